//! PixArt-α's conditioning layers, shared by the DiTs built on its blocks (Latte, Allegro):
//! `AdaLayerNormSingle` (one timestep MLP modulating every block), the caption projection and
//! the blocks' LayerNorms and projections, whose weights and biases a config may leave out.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{LayerNorm, LayerNormConfig, Linear, VarBuilder};

use crate::models::attention::sdpa;
use crate::models::wan::transformer::timestep_embedding;

/// Channels of the sinusoidal timestep embedding (`Timesteps(256, ...)` of PixArt-α).
const TIME_PROJ_DIM: usize = 256;

/// A LayerNorm over the last dim; without `affine` the checkpoint holds no weight or bias.
pub fn layer_norm(dim: usize, eps: f64, affine: bool, vb: VarBuilder) -> Result<LayerNorm> {
    if affine {
        let config = LayerNormConfig {
            eps,
            ..Default::default()
        };
        return candle_nn::layer_norm(dim, config, vb);
    }
    let ones = Tensor::ones(dim, vb.dtype(), vb.device())?;
    let zeros = Tensor::zeros(dim, vb.dtype(), vb.device())?;
    Ok(LayerNorm::new(ones, zeros, eps))
}

/// A linear layer with or without its bias (the blocks' `attention_bias`).
pub fn linear(cin: usize, cout: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    if bias {
        candle_nn::linear(cin, cout, vb)
    } else {
        candle_nn::linear_no_bias(cin, cout, vb)
    }
}

/// The blocks' multi-head `Attention`: q from the tokens, k and v from a context (the tokens
/// themselves, or the caption), heads as `[B, H, S, head_dim]`, then `to_out.0`.
#[derive(Debug, Clone)]
pub struct Attention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    heads: usize,
    head_dim: usize,
}

impl Attention {
    /// The attention under `vb` (`attn1`, `attn2`); `bias`: the q/k/v projections' biases.
    pub fn new(
        dim: usize,
        context_dim: usize,
        (heads, head_dim): (usize, usize),
        bias: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            to_q: linear(dim, dim, bias, vb.pp("to_q"))?,
            to_k: linear(context_dim, dim, bias, vb.pp("to_k"))?,
            to_v: linear(context_dim, dim, bias, vb.pp("to_v"))?,
            to_out: candle_nn::linear(dim, dim, vb.pp("to_out.0"))?,
            heads,
            head_dim,
        })
    }

    /// q of `x` and k, v of `context` (`[B', S, ·]`), each `[B', H, S, head_dim]`.
    pub fn heads(&self, x: &Tensor, context: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let split = |t: Tensor| -> Result<Tensor> {
            let (b, s, _) = t.dims3()?;
            t.reshape((b, s, self.heads, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        Ok((
            split(project(&self.to_q, x)?)?,
            split(project(&self.to_k, context)?)?,
            split(project(&self.to_v, context)?)?,
        ))
    }

    /// The attention's output `[B', H, S, head_dim]` merged and projected: `[B', S, D]`.
    pub fn merge(&self, out: Tensor) -> Result<Tensor> {
        let (b, _, s, _) = out.dims4()?;
        let out = out
            .transpose(1, 2)?
            .reshape((b, s, self.heads * self.head_dim))?;
        project(&self.to_out, &out)
    }

    /// The softmax scale, `1 / sqrt(head_dim)`.
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// `x` attending to `context`, unmasked.
    pub fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let (q, k, v) = self.heads(x, context)?;
        self.merge(sdpa(&q, &k, &v, self.scale())?)
    }
}

/// `linear` over every row of `x` `[B', S, ·]` as one matrix product: candle runs a 3-D input as
/// B' products against a broadcast weight, which wastes the GPU where B' is large and S small
/// (Latte's temporal blocks: 1024 sequences of 16 frames each).
fn project(linear: &Linear, x: &Tensor) -> Result<Tensor> {
    let (b, s, d) = x.dims3()?;
    linear.forward(&x.reshape((b * s, d))?)?.reshape((b, s, ()))
}

/// `AdaLayerNormSingle` without additional conditions: sinusoid (f32) → `timestep_embedder`
/// (linear, SiLU, linear) in the model dtype = the embedded timestep; SiLU → `linear` = the
/// blocks' `[B, 6·D]` modulation.
#[derive(Debug, Clone)]
pub struct AdaLayerNormSingle {
    linear_1: Linear,
    linear_2: Linear,
    linear: Linear,
    dtype: DType,
    device: Device,
}

impl AdaLayerNormSingle {
    /// The weights under `adaln_single` for hidden width `dim`.
    pub fn new(dim: usize, vb: VarBuilder) -> Result<Self> {
        let tvb = vb.pp("emb.timestep_embedder");
        Ok(Self {
            linear_1: candle_nn::linear(TIME_PROJ_DIM, dim, tvb.pp("linear_1"))?,
            linear_2: candle_nn::linear(dim, dim, tvb.pp("linear_2"))?,
            linear: candle_nn::linear(dim, 6 * dim, vb.pp("linear"))?,
            dtype: vb.dtype(),
            device: vb.device().clone(),
        })
    }

    /// `(modulation [B, 6·D], embedded timestep [B, D])` of `timestep` (`[B]` or one value for
    /// the whole batch; any dtype).
    pub fn forward(&self, timestep: &Tensor, batch: usize) -> Result<(Tensor, Tensor)> {
        let timestep = match timestep.elem_count() {
            1 if batch > 1 => timestep.flatten_all()?.repeat(batch)?,
            n if n == batch => timestep.flatten_all()?,
            n => candle_core::bail!("timestep has {n} values for a batch of {batch}"),
        };
        let t_proj = timestep_embedding(&timestep.to_device(&self.device)?, TIME_PROJ_DIM)?
            .to_dtype(self.dtype)?;
        let embedded = self
            .linear_2
            .forward(&self.linear_1.forward(&t_proj)?.silu()?)?;
        let modulation = self.linear.forward(&embedded.silu()?)?;
        Ok((modulation, embedded))
    }
}

/// `PixArtAlphaTextProjection`: linear, GELU (tanh), linear, in the model dtype.
#[derive(Debug, Clone)]
pub struct CaptionProjection {
    linear_1: Linear,
    linear_2: Linear,
    dtype: DType,
}

impl CaptionProjection {
    /// The weights under `caption_projection`: `caption_channels` in, `dim` out.
    pub fn new(caption_channels: usize, dim: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            linear_1: candle_nn::linear(caption_channels, dim, vb.pp("linear_1"))?,
            linear_2: candle_nn::linear(dim, dim, vb.pp("linear_2"))?,
            dtype: vb.dtype(),
        })
    }

    pub fn forward(&self, text: &Tensor) -> Result<Tensor> {
        let h = self.linear_1.forward(&text.to_dtype(self.dtype)?)?.gelu()?;
        self.linear_2.forward(&h)
    }
}
