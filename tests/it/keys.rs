//! Text keys compared as their column compares them (issue 35, finding 5): a `char(n)` key, a
//! `citext` key, a key under a non-deterministic ICU collation on PostgreSQL; a `CHAR(8)` key,
//! non-ASCII keys (utf8mb4 and latin1), case-folded keys and binary keys on MariaDB. Each case
//! catches up across several batches (ten rows share each cursor value, batches of 7 split the
//! ties, so every boundary is decided by the key), delivers each row once, then answers 12 idle
//! ticks with nothing late and nothing delivered again.

use std::collections::BTreeSet;
use std::sync::Arc;

use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::TickOutcome;
use serde_json::{Value, json};

use crate::sources::{Engine, database, execute, items_config, poller_with};

/// Rows in each case: 6 batches and more of 7.
const ROWS: usize = 48;

/// `key_type` is the key column's type; `key(n)` the SQL literal of row n's key.
/// `detector`: the late-arrival detector on (its default) or off.
async fn catch_up_then_idle(
    engine: Engine,
    prelude: &str,
    key_type: &str,
    key: impl Fn(usize) -> String,
    detector: bool,
) {
    let database = database(engine).await;
    let url = database.url.clone();
    let table = format!(
        "{prelude}CREATE TABLE items (k {key_type} NOT NULL PRIMARY KEY, c BIGINT NOT NULL, note TEXT);\n\
         CREATE INDEX items_seek ON items (c, k);\n"
    );
    execute(&url, &table).await;
    let values: Vec<String> = (0..ROWS).map(|n| format!("({}, {}, 'row {n}')", key(n), n / 10)).collect();
    execute(&url, &format!("INSERT INTO items VALUES {};\n", values.join(", "))).await;

    let (config, _directory) = items_config(&url, json!({"pk": ["k"], "lateArrivals": {"enabled": detector}}), 7);
    let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
    let label = format!("{engine:?} {key_type}");

    let (result, report) = poller.tick_reported().await;
    let outcome = result.unwrap_or_else(|error| panic!("{label}: the catch-up failed: {error}"));
    assert!(matches!(outcome, TickOutcome::Delivered { .. }), "{label}: {outcome:?}");
    assert_eq!(report.late_arrivals, 0, "{label}: nothing is late in a catch-up");
    let delivered: Vec<Value> =
        sink.batches().iter().flat_map(|batch| batch.events.iter().map(|event| event.pk()["k"].clone())).collect();
    let distinct: BTreeSet<String> = delivered.iter().map(Value::to_string).collect();
    assert_eq!(
        (delivered.len(), distinct.len()),
        (ROWS, ROWS),
        "{label}: each row once across {} batches: {delivered:?}",
        sink.batches().len()
    );
    assert!(sink.batches().len() >= 6, "{label}: several batches");

    for round in 1..=12 {
        let (result, report) = poller.tick_reported().await;
        let outcome = result.unwrap_or_else(|error| panic!("{label}: idle tick {round} failed: {error}"));
        assert_eq!(outcome, TickOutcome::Idle, "{label}: idle tick {round}");
        assert_eq!(report.late_arrivals, 0, "{label}: idle tick {round} found rows late");
    }
    let after: usize = sink.batches().iter().map(|batch| batch.events.len()).sum();
    assert_eq!(after, ROWS, "{label}: nothing delivered again");
}

/// Row n's key: short text of mixed case, so that byte order and a case-insensitive order differ
/// (`B1` sorts before `a2` by bytes, after it case-insensitively).
fn mixed_case(n: usize) -> String {
    let letter =
        if n.is_multiple_of(2) { char::from(b'a' + (n % 26) as u8) } else { char::from(b'A' + (n % 26) as u8) };
    format!("{letter}{n}")
}

/// Regression (issue 35, finding 5): a `char(8)` key of values shorter than 8 was bound as
/// `::CHAR` (sqlx's name for bpchar), which is `character(1)`: the bound lost all but its first
/// letter, the row at each batch boundary came again, then every tick failed for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_char_key_is_read_once_and_then_idle() {
    // The detector on: it hashes a char(n) key without its padding on both sides (issue 35,
    // finding 5's detector half), so 12 idle ticks find nothing late.
    catch_up_then_idle(Engine::Postgres, "", "char(8)", |n| format!("'{}'", mixed_case(n)), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_citext_key_is_read_once_and_then_idle() {
    catch_up_then_idle(
        Engine::Postgres,
        "CREATE EXTENSION citext;\n",
        "citext",
        |n| format!("'{}'", mixed_case(n)),
        true,
    )
    .await;
}

/// A key under a non-deterministic collation: the seek and the ORDER BY compare it in that
/// collation, and the unique key keeps two values it calls equal out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_key_under_a_nondeterministic_collation_is_read_once_and_then_idle() {
    catch_up_then_idle(
        Engine::Postgres,
        "CREATE COLLATION folded (provider = icu, locale = 'und-u-ks-level2', deterministic = false);\n",
        "text COLLATE folded",
        |n| format!("'{}'", mixed_case(n)),
        true,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_char_key_is_read_once_and_then_idle() {
    catch_up_then_idle(Engine::MariaDb, "", "CHAR(8)", |n| format!("'k{n}'"), true).await;
}

/// Case-folded keys under MariaDB's default (case-insensitive) collation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_case_folded_key_is_read_once_and_then_idle() {
    catch_up_then_idle(
        Engine::MariaDb,
        "",
        "VARCHAR(8) COLLATE utf8mb4_general_ci",
        |n| format!("'{}'", mixed_case(n)),
        true,
    )
    .await;
}

/// Non-ASCII keys, whose byte order is not the collation's (`é` sorts with `e` there).
fn non_ascii(n: usize) -> String {
    let letters = ['é', 'e', 'f', 'É', 'ü', 'u', 'z', 'ß'];
    format!("'{}{n}'", letters[n % letters.len()])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_non_ascii_key_is_read_once_and_then_idle() {
    catch_up_then_idle(Engine::MariaDb, "", "VARCHAR(8) CHARACTER SET utf8mb4", non_ascii, true).await;
    catch_up_then_idle(Engine::MariaDb, "", "VARCHAR(8) CHARACTER SET latin1", non_ascii, true).await;
}

/// Binary keys are refused, naming the column, before anything is delivered: a key is bound
/// back as an integer or as text, and a binary key's base64 text would compare as other bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binary_key_is_refused_naming_it() {
    let cases = [(Engine::MariaDb, "VARBINARY(8)", "x'ff00'"), (Engine::Postgres, "bytea", "'\\xff00'")];
    for (engine, key_type, key) in cases {
        let database = database(engine).await;
        execute(
            &database.url,
            &format!(
                "CREATE TABLE items (k {key_type} NOT NULL, c BIGINT NOT NULL);\nINSERT INTO items VALUES ({key}, 1);\n"
            ),
        )
        .await;
        let (config, _directory) = items_config(&database.url, json!({"pk": ["k"]}), 7);
        let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
        let message = poller.tick().await.unwrap_err().to_string();
        assert!(message.contains("primary key column \"k\"") && message.contains("integers or text"), "{message}");
        assert!(sink.batches().is_empty(), "{engine:?}: nothing delivered");
    }
}
