//! The T5 encoder stack shared by the T5 family (transformers' `T5EncoderModel`,
//! `MT5EncoderModel`, `UMT5EncoderModel`): LTX-Video and CogVideoX use T5 v1.1, Wan2.1 UMT5.
//!
//! The variants differ in one place: T5 and mT5 compute the relative-position bias in the first
//! block only and every later block reuses it, while each UMT5 block owns its own bias table.
//! Attention scores are not scaled by 1/sqrt(d_kv). Padded keys are masked when a mask is
//! given; padded queries are computed normally (Wan zeroes those rows afterwards, see
//! [`T5EncoderModel::prompt_embeds`]; LTX-Video keeps them and passes an all-ones mask).
//!
//! Dtypes follow a transformers bf16/fp16 load: the FFN output projections `wo` stay in f32
//! (`_keep_in_fp32_modules`), so from the first FFN on the residual stream is f32 (PyTorch
//! promotes `bf16 + f32`); RMSNorm is computed in f32 and cast to its weight's dtype; the
//! attention softmax (scores, bias, mask) runs in f32.
//!
//! The model is a plain list of blocks so an engine can run it block by block, loading each
//! block's weights just before it runs: [`T5Embedding`], [`T5Block`] and [`T5LayerNorm`] (the
//! final norm) can each be built alone; [`T5Block::forward_sharing_bias`] carries T5's shared
//! position bias from block to block.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};
use serde::Deserialize;
use std::path::Path;

use crate::models::blocks::{Blockwise, PlacedBlocks};

/// Which member of the T5 family a config describes (its `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum T5Variant {
    /// T5 / T5 v1.1 (`"t5"`) and mT5 (`"mt5"`): relative-position bias in the first block only.
    T5,
    /// UMT5 (`"umt5"`): every block owns its relative-position bias.
    Umt5,
}

impl T5Variant {
    /// Whether block `index` owns a `relative_attention_bias` table.
    pub fn block_has_relative_bias(self, index: usize) -> bool {
        self == Self::Umt5 || index == 0
    }
}

/// `text_encoder/config.json` (transformers' `T5Config`, `MT5Config` or `UMT5Config`, told
/// apart by `model_type`); unknown keys are ignored and missing ones take the defaults of the
/// transformers class that `model_type` names.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "PartialT5Config")]
pub struct T5Config {
    /// `model_type`: `"t5"` (also when missing), `"mt5"` or `"umt5"`.
    pub variant: T5Variant,
    pub vocab_size: usize,
    pub d_model: usize,
    pub d_kv: usize,
    pub d_ff: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub relative_attention_num_buckets: usize,
    pub relative_attention_max_distance: usize,
    pub layer_norm_epsilon: f64,
    /// `"gated-gelu"` or `"{act}"` / `"gated-{act}"`. As in transformers it alone decides the
    /// FFN activation; a `dense_act_fn` key in the file is ignored.
    pub feed_forward_proj: String,
}

/// The config file as written, every key optional.
#[derive(Deserialize)]
struct PartialT5Config {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    d_model: Option<usize>,
    d_kv: Option<usize>,
    d_ff: Option<usize>,
    num_layers: Option<usize>,
    num_heads: Option<usize>,
    relative_attention_num_buckets: Option<usize>,
    relative_attention_max_distance: Option<usize>,
    layer_norm_epsilon: Option<f64>,
    feed_forward_proj: Option<String>,
}

impl TryFrom<PartialT5Config> for T5Config {
    type Error = String;

