use super::*;
use crate::domain::cursor::{CursorValue, PkValue};
use crate::domain::lease::{self, LeaseTerms};
use crate::domain::state::{StateDocument, describe};
use chrono::Duration;

fn terms() -> LeaseTerms {
    LeaseTerms { ttl: Duration::seconds(60), heartbeat: Duration::seconds(15), clock_skew: Duration::seconds(5) }
}

fn at(seconds: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_780_000_000 + seconds, 0).unwrap()
}

fn position(cursor: i64, id: i64) -> Position {
    Position { cursor: CursorValue::Integer(cursor), pk: vec![("id".to_string(), PkValue::Integer(id))] }
}

fn held_by(owner: &str, since: i64) -> StateDocument {
    acquire(&StateDocument::new("orders", "sha256:a"), owner, at(since), &terms()).unwrap()
}

fn delivered(last: &Position) -> Delivered<'_> {
    Delivered { last, last_batch_id: "bat_1", rows: 10, batches: 1, quarantined: 0 }
}

const ALICE: Operator<'static> =
    Operator { who: "alice@laptop", force: false, reason: Some("replay after the outage") };
const ALICE_FORCING: Operator<'static> = Operator { who: "alice@laptop", force: true, reason: None };

/// acquire: (lease state, who, when) -> taken with which token, or refused.
#[test]
fn acquire_truth_table() {
    let fresh = StateDocument::new("orders", "sha256:a");
    let a_holds = held_by("a", 0);
    let token = a_holds.lease.as_ref().unwrap().fencing_token;
    let released = release(&a_holds, "a", at(1)).unwrap();
    for (case, document, who, when, expected) in [
        ("no lease: token from the clock", &fresh, "a", at(0), Ok(lease::first_fencing_token(at(0)))),
        ("ours: renewed, same token", &a_holds, "a", at(10), Ok(token)),
        ("another's live lease", &a_holds, "b", at(30), Err(())),
        ("expired but within skew", &a_holds, "b", at(64), Err(())),
        ("expired past skew: next token", &a_holds, "b", at(66), Ok(token + 1)),
        ("released: at once, next token", &released, "b", at(2), Ok(token + 1)),
    ] {
        let result = acquire(document, who, when, &terms());
        match (result, expected) {
            (Ok(next), Ok(token)) => {
                let lease = next.lease.unwrap();
                assert_eq!(lease.fencing_token, token, "{case}");
                assert_eq!(lease.owner_id.as_deref(), Some(who), "{case}");
                assert_eq!(next.checkpoint, document.checkpoint, "{case}: the checkpoint is untouched");
            }
            (Err(held), Err(())) => assert_eq!(held.owner_id, "a", "{case}"),
            (result, expected) => panic!("{case}: got {result:?}, expected {expected:?}"),
        }
    }
}

/// heartbeat and release: only the owner, the token kept.
#[test]
fn heartbeat_and_release_truth_table() {
    let a_holds = held_by("a", 0);
    let token = a_holds.lease.as_ref().unwrap().fencing_token;
    let renewed = heartbeat(&a_holds, "a", at(20), &terms()).unwrap();
    assert_eq!(renewed.lease.as_ref().unwrap().expires_at, Some(at(80)));
    assert_eq!(renewed.lease.as_ref().unwrap().fencing_token, token);
    assert!(matches!(heartbeat(&a_holds, "b", at(20), &terms()), Err(Refusal::NotOwner { .. })));
    assert!(matches!(
        heartbeat(&StateDocument::new("orders", "x"), "a", at(0), &terms()),
        Err(Refusal::NotOwner { owner_id: None })
    ));
    let released = release(&a_holds, "a", at(5)).unwrap();
    assert_eq!(released.lease.as_ref().unwrap().owner_id, None);
    assert_eq!(released.lease.as_ref().unwrap().fencing_token, token);
    assert!(matches!(release(&released, "a", at(6)), Err(Refusal::NotOwner { owner_id: None })));
    assert!(matches!(release(&a_holds, "b", at(6)), Err(Refusal::NotOwner { .. })));
}

