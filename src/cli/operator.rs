//! What every operator command shares: finding the poller as the handler would, who is acting, and
//! the guard of a write (dry run, confirmation on a terminal or `--yes`, `--force`).

use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;
use std::sync::Arc;

use anyhow::bail;

use crate::app::{App, Function};
use crate::tick::Poller;

/// How a write goes ahead.
pub struct Guard {
    pub dry_run: bool,
    pub yes: bool,
    /// Write even while a tick holds the lease (state document writes only).
    pub force: bool,
    /// Why, for the audit entry (`--reason`).
    pub reason: Option<String>,
}

impl Guard {
    /// After the plan was printed: `false` to stop here (a dry run, or a declined question).
    /// Without a terminal and without `--yes`, refuses.
    pub fn confirmed(&self, question: &str) -> anyhow::Result<bool> {
        if self.dry_run {
            println!("dry run: nothing was changed");
            return Ok(false);
        }
        if self.yes {
            return Ok(true);
        }
        if !std::io::stdin().is_terminal() {
            bail!("refusing to go ahead without confirmation: not a terminal; pass --yes to go ahead");
        }
        print!("{question} [y/N] ");
        std::io::stdout().flush()?;
        let mut answer = String::new();
        std::io::stdin().lock().read_line(&mut answer)?;
        Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
    }
}

/// The poller of `app_root` named `name` (its function or poller name), settings resolved as
/// `dev` resolves them.
pub fn find_poller(app_root: &Path, name: &str) -> anyhow::Result<Arc<Poller>> {
    let settings = crate::config::Settings::for_app_root(app_root)?;
    let app = App::load(app_root, &settings)?;
    let found = app
        .pollers()
        .map(|(_, poller)| poller)
        .find(|poller| poller.config.poller_name == name || poller.config.function_name == name)
        .cloned();
    match found {
        Some(poller) => Ok(poller),
        None => match app.function(name) {
            Some(Function::Unusable(reason)) => bail!("{name}: {reason}"),
            _ => bail!("no poller {name:?} in {} (functions: {})", app_root.display(), app.function_names().join(", ")),
        },
    }
}

/// Who is acting, for the history: `user@host`.
pub fn operator_name() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("USERNAME"))
        .ok()
        .filter(|user| !user.is_empty())
        .unwrap_or_else(|| "operator".to_string());
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|host| host.trim().to_string())
        .filter(|host| !host.is_empty())
        .unwrap_or_else(|| "unknown-host".to_string());
    format!("{user}@{host}")
}
