//! When to try a failed delivery again. Pure: the caller passes the attempt number, what the
//! receiver said (`Retry-After`), a jitter fraction, and the time left.

use std::time::Duration;

/// First retry after about this long, doubling each time.
pub const BASE_DELAY: Duration = Duration::from_millis(500);
/// No backoff step is longer than this (unless the receiver asks for more with Retry-After).
pub const MAX_DELAY: Duration = Duration::from_secs(30);
/// A Retry-After longer than this is not honoured within a tick: the batch is retried next tick.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(120);

/// What to do after failed attempt number `attempt` (1 = the first try failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    RetryAfter(Duration),
    GiveUp(GiveUpReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveUpReason {
    /// `maxRetries` used up.
    RetriesExhausted,
    /// The wait would end past the tick's deadline.
    OutOfTime,
    /// The receiver asked for a wait longer than a tick should hold a lease idle.
    RetryAfterTooLong,
}

/// Exponential backoff with jitter (`jitter` in 0..1 picks within the upper half of the step),
/// never less than the receiver's `Retry-After`, never past `time_left`.
pub fn decide(
    attempt: u32,
    max_retries: u32,
    retry_after: Option<Duration>,
    jitter: f64,
    time_left: Duration,
) -> RetryDecision {
    if attempt > max_retries {
        return RetryDecision::GiveUp(GiveUpReason::RetriesExhausted);
    }
    if retry_after.is_some_and(|asked| asked > MAX_RETRY_AFTER) {
        return RetryDecision::GiveUp(GiveUpReason::RetryAfterTooLong);
    }
    let exponent = attempt.saturating_sub(1).min(16);
    let step = BASE_DELAY.saturating_mul(1 << exponent).min(MAX_DELAY);
    let jittered = step.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0));
    let wait = match retry_after {
        Some(asked) if asked > jittered => asked,
        _ => jittered,
    };
    if wait >= time_left {
        return RetryDecision::GiveUp(GiveUpReason::OutOfTime);
    }
    RetryDecision::RetryAfter(wait)
}

/// `Retry-After` as seconds or as an HTTP date, relative to `now`.
pub fn parse_retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLENTY: Duration = Duration::from_secs(600);

    #[test]
    fn backoff_doubles_within_its_jitter_band() {
        assert_eq!(decide(1, 5, None, 1.0, PLENTY), RetryDecision::RetryAfter(Duration::from_millis(500)));
        assert_eq!(decide(2, 5, None, 1.0, PLENTY), RetryDecision::RetryAfter(Duration::from_millis(1000)));
        assert_eq!(decide(3, 5, None, 0.0, PLENTY), RetryDecision::RetryAfter(Duration::from_millis(1000)));
        assert_eq!(decide(12, 20, None, 1.0, PLENTY), RetryDecision::RetryAfter(MAX_DELAY));
    }

    #[test]
    fn retries_stop_at_the_limit_and_at_the_deadline() {
        assert_eq!(decide(4, 3, None, 0.5, PLENTY), RetryDecision::GiveUp(GiveUpReason::RetriesExhausted));
        assert_eq!(decide(1, 0, None, 0.5, PLENTY), RetryDecision::GiveUp(GiveUpReason::RetriesExhausted));
        assert_eq!(decide(1, 3, None, 1.0, Duration::from_millis(400)), RetryDecision::GiveUp(GiveUpReason::OutOfTime));
    }

    #[test]
    fn retry_after_is_honoured_when_longer() {
        assert_eq!(
            decide(1, 3, Some(Duration::from_secs(1)), 0.0, PLENTY),
            RetryDecision::RetryAfter(Duration::from_secs(1))
        );
        assert_eq!(
            decide(1, 3, Some(Duration::from_secs(600)), 0.0, PLENTY),
            RetryDecision::GiveUp(GiveUpReason::RetryAfterTooLong)
        );
    }

    #[test]
    fn retry_after_parses_seconds_and_dates() {
        let now = std::time::UNIX_EPOCH + Duration::from_secs(1_445_412_480);
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now), Some(Duration::from_secs(10)));
        assert_eq!(parse_retry_after("soon", now), None);
    }
}
