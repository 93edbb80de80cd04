//! Latte-1 text-to-video (maxin-cn/Latte-1) as a list of stages, step for step as diffusers'
//! `LattePipeline.__call__` (see [`crate::models::latte`] for the math).

use super::denoise::Denoise;
use super::draws::Draws;
use super::frame::Frame;
use super::jobs::Job;
use super::placement::Held;
use super::registry::{Configs, Family, FamilyOption, RunShape};
use super::spec::{PipelineSpec, StageSpec, TextToVideo};
use super::stages;
use crate::config::video::FrameRule;
use crate::config::{ModelDefaults, UsageError};
use crate::models::autoencoder_kl::{AutoencoderKL, AutoencoderKLConfig};
use crate::models::cogvideox::activations::text_encoder_activations;
use crate::models::guidance::guide_batched;
use crate::models::latte::transformer::{LatteTransformer3DModel, LatteTransformerConfig};
use crate::models::latte::{activations, decode_latents, prompt, DECODE_CHUNK_FRAMES};
use crate::models::source::FileRef;
use crate::models::t5::encoder::{T5Config, T5EncoderModel};
use crate::models::t5::tokenizer::PromptTokenizer;
use crate::rng::TorchGenerator;
use crate::schedulers::ddim::{DdimConfig, DdimScheduler};
use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use std::any::Any;

/// Reads a Latte model's configs (the registry's entry point).
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    Ok(Box::new(LatteConfigs::from_configs(configs)?))
}

/// The configs of a Latte model: everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct LatteConfigs {
    pub transformer: LatteTransformerConfig,
    pub vae: AutoencoderKLConfig,
    pub text_encoder: T5Config,
    pub scheduler: DdimConfig,
}

/// The components of a Latte pipeline.
type Parts = TextToVideo<T5EncoderModel, LatteTransformer3DModel, AutoencoderKL>;

impl LatteConfigs {
    /// Reads every component's config.
    pub fn from_configs(configs: Configs) -> Result<Self> {
        Ok(LatteConfigs {
            transformer: configs.read("transformer/config.json")?,
            vae: configs.read("vae/config.json")?,
            text_encoder: configs.read("text_encoder/config.json")?,
            scheduler: configs.read("scheduler/scheduler_config.json")?,
        })
    }

    /// The latent shape `[1, C, F, H/f, W/f]` for a video size.
    pub fn latent_shape(&self, num_frames: u32, height: u32, width: u32) -> [usize; 5] {
        let s = self.vae.scale_factor();
        [
            1,
            self.transformer.in_channels(),
            num_frames as usize,
            height as usize / s,
            width as usize / s,
        ]
    }

    /// Pixels per side of one transformer token: the VAE's factor times the patch.
    fn size_step(&self) -> u32 {
        let step = self.vae.scale_factor() * self.transformer.patch_size().clamp(1, 1 << 16);
        u32::try_from(step).unwrap_or(u32::MAX)
    }

    /// Text encoder, DiT and VAE (each in the run's dtype, as diffusers loads them), each used
    /// by one stage and safe to defer; the pipeline as data with its components' slots.
    fn declare(&self, shape: &RunShape) -> (PipelineSpec, Parts) {
        let latent = self.latent_shape(shape.num_frames, shape.height, shape.width);
        let mut spec = PipelineSpec::titled(self.title());
        let parts = Parts::declare(&mut spec, &self.text_encoder, &self.transformer, &self.vae);
        let (c, dtype) = (&parts, shape.dtype);
        let text = text_encoder_activations(&self.text_encoder, prompt::MAX_LENGTH, dtype);
        let dit = activations::transformer_activations(
            &self.transformer,
            latent,
            prompt::MAX_LENGTH,
            dtype,
        );
        let vae =
            activations::vae_decode_activations(&self.vae, latent, DECODE_CHUNK_FRAMES, dtype);
        spec.stages = vec![
            StageSpec::new("encode_text", &[c.text_encoder.index()], text).runs(Latte::encode_text),
            StageSpec::new("denoise", &[c.transformer.index()], dit).runs(Latte::denoise),
            StageSpec::new("decode", &[c.vae.index()], vae).runs(Latte::decode),
            StageSpec::write(),
        ];
        (spec, parts)
    }
}

