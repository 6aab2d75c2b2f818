//! From pgoutput messages to changes: the messages of each transaction, Begin to Commit, become
//! one change per row (and per truncated table), numbered from 1 within the transaction, each
//! with its row as JSON. Pure code: the rows `pg_logical_slot_peek_binary_changes` returned in,
//! whole transactions out.

use std::collections::HashMap;
use std::sync::Arc;

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

/// Messages that do not make sense where they are.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssembleError {
    #[error(transparent)]
    Decode(#[from] pgoutput::DecodeError),
    #[error("pgoutput at {lsn}: {reason}")]
    Sequence { lsn: String, reason: String },
}

/// What one message of a transaction gives, read in order (see [`Decoder`]).
#[derive(Debug)]
pub enum Step {
    /// Nothing to hand out (a Begin, a Relation, a change counted and not decoded).
    Nothing,
    /// Changes of the open transaction (one, or one per table of a truncate), decoded.
    Changes(Vec<Change>),
    /// A row change of the open transaction, its values not decoded yet (a [`Decoder::deferring`]
    /// decoder's inserts, updates and deletes): [`Pending::decode`] makes its [`Change`].
    Pending(Pending),
    /// The open transaction committed: its end and its changes, decoded or counted.
    Committed { commit_lsn: u64, end_lsn: u64, commit_time: i64, changes: u32 },
}

/// The transaction begun and not committed yet.
struct Open {
    xid: u32,
    commit_lsn: u64,
    commit_time: i64,
    /// Changes so far, decoded or counted.
    changes: u32,
}

/// Reads the messages of a slot in order and gives each change as its message comes: pgoutput's
/// Begin carries the transaction's commit LSN, so a change's position (commit LSN, ordinal) is
/// known before its Commit, and a transaction of any size goes through without being held. The
/// changes at or before [`Decoder::after`] (and every change, when counting) are counted by their
/// message's tag alone, not decoded.
#[derive(Default)]
pub struct Decoder {
    relations: HashMap<u32, Arc<Relation>>,
    open: Option<Open>,
    /// Row changes come as [`Step::Pending`], their values decoded later (elsewhere).
    defer: bool,
    /// Changes at or before this position are counted, not decoded.
    after: Option<(u64, u32)>,
    /// Count every change, decode none.
    count_only: bool,
}

impl Decoder {
    /// A decoder of the changes after `after`.
    pub fn after(after: Option<(u64, u32)>) -> Decoder {
        Decoder { after, ..Decoder::default() }
    }

    /// This decoder, handing out its row changes undecoded ([`Step::Pending`]): the values of a
    /// change, most of the work, are decoded by whoever takes it (a peek's changes in parallel).
    pub fn deferring(self) -> Decoder {
        Decoder { defer: true, ..self }
    }

    /// A decoder that counts changes and decodes none.
    pub fn counting() -> Decoder {
        Decoder { count_only: true, ..Decoder::default() }
    }

    /// The commit LSN of the transaction begun and not committed yet, and the ordinal its next
    /// change will have.
    pub fn next_change(&self) -> Option<(u64, u32)> {
        self.open.as_ref().map(|open| (open.commit_lsn, open.changes + 1))
    }

    /// What every change of the open transaction carries.
    pub fn commit_fields(&self) -> Option<CommitFields> {
        self.open.as_ref().map(|open| CommitFields::new(open.commit_lsn, open.commit_time, open.xid))
    }

    /// Whether the open transaction's next `count` changes are counted and not decoded.
    fn skips(&self, open: &Open) -> bool {
        self.count_only || self.after.is_some_and(|after| (open.commit_lsn, open.changes + 1) <= after)
    }

