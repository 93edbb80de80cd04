//! CogVideoX text-to-video (THUDM/CogVideoX-5b) in the Hugging Face diffusers layout.
//!
//! The stages of `CogVideoXPipeline.__call__`, in order:
//! 1. Text: the shared T5 v1.1 encoder run **without** a mask; `last_hidden_state` (pads not
//!    zeroed) is the prompt embedding `[B, L, text_embed_dim]`, every token attended later.
//! 2. Denoising, latents `[B, F, C, H, W]` (frames before channels), for each timestep of
//!    [`crate::schedulers::cogvideox::CogVideoXDpmScheduler`]:
//!    [`transformer::CogVideoXTransformer3DModel`] (one batched call over `[negative; positive]`
//!    when [`guidance::is_guided`]), [`guidance::apply`] with [`guidance::scale_at`], then the
//!    scheduler's `step` with the last of the step's `draws_at(i)` noise draws.
//! 3. Decode: [`vae::AutoencoderKLCogVideoX::scale_latents`] (permute to `[B, C, F, H, W]`,
//!    times `1 / scaling_factor`), then `decode` (frame-batched), then `(video / 2 + 0.5)`
//!    clamped to [0, 1].

pub mod activations;
pub mod guidance;
pub mod transformer;
pub mod vae;

/// CogVideoX's component configs and its published configs, shipped.
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![
        (
            "CogVideoXTransformer3DModel",
            "config.json",
            transformer::CogVideoXTransformerConfig
        ),
        (
            "AutoencoderKLCogVideoX",
            "config.json",
            vae::CogVideoXVaeConfig
        ),
    ],
    shipped: &[crate::models::source::Shipped {
        name: "cogvideox-5b",
        hub: Some("THUDM/CogVideoX-5b"),
        files: crate::shipped_files!("cogvideox-5b"),
    }],
};
