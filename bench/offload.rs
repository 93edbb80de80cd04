//! Offload benchmark: one synthetic Wan2.1 component per mode, in one process, timed the way
//! diffusers' peer script times (median s/forward after warm-up, pool peaks reset after it).
//!
//! cargo build --release --features cuda --example offload_bench
//! offload_bench MODEL FORWARDS FRAMESxHEIGHTxWIDTH 'label: flags' ...   (a label starting with "vae" decodes instead)
//!
//! With `VIDGEN_BENCH_FILES=DIR`, a synthetic model's weights are first written to DIR as
//! safetensors (bf16, f32 where the model keeps f32) and every mode loads them from that file,
//! as from a downloaded checkpoint sitting in the page cache (DIR on a tmpfs such as /dev/shm).
//!
//! Prints one JSON object per mode: s/forward, setup seconds, model memory (pool bytes in use
//! once placed), inference peaks (used / reserved), pinned and host bytes, bytes copied, copy
//! busy time and throughput.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use std::time::Instant;
use vidgen::cli::args::GenerateOptions;
use vidgen::memory::accounting::MemoryMeter;
use vidgen::models::loader::{component_weights, seeded_normal, WeightSet, Weights};
use vidgen::models::source::ModelSource;
use vidgen::models::wan::transformer::WanTransformer3DModel;
use vidgen::models::wan::vae::AutoencoderKLWan;
use vidgen::offload::group::Slot;
use vidgen::offload::{record, Packing};
use vidgen::pipeline::placement::{Placed, Placement};
use vidgen::pipeline::wan_t2v::{dit_forward, WanConfigs};

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    options: GenerateOptions,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (model, forwards) = (&args[1], args[2].parse::<usize>()?);
    let device = Device::new_cuda(0).or_else(|_| Ok::<_, anyhow::Error>(Device::Cpu))?;
    let source = ModelSource::parse(model)?;
    let configs = WanConfigs::read(&source)?;
    let size: Vec<u32> = args[3]
        .split('x')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .context("size is FRAMESxHEIGHTxWIDTH, e.g. 81x480x832")?;
    let shape = configs.latent_shape(size[0], size[1], size[2]);
    let meter = MemoryMeter::new(&device);
    let mut first_output: Option<Vec<f32>> = None;
    for spec in &args[4..] {
        let (label, flags) = spec.split_once(':').context("a mode is 'label: flags'")?;
        let mut argv = vec!["bench".to_string()];
        argv.extend(flags.split_whitespace().map(String::from));
        let options = Flags::try_parse_from(argv)?.options;
        let placement = Placement::new(&options)?;
        let vae = label.starts_with("vae");
        let folder = if vae { "vae" } else { "transformer" };
        let weights = match std::env::var_os("VIDGEN_BENCH_FILES") {
            Some(dir) => materialized(&source, folder, &configs, dir.as_ref())?,
            None => WeightSet::open(&component_weights(&source, folder)?)?,
        };
        meter.reset();
        let start = Instant::now();
        let (mut times, peaks_load, stats);
        let model_memory;
        if vae {
            let placed = Placed::<AutoencoderKLWan>::load(
                &configs.vae,
                &weights,
                placement.vae,
                placement.memory,
                DType::F32,
                &device,
            )?;
            device.synchronize()?;
            let setup = start.elapsed().as_secs_f64();
            peaks_load = meter.peaks();
            meter.reset();
            model_memory = meter.peaks().device_used_peak;
            let z = Tensor::randn(0f32, 1f32, &shape[..], &device)?;
            times = Vec::new();
            for _ in 0..forwards {
                let t = Instant::now();
                let held = placed.hold()?;
                let video = held.model().decode(&z)?;
                device.synchronize()?;
                drop((video, held));
                times.push(t.elapsed().as_secs_f64());
            }
            stats = (
                setup,
                placed.offloaded().map(|o| (o.stats(), o.host_bytes())),
            );
        } else {
            let placed = Placed::<WanTransformer3DModel>::load(
                &configs.transformer,
                &weights,
                placement.dit,
                placement.memory,
                DType::BF16,
                &device,
            )?;
            device.synchronize()?;
            let setup = start.elapsed().as_secs_f64();
            peaks_load = meter.peaks();
            meter.reset();
            model_memory = meter.peaks().device_used_peak;
            let latents = seeded_normal(1, &shape)?
                .to_dtype(DType::BF16)?
                .to_device(&device)?;
            let text = seeded_normal(2, &[1, 512, configs.transformer.text_dim])?
                .to_dtype(DType::BF16)?
                .to_device(&device)?;
            let timestep = Tensor::new(&[999f32], &device)?;
            let held = placed.hold()?;
            dit_forward(&held, &latents, &timestep, &text)?; // warm-up
            device.synchronize()?;
            meter.reset();
            let before = placed.offloaded().map(|o| o.stats().0);
            times = Vec::new();
            let mut out = None;
            for _ in 0..forwards {
                let t = Instant::now();
                out = Some(dit_forward(&held, &latents, &timestep, &text)?);
                device.synchronize()?;
                times.push(t.elapsed().as_secs_f64());
            }
            let out = out
                .context("no forward ran")?
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
            stats = (
                setup,
                placed.offloaded().map(|o| {
                    let (after, pinned) = o.stats();
                    (
                        (after.since(&before.unwrap_or_default()), pinned),
                        o.host_bytes(),
                    )
                }),
            );
            drop(held);
        }
        let peaks = meter.peaks();
        times.sort_by(f64::total_cmp);
        let ((copies, pinned), host) = stats.1.unwrap_or_default();
        const GIB: f64 = (1u64 << 30) as f64;
        println!(
            "{}",
            serde_json::json!({
                "label": label, "flags": flags,
                "s_per_forward": times[times.len() / 2], "times": times,
                "setup_s": stats.0,
                "load_peak_gib": peaks_load.device_used_peak as f64 / GIB,
                "model_memory_gib": model_memory as f64 / GIB,
                "peak_alloc_gib": peaks.device_used_peak as f64 / GIB,
                "peak_reserved_gib": peaks.device_reserved_peak as f64 / GIB,
                "pinned_gib": pinned as f64 / GIB, "host_gib": host as f64 / GIB,
                "copied_gb": copies.bytes as f64 / 1e9, "copy_busy_s": copies.busy_seconds,
                "copy_gb_s": copies.gb_per_second(), "host_rss_peak_gib": peaks.host_rss_peak as f64 / GIB,
            })
        );
    }
    Ok(())
}

/// The component's synthetic weights written once to `dir` as safetensors, then opened from
/// there (memory mapped, as a downloaded checkpoint would be).
fn materialized(
    source: &ModelSource,
    folder: &str,
    configs: &WanConfigs,
    dir: &std::path::Path,
) -> Result<WeightSet> {
    let path = dir.join(format!(
        "{}-{folder}.safetensors",
        source.to_string().replace([':', '/'], "-")
    ));
    if !path.exists() {
        let synthetic = WeightSet::open(&component_weights(source, folder)?)?;
        let layout = if folder == "vae" {
            record(&synthetic, DType::F32, Packing::PerTensor, |vb| {
                AutoencoderKLWan::new(&configs.vae, vb)
            })?
        } else {
            record(&synthetic, DType::BF16, Packing::PerTensor, |vb| {
                WanTransformer3DModel::new(&configs.transformer, vb)
            })?
        };
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
