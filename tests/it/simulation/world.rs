//! The world a run drives: the real `Poller`s (two or three owners of the poller, and of its copy
//! once an operator cloned it) over one memory store, the scripted source and receiver, one clock;
//! how each step acts on it; and the tick tasks, whose ends are read after every step.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use dbtrigger::config::PollerConfig;
use dbtrigger::domain::LeaseRecord;
use dbtrigger::store::{StateStore, WriteCondition};
use dbtrigger::tick::{Clock, Poller, TickError, TickOutcome, TickReport};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::RowId;
use super::config::{self, COPY, POLLER};
use super::invariants::Violation;
use super::operator;
use super::schedule::{Command, Step, TTL_SECONDS, Variant};
use super::sink::{ScriptedSink, SinkState};
use super::source::{ScriptedSource, SourceShared};
use super::store::{Role, SimStore, StoreShared};

/// A fixed epoch plus the (paused) runtime's elapsed time: decisions and timers agree.
pub struct SimClock {
    epoch: DateTime<Utc>,
    start: Instant,
}

impl Clock for SimClock {
    fn now(&self) -> DateTime<Utc> {
        self.epoch + chrono::Duration::from_std(self.start.elapsed()).expect("a short run")
    }
}

/// How a tick task ended: `None` when its process crashed. With the write log's length when it
/// started and ended (the writes it overlapped).
pub struct Ended {
    pub result: Option<(Result<TickOutcome, TickError>, TickReport)>,
    /// The lease owner id of the process that ran it.
    pub owner_id: String,
    pub log_from: usize,
    pub log_to: usize,
    /// How long it ran, by the simulation's clock.
    pub took: Duration,
}

/// One poller (the poller, or its copy): its owners, its observer, and what the invariants keep
/// about it.
pub struct Logical {
    pub config: PollerConfig,
    pub owners: Vec<Arc<Poller>>,
    /// Processes started so far for each owner: a process that crashed comes back with a new
    /// lease owner id, as a restarted one does (`{instance}/{pid}-{random}`).
    pub incarnations: Vec<u32>,
    /// A poller over the fault-free handles, for `status`.
    pub observer: Poller,
    pub running: BTreeMap<u8, JoinHandle<Ended>>,
    /// Rows an operator dropped on purpose (purged), or that were another poller's business (a
    /// copy's rows before the checkpoint it was cloned at).
    pub excused: BTreeSet<RowId>,
    /// Completed ticks in a row that failed without moving the checkpoint.
    pub failing_streak: u32,
    /// The checkpoint (and generation) when the streak was last looked at.
    pub progress: Option<String>,
    /// The last checkpoint seen: (generation, cursor, key).
    pub last_checkpoint: Option<(Option<u64>, i64, i64)>,
    /// How its last completed tick ended (`TickOutcome::kind`, or `error`).
    pub last_end: &'static str,
}

pub struct World {
    pub variant: Variant,
    pub clock: Arc<SimClock>,
    pub source: Arc<SourceShared>,
    pub sink: Arc<Mutex<SinkState>>,
    pub store: Arc<StoreShared>,
    pub pollers: Vec<Logical>,
    pub edited: bool,
    /// What happened, in order (tick ends, operator answers): the run's outcome, compared by the
    /// determinism test and printed on failure.
    pub trace: Vec<String>,
    /// Quarantine entries at the last check (the generator's view).
    pub quarantined: usize,
    /// Per poller: the versions committed behind what it read ([`super::commits`]).
    pub late: BTreeMap<String, super::commits::LateLedger>,
    /// Per poller: every quarantine entry seen, with when it was written ([`super::budget`]).
    pub quarantine_seen: BTreeMap<String, BTreeSet<(DateTime<Utc>, String)>>,
}

pub const OWNERS: [&str; 3] = ["owner-a", "owner-b", "owner-c"];

impl World {
    pub fn new(variant: Variant) -> World {
        let epoch = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        let sink = Arc::new(Mutex::new(SinkState::default()));
        let mut world = World {
            variant,
            clock: Arc::new(SimClock { epoch, start: Instant::now() }),
            source: SourceShared::new(),
            store: StoreShared::new(sink.clone()),
            sink,
            pollers: Vec::new(),
            edited: false,
            trace: Vec::new(),
            quarantined: 0,
            late: BTreeMap::new(),
            quarantine_seen: BTreeMap::new(),
        };
        let logical = world.logical(POLLER);
        world.pollers.push(logical);
        world
    }

