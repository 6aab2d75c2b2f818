//! The status the app reads of its pollers, and the status function's answer.

use serde_json::Value;

use super::{App, Function, Invocation};
use crate::config::StatusConfig;
use crate::domain::health::PollerHealth;
use crate::domain::horizon::Audience;
use crate::protocol::InvocationRequest;
use crate::tick::Poller;

impl App {
    /// The status of every poller of the app (and of every function that cannot run), or of the
    /// one named by its poller or function name; `None` when there is no such poller.
    /// `audience` says what it may show of other sessions (an operator's `dbtrigger status`, or
    /// the status function).
    pub async fn status(&self, only: Option<&str>, audience: Audience) -> Option<Vec<PollerHealth>> {
        self.status_read(only, audience, false).await
    }

    /// Every poller's status for telemetry's gauges: as [`App::status`] (published), without
    /// counting a change stream's lag ([`crate::status::of_poller_sampled`]).
    pub async fn sampled_status(&self) -> Option<Vec<PollerHealth>> {
        self.status_read(None, Audience::Published, true).await
    }

    async fn status_read(&self, only: Option<&str>, audience: Audience, sampled: bool) -> Option<Vec<PollerHealth>> {
        let now = self.clock.now();
        let wanted = |name: &str, poller: Option<&Poller>| match only {
            None => true,
            Some(only) => {
                name.eq_ignore_ascii_case(only) || poller.is_some_and(|poller| poller.config.poller_name == only)
            }
        };
        let mut reports = Vec::new();
        let mut healths = Vec::new();
        for (name, function) in &self.functions {
            let poller = match function {
                Function::Poller(poller) => Some(poller.as_ref()),
                _ => None,
            };
            if !matches!(function, Function::Poller(_) | Function::Unusable(_)) || !wanted(name, poller) {
                continue;
            }
            // A disabled function is healthy whatever its state: nothing more is read.
            if let Some(reason) = self.disabled.get(name) {
                let poller_name = poller.map(|poller| poller.config.poller_name.as_str()).unwrap_or(name);
                healths.push(PollerHealth::disabled(name, poller_name, reason.clone()));
                continue;
            }
            match function {
                Function::Poller(poller) => reports.push(async move {
                    if sampled {
                        crate::status::of_poller_sampled(name, poller, now).await
                    } else {
                        crate::status::of_poller_cached(name, poller, now, audience).await
                    }
                }),
                Function::Unusable(reason) => healths.push(PollerHealth::unusable(name, reason.to_string())),
                _ => {}
            }
        }
        healths.extend(futures::future::join_all(reports).await);
        healths.sort_by(|left, right| left.function.cmp(&right.function));
        if only.is_some() && healths.is_empty() { None } else { Some(healths) }
    }

    /// The status page of `healths`, with what the app's watchdog remembers (its findings, the
    /// lag series), read from its memory document.
    async fn status_page(&self, healths: &[PollerHealth]) -> String {
        use crate::status::page::{WatchdogView, render};
        let now = self.clock.now();
        let watchdog = self.functions.iter().find_map(|(_, function)| match function {
            Function::Watchdog(watchdog) => Some(watchdog.clone()),
            _ => None,
        });
        let Some(watchdog) = watchdog else {
            return render(healths, WatchdogView::None, now);
        };
        match watchdog.memory().await {
            Ok(Some(memory)) => render(healths, WatchdogView::Remembered(&memory), now),
            Ok(None) => render(healths, WatchdogView::NotYet, now),
            Err(reason) => render(healths, WatchdogView::Unreadable(&reason), now),
        }
    }

    /// The status function's answer to `request`: every poller's health (or the one `?poller=`
    /// names), as JSON or as the page.
    pub(super) async fn answer_status(
        &self,
        function: &str,
        config: &StatusConfig,
        request: &InvocationRequest,
    ) -> Invocation {
        let query = request.http_query(&config.request_binding);
        let only = query.get("poller").map(String::as_str);
        let accept = request.http_header(&config.request_binding, "Accept").unwrap_or_default();
        let wants_page = match query.get("format").map(String::as_str) {
            Some(format) => format.eq_ignore_ascii_case("html"),
            None => accept.to_ascii_lowercase().contains("text/html"),
        };
        let response_binding = config.response_binding.clone();
        let function = function.to_string();
        match self.status(only, Audience::Published).await {
            None => Invocation::Answered {
                function,
                response_binding,
                status_code: 404,
                body: serde_json::json!({"error": format!("no poller {:?} in this app", only.unwrap_or_default())}),
                summary: format!("no poller {:?}", only.unwrap_or_default()),
                page: None,
            },
            Some(healths) => {
                let unhealthy = healths.iter().filter(|health| !health.healthy).count();
                let page = match wants_page {
                    true => Some(self.status_page(&healths).await),
                    false => None,
                };
                Invocation::Answered {
                    function,
                    response_binding,
                    status_code: if unhealthy == 0 { 200 } else { 503 },
                    summary: format!("status of {} pollers, {unhealthy} unhealthy", healths.len()),
                    body: serde_json::to_value(&healths).unwrap_or(Value::Null),
                    page,
                }
            }
        }
    }
}
