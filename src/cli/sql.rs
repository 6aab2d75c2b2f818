//! `dbtrigger sql <poller>`: prints the DDL the poller's cursor needs ([`crate::source::ddl`]).
//! Nothing is run, nothing is connected to.

use std::path::Path;
use std::process::ExitCode;
use std::str::FromStr;

use anyhow::bail;

use super::operator::find_poller;
use crate::config::{Engine, SourceConfig};

pub fn run(app_root: &Path, name: &str) -> anyhow::Result<ExitCode> {
    let poller = find_poller(app_root, name)?;
    let source = &poller.config.source;
    if let crate::config::SourceTarget::Logical { slot, publication } = &source.target {
        let user = connecting_user(source);
        print!("{}", crate::source::logical::setup::logical_ddl(&poller.config.poller_name, slot, publication, user.as_deref()));
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
