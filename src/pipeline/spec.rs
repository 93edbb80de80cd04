//! A pipeline as data: its components (each with a role and the constructors that build it) and
//! its stages (the components each uses, in order, and the activations each is expected to
//! hold). The runner, the placement, the memory plan, the out-of-memory advice, the dry run and
//! the stats read only this, so a new family adds no code to any of them.

use super::frame::{Frame, Loaded};
use super::holding::{Fsdp, Holding};
use super::jobs::Job;
use super::placement::Blockwise;
use crate::offload::{ComponentLayout, Packing, Residency};
use crate::weights::WeightSet;
use anyhow::{Context, Result};
use candle_core::DType;
use serde::Serialize;
use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

/// What a component does in its pipeline; the role decides which flags place it (FastVideo's
/// `--text-encoder-cpu-offload` for every text encoder, the DiT flags for every DiT, ...).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    TextEncoder,
    ImageEncoder,
    Dit,
    Vae,
    AudioVae,
}

impl Role {
    /// Every role, in the order reports list them.
    pub const ALL: [Role; 5] = [
        Role::TextEncoder,
        Role::ImageEncoder,
        Role::Dit,
        Role::Vae,
        Role::AudioVae,
    ];

    /// The role's key in the dry-run JSON's `placement` (`dit` for the DiTs).
    pub fn key(self) -> &'static str {
        match self {
            Role::TextEncoder => "text_encoder",
            Role::ImageEncoder => "image_encoder",
            Role::Dit => "dit",
            Role::Vae => "vae",
            Role::AudioVae => "audio_vae",
        }
    }

    /// The role in words.
    pub fn describe(self) -> &'static str {
        match self {
            Role::TextEncoder => "text encoder",
            Role::ImageEncoder => "image encoder",
            Role::Dit => "DiT",
            Role::Vae => "VAE",
            Role::AudioVae => "audio VAE",
        }
    }
}

/// A component's constructors behind one object: what the plan records and the run builds.
pub trait Constructors: Send + Sync {
    /// How many steps a block splits into for step-by-step streaming (1: it cannot).
    fn steps(&self) -> usize;
    /// How many of the largest steps make the bytes of the smallest block (rounded), less the
    /// one computing: how far ahead step-by-step streaming can copy while holding about the
    /// smallest block, so leaf level holds less than block level around every block kind
    /// (0 without steps).
    fn steps_ahead_in_a_block(&self) -> usize;
    /// How the component is held in `dtype` under `residency`, or as FSDP shards (see
    /// [`Holding::of`]).
    fn holding(&self, residency: Residency, fsdp: Option<Fsdp>, dtype: DType) -> Result<Holding>;
    /// The tensors the component's constructors ask for, laid out as `holding` holds them (see
    /// [`Holding::layout`]); checked against `weights` when given.
    fn layout(
        &self,
        holding: Holding,
        dtype: DType,
        weights: Option<&WeightSet>,
    ) -> Result<ComponentLayout>;
    /// Builds component `component` as `frame` places it: the frame holds what comes back and
    /// a [`Slot`] of the model's type reads it.
    fn load(&self, frame: &Frame, component: usize) -> Result<Box<dyn Loaded>>;
}

/// The constructors of a [`Blockwise`] model with its config.
pub struct ModelConstructors<M: Blockwise>(pub M::Config);

