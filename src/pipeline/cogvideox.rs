//! CogVideoX text-to-video (THUDM/CogVideoX-5b) as a list of stages, step for step as
//! diffusers' `CogVideoXPipeline.__call__` (see [`crate::models::cogvideox`] for the math).

use super::denoise::Denoise;
use super::draws::{RunDraws, Sizes};
use super::frame::Frame;
use super::jobs::Job;
use super::registry::FamilyOption::{Cache, Lora, Pab, StorageDtype, TaylorSeer, VaeTiling};
use super::registry::{
    declared_by, About, Family, RunShape, T5Parts, T5VideoConfigs, T5VideoPipeline,
};
use super::spec::TextToVideoStages;
use super::stages;
use crate::config::ModelDefaults;
use crate::models::cogvideox::guidance;
use crate::models::cogvideox::transformer::{
    CogVideoXTransformer3DModel, CogVideoXTransformerConfig,
};
use crate::models::cogvideox::vae::{AutoencoderKLCogVideoX, CogVideoXVaeConfig};
use crate::models::guidance::batch_input;
use crate::models::step_cache::Pass;
use crate::models::video::DenoiseActivations;
use crate::schedulers::cogvideox::{CogVideoXSampler, CogVideoXSchedulerConfig};
use anyhow::Result;
use candle_core::{DType, Tensor};

/// The configs of a CogVideoX model: everything planning needs, no weights.
pub type CogVideoXConfigs =
    T5VideoConfigs<CogVideoXTransformerConfig, CogVideoXVaeConfig, CogVideoXSchedulerConfig>;

/// CogVideoX's own part of its pipeline (the frame holds the rest).
type CogVideoX =
    T5VideoPipeline<CogVideoXConfigs, CogVideoXTransformer3DModel, AutoencoderKLCogVideoX>;

impl Family for CogVideoXConfigs {
    declared_by!(CogVideoX::new, stages CogVideoX);

    /// Text-to-video with classifier-free guidance; the DDIM or DPM sampler its checkpoint names, its VAE decodes
    /// frame-batched, in spatial tiles with `--vae-tiling`. The published pipeline's call
    /// defaults: 480x720, 49 frames at 8 fps, 50 steps, guidance 6, 226 text tokens.
    fn about(&self) -> About {
        About {
            // 4k+1 frames (the VAE's 4x in time), sizes in multiples of 16 (8x space, patch 2).
            defaults: ModelDefaults::video(480, 720, 49, 8).sampling(50, 6.0, 226),
            cache_blocks: Some(DenoiseActivations::hooked_blocks(&self.transformer)),
            ..About::guided(
                "CogVideoX text-to-video",
                &[Lora, StorageDtype, VaeTiling, Cache, Pab, TaylorSeer],
            )
        }
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        let own = serde_json::json!({
            "latent_layout": "BFCHW",
            "vae_scale_factor_temporal": self.vae.scale_factor_temporal(),
            "scheduler": self.scheduler.class_name,
        });
        self.facts_with(shape, own)
    }
}

impl CogVideoX {
    /// Reads the tokenizer and checks the draws file against the run's sizes; loads no weights.
    /// (The sampler the scheduler config names was checked with every config as the model was
    /// read.)
    fn new(
        configs: CogVideoXConfigs,
        parts: T5Parts<CogVideoXTransformer3DModel, AutoencoderKLCogVideoX>,
        frame: &Frame,
    ) -> Result<Self> {
        let pipeline = Self::read(configs, parts, frame, Some("CogVideoX"))?;
        pipeline.checking_draws(frame, Self::take_draws)
    }

    /// Every draw of a run, in the order diffusers makes them: the initial latents, then each
    /// step's scheduler noise (DPM: the last of the step's draws is the one it uses; DDIM draws
    /// none).
    fn take_draws(
        &self,
        draws: &mut RunDraws,
        sizes: Sizes,
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        let shape = self
            .configs
            .latent_shape(sizes.num_frames, sizes.height, sizes.width);
        let steps = sizes.steps as usize;
        let sampler = CogVideoXSampler::new(&self.configs.scheduler, steps)?;
        let latents = draws.take("latents", &shape)?;
        let mut noises = Vec::with_capacity(steps);
        for i in 0..steps {
            let mut last = None;
            for k in 0..sampler.draws_at(i) {
                last = Some(draws.take(&format!("step{i}.scheduler_noise.{k}"), &shape)?);
            }
            noises.push(last);
        }
        Ok((latents, noises))
    }
}

impl TextToVideoStages for CogVideoX {
    /// Encodes the prompts (the negative one when guided): T5's `last_hidden_state` `[1, L,
    /// text_dim]` of the padded ids without a mask (the prompt is not cleaned); the embeddings
    /// wait for the denoise stage in host memory.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let encoder = frame.hold(self.parts.text_encoder)?;
        let texts = job.texts(guidance::is_guided(job.guidance_scale));
        let embeds = stages::t5_embeds(frame, &encoder, &self.tokenizer, &texts, false)?;
        let mut embeds = embeds.into_iter().map(|(embeds, _)| embeds);
        job.prompt_embeds = embeds.next();
        job.negative_embeds = embeds.next();
        Ok(())
    }

    fn denoise(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let model = &frame.hold(self.parts.transformer)?;
        let (dtype, device) = (frame.dtype(), &frame.device);
        let text = job.guidance_batch(device)?;
        let guided = text.dim(0)? > 1;
        let (latents, noises) = RunDraws::take_for(frame, job, dtype, |draws, sizes| {
            self.take_draws(draws, sizes)
        })?;
        let steps = job.num_inference_steps as usize;
        let mut scheduler = CogVideoXSampler::new(&self.configs.scheduler, steps)?;
        // init_noise_sigma is 1: the latents are used as drawn.
        let mut latents = latents.to_dtype(dtype)?.to_device(device)?;
        let timesteps = scheduler.timesteps().to_vec();
        let guidance_scale = job.guidance_scale;
        let denoise = Denoise::all(frame, timesteps.len(), |forwards, i| {
            let t = timesteps[i];
            let input = batch_input(&latents, text.dim(0)?)?;
            let timestep = Tensor::new(&[t], device)?;
            let out = forwards
                .dit(model, Pass::Cond, t as f64, |m| {
                    m.prepare(&input, &timestep, &text)
                })?
                .to_dtype(DType::F32)?;
            let noise_pred = if guided {
                let scale = guidance::scale_at(guidance_scale, false, t, steps);
                guidance::apply(&out.narrow(0, 0, 1)?, &out.narrow(0, 1, 1)?, scale)?
            } else {
                out
            };
            let noise = noises[i]
                .as_ref()
                .map(|n| n.to_dtype(DType::F32)?.to_device(device))
                .transpose()?;
            latents = scheduler
                .step(&noise_pred, &latents.to_dtype(DType::F32)?, noise.as_ref())?
                .to_dtype(dtype)?;
            Ok(latents.clone())
        })?;
        denoise.finish_with(job, &latents)
    }

    /// `decode_latents` (permute to `[B, C, F, H, W]`, times 1/scaling_factor, frame-batched
    /// decode, tiled with `--vae-tiling` as `enable_tiling()`) and `postprocess_video` to frames
    /// `[T, H, W, 3]` in [0, 1].
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        frame.decode(job, self.parts.vae, |vae, latents, tiled| {
            let z = vae.scale_latents(&latents)?;
            let video = match tiled {
                true => vae.decode_tiled(&z, &vae.config().tiling())?,
                false => vae.decode(&z)?,
            };
            Ok(video.to_dtype(DType::F32)?)
        })
    }
}
