//! diffusers' two CogVideoX samplers over one schedule (v-prediction, zero-terminal-SNR,
//! "trailing" timesteps): `CogVideoXDDIMScheduler`, which the CogVideoX-5b repo ships and
//! diffusers' pipeline runs as loaded, and `CogVideoXDPMScheduler`, the stochastic
//! DPM-Solver++(2M) SDE sampler its model card swaps in. [`CogVideoXSampler`] is the one a
//! checkpoint names.
//!
//! The schedule is computed in f64 as diffusers keeps it (its `alphas_cumprod` is a float64
//! tensor); the per-step multipliers are f64 scalars that multiply the f32 latents after rounding
//! to f32, as torch does for 0-dim tensors. The DPM sampler's random draws are inputs: diffusers
//! draws one `randn` per step, and a second one in the steps that apply the second-order
//! correction (only that second draw enters the result); [`CogVideoXSampler::draws_at`]
//! says how many the generator makes at a step, so a caller replaying a draws file consumes them
//! in order and hands the last to [`CogVideoXSampler::step`]. The DDIM sampler draws none.

use anyhow::bail;
use candle_core::Tensor;
use serde::Deserialize;
use std::path::Path;

/// `scheduler/scheduler_config.json` of a `CogVideoXDPMScheduler` or a `CogVideoXDDIMScheduler`
/// (the same keys and defaults).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct CogVideoXSchedulerConfig {
    /// The sampler: [`CogVideoXSampler::DDIM`] or [`CogVideoXSampler::DPM`] (diffusers' class).
    #[serde(rename = "_class_name")]
    pub class_name: String,
    /// Length of the training schedule.
    pub num_train_timesteps: usize,
    /// First beta of the schedule.
    pub beta_start: f64,
    /// Last beta of the schedule.
    pub beta_end: f64,
    /// Only `scaled_linear` (CogVideoX's).
    pub beta_schedule: String,
    /// Explicit betas (not supported).
    pub trained_betas: Option<Vec<f64>>,
    /// Clipping of x0 (neither of diffusers' steps clips; accepted and ignored like diffusers).
    pub clip_sample: bool,
    /// ᾱ used past the end of the schedule (`prev_t < 0`): 1 when true, else `ᾱ[0]`.
    pub set_alpha_to_one: bool,
    /// Offset added to "leading" timesteps.
    pub steps_offset: i64,
    /// `v_prediction` (CogVideoX), `epsilon` or `sample`.
    pub prediction_type: String,
    /// Ignored by both steps (as in diffusers).
    pub clip_sample_range: f64,
    /// Ignored by both steps (as in diffusers).
    pub sample_max_value: f64,
    /// `trailing` (CogVideoX), `leading` or `linspace`.
    pub timestep_spacing: String,
    /// Rescale the schedule to zero terminal SNR.
    pub rescale_betas_zero_snr: bool,
    /// ᾱ ← ᾱ / (s + (1 − s)·ᾱ) (1.0 for CogVideoX-5b, 3.0 by default).
    pub snr_shift_scale: f64,
}

impl Default for CogVideoXSchedulerConfig {
    fn default() -> Self {
        // The defaults of both samplers' `__init__`.
        Self {
            class_name: String::new(),
            num_train_timesteps: 1000,
            beta_start: 0.00085,
            beta_end: 0.012,
            beta_schedule: "scaled_linear".into(),
            trained_betas: None,
            clip_sample: true,
            set_alpha_to_one: true,
            steps_offset: 0,
            prediction_type: "epsilon".into(),
            clip_sample_range: 1.0,
            sample_max_value: 1.0,
            timestep_spacing: "leading".into(),
            rescale_betas_zero_snr: false,
            snr_shift_scale: 3.0,
        }
    }
}

