//! The Wan family in the Hugging Face diffusers layout: Wan2.1 text- and image-to-video, Wan2.2
//! TI2V-5B and the A14B experts.

pub mod condition;
pub mod prompt;
pub mod text_encoder;
pub mod transformer;
pub mod vae;
