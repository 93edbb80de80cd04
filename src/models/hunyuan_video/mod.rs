//! HunyuanVideo text-to-video (hunyuanvideo-community/HunyuanVideo, diffusers layout): a Llama
//! text encoder with a prompt template, the CLIP pooled embedding (src/models/clip), a
//! guidance-distilled dual/single-stream DiT and a causal 3D VAE.

pub mod activations;
pub mod scheduler;
pub mod text_encoder;
pub mod transformer;
pub mod vae;

/// HunyuanVideo's component configs and its published configs, shipped. The tokenizers are the
/// tiny fixture's stand-ins (the published Llama one is 9 MB); their ids fit both encoders'
/// vocabularies and the weights are random anyway.
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![
        (
            "HunyuanVideoTransformer3DModel",
            "config.json",
            transformer::HunyuanVideoTransformerConfig
        ),
        (
            "AutoencoderKLHunyuanVideo",
            "config.json",
            vae::HunyuanVideoVaeConfig
        ),
        ("LlamaModel", "config.json", text_encoder::LlamaConfig),
    ],
    shipped: &[crate::models::source::Shipped {
        name: "hunyuanvideo",
        hub: Some("hunyuanvideo-community/HunyuanVideo"),
        files: crate::shipped_files!("hunyuanvideo":
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
