//! Shared pieces: a recording HTTP receiver, SQLite tables, app roots, the handler binary.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use serde_json::{Value, json};
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

/// The peak resident memory (VmHWM) of a running process, in KiB: its own address space's high
/// water mark. Not `wait4`'s `ru_maxrss`, which also counts the spawning process's resident memory
/// (the kernel folds the parent's address space into the child's maximum at its exec: a
/// `/bin/true` spawned by a 600 MB process reports 613 MB).
pub fn peak_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A free TCP port on loopback (bound, read, released).
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One POST the receiver got.
#[derive(Debug, Clone)]
pub struct Received {
    pub headers: HeaderMap,
    pub body: Bytes,
    pub envelope: Value,
    /// The status it answered.
    pub status: u16,
    /// When it arrived.
    pub at: Instant,
}

/// An answer the receiver is told to give.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: String,
    pub headers: Vec<(String, String)>,
}

#[derive(Default)]
struct ReceiverState {
    received: Vec<Received>,
    /// Statuses to answer next (then 200).
    planned: VecDeque<Answer>,
    /// How long to wait before answering each delivery.
    delay: Duration,
    /// Requests being answered right now, and the most there ever were at once.
    concurrent: usize,
    max_concurrent: usize,
}

/// An HTTP receiver on loopback that records every delivery and answers what it is told.
#[derive(Clone)]
pub struct Receiver {
    state: Arc<Mutex<ReceiverState>>,
    pub url: String,
}

async fn record(
    State(state): State<Arc<Mutex<ReceiverState>>>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, HeaderMap, String) {
    let at = Instant::now();
    let envelope: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let delay = {
        let mut state = state.lock().unwrap();
        state.concurrent += 1;
        state.max_concurrent = state.max_concurrent.max(state.concurrent);
        state.delay
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut state = state.lock().unwrap();
    state.concurrent -= 1;
    let answer = state.planned.pop_front().unwrap_or(Answer {
        status: 200,
        body: "{\"ok\":true}".to_string(),
        headers: Vec::new(),
    });
    state.received.push(Received { headers, body, envelope, status: answer.status, at });
    let mut answer_headers = HeaderMap::new();
    for (name, value) in &answer.headers {
        answer_headers.insert(axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
    }
    (StatusCode::from_u16(answer.status).unwrap(), answer_headers, answer.body)
}

impl Receiver {
    pub async fn start() -> Receiver {
        let state = Arc::new(Mutex::new(ReceiverState::default()));
        let router = axum::Router::new().route("/hook", post(record)).with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await });
        Receiver { state, url }
    }

    /// The next delivery is answered with `status` and `body`.
    pub fn answer_next(&self, status: u16, body: &str) {
        self.answer_next_with(status, body, &[]);
    }

    /// The next delivery is answered with `status`, `body` and these headers.
    pub fn answer_next_with(&self, status: u16, body: &str, headers: &[(&str, &str)]) {
        let headers = headers.iter().map(|(name, value)| (name.to_string(), value.to_string())).collect();
        let answer = Answer { status, body: body.to_string(), headers };
        self.state.lock().unwrap().planned.push_back(answer);
    }

    /// Every later delivery is answered after `delay`.
    pub fn set_delay(&self, delay: Duration) {
        self.state.lock().unwrap().delay = delay;
    }

    /// The most deliveries it was answering at one time.
    pub fn max_concurrent(&self) -> usize {
        self.state.lock().unwrap().max_concurrent
    }

    pub fn all(&self) -> Vec<Received> {
        self.state.lock().unwrap().received.clone()
    }

    /// Deliveries it acknowledged (2xx).
    pub fn acknowledged(&self) -> Vec<Received> {
        self.all().into_iter().filter(|received| (200..300).contains(&received.status)).collect()
    }

    /// The `id` of every event in acknowledged deliveries, in arrival order.
    pub fn acknowledged_ids(&self) -> Vec<i64> {
        let mut ids = Vec::new();
        for received in self.acknowledged() {
            for event in received.envelope["events"].as_array().unwrap() {
                ids.push(event["pk"]["id"].as_i64().unwrap());
            }
        }
        ids
    }
}

