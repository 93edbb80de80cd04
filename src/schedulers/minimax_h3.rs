//! MiniMax H3's rectified-flow Euler schedule (diffusers `MiniMaxH3Scheduler`), as pure
//! functions. A request runs two of them, one per modality (`scheduler/` shift 12 for video,
//! `audio_scheduler/` shift 3 for audio), through the same transformer forward.
//!
//! Conventions that differ from the usual flow matching: timesteps are *clean time*
//! `t = 1 - sigma` in [0, 1] (0 is pure noise), the model's velocity points towards the data
//! (`x0 = x + (1 - t) v`), and `num_inference_steps` counts sigma points including the terminal
//! 0, so N points drive N - 1 forwards. All arithmetic is f32, as torch does it.

use candle_core::{Result, Tensor};
use serde::Deserialize;

/// `scheduler_config.json` of a `MiniMaxH3Scheduler`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct MiniMaxH3SchedulerConfig {
    /// Exponential shift of the sigma grid: `shift*s / (1 + (shift-1)*s)`.
    pub shift: f64,
}

impl Default for MiniMaxH3SchedulerConfig {
    fn default() -> Self {
        Self { shift: 12.0 }
    }
}

impl MiniMaxH3SchedulerConfig {
    /// Rejects a shift the schedule cannot use (diffusers raises for shift <= 0).
    pub fn validate(&self) -> Result<()> {
        if !(self.shift.is_finite() && self.shift > 0.0) {
            candle_core::bail!(
                "scheduler config: shift must be a positive number, got {}",
                self.shift
            );
        }
        Ok(())
    }
}

/// `torch.linspace(start, end, steps)` in f32 as ATen's CPU kernel rounds it: an f32 step, the
/// first half `start + step * i` and the second half `end - step * (steps - 1 - i)`, each as one
/// fused multiply-add (a single rounding; checked bit for bit against torch's grids).
fn torch_linspace_f32(start: f32, end: f32, steps: usize) -> Vec<f32> {
    if steps == 1 {
        return vec![start];
    }
    let step = (end - start) / (steps - 1) as f32;
    let halfway = steps / 2;
    (0..steps)
        .map(|i| {
            if i < halfway {
                step.mul_add(i as f32, start)
            } else {
                (-step).mul_add((steps - 1 - i) as f32, end)
            }
        })
        .collect()
}

/// The sigma grid of `set_timesteps(num_points)`: `linspace(1, 0, num_points)` shifted, with
/// consecutive duplicates collapsed; starts at 1 and ends at exactly 0.
pub fn sigmas(shift: f64, num_points: usize) -> Result<Vec<f32>> {
    MiniMaxH3SchedulerConfig { shift }.validate()?;
    if num_points < 2 {
        candle_core::bail!("num_inference_steps must be at least 2 (it counts the terminal sigma 0), got {num_points}");
    }
    let shift = shift as f32;
    let mut out: Vec<f32> = Vec::with_capacity(num_points);
    for b in torch_linspace_f32(1.0, 0.0, num_points) {
        let sigma = shift * b / (1.0 + (shift - 1.0) * b);
        if out.last() != Some(&sigma) {
            out.push(sigma);
        }
    }
    Ok(out)
}

/// Clean-time timesteps `1 - sigma` of every sigma but the terminal one (one per forward).
pub fn timesteps(sigmas: &[f32]) -> Vec<f32> {
    let n = sigmas.len().saturating_sub(1);
    sigmas[..n].iter().map(|s| 1.0 - s).collect()
}

/// One Euler step from `sigma` to `sigma_next` at clean time `timestep`:
/// `x0 = x + (1 - t) v`, `x' = r x + (1 - r) x0` with `r = sigma_next / sigma` (f32 scalars).
pub fn step(
    model_output: &Tensor,
    timestep: f32,
    sample: &Tensor,
    sigma: f32,
    sigma_next: f32,
) -> Result<Tensor> {
    if sigma == 0.0 {
        candle_core::bail!("cannot step from the terminal sigma 0");
    }
    let denoised = (sample + model_output.affine((1.0 - timestep) as f64, 0.0)?)?;
    let ratio = sigma_next / sigma;
    sample.affine(ratio as f64, 0.0)? + denoised.affine((1.0 - ratio) as f64, 0.0)?
}

/// A schedule built once per request, stepped by index.
#[derive(Debug, Clone, PartialEq)]
pub struct MiniMaxH3Schedule {
    /// Sigma points, terminal 0 included.
    pub sigmas: Vec<f32>,
    /// Clean-time timesteps, one per forward (`sigmas.len() - 1`).
    pub timesteps: Vec<f32>,
}

impl MiniMaxH3Schedule {
    /// `set_timesteps(num_points)` of a scheduler with this config.
    pub fn new(cfg: &MiniMaxH3SchedulerConfig, num_points: usize) -> Result<Self> {
        let sigmas = sigmas(cfg.shift, num_points)?;
        let timesteps = timesteps(&sigmas);
        Ok(Self { sigmas, timesteps })
    }

    /// The sample after forward `index` predicted `model_output` for `sample`.
    pub fn step(&self, index: usize, model_output: &Tensor, sample: &Tensor) -> Result<Tensor> {
        let Some(&timestep) = self.timesteps.get(index) else {
            candle_core::bail!(
                "step {index} is past the last of {} steps",
                self.timesteps.len()
            );
        };
        step(
            model_output,
            timestep,
            sample,
            self.sigmas[index],
            self.sigmas[index + 1],
        )
    }
}

/// The per-row timestep table of one packed forward: the sorted distinct values of the video
/// and audio timesteps (`torch.unique`) and the index of each in it, `(values, video, audio)`.
/// Text rows take the video index.
pub fn distinct_timesteps(video: f32, audio: f32) -> (Vec<f32>, usize, usize) {
    if video == audio {
        (vec![video], 0, 0)
    } else if video < audio {
        (vec![video, audio], 0, 1)
    } else {
        (vec![audio, video], 1, 0)
    }
}
