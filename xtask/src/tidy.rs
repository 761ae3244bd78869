//! The tidy check (run by `cargo test -p xtask`, so by `cargo xtask test` and CI): the
//! workspace keeps one shape, and the lists that name its backends and metrics stay true.
//!
//! - every backend crate (`outbox-<type>`, other than `outbox-core`) has the standard files:
//!   `src/lib.rs`, `src/config.rs`, `src/error.rs`, `README.md`, and either `src/sink.rs` with
//!   `src/wire.rs` (a sink) or `src/storage.rs` (a storage);
//! - each has its docs page (`docs/sinks/<type>.md` or `docs/storage/<type>.md`), and a sink's
//!   page has the standard sections;
//! - each type is a cargo feature of the facade and is named in the binary's list of backends
//!   (which `--help` prints), in README.md and in docs/ARCHITECTURE.md, and every facade
//!   feature is named in docs/ARCHITECTURE.md;
//! - every metric name of `outbox_core::metrics` is documented in docs/configuration.md, and
//!   no code records a metric under a string literal instead of those constants.

use std::fs;
use std::path::{Path, PathBuf};

/// The sections every docs/sinks page has, in this order.
const SINK_PAGE_SECTIONS: [&str; 5] = [
    "## Configuration",
    "## Layout on the wire",
    "## Guarantees",
    "## Error mapping",
    "## How to consume",
];

/// What a backend crate is.
#[derive(Debug, PartialEq)]
enum Kind {
    Sink,
    Storage,
}

/// A backend crate of the workspace.
#[derive(Debug)]
struct Backend {
    /// `redis` for `outbox-redis`: the type name in configuration and the cargo feature.
    name: String,
    dir: PathBuf,
    kind: Option<Kind>,
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_default()
}

fn backends(root: &Path) -> Vec<Backend> {
    let mut found = Vec::new();
    let Ok(entries) = fs::read_dir(root) else {
        return found;
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        let file_name = entry.file_name().to_string_lossy().to_string();
        let Some(name) = file_name.strip_prefix("outbox-") else {
            continue;
        };
        if name == "core" || !dir.join("Cargo.toml").is_file() {
            continue;
        }
        let kind = match (
            dir.join("src/sink.rs").is_file(),
            dir.join("src/storage.rs").is_file(),
        ) {
            (true, false) => Some(Kind::Sink),
            (false, true) => Some(Kind::Storage),
            _ => None,
        };
        found.push(Backend {
            name: name.to_string(),
            dir,
            kind,
        });
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    found
}

/// The facade's cargo features (the `[features]` table of the root Cargo.toml).
fn features(root: &Path) -> Vec<String> {
    let manifest = read(&root.join("Cargo.toml"));
    let mut in_features = false;
    let mut names = Vec::new();
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_features = line == "[features]";
            continue;
        }
        if !in_features {
            continue;
        }
        if let Some((name, _)) = line.split_once('=') {
            let name = name.trim();
            if !name.is_empty() && !name.starts_with('#') {
                names.push(name.to_string());
            }
        }
    }
    names
}