/// A SQLite database file with `orders(id, note, version)`: integer cursor `version`, pk `id`.
pub struct Orders {
    pub path: PathBuf,
    pub pool: SqlitePool,
}

impl Orders {
    pub async fn create(directory: &Path) -> Orders {
        let path = directory.join("orders.db");
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(SqliteConnectOptions::new().filename(&path).create_if_missing(true))
            .await
            .unwrap();
        sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, note TEXT, version INTEGER NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("CREATE INDEX orders_seek ON orders (version, id)").execute(&pool).await.unwrap();
        Orders { path, pool }
    }

    /// Inserts rows `ids`, with `version = id / versions_per_value` so that several rows share a
    /// cursor value and batch boundaries split them.
    pub async fn insert(&self, ids: std::ops::RangeInclusive<i64>, rows_per_version: i64) {
        let mut transaction = self.pool.begin().await.unwrap();
        for id in ids {
            sqlx::query("INSERT INTO orders (id, note, version) VALUES (?, ?, ?)")
                .bind(id)
                .bind(format!("order {id}"))
                .bind(id / rows_per_version)
                .execute(&mut *transaction)
                .await
                .unwrap();
        }
        transaction.commit().await.unwrap();
    }

    pub fn url(&self) -> String {
        format!("sqlite://{}", self.path.display())
    }
}

/// A function app root with one poller `orders` reading the `orders` table into a webhook.
pub struct AppRoot {
    pub root: PathBuf,
    pub state_dir: PathBuf,
    /// Unique per app root, so that apps sharing one Azurite never share state.
    pub app_name: String,
    /// The value of the ORDERS_STATE setting: a Storage connection string, or `None` for the file store.
    pub azure_state: Option<String>,
}

impl AppRoot {
    pub fn write(directory: &Path, poller: Value) -> AppRoot {
        // Every fixture a test starts from is a function.json an editor would accept (issue 28);
        // a test of a broken one writes it with `write_invalid`.
        crate::schema::assert_valid_function_json(&AppRoot::function_json(poller.clone()));
        AppRoot::write_invalid(directory, poller)
    }

    fn function_json(poller: Value) -> Value {
        json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
            "poller": poller
        })
    }

    /// Writes the `orders` function.json without checking it against the schema: for the tests of
    /// what the loader does with a broken one.
    pub fn write_invalid(directory: &Path, poller: Value) -> AppRoot {
        let function = AppRoot::function_json(poller);
        let root = directory.join("app");
        std::fs::create_dir_all(root.join("orders")).unwrap();
        std::fs::write(
            root.join("host.json"),
            serde_json::to_vec(&json!({
                "version": "2.0", "functionTimeout": "00:10:00",
                "customHandler": {"description": {"defaultExecutablePath": "dbtrigger", "arguments": ["serve"]}}
            }))
            .unwrap(),
        )
        .unwrap();
        std::fs::write(root.join("orders/function.json"), serde_json::to_vec_pretty(&function).unwrap()).unwrap();
        AppRoot {
            root,
            state_dir: directory.join("state"),
            app_name: format!("it-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
            azure_state: None,
        }
    }

    /// Keeps the state in Azure Blob Storage through this connection string.
    pub fn with_azure_state(mut self, connection_string: &str) -> AppRoot {
        self.azure_state = Some(connection_string.to_string());
        self
    }

    /// The usual poller section: integer cursor, batches of `size`.
    pub fn orders_poller(size: usize) -> Value {
        json!({
            "source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]},
            "batch": {"size": size},
            "sink": {"type": "webhook", "url": "%ORDERS_WEBHOOK%", "timeoutSeconds": 5},
            "state": {"connection": "ORDERS_STATE"}
        })
    }

    pub fn settings(&self, orders: &Orders, receiver: &Receiver) -> Vec<(String, String)> {
        vec![
            ("ORDERS_DB".to_string(), orders.url()),
            ("ORDERS_WEBHOOK".to_string(), receiver.url.clone()),
            (
                "ORDERS_STATE".to_string(),
                self.azure_state.clone().unwrap_or_else(|| format!("file:{}", self.state_dir.display())),
            ),
            ("DBTRIGGER_APP_NAME".to_string(), self.app_name.clone()),
        ]
    }

    /// The stored bytes of `poller`'s state document, exactly.
    pub async fn state_bytes(&self, poller: &str) -> Option<Vec<u8>> {
        use dbtrigger::store::BlobStore as _;
        let key = dbtrigger::store::StateKey::new(&self.app_name, poller);
        match &self.azure_state {
            None => std::fs::read(self.state_dir.join(key.blob_path())).ok(),
            Some(_) => self.azure_blobs().get(&key.blob_path()).await.unwrap().map(|blob| blob.bytes),
        }
    }

    /// Overwrites `poller`'s state document with `document`, as a person editing the blob would.
    pub async fn put_state_document(&self, poller: &str, document: &Value) {
        use dbtrigger::store::BlobStore as _;
        let key = dbtrigger::store::StateKey::new(&self.app_name, poller);
        let bytes = serde_json::to_vec_pretty(document).unwrap();
        match &self.azure_state {
            None => std::fs::write(self.state_dir.join(key.blob_path()), bytes).unwrap(),
            Some(_) => {
                self.azure_blobs().put(&key.blob_path(), bytes, dbtrigger::store::PutMode::Overwrite).await.unwrap();
            }
        }
    }

    fn azure_blobs(&self) -> dbtrigger::store::azure_blob::AzureBlobStore {
        let connection_string = self.azure_state.as_ref().expect("an Azure state");
        let connection = dbtrigger::azure::StorageConnection::parse_connection_string(connection_string).unwrap();
        dbtrigger::store::azure_blob::AzureBlobStore::new(&connection, "db-state").unwrap()
    }

    /// The state document of `orders`, as the store holds it.
    pub async fn state_document(&self) -> Option<Value> {
        use dbtrigger::store::StateStore as _;
        let key = dbtrigger::store::StateKey::new(&self.app_name, "orders");
        match &self.azure_state {
            None => {
                let path = self.state_dir.join(key.blob_path());
                std::fs::read(path).ok().map(|bytes| serde_json::from_slice(&bytes).unwrap())
            }
            Some(_) => {
                let read = self.azure_blobs().read(&key).await.unwrap()?;
                Some(serde_json::to_value(&read.document).unwrap())
            }
        }
    }
}

