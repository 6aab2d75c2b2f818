//! The watchdog function's run: reads every poller's status (the same as `dbtrigger status`), lists
//! the app's state documents, judges each poller against what it saw at its previous run
//! ([`crate::domain::watchdog`]), remembers what it saw (`watchdog/{app}/{function}.json` beside the
//! state), and reports: error-level lines on stderr, which the host logs at Error (for
//! Application Insights alert rules), the summary and findings in the invocation's `Logs`, and the
//! findings posted to an alert webhook if one is configured, signed like the sink. Disabled
//! functions are not judged. Which pollers to kick it leaves to the app.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde_json::json;
use tracing::{error, info, warn};

use crate::config::WatchdogConfig;
use crate::domain::health::PollerHealth;
use crate::domain::lag_series::{FindingNote, LagPoint};
use crate::domain::schedule::ScheduleZone;
use crate::domain::watchdog::{Finding, FindingKind, Memory, judge, judge_horizon, judge_slot};
use crate::sink::signing::sign;
use crate::store::{BlobStore, PutMode, StoreError};
use crate::tick::Poller;

/// A watchdog function, opened once.
pub struct Watchdog {
    pub config: WatchdogConfig,
    blobs: Arc<dyn BlobStore>,
    client: reqwest::Client,
}

/// What one run found.
#[derive(Debug, Default)]
pub struct Report {
    pub checked: usize,
    /// Functions the host does not run, left alone.
    pub disabled: usize,
    pub findings: Vec<Finding>,
    /// Lines about the run itself (orphan documents, a memory or alert that failed).
    pub notes: Vec<String>,
    /// Function names a tick may fix (with `kick`).
    pub to_kick: Vec<String>,
}

impl Report {
    /// The lines for the host's `Logs`: a summary, then one line per finding, then the notes.
    pub fn lines(&self) -> Vec<String> {
        let disabled = if self.disabled > 0 { format!(" disabled={}", self.disabled) } else { String::new() };
        let mut lines = vec![format!(
            "watchdog checked={} findings={}{disabled}{}",
            self.checked,
            self.findings.len(),
            if self.findings.is_empty() { " all well" } else { "" }
        )];
        lines.extend(self.findings.iter().map(finding_line));
        lines.extend(self.notes.iter().cloned());
        lines
    }
}

/// `watchdog finding=stalled function=orders poller=orders message="…"`.
pub fn finding_line(finding: &Finding) -> String {
    format!(
        "watchdog finding={} function={} poller={} message={:?}",
        finding.kind.name(),
        finding.function,
        finding.poller,
        finding.message
    )
}

