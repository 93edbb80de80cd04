//! Allegro text-to-video (rhymes-ai/Allegro) as a list of stages, step for step as diffusers'
//! `AllegroPipeline.__call__` with `vae.enable_tiling()` (see [`crate::models::allegro`] for the
//! math).

use super::denoise::Denoise;
use super::draws::{RunDraws, Sizes};
use super::frame::Frame;
use super::jobs::Job;
use super::registry::FamilyOption::{Pab, StorageDtype, VaeTiling};
use super::registry::{declared_by, About, Family, RunShape, T5VideoConfigs, T5VideoPipeline};
use super::spec::TextToVideoStages;
use super::stages;
use crate::config::video::FrameRule;
use crate::config::ModelDefaults;
use crate::models::allegro::defaults;
use crate::models::allegro::transformer::{AllegroTransformer3DModel, AllegroTransformerConfig};
use crate::models::allegro::vae::{AllegroVaeConfig, AutoencoderKLAllegro};
use crate::models::guidance::{batch_input, guide_if_batched};
use crate::models::step_cache::Pass;
use crate::models::t5::tokenizer::clean_caption;
use crate::schedulers::euler_ancestral::{EulerAncestral, EulerAncestralConfig};
use anyhow::Result;
use candle_core::{DType, Tensor};

/// The configs of an Allegro model: everything planning needs, no weights.
pub type AllegroConfigs =
    T5VideoConfigs<AllegroTransformerConfig, AllegroVaeConfig, EulerAncestralConfig>;

/// Allegro's own part of its pipeline (the frame holds the rest).
type Allegro = T5VideoPipeline<AllegroConfigs, AllegroTransformer3DModel, AutoencoderKLAllegro>;

impl Family for AllegroConfigs {
    declared_by!(Allegro::opener(Some("Allegro"), Allegro::take_draws), stages Allegro);

    /// Text-to-video with classifier-free guidance; its own Euler ancestral scheduler. The VAE
    /// decodes in tiles whatever `--vae-tiling` says (it has no other decode); diffusers'
    /// `AllegroPipeline` loads no LoRAs. `AllegroPipeline.__call__`'s defaults: the
    /// transformer's sample size (×8) and frames (×4), 100 steps, guidance 7.5, 512 text tokens;
    /// 15 fps (diffusers' example). Sizes in multiples of the VAE's factor times the patch.
    fn about(&self) -> About {
        let (rs, rt) = (
            self.vae.spatial_compression_ratio(),
            self.vae.temporal_compression_ratio(),
        );
        let t = &self.transformer;
        let side = |n: usize| u32::try_from(n.saturating_mul(rs)).unwrap_or(u32::MAX);
        About {
            defaults: ModelDefaults {
                height: Some(side(t.sample_height)),
                width: Some(side(t.sample_width)),
                num_frames: Some(
                    u32::try_from(t.sample_frames.saturating_mul(rt)).unwrap_or(u32::MAX),
                ),
                fps: Some(defaults::FPS),
                num_inference_steps: Some(defaults::NUM_INFERENCE_STEPS),
                guidance_scale: Some(defaults::GUIDANCE_SCALE),
                max_sequence_length: Some(defaults::MAX_SEQUENCE_LENGTH),
                frame_rule: Some(FrameRule::any_frames(
                    side(t.patch_size.clamp(1, 1 << 16)),
                    1,
                )),
                ..ModelDefaults::default()
            },
            ..About::guided("Allegro text-to-video", &[StorageDtype, VaeTiling, Pab])
        }
    }

