//! Connections shared by the app: one pool per database target (the source's `pool_key`), used by
//! every poller of the app that reads that database, capped (`source.maxConnections`, app setting
//! `DBTRIGGER_MAX_CONNECTIONS_PER_DATABASE`, default 10), its idle connections closed after
//! [`IDLE_CLOSE`] so that a quiet app holds none.
//!
//! The cap is a semaphore of the target's size in front of the pool (whose own maximum is the same
//! number): a source question (a fetch, a count, a recount) holds one permit while it runs, so
//! it never holds more than one connection, and waiting for a permit happens before the
//! question's query timeout starts. A question that finds every permit taken waits, up to its
//! poller's tick budget; the wait is added up per source for the tick's summary line.
//!
//! Pollers of one target may ask for different query timeouts; the target's sessions get the
//! longest as PostgreSQL's `statement_timeout` (each question is still cancelled at its own).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::SourceError;
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

    /// A permit to use one connection of the target, waiting for one if all are in use.
    pub(crate) async fn enter(&self, location: &str) -> Result<Option<OwnedSemaphorePermit>, SourceError> {
        let Some(target) = &self.target else {
            return Ok(None);
        };
        let permits = target.permits().clone();
        if let Ok(permit) = permits.clone().try_acquire_owned() {
            return Ok(Some(permit));
        }
        let started = Instant::now();
        let permit = tokio::time::timeout(self.wait_limit, permits.acquire_owned()).await;
        let waited = started.elapsed();
        self.waited_micros.fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
        match permit {
            Ok(Ok(permit)) => Ok(Some(permit)),
            _ => {
                Err(SourceError::Busy { location: location.to_string(), cap: target.cap(), seconds: waited.as_secs() })
            }
        }
    }

    /// The shared target (none for [`Gate::open`]).
    pub(crate) fn target(&self) -> Option<&Arc<Target>> {
        self.target.as_ref()
    }

    /// How long this source waited for connections since the last call.
    pub(crate) fn take_waited(&self) -> Duration {
        Duration::from_micros(self.waited_micros.swap(0, Ordering::Relaxed))
    }
}
