//! FLUX.1 text-to-image (black-forest-labs/FLUX.1-dev, diffusers layout): the CLIP text
//! model's pooled output (src/models/clip) and T5 v1.1 without a mask (src/models/t5), the
//! guidance-distilled dual/single-stream [`transformer::FluxTransformer2DModel`] over 2x2-packed
//! latents ([`packing`]), flow-match Euler shifted by the image's token count, and the 2-D
//! `AutoencoderKL`.

pub mod activations;
pub mod packing;
pub mod transformer;

/// FLUX's component configs (its DiT's and the shared `AutoencoderKL`'s, which no other folder
/// checks yet) and its published configs, shipped. The tokenizers are the tiny
/// fixture's stand-ins (their ids fit both encoders' vocabularies; the weights are random).
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![
        (
            "FluxTransformer2DModel",
            "config.json",
            transformer::FluxTransformerConfig
        ),
        (
            "AutoencoderKL",
            "config.json",
            crate::models::autoencoder_kl::AutoencoderKLConfig
        ),
    ],
    shipped: &[crate::models::source::Shipped {
        name: "flux.1-dev",
        hub: Some("black-forest-labs/FLUX.1-dev"),
        files: crate::shipped_files!("flux.1-dev":
            "model_index.json",
            "transformer/config.json",
            "vae/config.json",
            "text_encoder/config.json",
            "text_encoder_2/config.json",
            "scheduler/scheduler_config.json",
            "tokenizer/tokenizer.json",
            "tokenizer/tokenizer_config.json",
            "tokenizer_2/tokenizer.json",
            "tokenizer_2/tokenizer_config.json"
        ),
    }],
};
