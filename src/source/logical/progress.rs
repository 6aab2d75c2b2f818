//! Where a logical source is, in pure code: the changes read and not yet handed out, the
//! transactions read (to know where each ends), what the state document has committed, and from
//! these, how far the slot may move.
//!
//! A change's position is (commit LSN, ordinal): the LSN of its transaction's commit record and
//! its number within the transaction, from 1. A position is stored as the cursor (the commit LSN,
//! an integer) and the key `ordinal`. The slot moves only past whole transactions the committed
//! checkpoint covers, never past a change that is read and not yet committed: a crash at any
//! point re-reads from the slot and skips what the checkpoint covers.

use crate::config::LOGICAL_KEY;
use crate::domain::{CursorValue, PkValue, Position};

/// A logical position: (commit LSN, ordinal).
pub type Key = (u64, u32);

/// The position a change is stored as.
pub fn position(commit_lsn: u64, ordinal: u32) -> Position {
    Position {
        cursor: CursorValue::Integer(commit_lsn as i64),
        pk: vec![(LOGICAL_KEY.to_string(), PkValue::Integer(i64::from(ordinal)))],
    }
}

/// The (commit LSN, ordinal) of a stored position; an error when it is not a logical source's
/// (a checkpoint written by a polling source under the same poller name).
pub fn key_of(position: &Position) -> Result<Key, String> {
    let not_logical = || {
        format!(
            "the checkpoint ({}) is not a logical source's (commit LSN, ordinal): the poller's source changed kind; reset it (`dbtrigger reset`)",
            crate::domain::state::describe(position)
        )
    };
    let CursorValue::Integer(lsn) = position.cursor else {
        return Err(not_logical());
    };
    match position.pk.as_slice() {
        [(name, PkValue::Integer(ordinal))] if name == LOGICAL_KEY && lsn >= 0 => {
            Ok((lsn as u64, u32::try_from(*ordinal).map_err(|_| not_logical())?))
        }
        _ => Err(not_logical()),
    }
}

/// A transaction read: where it commits, where it ends, how many changes it has, and how many
/// rows a peek returned for it (its messages, Begin to Commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    pub commit_lsn: u64,
    pub end_lsn: u64,
    pub changes: u32,
    pub rows: u32,
}

/// A read that reached the end of what was flushed: every transaction committed before `flushed`
/// was in it, the last of its changes being `last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadToEnd {
    pub flushed: u64,
    pub last: Option<Key>,
}

#[derive(Debug, Default)]
pub struct Progress {
    /// The last change handed out.
    handed_out: Option<Key>,
    /// Transactions read whose end the slot has not passed yet.
    marks: Vec<Mark>,
    read_to_end: Option<ReadToEnd>,
    /// What the state document holds, once known: the last change delivered and committed
    /// (`Some(None)`: nothing yet).
    committed: Option<Option<Key>>,
    /// How far the slot was moved by this process (or stood when this process looked).
    advanced: u64,
    /// Whether `advanced` is known: this process moved the slot, or read where it stands.
    slot_known: bool,
}

/// An idle tick takes the lease to move the slot to the end of the flushed WAL only when that
/// passes at least this much WAL (a WAL segment, by default): the server frees WAL a segment at a
/// time, and a smaller move would cost two writes of the state document at every idle tick of a
/// busy server for nothing.
pub const IDLE_MOVE_BYTES: u64 = 16 * 1024 * 1024;

/// The two places the slot may move to: the end of the last whole transaction the committed
/// checkpoint covers (or that checkpoint's commit LSN), and the end of the flushed WAL when a read
/// reached it and everything it returned is committed.
struct Targets {
    by_checkpoint: Option<u64>,
    at_end: Option<u64>,
}

impl Progress {
    /// A change was handed out.
    pub fn handed(&mut self, key: Key) {
        self.handed_out = Some(key);
    }

    /// The last change handed out.
    pub fn handed_out(&self) -> Option<Key> {
        self.handed_out
    }

    /// A transaction read. The marks stay in commit order: a peek returns transactions in that
    /// order, and one read again (a peek starts where the slot is) is found by a binary search,
    /// so that a peek of many transactions costs no more than its length.
    pub fn read(&mut self, mark: Mark) {
        if mark.end_lsn <= self.advanced {
            return;
        }
        if self.marks.last().is_none_or(|last| last.commit_lsn < mark.commit_lsn) {
            self.marks.push(mark);
        } else if let Err(at) = self.marks.binary_search_by_key(&mark.commit_lsn, |known| known.commit_lsn) {
            self.marks.insert(at, mark);
        }
    }

    /// The rows a peek returns before the changes after `after`, as far as the transactions
    /// read tell: those of the transactions read that commit at or before it and that the slot
    /// has not passed. A peek asks for these plus what it wants to read past them.
    pub fn rows_through(&self, after: Option<Key>) -> usize {
        let Some((commit_lsn, _)) = after else {
            return 0;
        };
        self.marks.iter().filter(|mark| mark.commit_lsn <= commit_lsn).map(|mark| mark.rows as usize).sum()
    }

    pub fn reached_end(&mut self, end: Option<ReadToEnd>) {
        self.read_to_end = end;
    }

