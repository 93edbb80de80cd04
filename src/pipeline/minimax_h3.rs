//! MiniMax H3 text-to-video+audio (`t2va`) as a list of stages, step for step as diffusers'
//! modular `MiniMaxH3` pipeline (the order [`crate::models::minimax_h3`] documents): the prompt
//! through Qwen3-VL's text model up to the layer read, one packed sequence of text, stereo-audio
//! and video rows denoised by both schedules with one forward per step (guidance-distilled: no
//! CFG), the video decoded clip by clip and tile by tile, the audio by the BigVGAN audio VAE.

use super::denoise::Denoise;
use super::draws::Draws;
use super::frame::Frame;
use super::jobs::Job;
use super::placement::Held;
use super::registry::{declared_by, About, Configs, Family, RunShape};
use super::spec::{Component, PipelineSpec, Role, Slot, StageSpec};
use super::stages;
use crate::config::video::FrameRule;
use crate::config::{ModelDefaults, ResolvedConfig};
use crate::models::minimax_h3::activations;
use crate::models::minimax_h3::audio_vae::{
    stereo_from_batch, MiniMaxH3AudioVaeConfig, MiniMaxH3AudioVaeDecoder,
};
use crate::models::minimax_h3::layout::{
    pack_audio, row_timesteps, t2va_layout, unpack_audio, T2vaGeometry, AUDIO_CHANNELS, FPS,
    MIN_DURATION_S,
};
use crate::models::minimax_h3::text_encoder::{
    MiniMaxH3TextEncoder, MiniMaxH3Tokenizer, Qwen3DecoderLayer, Qwen3VLConfig, Qwen3VLTextConfig,
    TextRope,
};
use crate::models::minimax_h3::transformer::{
    MiniMaxH3Modulations, MiniMaxH3Transformer3DModel, MiniMaxH3TransformerConfig, PackedLayout,
};
use crate::models::minimax_h3::vae::{
    decoded_to_unit_range, MiniMaxH3VaeConfig, MiniMaxH3VaeDecoder,
};
use crate::models::patches::{patchify, unpatchify};
use crate::models::source::{message, FileRef};
use crate::offload::transfer::Download;
use crate::output::Audio;
use crate::rng::TorchGenerator;
use crate::schedulers::minimax_h3::{
    distinct_timesteps, MiniMaxH3Schedule, MiniMaxH3SchedulerConfig,
};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

/// Bytes of an f32 element (RoPE tables, latents, the patch projections).
const F32_BYTES: u64 = 4;

/// Decoded frames converted to [0, 1] f32 on the device and handed to host memory at once: a few,
/// so the conversion's f32 copies stay small beside the decoded clips the plan counts.
const HANDOFF_FRAMES: usize = 4;

/// `modular_model_index.json`'s `_class_name` for this pipeline.
pub const CLASS_NAME: &str = "MiniMaxH3ModularPipeline";

/// Reads a MiniMax H3 model's configs (the registry's entry point).
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    Ok(Box::new(MiniMaxH3Configs::from_configs(configs)?))
}

/// The configs of a MiniMax H3 model: everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct MiniMaxH3Configs {
    pub transformer: MiniMaxH3TransformerConfig,
    pub vae: MiniMaxH3VaeConfig,
    pub audio_vae: MiniMaxH3AudioVaeConfig,
    pub text_encoder: Qwen3VLTextConfig,
    pub scheduler: MiniMaxH3SchedulerConfig,
    pub audio_scheduler: MiniMaxH3SchedulerConfig,
}

