//! The frame's half of every family pipeline: the run, its pipeline as data, where each
//! component is placed, and the components themselves, loaded and released from the spec alone.
//! A family adds its own state (tokenizers, configs, typed slots) and its stages' bodies; the
//! frame runs them, records what the offload engine moved around each stage, drops what a job
//! carried when a stage fails, and leaves decoding and writing to the leader of a
//! sequence-parallel group.

use super::draws::{RunDraws, Sizes};
use super::holding::{Fsdp, Holding};
use super::jobs::Job;
use super::placement::{Blockwise, Held, Placed, Placement};
use super::progress::Progress;
use super::registry::{Family, RunShape, T5VideoConfigs};
use super::runner::{LoadedBeside, Pipeline};
use super::spec::{ComponentSpec, PipelineSpec, Role, Slot};
use super::stages;
use crate::config::ResolvedConfig;
use crate::memory::MemoryOptions;
use crate::models::source::{component_weights, ModelSource};
use crate::models::t5::tokenizer::PromptTokenizer;
use crate::models::video::{VideoDit, VideoVae};
use crate::offload::{Residency, Usage};
use crate::output::Audio;
use crate::parallel::collective::Collective;
use crate::weights::WeightSet;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::json;
use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

/// A family's own part of its pipeline when it reads one T5 tokenizer (the frame holds the
/// rest): its configs, its components' slots and the tokenizer; its stage bodies are its
/// methods.
pub struct T5Pipeline<C, P> {
    pub configs: C,
    pub parts: P,
    pub tokenizer: PromptTokenizer,
}

impl<C, P> T5Pipeline<C, P> {
    /// Reads the model's `tokenizer/tokenizer.json`; loads no weights. `spiece`: the family, whose
    /// checkpoints may ship only `spiece.model` (the error where the file is missing says how
    /// to write it).
    pub fn read(configs: C, parts: P, frame: &Frame, spiece: Option<&str>) -> Result<Self> {
        let tokenizer = match spiece {
            Some(family) => PromptTokenizer::from_source_or_spiece(&frame.source, family)?,
            None => PromptTokenizer::from_source(&frame.source, "tokenizer/tokenizer.json")?,
        };
        Ok(T5Pipeline {
            configs,
            parts,
            tokenizer,
        })
    }

    /// The family's own part of a run ([`Family::open`]): the tokenizer read as [`Self::read`]
    /// reads it, the draws file checked against what `take` takes ([`Self::checking_draws`]).
    pub fn opener<T>(
        spiece: Option<&'static str>,
        take: fn(&Self, &mut RunDraws, Sizes) -> Result<T>,
    ) -> impl Fn(C, P, &Frame) -> Result<Self> {
        move |configs, parts, frame| {
            Self::read(configs, parts, frame, spiece)?.checking_draws(frame, take)
        }
    }

    /// Itself, once the run's draws file (where one is given) holds what `take` takes for a
    /// job of the run's sizes and nothing else ([`RunDraws::check`]).
    pub fn checking_draws<T>(
        self,
        frame: &Frame,
        take: impl FnOnce(&Self, &mut RunDraws, Sizes) -> Result<T>,
    ) -> Result<Self> {
        RunDraws::check(frame, |draws, sizes| take(&self, draws, sizes).map(drop))?;
        Ok(self)
    }
}

impl<D: VideoDit, V: VideoVae, S, P> T5Pipeline<T5VideoConfigs<D, V, S>, P> {
    /// The run's one draw where the family takes no other: the initial latents.
    pub fn take_latents(&self, draws: &mut RunDraws, s: Sizes) -> Result<Tensor> {
        let shape = self.configs.latent_shape(s.num_frames, s.height, s.width);
        draws.take("latents", &shape)
    }
}

/// A loaded component as the frame holds it: what the engine moved is readable without its
/// model type, the model through a [`Slot`]. Built on the thread that loads it beside a stage
/// ([`Pipeline::run_stage_loading`]).
pub trait Loaded: Send + Sync {
    /// What the offload engine holds and has moved for it (`None` if resident).
    fn offload_usage(&self) -> Option<Usage>;
    fn as_any(&self) -> &dyn Any;
}