    /// The state document's checkpoint, as committed.
    pub fn committed(&mut self, at: Option<Key>) {
        match self.committed {
            Some(known) if known >= at => {}
            _ => self.committed = Some(at),
        }
    }

    /// Where the slot may move now, when further than where it was moved: the end of the last
    /// whole transaction the committed checkpoint covers, or, when a read reached the end of the
    /// flushed WAL and everything it returned is committed, that end (a quiet publication on a
    /// busy server).
    ///
    /// The commit LSN of the committed checkpoint's own transaction is always a target: the
    /// server sends again every transaction committing at or after the slot's position, so the
    /// slot there holds the rest of that transaction (and everything after), whatever was read.
    pub fn advance_target(&self) -> Option<u64> {
        let targets = self.targets()?;
        targets.by_checkpoint.max(targets.at_end).filter(|target| *target > self.advanced)
    }

    /// Whether a tick owes the slot a move before it reads (and so takes the lease first, even
    /// with nothing to deliver): the committed checkpoint covers WAL the slot has not passed (a
    /// reset whose own move failed, a crash or a failed move after a commit), or a read reached
    /// the end of the flushed WAL at least [`IDLE_MOVE_BYTES`] past the slot. `false` while where
    /// the slot stands is not known.
    pub fn owed(&self) -> bool {
        if !self.slot_known {
            return false;
        }
        let Some(targets) = self.targets() else {
            return false;
        };
        targets.by_checkpoint.is_some_and(|target| target > self.advanced)
            || targets.at_end.is_some_and(|flushed| flushed >= self.advanced.saturating_add(IDLE_MOVE_BYTES))
    }

    /// Where the slot may go, wherever it stands: `None` while the committed checkpoint is not
    /// known. The one computation [`Progress::advance_target`] and [`Progress::owed`] share.
    fn targets(&self) -> Option<Targets> {
        let committed = self.committed?;
        let covered = |key: Key| committed.is_some_and(|committed| key <= committed);
        let by_checkpoint = self
            .marks
            .iter()
            .filter(|mark| covered((mark.commit_lsn, mark.changes)))
            .map(|mark| mark.end_lsn)
            .max()
            .max(committed.map(|(commit_lsn, _)| commit_lsn));
        let at_end = self.read_to_end.filter(|end| end.last.is_none_or(covered)).map(|end| end.flushed);
        Some(Targets { by_checkpoint, at_end })
    }

    /// Whether this process knows where the slot stands.
    pub fn slot_known(&self) -> bool {
        self.slot_known
    }

