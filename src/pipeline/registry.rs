//! Which family runs a model: `model_index.json`'s `_class_name` (what diffusers loads it
//! as; a modular pipeline's `modular_model_index.json`) maps to a family, one line each. A
//! family reads its configs into a [`Family`]; the frame asks it for its description and, to
//! run, for a pipeline.

use super::frame::{Frame, T5Pipeline};
use super::spec::{PipelineSpec, TextToVideo, TextToVideoStages};
use super::{allegro, cogvideox, flux, hunyuan_video, latte, ltx, minimax_h3, mochi, wan_t2v};
use crate::config::{ModelDefaults, Prompts, ResolvedConfig};
use crate::models::blocks::Blockwise;
use crate::models::cogvideox::activations::text_encoder_activations;
use crate::models::source::ModelSource;
use crate::models::step_cache::{AttentionModules, CacheSpec, HookedBlocks};
use crate::models::t5::encoder::T5Config;
use crate::models::t5::encoder::T5EncoderModel;
use crate::models::video::{DecodeActivations, DenoiseActivations, VideoDit, VideoVae};
use crate::output::OutputType;
use crate::schedulers::SchedulerKind;
use anyhow::{Context, Result};
use candle_core::DType;
use serde::de::DeserializeOwned;
use std::any::Any;

/// The draws of a run that takes one: its initial latents, of `shape`.
pub fn latents_draw(shape: &[usize]) -> Vec<(&'static str, Vec<usize>)> {
    vec![("latents", shape.to_vec())]
}

/// What the description of a run depends on: sizes that set activation estimates.
#[derive(Clone, Debug, PartialEq)]
pub struct RunShape {
    pub dtype: DType,
    pub num_frames: u32,
    pub height: u32,
    pub width: u32,
    /// Text tokens per prompt (`--max-sequence-length`).
    pub text_len: usize,
    pub vae_tiling: bool,
    /// The VAE's tiles in pixels where not its default (`--vae-tile-size`).
    pub vae_tile_size: Option<u32>,
    /// The DiT runs in low-activation mode (`--low-activation`).
    pub low_activation: bool,
    /// Whether the run conditions on `--image`.
    pub image: bool,
    /// Whether the VAE decodes the latents (not with `--output-type latent`).
    pub decode: bool,
    /// The step cache (`--cache`), whose held states depend on the model's blocks.
    pub cache: Option<CacheSpec>,
    /// The DiT blocks' Linears run as fp8 matmuls (`--fp8-matmul`).
    pub fp8_matmul: bool,
    /// The DiTs' attention computes in 8 bits (`--attention sage`).
    pub sage_attention: bool,
    /// Classifier-free guidance may run (a guidance scale above 1, the low-noise expert's
    /// included, or a prompt file, whose lines may set one): a family that batches its passes
    /// forwards two prompts at once.
    pub guided: bool,
}

impl RunShape {
    /// Prompts in one forward of a DiT that batches the guided `[negative; positive]` pair
    /// (where its passes run apart, the passes of a step): two with guidance, one without.
    pub fn guidance_batch(&self) -> usize {
        if self.guided {
            2
        } else {
            1
        }
    }

    /// What `--fp8-matmul` adds to a denoise stage where it is on: `inputs()`, the bytes it adds
    /// to a forward's activations, and `codes()`, each block's weight codes
    /// ([`super::spec::StageSpec::holding_per_block`]); nothing where it is off.
    pub fn fp8_bytes(
        &self,
        inputs: impl FnOnce() -> u64,
        codes: impl FnOnce() -> Vec<u64>,
    ) -> (u64, Vec<u64>) {
        if self.fp8_matmul {
            (inputs(), codes())
        } else {
            (0, Vec::new())
        }
    }

