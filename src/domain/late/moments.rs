//! Telling the versions that left a bucket from one that came (issue 45, finding 9).
//!
//! A recount sees, per bucket, aggregates of the versions there now (`C`); the record holds the
//! same aggregates of the versions delivered (`R`). Between two recounts versions **leave**
//! (`D ⊆ R`: a row updated past the checkpoint or into another bucket, or deleted) and **come**
//! (`A`: a commit behind the checkpoint, late). A count and sums show `|A| - |D|` and
//! `Σ(A) - Σ(D)`: when the count shrank, any `A` hides behind the departures (two versions left,
//! one came: one row fewer, sums that no one can check, since the departed versions are known to
//! nobody but by the record's sums).
//!
//! So the record also keeps the **moments** of each version's `v` (a number modulo the prime
//! `P`, [`super::hash`]): `p_j = Σ v^j mod P` for `j` = 1 (`sum_v`) to [`MOMENTS`]. Their
//! differences `q_j = p_j(R) - p_j(C)` are the power sums of the signed multiset `D - A`. When
//! nothing came, `q` are the power sums of `s = |D|` numbers, `s` the rows fewer: Newton's
//! identities give their elementary symmetric polynomials `e_1..e_s` from `q_1..q_s`, and then
//! each `q_k` for `k` in `s+1..=MOMENTS` must follow from them. That is the test
//! ([`departures_only`]).
//!
//! What it guarantees: when at most [`MOMENTS`] versions left a bucket between two of its
//! recounts, a version that came is always told (the test passing would make
//! `Π(1 - d·t) ≡ Π(1 - e·t)·Π(1 - a·t)` modulo `t^(MOMENTS+1)` for polynomials of degree
//! `|D| ≤ MOMENTS`, so equal, and every arrival one of the departures), unless an arrival's `v`
//! equals a departed version's (about 2^-31 a pair). With more departures and a shrink of fewer
//! than [`MOMENTS`] rows, the `MOMENTS - s` checks pass by chance only (about 2^-31 each). A shrink
//! of [`MOMENTS`] rows or more leaves no check: undecided.

use super::Tally;
use super::hash::KEY_HASH_MODULUS;

/// How many power sums of `v` a tally keeps (the first is `sum_v`).
pub const MOMENTS: usize = 4;

const P: u64 = KEY_HASH_MODULUS as u64;

/// `v²`, `v³`, `v⁴` modulo P: one version's part of a tally's moments (what the SQL repeats).
pub fn powers(v: u32) -> [u64; 3] {
    let v = u64::from(v) % P;
    let square = v * v % P;
    [square, square * v % P, square * square % P]
}

fn power_sums(tally: &Tally) -> Option<[u64; MOMENTS]> {
    let moments = tally.moments?;
    Some([tally.sum_v % P, moments[0] % P, moments[1] % P, moments[2] % P])
}

fn inverse(value: u64) -> u64 {
    // Fermat: value^(P-2), P prime.
    let (mut base, mut exponent, mut result) = (value % P, P - 2, 1u64);
    while exponent > 0 {
        if exponent & 1 == 1 {
            result = result * base % P;
        }
        base = base * base % P;
        exponent >>= 1;
    }
    result
}

/// Whether the versions that left a bucket explain its recount `found` against `recorded`
/// (fewer rows): `Some(true)` nothing came, `Some(false)` at least one version came, `None` the
/// moments cannot tell (a shrink of [`MOMENTS`] rows or more, or a record without moments).
pub fn departures_only(recorded: &Tally, found: &Tally) -> Option<bool> {
    let shrink = usize::try_from(recorded.rows.checked_sub(found.rows)?).ok()?;
    if shrink == 0 || shrink >= MOMENTS {
        return None;
    }
    let (before, after) = (power_sums(recorded)?, power_sums(found)?);
    // q[j - 1] = p_j(R) - p_j(C): the power sums of the versions that left, less those that came.
    let q: [u64; MOMENTS] = std::array::from_fn(|index| (before[index] + P - after[index]) % P);
    // Newton: k·e_k = Σ_{i=1..k} (-1)^(i-1) e_{k-i} q_i, with e_0 = 1 and e_k = 0 for k > shrink.
    let mut e = [0u64; MOMENTS + 1];
    e[0] = 1;
    let residual = |e: &[u64; MOMENTS + 1], k: usize| {
        (1..=k).fold(0u64, |sum, i| {
            let term = e[k - i] * q[i - 1] % P;
            if i % 2 == 1 { (sum + term) % P } else { (sum + P - term) % P }
        })
    };
    for k in 1..=shrink {
        e[k] = residual(&e, k) * inverse(k as u64) % P;
    }
    Some((shrink + 1..=MOMENTS).all(|k| residual(&e, k) == 0))
}