/// commit: moves forward only, renews or releases, counts.
#[test]
fn commit_truth_table() {
    let a_holds = held_by("a", 0);
    let first = commit(&a_holds, "a", &delivered(&position(5, 1)), false, at(10), &terms()).unwrap();
    assert_eq!(first.checkpoint.as_ref().unwrap().cursor.value, 5);
    assert_eq!(first.lease.as_ref().unwrap().owner_id.as_deref(), Some("a"), "renewed");
    assert_eq!(first.lease.as_ref().unwrap().expires_at, Some(at(70)));
    assert_eq!((first.stats.rows_delivered, first.stats.batches_delivered), (10, 1));

    let last = commit(&first, "a", &delivered(&position(6, 1)), true, at(11), &terms()).unwrap();
    assert_eq!(last.lease.as_ref().unwrap().owner_id, None, "the last commit releases");
    assert_eq!(last.stats.rows_delivered, 20);

    for (case, document, who, to) in
        [("backwards", &first, "a", position(4, 9)), ("the same position", &first, "a", position(5, 1))]
    {
        let refusal = commit(document, who, &delivered(&to), false, at(12), &terms()).unwrap_err();
        assert!(matches!(refusal, Refusal::Regression(_)), "{case}: {refusal:?}");
    }
    assert!(matches!(
        commit(&first, "b", &delivered(&position(9, 1)), false, at(12), &terms()),
        Err(Refusal::NotOwner { .. })
    ));
    assert!(matches!(
        commit(&last, "a", &delivered(&position(9, 1)), false, at(12), &terms()),
        Err(Refusal::NotOwner { owner_id: None })
    ));
}

/// A failed tick records the batch's failure and releases the lease; the next commit clears it
/// and counts what was quarantined.
#[test]
fn failure_then_commit_truth_table() {
    let a_holds = held_by("a", 0);
    let record =
        crate::domain::poison::record_failure(None, "bat_1", &position(1, 1), &position(5, 1), "HTTP 503", at(5));
    let failed = record_failure(&a_holds, "a", record.clone(), at(5)).unwrap();
    assert_eq!(failed.poison, Some(record.clone()));
    assert_eq!(failed.lease.as_ref().unwrap().owner_id, None, "released");
    assert_eq!(failed.checkpoint, a_holds.checkpoint, "the checkpoint stays");
    assert!(matches!(record_failure(&failed, "a", record, at(6)), Err(Refusal::NotOwner { .. })));
    let again = acquire(&failed, "b", at(7), &terms()).unwrap();
    let isolated = Delivered { last: &position(5, 1), last_batch_id: "bat_1", rows: 8, batches: 1, quarantined: 2 };
    let committed = commit(&again, "b", &isolated, true, at(8), &terms()).unwrap();
    assert_eq!(committed.poison, None);
    assert_eq!((committed.stats.rows_delivered, committed.stats.quarantined), (8, 2));
}