    /// Device bytes the run's step cache holds through the denoising loop in a transformer
    /// whose blocks it sees as `hooked`: its hidden states, each one prompt's block state of
    /// `tokens` tokens of width `dim`, and PAB's attention outputs of a transformer of
    /// `modules`, each of `prompts` prompts (2 where guidance is batched into one forward, 1
    /// where its passes run apart and share PAB's outputs).
    pub fn cache_bytes(
        &self,
        (tokens, dim): (usize, usize),
        (modules, hooked): (AttentionModules, &HookedBlocks),
        prompts: usize,
    ) -> u64 {
        let states = self.cache_states(hooked) + prompts * self.pab_outputs(modules);
        (states * tokens * dim * self.dtype.size_in_bytes()) as u64
    }

    /// The hidden states the step cache holds in a transformer whose blocks it sees as
    /// `hooked` (PAB's attention outputs apart).
    pub fn cache_states(&self, hooked: &HookedBlocks) -> usize {
        self.cache.as_ref().map_or(0, |c| c.held_states(hooked))
    }

    /// The attention outputs (one prompt's each) PAB holds in a transformer of `modules`.
    pub fn pab_outputs(&self, modules: AttentionModules) -> usize {
        match &self.cache {
            Some(CacheSpec::Pab(c)) => c.held_outputs(modules),
            _ => 0,
        }
    }

    /// The shape of a resolved run.
    pub fn of(config: &ResolvedConfig) -> Self {
        let (v, g) = (config.video(), config.generation());
        RunShape {
            dtype: config.dtype(),
            num_frames: v.num_frames,
            height: v.height,
            width: v.width,
            text_len: g.max_sequence_length,
            vae_tiling: config.memory().vae_tiling,
            vae_tile_size: config.memory().vae_tile_size,
            low_activation: config.memory().low_activation,
            image: g.image.is_some() || g.line_images,
            decode: config.output().kind != OutputType::Latent,
            cache: g.cache.clone(),
            fp8_matmul: g.fp8_matmul,
            sage_attention: g.attention == crate::models::sage_attention::AttentionKind::Sage,
            guided: v.guidance_scale > 1.0
                || g.guidance_scale_2.is_some_and(|s| s > 1.0)
                || matches!(g.prompts, Some(Prompts::File(_))),
        }
    }
}

/// Whether a model conditions on an image.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ImageInput {
    /// Text-to-video only.
    None,
    /// With an image or without (Wan2.2 TI2V: image-to-video or text-to-video per prompt).
    Optional,
    /// Image-to-video only: every prompt needs one.
    Required,
}

/// An option only some families honour. Each family lists those it takes
/// ([`About::options`]); [`refusal`] refuses the others in one sentence.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FamilyOption {
    Image,
    GuidanceScale,
    GuidanceScale2,
    TrueCfgScale,
    NegativePrompt,
    MaxSequenceLength,
    FlowShift,
    Sigmas,
    DecodeTimestep,
    DecodeNoiseScale,
    VaeTiling,
    VaeTileSize,
    Lora,
    Lora2,
    Transformer2,
    StorageDtype,
    Cache,
    Pab,
    TaylorSeer,
    LowActivation,
}

impl FamilyOption {
    /// Every option, in the order refusals check them.
    pub const ALL: [FamilyOption; 20] = [
        FamilyOption::Image,
        FamilyOption::GuidanceScale,
        FamilyOption::GuidanceScale2,
        FamilyOption::TrueCfgScale,
        FamilyOption::NegativePrompt,
        FamilyOption::MaxSequenceLength,
        FamilyOption::FlowShift,
        FamilyOption::Sigmas,
        FamilyOption::DecodeTimestep,
        FamilyOption::DecodeNoiseScale,
        FamilyOption::VaeTiling,
        FamilyOption::VaeTileSize,
        FamilyOption::Lora,
        FamilyOption::Lora2,
        FamilyOption::Transformer2,
        FamilyOption::StorageDtype,
        FamilyOption::Cache,
        FamilyOption::Pab,
        FamilyOption::TaylorSeer,
        FamilyOption::LowActivation,
    ];

