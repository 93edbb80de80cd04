//! The T5 family of text encoders (T5 v1.1, mT5, UMT5) and their tokenizer, shared by the
//! pipelines that encode prompts with T5: Wan2.1 (UMT5), LTX-Video and CogVideoX (T5 v1.1).

pub mod encoder;
pub mod tokenizer;
