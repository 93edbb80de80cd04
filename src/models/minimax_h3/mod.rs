//! MiniMax H3 text-to-video+audio (diffusers' modular `MiniMaxH3` pipeline, `t2va` workflow).

pub mod audio_vae;
pub mod layout;
mod nn;
pub mod text_encoder;
pub mod transformer;
pub mod vae;
