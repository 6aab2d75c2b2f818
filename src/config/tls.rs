//! Whether a database connection verifies the server it talks to. With no `sslmode` the
//! PostgreSQL driver prefers TLS but falls back to plaintext, and `sslmode=require` encrypts
//! without checking the certificate: either lets anyone on the path read the rows and the
//! password, or answer in the database's place. Only `verify-full` (PostgreSQL) and
//! `VERIFY_IDENTITY` (MySQL, MariaDB) check both the certificate chain and the host name. A loopback
//! host or a Unix socket never leaves the machine, and a SQLite file has no connection at all.
//!
//! Judged from the options the driver really uses (URL, then its environment defaults such as
//! `PGSSLMODE`), and said as a warning at start-up and by `check`: a refusal would break setups
//! where the path is trusted (a private network), a silence would hide the risk.

use std::net::IpAddr;
use std::str::FromStr;

use super::source::{Engine, SourceConfig};

/// What a source's connection does about the server's identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportSecurity {
    /// SQLite, a loopback address or a Unix socket: nothing crosses a network.
    Local,
    /// TLS with the certificate chain and the host name checked.
    Verified,
    /// Not verified: `mode` is the setting as the driver understands it.
    Unverified { host: String, mode: String },
}

/// How `source` connects, judged from its resolved URL.
pub fn transport_security(source: &SourceConfig) -> TransportSecurity {
    let url = source.url.expose();
    match source.engine {
        Engine::Sqlite => TransportSecurity::Local,
        Engine::Postgres => {
            use sqlx::postgres::{PgConnectOptions, PgSslMode};
            // A URL the configuration accepted parses; were it not to, nothing would connect.
            let Ok(options) = PgConnectOptions::from_str(url) else {
                return TransportSecurity::Local;
            };
            if options.get_socket().is_some() || is_local_host(options.get_host()) {
                return TransportSecurity::Local;
            }
            let mode = match options.get_ssl_mode() {
                PgSslMode::VerifyFull => return TransportSecurity::Verified,
                PgSslMode::Disable => "disable",
                PgSslMode::Allow => "allow",
                PgSslMode::Prefer => "prefer",
                PgSslMode::Require => "require",
                PgSslMode::VerifyCa => "verify-ca",
            };
            TransportSecurity::Unverified { host: options.get_host().to_string(), mode: format!("sslmode={mode}") }
        }
        Engine::MySql => {
            use sqlx::mysql::{MySqlConnectOptions, MySqlSslMode};
            let Ok(options) = MySqlConnectOptions::from_str(url) else {
                return TransportSecurity::Local;
            };
            if options.get_socket().is_some() || is_local_host(options.get_host()) {
                return TransportSecurity::Local;
            }
            let mode = match options.get_ssl_mode() {
                MySqlSslMode::VerifyIdentity => return TransportSecurity::Verified,
                MySqlSslMode::Disabled => "DISABLED",
                MySqlSslMode::Preferred => "PREFERRED",
                MySqlSslMode::Required => "REQUIRED",
                MySqlSslMode::VerifyCa => "VERIFY_CA",
            };
            TransportSecurity::Unverified { host: options.get_host().to_string(), mode: format!("ssl-mode={mode}") }
        }
    }
}

/// The warning to give about `source`'s connection, if it deserves one (it never quotes the URL).
pub fn tls_warning(source: &SourceConfig) -> Option<String> {
    let TransportSecurity::Unverified { host, mode } = transport_security(source) else {
        return None;
    };
    // The public roots (Azure's among them) are built in: a private CA is added with a file.
    let fix = match source.engine {
        Engine::MySql => "add ssl-mode=VERIFY_IDENTITY (and ssl-ca=<file> for a private CA)",
        _ => "add sslmode=verify-full (and sslrootcert=<file> for a private CA)",
    };
    let risk = if may_be_plaintext(&mode) {
        "may run in plaintext, and its server is not verified"
    } else {
        "is encrypted, but its server's certificate is not verified"
    };
    Some(format!(
        "the connection to {host} (app setting {}, {mode}) {risk}: anyone on the path can read the rows and the \
         password, or answer in the database's place; {fix} to the URL (docs/security.md, \"TLS to the database\")",
        source.connection
    ))
}

