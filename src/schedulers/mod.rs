//! Diffusion samplers: given the model output at a timestep, compute the next sample.
//!
//! Both samplers reproduce diffusers 0.42.1 number for number: the schedule is computed in f64 like
//! numpy and stored as f32 like the torch tensors, and the per-step scalar arithmetic runs in f32.

pub mod cogvideox;
pub mod ddim;
pub mod euler;
pub mod euler_ancestral;
pub mod linear_quadratic;
pub mod minimax_h3;
pub mod unipc;

use anyhow::{bail, Context};
use serde::Deserialize;
use std::path::Path;

/// `scheduler/scheduler_config.json` of a diffusers `UniPCMultistepScheduler`, with diffusers'
/// defaults for missing keys. Keys that do not matter for flow-matching models are ignored.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    /// Length of the training schedule; timesteps are `sigma * num_train_timesteps`.
    pub num_train_timesteps: usize,
    /// Multistep order of UniPC (2 for Wan).
    pub solver_order: usize,
    /// What the model predicts; only `flow_prediction` (velocity) is supported.
    pub prediction_type: String,
    /// UniPC's B(h) variant: `bh1` or `bh2` (`midpoint`, `heun`, `logrho` mean `bh2`, as in diffusers).
    pub solver_type: String,
    /// Drop to first order at the last steps (stabilises few-step sampling).
    pub lower_order_final: bool,
    /// Use the flow-matching sigma schedule (required).
    pub use_flow_sigmas: bool,
    /// Shift of the flow sigmas: `shift*s / (1 + (shift-1)*s)`.
    pub flow_shift: f64,
    /// Final sigma: `zero` or `sigma_min` (the last schedule sigma repeated).
    pub final_sigmas_type: String,
    /// Timestep spacing; irrelevant with flow sigmas but validated like diffusers.
    pub timestep_spacing: String,
    /// UniPC in data-prediction form (required for flow prediction).
    pub predict_x0: bool,
    /// Step indices after which the corrector is skipped.
    pub disable_corrector: Vec<usize>,
    /// Dynamic thresholding of the x0 prediction (not supported).
    pub thresholding: bool,
    /// Resolution-dependent shifting (not supported).
    pub use_dynamic_shifting: bool,
    /// Karras sigmas (not supported).
    pub use_karras_sigmas: bool,
    /// Exponential sigmas (not supported).
    pub use_exponential_sigmas: bool,
    /// Beta sigmas (not supported).
    pub use_beta_sigmas: bool,
    /// Stretch of the schedule to a terminal value (not supported).
    pub shift_terminal: Option<f64>,
    /// External predictor scheduler (not supported).
    pub solver_p: Option<serde_json::Value>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        // The defaults of `UniPCMultistepScheduler.__init__`.
        Self {
            num_train_timesteps: 1000,
            solver_order: 2,
            prediction_type: "epsilon".into(),
            solver_type: "bh2".into(),
            lower_order_final: true,
            use_flow_sigmas: false,
            flow_shift: 1.0,
            final_sigmas_type: "zero".into(),
            timestep_spacing: "linspace".into(),
            predict_x0: true,
            disable_corrector: Vec::new(),
            thresholding: false,
            use_dynamic_shifting: false,
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
            shift_terminal: None,
            solver_p: None,
        }
    }
}

