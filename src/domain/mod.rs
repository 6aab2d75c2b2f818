//! The pure core: no async, no I/O, no clock reads. Every function that depends on time takes `now`.
//!
//! - [`cursor`]: typed cursor and primary-key values and the (cursor, pk) position order.
//! - [`event`]: rows as sources read them, events and batches as sinks deliver them.
//! - [`state`]: the state document (seed 000, `version: 1`), its parsing and its checkpoint rules.
//! - [`transitions`]: every change to a state document as a pure function (acquire, commit,
//!   heartbeat, release; reset, clone, fingerprint accept with their audit trail).
//! - [`health`]: what `status` says of a poller (lag, lease, attempts, fingerprint), and whether
//!   it is healthy.
//! - [`endpoint`]: whether a refusal is about the endpoint (hold) or the rows (isolate): a table.
//! - [`poison`]: counting a batch's failed attempts, when to isolate it, and the isolation's plan
//!   (parts in row order, what halts it, what the next tick goes on with) (seed 001 case I).
//! - [`quarantine_budget`]: at most `poison.maxQuarantinedPerHour` rows quarantined in any hour.
//! - [`late`]: the late-arrival detector: the window of delivered keys behind the checkpoint, and
//!   what a recount by the database says of it.
//! - [`lease`]: lease decisions (acquire, renew, release) with the fencing token and skew margin.
//! - [`ids`]: deterministic event and batch ids, and the source fingerprint.
//! - [`horizon`]: what holds a poller's horizon back, who may see its query, and what
//!   `settle: "auto"` may conclude from the server (a replica, a prepared transaction).
//! - [`binlog`]: a binary-log source's positions, file names, server id, retention (issue 39).
//! - [`binlog_query`]: what a binary log's statement is to a poller (a bound, XA, a TRUNCATE, a
//!   change logged as a statement that stops it, or passed).
//! - [`slot`]: a logical source's replication slot as `status` shows it.
//! - [`finding`]: what the watchdog reports, one kind per thing a person should look at.
//! - [`watchdog`]: what the watchdog concludes about a poller (stalled, abandoned lease, failing,
//!   quarantine growing, source changed, horizon held, slot) from its status and what it saw last time.
//! - [`lag_series`]: the bounded lag series and findings the watchdog keeps for the status page.
//! - [`connection`]: whether a tick's read keeps its database connection for the next one.
//! - [`token`]: when a database access token (Entra, from the managed identity) is asked for again.
//! - [`window`]: batches in flight, acknowledged out of order, committed in order (seed 004).
//! - [`schedule`]: NCRONTAB and time-span timer schedules (for `dbtrigger dev`).

pub mod binlog;
pub mod binlog_query;
pub mod connection;
pub mod cursor;
pub mod endpoint;
pub mod event;
pub mod finding;
pub mod health;
pub mod horizon;
pub mod ids;
pub mod keyed;
pub mod lag_series;
pub mod late;
pub mod lease;
pub mod poison;
pub mod quarantine_budget;
pub mod schedule;
pub mod slot;
pub mod state;
pub mod token;
pub mod transitions;
pub mod watchdog;
pub mod window;

pub use cursor::{CursorValue, PkValue, Position};
pub use event::{Batch, Event, Op, SourceRow};
pub use lease::{LeaseRecord, LeaseStatus, LeaseTerms};
pub use state::{Checkpoint, DocumentError, StateDocument, Stats};
