//! The watchdog function's run: judge the pollers, then kick the ones a tick may fix within the time
//! the invocation has left.

use chrono::{DateTime, Utc};
use tracing::warn;

use super::{App, Function, Invocation};

impl App {
    /// One watchdog run: judge the pollers the host runs, then kick, within the time the
    /// invocation has left, the ones a tick may fix.
    pub(super) async fn watch(&self, function: &str, watchdog: &crate::watchdog::Watchdog) -> Invocation {
        let started = self.clock.now();
        let pollers = self.enabled_pollers();
        let mut unusable = Vec::new();
        let mut disabled = Vec::new();
        for (name, function) in &self.functions {
            match (self.disabled.contains_key(name), function) {
                (true, Function::Poller(poller)) => disabled.push(poller.config.poller_name.clone()),
                (true, _) => disabled.push(name.clone()),
                (false, Function::Unusable(reason)) => unusable.push((name.clone(), reason.to_string())),
                (false, _) => {}
            }
        }
        let report = watchdog.run(&pollers, &unusable, &disabled, started, &self.schedule_zone).await;
        let mut lines = report.lines();
        if watchdog.config.kick {
            // Regression (issue 24, item 12): kicks ran one after another with no overall
            // budget, so a few slow ones outlasted functionTimeout and the host restarted the
            // whole process, every tick in flight with it.
            let deadline = self.function_timeout.limit.and_then(|limit| {
                chrono::Duration::from_std(limit).ok().and_then(|limit| started.checked_add_signed(limit))
            });
            for name in &report.to_kick {
                let Some((_, poller)) = pollers.iter().find(|(candidate, _)| candidate == name) else {
                    continue;
                };
                let budget = poller.config.batch.tick_budget;
                match kick_fits(deadline, self.clock.now(), budget) {
                    Ok(()) => {
                        let kicked = match crate::telemetry::traced::child_context(&format!("kick {name}")) {
                            Some(context) => {
                                use opentelemetry::context::FutureExt as _;
                                let kicked = self.tick(poller).with_context(context.clone()).await;
                                crate::telemetry::traced::finish(context, kicked.succeeded(), &kicked.line());
                                kicked
                            }
                            None => self.tick(poller).await,
                        };
                        lines.push(format!("watchdog kicked {name}: {}", kicked.line()));
                    }
                    Err(left) => {
                        let reason = format!(
                            "a tick may take its budget ({} s) plus {} s, and {} s are left before {}: a later run kicks it",
                            budget.as_secs(),
                            KICK_MARGIN.as_secs(),
                            left.as_secs(),
                            self.function_timeout.describe()
                        );
                        let line = format!("watchdog kick skipped function={name} message={reason:?}");
                        warn!("{line}");
                        lines.push(line);
                    }
                }
            }
        }
        Invocation::Watched { function: function.to_string(), lines, findings: report.findings.len() }
    }
}

/// Time a kicked tick may need beyond its budget (its last commit, the release): the margin a
/// tick budget must leave before functionTimeout.
const KICK_MARGIN: std::time::Duration =
    std::time::Duration::from_secs(crate::config::defaults::TIMEOUT_MARGIN_SECONDS);

/// Whether a tick with `budget` fits before `deadline` (the invocation's functionTimeout) with
/// the margin; `Err` says how long is left.
fn kick_fits(
    deadline: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    budget: std::time::Duration,
) -> Result<(), std::time::Duration> {
    let Some(deadline) = deadline else {
        return Ok(());
    };
    let left = (deadline - now).to_std().unwrap_or_default();
    if budget.saturating_add(KICK_MARGIN) <= left { Ok(()) } else { Err(left) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text).unwrap().with_timezone(&Utc)
    }

    /// Regression (issue 24, item 12): a kick starts only when its tick's budget and the margin
    /// fit before functionTimeout; unbounded, every kick fits.
    #[test]
    fn a_kick_starts_only_within_the_time_the_invocation_has_left() {
        let deadline = Some(at("2024-01-01T00:10:00Z"));
        let budget = std::time::Duration::from_secs(240);
        assert_eq!(kick_fits(deadline, at("2024-01-01T00:05:30Z"), budget), Ok(()));
        assert_eq!(kick_fits(deadline, at("2024-01-01T00:05:31Z"), budget), Err(std::time::Duration::from_secs(269)));
        assert_eq!(kick_fits(deadline, at("2024-01-01T00:11:00Z"), budget), Err(std::time::Duration::ZERO));
        assert_eq!(kick_fits(None, at("2024-01-01T00:11:00Z"), budget), Ok(()));
    }
}
