//! The Wan family as lists of stages, step for step as diffusers: Wan2.1 text-to-video
//! (`WanPipeline`), Wan2.1 image-to-video (`WanImageToVideoPipeline`: CLIP image tokens and
//! condition latents), Wan2.2 TI2V-5B (`expand_timesteps`: per-token timesteps, with or without
//! `--image`) and Wan2.2 A14B (`transformer` for high noise, `transformer_2` for low noise,
//! switched at `boundary_ratio`; T2V and I2V).

use super::jobs::Job;
use super::placement::{Blockwise, Held, Placed, Placement};
use super::progress::Progress;
use super::registry::{Configs, Family, ImageInput, RunShape};
use super::runner::Pipeline;
use super::spec::{ComponentSpec, PipelineSpec, Role, StageSpec};
use super::stages;
use crate::cli::resolve::ModelDefaults;
use crate::cli::ResolvedConfig;
use crate::models::clip::image_processor::{
    load_rgb_image, ClipImageProcessor, ClipImageProcessorConfig,
};
use crate::models::clip::{ClipVisionConfig, ClipVisionModel};
use crate::models::sequence_parallel::SequenceParallel;
use crate::models::source::{FileRef, ModelSource};
use crate::models::wan::activations;
use crate::models::wan::condition::{
    first_frame_condition, first_frame_mask, image_condition, per_token_timesteps,
    preprocess_image, replace_first_frame,
};
use crate::models::wan::prompt::{clean_prompt, PromptTokenizer};
use crate::models::wan::text_encoder::{
    attention_mask, zero_padding_rows, UMT5Block, UMT5Config, UMT5EncoderModel,
};
use crate::models::wan::transformer::{
    BlockStep, WanTransformer3DModel, WanTransformerBlock, WanTransformerConfig,
};
use crate::models::wan::vae::{AutoencoderKLWan, WanVaeConfig, WanVaeTiling};
use crate::schedulers::{self, Scheduler, SchedulerConfig};
use crate::weights::{seeded_normal, WeightSet};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// The text length diffusers' image cross-attention assumes (it splits the joint context at
/// `len - 512`).
const I2V_TEXT_LEN: usize = 512;

/// A component of the family, in the order the description lists the present ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    TextEncoder,
    ImageEncoder,
    Transformer,
    Transformer2,
    Vae,
}

/// A stage of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    EncodeText,
    EncodeImage,
    /// Every step with `transformer` (the high-noise steps of a two-expert model).
    Denoise,
    /// The low-noise steps, with `transformer_2`.
    DenoiseLow,
    Decode,
    Write,
}

/// Reads a Wan model's configs (the registry's entry point).
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    Ok(Box::new(WanConfigs::from_configs(configs)?))
}

impl Family for WanConfigs {
    fn latents_shape(&self, num_frames: u32, height: u32, width: u32) -> Option<Vec<usize>> {
        Some(self.latent_shape(num_frames, height, width).to_vec())
    }

    /// Text encoder, (image encoder,) DiT expert(s) and VAE (in f32, as diffusers runs it),
    /// each safe to defer: every component only feeds tensors forward. A two-expert model
    /// denoises in two stages, one per expert, so that a lazy load frees the first expert at
    /// the switch.
    fn sequence_parallel(&self) -> bool {
        true
    }

