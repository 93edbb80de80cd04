//! FLUX.1 text-to-image (black-forest-labs/FLUX.1-dev) as a list of stages, step for step as
//! diffusers' `FluxPipeline.__call__` (see [`crate::models::flux`]): CLIP's pooled output and
//! T5 without a mask, the guidance-distilled DiT on 2x2-packed latents (embedded guidance; real
//! CFG, a second forward with the negative prompt, only when `--true-cfg-scale` > 1), flow-match
//! Euler shifted by the image's token count, and the 2-D `AutoencoderKL`. It makes one image:
//! frames `[1, H, W, 3]`.

use super::denoise::Denoise;
use super::draws::{Draws, RunDraws};
use super::frame::Frame;
use super::jobs::Job;
use super::registry::FamilyOption::{
    Cache, GuidanceScale, Lora, Pab, Sigmas, StorageDtype, TaylorSeer, TrueCfgScale, VaeTiling,
};
use super::registry::{declared_by, latents_draw, About, Configs, Family, RunShape};
use super::spec::{Component, PipelineSpec, Role, Slot, StageSpec, TextEncoders};
use super::stages;
use crate::config::video::FrameRule;
use crate::config::ModelDefaults;
use crate::models::autoencoder_kl::{AutoencoderKL, AutoencoderKLConfig};
use crate::models::clip::{self, ClipTextConfig, ClipTextModel};
use crate::models::flux::activations;
use crate::models::flux::packing::{pack, unpack};
use crate::models::flux::transformer::{
    image_ids, timestep_input, FluxTransformer2DModel, FluxTransformerConfig,
};
use crate::models::step_cache::AttentionModules;
use crate::models::t5::encoder::{T5Config, T5EncoderModel};
use crate::models::t5::tokenizer::PromptTokenizer;
use crate::output::OutputType;
use crate::rng::TorchGenerator;
use crate::schedulers::euler::{FlowMatchEuler, FlowMatchEulerConfig};
use crate::schedulers::Scheduler;
use anyhow::{Context, Result};
use candle_core::{DType, Tensor};

/// The most T5 tokens FluxPipeline takes (`check_inputs` refuses more).
const MAX_SEQUENCE_LENGTH: usize = 512;

/// FluxPipeline's `default_sample_size`: the default image side is this times the VAE's scale.
const DEFAULT_SAMPLE_SIZE: u32 = 128;

/// Reads a FLUX model's configs (the registry's entry point).
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    Ok(Box::new(FluxConfigs::from_configs(configs)?))
}

/// The configs of a FLUX model: everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct FluxConfigs {
    pub transformer: FluxTransformerConfig,
    pub vae: AutoencoderKLConfig,
    pub text_encoder: ClipTextConfig,
    pub text_encoder_2: T5Config,
    pub scheduler: FlowMatchEulerConfig,
}

impl FluxConfigs {
    /// Reads every component's config; a transformer whose packed tokens do not hold 2x2 of the
    /// VAE's latents is refused.
    pub fn from_configs(configs: Configs) -> Result<Self> {
        let configs = FluxConfigs {
            transformer: configs.read("transformer/config.json")?,
            vae: configs.read("vae/config.json")?,
            text_encoder: configs.read("text_encoder/config.json")?,
            text_encoder_2: configs.read("text_encoder_2/config.json")?,
            scheduler: configs.read("scheduler/scheduler_config.json")?,
        };
        configs.transformer.validate()?;
        configs.vae.validate()?;
        let (t, v) = (&configs.transformer, &configs.vae);
        if t.in_channels != 4 * v.latent_channels {
            anyhow::bail!(
                "transformer/config.json: in_channels {} is not 4 x the VAE's latent_channels {} (2x2 packed latents)",
                t.in_channels,
                v.latent_channels
            );
        }
        Ok(configs)
    }

    /// The side every image size is a multiple of: the VAE's scale times the 2x2 packing.
    fn size_step(&self) -> u32 {
        (self.vae.scale_factor() * 2) as u32
    }

    /// The VAE latent `h x w` of an image (FluxPipeline floors the size to [`Self::size_step`]).
    pub fn latent_size(&self, height: u32, width: u32) -> (usize, usize) {
        let step = self.size_step();
        (2 * (height / step) as usize, 2 * (width / step) as usize)
    }

    /// The packed latent shape `[1, (h/2)·(w/2), in_channels]` of an image.
    pub fn packed_shape(&self, height: u32, width: u32) -> [usize; 3] {
        let (h, w) = self.latent_size(height, width);
        [1, (h / 2) * (w / 2), self.transformer.in_channels]
    }
}