impl SchedulerConfig {
    /// Reads a `scheduler_config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> anyhow::Result<Self> {
        read_config(path.as_ref())
    }

    /// Rejects a config that no sampler here can run, naming the key: checked when the config
    /// is read, so a bad scheduler config fails before any model loads, not at the first step.
    /// It must be a flow-matching config and a valid UniPC one (the class Wan ships with).
    pub fn validate(&self) -> anyhow::Result<()> {
        self.check_flow_model()?;
        unipc::check_config(self)?;
        if !(self.flow_shift.is_finite() && self.flow_shift > 0.0) {
            bail!(
                "`flow_shift` {} must be a positive number (Wan uses 3.0 at 480p, 5.0 at 720p)",
                self.flow_shift
            );
        }
        Ok(())
    }

    /// Settings shared by every sampler here: a flow-matching (velocity) model.
    fn check_flow_model(&self) -> anyhow::Result<()> {
        if self.prediction_type != "flow_prediction" {
            bail!(
                "`prediction_type` {:?} is not supported (only \"flow_prediction\")",
                self.prediction_type
            );
        }
        if self.num_train_timesteps == 0 {
            bail!("`num_train_timesteps` is 0: it must be positive");
        }
        if self.use_dynamic_shifting {
            bail!("`use_dynamic_shifting` = true is not supported");
        }
        for (key, on) in [
            ("use_karras_sigmas", self.use_karras_sigmas),
            ("use_exponential_sigmas", self.use_exponential_sigmas),
            ("use_beta_sigmas", self.use_beta_sigmas),
        ] {
            if on {
                bail!("`{key}` = true is not supported (flow sigmas only)");
            }
        }
        if self.shift_terminal.is_some_and(|s| s != 0.0) {
            bail!("`shift_terminal` is not supported");
        }
        Ok(())
    }
}

/// A sampler that has had its schedule set: steps are consumed in order, one per call.
/// `Send` so the pipeline may run it on a worker thread.
pub trait Scheduler: Send {
    /// The timesteps handed to the model, one per step (integers for UniPC, fractional for Euler).
    fn timesteps(&self) -> &[f64];
    /// The sigma schedule, `timesteps().len() + 1` values ending with the final sigma.
    fn sigmas(&self) -> &[f32];
    /// Advances `sample` by one step given the model output at the current timestep.
    fn step(
        &mut self,
        model_output: &candle_core::Tensor,
        sample: &candle_core::Tensor,
    ) -> candle_core::Result<candle_core::Tensor>;
}

/// Which sampler to run (`--scheduler`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum SchedulerKind {
    /// UniPC multistep (the scheduler Wan ships with).
    #[default]
    #[value(name = "unipc")]
    UniPc,
    /// Flow-matching Euler (first order).
    #[value(name = "euler")]
    Euler,
}

impl SchedulerKind {
    /// Its `--scheduler` value.
    pub fn name(self) -> &'static str {
        match self {
            SchedulerKind::UniPc => "unipc",
            SchedulerKind::Euler => "euler",
        }
    }
}

/// Builds a sampler with its schedule for `num_steps` steps; `flow_shift` overrides the config's.
/// `sigmas` (Euler only, one per step) replace the sampler's own spacing, as diffusers'
/// `FlowMatchEulerDiscreteScheduler(shift=...).set_timesteps(sigmas=...)`: the few-step
/// distillation recipes' schedule.
pub fn build(
    kind: SchedulerKind,
    cfg: &SchedulerConfig,
    num_steps: usize,
    flow_shift: Option<f64>,
    sigmas: Option<&[f64]>,
) -> anyhow::Result<Box<dyn Scheduler>> {
    if num_steps == 0 {
        bail!("the number of inference steps must be at least 1");
    }
    let shift = flow_shift.unwrap_or(cfg.flow_shift);
    if !(shift.is_finite() && shift > 0.0) {
        bail!("flow shift must be a positive number, got {shift}");
    }
    Ok(match (kind, sigmas) {
        (SchedulerKind::UniPc, None) => {
            Box::new(unipc::UniPcMultistep::new(cfg, num_steps, shift)?)
        }
        (SchedulerKind::Euler, None) => {
            Box::new(euler::FlowMatchEuler::new(cfg, num_steps, shift)?)
        }
        (SchedulerKind::Euler, Some(sigmas)) => {
            if sigmas.len() != num_steps {
                bail!(
                    "{} sigmas for {num_steps} inference steps: give one sigma per step",
                    sigmas.len()
                );
            }
            cfg.check_flow_model()?;
            let euler = euler::FlowMatchEulerConfig {
                num_train_timesteps: cfg.num_train_timesteps,
                shift,
                ..Default::default()
            };
            Box::new(euler::FlowMatchEuler::with_sigmas(&euler, sigmas, None)?)
        }
        (SchedulerKind::UniPc, Some(_)) => {
            bail!("custom sigmas set the flow-matching Euler schedule; use --scheduler euler")
        }
    })
}