    /// The VAE decodes whole tiles only (diffusers fails on latents smaller than a tile).
    fn size_refusal(&self, num_frames: u32, height: u32, width: u32) -> Option<String> {
        let grid = self.grid(num_frames, height, width);
        self.vae.decode_refusal(grid).map(|why| {
            let [f, h, w] = self.vae.tile();
            format!("{num_frames} frames of {height}x{width}: {why}; the Allegro VAE decodes in tiles of {f} frames of {h}x{w} pixels: pass a size made of whole tiles (--num-frames {f}, --height {h}, --width {w} always decode)")
        })
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        let grid = self.grid(shape.num_frames, shape.height, shape.width);
        let own = serde_json::json!({
            "latent_layout": "BCFHW",
            "latent_tokens": self.transformer.video_tokens(grid),
            "vae_scale_factor_temporal": self.vae.temporal_compression_ratio(),
            "vae_tile": self.vae.tile(),
            "vae_tiles": self.vae.tiles(grid),
            "scheduler": "EulerAncestralDiscreteScheduler",
        });
        self.facts_with(shape, own)
    }
}

impl Allegro {
    /// Every draw of a run, in the order diffusers makes them: the initial latents, then one
    /// scheduler noise per step.
    fn take_draws(&self, draws: &mut RunDraws, sizes: Sizes) -> Result<(Tensor, Vec<Tensor>)> {
        let shape = self
            .configs
            .latent_shape(sizes.num_frames, sizes.height, sizes.width);
        let latents = draws.take("latents", &shape)?;
        let noises = (0..sizes.steps)
            .map(|i| draws.take(&format!("step{i}.scheduler_noise.0"), &shape))
            .collect::<Result<_>>()?;
        Ok((latents, noises))
    }
}

impl TextToVideoStages for Allegro {
    /// Encodes the prompt (and with guidance the negative prompt), each cleaned and padded to
    /// `max_sequence_length` tokens, as one batch [negative; positive]; embeddings and masks
    /// wait for the denoise stage in host memory.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let encoder = self.parts.text_encoder;
        stages::encode_prompt_batch(frame, job, encoder, &self.tokenizer, clean_caption, true)
    }

    fn denoise(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let model = &frame.hold(self.parts.transformer)?;
        let (dtype, device) = (frame.dtype(), &frame.device);
        let (embeds, mask) = job.take_masked_prompt(device)?;
        let batch = embeds.dim(0)?;
        let (latents, noises) = RunDraws::take_for(frame, job, dtype, |draws, sizes| {
            self.take_draws(draws, sizes)
        })?;
        let scheduler =
            EulerAncestral::new(&self.configs.scheduler, job.num_inference_steps as usize)?;
        // `prepare_latents`: the draw in the run dtype times init_noise_sigma (an f32 0-dim
        // tensor: computed in f32, rounded to the run dtype).
        let sigma = Tensor::new(scheduler.init_noise_sigma(), device)?;
        let mut latents = latents
            .to_dtype(dtype)?
            .to_device(device)?
            .to_dtype(DType::F32)?
            .broadcast_mul(&sigma)?
            .to_dtype(dtype)?;
        let timesteps = scheduler.timesteps().to_vec();
        let guidance_scale = job.guidance_scale;
        let denoise = Denoise::all(frame, timesteps.len(), |forwards, i| {
            let input = batch_input(&latents, batch)?;
            let input = scheduler.scale_model_input(&input, i)?;
            let timestep = Tensor::full(timesteps[i], batch, device)?;
            // One batched guided forward: one conditional pass, as a step cache sees it.
            let pred = forwards.dit(model, Pass::Cond, timesteps[i] as f64, |m| {
                m.prepare(&input, &timestep, &embeds, &mask)
            })?;
            let pred = guide_if_batched(pred, guidance_scale)?;
            let noise = noises[i].to_device(device)?;
            latents = scheduler.step(&pred, &latents, &noise, i)?;
            Ok(latents.clone())
        })?;
        denoise.finish_with(job, &latents)
    }

    /// `decode_latents` (`1 / scaling_factor · z`, tiled decode), cropped to the asked frames
    /// and size, then `postprocess_video` to frames `[T, H, W, 3]`.
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let (frames, height, width) = (job.num_frames, job.height, job.width);
        frame.decode(job, self.parts.vae, |vae, latents, _always_tiled| {
            Ok(vae
                .decode(&vae.unscale(&latents)?)?
                .narrow(2, 0, frames as usize)?
                .narrow(3, 0, height as usize)?
                .narrow(4, 0, width as usize)?
                .to_dtype(DType::F32)?)
        })
    }
}