    fn try_from(p: PartialT5Config) -> std::result::Result<Self, String> {
        let variant = match p.model_type.as_deref().unwrap_or("t5") {
            "t5" | "mt5" => T5Variant::T5,
            "umt5" => T5Variant::Umt5,
            other => {
                return Err(format!(
                    "model_type {other:?} is not a T5 encoder (\"t5\", \"mt5\" or \"umt5\")"
                ))
            }
        };
        let d = Self::defaults(variant);
        Ok(Self {
            variant,
            vocab_size: p.vocab_size.unwrap_or(d.vocab_size),
            d_model: p.d_model.unwrap_or(d.d_model),
            d_kv: p.d_kv.unwrap_or(d.d_kv),
            d_ff: p.d_ff.unwrap_or(d.d_ff),
            num_layers: p.num_layers.unwrap_or(d.num_layers),
            num_heads: p.num_heads.unwrap_or(d.num_heads),
            relative_attention_num_buckets: p
                .relative_attention_num_buckets
                .unwrap_or(d.relative_attention_num_buckets),
            relative_attention_max_distance: p
                .relative_attention_max_distance
                .unwrap_or(d.relative_attention_max_distance),
            layer_norm_epsilon: p.layer_norm_epsilon.unwrap_or(d.layer_norm_epsilon),
            feed_forward_proj: p.feed_forward_proj.unwrap_or(d.feed_forward_proj),
        })
    }
}

impl T5Config {
    /// The `__init__` defaults of transformers' config class for `variant`.
    pub fn defaults(variant: T5Variant) -> Self {
        match variant {
            T5Variant::T5 => Self {
                variant,
                vocab_size: 32128,
                d_model: 512,
                d_kv: 64,
                d_ff: 2048,
                num_layers: 6,
                num_heads: 8,
                relative_attention_num_buckets: 32,
                relative_attention_max_distance: 128,
                layer_norm_epsilon: 1e-6,
                feed_forward_proj: "relu".to_string(),
            },
            T5Variant::Umt5 => Self {
                variant,
                vocab_size: 250112,
                d_model: 512,
                d_kv: 64,
                d_ff: 1024,
                num_layers: 8,
                num_heads: 6,
                relative_attention_num_buckets: 32,
                relative_attention_max_distance: 128,
                layer_norm_epsilon: 1e-6,
                feed_forward_proj: "gated-gelu".to_string(),
            },
        }
    }

    /// Reads `text_encoder/config.json`.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("parsing {}: {e}", path.display()))
    }

    /// The FFN's gating and activation, derived from `feed_forward_proj` as transformers does
    /// (`"gated-gelu"` means gelu_new).
    fn feed_forward(&self) -> Result<(bool, Activation)> {
        let parts: Vec<&str> = self.feed_forward_proj.split('-').collect();
        let (gated, name) = match parts.as_slice() {
            [act] => (false, *act),
            ["gated", act] => (true, *act),
            _ => candle_core::bail!(
                "t5 feed_forward_proj {:?} is not \"{{act}}\" or \"gated-{{act}}\"",
                self.feed_forward_proj
            ),
        };
        let act = match (self.feed_forward_proj.as_str(), name) {
            ("gated-gelu", _) | (_, "gelu_new" | "gelu_pytorch_tanh") => Activation::GeluTanh,
            (_, "gelu") => Activation::GeluErf,
            (_, "relu") => Activation::Relu,
            (_, "silu" | "swish") => Activation::Silu,
            (_, other) => candle_core::bail!("t5 activation {other:?} is not supported"),
        };
        Ok((gated, act))
    }

    /// Rejects a config the encoder cannot run, with a one-line error naming the key.
    pub fn validate(&self) -> Result<()> {
        for (key, value) in [
            ("d_model", self.d_model),
            ("d_kv", self.d_kv),
            ("num_heads", self.num_heads),
            ("d_ff", self.d_ff),
            ("vocab_size", self.vocab_size),
        ] {
            if value == 0 {
                candle_core::bail!("`{key}` must be positive");
            }
            // Far above any real model; keeps `num_heads * d_kv` and friends from overflowing.
            if value > 1 << 24 {
                candle_core::bail!("`{key}` {value} is too large");
            }
        }
        if self.relative_attention_num_buckets < 4 {
            candle_core::bail!(
                "`relative_attention_num_buckets` must be at least 4, got {}",
                self.relative_attention_num_buckets
            );
        }
        if self.relative_attention_max_distance == 0 {
            candle_core::bail!("`relative_attention_max_distance` must be positive");
        }
        if !(self.layer_norm_epsilon.is_finite() && self.layer_norm_epsilon >= 0.0) {
            candle_core::bail!("`layer_norm_epsilon` must be a finite number >= 0");
        }
        self.feed_forward()?;
        Ok(())
    }
}

