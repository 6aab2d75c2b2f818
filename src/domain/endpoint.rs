//! Whose fault a refusal for good is: the endpoint's or the rows' (issue 36, item 1).
//!
//! Poison isolation is built for one bad row among good ones: it splits a refused batch until the
//! rows refused alone are found, and quarantines them. An endpoint that refuses everything (a
//! rotated token's 401, a gateway's 404, an http→https redirect, a queue SAS without add rights)
//! would have every row refused alone, and the backlog drained into the quarantine while the poller
//! looks alive. So a refusal is first asked what it is about:
//!
//! - about the **endpoint** (its URL, its method, its credential, a proxy or gateway in front of
//!   it, or, for a Storage queue, anything the service says: it never reads a message's content):
//!   every row would get the same answer, so the poller holds at its checkpoint, records the
//!   failure and quarantines nothing; the next tick tries the same rows, and gets through once the
//!   endpoint is fixed.
//! - about the **rows** (400, 413, 422, …; a queue message over its size limit): the batch is
//!   isolated and the rows refused alone quarantined, as before.
//!
//! A 409 is about the endpoint too: it is what a receiver answers a stale fencing token
//! (docs/receivers.md), or its own conflict (an idempotency key still in use by an earlier
//! request); neither says anything of a row, and a row is never quarantined for it (issue 35: a
//! receiver's 409 for a row tried alone sent it to the quarantine).
//!
//! The table below is the whole decision; [`Blame`] is what the tick and the isolation act on.

/// What kind of receiver answered (the table differs: a queue never reads the rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receiver {
    Webhook,
    StorageQueue,
}

/// Who a refusal for good is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The endpoint: every row would be refused the same way. Hold, quarantine nothing.
    Endpoint,
    /// The rows sent: smaller parts may pass, a row refused alone is poison.
    Rows,
}

/// Who a refusal for good with HTTP `status` from `receiver` is about.
///
/// | receiver | status                         | blame    | why                                              |
/// |----------|--------------------------------|----------|--------------------------------------------------|
/// | webhook  | 3xx                            | endpoint | redirects are not followed: the URL is wrong (http→https, a moved hook) |
/// | webhook  | 401, 407                       | endpoint | the credential (or the proxy's) is missing or wrong: a rotated token |
/// | webhook  | 403                            | endpoint | the credential may not post here                  |
/// | webhook  | 404, 405, 410, 421             | endpoint | no such route or method (a gateway, a removed hook, a wrong host) |
/// | webhook  | 406, 415, 426                  | endpoint | the content type or protocol every request shares |
/// | webhook  | 409                            | endpoint | a stale fencing token, or the receiver's own conflict: not about a row |
/// | webhook  | 413                            | rows     | the body is too big: a smaller part, or the row alone, tells |
/// | webhook  | any other (400, 422, …)        | rows     | the receiver judged what it read                  |
/// | queue    | 413                            | rows     | a row over the message limit (checked before sending) |
/// | queue    | any other                      | endpoint | the service refused the account, queue or SAS (403 `AuthorizationPermissionMismatch`) |
pub fn blame(receiver: Receiver, status: u16) -> Blame {
    match receiver {
        Receiver::StorageQueue if status == 413 => Blame::Rows,
        Receiver::StorageQueue => Blame::Endpoint,
        Receiver::Webhook => match status {
            300..=399 => Blame::Endpoint,
            401 | 403 | 404 | 405 | 406 | 407 | 409 | 410 | 415 | 421 | 426 => Blame::Endpoint,
            _ => Blame::Rows,
        },
    }
}

/// What `status`, the watchdog and the tick's error say of a held endpoint: the status and what it
/// usually means; never the URL (its path or query may hold a token).
pub fn meaning(receiver: Receiver, status: u16) -> &'static str {
    match (receiver, status) {
        (Receiver::StorageQueue, 403) => "the credential or SAS may not add messages to this queue",
        (Receiver::StorageQueue, _) => "the storage account refused the queue's requests",
        (Receiver::Webhook, 300..=399) => "a redirect, which is not followed: point the URL at where it redirects",
        (Receiver::Webhook, 401) => "the credential is missing, expired or rotated",
        (Receiver::Webhook, 407) => "a proxy wants credentials",
        (Receiver::Webhook, 403) => "the credential may not post here",
        (Receiver::Webhook, 404 | 410 | 421) => "no such route or host (a gateway, a removed hook, a wrong URL)",
        (Receiver::Webhook, 405) => "the URL does not take POST",
        (Receiver::Webhook, 409) => {
            "a conflict: a fencing token the receiver holds as stale, or a request of its own still in progress"
        }
        (Receiver::Webhook, _) => "the receiver refuses every request alike",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table, row by row: which answers hold the poller and which isolate the rows.
    #[test]
    fn blame_truth_table() {
        use Blame::{Endpoint, Rows};
        use Receiver::{StorageQueue, Webhook};
        for (receiver, status, expected) in [
            (Webhook, 301, Endpoint),
            (Webhook, 302, Endpoint),
            (Webhook, 307, Endpoint),
            (Webhook, 308, Endpoint),
            (Webhook, 401, Endpoint),
            (Webhook, 403, Endpoint),
            (Webhook, 404, Endpoint),
            (Webhook, 405, Endpoint),
            (Webhook, 406, Endpoint),
            (Webhook, 407, Endpoint),
            (Webhook, 410, Endpoint),
            (Webhook, 415, Endpoint),
            (Webhook, 421, Endpoint),
            (Webhook, 426, Endpoint),
            // A stale fencing token, or the receiver's own conflict: never a row's.
            (Webhook, 409, Endpoint),
            // What the receiver says of what it read is about the rows.
            (Webhook, 400, Rows),
            (Webhook, 411, Rows),
            (Webhook, 412, Rows),
            (Webhook, 413, Rows),
            (Webhook, 422, Rows),
            (Webhook, 451, Rows),
            (Webhook, 499, Rows),
            // A queue never reads a message: whatever it refuses is about the account, queue, SAS.
            (StorageQueue, 403, Endpoint),
            (StorageQueue, 400, Endpoint),
            (StorageQueue, 404, Endpoint),
            (StorageQueue, 409, Endpoint),
            (StorageQueue, 413, Rows),
        ] {
            assert_eq!(blame(receiver, status), expected, "{receiver:?} {status}");
        }
    }

    #[test]
    fn every_status_has_a_meaning_and_none_names_a_url() {
        for receiver in [Receiver::Webhook, Receiver::StorageQueue] {
            for status in 300..500 {
                let text = meaning(receiver, status);
                assert!(!text.is_empty() && !text.contains("http"), "{receiver:?} {status}: {text}");
            }
        }
    }
}
