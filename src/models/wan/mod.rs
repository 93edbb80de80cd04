//! Wan2.1 text-to-video in the Hugging Face diffusers layout.

pub mod activations;
pub mod prompt;
pub mod text_encoder;
pub mod transformer;
pub mod vae;
