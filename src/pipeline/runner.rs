//! The stage runner: a pipeline is an ordered list of stages, each naming the components it uses.
//! The runner decides when each component is loaded and released; pipelines only say how.

use anyhow::Result;
use serde::Serialize;
use std::fmt::Debug;
use std::time::{Duration, Instant};

/// One step of a pipeline and the components it needs loaded.
#[derive(Debug, Serialize)]
pub struct StageSpec<C: 'static> {
    pub name: &'static str,
    pub uses: &'static [C],
}

/// A pipeline the runner can drive: its stages, and how to load, release and run.
pub trait Pipeline {
    /// A loadable component (text encoder, DiT, VAE, ...).
    type Component: Copy + Eq + Debug + Serialize + 'static;
    /// The state of one request as it moves through the stages.
    type Job;

    /// The stages, in order.
    fn stages(&self) -> &'static [StageSpec<Self::Component>];
    /// Components checked as safe to load late and free early (FastVideo's `_lazy_module_names`).
    fn deferrable(&self) -> &'static [Self::Component];
    /// Loads a component and places it on its device.
    fn load(&mut self, component: Self::Component) -> Result<()>;
    /// Frees a component's memory.
    fn release(&mut self, component: Self::Component);
    /// Runs stage `index` for one job.
    fn run_stage(&mut self, index: usize, job: &mut Self::Job) -> Result<()>;
}

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
    /// Every prompt passes a stage before any goes to the next: each component loads once.
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

/// Which components are alive before and after each stage under a policy.
pub struct Schedule<C: 'static> {
    /// Components to load before stage i.
    pub load_before: Vec<Vec<C>>,
    /// Components to release after stage i.
    pub release_after: Vec<Vec<C>>,
}

impl<C: Copy + Eq + Debug + 'static> Schedule<C> {
    /// Plans the loads and releases of `stages` under `policy`.
    pub fn plan(stages: &[StageSpec<C>], deferrable: &[C], policy: LoadPolicy) -> Self {
        let n = stages.len();
        let mut load_before = vec![Vec::new(); n];
        let mut release_after = vec![Vec::new(); n];
        let mut all: Vec<C> = Vec::new();
        for s in stages {
            for c in s.uses {
                if !all.contains(c) {
                    all.push(*c);
                }
            }
        }
        let first = |c: &C| stages.iter().position(|s| s.uses.contains(c)).unwrap_or(0);
        let last = |c: &C| stages.iter().rposition(|s| s.uses.contains(c)).unwrap_or(0);
        for c in all {
            let (load_at, release_at) = match policy {
                LoadPolicy::Eager => (0, n - 1),
                LoadPolicy::Lazy if deferrable.contains(&c) => (first(&c), last(&c)),
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

fn first_after_zero<C>(stages: &[StageSpec<C>]) -> usize {
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
    let stages = pipeline.stages();
    let schedule = Schedule::plan(stages, pipeline.deferrable(), policy);
    let mut reports: Vec<JobReport> = jobs.iter().map(|_| JobReport::default()).collect();
    let mut loaded: Vec<P::Component> = Vec::new();
    let mut step = |pipeline: &mut P,
                    loaded: &mut Vec<P::Component>,
                    stage: usize,
                    job_index: usize,
                    job: &mut P::Job,
                    report: &mut JobReport| {
        if report.error.is_some() {
            return;
        }
        on_stage(job_index, stages[stage].name);
        let start = Instant::now();
        let result = ensure_loaded(pipeline, loaded, &schedule.load_before[stage])
            .and_then(|()| ensure_loaded(pipeline, loaded, stages[stage].uses))
            .and_then(|()| pipeline.run_stage(stage, job));
        report
            .stage_times
            .push((stages[stage].name, start.elapsed()));
        if let Err(e) = result {
            report.error = Some(format!("{}: {e:#}", stages[stage].name));
        }
    };
    match order {
        BatchOrder::Stage => {
            for stage in 0..stages.len() {
                for (i, (job, report)) in jobs.iter_mut().zip(&mut reports).enumerate() {
                    step(pipeline, &mut loaded, stage, i, job, report);
                }
                release(pipeline, &mut loaded, &schedule.release_after[stage]);
            }
        }
        BatchOrder::Prompt => {
            for (i, (job, report)) in jobs.iter_mut().zip(&mut reports).enumerate() {
                for stage in 0..stages.len() {
                    step(pipeline, &mut loaded, stage, i, job, report);
                    // Eager components stay for the next prompt; deferred ones reload per prompt.
                    if policy != LoadPolicy::Eager {
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

fn ensure_loaded<P: Pipeline>(
    pipeline: &mut P,
    loaded: &mut Vec<P::Component>,
    wanted: &[P::Component],
) -> Result<()> {
    for c in wanted {
        if !loaded.contains(c) {
            pipeline.load(*c)?;
            loaded.push(*c);
        }
    }
    Ok(())
}

fn release<P: Pipeline>(pipeline: &mut P, loaded: &mut Vec<P::Component>, which: &[P::Component]) {
    for c in which {
        if let Some(pos) = loaded.iter().position(|l| l == c) {
            pipeline.release(*c);
            loaded.remove(pos);
        }
    }
}
