//! LTX-Video (diffusers' `LTXPipeline`, Lightricks/LTX-Video): a T5 v1.1 text encoder
//! ([`crate::models::t5`]), `LTXVideoTransformer3DModel` on packed latent tokens, and
//! `AutoencoderKLLTXVideo`, whose 0.9.1 decoder is conditioned on a timestep and injects noise.

pub mod prompt;
pub mod transformer;
pub mod vae;

/// `LTXPipeline.__call__`'s defaults (diffusers 0.42.1). The benchmark table of issue 15 runs
/// 512x768x161 instead; height and width must be multiples of 32 (the VAE's spatial ratio).
pub mod defaults {
    pub const HEIGHT: usize = 512;
    pub const WIDTH: usize = 704;
    pub const NUM_FRAMES: usize = 161;
    /// The frame rate the transformer's RoPE is told (`frame_rate`).
    pub const FRAME_RATE: f64 = 25.0;
    pub const NUM_INFERENCE_STEPS: usize = 50;
    pub const GUIDANCE_SCALE: f64 = 3.0;
    /// `decode_timestep`; `decode_noise_scale` defaults to it.
    pub const DECODE_TIMESTEP: f64 = 0.0;
    pub const MAX_SEQUENCE_LENGTH: usize = super::prompt::DEFAULT_MAX_SEQUENCE_LENGTH;
}
