//! The late-arrival detector (design "Commit horizon and late arrivals"): what the state document
//! keeps of the rows delivered behind the checkpoint, and what a recount by the database says.
//!
//! A keyset poller can pass a row whose transaction is still open: when it commits, its cursor is
//! behind the checkpoint and no seek reads it again. The detector keeps, after each commit, a
//! **window** of the rows delivered last (the last 15 minutes of cursor time, the last 100,000
//! rows, at most [`MAX_BUCKETS`] buckets: a few kilobytes), cut into **buckets** by cursor value. A
//! bucket holds every row from its `from` cursor up to the next bucket's (the last one up to the
//! checkpoint), and records how many rows were delivered there and two sums of their row
//! versions' hashes (the key and the cursor value, [`hash`]): a row updated behind the checkpoint
//! is a version that left and one that came. A check asks the database for the same numbers over the same ranges, in one
//! grouped query; [`plan_check`] compares them:
//!
//! | the database has            | it means                                              | done            |
//! |-----------------------------|-------------------------------------------------------|-----------------|
//! | the same rows and sums      | nothing arrived                                       | nothing         |
//! | more rows                   | rows committed late (and maybe others left)           | late: delivered |
//! | as many rows, other sums    | keys arrived and as many left                         | late: delivered |
//! | 1-3 fewer, moments follow   | rows were updated (moved past the checkpoint) or deleted | record adopted |
//! | 1-3 fewer, moments do not   | rows left and at least one came late                  | late: delivered |
//! | 4 or more fewer             | cannot be told ([`moments`])                          | small: delivered again, uncounted; large: adopted, warned |
//!
//! A bucket that grew by one row whose hash is the difference of the sums has that one row
//! delivered; otherwise the whole bucket is delivered again (same event ids, `late: true`), and
//! its record becomes what was delivered. The moments (`Σv²`, `Σv³`, `Σv⁴` mod P) tell versions
//! that left from one that came whenever at most four left between two recounts
//! (docs/late-arrivals.md, issue 45).
//!
//! The window is tied to the checkpoint it was extended to (`checkpoint_batch`): a checkpoint moved
//! by anything else (a reset, a clone, a build that does not keep the window) makes it stale, and
//! the next commit starts a new one.

pub mod hash;
pub mod moments;
pub mod sweep;

use std::cmp::Ordering;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::cursor::{CursorJson, CursorValue, Position};
pub use hash::{KeyHash, KeyHashKind, key_hash, position_key_hash, version_hash};

/// At most this many buckets are kept, whatever the window: it bounds the state document (a
/// bucket is about 200 bytes of JSON).
pub const MAX_BUCKETS: usize = 32;

/// An old bucket holds at most a sixteenth of the window (in time, and in rows).
const BUCKETS_PER_WINDOW: i64 = 16;

/// The newest buckets, recounted at every check ([`sweep`]): where late commits land.
pub const FRESH_BUCKETS: usize = 4;

/// A bucket closes after this many rows (or a sixteenth of the window, if fewer), so that the
/// fresh buckets are small; once older than the newest [`FRESH_BUCKETS`], neighbours merge up to a
/// sixteenth of the window ([`compact`]).
pub const FRESH_BUCKET_ROWS: u64 = 16;

/// How much of the past the detector covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowPolicy {
    /// The cursor time behind the checkpoint covered, for timestamp cursors.
    pub span: chrono::Duration,
    /// The rows behind the checkpoint covered, for every cursor.
    pub rows: u64,
}

/// A bucket's row count, key sums and moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tally {
    pub rows: u64,
    pub sum_u: u64,
    pub sum_v: u64,
    /// The sums of `v²`, `v³` and `v⁴` modulo P over the bucket's versions ([`moments`]): what
    /// tells the versions that left a bucket from one that came when its count shrank. Absent in
    /// a window an earlier build wrote: such a bucket gets them at its next recount.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moments: Option<[u64; 3]>,
}

