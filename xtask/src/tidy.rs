//! The tidy check (run by `cargo test -p xtask`, so by `cargo xtask test` and CI): the
//! workspace keeps one shape, and the lists that name its backends and metrics stay true.
//!
//! - the facade's table of backends (the `backends!` invocation in
//!   src/backends.rs, which `--help`, the configuration errors and the registries
//!   read) is the list of backends: each row's cargo feature is a feature of the facade, each
//!   row's crate `outbox_<crate>` is a crate `outbox-<crate>` of the row's kind, and
//!   every crate with a sink or a storage is registered by a row;
//! - every backend crate has the standard files: `src/lib.rs`, `README.md`, and the modules
//!   (each `src/<module>.rs` or `src/<module>/mod.rs`) `config`, `error` and either `sink`
//!   with `wire` (a sink) or `storage`, `admin`, `table`, `sql`, `rows`, `inbox` and
//!   `connection` (a storage, as docs/CONTRIBUTING-BACKENDS.md lays it out);
//! - each has its docs page (`docs/sinks/<crate>.md` or `docs/storage/<crate>.md`), and a
//!   sink's page has the standard sections;
//! - each is named in README.md, and so is every facade feature (README.md is where a user
//!   looks for what can be compiled in; docs/ARCHITECTURE.md describes the kinds of crate and
//!   points there);
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
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Sink,
    Storage,
}

impl Kind {
    fn noun(self) -> &'static str {
        match self {
            Kind::Sink => "sink",
            Kind::Storage => "storage",
        }
    }

    /// The modules (`src/<name>.rs` or `src/<name>/mod.rs`) every crate of this kind has,
    /// besides `lib.rs`.
    fn modules(self) -> &'static [&'static str] {
        match self {
            Kind::Sink => &["config", "sink", "wire", "error"],
            Kind::Storage => &[
                "config",
                "storage",
                "admin",
                "table",
                "sql",
                "rows",
                "inbox",
                "error",
                "connection",
            ],
        }
    }
}

/// A crate `outbox-<name>` of the workspace other than `outbox-core`: a backend, or a
/// library the backends share (which the binary's table does not name).
#[derive(Debug)]
struct Backend {
    /// `redis` for `outbox-redis`: the module of the facade (`outbox::redis`).
    name: String,
    dir: PathBuf,
    /// What its files say it is: a sink (`src/sink.rs`) or a storage (`src/storage.rs`),
    /// neither, or both (`None`).
    kind: Option<Kind>,
}

/// A row of the binary's table of backends (the `backends!` invocation in
/// src/backends.rs).
#[derive(Debug)]
struct Row {
    kind: Kind,
    /// Its type name in configuration.
    name: String,
    feature: String,
    /// `file` for a row registered by `outbox_file`; `None` for a row that
    /// another row's function registers.
    module: Option<String>,
}

const TABLE: &str = "src/backends.rs";

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_default()
}

