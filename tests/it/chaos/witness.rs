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

/// A committed transaction as the server's `mariadb-binlog --verbose --base64-output=decode-rows`
/// prints it: its GTID, its row changes of one database, and where it ends (its file, and the
/// offset after its `Xid` or `COMMIT` event).
#[derive(Debug, Clone)]
pub struct Logged {
    pub gtid: String,
    pub changes: Vec<Change>,
    pub end: (String, u64),
}

/// `mariadb-binlog --verbose --base64-output=decode-rows` (MariaDB's `mysqlbinlog`) output, as the
/// transactions that changed tables of `database` (whose first column is `id`, the second `tag`),
/// in the order the log holds them. DDL and other databases' changes are left out.
pub fn parse_mariadb_binlog(text: &str, database: &str) -> Result<Vec<Logged>, String> {
    struct Row {
        op: String,
        table: String,
        /// Whether the `SET` part (the new row) is being read, else the `WHERE` part (the old).
        new: bool,
        id: Option<i64>,
        tag: Option<String>,
    }
    fn finish(row: Option<Row>, changes: &mut Option<Vec<Change>>, database: &str) -> Result<(), String> {
        let Some(row) = row else { return Ok(()) };
        let changes = changes.as_mut().ok_or_else(|| format!("a row of {} outside a transaction", row.table))?;
        if row.table.split_once('.').is_some_and(|(schema, _)| schema == database) {
            changes.push(Change::new(&row.op, &row.table, row.id, row.tag.as_deref().filter(|_| row.op != "delete")));
        }
        Ok(())
    }
    let table_of = |rest: &str| rest.trim().replace('`', "");
    let mut file = String::new();
    let mut last_end = 0u64;
    let mut gtid: Option<String> = None;
    let mut changes: Option<Vec<Change>> = None;
    let mut row: Option<Row> = None;
    let mut transactions = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("### ") {
            if let Some(rest) = rest.strip_prefix("INSERT INTO ") {
                finish(row.take(), &mut changes, database)?;
                row = Some(Row { op: "insert".into(), table: table_of(rest), new: true, id: None, tag: None });
            } else if let Some(rest) = rest.strip_prefix("UPDATE ") {
                finish(row.take(), &mut changes, database)?;
                row = Some(Row { op: "update".into(), table: table_of(rest), new: false, id: None, tag: None });
            } else if let Some(rest) = rest.strip_prefix("DELETE FROM ") {
                finish(row.take(), &mut changes, database)?;
                row = Some(Row { op: "delete".into(), table: table_of(rest), new: false, id: None, tag: None });
            } else if rest == "SET" {
                row.as_mut().ok_or_else(|| format!("a SET outside a row: {line}"))?.new = true;
            } else if rest == "WHERE" {
                row.as_mut().ok_or_else(|| format!("a WHERE outside a row: {line}"))?.new = false;
            } else if let Some(value) = rest.trim_start().strip_prefix('@') {
                let row = row.as_mut().ok_or_else(|| format!("a value outside a row: {line}"))?;
                let (column, value) = value.split_once('=').ok_or_else(|| format!("a value without '=': {line}"))?;
                // The key from the new row of an insert or update, from the old of a delete.
                if row.new || row.op == "delete" {
                    match column {
                        "1" => row.id = Some(value.trim().parse().map_err(|_| format!("a bad id: {line}"))?),
                        "2" => row.tag = Some(value.trim().trim_matches('\'').to_string()),
                        _ => {}
                    }
                }
            } else {
                return Err(format!("an unexpected row line: {line}"));
            }
            continue;
        }
        finish(row.take(), &mut changes, database)?;
        if line.starts_with('#') && line.contains(" end_log_pos ") {
            // An event's header: `#<time> server id 1  end_log_pos 899 CRC32 0x…  <Type> …`.
            let end = line.split(" end_log_pos ").nth(1).and_then(|rest| rest.split_whitespace().next());
            let end: u64 = end.and_then(|end| end.parse().ok()).ok_or_else(|| format!("no end_log_pos: {line}"))?;
            if let Some(rest) = line.split("\tRotate to ").nth(1) {
                file = rest.split_whitespace().next().unwrap_or_default().to_string();
                continue;
            }
            if end != 0 {
                last_end = end;
            }
            if let Some(rest) = line.split("\tGTID ").nth(1) {
                let mut words = rest.split_whitespace();
                let id = words.next().ok_or_else(|| format!("a GTID without an id: {line}"))?;
                // `trans`: a transaction; `ddl` and others: a statement on its own.
                if words.next() == Some("trans") {
                    gtid = Some(id.to_string());
                    changes = Some(Vec::new());
                } else {
                    (gtid, changes) = (None, None);
                }
            } else if line.contains("\tXid = ") {
                let (Some(id), Some(done)) = (gtid.take(), changes.take()) else {
                    return Err(format!("an Xid outside a transaction: {line}"));
                };
                if !done.is_empty() {
                    transactions.push(Logged { gtid: id, changes: done, end: (file.clone(), last_end) });
                }
            }
        } else if line.starts_with("COMMIT") && changes.is_some() {
            // A transaction of a non-transactional table ends with a COMMIT query, not an Xid.
            let (id, done) = (gtid.take().unwrap_or_default(), changes.take().unwrap_or_default());
            if !done.is_empty() {
                transactions.push(Logged { gtid: id, changes: done, end: (file.clone(), last_end) });
            }
        }
    }
    finish(row.take(), &mut changes, database)?;
    Ok(transactions)
}

