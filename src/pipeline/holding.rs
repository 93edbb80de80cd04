//! How one component is held: what its residency, or its FSDP membership, means for its model,
//! decided once per component. The memory plan records ([`Holding::layout`]) and counts
//! ([`Holding::device_weights`]) what the loader builds ([`super::placement::Placed::load`]) from
//! the same value, so the offload contract is stated here alone.

use super::placement::Blockwise;
use super::spec::Role;
use crate::memory::MemoryOptions;
use crate::offload::residency::{between_passes_bytes, landed_bytes, streamed_bytes};
use crate::offload::{
    ComponentLayout, DeviceWeights, GroupLayout, HostMemory, Packing, Recording, Residency,
    StreamOptions,
};
use crate::parallel::fsdp::shard_bytes;
use crate::weights::WeightSet;
use anyhow::Result;
use candle_core::DType;

/// How one component is held.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Holding {
    /// On the device for as long as the component is loaded.
    Resident,
    /// Built in f32 on the CPU, computing there.
    OnCpu,
    /// In host memory, moved in whole for each stage.
    Parked,
    /// The blocks stream through the device in `groups`; the outer part is held as `outer`
    /// says.
    Streamed {
        outer: Outer,
        groups: Grouping,
        options: StreamOptions,
    },
    /// The outer part on the device, every group of blocks (one block each) as this rank's FSDP
    /// flat shard.
    Sharded { fsdp: Fsdp, groups: Grouping },
}

/// How a model's blocks form groups: runs of up to `blocks_per_group` blocks of one kind, or
/// (`by_step`, where blocks have steps) one block step per group ([`GroupPlan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grouping {
    pub blocks_per_group: usize,
    pub by_step: bool,
}

/// Where a streamed component's outer part waits between its stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outer {
    /// On the device: it keeps tensors in host memory (a token table) that its device part
    /// works with.
    Resident,
    /// In host memory, moved in for each stage: between stages the component holds nothing on
    /// the device.
    Parked,
    /// In host memory, moved in around each use of it (the embedders before the blocks, the
    /// output head after them): while the blocks run it holds nothing on the device. Where
    /// blocks stream step by step (leaf level, sequential offload), memory is what counts.
    PerUse,
}

/// A DiT's FSDP membership (`--use-fsdp-inference`): rank `rank` of the `ranks` of its
/// sequence-parallel group keeps 1/`ranks` of every block (in host memory when `on_host`) and
/// gathers `depth` blocks ahead of the one computing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fsdp {
    pub rank: usize,
    pub ranks: usize,
    pub on_host: bool,
    pub depth: usize,
}

impl Fsdp {
    /// The membership of a component of `role` on rank `rank` of a group of `ranks` under `o`:
    /// the DiTs are sharded with `--use-fsdp-inference` over groups of several GPUs.
    pub fn of(o: &MemoryOptions, role: Role, rank: usize, ranks: usize) -> Option<Fsdp> {
        (role == Role::Dit && o.use_fsdp_inference && ranks > 1).then_some(Fsdp {
            rank,
            ranks,
            on_host: o.dit_cpu_offload,
            depth: o.block_depth(),
        })
    }

    /// Whole blocks on the device at once while computing: the one computing and those gathered
    /// ahead.
    pub fn gathered(self) -> usize {
        self.depth + 1
    }
}

impl Holding {
    /// How model `M` with `cfg` in `dtype` is held under `residency`, or as FSDP shards when
    /// `fsdp` says so: streaming step by step falls back to whole blocks where a block has no
    /// steps, and a streamed outer part stays resident only where it keeps host tensors.
    pub fn of<M: Blockwise>(
        cfg: &M::Config,
        residency: Residency,
        fsdp: Option<Fsdp>,
        dtype: DType,
    ) -> Result<Self> {
        if let Some(fsdp) = fsdp {
            let groups = Grouping {
                blocks_per_group: 1,
                by_step: false,
            };
            return Ok(Holding::Sharded { fsdp, groups });
        }
        Ok(match residency.for_steps(M::steps(cfg)) {
            Residency::Resident => Holding::Resident,
            Residency::OnCpu => Holding::OnCpu,
            Residency::Parked => Holding::Parked,
            Residency::Streamed {
                blocks_per_group,
                by_step,
                options,
            } => Holding::Streamed {
                outer: match outer_keeps_host_tensors::<M>(cfg, dtype)? {
                    true => Outer::Resident,
                    false if by_step => Outer::PerUse,
                    false => Outer::Parked,
                },
                groups: Grouping {
                    blocks_per_group,
                    by_step,
                },
                options,
            },
        })
    }