impl Default for Tally {
    /// An empty bucket's tally (with its moments: zero).
    fn default() -> Tally {
        Tally { rows: 0, sum_u: 0, sum_v: 0, moments: Some([0; 3]) }
    }
}

impl Tally {
    /// A tally of these numbers, without moments (as an earlier build recorded).
    pub fn counted(rows: u64, sum_u: u64, sum_v: u64) -> Tally {
        Tally { rows, sum_u, sum_v, moments: None }
    }

    pub fn add(&mut self, hash: KeyHash) {
        self.rows += 1;
        self.sum_u += u64::from(hash.u);
        self.sum_v += u64::from(hash.v);
        if let Some(sums) = self.moments.as_mut() {
            for (sum, power) in sums.iter_mut().zip(moments::powers(hash.v)) {
                *sum += power;
            }
        }
    }

    /// The tally of two ranges together.
    pub fn plus(&self, other: &Tally) -> Tally {
        let moments = match (self.moments, other.moments) {
            (Some(a), Some(b)) => Some([a[0] + b[0], a[1] + b[1], a[2] + b[2]]),
            _ => None,
        };
        Tally {
            rows: self.rows + other.rows,
            sum_u: self.sum_u + other.sum_u,
            sum_v: self.sum_v + other.sum_v,
            moments,
        }
    }

    /// `recount`, plus what was added to this tally since it was `checked`.
    fn rebased(&self, checked: &Tally, recount: &Tally) -> Tally {
        let moments = if self == checked {
            recount.moments
        } else {
            match (recount.moments, self.moments, checked.moments) {
                (Some(found), Some(now), Some(then)) => {
                    Some(std::array::from_fn(|index| found[index] + now[index].saturating_sub(then[index])))
                }
                _ => None,
            }
        };
        Tally {
            rows: recount.rows + self.rows.saturating_sub(checked.rows),
            sum_u: recount.sum_u + self.sum_u.saturating_sub(checked.sum_u),
            sum_v: recount.sum_v + self.sum_v.saturating_sub(checked.sum_v),
            moments,
        }
    }
}

/// One bucket of the window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    /// The cursor value of the bucket's first row, as the checkpoint stores a cursor.
    pub from: Value,
    /// SQLite: the text that row stored, bound back so that the ranges agree with SQLite's order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_text: Option<String>,
    #[serde(flatten)]
    pub tally: Tally,
    /// When its first row was committed: how late a row of an integer cursor is.
    pub since: DateTime<Utc>,
}

/// What a window's sums are sums of: [`WINDOW_IDENTITY`] for row versions (the key and the cursor
/// value); a window of another identity (an earlier build's, of keys alone) is stale.
pub const WINDOW_IDENTITY: u32 = 2;

/// The buckets behind the checkpoint, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Window {
    /// The cursor kind of the buckets' `from` values.
    pub kind: String,
    /// What the sums are sums of ([`WINDOW_IDENTITY`]; absent: keys alone, an earlier build's).
    #[serde(default)]
    pub identity: u32,
    /// `last_successful_batch_id` of the checkpoint this window reaches: it is stale otherwise.
    pub checkpoint_batch: String,
    pub buckets: Vec<Bucket>,
}

/// The state document's `late`: the window, and what the detector found so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LateRecord {
    /// Rows found late and delivered, in all (a lower bound when a whole bucket was delivered).
    #[serde(default)]
    pub found: u64,
    /// The most seconds a late row was found after its cursor time (integer cursors: after the
    /// checkpoint passed it): what `settleSeconds` would have had to be.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lateness_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_found_at: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<Window>,
    /// A bucket found late whose delivery failed (its `from`; its tally is not used): the window
    /// keeps it however old it grows, and every tick checks until it is delivered or its rows
    /// are gone, so that its rows are never dropped from the window undelivered (issue 35).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undelivered: Option<Bucket>,
    /// How far the undelivered bucket's redelivery got: its rows up to this position were
    /// delivered (their tally is then the mark's `tally`), so the next tick goes on after it
    /// instead of starting over (a bucket longer to deliver than a tick budget would otherwise
    /// never be delivered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undelivered_after: Option<CursorJson>,
    /// Fields of a newer build, kept.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One delivered row, as the window counts it.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRow {
    pub cursor: CursorValue,
    pub hash: KeyHash,
}

