//! Where each component's weights live and how they move, derived once from the options, and
//! the one place that builds a component accordingly (resident, parked in host memory and
//! moved in for its stage, or streamed block by block).

use super::holding::{GroupPlan, Holding, Outer};
use super::spec::{PipelineSpec, Role};
use crate::memory::MemoryOptions;
/// What a model declares to be placed (the block protocol, beside the models).
pub use crate::models::blocks::Blockwise;
use crate::models::blocks::{BlockForward, OuterUse, PlacedBlocks};
use crate::offload::{
    build_resident, record, HostMemory, Offloaded, Packing, Residency, StreamOptions, Usage,
};
use crate::parallel::collective::Collective;
use crate::parallel::fsdp::{FlatShard, Home, ShardedBlocks};
use crate::weights::WeightSet;
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::sync::Arc;

/// Where every component of a pipeline lives, plus how host memory is held.
#[derive(Clone, Debug)]
pub struct Placement {
    /// One residency per component, in [`PipelineSpec::components`] order.
    pub residencies: Vec<Residency>,
    /// How offloaded weights are held on the host.
    pub memory: HostMemory,
    /// Each component's name and role, for reports.
    named: Vec<(&'static str, Role)>,
}

impl Placement {
    /// Derives each component's residency from the memory options by its role (after the
    /// memory-model rules): `--sequential-cpu-offload` streams every blockwise component
    /// synchronously, one step at a time, and parks the rest; `--model-cpu-offload` parks
    /// every component whole; otherwise each follows its role's flag (for DiTs,
    /// `--dit-layerwise-offload` over `--dit-cpu-offload`). Streaming step by step applies
    /// where a model's blocks have steps. Unless `--prefetch-depth` says otherwise, a copy
    /// stream runs one slot fill ahead (smaller blocks share a slot), or step by step as many
    /// steps ahead as make the smallest block.
    pub fn new(o: &MemoryOptions, spec: &PipelineSpec) -> Self {
        let residencies = spec
            .components
            .iter()
            .map(|c| {
                let residency = role_residency(o, c.role).for_steps(c.constructors.steps());
                match o.prefetch_depth {
                    Some(_) => residency,
                    // Recorded only where it applies: it records every block and step.
                    None => residency.with_steps_ahead(|| c.constructors.steps_ahead_in_a_block()),
                }
            })
            .collect();
        let memory = match (o.max_pinned_memory, o.pin_cpu_memory) {
            (Some(bytes), _) => HostMemory::Bounded {
                max_pinned: bytes as usize,
            },
            (None, true) => HostMemory::Pinned,
            (None, false) => HostMemory::Pageable,
        };
        Placement {
            residencies,
            memory,
            named: spec.components.iter().map(|c| (c.name, c.role)).collect(),
        }
    }

    /// How `component`'s offloaded weights are held on the host: as the options say, but an
    /// encoder (run once per job) that would be pinned streams from the memory map through a
    /// staging ring instead ([`HostMemory::Staged`]).
    pub fn memory_for(&self, component: usize) -> HostMemory {
        match (self.memory, self.named[component].1) {
            (HostMemory::Pinned, Role::TextEncoder | Role::ImageEncoder) => HostMemory::Staged,
            (memory, _) => memory,
        }
    }

    /// Whether any component keeps its weights in host memory.
    pub fn uses_host_memory(&self) -> bool {
        self.residencies.iter().any(|r| r.uses_host_memory())
    }