    fn poller(&self, config: &PollerConfig, owner: &str, faulty: bool) -> Poller {
        let role = if faulty { Role::Tick } else { Role::Clean };
        let store = Arc::new(SimStore { shared: self.store.clone(), role });
        let reader = config.poller_name.clone();
        let source = Arc::new(ScriptedSource { shared: self.source.clone(), faulty, reader });
        let sink = Arc::new(ScriptedSink { state: self.sink.clone(), owner: faulty.then(|| owner.to_string()) });
        Poller::new(config.clone(), source, sink, store.clone(), self.clock.clone(), owner.to_string())
            .with_quarantine(store)
    }

    fn instance(&self, config: &PollerConfig, slot: usize, incarnation: u32) -> Arc<Poller> {
        let owner_id = match incarnation {
            0 => OWNERS[slot].to_string(),
            later => format!("{}#{}", OWNERS[slot], later + 1),
        };
        Arc::new(self.poller(config, &owner_id, true))
    }

    fn logical(&self, name: &str) -> Logical {
        let config = config::poller_config(&self.variant, name, self.edited);
        let slots = self.variant.owners as usize;
        let owners = (0..slots).map(|slot| self.instance(&config, slot, 0)).collect();
        let observer = self.poller(&config, "observer", false);
        Logical {
            config,
            owners,
            incarnations: vec![0; slots],
            observer,
            running: BTreeMap::new(),
            excused: BTreeSet::new(),
            failing_streak: 0,
            progress: None,
            last_checkpoint: None,
            last_end: "",
        }
    }

    pub fn now(&self) -> DateTime<Utc> {
        self.clock.now()
    }

    /// The fault-free handle on the store (operators, the invariants).
    pub fn clean_store(&self) -> Arc<SimStore> {
        Arc::new(SimStore { shared: self.store.clone(), role: Role::Clean })
    }

    /// An operator's parts for `config`: the observer's source and receiver, a store handle that
    /// takes the operators' fault script.
    fn operator(&self, config: &PollerConfig) -> Poller {
        let store = Arc::new(SimStore { shared: self.store.clone(), role: Role::Operator });
        let reader = config.poller_name.clone();
        let source = Arc::new(ScriptedSource { shared: self.source.clone(), faulty: false, reader });
        let sink = Arc::new(ScriptedSink { state: self.sink.clone(), owner: None });
        Poller::new(config.clone(), source, sink, store.clone(), self.clock.clone(), "operator".to_string())
            .with_quarantine(store)
    }

    pub fn note_public(&mut self, what: String) {
        self.note(what);
    }

    fn note(&mut self, what: String) {
        let at = (self.now() - self.clock.epoch).num_milliseconds();
        self.trace.push(format!("{at:>8} ms  {what}"));
    }

    pub fn running(&self) -> Vec<(u8, u8)> {
        let mut running = Vec::new();
        for (index, logical) in self.pollers.iter().enumerate() {
            running.extend(logical.running.keys().map(|owner| (index as u8, *owner)));
        }
        running
    }

    pub fn start_tick(&mut self, poller: u8, owner: u8, crash_after_ms: Option<u64>) {
        let Some(logical) = self.pollers.get_mut(poller as usize) else {
            return;
        };
        if logical.running.contains_key(&owner) {
            return;
        }
        let Some(instance) = logical.owners.get(owner as usize).cloned() else {
            return;
        };
        let store = self.store.clone();
        let (sink, poller_name) = (self.sink.clone(), logical.config.poller_name.clone());
        let handle = tokio::spawn(async move {
            let owner_id = instance.owner_id.clone();
            let log_from = store.log_len();
            let started = Instant::now();
            let tick = instance.tick_reported();
            let result = match crash_after_ms {
                None => Some(tick.await),
                Some(ms) => tokio::select! {
                    biased;
                    ended = tick => Some(ended),
                    _ = tokio::time::sleep(Duration::from_millis(ms)) => {
                        // The process dies now: what its detached tasks still send counts for nothing.
                        sink.lock().unwrap().dead.insert((poller_name, owner_id.clone()));
                        None
                    }
                },
            };
            Ended { result, owner_id, log_from, log_to: store.log_len(), took: started.elapsed() }
        });
        logical.running.insert(owner, handle);
    }

