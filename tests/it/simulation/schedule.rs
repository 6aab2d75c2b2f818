//! The schedule: the steps a run is made of, and how a seed picks them. A step's `Debug` form is
//! Rust, so that a failing schedule printed by the runner can be pasted into a fixed scenario.

use super::source::ReadFault;
use super::store::StoreFault;

/// The poller's configuration a run uses (chosen once per seed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    pub batch_size: usize,
    pub max_in_flight: usize,
    pub tick_budget_seconds: u64,
    pub commit_interval_ms: u64,
    pub max_attempts: u32,
    /// Owners (processes) running the poller: 2 or 3.
    pub owners: u8,
    /// The receiver is slow all along (seconds a request): isolations outlive leases and budgets.
    pub slow_receiver: bool,
}

/// Lease terms every run uses: a tick that stops heartbeating loses the lease within a minute.
pub const TTL_SECONDS: u64 = 30;
pub const HEARTBEAT_SECONDS: u64 = 10;
pub const SKEW_SECONDS: u64 = 5;

/// An operator command (`--yes`, never `--force`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    ResetToBeginning,
    /// `clone` at the checkpoint, to the poller's copy (the second poller of the run).
    Clone,
    /// Not a command: the source definition is edited (say a column added), so the configured
    /// fingerprint changes; ticks stop until `fingerprint accept`.
    EditDefinition,
    AcceptFingerprint,
    ReplayAll,
    PurgeAll,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Owner `owner` of poller `poller` (0: the poller, 1: its copy) starts a tick; with
    /// `crash_after_ms`, its process dies that long after (the tick dropped at its await).
    Tick {
        poller: u8,
        owner: u8,
        crash_after_ms: Option<u64>,
    },
    /// Time passes: every tick, delivery and timer moves.
    Run {
        ms: u64,
    },
    /// The process running that owner's tick dies now.
    Crash {
        poller: u8,
        owner: u8,
    },
    /// Rows inserted; the `poison`-th of them is refused for good by the receiver, the `slow`-th
    /// makes any batch holding it slow.
    Insert {
        rows: u8,
        poison: Option<u8>,
        slow: Option<u8>,
    },
    /// A row (the `nth`, modulo the count) is updated: it moves to a new cursor.
    Update {
        nth: u16,
    },
    /// A truncate and reload: a new generation of `rows` rows, cursors from 1 again.
    Reload {
        rows: u8,
    },
    Latency {
        base_ms: u64,
        slow_ms: u64,
    },
    /// The receiver answers 503 for this long.
    Outage {
        ms: u64,
    },
    /// The receiver refuses every request with 401 for this long (a rotated token, issue 36).
    Unauthorized {
        ms: u64,
    },
    /// The receiver refuses every row with 422 for this long (a bad deploy, issue 45 finding 8).
    /// Drawn only by [`refusing`]'s runs, so that the seeds of the default run stay as they were.
    RefuseRows {
        ms: u64,
    },
    /// The next requests hang until they time out.
    Timeouts {
        next: u8,
    },
    /// The receiver accepts every row again (the poison rows were fixed).
    Heal,
    /// A fault of the ticks' handle on the store.
    Store(StoreFault),
    /// A fault of the operators' handle on the store.
    OperatorStore(StoreFault),
    /// The next requests are refused with a 409 that is the receiver's own conflict.
    Conflicts {
        next: u8,
    },
    /// The receiver checks fencing tokens (the README asks it to), or ignores them.
    Fencing {
        enforced: bool,
    },
    /// The next delivery panics, `scripted` or not (only fixed scenarios use this: a panic nobody
    /// scripted must fail the run even where the product catches it).
    ReceiverPanic {
        scripted: bool,
    },
    /// Another instance takes the lease, as one whose clock ran ahead would, and never delivers.
    Rival {
        poller: u8,
    },
    Source(ReadFault),
    /// A transaction opens (issue 35): it reserves the cursors of `inserts` new rows and of an
    /// update of the `update`-th committed row now, and makes them visible at its `Commit`.
    /// `seen`: the horizon sees it (delivering reads stop below its first cursor); otherwise its
    /// rows may commit behind the checkpoint.
    Begin {
        inserts: u8,
        update: Option<u16>,
        seen: bool,
    },
    /// The `nth` open transaction (modulo their count) commits; with `poison`, the receiver
    /// refuses its first row for good from then on.
    Commit {
        nth: u8,
        poison: bool,
    },
    Operator {
        poller: u8,
        command: Command,
    },
}

