//! PostgreSQL logical decoding: the `pgoutput` plugin read through the SQL interface.
//!
//! | file          | holds                                                              |
//! |---------------|--------------------------------------------------------------------|
//! | `pgoutput.rs` | the protocol's messages, decoded from bytes                        |
//! | `values.rs`   | a value's text form as JSON, by its type OID; LSNs                 |
//! | `changes.rs`  | transactions put together from messages; an event's row           |
//! | `progress.rs` | what is read, handed out, committed; how far the slot may move     |
//! | `setup.rs`    | what `dbtrigger sql` prints and `check` asks a live server         |
//! | `operate.rs`  | the slot for `reset` (where it stands, moved forward); a lost slot |
//! | `peek.rs`     | a peek in its own task: its connection, the query, the changes sent  |
//! | `source.rs`   | the [`crate::source::Source`]: peeks, hands out, advances the slot |

pub mod changes;
mod operate;
mod peek;
pub mod pgoutput;
pub mod progress;
pub mod setup;
mod source;
pub mod values;

pub use peek::READ_AHEAD_BYTES;
pub use source::{LogicalSource, read_ahead_rows};
