//! Offload benchmark: one synthetic DiT (or the Wan VAE) per mode, in one process, timed the
//! way diffusers' peer scripts time (median s/forward after warm-up, pool peaks reset after it).
//! Every family whose DiT streams by blocks runs: Wan (2.1, 2.2), LTX-Video, CogVideoX,
//! HunyuanVideo, Mochi-1, Allegro, Latte-1 and FLUX.1 (size 1xHxW), each fed the inputs its
//! pipeline feeds its transformer at one CFG branch.
//!
//! cargo build --release --features cuda --example offload_bench
//! offload_bench MODEL FORWARDS FRAMESxHEIGHTxWIDTH 'label: flags' ...   (a Wan label starting with "vae" decodes instead)
//!
//! With `VIDGEN_BENCH_FILES=DIR`, a synthetic model's weights are first written to DIR as
//! safetensors (bf16, f32 where the model keeps f32) and every mode loads them from that file,
//! as from a downloaded checkpoint sitting in the page cache (DIR on a tmpfs such as /dev/shm).
//!
//! Prints one JSON object per mode: s/forward, setup seconds, the move-in of a parked model
//! (`hold_s`), model memory (pool bytes in use once placed), inference peaks (used / reserved),
//! pinned and host bytes, bytes copied, copy busy time and throughput, and the largest
//! difference of the output from the first mode's.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use std::sync::Arc;
use std::time::Instant;
use vidgen::cli::args::GenerateOptions;
use vidgen::memory::accounting::{MemoryMeter, MemoryPeaks};
use vidgen::models::allegro::transformer::AllegroTransformer3DModel;
use vidgen::models::cogvideox::transformer::CogVideoXTransformer3DModel;
use vidgen::models::flux::transformer::{image_ids, timestep_input, FluxTransformer2DModel};
use vidgen::models::hunyuan_video::scheduler::guidance_input;
use vidgen::models::hunyuan_video::transformer::{
    HunyuanModulations, HunyuanVideoTransformer3DModel, HunyuanVideoTransformerConfig,
};
use vidgen::models::latte::transformer::LatteTransformer3DModel;
use vidgen::models::ltx::transformer::{LtxTransformer3DModel, LtxTransformerConfig};
use vidgen::models::mochi::transformer::MochiTransformer3DModel;
use vidgen::models::source::component_weights;
use vidgen::models::source::ModelSource;
use vidgen::models::wan::transformer::WanTransformer3DModel;
use vidgen::models::wan::vae::AutoencoderKLWan;
use vidgen::offload::group::Slot;
use vidgen::offload::{record, Packing, Residency, Usage};
use vidgen::pipeline::allegro::AllegroConfigs;
use vidgen::pipeline::cogvideox::CogVideoXConfigs;
use vidgen::pipeline::flux::FluxConfigs;
use vidgen::pipeline::holding::Holding;
use vidgen::pipeline::hunyuan_video::{HunyuanConfigs, TextConds};
use vidgen::pipeline::latte::LatteConfigs;
use vidgen::pipeline::ltx::LtxConfigs;
use vidgen::pipeline::mochi::MochiConfigs;
use vidgen::pipeline::placement::{Blockwise, Held, Placed, Placement};
use vidgen::pipeline::registry::{family, Configs, RunShape};
use vidgen::pipeline::wan_t2v::{dit_forward, WanConfigs};
use vidgen::rng::TorchGenerator;
use vidgen::weights::{WeightSet, Weights};

/// Valid prompt tokens where a pipeline passes an attention mask (as the peer script's).
const PROMPT_TOKENS: usize = 40;

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    options: GenerateOptions,
}