    fn spec(&self, shape: &RunShape) -> PipelineSpec {
        let parts = self.parts();
        let index = |p: Part| parts.iter().position(|q| *q == p);
        // Diffusers runs the Wan VAE and the CLIP image encoder in f32.
        let f32 = |c: ComponentSpec| ComponentSpec {
            dtype: Some(DType::F32),
            ..c
        };
        let component = |part: Part| match part {
            Part::TextEncoder => ComponentSpec::new::<UMT5EncoderModel>(
                "text_encoder",
                Role::TextEncoder,
                self.text_encoder.clone(),
            ),
            Part::ImageEncoder => f32(ComponentSpec::new::<ClipVisionModel>(
                "image_encoder",
                Role::ImageEncoder,
                self.image_encoder.clone().unwrap_or_default(),
            )),
            Part::Transformer => ComponentSpec::new::<WanTransformer3DModel>(
                "transformer",
                Role::Dit,
                self.transformer.clone(),
            ),
            Part::Transformer2 => ComponentSpec::new::<WanTransformer3DModel>(
                "transformer_2",
                Role::Dit,
                self.transformer_2
                    .clone()
                    .unwrap_or_else(|| self.transformer.clone()),
            ),
            Part::Vae => f32(ComponentSpec::new::<AutoencoderKLWan>(
                "vae",
                Role::Vae,
                self.vae.clone(),
            )),
        };
        let latent = self.latent_shape(shape.num_frames, shape.height, shape.width);
        let tiling = shape.vae_tiling.then(WanVaeTiling::default);
        // What the image stage encodes: the whole video (Wan2.1 I2V) or the first frame (TI2V).
        let encoded = if self.expand_timesteps {
            [latent[0], latent[1], 1, latent[3], latent[4]]
        } else {
            latent
        };
        let dit_activations = |cfg: &WanTransformerConfig| {
            activations::transformer_activations(cfg, latent, shape.text_len, shape.dtype)
        };
        let stages = self
            .steps(shape.image, shape.decode)
            .into_iter()
            .map(|step| {
                let (name, uses, activation_bytes): (_, Vec<Option<usize>>, _) = match step {
                    Step::EncodeText => (
                        "encode_text",
                        vec![index(Part::TextEncoder)],
                        activations::text_encoder_activations(
                            &self.text_encoder,
                            shape.text_len,
                            shape.dtype,
                        ),
                    ),
                    Step::EncodeImage => (
                        "encode_image",
                        vec![index(Part::ImageEncoder), index(Part::Vae)],
                        self.image_encoder_activations()
                            + activations::vae_decode_activations(&self.vae, encoded, None),
                    ),
                    Step::Denoise => (
                        if self.transformer_2.is_some() {
                            "denoise_high_noise"
                        } else {
                            "denoise"
                        },
                        vec![index(Part::Transformer)],
                        dit_activations(&self.transformer),
                    ),
                    Step::DenoiseLow => (
                        "denoise_low_noise",
                        vec![index(Part::Transformer2)],
                        dit_activations(self.transformer_2.as_ref().unwrap_or(&self.transformer)),
                    ),
                    Step::Decode => (
                        "decode",
                        vec![index(Part::Vae)],
                        activations::vae_decode_activations(&self.vae, latent, tiling.as_ref()),
                    ),
                    Step::Write => ("write", vec![], 0),
                };
                StageSpec {
                    name,
                    uses: uses.into_iter().flatten().collect(),
                    activation_bytes,
                }
            })
            .collect();
        PipelineSpec {
            title: self.title(),
            components: parts.into_iter().map(component).collect(),
            stages,
        }
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        serde_json::json!({
            "transformer_layers": self.transformer.num_layers,
            "transformer_inner_dim": self.transformer.inner_dim(),
            "latent_shape": self.latent_shape(shape.num_frames, shape.height, shape.width),
            "vae_scale_factor_spatial": self.vae.scale_factor_spatial(),
            "vae_scale_factor_temporal": self.vae.scale_factor_temporal(),
            "text_encoder_layers": self.text_encoder.num_layers,
            "experts": if self.transformer_2.is_some() { 2 } else { 1 },
            "boundary_ratio": self.boundary_ratio,
            "boundary_timestep": self.boundary_timestep(),
            "expand_timesteps": self.expand_timesteps,
            "image_to_video": self.image_to_video || (self.expand_timesteps && shape.image),
            "image_encoder_layers": self.image_encoder.as_ref().map(|c| c.num_hidden_layers),
        })
    }

    /// Wan2.2 TI2V-5B's published size and rate (704x1280, 121 frames at 24 fps); the others
    /// take diffusers' call defaults, which are vidgen's.
    fn defaults(&self) -> ModelDefaults {
        if self.expand_timesteps {
            ModelDefaults {
                height: Some(704),
                width: Some(1280),
                num_frames: Some(121),
                fps: Some(24),
                ..ModelDefaults::default()
            }
        } else {
            ModelDefaults::default()
        }
    }

    /// Wan2.1 I2V needs the first frame; Wan2.2 TI2V makes a video with it or without.
    fn image_input(&self) -> ImageInput {
        if self.image_to_video {
            ImageInput::Required
        } else if self.expand_timesteps {
            ImageInput::Optional
        } else {
            ImageInput::None
        }
    }

    fn inapplicable(&self, config: &ResolvedConfig) -> Option<String> {
        self.refusal(config).err()
    }

    /// The latents as diffusers returns them: before the VAE's normalization is undone, with
    /// TI2V's condition frame put back.
    fn latent_output(&self) -> bool {
        true
    }

    fn open(
        &self,
        config: ResolvedConfig,
        source: ModelSource,
        device: Device,
        progress: Arc<Progress>,
    ) -> Result<Box<dyn Pipeline<Job = Job>>> {
        Ok(Box::new(WanT2V::new(
            self.clone(),
            config,
            source,
            device,
            progress,
        )?))
    }
}

/// The configs of a Wan model: everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct WanConfigs {
    pub transformer: WanTransformerConfig,
    pub vae: WanVaeConfig,
    pub text_encoder: UMT5Config,
    pub scheduler: SchedulerConfig,
    /// The low-noise expert of Wan2.2 A14B.
    pub transformer_2: Option<WanTransformerConfig>,
    /// The CLIP vision tower of Wan2.1 I2V.
    pub image_encoder: Option<ClipVisionConfig>,
    pub image_processor: Option<ClipImageProcessorConfig>,
    /// `model_index.json`'s `boundary_ratio` (two experts).
    pub boundary_ratio: Option<f64>,
    /// `model_index.json`'s `expand_timesteps` (Wan2.2 TI2V: per-token timesteps).
    pub expand_timesteps: bool,
    /// `WanImageToVideoPipeline`: condition channels behind the noise, `--image` required.
    pub image_to_video: bool,
}

