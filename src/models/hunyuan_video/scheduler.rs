//! The sampling schedule and guidance inputs of `HunyuanVideoPipeline` (diffusers 0.42.1).
//!
//! The pipeline passes its own sigmas, `linspace(1, 0, N + 1)[:-1]`, to
//! `FlowMatchEulerDiscreteScheduler.set_timesteps`, which shifts them once with the static
//! `shift` (7 for the published model) in float32: `σ' = shift·σ / (1 + (shift − 1)·σ)`;
//! timesteps are `σ'·1000` and a final sigma 0 is appended. The step itself is the shared
//! flow-matching Euler step ([`crate::schedulers::euler::FlowMatchEuler`]).
//!
//! The model is guidance-distilled: `guidance_scale` is not classifier-free guidance but an
//! input, `guidance_scale · 1000` in the transformer dtype. Real CFG (`true_cfg_scale`) runs a
//! second forward with the negative prompt only when `true_cfg_scale > 1` and a negative prompt
//! is given.

use anyhow::{bail, Context};
use candle_core::{DType, Device, Result, Tensor};
use serde::Deserialize;
use std::path::Path;

use crate::schedulers::euler::FlowMatchEuler;

/// `scheduler/scheduler_config.json` of `FlowMatchEulerDiscreteScheduler`, with diffusers'
/// defaults; keys that do not change this schedule are ignored.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct FlowMatchEulerConfig {
    pub num_train_timesteps: usize,
    /// Static shift of the sigmas.
    pub shift: f64,
    pub use_dynamic_shifting: bool,
    pub invert_sigmas: bool,
    pub shift_terminal: Option<f64>,
    pub use_karras_sigmas: bool,
    pub use_exponential_sigmas: bool,
    pub use_beta_sigmas: bool,
    pub stochastic_sampling: bool,
}

impl Default for FlowMatchEulerConfig {
    fn default() -> Self {
        Self {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: false,
            invert_sigmas: false,
            shift_terminal: None,
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
            stochastic_sampling: false,
        }
    }
}

impl FlowMatchEulerConfig {
    /// Reads a `scheduler_config.json`.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading scheduler config {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("parsing scheduler config {}", path.display()))
    }

    /// Rejects settings this schedule does not implement, naming the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.num_train_timesteps == 0 {
            bail!("scheduler config: num_train_timesteps must be positive");
        }
        if !(self.shift.is_finite() && self.shift > 0.0) {
            bail!("scheduler config: shift {} must be positive", self.shift);
        }
        for (key, on) in [
            ("use_dynamic_shifting", self.use_dynamic_shifting),
            ("invert_sigmas", self.invert_sigmas),
            ("use_karras_sigmas", self.use_karras_sigmas),
            ("use_exponential_sigmas", self.use_exponential_sigmas),
            ("use_beta_sigmas", self.use_beta_sigmas),
            ("stochastic_sampling", self.stochastic_sampling),
        ] {
            if on {
                bail!("scheduler config: {key} = true is not supported");
            }
        }
        if self.shift_terminal.is_some_and(|s| s != 0.0) {
            bail!("scheduler config: shift_terminal is not supported");
        }
        Ok(())
    }
}

/// The pipeline's schedule for `num_steps` steps: timesteps (f32 values) and `num_steps + 1`
/// sigmas ending in 0. `shift` overrides the config's.
pub fn schedule(
    cfg: &FlowMatchEulerConfig,
    num_steps: usize,
    shift: Option<f64>,
) -> anyhow::Result<(Vec<f64>, Vec<f32>)> {
    cfg.validate()?;
    if num_steps == 0 {
        bail!("the number of inference steps must be at least 1");
    }
    let shift = shift.unwrap_or(cfg.shift);
    if !(shift.is_finite() && shift > 0.0) {
        bail!("flow shift must be a positive number, got {shift}");
    }
    // np.linspace(1.0, 0.0, N + 1)[:-1] in f64, then .astype(float32); the shift runs in f32
    // (numpy keeps float32 arrays float32 against Python floats).
    let (shift, shift_m1) = (shift as f32, (shift - 1.0) as f32);
    let step = -1.0 / num_steps as f64;
    let mut sigmas: Vec<f32> = (0..num_steps)
        .map(|i| {
            let s = (i as f64 * step + 1.0) as f32;
            (shift * s) / (1.0 + shift_m1 * s)
        })
        .collect();
    let n = cfg.num_train_timesteps as f32;
    let timesteps = sigmas.iter().map(|&s| f64::from(s * n)).collect();
    sigmas.push(0.0);
    Ok((timesteps, sigmas))
}

/// The Euler sampler over [`schedule`].
pub fn sampler(
    cfg: &FlowMatchEulerConfig,
    num_steps: usize,
    shift: Option<f64>,
) -> anyhow::Result<FlowMatchEuler> {
    let (timesteps, sigmas) = schedule(cfg, num_steps, shift)?;
    FlowMatchEuler::with_schedule(timesteps, sigmas)
}

/// The transformer's `guidance` input `[batch]`: `guidance_scale` in `dtype`, times 1000 in
/// `dtype` (in bf16, 6.0 becomes 6016, as in diffusers).
pub fn guidance_input(
    guidance_scale: f64,
    batch: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    Tensor::full(guidance_scale as f32, batch, device)?
        .to_dtype(dtype)?
        .affine(1000.0, 0.0)
}

/// Whether the pipeline runs the negative-prompt forward (`true_cfg_scale > 1` and a
/// negative prompt given).
pub fn uses_true_cfg(true_cfg_scale: f64, has_negative_prompt: bool) -> bool {
    true_cfg_scale > 1.0 && has_negative_prompt
}

/// `neg + scale · (cond − neg)`, the pipeline's true-CFG combination (in the tensors' dtype).
pub fn true_cfg(cond: &Tensor, neg: &Tensor, true_cfg_scale: f64) -> Result<Tensor> {
    neg + (cond - neg)?.affine(true_cfg_scale, 0.0)?
}
