//! What the configuration must never do with a secret or a hostile value: quote a setting's value
//! in an error, accept a key anyone could guess, let a fragment out of its parentheses, or panic.

use super::*;
use serde_json::json;

const PASSWORD: &str = "Pg-Pass-7f3a91";
const WEBHOOK_KEY: &str = "whsec_c2lnbmluZy1rZXktZm9yLXRoZS1zZWN1cml0eS10ZXN0cw==";
const ACCOUNT_KEY: &str = "QWNjb3VudEtleUZvclRoZVNlY3VyaXR5VGVzdHMxMjM0NTY3ODk=";

fn secret_settings() -> Settings {
    Settings::from_pairs([
        ("ORDERS_DB", format!("postgres://app:{PASSWORD}@db.example.com:5432/orders")),
        ("ORDERS_URL", "https://hooks.example.com/services/T0KEN-IN-PATH".to_string()),
        ("ORDERS_SECRET", WEBHOOK_KEY.to_string()),
        ("ORDERS_STATE", format!("DefaultEndpointsProtocol=https;AccountName=shop;AccountKey={ACCOUNT_KEY}")),
        ("AzureWebJobsStorage", format!("DefaultEndpointsProtocol=https;AccountName=shop;AccountKey={ACCOUNT_KEY}")),
    ])
}

fn write_function(root: &std::path::Path, document: &serde_json::Value) {
    std::fs::create_dir_all(root.join("orders")).unwrap();
    std::fs::write(root.join("orders/function.json"), serde_json::to_vec(document).unwrap()).unwrap();
}

fn poller_document(poller: serde_json::Value) -> serde_json::Value {
    json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
        "poller": poller
    })
}

fn good_poller() -> serde_json::Value {
    json!({
        "source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]},
        "sink": {"type": "webhook", "url": "%ORDERS_URL%", "secret": "ORDERS_SECRET"},
        "state": {"connection": "ORDERS_STATE"}
    })
}

fn load_function(document: &serde_json::Value, settings: &Settings) -> Result<FunctionConfig, ConfigError> {
    let root = tempfile::tempdir().unwrap();
    write_function(root.path(), document);
    FunctionConfig::load(root.path(), "orders", settings, None)
}

fn assert_no_secret(text: &str) {
    for secret in [PASSWORD, WEBHOOK_KEY, WEBHOOK_KEY.trim_start_matches("whsec_"), ACCOUNT_KEY, "T0KEN-IN-PATH"] {
        assert!(!text.contains(secret), "a secret is shown: {text}");
    }
}

/// Regression (issue 30, item 1): a field that names an app setting, written `%NAME%`, was
/// substituted and its error quoted the setting's value as if it were a name (the database
/// password, the `whsec_` key, the storage AccountKey). Each such field is refused with the fix,
/// before any substitution, and the error never shows a value.
#[test]
fn a_setting_name_field_written_as_percent_name_is_refused_without_its_value() {
    let poller_cases = [
        ("/source/connection", "%ORDERS_DB%", "poller.source.connection", "ORDERS_DB"),
        ("/sink/secret", "%ORDERS_SECRET%", "poller.sink.secret", "ORDERS_SECRET"),
        ("/state/connection", "%ORDERS_STATE%", "poller.state.connection", "ORDERS_STATE"),
    ];
    for (pointer, written, field, name) in poller_cases {
        let mut poller = good_poller();
        *poller.pointer_mut(pointer).unwrap() = json!(written);
        let error = load_function(&poller_document(poller), &secret_settings()).unwrap_err();
        assert_eq!(error.field, field, "{error}");
        assert!(error.reason.contains(&format!("write {name:?}, not \"%{name}%\"")), "{error}");
        assert_no_secret(&error.to_string());
    }
    let mut queue = good_poller();
    queue["sink"] = json!({"type": "queue", "connection": "%AzureWebJobsStorage%", "queueName": "orders-changes"});
    let error = load_function(&poller_document(queue), &secret_settings()).unwrap_err();
    assert_eq!(error.field, "poller.sink.connection");
    assert_no_secret(&error.to_string());

    let watchdog = |alert: serde_json::Value, state: serde_json::Value| {
        json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
            "watchdog": {"alert": alert, "state": state}
        })
    };
    let error = load_function(
        &watchdog(json!({"url": "%ORDERS_URL%", "secret": "%ORDERS_SECRET%"}), json!({"connection": "ORDERS_STATE"})),
        &secret_settings(),
    )
    .unwrap_err();
    assert_eq!(error.field, "watchdog.alert.secret");
    assert_no_secret(&error.to_string());
    let error = load_function(&watchdog(json!({"url": "%ORDERS_URL%"}), json!({"connection": "%ORDERS_STATE%"})), &{
        secret_settings()
    })
    .unwrap_err();
    assert_eq!(error.field, "watchdog.state.connection");
    assert_no_secret(&error.to_string());
}