impl Watchdog {
    pub fn open(config: WatchdogConfig) -> Result<Watchdog, StoreError> {
        let (_, blobs) = crate::store::open(&config.state)?;
        let timeout = config.alert.as_ref().map(|alert| alert.timeout).unwrap_or(std::time::Duration::from_secs(10));
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("dbtrigger/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|error| StoreError::Unavailable {
                location: "alert webhook".into(),
                reason: error.to_string(),
                retryable: false,
            })?;
        Ok(Watchdog { config, blobs, client })
    }

    /// What the watchdog remembers (its findings and the lag series), for the status page;
    /// `None` before its first run.
    pub async fn memory(&self) -> Result<Option<Memory>, String> {
        let found = self.blobs.get(&self.memory_path()).await.map_err(|error| error.to_string())?;
        match found {
            None => Ok(None),
            Some(blob) => serde_json::from_slice(&blob.bytes).map(Some).map_err(|error| error.to_string()),
        }
    }

    fn memory_path(&self) -> String {
        format!("watchdog/{}/{}.json", self.config.app_name, self.config.function_name)
    }

    /// Checks `pollers` (function name, poller) and the functions that cannot run (`unusable`:
    /// function name, reason) at `now`, schedules read in `zone`. `disabled` names the pollers
    /// the host does not run: not judged, and their state documents are not orphans.
    pub async fn run(
        &self,
        pollers: &[(String, Arc<Poller>)],
        unusable: &[(String, String)],
        disabled: &[String],
        now: DateTime<Utc>,
        zone: &ScheduleZone,
    ) -> Report {
        let mut report = Report { disabled: disabled.len(), ..Report::default() };
        let memory_path = self.memory_path();
        let remembered = match self.blobs.get(&memory_path).await {
            Ok(found) => found.map(|blob| blob.bytes),
            Err(error) => {
                report.notes.push(format!("watchdog note: cannot read its memory: {error}"));
                None
            }
        };
        let mut memory = match remembered.as_deref().map(serde_json::from_slice::<Memory>) {
            Some(Ok(memory)) => memory,
            Some(Err(error)) => {
                report.notes.push(format!(
                    "watchdog note: its memory at {memory_path} is unreadable ({error}): starting afresh"
                ));
                Memory::default()
            }
            None => Memory::default(),
        };
        for (function, reason) in unusable {
            report.findings.push(Finding {
                kind: FindingKind::ConfigError,
                function: function.clone(),
                poller: function.clone(),
                message: reason.clone(),
            });
        }
        let healths: Vec<PollerHealth> = futures::future::join_all(
            pollers.iter().map(|(function, poller)| crate::status::of_poller(function, poller, now)),
        )
        .await;
        report.checked = pollers.len() + unusable.len();
        for ((function, poller), health) in pollers.iter().zip(&healths) {
            let interval = poller.config.schedule.as_ref().and_then(|schedule| {
                let first = schedule.next_after_in(now, zone)?;
                let second = schedule.next_after_in(first, zone)?;
                Some(second - first)
            });
            let seen = memory.pollers.get(&health.poller);
            let (mut findings, mut remembered) =
                judge(health, interval, self.config.stalled_after_intervals, seen, now);
            let held_seen = seen.and_then(|seen| seen.horizon.as_ref());
            let (held, holder_seen) = judge_horizon(health, self.config.horizon_held_after, held_seen, now);
            remembered.horizon = holder_seen;
            findings.extend(held);
            findings.extend(judge_slot(health, self.config.slot_retention_bytes));
            if findings.iter().any(|finding| finding.kind.kickable()) {
                report.to_kick.push(function.clone());
            }
            report.findings.extend(findings);
            memory.pollers.insert(health.poller.clone(), remembered);
            memory.lag.entry(health.poller.clone()).or_default().record(LagPoint {
                at: now,
                rows: health.lag_rows,
                age_seconds: health.oldest_pending_age_seconds,
            });
        }
        memory.lag.retain(|poller, _| pollers.iter().any(|(_, kept)| &kept.config.poller_name == poller));
        memory.findings = report
            .findings
            .iter()
            .map(|finding| FindingNote {
                kind: finding.kind.name().to_string(),
                function: finding.function.clone(),
                poller: finding.poller.clone(),
                message: finding.message.clone(),
            })
            .collect();
        // A disabled poller starts afresh when it is enabled again, not judged against what it
        // was before it stopped.
        for poller in disabled {
            memory.pollers.remove(poller);
        }
        // State documents of the app that no function polls (a removed function, a clone waiting
        // for its function): worth knowing, not an alert.
        match crate::store::state::list(self.blobs.as_ref(), &self.config.app_name).await {
            Ok(keys) => {
                for key in keys {
                    let polled = pollers.iter().any(|(_, poller)| poller.config.poller_name == key.poller);
                    if !polled && !disabled.contains(&key.poller) {
                        report.notes.push(format!(
                            "watchdog note: state document {} has no function in this app (removed, or a clone waiting for its function)",
                            key.blob_path()
                        ));
                    }
                }
            }
            Err(error) => report.notes.push(format!("watchdog note: cannot list the state documents: {error}")),
        }
        // Written only when it changed: a quiet app costs one GET per run, no PUT (a lag point
        // of an unchanged lag is added every half hour only: `lag_series`).
        let bytes = serde_json::to_vec_pretty(&memory).expect("the memory serializes");
        if remembered.as_deref() != Some(bytes.as_slice())
            && let Err(error) = self.blobs.put(&memory_path, bytes, PutMode::Overwrite).await
        {
            report.notes.push(format!("watchdog note: cannot keep its memory: {error}"));
        }
        for finding in &report.findings {
            error!(function = %finding.function, poller = %finding.poller, "{}", finding_line(finding));
        }
        for note in &report.notes {
            warn!("{note}");
        }
        if !report.findings.is_empty()
            && let Some(problem) = self.alert(&report.findings, now).await
        {
            error!("{problem}");
            report.notes.push(problem);
        }
        info!(checked = report.checked, findings = report.findings.len(), "watchdog run done");
        report
    }

    /// Posts the findings to the alert webhook, if one is configured; `Some` says why it failed.
    async fn alert(&self, findings: &[Finding], now: DateTime<Utc>) -> Option<String> {
        let alert = self.config.alert.as_ref()?;
        let id = format!("wdg_{}", uuid::Uuid::new_v4().simple());
        let body = serde_json::to_vec(&json!({
            "app": self.config.app_name,
            "watchdog": self.config.function_name,
            "at": now.to_rfc3339(),
            "findings": findings,
        }))
        .expect("findings serialize");
        let timestamp = Utc::now().timestamp();
        let mut request = self
            .client
            .post(alert.url.expose().clone())
            .header("content-type", "application/json")
            .header("webhook-id", &id)
            .header("webhook-timestamp", timestamp.to_string());
        if let Some(key) = &alert.signing_key {
            request = request.header("webhook-signature", sign(key, &id, timestamp, &body));
        }
        let host = alert.url.expose().host_str().unwrap_or("?").to_string();
        match request.body(body).send().await {
            Ok(response) if response.status().is_success() => None,
            Ok(response) => Some(format!("watchdog note: the alert webhook at {host} answered {}", response.status())),
            Err(error) => Some(format!(
                "watchdog note: the alert webhook at {host} could not be reached: {}",
                error.without_url()
            )),
        }
    }
}
