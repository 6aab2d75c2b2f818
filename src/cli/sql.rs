//! `dbtrigger sql <poller>`: prints the DDL the poller's cursor needs ([`crate::source::ddl`]).
//! Nothing is run, nothing is connected to.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::ExitCode;
use std::str::FromStr;

use anyhow::bail;

use super::operator::find_poller;
use crate::config::{Engine, SourceConfig};

pub fn run(app_root: &Path, name: &str) -> anyhow::Result<ExitCode> {
    let poller = find_poller(app_root, name)?;
    let source = &poller.config.source;
    if let crate::config::SourceTarget::Logical { slot, publication, .. } = &source.target {
        let user = connecting_user(source);
        print!(
            "{}",
            crate::source::logical::setup::logical_ddl(&poller.config.poller_name, slot, publication, user.as_deref())
        );
        return Ok(ExitCode::SUCCESS);
    }
    if let crate::config::SourceTarget::Binlog { tables, .. } = &source.target {
        let user = connecting_user(source).unwrap_or_else(|| "<user>".into());
        print!("{}", crate::source::binlog::setup::statements(&user, tables));
        return Ok(ExitCode::SUCCESS);
    }
    match crate::source::ddl::cursor_ddl(&poller.config.poller_name, source, connecting_user(source).as_deref()) {
        Ok(ddl) => {
            print!("{ddl}");
            Ok(ExitCode::SUCCESS)
        }
        Err(reason) => bail!("{reason}"),
    }
}

/// `check`'s live part: each logical or binary-log poller's server, asked what its source needs
/// (`wal_level`, the slot, the publication and its tables' replica identity, the role's
/// privilege; `log_bin`, the row format, the grants), and a binary-log poller's tables, what
/// changes the log will not hold (a cascading foreign key: a warning). The pollers something is
/// missing for. Pollers of other sources are not connected to.
pub async fn check_live(app_root: &Path) -> anyhow::Result<BTreeSet<String>> {
    let settings = crate::config::Settings::for_app_root(app_root)?;
    let Ok(config) = crate::config::AppConfig::load(app_root, &settings) else {
        // The offline check has said why.
        return Ok(BTreeSet::new());
    };
    let mut missing_for = BTreeSet::new();
    for parsed in config.functions.values() {
        let Ok(crate::config::FunctionConfig::Poller(poller)) = parsed else { continue };
        let name = &poller.poller_name;
        if !matches!(
            poller.source.target,
            crate::config::SourceTarget::Binlog { .. } | crate::config::SourceTarget::Logical { .. }
        ) {
            continue;
        }
        let url = match live_url(&poller.source).await {
            Ok(url) => url,
            Err(reason) => {
                missing_for.insert(name.clone());
                println!("missing {name}: the server cannot be asked: {reason}");
                continue;
            }
        };
        if let crate::config::SourceTarget::Binlog { tables, .. } = &poller.source.target {
            match crate::source::binlog::setup::check(url.expose()).await {
                Ok(missing) if missing.is_empty() => {
                    println!(
                        "ok {name}: log_bin, ROW events with full images and column names, the grants to read them"
                    );
                }
                Ok(missing) => {
                    missing_for.insert(name.clone());
                    for what in missing {
                        println!("missing {name}: {what} (`dbtrigger sql {name}` prints the set-up)");
                    }
                }
                Err(reason) => {
                    missing_for.insert(name.clone());
                    println!("missing {name}: the server cannot be asked: {reason}");
                }
            }
            // Warnings do not fail the check: a cascade that never fires on a watched table's
            // rows loses nothing. They are said every time.
            match crate::source::binlog::cascades::check(url.expose(), tables).await {
                Ok(warnings) => {
                    for warning in warnings {
                        println!("warning: {name}: {warning}");
                    }
                }
                Err(reason) => println!("warning: {name}: the tables' foreign keys cannot be read: {reason}"),
            }
            continue;
        }
        let crate::config::SourceTarget::Logical { slot, publication, origin } = &poller.source.target else {
            continue;
        };
        match crate::source::logical::setup::check(url.expose(), slot, publication, *origin).await {
            Ok(findings) => {
                for finding in findings {
                    if !finding.ok {
                        missing_for.insert(name.clone());
                    }
                    println!("{} {name}: {}", if finding.ok { "ok" } else { "missing" }, finding.what);
                }
            }
            Err(reason) => {
                missing_for.insert(name.clone());
                println!("missing {name}: the server cannot be asked: {reason}");
            }
        }
    }
    Ok(missing_for)
}

/// The URL the live check logs in with: the poller's own, or, for a login by managed identity
/// (`<connection>__credential`), the same with a token of the identity as its password. A secret
/// either way; an error names the setting, never the token.
async fn live_url(source: &SourceConfig) -> Result<crate::settings::Secret, String> {
    let Some(identity) = &source.identity else {
        return Ok(source.url.clone());
    };
    let location = crate::source::redacted_location(source.url.expose());
    let token = crate::source::entra::DatabaseToken::new(identity.clone());
    let password = token.password(std::time::SystemTime::now(), &location).await.map_err(|error| error.to_string())?;
    let mut url =
        url::Url::parse(source.url.expose()).map_err(|_| format!("{location}: the connection is not a URL"))?;
    url.set_password(Some(password.token.expose()))
        .map_err(|()| format!("{location}: the connection URL cannot carry a password"))?;
    Ok(crate::settings::Secret::new(url.as_str()))
}

/// The account the poller's URL connects as, as its driver resolves it (a `?user=` included).
fn connecting_user(source: &SourceConfig) -> Option<String> {
    let url = source.url.expose();
    let user = match source.engine {
        Engine::Postgres => sqlx::postgres::PgConnectOptions::from_str(url).ok()?.get_username().to_string(),
        Engine::MySql => sqlx::mysql::MySqlConnectOptions::from_str(url).ok()?.get_username().to_string(),
        Engine::Sqlite => return None,
    };
    Some(user).filter(|user| !user.is_empty())
}