/// Regression (issue 30, item 1): a value pasted where a setting's name belongs (a URL, a key) is
/// refused without being quoted, and a value substituted into any other field (here a URL where a
/// table name belongs, a key where a number belongs) is never quoted by the error that follows.
#[test]
fn no_configuration_error_quotes_a_setting_value() {
    let mut pasted = good_poller();
    pasted["source"]["connection"] = json!(format!("postgres://app:{PASSWORD}@db.example.com/orders"));
    let error = load_function(&poller_document(pasted), &secret_settings()).unwrap_err();
    assert_eq!(error.field, "poller.source.connection");
    assert!(error.reason.contains("must be the name of an app setting"), "{error}");
    assert_no_secret(&error.to_string());

    let mut misplaced = good_poller();
    misplaced["source"]["table"] = json!("%ORDERS_DB%");
    let error = load_function(&poller_document(misplaced), &secret_settings()).unwrap_err();
    assert_eq!(error.field, "poller.source.table");
    assert!(error.reason.contains("<value of ORDERS_DB>"), "{error}");
    assert_no_secret(&error.to_string());

    let mut typed = good_poller();
    typed["batch"] = json!({"size": "%ORDERS_SECRET%"});
    let error = load_function(&poller_document(typed), &secret_settings()).unwrap_err();
    assert_eq!(error.field, "poller.batch.size");
    assert_no_secret(&error.to_string());

    // A database URL that is not one: the reason never repeats it, whatever it holds.
    let settings = secret_settings().with("ORDERS_DB", PASSWORD);
    let error = load_function(&poller_document(good_poller()), &settings).unwrap_err();
    assert!(error.reason.contains("is not a database URL"), "{error}");
    assert_no_secret(&error.to_string());
    // The path of a webhook URL is never shown: no error quotes it either.
    let settings = secret_settings().with("ORDERS_URL", "ftp://hooks.example.com/services/T0KEN-IN-PATH");
    assert_no_secret(&load_function(&poller_document(good_poller()), &settings).unwrap_err().to_string());
}

/// Regression (issue 30, item 7): an empty (`whsec_`) or short signing key was accepted; keys under
/// 24 bytes are refused for the sink and for the alert, and the message never shows the key.
#[test]
fn a_signing_key_under_24_bytes_is_refused_without_showing_it() {
    for short in ["whsec_", "whsec_eA==", "whsec_c2hvcnQta2V5LTIzLWJ5dGVzLWxvbmc=", "tw3nty-three-char-secr"] {
        let settings = secret_settings().with("ORDERS_SECRET", short);
        let error = load_function(&poller_document(good_poller()), &settings).unwrap_err();
        assert_eq!(error.field, "poller.sink.secret", "{short}: {error}");
        assert!(error.reason.contains("at least 24"), "{short}: {error}");
        if short.len() > "whsec_".len() {
            assert!(!error.to_string().contains(short.trim_start_matches("whsec_")), "{error}");
        }
        let alert = json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
            "watchdog": {"alert": {"url": "%ORDERS_URL%", "secret": "ORDERS_SECRET"}, "state": {"connection": "ORDERS_STATE"}}
        });
        let error = load_function(&alert, &settings).unwrap_err();
        assert_eq!(error.field, "watchdog.alert.secret", "{error}");
    }
    assert!(load_function(&poller_document(good_poller()), &secret_settings()).is_ok());
    let long_enough = secret_settings().with("ORDERS_SECRET", "a-random-secret-of-24-by");
    assert!(load_function(&poller_document(good_poller()), &long_enough).is_ok());
}

