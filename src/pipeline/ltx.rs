//! LTX-Video text-to-video as a list of stages, step for step as diffusers' `LTXPipeline`
//! (the order [`crate::models::ltx`] documents).

use super::denoise::Denoise;
use super::draws::Draws;
use super::frame::Frame;
use super::jobs::Job;
use super::placement::Held;
use super::registry::{Configs, Family, FamilyOption, RunShape};
use super::spec::{PipelineSpec, StageSpec, TextToVideo};
use super::stages;
use crate::config::video::FrameRule;
use crate::config::ModelDefaults;
use crate::models::guidance::guide_batched;
use crate::models::ltx::transformer::{
    pack_latents, unpack_latents, LtxStream, LtxTransformer3DModel, LtxTransformerConfig,
};
use crate::models::ltx::vae::{
    add_decode_noise, AutoencoderKLLTXVideo, InjectedNoise, LtxVaeConfig,
};
use crate::models::ltx::{activations, defaults};
use crate::models::source::FileRef;
use crate::models::t5::encoder::{attention_mask, encode_unmasked, T5Config, T5EncoderModel};
use crate::models::t5::tokenizer::PromptTokenizer;
use crate::rng::TorchGenerator;
use crate::schedulers::euler::{FlowMatchEuler, FlowMatchEulerConfig};
use crate::schedulers::{Scheduler, SchedulerKind};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use std::any::Any;

/// Reads an LTX-Video model's configs (the registry's entry point).
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    Ok(Box::new(LtxConfigs::from_configs(configs)?))
}

/// The configs of an LTX-Video model: everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct LtxConfigs {
    pub transformer: LtxTransformerConfig,
    pub vae: LtxVaeConfig,
    pub text_encoder: T5Config,
    pub scheduler: FlowMatchEulerConfig,
}

impl LtxConfigs {
    /// Reads every component's config.
    pub fn from_configs(configs: Configs) -> Result<Self> {
        Ok(LtxConfigs {
            transformer: configs.read("transformer/config.json")?,
            vae: configs.read("vae/config.json")?,
            text_encoder: configs.read("text_encoder/config.json")?,
            scheduler: configs.read("scheduler/scheduler_config.json")?,
        })
    }

    /// The latent grid `[F', H', W']` of a video size (the pipeline's `latent_num_frames`,
    /// `latent_height`, `latent_width`).
    pub fn grid(&self, num_frames: u32, height: u32, width: u32) -> [usize; 3] {
        let (r_t, r_s) = (
            self.vae.temporal_compression_ratio(),
            self.vae.spatial_compression_ratio(),
        );
        [
            (num_frames as usize).saturating_sub(1) / r_t + 1,
            height as usize / r_s,
            width as usize / r_s,
        ]
    }

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

    /// The latents' shape `[1, C, F', H', W']`.
    fn latent_shape(&self, grid: [usize; 3]) -> [usize; 5] {
        [1, self.transformer.in_channels, grid[0], grid[1], grid[2]]
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
        let mut spec = PipelineSpec::titled(self.title());
        let parts = Parts::declare(&mut spec, &self.text_encoder, &self.transformer, &self.vae);
        let (c, dtype, text_len) = (&parts, shape.dtype, shape.text_len);
        let text = activations::text_encoder_activations(&self.text_encoder, 1, text_len, dtype);
        let dit =
            activations::transformer_activations(&self.transformer, tokens, text_len, 2, dtype);
        let vae = activations::vae_decode_activations(&self.vae, grid);
        spec.stages = vec![
            StageSpec::new("encode_text", &[c.text_encoder.index()], text).runs(Ltx::encode_text),
            StageSpec::new("denoise", &[c.transformer.index()], dit).runs(Ltx::denoise),
            StageSpec::new("decode", &[c.vae.index()], vae).runs(Ltx::decode),
            StageSpec::write(),
        ];
        (spec, parts)
    }
}

