use super::*;
use serde_json::json;

fn settings() -> Settings {
    Settings::from_pairs([
        ("ORDERS_DB", "sqlite://orders.db"),
        ("ORDERS_URL", "http://127.0.0.1:9/hook"),
        ("ORDERS_SCHEDULE", "0 */1 * * * *"),
        ("STATE", "file:state"),
    ])
}

fn function_json(poller: serde_json::Value) -> serde_json::Value {
    json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "%ORDERS_SCHEDULE%"}],
        "poller": poller
    })
}

fn valid_poller() -> serde_json::Value {
    json!({
        "source": {"connection": "ORDERS_DB", "table": "main.orders", "cursor": "updated_at", "pk": ["id"]},
        "sink": {"type": "webhook", "url": "%ORDERS_URL%"},
        "state": {"connection": "STATE"}
    })
}

fn load(document: &serde_json::Value, settings: &Settings) -> (tempfile::TempDir, Result<PollerConfig, ConfigError>) {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("orders")).unwrap();
    std::fs::write(root.path().join("orders/function.json"), serde_json::to_vec(document).unwrap()).unwrap();
    let result = PollerConfig::load(root.path(), "orders", settings, None);
    // Every fixture the loader takes, the JSON Schema takes too (issue 28).
    if result.is_ok() {
        super::tests_schema::assert_schema_takes(document);
    }
    (root, result)
}

fn load_error(poller: serde_json::Value) -> ConfigError {
    load(&function_json(poller), &settings()).1.unwrap_err()
}

#[test]
fn a_valid_poller_gets_its_defaults_and_settings() {
    let (root, result) = load(&function_json(valid_poller()), &settings());
    let config = result.unwrap();
    assert_eq!(config.poller_name, "orders");
    assert_eq!(config.schedule.as_ref().map(ToString::to_string).as_deref(), Some("0 */1 * * * *"));
    assert_eq!(config.batch.size, 500);
    assert_eq!(config.lease.ttl, chrono::Duration::seconds(60));
    assert_eq!(config.source.engine, Engine::Sqlite);
    assert_eq!(config.source.target, SourceTarget::Table { schema: Some("main".into()), name: "orders".into() });
    let SinkConfig::Webhook(webhook) = &config.sink else { panic!("a webhook sink") };
    assert_eq!(webhook.url.expose().as_str(), "http://127.0.0.1:9/hook");
    match &config.state.location {
        StateLocation::File(path) => assert_eq!(path, &root.path().join("state")),
        other => panic!("expected a file store, got {other:?}"),
    }
    // A relative SQLite path is the app root's, whatever the current directory.
    assert!(config.source.url.expose().contains(&root.path().to_string_lossy().into_owned()));
    assert!(config.fingerprint.starts_with("sha256:"));
}

#[test]
fn the_fingerprint_does_not_depend_on_where_the_app_lives() {
    let (_first_root, first) = load(&function_json(valid_poller()), &settings());
    let (_second_root, second) = load(&function_json(valid_poller()), &settings());
    assert_eq!(first.unwrap().fingerprint, second.unwrap().fingerprint);
}

#[test]
fn malformed_json_names_the_file_and_the_position() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("orders")).unwrap();
    std::fs::write(root.path().join("orders/function.json"), b"{\"bindings\": [,]}").unwrap();
    let error = PollerConfig::load(root.path(), "orders", &settings(), None).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("orders/function.json"), "{message}");
    assert!(message.contains("invalid JSON at line 1"), "{message}");
}

#[test]
fn a_missing_field_is_named_with_its_path() {
    let mut poller = valid_poller();
    poller["source"].as_object_mut().unwrap().remove("cursor");
    let error = load_error(poller);
    assert_eq!(error.field, "poller.source");
    assert!(error.reason.contains("missing field `cursor`"), "{}", error.reason);
}

