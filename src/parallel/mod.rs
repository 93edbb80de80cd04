//! Several processes (one per GPU) computing one video together, and the ranks they are: the
//! launcher's environment ([`world`]), the rendezvous that publishes NCCL's id ([`rendezvous`]),
//! the collectives on tensors ([`collective`], NCCL behind the `nccl` feature), Ulysses sequence
//! parallelism ([`ulysses`]). Knows no model: a model's self-attention calls the
//! [`crate::models::sequence_parallel::SequenceParallel`] hook that [`ulysses::Ulysses`] is.

pub mod collective;
pub mod fsdp;
pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod rendezvous;
pub mod supervisor;
pub mod ulysses;
pub mod world;

use std::ops::Range;

use std::sync::Arc;

use crate::cli::args::GenerateOptions;
use crate::models::sequence_parallel::SequenceParallel;
use collective::Collective;

/// One rank's part in a run whose GPUs compute each video together: the group of every rank and
/// the hook the DiT's self-attention goes through.
#[derive(Clone)]
pub struct Ranks {
    pub group: Arc<dyn Collective>,
    pub sequence: Arc<dyn SequenceParallel>,
}

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} of {}",
            self.group.rank(),
            self.group.world_size()
        )
    }
}

/// Why this build cannot run what the resolved options ask of several GPUs (`None`: it can).
/// A dry run plans any of them.
pub fn cannot_run(o: &GenerateOptions) -> Option<String> {
    let sp = o.sp_size.unwrap_or(o.num_gpus);
    // Prompt parallelism (--sp-size 1) needs no collective.
    if o.num_gpus > 1 && sp > 1 && !cfg!(feature = "nccl") {
        return Some(format!(
            "--num-gpus {} needs a vidgen built with the `nccl` feature (cargo build --release --features nccl); --dry-run plans it without",
            o.num_gpus
        ));
    }
    if o.num_gpus > 1 && sp > 1 && sp < o.num_gpus {
        return Some(format!(
            "--sp-size {sp} of --num-gpus {}: groups of sequence-parallel GPUs are not wired yet; pass --sp-size {} or 1 (--dry-run plans it)",
            o.num_gpus, o.num_gpus
        ));
    }
    if o.num_gpus > 1 && sp == 1 && o.use_fsdp_inference {
        return Some(
            "--use-fsdp-inference shards the DiT across GPUs that compute one video together; with --sp-size 1 each GPU makes its own: drop one of them"
                .into(),
        );
    }
    if o.num_gpus > 1 && sp > 1 && o.resume {
        return Some("--resume with sequence parallelism is not supported yet: the ranks must run the same prompts; drop --resume".into());
    }
    if o.use_fsdp_inference {
        return Some(
            "--use-fsdp-inference shards the DiT across GPUs: pass --num-gpus 2 or more, or drop it"
                .into(),
        );
    }
    None
}

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