    /// The tensors `M`'s constructors ask for, laid out as this holding holds them (see
    /// [`ComponentLayout`]): checked against `weights` when given, and held packed where those
    /// are, but as FSDP shards (which hold the weights as the model computes with them).
    pub fn layout<M: Blockwise>(
        self,
        cfg: &M::Config,
        dtype: DType,
        weights: Option<&WeightSet>,
    ) -> Result<ComponentLayout> {
        let weights = weights.filter(|_| !matches!(self, Holding::Sharded { .. }));
        let record = |packing, build: &dyn Fn(candle_nn::VarBuilder<'static>) -> _| {
            crate::offload::record(weights, dtype, packing, build)
        };
        let whole = || -> Result<GroupLayout> {
            record(Packing::PerTensor, &|vb| M::whole(cfg, vb).map(drop))
        };
        let groups = match self {
            Holding::Resident => {
                return Ok(ComponentLayout {
                    direct_bytes: whole()?.device_bytes(),
                    ..Default::default()
                })
            }
            Holding::OnCpu => {
                let f32_whole =
                    crate::offload::record(weights, DType::F32, Packing::PerTensor, |vb| {
                        M::whole(cfg, vb).map(drop)
                    })?;
                return Ok(ComponentLayout {
                    host_bytes: f32_whole.device_bytes(),
                    ..Default::default()
                });
            }
            Holding::Parked => {
                return Ok(ComponentLayout {
                    groups: vec![whole()?],
                    ..Default::default()
                })
            }
            Holding::Streamed { groups, .. } | Holding::Sharded { groups, .. } => {
                GroupPlan::<M>::new(cfg, groups)
            }
        };
        // What stays in host memory (a token table) is recorded apart.
        let (device, host) = record_outer::<M>(cfg, weights, dtype)?;
        Ok(ComponentLayout {
            direct_bytes: device.layout(Packing::PerTensor)?.device_bytes(),
            host_bytes: host.layout(Packing::PerTensor)?.device_bytes(),
            groups: (0..groups.count)
                .map(|g| record(Packing::ByDtype, &|vb| groups.build(g, vb).map(drop)))
                .collect::<Result<_>>()?,
        })
    }

    /// Device weight bytes of `layout` (this holding's) while its stage runs and while it waits
    /// loaded: resident weights stay; a parked component comes in whole for its stage; streamed
    /// groups pass through the engine's slots ([`streamed_bytes`]) beside the outer part, which
    /// stays between stages unless parked, or, moved in per use, only beside what the groups
    /// hold between passes ([`between_passes_bytes`]); FSDP keeps the outer part and this rank's
    /// shards (in host memory when `on_host`) and gathers [`Fsdp::gathered`] whole blocks at once.
    pub fn device_weights(self, layout: &ComponentLayout) -> DeviceWeights {
        let direct = layout.direct_bytes as u64;
        let largest = layout.groups.iter().map(|g| g.bytes as u64).max();
        match self {
            Holding::Resident => DeviceWeights {
                active: direct,
                idle: direct,
                apart: None,
            },
            Holding::OnCpu => DeviceWeights::default(),
            Holding::Parked => DeviceWeights {
                active: layout.groups.iter().map(landed_bytes).max().unwrap_or(0),
                idle: 0,
                apart: None,
            },
            Holding::Streamed {
                outer: Outer::PerUse,
                options,
                ..
            } => DeviceWeights {
                active: streamed_bytes(&layout.groups, options),
                idle: 0,
                apart: Some(direct.saturating_add(between_passes_bytes(&layout.groups, options))),
            },
            Holding::Streamed { outer, options, .. } => DeviceWeights {
                active: direct.saturating_add(streamed_bytes(&layout.groups, options)),
                idle: match outer {
                    Outer::Resident => direct,
                    Outer::Parked | Outer::PerUse => 0,
                },
                apart: None,
            },
            Holding::Sharded { fsdp, .. } => {
                let blocks: Vec<usize> = layout.groups.iter().map(|g| g.bytes).collect();
                let shards = if fsdp.on_host {
                    0
                } else {
                    shard_bytes(&blocks, fsdp.rank, fsdp.ranks) as u64
                };
                let gathered = fsdp.gathered().min(blocks.len()) as u64 * largest.unwrap_or(0);
                DeviceWeights {
                    active: direct + shards + gathered,
                    idle: direct + shards,
                    apart: None,
                }
            }
        }
    }