/// The FFN activations a T5 config can name.
#[derive(Debug, Clone, Copy)]
enum Activation {
    /// transformers' `gelu_new`: 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))).
    GeluTanh,
    GeluErf,
    Relu,
    Silu,
}

impl Activation {
    fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::GeluTanh => x.gelu(),
            Self::GeluErf => x.gelu_erf(),
            Self::Relu => x.relu(),
            Self::Silu => x.silu(),
        }
    }
}

/// `a + b` with PyTorch's promotion of mixed float dtypes (bf16 + f32 -> f32).
fn add_promoted(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dtype() == b.dtype() {
        return a + b;
    }
    let dtype = if a.dtype() == DType::F64 || b.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    a.to_dtype(dtype)? + b.to_dtype(dtype)?
}

/// T5-style RMSNorm (no mean subtraction, no bias): statistics in f32, the normalised value cast
/// to the weight's dtype before the scale, as transformers' `T5LayerNorm` does.
#[derive(Debug, Clone)]
pub struct T5LayerNorm {
    weight: Tensor,
    eps: f64,
}

impl T5LayerNorm {
    /// Loads `{vb}.weight` of shape `[size]`.
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get(size, "weight")?,
            eps,
        })
    }

    /// The encoder's final norm, `encoder.final_layer_norm` under the checkpoint root `vb`.
    pub fn final_norm(cfg: &T5Config, vb: VarBuilder) -> Result<Self> {
        Self::new(
            cfg.d_model,
            cfg.layer_norm_epsilon,
            vb.pp("encoder.final_layer_norm"),
        )
    }
}

impl Module for T5LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?;
        let inv_rms = (x.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?;
        x.broadcast_mul(&inv_rms)?
            .to_dtype(self.weight.dtype())?
            .broadcast_mul(&self.weight)
    }
}

/// The token embedding: `encoder.embed_tokens.weight`, or the tied `shared.weight` that
/// transformers stores instead. No scaling.
#[derive(Debug, Clone)]
pub struct T5Embedding {
    embedding: Embedding,
}

impl T5Embedding {
    /// Loads the embedding from the checkpoint root `vb`.
    pub fn new(cfg: &T5Config, vb: VarBuilder) -> Result<Self> {
        const NAMES: [&str; 2] = ["encoder.embed_tokens.weight", "shared.weight"];
        let name = NAMES
            .into_iter()
            .find(|n| vb.contains_tensor(n))
            .ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "cannot find the t5 token embedding: neither {} nor {} is in the weights",
                    vb.pp(NAMES[0]).prefix(),
                    vb.pp(NAMES[1]).prefix()
                ))
            })?;
        let weight = vb.get((cfg.vocab_size, cfg.d_model), name)?;
        Ok(Self {
            embedding: Embedding::new(weight, cfg.d_model),
        })
    }

    /// `[batch, seq]` integer ids to `[batch, seq, d_model]`.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.embedding.forward(input_ids)
    }
}

/// Bucket of a relative position `key_pos - query_pos` (bidirectional), computed with the
/// float32 arithmetic of transformers' `_relative_position_bucket`.
pub fn relative_position_bucket(
    relative_position: i64,
    num_buckets: usize,
    max_distance: usize,
) -> usize {
    let half = num_buckets / 2;
    let offset = if relative_position > 0 { half } else { 0 };
    let n = relative_position.unsigned_abs() as usize;
    let max_exact = half / 2;
    if n < max_exact {
        return offset + n;
    }
    let log_ratio = (n as f32 / max_exact as f32).ln()
        / ((max_distance as f64 / max_exact as f64).ln() as f32)
        * (half - max_exact) as f32;
    // `as` saturates (and maps NaN to 0), as the clamp to the last bucket needs.
    let large = (max_exact + log_ratio as usize).min(half.saturating_sub(1));
    offset + large
}

