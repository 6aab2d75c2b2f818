//! The key hash the late-arrival detector sums per bucket, defined so that PostgreSQL, MySQL /
//! MariaDB and SQLite compute the same numbers in SQL as this module does in Rust.
//!
//! Each row contributes two numbers `u` and `v`, both below 2^31, so that a bucket's sums are exact
//! integers on every engine (no overflow below 2^32 rows a bucket, no modular arithmetic to agree
//! on):
//!
//! - **one integer key column** (the common case, computed with integer arithmetic only, which
//!   every engine evaluates in a few nanoseconds): `u = k mod P` (made non-negative) and
//!   `v = u² mod P`, with `P = 2^31 - 1` (a prime). Two distinct keys agree on `u` only when they
//!   differ by a multiple of `P`; `v` makes the sums non-linear, so that swapping keys for others
//!   with the same total (101 and 102 for 100 and 103) changes `Σv`.
//! - **any other key** (text, or several columns): the key's text (each column as text, joined by
//!   U+001F) hashed with SHA-256; `u` is its first four bytes and `v` the next four, each read big
//!   endian and shifted right by one bit.
//!
//! A text value is hashed without its trailing spaces, on both sides: PostgreSQL's `char(n)`
//! arrives padded in Rust and unpadded through `::text`, MySQL's `CHAR` the other way round, and
//! a PAD SPACE collation compares `'a'` and `'a '` as one key anyway.
//!
//! What the window sums is a row **version**'s hash ([`version_hash`]): the key's `(k_u, k_v)`
//! and the cursor's word `w` (the integer; a timestamp's microseconds since 1970, a naive one read
//! as UTC; an `xid8`'s value; each modulo P), mixed with integer arithmetic again:
//! `u = (k_u + w·M mod P) mod P`, `v = (k_v + u² mod P) mod P` (`M` a fixed multiplier). A row
//! updated behind the checkpoint (a new cursor, the same key) is then a version that left and
//! one that came, even within one bucket.
//!
//! The odds: a bucket whose versions changed while its row count did not keeps both sums only if
//! the versions that left and the versions that came add up to the same `(Σu, Σv)`. A single
//! version that moved within a bucket keeps `u` only if its cursor moved by a multiple of P (for a
//! timestamp, 2,147.48 s exactly: longer than a bucket spans unless `windowSeconds` is over nine
//! hours); otherwise, as for any other change of the set, about 2^-62 for keys hashed with
//! SHA-256, and for integer keys about 2^-62 too unless the versions are chosen to collide (sets
//! with equal sums of `u` and of squares modulo P, left and arriving together within one check).
//! A count that grew is seen whatever the sums; one that shrank is judged by the moments of `v`
//! ([`super::moments`]).

use sha2::{Digest, Sha256};

use crate::domain::cursor::{CursorValue, PkValue};

/// The modulus of the integer-key hash: 2^31 - 1, a prime.
pub const KEY_HASH_MODULUS: i64 = 2_147_483_647;

/// The multiplier of the cursor's word in a version's hash (below P, far from 0 and 1).
pub const CURSOR_MULTIPLIER: i64 = 1_103_515_245;

/// The separator between the columns of a key's text: U+001F (unit separator).
pub const KEY_TEXT_SEPARATOR: char = '\u{1f}';

/// One row's contribution to its bucket's sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KeyHash {
    pub u: u32,
    pub v: u32,
}

/// How a key is hashed, which decides the SQL that hashes it the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyHashKind {
    /// One integer column: integer arithmetic.
    Integer,
    /// Anything else: SHA-256 of the key's text.
    Digest,
}

impl KeyHashKind {
    /// The kind for a key of these values (a checkpoint's key tells a source which SQL to run).
    pub fn of(values: &[&PkValue]) -> KeyHashKind {
        match values {
            [PkValue::Integer(_)] => KeyHashKind::Integer,
            _ => KeyHashKind::Digest,
        }
    }
}

/// The hash of a key, its column values in the configured order.
pub fn key_hash(values: &[&PkValue]) -> KeyHash {
    match values {
        [PkValue::Integer(number)] => integer_key_hash(*number),
        _ => {
            let mut text = String::new();
            for (index, value) in values.iter().enumerate() {
                if index > 0 {
                    text.push(KEY_TEXT_SEPARATOR);
                }
                match value {
                    PkValue::Integer(number) => text.push_str(&number.to_string()),
                    PkValue::Text(value) => text.push_str(value.trim_end_matches(' ')),
                }
            }
            text_key_hash(&text)
        }
    }
}

/// The hash of a position's key (`(name, value)` pairs in the configured order).
pub fn position_key_hash(pk: &[(String, PkValue)]) -> KeyHash {
    match pk {
        [(_, PkValue::Integer(number))] => integer_key_hash(*number),
        _ => {
            let values: Vec<&PkValue> = pk.iter().map(|(_, value)| value).collect();
            key_hash(&values)
        }
    }
}

/// The cursor's word: its integer (a timestamp's microseconds since 1970, a naive one read as
/// UTC) modulo P, non-negative.
pub fn cursor_word(cursor: &CursorValue) -> i64 {
    let number = match cursor {
        CursorValue::Integer(number) => *number,
        CursorValue::Timestamp { at, .. } => at.timestamp_micros(),
        CursorValue::NaiveTimestamp(at) => at.and_utc().timestamp_micros(),
        CursorValue::Xid(xid) => return (xid % KEY_HASH_MODULUS as u64) as i64,
    };
    number.rem_euclid(KEY_HASH_MODULUS)
}

/// A row version's hash: its key's, mixed with its cursor's word (the module's formula).
pub fn version_hash(key: KeyHash, cursor: &CursorValue) -> KeyHash {
    mix(key, cursor_word(cursor))
}

