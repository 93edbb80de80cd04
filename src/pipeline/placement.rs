//! Where each component's weights live and how they move, derived once from the options, and
//! the one place that builds a component accordingly (resident, parked in host memory and
//! moved in for its stage, or streamed block by block).

use crate::cli::args::{ComputeDevice, GenerateOptions, OffloadType};
use crate::models::loader::WeightSet;
use crate::offload::{HostMemory, Offloaded, Packing, StreamOptions, Usage};
use anyhow::Result;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
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

/// The residency of every role a pipeline's component can play, plus how host memory is held.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Placement {
    pub text_encoder: Residency,
    pub dit: Residency,
    pub vae: Residency,
    /// How offloaded weights are held on the host.
    #[serde(rename = "host_memory")]
    pub memory: HostMemory,
}

impl Placement {
    /// Derives placements from resolved options (after the memory-model rules):
    /// `--sequential-cpu-offload` streams every blockwise component synchronously, one block
    /// at a time; `--model-cpu-offload` parks every component whole; otherwise each
    /// component follows its own flag (`--dit-layerwise-offload` over `--dit-cpu-offload`).
    pub fn new(o: &GenerateOptions) -> Result<Self> {
        let streamed = |stream, depth, per_group, by_step| Residency::Streamed {
            blocks_per_group: per_group,
            by_step,
            options: StreamOptions { stream, depth },
        };
        let layerwise = streamed(
            o.offload_stream,
            o.prefetch_depth as usize,
            o.num_blocks_per_group as usize,
            o.offload_type == OffloadType::LeafLevel,
        );
        let memory = match (o.max_pinned_memory, o.pin_cpu_memory) {
            (Some(bytes), _) => HostMemory::Bounded {
                max_pinned: bytes as usize,
            },
            (None, true) => HostMemory::Pinned,
            (None, false) => HostMemory::Pageable,
        };
        let (text_encoder, dit, vae) = if o.sequential_cpu_offload {
            let sync = streamed(false, 1, 1, true);
            (sync, sync, Residency::Parked)
        } else if o.model_cpu_offload {
            (Residency::Parked, Residency::Parked, Residency::Parked)
        } else {
            let text_encoder = match (o.text_encoder_cpu_offload, o.text_encoder_compute) {
                (false, _) => Residency::Resident,
                (true, ComputeDevice::Cpu) => Residency::OnCpu,
                (true, ComputeDevice::Gpu) => layerwise,
            };
            let dit = if o.dit_layerwise_offload {
                layerwise
            } else if o.dit_cpu_offload {
                Residency::Parked
            } else {
                Residency::Resident
            };
            let vae = if o.vae_cpu_offload {
                Residency::Parked
            } else {
                Residency::Resident
            };
            (text_encoder, dit, vae)
        };
        Ok(Placement {
            text_encoder,
            dit,
            vae,
            memory,
        })
    }

    /// Whether any component keeps its weights in host memory.
    pub fn uses_host_memory(&self) -> bool {
        [self.text_encoder, self.dit, self.vae]
            .iter()
            .any(|r| matches!(r, Residency::Parked | Residency::Streamed { .. }))
    }
}

/// A model the engine can place: built whole, or as its outer part plus blocks built apart.
pub trait Blockwise: Sized + 'static {
    type Config: Clone + Send + Sync + 'static;
    type Block: 'static;
    /// The whole model from its root `VarBuilder`.
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self>;
    /// Everything but the repeated blocks; lookup tables (exact on any device) may come from
    /// `host_vb`, in host memory, when the blocks are streamed.
    fn outer(cfg: &Self::Config, vb: VarBuilder, host_vb: VarBuilder) -> candle_core::Result<Self>;
    fn num_blocks(cfg: &Self::Config) -> usize;
    /// Block `i` from the root `VarBuilder`.
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> candle_core::Result<Self::Block>;
    /// How many steps a block can be split into for finer streaming (1: it cannot).
    fn steps(_: &Self::Config) -> usize {
        1
    }
    /// Step `step` of block `i` alone, as a block that runs just that step.
    fn block_step(
        cfg: &Self::Config,
        i: usize,
        step: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<Self::Block> {
        let _ = step;
        Self::block(cfg, i, vb)
    }
}