/// Bytes of what `build` asks for, in bf16 (0 where it fails: a ratio's guess, not a plan).
fn recorded_bytes(
    build: &dyn Fn(candle_nn::VarBuilder<'static>) -> candle_core::Result<()>,
) -> usize {
    crate::offload::record(None, DType::BF16, Packing::ByDtype, build)
        .map(|layout| layout.bytes)
        .unwrap_or(0)
}

/// Each block's bytes, in bf16.
fn block_bytes<M: Blockwise>(cfg: &M::Config) -> Vec<usize> {
    (0..M::num_blocks(cfg))
        .map(|i| recorded_bytes(&|vb| M::block(cfg, i, vb).map(drop)))
        .collect()
}

impl<M: Blockwise> Constructors for ModelConstructors<M> {
    fn steps(&self) -> usize {
        M::steps(&self.0)
    }

    fn load(&self, frame: &Frame, component: usize) -> Result<Box<dyn Loaded>> {
        Ok(Box::new(frame.build::<M>(component, &self.0)?))
    }

    fn steps_ahead_in_a_block(&self) -> usize {
        let cfg = &self.0;
        if M::steps(cfg) < 2 {
            return 0;
        }
        // The smallest block, and the largest step of any block (the slot size).
        let blocks = 0..M::num_blocks(cfg);
        let block = block_bytes::<M>(cfg).into_iter().min().unwrap_or(0);
        let step = blocks
            .flat_map(|i| (0..M::block_steps(cfg, i)).map(move |s| (i, s)))
            .map(|(i, s)| recorded_bytes(&|vb| M::block_step(cfg, i, s, vb).map(drop)))
            .max()
            .unwrap_or(0);
        ((block + step / 2) / step.max(1)).saturating_sub(1)
    }

    fn holding(&self, residency: Residency, fsdp: Option<Fsdp>, dtype: DType) -> Result<Holding> {
        Holding::of::<M>(&self.0, residency, fsdp, dtype)
    }

    fn layout(
        &self,
        holding: Holding,
        dtype: DType,
        weights: Option<&WeightSet>,
    ) -> Result<ComponentLayout> {
        holding.layout::<M>(&self.0, dtype, weights)
    }
}

/// One loadable component of a pipeline.
#[derive(Clone)]
pub struct ComponentSpec {
    /// Its name in reports: its folder in the diffusers layout (`text_encoder`,
    /// `transformer_2`, ...) unless it is a part of another's weights.
    pub name: &'static str,
    /// The folder its weights are read from.
    pub folder: &'static str,
    pub role: Role,
    /// The dtype it loads and runs in when not the run's (diffusers runs the Wan VAE in f32).
    pub dtype: Option<DType>,
    /// Safe to load late and free early: it only feeds tensors forward
    /// (FastVideo's `_lazy_module_names`).
    pub deferrable: bool,
    /// Module paths `--storage-dtype` leaves unrounded beyond diffusers' defaults: the model's
    /// `_skip_layerwise_casting_patterns` and `_keep_in_fp32_modules`
    /// ([`crate::models::blocks::Blockwise::LAYERWISE_CASTING_SKIP`]).
    pub storage_cast_skip: &'static [&'static str],
    /// Which keys of `--lora` files (`--lora-2` for `transformer_2`) change it: a DiT's, with
    /// the model's original (non-diffusers) layout that LoRA files use too (Wan's ComfyUI and
    /// kohya LoRAs, FLUX.1's kohya ones: mapped to diffusers' names); FLUX.1's CLIP's; none.
    pub lora: Option<crate::lora::Target>,
    /// Its constructors, which count and place its weights.
    pub constructors: Arc<dyn Constructors>,
}

impl ComponentSpec {
    /// The dtype the component's weights take in a run of `dtype`.
    pub fn dtype(&self, run: DType) -> DType {
        self.dtype.unwrap_or(run)
    }
}

/// A component of model `M` before it joins a spec: [`PipelineSpec::add`] turns it into `M`'s
/// typed slot, so a family declares each component once.
pub struct Component<M> {
    spec: ComponentSpec,
    model: PhantomData<fn() -> M>,
}

impl<M: Blockwise> Component<M> {
    /// Model `M` with config `cfg`, in the run's dtype, safe to defer (what most components are).
    pub fn new(name: &'static str, role: Role, cfg: M::Config) -> Self {
        Component {
            spec: ComponentSpec {
                name,
                folder: name,
                role,
                dtype: None,
                deferrable: true,
                storage_cast_skip: M::LAYERWISE_CASTING_SKIP,
                lora: (role == Role::Dit).then_some(crate::lora::Target::Transformer(None)),
                constructors: Arc::new(ModelConstructors::<M>(cfg)),
            },
            model: PhantomData,
        }
    }
}

