//! The text side of `LTXPipeline`: prompts are tokenized as given (no cleaning, unlike Wan),
//! padded to `max_sequence_length`, and encoded by T5 **without** an attention mask, so every
//! token (the `<pad>`s included) attends to every token and the pad rows stay in the embeddings.
//! The mask is returned beside the embeddings: the transformer's cross-attention uses it.

use crate::models::t5::encoder::{attention_mask, T5EncoderModel};
use crate::models::t5::tokenizer::PromptTokenizer;
use anyhow::Result;
use candle_core::{Device, Tensor};

/// `LTXPipeline.__call__`'s default `max_sequence_length`.
pub const DEFAULT_MAX_SEQUENCE_LENGTH: usize = 128;

/// Token ids `[1, max_len]` (u32) of one prompt and its attention mask `[1, max_len]` (u32: 1
/// for the tokens and the final `</s>`, 0 for `<pad>`), as `_get_t5_prompt_embeds` tokenizes.
pub fn prompt_tokens(
    tokenizer: &PromptTokenizer,
    prompt: &str,
    max_len: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let (ids, len) = tokenizer.encode(prompt, max_len)?;
    let ids = Tensor::new(ids.as_slice(), device)?.unsqueeze(0)?;
    Ok((ids, attention_mask(&[len], max_len, device)?))
}

/// `_get_t5_prompt_embeds` for one prompt: `prompt_embeds` `[1, max_len, d_model]` (the
/// encoder's `last_hidden_state`, pad rows kept) and `prompt_attention_mask` `[1, max_len]`.
pub fn prompt_embeds(
    encoder: &T5EncoderModel,
    tokenizer: &PromptTokenizer,
    prompt: &str,
    max_len: usize,
) -> Result<(Tensor, Tensor)> {
    let (ids, mask) = prompt_tokens(tokenizer, prompt, max_len, &encoder.device())?;
    Ok((encoder.forward_unmasked(&ids)?, mask))
}
