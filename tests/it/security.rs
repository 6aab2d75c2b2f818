//! Secrets and trust boundaries (issue 30): no output ever carries a setting's value or a webhook
//! URL's path, nothing a peer sends can start a log line, an endless answer cannot exhaust memory,
//! and the database sessions are read-only.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::{AppRoot, Handler, Orders, Receiver, free_port, host_fixtures, run_dbtrigger};
use crate::services::{mariadb, postgres};
use crate::sources::{execute, items_config};

const PASSWORD: &str = "Db-Pass-8c1e42";
const HOOK_KEY_BASE64: &str = "aG9vay1zaWduaW5nLWtleS1mb3ItdGhlLWxlYWstdGVzdA==";
const ACCOUNT_KEY: &str = "QWNjb3VudEtleUxlYWtUZXN0MDEyMzQ1Njc4OWFiY2RlZg==";
const PATH_TOKEN: &str = "T0KEN-IN-THE-PATH-77";
const QUERY_KEY: &str = "QueryK3y-in-the-url";

fn secrets() -> [&'static str; 5] {
    [PASSWORD, HOOK_KEY_BASE64, ACCOUNT_KEY, PATH_TOKEN, QUERY_KEY]
}

fn assert_no_secret(what: &str, text: &str) {
    for secret in secrets() {
        assert!(!text.contains(secret), "{what} shows a secret ({secret}):\n{text}");
    }
}

/// A receiver on loopback that answers any path: row 2 is refused for good (422) and the first
/// request fails (503), each with a body that tries to forge a log line.
async fn forging_receiver() -> String {
    #[derive(Default)]
    struct Seen {
        requests: AtomicU64,
    }
    async fn answer(State(seen): State<Arc<Seen>>, body: axum::body::Bytes) -> (StatusCode, String) {
        let forged = "oops\nFORGED tick function=orders outcome=caught_up\r\nFORGED\u{2028}again\u{1b}[2J";
        if seen.requests.fetch_add(1, Ordering::SeqCst) == 0 {
            return (StatusCode::SERVICE_UNAVAILABLE, forged.to_string());
        }
        let envelope: Value = serde_json::from_slice(&body).unwrap();
        let refused = envelope["events"].as_array().unwrap().iter().any(|event| event["pk"]["id"] == 2);
        if refused { (StatusCode::UNPROCESSABLE_ENTITY, forged.to_string()) } else { (StatusCode::OK, "{}".into()) }
    }
    let router = axum::Router::new().fallback(axum::routing::post(answer)).with_state(Arc::new(Seen::default()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{address}/services/{PATH_TOKEN}/hook?code={QUERY_KEY}&x=1")
}

fn write_function(root: &Path, name: &str, document: Value) {
    std::fs::create_dir_all(root.join(name)).unwrap();
    std::fs::write(root.join(name).join("function.json"), serde_json::to_vec_pretty(&document).unwrap()).unwrap();
}

fn timer() -> Value {
    json!([{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}])
}

/// Every file under `directory`, as text.
fn every_file(directory: &Path) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut pending = vec![directory.to_path_buf()];
    while let Some(folder) = pending.pop() {
        for entry in std::fs::read_dir(&folder).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                found
                    .push((path.display().to_string(), String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into()));
            }
        }
    }
    found
}