    /// The options every text-to-video family with classifier-free guidance takes.
    pub const GUIDED: [FamilyOption; 3] = [
        FamilyOption::GuidanceScale,
        FamilyOption::NegativePrompt,
        FamilyOption::MaxSequenceLength,
    ];

    /// The flag as typed.
    pub fn flag(self) -> &'static str {
        match self {
            FamilyOption::Image => "--image",
            FamilyOption::GuidanceScale => "--guidance-scale",
            FamilyOption::GuidanceScale2 => "--guidance-scale-2",
            FamilyOption::TrueCfgScale => "--true-cfg-scale",
            FamilyOption::NegativePrompt => "--negative-prompt",
            FamilyOption::MaxSequenceLength => "--max-sequence-length",
            FamilyOption::FlowShift => "--flow-shift",
            FamilyOption::Sigmas => "--sigmas",
            FamilyOption::DecodeTimestep => "--decode-timestep",
            FamilyOption::DecodeNoiseScale => "--decode-noise-scale",
            FamilyOption::VaeTiling => "--vae-tiling",
            FamilyOption::VaeTileSize => "--vae-tile-size",
            FamilyOption::Lora => "--lora",
            FamilyOption::Lora2 => "--lora-2",
            FamilyOption::Transformer2 => "--transformer-2",
            FamilyOption::StorageDtype => "--storage-dtype",
            FamilyOption::Cache => "--cache first-block / magcache",
            FamilyOption::Pab => "--cache pab",
            FamilyOption::TaylorSeer => "--cache taylorseer",
            FamilyOption::LowActivation => "--low-activation",
        }
    }

    /// What the option sets, for the refusal's reader.
    fn purpose(self) -> &'static str {
        match self {
            FamilyOption::Image => "it conditions an image-to-video model on a first frame",
            FamilyOption::GuidanceScale => {
                "it scales classifier-free guidance, which a guidance-distilled model does not run"
            }
            FamilyOption::GuidanceScale2 => {
                "it guides the low-noise expert of a model with two transformers (Wan2.2 A14B)"
            }
            FamilyOption::TrueCfgScale => {
                "it turns on real classifier-free guidance in a guidance-distilled model (HunyuanVideo)"
            }
            FamilyOption::NegativePrompt => {
                "it is encoded for classifier-free guidance, which a guidance-distilled model does not run"
            }
            FamilyOption::MaxSequenceLength => {
                "it pads or truncates prompts to a length, and this model encodes each prompt whole"
            }
            FamilyOption::FlowShift => {
                "it shifts a flow-matching schedule, and this model's schedule comes from its own configs"
            }
            FamilyOption::Sigmas => {
                "it sets the flow-matching schedule's sigmas, which this model's diffusers pipeline takes none of (the Wan family's, FLUX.1's and HunyuanVideo's take them)"
            }
            FamilyOption::DecodeTimestep | FamilyOption::DecodeNoiseScale => {
                "it conditions LTX-Video's timestep-aware VAE decoder"
            }
            FamilyOption::VaeTiling => "this model's VAE decodes without spatial tiles",
            FamilyOption::VaeTileSize => {
                "vidgen sizes the tiles of the Wan family's VAE so far (the others take their configs' tiles)"
            }
            FamilyOption::Lora => "vidgen reads LoRAs for the transformers whose diffusers pipelines load them so far",
            FamilyOption::Lora2 | FamilyOption::Transformer2 => {
                "it changes the second expert of a model with two transformers (Wan2.2 A14B)"
            }
            FamilyOption::StorageDtype => {
                "vidgen stores in fp8 the transformers of the families whose diffusers models it runs (MiniMax H3's is not diffusers')"
            }
            FamilyOption::Cache => {
                "diffusers' cache hooks take the blocks of the Wan, CogVideoX, LTX-Video, HunyuanVideo, Mochi and FLUX.1 transformers, not this one's"
            }
            FamilyOption::Pab => {
                "it reuses attention outputs inside the blocks, which vidgen hooks in every transformer but MiniMax H3's so far"
            }
            FamilyOption::TaylorSeer => {
                "vidgen runs TaylorSeer in the Wan, CogVideoX, LTX-Video, HunyuanVideo, Mochi and FLUX.1 transformers, whose diffusers pipelines open the cache context its state needs"
            }
            FamilyOption::LowActivation => {
                "vidgen runs the Wan family's transformer by chunks of tokens so far"
            }
        }
    }

    /// Whether the user gave the option.
    fn given(self, config: &ResolvedConfig) -> bool {
        let g = config.generation();
        let given = |key: &str| config.given(key);
        match self {
            FamilyOption::Image => g.image.is_some(),
            FamilyOption::GuidanceScale => given("guidance_scale"),
            FamilyOption::GuidanceScale2 => g.guidance_scale_2.is_some(),
            FamilyOption::TrueCfgScale => g.true_cfg_scale.is_some(),
            FamilyOption::NegativePrompt => given("negative_prompt"),
            FamilyOption::MaxSequenceLength => given("max_sequence_length"),
            FamilyOption::FlowShift => g.flow_shift.is_some(),
            FamilyOption::Sigmas => g.sigmas.is_some(),
            FamilyOption::DecodeTimestep => g.decode_timestep.is_some(),
            FamilyOption::DecodeNoiseScale => g.decode_noise_scale.is_some(),
            FamilyOption::VaeTiling => given("vae_tiling") && config.memory().vae_tiling,
            FamilyOption::VaeTileSize => given("vae_tile_size"),
            FamilyOption::Lora => !g.loras[0].is_empty(),
            FamilyOption::Lora2 => !g.loras[1].is_empty(),
            FamilyOption::Transformer2 => g.transformer_files[1].is_some(),
            FamilyOption::StorageDtype => g.storage_dtype.is_some(),
            FamilyOption::Cache => matches!(
                g.cache,
                Some(CacheSpec::FirstBlock { .. } | CacheSpec::Mag(_))
            ),
            FamilyOption::Pab => matches!(g.cache, Some(CacheSpec::Pab(_))),
            FamilyOption::TaylorSeer => matches!(g.cache, Some(CacheSpec::TaylorSeer(_))),
            FamilyOption::LowActivation => config.memory().low_activation,
        }
    }
}

