//! A source's database URL: what identifies it (engine, host, database, user; never the
//! password), the effective target the driver resolves, and the key of the pool it shares.

use std::path::Path;
use std::str::FromStr;

use super::source_types::Engine;
use crate::config::{ConfigError, Located, redact};
use crate::domain::ids::FingerprintInput;
use crate::settings::Settings;

/// The parts of a database URL that identify it (no password).
pub(in crate::config) struct UrlIdentity {
    pub(in crate::config) engine: Engine,
    pub(in crate::config) host: String,
    pub(in crate::config) port: Option<u16>,
    pub(in crate::config) database: String,
    pub(in crate::config) user: String,
}

/// The database URL a source's `connection` setting holds, parsed.
pub(in crate::config) struct SourceUrl<'s> {
    pub(in crate::config) identity: UrlIdentity,
    /// The URL to connect with (a SQLite path made absolute).
    pub(in crate::config) resolved: String,
    /// The setting's own text.
    pub(in crate::config) setting: &'s str,
}

/// The URL of app setting `connection`, parsed; an error never quotes it (it may hold a password).
pub(in crate::config) fn resolve<'s>(
    connection: &str,
    settings: &'s Settings,
    app_root: &Path,
    at: &Located<'_>,
) -> Result<SourceUrl<'s>, ConfigError> {
    let setting = settings.get(connection).ok_or_else(|| {
        at.error(
            "poller.source.connection",
            format!("app setting {connection} is not set (it must hold the database URL)"),
        )
    })?;
    let (identity, resolved) = parse_source_url(setting, app_root)
        .map_err(|reason| at.error("poller.source.connection", format!("app setting {connection}: {reason}")))?;
    Ok(SourceUrl { identity, resolved, setting })
}

pub(in crate::config) fn parse_source_url(url: &str, app_root: &Path) -> Result<(UrlIdentity, String), String> {
    let scheme = url.split(':').next().unwrap_or_default().to_ascii_lowercase();
    match scheme.as_str() {
        "sqlite" => {
            // The scheme may be all there is (`sqlite`): nothing after it is an empty path.
            let rest = url.get("sqlite:".len()..).unwrap_or_default().trim_start_matches("//");
            let (path, query) = match rest.split_once('?') {
                Some((path, query)) => (path, Some(query)),
                None => (rest, None),
            };
            if path.is_empty() {
                return Err("a sqlite URL needs a file path: sqlite://path/to/file.db".to_string());
            }
            if path == ":memory:" {
                return Err("a sqlite URL names a database file: an in-memory database (:memory:) has no rows \
                            for a poller to read"
                    .to_string());
            }
            if let Some(query) = query {
                check_sqlite_parameters(query)?;
            }
            let resolved_path = if Path::new(path).is_absolute() {
                path.to_string()
            } else {
                app_root.join(path).to_string_lossy().into_owned()
            };
            let resolved = match query {
                Some(query) => format!("sqlite://{resolved_path}?{query}"),
                None => format!("sqlite://{resolved_path}"),
            };
            let identity = UrlIdentity {
                engine: Engine::Sqlite,
                host: String::new(),
                port: None,
                database: path.to_string(),
                user: String::new(),
            };
            Ok((identity, resolved))
        }
        "postgres" | "postgresql" | "mysql" | "mariadb" => {
            let parsed = url::Url::parse(url).map_err(|error| format!("not a valid URL: {error}"))?;
            let engine = if scheme.starts_with("postgres") { Engine::Postgres } else { Engine::MySql };
            let identity = UrlIdentity {
                engine,
                host: parsed.host_str().unwrap_or_default().to_string(),
                port: parsed.port(),
                database: parsed.path().trim_start_matches('/').to_string(),
                user: parsed.username().to_string(),
            };
            let resolved = match engine {
                Engine::Postgres => without_unsupported_postgres_parameters(parsed),
                _ if scheme == "mariadb" => url.replacen("mariadb", "mysql", 1),
                _ => url.to_string(),
            };
            Ok((identity, resolved))
        }
        // The scheme is quoted only when the text is a URL with one: a value without `://` may
        // be anything (a password pasted in the wrong setting), and is never repeated.
        _ if url.contains("://")
            && scheme.len() <= 16
            && scheme.chars().all(|character| character.is_ascii_alphanumeric() || "+-.".contains(character)) =>
        {
            Err(format!("unsupported database URL scheme {scheme:?}: expected postgres://, mysql:// or sqlite://"))
        }
        _ => Err("is not a database URL: expected postgres://, mysql:// or sqlite://".to_string()),
    }
}

