//! Property: whatever a function.json's `poller` or `watchdog` section and host.json hold, loading
//! the app gives a configuration or a [`ConfigError`], never a panic, and no error quotes a
//! setting's secret. Regression (issue 24, item 13): a multi-byte `cursorTimeZone` panicked by
//! byte slicing, and host.json's `functionTimeout` overflowed; this searches for the next one.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

const PASSWORD: &str = "Pw-9f8e7d6c";
const KEY_BASE64: &str = "cHJvcHRlc3Qtc2lnbmluZy1rZXktMzItYnl0ZXMtbG9uZw==";
const ACCOUNT_KEY: &str = "cHJvcHRlc3QtYWNjb3VudC1rZXk=";

fn settings() -> Settings {
    Settings::from_pairs([
        ("ORDERS_DB", format!("postgres://app:{PASSWORD}@db.example.com:5432/orders?sslmode=require")),
        ("LITE_DB", "sqlite://orders.db".to_string()),
        ("MY_DB", format!("mysql://app:{PASSWORD}@127.0.0.1/orders")),
        ("ORDERS_URL", "https://hooks.example.com/hook".to_string()),
        ("ORDERS_SECRET", format!("whsec_{KEY_BASE64}")),
        ("ORDERS_STATE", "file:state".to_string()),
        ("AzureWebJobsStorage", format!("AccountName=shop;AccountKey={ACCOUNT_KEY}")),
    ])
}

/// Pieces text is made of: names and references of the settings above, the characters that
/// matter to the parsers (quotes, parentheses, `%`, `$`, `:`, `.`), multi-byte characters, numbers.
fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("%ORDERS_DB%".to_string()),
        Just("%ORDERS_SECRET%".to_string()),
        Just("%ORDERS_URL%".to_string()),
        Just("%MISSING%".to_string()),
        Just("ORDERS_DB".to_string()),
        Just("LITE_DB".to_string()),
        Just("MY_DB".to_string()),
        Just("ORDERS_STATE".to_string()),
        Just("AzureWebJobsStorage".to_string()),
        Just("UTC".to_string()),
        Just("+02:00".to_string()),
        Just("webhook".to_string()),
        Just("queue".to_string()),
        Just("SELECT 1".to_string()),
        Just("orders".to_string()),
        "[a-z_.:+$%'\"`()\\\\ ;#/*-]{1,4}",
        "[é€😀\u{2028}\u{0}\n]{1,2}",
        // Shaped like an offset (`+02:00`) or a time span, with a multi-byte character anywhere.
        "[+-][0-9é]{1,2}[:é0-9][0-9é]{1,2}",
        "[0-9é]{1,3}:[0-9é]{1,3}:[0-9é.]{1,3}",
        "[0-9]{1,22}",
        any::<String>(),
    ];
    prop::collection::vec(piece, 0..4).prop_map(|pieces| pieces.concat())
}

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (0u64..100_000).prop_map(Value::from),
        any::<f64>().prop_filter("JSON numbers are finite", |number| number.is_finite()).prop_map(Value::from),
        text().prop_map(Value::from),
        text().prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map(text(), inner, 0..4).prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

const POLLER_FIELDS: [&str; 44] = [
    "name",
    "source",
    "source.connection",
    "source.table",
    "source.query",
    "source.cursor",
    "source.pk",
    "source.columns",
    "source.where",
    "source.settleSeconds",
    "source.cursorTimeZone",
    "source.queryTimeoutSeconds",
    "source.softDelete",
    "source.opColumn",
    "source.generation",
    "source.generation.query",
    "source.generation.onChange",
    "batch",
    "batch.size",
    "batch.maxBytes",
    "batch.maxInFlight",
    "batch.tickBudgetSeconds",
    "batch.commitIntervalMs",
    "sink",
    "sink.type",
    "sink.url",
    "sink.secret",
    "sink.timeoutSeconds",
    "sink.maxRetries",
    "sink.maxBodyBytes",
    "sink.connection",
    "sink.queueName",
    "sink.messageEncoding",
    "sink.messagePer",
    "lease",
    "lease.ttlSeconds",
    "lease.heartbeatSeconds",
    "lease.clockSkewSeconds",
    "poison.maxAttempts",
    "poison.mode",
    "state",
    "state.connection",
    "state.container",
    "unknownField",
];

const WATCHDOG_FIELDS: [&str; 9] = [
    "stalledAfterIntervals",
    "kick",
    "alert",
    "alert.url",
    "alert.secret",
    "alert.timeoutSeconds",
    "state",
    "state.connection",
    "state.container",
];

/// Sets `path` (dotted) in `document` to `value`, making objects of whatever is in the way.
fn set(document: &mut Value, path: &str, value: Value) {
    let mut at = document;
    let parts: Vec<&str> = path.split('.').collect();
    for part in &parts[..parts.len() - 1] {
        if !at.is_object() {
            *at = json!({});
        }
        at = at.as_object_mut().expect("an object").entry(part.to_string()).or_insert_with(|| json!({}));
    }
    if !at.is_object() {
        *at = json!({});
    }
    at.as_object_mut().expect("an object").insert(parts[parts.len() - 1].to_string(), value);
}

fn base_poller(database: &str) -> Value {
    json!({
        "source": {"connection": database, "table": "orders", "cursor": "updated_at", "pk": ["id"]},
        "sink": {"type": "webhook", "url": "%ORDERS_URL%", "secret": "ORDERS_SECRET"},
        "state": {"connection": "ORDERS_STATE"}
    })
}

