//! CogVideoX text-to-video (THUDM/CogVideoX-5b) as a list of stages, step for step as
//! diffusers' `CogVideoXPipeline.__call__` (see [`crate::models::cogvideox`] for the math).

use super::denoise::Denoise;
use super::draws::{Draws, RunDraws};
use super::frame::Frame;
use super::jobs::Job;
use super::placement::Held;
use super::registry::{Configs, Family, FamilyOption, RunShape};
use super::spec::{PipelineSpec, StageSpec, TextToVideo};
use super::stages;
use crate::config::{ModelDefaults, UsageError};
use crate::models::cogvideox::transformer::{
    CogVideoXTransformer3DModel, CogVideoXTransformerConfig,
};
use crate::models::cogvideox::vae::{AutoencoderKLCogVideoX, CogVideoXVaeConfig};
use crate::models::cogvideox::{activations, guidance};
use crate::models::source::FileRef;
use crate::models::t5::encoder::{encode_unmasked, T5Config, T5EncoderModel};
use crate::models::t5::tokenizer::PromptTokenizer;
use crate::rng::TorchGenerator;
use crate::schedulers::cogvideox_dpm::{CogVideoXDpmConfig, CogVideoXDpmScheduler};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use std::any::Any;

/// The scheduler the pipeline runs (the 5b repo ships `CogVideoXDDIMScheduler` with the same
/// values; its model card swaps this one in).
const DPM_SCHEDULER: &str = "CogVideoXDPMScheduler";

/// Reads a CogVideoX model's configs (the registry's entry point).
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    Ok(Box::new(CogVideoXConfigs::from_configs(configs)?))
}

/// The configs of a CogVideoX model: everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct CogVideoXConfigs {
    pub transformer: CogVideoXTransformerConfig,
    pub vae: CogVideoXVaeConfig,
    pub text_encoder: T5Config,
    pub scheduler: CogVideoXDpmConfig,
    /// The scheduler class `model_index.json` names.
    pub scheduler_class: String,
}

impl CogVideoXConfigs {
    /// Reads every component's config.
    pub fn from_configs(configs: Configs) -> Result<Self> {
        let index: serde_json::Value = configs.read("model_index.json")?;
        let scheduler_class = index["scheduler"][1]
            .as_str()
            .unwrap_or(DPM_SCHEDULER)
            .to_string();
        Ok(CogVideoXConfigs {
            transformer: configs.read("transformer/config.json")?,
            vae: configs.read("vae/config.json")?,
            text_encoder: configs.read("text_encoder/config.json")?,
            scheduler: configs.read("scheduler/scheduler_config.json")?,
            scheduler_class,
        })
    }

    /// The latent shape `[1, F', C, H', W']` (frames before channels) for a video size.
    pub fn latent_shape(&self, num_frames: u32, height: u32, width: u32) -> [usize; 5] {
        let t = self.vae.scale_factor_temporal();
        let s = self.vae.scale_factor_spatial();
        [
            1,
            (num_frames as usize - 1) / t + 1,
            self.transformer.in_channels,
            height as usize / s,
            width as usize / s,
        ]
    }
}

/// The components of a CogVideoX pipeline.
type Parts = TextToVideo<T5EncoderModel, CogVideoXTransformer3DModel, AutoencoderKLCogVideoX>;

impl CogVideoXConfigs {
    /// Text encoder, DiT and VAE (each in the run's dtype, as diffusers loads them), each used
    /// by one stage and safe to defer; the pipeline as data with its components' slots.
    fn declare(&self, shape: &RunShape) -> (PipelineSpec, Parts) {
        let latent = self.latent_shape(shape.num_frames, shape.height, shape.width);
        let mut spec = PipelineSpec::titled(self.title());
        let parts = Parts::declare(&mut spec, &self.text_encoder, &self.transformer, &self.vae);
        let (c, dtype, text_len) = (&parts, shape.dtype, shape.text_len);
        let text = activations::text_encoder_activations(&self.text_encoder, text_len, dtype);
        let dit = activations::transformer_activations(&self.transformer, latent, text_len, dtype);
        let vae = activations::vae_decode_activations(&self.vae, latent, dtype);
        spec.stages = vec![
            StageSpec::new("encode_text", &[c.text_encoder.index()], text)
                .runs(CogVideoX::encode_text),
            StageSpec::new("denoise", &[c.transformer.index()], dit).runs(CogVideoX::denoise),
            StageSpec::new("decode", &[c.vae.index()], vae).runs(CogVideoX::decode),
            StageSpec::write(),
        ];
        (spec, parts)
    }
}