impl Family for LatteConfigs {
    fn title(&self) -> &'static str {
        "Latte text-to-video"
    }

    fn spec(&self, shape: &RunShape) -> PipelineSpec {
        self.declare(shape).0
    }

    /// Text-to-video with classifier-free guidance; prompts always take 120 tokens, the DDIM
    /// scheduler comes from the model, the VAE decodes frame by frame without tiles.
    fn options(&self) -> Vec<FamilyOption> {
        vec![FamilyOption::GuidanceScale, FamilyOption::NegativePrompt]
    }

    /// The temporal table fixes the frame count (sizes in whole tokens are the frame rule's).
    fn size_refusal(&self, num_frames: u32, _height: u32, _width: u32) -> Option<String> {
        let frames = self.transformer.video_length as u32;
        (num_frames != frames && num_frames != 1).then(|| format!(
            "--num-frames {num_frames}: this Latte transformer's temporal position table is {frames} frames long (video_length); pass --num-frames {frames} (or 1)"
        ))
    }

    fn draws(&self, num_frames: u32, height: u32, width: u32) -> Vec<(&'static str, Vec<usize>)> {
        vec![(
            "latents",
            self.latent_shape(num_frames, height, width).to_vec(),
        )]
    }

    /// The published pipeline's call defaults: 512x512 (sample_size x 8), video_length frames,
    /// 50 steps, guidance 7.5, 120 text tokens.
    fn defaults(&self) -> ModelDefaults {
        let side = self
            .transformer
            .sample_size
            .saturating_mul(self.vae.scale_factor());
        let side = u32::try_from(side).unwrap_or(u32::MAX);
        ModelDefaults {
            height: Some(side),
            width: Some(side),
            num_frames: Some(u32::try_from(self.transformer.video_length).unwrap_or(u32::MAX)),
            fps: Some(8),
            num_inference_steps: Some(50),
            guidance_scale: Some(7.5),
            // Not an option here: the fixed length, so reports show what runs.
            max_sequence_length: Some(prompt::MAX_LENGTH as u32),
            image: false,
            frame_rule: Some(FrameRule {
                frame_step: 1,
                size_step: self.size_step(),
                min_steps: 1,
            }),
            ..ModelDefaults::default()
        }
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        serde_json::json!({
            "transformer_layers": self.transformer.num_layers,
            "transformer_temporal_layers": self.transformer.num_layers,
            "transformer_inner_dim": self.transformer.inner_dim(),
            "latent_shape": self.latent_shape(shape.num_frames, shape.height, shape.width),
            "latent_layout": "BCFHW",
            "vae_scale_factor_spatial": self.vae.scale_factor(),
            "vae_decode_chunk_frames": DECODE_CHUNK_FRAMES,
            "text_encoder_layers": self.text_encoder.num_layers,
            "text_tokens": prompt::MAX_LENGTH,
            "scheduler": "DDIMScheduler",
        })
    }

    fn open(&self, frame: &Frame) -> Result<Box<dyn Any>> {
        let (_, parts) = self.declare(&RunShape::of(&frame.config));
        Ok(Box::new(Latte::new(self.clone(), parts, frame)?))
    }
}

/// Latte's own part of its pipeline (the frame holds the rest).
struct Latte {
    configs: LatteConfigs,
    parts: Parts,
    tokenizer: PromptTokenizer,
}

impl Latte {
    /// Reads the tokenizer and checks the draws file against the run's sizes; loads no weights.
    fn new(configs: LatteConfigs, parts: Parts, frame: &Frame) -> Result<Self> {
        let tokenizer_json = frame.source.require("tokenizer/tokenizer.json").context(
            "Latte reads tokenizer/tokenizer.json; where a checkpoint ships only spiece.model, write it once with transformers: T5TokenizerFast.from_pretrained(folder, subfolder=\"tokenizer\").save_pretrained(folder + \"/tokenizer\")",
        )?;
        let tokenizer = match tokenizer_json {
            FileRef::Path(p) => PromptTokenizer::from_file(&p)?,
            FileRef::Embedded(text) => PromptTokenizer::from_json(text)?,
        };
        // A draws file that does not fit the run is bad input, found before anything loads.
        if let Some(path) = &frame.config.generation().latents {
            let o = frame.config.video();
            let shape = configs.latent_shape(o.num_frames, o.height, o.width);
            let mut draws = Draws::open(path).map_err(UsageError::from_error)?;
            draws
                .take("latents", &shape)
                .and_then(|_| draws.finish())
                .map_err(UsageError::from_error)?;
        }
        Ok(Latte {
            configs,
            parts,
            tokenizer,
        })
    }

