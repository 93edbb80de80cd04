//! Latte-1 text-to-video (maxin-cn/Latte-1) as a list of stages, step for step as diffusers'
//! `LattePipeline.__call__` (see [`crate::models::latte`] for the math).

use super::denoise::Denoise;
use super::draws::RunDraws;
use super::frame::Frame;
use super::jobs::Job;
use super::registry::FamilyOption::{GuidanceScale, NegativePrompt, Pab, StorageDtype, VaeTiling};
use super::registry::{declared_by, About, Family, RunShape, T5VideoConfigs, T5VideoPipeline};
use super::spec::TextToVideoStages;
use crate::config::video::FrameRule;
use crate::config::ModelDefaults;
use crate::models::autoencoder_kl::{AutoencoderKL, AutoencoderKLConfig};
use crate::models::guidance::{batch_input, guide_if_batched};
use crate::models::latte::transformer::{LatteTransformer3DModel, LatteTransformerConfig};
use crate::models::latte::{decode_latents, prompt, DECODE_CHUNK_FRAMES};
use crate::models::step_cache::Pass;
use crate::schedulers::ddim::{DdimConfig, DdimScheduler};
use anyhow::{Context, Result};
use candle_core::{Device, Tensor};

/// The configs of a Latte model: everything planning needs, no weights.
pub type LatteConfigs = T5VideoConfigs<LatteTransformerConfig, AutoencoderKLConfig, DdimConfig>;

/// Latte's own part of its pipeline (the frame holds the rest).
type Latte = T5VideoPipeline<LatteConfigs, LatteTransformer3DModel, AutoencoderKL>;

impl LatteConfigs {
    /// Pixels per side of one transformer token: the VAE's factor times the patch.
    fn size_step(&self) -> u32 {
        let step = self.vae.scale_factor() * self.transformer.patch_size().clamp(1, 1 << 16);
        u32::try_from(step).unwrap_or(u32::MAX)
    }
}

impl Family for LatteConfigs {
    declared_by!(Latte::opener(Some("Latte"), Latte::take_latents), stages Latte);

    /// Text-to-video with classifier-free guidance; prompts always take 120 tokens, the DDIM
    /// scheduler comes from the model, the VAE decodes frame by frame (in spatial tiles with
    /// `--vae-tiling`). The published pipeline's call defaults: 512x512 (sample_size x 8),
    /// video_length frames, 50 steps, guidance 7.5, 120 text tokens.
    fn about(&self) -> About {
        let side = self
            .transformer
            .sample_size
            .saturating_mul(self.vae.scale_factor());
        let side = u32::try_from(side).unwrap_or(u32::MAX);
        About {
            title: "Latte text-to-video",
            options: vec![GuidanceScale, NegativePrompt, StorageDtype, VaeTiling, Pab],
            defaults: ModelDefaults {
                height: Some(side),
                width: Some(side),
                num_frames: Some(u32::try_from(self.transformer.video_length).unwrap_or(u32::MAX)),
                fps: Some(8),
                num_inference_steps: Some(50),
                guidance_scale: Some(7.5),
                // Not an option here: the fixed length, so reports show what runs.
                max_sequence_length: Some(prompt::MAX_LENGTH as u32),
                frame_rule: Some(FrameRule::any_frames(self.size_step(), 1)),
                ..ModelDefaults::default()
            },
            ..About::default()
        }
    }

    /// The temporal table fixes the frame count (sizes in whole tokens are the frame rule's).
    fn size_refusal(&self, num_frames: u32, _height: u32, _width: u32) -> Option<String> {
        let frames = self.transformer.video_length as u32;
        (num_frames != frames && num_frames != 1).then(|| format!(
            "--num-frames {num_frames}: this Latte transformer's temporal position table is {frames} frames long (video_length); pass --num-frames {frames} (or 1)"
        ))
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        let own = serde_json::json!({
            "transformer_temporal_layers": self.transformer.num_layers,
            "latent_layout": "BCFHW",
            "vae_decode_chunk_frames": DECODE_CHUNK_FRAMES,
            "text_tokens": prompt::MAX_LENGTH,
            "scheduler": "DDIMScheduler",
        });
        self.facts_with(shape, own)
    }
}

impl TextToVideoStages for Latte {
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
        let (dtype, device) = (frame.dtype(), &frame.device);
        let text = job.guidance_batch(device)?;
        // `randn_tensor(shape, generator, dtype=prompt_embeds.dtype)`, or the file's draw;
        // init_noise_sigma is 1.
        let latents =
            RunDraws::take_for(frame, job, dtype, |draws, s| self.take_latents(draws, s))?;
        let steps = job.num_inference_steps as usize;
        let scheduler = DdimScheduler::new(&self.configs.scheduler, steps)?;
        let mut latents = latents.to_dtype(dtype)?.to_device(device)?;
        let timesteps = scheduler.timesteps().to_vec();
        let channels = self.configs.transformer.in_channels();
        let guidance_scale = job.guidance_scale;
        let denoise = Denoise::all(frame, timesteps.len(), |forwards, i| {
            let t = timesteps[i];
            let input = batch_input(&latents, text.dim(0)?)?;
            let timestep = Tensor::new(&[t], device)?;
            // One batched guided forward: one conditional pass, as a step cache sees it.
            let out = forwards.dit(model, Pass::Cond, t as f64, |m| {
                m.prepare(&input, &timestep, &text)
            })?;
            let noise_pred = guide_if_batched(out, guidance_scale)?;
            // The learned sigma (channels C..2C) is dropped before the step.
            let noise_pred = noise_pred.narrow(1, 0, channels)?;
            latents = scheduler.step(&noise_pred, t, &latents)?;
            Ok(latents.clone())
        })?;
        denoise.finish_with(job, &latents)
    }

    /// `decode_latents` (every frame on its own, in chunks; tiled with `--vae-tiling` as
    /// `enable_tiling()`), then `postprocess_video` to frames `[F, H, W, 3]`.
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        frame.decode(job, self.parts.vae, |vae, latents, tiled| {
            let vae = vae.with_tiling(tiled.then(|| vae.config().tiling()))?;
            Ok(decode_latents(&vae, &latents)?)
        })
    }
}