/// Self-attention with a relative position bias and no score scaling. The bias table is the
/// block's own (`Some`: every UMT5 block, the first T5 block) or shared from the first block.
#[derive(Debug, Clone)]
struct T5Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    relative_attention_bias: Option<Tensor>,
    num_heads: usize,
    d_kv: usize,
    num_buckets: usize,
    max_distance: usize,
}

impl T5Attention {
    fn new(cfg: &T5Config, has_relative_bias: bool, vb: VarBuilder) -> Result<Self> {
        let inner = cfg.num_heads * cfg.d_kv;
        let relative_attention_bias = if has_relative_bias {
            Some(vb.get(
                (cfg.relative_attention_num_buckets, cfg.num_heads),
                "relative_attention_bias.weight",
            )?)
        } else {
            None
        };
        Ok(Self {
            q: candle_nn::linear_no_bias(cfg.d_model, inner, vb.pp("q"))?,
            k: candle_nn::linear_no_bias(cfg.d_model, inner, vb.pp("k"))?,
            v: candle_nn::linear_no_bias(cfg.d_model, inner, vb.pp("v"))?,
            o: candle_nn::linear_no_bias(inner, cfg.d_model, vb.pp("o"))?,
            relative_attention_bias,
            num_heads: cfg.num_heads,
            d_kv: cfg.d_kv,
            num_buckets: cfg.relative_attention_num_buckets,
            max_distance: cfg.relative_attention_max_distance,
        })
    }

    /// `[1, heads, len, len]` f32 bias of this block's own table (`None` without one).
    fn position_bias(&self, len: usize, device: &Device) -> Result<Option<Tensor>> {
        let Some(table) = &self.relative_attention_bias else {
            return Ok(None);
        };
        let mut buckets = Vec::with_capacity(len * len);
        for query in 0..len as i64 {
            for key in 0..len as i64 {
                let bucket =
                    relative_position_bucket(key - query, self.num_buckets, self.max_distance);
                buckets.push(bucket as u32);
            }
        }
        let buckets = Tensor::from_vec(buckets, len * len, device)?;
        table
            .to_dtype(DType::F32)?
            .index_select(&buckets, 0)?
            .reshape((len, len, self.num_heads))?
            .permute((2, 0, 1))?
            .unsqueeze(0)
            .map(Some)
    }

    /// `x`: normed hidden states `[b, len, d_model]`; `position_bias`: `[1, heads, len, len]`
    /// f32; `key_bias`: `[b, 1, 1, len]` f32, 0 for real keys and f32::MIN for padding.
    fn forward(&self, x: &Tensor, position_bias: &Tensor, key_bias: &Tensor) -> Result<Tensor> {
        let (b, len, _) = x.dims3()?;
        let heads = |proj: &Linear| -> Result<Tensor> {
            proj.forward(x)?
                .reshape((b, len, self.num_heads, self.d_kv))?
                .transpose(1, 2)?
                .to_dtype(DType::F32)?
                .contiguous()
        };
        let (q, k, v) = (heads(&self.q)?, heads(&self.k)?, heads(&self.v)?);
        let scores = q
            .matmul(&k.t()?.contiguous()?)?
            .broadcast_add(position_bias)?
            .broadcast_add(key_bias)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, len, self.num_heads * self.d_kv))?
            .to_dtype(x.dtype())?;
        self.o.forward(&out)
    }
}

/// `DenseReluDense`: gated `wo(act(wi_0 x) * wi_1 x)` or plain `wo(act(wi x))`; `wo` is kept
/// in f32 when the weights are loaded in a 16-bit dtype.
#[derive(Debug, Clone)]
struct T5FeedForward {
    wi: Linear,
    gate: Option<Linear>,
    wo: Linear,
    act: Activation,
}

