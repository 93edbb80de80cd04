//! Wan2.1 text-to-video as a list of stages, step for step as diffusers' `WanPipeline`.

use super::jobs::Job;
use super::placement::{Blockwise, Held, Placed, Placement};
use super::progress::Progress;
use super::registry::{Configs, Family, RunShape};
use super::runner::Pipeline;
use super::spec::{ComponentSpec, ModelConstructors, PipelineSpec, Role, StageSpec};
use super::stages;
use crate::cli::ResolvedConfig;
use crate::models::source::{FileRef, ModelSource};
use crate::models::wan::activations;
use crate::models::wan::prompt::{clean_prompt, PromptTokenizer};
use crate::models::wan::text_encoder::{
    attention_mask, zero_padding_rows, UMT5Block, UMT5Config, UMT5EncoderModel,
};
use crate::models::wan::transformer::{
    BlockStep, WanTransformer3DModel, WanTransformerBlock, WanTransformerConfig,
};
use crate::models::wan::vae::{AutoencoderKLWan, WanVaeConfig, WanVaeTiling};
use crate::schedulers::{self, SchedulerConfig};
use crate::weights::{seeded_normal, WeightSet};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::sync::Arc;

/// Components, by their index in the description.
const TEXT_ENCODER: usize = 0;
const TRANSFORMER: usize = 1;
const VAE: usize = 2;

/// Stages, by their index in the description.
const ENCODE_TEXT: usize = 0;
const DENOISE: usize = 1;
const DECODE: usize = 2;

/// Reads a Wan T2V model's configs (the registry's entry point).
pub fn read(configs: Configs) -> Result<Box<dyn Family>> {
    Ok(Box::new(WanConfigs::from_configs(configs)?))
}

impl Family for WanConfigs {
    /// Text encoder, DiT and VAE (in f32, as diffusers runs it), each used by one stage and
    /// safe to defer: every component only feeds tensors forward.
    fn spec(&self, shape: &RunShape) -> PipelineSpec {
        let component = |name, role, dtype, constructors| ComponentSpec {
            name,
            role,
            dtype,
            deferrable: true,
            constructors,
        };
        let latent = self.latent_shape(shape.num_frames, shape.height, shape.width);
        let tiling = shape.vae_tiling.then(WanVaeTiling::default);
        let stage = |name, uses: &[usize], activation_bytes| StageSpec {
            name,
            uses: uses.to_vec(),
            activation_bytes,
        };
        PipelineSpec {
            title: "Wan2.1 text-to-video",
            components: vec![
                component(
                    "text_encoder",
                    Role::TextEncoder,
                    None,
                    Arc::new(ModelConstructors::<UMT5EncoderModel>(
                        self.text_encoder.clone(),
                    )),
                ),
                component(
                    "transformer",
                    Role::Dit,
                    None,
                    Arc::new(ModelConstructors::<WanTransformer3DModel>(
                        self.transformer.clone(),
                    )),
                ),
                component(
                    "vae",
                    Role::Vae,
                    Some(DType::F32),
                    Arc::new(ModelConstructors::<AutoencoderKLWan>(self.vae.clone())),
                ),
            ],
            stages: vec![
                stage(
                    "encode_text",
                    &[TEXT_ENCODER],
                    activations::text_encoder_activations(
                        &self.text_encoder,
                        shape.text_len,
                        shape.dtype,
                    ),
                ),
                stage(
                    "denoise",
                    &[TRANSFORMER],
                    activations::transformer_activations(
                        &self.transformer,
                        latent,
                        shape.text_len,
                        shape.dtype,
                    ),
                ),
                stage(
                    "decode",
                    &[VAE],
                    activations::vae_decode_activations(&self.vae, latent, tiling.as_ref()),
                ),
                stage("write", &[], 0),
            ],
        }
    }

    fn facts(&self, shape: &RunShape) -> serde_json::Value {
        serde_json::json!({
            "transformer_layers": self.transformer.num_layers,
            "transformer_inner_dim": self.transformer.inner_dim(),
            "latent_shape": self.latent_shape(shape.num_frames, shape.height, shape.width),
            "vae_scale_factor_spatial": self.vae.scale_factor_spatial(),
            "vae_scale_factor_temporal": self.vae.scale_factor_temporal(),
            "text_encoder_layers": self.text_encoder.num_layers,
        })
    }

    fn open(
        &self,
        config: ResolvedConfig,
        source: ModelSource,
        device: Device,
        progress: Arc<Progress>,
    ) -> Result<Box<dyn Pipeline<Job = Job>>> {
        Ok(Box::new(WanT2V::new(
            self.clone(),
            config,
            source,
            device,
            progress,
        )?))
    }
}