/// A sqlite URL's parameters are SQLite's URI parameters; those a poller can use are accepted, any
/// other refused (SQLite itself ignores a parameter it does not know, which would hide a typo).
fn check_sqlite_parameters(query: &str) -> Result<(), String> {
    for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
        let accepted = match &*key {
            "mode" => match &*value {
                "ro" => true,
                "rw" | "rwc" | "memory" => {
                    return Err(format!(
                        "mode={value} in a sqlite URL: a poller reads a database that exists, read-only, and \
                         never writes or creates one (use mode=ro, or leave mode out)"
                    ));
                }
                _ => false,
            },
            "immutable" => matches!(&*value, "0" | "1" | "true" | "false"),
            "cache" => matches!(&*value, "private" | "shared"),
            "vfs" => !value.is_empty(),
            _ => {
                return Err(format!(
                    "unknown parameter {key:?} in a sqlite URL: dbtrigger understands mode (ro, rw), \
                     immutable (0, 1), cache (private, shared) and vfs"
                ));
            }
        };
        if !accepted {
            return Err(format!("the value of {key} in a sqlite URL is not one SQLite takes for {key}"));
        }
    }
    Ok(())
}

/// The query parameters PostgreSQL's driver understands. It logs any other one *with its value*
/// ("ignoring unrecognized connect parameter"), which would print an `sslpassword` or a misspelt
/// `pasword` in clear: those are removed here, and named (never their value) in a warning.
const POSTGRES_PARAMETERS: [&str; 18] = [
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

fn without_unsupported_postgres_parameters(mut parsed: url::Url) -> String {
    if parsed.query().is_none() {
        return parsed.to_string();
    }
    let mut kept = Vec::new();
    for (name, value) in parsed.query_pairs() {
        if POSTGRES_PARAMETERS.contains(&name.as_ref()) {
            kept.push((name.into_owned(), value.into_owned()));
        } else {
            tracing::warn!(parameter = %name, "ignoring a database URL parameter the PostgreSQL driver does not support");
        }
    }
    if kept.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(kept);
    }
    parsed.to_string()
}

/// The database a URL really points at, as the driver resolves it: query parameters
/// (`?host=`, `?port=`, `?dbname=`, `?user=`, `?options=`) and the driver's defaults included.
pub(in crate::config) struct EffectiveTarget {
    pub(in crate::config) host: String,
    pub(in crate::config) port: Option<u16>,
    pub(in crate::config) socket: Option<String>,
    pub(in crate::config) database: String,
    pub(in crate::config) user: String,
    pub(in crate::config) options: Option<String>,
}

impl EffectiveTarget {
    /// A source fingerprint's input for this target: the connection's fields filled in, no
    /// column list or filter (a polling source adds its own).
    pub(in crate::config) fn fingerprint_input<'a>(
        &'a self,
        engine: Engine,
        target: String,
        cursor: &'a str,
        pk: &'a [String],
    ) -> FingerprintInput<'a> {
        FingerprintInput {
            engine: engine.name(),
            host: &self.host,
            port: self.port,
            database: &self.database,
            user: &self.user,
            socket: self.socket.as_deref(),
            options: self.options.as_deref(),
            target,
            cursor,
            pk,
            columns: None,
            where_clause: None,
        }
    }
}

/// The effective target of `resolved_url`, or an error naming the app setting (never its value).
pub(in crate::config) fn effective_of(
    identity: &UrlIdentity,
    resolved_url: &str,
    setting: &str,
    at: &Located<'_>,
) -> Result<EffectiveTarget, ConfigError> {
    effective_target(identity, resolved_url)
        .map_err(|reason| at.error("poller.source.connection", format!("app setting {setting}: {reason}")))
}