/// What a family declares about a model once: what it makes, what the user may change and
/// the published pipeline's call defaults ([`Family::about`]).
#[derive(Clone, Debug, Default)]
pub struct About {
    /// What it makes, in words ("CogVideoX text-to-video").
    pub title: &'static str,
    /// The options of [`FamilyOption`] this model honours; [`refusal`] refuses the others.
    pub options: Vec<FamilyOption>,
    /// The samplers `--scheduler` may pick (none: the model samples with its own scheduler).
    pub schedulers: &'static [SchedulerKind],
    /// The published pipeline's call defaults where they differ from vidgen's (Wan2.1's),
    /// its frame rule among them.
    pub defaults: ModelDefaults,
    /// The transformer's blocks as its step caches see them, where it takes TaylorSeer (whose
    /// patterns name modules: those it matches must be among these blocks' modules).
    pub cache_blocks: Option<HookedBlocks>,
}

impl About {
    /// A family titled `title` that takes the options of classifier-free guidance
    /// ([`FamilyOption::GUIDED`]) and its `own`, with vidgen's defaults and its own sampler.
    pub fn guided(title: &'static str, own: &[FamilyOption]) -> Self {
        About {
            title,
            options: [&FamilyOption::GUIDED[..], own].concat(),
            ..About::default()
        }
    }
}

