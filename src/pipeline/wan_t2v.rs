//! Wan2.1 text-to-video as a list of stages, step for step as diffusers' `WanPipeline`.

use super::jobs::Job;
use super::placement::Held;
use super::placement::{Blockwise, Placed, Placement};
use super::progress::Progress;
use super::runner::{Pipeline, StageSpec};
use crate::cli::args::GenerateOptions;
use crate::cli::ResolvedConfig;
use crate::memory::accounting::{MemoryMeter, MemoryPeaks};
use crate::memory::plan;
use crate::models::loader::{component_weights, seeded_normal, WeightSet};
use crate::models::source::{FileRef, ModelSource};
use crate::models::wan::prompt::{clean_prompt, PromptTokenizer};
use crate::models::wan::text_encoder::{
    attention_mask, zero_padding_rows, UMT5Block, UMT5Config, UMT5EncoderModel,
};
use crate::models::wan::transformer::{
    BlockStep, WanTransformer3DModel, WanTransformerBlock, WanTransformerConfig,
};
use crate::models::wan::vae::{AutoencoderKLWan, WanVaeConfig, WanVaeTiling};
use crate::schedulers::{self, SchedulerConfig};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
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

/// Where the options put each component, as it applies to these models (streaming by step
/// only where blocks have steps).
pub fn placement(options: &GenerateOptions, configs: &WanConfigs) -> Result<Placement> {
    let placement = Placement::new(options)?;
    Ok(Placement {
        text_encoder: placement
            .text_encoder
            .for_steps(UMT5EncoderModel::steps(&configs.text_encoder)),
        dit: placement
            .dit
            .for_steps(WanTransformer3DModel::steps(&configs.transformer)),
        vae: placement
            .vae
            .for_steps(AutoencoderKLWan::steps(&configs.vae)),
        ..placement
    })
}