/// The configs of a Wan T2V model: everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct WanConfigs {
    pub transformer: WanTransformerConfig,
    pub vae: WanVaeConfig,
    pub text_encoder: UMT5Config,
    pub scheduler: SchedulerConfig,
}

impl WanConfigs {
    /// Reads every component's config of `source`.
    pub fn read(source: &ModelSource) -> Result<Self> {
        Self::from_configs(Configs::Fetch(source))
    }

    /// Reads every component's config.
    pub fn from_configs(configs: Configs) -> Result<Self> {
        Ok(WanConfigs {
            transformer: configs.read("transformer/config.json")?,
            vae: configs.read("vae/config.json")?,
            text_encoder: configs.read("text_encoder/config.json")?,
            scheduler: configs.read("scheduler/scheduler_config.json")?,
        })
    }

    /// The latent shape `[1, C, F', H', W']` for a video size.
    pub fn latent_shape(&self, num_frames: u32, height: u32, width: u32) -> [usize; 5] {
        let t = self.vae.scale_factor_temporal();
        let s = self.vae.scale_factor_spatial();
        [
            1,
            self.transformer.in_channels,
            (num_frames as usize - 1) / t + 1,
            height as usize / s,
            width as usize / s,
        ]
    }
}

/// Wan T2V with its loaded components.
pub struct WanT2V {
    config: ResolvedConfig,
    source: ModelSource,
    configs: WanConfigs,
    spec: PipelineSpec,
    device: Device,
    tokenizer: PromptTokenizer,
    placement: Placement,
    text_encoder: Option<Placed<UMT5EncoderModel>>,
    transformer: Option<Placed<WanTransformer3DModel>>,
    vae: Option<Placed<AutoencoderKLWan>>,
    progress: Arc<Progress>,
}

impl WanT2V {
    /// Reads the tokenizer; loads no weights.
    pub fn new(
        configs: WanConfigs,
        config: ResolvedConfig,
        source: ModelSource,
        device: Device,
        progress: Arc<Progress>,
    ) -> Result<Self> {
        let spec = configs.spec(&RunShape::of(&config));
        let tokenizer = match source.require("tokenizer/tokenizer.json")? {
            FileRef::Path(p) => PromptTokenizer::from_file(&p)?,
            FileRef::Embedded(text) => PromptTokenizer::from_json(text)?,
        };
        let placement = Placement::new(&config.memory, &spec);
        Ok(WanT2V {
            placement,
            config,
            source,
            configs,
            spec,
            device,
            tokenizer,
            text_encoder: None,
            transformer: None,
            vae: None,
            progress,
        })
    }

    /// The model configs.
    pub fn configs(&self) -> &WanConfigs {
        &self.configs
    }

    /// The prompt embeddings `[1, L, text_dim]` of one text, zero padded past its length
    /// (`_get_t5_prompt_embeds`), with the encoder's blocks resident or streamed.
    fn embed(&self, encoder: &Held<'_, UMT5EncoderModel>, text: &str) -> Result<Tensor> {
        let max_len = self.config.generation.max_sequence_length;
        let (ids, seq_len) = self.tokenizer.encode(&clean_prompt(text), max_len)?;
        let model = encoder.model();
        let device = model.device();
        let ids = Tensor::new(ids.as_slice(), &device)?.unsqueeze(0)?;
        let mask = attention_mask(&[seq_len], max_len, &device)?;
        let mut h = model.embed(&ids)?;
        encoder.for_each_block(UMT5EncoderModel::blocks, |block: &UMT5Block| {
            h = block.forward(&h, &mask)?;
            Ok(())
        })?;
        Ok(zero_padding_rows(&model.final_norm(&h)?, &[seq_len])?.to_dtype(self.config.dtype())?)
    }

    /// Encodes the prompts; the embeddings wait for the denoise stage in host memory, so a
    /// stage-major batch holds no device memory between stages.
    fn encode_text(&self, job: &mut Job) -> Result<()> {
        let placed = self
            .text_encoder
            .as_ref()
            .context("text encoder not loaded")?;
        let encoder = placed.hold()?;
        job.prompt_embeds = Some(self.embed(&encoder, &job.prompt)?.to_device(&Device::Cpu)?);
        job.negative_embeds = if job.guidance_scale > 1.0 {
            Some(
                self.embed(&encoder, &job.negative_prompt)?
                    .to_device(&Device::Cpu)?,
            )
        } else {
            None
        };
        Ok(())
    }