/// A model family with its configs read: everything the frame needs to plan, report and run it.
pub trait Family {
    /// What the family declares about this model.
    fn about(&self) -> About;
    /// What it makes, in words ([`About::title`]).
    fn title(&self) -> &'static str {
        self.about().title
    }
    /// The published pipeline's call defaults ([`About::defaults`]), saying whether it samples
    /// with its own scheduler.
    fn defaults(&self) -> ModelDefaults {
        let about = self.about();
        ModelDefaults {
            own_sampler: about.schedulers.is_empty(),
            ..about.defaults
        }
    }
    /// The first value the user gave that this model cannot take (a size it cannot patch, a
    /// missing input file), as one line saying why (a run and a dry run refuse it as bad
    /// input, before any work). Options it has no use for at all are [`About::options`]'.
    fn inapplicable(&self, _config: &ResolvedConfig) -> Option<String> {
        None
    }
    /// Why this model cannot make a video of `num_frames` frames of `height` x `width`, if it
    /// cannot: each prompt's size (a `.jsonl` line's as well as the flags') is checked before
    /// anything loads, in a dry run too.
    fn size_refusal(&self, _num_frames: u32, _height: u32, _width: u32) -> Option<String> {
        None
    }
    /// Whether `--output-type latent` is supported: the pipeline leaves out its decode stage
    /// and writes the latents diffusers' `output_type="latent"` returns.
    fn latent_output(&self) -> bool {
        false
    }
    /// Whether the model takes a conditioning image (`--image`, a `.jsonl` line's `image`).
    fn image_input(&self) -> ImageInput {
        ImageInput::None
    }
    /// The draws a run of this size takes from `--latents`, by name with the shape each must
    /// have, checked before anything loads (a family that draws more checks the rest itself,
    /// or when it takes them).
    fn draws(
        &self,
        _num_frames: u32,
        _height: u32,
        _width: u32,
    ) -> Vec<(&'static str, Vec<usize>)> {
        Vec::new()
    }
    /// Whether its DiT splits each video's tokens across GPUs (`--sp-size` above 1).
    fn sequence_parallel(&self) -> bool {
        false
    }
    /// The pipeline as data for a run of `shape`.
    fn spec(&self, shape: &RunShape) -> PipelineSpec;
    /// The model's geometry for the dry run's `model` object (layers, widths, latent shape).
    fn facts(&self, shape: &RunShape) -> serde_json::Value;
    /// The family's own part of the runnable pipeline on `frame` (tokenizers and configs read;
    /// no weights loaded): the first argument of its stage bodies.
    fn open(&self, frame: &Frame) -> Result<Box<dyn Any>>;
}

/// [`Family::spec`] and [`Family::open`] of a family declared at once: its `declare(&self,
/// shape)` gives the pipeline of a run's shape as data with its components' slots, and
/// `$new(configs, slots, frame)` its own part of a run (tokenizers read, no weights loaded),
/// which the stage bodies get. A T5 video family names its part instead of a `declare`,
/// `declared_by!($new, stages $pipeline)` ([`T5VideoPipeline::declare`]), and takes one draw,
/// its initial latents ([`Family::draws`]).
macro_rules! declared_by {
    ($new:expr) => {
        $crate::pipeline::registry::declared_by!(@declare $new, |configs: &Self, shape| {
            configs.declare(shape)
        });
    };
    ($new:expr, stages $pipeline:ty) => {
        fn draws(&self, num_frames: u32, height: u32, width: u32) -> Vec<(&'static str, Vec<usize>)> {
            $crate::pipeline::registry::latents_draw(&self.latent_shape(num_frames, height, width))
        }

        $crate::pipeline::registry::declared_by!(@declare $new, |configs: &Self, shape| {
            <$pipeline>::declare(configs, shape)
        });
    };
    (@declare $new:expr, $declare:expr) => {
        fn spec(
            &self,
            shape: &$crate::pipeline::registry::RunShape,
        ) -> $crate::pipeline::spec::PipelineSpec {
            ($declare)(self, shape).0
        }

        fn open(
            &self,
            frame: &$crate::pipeline::frame::Frame,
        ) -> anyhow::Result<Box<dyn std::any::Any>> {
            let shape = $crate::pipeline::registry::RunShape::of(&frame.config);
            let (_, parts) = ($declare)(self, &shape);
            Ok(Box::new(($new)(self.clone(), parts, frame)?))
        }
    };
}
pub(crate) use declared_by;