impl KeyRow {
    pub fn of(position: &Position) -> KeyRow {
        KeyRow {
            cursor: position.cursor.clone(),
            hash: version_hash(position_key_hash(&position.pk), &position.cursor),
        }
    }
}

impl Bucket {
    /// The bucket's lower bound as a cursor value of `kind`.
    pub fn from_cursor(&self, kind: &str) -> Result<CursorValue, String> {
        let json = CursorJson {
            kind: kind.to_string(),
            value: self.from.clone(),
            source_text: self.from_text.clone(),
            tiebreaker: Map::new(),
        };
        Position::try_from(&json).map(|position| position.cursor)
    }

    fn starting_at(cursor: &CursorValue, now: DateTime<Utc>) -> Bucket {
        let json = CursorJson::from(&Position { cursor: cursor.clone(), pk: Vec::new() });
        Bucket { from: json.value, from_text: json.source_text, tally: Tally::default(), since: now }
    }
}

/// A cursor's instant, for the window's span (naive timestamps read as UTC: only differences are
/// taken). Integer cursors have none.
fn instant(cursor: &CursorValue) -> Option<DateTime<Utc>> {
    match cursor {
        CursorValue::Integer(_) | CursorValue::Xid(_) => None,
        CursorValue::Timestamp { at, .. } => Some(*at),
        CursorValue::NaiveTimestamp(at) => Some(at.and_utc()),
    }
}

/// The window after a commit of `rows` (in delivery order) moved the checkpoint from `previous`
/// (its position and batch id, if any) to the batch `checkpoint_batch`.
///
/// A window that does not reach `previous` is stale and dropped. A new window starts at the first
/// row whose cursor is after the previous checkpoint's: rows of the same cursor delivered before
/// it are not in it, and a range that began at that cursor would count them as late.
pub fn extend(
    record: Option<&LateRecord>,
    previous: Option<(&Position, &str)>,
    rows: &[&[KeyRow]],
    checkpoint_batch: &str,
    policy: &WindowPolicy,
    now: DateTime<Utc>,
) -> LateRecord {
    let mut next = record.cloned().unwrap_or_default();
    let mut window = next.window.take().filter(|window| {
        window.identity == WINDOW_IDENTITY && previous.is_some_and(|(_, batch)| batch == window.checkpoint_batch)
    });
    let kept = window.is_some();
    let rows_per_bucket = (policy.rows / BUCKETS_PER_WINDOW as u64).clamp(1, FRESH_BUCKET_ROWS);
    let span_per_bucket = policy.span / BUCKETS_PER_WINDOW as i32;
    // The open bucket's first instant, parsed once (timestamps only).
    let mut open_from: Option<DateTime<Utc>> = window
        .as_ref()
        .and_then(|window| window.buckets.last().and_then(|bucket| bucket.from_cursor(&window.kind).ok()))
        .as_ref()
        .and_then(instant);
    let mut last_cursor: Option<&CursorValue> = previous.map(|(position, _)| &position.cursor);
    for row in rows.iter().flat_map(|part| part.iter()) {
        let same_cursor_as_last = last_cursor.is_some_and(|last| last.compare(&row.cursor) == Some(Ordering::Equal));
        last_cursor = Some(&row.cursor);
        let opens = match window.as_ref() {
            // A new window skips the rows of the previous checkpoint's cursor.
            None if same_cursor_as_last => continue,
            None => true,
            Some(window) if window.kind != row.cursor.kind() => true,
            Some(window) => match window.buckets.last() {
                None => true,
                // Rows of one cursor value stay in one bucket: a range cannot split them.
                Some(_) if same_cursor_as_last => false,
                Some(open) => {
                    let full = open.tally.rows >= rows_per_bucket;
                    let old = match (open_from, instant(&row.cursor)) {
                        (Some(from), Some(at)) => at - from >= span_per_bucket,
                        _ => false,
                    };
                    full || old
                }
            },
        };
        if opens {
            let kind = row.cursor.kind();
            let fresh = || Window {
                kind: kind.to_string(),
                identity: WINDOW_IDENTITY,
                checkpoint_batch: String::new(),
                buckets: Vec::new(),
            };
            let window = window.get_or_insert_with(fresh);
            if window.kind != kind {
                // The cursor's kind changed (the column's type did): start again.
                *window = fresh();
            }
            window.buckets.push(Bucket::starting_at(&row.cursor, now));
            open_from = instant(&row.cursor);
        }
        let window = window.as_mut().expect("a bucket is open");
        window.buckets.last_mut().expect("a bucket is open").tally.add(row.hash);
    }
    if let Some(window) = window.as_mut() {
        window.checkpoint_batch = checkpoint_batch.to_string();
        compact(window, policy);
        let keep = next.undelivered.as_ref().and_then(|bucket| bucket.from_cursor(&window.kind).ok());
        prune(window, last_cursor, keep.as_ref(), policy);
    }
    if !kept {
        // A stale window (the checkpoint moved by other means): its undelivered bucket goes too.
        next.undelivered = None;
        next.undelivered_after = None;
    }
    next.window = window;
    next
}

