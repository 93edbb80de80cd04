//! The stage runner: a pipeline is an ordered list of stages, each naming the components it uses
//! ([`PipelineSpec`]). The runner decides when each component is loaded and released; pipelines
//! only say how.

use super::spec::{PipelineSpec, StageSpec};
use crate::memory::MemoryOptions;
use anyhow::Result;
use serde::Serialize;
use std::time::{Duration, Instant};

/// A pipeline the runner can drive: its description, and how to load, release and run.
/// Components and stages are named by their index in the description.
pub trait Pipeline {
    /// The state of one request as it moves through the stages.
    type Job;

    /// The pipeline as data.
    fn spec(&self) -> &PipelineSpec;
    /// Loads a component and places it on its device.
    fn load(&mut self, component: usize) -> Result<()>;
    /// Frees a component's memory.
    fn release(&mut self, component: usize);
    /// Runs stage `index` for one job.
    fn run_stage(&mut self, index: usize, job: &mut Self::Job) -> Result<()>;
    /// Runs stage `index` for one job while `ahead` (components the schedule loads before it
    /// that it does not use) load beside it; each one's load time, or why it failed (it is then
    /// loaded again before its first stage). Where a pipeline cannot load beside a stage, they
    /// load first.
    fn run_stage_loading(
        &mut self,
        index: usize,
        job: &mut Self::Job,
        ahead: &[usize],
    ) -> (Result<()>, Vec<LoadedBeside>) {
        let landed = ahead
            .iter()
            .map(|&c| {
                let start = Instant::now();
                (c, self.load(c).map(|()| start.elapsed()))
            })
            .collect();
        (self.run_stage(index, job), landed)
    }
    /// Places the components loaded from now on as `options` say (a leaner set after running
    /// out of memory); false where the pipeline cannot.
    fn replace_memory_options(&mut self, options: &MemoryOptions) -> bool {
        let _ = options;
        false
    }
}

/// A component loaded beside a stage ([`Pipeline::run_stage_loading`]): its index, and how long
/// its load took or why it failed.
pub type LoadedBeside = (usize, Result<Duration>);

/// When components are loaded and released.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadPolicy {
    /// Everything loads before the first stage and stays until the end.
    Eager,
    /// Deferrable components load before their first stage and are freed after their last.
    Lazy,
    /// The first stage's own components load, run and are freed before the rest load.
    Sequential,
}

/// In which order a batch walks the stages.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchOrder {
    /// Each prompt goes through every stage before the next prompt starts.
    Prompt,
    /// In groups of [`MAX_IN_FLIGHT`] prompts, every prompt passes a stage before any goes to
    /// the next (a stage that uses no component, writing, runs with the one before it): each
    /// component loads once per group.
    Stage,
}

/// What happened to one job.
#[derive(Debug, Default)]
pub struct JobReport {
    /// Wall time per stage, in stage order.
    pub stage_times: Vec<(&'static str, Duration)>,
    /// The error that stopped the job, if any.
    pub error: Option<String>,
}

/// Which jobs a [`Schedule`] is for: under [`LoadPolicy::Eager`] every component stays loaded
/// for the next job, and the last job (or the only one) releases each after its last stage, so
/// its host teardown overlaps the stages after it and they have its device memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Jobs {
    /// Jobs with others after them.
    More,
    /// The last job of a run.
    Last,
}

/// Which components are alive before and after each stage under a policy.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// Components to load before stage i.
    pub load_before: Vec<Vec<usize>>,
    /// Components to release after stage i.
    pub release_after: Vec<Vec<usize>>,
}

impl Schedule {
    /// Plans the loads and releases of `spec`'s stages under `policy` for `jobs`.
    pub fn plan(spec: &PipelineSpec, policy: LoadPolicy, jobs: Jobs) -> Self {
        let stages = &spec.stages;
        let n = stages.len();
        let mut load_before = vec![Vec::new(); n];
        let mut release_after = vec![Vec::new(); n];
        let mut all: Vec<usize> = Vec::new();
        for s in stages {
            for c in &s.uses {
                if !all.contains(c) {
                    all.push(*c);
                }
            }
        }
        let first = |c: &usize| stages.iter().position(|s| s.uses.contains(c)).unwrap_or(0);
        let last = |c: &usize| stages.iter().rposition(|s| s.uses.contains(c)).unwrap_or(0);
        for c in all {
            let (load_at, release_at) = match policy {
                LoadPolicy::Eager if jobs == Jobs::Last => (0, last(&c)),
                LoadPolicy::Eager => (0, n - 1),
                LoadPolicy::Lazy if spec.components[c].deferrable => (first(&c), last(&c)),
                LoadPolicy::Lazy => (0, n - 1),
                LoadPolicy::Sequential if last(&c) == 0 => (0, 0),
                LoadPolicy::Sequential => (first_after_zero(stages), n - 1),
            };
            load_before[load_at].push(c);
            release_after[release_at].push(c);
        }
        Schedule {
            load_before,
            release_after,
        }
    }
}