    /// Each component's name with its residency.
    pub fn components(&self) -> impl Iterator<Item = (&'static str, Residency)> + '_ {
        self.named
            .iter()
            .zip(&self.residencies)
            .map(|(&(name, _), &r)| (name, r))
    }

    /// The `placement` object of the dry-run JSON: each role present (its first component),
    /// `components` by name, and `host_memory`.
    pub fn json(&self) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        for role in Role::ALL {
            if let Some(i) = self.named.iter().position(|&(_, r)| r == role) {
                out.insert(role.key().into(), serde_json::json!(self.residencies[i]));
            }
        }
        out.insert(
            "components".into(),
            self.components()
                .map(|(name, r)| (name.to_string(), serde_json::json!(r)))
                .collect::<serde_json::Map<_, _>>()
                .into(),
        );
        out.insert("host_memory".into(), serde_json::json!(self.memory));
        out.into()
    }
}

/// The residency the flags give a component of `role`.
fn role_residency(o: &MemoryOptions, role: Role) -> Residency {
    let streamed = |stream, depth, per_group, by_step| Residency::Streamed {
        blocks_per_group: per_group,
        by_step,
        options: StreamOptions {
            stream,
            depth,
            kept_bytes: 0,
            exact_fills: by_step,
        },
    };
    let parked_if = |offload: bool| {
        if offload {
            Residency::Parked
        } else {
            Residency::Resident
        }
    };
    if o.sequential_cpu_offload {
        return match role {
            Role::TextEncoder | Role::Dit => streamed(false, 1, 1, true),
            _ => Residency::Parked,
        };
    }
    if o.model_cpu_offload {
        return Residency::Parked;
    }
    let layerwise = streamed(
        o.offload_stream,
        o.block_depth(),
        o.num_blocks_per_group,
        o.leaf_level,
    );
    match role {
        Role::TextEncoder => match (o.text_encoder_cpu_offload, o.text_encoder_on_cpu) {
            (false, _) => Residency::Resident,
            (true, true) => Residency::OnCpu,
            (true, false) => layerwise,
        },
        Role::Dit if o.dit_layerwise_offload => layerwise.keeping(o.dit_resident_memory),
        Role::Dit => parked_if(o.dit_cpu_offload),
        Role::ImageEncoder => parked_if(o.image_encoder_cpu_offload),
        Role::Vae | Role::AudioVae => parked_if(o.vae_cpu_offload),
    }
}

/// A component as placed.
pub enum Placed<M: Blockwise> {
    Resident(M),
    Parked(Offloaded<M>),
    Streamed {
        outer: OuterPart<M>,
        blocks: Offloaded<Vec<M::Block>>,
    },
    /// FSDP (`--use-fsdp-inference` on several GPUs): the outer part on the device, every block
    /// as this rank's flat shard, gathered before it runs.
    Sharded(Sharded<M>),
}

/// The outer (non-block) part of a streamed component, held as its [`Outer`] says.
pub enum OuterPart<M> {
    Resident(M),
    Parked(Box<Offloaded<M>>),
    PerUse(Box<Offloaded<M>>),
}

/// What `build` makes, held in host memory as one group and moved in whole when fetched.
fn parked<B>(
    weights: &WeightSet,
    dtype: DType,
    device: &Device,
    memory: HostMemory,
    build: impl Fn(VarBuilder<'static>) -> candle_core::Result<B> + Send + Sync + 'static,
) -> Result<Offloaded<B>> {
    let options = StreamOptions {
        stream: false,
        depth: 1,
        kept_bytes: 0,
        exact_fills: false,
    };
    Offloaded::from_weights(
        weights,
        1,
        Packing::PerTensor,
        move |_, vb| build(vb),
        dtype,
        device,
        memory,
        options,
    )
}

/// A component whose blocks are FSDP flat shards.
pub struct Sharded<M: Blockwise> {
    outer: M,
    shards: Vec<FlatShard>,
    group: Arc<dyn Collective>,
    cfg: M::Config,
    dtype: DType,
    device: Device,
    /// Blocks gathered ahead of the one computing.
    depth: usize,
}

impl<M: Blockwise> Placed<M> {
    /// Builds the component from `weights` as `holding` says (`OnCpu` builds it in f32 on the
    /// CPU; FSDP shards are this rank's of `group`, each block read whole from `weights`, its
    /// piece kept).
    pub fn load(
        cfg: &M::Config,
        weights: &WeightSet,
        holding: Holding,
        memory: HostMemory,
        dtype: DType,
        device: &Device,
        group: Option<&Arc<dyn Collective>>,
    ) -> Result<Self> {
        let resident_outer = || {
            build_resident(weights, dtype, device, |vb, host_vb| {
                M::outer(cfg, vb, host_vb)
            })
        };
        Ok(match holding {
            Holding::Resident => {
                Placed::Resident(build_resident(weights, dtype, device, |vb, _| {
                    M::whole(cfg, vb)
                })?)
            }
            Holding::OnCpu => Placed::Resident(M::whole(
                cfg,
                weights.var_builder(DType::F32, &Device::Cpu),
            )?),
            Holding::Parked => {
                let cfg = cfg.clone();
                Placed::Parked(parked(weights, dtype, device, memory, move |vb| {
                    M::whole(&cfg, vb)
                })?)
            }
            Holding::Streamed {
                outer,
                groups,
                options,
            } => {
                let outer = match outer {
                    Outer::Resident => OuterPart::Resident(resident_outer()?),
                    Outer::Parked | Outer::PerUse => {
                        let cfg = cfg.clone();
                        // The outer part asks nothing of host memory: an empty `VarBuilder` there.
                        let nothing = VarBuilder::zeros(dtype, &Device::Cpu);
                        let part = Box::new(parked(weights, dtype, device, memory, move |vb| {
                            M::outer(&cfg, vb, nothing.clone())
                        })?);
                        match outer {
                            Outer::PerUse => OuterPart::PerUse(part),
                            _ => OuterPart::Parked(part),
                        }
                    }
                };
                let groups = GroupPlan::<M>::new(cfg, groups);
                let blocks = Offloaded::from_weights(
                    weights,
                    groups.count,
                    Packing::ByDtype,
                    move |g, vb| groups.build(g, vb),
                    dtype,
                    device,
                    memory,
                    options,
                )?;
                Placed::Streamed { outer, blocks }
            }
            Holding::Sharded { fsdp, groups } => {
                let group = group.context("FSDP shards without their group")?.clone();
                let outer = resident_outer()?;
                let groups = GroupPlan::<M>::new(cfg, groups);
                let home = if fsdp.on_host {
                    Home::Host(device.clone())
                } else {
                    Home::Device(device.clone())
                };
                let shards = (0..groups.count)
                    .map(|g| {
                        // The tensors the block asks for, in the dtypes it asks for them.
                        let layout = record(Some(weights), dtype, Packing::PerTensor, |vb| {
                            groups.build(g, vb)
                        })?;
                        let tensors = layout
                            .slots
                            .iter()
                            .map(|s| {
                                let vb = weights.var_builder(s.dtype, &Device::Cpu);
                                Ok((s.name.clone(), vb.get(s.shape.clone(), &s.name)?))
                            })
                            .collect::<Result<Vec<_>>>()?;
                        Ok(FlatShard::new(&tensors, fsdp.rank, fsdp.ranks, &home)?)
                    })
                    .collect::<Result<_>>()?;
                Placed::Sharded(Sharded {
                    outer,
                    shards,
                    group,
                    cfg: cfg.clone(),
                    dtype,
                    device: device.clone(),
                    depth: fsdp.depth,
                })
            }
        })
    }

    /// The component for one stage: borrowed when it stays put, moved in when parked (and
    /// moved out when the returned value drops).
    pub fn hold(&self) -> Result<Held<'_, M>> {
        Ok(match self {
            Placed::Resident(m) => Held::Borrowed(m),
            Placed::Streamed { outer, blocks } => Held::Streamed {
                outer: match outer {
                    OuterPart::Resident(m) => HeldOuter::Borrowed(m),
                    OuterPart::Parked(parked) => HeldOuter::Moved(parked.fetch(0)?),
                    OuterPart::PerUse(parked) => HeldOuter::PerUse(parked),
                },
                blocks,
            },
            Placed::Parked(offloaded) => Held::Moved(offloaded.fetch(0)?),
            Placed::Sharded(sharded) => Held::Sharded(sharded),
        })
    }

    /// What the offload engine holds and has moved for this component (`None` if resident).
    pub fn offload_usage(&self) -> Option<Usage> {
        match self {
            Placed::Resident(_) | Placed::Sharded(_) => None,
            Placed::Parked(o) => Some(o.usage()),
            Placed::Streamed { outer, blocks } => {
                let mut usage = blocks.usage();
                if let OuterPart::Parked(parked) | OuterPart::PerUse(parked) = outer {
                    let outer = parked.usage();
                    usage.pinned_bytes += outer.pinned_bytes;
                    usage.host_bytes += outer.host_bytes;
                }
                Some(usage)
            }
        }
    }
}

/// A component held for a stage.
pub enum Held<'a, M: Blockwise> {
    /// Resident.
    Borrowed(&'a M),
    /// Moved in from host memory for this stage (its device memory is freed on drop).
    Moved(M),
    /// Blocks streamed through the device; their slots are given back on drop.
    Streamed {
        outer: HeldOuter<'a, M>,
        blocks: &'a Offloaded<Vec<M::Block>>,
    },
    /// FSDP flat shards, each block gathered for its turn.
    Sharded(&'a Sharded<M>),
}

/// A streamed component's outer part for a stage.
pub enum HeldOuter<'a, M> {
    Borrowed(&'a M),
    /// Moved in for this stage.
    Moved(M),
    /// Moved in for each use ([`Held::model`]).
    PerUse(&'a Offloaded<M>),
}

impl<M: Blockwise> Drop for Held<'_, M> {
    /// The stage is over: a streamed component's slots go back (errors are the copy stream's,
    /// which the stage's own work has already met).
    fn drop(&mut self) {
        if let Held::Streamed { blocks, .. } = self {
            blocks.release().ok();
        }
    }
}

impl<M: Blockwise> Held<'_, M> {
    /// The model (its outer part when streamed) for one use: an outer part held per use is
    /// moved in now and out again when the returned value drops.
    pub fn model(&self) -> candle_core::Result<OuterUse<'_, M>> {
        if let Held::Streamed {
            outer: HeldOuter::PerUse(parked),
            ..
        } = self
        {
            let moved = parked.fetch(0);
            return Ok(OuterUse::Moved(
                moved.map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?,
            ));
        }
        self.stays()
            .map(OuterUse::Borrowed)
            .ok_or_else(|| candle_core::Error::Msg("a held component without its model".into()))
    }