    fn initial_latents(&self, job: &Job) -> Result<Tensor> {
        let shape = self
            .configs
            .latent_shape(job.num_frames, job.height, job.width);
        match &self.config.generation.latents {
            Some(path) => {
                let tensors = candle_core::safetensors::load(path, &Device::Cpu)
                    .with_context(|| format!("reading --latents {}", path.display()))?;
                let tensor = match tensors.get("latents") {
                    Some(t) => t.clone(),
                    None if tensors.len() == 1 => tensors
                        .into_values()
                        .next()
                        .unwrap_or_else(|| unreachable!()),
                    None => bail!(
                        "--latents {} has no tensor named `latents` and more than one tensor",
                        path.display()
                    ),
                };
                if tensor.dims() != shape {
                    bail!(
                        "--latents {} has shape {:?} but this run needs {:?} ([1, channels, (frames-1)/{}+1, height/{}, width/{}])",
                        path.display(),
                        tensor.dims(),
                        shape,
                        self.configs.vae.scale_factor_temporal(),
                        self.configs.vae.scale_factor_spatial(),
                        self.configs.vae.scale_factor_spatial()
                    );
                }
                Ok(tensor.to_dtype(DType::F32)?.to_device(&self.device)?)
            }
            None => Ok(seeded_normal(job.seed, &shape)?.to_device(&self.device)?),
        }
    }

    fn denoise(&self, job: &mut Job) -> Result<()> {
        let placed = self
            .transformer
            .as_ref()
            .context("transformer not loaded")?;
        let before = placed.offload_usage();
        let model = &placed.hold()?;
        let dtype = self.config.dtype();
        let cond = job
            .prompt_embeds
            .as_ref()
            .context("prompt not encoded")?
            .to_device(&self.device)?;
        let cond = &cond;
        let uncond = match &job.negative_embeds {
            Some(t) => Some(t.to_device(&self.device)?),
            None => None,
        };
        let mut scheduler = schedulers::build(
            self.config.generation.scheduler,
            &self.configs.scheduler,
            job.num_inference_steps as usize,
            self.config.generation.flow_shift,
        )?;
        let mut latents = self.initial_latents(job)?;
        let timesteps = scheduler.timesteps().to_vec();
        let mut forward_seconds = Vec::with_capacity(timesteps.len() * 2);
        for (i, t) in timesteps.iter().enumerate() {
            crate::pipeline::interrupt::check()?;
            let input = latents.to_dtype(dtype)?;
            let timestep = Tensor::new(&[*t as f32], &self.device)?;
            let noise_cond = self.timed(&mut forward_seconds, || {
                dit_forward(model, &input, &timestep, cond)
            })?;
            let noise = match &uncond {
                Some(uncond) => {
                    let noise_uncond = self.timed(&mut forward_seconds, || {
                        dit_forward(model, &input, &timestep, uncond)
                    })?;
                    // diffusers combines in the transformer dtype.
                    let diff = (&noise_cond - &noise_uncond)?;
                    (noise_uncond + (diff * job.guidance_scale)?)?
                }
                None => noise_cond,
            };
            latents = scheduler.step(&noise, &latents)?.to_dtype(DType::F32)?;
            self.progress.step(i + 1, timesteps.len());
        }
        stages::report_denoise(
            &self.progress,
            job,
            forward_seconds,
            before,
            placed.offload_usage(),
        );
        job.latents = Some(latents.to_device(&Device::Cpu)?);
        job.prompt_embeds = None;
        job.negative_embeds = None;
        Ok(())
    }

    /// Builds a component from its weights, placed as the options say.
    fn load_component(&mut self, component: usize) -> Result<()> {
        let spec = self.spec.components[component].clone();
        let dtype = spec.dtype(self.config.dtype());
        let what = || format!("loading {} of {}", spec.name, self.source);
        let weights = stages::open_weights(&self.source, spec.name, &self.progress)?;
        match component {
            TEXT_ENCODER => {
                let placed = self.place(component, &self.configs.text_encoder, &weights, dtype);
                self.text_encoder = Some(placed.with_context(what)?);
            }
            TRANSFORMER => {
                let placed = self.place(component, &self.configs.transformer, &weights, dtype);
                self.transformer = Some(placed.with_context(what)?);
            }
            _ => {
                let placed = self.place(component, &self.configs.vae, &weights, dtype);
                self.vae = Some(placed.with_context(what)?);
            }
        }
        Ok(())
    }

