//! From pgoutput messages to changes: the messages of each transaction, Begin to Commit, become
//! one change per row (and per truncated table), numbered from 1 within the transaction, each
//! with its row as JSON. Pure code: the rows `pg_logical_slot_peek_binary_changes` returned in,
//! whole transactions out.

use std::collections::{HashMap, VecDeque};

use serde_json::{Map, Value};

use super::pgoutput::{self, Datum, Message, OldKind, Relation};
use super::values;
use crate::domain::event::Op;

/// One change of a committed transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub op: Op,
    /// `schema.table`.
    pub table: String,
    /// The row after the change (insert, update); unchanged TOAST columns are left out and named
    /// in `unchanged_toast`.
    pub new: Option<Map<String, Value>>,
    /// The old row's key (an update, a delete): the replica identity's columns, or the whole old
    /// row under `REPLICA IDENTITY FULL`.
    pub old: Option<Map<String, Value>>,
    /// Columns whose TOASTed value the change left as it was: the server did not send them.
    pub unchanged_toast: Vec<String>,
    /// The change's own WAL position.
    pub lsn: u64,
    /// Its position in its transaction, from 1.
    pub ordinal: u32,
    /// A truncate's options.
    pub cascade: bool,
    pub restart_identity: bool,
    /// The row's key(s) for per-key order, as JSON of the replica identity's columns: the new
    /// row's and, when an update changed it, the old one's. Empty: the table has no narrower key
    /// than itself (`REPLICA IDENTITY FULL`, a truncate).
    pub order_keys: Vec<Vec<u8>>,
}

/// One committed transaction and its changes, in the order they were made.
#[derive(Debug, Clone, PartialEq)]
pub struct Transaction {
    pub xid: u32,
    /// The LSN of the commit record: transactions are delivered in this order.
    pub commit_lsn: u64,
    /// Just past the commit record: where the slot moves once the transaction is delivered.
    pub end_lsn: u64,
    /// Microseconds since 2000-01-01 UTC.
    pub commit_time: i64,
    pub changes: Vec<Change>,
    /// Changes counted and not decoded: the transaction commits before the assembler's
    /// [`Assembler::skipping`] position (a reader has them already). Its changes are then empty.
    pub skipped: u32,
}

impl Transaction {
    /// How many changes it has, decoded or not.
    pub fn change_count(&self) -> u32 {
        self.changes.len() as u32 + self.skipped
    }
}

/// Messages that do not make sense where they are, or values that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssembleError {
    #[error(transparent)]
    Decode(#[from] pgoutput::DecodeError),
    #[error("pgoutput at {lsn}: {reason}")]
    Sequence { lsn: String, reason: String },
    #[error("pgoutput at {lsn}, table {table}: {error}")]
    Value { lsn: String, table: String, error: values::ValueError },
}

/// Puts transactions together from the messages of one peek, in order.
#[derive(Default)]
pub struct Assembler {
    relations: HashMap<u32, Relation>,
    open: Option<Transaction>,
    /// Transactions committing before this LSN are counted, not decoded.
    skip_before: u64,
}

impl Assembler {
    /// An assembler that counts the changes of the transactions committing before `lsn` without
    /// decoding their rows (Begin, Commit, Relation and Truncate are still decoded: the relations
    /// serve later transactions, a truncate's count is its relations'). A peek starts where the
    /// slot is, so it returns again what a reader already has: those cost almost nothing here.
    pub fn skipping(lsn: u64) -> Assembler {
        Assembler { skip_before: lsn, ..Assembler::default() }
    }

