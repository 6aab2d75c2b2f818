//! A binary-log source's positions (issue 39), as pure data: a (file, offset) pair packed into the
//! one integer a checkpoint's cursor holds, the file names the server uses, the server id a reader
//! registers with, and whether the checkpoint's file is still kept.
//!
//! A binary log's files are `<base>.<number>` (`mysql-bin.000042`), numbered in the order they
//! were written; an offset is at most 4 GiB (a v4 event header's 32-bit position). So
//! `number << 32 | offset` orders positions as the server wrote them: commit order.
//!
//! Beside a position, a MariaDB server's checkpoint records GTIDs ([`Gtid`], [`GtidPos`],
//! [`GtidMark`]): what survives a failover or a reset of the log, where a file and an offset do
//! not. [`judge`] decides, when a read starts, whether the position still names the place the
//! checkpoint was read from, must be found again by GTID, or is lost.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

/// A place in the binary log: a file's number and an offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BinlogPos {
    pub file: u32,
    pub offset: u32,
}

/// The first event of every binary log file starts here (after the 4-byte magic).
pub const FIRST_OFFSET: u32 = 4;

impl BinlogPos {
    /// The integer a checkpoint's cursor holds: positive, and ordered as the positions are.
    pub fn cursor(self) -> i64 {
        (i64::from(self.file) << 32) | i64::from(self.offset)
    }

    /// The position a checkpoint's cursor holds; `None` for a negative one or a file number
    /// past what a name can carry.
    pub fn of_cursor(cursor: i64) -> Option<BinlogPos> {
        let cursor = u64::try_from(cursor).ok()?;
        Some(BinlogPos { file: u32::try_from(cursor >> 32).ok()?, offset: cursor as u32 })
    }
}

/// How the server names its files: a base and a number written with at least `width` digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileNames {
    pub base: String,
    pub width: usize,
}

impl FileNames {
    /// The naming of `name` and its number (`mysql-bin.000042` → `mysql-bin`, 6 digits, 42).
    pub fn parse(name: &str) -> Option<(FileNames, u32)> {
        let (base, digits) = name.rsplit_once('.')?;
        if base.is_empty() || digits.is_empty() || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
            return None;
        }
        let number = digits.parse::<u32>().ok()?;
        Some((FileNames { base: base.to_string(), width: digits.len() }, number))
    }

    pub fn name(&self, number: u32) -> String {
        format!("{}.{:0width$}", self.base, number, width = self.width)
    }

    /// The number of `name`, when it is one of this naming's files.
    pub fn number(&self, name: &str) -> Option<u32> {
        let (naming, number) = FileNames::parse(name)?;
        (naming.base == self.base).then_some(number)
    }
}

/// The server id a poller registers with when `source.serverId` is not set: derived from the app
/// and the poller, so that two pollers never share one (a server drops the older of two replicas
/// with the same id), in the upper half of the range, away from the small ids people give their
/// servers by hand.
pub fn derived_server_id(app: &str, poller: &str) -> u32 {
    let digest = Sha256::digest(format!("dbtrigger-binlog\n{app}\n{poller}").as_bytes());
    let number = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    number | 0x8000_0000
}

/// Who reads a poller's binary log. Each registers with a replica id of its own, so that none
/// ends another's read (a server drops the older of two replicas with one id): `status` runs
/// beside a tick, in another process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reader {
    /// A tick's read: the poller's server id.
    Tick,
    /// `status`'s count of the changes after the checkpoint: the id's lowest bit flipped.
    Count,
    /// `status`'s look at the first change waiting: the id's second bit flipped.
    Look,
}

/// The replica id `reader` registers with for a poller of `server_id`: within the four ids that
/// differ from it in the two lowest bits, distinct for each reader.
pub fn reader_id(server_id: u32, reader: Reader) -> u32 {
    match reader {
        Reader::Tick => server_id,
        Reader::Count => server_id ^ 1,
        Reader::Look => server_id ^ 2,
    }
}

/// Why the checkpoint's place in the binary log is gone, if it is: its file is older than the
/// oldest the server keeps (purged, by hand or by `binlog_expire_logs_seconds`).
pub fn lost_reason(checkpoint: BinlogPos, oldest_kept: u32, names: &FileNames) -> Option<String> {
    (checkpoint.file < oldest_kept).then(|| {
        format!(
            "the checkpoint is in binary log {}, and the oldest the server keeps is {}: the files between were purged \
             before the poller read them",
            names.name(checkpoint.file),
            names.name(oldest_kept)
        )
    })
}

