//! pgoutput on byte sequences written here by the protocol's layout.

use serde_json::json;

use super::*;
use crate::domain::event::Op;
use crate::source::logical::changes::{Assembler, event_row};

fn string(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(text.as_bytes());
    out.push(0);
}

pub(crate) fn begin(final_lsn: u64, time: i64, xid: u32) -> Vec<u8> {
    let mut out = vec![b'B'];
    out.extend(final_lsn.to_be_bytes());
    out.extend(time.to_be_bytes());
    out.extend(xid.to_be_bytes());
    out
}

fn commit(commit_lsn: u64, end_lsn: u64, time: i64) -> Vec<u8> {
    let mut out = vec![b'C', 0];
    out.extend(commit_lsn.to_be_bytes());
    out.extend(end_lsn.to_be_bytes());
    out.extend(time.to_be_bytes());
    out
}

/// `orders(id int8 key, body text, amount numeric)` as relation 16384.
pub(crate) fn relation() -> Vec<u8> {
    let mut out = vec![b'R'];
    out.extend(16384u32.to_be_bytes());
    string(&mut out, "public");
    string(&mut out, "orders");
    out.push(b'd');
    out.extend(3u16.to_be_bytes());
    for (flags, name, oid) in [(1u8, "id", 20u32), (0, "body", 25), (0, "amount", 1700)] {
        out.push(flags);
        string(&mut out, name);
        out.extend(oid.to_be_bytes());
        out.extend((-1i32).to_be_bytes());
    }
    out
}

fn tuple(out: &mut Vec<u8>, values: &[Option<Option<&str>>]) {
    out.extend((values.len() as u16).to_be_bytes());
    for value in values {
        match value {
            None => out.push(b'u'),
            Some(None) => out.push(b'n'),
            Some(Some(text)) => {
                out.push(b't');
                out.extend((text.len() as u32).to_be_bytes());
                out.extend_from_slice(text.as_bytes());
            }
        }
    }
}

pub(crate) fn insert(values: &[Option<Option<&str>>]) -> Vec<u8> {
    let mut out = vec![b'I'];
    out.extend(16384u32.to_be_bytes());
    out.push(b'N');
    tuple(&mut out, values);
    out
}

#[test]
fn every_message_decodes() {
    assert_eq!(
        decode(&begin(0x1_0000_0010, 5, 740)).unwrap(),
        Message::Begin { final_lsn: 0x1_0000_0010, commit_time: 5, xid: 740 }
    );
    assert_eq!(decode(&commit(16, 24, 5)).unwrap(), Message::Commit { commit_lsn: 16, end_lsn: 24, commit_time: 5 });
    let Message::Relation(described) = decode(&relation()).unwrap() else { panic!("a relation") };
    assert_eq!(described.qualified_name(), "public.orders");
    assert_eq!(described.columns.iter().map(|column| column.key).collect::<Vec<_>>(), [true, false, false]);
    assert_eq!(described.columns[2].type_oid, 1700);
    assert_eq!(
        decode(&insert(&[Some(Some("7")), Some(None), None])).unwrap(),
        Message::Insert { relation: 16384, new: vec![Datum::Text("7".into()), Datum::Null, Datum::UnchangedToast] }
    );
    let mut update = vec![b'U'];
    update.extend(16384u32.to_be_bytes());
    update.push(b'K');
    tuple(&mut update, &[Some(Some("7")), Some(None), Some(None)]);
    update.push(b'N');
    tuple(&mut update, &[Some(Some("8")), Some(Some("x")), Some(Some("1.50"))]);
    let Message::Update { old: Some((OldKind::Key, old)), new, .. } = decode(&update).unwrap() else {
        panic!("an update with its old key")
    };
    assert_eq!((old[0].clone(), new[0].clone()), (Datum::Text("7".into()), Datum::Text("8".into())));
    let mut delete = vec![b'D'];
    delete.extend(16384u32.to_be_bytes());
    delete.push(b'O');
    tuple(&mut delete, &[Some(Some("7")), Some(Some("x")), Some(None)]);
    assert!(matches!(decode(&delete).unwrap(), Message::Delete { old: (OldKind::Full, _), .. }));
    let mut truncate = vec![b'T'];
    truncate.extend(2u32.to_be_bytes());
    truncate.push(3);
    truncate.extend(16384u32.to_be_bytes());
    truncate.extend(16390u32.to_be_bytes());
    assert_eq!(
        decode(&truncate).unwrap(),
        Message::Truncate { relations: vec![16384, 16390], cascade: true, restart_identity: true }
    );
    let mut origin = vec![b'O'];
    origin.extend(9u64.to_be_bytes());
    string(&mut origin, "upstream");
    assert_eq!(decode(&origin).unwrap(), Message::Other(b'O'));
}

