//! Classifier-free guidance of `CogVideoXPipeline.__call__`, as pure functions.

use candle_core::{Result, Tensor};

/// The guidance scale used at timestep `t` of an `num_inference_steps`-step run. With
/// `use_dynamic_cfg` (recommended on the CogVideoX-5b model card, off by default in the pipeline)
/// the scale follows diffusers' cosine ramp
/// `1 + g · (1 − cos(π · ((N − t) / N)^5)) / 2`, computed from the requested `guidance_scale` at
/// every step (never from the previous step's value); otherwise it is `guidance_scale`.
/// Whether guidance runs at all is decided once from the requested scale (`> 1`).
pub fn scale_at(
    guidance_scale: f64,
    use_dynamic_cfg: bool,
    timestep: i64,
    num_inference_steps: usize,
) -> f64 {
    if !use_dynamic_cfg {
        return guidance_scale;
    }
    let n = num_inference_steps as f64;
    let progress = (n - timestep as f64) / n;
    1.0 + guidance_scale * ((1.0 - (std::f64::consts::PI * progress.powf(5.0)).cos()) / 2.0)
}

/// Whether the pipeline runs the negative prompt: diffusers' `guidance_scale > 1`.
pub fn is_guided(guidance_scale: f64) -> bool {
    guidance_scale > 1.0
}

/// [`crate::models::guidance::guide`] in the tensors' dtype (diffusers runs it in f32 after
/// `noise_pred.float()`; the Python float scale is rounded to that dtype).
pub fn apply(uncond: &Tensor, cond: &Tensor, scale: f64) -> Result<Tensor> {
    crate::models::guidance::guide(uncond, cond, f64::from(scale as f32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_scale_follows_the_cosine_ramp() {
        assert_eq!(scale_at(6.0, false, 999, 50), 6.0);
        // t = N: progress 0, cos(0) = 1, scale 1.
        assert_eq!(scale_at(6.0, true, 50, 50), 1.0);
        // The value diffusers computes at the first step of a 50-step run.
        let n = 50.0f64;
        let expected =
            1.0 + 6.0 * ((1.0 - (std::f64::consts::PI * ((n - 999.0) / n).powf(5.0)).cos()) / 2.0);
        assert_eq!(scale_at(6.0, true, 999, 50), expected);
        assert!(is_guided(6.0) && !is_guided(1.0));
    }
}
