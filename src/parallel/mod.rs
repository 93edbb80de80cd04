//! Several processes (one per GPU) computing one video together, and the ranks they are: the
//! launcher's environment ([`world`]), the rendezvous that publishes NCCL's id ([`rendezvous`]),
//! the collectives on tensors ([`collective`], NCCL behind the `nccl` feature), Ulysses sequence
//! parallelism ([`ulysses`]). Knows no model: a model's self-attention calls the
//! [`crate::models::sequence_parallel::SequenceParallel`] hook that [`ulysses::Ulysses`] is.

pub mod collective;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod rendezvous;
pub mod ulysses;
pub mod world;

use std::ops::Range;

/// `n` items in `parts` consecutive ranges, the first `n % parts` one longer: every rank's share,
/// computed the same way everywhere so each knows the others'.
pub fn split(n: usize, parts: usize) -> Vec<Range<usize>> {
    let (base, extra) = (n / parts, n % parts);
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_exact_and_balanced() {
        assert_eq!(split(10, 3), vec![0..4, 4..7, 7..10]);
        assert_eq!(split(4, 2), vec![0..2, 2..4]);
        assert_eq!(split(2, 3), vec![0..1, 1..2, 2..2]);
    }
}
