//! A sink that keeps what it receives, for fast tests. It can be told to fail the next deliveries.

use std::collections::VecDeque;
use std::sync::Mutex;

use async_trait::async_trait;

use super::{Batch, Sink, SinkError};

#[derive(Default)]
pub struct RecordingSink {
    batches: Mutex<Vec<Batch>>,
    planned_failures: Mutex<VecDeque<SinkError>>,
}

impl RecordingSink {
    pub fn new() -> Self {
        RecordingSink::default()
    }

    /// The next delivery fails with `error` (queued: call several times for several failures).
    pub fn fail_next(&self, error: SinkError) {
        self.planned_failures.lock().unwrap().push_back(error);
    }

    /// Every batch acknowledged so far, in order.
    pub fn batches(&self) -> Vec<Batch> {
        self.batches.lock().unwrap().clone()
    }
}

#[async_trait]
impl Sink for RecordingSink {
    async fn deliver(&self, batch: &Batch, _deadline: tokio::time::Instant) -> Result<(), SinkError> {
        if let Some(error) = self.planned_failures.lock().unwrap().pop_front() {
            return Err(error);
        }
        self.batches.lock().unwrap().push(batch.clone());
        Ok(())
    }

    fn describe(&self) -> String {
        "recording".to_string()
    }
}