    /// Builds `component` as the placement says and reports where its weights went.
    fn place<M: Blockwise>(
        &self,
        component: usize,
        cfg: &M::Config,
        weights: &WeightSet,
        dtype: DType,
    ) -> Result<Placed<M>> {
        stages::place(
            &self.spec,
            &self.placement,
            component,
            cfg,
            weights,
            dtype,
            &self.device,
            &self.progress,
        )
    }

    /// Runs `f` and records its wall time, waiting for the device so the time is the work's.
    fn timed<T>(
        &self,
        seconds: &mut Vec<f64>,
        f: impl FnOnce() -> candle_core::Result<T>,
    ) -> Result<T> {
        stages::timed(&self.device, seconds, f)
    }

    fn decode(&self, job: &mut Job) -> Result<()> {
        let held = self.vae.as_ref().context("VAE not loaded")?.hold()?;
        let vae = held.model();
        let latents = job.latents.take().context("nothing denoised")?;
        let z = vae.denormalize(&latents.to_dtype(DType::F32)?.to_device(&self.device)?)?;
        // [1, 3, T, H, W] in [-1, 1]
        let video = if self.config.memory.vae_tiling {
            vae.decode_tiled(&z, &WanVaeTiling::default())?
        } else {
            vae.decode(&z)?
        };
        job.frames = Some(stages::video_frames(&video)?);
        Ok(())
    }

    fn write(&self, job: &mut Job) -> Result<()> {
        stages::write_video(&self.config, job)
    }
}

impl Pipeline for WanT2V {
    type Job = Job;

    fn spec(&self) -> &PipelineSpec {
        &self.spec
    }

    fn load(&mut self, component: usize) -> Result<()> {
        self.load_component(component)
    }

    fn release(&mut self, component: usize) {
        match component {
            TEXT_ENCODER => self.text_encoder = None,
            TRANSFORMER => self.transformer = None,
            _ => self.vae = None,
        }
    }

    fn run_stage(&mut self, index: usize, job: &mut Job) -> Result<()> {
        match index {
            ENCODE_TEXT => self.encode_text(job),
            DENOISE => self.denoise(job),
            DECODE => self.decode(job),
            _ => self.write(job),
        }
    }
}

impl WanT2V {}

/// One DiT forward: prepare, the blocks (resident or streamed), finish.
pub fn dit_forward(
    dit: &Held<'_, WanTransformer3DModel>,
    latents: &Tensor,
    timestep: &Tensor,
    text: &Tensor,
) -> candle_core::Result<Tensor> {
    let model = dit.model();
    let mut inputs = model.prepare(latents, timestep, text)?;
    let mut x = inputs.take_hidden_states()?;
    dit.for_each_block(WanTransformer3DModel::blocks, |block| {
        x = block.forward(&x, &inputs)?;
        Ok(())
    })
    .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
    model.finish(&x, &inputs)
}

impl Blockwise for WanTransformer3DModel {
    type Config = WanTransformerConfig;
    type Block = WanTransformerBlock;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self> {
        Self::new(cfg, vb)
    }
    fn outer(cfg: &Self::Config, vb: VarBuilder, _: VarBuilder) -> candle_core::Result<Self> {
        Self::new_without_blocks(cfg, vb)
    }
    fn num_blocks(cfg: &Self::Config) -> usize {
        cfg.num_layers
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> candle_core::Result<Self::Block> {
        WanTransformerBlock::new(cfg, vb.pp(format!("blocks.{i}")))
    }
    fn steps(_: &Self::Config) -> usize {
        BlockStep::ALL.len()
    }
    fn block_step(
        cfg: &Self::Config,
        i: usize,
        step: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<Self::Block> {
        WanTransformerBlock::with_steps(cfg, vb.pp(format!("blocks.{i}")), &[BlockStep::ALL[step]])
    }
}

/// The VAE has no repeated blocks to stream: it is resident or parked whole.
impl Blockwise for AutoencoderKLWan {
    type Config = WanVaeConfig;
    type Block = ();
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self> {
        Self::new(cfg, vb)
    }
    fn outer(cfg: &Self::Config, vb: VarBuilder, _: VarBuilder) -> candle_core::Result<Self> {
        Self::new(cfg, vb)
    }
    fn num_blocks(_: &Self::Config) -> usize {
        0
    }
    fn block(_: &Self::Config, _: usize, _: VarBuilder) -> candle_core::Result<()> {
        candle_core::bail!("the Wan VAE is offloaded whole, not block by block")
    }
}
