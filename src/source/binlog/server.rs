//! What a binary-log source asks the server with plain SQL: how to connect (from the source's
//! URL), where the binary log ends, which files it keeps, the configured tables' column types,
//! and the dump itself (`COM_BINLOG_DUMP` through `mysql_async`, from a file and an offset, with
//! MariaDB's GTID events asked for).

use std::collections::HashMap;

use mysql_async::prelude::Queryable;
use mysql_async::{BinlogStream, BinlogStreamRequest, Conn, Opts, OptsBuilder, SslOpts};

use super::values::{ColumnInfo, TableInfo};
use crate::config::redact::Redaction;
use crate::domain::binlog::{BinlogPos, FileNames, GtidPos};
use crate::source::SourceError;

/// Connection options from a `mysql://` URL as the polling source takes it (`ssl-mode`
/// `REQUIRED`, `VERIFY_CA`, `VERIFY_IDENTITY`; other parameters are the other driver's).
pub fn options_of(url: &str) -> Result<Opts, String> {
    let parsed = url::Url::parse(url).map_err(|error| format!("not a URL: {error}"))?;
    let decode = |text: &str| percent_encoding::percent_decode_str(text).decode_utf8_lossy().into_owned();
    let mut builder = OptsBuilder::default()
        .ip_or_hostname(parsed.host_str().unwrap_or("localhost").to_string())
        .tcp_port(parsed.port().unwrap_or(3306))
        .user(Some(decode(parsed.username())).filter(|user| !user.is_empty()))
        .pass(parsed.password().map(decode))
        .db_name(Some(parsed.path().trim_start_matches('/').to_string()).filter(|name| !name.is_empty()))
        .prefer_socket(false);
    for (name, value) in parsed.query_pairs() {
        if name.eq_ignore_ascii_case("ssl-mode") || name.eq_ignore_ascii_case("sslmode") {
            let ssl = match value.to_ascii_uppercase().as_str() {
                "REQUIRED" => Some(SslOpts::default().with_danger_accept_invalid_certs(true)),
                "VERIFY_CA" => Some(SslOpts::default().with_danger_skip_domain_validation(true)),
                "VERIFY_IDENTITY" => Some(SslOpts::default()),
                _ => None,
            };
            builder = builder.ssl_opts(ssl);
        }
    }
    Ok(builder.into())
}

pub fn error(redaction: &Redaction, error: mysql_async::Error) -> SourceError {
    let reason = redaction.scrub(&error.to_string());
    match error {
        mysql_async::Error::Io(_) | mysql_async::Error::Url(_) => {
            SourceError::Unreachable { location: redaction.location.clone(), reason }
        }
        mysql_async::Error::Server(server) if server.code == 1045 => {
            SourceError::Unreachable { location: redaction.location.clone(), reason }
        }
        _ => SourceError::Query { location: redaction.location.clone(), reason },
    }
}

/// The end of the binary log: the file being written and the offset after its last event.
pub async fn end(conn: &mut Conn) -> Result<Result<(String, u64), String>, mysql_async::Error> {
    // MariaDB and MySQL before 8.4 (`SHOW BINARY LOG STATUS` replaces it there).
    let row: Option<mysql_async::Row> = match conn.query_first("SHOW MASTER STATUS").await {
        Ok(row) => row,
        Err(mysql_async::Error::Server(_)) => conn.query_first("SHOW BINARY LOG STATUS").await?,
        Err(other) => return Err(other),
    };
    let Some(row) = row else {
        return Ok(Err("the server has no binary log (log_bin is OFF)".into()));
    };
    let file: Option<String> = row.get(0);
    let offset: Option<u64> = row.get(1);
    Ok(match (file, offset) {
        (Some(file), Some(offset)) => Ok((file, offset)),
        _ => Err("SHOW MASTER STATUS gave no file and position".into()),
    })
}

/// The files the server keeps, oldest first, with their sizes.
pub async fn files(conn: &mut Conn) -> Result<Vec<(String, u64)>, mysql_async::Error> {
    let rows: Vec<mysql_async::Row> = conn.query("SHOW BINARY LOGS").await?;
    Ok(rows.into_iter().filter_map(|row| Some((row.get::<String, _>(0)?, row.get::<u64, _>(1).unwrap_or(0)))).collect())
}

/// The end as a position, with the server's file naming.
pub async fn end_position(conn: &mut Conn) -> Result<Result<(BinlogPos, FileNames), String>, mysql_async::Error> {
    Ok(end(conn).await?.and_then(|(file, offset)| {
        let (names, number) = FileNames::parse(&file).ok_or_else(|| format!("a binary log named {file:?}"))?;
        Ok((BinlogPos { file: number, offset: u32::try_from(offset).unwrap_or(u32::MAX) }, names))
    }))
}

/// The configured tables' columns, as `information_schema` has them now (their types, and the
/// primary key's columns for a table map that does not name them).
pub async fn table_info(conn: &mut Conn, tables: &[String]) -> Result<HashMap<String, TableInfo>, mysql_async::Error> {
    let mut info: HashMap<String, TableInfo> = HashMap::new();
    for table in tables {
        let Some((database, name)) = table.split_once('.') else { continue };
        let rows: Vec<(String, String, String, i64)> = conn
            .exec(
                "SELECT COLUMN_NAME, LOWER(DATA_TYPE), LOWER(COLUMN_TYPE), COLUMN_KEY = 'PRI' \
                 FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?",
                (database, name),
            )
            .await?;
        let mut columns = TableInfo::new();
        for (column, data_type, column_type, key) in rows {
            columns.insert(column, ColumnInfo { data_type, column_type, key: key != 0 });
        }
        info.insert(table.clone(), columns);
    }
    Ok(info)
}

