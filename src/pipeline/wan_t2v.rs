//! Wan2.1 text-to-video as a list of stages, step for step as diffusers' `WanPipeline`.

use super::jobs::Job;
use super::progress::Progress;
use super::runner::{Pipeline, StageSpec};
use crate::cli::ResolvedConfig;
use crate::memory::accounting::{MemoryMeter, MemoryPeaks};
use crate::models::loader::{component_weights, seeded_normal, var_builder};
use crate::models::source::{FileRef, ModelSource};
use crate::models::wan::prompt::{clean_prompt, PromptTokenizer};
use crate::models::wan::text_encoder::{UMT5Config, UMT5EncoderModel};
use crate::models::wan::transformer::{
    WanTransformer3DModel, WanTransformerBlock, WanTransformerConfig,
};
use crate::models::wan::vae::{AutoencoderKLWan, WanVaeConfig, WanVaeTiling};
use crate::offload;
use crate::schedulers::{self, SchedulerConfig};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::Serialize;

/// The loadable parts of Wan T2V.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Component {
    TextEncoder,
    Transformer,
    Vae,
}

impl Component {
    /// The component's folder in the diffusers layout.
    pub fn folder(self) -> &'static str {
        match self {
            Component::TextEncoder => "text_encoder",
            Component::Transformer => "transformer",
            Component::Vae => "vae",
        }
    }
}

const STAGES: &[StageSpec<Component>] = &[
    StageSpec {
        name: "encode_text",
        uses: &[Component::TextEncoder],
    },
    StageSpec {
        name: "denoise",
        uses: &[Component::Transformer],
    },
    StageSpec {
        name: "decode",
        uses: &[Component::Vae],
    },
    StageSpec {
        name: "write",
        uses: &[],
    },
];

/// The stages of Wan T2V.
pub fn stages() -> &'static [StageSpec<Component>] {
    STAGES
}

/// The components safe to defer.
pub fn deferrable() -> &'static [Component] {
    DEFERRABLE
}

/// Every component only feeds tensors forward, so each may load late and free early.
const DEFERRABLE: &[Component] = &[
    Component::TextEncoder,
    Component::Transformer,
    Component::Vae,
];

/// The configs of a Wan T2V model: everything planning needs, no weights.
#[derive(Clone, Debug)]
pub struct WanConfigs {
    pub transformer: WanTransformerConfig,
    pub vae: WanVaeConfig,
    pub text_encoder: UMT5Config,
    pub scheduler: SchedulerConfig,
}

