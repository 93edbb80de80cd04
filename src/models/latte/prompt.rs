//! The text side of `LattePipeline.encode_prompt`: every prompt is cleaned (`clean_caption`
//! falls back to `lower().strip()` where beautifulsoup4 is missing, and the fixtures' calls pass
//! `clean_caption=False`, which is the same), tokenized to exactly [`MAX_LENGTH`] tokens and
//! encoded by T5 with its attention mask. `mask_feature` then cuts a single prompt's
//! embeddings to its token count, and the negative prompt's to the same rows.

use crate::models::blocks::PlacedBlocks;
use crate::models::t5::encoder::{attention_mask, T5Block, T5EncoderModel};
use crate::models::t5::tokenizer::{clean_caption, PromptTokenizer};
use anyhow::{bail, Result};
use candle_core::Tensor;

/// Tokens per prompt: `LattePipeline` has no `max_sequence_length`, always 120.
pub const MAX_LENGTH: usize = 120;

/// The prompt's token ids, padded to [`MAX_LENGTH`], and how many are real (`</s>` included:
/// `mask.sum()`).
pub fn tokens(tokenizer: &PromptTokenizer, prompt: &str) -> Result<(Vec<u32>, usize)> {
    tokenizer.encode(&clean_caption(prompt), MAX_LENGTH)
}

/// T5's `last_hidden_state` `[1, MAX_LENGTH, d_model]` of each of `texts` (ids and real length)
/// with the attention mask, the encoder's blocks resident or streamed: each block runs on every
/// text in turn, and T5's relative-position bias, computed by the first block, is carried on.
pub fn encode(
    encoder: &impl PlacedBlocks<T5EncoderModel>,
    texts: &[(Vec<u32>, usize)],
) -> Result<Vec<Tensor>> {
    let model = encoder.model()?;
    let device = model.device();
    let (mut states, mut masks) = (Vec::new(), Vec::new());
    for (ids, len) in texts {
        let ids = Tensor::new(ids.as_slice(), &device)?.unsqueeze(0)?;
        masks.push(attention_mask(&[*len], ids.dim(1)?, &device)?);
        states.push((model.embed(&ids)?, None));
    }
    let states = encoder.fold_blocks_each(
        T5EncoderModel::blocks,
        states,
        |block: &T5Block, i, (h, bias)| {
            let mut bias = bias.clone();
            let h = block.forward_sharing_bias(h, &masks[i], &mut bias)?;
            Ok((h, bias))
        },
    )?;
    states
        .iter()
        .map(|(h, _)| Ok(model.final_norm(h)?))
        .collect()
}

/// `mask_feature` for one prompt: its embeddings `[1, L, D]` cut to its `len` real rows, the
/// negative prompt's (when guided) to the same rows.
pub fn mask_feature(
    prompt: &Tensor,
    len: usize,
    negative: Option<&Tensor>,
) -> Result<(Tensor, Option<Tensor>)> {
    let rows = prompt.dim(1)?;
    if len == 0 || len > rows {
        bail!("prompt length {len} is not within 1..={rows}");
    }
    let negative = negative.map(|n| n.narrow(1, 0, len)).transpose()?;
    Ok((prompt.narrow(1, 0, len)?, negative))
}
