//! MiniMax H3 text-to-video+audio (diffusers' modular `MiniMaxH3` pipeline, `t2va` workflow).
//!
//! The model parts, in the order a `t2va` request uses them (each checked against diffusers
//! 0.42.1 on the `minimax-h3-tiny-a` fixture):
//!
//! 1. [`layout::T2vaGeometry::new`]: canvas check, `num_frames` snapped up to `17n + 5`, the
//!    5–15 s window, latent and audio sizes.
//! 2. [`text_encoder::MiniMaxH3Tokenizer::encode`] (prompt verbatim, no special tokens) then
//!    [`text_encoder::MiniMaxH3TextEncoder::forward`]: `prompt_embeds` = Qwen3-VL hidden state 50
//!    (layers streamable through `new_without_layers` / `layer` / `embed`).
//! 3. [`layout::t2va_layout`]: the packed `[text | audio L | audio R | video]` rows.
//! 4. Per step `i` of the two schedules ([`crate::schedulers::minimax_h3::MiniMaxH3Schedule`],
//!    `scheduler/` and `audio_scheduler/`): [`layout::row_timesteps`], one
//!    [`transformer::MiniMaxH3Transformer3DModel::forward`] (or `prepare`, the blocks, `finish`),
//!    then each schedule's `step` on its own rows. No CFG: one forward per step.
//! 5. [`crate::models::patches::unpatchify`] / [`layout::unpack_audio`], then
//!    [`vae::MiniMaxH3VaeDecoder::decode`] of `denormalize(latents)` and
//!    [`vae::decoded_to_unit_range`] (frames at [`layout::FPS`]), and
//!    [`audio_vae::MiniMaxH3AudioVaeDecoder::decode`] of `denormalize(audio)` with
//!    [`audio_vae::stereo_from_batch`] (`[1, 2, samples]` at the audio VAE's `sampling_rate`).

pub mod activations;
pub mod audio_vae;
pub mod layout;
mod nn;
pub mod text_encoder;
pub mod transformer;
pub mod vae;

/// MiniMax H3's component configs and its published configs, shipped. The tokenizer is a small
/// stand-in BPE (Qwen's is 11 MB); the weights are random anyway.
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![
        (
            "MiniMaxH3Transformer3DModel",
            "config.json",
            transformer::MiniMaxH3TransformerConfig
        ),
        (
            "AutoencoderKLMiniMaxH3",
            "config.json",
            vae::MiniMaxH3VaeConfig
        ),
        (
            "AutoencoderKLMiniMaxH3Audio",
            "config.json",
            audio_vae::MiniMaxH3AudioVaeConfig
        ),
        (
            "Qwen3VLForConditionalGeneration",
            "config.json",
            text_encoder::Qwen3VLConfig
        ),
        (
            "MiniMaxH3Scheduler",
            "scheduler_config.json",
            crate::schedulers::minimax_h3::MiniMaxH3SchedulerConfig
        ),
    ],
    shipped: &[crate::models::source::Shipped {
        name: "minimax-h3",
        hub: Some("MiniMaxAI/MiniMax-H3"),
        files: crate::shipped_files!("minimax-h3":
            "modular_model_index.json",
            "transformer/config.json",
            "vae/config.json",
            "audio_vae/config.json",
            "text_encoder/config.json",
            "scheduler/scheduler_config.json",
            "audio_scheduler/scheduler_config.json",
            "tokenizer/tokenizer.json"
        ),
    }],
};