impl WanConfigs {
    /// The first setting of `config` this model cannot honour, as one line saying why (a flag it
    /// has no use for, an input it needs, a size it cannot patch).
    fn refusal(&self, config: &ResolvedConfig) -> std::result::Result<(), String> {
        let g = &config.generation;
        let title = self.title();
        let unit = self.vae.scale_factor_spatial() * self.transformer.patch_size[1].max(1);
        for (key, v) in [
            ("height", config.options.height),
            ("width", config.options.width),
        ] {
            if !(v as usize).is_multiple_of(unit) {
                let up = (v as usize).div_ceil(unit).max(1) * unit;
                return Err(format!(
                    "--{key} {v}: {title} needs a multiple of {unit} (VAE factor x patch); use e.g. {up}"
                ));
            }
        }
        if g.true_cfg_scale.is_some() {
            return Err(format!("--true-cfg-scale does not apply to {title}: Wan's --guidance-scale is real classifier-free guidance"));
        }
        if g.decode_timestep.is_some() || g.decode_noise_scale.is_some() {
            return Err(format!("--decode-timestep and --decode-noise-scale do not apply to {title}: its VAE decoder takes no timestep"));
        }
        if g.guidance_scale_2.is_some() && self.transformer_2.is_none() {
            return Err(format!("--guidance-scale-2 does not apply to {title}: it has one transformer (only Wan2.2 A14B switches experts)"));
        }
        if let Some(path) = g.image.as_ref().filter(|p| !p.is_file()) {
            return Err(format!(
                "--image {}: no such file (a PNG or JPEG)",
                path.display()
            ));
        }
        if g.image.is_some() && self.image_input() == ImageInput::None {
            return Err(format!("--image does not apply to {title}: it is a text-to-video model (use an image-to-video or TI2V model)"));
        }
        if self.image_encoder.is_some()
            && self.transformer.has_image_branch()
            && g.max_sequence_length != I2V_TEXT_LEN
        {
            return Err(format!(
                "--max-sequence-length {}: {title} needs {I2V_TEXT_LEN} (diffusers splits the image and text context at length - {I2V_TEXT_LEN})",
                g.max_sequence_length
            ));
        }
        Ok(())
    }

    /// Reads every component's config of `source`.
    pub fn read(source: &ModelSource) -> Result<Self> {
        Self::from_configs(Configs::Fetch(source))
    }

    /// Reads every component's config.
    pub fn from_configs(configs: Configs) -> Result<Self> {
        let index: serde_json::Value = configs.read("model_index.json")?;
        let present = |key: &str| {
            index[key]
                .as_array()
                .and_then(|a| a.first())
                .is_some_and(|v| !v.is_null())
        };
        let image_to_video = index["_class_name"].as_str() == Some("WanImageToVideoPipeline");
        let image_encoder = if present("image_encoder") {
            Some(configs.read("image_encoder/config.json")?)
        } else {
            None
        };
        let image_processor = if present("image_processor") {
            Some(configs.read("image_processor/preprocessor_config.json")?)
        } else {
            None
        };
        let transformer_2 = if present("transformer_2") {
            Some(configs.read("transformer_2/config.json")?)
        } else {
            None
        };
        Ok(WanConfigs {
            transformer: configs.read("transformer/config.json")?,
            vae: configs.read("vae/config.json")?,
            text_encoder: configs.read("text_encoder/config.json")?,
            scheduler: configs.read("scheduler/scheduler_config.json")?,
            transformer_2,
            image_encoder,
            image_processor,
            boundary_ratio: index["boundary_ratio"].as_f64(),
            expand_timesteps: index["expand_timesteps"].as_bool().unwrap_or(false),
            image_to_video,
        })
    }

    /// The latent shape `[1, C, F', H', W']` for a video size (noise channels only).
    pub fn latent_shape(&self, num_frames: u32, height: u32, width: u32) -> [usize; 5] {
        let t = self.vae.scale_factor_temporal();
        let s = self.vae.scale_factor_spatial();
        [
            1,
            self.transformer.out_channels(),
            (num_frames as usize - 1) / t + 1,
            height as usize / s,
            width as usize / s,
        ]
    }

