//! LTX-Video text-to-video as a list of stages, step for step as diffusers' `LTXPipeline`
//! (the order [`crate::models::ltx`] documents).

use super::denoise::Denoise;
use super::draws::Draws;
use super::frame::{Frame, T5Pipeline};
use super::jobs::Job;
use super::registry::FamilyOption::{
    Cache, DecodeNoiseScale, DecodeTimestep, Lora, Pab, StorageDtype, TaylorSeer, VaeTiling,
};
use super::registry::{declared_by, About, Configs, Family, RunShape, T5VideoConfigs};
use super::spec::{PipelineSpec, TextToVideo, TextToVideoStages};
use super::stages;
use crate::config::video::FrameRule;
use crate::config::ModelDefaults;
use crate::models::guidance::{batch_input, guide_if_batched};
use crate::models::ltx::transformer::{LtxTransformer3DModel, LtxTransformerConfig};
use crate::models::ltx::vae::{
    add_decode_noise, AutoencoderKLLTXVideo, InjectedNoise, LtxVaeConfig, LtxVaeTiling,
};
use crate::models::ltx::{activations, defaults};
use crate::models::patches::{patchify, unpatchify};
use crate::models::step_cache::{AttentionModules, Pass};
use crate::models::t5::encoder::T5EncoderModel;
use crate::models::video::VideoDit;
use crate::rng::TorchGenerator;
use crate::schedulers::euler::{FlowMatchEuler, FlowMatchEulerConfig};
use crate::schedulers::{Scheduler, SchedulerKind};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};

/// Reads an LTX-Video model's configs (the registry's entry point).
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    Ok(Box::new(LtxConfigs::from_configs(configs)?))
}

/// The configs of an LTX-Video model: everything planning needs, no weights.
pub type LtxConfigs = T5VideoConfigs<LtxTransformerConfig, LtxVaeConfig, FlowMatchEulerConfig>;

impl LtxConfigs {
    /// The token grid the transformer sees (the latent grid in patches).
    pub fn token_grid(&self, grid: [usize; 3]) -> [usize; 3] {
        let (p, pt) = (
            self.transformer.patch_size.max(1),
            self.transformer.patch_size_t.max(1),
        );
        [grid[0] / pt, grid[1] / p, grid[2] / p]
    }

    /// The packed latents' shape `[1, tokens, C·p_t·p·p]`.
    pub fn packed_shape(&self, grid: [usize; 3]) -> [usize; 3] {
        let (p, pt) = (self.transformer.patch_size, self.transformer.patch_size_t);
        let tokens: usize = self.token_grid(grid).iter().product();
        [1, tokens, self.transformer.in_channels * pt * p * p]
    }
}

/// The components of an LTX-Video pipeline.
type Parts = TextToVideo<T5EncoderModel, LtxTransformer3DModel, AutoencoderKLLTXVideo>;

impl LtxConfigs {
    /// T5, DiT and VAE, each used by one stage and safe to defer (every component only feeds
    /// tensors forward): the pipeline as data with its components' slots.
    fn declare(&self, shape: &RunShape) -> (PipelineSpec, Parts) {
        let grid = self.grid(shape.num_frames, shape.height, shape.width);
        let tokens: usize = self.token_grid(grid).iter().product();
        let (dtype, text_len) = (shape.dtype, shape.text_len);
        // One forward runs the CFG batch [negative; positive] where guidance is on.
        let batch = shape.guidance_batch();
        let transformer = LtxTransformerConfig {
            fp8_matmul: shape.fp8_matmul,
            ..self.transformer.clone()
        };
        // Each block built on the device keeps its fp8 weight codes.
        let (fp8, block_codes) = shape.fp8_bytes(
            || activations::fp8_matmul_activations(&transformer, tokens, text_len, batch),
            || activations::fp8_block_codes(&transformer),
        );
        // PAB holds `attn1`'s and `attn2`'s outputs, both of the spatial kind (diffusers'
        // `LTXAttention` is not flagged as cross-attention).
        let attentions = AttentionModules {
            spatial: 2 * self.transformer.num_layers,
            ..Default::default()
        };
        // A step cache's states are held through the loop.
        let cache = shape.cache_bytes(
            (tokens, transformer.inner_dim()),
            (attentions, &transformer.hooked_blocks()),
            batch,
        );
        let dit =
            activations::transformer_activations(&transformer, tokens, text_len, batch, dtype)
                + fp8
                + cache;
        let outer =
            activations::outer_activations(&transformer, tokens, text_len, batch, dtype) + cache;
        let (mut spec, parts) = Parts::pipeline::<Ltx>(
            self.title(),
            (&self.text_encoder, &transformer, &self.vae),
            [
                activations::text_encoder_activations(&self.text_encoder, 1, text_len, dtype),
                dit,
                activations::vae_decode_activations(&self.vae, grid, shape.vae_tiling, dtype),
            ],
            (outer, block_codes),
        );
        // Its LoRAs may come under ComfyUI's `diffusion_model.` prefix.
        spec.components[parts.transformer.index()].lora = Some(crate::lora::Target::Transformer(
            Some(crate::weights::original::Model::LtxVideo),
        ));
        (spec, parts)
    }
}