impl CogVideoXSchedulerConfig {
    /// Reads a `scheduler_config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> anyhow::Result<Self> {
        super::read_config(path.as_ref())
    }

    /// Rejects configurations this sampler cannot run, with the key at fault.
    pub fn validate(&self) -> anyhow::Result<()> {
        if ![CogVideoXSampler::DDIM, CogVideoXSampler::DPM].contains(&self.class_name.as_str()) {
            bail!(
                "scheduler config: _class_name {:?} cannot sample CogVideoX: use {} or {}",
                self.class_name,
                CogVideoXSampler::DDIM,
                CogVideoXSampler::DPM
            );
        }
        super::validate_training_schedule(
            self.num_train_timesteps,
            self.trained_betas.is_some(),
            (&self.beta_schedule, &["scaled_linear"]),
            (self.beta_start, self.beta_end),
            &self.timestep_spacing,
        )?;
        if !matches!(
            self.prediction_type.as_str(),
            "v_prediction" | "epsilon" | "sample"
        ) {
            bail!(
                "scheduler config: prediction_type {:?} is not supported",
                self.prediction_type
            );
        }
        if !self.snr_shift_scale.is_finite() || self.snr_shift_scale <= 0.0 {
            bail!("scheduler config: snr_shift_scale must be a positive number");
        }
        Ok(())
    }

    /// ᾱ for every training timestep, as diffusers' `__init__` computes it for `scaled_linear`
    /// (in float64), SNR-shifted and optionally rescaled to zero terminal SNR.
    pub fn alphas_cumprod(&self) -> Vec<f64> {
        let betas = torch_linspace(
            self.beta_start.sqrt(),
            self.beta_end.sqrt(),
            self.num_train_timesteps,
        )
        .into_iter()
        .map(|b| b * b);
        let s = self.snr_shift_scale;
        let mut acc = 1.0f64;
        let mut cumprod: Vec<f64> = betas
            .map(|b| {
                acc *= 1.0 - b;
                acc / (s + (1.0 - s) * acc)
            })
            .collect();
        if self.rescale_betas_zero_snr {
            rescale_zero_terminal_snr(&mut cumprod);
        }
        cumprod
    }

    /// The integer timesteps of an `n`-step run (`set_timesteps`).
    pub fn timesteps(&self, n: usize) -> anyhow::Result<Vec<i64>> {
        super::discrete_timesteps(
            self.num_train_timesteps,
            n,
            &self.timestep_spacing,
            self.steps_offset,
        )
    }
}

/// `torch.linspace(start, end, n, dtype=float64)` (CPU formula: from the start for the first
/// half, from the end for the second).
fn torch_linspace(start: f64, end: f64, n: usize) -> Vec<f64> {
    if n <= 1 {
        return vec![start; n];
    }
    let step = (end - start) / (n - 1) as f64;
    let half = n / 2;
    (0..n)
        .map(|i| {
            if i < half {
                start + step * i as f64
            } else {
                end - step * (n - 1 - i) as f64
            }
        })
        .collect()
}

/// diffusers' `rescale_zero_terminal_snr` on ᾱ (Algorithm 1 of "Common Diffusion Noise
/// Schedules and Sample Steps are Flawed"): the last ᾱ becomes exactly 0.
fn rescale_zero_terminal_snr(alphas_cumprod: &mut [f64]) {
    let (Some(&first), Some(&last)) = (alphas_cumprod.first(), alphas_cumprod.last()) else {
        return;
    };
    let (sqrt_0, sqrt_t) = (first.sqrt(), last.sqrt());
    let factor = sqrt_0 / (sqrt_0 - sqrt_t);
    for a in alphas_cumprod.iter_mut() {
        let s = (a.sqrt() - sqrt_t) * factor;
        *a = s * s;
    }
}

/// `λ = log √(ᾱ / (1 − ᾱ))` (−∞ at ᾱ = 0, as in torch).
fn lambda(alpha_cumprod: f64) -> f64 {
    (alpha_cumprod / (1.0 - alpha_cumprod)).sqrt().ln()
}

/// `a·x + b·y` with f64 scalars rounded to f32 and the arithmetic in the tensors' dtype, in
/// torch's order (`a * x`, `b * y`, then the sum).
fn lin2(a: f64, x: &Tensor, b: f64, y: &Tensor) -> candle_core::Result<Tensor> {
    let ax = x.affine(f64::from(a as f32), 0.0)?;
    let by = y.affine(f64::from(b as f32), 0.0)?;
    ax + by
}