/// The integer timesteps of an `n`-step run of a discrete (DDPM-trained) scheduler over `train`
/// training steps, spaced as diffusers' `timestep_spacing` says (`linspace`, `leading` with
/// `steps_offset`, else `trailing`), in running order.
fn discrete_timesteps(
    train: usize,
    n: usize,
    spacing: &str,
    steps_offset: i64,
) -> anyhow::Result<Vec<i64>> {
    if n == 0 || n > train {
        bail!("the number of inference steps must be between 1 and num_train_timesteps ({train}), got {n}");
    }
    Ok(match spacing {
        "linspace" => np_linspace(0.0, (train - 1) as f64, n)
            .into_iter()
            .rev()
            .map(|t| t.round_ties_even() as i64)
            .collect(),
        "leading" => {
            let ratio = (train / n) as i64;
            (0..n as i64)
                .rev()
                .map(|i| i * ratio + steps_offset)
                .collect()
        }
        _ => {
            // np.round(np.arange(train, 0, -train / n)) - 1, with numpy's arange fill
            // (start + i * ((start + step) - start)).
            let start = train as f64;
            let step = -(train as f64 / n as f64);
            let len = ((0.0 - start) / step).ceil().max(0.0) as usize;
            let delta = (start + step) - start;
            (0..len)
                .map(|i| (start + i as f64 * delta).round_ties_even() as i64 - 1)
                .collect()
        }
    })
}

/// `numpy.linspace(start, stop, num)` (endpoint included) with numpy's exact float64 arithmetic.
fn np_linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    if num == 1 {
        return vec![start];
    }
    let div = (num - 1) as f64;
    let delta = stop - start;
    let step = delta / div;
    let mut y: Vec<f64> = (0..num)
        .map(|i| {
            let i = i as f64;
            if step == 0.0 {
                i / div * delta + start
            } else {
                i * step + start
            }
        })
        .collect();
    if let Some(last) = y.last_mut() {
        *last = stop;
    }
    y
}

/// A `scheduler_config.json` read and parsed, the file named in either error.
fn read_config<T: serde::de::DeserializeOwned>(path: &Path) -> anyhow::Result<T> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading scheduler config {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("parsing scheduler config {}", path.display()))
}

/// The checks every discrete-time (DDPM-family) sampler makes of its training schedule, with
/// the key at fault: at least two training timesteps, no explicit betas, a beta schedule among
/// `schedules`, betas in [0, 1), and a timestep spacing diffusers defines.
pub fn validate_training_schedule(
    num_train_timesteps: usize,
    trained_betas: bool,
    (beta_schedule, schedules): (&str, &[&str]),
    (beta_start, beta_end): (f64, f64),
    timestep_spacing: &str,
) -> anyhow::Result<()> {
    if num_train_timesteps < 2 {
        bail!("scheduler config: num_train_timesteps must be at least 2");
    }
    if trained_betas {
        bail!("scheduler config: trained_betas is not supported");
    }
    if !schedules.contains(&beta_schedule) {
        let only: Vec<String> = schedules.iter().map(|s| format!("{s:?}")).collect();
        bail!(
            "scheduler config: beta_schedule {beta_schedule:?} is not supported (only {})",
            only.join(" and ")
        );
    }
    if !matches!(timestep_spacing, "leading" | "trailing" | "linspace") {
        bail!("scheduler config: timestep_spacing {timestep_spacing:?} is not supported");
    }
    let betas_ok = |b: f64| b.is_finite() && (0.0..1.0).contains(&b);
    if !betas_ok(beta_start) || !betas_ok(beta_end) {
        bail!("scheduler config: beta_start and beta_end must lie in [0, 1)");
    }
    Ok(())
}

