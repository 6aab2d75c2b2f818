//! A source that times its delivering reads: how long they took, and how long the tick went
//! between the end of one and the start of the next (the reader waiting for room in the window, or
//! the tick busy elsewhere). Every other call goes to the source as it is.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use dbtrigger::domain::Position;
use dbtrigger::domain::late::Tally;
use dbtrigger::source::{BucketCheck, BucketRange, FetchLimit, Fetched, Probe, Source, SourceError};
use serde_json::Value;

#[derive(Default, Clone, Copy)]
pub struct Times {
    pub reads: u32,
    pub reading: Duration,
    pub between: Duration,
    last_end: Option<Instant>,
}

pub struct Timed {
    pub inner: Arc<dyn Source>,
    pub times: Arc<Mutex<Times>>,
}

#[async_trait]
impl Source for Timed {
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        self.inner.read(probe, after, limit).await
    }

    async fn count_after(&self, after: Option<&Position>, cap: u64) -> Result<u64, SourceError> {
        self.inner.count_after(after, cap).await
    }

    fn count_limit(&self) -> u64 {
        self.inner.count_limit()
    }

    async fn tick_ended(&self) -> Result<(), SourceError> {
        self.inner.tick_ended().await
    }

    fn end_reads(&self) {
        self.inner.end_reads()
    }

    async fn generation(&self) -> Result<Option<Value>, SourceError> {
        self.inner.generation().await
    }

    async fn horizon_holder(&self) -> Result<Option<dbtrigger::domain::horizon::HorizonHolder>, SourceError> {
        self.inner.horizon_holder().await
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn connection_wait(&self) -> Duration {
        self.inner.connection_wait()
    }

    async fn slot(&self) -> Result<Option<dbtrigger::domain::slot::SlotView>, SourceError> {
        self.inner.slot().await
    }

    async fn slot_ends(&self) -> Result<Option<dbtrigger::domain::slot::SlotEnds>, SourceError> {
        self.inner.slot_ends().await
    }

    async fn reset_moved(&self, to: &Position) -> Result<(), SourceError> {
        self.inner.reset_moved(to).await
    }

    async fn committed(&self, checkpoint: Option<&Position>) -> Result<(), SourceError> {
        self.inner.committed(checkpoint).await
    }

    async fn tally_buckets(&self, check: &BucketCheck) -> Result<Option<Vec<Tally>>, SourceError> {
        self.inner.tally_buckets(check).await
    }

    async fn read_bucket(
        &self,
        range: &BucketRange,
        after: Option<&Position>,
        limit: FetchLimit,
    ) -> Result<Fetched, SourceError> {
        self.inner.read_bucket(range, after, limit).await
    }

    async fn fetch_after(&self, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let started = Instant::now();
        let fetched = self.inner.fetch_after(after, limit).await;
        let ended = Instant::now();
        let mut times = self.times.lock().unwrap();
        times.reads += 1;
        times.reading += ended - started;
        if let Some(last_end) = times.last_end {
            times.between += started.saturating_duration_since(last_end);
        }
        times.last_end = Some(ended);
        fetched
    }
}