/// Merges neighbours older than the newest [`FRESH_BUCKETS`] while the merged bucket holds at most
/// a sixteenth of the window's rows and (timestamps) starts less than a sixteenth of its span
/// before the next: fresh buckets are small, old ones few. A merged bucket keeps the older one's
/// `from` and `since`; counts and sums add, so nothing is lost but where a late row lies within it.
pub fn compact(window: &mut Window, policy: &WindowPolicy) {
    let rows_per_bucket = (policy.rows / BUCKETS_PER_WINDOW as u64).max(1);
    let span_per_bucket = policy.span / BUCKETS_PER_WINDOW as i32;
    let instants: Vec<Option<DateTime<Utc>>> =
        window.buckets.iter().map(|bucket| bucket.from_cursor(&window.kind).ok().as_ref().and_then(instant)).collect();
    let old = window.buckets.len().saturating_sub(FRESH_BUCKETS);
    let mut kept: Vec<Bucket> = Vec::with_capacity(window.buckets.len());
    let mut kept_from: Option<DateTime<Utc>> = None;
    for (index, bucket) in window.buckets.drain(..).enumerate() {
        if index < old
            && let Some(last) = kept.last_mut()
        {
            let fits = last.tally.rows + bucket.tally.rows <= rows_per_bucket;
            let close = match (kept_from, instants[index]) {
                (Some(from), Some(at)) => at - from < span_per_bucket,
                _ => true,
            };
            if fits && close {
                last.tally = last.tally.plus(&bucket.tally);
                continue;
            }
        }
        kept_from = instants[index];
        kept.push(bucket);
    }
    window.buckets = kept;
}

/// Drops the oldest buckets beyond the window: past [`MAX_BUCKETS`], past the rows it covers, and
/// (timestamps) wholly older than its span behind `newest`; never the bucket that holds `keep`
/// (an undelivered late bucket's first cursor) nor any after it.
fn prune(window: &mut Window, newest: Option<&CursorValue>, keep: Option<&CursorValue>, policy: &WindowPolicy) {
    // Bucket 0 may go only if the next one starts at or before `keep`.
    let may_drop_first = |window: &Window| match keep {
        None => true,
        Some(keep) => window
            .buckets
            .get(1)
            .and_then(|next| next.from_cursor(&window.kind).ok())
            .and_then(|next| next.compare(keep))
            .is_some_and(|order| order != Ordering::Greater),
    };
    let mut excess = window.buckets.len().saturating_sub(MAX_BUCKETS);
    while excess > 0 && may_drop_first(window) {
        window.buckets.remove(0);
        excess -= 1;
    }
    let mut total: u64 = window.buckets.iter().map(|bucket| bucket.tally.rows).sum();
    while window.buckets.len() > 1 && total - window.buckets[0].tally.rows >= policy.rows && may_drop_first(window) {
        total -= window.buckets[0].tally.rows;
        window.buckets.remove(0);
    }
    let Some(newest) = newest.and_then(instant) else {
        return;
    };
    let oldest_kept = newest - policy.span;
    while window.buckets.len() > 1 && may_drop_first(window) {
        let next_from = window.buckets[1].from_cursor(&window.kind).ok();
        match next_from.as_ref().and_then(instant) {
            Some(next) if next <= oldest_kept => {
                window.buckets.remove(0);
            }
            _ => break,
        }
    }
}