    /// The pipeline's name in messages.
    pub fn title(&self) -> &'static str {
        match (
            self.transformer_2.is_some(),
            self.expand_timesteps,
            self.image_to_video,
        ) {
            (true, _, true) => "Wan2.2 A14B image-to-video",
            (true, _, false) => "Wan2.2 A14B text-to-video",
            (false, true, _) => "Wan2.2 TI2V",
            (false, false, true) => "Wan2.1 image-to-video",
            (false, false, false) => "Wan2.1 text-to-video",
        }
    }

    /// `boundary_ratio * num_train_timesteps` where there are two experts: steps at or above it
    /// run `transformer`, the others `transformer_2`.
    pub fn boundary_timestep(&self) -> Option<f64> {
        self.transformer_2.as_ref()?;
        Some(self.boundary_ratio.unwrap_or(0.0) * self.scheduler.num_train_timesteps as f64)
    }

    /// Whether a run with (`image`) or without an image conditions on it.
    fn conditions_on_image(&self, image: bool) -> bool {
        self.image_to_video || (self.expand_timesteps && image)
    }

    fn parts(&self) -> Vec<Part> {
        let mut parts = vec![Part::TextEncoder];
        if self.image_encoder.is_some() {
            parts.push(Part::ImageEncoder);
        }
        parts.push(Part::Transformer);
        if self.transformer_2.is_some() {
            parts.push(Part::Transformer2);
        }
        parts.push(Part::Vae);
        parts
    }

    /// The stages of a run with (`image`) or without an image, that decodes or (`--output-type
    /// latent`) writes the latents.
    fn steps(&self, image: bool, decode: bool) -> Vec<Step> {
        let mut steps = vec![Step::EncodeText];
        if self.conditions_on_image(image) {
            steps.push(Step::EncodeImage);
        }
        steps.push(Step::Denoise);
        if self.transformer_2.is_some() {
            steps.push(Step::DenoiseLow);
        }
        if decode {
            steps.push(Step::Decode);
        }
        steps.push(Step::Write);
        steps
    }

    /// A rough peak of the CLIP tower's forward: a few copies of the token stream and one
    /// layer's intermediates and scores, in f32.
    fn image_encoder_activations(&self) -> u64 {
        self.image_encoder.as_ref().map_or(0, |c| {
            let n = c.num_positions() as u64;
            let d = c.hidden_size as u64;
            let heads = c.num_attention_heads as u64;
            4 * (6 * n * d + n * c.intermediate_size as u64 + 2 * heads * n * n)
        })
    }
}

/// Denoising state that waits between the two experts' stages.
struct Denoising {
    scheduler: Box<dyn Scheduler>,
    latents: Tensor,
    next_step: usize,
    forward_seconds: Vec<f64>,
}

/// What the image stage made for one job.
struct Conditioning {
    /// CLIP image tokens (Wan2.1 I2V).
    image_embeds: Option<Tensor>,
    /// Wan2.1 I2V / A14B I2V: `[mask | latent]` channels behind the noise; TI2V: the first
    /// latent frame.
    condition: Tensor,
}

/// A Wan model with its loaded components.
pub struct WanT2V {
    config: ResolvedConfig,
    source: ModelSource,
    configs: WanConfigs,
    spec: PipelineSpec,
    parts: Vec<Part>,
    steps: Vec<Step>,
    device: Device,
    tokenizer: PromptTokenizer,
    placement: Placement,
    text_encoder: Option<Placed<UMT5EncoderModel>>,
    image_encoder: Option<Placed<ClipVisionModel>>,
    transformer: Option<Placed<WanTransformer3DModel>>,
    transformer_2: Option<Placed<WanTransformer3DModel>>,
    vae: Option<Placed<AutoencoderKLWan>>,
    /// Per job (by index): the image stage's output and the denoising between the experts.
    conditioning: HashMap<usize, Conditioning>,
    denoising: HashMap<usize, Denoising>,
    /// When the last high-noise stage ended and no low-noise forward has run since: the start
    /// of an expert switch (once per group of a stage-major batch, once per prompt otherwise).
    switch_started: Option<Instant>,
    progress: Arc<Progress>,
}

impl WanT2V {
    /// Reads the tokenizer; loads no weights.
    pub fn new(
        configs: WanConfigs,
        config: ResolvedConfig,
        source: ModelSource,
        device: Device,
        progress: Arc<Progress>,
    ) -> Result<Self> {
        let shape = RunShape::of(&config);
        let spec = configs.spec(&shape);
        // A rank that does not lead its sequence-parallel group loads the DiTs alone.
        let spec = match &config.ranks {
            Some(ranks) if !ranks.leads() => spec.follower(),
            _ => spec,
        };
        let tokenizer = match source.require("tokenizer/tokenizer.json")? {
            FileRef::Path(p) => PromptTokenizer::from_file(&p)?,
            FileRef::Embedded(text) => PromptTokenizer::from_json(text)?,
        };
        let placement = Placement::new(&config.memory, &spec);
        Ok(WanT2V {
            placement,
            parts: configs.parts(),
            steps: configs.steps(shape.image, shape.decode),
            config,
            source,
            configs,
            spec,
            device,
            tokenizer,
            text_encoder: None,
            image_encoder: None,
            transformer: None,
            transformer_2: None,
            vae: None,
            conditioning: HashMap::new(),
            denoising: HashMap::new(),
            switch_started: None,
            progress,
        })
    }

    /// The model configs.
    pub fn configs(&self) -> &WanConfigs {
        &self.configs
    }