#[test]
fn malformed_messages_are_errors_never_panics() {
    let mut cases: Vec<Vec<u8>> = vec![vec![], vec![b'Z'], vec![b'B', 0, 0], commit(1, 2, 3)[..20].to_vec()];
    let mut bad_length = vec![b'I'];
    bad_length.extend(16384u32.to_be_bytes());
    bad_length.extend([b'N', 0, 1, b't', 0xFF, 0xFF, 0xFF, 0xFF, b'x']);
    cases.push(bad_length);
    let mut truncate = vec![b'T'];
    truncate.extend(u32::MAX.to_be_bytes());
    truncate.push(0);
    cases.push(truncate);
    let mut trailing = begin(1, 2, 3);
    trailing.push(0);
    cases.push(trailing);
    let mut unterminated = vec![b'R', 0, 0, 0, 1];
    unterminated.extend_from_slice(b"public");
    cases.push(unterminated);
    for bytes in cases {
        assert!(decode(&bytes).is_err(), "{bytes:?}");
    }
    // Every prefix of a valid message fails cleanly too.
    let whole = relation();
    for end in 1..whole.len() {
        assert!(decode(&whole[..end]).is_err(), "prefix of {end} bytes");
    }
}

#[test]
fn a_transaction_becomes_numbered_changes_with_json_rows() {
    let mut assembler = Assembler::default();
    assert_eq!(assembler.push(10, &begin(100, 0, 740)).unwrap(), None);
    assembler.push(11, &relation()).unwrap();
    assembler.push(12, &insert(&[Some(Some("7")), Some(Some("hello")), Some(Some("12.50"))])).unwrap();
    // An update whose body is an unchanged TOAST value, the key the same.
    let mut update = vec![b'U'];
    update.extend(16384u32.to_be_bytes());
    update.push(b'N');
    tuple(&mut update, &[Some(Some("7")), None, Some(None)]);
    assembler.push(13, &update).unwrap();
    let mut delete = vec![b'D'];
    delete.extend(16384u32.to_be_bytes());
    delete.push(b'K');
    tuple(&mut delete, &[Some(Some("7")), Some(None), Some(None)]);
    assembler.push(14, &delete).unwrap();
    assert!(assembler.in_transaction());
    let transaction = assembler.push(15, &commit(100, 120, 1_000_000)).unwrap().expect("committed");
    assert!(!assembler.in_transaction());
    assert_eq!((transaction.xid, transaction.commit_lsn, transaction.end_lsn), (740, 100, 120));
    let ops: Vec<_> = transaction.changes.iter().map(|change| (change.op, change.ordinal)).collect();
    assert_eq!(ops, [(Op::Insert, 1), (Op::Update, 2), (Op::Delete, 3)]);
    assert_eq!(
        json!(event_row(&transaction, &transaction.changes[0])),
        json!({
            "table": "public.orders",
            "new": {"id": 7, "body": "hello", "amount": "12.50"},
            "old": null,
            "lsn": "0/C",
            "commit_lsn": "0/64",
            "commit_time": "2000-01-01T00:00:01Z",
            "xid": 740
        })
    );
    // The unchanged TOAST value is left out of the row and named, never null.
    let update = event_row(&transaction, &transaction.changes[1]);
    assert_eq!(update["new"], json!({"id": 7, "amount": null}));
    assert_eq!(update["unchanged_toast"], json!(["body"]));
    assert_eq!(update["old"], json!({"id": 7}));
    // A delete by the key: the key columns only.
    assert_eq!(event_row(&transaction, &transaction.changes[2])["old"], json!({"id": 7}));
    assert_eq!(event_row(&transaction, &transaction.changes[2])["new"], json!(null));
}

#[test]
fn out_of_place_messages_are_refused() {
    let mut assembler = Assembler::default();
    assert!(assembler.push(1, &commit(1, 2, 3)).is_err());
    assembler.push(1, &begin(5, 0, 1)).unwrap();
    assert!(assembler.push(2, &begin(6, 0, 2)).is_err());
    // A change of a relation never described.
    assert!(assembler.push(3, &insert(&[Some(Some("1"))])).is_err());
    assembler.push(4, &relation()).unwrap();
    // As many values as the relation has columns.
    assert!(assembler.push(5, &insert(&[Some(Some("1"))])).is_err());
    // A value that is not its type is no error (issue 37, finding 3): it goes as its text form.
    assert!(assembler.push(6, &insert(&[Some(Some("seven")), Some(None), Some(None)])).is_ok());
    assert!(assembler.push(7, &commit(99, 100, 0)).is_err(), "a Commit must match its Begin");
}