    /// Host bytes of `layout` (this holding's) for as long as the component is loaded on a
    /// discrete device, its weights held as `memory` says: what it keeps in host memory apart
    /// (a token table, the whole component on the CPU), and its host image (a parked
    /// component whole; a streamed one's groups, and its outer part when parked; this rank's
    /// FSDP shards when `on_host`). The image is held in arenas, or in the memory map's pages
    /// locked in place, except where the weights stay in the memory map unlocked (a bounded
    /// or staged ring) and `mapped` (read from files, where the kernel can drop and reread the
    /// pages; generated weights fill arenas): then only the ring of two groups (at most the
    /// bound) is held. A bound the whole image fits in pins it all.
    pub fn host_bytes(self, layout: &ComponentLayout, memory: HostMemory, mapped: bool) -> u64 {
        let direct = layout.direct_bytes as u64;
        let sizes: Vec<usize> = layout.groups.iter().map(|g| g.bytes).collect();
        let groups = sizes
            .iter()
            .fold(0u64, |sum, &b| sum.saturating_add(b as u64));
        let image = match self {
            Holding::Resident | Holding::OnCpu => 0,
            Holding::Parked
            | Holding::Streamed {
                outer: Outer::Resident,
                ..
            } => groups,
            Holding::Streamed {
                outer: Outer::Parked | Outer::PerUse,
                ..
            } => groups.saturating_add(direct),
            Holding::Sharded { fsdp, .. } if fsdp.on_host => {
                shard_bytes(&sizes, fsdp.rank, fsdp.ranks) as u64
            }
            Holding::Sharded { .. } => 0,
        };
        let ring = 2 * sizes.iter().copied().max().unwrap_or(0) as u64;
        // As the engine holds it: a staged part is bounded by a ring of two groups.
        let bound = match memory {
            HostMemory::Staged => Some(ring),
            HostMemory::Bounded { max_pinned } => Some(max_pinned as u64),
            HostMemory::Pinned | HostMemory::Pageable => None,
        };
        let held = match bound {
            Some(bound) if bound < image => {
                let ring = ring.min(bound);
                if mapped {
                    ring
                } else {
                    image.saturating_add(ring)
                }
            }
            _ => image,
        };
        (layout.host_bytes as u64).saturating_add(held)
    }
}

/// What `M`'s outer part asks for in `dtype` (checked against `weights` when given): on the
/// device, and in host memory (a text encoder's token table).
fn record_outer<M: Blockwise>(
    cfg: &M::Config,
    weights: Option<&WeightSet>,
    dtype: DType,
) -> Result<(Recording, Recording)> {
    let (device, host) = (Recording::default(), Recording::default());
    drop(M::outer(
        cfg,
        device.var_builder(weights, dtype),
        host.var_builder(weights, dtype),
    )?);
    Ok((device, host))
}

/// Whether `M`'s outer part keeps tensors in host memory (a text encoder's token table).
fn outer_keeps_host_tensors<M: Blockwise>(cfg: &M::Config, dtype: DType) -> Result<bool> {
    let (_, host) = record_outer::<M>(cfg, None, dtype)?;
    Ok(host.layout(Packing::PerTensor)?.tensor_bytes() > 0)
}

/// A model's groups of blocks as a [`Grouping`] forms them: the engine builds its groups (and
/// FSDP its shards) and the plan counts them through this one rule.
pub struct GroupPlan<M: Blockwise> {
    cfg: M::Config,
    groups: Vec<Group>,
    /// Groups in all.
    pub count: usize,
}

/// What one group holds.
enum Group {
    /// Whole blocks, in order.
    Blocks(std::ops::Range<usize>),
    /// One step of one block.
    Step { block: usize, step: usize },
}

impl<M: Blockwise> GroupPlan<M> {
    pub fn new(cfg: &M::Config, grouping: Grouping) -> Self {
        let Grouping {
            blocks_per_group,
            by_step,
        } = grouping;
        let blocks = M::num_blocks(cfg);
        let mut groups = Vec::new();
        if by_step && M::steps(cfg) > 1 {
            for block in 0..blocks {
                for step in 0..M::block_steps(cfg, block) {
                    groups.push(Group::Step { block, step });
                }
            }
        } else {
            let per_group = blocks_per_group.max(1);
            let mut start = 0;
            while start < blocks {
                let kind = M::block_kind(cfg, start);
                let mut end = start + 1;
                while end < blocks && end - start < per_group && M::block_kind(cfg, end) == kind {
                    end += 1;
                }
                groups.push(Group::Blocks(start..end));
                start = end;
            }
        }
        GroupPlan {
            cfg: cfg.clone(),
            count: groups.len(),
            groups,
        }
    }

