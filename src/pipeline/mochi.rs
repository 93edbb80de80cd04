//! Mochi-1 text-to-video (genmo/mochi-1-preview) as a list of stages, step for step as
//! diffusers' `MochiPipeline.__call__` (see [`crate::models::mochi`] for the math).

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
use crate::models::guidance::guide_batched;
use crate::models::mochi::transformer::{MochiTransformer3DModel, MochiTransformerConfig};
use crate::models::mochi::vae::{AutoencoderKLMochi, MochiVaeConfig};
use crate::models::mochi::{activations, defaults};
use crate::models::source::FileRef;
use crate::models::t5::encoder::{attention_mask, encode_masked, T5Config, T5EncoderModel};
use crate::models::t5::tokenizer::PromptTokenizer;
use crate::rng::TorchGenerator;
use crate::schedulers::euler::{FlowMatchEuler, FlowMatchEulerConfig};
use crate::schedulers::linear_quadratic::{linear_quadratic_schedule, THRESHOLD_NOISE};
use crate::schedulers::Scheduler;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;
use std::any::Any;
use std::path::Path;

/// Reads a Mochi model's configs (the registry's entry point).
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    Ok(Box::new(MochiConfigs::from_configs(configs)?))
}

/// The keys of `model_index.json` the pipeline reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct MochiIndex {
    /// Zero the ids and mask of an empty prompt (the original Mochi code's choice; false in the
    /// published checkpoints).
    force_zeros_for_empty_prompt: bool,
}

/// The configs of a Mochi model: everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct MochiConfigs {
    pub transformer: MochiTransformerConfig,
    pub vae: MochiVaeConfig,
    pub text_encoder: T5Config,
    pub scheduler: FlowMatchEulerConfig,
}

impl MochiConfigs {
    /// Reads every component's config.
    pub fn from_configs(configs: Configs) -> Result<Self> {
        let index: MochiIndex = configs.read("model_index.json")?;
        if index.force_zeros_for_empty_prompt {
            bail!("model_index.json sets force_zeros_for_empty_prompt, which vidgen does not run; set it to false (as genmo/mochi-1-preview does)");
        }
        let scheduler: FlowMatchEulerConfig = configs.read("scheduler/scheduler_config.json")?;
        if scheduler.use_dynamic_shifting {
            bail!("scheduler/scheduler_config.json: use_dynamic_shifting needs a mu, which MochiPipeline never passes; set it to false");
        }
        Ok(MochiConfigs {
            transformer: configs.read("transformer/config.json")?,
            vae: configs.read("vae/config.json")?,
            text_encoder: configs.read("text_encoder/config.json")?,
            scheduler,
        })
    }

    /// The latent grid `[F', H', W']` of a video size (`prepare_latents`).
    pub fn grid(&self, num_frames: u32, height: u32, width: u32) -> [usize; 3] {
        let (t, s) = (
            self.vae.temporal_compression_ratio(),
            self.vae.spatial_compression_ratio(),
        );
        [
            (num_frames as usize).saturating_sub(1) / t + 1,
            height as usize / s,
            width as usize / s,
        ]
    }

    /// The latents' shape `[1, C, F', H', W']`.
    pub fn latent_shape(&self, grid: [usize; 3]) -> [usize; 5] {
        [1, self.transformer.in_channels, grid[0], grid[1], grid[2]]
    }

    /// Video tokens of a latent grid.
    fn tokens(&self, grid: [usize; 3]) -> usize {
        let p = self.transformer.patch_size;
        grid[0] * (grid[1] / p) * (grid[2] / p)
    }
}

/// The components of a Mochi pipeline.
type Parts = TextToVideo<T5EncoderModel, MochiTransformer3DModel, AutoencoderKLMochi>;

impl MochiConfigs {
    /// T5, DiT and VAE, each used by one stage and safe to defer: the pipeline as data with its
    /// components' slots.
    fn declare(&self, shape: &RunShape) -> (PipelineSpec, Parts) {
        let grid = self.grid(shape.num_frames, shape.height, shape.width);
        let mut spec = PipelineSpec::titled(self.title());
        let parts = Parts::declare(&mut spec, &self.text_encoder, &self.transformer, &self.vae);
        let (c, dtype, text_len) = (&parts, shape.dtype, shape.text_len);
        let text = crate::models::cogvideox::activations::text_encoder_activations(
            &self.text_encoder,
            text_len,
            dtype,
        );
        let dit = activations::transformer_activations(
            &self.transformer,
            self.tokens(grid),
            text_len,
            2,
            dtype,
        );
        let vae = activations::vae_decode_activations(&self.vae, grid, dtype);
        spec.stages = vec![
            StageSpec::new("encode_text", &[c.text_encoder.index()], text).runs(Mochi::encode_text),
            StageSpec::new("denoise", &[c.transformer.index()], dit).runs(Mochi::denoise),
            StageSpec::new("decode", &[c.vae.index()], vae).runs(Mochi::decode),
            StageSpec::write(),
        ];
        (spec, parts)
    }
}

