//! HunyuanVideo text-to-video as a list of stages, step for step as diffusers'
//! `HunyuanVideoPipeline`: the Llama text encoder with the prompt template (`hidden_states[-3]`,
//! the template's tokens cropped), the CLIP text encoder's pooled output, the guidance-distilled
//! dual/single-stream DiT (embedded guidance; real CFG with a negative prompt only when
//! `--true-cfg-scale` > 1), flow-match Euler with the scheduler's shift, and the causal 3D VAE.

use super::denoise::Denoise;
use super::draws::RunDraws;
use super::frame::Frame;
use super::jobs::Job;
use super::placement::Held;
use super::registry::FamilyOption::{
    Cache, FlowShift, Lora, Pab, Sigmas, StorageDtype, TaylorSeer, TrueCfgScale, VaeTiling,
};
use super::registry::{declared_by, latents_draw, About, Configs, Family, RunShape};
use super::spec::{Component, PipelineSpec, Role, Slot, StageSpec, TextEncoders};
use super::stages;
use crate::config::ModelDefaults;
use crate::models::clip::{self, ClipTextConfig, ClipTextModel};
use crate::models::hunyuan_video::activations;
use crate::models::hunyuan_video::scheduler::{guidance_input, sampler, FlowMatchEulerConfig};
use crate::models::hunyuan_video::text_encoder::{
    crop_prompt, LlamaConfig, LlamaDecoderLayer, LlamaPromptTokenizer, LlamaTextEncoder,
    LlamaTokenizerLoad, DEFAULT_PROMPT_TEMPLATE,
};
use crate::models::hunyuan_video::transformer::{
    HunyuanModulations, HunyuanVideoTransformer3DModel, HunyuanVideoTransformerConfig,
};
use crate::models::hunyuan_video::vae::{AutoencoderKLHunyuanVideo, HunyuanVideoVaeConfig};
use crate::models::step_cache::AttentionModules;
use crate::models::video::causal_latent_grid;
use crate::schedulers::euler::FlowMatchEuler;
use crate::schedulers::{Scheduler, SchedulerKind};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

/// Reads a HunyuanVideo model's configs (the registry's entry point).
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    Ok(Box::new(HunyuanConfigs::from_configs(configs)?))
}

/// The configs of a HunyuanVideo model: everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct HunyuanConfigs {
    pub transformer: HunyuanVideoTransformerConfig,
    pub vae: HunyuanVideoVaeConfig,
    pub text_encoder: LlamaConfig,
    pub text_encoder_2: ClipTextConfig,
    pub scheduler: FlowMatchEulerConfig,
    /// The class `model_index.json` names for `tokenizer` (how its file is loaded).
    pub tokenizer_class: String,
}

impl HunyuanConfigs {
    /// Reads every component's config.
    pub fn from_configs(configs: Configs) -> Result<Self> {
        let index: serde_json::Value = configs.read("model_index.json")?;
        Ok(HunyuanConfigs {
            // Every step's modulations are computed before denoising (`MODULATIONS`): the
            // streamed blocks leave them out.
            transformer: HunyuanVideoTransformerConfig {
                modulations_apart: true,
                ..configs.read("transformer/config.json")?
            },
            vae: configs.read("vae/config.json")?,
            text_encoder: configs.read("text_encoder/config.json")?,
            text_encoder_2: configs.read("text_encoder_2/config.json")?,
            scheduler: configs.read("scheduler/scheduler_config.json")?,
            tokenizer_class: index["tokenizer"][1]
                .as_str()
                .unwrap_or("LlamaTokenizerFast")
                .to_string(),
        })
    }

    /// The latent shape `[1, C, F', H', W']` for a video size.
    pub fn latent_shape(&self, num_frames: u32, height: u32, width: u32) -> [usize; 5] {
        let (t, s) = (
            self.vae.temporal_compression_ratio,
            self.vae.spatial_compression_ratio,
        );
        let [f, h, w] = causal_latent_grid(num_frames, height, width, t, s);
        [1, self.transformer.in_channels, f, h, w]
    }
}