impl T5FeedForward {
    fn new(cfg: &T5Config, vb: VarBuilder) -> Result<Self> {
        let (gated, act) = cfg.feed_forward()?;
        let (wi, gate) = if gated {
            (
                candle_nn::linear_no_bias(cfg.d_model, cfg.d_ff, vb.pp("wi_0"))?,
                Some(candle_nn::linear_no_bias(
                    cfg.d_model,
                    cfg.d_ff,
                    vb.pp("wi_1"),
                )?),
            )
        } else {
            (
                candle_nn::linear_no_bias(cfg.d_model, cfg.d_ff, vb.pp("wi"))?,
                None,
            )
        };
        let wo_dtype = match vb.dtype() {
            DType::BF16 | DType::F16 => DType::F32,
            dtype => dtype,
        };
        let wo = candle_nn::linear_no_bias(cfg.d_ff, cfg.d_model, vb.pp("wo").set_dtype(wo_dtype))?;
        Ok(Self { wi, gate, wo, act })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.act.apply(&self.wi.forward(x)?)?;
        if let Some(gate) = &self.gate {
            h = (h * gate.forward(x)?)?;
        }
        self.wo.forward(&h.to_dtype(self.wo.weight().dtype())?)
    }
}

/// One encoder block: `h += attn(norm(h))`, then `h += ffn(norm(h))`.
#[derive(Debug, Clone)]
pub struct T5Block {
    attn_norm: T5LayerNorm,
    attn: T5Attention,
    ffn_norm: T5LayerNorm,
    ffn: T5FeedForward,
}

impl T5Block {
    /// Loads a block that owns its relative-position bias (every UMT5 block, the first T5
    /// block) from `vb` = `encoder.block.{i}` of the checkpoint.
    pub fn new(cfg: &T5Config, vb: VarBuilder) -> Result<Self> {
        Self::with_relative_bias(cfg, true, vb)
    }

    /// Loads a block, with its `relative_attention_bias` table or (later T5 blocks) without.
    pub fn with_relative_bias(
        cfg: &T5Config,
        has_relative_bias: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        cfg.validate()?;
        let (l0, l1) = (vb.pp("layer.0"), vb.pp("layer.1"));
        let norm = |vb: VarBuilder| T5LayerNorm::new(cfg.d_model, cfg.layer_norm_epsilon, vb);
        Ok(Self {
            attn_norm: norm(l0.pp("layer_norm"))?,
            attn: T5Attention::new(cfg, has_relative_bias, l0.pp("SelfAttention"))?,
            ffn_norm: norm(l1.pp("layer_norm"))?,
            ffn: T5FeedForward::new(cfg, l1.pp("DenseReluDense"))?,
        })
    }

    /// `h`: `[batch, seq, d_model]`; `attention_mask`: `[batch, seq]`, 1 for real tokens and 0
    /// for `<pad>` (any numeric dtype). Only for a block with its own bias table.
    pub fn forward(&self, h: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        self.forward_sharing_bias(h, attention_mask, &mut None)
    }

    /// [`Self::forward`] for any block of a stack run in order: a block with its own table
    /// computes its bias and leaves it in `position_bias`; a block without one (T5 after the
    /// first) uses the bias found there, as transformers passes block 0's bias along.
    pub fn forward_sharing_bias(
        &self,
        h: &Tensor,
        attention_mask: &Tensor,
        position_bias: &mut Option<Tensor>,
    ) -> Result<Tensor> {
        let (b, len, _) = h.dims3()?;
        if let Some(own) = self.attn.position_bias(len, h.device())? {
            *position_bias = Some(own);
        }
        let Some(bias) = position_bias.as_ref() else {
            candle_core::bail!(
                "this t5 block has no relative_attention_bias: run the blocks in order from block 0"
            );
        };
        let key_bias = attention_mask
            .to_device(h.device())?
            .to_dtype(DType::F32)?
            .affine(f64::from(f32::MAX), -f64::from(f32::MAX))?
            .reshape((b, 1, 1, len))?;
        let attn = self
            .attn
            .forward(&self.attn_norm.forward(h)?, bias, &key_bias)?;
        let h = add_promoted(h, &attn)?;
        let ffn = self.ffn.forward(&self.ffn_norm.forward(&h)?)?;
        add_promoted(&h, &ffn)
    }
}

