//! What the logical chaos run checks deliveries against: the writers' own log of what they did
//! (committed or rolled back, by transaction id), and a second slot on the same database decoded
//! by PostgreSQL's `test_decoding` plugin (the server's own account of every committed change, in
//! commit order), read once at the end. The two must agree before deliveries are judged.

use std::collections::BTreeMap;

/// One change, as the writers made it and as both plugins show it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Change {
    pub op: String,
    pub table: String,
    /// The row's key (the new row's for an insert or update, the old key's for a delete).
    pub id: Option<i64>,
    /// The new row's tag (unique per insert and update).
    pub tag: Option<String>,
}

impl Change {
    pub fn new(op: &str, table: &str, id: Option<i64>, tag: Option<&str>) -> Change {
        Change { op: op.into(), table: table.into(), id, tag: tag.map(str::to_string) }
    }

    /// A delivered event's change: `op`, `row.table`, the key from `row.new` (else `row.old`),
    /// the tag from `row.new`.
    pub fn of_event(event: &serde_json::Value) -> Change {
        let row = &event["row"];
        let id = row["new"].get("id").or_else(|| row["old"].get("id")).and_then(|id| id.as_i64());
        Change {
            op: event["op"].as_str().unwrap_or("?").to_string(),
            table: row["table"].as_str().unwrap_or("?").to_string(),
            id,
            tag: row["new"].get("tag").and_then(|tag| tag.as_str()).map(str::to_string),
        }
    }
}

/// A writer's transaction, as the writer saw it.
#[derive(Debug, Clone)]
pub struct Written {
    pub xid: u64,
    pub changes: Vec<Change>,
    pub committed: bool,
    pub late: bool,
}

/// A committed transaction as the witness slot decoded it.
#[derive(Debug, Clone)]
pub struct Decoded {
    pub xid: u64,
    pub changes: Vec<Change>,
}

/// `test_decoding`'s rows (`BEGIN n`, `table public.t: OP: col[type]:value …`, `COMMIT n`), in
/// order, as transactions.
pub fn parse_test_decoding(lines: &[String]) -> Result<Vec<Decoded>, String> {
    let mut transactions = Vec::new();
    let mut open: Option<Decoded> = None;
    for line in lines {
        if let Some(xid) = line.strip_prefix("BEGIN ") {
            let xid = xid.trim().parse().map_err(|_| format!("a BEGIN without an xid: {line}"))?;
            open = Some(Decoded { xid, changes: Vec::new() });
        } else if line.starts_with("COMMIT") {
            transactions.push(open.take().ok_or_else(|| format!("a COMMIT outside a transaction: {line}"))?);
        } else if let Some(rest) = line.strip_prefix("table ") {
            let (table, rest) = rest.split_once(": ").ok_or_else(|| format!("no table: {line}"))?;
            let (op, columns) = rest.split_once(':').ok_or_else(|| format!("no operation: {line}"))?;
            let column = |name: &str| {
                columns.split(' ').find_map(|part| part.strip_prefix(name)).map(|value| value.trim_matches('\''))
            };
            let id = column("id[bigint]:").map(|id| id.parse().map_err(|_| format!("a bad id: {line}"))).transpose()?;
            let change = Change::new(&op.to_lowercase(), table, id, column("tag[text]:"));
            open.as_mut().ok_or_else(|| format!("a change outside a transaction: {line}"))?.changes.push(change);
        } else {
            return Err(format!("an unexpected row: {line}"));
        }
    }
    Ok(transactions)
}

/// The writers' log and the witness agree: the same committed transactions with changes, each
/// with the same changes in the same order; no rolled-back transaction decoded.
pub fn check_agreement(written: &[Written], decoded: &[Decoded]) -> Result<(), String> {
    let by_xid: BTreeMap<u64, &Written> = written.iter().map(|transaction| (transaction.xid, transaction)).collect();
    for transaction in decoded {
        let Some(writer) = by_xid.get(&transaction.xid) else {
            return Err(format!("the witness decoded a transaction no writer made: {transaction:?}"));
        };
        if !writer.committed {
            return Err(format!("the witness decoded a rolled-back transaction: {transaction:?}"));
        }
        if writer.changes != transaction.changes {
            return Err(format!("writer and witness differ on xid {}: {writer:?} / {transaction:?}", transaction.xid));
        }
    }
    let decoded_count = decoded.len();
    let committed =
        written.iter().filter(|transaction| transaction.committed && !transaction.changes.is_empty()).count();
    if committed != decoded_count {
        return Err(format!("{committed} committed transactions with changes, {decoded_count} decoded"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_decoding_rows_parse_into_transactions() {
        let rows: Vec<String> = [
            "BEGIN 740",
            "table public.orders: INSERT: id[bigint]:1000001 tag[text]:'w1s1c0' n[bigint]:1",
            "table public.orders: UPDATE: id[bigint]:1000001 tag[text]:'w1s1c1' n[bigint]:2",
            "table public.orders: DELETE: id[bigint]:1000001",
            "table public.lines: TRUNCATE: (no-flags)",
            "COMMIT 740",
        ]
        .map(String::from)
        .to_vec();
        let parsed = parse_test_decoding(&rows).unwrap();
        assert_eq!(parsed.len(), 1);
        assert_eq!(parsed[0].xid, 740);
        assert_eq!(
            parsed[0].changes,
            vec![
                Change::new("insert", "public.orders", Some(1000001), Some("w1s1c0")),
                Change::new("update", "public.orders", Some(1000001), Some("w1s1c1")),
                Change::new("delete", "public.orders", Some(1000001), None),
                Change::new("truncate", "public.lines", None, None),
            ]
        );
        assert!(parse_test_decoding(&["table public.x: INSERT: id[bigint]:1".to_string()]).is_err());
    }
}
