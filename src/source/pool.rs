//! The connection pool every sqlx engine's source uses.

use sqlx::Database;

/// A pooled connection idle for less than this is handed out without a ping: the back-to-back
/// fetches of a catch-up skip that round trip, while a connection idle since an earlier tick
/// (ticks are seconds apart at least) is checked first, and replaced if the server dropped it.
/// A connection that breaks within the window fails its fetch, and the tick with it: the next
/// tick starts again from the checkpoint.
pub(crate) const PING_AFTER_IDLE: std::time::Duration = std::time::Duration::from_secs(1);

/// The base of every shared pool ([`super::pools::Target::pool_options`] sets its size and idle time):
/// ten seconds to get a connection once a permit is held (one is free or can be opened), a ping
/// only after [`PING_AFTER_IDLE`] idle.
pub(crate) fn pool_options<DB: Database>() -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::new()
        .max_connections(2)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .test_before_acquire(false)
        .before_acquire(|connection, metadata| {
            Box::pin(async move {
                if metadata.idle_for >= PING_AFTER_IDLE {
                    sqlx::Connection::ping(connection).await?;
                }
                Ok(true)
            })
        })
}
