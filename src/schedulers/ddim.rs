//! diffusers' `DDIMScheduler` at `eta = 0` (deterministic: no draws), as `LattePipeline` runs it.
//!
//! The schedule is float32 as diffusers keeps it: `betas = torch.linspace(start, end, n,
//! dtype=float32)` (CPU formula), `alphas_cumprod = torch.cumprod(1 - betas)` (accumulated in
//! f64, each entry rounded to f32). A step's scalars (`√ᾱ_t`, `√(1 − ᾱ_t)`, `√ᾱ_prev`,
//! `√(1 − ᾱ_prev)`) are f32 0-dim tensors in diffusers, so they are taken in f32 here and the
//! tensor arithmetic runs in the latents' dtype in torch's order, with a true division by `√ᾱ_t`.

use anyhow::bail;
use candle_core::Tensor;
use serde::Deserialize;

/// `scheduler/scheduler_config.json` of a diffusers `DDIMScheduler`, with its defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct DdimConfig {
    /// Length of the training schedule.
    pub num_train_timesteps: usize,
    /// First beta of the schedule.
    pub beta_start: f64,
    /// Last beta of the schedule.
    pub beta_end: f64,
    /// `linear` (Latte) or `scaled_linear`.
    pub beta_schedule: String,
    /// Explicit betas (not supported).
    pub trained_betas: Option<Vec<f64>>,
    /// Clamp the x0 prediction to `±clip_sample_range`.
    pub clip_sample: bool,
    /// ᾱ past the end of the schedule (`prev_t < 0`): 1 when true, else `ᾱ[0]`.
    pub set_alpha_to_one: bool,
    /// Offset added to "leading" timesteps.
    pub steps_offset: i64,
    /// `epsilon` (Latte), `v_prediction` or `sample`.
    pub prediction_type: String,
    /// Dynamic thresholding of x0 (not supported).
    pub thresholding: bool,
    /// Used by thresholding only.
    pub dynamic_thresholding_ratio: f64,
    /// Bound of `clip_sample`.
    pub clip_sample_range: f64,
    /// Used by thresholding only.
    pub sample_max_value: f64,
    /// `leading` (Latte), `trailing` or `linspace`.
    pub timestep_spacing: String,
    /// Zero-terminal-SNR rescaling (not supported).
    pub rescale_betas_zero_snr: bool,
    /// The original Latte config's learned-sigma marker: diffusers' `LattePipeline` then keeps
    /// all 2C channels, which no DDIM step can take (refused; absent from the published file).
    pub variance_type: Option<String>,
}

impl Default for DdimConfig {
    fn default() -> Self {
        // The defaults of `DDIMScheduler.__init__`.
        Self {
            num_train_timesteps: 1000,
            beta_start: 0.0001,
            beta_end: 0.02,
            beta_schedule: "linear".into(),
            trained_betas: None,
            clip_sample: true,
            set_alpha_to_one: true,
            steps_offset: 0,
            prediction_type: "epsilon".into(),
            thresholding: false,
            dynamic_thresholding_ratio: 0.995,
            clip_sample_range: 1.0,
            sample_max_value: 1.0,
            timestep_spacing: "leading".into(),
            rescale_betas_zero_snr: false,
            variance_type: None,
        }
    }
}

impl DdimConfig {
    /// Rejects configurations this sampler cannot run, with the key at fault.
    pub fn validate(&self) -> anyhow::Result<()> {
        super::validate_training_schedule(
            self.num_train_timesteps,
            self.trained_betas.is_some(),
            (&self.beta_schedule, &["linear", "scaled_linear"]),
            (self.beta_start, self.beta_end),
            &self.timestep_spacing,
        )?;
        if !matches!(
            self.prediction_type.as_str(),
            "epsilon" | "v_prediction" | "sample"
        ) {
            bail!(
                "scheduler config: prediction_type {:?} is not supported",
                self.prediction_type
            );
        }
        if self.thresholding {
            bail!("scheduler config: thresholding is not supported");
        }
        if self.rescale_betas_zero_snr {
            bail!("scheduler config: rescale_betas_zero_snr is not supported");
        }
        if let Some(v) = self
            .variance_type
            .as_deref()
            .filter(|v| matches!(*v, "learned" | "learned_range"))
        {
            bail!("scheduler config: variance_type {v:?} (learned sigma) cannot drive a DDIM step; drop the key");
        }
        if !(self.clip_sample_range.is_finite() && self.clip_sample_range > 0.0) {
            bail!("scheduler config: clip_sample_range must be a positive number");
        }
        Ok(())
    }

    /// ᾱ for every training timestep (f32, as diffusers' `alphas_cumprod`).
    pub fn alphas_cumprod(&self) -> Vec<f32> {
        super::alphas_cumprod(
            &self.beta_schedule,
            self.beta_start,
            self.beta_end,
            self.num_train_timesteps,
        )
    }