    /// The message at `lsn`.
    pub fn push(&mut self, lsn: u64, bytes: &[u8]) -> Result<Step, AssembleError> {
        let sequence = |reason: &str| AssembleError::Sequence { lsn: values::lsn_text(lsn), reason: reason.into() };
        // An insert, update or delete counted by its tag alone.
        if let Some(b'I' | b'U' | b'D') = bytes.first()
            && let Some(open) = self.open.as_ref()
            && self.skips(open)
        {
            if let Some(open) = self.open.as_mut() {
                open.changes += 1;
            }
            return Ok(Step::Nothing);
        }
        // Deferred: the change is counted and its message kept, decoded later by whoever takes it.
        if self.defer
            && let [b'I' | b'U' | b'D', a, b, c, d, ..] = *bytes
        {
            let relation = self.relation(lsn, u32::from_be_bytes([a, b, c, d]))?.clone();
            let open = self.open.as_mut().ok_or_else(|| sequence("a change outside a transaction"))?;
            open.changes += 1;
            return Ok(Step::Pending(Pending { relation, message: bytes.to_vec(), lsn, ordinal: open.changes }));
        }
        match pgoutput::decode(bytes)? {
            Message::Begin { final_lsn, commit_time, xid } => {
                if self.open.is_some() {
                    return Err(sequence("a Begin inside a transaction"));
                }
                self.open = Some(Open { xid, commit_lsn: final_lsn, commit_time, changes: 0 });
                Ok(Step::Nothing)
            }
            Message::Commit { commit_lsn, end_lsn, commit_time } => {
                let open = self.open.take().ok_or_else(|| sequence("a Commit outside a transaction"))?;
                if open.commit_lsn != commit_lsn {
                    return Err(sequence("a Commit whose LSN is not its Begin's"));
                }
                Ok(Step::Committed { commit_lsn, end_lsn, commit_time, changes: open.changes })
            }
            Message::Relation(relation) => {
                self.relations.insert(relation.oid, Arc::new(relation));
                Ok(Step::Nothing)
            }
            Message::Insert { relation, new } => self.change(lsn, relation, Op::Insert, None, Some(new)),
            Message::Update { relation, old, new } => self.change(lsn, relation, Op::Update, old, Some(new)),
            Message::Delete { relation, old } => self.change(lsn, relation, Op::Delete, Some(old), None),
            Message::Truncate { relations, cascade, restart_identity } => {
                let tables = relations
                    .iter()
                    .map(|oid| self.relation(lsn, *oid).map(|relation| relation.qualified_name()))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut changes = Vec::new();
                for table in tables {
                    let skips = self.open.as_ref().map(|open| self.skips(open));
                    let open = self.open.as_mut().ok_or_else(|| sequence("a change outside a transaction"))?;
                    open.changes += 1;
                    if skips == Some(true) {
                        continue;
                    }
                    changes.push(Change {
                        op: Op::Truncate,
                        table,
                        new: None,
                        old: None,
                        unchanged_toast: Vec::new(),
                        lsn,
                        ordinal: open.changes,
                        cascade,
                        restart_identity,
                        order_keys: Vec::new(),
                    });
                }
                Ok(if changes.is_empty() { Step::Nothing } else { Step::Changes(changes) })
            }
            Message::Other(_) => Ok(Step::Nothing),
        }
    }

    /// Whether a transaction was begun and not committed (the read ended inside it).
    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    fn relation(&self, lsn: u64, oid: u32) -> Result<&Arc<Relation>, AssembleError> {
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
        old: Option<(OldKind, Vec<Datum>)>,
        new: Option<Vec<Datum>>,
    ) -> Result<Step, AssembleError> {
        let relation = self.relation(lsn, oid)?.clone();
        let open = self.open.as_mut().ok_or_else(|| AssembleError::Sequence {
            lsn: values::lsn_text(lsn),
            reason: "a change outside a transaction".into(),
        })?;
        // Counted once built: a change that cannot be is still the next one.
        let change = build(&relation, lsn, open.changes + 1, op, old, new)?;
        open.changes += 1;
        Ok(Step::Changes(vec![change]))
    }
}

/// A row change as its message came (a [`Decoder::deferring`] decoder's): its relation as its
/// transaction described it, and its message, decoded by [`Pending::decode`].
#[derive(Debug)]
pub struct Pending {
    relation: Arc<Relation>,
    message: Vec<u8>,
    lsn: u64,
    ordinal: u32,
}

impl Pending {
    /// Its position in its transaction, from 1.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The change, its message decoded.
    pub fn decode(self) -> Result<Change, AssembleError> {
        let Pending { relation, message, lsn, ordinal } = self;
        let (op, old, new) = match pgoutput::decode(&message)? {
            Message::Insert { new, .. } => (Op::Insert, None, Some(new)),
            Message::Update { old, new, .. } => (Op::Update, old, Some(new)),
            Message::Delete { old, .. } => (Op::Delete, Some(old), None),
            _ => {
                return Err(AssembleError::Sequence {
                    lsn: values::lsn_text(lsn),
                    reason: "a change that is not an insert, an update or a delete".into(),
                });
            }
        };
        build(&relation, lsn, ordinal, op, old, new)
    }
}

