//! Flow-matching Euler sampler (diffusers' `FlowMatchEulerDiscreteScheduler`):
//! x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v. Two schedules: a fixed shift, as Wan runs it
//! ([`FlowMatchEuler::new`]), and LTX-Video's custom sigmas shifted by `mu`, which the pipeline
//! derives from the video's sequence length ([`FlowMatchEuler::for_sequence_length`]).

use super::{np_linspace, scale, Scheduler, SchedulerConfig};
use anyhow::bail;
use candle_core::{DType, Result, Tensor};
use serde::Deserialize;
use std::path::Path;

/// `scheduler/scheduler_config.json` of a diffusers `FlowMatchEulerDiscreteScheduler`, with
/// the class defaults for missing keys.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct FlowMatchEulerConfig {
    /// Length of the training schedule; timesteps are `sigma * num_train_timesteps`.
    pub num_train_timesteps: usize,
    /// Fixed shift `shift*s / (1 + (shift-1)*s)`, used without dynamic shifting.
    pub shift: f64,
    /// Shift by `mu` (resolution-dependent) instead of by `shift`.
    pub use_dynamic_shifting: bool,
    /// `mu` at `base_image_seq_len` tokens.
    pub base_shift: f64,
    /// `mu` at `max_image_seq_len` tokens.
    pub max_shift: f64,
    /// Sequence length of `base_shift`.
    pub base_image_seq_len: usize,
    /// Sequence length of `max_shift`.
    pub max_image_seq_len: usize,
    /// `exponential`: e^mu / (e^mu + 1/s - 1); `linear`: mu / (mu + 1/s - 1).
    pub time_shift_type: String,
    /// Stretch the schedule so its last sigma is this value (LTX-Video: 0.1).
    pub shift_terminal: Option<f64>,
    /// Hand the model `1 - sigma` (Mochi): sigmas and timesteps inverted, a final 1 appended.
    pub invert_sigmas: bool,
    /// Stochastic re-noising steps (not supported).
    pub stochastic_sampling: bool,
    /// Karras sigmas (not supported).
    pub use_karras_sigmas: bool,
    /// Exponential sigmas (not supported).
    pub use_exponential_sigmas: bool,
    /// Beta sigmas (not supported).
    pub use_beta_sigmas: bool,
}

impl Default for FlowMatchEulerConfig {
    fn default() -> Self {
        // The defaults of `FlowMatchEulerDiscreteScheduler.__init__`.
        Self {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: false,
            base_shift: 0.5,
            max_shift: 1.15,
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
            time_shift_type: "exponential".into(),
            shift_terminal: None,
            invert_sigmas: false,
            stochastic_sampling: false,
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
        }
    }
}