impl MiniMaxH3Configs {
    /// Reads every component's config (each checked as it is read, see
    /// [`ModelSource::json`]) and checks that they agree.
    pub fn from_configs(configs: Configs) -> Result<Self> {
        let out = MiniMaxH3Configs {
            // Every step's AdaLN tables are computed before denoising (`MODULATIONS`): the
            // streamed blocks leave their projections out.
            transformer: MiniMaxH3TransformerConfig {
                modulations_apart: true,
                ..configs.read("transformer/config.json")?
            },
            vae: configs.read("vae/config.json")?,
            audio_vae: configs.read("audio_vae/config.json")?,
            text_encoder: configs
                .read::<Qwen3VLConfig>("text_encoder/config.json")?
                .text_config,
            scheduler: configs.read("scheduler/scheduler_config.json")?,
            audio_scheduler: configs.read("audio_scheduler/scheduler_config.json")?,
        };
        if out.transformer.in_channels != out.vae.latent_channels
            || out.transformer.audio_in_channels != out.audio_vae.latent_channels
            || out.transformer.text_dim != out.text_encoder.hidden_size
        {
            bail!(
                "the configs disagree: transformer in_channels {} / audio_in_channels {} / text_dim {} against vae latent_channels {}, audio_vae latent_channels {}, text_encoder hidden_size {}",
                out.transformer.in_channels,
                out.transformer.audio_in_channels,
                out.transformer.text_dim,
                out.vae.latent_channels,
                out.audio_vae.latent_channels,
                out.text_encoder.hidden_size
            );
        }
        Ok(out)
    }

    /// The request's sizes as diffusers resolves them (`num_frames` snapped up to `17n + 5`).
    pub fn geometry(&self, num_frames: u32, height: u32, width: u32) -> Result<T2vaGeometry> {
        T2vaGeometry::new(
            height as usize,
            width as usize,
            num_frames as usize,
            &self.vae,
            self.transformer.patch_size,
        )
        .map_err(message)
    }

    /// The geometry for planning: a frame count outside the model's 5-15 s plans as the
    /// shortest video (the memory advice tries fewer frames; a run refuses them); a size the
    /// model cannot take (refused by a run too) plans as a single latent.
    fn planning_geometry(&self, shape: &RunShape) -> T2vaGeometry {
        let shortest = (MIN_DURATION_S * FPS as f64) as u32;
        self.geometry(shape.num_frames, shape.height, shape.width)
            .or_else(|_| self.geometry(shortest, shape.height, shape.width))
            .unwrap_or(T2vaGeometry {
                height: shape.height as usize,
                width: shape.width as usize,
                num_frames: shortest as usize,
                num_latent_frames: 1,
                latent_height: 1,
                latent_width: 1,
                num_audio_latents: 1,
            })
    }

    /// Video latents `[1, C, F, h, w]`.
    fn latent_shape(&self, g: &T2vaGeometry) -> [usize; 5] {
        [
            1,
            self.vae.latent_channels,
            g.num_latent_frames,
            g.latent_height,
            g.latent_width,
        ]
    }

    /// Audio latents `[2, Ca, Na]` (stereo as a batch of two).
    fn audio_latent_shape(&self, g: &T2vaGeometry) -> [usize; 3] {
        [
            AUDIO_CHANNELS,
            self.audio_vae.latent_channels,
            g.num_audio_latents,
        ]
    }

    /// Video rows of the packed sequence.
    fn video_rows(&self, g: &T2vaGeometry) -> usize {
        g.token_grid(self.transformer.patch_size).iter().product()
    }

    /// Waveform samples per channel of a geometry's audio.
    fn audio_samples(&self, g: &T2vaGeometry) -> usize {
        g.num_audio_latents * self.audio_vae.hop_length()
    }
}

/// The components of a MiniMax H3 pipeline.
#[derive(Clone, Copy)]
struct Parts {
    text_encoder: Slot<MiniMaxH3TextEncoder>,
    transformer: Slot<MiniMaxH3Transformer3DModel>,
    modulations: Slot<MiniMaxH3Modulations>,
    vae: Slot<MiniMaxH3VaeDecoder>,
    audio_vae: Slot<MiniMaxH3AudioVaeDecoder>,
}