fn host_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        value(),
        text().prop_map(|timeout| json!({"version": "2.0", "functionTimeout": timeout})),
        ("[0-9]{1,20}", "[0-9]{1,20}", "[0-9]{1,20}", "[0-9.]{1,20}").prop_map(|(days, hours, minutes, seconds)| {
            json!({"version": "2.0", "functionTimeout": format!("{days}.{hours}:{minutes}:{seconds}")})
        }),
        ("[0-9]{1,20}", "[0-9]{1,3}").prop_map(|(hours, minutes)| {
            json!({"version": "2.0", "functionTimeout": format!("{hours}:{minutes}:00")})
        }),
    ]
}

fn load_app(poller: &Value, watchdog: &Value, host: &Value) -> Result<AppConfig, ConfigError> {
    let root = tempfile::tempdir().unwrap();
    let timer = json!([{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}]);
    for (folder, section, body) in [("orders", "poller", poller), ("watch", "watchdog", watchdog)] {
        std::fs::create_dir(root.path().join(folder)).unwrap();
        let document = json!({"bindings": timer, section: body});
        std::fs::write(root.path().join(folder).join("function.json"), document.to_string()).unwrap();
    }
    std::fs::write(root.path().join("host.json"), host.to_string()).unwrap();
    AppConfig::load(root.path(), &settings())
}

fn assert_no_secret(error: &ConfigError) {
    let shown = error.to_string();
    for secret in [PASSWORD, KEY_BASE64, ACCOUNT_KEY] {
        assert!(!shown.contains(secret), "an error shows a secret: {shown}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any values in a poller section, a watchdog section and host.json: a configuration or a
    /// ConfigError, never a panic, and never an error that shows a secret.
    #[test]
    fn any_configuration_gives_a_config_or_an_error_never_a_panic(
        database in prop::sample::select(vec!["ORDERS_DB", "LITE_DB", "MY_DB"]),
        poller_changes in prop::collection::vec((prop::sample::select(POLLER_FIELDS.to_vec()), value()), 0..6),
        watchdog_changes in prop::collection::vec((prop::sample::select(WATCHDOG_FIELDS.to_vec()), value()), 0..4),
        host in host_json(),
    ) {
        let mut poller = base_poller(database);
        for (field, change) in poller_changes {
            set(&mut poller, field, change);
        }
        let mut watchdog = json!({"state": {"connection": "ORDERS_STATE"}});
        for (field, change) in watchdog_changes {
            set(&mut watchdog, field, change);
        }
        match load_app(&poller, &watchdog, &host) {
            Err(error) => assert_no_secret(&error),
            Ok(app) => {
                for parsed in app.functions.values() {
                    if let Err(error) = parsed {
                        assert_no_secret(error);
                    }
                }
            }
        }
    }
}

/// The text fields of a poller section, each of which the next property fills in turn.
const TEXT_FIELDS: [&str; 22] = [
    "name",
    "source.connection",
    "source.table",
    "source.cursor",
    "source.where",
    "source.cursorTimeZone",
    "source.softDelete",
    "source.opColumn",
    "source.generation.query",
    "source.generation.onChange",
    "sink.type",
    "sink.url",
    "sink.secret",
    "state.connection",
    "state.container",
    "poison.mode",
    "source.query",
    "sink.connection",
    "sink.queueName",
    "sink.messageEncoding",
    "sink.messagePer",
    "source.pk",
];

/// A poller section whose every text field in turn holds `text`, parsed without I/O.
fn each_text_field(database: &str, text: &str) -> Vec<Result<PollerConfig, ConfigError>> {
    let root = std::path::Path::new("/nonexistent-app-root");
    let file = root.join("orders/function.json");
    let at = Located { file: &file };
    let mut results = Vec::new();
    for field in TEXT_FIELDS {
        let mut poller = base_poller(database);
        if field.starts_with("sink.") && ["sink.connection", "sink.queueName", "sink.messagePer"].contains(&field) {
            poller["sink"] = json!({"type": "queue", "queueName": "orders-changes"});
        }
        if field == "source.query" {
            poller["source"].as_object_mut().expect("an object").remove("table");
        }
        let value = if field == "source.pk" { json!([text]) } else { Value::from(text) };
        set(&mut poller, field, value);
        let document = json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
            "poller": poller
        });
        results.push(PollerConfig::from_document(&document, root, "orders", &settings(), None, &at));
    }
    results
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any text in any text field of a poller, and any `functionTimeout`: a configuration or a
    /// ConfigError, never a panic nor a secret shown. Cheap enough (no files) to try thousands.
    #[test]
    fn any_text_in_any_field_gives_a_config_or_an_error_never_a_panic(
        database in prop::sample::select(vec!["ORDERS_DB", "LITE_DB", "MY_DB"]),
        text in prop_oneof![text(), "[+0-9:é-]{4,7}"],
        timeout in prop_oneof![text(), "[0-9]{1,20}(\\.[0-9]{1,20})?:[0-9]{1,3}:[0-9.]{1,6}"],
    ) {
        for result in each_text_field(database, &text) {
            if let Err(error) = result {
                assert_no_secret(&error);
            }
        }
        let host = json!({"version": "2.0", "functionTimeout": timeout}).to_string();
        for plan in [super::plan::HostingPlan::Consumption, super::plan::HostingPlan::Other] {
            let _ = super::plan::function_timeout_of(std::path::Path::new("host.json"), &host, plan);
        }
    }
}
