//! Allegro text-to-video (rhymes-ai/Allegro) in the Hugging Face diffusers layout.
//!
//! The stages of `AllegroPipeline.__call__`, in order:
//! 1. Text: the prompt lower-cased and stripped (`clean_caption` without beautifulsoup4, or
//!    `clean_caption=False`), `max_sequence_length` T5 tokens with the mask; `last_hidden_state`
//!    (pad rows not zeroed) and the mask go to the transformer, which masks the padding keys.
//!    With guidance > 1 the negative prompt (default `""`) is encoded the same way and both
//!    run as one batch `[negative; positive]`.
//! 2. Denoising on latents `[B, C, F, H, W]` (drawn, then × `init_noise_sigma`) over
//!    [`crate::schedulers::euler_ancestral`]: the input divided by `√(σ² + 1)`,
//!    [`transformer::AllegroTransformer3DModel`] at the float timestep, CFG, then the ancestral
//!    step with one fresh draw.
//! 3. Decode: `1 / scaling_factor · z` through the tiled [`vae::AutoencoderKLAllegro`], cropped
//!    to the asked frames and size, `(video / 2 + 0.5)` clamped to [0, 1].

pub mod activations;
pub mod transformer;
pub mod vae;

/// `AllegroPipeline.__call__`'s defaults that its configs do not give (diffusers 0.42.1; the
/// size and frame count come from the transformer's sample sizes).
pub mod defaults {
    pub const NUM_INFERENCE_STEPS: u32 = 100;
    pub const GUIDANCE_SCALE: f64 = 7.5;
    pub const MAX_SEQUENCE_LENGTH: u32 = 512;
    /// The frame rate of diffusers' Allegro example (`export_to_video(video, fps=15)`).
    pub const FPS: u32 = 15;
}

/// Allegro's component configs and its published configs, shipped.
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![
        (
            "AllegroTransformer3DModel",
            "config.json",
            transformer::AllegroTransformerConfig
        ),
        ("AutoencoderKLAllegro", "config.json", vae::AllegroVaeConfig),
        (
            "EulerAncestralDiscreteScheduler",
            "scheduler_config.json",
            crate::schedulers::euler_ancestral::EulerAncestralConfig
        ),
    ],
    shipped: &[crate::models::source::Shipped {
        name: "allegro",
        hub: Some("rhymes-ai/Allegro"),
        files: crate::shipped_files!("allegro"),
    }],
};