/// How a bucket's recount compares with its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketChange {
    Same,
    /// More rows than delivered: `late_rows` at least arrived late.
    Grew {
        late_rows: u64,
    },
    /// As many rows, other keys: at least one arrived late, as many left.
    Replaced,
    /// Fewer rows, and the moments say the versions that left explain the recount: rows updated
    /// past the checkpoint (or into another bucket), or deleted. Not a late arrival.
    Shrank,
    /// Fewer rows, and the moments say a version also came: at least one arrived late.
    ShrankAndGrew,
    /// Fewer rows, too many fewer (or a record without moments, an earlier build's) for the
    /// moments to tell whether a version also came.
    Undecided,
    /// The same rows and sums, the record without moments: the recount's become the record.
    Rebased,
}

pub fn classify(recorded: &Tally, found: &Tally) -> BucketChange {
    if found.rows > recorded.rows {
        return BucketChange::Grew { late_rows: found.rows - recorded.rows };
    }
    if found.rows == recorded.rows {
        return match recorded.moments {
            _ if found == recorded => BucketChange::Same,
            None if (found.sum_u, found.sum_v) == (recorded.sum_u, recorded.sum_v) => BucketChange::Rebased,
            _ => BucketChange::Replaced,
        };
    }
    match moments::departures_only(recorded, found) {
        Some(true) => BucketChange::Shrank,
        Some(false) => BucketChange::ShrankAndGrew,
        None => BucketChange::Undecided,
    }
}

/// A bucket whose shrink the moments cannot decide is delivered again when it holds at most
/// this many rows (a fresh bucket, or a small one): a receiver that dedupes on `event_id` sees
/// nothing new unless a row did arrive. A larger one is adopted, with a warning.
pub const UNDECIDED_REDELIVERY_ROWS: u64 = 4 * FRESH_BUCKET_ROWS;

/// Where a bucket's range ends.
#[derive(Debug, Clone, PartialEq)]
pub enum BucketEnd {
    /// Before the next bucket's first cursor.
    Before(CursorValue),
    /// At the checkpoint, included (the last bucket).
    Checkpoint,
}

/// A bucket the database says holds rows that were never delivered.
#[derive(Debug, Clone, PartialEq)]
pub struct LateBucket {
    pub from: CursorValue,
    pub until: BucketEnd,
    pub recorded: Tally,
    pub found: Tally,
    /// Rows that arrived late, at least.
    pub late_rows: u64,
    /// The one new row's key hash, when exactly one row came and none left: only it is
    /// delivered. Otherwise the whole bucket is.
    pub single: Option<KeyHash>,
    pub since: DateTime<Utc>,
}

/// A bucket with fewer rows than recorded and none arrived (or a record gaining its moments):
/// its record becomes the recount.
#[derive(Debug, Clone, PartialEq)]
pub struct ShrunkBucket {
    pub from: CursorValue,
    pub recorded: Tally,
    pub found: Tally,
    /// The moments could not tell whether a row also arrived (too many left): adopted all the
    /// same, said by a warning.
    pub undecided: bool,
}

/// What a check found.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CheckPlan {
    pub late: Vec<LateBucket>,
    pub shrunk: Vec<ShrunkBucket>,
}

impl CheckPlan {
    pub fn is_empty(&self) -> bool {
        self.late.is_empty() && self.shrunk.is_empty()
    }
}

