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

    /// Streaming step by step on a copy stream copies at least `steps()` slot fills ahead of
    /// the one computing (asked only then): a step that computes little (a cross-attention over
    /// a short text) would otherwise leave the copy of the next, larger step no time; the
    /// caller bounds it by what fits in one block's bytes, so leaf level never holds more than
    /// block level. Whole blocks need no more than one fill ahead: smaller blocks share a slot
    /// ([`SlotRuns`]), so a block several times the typical one has as many typical blocks'
    /// compute to hide its copy behind.
    pub fn with_steps_ahead(self, steps: impl FnOnce() -> usize) -> Residency {
        match self {
            Residency::Streamed {
                blocks_per_group,
                by_step: true,
                options,
            } if options.stream => Residency::Streamed {
                blocks_per_group,
                by_step: true,
                options: StreamOptions {
                    depth: options.depth.max(steps()),
                    ..options
                },
            },
            other => other,
        }
    }

    /// This residency with up to `bytes` of a streamed part's groups kept on the device through
    /// a stage ([`kept_groups`]).
    pub fn keeping(self, bytes: u64) -> Residency {
        match self {
            Residency::Streamed {
                blocks_per_group,
                by_step,
                options,
            } => Residency::Streamed {
                blocks_per_group,
                by_step,
                options: StreamOptions {
                    kept_bytes: bytes,
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
            )
            .and_then(|()| match options.kept_bytes {
                0 => Ok(()),
                kept => write!(
                    f,
                    ", up to {:.2} MiB of groups kept on the device",
                    kept as f64 / (1u64 << 20) as f64
                ),
            }),
        }
    }
}

/// Slot fills the copy stream keeps ahead of the computing one over `runs` [`SlotRuns`]: at
/// most the runs there are besides the computing one (a single run is never prefetched
/// against itself, which would hold it twice).
pub fn prefetch_depth(runs: usize, options: StreamOptions) -> usize {
    options.depth.max(1).min(runs.saturating_sub(1))
}

/// Device slots a streamed part allocates once and keeps between passes, over `runs`
/// [`SlotRuns`]: the computing run and the prefetched ones (with a copy stream), else none
/// (each group gets fresh memory that is freed after it runs).
pub fn slot_count(runs: usize, options: StreamOptions) -> usize {
    if options.stream && runs > 0 {
        prefetch_depth(runs, options) + 1
    } else {
        0
    }
}

/// How a streamed part's groups share its device slots: consecutive groups fill one slot
/// while their sections fit in it. A slot holds the largest group, so where groups differ
/// (FLUX.1's and HunyuanVideo's single-stream blocks are half a dual-stream block or less)
/// the copy stream runs several small groups ahead in the bytes one large group takes: a
/// large block's copy then hides behind as much compute as its bytes, at no device memory
/// beyond the slots. Groups of one size fill a slot each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotRuns {
    /// The groups of each slot fill, in order (one pass: a run never spans the pass's end).
    pub runs: Vec<std::ops::Range<usize>>,
    /// For each group, the byte offset of each of its sections in the slot's buffer of the
    /// section's dtype.
    pub offsets: Vec<Vec<usize>>,
}

impl SlotRuns {
    /// The runs of `groups` within slots of [`slot_sections`].
    pub fn of(groups: &[GroupLayout]) -> Self {
        let room = slot_sections(groups);
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        let mut offsets = Vec::with_capacity(groups.len());
        // Bytes of each dtype's buffer taken by the current run.
        let mut filled: ByDtype = Vec::new();
        for (index, group) in groups.iter().enumerate() {
            let fits = |filled: &ByDtype| {
                dtype_bytes(group)
                    .into_iter()
                    .all(|(dtype, bytes)| get(filled, dtype) + bytes <= get(&room, dtype))
            };
            match runs.last_mut() {
                Some(run) if fits(&filled) => run.end = index + 1,
                _ => {
                    runs.push(index..index + 1);
                    filled.clear();
                }
            }
            offsets.push(place_sections(group, &mut filled));
        }
        SlotRuns { runs, offsets }
    }

