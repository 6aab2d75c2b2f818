//! Real database servers for the tests: PostgreSQL and MariaDB, each started once per test binary
//! on a free loopback port under a temporary directory, and stopped when the binary exits. Each
//! test gets a fresh database. A missing server is an error that says how to install it, never a
//! skipped test. Also the counting webhook receiver the memory test and the throughput bench use.

#![allow(dead_code)]

// Shared with the benches (seek, throughput), so it depends on nothing else in tests/.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// What the counting receiver has received: events and body bytes.
#[derive(Default)]
pub struct Received {
    pub events: AtomicU64,
    pub bytes: AtomicU64,
}

/// A webhook receiver at `/hook` that only counts the events and bytes of each body (it keeps
/// nothing, so it holds no memory of its own), with no body size limit; the counts are shared.
pub fn counting_receiver() -> (axum::Router, Arc<Received>) {
    let received = Arc::new(Received::default());
    let counter = received.clone();
    let router = axum::Router::new()
        .route(
            "/hook",
            axum::routing::post(move |body: axum::body::Bytes| {
                let counter = counter.clone();
                async move {
                    let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                    let events = value["events"].as_array().map(Vec::len).unwrap_or(0) as u64;
                    counter.bytes.fetch_add(body.len() as u64, Ordering::SeqCst);
                    counter.events.fetch_add(events, Ordering::SeqCst);
                    "{}"
                }
            }),
        )
        .layer(axum::extract::DefaultBodyLimit::disable());
    (router, received)
}

/// A free TCP port on loopback (bound, read, released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Commands to run when the test binary exits (stopping servers).
static AT_EXIT: Mutex<Vec<Box<dyn FnOnce() + Send>>> = Mutex::new(Vec::new());

extern "C" fn run_at_exit() {
    let actions: Vec<_> = std::mem::take(&mut *AT_EXIT.lock().unwrap_or_else(|poison| poison.into_inner()));
    for action in actions {
        action();
    }
}

fn at_exit(action: impl FnOnce() + Send + 'static) {
    static REGISTERED: OnceLock<()> = OnceLock::new();
    REGISTERED.get_or_init(|| unsafe {
        libc::atexit(run_at_exit);
    });
    AT_EXIT.lock().unwrap().push(Box::new(action));
}

pub fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