/// Everything that is out of shape, one sentence each (empty when tidy).
fn problems(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let backends = backends(root);
    if backends.is_empty() {
        problems.push(format!(
            "no backend crates (outbox-*) found under {}",
            root.display()
        ));
    }
    let features = features(root);
    let backend_list = read(&root.join("src/bin/outbox/backends.rs"));
    let readme = read(&root.join("README.md"));
    let architecture = read(&root.join("docs/ARCHITECTURE.md"));
    for backend in &backends {
        let crate_name = format!("outbox-{}", backend.name);
        let mut standard = vec!["src/lib.rs", "src/config.rs", "src/error.rs", "README.md"];
        let page = match backend.kind {
            Some(Kind::Sink) => {
                standard.push("src/wire.rs");
                format!("docs/sinks/{}.md", backend.name)
            }
            Some(Kind::Storage) => format!("docs/storage/{}.md", backend.name),
            None => {
                problems.push(format!(
                    "{crate_name} has neither src/sink.rs nor src/storage.rs (or both): a backend \
                     crate holds its sink or its storage in the file of that name"
                ));
                continue;
            }
        };
        for file in standard {
            if !backend.dir.join(file).is_file() {
                problems.push(format!(
                    "{crate_name} lacks {file}; every backend crate has lib.rs, config.rs, the \
                     sink or storage, error.rs and README.md (docs/CONTRIBUTING-BACKENDS.md)"
                ));
            }
        }
        let page_text = read(&root.join(&page));
        if page_text.is_empty() {
            problems.push(format!("{crate_name} has no docs page: write {page}"));
        } else if backend.kind == Some(Kind::Sink) {
            let mut from = 0;
            for section in SINK_PAGE_SECTIONS {
                match page_text[from..].find(&format!("\n{section}\n")) {
                    Some(at) => from += at + section.len(),
                    None => problems.push(format!(
                        "{page} lacks the section `{section}` (or has it out of order); every \
                         sink page has: {}",
                        SINK_PAGE_SECTIONS.join(", ")
                    )),
                }
            }
        }
        let quoted = format!("\"{}\"", backend.name);
        let ticked = format!("`{}`", backend.name);
        if !features.contains(&backend.name) {
            problems.push(format!(
                "the facade (root Cargo.toml) has no cargo feature `{}` for {crate_name}",
                backend.name
            ));
        }
        if !backend_list.contains(&format!("({quoted}, ")) {
            problems.push(format!(
                "src/bin/outbox/backends.rs does not list {quoted} in STORAGES or SINKS, so --help \
                 and the configuration errors do not name it"
            ));
        }
        if !readme.contains(&ticked) && !readme.contains(&crate_name) {
            problems.push(format!("README.md does not name {crate_name}"));
        }
        if !architecture.contains(&crate_name) {
            problems.push(format!("docs/ARCHITECTURE.md does not name {crate_name}"));
        }
    }
    for feature in features.iter().filter(|f| *f != "default") {
        if !architecture.contains(&format!("`{feature}`"))
            && !architecture.contains(&format!(" {feature},"))
            && !architecture.contains(&format!(" {feature})"))
        {
            problems.push(format!(
                "docs/ARCHITECTURE.md does not name the facade feature `{feature}`"
            ));
        }
    }
    problems.extend(metric_problems(root));
    problems
}

/// Metric names come from `outbox_core::metrics` and are all documented.
fn metric_problems(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let names_file = read(&root.join("outbox-core/src/metrics.rs"));
    let documented = read(&root.join("docs/configuration.md"));
    let names: Vec<&str> = names_file
        .lines()
        .filter_map(|line| line.trim().strip_prefix("pub const "))
        .filter_map(|rest| rest.split_once("= \"outbox_"))
        .filter_map(|(_, rest)| rest.split_once('"'))
        .map(|(name, _)| name)
        .collect();
    if names.is_empty() {
        problems.push("outbox-core/src/metrics.rs defines no metric names".to_string());
    }
    for name in names {
        if !documented.contains(&format!("`outbox_{name}`")) {
            problems.push(format!(
                "metric `outbox_{name}` is not documented in docs/configuration.md"
            ));
        }
    }
    problems.extend(label_problems(&names_file, &documented));
    let mut sources = Vec::new();
    collect_rust_files(root, &mut sources);
    for path in sources {
        let text = read(&path);
        for macro_name in ["counter!(\"", "gauge!(\"", "histogram!(\""] {
            if text.contains(macro_name) {
                problems.push(format!(
                    "{} records a metric under a string literal ({macro_name}…); use the names \
                     in outbox_core::metrics",
                    path.strip_prefix(root).unwrap_or(&path).display()
                ));
            }
        }
    }
    problems
}

/// Each metric's labels, as `outbox_core::metrics` declares them in its doc comment
/// (`/// Counter (relay, topic): …`), must be the labels docs/configuration.md lists in its
/// row, so dashboards built from the docs match the series.
fn label_problems(names_file: &str, documented: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut declared: Option<Vec<String>> = None;
    for line in names_file.lines().map(str::trim) {
        if let Some(kind) = ["/// Counter (", "/// Gauge (", "/// Histogram ("]
            .iter()
            .find_map(|kind| line.strip_prefix(kind))
        {
            declared = kind.split_once(')').map(|(labels, _)| label_set(labels));
            continue;
        }
        let Some((_, rest)) = line
            .strip_prefix("pub const ")
            .and_then(|rest| rest.split_once("= \"outbox_"))
        else {
            continue;
        };
        let Some((name, _)) = rest.split_once('"') else {
            continue;
        };
        let Some(labels) = declared.take() else {
            problems.push(format!(
                "metric `outbox_{name}`: its doc comment in outbox-core/src/metrics.rs does not say its kind and labels (`/// Counter (relay, topic): …`)"
            ));
            continue;
        };
        let row = documented
            .lines()
            .find(|row| row.starts_with('|') && row.contains(&format!("`outbox_{name}`")));
        let listed = row.and_then(|row| row.split('|').nth(2)).map(label_set);
        if let Some(listed) = listed
            && listed != labels
        {
            problems.push(format!(
                "metric `outbox_{name}` has labels {labels:?} in outbox-core/src/metrics.rs but {listed:?} in docs/configuration.md"
            ));
        }
    }
    problems
}