    /// The prompt embeddings `[1, L, text_dim]` of each text, zero padded past its length
    /// (`_get_t5_prompt_embeds`), with the encoder's blocks resident or streamed. Each block
    /// runs on every text in turn, so a streamed encoder's weights pass through once for all of
    /// them, and each text's result is what encoding it alone gives.
    fn embed(&self, encoder: &Held<'_, UMT5EncoderModel>, texts: &[&str]) -> Result<Vec<Tensor>> {
        let max_len = self.config.generation.max_sequence_length;
        let model = encoder.model();
        let device = model.device();
        let (mut hidden, mut masks, mut lens) = (Vec::new(), Vec::new(), Vec::new());
        for text in texts {
            let (ids, seq_len) = self.tokenizer.encode(&clean_prompt(text), max_len)?;
            let ids = Tensor::new(ids.as_slice(), &device)?.unsqueeze(0)?;
            masks.push(attention_mask(&[seq_len], max_len, &device)?);
            hidden.push(model.embed(&ids)?);
            lens.push(seq_len);
        }
        let hidden = encoder.fold_blocks_each(
            UMT5EncoderModel::blocks,
            hidden,
            |block: &UMT5Block, i, h| block.forward(h, &masks[i]),
        )?;
        hidden
            .iter()
            .zip(&lens)
            .map(|(h, len)| {
                Ok(zero_padding_rows(&model.final_norm(h)?, &[*len])?
                    .to_dtype(self.config.dtype())?)
            })
            .collect()
    }

    /// Encodes the prompts (once per sequence-parallel group: its leader encodes, the others
    /// receive the embeddings); the embeddings wait for the denoise stage in host memory, so a
    /// stage-major batch holds no device memory between stages.
    fn encode_text(&self, job: &mut Job) -> Result<()> {
        let usage = || self.text_encoder.as_ref().and_then(Placed::offload_usage);
        let before = usage();
        let ranks = self.config.ranks.as_ref();
        let embeds = crate::parallel::once_per_group(ranks, &self.device, || {
            let placed = self
                .text_encoder
                .as_ref()
                .context("text encoder not loaded")?;
            let encoder = placed.hold()?;
            let mut texts = vec![job.prompt.as_str()];
            if job.guidance_scale > 1.0 {
                texts.push(job.negative_prompt.as_str());
            }
            self.embed(&encoder, &texts)
        })?;
        let mut embeds = embeds.into_iter().map(|t| t.to_device(&Device::Cpu));
        job.prompt_embeds = Some(embeds.next().context("no prompt embeddings")??);
        job.negative_embeds = embeds.next().transpose()?;
        stages::report_offload(&self.progress, job, "offload_text_encoder", before, usage());
        Ok(())
    }

    /// The image stage: the condition latents (`prepare_latents`) and CLIP image tokens (where
    /// the model has an image encoder), made once per sequence-parallel group as the text's
    /// embeddings are, kept in host memory until the denoise stage.
    fn encode_image(&mut self, job: &mut Job) -> Result<()> {
        // A TI2V prompt without an image is text-to-video (`check_images` made sure the
        // image-to-video models have one for every prompt).
        let Some(path) = &job.image else {
            return Ok(());
        };
        let ranks = self.config.ranks.as_ref();
        // The leader's two parts, timed apart: the `encode_image_seconds` metric.
        let mut seconds = serde_json::Map::new();
        let made = crate::parallel::once_per_group(ranks, &self.device, || {
            self.condition_on(path, job, &mut seconds)
        })?;
        if !seconds.is_empty() {
            job.metrics
                .insert("encode_image_seconds".into(), seconds.into());
        }
        let mut made = made.into_iter().map(|t| t.to_device(&Device::Cpu));
        let condition = made.next().context("no condition latents")??;
        self.conditioning.insert(
            job.index,
            Conditioning {
                image_embeds: made.next().transpose()?,
                condition,
            },
        );
        Ok(())
    }