/// Whether an unverified connection's `mode` (as [`TransportSecurity::Unverified`] names it) lets
/// the driver fall back to plaintext.
pub fn may_be_plaintext(mode: &str) -> bool {
    matches!(mode, "sslmode=disable" | "sslmode=allow" | "sslmode=prefer" | "ssl-mode=DISABLED" | "ssl-mode=PREFERRED")
}

fn is_local_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") || host.starts_with('/') || host.is_empty() {
        return true;
    }
    host.parse::<IpAddr>().is_ok_and(|address| address.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Secret, SourceTarget};

    fn source(engine: Engine, url: &str) -> SourceConfig {
        SourceConfig {
            connection: "ORDERS_DB".into(),
            engine,
            url: Secret::new(url),
            target: SourceTarget::Table { schema: None, name: "orders".into() },
            cursor: "version".into(),
            pk: vec!["id".into()],
            columns: None,
            where_clause: None,
            settle: std::time::Duration::ZERO,
            settle_configured: false,
            cursor_kind: None,
            settle_mode: crate::config::source::SettleMode::Fixed,
            query_timeout: std::time::Duration::from_secs(5),
            cursor_time_zone: "UTC".into(),
            ops: Default::default(),
            generation: None,
            pool_key: String::new(),
            max_connections: 10,
            max_row_bytes: crate::config::limits::ROW_MAX_BYTES,
            oversized_rows: crate::config::OversizedRows::Stop,
            identity: None,
        }
    }

    /// Regression (issue 30, item 5): a remote database whose server is not verified (no sslmode,
    /// `require`, `verify-ca`; MySQL below VERIFY_IDENTITY) is named in a warning that says the
    /// fix and never quotes the password; verify-full, loopback hosts and SQLite are not.
    #[test]
    fn an_unverified_remote_database_connection_is_warned_about() {
        let cases = [
            ("postgres://app:Hunter2pw@db.example.com/orders", Some("sslmode=prefer")),
            ("postgres://app:Hunter2pw@db.example.com/orders?sslmode=require", Some("sslmode=require")),
            ("postgres://app:Hunter2pw@db.example.com/orders?sslmode=verify-ca", Some("sslmode=verify-ca")),
            ("postgres://app:Hunter2pw@db.example.com/orders?sslmode=verify-full", None),
            ("postgres://app:Hunter2pw@127.0.0.1:5432/orders", None),
            ("postgres://app:Hunter2pw@localhost/orders?sslmode=disable", None),
        ];
        for (url, expected) in cases {
            let warning = tls_warning(&source(Engine::Postgres, url));
            match expected {
                None => assert_eq!(warning, None, "{url}"),
                Some(mode) => {
                    let warning = warning.unwrap_or_else(|| panic!("a warning for {url}"));
                    assert!(warning.contains(mode) && warning.contains("db.example.com"), "{warning}");
                    assert!(warning.contains("verify-full") && !warning.contains("Hunter2pw"), "{warning}");
                }
            }
        }
        let mysql =
            tls_warning(&source(Engine::MySql, "mysql://app:Hunter2pw@db.example.com/orders?ssl-mode=REQUIRED"));
        assert!(mysql.as_deref().is_some_and(|warning| warning.contains("VERIFY_IDENTITY")), "{mysql:?}");
        let mysql = source(Engine::MySql, "mysql://app:pw@db.example.com/orders?ssl-mode=VERIFY_IDENTITY");
        assert_eq!(tls_warning(&mysql), None);
        assert_eq!(transport_security(&source(Engine::Sqlite, "sqlite:///tmp/x.db")), TransportSecurity::Local);
    }
}