/// Regression (issue 30, item 8): PostgreSQL's dollar quoting (`$$…$$`, `$tag$…$tag$`) hid a
/// parenthesis from the `where` check, so a fragment could close the seek's parentheses. A `$`
/// outside quoted text is refused in `where`, `query` and the generation query; inside quotes it
/// is text.
#[test]
fn dollar_quoting_in_a_fragment_is_refused() {
    let settings = secret_settings();
    for (field, bad) in [
        ("where", "tenant = 7 OR $$) OR (1 = 1$$ = ''"),
        ("where", "note = $tag$x$tag$"),
        ("where", "id = $1"),
        ("query", "SELECT * FROM orders WHERE $$)$$ = ''"),
    ] {
        let mut poller = good_poller();
        if field == "query" {
            poller["source"].as_object_mut().unwrap().remove("table");
        }
        poller["source"][field] = json!(bad);
        let error = load_function(&poller_document(poller), &settings).unwrap_err();
        assert_eq!(error.field, format!("poller.source.{field}"), "{bad}: {error}");
        assert!(error.reason.contains("'$' outside quoted text"), "{bad}: {error}");
    }
    let mut generation = good_poller();
    generation["source"]["generation"] = json!({"query": "SELECT $$1$$"});
    let error = load_function(&poller_document(generation), &settings).unwrap_err();
    assert_eq!(error.field, "poller.source.generation.query");
    let mut quoted = good_poller();
    quoted["source"]["where"] = json!("note <> '$$ costs $5'");
    assert!(load_function(&poller_document(quoted), &settings).is_ok());
}

/// Regression (issue 24, item 13): a `cursorTimeZone` of six bytes with a multi-byte character
/// (`+0é00`) was sliced inside the character and panicked; a `sqlite` URL with nothing after its
/// scheme was sliced past its end. Both are configuration errors.
#[test]
fn multi_byte_time_zones_and_bare_schemes_are_errors_not_panics() {
    for (engine_url, zone) in [
        ("mysql://app:pw@db.example.com/orders", "+0é00"),
        ("mysql://app:pw@db.example.com/orders", "é:00:"),
        ("postgres://app:pw@db.example.com/orders", "+0é00"),
        ("sqlite://orders.db", "+0é00"),
    ] {
        let mut poller = good_poller();
        poller["source"]["cursorTimeZone"] = json!(zone);
        let settings = secret_settings().with("ORDERS_DB", engine_url);
        let outcome = std::panic::catch_unwind(|| load_function(&poller_document(poller), &settings));
        let error = outcome.unwrap_or_else(|_| panic!("{zone:?} on {engine_url} panicked")).unwrap_err();
        assert_eq!(error.field, "poller.source.cursorTimeZone", "{error}");
    }
    for bare in ["sqlite", "SQLITE", "sqlite:"] {
        let settings = secret_settings().with("ORDERS_DB", bare);
        let outcome = std::panic::catch_unwind(|| load_function(&poller_document(good_poller()), &settings));
        let error = outcome.unwrap_or_else(|_| panic!("{bare:?} panicked")).unwrap_err();
        assert_eq!(error.field, "poller.source.connection", "{error}");
    }
}

/// Regression (issue 30, item 6): an app name that climbs out of the store's root
/// (`DBTRIGGER_APP_NAME=../../x`) is refused for the watchdog as for pollers.
#[test]
fn an_app_name_that_is_not_a_path_name_is_refused_for_every_function() {
    let watchdog = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
        "watchdog": {"state": {"connection": "ORDERS_STATE"}}
    });
    for bad in ["../../x", "a/b", ".hidden", "x\ny"] {
        let settings = secret_settings().with("DBTRIGGER_APP_NAME", bad);
        let error = load_function(&watchdog, &settings).unwrap_err();
        assert_eq!(error.field, "(app name)", "{bad:?}: {error}");
        let error = load_function(&poller_document(good_poller()), &settings).unwrap_err();
        assert_eq!(error.field, "(app name)", "{bad:?}: {error}");
    }
}
