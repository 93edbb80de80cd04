//! PixArt-α's layers, shared by the DiTs built on its blocks (Latte, Allegro):
//! `AdaLayerNormSingle` (one timestep MLP modulating every block), the caption projection and
//! the `BasicTransformerBlock` with `ada_norm_single` ([`Block`]), whose LayerNorms and
//! projections a config may leave without weights or biases. On CUDA bf16 a block's norms with
//! their modulation, its Linear biases with GELU and its gated residuals run as the fused row
//! kernels every DiT shares (`kernels/row_ops.cu`).

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{LayerNorm, LayerNormConfig, Linear, VarBuilder};

use crate::models::attention::sdpa;
use crate::models::projection::{Input, Projection};
#[cfg(feature = "cuda")]
use crate::models::row_ops::{self, Act, BatchRow, Gate, Modulation, Rows};
#[cfg(feature = "cuda")]
use crate::models::step_cache::whole_output;
use crate::models::step_cache::{BlockHooks, ComputeAll, Submodule, Through};
use crate::models::wan::transformer::timestep_embedding;

/// Channels of the sinusoidal timestep embedding (`Timesteps(256, ...)` of PixArt-α).
const TIME_PROJ_DIM: usize = 256;
/// `norm_out`'s epsilon (PixArt-α's output head, in Latte and Allegro alike).
const NORM_OUT_EPS: f64 = 1e-6;

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

/// The blocks' multi-head `Attention`: q from the tokens, k and v from a context (the tokens
/// themselves, or the caption), heads as `[B, H, S, head_dim]`, then `to_out.0`.
#[derive(Debug, Clone)]
pub struct Attention {
    to_q: Projection,
    to_k: Projection,
    to_v: Projection,
    to_out: Projection,
    heads: usize,
    head_dim: usize,
}

impl Attention {
    /// The attention under `vb` (`attn1`, `attn2`); `bias`: the q/k/v projections' biases;
    /// its Linears in fp8 where `fp8` (`--fp8-matmul`).
    pub fn new(
        (dim, context_dim): (usize, usize),
        (heads, head_dim): (usize, usize),
        bias: bool,
        vb: VarBuilder,
        fp8: bool,
    ) -> Result<Self> {
        let qkv = |cin, name: &str| Projection::load_with((cin, dim), bias, vb.pp(name), fp8);
        Ok(Self {
            to_q: qkv(dim, "to_q")?,
            to_k: qkv(context_dim, "to_k")?,
            to_v: qkv(context_dim, "to_v")?,
            to_out: Projection::load((dim, dim), vb.pp("to_out.0"), fp8)?,
            heads,
            head_dim,
        })
    }

    /// q of `x` and k, v of `context` (`[B', S, ·]`), each `[B', H, S, head_dim]`: views of the
    /// projections, which every attention path takes as they are (the fused ones read strides).
    pub fn heads(&self, x: &Tensor, context: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let split = |t: Tensor| -> Result<Tensor> {
            let (b, s, _) = t.dims3()?;
            t.reshape((b, s, self.heads, self.head_dim))?
                .transpose(1, 2)
        };
        // A self-attention's one input is quantized once for q, k and v under `--fp8-matmul`.
        let x_rows = Input::new(x);
        let context_rows = (context.id() != x.id()).then(|| Input::new(context));
        let context_rows = context_rows.as_ref().unwrap_or(&x_rows);
        Ok((
            split(self.to_q.apply(&x_rows, false)?)?,
            split(self.to_k.apply(context_rows, false)?)?,
            split(self.to_v.apply(context_rows, false)?)?,
        ))
    }

    /// The attention's output `[B', H, S, head_dim]` with its heads merged: `[B', S, D]`, before
    /// `to_out` (which [`Block`] applies with its residual).
    pub fn merge_heads(&self, out: Tensor) -> Result<Tensor> {
        let (b, _, s, _) = out.dims4()?;
        out.transpose(1, 2)?
            .reshape((b, s, self.heads * self.head_dim))
    }

    /// The softmax scale, `1 / sqrt(head_dim)`.
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// `x` attending to `context`, unmasked, heads merged (before `to_out`).
    pub fn attend(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let (q, k, v) = self.heads(x, context)?;
        self.merge_heads(sdpa(&q, &k, &v, self.scale())?)
    }
}

