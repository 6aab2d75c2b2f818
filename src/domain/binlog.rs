//! A binary-log source's positions (issue 39), as pure data: a (file, offset) pair packed into the
//! one integer a checkpoint's cursor holds, the file names the server uses, the server id a reader
//! registers with, and whether the checkpoint's file is still kept.
//!
//! A binary log's files are `<base>.<number>` (`mysql-bin.000042`), numbered in the order they
//! were written; an offset is at most 4 GiB (a v4 event header's 32-bit position). So
//! `number << 32 | offset` orders positions as the server wrote them: commit order.

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
}