impl Family for CogVideoXConfigs {
    fn title(&self) -> &'static str {
        "CogVideoX text-to-video"
    }

    fn spec(&self, shape: &RunShape) -> PipelineSpec {
        self.declare(shape).0
    }

    /// Text-to-video with classifier-free guidance; its own DPM scheduler, its VAE decodes
    /// frame-batched without tiles.
    fn options(&self) -> Vec<FamilyOption> {
        [&FamilyOption::GUIDED[..], &[FamilyOption::Lora]].concat()
    }

    fn draws(&self, num_frames: u32, height: u32, width: u32) -> Vec<(&'static str, Vec<usize>)> {
        vec![(
            "latents",
            self.latent_shape(num_frames, height, width).to_vec(),
        )]
    }

    /// The published pipeline's call defaults: 480x720, 49 frames at 8 fps, 50 steps,
    /// guidance 6, 226 text tokens.
    fn defaults(&self) -> ModelDefaults {
        ModelDefaults {
            height: Some(480),
            width: Some(720),
            num_frames: Some(49),
            fps: Some(8),
            num_inference_steps: Some(50),
            guidance_scale: Some(6.0),
            max_sequence_length: Some(226),
            // 4k+1 frames (the VAE's 4x in time), sizes in multiples of 16 (8x space, patch 2).
            ..ModelDefaults::default()
        }
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        serde_json::json!({
            "transformer_layers": self.transformer.num_layers,
            "transformer_inner_dim": self.transformer.inner_dim(),
            "latent_shape": self.latent_shape(shape.num_frames, shape.height, shape.width),
            "latent_layout": "BFCHW",
            "vae_scale_factor_spatial": self.vae.scale_factor_spatial(),
            "vae_scale_factor_temporal": self.vae.scale_factor_temporal(),
            "text_encoder_layers": self.text_encoder.num_layers,
            "scheduler": DPM_SCHEDULER,
        })
    }

    fn open(&self, frame: &Frame) -> Result<Box<dyn Any>> {
        let (_, parts) = self.declare(&RunShape::of(&frame.config));
        Ok(Box::new(CogVideoX::new(self.clone(), parts, frame)?))
    }
}

/// CogVideoX's own part of its pipeline (the frame holds the rest).
struct CogVideoX {
    configs: CogVideoXConfigs,
    parts: Parts,
    tokenizer: PromptTokenizer,
}

