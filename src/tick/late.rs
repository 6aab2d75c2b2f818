//! The late-arrival detector in the tick ([`crate::domain::late`] decides, this file acts).
//!
//! - **Record**: every commit extends the window of the state document with the keys of the rows
//!   it covers ([`Poller::record_late`]), in the same compare-and-swap.
//! - **Check**: at one tick in `everyTicks`, before the first fetch, the source recounts the
//!   fresh buckets and a slice of the older ones in one query ([`Poller::check_late`],
//!   [`late::sweep`]: the turn over the older ones is kept in memory). Reading only, no lease.
//! - **Deliver**: buckets that grew are delivered again under the tick's lease, after the tick's
//!   own batches (so that a late batch that keeps failing never holds up new rows): the one new row
//!   when its hash names it, else the bucket's rows page by page, each page a batch with
//!   `late: true` and the event ids those rows always had, through the same sink and deadline.
//!   After each bucket one write (by CAS, renewing the lease) records its new tally and the
//!   finding. A refused late batch goes through the refusal handling of any batch
//!   ([`late_refused`](super::late_refused): isolated, a row refused alone quarantined or, with
//!   `poison.mode: stop`, held; an endpoint's refusal held). A failed delivery fails the tick
//!   (recorded for status and the watchdog, and kept recorded until it is delivered); the bucket
//!   is marked undelivered (never pruned from the window, checked at every tick). The checkpoint
//!   never moves here.
//! - Buckets that shrank (rows updated past the checkpoint, or deleted) are adopted when the
//!   moments say the versions that left explain the recount ([`late::moments`]); one where a
//!   version also came is late; one they cannot decide is delivered again when small, else
//!   adopted with a warning.

use std::sync::atomic::Ordering;

use tracing::{info, warn};

use crate::domain::StateDocument;
use crate::domain::late::{self, CheckPlan, KeyRow, LateBucket, LateRecord, Tally};
use crate::domain::lease;
use crate::domain::transitions;
use crate::domain::{CursorValue, Position};
use crate::sink::SinkError;
use crate::source::{BucketCheck, BucketRange, FetchLimit, SourceRow};
use crate::store::{StateWriter, WriteFailure};

use super::Poller;
use super::budget;
use super::outcome::{LateCheck, TickError};
use super::reader::{BatchMaker, Prepared};
use super::timer::runtime_deadline;

/// What a check found, and the checkpoint it was made behind.
pub(super) struct LateFound {
    pub(super) plan: CheckPlan,
    pub(super) checkpoint: Position,
    /// The bucket marked undelivered is not late any more (its rows delivered or gone): clear it.
    pub(super) clear_undelivered: bool,
}

impl LateFound {
    /// Buckets to deliver again (a lease is needed).
    pub(super) fn has_late(&self) -> bool {
        !self.plan.late.is_empty()
    }
}

impl Poller {
    /// The keys of `positions` as the window counts them (none while the detector is off).
    pub(super) fn late_keys(&self, positions: &[Position]) -> Vec<KeyRow> {
        if !self.config.late_arrivals.enabled {
            return Vec::new();
        }
        positions.iter().map(KeyRow::of).collect()
    }

    /// Extends `next`'s window (a commit from `before`) with the rows it covers.
    pub(super) fn record_late(&self, before: &StateDocument, next: &mut StateDocument, keys: &[&[KeyRow]]) {
        if !self.config.late_arrivals.enabled {
            if let Some(record) = next.late.as_mut() {
                record.window = None;
            }
            return;
        }
        let Some(checkpoint) = next.checkpoint.as_ref() else {
            return;
        };
        let previous_position = before.position().ok().flatten();
        let previous = before
            .checkpoint
            .as_ref()
            .zip(previous_position.as_ref())
            .map(|(checkpoint, position)| (position, checkpoint.last_successful_batch_id.as_str()));
        next.late = Some(late::extend(
            before.late.as_ref(),
            previous,
            keys,
            &checkpoint.last_successful_batch_id,
            &self.config.late_arrivals.policy(),
            self.clock.now(),
        ));
    }