/// Regression (issue 24, item 9): a tick failing for a reason other than the sink is recorded
/// (attempts counting, the lease given back if ours, nothing written through a live lease of
/// another), kept by the commits of a tick still running, and cleared by a tick that ends well
/// or by an idle one.
#[test]
fn tick_failure_truth_table() {
    let free = StateDocument::new("orders", "sha256:a");
    let once = record_tick_failure(&free, "a", "opColumn \"note\" holds \"x\"", at(1), &terms()).unwrap();
    let failure = once.failure.clone().unwrap();
    assert_eq!((failure.attempts, failure.first_failure_at), (1, at(1)));
    assert_eq!(once.lease, None, "no lease taken");
    let twice = record_tick_failure(&once, "a", "HTTP 500", at(2), &terms()).unwrap();
    let failure = twice.failure.clone().unwrap();
    assert_eq!(
        (failure.attempts, failure.first_error.as_str(), failure.last_error.as_str()),
        (2, "opColumn \"note\" holds \"x\"", "HTTP 500")
    );

    let a_holds = acquire(&twice, "a", at(3), &terms()).unwrap();
    let released = record_tick_failure(&a_holds, "a", "HTTP 500", at(4), &terms()).unwrap();
    assert_eq!(released.lease.as_ref().unwrap().owner_id, None, "our lease given back with it");
    assert_eq!(released.failure.as_ref().unwrap().attempts, 3);
    assert!(matches!(
        record_tick_failure(&a_holds, "b", "HTTP 500", at(4), &terms()),
        Err(Refusal::HeldElsewhere { .. })
    ));
    // Expired past the skew margin: free, so recorded.
    assert!(record_tick_failure(&a_holds, "b", "HTTP 500", at(100), &terms()).is_ok());

    // A tick in progress keeps the record; its releasing commit, or a release after it ended
    // well, clears it; so does an idle tick, with the poison record.
    let again = acquire(&released, "a", at(5), &terms()).unwrap();
    let progress = commit(&again, "a", &delivered(&position(5, 5)), false, at(6), &terms()).unwrap();
    assert!(progress.failure.is_some());
    assert_eq!(commit(&progress, "a", &delivered(&position(6, 6)), true, at(7), &terms()).unwrap().failure, None);
    assert_eq!(release_after_success(&progress, "a", at(7)).unwrap().failure, None);
    assert_eq!(release(&progress, "a", at(7)).unwrap().failure, progress.failure, "a plain release keeps it");
    let cleared = clear_failures(&released).unwrap();
    assert_eq!((cleared.failure, cleared.poison), (None, None));
    assert_eq!(clear_failures(&held_by("a", 0)), None, "nothing to clear: no write");
}

/// An isolation under way commits its settled rows and keeps its record; the failure record of
/// earlier ticks stays until the tick ends well.
#[test]
fn an_isolating_commit_keeps_the_poison_record() {
    let failed = record_tick_failure(&held_by("a", 0), "a", "HTTP 500", at(1), &terms()).unwrap();
    let holding = acquire(&failed, "a", at(2), &terms()).unwrap();
    let record =
        crate::domain::poison::record_failure(None, "bat_1", &position(1, 1), &position(9, 9), "HTTP 422", at(2));
    let settled = Delivered { last: &position(4, 4), last_batch_id: "bat_1", rows: 3, batches: 0, quarantined: 1 };
    for release in [false, true] {
        let next = commit_isolating(&holding, "a", &settled, record.clone(), release, at(3), &terms()).unwrap();
        assert_eq!(next.poison.as_ref(), Some(&record));
        assert!(next.failure.is_some());
        assert_eq!(next.checkpoint.as_ref().unwrap().cursor.tiebreaker["id"], 4);
        assert_eq!((next.stats.rows_delivered, next.stats.quarantined, next.stats.batches_delivered), (3, 1, 0));
        assert_eq!(next.lease.as_ref().unwrap().owner_id.is_none(), release);
    }
    assert!(matches!(
        commit_isolating(&holding, "b", &settled, record, false, at(3), &terms()),
        Err(Refusal::NotOwner { .. })
    ));
}