#[test]
fn a_misspelled_field_is_refused_not_ignored() {
    let mut poller = valid_poller();
    poller["batch"] = json!({"sise": 10});
    let error = load_error(poller);
    assert_eq!(error.field, "poller.batch.sise");
    assert!(error.reason.contains("unknown field `sise`"), "{}", error.reason);
}

#[test]
fn a_wrong_type_names_the_field() {
    let mut poller = valid_poller();
    poller["batch"] = json!({"size": "big"});
    let error = load_error(poller);
    assert_eq!(error.field, "poller.batch.size");
}

#[test]
fn an_unset_setting_is_named() {
    let mut poller = valid_poller();
    poller["sink"]["url"] = json!("%NOPE%");
    let error = load_error(poller);
    assert_eq!(error.field, "poller.sink.url");
    assert!(error.reason.contains("NOPE"), "{}", error.reason);
}

#[test]
fn identifiers_with_quotes_semicolons_or_comments_are_refused() {
    for (field, value) in [
        ("table", "orders\"; drop table x"),
        ("table", "orders;"),
        ("table", "orders--"),
        ("cursor", "updated_at/*"),
        ("cursor", "a b"),
        ("table", "a.b.c"),
    ] {
        let mut poller = valid_poller();
        poller["source"][field] = json!(value);
        let error = load_error(poller);
        assert_eq!(error.field, format!("poller.source.{field}"), "{value}");
    }
    let mut poller = valid_poller();
    poller["source"]["pk"] = json!(["id", "x'y"]);
    assert_eq!(load_error(poller).field, "poller.source.pk[1]");
    let mut poller = valid_poller();
    poller["source"]["where"] = json!("tenant = 1; delete from orders");
    assert_eq!(load_error(poller).field, "poller.source.where");
}

#[test]
fn a_lease_ttl_under_three_heartbeats_is_refused() {
    let mut poller = valid_poller();
    poller["lease"] = json!({"ttlSeconds": 30, "heartbeatSeconds": 15});
    let error = load_error(poller);
    assert_eq!(error.field, "poller.lease.ttlSeconds");
}

#[test]
fn a_database_password_never_appears_in_an_error() {
    let settings = settings().with("ORDERS_DB", "oracle://user:hunter2@db/orders");
    let (_root, result) = load(&function_json(valid_poller()), &settings);
    let message = result.unwrap_err().to_string();
    assert!(message.contains("unsupported database URL scheme"), "{message}");
    assert!(!message.contains("hunter2"), "{message}");
}

#[test]
fn sqlite_urls_take_the_uri_parameters_a_poller_can_use_and_refuse_the_rest() {
    let error_for = |url: &str| {
        let (_root, result) = load(&function_json(valid_poller()), &settings().with("ORDERS_DB", url));
        result.err().map(|error| error.to_string())
    };
    for accepted in ["sqlite://orders.db?mode=ro", "sqlite://orders.db?immutable=1&vfs=unix-none", "sqlite://orders.db"]
    {
        assert_eq!(error_for(accepted), None, "{accepted}");
    }
    let refused = [
        ("sqlite://orders.db?mode=rwc", "mode=rwc in a sqlite URL: a poller reads a database that exists"),
        ("sqlite://orders.db?mode=rw", "mode=rw in a sqlite URL: a poller reads a database that exists, read-only"),
        ("sqlite://:memory:", "an in-memory database (:memory:) has no rows"),
        ("sqlite://orders.db?immutible=1", "unknown parameter \"immutible\" in a sqlite URL"),
        ("sqlite://orders.db?mode=readonly", "the value of mode in a sqlite URL is not one SQLite takes for mode"),
    ];
    for (url, expected) in refused {
        let message = error_for(url).unwrap_or_else(|| panic!("{url} was accepted"));
        assert!(message.contains(expected), "{url}: {message}");
    }
}

