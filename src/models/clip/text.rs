//! CLIP's text tower (transformers' `CLIPTextModel`): token + learned position embeddings,
//! causal pre-LN encoder layers, `final_layer_norm`, and the pooled output at the end token.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, LayerNorm, VarBuilder};
use serde::Deserialize;

use super::encoder::{ClipActivation, ClipEncoderConfig, ClipEncoderLayer};
use crate::models::blocks::Blockwise;

/// `eos_token_id` as a config may write it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(i64),
    Many(Vec<i64>),
}

/// `text_encoder_2/config.json` (`clip_text_model`); missing keys take transformers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct ClipTextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Longest token sequence (rows of the position embedding).
    pub max_position_embeddings: usize,
    pub layer_norm_eps: f64,
    pub hidden_act: ClipActivation,
    /// Picks the pooled position: 2 means "the largest token id" (transformers' legacy rule),
    /// anything else "the first occurrence of this id".
    pub eos_token_id: Option<TokenIds>,
}

impl Default for ClipTextConfig {
    fn default() -> Self {
        Self {
            vocab_size: 49408,
            hidden_size: 512,
            intermediate_size: 2048,
            num_hidden_layers: 12,
            num_attention_heads: 8,
            max_position_embeddings: 77,
            layer_norm_eps: 1e-5,
            hidden_act: ClipActivation::QuickGelu,
            eos_token_id: Some(TokenIds::One(49407)),
        }
    }
}

impl ClipTextConfig {
    /// The encoder-layer sizes.
    pub fn encoder(&self) -> ClipEncoderConfig {
        ClipEncoderConfig {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_attention_heads: self.num_attention_heads,
            layer_norm_eps: self.layer_norm_eps,
            hidden_act: self.hidden_act,
        }
    }

    /// Rejects configurations the model cannot run, naming the key.
    pub fn validate(&self) -> Result<()> {
        self.encoder().validate()?;
        if self.vocab_size == 0 || self.max_position_embeddings == 0 {
            candle_core::bail!(
                "clip text config: vocab_size and max_position_embeddings must be positive"
            )
        }
        match self.eos_token_id {
            Some(TokenIds::One(_)) => Ok(()),
            _ => candle_core::bail!(
                "clip text config: eos_token_id must be one token id to pick the pooled output"
            ),
        }
    }

    fn eos(&self) -> i64 {
        match self.eos_token_id {
            Some(TokenIds::One(id)) => id,
            _ => -1,
        }
    }
}

/// What [`ClipTextModel::forward`] returns.
#[derive(Debug, Clone)]
pub struct ClipTextOutput {
    /// `final_layer_norm` output `[B, L, hidden]`.
    pub last_hidden_state: Tensor,
    /// `[B, hidden]`: `last_hidden_state` at each row's end token.
    pub pooler_output: Tensor,
}

/// transformers' `CLIPTextModel`.
#[derive(Debug, Clone)]
pub struct ClipTextModel {
    cfg: ClipTextConfig,
    token_embedding: Embedding,
    /// `[max_position_embeddings, hidden]`.
    position_embedding: Tensor,
    layers: Vec<ClipEncoderLayer>,
    final_layer_norm: LayerNorm,
}

impl ClipTextModel {
    /// Loads the model; `vb` is the root of `model.safetensors` (with or without the
    /// `text_model.` prefix).
    pub fn new(cfg: &ClipTextConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_layers(cfg, vb.clone())?;
        model.layers = (0..cfg.num_hidden_layers)
            .map(|i| Self::layer(cfg, i, vb.clone()))
            .collect::<Result<_>>()?;
        Ok(model)
    }