/// A dump from `from`, to the end of what is written (non-blocking), as replica `server_id`.
pub async fn dump(
    mut conn: Conn,
    server_id: u32,
    names: &FileNames,
    from: BinlogPos,
) -> Result<BinlogStream, mysql_async::Error> {
    // MariaDB: send GTID events as they are (not rewritten as BEGIN); MySQL ignores the variable.
    conn.query_drop("SET @mariadb_slave_capability = 4").await?;
    let file = names.name(from.file);
    let request = BinlogStreamRequest::new(server_id)
        .with_filename(file.as_bytes())
        .with_pos(u64::from(from.offset))
        .with_non_blocking();
    conn.get_binlog_stream(request).await
}

/// The server's global `binlog_format` (`ROW`, `MIXED`, `STATEMENT`).
pub async fn binlog_format(conn: &mut Conn) -> Result<String, mysql_async::Error> {
    let format: Option<Option<String>> = conn.query_first("SELECT @@GLOBAL.binlog_format").await?;
    Ok(format.flatten().unwrap_or_default())
}

/// Who the server is, as a checkpoint records it: MariaDB has no server UUID, its `server_id`
/// (which replication needs distinct on every server of a topology) names it; MySQL's
/// `server_uuid`. And whether it is MariaDB (whose GTIDs the checkpoint records).
pub async fn identity(conn: &mut Conn) -> Result<(String, bool), mysql_async::Error> {
    let (id, version): (Option<u64>, Option<String>) =
        conn.query_first("SELECT @@server_id, @@version").await?.unwrap_or((None, None));
    let mariadb = version.as_deref().is_some_and(|version| version.contains("MariaDB"));
    let id = id.unwrap_or(0);
    if mariadb {
        return Ok((format!("server_id {id}"), true));
    }
    let uuid: Option<String> = conn.query_first("SELECT @@server_uuid").await.ok().flatten();
    Ok((uuid.map(|uuid| format!("server_uuid {uuid}")).unwrap_or_else(|| format!("server_id {id}")), false))
}

/// MariaDB's `@@gtid_binlog_pos`: the last GTID of each domain in its binary log.
pub async fn gtid_binlog_pos(conn: &mut Conn) -> Result<Result<GtidPos, String>, mysql_async::Error> {
    let text: Option<String> = conn.query_first("SELECT @@gtid_binlog_pos").await?;
    let text = text.unwrap_or_default();
    Ok(GtidPos::parse(&text).ok_or_else(|| format!("@@gtid_binlog_pos is {text:?}, not a GTID position")))
}

/// MariaDB's `@@gtid_strict_mode`: the server refuses to log a GTID whose sequence number does not
/// grow within its domain.
pub async fn gtid_strict_mode(conn: &mut Conn) -> Result<bool, mysql_async::Error> {
    let strict: Option<Option<i64>> = conn.query_first("SELECT @@gtid_strict_mode").await?;
    Ok(strict.flatten().unwrap_or(0) != 0)
}

/// MariaDB's `BINLOG_GTID_POS(file, offset)`: the GTID position at a place in the binary log,
/// `None` when the place is not the start of an event of a file the server keeps. (The server
/// reads the file from its start to there.)
pub async fn gtid_pos_at(
    conn: &mut Conn,
    names: &FileNames,
    at: BinlogPos,
) -> Result<Option<GtidPos>, mysql_async::Error> {
    let text: Option<Option<String>> =
        conn.exec_first("SELECT BINLOG_GTID_POS(?, ?)", (names.name(at.file), at.offset)).await?;
    Ok(text.flatten().and_then(|text| GtidPos::parse(&text)))
}

/// A MariaDB dump by GTID: from the first transaction after `from` (what a replica with
/// `MASTER_USE_GTID` asks: `@slave_connect_state`, then `COM_BINLOG_DUMP` with no file name),
/// non-blocking, as replica `server_id`.
pub async fn dump_by_gtid(mut conn: Conn, server_id: u32, from: &GtidPos) -> Result<BinlogStream, mysql_async::Error> {
    conn.query_drop("SET @mariadb_slave_capability = 4").await?;
    conn.exec_drop("SET @slave_connect_state = ?", (from.to_string(),)).await?;
    conn.query_drop("SET @slave_gtid_strict_mode = 0, @slave_gtid_ignore_duplicates = 0").await?;
    let request = BinlogStreamRequest::new(server_id).with_non_blocking();
    conn.get_binlog_stream(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_options_carry_the_target_and_tls() {
        let options = options_of("mysql://u:p%40ss@db.example:3307/shop?ssl-mode=VERIFY_IDENTITY").unwrap();
        assert_eq!(options.ip_or_hostname(), "db.example");
        assert_eq!(options.tcp_port(), 3307);
        assert_eq!(options.pass(), Some("p@ss"));
        assert_eq!(options.db_name(), Some("shop"));
        assert!(options.ssl_opts().is_some());
    }
}