    /// One group per fill, each section at its offset among its group's sections of its
    /// dtype: for fills in memory of their own size ([`StreamOptions::exact_fills`]).
    pub fn each(groups: &[GroupLayout]) -> Self {
        let offsets = groups
            .iter()
            .map(|group| place_sections(group, &mut Vec::new()))
            .collect();
        SlotRuns {
            runs: (0..groups.len()).map(|i| i..i + 1).collect(),
            offsets,
        }
    }

    /// The runs `options` fill: one group each in exact fills, else groups sharing a slot.
    pub fn under(groups: &[GroupLayout], options: StreamOptions) -> Self {
        match options.exact_fills {
            true => Self::each(groups),
            false => Self::of(groups),
        }
    }

    /// Whether group `index` is the last of its run (its slot is free once it has computed).
    pub fn ends_run(&self, index: usize) -> bool {
        self.runs.iter().any(|r| r.end == index + 1)
    }
}

/// Each of `group`'s sections at the next offset of its dtype's buffer, `filled` the bytes each
/// buffer holds so far (and after them).
fn place_sections(group: &GroupLayout, filled: &mut ByDtype) -> Vec<usize> {
    group
        .sections
        .iter()
        .map(|s| {
            let used = entry(filled, s.dtype);
            *used += s.bytes;
            *used - s.bytes
        })
        .collect()
}

/// Bytes of one device slot: for each dtype, the most any group holds in it (a slot holds any
/// group, its sections of one dtype one after the other).
pub fn slot_sections(layouts: &[GroupLayout]) -> ByDtype {
    let mut need: ByDtype = Vec::new();
    for (dtype, bytes) in layouts.iter().flat_map(dtype_bytes) {
        let most = entry(&mut need, dtype);
        *most = (*most).max(bytes);
    }
    need
}

/// Bytes by dtype, in the order the dtypes first come.
pub type ByDtype = Vec<(candle_core::DType, usize)>;

/// The bytes of `dtype` in `list` (0 where it has none).
fn get(list: &ByDtype, dtype: candle_core::DType) -> usize {
    list.iter()
        .find(|(d, _)| *d == dtype)
        .map_or(0, |(_, b)| *b)
}

/// The bytes of `dtype` in `list`, added as 0 where it has none.
fn entry(list: &mut ByDtype, dtype: candle_core::DType) -> &mut usize {
    let at = match list.iter().position(|(d, _)| *d == dtype) {
        Some(at) => at,
        None => {
            list.push((dtype, 0));
            list.len() - 1
        }
    };
    &mut list[at].1
}

/// A group's section bytes summed by dtype.
pub(super) fn dtype_bytes(group: &GroupLayout) -> ByDtype {
    let mut sums: ByDtype = Vec::new();
    for section in &group.sections {
        *entry(&mut sums, section.dtype) += section.bytes;
    }
    sums
}

/// Device bytes a streamed part's groups hold while its stage runs: the groups it keeps there
/// ([`kept_groups`]); for the groups it moves, the [`slot_count`] slots, which stay allocated
/// between the passes of a stage, or, without a copy stream, the largest group in fresh memory,
/// and the expanded copy of the computing group's packed tensors.
/// Saturating: a layout beyond 2^64 bytes reads as u64::MAX, which the memory plan's checked
/// sums refuse.
pub fn streamed_bytes(groups: &[GroupLayout], options: StreamOptions) -> u64 {
    let (held, moved) = kept_and_moved(groups, options);
    held.saturating_add(moving_bytes(&moved, options))
}

/// The bytes of the groups kept on the device through a stage ([`kept_groups`]), and the
/// groups that move.
fn kept_and_moved(groups: &[GroupLayout], options: StreamOptions) -> (u64, Vec<GroupLayout>) {
    let kept = kept_groups(groups, options.kept_bytes);
    let (held, moved): (Vec<_>, Vec<_>) = groups.iter().zip(kept).partition(|(_, k)| *k);
    let held = held
        .into_iter()
        .fold(0u64, |sum, (g, _)| sum.saturating_add(landed_bytes(g)));
    (held, moved.into_iter().map(|(g, _)| g.clone()).collect())
}