/// The sizes of a [`Block`], from its model's config.
#[derive(Debug, Clone, Copy)]
pub struct BlockShape {
    /// Hidden width `D` (heads x head_dim).
    dim: usize,
    /// `(heads, head_dim)`.
    heads: (usize, usize),
    /// Whether the q/k/v projections have biases (`attention_bias`).
    attention_bias: bool,
    /// The norms' epsilon and whether they have weights (`norm_elementwise_affine`).
    norm: (f64, bool),
    /// The caption width of the cross-attention `attn2`, where the block has one.
    cross_attention_dim: Option<usize>,
    /// The attentions' and the feed-forward's Linears in fp8 (`--fp8-matmul`).
    fp8: bool,
}

impl BlockShape {
    /// A block of `heads` `(heads, head_dim)`, `norm` `(eps, elementwise_affine)`.
    pub fn new(
        heads: (usize, usize),
        attention_bias: bool,
        norm: (f64, bool),
        cross_attention_dim: Option<usize>,
    ) -> Self {
        Self {
            dim: heads.0 * heads.1,
            heads,
            attention_bias,
            norm,
            cross_attention_dim,
            fp8: false,
        }
    }

    /// The block with its attentions' and feed-forward's Linears in fp8 where `fp8`.
    pub fn in_fp8(self, fp8: bool) -> Self {
        Self { fp8, ..self }
    }

    /// Device bytes of the block's weight codes under `--fp8-matmul`: `attn1`'s q, k, v and out,
    /// `attn2`'s where it has one (k and v from the caption), the feed-forward's two.
    pub fn fp8_codes(&self) -> u64 {
        let d = self.dim;
        let mut linears = vec![(d, d); 4];
        if let Some(context) = self.cross_attention_dim {
            linears.extend([(d, d), (context, d), (context, d), (d, d)]);
        }
        linears.extend([(d, 4 * d), (4 * d, d)]);
        crate::models::fp8::weight_codes(&linears)
    }
}

/// How a model's [`Block`] runs its attentions (its token grouping, positions and masks): each
/// returns the attention's merged heads `[B, S, D]` before `to_out`.
pub trait BlockAttention {
    /// `attn1` over the normed, modulated states `[B, S, D]`.
    fn self_attention(&self, attn: &Attention, normed: &Tensor) -> Result<Tensor>;
    /// `attn2` from the states `[B, S, D]` to the caption.
    fn cross_attention(&self, attn: &Attention, states: &Tensor) -> Result<Tensor>;
}

/// A PixArt-α `BasicTransformerBlock` with `ada_norm_single`: a modulated LayerNorm, a
/// self-attention and a gated residual; where it has one, a cross-attention to the caption on
/// the un-normed states (no gate); a modulated LayerNorm, a tanh-GELU feed-forward and a gated
/// residual. The shift, scale and gate rows are `scale_shift_table + timestep` per batch entry.
/// How the attentions group and embed their tokens (per frame, per token position, rotary,
/// masked) is the model's: [`Block::forward`] takes them as closures.
#[derive(Debug, Clone)]
pub struct Block {
    norm1: LayerNorm,
    attn1: Attention,
    attn2: Option<Attention>,
    norm2: LayerNorm,
    ff_in: Projection,
    ff_out: Projection,
    /// `[6, D]`: shift, scale, gate of the attention, then of the feed-forward.
    scale_shift_table: Tensor,
    /// The norms' epsilon, for the fused kernels (candle's `LayerNorm` keeps its own private).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    norm_eps: f64,
}

/// The modulation rows of a [`Block`], in `scale_shift_table`'s order.
#[derive(Debug, Clone, Copy)]
enum Row {
    ShiftMsa,
    ScaleMsa,
    GateMsa,
    ShiftMlp,
    ScaleMlp,
    GateMlp,
}