/// The components of a HunyuanVideo pipeline.
#[derive(Clone, Copy)]
struct Parts {
    encoders: TextEncoders<LlamaTextEncoder, ClipTextModel>,
    transformer: Slot<HunyuanVideoTransformer3DModel>,
    modulations: Slot<HunyuanModulations>,
    vae: Slot<AutoencoderKLHunyuanVideo>,
}

impl HunyuanConfigs {
    /// Two text encoders (Llama, CLIP) used by one stage, the DiT, the VAE; every component
    /// only feeds tensors forward, so each is safe to defer. The pipeline as data with its
    /// components' slots.
    fn declare(&self, shape: &RunShape) -> (PipelineSpec, Parts) {
        let text = activations::text_encoder_activations(
            &self.text_encoder,
            &self.text_encoder_2,
            shape.text_len,
            clip::prompt::MAX_LENGTH,
            shape.dtype,
        );
        let latent = self.latent_shape(shape.num_frames, shape.height, shape.width);
        let (t, p) = (self.transformer.patch_size_t, self.transformer.patch_size);
        let tokens = latent[2] / t * (latent[3] / p) * (latent[4] / p) + shape.text_len;
        let cfg = HunyuanVideoTransformerConfig {
            fp8_matmul: shape.fp8_matmul,
            ..self.transformer.clone()
        };
        // Each block built on the device keeps its fp8 weight codes.
        let (fp8, block_codes) = shape.fp8_bytes(
            || activations::fp8_matmul_activations(&cfg, latent, shape.text_len),
            || activations::fp8_block_codes(&cfg),
        );
        let denoise = activations::transformer_activations(
            &self.transformer,
            latent,
            shape.text_len,
            shape.dtype,
        ) + fp8
            + shape.cache_bytes(
                (tokens, self.transformer.inner_dim()),
                // Every block's `attn`, the token refiner's too (its text-wide outputs counted as
                // block states): one prompt's each, the passes of guidance running apart.
                (
                    AttentionModules {
                        spatial: self.transformer.num_refiner_layers
                            + self.transformer.num_layers
                            + self.transformer.num_single_layers,
                        ..Default::default()
                    },
                    &self.transformer.hooked_blocks(),
                ),
                1,
            );
        let modulate = activations::modulations_activations(&self.transformer, shape.dtype);
        let decode = activations::vae_decode_activations(
            &self.vae,
            latent,
            (shape.num_frames, shape.height, shape.width),
            shape.vae_tiling,
            shape.dtype,
        );
        let mut spec = PipelineSpec::titled(self.title());
        let encoders = TextEncoders::add(&mut spec, (&self.text_encoder, &self.text_encoder_2));
        let transformer = spec.add(
            Component::new("transformer", Role::Dit, cfg)
                .with_original_layout(crate::weights::original::Model::HunyuanVideo),
        );
        let parts = Parts {
            encoders,
            modulations: spec.add_modulations(&self.transformer, &transformer),
            transformer,
            vae: spec.add_model("vae", Role::Vae, &self.vae),
        };
        spec.stages = vec![
            parts.encoders.stage(text, HunyuanVideo::encode_text),
            StageSpec::new("modulate", &[parts.modulations.index()], modulate)
                .runs(HunyuanVideo::modulate),
            StageSpec::new("denoise", &[parts.transformer.index()], denoise)
                .holding_per_block(block_codes)
                .runs(HunyuanVideo::denoise),
            StageSpec::new("decode", &[parts.vae.index()], decode).runs(HunyuanVideo::decode),
            StageSpec::write(),
        ];
        (spec, parts)
    }
}

