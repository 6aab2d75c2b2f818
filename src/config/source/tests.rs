//! `cursorKind`, `settle` and `settleSeconds` as the parser reads them (issue 26).

use super::*;
use crate::config::PollerConfig;
use serde_json::json;

/// Loads a poller whose `source` is `source` (connection `DB` set to `url`).
fn load(url: &str, source: serde_json::Value) -> Result<SourceConfig, ConfigError> {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("orders")).unwrap();
    let mut full = json!({"connection": "DB", "table": "orders", "cursor": "c", "pk": ["id"]});
    for (key, value) in source.as_object().unwrap() {
        full[key] = value.clone();
    }
    let document = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */1 * * * *"}],
        "poller": {"source": full, "sink": {"type": "webhook", "url": "http://127.0.0.1:9/hook"},
                   "state": {"connection": "STATE"}}
    });
    std::fs::write(root.path().join("orders/function.json"), serde_json::to_vec(&document).unwrap()).unwrap();
    let settings = Settings::from_pairs([("DB", url), ("STATE", "file:state")]);
    PollerConfig::load(root.path(), "orders", &settings, None).map(|config| config.source)
}

const POSTGRES: &str = "postgres://u@db/shop";
const MYSQL: &str = "mysql://u@db/shop";
const SQLITE: &str = "sqlite://shop.db";

fn refusal(url: &str, source: serde_json::Value) -> (String, String) {
    let error = load(url, source).unwrap_err();
    (error.field.clone(), error.reason.clone())
}

/// Issue 26, items 1 and 4: `cursorKind` and `settle` are parsed with their defaults, and
/// `settleSeconds` is the margin (1 s by default) under `settle: "auto"`.
#[test]
fn cursor_kind_and_settle_auto_are_read_with_their_defaults() {
    let plain = load(POSTGRES, json!({})).unwrap();
    assert_eq!((plain.cursor_kind, plain.settle_mode, plain.settle.as_secs()), (None, SettleMode::Fixed, 2));
    let xid = load(POSTGRES, json!({"cursorKind": "xid"})).unwrap();
    assert_eq!(xid.cursor_kind, Some(CursorKind::Xid));
    let auto = load(MYSQL, json!({"settle": "auto"})).unwrap();
    assert_eq!((auto.settle_mode, auto.settle.as_secs()), (SettleMode::Auto, AUTO_SETTLE_SECONDS));
    let margin = load(POSTGRES, json!({"settle": "auto", "settleSeconds": 3, "cursorKind": "timestamp"})).unwrap();
    assert_eq!((margin.settle.as_secs(), margin.cursor_kind), (3, Some(CursorKind::Timestamp)));
}

/// Issue 26, items 1 and 4: what an engine or a cursor cannot honour is refused at load,
/// naming the field.
#[test]
fn what_a_cursor_or_an_engine_cannot_honour_is_refused_with_its_field() {
    let cases = [
        (MYSQL, json!({"cursorKind": "xid"}), "poller.source.cursorKind", "is a PostgreSQL cursor"),
        (SQLITE, json!({"cursorKind": "xid"}), "poller.source.cursorKind", "this source is sqlite"),
        (POSTGRES, json!({"cursorKind": "xid", "settleSeconds": 2}), "poller.source.settleSeconds", "exact"),
        (POSTGRES, json!({"cursorKind": "xid", "settle": "auto"}), "poller.source.settle", "exact"),
        (
            POSTGRES,
            json!({"cursorKind": "txid"}),
            "poller.source.cursorKind",
            "expected \"integer\", \"timestamp\" or \"xid\"",
        ),
        (SQLITE, json!({"settle": "auto"}), "poller.source.settle", "SQLite does not give"),
        (
            POSTGRES,
            json!({"settle": "auto", "cursorKind": "integer"}),
            "poller.source.settle",
            "an integer cursor has none",
        ),
        (MYSQL, json!({"settle": "auto", "settleSeconds": 0}), "poller.source.settleSeconds", "at least 1"),
        (POSTGRES, json!({"settle": "fixed"}), "poller.source.settle", "expected \"auto\""),
    ];
    for (url, source, field, reason) in cases {
        let (got_field, got_reason) = refusal(url, source.clone());
        assert_eq!(got_field, field, "{source}: {got_reason}");
        assert!(got_reason.contains(reason), "{source}: {got_reason}");
    }
}

/// An xid cursor cannot see a late commit, so the late-arrival detector is off for it (its
/// buckets are not defined on xid8), and asking for it in so many words is refused.
#[test]
fn an_xid_cursor_needs_no_late_arrival_detector() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("orders")).unwrap();
    let write = |late: serde_json::Value| {
        let mut source =
            json!({"connection": "DB", "table": "orders", "cursor": "txid", "pk": ["id"], "cursorKind": "xid"});
        if !late.is_null() {
            source["lateArrivals"] = late;
        }
        let document = json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */1 * * * *"}],
            "poller": {"source": source, "sink": {"type": "webhook", "url": "http://127.0.0.1:9/hook"},
                       "state": {"connection": "STATE"}}
        });
        std::fs::write(root.path().join("orders/function.json"), serde_json::to_vec(&document).unwrap()).unwrap();
    };
    let settings = Settings::from_pairs([("DB", POSTGRES), ("STATE", "file:state")]);
    write(serde_json::Value::Null);
    let config = PollerConfig::load(root.path(), "orders", &settings, None).unwrap();
    assert!(!config.late_arrivals.enabled);
    write(json!({"enabled": true}));
    let error = PollerConfig::load(root.path(), "orders", &settings, None).unwrap_err();
    assert_eq!(error.field, "poller.source.lateArrivals");
    assert!(error.reason.contains("no row can arrive late"), "{}", error.reason);
}