impl Block {
    /// The block's weights under `vb` (`transformer_blocks.{i}` and the like).
    pub fn new(shape: BlockShape, vb: VarBuilder) -> Result<Self> {
        let BlockShape {
            dim,
            heads,
            attention_bias,
            norm: (norm_eps, norm_affine),
            cross_attention_dim,
            fp8,
        } = shape;
        let attention = |context: usize, vb: VarBuilder| {
            Attention::new((dim, context), heads, attention_bias, vb, fp8)
        };
        Ok(Self {
            norm1: layer_norm(dim, norm_eps, norm_affine, vb.pp("norm1"))?,
            attn1: attention(dim, vb.pp("attn1"))?,
            attn2: cross_attention_dim
                .map(|context| attention(context, vb.pp("attn2")))
                .transpose()?,
            norm2: layer_norm(dim, norm_eps, norm_affine, vb.pp("norm2"))?,
            ff_in: Projection::load((dim, 4 * dim), vb.pp("ff.net.0.proj"), fp8)?,
            ff_out: Projection::load((4 * dim, dim), vb.pp("ff.net.2"), fp8)?,
            scale_shift_table: vb.get((6, dim), "scale_shift_table")?,
            norm_eps,
        })
    }

    /// `x` `[B, S, D]` through the block, `timestep` the `[B, 6·D]` modulation of
    /// `adaln_single`, the attentions run as `attention` says.
    pub fn forward(
        &self,
        x: &Tensor,
        timestep: &Tensor,
        attention: &impl BlockAttention,
    ) -> Result<Tensor> {
        self.forward_hooked(x, timestep, attention, &mut ComputeAll)
    }