/// Finds a server program on PATH or in Debian's versioned directories.
fn find_program(name: &str, debian_dirs: &[&str]) -> Option<PathBuf> {
    if let Ok(path) = std::env::var("PATH") {
        for directory in std::env::split_paths(&path) {
            let candidate = directory.join(name);
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    for pattern in debian_dirs {
        let Ok(entries) = std::fs::read_dir(pattern) else {
            continue;
        };
        let mut versions: Vec<PathBuf> = entries.flatten().map(|entry| entry.path()).collect();
        versions.sort();
        for version in versions.iter().rev() {
            let candidate = version.join("bin").join(name);
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    None
}

pub fn run(command: &mut Command, what: &str) {
    let output = command.output().unwrap_or_else(|error| panic!("{what}: cannot run: {error}"));
    assert!(
        output.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn wait_for_port(port: u16, what: &str, log: &Path) {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(60) {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "{what} did not listen on port {port} within 60 s; log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// Kills `child` and removes `directory` when the test binary exits.
fn stop_at_exit(child: Child, directory: PathBuf) {
    let child = Mutex::new(child);
    at_exit(move || {
        let mut child = child.lock().unwrap_or_else(|poison| poison.into_inner());
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&directory);
    });
}

pub struct Postgres {
    pub port: u16,
    pub directory: PathBuf,
    /// The programs it was started with (a standby of it uses the same).
    pub programs: PostgresPrograms,
}

/// The server's programs (initdb's directory) and how to run one as the server's user.
#[derive(Clone)]
pub struct PostgresPrograms {
    initdb: PathBuf,
}

impl PostgresPrograms {
    fn find() -> PostgresPrograms {
        let initdb = find_program("initdb", &["/usr/lib/postgresql"])
            .expect("PostgreSQL is not installed (initdb not found): run scripts/test, which installs it");
        PostgresPrograms { initdb }
    }

    /// The programs of the directory `bin` (which must hold initdb, pg_ctl and postgres).
    pub fn in_directory(bin: &Path) -> PostgresPrograms {
        for program in ["initdb", "pg_ctl", "postgres"] {
            assert!(
                bin.join(program).is_file(),
                "{} is missing: run scripts/test, which installs the PostgreSQL servers the tests use",
                bin.join(program).display()
            );
        }
        PostgresPrograms { initdb: bin.join("initdb") }
    }

    /// A program beside initdb (or beside the file initdb links to: PATH may hold a few links).
    pub fn program(&self, name: &str) -> PathBuf {
        let beside = self.initdb.with_file_name(name);
        if beside.is_file() {
            return beside;
        }
        std::fs::canonicalize(&self.initdb).map(|real| real.with_file_name(name)).unwrap_or(beside)
    }

    /// `program arguments`, as the `postgres` user when running as root (initdb refuses root).
    pub fn as_server_user(&self, program: &Path, arguments: &str) -> Command {
        if is_root() {
            let mut command = Command::new("su");
            command.args(["postgres", "-s", "/bin/sh", "-c", &format!("{} {arguments}", program.display())]);
            command
        } else {
            let mut command = Command::new("/bin/sh");
            command.args(["-c", &format!("{} {arguments}", program.display())]);
            command
        }
    }
}

/// The shared PostgreSQL server, started on first use.
pub fn postgres() -> &'static Postgres {
    static SERVER: OnceLock<Postgres> = OnceLock::new();
    SERVER.get_or_init(|| start_postgres(200))
}

/// A PostgreSQL server of its own, accepting at most `max_connections` (stopped at exit).
pub fn postgres_with_max_connections(max_connections: u32) -> Postgres {
    start_postgres(max_connections)
}

/// A PostgreSQL server of its own with these `-c name=value` settings beside the usual ones
/// (`max_prepared_transactions`, say), stopped at exit.
pub fn postgres_with_settings(settings: &[(&str, &str)]) -> Postgres {
    let extra: Vec<String> = settings.iter().map(|(name, value)| format!("-c {name}={value}")).collect();
    start_postgres_with(200, &extra.join(" "))
}

fn start_postgres(max_connections: u32) -> Postgres {
    start_postgres_with(max_connections, "")
}

fn start_postgres_with(max_connections: u32, extra_settings: &str) -> Postgres {
    start_postgres_of(&PostgresPrograms::find(), max_connections, extra_settings)
}

/// A server of its own started with `programs` (a given PostgreSQL major), stopped at exit.
pub fn start_postgres_of(programs: &PostgresPrograms, max_connections: u32, extra_settings: &str) -> Postgres {
    let directory = std::env::temp_dir().join(format!("dbtrigger-pg-{}", uuid::Uuid::new_v4().simple()));
    let data = directory.join("data");
    std::fs::create_dir_all(&directory).unwrap();
    if is_root() {
        run(Command::new("chown").args(["-R", "postgres"]).arg(&directory), "chown for postgres");
    }
    run(
        &mut programs
            .as_server_user(&programs.initdb, &format!("-D {} -U postgres -A trust --no-sync -E UTF8", data.display())),
        "initdb",
    );
    start_postgres_data(programs, directory, max_connections, extra_settings)
}

/// Starts the server whose data directory is `directory/data` on a free port.
pub fn start_postgres_data(
    programs: &PostgresPrograms,
    directory: PathBuf,
    max_connections: u32,
    extra_settings: &str,
) -> Postgres {
    let pg_ctl = programs.program("pg_ctl");
    let data = directory.join("data");
    let port = free_port();
    let log = directory.join("server.log");
    run(
        &mut programs.as_server_user(
            &pg_ctl,
            &format!(
                "-D {} -l {} -w -t 60 -o \"-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections={max_connections} -c wal_level=logical -c max_replication_slots=64 -c max_wal_senders=64 {extra_settings}\" start",
                data.display(),
                log.display(),
                directory.display()
            ),
        ),
        "pg_ctl start",
    );
    wait_for_port(port, "PostgreSQL", &log);
    let stop_command = programs.as_server_user(&pg_ctl, &format!("-D {} -m immediate stop", data.display()));
    let stop_directory = directory.clone();
    let stop = Mutex::new(stop_command);
    at_exit(move || {
        let _ = stop.lock().unwrap().stdout(Stdio::null()).stderr(Stdio::null()).status();
        let _ = std::fs::remove_dir_all(&stop_directory);
    });
    Postgres { port, directory, programs: programs.clone() }
}

/// A hot standby of `primary` (a server of its own: `pg_basebackup -R` into a temporary
/// directory, started on a free port, streaming from the primary), stopped at exit.
pub fn hot_standby_of(primary: &Postgres) -> Postgres {
    let programs = primary.programs.clone();
    let directory = std::env::temp_dir().join(format!("dbtrigger-pg-standby-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&directory).unwrap();
    if is_root() {
        run(Command::new("chown").args(["-R", "postgres"]).arg(&directory), "chown for postgres");
    }
    run(
        &mut programs.as_server_user(
            &programs.program("pg_basebackup"),
            &format!(
                "-h 127.0.0.1 -p {} -U postgres -D {} -R -X stream -c fast --no-sync",
                primary.port,
                directory.join("data").display()
            ),
        ),
        "pg_basebackup",
    );
    start_postgres_data(&programs, directory, 200, "-c hot_standby=on")
}

impl Postgres {
    /// Stops the server now (`pg_ctl stop -m fast`: its sessions are ended, its WAL flushed).
    pub fn stop(&self) {
        let pg_ctl = self.programs.program("pg_ctl");
        run(
            &mut self
                .programs
                .as_server_user(&pg_ctl, &format!("-D {} -m fast -w stop", self.directory.join("data").display())),
            "pg_ctl stop",
        );
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// A new, empty database for one test.
    pub async fn fresh_database(&self) -> String {
        let name = format!("t_{}", uuid::Uuid::new_v4().simple());
        let pool = sqlx::PgPool::connect(&self.url("postgres")).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&pool).await.unwrap();
        pool.close().await;
        self.url(&name)
    }
}

pub struct MariaDb {
    pub port: u16,
    directory: PathBuf,
}

/// How to start a MariaDB server of its own beside the usual options.
#[derive(Default)]
pub struct MariaDbOptions<'a> {
    /// More `--name=value` options (`--log-bin`, `--server-id=2`, `--read-only`…).
    pub arguments: &'a [&'a str],
    /// The server's system time zone (`TZ`), e.g. `Europe/Paris`; the machine's when `None`.
    pub system_time_zone: Option<&'a str>,
}

/// The shared MariaDB server, started on first use.
pub fn mariadb() -> &'static MariaDb {
    static SERVER: OnceLock<MariaDb> = OnceLock::new();
    SERVER.get_or_init(|| start_mariadb(300))
}

/// The options a binary-log source needs (issue 39): ROW events with full images and column
/// names, a server id of the server's own.
pub const BINLOG_ARGUMENTS: &[&str] = &[
    "--log-bin=binlog",
    "--binlog-format=ROW",
    "--binlog-row-image=FULL",
    "--binlog-row-metadata=FULL",
    "--server-id=1",
];

/// The shared MariaDB server with its binary log on (the binary-log source's tests), started on
/// first use: each test reads the tables of its own database.
pub fn mariadb_binlog() -> &'static MariaDb {
    static SERVER: OnceLock<MariaDb> = OnceLock::new();
    SERVER.get_or_init(|| mariadb_with(&MariaDbOptions { arguments: BINLOG_ARGUMENTS, system_time_zone: None }))
}

/// A MariaDB server of its own, accepting at most `max_connections` (stopped at exit).
pub fn mariadb_with_max_connections(max_connections: u32) -> MariaDb {
    start_mariadb(max_connections)
}

/// A MariaDB server of its own started with `options` (stopped at exit).
pub fn mariadb_with(options: &MariaDbOptions<'_>) -> MariaDb {
    start_mariadb_with(300, options)
}

fn start_mariadb(max_connections: u32) -> MariaDb {
    start_mariadb_with(max_connections, &MariaDbOptions::default())
}

fn start_mariadb_with(max_connections: u32, options: &MariaDbOptions<'_>) -> MariaDb {
    let install = find_program("mariadb-install-db", &[])
        .expect("MariaDB is not installed (mariadb-install-db not found): run scripts/test, which installs it");
    let server = find_program("mariadbd", &[])
        .or_else(|| Some(PathBuf::from("/usr/sbin/mariadbd")).filter(|path| path.is_file()))
        .expect("MariaDB is not installed (mariadbd not found): run scripts/test, which installs it");
    let directory = std::env::temp_dir().join(format!("dbtrigger-maria-{}", uuid::Uuid::new_v4().simple()));
    let data = directory.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let tmp = directory.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let port = free_port();
    let log = directory.join("server.log");
    let mut install_command = Command::new(&install);
    install_command
        .arg(format!("--datadir={}", data.display()))
        .arg("--auth-root-authentication-method=normal")
        .arg("--skip-test-db")
        // Its bootstrap's temporary tables in a directory of its own: two servers installed at
        // once in the shared /tmp can collide on one (`Could not remove temporary table`, seen).
        .arg(format!("--tmpdir={}", tmp.display()));
    if is_root() {
        install_command.arg("--user=root");
    }
    run(&mut install_command, "mariadb-install-db");
    let mut server_command = Command::new(&server);
    server_command
        .arg("--no-defaults")
        .arg(format!("--datadir={}", data.display()))
        .arg(format!("--port={port}"))
        .arg("--bind-address=127.0.0.1")
        .arg(format!("--socket={}", directory.join("sock").display()))
        .arg(format!("--pid-file={}", directory.join("pid").display()))
        .arg("--skip-name-resolve")
        .arg("--innodb-flush-log-at-trx-commit=0")
        .arg(format!("--max-connections={max_connections}"))
        .args(options.arguments)
        .stdout(Stdio::from(std::fs::File::create(&log).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(directory.join("server.err")).unwrap()));
    if is_root() {
        server_command.arg("--user=root");
    }
    if let Some(zone) = options.system_time_zone {
        server_command.env("TZ", zone);
    }
    let child: Child = server_command.spawn().expect("mariadbd starts");
    stop_at_exit(child, directory.clone());
    wait_for_port(port, "MariaDB", &directory.join("server.err"));
    MariaDb { port, directory }
}

impl MariaDb {
    pub fn url(&self, database: &str) -> String {
        format!("mysql://root@127.0.0.1:{}/{database}", self.port)
    }

    /// A new, empty database for one test.
    pub async fn fresh_database(&self) -> String {
        let name = format!("t_{}", uuid::Uuid::new_v4().simple());
        let pool = sqlx::MySqlPool::connect(&self.url("mysql")).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&pool).await.unwrap();
        pool.close().await;
        self.url(&name)
    }
}

pub struct Azurite {
    pub blob_port: u16,
    pub queue_port: u16,
}

/// The shared Azurite (blob and queue), started on first use.
pub fn azurite() -> &'static Azurite {
    static SERVER: OnceLock<Azurite> = OnceLock::new();
    SERVER.get_or_init(start_azurite)
}

fn find_azurite() -> Option<PathBuf> {
    let local = Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/node_modules/.bin/azurite");
    if local.is_file() {
        return Some(local);
    }
    find_program("azurite", &[])
}

fn start_azurite() -> Azurite {
    let program = find_azurite().expect(
        "Azurite is not installed (.tools/node_modules/.bin/azurite): run scripts/test, which installs azurite@3.37.0",
    );
    let directory = std::env::temp_dir().join(format!("dbtrigger-azurite-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&directory).unwrap();
    let (blob_port, queue_port, table_port) = (free_port(), free_port(), free_port());
    let log = directory.join("azurite.log");
    let child = Command::new(program)
        .args(["--blobHost", "127.0.0.1", "--queueHost", "127.0.0.1", "--tableHost", "127.0.0.1"])
        .args(["--blobPort", &blob_port.to_string(), "--queuePort", &queue_port.to_string()])
        .args(["--tablePort", &table_port.to_string()])
        .arg("--location")
        .arg(&directory)
        .args(["--disableTelemetry", "--silent"])
        .stdout(Stdio::from(std::fs::File::create(&log).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(directory.join("azurite.err")).unwrap()))
        .spawn()
        .expect("azurite starts");
    stop_at_exit(child, directory.clone());
    wait_for_port(blob_port, "Azurite (blob)", &directory.join("azurite.err"));
    wait_for_port(queue_port, "Azurite (queue)", &directory.join("azurite.err"));
    Azurite { blob_port, queue_port }
}

impl Azurite {
    /// A full connection string with the well-known development account key.
    pub fn connection_string(&self) -> String {
        format!(
            "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={};\
             BlobEndpoint=http://127.0.0.1:{}/devstoreaccount1;QueueEndpoint=http://127.0.0.1:{}/devstoreaccount1;",
            "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==",
            self.blob_port,
            self.queue_port
        )
    }
}