impl Family for HunyuanConfigs {
    /// Text-to-video with embedded guidance, real CFG by `--true-cfg-scale` with a negative
    /// prompt, flow-match Euler with a shift, and a VAE that tiles.
    /// hunyuanvideo-community/HunyuanVideo's call defaults: 720x1280, 129 frames at 24 fps, 50
    /// steps, embedded guidance 6, 256 prompt tokens.
    fn about(&self) -> About {
        About {
            schedulers: &[SchedulerKind::Euler],
            cache_blocks: Some(self.transformer.hooked_blocks()),
            defaults: ModelDefaults {
                scheduler: Some(SchedulerKind::Euler),
                // Wan's rule: 4k+1 frames, multiples of 16 (the VAE's 4x time, 8x space, patch 2).
                ..ModelDefaults::video(720, 1280, 129, 24).sampling(50, 6.0, 256)
            },
            ..About::guided(
                "HunyuanVideo text-to-video",
                &[
                    TrueCfgScale,
                    FlowShift,
                    Sigmas,
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

    fn draws(&self, num_frames: u32, height: u32, width: u32) -> Vec<(&'static str, Vec<usize>)> {
        latents_draw(&self.latent_shape(num_frames, height, width))
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        serde_json::json!({
            "transformer_refiner_layers": self.transformer.num_refiner_layers,
            "transformer_dual_stream_layers": self.transformer.num_layers,
            "transformer_single_stream_layers": self.transformer.num_single_layers,
            "transformer_inner_dim": self.transformer.inner_dim(),
            "latent_shape": self.latent_shape(shape.num_frames, shape.height, shape.width),
            "vae_scale_factor_spatial": self.vae.spatial_compression_ratio,
            "vae_scale_factor_temporal": self.vae.temporal_compression_ratio,
            "text_encoder_layers": self.text_encoder.num_hidden_layers,
            "text_encoder_layers_used": self.text_encoder.layers_used(),
            "text_encoder_2_layers": self.text_encoder_2.num_hidden_layers,
            "tokenizer": self.tokenizer_class,
        })
    }

    declared_by!(HunyuanVideo::new);
}

/// One text's conditioning: Llama embeds `[1, L, D]`, their mask `[1, L]` (f32), the CLIP
/// pooled embedding `[1, P]`; kept in host memory between stages.
pub struct TextConds {
    pub embeds: Tensor,
    pub mask: Tensor,
    pub pooled: Tensor,
}

/// Every block's modulation chunks for one conditioning (a step of one prompt), then the output
/// head's, waiting in host memory as one tensor `[chunks, B, inner]`, entry `i`'s being
/// `counts[i]` of them in order.
struct StepModulations {
    all: Tensor,
    counts: Arc<Vec<usize>>,
}

impl StepModulations {
    /// On `device` (one copy), split per block as the blocks read them (`BlockInputs::modulations`).
    fn on(&self, device: &Device) -> Result<Arc<Vec<Vec<Tensor>>>> {
        let all = self.all.to_device(device)?;
        let mut at = 0;
        let mut blocks = Vec::with_capacity(self.counts.len());
        for &n in self.counts.iter() {
            blocks.push(
                (at..at + n)
                    .map(|k| all.get(k))
                    .collect::<candle_core::Result<_>>()?,
            );
            at += n;
        }
        Ok(Arc::new(blocks))
    }
}

/// What a job carries between stages beside [`Job`]'s own fields.
#[derive(Default)]
struct Carried {
    /// The (prompt, negative prompt) conditioning, from encode to denoise.
    conds: Option<(TextConds, Option<TextConds>)>,
    /// The modulations, per step and conditioning, from modulate to denoise.
    modulations: Vec<StepModulations>,
}

/// HunyuanVideo's own part of its pipeline (the frame holds the rest).
struct HunyuanVideo {
    configs: HunyuanConfigs,
    parts: Parts,
    tokenizer: LlamaPromptTokenizer,
    crop_start: usize,
    tokenizer_2: tokenizers::Tokenizer,
}

impl HunyuanVideo {
    /// Reads both tokenizers; loads no weights.
    fn new(configs: HunyuanConfigs, parts: Parts, frame: &Frame) -> Result<Self> {
        let source = &frame.source;
        let load = LlamaTokenizerLoad::for_class(&configs.tokenizer_class);
        let (json, tokenizer_config) = source.tokenizer_files("tokenizer")?;
        let tokenizer = LlamaPromptTokenizer::from_json(&json, tokenizer_config.as_deref(), load)
            .context("loading tokenizer/tokenizer.json")?;
        let crop_start = tokenizer.crop_start(DEFAULT_PROMPT_TEMPLATE)?;
        let tokenizer_2 = clip::prompt::tokenizer(source, "tokenizer_2")?;
        Ok(HunyuanVideo {
            configs,
            parts,
            tokenizer,
            crop_start,
            tokenizer_2,
        })
    }

    /// `_get_llama_prompt_embeds` of each text: the template around it, `hidden_states[-3]`, the
    /// template's tokens cropped; embeds and mask on the host. Each layer runs on every text in
    /// turn (a streamed encoder passes once for all), each result as encoding it alone gives.
    fn llama_embed(
        &self,
        frame: &Frame,
        encoder: &Held<'_, LlamaTextEncoder>,
        texts: &[&str],
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let device = frame.device_of(self.parts.encoders.text_encoder);
        let model = encoder.model()?;
        let max_len = frame.config.generation().max_sequence_length;
        encoder.each_through_blocks(
            LlamaTextEncoder::blocks,
            texts,
            |text| {
                let (ids, mask) = self.tokenizer.batch(
                    DEFAULT_PROMPT_TEMPLATE,
                    &[text],
                    self.crop_start,
                    max_len,
                    &device,
                )?;
                Ok((model.embed(&ids)?, (model.prepare(&mask, &device)?, mask)))
            },
            |block: &LlamaDecoderLayer, h, (prepared, _)| block.forward(h, prepared),
            |h, (_, mask)| {
                let (embeds, mask) = crop_prompt(&h, &mask, self.crop_start)?;
                Ok((
                    embeds.to_dtype(frame.dtype())?.to_device(&Device::Cpu)?,
                    mask.to_dtype(DType::F32)?.to_device(&Device::Cpu)?,
                ))
            },
        )
    }

    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let llama = frame.hold(self.parts.encoders.text_encoder)?;
        let clip = frame.hold(self.parts.encoders.text_encoder_2)?;
        let texts = stages::true_cfg_texts(frame, job);
        let conds = self
            .llama_embed(frame, &llama, &texts)?
            .into_iter()
            .zip(clip::prompt::pooled(
                &clip,
                &self.tokenizer_2,
                &frame.device_of(self.parts.encoders.text_encoder_2),
                frame.dtype(),
                &texts,
            )?)
            .map(|((embeds, mask), pooled)| TextConds {
                embeds,
                mask,
                pooled,
            });
        let (cond, negative) = stages::prompt_and_negative(conds, |c| [&c.embeds, &c.pooled])?;
        drop((llama, clip));
        job.carry.put(Carried {
            conds: Some((cond, negative)),
            modulations: Vec::new(),
        });
        Ok(())
    }

    /// The initial latents: the draws file's `latents`, else the seed's draw.
    fn initial_latents(&self, frame: &Frame, job: &Job) -> Result<Tensor> {
        let latents = RunDraws::take_for(frame, job, DType::F32, |draws, s| {
            draws.take(
                "latents",
                &self.configs.latent_shape(s.num_frames, s.height, s.width),
            )
        })?;
        Ok(latents.to_dtype(DType::F32)?.to_device(&frame.device)?)
    }

    fn denoise(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let carried: Carried = job.carry.take();
        let (cond, negative) = carried.conds.context("prompt not encoded")?;
        let model = &frame.hold(self.parts.transformer)?;
        let (dtype, device) = (frame.dtype(), &frame.device);
        let cond = on_device(frame, &cond)?;
        let negative = negative.as_ref().map(|n| on_device(frame, n)).transpose()?;
        let true_cfg_scale = stages::true_cfg(frame, job);
        let mut scheduler = self.sampler(frame, job)?;
        let guidance = guidance_input(job.guidance_scale, 1, dtype, device)?;
        let mut latents = self.initial_latents(frame, job)?;
        let timesteps = scheduler.timesteps().to_vec();
        if carried.modulations.is_empty() {
            anyhow::bail!("prompt not modulated");
        }
        let mut modulations = carried.modulations.into_iter();
        let denoise = Denoise::all(frame, timesteps.len(), |forwards, i| {
            let input = latents.to_dtype(dtype)?;
            // diffusers: t.expand(B).to(latents.dtype), float32.
            let timestep = Tensor::new(&[timesteps[i] as f32], device)?;
            let mut next = || modulations.next().context("a step without modulations");
            let cond = (&cond, next()?.on(device)?);
            let negative = match negative.as_ref().zip(true_cfg_scale) {
                Some((neg, scale)) => Some(((neg, next()?.on(device)?), scale)),
                None => None,
            };
            let noise = forwards.guided(
                model,
                timesteps[i],
                cond,
                negative,
                |m, (text, modulations)| {
                    let (embeds, mask, pooled) = (&text.embeds, &text.mask, &text.pooled);
                    let mut inputs =
                        m.prepare(&input, &timestep, embeds, mask, pooled, Some(&guidance))?;
                    // This step's modulations, computed apart ([`HunyuanModulations`]).
                    inputs.modulations = Some(modulations);
                    Ok(inputs)
                },
            )?;
            // The step runs as diffusers' does (dt * v in the model dtype, the sum in f32, then
            // back to the model dtype); the latents wait in f32, which holds that exactly.
            latents = scheduler.step(&noise, &latents)?.to_dtype(DType::F32)?;
            Ok(latents.clone())
        })?;
        denoise.finish_with(job, &latents)
    }

    /// The flow-match Euler sampler of `job`'s steps (over `--sigmas` where given).
    fn sampler(&self, frame: &Frame, job: &Job) -> Result<FlowMatchEuler> {
        let g = frame.config.generation();
        sampler(
            &self.configs.scheduler,
            job.num_inference_steps as usize,
            g.flow_shift,
            g.sigmas.as_deref(),
        )
    }

    /// Every step's modulations for the prompt (and, where true CFG runs, the negative
    /// prompt), in one pass over the modulation weights, which hold device memory for this
    /// stage only; they wait in host memory for denoise, a step's conditionings in order.
    fn modulate(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let mut carried: Carried = job.carry.take();
        let (cond, negative) = carried.conds.as_ref().context("prompt not encoded")?;
        let mut conds = vec![on_device(frame, cond)?];
        if let (Some(negative), Some(_)) = (negative, stages::true_cfg(frame, job)) {
            conds.push(on_device(frame, negative)?);
        }
        let device = &frame.device;
        let timesteps = self.sampler(frame, job)?.timesteps().to_vec();
        let guidance = guidance_input(job.guidance_scale, 1, frame.dtype(), device)?;
        let held = frame.hold(self.parts.modulations)?;
        let model = held.model()?;
        let conditionings = timesteps
            .iter()
            .flat_map(|&t| conds.iter().map(move |c| (t, c)))
            .map(|(t, c)| {
                // diffusers: t.expand(B).to(latents.dtype), float32.
                let timestep = Tensor::new(&[t as f32], device)?;
                model.conditioning(&timestep, &c.embeds, &c.mask, &c.pooled, Some(&guidance))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        // Block by block: every conditioning's chunks, stacked and moved to host memory at once.
        let mut per_block = Vec::new();
        held.fold_blocks(HunyuanModulations::blocks, (), |block, _| {
            let chunks = conditionings
                .iter()
                .map(|(temb, refiner_temb)| block.modulation(temb, refiner_temb))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let n = chunks.first().map_or(0, Vec::len);
            let chunks: Vec<Tensor> = chunks.into_iter().flatten().collect();
            per_block.push((n, Tensor::stack(&chunks, 0)?.to_device(&Device::Cpu)?));
            Ok(())
        })?;
        // Then the output head's, the table's last entry.
        let outputs = conditionings
            .iter()
            .map(|(temb, _)| model.output(temb))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let n = outputs.first().map_or(0, Vec::len);
        let outputs: Vec<Tensor> = outputs.into_iter().flatten().collect();
        per_block.push((n, Tensor::stack(&outputs, 0)?.to_device(&Device::Cpu)?));
        drop(held);
        let counts = Arc::new(per_block.iter().map(|(n, _)| *n).collect::<Vec<_>>());
        let tables = (0..conditionings.len())
            .map(|c| {
                let parts = per_block
                    .iter()
                    .map(|(n, t)| t.narrow(0, c * n, *n))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Ok(StepModulations {
                    all: Tensor::cat(&parts, 0)?,
                    counts: counts.clone(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        carried.modulations = tables;
        job.carry.put(carried);
        Ok(())
    }

    /// `latents / scaling_factor`, the VAE decode (temporal tiling as diffusers' default;
    /// spatial tiling with `--vae-tiling`), `(video / 2 + 0.5).clamp(0, 1)` as `[F, H, W, 3]`.
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let dtype = frame.dtype_of(self.parts.vae);
        frame.decode(job, self.parts.vae, |vae, latents, tiled| {
            let z = vae.scale_latents(&latents.to_dtype(dtype)?)?;
            let video = if tiled {
                let mut vae = vae.clone();
                let mut t = vae.tiling();
                t.spatial = true;
                vae.set_tiling(t)?;
                vae.decode(&z)?
            } else {
                vae.decode(&z)?
            };
            Ok(video.to_dtype(DType::F32)?)
        })
    }
}

/// A text conditioning in the run dtype on the device.
fn on_device(frame: &Frame, c: &TextConds) -> Result<TextConds> {
    let (dtype, device) = (frame.dtype(), &frame.device);
    Ok(TextConds {
        embeds: c.embeds.to_dtype(dtype)?.to_device(device)?,
        mask: c.mask.to_dtype(dtype)?.to_device(device)?,
        pooled: c.pooled.to_dtype(dtype)?.to_device(device)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::source::ModelSource;
    use crate::offload::GroupLayout;
    use crate::pipeline::holding::testing::{assert_within_mlp_step, built_names, names, streamed};
    use crate::pipeline::spec::{Constructors, ModelConstructors};

    /// The block list a weight belongs to (None: the outer part).
    fn list(name: &str) -> Option<&'static str> {
        [
            "context_embedder.token_refiner.refiner_blocks.",
            "transformer_blocks.",
            "single_transformer_blocks.",
        ]
        .into_iter()
        .find(|p| name.starts_with(p))
    }

    /// The published model's groups, streamed as the pipeline streams them (the modulations
    /// apart): block level never puts two kinds in one group (as diffusers groups each block
    /// list apart); leaf level splits every block body into its steps, none above the
    /// single-stream MLP step; the outer part keeps only the patch and text input embedders
    /// and the output projection; body steps, outer part and the modulation component (its
    /// outer part included) hold every weight exactly once.
    #[test]
    fn groups_hold_one_kind_and_steps_split_every_weight_once() -> anyhow::Result<()> {
        let cfg = HunyuanVideoTransformerConfig::default();
        let apart = HunyuanVideoTransformerConfig {
            modulations_apart: true,
            ..cfg.clone()
        };
        let model = ModelConstructors::<HunyuanVideoTransformer3DModel>(apart.clone());
        let holding = |c: &dyn Constructors, r| c.holding(r, None, DType::BF16);
        let groups = model
            .layout(holding(&model, streamed(8, false))?, DType::BF16, None)?
            .groups;
        let lists: Vec<Option<&str>> = groups
            .iter()
            .map(|g| {
                let kinds: Vec<_> = names(g).iter().map(|n| list(n)).collect();
                assert!(kinds.windows(2).all(|w| w[0] == w[1]), "{kinds:?}");
                kinds[0]
            })
            .collect();
        // 2 refiner blocks in one group, 20 dual-stream in 8 + 8 + 4, 40 single-stream in 5 x 8.
        let [refiner, dual, single] = [
            list("context_embedder.token_refiner.refiner_blocks.0"),
            list("transformer_blocks.0"),
            list("single_transformer_blocks.0"),
        ];
        let want = [vec![refiner], vec![dual; 3], vec![single; 5]].concat();
        assert_eq!(lists, want);

        let leaf = model.layout(holding(&model, streamed(1, true))?, DType::BF16, None)?;
        assert_eq!(
            leaf.groups.len(),
            2 * cfg.num_refiner_layers + 3 * cfg.num_layers + 2 * cfg.num_single_layers
        );
        assert_within_mlp_step(&leaf.groups, cfg.inner_dim(), cfg.mlp_dim());
        let outer =
            built_names(|vb| HunyuanVideoTransformer3DModel::new_without_blocks(&apart, vb))?;
        assert!(outer.iter().all(|n| list(n).is_none()));
        let modulations = ModelConstructors::<HunyuanModulations>(apart.clone());
        let modulations = modulations.layout(
            holding(&modulations, streamed(1, false))?,
            DType::BF16,
            None,
        )?;
        assert_eq!(modulations.groups.len(), cfg.num_blocks());
        // The modulations are a quarter of the block weights and more.
        let bytes = |groups: &[GroupLayout]| groups.iter().map(|g| g.bytes).sum::<usize>();
        let share = bytes(&modulations.groups) as f64
            / (bytes(&modulations.groups) + bytes(&leaf.groups)) as f64;
        assert!((0.26..0.29).contains(&share), "{share}");
        let mut split: Vec<String> = leaf.groups.iter().flat_map(names).collect();
        split.extend(outer);
        // The modulation component's own outer part: the conditioning embedders and the
        // output head's modulation, which the transformer's outer part then leaves out.
        split.extend(built_names(|vb| {
            HunyuanModulations::new_without_blocks(&apart, vb)
        })?);
        split.extend(modulations.groups.iter().flat_map(names));
        split.sort();
        let whole = built_names(|vb| HunyuanVideoTransformer3DModel::new(&cfg, vb))?;
        assert_eq!(split, whole);
        // Block streaming's slots: a dual-stream body is two single-stream bodies' bytes, so
        // the single-stream blocks fill a slot two at a time (the copy stream runs two of them
        // ahead in one dual-stream block's bytes), the dual-stream ones one each.
        let blocks = model.layout(holding(&model, streamed(1, false))?, DType::BF16, None)?;
        let runs = crate::offload::residency::SlotRuns::of(&blocks.groups);
        let sizes: Vec<usize> = runs.runs.iter().map(|r| r.len()).collect();
        // 2 refiner blocks, 20 dual-stream, 40 single-stream.
        assert_eq!(sizes, [vec![1; 2 + 20], vec![2; 20]].concat());
        Ok(())
    }

    /// `synthetic:hunyuanvideo` ships stand-in tokenizers (the tiny fixture's), so the CLI
    /// runs it: both load as the pipeline loads them, with the template's own crop_start.
    #[test]
    fn the_synthetic_model_ships_both_tokenizers() {
        let synthetic = ModelSource::Synthetic("hunyuanvideo");
        let fixture = ModelSource::Local(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/hunyuanvideo-tiny-a"),
        );
        let llama = |source: &ModelSource| {
            let (json, config) = source.tokenizer_files("tokenizer").unwrap();
            let load = LlamaTokenizerLoad::for_class("LlamaTokenizerFast");
            let tokenizer =
                LlamaPromptTokenizer::from_json(&json, config.as_deref(), load).unwrap();
            let crop_start = tokenizer.crop_start(DEFAULT_PROMPT_TEMPLATE).unwrap();
            (tokenizer.ids("a red fox").unwrap(), crop_start)
        };
        let (ids, crop_start) = llama(&synthetic);
        assert_eq!((ids.clone(), crop_start), llama(&fixture));
        assert!(crop_start > 1 && ids.len() > 1, "{crop_start} {ids:?}");
        let clip = clip::prompt::tokenizer(&synthetic, "tokenizer_2").unwrap();
        let encoding = clip.encode("a red fox", true).unwrap();
        assert_eq!(encoding.get_ids().len(), clip::prompt::MAX_LENGTH);
    }
}