#[test]
fn a_function_without_a_timer_is_refused() {
    let document =
        json!({"bindings": [{"type": "httpTrigger", "name": "req", "direction": "in"}], "poller": valid_poller()});
    let (_root, result) = load(&document, &settings());
    assert_eq!(result.unwrap_err().field, "bindings");
}

#[test]
fn a_tick_budget_too_close_to_the_function_timeout_is_refused() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("orders")).unwrap();
    std::fs::write(
        root.path().join("orders/function.json"),
        serde_json::to_vec(&function_json(valid_poller())).unwrap(),
    )
    .unwrap();
    std::fs::write(root.path().join("host.json"), br#"{"version": "2.0", "functionTimeout": "00:04:00"}"#).unwrap();
    let app = AppConfig::load(root.path(), &settings()).unwrap();
    let error = app.functions["orders"].as_ref().unwrap_err();
    assert_eq!(error.field, "poller.batch.tickBudgetSeconds");
}

#[test]
fn time_spans_parse_like_host_json() {
    assert_eq!(parse_timespan("00:10:00"), Ok(Duration::from_secs(600)));
    assert_eq!(parse_timespan("1.00:00:01"), Ok(Duration::from_secs(86_401)));
    assert!(parse_timespan("00:61:00").is_err());
    assert!(parse_timespan("ten minutes").is_err());
}

/// Regression (issue 30, item 9): a host.json `functionTimeout` whose hours or days overflow the
/// arithmetic (`5124095576030431:00:59` panicked `serve` and `check`; smaller ones wrapped in a
/// release build) is a configuration error on `functionTimeout` that says why.
#[test]
fn an_overflowing_function_timeout_is_a_configuration_error_not_a_panic() {
    for absurd in ["5124095576030431:00:59", "18446744073709551615:00:00", "213503982334601.00:00:00", "9000:00:00"] {
        let root = tempfile::tempdir().unwrap();
        let host = json!({"version": "2.0", "functionTimeout": absurd});
        std::fs::write(root.path().join("host.json"), host.to_string()).unwrap();
        let error = std::panic::catch_unwind(|| AppConfig::load(root.path(), &settings()))
            .unwrap_or_else(|_| panic!("{absurd} panicked"))
            .unwrap_err();
        assert_eq!(error.field, "functionTimeout", "{error}");
        assert!(error.reason.contains("longer than a year"), "{absurd}: {error}");
    }
}

#[test]
fn identity_based_state_connections_are_recognised() {
    let settings = settings().with("Store__accountName", "myaccount").with("Store__clientId", "abc");
    let mut poller = valid_poller();
    poller["state"] = json!({"connection": "Store"});
    let (_root, result) = load(&function_json(poller), &settings);
    match result.unwrap().state.location {
        StateLocation::AzureBlob(connection) => {
            assert_eq!(connection.blob_endpoint.as_str(), "https://myaccount.blob.core.windows.net/");
            assert_eq!(
                connection.credential,
                crate::azure::StorageCredential::ManagedIdentity { client_id: Some("abc".into()) }
            );
        }
        other => panic!("expected an identity-based blob store, got {other:?}"),
    }
}

#[test]
fn a_queue_sink_resolves_its_connection_and_defaults_to_base64_per_row() {
    let settings = settings().with("QUEUES", "UseDevelopmentStorage=true");
    let mut poller = valid_poller();
    poller["sink"] = json!({"type": "queue", "connection": "QUEUES", "queueName": "orders-changes"});
    let (_root, result) = load(&function_json(poller), &settings);
    let config = result.unwrap();
    let SinkConfig::Queue(queue) = &config.sink else { panic!("a queue sink") };
    assert_eq!(queue.queue_name, "orders-changes");
    assert_eq!(queue.encoding, MessageEncoding::Base64);
    assert_eq!(queue.per, MessagePer::Row);
    assert_eq!(queue.connection.queue_endpoint.as_str(), "http://127.0.0.1:10001/devstoreaccount1");
}

