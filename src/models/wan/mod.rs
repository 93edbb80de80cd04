//! The Wan family in the Hugging Face diffusers layout: Wan2.1 text- and image-to-video, Wan2.2
//! TI2V-5B and the A14B experts.

pub mod activations;
pub mod condition;
pub mod prompt;
pub mod text_encoder;
pub mod transformer;
pub mod vae;
#[cfg(feature = "cuda")]
#[path = "../kernels/wan_vae_ops.rs"]
pub(crate) mod vae_ops;

/// The Wan family's component configs and the models whose published configs vidgen ships.
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![
        (
            "WanTransformer3DModel",
            "config.json",
            transformer::WanTransformerConfig
        ),
        ("AutoencoderKLWan", "config.json", vae::WanVaeConfig),
        ("UMT5EncoderModel", "config.json", text_encoder::UMT5Config),
    ],
    shipped: &[
        crate::models::source::Shipped {
            name: "wan2.1-t2v-1.3b",
            hub: Some("Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
            files: crate::shipped_files!("wan2.1-t2v-1.3b"),
        },
        crate::models::source::Shipped {
            name: "wan2.1-t2v-14b",
            hub: Some("Wan-AI/Wan2.1-T2V-14B-Diffusers"),
            files: crate::shipped_files!("wan2.1-t2v-14b"),
        },
        crate::models::source::Shipped {
            name: "wan2.1-tiny",
            hub: None,
            files: crate::shipped_files!("wan2.1-tiny"),
        },
        crate::models::source::Shipped {
            name: "wan2.1-i2v-14b-480p",
            hub: Some("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"),
            files: crate::shipped_files!(
                "wan2.1-i2v-14b-480p",
                "image_encoder/config.json",
                "image_processor/preprocessor_config.json"
            ),
        },
        crate::models::source::Shipped {
            name: "wan2.2-ti2v-5b",
            hub: Some("Wan-AI/Wan2.2-TI2V-5B-Diffusers"),
            files: crate::shipped_files!("wan2.2-ti2v-5b"),
        },
        crate::models::source::Shipped {
            name: "wan2.2-t2v-a14b",
            hub: Some("Wan-AI/Wan2.2-T2V-A14B-Diffusers"),
            files: crate::shipped_files!("wan2.2-t2v-a14b", "transformer_2/config.json"),
        },
    ],
};
