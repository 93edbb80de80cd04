//! Flow-matching Euler sampler, as diffusers' `FlowMatchEulerDiscreteScheduler(num_train_timesteps,
//! shift)` would run Wan: x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v.

use super::{np_linspace, scale, Scheduler, SchedulerConfig};
use candle_core::{DType, Result, Tensor};

/// Euler state: the schedule and the index of the next step.
#[derive(Debug)]
pub struct FlowMatchEuler {
    timesteps: Vec<f64>,
    sigmas: Vec<f32>,
    step_index: usize,
}

impl FlowMatchEuler {
    /// The schedule of `set_timesteps(num_steps)` for a scheduler constructed with `shift`.
    ///
    /// Like diffusers, the shift is applied twice to the end point: the constructor's shifted
    /// training schedule gives `sigma_min`, and `set_timesteps` shifts the linspace between
    /// `sigma_max` and that `sigma_min` again.
    pub fn new(cfg: &SchedulerConfig, num_steps: usize, shift: f64) -> anyhow::Result<Self> {
        cfg.check_flow_model()?;
        if num_steps == 0 {
            anyhow::bail!("the number of inference steps must be at least 1");
        }
        let n_train = cfg.num_train_timesteps;
        // Constructor: timesteps 1000..1 as f32, sigmas = t / n (f32), shifted in f32.
        let shift32 = shift as f32;
        let shifted32 = |t: f32| {
            let s = t / n_train as f32;
            shift32 * s / (1.0 + (shift - 1.0) as f32 * s)
        };
        let sigma_max = f64::from(shifted32(n_train as f32));
        let sigma_min = f64::from(shifted32(1.0));
        // set_timesteps: linspace of timesteps in f64, shifted again in f64, stored as f32.
        let n = n_train as f64;
        let sigmas: Vec<f32> = np_linspace(sigma_max * n, sigma_min * n, num_steps)
            .into_iter()
            .map(|t| {
                let s = t / n;
                (shift * s / (1.0 + (shift - 1.0) * s)) as f32
            })
            .chain(std::iter::once(0.0))
            .collect();
        let timesteps = sigmas[..num_steps]
            .iter()
            .map(|&s| f64::from(s * n_train as f32))
            .collect();
        Ok(Self {
            timesteps,
            sigmas,
            step_index: 0,
        })
    }
}

impl FlowMatchEuler {
    /// A sampler over a schedule computed elsewhere (e.g. a pipeline that passes its own
    /// `sigmas` to `set_timesteps`): one timestep per step and `steps + 1` sigmas.
    pub fn with_schedule(timesteps: Vec<f64>, sigmas: Vec<f32>) -> anyhow::Result<Self> {
        if timesteps.is_empty() || sigmas.len() != timesteps.len() + 1 {
            anyhow::bail!(
                "a schedule of {} timesteps needs {} sigmas, got {}",
                timesteps.len(),
                timesteps.len() + 1,
                sigmas.len()
            );
        }
        Ok(Self {
            timesteps,
            sigmas,
            step_index: 0,
        })
    }
}

impl Scheduler for FlowMatchEuler {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    /// The sample is upcast to f32, `dt * v` is formed in the model dtype, and the result is cast
    /// back to the model dtype, exactly as diffusers does.
    fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor> {
        let i = self.step_index;
        super::check_step("Euler", i, self.timesteps.len())?;
        let dt = self.sigmas[i + 1] - self.sigmas[i];
        let sample = sample.to_dtype(DType::F32)?;
        let update = scale(model_output, dt)?.to_dtype(DType::F32)?;
        let prev = sample.add(&update)?.to_dtype(model_output.dtype())?;
        self.step_index += 1;
        Ok(prev)
    }
}
