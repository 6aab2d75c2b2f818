//! `dbtrigger sql <poller>` for a logical source: the server setting, the publication, the slot,
//! the replica identity and the role's privilege it needs, printed for a person to review and
//! run (dbtrigger never runs it). Each statement can run twice.

use std::fmt::Write as _;

/// The set-up of a logical source; `user` is the role its URL connects as.
pub fn logical_ddl(poller: &str, slot: &str, publication: &str, user: Option<&str>) -> String {
    let quoted_publication = format!("\"{publication}\"");
    let mut out = String::new();
    let _ = writeln!(
        out,
        "-- dbtrigger sql {poller}: logical source, slot {slot}, publication {publication} (PostgreSQL)."
    );
    out.push_str(
        "-- Printed for a person to review and run: dbtrigger never runs it. Every statement can run twice.\n",
    );
    out.push_str(
        "-- Run the statements one by one, in this order (psql does): a slot cannot be created in a transaction\n\
         -- that has written, and the publication must exist before the slot decodes any change.\n\n",
    );
    out.push_str(
        "-- 1. The server decodes its WAL: wal_level = logical (takes a restart; on Azure Database for\n\
         --    PostgreSQL, the server parameter wal_level = LOGICAL). Bound the WAL one slot may hold\n\
         --    (PostgreSQL 13+): past it the server invalidates the slot instead of filling its disk.\n\
         ALTER SYSTEM SET wal_level = logical;\n\
         ALTER SYSTEM SET max_slot_wal_keep_size = '10GB';\n\n",
    );
    let _ = writeln!(
        out,
        "-- 2. The publication: the tables whose changes the poller delivers. Edit the list (here\n\
         --    public.orders) before running; add tables later with ALTER PUBLICATION {quoted_publication} ADD TABLE ….\n\
         DO $$\n\
         BEGIN\n\
         \x20 IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = '{publication}') THEN\n\
         \x20   CREATE PUBLICATION {quoted_publication} FOR TABLE public.orders;\n\
         \x20 END IF;\n\
         END\n\
         $$;\n"
    );
    let _ = writeln!(
        out,
        "-- 3. The slot (pgoutput). It keeps every change from now on; rows that exist before it are\n\
         --    not changes: see docs/logical.md, \"The first load\". On PostgreSQL 17 and later it is made a\n\
         --    failover slot (failover => true), which a standby with sync_replication_slots = on keeps a\n\
         --    copy of (see docs/logical-operations.md, \"A failover\"); with no such standby it changes nothing.\n\
         --    PostgreSQL 16 and earlier have no failover slots: there it is an ordinary slot.\n\
         DO $$\n\
         BEGIN\n\
         \x20 IF NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = '{slot}') THEN\n\
         \x20   IF current_setting('server_version_num')::int >= 170000 THEN\n\
         \x20     -- temporary false, twophase false, failover true\n\
         \x20     PERFORM pg_create_logical_replication_slot('{slot}', 'pgoutput', false, false, true);\n\
         \x20   ELSE\n\
         \x20     PERFORM pg_create_logical_replication_slot('{slot}', 'pgoutput');\n\
         \x20   END IF;\n\
         \x20 END IF;\n\
         END\n\
         $$;\n"
    );
    out.push_str(
        "-- 4. Replica identity: an update or delete names the old row by the primary key. A table\n\
         --    without one has no old key (PostgreSQL then refuses its updates and deletes while it is\n\
         --    published); FULL sends the whole old row, at the cost of WAL:\n\
         -- ALTER TABLE public.orders REPLICA IDENTITY FULL;\n\n",
    );
    let role = user.map(|user| format!("\"{user}\"")).unwrap_or_else(|| "the_poller_role".to_string());
    let _ = writeln!(
        out,
        "-- 5. The poller's role reads and moves the slot: it needs REPLICATION (on Azure Database for\n\
         --    PostgreSQL, granted by the admin role; or use a member of azure_pg_admin).\n\
         ALTER ROLE {role} WITH REPLICATION;"
    );
    out
}

/// What `check` asks a live server, and what each answer means.
pub struct Finding {
    pub ok: bool,
    pub what: String,
}

