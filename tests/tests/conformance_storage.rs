//! The storage conformance suite, run against the real PostgreSQL storage and against the
//! in-memory storage of outbox-core.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::memory::{MemoryStorage, MemoryTransaction};
use outbox_core::{NewMessage, Storage, StorageAdmin};
use outbox_postgres::PgStorage;
use outbox_testkit::{PendingWrite, StorageFixture, StorageHarness};
use outbox_tests::{PgWrite, TestOutbox, on_a_blocking_thread};

/// PostgreSQL: each fixture is a fresh migrated schema, dropped with it.
struct Postgres;

/// The outbox, and the relay's storage on it (a new one after each restart).
struct PgFixture(TestOutbox, Mutex<Arc<PgStorage>>);

#[async_trait]
impl StorageFixture for PgFixture {
    fn storage(&self) -> Arc<dyn Storage> {
        self.1.lock().expect("the relay's storage").clone()
    }

    fn admin(&self) -> Arc<dyn StorageAdmin> {
        self.0.storage.clone()
    }

    fn replica(&self) -> Option<Arc<dyn Storage>> {
        let config = self.0.storage.config().clone();
        Some(Arc::new(
            PgStorage::new(config).expect("valid configuration"),
        ))
    }

    async fn restart(&self, stop: bool) -> bool {
        if stop {
            self.storage().stop().await.expect("stop");
        }
        let config = self.0.storage.config().clone();
        *self.1.lock().expect("the relay's storage") =
            Arc::new(PgStorage::new(config).expect("valid configuration"));
        true
    }

    async fn begin(&self, messages: &[NewMessage]) -> Box<dyn PendingWrite> {
        PgWrite::begin(&self.0, messages).await
    }

    async fn advance(&self, by: Duration) {
        self.0.move_times_back("", "available_at", by).await;
    }
}

#[async_trait]
impl StorageHarness for Postgres {
    async fn fresh(&self, per_key_order: bool) -> Box<dyn StorageFixture> {
        let outbox = on_a_blocking_thread(move || {
            TestOutbox::with_config(move |c| c.per_key_order = per_key_order)
        })
        .await;
        let relay = Mutex::new(outbox.storage.clone());
        Box::new(PgFixture(outbox, relay))
    }
}

/// The in-memory storage: a "transaction" holds its messages until it commits.
struct Memory;

struct MemoryFixture(Arc<MemoryStorage>);

struct MemoryWrite {
    storage: Arc<MemoryStorage>,
    tx: MemoryTransaction,
}

#[async_trait]
impl PendingWrite for MemoryWrite {
    async fn commit(self: Box<Self>) {
        self.storage.commit(self.tx);
    }
    async fn rollback(self: Box<Self>) {
        self.storage.rollback(self.tx);
    }
}

#[async_trait]
impl StorageFixture for MemoryFixture {
    fn storage(&self) -> Arc<dyn Storage> {
        self.0.clone()
    }

    fn admin(&self) -> Arc<dyn StorageAdmin> {
        self.0.clone()
    }

    async fn begin(&self, messages: &[NewMessage]) -> Box<dyn PendingWrite> {
        Box::new(MemoryWrite {
            storage: self.0.clone(),
            tx: self.0.begin(messages.to_vec()),
        })
    }

    async fn advance(&self, by: Duration) {
        self.0.advance(by);
    }
}

#[async_trait]
impl StorageHarness for Memory {
    async fn fresh(&self, per_key_order: bool) -> Box<dyn StorageFixture> {
        Box::new(MemoryFixture(Arc::new(MemoryStorage::new(per_key_order))))
    }
}

mod postgres {
    outbox_testkit::storage_conformance_tests!(super::Postgres);
}

mod memory {
    outbox_testkit::storage_conformance_tests!(super::Memory);
}

/// The whole suite in one call, as an out-of-tree crate might run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_suite_runs_in_one_call() {
    outbox_testkit::run_storage_suite(&Postgres).await;
}
