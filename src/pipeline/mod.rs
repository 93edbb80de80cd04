//! The stage runner and the pipelines: the single place where components are loaded, placed on
//! a device and released.

pub mod allegro;
pub mod cogvideox;
mod denoise;
pub mod draws;
pub mod flux;
pub mod frame;
pub mod holding;
pub mod hunyuan_video;
pub mod interrupt;
pub mod jobs;
pub mod latte;
pub mod ltx;
pub mod minimax_h3;
pub mod mochi;
pub mod placement;
pub mod plan;
pub mod progress;
pub mod registry;
pub mod runner;
pub mod spec;
mod stages;
pub mod wan_t2v;

use crate::config::{BatchOrderChoice, ModelDefaults, ResolvedConfig, UsageError};
use crate::memory::accounting::MemoryMeter;
use crate::memory::plan::{self as memory_plan, gib, MemoryPlan, Request, StagePlan};
use crate::memory::{DeviceKind, MemoryModel, MemoryOptions};
use crate::models::sage_attention::AttentionKind;
use crate::models::source::ModelSource;
use anyhow::{bail, Context, Result};
use candle_core::Device;
use holding::Fsdp;
use interrupt::Interrupted;
use jobs::Job;
use placement::Placement;
use plan::Planner;
use progress::Progress;
use registry::{Configs, Family, ImageInput, RunShape};
use runner::{BatchOrder, JobReport, LoadPolicy, LoadedBeside, Pipeline, Schedule};
use serde::Serialize;
use serde_json::json;
use spec::{PipelineSpec, Role};
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// When components load, from the resolved options.
pub fn load_policy(config: &ResolvedConfig) -> LoadPolicy {
    plan::load_policy(config.memory())
}

/// The order a batch walks the stages in: `--batch-order`, where `auto` is stage-major when
/// components are loaded late (each then loads once per group of `runner::MAX_IN_FLIGHT` prompts) and prompt-major otherwise.
pub fn batch_order(config: &ResolvedConfig) -> BatchOrder {
    match config.batch().order {
        BatchOrderChoice::Prompt => BatchOrder::Prompt,
        BatchOrderChoice::Stage => BatchOrder::Stage,
        BatchOrderChoice::Auto => match load_policy(config) {
            LoadPolicy::Eager => BatchOrder::Prompt,
            LoadPolicy::Lazy | LoadPolicy::Sequential => BatchOrder::Stage,
        },
    }
}

/// What became of one prompt of a run.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Status {
    /// Its output is complete.
    Written,
    /// It failed; the others went on.
    Failed,
    /// Its output already existed and `--resume` skipped it.
    Skipped,
    /// Ctrl-C stopped it.
    Interrupted,
    /// The run ended (a model that did not load) before it started.
    NotRun,
    /// Another GPU, or group of GPUs, of the run makes it (`--num-gpus` above `--sp-size`).
    OtherGpu,
}

/// The outcome of one job: its status, why it failed and how long each stage took.
struct Outcome {
    status: Status,
    error: Option<String>,
    stage_times: Vec<(&'static str, Duration)>,
}

impl Outcome {
    fn new(status: Status, error: Option<String>) -> Self {
        Outcome {
            status,
            error,
            stage_times: Vec::new(),
        }
    }

