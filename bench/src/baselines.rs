//! The in-run baselines that give the relay's figures their meaning.

use std::time::Instant;

use outbox_core::{Message, NewMessage, Sink};
use sqlx::Row;

use crate::Scale;
use crate::drain::BATCH;
use crate::setup::{BenchOutbox, SinkKind, text};

/// The database ceiling: `DELETE … WHERE seq IN (SELECT … FOR UPDATE SKIP LOCKED LIMIT n)
/// RETURNING *` in a loop on one connection, no sink.
pub async fn bare_delete(scale: Scale) -> Result<f64, String> {
    let outbox = BenchOutbox::new().await?;
    outbox.preload(scale.drain_messages, scale.keys).await?;
    let t = outbox.table.qualified("");
    let sql = format!(
        "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED) RETURNING *"
    );
    let mut conn = outbox.pool.acquire().await.map_err(text)?;
    let rate = deleted_per_second::<sqlx::Postgres>(&mut conn, &sql).await?;
    drop(conn);
    outbox.drop_schema().await?;
    Ok(rate)
}

/// The rate of a bare `DELETE … RETURNING *` loop on one connection: runs `sql`, whose one
/// parameter is the batch size, until it deletes nothing (see [`rows_per_second`]).
pub async fn deleted_per_second<DB>(conn: &mut DB::Connection, sql: &str) -> Result<f64, String>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    rows_per_second(async || {
        let rows = sqlx::query::<DB>(sql)
            .bind(BATCH as i64)
            .fetch_all(&mut *conn)
            .await
            .map_err(text)?;
        Ok(rows.len())
    })
    .await
}

/// The rate of a storage's bare-delete ceiling: runs `batch` (which removes up to a batch
/// of rows and says how many) until it removes none; returns the rows removed per second.
pub async fn rows_per_second(
    mut batch: impl AsyncFnMut() -> Result<usize, String>,
) -> Result<f64, String> {
    let started = Instant::now();
    let mut total = 0u64;
    loop {
        let removed = batch().await?;
        if removed == 0 {
            break;
        }
        total += removed as u64;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

/// The loop most outbox workers are written as: claim a batch in a transaction, publish
/// each message and await it, then delete each one with its own statement.
pub async fn naive_relay(scale: Scale, kind: SinkKind) -> Result<f64, String> {
    let outbox = BenchOutbox::new().await?;
    outbox.preload(scale.drain_messages, scale.keys).await?;
    let run = outbox.schema.clone();
    let sink = kind.build(&run)?;
    let t = outbox.table.qualified("");
    let claim = format!(
        "SELECT id, topic, partition_key, payload FROM {t} ORDER BY seq LIMIT 100 FOR UPDATE SKIP LOCKED"
    );
    let delete = format!("DELETE FROM {t} WHERE id = $1");
    let started = Instant::now();
    let mut total = 0u64;
    loop {
        let mut tx = outbox.pool.begin().await.map_err(text)?;
        let rows = sqlx::query(&claim)
            .fetch_all(&mut *tx)
            .await
            .map_err(text)?;
        if rows.is_empty() {
            break;
        }
        let mut ids = Vec::new();
        for row in &rows {
            let mut message: Message = NewMessage::new(
                row.get::<String, _>("topic"),
                row.get::<Vec<u8>, _>("payload"),
            )
            .into();
            message.id = row.get("id");
            message.key = row.get("partition_key");
            sink.publish(std::slice::from_ref(&message))
                .await
                .map_err(text)?;
            ids.push(message.id);
        }
        for id in ids {
            sqlx::query(&delete)
                .bind(id)
                .execute(&mut *tx)
                .await
                .map_err(text)?;
        }
        tx.commit().await.map_err(text)?;
        total += rows.len() as u64;
    }
    let rate = total as f64 / started.elapsed().as_secs_f64();
    kind.cleanup(&run).await?;
    outbox.drop_schema().await?;
    Ok(rate)
}

/// The sink ceiling: the same messages published straight to the sink in batches, no database.
pub async fn sink_ceiling(scale: Scale, kind: SinkKind) -> Result<f64, String> {
    let run = format!("bench_sink_{:08x}", fastrand::u32(..));
    kind.prepare(&run).await?;
    let sink = kind.build(&run)?;
    let rate = publish_all(scale, sink.as_ref()).await?;
    kind.cleanup(&run).await?;
    Ok(rate)
}

/// Publishes the drain's messages straight to `sink` in batches of [`BATCH`], no database.
/// Returns events per second.
pub async fn publish_all(scale: Scale, sink: &dyn Sink) -> Result<f64, String> {
    // Batches are made as they go, so the benchmark process never holds them all: its peak
    // memory is reported as the relay's.
    let batch = |start: u64| -> Vec<Message> {
        (start..(start + BATCH as u64).min(scale.drain_messages))
            .map(|i| {
                NewMessage::new("bench", vec![b'x'; 200])
                    .key(format!("k{}", i % scale.keys))
                    .into()
            })
            .collect()
    };
    let started = Instant::now();
    for start in (0..scale.drain_messages).step_by(BATCH) {
        sink.publish(&batch(start)).await.map_err(text)?;
    }
    Ok(scale.drain_messages as f64 / started.elapsed().as_secs_f64())
}
