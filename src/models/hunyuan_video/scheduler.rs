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

use anyhow::bail;
use candle_core::{DType, Device, Result, Tensor};

use crate::schedulers::euler::FlowMatchEuler;
pub use crate::schedulers::euler::FlowMatchEulerConfig;

/// The pipeline's schedule for `num_steps` steps: timesteps (f32 values) and `num_steps + 1`
/// sigmas ending in 0. `shift` overrides the config's.
pub fn schedule(
    cfg: &FlowMatchEulerConfig,
    num_steps: usize,
    shift: Option<f64>,
) -> anyhow::Result<(Vec<f64>, Vec<f32>)> {
    if num_steps == 0 {
        bail!("the number of inference steps must be at least 1");
    }
    // np.linspace(1.0, 0.0, N + 1)[:-1] in f64.
    let step = -1.0 / num_steps as f64;
    let sigmas: Vec<f64> = (0..num_steps).map(|i| i as f64 * step + 1.0).collect();
    schedule_of(cfg, &sigmas, shift)
}

/// The schedule of `sigmas` (the pipeline's own, or those its `sigmas=` argument gives):
/// `.astype(float32)`, shifted once statically in float32; timesteps and the sigmas with a
/// final 0. `shift` overrides the config's.
pub fn schedule_of(
    cfg: &FlowMatchEulerConfig,
    sigmas: &[f64],
    shift: Option<f64>,
) -> anyhow::Result<(Vec<f64>, Vec<f32>)> {
    cfg.validate()?;
    // The pipeline shifts its own sigmas once, statically.
    if cfg.use_dynamic_shifting {
        bail!("scheduler config: use_dynamic_shifting = true is not supported by HunyuanVideo's schedule");
    }
    if cfg.shift_terminal.is_some_and(|s| s != 0.0) {
        bail!("scheduler config: shift_terminal is not supported by HunyuanVideo's schedule");
    }
    if sigmas.is_empty() {
        bail!("the number of inference steps must be at least 1");
    }
    let shift = shift.unwrap_or(cfg.shift);
    if !(shift.is_finite() && shift > 0.0) {
        bail!("flow shift must be a positive number, got {shift}");
    }
    // numpy keeps float32 arrays float32 against Python floats.
    let (shift, shift_m1) = (shift as f32, (shift - 1.0) as f32);
    let mut sigmas: Vec<f32> = sigmas
        .iter()
        .map(|&s| {
            let s = s as f32;
            (shift * s) / (1.0 + shift_m1 * s)
        })
        .collect();
    let n = cfg.num_train_timesteps as f32;
    let timesteps = sigmas.iter().map(|&s| f64::from(s * n)).collect();
    sigmas.push(0.0);
    Ok((timesteps, sigmas))
}

/// The Euler sampler over [`schedule`], or over [`schedule_of`] the given `sigmas`.
pub fn sampler(
    cfg: &FlowMatchEulerConfig,
    num_steps: usize,
    shift: Option<f64>,
    sigmas: Option<&[f64]>,
) -> anyhow::Result<FlowMatchEuler> {
    let (timesteps, sigmas) = match sigmas {
        Some(sigmas) => schedule_of(cfg, sigmas, shift)?,
        None => schedule(cfg, num_steps, shift)?,
    };
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