/// The components of a FLUX pipeline.
#[derive(Clone, Copy)]
struct Parts {
    encoders: TextEncoders<ClipTextModel, T5EncoderModel>,
    transformer: Slot<FluxTransformer2DModel>,
    vae: Slot<AutoencoderKL>,
}

impl FluxConfigs {
    /// Two text encoders (CLIP, T5) used by one stage, the DiT, the VAE, each in the run's dtype
    /// and safe to defer; the pipeline as data with its components' slots.
    fn declare(&self, shape: &RunShape) -> (PipelineSpec, Parts) {
        let dtype = shape.dtype;
        let text = activations::text_encoder_activations(
            &self.text_encoder,
            &self.text_encoder_2,
            clip::prompt::MAX_LENGTH,
            shape.text_len,
            dtype,
        );
        let [_, tokens, _] = self.packed_shape(shape.height, shape.width);
        let transformer = FluxTransformerConfig {
            fp8_matmul: shape.fp8_matmul,
            ..self.transformer.clone()
        };
        // Each block built on the device keeps its fp8 weight codes.
        let (fp8, block_codes) = shape.fp8_bytes(
            || activations::fp8_matmul_activations(&transformer, tokens, shape.text_len),
            || activations::fp8_block_codes(&transformer),
        );
        let denoise =
            activations::transformer_activations(&transformer, tokens, shape.text_len, dtype)
                + fp8
                + shape.cache_bytes(
                    (tokens + shape.text_len, self.transformer.inner_dim()),
                    // Every block's `attn`: the dual blocks' image and text outputs, the single
                    // blocks' joint one, each a block state wide.
                    (
                        AttentionModules {
                            spatial: self.transformer.num_blocks(),
                            ..Default::default()
                        },
                        &self.transformer.hooked_blocks(),
                    ),
                    1,
                );
        let (h, w) = self.latent_size(shape.height, shape.width);
        let decode = activations::vae_decode_activations(&self.vae, h, w, shape.vae_tiling, dtype);
        let mut spec = PipelineSpec::titled(self.title());
        let parts = Parts {
            encoders: TextEncoders::add(&mut spec, (&self.text_encoder, &self.text_encoder_2)),
            transformer: spec.add(
                Component::new("transformer", Role::Dit, transformer)
                    .with_original_layout(crate::weights::original::Model::Flux),
            ),
            vae: spec.add_model("vae", Role::Vae, &self.vae),
        };
        // diffusers' FLUX.1 loader reads the LoRAs of its CLIP too.
        spec.components[parts.encoders.text_encoder.index()].lora =
            Some(crate::lora::Target::ClipText);
        spec.stages = vec![
            parts.encoders.stage(text, Flux::encode_text),
            StageSpec::new("denoise", &[parts.transformer.index()], denoise)
                .holding_per_block(block_codes)
                .runs(Flux::denoise),
            StageSpec::new("decode", &[parts.vae.index()], decode).runs(Flux::decode),
            StageSpec::write(),
        ];
        (spec, parts)
    }
}

impl Family for FluxConfigs {
    /// Text-to-image with embedded guidance (where the transformer embeds it: not FLUX.1
    /// schnell), real CFG by `--true-cfg-scale` with a negative prompt; its schedule comes from
    /// its own config and the image's size. FluxPipeline's call defaults: 1024x1024 (128 x the
    /// VAE's scale), one image written as a PNG file, 28 steps, embedded guidance 3.5, 512 T5
    /// tokens; sizes in multiples of 16 (the VAE's 8 x the 2x2 packing).
    fn about(&self) -> About {
        let side = DEFAULT_SAMPLE_SIZE * self.vae.scale_factor() as u32;
        let guided = About::guided(
            "FLUX.1 text-to-image",
            &[
                TrueCfgScale,
                Sigmas,
                VaeTiling,
                Lora,
                StorageDtype,
                Cache,
                Pab,
                TaylorSeer,
            ],
        );
        let embeds_guidance = self.transformer.guidance_embeds;
        About {
            cache_blocks: Some(self.transformer.hooked_blocks()),
            options: (guided.options.into_iter())
                .filter(|&o| o != GuidanceScale || embeds_guidance)
                .collect(),
            defaults: ModelDefaults {
                height: Some(side),
                width: Some(side),
                num_frames: Some(1),
                fps: None,
                num_inference_steps: Some(28),
                guidance_scale: Some(3.5),
                max_sequence_length: Some(MAX_SEQUENCE_LENGTH as u32),
                frame_rule: Some(FrameRule::any_frames(self.size_step(), 1)),
                image: true,
                ..ModelDefaults::default()
            },
            ..guided
        }
    }

