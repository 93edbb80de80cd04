//! The stage runner and the pipelines: the single place where components are loaded, placed on
//! a device and released.

pub mod jobs;
pub mod progress;
pub mod runner;
pub mod wan_t2v;

use crate::cli::{ResolvedConfig, UsageError};
use crate::memory::DeviceKind;
use crate::models::source::ModelSource;
use anyhow::{Context, Result};
use candle_core::Device;
use progress::Progress;
use runner::{BatchOrder, LoadPolicy, Schedule};
use serde_json::json;
use std::process::ExitCode;
use std::sync::Arc;
use wan_t2v::{WanConfigs, WanT2V};

/// When components load, from the resolved options.
pub fn load_policy(config: &ResolvedConfig) -> LoadPolicy {
    if config.lazy_module_load() {
        LoadPolicy::Lazy
    } else if config.h3_sequential_load() {
        LoadPolicy::Sequential
    } else {
        LoadPolicy::Eager
    }
}

/// Stage-major when components are loaded late (each then loads once per batch).
pub fn batch_order(config: &ResolvedConfig) -> BatchOrder {
    match load_policy(config) {
        LoadPolicy::Eager => BatchOrder::Prompt,
        LoadPolicy::Lazy | LoadPolicy::Sequential => BatchOrder::Stage,
    }
}

/// Runs (or, with `--dry-run`, plans) a resolved job.
pub fn run(config: ResolvedConfig) -> Result<ExitCode> {
    for o in &config.overrides {
        eprintln!("{o}");
    }
    let source =
        ModelSource::parse(&config.options.model).map_err(|e| UsageError::new(format!("{e:#}")))?;
    if config.dry_run {
        let plan = plan(&config, &source);
        if config.json {
            println!("{plan}");
        } else {
            println!("{}", serde_json::to_string_pretty(&plan)?);
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut jobs = jobs::jobs(&config).map_err(|e| UsageError::new(format!("{e:#}")))?;
    std::fs::create_dir_all(&config.options.output_path).with_context(|| {
        format!(
            "cannot create the output folder {}; pass a writable --output-path",
            config.options.output_path.display()
        )
    })?;
    let progress = Arc::new(Progress::new(false));
    if source.is_synthetic() {
        progress.note(&format!("note: {source} has random weights: the output is noise, for measuring speed and memory"));
    }
    let device = candle_device(&config)?;
    let policy = load_policy(&config);
    let order = batch_order(&config);
    let mut pipeline = WanT2V::new(config, source, device, progress.clone())?;
    let total = jobs.len();
    let reports = runner::run(&mut pipeline, &mut jobs, policy, order, |i, stage| {
        progress.stage(i, total, stage)
    });
    let mut failed = 0;
    for (job, report) in jobs.iter().zip(&reports) {
        match &report.error {
            None if job.written => println!("{}", job.output.display()),
            None => {}
            Some(e) => {
                failed += 1;
                eprintln!("error: prompt {:?}: {e}", job.prompt);
            }
        }
        let times: Vec<String> = report
            .stage_times
            .iter()
            .map(|(s, d)| format!("{s} {:.2}s", d.as_secs_f64()))
            .collect();
        progress.note(&format!("  {}", times.join(", ")));
    }
    if failed > 0 {
        eprintln!("{failed} of {total} prompts failed");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

fn candle_device(config: &ResolvedConfig) -> Result<Device> {
    Ok(match config.device.kind {
        DeviceKind::Cpu => Device::Cpu,
        DeviceKind::Cuda => Device::new_cuda(config.device.ordinal)?,
        DeviceKind::Metal => Device::new_metal(config.device.ordinal)?,
    })
}

/// The `--dry-run` report: the resolved config, the model's geometry where its configs can be
/// read without downloading, and the planned stages with when each component loads.
fn plan(config: &ResolvedConfig, source: &ModelSource) -> serde_json::Value {
    let mut out = config.to_json();
    let policy = load_policy(config);
    let stages = wan_t2v::stages();
    let schedule = Schedule::plan(stages, wan_t2v::deferrable(), policy);
    out["load_policy"] = json!(policy);
    out["batch_order"] = json!(batch_order(config));
    out["stages"] = stages
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({
                "name": s.name,
                "components": s.uses,
                "load_before": schedule.load_before[i],
                "release_after": schedule.release_after[i],
            })
        })
        .collect();
    out["model"] = match dry_run_configs(source) {
        Some(c) => {
            let o = &config.options;
            let t = &c.transformer;
            json!({
                "source": source.to_string(),
                "configs_read": true,
                "transformer_layers": t.num_layers,
                "transformer_inner_dim": t.inner_dim(),
                "latent_shape": c.latent_shape(o.num_frames, o.height, o.width),
                "vae_scale_factor_spatial": c.vae.scale_factor_spatial(),
                "vae_scale_factor_temporal": c.vae.scale_factor_temporal(),
                "text_encoder_layers": c.text_encoder.num_layers,
            })
        }
        None => json!({ "source": source.to_string(), "configs_read": false }),
    };
    out
}

fn dry_run_configs(source: &ModelSource) -> Option<WanConfigs> {
    let read = |rel: &str| source.cached_json(rel);
    read("model_index.json")?;
    Some(WanConfigs {
        transformer: serde_json::from_value(read("transformer/config.json")?).ok()?,
        vae: serde_json::from_value(read("vae/config.json")?).ok()?,
        text_encoder: serde_json::from_value(read("text_encoder/config.json")?).ok()?,
        scheduler: serde_json::from_value(read("scheduler/scheduler_config.json")?).ok()?,
    })
}
