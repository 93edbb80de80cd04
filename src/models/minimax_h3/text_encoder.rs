//! MiniMax H3's conditioning encoder: the text model of Qwen3-VL (transformers'
//! `Qwen3VLTextModel`), run only up to the hidden state the pipeline reads, and its byte-level
//! BPE tokenizer.
//!
//! diffusers' `t2va` reads `hidden_states[50]`: the output of decoder layer 50, *without* the
//! final norm (transformers' last hidden state is post-norm, hence the model must have more than
//! 50 layers). The index is hard-coded in diffusers, not a config value. Only the first 50 layers
//! are loaded; the rest (and the vision tower, the final norm and `lm_head`) are never used.
//!
//! For text-only input all three mRoPE axes carry the same positions `0..n`, so interleaved mRoPE
//! is plain rotate-half RoPE over the whole head.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, Linear, VarBuilder};
use serde::Deserialize;
use std::path::Path;
use tokenizers::Tokenizer;

use super::nn::{cos_sin, partial_rope, RmsNorm};
use crate::models::blocks::Blockwise;

/// The hidden state diffusers' MiniMax H3 pipeline conditions on (output of decoder layer 50).
pub const PROMPT_HIDDEN_STATE_INDEX: usize = 50;

/// Rotary settings of the text model (transformers 5.x `rope_parameters`, 4.x `rope_scaling`).
#[derive(Debug, Clone, PartialEq, Deserialize, Default)]
#[serde(default)]
pub struct RopeParameters {
    /// Rotary base.
    pub rope_theta: Option<f64>,
    /// Only `default` is supported.
    pub rope_type: Option<String>,
    /// mRoPE split of the frequencies over (t, h, w); irrelevant for text-only positions.
    pub mrope_section: Option<Vec<usize>>,
    /// Whether mRoPE interleaves the axes; irrelevant for text-only positions.
    pub mrope_interleaved: Option<bool>,
}

/// `text_config` of a Qwen3-VL `config.json`; missing keys take transformers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct Qwen3VLTextConfig {
    /// Rows of the token table.
    pub vocab_size: usize,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Inner width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Decoder layers in the checkpoint (more than [`PROMPT_HIDDEN_STATE_INDEX`]).
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: Option<usize>,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// Whether q/k/v/o projections carry biases.
    pub attention_bias: bool,
    /// MLP activation; only `silu`.
    pub hidden_act: String,
    /// transformers 5.x rotary settings.
    pub rope_parameters: Option<RopeParameters>,
    /// transformers 4.x rotary settings.
    pub rope_scaling: Option<RopeParameters>,
    /// transformers 4.x rotary base.
    pub rope_theta: Option<f64>,
}

impl Default for Qwen3VLTextConfig {
    fn default() -> Self {
        Self {
            vocab_size: 151936,
            hidden_size: 4096,
            intermediate_size: 22016,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 32,
            head_dim: Some(128),
            rms_norm_eps: 1e-6,
            attention_bias: false,
            hidden_act: "silu".into(),
            rope_parameters: None,
            rope_scaling: None,
            rope_theta: None,
        }
    }
}

/// The `config.json` of `text_encoder/` (`Qwen3VLForConditionalGeneration`): only the text part
/// is read.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Qwen3VLConfig {
    /// The language model's settings.
    pub text_config: Qwen3VLTextConfig,
}

impl Qwen3VLConfig {
    /// Reads and validates `text_encoder/config.json`.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        let cfg: Self = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("parsing {}: {e}", path.display()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the language model's settings (the vision tower is not used).
    pub fn validate(&self) -> Result<()> {
        self.text_config.validate()
    }
}