    /// The model (its outer part when streamed) where it stays on the device for the stage.
    fn stays(&self) -> Option<&M> {
        match self {
            Held::Borrowed(m) => Some(m),
            Held::Moved(m) => Some(m),
            Held::Streamed {
                outer: HeldOuter::Borrowed(m),
                ..
            } => Some(m),
            Held::Streamed {
                outer: HeldOuter::Moved(m),
                ..
            } => Some(m),
            Held::Streamed {
                outer: HeldOuter::PerUse(_),
                ..
            } => None,
            Held::Sharded(s) => Some(&s.outer),
        }
    }

    /// Threads `state` through every block in order, streamed, gathered or resident
    /// (`resident` lists them): each block maps the state to the next. Errors come back as the
    /// models' own error type, messages kept.
    pub fn fold_blocks<'b, T>(
        &'b self,
        resident: impl FnOnce(&'b M) -> &'b [M::Block],
        init: T,
        mut f: impl FnMut(&M::Block, &T) -> candle_core::Result<T>,
    ) -> candle_core::Result<T> {
        let mut state = init;
        self.for_each_block(resident, |block| {
            state = f(block, &state)?;
            Ok(())
        })
        .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        Ok(state)
    }

    /// One forward of `M` from its prepared `inputs` (see [`PlacedBlocks::forward`]).
    pub fn forward(&self, inputs: M::Inputs) -> candle_core::Result<M::Output>
    where
        M: BlockForward,
    {
        PlacedBlocks::forward(self, inputs)
    }