/// Where configs are read from: the model (downloading if needed), or only what is on disk
/// (a dry run never downloads).
#[derive(Clone, Copy)]
pub enum Configs<'a> {
    Fetch(&'a ModelSource),
    OnDisk(&'a ModelSource),
}

impl Configs<'_> {
    /// A config file, parsed; a file that does not parse names itself and the problem.
    pub fn read<T: DeserializeOwned>(&self, rel: &str) -> Result<T> {
        match *self {
            Configs::Fetch(source) => source.json(rel),
            Configs::OnDisk(source) => {
                let value = source.cached_json(rel).with_context(|| {
                    format!("{rel} of {source} is not on disk (a dry run never downloads)")
                })?;
                serde_json::from_value(value).with_context(|| format!("{rel} of {source}"))
            }
        }
    }
}

/// The configs of a plain T5 text-to-video model: `transformer`, `vae`, a T5 `text_encoder` and
/// `scheduler` (diffusers' names); everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct T5VideoConfigs<D, V, S> {
    pub transformer: D,
    pub vae: V,
    pub text_encoder: T5Config,
    pub scheduler: S,
}

impl<D: DeserializeOwned, V: DeserializeOwned, S: DeserializeOwned> T5VideoConfigs<D, V, S> {
    /// Reads every component's config.
    pub fn from_configs(configs: Configs) -> Result<Self> {
        Ok(T5VideoConfigs {
            transformer: configs.read("transformer/config.json")?,
            vae: configs.read("vae/config.json")?,
            text_encoder: configs.read("text_encoder/config.json")?,
            scheduler: configs.read("scheduler/scheduler_config.json")?,
        })
    }

    /// Reads the model's configs as its family (the registry's entry point of a family that
    /// checks nothing more).
    pub fn read(configs: Configs) -> Result<Box<dyn Family>>
    where
        Self: Family + 'static,
    {
        Ok(Box::new(Self::from_configs(configs)?))
    }
}

impl<D: VideoDit, V: VideoVae, S> T5VideoConfigs<D, V, S> {
    /// The latent grid `[F', H', W']` of a video size ([`VideoVae::latent_grid`]).
    pub fn grid(&self, num_frames: u32, height: u32, width: u32) -> [usize; 3] {
        self.vae.latent_grid(num_frames, height, width)
    }

    /// The shape of the latents of a video size ([`VideoDit::latent_shape`] of its grid).
    pub fn latent_shape(&self, num_frames: u32, height: u32, width: u32) -> [usize; 5] {
        let grid = self.grid(num_frames, height, width);
        self.transformer.latent_shape(grid)
    }

    /// The dry run's `model` facts every T5 video family reports for a run of `shape` (its
    /// transformer's size, the latents' `latent_shape`, the VAE's spatial factor and the text
    /// encoder's layers), with the family's `own`.
    pub fn facts_with(&self, shape: &RunShape, own: serde_json::Value) -> serde_json::Value {
        let latent_shape = self.latent_shape(shape.num_frames, shape.height, shape.width);
        let mut facts = serde_json::json!({
            "transformer_layers": self.transformer.dit_shape().num_layers,
            "transformer_inner_dim": self.transformer.dit_shape().hidden_dim,
            "latent_shape": latent_shape,
            "vae_scale_factor_spatial": self.vae.compression().1,
            "text_encoder_layers": self.text_encoder.num_layers,
        });
        if let (Some(facts), serde_json::Value::Object(own)) = (facts.as_object_mut(), own) {
            facts.extend(own);
        }
        facts
    }
}