    /// An image, not a video: one frame, no MP4; and at most 512 T5 tokens.
    fn inapplicable(&self, config: &crate::config::ResolvedConfig) -> Option<String> {
        let v = config.video();
        if let Some(refusal) = self.size_refusal(v.num_frames, v.height, v.width) {
            return Some(refusal);
        }
        if config.output().kind == OutputType::Mp4 {
            return Some(format!(
                "--output-type mp4 does not apply to {}: it makes one image; use png or safetensors",
                self.title()
            ));
        }
        let len = config.generation().max_sequence_length;
        (len > MAX_SEQUENCE_LENGTH).then(|| {
            format!(
                "--max-sequence-length {len}: FLUX.1's T5 takes at most {MAX_SEQUENCE_LENGTH} tokens; pass {MAX_SEQUENCE_LENGTH} or fewer"
            )
        })
    }

    /// One image: a frame count other than 1 (a flag's or a prompt-file line's) is refused.
    fn size_refusal(&self, num_frames: u32, _height: u32, _width: u32) -> Option<String> {
        (num_frames != 1).then(|| {
            format!(
                "--num-frames {num_frames}: {} makes one image; drop the flag (or pass 1)",
                self.title()
            )
        })
    }

    fn draws(&self, _num_frames: u32, height: u32, width: u32) -> Vec<(&'static str, Vec<usize>)> {
        latents_draw(&self.packed_shape(height, width))
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        serde_json::json!({
            "transformer_dual_stream_layers": self.transformer.num_layers,
            "transformer_single_stream_layers": self.transformer.num_single_layers,
            "transformer_inner_dim": self.transformer.inner_dim(),
            "latent_shape": self.packed_shape(shape.height, shape.width),
            "latent_layout": "packed 2x2 tokens",
            "scheduler_mu": self.scheduler.use_dynamic_shifting.then(|| {
                self.scheduler.mu(self.packed_shape(shape.height, shape.width)[1])
            }),
            "vae_scale_factor_spatial": self.vae.scale_factor(),
            "text_encoder_layers": self.text_encoder.num_hidden_layers,
            "text_encoder_2_layers": self.text_encoder_2.num_layers,
        })
    }

    declared_by!(Flux::new);
}

/// One text's conditioning: T5 embeds `[1, L, D]` and the CLIP pooled embedding `[1, P]`, in
/// host memory between stages.
struct TextConds {
    embeds: Tensor,
    pooled: Tensor,
}

impl TextConds {
    /// The conditioning in the run dtype on the device.
    fn on_device(&self, frame: &Frame) -> Result<TextConds> {
        let (dtype, device) = (frame.dtype(), &frame.device);
        Ok(TextConds {
            embeds: self.embeds.to_dtype(dtype)?.to_device(device)?,
            pooled: self.pooled.to_dtype(dtype)?.to_device(device)?,
        })
    }
}

/// What a job carries from encode to denoise beside [`Job`]'s own fields: the prompt's and, with
/// real CFG, the negative prompt's conditioning.
#[derive(Default)]
struct Carried {
    conds: Option<(TextConds, Option<TextConds>)>,
}

/// FLUX's own part of its pipeline (the frame holds the rest).
struct Flux {
    configs: FluxConfigs,
    parts: Parts,
    tokenizer: tokenizers::Tokenizer,
    tokenizer_2: PromptTokenizer,
}

impl Flux {
    /// Reads both tokenizers and checks the draws file against the run's size; loads no
    /// weights.
    fn new(configs: FluxConfigs, parts: Parts, frame: &Frame) -> Result<Self> {
        let source = &frame.source;
        let tokenizer = clip::prompt::tokenizer(source, "tokenizer")?;
        let tokenizer_2 = PromptTokenizer::from_source(source, "tokenizer_2/tokenizer.json")?;
        let pipeline = Flux {
            configs,
            parts,
            tokenizer,
            tokenizer_2,
        };
        RunDraws::check(frame, |draws, s| {
            let packed = pipeline.configs.packed_shape(s.height, s.width);
            draws.take("latents", &packed).map(drop)
        })?;
        Ok(pipeline)
    }

