//! What every family's stage bodies do alike: place a component and say where its weights went,
//! time a forward, write the video with its metadata, record a denoise's offload traffic, and
//! turn a device out-of-memory error into advice.

use super::jobs::Job;
use super::placement::{Blockwise, Placed, Placement};
use super::plan::Planner;
use super::progress::{describe_peaks, Progress};
use super::registry::Family;
use crate::cli::ResolvedConfig;
use crate::memory::accounting::MemoryMeter;
use crate::memory::plan::gib;
use crate::offload::Usage;
use crate::weights::WeightSet;
use anyhow::{Context, Result};
use candle_core::{DType, Device};

/// Builds component `component` (named `name`) as `placement` says and reports where its
/// weights went.
#[allow(clippy::too_many_arguments)]
pub(crate) fn place<M: Blockwise>(
    placement: &Placement,
    component: usize,
    name: &str,
    cfg: &M::Config,
    weights: &WeightSet,
    dtype: DType,
    device: &Device,
    progress: &Progress,
) -> Result<Placed<M>> {
    let residency = placement.residencies[component];
    let placed = Placed::load(cfg, weights, residency, placement.memory, dtype, device)?;
    const GIB: f64 = (1u64 << 30) as f64;
    progress.note(&match placed.offload_usage() {
        Some(u) => format!(
            "{name}: {residency}; {:.2} GiB in host memory, {:.2} GiB pinned",
            u.host_bytes as f64 / GIB,
            u.pinned_bytes as f64 / GIB
        ),
        None => format!("{name}: {residency}"),
    });
    Ok(placed)
}

/// Runs `f` and records its wall time, waiting for `device` so the time is the work's.
pub(crate) fn timed<T>(
    device: &Device,
    seconds: &mut Vec<f64>,
    f: impl FnOnce() -> candle_core::Result<T>,
) -> Result<T> {
    let start = std::time::Instant::now();
    let out = f()?;
    device.synchronize()?;
    seconds.push(start.elapsed().as_secs_f64());
    Ok(out)
}

/// Records a denoise's forward times and, for an offloaded DiT, what it copied since `before`
/// (the job's `metrics`), with one note each.
pub(crate) fn record_denoise(
    job: &mut Job,
    progress: &Progress,
    forward_seconds: Vec<f64>,
    before: Option<Usage>,
    after: Option<Usage>,
) {
    if let (Some(before), Some(after)) = (before, after) {
        let (copies, pinned) = (after.copies.since(&before.copies), after.pinned_bytes);
        progress.note(&format!(
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
                "device_bytes": after.device_bytes,
            }),
        );
    }
    progress.note(&format!(
        "  transformer forwards: {}",
        forward_seconds
            .iter()
            .map(|s| format!("{s:.3}s"))
            .collect::<Vec<_>>()
            .join(" ")
    ));
    job.metrics
        .insert("forward_seconds".into(), serde_json::json!(forward_seconds));
}

/// Writes the job's decoded frames as the output options say, with the prompt, seed, model
/// and resolved config in the metadata.
pub(crate) fn write_video(config: &ResolvedConfig, job: &mut Job) -> Result<()> {
    let frames = job.frames.take().context("nothing decoded")?;
    let metadata = vec![
        ("title".to_string(), job.prompt.clone()),
        (
            "comment".to_string(),
            format!("vidgen: {} seed {}", config.generation.model, job.seed),
        ),
        ("vidgen_prompt".to_string(), job.prompt.clone()),
        (
            "vidgen_negative_prompt".to_string(),
            job.negative_prompt.clone(),
        ),
        ("vidgen_seed".to_string(), job.seed.to_string()),
        ("vidgen_model".to_string(), config.generation.model.clone()),
        (
            "vidgen_config".to_string(),
            config.output.config_json.clone(),
        ),
    ];
    crate::output::write(
        config.output.kind,
        &job.output,
        &frames,
        config.output.fps,
        &metadata,
    )?;
    job.written = true;
    Ok(())
}

/// Turns a device out-of-memory error into one that names `when` it happened, the memory in
/// use, the peak and the device's size, and the option set the memory plan of `family`
/// predicts to fit; other errors pass through.
pub(crate) fn explain_out_of_memory(
    family: &dyn Family,
    config: &ResolvedConfig,
    meter: &MemoryMeter,
    when: &str,
    e: anyhow::Error,
) -> anyhow::Error {
    let text = format!("{e:#}");
    if !text.contains("OUT_OF_MEMORY") && !text.to_ascii_lowercase().contains("out of memory") {
        return e;
    }
    let peaks = meter.peaks();
    let total = config.device.total_memory;
    let in_use = match (peaks.device_in_use_now, total) {
        (0, _) => String::new(),
        (used, Some(total)) => format!(
            "; {:.2} of {:.2} GiB in use on the device",
            gib(used),
            gib(total)
        ),
        (used, None) => format!("; {:.2} GiB in use on the device", gib(used)),
    };
    let advice = Planner::new(family, config).advice();
    e.context(format!(
        "out of device memory {when} ({}{in_use}); {advice}",
        describe_peaks(&peaks)
    ))
}