impl Family for MochiConfigs {
    fn title(&self) -> &'static str {
        "Mochi-1 text-to-video"
    }

    fn spec(&self, shape: &RunShape) -> PipelineSpec {
        self.declare(shape).0
    }

    /// Text-to-video with classifier-free guidance; its own linear-quadratic flow-match
    /// schedule, the VAE decoding whole.
    fn options(&self) -> Vec<FamilyOption> {
        [&FamilyOption::GUIDED[..], &[FamilyOption::Lora]].concat()
    }

    fn draws(&self, num_frames: u32, height: u32, width: u32) -> Vec<(&'static str, Vec<usize>)> {
        let grid = self.grid(num_frames, height, width);
        vec![("latents", self.latent_shape(grid).to_vec())]
    }

    /// `MochiPipeline.__call__`'s defaults: 480x848, 19 frames, 64 steps, guidance 4.5, 256 text
    /// tokens; 30 fps (Mochi's frame rate). Any frame count (a decode gives
    /// `6·((n − 1) // 6) + 1`), sizes in multiples of the VAE's 8x times the patch, at least 2
    /// steps (the schedule's linear half is empty with one).
    fn defaults(&self) -> ModelDefaults {
        ModelDefaults {
            height: Some(defaults::HEIGHT),
            width: Some(defaults::WIDTH),
            num_frames: Some(defaults::NUM_FRAMES),
            fps: Some(defaults::FPS),
            num_inference_steps: Some(defaults::NUM_INFERENCE_STEPS),
            guidance_scale: Some(defaults::GUIDANCE_SCALE),
            max_sequence_length: Some(defaults::MAX_SEQUENCE_LENGTH),
            image: false,
            frame_rule: Some(FrameRule {
                frame_step: 1,
                size_step: (self.vae.spatial_compression_ratio() * self.transformer.patch_size)
                    as u32,
                min_steps: 2,
            }),
            scheduler: None,
        }
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        let grid = self.grid(shape.num_frames, shape.height, shape.width);
        serde_json::json!({
            "transformer_layers": self.transformer.num_layers,
            "transformer_inner_dim": self.transformer.inner_dim(),
            "latent_shape": self.latent_shape(grid),
            "latent_tokens": self.tokens(grid),
            "frames_out": self.vae.decoded_frames(grid[0]),
            "vae_scale_factor_spatial": self.vae.spatial_compression_ratio(),
            "vae_scale_factor_temporal": self.vae.temporal_compression_ratio(),
            "text_encoder_layers": self.text_encoder.num_layers,
        })
    }

    fn open(&self, frame: &Frame) -> Result<Box<dyn Any>> {
        let (_, parts) = self.declare(&RunShape::of(&frame.config));
        Ok(Box::new(Mochi::new(self.clone(), parts, frame)?))
    }
}

/// What a job carries from the text stage to the denoise stage beside its embeddings.
#[derive(Default)]
struct Carried {
    /// The prompt mask `[B, L]` (u32; [negative; positive] with guidance).
    mask: Option<Tensor>,
}

/// Mochi's own part of its pipeline (the frame holds the rest).
struct Mochi {
    configs: MochiConfigs,
    parts: Parts,
    tokenizer: PromptTokenizer,
}

impl Mochi {
    /// Reads the tokenizer and checks the draws file against the run's sizes; loads no weights.
    fn new(configs: MochiConfigs, parts: Parts, frame: &Frame) -> Result<Self> {
        let tokenizer = match frame.source.require("tokenizer/tokenizer.json")? {
            FileRef::Path(p) => PromptTokenizer::from_file(&p)?,
            FileRef::Embedded(text) => PromptTokenizer::from_json(text)?,
        };
        let pipeline = Mochi {
            configs,
            parts,
            tokenizer,
        };
        // A draws file that does not fit the run is bad input, found before anything loads.
        if let Some(path) = &frame.config.generation().latents {
            let o = frame.config.video();
            pipeline
                .take_latents(path, o.num_frames, o.height, o.width)
                .map_err(|e| UsageError::new(format!("{e:#}")))?;
        }
        Ok(pipeline)
    }

    /// The draws file's `latents` for a video size; the file must hold nothing else.
    fn take_latents(
        &self,
        path: &Path,
        num_frames: u32,
        height: u32,
        width: u32,
    ) -> Result<Tensor> {
        let grid = self.configs.grid(num_frames, height, width);
        let mut draws = Draws::open(path)?;
        let latents = draws.take("latents", &self.configs.latent_shape(grid))?;
        draws.finish()?;
        Ok(latents)
    }

