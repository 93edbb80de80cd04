//! Mochi-1 text-to-video (diffusers' `MochiPipeline`, genmo/mochi-1-preview).
//!
//! The stages of `MochiPipeline.__call__`, in order:
//! 1. Text: the shared T5 v1.1 encoder **with** the attention mask; `last_hidden_state` (pad
//!    rows not zeroed) is the prompt embedding `[B, L, text_embed_dim]`, and the mask goes to
//!    the transformer. With guidance > 1 the negative prompt (default `""`) is encoded the same
//!    way and both run as one batch `[negative; positive]`.
//! 2. Denoising on latents `[B, C, F, H, W]` over the flow-match Euler schedule of
//!    [`crate::schedulers::linear_quadratic`] (inverted sigmas: the transformer sees t = 0
//!    first): [`transformer::MochiTransformer3DModel`], CFG `uncond + g·(cond − uncond)` in f32,
//!    the Euler step in f32.
//! 3. Decode: [`vae::AutoencoderKLMochi::denormalize`] (`z·std/scaling + mean`), `decode`
//!    (`6(F − 1) + 1` frames), `(video / 2 + 0.5)` clamped to [0, 1].

pub mod activations;
pub mod transformer;
pub mod vae;

/// `MochiPipeline.__call__`'s defaults (diffusers 0.42.1; height and width from the pipeline's
/// `default_height` / `default_width`).
pub mod defaults {
    pub const HEIGHT: u32 = 480;
    pub const WIDTH: u32 = 848;
    pub const NUM_FRAMES: u32 = 19;
    pub const NUM_INFERENCE_STEPS: u32 = 64;
    pub const GUIDANCE_SCALE: f64 = 4.5;
    pub const MAX_SEQUENCE_LENGTH: u32 = 256;
    /// The frame rate of diffusers' Mochi examples (`export_to_video(frames, fps=30)`).
    pub const FPS: u32 = 30;
}

/// Mochi's component configs and its published configs, shipped.
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![
        (
            "MochiTransformer3DModel",
            "config.json",
            transformer::MochiTransformerConfig
        ),
        ("AutoencoderKLMochi", "config.json", vae::MochiVaeConfig),
    ],
    shipped: &[crate::models::source::Shipped {
        name: "mochi-1",
        hub: Some("genmo/mochi-1-preview"),
        files: crate::shipped_files!("mochi-1"),
    }],
};