impl Qwen3VLTextConfig {
    /// Width of one head (`head_dim`, else hidden / heads).
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The rotary base, from `rope_parameters`, `rope_scaling` or `rope_theta` (default 5e6,
    /// Qwen3-VL's).
    pub fn rope_theta(&self) -> f64 {
        [&self.rope_parameters, &self.rope_scaling]
            .into_iter()
            .flatten()
            .find_map(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(5_000_000.0)
    }

    /// Rejects configurations the encoder cannot run, naming the key.
    pub fn validate(&self) -> Result<()> {
        crate::models::config_checks::positive(
            "text_encoder config",
            &[
                ("text_config.vocab_size", self.vocab_size),
                ("text_config.hidden_size", self.hidden_size),
                ("text_config.intermediate_size", self.intermediate_size),
                ("text_config.num_attention_heads", self.num_attention_heads),
                ("text_config.num_key_value_heads", self.num_key_value_heads),
            ],
        )?;
        if self.num_hidden_layers <= PROMPT_HIDDEN_STATE_INDEX {
            candle_core::bail!(
                "text_encoder config: text_config.num_hidden_layers is {}, but MiniMax H3 reads the output of layer {PROMPT_HIDDEN_STATE_INDEX} before the final norm (needs more than {PROMPT_HIDDEN_STATE_INDEX})",
                self.num_hidden_layers
            );
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            candle_core::bail!(
                "text_encoder config: text_config.num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        let head_dim = self.head_dim();
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            candle_core::bail!(
                "text_encoder config: text_config.head_dim {head_dim} must be even and positive"
            );
        }
        if self.hidden_act != "silu" {
            candle_core::bail!(
                "text_encoder config: text_config.hidden_act {:?} is not supported (only silu)",
                self.hidden_act
            );
        }
        let theta = self.rope_theta();
        if !(theta.is_finite() && theta > 0.0) {
            candle_core::bail!("text_encoder config: rope_theta must be a positive number");
        }
        let rope_type = [&self.rope_parameters, &self.rope_scaling]
            .into_iter()
            .flatten()
            .find_map(|p| p.rope_type.clone());
        if let Some(t) = rope_type.filter(|t| t != "default") {
            candle_core::bail!(
                "text_encoder config: rope_type {t:?} is not supported (only default)"
            );
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            candle_core::bail!(
                "text_encoder config: text_config.rms_norm_eps must be a non-negative number"
            );
        }
        Ok(())
    }
}

/// Causal grouped-query self-attention with per-head RMSNorm on q and k.
#[derive(Debug, Clone)]
struct SelfAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl SelfAttention {
    fn new(cfg: &Qwen3VLTextConfig, vb: VarBuilder) -> Result<Self> {
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim());
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let bias = cfg.attention_bias;
        Ok(Self {
            q_proj: candle_nn::linear_b(hidden, heads * hd, bias, vb.pp("q_proj"))?,
            k_proj: candle_nn::linear_b(hidden, kv_heads * hd, bias, vb.pp("k_proj"))?,
            v_proj: candle_nn::linear_b(hidden, kv_heads * hd, bias, vb.pp("v_proj"))?,
            o_proj: candle_nn::linear_b(heads * hd, hidden, bias, vb.pp("o_proj"))?,
            q_norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("q_norm"))?,
            k_norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("k_norm"))?,
            heads,
            kv_heads,
            head_dim: hd,
        })
    }

    fn forward(&self, x: &Tensor, rope: &TextRope) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        // [B, n, count * hd] -> [B, count, n, hd], per-head RMSNorm first when given.
        let split = |t: Tensor, count: usize, norm: Option<&RmsNorm>| -> Result<Tensor> {
            let t = t.reshape((b, n, count, self.head_dim))?;
            let t = match norm {
                Some(norm) => norm.forward(&t)?,
                None => t,
            };
            t.transpose(1, 2)?.contiguous()
        };
        let q = split(self.q_proj.forward(x)?, self.heads, Some(&self.q_norm))?;
        let k = split(self.k_proj.forward(x)?, self.kv_heads, Some(&self.k_norm))?;
        let v = split(self.v_proj.forward(x)?, self.kv_heads, None)?;
        let (cos, sin) = (&rope.cos, &rope.sin);
        let q = partial_rope(&q, cos, sin)?;
        let k = partial_rope(&k, cos, sin)?;
        let groups = self.heads / self.kv_heads;
        let k = candle_transformers::utils::repeat_kv(k, groups)?.contiguous()?;
        let v = candle_transformers::utils::repeat_kv(v, groups)?.contiguous()?;
        let dtype = q.dtype();
        let scores = (q
            .to_dtype(DType::F32)?
            .matmul(&k.to_dtype(DType::F32)?.t()?)?
            * (1.0 / (self.head_dim as f64).sqrt()))?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&rope.causal_mask)?)?;
        let out = probs.to_dtype(dtype)?.matmul(&v)?;
        let out = out
            .transpose(1, 2)?
            .reshape((b, n, self.heads * self.head_dim))?;
        self.o_proj.forward(&out)
    }
}