/// Options this pipeline accepts but that act on nothing in it, each with why.
pub fn inert_options(o: &GenerateOptions) -> Vec<String> {
    let mut notes = Vec::new();
    if o.image_encoder_cpu_offload {
        notes.push(
            "--image-encoder-cpu-offload has nothing to move: Wan2.1 text-to-video has no image encoder"
                .to_string(),
        );
    }
    notes
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
    placement: Placement,
    text_encoder: Option<Placed<UMT5EncoderModel>>,
    transformer: Option<Placed<WanTransformer3DModel>>,
    vae: Option<Placed<AutoencoderKLWan>>,
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
        let placement = placement(&config.options, &configs)?;
        Ok(WanT2V {
            placement,
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

    /// The prompt embeddings `[1, L, text_dim]` of one text, zero padded past its length
    /// (`_get_t5_prompt_embeds`), with the encoder's blocks resident or streamed.
    fn embed(&self, encoder: &Held<'_, UMT5EncoderModel>, text: &str) -> Result<Tensor> {
        let max_len = self.config.options.max_sequence_length as usize;
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
        job.metrics
            .insert("forward_seconds".into(), serde_json::json!(forward_seconds));
        if let (Some(before), Some(after)) = (before, placed.offload_usage()) {
            let (copies, pinned) = (after.copies.since(&before.copies), after.pinned_bytes);
            self.progress.note(&format!(
                "  offload: {:.2} GB copied in {:.2}s of copy-stream time ({:.1} GB/s), {:.2} GiB pinned",
                copies.bytes as f64 / 1e9,
                copies.busy_seconds,
                copies.gb_per_second(),
                pinned as f64 / (1u64 << 30) as f64
            ));
            job.metrics.insert(
                "offload".into(),
                serde_json::json!({
                    "bytes_copied": copies.bytes,
                    "groups_copied": copies.groups,
                    "copy_busy_seconds": copies.busy_seconds,
                    "copy_gb_per_second": copies.gb_per_second(),
                    "pinned_bytes": pinned,
                    "host_bytes": after.host_bytes,
                }),
            );
        }
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

    /// Builds a component from its weights, placed as the options say.
    fn load_component(&mut self, component: Component) -> Result<()> {
        let dtype = self.config.dtype();
        let what = || format!("loading {} of {}", component.folder(), self.source);
        let weights = WeightSet::open(&component_weights(&self.source, component.folder())?)
            .with_context(what)?;
        let total = weights.stored_bytes();
        let weights = weights.with_progress(
            self.progress
                .bytes(&format!("reading {}", component.folder()), total),
        );
        match component {
            Component::TextEncoder => {
                let placed = self.place(component, &self.configs.text_encoder, &weights, dtype);
                self.text_encoder = Some(placed.with_context(what)?);
            }
            Component::Transformer => {
                let placed = self.place(component, &self.configs.transformer, &weights, dtype);
                self.transformer = Some(placed.with_context(what)?);
            }
            Component::Vae => {
                // diffusers runs the Wan VAE in f32.
                let placed = self.place(component, &self.configs.vae, &weights, DType::F32);
                self.vae = Some(placed.with_context(what)?);
            }
        }
        Ok(())
    }

    /// Builds `component` as the placement says and reports where its weights went.
    fn place<M: Blockwise>(
        &self,
        component: Component,
        cfg: &M::Config,
        weights: &WeightSet,
        dtype: DType,
    ) -> Result<Placed<M>> {
        let residency = match component {
            Component::TextEncoder => self.placement.text_encoder,
            Component::Transformer => self.placement.dit,
            Component::Vae => self.placement.vae,
        };
        let placed = Placed::load(
            cfg,
            weights,
            residency,
            self.placement.memory,
            dtype,
            &self.device,
        )?;
        const GIB: f64 = (1u64 << 30) as f64;
        self.progress.note(&match placed.offload_usage() {
            Some(u) => format!(
                "{}: {residency}; {:.2} GiB in host memory, {:.2} GiB pinned",
                component.folder(),
                u.host_bytes as f64 / GIB,
                u.pinned_bytes as f64 / GIB
            ),
            None => format!("{}: {residency}", component.folder()),
        });
        Ok(placed)
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
        let held = self.vae.as_ref().context("VAE not loaded")?.hold()?;
        let vae = held.model();
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
        let loaded = self
            .load_component(component)
            .and_then(|()| Ok(self.device.synchronize()?));
        if let Err(e) = loaded {
            let when = format!("while loading {}", component.folder());
            return Err(self.explain_out_of_memory(&when, e));
        }
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
            return Err(self.explain_out_of_memory(&format!("in stage {name}"), e));
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
    /// Turns a device out-of-memory error into one that names the stage, the memory in use, the
    /// peak and the device's size, and the option set the memory plan predicts to fit; other
    /// errors pass through.
    fn explain_out_of_memory(&self, when: &str, e: anyhow::Error) -> anyhow::Error {
        let text = format!("{e:#}");
        if !text.contains("OUT_OF_MEMORY") && !text.to_ascii_lowercase().contains("out of memory") {
            return e;
        }
        let peaks = self.meter.peaks();
        let total = self.config.device.total_memory;
        let in_use = match (peaks.device_in_use_now, total) {
            (0, _) => String::new(),
            (used, Some(total)) => format!(
                "; {:.2} of {:.2} GiB in use on the device",
                plan::gib(used),
                plan::gib(total)
            ),
            (used, None) => format!("; {:.2} GiB in use on the device", plan::gib(used)),
        };
        let advice = plan::advice(&self.config, &|c| plan::wan::plan(&self.configs, c), total);
        e.context(format!(
            "out of device memory {when} ({}{in_use}); {advice}",
            describe_peaks(&peaks)
        ))
    }
}

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

impl Blockwise for UMT5EncoderModel {
    type Config = UMT5Config;
    type Block = UMT5Block;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self> {
        Self::new(cfg, vb)
    }
    /// The token table stays in host memory: only the looked-up rows move.
    fn outer(cfg: &Self::Config, vb: VarBuilder, host_vb: VarBuilder) -> candle_core::Result<Self> {
        Self::new_without_blocks(cfg, vb, host_vb)
    }
    fn num_blocks(cfg: &Self::Config) -> usize {
        cfg.num_layers
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> candle_core::Result<Self::Block> {
        Self::block(cfg, i, vb)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiny fixture's pipeline on the CPU, as a run would build it.
    fn tiny() -> WanT2V {
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/wan-tiny-a");
        let argv = [
            "vidgen",
            "generate",
            "--model",
            fixture,
            "--prompt",
            "a",
            "--device",
            "cpu",
            "--memory-model",
            "discrete",
            "--no-dit-layerwise-offload",
        ];
        let crate::cli::Parsed::Generate(args) = crate::cli::parse(argv.map(Into::into)).unwrap()
        else {
            panic!("not a generate command")
        };
        let config = ResolvedConfig::resolve(*args).unwrap();
        let source = ModelSource::parse(fixture).unwrap();
        let progress = std::sync::Arc::new(Progress::new(true));
        WanT2V::new(config, source, Device::Cpu, progress).unwrap()
    }

    /// A device out-of-memory error, at load or in a stage, names when it happened and what to
    /// change; any other error passes through untouched.
    #[test]
    fn out_of_memory_errors_say_when_and_what_fits() {
        let pipeline = tiny();
        let oom = anyhow::anyhow!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")");
        let text = format!(
            "{:#}",
            pipeline.explain_out_of_memory("while loading transformer", oom)
        );
        assert!(
            text.starts_with("out of device memory while loading transformer ("),
            "{text}"
        );
        assert!(text.contains("device peak"), "{text}");
        assert!(text.contains("--dit-layerwise-offload"), "advice: {text}");
        assert!(
            text.contains("CUDA_ERROR_OUT_OF_MEMORY"),
            "the cause is kept: {text}"
        );
        let other = anyhow::anyhow!("shape mismatch for blocks.0.attn1.to_q.weight");
        let text = format!(
            "{:#}",
            pipeline.explain_out_of_memory("in stage denoise", other)
        );
        assert_eq!(text, "shape mismatch for blocks.0.attn1.to_q.weight");
    }
}
