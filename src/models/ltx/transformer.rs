//! LTX-Video's diffusion transformer (diffusers `LTXVideoTransformer3DModel`).
//!
//! It works on **packed** latents `[B, F·H·W, C]` (token order f, h, w; see [`LtxTransformerConfig::patch`]).
//! The forward pass is split like Wan's so an engine can stream the blocks:
//!
//! 1. [`LtxTransformer3DModel::prepare`]: `proj_in`, the AdaLayerNormSingle time embedding, the
//!    caption projection, the cross-attention mask bias and the RoPE tables.
//! 2. [`LtxTransformerBlock::forward`] for every block in order, starting from
//!    [`LtxBlockInputs::take_hidden_states`].
//! 3. [`LtxTransformer3DModel::finish`]: LayerNorm, modulation by the embedded timestep,
//!    `proj_out`.
//!
//! [`LtxTransformer3DModel::forward`] chains the three; [`LtxTransformer3DModel::new_without_blocks`]
//! holds no block weights (each block is built with [`LtxTransformerBlock::new`] from
//! `vb.pp("transformer_blocks.{i}")`).
//!
//! Norms and RoPE are computed in f32 and cast back to the model dtype, as diffusers does.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;

use crate::models::attention::{mask_prefix_lens, sdpa, sdpa_key_prefix, sdpa_with_bias};
use crate::models::blocks::HookedBlock;
use crate::models::hunyuan_video::transformer::norm_modulate_eps;
use crate::models::projection::{Input, Projection};
#[cfg(feature = "cuda")]
use crate::models::row_ops::{self, Act, BatchRow, Gate, Modulation, Rounding, Rows};
use crate::models::step_cache::{
    BlockHooks, BlockStreams, ComputeAll, HiddenStates, HookedBlocks, ModuleNames, Output,
    Submodule, Through,
};
use crate::models::video::{DitShape, VideoDit};
use crate::models::wan::transformer::timestep_embedding;

/// Largest width or patch size a config may give (far above any real model).
const MAX_SIZE: usize = 1 << 16;
/// Width of the sinusoidal timestep projection (`Timesteps(256)` in AdaLayerNormSingle).
const TIMESTEP_PROJ_DIM: usize = 256;
/// Epsilon of `LTXAttention`'s q/k RMSNorm (hard-coded in diffusers, not in the config).
const QK_NORM_EPS: f64 = 1e-5;
/// Epsilon of the output LayerNorm (hard-coded in diffusers).
const NORM_OUT_EPS: f64 = 1e-6;
/// Additive bias of a masked text key: diffusers' `(1 - mask) * -10000.0`.
const MASKED_KEY_BIAS: f64 = -10000.0;
/// RoPE bases of `LTXVideoRotaryPosEmbed`: frames, height, width, and theta.
const ROPE_BASE: [f64; 3] = [20.0, 2048.0, 2048.0];
const ROPE_THETA: f32 = 10000.0;

/// `transformer/config.json` of `LTXVideoTransformer3DModel`; missing keys take diffusers'
/// defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct LtxTransformerConfig {
    /// Channels of a packed latent token.
    pub in_channels: usize,
    /// `null` means "same as `in_channels`".
    pub out_channels: Option<usize>,
    /// Spatial patch of the packing (affects the RoPE coordinates).
    pub patch_size: usize,
    /// Temporal patch of the packing (affects the RoPE coordinates).
    pub patch_size_t: usize,
    pub num_attention_heads: usize,
    pub attention_head_dim: usize,
    /// Width of the text keys/values after the caption projection (must be the inner width).
    pub cross_attention_dim: usize,
    pub num_layers: usize,
    /// `gelu-approximate` (tanh) or `gelu` (erf) in the feed-forward.
    pub activation_fn: String,
    /// Only `rms_norm_across_heads` exists in diffusers.
    pub qk_norm: String,
    /// Whether the blocks' two RMSNorms have a weight.
    pub norm_elementwise_affine: bool,
    /// Epsilon of the blocks' RMSNorms.
    pub norm_eps: f64,
    /// Width of the text-encoder embeddings.
    pub caption_channels: usize,
    /// Whether q/k/v projections have biases.
    pub attention_bias: bool,
    /// Whether the attention output projection has a bias.
    pub attention_out_bias: bool,
    /// Not in the file: the blocks' Linears run in fp8 (`--fp8-matmul`, set by the pipeline);
    /// the embeddings' and projections' in and out stay exact.
    #[serde(skip)]
    pub fp8_matmul: bool,
}

impl Default for LtxTransformerConfig {
    fn default() -> Self {
        Self {
            in_channels: 128,
            out_channels: Some(128),
            patch_size: 1,
            patch_size_t: 1,
            num_attention_heads: 32,
            attention_head_dim: 64,
            cross_attention_dim: 2048,
            num_layers: 28,
            activation_fn: "gelu-approximate".into(),
            qk_norm: "rms_norm_across_heads".into(),
            norm_elementwise_affine: false,
            norm_eps: 1e-6,
            caption_channels: 4096,
            attention_bias: true,
            attention_out_bias: true,
            fp8_matmul: false,
        }
    }
}

impl LtxTransformerConfig {
    /// Model width: heads x head dim.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// The feed-forward's inner width (diffusers' `FeedForward` multiplies by 4).
    pub fn ff_inner_dim(&self) -> usize {
        4 * self.inner_dim()
    }

    /// Output channels (`out_channels or in_channels`).
    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// The patch `[p_t, p, p]` the pipeline packs latents into tokens by (`_pack_latents`, see
    /// [`crate::models::patches::patchify`]).
    pub fn patch(&self) -> [usize; 3] {
        [self.patch_size_t, self.patch_size, self.patch_size]
    }

    /// The pipeline's `rope_interpolation_scale`: (temporal compression / frame rate, spatial
    /// compression, spatial compression) of the VAE.
    pub fn rope_interpolation_scale(
        temporal_compression: usize,
        spatial_compression: usize,
        frame_rate: f64,
    ) -> [f64; 3] {
        [
            temporal_compression as f64 / frame_rate,
            spatial_compression as f64,
            spatial_compression as f64,
        ]
    }

