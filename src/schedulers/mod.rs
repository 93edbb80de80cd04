//! Diffusion samplers: given the model output at a timestep, compute the next sample.

pub mod euler;
pub mod unipc;