impl MiniMaxH3Configs {
    /// Qwen3-VL, DiT, video VAE and audio VAE, each used by one stage and safe to defer: the
    /// pipeline as data with its components' slots.
    fn declare(&self, shape: &RunShape) -> (PipelineSpec, Parts) {
        let g = self.planning_geometry(shape);
        // Text tokens are the prompt's own (no padding); `--max-sequence-length` stands in for
        // the prompt length when planning.
        let text = shape.text_len;
        let rows = text + 2 * g.num_audio_latents + self.video_rows(&g);
        let dit = MiniMaxH3TransformerConfig {
            fp8_matmul: shape.fp8_matmul,
            ..self.transformer.clone()
        };
        // Each block built on the device keeps its fp8 weight codes.
        let (fp8, block_codes) = shape.fp8_bytes(
            || activations::fp8_matmul_activations(&dit, rows),
            || activations::fp8_block_codes(&dit),
        );
        let mut spec = PipelineSpec::titled(self.title());
        let text_encoder = spec.add_model("text_encoder", Role::TextEncoder, &self.text_encoder);
        let transformer = spec.add_model("transformer", Role::Dit, &dit);
        let parts = Parts {
            text_encoder,
            modulations: spec.add_modulations(&self.transformer, &transformer),
            transformer,
            vae: spec.add_model("vae", Role::Vae, &self.vae),
            // The vocoder runs in f32 (its checkpoint's dtype): a bf16 waveform is audibly
            // noisy.
            audio_vae: spec.add(
                Component::new("audio_vae", Role::AudioVae, self.audio_vae.clone())
                    .in_dtype(DType::F32),
            ),
        };
        spec.stages = vec![
            StageSpec::new(
                "encode_text",
                &[parts.text_encoder.index()],
                activations::text_encoder_activations(&self.text_encoder, text, shape.dtype),
            )
            .runs(MiniMaxH3::encode_text),
            // One block's table for one step at a time, in f32 at most (two distinct
            // timesteps, three modalities), and the time embedding.
            StageSpec::new(
                "modulate",
                &[parts.modulations.index()],
                2 * 3 * 6 * self.transformer.hidden_size as u64 * F32_BYTES * 2,
            )
            .runs(MiniMaxH3::modulate),
            StageSpec::new(
                "denoise",
                &[parts.transformer.index()],
                activations::transformer_activations(&self.transformer, rows, text, shape.dtype)
                    + fp8,
            )
            .holding_per_block(block_codes)
            .runs(MiniMaxH3::denoise),
            StageSpec::new(
                "decode_video",
                &[parts.vae.index()],
                activations::vae_decode_activations(&self.vae, &g, shape.dtype),
            )
            .runs(MiniMaxH3::decode_video),
            StageSpec::new(
                "decode_audio",
                &[parts.audio_vae.index()],
                activations::audio_decode_activations(&self.audio_vae, g.num_audio_latents),
            )
            .runs(MiniMaxH3::decode_audio),
            StageSpec::new("write", &[], 0).runs(MiniMaxH3::write),
        ];
        (spec, parts)
    }
}

impl Family for MiniMaxH3Configs {
    /// Guidance-distilled (no guidance scale, no negative prompt), the prompt encoded whole,
    /// its own two flow schedules (video and audio): none of the family options. The published
    /// pipeline's defaults: the 16:9 canvas of `canvas_short_edge` 768 within
    /// `canvas_max_pixels` (768x1344), 124 frames (5 s), 24 fps, 50 steps, no guidance.
    fn about(&self) -> About {
        About {
            title: "MiniMax H3 text-to-video+audio",
            defaults: ModelDefaults {
                height: Some(768),
                width: Some(1344),
                num_frames: Some(124),
                fps: Some(FPS as u32),
                num_inference_steps: Some(50),
                guidance_scale: Some(1.0),
                max_sequence_length: None,
                // Any frame count: it is snapped up to 17n+5 (said on stderr); sizes are
                // multiples of the canvas multiple (VAE spatial ratio x patch width); the steps
                // count sigma points, the terminal 0 among them, so one step is no schedule.
                frame_rule: Some(FrameRule::any_frames(
                    (self.vae.spatial_ratio() * self.transformer.patch_size[2]) as u32,
                    2,
                )),
                ..ModelDefaults::default()
            },
            ..About::default()
        }
    }

