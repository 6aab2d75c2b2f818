//! The ordered window in the simulation (issue 38).
//!
//! The random schedules' windows of 2 and 3 never put a key's two versions in batches in flight at
//! once: with `batch.order: "none"` (`DBTRIGGER_SIM_UNORDERED=1`) none of the 2,000 seeds of the
//! default run, nor 600 of them with windows of 4 or 8, breaks "a key's versions are first
//! delivered in source order" (2026-11-27). That needs a tick still reading while a slow batch is in
//! flight, and a row of that batch updated meanwhile, so that the tick reads its newer version. So:
//!
//! - a fixed schedule that does exactly that (window 2), which breaks the invariant with the
//!   unordered window and keeps it with the ordered one;
//! - wide-window runs ([`run_wide_seed`]): windows of 4 or 8, more rows than the window takes at
//!   once with one of the first slow, and updates aimed at the rows around the slow one while a
//!   tick runs. With the unordered window 4 of the first 100 seeds break the invariant (11, 37,
//!   57, 97, since the schedules draw issue 35's transactions too); seed 11 is kept as a scenario. With the ordered window, 400 seeds keep every invariant;
//!   the test runs 64.

use super::config::UNORDERED;
use super::schedule;
use super::schedule::Step::{self, Insert, Latency, Run, Tick, Update};
use super::schedule::Variant;
use super::{describe, run_fixed};

const KEY_ORDER: &str = "a key's versions are first delivered in source order";

/// Batches of 2, two in flight.
fn variant() -> Variant {
    Variant {
        batch_size: 2,
        max_in_flight: 2,
        tick_budget_seconds: 60,
        commit_interval_ms: 1000,
        max_attempts: 3,
        owners: 2,
        slow_receiver: false,
    }
}

/// Rows 1-6; row 2 makes its batch slow (11 s against 1 s). The tick sends [1, 2] (slow) and
/// [3, 4]; meanwhile row 1 is updated (a new cursor, after row 6), so the tick's read after
/// [5, 6] finds row 1's new version while the batch holding its old one is still in flight.
fn steps() -> Vec<Step> {
    vec![
        Latency { base_ms: 1_000, slow_ms: 10_000 },
        Insert { rows: 6, poison: None, slow: Some(1) },
        Tick { poller: 0, owner: 0, crash_after_ms: None },
        Run { ms: 500 },
        Update { nth: 0 },
        Run { ms: 15_000 },
        Run { ms: 15_000 },
    ]
}

fn run(unordered: bool) -> super::Run {
    UNORDERED.with(|cell| cell.set(unordered));
    let run = run_fixed(variant(), &steps());
    UNORDERED.with(|cell| cell.set(false));
    run
}

/// The ordered window keeps a key's versions in source order where the unordered one does not.
#[test]
fn a_newer_version_read_while_the_older_is_in_flight_waits_for_it() {
    let ordered = run(false);
    assert!(ordered.violation.is_none(), "{}", describe(&ordered, None));
    let unordered = run(true);
    assert!(
        unordered.violation.as_ref().is_some_and(|(_, violation)| violation.invariant == KEY_ORDER),
        "without the ordered window the invariant should fire:\n{}",
        describe(&unordered, None)
    );
}

/// A seed's run with a wide window (4 or 8 batches in flight; the random schedules' are 1 to 3),
/// more rows than the window takes at once (20 to 60 more, one of the first ones slow), and
/// updates aimed at rows a running tick holds: while a tick runs, one step in four updates a row
/// that may share the slow row's batch; the rest is drawn as in the random schedules.
pub fn run_wide_seed(seed: u64) -> super::Run {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut variant = schedule::variant(&mut rng);
    variant.max_in_flight = if rng.bool() { 4 } else { 8 };
    let count = rng.usize(40..=120);
    let mut opening = schedule::opening(&mut rng, &variant);
    // More rows than a wide window takes at once, one of the first ones slow: the tick's reads go
    // on while a slow batch is in flight.
    let before: usize =
        opening.iter().map(|step| if let Insert { rows, .. } = step { *rows as usize } else { 0 }).sum();
    let slow = rng.u8(0..4);
    opening.push(Latency { base_ms: rng.u64(100..=1_000), slow_ms: rng.u64(2_000..=10_000) });
    opening.push(Insert { rows: rng.u8(20..=60), poison: None, slow: Some(slow) });
    // The rows that may share the slow row's batch.
    let near = before + slow as usize;
    let targets = near.saturating_sub(variant.batch_size)..near + variant.batch_size + 1;
    super::drive(variant, Some(seed), |world, index| {
        if let Some(step) = opening.get(index) {
            return Some(step.clone());
        }
        if index >= count {
            return None;
        }
        let rows = world.source.table.lock().unwrap().rows.len();
        let running = world.running();
        if !running.is_empty() && rng.u8(0..4) == 0 {
            return Some(Update { nth: rng.usize(targets.clone()) as u16 });
        }
        let view = schedule::View {
            slow_receiver: variant.slow_receiver,
            rows,
            owners: variant.owners,
            has_copy: world.pollers.len() > 1,
            running,
            quarantined: world.quarantined,
        };
        Some(schedule::next(&mut rng, &view))
    })
}

/// Seeds of wide windows keep every invariant (64; `DBTRIGGER_SIM_WIDE_SEEDS=<n>` runs n of them; with
/// `DBTRIGGER_SIM_UNORDERED=1` the failing seeds are listed instead, to find where the ordered
/// window is what holds the key order).
#[test]
fn wide_windows_keep_every_invariant() {
    let count: u64 = std::env::var("DBTRIGGER_SIM_WIDE_SEEDS").map(|count| count.parse().unwrap()).unwrap_or(64);
    let hunting = std::env::var_os("DBTRIGGER_SIM_UNORDERED").is_some();
    let mut failing = Vec::new();
    for seed in 0..count {
        let run = run_wide_seed(seed);
        if let Some((_, violation)) = &run.violation {
            if !hunting {
                panic!("{}", describe(&run, None));
            }
            failing.push((seed, violation.invariant));
        }
    }
    if hunting {
        println!("unordered wide windows: {} of {count} seeds fail: {failing:?}", failing.len());
    }
}

/// Seed 11 of the wide windows: the first of 4 seeds of 100 in which the unordered window breaks
/// the key order (also 37, 57, 97, since the schedules gained issue 35's transactions; 3, 7, 11
/// and 23 before); the ordered window keeps every invariant.
#[test]
fn wide_window_seed_11_breaks_the_key_order_only_without_the_ordered_window() {
    let ordered = run_wide_seed(11);
    assert!(ordered.violation.is_none(), "{}", describe(&ordered, None));
    UNORDERED.with(|cell| cell.set(true));
    let unordered = run_wide_seed(11);
    UNORDERED.with(|cell| cell.set(false));
    assert!(
        unordered.violation.as_ref().is_some_and(|(_, violation)| violation.invariant == KEY_ORDER),
        "{}",
        describe(&unordered, None)
    );
}
