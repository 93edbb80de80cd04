//! The Wan family as lists of stages, step for step as diffusers: Wan2.1 text-to-video
//! (`WanPipeline`), Wan2.1 image-to-video (`WanImageToVideoPipeline`: CLIP image tokens and
//! condition latents), Wan2.2 TI2V-5B (`expand_timesteps`: per-token timesteps, with or without
//! `--image`) and Wan2.2 A14B (`transformer` for high noise, `transformer_2` for low noise,
//! switched at `boundary_ratio`; T2V and I2V).

use super::denoise::Denoise;
use super::frame::Frame;
use super::jobs::Job;
use super::placement::Held;
use super::registry::FamilyOption::{
    Cache, FlowShift, GuidanceScale2, Image, Lora, Lora2, LowActivation, Pab, Sigmas, StorageDtype,
    TaylorSeer, Transformer2, VaeTileSize, VaeTiling,
};
use super::registry::{declared_by, latents_draw, About, Configs, Family, ImageInput, RunShape};
use super::spec::{Component, PipelineSpec, Role, Slot, StageSpec};
use super::stages;
use crate::config::{ModelDefaults, ResolvedConfig};
use crate::models::clip::image_processor::{
    load_rgb_image, ClipImageProcessor, ClipImageProcessorConfig,
};
use crate::models::clip::{ClipVisionConfig, ClipVisionModel};
use crate::models::guidance::guide;
use crate::models::sequence_parallel::SequenceParallel;
use crate::models::source::ModelSource;
use crate::models::step_cache::{AttentionModules, Forward, HiddenStates, Pass, StepCache};
use crate::models::video::causal_latent_grid;
use crate::models::wan::activations;
use crate::models::wan::condition::{
    first_frame_condition, first_frame_mask, image_condition, per_token_timesteps,
    preprocess_image, replace_first_frame,
};
use crate::models::wan::prompt::{clean_prompt, PromptTokenizer};
use crate::models::wan::text_encoder::{
    attention_mask, zero_padding_rows, UMT5Block, UMT5Config, UMT5EncoderModel,
};
use crate::models::wan::transformer::{WanTransformer3DModel, WanTransformerConfig};
use crate::models::wan::vae::{AutoencoderKLWan, WanVaeConfig, WanVaeTiling};
use crate::rng::TorchGenerator;
use crate::schedulers::{self, Scheduler, SchedulerConfig, SchedulerKind};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::cell::Cell;
use std::sync::Arc;
use std::time::Instant;

/// The text length diffusers' image cross-attention assumes (it splits the joint context at
/// `len - 512`).
const I2V_TEXT_LEN: usize = 512;

/// The components of a Wan pipeline (the image encoder of Wan2.1 I2V, the low-noise expert of
/// Wan2.2 A14B where the model has them).
#[derive(Clone, Copy)]
struct Parts {
    text_encoder: Slot<UMT5EncoderModel>,
    image_encoder: Option<Slot<ClipVisionModel>>,
    transformer: Slot<WanTransformer3DModel>,
    transformer_2: Option<Slot<WanTransformer3DModel>>,
    vae: Slot<AutoencoderKLWan>,
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
    /// Classifier-free guidance, a flow shift and custom sigmas, a VAE that tiles (in tiles of
    /// any size), LoRAs and the low-activation DiT; the first frame where the model takes one, the low-noise expert's guidance and LoRAs where it
    /// has two. Wan2.2 TI2V-5B's published size and rate (704x1280, 121 frames at 24 fps); the
    /// others take diffusers' call defaults, which are vidgen's.
    fn about(&self) -> About {
        let two_experts = self.transformer_2.is_some();
        let title = match (two_experts, self.expand_timesteps, self.image_to_video) {
            (true, _, true) => "Wan2.2 A14B image-to-video",
            (true, _, false) => "Wan2.2 A14B text-to-video",
            (false, true, _) => "Wan2.2 TI2V",
            (false, false, true) => "Wan2.1 image-to-video",
            (false, false, false) => "Wan2.1 text-to-video",
        };
        let mut options = vec![
            FlowShift,
            Sigmas,
            VaeTiling,
            VaeTileSize,
            Lora,
            StorageDtype,
            Cache,
            Pab,
            TaylorSeer,
            LowActivation,
        ];
        if self.image_input() != ImageInput::None {
            options.push(Image);
        }
        if two_experts {
            options.extend([GuidanceScale2, Lora2, Transformer2]);
        }
        About {
            schedulers: &[SchedulerKind::UniPc, SchedulerKind::Euler],
            cache_blocks: Some(self.transformer.hooked_blocks()),
            defaults: match self.expand_timesteps {
                true => ModelDefaults::video(704, 1280, 121, 24),
                false => ModelDefaults::default(),
            },
            ..About::guided(title, &options)
        }
    }