/// What every mode of one run shares.
struct Bench {
    source: ModelSource,
    size: [u32; 3],
    forwards: usize,
    device: Device,
    meter: MemoryMeter,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let size: Vec<u32> = args[3]
        .split('x')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .context("size is FRAMESxHEIGHTxWIDTH, e.g. 81x480x832")?;
    let device = Device::new_cuda(0).or_else(|_| Ok::<_, anyhow::Error>(Device::Cpu))?;
    let bench = Bench {
        source: ModelSource::parse(&args[1])?,
        forwards: args[2].parse()?,
        size: [size[0], size[1], size[2]],
        meter: MemoryMeter::new(&device),
        device,
    };
    let modes = &args[4..];
    let index: serde_json::Value = bench.source.json("model_index.json")?;
    let bf16 = |t: Tensor, device: &Device| -> Result<Tensor> {
        Ok(t.to_dtype(DType::BF16)?.to_device(device)?)
    };
    let [frames, height, width] = bench.size;
    match index["_class_name"].as_str().unwrap_or("") {
        "WanPipeline" | "WanImageToVideoPipeline" => {
            let c = WanConfigs::read(&bench.source)?;
            if c.transformer.has_image_branch() {
                bail!("the benchmark feeds text-to-video inputs; an image-to-video DiT is not covered");
            }
            let shape = c.latent_shape(frames, height, width);
            let text_dim = c.transformer.text_dim;
            bench.run(
                &c.transformer,
                512,
                modes,
                Some(&c),
                |device, _| {
                    Ok((
                        bf16(TorchGenerator::new(1).randn(&shape)?, device)?,
                        Tensor::new(&[999f32], device)?,
                        bf16(TorchGenerator::new(2).randn(&[1, 512, text_dim])?, device)?,
                    ))
                },
                |held: &Held<'_, WanTransformer3DModel>, (latents, t, text)| {
                    Ok(dit_forward(held, latents, t, text, None, None, None, false)?)
                },
            )
        }
        "LTXPipeline" => {
            let c = LtxConfigs::from_configs(Configs::Fetch(&bench.source))?;
            let grid = c.token_grid(c.grid(frames, height, width));
            let packed = c.packed_shape(c.grid(frames, height, width));
            let text_len = 128;
            let rope_scale = LtxTransformerConfig::rope_interpolation_scale(
                c.vae.temporal_compression_ratio(),
                c.vae.spatial_compression_ratio(),
                25.0,
            );
            let caption = c.transformer.caption_channels;
            bench.run(
                &c.transformer,
                text_len,
                modes,
                None,
                |device, _| {
                    Ok((
                        bf16(TorchGenerator::new(1).randn(&packed)?, device)?,
                        bf16(
                            TorchGenerator::new(2).randn(&[1, text_len, caption])?,
                            device,
                        )?,
                        Tensor::new(&[1000f32], device)?,
                        prompt_mask(text_len, DType::BF16, device)?,
                    ))
                },
                |held: &Held<'_, LtxTransformer3DModel>, (latents, text, t, mask)| {
                    let inputs = held.model()?.prepare(latents, text, t, Some(mask), grid, rope_scale)?;
                    Ok(held.forward(inputs)?)
                },
            )
        }
        "CogVideoXPipeline" => {
            let c = CogVideoXConfigs::from_configs(Configs::Fetch(&bench.source))?;
            let shape = c.latent_shape(frames, height, width);
            let text_len = c.transformer.max_text_seq_length;
            let text_dim = c.transformer.text_embed_dim;
            bench.run(
                &c.transformer,
                text_len,
                modes,
                None,
                |device, _| {
                    let t = Tensor::new(&[999i64], device)?;
                    latents_timestep_text(&shape, t, [text_len, text_dim], device)
                },
                |held: &Held<'_, CogVideoXTransformer3DModel>, (latents, t, text)| {
                    let inputs = held.model()?.prepare(latents, t, text)?;
                    Ok(held.forward(inputs)?)
                },
            )
        }
        "HunyuanVideoPipeline" => {
            let c = HunyuanConfigs::from_configs(Configs::Fetch(&bench.source))?;
            let shape = c.latent_shape(frames, height, width);
            let text_len = 256;
            let t = &c.transformer;
            let (text_dim, pooled_dim) = (t.text_embed_dim, t.pooled_projection_dim);
            // The blocks leave their modulations out (the pipeline computes every step's in one
            // pass before denoising); the weights written for the benchmark hold them too, and
            // the inputs carry the step's modulations, computed once from them, resident.
            let whole = HunyuanVideoTransformerConfig {
                modulations_apart: false,
                ..t.clone()
            };
            let weights = bench.weights::<HunyuanVideoTransformer3DModel>(
                "transformer",
                &whole,
                DType::BF16,
            )?;
            bench.run(
                &c.transformer,
                text_len,
                modes,
                None,
                |device, modulations| {
                    let text = TextConds {
                        embeds: bf16(
                            TorchGenerator::new(2).randn(&[1, text_len, text_dim])?,
                            device,
                        )?,
                        mask: prompt_mask(text_len, DType::BF16, device)?,
                        pooled: bf16(TorchGenerator::new(3).randn(&[1, pooled_dim])?, device)?,
                    };
                    let timestep = Tensor::new(&[1000f32], device)?;
                    let guidance = guidance_input(6.0, 1, DType::BF16, device)?;
                    let model =
                        HunyuanModulations::new(t, weights.var_builder(DType::BF16, device))?;
                    let (temb, refiner_temb) = model.conditioning(
                        &timestep,
                        &text.embeds,
                        &text.mask,
                        &text.pooled,
                        Some(&guidance),
                    )?;
                    let mut table = model
                        .blocks()
                        .iter()
                        .map(|b| b.modulation(&temb, &refiner_temb))
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    table.push(model.output(&temb)?);
                    // Resident, the modulation component stays on the device as in a run;
                    // streamed or parked, it holds nothing there once its stage is done.
                    let kept = matches!(modulations, Some(Residency::Resident)).then_some(model);
                    Ok((
                        bf16(TorchGenerator::new(1).randn(&shape)?, device)?,
                        timestep,
                        text,
                        guidance,
                        Arc::new(table),
                        kept,
                    ))
                },
                |held: &Held<'_, HunyuanVideoTransformer3DModel>,
                 (latents, t, text, guidance, modulations, _)| {
                    let (embeds, mask, pooled) = (&text.embeds, &text.mask, &text.pooled);
                    let mut inputs =
                        held.model()?
                            .prepare(latents, t, embeds, mask, pooled, Some(guidance))?;
                    inputs.modulations = Some(modulations.clone());
                    Ok(held.forward(inputs)?)
                },
            )
        }
        "MochiPipeline" => {
            let c = MochiConfigs::from_configs(Configs::Fetch(&bench.source))?;
            let shape = c.latent_shape(frames, height, width);
            let text_len = vidgen::models::mochi::defaults::MAX_SEQUENCE_LENGTH as usize;
            let text_dim = c.transformer.text_embed_dim;
            bench.run(
                &c.transformer,
                text_len,
                modes,
                None,
                |device, _| {
                    // `t.expand(B).to(latents.dtype)`: a step's timestep in bf16.
                    let t = bf16(Tensor::new(&[1000f32], device)?, device)?;
                    let (latents, t, text) =
                        latents_timestep_text(&shape, t, [text_len, text_dim], device)?;
                    Ok((latents, t, text, prompt_mask(text_len, DType::U32, device)?))
                },
                |held: &Held<'_, MochiTransformer3DModel>, (latents, t, text, mask)| {
                    let inputs = held.model()?.prepare(latents, t, text, mask)?;
                    Ok(held.forward(inputs)?)
                },
            )
        }
        "AllegroPipeline" => {
            let c = AllegroConfigs::from_configs(Configs::Fetch(&bench.source))?;
            let shape = c.latent_shape(frames, height, width);
            let text_len = vidgen::models::allegro::defaults::MAX_SEQUENCE_LENGTH as usize;
            let text_dim = c.transformer.caption_channels;
            bench.run(
                &c.transformer,
                text_len,
                modes,
                None,
                |device, _| {
                    let t = Tensor::new(&[999f32], device)?;
                    let (latents, t, text) =
                        latents_timestep_text(&shape, t, [text_len, text_dim], device)?;
                    Ok((latents, t, text, prompt_mask(text_len, DType::U32, device)?))
                },
                |held: &Held<'_, AllegroTransformer3DModel>, (latents, t, text, mask)| {
                    let inputs = held.model()?.prepare(latents, t, text, mask)?;
                    Ok(held.forward(inputs)?)
                },
            )
        }
        "LattePipeline" => {
            let c = LatteConfigs::from_configs(Configs::Fetch(&bench.source))?;
            let shape = c.latent_shape(frames, height, width);
            // `mask_feature` cuts the embeddings to the prompt's tokens; no mask goes in.
            let text_len = PROMPT_TOKENS;
            let text_dim = c.transformer.caption_channels.context("no caption_channels")?;
            bench.run(
                &c.transformer,
                text_len,
                modes,
                None,
                |device, _| {
                    let t = Tensor::new(&[999i64], device)?;
                    latents_timestep_text(&shape, t, [text_len, text_dim], device)
                },
                |held: &Held<'_, LatteTransformer3DModel>, (latents, t, text)| {
                    let inputs = held.model()?.prepare(latents, t, text)?;
                    Ok(held.forward(inputs)?)
                },
            )
        }
        "FluxPipeline" => {
            let c = FluxConfigs::from_configs(Configs::Fetch(&bench.source))?;
            let packed = c.packed_shape(height, width);
            let (h, w) = c.latent_size(height, width);
            // FluxPipeline's max_sequence_length (T5 tokens).
            let text_len = 512;
            let t = &c.transformer;
            let (text_dim, pooled_dim) = (t.joint_attention_dim, t.pooled_projection_dim);
            bench.run(
                t,
                text_len,
                modes,
                None,
                |device, _| {
                    Ok((
                        bf16(TorchGenerator::new(1).randn(&packed)?, device)?,
                        timestep_input(1000.0, DType::BF16, device)?,
                        bf16(
                            TorchGenerator::new(2).randn(&[1, text_len, text_dim])?,
                            device,
                        )?,
                        bf16(TorchGenerator::new(3).randn(&[1, pooled_dim])?, device)?,
                        // FluxPipeline's guidance 3.5, where the transformer embeds it.
                        t.guidance_embeds
                            .then(|| Tensor::new(&[3.5f32], device))
                            .transpose()?,
                        Tensor::zeros((text_len, 3), DType::F32, device)?,
                        image_ids(h / 2, w / 2, device)?,
                    ))
                },
                |held: &Held<'_, FluxTransformer2DModel>,
                 (latents, t, text, pooled, guidance, text_ids, image_ids)| {
                    let inputs = held.model()?.prepare(
                        latents,
                        t,
                        text,
                        pooled,
                        guidance.as_ref(),
                        text_ids,
                        image_ids,
                    )?;
                    Ok(held.forward(inputs)?)
                },
            )
        }
        other => bail!("{other:?}: the benchmark runs Wan, LTX-Video, CogVideoX, HunyuanVideo, Mochi-1, Allegro, Latte-1 and FLUX.1"),
    }
}