    /// `encode_prompt` with `mask_feature`: the prompt's embeddings cut to its token count and,
    /// when guided, the negative prompt's cut to the same rows; they wait for the denoise stage
    /// in host memory.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let encoder = frame.hold(self.parts.text_encoder)?;
        let mut texts = vec![prompt::tokens(&self.tokenizer, &job.prompt)?];
        if job.guidance_scale > 1.0 {
            texts.push(prompt::tokens(&self.tokenizer, &job.negative_prompt)?);
        }
        let len = texts[0].1;
        let mut embeds = prompt::encode(&encoder, &texts)?.into_iter();
        drop(encoder);
        let cond = embeds.next().context("no prompt embeddings")?;
        let (cond, uncond) = prompt::mask_feature(&cond, len, embeds.next().as_ref())?;
        let host = |t: Tensor| -> Result<Tensor> {
            Ok(t.to_dtype(frame.dtype())?.to_device(&Device::Cpu)?)
        };
        job.prompt_embeds = Some(host(cond)?);
        job.negative_embeds = uncond.map(host).transpose()?;
        Ok(())
    }

    fn denoise(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let model = &frame.hold(self.parts.transformer)?;
        let dtype = frame.dtype();
        let device = &frame.device;
        let cond = job.prompt_embeds.as_ref().context("prompt not encoded")?;
        // One batched forward over [negative; positive], as diffusers calls it.
        let text = match &job.negative_embeds {
            Some(uncond) => Tensor::cat(&[uncond, cond], 0)?,
            None => cond.clone(),
        }
        .to_device(device)?;
        let guided = job.negative_embeds.is_some();
        let shape = self
            .configs
            .latent_shape(job.num_frames, job.height, job.width);
        // `randn_tensor(shape, generator, dtype=prompt_embeds.dtype)`, or the file's draw;
        // init_noise_sigma is 1.
        let latents = match &frame.config.generation().latents {
            Some(path) => {
                let mut draws = Draws::open(path)?;
                let latents = draws.take("latents", &shape)?;
                draws.finish()?;
                latents
            }
            None => TorchGenerator::new(job.seed).randn_as(&shape, dtype)?,
        };
        let steps = job.num_inference_steps as usize;
        let scheduler = DdimScheduler::new(&self.configs.scheduler, steps)?;
        let mut latents = latents.to_dtype(dtype)?.to_device(device)?;
        let timesteps = scheduler.timesteps().to_vec();
        let channels = self.configs.transformer.in_channels();
        let guidance_scale = job.guidance_scale;
        let mut denoise = Denoise::new(frame, timesteps.len());
        denoise.run(0..timesteps.len(), |forwards, i| {
            let t = timesteps[i];
            let input = if guided {
                Tensor::cat(&[&latents, &latents], 0)?
            } else {
                latents.clone()
            };
            let timestep = Tensor::new(&[t], device)?;
            let out = forwards.run(|| dit_forward(model, &input, &timestep, &text))?;
            let noise_pred = if guided {
                guide_batched(&out, guidance_scale)?
            } else {
                out
            };
            // The learned sigma (channels C..2C) is dropped before the step.
            let noise_pred = noise_pred.narrow(1, 0, channels)?;
            latents = scheduler.step(&noise_pred, t, &latents)?;
            Ok(latents.clone())
        })?;
        denoise.finish(job);
        job.latents = Some(latents.to_device(&Device::Cpu)?);
        job.prompt_embeds = None;
        job.negative_embeds = None;
        Ok(())
    }

    /// `decode_latents` (every frame on its own, in chunks), then `postprocess_video` to frames
    /// `[F, H, W, 3]`.
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let held = frame.hold(self.parts.vae)?;
        let vae = held.model();
        let latents = job.latents.take().context("nothing denoised")?;
        let video = decode_latents(vae, &latents.to_device(&frame.device)?)?;
        job.frames = Some(stages::video_frames(video)?);
        Ok(())
    }
}

/// One DiT forward: prepare, the blocks (resident or streamed), finish.
pub fn dit_forward(
    dit: &Held<'_, LatteTransformer3DModel>,
    latents: &Tensor,
    timestep: &Tensor,
    text: &Tensor,
) -> candle_core::Result<Tensor> {
    let model = dit.model();
    let mut inputs = model.prepare(latents, timestep, text)?;
    let x = inputs.take_hidden_states()?;
    let x = dit.fold_blocks(LatteTransformer3DModel::blocks, x, |block, x| {
        block.forward(x, &inputs)
    })?;
    model.finish(&x, &inputs)
}
