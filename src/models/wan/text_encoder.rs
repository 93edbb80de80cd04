//! UMT5 encoder, the text encoder of Wan2.1 (transformers' `UMT5EncoderModel`): the shared T5
//! encoder of [`crate::models::t5`], whose UMT5 variant (`model_type` `"umt5"`) gives every
//! block its own relative-position bias. Re-exported under Wan's names.

pub use crate::models::t5::encoder::{
    attention_mask, relative_position_bucket, zero_padding_rows, T5Block as UMT5Block,
    T5Config as UMT5Config, T5Embedding as UMT5Embedding, T5EncoderModel as UMT5EncoderModel,
    T5LayerNorm as UMT5LayerNorm,
};