/// Regression (issue 30, items 1 and 4): a field that names a setting, written `%NAME%`, put the
/// setting's value (the database password, the `whsec_` key, the storage AccountKey) in `check`,
/// the start-up log, the 500 body sent to the host, the status function's answer and the
/// watchdog's alert; a webhook URL's path (a chat hook's token) was in the log, `last_error`,
/// status, alerts and quarantine entries; a receiver's newlines forged log lines. Every output
/// is grepped for every secret, and the log for a forged line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_output_carries_a_secret_and_no_peer_forges_a_log_line() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=3, 1).await;
    let alerts = Receiver::start().await;
    let mut poller = AppRoot::orders_poller(1);
    poller["sink"]["maxRetries"] = json!(1);
    let app = AppRoot::write(directory.path(), poller);
    let mut settings = app.settings(&orders, &alerts);
    let hook_url = forging_receiver().await;
    settings.retain(|(name, _)| name != "ORDERS_WEBHOOK");
    let closed = format!("http://127.0.0.1:{}/services/{PATH_TOKEN}/hook?code={QUERY_KEY}", free_port());
    let storage = format!("DefaultEndpointsProtocol=https;AccountName=shop;AccountKey={ACCOUNT_KEY}");
    settings.extend([
        ("ORDERS_WEBHOOK".to_string(), hook_url),
        ("OFFLINE_WEBHOOK".to_string(), closed),
        ("PG_DB".to_string(), format!("postgres://app:{PASSWORD}@db.example.com:5432/orders?sslmode=verify-full")),
        ("HOOK_SECRET".to_string(), format!("whsec_{HOOK_KEY_BASE64}")),
        ("STORE".to_string(), storage),
        ("ALERT_URL".to_string(), alerts.url.clone()),
    ]);
    let root = &app.root;
    let source = json!({"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]});
    let state = json!({"connection": "ORDERS_STATE"});
    let webhook = json!({"type": "webhook", "url": "%ORDERS_WEBHOOK%", "secret": "HOOK_SECRET", "maxRetries": 0});
    let mut wrong_source = source.clone();
    wrong_source["connection"] = json!("%PG_DB%");
    let mut wrong_secret = webhook.clone();
    wrong_secret["secret"] = json!("%HOOK_SECRET%");
    let mistakes = [
        ("a_source", json!({"source": wrong_source, "sink": webhook, "state": state})),
        ("b_secret", json!({"source": source, "sink": wrong_secret, "state": state})),
        ("c_state", json!({"source": source, "sink": webhook, "state": {"connection": "%STORE%"}})),
        (
            "d_queue",
            json!({"source": source, "sink": {"type": "queue", "connection": "%STORE%", "queueName": "orders-q"},
                   "state": state}),
        ),
    ];
    for (name, poller) in &mistakes {
        write_function(root, name, json!({"bindings": timer(), "poller": poller}));
    }
    // Issue 36, section 3: a literal URL with an unmatched '%' in its key, and a URL at the cloud
    // metadata address, are refused without quoting their path or key.
    let percent_url = format!("https://hooks.example/services/{PATH_TOKEN}/x?code={QUERY_KEY}%3D");
    let metadata_url = format!("http://169.254.169.254/{PATH_TOKEN}?code={QUERY_KEY}");
    settings.push(("METADATA_HOOK".to_string(), metadata_url));
    for (name, url) in [("e_percent", percent_url.as_str()), ("f_metadata", "%METADATA_HOOK%")] {
        let sink = json!({"type": "webhook", "url": url});
        write_function(
            root,
            name,
            json!({"bindings": timer(), "poller": {"source": source, "sink": sink, "state": state}}),
        );
    }
    let offline_sink = json!({"type": "webhook", "url": "%OFFLINE_WEBHOOK%", "maxRetries": 0, "timeoutSeconds": 2});
    write_function(
        root,
        "offline",
        json!({"bindings": timer(), "poller": {"source": source, "sink": offline_sink, "state": state}}),
    );
    write_function(
        root,
        "watchdog",
        json!({"bindings": timer(), "watchdog": {"alert": {"url": "%ALERT_URL%", "secret": "HOOK_SECRET"}, "state": state}}),
    );
    write_function(
        root,
        "status",
        json!({"bindings": [{"type": "httpTrigger", "direction": "in", "name": "req", "authLevel": "function"},
                            {"type": "http", "direction": "out", "name": "res"}],
               "status": {}}),
    );

    // check: one line per mistake, each naming the field and the fix, none with a value.
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["check"]);
    assert!(!ok);
    for (function, field, name) in [
        ("a_source", "poller.source.connection", "PG_DB"),
        ("b_secret", "poller.sink.secret", "HOOK_SECRET"),
        ("c_state", "poller.state.connection", "STORE"),
        ("d_queue", "poller.sink.connection", "STORE"),
    ] {
        let line = stdout
            .lines()
            .find(|line| line.contains(&format!("{function}/function.json")))
            .unwrap_or_else(|| panic!("check names {function}:\n{stdout}"));
        assert!(line.contains(field) && line.contains(&format!("write \"{name}\", not \"%{name}%\"")), "{line}");
    }
    let line_of = |function: &str| stdout.lines().find(|line| line.contains(&format!("{function}/function.json")));
    let percent = line_of("e_percent").unwrap_or_else(|| panic!("check names e_percent:\n{stdout}"));
    assert!(percent.contains("unmatched '%'") && percent.contains("https://hooks.example/…"), "{percent}");
    let metadata = line_of("f_metadata").unwrap_or_else(|| panic!("check names f_metadata:\n{stdout}"));
    assert!(metadata.contains("link-local") && metadata.contains("allowLinkLocal"), "{metadata}");
    assert_no_secret("check", &format!("{stdout}{stderr}"));
    let (_, status_stdout, status_stderr) = run_dbtrigger(&app, &settings, &["status", "--json"]);
    assert_no_secret("the status command", &format!("{status_stdout}{status_stderr}"));
    // sql prints a grant naming the poller's login: never its password, nor a mistaken setting's value.
    for function in ["a_source", "orders"] {
        let (_, sql_stdout, sql_stderr) = run_dbtrigger(&app, &settings, &["sql", function]);
        assert_no_secret("the sql command", &format!("{sql_stdout}{sql_stderr}"));
    }

    let handler = Handler::start(&app, &settings).await;
    let timer_payload = host_fixtures()[2].1;
    let mut answers = Vec::new();
    for function in ["a_source", "b_secret", "c_state", "d_queue"] {
        let (status, _, body) = handler.invoke(function, timer_payload).await;
        assert_eq!(status, 500, "an unusable function's invocation fails: {body}");
        answers.push(body.to_string());
    }
    let (_, _, ticked) = handler.invoke("orders", timer_payload).await;
    let (_, _, offline) = handler.invoke("offline", timer_payload).await;
    let every_poller = json!({"Data": {"req": {"Url": "https://app.azurewebsites.net/api/status", "Method": "GET",
                                               "Query": {}, "Headers": {}, "Params": {}, "Body": null}},
                              "Metadata": {"sys": {"MethodName": "status"}}});
    let (_, _, status_answer) = handler.invoke("status", &every_poller.to_string()).await;
    let (_, _, watchdog) = handler.invoke("watchdog", timer_payload).await;
    answers.extend([ticked.to_string(), offline.to_string(), status_answer.to_string(), watchdog.to_string()]);
    for answer in &answers {
        assert_no_secret("an answer to the host", answer);
    }
    let status_text = status_answer.to_string();
    assert!(status_text.contains("POST http://127.0.0.1:") && status_text.contains("a_source"), "{status_text}");

    // The watchdog alerted: the configuration errors and the failing poller, no secret in it.
    let posted = alerts.all();
    assert!(!posted.is_empty(), "the watchdog alerted");
    for alert in &posted {
        let payload = String::from_utf8_lossy(&alert.body);
        assert!(payload.contains("config_error") && payload.contains("a_source"), "{payload}");
        assert_no_secret("the alert payload", &payload);
    }

    // The state documents, the quarantine entries and the watchdog's memory.
    let files = every_file(&app.state_dir);
    let quarantined: Vec<&(String, String)> =
        files.iter().filter(|(path, _)| path.contains("/quarantine/") && path.ends_with(".json")).collect();
    assert_eq!(quarantined.len(), 1, "row 2 quarantined: {files:?}");
    let entry: Value = serde_json::from_str(&quarantined[0].1).unwrap();
    let error = entry["error"].as_str().unwrap();
    assert!(error.contains("oops\\nFORGED") && !error.contains('\n') && !error.contains('\u{1b}'), "{error}");
    for (path, text) in &files {
        assert_no_secret(path, text);
    }

    // The log: no secret, the URL only as scheme, host and port, and no line a receiver began.
    let log = handler.log();
    drop(handler);
    assert_no_secret("the handler's log", &log);
    assert!(log.contains("oops\\nFORGED"), "the receiver's answer is logged, escaped:\n{log}");
    for line in log.lines() {
        assert!(!line.trim_start().starts_with("FORGED"), "a receiver forged a log line: {line:?}\n{log}");
        assert!(!line.contains('\u{2028}') && !line.contains('\u{1b}'), "{line:?}");
    }
}