    /// Applies one step (time passes only in `Run`, and for a millisecond after any other step so
    /// that what it started gets going).
    pub async fn apply(&mut self, step: &Step) -> Result<(), Violation> {
        match *step {
            Step::Tick { poller, owner, crash_after_ms } => self.start_tick(poller, owner, crash_after_ms),
            Step::Run { ms } => tokio::time::sleep(Duration::from_millis(ms)).await,
            Step::Crash { poller, owner } => {
                if let Some(handle) = self.pollers.get_mut(poller as usize).and_then(|l| l.running.remove(&owner)) {
                    handle.abort();
                    match handle.await {
                        // It had ended already.
                        Ok(ended) => self.ended(poller, owner, ended).await?,
                        Err(error) if error.is_panic() => {
                            return Err(Violation::new("nothing panics", format!("tick {poller}/{owner}: {error}")));
                        }
                        Err(_) => {
                            self.note(format!("{poller}/{owner} crashed"));
                            self.restart(poller, owner);
                        }
                    }
                }
            }
            Step::Insert { rows, poison, slow } => {
                let (generation, keys) = {
                    let mut table = self.source.table.lock().unwrap();
                    (table.generation, table.insert(rows as usize))
                };
                let mut sink = self.sink.lock().unwrap();
                if let Some(key) = poison.and_then(|nth| keys.get(nth as usize)) {
                    sink.poison.insert((generation, *key));
                }
                if let Some(key) = slow.and_then(|nth| keys.get(nth as usize)) {
                    sink.slow.insert((generation, *key));
                }
            }
            Step::Update { nth } => {
                self.source.table.lock().unwrap().update(nth as usize);
            }
            Step::Reload { rows } => self.source.table.lock().unwrap().reload(rows as usize),
            Step::Latency { base_ms, slow_ms } => {
                let mut sink = self.sink.lock().unwrap();
                sink.base_latency = Duration::from_millis(base_ms);
                sink.slow_latency = Duration::from_millis(slow_ms);
            }
            Step::Outage { ms } => {
                self.sink.lock().unwrap().outage_until = Some(Instant::now() + Duration::from_millis(ms))
            }
            Step::Unauthorized { ms } => {
                self.sink.lock().unwrap().unauthorized_until = Some(Instant::now() + Duration::from_millis(ms))
            }
            Step::RefuseRows { ms } => {
                self.sink.lock().unwrap().refuse_rows_until = Some(Instant::now() + Duration::from_millis(ms))
            }
            Step::Timeouts { next } => self.sink.lock().unwrap().timeouts += next as u32,
            Step::Heal => self.sink.lock().unwrap().poison.clear(),
            Step::Store(fault) => self.store.faults.lock().unwrap().push_back(fault),
            Step::OperatorStore(fault) => self.store.operator_faults.lock().unwrap().push_back(fault),
            Step::Conflicts { next } => self.sink.lock().unwrap().conflicts += next as u32,
            Step::Fencing { enforced } => self.sink.lock().unwrap().unfenced = !enforced,
            Step::ReceiverPanic { scripted } => self.sink.lock().unwrap().panic_next = Some(scripted),
            Step::Rival { poller } => self.rival(poller).await,
            Step::Source(fault) => self.source.faults.lock().unwrap().push_back(fault),
            Step::Operator { poller, command } => self.operate(poller, command).await,
            Step::Begin { inserts, update, seen } => {
                self.source.table.lock().unwrap().begin(inserts as usize, update.map(usize::from), seen);
            }
            Step::Commit { nth, poison } => self.commit(nth as usize, poison).await,
        }
        if !matches!(step, Step::Run { .. }) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.collect().await
    }