#[test]
fn a_queue_sink_refuses_webhook_fields_and_bad_names() {
    let settings = settings().with("QUEUES", "UseDevelopmentStorage=true");
    let mut poller = valid_poller();
    poller["sink"] = json!({"type": "queue", "connection": "QUEUES", "queueName": "orders", "url": "http://x"});
    assert_eq!(load(&function_json(poller), &settings).1.unwrap_err().field, "poller.sink.url");
    let mut poller = valid_poller();
    poller["sink"] = json!({"type": "queue", "connection": "QUEUES", "queueName": "Orders_Changes"});
    assert_eq!(load(&function_json(poller), &settings).1.unwrap_err().field, "poller.sink.queueName");
    let mut poller = valid_poller();
    poller["sink"] = json!({"type": "queue", "connection": "QUEUES", "queueName": "orders", "messageEncoding": "hex"});
    assert_eq!(load(&function_json(poller), &settings).1.unwrap_err().field, "poller.sink.messageEncoding");
}

#[test]
fn a_bad_schedule_is_named_with_its_binding() {
    let settings = settings().with("ORDERS_SCHEDULE", "every five minutes");
    let (_root, result) = load(&function_json(valid_poller()), &settings);
    let error = result.unwrap_err();
    assert_eq!(error.field, "bindings[0].schedule");
    assert!(error.reason.contains("six"), "{}", error.reason);
}

fn postgres_fingerprint(url: &str) -> (String, Option<String>) {
    let mut poller = valid_poller();
    poller["source"]["table"] = json!("public.orders");
    let (_root, result) = load(&function_json(poller), &settings().with("ORDERS_DB", url));
    let config = result.unwrap();
    (config.fingerprint, config.legacy_fingerprint)
}

/// Regression (issue 9, item 5): parameters in the URL's query that point the driver at another
/// database, server, user or schema change the fingerprint, so an old checkpoint is never reused
/// against another table.
#[test]
fn the_fingerprint_follows_the_effective_target_not_the_url_surface() {
    let (base, legacy) = postgres_fingerprint("postgres://app@db.example:5432/orders");
    assert_eq!(legacy, None, "the effective target is the URL's surface here: one fingerprint for both");
    for changed in [
        "postgres://app@db.example:5432/orders?dbname=archive",
        "postgres://app@db.example:5432/orders?host=replica.example",
        "postgres://app@db.example:5432/orders?port=6432",
        "postgres://app@db.example:5432/orders?user=reporting",
        "postgres://app@db.example:5432/orders?options=-c%20search_path%3Darchive",
    ] {
        let (fingerprint, changed_legacy) = postgres_fingerprint(changed);
        assert_ne!(fingerprint, base, "{changed}");
        assert_eq!(changed_legacy, None, "{changed}: the surface-only fingerprint is not trusted");
    }
    // What does not change the target does not change the fingerprint.
    assert_eq!(postgres_fingerprint("postgres://app:secret@db.example:5432/orders?sslmode=require").0, base);
    assert_eq!(postgres_fingerprint("postgres://app@db.example/orders").0, base, "5432 is the default port");
    // Earlier builds fingerprinted an omitted port as none: that fingerprint is still accepted.
    let legacy = postgres_fingerprint("postgres://app@db.example/orders").1;
    assert!(
        legacy.is_some_and(|legacy| legacy != base),
        "a URL without target parameters keeps its earlier fingerprint"
    );
    let mysql_base = postgres_fingerprint("mysql://app@db.example/orders").0;
    assert_ne!(postgres_fingerprint("mysql://app@db.example/orders?socket=/tmp/other.sock").0, mysql_base);
}

