//! A family's memory plan from its description alone: the placement the options give each
//! component, the weights its constructors ask for as the offload engine would hold them, and
//! the schedule's loads and releases.

use super::frame;
use super::holding::Fsdp;
use super::placement::Placement;
use super::registry::{Family, RunShape};
use super::runner::{Jobs, LoadPolicy, Schedule};
use super::spec::{ComponentSpec, PipelineSpec, Role};
use crate::config::ResolvedConfig;
use crate::memory::plan::{self as memory_plan, HostSide, MemoryPlan, PlanFor, PlanStage, Request};
use crate::memory::{DeviceInfo, MemoryModel, MemoryOptions};
use crate::models::source::ModelSource;
use crate::offload::{DeviceWeights, HostMemory, Residency};
use crate::weights::WeightSet;
use anyhow::Result;
use candle_core::DType;
use std::cell::RefCell;
use std::collections::HashMap;

/// When components load, from the memory options.
pub fn load_policy(o: &MemoryOptions) -> LoadPolicy {
    if o.lazy() {
        LoadPolicy::Lazy
    } else if o.sequential() {
        LoadPolicy::Sequential
    } else {
        LoadPolicy::Eager
    }
}

/// A component's device weights and host bytes under one holding.
type Recorded = (DeviceWeights, u64);

/// Plans a family's runs; remembers each component's recorded weights (they depend on the
/// residency, FSDP membership, host memory and dtype only), so weighing many option sets
/// records each layout once.
pub struct Planner<'a> {
    family: &'a dyn Family,
    config: &'a ResolvedConfig,
    weights: RefCell<HashMap<(usize, String, DType), Recorded>>,
    /// Each component's weights (by name) where some are held packed ([`Self::packed_weights`]).
    packed: RefCell<HashMap<&'static str, Option<WeightSet>>>,
    /// The weights are read from files (not generated): unlocked, their pages can be dropped.
    mapped: bool,
}

impl<'a> Planner<'a> {
    pub fn new(family: &'a dyn Family, config: &'a ResolvedConfig) -> Self {
        Planner {
            family,
            config,
            weights: RefCell::default(),
            packed: RefCell::default(),
            mapped: ModelSource::parse(&config.generation().model)
                .is_ok_and(|source| !source.is_synthetic()),
        }
    }

    /// Which jobs the plan is for: one `--prompt` is the run's last job (each component is
    /// released after its last stage); a prompt file has more (every component stays for the
    /// next one).
    pub fn jobs(&self) -> Jobs {
        match self.config.generation().prompts {
            Some(crate::config::Prompts::File(_)) => Jobs::More,
            _ => Jobs::Last,
        }
    }

    /// The run's own request: its resolved memory options and frame count, and the family's
    /// frame rule.
    pub fn request(&self) -> Request {
        Request {
            options: self.config.memory().clone(),
            num_frames: self.config.video().num_frames,
            frame_step: self.config.frame_rule().frame_step,
        }
    }

    /// The description of the run `request` asks for.
    pub fn spec(&self, request: &Request) -> PipelineSpec {
        self.family.spec(&self.shape(request))
    }

    fn shape(&self, request: &Request) -> RunShape {
        RunShape {
            num_frames: request.num_frames,
            vae_tiling: request.options.vae_tiling,
            vae_tile_size: request.options.vae_tile_size,
            low_activation: request.options.low_activation,
            ..RunShape::of(self.config)
        }
    }

    /// The memory plan of the options asked, where they can be placed (where they cannot, the
    /// run reports it where it places them).
    pub fn asked(&self) -> Option<MemoryPlan> {
        self.plan(&self.request()).ok()
    }

    /// The memory plan of `request` on the GPU of rank 0 (the busiest: it alone encodes the
    /// text and decodes).
    pub fn plan(&self, request: &Request) -> Result<MemoryPlan> {
        self.plan_rank(request, 0)
    }

    /// The memory plan of the run's options for a video of another size (a prompt file line's
    /// overrides), on rank 0; the recorded weights are shared with every other plan of this
    /// planner.
    pub fn plan_size(&self, num_frames: u32, height: u32, width: u32) -> Result<MemoryPlan> {
        let request = Request {
            num_frames,
            ..self.request()
        };
        let shape = RunShape {
            height,
            width,
            ..self.shape(&request)
        };
        self.plan_shape(&request, shape, 0)
    }

    /// The memory plan of `request` on the GPU of `rank` of `--num-gpus`: every rank holds the
    /// DiT (whole, or its flat shards over its group plus the gathered blocks with FSDP) and its
    /// share of the denoise activations (1 / `--sp-size` of the tokens); the leader of each
    /// group of `--sp-size` alone holds the other components and runs their stages
    /// ([`PipelineSpec::follower`] is what the others run).
    pub fn plan_rank(&self, request: &Request, rank: usize) -> Result<MemoryPlan> {
        self.plan_shape(request, self.shape(request), rank)
    }

    /// What `rank` runs: the whole pipeline, or a follower's part of it.
    pub fn rank_spec(&self, spec: PipelineSpec, rank: usize) -> PipelineSpec {
        if self.config.groups().leads(rank) {
            spec
        } else {
            spec.follower()
        }
    }

