//! The quarantine budget's invariant (issue 45, finding 8): a poller's quarantine never grows
//! past `poison.maxQuarantinedPerHour` rows within any hour, checked after every step.
//!
//! Every entry seen is remembered with the time it was written (`quarantined_at`, by the one
//! clock), also after a replay or purge removed it. The quarantines before an operator's last
//! replay or purge (a history entry of the state document) no longer count: the operator has
//! answered them, and the budget is free again.

use chrono::Duration;
use dbtrigger::store::{StateStore, quarantine};

use super::config::APP;
use super::schedule::TTL_SECONDS;

/// The quiet ticks an hour takes (each waits past a lease, `TTL_SECONDS` + 10): a poller whose
/// budget was spent before the world went quiet holds up to an hour after its last quarantine
/// (the receiver keeps its poison rows), so quiescing allows that many ticks more.
pub const HOLD_TICKS: usize = (3600 / (TTL_SECONDS as usize + 10)) + 1;
use super::invariants::Violation;
use super::world::World;

pub async fn quarantine_within_budget(world: &mut World) -> Result<(), Violation> {
    for index in 0..world.pollers.len() {
        let config = &world.pollers[index].config;
        let (name, budget) = (config.poller_name.clone(), config.poison.max_quarantined_per_hour as usize);
        let store = world.clean_store();
        // Unreadable entries and documents are the other invariants' to report.
        let Ok(entries) = quarantine::list(store.as_ref(), APP, &name).await else {
            continue;
        };
        let key = world.pollers[index].observer.key();
        let answered = match store.read(&key).await {
            Ok(Some(versioned)) => dbtrigger::domain::state::quarantine_answered_at(&versioned.document.history),
            _ => None,
        };
        let seen = world.quarantine_seen.entry(name.clone()).or_default();
        for (entry, _) in entries {
            seen.insert((entry.quarantined_at, entry.id));
        }
        let counted: Vec<_> =
            seen.iter().filter(|(at, _)| answered.is_none_or(|answered| *at > answered)).map(|(at, _)| *at).collect();
        // `counted` is in time order: the most within an hour start at some entry.
        for (start, first) in counted.iter().enumerate() {
            let within = counted[start..].iter().take_while(|at| **at < *first + Duration::hours(1)).count();
            if within > budget {
                return Err(Violation::new(
                    "the quarantine never grows past its budget within an hour",
                    format!(
                        "{name}: {within} rows quarantined within the hour from {first} (poison.maxQuarantinedPerHour {budget}, operator's last answer {answered:?})"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Seeds the refusing receiver's test runs by default (`DBTRIGGER_SIM_REFUSING_SEEDS=<n>` for more).
const REFUSING_SEEDS: u64 = 300;

/// The run of `seed` with the refusing receiver: the default run's variant and draws, with some
/// steps turned into stretches of 422s for every row ([`super::schedule::refusing`]).
pub fn run_refusing_seed(seed: u64) -> super::Run {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut extra = fastrand::Rng::with_seed(seed ^ 0x0422_0422_0422_0422);
    let variant = super::schedule::variant(&mut rng);
    let count = rng.usize(40..=120);
    let opening = super::schedule::opening(&mut rng, &variant);
    super::drive(variant, Some(seed), |world, index| {
        if let Some(step) = opening.get(index) {
            return Some(step.clone());
        }
        if index >= count {
            return None;
        }
        let view = super::schedule::View {
            slow_receiver: variant.slow_receiver,
            rows: world.source.table.lock().unwrap().rows.len(),
            owners: variant.owners,
            has_copy: world.pollers.len() > 1,
            running: world.running(),
            quarantined: world.quarantined,
        };
        Some(super::schedule::refusing(&mut extra, super::schedule::next(&mut rng, &view)))
    })
}

/// Every refusing receiver's seed keeps every invariant (the quarantine budget's among them).
#[test]
fn refusing_receiver_schedules_keep_every_invariant() {
    let count = std::env::var("DBTRIGGER_SIM_REFUSING_SEEDS")
        .map(|count| count.parse().expect("DBTRIGGER_SIM_REFUSING_SEEDS is a number"))
        .unwrap_or(REFUSING_SEEDS);
    let seeds: Vec<u64> = match std::env::var("DBTRIGGER_SIM_SEED") {
        Ok(seed) => vec![seed.parse().expect("DBTRIGGER_SIM_SEED is a number")],
        Err(_) => (0..count).collect(),
    };
    let threads = std::thread::available_parallelism().map(usize::from).unwrap_or(1).clamp(1, 4);
    let mut failing: Vec<super::Run> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|worker| {
                let seeds = &seeds;
                scope.spawn(move || {
                    let mine = seeds.iter().skip(worker).step_by(threads);
                    mine.map(|seed| run_refusing_seed(*seed)).filter(|run| run.violation.is_some()).collect::<Vec<_>>()
                })
            })
            .collect();
        workers.into_iter().flat_map(|worker| worker.join().expect("a simulation worker panicked")).collect()
    });
    failing.sort_by_key(|run| run.seed);
    let listed: Vec<String> = failing
        .iter()
        .map(|run| format!("seed {}: {}", run.seed.unwrap_or_default(), run.violation.as_ref().unwrap().1.invariant))
        .collect();
    if let Some(first) = failing.first() {
        panic!("{}\nfailing seeds: {listed:?}", super::describe(first, None));
    }
}

/// Regression (issue 45, finding 8): a receiver answering 422 to every row for an hour, over a
/// backlog of 30 rows, ticked by two owners. Before the fix every row was quarantined within a
/// few ticks ("the quarantine never grows past its budget within an hour"); the poller holds at
/// its checkpoint once the budget is spent, is reported unhealthy while it holds ("a stuck poller
/// is reported unhealthy"), and once the receiver accepts again delivers the rest.
#[test]
fn a_receiver_refusing_every_row_quarantines_no_more_than_the_budget() {
    use super::schedule::Step::{Insert, RefuseRows, Run, Tick};
    let variant = super::schedule::Variant {
        batch_size: 4,
        max_in_flight: 1,
        tick_budget_seconds: 60,
        commit_interval_ms: 1000,
        max_attempts: 3,
        owners: 2,
        slow_receiver: false,
    };
    let mut steps = vec![Insert { rows: 30, poison: None, slow: None }, RefuseRows { ms: 3_600_000 }];
    for owner in [0, 1, 0, 1, 0, 1, 0, 1] {
        steps.extend([Tick { poller: 0, owner, crash_after_ms: None }, Run { ms: 45_000 }]);
    }
    let run = super::run_fixed(variant, &steps);
    assert!(run.violation.is_none(), "{}", super::describe(&run, None));
    let held = run.trace.iter().filter(|line| line.contains("quarantine_budget_spent")).count();
    assert!(held >= 4, "the ticks past the budget hold and say so:\n{}", run.trace.join("\n"));
}