    /// Video at 24 fps with its sound in step, and frame counts of 5-15 s.
    fn inapplicable(&self, config: &ResolvedConfig) -> Option<String> {
        if config.output().fps != FPS as u32 {
            return Some(
                "--fps: MiniMax H3 makes 24 fps video with its sound in step; leave it out".into(),
            );
        }
        let o = config.video();
        self.size_refusal(o.num_frames, o.height, o.width)
            .map(|why| format!("--num-frames {}: {why}", o.num_frames))
    }

    /// The video's `latents` and the stereo `audio_latents`.
    fn draws(&self, num_frames: u32, height: u32, width: u32) -> Vec<(&'static str, Vec<usize>)> {
        match self.geometry(num_frames, height, width) {
            Ok(g) => vec![
                ("latents", self.latent_shape(&g).to_vec()),
                ("audio_latents", self.audio_latent_shape(&g).to_vec()),
            ],
            // A size the model refuses ([`Family::size_refusal`]) takes no draws.
            Err(_) => Vec::new(),
        }
    }

    /// Frame counts of 5-15 s once snapped up to 17n+5.
    fn size_refusal(&self, num_frames: u32, height: u32, width: u32) -> Option<String> {
        self.geometry(num_frames, height, width)
            .err()
            .map(|e| format!("{e:#}"))
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        let g = self.planning_geometry(shape);
        serde_json::json!({
            "transformer_layers": self.transformer.num_layers,
            "transformer_refiner_layers": self.transformer.num_refiner_layers,
            "transformer_hidden_size": self.transformer.hidden_size,
            "transformer_inner_dim": self.transformer.inner_dim(),
            "num_frames_generated": g.num_frames,
            "latent_shape": self.latent_shape(&g),
            "audio_latent_shape": self.audio_latent_shape(&g),
            "video_rows": self.video_rows(&g),
            "audio_rows": 2 * g.num_audio_latents,
            "audio_sample_rate": self.audio_vae.sampling_rate,
            "audio_samples": self.audio_samples(&g),
            "vae_scale_factor_spatial": self.vae.spatial_ratio(),
            "vae_scale_factor_temporal": self.vae.temporal_ratio(),
            "text_encoder_layers": self.text_encoder.num_hidden_layers,
            "text_encoder_layers_loaded": MiniMaxH3TextEncoder::layers_used(),
            "scheduler_shift": self.scheduler.shift,
            "audio_scheduler_shift": self.audio_scheduler.shift,
        })
    }

    declared_by!(MiniMaxH3::new);
}

/// What a job carries between stages beside [`Job`]'s own fields.
#[derive(Default)]
struct Carried {
    /// The request's sizes, from encode on.
    geometry: Option<T2vaGeometry>,
    /// The denoised audio rows `[1, 2 Na, Ca]` (f32, host memory) until the audio decode.
    audio_latents: Option<Tensor>,
    /// The decoded stereo waveform until it is written.
    audio: Option<Audio>,
    /// Every step's AdaLN tables (host memory), from modulate to denoise.
    adaln_tables: Option<Arc<Vec<StepTables>>>,
}

/// One step's AdaLN tables in host memory: the blocks' stacked (`[blocks * T * 3, 6 * hidden]`,
/// block b's rows `[b * n, (b + 1) * n)`) and the output norm's (`[T, 2 * hidden]`).
struct StepTables {
    blocks: Tensor,
    output: Tensor,
}

