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
//! The odds: a bucket whose key set changed while its row count did not keeps both sums only if
//! the keys that left and the keys that came add up to the same `(Σu, Σv)`: about 2^-62 for keys
//! hashed with SHA-256, and for integer keys about 2^-62 too unless the keys are chosen to collide
//! (sets with equal sums of values and of squares modulo P, such as {1, 5, 6} and {2, 3, 7}, left
//! and arriving together within one check). A count that grew is seen whatever the sums.

use sha2::{Digest, Sha256};

use crate::domain::cursor::PkValue;

/// The modulus of the integer-key hash: 2^31 - 1, a prime.
pub const KEY_HASH_MODULUS: i64 = 2_147_483_647;

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
                    PkValue::Text(value) => text.push_str(value),
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