    /// Rejects a config this model cannot run, with a one-line error naming the key.
    pub fn validate(&self) -> Result<()> {
        // Bounds far above any real model keep the size arithmetic from overflowing.
        for (key, value) in [
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels()),
            ("num_attention_heads", self.num_attention_heads),
            ("attention_head_dim", self.attention_head_dim),
            ("cross_attention_dim", self.cross_attention_dim),
            ("caption_channels", self.caption_channels),
            ("patch_size", self.patch_size),
            ("patch_size_t", self.patch_size_t),
        ] {
            if value > MAX_SIZE {
                candle_core::bail!(
                    "ltx transformer config: {key} {value} is larger than {MAX_SIZE}"
                );
            }
        }
        crate::models::config_checks::positive(
            "ltx transformer config",
            &[
                ("in_channels", self.in_channels),
                ("num_attention_heads", self.num_attention_heads),
                ("attention_head_dim", self.attention_head_dim),
                ("caption_channels", self.caption_channels),
                ("patch_size", self.patch_size),
                ("patch_size_t", self.patch_size_t),
                ("out_channels", self.out_channels()),
            ],
        )?;
        if self.inner_dim() < 6 || !self.inner_dim().is_multiple_of(2) {
            candle_core::bail!(
                "ltx transformer config: num_attention_heads x attention_head_dim = {} must be even and at least 6 (RoPE)",
                self.inner_dim()
            );
        }
        if self.cross_attention_dim != self.inner_dim() {
            candle_core::bail!(
                "ltx transformer config: cross_attention_dim {} must equal num_attention_heads x attention_head_dim = {}",
                self.cross_attention_dim,
                self.inner_dim()
            );
        }
        crate::models::config_checks::one_of(
            "ltx transformer config",
            ("qk_norm", &self.qk_norm),
            &["rms_norm_across_heads"],
        )?;
        self.gelu()?;
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            candle_core::bail!(
                "ltx transformer config: norm_eps must be a finite non-negative number"
            );
        }
        Ok(())
    }

    /// Whether the feed-forward GELU is the tanh approximation.
    fn gelu(&self) -> Result<bool> {
        match self.activation_fn.as_str() {
            "gelu-approximate" => Ok(true),
            "gelu" => Ok(false),
            other => candle_core::bail!(
                "ltx transformer config: activation_fn {other:?} is not supported (\"gelu-approximate\" or \"gelu\")"
            ),
        }
    }
}

impl VideoDit for LtxTransformerConfig {
    fn dit_shape(&self) -> DitShape {
        DitShape::of(self.num_layers, self.inner_dim(), self.in_channels)
    }
}

/// `torch.linspace(start, end, steps)` in f32: `start + i*step` for the first half,
/// `end - (steps-1-i)*step` for the second, as ATen computes it.
fn torch_linspace_f32(start: f32, end: f32, steps: usize) -> Vec<f32> {
    if steps == 1 {
        return vec![start];
    }
    let step = (end - start) / (steps - 1) as f32;
    let halfway = steps / 2;
    (0..steps)
        .map(|i| {
            if i < halfway {
                start + step * i as f32
            } else {
                end - step * (steps - 1 - i) as f32
            }
        })
        .collect()
}

/// `LTXVideoRotaryPosEmbed` for a `num_frames x height x width` token grid, one entry per
/// interleaved pair: (cos, sin), each `[F·H·W, dim / 2]` f32 — per frequency the (f, h, w)
/// angles, after `dim % 6 / 2` padding entries (cos 1, sin 0). Every angle is diffusers' f32
/// arithmetic; the per-axis values are computed once on the host and gathered on `device`.
pub fn rope_pair_tables(
    dim: usize,
    grid: [usize; 3],
    rope_interpolation_scale: [f64; 3],
    patch: [usize; 3],
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let n = dim / 6;
    let freqs: Vec<f32> = torch_linspace_f32(0.0, 1.0, n)
        .into_iter()
        .map(|e| ROPE_THETA.powf(e) * std::f32::consts::PI / 2.0)
        .collect();
    let [frames, height, width] = grid;
    let tokens = frames * height * width;
    // Per axis a `[len, n]` table; per token the axis index to gather.
    let mut cos_parts = Vec::with_capacity(3);
    let mut sin_parts = Vec::with_capacity(3);
    for (axis, len) in grid.into_iter().enumerate() {
        let mut cos = Vec::with_capacity(len * n);
        let mut sin = Vec::with_capacity(len * n);
        for i in 0..len {
            // i * scale * patch / base, op by op in f32.
            let coord = i as f32 * rope_interpolation_scale[axis] as f32 * patch[axis] as f32
                / ROPE_BASE[axis] as f32;
            for &freq in &freqs {
                let (s, c) = (freq * (coord * 2.0 - 1.0)).sin_cos();
                cos.push(c);
                sin.push(s);
            }
        }
        let index: Vec<u32> = (0..tokens)
            .map(|t| match axis {
                0 => t / (height * width),
                1 => t / width % height,
                _ => t % width,
            } as u32)
            .collect();
        let index = Tensor::from_vec(index, tokens, device)?;
        let gather = |v: Vec<f32>| Tensor::from_vec(v, (len, n), device)?.index_select(&index, 0);
        cos_parts.push(gather(cos)?);
        sin_parts.push(gather(sin)?);
    }
    // [S, n, 3] -> [S, 3n]: for each frequency the (f, h, w) angles.
    let interleave = |parts: &[Tensor]| Tensor::stack(parts, 2)?.reshape((tokens, 3 * n));
    let (cos, sin) = (interleave(&cos_parts)?, interleave(&sin_parts)?);
    let pad = dim / 2 - 3 * n;
    if pad == 0 {
        return Ok((cos, sin));
    }
    Ok((
        Tensor::cat(
            &[&Tensor::ones((tokens, pad), DType::F32, device)?, &cos],
            1,
        )?,
        Tensor::cat(
            &[&Tensor::zeros((tokens, pad), DType::F32, device)?, &sin],
            1,
        )?,
    ))
}

/// [`rope_pair_tables`] in diffusers' full layout `[F·H·W, dim]` (every entry repeated for
/// both members of its pair), as `LTXVideoRotaryPosEmbed` returns it.
pub fn rope_tables(
    dim: usize,
    grid: [usize; 3],
    rope_interpolation_scale: [f64; 3],
    patch: [usize; 3],
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let (cos, sin) = rope_pair_tables(dim, grid, rope_interpolation_scale, patch, device)?;
    let full = |t: Tensor| -> Result<Tensor> {
        let (s, half) = t.dims2()?;
        t.unsqueeze(2)?
            .broadcast_as((s, half, 2))?
            .reshape((s, 2 * half))
    };
    Ok((full(cos)?, full(sin)?))
}

/// RMSNorm over the last dim computed in f32 (diffusers' `RMSNorm`), optionally scaled by a
/// weight, cast back to `x`'s dtype.
fn rms_norm(x: &Tensor, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let xf = x.to_dtype(DType::F32)?;
    let inv = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let y = xf.broadcast_mul(&inv)?;
    let y = match weight {
        Some(w) => y.broadcast_mul(&w.to_dtype(DType::F32)?)?,
        None => y,
    };
    y.to_dtype(x.dtype())
}

/// `x * (1 + scale) + shift` with `[B, 1, dim]` modulation.
fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    x.broadcast_mul(&(scale + 1.0)?)?.broadcast_add(shift)
}

/// Linear -> GELU (tanh) -> Linear: the caption projection (`linear_1`, `linear_2`).
#[derive(Debug, Clone)]
struct GeluMlp {
    fc1: Linear,
    fc2: Linear,
}

impl GeluMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.gelu()?)
    }
}

/// `LTXAttention`: RMSNorm across heads (with weight) on q and k, RoPE over the whole inner
/// dim for self-attention, the masked text keys for cross-attention.
#[derive(Debug, Clone)]
struct LtxAttention {
    to_q: Projection,
    to_k: Projection,
    to_v: Projection,
    to_out: Projection,
    norm_q: Tensor,
    norm_k: Tensor,
    heads: usize,
    head_dim: usize,
}

