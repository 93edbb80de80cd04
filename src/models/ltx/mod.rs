//! LTX-Video (diffusers' `LTXPipeline`, Lightricks/LTX-Video): a T5 v1.1 text encoder
//! ([`crate::models::t5`]), `LTXVideoTransformer3DModel` on packed latent tokens, and
//! `AutoencoderKLLTXVideo`, whose 0.9.1 decoder is conditioned on a timestep and injects noise.
//!
//! `LTXPipeline`'s stages, in order (tests/parity_ltx_pipeline.rs runs exactly this):
//! 1. [`prompt::prompt_embeds`] for the prompt and, with guidance > 1, the negative prompt:
//!    T5 without attention mask; the masks go to cross-attention. CFG batches [negative;
//!    positive] (embeds and masks concatenated).
//! 2. Sizes: latent grid `[(frames - 1) / r_t + 1, height / r_s, width / r_s]` with the VAE
//!    config's ratios; noise drawn as `[1, C, F, H, W]` and packed with
//!    [`crate::models::patches::patchify`] by [`transformer::LtxTransformerConfig::patch`] (latents given by the caller are already packed).
//! 3. [`crate::schedulers::euler::FlowMatchEuler::for_sequence_length`] with the grid's token
//!    count; per step one transformer forward over the batch (`timestep` = σ·1000 as f32,
//!    `rope_interpolation_scale` from [`transformer::LtxTransformerConfig::rope_interpolation_scale`]
//!    with the frame rate), CFG `uncond + g·(cond − uncond)` in f32, Euler step.
//! 4. [`crate::models::patches::unpatchify`], [`vae::AutoencoderKLLTXVideo::denormalize`]; with timestep
//!    conditioning [`vae::add_decode_noise`] (noise `[1, C, F, H, W]`, scale
//!    `decode_noise_scale`, default `decode_timestep`) and `decode(z, Some(decode_timestep),
//!    noise)`; else `decode(z, None, ..)`.
//! 5. Frames: `(video / 2 + 0.5).clamp(0, 1)`.

pub mod activations;
pub mod prompt;
pub mod transformer;
pub mod vae;

/// `LTXPipeline.__call__`'s defaults (diffusers 0.42.1). The benchmark table of issue 15 runs
/// 512x768x161 instead; height and width must be multiples of 32 (the VAE's spatial ratio).
pub mod defaults {
    pub const HEIGHT: usize = 512;
    pub const WIDTH: usize = 704;
    pub const NUM_FRAMES: usize = 161;
    /// The frame rate the transformer's RoPE is told (`frame_rate`).
    pub const FRAME_RATE: f64 = 25.0;
    pub const NUM_INFERENCE_STEPS: usize = 50;
    pub const GUIDANCE_SCALE: f64 = 3.0;
    /// `decode_timestep`; `decode_noise_scale` defaults to it.
    pub const DECODE_TIMESTEP: f64 = 0.0;
    pub const MAX_SEQUENCE_LENGTH: usize = super::prompt::DEFAULT_MAX_SEQUENCE_LENGTH;
}

/// LTX-Video's component configs and its published configs, shipped.
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![
        (
            "LTXVideoTransformer3DModel",
            "config.json",
            transformer::LtxTransformerConfig
        ),
        ("AutoencoderKLLTXVideo", "config.json", vae::LtxVaeConfig),
    ],
    shipped: &[crate::models::source::Shipped {
        name: "ltx-video",
        hub: Some("Lightricks/LTX-Video"),
        files: crate::shipped_files!("ltx-video"),
    }],
};
