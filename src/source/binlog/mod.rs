//! The MySQL/MariaDB binary log, read as a replica (`source.kind: "binlog"`, issue 39).
//!
//! | file        | holds                                                                   |
//! |-------------|-------------------------------------------------------------------------|
//! | `server.rs` | the server's questions: connecting, the log's end and files, the dump    |
//! | `events.rs` | from events to changes: positions, transactions, rows of the tables      |
//! | `values.rs` | a row's values as the polling MySQL source's JSON                        |
//! | `setup.rs`  | what `dbtrigger sql` prints and `check` asks a live server               |
//! | `cascades.rs` | `check`'s warning: the cascading foreign keys whose changes are not logged |
//! | `source.rs` | the [`crate::source::Source`]: reads, counts, rests, retention           |
//!
//! The positions and their decisions (packing, file names, server id, loss) are pure, in
//! [`crate::domain::binlog`].

pub mod cascades;
pub mod events;
pub mod server;
pub mod setup;
mod source;
pub mod values;

pub use source::{At, BinlogSource, GTID_KEY, GTID_POS_KEY, Key, at_of, key_of, position, position_marked, rows_of};