impl LtxAttention {
    fn new(cfg: &LtxTransformerConfig, kv_dim: usize, vb: VarBuilder) -> Result<Self> {
        let dim = cfg.inner_dim();
        let (bias, fp8) = (cfg.attention_bias, cfg.fp8_matmul);
        Ok(Self {
            to_q: Projection::load_with((dim, dim), bias, vb.pp("to_q"), fp8)?,
            to_k: Projection::load_with((kv_dim, dim), bias, vb.pp("to_k"), fp8)?,
            to_v: Projection::load_with((kv_dim, dim), bias, vb.pp("to_v"), fp8)?,
            to_out: Projection::load_with(
                (dim, dim),
                cfg.attention_out_bias,
                vb.pp("to_out.0"),
                fp8,
            )?,
            norm_q: vb.get(dim, "norm_q.weight")?,
            norm_k: vb.get(dim, "norm_k.weight")?,
            heads: cfg.num_attention_heads,
            head_dim: cfg.attention_head_dim,
        })
    }

    /// The fused-kernel [`Self::forward`] on `x` `[B·S, dim]` (`b` batch entries), bf16 on
    /// CUDA; returns the output projection *without* its bias (the residual kernel adds it).
    #[cfg(feature = "cuda")]
    fn forward_fused(
        &self,
        x: &Tensor,
        b: usize,
        context: Option<&Tensor>,
        rope: Option<(&Tensor, &Tensor)>,
        keys: &TextKeys,
    ) -> Result<Tensor> {
        let (rows, dim) = x.dims2()?;
        let s = rows / b;
        // One input for q, k and v (k and v over the text): quantized once under
        // `--fp8-matmul`.
        let x = Input::new(x);
        let text = match context {
            Some(c) => Some(Input::new(&c.reshape(((), c.dim(2)?))?)),
            None => None,
        };
        let kv = text.as_ref().unwrap_or(&x);
        let kv_len = kv.dims2()?.0 / b;
        let q = row_ops::rms_rope(
            self.to_q.product(&x)?,
            self.to_q.bias(),
            &self.norm_q,
            rope,
            dim,
            Rows { row0: 0, seq: s },
            QK_NORM_EPS,
            Rounding::Bf16,
        )?;
        let k = row_ops::rms_rope(
            self.to_k.product(kv)?,
            self.to_k.bias(),
            &self.norm_k,
            rope,
            dim,
            Rows {
                row0: 0,
                seq: kv_len,
            },
            QK_NORM_EPS,
            Rounding::Bf16,
        )?;
        let v = self.to_v.apply(kv, false)?;
        let split = |t: Tensor, n: usize| {
            t.reshape((b, n, self.heads, self.head_dim))?
                .transpose(1, 2)
        };
        let (q, k, v) = (split(q, s)?, split(k, kv_len)?, split(v, kv_len)?);
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let out = keys.attend(&q, &k, &v, scale)?;
        self.to_out
            .product(&Input::new(&out.transpose(1, 2)?.reshape((rows, dim))?))
    }

    /// `x` `[B, S, dim]` attending to itself (`context` `None`, RoPE from `rope`) or to
    /// `context` `[B, L, kv_dim]` through the text keys `keys` lets it see.
    fn forward(
        &self,
        x: &Tensor,
        context: Option<&Tensor>,
        rope: Option<(&Tensor, &Tensor)>,
        keys: &TextKeys,
    ) -> Result<Tensor> {
        let (b, s, dim) = x.dims3()?;
        let kv_len = context.map_or(Ok(s), |c| c.dim(1))?;
        // One input for q, k and v (k and v over the text): quantized once under
        // `--fp8-matmul`.
        let x = Input::new(x);
        let text = context.map(Input::new);
        let kv = text.as_ref().unwrap_or(&x);
        let mut q = rms_norm(
            &self.to_q.apply(&x, false)?,
            Some(&self.norm_q),
            QK_NORM_EPS,
        )?;
        let mut k = rms_norm(
            &self.to_k.apply(kv, false)?,
            Some(&self.norm_k),
            QK_NORM_EPS,
        )?;
        let v = self.to_v.apply(kv, false)?;
        if let Some((cos, sin)) = rope {
            q = apply_rope(&q, cos, sin)?;
            k = apply_rope(&k, cos, sin)?;
        }
        let split = |t: Tensor, n: usize| {
            t.reshape((b, n, self.heads, self.head_dim))?
                .transpose(1, 2)
        };
        let (q, k, v) = (split(q, s)?, split(k, kv_len)?, split(v, kv_len)?);
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let out = keys.attend(&q, &k, &v, scale)?;
        self.to_out.apply(
            &Input::new(&out.transpose(1, 2)?.reshape((b, s, dim))?),
            false,
        )
    }
}

/// The text keys cross-attention sees, from the tokenizer's keep-mask.
#[derive(Debug, Clone)]
pub enum TextKeys {
    /// Every key (no mask).
    All,
    /// The first `n[b]` keys of batch entry `b`: a padding mask, run as a selection of keys
    /// through the fused attention. diffusers adds -10000 to the other keys' scores; their
    /// softmax weights underflow to exactly 0, so the result is the same.
    Prefix(Vec<usize>),
    /// diffusers' additive `[B, 1, 1, L]` bias (0 or -10000), for a mask that is not a prefix.
    Bias(Tensor),
}

impl TextKeys {
    /// From a `[B, L]` keep-mask (1 keep, 0 masked) for scores of `dtype`.
    fn from_mask(mask: &Tensor, dtype: DType) -> Result<Self> {
        if let Some(lens) = mask_prefix_lens(mask)? {
            return Ok(TextKeys::Prefix(lens));
        }
        let (b, len) = mask.dims2()?;
        Ok(TextKeys::Bias(
            mask.to_dtype(dtype)?
                .affine(-1.0, 1.0)?
                .affine(MASKED_KEY_BIAS, 0.0)?
                .reshape((b, 1, 1, len))?,
        ))
    }

    /// Attention of `q` `[B, H, S, D]` over the keys and values `[B, H, L, D]` it sees.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        match self {
            TextKeys::All => sdpa(q, k, v, scale),
            TextKeys::Prefix(lens) => sdpa_key_prefix(q, k, v, scale, lens),
            TextKeys::Bias(bias) => sdpa_with_bias(q, k, v, scale, bias),
        }
    }
}

/// diffusers' LTX `apply_rotary_emb` on `[B, S, dim]` with the half tables `[S, dim/2]`
/// (one entry per interleaved pair), computed in f32 and cast back.
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, s, dim) = x.dims3()?;
    let xf = x
        .to_dtype(DType::F32)?
        .reshape((b, 1, s, dim))?
        .contiguous()?;
    candle_nn::rotary_emb::rope_i(&xf, cos, sin)?
        .reshape((b, s, dim))?
        .to_dtype(x.dtype())
}

