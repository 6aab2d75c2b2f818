//! Whether a tick's delivering read keeps its database connection for the tick's next read (issue
//! 38), and whether a kept connection is checked before it is used again.
//!
//! A connection given back to the shared pool is pinged on its way back (sqlx does so on every
//! release, whatever the pool's options), and the next read takes it or another one from the pool:
//! behind a database a few milliseconds away that is one more round trip a page, which a
//! catch-up's serial reads pay in full. So a read that leaves more rows to read keeps its
//! connection, and the permit of the database's cap it counts against, for the next read; the tick
//! gives it back when it ends. It never keeps one that the other questions of the database need:
//! with no permit of the cap left free, the connection goes back after each read, as before.

use std::time::Duration;

/// What a delivering read does with its connection once it answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterRead {
    /// Kept, with its permit of the cap, for the tick's next read.
    Keep,
    /// Given back to the pool, and its permit to the cap.
    GiveBack,
}

/// What a read that answered knows when it decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadEnd {
    /// The read stopped at a limit: the tick may read again at once. `false`: the source had no
    /// more rows, and the tick reads nothing more.
    pub more_to_read: bool,
    /// The connection may serve another question at once: not marked to close (a read that left
    /// much of a result unread closes its connection instead of draining it), and its last result
    /// read to its end (one left partly unread still holds its query open on the server).
    pub reusable: bool,
    /// Permits of the database's cap free besides this read's own: none means another question
    /// waits, or would.
    pub free_permits: usize,
}

/// Keep the connection only when a next read is likely and costs no one else a connection.
pub fn after_read(end: ReadEnd) -> AfterRead {
    if end.more_to_read && end.reusable && end.free_permits > 0 { AfterRead::Keep } else { AfterRead::GiveBack }
}

/// What a read does first with the connection kept by the tick's previous read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BeforeReuse {
    /// Used as it is: it answered a moment ago.
    Use,
    /// Pinged first (replaced if it does not answer): it was kept idle as long as the pool
    /// would have pinged it after.
    Ping,
}

/// A kept connection idle for `idle` is checked as the pool checks one idle for `ping_after` or
/// longer, so that keeping it never makes a read fail where the pool's connection would not.
pub fn before_reuse(idle: Duration, ping_after: Duration) -> BeforeReuse {
    if idle >= ping_after { BeforeReuse::Ping } else { BeforeReuse::Use }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_with_more_to_read_a_reusable_connection_and_a_free_permit() {
        for more_to_read in [false, true] {
            for reusable in [false, true] {
                for free_permits in [0, 1, 9] {
                    let decided = after_read(ReadEnd { more_to_read, reusable, free_permits });
                    let expected = if more_to_read && reusable && free_permits > 0 {
                        AfterRead::Keep
                    } else {
                        AfterRead::GiveBack
                    };
                    assert_eq!(decided, expected, "{more_to_read} {reusable} {free_permits}");
                }
            }
        }
    }

    #[test]
    fn a_connection_kept_idle_as_long_as_the_pool_pings_after_is_pinged() {
        let second = Duration::from_secs(1);
        assert_eq!(before_reuse(Duration::from_millis(999), second), BeforeReuse::Use);
        assert_eq!(before_reuse(second, second), BeforeReuse::Ping);
        assert_eq!(before_reuse(Duration::from_secs(30), second), BeforeReuse::Ping);
    }
}