/// Regression (issue 9, item 12): absurd numbers are refused with the field, never a panic in the
/// arithmetic that follows (`3 * heartbeat`, `skew * 2`, `budget + margin`, chrono durations).
#[test]
fn absurd_numbers_are_refused_with_their_field_not_a_panic() {
    let huge = json!(u64::MAX);
    for (section, field, value) in [
        ("lease", "ttlSeconds", huge.clone()),
        ("lease", "heartbeatSeconds", huge.clone()),
        ("lease", "clockSkewSeconds", huge.clone()),
        ("batch", "tickBudgetSeconds", huge.clone()),
        ("batch", "size", huge.clone()),
        ("batch", "maxBytes", huge.clone()),
        ("batch", "maxInFlight", huge.clone()),
        ("batch", "commitIntervalMs", huge.clone()),
        ("source", "settleSeconds", huge.clone()),
        ("source", "queryTimeoutSeconds", huge.clone()),
        ("sink", "timeoutSeconds", huge.clone()),
        ("sink", "maxBodyBytes", huge.clone()),
        ("poison", "maxAttempts", json!(u32::MAX)),
    ] {
        let mut poller = valid_poller();
        if poller.get(section).is_none() {
            poller[section] = json!({});
        }
        poller[section][field] = value;
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("orders")).unwrap();
        std::fs::write(root.path().join("orders/function.json"), serde_json::to_vec(&function_json(poller)).unwrap())
            .unwrap();
        std::fs::write(root.path().join("host.json"), br#"{"version": "2.0", "functionTimeout": "00:10:00"}"#).unwrap();
        let outcome =
            std::panic::catch_unwind(|| AppConfig::load(root.path(), &settings()).unwrap().functions.remove("orders"));
        let parsed = outcome.unwrap_or_else(|_| panic!("{section}.{field} = huge panicked"));
        let error = parsed.unwrap().unwrap_err();
        assert_eq!(error.field, format!("poller.{section}.{field}"), "{error}");
        assert!(error.reason.contains("out of range"), "{error}");
    }
}

/// Regression (issue 9, item 13): a `where` that closes its own parentheses, or comments out the
/// rest with MySQL's `#`, would bypass the seek; it is refused.
#[test]
fn a_where_that_escapes_its_parentheses_is_refused() {
    for (bad, expected) in [
        ("tenant = 7) OR (1 = 1", "closes a parenthesis"),
        ("tenant = 7 # and the seek is gone", "'#'"),
        ("(tenant = 7", "unclosed parenthesis"),
        ("name = 'o''brien", "unclosed ' quote"),
        ("name = 'a\\' OR 1=1 OR ''", "backslash"),
    ] {
        let mut poller = valid_poller();
        poller["source"]["where"] = json!(bad);
        let error = load_error(poller);
        assert_eq!(error.field, "poller.source.where", "{bad}");
        assert!(error.reason.contains(expected), "{bad}: {error}");
    }
    for good in ["tenant = 7", "(a = 1 OR b = 2) AND c IN (1, 2)", "name = 'x) OR (1 = 1'", "note = 'it''s'"] {
        let mut poller = valid_poller();
        poller["source"]["where"] = json!(good);
        let (_root, result) = load(&function_json(poller), &settings());
        assert!(result.is_ok(), "{good}: {:?}", result.err());
    }
    let mut poller = valid_poller();
    poller["source"].as_object_mut().unwrap().remove("table");
    poller["source"]["query"] = json!("SELECT * FROM orders) AS x UNION (SELECT * FROM secrets");
    assert_eq!(load_error(poller).field, "poller.source.query");
}

/// Regression (issue 9, item 14): two functions with one poller name would both believe they hold
/// the lease; both are refused, each naming the other.
#[test]
fn two_functions_sharing_a_poller_name_are_both_refused() {
    let root = tempfile::tempdir().unwrap();
    for (function, name) in [("orders", "orders"), ("orders_copy", "orders"), ("other", "other")] {
        let mut poller = valid_poller();
        poller["name"] = json!(name);
        std::fs::create_dir(root.path().join(function)).unwrap();
        std::fs::write(
            root.path().join(function).join("function.json"),
            serde_json::to_vec(&function_json(poller)).unwrap(),
        )
        .unwrap();
    }
    let app = AppConfig::load(root.path(), &settings()).unwrap();
    for function in ["orders", "orders_copy"] {
        let error = app.functions[function].as_ref().unwrap_err();
        assert_eq!(error.field, "poller.name");
        assert!(error.reason.contains("orders, orders_copy"), "{error}");
    }
    assert!(app.functions["other"].is_ok(), "a poller with its own name is not affected");
}