impl FlowMatchEulerConfig {
    /// Reads a `scheduler_config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> anyhow::Result<Self> {
        let cfg: Self = super::read_config(path.as_ref())?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Rejects settings this sampler does not reproduce, naming the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.num_train_timesteps == 0 {
            bail!("scheduler config: num_train_timesteps must be positive");
        }
        if !(self.shift.is_finite() && self.shift > 0.0) {
            bail!(
                "scheduler config: shift must be a positive number, got {}",
                self.shift
            );
        }
        if self.base_image_seq_len == self.max_image_seq_len {
            bail!("scheduler config: max_image_seq_len must differ from base_image_seq_len");
        }
        if !matches!(self.time_shift_type.as_str(), "exponential" | "linear") {
            bail!(
                "scheduler config: time_shift_type {:?} is not \"exponential\" or \"linear\"",
                self.time_shift_type
            );
        }
        if self
            .shift_terminal
            .is_some_and(|t| !(t.is_finite() && t < 1.0))
        {
            bail!("scheduler config: shift_terminal must be below 1");
        }
        for (key, on) in [
            ("stochastic_sampling", self.stochastic_sampling),
            ("use_karras_sigmas", self.use_karras_sigmas),
            ("use_exponential_sigmas", self.use_exponential_sigmas),
            ("use_beta_sigmas", self.use_beta_sigmas),
        ] {
            if on {
                bail!("scheduler config: {key} = true is not supported");
            }
        }
        Ok(())
    }

    /// The pipelines' `calculate_shift`: `mu` linear in the sequence length, through
    /// (`base_image_seq_len`, `base_shift`) and (`max_image_seq_len`, `max_shift`), in f64.
    pub fn mu(&self, sequence_length: usize) -> f64 {
        let m = (self.max_shift - self.base_shift)
            / (self.max_image_seq_len as f64 - self.base_image_seq_len as f64);
        let b = self.base_shift - m * self.base_image_seq_len as f64;
        sequence_length as f64 * m + b
    }
}

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
    /// LTX-Video's schedule: `set_timesteps(sigmas=linspace(1, 1/N, N), mu)` with `mu` from
    /// the video's sequence length (latent frames x height x width tokens) when the config
    /// shifts dynamically.
    pub fn for_sequence_length(
        cfg: &FlowMatchEulerConfig,
        num_steps: usize,
        sequence_length: usize,
    ) -> anyhow::Result<Self> {
        if num_steps == 0 {
            bail!("the number of inference steps must be at least 1");
        }
        let sigmas = np_linspace(1.0, 1.0 / num_steps as f64, num_steps);
        let mu = cfg.use_dynamic_shifting.then(|| cfg.mu(sequence_length));
        Self::with_sigmas(cfg, &sigmas, mu)
    }

    /// `set_timesteps(sigmas=..., mu=...)`: the given sigmas as f32, shifted (by `mu` with
    /// dynamic shifting, else by `shift`) and stretched to `shift_terminal`, all in f32 as numpy
    /// computes them; with `invert_sigmas` each becomes `1 - sigma`; `timesteps = sigmas *
    /// num_train_timesteps`; a final sigma appended (0, or 1 when inverted).
    pub fn with_sigmas(
        cfg: &FlowMatchEulerConfig,
        sigmas: &[f64],
        mu: Option<f64>,
    ) -> anyhow::Result<Self> {
        cfg.validate()?;
        if sigmas.is_empty() {
            bail!("the number of inference steps must be at least 1");
        }
        let sigmas32 = sigmas.iter().map(|&s| s as f32);
        let mut shifted: Vec<f32> = if cfg.use_dynamic_shifting {
            let Some(mu) = mu.filter(|m| m.is_finite()) else {
                bail!("use_dynamic_shifting needs a finite mu (from the sequence length)");
            };
            match cfg.time_shift_type.as_str() {
                "exponential" => {
                    let e = mu.exp() as f32;
                    sigmas32.map(|t| e / (e + (1.0 / t - 1.0))).collect()
                }
                _ => {
                    let m = mu as f32;
                    sigmas32.map(|t| m / (m + (1.0 / t - 1.0))).collect()
                }
            }
        } else {
            // numpy: `shift` and `shift - 1` are Python floats, each rounded to f32 once.
            let (shift, shift_m1) = (cfg.shift as f32, (cfg.shift - 1.0) as f32);
            sigmas32.map(|s| shift * s / (1.0 + shift_m1 * s)).collect()
        };
        if let Some(terminal) = cfg.shift_terminal.filter(|&t| t != 0.0) {
            // stretch_shift_to_terminal: 1 - (1 - s) / ((1 - s_last) / (1 - terminal)).
            let last = 1.0 - shifted[shifted.len() - 1];
            let scale_factor = last / (1.0 - terminal) as f32;
            if scale_factor == 0.0 || !scale_factor.is_finite() {
                bail!(
                    "the schedule ends at sigma 1, so shift_terminal cannot stretch it: use more steps"
                );
            }
            for s in &mut shifted {
                *s = 1.0 - (1.0 - *s) / scale_factor;
            }
        }
        let n_train = cfg.num_train_timesteps as f32;
        if cfg.invert_sigmas {
            for s in &mut shifted {
                *s = 1.0 - *s;
            }
        }
        let timesteps = shifted.iter().map(|&s| f64::from(s * n_train)).collect();
        shifted.push(if cfg.invert_sigmas { 1.0 } else { 0.0 });
        Ok(Self {
            timesteps,
            sigmas: shifted,
            step_index: 0,
        })
    }

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