fn first_after_zero(stages: &[StageSpec]) -> usize {
    stages
        .iter()
        .skip(1)
        .position(|s| !s.uses.is_empty())
        .map_or(0, |i| i + 1)
}

/// Runs every job through the pipeline. A failing job is reported and the others go on.
///
/// `on_stage(job, stage)` is called as each stage starts (progress display).
pub fn run<P: Pipeline>(
    pipeline: &mut P,
    jobs: &mut [P::Job],
    policy: LoadPolicy,
    order: BatchOrder,
    mut on_stage: impl FnMut(usize, &'static str),
) -> Vec<JobReport> {
    let stages = pipeline.spec().stages.clone();
    // Eager components stay for the next job: only the last job's stages release them.
    let schedule = Schedule::plan(pipeline.spec(), policy, Jobs::Last);
    let keeps = |last_job: bool| policy == LoadPolicy::Eager && !last_job;
    let mut reports: Vec<JobReport> = jobs.iter().map(|_| JobReport::default()).collect();
    let mut loaded: Vec<usize> = Vec::new();
    let mut step = |pipeline: &mut P,
                    loaded: &mut Vec<usize>,
                    stage: usize,
                    job_index: usize,
                    job: &mut P::Job,
                    report: &mut JobReport| {
        if report.error.is_some() {
            return;
        }
        on_stage(job_index, stages[stage].name);
        let start = Instant::now();
        // The stage's own components first; the others the schedule loads now, beside it.
        let result = ensure_loaded(pipeline, loaded, &stages[stage].uses).and_then(|()| {
            let ahead: Vec<usize> = schedule.load_before[stage]
                .iter()
                .copied()
                .filter(|c| !loaded.contains(c))
                .collect();
            let (result, landed) = pipeline.run_stage_loading(stage, job, &ahead);
            loaded.extend(landed.iter().filter(|(_, r)| r.is_ok()).map(|&(c, _)| c));
            result
        });
        report
            .stage_times
            .push((stages[stage].name, start.elapsed()));
        if let Err(e) = result {
            report.error = Some(format!("{}: {e:#}", stages[stage].name));
        }
    };
    match order {
        BatchOrder::Stage => {
            let groups = stage_groups(&stages);
            let last_chunk = jobs.len().div_ceil(MAX_IN_FLIGHT).saturating_sub(1);
            let chunks = jobs
                .chunks_mut(MAX_IN_FLIGHT)
                .zip(reports.chunks_mut(MAX_IN_FLIGHT));
            for (c, (chunk, chunk_reports)) in chunks.enumerate() {
                for group in &groups {
                    for (i, (job, report)) in chunk.iter_mut().zip(&mut *chunk_reports).enumerate()
                    {
                        for stage in group.clone() {
                            step(
                                pipeline,
                                &mut loaded,
                                stage,
                                c * MAX_IN_FLIGHT + i,
                                job,
                                report,
                            );
                        }
                    }
                    if !keeps(c == last_chunk) {
                        for stage in group.clone() {
                            release(pipeline, &mut loaded, &schedule.release_after[stage]);
                        }
                    }
                }
            }
        }
        BatchOrder::Prompt => {
            let last_job = jobs.len().saturating_sub(1);
            for (i, (job, report)) in jobs.iter_mut().zip(&mut reports).enumerate() {
                for stage in 0..stages.len() {
                    step(pipeline, &mut loaded, stage, i, job, report);
                    // Deferred components reload per prompt.
                    if !keeps(i == last_job) {
                        release(pipeline, &mut loaded, &schedule.release_after[stage]);
                    }
                }
            }
        }
    }
    let rest = loaded.clone();
    release(pipeline, &mut loaded, &rest);
    reports
}

/// The most jobs a stage-major batch has between stages at once: what waits between stages
/// (each prompt's embeddings and latents, some tens of MB at full size) is bounded by it
/// instead of growing with the batch, at the cost of loading each component once per this
/// many prompts instead of once per batch.
pub const MAX_IN_FLIGHT: usize = 16;

/// The stages in groups that a stage-major batch runs job by job: each stage that uses
/// components, with the stages after it that use none (writing the video), so that a video is
/// written as soon as it is decoded instead of every decoded video waiting in memory for the
/// last to be decoded.
fn stage_groups(stages: &[StageSpec]) -> Vec<std::ops::Range<usize>> {
    let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, stage) in stages.iter().enumerate() {
        match groups.last_mut() {
            Some(last) if stage.uses.is_empty() => last.end = i + 1,
            _ => groups.push(i..i + 1),
        }
    }
    groups
}

fn ensure_loaded<P: Pipeline>(
    pipeline: &mut P,
    loaded: &mut Vec<usize>,
    wanted: &[usize],
) -> Result<()> {
    for c in wanted {
        if !loaded.contains(c) {
            pipeline.load(*c)?;
            loaded.push(*c);
        }
    }
    Ok(())
}

fn release<P: Pipeline>(pipeline: &mut P, loaded: &mut Vec<usize>, which: &[usize]) {
    for c in which {
        if let Some(pos) = loaded.iter().position(|l| l == c) {
            pipeline.release(*c);
            loaded.remove(pos);
        }
    }
}