/// `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(cfg: &Qwen3VLTextConfig, vb: VarBuilder) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_proj: candle_nn::linear_no_bias(h, i, vb.pp("gate_proj"))?,
            up_proj: candle_nn::linear_no_bias(h, i, vb.pp("up_proj"))?,
            down_proj: candle_nn::linear_no_bias(i, h, vb.pp("down_proj"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        self.down_proj.forward(&(gate * self.up_proj.forward(x)?)?)
    }
}

/// RoPE tables and the causal mask of one prompt length, shared by every layer.
#[derive(Debug, Clone)]
pub struct TextRope {
    /// `[n, head_dim / 2]` f32 cosines.
    pub cos: Tensor,
    /// `[n, head_dim / 2]` f32 sines.
    pub sin: Tensor,
    /// `[n, n]` f32 additive mask: 0 on and below the diagonal, -inf above.
    pub causal_mask: Tensor,
}

impl TextRope {
    /// Tables for positions `0..len`: `inv_freq_j = 1 / theta^(2j / head_dim)` and the angles
    /// `pos * inv_freq` rounded in f32 as transformers computes them.
    pub fn new(cfg: &Qwen3VLTextConfig, len: usize, device: &Device) -> Result<Self> {
        let dim = cfg.head_dim();
        let theta = cfg.rope_theta() as f32;
        let inv_freq: Vec<f32> = (0..dim / 2)
            .map(|j| {
                let exponent = (2 * j) as f32 / dim as f32;
                1.0 / ((theta as f64).powf(exponent as f64) as f32)
            })
            .collect();
        let angles: Vec<f32> = (0..len)
            .flat_map(|p| inv_freq.iter().map(move |&f| p as f32 * f))
            .collect();
        let (cos, sin) = cos_sin(&angles, len, dim / 2, device)?;
        let mask: Vec<f32> = (0..len)
            .flat_map(|i| (0..len).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        Ok(Self {
            cos,
            sin,
            causal_mask: Tensor::from_vec(mask, (len, len), device)?,
        })
    }
}

/// One Qwen3 decoder layer (pre-norm attention and MLP with residuals).
#[derive(Debug, Clone)]
pub struct Qwen3DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: SelfAttention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl Qwen3DecoderLayer {
    /// Loads one layer from `vb` = `model.language_model.layers.{i}`.
    pub fn new(cfg: &Qwen3VLTextConfig, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            input_layernorm: RmsNorm::new(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp("input_layernorm"),
            )?,
            self_attn: SelfAttention::new(cfg, vb.pp("self_attn"))?,
            post_attention_layernorm: RmsNorm::new(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp: Mlp::new(cfg, vb.pp("mlp"))?,
        })
    }

    /// `[B, n, hidden]` -> `[B, n, hidden]`.
    pub fn forward(&self, x: &Tensor, rope: &TextRope) -> Result<Tensor> {
        let x = (x + self
            .self_attn
            .forward(&self.input_layernorm.forward(x)?, rope)?)?;
        &x + self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?)?
    }
}

/// The Qwen3-VL text model truncated after layer [`PROMPT_HIDDEN_STATE_INDEX`].
#[derive(Debug, Clone)]
pub struct MiniMaxH3TextEncoder {
    cfg: Qwen3VLTextConfig,
    embed_tokens: Embedding,
    layers: Vec<Qwen3DecoderLayer>,
}

impl MiniMaxH3TextEncoder {
    /// Loads the token table and the layers the prompt embedding needs from the checkpoint root
    /// `vb` (`text_encoder/model*.safetensors`).
    pub fn new(cfg: &Qwen3VLTextConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_layers(cfg, vb.clone())?;
        model.layers = (0..Self::layers_used())
            .map(|i| Self::layer(cfg, i, vb.clone()))
            .collect::<Result<_>>()?;
        Ok(model)
    }

