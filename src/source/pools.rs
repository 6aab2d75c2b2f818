//! Connections shared by the app: one pool per database target (the source's `pool_key`), used by
//! every poller of the app that reads that database, capped (`source.maxConnections`, app setting
//! `DBTRIGGER_MAX_CONNECTIONS_PER_DATABASE`, default 10), its idle connections closed after
//! [`IDLE_CLOSE`] so that a quiet app holds none.
//!
//! The cap is a semaphore of the target's size in front of the pool (whose own maximum is the same
//! number): a source question (a fetch, a count, a recount) holds one permit while it runs, so
//! it never holds more than one connection, and waiting for a permit happens before the
//! question's query timeout starts. A fetch and a count take their connection with the permit
//! ([`HeldConnection`]): when the question times out with the connection still busy, the permit
//! is held until the connection is back in the pool or closed. A question that finds every permit taken waits, up to its
//! poller's tick budget; the wait is added up per source for the tick's summary line. A tick's
//! delivering reads keep their connection, with its permit, from one read to the next while
//! another permit is free ([`super::kept`]), and give it back when the tick ends.
//!
//! Pollers of one target may ask for different query timeouts; the target's sessions get the
//! longest as PostgreSQL's `statement_timeout` (each question is still cancelled at its own).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::SourceError;
use super::entra::DatabaseToken;
use crate::config::SourceConfig;

/// An idle connection is closed after this long: a poller ticking every few seconds keeps its
/// connections warm, an app whose timers are minutes apart holds none between them.
pub const IDLE_CLOSE: Duration = Duration::from_secs(10);

/// The pools of one app, by target.
#[derive(Default, Clone)]
pub struct Pools {
    targets: Arc<Mutex<HashMap<String, Arc<Target>>>>,
}

impl Pools {
    pub fn new() -> Self {
        Pools::default()
    }

    /// The shared target of `config`, registering what this source asks of it (its cap and its
    /// query timeout). Registration happens when the app opens its functions, before the first
    /// connection: the target's cap and session settings are fixed at its first use.
    pub(crate) fn target(&self, config: &SourceConfig) -> Arc<Target> {
        let mut targets = self.targets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let target = targets
            .entry(config.pool_key.clone())
            .or_insert_with(|| {
                Arc::new(Target {
                    key: config.pool_key.clone(),
                    cap: AtomicU32::new(config.max_connections.max(1)),
                    statement_timeout_ms: AtomicU64::new(0),
                    permits: OnceLock::new(),
                    postgres: OnceLock::new(),
                    mysql: OnceLock::new(),
                    token: config.identity.clone().map(|identity| Arc::new(DatabaseToken::new(identity))),
                    applied: AtomicU64::new(0),
                })
            })
            .clone();
        target.cap.fetch_min(config.max_connections.max(1), Ordering::Relaxed);
        target.statement_timeout_ms.fetch_max(config.query_timeout.as_millis() as u64, Ordering::Relaxed);
        target
    }