impl<M> Component<M> {
    /// The component reads its weights from `folder` (a part of another component's weights,
    /// loaded and placed on its own).
    pub fn in_folder(mut self, folder: &'static str) -> Self {
        self.spec.folder = folder;
        self
    }

    /// The component loads and runs in `dtype` whatever the run's (diffusers runs the Wan VAE
    /// in f32).
    pub fn in_dtype(mut self, dtype: DType) -> Self {
        self.spec.dtype = Some(dtype);
        self
    }

    /// Its weights also go by `layout`, an original naming that LoRA files use too.
    pub fn with_original_layout(mut self, layout: crate::weights::original::Model) -> Self {
        self.spec.lora = Some(crate::lora::Target::Transformer(Some(layout)));
        self
    }
}

/// Where the frame holds a loaded component of model `M`: its index in the spec, typed.
pub struct Slot<M> {
    index: usize,
    model: PhantomData<fn() -> M>,
}

impl<M> Clone for Slot<M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M> Copy for Slot<M> {}

impl<M> Slot<M> {
    /// The component's index in [`PipelineSpec::components`].
    pub fn index(self) -> usize {
        self.index
    }
}

/// The components of a plain text-to-video pipeline, by diffusers' names: `text_encoder`,
/// `transformer` and `vae`, each in the run's dtype and safe to defer.
pub struct TextToVideo<T, D, V> {
    pub text_encoder: Slot<T>,
    pub transformer: Slot<D>,
    pub vae: Slot<V>,
}

/// A stage body of the family's pipeline `P` (see [`StageSpec::runs`]).
pub type Body<P> = fn(&P, &Frame, &mut Job) -> Result<()>;

/// The stage bodies of a family's part of a plain text-to-video pipeline
/// ([`TextToVideo::pipeline`]), one for each component in turn.
pub trait TextToVideoStages: 'static {
    /// Encodes the job's prompts; the embeddings wait for the denoise stage.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()>;
    /// Denoises the job's latents.
    fn denoise(&self, frame: &Frame, job: &mut Job) -> Result<()>;
    /// Decodes the job's latents into its frames.
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()>;
}

impl<T: Blockwise, D: Blockwise, V: Blockwise> TextToVideo<T, D, V> {
    /// The plain text-to-video pipeline `title` with its components' slots: the three
    /// components, configured by `configs`, then one stage for each in turn (`encode_text`,
    /// `denoise`, `decode`: the activations it holds and its body of the family's pipeline
    /// `P`) and `write`. The denoise stage also holds `dit.0`, the activations while the DiT's
    /// outer part computes apart ([`StageSpec::apart_activations`]), and `dit.1`, its blocks'
    /// bytes ([`StageSpec::holding_per_block`]).
    pub fn pipeline<P: TextToVideoStages>(
        title: &'static str,
        configs: (&T::Config, &D::Config, &V::Config),
        activations: [u64; 3],
        dit: (u64, Vec<u64>),
    ) -> (PipelineSpec, Self) {
        let mut spec = PipelineSpec::titled(title);
        let parts = TextToVideo {
            text_encoder: spec.add_model("text_encoder", Role::TextEncoder, configs.0),
            transformer: spec.add_model("transformer", Role::Dit, configs.1),
            vae: spec.add_model("vae", Role::Vae, configs.2),
        };
        let uses = [
            parts.text_encoder.index(),
            parts.transformer.index(),
            parts.vae.index(),
        ];
        let names = ["encode_text", "denoise", "decode"];
        let bodies: [Body<P>; 3] = [P::encode_text, P::denoise, P::decode];
        let (dit_apart, dit_block_bytes) = dit;
        spec.stages = (names.into_iter().zip(uses).zip(activations).zip(bodies))
            .map(|(((name, uses), activations), body)| {
                let stage = StageSpec::new(name, &[uses], activations);
                match name {
                    "denoise" => stage
                        .apart_activations(dit_apart)
                        .holding_per_block(dit_block_bytes.clone()),
                    _ => stage,
                }
                .runs(body)
            })
            .chain([StageSpec::write()])
            .collect();
        (spec, parts)
    }
}