    /// The recount, when one is due at this tick and the window reaches the checkpoint. A recount
    /// that fails is reported (a warning, and `late_check=failed` in the summary line) but does not
    /// fail the tick: the rows after the checkpoint are delivered all the same.
    pub(super) async fn check_late(&self, document: &StateDocument) -> Option<LateFound> {
        let config = &self.config.late_arrivals;
        if !config.enabled {
            // Turned off with a bucket marked undelivered: nothing delivers it now, so the mark
            // (and the failure it keeps visible) goes, said once here.
            let marked = document.late.as_ref().and_then(|record| record.undelivered.as_ref()).is_some();
            let position = document.position().ok().flatten().filter(|_| marked)?;
            warn!(
                poller = %self.config.poller_name,
                "late arrivals are turned off: the late bucket still undelivered is dropped, its rows are not delivered"
            );
            let plan = late::CheckPlan { late: Vec::new(), shrunk: Vec::new() };
            return Some(LateFound { plan, checkpoint: position, clear_undelivered: true });
        }
        let tick = self.late_ticks.fetch_add(1, Ordering::Relaxed);
        // A late bucket whose delivery failed is checked at every tick until delivered: the
        // failure stays visible, and the bucket in the window.
        let undelivered = document.late.as_ref().and_then(|record| record.undelivered.as_ref()).is_some();
        if !undelivered && !tick.is_multiple_of(u64::from(config.every_ticks)) {
            return None;
        }
        let checkpoint = document.checkpoint.as_ref()?;
        let window = document.late.as_ref()?.window.as_ref()?;
        if window.checkpoint_batch != checkpoint.last_successful_batch_id || window.buckets.is_empty() {
            return None;
        }
        let position = document.position().ok().flatten()?;
        let froms = match late::bounds(window) {
            Ok(froms) => froms,
            Err(reason) => {
                warn!(poller = %self.config.poller_name, "the late-arrival window cannot be read ({reason}): a new one starts");
                return None;
            }
        };
        let sweep = self.late_sweep.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        // A turn not begun starts at a bucket picked by the clock: a process restarted often does
        // not always recount the same ones first.
        let start = self.clock.now().timestamp_millis().unsigned_abs();
        let mut selection = late::sweep::select(window, &sweep, config.sweep_checks, start);
        if undelivered {
            // Every bucket, so that the undelivered one (however old) is among them.
            selection.indices = (0..window.buckets.len()).collect();
            selection.sweep = sweep;
        }
        let tallies = match self.recount(&froms, &selection.indices, &position).await {
            Ok(Some(tallies)) => tallies,
            Ok(None) => return None,
            Err(error) => {
                warn!(poller = %self.config.poller_name, error = %error, "the late-arrival check failed; delivering on without it");
                self.learn(|learnt| learnt.late_check = LateCheck::Failed);
                return None;
            }
        };
        self.learn(|learnt| learnt.late_check = LateCheck::Checked);
        *self.late_sweep.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = selection.sweep;
        match late::plan_partial(window, &selection.indices, &tallies) {
            Ok(plan) if plan.is_empty() && !undelivered => None,
            Ok(plan) => {
                let marked = document.late.as_ref().and_then(|record| record.undelivered.as_ref());
                let marked = marked.and_then(|bucket| bucket.from_cursor(&window.kind).ok());
                // The late bucket that holds the marked one (merged into an older one since, maybe).
                let holds = |late: &late::LateBucket, marked: &CursorValue| {
                    let from_before =
                        late.from.compare(marked).is_some_and(|order| order != std::cmp::Ordering::Greater);
                    let until_after = match &late.until {
                        late::BucketEnd::Checkpoint => true,
                        late::BucketEnd::Before(until) => {
                            until.compare(marked).is_some_and(|order| order == std::cmp::Ordering::Greater)
                        }
                    };
                    from_before && until_after
                };
                let clear_undelivered = marked.is_some_and(|marked| !plan.late.iter().any(|late| holds(late, &marked)));
                Some(LateFound { plan, checkpoint: position, clear_undelivered })
            }
            Err(reason) => {
                warn!(poller = %self.config.poller_name, "the late-arrival check cannot be compared: {reason}");
                None
            }
        }
    }

    /// The tallies of the buckets `indices` (the old ones the sweep reached, and the fresh ones),
    /// each over its own range, in one query: a row updated from one fresh bucket into another
    /// leaves one and grows the other, which a total over the fresh ones together would not show.
    async fn recount(
        &self,
        froms: &[CursorValue],
        indices: &[usize],
        checkpoint: &Position,
    ) -> Result<Option<Vec<Tally>>, crate::source::SourceError> {
        let ranges = indices.iter().map(|index| (froms[*index].clone(), late::end_of(froms, *index))).collect();
        let check = BucketCheck { ranges, checkpoint: checkpoint.clone() };
        self.source.tally_buckets(&check).await
    }

    /// `document` with the buckets that shrank adopted (`false`: none did).
    pub(super) fn adopt_shrunk(&self, document: &mut StateDocument, found: &LateFound) -> bool {
        let Some(mut record) = document.late.clone() else {
            return false;
        };
        if found.plan.shrunk.is_empty() && !found.clear_undelivered {
            return false;
        }
        if found.clear_undelivered {
            record.undelivered = None;
            record.undelivered_after = None;
        }
        for shrunk in &found.plan.shrunk {
            if shrunk.undecided {
                warn!(
                    poller = %self.config.poller_name,
                    bucket = %shrunk.from.to_json(),
                    rows_before = shrunk.recorded.rows,
                    rows_now = shrunk.found.rows,
                    "a late-arrival bucket lost too many rows since its last recount to tell whether one also arrived; adopted (a row committed late there is not found)"
                );
            }
            record = late::adopt(&record, &shrunk.from, shrunk.recorded, shrunk.found);
        }
        document.late = Some(record);
        true
    }