    /// The condition latents of the image at `path` for `job`, then its CLIP image tokens where
    /// the model has an image encoder; the seconds each took go in `seconds`.
    fn condition_on(
        &self,
        path: &std::path::Path,
        job: &Job,
        seconds: &mut serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<Tensor>> {
        let img = load_rgb_image(path)?;
        let dtype = self.config.dtype();
        let start = Instant::now();
        let image_embeds = match (&self.image_encoder, &self.configs.image_processor) {
            (Some(placed), processor) => {
                let held = placed.hold()?;
                let model = held.model();
                let processor = ClipImageProcessor::new(&processor.clone().unwrap_or_default())?;
                let pixels = processor.preprocess(&img, &self.device)?;
                let embeds = model.last_hidden_state(&pixels)?.to_dtype(dtype)?;
                self.device.synchronize()?;
                seconds.insert("image_encoder".into(), start.elapsed().as_secs_f64().into());
                Some(embeds)
            }
            (None, _) => None,
        };
        let start = Instant::now();
        let held = self.vae.as_ref().context("VAE not loaded")?.hold()?;
        let vae = held.model();
        let image = preprocess_image(
            &img,
            job.height as usize,
            job.width as usize,
            self.configs.vae.scale_factor_spatial(),
            &self.device,
        )?;
        let condition = if self.configs.expand_timesteps {
            first_frame_condition(vae, &image, 1, dtype)?
        } else {
            image_condition(vae, &image, job.num_frames as usize, 1, dtype)?
        };
        self.device.synchronize()?;
        seconds.insert("vae_encode".into(), start.elapsed().as_secs_f64().into());
        Ok([Some(condition), image_embeds]
            .into_iter()
            .flatten()
            .collect())
    }

    fn initial_latents(&self, job: &Job) -> Result<Tensor> {
        let shape = self
            .configs
            .latent_shape(job.num_frames, job.height, job.width);
        match &self.config.generation.latents {
            Some(path) => {
                let tensors = candle_core::safetensors::load(path, &Device::Cpu)
                    .with_context(|| format!("reading --latents {}", path.display()))?;
                let tensor = match tensors.get("latents") {
                    Some(t) => t.clone(),
                    None if tensors.len() == 1 => tensors
                        .into_values()
                        .next()
                        .unwrap_or_else(|| unreachable!()),
                    None => bail!(
                        "--latents {} has no tensor named `latents` and more than one tensor",
                        path.display()
                    ),
                };
                if tensor.dims() != shape {
                    bail!(
                        "--latents {} has shape {:?} but this run needs {:?} ([1, channels, (frames-1)/{}+1, height/{}, width/{}])",
                        path.display(),
                        tensor.dims(),
                        shape,
                        self.configs.vae.scale_factor_temporal(),
                        self.configs.vae.scale_factor_spatial(),
                        self.configs.vae.scale_factor_spatial()
                    );
                }
                Ok(tensor.to_dtype(DType::F32)?.to_device(&self.device)?)
            }
            None => Ok(seeded_normal(job.seed, &shape)?.to_device(&self.device)?),
        }
    }

    /// The denoising steps of one expert: every step for a one-expert model; for two experts,
    /// `low` = false runs the steps at or above the boundary with `transformer` and
    /// `guidance_scale`, `low` = true the rest with `transformer_2` and `guidance_scale_2`
    /// (one scheduler across both, as diffusers).
    fn denoise(&mut self, job: &mut Job, low: bool) -> Result<()> {
        let state = self.denoising.remove(&job.index);
        let switch_started = if low {
            self.switch_started.take()
        } else {
            None
        };
        let state = self.denoise_steps(job, low, state, switch_started)?;
        if self.configs.transformer_2.is_some() && !low {
            self.switch_started = Some(Instant::now());
            self.denoising.insert(job.index, state);
        } else {
            self.conditioning.remove(&job.index);
        }
        Ok(())
    }

    /// `switch_started`: when the expert switch before this low-noise stage began; the time
    /// until its first forward starts (releasing and loading experts as the load policy says,
    /// moving the latents, readying the first streamed blocks) is the job's `expert_switch`
    /// metric, with the number of forwards before it.
    fn denoise_steps(
        &self,
        job: &mut Job,
        low: bool,
        state: Option<Denoising>,
        switch_started: Option<Instant>,
    ) -> Result<Denoising> {
        let state = match state {
            Some(state) => state,
            None => {
                let scheduler = schedulers::build(
                    self.config.generation.scheduler,
                    &self.configs.scheduler,
                    job.num_inference_steps as usize,
                    self.config.generation.flow_shift,
                )?;
                Denoising {
                    scheduler,
                    latents: self.initial_latents(job)?,
                    next_step: 0,
                    forward_seconds: Vec::new(),
                }
            }
        };
        let Denoising {
            mut scheduler,
            latents,
            next_step,
            mut forward_seconds,
        } = state;
        // Latents wait in host memory between the experts' stages.
        let mut latents = latents.to_device(&self.device)?;
        let placed = if low {
            self.transformer_2
                .as_ref()
                .context("transformer_2 not loaded")?
        } else {
            self.transformer
                .as_ref()
                .context("transformer not loaded")?
        };
        let before = placed.offload_usage();
        let model = &placed.hold()?;
        let dtype = self.config.dtype();
        let cond = job
            .prompt_embeds
            .as_ref()
            .context("prompt not encoded")?
            .to_device(&self.device)?;
        let cond = &cond;
        let uncond = match &job.negative_embeds {
            Some(t) => Some(t.to_device(&self.device)?),
            None => None,
        };
        let guidance = if low {
            self.config
                .generation
                .guidance_scale_2
                .unwrap_or(job.guidance_scale)
        } else {
            job.guidance_scale
        };
        let conditioning = self.conditioning.get(&job.index);
        let image_embeds = match conditioning.and_then(|c| c.image_embeds.as_ref()) {
            Some(t) => Some(t.to_device(&self.device)?),
            None => None,
        };
        let condition = match conditioning {
            Some(c) => Some(c.condition.to_device(&self.device)?),
            None => None,
        };
        // Wan2.2 TI2V: the first-frame mask (ones without an image) for per-token timesteps.
        let [_, _, frames, lh, lw] =
            self.configs
                .latent_shape(job.num_frames, job.height, job.width);
        let mask = if !self.configs.expand_timesteps {
            None
        } else if condition.is_some() {
            Some(first_frame_mask(
                frames,
                (lh, lw),
                DType::F32,
                &self.device,
            )?)
        } else {
            Some(Tensor::ones(
                (1, 1, frames, lh, lw),
                DType::F32,
                &self.device,
            )?)
        };
        let [_, ph, pw] = self.configs.transformer.patch_size;
        let timesteps = scheduler.timesteps().to_vec();
        let boundary = self.configs.boundary_timestep();
        let mut i = next_step;
        while i < timesteps.len() {
            let t = timesteps[i];
            if !low && boundary.is_some_and(|b| t < b) {
                break;
            }
            crate::pipeline::interrupt::check()?;
            if let (Some(start), true) = (switch_started, i == next_step) {
                job.metrics.insert(
                    "expert_switch".into(),
                    serde_json::json!({
                        "seconds": start.elapsed().as_secs_f64(),
                        "after_forward": forward_seconds.len(),
                    }),
                );
            }
            let input = match (&condition, &mask) {
                (Some(c), Some(m)) => replace_first_frame(&latents, c, m)?.to_dtype(dtype)?,
                (Some(c), None) => {
                    Tensor::cat(&[&latents.to_dtype(dtype)?, &c.to_dtype(dtype)?], 1)?
                }
                _ => latents.to_dtype(dtype)?,
            };
            let timestep = match &mask {
                Some(m) => per_token_timesteps(t, m, 1, (ph, pw))?,
                None => Tensor::new(&[t as f32], &self.device)?,
            };
            let image = image_embeds.as_ref();
            let sequence = self.config.ranks.as_ref().map(|r| &r.sequence);
            let noise_cond = stages::timed(&self.device, &mut forward_seconds, || {
                dit_forward(model, &input, &timestep, cond, image, sequence)
            })?;
            let noise = match &uncond {
                Some(uncond) => {
                    let noise_uncond = stages::timed(&self.device, &mut forward_seconds, || {
                        dit_forward(model, &input, &timestep, uncond, image, sequence)
                    })?;
                    // diffusers combines in the transformer dtype.
                    let diff = (&noise_cond - &noise_uncond)?;
                    (noise_uncond + (diff * guidance)?)?
                }
                None => noise_cond,
            };
            latents = scheduler.step(&noise, &latents)?.to_dtype(DType::F32)?;
            stages::step_done(&self.progress, &latents, i + 1, timesteps.len())?;
            i += 1;
        }
        let key = if low {
            "offload_transformer_2"
        } else {
            "offload"
        };
        stages::report_offload(&self.progress, job, key, before, placed.offload_usage());
        let last = self.configs.transformer_2.is_none() || low;
        if !last {
            return Ok(Denoising {
                scheduler,
                latents: latents.to_device(&Device::Cpu)?,
                next_step: i,
                forward_seconds,
            });
        }
        job.metrics
            .insert("forward_seconds".into(), serde_json::json!(forward_seconds));
        self.progress.note(&format!(
            "  transformer forwards: {}",
            forward_seconds
                .iter()
                .map(|s| format!("{s:.3}s"))
                .collect::<Vec<_>>()
                .join(" ")
        ));
        // Wan2.2 TI2V image-to-video: frame 0 is the condition after the loop too.
        if let (Some(c), Some(m)) = (&condition, &mask) {
            latents = replace_first_frame(&latents, c, m)?;
        }
        job.latents = Some(latents.to_device(&Device::Cpu)?);
        job.prompt_embeds = None;
        job.negative_embeds = None;
        Ok(Denoising {
            scheduler,
            latents: Tensor::zeros(1, DType::F32, &Device::Cpu)?,
            next_step: i,
            forward_seconds: Vec::new(),
        })
    }

    /// Builds a component from its weights, placed as the options say.
    fn load_component(&mut self, component: usize) -> Result<()> {
        let loader = stages::loader!(self);
        match self.parts[component] {
            Part::TextEncoder => {
                self.text_encoder = Some(loader.build(component, &self.configs.text_encoder)?)
            }
            Part::ImageEncoder => {
                let cfg = self.configs.image_encoder.clone().unwrap_or_default();
                self.image_encoder = Some(loader.build(component, &cfg)?);
            }
            Part::Transformer if self.fsdp().is_some() => {
                let weights = loader.weights(component)?;
                let placed =
                    self.shard(&self.configs.transformer, &weights, loader.dtype(component));
                self.transformer = Some(placed.with_context(|| loader.what(component))?);
            }
            Part::Transformer => {
                self.transformer = Some(loader.build(component, &self.configs.transformer)?)
            }
            Part::Transformer2 => {
                let cfg = self
                    .configs
                    .transformer_2
                    .clone()
                    .unwrap_or_else(|| self.configs.transformer.clone());
                self.transformer_2 = Some(loader.build(component, &cfg)?);
            }
            Part::Vae => self.vae = Some(loader.build(component, &self.configs.vae)?),
        }
        Ok(())
    }

    /// Whether this rank follows the leader of its sequence-parallel group.
    fn follows(&self) -> bool {
        self.config.ranks.as_ref().is_some_and(|r| !r.leads())
    }

    /// The group the DiT is sharded over (`--use-fsdp-inference` on a rank of several).
    fn fsdp(&self) -> Option<&Arc<dyn crate::parallel::collective::Collective>> {
        let ranks = self.config.ranks.as_ref()?;
        self.config
            .memory
            .use_fsdp_inference
            .then_some(&ranks.group)
    }

    /// Builds a DiT with its blocks as this rank's FSDP flat shards (in host memory with
    /// `--dit-cpu-offload`), gathered `--prefetch-depth` blocks ahead.
    fn shard(
        &self,
        cfg: &WanTransformerConfig,
        weights: &WeightSet,
        dtype: DType,
    ) -> Result<Placed<WanTransformer3DModel>> {
        let group = self.fsdp().context("FSDP without a group")?.clone();
        let ranks = group.world_size();
        let m = &self.config.memory;
        let placed = Placed::load_sharded(
            cfg,
            weights,
            group,
            dtype,
            &self.device,
            m.dit_cpu_offload,
            m.block_depth(),
        )?;
        self.progress.note(&format!(
            "transformer: FSDP, 1/{ranks} of every block on this GPU{}",
            if m.dit_cpu_offload {
                " (in host memory)"
            } else {
                ""
            }
        ));
        Ok(placed)
    }

    fn decode(&self, job: &mut Job) -> Result<()> {
        let held = self.vae.as_ref().context("VAE not loaded")?.hold()?;
        let vae = held.model();
        let latents = job.latents.take().context("nothing denoised")?;
        let z = vae.denormalize(&latents.to_dtype(DType::F32)?.to_device(&self.device)?)?;
        // [1, 3, T, H, W] in [-1, 1]
        let video = if self.config.memory.vae_tiling {
            vae.decode_tiled(&z, &WanVaeTiling::default())?
        } else {
            vae.decode(&z)?
        };
        job.frames = Some(stages::video_frames(video)?);
        Ok(())
    }
}

impl Pipeline for WanT2V {
    type Job = Job;

