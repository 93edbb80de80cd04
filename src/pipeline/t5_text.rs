//! The T5 v1.1 text encoder as the T5 pipelines (CogVideoX, LTX-Video) run it: placed like any
//! component (its `Blockwise` impl is Wan's UMT5 one: the same type), its blocks resident or
//! streamed, called without a mask.

use super::placement::Held;
use crate::models::t5::encoder::{T5Block, T5EncoderModel};
use anyhow::Result;
use candle_core::{DType, Tensor};

/// `last_hidden_state` of `ids` `[1, L]` without a mask (every token, `<pad>` included, attends
/// to every token), with the encoder's blocks resident or streamed; T5's relative-position
/// bias, computed by the first block, is carried to the later ones.
pub(crate) fn encode_unmasked(encoder: &Held<'_, T5EncoderModel>, ids: &[u32]) -> Result<Tensor> {
    let model = encoder.model();
    let device = model.device();
    let ids = Tensor::new(ids, &device)?.unsqueeze(0)?;
    let mask = Tensor::ones(ids.dims2()?, DType::U32, &device)?;
    let h = model.embed(&ids)?;
    let mut position_bias = None;
    let h = encoder.fold_blocks(T5EncoderModel::blocks, h, |block: &T5Block, h| {
        block.forward_sharing_bias(h, &mask, &mut position_bias)
    })?;
    Ok(model.final_norm(&h)?)
}