    /// Loads the token table only (for an engine that streams the layers).
    pub fn new_without_layers(cfg: &Qwen3VLTextConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            embed_tokens: candle_nn::embedding(
                cfg.vocab_size,
                cfg.hidden_size,
                vb.pp("model.language_model.embed_tokens"),
            )?,
            layers: Vec::new(),
            cfg: cfg.clone(),
        })
    }

    /// How many decoder layers run: layers `0..PROMPT_HIDDEN_STATE_INDEX`.
    pub fn layers_used() -> usize {
        PROMPT_HIDDEN_STATE_INDEX
    }

    /// Decoder layer `i` from the checkpoint root `vb`.
    pub fn layer(cfg: &Qwen3VLTextConfig, i: usize, vb: VarBuilder) -> Result<Qwen3DecoderLayer> {
        Qwen3DecoderLayer::new(cfg, vb.pp(format!("model.language_model.layers.{i}")))
    }

    /// The loaded layers in order (empty after `new_without_layers`).
    pub fn layers(&self) -> &[Qwen3DecoderLayer] {
        &self.layers
    }

    /// Where the token table lives (host memory when an engine streams the layers).
    pub fn table_device(&self) -> Device {
        self.embed_tokens.embeddings().device().clone()
    }

    /// The configuration the encoder was built with.
    pub fn config(&self) -> &Qwen3VLTextConfig {
        &self.cfg
    }

    /// Token embeddings (`hidden_states[0]`) of `[B, n]` ids, and the RoPE tables for them.
    pub fn embed(&self, input_ids: &Tensor) -> Result<(Tensor, TextRope)> {
        let (_, n) = input_ids.dims2()?;
        if n == 0 {
            candle_core::bail!("the prompt has no tokens");
        }
        let h = self.embed_tokens.forward(input_ids)?;
        let rope = TextRope::new(&self.cfg, n, h.device())?;
        Ok((h, rope))
    }

    /// `prompt_embeds` = `hidden_states[50]` (no final norm) of `[B, n]` ids (causal, no
    /// padding). Needs an encoder built with `new`.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        if self.layers.len() != Self::layers_used() {
            candle_core::bail!(
                "text encoder holds {} of {} layers; run them through layers() instead",
                self.layers.len(),
                Self::layers_used()
            );
        }
        let (mut h, rope) = self.embed(input_ids)?;
        for layer in &self.layers {
            h = layer.forward(&h, &rope)?;
        }
        Ok(h)
    }
}

/// The prompt tokenizer: `tokenizer/tokenizer.json` as is, without special tokens, padding or
/// truncation (diffusers' `t2va` passes the prompt verbatim, no chat template).
pub struct MiniMaxH3Tokenizer {
    tokenizer: Tokenizer,
}

impl MiniMaxH3Tokenizer {
    /// Loads `tokenizer.json`.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let tokenizer = Tokenizer::from_file(path)
            .map_err(|e| anyhow::anyhow!("loading {}: {e}", path.display()))?;
        Self::verbatim(tokenizer).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    /// The tokenizer from the text of a `tokenizer.json` (one shipped in the binary).
    pub fn from_json(text: &str) -> anyhow::Result<Self> {
        let tokenizer: Tokenizer = text
            .parse()
            .map_err(|e| anyhow::anyhow!("reading tokenizer.json: {e}"))?;
        Self::verbatim(tokenizer)
    }

    /// Without truncation or padding, as the pipeline tokenizes.
    fn verbatim(mut tokenizer: Tokenizer) -> anyhow::Result<Self> {
        tokenizer
            .with_truncation(None)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        tokenizer.with_padding(None);
        Ok(Self { tokenizer })
    }

    /// The ids of `prompt`, exactly as `tokenizer(prompt, add_special_tokens=False)`.
    pub fn encode(&self, prompt: &str) -> anyhow::Result<Vec<u32>> {
        let encoding = self
            .tokenizer
            .encode(prompt, false)
            .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }
}

/// `text_token_tags` of a t2va prompt: every text row is tagged text.
pub fn text_token_tags(num_tokens: usize, device: &Device) -> Result<Tensor> {
    Tensor::full(super::transformer::TAG_TEXT as i64, num_tokens, device)
}

/// Qwen3-VL's text model: only the layers up to the hidden state read exist as blocks (the
/// rest, the final norm, `lm_head` and the vision tower never load). With the layers streamed,
/// the 152k-token table stays in host memory.
impl Blockwise for MiniMaxH3TextEncoder {
    type Config = Qwen3VLTextConfig;
    type Block = Qwen3DecoderLayer;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        Self::new(cfg, vb)
    }
    fn outer(cfg: &Self::Config, _: VarBuilder, host_vb: VarBuilder) -> Result<Self> {
        Self::new_without_layers(cfg, host_vb)
    }
    fn num_blocks(_: &Self::Config) -> usize {
        Self::layers_used()
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> Result<Self::Block> {
        Self::layer(cfg, i, vb)
    }
}