    /// Delivers the late buckets again, under the lease this tick holds; records each one as it is
    /// delivered. Stops (leaving the rest to the next check) at the tick's deadline or when the
    /// lease cannot be kept.
    pub(super) async fn deliver_late(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        found: LateFound,
        maker: &BatchMaker,
        deadline: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), TickError> {
        for bucket in &found.plan.late {
            if self.clock.now() >= deadline {
                warn!(poller = %self.config.poller_name, "the tick budget ran out before every late bucket was delivered; the next check finds the rest");
                // Marked, so that the bucket (and every one after it) stays in the window and
                // every tick checks it until it is delivered.
                if let Some(record) = document.late.as_ref() {
                    document.late = Some(late::mark_undelivered(record, &bucket.from, self.clock.now()));
                }
                break;
            }
            let delivered = self.deliver_bucket(writer, document, bucket, &found.checkpoint, maker, deadline).await;
            let Some((delivered, late_rows, lateness_of)) = (match delivered {
                Ok(delivered) => delivered,
                Err(error) => {
                    // Kept in the window and checked at every tick until delivered; the tick's
                    // failure record (written as it ends) carries this with it.
                    if let Some(record) = document.late.as_ref() {
                        document.late = Some(late::mark_undelivered(record, &bucket.from, self.clock.now()));
                    }
                    return Err(error);
                }
            }) else {
                return Ok(());
            };
            let now = self.clock.now();
            let naive_is_utc = self.config.source.cursor_time_zone == "UTC";
            let lateness = late::lateness_seconds(now, &lateness_of, bucket.since, naive_is_utc);
            let record = document.late.clone().unwrap_or_default();
            let next_record =
                late::after_redelivery(&record, &bucket.from, bucket.recorded, delivered, late_rows, lateness, now);
            if !self.write_late(writer, document, next_record).await? {
                return Ok(());
            }
            warn!(
                poller = %self.config.poller_name,
                late_rows,
                lateness_seconds = lateness,
                bucket = %bucket.from.to_json(),
                "rows committed behind the checkpoint were found and delivered (late: true)"
            );
            self.learn(|learnt| {
                learnt.late_arrivals += late_rows;
                learnt.max_lateness_seconds = Some(learnt.max_lateness_seconds.unwrap_or(0).max(lateness));
            });
        }
        Ok(())
    }

    /// Delivers one late bucket: its one new row, if its hash names one row, else every row of the
    /// bucket. `None`: the lease could not be kept, stop. Otherwise the tally of what was
    /// delivered's bucket, the rows counted late, and the cursor lateness is measured from.
    async fn deliver_bucket(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        bucket: &LateBucket,
        checkpoint: &Position,
        maker: &BatchMaker,
        deadline: chrono::DateTime<chrono::Utc>,
    ) -> Result<Option<(Tally, u64, CursorValue)>, TickError> {
        let range = |only| BucketRange {
            from: bucket.from.clone(),
            until: bucket.until.clone(),
            checkpoint: checkpoint.clone(),
            only,
        };
        let reservations = self.reservations();
        if let Some(hash) = bucket.single {
            // Late batches hold the app's byte budget as any batch does, while read and sent.
            let mut hold = reservations.reserve(self.fetch_limit().bytes).await;
            let limit = FetchLimit { rows: 2, bytes: self.fetch_limit().bytes };
            let found = self.source.read_bucket(&range(Some(hash)), None, limit).await?;
            hold.keep(budget::rows_bytes(&found.rows));
            if let [row] = found.rows.as_slice() {
                let cursor = row.position.cursor.clone();
                let sent = self.send_late(writer, document, found.rows, maker, deadline, &mut 0).await?;
                drop(hold);
                if !sent {
                    return Ok(None);
                }
                let mut tally = bucket.recorded;
                tally.add(hash);
                return Ok(Some((tally, 1, cursor)));
            }
        }
        // Every row of the bucket, page by page; what is delivered becomes its tally. A
        // redelivery an earlier tick left midway goes on where it got to; a failure here records
        // how far this one got (a bucket longer to deliver than a tick budget still gets there).
        let whole = range(None);
        let resumed = document.late.as_ref().and_then(|record| late::progress(record, &bucket.from));
        let (mut after, mut tally) = match resumed {
            Some((after, tally)) => (Some(after), tally),
            None => (None, Tally::default()),
        };
        let mut oldest: Option<CursorValue> = None;
        loop {
            let mut hold = reservations.reserve(self.fetch_limit().bytes).await;
            let page = self.source.read_bucket(&whole, after.as_ref(), self.fetch_limit()).await?;
            hold.keep(budget::rows_bytes(&page.rows));
            let Some(last) = page.rows.last() else {
                break;
            };
            let last = last.position.clone();
            let mut page_tally = tally;
            for row in &page.rows {
                page_tally.add(KeyRow::of(&row.position).hash);
            }
            if oldest.is_none() {
                oldest = page.rows.first().map(|row| row.position.cursor.clone());
            }
            let more = page.full;
            let positions: Vec<Position> = page.rows.iter().map(|row| row.position.clone()).collect();
            // Rows of the page settled (delivered or quarantined) when its isolation stopped.
            let mut settled = 0;
            let sent = match self.send_late(writer, document, page.rows, maker, deadline, &mut settled).await {
                Ok(sent) => sent,
                Err(error) => {
                    let settled = settled.min(positions.len());
                    for position in &positions[..settled] {
                        tally.add(KeyRow::of(position).hash);
                    }
                    let got_to = if settled > 0 { Some(&positions[settled - 1]) } else { after.as_ref() };
                    if let (Some(record), Some(got_to)) = (document.late.as_ref(), got_to) {
                        let now = self.clock.now();
                        document.late = Some(late::mark_progress(record, &bucket.from, got_to, tally, now));
                    }
                    return Err(error);
                }
            };
            drop(hold);
            if !sent {
                return Ok(None);
            }
            after = Some(last);
            tally = page_tally;
            if !more {
                break;
            }
        }
        let lateness_of = oldest.unwrap_or_else(|| bucket.from.clone());
        Ok(Some((tally, bucket.late_rows, lateness_of)))
    }