/// The change of `relation` at `lsn`, its rows made from their values.
fn build(
    relation: &Relation,
    lsn: u64,
    ordinal: u32,
    op: Op,
    old: Option<(OldKind, Vec<Datum>)>,
    new: Option<Vec<Datum>>,
) -> Result<Change, AssembleError> {
    for datums in [new.as_ref(), old.as_ref().map(|(_, datums)| datums)].into_iter().flatten() {
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
    }
    let table = relation.qualified_name();
    let mut unchanged_toast = Vec::new();
    let new = new.map(|datums| row(relation, &datums, RowPart::New(&mut unchanged_toast)));
    let old = match old {
        Some((OldKind::Full, datums)) => Some(row(relation, &datums, RowPart::Full)),
        Some((OldKind::Key, datums)) => Some(row(relation, &datums, RowPart::Key)),
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
    Ok(Change {
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
    })
}

/// Puts whole transactions together from messages, in order (a [`Decoder`] whose changes are
/// kept until their Commit): for tests and tools that want a transaction at a time.
#[derive(Default)]
pub struct Assembler {
    decoder: Decoder,
    open: Option<Transaction>,
}

impl Assembler {
    /// An assembler that counts the changes of the transactions committing before `lsn` without
    /// decoding their rows.
    pub fn skipping(lsn: u64) -> Assembler {
        let after = lsn.checked_sub(1).map(|before| (before, u32::MAX));
        Assembler { decoder: Decoder::after(after), open: None }
    }

    /// The message at `lsn`; a transaction when it was its Commit.
    pub fn push(&mut self, lsn: u64, bytes: &[u8]) -> Result<Option<Transaction>, AssembleError> {
        if self.open.is_none()
            && let Some(b'B') = bytes.first()
        {
            let step = self.decoder.push(lsn, bytes)?;
            debug_assert!(matches!(step, Step::Nothing));
            let (commit_lsn, _) = self.decoder.next_change().expect("a Begin opens a transaction");
            let fields = self.decoder.open.as_ref().map(|open| (open.xid, open.commit_time)).unwrap_or_default();
            self.open = Some(Transaction {
                xid: fields.0,
                commit_lsn,
                end_lsn: 0,
                commit_time: fields.1,
                changes: Vec::new(),
                skipped: 0,
            });
            return Ok(None);
        }
        match self.decoder.push(lsn, bytes)? {
            Step::Nothing => Ok(None),
            Step::Changes(changes) => {
                if let Some(open) = self.open.as_mut() {
                    open.changes.extend(changes);
                }
                Ok(None)
            }
            Step::Pending(pending) => {
                let change = pending.decode()?;
                if let Some(open) = self.open.as_mut() {
                    open.changes.push(change);
                }
                Ok(None)
            }
            Step::Committed { end_lsn, commit_time, changes, .. } => {
                let mut transaction = self.open.take().ok_or_else(|| AssembleError::Sequence {
                    lsn: values::lsn_text(lsn),
                    reason: "a Commit outside a transaction".into(),
                })?;
                transaction.end_lsn = end_lsn;
                transaction.commit_time = commit_time;
                transaction.skipped = changes - transaction.changes.len() as u32;
                Ok(Some(transaction))
            }
        }
    }

    /// Whether a transaction was begun and not committed (the peek ended inside it).
    pub fn in_transaction(&self) -> bool {
        self.decoder.in_transaction()
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

/// The JSON object of a row whose values fit its relation's columns (checked by [`build`]).
fn row(relation: &Relation, datums: &[Datum], mut part: RowPart<'_>) -> Map<String, Value> {
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
            Datum::Text(text) => values::to_json(column.type_oid, text),
        };
        map.insert(column.name.clone(), value);
    }
    map
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
        CommitFields::new(transaction.commit_lsn, transaction.commit_time, transaction.xid)
    }

    pub fn new(commit_lsn: u64, commit_time: i64, xid: u32) -> CommitFields {
        CommitFields {
            commit_lsn: Value::from(values::lsn_text(commit_lsn)),
            commit_time: values::pg_time(commit_time),
            xid: Value::from(xid),
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
