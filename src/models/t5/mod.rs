//! The T5 family of text encoders (T5 v1.1, mT5, UMT5) and their tokenizer, shared by the
//! pipelines that encode prompts with T5: Wan2.1 (UMT5), LTX-Video and CogVideoX (T5 v1.1).

pub mod encoder;
pub mod tokenizer;

/// The T5 v1.1 encoder's config (LTX-Video, CogVideoX; Wan's UMT5 is the Wan folder's).
pub const FOLDER: crate::models::source::ModelFolder = crate::models::source::ModelFolder {
    configs: crate::config_checks![("T5EncoderModel", "config.json", encoder::T5Config)],
    shipped: &[],
};