/// Runs `processes` `dbtrigger tick orders` processes at once, round after round, until a whole
/// round finds nothing new (at most `rounds`). Returns every line they printed.
pub async fn race_tick_processes(
    app: &AppRoot,
    settings: &[(String, String)],
    processes: usize,
    rounds: usize,
) -> Vec<String> {
    let mut outputs = Vec::new();
    for _round in 0..rounds {
        let mut children = Vec::new();
        for _ in 0..processes {
            let child = Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
                .args(["tick", "orders", "--app-root"])
                .arg(&app.root)
                .envs(settings.iter().map(|(key, value)| (key.as_str(), value.as_str())))
                .env("RUST_LOG", "warn")
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            children.push(child);
        }
        let mut round = Vec::new();
        for child in children {
            let output = tokio::task::spawn_blocking(move || child.wait_with_output()).await.unwrap().unwrap();
            let text = String::from_utf8_lossy(&output.stdout).to_string();
            assert!(output.status.success(), "a tick failed: {text}");
            round.push(text);
        }
        let done = round.iter().all(|line| line.contains("nothing new"));
        outputs.extend(round);
        if done {
            return outputs;
        }
    }
    panic!("the processes did not catch up in {rounds} rounds: {outputs:?}");
}

/// Runs the real binary with `arguments` and `--app-root`, the given settings as its environment
/// and no terminal: returns (success, stdout, stderr).
pub fn run_dbtrigger(app: &AppRoot, settings: &[(String, String)], arguments: &[&str]) -> (bool, String, String) {
    output_of(&mut dbtrigger_command(app, settings, arguments))
}

/// The real binary with `arguments` and `--app-root`, the given settings as its environment and
/// no terminal, ready to run (a caller may change its environment first).
pub fn dbtrigger_command(app: &AppRoot, settings: &[(String, String)], arguments: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_dbtrigger"));
    command
        .args(arguments)
        .arg("--app-root")
        .arg(&app.root)
        .envs(settings.iter().map(|(key, value)| (key.as_str(), value.as_str())))
        .env_remove("FUNCTIONS_APP_ROOT_PATH")
        .stdin(Stdio::null());
    command
}