impl Family for LtxConfigs {
    fn title(&self) -> &'static str {
        "LTX-Video text-to-video"
    }

    fn spec(&self, shape: &RunShape) -> PipelineSpec {
        self.declare(shape).0
    }

    /// Text-to-video with classifier-free guidance and a timestep-conditioned decoder; flow-match
    /// Euler shifted by the video's token count, the VAE decoding whole.
    fn options(&self) -> Vec<FamilyOption> {
        let decoder = [FamilyOption::DecodeTimestep, FamilyOption::DecodeNoiseScale];
        [&FamilyOption::GUIDED[..], &decoder, &[FamilyOption::Lora]].concat()
    }

    fn schedulers(&self) -> &'static [SchedulerKind] {
        &[SchedulerKind::Euler]
    }

    /// The packed `latents` and, with a timestep-conditioned decoder, the `decode_noise` mixed
    /// into the unpacked latents (its `injected_noise.K` are checked as the decoder takes them).
    fn draws(&self, num_frames: u32, height: u32, width: u32) -> Vec<(&'static str, Vec<usize>)> {
        let grid = self.grid(num_frames, height, width);
        let mut draws = vec![("latents", self.packed_shape(grid).to_vec())];
        if self.vae.timestep_conditioning {
            draws.push(("decode_noise", self.latent_shape(grid).to_vec()));
        }
        draws
    }

    /// `LTXPipeline.__call__`'s defaults: 704x512, 161 frames told 25 fps, 50 steps, guidance 3,
    /// 128 text tokens.
    fn defaults(&self) -> ModelDefaults {
        ModelDefaults {
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
                // One step's schedule ends at sigma 1, which `shift_terminal` cannot stretch.
                min_steps: match self.scheduler.shift_terminal.filter(|&t| t != 0.0) {
                    Some(_) => 2,
                    None => 1,
                },
            }),
            // LTX-Video samples with flow-match Euler only (`schedulers`).
            scheduler: None,
            image: false,
        }
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        let grid = self.grid(shape.num_frames, shape.height, shape.width);
        serde_json::json!({
            "transformer_layers": self.transformer.num_layers,
            "transformer_inner_dim": self.transformer.inner_dim(),
            "latent_shape": self.latent_shape(grid),
            "latent_tokens": self.packed_shape(grid)[1],
            "vae_scale_factor_spatial": self.vae.spatial_compression_ratio(),
            "vae_scale_factor_temporal": self.vae.temporal_compression_ratio(),
            "vae_timestep_conditioning": self.vae.timestep_conditioning,
            "text_encoder_layers": self.text_encoder.num_layers,
        })
    }

    fn open(&self, frame: &Frame) -> Result<Box<dyn Any>> {
        let (_, parts) = self.declare(&RunShape::of(&frame.config));
        Ok(Box::new(Ltx::new(self.clone(), parts, frame)?))
    }
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
    /// The cross-attention mask `[B, L]` of the prompt embeddings ([negative; positive] with
    /// guidance).
    mask: Option<Tensor>,
    /// The job's draws file, opened in the denoise stage and finished after decoding.
    draws: Option<Draws>,
    /// Without a draws file: the job's generator after the latents, whose next draw is the
    /// decode noise (diffusers draws both from its `generator`).
    generator: Option<TorchGenerator>,
}

/// LTX-Video's own part of its pipeline (the frame holds the rest).
struct Ltx {
    configs: LtxConfigs,
    parts: Parts,
    tokenizer: PromptTokenizer,
}

impl Ltx {
    /// Reads the tokenizer; loads no weights.
    fn new(configs: LtxConfigs, parts: Parts, frame: &Frame) -> Result<Self> {
        let tokenizer = match frame.source.require("tokenizer/tokenizer.json")? {
            FileRef::Path(p) => PromptTokenizer::from_file(&p)?,
            FileRef::Embedded(text) => PromptTokenizer::from_json(text)?,
        };
        Ok(Ltx {
            configs,
            parts,
            tokenizer,
        })
    }

    /// `_get_t5_prompt_embeds` for each text: T5 without attention mask (every token, `<pad>`
    /// included, attends to every token), blocks resident or streamed, the texts through the
    /// blocks together; each with its mask for the transformer's cross-attention, in host memory.
    fn embed(
        &self,
        frame: &Frame,
        encoder: &Held<'_, T5EncoderModel>,
        texts: &[&str],
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let max_len = frame.config.generation().max_sequence_length;
        let tokens = texts
            .iter()
            .map(|text| self.tokenizer.encode(text, max_len))
            .collect::<Result<Vec<_>>>()?;
        let ids: Vec<&[u32]> = tokens.iter().map(|(ids, _)| ids.as_slice()).collect();
        encode_unmasked(encoder, &ids)?
            .into_iter()
            .zip(&tokens)
            .map(|(embeds, (_, len))| {
                Ok((
                    embeds.to_dtype(frame.dtype())?.to_device(&Device::Cpu)?,
                    attention_mask(&[*len], max_len, &Device::Cpu)?,
                ))
            })
            .collect()
    }