/// The components of a T5 video pipeline with the DiT `D` and the VAE `V`.
pub type T5Parts<D, V> = TextToVideo<T5EncoderModel, D, V>;

/// A T5 video family's own part of its pipeline: its configs `C`, the slots of its DiT `D` and
/// VAE `V` ([`T5Parts`]), its tokenizer.
pub type T5VideoPipeline<C, D, V> = T5Pipeline<C, T5Parts<D, V>>;

impl<D, V, S, DM, VM> T5VideoPipeline<T5VideoConfigs<D, V, S>, DM, VM>
where
    D: VideoDit + DenoiseActivations + Clone,
    V: VideoVae + DecodeActivations,
    DM: Blockwise<Config = D>,
    VM: Blockwise<Config = V>,
    T5VideoConfigs<D, V, S>: Family,
    Self: TextToVideoStages,
{
    /// The family's pipeline for a run of `shape` as data with its components' slots: T5, DiT
    /// and VAE (each in the run's dtype, as diffusers loads them), each used by one stage of
    /// this part and safe to defer, holding the activations their configs estimate.
    pub fn declare(
        configs: &T5VideoConfigs<D, V, S>,
        shape: &RunShape,
    ) -> (PipelineSpec, T5Parts<DM, VM>) {
        let grid = configs.grid(shape.num_frames, shape.height, shape.width);
        // One forward runs the guided pair where guidance is on.
        let (dtype, text_len, batch) = (shape.dtype, shape.text_len, shape.guidance_batch());
        let T5VideoConfigs {
            transformer,
            vae,
            text_encoder,
            ..
        } = configs;
        let transformer = &transformer.in_fp8(shape.fp8_matmul);
        // Each block built on the device keeps its fp8 weight codes.
        let (fp8, block_codes) = shape.fp8_bytes(
            || transformer.fp8_activations(grid, text_len, batch),
            || transformer.fp8_block_codes(),
        );
        // A step cache's states are held through the loop.
        let cache = shape.cache_bytes(
            transformer.block_state(grid, text_len),
            (
                transformer.attention_modules(),
                &transformer.hooked_blocks(),
            ),
            batch,
        );
        T5Parts::pipeline::<Self>(
            configs.title(),
            (text_encoder, transformer, vae),
            [
                text_encoder_activations(text_encoder, text_len, dtype),
                transformer.denoise_activations(grid, text_len, batch, dtype) + fp8 + cache,
                vae.decode_activations(grid, shape.vae_tiling, dtype),
            ],
            (
                transformer.outer_activations(grid, text_len, batch, dtype) + cache,
                block_codes,
            ),
        )
    }
}

/// One family: the `_class_name`s it runs and how it reads a model's configs.
pub struct FamilyEntry {
    pub class_names: &'static [&'static str],
    pub read: fn(Configs) -> Result<Box<dyn Family>>,
}

/// Every family vidgen runs.
pub const FAMILIES: &[FamilyEntry] = &[
    FamilyEntry {
        class_names: &["WanPipeline", "WanImageToVideoPipeline"],
        read: wan_t2v::read,
    },
    FamilyEntry {
        class_names: &["LTXPipeline"],
        read: ltx::read,
    },
    FamilyEntry {
        class_names: &["CogVideoXPipeline"],
        read: cogvideox::CogVideoXConfigs::read,
    },
    FamilyEntry {
        class_names: &["HunyuanVideoPipeline"],
        read: hunyuan_video::read,
    },
    FamilyEntry {
        class_names: &[minimax_h3::CLASS_NAME],
        read: minimax_h3::read,
    },
    FamilyEntry {
        class_names: &["LattePipeline"],
        read: latte::LatteConfigs::read,
    },
    FamilyEntry {
        class_names: &["MochiPipeline"],
        read: mochi::read,
    },
    FamilyEntry {
        class_names: &["AllegroPipeline"],
        read: allegro::AllegroConfigs::read,
    },
    FamilyEntry {
        class_names: &["FluxPipeline"],
        read: flux::read,
    },
];

