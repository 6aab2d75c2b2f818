//! The status function's page for a browser: pure, data in, HTML out. One row per poller (health
//! in a colour and a word, lag, oldest pending age, last success, attempts, quarantine, what holds
//! the horizon, slot retention, a small chart of the lag over the last hours), then the watchdog's
//! findings at its last run. Everything shown comes from the same [`PollerHealth`] the JSON
//! serializes (never more: the same redaction), every text is escaped, and the page loads nothing
//! (inline style, inline SVG, no script), readable on a phone (viewport, the table turns into
//! cards on a narrow screen).

use chrono::{DateTime, Utc};

use crate::domain::health::{Horizon, PollerHealth};
use crate::domain::lag_series::{FindingNote, KEPT_FOR, LagSeries};
use crate::domain::watchdog::Memory;

/// The Content-Security-Policy the page is served with: nothing loads, no script runs.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'unsafe-inline'; img-src data:";

/// What the page knows of the app's watchdog.
pub enum WatchdogView<'a> {
    /// The app has no watchdog function.
    None,
    /// Its memory could not be read (the reason is the store's, no secret in it).
    Unreadable(&'a str),
    /// It has not run yet.
    NotYet,
    Remembered(&'a Memory),
}

const STYLE: &str = "
:root{color-scheme:light dark;font-family:system-ui,-apple-system,'Segoe UI',sans-serif}
body{margin:0 auto;max-width:72rem;padding:1rem;line-height:1.4}
h1{font-size:1.3rem;margin:.2rem 0}
h2{font-size:1.1rem;margin:1.5rem 0 .5rem}
.summary{color:#666;margin:0 0 1rem}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:.35rem .4rem;border-bottom:1px solid #8884;vertical-align:top}
th{font-size:.72rem;text-transform:uppercase;color:#666}
.scroll{overflow-x:auto}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.health{display:inline-block;padding:.05rem .5rem;border-radius:.7rem;color:#fff;font-weight:600;font-size:.85rem}
.ok{background:#1a7f37}.unhealthy{background:#cf222e}.disabled{background:#6e7781}
.problems{color:#cf222e;font-size:.85rem;margin:.2rem 0 0;padding-left:1rem;max-width:24rem;overflow-wrap:anywhere}
svg.chart{display:inline-block;vertical-align:middle;width:8rem;height:2rem}
.chart polyline{fill:none;stroke:#0969da;stroke-width:1.5}.chart circle{fill:#0969da}
.chart .axis{stroke:#8886;stroke-width:1}
.muted{color:#888}
ul.findings{padding-left:1.2rem;overflow-wrap:anywhere}
@media (max-width:40rem){
 table,tbody,tr,td{display:block;width:auto}
 thead{display:none}
 tr{border:1px solid #8884;border-radius:.5rem;margin:0 0 .8rem;padding:.3rem}
 td{border:none;padding:.2rem .4rem}
 td.num{text-align:left}
 td::before{content:attr(data-label);display:inline-block;min-width:8.5rem;color:#666;font-size:.8rem}
}
";

/// The whole page at `now`.
pub fn render(healths: &[PollerHealth], watchdog: WatchdogView<'_>, now: DateTime<Utc>) -> String {
    let unhealthy = healths.iter().filter(|health| !health.healthy).count();
    let mut page = String::with_capacity(8 * 1024);
    page.push_str("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">");
    page.push_str("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">");
    page.push_str("<title>dbtrigger status</title><style>");
    page.push_str(STYLE);
    page.push_str("</style></head><body>\n<h1>dbtrigger status</h1>\n");
    page.push_str(&format!(
        "<p class=\"summary\" id=\"summary\">{} pollers, {} unhealthy · {}</p>\n",
        healths.len(),
        unhealthy,
        escape(&now.format("%Y-%m-%d %H:%M:%S UTC").to_string())
    ));
    page.push_str("<div class=\"scroll\"><table id=\"pollers\"><thead><tr>");
    for heading in COLUMNS {
        page.push_str(&format!("<th>{}</th>", escape(heading)));
    }
    page.push_str("</tr></thead><tbody>\n");
    let memory = match &watchdog {
        WatchdogView::Remembered(memory) => Some(*memory),
        _ => None,
    };
    for health in healths {
        let series = memory.and_then(|memory| memory.lag.get(&health.poller));
        page.push_str(&row(health, series, now));
    }
    page.push_str("</tbody></table></div>\n<h2>Watchdog</h2>\n");
    page.push_str(&findings(&watchdog));
    page.push_str("</body></html>\n");
    page
}

const COLUMNS: [&str; 10] = [
    "Poller",
    "Health",
    "Lag (rows)",
    "Oldest pending",
    "Last success",
    "Attempts",
    "Quarantined",
    "Horizon held by",
    "Slot retention",
    "Lag, last 6 h",
];

fn row(health: &PollerHealth, series: Option<&LagSeries>, now: DateTime<Utc>) -> String {
    let (class, word) = health_word(health);
    let name = if health.function == health.poller {
        escape(&health.poller)
    } else {
        format!("{} <span class=\"muted\">({})</span>", escape(&health.poller), escape(&health.function))
    };
    let mut problems = String::new();
    if !health.problems.is_empty() {
        problems.push_str("<ul class=\"problems\">");
        for problem in &health.problems {
            problems.push_str(&format!("<li>{}</li>", escape(problem)));
        }
        problems.push_str("</ul>");
    }
    let cells = [
        (COLUMNS[0], format!("{name}{problems}"), false),
        (COLUMNS[1], format!("<span class=\"health {class}\">{word}</span>"), false),
        (COLUMNS[2], escape(&super::lag_text(health)), true),
        (COLUMNS[3], health.oldest_pending_age_seconds.map(duration_text).unwrap_or_else(|| "-".into()), true),
        (COLUMNS[4], health.last_success_at.map(|at| ago(at, now)).unwrap_or_else(|| "never".into()), false),
        (COLUMNS[5], health.attempts.to_string(), true),
        (COLUMNS[6], health.quarantined.to_string(), true),
        (COLUMNS[7], horizon_text(health), false),
        (COLUMNS[8], slot_text(health), true),
        (COLUMNS[9], chart(series, now), false),
    ];
    let mut html = format!("<tr data-poller=\"{}\" data-health=\"{word}\">", escape(&health.poller));
    for (label, cell, numeric) in cells {
        let class = if numeric { " class=\"num\"" } else { "" };
        html.push_str(&format!("<td data-label=\"{}\"{class}>{cell}</td>", escape(label)));
    }
    html.push_str("</tr>\n");
    html
}

/// The health's colour class and its word (the word says it without the colour).
fn health_word(health: &PollerHealth) -> (&'static str, &'static str) {
    if health.disabled.is_some() {
        ("disabled", "disabled")
    } else if health.healthy {
        ("ok", "ok")
    } else {
        ("unhealthy", "unhealthy")
    }
}

fn horizon_text(health: &PollerHealth) -> String {
    let Some(holder) = &health.horizon_holder else {
        return "-".into();
    };
    let kind = match holder.holds {
        Horizon::CommitHorizon => "commit horizon",
        Horizon::SettleBound => "settle bound",
    };
    let session = holder.pid.map(|pid| format!(" pid {pid}")).unwrap_or_default();
    let state = holder.state.as_deref().map(|state| format!(", {state}")).unwrap_or_default();
    escape(&format!("{kind}: transaction{session} open {}{state}", duration_text(holder.age_seconds)))
}

fn slot_text(health: &PollerHealth) -> String {
    let Some(slot) = &health.slot else {
        return "-".into();
    };
    let bytes = slot.retained_bytes.map(bytes_text).unwrap_or_else(|| "?".into());
    let status = slot.wal_status.as_deref().map(|status| format!(" ({status})")).unwrap_or_default();
    escape(&format!("{bytes}{status}"))
}

/// The lag over the last [`KEPT_FOR`] as an inline SVG: a step line, scaled to its highest point.
fn chart(series: Option<&LagSeries>, now: DateTime<Utc>) -> String {
    const WIDTH: f64 = 160.0;
    const HEIGHT: f64 = 40.0;
    let points: Vec<(f64, u64)> = series
        .map(|series| {
            series
                .points
                .iter()
                .filter_map(|point| {
                    let rows = point.rows?;
                    let before = (now - point.at).num_seconds() as f64;
                    let span = KEPT_FOR.num_seconds() as f64;
                    (before <= span).then(|| ((1.0 - before.max(0.0) / span) * WIDTH, rows))
                })
                .collect()
        })
        .unwrap_or_default();
    if points.is_empty() {
        return "<span class=\"muted\">no samples yet</span>".into();
    }
    let highest = points.iter().map(|(_, rows)| *rows).max().unwrap_or(0).max(1);
    let y = |rows: u64| HEIGHT - 2.0 - (rows as f64 / highest as f64) * (HEIGHT - 4.0);
    let mut line = String::new();
    let mut previous: Option<f64> = None;
    for (x, rows) in &points {
        if let Some(previous_y) = previous {
            line.push_str(&format!("{x:.1},{previous_y:.1} "));
        }
        line.push_str(&format!("{x:.1},{:.1} ", y(*rows)));
        previous = Some(y(*rows));
    }
    if let Some(last_y) = previous {
        line.push_str(&format!("{WIDTH:.1},{last_y:.1}"));
    }
    let (newest_x, newest) = points.last().copied().unwrap_or((WIDTH, 0));
    format!(
        "<svg class=\"chart\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" role=\"img\" aria-label=\"lag over the last 6 hours: {} samples, highest {highest} rows, latest {newest}\">\
<line class=\"axis\" x1=\"0\" y1=\"{bottom}\" x2=\"{WIDTH}\" y2=\"{bottom}\"/><polyline points=\"{}\"/>\
<circle cx=\"{newest_x:.1}\" cy=\"{:.1}\" r=\"2.5\"/></svg>",
        points.len(),
        line.trim_end(),
        y(newest),
        bottom = HEIGHT - 2.0,
    )
}

fn findings(watchdog: &WatchdogView<'_>) -> String {
    match watchdog {
        WatchdogView::None => "<p class=\"muted\" id=\"findings\">This app has no watchdog function.</p>\n".into(),
        WatchdogView::Unreadable(reason) => format!(
            "<p class=\"unhealthy-text\" id=\"findings\">The watchdog's memory could not be read: {}</p>\n",
            escape(reason)
        ),
        WatchdogView::NotYet => "<p class=\"muted\" id=\"findings\">The watchdog has not run yet.</p>\n".into(),
        WatchdogView::Remembered(memory) if memory.findings.is_empty() => {
            "<p id=\"findings\">No findings at its last run.</p>\n".into()
        }
        WatchdogView::Remembered(memory) => {
            let mut html = String::from("<ul class=\"findings\" id=\"findings\">");
            for FindingNote { kind, function, poller, message } in &memory.findings {
                let whom = if function == poller {
                    escape(poller)
                } else {
                    format!("{} ({})", escape(poller), escape(function))
                };
                html.push_str(&format!("<li><strong>{}</strong> {whom}: {}</li>", escape(kind), escape(message)));
            }
            html.push_str("</ul>\n");
            html
        }
    }
}

/// `12s`, `3m 20s`, `2h 05m`, `3d 4h`.
fn duration_text(seconds: f64) -> String {
    let total = seconds.max(0.0).round() as u64;
    match total {
        0..60 => format!("{total}s"),
        60..3600 => format!("{}m {:02}s", total / 60, total % 60),
        3600..86400 => format!("{}h {:02}m", total / 3600, total % 3600 / 60),
        _ => format!("{}d {}h", total / 86400, total % 86400 / 3600),
    }
}

fn ago(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    format!("{} ago", duration_text((now - at).num_milliseconds() as f64 / 1000.0))
}

fn bytes_text(bytes: i64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes.max(0) as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.1} {}", units[unit]) }
}

/// Text made safe for HTML content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for character in text.chars() {
        match character {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::lag_series::LagPoint;

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap()
    }

    fn health(poller: &str) -> PollerHealth {
        let mut health = PollerHealth::unusable(poller, "x".into());
        health.healthy = true;
        health.problems.clear();
        health.error = None;
        health
    }

    /// Whatever a poller's name, problem or finding holds, it is text on the page, never markup.
    #[test]
    fn every_text_is_escaped() {
        let mut hostile = health("<script>alert(1)</script>");
        hostile.healthy = false;
        hostile.problems.push("a \"quoted\" <b>problem</b> & more".into());
        let memory = Memory {
            findings: vec![FindingNote {
                kind: "stalled".into(),
                function: "f<i>".into(),
                poller: "p'".into(),
                message: "<img src=x onerror=alert(1)>".into(),
            }],
            ..Memory::default()
        };
        let page = render(&[hostile], WatchdogView::Remembered(&memory), now());
        assert!(!page.contains("<script>") && !page.contains("<img") && !page.contains("<b>"), "{page}");
        assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        assert!(page.contains("&lt;img src=x onerror=alert(1)&gt;"));
        assert!(page.contains("p&#39; (f&lt;i&gt;)"));
        assert_eq!(page.matches("<script").count(), 0, "no script at all");
    }

    #[test]
    fn a_row_says_its_health_in_a_word_and_a_colour_and_draws_its_lag() {
        let mut lagging = health("orders");
        lagging.lag_rows = Some(1234);
        lagging.attempts = 2;
        let mut memory = Memory::default();
        let mut series = LagSeries::default();
        for (minutes_ago, rows) in [(120, 0), (60, 50), (10, 1234)] {
            series.points.push(LagPoint {
                at: now() - chrono::Duration::minutes(minutes_ago),
                rows: Some(rows),
                age_seconds: None,
            });
        }
        memory.lag.insert("orders".into(), series);
        let mut stopped = health("shipments");
        stopped.healthy = false;
        let page = render(&[lagging, stopped], WatchdogView::Remembered(&memory), now());
        assert!(page.contains("<tr data-poller=\"orders\" data-health=\"ok\">"), "{page}");
        assert!(page.contains("<span class=\"health ok\">ok</span>"));
        assert!(page.contains("<span class=\"health unhealthy\">unhealthy</span>"));
        assert!(page.contains(">1,234<"));
        assert!(page.contains("aria-label=\"lag over the last 6 hours: 3 samples, highest 1234 rows, latest 1234\""));
        assert!(page.contains("No findings at its last run."));
        assert!(page.contains("name=\"viewport\""));
    }

    #[test]
    fn durations_and_sizes_read_as_a_person_says_them() {
        assert_eq!(duration_text(12.4), "12s");
        assert_eq!(duration_text(200.0), "3m 20s");
        assert_eq!(duration_text(7500.0), "2h 05m");
        assert_eq!(duration_text(-3.0), "0s");
        assert_eq!(bytes_text(512), "512 B");
        assert_eq!(bytes_text(3 * 1024 * 1024 + 1024 * 100), "3.1 MiB");
    }
}