    fn draws(&self, num_frames: u32, height: u32, width: u32) -> Vec<(&'static str, Vec<usize>)> {
        latents_draw(&self.latent_shape(num_frames, height, width))
    }

    /// Text encoder, (image encoder,) DiT expert(s) and VAE (in f32, as diffusers runs it),
    /// each safe to defer: every component only feeds tensors forward. A two-expert model
    /// denoises in two stages, one per expert, so that a lazy load frees the first expert at
    /// the switch.
    fn sequence_parallel(&self) -> bool {
        true
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

    declared_by!(WanT2V::new);
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
    /// The first setting of `config` this model cannot honour, as one line saying why (an input
    /// it needs, a size it cannot patch).
    fn refusal(&self, config: &ResolvedConfig) -> std::result::Result<(), String> {
        let g = config.generation();
        let title = self.title();
        let unit = self.vae.scale_factor_spatial() * self.transformer.patch_size[1].max(1);
        for (key, v) in [
            ("height", config.video().height),
            ("width", config.video().width),
        ] {
            if !(v as usize).is_multiple_of(unit) {
                let up = (v as usize).div_ceil(unit).max(1) * unit;
                return Err(format!(
                    "--{key} {v}: {title} needs a multiple of {unit} (VAE factor x patch); use e.g. {up}"
                ));
            }
        }
        if g.cache.is_some() && config.groups().sp > 1 {
            return Err(format!(
                "--cache with --sp-size {}: a step cache decides on the whole sequence, which sequence parallelism splits; run it on one GPU per video",
                config.groups().sp
            ));
        }
        if let Some(path) = &g.image {
            crate::config::files::check_image(path).map_err(|why| {
                format!("--image {}: {why}; pass a PNG or JPEG file", path.display())
            })?;
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
        let (t, s) = (
            self.vae.scale_factor_temporal(),
            self.vae.scale_factor_spatial(),
        );
        let [f, h, w] = causal_latent_grid(num_frames, height, width, t, s);
        [1, self.transformer.out_channels(), f, h, w]
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

    /// Text encoder, (image encoder,) DiT expert(s) and VAE (in f32, as diffusers runs it), each
    /// safe to defer: every component only feeds tensors forward. A two-expert model denoises
    /// in two stages, one per expert, so that a lazy load frees the first expert at the switch.
    /// The pipeline as data with its components' slots.
    fn declare(&self, shape: &RunShape) -> (PipelineSpec, Parts) {
        let mut spec = PipelineSpec::titled(self.title());
        let text_encoder = spec.add_model("text_encoder", Role::TextEncoder, &self.text_encoder);
        // Diffusers runs the Wan VAE and the CLIP image encoder in f32.
        let image_encoder = self.image_encoder.as_ref().map(|cfg| {
            spec.add(
                Component::new("image_encoder", Role::ImageEncoder, cfg.clone())
                    .in_dtype(DType::F32),
            )
        });
        let dit = |name, cfg: &WanTransformerConfig| {
            let cfg = WanTransformerConfig {
                fp8_matmul: shape.fp8_matmul,
                ..cfg.clone()
            };
            Component::new(name, Role::Dit, cfg)
                .with_original_layout(crate::weights::original::Model::Wan)
        };
        let transformer = spec.add(dit("transformer", &self.transformer));
        let transformer_2 = self
            .transformer_2
            .as_ref()
            .map(|cfg| spec.add(dit("transformer_2", cfg)));
        let vae = spec.add(Component::new("vae", Role::Vae, self.vae.clone()).in_dtype(DType::F32));
        let parts = Parts {
            text_encoder,
            image_encoder,
            transformer,
            transformer_2,
            vae,
        };
        let latent = self.latent_shape(shape.num_frames, shape.height, shape.width);
        let tiling = shape
            .vae_tiling
            .then(|| WanVaeTiling::sized(shape.vae_tile_size));
        // What the image stage encodes: the whole video (Wan2.1 I2V) or the first frame (TI2V).
        let encoded = if self.expand_timesteps {
            [latent[0], latent[1], 1, latent[3], latent[4]]
        } else {
            latent
        };
        // The hidden states a step cache (or PAB) holds through the forward.
        let cached_states = |cfg: &WanTransformerConfig| {
            let attentions = AttentionModules {
                spatial: cfg.num_layers,
                temporal: 0,
                cross: cfg.num_layers,
            };
            shape.cache_states(&cfg.hooked_blocks()) + shape.pab_outputs(attentions)
        };
        let hidden =
            |cfg: &WanTransformerConfig| activations::hidden_state_bytes(cfg, latent, shape.dtype);
        // The prompts' text and each guidance pass's (a forward of its own) prediction.
        let text = (shape.text_len, shape.guidance_batch());
        // The cached states, and (in low-activation mode) each block's input beside the output
        // it writes.
        let dit_activations = |cfg: &WanTransformerConfig| {
            let low = shape.low_activation;
            let cached = cached_states(cfg);
            let copies = cached + usize::from(low && cached > 0);
            let fp8 = if shape.fp8_matmul {
                activations::fp8_matmul_activations(cfg, latent, low)
            } else {
                0
            };
            let sage = if shape.sage_attention {
                activations::sage_attention_activations(cfg, latent)
            } else {
                0
            };
            activations::transformer_activations(cfg, latent, text, shape.dtype, low)
                + copies as u64 * hidden(cfg)
                + fp8
                + sage
        };
        // While the outer part computes: its activations and the cached states.
        let apart_activations = |cfg: &WanTransformerConfig| {
            activations::outer_activations(cfg, latent, text, shape.dtype)
                + cached_states(cfg) as u64 * hidden(cfg)
        };
        // Each block built on the device keeps its fp8 weight codes.
        let block_codes = |cfg: &WanTransformerConfig| {
            let blocks = if shape.fp8_matmul { cfg.num_layers } else { 0 };
            vec![activations::fp8_block_codes(cfg); blocks]
        };
        let index = |slot: Option<usize>| slot.into_iter().collect::<Vec<_>>();
        spec.stages = self
            .steps(shape.image, shape.decode)
            .into_iter()
            .map(|step| match step {
                Step::EncodeText => StageSpec::new(
                    "encode_text",
                    &[text_encoder.index()],
                    activations::text_encoder_activations(
                        &self.text_encoder,
                        shape.text_len,
                        shape.dtype,
                    ),
                )
                .runs(WanT2V::encode_text),
                Step::EncodeImage => StageSpec::new(
                    "encode_image",
                    &[index(image_encoder.map(Slot::index)), vec![vae.index()]].concat(),
                    self.image_encoder
                        .as_ref()
                        .map_or(0, activations::image_encoder_activations)
                        + activations::vae_decode_activations(&self.vae, encoded, None),
                )
                .runs(WanT2V::encode_image),
                Step::Denoise => StageSpec::new(
                    if self.transformer_2.is_some() {
                        "denoise_high_noise"
                    } else {
                        "denoise"
                    },
                    &[transformer.index()],
                    dit_activations(&self.transformer),
                )
                .apart_activations(apart_activations(&self.transformer))
                .holding_per_block(block_codes(&self.transformer))
                .runs(|wan: &WanT2V, frame, job| wan.denoise(frame, job, false)),
                Step::DenoiseLow => {
                    let cfg = self.transformer_2.as_ref().unwrap_or(&self.transformer);
                    StageSpec::new(
                        "denoise_low_noise",
                        &index(transformer_2.map(Slot::index)),
                        dit_activations(cfg),
                    )
                    .apart_activations(apart_activations(cfg))
                    .holding_per_block(block_codes(cfg))
                    .runs(|wan: &WanT2V, frame, job| wan.denoise(frame, job, true))
                }
                Step::Decode => StageSpec::new(
                    "decode",
                    &[vae.index()],
                    activations::vae_decode_activations(&self.vae, latent, tiling.as_ref()),
                )
                .runs(WanT2V::decode),
                Step::Write => StageSpec::write(),
            })
            .collect();
        (spec, parts)
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

/// What a job carries between stages beside [`Job`]'s own fields.
#[derive(Default)]
struct Carried {
    /// The image stage's output, until the last denoise stage.
    conditioning: Option<Conditioning>,
    /// The denoising between the experts' stages.
    denoising: Option<Denoising>,
}

/// The Wan family's own part of its pipeline (the frame holds the rest).
struct WanT2V {
    configs: WanConfigs,
    parts: Parts,
    tokenizer: PromptTokenizer,
    /// When the last high-noise stage ended and no low-noise forward has run since: the start
    /// of an expert switch (once per group of a stage-major batch, once per prompt otherwise).
    switch_started: Cell<Option<Instant>>,
}

impl WanT2V {
    /// Reads the tokenizer; loads no weights.
    fn new(configs: WanConfigs, parts: Parts, frame: &Frame) -> Result<Self> {
        let tokenizer = PromptTokenizer::from_source(&frame.source, "tokenizer/tokenizer.json")?;
        Ok(WanT2V {
            configs,
            parts,
            tokenizer,
            switch_started: Cell::new(None),
        })
    }

    /// The prompt embeddings `[1, L, text_dim]` of each text, zero padded past its length
    /// (`_get_t5_prompt_embeds`), with the encoder's blocks resident or streamed. Each block
    /// runs on every text in turn, so a streamed encoder's weights pass through once for all of
    /// them, and each text's result is what encoding it alone gives.
    fn embed(
        &self,
        frame: &Frame,
        encoder: &Held<'_, UMT5EncoderModel>,
        texts: &[&str],
    ) -> Result<Vec<Tensor>> {
        let max_len = frame.config.generation().max_sequence_length;
        let model = encoder.model()?;
        let device = model.device();
        encoder.each_through_blocks(
            UMT5EncoderModel::blocks,
            texts,
            |text| {
                let (ids, seq_len) = self.tokenizer.encode(&clean_prompt(text), max_len)?;
                let ids = Tensor::new(ids.as_slice(), &device)?.unsqueeze(0)?;
                let mask = attention_mask(&[seq_len], max_len, &device)?;
                Ok((model.embed(&ids)?, (mask, seq_len)))
            },
            |block: &UMT5Block, h, (mask, _)| block.forward(h, mask),
            |h, (_, len)| {
                Ok(zero_padding_rows(&model.final_norm(&h)?, &[len])?.to_dtype(frame.dtype())?)
            },
        )
    }

    /// Encodes the prompts (once per sequence-parallel group: its leader encodes, the others
    /// receive the embeddings); the embeddings wait for the denoise stage in host memory, so a
    /// stage-major batch holds no device memory between stages.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let ranks = frame.config.ranks();
        let embeds = crate::parallel::once_per_group(ranks, &frame.device, || {
            let encoder = frame.hold(self.parts.text_encoder)?;
            let mut texts = vec![job.prompt.as_str()];
            if job.guidance_scale > 1.0 {
                texts.push(job.negative_prompt.as_str());
            }
            self.embed(frame, &encoder, &texts)
        })?;
        let mut embeds = embeds.into_iter().map(|t| t.to_device(&Device::Cpu));
        job.prompt_embeds = Some(embeds.next().context("no prompt embeddings")??);
        job.negative_embeds = embeds.next().transpose()?;
        Ok(())
    }

    /// The image stage: the condition latents (`prepare_latents`) and CLIP image tokens (where
    /// the model has an image encoder), made once per sequence-parallel group as the text's
    /// embeddings are, kept in host memory until the denoise stage.
    fn encode_image(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        // A TI2V prompt without an image is text-to-video (`check_images` made sure the
        // image-to-video models have one for every prompt).
        let Some(path) = &job.image else {
            return Ok(());
        };
        let ranks = frame.config.ranks();
        // The leader's two parts, timed apart: the `encode_image_seconds` metric.
        let mut seconds = serde_json::Map::new();
        let made = crate::parallel::once_per_group(ranks, &frame.device, || {
            self.condition_on(frame, path, job, &mut seconds)
        })?;
        if !seconds.is_empty() {
            job.metrics
                .insert("encode_image_seconds".into(), seconds.into());
        }
        let mut made = made.into_iter().map(|t| t.to_device(&Device::Cpu));
        let condition = made.next().context("no condition latents")??;
        job.carry.put(Carried {
            conditioning: Some(Conditioning {
                image_embeds: made.next().transpose()?,
                condition,
            }),
            denoising: None,
        });
        Ok(())
    }

    /// The condition latents of the image at `path` for `job`, then its CLIP image tokens where
    /// the model has an image encoder; the seconds each took go in `seconds`.
    fn condition_on(
        &self,
        frame: &Frame,
        path: &std::path::Path,
        job: &Job,
        seconds: &mut serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<Tensor>> {
        let img = load_rgb_image(path)?;
        let (dtype, device) = (frame.dtype(), &frame.device);
        let start = Instant::now();
        let image_embeds = match self.parts.image_encoder {
            Some(slot) => {
                let held = frame.hold(slot)?;
                let model = held.model()?;
                let processor = self.configs.image_processor.clone().unwrap_or_default();
                let pixels = ClipImageProcessor::new(&processor)?.preprocess(&img, device)?;
                let embeds = model.last_hidden_state(&pixels)?.to_dtype(dtype)?;
                device.synchronize()?;
                seconds.insert("image_encoder".into(), start.elapsed().as_secs_f64().into());
                Some(embeds)
            }
            None => None,
        };
        let start = Instant::now();
        let held = frame.hold(self.parts.vae)?;
        let vae = held.model()?;
        let image = preprocess_image(
            &img,
            job.height as usize,
            job.width as usize,
            self.configs.vae.scale_factor_spatial(),
            device,
        )?;
        let condition = if self.configs.expand_timesteps {
            first_frame_condition(&vae, &image, 1, dtype)?
        } else {
            image_condition(&vae, &image, job.num_frames as usize, 1, dtype)?
        };
        device.synchronize()?;
        seconds.insert("vae_encode".into(), start.elapsed().as_secs_f64().into());
        Ok([Some(condition), image_embeds]
            .into_iter()
            .flatten()
            .collect())
    }

    fn initial_latents(&self, frame: &Frame, job: &Job) -> Result<Tensor> {
        let shape = self
            .configs
            .latent_shape(job.num_frames, job.height, job.width);
        match &frame.config.generation().latents {
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
                Ok(tensor.to_dtype(DType::F32)?.to_device(&frame.device)?)
            }
            None => Ok(TorchGenerator::new(job.seed)
                .randn(&shape)?
                .to_device(&frame.device)?),
        }
    }

    /// The denoising steps of one expert: every step for a one-expert model; for two experts,
    /// `low` = false runs the steps at or above the boundary with `transformer` and
    /// `guidance_scale`, `low` = true the rest with `transformer_2` and `guidance_scale_2`
    /// (one scheduler across both, as diffusers).
    fn denoise(&self, frame: &Frame, job: &mut Job, low: bool) -> Result<()> {
        let mut carried: Carried = job.carry.take();
        let switch_started = if low {
            self.switch_started.take()
        } else {
            None
        };
        let state = carried.denoising.take();
        let conditioning = carried.conditioning.as_ref();
        let state = self.denoise_steps(frame, job, low, state, conditioning, switch_started)?;
        if self.configs.transformer_2.is_some() && !low {
            self.switch_started.set(Some(Instant::now()));
            carried.denoising = Some(state);
            job.carry.put(carried);
        }
        Ok(())
    }

    /// `switch_started`: when the expert switch before this low-noise stage began; the time
    /// until its first forward starts (releasing and loading experts as the load policy says,
    /// moving the latents, readying the first streamed blocks) is the job's `expert_switch`
    /// metric, with the number of forwards before it.
    fn denoise_steps(
        &self,
        frame: &Frame,
        job: &mut Job,
        low: bool,
        state: Option<Denoising>,
        conditioning: Option<&Conditioning>,
        switch_started: Option<Instant>,
    ) -> Result<Denoising> {
        let g = frame.config.generation();
        let device = &frame.device;
        let state = match state {
            Some(state) => state,
            None => {
                let scheduler = schedulers::build(
                    g.scheduler,
                    &self.configs.scheduler,
                    job.num_inference_steps as usize,
                    g.flow_shift,
                    g.sigmas.as_deref(),
                )?;
                Denoising {
                    scheduler,
                    latents: self.initial_latents(frame, job)?,
                    next_step: 0,
                    forward_seconds: Vec::new(),
                }
            }
        };
        let Denoising {
            mut scheduler,
            latents,
            next_step,
            forward_seconds,
        } = state;
        // Latents wait in host memory between the experts' stages.
        let mut latents = latents.to_device(device)?;
        let expert = match (low, self.parts.transformer_2) {
            (true, Some(low)) => low,
            (true, None) => bail!("a low-noise stage without transformer_2"),
            (false, _) => self.parts.transformer,
        };
        let model = &frame.hold(expert)?;
        let dtype = frame.dtype();
        let cond = job
            .prompt_embeds
            .as_ref()
            .context("prompt not encoded")?
            .to_device(device)?;
        let cond = &cond;
        let uncond = match &job.negative_embeds {
            Some(t) => Some(t.to_device(device)?),
            None => None,
        };
        let guidance = if low {
            g.guidance_scale_2.unwrap_or(job.guidance_scale)
        } else {
            job.guidance_scale
        };
        let image_embeds = match conditioning.and_then(|c| c.image_embeds.as_ref()) {
            Some(t) => Some(t.to_device(device)?),
            None => None,
        };
        let condition = match conditioning {
            Some(c) => Some(c.condition.to_device(device)?),
            None => None,
        };
        // Wan2.2 TI2V: the first-frame mask (ones without an image) for per-token timesteps.
        let [_, _, frames, lh, lw] =
            self.configs
                .latent_shape(job.num_frames, job.height, job.width);
        let mask = if !self.configs.expand_timesteps {
            None
        } else if condition.is_some() {
            Some(first_frame_mask(frames, (lh, lw), DType::F32, device)?)
        } else {
            Some(Tensor::ones((1, 1, frames, lh, lw), DType::F32, device)?)
        };
        let [_, ph, pw] = self.configs.transformer.patch_size;
        let timesteps = scheduler.timesteps().to_vec();
        // The high-noise expert's steps end at the boundary.
        let boundary = self.configs.boundary_timestep().filter(|_| !low);
        let end = (next_step..timesteps.len())
            .find(|&i| boundary.is_some_and(|b| timesteps[i] < b))
            .unwrap_or(timesteps.len());
        let mut denoise = Denoise::resume(frame, timesteps.len(), forward_seconds);
        if let (Some(start), true) = (switch_started, next_step < end) {
            job.metrics.insert(
                "expert_switch".into(),
                serde_json::json!({
                    "seconds": start.elapsed().as_secs_f64(),
                    "after_forward": denoise.forwards_run(),
                }),
            );
        }
        let sequence = frame.config.ranks().map(|r| &r.sequence);
        let low_activation = frame.config.memory().low_activation;
        let image = image_embeds.as_ref();
        denoise.run(next_step..end, |forwards, i| {
            let t = timesteps[i];
            let input = match (&condition, &mask) {
                (Some(c), Some(m)) => replace_first_frame(&latents, c, m)?.to_dtype(dtype)?,
                (Some(c), None) => {
                    Tensor::cat(&[&latents.to_dtype(dtype)?, &c.to_dtype(dtype)?], 1)?
                }
                _ => latents.to_dtype(dtype)?,
            };
            let timestep = match &mask {
                Some(m) => per_token_timesteps(t, m, 1, (ph, pw))?,
                None => Tensor::new(&[t as f32], device)?,
            };
            let forward = |text: &Tensor, cache: Option<(&mut StepCache, Forward)>| {
                dit_forward(
                    model,
                    &input,
                    &timestep,
                    text,
                    image,
                    sequence,
                    cache,
                    low_activation,
                )
            };
            let noise_cond = forwards.run_cached(Pass::Cond, t, |c| forward(cond, c))?;
            // diffusers combines in the transformer dtype.
            let noise = match &uncond {
                Some(uncond) => guide(
                    &forwards.run_cached(Pass::Uncond, t, |c| forward(uncond, c))?,
                    &noise_cond,
                    guidance,
                )?,
                None => noise_cond,
            };
            latents = scheduler.step(&noise, &latents)?.to_dtype(DType::F32)?;
            Ok(latents.clone())
        })?;
        let last = self.configs.transformer_2.is_none() || low;
        if !last {
            return Ok(Denoising {
                scheduler,
                latents: latents.to_device(&Device::Cpu)?,
                next_step: end,
                forward_seconds: denoise.into_seconds(job)?,
            });
        }
        denoise.finish(job)?;
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
            next_step: end,
            forward_seconds: Vec::new(),
        })
    }

    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let held = frame.hold(self.parts.vae)?;
        let vae = held.model()?;
        let latents = job.latents.take().context("nothing denoised")?;
        let z = vae.denormalize(&latents.to_dtype(DType::F32)?.to_device(&frame.device)?)?;
        // [1, 3, T, H, W] in [-1, 1]
        let video = if frame.config.memory().vae_tiling {
            let px = frame.config.memory().vae_tile_size;
            vae.decode_tiled(&z, &WanVaeTiling::sized(px))?
        } else {
            vae.decode(&z)?
        };
        job.frames = Some(stages::video_frames(video)?);
        Ok(())
    }
}

/// One DiT forward (with the CLIP image tokens of Wan2.1 I2V): prepare, the blocks (resident or
/// streamed, in low-activation mode where `low_activation`), finish; on a rank of a
/// sequence-parallel run (`sequence`), the blocks run on the rank's share of the tokens and
/// their output is gathered before `finish`.
#[allow(clippy::too_many_arguments)]
pub fn dit_forward(
    dit: &Held<'_, WanTransformer3DModel>,
    latents: &Tensor,
    timestep: &Tensor,
    text: &Tensor,
    image: Option<&Tensor>,
    sequence: Option<&Arc<dyn SequenceParallel>>,
    cache: Option<(&mut StepCache, Forward)>,
    low_activation: bool,
) -> candle_core::Result<Tensor> {
    // The outer part only around its uses: it may be moved in for each (leaf level).
    let (mut inputs, hooked) = {
        let model = dit.model()?;
        let inputs = model.prepare_with_image(latents, timestep, text, image)?;
        (inputs, model.config().hooked_blocks())
    };
    inputs.low_activation = low_activation;
    let mut share = sequence
        .map(|sp| inputs.split_sequence(sp.clone()))
        .transpose()?;
    let x = match &mut share {
        Some(share) => share.take_hidden_states()?,
        None => inputs.take_hidden_states()?,
    };
    let at = share.as_ref().unwrap_or(&inputs);
    let blocks = WanTransformer3DModel::blocks;
    let mut cache = cache;
    let x = match &mut cache {
        Some((cache, step)) => cache.through_blocks(
            *step,
            x,
            hooked,
            &HiddenStates,
            |x, f| dit.fold_blocks(blocks, x, |block, x| f(block, x)),
            |block, x, hooks| block.forward_hooked(x, at, hooks),
        )?,
        // The fold drops each block's input as the block returns: the block may write over it.
        None => dit.fold_blocks(blocks, x, |block, x| block.forward_owned(x.clone(), at))?,
    };
    let x = at.gather_sequence(&x)?;
    let model = dit.model()?;
    match cache {
        Some((cache, step)) => {
            model.finish_projecting(&x, &inputs, &mut |compute| cache.project(step, compute))
        }
        None => model.finish(&x, &inputs),
    }
}