/// Runs `command` to its end: (success, stdout, stderr).
pub fn output_of(command: &mut Command) -> (bool, String, String) {
    let output = command.output().unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The real binary, started the way the Functions host starts a custom handler.
pub struct Handler {
    child: Child,
    pub base_url: String,
    /// Where its stdout goes; its stderr goes beside it (`.err`): the host gives each stream its
    /// own severity.
    pub log_path: PathBuf,
    err_path: PathBuf,
}

impl Handler {
    pub async fn start(app: &AppRoot, settings: &[(String, String)]) -> Handler {
        Handler::start_binary(Path::new(env!("CARGO_BIN_EXE_dbtrigger")), &app.root, settings).await
    }

    /// Starts `binary` as the host would, in `app_root` (an unpacked zip, say).
    pub async fn start_binary(binary: &Path, app_root: &Path, settings: &[(String, String)]) -> Handler {
        Handler::start_with(binary, app_root, settings, &[]).await
    }

    /// Starts the real binary with `arguments` after `serve`.
    pub async fn start_with_arguments(app: &AppRoot, settings: &[(String, String)], arguments: &[&str]) -> Handler {
        Handler::start_with(Path::new(env!("CARGO_BIN_EXE_dbtrigger")), &app.root, settings, arguments).await
    }

    async fn start_with(binary: &Path, app_root: &Path, settings: &[(String, String)], arguments: &[&str]) -> Handler {
        let port = free_port();
        let log_path = app_root.join("handler.log");
        let err_path = app_root.join("handler.err");
        let log = std::fs::File::create(&log_path).unwrap();
        let err = std::fs::File::create(&err_path).unwrap();
        let child = Command::new(binary)
            .arg("serve")
            .args(arguments)
            .current_dir(app_root)
            .env("FUNCTIONS_CUSTOMHANDLER_PORT", port.to_string())
            .env("FUNCTIONS_APP_ROOT_PATH", app_root)
            .env("FUNCTIONS_CUSTOMHANDLER_WORKER_ID", uuid::Uuid::new_v4().to_string())
            .envs(settings.iter().map(|(key, value)| (key.as_str(), value.as_str())))
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(err))
            .spawn()
            .expect("the dbtrigger binary starts");
        let handler = Handler { child, base_url: format!("http://127.0.0.1:{port}"), log_path, err_path };
        handler.wait_ready().await;
        handler
    }

    /// Polls `GET /` like the host, every 25 ms, until it answers.
    async fn wait_ready(&self) {
        let client = reqwest::Client::new();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            if let Ok(response) = client.get(format!("{}/", self.base_url)).send().await {
                assert_eq!(response.status(), 200);
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("the handler did not answer GET / within 30 s; log:\n{}", self.log());
    }

    /// Both streams (stdout, then stderr).
    pub fn log(&self) -> String {
        format!("{}{}", self.stdout(), self.stderr())
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err_path).unwrap_or_default()
    }

    /// Sends `signal` (libc's number) and waits up to `within` for the process to exit: its exit
    /// code, `None` if it did not exit (then it is killed).
    pub fn signal_and_wait(&mut self, signal: i32, within: Duration) -> Option<i32> {
        unsafe {
            libc::kill(self.child.id() as i32, signal);
        }
        let started = Instant::now();
        while started.elapsed() < within {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// POSTs a body to `/{function}` as the host does: its headers, and the body with
    /// `Transfer-Encoding: chunked` and no `Content-Length` (the host's `ObjectContent`), in a few
    /// chunks. Returns status, content type, JSON body.
    pub async fn invoke(&self, function: &str, body: &str) -> (u16, String, Value) {
        self.invoke_as(function, body, &uuid::Uuid::new_v4().to_string()).await
    }

    /// [`Handler::invoke`] with the invocation id the host sends in `X-Azure-Functions-InvocationId`.
    pub async fn invoke_as(&self, function: &str, body: &str, invocation_id: &str) -> (u16, String, Value) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let address = self.base_url.trim_start_matches("http://");
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let mut request = format!(
            "POST /{function} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json; charset=utf-8\r\n\
             X-Azure-Functions-InvocationId: {}\r\nX-Azure-Functions-HostVersion: 4.1036.1.23224\r\n\
             User-Agent: Azure-Functions-Host/4.1036.1.23224\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
            invocation_id
        )
        .into_bytes();
        for chunk in body.as_bytes().chunks(97) {
            request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
            request.extend_from_slice(chunk);
            request.extend_from_slice(b"\r\n");
        }
        request.extend_from_slice(b"0\r\n\r\n");
        stream.write_all(&request).await.unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let (head, text) = answer.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP answer: {answer:?}"));
        let status: u16 = head.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap();
        let mut content_type = String::new();
        for line in head.lines().skip(1) {
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("content-type") {
                    content_type = value.trim().to_string();
                }
                assert!(!name.eq_ignore_ascii_case("transfer-encoding"), "a JSON answer has a length: {head}");
            }
        }
        let json = serde_json::from_str(text).unwrap_or_else(|_| panic!("the handler answered non-JSON: {text:?}"));
        (status, content_type, json)
    }
}