    /// The message at `lsn`; a transaction when it was its Commit.
    pub fn push(&mut self, lsn: u64, bytes: &[u8]) -> Result<Option<Transaction>, AssembleError> {
        let sequence = |reason: &str| AssembleError::Sequence { lsn: values::lsn_text(lsn), reason: reason.into() };
        // An insert, update or delete of a skipped transaction: counted by its tag alone.
        if let (Some(open), Some(b'I' | b'U' | b'D')) = (self.open.as_mut(), bytes.first())
            && open.commit_lsn < self.skip_before
        {
            open.skipped += 1;
            return Ok(None);
        }
        match pgoutput::decode(bytes)? {
            Message::Begin { final_lsn, commit_time, xid } => {
                if self.open.is_some() {
                    return Err(sequence("a Begin inside a transaction"));
                }
                self.open = Some(Transaction {
                    xid,
                    commit_lsn: final_lsn,
                    end_lsn: 0,
                    commit_time,
                    changes: Vec::new(),
                    skipped: 0,
                });
                Ok(None)
            }
            Message::Commit { commit_lsn, end_lsn, commit_time } => {
                let mut transaction = self.open.take().ok_or_else(|| sequence("a Commit outside a transaction"))?;
                if transaction.commit_lsn != commit_lsn {
                    return Err(sequence("a Commit whose LSN is not its Begin's"));
                }
                transaction.end_lsn = end_lsn;
                transaction.commit_time = commit_time;
                Ok(Some(transaction))
            }
            Message::Relation(relation) => {
                self.relations.insert(relation.oid, relation);
                Ok(None)
            }
            Message::Insert { relation, new } => {
                self.change(lsn, relation, Op::Insert, None, Some(&new))?;
                Ok(None)
            }
            Message::Update { relation, old, new } => {
                self.change(lsn, relation, Op::Update, old.as_ref(), Some(&new))?;
                Ok(None)
            }
            Message::Delete { relation, old } => {
                self.change(lsn, relation, Op::Delete, Some(&old), None)?;
                Ok(None)
            }
            Message::Truncate { relations, cascade, restart_identity } => {
                let tables = relations
                    .iter()
                    .map(|oid| self.relation(lsn, *oid).map(Relation::qualified_name))
                    .collect::<Result<Vec<_>, _>>()?;
                let open = self.open.as_mut().ok_or_else(|| sequence("a change outside a transaction"))?;
                if open.commit_lsn < self.skip_before {
                    open.skipped += tables.len() as u32;
                    return Ok(None);
                }
                for table in tables {
                    let ordinal = open.changes.len() as u32 + 1;
                    open.changes.push(Change {
                        op: Op::Truncate,
                        table,
                        new: None,
                        old: None,
                        unchanged_toast: Vec::new(),
                        lsn,
                        ordinal,
                        cascade,
                        restart_identity,
                        order_keys: Vec::new(),
                    });
                }
                Ok(None)
            }
            Message::Other(_) => Ok(None),
        }
    }

    /// Whether a transaction was begun and not committed (the peek ended inside it).
    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    /// The commit LSN of the transaction begun and not committed yet, if any.
    pub fn open_commit_lsn(&self) -> Option<u64> {
        self.open.as_ref().map(|open| open.commit_lsn)
    }

    fn relation(&self, lsn: u64, oid: u32) -> Result<&Relation, AssembleError> {
        self.relations.get(&oid).ok_or_else(|| AssembleError::Sequence {
            lsn: values::lsn_text(lsn),
            reason: format!("a change of relation {oid}, which no Relation message described"),
        })
    }

    fn change(
        &mut self,
        lsn: u64,
        oid: u32,
        op: Op,
        old: Option<&(OldKind, Vec<Datum>)>,
        new: Option<&Vec<Datum>>,
    ) -> Result<(), AssembleError> {
        let relation = self.relation(lsn, oid)?;
        let table = relation.qualified_name();
        let mut unchanged_toast = Vec::new();
        let new = new.map(|datums| row(lsn, relation, datums, RowPart::New(&mut unchanged_toast))).transpose()?;
        let old = match old {
            Some((OldKind::Full, datums)) => Some(row(lsn, relation, datums, RowPart::Full)?),
            Some((OldKind::Key, datums)) => Some(row(lsn, relation, datums, RowPart::Key)?),
            None if op != Op::Update => None,
            // An update that did not change the key: the old key is the new row's.
            None => new.as_ref().map(|new| {
                relation
                    .columns
                    .iter()
                    .filter(|column| column.key)
                    .filter_map(|column| new.get(&column.name).map(|value| (column.name.clone(), value.clone())))
                    .collect()
            }),
        };
        let mut order_keys: Vec<Vec<u8>> = Vec::new();
        if relation.replica_identity != b'f' {
            for row in [new.as_ref(), old.as_ref()].into_iter().flatten() {
                let key: Vec<(&str, &Value)> = relation
                    .columns
                    .iter()
                    .filter(|column| column.key)
                    .filter_map(|column| row.get(&column.name).map(|value| (column.name.as_str(), value)))
                    .collect();
                let key = serde_json::to_vec(&key).expect("JSON values serialize");
                if !order_keys.contains(&key) {
                    order_keys.push(key);
                }
            }
        }
        let open = self.open.as_mut().ok_or_else(|| AssembleError::Sequence {
            lsn: values::lsn_text(lsn),
            reason: "a change outside a transaction".into(),
        })?;
        let ordinal = open.changes.len() as u32 + 1;
        open.changes.push(Change {
            op,
            table,
            new,
            old,
            unchanged_toast,
            lsn,
            ordinal,
            cascade: false,
            restart_identity: false,
            order_keys,
        });
        Ok(())
    }
}

