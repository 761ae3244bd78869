//! WAL mode (issue 32, being built; docs/design/wal-mode.md): reading the outbox through a
//! logical replication slot with the `pgoutput` plugin. What is here so far: the decoder of
//! pgoutput's messages (`pgoutput`), which the SQL reader and a later streaming reader
//! share; the SQL reader (`slot`: peek, put together into transactions, advance, the slot's
//! checks); an outbox message from an insert's text values (`row`). No configuration
//! selects this mode yet.

// Used by the WAL engine as it lands; until then only their tests call them.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod pgoutput;
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod row;
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod slot;

/// A PostgreSQL server of the test's own with `wal_level = logical` (the shared server's is
/// `replica`), `settings` added, started; and a connection to its `postgres` database.
#[cfg(test)]
pub(crate) async fn logical_server(
    name: &str,
    settings: &str,
) -> (
    outbox_test_support::postgres_server::PostgresServer,
    sqlx::PgConnection,
) {
    use sqlx::Connection;
    let dir = std::env::temp_dir().join(outbox_test_support::unique_name(name));
    let server = outbox_test_support::postgres_server::PostgresServer::init(&dir);
    server.configure(&format!("wal_level = logical\n{settings}"));
    server.start();
    let url = server.url("127.0.0.1", "postgres", "");
    let conn = sqlx::PgConnection::connect(&url)
        .await
        .expect("the server of the test");
    (server, conn)
}

/// Runs each of `statements` on `conn`, failing the test with the one that failed.
#[cfg(test)]
pub(crate) async fn run_all(conn: &mut sqlx::PgConnection, statements: &[&str]) {
    for statement in statements {
        sqlx::raw_sql(statement)
            .execute(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
}