    /// Sends `rows` as one late batch, renewing the lease first when a heartbeat is due; a refusal
    /// is handled as any batch's ([`late_refused`](super::late_refused)). `false`: the lease could
    /// not be kept. When it fails, `settled` says how many of its first rows were settled.
    async fn send_late(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        rows: Vec<SourceRow>,
        maker: &BatchMaker,
        deadline: chrono::DateTime<chrono::Utc>,
        settled: &mut usize,
    ) -> Result<bool, TickError> {
        let Some((prepared, sent)) = self.try_late(writer, document, rows.clone(), maker, deadline).await? else {
            return Ok(false);
        };
        match sent {
            Ok(()) => Ok(true),
            Err(error) => self.late_refused(writer, document, rows, prepared, error, maker, deadline, settled).await,
        }
    }

    /// One attempt at `rows` as a late batch, renewing the lease first when a heartbeat is due:
    /// the batch and how the receiver answered. `None`: the lease could not be kept.
    pub(super) async fn try_late(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        rows: Vec<SourceRow>,
        maker: &BatchMaker,
        deadline: chrono::DateTime<chrono::Utc>,
    ) -> Result<Option<(Prepared, Result<(), SinkError>)>, TickError> {
        let terms = &self.config.lease;
        let Some(current) = document.lease.clone() else {
            return Ok(None);
        };
        let now = self.clock.now();
        if lease::next_heartbeat_due(&current, terms).is_some_and(|due| now >= due)
            && !matches!(self.heartbeat(writer, document).await, Ok(true))
        {
            return Ok(None);
        }
        let current = document.lease.clone().expect("the lease is held");
        if !lease::holder_may_act(&current, &self.owner_id, self.clock.now(), terms) {
            return Ok(None);
        }
        let mut prepared = maker.prepare(rows);
        prepared.batch.late = true;
        let sink_deadline = runtime_deadline(deadline, self.clock.now());
        let sent = self.sink.deliver(&prepared.batch, sink_deadline).await;
        if sent.is_ok() {
            info!(
                poller = %self.config.poller_name,
                batch = %prepared.batch.batch_id,
                rows = prepared.positions.len(),
                "late batch delivered"
            );
        }
        Ok(Some((prepared, sent)))
    }

    /// Writes `record` as the document's `late`, renewing the lease, by CAS. `false`: the lease is
    /// not ours any more.
    async fn write_late(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        record: LateRecord,
    ) -> Result<bool, TickError> {
        let Ok(mut next) = transitions::heartbeat(document, &self.owner_id, self.clock.now(), &self.config.lease)
        else {
            writer.lost = true;
            return Ok(false);
        };
        next.late = Some(record);
        match writer.write(&mut next).await {
            Ok(()) => {
                *document = next;
                Ok(true)
            }
            Err(WriteFailure::Conflict(_)) => {
                writer.lost = true;
                Ok(false)
            }
            Err(WriteFailure::Store(error)) => Err(error.into()),
        }
    }
}