/// ᾱ of every training timestep of a DDPM-trained model (f32, as diffusers' `alphas_cumprod`):
/// `betas = torch.linspace(start, end, n, dtype=float32)` (of the square roots, squared, for
/// `scaled_linear`), `torch.cumprod(1 - betas)` accumulated in f64 with each entry rounded to f32.
fn alphas_cumprod(beta_schedule: &str, beta_start: f64, beta_end: f64, n: usize) -> Vec<f32> {
    let betas: Vec<f32> = match beta_schedule {
        "scaled_linear" => torch_linspace_f32(beta_start.sqrt() as f32, beta_end.sqrt() as f32, n)
            .into_iter()
            .map(|b| b * b)
            .collect(),
        _ => torch_linspace_f32(beta_start as f32, beta_end as f32, n),
    };
    let mut acc = 1.0f64;
    betas
        .into_iter()
        .map(|b| {
            acc *= f64::from(1.0f32 - b);
            acc as f32
        })
        .collect()
}

/// `torch.linspace(start, end, n, dtype=float32)` as the CPU kernel computes it: from the start
/// for the first half, from the end for the second, each a fused multiply-add in f32 (what the
/// compiled kernel runs: it reproduces diffusers' `alphas_cumprod` bit for bit).
fn torch_linspace_f32(start: f32, end: f32, n: usize) -> Vec<f32> {
    if n <= 1 {
        return vec![start; n];
    }
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(|i| {
            if i < half {
                (i as f32).mul_add(step, start)
            } else {
                (-((n - 1 - i) as f32)).mul_add(step, end)
            }
        })
        .collect()
}

/// Multiplies by an f32 scalar in the tensor's own dtype (like a 0-dim torch tensor would).
fn scale(t: &candle_core::Tensor, s: f32) -> candle_core::Result<candle_core::Tensor> {
    t.affine(f64::from(s), 0.0)
}

/// Refuses a step past the end of the schedule (an error, not a panic on the sigma table).
fn check_step(scheduler: &str, index: usize, steps: usize) -> candle_core::Result<()> {
    if index >= steps {
        candle_core::bail!("{scheduler}: all {steps} steps of the schedule were already taken");
    }
    Ok(())
}

/// The configs of the schedulers more than one family samples with.
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![
        (
            "FlowMatchEulerDiscreteScheduler",
            "scheduler_config.json",
            euler::FlowMatchEulerConfig
        ),
        (
            "UniPCMultistepScheduler",
            "scheduler_config.json",
            SchedulerConfig
        ),
        (
            "CogVideoXDPMScheduler",
            "scheduler_config.json",
            cogvideox::CogVideoXSchedulerConfig
        ),
        (
            "CogVideoXDDIMScheduler",
            "scheduler_config.json",
            cogvideox::CogVideoXSchedulerConfig
        ),
    ],
    shipped: &[],
};

#[cfg(test)]
mod tests {
    use super::np_linspace;

    #[test]
    fn linspace_matches_numpy() {
        assert_eq!(np_linspace(1.0, 0.001, 1), vec![1.0]);
        let y = np_linspace(0.0, 1.0, 5);
        assert_eq!(y, vec![0.0, 0.25, 0.5, 0.75, 1.0]);
        // numpy.linspace(1, 0.001, 5)[1] == 0.75025 (i*step + start, not start + i*delta/div)
        assert_eq!(
            np_linspace(1.0, 0.001, 5)[1],
            1.0 * ((0.001 - 1.0) / 4.0) + 1.0
        );
    }
}