/// `relay, topic` as a sorted list of label names.
fn label_set(text: &str) -> Vec<String> {
    let mut labels: Vec<String> = text
        .split(',')
        .map(|label| label.trim().to_string())
        .filter(|label| !label.is_empty())
        .collect();
    labels.sort();
    labels
}

fn collect_rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name.to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            collect_rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workspace() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("xtask sits in the workspace")
            .to_path_buf()
    }

    #[test]
    fn the_workspace_is_tidy() {
        let root = workspace();
        let found = backends(&root);
        assert!(
            found.iter().any(|b| b.kind == Some(Kind::Sink))
                && found.iter().any(|b| b.kind == Some(Kind::Storage)),
            "found no sink or no storage crate: {found:?}"
        );
        let problems = problems(&root);
        assert!(problems.is_empty(), "tidy:\n- {}", problems.join("\n- "));
    }

    /// The check can fail: a copy of the workspace's shape with faults in it is caught.
    #[test]
    fn faults_are_reported() {
        let root = std::env::temp_dir().join(format!("outbox-tidy-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let write = |path: &str, text: &str| {
            let path = root.join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        };
        write(
            "Cargo.toml",
            "[features]\ndefault = [\"cli\"]\ncli = []\nmqtt = []\n",
        );
        write("outbox-mqtt/Cargo.toml", "");
        write("outbox-mqtt/src/lib.rs", "");
        write("outbox-mqtt/src/sink.rs", "");
        write("outbox-mqtt/src/config.rs", "");
        write(
            "docs/sinks/mqtt.md",
            "# MQTT\n\n## Configuration\n\n## Guarantees\n",
        );
        write("docs/ARCHITECTURE.md", "features `cli`");
        write(
            "docs/configuration.md",
            "| `outbox_sent_total` | relay, topic | sent |\n| `outbox_late_total` | relay | late |\n",
        );
        write("README.md", "");
        write("src/bin/outbox/backends.rs", "");
        write(
            "outbox-core/src/metrics.rs",
            "/// Counter (relay, topic): sent.\npub const SENT: &str = \"outbox_sent_total\";\n\
             /// Counter (relay): lost.\npub const LOST: &str = \"outbox_lost_total\";\n\
             /// Counter (relay, topic): late.\npub const LATE: &str = \"outbox_late_total\";\n",
        );
        write(
            "outbox-core/src/worker.rs",
            "metrics::counter!(\"outbox_x\").increment(1);",
        );
        let found = problems(&root);
        fs::remove_dir_all(&root).unwrap();
        for expected in [
            "outbox-mqtt lacks src/error.rs",
            "outbox-mqtt lacks src/wire.rs",
            "outbox-mqtt lacks README.md",
            "docs/sinks/mqtt.md lacks the section `## Layout on the wire`",
            "docs/sinks/mqtt.md lacks the section `## Error mapping`",
            "src/bin/outbox/backends.rs does not list \"mqtt\"",
            "README.md does not name outbox-mqtt",
            "docs/ARCHITECTURE.md does not name outbox-mqtt",
            "docs/ARCHITECTURE.md does not name the facade feature `mqtt`",
            "metric `outbox_lost_total` is not documented",
            "metric `outbox_late_total` has labels [\"relay\", \"topic\"] in outbox-core/src/metrics.rs but [\"relay\"] in docs/configuration.md",
            "outbox-core/src/worker.rs records a metric under a string literal",
        ] {
            assert!(
                found.iter().any(|p| p.contains(expected)),
                "`{expected}` not reported; reported:\n- {}",
                found.join("\n- ")
            );
        }
        assert!(
            !found.iter().any(|p| p.contains("outbox_sent_total")),
            "a documented metric was reported: {found:?}"
        );
    }
}
