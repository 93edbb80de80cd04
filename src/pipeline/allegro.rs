//! Allegro text-to-video (rhymes-ai/Allegro) as a list of stages, step for step as diffusers'
//! `AllegroPipeline.__call__` with `vae.enable_tiling()` (see [`crate::models::allegro`] for the
//! math).

use super::denoise::Denoise;
use super::draws::{Draws, RunDraws};
use super::frame::Frame;
use super::jobs::Job;
use super::placement::Held;
use super::registry::{Configs, Family, FamilyOption, RunShape};
use super::spec::{PipelineSpec, StageSpec, TextToVideo};
use super::stages;
use crate::config::video::FrameRule;
use crate::config::{ModelDefaults, UsageError};
use crate::models::allegro::transformer::{AllegroTransformer3DModel, AllegroTransformerConfig};
use crate::models::allegro::vae::{AllegroVaeConfig, AutoencoderKLAllegro};
use crate::models::allegro::{activations, defaults};
use crate::models::cogvideox::activations::text_encoder_activations;
use crate::models::guidance::guide_batched;
use crate::models::source::FileRef;
use crate::models::t5::encoder::{attention_mask, encode_masked, T5Config, T5EncoderModel};
use crate::models::t5::tokenizer::{clean_caption, PromptTokenizer};
use crate::rng::TorchGenerator;
use crate::schedulers::euler_ancestral::{EulerAncestral, EulerAncestralConfig};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use std::any::Any;

/// Reads an Allegro model's configs (the registry's entry point).
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    Ok(Box::new(AllegroConfigs::from_configs(configs)?))
}

/// The configs of an Allegro model: everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct AllegroConfigs {
    pub transformer: AllegroTransformerConfig,
    pub vae: AllegroVaeConfig,
    pub text_encoder: T5Config,
    pub scheduler: EulerAncestralConfig,
}

/// The components of an Allegro pipeline.
type Parts = TextToVideo<T5EncoderModel, AllegroTransformer3DModel, AutoencoderKLAllegro>;

impl AllegroConfigs {
    /// Reads every component's config.
    pub fn from_configs(configs: Configs) -> Result<Self> {
        Ok(AllegroConfigs {
            transformer: configs.read("transformer/config.json")?,
            vae: configs.read("vae/config.json")?,
            text_encoder: configs.read("text_encoder/config.json")?,
            scheduler: configs.read("scheduler/scheduler_config.json")?,
        })
    }

    /// The latent grid `[F, h, w]` of a video size (`prepare_latents`): `⌈n / rt⌉` frames for
    /// an even count n, `⌈(n − 1) / rt⌉ + 1` for an odd one.
    pub fn grid(&self, num_frames: u32, height: u32, width: u32) -> [usize; 3] {
        let (rt, rs) = (
            self.vae.temporal_compression_ratio().max(1),
            self.vae.spatial_compression_ratio(),
        );
        let n = num_frames as usize;
        let frames = if n.is_multiple_of(2) {
            n.div_ceil(rt)
        } else {
            n.saturating_sub(1).div_ceil(rt) + 1
        };
        [frames, height as usize / rs, width as usize / rs]
    }

    /// The latents' shape `[1, C, F, h, w]`.
    pub fn latent_shape(&self, grid: [usize; 3]) -> [usize; 5] {
        [1, self.transformer.in_channels, grid[0], grid[1], grid[2]]
    }

    /// Video tokens of a latent grid.
    fn tokens(&self, grid: [usize; 3]) -> usize {
        let p = self.transformer.patch_size.max(1);
        grid[0] * (grid[1] / p) * (grid[2] / p)
    }

    /// T5, DiT and VAE, each used by one stage and safe to defer: the pipeline as data with its
    /// components' slots.
    fn declare(&self, shape: &RunShape) -> (PipelineSpec, Parts) {
        let grid = self.grid(shape.num_frames, shape.height, shape.width);
        let mut spec = PipelineSpec::titled(self.title());
        let parts = Parts::declare(&mut spec, &self.text_encoder, &self.transformer, &self.vae);
        let (c, dtype, text_len) = (&parts, shape.dtype, shape.text_len);
        let text = text_encoder_activations(&self.text_encoder, text_len, dtype);
        let dit = activations::transformer_activations(
            &self.transformer,
            self.tokens(grid),
            text_len,
            2,
            dtype,
        );
        let vae = activations::vae_decode_activations(&self.vae, grid, dtype);
        spec.stages = vec![
            StageSpec::new("encode_text", &[c.text_encoder.index()], text)
                .runs(Allegro::encode_text),
            StageSpec::new("denoise", &[c.transformer.index()], dit).runs(Allegro::denoise),
            StageSpec::new("decode", &[c.vae.index()], vae).runs(Allegro::decode),
            StageSpec::write(),
        ];
        (spec, parts)
    }
}