    /// The integer timesteps of an `n`-step run (`set_timesteps`).
    pub fn timesteps(&self, n: usize) -> anyhow::Result<Vec<i64>> {
        let train = self.num_train_timesteps;
        let timesteps =
            super::discrete_timesteps(train, n, &self.timestep_spacing, self.steps_offset)?;
        if let Some(t) = timesteps.iter().find(|&&t| t < 0 || t >= train as i64) {
            bail!("scheduler config: timestep {t} falls outside the training schedule (check steps_offset)");
        }
        Ok(timesteps)
    }
}

/// The DDIM sampler (eta 0) with its schedule set for a number of steps.
#[derive(Debug, Clone)]
pub struct DdimScheduler {
    cfg: DdimConfig,
    alphas_cumprod: Vec<f32>,
    final_alpha_cumprod: f32,
    timesteps: Vec<i64>,
    num_steps: usize,
}

impl DdimScheduler {
    /// Builds the schedule for `num_steps` steps (`set_timesteps`).
    pub fn new(cfg: &DdimConfig, num_steps: usize) -> anyhow::Result<Self> {
        cfg.validate()?;
        let alphas_cumprod = cfg.alphas_cumprod();
        let final_alpha_cumprod = if cfg.set_alpha_to_one {
            1.0
        } else {
            alphas_cumprod[0]
        };
        Ok(Self {
            cfg: cfg.clone(),
            timesteps: cfg.timesteps(num_steps)?,
            alphas_cumprod,
            final_alpha_cumprod,
            num_steps,
        })
    }

    /// The timesteps, first to last.
    pub fn timesteps(&self) -> &[i64] {
        &self.timesteps
    }

    /// ᾱ of every training timestep.
    pub fn alphas_cumprod(&self) -> &[f32] {
        &self.alphas_cumprod
    }

    /// `scheduler.init_noise_sigma`: DDIM's initial noise is used as drawn.
    pub fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    /// One `step(model_output, t, sample, eta=0)`: the sample at the previous timestep
    /// `t − num_train_timesteps // num_steps`.
    pub fn step(&self, model_output: &Tensor, t: i64, sample: &Tensor) -> anyhow::Result<Tensor> {
        let train = self.cfg.num_train_timesteps as i64;
        if !(0..train).contains(&t) {
            bail!("DDIM: timestep {t} is outside the training schedule");
        }
        let prev_t = t - train / self.num_steps as i64;
        let alpha_t = self.alphas_cumprod[t as usize];
        let alpha_prev = if prev_t >= 0 {
            self.alphas_cumprod[prev_t as usize]
        } else {
            self.final_alpha_cumprod
        };
        let beta_t = 1.0f32 - alpha_t;
        let device = sample.device();
        let scalar = |v: f32| Tensor::new(v, device)?.to_dtype(sample.dtype());
        let (sqrt_alpha, sqrt_beta) = (alpha_t.sqrt(), beta_t.sqrt());
        let (x0, eps) = match self.cfg.prediction_type.as_str() {
            "epsilon" => (
                (sample - model_output.affine(f64::from(sqrt_beta), 0.0)?)?
                    .broadcast_div(&scalar(sqrt_alpha)?)?,
                model_output.clone(),
            ),
            "sample" => (
                model_output.clone(),
                (sample - model_output.affine(f64::from(sqrt_alpha), 0.0)?)?
                    .broadcast_div(&scalar(sqrt_beta)?)?,
            ),
            _ => (
                (sample.affine(f64::from(sqrt_alpha), 0.0)?
                    - model_output.affine(f64::from(sqrt_beta), 0.0)?)?,
                (model_output.affine(f64::from(sqrt_alpha), 0.0)?
                    + sample.affine(f64::from(sqrt_beta), 0.0)?)?,
            ),
        };
        let x0 = if self.cfg.clip_sample {
            let r = self.cfg.clip_sample_range;
            x0.clamp(-r, r)?
        } else {
            x0
        };
        // eta = 0: std_dev_t = 0, so the direction is √(1 − ᾱ_prev − 0)·ε.
        let direction = eps.affine(f64::from((1.0f32 - alpha_prev).sqrt()), 0.0)?;
        Ok((x0.affine(f64::from(alpha_prev.sqrt()), 0.0)? + direction)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_timesteps_follow_diffusers() {
        let cfg = DdimConfig::default();
        assert_eq!(cfg.timesteps(3).unwrap(), vec![666, 333, 0]);
        assert_eq!(cfg.timesteps(4).unwrap(), vec![750, 500, 250, 0]);
        assert!(cfg.timesteps(0).is_err());
        assert!(cfg.timesteps(1001).is_err());
    }

    #[test]
    fn learned_sigma_configs_are_refused() {
        let cfg = DdimConfig {
            variance_type: Some("learned_range".into()),
            ..DdimConfig::default()
        };
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("variance_type"));
    }
}
