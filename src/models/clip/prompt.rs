//! CLIP's text tower as the HunyuanVideo and FLUX pipelines prompt it: the tokenizer as
//! transformers' `CLIPTokenizer` runs it, and each text's pooled output.

use super::{ClipEncoderLayer, ClipTextModel};
use crate::models::blocks::PlacedBlocks;
use crate::models::source::ModelSource;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};

/// The CLIP tokenizer's length (`tokenizer_max_length`, 77).
pub const MAX_LENGTH: usize = 77;

/// The CLIP tokenizer in `folder` as transformers' `CLIPTokenizer` runs it for HunyuanVideo and
/// FLUX: the file verbatim, truncated and padded to 77 with the pad token.
pub fn tokenizer(source: &ModelSource, folder: &str) -> Result<tokenizers::Tokenizer> {
    let (json, config) = source.tokenizer_files(folder)?;
    let mut tokenizer: tokenizers::Tokenizer = json
        .parse()
        .map_err(|e| anyhow::anyhow!("loading {folder}/tokenizer.json: {e}"))?;
    let config: serde_json::Value = config
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let pad = config["pad_token"]
        .as_str()
        .or_else(|| config["pad_token"]["content"].as_str())
        .unwrap_or("<|endoftext|>")
        .to_string();
    let pad_id = tokenizer
        .token_to_id(&pad)
        .with_context(|| format!("{folder} has no pad token {pad:?}"))?;
    tokenizer
        .with_truncation(Some(tokenizers::TruncationParams {
            max_length: MAX_LENGTH,
            ..Default::default()
        }))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    tokenizer.with_padding(Some(tokenizers::PaddingParams {
        strategy: tokenizers::PaddingStrategy::Fixed(MAX_LENGTH),
        pad_id,
        pad_token: pad,
        ..Default::default()
    }));
    Ok(tokenizer)
}

/// `_get_clip_prompt_embeds` of each text (HunyuanVideo's and FLUX's): the pooled output of
/// the CLIP text model (its layers wherever they are placed) on `device`, in `dtype` on the host; the texts through the layers
/// together, each result as encoding it alone gives.
pub fn pooled(
    encoder: &impl PlacedBlocks<ClipTextModel>,
    tokenizer: &tokenizers::Tokenizer,
    device: &Device,
    dtype: DType,
    texts: &[&str],
) -> Result<Vec<Tensor>> {
    let model = encoder.model()?;
    let (mut hidden, mut ids) = (Vec::new(), Vec::new());
    for text in texts {
        let encoding = tokenizer
            .encode(*text, true)
            .map_err(|e| anyhow::anyhow!("tokenizing {text:?}: {e}"))?;
        let tokens: Vec<i64> = encoding.get_ids().iter().map(|&i| i64::from(i)).collect();
        let tokens = Tensor::new(tokens.as_slice(), device)?.unsqueeze(0)?;
        hidden.push(model.embed(&tokens)?);
        ids.push(tokens);
    }
    let hidden = encoder.fold_blocks_each(
        ClipTextModel::layers,
        hidden,
        |layer: &ClipEncoderLayer, _, x| layer.forward(x, true),
    )?;
    hidden
        .iter()
        .zip(&ids)
        .map(|(x, ids)| {
            Ok(model
                .finish(x, ids)?
                .pooler_output
                .to_dtype(dtype)?
                .to_device(&Device::Cpu)?)
        })
        .collect()
}
