//! Results: the terminal table, `target/bench/results.json`, and the generated part of
//! BENCHMARKS.md with its plot `bench/drain.svg`.

use std::fmt::Write as _;
use std::time::Instant;

use serde_json::json;

use crate::Scale;

/// CPU time and peak memory of this process over a drain.
#[derive(Debug, Clone, Copy)]
pub struct Resources {
    pub cpu_ms_per_1000: f64,
    pub peak_rss_mb: f64,
}

/// CPU ticks (user + system) of this process so far.
fn cpu_ticks() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let after = s.rsplit_once(')')?.1.split_whitespace().collect::<Vec<_>>();
            Some(after.get(11)?.parse::<u64>().ok()? + after.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}

fn peak_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// A measurement in progress.
pub struct ResourceMeter {
    ticks: u64,
}

impl Resources {
    /// Starts measuring: resets the peak resident size (Linux `clear_refs`).
    pub fn start() -> ResourceMeter {
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        ResourceMeter { ticks: cpu_ticks() }
    }
}

impl ResourceMeter {
    pub fn finish(self, messages: u64) -> Resources {
        // Kernel clock ticks are 1/100 s on Linux.
        let cpu_ms = (cpu_ticks() - self.ticks) as f64 * 10.0;
        Resources {
            cpu_ms_per_1000: cpu_ms / messages.max(1) as f64 * 1000.0,
            peak_rss_mb: peak_rss_kb() as f64 / 1024.0,
        }
    }
}

struct Row {
    section: String,
    name: String,
    value: f64,
    unit: String,
    ratio: Option<(String, f64)>,
}

struct PlotPoint {
    sink: String,
    relays: usize,
    per_key_order: bool,
    rate: f64,
}

pub struct Report {
    pub machine: String,
    scale: Scale,
    rows: Vec<Row>,
    pub resources: Option<Resources>,
    plot: Vec<PlotPoint>,
    ceilings: Option<(f64, f64, f64)>,
    started: Instant,
    /// The arguments the benchmark ran with, for the generated text.
    pub args: String,
}

/// Sections whose rows go to the log-mode block of BENCHMARKS.md, not the main table.
fn log_block(section: &str) -> bool {
    section.starts_with("log")
}

