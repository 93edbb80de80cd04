//! LTX-Video (diffusers' `LTXPipeline`, Lightricks/LTX-Video): a T5 v1.1 text encoder
//! ([`crate::models::t5`]), `LTXVideoTransformer3DModel` on packed latent tokens, and
//! `AutoencoderKLLTXVideo`, whose 0.9.1 decoder is conditioned on a timestep and injects noise.

pub mod prompt;
pub mod transformer;
pub mod vae;
