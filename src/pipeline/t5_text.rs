//! The T5 v1.1 text encoder as the T5 pipelines (CogVideoX, LTX-Video) run it: placed like any
//! component (its `Blockwise` impl is Wan's UMT5 one: the same type), its blocks resident or
//! streamed, called without a mask.

use super::placement::Held;
use crate::models::t5::encoder::{T5Block, T5EncoderModel};
use anyhow::Result;
use candle_core::{DType, Tensor};

/// `last_hidden_state` of each of `texts` (token ids, as `[1, L]`) without a mask (every token,
/// `<pad>` included, attends to every token), with the encoder's blocks resident or streamed;
/// T5's relative-position bias, computed by the first block, is carried to the later ones. Each
/// block runs on every text in turn, so a streamed encoder's weights pass once for all of them,
/// and each text's result is what encoding it alone gives.
pub(crate) fn encode_unmasked(
    encoder: &Held<'_, T5EncoderModel>,
    texts: &[&[u32]],
) -> Result<Vec<Tensor>> {
    let model = encoder.model();
    let device = model.device();
    let mut inputs = Vec::with_capacity(texts.len());
    for ids in texts {
        let ids = Tensor::new(*ids, &device)?.unsqueeze(0)?;
        let mask = Tensor::ones(ids.dims2()?, DType::U32, &device)?;
        inputs.push((model.embed(&ids)?, mask, None));
    }
    let hidden =
        encoder.fold_blocks(T5EncoderModel::blocks, inputs, |block: &T5Block, inputs| {
            inputs
                .iter()
                .map(|(h, mask, bias)| {
                    let mut bias = bias.clone();
                    let h = block.forward_sharing_bias(h, mask, &mut bias)?;
                    Ok((h, mask.clone(), bias))
                })
                .collect()
        })?;
    hidden
        .iter()
        .map(|(h, _, _)| Ok(model.final_norm(h)?))
        .collect()
}
