//! CogVideoX text-to-video (THUDM/CogVideoX-5b) in the Hugging Face diffusers layout.
//!
//! The pipeline's stages, in order (the text encoder is the shared T5 v1.1 encoder, run
//! without a mask; its `last_hidden_state` feeds the transformer as is):
//! 1. [`transformer::CogVideoXTransformer3DModel`] on latents `[B, F, C, H, W]` (frames before
//!    channels) with the prompt embeddings; with guidance, one batched call over
//!    `[negative; positive]` and [`guidance::apply`].
//! 2. [`crate::schedulers::cogvideox_dpm::CogVideoXDpmScheduler::step`] with the scheduler's
//!    random draw of that step.
//! 3. [`vae::AutoencoderKLCogVideoX::decode`] of `latents.permute(0, 2, 1, 3, 4) / scaling_factor`.

pub mod guidance;
pub mod transformer;
pub mod vae;
