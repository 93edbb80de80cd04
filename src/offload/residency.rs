//! Where a component's weights live, and what a streamed part holds on the device: the one rule
//! the engine allocates by and the memory plan counts by.

use super::group::GroupLayout;
use super::streamer::StreamOptions;
use serde::Serialize;

/// Where one component's weights live.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum Residency {
    /// On the device for as long as the component is loaded.
    Resident,
    /// On the CPU, computing there (`--text-encoder-compute cpu`).
    OnCpu,
    /// In host memory; the whole component moves to the device for its stage.
    Parked,
    /// In host memory; the repeated blocks move through the device in groups (`by_step`: each
    /// step of a block, e.g. attention or feed-forward, is a group of its own).
    Streamed {
        blocks_per_group: usize,
        by_step: bool,
        #[serde(flatten)]
        options: StreamOptions,
    },
}

impl Residency {
    /// What this residency means for a model whose blocks split into `steps` steps: streaming
    /// step by step moves one step per group, and falls back to whole blocks when a block has
    /// no steps.
    pub fn for_steps(self, steps: usize) -> Residency {
        match self {
            Residency::Streamed {
                blocks_per_group,
                by_step: true,
                options,
            } => Residency::Streamed {
                blocks_per_group: if steps > 1 { 1 } else { blocks_per_group },
                by_step: steps > 1,
                options,
            },
            other => other,
        }
    }

    /// Streaming on a copy stream, copies at least `steps()` groups ahead of the one computing
    /// when they are block steps, `blocks()` when they are whole blocks (each asked only then).
    /// Step by step, a step that computes little (a cross-attention over a short text) would
    /// otherwise leave the copy of the next, larger step no time; the caller bounds it by what
    /// fits in one block's bytes, so leaf level never holds more than block level. Block by
    /// block, a block several times the typical one (HunyuanVideo's dual-stream blocks) needs
    /// as many typical computations to hide its copy.
    pub fn with_groups_ahead(
        self,
        steps: impl FnOnce() -> usize,
        blocks: impl FnOnce() -> usize,
    ) -> Residency {
        match self {
            Residency::Streamed {
                blocks_per_group,
                by_step,
                options,
            } if options.stream => Residency::Streamed {
                blocks_per_group,
                by_step,
                options: StreamOptions {
                    depth: options.depth.max(if by_step { steps() } else { blocks() }),
                    ..options
                },
            },
            other => other,
        }
    }

    /// Whether the weights wait in host memory.
    pub fn uses_host_memory(self) -> bool {
        matches!(self, Residency::Parked | Residency::Streamed { .. })
    }
}

impl std::fmt::Display for Residency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Residency::Resident => write!(f, "resident"),
            Residency::OnCpu => write!(f, "on the CPU"),
            Residency::Parked => write!(f, "parked in host memory, moved in whole for its stage"),
            Residency::Streamed {
                blocks_per_group,
                by_step,
                options,
            } => write!(
                f,
                "streamed {}, {}",
                if *by_step {
                    "step by step (each step of a block its own group)".to_string()
                } else {
                    format!("in groups of {blocks_per_group} block(s)")
                },
                if options.stream {
                    format!("prefetch depth {} on a copy stream", options.depth)
                } else {
                    "synchronous copies".to_string()
                }
            ),
        }
    }
}

/// Groups the copy stream keeps ahead of the computing one over `groups` groups: at most the
/// groups there are besides the computing one (a single group is never prefetched against
/// itself, which would hold it twice).
pub fn prefetch_depth(groups: usize, options: StreamOptions) -> usize {
    options.depth.max(1).min(groups.saturating_sub(1))
}

/// Device slots a streamed part allocates once and keeps between passes: the computing group
/// and the prefetched ones (with a copy stream), else none (each group gets fresh memory that
/// is freed after it runs).
pub fn slot_count(groups: usize, options: StreamOptions) -> usize {
    if options.stream && groups > 0 {
        prefetch_depth(groups, options) + 1
    } else {
        0
    }
}

/// Bytes of one device slot: for each dtype, the largest section of any group (a slot holds
/// any group).
pub fn slot_sections(layouts: &[GroupLayout]) -> Vec<(candle_core::DType, usize)> {
    let mut need: Vec<(candle_core::DType, usize)> = Vec::new();
    for section in layouts.iter().flat_map(|l| &l.sections) {
        match need.iter_mut().find(|(d, _)| *d == section.dtype) {
            Some((_, bytes)) => *bytes = (*bytes).max(section.bytes),
            None => need.push((section.dtype, section.bytes)),
        }
    }
    need
}