fn effective_target(identity: &UrlIdentity, resolved_url: &str) -> Result<EffectiveTarget, String> {
    let redaction = redact::Redaction::of_url(resolved_url);
    let invalid = |error: sqlx::Error| format!("not a valid database URL: {}", redaction.scrub(&error.to_string()));
    match identity.engine {
        Engine::Sqlite => Ok(EffectiveTarget {
            host: identity.host.clone(),
            port: identity.port,
            socket: None,
            database: identity.database.clone(),
            user: identity.user.clone(),
            options: None,
        }),
        Engine::Postgres => {
            let options = sqlx::postgres::PgConnectOptions::from_str(resolved_url).map_err(invalid)?;
            let user = options.get_username().to_string();
            Ok(EffectiveTarget {
                host: options.get_host().to_string(),
                port: Some(options.get_port()),
                socket: options.get_socket().map(|path| path.display().to_string()),
                // PostgreSQL's default database is the user's name.
                database: options.get_database().map(str::to_string).unwrap_or_else(|| user.clone()),
                user,
                options: options.get_options().map(str::to_string),
            })
        }
        Engine::MySql => {
            let options = sqlx::mysql::MySqlConnectOptions::from_str(resolved_url).map_err(invalid)?;
            Ok(EffectiveTarget {
                host: options.get_host().to_string(),
                port: Some(options.get_port()),
                socket: options.get_socket().map(|path| path.display().to_string()),
                database: options.get_database().unwrap_or_default().to_string(),
                user: options.get_username().to_string(),
                options: None,
            })
        }
    }
}

/// The key of the pool a source shares: a digest of the effective target (as the fingerprint
/// sees it), the password and the URL's other parameters (TLS among them), sorted; so that two
/// URLs that write one database differently share a pool, and two that log in differently do
/// not. A digest: the key may be logged, the password must not be.
pub(in crate::config) fn pool_key(engine: Engine, effective: &EffectiveTarget, resolved_url: &str) -> String {
    use sha2::Digest;
    const TARGET_PARAMETERS: [&str; 7] = ["host", "hostaddr", "port", "dbname", "user", "options", "socket"];
    let mut hasher = sha2::Sha256::new();
    let mut part = |text: &str| {
        hasher.update((text.len() as u64).to_be_bytes());
        hasher.update(text.as_bytes());
    };
    part(engine.name());
    part(&effective.host);
    part(&effective.port.map(|port| port.to_string()).unwrap_or_default());
    part(effective.socket.as_deref().unwrap_or_default());
    part(&effective.database);
    part(&effective.user);
    part(effective.options.as_deref().unwrap_or_default());
    match url::Url::parse(resolved_url) {
        Ok(parsed) if engine != Engine::Sqlite => {
            part(parsed.password().unwrap_or_default());
            let mut parameters: Vec<(String, String)> = parsed
                .query_pairs()
                .filter(|(name, _)| !TARGET_PARAMETERS.contains(&name.to_ascii_lowercase().as_str()))
                .map(|(name, value)| (name.into_owned(), value.into_owned()))
                .collect();
            parameters.sort();
            for (name, value) in parameters {
                part(&name);
                part(&value);
            }
        }
        _ => part(resolved_url),
    }
    format!("{}:{}", engine.name(), &hex::encode(hasher.finalize())[..16])
}

/// Whether the URL's query names a different target than its surface (host, port, database,
/// user, options, socket): then the surface-only fingerprint of earlier builds cannot be trusted.
pub(in crate::config) fn url_changes_target_in_query(url: &str) -> bool {
    const TARGET_PARAMETERS: [&str; 8] = ["host", "hostaddr", "port", "dbname", "user", "options", "socket", "service"];
    let Some((_, query)) = url.split_once('?') else {
        return false;
    };
    query.split('&').any(|pair| {
        let name = pair.split('=').next().unwrap_or_default().to_ascii_lowercase();
        TARGET_PARAMETERS.contains(&name.as_str())
    })
}