    /// Encodes the prompt (and with guidance the negative prompt); the embeddings wait for the
    /// denoise stage in host memory.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let encoder = frame.hold(self.parts.text_encoder)?;
        let mut texts = vec![job.prompt.as_str()];
        if job.guidance_scale > 1.0 {
            texts.push(job.negative_prompt.as_str());
        }
        let mut encoded = self.embed(frame, &encoder, &texts)?.into_iter();
        drop(encoder);
        let (embeds, mask) = encoded.next().context("no prompt embeddings")?;
        // With guidance, one batch: [negative; positive].
        let (embeds, mask) = match encoded.next() {
            Some((neg, neg_mask)) => (
                Tensor::cat(&[&neg, &embeds], 0)?,
                Tensor::cat(&[&neg_mask, &mask], 0)?,
            ),
            None => (embeds, mask),
        };
        job.prompt_embeds = Some(embeds);
        job.carry.put(Carried {
            mask: Some(mask),
            draws: None,
            generator: None,
        });
        Ok(())
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
                let latents = generator.randn(&self.configs.latent_shape(grid))?;
                carried.generator = Some(generator);
                pack_latents(
                    &latents,
                    self.configs.transformer.patch_size,
                    self.configs.transformer.patch_size_t,
                )?
            }
        };
        let mask = carried.mask.take();
        self.denoise_from(frame, job, latents, token_grid, mask)?;
        job.carry.put(carried);
        Ok(())
    }

    fn denoise_from(
        &self,
        frame: &Frame,
        job: &mut Job,
        latents: Tensor,
        token_grid: [usize; 3],
        mask: Option<Tensor>,
    ) -> Result<()> {
        let model = &frame.hold(self.parts.transformer)?;
        let dtype = frame.dtype();
        let device = &frame.device;
        let embeds = job
            .prompt_embeds
            .take()
            .context("prompt not encoded")?
            .to_device(device)?;
        let mask = mask.context("prompt not encoded")?.to_device(device)?;
        let batch = embeds.dim(0)?;
        let guided = batch > 1;
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
        let mut denoise = Denoise::new(frame, timesteps.len());
        denoise.run(0..timesteps.len(), |forwards, i| {
            let input = Tensor::cat(&vec![&latents; batch], 0)?.to_dtype(dtype)?;
            let timestep = Tensor::full(timesteps[i] as f32, batch, device)?;
            let pred = forwards
                .run(|| {
                    dit_forward(
                        model, &input, &embeds, &timestep, &mask, token_grid, rope_scale,
                    )
                })?
                .to_dtype(DType::F32)?;
            // CFG in f32.
            let pred = match guided {
                true => guide_batched(&pred, guidance_scale)?,
                false => pred,
            };
            latents = scheduler.step(&pred, &latents)?;
            Ok(latents.clone())
        })?;
        denoise.finish(job);
        job.latents = Some(latents.to_device(&Device::Cpu)?);
        job.prompt_embeds = None;
        Ok(())
    }

    /// Unpack, de-normalise; with a timestep-conditioned decoder mix in the decode noise and
    /// decode at `decode_timestep` with injected noise; frames in [0, 1].
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let mut carried: Carried = job.carry.take();
        let device = &frame.device;
        let held = frame.hold(self.parts.vae)?;
        let vae = held.model();
        let grid = self.configs.grid(job.num_frames, job.height, job.width);
        let token_grid = self.configs.token_grid(grid);
        let latents = job.latents.take().context("nothing denoised")?;
        let z = unpack_latents(
            &latents.to_device(device)?,
            token_grid[0],
            token_grid[1],
            token_grid[2],
            self.configs.transformer.patch_size,
            self.configs.transformer.patch_size_t,
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

/// One DiT forward over the CFG batch: prepare, the blocks (resident or streamed), finish.
pub fn dit_forward(
    dit: &Held<'_, LtxTransformer3DModel>,
    latents: &Tensor,
    embeds: &Tensor,
    timestep: &Tensor,
    mask: &Tensor,
    grid: [usize; 3],
    rope_scale: [f64; 3],
) -> candle_core::Result<Tensor> {
    let model = dit.model();
    let mut inputs = model.prepare(latents, embeds, timestep, Some(mask), grid, rope_scale)?;
    let x = LtxStream::new(inputs.take_hidden_states()?);
    let x = dit.fold_blocks(LtxTransformer3DModel::blocks, x, |block, x| {
        block.forward(x.clone(), &inputs)
    })?;
    model.finish(&x.into_hidden()?, &inputs)
}