    /// Group `g`'s blocks (or its one block step) from the root `VarBuilder`.
    pub fn build(
        &self,
        g: usize,
        vb: candle_nn::VarBuilder<'static>,
    ) -> candle_core::Result<Vec<M::Block>> {
        match self.groups.get(g) {
            Some(Group::Step { block, step }) => {
                Ok(vec![M::block_step(&self.cfg, *block, *step, vb)?])
            }
            Some(Group::Blocks(blocks)) => blocks
                .clone()
                .map(|i| M::block(&self.cfg, i, vb.clone()))
                .collect(),
            None => candle_core::bail!("group {g} of {}", self.count),
        }
    }
}

/// What the families' layout tests share.
#[cfg(test)]
pub(crate) mod testing {
    use crate::offload::{record, GroupLayout, Packing, Residency, StreamOptions};
    use candle_core::DType;
    use candle_nn::VarBuilder;

    /// The names a layout holds.
    pub fn names(layout: &GroupLayout) -> Vec<String> {
        layout.slots.iter().map(|s| s.name.clone()).collect()
    }

    /// The names of the weights `build` asks for, sorted.
    pub fn built_names<B>(
        build: impl FnOnce(VarBuilder<'static>) -> candle_core::Result<B>,
    ) -> anyhow::Result<Vec<String>> {
        let mut names = names(&record(None, DType::BF16, Packing::PerTensor, build)?);
        names.sort();
        Ok(names)
    }

    /// Streamed `blocks_per_group` blocks at a time (`by_step`: step by step), one copy ahead.
    pub fn streamed(blocks_per_group: usize, by_step: bool) -> Residency {
        Residency::Streamed {
            blocks_per_group,
            by_step,
            options: StreamOptions {
                stream: true,
                depth: 1,
                kept_bytes: 0,
                exact_fills: false,
            },
        }
    }

    /// No group of a leaf-level layout holds more than the single-stream MLP step of a
    /// transformer of width `dim` and MLP width `mlp` in bf16 (alignment padding aside).
    pub fn assert_within_mlp_step(groups: &[GroupLayout], dim: usize, mlp: usize) {
        let mlp_step = (dim * mlp + mlp + (dim + mlp) * dim + dim) * 2;
        let largest = groups.iter().map(|g| g.bytes).max().unwrap_or(0);
        assert!(largest <= mlp_step + 4 * 256, "{largest} > {mlp_step}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::offload::record;
    use crate::offload::residency::slot_sections;

    /// Four blocks of one 1000-float group each, `direct` bytes outside the blocks and `apart`
    /// kept in host memory; and one group's bytes.
    fn four_blocks(direct: usize, apart: usize) -> (ComponentLayout, u64) {
        let group = record(None, DType::F32, Packing::ByDtype, |vb| vb.get(1000, "w")).unwrap();
        let bytes = group.bytes as u64;
        let layout = ComponentLayout {
            direct_bytes: direct,
            groups: vec![group; 4],
            host_bytes: apart,
        };
        (layout, bytes)
    }

    /// Streamed a block at a time, one copy ahead, its outer part `outer`.
    fn streamed(outer: Outer) -> Holding {
        Holding::Streamed {
            outer,
            groups: Grouping {
                blocks_per_group: 1,
                by_step: false,
            },
            options: StreamOptions {
                stream: true,
                depth: 1,
                kept_bytes: 0,
                exact_fills: false,
            },
        }
    }

    /// Between its stages a streamed component holds its outer part only when that is not
    /// parked (its slots go back when a stage ends); during a stage, the outer part and slots.
    #[test]
    fn streamed_components_hold_nothing_between_stages_unless_their_outer_part_stays() {
        let (layout, _) = four_blocks(10, 0);
        let slot: usize = slot_sections(&layout.groups).iter().map(|s| s.1).sum();
        for outer in [Outer::Parked, Outer::Resident] {
            let weights = streamed(outer).device_weights(&layout);
            assert_eq!(weights.active, 10 + 2 * slot as u64);
            assert_eq!(weights.idle, if outer == Outer::Parked { 0 } else { 10 });
        }
    }

    /// A component holds its host image while loaded: whole when parked or pinned (the memory
    /// map's pages locked in place count as much as arenas), only the staging ring when its
    /// weights wait unlocked in a file's memory map, image and ring when they were generated;
    /// a bound the image fits in pins it all. What it keeps apart (a token table) always counts.
    #[test]
    fn host_bytes_follow_where_the_weights_wait() {
        let (direct, apart) = (10u64, 7u64);
        let (layout, g) = four_blocks(direct as usize, apart as usize);
        let bounded = |max_pinned| HostMemory::Bounded { max_pinned };
        let (resident, parked) = (streamed(Outer::Resident), streamed(Outer::Parked));
        let cases = [
            (Holding::Resident, HostMemory::Pinned, true, apart),
            (resident, HostMemory::Pinned, true, apart + 4 * g),
            (parked, HostMemory::Pageable, true, apart + 4 * g + direct),
            (resident, HostMemory::Staged, true, apart + 2 * g),
            (resident, HostMemory::Staged, false, apart + 6 * g),
            (resident, bounded(g as usize), true, apart + g),
            (resident, bounded(g as usize), false, apart + 5 * g),
            (resident, bounded(1 << 40), true, apart + 4 * g),
        ];
        for (holding, memory, mapped, want) in cases {
            assert_eq!(
                holding.host_bytes(&layout, memory, mapped),
                want,
                "{holding:?} {memory:?} mapped {mapped}"
            );
        }
        // One group: the staged ring of two would hold the whole, so it is pinned whole.
        let one = ComponentLayout {
            groups: layout.groups[..1].to_vec(),
            ..layout
        };
        let parked = Holding::Parked.host_bytes(&one, HostMemory::Staged, true);
        assert_eq!(parked, apart + g);
    }

    /// A streamed DiT whose weights are held packed is planned as the engine holds it: each
    /// packed tensor of its groups counts its bytes as held (a Q8_0 GGUF file's tensors their
    /// bytes in the file, a scaled fp8 file's its scale and one byte a value: about half of
    /// bf16; the tiny fixtures' images shrink less, their 256-byte alignment being a larger
    /// part), and its device weights add the expanded copy of the computing group.
    #[test]
    fn packed_weights_are_planned_as_held() -> Result<()> {
        use crate::models::source::ModelSource;
        use crate::models::wan::transformer::WanTransformer3DModel;
        use crate::weights::{Packed, Weights};
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        for (model, file) in [
            ("wan-q-tiny-a", "wan-q-tiny-a-Q8_0.gguf"),
            ("wan-tiny-a", "wan-tiny-a-comfyui-fp8-scaled.safetensors"),
        ] {
            let source = ModelSource::parse(fixtures.join(model).to_str().unwrap())?;
            let configs = crate::pipeline::wan_t2v::WanConfigs::read(&source)?;
            let dit = &configs.transformer;
            let file = fixtures.join("weights-a").join(file);
            let weights = WeightSet::open(&Weights::Files(vec![file]))?;
            let options = StreamOptions {
                stream: true,
                depth: 1,
                kept_bytes: 0,
                exact_fills: false,
            };
            let residency = Residency::Streamed {
                blocks_per_group: 1,
                by_step: false,
                options,
            };
            let holding = Holding::of::<WanTransformer3DModel>(dit, residency, None, DType::BF16)?;
            let plain = holding.layout::<WanTransformer3DModel>(dit, DType::BF16, None)?;
            let packed =
                holding.layout::<WanTransformer3DModel>(dit, DType::BF16, Some(&weights))?;
            let (mut held_packed, mut as_bf16) = (0, 0);
            for slot in packed.groups.iter().flat_map(|g| &g.slots) {
                if let Some(form) = slot.packed {
                    let stored = match form {
                        Packed::ScaledFp8 { scales } => Some(4 * scales + slot.shape.elem_count()),
                        _ => weights.mapped_packed(&slot.name, form).map(<[u8]>::len),
                    };
                    assert_eq!(Some(slot.bytes()), stored, "{}", slot.name);
                    held_packed += slot.bytes();
                    as_bf16 += slot.device_bytes();
                }
            }
            let ratio = held_packed as f64 / as_bf16 as f64;
            assert!((0.5..0.6).contains(&ratio), "{model}: {ratio}");
            let image =
                |l: &ComponentLayout| l.groups.iter().map(|g| g.bytes).sum::<usize>() as f64;
            assert!(image(&packed) < 0.7 * image(&plain), "{model}");
            let held = |l| holding.host_bytes(l, HostMemory::Pinned, true);
            assert_eq!(
                held(&plain) - held(&packed),
                (image(&plain) - image(&packed)) as u64
            );
            let expanded = packed.groups.iter().map(|g| g.expanded_bytes()).max();
            let slot: usize = slot_sections(&packed.groups).iter().map(|s| s.1).sum();
            let runs = crate::offload::residency::SlotRuns::of(&packed.groups)
                .runs
                .len();
            let slots = crate::offload::residency::slot_count(runs, options);
            assert_eq!(
                holding.device_weights(&packed).active,
                (packed.direct_bytes + slots * slot + expanded.unwrap()) as u64
            );
        }
        Ok(())
    }
}