/// A server on loopback that answers every request with `status` and a body that never ends,
/// until writing fails; it counts the bytes it managed to send (stopping at 512 MiB, so a client
/// that reads on without bound fails the test rather than the machine).
async fn endless_answer(status: u16) -> (String, Arc<AtomicU64>, Arc<AtomicBool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let sent = Arc::new(AtomicU64::new(0));
    let cut_off = Arc::new(AtomicBool::new(false));
    let (sent_counter, cut_off_flag) = (sent.clone(), cut_off.clone());
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let sent = sent_counter.clone();
            let cut_off = cut_off_flag.clone();
            tokio::spawn(async move {
                // The request: headers, then as many body bytes as content-length says.
                let mut request = Vec::new();
                let mut buffer = [0u8; 8192];
                let body_start = loop {
                    let read = stream.read(&mut buffer).await.unwrap_or(0);
                    if read == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..read]);
                    if let Some(end) = request.windows(4).position(|window| window == b"\r\n\r\n") {
                        break end + 4;
                    }
                };
                let headers = String::from_utf8_lossy(&request[..body_start]).to_ascii_lowercase();
                let length: usize = headers
                    .lines()
                    .find_map(|line| line.strip_prefix("content-length:").map(|value| value.trim().parse().unwrap()))
                    .unwrap_or(0);
                while request.len() - body_start < length {
                    let read = stream.read(&mut buffer).await.unwrap_or(0);
                    if read == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..read]);
                }
                let head = format!(
                    "HTTP/1.1 {status} Whatever\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"
                );
                if stream.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = format!("{:x}\r\n{}\r\n", 64 * 1024, "x".repeat(64 * 1024));
                loop {
                    if sent.load(Ordering::SeqCst) >= 512 * 1024 * 1024 {
                        return;
                    }
                    if stream.write_all(chunk.as_bytes()).await.is_err() {
                        cut_off.store(true, Ordering::SeqCst);
                        return;
                    }
                    sent.fetch_add(64 * 1024, Ordering::SeqCst);
                }
            });
        }
    });
    (url, sent, cut_off)
}