impl Family for LtxConfigs {
    /// Text-to-video with classifier-free guidance and a timestep-conditioned decoder; flow-match
    /// Euler shifted by the video's token count, the VAE decoding whole (in spatial tiles with
    /// `--vae-tiling`). `LTXPipeline.__call__`'s defaults: 704x512, 161 frames told 25 fps, 50
    /// steps, guidance 3, 128 text tokens.
    fn about(&self) -> About {
        // One step's schedule ends at sigma 1, which `shift_terminal` cannot stretch.
        let min_steps = match self.scheduler.shift_terminal.filter(|&t| t != 0.0) {
            Some(_) => 2,
            None => 1,
        };
        About {
            schedulers: &[SchedulerKind::Euler],
            cache_blocks: Some(self.transformer.hooked_blocks()),
            defaults: ModelDefaults {
                height: Some(defaults::HEIGHT as u32),
                width: Some(defaults::WIDTH as u32),
                num_frames: Some(defaults::NUM_FRAMES as u32),
                fps: Some(defaults::FRAME_RATE as u32),
                num_inference_steps: Some(defaults::NUM_INFERENCE_STEPS as u32),
                guidance_scale: Some(defaults::GUIDANCE_SCALE),
                max_sequence_length: Some(defaults::MAX_SEQUENCE_LENGTH as u32),
                frame_rule: Some(FrameRule {
                    frame_step: self.vae.temporal_compression_ratio() as u32,
                    size_step: self.vae.spatial_compression_ratio() as u32,
                    min_steps,
                }),
                // No sampler of its own: LTX-Video samples with flow-match Euler only.
                ..ModelDefaults::default()
            },
            ..About::guided(
                "LTX-Video text-to-video",
                &[
                    DecodeTimestep,
                    DecodeNoiseScale,
                    VaeTiling,
                    Lora,
                    StorageDtype,
                    Cache,
                    Pab,
                    TaylorSeer,
                ],
            )
        }
    }

    /// The packed `latents` and, with a timestep-conditioned decoder, the `decode_noise` mixed
    /// into the unpacked latents (its `injected_noise.K` are checked as the decoder takes them).
    fn draws(&self, num_frames: u32, height: u32, width: u32) -> Vec<(&'static str, Vec<usize>)> {
        let grid = self.grid(num_frames, height, width);
        let mut draws = vec![("latents", self.packed_shape(grid).to_vec())];
        if self.vae.timestep_conditioning {
            draws.push(("decode_noise", self.transformer.latent_shape(grid).to_vec()));
        }
        draws
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        let grid = self.grid(shape.num_frames, shape.height, shape.width);
        let own = serde_json::json!({
            "latent_tokens": self.packed_shape(grid)[1],
            "vae_scale_factor_temporal": self.vae.temporal_compression_ratio(),
            "vae_timestep_conditioning": self.vae.timestep_conditioning,
        });
        self.facts_with(shape, own)
    }

    declared_by!(|configs, parts, frame| Ltx::read(configs, parts, frame, None));
}

/// The decoder's injected noise without a draws file. diffusers' decoder draws it from torch's
/// global generator, not the pipeline's; a generator seeded with the job's seed stands for it,
/// as `torch.manual_seed(S)` before the call seeds it.
fn global_rng(seed: u64) -> TorchGenerator {
    TorchGenerator::new(seed)
}

/// The injected noise of the decoder taken from the draws file as `injected_noise.K`, in order.
struct DrawnNoise<'a> {
    draws: &'a mut Draws,
    next: usize,
}

impl InjectedNoise for DrawnNoise<'_> {
    fn next(
        &mut self,
        height: usize,
        width: usize,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let name = format!("injected_noise.{}", self.next);
        self.next += 1;
        self.draws
            .take(&name, &[height, width])
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?
            .to_device(device)?
            .to_dtype(DType::F32)
    }
}

/// What a job carries between stages beside [`Job`]'s own fields.
#[derive(Default)]
struct Carried {
    /// The job's draws file, opened in the denoise stage and finished after decoding.
    draws: Option<Draws>,
    /// Without a draws file: the job's generator after the latents, whose next draw is the
    /// decode noise (diffusers draws both from its `generator`).
    generator: Option<TorchGenerator>,
}

/// Ltx's own part of its pipeline (the frame holds the rest).
type Ltx = T5Pipeline<LtxConfigs, Parts>;

