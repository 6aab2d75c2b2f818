//! `dbtrigger status [--json] [--poller NAME]`: every poller of the app, its checkpoint, lag,
//! lease, last success, attempts, quarantine and fingerprint, and every function that cannot run.
//! The exit code is 1 when any is unhealthy, so that it can gate a deployment.

use std::path::Path;
use std::process::ExitCode;

use anyhow::bail;

use crate::app::App;
use crate::domain::health::{FingerprintState, PollerHealth};
use crate::domain::horizon::{Audience, Horizon};
use crate::status::lag_text;

pub async fn run(app_root: &Path, json: bool, only: Option<&str>) -> anyhow::Result<ExitCode> {
    let settings = crate::config::Settings::for_app_root(app_root)?;
    let app = App::load(app_root, &settings)?;
    // Run by an operator: the holder of a horizon is shown with the start of its query.
    let Some(healths) = app.status(only, Audience::Operator).await else {
        bail!(
            "no poller {:?} in {} (functions: {})",
            only.unwrap_or_default(),
            app_root.display(),
            app.function_names().join(", ")
        );
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&healths)?);
    } else {
        print!("{}", table(&healths, chrono::Utc::now()));
    }
    let healthy = healths.iter().all(|health| health.healthy);
    Ok(if healthy { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// An aligned table, then one line per problem.
pub fn table(healths: &[PollerHealth], now: chrono::DateTime<chrono::Utc>) -> String {
    let header = [
        "POLLER",
        "HEALTH",
        "LAG",
        "OLDEST",
        "CHECKPOINT",
        "LEASE",
        "LAST SUCCESS",
        "ATTEMPTS",
        "QUARANTINED",
        "FINGERPRINT",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|title| title.to_string()).collect()];
    for health in healths {
        let checkpoint = match &health.checkpoint {
            Some(checkpoint) => {
                let keys: Vec<String> =
                    checkpoint.pk.iter().map(|(column, value)| format!("{column}={value}")).collect();
                format!("{} ({})", checkpoint.cursor, keys.join(", "))
            }
            None => "-".to_string(),
        };
        let lease = match &health.lease {
            Some(lease) if lease.live => format!("held by {}", lease.owner.as_deref().unwrap_or("?")),
            Some(_) | None => "free".to_string(),
        };
        let last = match health.last_success_at {
            Some(at) => format!("{} ago", age((now - at).num_seconds())),
            None => "never".to_string(),
        };
        let fingerprint = match health.fingerprint {
            Some(FingerprintState::Ok) => "ok",
            Some(FingerprintState::Changed) => "CHANGED",
            Some(FingerprintState::New) => "new",
            None => "-",
        };
        rows.push(vec![
            if health.poller == health.function {
                health.poller.clone()
            } else {
                format!("{} ({})", health.poller, health.function)
            },
            if health.disabled.is_some() {
                "disabled".to_string()
            } else if health.healthy {
                "ok".to_string()
            } else {
                "UNHEALTHY".to_string()
            },
            lag_text(health),
            health.oldest_pending_age_seconds.map(|seconds| age(seconds as i64)).unwrap_or_else(|| "-".to_string()),
            checkpoint,
            lease,
            last,
            health.attempts.to_string(),
            health.quarantined.to_string(),
            fingerprint.to_string(),
        ]);
    }
    let widths: Vec<usize> =
        (0..header.len()).map(|column| rows.iter().map(|row| row[column].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell}{}", " ".repeat(width - cell.chars().count())))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    for health in healths {
        for problem in &health.problems {
            out.push_str(&format!("{}: {problem}\n", health.function));
        }
        if let Some(reason) = &health.disabled {
            out.push_str(&format!("{}: disabled: {reason}\n", health.function));
        }
        if health.late_arrivals > 0 {
            out.push_str(&format!(
                "{}: {} rows arrived late (committed behind the checkpoint; found and delivered with late: true), the latest {} s after its cursor time{}\n",
                health.function,
                health.late_arrivals,
                health.max_lateness_seconds.unwrap_or_default(),
                health.last_late_arrival_at.map(|at| format!(", last found {} ago", age((now - at).num_seconds()))).unwrap_or_default()
            ));
        }
        if let Some(holder) = &health.horizon_holder {
            let what = match holder.holds {
                Horizon::CommitHorizon => "the commit horizon (cluster-wide)",
                Horizon::SettleBound => "the settle bound",
            };
            out.push_str(&format!("{}: rows wait behind {what}, held by {}\n", health.function, holder.describe()));
        }
        if let Some(slot) = &health.slot {
            out.push_str(&format!(
                "{}: replication slot {}: {} of WAL retained, wal_status {}, {}\n",
                health.function,
                slot.slot,
                slot.retained_bytes.map(|bytes| format!("{} KiB", bytes / 1024)).unwrap_or_else(|| "none".into()),
                slot.wal_status.as_deref().unwrap_or("unknown"),
                slot.active_pid.map(|pid| format!("read by pid {pid}")).unwrap_or_else(|| "idle".into())
            ));
        }
    }
    out
}

/// `42s`, `5m`, `3h`, `2d`.
fn age(seconds: i64) -> String {
    let seconds = seconds.max(0);
    match seconds {
        0..=119 => format!("{seconds}s"),
        120..=7_199 => format!("{}m", seconds / 60),
        7_200..=172_799 => format!("{}h", seconds / 3_600),
        _ => format!("{}d", seconds / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 26, section 3: `status` says how many rows arrived late, and how late.
    #[test]
    fn the_table_says_how_many_rows_arrived_late() {
        let now = chrono::DateTime::from_timestamp(1_780_000_000, 0).unwrap();
        let mut health = PollerHealth::disabled("orders", "orders", "x".into());
        health.disabled = None;
        health.late_arrivals = 2;
        health.max_lateness_seconds = Some(7);
        health.last_late_arrival_at = Some(now - chrono::Duration::seconds(30));
        let table = table(&[health], now);
        assert!(
            table.contains("orders: 2 rows arrived late (committed behind the checkpoint; found and delivered with late: true), the latest 7 s after its cursor time, last found 30s ago"),
            "{table}"
        );
    }
}
