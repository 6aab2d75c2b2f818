//! Database logins by the app's managed identity (issue 48): `ORDERS_DB__credential =
//! managedidentity`, the URL naming the user and no password, the token of a loopback stand-in for
//! the App Service identity endpoint ([`crate::identity`]) as the password. The servers check it as
//! a password: the stand-in makes each token it issues the role's password (and ends the role's
//! sessions) before it answers, as a rotation would, so a connection opened with any older token is
//! refused. What this proves: dbtrigger asks the endpoint the way azure_identity speaks to App
//! Service, asks again before the token it holds is due, and logs in every new connection with the
//! latest; what it cannot prove here is Azure's own token check (`aad_auth`, `pgaadauth`).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::harness::{AppRoot, Handler, Receiver, host_fixtures, run_dbtrigger};
use crate::identity::{IdentityEndpoint, OnIssue};

/// How long a token is used before it is due (see [`crate::identity`]).
const LIVE: Duration = Duration::from_secs(3);

fn polling() -> serde_json::Value {
    json!({"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]})
}

fn poller(source: serde_json::Value) -> serde_json::Value {
    json!({
        "source": source,
        "batch": {"size": 100},
        "sink": {"type": "webhook", "url": "%ORDERS_WEBHOOK%", "timeoutSeconds": 5},
        "state": {"connection": "ORDERS_STATE"}
    })
}

fn settings(app: &AppRoot, url: &str, receiver: &Receiver, endpoint: &IdentityEndpoint) -> Vec<(String, String)> {
    let mut settings = vec![
        ("ORDERS_DB".to_string(), url.to_string()),
        ("ORDERS_DB__credential".to_string(), "managedidentity".to_string()),
        ("ORDERS_WEBHOOK".to_string(), receiver.url.clone()),
        ("ORDERS_STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];
    settings.extend(endpoint.settings());
    settings
}

/// Every file under `directory`, as text.
fn every_file(directory: &std::path::Path) -> Vec<(String, String)> {
    let mut files = Vec::new();
    let Ok(entries) = std::fs::read_dir(directory) else {
        return files;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(every_file(&path));
        } else {
            files.push((
                path.display().to_string(),
                String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into_owned(),
            ));
        }
    }
    files
}

/// The `id` of every row the receiver acknowledged, in order.
fn delivered(receiver: &Receiver) -> Vec<i64> {
    let mut ids = Vec::new();
    for received in receiver.acknowledged() {
        for event in received.envelope["events"].as_array().unwrap() {
            // A polling source's row, or a change stream's new image.
            let row = if event["row"]["new"].is_object() { &event["row"]["new"] } else { &event["row"] };
            let id = &row["id"];
            let id = id.as_i64().or_else(|| id.as_str().and_then(|text| text.parse().ok()));
            ids.push(id.unwrap_or_else(|| panic!("an event with a row id: {event}")));
        }
    }
    ids
}

/// Ticks through a rotation, then with the endpoint down; and no token, nor the identity header,
/// anywhere the handler writes or answers.
async fn deliver_through_rotation(
    app: &AppRoot,
    settings: &[(String, String)],
    receiver: &Receiver,
    endpoint: &IdentityEndpoint,
    insert: impl Fn(std::ops::RangeInclusive<i64>) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>,
) {
    let timer = host_fixtures()[2].1;
    let handler = Handler::start(app, settings).await;
    // A change stream's first tick starts at the stream's end: it reads nothing.
    let (status, _, empty) = handler.invoke("orders", timer).await;
    assert_eq!(status, 200, "{empty}\n{}", handler.log());
    insert(1..=5).await;
    let (status, _, first) = handler.invoke("orders", timer).await;
    assert_eq!(status, 200, "{first}\n{}", handler.log());
    assert_eq!(delivered(receiver), (1..=5).collect::<Vec<_>>(), "{}", handler.log());
    assert_eq!(endpoint.issued().len(), 1, "one token for the first tick");

    // The token is due: the next tick asks for another, which the server now requires (the
    // sessions that logged in with the first one were ended).
    tokio::time::sleep(LIVE + Duration::from_secs(1)).await;
    insert(6..=10).await;
    let (status, _, second) = handler.invoke("orders", timer).await;
    assert_eq!(status, 200, "a rotation costs no failed tick: {second}\n{}", handler.log());
    assert_eq!(delivered(receiver), (1..=10).collect::<Vec<_>>(), "{}", handler.log());
    assert_eq!(endpoint.issued().len(), 2, "a second token after the first was due");
    let asked = endpoint.asked();
    assert!(asked.iter().all(|asked| asked.resource == "https://ossrdbms-aad.database.windows.net"), "{asked:?}");

    // `check` logs in with a token too (a change stream's check asks the server): it says how the
    // poller logs in and finds nothing missing while the endpoint answers.
    let (_, check_stdout, check_stderr) = run_dbtrigger(app, settings, &["check"]);
    assert!(
        check_stdout.contains(
            "ok: orders (poller orders, logs in by managed identity: ORDERS_DB__credential = managedidentity"
        ),
        "check says how the poller logs in:\n{check_stdout}{check_stderr}"
    );
    assert!(!check_stdout.contains("missing"), "{check_stdout}{check_stderr}");

    // The endpoint goes down: once the token is due, the tick fails, naming the setting.
    endpoint.stop();
    tokio::time::sleep(LIVE + Duration::from_secs(1)).await;
    insert(11..=12).await;
    let (status, _, failed) = handler.invoke("orders", timer).await;
    assert_ne!(status, 200, "no token, no tick: {failed}");
    let log = handler.log();
    assert!(
        log.contains("ORDERS_DB__credential") && log.contains("no Microsoft Entra token from the managed identity"),
        "the failure names the setting:\n{log}"
    );
    assert_eq!(delivered(receiver), (1..=10).collect::<Vec<_>>());

    let (_, status_stdout, status_stderr) = run_dbtrigger(app, settings, &["status", "--json"]);
    drop(handler);
    let mut outputs = vec![
        ("the handler's log".to_string(), log),
        ("the tick's answers".to_string(), format!("{empty}{first}{second}{failed}")),
        ("status".to_string(), format!("{status_stdout}{status_stderr}")),
        ("check".to_string(), format!("{check_stdout}{check_stderr}")),
        (
            "the deliveries".to_string(),
            format!("{:?}", receiver.all().iter().map(|r| r.envelope.to_string()).collect::<Vec<_>>()),
        ),
    ];
    outputs.extend(every_file(&app.state_dir));
    let secrets: Vec<String> = endpoint.issued().into_iter().chain([endpoint.header.clone()]).collect();
    for (what, text) in &outputs {
        for secret in &secrets {
            // A token's signature part alone is short: the whole token, and its claims, are what leak.
            assert!(!text.contains(secret.as_str()), "{what} shows a token or the identity header:\n{text}");
            if let Some(claims) = secret.split('.').nth(1) {
                assert!(!text.contains(claims), "{what} shows a token's claims:\n{text}");
            }
        }
    }
}

/// A PostgreSQL server of its own where role `entra_reader` logs in by password (SCRAM; every
/// other role by trust, as the harness's servers do), a database with `orders` it may read; the
/// admin pool and the database's name.
async fn postgres_for_tokens(directory: &std::path::Path) -> (crate::services::Postgres, sqlx::PgPool, String) {
    let hba = directory.join("pg_hba.conf");
    std::fs::write(
        &hba,
        "host all entra_reader 127.0.0.1/32 scram-sha-256\nhost all all 127.0.0.1/32 trust\nlocal all all trust\n",
    )
    .unwrap();
    let mut permissions = std::fs::metadata(directory).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o755);
    std::fs::set_permissions(directory, permissions).unwrap();
    let server = crate::services::postgres_with_settings(&[("hba_file", &hba.display().to_string())]);
    let admin_url = server.fresh_database().await;
    let admin = sqlx::PgPool::connect(&admin_url).await.unwrap();
    let database = admin_url.rsplit('/').next().unwrap().to_string();
    for statement in [
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT, version BIGINT NOT NULL)".to_string(),
        "CREATE INDEX orders_seek ON orders (version, id)".to_string(),
        "CREATE ROLE entra_reader LOGIN".to_string(),
        format!("GRANT CONNECT ON DATABASE {database} TO entra_reader"),
        "GRANT SELECT ON orders TO entra_reader".to_string(),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&admin).await.unwrap();
    }
    (server, admin, database)
}

