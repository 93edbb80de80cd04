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

use candle_core::{Device, Tensor};

use crate::models::sequence_parallel::SequenceParallel;
use collective::Collective;

/// How `--num-gpus` ranks form sequence-parallel groups: `sp` consecutive ranks per group
/// (`--sp-size`, a divisor of the ranks), each group splitting one video at a time and making
/// its own share of the prompts (prompt `i` belongs to group `i % count`), as prompt parallelism
/// does per rank. The first rank of a group leads it: it alone encodes, decodes and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Groups {
    pub ranks: usize,
    pub sp: usize,
}

impl Groups {
    /// The groups of `--num-gpus` and `--sp-size` (default: one group of every GPU).
    pub fn of(num_gpus: u32, sp_size: Option<u32>) -> Self {
        let ranks = num_gpus.max(1) as usize;
        let sp = (sp_size.unwrap_or(num_gpus) as usize).clamp(1, ranks);
        Groups { ranks, sp }
    }

    /// How many groups there are.
    pub fn count(&self) -> usize {
        self.ranks / self.sp
    }

    /// The group of `rank`.
    pub fn group(&self, rank: usize) -> usize {
        rank / self.sp
    }

    /// `rank`'s place in its group.
    pub fn rank_in_group(&self, rank: usize) -> usize {
        rank % self.sp
    }

    /// Whether `rank` leads its group (encodes, decodes, writes).
    pub fn leads(&self, rank: usize) -> bool {
        self.rank_in_group(rank) == 0
    }

    /// The ranks of `group`.
    pub fn members(&self, group: usize) -> Range<usize> {
        group * self.sp..(group + 1) * self.sp
    }

    /// `rank`'s share of the prompts, `(mine, of)`: it makes prompt `i` when `i % of == mine`.
    pub fn prompts(&self, rank: usize) -> (usize, usize) {
        (self.group(rank), self.count())
    }

    /// The groups in words, for the dry run: `[0,1] [2,3]`.
    pub fn describe(&self) -> String {
        (0..self.count())
            .map(|g| {
                let ranks: Vec<String> = self.members(g).map(|r| r.to_string()).collect();
                format!("[{}]", ranks.join(","))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// One rank's part in a sequence-parallel group: the group's collective (its ranks only) and
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

impl Ranks {
    /// The part of a member of `group`: Ulysses over it.
    pub fn new(group: Arc<dyn Collective>) -> Self {
        Ranks {
            sequence: Arc::new(ulysses::Ulysses::new(group.clone())),
            group,
        }
    }

    /// Whether this rank leads its group.
    pub fn leads(&self) -> bool {
        self.group.rank() == 0
    }
}

/// Work that one rank of a group does for all of it (text and image encoding): alone, or on the
/// group's leader, `make` runs; the leader then broadcasts its tensors (or its failure) and
/// every other rank receives them, on `device`, instead of running `make`.
pub fn once_per_group(
    ranks: Option<&Ranks>,
    device: &Device,
    make: impl FnOnce() -> anyhow::Result<Vec<Tensor>>,
) -> anyhow::Result<Vec<Tensor>> {
    match ranks {
        None => make(),
        Some(r) if r.leads() => {
            let made = make();
            let shared = collective::broadcast_tensors(
                r.group.as_ref(),
                made.as_ref().ok().map(Vec::as_slice),
                device,
            );
            let made = made?;
            shared?;
            Ok(made)
        }
        Some(r) => Ok(collective::broadcast_tensors(
            r.group.as_ref(),
            None,
            device,
        )?),
    }
}

/// Why this build cannot run `groups` (with FSDP's shards, with `--resume`) (`None`: it can).
/// A dry run plans any of them.
pub fn cannot_run(groups: Groups, fsdp: bool, resume: bool) -> Option<String> {
    let Groups { ranks, sp } = groups;
    // Prompt parallelism (--sp-size 1) needs no collective.
    if ranks > 1 && sp > 1 && !cfg!(feature = "nccl") {
        return Some(format!(
            "--num-gpus {ranks} needs a vidgen built with the `nccl` feature (cargo build --release --features nccl); --dry-run plans it without"
        ));
    }
    if ranks > 1 && sp == 1 && fsdp {
        return Some(
            "--use-fsdp-inference shards the DiT across GPUs that compute one video together; with --sp-size 1 each GPU makes its own: drop one of them"
                .into(),
        );
    }
    if ranks > 1 && sp > 1 && resume {
        return Some("--resume with sequence parallelism is not supported yet: the ranks must run the same prompts; drop --resume".into());
    }
    if fsdp {
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
    fn groups_are_consecutive_ranks_each_with_its_prompts() {
        let g = Groups { ranks: 6, sp: 3 };
        assert_eq!(g.count(), 2);
        assert_eq!((g.members(0), g.members(1)), (0..3, 3..6));
        assert_eq!((g.group(4), g.rank_in_group(4), g.leads(4)), (1, 1, false));
        assert!(g.leads(3));
        assert_eq!(g.prompts(5), (1, 2));
        assert_eq!(g.describe(), "[0,1,2] [3,4,5]");
        // Prompt parallelism: every rank its own group.
        let one = Groups { ranks: 2, sp: 1 };
        assert_eq!((one.count(), one.prompts(1)), (2, (1, 2)));
        assert!(one.leads(1));
    }

    #[test]
    fn split_is_exact_and_balanced() {
        assert_eq!(split(10, 3), vec![0..4, 4..7, 7..10]);
        assert_eq!(split(4, 2), vec![0..2, 2..4]);
        assert_eq!(split(2, 3), vec![0..1, 1..2, 2..2]);
    }
}