/// How far the checkpoint is behind the end of the binary log: bytes and files (`sizes` are the
/// server's files in order, `(number, size)`).
pub fn behind(checkpoint: BinlogPos, sizes: &[(u32, u64)]) -> (u64, u32) {
    let mut bytes = 0u64;
    let mut files = 0u32;
    for (number, size) in sizes {
        if *number < checkpoint.file {
            continue;
        }
        if *number == checkpoint.file {
            bytes += size.saturating_sub(u64::from(checkpoint.offset));
        } else {
            bytes += size;
            files += 1;
        }
    }
    (bytes, files)
}

/// A MariaDB GTID: `domain-server-sequence`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gtid {
    pub domain: u32,
    pub server: u32,
    pub seq: u64,
}

impl Gtid {
    /// `0-1-1234`; `None` for anything else.
    pub fn parse(text: &str) -> Option<Gtid> {
        fn number(part: Option<&str>) -> Option<&str> {
            part.filter(|part| !part.is_empty() && part.bytes().all(|byte| byte.is_ascii_digit()))
        }
        let mut parts = text.trim().splitn(3, '-');
        let domain = number(parts.next())?.parse().ok()?;
        let server = number(parts.next())?.parse().ok()?;
        let seq = number(parts.next())?.parse().ok()?;
        Some(Gtid { domain, server, seq })
    }
}

impl std::fmt::Display for Gtid {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "{}-{}-{}", self.domain, self.server, self.seq)
    }
}

/// A GTID position as MariaDB writes one (`@@gtid_binlog_pos`, `BINLOG_GTID_POS()`,
/// `@slave_connect_state`): the last GTID of each replication domain, so every transaction up to
/// it. Written with its domains in order, so that one position has one text.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct GtidPos(BTreeMap<u32, Gtid>);

impl GtidPos {
    /// `0-1-5,1-2-9` (spaces and an empty text allowed: the empty position); `None` when a part is
    /// not a GTID or a domain comes twice.
    pub fn parse(text: &str) -> Option<GtidPos> {
        let mut domains = BTreeMap::new();
        for part in text.split(',').map(str::trim).filter(|part| !part.is_empty()) {
            let gtid = Gtid::parse(part)?;
            if domains.insert(gtid.domain, gtid).is_some() {
                return None;
            }
        }
        Some(GtidPos(domains))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// How many replication domains the position names.
    pub fn domains(&self) -> usize {
        self.0.len()
    }

    /// Whether `gtid`'s transaction is at or before this position: its domain's last GTID has a
    /// sequence number at least as high (sequence numbers grow within a domain, in every log).
    pub fn contains(&self, gtid: &Gtid) -> bool {
        self.0.get(&gtid.domain).is_some_and(|last| last.seq >= gtid.seq)
    }

    /// Why a server whose binary log ends at `logged` (`@@gtid_binlog_pos`) cannot place this
    /// position, an operator's reset target: a domain it never logged, or a transaction after
    /// its last in a domain (ahead of the server). `None`: the server may serve it (whether it
    /// still keeps the files is the server's to say).
    pub fn beyond(&self, logged: &GtidPos) -> Option<String> {
        for (domain, gtid) in &self.0 {
            match logged.0.get(domain) {
                None => {
                    return Some(format!(
                        "the server's binary log has no transaction of domain {domain} (it is at {logged})"
                    ));
                }
                Some(last) if last.seq < gtid.seq => {
                    return Some(format!(
                        "{gtid} is ahead of the server's binary log (its last transaction of domain {domain} is {last})"
                    ));
                }
                Some(_) => {}
            }
        }
        None
    }

    /// Whether every transaction up to `other` is up to this position too.
    pub fn covers(&self, other: &GtidPos) -> bool {
        other.0.values().all(|gtid| self.contains(gtid))
    }

    /// The position after `gtid`'s transaction too.
    pub fn advance(&mut self, gtid: Gtid) {
        self.0.insert(gtid.domain, gtid);
    }
}

impl std::fmt::Display for GtidPos {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.values().map(Gtid::to_string).collect();
        formatter.write_str(&parts.join(","))
    }
}

/// What a MariaDB checkpoint records beside its (position, ordinal): the GTID of the transaction
/// at the position (`None`: the position is the end of the log, or was given by file and offset,
/// and no transaction names it yet) and the GTID position before that transaction, from which a
/// dump by GTID sends it again on any server of the same history.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GtidMark {
    pub tx: Option<Gtid>,
    pub before: GtidPos,
}