/// What every block and the output head need, computed once per forward by `prepare`.
#[derive(Debug, Clone)]
pub struct LtxBlockInputs {
    hidden_states: Option<Tensor>,
    /// Per-block modulation `[B, 1, 6·inner]` (AdaLayerNormSingle's `temb`).
    pub temb: Tensor,
    /// `[B, 1, inner]`: modulates the output head.
    pub embedded_timestep: Tensor,
    /// Projected text `[B, L, inner]`: keys and values of cross-attention.
    pub encoder_hidden_states: Tensor,
    /// The text keys cross-attention sees.
    pub text_keys: TextKeys,
    /// RoPE cosines `[S, inner/2]` in f32, one per interleaved pair.
    pub rope_cos: Tensor,
    /// RoPE sines, same layout.
    pub rope_sin: Tensor,
}

impl LtxBlockInputs {
    /// Takes the projected tokens `[B, S, inner]` that feed block 0 (once).
    pub fn take_hidden_states(&mut self) -> Result<Tensor> {
        self.hidden_states
            .take()
            .ok_or_else(|| candle_core::Error::Msg("block-0 hidden states already taken".into()))
    }
}

/// The steps of a block, in execution order. A block can be built with only some of them (an
/// offload engine streaming steps rather than whole blocks); running such a partial block
/// applies just its steps, with exactly the arithmetic of the whole block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockStep {
    /// `norm1` (RMSNorm) with modulation, self-attention with RoPE, gated residual.
    SelfAttention,
    /// Cross-attention to the projected text, residual.
    CrossAttention,
    /// `norm2` with modulation, the feed-forward's first Linear and GELU: its output is carried
    /// to the next step ([`LtxStream`]).
    FeedForwardIn,
    /// The feed-forward's second Linear, gated residual.
    FeedForwardOut,
}

impl BlockStep {
    /// The feed-forward is two steps so that every step holds about a quarter of a block: the
    /// copy stream can then run the next block's steps in behind the self-attention, the one
    /// step with much to compute.
    pub const ALL: [BlockStep; 4] = [
        BlockStep::SelfAttention,
        BlockStep::CrossAttention,
        BlockStep::FeedForwardIn,
        BlockStep::FeedForwardOut,
    ];
}

/// What flows from block to block (and from step to step within one).
#[derive(Debug, Clone)]
pub struct LtxStream {
    /// The hidden states `[B, S, inner]`.
    pub x: Tensor,
    /// The feed-forward's inner activations between [`BlockStep::FeedForwardIn`] and
    /// [`BlockStep::FeedForwardOut`] (`None` between blocks).
    ff_hidden: Option<Tensor>,
}

impl LtxStream {
    pub fn new(x: Tensor) -> Self {
        LtxStream { x, ff_hidden: None }
    }

    /// The hidden states after the last block.
    pub fn into_hidden(self) -> Result<Tensor> {
        if self.ff_hidden.is_some() {
            candle_core::bail!("LTX blocks stopped inside a feed-forward");
        }
        Ok(self.x)
    }

    fn take_ff_hidden(&mut self) -> Result<Tensor> {
        self.ff_hidden.take().ok_or_else(|| {
            candle_core::Error::Msg("LTX feed-forward output step without its input step".into())
        })
    }
}

/// One `LTXVideoTransformerBlock` (or some of its steps, see [`BlockStep`]).
#[derive(Debug, Clone)]
pub struct LtxTransformerBlock {
    /// `norm1`'s weight (when affine) and `attn1`.
    attn1: Option<(Option<Tensor>, LtxAttention)>,
    attn2: Option<LtxAttention>,
    /// `norm2`'s weight (when affine) and `ff.net.0.proj`.
    ff_in: Option<(Option<Tensor>, Projection)>,
    /// `ff.net.2`.
    ff_out: Option<Projection>,
    /// The block's `[6, inner]` modulation table, held by each modulated step.
    scale_shift_table: Option<Tensor>,
    /// GELU's tanh approximation (else exact).
    tanh: bool,
    eps: f64,
}

impl LtxTransformerBlock {
    /// Loads one block from `vb` = `transformer_blocks.{i}`.
    pub fn new(cfg: &LtxTransformerConfig, vb: VarBuilder) -> Result<Self> {
        Self::with_steps(cfg, vb, &BlockStep::ALL)
    }