/// The bucket bounds a check binds: each bucket's `from`, oldest first.
pub fn bounds(window: &Window) -> Result<Vec<CursorValue>, String> {
    window.buckets.iter().map(|bucket| bucket.from_cursor(&window.kind)).collect()
}

/// Compares the recount `found` (one tally per bucket, in order) with the window.
pub fn plan_check(window: &Window, found: &[Tally]) -> Result<CheckPlan, String> {
    let every: Vec<usize> = (0..window.buckets.len()).collect();
    plan_partial(window, &every, found)
}

/// Where bucket `index` of `window` ends (`froms`: every bucket's first cursor).
pub fn end_of(froms: &[CursorValue], index: usize) -> BucketEnd {
    match froms.get(index + 1) {
        Some(next) => BucketEnd::Before(next.clone()),
        None => BucketEnd::Checkpoint,
    }
}

/// Compares the recount `found` of the buckets `indices` (ascending; one tally each, in order)
/// with the window.
pub fn plan_partial(window: &Window, indices: &[usize], found: &[Tally]) -> Result<CheckPlan, String> {
    if found.len() != indices.len() {
        return Err(format!("the recount has {} buckets, the check asked for {}", found.len(), indices.len()));
    }
    if indices.iter().any(|index| *index >= window.buckets.len()) {
        return Err(format!("a check of a bucket beyond the window's {}", window.buckets.len()));
    }
    let froms = bounds(window)?;
    let mut plan = CheckPlan::default();
    for (&index, found) in indices.iter().zip(found) {
        let bucket = &window.buckets[index];
        let adopted =
            |undecided| ShrunkBucket { from: froms[index].clone(), recorded: bucket.tally, found: *found, undecided };
        let late_rows = match classify(&bucket.tally, found) {
            BucketChange::Same => continue,
            BucketChange::Shrank | BucketChange::Rebased => {
                plan.shrunk.push(adopted(false));
                continue;
            }
            BucketChange::Undecided if found.rows > UNDECIDED_REDELIVERY_ROWS => {
                plan.shrunk.push(adopted(true));
                continue;
            }
            // Delivered again, none counted: a row may have arrived, none is known to.
            BucketChange::Undecided => 0,
            BucketChange::Grew { late_rows } => late_rows,
            BucketChange::Replaced | BucketChange::ShrankAndGrew => 1,
        };
        let until = end_of(&froms, index);
        plan.late.push(LateBucket {
            from: froms[index].clone(),
            until,
            recorded: bucket.tally,
            found: *found,
            late_rows,
            single: single_new_key(&bucket.tally, found),
            since: bucket.since,
        });
    }
    Ok(plan)
}

/// The key hash of the one row that came, when the recount is the record plus exactly one row.
/// (If rows also left, the difference is not a key's hash, and no row matches it but by a 2^-62
/// chance; a match is delivered, the rest of the bucket not: see the module's odds.)
pub fn single_new_key(recorded: &Tally, found: &Tally) -> Option<KeyHash> {
    if found.rows != recorded.rows + 1 {
        return None;
    }
    let u = found.sum_u.checked_sub(recorded.sum_u)?;
    let v = found.sum_v.checked_sub(recorded.sum_v)?;
    Some(KeyHash { u: u32::try_from(u).ok()?, v: u32::try_from(v).ok()? })
}

/// The record after a late bucket was delivered: its tally becomes what was delivered, plus what
/// commits added to it since the check (`checked` is its tally then), and the finding is counted
/// (`late_rows`, found `lateness_seconds` after the late row's time).
pub fn after_redelivery(
    record: &LateRecord,
    from: &CursorValue,
    checked: Tally,
    delivered: Tally,
    late_rows: u64,
    lateness_seconds: u64,
    now: DateTime<Utc>,
) -> LateRecord {
    let mut next = adopt(record, from, checked, delivered);
    let kind = next.window.as_ref().map(|window| window.kind.clone()).unwrap_or_default();
    if next.undelivered.as_ref().and_then(|bucket| bucket.from_cursor(&kind).ok()).as_ref() == Some(from) {
        next.undelivered = None;
        next.undelivered_after = None;
    }
    if late_rows > 0 {
        next.found += late_rows;
        next.max_lateness_seconds = Some(next.max_lateness_seconds.unwrap_or(0).max(lateness_seconds));
        next.last_found_at = Some(now);
    }
    next
}

