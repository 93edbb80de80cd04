//! A seeded random-mutation fuzzer for the parsers of user files (prompt files, `.jsonl` lines,
//! TOML configs, safetensors headers), run as ordinary unit tests: deterministic, a fixed
//! number of inputs, well under a second each. Inputs that once broke a parser are kept next
//! to its fuzz test as regression cases.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Fragments that reach the corners of text formats: quotes, brackets, escapes, NUL, huge and
/// non-finite numbers, line ends, a BOM, bytes that are not UTF-8.
const TOKENS: &[&[u8]] = &[
    b"\"",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"=",
    b"\\",
    b"\\u0000",
    b"\\ud800",
    b"\0",
    b"nan",
    b"inf",
    b"-1",
    b"0",
    b"1e309",
    b"18446744073709551616",
    b"4294967296",
    b"\n",
    b"\r\n",
    b"\xef\xbb\xbf",
    b"\xff",
    b"\xc3",
    b"#",
    b"prompt",
    b"num_frames",
    b"null",
    b"true",
    b"[[x]]",
    b"'''",
];

/// Calls `check` on `iterations` inputs, each a few random mutations of one of `seeds`; a panic
/// inside `check` fails the test naming the input that caused it.
///
/// `VIDGEN_FUZZ_ROUNDS=N` runs N times as many inputs (a longer search, by hand).
pub fn mutate(seeds: &[&[u8]], iterations: usize, mut check: impl FnMut(&[u8])) {
    let rounds: usize = std::env::var("VIDGEN_FUZZ_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1);
    let mut rng = StdRng::seed_from_u64(17);
    for _ in 0..iterations * rounds {
        let mut input = seeds[rng.gen_range(0..seeds.len())].to_vec();
        for _ in 0..rng.gen_range(1..=4) {
            mutate_once(&mut rng, &mut input);
        }
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&input)));
        if caught.is_err() {
            panic!(
                "the parser panicked on {:?}; keep it as a regression case",
                String::from_utf8_lossy(&input)
            );
        }
    }
}

fn mutate_once(rng: &mut StdRng, input: &mut Vec<u8>) {
    let at = rng.gen_range(0..=input.len());
    match rng.gen_range(0..5) {
        0 if !input.is_empty() => {
            let i = rng.gen_range(0..input.len());
            input[i] = rng.gen();
        }
        1 => input.insert(at, rng.gen()),
        2 if !input.is_empty() => {
            let end = rng.gen_range(at..=input.len().min(at + 8));
            input.drain(at..end);
        }
        3 => {
            let token = TOKENS[rng.gen_range(0..TOKENS.len())];
            input.splice(at..at, token.iter().copied());
        }
        _ if !input.is_empty() => {
            // Repeat a slice: long lines, nested brackets.
            let start = rng.gen_range(0..input.len());
            let end = rng.gen_range(start..=input.len().min(start + 16));
            let piece = input[start..end].to_vec();
            for _ in 0..rng.gen_range(1..4) {
                input.splice(at..at, piece.iter().copied());
            }
        }
        _ => input.extend_from_slice(TOKENS[rng.gen_range(0..TOKENS.len())]),
    }
}
