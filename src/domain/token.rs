//! When a database access token (Microsoft Entra, from the managed identity) is asked for again.
//!
//! The token is the password of every new connection to the database. Each question a source
//! asks of the database checks the token first, and a connection may still be opened a little later
//! (a pool replacing a broken one, a stream reconnecting): so a token is replaced once less than
//! [`REFRESH_MARGIN`] of it remains, never used up to its last second. Entra issues tokens for 60 to
//! 90 minutes, so one is asked for about once an hour.

use std::time::{Duration, SystemTime};

/// A token with less than this left is replaced before a connection is opened with it.
pub const REFRESH_MARGIN: Duration = Duration::from_secs(5 * 60);

/// What to do with the token kept, before opening a connection at `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenUse {
    /// Kept: more than the margin remains.
    Keep,
    /// Asked for again: none yet, or less than the margin remains (or it expired).
    Refresh,
}

/// The rule: keep a token only while more than [`REFRESH_MARGIN`] of it remains at `now`.
pub fn token_use(expires_at: Option<SystemTime>, now: SystemTime) -> TokenUse {
    let Some(expires_at) = expires_at else {
        return TokenUse::Refresh;
    };
    match expires_at.duration_since(now) {
        Ok(remaining) if remaining > REFRESH_MARGIN => TokenUse::Keep,
        _ => TokenUse::Refresh,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_kept_only_while_more_than_the_margin_remains() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(token_use(None, now), TokenUse::Refresh, "no token yet");
        assert_eq!(token_use(Some(now + Duration::from_secs(3600)), now), TokenUse::Keep);
        assert_eq!(token_use(Some(now + REFRESH_MARGIN + Duration::from_secs(1)), now), TokenUse::Keep);
        assert_eq!(token_use(Some(now + REFRESH_MARGIN), now), TokenUse::Refresh, "exactly the margin left");
        assert_eq!(token_use(Some(now + Duration::from_secs(10)), now), TokenUse::Refresh);
        assert_eq!(token_use(Some(now), now), TokenUse::Refresh, "expiring now");
        assert_eq!(token_use(Some(now - Duration::from_secs(10)), now), TokenUse::Refresh, "expired");
    }
}