    fn from_report(job: &Job, report: JobReport) -> Self {
        let (status, error) = match (report.error, job.stopped_at) {
            (_, Some(stage)) => (
                Status::Interrupted,
                Some(format!("interrupted by Ctrl-C or SIGTERM at {stage}")),
            ),
            (Some(e), None) => (Status::Failed, Some(e)),
            (None, None) if job.written => (Status::Written, None),
            (None, None) => (Status::Failed, Some("no output was written".into())),
        };
        Outcome {
            status,
            error,
            stage_times: report.stage_times,
        }
    }
}

/// Runs (or, with `--dry-run`, plans) a resolved job.
///
/// Every prompt is checked before any model loads (bad input: exit 2). A failing prompt does
/// not stop the others; the run then ends with a summary of what failed and exit code 1, or 130
/// after Ctrl-C. Paths go to stdout as each file is complete.
pub fn run(config: ResolvedConfig) -> Result<ExitCode> {
    crate::models::conv3d::set_tf32(config.tf32());
    let progress = Arc::new(Progress::new(config.batch().quiet));
    let source = ModelSource::parse(&config.generation().model)
        .map_err(|e| UsageError::new(format!("{e:#}")))?;
    let unsupported = |e: anyhow::Error| -> anyhow::Error {
        match e.downcast::<registry::UnsupportedPipeline>() {
            Ok(unsupported) => UsageError::new(format!("{source}: {unsupported}")).into(),
            Err(e) => e,
        }
    };
    if config.dry_run() {
        // A model no family runs is bad input, in a dry run too.
        if let Err(e) = registry::family(Configs::OnDisk(&source)) {
            if e.is::<registry::UnsupportedPipeline>() {
                return Err(unsupported(e));
            }
        }
        let found = dry_run_family(&source);
        let config = match &found {
            // A host too small is shown in the plan's verdict: a dry run plans for any host.
            Ok((family, _)) => for_family(family.as_ref(), config, &source, false)?,
            // A family not known: Wan's rules.
            Err(_) => config.with_model_defaults(&ModelDefaults::default())?,
        };
        // The prompts are read and checked as a run would (a missing or broken prompt file is
        // bad input here too), so that the plan covers every size they ask for.
        let prompts = match &config.generation().prompts {
            None => Vec::new(),
            Some(_) => {
                jobs::jobs(&config)
                    .map_err(|e| UsageError::new(format!("{e:#}")))?
                    .0
            }
        };
        if let Ok((family, _)) = &found {
            check_jobs(&config, family.as_ref(), &prompts)?;
        }
        // What the device changed, once the sizes are known to be good (an error is one line).
        progress.overrides(config.overrides());
        let plan = DryRun::new(&config, &source, found, &prompts);
        if config.json() {
            println!("{}", plan.json());
        } else {
            print!("{}", plan.text());
        }
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(why) = cannot_run(&config) {
        return Err(UsageError::new(why).into());
    }
    // Only a model no family runs stops here: a model that fails to read (a missing file, a
    // download error) fails the run after the jobs are known, so `--stats-json` records them.
    let family = match registry::family(Configs::Fetch(&source)) {
        Err(e) if e.is::<registry::UnsupportedPipeline>() => return Err(unsupported(e)),
        found => found,
    };
    let config = match &family {
        Ok(family) => for_family(family.as_ref(), config, &source, true)?,
        Err(_) => config.with_model_defaults(&ModelDefaults::default())?,
    };
    match parallel_part(config, &family, &progress)? {
        Ok(joined) => run_joined(joined, family, source, &progress),
        Err(code) => Ok(code),
    }
}

/// The run's config for `family`: its defaults for what was not given, then (bad input where
/// the family refuses a setting or a weight file does not fit) checked and fitted to the device
/// memory, then the host memory, free when the run starts (see [`fit_to_device`] and
/// [`fit_to_host`]), before anything loads; a host too small is bad input where `stop_on_host`.
fn for_family(
    family: &dyn Family,
    config: ResolvedConfig,
    source: &ModelSource,
    stop_on_host: bool,
) -> Result<ResolvedConfig> {
    let config = config.with_model_defaults(&family.defaults())?;
    if let Some(why) = registry::refusal(family, &config) {
        return Err(UsageError::new(why).into());
    }
    let spec = family.spec(&RunShape::of(&config));
    check_shards(&spec, source)?;
    check_weight_files(&spec, &config, source)?;
    check_cache_modules(&family.about(), &config, source)?;
    let config =
        text_encoders_on_device_where_free(family, dit_on_device_where_free(family, config));
    fit_to_host(family, fit_to_device(family, config)?, stop_on_host)
}

/// `config` with the memory options `place` picks for the device memory free when the run
/// starts, recorded as overrides with the reason it gives; as it is where the probe does not
/// know what is free or `place` picks nothing.
fn placed_where_free(
    family: &dyn Family,
    config: ResolvedConfig,
    place: impl FnOnce(&Planner, u64) -> Option<(MemoryOptions, String)>,
) -> ResolvedConfig {
    let Some(free) = config.device().free_memory else {
        return config;
    };
    let planner = Planner::new(family, &config);
    let Some((options, reason)) = place(&planner, free) else {
        return config;
    };
    drop(planner);
    config.with_memory_options(options, &reason)
}

/// The configuration with its DiT held on the device, where only the defaults offload it and
/// the memory plan predicts it fits the device memory free when the run starts with room to
/// spare (see [`memory_plan::dit_on_device`]: a streamed DiT copies its weights every forward,
/// and LoRAs' merged copies in page-locked host memory cost seconds); where it does not, with
/// as many of its streamed blocks kept there as fit (see [`memory_plan::dit_kept_on_device`]);
/// the change recorded as overrides with why; else as asked.
fn dit_on_device_where_free(family: &dyn Family, config: ResolvedConfig) -> ResolvedConfig {
    let merged = if config.generation().loras.iter().any(|l| !l.is_empty()) {
        "; the LoRAs are merged as it lands, not into copies in page-locked host memory"
    } else {
        ""
    };
    placed_where_free(family, config, |planner, free| {
        if let Some((resident, plan)) = planner.dit_on_device(free) {
            let reason = format!(
                "the memory plan predicts a peak of {} with the DiT on the device ({:.2} GiB free): held there, not streamed from host memory every step{merged}",
                plan.describe_peak(),
                gib(free)
            );
            return Some((resident.options, reason));
        }
        let (kept, plan) = planner.dit_kept_on_device(free)?;
        let reason = format!(
            "the memory plan predicts a peak of {} with up to {:.2} GiB of the streamed DiT's blocks kept on the device ({:.2} GiB free; the whole DiT does not fit): those are copied once per stage, the rest every step",
            plan.describe_peak(),
            gib(kept.options.dit_resident_memory),
            gib(free)
        );
        Some((kept.options, reason))
    })
}

/// The configuration with its text encoders loaded whole on the device for their stage, where
/// only the defaults stream them and the memory plan predicts it fits the device memory free
/// when the run starts with room to spare (see [`memory_plan::text_encoders_on_device`]), the
/// change recorded as an override with why; else as it is.
fn text_encoders_on_device_where_free(
    family: &dyn Family,
    config: ResolvedConfig,
) -> ResolvedConfig {
    placed_where_free(family, config, |planner, free| {
        let (whole, plan) = planner.text_encoders_on_device(free)?;
        let reason = format!(
            "the memory plan predicts a peak of {} with the text encoders loaded whole ({:.2} GiB free): not streamed from host memory for each prompt",
            plan.describe_peak(),
            gib(free)
        );
        Some((whole.options, reason))
    })
}

/// The configuration fitted to the device memory free when the run starts (where the probe knows
/// it): as asked when the memory plan predicts the options fit; else with the first leaner option
/// set predicted to fit that keeps every memory option the user set (the changes recorded as
/// overrides, printed and in `--stats-json`); else bad input, before anything loads, with the
/// advice for what is free.
fn fit_to_device(family: &dyn Family, config: ResolvedConfig) -> Result<ResolvedConfig> {
    let Some(free) = config.device().free_memory else {
        return Ok(config);
    };
    let planner = Planner::new(family, &config);
    let Some(asked) = planner.asked() else {
        return Ok(config);
    };
    let budget = |total: Option<u64>| match total {
        Some(total) => format!("{:.2} of the device's {:.2} GiB", gib(free), gib(total)),
        None => format!("{:.2} GiB", gib(free)),
    };
    let free_text = budget(config.device().total_memory);
    match planner.fit(free) {
        memory_plan::Fit::AsAsked => Ok(config),
        memory_plan::Fit::Leaner(candidate) => {
            drop(planner);
            let budget = format!("{free_text} free");
            let peak = ("peak", MemoryPlan::describe_peak);
            Ok(with_leaner(config, &candidate, &budget, peak, &asked))
        }
        memory_plan::Fit::Nothing => {
            let keeping = keeping(&planner.kept());
            let v = config.video();
            let size = format!("{}x{}x{}", v.num_frames, v.height, v.width);
            let advice = memory_plan::advice(
                &planner.request(),
                config.device(),
                &|r| planner.plan(r),
                Some(free),
            );
            Err(UsageError::new(format!(
                "{free_text} free: no memory option set is predicted to fit {size} (frames x height x width){keeping}; {advice}"
            ))
            .into())
        }
    }
}

/// The configuration fitted to the host memory available when the run starts (where the probe
/// knows it): as asked when the memory plan's host peak fits; else with the first host option
/// set predicted to fit it and the free device memory (the encoder freed before the rest
/// loads, each component loaded for its stages alone, a bounded pinned ring), keeping every
/// option the user set, the changes recorded as overrides; else, when `stop`, bad input,
/// before anything loads, naming the leanest set (otherwise as asked).
fn fit_to_host(family: &dyn Family, config: ResolvedConfig, stop: bool) -> Result<ResolvedConfig> {
    let Some(host) = config.device().host_available else {
        return Ok(config);
    };
    let planner = Planner::new(family, &config);
    let Some(asked) = planner.asked() else {
        return Ok(config);
    };
    let host_text = format!("{:.2} GiB of host memory available", gib(host));
    match planner.fit_host(host, config.device().free_memory) {
        memory_plan::Fit::AsAsked => Ok(config),
        memory_plan::Fit::Leaner(candidate) => {
            drop(planner);
            let peak = ("host peak", MemoryPlan::describe_host_peak);
            Ok(with_leaner(config, &candidate, &host_text, peak, &asked))
        }
        memory_plan::Fit::Nothing if !stop => Ok(config),
        memory_plan::Fit::Nothing => {
            let keeping = keeping(&planner.kept_host());
            let leanest = match planner.leanest_host() {
                Some(c) => format!(
                    "; the leanest, {}, holds {}",
                    c.flags.join(" "),
                    c.plan.describe_host_peak()
                ),
                None => String::new(),
            };
            let v = config.video();
            Err(UsageError::new(format!(
                "{host_text}: no option set is predicted to hold {}x{}x{} (frames x height x width) in it{keeping}; the options asked hold {}{leanest}; free host memory, or ask for fewer frames or a smaller size",
                v.num_frames,
                v.height,
                v.width,
                asked.describe_host_peak()
            ))
            .into())
        }
    }
}

/// `config` with the leaner memory options of `candidate`, the change recorded as overrides
/// with why: the `budget`, and the `peak` (its name, how a plan describes it) the memory plan
/// predicts for the options asked (`asked`) and for the candidate's, and what the change does to
/// the output beside the memory.
fn with_leaner(
    config: ResolvedConfig,
    candidate: &memory_plan::Candidate,
    budget: &str,
    (peak, describe): (&str, impl Fn(&MemoryPlan) -> String),
    asked: &MemoryPlan,
) -> ResolvedConfig {
    let caveats = memory_plan::caveats(config.memory(), &candidate.request.options);
    let reason = format!(
        "{budget}; the memory plan predicts a {peak} of {} for the options asked, {} with {}{}",
        describe(asked),
        describe(&candidate.plan),
        candidate.flags.join(" "),
        caveats.iter().map(|c| format!("; {c}")).collect::<String>()
    );
    config.with_memory_options(candidate.request.options.clone(), &reason)
}

/// " while keeping A, B" of the memory options the user set that no fit may change (empty
/// where there are none).
fn keeping(kept: &[&str]) -> String {
    match kept.is_empty() {
        true => String::new(),
        false => format!(" while keeping {}", kept.join(", ")),
    }
}

/// Runs this process's share of the jobs as the configuration it joined with says (alone: all of
/// them), `family` read from `source` (or why it could not be), and writes the stats.
pub fn run_joined(
    (config, scratch, share): crate::parallel::launch::Joined,
    family: Result<Box<dyn Family>>,
    source: ModelSource,
    progress: &Arc<Progress>,
) -> Result<ExitCode> {
    let (mut jobs, seed_notice) =
        jobs::jobs(&config).map_err(|e| UsageError::new(format!("{e:#}")))?;
    if let Some(stats) = &config.batch().stats_json {
        for job in &jobs {
            if crate::config::files::same_file(stats, &job.output) {
                return Err(UsageError::new(format!(
                    "--stats-json {} is the output of {}; writing the stats would replace it: pass another path",
                    stats.display(),
                    job.origin
                ))
                .into());
            }
        }
    }
    let line_images = jobs
        .iter()
        .any(|j| j.image.is_some() && j.image != config.generation().image);
    let config = config.with_line_images(line_images);
    if let Ok(family) = &family {
        check_jobs(&config, family.as_ref(), &jobs)?;
    }
    check_output_folder(&config.output().folder)?;
    // What the device changed and the seed drawn, once the prompts are known to be good (an
    // error is one line).
    progress.overrides(config.overrides());
    if let Some(notice) = seed_notice {
        progress.note(&notice);
    }
    if config.batch().resume {
        remove_stale_temporaries(&config, progress);
    }
    interrupt::install(config.batch().quiet);
    let started = Instant::now();
    let mut outcomes: Vec<Outcome> = jobs
        .iter()
        .map(|job| match share {
            Some((mine, of)) if job.index % of != mine => Outcome::new(Status::OtherGpu, None),
            _ => existing_output(&config, job, progress),
        })
        .collect();
    if source.is_synthetic() {
        progress.note(&format!("note: {source} has random weights: the output is noise, for measuring speed and memory"));
    }
    let result = family
        .and_then(|family| generate(&config, family, source, progress, &mut jobs, &mut outcomes));
    let mut code = summarize(&jobs, &outcomes, progress);
    if let Some(path) = &config.batch().stats_json {
        let stats = stats(
            &config,
            &jobs,
            &outcomes,
            started.elapsed(),
            result.as_ref().err(),
        );
        if let Err(e) = write_stats(path, &stats) {
            progress.error(&format!("error: {e:#}"));
            if code == ExitCode::SUCCESS {
                code = ExitCode::from(1);
            }
        }
    }
    if let Some(dir) = scratch {
        let _ = std::fs::remove_dir_all(dir);
    }
    result.map(|()| code)
}

/// Every check of the prompts a run makes before anything loads (a dry run makes them too):
/// their sizes, steps, draws file and images.
fn check_jobs(
    config: &ResolvedConfig,
    family: &dyn Family,
    jobs: &[Job],
) -> Result<(), UsageError> {
    check_sizes(family, jobs)?;
    check_steps(config, jobs)?;
    check_latents(config, family, jobs)?;
    check_images(config, family, jobs)
}

/// Checks before anything loads that every prompt has an image if the model needs one, and
/// none if it takes none.
fn check_images(
    config: &ResolvedConfig,
    family: &dyn Family,
    jobs: &[Job],
) -> Result<(), UsageError> {
    let title = family.spec(&RunShape::of(config)).title;
    for job in jobs {
        match (family.image_input(), &job.image) {
            (ImageInput::Required, None) => {
                return Err(UsageError::new(format!(
                    "{}: {title} needs an image (the first frame): pass --image FILE or give the line an `image`",
                    job.origin
                )))
            }
            (ImageInput::None, Some(_)) => {
                return Err(UsageError::new(format!(
                    "{}: an image does not apply to {title}: it is a text-to-video model (use an image-to-video or TI2V model)",
                    job.origin
                )))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Checks the shard index of every component of `spec` (the run's) that loads from a local
/// model folder ([`crate::models::source::check_shards`]) before anything loads.
fn check_shards(spec: &PipelineSpec, source: &ModelSource) -> Result<(), UsageError> {
    for component in &spec.components {
        crate::models::source::check_shards(source, component.folder)
            .map_err(|e| UsageError::new(format!("{e:#}")))?;
    }
    Ok(())
}

/// Opens every `--transformer` file given and reads every LoRA file, checking each LoRA against
/// the weights of the transformer it is for (where the model has weight files): a file that is
/// not safetensors, a LoRA key of no layout, a missing half, a layer the model does not have or
/// a shape that does not fit is bad input naming the file, before anything loads.
fn check_weight_files(
    spec: &PipelineSpec,
    config: &ResolvedConfig,
    source: &ModelSource,
) -> Result<(), UsageError> {
    let bad = |e: anyhow::Error| UsageError::new(format!("{e:#}"));
    for component in &spec.components {
        let file = frame::transformer_file(config, component.folder).map_err(bad)?;
        let files = match &file {
            Some((given, local)) => {
                if !local.is_file() {
                    return Err(UsageError::new(format!(
                        "--transformer {}: no such file; pass a .safetensors or .gguf file of the transformer's weights",
                        given.display()
                    )));
                }
                Some(crate::weights::Weights::Files(vec![local.clone()]))
            }
            None => crate::models::source::component_weights(source, component.folder)
                .ok()
                .filter(|w| matches!(w, crate::weights::Weights::Files(_))),
        };
        let weights = match (&files, file) {
            (Some(files), Some((file, _))) => {
                let weights = crate::weights::WeightSet::open(files)
                    .map_err(|e| bad(e.context(format!("--transformer {}", file.display()))))?;
                check_single_file(&weights, file, source, component.folder)?;
                Some(weights)
            }
            (Some(files), None) => crate::weights::WeightSet::open(files).ok(),
            (None, _) => None,
        };
        let Some((specs, target)) = frame::lora_specs(config, component) else {
            continue;
        };
        let loras = crate::lora::Scanned::scan(specs, target).map_err(bad)?;
        for notice in loras.notices() {
            eprintln!("{notice}");
        }
        if let Some(weights) = weights {
            loras
                .rooted(|name| weights.stored_shape(name).is_some())
                .check(|name| weights.stored_shape(name))
                .map_err(bad)?;
        }
    }
    Ok(())
}

/// Checks `--cache taylorseer`'s patterns against the transformer's modules, named by the
/// folder's own weights where it has them: a module a pattern matches that the blocks do not
/// hand the cache (diffusers would predict or zero it) is bad input naming it.
fn check_cache_modules(
    about: &registry::About,
    config: &ResolvedConfig,
    source: &ModelSource,
) -> Result<(), UsageError> {
    let (Some(cache), Some(hooked)) = (&config.generation().cache, &about.cache_blocks) else {
        return Ok(());
    };
    let Ok(weights @ crate::weights::Weights::Files(_)) =
        crate::models::source::component_weights(source, "transformer")
    else {
        return Ok(());
    };
    let Ok(weights) = crate::weights::WeightSet::open(&weights) else {
        return Ok(());
    };
    let names = weights.names();
    let modules = crate::models::step_cache::module_paths(names.iter().map(String::as_str));
    match cache.unhooked_module(hooked, modules.iter().map(String::as_str)) {
        Some(module) => Err(UsageError::new(format!(
            "--cache taylorseer: a pattern matches the module {module:?}, which vidgen does not hook in this transformer (it hooks each of {} and their {}, and {}); narrow cache_identifiers / skip_predict_identifiers to those",
            hooked.names.lists.join(" / "),
            match hooked.names.submodules {
                [] => "whole outputs".to_string(),
                _ => hooked.names.submodule_names().collect::<Vec<_>>().join(", "),
            },
            hooked.names.proj_out,
        ))),
        None => Ok(()),
    }
}

/// Checks a `--transformer` file against the model folder's own transformer weights, where the
/// folder has them: every tensor there must be in the file (under the file's layout) with the
/// same shape, else bad input naming the first one missing or misshapen.
fn check_single_file(
    weights: &crate::weights::WeightSet,
    file: &Path,
    source: &ModelSource,
    folder: &str,
) -> Result<(), UsageError> {
    let Ok(crate::weights::Weights::Files(own)) =
        crate::models::source::component_weights(source, folder)
    else {
        return Ok(());
    };
    let Ok(own) = crate::weights::WeightSet::open(&crate::weights::Weights::Files(own)) else {
        return Ok(());
    };
    for name in own.names() {
        let want = own.stored_shape(&name);
        let got = weights.stored_shape(&name);
        if got != want {
            let (layout, key) = weights.stored_key(&name);
            let what = match got {
                None => format!("has no {key}"),
                Some(got) => format!("holds {key} as {got:?}, the model's {name} is {want:?}"),
            };
            return Err(UsageError::new(format!(
                "--transformer {} ({}, {layout} layout) {what}: pass the whole transformer of this model",
                file.display(),
                weights.format()
            )));
        }
    }
    Ok(())
}

/// Checks before anything loads that the model can make every prompt's size.
fn check_sizes(family: &dyn Family, jobs: &[Job]) -> Result<(), UsageError> {
    for job in jobs {
        if let Some(why) = family.size_refusal(job.num_frames, job.height, job.width) {
            return Err(UsageError::new(format!("{}: {why}", job.origin)));
        }
    }
    Ok(())
}

/// Checks before anything loads that every prompt takes as many steps as `--sigmas` gives (a
/// `.jsonl` line may set its own `num_inference_steps`).
fn check_steps(config: &ResolvedConfig, jobs: &[Job]) -> Result<(), UsageError> {
    let Some(sigmas) = &config.generation().sigmas else {
        return Ok(());
    };
    match jobs
        .iter()
        .find(|j| j.num_inference_steps as usize != sigmas.len())
    {
        Some(job) => Err(UsageError::new(format!(
            "{}: num_inference_steps {} but --sigmas gives {} sigmas, one per step; drop its num_inference_steps",
            job.origin,
            job.num_inference_steps,
            sigmas.len()
        ))),
        None => Ok(()),
    }
}

/// Checks `--latents` before anything loads: a regular safetensors file (read up to its header
/// only) whose `latents` tensor, or only tensor, is a float tensor, holding every draw each
/// prompt's size takes ([`Family::draws`]) as a float tensor of its shape.
fn check_latents(
    config: &ResolvedConfig,
    family: &dyn Family,
    jobs: &[Job],
) -> Result<(), UsageError> {
    let Some(path) = &config.generation().latents else {
        return Ok(());
    };
    let at = format!("--latents {}", path.display());
    let tensors = draws::header(path).map_err(|e| {
        UsageError::new(format!(
            "{at}: {e:#}; pass a safetensors file with a `latents` tensor"
        ))
    })?;
    let find = |name: &str| -> Result<&draws::Declared, UsageError> {
        let declared = match tensors.get(name) {
            Some(t) => t,
            // A file of one tensor holds the initial latents whatever its name.
            None if name == "latents" && tensors.len() == 1 => {
                tensors.values().next().unwrap_or_else(|| unreachable!())
            }
            None => {
                let fix = match name {
                    "latents" => "name the initial latents `latents`".to_string(),
                    _ => format!("add the draw `{name}` (the README's --latents of this model says what each draw is)"),
                };
                return Err(UsageError::new(format!(
                    "{at} has no tensor named `{name}` (it holds {}); {fix}",
                    tensors.keys().cloned().collect::<Vec<_>>().join(", ")
                )));
            }
        };
        if !matches!(declared.dtype.as_str(), "F16" | "BF16" | "F32" | "F64") {
            return Err(UsageError::new(format!(
                "{at}: the {name} are {}; store them as F32 (or F16, BF16, F64)",
                declared.dtype
            )));
        }
        Ok(declared)
    };
    find("latents")?;
    for job in jobs {
        for (name, shape) in family.draws(job.num_frames, job.height, job.width) {
            let declared = find(name)?;
            if declared.shape != shape {
                return Err(UsageError::new(format!(
                    "{at} holds {name} of shape {:?}, but {} ({} frames of {}x{}) needs {shape:?}; pass {name} of that shape or change the size",
                    declared.shape, job.origin, job.num_frames, job.height, job.width
                )));
            }
        }
    }
    Ok(())
}

/// Why this build cannot run what `config` asks of several GPUs (`None`: it can).
fn cannot_run(config: &ResolvedConfig) -> Option<String> {
    let fsdp = config.memory().use_fsdp_inference;
    crate::parallel::cannot_run(config.groups(), fsdp, config.batch().resume)
}

/// This process's part in a run on several GPUs: what it runs with, or the exit code of the
/// workers it supervised.
fn parallel_part(
    config: ResolvedConfig,
    family: &Result<Box<dyn Family>>,
    progress: &Progress,
) -> Result<Result<crate::parallel::launch::Joined, ExitCode>> {
    use crate::parallel::launch::{self, Part};
    let world =
        crate::parallel::world::World::from_env().map_err(|e| UsageError::new(e.to_string()))?;
    let part = launch::part(config.groups().ranks, world).map_err(UsageError::new)?;
    if let (Some(sp), Ok(family)) = (Some(config.groups().sp).filter(|&sp| sp > 1), family) {
        if !family.sequence_parallel() {
            return Err(UsageError::new(format!(
                "--sp-size {sp}: only the Wan pipelines split a video across GPUs so far; pass --sp-size 1 (one prompt per GPU) or --num-gpus 1"
            ))
            .into());
        }
    }
    let groups = config.groups();
    match part {
        Part::Alone => Ok(Ok((config, None, None))),
        Part::Supervisor(_) => {
            // A worker checks the prompts and says what it changed once they pass.
            progress.overrides(config.overrides());
            // It runs nothing on a GPU: the probe's context goes before the workers start.
            drop(config);
            launch::supervise_self(groups).map(Err)
        }
        // Prompt parallelism (--sp-size 1) needs no collective.
        Part::Rank(world) if groups.sp == 1 => launch::as_rank(config, &world, None).map(Ok),
        #[cfg(feature = "nccl")]
        Part::Rank(world) => launch::join(config, world).map(Ok),
        #[cfg(not(feature = "nccl"))]
        Part::Rank(_) => Err(UsageError::new(cannot_run(&config).unwrap_or_default()).into()),
    }
}

/// Creates the output folder and checks that files can be made in it, before any model loads.
fn check_output_folder(dir: &Path) -> Result<(), UsageError> {
    let fix = "pass a writable --output-path";
    std::fs::create_dir_all(dir).map_err(|e| {
        UsageError::new(format!(
            "cannot create the output folder {}: {e}; {fix}",
            dir.display()
        ))
    })?;
    let probe = dir.join(format!(".vidgen-write-test-{}", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            // Best effort: an empty hidden file is all that could remain.
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(UsageError::new(format!(
            "the output folder {} is not writable: {e}; {fix}",
            dir.display()
        ))),
    }
}

/// Removes what runs killed before they could clean up left behind (`--resume`): every
/// temporary in the output folder and those of the `--stats-json` file, where the process that
/// wrote it is gone.
fn remove_stale_temporaries(config: &ResolvedConfig, progress: &Progress) {
    let mut removed = crate::output::remove_stale_temporaries(&config.output().folder, |_| true);
    if let Some(stats) = &config.batch().stats_json {
        let dir = stats.parent().filter(|p| !p.as_os_str().is_empty());
        let name = stats.file_name().and_then(|n| n.to_str());
        removed.extend(crate::output::remove_stale_temporaries(
            dir.unwrap_or(Path::new(".")),
            |dest| Some(dest) == name,
        ));
    }
    for path in removed {
        progress.note(&format!(
            "removed {}: a temporary of a run that ended without cleaning up (--resume)",
            path.display()
        ));
    }
}

/// The outcome a job starts with: not run yet, or decided by an output that already exists
/// (skipped with `--resume`, failed unless `--overwrite`).
fn existing_output(config: &ResolvedConfig, job: &Job, progress: &Progress) -> Outcome {
    let o = config.batch();
    if o.overwrite || !jobs::output_exists(&job.output) {
        return Outcome::new(Status::NotRun, None);
    }
    if o.resume {
        progress.note(&format!(
            "skipping {} ({}): it exists (--resume)",
            job.output.display(),
            job.origin
        ));
        return Outcome::new(Status::Skipped, None);
    }
    Outcome::new(
        Status::Failed,
        Some(format!(
            "{} already exists; pass --overwrite to replace it or --resume to skip it",
            job.output.display()
        )),
    )
}

/// Loads the pipeline and runs every job not yet decided, recording each outcome.
fn generate(
    config: &ResolvedConfig,
    family: Box<dyn Family>,
    source: ModelSource,
    progress: &Arc<Progress>,
    jobs: &mut Vec<Job>,
    outcomes: &mut [Outcome],
) -> Result<()> {
    let device = candle_device(config)?;
    #[cfg(feature = "cuda")]
    let _preloading = match &device {
        Device::Cuda(cuda) => Some(crate::models::kernel_module::preload(cuda)),
        _ => None,
    };
    let mut pipeline = frame::Frame::open(
        family.as_ref(),
        config.clone(),
        source,
        device.clone(),
        progress.clone(),
    )?;
    let (mut todo, done): (Vec<Job>, Vec<Job>) = std::mem::take(jobs)
        .into_iter()
        .partition(|j| outcomes[j.index].status == Status::NotRun);
    let positions: Vec<usize> = todo.iter().map(|j| j.index).collect();
    let total = outcomes.len();
    let mut guarded = Guarded {
        inner: pipeline.as_mut(),
        progress,
        config,
        family: family.as_ref(),
        meter: MemoryMeter::new(&device),
        device,
        planner: Planner::new(family.as_ref(), config),
        current: config.clone(),
        loaded: Vec::new(),
        evicted: Vec::new(),
        injected: 0,
        plans_by_size: Default::default(),
    };
    // Jobs whose first stage began before any Ctrl-C; the others never started (`not_run`).
    let mut begun: std::collections::HashSet<usize> = std::collections::HashSet::new();
    let reports = runner::run(
        &mut guarded,
        &mut todo,
        load_policy(config),
        batch_order(config),
        |i, stage| {
            if !interrupt::interrupted() {
                begun.insert(positions[i]);
                progress.stage(positions[i], total, stage);
            }
        },
    );
    for (job, report) in todo.iter_mut().zip(reports) {
        if begun.contains(&job.index) {
            outcomes[job.index] = Outcome::from_report(job, report);
        } else {
            job.stopped_at = None;
        }
    }
    jobs.extend(done);
    jobs.extend(todo);
    jobs.sort_by_key(|j| j.index);
    Ok(())
}

/// A pipeline with what an unattended run adds around each stage: Ctrl-C is honoured at every
/// stage boundary, an output that appeared meanwhile is not overwritten, loads are announced,
/// and each path goes to stdout as soon as its file is complete.
struct Guarded<'a> {
    inner: &'a mut dyn Pipeline<Job = Job>,
    progress: &'a Progress,
    config: &'a ResolvedConfig,
    /// The family the pipeline came from: its memory plan explains an out-of-memory error.
    family: &'a dyn Family,
    /// Device and host memory peaks of each load and stage.
    meter: MemoryMeter,
    device: Device,
    /// The memory plan of each prompt's size: a stage is not begun where the host cannot hold
    /// it.
    planner: Planner<'a>,
    /// The run's configuration with the memory options in force (a leaner set once a stage ran
    /// out of device memory).
    current: ResolvedConfig,
    /// The components the pipeline holds.
    loaded: Vec<usize>,
    /// The components freed after running out of memory that the runner still counts as
    /// loaded: each loads again before a stage that uses it.
    evicted: Vec<usize>,
    /// How many out-of-memory errors `VIDGEN_INJECT_OOM` has injected.
    injected: usize,
    /// The memory plan of each prompt size under the options in force, as planned (`None`:
    /// none could be made).
    plans_by_size: std::collections::HashMap<(u32, u32, u32), Option<MemoryPlan>>,
}

impl Guarded<'_> {
    /// `e` as [`stages::explain_out_of_memory`] words it for this run.
    fn explain(&self, when: &str, e: anyhow::Error) -> anyhow::Error {
        stages::explain_out_of_memory(self.family, self.config, &self.meter, when, e)
    }

    /// Loads `component` (after the out-of-memory error `VIDGEN_INJECT_OOM` asks for) and waits
    /// for its copies.
    fn load_once(&mut self, component: usize) -> Result<()> {
        self.injected_out_of_memory(self.inner.spec().components[component].name)?;
        self.inner.load(component)?;
        Ok(self.device.synchronize()?)
    }

    /// Stage `index` for `job`, after the out-of-memory error `VIDGEN_INJECT_OOM` asks for.
    fn attempt(&mut self, index: usize, job: &mut Job) -> Result<()> {
        self.attempt_beside(index, job, &[]).0
    }

    /// [`Guarded::attempt`] with `ahead` loading beside the stage (none after Ctrl-C; one that
    /// `VIDGEN_INJECT_OOM` names fails as it would), each announced and, where it loaded, held;
    /// what loaded or failed comes back. One that failed is loaded again before its first stage,
    /// where its error is reported.
    fn attempt_beside(
        &mut self,
        index: usize,
        job: &mut Job,
        ahead: &[usize],
    ) -> (Result<()>, Vec<LoadedBeside>) {
        let stage = self.inner.spec().stages[index].name;
        if let Err(e) = self.injected_out_of_memory(stage) {
            return (Err(e), Vec::new());
        }
        let (mut beside, mut landed) = (Vec::with_capacity(ahead.len()), Vec::new());
        for &c in ahead.iter().filter(|_| !interrupt::interrupted()) {
            let name = self.inner.spec().components[c].name;
            match self.injected_out_of_memory(name) {
                Ok(()) => {
                    self.progress
                        .note(&format!("loading {name} beside {stage}"));
                    beside.push(c);
                }
                Err(e) => landed.push((c, Err(e))),
            }
        }
        if !beside.is_empty() {
            // What released components give back is free again before anything more is held.
            crate::teardown::settle();
        }
        let (result, got) = self.inner.run_stage_loading(index, job, &beside);
        landed.extend(got);
        for (c, loaded) in &landed {
            let name = self.inner.spec().components[*c].name;
            self.progress.note(&match loaded {
                Ok(took) => {
                    self.loaded.push(*c);
                    format!("loaded {name} beside {stage}, in {:.2}s", took.as_secs_f64())
                }
                Err(e) => format!(
                    "{name} did not load beside {stage} ({e:#}); it loads again before its first stage"
                ),
            });
        }
        (result, landed)
    }

    /// `VIDGEN_INJECT_OOM=NAME[:N]`: the stage, or the load of the component, called NAME fails
    /// with a device out-of-memory error the first N times (once without N), so the recovery is
    /// tested without a GPU.
    fn injected_out_of_memory(&mut self, name: &str) -> Result<()> {
        let Ok(asked) = std::env::var("VIDGEN_INJECT_OOM") else {
            return Ok(());
        };
        let (target, times) = match asked.split_once(':') {
            Some((target, times)) => (target, times.parse().unwrap_or(1)),
            None => (asked.as_str(), 1),
        };
        if target == name && self.injected < times {
            self.injected += 1;
            bail!("CUDA_ERROR_OUT_OF_MEMORY: out of memory (injected by VIDGEN_INJECT_OOM)");
        }
        Ok(())
    }

    /// Loads again the components stage `index` uses that [`Guarded::make_room`] freed.
    fn reload_evicted(&mut self, index: usize) -> Result<()> {
        for c in self.inner.spec().stages[index].uses.clone() {
            if let Some(at) = self.evicted.iter().position(|&e| e == c) {
                self.evicted.remove(at);
                self.load(c)?;
            }
        }
        Ok(())
    }

    /// After running out of device memory `when` (in a stage, or loading a component): frees
    /// every component and places those loaded from now on by the first leaner option set
    /// predicted to fit the device memory free now (where the device says what is free and the
    /// plan predicts the options in force do not fit it; else the first leaner set), keeping
    /// every option the user set. The flags of that set, or `None` where there is none.
    fn make_room(&mut self, when: &str) -> Option<Vec<String>> {
        for c in std::mem::take(&mut self.loaded) {
            self.inner.release(c);
            self.progress
                .note(&format!("freed {}", self.inner.spec().components[c].name));
            self.evicted.push(c);
        }
        let _ = self.device.synchronize();
        let candidate = {
            let planner = Planner::new(self.family, &self.current);
            match self.meter.device_free().map(|free| planner.fit(free)) {
                Some(memory_plan::Fit::Leaner(c)) => c,
                Some(memory_plan::Fit::Nothing) => return None,
                Some(memory_plan::Fit::AsAsked) | None => planner.leaner()?,
            }
        };
        let options = candidate.request.options;
        if !self.inner.replace_memory_options(&options) {
            return None;
        }
        let reason = format!("out of device memory {when}");
        self.current = self.current.clone().with_memory_options(options, &reason);
        self.plans_by_size.clear();
        self.progress.note(&format!(
            "out of device memory {when}; retrying once with {} (predicted peak {})",
            candidate.flags.join(" "),
            candidate.plan.describe_peak()
        ));
        Some(candidate.flags)
    }

    /// Why `job` cannot begin `stage`: the memory plan of its size predicts more host memory
    /// than this process may hold now (where the run has a host budget). A host allocation that
    /// fails aborts the process, so the prompt fails here, alone, before it allocates.
    fn host_shortfall(&mut self, stage: &str, job: &Job) -> Option<String> {
        self.config.device().host_available?;
        // On unified memory what the device holds is in no resident set, so what the process
        // may hold is not known here; the device's own error and retry cover it.
        if self.config.device().memory_model == MemoryModel::Unified {
            return None;
        }
        let need = self.planned(stage, job)?.host_bytes;
        let sharers = self.config.device().host_sharers;
        // What the components released before this stage give back is counted free.
        let room = crate::teardown::room_for(need, || crate::memory::probe::host_room(sharers))?;
        (need > room).then(|| {
            format!(
                "the memory plan predicts {:.2} GiB of host memory for {}x{}x{} (frames x height x width) here, more than the {:.2} GiB this process may hold now; free host memory, or ask for fewer frames or a smaller size",
                gib(need),
                job.num_frames,
                job.height,
                job.width,
                gib(room)
            )
        })
    }

    /// What the memory plan of `job`'s size predicts for `stage` under the options in force.
    fn planned(&mut self, stage: &str, job: &Job) -> Option<StagePlan> {
        let size = (job.num_frames, job.height, job.width);
        if !self.plans_by_size.contains_key(&size) {
            // After a retry's leaner set, that set's plan.
            let leaner;
            let planner = match self.current.memory() == self.config.memory() {
                true => &self.planner,
                false => {
                    leaner = Planner::new(self.family, &self.current);
                    &leaner
                }
            };
            let plan = planner.plan_size(size.0, size.1, size.2).ok();
            self.plans_by_size.insert(size, plan);
        }
        self.plans_by_size[&size].as_ref()?.stage(stage).cloned()
    }
}

impl Pipeline for Guarded<'_> {
    type Job = Job;

    fn spec(&self) -> &PipelineSpec {
        self.inner.spec()
    }

    /// Loads a component, timing it and measuring its memory; an out-of-memory error names
    /// what the plan predicts to fit.
    fn load(&mut self, component: usize) -> Result<()> {
        if interrupt::interrupted() {
            // Nothing loads after Ctrl-C. `run_stage` refuses every stage from now on, so the
            // component the runner now counts as loaded is never used.
            return Ok(());
        }
        let name = self.inner.spec().components[component].name;
        self.progress.note(&format!("loading {name}"));
        let start = Instant::now();
        // What released components give back is free again before anything more is held.
        crate::teardown::settle();
        self.meter.reset();
        let when = format!("while loading {name}");
        let mut loaded = self.load_once(component);
        // Out of device memory: every other component is freed and the load is tried once more
        // with a leaner option set.
        if let Err(e) = &loaded {
            if stages::is_out_of_memory(e) && self.make_room(&when).is_some() {
                loaded = self.load_once(component);
            }
        }
        if let Err(e) = loaded {
            return Err(self.explain(&when, e));
        }
        self.loaded.push(component);
        self.progress.note(&format!(
            "loaded {name} in {:.2}s: {}",
            start.elapsed().as_secs_f64(),
            progress::describe_peaks(&self.meter.peaks())
        ));
        Ok(())
    }

    /// Frees a component, saying so: when each is freed is what the load levers change.
    fn release(&mut self, component: usize) {
        if let Some(at) = self.evicted.iter().position(|&e| e == component) {
            // Freed already, after running out of memory.
            self.evicted.remove(at);
            return;
        }
        let name = self.inner.spec().components[component].name;
        self.inner.release(component);
        self.loaded.retain(|&c| c != component);
        self.progress.note(&format!("freed {name}"));
    }

    fn run_stage(&mut self, index: usize, job: &mut Job) -> Result<()> {
        self.run_stage_loading(index, job, &[]).0
    }

    fn run_stage_loading(
        &mut self,
        index: usize,
        job: &mut Job,
        ahead: &[usize],
    ) -> (Result<()>, Vec<LoadedBeside>) {
        let mut landed = Vec::new();
        let result = self.stage_beside(index, job, ahead, &mut landed);
        (result, landed)
    }
}

impl Guarded<'_> {
    /// Stage `index` for `job` as [`Pipeline::run_stage`] runs it, with `ahead` loading beside
    /// its first attempt; what loaded goes to `landed`.
    fn stage_beside(
        &mut self,
        index: usize,
        job: &mut Job,
        ahead: &[usize],
        landed: &mut Vec<LoadedBeside>,
    ) -> Result<()> {
        let stage = self.inner.spec().stages[index].name;
        if let Err(e) = interrupt::check() {
            job.stopped_at = Some(stage);
            return Err(e.into());
        }
        if !self.config.batch().overwrite && !job.written && jobs::output_exists(&job.output) {
            bail!(
                "{} appeared during the run; pass --overwrite to replace it",
                job.output.display()
            );
        }
        if let Some(why) = self.host_shortfall(stage, job) {
            bail!(why);
        }
        self.reload_evicted(index)?;
        let was_written = job.written;
        self.meter.reset();
        // Out of device memory (another process took some after the plan): every component is
        // freed and the stage runs once more from the same state with a leaner option set.
        let state = job.state();
        let (mut result, loaded_beside) = self.attempt_beside(index, job, ahead);
        landed.extend(loaded_beside);
        if let (Err(e), Some(state)) = (&result, state) {
            if stages::is_out_of_memory(e) && !interrupt::interrupted() {
                let first = format!("{e:#}");
                if let Some(flags) = self.make_room(&format!("in stage {stage}")) {
                    job.restore(state);
                    result = self
                        .reload_evicted(index)
                        .and_then(|()| self.attempt(index, job));
                    job.metrics.insert(
                        "out_of_memory_retry".into(),
                        json!({ "stage": stage, "with": flags, "error": first }),
                    );
                }
            }
        }
        match &result {
            Err(e) if e.is::<Interrupted>() => job.stopped_at = Some(stage),
            // Rank 0 alone speaks on stdout (the others write to a scratch folder).
            Ok(())
                if job.written
                    && !was_written
                    && self.config.ranks().is_none_or(|r| r.group.rank() == 0) =>
            {
                println!("{}", job.output.display())
            }
            _ => {}
        }
        let result = result.map_err(|e| self.explain(&format!("in stage {stage}"), e));
        if result.is_ok() {
            // Each stage's memory peaks: on stderr and in the job's `--stats-json` metrics.
            let peaks = self.meter.peaks();
            self.progress
                .note(&format!("  {stage}: {}", progress::describe_peaks(&peaks)));
            let mut measured = serde_json::to_value(peaks)?;
            // Beside what was measured, what the plan predicted.
            let planned = self.planned(stage, job);
            measured["host_planned_bytes"] = json!(planned.as_ref().map(|p| p.host_bytes));
            measured["device_planned_bytes"] = json!(planned.map(|p| p.peak_bytes));
            let stages = job.metrics.entry("stages").or_insert_with(|| json!({}));
            stages[stage] = measured;
        }
        result
    }
}

/// Reports every job on stderr (failures as errors, so also with --quiet) and picks the exit
/// code: 130 after Ctrl-C, 1 if any prompt failed, else 0.
fn summarize(jobs: &[Job], outcomes: &[Outcome], progress: &Progress) -> ExitCode {
    let total = jobs.len();
    let count = |s: Status| outcomes.iter().filter(|o| o.status == s).count();
    for (job, outcome) in jobs.iter().zip(outcomes) {
        let at = format!(
            "[{}/{total}] {} {}",
            job.index + 1,
            job.origin,
            jobs::excerpt(&job.prompt)
        );
        if !outcome.stage_times.is_empty() {
            let times: Vec<String> = outcome
                .stage_times
                .iter()
                .map(|(s, d)| format!("{s} {:.2}s", d.as_secs_f64()))
                .collect();
            progress.note(&format!("{at}: {}", times.join(", ")));
        }
        if let (Status::Failed, Some(e)) = (outcome.status, &outcome.error) {
            progress.error(&format!("error: {at}: {e}"));
        }
    }
    let (written, failed, skipped, other) = (
        count(Status::Written),
        count(Status::Failed),
        count(Status::Skipped),
        count(Status::OtherGpu),
    );
    let mut tally = format!("{written} of {total} written");
    if skipped > 0 {
        tally += &format!(", {skipped} skipped (--resume)");
    }
    if other > 0 {
        tally += &format!(", {other} on the other GPUs");
    }
    if failed > 0 {
        tally += &format!(", {failed} failed");
    }
    let stopped = jobs
        .iter()
        .zip(outcomes)
        .find(|(_, o)| o.status == Status::Interrupted);
    // Ctrl-C is 130 however late it came: between prompts, or during the last write, after
    // which nothing was left to stop.
    if stopped.is_some() || interrupt::interrupted() {
        let unfinished = count(Status::Interrupted) + count(Status::NotRun);
        let at = match stopped {
            Some((job, _)) => format!(
                " at {} of [{}/{total}] ({})",
                job.stopped_at.unwrap_or("start"),
                job.index + 1,
                job.origin
            ),
            None => String::new(),
        };
        progress.error(&format!(
            "interrupted{at}: {tally}, {unfinished} not made; finished videos are kept, rerun with --resume to make the rest"
        ));
        return ExitCode::from(interrupt::EXIT_CODE);
    }
    if failed > 0 {
        progress.error(&format!("{failed} of {total} prompts failed ({tally})"));
        return ExitCode::from(1);
    }
    if written + skipped + other == total {
        progress.note(&format!("done: {tally}"));
    }
    ExitCode::SUCCESS
}

/// The `--stats-json` document (schema in the README).
fn stats(
    config: &ResolvedConfig,
    jobs: &[Job],
    outcomes: &[Outcome],
    wall: Duration,
    error: Option<&anyhow::Error>,
) -> serde_json::Value {
    let mut out = config.to_json();
    let status = if error.is_some() {
        "error"
    } else if interrupt::interrupted() || outcomes.iter().any(|o| o.status == Status::Interrupted) {
        "interrupted"
    } else if outcomes.iter().any(|o| o.status == Status::Failed) {
        "failed"
    } else {
        "ok"
    };
    out["vidgen_version"] = json!(env!("CARGO_PKG_VERSION"));
    out["load_policy"] = json!(load_policy(config));
    out["batch_order"] = json!(batch_order(config));
    out["status"] = json!(status);
    out["error"] = json!(error.map(|e| format!("{e:#}")));
    out["wall_seconds"] = json!(wall.as_secs_f64());
    if config.generation().fp8_matmul {
        // The products that ran in fp8 (`--fp8-matmul`): the option's effect, counted.
        out["fp8_matmuls"] = json!(crate::models::fp8::products());
    }
    if config.generation().attention == AttentionKind::Sage {
        // The attentions that ran in 8 bits (`--attention sage`): the option's effect, counted.
        out["sage_attentions"] = json!(crate::models::sage_attention::calls());
    }
    out["jobs"] = jobs
        .iter()
        .zip(outcomes)
        .map(|(j, o)| {
            json!({
                "index": j.index + 1,
                "origin": j.origin,
                "prompt": j.prompt,
                "negative_prompt": j.negative_prompt,
                "seed": j.seed,
                "num_frames": j.num_frames,
                "height": j.height,
                "width": j.width,
                "num_inference_steps": j.num_inference_steps,
                "guidance_scale": j.guidance_scale,
                "output": j.output,
                "status": o.status,
                "error": o.error,
                "stopped_at": j.stopped_at,
                "stages": o.stage_times.iter().map(|(name, d)| json!({
                    "name": name,
                    "seconds": d.as_secs_f64(),
                })).collect::<Vec<_>>(),
                "seconds": o.stage_times.iter().map(|(_, d)| d.as_secs_f64()).sum::<f64>(),
                "metrics": j.metrics,
            })
        })
        .collect();
    out
}

/// Writes `stats` to `path` through a temporary file renamed into place.
fn write_stats(path: &Path, stats: &serde_json::Value) -> Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("--stats-json {} does not name a file", path.display()))?;
    // Unique to this process and created exclusively: another run's stats never share it.
    let temp = path.with_file_name(format!(
        ".{}.{}.partial",
        name.to_string_lossy(),
        std::process::id()
    ));
    let text = serde_json::to_string_pretty(stats)? + "\n";
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp)
        .and_then(|mut file| std::io::Write::write_all(&mut file, text.as_bytes()))
        .and_then(|()| std::fs::rename(&temp, path));
    if let Err(e) = written {
        // Best effort: the write error is the one worth reporting.
        let _ = std::fs::remove_file(&temp);
        return Err(e).with_context(|| format!("cannot write --stats-json {}", path.display()));
    }
    Ok(())
}

fn candle_device(config: &ResolvedConfig) -> Result<Device> {
    Ok(match config.device().kind {
        DeviceKind::Cpu => Device::Cpu,
        DeviceKind::Cuda => {
            let device = Device::new_cuda(config.device().ordinal)?;
            #[cfg(feature = "cuda")]
            if config.generation().attention == AttentionKind::Sage
                && !crate::models::sage_kernels::device_runs(device.as_cuda_device()?)
            {
                anyhow::bail!(
                    "--attention sage needs a GPU with fp8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell, GB10); use --attention exact"
                );
            }
            device
        }
        DeviceKind::Metal => Device::new_metal(config.device().ordinal)?,
    })
}

/// The `--dry-run` report: the resolved config, the planned stages with when each component
/// loads, and, where the model's configs can be read without downloading, the model's geometry,
/// where each component lives and the memory each stage is predicted to need. Everything comes
/// from the family's description, so every family is reported alike.
struct DryRun<'a> {
    config: &'a ResolvedConfig,
    source: &'a ModelSource,
    /// The family's description and facts, where its configs could be read, and where they came
    /// from (`model` or `shipped`); else why not.
    described: Result<Described, String>,
}