/// A pipeline's two text encoders by diffusers' names, `text_encoder` and `text_encoder_2`
/// (FLUX's CLIP and T5, HunyuanVideo's Llama and CLIP), each in the run's dtype and safe to
/// defer, both used by its one `encode_text` stage.
pub struct TextEncoders<A, B> {
    pub text_encoder: Slot<A>,
    pub text_encoder_2: Slot<B>,
}

impl<A: Blockwise, B: Blockwise> TextEncoders<A, B> {
    /// Adds both, configured by `configs`, to `spec`.
    pub fn add(spec: &mut PipelineSpec, configs: (&A::Config, &B::Config)) -> Self {
        TextEncoders {
            text_encoder: spec.add_model("text_encoder", Role::TextEncoder, configs.0),
            text_encoder_2: spec.add_model("text_encoder_2", Role::TextEncoder, configs.1),
        }
    }

    /// The `encode_text` stage: both encoders, holding `activations`, running `body` of the
    /// family's pipeline `P`.
    pub fn stage<P: 'static>(&self, activations: u64, body: Body<P>) -> StageSpec {
        let uses = [self.text_encoder.index(), self.text_encoder_2.index()];
        StageSpec::new("encode_text", &uses, activations).runs(body)
    }
}

impl<A, B> Clone for TextEncoders<A, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A, B> Copy for TextEncoders<A, B> {}

impl<T, D, V> Clone for TextToVideo<T, D, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T, D, V> Copy for TextToVideo<T, D, V> {}

/// What a stage does for one job: the family's pipeline (its own state beside the frame), the
/// frame (components, config, device) and the job. Built by [`StageSpec::runs`].
#[derive(Clone)]
pub struct StageBody(Arc<BodyFn>);

/// A stage body with its family's pipeline type erased.
type BodyFn = dyn Fn(&dyn Any, &Frame, &mut Job) -> Result<()> + Send + Sync;

impl StageBody {
    /// Runs the stage.
    pub fn run(&self, family: &dyn Any, frame: &Frame, job: &mut Job) -> Result<()> {
        (self.0)(family, frame, job)
    }
}

impl std::fmt::Debug for StageBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StageBody")
    }
}

/// One step of a pipeline.
#[derive(Clone, Debug, Serialize)]
pub struct StageSpec {
    pub name: &'static str,
    /// Indices of the components it uses, into [`PipelineSpec::components`].
    pub uses: Vec<usize>,
    /// Device bytes of activations and scratch it is expected to hold at its peak, above the
    /// weights (0 on the CPU is still an estimate of host bytes).
    #[serde(skip)]
    pub activation_bytes: u64,
    /// Device bytes of activations while its DiT's outer part computes apart from the blocks
    /// (an outer part moved in per use), where the family estimates them; `None`: as many as
    /// `activation_bytes` (the plan's safe side).
    #[serde(skip)]
    pub apart_activation_bytes: Option<u64>,
    /// Device bytes each block of its DiT makes at its first use and keeps while it is built on
    /// the device (`--fp8-matmul`'s weight codes), in block order; empty where none. The plan
    /// adds those of the blocks held at once (every block of a DiT whole on the device, a
    /// streamed group's), the largest where it cannot tell which.
    #[serde(skip)]
    pub block_bytes: Vec<u64>,
    /// What it does; a stage without one (a plan's stand-in) fails when run.
    #[serde(skip)]
    pub body: Option<StageBody>,
}

impl StageSpec {
    pub fn new(name: &'static str, uses: &[usize], activation_bytes: u64) -> Self {
        StageSpec {
            name,
            uses: uses.to_vec(),
            activation_bytes,
            apart_activation_bytes: None,
            block_bytes: Vec::new(),
            body: None,
        }
    }

    /// Each block of the stage's DiT holds its entry of `bytes` while built
    /// ([`Self::block_bytes`]).
    pub fn holding_per_block(mut self, bytes: Vec<u64>) -> Self {
        self.block_bytes = bytes;
        self
    }