/// A checkpoint placed by GTID only (`reset --to-cursor 0-1-1234`): its file position is not known
/// yet, and the next read finds it by GTID.
pub const BY_GTID_ONLY: BinlogPos = BinlogPos { file: 0, offset: 0 };

/// How a read starts from a checkpoint, judged from what the server says when it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// The checkpoint's file position is on this server's log: read from it (checking that the
    /// transaction there is the checkpoint's, [`GtidMark::tx`], or that `BINLOG_GTID_POS` there
    /// is the checkpoint's GTID position when no transaction names it).
    ByPosition,
    /// Another server (a failover), or a checkpoint placed by GTID only: a dump by GTID from the
    /// checkpoint's GTID position finds its transaction again, and the checkpoint is re-based on
    /// this server's file positions.
    ByGtid,
    /// Nothing on this server can say where the checkpoint is: the poller stops until reset.
    Lost { reason: String },
}

/// What [`judge`] weighs.
#[derive(Debug, Clone)]
pub struct Sight<'a> {
    /// The server identity the checkpoint was read on (the state document's), `None`: not known.
    pub recorded: Option<&'a str>,
    /// The identity of the server read now.
    pub current: &'a str,
    pub at: BinlogPos,
    /// The changes of the checkpoint's transaction delivered.
    pub ordinal: u32,
    pub mark: Option<&'a GtidMark>,
    /// The server's `@@gtid_binlog_pos`: every transaction it has logged.
    pub server_pos: &'a GtidPos,
    /// The files the server keeps: the oldest, and where the log ends.
    pub oldest_kept: u32,
    pub end: BinlogPos,
}

/// Where a read from a checkpoint starts, or why it cannot (MariaDB). The GTID position is the
/// truth a checkpoint keeps; the file position is how the same server's log is read fast:
///
/// - a server whose GTIDs do not reach the checkpoint's GTID position has not logged what was
///   delivered: the log was reset (`RESET MASTER` starts the GTIDs again, and a later read by GTID
///   would take new transactions for old ones), or the server is behind (a failover to a replica
///   that had not caught up: what it lacks is lost on it). Lost, never silently resumed;
/// - another server than the one the checkpoint was read on (a failover): by GTID;
/// - the same server, the checkpoint's file no longer kept or past the end of the log: its log was
///   reset or replaced under the checkpoint, and its GTIDs may name other transactions now: lost;
/// - otherwise by position (the read checks the transaction there is the checkpoint's).
pub fn judge(sight: &Sight<'_>, names: &FileNames) -> Resume {
    let Some(mark) = sight.mark else {
        return match sight.recorded {
            Some(recorded) if recorded != sight.current => Resume::Lost {
                reason: format!(
                    "the checkpoint was read on server {recorded} and this is {}, and it has no GTID position to be found \
                     again by: `dbtrigger reset` it on this server",
                    sight.current
                ),
            },
            _ => Resume::ByPosition,
        };
    };
    // Some of the checkpoint's transaction delivered (its ordinal): the server must have it too.
    let delivered_tx = mark.tx.filter(|_| sight.ordinal > 0);
    if !sight.server_pos.covers(&mark.before) || delivered_tx.is_some_and(|tx| !sight.server_pos.contains(&tx)) {
        return Resume::Lost {
            reason: format!(
                "the server's GTID position ({}) does not reach the checkpoint's ({}): the server has not logged \
                 transactions already delivered. Its binary log was reset (RESET MASTER starts its GTIDs again), or it is \
                 a replica behind the server the checkpoint was read on. If it is catching up, wait and `dbtrigger reset \
                 <poller> --to-cursor {}`",
                show(sight.server_pos),
                delivered_tx
                    .map(|tx| format!("{}, and {tx} partly or wholly delivered", show(&mark.before)))
                    .unwrap_or_else(|| show(&mark.before)),
                show(&mark.before)
            ),
        };
    }
    let same = sight.recorded.is_none_or(|recorded| recorded == sight.current);
    if !same || sight.at == BY_GTID_ONLY {
        return Resume::ByGtid;
    }
    if sight.at.file < sight.oldest_kept {
        return Resume::ByPosition; // the purge is named by the read ([`lost_reason`])
    }
    if sight.at > sight.end {
        return Resume::Lost {
            reason: format!(
                "the checkpoint is at {}:{}, past the end of the server's binary log ({}:{}): the log was reset (RESET \
                 MASTER) or replaced under it, and its GTIDs may name other transactions now. If the server's GTID state \
                 was carried over, `dbtrigger reset <poller> --to-cursor {}`",
                names.name(sight.at.file),
                sight.at.offset,
                names.name(sight.end.file),
                sight.end.offset,
                show(&mark.before)
            ),
        };
    }
    Resume::ByPosition
}

