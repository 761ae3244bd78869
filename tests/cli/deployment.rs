//! The deployment recipes (Dockerfile, docker-compose.yml, deploy/outbox.service) hold
//! together with the workspace. No container engine runs here, so the Dockerfile's build line
//! is checked rather than run (`cargo xtask container-build` runs it as is); the settings the
//! recipes give the relay are checked by the binary's own configuration parsing.

use std::path::Path;

use super::{ConfigFile, said, text};

fn repo_file(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The one `cargo build` line of the Dockerfile.
fn dockerfile_build_line() -> String {
    let dockerfile = repo_file("Dockerfile");
    let builds: Vec<&str> = dockerfile
        .lines()
        .filter_map(|line| line.trim().strip_prefix("RUN "))
        .filter(|command| command.contains("cargo build"))
        .collect();
    assert_eq!(builds.len(), 1, "the Dockerfile builds once: {builds:?}");
    builds[0].to_string()
}

#[test]
fn the_dockerfile_builds_the_binary_from_the_locked_workspace() {
    let build = dockerfile_build_line();
    for flag in ["--release", "--locked", "--all-features", "--bin outbox"] {
        assert!(build.contains(flag), "`{build}` lacks {flag}");
    }
    // `--locked` fails the image build when Cargo.lock is stale; .ci/run checks that it is
    // current before cargo touches it (a test is too late: `cargo test` rewrites it first).
    let ci = repo_file(".ci/run");
    assert!(ci.contains("cargo metadata --locked"), "{ci}");
    let dockerfile = repo_file("Dockerfile");
    assert!(dockerfile.contains("COPY --from=build /src/target/release/outbox "));
    assert!(
        dockerfile.contains("USER 10001"),
        "the image runs as a non-root user"
    );
}

/// The environment a recipe sets, as `NAME=value` pairs, from lines `NAME: value` (compose)
/// or `Environment=NAME=value` (systemd).
fn outbox_variables(recipe: &str) -> Vec<(String, String)> {
    recipe
        .lines()
        .map(str::trim)
        .filter_map(|line| {
            let line = line.strip_prefix("Environment=").unwrap_or(line);
            let (name, value) = line.split_once([':', '='])?;
            name.starts_with("OUTBOX_")
                .then(|| (name.to_string(), value.trim().to_string()))
        })
        .collect()
}

#[test]
fn the_compose_file_and_the_service_unit_give_settings_the_relay_takes() {
    let compose = repo_file("docker-compose.yml");
    assert!(compose.contains("./examples/redis.toml:/etc/outbox/outbox.toml:ro"));
    let variables = outbox_variables(&compose);
    assert_eq!(variables.len(), 3, "{variables:?}");
    // The compose file's configuration with its environment, parsed by the binary: `check`
    // gets past the configuration and fails only on reaching hosts named `postgres`.
    let config = ConfigFile::new(&repo_file("examples/redis.toml"));
    let out = super::outbox_command(&config.path)
        .arg("check")
        .envs(variables.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("OUTBOX_STORAGE__CONNECT_TIMEOUT", "1s")
        .output()
        .expect("run the outbox binary");
    let stderr = text(&out.stderr);
    assert_ne!(
        out.status.code(),
        Some(78),
        "a configuration error: {stderr}"
    );
    assert!(!stderr.contains("ignored OUTBOX_"), "{stderr}");

    let unit = repo_file("deploy/outbox.service");
    assert!(
        unit.contains("ExecStart=/usr/local/bin/outbox --config /etc/outbox/outbox.toml relay")
    );
    assert!(unit.contains("RestartPreventExitStatus=78"));
    let variables = outbox_variables(&unit);
    assert_eq!(
        variables,
        [(
            "OUTBOX_STORAGE__URL__FILE".to_string(),
            "%d/db_url".to_string()
        )]
    );
    // That variable, with a credentials directory in place of `%d`, gives the storage URL.
    let dir = std::env::temp_dir().join(outbox_tests::unique_name("outbox_credentials"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("db_url"), "postgres://postgres@127.0.0.1:1/test\n").expect("write");
    let out = super::outbox_command(&config.path)
        .arg("check")
        .env("OUTBOX_STORAGE__URL__FILE", dir.join("db_url"))
        .env("OUTBOX_STORAGE__CONNECT_TIMEOUT", "1s")
        .output()
        .expect("run the outbox binary");
    let (code, printed) = said(&out);
    assert_ne!(code, Some(78), "a configuration error: {printed}");
    assert!(
        printed.contains("127.0.0.1:1/"),
        "the URL from the file was not used: {printed}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