/// What a dry run knows of a model whose configs it read.
struct Described {
    spec: PipelineSpec,
    facts: serde_json::Value,
    from: &'static str,
    schedule: Schedule,
    placement: Placement,
    /// The memory plan, or why there is none.
    memory: Result<MemoryPlan, String>,
    /// Each video size the prompts ask for (their per-line overrides merged with the flags), in
    /// order of first appearance, with its memory plan; empty without prompts.
    sizes: Vec<SizePlan>,
    /// With several GPUs: each rank's plan and the components it holds.
    gpus: Vec<GpuPlan>,
}

/// One video size of the prompts: how many ask for it and its memory plan.
struct SizePlan {
    num_frames: u32,
    height: u32,
    width: u32,
    prompts: usize,
    memory: Result<MemoryPlan, String>,
}

impl SizePlan {
    /// The prompts' distinct sizes, each planned as a run of that size.
    fn of(planner: &Planner, jobs: &[Job]) -> Vec<SizePlan> {
        let mut order: Vec<(u32, u32, u32)> = Vec::new();
        let mut counts: std::collections::HashMap<(u32, u32, u32), usize> = Default::default();
        for j in jobs {
            let size = (j.num_frames, j.height, j.width);
            *counts.entry(size).or_insert_with(|| {
                order.push(size);
                0
            }) += 1;
        }
        order
            .into_iter()
            .map(|(num_frames, height, width)| SizePlan {
                num_frames,
                height,
                width,
                prompts: counts[&(num_frames, height, width)],
                memory: planner
                    .plan_size(num_frames, height, width)
                    .map_err(|e| format!("{e:#}")),
            })
            .collect()
    }

