//! PostgreSQL's `pgoutput` logical replication protocol (version 1), decoded from the bytes one
//! message at a time: pure code, no I/O. Each row `pg_logical_slot_peek_binary_changes` returns
//! holds one message.
//!
//! Only what a change feed needs is kept: transaction bounds (Begin, Commit), the shape of each
//! relation (Relation), the changes (Insert, Update, Delete, Truncate). Origin, Type and Message
//! are recognised and skipped. Any malformed input is an error naming what and where, never a
//! panic.

/// One column's value in a tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Datum {
    Null,
    /// A TOASTed value the change left as it was: the server did not send it.
    UnchangedToast,
    /// The value in its type's text form.
    Text(String),
}

/// A relation's column, as a Relation message describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    pub name: String,
    pub type_oid: u32,
    /// Part of the replica identity (the key an update or delete names the old row by).
    pub key: bool,
}

/// A Relation message: what the following changes of this OID look like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub oid: u32,
    pub namespace: String,
    pub name: String,
    /// `d` (default: the primary key), `n` (nothing), `f` (full), `i` (an index).
    pub replica_identity: u8,
    pub columns: Vec<RelationColumn>,
    /// `schema.table`, made once (every change of the relation names it).
    qualified: String,
}

impl Relation {
    /// `schema.table`.
    pub fn qualified_name(&self) -> String {
        self.qualified.clone()
    }
}

/// Which old row an Update or a Delete carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OldKind {
    /// `K`: the replica identity's columns only (the others are null).
    Key,
    /// `O`: the whole old row (`REPLICA IDENTITY FULL`).
    Full,
}

/// One decoded pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Begin {
        /// The LSN of the transaction's commit record.
        final_lsn: u64,
        /// Microseconds since 2000-01-01 00:00:00 UTC.
        commit_time: i64,
        xid: u32,
    },
    Commit {
        commit_lsn: u64,
        end_lsn: u64,
        commit_time: i64,
    },
    Relation(Relation),
    Insert {
        relation: u32,
        new: Vec<Datum>,
    },
    Update {
        relation: u32,
        old: Option<(OldKind, Vec<Datum>)>,
        new: Vec<Datum>,
    },
    Delete {
        relation: u32,
        old: (OldKind, Vec<Datum>),
    },
    Truncate {
        relations: Vec<u32>,
        cascade: bool,
        restart_identity: bool,
    },
    /// Origin, Type, logical Message: nothing a change feed delivers.
    Other(u8),
}

/// A message that is not what pgoutput version 1 sends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed pgoutput message {kind:?} at byte {offset}: {reason}")]
pub struct DecodeError {
    pub kind: char,
    pub offset: usize,
    pub reason: String,
}

/// Reads big-endian integers and NUL-terminated strings, never past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    offset: usize,
    kind: char,
}

impl<'a> Reader<'a> {
    fn error(&self, reason: impl Into<String>) -> DecodeError {
        DecodeError { kind: self.kind, offset: self.offset, reason: reason.into() }
    }

    fn take(&mut self, count: usize) -> Result<&'a [u8], DecodeError> {
        let end =
            self.offset.checked_add(count).filter(|end| *end <= self.bytes.len()).ok_or_else(|| {
                self.error(format!("needs {count} more bytes, has {}", self.bytes.len() - self.offset))
            })?;
        let slice = &self.bytes[self.offset..end];
        self.offset = end;
        Ok(slice)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.take(2)?.try_into().expect("two bytes")))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().expect("four bytes")))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().expect("eight bytes")))
    }

    fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(self.u64()? as i64)
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        let rest = &self.bytes[self.offset..];
        let end =
            rest.iter().position(|byte| *byte == 0).ok_or_else(|| self.error("a string has no terminating NUL"))?;
        let text = std::str::from_utf8(&rest[..end]).map_err(|_| self.error("a string is not UTF-8"))?.to_string();
        self.offset += end + 1;
        Ok(text)
    }

    fn tuple(&mut self) -> Result<Vec<Datum>, DecodeError> {
        let count = self.u16()?;
        let mut datums = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let datum = match self.u8()? {
                b'n' => Datum::Null,
                b'u' => Datum::UnchangedToast,
                b't' => {
                    let length = self.u32()?;
                    let length = usize::try_from(length).map_err(|_| self.error("a value length overflows"))?;
                    let bytes = self.take(length)?;
                    let text = std::str::from_utf8(bytes).map_err(|_| self.error("a text value is not UTF-8"))?;
                    Datum::Text(text.to_string())
                }
                b'b' => return Err(self.error("a binary value: dbtrigger asks for the text form (binary off)")),
                other => return Err(self.error(format!("unknown tuple value kind {:?}", other as char))),
            };
            datums.push(datum);
        }
        Ok(datums)
    }

    fn finish<T>(&self, value: T) -> Result<T, DecodeError> {
        if self.offset == self.bytes.len() {
            Ok(value)
        } else {
            Err(self.error(format!("{} bytes left over", self.bytes.len() - self.offset)))
        }
    }
}