#[test]
fn delete_rules_and_generations_are_checked_with_their_field() {
    let with = |extra: serde_json::Value| {
        let mut poller = valid_poller();
        for (key, value) in extra.as_object().unwrap() {
            poller["source"][key] = value.clone();
        }
        poller
    };
    let both = load_error(with(json!({"softDelete": "deleted_at", "opColumn": "op"})));
    assert_eq!(
        (both.field.as_str(), both.reason.as_str()),
        ("poller.source", "give `softDelete` or `opColumn`, not both")
    );
    let on_cursor = load_error(with(json!({"opColumn": "updated_at"})));
    assert_eq!(on_cursor.field, "poller.source.opColumn");
    let injected = load_error(with(json!({"softDelete": "deleted_at; DROP TABLE x"})));
    assert_eq!(injected.field, "poller.source.softDelete");
    let bad_mode =
        load_error(with(json!({"generation": {"query": "SELECT max(id) FROM loads", "onChange": "ignore"}})));
    assert_eq!(bad_mode.field, "poller.source.generation.onChange");
    let not_select = load_error(with(json!({"generation": {"query": "DELETE FROM loads"}})));
    assert_eq!(not_select.field, "poller.source.generation.query");
    let typo = load_error(with(json!({"generation": {"query": "SELECT 1", "onchange": "stop"}})));
    assert!(typo.field.starts_with("poller.source.generation"), "{typo:?}");

    let (_root, loaded) = load(
        &function_json(with(
            json!({"softDelete": "deleted_at", "generation": {"query": "SELECT max(id) FROM loads;"}}),
        )),
        &settings(),
    );
    let config = loaded.unwrap();
    assert_eq!(config.source.ops, OpRule::SoftDelete("deleted_at".into()));
    let generation = config.source.generation.unwrap();
    assert_eq!(
        (generation.query.as_str(), generation.on_change),
        ("SELECT max(id) FROM loads", OnGenerationChange::Stop)
    );
}

/// Issue 26, section 3: the late-arrival detector is on by default, and `source.lateArrivals`
/// turns it off or sizes it; a number out of range or an unknown field is refused by name.
#[test]
fn late_arrivals_are_detected_by_default_and_configurable() {
    let (_root, config) = load(&function_json(valid_poller()), &settings());
    assert_eq!(config.unwrap().late_arrivals, LateArrivalsConfig::default());
    let mut poller = valid_poller();
    poller["source"]["lateArrivals"] =
        json!({"enabled": false, "windowSeconds": 60, "windowRows": 500, "everyTicks": 3, "sweepChecks": 20});
    let (_root, config) = load(&function_json(poller), &settings());
    let late = config.unwrap().late_arrivals;
    assert_eq!(
        late,
        LateArrivalsConfig {
            enabled: false,
            window: Duration::from_secs(60),
            window_rows: 500,
            every_ticks: 3,
            sweep_checks: 20
        }
    );
    let mut poller = valid_poller();
    poller["source"]["lateArrivals"] = json!({"sweepChecks": 0});
    assert!(load_error(poller).to_string().contains("poller.source.lateArrivals.sweepChecks"));
    let mut poller = valid_poller();
    poller["source"]["lateArrivals"] = json!({"everyTicks": 0});
    assert!(load_error(poller).to_string().contains("poller.source.lateArrivals.everyTicks"));
    let mut poller = valid_poller();
    poller["source"]["lateArrivals"] = json!({"enable": false});
    assert!(load_error(poller).to_string().contains("enable"));
}