impl StepTables {
    /// On `device` (one copy per table), as [`BlockInputs::adaln_tables`] reads them: one per
    /// block, then the output norm's.
    fn on(&self, device: &Device, blocks: usize) -> candle_core::Result<Arc<Vec<Tensor>>> {
        let stacked = self.blocks.to_device(device)?;
        let n = stacked.dim(0)? / blocks.max(1);
        let mut tables = (0..blocks)
            .map(|b| stacked.narrow(0, b * n, n))
            .collect::<candle_core::Result<Vec<_>>>()?;
        tables.push(self.output.to_device(device)?);
        Ok(Arc::new(tables))
    }
}

/// MiniMax H3's own part of its pipeline (the frame holds the rest).
struct MiniMaxH3 {
    configs: MiniMaxH3Configs,
    parts: Parts,
    tokenizer: MiniMaxH3Tokenizer,
    /// The AdaLN tables by step count: they depend on the schedules' timesteps alone (not on
    /// the prompt), so the prompts of a batch with one step count share one pass and one copy
    /// (about 1 GB for 50 steps at the published size, in bf16).
    adaln_tables: RefCell<HashMap<usize, Arc<Vec<StepTables>>>>,
}

impl MiniMaxH3 {
    /// Reads the tokenizer; loads no weights.
    fn new(configs: MiniMaxH3Configs, parts: Parts, frame: &Frame) -> Result<Self> {
        let tokenizer = match frame.source.require("tokenizer/tokenizer.json")? {
            FileRef::Path(p) => MiniMaxH3Tokenizer::from_file(&p)?,
            FileRef::Embedded(text) => MiniMaxH3Tokenizer::from_json(text)?,
        };
        Ok(MiniMaxH3 {
            configs,
            parts,
            tokenizer,
            adaln_tables: RefCell::default(),
        })
    }