    /// The slot was moved to `lsn`: what it passed is forgotten.
    pub fn advanced(&mut self, lsn: u64) {
        self.advanced = self.advanced.max(lsn);
        self.slot_known = true;
        self.marks.retain(|mark| mark.end_lsn > lsn);
        if self.read_to_end.is_some_and(|end| end.flushed <= lsn) {
            self.read_to_end = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(commit_lsn: u64, end_lsn: u64, changes: u32) -> Mark {
        Mark { commit_lsn, end_lsn, changes, rows: changes + 2 }
    }

    #[test]
    fn positions_round_trip_and_foreign_ones_are_refused() {
        assert_eq!(key_of(&position(0x1_0000_0000, 3)), Ok((0x1_0000_0000, 3)));
        let polling = Position { cursor: CursorValue::Integer(5), pk: vec![("id".into(), PkValue::Integer(1))] };
        assert!(key_of(&polling).unwrap_err().contains("reset"));
        let xid = Position { cursor: CursorValue::Xid(5), pk: vec![(LOGICAL_KEY.into(), PkValue::Integer(1))] };
        assert!(key_of(&xid).is_err());
    }

    #[test]
    fn a_transaction_read_again_counts_once() {
        let mut progress = Progress::default();
        for mark_read in [mark(100, 120, 2), mark(200, 220, 3), mark(300, 320, 1)] {
            progress.read(mark_read);
        }
        // A second peek from the slot returns the same transactions, and one in between.
        for mark_read in [mark(100, 120, 2), mark(150, 160, 1), mark(200, 220, 3)] {
            progress.read(mark_read);
        }
        assert_eq!(progress.rows_through(Some((100, 2))), 4);
        assert_eq!(progress.rows_through(Some((200, 1))), 4 + 3 + 5);
        assert_eq!(progress.rows_through(Some((300, 1))), 4 + 3 + 5 + 3);
        progress.committed(Some((200, 3)));
        assert_eq!(progress.advance_target(), Some(220));
    }

    #[test]
    fn the_slot_moves_past_whole_committed_transactions_only() {
        let mut progress = Progress::default();
        progress.read(mark(100, 120, 2));
        progress.read(mark(200, 220, 3));
        assert_eq!(progress.advance_target(), None, "nothing committed");
        progress.committed(Some((100, 1)));
        assert_eq!(progress.advance_target(), Some(100), "half of the first transaction: to its commit LSN");
        progress.committed(Some((200, 2)));
        assert_eq!(progress.advance_target(), Some(200), "the first whole, the second half: its commit LSN");
        progress.advanced(200);
        assert_eq!(progress.advance_target(), None);
        progress.committed(Some((200, 3)));
        assert_eq!(progress.advance_target(), Some(220));
        // A checkpoint never moves back.
        progress.committed(Some((100, 2)));
        assert_eq!(progress.advance_target(), Some(220));
    }

    #[test]
    fn a_peek_asks_again_for_the_rows_the_slot_holds_before_the_read_position() {
        let mut progress = Progress::default();
        assert_eq!(progress.rows_through(Some((100, 1))), 0, "nothing read");
        progress.read(Mark { commit_lsn: 100, end_lsn: 120, changes: 2, rows: 5 });
        progress.read(Mark { commit_lsn: 200, end_lsn: 220, changes: 3, rows: 5 });
        progress.read(Mark { commit_lsn: 300, end_lsn: 320, changes: 1, rows: 3 });
        // Read again by a later peek (with a Relation message more, say): known once.
        progress.read(Mark { commit_lsn: 200, end_lsn: 220, changes: 3, rows: 6 });
        assert_eq!(progress.rows_through(None), 0);
        assert_eq!(progress.rows_through(Some((200, 1))), 10, "the transaction of the position counts");
        assert_eq!(progress.rows_through(Some((300, 1))), 13);
        // What the slot has passed is not returned again.
        progress.committed(Some((200, 3)));
        progress.advanced(220);
        assert_eq!(progress.rows_through(Some((300, 1))), 3);
    }

    /// Regression (issue 37, finding 1 (b)(c)): with no transaction read (a restart, a reset whose
    /// own move failed), the slot never moved while the transaction of the checkpoint was larger
    /// than a peek could keep. The commit LSN of a committed (c, k) is always safe: the server
    /// sends every transaction committing at or after the slot's position again.
    #[test]
    fn the_slot_moves_to_the_committed_checkpoints_commit_lsn_with_nothing_read() {
        let mut progress = Progress::default();
        progress.committed(Some((5000, 7)));
        assert_eq!(progress.advance_target(), Some(5000));
        progress.advanced(5000);
        assert_eq!(progress.advance_target(), None);
        let mut reset = Progress::default();
        reset.committed(Some((9000, 0)));
        assert_eq!(reset.advance_target(), Some(9000));
    }

    #[test]
    fn a_read_to_the_end_lets_a_quiet_slot_move_once_all_it_returned_is_committed() {
        let mut progress = Progress::default();
        progress.read(mark(100, 120, 1));
        progress.reached_end(Some(ReadToEnd { flushed: 5000, last: Some((100, 1)) }));
        assert_eq!(progress.advance_target(), None, "the checkpoint is not known yet");
        progress.committed(None);
        assert_eq!(progress.advance_target(), None, "nothing committed, a change returned");
        progress.committed(Some((100, 1)));
        assert_eq!(progress.advance_target(), Some(5000));
        progress.advanced(5000);
        assert_eq!(progress.advance_target(), None);
        // Nothing returned at all: the end is covered by any checkpoint known, even none.
        let mut fresh = Progress::default();
        fresh.reached_end(Some(ReadToEnd { flushed: 700, last: None }));
        fresh.committed(None);
        assert_eq!(fresh.advance_target(), Some(700));
        progress.reached_end(Some(ReadToEnd { flushed: 9000, last: None }));
        assert_eq!(progress.advance_target(), Some(9000));
        // A change returned past the checkpoint holds the end back.
        progress.reached_end(Some(ReadToEnd { flushed: 12000, last: Some((9500, 1)) }));
        assert_eq!(progress.advance_target(), None);
    }

    /// Issue 37, finding 4: a tick takes the lease before it reads when it owes the slot a move,
    /// so that the slot moves only under the lease; a quiet publication's end of WAL is owed only
    /// once it is a segment away.
    #[test]
    fn a_move_is_owed_for_what_the_checkpoint_covers_and_for_a_far_end_of_wal() {
        let mut progress = Progress::default();
        progress.committed(Some((5000, 2)));
        assert!(!progress.owed(), "where the slot stands is not known yet");
        progress.advanced(4000);
        assert!(progress.owed(), "the checkpoint's transaction is past the slot");
        progress.advanced(5000);
        assert!(!progress.owed());
        progress.read(mark(5000, 5100, 2));
        assert!(progress.owed(), "its whole transaction is covered: to its end");
        progress.advanced(5100);
        progress.reached_end(Some(ReadToEnd { flushed: 5100 + IDLE_MOVE_BYTES - 1, last: None }));
        assert!(!progress.owed(), "less than a segment of WAL to pass");
        assert_eq!(progress.advance_target(), Some(5100 + IDLE_MOVE_BYTES - 1), "made when the lease is held anyway");
        progress.reached_end(Some(ReadToEnd { flushed: 5100 + IDLE_MOVE_BYTES, last: None }));
        assert!(progress.owed());
        progress.reached_end(Some(ReadToEnd { flushed: 5100 + IDLE_MOVE_BYTES, last: Some((9000, 1)) }));
        assert!(!progress.owed(), "a change past the checkpoint holds the end back");
    }
}