#[test]
fn transactions_before_the_skip_position_are_counted_not_decoded() {
    let mut assembler = Assembler::skipping(200);
    assembler.push(10, &begin(100, 0, 1)).unwrap();
    assembler.push(11, &relation()).unwrap();
    // Not decoded: a value that is not its type would be an error if it were.
    assembler.push(12, &insert(&[Some(Some("seven")), Some(None), Some(None)])).unwrap();
    assembler.push(13, &insert(&[Some(Some("8")), Some(None), Some(None)])).unwrap();
    let mut truncate = vec![b'T'];
    truncate.extend(1u32.to_be_bytes());
    truncate.push(0);
    truncate.extend(16384u32.to_be_bytes());
    assembler.push(14, &truncate).unwrap();
    let skipped = assembler.push(15, &commit(100, 120, 0)).unwrap().expect("committed");
    assert!(skipped.changes.is_empty());
    assert_eq!((skipped.skipped, skipped.change_count(), skipped.end_lsn), (3, 3, 120));
    // The transaction at the skip position is decoded, with the relation the skipped one described.
    assembler.push(20, &begin(200, 0, 2)).unwrap();
    assembler.push(21, &insert(&[Some(Some("9")), Some(Some("x")), Some(None)])).unwrap();
    let decoded = assembler.push(22, &commit(200, 220, 0)).unwrap().expect("committed");
    assert_eq!((decoded.skipped, decoded.change_count()), (0, 1));
    assert_eq!(event_row(&decoded, &decoded.changes[0])["new"], json!({"id": 9, "body": "x", "amount": null}));
    // A skipped transaction still needs its Begin: a change outside one is refused.
    let mut outside = Assembler::skipping(u64::MAX);
    outside.push(1, &relation()).unwrap();
    assert!(outside.push(2, &insert(&[Some(Some("1")), Some(None), Some(None)])).is_err());
}

/// A peek's decoder hands its row changes out undecoded, to be decoded in parallel: decoded, each
/// is the change the decoder gives at once, and a row that does not fit its relation is refused
/// when it is decoded, as at once.
#[test]
fn a_deferring_decoder_gives_the_same_changes_decoded_later() {
    use crate::source::logical::changes::{Decoder, Step};
    let mut update = vec![b'U'];
    update.extend(16384u32.to_be_bytes());
    update.push(b'N');
    tuple(&mut update, &[Some(Some("7")), None, Some(Some("3.5"))]);
    let messages = [
        begin(100, 0, 740),
        relation(),
        insert(&[Some(Some("7")), Some(Some("hello")), Some(Some("12.50"))]),
        update,
        commit(100, 120, 0),
    ];
    let (mut now, mut later) = (Decoder::after(None), Decoder::after(None).deferring());
    let (mut decoded, mut deferred) = (Vec::new(), Vec::new());
    for (lsn, message) in messages.iter().enumerate() {
        if let Step::Changes(changes) = now.push(lsn as u64, message).unwrap() {
            decoded.extend(changes);
        }
        match later.push(lsn as u64, message).unwrap() {
            Step::Pending(pending) => deferred.push((pending.ordinal(), pending)),
            Step::Changes(_) => panic!("a deferring decoder hands row changes out undecoded"),
            _ => {}
        }
    }
    assert_eq!(decoded.len(), 2);
    let deferred: Vec<_> = deferred
        .into_iter()
        .map(|(ordinal, pending)| {
            let change = pending.decode().unwrap();
            assert_eq!(change.ordinal, ordinal);
            change
        })
        .collect();
    assert_eq!(deferred, decoded);
    let mut short = Decoder::after(None).deferring();
    short.push(1, &begin(5, 0, 1)).unwrap();
    short.push(2, &relation()).unwrap();
    let Step::Pending(pending) = short.push(3, &insert(&[Some(Some("1"))])).unwrap() else {
        panic!("a row change is handed out undecoded");
    };
    let error = pending.decode().unwrap_err();
    assert!(error.to_string().contains("a row of 1 values for public.orders, which has 3 columns"), "{error}");
    // A change of a relation never described, or outside a transaction, is refused at once.
    let mut unknown = Decoder::after(None).deferring();
    unknown.push(1, &begin(5, 0, 1)).unwrap();
    assert!(unknown.push(2, &insert(&[Some(Some("1"))])).is_err());
    let mut outside = Decoder::after(None).deferring();
    outside.push(1, &relation()).unwrap();
    assert!(outside.push(2, &insert(&[Some(Some("1")), Some(None), Some(None)])).is_err());
}