    /// Resolves the job's sizes (saying on stderr when the frame count was snapped), then
    /// `prompt_embeds` = the output of layer 50 of the prompt's tokens, verbatim (no template,
    /// no special tokens, no padding); it waits for the denoise stage in host memory.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        // A prompt-file line may set what the flags refuse.
        if job.guidance_scale != 1.0 || !job.negative_prompt.is_empty() {
            bail!("MiniMax H3 is guidance-distilled: it takes no guidance_scale and no negative_prompt; remove them from the prompt line");
        }
        let geometry = self
            .configs
            .geometry(job.num_frames, job.height, job.width)?;
        if geometry.num_frames != job.num_frames as usize {
            frame.progress.note(&format!(
                "note: MiniMax H3 makes 17n+5 frames: {} frames snapped up to {} ({:.2} s at {FPS} fps)",
                job.num_frames,
                geometry.num_frames,
                geometry.num_frames as f64 / FPS as f64
            ));
        }
        let ids = self.tokenizer.encode(&job.prompt)?;
        if ids.is_empty() {
            bail!("the prompt has no tokens; pass a non-empty --prompt");
        }
        let device = frame.device_of(self.parts.text_encoder);
        let encoder = frame.hold(self.parts.text_encoder)?;
        let model = encoder.model()?;
        // The token table may wait in host memory (streamed layers): the rows looked up move.
        let ids = Tensor::new(ids.as_slice(), &model.table_device())?.unsqueeze(0)?;
        let h = model.embed(&ids)?.0.to_device(&device)?;
        let rope = TextRope::new(model.config(), ids.dim(1)?, &device)?;
        let h = encoder.fold_blocks(
            MiniMaxH3TextEncoder::layers,
            h,
            |layer: &Qwen3DecoderLayer, h| layer.forward(h, &rope),
        )?;
        drop(encoder);
        job.prompt_embeds = Some(h.to_dtype(frame.dtype())?.to_device(&Device::Cpu)?);
        job.carry.put(Carried {
            geometry: Some(geometry),
            ..Carried::default()
        });
        Ok(())
    }

    /// The initial noise: `latents` and `audio_latents` from the draws file (the only draws of a
    /// `t2va` call), or from the job's generator.
    fn initial_latents(
        &self,
        frame: &Frame,
        job: &Job,
        carried: &Carried,
    ) -> Result<(Tensor, Tensor)> {
        let g = carried.geometry.context("sizes not resolved")?;
        let (video, audio) = (
            self.configs.latent_shape(&g),
            self.configs.audio_latent_shape(&g),
        );
        Ok(match &frame.config.generation().latents {
            Some(path) => {
                let mut draws = Draws::open(path)?;
                let latents = (
                    draws.take("latents", &video)?,
                    draws.take("audio_latents", &audio)?,
                );
                draws.finish()?;
                latents
            }
            None => {
                // diffusers draws the video noise, then the audio noise in its row layout
                // `[channels * Na, Ca]` (the stereo blocks one after the other).
                let mut generator = TorchGenerator::new(job.seed);
                let latents = generator.randn(&video)?;
                let [channels, ca, na] = audio;
                let rows = generator.randn(&[channels, na, ca])?;
                (latents, rows.transpose(1, 2)?.contiguous()?)
            }
        })
    }

    /// Both schedules through one transformer forward per step over the packed sequence; the
    /// video latents wait in host memory as `[1, C, F, h, w]`, the audio rows beside them.
    /// Every step's AdaLN tables, in one pass over the blocks' projections, which hold device
    /// memory for this stage only; they wait in host memory for denoise, shared by the
    /// prompts with this step count.
    fn modulate(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let steps = job.num_inference_steps as usize;
        let known = self.adaln_tables.borrow().get(&steps).cloned();
        let tables = match known {
            Some(tables) => tables,
            None => {
                let tables = Arc::new(self.adaln_tables_for(frame, steps)?);
                self.adaln_tables.borrow_mut().insert(steps, tables.clone());
                tables
            }
        };
        let mut carried: Carried = job.carry.take();
        carried.adaln_tables = Some(tables);
        job.carry.put(carried);
        Ok(())
    }

    /// The video and audio schedules of a `steps`-step run (one forward per step of both).
    fn schedules(&self, steps: usize) -> Result<(MiniMaxH3Schedule, MiniMaxH3Schedule)> {
        let video = MiniMaxH3Schedule::new(&self.configs.scheduler, steps)?;
        let audio = MiniMaxH3Schedule::new(&self.configs.audio_scheduler, steps)?;
        if audio.timesteps.len() != video.timesteps.len() {
            bail!(
                "the video and audio schedules have {} and {} steps for --num-inference-steps {steps}; pass another step count",
                video.timesteps.len(),
                audio.timesteps.len()
            );
        }
        Ok((video, audio))
    }

    /// The AdaLN tables of a `steps`-step run, one [`StepTables`] per step.
    fn adaln_tables_for(&self, frame: &Frame, steps: usize) -> Result<Vec<StepTables>> {
        let (video_schedule, audio_schedule) = self.schedules(steps)?;
        let held = frame.hold(self.parts.modulations)?;
        let model = held.model()?;
        let tembs = video_schedule
            .timesteps
            .iter()
            .zip(&audio_schedule.timesteps)
            .map(|(&video, &audio)| {
                // The distinct timesteps, as `row_timesteps` gives them to the transformer.
                let (values, _, _) = distinct_timesteps(video, audio);
                model.time_embedding(&Tensor::new(values.as_slice(), &frame.device)?)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut per_step = vec![Vec::new(); tembs.len()];
        held.fold_blocks(MiniMaxH3Modulations::blocks, (), |block, _| {
            for (temb, tables) in tembs.iter().zip(&mut per_step) {
                tables.push(block.table(temb)?.to_device(&Device::Cpu)?);
            }
            Ok(())
        })?;
        // Then the output norm's.
        let outputs = tembs
            .iter()
            .map(|temb| model.output_table(temb)?.to_device(&Device::Cpu))
            .collect::<candle_core::Result<Vec<_>>>()?;
        drop(held);
        Ok(per_step
            .iter()
            .zip(outputs)
            .map(|(blocks, output)| {
                Ok(StepTables {
                    blocks: Tensor::cat(blocks, 0)?,
                    output,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?)
    }

    fn denoise(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let mut carried: Carried = job.carry.take();
        let (latents, audio_latents) = self.initial_latents(frame, job, &carried)?;
        let g = carried.geometry.context("sizes not resolved")?;
        let cfg = &self.configs.transformer;
        let device = &frame.device;
        let model = &frame.hold(self.parts.transformer)?;
        let text = job
            .prompt_embeds
            .take()
            .context("prompt not encoded")?
            .to_device(device)?;
        let layout = t2va_layout(&g.layout_sizes(text.dim(1)?), cfg.patch_size, device)?;
        let (video_schedule, audio_schedule) = self.schedules(job.num_inference_steps as usize)?;
        let forwards = video_schedule.timesteps.len();
        let mut video = patchify(&latents.to_device(device)?, cfg.patch_size)?;
        let mut audio = pack_audio(&audio_latents.to_device(device)?)?;
        let tables = carried
            .adaln_tables
            .take()
            .context("prompt not modulated")?;
        if tables.len() != forwards {
            bail!("{} steps modulated for {forwards} forwards", tables.len());
        }
        let blocks = cfg.num_layers;
        let rope = cfg.rope(&layout)?;
        let denoise = Denoise::all(frame, forwards, |dit, i| {
            let (t, t_idx) = row_timesteps(
                &layout,
                video_schedule.timesteps[i],
                audio_schedule.timesteps[i],
            )?;
            let per_block = tables[i].on(device, blocks)?;
            let (v, a) = dit.run(|| {
                dit_forward(
                    model,
                    &video,
                    &audio,
                    &text,
                    (&t, &t_idx, per_block),
                    (&layout, &rope),
                )
            })?;
            video = video_schedule.step(i, &v, &video)?;
            audio = audio_schedule.step(i, &a, &audio)?;
            stages::check_finite(&audio, i + 1, forwards)?;
            Ok(video.clone())
        })?;
        denoise.finish(job)?;
        let latents = unpatchify(&video, g.token_grid(cfg.patch_size), cfg.patch_size)?;
        job.latents = Some(latents.to_device(&Device::Cpu)?);
        carried.audio_latents = Some(audio.to_device(&Device::Cpu)?);
        job.carry.put(carried);
        Ok(())
    }

    /// `vae.decode(latents · std + mean)`, clip by clip with cross-fades and in spatial tiles as
    /// diffusers decodes by default; frames `[T, H, W, 3]` in [0, 1].
    fn decode_video(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let held = frame.hold(self.parts.vae)?;
        let vae = held.model()?;
        let dtype = frame.dtype_of(self.parts.vae);
        let latents = job.latents.take().context("nothing denoised")?;
        let z = vae.denormalize(&latents.to_device(&frame.device)?.to_dtype(dtype)?)?;
        // Each cross-faded stretch of frames leaves the device as it is finished (the whole
        // video never waits there) and is appended to the frames in host memory as [0, 1] f32
        // frames `[n, H, W, 3]`: host memory holds the video once, plus a few frames. The
        // conversion runs on the device, HANDOFF_FRAMES frames at a time: done on the host, the
        // 5 s request's stage took 13.8 s on an H100 where the decoder takes 4.2 s
        // (bench/RESULTS.md, session 59).
        let mut values: Vec<f32> = Vec::new();
        let mut download = Download::default();
        let mut frame_shape = None;
        let frames = vae.decode_into(&z, |piece| {
            let shape = append_frames(&piece, &mut download, &mut values)
                .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
            frame_shape = shape.or(frame_shape);
            Ok(())
        })?;
        let (h, w, c) = frame_shape.context("the VAE decoded no frames")?;
        let decoded = values.len() / (h * w * c);
        job.frames =
            Some(Tensor::from_vec(values, (decoded, h, w, c), &Device::Cpu)?.narrow(0, 0, frames)?);
        Ok(())
    }

    /// The audio rows back to `[2, Ca, Na]` (stereo as a batch of two), `audio_vae.decode(z · std
    /// + mean)`, the waveform `[2, samples]` at the audio VAE's sample rate.
    fn decode_audio(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let mut carried: Carried = job.carry.take();
        let rows = carried.audio_latents.take().context("nothing denoised")?;
        let held = frame.hold(self.parts.audio_vae)?;
        let audio_vae = held.model()?;
        let dtype = frame.dtype_of(self.parts.audio_vae);
        let z = unpack_audio(&rows.to_device(&frame.device)?, AUDIO_CHANNELS)?.to_dtype(dtype)?;
        let waveform = audio_vae.decode(&audio_vae.denormalize(&z)?)?;
        stages::ensure_finite(&waveform, "the decoded audio")?;
        let stereo = stereo_from_batch(&waveform)?
            .squeeze(0)?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?;
        carried.audio = Some(Audio::new(
            stereo,
            self.configs.audio_vae.sampling_rate as u32,
        )?);
        job.carry.put(carried);
        Ok(())
    }

    fn write(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let carried: Carried = job.carry.take();
        let audio = carried.audio.context("no audio decoded")?;
        frame.write(job, Some(&audio))
    }
}

/// One transformer forward: prepare (projections, token refiner, packing, time embedding),
/// the blocks (resident or streamed), the output norm and both velocity heads. The first
/// tuple holds the step's distinct timesteps, each row's index into them and the blocks' AdaLN
/// tables computed apart ([`MiniMaxH3Modulations`]); the second the rows' layout and its
/// rotary tables, made once per video.
fn dit_forward(
    dit: &Held<'_, MiniMaxH3Transformer3DModel>,
    video: &Tensor,
    audio: &Tensor,
    text: &Tensor,
    (timestep, timestep_indices, adaln_tables): (&Tensor, &Tensor, Arc<Vec<Tensor>>),
    (layout, rope): (&PackedLayout, &(Tensor, Tensor)),
) -> candle_core::Result<(Tensor, Tensor)> {
    // The outer part only around its uses: it may be moved in for each.
    let mut inputs =
        dit.model()?
            .prepare(video, audio, text, timestep, timestep_indices, layout, rope)?;
    inputs.adaln_tables = Some(adaln_tables);
    let x = inputs.take_hidden_states()?;
    let x = dit.fold_blocks(MiniMaxH3Transformer3DModel::blocks, x, |block, x| {
        block.forward(x, &inputs)
    })?;
    dit.model()?.finish(&x, &inputs)
}

/// Appends a decoded stretch `[1, 3, n, H, W]` to `values` as [0, 1] f32 frames `[n, H, W, 3]`,
/// converted on the stretch's device HANDOFF_FRAMES frames at a time; `(H, W, 3)`, or `None` for
/// a stretch without frames.
fn append_frames(
    piece: &Tensor,
    download: &mut Download,
    values: &mut Vec<f32>,
) -> Result<Option<(usize, usize, usize)>> {
    // Before the clamp, which would turn an infinity into a blank frame.
    stages::ensure_finite(piece, "the decoded video")?;
    let n = piece.dim(2)?;
    let mut shape = None;
    for first in (0..n).step_by(HANDOFF_FRAMES) {
        let part = piece.narrow(2, first, HANDOFF_FRAMES.min(n - first))?;
        let part = decoded_to_unit_range(&part)?
            .squeeze(0)?
            .permute((1, 2, 3, 0))?
            .contiguous()?;
        let (_, h, w, c) = part.dims4()?;
        shape = Some((h, w, c));
        download.append(&part, values)?;
    }
    Ok(shape)
}
