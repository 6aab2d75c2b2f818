//! Where `now` comes from: one injected clock for every decision that depends on time (the tick's
//! budget, lease and heartbeat; an operator command's lease check and the times it records).

use chrono::{DateTime, Utc};

/// Where `now` comes from. Production reads the system clock; the domain never does.
pub trait Clock: Send + Sync {
    fn now(&self) -> DateTime<Utc>;
}

pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that moves only when told: tests drive leases and budgets through time without sleeping.
#[cfg(any(test, feature = "testing"))]
pub struct ManualClock {
    now: std::sync::Mutex<DateTime<Utc>>,
}

#[cfg(any(test, feature = "testing"))]
impl ManualClock {
    pub fn at(now: DateTime<Utc>) -> Self {
        ManualClock { now: std::sync::Mutex::new(now) }
    }

    pub fn set(&self, now: DateTime<Utc>) {
        *self.now.lock().unwrap() = now;
    }

    pub fn advance(&self, by: chrono::Duration) {
        let mut now = self.now.lock().unwrap();
        *now += by;
    }
}

#[cfg(any(test, feature = "testing"))]
impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap()
    }
}