/// What the generator may look at: the world as it is before the step.
pub struct View {
    pub slow_receiver: bool,
    pub rows: usize,
    pub owners: u8,
    pub has_copy: bool,
    /// (poller, owner) of the ticks running now.
    pub running: Vec<(u8, u8)>,
    pub quarantined: usize,
}

pub fn variant(rng: &mut fastrand::Rng) -> Variant {
    Variant {
        batch_size: rng.usize(2..=5),
        max_in_flight: pick(rng, &[(1, 2), (2, 2), (3, 1)]),
        tick_budget_seconds: pick(rng, &[(20, 1), (40, 2), (60, 2)]),
        commit_interval_ms: pick(rng, &[(0, 1), (1000, 2)]),
        max_attempts: pick(rng, &[(2, 1), (3, 1), (5, 1)]),
        owners: pick(rng, &[(2, 1), (3, 1)]),
        slow_receiver: rng.u8(0..4) == 0,
    }
}

/// The steps a run starts with: its first rows, and a slow receiver's latency.
pub fn opening(rng: &mut fastrand::Rng, variant: &Variant) -> Vec<Step> {
    let mut steps = vec![Step::Insert { rows: rng.u8(0..=12), poison: None, slow: None }];
    if variant.slow_receiver {
        steps.push(latency(rng, true));
    }
    steps
}

fn latency(rng: &mut fastrand::Rng, slow_receiver: bool) -> Step {
    let base_ms = if slow_receiver {
        pick(rng, &[(3_000, 1), (5_000, 1), (8_000, 2)])
    } else {
        pick(rng, &[(0, 2), (200, 2), (1_000, 2), (3_000, 2), (5_000, 1), (8_000, 1)])
    };
    Step::Latency { base_ms, slow_ms: pick(rng, &[(2_000, 1), (6_000, 2), (9_000, 1)]) }
}

/// A value by weight.
fn pick<T: Copy>(rng: &mut fastrand::Rng, choices: &[(T, u32)]) -> T {
    let total: u32 = choices.iter().map(|(_, weight)| weight).sum();
    let mut draw = rng.u32(0..total);
    for (value, weight) in choices {
        if draw < *weight {
            return *value;
        }
        draw -= weight;
    }
    unreachable!("the draw is below the total")
}