impl Family for AllegroConfigs {
    fn title(&self) -> &'static str {
        "Allegro text-to-video"
    }

    fn spec(&self, shape: &RunShape) -> PipelineSpec {
        self.declare(shape).0
    }

    /// Text-to-video with classifier-free guidance; its own Euler ancestral scheduler. The VAE
    /// decodes in tiles whatever `--vae-tiling` says (it has no other decode); diffusers'
    /// `AllegroPipeline` loads no LoRAs.
    fn options(&self) -> Vec<FamilyOption> {
        [&FamilyOption::GUIDED[..], &[FamilyOption::VaeTiling]].concat()
    }

    /// The VAE decodes whole tiles only (diffusers fails on latents smaller than a tile).
    fn size_refusal(&self, num_frames: u32, height: u32, width: u32) -> Option<String> {
        let grid = self.grid(num_frames, height, width);
        self.vae.decode_refusal(grid).map(|why| {
            let [f, h, w] = self.vae.tile();
            format!("{num_frames} frames of {height}x{width}: {why}; the Allegro VAE decodes in tiles of {f} frames of {h}x{w} pixels: pass a size made of whole tiles (--num-frames {f}, --height {h}, --width {w} always decode)")
        })
    }

    fn draws(&self, num_frames: u32, height: u32, width: u32) -> Vec<(&'static str, Vec<usize>)> {
        let grid = self.grid(num_frames, height, width);
        vec![("latents", self.latent_shape(grid).to_vec())]
    }

    /// `AllegroPipeline.__call__`'s defaults: the transformer's sample size (×8) and frames
    /// (×4), 100 steps, guidance 7.5, 512 text tokens; 15 fps (diffusers' example). Sizes in
    /// multiples of the VAE's factor times the patch.
    fn defaults(&self) -> ModelDefaults {
        let (rs, rt) = (
            self.vae.spatial_compression_ratio(),
            self.vae.temporal_compression_ratio(),
        );
        let t = &self.transformer;
        let side = |n: usize| u32::try_from(n.saturating_mul(rs)).unwrap_or(u32::MAX);
        ModelDefaults {
            height: Some(side(t.sample_height)),
            width: Some(side(t.sample_width)),
            num_frames: Some(u32::try_from(t.sample_frames.saturating_mul(rt)).unwrap_or(u32::MAX)),
            fps: Some(defaults::FPS),
            num_inference_steps: Some(defaults::NUM_INFERENCE_STEPS),
            guidance_scale: Some(defaults::GUIDANCE_SCALE),
            max_sequence_length: Some(defaults::MAX_SEQUENCE_LENGTH),
            image: false,
            frame_rule: Some(FrameRule {
                frame_step: 1,
                size_step: side(t.patch_size.clamp(1, 1 << 16)),
                min_steps: 1,
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
            "latent_layout": "BCFHW",
            "latent_tokens": self.tokens(grid),
            "vae_scale_factor_spatial": self.vae.spatial_compression_ratio(),
            "vae_scale_factor_temporal": self.vae.temporal_compression_ratio(),
            "vae_tile": self.vae.tile(),
            "vae_tiles": self.vae.tiles(grid),
            "text_encoder_layers": self.text_encoder.num_layers,
            "scheduler": "EulerAncestralDiscreteScheduler",
        })
    }

    fn open(&self, frame: &Frame) -> Result<Box<dyn Any>> {
        let (_, parts) = self.declare(&RunShape::of(&frame.config));
        Ok(Box::new(Allegro::new(self.clone(), parts, frame)?))
    }
}

/// What a job carries from the text stage to the denoise stage beside its embeddings.
#[derive(Default)]
struct Carried {
    /// The prompt masks `[B, L]` ([negative; positive] with guidance).
    mask: Option<Tensor>,
}

/// Allegro's own part of its pipeline (the frame holds the rest).
struct Allegro {
    configs: AllegroConfigs,
    parts: Parts,
    tokenizer: PromptTokenizer,
}

impl Allegro {
    /// Reads the tokenizer and checks the draws file against the run's sizes; loads no weights.
    fn new(configs: AllegroConfigs, parts: Parts, frame: &Frame) -> Result<Self> {
        let tokenizer_json = frame.source.require("tokenizer/tokenizer.json").context(
            "Allegro reads tokenizer/tokenizer.json; where a checkpoint ships only spiece.model, write it once with transformers: T5TokenizerFast.from_pretrained(folder, subfolder=\"tokenizer\").save_pretrained(folder + \"/tokenizer\")",
        )?;
        let tokenizer = match tokenizer_json {
            FileRef::Path(p) => PromptTokenizer::from_file(&p)?,
            FileRef::Embedded(text) => PromptTokenizer::from_json(text)?,
        };
        let pipeline = Allegro {
            configs,
            parts,
            tokenizer,
        };
        // A draws file that does not fit the run is bad input, found before anything loads.
        if let Some(path) = &frame.config.generation().latents {
            let o = frame.config.video();
            let mut draws = RunDraws::File(Draws::open(path).map_err(UsageError::from_error)?);
            pipeline
                .take_draws(
                    &mut draws,
                    o.num_frames,
                    o.height,
                    o.width,
                    o.num_inference_steps,
                )
                .and_then(|_| draws.finish())
                .map_err(UsageError::from_error)?;
        }
        Ok(pipeline)
    }