/// reset: any direction, refused through a live lease unless forced, always audited.
#[test]
fn reset_truth_table() {
    let a_holds = held_by("a", 0);
    let committed = commit(&a_holds, "a", &delivered(&position(5, 1)), true, at(10), &terms()).unwrap();
    let live = acquire(&committed, "a", at(20), &terms()).unwrap();

    let to_start = reset(&committed, &ResetTarget::Beginning, ALICE, at(30), &terms()).unwrap();
    assert_eq!(to_start.checkpoint, None);
    let entry = to_start.history.last().unwrap();
    assert_eq!(
        (entry.who.as_str(), entry.what.as_str(), entry.forced),
        ("alice@laptop", "reset to the beginning", false)
    );
    assert_eq!(entry.reason.as_deref(), Some("replay after the outage"));
    assert_eq!(entry.previous_checkpoint.as_ref().unwrap().value, 5);
    // A reset takes a new fencing token: a tick still delivering from the old checkpoint is stale.
    let token = |document: &StateDocument| document.lease.as_ref().unwrap().fencing_token;
    assert_eq!(token(&to_start), token(&committed) + 1);
    let after_reset = acquire(&to_start, "b", at(31), &terms()).unwrap();
    assert!(token(&after_reset) > token(&to_start));

    let forward = reset(&committed, &ResetTarget::After(position(9, 3)), ALICE, at(30), &terms()).unwrap();
    assert_eq!(forward.checkpoint.as_ref().unwrap().cursor.value, 9);
    assert_eq!(forward.checkpoint.as_ref().unwrap().cursor.tiebreaker["id"], 3);
    let backward = reset(&forward, &ResetTarget::After(position(2, 0)), ALICE, at(31), &terms()).unwrap();
    assert_eq!(backward.checkpoint.as_ref().unwrap().cursor.value, 2);
    assert_eq!(backward.history.len(), 2);

    let refused = reset(&live, &ResetTarget::Beginning, ALICE, at(30), &terms()).unwrap_err();
    assert!(matches!(refused, Refusal::HeldElsewhere { ref owner_id, .. } if owner_id == "a"));
    let forced = reset(&live, &ResetTarget::Beginning, ALICE_FORCING, at(30), &terms()).unwrap();
    let lease = forced.lease.as_ref().unwrap();
    assert_eq!(lease.owner_id, None, "the displaced holder's lease is cleared");
    assert!(lease.fencing_token > live.lease.as_ref().unwrap().fencing_token, "above the displaced holder's token");
    assert!(forced.history.last().unwrap().forced);
    // After expiry plus skew the lease no longer protects anything: no force needed.
    assert!(reset(&live, &ResetTarget::Beginning, ALICE, at(20 + 66), &terms()).is_ok());
}

/// generation: adopted when none is recorded, kept when the same, a stop or a restart when
/// it moved; a reset forgets it so the next tick adopts the source as it is.
#[test]
fn generation_truth_table() {
    let a_holds = held_by("a", 0);
    let committed = commit(&a_holds, "a", &delivered(&position(5, 1)), true, at(10), &terms()).unwrap();
    let seven = serde_json::json!(7);
    let eight = serde_json::json!("load-8");
    assert_eq!(check_generation(&committed, None, false, at(11)), GenerationCheck::Same);
    let GenerationCheck::Adopted(adopted) = check_generation(&committed, Some(&seven), false, at(11)) else {
        panic!("adopted")
    };
    assert_eq!(adopted.generation.as_ref().unwrap().value, seven);
    assert_eq!(adopted.checkpoint, committed.checkpoint, "adopting keeps the checkpoint");
    assert_eq!(check_generation(&adopted, Some(&seven), false, at(12)), GenerationCheck::Same);
    assert_eq!(
        check_generation(&adopted, Some(&eight), false, at(12)),
        GenerationCheck::Stopped { stored: seven.clone(), current: eight.clone() }
    );
    let GenerationCheck::Restarted(restarted) = check_generation(&adopted, Some(&eight), true, at(12)) else {
        panic!("restarted")
    };
    assert_eq!(restarted.checkpoint, None);
    assert_eq!(restarted.generation.as_ref().unwrap().value, eight);
    assert!(restarted.history.last().unwrap().what.contains("from 7 to \"load-8\""));
    assert!(
        restarted.lease.as_ref().unwrap().fencing_token > adopted.lease.as_ref().unwrap().fencing_token,
        "deliveries of the old load are stale"
    );
    // A null generation (an empty load log) is a value like any other.
    let GenerationCheck::Adopted(null) = check_generation(&committed, Some(&serde_json::Value::Null), false, at(11))
    else {
        panic!("adopted")
    };
    assert!(matches!(check_generation(&null, Some(&seven), false, at(12)), GenerationCheck::Stopped { .. }));
    let reset_one = reset(&adopted, &ResetTarget::Beginning, ALICE, at(13), &terms()).unwrap();
    assert_eq!(reset_one.generation, None);
}

#[test]
fn the_history_keeps_the_last_fifty_entries() {
    let mut document = StateDocument::new("orders", "sha256:a");
    for step in 0..60 {
        document = reset(&document, &ResetTarget::After(position(step, 0)), ALICE, at(step), &terms()).unwrap();
    }
    assert_eq!(document.history.len(), HISTORY_LIMIT);
    assert_eq!(document.history.first().unwrap().what, format!("reset to after {}", describe(&position(10, 0))));
    assert_eq!(document.history.last().unwrap().previous_checkpoint.as_ref().unwrap().value, 58);
}