    fn spec(&self) -> &PipelineSpec {
        &self.spec
    }

    fn load(&mut self, component: usize) -> Result<()> {
        self.load_component(component)
    }

    fn release(&mut self, component: usize) {
        match self.parts[component] {
            Part::TextEncoder => self.text_encoder = None,
            Part::ImageEncoder => self.image_encoder = None,
            Part::Transformer => self.transformer = None,
            Part::Transformer2 => self.transformer_2 = None,
            Part::Vae => self.vae = None,
        }
    }

    fn run_stage(&mut self, index: usize, job: &mut Job) -> Result<()> {
        let result = match self.steps[index] {
            Step::EncodeText => self.encode_text(job),
            Step::EncodeImage => self.encode_image(job),
            Step::Denoise => self.denoise(job, false),
            Step::DenoiseLow => self.denoise(job, true),
            // The group's leader decodes and writes the video.
            Step::Decode if self.follows() => {
                job.latents = None;
                Ok(())
            }
            Step::Write if self.follows() => {
                job.written = true;
                Ok(())
            }
            Step::Decode => self.decode(job),
            Step::Write => stages::write_video(&self.config, job),
        };
        if result.is_err() {
            self.denoising.remove(&job.index);
            self.conditioning.remove(&job.index);
        }
        result
    }
}

/// One DiT forward (with the CLIP image tokens of Wan2.1 I2V): prepare, the blocks (resident or
/// streamed), finish; on a rank of a sequence-parallel run (`sequence`), the blocks run on the
/// rank's share of the tokens and their output is gathered before `finish`.
pub fn dit_forward(
    dit: &Held<'_, WanTransformer3DModel>,
    latents: &Tensor,
    timestep: &Tensor,
    text: &Tensor,
    image: Option<&Tensor>,
    sequence: Option<&Arc<dyn SequenceParallel>>,
) -> candle_core::Result<Tensor> {
    let model = dit.model();
    let mut inputs = model.prepare_with_image(latents, timestep, text, image)?;
    let mut share = sequence
        .map(|sp| inputs.split_sequence(sp.clone()))
        .transpose()?;
    let x = match &mut share {
        Some(share) => share.take_hidden_states()?,
        None => inputs.take_hidden_states()?,
    };
    let at = share.as_ref().unwrap_or(&inputs);
    let x = dit.fold_blocks(WanTransformer3DModel::blocks, x, |block, x| {
        block.forward(x, at)
    })?;
    model.finish(&at.gather_sequence(&x)?, &inputs)
}

impl Blockwise for WanTransformer3DModel {
    type Config = WanTransformerConfig;
    type Block = WanTransformerBlock;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self> {
        Self::new(cfg, vb)
    }
    fn outer(cfg: &Self::Config, vb: VarBuilder, _: VarBuilder) -> candle_core::Result<Self> {
        Self::new_without_blocks(cfg, vb)
    }
    fn num_blocks(cfg: &Self::Config) -> usize {
        cfg.num_layers
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> candle_core::Result<Self::Block> {
        WanTransformerBlock::new(cfg, vb.pp(format!("blocks.{i}")))
    }
    fn steps(_: &Self::Config) -> usize {
        BlockStep::ALL.len()
    }
    fn block_step(
        cfg: &Self::Config,
        i: usize,
        step: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<Self::Block> {
        WanTransformerBlock::with_steps(cfg, vb.pp(format!("blocks.{i}")), &[BlockStep::ALL[step]])
    }
}

crate::placed_whole!(AutoencoderKLWan, WanVaeConfig, AutoencoderKLWan::new);

crate::placed_whole!(
    ClipVisionModel,
    ClipVisionConfig,
    ClipVisionModel::new_penultimate
);