/// The T5 encoder stack: embedding, blocks, final norm.
#[derive(Debug, Clone)]
pub struct T5EncoderModel {
    variant: T5Variant,
    embed_tokens: T5Embedding,
    blocks: Vec<T5Block>,
    final_layer_norm: T5LayerNorm,
}

impl T5EncoderModel {
    /// Loads the whole encoder from the checkpoint root `vb` (`text_encoder/model*.safetensors`).
    pub fn new(cfg: &T5Config, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone(), vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads the embedding and the final norm only (for an engine that streams the blocks).
    /// The token table (vocab x d_model, the largest tensor) comes from `table_vb`, which may
    /// be on another device than `vb`: a lookup is exact anywhere, so it can stay in host memory.
    pub fn new_without_blocks(
        cfg: &T5Config,
        vb: VarBuilder,
        table_vb: VarBuilder,
    ) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            variant: cfg.variant,
            embed_tokens: T5Embedding::new(cfg, table_vb)?,
            blocks: Vec::new(),
            final_layer_norm: T5LayerNorm::final_norm(cfg, vb)?,
        })
    }

    /// Block `i` from the checkpoint root `vb` (with a bias table where the variant has one).
    pub fn block(cfg: &T5Config, i: usize, vb: VarBuilder) -> Result<T5Block> {
        T5Block::with_relative_bias(
            cfg,
            cfg.variant.block_has_relative_bias(i),
            vb.pp(format!("encoder.block.{i}")),
        )
    }

    /// The family member this encoder was built as.
    pub fn variant(&self) -> T5Variant {
        self.variant
    }

    /// The device the encoder computes on (where its final norm lives).
    pub fn device(&self) -> Device {
        self.final_layer_norm.weight.device().clone()
    }

    /// Token embeddings (`hidden_states[0]`), on the compute device wherever the table is.
    pub fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let table = self.embed_tokens.embedding.embeddings().device();
        self.embed_tokens
            .forward(&input_ids.to_device(table)?)?
            .to_device(&self.device())
    }

    /// The blocks in order, for running the encoder one block at a time.
    pub fn blocks(&self) -> &[T5Block] {
        &self.blocks
    }

    /// `encoder.final_layer_norm`.
    pub fn final_norm(&self, h: &Tensor) -> Result<Tensor> {
        self.final_layer_norm.forward(h)
    }

    /// `last_hidden_state` for `[batch, seq]` ids and mask (1 real, 0 `<pad>`).
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let mut h = self.embed(input_ids)?;
        let mut position_bias = None;
        for block in &self.blocks {
            h = block.forward_sharing_bias(&h, attention_mask, &mut position_bias)?;
        }
        self.final_norm(&h)
    }

    /// `last_hidden_state` of a call without an attention mask, as LTX-Video's and CogVideoX's
    /// pipelines make it: every token, `<pad>` included, attends to every token.
    pub fn forward_unmasked(&self, input_ids: &Tensor) -> Result<Tensor> {
        let ones = Tensor::ones(input_ids.dims2()?, DType::U32, input_ids.device())?;
        self.forward(input_ids, &ones)
    }

    /// WanPipeline's `_get_t5_prompt_embeds`: `last_hidden_state` with every row at or beyond a
    /// prompt's `seq_len` replaced by exact zeros (the length stays `seq`).
    pub fn prompt_embeds(&self, input_ids: &Tensor, seq_lens: &[usize]) -> Result<Tensor> {
        let (_, len) = input_ids.dims2()?;
        let mask = attention_mask(seq_lens, len, input_ids.device())?;
        zero_padding_rows(&self.forward(input_ids, &mask)?, seq_lens)
    }
}

