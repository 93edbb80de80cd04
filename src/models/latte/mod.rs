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

/// Frames per VAE call (`decode_chunk_size`'s default in `LattePipeline.__call__`).
pub const DECODE_CHUNK_FRAMES: usize = 14;

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