/// Messages peeked and not decoded yet, made into transactions one at a time as batches are
/// handed out: what waits in memory is pgoutput (several times smaller than the rows' JSON), and a
/// batch is decoded while the ones before it are delivered.
#[derive(Default)]
pub struct Unread {
    messages: VecDeque<(u64, Vec<u8>)>,
    assembler: Assembler,
}

impl Unread {
    /// The message at `lsn`, after those pushed before.
    pub fn push(&mut self, lsn: u64, message: Vec<u8>) {
        self.messages.push_back((lsn, message));
    }

    /// No message waits.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The next whole transaction, decoded; `None` once no whole transaction waits.
    pub fn next_transaction(&mut self) -> Result<Option<Transaction>, AssembleError> {
        while let Some((lsn, message)) = self.messages.pop_front() {
            if let Some(transaction) = self.assembler.push(lsn, &message)? {
                return Ok(Some(transaction));
            }
        }
        Ok(None)
    }
}

enum RowPart<'a> {
    /// The new row: every column, unchanged TOAST ones left out and listed.
    New(&'a mut Vec<String>),
    /// The replica identity's columns only.
    Key,
    /// The whole old row.
    Full,
}

fn row(
    lsn: u64,
    relation: &Relation,
    datums: &[Datum],
    mut part: RowPart<'_>,
) -> Result<Map<String, Value>, AssembleError> {
    if datums.len() != relation.columns.len() {
        return Err(AssembleError::Sequence {
            lsn: values::lsn_text(lsn),
            reason: format!(
                "a row of {} values for {}, which has {} columns",
                datums.len(),
                relation.qualified_name(),
                relation.columns.len()
            ),
        });
    }
    let mut map = Map::new();
    for (column, datum) in relation.columns.iter().zip(datums) {
        if matches!(part, RowPart::Key) && !column.key {
            continue;
        }
        let value = match datum {
            Datum::Null => Value::Null,
            Datum::UnchangedToast => {
                if let RowPart::New(unchanged) = &mut part {
                    unchanged.push(column.name.clone());
                }
                continue;
            }
            Datum::Text(text) => values::to_json(&column.name, column.type_oid, text).map_err(|error| {
                AssembleError::Value { lsn: values::lsn_text(lsn), table: relation.qualified_name(), error }
            })?,
        };
        map.insert(column.name.clone(), value);
    }
    Ok(map)
}

/// What every change of a transaction carries, as JSON: the commit's LSN and time and the xid,
/// made once for the whole transaction.
pub struct CommitFields {
    commit_lsn: Value,
    commit_time: Value,
    xid: Value,
}

impl CommitFields {
    pub fn of(transaction: &Transaction) -> CommitFields {
        CommitFields {
            commit_lsn: Value::from(values::lsn_text(transaction.commit_lsn)),
            commit_time: values::pg_time(transaction.commit_time),
            xid: Value::from(transaction.xid),
        }
    }
}

/// The row an event carries for a change: `table`, `new`, `old`, the TOAST columns left
/// unchanged (only when there are some), `lsn`, `commit_lsn`, `commit_time` and `xid`.
pub fn event_row(transaction: &Transaction, change: &Change) -> Map<String, Value> {
    event_row_of(&CommitFields::of(transaction), change.clone())
}

/// [`event_row`], taking the change (its rows move into the event row, nothing is copied).
pub fn event_row_of(commit: &CommitFields, change: Change) -> Map<String, Value> {
    let mut row = Map::new();
    row.insert("table".into(), Value::from(change.table));
    row.insert("new".into(), change.new.map(Value::Object).unwrap_or(Value::Null));
    row.insert("old".into(), change.old.map(Value::Object).unwrap_or(Value::Null));
    if !change.unchanged_toast.is_empty() {
        row.insert("unchanged_toast".into(), Value::from(change.unchanged_toast));
    }
    if change.op == Op::Truncate {
        row.insert("cascade".into(), Value::Bool(change.cascade));
        row.insert("restart_identity".into(), Value::Bool(change.restart_identity));
    }
    row.insert("lsn".into(), Value::from(values::lsn_text(change.lsn)));
    row.insert("commit_lsn".into(), commit.commit_lsn.clone());
    row.insert("commit_time".into(), commit.commit_time.clone());
    row.insert("xid".into(), commit.xid.clone());
    row
}
