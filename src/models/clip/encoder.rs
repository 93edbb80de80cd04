//! The pre-LayerNorm transformer layer shared by CLIP's vision and text towers (transformers'
//! `CLIPEncoderLayer`): LN -> multi-head attention -> residual, LN -> MLP -> residual.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{LayerNorm, Linear, VarBuilder};
use serde::Deserialize;

use crate::models::attention::sdpa;

/// `hidden_act` of a CLIP config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClipActivation {
    /// `x * sigmoid(1.702 x)` (OpenAI CLIP, CLIP-L text encoders).
    QuickGelu,
    /// Exact (erf) GELU (OpenCLIP ViT-H/14, the Wan image encoder).
    Gelu,
    /// tanh-approximated GELU.
    #[serde(alias = "gelu_pytorch_tanh")]
    GeluNew,
}

impl ClipActivation {
    fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::QuickGelu => x * candle_nn::ops::sigmoid(&(x * 1.702)?)?,
            Self::Gelu => x.gelu_erf(),
            Self::GeluNew => x.gelu(),
        }
    }
}

/// The sizes one encoder layer needs, taken from a vision or text config.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipEncoderConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub layer_norm_eps: f64,
    pub hidden_act: ClipActivation,
}

impl ClipEncoderConfig {
    /// Rejects sizes the layer cannot run, naming the config key.
    pub fn validate(&self) -> Result<()> {
        if self.hidden_size == 0 || self.intermediate_size == 0 {
            candle_core::bail!("clip config: hidden_size and intermediate_size must be positive")
        }
        if self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            candle_core::bail!(
                "clip config: num_attention_heads {} must divide hidden_size {}",
                self.num_attention_heads,
                self.hidden_size
            )
        }
        Ok(())
    }
}

/// transformers' `CLIPAttention`: biased q/k/v/out projections, scale 1/sqrt(head_dim).
#[derive(Debug, Clone)]
struct ClipAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    heads: usize,
}

impl ClipAttention {
    fn new(cfg: &ClipEncoderConfig, vb: VarBuilder) -> Result<Self> {
        let d = cfg.hidden_size;
        Ok(Self {
            q_proj: candle_nn::linear(d, d, vb.pp("q_proj"))?,
            k_proj: candle_nn::linear(d, d, vb.pp("k_proj"))?,
            v_proj: candle_nn::linear(d, d, vb.pp("v_proj"))?,
            out_proj: candle_nn::linear(d, d, vb.pp("out_proj"))?,
            heads: cfg.num_attention_heads,
        })
    }

    /// `x` `[B, L, D]`; `causal`: each position attends to itself and earlier ones only (the text
    /// tower), else to every position (the vision tower).
    fn forward(&self, x: &Tensor, causal: bool) -> Result<Tensor> {
        let (b, l, d) = x.dims3()?;
        let head_dim = d / self.heads;
        let split = |t: Tensor| -> Result<Tensor> {
            t.reshape((b, l, self.heads, head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = split(self.q_proj.forward(x)?)?;
        let k = split(self.k_proj.forward(x)?)?;
        let v = split(self.v_proj.forward(x)?)?;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let out = if causal {
            causal_attention(&q, &k, &v, scale)?
        } else {
            sdpa(&q, &k, &v, scale)?
        };
        let out = out.transpose(1, 2)?.reshape((b, l, d))?;
        self.out_proj.forward(&out)
    }
}

/// Softmax attention with a causal mask over `[B, H, L, head_dim]` (text lengths are small, so
/// the `[L, L]` scores are materialised); softmax in f32.
fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let l = q.dim(2)?;
    let mask: Vec<f32> = (0..l)
        .flat_map(|i| (0..l).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (l, l), q.device())?;
    let scores = (q
        .to_dtype(DType::F32)?
        .matmul(&k.to_dtype(DType::F32)?.t()?)?
        * scale)?
        .broadcast_add(&mask)?;
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    probs.to_dtype(v.dtype())?.matmul(v)
}

/// transformers' `CLIPEncoderLayer`.
#[derive(Debug, Clone)]
pub struct ClipEncoderLayer {
    layer_norm1: LayerNorm,
    self_attn: ClipAttention,
    layer_norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    act: ClipActivation,
}

impl ClipEncoderLayer {
    /// Loads one layer; `vb` points at `encoder.layers.{i}`.
    pub fn new(cfg: &ClipEncoderConfig, vb: VarBuilder) -> Result<Self> {
        let (d, eps) = (cfg.hidden_size, cfg.layer_norm_eps);
        Ok(Self {
            layer_norm1: candle_nn::layer_norm(d, eps, vb.pp("layer_norm1"))?,
            self_attn: ClipAttention::new(cfg, vb.pp("self_attn"))?,
            layer_norm2: candle_nn::layer_norm(d, eps, vb.pp("layer_norm2"))?,
            fc1: candle_nn::linear(d, cfg.intermediate_size, vb.pp("mlp.fc1"))?,
            fc2: candle_nn::linear(cfg.intermediate_size, d, vb.pp("mlp.fc2"))?,
            act: cfg.hidden_act,
        })
    }

    /// `x` `[B, L, D]` -> `[B, L, D]`.
    pub fn forward(&self, x: &Tensor, causal: bool) -> Result<Tensor> {
        let h = self
            .self_attn
            .forward(&self.layer_norm1.forward(x)?, causal)?;
        let x = (x + h)?;
        let h = self
            .act
            .apply(&self.fc1.forward(&self.layer_norm2.forward(&x)?)?)?;
        x + self.fc2.forward(&h)?
    }
}
