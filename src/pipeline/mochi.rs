//! Mochi-1 text-to-video (genmo/mochi-1-preview) as a list of stages, step for step as
//! diffusers' `MochiPipeline.__call__` (see [`crate::models::mochi`] for the math).

use super::denoise::Denoise;
use super::draws::RunDraws;
use super::frame::Frame;
use super::jobs::Job;
use super::registry::FamilyOption::{Cache, Lora, Pab, StorageDtype, TaylorSeer, VaeTiling};
use super::registry::{
    declared_by, About, Configs, Family, RunShape, T5VideoConfigs, T5VideoPipeline,
};
use super::spec::TextToVideoStages;
use super::stages;
use crate::config::video::FrameRule;
use crate::config::ModelDefaults;
use crate::models::guidance::{batch_input, guide_if_batched};
use crate::models::mochi::defaults;
use crate::models::mochi::transformer::{MochiTransformer3DModel, MochiTransformerConfig};
use crate::models::mochi::vae::{AutoencoderKLMochi, MochiVaeConfig};
use crate::models::step_cache::Pass;
use crate::models::video::DenoiseActivations;
use crate::schedulers::euler::{FlowMatchEuler, FlowMatchEulerConfig};
use crate::schedulers::linear_quadratic::{linear_quadratic_schedule, THRESHOLD_NOISE};
use crate::schedulers::Scheduler;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use serde::Deserialize;

/// Reads a Mochi model's configs (the registry's entry point); refuses the settings
/// `MochiPipeline` does not run.
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    let index: MochiIndex = configs.read("model_index.json")?;
    if index.force_zeros_for_empty_prompt {
        bail!("model_index.json sets force_zeros_for_empty_prompt, which vidgen does not run; set it to false (as genmo/mochi-1-preview does)");
    }
    let family = MochiConfigs::from_configs(configs)?;
    if family.scheduler.use_dynamic_shifting {
        bail!("scheduler/scheduler_config.json: use_dynamic_shifting needs a mu, which MochiPipeline never passes; set it to false");
    }
    Ok(Box::new(family))
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
pub type MochiConfigs =
    T5VideoConfigs<MochiTransformerConfig, MochiVaeConfig, FlowMatchEulerConfig>;

/// Mochi's own part of its pipeline (the frame holds the rest).
type Mochi = T5VideoPipeline<MochiConfigs, MochiTransformer3DModel, AutoencoderKLMochi>;

impl Family for MochiConfigs {
    declared_by!(Mochi::opener(None, Mochi::take_latents), stages Mochi);

    /// Text-to-video with classifier-free guidance; its own linear-quadratic flow-match
    /// schedule, the VAE decoding whole (in spatial tiles with `--vae-tiling`).
    /// `MochiPipeline.__call__`'s defaults: 480x848, 19 frames, 64 steps, guidance 4.5, 256 text
    /// tokens; 30 fps (Mochi's frame rate). Any frame count (a decode gives
    /// `6·((n − 1) // 6) + 1`), sizes in multiples of the VAE's 8x times the patch, at least 2
    /// steps (the schedule's linear half is empty with one).
    fn about(&self) -> About {
        About {
            cache_blocks: Some(DenoiseActivations::hooked_blocks(&self.transformer)),
            defaults: ModelDefaults {
                height: Some(defaults::HEIGHT),
                width: Some(defaults::WIDTH),
                num_frames: Some(defaults::NUM_FRAMES),
                fps: Some(defaults::FPS),
                num_inference_steps: Some(defaults::NUM_INFERENCE_STEPS),
                guidance_scale: Some(defaults::GUIDANCE_SCALE),
                max_sequence_length: Some(defaults::MAX_SEQUENCE_LENGTH),
                frame_rule: Some(FrameRule::any_frames(
                    (self.vae.spatial_compression_ratio() * self.transformer.patch_size) as u32,
                    2,
                )),
                ..ModelDefaults::default()
            },
            ..About::guided(
                "Mochi-1 text-to-video",
                &[Lora, StorageDtype, VaeTiling, Cache, Pab, TaylorSeer],
            )
        }
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        let grid = self.grid(shape.num_frames, shape.height, shape.width);
        let own = serde_json::json!({
            "latent_tokens": self.transformer.video_tokens(grid),
            "frames_out": self.vae.decoded_frames(grid[0]),
            "vae_scale_factor_temporal": self.vae.temporal_compression_ratio(),
        });
        self.facts_with(shape, own)
    }
}

impl TextToVideoStages for Mochi {
    /// `_get_t5_prompt_embeds` of the prompt (and with guidance the negative prompt): T5 with
    /// the attention mask (pad rows not zeroed), as one batch [negative; positive]; embeddings
    /// and masks wait for the denoise stage in host memory.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let encoder = self.parts.text_encoder;
        stages::encode_prompt_batch(frame, job, encoder, &self.tokenizer, str::to_string, true)
    }

    fn denoise(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let model = &frame.hold(self.parts.transformer)?;
        let (dtype, device) = (frame.dtype(), &frame.device);
        let (embeds, mask) = job.take_masked_prompt(device)?;
        let batch = embeds.dim(0)?;
        // `prepare_latents`: the given latents, or a float32 draw, in the embeddings' dtype.
        let latents = RunDraws::take_for(frame, job, DType::F32, |draws, s| {
            self.take_latents(draws, s)
        })?;
        let mut latents = latents.to_dtype(dtype)?.to_device(device)?;
        let steps = job.num_inference_steps as usize;
        let sigmas = linear_quadratic_schedule(steps, THRESHOLD_NOISE);
        let mut scheduler = FlowMatchEuler::with_sigmas(&self.configs.scheduler, &sigmas, None)?;
        let timesteps = scheduler.timesteps().to_vec();
        let guidance_scale = job.guidance_scale;
        let denoise = Denoise::all(frame, timesteps.len(), |forwards, i| {
            let input = batch_input(&latents, batch)?;
            let timestep = Tensor::full(timesteps[i] as f32, batch, device)?.to_dtype(dtype)?;
            // diffusers' `current_timestep` (what PAB compares) is `1000 - t`, in f32.
            let current = f64::from(1000f32 - timesteps[i] as f32);
            let pred = forwards
                .dit(model, Pass::Cond, current, |m| {
                    m.prepare(&input, &timestep, &embeds, &mask)
                })?
                .to_dtype(DType::F32)?;
            // CFG and the Euler step in f32, the latents back in the run dtype.
            let pred = guide_if_batched(pred, guidance_scale)?;
            latents = scheduler
                .step(&pred, &latents.to_dtype(DType::F32)?)?
                .to_dtype(dtype)?;
            Ok(latents.clone())
        })?;
        denoise.finish_with(job, &latents)
    }

    /// De-normalise (`z·std/scaling + mean`), decode (tiled with `--vae-tiling` as
    /// `enable_tiling()`), frames in [0, 1].
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let asked = job.num_frames;
        frame.decode(job, self.parts.vae, |vae, latents, tiled| {
            let video = vae
                .with_tiling(tiled.then_some(crate::models::mochi::vae::DEFAULT_TILING))?
                .decode(&vae.denormalize(&latents)?)?
                .to_dtype(DType::F32)?;
            let made = video.dim(2)?;
            if made != asked as usize {
                frame.progress.note(&format!(
                    "note: Mochi-1 makes 6k+1 frames: {asked} frames asked, {made} made"
                ));
            }
            Ok(video)
        })
    }
}