    fn plan_shape(&self, request: &Request, shape: RunShape, rank: usize) -> Result<MemoryPlan> {
        let spec = self.rank_spec(self.family.spec(&shape), rank);
        let placement = Placement::new(&request.options, &spec);
        let schedule = Schedule::plan(&spec, load_policy(&request.options), self.jobs());
        let groups = self.config.groups();
        let (weights, host_weights): (Vec<DeviceWeights>, Vec<u64>) = spec
            .components
            .iter()
            .zip(&placement.residencies)
            .enumerate()
            .map(|(i, (c, &residency))| {
                let fsdp = Fsdp::of(
                    &request.options,
                    c.role,
                    groups.rank_in_group(rank),
                    groups.sp,
                );
                let memory = placement.memory_for(i);
                self.component_bytes(i, &spec, residency, fsdp, memory, c.dtype(shape.dtype))
            })
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let is_dit = |c: usize| spec.components[c].role == Role::Dit;
        // The decoded video waits in host memory (f32 RGB) from the stage after the last that
        // denoises to the end.
        let last_dit = spec
            .stages
            .iter()
            .rposition(|s| s.uses.iter().any(|&c| is_dit(c)));
        let video_bytes = u64::from(shape.num_frames)
            .saturating_mul(u64::from(shape.height) * u64::from(shape.width) * 3 * 4);
        // A stage whose components all compute on the CPU holds no device activations.
        let on_device = |uses: &[usize]| {
            uses.iter()
                .any(|&c| placement.residencies[c] != Residency::OnCpu)
        };
        let stages: Vec<PlanStage> = spec
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let dit = on_device(&s.uses) && s.uses.iter().any(|&c| is_dit(c));
                // Each rank holds its share of the tokens (sequence parallelism), and every
                // block built on the device its own bytes.
                let mut per_block = s.block_bytes.clone();
                per_block.sort_unstable_by(|a, b| b.cmp(a));
                let blocks = per_block.len();
                let held = s
                    .uses
                    .iter()
                    .filter(|&&c| is_dit(c))
                    .map(|&c| match placement.residencies[c] {
                        Residency::Resident | Residency::Parked => blocks,
                        Residency::Streamed {
                            blocks_per_group,
                            by_step: false,
                            ..
                        } => blocks_per_group.min(blocks),
                        _ => 1,
                    })
                    .max()
                    .unwrap_or(1);
                let held_bytes: u64 = per_block.iter().take(held).sum();
                let dit_bytes =
                    |activations: u64| activations.div_ceil(groups.sp as u64) + held_bytes;
                PlanStage {
                    name: s.name,
                    uses: &s.uses,
                    load_before: &schedule.load_before[i],
                    release_after: &schedule.release_after[i],
                    activation_bytes: match () {
                        _ if !on_device(&s.uses) => 0,
                        _ if dit => dit_bytes(s.activation_bytes),
                        _ => s.activation_bytes,
                    },
                    apart_activation_bytes: s.apart_activation_bytes.filter(|_| dit).map(dit_bytes),
                    host_activation_bytes: match () {
                        // A stage computing on the CPU holds its activations there.
                        _ if !s.uses.is_empty() && !on_device(&s.uses) => s.activation_bytes,
                        _ if shape.decode && last_dit.is_some_and(|d| i > d) => video_bytes,
                        _ => 0,
                    },
                }
            })
            .collect();
        let host = HostSide {
            weights: &host_weights,
            // Unified memory, or none: what the device holds, the host holds.
            shared: self.config.device().memory_model != MemoryModel::Discrete,
        };
        MemoryPlan::with_host(&stages, &weights, host)
    }

    /// Component `index`'s device weights and host bytes held as `residency`, or `fsdp`, and
    /// `memory` say (see [`super::holding::Holding`]).
    fn component_bytes(
        &self,
        index: usize,
        spec: &PipelineSpec,
        residency: Residency,
        fsdp: Option<Fsdp>,
        memory: HostMemory,
        dtype: DType,
    ) -> Result<Recorded> {
        let key = (index, format!("{residency:?} {fsdp:?} {memory:?}"), dtype);
        if let Some(w) = self.weights.borrow().get(&key) {
            return Ok(*w);
        }
        let constructors = &spec.components[index].constructors;
        let holding = constructors.holding(residency, fsdp, dtype)?;
        let weights = self.packed_weights(&spec.components[index]);
        let layout = constructors.layout(holding, dtype, weights.as_ref())?;
        let w = (
            holding.device_weights(&layout),
            holding.host_bytes(&layout, memory, self.mapped),
        );
        self.weights.borrow_mut().insert(key, w);
        Ok(w)
    }

    /// `component`'s weights where the engine holds some packed (a GGUF file, a scaled fp8
    /// file, a DiT under `--storage-dtype`), so the plan counts them as held; elsewhere (and
    /// where they do not open: the run reports that) `None`, the constructors' requests being
    /// the bytes.
    fn packed_weights(&self, component: &ComponentSpec) -> Option<WeightSet> {
        let open = || {
            let file = frame::transformer_file(self.config, component.folder).ok()?;
            let gguf = file
                .as_ref()
                .is_some_and(|(_, local)| crate::weights::gguf::is_gguf(local));
            let cast =
                self.config.generation().storage_dtype.is_some() && component.role == Role::Dit;
            let source = ModelSource::parse(&self.config.generation().model).ok()?;
            (file.is_some() || cast)
                .then(|| frame::open_weights(self.config, &source, component).ok())
                .flatten()
                .filter(|weights| gguf || cast || weights.holds_scaled_fp8())
        };
        let mut packed = self.packed.borrow_mut();
        packed.entry(component.name).or_insert_with(open).clone()
    }

    /// What every search of option sets ([`memory_plan`]) is given, handed to `search`: the
    /// run's request, its device, how a request is planned, and which options the user set
    /// (which fitting keeps).
    fn search<T>(
        &self,
        search: impl FnOnce(&Request, &DeviceInfo, PlanFor, &dyn Fn(&str) -> bool) -> T,
    ) -> T {
        // A step cache acts between whole blocks: fitting never streams them step by step.
        let cached = self.config.generation().cache.is_some();
        let given =
            |option: &str| self.config.given(option) || (cached && option == "offload_type");
        search(
            &self.request(),
            self.config.device(),
            &|r| self.plan(r),
            &given,
        )
    }

    /// Out-of-memory advice for the run (see [`memory_plan::advice`]).
    pub fn advice(&self) -> String {
        let total = self.config.device().total_memory;
        self.search(|request, device, plan, _| memory_plan::advice(request, device, plan, total))
    }

    /// Option sets that need less memory (see [`memory_plan::candidates`]).
    pub fn candidates(&self, total: Option<u64>) -> Vec<memory_plan::Candidate> {
        self.search(|request, device, plan, _| {
            memory_plan::candidates(request, device, plan, total, &|_| false)
        })
    }

    /// The memory options the user set, which fitting keeps (their flags).
    pub fn kept(&self) -> Vec<&'static str> {
        memory_plan::kept_savings(&|option| self.config.given(option))
    }

    /// The host options the user set, which fitting to the host keeps (their flags).
    pub fn kept_host(&self) -> Vec<&'static str> {
        memory_plan::kept_host_savings(&|option| self.config.given(option))
    }

    /// How the run fits `host` bytes of host memory and, where known, the `free` device bytes,
    /// keeping every option the user set (see [`memory_plan::fit_host`]).
    pub fn fit_host(&self, host: u64, free: Option<u64>) -> memory_plan::Fit {
        self.search(|request, device, plan, kept| {
            memory_plan::fit_host(request, device, plan, host, free, kept)
        })
    }

    /// The host option set with the lowest host peak the run may take (see
    /// [`memory_plan::leanest_host`]).
    pub fn leanest_host(&self) -> Option<memory_plan::Candidate> {
        self.search(memory_plan::leanest_host)
    }

    /// The run's options with the DiT held on the device, where its defaults offload it and
    /// that is predicted to fit `free` bytes with room to spare (see
    /// [`memory_plan::dit_on_device`]).
    pub fn dit_on_device(&self, free: u64) -> Option<(Request, MemoryPlan)> {
        let given = |option: &str| self.config.given(option);
        memory_plan::dit_on_device(
            &self.request(),
            self.config.device(),
            &|r| self.plan(r),
            free,
            &given,
        )
    }

    /// The run's options with its text encoders loaded whole on the device, where its defaults
    /// stream them and that is predicted to fit `free` bytes with room to spare (see
    /// [`memory_plan::text_encoders_on_device`]).
    pub fn text_encoders_on_device(&self, free: u64) -> Option<(Request, MemoryPlan)> {
        let given = |option: &str| self.config.given(option);
        memory_plan::text_encoders_on_device(&self.request(), &|r| self.plan(r), free, &given)
    }

    /// The run's options with as many of its streamed DiT's blocks kept on the device as `free`
    /// bytes hold with room to spare, where its defaults stream the DiT (see
    /// [`memory_plan::dit_kept_on_device`]).
    pub fn dit_kept_on_device(&self, free: u64) -> Option<(Request, MemoryPlan)> {
        let given = |option: &str| self.config.given(option);
        memory_plan::dit_kept_on_device(&self.request(), &|r| self.plan(r), free, &given)
    }

    /// The first option set that needs less device memory than the run's, keeping every
    /// memory option the user set and the frames (see [`memory_plan::candidates`]).
    pub fn leaner(&self) -> Option<memory_plan::Candidate> {
        self.search(|request, device, plan, kept| {
            memory_plan::candidates(request, device, plan, None, kept)
        })
        .into_iter()
        .next()
    }

    /// How the run fits `free` bytes, keeping every memory option the user set (see
    /// [`memory_plan::fit`]).
    pub fn fit(&self, free: u64) -> memory_plan::Fit {
        self.search(|request, device, plan, kept| {
            memory_plan::fit(request, device, plan, free, kept)
        })
    }
}