/// Device bytes a streamed part's groups hold while its stage runs: the [`slot_count`] slots,
/// which stay allocated between the passes of a stage, or, without a copy stream, the largest
/// group in fresh memory; and the expanded copy of the computing group's packed tensors.
/// Saturating: a layout beyond 2^64 bytes reads as u64::MAX, which the memory plan's checked
/// sums refuse.
pub fn streamed_bytes(groups: &[GroupLayout], options: StreamOptions) -> u64 {
    let slot: u64 = slot_sections(groups)
        .iter()
        .fold(0u64, |sum, &(_, b)| sum.saturating_add(b as u64));
    let expanded = groups.iter().map(|g| g.expanded_bytes() as u64).max();
    match slot_count(groups.len(), options) as u64 {
        0 => groups.iter().map(landed_bytes).max().unwrap_or(0),
        slots => slots
            .saturating_mul(slot)
            .saturating_add(expanded.unwrap_or(0)),
    }
}

/// Device bytes of a group moved in fresh memory, while it computes: its image and the
/// expanded copy of its packed tensors.
pub fn landed_bytes(group: &GroupLayout) -> u64 {
    (group.bytes as u64).saturating_add(group.expanded_bytes() as u64)
}

/// The weights of one component as its constructors ask for them, laid out as the engine
/// would hold them under one holding (see `pipeline::holding`).
#[derive(Clone, Debug, Default)]
pub struct ComponentLayout {
    /// Bytes of the part that is built directly on the device: the whole component when it is
    /// resident, its outer part (without what stays in host memory) when its blocks stream or
    /// are sharded.
    pub direct_bytes: usize,
    /// The groups the engine moves (or FSDP shards): one (the whole component) when parked,
    /// one per group of blocks or block steps when streamed, one per block when sharded, none
    /// otherwise.
    pub groups: Vec<GroupLayout>,
    /// Bytes kept in host memory apart from the groups: what a streamed outer part keeps there
    /// (a token table), or the whole component when it is built on the CPU.
    pub host_bytes: usize,
}

/// Device weight bytes of a component while its stage runs and while it waits loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceWeights {
    pub active: u64,
    pub idle: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(depth: usize, stream: bool) -> StreamOptions {
        StreamOptions { stream, depth }
    }

    /// The slot rule: depth + 1 slots while there are more groups than that, never more slots
    /// than groups, none without a copy stream.
    #[test]
    fn slots_never_outnumber_groups() {
        assert_eq!(slot_count(40, streamed(1, true)), 2);
        assert_eq!(slot_count(40, streamed(3, true)), 4);
        assert_eq!(slot_count(2, streamed(3, true)), 2);
        // One group of 40 blocks (`--num-blocks-per-group 40` on a 40-block DiT): one slot.
        assert_eq!(slot_count(1, streamed(1, true)), 1);
        assert_eq!(slot_count(0, streamed(1, true)), 0);
        assert_eq!(slot_count(40, streamed(2, false)), 0);
        assert_eq!(prefetch_depth(1, streamed(4, true)), 0);
        assert_eq!(prefetch_depth(10, streamed(0, true)), 1);
    }

    /// Streaming on a copy stream runs at least the steps' or the blocks' look-ahead, as its
    /// groups are (more when asked); without a copy stream the depth stays.
    #[test]
    fn streaming_runs_at_least_its_groups_look_ahead() {
        let depth = |by_step, stream, asked| match (Residency::Streamed {
            blocks_per_group: 1,
            by_step,
            options: streamed(asked, stream),
        })
        .with_groups_ahead(|| 3, || 2)
        {
            Residency::Streamed { options, .. } => options.depth,
            other => panic!("{other:?}"),
        };
        assert_eq!(depth(true, true, 1), 3);
        assert_eq!(depth(true, true, 4), 4);
        assert_eq!(depth(false, true, 1), 2);
        assert_eq!(depth(false, true, 4), 4);
        assert_eq!(depth(false, false, 1), 1);
        assert_eq!(depth(true, false, 1), 1);
    }
}