    /// Reads the ends of the ticks that finished.
    pub async fn collect(&mut self) -> Result<(), Violation> {
        for poller in 0..self.pollers.len() {
            let finished: Vec<u8> = self.pollers[poller]
                .running
                .iter()
                .filter(|(_, handle)| handle.is_finished())
                .map(|(owner, _)| *owner)
                .collect();
            for owner in finished {
                let handle = self.pollers[poller].running.remove(&owner).expect("listed above");
                match handle.await {
                    Ok(ended) => self.ended(poller as u8, owner, ended).await?,
                    Err(error) => {
                        return Err(Violation::new(
                            "nothing panics",
                            format!("the task of tick {poller}/{owner}: {error}"),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    async fn ended(&mut self, poller: u8, owner: u8, ended: Ended) -> Result<(), Violation> {
        let Some((result, report)) = ended.result else {
            self.note(format!("{poller}/{owner} crashed (scripted instant)"));
            self.restart(poller, owner);
            return Ok(());
        };
        let what = match &result {
            Ok(outcome) => format!("{}: {outcome}", outcome.kind()),
            Err(error) => format!("error: {error}"),
        };
        self.note(format!("{poller}/{owner} token {:?} {what}", report.fencing_token));
        self.pollers[poller as usize].last_end = match &result {
            Ok(outcome) => outcome.kind(),
            Err(_) => "error",
        };
        let overlapped = ended.log_from..ended.log_to;
        super::invariants::tick_took(self, poller as usize, &ended.owner_id, ended.took)?;
        super::invariants::after_tick(self, poller as usize, &ended.owner_id, &result, &report, overlapped).await
    }

    /// The `nth` open transaction commits (see [`super::commits`]).
    async fn commit(&mut self, nth: usize, poison: bool) {
        let written = self.source.table.lock().unwrap().commit(nth);
        let versions: Vec<RowId> = written.into_iter().map(|(version, _)| version).collect();
        if poison && let Some(first) = versions.first() {
            self.sink.lock().unwrap().poison.insert((first.generation, first.key));
        }
        if !versions.is_empty() {
            self.note(format!("committed {versions:?}{}", if poison { " (the first refused)" } else { "" }));
        }
        super::commits::committed(self, &versions).await;
    }

    /// The process of `owner` comes back after a crash, with a new lease owner id.
    fn restart(&mut self, poller: u8, owner: u8) {
        let (slot, index) = (owner as usize, poller as usize);
        // The incarnation ends: what its detached tasks still send counts for nothing.
        let gone = (self.pollers[index].config.poller_name.clone(), self.pollers[index].owners[slot].owner_id.clone());
        self.sink.lock().unwrap().dead.insert(gone);
        let incarnation = self.pollers[index].incarnations[slot] + 1;
        let instance = self.instance(&self.pollers[index].config, slot, incarnation);
        let logical = &mut self.pollers[index];
        logical.incarnations[slot] = incarnation;
        logical.owners[slot] = instance;
    }

    /// Another instance writes itself into the lease (token + 1), as one whose clock runs ahead of
    /// the skew margin would; it never delivers.
    async fn rival(&mut self, poller: u8) {
        let Some(logical) = self.pollers.get(poller as usize) else {
            return;
        };
        let key = logical.observer.key();
        let store = self.clean_store();
        let Ok(Some(mut current)) = store.read(&key).await else {
            return;
        };
        let now = self.now();
        let token = current.document.lease.as_ref().map(|lease| lease.fencing_token).unwrap_or(0) + 1;
        current.document.lease = Some(LeaseRecord {
            owner_id: Some("rival".to_string()),
            fencing_token: token,
            acquired_at: Some(now),
            heartbeat_at: Some(now),
            expires_at: Some(now + chrono::Duration::seconds(TTL_SECONDS as i64)),
        });
        current.document.write_id = Some(format!("rival-{token}"));
        let written = store.write(&key, &current.document, WriteCondition::Matches(current.etag)).await;
        self.note(format!("{poller}/rival took the lease with token {token}: {:?}", written.map(|_| ())));
    }

    async fn operate(&mut self, poller: u8, command: Command) {
        if command == Command::EditDefinition {
            self.edit_definition();
            return;
        }
        // A clone is always of the poller, to its copy.
        let index = if command == Command::Clone { 0 } else { poller as usize };
        let Some(logical) = self.pollers.get(index) else {
            return;
        };
        // The operator's parts are the observer's, on the simulation's clock, but for the store
        // handle: it takes the operators' fault script.
        let operator_parts = self.operator(&logical.config);
        let observer = &operator_parts;
        let done = match command {
            Command::ResetToBeginning => operator::reset_to_beginning(observer).await,
            Command::AcceptFingerprint => operator::accept_fingerprint(observer).await,
            Command::ReplayAll => operator::replay_all(observer).await,
            Command::PurgeAll => {
                let (rows, done) = operator::purge_all(observer).await;
                let kept = super::invariants::in_quarantine(self, index).await;
                self.pollers[index].excused.extend(rows.into_iter().filter(|row| !kept.contains(row)));
                done
            }
            Command::Clone => {
                if self.pollers.len() > 1 {
                    Err("the copy exists already".to_string())
                } else {
                    let excused = super::invariants::covered_by_checkpoint(self, 0).await;
                    let done = operator::clone(observer, COPY).await;
                    if done.is_ok() {
                        let mut copy = self.logical(COPY);
                        copy.excused = excused;
                        self.pollers.push(copy);
                        super::commits::cloned(self, POLLER, COPY);
                    }
                    done
                }
            }
            Command::EditDefinition => unreachable!("handled above"),
        };
        if done.is_ok() {
            // An operator acted: whatever kept the poller failing is a new story from here.
            self.pollers[index].failing_streak = 0;
        }
        // An accept that landed but answered an error dropped the window all the same.
        if command == Command::AcceptFingerprint
            && (done.is_ok() || super::invariants::fingerprint_matches(self, index).await)
        {
            super::commits::window_dropped(self, index);
        }
        if command == Command::ResetToBeginning && done.is_ok() {
            self.pollers[index].last_checkpoint = None;
            // A new epoch: what was acknowledged or excused before it accounts for no row.
            self.pollers[index].excused.clear();
            let key = self.pollers[index].observer.key();
            if let Ok(Some(reset)) = self.clean_store().read(&key).await {
                let token = reset.document.lease.map(|lease| lease.fencing_token).unwrap_or(0);
                self.sink.lock().unwrap().epoch_token.insert(key.poller.clone(), token);
            }
        }
        self.note(format!("{index}/operator {command:?}: {done:?}"));
    }

    /// The source definition is edited: every poller (the ones started from now on) gets the new
    /// fingerprint.
    fn edit_definition(&mut self) {
        self.edited = !self.edited;
        for index in 0..self.pollers.len() {
            let name = self.pollers[index].config.poller_name.clone();
            let fresh = self.logical(&name);
            let incarnations = self.pollers[index].incarnations.clone();
            let owners = incarnations
                .iter()
                .enumerate()
                .map(|(slot, incarnation)| self.instance(&fresh.config, slot, *incarnation))
                .collect();
            let logical = &mut self.pollers[index];
            logical.config = fresh.config;
            logical.owners = owners;
            logical.observer = fresh.observer;
        }
        self.note(format!("definition edited (edited: {})", self.edited));
    }

    /// Lets every running tick end (their ends read every second); a tick must end within its budget
    /// (and a minute for the reads and writes that do not look at it).
    async fn wait_for_ticks(&mut self) -> Result<(), Violation> {
        let limit = self.variant.tick_budget_seconds + 60;
        for _ in 0..limit {
            if self.running().is_empty() {
                return super::invariants::check(self).await;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            self.collect().await?;
        }
        if self.running().is_empty() {
            return super::invariants::check(self).await;
        }
        Err(Violation::new(
            "a tick ends within its budget",
            format!("still running after {limit} s: {:?}", self.running()),
        ))
    }

    /// Faults off (the receiver keeps its latency and its poison rows), every lease expired, then
    /// ticks of one owner until each poller is caught up.
    pub async fn quiesce(&mut self) -> Result<(), Violation> {
        self.note("quiesce: faults off".to_string());
        {
            let mut sink = self.sink.lock().unwrap();
            sink.outage_until = None;
            sink.unauthorized_until = None;
            sink.refuse_rows_until = None;
            sink.timeouts = 0;
        }
        self.store.faults.lock().unwrap().clear();
        self.store.operator_faults.lock().unwrap().clear();
        self.sink.lock().unwrap().conflicts = 0;
        self.source.faults.lock().unwrap().clear();
        // Every open transaction commits (a bounded loop: each commit closes one).
        for _ in 0..super::source::MAX_OPEN {
            self.commit(0, false).await;
        }
        self.wait_for_ticks().await?;
        for index in 0..self.pollers.len() {
            let rows = self.source.table.lock().unwrap().rows.len();
            let limit = 20 + 3 * rows + super::commits::IDLE_TICKS_TO_SWEEP + super::budget::HOLD_TICKS;
            let mut caught_up = false;
            // Idle ticks in a row: the detector's sweep over the older buckets needs a full turn.
            let mut idle = 0;
            for _ in 0..limit {
                // Past any lease a crashed tick or a rival left.
                tokio::time::sleep(Duration::from_secs(TTL_SECONDS + 10)).await;
                if !super::invariants::fingerprint_matches(self, index).await {
                    self.operate(index as u8, Command::AcceptFingerprint).await;
                }
                self.start_tick(index as u8, 0, None);
                self.wait_for_ticks().await?;
                idle = if self.pollers[index].last_end == "idle" { idle + 1 } else { 0 };
                if idle >= super::commits::IDLE_TICKS_TO_SWEEP {
                    caught_up = true;
                    break;
                }
            }
            if !caught_up {
                return Err(Violation::new(
                    "caught up after quiesce",
                    format!("poller {index} did not catch up in {limit} ticks with every fault off"),
                ));
            }
        }
        super::invariants::complete(self).await
    }
}