    /// Every draw of a run, in the order diffusers makes them: the initial latents, then one
    /// scheduler noise per step.
    fn take_draws(
        &self,
        draws: &mut RunDraws,
        num_frames: u32,
        height: u32,
        width: u32,
        steps: u32,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let shape = self
            .configs
            .latent_shape(self.configs.grid(num_frames, height, width));
        let latents = draws.take("latents", &shape)?;
        let noises = (0..steps)
            .map(|i| draws.take(&format!("step{i}.scheduler_noise.0"), &shape))
            .collect::<Result<_>>()?;
        Ok((latents, noises))
    }

    /// Encodes the prompt (and with guidance the negative prompt), each cleaned and padded to
    /// `max_sequence_length` tokens, as one batch [negative; positive]; embeddings and masks
    /// wait for the denoise stage in host memory.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let encoder = frame.hold(self.parts.text_encoder)?;
        let max_len = frame.config.generation().max_sequence_length;
        let mut texts = vec![job.prompt.as_str()];
        if job.guidance_scale > 1.0 {
            texts.push(job.negative_prompt.as_str());
        }
        let tokens = texts
            .iter()
            .map(|text| self.tokenizer.encode(&clean_caption(text), max_len))
            .collect::<Result<Vec<_>>>()?;
        let ids: Vec<&[u32]> = tokens.iter().map(|(ids, _)| ids.as_slice()).collect();
        let mut lens: Vec<usize> = tokens.iter().map(|(_, len)| *len).collect();
        let mut embeds = encode_masked(&encoder, &ids, &lens)?;
        drop(encoder);
        // [negative; positive]: the reverse of the encoding order.
        embeds.reverse();
        lens.reverse();
        let embeds = Tensor::cat(&embeds, 0)?
            .to_dtype(frame.dtype())?
            .to_device(&Device::Cpu)?;
        job.prompt_embeds = Some(embeds);
        job.carry.put(Carried {
            mask: Some(attention_mask(&lens, max_len, &Device::Cpu)?),
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
        let mut draws = match &frame.config.generation().latents {
            Some(path) => RunDraws::File(Draws::open(path)?),
            None => RunDraws::Seeded(TorchGenerator::new(job.seed), dtype),
        };
        let (latents, noises) = self.take_draws(
            &mut draws,
            job.num_frames,
            job.height,
            job.width,
            job.num_inference_steps,
        )?;
        draws.finish()?;
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
        let mut denoise = Denoise::new(frame, timesteps.len());
        denoise.run(0..timesteps.len(), |forwards, i| {
            let input = Tensor::cat(&vec![&latents; batch], 0)?;
            let input = scheduler.scale_model_input(&input, i)?;
            let timestep = Tensor::full(timesteps[i], batch, device)?;
            let pred = forwards.run(|| dit_forward(model, &input, &timestep, &embeds, &mask))?;
            let pred = match batch > 1 {
                true => guide_batched(&pred, guidance_scale)?,
                false => pred,
            };
            let noise = noises[i].to_device(device)?;
            latents = scheduler.step(&pred, &latents, &noise, i)?;
            Ok(latents.clone())
        })?;
        denoise.finish(job);
        job.latents = Some(latents.to_device(&Device::Cpu)?);
        Ok(())
    }

    /// `decode_latents` (`1 / scaling_factor · z`, tiled decode), cropped to the asked frames
    /// and size, then `postprocess_video` to frames `[T, H, W, 3]`.
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let held = frame.hold(self.parts.vae)?;
        let vae = held.model();
        let latents = job.latents.take().context("nothing denoised")?;
        let z = vae.unscale(&latents.to_device(&frame.device)?)?;
        let video = vae
            .decode(&z)?
            .narrow(2, 0, job.num_frames as usize)?
            .narrow(3, 0, job.height as usize)?
            .narrow(4, 0, job.width as usize)?
            .to_dtype(DType::F32)?;
        job.frames = Some(stages::video_frames(video)?);
        Ok(())
    }
}

/// One DiT forward over the CFG batch: prepare, the blocks (resident or streamed), finish.
pub fn dit_forward(
    dit: &Held<'_, AllegroTransformer3DModel>,
    latents: &Tensor,
    timestep: &Tensor,
    embeds: &Tensor,
    mask: &Tensor,
) -> candle_core::Result<Tensor> {
    let model = dit.model();
    let mut inputs = model.prepare(latents, timestep, embeds, mask)?;
    let x = inputs.take_hidden_states()?;
    let x = dit.fold_blocks(AllegroTransformer3DModel::blocks, x, |block, x| {
        block.forward(x, &inputs)
    })?;
    model.finish(&x, &inputs)
}