/// Each token the endpoint issues becomes `entra_reader`'s password, and the role's sessions end.
fn postgres_rotation(admin: &sqlx::PgPool) -> OnIssue {
    let rotate_pool = admin.clone();
    Arc::new(move |token: String| {
        let pool = rotate_pool.clone();
        Box::pin(async move {
            sqlx::query(sqlx::AssertSqlSafe(format!("ALTER ROLE entra_reader PASSWORD '{token}'")))
                .execute(&pool)
                .await
                .unwrap();
            sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'entra_reader'")
                .execute(&pool)
                .await
                .unwrap();
        })
    })
}

fn postgres_insert(
    admin: &sqlx::PgPool,
) -> impl Fn(std::ops::RangeInclusive<i64>) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>> {
    let admin = admin.clone();
    move |ids: std::ops::RangeInclusive<i64>| {
        let pool = admin.clone();
        Box::pin(async move {
            for id in ids {
                sqlx::query("INSERT INTO orders (id, note, version) VALUES ($1, $2, $1)")
                    .bind(id)
                    .bind(format!("order {id}"))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }) as std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_poller_logs_in_with_the_managed_identity_token_through_a_rotation() {
    let directory = tempfile::tempdir().unwrap();
    let (server, admin, database) = postgres_for_tokens(directory.path()).await;
    let endpoint = IdentityEndpoint::start(LIVE, Some(postgres_rotation(&admin))).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), poller(polling()));
    let url = format!("postgres://entra_reader@127.0.0.1:{}/{database}", server.port);
    let settings = settings(&app, &url, &receiver, &endpoint);
    deliver_through_rotation(&app, &settings, &receiver, &endpoint, postgres_insert(&admin)).await;
    assert!(endpoint.asked().iter().all(|asked| asked.client_id.is_none()), "the system-assigned identity");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logical_poller_logs_in_with_the_managed_identity_token_through_a_rotation() {
    let directory = tempfile::tempdir().unwrap();
    let (server, admin, database) = postgres_for_tokens(directory.path()).await;
    let slot = format!("s_{}", database.trim_start_matches("t_"));
    for statement in [
        "ALTER ROLE entra_reader REPLICATION".to_string(),
        "CREATE PUBLICATION feed FOR TABLE orders".to_string(),
        format!("SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&admin).await.unwrap();
    }
    let endpoint = IdentityEndpoint::start(LIVE, Some(postgres_rotation(&admin))).await;
    let receiver = Receiver::start().await;
    let source = json!({"kind": "logical", "connection": "ORDERS_DB", "slot": slot, "publication": "feed"});
    let app = AppRoot::write(directory.path(), poller(source));
    let url = format!("postgres://entra_reader@127.0.0.1:{}/{database}", server.port);
    let settings = settings(&app, &url, &receiver, &endpoint);
    deliver_through_rotation(&app, &settings, &receiver, &endpoint, postgres_insert(&admin)).await;
}

/// A database on `server` with `orders`, and a user of its own (password login) that may read it
/// (and, for a binary-log source, the log); the admin pool, the database's name and the user.
async fn mariadb_for_tokens(server: &crate::services::MariaDb, binlog: bool) -> (sqlx::MySqlPool, String, String) {
    let admin_url = server.fresh_database().await;
    let admin = sqlx::MySqlPool::connect(&admin_url).await.unwrap();
    let database = admin_url.rsplit('/').next().unwrap().to_string();
    let user = format!("entra_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut statements = vec![
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT, version BIGINT NOT NULL, INDEX orders_seek (version, id))"
            .to_string(),
        format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'not-yet-a-token'"),
        format!("GRANT SELECT ON {database}.* TO '{user}'@'%'"),
    ];
    if binlog {
        statements.push(format!("GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO '{user}'@'%'"));
    }
    for statement in statements {
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&admin).await.unwrap();
    }
    (admin, database, user)
}

/// Each token the endpoint issues becomes `user`'s password, and the user's sessions end.
fn mariadb_rotation(admin: &sqlx::MySqlPool, user: &str) -> OnIssue {
    let (rotate_pool, rotate_user) = (admin.clone(), user.to_string());
    Arc::new(move |token: String| {
        let (pool, user) = (rotate_pool.clone(), rotate_user.clone());
        Box::pin(async move {
            sqlx::query(sqlx::AssertSqlSafe(format!("ALTER USER '{user}'@'%' IDENTIFIED BY '{token}'")))
                .execute(&pool)
                .await
                .unwrap();
            let sessions: Vec<i64> = sqlx::query_scalar("SELECT ID FROM information_schema.PROCESSLIST WHERE USER = ?")
                .bind(&user)
                .fetch_all(&pool)
                .await
                .unwrap();
            for session in sessions {
                let _ = sqlx::query(sqlx::AssertSqlSafe(format!("KILL {session}"))).execute(&pool).await;
            }
        })
    })
}

fn mariadb_insert(
    admin: &sqlx::MySqlPool,
) -> impl Fn(std::ops::RangeInclusive<i64>) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>> {
    let admin = admin.clone();
    move |ids: std::ops::RangeInclusive<i64>| {
        let pool = admin.clone();
        Box::pin(async move {
            for id in ids {
                sqlx::query("INSERT INTO orders (id, note, version) VALUES (?, ?, ?)")
                    .bind(id)
                    .bind(format!("order {id}"))
                    .bind(id)
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }) as std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_poller_logs_in_with_the_managed_identity_token_through_a_rotation() {
    let directory = tempfile::tempdir().unwrap();
    let server = crate::services::mariadb();
    let (admin, database, user) = mariadb_for_tokens(server, false).await;
    let endpoint = IdentityEndpoint::start(LIVE, Some(mariadb_rotation(&admin, &user))).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), poller(polling()));
    let url = format!("mysql://{user}@127.0.0.1:{}/{database}", server.port);
    // A user-assigned identity: its client id goes to the endpoint.
    let mut settings = settings(&app, &url, &receiver, &endpoint);
    settings.push(("ORDERS_DB__clientId".to_string(), "0b8e3c51-5f8a-4b7e-9d2c-000000c11e57".to_string()));
    deliver_through_rotation(&app, &settings, &receiver, &endpoint, mariadb_insert(&admin)).await;
    let asked = endpoint.asked();
    assert!(
        asked.iter().all(|asked| asked.client_id.as_deref() == Some("0b8e3c51-5f8a-4b7e-9d2c-000000c11e57")),
        "{asked:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binlog_poller_logs_in_with_the_managed_identity_token_through_a_rotation() {
    let directory = tempfile::tempdir().unwrap();
    let server = crate::services::mariadb_binlog();
    let (admin, database, user) = mariadb_for_tokens(server, true).await;
    let endpoint = IdentityEndpoint::start(LIVE, Some(mariadb_rotation(&admin, &user))).await;
    let receiver = Receiver::start().await;
    let source = json!({"kind": "binlog", "connection": "ORDERS_DB", "tables": [format!("{database}.orders")]});
    let app = AppRoot::write(directory.path(), poller(source));
    let url = format!("mysql://{user}@127.0.0.1:{}/{database}", server.port);
    let settings = settings(&app, &url, &receiver, &endpoint);
    deliver_through_rotation(&app, &settings, &receiver, &endpoint, mariadb_insert(&admin)).await;
}

/// `check` refuses what a managed-identity login cannot use, naming the setting and never the URL's
/// password: a password beside `__credential`, and a connection that may run in plaintext.
#[test]
fn check_refuses_a_password_beside_the_credential_and_a_plaintext_connection() {
    let directory = tempfile::tempdir().unwrap();
    let app = AppRoot::write(directory.path(), poller(polling()));
    let base = vec![
        ("ORDERS_DB__credential".to_string(), "managedidentity".to_string()),
        ("ORDERS_WEBHOOK".to_string(), "http://127.0.0.1:9/hook".to_string()),
        ("ORDERS_STATE".to_string(), format!("file:{}", app.state_dir.display())),
    ];
    let with_url = |url: &str| {
        let mut settings = base.clone();
        settings.push(("ORDERS_DB".to_string(), url.to_string()));
        settings
    };
    let (ok, stdout, stderr) = run_dbtrigger(
        &app,
        &with_url("postgres://reader:Pw-9f31c@db.example.com/shop?sslmode=verify-full"),
        &["check"],
    );
    assert!(!ok && stdout.contains("ORDERS_DB: the URL has a password"), "{stdout}{stderr}");
    assert!(!format!("{stdout}{stderr}").contains("Pw-9f31c"), "{stdout}{stderr}");
    let (ok, stdout, stderr) = run_dbtrigger(&app, &with_url("mysql://reader@db.example.com/shop"), &["check"]);
    assert!(
        !ok && stdout.contains("may run in plaintext") && stdout.contains("ORDERS_DB__credential"),
        "{stdout}{stderr}"
    );
    let (ok, stdout, stderr) =
        run_dbtrigger(&app, &with_url("mysql://reader@db.example.com/shop?ssl-mode=VERIFY_IDENTITY"), &["check"]);
    assert!(ok, "{stdout}{stderr}");
}
