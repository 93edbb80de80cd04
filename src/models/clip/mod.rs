//! CLIP (transformers' `CLIPVisionModelWithProjection` and `CLIPTextModel`) and its image
//! preprocessing. The Wan image-to-video pipelines condition on the vision tower's penultimate
//! hidden states; HunyuanVideo's `text_encoder_2` is the text tower (its pooled output). Both
//! towers share one encoder-layer implementation.

pub mod encoder;
pub mod image_processor;
pub mod prompt;
pub mod text;
pub mod vision;

pub use encoder::{ClipActivation, ClipEncoderConfig, ClipEncoderLayer};
pub use image_processor::{
    load_rgb_image, resize_like_pil, ClipImageProcessor, ClipImageProcessorConfig, PilFilter,
};
pub use text::{ClipTextConfig, ClipTextModel, ClipTextOutput};
pub use vision::{ClipVisionConfig, ClipVisionModel};

/// CLIP's configs: the vision tower and its image processor (Wan2.1 I2V), the text model
/// (HunyuanVideo).
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![
        (
            "CLIPVisionModelWithProjection",
            "config.json",
            ClipVisionConfig
        ),
        (
            "CLIPImageProcessor",
            "preprocessor_config.json",
            ClipImageProcessorConfig
        ),
        ("CLIPTextModel", "config.json", ClipTextConfig),
    ],
    shipped: &[],
};