    fn json(&self, total: Option<u64>) -> serde_json::Value {
        let memory = self.memory.as_ref().ok();
        json!({
            "num_frames": self.num_frames,
            "height": self.height,
            "width": self.width,
            "prompts": self.prompts,
            "peak_bytes": memory.and_then(|m| m.peak()).map(|s| s.peak_bytes),
            "required_bytes": memory.map(|m| m.required_bytes()),
            "fits": memory.and_then(|m| total.map(|t| m.fits(t))),
            "host_peak_bytes": memory.map(|m| m.host_required_bytes()),
            "memory_error": self.memory.as_ref().err(),
        })
    }
}

/// What one GPU of a multi-GPU run holds and needs.
struct GpuPlan {
    rank: usize,
    /// Its sequence-parallel group.
    group: usize,
    holds: Vec<String>,
    memory: Result<MemoryPlan, String>,
}

impl GpuPlan {
    /// Every rank's plan (none with one GPU).
    fn all(
        planner: &Planner,
        request: &Request,
        spec: &PipelineSpec,
        config: &ResolvedConfig,
    ) -> Vec<Self> {
        let groups = config.groups();
        if groups.ranks < 2 {
            return Vec::new();
        }
        (0..groups.ranks)
            .map(|rank| {
                let mine = planner.rank_spec(spec.clone(), rank);
                let holds = mine
                    .used()
                    .into_iter()
                    .map(|c| &mine.components[c])
                    .map(|c| {
                        let (member, ranks) = (groups.rank_in_group(rank), groups.sp);
                        match Fsdp::of(config.memory(), c.role, member, ranks) {
                            Some(f) => format!(
                                "{} (1/{} of every block + {} gathered)",
                                c.name,
                                f.ranks,
                                f.gathered()
                            ),
                            None => c.name.to_string(),
                        }
                    })
                    .collect();
                GpuPlan {
                    rank,
                    group: groups.group(rank),
                    holds,
                    memory: planner
                        .plan_rank(request, rank)
                        .map_err(|e| format!("{e:#}")),
                }
            })
            .collect()
    }