    /// [`Self::fold_blocks`] over several independent states at once (see
    /// [`PlacedBlocks::fold_blocks_each`]).
    pub fn fold_blocks_each<'b, T>(
        &'b self,
        resident: impl FnOnce(&'b M) -> &'b [M::Block],
        init: Vec<T>,
        f: impl FnMut(&M::Block, usize, &T) -> candle_core::Result<T>,
    ) -> candle_core::Result<Vec<T>> {
        PlacedBlocks::fold_blocks_each(self, resident, init, f)
    }

    /// Each of `inputs` (a prompt's texts) through every block on its own, each block run on
    /// every input in turn so that a streamed model's weights pass through once for all
    /// ([`Self::fold_blocks_each`]): `start` makes an input's first hidden state and what its
    /// blocks read (a mask), `block` runs a block, `finish` makes the input's result of its
    /// last hidden state. Each result is what running its input alone gives.
    pub fn each_through_blocks<'b, I, T, C, R>(
        &'b self,
        resident: impl FnOnce(&'b M) -> &'b [M::Block],
        inputs: impl IntoIterator<Item = I>,
        start: impl FnMut(I) -> Result<(T, C)>,
        mut block: impl FnMut(&M::Block, &T, &C) -> candle_core::Result<T>,
        mut finish: impl FnMut(T, C) -> Result<R>,
    ) -> Result<Vec<R>> {
        let started = inputs.into_iter().map(start).collect::<Result<Vec<_>>>()?;
        let (hidden, reads): (Vec<T>, Vec<C>) = started.into_iter().unzip();
        let hidden = self.fold_blocks_each(resident, hidden, |b, i, h| block(b, h, &reads[i]))?;
        hidden
            .into_iter()
            .zip(reads)
            .map(|(h, read)| finish(h, read))
            .collect()
    }

