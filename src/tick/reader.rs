//! The batches of a tick: made from the rows read (events encoded once), and read ahead of the
//! deliveries by the tick's own task.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;

use crate::domain::Position;
use crate::domain::event::position_key;
use crate::domain::ids::{EventIds, batch_id};
use crate::domain::keyed::{Group, group_of};
use crate::sink::Batch;
use crate::source::{FetchLimit, Source, SourceError, SourceRow};

use super::panic_message;

/// What makes the batches of one tick: the same poller, fingerprint, token and generation for
/// every one of them.
pub(super) struct BatchMaker {
    pub(super) ids: EventIds,
    pub(super) poller: String,
    pub(super) fingerprint: String,
    pub(super) fencing_token: u64,
    pub(super) generation: Option<serde_json::Value>,
    /// The ordered window's key (issue 38): `None` when batches go in any order; else the columns
    /// `batch.orderKey` names (`None` inside: the primary key).
    pub(super) grouping: Option<Option<Vec<String>>>,
}

/// A fetched batch ready to send: its events encoded, its rows' positions kept for the window
/// and for isolation.
pub(super) struct Prepared {
    pub(super) batch: Batch,
    pub(super) positions: Vec<Position>,
    /// Its bytes in the app's budget, given back when it is dropped (delivered or given up).
    pub(super) hold: super::budget::Hold,
    /// Each event's keys, for the ordered window (empty when batches go in any order).
    pub(super) groups: Vec<Group>,
}

impl BatchMaker {
    /// The batch of `rows` (never empty): the rows' values move into its events.
    pub(super) fn prepare(&self, rows: Vec<SourceRow>) -> Prepared {
        let first = &rows.first().expect("a batch is never empty").position;
        let last = &rows.last().expect("a batch is never empty").position;
        let id = batch_id(&self.poller, &self.fingerprint, first, last, rows.len());
        let groups = match &self.grouping {
            None => Vec::new(),
            Some(columns) => {
                let mut key = Vec::new();
                let columns = columns.as_deref();
                rows.iter()
                    .map(|row| {
                        let (_, pk) = position_key(&mut key, &row.position);
                        group_of(columns, row.group.as_ref(), &key[pk], row.row.as_bytes())
                    })
                    .collect()
            }
        };
        let (mut batch, positions) = Batch::from_rows(&self.ids, &self.poller, id, self.fencing_token, rows);
        batch.generation = self.generation.clone();
        Prepared { batch, positions, hold: super::budget::Hold::default(), groups }
    }
}

/// The batches after a tick's first one, read in order, one at a time, by the tick's own task: a
/// read is polled where the tick waits for its deliveries, so a batch reaches the window without a
/// hand-off between tasks. The next read starts once no batch waits to be sent (see `start`), and
/// a batch is prepared (its events encoded) as its read ends. Dropping a read (`stop`, or the
/// reader) cancels it, and a source interrupts a query whose future is dropped.
pub(super) struct Reader {
    source: Arc<dyn Source>,
    limit: FetchLimit,
    maker: Arc<BatchMaker>,
    /// Where the next read starts: `None` while one runs, and for good once one came back short
    /// of its limits (the end of the source for now), failed, or the reader was stopped.
    from: Option<Position>,
    reading: Option<BoxFuture<'static, Result<Read, SourceError>>>,
    /// The app's budget of bytes in flight, which each read reserves its batch from.
    reservations: super::budget::Reservations,
    /// Why reading stopped, if a read failed: the tick ends with this error.
    pub(super) failed: Option<SourceError>,
    /// `stop` gave up a read in progress or one still to make: the source may have more.
    given_up: bool,
}

/// What one read of the reader found: a batch (none if the source had no more rows), and where the
/// next read starts, if the read stopped at a limit.
struct Read {
    batch: Option<Prepared>,
    next: Option<Position>,
}

impl Reader {
    /// Reads after `from`; `None` means there is nothing more to read this tick.
    pub(super) fn new(
        source: Arc<dyn Source>,
        limit: FetchLimit,
        maker: Arc<BatchMaker>,
        from: Option<Position>,
        reservations: super::budget::Reservations,
    ) -> Reader {
        Reader { source, limit, maker, from, reading: None, reservations, failed: None, given_up: false }
    }

    /// No read runs and none will: the source has nothing more this tick, a read failed, or the
    /// reader stopped.
    pub(super) fn done(&self) -> bool {
        self.from.is_none() && self.reading.is_none()
    }

    /// A read was given up by `stop`: what follows was not read, whether or not there is any.
    pub(super) fn given_up(&self) -> bool {
        self.given_up
    }

    pub(super) fn reading(&self) -> bool {
        self.reading.is_some()
    }

    /// Cancels the read in progress, if any, and reads nothing more.
    pub(super) fn stop(&mut self) {
        self.given_up |= self.from.is_some() || self.reading.is_some();
        self.from = None;
        self.reading = None;
    }

    /// Starts the next read, unless one runs or a batch still waits to be sent (`waiting`): memory
    /// holds what is in flight, one batch ready and one being read, at most.
    pub(super) fn start(&mut self, waiting: usize) {
        if self.reading.is_some() || waiting > 0 {
            return;
        }
        let Some(from) = self.from.take() else {
            return;
        };
        let (source, maker, limit) = (self.source.clone(), self.maker.clone(), self.limit);
        let reservations = self.reservations.clone();
        let read = async move {
            let read = AssertUnwindSafe(async {
                // The batch's byte limit first, from the app's budget (waiting while it is spent);
                // what the rows weigh is kept once they are read.
                let mut hold = reservations.reserve(limit.bytes).await;
                let fetched = source.fetch_after(Some(&from), limit).await?;
                hold.keep(super::budget::rows_bytes(&fetched.rows));
                let next = if fetched.full { fetched.rows.last().map(|row| row.position.clone()) } else { None };
                let batch = if fetched.rows.is_empty() {
                    None
                } else {
                    let mut prepared = maker.prepare(fetched.rows);
                    prepared.hold = hold;
                    Some(prepared)
                };
                Ok(Read { batch, next })
            })
            .catch_unwind()
            .await;
            // A panicking read is a failed read: the tick commits what was acknowledged before it
            // and never calls itself caught up.
            read.unwrap_or_else(|panic| {
                Err(SourceError::Query {
                    location: source.describe(),
                    reason: format!("the read of the next batch panicked: {}", panic_message(panic.as_ref())),
                })
            })
        };
        self.reading = Some(read.boxed());
    }

    /// Waits for the read in progress to end (pending for ever if none runs: guard a wait on
    /// `reading`), and returns its batch, if the source had more rows (a failed read keeps its
    /// error in `failed` and reads nothing more). Cancel-safe: dropped before the read ends, the
    /// read goes on and is waited for next time.
    pub(super) async fn next(&mut self) -> Option<Prepared> {
        let Some(reading) = self.reading.as_mut() else {
            return std::future::pending().await;
        };
        let read = reading.await;
        self.reading = None;
        match read {
            Ok(read) => {
                self.from = read.next;
                read.batch
            }
            Err(error) => {
                self.failed = Some(error);
                None
            }
        }
    }
}