/// The checks of a logical source on a live server: `wal_level`, the slot (its plugin, whether
/// another process holds it, whether the server invalidated it), the publication and its tables
/// (each with a replica identity), the role's privilege, and (for `source.origin: "none"`) that the
/// server has pgoutput's origin option.
pub async fn check(
    url: &str,
    slot: &str,
    publication: &str,
    origin: crate::config::Origin,
) -> Result<Vec<Finding>, String> {
    use sqlx::Row;
    let pool = sqlx::PgPool::connect(url)
        .await
        .map_err(|error| crate::config::redact::Redaction::of_url(url).scrub(&error.to_string()))?;
    let scrub = |error: sqlx::Error| crate::config::redact::Redaction::of_url(url).scrub(&error.to_string());
    let mut findings = Vec::new();
    let wal_level: String = sqlx::query_scalar("SHOW wal_level").fetch_one(&pool).await.map_err(scrub)?;
    findings.push(Finding {
        ok: wal_level == "logical",
        what: format!(
            "wal_level is {wal_level} (logical needed: ALTER SYSTEM SET wal_level = logical, then a restart)"
        ),
    });
    let row = sqlx::query(
        "SELECT plugin::text, active_pid, wal_status, \
         pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint AS retained \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(&pool)
    .await
    .map_err(scrub)?;
    match row {
        None => findings
            .push(Finding { ok: false, what: format!("slot {slot} does not exist (`dbtrigger sql` prints it)") }),
        Some(row) => {
            let plugin: Option<String> = row.try_get(0).map_err(scrub)?;
            let pid: Option<i32> = row.try_get(1).map_err(scrub)?;
            let wal_status: Option<String> = row.try_get(2).map_err(scrub)?;
            let retained: Option<i64> = row.try_get(3).map_err(scrub)?;
            findings.push(Finding {
                ok: plugin.as_deref() == Some("pgoutput"),
                what: format!("slot {slot} uses plugin {}", plugin.as_deref().unwrap_or("none (a physical slot)")),
            });
            findings.push(Finding {
                ok: wal_status.as_deref() != Some("lost"),
                what: format!(
                    "slot {slot}: wal_status {}, {} bytes of WAL retained",
                    wal_status.as_deref().unwrap_or("unknown"),
                    retained.unwrap_or(0)
                ),
            });
            if let Some(pid) = pid {
                findings.push(Finding {
                    ok: false,
                    what: format!("slot {slot} is in use by process {pid}: a slot has one reader"),
                });
            }
        }
    }
    let tables: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT p.schemaname::text, p.tablename::text, c.relreplident::text FROM pg_publication_tables p \
         JOIN pg_namespace n ON n.nspname = p.schemaname JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename \
         WHERE p.pubname = $1",
    )
    .bind(publication)
    .fetch_all(&pool)
    .await
    .map_err(scrub)?;
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
        .bind(publication)
        .fetch_one(&pool)
        .await
        .map_err(scrub)?;
    if !exists {
        findings.push(Finding {
            ok: false,
            what: format!("publication {publication} does not exist (`dbtrigger sql` prints it)"),
        });
    } else {
        findings.push(Finding {
            ok: !tables.is_empty(),
            what: format!("publication {publication} has {} table(s)", tables.len()),
        });
    }
    for (schema, table, identity) in tables {
        if identity == "n" {
            findings.push(Finding {
                ok: false,
                what: format!(
                    "{schema}.{table} has REPLICA IDENTITY NOTHING: its updates and deletes carry no old key"
                ),
            });
        } else if identity == "d" {
            let has_key: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname = $2 AND i.indisprimary)",
            )
            .bind(&schema)
            .bind(&table)
            .fetch_one(&pool)
            .await
            .map_err(scrub)?;
            if !has_key {
                findings.push(Finding {
                    ok: false,
                    what: format!("{schema}.{table} has no primary key: give it one, or REPLICA IDENTITY FULL"),
                });
            }
        }
    }
    let privileged: bool =
        sqlx::query_scalar("SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user")
            .fetch_one(&pool)
            .await
            .map_err(scrub)?;
    findings.push(Finding {
        ok: privileged,
        what: "the role has REPLICATION (or is a superuser): it may read and move the slot".to_string(),
    });
    if origin == crate::config::Origin::None {
        let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
            .fetch_one(&pool)
            .await
            .map_err(scrub)?;
        let refusal = super::peek::origin_refusal(origin, version);
        findings.push(Finding {
            ok: refusal.is_none(),
            what: refusal.unwrap_or_else(|| {
                "source.origin \"none\": the server has pgoutput's origin option (PostgreSQL 16+)".to_string()
            }),
        });
    }
    pool.close().await;
    Ok(findings)
}

#[cfg(test)]
mod tests {
    use super::logical_ddl;
    use crate::config::Origin;
    use crate::source::logical::peek::origin_refusal;

    #[test]
    fn the_printed_slot_is_a_failover_slot_from_postgresql_17_on_and_an_ordinary_one_before() {
        let ddl = logical_ddl("orders", "feed_slot", "feed", None);
        let failover = "IF current_setting('server_version_num')::int >= 170000 THEN";
        let at = ddl.find(failover).expect(&ddl);
        let (then, otherwise) = ddl[at..].split_once("ELSE").expect(&ddl);
        assert!(
            then.contains("PERFORM pg_create_logical_replication_slot('feed_slot', 'pgoutput', false, false, true);")
        );
        assert!(otherwise.contains("PERFORM pg_create_logical_replication_slot('feed_slot', 'pgoutput');"));
        assert!(
            ddl.contains("On PostgreSQL 17 and later it is made a\n--    failover slot (failover => true)"),
            "{ddl}"
        );
    }

    #[test]
    fn origin_none_is_refused_before_postgresql_16_naming_the_version() {
        let refusal = origin_refusal(Origin::None, 150_018).expect("15 has no origin option");
        assert!(refusal.starts_with("source.origin \"none\" needs PostgreSQL 16 or later"), "{refusal}");
        assert!(refusal.contains("this server is PostgreSQL 15 (server_version_num 150018)"), "{refusal}");
        assert_eq!(origin_refusal(Origin::None, 160_000), None);
        assert_eq!(origin_refusal(Origin::None, 180_001), None);
        assert_eq!(origin_refusal(Origin::Any, 100_000), None, "any passes no option: every version reads it");
    }
}