    /// [`Self::forward`], asking `hooks` (a step cache) for the outputs of `attn1` and `attn2`
    /// (after `to_out`, its bias included: diffusers' attention modules).
    pub fn forward_hooked(
        &self,
        x: &Tensor,
        timestep: &Tensor,
        attention: &impl BlockAttention,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Tensor> {
        let (b, _, d) = x.dims3()?;
        let modulation = self
            .scale_shift_table
            .unsqueeze(0)?
            .broadcast_add(&timestep.reshape((b, 6, d))?)?;
        #[cfg(feature = "cuda")]
        if row_ops::rows_supported(x) {
            return self.forward_fused(x, &modulation, attention, hooks);
        }
        self.forward_composite(x, &modulation, attention, hooks)
    }

    /// [`Self::forward`] as candle ops (CPU, f32, other dtypes), `modulation` `[B, 6, D]`.
    fn forward_composite(
        &self,
        x: &Tensor,
        modulation: &Tensor,
        attention: &impl BlockAttention,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Tensor> {
        let row = |r: Row| modulation.narrow(1, r as usize, 1);
        let modulate = |t: &Tensor, scale: Row, shift: Row| -> Result<Tensor> {
            t.broadcast_mul(&(row(scale)? + 1.0)?)?
                .broadcast_add(&row(shift)?)
        };
        let normed = modulate(&self.norm1.forward(x)?, Row::ScaleMsa, Row::ShiftMsa)?;
        let project = |linear: &Projection, x: Tensor| linear.apply(&Input::new(&x), false);
        let attn = hooks.output(Submodule::SelfAttention, &mut || {
            project(
                &self.attn1.to_out,
                attention.self_attention(&self.attn1, &normed)?,
            )
        })?;
        let mut h = (attn.broadcast_mul(&row(Row::GateMsa)?)? + x)?;
        if let Some(attn2) = &self.attn2 {
            let attn = hooks.output(Submodule::CrossAttention, &mut || {
                project(&attn2.to_out, attention.cross_attention(attn2, &h)?)
            })?;
            h = (attn + h)?;
        }
        let normed = modulate(&self.norm2.forward(&h)?, Row::ScaleMlp, Row::ShiftMlp)?;
        let ff = self.ff_out.forward(&self.ff_in.forward(&normed)?.gelu()?)?;
        ff.broadcast_mul(&row(Row::GateMlp)?)? + h
    }

    /// [`Self::forward`] as the fused row kernels on `x` (CUDA bf16): each modulated norm, the
    /// feed-forward's bias + GELU and each bias + gate + residual is one pass over the rows.
    #[cfg(feature = "cuda")]
    fn forward_fused(
        &self,
        x: &Tensor,
        modulation: &Tensor,
        attention: &impl BlockAttention,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Tensor> {
        let (b, s, d) = x.dims3()?;
        let table = modulation.reshape((b, 6 * d))?;
        let at = Rows { row0: 0, seq: s };
        let norm_modulate = |x: &Tensor, norm: &LayerNorm, shift: Row, scale: Row| {
            let Some(bias) = norm.bias() else {
                candle_core::bail!("a PixArt LayerNorm without a bias")
            };
            let modulation = Modulation {
                table: &table,
                stride: 6 * d,
                shift: shift as usize * d,
                scale: scale as usize * d,
                text: None,
                rows: None,
            };
            let norm = row_ops::LayerNorm::Fused {
                w: norm.weight(),
                b: bias,
            };
            row_ops::layer_norm_modulate(x, norm, Some(modulation), at, self.norm_eps)
        };
        let gate = |row: Row| {
            Gate::Bf16(BatchRow {
                table: &table,
                stride: 6 * d,
                offset: row as usize * d,
                text: None,
                rows: None,
            })
        };
        // `res + (out @ to_out^T + bias) * gate`, the product's bias added by the residual (or
        // first, where a step cache hooks the output: `whole_output`).
        let project_rows = |linear: &Projection, out: &Tensor| {
            linear.product(&Input::new(&out.reshape((b * s, ()))?))
        };
        let residual = |res: &Tensor, (out, bias): (Tensor, Option<&Tensor>), gate| {
            row_ops::residual_into_delta(res, out, bias, gate, at)
        };
        let x = x.reshape((b * s, d))?;
        let normed = norm_modulate(&x, &self.norm1, Row::ShiftMsa, Row::ScaleMsa)?;
        let to_out = &self.attn1.to_out;
        let heads = || attention.self_attention(&self.attn1, &normed.reshape((b, s, d))?);
        let compute = || project_rows(to_out, &heads()?);
        let attn = whole_output(hooks, Submodule::SelfAttention, compute, to_out.bias())?;
        let mut h = residual(&x, attn, Some(gate(Row::GateMsa)))?;
        if let Some(attn2) = &self.attn2 {
            let states = h.reshape((b, s, d))?;
            let heads = || attention.cross_attention(attn2, &states);
            let compute = || project_rows(&attn2.to_out, &heads()?);
            let module = Submodule::CrossAttention;
            let attn = whole_output(hooks, module, compute, attn2.to_out.bias())?;
            h = residual(&h, attn, None)?;
        }
        let normed = norm_modulate(&h, &self.norm2, Row::ShiftMlp, Row::ScaleMlp)?;
        let Some(ff_bias) = self.ff_in.bias() else {
            candle_core::bail!("a PixArt feed-forward without a bias")
        };
        let hidden = match self
            .ff_in
            .fp8_product(&Input::new(&normed), Some(ff_bias), true)?
        {
            Some(hidden) => hidden,
            None => row_ops::matmul_bias_act(&normed, self.ff_in.weight(), ff_bias, Act::GeluTanh)?,
        };
        let ff = (project_rows(&self.ff_out, &hidden)?, self.ff_out.bias());
        residual(&h, ff, Some(gate(Row::GateMlp)))?.reshape((b, s, d))
    }
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

/// PixArt-α's output head: `norm_out` (a LayerNorm without weights) shifted and scaled by
/// `scale_shift_table` plus the embedded timestep, then `proj_out`.
#[derive(Debug, Clone)]
pub struct OutputHead {
    /// `[2, D]`: shift and scale.
    scale_shift_table: Tensor,
    norm_out: LayerNorm,
    proj_out: Linear,
}

impl OutputHead {
    /// The weights `scale_shift_table` and `proj_out` (`dim` in, `out` out) under `vb`.
    pub fn new(dim: usize, out: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            scale_shift_table: vb.get((2, dim), "scale_shift_table")?,
            norm_out: layer_norm(dim, NORM_OUT_EPS, false, vb.pp("norm_out"))?,
            proj_out: candle_nn::linear(dim, out, vb.pp("proj_out"))?,
        })
    }

    /// `proj_out(norm_out(x) · (1 + scale) + shift)` of tokens `x` `[B, .., D]` under the
    /// embedded timestep `[B, D]`, the projection's output through `project` (a step cache's,
    /// which may stand in for it).
    pub fn forward(
        &self,
        x: &Tensor,
        embedded_timestep: &Tensor,
        project: &mut Through,
    ) -> Result<Tensor> {
        let mut modulation_shape = vec![1; x.rank()];
        modulation_shape[0] = x.dim(0)?;
        modulation_shape[x.rank() - 1] = x.dim(candle_core::D::Minus1)?;
        let table = self
            .scale_shift_table
            .unsqueeze(0)?
            .broadcast_add(&embedded_timestep.unsqueeze(1)?)?;
        let shift = table.narrow(1, 0, 1)?.reshape(modulation_shape.clone())?;
        let scale = table.narrow(1, 1, 1)?.reshape(modulation_shape)?;
        let h = self
            .norm_out
            .forward(x)?
            .broadcast_mul(&(scale + 1.0)?)?
            .broadcast_add(&shift)?;
        project(&mut || self.proj_out.forward(&h))
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    //! The fused block against the candle composition it replaces, on random bf16 inputs of
    //! Latte-1's width (16 heads x 72) and a caption of 120 tokens, on the GPU.
    use super::*;
    use crate::models::row_ops::test_util::{device, randn};

    /// Unmasked attentions over the whole sequence, to a caption.
    struct Plain(Tensor);

    impl BlockAttention for Plain {
        fn self_attention(&self, attn: &Attention, normed: &Tensor) -> Result<Tensor> {
            attn.attend(normed, normed)
        }

        fn cross_attention(&self, attn: &Attention, states: &Tensor) -> Result<Tensor> {
            attn.attend(states, &self.0)
        }
    }

    #[test]
    fn block_fused_matches_composite() -> Result<()> {
        let Some(dev) = device("PixArt fused block") else {
            return Ok(());
        };
        let (b, s, text_len, dim) = (2, 1024, 120, 1152);
        let shape = BlockShape::new((16, 72), true, (1e-6, true), Some(dim));
        let map = candle_nn::VarMap::new();
        let block = Block::new(shape, VarBuilder::from_varmap(&map, DType::BF16, &dev))?;
        // The VarMap's init leaves norms at one and biases at zero: draw them too.
        for (name, var) in map.data().lock().expect("varmap lock").iter() {
            if name.contains("norm") || name.ends_with("bias") || name.contains("scale_shift") {
                var.set(&randn(var.dims(), 0.5, &dev)?)?;
            }
        }
        let x = randn(&[b, s, dim], 1.0, &dev)?;
        let timestep = randn(&[b, 6 * dim], 0.5, &dev)?;
        let text = randn(&[b, text_len, dim], 1.0, &dev)?;
        let modulation = block
            .scale_shift_table
            .unsqueeze(0)?
            .broadcast_add(&timestep.reshape((b, 6, dim))?)?;
        let attention = Plain(text);
        let fused = block.forward(&x, &timestep, &attention)?;
        let composite = block.forward_composite(&x, &modulation, &attention, &mut ComputeAll)?;
        let (fused, composite) = (fused.to_dtype(DType::F32)?, composite.to_dtype(DType::F32)?);
        // The fused path adds biases in the GEMM epilogues (one rounding, as PyTorch): compare
        // the relative L2 error, bf16-sized.
        let err = ((&fused - &composite)?.sqr()?.sum_all()?.sqrt()?
            / composite.sqr()?.sum_all()?.sqrt()?)?
        .to_scalar::<f32>()?;
        eprintln!("PixArt block fused vs composite: relative L2 error {err}");
        assert!(err < 1e-2, "relative L2 error {err}");

        // A step cache hooking both attentions: each whole output (bias included) computed
        // once, the block's result that of the unhooked block; then both reused, the same bits.
        let mut hooks = crate::models::step_cache::ReplayHooks::default();
        let hooked = block.forward_hooked(&x, &timestep, &attention, &mut hooks)?;
        let hooked = hooked.to_dtype(DType::F32)?;
        let err = ((&hooked - &fused)?.sqr()?.sum_all()?.sqrt()?
            / fused.sqr()?.sum_all()?.sqrt()?)?
        .to_scalar::<f32>()?;
        assert!(err < 1e-2, "hooked: relative L2 error {err}");
        let reused = block.forward_hooked(&x, &timestep, &attention, &mut hooks)?;
        let gap = (reused.to_dtype(DType::F32)? - &hooked)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(gap, 0.0, "reused outputs");
        use crate::models::step_cache::Submodule::{CrossAttention, SelfAttention};
        let once = [SelfAttention, CrossAttention];
        assert_eq!(hooks.asked, [once, once].concat());
        Ok(())
    }
}