/// Which of `groups` stay on the device through a stage within `budget` bytes (each counted by
/// [`landed_bytes`]): spread through the pass by bytes, each group kept where that leaves the
/// kept bytes so far nearer the budget's share of the bytes so far. Each stretch of the pass
/// then moves the same share of its bytes, and each moved group's copy hides behind the compute
/// of the kept groups around it, where kept groups in one run would leave the copies of the
/// rest to outlast their compute as before.
pub fn kept_groups(groups: &[GroupLayout], budget: u64) -> Vec<bool> {
    let total: u128 = groups.iter().map(|g| landed_bytes(g) as u128).sum();
    let (mut seen, mut kept) = (0u128, 0u128);
    groups
        .iter()
        .map(|g| {
            let bytes = landed_bytes(g) as u128;
            seen += bytes;
            // Kept where that leaves the kept bytes nearer the share than moving it would.
            let keep = bytes > 0
                && kept + bytes <= budget as u128
                && (2 * kept + bytes) * total <= 2 * budget as u128 * seen;
            if keep {
                kept += bytes;
            }
            keep
        })
        .collect()
}

/// Device bytes of moved `groups` while their stage runs (see [`streamed_bytes`]): the slots,
/// each the size of the largest fill; or, in exact fills, the most any [`slot_count`]
/// consecutive fills of a pass take (the next pass's first are copied beside its last ones only
/// where that takes no more, [`prefetches_across_passes`]); and the expanded copy of the
/// computing group's packed tensors.
fn moving_bytes(groups: &[GroupLayout], options: StreamOptions) -> u64 {
    let slot: u64 = slot_sections(groups)
        .iter()
        .fold(0u64, |sum, &(_, b)| sum.saturating_add(b as u64));
    let expanded = groups.iter().map(|g| g.expanded_bytes() as u64).max();
    let slots = slot_count(SlotRuns::under(groups, options).runs.len(), options);
    let in_flight = match (slots, options.exact_fills) {
        (0, _) => return groups.iter().map(landed_bytes).max().unwrap_or(0),
        (slots, true) => exact_fills_in_flight(groups, slots).0,
        (slots, false) => (slots as u64).saturating_mul(slot),
    };
    in_flight.saturating_add(expanded.unwrap_or(0))
}

/// The most bytes `slots` consecutive exact fills (one group each) take within a pass, and
/// across the end of one pass into the next.
fn exact_fills_in_flight(groups: &[GroupLayout], slots: usize) -> (u64, u64) {
    let n = groups.len();
    let window = |first: usize| {
        (first..first + slots.min(n)).fold(0u64, |sum, i| {
            sum.saturating_add(groups[i % n].bytes as u64)
        })
    };
    let within = (0..=n.saturating_sub(slots)).map(window).max().unwrap_or(0);
    let across = (n.saturating_sub(slots) + 1..n)
        .map(window)
        .max()
        .unwrap_or(0);
    (within, across)
}

/// Whether the copy stream copies the next pass's first fills while a pass's last ones
/// compute. Slots always do. Exact fills do where that holds no more than the pass's own fills
/// in flight; elsewhere (FLUX.1's last single-stream MLP beside its first modulation) they are
/// copied once the pass is done, as the outer part computes.
pub fn prefetches_across_passes(groups: &[GroupLayout], options: StreamOptions) -> bool {
    let slots = slot_count(SlotRuns::under(groups, options).runs.len(), options);
    if !options.exact_fills || slots == 0 {
        return true;
    }
    let (within, across) = exact_fills_in_flight(groups, slots);
    across <= within
}

