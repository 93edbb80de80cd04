//! Mochi's sigma schedule (`linear_quadratic_schedule` of diffusers' `MochiPipeline`, from
//! genmo's reference sampler): the first half of the steps lowers the noise linearly to a
//! threshold, the rest quadratically to the end. The pipeline hands `1 − schedule` to
//! `FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=...)`, whose `invert_sigmas` turns it
//! back ([`crate::schedulers::euler::FlowMatchEuler::with_sigmas`]).

/// `MochiPipeline`'s threshold noise (`threshold_noise = 0.025`).
pub const THRESHOLD_NOISE: f64 = 0.025;

/// `linear_quadratic_schedule(num_steps, threshold_noise)` with the default `linear_steps =
/// num_steps // 2`: `1 − x` for the linear-then-quadratic x, in f64 as Python computes it.
pub fn linear_quadratic_schedule(num_steps: usize, threshold_noise: f64) -> Vec<f64> {
    let linear_steps = num_steps / 2;
    let n = num_steps as f64;
    let ls = linear_steps as f64;
    let linear = (0..linear_steps).map(|i| i as f64 * threshold_noise / ls);
    let step_diff = ls - threshold_noise * n;
    let quadratic_steps = (num_steps - linear_steps) as f64;
    let quadratic_coef = step_diff / (ls * quadratic_steps.powi(2));
    let linear_coef = threshold_noise / ls - 2.0 * step_diff / quadratic_steps.powi(2);
    let constant = quadratic_coef * ls.powi(2);
    let quadratic = (linear_steps..num_steps).map(|i| {
        let i = i as f64;
        quadratic_coef * (i * i) + linear_coef * i + constant
    });
    linear.chain(quadratic).map(|x| 1.0 - x).collect()
}
