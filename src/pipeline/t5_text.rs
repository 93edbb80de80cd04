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
    let (mut states, mut masks) = (Vec::new(), Vec::new());
    for ids in texts {
        let ids = Tensor::new(*ids, &device)?.unsqueeze(0)?;
        masks.push(Tensor::ones(ids.dims2()?, DType::U32, &device)?);
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
