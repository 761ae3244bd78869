//! The run-time registries of sink and storage types: configuration names a type, the
//! registry builds it. Each backend crate exports its type name and a `register` function,
//! so a third-party crate plugs in without editing ours.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::config::Settings;
use crate::{Error, Result, Sink, StorageAdmin};

/// A boxed future, as returned by a [`Factory`].
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Builds a backend from its configuration section (the `[sink]` or `[storage]` table of
/// the relay's configuration, without `type`, as JSON). Must validate the configuration and
/// return a `Config` error keyed by the bad setting inside the section ([`Error::setting`],
/// or [`config::from_value`](crate::config::from_value) which does so); the caller adds the
/// section.
pub type Factory<T> = Arc<dyn Fn(serde_json::Value) -> BoxFuture<Result<Arc<T>>> + Send + Sync>;

/// Builds a sink: see [`Factory`].
pub type SinkFactory = Factory<dyn Sink>;

/// Sink types known to this process, by name.
pub type SinkRegistry = Registry<dyn Sink>;

/// Storage types known to this process, by name. A storage is built as a
/// [`StorageAdmin`], which is also the [`Storage`](crate::Storage) the worker runs on.
pub type StorageRegistry = Registry<dyn StorageAdmin>;

/// Backend types of one kind (sinks or storages) known to this process, by name.
pub struct Registry<T: ?Sized> {
    factories: BTreeMap<String, Factory<T>>,
    /// Types that exist but were not compiled in, with the cargo feature that adds each.
    missing: BTreeMap<String, String>,
}

impl<T: ?Sized> Clone for Registry<T> {
    fn clone(&self) -> Self {
        Registry {
            factories: self.factories.clone(),
            missing: self.missing.clone(),
        }
    }
}

impl<T: ?Sized> Default for Registry<T> {
    fn default() -> Self {
        Registry {
            factories: BTreeMap::new(),
            missing: BTreeMap::new(),
        }
    }
}

impl<T: ?Sized + 'static> std::fmt::Debug for Registry<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("types", &self.names())
            .field("not_compiled_in", &self.missing)
            .finish()
    }
}

impl<T: ?Sized + 'static> Registry<T> {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `factory` under `name`, replacing any earlier one.
    pub fn register<F, Fut>(&mut self, name: &str, factory: F)
    where
        F: Fn(serde_json::Value) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Arc<T>>> + Send + 'static,
    {
        self.missing.remove(name);
        self.factories.insert(
            name.to_string(),
            Arc::new(move |config| Box::pin(factory(config))),
        );
    }

    /// Registers under `name` a factory that takes its typed settings: the section is read
    /// and validated with [`Settings::from_value`] (a bad key or value is a `Config` error
    /// keyed by the setting) before `build` is called, so a backend cannot forget to.
    pub fn register_settings<C, F, Fut>(&mut self, name: &str, build: F)
    where
        C: Settings,
        F: Fn(C) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Arc<T>>> + Send + 'static,
    {
        self.register(name, move |section| {
            let building = C::from_value(section).map(&build);
            async move { building?.await }
        });
    }

    /// Records that type `name` exists but this build lacks it, and which cargo feature
    /// adds it, so the error for it can say so.
    pub fn note_missing(&mut self, name: &str, feature: &str) {
        if !self.factories.contains_key(name) {
            self.missing.insert(name.to_string(), feature.to_string());
        }
    }

    /// The registered type names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.factories.keys().map(String::as_str).collect()
    }

    /// Builds the backend of type `name` from `config`. An unknown type is a `Config` error
    /// keyed `type` that lists the registered ones (and the feature that adds a known but
    /// missing one); errors are relative to the section (see [`Error::in_section`]).
    pub async fn build(&self, name: &str, config: serde_json::Value) -> Result<Arc<T>> {
        match self.factories.get(name) {
            Some(factory) => factory(config).await,
            None => Err(Error::setting(
                "type",
                match self.missing.get(name) {
                    Some(feature) => format!(
                        "`{name}` is not compiled into this build; it has: {}. Rebuild with \
                         cargo feature `{feature}` to add it",
                        self.list()
                    ),
                    None => format!("`{name}` is unknown; this build has: {}", self.list()),
                },
            )),
        }
    }

    fn list(&self) -> String {
        match self.names() {
            names if names.is_empty() => "none".to_string(),
            names => names.join(", "),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemorySink;

    #[tokio::test]
    async fn builds_registered_types_and_names_the_others() {
        let mut registry = SinkRegistry::new();
        registry.register("memory", |_config| async {
            Ok(Arc::new(MemorySink::new()) as Arc<dyn Sink>)
        });
        registry.note_missing("kafka", "kafka");
        assert!(
            registry
                .build("memory", serde_json::json!({}))
                .await
                .is_ok()
        );
        let unknown = registry
            .build("mqtt", serde_json::Value::Null)
            .await
            .err()
            .unwrap()
            .in_section("sink");
        assert_eq!(
            unknown.to_string(),
            "configuration error: sink.type `mqtt` is unknown; this build has: memory"
        );
        let missing = registry
            .build("kafka", serde_json::Value::Null)
            .await
            .err()
            .unwrap();
        assert!(
            missing.to_string().contains("cargo feature `kafka`"),
            "{missing}"
        );
    }

    /// Settings of a sink made up for the test: `size` must be at least 1.
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Spool {
        size: usize,
    }

    impl Settings for Spool {
        fn validate(&self) -> Result<()> {
            if self.size == 0 {
                return Err(Error::setting("size", "is 0; it must be at least 1"));
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_factory_of_settings_gets_them_read_and_checked() {
        let mut registry = SinkRegistry::new();
        let built = Arc::new(std::sync::Mutex::new(Vec::new()));
        registry.register_settings("spool", {
            let built = built.clone();
            move |settings: Spool| {
                built.lock().unwrap().push(settings.size);
                async { Ok(Arc::new(MemorySink::new()) as Arc<dyn Sink>) }
            }
        });
        let build = |section| registry.build("spool", section);
        assert!(build(serde_json::json!({"size": "3"})).await.is_ok());
        for (section, problem) in [
            (
                serde_json::json!({"size": 0}),
                "sink.size is 0; it must be at least 1",
            ),
            (
                serde_json::json!({"size": 1, "extra": 1}),
                "sink.extra: unknown field",
            ),
            (serde_json::json!({"size": "many"}), "sink.size: invalid"),
        ] {
            let error = build(section).await.err().unwrap().in_section("sink");
            assert!(error.message().starts_with(problem), "{error}");
            assert_eq!(error.kind(), crate::ErrorKind::Config);
        }
        // The factory ran for the good section only.
        assert_eq!(*built.lock().unwrap(), [3]);
    }
}
