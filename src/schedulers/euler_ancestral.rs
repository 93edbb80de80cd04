//! diffusers' `EulerAncestralDiscreteScheduler`, as `AllegroPipeline` samples with it: an Euler
//! step on the ε-prediction to `σ_down` plus fresh noise scaled by `σ_up`, one draw per step.
//!
//! The schedule is float32 as diffusers keeps it: ᾱ as the DDIM scheduler computes it
//! ([`super::alphas_cumprod`]), `σ = √((1 − ᾱ)/ᾱ)` in f32, interpolated linearly (numpy's
//! `interp`, f64) at the run's float timesteps and stored as f32 with a final 0. A step's
//! scalars are f32 0-dim tensors in diffusers, so they are computed in f32 here.

use anyhow::bail;
use candle_core::{DType, Tensor};
use serde::Deserialize;

/// `scheduler/scheduler_config.json` of an `EulerAncestralDiscreteScheduler`, with its defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct EulerAncestralConfig {
    /// Length of the training schedule.
    pub num_train_timesteps: usize,
    /// First beta of the schedule.
    pub beta_start: f64,
    /// Last beta of the schedule.
    pub beta_end: f64,
    /// `linear` (Allegro) or `scaled_linear`.
    pub beta_schedule: String,
    /// Explicit betas (not supported).
    pub trained_betas: Option<Vec<f64>>,
    /// Only `epsilon` (Allegro's).
    pub prediction_type: String,
    /// `linspace` (Allegro), `leading` or `trailing`.
    pub timestep_spacing: String,
    /// Offset added to "leading" timesteps.
    pub steps_offset: i64,
    /// Zero-terminal-SNR rescaling (not supported).
    pub rescale_betas_zero_snr: bool,
}

impl Default for EulerAncestralConfig {
    fn default() -> Self {
        // The defaults of `EulerAncestralDiscreteScheduler.__init__`.
        Self {
            num_train_timesteps: 1000,
            beta_start: 0.0001,
            beta_end: 0.02,
            beta_schedule: "linear".into(),
            trained_betas: None,
            prediction_type: "epsilon".into(),
            timestep_spacing: "linspace".into(),
            steps_offset: 0,
            rescale_betas_zero_snr: false,
        }
    }
}

impl EulerAncestralConfig {
    /// Rejects configurations this sampler cannot run, with the key at fault.
    pub fn validate(&self) -> anyhow::Result<()> {
        super::validate_training_schedule(
            self.num_train_timesteps,
            self.trained_betas.is_some(),
            (&self.beta_schedule, &["linear", "scaled_linear"]),
            (self.beta_start, self.beta_end),
            &self.timestep_spacing,
        )?;
        if self.prediction_type != "epsilon" {
            bail!(
                "scheduler config: prediction_type {:?} is not supported (only \"epsilon\")",
                self.prediction_type
            );
        }
        if self.rescale_betas_zero_snr {
            bail!("scheduler config: rescale_betas_zero_snr is not supported");
        }
        Ok(())
    }

    /// ᾱ for every training timestep.
    pub fn alphas_cumprod(&self) -> Vec<f32> {
        super::alphas_cumprod(
            &self.beta_schedule,
            self.beta_start,
            self.beta_end,
            self.num_train_timesteps,
        )
    }

    /// The float timesteps of an `n`-step run (`set_timesteps`), first to last.
    pub fn timesteps(&self, n: usize) -> anyhow::Result<Vec<f32>> {
        let train = self.num_train_timesteps;
        if self.timestep_spacing == "linspace" {
            if n == 0 || n > train {
                bail!("the number of inference steps must be between 1 and num_train_timesteps ({train}), got {n}");
            }
            return Ok(super::np_linspace(0.0, (train - 1) as f64, n)
                .into_iter()
                .rev()
                .map(|t| t as f32)
                .collect());
        }
        let timesteps =
            super::discrete_timesteps(train, n, &self.timestep_spacing, self.steps_offset)?;
        if let Some(t) = timesteps.iter().find(|&&t| t < 0 || t >= train as i64) {
            bail!("scheduler config: timestep {t} falls outside the training schedule (check steps_offset)");
        }
        Ok(timesteps.into_iter().map(|t| t as f32).collect())
    }
}

/// numpy's `interp(x, arange(len(fp)), fp)` in f64.
fn interp_unit_grid(x: f64, fp: &[f64]) -> f64 {
    let last = fp.len() - 1;
    if x <= 0.0 {
        return fp[0];
    }
    if x >= last as f64 {
        return fp[last];
    }
    let j = x.floor() as usize;
    if j as f64 == x {
        return fp[j];
    }
    let slope = (fp[j + 1] - fp[j]) / 1.0;
    slope * (x - j as f64) + fp[j]
}