/// The record with bucket `from`'s tally made `recount` (a bucket that shrank, or was delivered
/// again), keeping what commits added to it since it was `checked` (the tick's own rows, committed
/// between the check and this write, went into the last bucket).
pub fn adopt(record: &LateRecord, from: &CursorValue, checked: Tally, recount: Tally) -> LateRecord {
    let mut next = record.clone();
    if let Some(window) = next.window.as_mut() {
        let kind = window.kind.clone();
        // The bucket that holds `from` now: the one checked, or the older one it was merged into
        // by a commit since (whose other rows are kept as commits' additions are).
        let holder = window.buckets.iter().rposition(|bucket| {
            bucket
                .from_cursor(&kind)
                .ok()
                .and_then(|start| start.compare(from))
                .is_some_and(|order| order != Ordering::Greater)
        });
        if let Some(bucket) = holder.map(|index| &mut window.buckets[index]) {
            bucket.tally = bucket.tally.rebased(&checked, &recount);
        }
    }
    next
}

/// The record with the late bucket `from` marked undelivered (the oldest such bucket is kept,
/// with how far its redelivery got).
pub fn mark_undelivered(record: &LateRecord, from: &CursorValue, now: DateTime<Utc>) -> LateRecord {
    let mut next = record.clone();
    if marked_from(&next).and_then(|marked| marked.compare(from)).is_some_and(|order| order != Ordering::Greater) {
        return next;
    }
    next.undelivered = Some(Bucket::starting_at(from, now));
    next.undelivered_after = None;
    next
}

/// The first cursor of the bucket marked undelivered.
fn marked_from(record: &LateRecord) -> Option<CursorValue> {
    let kind = record.window.as_ref().map(|window| window.kind.clone()).unwrap_or_default();
    record.undelivered.as_ref().and_then(|bucket| bucket.from_cursor(&kind).ok())
}

/// The record with the redelivery of the late bucket `from` delivered up to `after` (`tally`:
/// the rows delivered so far): marked undelivered, with that progress, when it is the marked one
/// or none is.
pub fn mark_progress(
    record: &LateRecord,
    from: &CursorValue,
    after: &Position,
    tally: Tally,
    now: DateTime<Utc>,
) -> LateRecord {
    let mut next = mark_undelivered(record, from, now);
    if marked_from(&next).as_ref() == Some(from)
        && let Some(bucket) = next.undelivered.as_mut()
    {
        bucket.tally = tally;
        next.undelivered_after = Some(CursorJson::from(after));
    }
    next
}

/// Where the redelivery of the late bucket `from` goes on: after this position, with the tally
/// of the rows delivered before it (when the marked bucket is `from` and got that far).
pub fn progress(record: &LateRecord, from: &CursorValue) -> Option<(Position, Tally)> {
    if marked_from(record).as_ref() != Some(from) {
        return None;
    }
    let after = Position::try_from(record.undelivered_after.as_ref()?).ok()?;
    Some((after, record.undelivered.as_ref()?.tally))
}

/// How late a late row was found, in whole seconds (rounded up): after its cursor time for a
/// timestamp (a naive one only when it means UTC), else after its bucket was first committed.
pub fn lateness_seconds(now: DateTime<Utc>, cursor: &CursorValue, since: DateTime<Utc>, naive_is_utc: bool) -> u64 {
    let at = match cursor {
        CursorValue::Timestamp { at, .. } => *at,
        CursorValue::NaiveTimestamp(at) if naive_is_utc => at.and_utc(),
        CursorValue::NaiveTimestamp(_) | CursorValue::Integer(_) | CursorValue::Xid(_) => since,
    };
    let milliseconds = (now - at).num_milliseconds().max(0) as u64;
    milliseconds.div_ceil(1000)
}

#[cfg(test)]
mod tests;
