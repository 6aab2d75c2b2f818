//! What a binary-log source needs of its server: `dbtrigger sql` prints it, `check` asks a live
//! server what is missing (`log_bin`, `binlog_format=ROW`, `binlog_row_image=FULL`,
//! `binlog_row_metadata=FULL`, the grants).

use mysql_async::prelude::Queryable;

/// The statements a person runs for a binary-log poller reading as `user`.
pub fn statements(user: &str, tables: &[String]) -> String {
    let mut text = String::new();
    text.push_str("-- In the server's configuration (a restart), or as server parameters on a managed server:\n");
    text.push_str("--   log_bin = ON, binlog_format = ROW, binlog_row_image = FULL, binlog_row_metadata = FULL\n");
    text.push_str("--   binlog_expire_logs_seconds (or expire_logs_days) longer than the poller may ever be stopped\n");
    text.push_str(&format!(
        "GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO '{user}'@'%';\n\
         -- MariaDB 10.5 and later: BINLOG MONITOR replaces REPLICATION CLIENT for SHOW BINARY LOGS\n\
         GRANT BINLOG MONITOR ON *.* TO '{user}'@'%';\n"
    ));
    for table in tables {
        text.push_str(&format!("GRANT SELECT ON {table} TO '{user}'@'%';\n"));
    }
    text
}

/// What the live server lacks for a binary-log source, one line each (empty: nothing).
pub async fn missing(conn: &mut mysql_async::Conn) -> Result<Vec<String>, mysql_async::Error> {
    let mut missing = Vec::new();
    let variables: Vec<(String, String)> = conn
        .query(
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN \
             ('log_bin', 'binlog_format', 'binlog_row_image', 'binlog_row_metadata')",
        )
        .await?;
    let value = |name: &str| {
        variables.iter().find(|(variable, _)| variable.eq_ignore_ascii_case(name)).map(|(_, value)| value.clone())
    };
    for (name, wanted) in
        [("log_bin", "ON"), ("binlog_format", "ROW"), ("binlog_row_image", "FULL"), ("binlog_row_metadata", "FULL")]
    {
        if let Some(finding) = finding(name, value(name).as_deref(), wanted) {
            missing.push(finding);
        }
    }
    let grants: Vec<String> = conn.query("SHOW GRANTS").await?;
    let all = grants.join("\n").to_ascii_uppercase();
    let has = |privilege: &str| all.contains("ALL PRIVILEGES ON *.*") || all.contains(privilege);
    if !has("REPLICATION SLAVE") {
        missing.push("the user lacks REPLICATION SLAVE (reads the binary log)".into());
    }
    if !has("REPLICATION CLIENT") && !has("BINLOG MONITOR") && !has("SUPER") {
        missing.push("the user lacks BINLOG MONITOR / REPLICATION CLIENT (SHOW BINARY LOGS)".into());
    }
    Ok(missing)
}

/// What a server variable's value lacks, if anything (`binlog_row_image` says what a partial
/// image costs).
fn finding(name: &str, value: Option<&str>, wanted: &str) -> Option<String> {
    let value = match value {
        Some(value) if value.eq_ignore_ascii_case(wanted) => return None,
        Some(value) => value,
        None => return Some(format!("{name} is unknown to this server: it needs {wanted}")),
    };
    let cost = match (name, value.to_ascii_uppercase().as_str()) {
        ("binlog_row_image", "MINIMAL") => {
            " (under MINIMAL an update's old row holds only its primary key and its new row only the columns it \
             set, a delete's old row only its key: what is not logged is left out of the events and named in \
             their not_logged, never sent as null)"
        }
        ("binlog_row_image", "NOBLOB") => {
            " (under NOBLOB the BLOB and TEXT columns a statement did not set are not logged: they are left out of \
             the events and named in their not_logged, never sent as null)"
        }
        _ => "",
    };
    Some(format!("{name} is {value}: set it to {wanted}{cost}"))
}

/// [`missing`] on the server of `url` (its errors as text, the URL's secrets scrubbed).
pub async fn check(url: &str) -> Result<Vec<String>, String> {
    let redaction = crate::config::redact::Redaction::of_url(url);
    let options = super::server::options_of(url).map_err(|reason| redaction.scrub(&reason))?;
    let mut conn = mysql_async::Conn::new(options).await.map_err(|error| redaction.scrub(&error.to_string()))?;
    let missing = missing(&mut conn).await.map_err(|error| redaction.scrub(&error.to_string()));
    let _ = conn.disconnect().await;
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_row_image_says_what_it_costs() {
        assert_eq!(finding("binlog_row_image", Some("full"), "FULL"), None);
        let minimal = finding("binlog_row_image", Some("MINIMAL"), "FULL").unwrap();
        assert!(minimal.starts_with("binlog_row_image is MINIMAL: set it to FULL"), "{minimal}");
        assert!(minimal.contains("only its primary key") && minimal.contains("not_logged"), "{minimal}");
        let noblob = finding("binlog_row_image", Some("NOBLOB"), "FULL").unwrap();
        assert!(noblob.contains("BLOB and TEXT") && noblob.contains("not_logged"), "{noblob}");
        assert_eq!(finding("log_bin", Some("OFF"), "ON").unwrap(), "log_bin is OFF: set it to ON");
        assert_eq!(
            finding("binlog_row_metadata", None, "FULL").unwrap(),
            "binlog_row_metadata is unknown to this server: it needs FULL"
        );
    }
}