impl Report {
    pub fn new(scale: Scale) -> Self {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|s| s.trim().to_string())
            })
            .unwrap_or_else(|| "unknown CPU".into());
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0);
        let memory = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .next()
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|k| k.parse::<u64>().ok())
            })
            .map(|kb| format!("{:.0} GiB", kb as f64 / 1024.0 / 1024.0))
            .unwrap_or_default();
        Report {
            machine: format!(
                "machine: {cpu}, {cores} cores, {memory}; PostgreSQL, Redis, RabbitMQ, Kafka (tansu) on localhost; {} run",
                if scale.quick { "quick" } else { "full" }
            ),
            scale,
            rows: Vec::new(),
            resources: None,
            plot: Vec::new(),
            ceilings: None,
            started: Instant::now(),
            args: String::new(),
        }
    }

    /// Records and prints a figure, with its ratio to `baseline` when given.
    pub fn add(
        &mut self,
        section: &str,
        name: &str,
        value: f64,
        unit: &str,
        baseline: Option<(&str, f64)>,
    ) {
        let ratio = baseline.map(|(b, v)| (b.to_string(), value / v));
        match &ratio {
            Some((b, r)) => {
                println!("{section:<8} {name:<52} {value:>12.1} {unit:<9} {r:>6.2}× {b}")
            }
            None => println!("{section:<8} {name:<52} {value:>12.1} {unit}"),
        }
        self.rows.push(Row {
            section: section.into(),
            name: name.into(),
            value,
            unit: unit.into(),
            ratio,
        });
    }

    /// Records and prints a database's ceiling, a bare loop of `statement` in rows/s (the
    /// baseline its drains are read against).
    pub fn add_bare_ceiling(&mut self, section: &str, statement: &str, rows_per_second: f64) {
        let name = format!("ceiling: bare {statement} loop");
        self.add(section, &name, rows_per_second, "rows/s", None);
    }

    /// Records and prints a ratio on its own.
    pub fn add_ratio(&mut self, section: &str, name: &str, ratio: f64) {
        self.add(section, name, ratio, "×", None);
    }

    #[allow(clippy::too_many_arguments)]
    pub fn plot(
        &mut self,
        sink: &str,
        relays: usize,
        per_key_order: bool,
        rate: f64,
        bare: f64,
        sink_ceiling: f64,
        naive: f64,
    ) {
        self.ceilings = Some((bare, sink_ceiling, naive));
        self.plot.push(PlotPoint {
            sink: sink.into(),
            relays,
            per_key_order,
            rate,
        });
    }

    pub fn write(&self) -> Result<(), String> {
        if let Some(r) = self.resources {
            println!(
                "resources: {:.1} ms CPU per 1,000 messages, peak resident memory {:.1} MB",
                r.cpu_ms_per_1000, r.peak_rss_mb
            );
        }
        println!(
            "benchmark took {:.0} s",
            self.started.elapsed().as_secs_f64()
        );
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let json = json!({
            "machine": self.machine,
            "quick": self.scale.quick,
            "results": self.rows.iter().map(|r| json!({
                "section": r.section, "name": r.name, "value": r.value, "unit": r.unit,
                "baseline": r.ratio.as_ref().map(|(b, _)| b.clone()),
                "ratio": r.ratio.as_ref().map(|(_, v)| *v),
            })).collect::<Vec<_>>(),
            "resources": self.resources.map(|r| json!({"cpu_ms_per_1000": r.cpu_ms_per_1000, "peak_rss_mb": r.peak_rss_mb})),
        });
        let dir = root.join("target").join("bench");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        std::fs::write(
            dir.join("results.json"),
            serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?,
        )
        .map_err(|e| e.to_string())?;
        if self.scale.quick {
            println!(
                "quick run: results in target/bench/results.json; BENCHMARKS.md left as it is"
            );
            return Ok(());
        }
        if !self.plot.is_empty() {
            std::fs::write(root.join("bench").join("drain.svg"), self.svg())
                .map_err(|e| e.to_string())?;
        }
        self.update_markdown(&root.join("BENCHMARKS.md"))
    }

    fn table(&self, log: bool) -> String {
        let mut out = String::new();
        if log {
            let date = std::process::Command::new("date")
                .args(["-u", "+%Y-%m-%d %H:%M UTC"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "{date}, `cargo xtask bench {}`; {}\n",
                self.args, self.machine
            );
        } else {
            let _ = writeln!(out, "{}\n", self.machine);
        }
        let _ = writeln!(
            out,
            "| section | measurement | value | unit | ratio |\n|---|---|---:|---|---|"
        );
        for r in self.rows.iter().filter(|r| log_block(&r.section) == log) {
            let ratio = r
                .ratio
                .as_ref()
                .map(|(b, v)| format!("{v:.2}× {b}"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "| {} | {} | {:.1} | {} | {} |",
                r.section, r.name, r.value, r.unit, ratio
            );
        }
        if let Some(r) = self.resources.filter(|_| !log) {
            let _ = writeln!(
                out,
                "\nOne relay → Redis, key order on: {:.1} ms CPU per 1,000 messages; peak resident memory {:.1} MB (the bench process: relay plus an idle harness).",
                r.cpu_ms_per_1000, r.peak_rss_mb
            );
        }
        if !self.plot.is_empty() && !log {
            let _ = writeln!(
                out,
                "\n![drain rate per sink against its ceilings](bench/drain.svg)"
            );
        }
        out
    }

    /// Replaces the generated parts of BENCHMARKS.md that this run measured (the main table,
    /// the log-mode table), keeping the hand-written analysis and the other part.
    fn update_markdown(&self, path: &std::path::Path) -> Result<(), String> {
        let mut text = std::fs::read_to_string(path).unwrap_or_else(|_| {
            "# Benchmarks\n\n<!-- bench:start -->\n<!-- bench:end -->\n\n<!-- bench:log:start -->\n<!-- bench:log:end -->\n".into()
        });
        for (log, marker) in [(false, "bench"), (true, "bench:log")] {
            if !self.rows.iter().any(|r| log_block(&r.section) == log) {
                continue;
            }
            let (start, end) = (
                format!("<!-- {marker}:start -->"),
                format!("<!-- {marker}:end -->"),
            );
            let (before, rest) = text
                .split_once(&start)
                .ok_or(format!("BENCHMARKS.md lacks the {start} marker"))?;
            let (previous, after) = rest
                .split_once(&end)
                .ok_or(format!("BENCHMARKS.md lacks the {end} marker"))?;
            let mut block = self.table(log);
            if log {
                block.push_str(&self.kept_rows(previous));
            }
            text = format!("{before}{start}\n{block}{end}{after}");
        }
        std::fs::write(path, text).map_err(|e| e.to_string())
    }

    /// The rows of the log-mode parts this run did not measure (a run of one part, such as
    /// `log-drain`), from the `previous` table, each group under the line that says which
    /// run measured it: a part's run replaces its own rows only.
    fn kept_rows(&self, previous: &str) -> String {
        let measured: std::collections::HashSet<&str> =
            self.rows.iter().map(|r| r.section.as_str()).collect();
        fn section(line: &str) -> &str {
            line.split('|').nth(1).map(str::trim).unwrap_or_default()
        }
        // (which run, its rows), in the order found.
        let mut groups: Vec<(&str, Vec<&str>)> = Vec::new();
        let mut when = "an earlier run";
        for line in previous.lines() {
            if let Some(run) = line.strip_prefix("Kept from ") {
                when = run.trim_end_matches(':');
            } else if line.contains("`cargo xtask bench") && !line.starts_with('|') {
                when = line;
            } else if line.starts_with("| log") && !measured.contains(section(line)) {
                match groups.last_mut() {
                    Some((w, rows)) if *w == when => rows.push(line),
                    _ => groups.push((when, vec![line])),
                }
            }
        }
        let mut out = String::new();
        for (when, rows) in groups {
            let _ = write!(
                out,
                "\nKept from {when}:\n\n| section | measurement | value | unit | ratio |\n|---|---|---:|---|---|\n"
            );
            for row in rows {
                out.push_str(row);
                out.push('\n');
            }
        }
        out
    }

    /// Bars of the drain rates per sink and relay count, with the ceilings as lines.
    fn svg(&self) -> String {
        let (bare, sink_ceiling, naive) = self.ceilings.unwrap_or((1.0, 1.0, 1.0));
        let max = self
            .plot
            .iter()
            .map(|p| p.rate)
            .fold(bare.max(sink_ceiling).max(naive), f64::max)
            * 1.1;
        let (w, h, left, bottom) = (900.0, 420.0, 70.0, 110.0);
        let plot_h = h - bottom - 20.0;
        let bar_w = (w - left - 20.0) / self.plot.len().max(1) as f64;
        let y = |v: f64| 20.0 + plot_h * (1.0 - v / max);
        let mut svg = format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">"#
        );
        let _ = write!(svg, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        for (i, p) in self.plot.iter().enumerate() {
            let x = left + i as f64 * bar_w;
            let colour = if p.per_key_order {
                "#3b6ea5"
            } else {
                "#8fb3d9"
            };
            let _ = write!(
                svg,
                r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{colour}"/>"#,
                x + 4.0,
                y(p.rate),
                bar_w - 8.0,
                plot_h + 20.0 - y(p.rate)
            );
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" transform="rotate(60 {:.1} {:.1})">{} ×{} {}</text>"#,
                x + bar_w / 2.0,
                h - bottom + 14.0,
                x + bar_w / 2.0,
                h - bottom + 14.0,
                p.sink,
                p.relays,
                if p.per_key_order {
                    "ordered"
                } else {
                    "unordered"
                }
            );
        }
        for (value, label, colour) in [
            (bare, "bare DELETE ceiling", "#c0392b"),
            (sink_ceiling, "Redis publish ceiling", "#27ae60"),
            (naive, "naive relay", "#7f8c8d"),
        ] {
            let _ = write!(
                svg,
                r#"<line x1="{left}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="{colour}" stroke-dasharray="6 3"/><text x="{}" y="{:.1}" fill="{colour}">{label} {value:.0}/s</text>"#,
                w - 20.0,
                y(value),
                y(value),
                left + 5.0,
                y(value) - 3.0
            );
        }
        let _ = write!(
            svg,
            r#"<line x1="{left}" x2="{left}" y1="20" y2="{:.1}" stroke="black"/><text x="5" y="15">events/s (max {max:.0})</text></svg>"#,
            plot_h + 20.0
        );
        svg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of one part replaces that part's rows and keeps the others', each group under
    /// the run that measured it, through several part runs.
    #[test]
    fn a_part_run_keeps_the_other_parts_rows_with_their_run() {
        let previous = "2026-12-01 19:46 UTC, `cargo xtask bench log`; machine\n\n\
            | section | measurement | value | unit | ratio |\n|---|---|---:|---|---|\n\
            | log drain | old drain | 1.0 | rows/s |  |\n\
            | log enqueue | writers | 2.0 | commits/s |  |\n\
            \nKept from 2026-11-30 10:00 UTC, `cargo xtask bench log`; machine:\n\n\
            | section | measurement | value | unit | ratio |\n|---|---|---:|---|---|\n\
            | log latency | p99 | 3.0 | ms |  |\n";
        let mut report = Report::new(crate::Scale::new(true));
        report.add("log drain", "new drain", 4.0, "rows/s", None);
        let kept = report.kept_rows(previous);
        assert!(!kept.contains("old drain"), "{kept}");
        let enqueue = kept.find("| log enqueue").expect("enqueue kept");
        let latency = kept.find("| log latency").expect("latency kept");
        let first = kept
            .find("Kept from 2026-12-01 19:46")
            .expect("its run named");
        let second = kept
            .find("Kept from 2026-11-30 10:00")
            .expect("its run named");
        assert!(
            first < enqueue && enqueue < second && second < latency,
            "{kept}"
        );
    }
}