impl<M: Blockwise> Loaded for Placed<M> {
    fn offload_usage(&self) -> Option<Usage> {
        Placed::offload_usage(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The run and its components: what every stage body reads besides its family's own state.
pub struct Frame {
    pub config: ResolvedConfig,
    pub source: ModelSource,
    pub spec: PipelineSpec,
    pub device: Device,
    pub placement: Placement,
    pub progress: Arc<Progress>,
    loaded: Vec<Option<Box<dyn Loaded>>>,
}

impl Frame {
    /// The frame of a run of `spec`; a rank that does not lead its sequence-parallel group
    /// runs the follower's part of it (the DiTs alone).
    pub fn new(
        config: ResolvedConfig,
        source: ModelSource,
        spec: PipelineSpec,
        device: Device,
        progress: Arc<Progress>,
    ) -> Self {
        let spec = match config.ranks() {
            Some(ranks) if !ranks.leads() => spec.follower(),
            _ => spec,
        };
        let placement = Placement::new(config.memory(), &spec);
        Frame {
            loaded: spec.components.iter().map(|_| None).collect(),
            config,
            source,
            spec,
            device,
            placement,
            progress,
        }
    }

    /// The runnable pipeline of `family` on the frame of a run: the frame for the spec of the
    /// run's shape, and the family's own part ([`Family::open`]).
    pub fn open(
        family: &dyn Family,
        config: ResolvedConfig,
        source: ModelSource,
        device: Device,
        progress: Arc<Progress>,
    ) -> Result<Box<dyn Pipeline<Job = Job>>> {
        let spec = family.spec(&RunShape::of(&config));
        let frame = Frame::new(config, source, spec, device, progress);
        let family = family.open(&frame)?;
        Ok(Box::new(FramePipeline { frame, family }))
    }

    /// The run's dtype.
    pub fn dtype(&self) -> DType {
        self.config.dtype()
    }

    /// The dtype `slot`'s component runs in.
    pub fn dtype_of<M>(&self, slot: Slot<M>) -> DType {
        self.spec.components[slot.index()].dtype(self.dtype())
    }

    /// Where `slot`'s component computes (its residency may keep it on the CPU).
    pub fn device_of<M>(&self, slot: Slot<M>) -> Device {
        match self.placement.residencies[slot.index()] {
            Residency::OnCpu => Device::Cpu,
            _ => self.device.clone(),
        }
    }

    /// `slot`'s component, if loaded.
    pub fn loaded<M: Blockwise>(&self, slot: Slot<M>) -> Option<&Placed<M>> {
        self.loaded
            .get(slot.index())?
            .as_ref()?
            .as_any()
            .downcast_ref()
    }

    /// `slot`'s component held for a stage (moved in when parked, see [`Placed::hold`]).
    pub fn hold<M: Blockwise>(&self, slot: Slot<M>) -> Result<Held<'_, M>> {
        self.loaded(slot)
            .with_context(|| format!("{} not loaded", self.spec.components[slot.index()].name))?
            .hold()
    }

    /// Whether this rank follows the leader of its sequence-parallel group.
    pub fn follows(&self) -> bool {
        self.config.ranks().is_some_and(|r| !r.leads())
    }

    /// A decode stage: holds the VAE in `slot`, gives `decode` the job's denoised latents (on
    /// the device) and whether to decode in tiles (`--vae-tiling`, or the plan's override), and
    /// keeps the video `[1, 3, T, H, W]` in [-1, 1] it makes as the job's frames
    /// ([`stages::video_frames`]).
    pub fn decode<M: Blockwise>(
        &self,
        job: &mut Job,
        slot: Slot<M>,
        decode: impl FnOnce(&M, Tensor, bool) -> Result<Tensor>,
    ) -> Result<()> {
        let held = self.hold(slot)?;
        let latents = job.latents.take().context("nothing denoised")?;
        let tiled = self.config.memory().vae_tiling;
        let video = decode(&*held.model()?, latents.to_device(&self.device)?, tiled)?;
        job.frames = Some(stages::video_frames(video)?);
        Ok(())
    }

    /// Writes the job's output: (with the sound of a model that makes it), or its
    /// latents with `--output-type latent`.
    pub fn write(&self, job: &mut Job, audio: Option<&Audio>) -> Result<()> {
        stages::write_output(&self.config, job, audio)
    }

    /// Opens `component`'s weights and builds it as the placement says (as this rank's FSDP
    /// shards for a DiT under `--use-fsdp-inference`), and reports where they went.
    pub fn build<M: Blockwise>(&self, component: usize, cfg: &M::Config) -> Result<Placed<M>> {
        let weights = self.weights(component)?;
        self.place(component, cfg, &weights)
            .with_context(|| self.what(component))
    }

    /// "loading NAME of SOURCE", the context of a failure to build `component`.
    fn what(&self, component: usize) -> String {
        format!(
            "loading {} of {}",
            self.spec.components[component].name, self.source
        )
    }

    /// `component`'s weights ([`open_weights`]), opened with a progress bar.
    fn weights(&self, component: usize) -> Result<WeightSet> {
        let spec = &self.spec.components[component];
        let weights =
            open_weights(&self.config, &self.source, spec).with_context(|| self.what(component))?;
        let total = weights.stored_bytes();
        let progress = self
            .progress
            .bytes(&format!("reading {}", spec.name), total);
        Ok(weights.with_progress(progress))
    }

    /// The group the DiTs are sharded over (`--use-fsdp-inference` on a rank of several).
    fn fsdp(&self) -> Option<&Arc<dyn Collective>> {
        let ranks = self.config.ranks()?;
        self.config
            .memory()
            .use_fsdp_inference
            .then_some(&ranks.group)
    }

    /// Builds `component` from `weights` as its [`Holding`] says and reports where they went.
    fn place<M: Blockwise>(
        &self,
        component: usize,
        cfg: &M::Config,
        weights: &WeightSet,
    ) -> Result<Placed<M>> {
        let residency = self.placement.residencies[component];
        let ComponentSpec { name, role, .. } = self.spec.components[component];
        let dtype = self.spec.components[component].dtype(self.dtype());
        let group = self.fsdp();
        let fsdp =
            group.and_then(|g| Fsdp::of(self.config.memory(), role, g.rank(), g.world_size()));
        let holding = Holding::of::<M>(cfg, residency, fsdp, dtype)?;
        let placed = Placed::load(
            cfg,
            weights,
            holding,
            self.placement.memory_for(component),
            dtype,
            &self.device,
            group,
        )?;
        const GIB: f64 = (1u64 << 30) as f64;
        self.progress.note(&match (holding, placed.offload_usage()) {
            (Holding::Sharded { fsdp, .. }, _) => format!(
                "{name}: FSDP, 1/{} of every block on this GPU{}",
                fsdp.ranks,
                if fsdp.on_host {
                    " (in host memory)"
                } else {
                    ""
                }
            ),
            (_, Some(u)) => format!(
                "{name}: {residency}{}; {:.2} GiB copied into host memory, {:.2} GiB pinned, in {:.2}s \
                 (filling {:.2} and locking {:.2} task-seconds)",
                match u.kept_groups {
                    0 => String::new(),
                    n => format!(
                        "; kept on the device: {n} group(s), {:.2} GiB",
                        u.kept_bytes as f64 / GIB
                    ),
                },
                u.host_bytes as f64 / GIB,
                u.pinned_bytes as f64 / GIB,
                u.setup.seconds,
                u.setup.fill_task_seconds,
                u.setup.lock_task_seconds
            ),
            (_, None) => format!("{name}: {residency}"),
        });
        Ok(placed)
    }

    /// What the offload engine holds and has moved for `component`, where it is loaded.
    fn usage(&self, component: usize) -> Option<Usage> {
        self.loaded[component].as_ref()?.offload_usage()
    }

    /// The `--stats-json` metric of what the engine moved for `component`: `offload` for the
    /// first DiT (the denoiser every family has), `offload_<name>` for the others.
    fn usage_key(&self, component: usize) -> String {
        let first_dit = self
            .spec
            .components
            .iter()
            .position(|c| c.role == Role::Dit);
        match first_dit == Some(component) {
            true => "offload".into(),
            false => format!("offload_{}", self.spec.components[component].name),
        }
    }
}

/// A family's pipeline on the frame: the runner's view of it.
struct FramePipeline {
    frame: Frame,
    family: Box<dyn Any>,
}

impl Pipeline for FramePipeline {
    type Job = Job;

    fn spec(&self) -> &PipelineSpec {
        &self.frame.spec
    }

    fn load(&mut self, component: usize) -> Result<()> {
        let constructors = self.frame.spec.components[component].constructors.clone();
        let built = constructors.load(&self.frame, component)?;
        self.frame.loaded[component] = Some(built);
        Ok(())
    }

    fn release(&mut self, component: usize) {
        self.frame.loaded[component] = None;
    }

    /// The frame's options become `options` and its placement theirs: components load as they
    /// say from now on.
    fn replace_memory_options(&mut self, options: &MemoryOptions) -> bool {
        let config = self.frame.config.clone();
        self.frame.config = config.with_memory_options(options.clone(), "out of memory");
        self.frame.placement = Placement::new(self.frame.config.memory(), &self.frame.spec);
        true
    }

    fn run_stage(&mut self, index: usize, job: &mut Job) -> Result<()> {
        run_stage(&self.frame, self.family.as_ref(), index, job)
    }

    /// The components `ahead` are built on a thread of their own while the stage runs (reading
    /// and page-locking their weights is host work; what either queues on the device runs in
    /// stream order), then held by the frame.
    fn run_stage_loading(
        &mut self,
        index: usize,
        job: &mut Job,
        ahead: &[usize],
    ) -> (Result<()>, Vec<LoadedBeside>) {
        if ahead.is_empty() {
            return (self.run_stage(index, job), Vec::new());
        }
        let (frame, family) = (&self.frame, self.family.as_ref());
        let (result, built) = std::thread::scope(|scope| {
            let loader = scope.spawn(|| {
                ahead
                    .iter()
                    .map(|&c| {
                        let start = Instant::now();
                        let built = frame.spec.components[c]
                            .constructors
                            .load(frame, c)
                            .and_then(|b| Ok(frame.device.synchronize().map(|()| b)?));
                        (c, built.map(|b| (b, start.elapsed())))
                    })
                    .collect::<Vec<_>>()
            });
            let result = run_stage(frame, family, index, job);
            let work_done = Instant::now();
            let built = loader.join().unwrap_or_else(|_| {
                let failed = || Err(anyhow::anyhow!("its load beside the stage panicked"));
                ahead.iter().map(|&c| (c, failed())).collect()
            });
            // The stage's time counts its wait for the loads beside it; its own work is the
            // rest (a text stage's against diffusers' `encode_prompt`, which loads nothing).
            let waited = work_done.elapsed().as_secs_f64();
            let waits = job
                .metrics
                .entry("waited_for_loads_beside")
                .or_insert_with(|| json!({}));
            waits[frame.spec.stages[index].name] = json!(waited);
            (result, built)
        });
        let landed = built
            .into_iter()
            .map(|(c, built)| {
                let took = built.map(|(b, took)| {
                    self.frame.loaded[c] = Some(b);
                    took
                });
                (c, took)
            })
            .collect();
        (result, landed)
    }
}

/// Runs the stage's body, recording what the engine moved for each component it uses. A rank
/// that follows its group's leader skips what comes after the DiTs (the leader decodes and
/// writes); a failed stage drops what the job carried for the later ones.
fn run_stage(frame: &Frame, family: &dyn Any, index: usize, job: &mut Job) -> Result<()> {
    let stages = &frame.spec.stages;
    let stage = &stages[index];
    if frame.follows() {
        let last_dit = stages.iter().rposition(|s| !s.uses.is_empty());
        if last_dit.is_some_and(|last| index > last) {
            job.latents = None;
            job.frames = None;
            job.written = index + 1 == stages.len();
            return Ok(());
        }
    }
    let body = stage
        .body
        .as_ref()
        .with_context(|| format!("stage {} has nothing to run", stage.name))?;
    let before: Vec<_> = stage.uses.iter().map(|&c| frame.usage(c)).collect();
    let result = body
        .run(family, frame, job)
        .and_then(|()| check_embeddings(job));
    match &result {
        Ok(()) => {
            for (&c, before) in stage.uses.iter().zip(before) {
                let key = frame.usage_key(c);
                stages::report_offload(&frame.progress, job, &key, before, frame.usage(c));
            }
        }
        Err(_) => job.carry.clear(),
    }
    result
}

/// Fails when the embeddings a stage left for the job hold a NaN or an infinity (families that
/// carry their conditioning apart check it where they make it).
fn check_embeddings(job: &Job) -> Result<()> {
    for (embeds, what) in [
        (&job.prompt_embeds, "the prompt embeddings"),
        (&job.negative_embeds, "the negative prompt embeddings"),
    ] {
        if let Some(embeds) = embeds {
            stages::ensure_finite(embeds, what)?;
        }
    }
    Ok(())
}

/// The LoRAs given for component `spec` and which of their keys change it: `--lora-2` for the
/// second expert (`transformer_2`), `--lora` for any other component LoRAs change.
pub(crate) fn lora_specs<'a>(
    config: &'a ResolvedConfig,
    spec: &ComponentSpec,
) -> Option<(&'a [crate::lora::LoraSpec], crate::lora::Target)> {
    let [first, second] = &config.generation().loras;
    let specs = match spec.folder {
        "transformer_2" => second,
        _ => first,
    };
    Some((specs.as_slice(), spec.lora?)).filter(|(specs, _)| !specs.is_empty())
}

/// The weights of component `spec` as the run reads them: its single file or its folder's
/// files, with the LoRAs given for it merged in and, for a DiT, `--storage-dtype`'s rounding.
pub(crate) fn open_weights(
    config: &ResolvedConfig,
    source: &ModelSource,
    spec: &ComponentSpec,
) -> Result<WeightSet> {
    let files = match transformer_file(config, spec.folder)? {
        Some((_, local)) => crate::weights::Weights::Files(vec![local]),
        None => component_weights(source, spec.folder)?,
    };
    let mut weights = WeightSet::open(&files)?;
    if let Some((specs, target)) = lora_specs(config, spec) {
        let loras = crate::lora::Scanned::scan(specs, target)?
            .rooted(|name| weights.stored_shape(name).is_some())
            .read()?;
        weights = weights.with_loras(Arc::new(loras));
    }
    if let (Some(dtype), Role::Dit) = (config.generation().storage_dtype, spec.role) {
        let skip = spec.storage_cast_skip;
        weights = weights.with_storage_cast(crate::weights::StorageCast { dtype, skip });
    }
    Ok(weights)
}

/// The single file given for the component in `folder` (`--transformer`, `--transformer-2`):
/// as given, and the local file it names (an `hf:` file fetched,
/// [`crate::models::source::flag_file`]).
pub(crate) fn transformer_file<'a>(
    config: &'a ResolvedConfig,
    folder: &str,
) -> Result<Option<(&'a std::path::Path, std::path::PathBuf)>> {
    let [first, second] = &config.generation().transformer_files;
    let given = match folder {
        "transformer" => first.as_deref(),
        "transformer_2" => second.as_deref(),
        _ => None,
    };
    given
        .map(|file| {
            let local = crate::models::source::flag_file(file)
                .with_context(|| format!("--transformer {}", file.display()))?;
            Ok((file, local))
        })
        .transpose()
}