impl WanConfigs {
    /// Reads model_index.json and every component's config.
    pub fn read(source: &ModelSource) -> Result<Self> {
        let index: serde_json::Value = source.json("model_index.json")?;
        let class = index["_class_name"].as_str().unwrap_or("");
        if class != "WanPipeline" {
            bail!("{source} is a {class:?} pipeline; vidgen runs Wan2.1 text-to-video (WanPipeline) models");
        }
        Ok(WanConfigs {
            transformer: source.json("transformer/config.json")?,
            vae: source.json("vae/config.json")?,
            text_encoder: source.json("text_encoder/config.json")?,
            scheduler: source.json("scheduler/scheduler_config.json")?,
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
    device: Device,
    tokenizer: PromptTokenizer,
    text_encoder: Option<UMT5EncoderModel>,
    transformer: Option<Dit>,
    vae: Option<AutoencoderKLWan>,
    progress: std::sync::Arc<Progress>,
    meter: MemoryMeter,
}

impl WanT2V {
    /// Reads configs and the tokenizer; loads no weights.
    pub fn new(
        config: ResolvedConfig,
        source: ModelSource,
        device: Device,
        progress: std::sync::Arc<Progress>,
    ) -> Result<Self> {
        let configs = WanConfigs::read(&source)?;
        let meter = MemoryMeter::new(&device);
        let tokenizer = match source.require("tokenizer/tokenizer.json")? {
            FileRef::Path(p) => PromptTokenizer::from_file(&p)?,
            FileRef::Embedded(text) => PromptTokenizer::from_json(text)?,
        };
        Ok(WanT2V {
            config,
            source,
            configs,
            device,
            tokenizer,
            text_encoder: None,
            transformer: None,
            vae: None,
            progress,
            meter,
        })
    }

    /// The model configs.
    pub fn configs(&self) -> &WanConfigs {
        &self.configs
    }

    fn vb(&self, component: Component, dtype: DType) -> Result<candle_nn::VarBuilder<'static>> {
        let weights = component_weights(&self.source, component.folder())?;
        var_builder(&weights, dtype, &self.device)
    }

    /// The prompt embeddings `[1, L, text_dim]` of one text, zero padded past its length.
    fn embed(&self, text: &str) -> Result<Tensor> {
        let encoder = self
            .text_encoder
            .as_ref()
            .context("text encoder not loaded")?;
        let max_len = self.config.options.max_sequence_length as usize;
        let (ids, seq_len) = self.tokenizer.encode(&clean_prompt(text), max_len)?;
        let ids = Tensor::new(ids.as_slice(), &self.device)?.unsqueeze(0)?;
        Ok(encoder
            .prompt_embeds(&ids, &[seq_len])?
            .to_dtype(self.config.dtype())?)
    }

    /// Encodes the prompts; the embeddings wait for the denoise stage in host memory, so a
    /// stage-major batch holds no device memory between stages.
    fn encode_text(&self, job: &mut Job) -> Result<()> {
        job.prompt_embeds = Some(self.embed(&job.prompt)?.to_device(&Device::Cpu)?);
        job.negative_embeds = if job.guidance_scale > 1.0 {
            Some(self.embed(&job.negative_prompt)?.to_device(&Device::Cpu)?)
        } else {
            None
        };
        Ok(())
    }

    fn initial_latents(&self, job: &Job) -> Result<Tensor> {
        let shape = self
            .configs
            .latent_shape(job.num_frames, job.height, job.width);
        match &self.config.options.latents {
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
        let model = self
            .transformer
            .as_ref()
            .context("transformer not loaded")?;
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
            self.config.options.scheduler,
            &self.configs.scheduler,
            job.num_inference_steps as usize,
            self.config.options.flow_shift,
        )?;
        let mut latents = self.initial_latents(job)?;
        let timesteps = scheduler.timesteps().to_vec();
        let mut forward_seconds = Vec::with_capacity(timesteps.len() * 2);
        for (i, t) in timesteps.iter().enumerate() {
            crate::pipeline::interrupt::check()?;
            let input = latents.to_dtype(dtype)?;
            let timestep = Tensor::new(&[*t as f32], &self.device)?;
            let noise_cond = self.timed(&mut forward_seconds, || {
                model.forward(&input, &timestep, cond)
            })?;
            let noise = match &uncond {
                Some(uncond) => {
                    let noise_uncond = self.timed(&mut forward_seconds, || {
                        model.forward(&input, &timestep, uncond)
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
        job.metrics
            .insert("forward_seconds".into(), serde_json::json!(forward_seconds));
        self.progress.note(&format!(
            "  transformer forwards: {}",
            forward_seconds
                .iter()
                .map(|s| format!("{s:.3}s"))
                .collect::<Vec<_>>()
                .join(" ")
        ));
        job.latents = Some(latents.to_device(&Device::Cpu)?);
        job.prompt_embeds = None;
        job.negative_embeds = None;
        Ok(())
    }

    /// Builds a component from its weights on the run device.
    fn load_component(&mut self, component: Component) -> Result<()> {
        let dtype = self.config.dtype();
        let what = || format!("loading {} of {}", component.folder(), self.source);
        match component {
            Component::TextEncoder => {
                let vb = self.vb(component, dtype)?;
                self.text_encoder =
                    Some(UMT5EncoderModel::new(&self.configs.text_encoder, vb).with_context(what)?);
            }
            Component::Transformer => {
                let vb = self.vb(component, dtype)?;
                self.transformer = Some(self.place_dit(vb).with_context(what)?);
            }
            Component::Vae => {
                // diffusers runs the Wan VAE in f32.
                let vb = self.vb(component, DType::F32)?;
                self.vae = Some(AutoencoderKLWan::new(&self.configs.vae, vb).with_context(what)?);
            }
        }
        Ok(())
    }

    /// Places the DiT: resident, or with its blocks streamed from host memory by the offload
    /// engine (`--dit-layerwise-offload`, blocks per group and prefetch depth as configured).
    fn place_dit(&self, vb: candle_nn::VarBuilder<'static>) -> Result<Dit> {
        let cfg = &self.configs.transformer;
        let o = &self.config.options;
        if !o.dit_layerwise_offload {
            return Ok(Dit::Resident(WanTransformer3DModel::new(cfg, vb)?));
        }
        let model = WanTransformer3DModel::new_without_blocks(cfg, vb.clone())?;
        let per_group = o.num_blocks_per_group.max(1) as usize;
        let num_layers = cfg.num_layers;
        let layers = move |g: usize| g * per_group..((g + 1) * per_group).min(num_layers);
        let groups = (0..num_layers.div_ceil(per_group))
            .map(|g| offload::host_group(&vb, |vb| build_group(cfg, layers(g), &vb)))
            .collect::<Result<Vec<_>>>()?;
        let build_cfg = cfg.clone();
        let streamer = offload::Streamer::new(
            groups,
            move |g, vb| build_group(&build_cfg, layers(g), &vb),
            self.config.dtype(),
            self.device.clone(),
            o.prefetch_depth as usize,
        );
        self.progress.note(&format!(
            "dit layerwise offload: {} blocks in host memory ({:.2} GiB), {} per group, prefetch depth {}",
            cfg.num_layers,
            streamer.host_bytes() as f64 / (1u64 << 30) as f64,
            per_group,
            o.prefetch_depth
        ));
        Ok(Dit::Streamed { model, streamer })
    }

    /// Runs `f` and records its wall time, waiting for the device so the time is the work's.
    fn timed<T>(
        &self,
        seconds: &mut Vec<f64>,
        f: impl FnOnce() -> candle_core::Result<T>,
    ) -> Result<T> {
        let start = std::time::Instant::now();
        let out = f()?;
        self.device.synchronize()?;
        seconds.push(start.elapsed().as_secs_f64());
        Ok(out)
    }

    fn decode(&self, job: &mut Job) -> Result<()> {
        let vae = self.vae.as_ref().context("VAE not loaded")?;
        let latents = job.latents.take().context("nothing denoised")?;
        let z = vae.denormalize(&latents.to_dtype(DType::F32)?.to_device(&self.device)?)?;
        // [1, 3, T, H, W] in [-1, 1]
        let video = if self.config.options.vae_tiling {
            vae.decode_tiled(&z, &WanVaeTiling::default())?
        } else {
            vae.decode(&z)?
        };
        let frames = ((video * 0.5)? + 0.5)?.clamp(0f32, 1f32)?;
        let frames = frames
            .squeeze(0)?
            .permute((1, 2, 3, 0))?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?;
        job.frames = Some(frames);
        Ok(())
    }

    fn write(&self, job: &mut Job) -> Result<()> {
        let frames = job.frames.take().context("nothing decoded")?;
        let metadata = vec![
            ("title".to_string(), job.prompt.clone()),
            (
                "comment".to_string(),
                format!("vidgen: {} seed {}", self.config.options.model, job.seed),
            ),
            ("vidgen_prompt".to_string(), job.prompt.clone()),
            (
                "vidgen_negative_prompt".to_string(),
                job.negative_prompt.clone(),
            ),
            ("vidgen_seed".to_string(), job.seed.to_string()),
            (
                "vidgen_model".to_string(),
                self.config.options.model.clone(),
            ),
            (
                "vidgen_config".to_string(),
                serde_json::to_string(&self.config.options)?,
            ),
        ];
        crate::output::write(
            self.config.options.output_type,
            &job.output,
            &frames,
            self.config.options.fps,
            &metadata,
        )?;
        job.written = true;
        Ok(())
    }
}

impl Pipeline for WanT2V {
    type Component = Component;
    type Job = Job;

    fn stages(&self) -> &'static [StageSpec<Component>] {
        STAGES
    }

    fn deferrable(&self) -> &'static [Component] {
        DEFERRABLE
    }

    fn load(&mut self, component: Component) -> Result<()> {
        let start = std::time::Instant::now();
        self.meter.reset();
        self.load_component(component)?;
        self.device.synchronize()?;
        self.progress.note(&format!(
            "loaded {} in {:.2}s: {}",
            component.folder(),
            start.elapsed().as_secs_f64(),
            describe_peaks(&self.meter.peaks())
        ));
        Ok(())
    }

    fn release(&mut self, component: Component) {
        match component {
            Component::TextEncoder => self.text_encoder = None,
            Component::Transformer => self.transformer = None,
            Component::Vae => self.vae = None,
        }
    }

    fn run_stage(&mut self, index: usize, job: &mut Job) -> Result<()> {
        let name = STAGES[index].name;
        self.meter.reset();
        let result = match name {
            "encode_text" => self.encode_text(job),
            "denoise" => self.denoise(job),
            "decode" => self.decode(job),
            _ => self.write(job),
        };
        if let Err(e) = result {
            return Err(self.explain_out_of_memory(name, e));
        }
        let peaks = self.meter.peaks();
        self.progress
            .note(&format!("  {name}: {}", describe_peaks(&peaks)));
        let stages = job
            .metrics
            .entry("stages")
            .or_insert_with(|| serde_json::json!({}));
        stages[name] = serde_json::to_value(peaks)?;
        Ok(())
    }
}

impl WanT2V {
    /// Turns a device out-of-memory error into one that names the stage, the memory in use and
    /// the flags that lower the peak; other errors pass through.
    fn explain_out_of_memory(&self, stage: &str, e: anyhow::Error) -> anyhow::Error {
        let text = format!("{e:#}");
        if !text.contains("OUT_OF_MEMORY") && !text.to_ascii_lowercase().contains("out of memory") {
            return e;
        }
        let o = &self.config.options;
        let mut fixes = Vec::new();
        if !o.dit_layerwise_offload {
            fixes.push("--dit-layerwise-offload");
        }
        if !self.config.lazy_module_load() {
            fixes.push("--lazy-module-load");
        }
        if stage == "decode" && !o.vae_tiling {
            fixes.push("--vae-tiling");
        }
        fixes.push("smaller --height/--width/--num-frames");
        e.context(format!(
            "out of device memory in stage {stage} ({}); try {}",
            describe_peaks(&self.meter.peaks()),
            fixes.join(", ")
        ))
    }
}

/// The DiT as placed: all weights on the device, or blocks streamed by the offload engine.
enum Dit {
    Resident(WanTransformer3DModel),
    Streamed {
        model: WanTransformer3DModel,
        streamer: offload::Streamer<Vec<WanTransformerBlock>>,
    },
}

impl Dit {
    fn forward(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        text: &Tensor,
    ) -> candle_core::Result<Tensor> {
        match self {
            Dit::Resident(model) => model.forward(latents, timestep, text),
            Dit::Streamed { model, streamer } => {
                let mut inputs = model.prepare(latents, timestep, text)?;
                let mut x = inputs.take_hidden_states()?;
                streamer
                    .for_each(|group| {
                        for block in group {
                            x = block.forward(&x, &inputs)?;
                        }
                        Ok(())
                    })
                    .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
                model.finish(&x, &inputs)
            }
        }
    }
}

/// Builds the blocks `layers` from a `VarBuilder` rooted at the transformer.
fn build_group(
    cfg: &WanTransformerConfig,
    layers: std::ops::Range<usize>,
    vb: &candle_nn::VarBuilder<'static>,
) -> candle_core::Result<Vec<WanTransformerBlock>> {
    layers
        .map(|i| WanTransformerBlock::new(cfg, vb.pp(format!("blocks.{i}"))))
        .collect()
}

/// One line for a stage's memory: device peaks (used / reserved by the pool) and host RSS.
fn describe_peaks(p: &MemoryPeaks) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    format!(
        "device peak {:.2} GiB used, {:.2} GiB reserved; host RSS peak {:.2} GiB",
        p.device_used_peak as f64 / GIB,
        p.device_reserved_peak as f64 / GIB,
        p.host_rss_peak as f64 / GIB
    )
}