impl CogVideoX {
    /// Reads the tokenizer and checks the draws file against the run's sizes; loads no weights.
    fn new(configs: CogVideoXConfigs, parts: Parts, frame: &Frame) -> Result<Self> {
        let (source, progress) = (&frame.source, &frame.progress);
        let tokenizer_json = source.require("tokenizer/tokenizer.json").context(
            "CogVideoX reads tokenizer/tokenizer.json; where a checkpoint ships only spiece.model, write it once with transformers: T5TokenizerFast.from_pretrained(folder, subfolder=\"tokenizer\").save_pretrained(folder + \"/tokenizer\")",
        )?;
        let tokenizer = match tokenizer_json {
            FileRef::Path(p) => PromptTokenizer::from_file(&p)?,
            FileRef::Embedded(text) => PromptTokenizer::from_json(text)?,
        };
        if configs.scheduler_class != DPM_SCHEDULER {
            progress.note(&format!(
                "note: {source} names {}; vidgen samples with {DPM_SCHEDULER} from the same config, as the CogVideoX-5b model card does",
                configs.scheduler_class
            ));
        }
        let pipeline = CogVideoX {
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

    /// Every draw of a run, in the order diffusers makes them: the initial latents, then each
    /// step's scheduler noise (the last of the step's draws is the one it uses).
    fn take_draws(
        &self,
        draws: &mut RunDraws,
        num_frames: u32,
        height: u32,
        width: u32,
        steps: u32,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let shape = self.configs.latent_shape(num_frames, height, width);
        let scheduler = CogVideoXDpmScheduler::new(&self.configs.scheduler, steps as usize)?;
        let latents = draws.take("latents", &shape)?;
        let mut noises = Vec::with_capacity(steps as usize);
        for i in 0..steps as usize {
            let mut last = None;
            for k in 0..scheduler.draws_at(i) {
                last = Some(draws.take(&format!("step{i}.scheduler_noise.{k}"), &shape)?);
            }
            noises.push(last.context("a step without a draw")?);
        }
        Ok((latents, noises))
    }

    /// The prompt embeddings `[1, L, text_dim]` of each text: T5's `last_hidden_state` of the
    /// padded ids without a mask (the prompt is not cleaned), the texts through the blocks
    /// together.
    fn embed(
        &self,
        frame: &Frame,
        encoder: &Held<'_, T5EncoderModel>,
        texts: &[&str],
    ) -> Result<Vec<Tensor>> {
        let max_len = frame.config.generation().max_sequence_length;
        let ids = texts
            .iter()
            .map(|text| Ok(self.tokenizer.encode(text, max_len)?.0))
            .collect::<Result<Vec<_>>>()?;
        let ids: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
        encode_unmasked(encoder, &ids)?
            .into_iter()
            .map(|t| Ok(t.to_dtype(frame.dtype())?.to_device(&Device::Cpu)?))
            .collect()
    }

    /// Encodes the prompts (the negative one when guided); the embeddings wait for the denoise
    /// stage in host memory.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let encoder = frame.hold(self.parts.text_encoder)?;
        let mut texts = vec![job.prompt.as_str()];
        if guidance::is_guided(job.guidance_scale) {
            texts.push(job.negative_prompt.as_str());
        }
        let mut embeds = self.embed(frame, &encoder, &texts)?.into_iter();
        job.prompt_embeds = embeds.next();
        job.negative_embeds = embeds.next();
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
        let steps = job.num_inference_steps as usize;
        let mut scheduler = CogVideoXDpmScheduler::new(&self.configs.scheduler, steps)?;
        // init_noise_sigma is 1: the latents are used as drawn.
        let mut latents = latents.to_dtype(dtype)?.to_device(device)?;
        let timesteps = scheduler.timesteps().to_vec();
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
            let out = forwards
                .run(|| dit_forward(model, &input, &timestep, &text))?
                .to_dtype(DType::F32)?;
            let noise_pred = if guided {
                let scale = guidance::scale_at(guidance_scale, false, t, steps);
                guidance::apply(&out.narrow(0, 0, 1)?, &out.narrow(0, 1, 1)?, scale)?
            } else {
                out
            };
            let noise = noises[i].to_dtype(DType::F32)?.to_device(device)?;
            latents = scheduler
                .step(&noise_pred, &latents.to_dtype(DType::F32)?, &noise)?
                .to_dtype(dtype)?;
            Ok(latents.clone())
        })?;
        denoise.finish(job);
        job.latents = Some(latents.to_device(&Device::Cpu)?);
        job.prompt_embeds = None;
        job.negative_embeds = None;
        Ok(())
    }

    /// `decode_latents` (permute to `[B, C, F, H, W]`, times 1/scaling_factor, frame-batched
    /// decode) and `postprocess_video` to frames `[T, H, W, 3]` in [0, 1].
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let held = frame.hold(self.parts.vae)?;
        let vae = held.model();
        let latents = job.latents.take().context("nothing denoised")?;
        let z = vae.scale_latents(&latents.to_device(&frame.device)?)?;
        let video = vae.decode(&z)?.to_dtype(DType::F32)?;
        job.frames = Some(stages::video_frames(video)?);
        Ok(())
    }
}

/// One DiT forward over the joint sequence: prepare, the blocks (resident or streamed), finish.
pub fn dit_forward(
    dit: &Held<'_, CogVideoXTransformer3DModel>,
    latents: &Tensor,
    timestep: &Tensor,
    text: &Tensor,
) -> candle_core::Result<Tensor> {
    let model = dit.model();
    let mut inputs = model.prepare(latents, timestep, text)?;
    let x = inputs.take_hidden_states()?;
    let x = dit.fold_blocks(CogVideoXTransformer3DModel::blocks, x, |block, x| {
        block.forward(x, &inputs)
    })?;
    model.finish(&x, &inputs)
}
