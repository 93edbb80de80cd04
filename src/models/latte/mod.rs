//! Latte-1 text-to-video (maxin-cn/Latte-1) in the Hugging Face diffusers layout.
//!
//! The stages of `LattePipeline.__call__`, in order:
//! 1. Text ([`prompt`]): the prompt lower-cased and stripped (`clean_caption` without
//!    beautifulsoup4), 120 T5 tokens with the mask; with `mask_feature` the embeddings are cut
//!    to the prompt's token count, the negative prompt's (encoded at 120 with its own mask) to
//!    the same rows.
//! 2. Denoising, latents `[B, C, F, H, W]`, for each timestep of
//!    [`crate::schedulers::ddim::DdimScheduler`] (eta 0): [`transformer::LatteTransformer3DModel`]
//!    (one batched call over `[negative; positive]` when guided), CFG on all 2C channels, then
//!    channels `[:C]` (the learned sigma is dropped) into the DDIM step.
//! 3. Decode: every frame on its own through the 2-D
//!    [`crate::models::autoencoder_kl::AutoencoderKL`] (`1 / scaling_factor · z`, in chunks of
//!    [`DECODE_CHUNK_FRAMES`] frames), then `(video / 2 + 0.5)` clamped to [0, 1].

pub mod activations;
pub mod prompt;
pub mod transformer;

use crate::models::autoencoder_kl::AutoencoderKL;
use candle_core::{DType, Result, Tensor};

/// Frames per VAE call (`decode_chunk_size`'s default in `LattePipeline.__call__`).
pub const DECODE_CHUNK_FRAMES: usize = 14;

/// `decode_latents`: latents `[1, C, F, h, w]` as `F` images (times `1 / scaling_factor`),
/// decoded [`DECODE_CHUNK_FRAMES`] at a time, to the video `[1, 3, F, H, W]` in f32 (not
/// clamped).
pub fn decode_latents(vae: &AutoencoderKL, latents: &Tensor) -> Result<Tensor> {
    let z = latents.squeeze(0)?.permute((1, 0, 2, 3))?;
    let z = vae.unscale_by_reciprocal(&z)?;
    let frames = z.dim(0)?;
    let mut decoded = Vec::with_capacity(frames.div_ceil(DECODE_CHUNK_FRAMES));
    for start in (0..frames).step_by(DECODE_CHUNK_FRAMES) {
        let n = DECODE_CHUNK_FRAMES.min(frames - start);
        decoded.push(vae.decode(&z.narrow(0, start, n)?)?.to_dtype(DType::F32)?);
    }
    drop(z);
    Tensor::cat(&decoded, 0)?
        .permute((1, 0, 2, 3))?
        .unsqueeze(0)
}

/// Latte's component configs and its published configs, shipped.
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![
        (
            "LatteTransformer3DModel",
            "config.json",
            transformer::LatteTransformerConfig
        ),
        (
            "AutoencoderKL",
            "config.json",
            crate::models::autoencoder_kl::AutoencoderKLConfig
        ),
        (
            "DDIMScheduler",
            "scheduler_config.json",
            crate::schedulers::ddim::DdimConfig
        ),
    ],
    shipped: &[crate::models::source::Shipped {
        name: "latte-1",
        hub: Some("maxin-cn/Latte-1"),
        files: crate::shipped_files!("latte-1"),
    }],
};