/// Regression (issue 30, item 3): a receiver answering 500 with an endless body drove a tick to
/// 2.3 GB in 4 s, since the body was read whole before it was cut to 1 KiB. The client now reads
/// at most what it keeps and drops the connection: the receiver is cut off after what the socket
/// buffers hold (a few MiB), far under the 64 MiB bound, and the tick fails on the 500 at once.
/// A 200 with an endless body is acknowledged without reading it at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_answer_body_is_never_read_past_what_is_kept() {
    const BOUND: u64 = 64 * 1024 * 1024;
    for (status, should_succeed) in [(500u16, false), (200, true)] {
        let directory = tempfile::tempdir().unwrap();
        let orders = Orders::create(directory.path()).await;
        orders.insert(1..=1, 1).await;
        let (url, sent, cut_off) = endless_answer(status).await;
        let mut poller = AppRoot::orders_poller(10);
        poller["sink"]["maxRetries"] = json!(0);
        poller["sink"]["timeoutSeconds"] = json!(60);
        let app = AppRoot::write(directory.path(), poller);
        let receiver = Receiver::start().await;
        let mut settings = app.settings(&orders, &receiver);
        for (name, value) in &mut settings {
            if name == "ORDERS_WEBHOOK" {
                *value = url.clone();
            }
        }
        let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
        assert_eq!(ok, should_succeed, "HTTP {status}: {stdout}{stderr}");
        if !should_succeed {
            assert!(stdout.contains("HTTP 500") || stderr.contains("HTTP 500"), "{stdout}{stderr}");
        }
        // The process has exited; give the server a moment to see the closed connection.
        for _ in 0..100 {
            if cut_off.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let bytes = sent.load(Ordering::SeqCst);
        assert!(cut_off.load(Ordering::SeqCst), "HTTP {status}: the receiver was cut off ({bytes} bytes sent)");
        assert!(bytes < BOUND, "HTTP {status}: {bytes} bytes of an endless body were taken (bound {BOUND})");
    }
}