    /// Encodes the prompt (and the negative prompt under real CFG) with both encoders; the
    /// conditionings wait for denoise in host memory.
    fn encode_text(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let clip = frame.hold(self.parts.encoders.text_encoder)?;
        let t5 = frame.hold(self.parts.encoders.text_encoder_2)?;
        let texts = stages::true_cfg_texts(frame, job);
        let device = frame.device_of(self.parts.encoders.text_encoder);
        let pooled = clip::prompt::pooled(&clip, &self.tokenizer, &device, frame.dtype(), &texts)?;
        // `_get_t5_prompt_embeds`: T5's `last_hidden_state` of the padded ids without a mask.
        let conds = stages::t5_embeds(frame, &t5, &self.tokenizer_2, &texts, false)?
            .into_iter()
            .zip(pooled)
            .map(|((embeds, _), pooled)| TextConds { embeds, pooled });
        let (cond, negative) = stages::prompt_and_negative(conds, |c| [&c.embeds, &c.pooled])?;
        job.carry.put(Carried {
            conds: Some((cond, negative)),
        });
        Ok(())
    }

    /// The initial packed latents: the draws file's `latents`, else the seed's draw of the
    /// unpacked `[1, C, h, w]` in the run dtype, packed (as `prepare_latents`).
    fn initial_latents(&self, frame: &Frame, job: &Job) -> Result<Tensor> {
        let latents = match &frame.config.generation().latents {
            Some(path) => {
                let mut draws = Draws::open(path)?;
                let shape = self.configs.packed_shape(job.height, job.width);
                let latents = draws.take("latents", &shape)?;
                draws.finish()?;
                latents
            }
            None => {
                let (h, w) = self.configs.latent_size(job.height, job.width);
                let shape = [1, self.configs.vae.latent_channels, h, w];
                pack(&TorchGenerator::new(job.seed).randn_as(&shape, frame.dtype())?)?
            }
        };
        Ok(latents.to_dtype(frame.dtype())?.to_device(&frame.device)?)
    }

    fn denoise(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let carried: Carried = job.carry.take();
        let (cond, negative) = carried.conds.context("prompt not encoded")?;
        let model = &frame.hold(self.parts.transformer)?;
        let (dtype, device) = (frame.dtype(), &frame.device);
        let cond = cond.on_device(frame)?;
        let negative = negative.map(|n| n.on_device(frame)).transpose()?;
        let true_cfg_scale = stages::true_cfg(frame, job);
        let mut latents = self.initial_latents(frame, job)?;
        let tokens = latents.dim(1)?;
        let cfg = &self.configs.scheduler;
        let mut scheduler = match &frame.config.generation().sigmas {
            // `set_timesteps(sigmas=..., mu=...)`: the pipeline's shift of its own sigmas.
            Some(sigmas) => FlowMatchEuler::with_sigmas(
                cfg,
                sigmas,
                cfg.use_dynamic_shifting.then(|| cfg.mu(tokens)),
            )?,
            None => {
                FlowMatchEuler::for_sequence_length(cfg, job.num_inference_steps as usize, tokens)?
            }
        };
        let (h, w) = self.configs.latent_size(job.height, job.width);
        let ids = Ids {
            text: Tensor::zeros((cond.embeds.dim(1)?, 3), DType::F32, device)?,
            image: image_ids(h / 2, w / 2, device)?,
        };
        // diffusers: torch.full([1], guidance_scale, dtype=float32).
        let guidance = self
            .configs
            .transformer
            .guidance_embeds
            .then(|| Tensor::new(&[job.guidance_scale as f32], device))
            .transpose()?;
        let timesteps = scheduler.timesteps().to_vec();
        let denoise = Denoise::all(frame, timesteps.len(), |forwards, i| {
            let timestep = timestep_input(timesteps[i], dtype, device)?;
            let negative = negative.as_ref().zip(true_cfg_scale);
            let noise = forwards.guided(model, timesteps[i], &cond, negative, |m, text| {
                let (embeds, pooled, guidance) = (&text.embeds, &text.pooled, guidance.as_ref());
                m.prepare(
                    &latents, &timestep, embeds, pooled, guidance, &ids.text, &ids.image,
                )
            })?;
            latents = scheduler.step(&noise, &latents)?;
            Ok(latents.clone())
        })?;
        denoise.finish_with(job, &latents)
    }