/// Decodes one message.
pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
    let Some(&first) = bytes.first() else {
        return Err(DecodeError { kind: '?', offset: 0, reason: "an empty message".into() });
    };
    let mut reader = Reader { bytes, offset: 1, kind: first as char };
    let message = match first {
        b'B' => {
            let final_lsn = reader.u64()?;
            let commit_time = reader.i64()?;
            let xid = reader.u32()?;
            Message::Begin { final_lsn, commit_time, xid }
        }
        b'C' => {
            let _flags = reader.u8()?;
            let commit_lsn = reader.u64()?;
            let end_lsn = reader.u64()?;
            let commit_time = reader.i64()?;
            Message::Commit { commit_lsn, end_lsn, commit_time }
        }
        b'R' => {
            let oid = reader.u32()?;
            let namespace = reader.string()?;
            let name = reader.string()?;
            let replica_identity = reader.u8()?;
            let count = reader.u16()?;
            let mut columns = Vec::with_capacity(usize::from(count));
            for _ in 0..count {
                let flags = reader.u8()?;
                let name = reader.string()?;
                let type_oid = reader.u32()?;
                let _type_modifier = reader.u32()?;
                columns.push(RelationColumn { name, type_oid, key: flags & 1 == 1 });
            }
            // The pg_catalog namespace is sent as an empty string.
            let namespace = if namespace.is_empty() { "pg_catalog".to_string() } else { namespace };
            let qualified = format!("{namespace}.{name}");
            Message::Relation(Relation { oid, namespace, name, replica_identity, columns, qualified })
        }
        b'I' => {
            let relation = reader.u32()?;
            match reader.u8()? {
                b'N' => Message::Insert { relation, new: reader.tuple()? },
                other => {
                    return Err(reader.error(format!("expected 'N' before the new row, found {:?}", other as char)));
                }
            }
        }
        b'U' => {
            let relation = reader.u32()?;
            let mut old = None;
            let mut marker = reader.u8()?;
            if marker == b'K' || marker == b'O' {
                let kind = if marker == b'K' { OldKind::Key } else { OldKind::Full };
                old = Some((kind, reader.tuple()?));
                marker = reader.u8()?;
            }
            if marker != b'N' {
                return Err(reader.error(format!("expected 'N' before the new row, found {:?}", marker as char)));
            }
            Message::Update { relation, old, new: reader.tuple()? }
        }
        b'D' => {
            let relation = reader.u32()?;
            let kind = match reader.u8()? {
                b'K' => OldKind::Key,
                b'O' => OldKind::Full,
                other => {
                    return Err(
                        reader.error(format!("expected 'K' or 'O' before the old row, found {:?}", other as char))
                    );
                }
            };
            Message::Delete { relation, old: (kind, reader.tuple()?) }
        }
        b'T' => {
            let count = reader.u32()?;
            let options = reader.u8()?;
            // Each OID takes four bytes: a count beyond what is left is refused before allocating.
            if usize::try_from(count).map_or(true, |count| count > (bytes.len() - reader.offset) / 4) {
                return Err(reader.error(format!("{count} relations announced, fewer sent")));
            }
            let mut relations = Vec::with_capacity(count as usize);
            for _ in 0..count {
                relations.push(reader.u32()?);
            }
            Message::Truncate { relations, cascade: options & 1 == 1, restart_identity: options & 2 == 2 }
        }
        b'O' | b'Y' | b'M' => return Ok(Message::Other(first)),
        other => {
            return Err(DecodeError {
                kind: other as char,
                offset: 0,
                reason: "not a pgoutput version 1 message".into(),
            });
        }
    };
    reader.finish(message)
}

#[cfg(test)]
#[path = "tests_pgoutput.rs"]
pub(super) mod tests;