/// The next step. Weights favour ticks and time (the poller at work) and keep each fault
/// frequent enough that two of them meet: a slow batch and a refusal, an isolation and a
/// takeover, an isolation and an outage, an operator and a tick.
pub fn next(rng: &mut fastrand::Rng, view: &View) -> Step {
    #[derive(Clone, Copy)]
    enum Kind {
        Tick,
        Run,
        Crash,
        Insert,
        Update,
        Reload,
        Latency,
        Outage,
        Unauthorized,
        Timeouts,
        Heal,
        Store,
        OperatorStore,
        Conflicts,
        Fencing,
        Rival,
        Source,
        Begin,
        Commit,
        Operator,
    }
    let crash_weight = if view.running.is_empty() { 0 } else { 3 };
    let kind = pick(
        rng,
        &[
            (Kind::Tick, 24),
            (Kind::Run, 26),
            (Kind::Crash, crash_weight),
            (Kind::Insert, 10),
            (Kind::Update, 3),
            (Kind::Reload, 2),
            (Kind::Latency, 4),
            (Kind::Outage, 3),
            (Kind::Unauthorized, 2),
            (Kind::Timeouts, 2),
            (Kind::Heal, 1),
            (Kind::Store, 5),
            (Kind::OperatorStore, 2),
            (Kind::Conflicts, 1),
            (Kind::Fencing, 1),
            (Kind::Rival, 1),
            (Kind::Source, 3),
            (Kind::Begin, 4),
            (Kind::Commit, 5),
            (Kind::Operator, 5),
        ],
    );
    let poller = |rng: &mut fastrand::Rng| if view.has_copy && rng.u8(0..3) == 0 { 1 } else { 0 };
    match kind {
        Kind::Tick => {
            let crash_after_ms = if rng.u8(0..10) == 0 { Some(rng.u64(0..15_000)) } else { None };
            Step::Tick { poller: poller(rng), owner: rng.u8(0..view.owners), crash_after_ms }
        }
        Kind::Run => Step::Run {
            ms: pick(rng, &[(100, 3), (500, 3), (1_000, 4), (3_000, 4), (8_000, 3), (20_000, 2), (45_000, 2)]),
        },
        Kind::Crash => {
            let (poller, owner) = view.running[rng.usize(0..view.running.len())];
            Step::Crash { poller, owner }
        }
        Kind::Insert => {
            let rows = rng.u8(1..=6);
            let poison = if rng.u8(0..100) < 18 { Some(rng.u8(0..rows)) } else { None };
            let slow = if rng.u8(0..100) < 18 { Some(rng.u8(0..rows)) } else { None };
            Step::Insert { rows, poison, slow }
        }
        Kind::Update => Step::Update { nth: rng.u16(0..(view.rows.max(1) as u16)) },
        Kind::Reload => Step::Reload { rows: rng.u8(0..=10) },
        Kind::Latency => latency(rng, view.slow_receiver),
        Kind::Outage => Step::Outage { ms: pick(rng, &[(1_000, 1), (5_000, 2), (20_000, 2), (60_000, 1)]) },
        Kind::Unauthorized => {
            Step::Unauthorized { ms: pick(rng, &[(5_000, 1), (20_000, 2), (60_000, 1), (240_000, 1)]) }
        }
        Kind::Timeouts => Step::Timeouts { next: rng.u8(1..=3) },
        Kind::Heal => Step::Heal,
        Kind::Store => Step::Store(store_fault(rng)),
        Kind::OperatorStore => Step::OperatorStore(store_fault(rng)),
        Kind::Conflicts => Step::Conflicts { next: rng.u8(1..=3) },
        Kind::Fencing => Step::Fencing { enforced: rng.u8(0..3) == 0 },
        Kind::Rival => Step::Rival { poller: poller(rng) },
        Kind::Source => Step::Source(pick(
            rng,
            &[
                (ReadFault::Delay { ms: 2_000 }, 2),
                (ReadFault::Delay { ms: 20_000 }, 1),
                (ReadFault::Error, 2),
                (ReadFault::Panic, 1),
            ],
        )),
        Kind::Begin => Step::Begin {
            inserts: pick(rng, &[(0, 2), (1, 3), (2, 2), (3, 1)]),
            update: if rng.u8(0..100) < 55 { Some(rng.u16(0..(view.rows.max(1) as u16))) } else { None },
            seen: rng.u8(0..3) == 0,
        },
        Kind::Commit => Step::Commit { nth: rng.u8(0..4), poison: rng.u8(0..100) < 15 },
        Kind::Operator => {
            let quarantine_weight = if view.quarantined > 0 { 6 } else { 1 };
            let clone_weight = if view.has_copy { 0 } else { 3 };
            let command = pick(
                rng,
                &[
                    (Command::ResetToBeginning, 2),
                    (Command::Clone, clone_weight),
                    (Command::EditDefinition, 1),
                    (Command::AcceptFingerprint, 2),
                    (Command::ReplayAll, quarantine_weight),
                    (Command::PurgeAll, quarantine_weight),
                ],
            );
            Step::Operator { poller: poller(rng), command }
        }
    }
}

/// A fault real blob storage has, for the next request of its kind.
fn store_fault(rng: &mut fastrand::Rng) -> StoreFault {
    pick(
        rng,
        &[
            (StoreFault::RefuseNextWrite, 3),
            (StoreFault::LandNextWriteButFail, 3),
            (StoreFault::LandNextWriteButConflict, 3),
            (StoreFault::LandNextWriteLate { ms: 300 }, 1),
            (StoreFault::LandNextWriteLate { ms: 4_000 }, 1),
            (StoreFault::FailNextRead, 3),
            (StoreFault::FailNextList, 1),
            (StoreFault::FailNextDelete, 1),
            (StoreFault::LandNextDeleteButFail, 1),
        ],
    )
}

/// A run of the refusing receiver's seeds (issue 45, finding 8): the default run's step, except
/// that about one 401 stretch in two (and one step in 40 besides) is a stretch of 422s for every
/// row instead, drawn from `extra` so that the main draws stay those of the default run.
pub fn refusing(extra: &mut fastrand::Rng, step: Step) -> Step {
    let ms = pick(extra, &[(20_000, 1), (240_000, 2), (3_600_000, 1)]);
    match step {
        Step::Unauthorized { .. } if extra.bool() => Step::RefuseRows { ms },
        _ if extra.u8(0..40) == 0 => Step::RefuseRows { ms },
        step => step,
    }
}