/// A model whose pipeline no family runs: bad input, named with what vidgen does run.
#[derive(Debug, thiserror::Error)]
#[error("model_index.json names a {class:?} pipeline, which vidgen does not run yet; pass a model of {known}")]
pub struct UnsupportedPipeline {
    class: String,
    known: String,
}

/// The first option of `config` that `family` cannot honour, as one line saying why: the
/// options it does not take, a sampler it does not run, then the family's own checks.
pub fn refusal(family: &dyn Family, config: &ResolvedConfig) -> Option<String> {
    let About {
        title,
        options,
        schedulers,
        ..
    } = family.about();
    if config.output().kind == OutputType::Latent && !family.latent_output() {
        return Some(format!(
            "--output-type latent is not supported for {title}; use safetensors, png or mp4"
        ));
    }
    if let Some(option) = FamilyOption::ALL
        .into_iter()
        .find(|o| o.given(config) && !options.contains(o))
    {
        return Some(format!(
            "{} does not apply to {title}: {}; drop the flag",
            option.flag(),
            option.purpose()
        ));
    }
    if config.generation().fp8_matmul && config.dtype() == DType::F16 {
        return Some(
            "--fp8-matmul with --dtype f16: fp8 matmuls compute in bf16 or f32 (their f32 sums overflow f16); use --dtype bf16".into(),
        );
    }
    let memory = config.memory();
    let by_step =
        memory.sequential_cpu_offload || (memory.dit_layerwise_offload && memory.leaf_level);
    if config.generation().cache.is_some() && by_step {
        return Some(
            "--cache with --sequential-cpu-offload or --offload-type leaf-level: a step cache acts between whole blocks, which these stream one step at a time; stream block groups (--dit-layerwise-offload) instead".into(),
        );
    }
    let scheduler = config.generation().scheduler;
    // A family with a choice of samplers takes `--sigmas` on its flow-matching Euler one (one
    // without samples with its own, which takes them).
    if config.generation().sigmas.is_some()
        && !schedulers.is_empty()
        && scheduler != SchedulerKind::Euler
    {
        return Some(format!(
            "--sigmas sets the schedule of the flow-matching Euler sampler (diffusers' FlowMatchEulerDiscreteScheduler), not of --scheduler {}; add --scheduler euler",
            scheduler.name()
        ));
    }
    if config.given("scheduler") && !schedulers.contains(&scheduler) {
        let runs = match schedulers {
            [] => "its own scheduler".to_string(),
            kinds => kinds
                .iter()
                .map(|k| format!("--scheduler {}", k.name()))
                .collect::<Vec<_>>()
                .join(" or "),
        };
        return Some(format!(
            "--scheduler {} does not apply to {title}: it samples with {runs}; drop the flag",
            scheduler.name()
        ));
    }
    family.inapplicable(config)
}

/// The family of a model, with its configs read.
pub fn family(configs: Configs) -> Result<Box<dyn Family>> {
    // A modular pipeline (MiniMax H3) has `modular_model_index.json` instead.
    let index: serde_json::Value = configs
        .read("model_index.json")
        .or_else(|e| configs.read("modular_model_index.json").map_err(|_| e))?;
    let class = index["_class_name"].as_str().unwrap_or("");
    match FAMILIES.iter().find(|f| f.class_names.contains(&class)) {
        Some(entry) => (entry.read)(configs),
        None => {
            let known: Vec<&str> = FAMILIES
                .iter()
                .flat_map(|f| f.class_names.iter().copied())
                .collect();
            Err(UnsupportedPipeline {
                class: class.to_string(),
                known: known.join(", "),
            }
            .into())
        }
    }
}