impl TextToVideoStages for Ltx {
    /// `_get_t5_prompt_embeds` of the prompt (and with guidance the negative prompt): T5
    /// without attention mask (every token, `<pad>` included, attends to every token), as one
    /// batch [negative; positive] with the masks of the transformer's cross-attention; they
    /// wait for the denoise stage in host memory.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let encoder = self.parts.text_encoder;
        stages::encode_prompt_batch(frame, job, encoder, &self.tokenizer, str::to_string, false)
    }

    fn denoise(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let grid = self.configs.grid(job.num_frames, job.height, job.width);
        let token_grid = self.configs.token_grid(grid);
        let packed = self.configs.packed_shape(grid);
        let mut carried: Carried = job.carry.take();
        // The draws: `latents` (packed) from the file, or the seed's draw packed as the
        // pipeline packs it.
        let latents = match &frame.config.generation().latents {
            Some(path) => {
                let mut draws = Draws::open(path)?;
                let latents = draws.take("latents", &packed)?;
                carried.draws = Some(draws);
                latents
            }
            None => {
                let mut generator = TorchGenerator::new(job.seed);
                let latents = generator.randn(&self.configs.transformer.latent_shape(grid))?;
                carried.generator = Some(generator);
                patchify(&latents, self.configs.transformer.patch())?
            }
        };
        self.denoise_from(frame, job, latents, token_grid)?;
        job.carry.put(carried);
        Ok(())
    }

    /// Unpack, de-normalise; with a timestep-conditioned decoder mix in the decode noise and
    /// decode at `decode_timestep` with injected noise; frames in [0, 1].
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let mut carried: Carried = job.carry.take();
        let device = &frame.device;
        let held = frame.hold(self.parts.vae)?;
        let tiling = frame.config.memory().vae_tiling;
        let vae = held
            .model()?
            .with_tiling(tiling.then(LtxVaeTiling::default))?;
        let grid = self.configs.grid(job.num_frames, job.height, job.width);
        let token_grid = self.configs.token_grid(grid);
        let latents = job.latents.take().context("nothing denoised")?;
        let z = unpatchify(
            &latents.to_device(device)?,
            token_grid,
            self.configs.transformer.patch(),
        )?;
        let z = vae.denormalize(&z.to_dtype(DType::F32)?)?;
        let video = if vae.timestep_conditioning() {
            let g = frame.config.generation();
            let decode_timestep = g.decode_timestep.unwrap_or(defaults::DECODE_TIMESTEP);
            let scale = g.decode_noise_scale.unwrap_or(decode_timestep);
            let timestep = Tensor::new(&[decode_timestep as f32], device)?;
            match carried.draws.as_mut() {
                Some(draws) => {
                    let noise = draws.take("decode_noise", z.dims())?;
                    let z = add_decode_noise(&z, &noise.to_device(device)?, scale)?
                        .to_dtype(frame.dtype())?;
                    let mut injected = DrawnNoise { draws, next: 0 };
                    vae.decode(&z, Some(&timestep), &mut injected)?
                }
                None => {
                    // diffusers draws it in the run dtype (the prompt embeddings').
                    let generator = carried.generator.as_mut().context("no latents drawn")?;
                    let noise = generator
                        .randn_as(z.dims(), frame.dtype())?
                        .to_dtype(DType::F32)?
                        .to_device(device)?;
                    let z = add_decode_noise(&z, &noise, scale)?.to_dtype(frame.dtype())?;
                    vae.decode(&z, Some(&timestep), &mut global_rng(job.seed))?
                }
            }
        } else {
            let z = z.to_dtype(frame.dtype())?;
            vae.decode(&z, None, &mut global_rng(job.seed))?
        };
        if let Some(draws) = &carried.draws {
            draws.finish()?;
        }
        job.frames = Some(stages::video_frames(video)?);
        Ok(())
    }
}

impl Ltx {
    /// The denoising loop from the packed `latents` (the transformer's tokens laid out as
    /// `token_grid`).
    fn denoise_from(
        &self,
        frame: &Frame,
        job: &mut Job,
        latents: Tensor,
        token_grid: [usize; 3],
    ) -> Result<()> {
        let model = &frame.hold(self.parts.transformer)?;
        let (dtype, device) = (frame.dtype(), &frame.device);
        let (embeds, mask) = job.take_masked_prompt(device)?;
        let batch = embeds.dim(0)?;
        let rope_scale = LtxTransformerConfig::rope_interpolation_scale(
            self.configs.vae.temporal_compression_ratio(),
            self.configs.vae.spatial_compression_ratio(),
            f64::from(frame.config.output().fps),
        );
        let mut scheduler = FlowMatchEuler::for_sequence_length(
            &self.configs.scheduler,
            job.num_inference_steps as usize,
            token_grid.iter().product(),
        )?;
        let mut latents = latents.to_dtype(DType::F32)?.to_device(device)?;
        let timesteps = scheduler.timesteps().to_vec();
        let guidance_scale = job.guidance_scale;
        let denoise = Denoise::all(frame, timesteps.len(), |forwards, i| {
            let input = batch_input(&latents, batch)?.to_dtype(dtype)?;
            let timestep = Tensor::full(timesteps[i] as f32, batch, device)?;
            let pred = forwards
                .dit(model, Pass::Cond, timesteps[i], |m| {
                    m.prepare(
                        &input,
                        &embeds,
                        &timestep,
                        Some(&mask),
                        token_grid,
                        rope_scale,
                    )
                })?
                .to_dtype(DType::F32)?;
            // CFG in f32.
            let pred = guide_if_batched(pred, guidance_scale)?;
            latents = scheduler.step(&pred, &latents)?;
            Ok(latents.clone())
        })?;
        denoise.finish_with(job, &latents)
    }
}