/// Seeded latents of `shape`, the `timestep` given and text embeddings `[1, L, D]` (`text`),
/// bf16 on `device`: the inputs of the DiTs fed latents, a timestep and a prompt.
fn latents_timestep_text(
    shape: &[usize],
    timestep: Tensor,
    [text_len, text_dim]: [usize; 2],
    device: &Device,
) -> Result<(Tensor, Tensor, Tensor)> {
    let bf16 = |t: Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::BF16)?.to_device(device)?) };
    Ok((
        bf16(TorchGenerator::new(1).randn(shape)?)?,
        timestep,
        bf16(TorchGenerator::new(2).randn(&[1, text_len, text_dim])?)?,
    ))
}

/// A `[1, len]` mask with the first [`PROMPT_TOKENS`] tokens valid.
fn prompt_mask(len: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let valid: Vec<f32> = (0..len)
        .map(|i| f32::from(u8::from(i < PROMPT_TOKENS)))
        .collect();
    Ok(Tensor::from_vec(valid, (1, len), device)?.to_dtype(dtype)?)
}

impl Bench {
    /// Runs every mode on DiT `M` (and, given Wan's configs, the Wan VAE for labels starting
    /// with "vae"), printing one JSON line per mode.
    #[allow(clippy::too_many_arguments)]
    fn run<M: Blockwise, I>(
        &self,
        cfg: &M::Config,
        text_len: usize,
        modes: &[String],
        wan: Option<&WanConfigs>,
        inputs: impl Fn(&Device, Option<Residency>) -> Result<I>,
        forward: impl Fn(&Held<'_, M>, &I) -> Result<Tensor>,
    ) -> Result<()> {
        let family = family(Configs::Fetch(&self.source))?;
        let [num_frames, height, width] = self.size;
        let run = RunShape {
            dtype: DType::BF16,
            num_frames,
            height,
            width,
            text_len,
            vae_tiling: false,
            vae_tile_size: None,
            low_activation: false,
            image: false,
            decode: true,
            cache: None,
            fp8_matmul: false,
            sage_attention: false,
            // One CFG branch a forward, as the inputs are made.
            guided: false,
        };
        let spec = family.spec(&run);
        let mut first_output: Option<Vec<f32>> = None;
        for mode in modes {
            let (label, flags) = mode.split_once(':').context("a mode is 'label: flags'")?;
            let mut argv = vec!["bench".to_string()];
            argv.extend(flags.split_whitespace().map(String::from));
            let options = Flags::try_parse_from(argv)?.options;
            // The rules of a discrete GPU (what the modes measure), as `vidgen generate`
            // applies them (e.g. a copy stream moves single blocks).
            let mut memory = vidgen::cli::resolve::memory_options(&options);
            let discrete = Some(vidgen::memory::MemoryModel::Discrete);
            let device_info = vidgen::memory::probe(options.device, 1, discrete)?;
            for change in vidgen::memory::apply_memory_rules(&mut memory, &device_info) {
                eprintln!("{label}: {change}");
            }
            let placement = Placement::new(&memory, &spec);
            let residency = |name| {
                spec.component(name)
                    .map(|i| placement.residencies[i])
                    .with_context(|| format!("no {name}"))
            };
            let m = match wan.filter(|_| label.starts_with("vae")) {
                Some(wan) => {
                    let weights = self.weights::<AutoencoderKLWan>("vae", &wan.vae, DType::F32)?;
                    let shape = wan.latent_shape(num_frames, height, width);
                    let z = |device: &Device| Ok(Tensor::randn(0f32, 1f32, &shape[..], device)?);
                    self.measure::<AutoencoderKLWan, _>(
                        (&wan.vae, &weights, residency("vae")?, &placement),
                        DType::F32,
                        false,
                        z,
                        |held, z| Ok(held.model()?.decode(z)?),
                    )?
                }
                None => {
                    let weights = self.weights::<M>("transformer", cfg, DType::BF16)?;
                    // Where a DiT's modulations are computed apart, their component's residency:
                    // resident, it stays on the device through the denoising forwards.
                    let modulations = residency("transformer_modulations").ok();
                    let m = self.measure::<M, _>(
                        (cfg, &weights, residency("transformer")?, &placement),
                        DType::BF16,
                        true,
                        |device: &Device| inputs(device, modulations),
                        &forward,
                    )?;
                    let out = m
                        .output
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    let diff = match &first_output {
                        None => 0.0,
                        Some(first) => first
                            .iter()
                            .zip(&out)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0f32, f32::max),
                    };
                    println!("{{\"label\":\"{label}\",\"max_abs_diff_vs_first_mode\":{diff}}}");
                    first_output.get_or_insert(out);
                    m
                }
            };
            m.print(label, flags);
        }
        Ok(())
    }