    fn json(&self) -> serde_json::Value {
        let m = self.memory.as_ref().ok();
        json!({
            "rank": self.rank,
            "group": self.group,
            "holds": self.holds,
            "peak_stage": m.and_then(|m| m.peak()).map(|s| s.name),
            "peak_bytes": m.and_then(|m| m.peak()).map(|s| s.peak_bytes),
            "denoise_weight_bytes": m.and_then(|m| m.stage("denoise")).map(|s| s.weight_bytes),
            "required_bytes": m.map(|m| m.required_bytes()),
        })
    }
}

/// "4 GPUs: ..." for the dry run.
fn parallel_text(config: &ResolvedConfig) -> String {
    let groups = config.groups();
    let mut text = if groups.sp == 1 {
        format!(
            "{} GPUs: prompt parallelism, each GPU makes its share of the prompts",
            groups.ranks
        )
    } else {
        format!(
            "{} GPUs in {} group(s) of {} ({}): sequence parallelism in each group (a video's tokens split {} ways), {} prompt(s) at once; the first GPU of a group encodes, decodes and writes for it",
            groups.ranks,
            groups.count(),
            groups.sp,
            groups.describe(),
            groups.sp,
            groups.count()
        )
    };
    if config.memory().use_fsdp_inference {
        text += &format!(", FSDP: each GPU holds 1/{} of every DiT block", groups.sp);
    }
    text
}