/// The schedule both samplers step through, set for a number of steps (`set_timesteps`).
#[derive(Debug, Clone)]
struct Schedule {
    prediction_type: String,
    alphas_cumprod: Vec<f64>,
    final_alpha_cumprod: f64,
    timesteps: Vec<i64>,
    /// `num_train_timesteps // N`: how far back each step's `prev_t` lies.
    step_ratio: i64,
}

impl Schedule {
    fn new(cfg: &CogVideoXSchedulerConfig, num_steps: usize) -> anyhow::Result<Self> {
        cfg.validate()?;
        let alphas_cumprod = cfg.alphas_cumprod();
        let final_alpha_cumprod = if cfg.set_alpha_to_one {
            1.0
        } else {
            alphas_cumprod[0]
        };
        let timesteps = cfg.timesteps(num_steps)?;
        let train = cfg.num_train_timesteps as i64;
        if let Some(t) = timesteps.iter().find(|&&t| t < 0 || t >= train) {
            bail!("scheduler config: timestep {t} falls outside the training schedule (check steps_offset)");
        }
        Ok(Self {
            prediction_type: cfg.prediction_type.clone(),
            alphas_cumprod,
            final_alpha_cumprod,
            step_ratio: (cfg.num_train_timesteps / timesteps.len()) as i64,
            timesteps,
        })
    }

    /// `prev_t` of step `i`: `t − num_train_timesteps // N` (not the next list entry).
    fn prev_timestep(&self, i: usize) -> i64 {
        self.timesteps[i] - self.step_ratio
    }

    /// ᾱ at `t`, or the final ᾱ for `t < 0`.
    fn alpha_at(&self, t: i64) -> f64 {
        if t < 0 {
            self.final_alpha_cumprod
        } else {
            self.alphas_cumprod[t as usize]
        }
    }

    /// x0 predicted from the model output at a timestep of ᾱ = `alpha_t`.
    fn pred_original(
        &self,
        alpha_t: f64,
        model_output: &Tensor,
        sample: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let beta_t = 1.0 - alpha_t;
        match self.prediction_type.as_str() {
            "v_prediction" => lin2(alpha_t.sqrt(), sample, -beta_t.sqrt(), model_output),
            "epsilon" => {
                let scaled = model_output.affine(f64::from(beta_t.sqrt() as f32), 0.0)?;
                let divisor = Tensor::new(alpha_t.sqrt() as f32, sample.device())?
                    .to_dtype(sample.dtype())?;
                (sample - scaled)?.broadcast_div(&divisor)
            }
            _ => Ok(model_output.clone()),
        }
    }
}

/// The sampler a CogVideoX checkpoint names (`model_index.json`'s scheduler class), with its
/// schedule set for a number of steps. Call [`Self::step`] once per timestep, in order.
#[derive(Debug, Clone)]
pub struct CogVideoXSampler {
    schedule: Schedule,
    /// Whether it is the DPM sampler (else DDIM).
    dpm: bool,
    step_index: usize,
    /// x0 of the previous step (the DPM sampler's second-order history).
    old_pred_original_sample: Option<Tensor>,
}

impl CogVideoXSampler {
    /// diffusers' class name of the DPM sampler.
    pub const DPM: &'static str = "CogVideoXDPMScheduler";
    /// diffusers' class name of the DDIM sampler.
    pub const DDIM: &'static str = "CogVideoXDDIMScheduler";

    /// The sampler the config names (`_class_name`) for `num_steps` steps (`set_timesteps`).
    pub fn new(cfg: &CogVideoXSchedulerConfig, num_steps: usize) -> anyhow::Result<Self> {
        Ok(Self {
            schedule: Schedule::new(cfg, num_steps)?,
            dpm: cfg.class_name == Self::DPM,
            step_index: 0,
            old_pred_original_sample: None,
        })
    }