/// clone: a new document on the new name, at the checkpoint or the beginning, never a lease.
#[test]
fn clone_truth_table() {
    let a_holds = held_by("a", 0);
    let committed = commit(&a_holds, "a", &delivered(&position(5, 1)), false, at(10), &terms()).unwrap();
    let at_checkpoint = clone_to(&committed, "orders_backfill", false, ALICE, at(20));
    assert_eq!(at_checkpoint.poller_name, "orders_backfill");
    assert_eq!(at_checkpoint.checkpoint, committed.checkpoint);
    assert_eq!(at_checkpoint.lease, None);
    assert_eq!(at_checkpoint.stats.rows_delivered, 0);
    assert_eq!(at_checkpoint.source_fingerprint, committed.source_fingerprint);
    assert_eq!(at_checkpoint.history.last().unwrap().what, "cloned from orders at its checkpoint");
    let from_start = clone_to(&committed, "orders_backfill", true, ALICE, at(20));
    assert_eq!(from_start.checkpoint, None);
}

/// Regression (issue 24, item 11): a clone at the checkpoint keeps the generation record, so
/// that after a reload its tick stops or restarts instead of adopting the new load with the
/// old load's checkpoint; a clone from the beginning records the load it starts on.
#[test]
fn clone_keeps_the_generation_its_checkpoint_belongs_to() {
    let a_holds = held_by("a", 0);
    let committed = commit(&a_holds, "a", &delivered(&position(5, 1)), true, at(10), &terms()).unwrap();
    let GenerationCheck::Adopted(loaded) = check_generation(&committed, Some(&serde_json::json!(7)), false, at(11))
    else {
        panic!("adopted");
    };
    let clone = clone_to(&loaded, "orders_backfill", false, ALICE, at(20));
    assert_eq!(clone.generation, loaded.generation);
    assert!(matches!(
        check_generation(&clone, Some(&serde_json::json!(8)), false, at(21)),
        GenerationCheck::Stopped { .. }
    ));
    assert_eq!(clone.history.last().unwrap().action, Some(HistoryAction::Clone));
    assert_eq!(clone_to(&loaded, "orders_backfill", true, ALICE, at(20)).generation, None);
}

/// fingerprint accept: records the new one, keeps the checkpoint, audited; refused when it
/// would change nothing or through a live lease.
#[test]
fn accept_fingerprint_truth_table() {
    let a_holds = held_by("a", 0);
    let committed = commit(&a_holds, "a", &delivered(&position(5, 1)), true, at(10), &terms()).unwrap();
    let accepted = accept_fingerprint(&committed, "sha256:b", ALICE, at(20), &terms()).unwrap();
    assert_eq!(accepted.source_fingerprint, "sha256:b");
    assert_eq!(accepted.checkpoint, committed.checkpoint);
    assert_eq!(accepted.history.last().unwrap().previous_fingerprint.as_deref(), Some("sha256:a"));
    assert!(matches!(accept_fingerprint(&accepted, "sha256:b", ALICE, at(21), &terms()), Err(Refusal::NoChange(_))));
    let live = acquire(&committed, "a", at(30), &terms()).unwrap();
    assert!(matches!(
        accept_fingerprint(&live, "sha256:b", ALICE, at(31), &terms()),
        Err(Refusal::HeldElsewhere { .. })
    ));
}

#[test]
fn fingerprint_check_truth_table() {
    assert_eq!(check_fingerprint("a", "a", None), FingerprintCheck::Same);
    assert_eq!(check_fingerprint("a", "a", Some("old")), FingerprintCheck::Same);
    assert_eq!(check_fingerprint("old", "a", Some("old")), FingerprintCheck::Earlier);
    assert_eq!(check_fingerprint("other", "a", Some("old")), FingerprintCheck::Changed);
    assert_eq!(check_fingerprint("other", "a", None), FingerprintCheck::Changed);
}