/// Whether the crate at `dir` has module `name`, as a file or as a directory.
fn has_module(dir: &Path, name: &str) -> bool {
    dir.join(format!("src/{name}.rs")).is_file() || dir.join(format!("src/{name}/mod.rs")).is_file()
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
        let kind = match (has_module(&dir, "sink"), has_module(&dir, "storage")) {
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

/// `"text"` at the start of `line`: the text, and what follows the closing quote.
fn quoted(line: &str) -> Option<(&str, &str)> {
    let rest = line.strip_prefix('"')?;
    let end = rest.find('"')?;
    Some((&rest[..end], &rest[end + 1..]))
}

/// One row: `"type", feature "feature", "what it is", outbox_<module> as <module>;` (the
/// crate left out when another row's registers the type).
fn row(kind: Kind, line: &str) -> Option<Row> {
    let (name, rest) = quoted(line)?;
    let (feature, rest) = quoted(rest.strip_prefix(", feature ")?)?;
    let (_what, rest) = quoted(rest.strip_prefix(", ")?)?;
    let module = match rest.strip_suffix(';')? {
        "" => None,
        krate => {
            let (krate, module) = krate.strip_prefix(", ")?.split_once(" as ")?;
            (krate.strip_prefix("outbox_")? == module).then(|| module.to_string())
        }
    };
    Some(Row {
        kind,
        name: name.to_string(),
        feature: feature.to_string(),
        module,
    })
}

/// The rows of the `backends!` table in `text` (src/backends.rs), and the lines
/// of it that are not rows in the table's form.
fn table(text: &str) -> (Vec<Row>, Vec<String>) {
    let (mut rows, mut unread) = (Vec::new(), Vec::new());
    let Some(start) = text.find("\nbackends! {\n") else {
        return (rows, unread);
    };
    let mut kind = None;
    for line in text[start + 1..].lines().skip(1) {
        if line == "}" {
            break;
        }
        let line = line.trim();
        if line.starts_with("STORAGES,") {
            kind = Some(Kind::Storage);
        } else if line.starts_with("SINKS,") {
            kind = Some(Kind::Sink);
        } else if line.starts_with('"') {
            match kind.and_then(|kind| row(kind, line)) {
                Some(row) => rows.push(row),
                None => unread.push(line.to_string()),
            }
        }
    }
    (rows, unread)
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

/// The binary's table against the crates and the facade's features: every row's feature is
/// one of the facade's, every row's register function is of a crate of its kind, and every
/// sink or storage crate is registered by a row. Returns the backend crates with the kind
/// the table gives them (a crate no row names, with neither a sink nor a storage, is a
/// library the backends share, and is left out).
fn table_problems<'a>(
    root: &Path,
    crates: &'a [Backend],
    problems: &mut Vec<String>,
) -> Vec<(&'a Backend, Kind)> {
    let features = features(root);
    let (rows, unread) = table(&read(&root.join(TABLE)));
    if rows.is_empty() {
        problems.push(format!(
            "{TABLE} has no `backends!` table with rows, so --help, the configuration errors \
             and the registries know no backend"
        ));
    }
    for line in unread {
        problems.push(format!(
            "{TABLE}: `{line}` is not a row of the form `\"type\", feature \"feature\", \"what \
             it is\", outbox_<name> as <name>;`"
        ));
    }
    for row in &rows {
        if !features.contains(&row.feature) {
            problems.push(format!(
                "the facade (root Cargo.toml) has no cargo feature `{}`, which {TABLE} names for \
                 {} `{}`",
                row.feature,
                row.kind.noun(),
                row.name
            ));
        }
        let Some(module) = &row.module else {
            continue;
        };
        if !crates
            .iter()
            .any(|c| &c.name == module && c.kind == Some(row.kind))
        {
            problems.push(format!(
                "{TABLE} registers {} `{}` with outbox_{module}, but there is no {} crate \
                 outbox-{module}",
                row.kind.noun(),
                row.name,
                row.kind.noun()
            ));
        }
    }
    let mut found = Vec::new();
    for backend in crates {
        let registered = rows
            .iter()
            .find(|row| row.module.as_ref() == Some(&backend.name));
        match (backend.kind, registered) {
            (Some(kind), Some(_)) => found.push((backend, kind)),
            (Some(kind), None) => {
                problems.push(format!(
                    "{TABLE} has no row registering outbox-{} (a {}), so --help, the \
                     configuration errors and the registries do not know it",
                    backend.name,
                    kind.noun()
                ));
                found.push((backend, kind));
            }
            (None, Some(row)) => {
                problems.push(format!(
                    "outbox-{} has neither src/sink.rs nor src/storage.rs (or both): a backend \
                     crate holds its sink or its storage in the module of that name",
                    backend.name
                ));
                found.push((backend, row.kind));
            }
            (None, None) => {}
        }
    }
    found
}

/// Everything that is out of shape, one sentence each (empty when tidy).
fn problems(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let crates = backends(root);
    if !crates.iter().any(|c| c.kind.is_some()) {
        problems.push(format!(
            "no backend crates (outbox-*) found under {}",
            root.display()
        ));
    }
    let backends = table_problems(root, &crates, &mut problems);
    let features = features(root);
    let readme = read(&root.join("README.md"));
    for (backend, kind) in backends {
        let crate_name = format!("outbox-{}", backend.name);
        let noun = kind.noun();
        let modules = kind.modules();
        let listed = modules
            .iter()
            .map(|m| format!("{m}.rs"))
            .collect::<Vec<_>>()
            .join(", ");
        if !backend.dir.join("src/lib.rs").is_file() {
            problems.push(format!("{crate_name} lacks src/lib.rs"));
        }
        for module in modules {
            if !has_module(&backend.dir, module) {
                problems.push(format!(
                    "{crate_name} lacks src/{module}.rs (or src/{module}/mod.rs); every {noun} \
                     crate has lib.rs, {listed} and README.md (docs/CONTRIBUTING-BACKENDS.md)"
                ));
            }
        }
        if !backend.dir.join("README.md").is_file() {
            problems.push(format!(
                "{crate_name} lacks README.md, its rustdoc front page (docs/CONTRIBUTING-BACKENDS.md)"
            ));
        }
        let page = match kind {
            Kind::Sink => format!("docs/sinks/{}.md", backend.name),
            Kind::Storage => format!("docs/storage/{}.md", backend.name),
        };
        let page_text = read(&root.join(&page));
        if page_text.is_empty() {
            problems.push(format!("{crate_name} has no docs page: write {page}"));
        } else if kind == Kind::Sink {
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
        let ticked = format!("`{}`", backend.name);
        if !readme.contains(&ticked) && !readme.contains(&crate_name) {
            problems.push(format!("README.md does not name {crate_name}"));
        }
    }
    for feature in features.iter().filter(|f| *f != "default") {
        if !readme.contains(&format!("`{feature}`")) {
            problems.push(format!(
                "README.md does not name the facade feature `{feature}`"
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

    /// A scratch workspace under the temporary directory, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let root =
                std::env::temp_dir().join(format!("outbox-tidy-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&root);
            Scratch(root)
        }

        fn write(&self, path: &str, text: &str) {
            let path = self.0.join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[track_caller]
    fn assert_reported(found: &[String], expected: &[&str], not_expected: &[&str]) {
        for expected in expected {
            assert!(
                found.iter().any(|p| p.contains(expected)),
                "`{expected}` not reported; reported:\n- {}",
                found.join("\n- ")
            );
        }
        for not_expected in not_expected {
            assert!(
                !found.iter().any(|p| p.contains(not_expected)),
                "`{not_expected}` reported; reported:\n- {}",
                found.join("\n- ")
            );
        }
    }

    /// The check can fail: a copy of the workspace's shape with faults in it is caught.
    #[test]
    fn faults_are_reported() {
        let scratch = Scratch::new("faults");
        scratch.write(
            "Cargo.toml",
            "[features]\ndefault = [\"cli\"]\ncli = []\nmqtt = []\n",
        );
        scratch.write("outbox-mqtt/Cargo.toml", "");
        scratch.write("outbox-mqtt/src/lib.rs", "");
        scratch.write("outbox-mqtt/src/sink.rs", "");
        scratch.write("outbox-mqtt/src/config.rs", "");
        scratch.write(
            "docs/sinks/mqtt.md",
            "# MQTT\n\n## Configuration\n\n## Guarantees\n",
        );
        scratch.write(
            "docs/configuration.md",
            "| `outbox_sent_total` | relay, topic | sent |\n| `outbox_late_total` | relay | late |\n",
        );
        scratch.write("README.md", "features `cli`");
        scratch.write(TABLE, "");
        scratch.write(
            "outbox-core/src/metrics.rs",
            "/// Counter (relay, topic): sent.\npub const SENT: &str = \"outbox_sent_total\";\n\
             /// Counter (relay): lost.\npub const LOST: &str = \"outbox_lost_total\";\n\
             /// Counter (relay, topic): late.\npub const LATE: &str = \"outbox_late_total\";\n",
        );
        scratch.write(
            "outbox-core/src/worker.rs",
            "metrics::counter!(\"outbox_x\").increment(1);",
        );
        assert_reported(
            &problems(&scratch.0),
            &[
                "outbox-mqtt lacks src/error.rs",
                "outbox-mqtt lacks src/wire.rs",
                "outbox-mqtt lacks README.md",
                "docs/sinks/mqtt.md lacks the section `## Layout on the wire`",
                "docs/sinks/mqtt.md lacks the section `## Error mapping`",
                "src/backends.rs has no `backends!` table",
                "src/backends.rs has no row registering outbox-mqtt (a sink)",
                "README.md does not name outbox-mqtt",
                "README.md does not name the facade feature `mqtt`",
                "metric `outbox_lost_total` is not documented",
                "metric `outbox_late_total` has labels [\"relay\", \"topic\"] in outbox-core/src/metrics.rs but [\"relay\"] in docs/configuration.md",
                "outbox-core/src/worker.rs records a metric under a string literal",
            ],
            &["outbox_sent_total", "outbox-mqtt lacks src/sink.rs"],
        );
    }

    /// The table is read row by row, and a storage crate lacking one of the storage modules
    /// is caught (a module may be a file or a directory); a crate that is neither a sink nor
    /// a storage and that no row names is a shared library, and is left alone.
    #[test]
    fn table_and_storage_faults_are_reported() {
        let scratch = Scratch::new("storage");
        scratch.write(
            "Cargo.toml",
            "[features]\ndefault = [\"cli\"]\ncli = []\nduck = []\nmqtt = []\n",
        );
        scratch.write(
            TABLE,
            "use crate::{SinkRegistry, StorageRegistry};\n\n\
             backends! {\n    \
                 /// Storages.\n    \
                 STORAGES, StorageRegistry, register_storages {\n        \
                     \"duck\", feature \"duck\", \"DuckDB, files\", outbox_duck as duck;\n        \
                     \"ghost\", feature \"ghost\", \"Nothing\", outbox_ghost as ghost;\n    \
                 }\n    \
                 SINKS, SinkRegistry, register_sinks {\n        \
                     \"mqtt-v3\", feature \"mqtt\", \"MQTT 3.1\";\n        \
                     \"bad\" feature \"x\";\n    \
                 }\n\
             }\n",
        );
        for file in [
            "Cargo.toml",
            "README.md",
            "src/lib.rs",
            "src/config.rs",
            "src/error.rs",
            "src/storage/mod.rs",
            "src/admin/mod.rs",
            "src/inbox.rs",
            "src/connection.rs",
        ] {
            scratch.write(&format!("outbox-duck/{file}"), "");
        }
        scratch.write("outbox-shared/Cargo.toml", "");
        scratch.write("outbox-shared/src/lib.rs", "");
        scratch.write("docs/storage/duck.md", "# DuckDB\n");
        scratch.write("README.md", "`cli`, `duck`, `mqtt`: outbox-duck");
        let found = problems(&scratch.0);
        let (rows, _) = table(&read(&scratch.0.join(TABLE)));
        let read_rows: Vec<_> = rows
            .iter()
            .map(|r| {
                (
                    r.kind,
                    r.name.as_str(),
                    r.feature.as_str(),
                    r.module.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            read_rows,
            [
                (Kind::Storage, "duck", "duck", Some("duck")),
                (Kind::Storage, "ghost", "ghost", Some("ghost")),
                (Kind::Sink, "mqtt-v3", "mqtt", None),
            ]
        );
        assert_reported(
            &found,
            &[
                "outbox-duck lacks src/rows.rs (or src/rows/mod.rs); every storage crate has \
                 lib.rs, config.rs, storage.rs, admin.rs, table.rs, sql.rs, rows.rs, inbox.rs, \
                 error.rs, connection.rs and README.md",
                "outbox-duck lacks src/sql.rs",
                "outbox-duck lacks src/table.rs",
                "the facade (root Cargo.toml) has no cargo feature `ghost`, which \
                 src/backends.rs names for storage `ghost`",
                "src/backends.rs registers storage `ghost` with outbox_ghost, but there is no \
                 storage crate outbox-ghost",
                "src/backends.rs: `\"bad\" feature \"x\";` is not a row",
            ],
            &[
                "outbox-duck lacks src/storage.rs",
                "outbox-duck lacks src/admin.rs",
                "outbox-duck lacks src/inbox.rs",
                "outbox-duck lacks src/connection.rs",
                "outbox-duck lacks README.md",
                "outbox-shared",
                "mqtt-v3",
                "no `backends!` table",
                "README.md does not name",
            ],
        );
    }
}