    /// A component's weights: synthetic ones (written once to `VIDGEN_BENCH_FILES` when set),
    /// or the checkpoint's files.
    fn weights<M: Blockwise>(
        &self,
        folder: &str,
        cfg: &M::Config,
        dtype: DType,
    ) -> Result<WeightSet> {
        match std::env::var_os("VIDGEN_BENCH_FILES") {
            Some(dir) => materialized::<M>(&self.source, folder, cfg, dtype, dir.as_ref()),
            None => WeightSet::open(&component_weights(&self.source, folder)?),
        }
    }

    /// Makes the inputs, places component `M` as `residency` says (the model memory counts both),
    /// then times `forwards` runs of `run` (after one untimed warm-up with `warm_up`; the pool
    /// peaks are reset after it). A
    /// parked component is held for all runs with `warm_up` (its move-in timed as `hold_s`),
    /// else moved in for each run (as the pipeline moves the VAE in for each decode).
    fn measure<M: Blockwise, I>(
        &self,
        (cfg, weights, residency, placement): (&M::Config, &WeightSet, Residency, &Placement),
        dtype: DType,
        warm_up: bool,
        inputs: impl FnOnce(&Device) -> Result<I>,
        run: impl Fn(&Held<'_, M>, &I) -> Result<Tensor>,
    ) -> Result<Measured> {
        let (device, meter) = (&self.device, &self.meter);
        meter.reset();
        let inputs = inputs(device)?;
        let start = Instant::now();
        let holding = Holding::of::<M>(cfg, residency, None, dtype)?;
        let placed =
            Placed::<M>::load(cfg, weights, holding, placement.memory, dtype, device, None)?;
        device.synchronize()?;
        let setup = start.elapsed().as_secs_f64();
        let load = meter.peaks();
        meter.reset();
        let model_memory = meter.peaks().device_used_peak;
        let start = Instant::now();
        let held = warm_up.then(|| placed.hold()).transpose()?;
        device.synchronize()?;
        let hold = start.elapsed().as_secs_f64();
        let step = || match &held {
            Some(held) => run(held, &inputs),
            None => run(&placed.hold()?, &inputs),
        };
        if warm_up {
            step()?;
            device.synchronize()?;
            meter.reset();
        }
        let before = placed.offload_usage().unwrap_or_default();
        let mut times = Vec::with_capacity(self.forwards);
        let mut output = None;
        for _ in 0..self.forwards {
            drop(output.take());
            let t = Instant::now();
            output = Some(step()?);
            device.synchronize()?;
            times.push(t.elapsed().as_secs_f64());
        }
        let mut usage = placed.offload_usage().unwrap_or_default();
        usage.copies = usage.copies.since(&before.copies);
        Ok(Measured {
            setup,
            hold,
            load,
            model_memory,
            times,
            peaks: meter.peaks(),
            usage,
            output: output.context("no run was timed")?,
        })
    }
}

/// One mode's measurements.
struct Measured {
    setup: f64,
    /// Moving a parked component in before the timed runs (0 when resident or streamed).
    hold: f64,
    /// Pool peaks while loading.
    load: MemoryPeaks,
    /// Pool bytes in use once placed.
    model_memory: u64,
    times: Vec<f64>,
    /// Pool peaks over the timed runs.
    peaks: MemoryPeaks,
    /// Copies during the timed runs, and host bytes held.
    usage: Usage,
    /// The last run's output.
    output: Tensor,
}

impl Measured {
    fn print(mut self, label: &str, flags: &str) {
        self.times.sort_by(f64::total_cmp);
        let (copies, pinned, host) = (
            self.usage.copies,
            self.usage.pinned_bytes,
            self.usage.host_bytes,
        );
        const GIB: f64 = (1u64 << 30) as f64;
        println!(
            "{}",
            serde_json::json!({
                "label": label, "flags": flags,
                "s_per_forward": self.times[self.times.len() / 2], "times": self.times,
                "setup_s": self.setup, "hold_s": self.hold, "host_setup_s": self.usage.setup.seconds,
                "fill_task_s": self.usage.setup.fill_task_seconds, "lock_task_s": self.usage.setup.lock_task_seconds,
                "load_peak_gib": self.load.device_used_peak as f64 / GIB,
                "model_memory_gib": self.model_memory as f64 / GIB,
                "peak_alloc_gib": self.peaks.device_used_peak as f64 / GIB,
                "peak_reserved_gib": self.peaks.device_reserved_peak as f64 / GIB,
                "pinned_gib": pinned as f64 / GIB, "host_gib": host as f64 / GIB,
                "copied_gb": copies.bytes as f64 / 1e9, "copy_busy_s": copies.busy_seconds,
                "copy_gb_s": copies.gb_per_second(), "host_rss_peak_gib": self.peaks.host_rss_peak as f64 / GIB,
            })
        );
    }
}

/// The component's synthetic weights written once to `dir` as safetensors, then opened from
/// there (memory mapped, as a downloaded checkpoint would be).
fn materialized<M: Blockwise>(
    source: &ModelSource,
    folder: &str,
    cfg: &M::Config,
    dtype: DType,
    dir: &std::path::Path,
) -> Result<WeightSet> {
    let path = dir.join(format!(
        "{}-{folder}.safetensors",
        source.to_string().replace([':', '/'], "-")
    ));
    if !path.exists() {
        let synthetic = WeightSet::open(&component_weights(source, folder)?)?;
        let layout = record(Some(&synthetic), dtype, Packing::PerTensor, |vb| {
            M::whole(cfg, vb)
        })?;
        let start = Instant::now();
        std::fs::create_dir_all(dir)?;
        let views: Vec<(String, Lazy)> = layout
            .slots
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    Lazy {
                        weights: synthetic.clone(),
                        slot: s.clone(),
                        dims: s.shape.dims().to_vec(),
                    },
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &path)?;
        eprintln!(
            "wrote {} in {:.1}s",
            path.display(),
            start.elapsed().as_secs_f64()
        );
    }
    WeightSet::open(&Weights::Files(vec![path]))
}

/// A tensor whose bytes are made when the writer asks for them.
struct Lazy {
    weights: WeightSet,
    slot: Slot,
    dims: Vec<usize>,
}

impl safetensors::View for Lazy {
    fn dtype(&self) -> safetensors::Dtype {
        self.slot.dtype.into()
    }
    fn shape(&self) -> &[usize] {
        &self.dims
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let mut bytes = vec![0u8; self.slot.bytes()];
        self.weights
            .read_into(
                &self.slot.name,
                &self.slot.shape,
                self.slot.dtype,
                &mut bytes,
            )
            .expect("synthetic weights are always readable");
        bytes.into()
    }
    fn data_len(&self) -> usize {
        self.slot.bytes()
    }
}