impl<'a> DryRun<'a> {
    fn new(
        config: &'a ResolvedConfig,
        source: &'a ModelSource,
        found: Result<(Box<dyn Family>, &'static str), String>,
        jobs: &[Job],
    ) -> Self {
        let described = found.map(|(family, from)| {
            let planner = Planner::new(family.as_ref(), config);
            let request = planner.request();
            let spec = planner.spec(&request);
            Described {
                gpus: GpuPlan::all(&planner, &request, &spec, config),
                facts: family.facts(&RunShape::of(config)),
                from,
                schedule: Schedule::plan(&spec, load_policy(config), planner.jobs()),
                placement: Placement::new(config.memory(), &spec),
                memory: planner.plan(&request).map_err(|e| format!("{e:#}")),
                sizes: SizePlan::of(&planner, jobs),
                spec,
            }
        });
        DryRun {
            config,
            source,
            described,
        }
    }

    fn memory(&self) -> Option<&MemoryPlan> {
        self.described.as_ref().ok()?.memory.as_ref().ok()
    }

    /// The `--dry-run --json` object (keys documented in the README).
    fn json(&self) -> serde_json::Value {
        let config = self.config;
        let mut out = config.to_json();
        // The host's budget (it changes from moment to moment: beside the plan, not in it).
        out["host_available_bytes"] = json!(host_available(config));
        out["load_policy"] = json!(load_policy(config));
        out["batch_order"] = json!(batch_order(config));
        let source = self.source.to_string();
        match &self.described {
            Ok(d) => {
                out["pipeline"] = json!(d.spec.title);
                out["placement"] = d.placement.json();
                out["notes"] = json!(inert_options(config.memory(), &d.spec));
                out["stages"] = d
                    .spec
                    .stages
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let mut stage = json!({
                            "name": s.name,
                            "components": d.spec.names(&s.uses),
                            "load_before": d.spec.names(&d.schedule.load_before[i]),
                            "release_after": d.spec.names(&d.schedule.release_after[i]),
                        });
                        if let Some(m) = self.memory().and_then(|m| m.stage(s.name)) {
                            stage["memory"] = json!({
                                "weight_bytes": m.weight_bytes,
                                "activation_bytes": m.activation_bytes,
                                "peak_bytes": m.peak_bytes,
                                "peak_gib": round2(gib(m.peak_bytes)),
                                "host_bytes": m.host_bytes,
                            });
                        }
                        stage
                    })
                    .collect();
                let mut model = json!({
                    "source": source,
                    "configs_read": true,
                    "configs_from": d.from,
                });
                if let (Some(model), serde_json::Value::Object(facts)) =
                    (model.as_object_mut(), &d.facts)
                {
                    model.extend(facts.clone());
                }
                out["model"] = model;
                if !d.sizes.is_empty() {
                    let total = config.device().total_memory;
                    out["prompts"] = json!({
                        "count": d.sizes.iter().map(|s| s.prompts).sum::<usize>(),
                        "sizes": d.sizes.iter().map(|s| s.json(total)).collect::<Vec<_>>(),
                    });
                }
                if !d.gpus.is_empty() {
                    out["gpus"] = d.gpus.iter().map(GpuPlan::json).collect();
                }
            }
            Err(why) => {
                out["placement"] = json!({ "error": why });
                out["notes"] = json!([]);
                out["stages"] = json!([]);
                out["model"] = json!({ "source": source, "configs_read": false });
            }
        }
        out["memory_plan"] = match self.memory() {
            Some(m) => {
                let total = config.device().total_memory;
                json!({
                    "peak_stage": m.peak().map(|s| s.name),
                    "peak_bytes": m.peak().map(|s| s.peak_bytes),
                    "peak_gib": m.peak().map(|s| round2(gib(s.peak_bytes))),
                    "required_bytes": m.required_bytes(),
                    "device_total_bytes": total,
                    "device_free_bytes": config.device().free_memory,
                    "fits": total.map(|t| m.fits(t)),
                    "host_peak_stage": m.host_peak().map(|s| s.name),
                    "host_peak_bytes": m.host_required_bytes(),
                })
            }
            None => serde_json::Value::Null,
        };
        out
    }

    /// The same report for people: a summary, the options as config-file keys, and one line per
    /// stage with its predicted memory.
    fn text(&self) -> String {
        let config = self.config;
        let v = config.video();
        let d = config.device();
        let mut out = String::from("vidgen dry run: nothing is loaded\n");
        let from = match &self.described {
            Ok(Described {
                from: "shipped", ..
            }) => "published configs shipped with vidgen",
            Ok(_) => "configs read",
            Err(_) => "configs not readable without a download",
        };
        out += &format!("model        {} ({from})\n", self.source);
        if let Ok(described) = &self.described {
            out += &format!("pipeline     {}\n", described.spec.title);
        }
        let size = match (d.total_memory, d.free_memory) {
            (Some(t), Some(f)) => format!("{:.2} GiB, {:.2} GiB free", gib(t), gib(f)),
            (Some(t), None) => format!("{:.2} GiB", gib(t)),
            (None, _) => "size unknown".into(),
        };
        out += &format!(
            "device       {} ({}), memory model {}, {size}\n",
            d.spec(),
            d.name,
            json!(d.memory_model).as_str().unwrap_or("?")
        );
        if let Some(host) = host_available(config) {
            out += &format!("host         {:.2} GiB available", gib(host));
            if d.host_sharers > 1 {
                out += &format!(" (one share of {} processes on this host)", d.host_sharers);
            }
            out += "\n";
        }
        out += &format!("dtype        {}", config.dtype().as_str());
        if let Ok(described) = &self.described {
            let kept: Vec<String> = described
                .spec
                .components
                .iter()
                .filter_map(|c| {
                    let dtype = c.dtype?;
                    (dtype != config.dtype())
                        .then(|| format!("the {} runs in {}", c.name, dtype.as_str()))
                })
                .collect();
            if !kept.is_empty() {
                out += &format!(" ({})", kept.join(", "));
            }
        }
        out += &format!(
            "\nvideo        {} frames of {}x{}",
            v.num_frames, v.height, v.width
        );
        if let Some(latent) = self
            .described
            .as_ref()
            .ok()
            .and_then(|d| d.facts.get("latent_shape"))
        {
            out += &format!(", latents {latent}");
        }
        out += &format!(
            "\nload policy  {}, batch order {}\n",
            json!(load_policy(config)).as_str().unwrap_or("?"),
            json!(batch_order(config)).as_str().unwrap_or("?")
        );
        let described = match &self.described {
            Ok(described) => described,
            Err(why) => {
                out += &format!("placement    unknown: {why}\n");
                out += &options_text(config);
                out += &format!("stages       unknown: {why}\nmemory not predicted: {why}\n");
                return out;
            }
        };
        let p = &described.placement;
        for (name, residency) in p.components() {
            out += &format!("{name:<12} {residency}\n");
        }
        if p.uses_host_memory() {
            out += &format!("host memory  {}\n", p.memory);
        }
        for note in inert_options(config.memory(), &described.spec) {
            out += &format!("note         {note}\n");
        }
        out += &options_text(config);
        let spec = &described.spec;
        let names = |cs: &[usize]| match spec.names(cs) {
            n if n.is_empty() => "-".to_string(),
            n => n.join(","),
        };
        if !described.gpus.is_empty() {
            out += &format!("gpus         {}\n", parallel_text(config));
            for g in &described.gpus {
                let peak = match &g.memory {
                    Ok(m) => format!("peak {}", m.describe_peak()),
                    Err(why) => format!("memory not predicted: {why}"),
                };
                out += &format!(
                    "gpu {:<8} group {}: {}; {peak}\n",
                    g.rank,
                    g.group,
                    g.holds.join(", ")
                );
            }
        }
        let memory = &described.memory;
        let mut rows = vec![["stage", "uses", "loads before", "released after"].map(String::from)];
        for (i, s) in spec.stages.iter().enumerate() {
            rows.push([
                s.name.to_string(),
                names(&s.uses),
                names(&described.schedule.load_before[i]),
                names(&described.schedule.release_after[i]),
            ]);
        }
        let widths: Vec<usize> = (0..4)
            .map(|col| rows.iter().map(|r| r[col].len()).max().unwrap_or(0))
            .collect();
        for (i, row) in rows.iter().enumerate() {
            for (cell, width) in row.iter().zip(&widths) {
                out += &format!("{cell:<width$}  ");
            }
            let stage = i
                .checked_sub(1)
                .and_then(|s| memory.as_ref().ok()?.stage(spec.stages[s].name));
            match stage {
                Some(m) => {
                    out += &format!(
                        "{:>11.2}  {:>15.2}  {:>8.2}  {:>13.2}",
                        gib(m.weight_bytes),
                        gib(m.activation_bytes),
                        gib(m.peak_bytes),
                        gib(m.host_bytes)
                    )
                }
                None if i == 0 && memory.is_ok() => {
                    out += "weights GiB  activations GiB  peak GiB  host peak GiB"
                }
                None => {}
            }
            out = out.trim_end().to_string() + "\n";
        }
        match memory {
            Ok(m) => {
                out += &format!("predicted peak {}", m.describe_peak());
                if let Some(total) = d.total_memory {
                    let verdict = verdict(m.fits(total));
                    out += &format!(
                        "; {:.2} GiB with the allocator's slack and the context: {verdict} in {:.2} GiB",
                        gib(m.required_bytes()),
                        gib(total)
                    );
                }
                out += &format!("\npredicted host peak {}", m.describe_host_peak());
                if let Some(host) = d.host_available {
                    let verdict = verdict(m.fits_host(host));
                    out += &format!(": {verdict} in the {:.2} GiB available", gib(host));
                }
                out += "\n";
            }
            Err(why) => out += &format!("memory not predicted: {why}\n"),
        }
        out += &prompts_text(&described.sizes, d.total_memory);
        out
    }
}