/// `u = (k_u + w·M mod P) mod P`, `v = (k_v + u² mod P) mod P`: what the SQL repeats.
pub fn mix(key: KeyHash, word: i64) -> KeyHash {
    let modulus = KEY_HASH_MODULUS;
    let u = (i64::from(key.u) + (word * CURSOR_MULTIPLIER) % modulus) % modulus;
    let v = (i64::from(key.v) + (u * u) % modulus) % modulus;
    KeyHash { u: u as u32, v: v as u32 }
}

/// `u = k mod P` (non-negative), `v = u² mod P`: what `((k % P) + P) % P` and `(u * u) % P`
/// give in SQL, where `%` keeps the sign of the dividend as Rust's does.
pub fn integer_key_hash(key: i64) -> KeyHash {
    let u = ((key % KEY_HASH_MODULUS) + KEY_HASH_MODULUS) % KEY_HASH_MODULUS;
    let v = (u * u) % KEY_HASH_MODULUS;
    KeyHash { u: u as u32, v: v as u32 }
}

/// The first two 31-bit words of SHA-256 of the key's text (UTF-8).
pub fn text_key_hash(text: &str) -> KeyHash {
    let digest = Sha256::digest(text.as_bytes());
    let word = |at: usize| u32::from_be_bytes([digest[at], digest[at + 1], digest[at + 2], digest[at + 3]]) >> 1;
    KeyHash { u: word(0), v: word(4) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_keys_hash_by_arithmetic_that_sql_repeats() {
        assert_eq!(integer_key_hash(5), KeyHash { u: 5, v: 25 });
        // Negative keys: SQL's `%` keeps the dividend's sign, so `+ P) % P` makes it positive.
        assert_eq!(integer_key_hash(-1), KeyHash { u: 2_147_483_646, v: 1 });
        assert_eq!(integer_key_hash(KEY_HASH_MODULUS), KeyHash { u: 0, v: 0 });
        let large = integer_key_hash(i64::MAX);
        assert!(large.u < KEY_HASH_MODULUS as u32 && large.v < KEY_HASH_MODULUS as u32);
        assert_eq!(integer_key_hash(i64::MIN).u, (((i64::MIN % KEY_HASH_MODULUS) + KEY_HASH_MODULUS) as u32));
    }

    /// The values PostgreSQL gives for the same keys (`select ('x' || substr(encode(sha256(
    /// convert_to('a', 'UTF8')), 'hex'), 1, 8))::bit(32)::bigint >> 1`), pinned so that a change
    /// on either side is seen.
    #[test]
    fn text_keys_hash_by_sha256_words() {
        // sha256("a") = ca978112 ca1bbdca ...
        assert_eq!(text_key_hash("a"), KeyHash { u: 0xca97_8112 >> 1, v: 0xca1b_bdca >> 1 });
        let composite = key_hash(&[&PkValue::Integer(7), &PkValue::Text("x".into())]);
        assert_eq!(composite, text_key_hash("7\u{1f}x"));
        assert_eq!(key_hash(&[&PkValue::Text("a".into())]), text_key_hash("a"));
    }

    #[test]
    fn the_kind_follows_the_key() {
        assert_eq!(KeyHashKind::of(&[&PkValue::Integer(1)]), KeyHashKind::Integer);
        assert_eq!(KeyHashKind::of(&[&PkValue::Text("1".into())]), KeyHashKind::Digest);
        assert_eq!(KeyHashKind::of(&[&PkValue::Integer(1), &PkValue::Integer(2)]), KeyHashKind::Digest);
    }

    /// A version's hash changes with its cursor, and PostgreSQL computes the same numbers
    /// (`select (5 + 1000 * 1103515245 % 2147483647) % 2147483647`: 1856134094).
    #[test]
    fn a_version_is_its_key_and_its_cursor() {
        let key = integer_key_hash(5);
        let first = version_hash(key, &CursorValue::Integer(1000));
        assert_eq!(first, KeyHash { u: 1_856_134_094, v: 960_755_096 });
        assert_ne!(first, version_hash(key, &CursorValue::Integer(1001)));
        let at = chrono::DateTime::from_timestamp_micros(1_700_000_000_123_456).unwrap();
        let stamped = CursorValue::Timestamp { at, source_text: None };
        assert_eq!(cursor_word(&stamped), 1_700_000_000_123_456i64.rem_euclid(KEY_HASH_MODULUS));
        assert_eq!(cursor_word(&CursorValue::NaiveTimestamp(at.naive_utc())), cursor_word(&stamped));
        assert_eq!(cursor_word(&CursorValue::Integer(-1)), KEY_HASH_MODULUS - 1);
        assert_eq!(cursor_word(&CursorValue::Xid(u64::MAX)), (u64::MAX % KEY_HASH_MODULUS as u64) as i64);
    }

    /// A padded `char(n)` key and its unpadded text are one key.
    #[test]
    fn trailing_spaces_are_not_part_of_a_text_key() {
        let padded = key_hash(&[&PkValue::Text("c200    ".into())]);
        assert_eq!(padded, key_hash(&[&PkValue::Text("c200".into())]));
        assert_ne!(padded, key_hash(&[&PkValue::Text(" c200".into())]));
    }

    /// Keys that add up alike (a row moved out for each late one, same total) still change Σv.
    #[test]
    fn swapped_keys_with_equal_sums_change_the_squares() {
        let sums = |keys: &[i64]| {
            keys.iter().fold((0u64, 0u64), |(u, v), key| {
                let hash = integer_key_hash(*key);
                (u + hash.u as u64, v + hash.v as u64)
            })
        };
        assert_eq!(sums(&[100, 103]).0, sums(&[101, 102]).0);
        assert_ne!(sums(&[100, 103]).1, sums(&[101, 102]).1);
    }
}
