//! The relay's configuration: read and validated by [`outbox::cli::config`] (in the library,
//! where the fuzz targets and tests reach it), with the storages and sinks of this build.

use outbox::cli::config::Backends;
pub use outbox::cli::config::{Config, ConfigError, LogFormat, Observability, RelayDef};

/// Reads, overrides from the environment and validates the configuration in `path`.
pub fn load(path: &std::path::Path) -> Result<Config, ConfigError> {
    outbox::cli::config::load(path, &backends())
}

/// This build's backends, as the configuration refers to them.
fn backends() -> Backends {
    Backends {
        default_storage: outbox::backends::DEFAULT_STORAGE.to_string(),
        sink_types: (outbox::backends::sinks().names().into_iter())
            .map(str::to_string)
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(text: &str) -> Result<Config, ConfigError> {
        outbox::cli::config::parse(text.parse().unwrap(), &backends())
    }

    const MINIMAL: &str =
        "[storage]\nurl = \"postgres://u:secret@h/db\"\n[sink]\ntype = \"redis\"\n";

    #[test]
    fn the_configuration_knows_this_builds_backends() {
        let config = parse_str(MINIMAL).unwrap();
        assert_eq!(
            config.relays[0].storage_type,
            outbox::backends::DEFAULT_STORAGE
        );
        let error = parse_str("[storage]\nurl = \"postgres://h/db\"\n")
            .unwrap_err()
            .0;
        for name in outbox::backends::sinks().names() {
            assert!(error.contains(&format!("\"{name}\"")), "{name}: {error}");
        }
    }

    /// The storage's own settings are checked when the registry builds it (as `check` and
    /// `relay` do before anything else), and the error names the key where it is written.
    #[tokio::test]
    async fn storage_errors_name_the_key() {
        let cases = [
            ("[sink]\ntype = \"redis\"\n".to_string(), "storage.url is missing"),
            ("[storage]\nurl = \"postgres://h/db\"\nschema = \"Bad-Name\"\n[sink]\ntype = \"redis\"\n".to_string(), "storage.schema `Bad-Name`"),
            (MINIMAL.replace("[sink]", "retention = \"0s\"\n[sink]"), "storage.retention is 0"),
            (MINIMAL.replace("[sink]", "max_per_key = 0\n[sink]"), "storage.max_per_key is 0"),
            (MINIMAL.replace("[sink]", "max_connections = \"four\"\n[sink]"), "storage.max_connections: invalid type"),
            (MINIMAL.replace("[sink]", "type = \"oracle\"\n[sink]"), "storage.type `oracle` is unknown"),
            ("[storage]\nurl = \"postgres://h/db\"\n[[relay]]\nname = \"orders\"\nstorage = { table = \"Orders\" }\n[relay.sink]\ntype = \"redis\"\n".to_string(), "relay[orders].storage.table `Orders` is not allowed"),
        ];
        for (text, expected) in cases {
            let config = parse_str(&text).unwrap();
            let error = match crate::relay::open_storage(&config.relays[0]).await {
                Err(crate::Failure::Config(error)) => error,
                Err(_) => panic!("`{expected}`: not a configuration error"),
                Ok(_) => panic!("`{expected}`: accepted"),
            };
            assert!(
                error.contains(expected),
                "expected `{expected}` in: {error}"
            );
            assert!(!error.contains("secret"), "password leaked: {error}");
        }
    }
}