/// A GTID position for a message (`(empty)` for none).
fn show(pos: &GtidPos) -> String {
    if pos.is_empty() { "(empty)".into() } else { pos.to_string() }
}

/// The ordinal a checkpoint re-based by GTID keeps: the changes of its transaction already
/// delivered, when the first transaction a dump by GTID sends is that transaction; 0 otherwise
/// (the transaction comes later on this server, in another domain's order: its first changes are
/// delivered again, at least once).
pub fn rebased_ordinal(mark: &GtidMark, ordinal: u32, first: Option<Gtid>) -> u32 {
    match (mark.tx, first) {
        (Some(tx), Some(first)) if tx == first => ordinal,
        _ => 0,
    }
}

/// Whether a re-base must ask the server for the checkpoint's transaction itself: some of it was
/// delivered, and the first transaction a dump by GTID sent is another (another domain's first,
/// or a server that never logged it, its history diverged). The GTID position through that
/// transaction, which a server that does not hold it refuses to send from; `None`: no need.
pub fn probe_through(mark: &GtidMark, ordinal: u32, first: Option<Gtid>) -> Option<GtidPos> {
    let tx = mark.tx.filter(|_| ordinal > 0)?;
    if first == Some(tx) {
        return None;
    }
    let mut through = mark.before.clone();
    through.advance(tx);
    Some(through)
}