    /// Runs `f` on every block in order, streamed or resident (`resident` lists them).
    fn for_each_block<'b>(
        &'b self,
        resident: impl FnOnce(&'b M) -> &'b [M::Block],
        mut f: impl FnMut(&M::Block) -> Result<()>,
    ) -> Result<()> {
        match self {
            Held::Streamed { blocks, .. } => blocks.for_each(|group| {
                for block in group {
                    f(block)?;
                }
                Ok(())
            }),
            Held::Sharded(s) => {
                let blocks = ShardedBlocks::new(&s.shards, s.group.as_ref(), &s.device, s.depth);
                Ok(blocks.for_each(|i, tensors| {
                    let map = tensors.iter().cloned().collect();
                    let vb = VarBuilder::from_tensors(map, s.dtype, &s.device);
                    let block = M::block(&s.cfg, i, vb)?;
                    f(&block).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
                })?)
            }
            _ => {
                let model = self
                    .stays()
                    .context("resident blocks without their model")?;
                for block in resident(model) {
                    f(block)?;
                }
                Ok(())
            }
        }
    }
}

/// Model-side code runs a held component's blocks through this (models know nothing of
/// placement).
impl<M: Blockwise> PlacedBlocks<M> for Held<'_, M> {
    fn model(&self) -> candle_core::Result<OuterUse<'_, M>> {
        Held::model(self)
    }

    fn fold_blocks<'b, T>(
        &'b self,
        resident: impl FnOnce(&'b M) -> &'b [M::Block],
        init: T,
        f: impl FnMut(&M::Block, &T) -> candle_core::Result<T>,
    ) -> candle_core::Result<T> {
        Held::fold_blocks(self, resident, init, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::source::{component_weights, ModelSource};
    use crate::models::wan::text_encoder::UMT5EncoderModel;
    use crate::models::wan::transformer::WanTransformer3DModel;
    use crate::offload::{ComponentLayout, GroupLayout};
    use crate::parallel::collective::ThreadGroup;
    use crate::pipeline::holding::Fsdp;
    use crate::pipeline::wan_t2v::WanConfigs;
    use std::time::Duration;

    /// Builds `M` from `folder` of the tiny Wan fixture as `residency` (or `fsdp`, over `group`)
    /// makes it held, and checks that what the loader built is what the plan records: the same
    /// kind, the same groups byte for byte, the same outer part, and (streamed) the device bytes
    /// the plan counts. Sharded, each block's bytes this rank keeps.
    fn built_as_planned<M: Blockwise>(
        cfg: &M::Config,
        folder: &str,
        residency: Residency,
        fsdp: Option<(Fsdp, &Arc<dyn Collective>)>,
    ) -> (Holding, ComponentLayout, Vec<usize>) {
        let source = ModelSource::parse(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/wan-tiny-a"
        ))
        .unwrap();
        let weights = WeightSet::open(&component_weights(&source, folder).unwrap()).unwrap();
        let dtype = DType::BF16;
        let holding = Holding::of::<M>(cfg, residency, fsdp.map(|f| f.0), dtype).unwrap();
        let planned = holding.layout::<M>(cfg, dtype, None).unwrap();
        let (memory, device) = (HostMemory::Pageable, &Device::Cpu);
        let group = fsdp.map(|f| f.1);
        let placed = Placed::<M>::load(cfg, &weights, holding, memory, dtype, device, group);
        let placed = placed.unwrap();
        let bytes = |groups: &[GroupLayout]| -> Vec<(usize, usize)> {
            groups.iter().map(|g| (g.bytes, g.tensor_bytes())).collect()
        };
        let what = format!("{folder} {holding:?}");
        let mut kept = Vec::new();
        match (holding, &placed) {
            (Holding::Resident | Holding::OnCpu, Placed::Resident(_)) => {
                assert!(planned.groups.is_empty(), "{what}")
            }
            (Holding::Parked, Placed::Parked(whole)) => {
                assert_eq!(bytes(&whole.layouts()), bytes(&planned.groups), "{what}")
            }
            (
                Holding::Streamed { outer, .. },
                Placed::Streamed {
                    outer: part,
                    blocks,
                },
            ) => {
                assert_eq!(bytes(&blocks.layouts()), bytes(&planned.groups), "{what}");
                let built = match part {
                    OuterPart::Resident(_) => Outer::Resident,
                    OuterPart::Parked(_) => Outer::Parked,
                    OuterPart::PerUse(_) => Outer::PerUse,
                };
                assert_eq!(built, outer, "{what}");
                let usage = placed.offload_usage().unwrap();
                let (active, direct) = (
                    holding.device_weights(&planned).active,
                    planned.direct_bytes as u64,
                );
                let streamed = usage.device_bytes as u64;
                match outer {
                    // The outer part only beside what the groups hold between passes.
                    Outer::PerUse => assert!(
                        (streamed..direct + streamed).contains(&active),
                        "{what}: {active}"
                    ),
                    _ => assert_eq!(active, direct + streamed, "{what}"),
                }
            }
            (Holding::Sharded { .. }, Placed::Sharded(sharded)) => {
                assert_eq!(sharded.shards.len(), planned.groups.len(), "{what}");
                kept = (sharded.shards.iter())
                    .map(|s| s.held().iter().map(|(d, n)| d.size_in_bytes() * n).sum())
                    .collect();
            }
            _ => panic!("{what}: built otherwise"),
        }
        (holding, planned, kept)
    }

    /// Under every residency (streamed in block groups of 1, 2 and all, and step by step; with a
    /// copy stream and without) and as FSDP shards, the tiny Wan DiT (whose outer part is
    /// parked) and text encoder (whose outer part stays, it keeps a token table in host memory)
    /// are built as the plan records them; the ranks' shards hold every block's bytes once.
    #[test]
    fn the_loader_builds_what_the_plan_records() {
        let source = ModelSource::parse(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/wan-tiny-a"
        ))
        .unwrap();
        let configs = WanConfigs::read(&source).unwrap();
        let (dit, te) = (&configs.transformer, &configs.text_encoder);
        let mut residencies = vec![Residency::Resident, Residency::OnCpu, Residency::Parked];
        for (blocks_per_group, by_step) in [(1, false), (2, false), (dit.num_layers, false)]
            .into_iter()
            .chain([(1, true)])
        {
            for (stream, depth) in [(true, 1), (true, 3), (false, 1)] {
                residencies.push(Residency::Streamed {
                    blocks_per_group,
                    by_step,
                    options: StreamOptions {
                        stream,
                        depth,
                        kept_bytes: 0,
                        exact_fills: by_step,
                    },
                });
            }
        }
        let mut outers = Vec::new();
        for residency in residencies {
            for holding in [
                built_as_planned::<WanTransformer3DModel>(dit, "transformer", residency, None).0,
                built_as_planned::<UMT5EncoderModel>(te, "text_encoder", residency, None).0,
            ] {
                if let Holding::Streamed { outer, .. } = holding {
                    outers.push(outer);
                }
            }
        }
        assert!(outers.contains(&Outer::Resident) && outers.contains(&Outer::Parked));

        let groups: Vec<Arc<dyn Collective>> = ThreadGroup::new(2, Duration::from_secs(10))
            .into_iter()
            .map(|g| Arc::new(g) as Arc<dyn Collective>)
            .collect();
        for on_host in [false, true] {
            let mut kept = Vec::new();
            let mut planned = None;
            for (rank, group) in groups.iter().enumerate() {
                let fsdp = Fsdp {
                    rank,
                    ranks: 2,
                    on_host,
                    depth: 1,
                };
                let (_, layout, mine) = built_as_planned::<WanTransformer3DModel>(
                    dit,
                    "transformer",
                    Residency::Resident,
                    Some((fsdp, group)),
                );
                kept.resize(mine.len(), 0);
                kept.iter_mut().zip(mine).for_each(|(k, m)| *k += m);
                planned = Some(layout);
            }
            let blocks: Vec<usize> = (planned.unwrap().groups.iter())
                .map(|g| g.tensor_bytes())
                .collect();
            assert_eq!(kept, blocks, "on host: {on_host}");
        }
    }
}