impl Drop for Handler {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The timer payloads the host sends (see the host protocol reference and src/protocol.rs).
pub fn host_fixtures() -> Vec<(&'static str, &'static str)> {
    vec![
        ("timer_first_run", include_str!("../fixtures/host/timer_first_run.json")),
        ("timer_no_monitor", include_str!("../fixtures/host/timer_no_monitor.json")),
        ("timer_normal", include_str!("../fixtures/host/timer_normal.json")),
        ("timer_past_due", include_str!("../fixtures/host/timer_past_due.json")),
        ("timer_first_run_offset", include_str!("../fixtures/host/timer_first_run_offset.json")),
        ("timer_overrun", include_str!("../fixtures/host/timer_overrun.json")),
        ("timer_retry", include_str!("../fixtures/host/timer_retry.json")),
    ]
}

/// What a [`FaultyStore`] does with a write.
pub enum Fault {
    /// Pass it through.
    None,
    /// Refuse it without writing.
    Refuse(dbtrigger::store::StoreError),
    /// Write it, then answer this error (a response lost after the write landed).
    LandThenAnswer(dbtrigger::store::StoreError),
}

/// Decides what goes wrong with write number n (from 1).
type FaultRule = Box<dyn Fn(u32, &dbtrigger::store::WriteCondition) -> Fault + Send + Sync>;

/// A state store over `inner` that counts writes and lets a rule decide, for each one (numbered
/// from 1), what goes wrong. Reads pass through.
pub struct FaultyStore<S> {
    pub inner: Arc<S>,
    writes: Mutex<u32>,
    rule: FaultRule,
}

impl<S> FaultyStore<S> {
    pub fn over(
        inner: Arc<S>,
        rule: impl Fn(u32, &dbtrigger::store::WriteCondition) -> Fault + Send + Sync + 'static,
    ) -> FaultyStore<S> {
        FaultyStore { inner, writes: Mutex::new(0), rule: Box::new(rule) }
    }

    pub fn writes(&self) -> u32 {
        *self.writes.lock().unwrap()
    }
}

#[async_trait::async_trait]
impl<S: dbtrigger::store::StateStore + 'static> dbtrigger::store::StateStore for FaultyStore<S> {
    async fn read(
        &self,
        key: &dbtrigger::store::StateKey,
    ) -> Result<Option<dbtrigger::store::Versioned>, dbtrigger::store::StoreError> {
        self.inner.read(key).await
    }

    async fn write(
        &self,
        key: &dbtrigger::store::StateKey,
        document: &dbtrigger::domain::StateDocument,
        condition: dbtrigger::store::WriteCondition,
    ) -> Result<dbtrigger::store::ETag, dbtrigger::store::StoreError> {
        let number = {
            let mut writes = self.writes.lock().unwrap();
            *writes += 1;
            *writes
        };
        match (self.rule)(number, &condition) {
            Fault::None => self.inner.write(key, document, condition).await,
            Fault::Refuse(error) => Err(error),
            Fault::LandThenAnswer(error) => {
                self.inner.write(key, document, condition).await?;
                Err(error)
            }
        }
    }

    fn describe(&self) -> String {
        format!("faulty {}", self.inner.describe())
    }
}