/// Regression (issue 30, item 9): database sessions are read-only. A generation query that writes
/// (a sequence's `nextval`, a function that inserts) fails with the engine's read-only error, on
/// PostgreSQL and on MariaDB, while the same poller reads as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_sessions_are_read_only() {
    let pg = postgres().fresh_database().await;
    execute(&pg, "CREATE TABLE items (id INT PRIMARY KEY, c INT NOT NULL);\nCREATE SEQUENCE load_seq").await;
    let maria = mariadb().fresh_database().await;
    execute(
        &maria,
        "CREATE TABLE items (id INT PRIMARY KEY, c INT NOT NULL);\n\
         CREATE TABLE load_log (id INT AUTO_INCREMENT PRIMARY KEY);\n\
         CREATE FUNCTION next_load() RETURNS INT MODIFIES SQL DATA BEGIN INSERT INTO load_log VALUES (NULL); RETURN LAST_INSERT_ID(); END",
    )
    .await;
    for (url, writing_query, read_only_error) in [
        (&pg, "SELECT nextval('load_seq')", "read-only transaction"),
        (&maria, "SELECT next_load()", "READ ONLY transaction"),
    ] {
        let (config, _directory) = items_config(url, json!({"generation": {"query": writing_query}}), 10);
        let source = dbtrigger::source::open(&config.source).unwrap();
        let error = source.generation().await.expect_err("a write through the poller's session");
        assert!(error.to_string().contains(read_only_error), "{url}: {error}");
        assert_eq!(source.count_after(None, 100).await.unwrap(), 0, "{url}: it still reads");
    }
}

