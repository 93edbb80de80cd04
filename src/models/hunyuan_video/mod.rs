//! HunyuanVideo text-to-video (hunyuanvideo-community/HunyuanVideo, diffusers layout): a Llama
//! text encoder with a prompt template, the CLIP pooled embedding (src/models/clip), a
//! guidance-distilled dual/single-stream DiT and a causal 3D VAE.

pub mod activations;
pub mod scheduler;
pub mod text_encoder;
pub mod transformer;
pub mod vae;