/// Device bytes a streamed part's groups hold between two passes of a stage: the kept groups,
/// and the slots; in exact fills, only the first fills of the next pass, prefetched.
pub fn between_passes_bytes(groups: &[GroupLayout], options: StreamOptions) -> u64 {
    let (held, moved) = kept_and_moved(groups, options);
    let runs = SlotRuns::under(&moved, options).runs.len();
    let moving = match (slot_count(runs, options), options.exact_fills) {
        (0, _) => 0,
        (_, true) => moved[..prefetch_depth(runs, options)]
            .iter()
            .fold(0u64, |sum, g| sum.saturating_add(g.bytes as u64)),
        (_, false) => moving_bytes(&moved, options),
    };
    held.saturating_add(moving)
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
    /// While its stage runs (where `apart` is set: while its blocks run).
    pub active: u64,
    pub idle: u64,
    /// While its outer part computes apart from its blocks, where that moment holds other
    /// weights than the blocks' (an outer part moved in per use, beside the next pass's first
    /// fills): the plan takes the larger of the two moments, each with its own activations.
    pub apart: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(depth: usize, stream: bool) -> StreamOptions {
        StreamOptions {
            stream,
            depth,
            kept_bytes: 0,
            exact_fills: false,
        }
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

    /// Streaming step by step on a copy stream runs at least the steps' look-ahead (more when
    /// asked); whole blocks and synchronous copies keep the depth asked.
    #[test]
    fn streaming_steps_run_at_least_their_look_ahead() {
        let depth = |by_step, stream, asked| match (Residency::Streamed {
            blocks_per_group: 1,
            by_step,
            options: streamed(asked, stream),
        })
        .with_steps_ahead(|| 3)
        {
            Residency::Streamed { options, .. } => options.depth,
            other => panic!("{other:?}"),
        };
        assert_eq!(depth(true, true, 1), 3);
        assert_eq!(depth(true, true, 4), 4);
        assert_eq!(depth(false, true, 1), 1);
        assert_eq!(depth(false, true, 4), 4);
        assert_eq!(depth(false, false, 1), 1);
        assert_eq!(depth(true, false, 1), 1);
    }

    /// A group of `sections` (dtype, bytes), each at the next offset of its image.
    fn group(sections: &[(candle_core::DType, usize)]) -> GroupLayout {
        let mut offset = 0;
        GroupLayout {
            sections: sections
                .iter()
                .map(|&(dtype, bytes)| {
                    offset += bytes;
                    crate::offload::group::Section {
                        dtype,
                        offset: offset - bytes,
                        bytes,
                    }
                })
                .collect(),
            bytes: sections.iter().map(|s| s.1).sum(),
            ..Default::default()
        }
    }

    /// Kept groups spread through the pass by bytes: half of five equal groups keeps the first
    /// and third; a budget under one group keeps none, one over all keeps all. The plan counts
    /// the kept groups and slots for the moved ones alone: keeping a large group shrinks the
    /// slots to the small ones.
    #[test]
    fn kept_groups_spread_through_the_pass() {
        use candle_core::DType::BF16;
        let equal = vec![group(&[(BF16, 100)]); 5];
        assert_eq!(kept_groups(&equal, 250), [true, false, true, false, false]);
        assert_eq!(kept_groups(&equal, 99), [false; 5]);
        assert_eq!(kept_groups(&equal, 10_000), [true; 5]);
        let keeping = |kept_bytes| StreamOptions {
            kept_bytes,
            ..streamed(1, true)
        };
        // Two kept, two slots of one group for the three moved.
        assert_eq!(streamed_bytes(&equal, keeping(250)), 200 + 2 * 100);
        assert_eq!(streamed_bytes(&equal, keeping(10_000)), 500);
        assert_eq!(streamed_bytes(&equal, keeping(0)), 2 * 100);
        let (large, small) = (group(&[(BF16, 400)]), group(&[(BF16, 100)]));
        let mixed = [small.clone(), large, small.clone(), small];
        assert_eq!(kept_groups(&mixed, 500), [true, true, false, false]);
        assert_eq!(streamed_bytes(&mixed, keeping(0)), 2 * 400);
        assert_eq!(streamed_bytes(&mixed, keeping(500)), 500 + 2 * 100);
    }

    /// Exact fills take one group each, every section at its offset among its group's sections
    /// of its dtype. The device holds the most that `depth + 1` consecutive groups of a pass
    /// take, where slots would hold `depth + 1` of the largest; between passes only the next
    /// pass's first `depth` groups; kept groups beside both.
    #[test]
    fn exact_fills_hold_the_groups_in_flight() {
        use candle_core::DType::{BF16, F32};
        let exact = |depth, kept_bytes| StreamOptions {
            exact_fills: true,
            kept_bytes,
            ..streamed(depth, true)
        };
        let mixed = group(&[(BF16, 256), (F32, 128), (BF16, 64)]);
        let runs = SlotRuns::under(&[mixed.clone(), mixed.clone()], exact(1, 0));
        assert_eq!(runs.runs, [0..1, 1..2]);
        assert_eq!(runs.offsets, [vec![0, 0, 256], vec![0, 0, 256]]);
        let sizes = [100, 400, 50, 50, 300];
        let groups: Vec<GroupLayout> = sizes.iter().map(|&b| group(&[(BF16, b)])).collect();
        assert_eq!(streamed_bytes(&groups, streamed(1, true)), 2 * 400);
        assert_eq!(streamed_bytes(&groups, exact(1, 0)), 500);
        assert_eq!(streamed_bytes(&groups, exact(2, 0)), 550);
        // Not 300 with the next pass's 100, 400, which are copied once the pass is done.
        assert_eq!(streamed_bytes(&groups, exact(3, 0)), 800);
        assert!(!prefetches_across_passes(&groups, exact(3, 0)));
        // 300 beside the next pass's 100 is no more than 100, 400.
        assert!(prefetches_across_passes(&groups, exact(1, 0)));
        assert!(prefetches_across_passes(&groups, streamed(3, true)));
        assert_eq!(between_passes_bytes(&groups, exact(1, 0)), 100);
        assert_eq!(between_passes_bytes(&groups, exact(2, 0)), 500);
        assert_eq!(between_passes_bytes(&groups, streamed(1, true)), 2 * 400);
        assert_eq!(between_passes_bytes(&groups, streamed(1, false)), 0);
        // 100, 50, 50 kept (spread through the pass); 400 and 300 move.
        assert_eq!(kept_groups(&groups, 450), [true, false, true, true, false]);
        assert_eq!(streamed_bytes(&groups, exact(1, 450)), 200 + 700);
        assert_eq!(between_passes_bytes(&groups, exact(1, 450)), 200 + 400);
    }

    /// Consecutive groups share a slot while every dtype's sections fit in it, each section
    /// after the last one of its dtype; a group that does not fit starts the next fill, and
    /// groups of the largest size fill a slot each.
    #[test]
    fn smaller_groups_share_a_slot_while_they_fit() {
        use candle_core::DType::{BF16, F32};
        let (large, small) = (group(&[(BF16, 1024), (F32, 256)]), group(&[(BF16, 512)]));
        let mixed = group(&[(BF16, 256), (F32, 256)]);
        let groups = [
            large.clone(),
            large.clone(),
            small.clone(),
            small.clone(),
            small.clone(),
            mixed.clone(),
            mixed,
            large,
        ];
        let runs = SlotRuns::of(&groups);
        assert_eq!(runs.runs, [0..1, 1..2, 2..4, 4..6, 6..7, 7..8]);
        assert_eq!(
            runs.offsets,
            [
                vec![0, 0],
                vec![0, 0],
                vec![0],
                vec![512],
                vec![0],
                vec![512, 0],
                vec![0, 0],
                vec![0, 0],
            ]
        );
        let ends: Vec<bool> = (0..groups.len()).map(|i| runs.ends_run(i)).collect();
        assert_eq!(ends, [true, true, false, true, false, true, true, true]);
        // Two slots of 1280 bytes, however many groups each holds.
        assert_eq!(streamed_bytes(&groups, streamed(1, true)), 2 * (1024 + 256));
        // Groups of one size: one each (their count bounds the slots).
        let even = SlotRuns::of(&[small.clone(), small.clone(), small.clone()]);
        assert_eq!(even.runs, [0..1, 1..2, 2..3]);
        // A group's sections of one dtype lie one after the other, and the slot holds them all.
        let split = group(&[(BF16, 256), (BF16, 256)]);
        assert_eq!(
            slot_sections(&[split.clone(), small.clone()]),
            [(BF16, 512)]
        );
        let runs = SlotRuns::of(&[split, small]);
        assert_eq!(runs.runs, [0..1, 1..2]);
        assert_eq!(runs.offsets, [vec![0, 256], vec![0]]);
    }
}