    /// `_unpack_latents`, `z / scaling_factor + shift_factor`, the VAE decode (tiled with
    /// `--vae-tiling` as `enable_tiling()`) and `(image / 2 + 0.5).clamp(0, 1)` as one frame
    /// `[1, H, W, 3]`.
    fn decode(&self, frame: &Frame, job: &mut Job) -> Result<()> {
        let (h, w) = self.configs.latent_size(job.height, job.width);
        let dtype = frame.dtype_of(self.parts.vae);
        frame.decode(job, self.parts.vae, |vae, latents, tiled| {
            let vae = vae.with_tiling(tiled.then(|| vae.config().tiling()))?;
            let z = unpack(&latents, h, w)?.to_dtype(dtype)?;
            let image = vae.decode(&vae.unscale(&z)?)?.to_dtype(DType::F32)?;
            Ok(image.unsqueeze(2)?)
        })
    }
}

/// The RoPE ids of a forward: the text's (zeros `[L, 3]`) and the packed image's.
struct Ids {
    text: Tensor,
    image: Tensor,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::source::ModelSource;
    use crate::offload::GroupLayout;
    use crate::pipeline::holding::testing::{assert_within_mlp_step, built_names, names, streamed};
    use crate::pipeline::spec::{Constructors, ModelConstructors};
    use candle_core::Device;

    /// The published transformer streamed as the pipeline streams it: block level never puts a
    /// dual- and a single-stream block in one group (as diffusers groups each block list apart);
    /// leaf level splits every block into its steps, none above the single-stream MLP; the
    /// outer part and the steps hold every weight exactly once.
    #[test]
    fn groups_hold_one_kind_and_steps_split_every_weight_once() -> Result<()> {
        let cfg: FluxTransformerConfig = serde_json::from_str(include_str!(
            "../../assets/flux.1-dev/transformer/config.json"
        ))?;
        let model = ModelConstructors::<FluxTransformer2DModel>(cfg.clone());
        let layout = |residency| -> Result<Vec<GroupLayout>> {
            let holding = model.holding(residency, None, DType::BF16)?;
            Ok(model.layout(holding, DType::BF16, None)?.groups)
        };
        let dual = |name: &String| name.starts_with("transformer_blocks.");
        let kinds: Vec<bool> = layout(streamed(8, false))?
            .iter()
            .map(|g| {
                let names = names(g);
                assert!(
                    names.iter().all(|n| dual(n) == dual(&names[0])),
                    "{names:?}"
                );
                dual(&names[0])
            })
            .collect();
        let groups = |n: usize| n.div_ceil(8);
        let want = [
            vec![true; groups(cfg.num_layers)],
            vec![false; groups(cfg.num_single_layers)],
        ]
        .concat();
        assert_eq!(kinds, want);
        // Leaf level: every step its own group, none above the single-stream MLP step.
        let leaf = layout(streamed(1, true))?;
        assert_eq!(leaf.len(), 8 * cfg.num_layers + 3 * cfg.num_single_layers);
        assert_within_mlp_step(&leaf, cfg.inner_dim(), cfg.mlp_dim());
        let outer = built_names(|vb| FluxTransformer2DModel::new_without_blocks(&cfg, vb))?;
        let mut split: Vec<String> = leaf.iter().flat_map(names).chain(outer).collect();
        split.sort();
        let whole = built_names(|vb| FluxTransformer2DModel::new(&cfg, vb))?;
        assert_eq!(split, whole);
        Ok(())
    }

    /// The CLIP tokenizer as the pipeline loads it, from the fixture and from the stand-ins
    /// `synthetic:flux.1-dev` ships, gives the ids FluxPipeline fed its CLIP (77 each, padded
    /// with `<|endoftext|>`).
    #[test]
    fn clip_tokens_match_the_pipeline() -> Result<()> {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/flux-tiny-a");
        let readme: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference/README.json"))?)?;
        let reference = candle_core::safetensors::load(
            dir.join("reference/text_encoder.safetensors"),
            &Device::Cpu,
        )?;
        let want: Vec<Vec<i64>> = reference["clip.input_ids"].to_vec2()?;
        let prompts = readme["files"]["text_encoder.safetensors"]["inputs"]["prompts"]
            .as_array()
            .context("prompts")?;
        for source in [
            ModelSource::Local(dir.clone()),
            ModelSource::Synthetic("flux.1-dev"),
        ] {
            let tokenizer = clip::prompt::tokenizer(&source, "tokenizer")?;
            for (prompt, want) in prompts.iter().zip(&want) {
                let prompt = prompt.as_str().context("a prompt")?;
                let encoding = tokenizer.encode(prompt, true).map_err(anyhow::Error::msg)?;
                let ids: Vec<i64> = encoding.get_ids().iter().map(|&i| i64::from(i)).collect();
                assert_eq!(&ids, want, "{prompt:?}");
            }
        }
        Ok(())
    }
}
