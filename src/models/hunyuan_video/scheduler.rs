//! The sampling schedule and guidance inputs of `HunyuanVideoPipeline` (diffusers 0.42.1).
//!
//! The pipeline passes its own sigmas, `linspace(1, 0, N + 1)[:-1]` (or its `sigmas=`
//! argument), to `FlowMatchEulerDiscreteScheduler.set_timesteps`, which shifts them once with the
//! static `shift` (7 for the published model) in float32: the shared flow-matching Euler
//! schedule and step ([`crate::schedulers::euler::FlowMatchEuler::with_sigmas`]).
//!
//! The model is guidance-distilled: `guidance_scale` is not classifier-free guidance but an
//! input, `guidance_scale · 1000` in the transformer dtype. Real CFG (`true_cfg_scale`) runs a
//! second forward with the negative prompt only when `true_cfg_scale > 1` and a negative prompt
//! is given.

use anyhow::bail;
use candle_core::{DType, Device, Result, Tensor};

use crate::schedulers::euler::FlowMatchEuler;
pub use crate::schedulers::euler::FlowMatchEulerConfig;
use crate::schedulers::Scheduler;

/// The pipeline's schedule for `num_steps` steps: timesteps (f32 values) and `num_steps + 1`
/// sigmas ending in 0. `shift` overrides the config's.
pub fn schedule(
    cfg: &FlowMatchEulerConfig,
    num_steps: usize,
    shift: Option<f64>,
) -> anyhow::Result<(Vec<f64>, Vec<f32>)> {
    let euler = sampler(cfg, num_steps, shift, None)?;
    Ok((euler.timesteps().to_vec(), euler.sigmas().to_vec()))
}

/// The Euler sampler of the pipeline's own sigmas for `num_steps` steps,
/// `np.linspace(1.0, 0.0, N + 1)[:-1]`, or of the `sigmas` its `sigmas=` argument gives: handed
/// to `set_timesteps(sigmas=...)`, which shifts them once statically (`shift` overrides the
/// config's).
pub fn sampler(
    cfg: &FlowMatchEulerConfig,
    num_steps: usize,
    shift: Option<f64>,
    sigmas: Option<&[f64]>,
) -> anyhow::Result<FlowMatchEuler> {
    if cfg.use_dynamic_shifting {
        bail!("scheduler config: use_dynamic_shifting = true is not supported by HunyuanVideo's schedule");
    }
    if cfg.shift_terminal.is_some_and(|s| s != 0.0) {
        bail!("scheduler config: shift_terminal is not supported by HunyuanVideo's schedule");
    }
    let shift = shift.unwrap_or(cfg.shift);
    if !(shift.is_finite() && shift > 0.0) {
        bail!("flow shift must be a positive number, got {shift}");
    }
    let own: Vec<f64>;
    let sigmas = match sigmas {
        Some(sigmas) => sigmas,
        None => {
            let step = -1.0 / num_steps as f64;
            own = (0..num_steps).map(|i| i as f64 * step + 1.0).collect();
            &own
        }
    };
    let cfg = FlowMatchEulerConfig {
        shift,
        ..cfg.clone()
    };
    FlowMatchEuler::with_sigmas(&cfg, sigmas, None)
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