/// The Euler ancestral sampler with its schedule set for a number of steps.
#[derive(Debug, Clone)]
pub struct EulerAncestral {
    timesteps: Vec<f32>,
    /// `timesteps.len() + 1` values, the last 0.
    sigmas: Vec<f32>,
    init_noise_sigma: f32,
}

impl EulerAncestral {
    /// Builds the schedule for `num_steps` steps (`set_timesteps`).
    pub fn new(cfg: &EulerAncestralConfig, num_steps: usize) -> anyhow::Result<Self> {
        cfg.validate()?;
        let timesteps = cfg.timesteps(num_steps)?;
        let table: Vec<f64> = cfg
            .alphas_cumprod()
            .into_iter()
            .map(|a| f64::from(((1.0f32 - a) / a).sqrt()))
            .collect();
        let mut sigmas: Vec<f32> = timesteps
            .iter()
            .map(|&t| interp_unit_grid(f64::from(t), &table) as f32)
            .collect();
        sigmas.push(0.0);
        let max = sigmas.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // `init_noise_sigma`: σ_max for linspace and trailing spacing, else √(σ_max² + 1).
        let init_noise_sigma = match cfg.timestep_spacing.as_str() {
            "linspace" | "trailing" => max,
            _ => (max * max + 1.0).sqrt(),
        };
        Ok(Self {
            timesteps,
            sigmas,
            init_noise_sigma,
        })
    }

    /// The timesteps handed to the model, first to last.
    pub fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    /// σ of every step and the final 0.
    pub fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    /// What the initial noise is multiplied by.
    pub fn init_noise_sigma(&self) -> f32 {
        self.init_noise_sigma
    }

    /// `scale_model_input` at step `i`: `sample / √(σ² + 1)`, computed in f32 (torch's
    /// arithmetic for a tensor over an f32 0-dim tensor) and rounded to the sample's dtype.
    pub fn scale_model_input(&self, sample: &Tensor, i: usize) -> anyhow::Result<Tensor> {
        let sigma = self.sigma(i)?;
        let s = Tensor::new((sigma * sigma + 1.0).sqrt(), sample.device())?;
        Ok(sample
            .to_dtype(DType::F32)?
            .broadcast_div(&s)?
            .to_dtype(sample.dtype())?)
    }

    /// One `step` at step `i` with the step's draw `noise` (the latents' shape), computed in
    /// f32 (diffusers casts the sample to f32) and returned in the model output's dtype.
    pub fn step(
        &self,
        model_output: &Tensor,
        sample: &Tensor,
        noise: &Tensor,
        i: usize,
    ) -> anyhow::Result<Tensor> {
        let (sigma, sigma_to) = (self.sigma(i)?, self.sigma(i + 1)?);
        let dtype = model_output.dtype();
        let sample = sample.to_dtype(DType::F32)?;
        let eps = model_output.to_dtype(DType::F32)?;
        let scalar = |v: f32| Tensor::new(v, sample.device());
        let pred_original = (&sample - eps.affine(f64::from(sigma), 0.0)?)?;
        let (from2, to2) = (sigma * sigma, sigma_to * sigma_to);
        let sigma_up = (to2 * (from2 - to2) / from2).sqrt();
        let sigma_down = (to2 - sigma_up * sigma_up).sqrt();
        let derivative = (&sample - pred_original)?.broadcast_div(&scalar(sigma)?)?;
        let prev = (&sample + derivative.affine(f64::from(sigma_down - sigma), 0.0)?)?;
        let kick = noise
            .to_dtype(DType::F32)?
            .affine(f64::from(sigma_up), 0.0)?;
        Ok((prev + kick)?.to_dtype(dtype)?)
    }

    fn sigma(&self, i: usize) -> anyhow::Result<f32> {
        match self.sigmas.get(i) {
            Some(&s) => Ok(s),
            None => bail!(
                "Euler ancestral: step {i} is past the {}-step schedule",
                self.timesteps.len()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linspace_timesteps_are_fractional() {
        let cfg = EulerAncestralConfig::default();
        assert_eq!(cfg.timesteps(3).unwrap(), vec![999.0, 499.5, 0.0]);
        assert!(cfg.timesteps(0).is_err());
    }

    #[test]
    fn interp_matches_numpy_at_the_ends_and_between() {
        let fp = [1.0, 3.0, 7.0];
        assert_eq!(interp_unit_grid(0.0, &fp), 1.0);
        assert_eq!(interp_unit_grid(2.0, &fp), 7.0);
        assert_eq!(interp_unit_grid(1.5, &fp), 5.0);
        assert_eq!(interp_unit_grid(1.0, &fp), 3.0);
    }
}