#[cfg(test)]
mod tests {
    use super::super::KeyHash;
    use super::*;

    fn tally(values: &[u32]) -> Tally {
        let mut tally = Tally::default();
        for (index, v) in values.iter().enumerate() {
            tally.add(KeyHash { u: index as u32, v: *v });
        }
        tally
    }

    /// The record less some versions, plus others: `departures_only` of the two.
    fn judge(recorded: &[u32], left: &[usize], came: &[u32]) -> Option<bool> {
        let now: Vec<u32> = recorded
            .iter()
            .enumerate()
            .filter(|(index, _)| !left.contains(index))
            .map(|(_, v)| *v)
            .chain(came.iter().copied())
            .collect();
        departures_only(&tally(recorded), &tally(&now))
    }

    /// Versions that only left are told as such, for every shrink the moments decide.
    #[test]
    fn departures_alone_are_departures() {
        let mut rng = fastrand::Rng::with_seed(45);
        for _ in 0..2_000 {
            let recorded: Vec<u32> = (0..rng.usize(4..40)).map(|_| rng.u32(0..P as u32)).collect();
            let shrink = rng.usize(1..MOMENTS);
            let left: Vec<usize> = rng.choose_multiple(0..recorded.len(), shrink);
            assert_eq!(judge(&recorded, &left, &[]), Some(true), "{recorded:?} less {left:?}");
        }
    }

    /// Up to MOMENTS versions left and at least one came (fewer rows all the same): always told.
    #[test]
    fn an_arrival_beside_up_to_four_departures_is_always_told() {
        let mut rng = fastrand::Rng::with_seed(9);
        for _ in 0..5_000 {
            let recorded: Vec<u32> = (0..rng.usize(5..40)).map(|_| rng.u32(0..P as u32)).collect();
            let departures = rng.usize(2..=MOMENTS);
            let arrivals = rng.usize(1..departures);
            let left: Vec<usize> = rng.choose_multiple(0..recorded.len(), departures);
            let came: Vec<u32> = (0..arrivals).map(|_| rng.u32(0..P as u32)).collect();
            assert_eq!(judge(&recorded, &left, &came), Some(false), "{recorded:?} less {left:?} plus {came:?}");
        }
        // Small, structured values too: the case of the simulation's scenario (v of 1..=4).
        assert_eq!(judge(&[1, 2, 3, 4], &[1, 2], &[9]), Some(false));
        assert_eq!(judge(&[1, 2, 3, 4], &[1, 2], &[]), Some(true));
    }

    /// More departures than moments, a shrink below MOMENTS: still told, by chance of 2^-31 a check.
    #[test]
    fn many_departures_and_an_arrival_are_told_but_for_chance() {
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..2_000 {
            let recorded: Vec<u32> = (0..rng.usize(12..60)).map(|_| rng.u32(0..P as u32)).collect();
            let left: Vec<usize> = rng.choose_multiple(0..recorded.len(), 10);
            let came: Vec<u32> = (0..rng.usize(7..=9)).map(|_| rng.u32(0..P as u32)).collect();
            assert_eq!(judge(&recorded, &left, &came), Some(false));
        }
    }

    /// A shrink of MOMENTS rows or more, or a record an earlier build wrote: undecided.
    #[test]
    fn a_large_shrink_or_a_record_without_moments_is_undecided() {
        let recorded: Vec<u32> = (1..=10).collect();
        assert_eq!(judge(&recorded, &[0, 1, 2, 3], &[]), None);
        assert_eq!(judge(&recorded, &[0, 1, 2, 3, 4], &[77]), None);
        let legacy = Tally { moments: None, ..tally(&recorded) };
        assert_eq!(departures_only(&legacy, &tally(&recorded[1..])), None);
        assert_eq!(departures_only(&tally(&recorded), &tally(&recorded)), None, "no shrink");
    }
}
