//! The connection a tick's delivering reads keep between them (issue 38; the decisions are
//! [`crate::domain::connection`]'s).
//!
//! A catch-up reads page after page, each after the last one's end. Given back to the pool after
//! each page, a connection costs a round trip more a page (sqlx pings it on its way back), which a
//! database a few milliseconds away makes a large share of the read. So a read that stops at a limit
//! keeps its connection, and the permit of the target's cap it counts against, while another
//! permit is free; the next delivering read of the source uses it, and the tick gives it back when
//! it ends ([`super::Source::end_reads`], however the tick ends). A kept connection is only ever in
//! one read at a time: a read takes it out, and a read that fails or is cancelled never puts it
//! back (it goes as any failed question's does: its permit held until the connection is idle or
//! closed), so a broken connection never serves another read.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::pools::{HeldConnection, Permit};
use crate::domain::connection::{AfterRead, BeforeReuse, ReadEnd, after_read, before_reuse};

/// How a question gets its connection.
pub(crate) enum Way<DB: sqlx::Database> {
    /// A permit of the target's cap, to take a connection of the pool with.
    Take(Permit),
    /// The connection the tick's previous read kept (it holds its permit), idle for `idle`.
    Kept { connection: HeldConnection<DB>, idle: Duration },
}

impl<DB: sqlx::Database> Way<DB> {
    /// The question's connection. A kept connection idle as long as the pool would ping one after
    /// is pinged first; one that does not answer is closed, and another taken with its permit.
    pub(crate) async fn connect(self, pool: &sqlx::Pool<DB>) -> Result<HeldConnection<DB>, sqlx::Error> {
        let (mut connection, idle) = match self {
            Way::Take(permit) => return permit.connect(pool).await,
            Way::Kept { connection, idle } => (connection, idle),
        };
        if before_reuse(idle, super::pool::PING_AFTER_IDLE) == BeforeReuse::Use {
            return Ok(connection);
        }
        match sqlx::Connection::ping(&mut **connection.pooled()).await {
            Ok(()) => Ok(connection),
            Err(_) => connection.close().connect(pool).await,
        }
    }
}

/// The connection kept for a source's next delivering read, if any, and since when.
pub(crate) struct Kept<DB: sqlx::Database> {
    slot: Mutex<Option<(HeldConnection<DB>, Instant)>>,
}

impl<DB: sqlx::Database> Default for Kept<DB> {
    fn default() -> Self {
        Kept { slot: Mutex::new(None) }
    }
}

impl<DB: sqlx::Database> Kept<DB> {
    /// How the next delivering read gets its connection: the kept one, if any (taken out: only
    /// a read that succeeds puts one back).
    pub(crate) fn take(&self) -> Option<Way<DB>> {
        let (connection, since) = self.lock().take()?;
        Some(Way::Kept { connection, idle: since.elapsed() })
    }

    /// A delivering read answered on `connection`: kept for the next read, or given back.
    pub(crate) fn after_read(&self, connection: HeldConnection<DB>, more_to_read: bool, free_permits: usize) {
        let end = ReadEnd { more_to_read, reusable: connection.reusable(), free_permits };
        if after_read(end) == AfterRead::GiveBack {
            connection.finish();
            return;
        }
        let mut slot = self.lock();
        match slot.as_ref() {
            // Two delivering reads at once (not a tick's: its reads are one after the other):
            // one connection is kept, the other goes back.
            Some(_) => connection.finish(),
            None => *slot = Some((connection, Instant::now())),
        }
    }

    /// The tick's reads are over: the kept connection, if any, goes back to the pool.
    pub(crate) fn release(&self) {
        let kept = self.lock().take();
        if let Some((connection, _)) = kept {
            connection.finish();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(HeldConnection<DB>, Instant)>> {
        self.slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl<DB: sqlx::Database> Drop for Kept<DB> {
    fn drop(&mut self) {
        // A pooled connection goes back through a task: without a runtime (the process is
        // ending) it is let go without one.
        if tokio::runtime::Handle::try_current().is_err()
            && let Some(kept) = self.lock().take()
        {
            std::mem::forget(kept);
        }
    }
}