/// A prediction's verdict in words.
fn verdict(fits: bool) -> &'static str {
    match fits {
        true => "fits",
        false => "does not fit",
    }
}

/// The host memory available: the run's budget, or where it plans for another machine (a forced
/// memory model), what this host has.
fn host_available(config: &ResolvedConfig) -> Option<u64> {
    config
        .device()
        .host_available
        .or_else(crate::memory::probe::host_available)
}

/// The prompts' sizes for people: how many prompts ask for each and its predicted peak (the
/// first few sizes; the rest summed up), where a prompt's line changes the flags' size.
fn prompts_text(sizes: &[SizePlan], total: Option<u64>) -> String {
    const SHOWN: usize = 8;
    let count: usize = sizes.iter().map(|s| s.prompts).sum();
    if count == 0 {
        return String::new();
    }
    let mut out = format!("prompts      {count}, {} size(s)\n", sizes.len());
    for s in sizes.iter().take(SHOWN) {
        let memory = match &s.memory {
            Ok(m) => {
                let verdict = match total {
                    Some(t) if m.fits(t) => ", fits",
                    Some(_) => ", does not fit",
                    None => "",
                };
                format!("predicted peak {}{verdict}", m.describe_peak())
            }
            Err(why) => format!("memory not predicted: {why}"),
        };
        out += &format!(
            "  {} x {} frames of {}x{}: {memory}\n",
            s.prompts, s.num_frames, s.height, s.width
        );
    }
    if sizes.len() > SHOWN {
        out += &format!(
            "  ... {} more sizes (all in --dry-run --json)\n",
            sizes.len() - SHOWN
        );
    }
    out
}