/// The writers' log (by GTID) and the binary log agree: the same committed transactions, each with
/// the same changes in the same order; no rolled-back change logged.
pub fn check_binlog_agreement(written: &[(Option<String>, &Written)], logged: &[Logged]) -> Result<(), String> {
    let by_gtid: BTreeMap<&str, &Written> =
        written.iter().filter_map(|(gtid, transaction)| Some((gtid.as_deref()?, *transaction))).collect();
    for transaction in logged {
        let Some(writer) = by_gtid.get(transaction.gtid.as_str()) else {
            return Err(format!("the binary log holds a transaction no writer committed: {transaction:?}"));
        };
        if writer.changes != transaction.changes {
            return Err(format!("writer and binary log differ on {}: {writer:?} / {transaction:?}", transaction.gtid));
        }
    }
    let committed = written.iter().filter(|(_, transaction)| transaction.committed).count();
    if committed != logged.len() || by_gtid.len() != committed {
        return Err(format!(
            "{committed} committed transactions ({} with a GTID), {} logged",
            by_gtid.len(),
            logged.len()
        ));
    }
    let rolled_back: std::collections::BTreeSet<&Change> = written
        .iter()
        .filter(|(_, transaction)| !transaction.committed)
        .flat_map(|(_, transaction)| &transaction.changes)
        .filter(|change| change.tag.is_some())
        .collect();
    if let Some(change) =
        logged.iter().flat_map(|transaction| &transaction.changes).find(|change| rolled_back.contains(change))
    {
        return Err(format!("the binary log holds a rolled-back change: {change:?}"));
    }
    Ok(())
}

#[cfg(test)]
mod binlog_tests {
    use super::*;

    #[test]
    fn mariadb_binlog_rows_parse_into_transactions() {
        let text = "\
# at 4
#700101  0:00:00 server id 1  end_log_pos 0 \tRotate to binlog.000002  pos: 4
#261127 12:04:05 server id 1  end_log_pos 692 CRC32 0x1640790d \tGTID 0-1-3 trans
START TRANSACTION
#261127 12:04:05 server id 1  end_log_pos 826 CRC32 0x33264fc7 \tTable_map: `d`.`t` mapped to number 18
#261127 12:04:05 server id 1  end_log_pos 899 CRC32 0x7e862844 \tWrite_rows: table id 18 flags: STMT_END_F
### INSERT INTO `d`.`t`
### SET
###   @1=1
###   @2='a'
###   @3=1
### INSERT INTO `other`.`t`
### SET
###   @1=5
###   @2='x'
### UPDATE `d`.`t`
### WHERE
###   @1=1
###   @2='a'
### SET
###   @1=1
###   @2='c'
### DELETE FROM `d`.`t`
### WHERE
###   @1=2
###   @2='b'
# Number of rows: 2
#261127 12:04:05 server id 1  end_log_pos 1297 CRC32 0x189b4db1 \tXid = 4
COMMIT/*!*/;
#261127 12:04:05 server id 1  end_log_pos 1340 CRC32 0x189b4db1 \tGTID 0-1-4 ddl
create table d.u (id int)
";
        let parsed = parse_mariadb_binlog(text, "d").unwrap();
        assert_eq!(parsed.len(), 1);
        assert_eq!(parsed[0].gtid, "0-1-3");
        assert_eq!(parsed[0].end, ("binlog.000002".to_string(), 1297));
        assert_eq!(
            parsed[0].changes,
            vec![
                Change::new("insert", "d.t", Some(1), Some("a")),
                Change::new("update", "d.t", Some(1), Some("c")),
                Change::new("delete", "d.t", Some(2), None),
            ]
        );
        assert!(parse_mariadb_binlog("### INSERT INTO `d`.`t`\n", "d").is_err());
    }
}