    /// How many targets the app's sources share (for tests and logs).
    pub fn len(&self) -> usize {
        self.targets.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One database target: its cap, the permits that enforce it, its pool (made at first use).
pub struct Target {
    key: String,
    cap: AtomicU32,
    statement_timeout_ms: AtomicU64,
    permits: OnceLock<Arc<Semaphore>>,
    pub(crate) postgres: OnceLock<sqlx::PgPool>,
    pub(crate) mysql: OnceLock<sqlx::MySqlPool>,
    /// The Entra token the target logs in with (`<connection>__credential = managedidentity`).
    token: Option<Arc<DatabaseToken>>,
    /// Which of the token's generations the pool's connect options carry (0: none yet).
    applied: AtomicU64,
}

impl Target {
    /// The cap, fixed from here on.
    pub fn cap(&self) -> u32 {
        self.permits();
        self.cap.load(Ordering::Relaxed)
    }

    /// The longest query timeout of the target's sources (PostgreSQL's `statement_timeout`).
    pub(crate) fn statement_timeout(&self) -> Duration {
        Duration::from_millis(self.statement_timeout_ms.load(Ordering::Relaxed))
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    fn permits(&self) -> &Arc<Semaphore> {
        self.permits.get_or_init(|| Arc::new(Semaphore::new(self.cap.load(Ordering::Relaxed) as usize)))
    }

    /// `options` with the password of the target's kept token, for a pool made now (unchanged
    /// for a target that logs in with its URL's password).
    pub(crate) fn postgres_login(&self, options: sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions {
        match self.token.as_ref().and_then(|token| token.kept()) {
            Some(password) => {
                self.applied.store(password.generation, Ordering::SeqCst);
                options.password(password.token.expose())
            }
            None => options,
        }
    }

    /// As [`Target::postgres_login`], for MySQL/MariaDB: Azure Database for MySQL takes the token
    /// by the cleartext plugin (over the TLS the configuration requires).
    pub(crate) fn mysql_login(&self, options: sqlx::mysql::MySqlConnectOptions) -> sqlx::mysql::MySqlConnectOptions {
        match self.token.as_ref().and_then(|token| token.kept()) {
            Some(password) => {
                self.applied.store(password.generation, Ordering::SeqCst);
                options.password(password.token.expose()).enable_cleartext_plugin(true)
            }
            None => options,
        }
    }

    /// Before a question: a token that is due is renewed, and a pool that logs in with an older
    /// one is given the new one for the connections it opens from now on.
    async fn renew_login(&self, location: &str) -> Result<(), SourceError> {
        let Some(token) = &self.token else {
            return Ok(());
        };
        let password = token.password(std::time::SystemTime::now(), location).await?;
        if self.applied.load(Ordering::SeqCst) == password.generation {
            return Ok(());
        }
        if let Some(pool) = self.postgres.get() {
            pool.set_connect_options(pool.connect_options().as_ref().clone().password(password.token.expose()));
            self.applied.store(password.generation, Ordering::SeqCst);
        }
        if let Some(pool) = self.mysql.get() {
            let options = pool.connect_options().as_ref().clone();
            pool.set_connect_options(options.password(password.token.expose()).enable_cleartext_plugin(true));
            self.applied.store(password.generation, Ordering::SeqCst);
        }
        Ok(())
    }

    /// The pool options of every shared pool: the cap, idle connections closed after
    /// [`IDLE_CLOSE`], a ping only after [`super::PING_AFTER_IDLE`].
    pub(crate) fn pool_options<DB: sqlx::Database>(&self) -> sqlx::pool::PoolOptions<DB> {
        super::pool_options::<DB>().max_connections(self.cap()).min_connections(0).idle_timeout(Some(IDLE_CLOSE))
    }
}

/// One source's way into its target: waits for a permit, and adds up how long it waited.
pub(crate) struct Gate {
    target: Option<Arc<Target>>,
    /// How long one question may wait for a connection: the poller's tick budget.
    wait_limit: Duration,
    waited_micros: AtomicU64,
}

impl Gate {
    pub(crate) fn new(target: Arc<Target>, wait_limit: Duration) -> Self {
        Gate { target: Some(target), wait_limit, waited_micros: AtomicU64::new(0) }
    }

    /// No shared cap (SQLite: a file, read by a pool of its own).
    pub(crate) fn open() -> Self {
        Gate { target: None, wait_limit: Duration::ZERO, waited_micros: AtomicU64::new(0) }
    }

    /// A permit to use one connection of the target, waiting for one if all are in use (an empty
    /// one without a shared cap).
    pub(crate) async fn enter(&self, location: &str) -> Result<Permit, SourceError> {
        let Some(target) = &self.target else {
            return Ok(Permit(None));
        };
        target.renew_login(location).await?;
        let permits = target.permits().clone();
        if let Ok(permit) = permits.clone().try_acquire_owned() {
            return Ok(Permit(Some(permit)));
        }
        let started = Instant::now();
        let permit = tokio::time::timeout(self.wait_limit, permits.acquire_owned()).await;
        let waited = started.elapsed();
        self.waited_micros.fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
        match permit {
            Ok(Ok(permit)) => Ok(Permit(Some(permit))),
            _ => {
                Err(SourceError::Busy { location: location.to_string(), cap: target.cap(), seconds: waited.as_secs() })
            }
        }
    }

    /// The shared target (none for [`Gate::open`]).
    pub(crate) fn target(&self) -> Option<&Arc<Target>> {
        self.target.as_ref()
    }

    /// Permits of the target's cap free now (`usize::MAX` without a shared cap).
    pub(crate) fn free_permits(&self) -> usize {
        match &self.target {
            Some(target) => target.permits().available_permits(),
            None => usize::MAX,
        }
    }

    /// How long this source waited for connections since the last call.
    pub(crate) fn take_waited(&self) -> Duration {
        Duration::from_micros(self.waited_micros.swap(0, Ordering::Relaxed))
    }
}

/// A permit of the target's cap, held by one question from before its query timeout starts.
/// Dropped with the question, unless the question moved it into the connection it took
/// ([`Permit::connect`]): then it goes with that connection.
pub(crate) struct Permit(Option<OwnedSemaphorePermit>);

impl Permit {
    /// Takes a connection of `pool` that holds this permit until it is back in the pool or closed.
    pub(crate) async fn connect<DB: sqlx::Database>(
        self,
        pool: &sqlx::Pool<DB>,
    ) -> Result<HeldConnection<DB>, sqlx::Error> {
        let connection = pool.acquire().await?;
        Ok(HeldConnection {
            connection: Some(connection),
            permit: self,
            finished: false,
            closing: false,
            unread: false,
        })
    }
}

/// A pooled connection and the permit it counts against. A question that ends normally calls
/// [`HeldConnection::finish`], and both go back at once. One dropped before that (its question
/// timed out, the future dropped mid-query) may still be busy on the server (MySQL runs the
/// statement on; PostgreSQL until `statement_timeout`): the permit stays held, in a task of its
/// own, until the connection has answered (its query over) and gone back to the pool, or is
/// closed. Freed at once, it let the next question past the cap, to spend its own query timeout
/// waiting for the busy connection (issue 35, finding 8).
pub(crate) struct HeldConnection<DB: sqlx::Database> {
    connection: Option<sqlx::pool::PoolConnection<DB>>,
    permit: Permit,
    finished: bool,
    /// Marked to close when it goes ([`HeldConnection::close_on_drop`]): never kept for another
    /// question.
    closing: bool,
    /// Its last result was left partly unread ([`HeldConnection::left_unread`]).
    unread: bool,
}

impl<DB: sqlx::Database> HeldConnection<DB> {
    /// The question is over and left the connection idle (or marked it to close on drop).
    pub(crate) fn finish(mut self) {
        self.finished = true;
    }

    pub(crate) fn pooled(&mut self) -> &mut sqlx::pool::PoolConnection<DB> {
        self.connection.as_mut().expect("held until dropped")
    }

    /// Closes the connection when it goes, instead of giving it back to the pool.
    pub(crate) fn close_on_drop(&mut self) {
        self.closing = true;
        self.pooled().close_on_drop();
    }

    /// Its query's result was left unread past what the socket's buffers take (a read stopped at
    /// its byte limit): until it is drained the server's query stays open, with its snapshot and
    /// its locks (PostgreSQL's AccessShareLock, which an `ALTER TABLE` queues behind, and every
    /// writer after it). The pool drains it as it takes it back; it is never kept idle.
    pub(crate) fn left_unread(&mut self) {
        self.unread = true;
    }

    /// Whether the connection may be kept for another question: not marked to close, its last
    /// result read to its end.
    pub(crate) fn reusable(&self) -> bool {
        !self.closing && !self.unread
    }

    /// Closes a connection that failed between questions (a kept one that did not answer its
    /// ping) and keeps its permit, for the question to take another connection with.
    pub(crate) fn close(mut self) -> Permit {
        if let Some(mut connection) = self.connection.take() {
            connection.close_on_drop();
        }
        Permit(self.permit.0.take())
    }
}

impl<DB: sqlx::Database> Drop for HeldConnection<DB> {
    fn drop(&mut self) {
        let Some(mut connection) = self.connection.take() else {
            return;
        };
        if self.finished {
            return;
        }
        let permit = Permit(self.permit.0.take());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime left (the process is ending): nothing waits for the permit any more.
            return;
        };
        runtime.spawn(async move {
            // A ping answers once what the connection was running is over.
            if sqlx::Connection::ping(&mut *connection).await.is_err() {
                connection.close_on_drop();
            }
            drop(connection);
            drop(permit);
        });
    }
}