/// A component as placed.
pub enum Placed<M: Blockwise> {
    Resident(M),
    Parked(Offloaded<M>),
    Streamed {
        outer: M,
        blocks: Offloaded<Vec<M::Block>>,
    },
}

impl<M: Blockwise> Placed<M> {
    /// Builds the component from `weights` as `residency` says (`OnCpu` builds it in f32 on
    /// the CPU; the outer part of a streamed component stays on the device).
    pub fn load(
        cfg: &M::Config,
        weights: &WeightSet,
        residency: Residency,
        memory: HostMemory,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(match residency.for_steps(M::steps(cfg)) {
            Residency::Resident => {
                Placed::Resident(M::whole(cfg, weights.var_builder(dtype, device))?)
            }
            Residency::OnCpu => Placed::Resident(M::whole(
                cfg,
                weights.var_builder(DType::F32, &Device::Cpu),
            )?),
            Residency::Parked => {
                let cfg = cfg.clone();
                Placed::Parked(Offloaded::from_weights(
                    weights,
                    1,
                    Packing::PerTensor,
                    move |_, vb| M::whole(&cfg, vb),
                    dtype,
                    device,
                    memory,
                    StreamOptions {
                        stream: false,
                        depth: 1,
                    },
                )?)
            }
            Residency::Streamed {
                blocks_per_group,
                by_step,
                options,
            } => {
                let outer = M::outer(
                    cfg,
                    weights.var_builder(dtype, device),
                    weights.var_builder(dtype, &Device::Cpu),
                )?;
                let n = M::num_blocks(cfg);
                let steps = if by_step { M::steps(cfg) } else { 1 };
                let per_group = blocks_per_group.max(1);
                let cfg = cfg.clone();
                let blocks = Offloaded::from_weights(
                    weights,
                    if steps > 1 {
                        n * steps
                    } else {
                        n.div_ceil(per_group)
                    },
                    Packing::ByDtype,
                    move |g, vb| {
                        if steps > 1 {
                            return Ok(vec![M::block_step(&cfg, g / steps, g % steps, vb)?]);
                        }
                        (g * per_group..((g + 1) * per_group).min(n))
                            .map(|i| M::block(&cfg, i, vb.clone()))
                            .collect()
                    },
                    dtype,
                    device,
                    memory,
                    options,
                )?;
                Placed::Streamed { outer, blocks }
            }
        })
    }

    /// The component for one stage: borrowed when it stays put, moved in when parked (and
    /// moved out when the returned value drops).
    pub fn hold(&self) -> Result<Held<'_, M>> {
        Ok(match self {
            Placed::Resident(m) => Held::Borrowed(m, None),
            Placed::Streamed { outer, blocks } => Held::Borrowed(outer, Some(blocks)),
            Placed::Parked(offloaded) => Held::Moved(offloaded.fetch(0)?),
        })
    }

    /// What the offload engine holds and has moved for this component (`None` if resident).
    pub fn offload_usage(&self) -> Option<Usage> {
        match self {
            Placed::Resident(_) => None,
            Placed::Parked(o) => Some(o.usage()),
            Placed::Streamed { blocks, .. } => Some(blocks.usage()),
        }
    }
}

/// A component held for a stage.
pub enum Held<'a, M: Blockwise> {
    /// Resident (with its streamed blocks, if any).
    Borrowed(&'a M, Option<&'a Offloaded<Vec<M::Block>>>),
    /// Moved in from host memory for this stage (its device memory is freed on drop).
    Moved(M),
}

impl<M: Blockwise> Held<'_, M> {
    /// The model (its outer part when streamed).
    pub fn model(&self) -> &M {
        match self {
            Held::Borrowed(m, _) => m,
            Held::Moved(m) => m,
        }
    }

    /// Runs `f` on every block in order, streamed or resident (`resident` lists them).
    pub fn for_each_block<'b>(
        &'b self,
        resident: impl FnOnce(&'b M) -> &'b [M::Block],
        mut f: impl FnMut(&M::Block) -> Result<()>,
    ) -> Result<()> {
        match self {
            Held::Borrowed(_, Some(blocks)) => blocks.for_each(|group| {
                for block in group {
                    f(block)?;
                }
                Ok(())
            }),
            _ => {
                for block in resident(self.model()) {
                    f(block)?;
                }
                Ok(())
            }
        }
    }
}