    /// Its DiT's outer part, computing apart from the blocks, holds `bytes` of activations
    /// ([`Self::apart_activation_bytes`]).
    pub fn apart_activations(mut self, bytes: u64) -> Self {
        self.apart_activation_bytes = Some(bytes);
        self
    }

    /// The stage runs `body` with the family's pipeline `P` (what [`Frame::open`] was given).
    pub fn runs<P: 'static>(
        mut self,
        body: impl Fn(&P, &Frame, &mut Job) -> Result<()> + Send + Sync + 'static,
    ) -> Self {
        let name = self.name;
        self.body = Some(StageBody(Arc::new(move |family, frame, job| {
            let family = family
                .downcast_ref::<P>()
                .with_context(|| format!("stage {name} run by another family's pipeline"))?;
            body(family, frame, job)
        })));
        self
    }

    /// The last stage of every family: the job's output written (its frames, or its latents
    /// with `--output-type latent`).
    pub fn write() -> Self {
        let mut stage = Self::new("write", &[], 0);
        stage.body = Some(StageBody(Arc::new(|_, frame, job| frame.write(job, None))));
        stage
    }
}

/// A pipeline as data.
#[derive(Clone)]
pub struct PipelineSpec {
    /// What it makes, in words ("Wan2.1 text-to-video").
    pub title: &'static str,
    pub components: Vec<ComponentSpec>,
    pub stages: Vec<StageSpec>,
}

impl PipelineSpec {
    /// A spec titled `title` with no components and no stages yet.
    pub fn titled(title: &'static str) -> Self {
        PipelineSpec {
            title,
            components: Vec::new(),
            stages: Vec::new(),
        }
    }

    /// Adds model `M` named `name` in the role `role`, with config `cfg`, in the run's dtype and
    /// safe to defer (what most components are); its slot.
    pub fn add_model<M: Blockwise>(
        &mut self,
        name: &'static str,
        role: Role,
        cfg: &M::Config,
    ) -> Slot<M> {
        self.add(Component::new(name, role, cfg.clone()))
    }

    /// Adds the modulation weights of the DiT configured by `cfg` (HunyuanVideo's, MiniMax
    /// H3's) as a component of their own, `transformer_modulations`, read from the
    /// transformer's folder (`transformer`'s, whose original layout they share): they run once
    /// before denoising, in their own stage.
    pub fn add_modulations<M: Blockwise, T>(
        &mut self,
        cfg: &M::Config,
        transformer: &Slot<T>,
    ) -> Slot<M> {
        let mut modulations = Component::new("transformer_modulations", Role::Dit, cfg.clone());
        modulations.spec.lora = self.components[transformer.index()].lora;
        self.add(modulations.in_folder("transformer"))
    }

    /// Adds a declared component; its slot.
    pub fn add<M>(&mut self, component: Component<M>) -> Slot<M> {
        self.components.push(component.spec);
        Slot {
            index: self.components.len() - 1,
            model: PhantomData,
        }
    }

    /// The names of components `indices`.
    pub fn names(&self, indices: &[usize]) -> Vec<&'static str> {
        indices.iter().map(|&i| self.components[i].name).collect()
    }

    /// The index of the component named `name`.
    pub fn component(&self, name: &str) -> Option<usize> {
        self.components.iter().position(|c| c.name == name)
    }

    /// The pipeline as a rank that does not lead its sequence-parallel group runs it: its stages
    /// use the DiTs alone (the leader encodes for the group, and decodes and writes), so no
    /// other component loads there. The components keep their indices.
    pub fn follower(mut self) -> Self {
        let components = &self.components;
        for stage in &mut self.stages {
            stage.uses.retain(|&c| components[c].role == Role::Dit);
        }
        self
    }

    /// The components some stage uses, in order: what a run loads.
    pub fn used(&self) -> Vec<usize> {
        (0..self.components.len())
            .filter(|c| self.stages.iter().any(|s| s.uses.contains(c)))
            .collect()
    }
}