    /// Loads only the weights of `steps`; `vb` points at `transformer_blocks.{i}`.
    pub fn with_steps(
        cfg: &LtxTransformerConfig,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self> {
        cfg.validate()?;
        let (dim, ff_inner, fp8) = (cfg.inner_dim(), cfg.ff_inner_dim(), cfg.fp8_matmul);
        let has = |s| steps.contains(&s);
        let norm = |name: &str| -> Result<Option<Tensor>> {
            if cfg.norm_elementwise_affine {
                Ok(Some(vb.pp(name).get(dim, "weight")?))
            } else {
                Ok(None)
            }
        };
        let attn1 = if has(BlockStep::SelfAttention) {
            Some((norm("norm1")?, LtxAttention::new(cfg, dim, vb.pp("attn1"))?))
        } else {
            None
        };
        let attn2 = if has(BlockStep::CrossAttention) {
            Some(LtxAttention::new(
                cfg,
                cfg.cross_attention_dim,
                vb.pp("attn2"),
            )?)
        } else {
            None
        };
        let ff_in = if has(BlockStep::FeedForwardIn) {
            Some((
                norm("norm2")?,
                Projection::load((dim, ff_inner), vb.pp("ff.net.0.proj"), fp8)?,
            ))
        } else {
            None
        };
        let ff_out = if has(BlockStep::FeedForwardOut) {
            Some(Projection::load((ff_inner, dim), vb.pp("ff.net.2"), fp8)?)
        } else {
            None
        };
        let modulated = attn1.is_some() || ff_in.is_some() || ff_out.is_some();
        Ok(Self {
            attn1,
            attn2,
            ff_in,
            ff_out,
            scale_shift_table: if modulated {
                Some(vb.get((6, dim), "scale_shift_table")?)
            } else {
                None
            },
            tanh: cfg.gelu()?,
            eps: cfg.norm_eps,
        })
    }

    /// Runs the block's steps on `stream` (`x` `[B, S, inner]`): the fused kernels on CUDA
    /// bf16, else the candle composition (both compute the same ops in the same order).
    pub fn forward(&self, stream: LtxStream, inputs: &LtxBlockInputs) -> Result<LtxStream> {
        self.run(stream, inputs, &mut ComputeAll)
    }

    /// [`Self::forward`], asking `hooks` (a step cache) for the outputs of `attn1` and `attn2`
    /// (the latter as [`Submodule::UnflaggedCrossAttention`]: diffusers' `LTXAttention` is not
    /// flagged as cross-attention, so PAB gives it the spatial settings).
    fn run(
        &self,
        stream: LtxStream,
        inputs: &LtxBlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<LtxStream> {
        let (b, _, dim) = stream.x.dims3()?;
        // [B, 1, 6, inner] = table + temb; unbind the 6 rows.
        let ada = match &self.scale_shift_table {
            Some(table) => Some(
                inputs
                    .temb
                    .reshape((b, 1, 6, dim))?
                    .broadcast_add(&table.unsqueeze(0)?.unsqueeze(0)?)?,
            ),
            None => None,
        };
        #[cfg(feature = "cuda")]
        if row_ops::rows_supported(&stream.x) && inputs.temb.dtype() == DType::BF16 {
            return self.forward_fused(stream, inputs, ada.as_ref(), hooks);
        }
        self.forward_composite(stream, inputs, ada.as_ref(), hooks)
    }

    /// [`Self::forward`] as fused kernels: each norm + modulation, q/k bias + norm + RoPE,
    /// bias + GELU and bias + gate + residual is one pass over bf16 storage.
    #[cfg(feature = "cuda")]
    fn forward_fused(
        &self,
        mut stream: LtxStream,
        inputs: &LtxBlockInputs,
        ada: Option<&Tensor>,
        hooks: &mut dyn BlockHooks,
    ) -> Result<LtxStream> {
        let (b, s, dim) = stream.x.dims3()?;
        let at = Rows { row0: 0, seq: s };
        let ada = ada.map(|a| a.reshape((b, 6 * dim))).transpose()?;
        let modulation = |shift: usize, scale: usize| {
            ada.as_ref().map(|table| Modulation {
                table,
                stride: 6 * dim,
                shift: shift * dim,
                scale: scale * dim,
                text: None,
                rows: None,
            })
        };
        let gate = |i: usize| {
            ada.as_ref().map(|table| {
                Gate::Bf16(BatchRow {
                    table,
                    stride: 6 * dim,
                    offset: i * dim,
                    text: None,
                    rows: None,
                })
            })
        };
        let mut x = stream.x.reshape((b * s, dim))?;
        if let Some((norm1, attn1)) = &self.attn1 {
            let h = row_ops::rms_modulate(&x, norm1.as_ref(), modulation(0, 1), at, self.eps)?;
            let rope = (&inputs.rope_cos, &inputs.rope_sin);
            let compute = || attn1.forward_fused(&h, b, None, Some(rope), &TextKeys::All);
            let module = Submodule::SelfAttention;
            let (attn, bias) = crate::models::step_cache::whole_output(
                hooks,
                module,
                compute,
                attn1.to_out.bias(),
            )?;
            x = row_ops::residual_into_delta(&x, attn, bias, gate(2), at)?;
        }
        if let Some(attn2) = &self.attn2 {
            let text = Some(&inputs.encoder_hidden_states);
            let compute = || attn2.forward_fused(&x, b, text, None, &inputs.text_keys);
            let module = Submodule::UnflaggedCrossAttention;
            let (attn, bias) = crate::models::step_cache::whole_output(
                hooks,
                module,
                compute,
                attn2.to_out.bias(),
            )?;
            x = row_ops::residual_into_delta(&x, attn, bias, None, at)?;
        }
        // The feed-forward's input step: norm2 with modulation, the first Linear and GELU.
        let ff_hidden =
            |x: &Tensor, (norm2, fc1): &(Option<Tensor>, Projection)| -> Result<Tensor> {
                let h = row_ops::rms_modulate(x, norm2.as_ref(), modulation(3, 4), at, self.eps)?;
                let h = Input::new(&h);
                if self.tanh {
                    return fc1.apply(&h, true);
                }
                // GELU (erf) has no product epilogue: one pass adds the bias and applies it.
                match fc1.bias() {
                    Some(bias) => row_ops::bias_act(fc1.product(&h)?, bias, Act::GeluErf),
                    None => fc1.product(&h)?.gelu_erf(),
                }
            };
        match (&self.ff_in, &self.ff_out) {
            // A whole feed-forward: the module `ff` a step cache hooks.
            (Some(ff_in), Some(fc2)) => {
                let compute = || fc2.product(&Input::new(&ff_hidden(&x, ff_in)?));
                let module = Submodule::FeedForward;
                let (out, bias) =
                    crate::models::step_cache::whole_output(hooks, module, compute, fc2.bias())?;
                x = row_ops::residual_into_delta(&x, out, bias, gate(5), at)?;
            }
            (ff_in, ff_out) => {
                if let Some(ff_in) = ff_in {
                    stream.ff_hidden = Some(ff_hidden(&x, ff_in)?);
                }
                if let Some(fc2) = ff_out {
                    let out = fc2.product(&Input::new(&stream.take_ff_hidden()?))?;
                    x = row_ops::residual_into_delta(&x, out, fc2.bias(), gate(5), at)?;
                }
            }
        }
        stream.x = x.reshape((b, s, dim))?;
        Ok(stream)
    }

    /// [`Self::forward`] as candle ops (CPU, f32, other dtypes); `ada` `[B, 1, 6, inner]`.
    fn forward_composite(
        &self,
        mut stream: LtxStream,
        inputs: &LtxBlockInputs,
        ada: Option<&Tensor>,
        hooks: &mut dyn BlockHooks,
    ) -> Result<LtxStream> {
        let row = |i: usize| -> Result<Tensor> {
            let ada = ada.ok_or_else(|| {
                candle_core::Error::Msg("LTX block step without its modulation table".into())
            })?;
            ada.narrow(2, i, 1)?.squeeze(2)
        };
        let mut x = stream.x.clone();
        if let Some((norm1, attn1)) = &self.attn1 {
            let h = modulate(&rms_norm(&x, norm1.as_ref(), self.eps)?, &row(0)?, &row(1)?)?;
            let rope = (&inputs.rope_cos, &inputs.rope_sin);
            let attn = hooks.output(Submodule::SelfAttention, &mut || {
                attn1.forward(&h, None, Some(rope), &TextKeys::All)
            })?;
            x = (x + attn.broadcast_mul(&row(2)?)?)?;
        }
        if let Some(attn2) = &self.attn2 {
            let text = Some(&inputs.encoder_hidden_states);
            let attn = hooks.output(Submodule::UnflaggedCrossAttention, &mut || {
                attn2.forward(&x, text, None, &inputs.text_keys)
            })?;
            x = (x + attn)?;
        }
        // The feed-forward's input step: norm2 with modulation, the first Linear and GELU.
        let ff_hidden =
            |x: &Tensor, (norm2, fc1): &(Option<Tensor>, Projection)| -> Result<Tensor> {
                let h = modulate(&rms_norm(x, norm2.as_ref(), self.eps)?, &row(3)?, &row(4)?)?;
                let h = fc1.apply(&Input::new(&h), self.tanh)?;
                if self.tanh {
                    Ok(h)
                } else {
                    h.gelu_erf()
                }
            };
        match (&self.ff_in, &self.ff_out) {
            // A whole feed-forward: the module `ff` a step cache hooks.
            (Some(ff_in), Some(fc2)) => {
                let out = hooks.output(Submodule::FeedForward, &mut || {
                    fc2.apply(&Input::new(&ff_hidden(&x, ff_in)?), false)
                })?;
                x = (&x + out.broadcast_mul(&row(5)?)?)?;
            }
            (ff_in, ff_out) => {
                if let Some(ff_in) = ff_in {
                    stream.ff_hidden = Some(ff_hidden(&x, ff_in)?);
                }
                if let Some(fc2) = ff_out {
                    let out = fc2.apply(&Input::new(&stream.take_ff_hidden()?), false)?;
                    x = (&x + out.broadcast_mul(&row(5)?)?)?;
                }
            }
        }
        stream.x = x;
        Ok(stream)
    }
}

/// diffusers' `LTXVideoTransformer3DModel`.
#[derive(Debug, Clone)]
pub struct LtxTransformer3DModel {
    cfg: LtxTransformerConfig,
    proj_in: Linear,
    /// `time_embed.emb.timestep_embedder` linear_1 / linear_2.
    time_linear_1: Linear,
    time_linear_2: Linear,
    /// `time_embed.linear`: embedded timestep -> 6·inner block modulation.
    time_linear: Linear,
    caption_projection: GeluMlp,
    scale_shift_table: Tensor,
    proj_out: Linear,
    blocks: Vec<LtxTransformerBlock>,
}

impl LtxTransformer3DModel {
    /// Loads the whole model from `vb` (`transformer/diffusion_pytorch_model*.safetensors`).
    pub fn new(cfg: &LtxTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Everything but the blocks (for an engine that streams them).
    pub fn new_without_blocks(cfg: &LtxTransformerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let temb = vb.pp("time_embed");
        Ok(Self {
            cfg: cfg.clone(),
            proj_in: candle_nn::linear(cfg.in_channels, dim, vb.pp("proj_in"))?,
            time_linear_1: candle_nn::linear(
                TIMESTEP_PROJ_DIM,
                dim,
                temb.pp("emb.timestep_embedder.linear_1"),
            )?,
            time_linear_2: candle_nn::linear(dim, dim, temb.pp("emb.timestep_embedder.linear_2"))?,
            time_linear: candle_nn::linear(dim, 6 * dim, temb.pp("linear"))?,
            caption_projection: GeluMlp {
                fc1: candle_nn::linear(
                    cfg.caption_channels,
                    dim,
                    vb.pp("caption_projection.linear_1"),
                )?,
                fc2: candle_nn::linear(dim, dim, vb.pp("caption_projection.linear_2"))?,
            },
            scale_shift_table: vb.get((2, dim), "scale_shift_table")?,
            proj_out: candle_nn::linear(dim, cfg.out_channels(), vb.pp("proj_out"))?,
            blocks: Vec::new(),
        })
    }

    pub fn config(&self) -> &LtxTransformerConfig {
        &self.cfg
    }

    /// The blocks in order (empty for a model built without them).
    pub fn blocks(&self) -> &[LtxTransformerBlock] {
        &self.blocks
    }

    /// AdaLayerNormSingle: (`temb` `[B, 6·inner]`, `embedded_timestep` `[B, inner]`) of float
    /// timesteps `[B]` (σ·1000, not truncated), in `dtype`.
    pub fn time_embedding(&self, timestep: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let proj = timestep_embedding(timestep, TIMESTEP_PROJ_DIM)?.to_dtype(dtype)?;
        let embedded = self
            .time_linear_2
            .forward(&self.time_linear_1.forward(&proj)?.silu()?)?;
        let temb = self.time_linear.forward(&embedded.silu()?)?;
        Ok((temb, embedded))
    }

    /// Everything before the blocks. `hidden_states`: packed latents `[B, S, in_channels]` of a
    /// `grid` = (frames, height, width) token grid; `encoder_hidden_states` `[B, L,
    /// caption_channels]`; `timestep` `[B]` (or one value for the batch); `encoder_attention_mask`
    /// `[B, L]` (1 keep, 0 masked), `None` for no mask; `rope_interpolation_scale` as
    /// [`LtxTransformerConfig::rope_interpolation_scale`] gives it.
    pub fn prepare(
        &self,
        hidden_states: &Tensor,
        encoder_hidden_states: &Tensor,
        timestep: &Tensor,
        encoder_attention_mask: Option<&Tensor>,
        grid: [usize; 3],
        rope_interpolation_scale: [f64; 3],
    ) -> Result<LtxBlockInputs> {
        let (b, s, _) = hidden_states.dims3()?;
        if s != grid.iter().product::<usize>() {
            candle_core::bail!("{s} latent tokens for a {grid:?} grid");
        }
        let dtype = hidden_states.dtype();
        let device = hidden_states.device();
        let dim = self.cfg.inner_dim();
        let (rope_cos, rope_sin) = rope_pair_tables(
            dim,
            grid,
            rope_interpolation_scale,
            [
                self.cfg.patch_size_t,
                self.cfg.patch_size,
                self.cfg.patch_size,
            ],
            device,
        )?;
        let text_keys = match encoder_attention_mask {
            Some(mask) => TextKeys::from_mask(mask, dtype)?,
            None => TextKeys::All,
        };
        let timestep = timestep.flatten_all()?;
        let timestep = if timestep.dim(0)? == 1 && b > 1 {
            timestep.broadcast_as(b)?.contiguous()?
        } else {
            timestep
        };
        let (temb, embedded) = self.time_embedding(&timestep, dtype)?;
        let caption = self.caption_projection.forward(encoder_hidden_states)?;
        Ok(LtxBlockInputs {
            hidden_states: Some(self.proj_in.forward(hidden_states)?),
            temb: temb.reshape((b, 1, 6 * dim))?,
            embedded_timestep: embedded.reshape((b, 1, dim))?,
            encoder_hidden_states: caption,
            text_keys,
            rope_cos,
            rope_sin,
        })
    }

    /// After the blocks: LayerNorm (no affine), modulation by the embedded timestep,
    /// `proj_out`: `[B, S, out_channels]`.
    pub fn finish(&self, x: &Tensor, inputs: &LtxBlockInputs) -> Result<Tensor> {
        self.finish_projecting(x, inputs, &mut |compute| compute())
    }

    /// [`Self::finish`], the output projection's output through `project` (a step cache's,
    /// which may stand in for it).
    pub fn finish_projecting(
        &self,
        x: &Tensor,
        inputs: &LtxBlockInputs,
        project: &mut Through,
    ) -> Result<Tensor> {
        let (b, _, dim) = x.dims3()?;
        let ss = inputs
            .embedded_timestep
            .reshape((b, 1, 1, dim))?
            .broadcast_add(&self.scale_shift_table.unsqueeze(0)?.unsqueeze(0)?)?;
        let row = |i| ss.narrow(2, i, 1)?.squeeze(2)?.squeeze(1);
        // The LayerNorm (no affine) and modulation, fused on CUDA as HunyuanVideo's head: one
        // bf16 output where the composite held f32 copies of every token.
        let normed = norm_modulate_eps(x, &row(0)?, &row(1)?, NORM_OUT_EPS)?;
        project(&mut || self.proj_out.forward(&normed))
    }

    /// The whole forward: [`Self::prepare`], the blocks in order, [`Self::finish`].
    pub fn forward(
        &self,
        hidden_states: &Tensor,
        encoder_hidden_states: &Tensor,
        timestep: &Tensor,
        encoder_attention_mask: Option<&Tensor>,
        grid: [usize; 3],
        rope_interpolation_scale: [f64; 3],
    ) -> Result<Tensor> {
        if self.blocks.len() != self.cfg.num_layers {
            candle_core::bail!("this transformer was built without its blocks");
        }
        let mut inputs = self.prepare(
            hidden_states,
            encoder_hidden_states,
            timestep,
            encoder_attention_mask,
            grid,
            rope_interpolation_scale,
        )?;
        let mut x = LtxStream::new(inputs.take_hidden_states()?);
        for block in &self.blocks {
            x = block.forward(x, &inputs)?;
        }
        self.finish(&x.into_hidden()?, &inputs)
    }
}

// Placed by the block protocol: `transformer_blocks.{i}`, each streamed whole or step by step.
/// The modules diffusers' layerwise casting leaves alone in `LTXVideoTransformer3DModel` (its
/// `_skip_layerwise_casting_patterns`).
const LAYERWISE_CASTING_SKIP: &[&str] = &["norm"];

crate::repeated_blocks!(
    LtxTransformer3DModel,
    LtxTransformerConfig,
    LtxTransformerBlock,
    BlockStep,
    "transformer_blocks",
    skip: LAYERWISE_CASTING_SKIP
);

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    //! Each fused kernel against the candle composition it replaces, on random bf16 inputs of
    //! LTX-Video 512x768x161 sizes (8064 tokens of 2048), run on the GPU.
    use super::*;
    use crate::models::row_ops::test_util::{
        assert_within_ulp, assert_within_ulp_carrying, device, randn,
    };

    /// Tokens of a 512x768x161 video: 21 latent frames of 16x24.
    const GRID: [usize; 3] = [21, 16, 24];
    const DIM: usize = 2048;

    /// `[B, 6·dim]` modulation rows as the block builds them.
    fn ada(b: usize, dev: &Device) -> Result<Tensor> {
        randn(&[b, 6 * DIM], 0.5, dev)
    }

    #[test]
    fn rms_modulate_matches_composite() -> Result<()> {
        let Some(dev) = device("LTX fused kernels") else {
            return Ok(());
        };
        for (b, s, weight) in [(1, 8064, false), (2, 1000, true)] {
            let x = (randn(&[b, s, DIM], 1.0, &dev)? * 3.0)?;
            let w = weight.then(|| randn(&[DIM], 1.0, &dev)).transpose()?;
            let ada = ada(b, &dev)?;
            let row = |i: usize| ada.narrow(1, i * DIM, DIM)?.unsqueeze(1);
            let (shift, scale) = (row(3)?, row(4)?);
            let normed = rms_norm(&x, w.as_ref(), 1e-6)?;
            let want = modulate(&normed, &shift, &scale)?;
            let term = normed.broadcast_mul(&(&scale + 1.0)?)?;
            let got = row_ops::rms_modulate(
                &x.reshape((b * s, DIM))?,
                w.as_ref(),
                Some(Modulation {
                    table: &ada,
                    stride: 6 * DIM,
                    shift: 3 * DIM,
                    scale: 4 * DIM,
                    text: None,
                    rows: None,
                }),
                Rows { row0: 0, seq: s },
                1e-6,
            )?;
            // A one-ulp flip of the norm reaches the result through 1 + scale.
            let gain = (&scale + 1.0)?;
            let what = format!("rms_modulate b={b} weight={weight}");
            let got = got.reshape((b, s, DIM))?;
            assert_within_ulp_carrying(&got, &want, &term, (&normed, &gain), &what)?;
        }
        Ok(())
    }

    #[test]
    fn qk_rms_rope_matches_composite() -> Result<()> {
        let Some(dev) = device("LTX fused kernels") else {
            return Ok(());
        };
        let s: usize = GRID.iter().product();
        let (cos, sin) = rope_pair_tables(DIM, GRID, [8.0 / 25.0, 32.0, 32.0], [1, 1, 1], &dev)?;
        // Self-attention q (RoPE) over the video tokens; cross-attention k (no RoPE) over 128
        // text tokens of 2 batch entries.
        for (b, n, rope) in [(1, s, true), (2, 128, false)] {
            let x = randn(&[b, n, DIM], 1.0, &dev)?;
            let bias = randn(&[DIM], 0.2, &dev)?;
            let w = randn(&[DIM], 1.0, &dev)?;
            let normed = rms_norm(&x.broadcast_add(&bias)?, Some(&w), QK_NORM_EPS)?;
            let (want, term) = if rope {
                // A rotated pair mixes both members: bound by the larger of the two.
                let pair_max = normed
                    .abs()?
                    .reshape((b, n, DIM / 2, 2))?
                    .max_keepdim(D::Minus1)?
                    .broadcast_as((b, n, DIM / 2, 2))?
                    .reshape((b, n, DIM))?;
                (apply_rope(&normed, &cos, &sin)?, pair_max)
            } else {
                (normed.clone(), normed)
            };
            let got = row_ops::rms_rope(
                x.reshape((b * n, DIM))?,
                Some(&bias),
                &w,
                rope.then_some((&cos, &sin)),
                DIM,
                Rows { row0: 0, seq: n },
                QK_NORM_EPS,
                Rounding::Bf16,
            )?;
            let what = format!("rms_rope b={b} rope={rope}");
            assert_within_ulp(&got.reshape((b, n, DIM))?, &want, &term, &what)?;
        }
        Ok(())
    }

    #[test]
    fn gated_residual_matches_composite() -> Result<()> {
        let Some(dev) = device("LTX fused kernels") else {
            return Ok(());
        };
        for (b, s, gated) in [(1, 8064, true), (2, 1000, true), (1, 8064, false)] {
            let res = randn(&[b, s, DIM], 1.0, &dev)?;
            let delta = randn(&[b, s, DIM], 1.0, &dev)?;
            let bias = randn(&[DIM], 0.2, &dev)?;
            let ada = ada(b, &dev)?;
            let gate = ada.narrow(1, 2 * DIM, DIM)?.unsqueeze(1)?;
            let linear_out = delta.broadcast_add(&bias)?;
            let term = if gated {
                linear_out.broadcast_mul(&gate)?
            } else {
                linear_out
            };
            let want = (&res + &term)?;
            let term = res.abs()?.maximum(&term.abs()?)?;
            let got = row_ops::residual_into_delta(
                &res.reshape((b * s, DIM))?,
                delta.reshape((b * s, DIM))?.copy()?,
                Some(&bias),
                gated.then_some(Gate::Bf16(BatchRow {
                    table: &ada,
                    stride: 6 * DIM,
                    offset: 2 * DIM,
                    text: None,
                    rows: None,
                })),
                Rows { row0: 0, seq: s },
            )?;
            let what = format!("residual b={b} gated={gated}");
            assert_within_ulp(&got.reshape((b, s, DIM))?, &want, &term, &what)?;
        }
        Ok(())
    }

    #[test]
    fn bias_gelu_matches_composite() -> Result<()> {
        let Some(dev) = device("LTX fused kernels") else {
            return Ok(());
        };
        // The feed-forward's inner width (4·dim) over the video tokens.
        let x = (randn(&[8064, 4 * DIM], 1.0, &dev)? * 2.0)?;
        let bias = randn(&[4 * DIM], 0.5, &dev)?;
        let biased = x.broadcast_add(&bias)?;
        // The kernel computes GELU in f32 and rounds once, as torch does for bf16.
        let exact = biased.to_dtype(DType::F32)?;
        for act in [Act::GeluTanh, Act::GeluErf] {
            let want = match act {
                Act::GeluTanh => exact.gelu()?.to_dtype(DType::BF16)?,
                Act::GeluErf => exact.gelu_erf()?.to_dtype(DType::BF16)?,
            };
            let got = row_ops::bias_act(x.copy()?, &bias, act)?;
            assert_within_ulp(&got, &want, &want, &format!("bias_act {act:?}"))?;
        }
        Ok(())
    }

    /// A block with random weights of LTX-Video's sizes (2048 wide, 32 heads).
    fn random_block(dev: &Device) -> Result<LtxTransformerBlock> {
        let cfg = LtxTransformerConfig::default();
        let map = candle_nn::VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::BF16, dev);
        let block = LtxTransformerBlock::new(&cfg, vb)?;
        // VarMap initialises Linear weights; give the table and norms random values too.
        for (name, var) in map.data().lock().expect("varmap lock").iter() {
            if name.ends_with("scale_shift_table") || name.contains("norm_") {
                var.set(&randn(var.dims(), 0.5, dev)?.to_dtype(var.dtype())?)?;
            }
        }
        Ok(block)
    }

    #[test]
    fn block_fused_matches_composite() -> Result<()> {
        let Some(dev) = device("LTX fused kernels") else {
            return Ok(());
        };
        let grid = [3, 16, 24];
        let (b, s, l): (usize, usize, usize) = (2, grid.iter().product(), 128);
        let block = random_block(&dev)?;
        let (rope_cos, rope_sin) =
            rope_pair_tables(DIM, grid, [8.0 / 25.0, 32.0, 32.0], [1, 1, 1], &dev)?;
        let mask = Tensor::ones((b, l), DType::F32, &dev)?.slice_assign(
            &[0..1, 100..l],
            &Tensor::zeros((1, l - 100), DType::F32, &dev)?,
        )?;
        let inputs = LtxBlockInputs {
            hidden_states: None,
            temb: randn(&[b, 1, 6 * DIM], 0.5, &dev)?,
            embedded_timestep: randn(&[b, 1, DIM], 0.5, &dev)?,
            encoder_hidden_states: randn(&[b, l, DIM], 1.0, &dev)?,
            text_keys: TextKeys::from_mask(&mask, DType::BF16)?,
            rope_cos,
            rope_sin,
        };
        let x = randn(&[b, s, DIM], 1.0, &dev)?;
        let ada = inputs.temb.reshape((b, 1, 6, DIM))?.broadcast_add(
            &block
                .scale_shift_table
                .as_ref()
                .expect("a whole block holds its table")
                .unsqueeze(0)?
                .unsqueeze(0)?,
        )?;
        let fused = block
            .forward(LtxStream::new(x.clone()), &inputs)?
            .into_hidden()?
            .to_dtype(DType::F32)?;
        let composite = block
            .forward_composite(
                LtxStream::new(x.clone()),
                &inputs,
                Some(&ada),
                &mut ComputeAll,
            )?
            .into_hidden()?
            .to_dtype(DType::F32)?;
        // Whole-block outputs go through GEMMs and attention after each kernel, so a one-ulp
        // flip inside can grow: compare the relative L2 error instead, bf16-sized.
        let err = ((&fused - &composite)?.sqr()?.sum_all()?.sqrt()?
            / composite.sqr()?.sum_all()?.sqrt()?)?
        .to_scalar::<f32>()?;
        eprintln!("LTX block fused vs composite: relative L2 error {err}");
        assert!(err < 1e-2, "relative L2 error {err}");

        // A step cache hooking both attentions and the feed-forward: each whole output (bias
        // included) computed once, the block's result that of the unhooked block; then all
        // reused, the same bits.
        let mut hooks = crate::models::step_cache::ReplayHooks::default();
        let mut hooked = || -> Result<Tensor> {
            block
                .forward_hooked(&LtxStream::new(x.clone()), &inputs, &mut hooks)?
                .into_hidden()?
                .to_dtype(DType::F32)
        };
        let first = hooked()?;
        let err = ((&first - &fused)?.sqr()?.sum_all()?.sqrt()?
            / fused.sqr()?.sum_all()?.sqrt()?)?
        .to_scalar::<f32>()?;
        assert!(err < 1e-2, "hooked: relative L2 error {err}");
        let gap = (hooked()? - &first)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(gap, 0.0, "reused outputs");
        use crate::models::step_cache::Submodule::{
            FeedForward, SelfAttention, UnflaggedCrossAttention,
        };
        let once = [SelfAttention, UnflaggedCrossAttention, FeedForward];
        assert_eq!(hooks.asked, [once, once].concat());
        Ok(())
    }
}

/// The LTX-Video blocks thread an [`LtxStream`] (one block's output as the next's input).
impl crate::models::blocks::BlockForward for LtxTransformer3DModel {
    type Inputs = LtxBlockInputs;
    type State = LtxStream;
    type Output = Tensor;
    fn config(&self) -> &LtxTransformerConfig {
        self.config()
    }
    fn resident_blocks(&self) -> &[LtxTransformerBlock] {
        self.blocks()
    }
    fn first_state(inputs: &mut LtxBlockInputs) -> Result<LtxStream> {
        Ok(LtxStream::new(inputs.take_hidden_states()?))
    }
    fn through(
        block: &LtxTransformerBlock,
        stream: &LtxStream,
        inputs: &LtxBlockInputs,
    ) -> Result<LtxStream> {
        block.forward(stream.clone(), inputs)
    }
    fn finish_forward(&self, stream: LtxStream, inputs: &LtxBlockInputs) -> Result<Tensor> {
        self.finish(&stream.into_hidden()?, inputs)
    }
}

impl HookedBlock<LtxStream, LtxBlockInputs> for LtxTransformerBlock {
    fn forward_hooked(
        &self,
        stream: &LtxStream,
        inputs: &LtxBlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<LtxStream> {
        self.run(stream.clone(), inputs, hooks)
    }
}

/// How diffusers names what its cache hooks see in LTX-Video: `transformer_blocks`, each
/// returning the hidden states alone, and in each `attn1` and `attn2` (PAB's) and `ff`.
const CACHE_NAMES: ModuleNames = ModuleNames::transformer_blocks(&[
    (Output::Attention, "attn1"),
    (Output::CrossAttention, "attn2"),
    (Output::FeedForward, "ff"),
]);

impl LtxTransformerConfig {
    /// The blocks diffusers' cache hooks see, by their names.
    pub fn hooked_blocks(&self) -> HookedBlocks {
        HookedBlocks::one_list(self.num_layers, CACHE_NAMES)
    }
}

impl crate::models::blocks::CachedForward for LtxTransformer3DModel {
    fn finish_hooked(
        &self,
        stream: LtxStream,
        inputs: &LtxBlockInputs,
        project: &mut Through,
    ) -> Result<Tensor> {
        self.finish_projecting(&stream.into_hidden()?, inputs, project)
    }

    fn hooked_blocks(&self) -> HookedBlocks {
        self.cfg.hooked_blocks()
    }

    fn streams(stream: &LtxStream, _: &LtxBlockInputs) -> Result<Vec<Tensor>> {
        Ok(vec![stream.clone().into_hidden()?])
    }

    fn state(streams: Vec<Tensor>, _: &LtxBlockInputs) -> Result<LtxStream> {
        HiddenStates.state(streams).map(LtxStream::new)
    }
}
