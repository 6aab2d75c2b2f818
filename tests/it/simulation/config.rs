//! The poller's configuration, loaded from a real function.json through `PollerConfig::load` (so
//! that every value passed validation), once per variant, per edit of the definition, per poller.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use dbtrigger::config::{PollerConfig, Settings};
use serde_json::json;

use super::schedule::{HEARTBEAT_SECONDS, SKEW_SECONDS, TTL_SECONDS, Variant};

pub const APP: &str = "sim";
pub const POLLER: &str = "orders";
pub const COPY: &str = "orders_copy";

struct Loaded {
    root: PathBuf,
    _directory: tempfile::TempDir,
    configs: BTreeMap<String, PollerConfig>,
}

static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();

thread_local! {
    /// `batch.order: "none"` (the unordered window) for the runs of this thread: the scenario
    /// showing that the key-order invariant fires without the ordered window (issue 38), or every
    /// run with `DBTRIGGER_SIM_UNORDERED=1` (to hunt seeds where it would).
    pub static UNORDERED: std::cell::Cell<bool> =
        std::cell::Cell::new(std::env::var_os("DBTRIGGER_SIM_UNORDERED").is_some());
}

/// The configuration of `name` (the poller or its copy) for `variant`; `edited`: the source
/// definition was edited (a column list added), which changes the fingerprint and nothing else.
pub fn poller_config(variant: &Variant, name: &str, edited: bool) -> PollerConfig {
    let loaded = LOADED.get_or_init(|| {
        let directory = tempfile::tempdir().expect("a temporary directory");
        let root = directory.path().join("app");
        std::fs::create_dir_all(&root).unwrap();
        let host = json!({"version": "2.0", "functionTimeout": "00:10:00"});
        std::fs::write(root.join("host.json"), serde_json::to_vec(&host).unwrap()).unwrap();
        Mutex::new(Loaded { root, _directory: directory, configs: BTreeMap::new() })
    });
    let mut loaded = loaded.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let unordered = UNORDERED.with(std::cell::Cell::get);
    let cache_key = format!("{variant:?}/{name}/{edited}/{unordered}");
    if let Some(config) = loaded.configs.get(&cache_key) {
        return config.clone();
    }
    let mut source = json!({
        "connection": "SIM_DB", "table": "orders", "cursor": "version", "pk": ["id"],
        "generation": {"query": "SELECT load_id FROM loads", "onChange": "restart"},
        // A small window (buckets of 4 rows, merged when older than the newest 4), recounted in
        // slices over 3 checks: every simulated tick exercises the sweep, and no row may be called late.
        "lateArrivals": {"windowRows": 64, "sweepChecks": 3}
    });
    if edited {
        source["columns"] = json!(["id", "version", "gen"]);
    }
    let mut poller = json!({
        "name": name,
        "source": source,
        "batch": {
            "size": variant.batch_size,
            "maxInFlight": variant.max_in_flight,
            "tickBudgetSeconds": variant.tick_budget_seconds,
            "commitIntervalMs": variant.commit_interval_ms
        },
        "sink": {"type": "webhook", "url": "%SIM_HOOK%", "timeoutSeconds": 5, "maxRetries": 0},
        "lease": {"ttlSeconds": TTL_SECONDS, "heartbeatSeconds": HEARTBEAT_SECONDS, "clockSkewSeconds": SKEW_SECONDS},
        "poison": {"maxAttempts": variant.max_attempts, "mode": "quarantine"},
        "state": {"connection": "SIM_STATE"}
    });
    if unordered {
        poller["batch"]["order"] = json!("none");
    }
    let function = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
        "poller": poller
    });
    // Named after what it holds, so that a configuration is the same whichever run loads it first.
    let function_name = format!(
        "f{}_{}_{}_{}_{}_{name}_{}{}",
        variant.batch_size,
        variant.max_in_flight,
        variant.tick_budget_seconds,
        variant.commit_interval_ms,
        variant.max_attempts,
        u8::from(edited),
        if unordered { "_unordered" } else { "" }
    );
    // The loader takes it below: an editor's schema must take it too (issue 28).
    crate::schema::assert_valid_function_json(&function);
    let folder = loaded.root.join(&function_name);
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("function.json"), serde_json::to_vec_pretty(&function).unwrap()).unwrap();
    let settings = Settings::from_pairs([
        ("SIM_DB", "sqlite:sim.db"),
        ("SIM_HOOK", "http://127.0.0.1:9/hook"),
        ("SIM_STATE", "file:unused"),
        ("DBTRIGGER_APP_NAME", APP),
    ]);
    let config = PollerConfig::load(&loaded.root, &function_name, &settings, None)
        .unwrap_or_else(|error| panic!("the simulation's configuration is invalid: {error}"));
    loaded.configs.insert(cache_key, config.clone());
    config
}
