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
use vidgen::memory::accounting::{MemoryMeter, MemoryPeaks};
use vidgen::models::source::component_weights;
use vidgen::models::source::ModelSource;
use vidgen::models::wan::transformer::WanTransformer3DModel;
use vidgen::models::wan::vae::AutoencoderKLWan;
use vidgen::offload::group::Slot;
use vidgen::offload::Residency;
use vidgen::offload::{record, Packing, Usage};
use vidgen::pipeline::placement::{Blockwise, Held, Placed, Placement};
use vidgen::pipeline::registry::{Family, RunShape};
use vidgen::pipeline::wan_t2v::{dit_forward, WanConfigs};
use vidgen::weights::{seeded_normal, WeightSet, Weights};

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
        let run = RunShape {
            dtype: DType::BF16,
            num_frames: size[0],
            height: size[1],
            width: size[2],
            text_len: 512,
            vae_tiling: false,
            image: false,
        };
        let spec = configs.spec(&run);
        let placement = Placement::new(&vidgen::cli::resolve::memory_options(&options), &spec);
        let residency = |name| spec.component(name).map(|i| placement.residencies[i]);
        let vae = label.starts_with("vae");
        let folder = if vae { "vae" } else { "transformer" };
        let weights = match std::env::var_os("VIDGEN_BENCH_FILES") {
            Some(dir) => materialized(&source, folder, &configs, dir.as_ref())?,
            None => WeightSet::open(&component_weights(&source, folder)?)?,
        };
        let m = if vae {
            let z = |device: &Device| Ok(Tensor::randn(0f32, 1f32, &shape[..], device)?);
            measure::<AutoencoderKLWan, _>(
                (
                    &configs.vae,
                    &weights,
                    residency("vae").context("no vae")?,
                    &placement,
                ),
                DType::F32,
                (&device, &meter, forwards),
                false,
                z,
                |held, z| Ok(held.model().decode(z)?),
            )?
        } else {
            let text_dim = configs.transformer.text_dim;
            let inputs = |device: &Device| {
                let bf16 = |t: Tensor| t.to_dtype(DType::BF16)?.to_device(device);
                Ok((
                    bf16(seeded_normal(1, &shape)?)?,
                    Tensor::new(&[999f32], device)?,
                    bf16(seeded_normal(2, &[1, 512, text_dim])?)?,
                ))
            };
            let m = measure::<WanTransformer3DModel, _>(
                (
                    &configs.transformer,
                    &weights,
                    residency("transformer").context("no transformer")?,
                    &placement,
                ),
                DType::BF16,
                (&device, &meter, forwards),
                true,
                inputs,
                |held, (latents, timestep, text)| {
                    Ok(dit_forward(held, latents, timestep, text, None, None)?)
                },
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
        };
        let mut times = m.times;
        times.sort_by(f64::total_cmp);
        let (copies, pinned, host) = (m.usage.copies, m.usage.pinned_bytes, m.usage.host_bytes);
        const GIB: f64 = (1u64 << 30) as f64;
        println!(
            "{}",
            serde_json::json!({
                "label": label, "flags": flags,
                "s_per_forward": times[times.len() / 2], "times": times,
                "setup_s": m.setup, "host_setup_s": m.usage.setup.seconds,
                "fill_task_s": m.usage.setup.fill_task_seconds, "lock_task_s": m.usage.setup.lock_task_seconds,
                "load_peak_gib": m.load.device_used_peak as f64 / GIB,
                "model_memory_gib": m.model_memory as f64 / GIB,
                "peak_alloc_gib": m.peaks.device_used_peak as f64 / GIB,
                "peak_reserved_gib": m.peaks.device_reserved_peak as f64 / GIB,
                "pinned_gib": pinned as f64 / GIB, "host_gib": host as f64 / GIB,
                "copied_gb": copies.bytes as f64 / 1e9, "copy_busy_s": copies.busy_seconds,
                "copy_gb_s": copies.gb_per_second(), "host_rss_peak_gib": m.peaks.host_rss_peak as f64 / GIB,
            })
        );
    }
    Ok(())
}

/// One mode's measurements.
struct Measured {
    setup: f64,
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

/// Places component `M` as `residency` says, makes its inputs, then times `forwards` runs of
/// `run` (after one untimed warm-up with `warm_up`; the pool peaks are reset after it). A
/// parked component is held for all runs with `warm_up`, else moved in for each run (as the
/// pipeline moves the VAE in for each decode).
fn measure<M: Blockwise, I>(
    (cfg, weights, residency, placement): (&M::Config, &WeightSet, Residency, &Placement),
    dtype: DType,
    (device, meter, forwards): (&Device, &MemoryMeter, usize),
    warm_up: bool,
    inputs: impl FnOnce(&Device) -> Result<I>,
    run: impl Fn(&Held<'_, M>, &I) -> Result<Tensor>,
) -> Result<Measured> {
    meter.reset();
    let start = Instant::now();
    let placed = Placed::<M>::load(cfg, weights, residency, placement.memory, dtype, device)?;
    device.synchronize()?;
    let setup = start.elapsed().as_secs_f64();
    let load = meter.peaks();
    meter.reset();
    let model_memory = meter.peaks().device_used_peak;
    let inputs = inputs(device)?;
    let held = warm_up.then(|| placed.hold()).transpose()?;
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
    let mut times = Vec::with_capacity(forwards);
    let mut output = None;
    for _ in 0..forwards {
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
        load,
        model_memory,
        times,
        peaks: meter.peaks(),
        usage,
        output: output.context("no run was timed")?,
    })
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
            record(Some(&synthetic), DType::F32, Packing::PerTensor, |vb| {
                AutoencoderKLWan::new(&configs.vae, vb)
            })?
        } else {
            record(Some(&synthetic), DType::BF16, Packing::PerTensor, |vb| {
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