/// Regression (issue 30, item 5): a remote database whose server is not verified (no `sslmode`:
/// plaintext may be used) is warned about by `check` (which still passes: a private network may
/// be trusted) and in the start-up log of `serve`, naming the fix and never the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unverified_database_connection_is_warned_about_by_check_and_at_start_up() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(10));
    let mut settings = app.settings(&orders, &receiver);
    for (name, value) in &mut settings {
        if name == "ORDERS_DB" {
            *value = format!("postgres://app:{PASSWORD}@db.example.com:5432/orders");
        }
    }
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["check"]);
    assert!(ok, "a warning does not fail the check: {stdout}{stderr}");
    let warning = stdout.lines().find(|line| line.starts_with("warning: ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(warning.contains("orders/function.json: poller.source.connection"), "{warning}");
    assert!(warning.contains("db.example.com") && warning.contains("sslmode=prefer"), "{warning}");
    assert!(warning.contains("plaintext") && warning.contains("sslmode=verify-full"), "{warning}");
    assert_no_secret("check", &format!("{stdout}{stderr}"));

    let handler = Handler::start(&app, &settings).await;
    let log = handler.log();
    drop(handler);
    assert!(log.contains("WARN") && log.contains("sslmode=prefer") && log.contains("db.example.com"), "{log}");
    assert_no_secret("the start-up log", &log);
}

/// Issue 36, section 3: another session's SQL (here an `ALTER ROLE … PASSWORD` in the transaction
/// that holds the commit horizon) reaches an operator's `dbtrigger status` only: the status
/// function, the watchdog's output and its alert webhook show who holds the horizon (pid, role,
/// application, state, age), never the query text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_sessions_query_reaches_only_an_operators_status() {
    use sqlx::Connection as _;
    // A server of its own: the transaction held here would hold every xid poller of a shared one.
    let server = crate::services::postgres_with_settings(&[]);
    let url = server.fresh_database().await;
    execute(&url, "CREATE TABLE items (id BIGINT PRIMARY KEY, c xid8 NOT NULL DEFAULT pg_current_xact_id());\n").await;
    let alerts = Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, mut settings, _) =
        crate::horizon::items_app_into(directory.path(), &url, json!({"cursorKind": "xid"}), &alerts.url);
    settings.push(("ALERT_URL".to_string(), alerts.url.clone()));
    let state = json!({"connection": "STATE"});
    write_function(
        &app.root,
        "watchdog",
        json!({"bindings": timer(), "watchdog": {"horizonHeldAfterSeconds": 1, "alert": {"url": "%ALERT_URL%"}, "state": state}}),
    );
    write_function(
        &app.root,
        "status",
        json!({"bindings": [{"type": "httpTrigger", "direction": "in", "name": "req", "authLevel": "function"},
                            {"type": "http", "direction": "out", "name": "res"}],
               "status": {}}),
    );
    let role = format!("r_{}", &uuid::Uuid::new_v4().simple().to_string()[..4]);
    let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut holder).await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE ROLE {role}"))).execute(&mut holder).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("ALTER ROLE {role} PASSWORD '{PASSWORD}'")))
        .execute(&mut holder)
        .await
        .unwrap();
    execute(&url, "INSERT INTO items (id) VALUES (1);\n").await;
    tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;

    // The operator's status: the holder with the start of its query (the oldest holder of the
    // shared server is named: wait out another test's older transaction).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let operator = loop {
        let (_, stdout, _) = run_dbtrigger(&app, &settings, &["status"]);
        if stdout.contains(&format!("held by pid {pid} ")) || std::time::Instant::now() > deadline {
            break stdout;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert!(operator.contains(&format!("held by pid {pid} (role postgres, ")), "{operator}");
    assert!(operator.contains(&format!(": ALTER ROLE {role} PASSWORD 'Db-Pass")), "an operator sees it: {operator}");

    // The status function, as the host calls it.
    let pairs: Vec<(&str, &str)> = settings.iter().map(|(key, value)| (key.as_str(), value.as_str())).collect();
    let loaded = dbtrigger::app::App::load(&app.root, &dbtrigger::config::Settings::from_pairs(pairs)).unwrap();
    let answer = loaded.invoke_with("status", &dbtrigger::protocol::InvocationRequest::default()).await;
    let published = format!("{answer:?}");
    assert!(published.contains(&format!("Number({pid})")), "the status function names the holder: {published}");
    // The watchdog, past horizonHeldAfterSeconds: its lines and its alert.
    let (_, watchdog_stdout, watchdog_stderr) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(watchdog_stdout.contains("finding=horizon_held"), "{watchdog_stdout}");
    let posted: Vec<String> =
        alerts.all().iter().map(|alert| String::from_utf8_lossy(&alert.body).into_owned()).collect();
    assert!(posted.iter().any(|payload| payload.contains("horizon_held")), "the watchdog alerted: {posted:?}");
    for (what, text) in [
        ("the status function's answer", published),
        ("the watchdog's output", format!("{watchdog_stdout}{watchdog_stderr}")),
        ("the alert payload", posted.join("\n")),
    ] {
        assert_no_secret(what, &text);
        assert!(!text.contains("ALTER ROLE"), "{what} shows another session's query:\n{text}");
    }
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();
}