/// The options as config-file keys, one per line.
fn options_text(config: &ResolvedConfig) -> String {
    let mut out = String::from("options (as --config file keys)\n");
    if let serde_json::Value::Object(options) = json!(config.echo()) {
        for (key, value) in options.iter().filter(|(_, v)| !v.is_null()) {
            out += &format!("  {key} = {value}\n");
        }
    }
    out
}

/// Options that act on no component of the pipeline, each with why: an offload flag whose role
/// no component plays.
pub fn inert_options(o: &MemoryOptions, spec: &PipelineSpec) -> Vec<String> {
    let flags = [
        (
            o.image_encoder_cpu_offload,
            Role::ImageEncoder,
            "--image-encoder-cpu-offload",
        ),
        (
            o.text_encoder_cpu_offload,
            Role::TextEncoder,
            "--text-encoder-cpu-offload",
        ),
        (o.vae_cpu_offload, Role::Vae, "--vae-cpu-offload"),
    ];
    flags
        .into_iter()
        .filter(|&(on, role, _)| on && !spec.components.iter().any(|c| c.role == role))
        .map(|(_, role, flag)| {
            format!(
                "{flag} has nothing to move: {} has no {}",
                spec.title,
                role.describe()
            )
        })
        .collect()
}

/// Rounds to two decimals, for GiB figures in JSON.
fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// The model's family without downloading, and where its configs came from: the model itself (a
/// folder, the Hub cache, a synthetic model), else, for a Hub id whose published configs vidgen
/// ships ([`ModelSource::shipped_for`]), those.
fn dry_run_family(source: &ModelSource) -> Result<(Box<dyn Family>, &'static str), String> {
    let not_read = match registry::family(Configs::OnDisk(source)) {
        Ok(family) => return Ok((family, "model")),
        Err(e) => format!("{e:#}"),
    };
    let shipped = source.shipped_for();
    match shipped {
        Some(shipped) => registry::family(Configs::OnDisk(&shipped))
            .map(|family| (family, "shipped"))
            .map_err(|e| format!("{e:#}")),
        None => Err(not_read),
    }
}