    /// `_get_t5_prompt_embeds` for each text: T5 with the attention mask (pad rows not zeroed),
    /// the texts through the blocks together; embeddings `[1, L, D]` and masks `[1, L]`.
    fn embed(
        &self,
        frame: &Frame,
        encoder: &Held<'_, T5EncoderModel>,
        texts: &[&str],
    ) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let max_len = frame.config.generation().max_sequence_length;
        let tokens = texts
            .iter()
            .map(|text| self.tokenizer.encode(text, max_len))
            .collect::<Result<Vec<_>>>()?;
        let ids: Vec<&[u32]> = tokens.iter().map(|(ids, _)| ids.as_slice()).collect();
        let lens: Vec<usize> = tokens.iter().map(|(_, len)| *len).collect();
        let embeds = encode_masked(encoder, &ids, &lens)?
            .into_iter()
            .map(|t| Ok(t.to_dtype(frame.dtype())?.to_device(&Device::Cpu)?))
            .collect::<Result<_>>()?;
        let masks = lens
            .iter()
            .map(|&len| Ok(attention_mask(&[len], max_len, &Device::Cpu)?))
            .collect::<Result<_>>()?;
        Ok((embeds, masks))
    }

    /// Encodes the prompt (and with guidance the negative prompt) as one batch [negative;
    /// positive]; embeddings and masks wait for the denoise stage in host memory.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let encoder = frame.hold(self.parts.text_encoder)?;
        let mut texts = vec![job.prompt.as_str()];
        if job.guidance_scale > 1.0 {
            texts.push(job.negative_prompt.as_str());
        }
        let (mut embeds, mut masks) = self.embed(frame, &encoder, &texts)?;
        drop(encoder);
        // [negative; positive]: the reverse of the encoding order.
        embeds.reverse();
        masks.reverse();
        job.prompt_embeds = Some(Tensor::cat(&embeds, 0)?);
        job.carry.put(Carried {
            mask: Some(Tensor::cat(&masks, 0)?),
        });
        Ok(())
    }

    fn denoise(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let model = &frame.hold(self.parts.transformer)?;
        let dtype = frame.dtype();
        let device = &frame.device;
        let carried: Carried = job.carry.take();
        let mask = carried
            .mask
            .context("prompt not encoded")?
            .to_device(device)?;
        let embeds = job
            .prompt_embeds
            .take()
            .context("prompt not encoded")?
            .to_device(device)?;
        let batch = embeds.dim(0)?;
        // `prepare_latents`: the given latents, or a float32 draw, in the embeddings' dtype.
        let latents = match &frame.config.generation().latents {
            Some(path) => self.take_latents(path, job.num_frames, job.height, job.width)?,
            None => {
                let grid = self.configs.grid(job.num_frames, job.height, job.width);
                TorchGenerator::new(job.seed).randn(&self.configs.latent_shape(grid))?
            }
        };
        let mut latents = latents.to_dtype(dtype)?.to_device(device)?;
        let steps = job.num_inference_steps as usize;
        let sigmas = linear_quadratic_schedule(steps, THRESHOLD_NOISE);
        let mut scheduler = FlowMatchEuler::with_sigmas(&self.configs.scheduler, &sigmas, None)?;
        let timesteps = scheduler.timesteps().to_vec();
        let guidance_scale = job.guidance_scale;
        let mut denoise = Denoise::new(frame, timesteps.len());
        denoise.run(0..timesteps.len(), |forwards, i| {
            let input = Tensor::cat(&vec![&latents; batch], 0)?;
            let timestep = Tensor::full(timesteps[i] as f32, batch, device)?.to_dtype(dtype)?;
            let pred = forwards
                .run(|| dit_forward(model, &input, &embeds, &timestep, &mask))?
                .to_dtype(DType::F32)?;
            // CFG and the Euler step in f32, the latents back in the run dtype.
            let pred = match batch > 1 {
                true => guide_batched(&pred, guidance_scale)?,
                false => pred,
            };
            latents = scheduler
                .step(&pred, &latents.to_dtype(DType::F32)?)?
                .to_dtype(dtype)?;
            Ok(latents.clone())
        })?;
        denoise.finish(job);
        job.latents = Some(latents.to_device(&Device::Cpu)?);
        Ok(())
    }

    /// De-normalise (`z·std/scaling + mean`), decode, frames in [0, 1].
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let held = frame.hold(self.parts.vae)?;
        let vae = held.model();
        let latents = job.latents.take().context("nothing denoised")?;
        let z = vae.denormalize(&latents.to_device(&frame.device)?)?;
        let video = vae.decode(&z)?.to_dtype(DType::F32)?;
        let made = video.dim(2)?;
        if made != job.num_frames as usize {
            frame.progress.note(&format!(
                "note: Mochi-1 makes 6k+1 frames: {} frames asked, {made} made",
                job.num_frames
            ));
        }
        job.frames = Some(stages::video_frames(video)?);
        Ok(())
    }
}

/// One DiT forward over the CFG batch: prepare, the blocks (resident or streamed), finish.
pub fn dit_forward(
    dit: &Held<'_, MochiTransformer3DModel>,
    latents: &Tensor,
    embeds: &Tensor,
    timestep: &Tensor,
    mask: &Tensor,
) -> candle_core::Result<Tensor> {
    let model = dit.model();
    let mut inputs = model.prepare(latents, timestep, embeds, mask)?;
    let streams = inputs.take_streams()?;
    let streams = dit.fold_blocks(MochiTransformer3DModel::blocks, streams, |block, s| {
        block.forward(s, &inputs)
    })?;
    model.finish(&streams.video, &inputs)
}