/// A change of a transaction read after a checkpoint is delivered unless the checkpoint covers it:
/// its transaction is at or before the checkpoint's GTID position (a dump by position re-reads
/// such transactions only after a re-base across domains ordered differently on the new server).
pub fn covered_by(mark: Option<&GtidMark>, tx: Option<Gtid>) -> bool {
    matches!((mark, tx), (Some(mark), Some(tx)) if mark.before.contains(&tx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_order_as_the_server_wrote_them_and_round_trip() {
        let early = BinlogPos { file: 1, offset: u32::MAX };
        let late = BinlogPos { file: 2, offset: 4 };
        assert!(early.cursor() < late.cursor());
        assert_eq!(BinlogPos::of_cursor(late.cursor()), Some(late));
        assert_eq!(BinlogPos::of_cursor(early.cursor()), Some(early));
        assert_eq!(BinlogPos::of_cursor(-1), None);
        let last = BinlogPos { file: u32::MAX >> 1, offset: u32::MAX };
        assert_eq!(BinlogPos::of_cursor(last.cursor()), Some(last));
    }

    #[test]
    fn file_names_parse_and_format() {
        let (names, number) = FileNames::parse("mysql-bin.000042").unwrap();
        assert_eq!((names.base.as_str(), names.width, number), ("mysql-bin", 6, 42));
        assert_eq!(names.name(7), "mysql-bin.000007");
        assert_eq!(names.name(1_234_567), "mysql-bin.1234567");
        assert_eq!(names.number("mysql-bin.000100"), Some(100));
        assert_eq!(names.number("other.000100"), None);
        assert_eq!(FileNames::parse("nodots"), None);
        assert_eq!(FileNames::parse("a.b"), None);
    }

    #[test]
    fn each_reader_of_a_poller_registers_with_an_id_of_its_own() {
        for server_id in [derived_server_id("app", "orders"), 4242, 4243, u32::MAX] {
            let ids: Vec<u32> = [Reader::Tick, Reader::Count, Reader::Look]
                .iter()
                .map(|reader| reader_id(server_id, *reader))
                .collect();
            assert_eq!(ids[0], server_id);
            assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2], "{ids:?}");
            assert!(ids.iter().all(|id| id & !3 == server_id & !3), "{ids:?}");
        }
    }

    #[test]
    fn server_ids_are_stable_distinct_and_high() {
        let one = derived_server_id("app", "orders");
        assert_eq!(one, derived_server_id("app", "orders"));
        assert_ne!(one, derived_server_id("app", "customers"));
        assert!(one >= 0x8000_0000);
    }

    #[test]
    fn a_checkpoint_before_the_oldest_file_kept_is_lost() {
        let names = FileNames { base: "b".into(), width: 6 };
        assert!(lost_reason(BinlogPos { file: 3, offset: 9 }, 4, &names).unwrap().contains("b.000003"));
        assert_eq!(lost_reason(BinlogPos { file: 4, offset: 9 }, 4, &names), None);
    }

    #[test]
    fn behind_counts_the_rest_of_the_file_and_the_files_after() {
        let sizes = [(1, 1000), (2, 500), (3, 300)];
        assert_eq!(behind(BinlogPos { file: 2, offset: 100 }, &sizes), (400 + 300, 1));
        assert_eq!(behind(BinlogPos { file: 3, offset: 300 }, &sizes), (0, 0));
    }

    fn pos(text: &str) -> GtidPos {
        GtidPos::parse(text).unwrap()
    }

    #[test]
    fn gtids_and_positions_parse_print_and_compare() {
        assert_eq!(Gtid::parse("0-1-1234"), Some(Gtid { domain: 0, server: 1, seq: 1234 }));
        for bad in ["", "0-1", "0-1-", "a-1-2", "0-1-2-3", "-1-2", "0-1-99999999999999999999999"] {
            assert_eq!(Gtid::parse(bad), None, "{bad:?}");
        }
        let position = pos(" 1-2-9, 0-1-5 ");
        assert_eq!(position.to_string(), "0-1-5,1-2-9", "domains in order, one text per position");
        assert_eq!(GtidPos::parse("").unwrap(), GtidPos::default());
        assert_eq!(GtidPos::parse("0-1-5,0-2-6"), None, "a domain twice");
        assert_eq!(GtidPos::parse("0-1-5,x"), None);
        let logged = pos("0-1-9,1-2-4");
        assert_eq!(pos("0-1-9").beyond(&logged), None);
        assert_eq!(pos("0-1-3,1-2-4").beyond(&logged), None);
        assert_eq!(
            pos("0-1-10").beyond(&logged).unwrap(),
            "0-1-10 is ahead of the server's binary log (its last transaction of domain 0 is 0-1-9)"
        );
        assert!(pos("2-1-1").beyond(&logged).unwrap().contains("no transaction of domain 2 (it is at 0-1-9,1-2-4)"));
        assert!(position.contains(&Gtid::parse("0-7-5").unwrap()), "sequence numbers, whatever the server");
        assert!(!position.contains(&Gtid::parse("0-1-6").unwrap()));
        assert!(!position.contains(&Gtid::parse("2-1-1").unwrap()), "a domain it has not seen");
        assert!(position.covers(&pos("0-1-4,1-2-9")));
        assert!(position.covers(&GtidPos::default()));
        assert!(!position.covers(&pos("0-1-4,3-1-1")));
        assert!(!pos("0-1-3").covers(&pos("0-1-4")));
        let mut next = position.clone();
        next.advance(Gtid::parse("1-2-10").unwrap());
        assert_eq!(next.to_string(), "0-1-5,1-2-10");
    }

    fn sight<'a>(recorded: Option<&'a str>, mark: Option<&'a GtidMark>, server_pos: &'a GtidPos) -> Sight<'a> {
        Sight {
            recorded,
            current: "1",
            at: BinlogPos { file: 3, offset: 400 },
            ordinal: 0,
            mark,
            server_pos,
            oldest_kept: 2,
            end: BinlogPos { file: 4, offset: 900 },
        }
    }

    #[test]
    fn a_read_starts_by_position_on_the_same_log_by_gtid_on_another_server_and_never_on_a_reset_one() {
        let names = FileNames { base: "binlog".into(), width: 6 };
        let mark = GtidMark { tx: Gtid::parse("0-1-11"), before: pos("0-1-10") };
        let server = pos("0-1-20");
        assert_eq!(judge(&sight(Some("1"), Some(&mark), &server), &names), Resume::ByPosition);
        assert_eq!(judge(&sight(None, Some(&mark), &server), &names), Resume::ByPosition, "no server recorded yet");
        // A failover: another server that has logged everything delivered.
        assert_eq!(judge(&sight(Some("2"), Some(&mark), &server), &names), Resume::ByGtid);
        // Placed by GTID only (reset --to-cursor 0-1-10).
        let mut by_gtid = sight(Some("1"), Some(&mark), &server);
        by_gtid.at = BY_GTID_ONLY;
        assert_eq!(judge(&by_gtid, &names), Resume::ByGtid);
        // RESET MASTER: the GTIDs started again (or a replica behind): lost, on any server.
        let reset = pos("0-1-3");
        for recorded in [Some("1"), Some("2"), None] {
            let Resume::Lost { reason } = judge(&sight(recorded, Some(&mark), &reset), &names) else {
                panic!("a server behind the checkpoint's GTID position is lost");
            };
            assert!(reason.contains("(0-1-3)") && reason.contains("--to-cursor 0-1-10"), "{reason}");
        }
        assert!(matches!(judge(&sight(Some("1"), Some(&mark), &GtidPos::default()), &names), Resume::Lost { .. }));
        // A failover back to a server that lacks the transaction the checkpoint is in, partly
        // delivered: lost; with none of it delivered, the server need not have it.
        let behind = pos("0-1-10");
        let mut partly = sight(Some("2"), Some(&mark), &behind);
        partly.ordinal = 1;
        let Resume::Lost { reason } = judge(&partly, &names) else { panic!("a delivered transaction is missing") };
        assert!(reason.contains("0-1-11 partly or wholly delivered"), "{reason}");
        assert_eq!(judge(&sight(Some("2"), Some(&mark), &behind), &names), Resume::ByGtid);
        // The same server, its log reset and its GTID state carried over: past the end, lost.
        let mut past = sight(Some("1"), Some(&mark), &server);
        past.end = BinlogPos { file: 1, offset: 4 };
        past.oldest_kept = 1;
        let Resume::Lost { reason } = judge(&past, &names) else { panic!("past the end is lost") };
        assert!(reason.contains("binlog.000003:400"), "{reason}");
        // A purged file is left to the read, which names the purge.
        let mut purged = sight(Some("1"), Some(&mark), &server);
        purged.oldest_kept = 4;
        assert_eq!(judge(&purged, &names), Resume::ByPosition);
        // No GTIDs recorded (MySQL, or a checkpoint older than them): by position on its server only.
        assert_eq!(judge(&sight(Some("1"), None, &server), &names), Resume::ByPosition);
        assert!(matches!(judge(&sight(Some("2"), None, &server), &names), Resume::Lost { .. }));
    }

    #[test]
    fn a_rebased_checkpoint_keeps_its_ordinal_only_on_its_own_transaction() {
        let mark = GtidMark { tx: Gtid::parse("0-1-11"), before: pos("0-1-10") };
        assert_eq!(rebased_ordinal(&mark, 7, Gtid::parse("0-1-11")), 7);
        assert_eq!(rebased_ordinal(&mark, 7, Gtid::parse("1-3-4")), 0);
        assert_eq!(rebased_ordinal(&mark, 7, None), 0);
        let end = GtidMark { tx: None, before: pos("0-1-10") };
        assert_eq!(rebased_ordinal(&end, 0, Gtid::parse("0-1-11")), 0);
    }

    #[test]
    fn a_partly_delivered_transaction_not_sent_first_is_asked_for() {
        let mark = GtidMark { tx: Gtid::parse("0-2-11"), before: pos("0-1-10,1-3-4") };
        assert_eq!(probe_through(&mark, 1, Gtid::parse("0-2-11")), None, "sent first: the server holds it");
        assert_eq!(probe_through(&mark, 0, Gtid::parse("0-1-11")), None, "none of it delivered");
        assert_eq!(probe_through(&mark, 3, Gtid::parse("0-1-11")), Some(pos("0-2-11,1-3-4")));
        assert_eq!(probe_through(&mark, 3, None), Some(pos("0-2-11,1-3-4")));
        assert_eq!(probe_through(&GtidMark { tx: None, before: pos("0-1-10") }, 3, None), None);
    }

    #[test]
    fn transactions_the_checkpoints_gtid_position_holds_are_covered() {
        let mark = GtidMark { tx: None, before: pos("0-1-10,1-2-4") };
        assert!(covered_by(Some(&mark), Gtid::parse("1-2-4")));
        assert!(covered_by(Some(&mark), Gtid::parse("0-3-9")));
        assert!(!covered_by(Some(&mark), Gtid::parse("0-1-11")));
        assert!(!covered_by(Some(&mark), Gtid::parse("2-1-1")));
        assert!(!covered_by(None, Gtid::parse("0-1-1")));
        assert!(!covered_by(Some(&mark), None));
    }
}