    /// diffusers' class name of this sampler.
    pub fn class(&self) -> &'static str {
        match self.dpm {
            true => Self::DPM,
            false => Self::DDIM,
        }
    }

    /// The timesteps handed to the transformer, one per step (int64 in diffusers).
    pub fn timesteps(&self) -> &[i64] {
        &self.schedule.timesteps
    }

    /// ᾱ of every training timestep (f64, as diffusers keeps it).
    pub fn alphas_cumprod(&self) -> &[f64] {
        &self.schedule.alphas_cumprod
    }

    /// The initial noise is used as drawn (diffusers' `init_noise_sigma`).
    pub fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    /// Steps already taken.
    pub fn step_index(&self) -> usize {
        self.step_index
    }

    /// How many `randn` draws diffusers' step `i` makes from the pipeline generator. DPM: 2
    /// when it applies the second-order correction (a previous x0 exists and `prev_t ≥ 0`),
    /// else 1, of which only the last enters the result. DDIM: none.
    pub fn draws_at(&self, i: usize) -> usize {
        match self.dpm {
            false => 0,
            true if i > 0
                && i < self.schedule.timesteps.len()
                && self.schedule.prev_timestep(i) >= 0 =>
            {
                2
            }
            true => 1,
        }
    }

    /// x0 predicted by the last step (diffusers' second return value).
    pub fn pred_original_sample(&self) -> Option<&Tensor> {
        self.old_pred_original_sample.as_ref()
    }

    /// Advances `sample` by one step given the model output at the current timestep and, for
    /// the DPM sampler, the step's noise (the last of its [`Self::draws_at`] draws, shaped like
    /// `sample`).
    pub fn step(
        &mut self,
        model_output: &Tensor,
        sample: &Tensor,
        noise: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let i = self.step_index;
        let s = &self.schedule;
        let steps = s.timesteps.len();
        if i >= steps {
            candle_core::bail!("CogVideoX: all {steps} steps of the schedule were already taken");
        }
        if model_output.dims() != sample.dims() || noise.is_some_and(|n| n.dims() != sample.dims())
        {
            candle_core::bail!(
                "CogVideoX: model output {:?}, sample {:?} and noise {:?} differ in shape",
                model_output.dims(),
                sample.dims(),
                noise.map(Tensor::dims)
            );
        }
        let t = s.timesteps[i];
        let prev_t = s.prev_timestep(i);
        let alpha_t = s.alpha_at(t);
        let alpha_prev = s.alpha_at(prev_t);
        let pred_original = s.pred_original(alpha_t, model_output, sample)?;
        let prev_sample = if self.dpm {
            let Some(noise) = noise else {
                candle_core::bail!("CogVideoX DPM: step {i} needs its noise draw")
            };
            let lamb = lambda(alpha_t);
            let h = lambda(alpha_prev) - lamb;
            let mult1 = ((1.0 - alpha_prev) / (1.0 - alpha_t)).sqrt() * (-h).exp();
            let mult2 = (-2.0 * h).exp_m1() * alpha_prev.sqrt();
            let mult_noise = (1.0 - alpha_prev).sqrt() * (1.0 - (-2.0 * h).exp()).sqrt();
            let denoised = match &self.old_pred_original_sample {
                Some(old) if prev_t >= 0 && i > 0 => {
                    let h_last = lamb - lambda(s.alpha_at(s.timesteps[i - 1]));
                    let r = h_last / h;
                    let mult3 = 1.0 + 1.0 / (2.0 * r);
                    let mult4 = 1.0 / (2.0 * r);
                    lin2(mult3, &pred_original, -mult4, old)?
                }
                _ => pred_original.clone(),
            };
            (lin2(mult1, sample, -mult2, &denoised)?
                + noise.affine(f64::from(mult_noise as f32), 0.0)?)?
        } else {
            // DDIM at eta 0: x_prev = a·x + b·x0 with a = √((1 − ᾱ_prev)/(1 − ᾱ_t)),
            // b = √ᾱ_prev − √ᾱ_t·a (0-dim f64 tensors in diffusers).
            let a = ((1.0 - alpha_prev) / (1.0 - alpha_t)).sqrt();
            let b = alpha_prev.sqrt() - alpha_t.sqrt() * a;
            lin2(a, sample, b, &pred_original)?
        };
        self.old_pred_original_sample = Some(pred_original);
        self.step_index += 1;
        Ok(prev_sample)
    }
}