    /// The root of the text tower's tensors: `text_model.` when `vb` holds `probe` under it.
    /// Each part probes a tensor of its own, because an engine that streams layers builds each
    /// from a `vb` holding only that layer's tensors.
    fn root<'a>(vb: VarBuilder<'a>, probe: &str) -> VarBuilder<'a> {
        if vb.contains_tensor(&format!("text_model.{probe}")) {
            vb.pp("text_model")
        } else {
            vb
        }
    }

    /// Encoder layer `i` from the model's root `vb` (for an engine that streams layers).
    pub fn layer(cfg: &ClipTextConfig, i: usize, vb: VarBuilder) -> Result<ClipEncoderLayer> {
        let layer = format!("encoder.layers.{i}");
        let vb = Self::root(vb, &format!("{layer}.layer_norm1.weight"));
        ClipEncoderLayer::new(&cfg.encoder(), vb.pp(layer))
    }

    /// The encoder layers, in order (empty after `new_without_layers`).
    pub fn layers(&self) -> &[ClipEncoderLayer] {
        &self.layers
    }

    /// Everything but the encoder layers; `layers()` is then empty.
    pub fn new_without_layers(cfg: &ClipTextConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let vb = Self::root(vb, "embeddings.token_embedding.weight");
        let d = cfg.hidden_size;
        let layers = Vec::new();
        Ok(Self {
            cfg: cfg.clone(),
            token_embedding: candle_nn::embedding(
                cfg.vocab_size,
                d,
                vb.pp("embeddings.token_embedding"),
            )?,
            position_embedding: vb.get(
                (cfg.max_position_embeddings, d),
                "embeddings.position_embedding.weight",
            )?,
            layers,
            final_layer_norm: candle_nn::layer_norm(
                d,
                cfg.layer_norm_eps,
                vb.pp("final_layer_norm"),
            )?,
        })
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &ClipTextConfig {
        &self.cfg
    }

    /// `input_ids` `[B, L]` (any integer dtype; no attention mask, as HunyuanVideo calls it).
    pub fn forward(&self, input_ids: &Tensor) -> Result<ClipTextOutput> {
        let mut x = self.embed(input_ids)?;
        for layer in &self.layers {
            x = layer.forward(&x, true)?;
        }
        self.finish(&x, input_ids)
    }

    /// Token plus position embeddings `[B, L, hidden]` of `input_ids` `[B, L]` (checked).
    pub fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_, l) = input_ids.dims2()?;
        if l == 0 || l > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "clip text: {l} tokens for max_position_embeddings {}",
                self.cfg.max_position_embeddings
            )
        }
        let ids: Vec<Vec<i64>> = input_ids.to_dtype(DType::I64)?.to_vec2()?;
        if let Some(&bad) = ids
            .iter()
            .flatten()
            .find(|&&t| t < 0 || t as usize >= self.cfg.vocab_size)
        {
            candle_core::bail!(
                "clip text: token id {bad} outside vocab_size {}",
                self.cfg.vocab_size
            )
        }
        let ids_u32 = input_ids.to_dtype(DType::U32)?;
        self.token_embedding
            .forward(&ids_u32)?
            .broadcast_add(&self.position_embedding.narrow(0, 0, l)?.unsqueeze(0)?)
    }

    /// The final norm and the pooled output of the layers' output `x` for `input_ids`.
    pub fn finish(&self, x: &Tensor, input_ids: &Tensor) -> Result<ClipTextOutput> {
        let b = input_ids.dim(0)?;
        let ids: Vec<Vec<i64>> = input_ids.to_dtype(DType::I64)?.to_vec2()?;
        let last_hidden_state = self.final_layer_norm.forward(x)?;
        // transformers: eos_token_id == 2 -> argmax of the ids (the legacy rule); otherwise the
        // first position holding eos_token_id (argmax of a 0/1 mask: 0 when absent).
        let eos = self.cfg.eos();
        let positions: Vec<usize> = ids
            .iter()
            .map(|row| {
                if eos == 2 {
                    first_argmax(row.iter().map(|&t| t as i32))
                } else {
                    row.iter().position(|&t| t == eos).unwrap_or(0)
                }
            })
            .collect();
        let pooled = (0..b)
            .map(|i| last_hidden_state.get(i)?.get(positions[i]))
            .collect::<Result<Vec<_>>>()?;
        Ok(ClipTextOutput {
            pooler_output: Tensor::stack(&pooled, 0)?,
            last_hidden_state,
        })
    }
}

/// Index of the first maximum, as torch's `argmax`.
fn first_argmax(values: impl Iterator<Item = i32>) -> usize {
    let mut best = (0, i32::MIN);
    for (i, v) in values.enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0
}

/// Placed by the block protocol: its encoder layers stream one by one.
impl Blockwise for ClipTextModel {
    type Config = ClipTextConfig;
    type Block = ClipEncoderLayer;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        Self::new(cfg, vb)
    }
    fn outer(cfg: &Self::Config, vb: VarBuilder, _: VarBuilder) -> Result<Self> {
        Self::new_without_layers(cfg, vb)
    }
    fn num_blocks(cfg: &Self::Config) -> usize {
        cfg.num_hidden_layers
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> Result<Self::Block> {
        Self::layer(cfg, i, vb)
    }
}