/// `[batch, max_len]` u32 mask: 1 for the first `seq_lens[i]` positions, 0 after.
pub fn attention_mask(seq_lens: &[usize], max_len: usize, device: &Device) -> Result<Tensor> {
    if let Some(bad) = seq_lens.iter().find(|&&l| l == 0 || l > max_len) {
        candle_core::bail!("prompt length {bad} is not within 1..={max_len}");
    }
    let mask: Vec<u32> = seq_lens
        .iter()
        .flat_map(|&l| (0..max_len).map(move |i| u32::from(i < l)))
        .collect();
    Tensor::from_vec(mask, (seq_lens.len(), max_len), device)
}

/// Replaces rows `>= seq_lens[i]` of `[batch, seq, dim]` hidden states by exact (+0.0) zeros.
pub fn zero_padding_rows(hidden: &Tensor, seq_lens: &[usize]) -> Result<Tensor> {
    let (b, len, _) = hidden.dims3()?;
    if seq_lens.len() != b {
        candle_core::bail!("{} prompt lengths for a batch of {b}", seq_lens.len());
    }
    let keep = attention_mask(seq_lens, len, hidden.device())?
        .to_dtype(DType::U8)?
        .unsqueeze(2)?
        .broadcast_as(hidden.shape())?;
    keep.where_cond(hidden, &hidden.zeros_like()?)
}

/// The encoder stack (UMT5 for Wan, T5 v1.1 for LTX-Video and CogVideoX) as a placeable
/// component: its blocks stream in order (a T5 v1.1 block past the first takes block 0's
/// relative-position bias, see [`T5Block::forward_sharing_bias`]).
impl Blockwise for T5EncoderModel {
    type Config = T5Config;
    type Block = T5Block;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        Self::new(cfg, vb)
    }
    /// The token table stays in host memory: only the looked-up rows move.
    fn outer(cfg: &Self::Config, vb: VarBuilder, host_vb: VarBuilder) -> Result<Self> {
        Self::new_without_blocks(cfg, vb, host_vb)
    }
    fn num_blocks(cfg: &Self::Config) -> usize {
        cfg.num_layers
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> Result<Self::Block> {
        Self::block(cfg, i, vb)
    }
}

/// `last_hidden_state` of each of `texts` (token ids, as `[1, L]`) without a mask (every token,
/// `<pad>` included, attends to every token), as the T5 v1.1 pipelines (CogVideoX, LTX-Video)
/// call it; [`encode_masked`] with every token real.
pub(crate) fn encode_unmasked(
    encoder: &impl PlacedBlocks<T5EncoderModel>,
    texts: &[&[u32]],
) -> anyhow::Result<Vec<Tensor>> {
    let lens: Vec<usize> = texts.iter().map(|ids| ids.len()).collect();
    encode_masked(encoder, texts, &lens)
}

/// `last_hidden_state` of each of `texts` (token ids, as `[1, L]`) with the attention mask of
/// its first `seq_lens[i]` tokens (pad keys masked, pad rows not zeroed), with the encoder's
/// blocks resident or streamed; T5's relative-position bias, computed by the first block, is
/// carried to the later ones. Each block runs on every text in turn, so a streamed encoder's
/// weights pass once for all of them, and each text's result is what encoding it alone gives.
pub(crate) fn encode_masked(
    encoder: &impl PlacedBlocks<T5EncoderModel>,
    texts: &[&[u32]],
    seq_lens: &[usize],
) -> anyhow::Result<Vec<Tensor>> {
    let model = encoder.model()?;
    let device = model.device();
    let (mut states, mut masks) = (Vec::new(), Vec::new());
    for (ids, &len) in texts.iter().zip(seq_lens) {
        masks.push(attention_mask(&[len], ids.len(), &device)?);
        let ids = Tensor::new(*ids, &device)?.unsqueeze(0)?;
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
