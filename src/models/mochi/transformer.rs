//! Mochi-1 diffusion transformer (diffusers `MochiTransformer3DModel`, genmo/mochi-1-preview).
//!
//! Two streams of different widths: video tokens (`inner` = heads x head_dim) and text tokens
//! (`pooled_projection_dim`), joined only inside the attention ("asymmetric" joint attention).
//! The forward pass is split so that an engine can stream the blocks:
//!
//! 1. [`MochiTransformer3DModel::prepare`]: the conditioning `temb` (timestep MLP plus the
//!    attention-pooled caption), the text stream (`caption_proj`), the per-frame patch embedding
//!    of the video stream, the RoPE tables from the learned `pos_frequencies`, and each sample's
//!    valid text tokens.
//! 2. [`MochiBlock::forward`] for every block, in order (the last is `context_pre_only`: it
//!    reads the text but does not update it).
//! 3. [`MochiTransformer3DModel::finish`]: AdaLayerNormContinuous (scale, shift), `proj_out`,
//!    unpatchify to `[B, C, F, H, W]`.
//!
//! The RMS norms compute in f32 and cast back to the stream's dtype, as diffusers'
//! `MochiRMSNormZero` / `MochiModulatedRMSNorm` do; the rotation of q and k runs in f32. On CUDA
//! bf16 the blocks' norms with their modulation, gated residuals, q/k norms with RoPE, Linear
//! biases and SwiGLU run as the fused row kernels every DiT shares (`kernels/row_ops.cu`), with
//! the same roundings ([`Ops`]). With `--fp8-matmul` the blocks' attention and feed-forward
//! Linears run in e4m3 ([`Projection`]); the modulations and embedders stay exact.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{LayerNorm, Linear, VarBuilder};
use serde::Deserialize;

use crate::models::attention::{sdpa, sdpa_with_bias};
use crate::models::blocks::{HookedBlock, RepeatedBlocks};
use crate::models::cogvideox::transformer::linspace_f32;
use crate::models::patches::{patchify, unpatchify_channels_last};
use crate::models::projection::{Input, Projection};
#[cfg(feature = "cuda")]
use crate::models::row_ops::{self, Rows};
use crate::models::step_cache::{
    joint_output, Absent, BlockHooks, ComputeAll, HookedBlocks, ModuleNames, Output, Submodule,
    Through,
};
use crate::models::video::{DitShape, VideoDit};
use crate::models::wan::transformer::timestep_embedding;

/// Heads of `MochiAttentionPool` (hard-coded to 8 in `MochiCombinedTimestepCaptionEmbedding`).
pub const POOL_HEADS: usize = 8;
/// Epsilon of the blocks' modulated RMS norms and of the output LayerNorm.
const NORM_EPS: f64 = 1e-6;
/// Epsilon of the per-head RMS norms on q and k (`MochiAttention`'s `eps=1e-5`).
const QK_NORM_EPS: f64 = 1e-5;
/// `MochiRoPE`'s base grid: positions are scaled so the grid's area is 192 x 192 patches.
const ROPE_BASE_AREA: f64 = 192.0 * 192.0;

/// `transformer/config.json` of a diffusers Mochi checkpoint; missing keys take diffusers'
/// defaults (those of `MochiTransformer3DModel.__init__`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct MochiTransformerConfig {
    /// Spatial patch size (Conv2d kernel = stride), per frame.
    pub patch_size: usize,
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Width of one head.
    pub attention_head_dim: usize,
    /// Number of transformer blocks (the last one is `context_pre_only`).
    pub num_layers: usize,
    /// Width of the text stream.
    pub pooled_projection_dim: usize,
    /// Latent channels in.
    pub in_channels: usize,
    /// Latent channels out (`null` means `in_channels`).
    pub out_channels: Option<usize>,
    /// Per-head norm of q and k (only `rms_norm`).
    pub qk_norm: String,
    /// Width of the text-encoder embeddings.
    pub text_embed_dim: usize,
    /// Sinusoid width of the timestep embedding.
    pub time_embed_dim: usize,
    /// Feed-forward activation (only `swiglu`).
    pub activation_fn: String,
    /// Informational: the text length the model was trained with.
    pub max_sequence_length: usize,
    /// Not in the file: the blocks' attention and feed-forward Linears run in fp8
    /// (`--fp8-matmul`, set by the pipeline); the modulations' stay exact.
    #[serde(skip)]
    pub fp8_matmul: bool,
}

impl Default for MochiTransformerConfig {
    fn default() -> Self {
        Self {
            patch_size: 2,
            num_attention_heads: 24,
            attention_head_dim: 128,
            num_layers: 48,
            pooled_projection_dim: 1536,
            in_channels: 12,
            out_channels: None,
            qk_norm: "rms_norm".into(),
            text_embed_dim: 4096,
            time_embed_dim: 256,
            activation_fn: "swiglu".into(),
            max_sequence_length: 256,
            fp8_matmul: false,
        }
    }
}

impl MochiTransformerConfig {
    /// Video tokens of a latent grid `[F', H', W']`: every latent frame patched.
    pub fn video_tokens(&self, grid: [usize; 3]) -> usize {
        let p = self.patch_size;
        grid[0] * (grid[1] / p) * (grid[2] / p)
    }

    /// Video stream width: heads x head dim.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Whether block `i` is `context_pre_only` (the last): it reads the text but does not
    /// update it.
    pub fn context_pre_only(&self, i: usize) -> bool {
        i + 1 == self.num_layers
    }

    /// Output channels (`out_channels or in_channels`).
    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// SwiGLU inner width of a stream of width `dim` (`(4 * dim * 2) // 3`).
    pub fn ff_inner_dim(dim: usize) -> usize {
        4 * dim * 2 / 3
    }

    /// Rejects configurations this implementation cannot run, with the key at fault.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("patch_size", self.patch_size),
            ("num_attention_heads", self.num_attention_heads),
            ("attention_head_dim", self.attention_head_dim),
            ("num_layers", self.num_layers),
            ("pooled_projection_dim", self.pooled_projection_dim),
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels()),
            ("text_embed_dim", self.text_embed_dim),
            ("time_embed_dim", self.time_embed_dim),
        ];
        crate::models::config_checks::positive("transformer config", &positive)?;
        if !self.attention_head_dim.is_multiple_of(2) {
            candle_core::bail!(
                "transformer config: attention_head_dim {} must be even (RoPE rotates pairs)",
                self.attention_head_dim
            );
        }
        if !self.text_embed_dim.is_multiple_of(POOL_HEADS) {
            candle_core::bail!(
                "transformer config: text_embed_dim {} must be a multiple of the caption pool's {POOL_HEADS} heads",
                self.text_embed_dim
            );
        }
        crate::models::config_checks::one_of(
            "transformer config",
            ("qk_norm", &self.qk_norm),
            &["rms_norm"],
        )?;
        crate::models::config_checks::one_of(
            "transformer config",
            ("activation_fn", &self.activation_fn),
            &["swiglu"],
        )?;
        Ok(())
    }
}

impl VideoDit for MochiTransformerConfig {
    fn dit_shape(&self) -> DitShape {
        DitShape::of(self.num_layers, self.inner_dim(), self.in_channels)
    }
}

/// Everything the blocks and the output head need, computed once per forward by `prepare`.
#[derive(Debug, Clone)]
pub struct BlockInputs {
    streams: Option<Streams>,
    /// Conditioning `[B, inner]` (model dtype): input of every modulation.
    pub temb: Tensor,
    /// RoPE cosines `[F·h·w·heads, head_dim / 2]` in f32 (a table per head).
    pub rope_cos: Tensor,
    /// RoPE sines, same layout as `rope_cos`.
    pub rope_sin: Tensor,
    /// For each sample, the indices (u32) of its text tokens the mask keeps.
    pub valid_text: Vec<Tensor>,
    /// Token grid (frames, height, width) after patching.
    pub grid: [usize; 3],
}

/// The two streams between blocks: video `[B, N, inner]` and text `[B, L, pooled_dim]`.
#[derive(Debug, Clone)]
pub struct Streams {
    pub video: Tensor,
    pub text: Tensor,
    /// Between a block's attention and feed-forward steps: the video and (unless the block is
    /// `context_pre_only`) text RMSNormZero rows `[B, 4·D]`.
    rows: Option<(Tensor, Option<Tensor>)>,
}

impl BlockInputs {
    /// Takes the streams that feed block 0; once.
    pub fn take_streams(&mut self) -> Result<Streams> {
        self.streams
            .take()
            .ok_or_else(|| candle_core::Error::Msg("block-0 streams already taken".into()))
    }
}

/// `x / sqrt(mean(x²) + eps)` over the last dim, in f32 (diffusers' weightless `RMSNorm` on an
/// f32 input).
fn rms_normalize(x: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let ones = Tensor::ones(x.dim(candle_core::D::Minus1)?, DType::F32, x.device())?;
    candle_nn::ops::rms_norm(&x.contiguous()?, &ones, eps as f32)
}

/// `MochiModulatedRMSNorm`: `rms(x) · factor` in f32 (`factor` f32 `[B, 1, D]`: [`one_plus`] a
/// scale or [`tanh_gate`]), back in `x`'s dtype.
fn modulated_rms(x: &Tensor, factor: &Tensor) -> Result<Tensor> {
    rms_normalize(x, NORM_EPS)?
        .broadcast_mul(factor)?
        .to_dtype(x.dtype())
}

/// `1 + scale` of a modulation row, in f32 (diffusers casts the row first).
fn one_plus(scale: &Tensor) -> Result<Tensor> {
    scale.to_dtype(DType::F32)? + 1.0
}

/// The gate `tanh(g)` of a modulation row, in the row's dtype, as f32 (the factor of
/// [`modulated_rms`]).
fn tanh_gate(gate: &Tensor) -> Result<Tensor> {
    gate.tanh()?.to_dtype(DType::F32)
}

/// `[B, k·D]` modulation rows -> row `i` as `[B, 1, D]`.
fn chunk(emb: &Tensor, i: usize, dim: usize) -> Result<Tensor> {
    emb.narrow(1, i * dim, dim)?.unsqueeze(1)
}

/// How a block runs its per-token steps (modulated norms, gated residuals, q/k norms with RoPE,
/// Linear layers, SwiGLU); the block's structure is the same for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ops {
    /// candle ops: the CPU, f32 and other dtypes, and the reference of the fused path.
    Composite,
    /// The fused row kernels on CUDA bf16 (`kernels/row_ops.cu`): one pass over the rows per
    /// step, rounded as the candle ops round (bar a reduction's summation order); a Linear's bias
    /// goes into its GEMM's epilogue, rounded once, as PyTorch adds it.
    #[cfg(feature = "cuda")]
    Fused,
}

impl Ops {
    /// [`modulated_rms`] of `x` `[B, S, D]` by `factor` (f32 `[B, 1, D]`).
    fn modulated_rms(self, x: &Tensor, factor: &Tensor) -> Result<Tensor> {
        match self {
            Ops::Composite => modulated_rms(x, factor),
            #[cfg(feature = "cuda")]
            Ops::Fused => {
                let (b, s, d) = x.dims3()?;
                let factor = factor.reshape((b, d))?.contiguous()?;
                let at = Rows { row0: 0, seq: s };
                row_ops::rms_mul_f32(&x.reshape((b * s, d))?, &factor, at, NORM_EPS)?
                    .reshape((b, s, d))
            }
        }
    }

    /// `x + modulated_rms(delta, factor)` for `x`, `delta` `[B, S, D]` (the fused kernel writes
    /// the sum into `delta`'s storage).
    fn gated_residual(self, x: &Tensor, delta: Tensor, factor: &Tensor) -> Result<Tensor> {
        match self {
            Ops::Composite => x + modulated_rms(&delta, factor)?,
            #[cfg(feature = "cuda")]
            Ops::Fused => {
                let (b, s, d) = x.dims3()?;
                let factor = factor.reshape((b, d))?.contiguous()?;
                let (x, delta) = (x.reshape((b * s, d))?, delta.reshape((b * s, d))?);
                let at = Rows { row0: 0, seq: s };
                row_ops::rms_mul_residual_f32(&x, delta, &factor, at, NORM_EPS)?.reshape((b, s, d))
            }
        }
    }

    /// `linear` over `x` `[B, S, in]`: an fp8 layer's product of the shared `x`; else composed,
    /// candle's Linear; fused, one GEMM over the rows with the bias in its epilogue.
    fn linear(self, linear: &Projection, x: &Input) -> Result<Tensor> {
        match self {
            Ops::Composite => linear.forward_input(x),
            #[cfg(feature = "cuda")]
            Ops::Fused => linear.apply(x, false),
        }
    }

    /// The per-head RMSNorm with `weight` ([`head_rms`]) of a projection `x` `[B, S, H·hd]`, then
    /// with `rope` (cos, sin `[S·H, hd / 2]` f32: a row per token and head) the rotation of its
    /// interleaved pairs in f32, back in `x`'s dtype. The fused kernel works in `x`'s storage.
    fn head_norm_rope(
        self,
        x: Tensor,
        weight: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
        head_dim: usize,
    ) -> Result<Tensor> {
        let (b, s, dim) = x.dims3()?;
        let heads = dim / head_dim;
        match self {
            #[cfg(feature = "cuda")]
            Ops::Fused if weight.dtype() == DType::BF16 => {
                // A kernel row per (token, head): its position s·H + h picks its table row.
                let at = Rows {
                    row0: 0,
                    seq: s * heads,
                };
                let rows = x.reshape((b * s * heads, head_dim))?;
                row_ops::head_norm_rope(
                    rows,
                    None,
                    weight,
                    None,
                    rope,
                    head_dim,
                    0,
                    at,
                    QK_NORM_EPS,
                )?
                .reshape((b, s, dim))
            }
            _ => {
                let normed = head_rms(&x.reshape((b, s, heads, head_dim))?, weight)?;
                let Some((cos, sin)) = rope else {
                    return normed.reshape((b, s, dim));
                };
                // One table row per (token, head): rotate as a single head over S·H positions.
                candle_nn::rotary_emb::rope_i(
                    &normed
                        .to_dtype(DType::F32)?
                        .reshape((b, 1, s * heads, head_dim))?
                        .contiguous()?,
                    cos,
                    sin,
                )?
                .to_dtype(x.dtype())?
                .reshape((b, s, dim))
            }
        }
    }
}

/// A stream's modulation: `MochiRMSNormZero` (scale_msa, gate_msa, scale_mlp, gate_mlp), or,
/// for the text of a `context_pre_only` block, `MochiLayerNormContinuous` (a scale only).
#[derive(Debug, Clone)]
enum Modulation {
    /// `linear`: SiLU(temb) -> the four `[B, D]` rows.
    Zero(Linear),
    /// `linear_1`: SiLU(temb) -> the scale.
    ScaleOnly(Linear),
}

/// A stream's modulated input to the attention and what the rest of the block needs.
struct Modulated {
    normed: Tensor,
    /// `[B, 4·D]` rows (RMSNormZero only).
    emb: Option<Tensor>,
}

impl Modulation {
    fn apply(&self, x: &Tensor, temb: &Tensor, ops: Ops) -> Result<Modulated> {
        let dim = x.dim(2)?;
        let silu = candle_nn::ops::silu(temb)?;
        let (scale, emb) = match self {
            Modulation::Zero(linear) => {
                let emb = linear.forward(&silu)?;
                (chunk(&emb, 0, dim)?, Some(emb))
            }
            Modulation::ScaleOnly(linear) => (linear.forward(&silu)?.unsqueeze(1)?, None),
        };
        Ok(Modulated {
            normed: ops.modulated_rms(x, &one_plus(&scale)?)?,
            emb,
        })
    }
}

/// The SwiGLU feed-forward (`FeedForward(activation_fn="swiglu", bias=False)`).
#[derive(Debug, Clone)]
struct SwiGlu {
    proj: Projection,
    out: Projection,
}

impl SwiGlu {
    /// The feed-forward of a stream of width `dim`, its Linears in fp8 where `fp8`.
    fn new(dim: usize, vb: VarBuilder, fp8: bool) -> Result<Self> {
        let inner = MochiTransformerConfig::ff_inner_dim(dim);
        Ok(Self {
            proj: Projection::load_with((dim, 2 * inner), false, vb.pp("net.0.proj"), fp8)?,
            out: Projection::load_with((inner, dim), false, vb.pp("net.2"), fp8)?,
        })
    }

    fn forward(&self, x: &Tensor, ops: Ops) -> Result<Tensor> {
        let h = ops.linear(&self.proj, &Input::new(x))?;
        let inner = h.dim(2)? / 2;
        let gated = match ops {
            // The same SiLU (f32, rounded once) and rounded product as candle's bf16 ops.
            #[cfg(feature = "cuda")]
            Ops::Fused if inner.is_multiple_of(2) => {
                let (b, s, width) = h.dims3()?;
                row_ops::swiglu(&h.reshape((b * s, width))?)?.reshape((b, s, inner))?
            }
            _ => (h.narrow(2, 0, inner)? * candle_nn::ops::silu(&h.narrow(2, inner, inner)?)?)?,
        };
        ops.linear(&self.out, &Input::new(&gated))
    }
}

/// A per-head RMSNorm with weight (`MochiRMSNorm`), in f32, back in the input dtype.
fn head_rms(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    candle_nn::ops::rms_norm(
        &x.to_dtype(DType::F32)?.contiguous()?,
        &weight.to_dtype(DType::F32)?,
        QK_NORM_EPS as f32,
    )?
    .to_dtype(x.dtype())
}

/// `MochiAttention` with `MochiAttnProcessor2_0`: video and text projected apart, per-head RMS
/// norms, RoPE on the video q and k, attention per sample over [video; the text tokens its mask
/// keeps]; the text outputs of masked tokens are zero before `to_add_out`.
#[derive(Debug, Clone)]
struct JointAttention {
    to_q: Projection,
    to_k: Projection,
    to_v: Projection,
    norm_q: Tensor,
    norm_k: Tensor,
    add_k_proj: Projection,
    add_v_proj: Projection,
    norm_added_k: Tensor,
    /// The text queries and the text output (absent in a `context_pre_only` block, whose text
    /// outputs are discarded).
    text_out: Option<TextOut>,
    to_out: Projection,
    heads: usize,
    head_dim: usize,
}

/// The text queries (`add_q_proj` with its per-head norm) and the text output projection of a
/// block that updates the text stream.
#[derive(Debug, Clone)]
struct TextOut {
    add_q_proj: Projection,
    norm_added_q: Tensor,
    to_add_out: Projection,
}

impl JointAttention {
    fn new(cfg: &MochiTransformerConfig, context_pre_only: bool, vb: VarBuilder) -> Result<Self> {
        let (dim, text_dim, hd, fp8) = (
            cfg.inner_dim(),
            cfg.pooled_projection_dim,
            cfg.attention_head_dim,
            cfg.fp8_matmul,
        );
        let text_out = if context_pre_only {
            None
        } else {
            Some(TextOut {
                add_q_proj: Projection::load_with(
                    (text_dim, dim),
                    false,
                    vb.pp("add_q_proj"),
                    fp8,
                )?,
                norm_added_q: vb.get(hd, "norm_added_q.weight")?,
                to_add_out: Projection::load((dim, text_dim), vb.pp("to_add_out"), fp8)?,
            })
        };
        Ok(Self {
            to_q: Projection::load_with((dim, dim), false, vb.pp("to_q"), fp8)?,
            to_k: Projection::load_with((dim, dim), false, vb.pp("to_k"), fp8)?,
            to_v: Projection::load_with((dim, dim), false, vb.pp("to_v"), fp8)?,
            norm_q: vb.get(hd, "norm_q.weight")?,
            norm_k: vb.get(hd, "norm_k.weight")?,
            add_k_proj: Projection::load_with((text_dim, dim), false, vb.pp("add_k_proj"), fp8)?,
            add_v_proj: Projection::load_with((text_dim, dim), false, vb.pp("add_v_proj"), fp8)?,
            norm_added_k: vb.get(hd, "norm_added_k.weight")?,
            text_out,
            to_out: Projection::load((dim, dim), vb.pp("to_out.0"), fp8)?,
            heads: cfg.num_attention_heads,
            head_dim: hd,
        })
    }

    /// `[B, S, H·hd]` -> `[B, H, S, hd]`.
    fn heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        x.reshape((b, s, self.heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    }

    /// `linear` of `x` `[B, S, ·]` as heads `[B, H, S, hd]`, each normed with `norm` where given
    /// and, with `rope`, rotated.
    fn project_heads(
        &self,
        x: &Input,
        linear: &Projection,
        norm: Option<&Tensor>,
        rope: Option<(&Tensor, &Tensor)>,
        ops: Ops,
    ) -> Result<Tensor> {
        let h = ops.linear(linear, x)?;
        let h = match norm {
            Some(w) => ops.head_norm_rope(h, w, rope, self.head_dim)?,
            None => h,
        };
        self.heads(&h)
    }

    /// Video `x` `[B, N, inner]` and text `c` `[B, L, pooled]` (both modulated) -> the video
    /// output after `to_out` and, unless `context_pre_only`, the text output after `to_add_out`.
    fn forward(
        &self,
        x: &Tensor,
        c: &Tensor,
        inputs: &BlockInputs,
        ops: Ops,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (b, n, dim) = x.dims3()?;
        let l = c.dim(1)?;
        let rope = Some((&inputs.rope_cos, &inputs.rope_sin));
        // One input per stream for its q, k and v: quantized once under `--fp8-matmul`, each
        // stream's codes dropped once its heads are made.
        let (q, k, v) = {
            let x = Input::new(x);
            (
                self.project_heads(&x, &self.to_q, Some(&self.norm_q), rope, ops)?,
                self.project_heads(&x, &self.to_k, Some(&self.norm_k), rope, ops)?,
                self.project_heads(&x, &self.to_v, None, None, ops)?,
            )
        };
        let (tk, tv, tq) = {
            let c = Input::new(c);
            (
                self.project_heads(&c, &self.add_k_proj, Some(&self.norm_added_k), None, ops)?,
                self.project_heads(&c, &self.add_v_proj, None, None, ops)?,
                self.text_out
                    .as_ref()
                    .map(|t| {
                        self.project_heads(&c, &t.add_q_proj, Some(&t.norm_added_q), None, ops)
                    })
                    .transpose()?,
            )
        };
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let (mut video_out, mut text_out) = (Vec::with_capacity(b), Vec::with_capacity(b));
        for (i, valid) in inputs.valid_text.iter().enumerate() {
            let pick = |t: &Tensor| t.narrow(0, i, 1)?.index_select(valid, 2);
            let keys = Tensor::cat(&[&k.narrow(0, i, 1)?, &pick(&tk)?], 2)?;
            let values = Tensor::cat(&[&v.narrow(0, i, 1)?, &pick(&tv)?], 2)?;
            let queries = match &tq {
                Some(tq) => Tensor::cat(&[&q.narrow(0, i, 1)?, &pick(tq)?], 2)?,
                // Text queries only feed the discarded text outputs.
                None => q.narrow(0, i, 1)?,
            };
            // [1, H, S, hd] -> [1, S, inner]
            let out = sdpa(&queries, &keys, &values, scale)?
                .transpose(1, 2)?
                .reshape((1, (), dim))?;
            video_out.push(out.narrow(1, 0, n)?);
            if tq.is_some() {
                // Valid text outputs first, zeros after (diffusers pads the joint output).
                let kept = out.narrow(1, n, valid.dim(0)?)?;
                let pad = Tensor::zeros((1, l - kept.dim(1)?, dim), kept.dtype(), kept.device())?;
                text_out.push(Tensor::cat(&[kept, pad], 1)?);
            }
        }
        let video = ops.linear(&self.to_out, &Input::new(&Tensor::cat(&video_out, 0)?))?;
        let text = match &self.text_out {
            Some(t) => Some(ops.linear(&t.to_add_out, &Input::new(&Tensor::cat(&text_out, 0)?))?),
            None => None,
        };
        Ok((video, text))
    }
}

/// The steps of a block, in execution order. A block can be built with only some of them (an
/// offload engine streaming steps rather than whole blocks); running such a partial block
/// applies just its steps, with exactly the arithmetic of the whole block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockStep {
    /// `norm1` / `norm1_context` (their modulation rows, kept in [`Streams`] for the
    /// feed-forward step), the joint attention, the gated attention residuals.
    Attention,
    /// The SwiGLU feed-forwards of both streams with their gated residuals.
    FeedForward,
}

impl BlockStep {
    pub const ALL: [BlockStep; 2] = [BlockStep::Attention, BlockStep::FeedForward];
}

/// A block's attention step.
#[derive(Debug, Clone)]
struct AttentionStep {
    norm1: Modulation,
    norm1_context: Modulation,
    attn: JointAttention,
}

/// A block's feed-forward step: `ff_context` is `None` in the `context_pre_only` (last) block.
#[derive(Debug, Clone)]
struct FeedForwardStep {
    ff: SwiGlu,
    ff_context: Option<SwiGlu>,
}

/// One `MochiTransformerBlock` of diffusers (or some of its steps, see [`BlockStep`]).
#[derive(Debug, Clone)]
pub struct MochiBlock {
    attention: Option<AttentionStep>,
    feed_forward: Option<FeedForwardStep>,
}

impl MochiBlock {
    /// Loads block `i`; `vb` points at `transformer_blocks.{i}`.
    pub fn new(cfg: &MochiTransformerConfig, i: usize, vb: VarBuilder) -> Result<Self> {
        Self::with_steps(cfg, i, vb, &BlockStep::ALL)
    }

    /// Loads only the weights of `steps` of block `i`; `vb` points at `transformer_blocks.{i}`.
    pub fn with_steps(
        cfg: &MochiTransformerConfig,
        i: usize,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self> {
        cfg.validate()?;
        let context_pre_only = cfg.context_pre_only(i);
        let (dim, text_dim) = (cfg.inner_dim(), cfg.pooled_projection_dim);
        let attention = if steps.contains(&BlockStep::Attention) {
            let norm1_context = if context_pre_only {
                let linear = candle_nn::linear(dim, text_dim, vb.pp("norm1_context.linear_1"))?;
                Modulation::ScaleOnly(linear)
            } else {
                let linear = candle_nn::linear(dim, 4 * text_dim, vb.pp("norm1_context.linear"))?;
                Modulation::Zero(linear)
            };
            Some(AttentionStep {
                norm1: Modulation::Zero(candle_nn::linear(dim, 4 * dim, vb.pp("norm1.linear"))?),
                norm1_context,
                attn: JointAttention::new(cfg, context_pre_only, vb.pp("attn1"))?,
            })
        } else {
            None
        };
        let feed_forward = if steps.contains(&BlockStep::FeedForward) {
            let ff_context = if context_pre_only {
                None
            } else {
                Some(SwiGlu::new(text_dim, vb.pp("ff_context"), cfg.fp8_matmul)?)
            };
            Some(FeedForwardStep {
                ff: SwiGlu::new(dim, vb.pp("ff"), cfg.fp8_matmul)?,
                ff_context,
            })
        } else {
            None
        };
        Ok(Self {
            attention,
            feed_forward,
        })
    }

    /// Runs the block's steps on both streams: the fused row kernels on CUDA bf16, else candle
    /// ops.
    pub fn forward(&self, s: &Streams, inputs: &BlockInputs) -> Result<Streams> {
        self.forward_hooked(s, inputs, &mut ComputeAll)
    }

    /// [`Ops::Fused`] where both streams are CUDA bf16 of widths the row kernels take and the
    /// heads are no wider than theirs.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn ops(&self, s: &Streams) -> Ops {
        #[cfg(feature = "cuda")]
        if row_ops::grouped_rows_supported(&s.video)
            && row_ops::grouped_rows_supported(&s.text)
            && self
                .attention
                .as_ref()
                .is_none_or(|a| a.attn.head_dim <= row_ops::MAX_HEAD_DIM)
        {
            return Ops::Fused;
        }
        Ops::Composite
    }

    /// [`Self::forward`] through `ops`.
    fn forward_with(
        &self,
        s: &Streams,
        inputs: &BlockInputs,
        ops: Ops,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Streams> {
        let mut s = s.clone();
        if let Some(step) = &self.attention {
            let video = step.norm1.apply(&s.video, &inputs.temb, ops)?;
            let text = step.norm1_context.apply(&s.text, &inputs.temb, ops)?;
            // The text output is as wide as the text stream, where the block has one.
            let text_shape = step.attn.text_out.as_ref().map(|_| s.text.dims());
            let (attn, text_attn) = joint_output(
                hooks,
                Submodule::SelfAttention,
                video.normed.dims(),
                text_shape,
                || step.attn.forward(&video.normed, &text.normed, inputs, ops),
            )?;
            let video_rows = video
                .emb
                .ok_or_else(|| candle_core::Error::Msg("norm1 gave no modulation rows".into()))?;
            s.video = gated_residual(&s.video, attn, &video_rows, 1, ops)?;
            if let (Some(text_attn), Some(rows)) = (text_attn, &text.emb) {
                s.text = gated_residual(&s.text, text_attn, rows, 1, ops)?;
            }
            s.rows = Some((video_rows, text.emb));
        }
        if let Some(step) = &self.feed_forward {
            let (video_rows, text_rows) = s.rows.take().ok_or_else(|| {
                candle_core::Error::Msg("a feed-forward step without its attention step".into())
            })?;
            let ff = (&step.ff, Submodule::FeedForward);
            s.video = feed_forward(&s.video, &video_rows, ff, ops, hooks)?;
            if let (Some(ff), Some(rows)) = (&step.ff_context, &text_rows) {
                let ff = (ff, Submodule::ContextFeedForward);
                s.text = feed_forward(&s.text, rows, ff, ops, hooks)?;
            }
        }
        Ok(s)
    }
}

/// `x + rms(delta)·tanh(gate)`, the gate row `gate` of a stream's RMSNormZero rows `emb`
/// (1: gate_msa, 3: gate_mlp).
fn gated_residual(
    x: &Tensor,
    delta: Tensor,
    emb: &Tensor,
    gate: usize,
    ops: Ops,
) -> Result<Tensor> {
    let factor = tanh_gate(&chunk(emb, gate, x.dim(2)?)?)?;
    ops.gated_residual(x, delta, &factor)
}

/// A stream's feed-forward residual: `x + rms(ff(rms(x)·(1 + scale_mlp)))·tanh(gate_mlp)`, the
/// feed-forward's output (`module`) through `hooks`.
fn feed_forward(
    x: &Tensor,
    emb: &Tensor,
    (ff, module): (&SwiGlu, Submodule),
    ops: Ops,
    hooks: &mut dyn BlockHooks,
) -> Result<Tensor> {
    let dim = x.dim(2)?;
    let out = hooks.output(module, &mut || {
        let normed = ops.modulated_rms(x, &one_plus(&chunk(emb, 2, dim)?)?)?;
        ff.forward(&normed, ops)
    })?;
    gated_residual(x, out, emb, 3, ops)
}

/// `MochiAttentionPool`: attention of the mask-weighted mean token over [mean; tokens] (pads
/// masked), `POOL_HEADS` heads, then `to_out`.
#[derive(Debug, Clone)]
struct AttentionPool {
    to_kv: Linear,
    to_q: Linear,
    to_out: Linear,
}

impl AttentionPool {
    fn new(embed_dim: usize, output_dim: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            to_kv: candle_nn::linear(embed_dim, 2 * embed_dim, vb.pp("to_kv"))?,
            to_q: candle_nn::linear(embed_dim, embed_dim, vb.pp("to_q"))?,
            to_out: candle_nn::linear(embed_dim, output_dim, vb.pp("to_out"))?,
        })
    }

    /// `x` `[B, L, D]`, `mask` `[B, L]` (1 keeps) in `x`'s dtype -> `[B, output_dim]`.
    fn forward(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, l, d) = x.dims3()?;
        let hd = d / POOL_HEADS;
        let count = mask.sum_keepdim(1)?.clamp(1.0, f64::INFINITY)?;
        let weights = mask.broadcast_div(&count)?.unsqueeze(2)?;
        let pooled = x.broadcast_mul(&weights)?.sum_keepdim(1)?;
        let x = Tensor::cat(&[&pooled, x], 1)?;
        let kv = self.to_kv.forward(&x)?;
        let split = |t: Tensor, s: usize| {
            t.reshape((b, s, POOL_HEADS, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let k = split(kv.narrow(2, 0, d)?, l + 1)?;
        let v = split(kv.narrow(2, d, d)?, l + 1)?;
        let q = split(self.to_q.forward(&pooled)?, 1)?;
        // The mean token is always attended; pads get -inf.
        let keep = Tensor::cat(
            &[
                &Tensor::ones((b, 1), DType::F32, x.device())?,
                &mask.to_dtype(DType::F32)?,
            ],
            1,
        )?;
        let bias = ((keep - 1.0)? * f64::from(f32::MAX))?
            .to_dtype(x.dtype())?
            .reshape((b, 1, 1, l + 1))?;
        let out = sdpa_with_bias(&q, &k, &v, 1.0 / (hd as f64).sqrt(), &bias)?;
        self.to_out.forward(&out.reshape((b, d))?)
    }
}

/// `MochiRoPE`'s positions of a `(frames, h, w)` token grid, `[F·h·w, 3]` in f32: the frame
/// index, and the centres of `h` (`w`) cells spanning `±size·s/2` with `s = sqrt(192² / (h·w))`.
fn rope_positions(grid: [usize; 3]) -> Vec<f32> {
    let [f, h, w] = grid;
    let scale = (ROPE_BASE_AREA / (h * w) as f64).sqrt();
    let centres = |n: usize| {
        let half = n as f64 * scale / 2.0;
        let edges = linspace_f32(-half, half, n + 1);
        edges
            .windows(2)
            .map(|e| (e[0] + e[1]) / 2.0)
            .collect::<Vec<f32>>()
    };
    let (hs, ws) = (centres(h), centres(w));
    let mut positions = Vec::with_capacity(f * h * w * 3);
    for t in 0..f {
        for &y in &hs {
            for &x in &ws {
                positions.extend_from_slice(&[t as f32, y, x]);
            }
        }
    }
    positions
}

/// The RoPE tables of a token grid from the learned frequencies `[3, heads, head_dim / 2]`:
/// angle = Σ_axis position·frequency, as (cos, sin) `[F·h·w, heads, head_dim / 2]` in f32.
pub fn rope_tables(
    pos_frequencies: &Tensor,
    grid: [usize; 3],
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let (axes, heads, half) = pos_frequencies.dims3()?;
    let tokens = grid.iter().product::<usize>();
    let positions = Tensor::from_vec(rope_positions(grid), (tokens, axes), device)?;
    let freqs = pos_frequencies
        .to_dtype(DType::F32)?
        .to_device(device)?
        .reshape((axes, heads * half))?;
    let angles = positions.matmul(&freqs)?.reshape((tokens, heads, half))?;
    Ok((angles.cos()?, angles.sin()?))
}

/// The diffusers `MochiTransformer3DModel`.
#[derive(Debug, Clone)]
pub struct MochiTransformer3DModel {
    cfg: MochiTransformerConfig,
    /// `patch_embed.proj`: Conv2d with kernel = stride = patch, as a linear over patches.
    patch_proj: Linear,
    /// `time_embed.timestep_embedder`: linear_1 -> SiLU -> linear_2.
    timestep_embedder: (Linear, Linear),
    pooler: AttentionPool,
    caption_proj: Linear,
    /// Learned RoPE frequencies `[3, heads, head_dim / 2]`.
    pos_frequencies: Tensor,
    blocks: Vec<MochiBlock>,
    /// `norm_out.linear`: Linear(SiLU(temb)) -> scale, shift.
    norm_out_linear: Linear,
    proj_out: Linear,
    dtype: DType,
}

impl MochiTransformer3DModel {
    /// Loads the whole model, blocks included.
    pub fn new(cfg: &MochiTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads everything except the blocks (for an engine that streams them).
    pub fn new_without_blocks(cfg: &MochiTransformerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let p = cfg.patch_size;
        let pvb = vb.pp("patch_embed.proj");
        let patch_w = pvb
            .get((dim, cfg.in_channels, p, p), "weight")?
            .reshape((dim, cfg.in_channels * p * p))?;
        let tvb = vb.pp("time_embed");
        let evb = tvb.pp("timestep_embedder");
        Ok(Self {
            cfg: cfg.clone(),
            patch_proj: Linear::new(patch_w, Some(pvb.get(dim, "bias")?)),
            timestep_embedder: (
                candle_nn::linear(cfg.time_embed_dim, dim, evb.pp("linear_1"))?,
                candle_nn::linear(dim, dim, evb.pp("linear_2"))?,
            ),
            pooler: AttentionPool::new(cfg.text_embed_dim, dim, tvb.pp("pooler"))?,
            caption_proj: candle_nn::linear(
                cfg.text_embed_dim,
                cfg.pooled_projection_dim,
                tvb.pp("caption_proj"),
            )?,
            pos_frequencies: vb.get(
                (3, cfg.num_attention_heads, cfg.attention_head_dim / 2),
                "pos_frequencies",
            )?,
            blocks: Vec::new(),
            norm_out_linear: candle_nn::linear(dim, 2 * dim, vb.pp("norm_out.linear"))?,
            proj_out: candle_nn::linear(dim, p * p * cfg.out_channels(), vb.pp("proj_out"))?,
            dtype: vb.dtype(),
        })
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &MochiTransformerConfig {
        &self.cfg
    }

    /// The loaded blocks, in execution order (empty after `new_without_blocks`).
    pub fn blocks(&self) -> &[MochiBlock] {
        &self.blocks
    }

    /// The conditioning `temb` `[B, inner]`: the timestep MLP plus the attention-pooled caption.
    pub fn conditioning(&self, timestep: &Tensor, text: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (lin1, lin2) = &self.timestep_embedder;
        let t_emb = timestep_embedding(timestep, self.cfg.time_embed_dim)?.to_dtype(self.dtype)?;
        let time = lin2.forward(&candle_nn::ops::silu(&lin1.forward(&t_emb)?)?)?;
        time + self.pooler.forward(text, &mask.to_dtype(self.dtype)?)?
    }

    /// `temb`, the two streams, the RoPE tables and the valid text tokens for `latents`
    /// `[B, C, F, H, W]`, `timestep` `[B]` (or one value), `encoder_hidden_states`
    /// `[B, L, text_embed_dim]` and its mask `[B, L]` (non-zero keeps; any dtype).
    pub fn prepare(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
        mask: &Tensor,
    ) -> Result<BlockInputs> {
        let cfg = &self.cfg;
        let (b, c, f, h, w) = latents.dims5()?;
        if c != cfg.in_channels {
            candle_core::bail!(
                "latents [B, C, F, H, W] have {c} channels, the transformer expects {}",
                cfg.in_channels
            );
        }
        let p = cfg.patch_size;
        if !h.is_multiple_of(p) || !w.is_multiple_of(p) || h == 0 || w == 0 || f == 0 {
            candle_core::bail!("latents {f}x{h}x{w} are not a whole number of {p}x{p} patches");
        }
        let grid = [f, h / p, w / p];
        let (eb, l, text_dim) = encoder_hidden_states.dims3()?;
        if eb != b || text_dim != cfg.text_embed_dim || mask.dims2()? != (b, l) {
            candle_core::bail!(
                "encoder_hidden_states {:?} / mask {:?} do not match batch {b} and text_embed_dim {}",
                encoder_hidden_states.dims(),
                mask.dims(),
                cfg.text_embed_dim
            );
        }
        let device = latents.device();
        let timestep = match timestep.elem_count() {
            1 if b > 1 => timestep.flatten_all()?.repeat(b)?,
            n if n == b => timestep.flatten_all()?,
            n => candle_core::bail!("timestep has {n} values for a batch of {b}"),
        };
        let text = encoder_hidden_states.to_dtype(self.dtype)?;
        let temb = self.conditioning(&timestep.to_device(device)?, &text, mask)?;
        let text = self.caption_proj.forward(&text)?;
        let patches = patchify(&latents.to_dtype(self.dtype)?, [1, p, p])?;
        let video = self.patch_proj.forward(&patches)?;
        let (cos, sin) = rope_tables(&self.pos_frequencies, grid, device)?;
        let rows = grid.iter().product::<usize>() * cfg.num_attention_heads;
        let half = cfg.attention_head_dim / 2;
        let valid_text = mask
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?
            .iter()
            .map(|row| {
                let kept: Vec<u32> = (0..l as u32).filter(|&j| row[j as usize] != 0.0).collect();
                Tensor::new(kept.as_slice(), device)
            })
            .collect::<Result<_>>()?;
        Ok(BlockInputs {
            streams: Some(Streams {
                video,
                text,
                rows: None,
            }),
            temb,
            rope_cos: cos.reshape((rows, half))?,
            rope_sin: sin.reshape((rows, half))?,
            valid_text,
            grid,
        })
    }

    /// The output norm (LayerNorm without affine, `·(1 + scale) + shift`) on the video stream,
    /// before `proj_out`.
    pub fn norm_out(&self, video: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        let dim = self.cfg.inner_dim();
        let emb = self
            .norm_out_linear
            .forward(&candle_nn::ops::silu(&inputs.temb)?)?;
        let scale = chunk(&emb, 0, dim)?;
        let shift = chunk(&emb, 1, dim)?;
        let ones = Tensor::ones(dim, video.dtype(), video.device())?;
        let zeros = Tensor::zeros(dim, video.dtype(), video.device())?;
        LayerNorm::new(ones, zeros, NORM_EPS)
            .forward(video)?
            .broadcast_mul(&(scale + 1.0)?)?
            .broadcast_add(&shift)
    }

    /// Output head and unpatchify: video `[B, N, inner]` -> `[B, C_out, F, H, W]`.
    pub fn finish(&self, video: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        self.finish_projecting(video, inputs, &mut |compute| compute())
    }

    /// [`Self::finish`], the output projection's output through `project` (a step cache's,
    /// which may stand in for it).
    pub fn finish_projecting(
        &self,
        video: &Tensor,
        inputs: &BlockInputs,
        project: &mut Through,
    ) -> Result<Tensor> {
        let out = project(&mut || self.proj_out.forward(&self.norm_out(video, inputs)?))?;
        let p = self.cfg.patch_size;
        unpatchify_channels_last(&out, inputs.grid, [1, p, p])
    }

    /// Full forward: `prepare`, every block, `finish`. Needs a model built with `new`.
    pub fn forward(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
        mask: &Tensor,
    ) -> Result<Tensor> {
        let inputs = self.prepare(latents, timestep, encoder_hidden_states, mask)?;
        crate::models::blocks::BlockForward::forward_resident(self, inputs)
    }
}

/// Placed by the block protocol: `transformer_blocks.{i}`, each streamed whole or step by step
/// (a block knows its index: the last one is `context_pre_only`).
/// The modules diffusers' layerwise casting leaves alone in `MochiTransformer3DModel` (its
/// `_skip_layerwise_casting_patterns`).
const LAYERWISE_CASTING_SKIP: &[&str] = &["patch_embed", "norm"];

impl RepeatedBlocks for MochiTransformer3DModel {
    const LAYERWISE_CASTING_SKIP: &'static [&'static str] = LAYERWISE_CASTING_SKIP;
    type Config = MochiTransformerConfig;
    type Block = MochiBlock;
    type Step = BlockStep;
    const BLOCKS: &'static str = "transformer_blocks";
    const STEPS: &'static [BlockStep] = &BlockStep::ALL;
    fn new(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        MochiTransformer3DModel::new(cfg, vb)
    }
    fn new_without_blocks(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        MochiTransformer3DModel::new_without_blocks(cfg, vb)
    }
    fn num_layers(cfg: &Self::Config) -> usize {
        cfg.num_layers
    }
    fn new_block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> Result<Self::Block> {
        MochiBlock::new(cfg, i, vb)
    }
    fn with_steps(
        cfg: &Self::Config,
        i: usize,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self::Block> {
        MochiBlock::with_steps(cfg, i, vb, steps)
    }
}

crate::block_forward!(
    MochiTransformer3DModel, BlockInputs, take_streams, Streams,
    |m, s, inputs| m.finish(&s.video, inputs) => Tensor
);

impl HookedBlock<Streams, BlockInputs> for MochiBlock {
    /// [`Self::forward`], asking `hooks` (a step cache) for `attn1`'s video and text outputs.
    fn forward_hooked(
        &self,
        s: &Streams,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Streams> {
        self.forward_with(s, inputs, self.ops(s), hooks)
    }
}

/// How diffusers names what its cache hooks see in Mochi-1: `transformer_blocks`, each
/// returning the video and text streams, and in each the joint attention `attn1` (PAB's) and
/// the streams' feed-forwards `ff` and `ff_context` (the last block has none for the text).
pub(super) const CACHE_NAMES: ModuleNames = ModuleNames {
    absent: Absent::LastContextFeedForward,
    ..ModuleNames::transformer_blocks(&[
        (Output::Attention, "attn1"),
        (Output::FeedForward, "ff"),
        (Output::ContextFeedForward, "ff_context"),
    ])
};

impl crate::models::blocks::CachedForward for MochiTransformer3DModel {
    fn finish_hooked(
        &self,
        s: Streams,
        inputs: &BlockInputs,
        project: &mut Through,
    ) -> Result<Tensor> {
        self.finish_projecting(&s.video, inputs, project)
    }

    fn hooked_blocks(&self) -> HookedBlocks {
        crate::models::video::DenoiseActivations::hooked_blocks(&self.cfg)
    }

    fn streams(s: &Streams, _: &BlockInputs) -> Result<Vec<Tensor>> {
        if s.rows.is_some() {
            candle_core::bail!("a step cache reads Mochi's streams between whole blocks");
        }
        Ok(vec![s.video.clone(), s.text.clone()])
    }

    fn state(streams: Vec<Tensor>, _: &BlockInputs) -> Result<Streams> {
        match <[Tensor; 2]>::try_from(streams) {
            Ok([video, text]) => Ok(Streams {
                video,
                text,
                rows: None,
            }),
            Err(_) => candle_core::bail!("Mochi's blocks thread two streams"),
        }
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    //! The fused path against the candle composition, on random bf16 inputs of Mochi-1's widths
    //! (24 heads x 128 = 3072 video, 1536 text) on the GPU: the `rms_mul` kernels and the q/k
    //! norms with RoPE element by element, then one block and a two-block forward.
    use super::*;
    use crate::models::row_ops::test_util::{
        assert_within_ulp, assert_within_ulp_carrying, device, randn,
    };

    const HEADS: usize = 24;
    const HEAD_DIM: usize = 128;
    const DIM: usize = HEADS * HEAD_DIM;
    const TEXT_DIM: usize = 1536;
    /// A token grid of 2 latent frames of 16 x 24 patches (768 tokens).
    const GRID: [usize; 3] = [2, 16, 24];
    const TOKENS: usize = GRID[0] * GRID[1] * GRID[2];

    /// Normal values `[b, s, d]` seen `offset` elements into their storage (an offset of 4 puts
    /// them 8 bytes off 16-byte alignment: the kernels' scalar accesses).
    fn randn_at(b: usize, s: usize, d: usize, offset: usize, dev: &Device) -> Result<Tensor> {
        let n = b * s * d;
        (randn(&[n + offset], 1.0, dev)? * 3.0)?
            .narrow(0, offset, n)?
            .reshape((b, s, d))
    }

    #[test]
    fn rms_mul_matches_composite() -> Result<()> {
        let Some(dev) = device("Mochi fused kernels") else {
            return Ok(());
        };
        // Both stream widths (a warp per row of 1536, two warps per row of 3072), aligned and not.
        for (b, s, d, offset) in [(2, TOKENS, DIM, 0), (2, 256, TEXT_DIM, 0), (1, 300, DIM, 4)] {
            let what = format!("b={b} d={d} offset={offset}");
            let x = randn_at(b, s, d, offset, &dev)?;
            let emb = randn(&[b, 4 * d], 0.5, &dev)?;
            let scale = one_plus(&chunk(&emb, 0, d)?)?;
            let want = modulated_rms(&x, &scale)?;
            let got = Ops::Fused.modulated_rms(&x, &scale)?;
            assert_within_ulp(&got, &want, &want, &format!("modulated rms {what}"))?;

            let res = randn(&[b, s, d], 1.0, &dev)?;
            let gate = tanh_gate(&chunk(&emb, 1, d)?)?;
            let gated = modulated_rms(&x, &gate)?;
            let want = (&res + &gated)?;
            // The kernel writes into `x`'s storage (at its offset).
            let got = Ops::Fused.gated_residual(&res, x, &gate)?;
            // A one-ulp flip of the rounded gated term, then the sum's rounding.
            let term = res.abs()?.maximum(&gated.abs()?)?;
            let carried = (&gated, &gated.ones_like()?);
            let what = format!("gated residual {what}");
            assert_within_ulp_carrying(&got, &want, &term, carried, &what)?;
        }
        Ok(())
    }

    #[test]
    fn qk_norm_rope_matches_composite() -> Result<()> {
        let Some(dev) = device("Mochi fused kernels") else {
            return Ok(());
        };
        let b = 2;
        let (cos, sin) = rope_tables(&randn(&[3, HEADS, HEAD_DIM / 2], 0.5, &dev)?, GRID, &dev)?;
        let table = |t: Tensor| t.reshape((TOKENS * HEADS, HEAD_DIM / 2));
        let (cos, sin) = (table(cos)?, table(sin)?);
        let x = randn(&[b, TOKENS, DIM], 1.0, &dev)?;
        let w = randn(&[HEAD_DIM], 1.0, &dev)?;
        let normed = Ops::Composite.head_norm_rope(x.clone(), &w, None, HEAD_DIM)?;
        // The video q/k (RoPE, a table row per token and head) and the text q/k (none).
        for rope in [Some((&cos, &sin)), None] {
            let what = format!("q/k norm, rope {}", rope.is_some());
            let want = Ops::Composite.head_norm_rope(x.clone(), &w, rope, HEAD_DIM)?;
            // The kernel works in place: hand it a copy.
            let got = Ops::Fused.head_norm_rope(x.copy()?, &w, rope, HEAD_DIM)?;
            if rope.is_none() {
                assert_within_ulp(&got, &want, &want, &what)?;
                continue;
            }
            // A rotated pair mixes both members: a one-ulp flip of either normed value carries
            // through, bounded by the larger of the two.
            let pair_max = normed
                .abs()?
                .reshape((b, TOKENS, DIM / 2, 2))?
                .max_keepdim(3)?
                .broadcast_as((b, TOKENS, DIM / 2, 2))?
                .reshape((b, TOKENS, DIM))?;
            let carried = (&pair_max, &pair_max.ones_like()?);
            assert_within_ulp_carrying(&got, &want, &pair_max, carried, &what)?;
        }
        Ok(())
    }

    /// The two blocks of a two-layer Mochi-1 with random weights: block 0 updates both streams,
    /// block 1 is `context_pre_only`.
    fn random_blocks(dev: &Device) -> Result<Vec<MochiBlock>> {
        let cfg = MochiTransformerConfig {
            num_layers: 2,
            ..Default::default()
        };
        let map = candle_nn::VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::BF16, dev);
        let blocks = (0..cfg.num_layers)
            .map(|i| MochiBlock::new(&cfg, i, vb.pp(format!("transformer_blocks.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        // The VarMap leaves the q/k norm weights at zero: draw them.
        for (name, var) in map.data().lock().expect("varmap lock").iter() {
            if name.contains("norm_") {
                var.set(&randn(var.dims(), 1.0, dev)?)?;
            }
        }
        Ok(blocks)
    }

    /// The blocks' inputs for `b` samples of `l` text tokens; sample 0 keeps only 200 of them.
    fn random_inputs(b: usize, l: usize, dev: &Device) -> Result<BlockInputs> {
        let (cos, sin) = rope_tables(&randn(&[3, HEADS, HEAD_DIM / 2], 0.5, dev)?, GRID, dev)?;
        let table = |t: Tensor| t.reshape((TOKENS * HEADS, HEAD_DIM / 2));
        let valid_text = (0..b)
            .map(|i| Tensor::arange(0u32, if i == 0 { 200 } else { l as u32 }, dev))
            .collect::<Result<_>>()?;
        Ok(BlockInputs {
            streams: Some(Streams {
                video: randn(&[b, TOKENS, DIM], 1.0, dev)?,
                text: randn(&[b, l, TEXT_DIM], 1.0, dev)?,
                rows: None,
            }),
            temb: randn(&[b, DIM], 1.0, dev)?,
            rope_cos: table(cos)?,
            rope_sin: table(sin)?,
            valid_text,
            grid: GRID,
        })
    }

    /// Asserts that `fused` is `composite` up to bf16 rounding at the stream's scale: no element
    /// more than 8 ulps of the largest magnitude apart (a rounding flip anywhere inside moves a
    /// residual sum by an ulp or two of its magnitude; 1-ulp flips of q/k and of the GEMM outputs
    /// reach the normed deltas as a few ulps), and a relative L2 error below 1e-2.
    fn assert_close(fused: &Tensor, composite: &Tensor, what: &str) -> Result<()> {
        let (fused, composite) = (fused.to_dtype(DType::F32)?, composite.to_dtype(DType::F32)?);
        let diff = (&fused - &composite)?;
        let worst = diff.abs()?.max_all()?.to_scalar::<f32>()?;
        let peak = composite.abs()?.max_all()?.to_scalar::<f32>()?;
        let ulp = 2f32.powi(peak.log2().floor() as i32 - 7);
        let err = (diff.sqr()?.sum_all()?.sqrt()? / composite.sqr()?.sum_all()?.sqrt()?)?
            .to_scalar::<f32>()?;
        eprintln!(
            "{what}: worst |fused - composite| {worst} ({} ulps of the peak {peak}), relative L2 error {err}",
            worst / ulp
        );
        assert!(fused
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|v| v.is_finite()));
        assert!(worst <= 8.0 * ulp, "{what}: {worst} over 8 ulps of {peak}");
        assert!(err < 1e-2, "{what}: relative L2 error {err}");
        Ok(())
    }

    #[test]
    fn block_fused_matches_composite() -> Result<()> {
        let Some(dev) = device("Mochi fused block") else {
            return Ok(());
        };
        let blocks = random_blocks(&dev)?;
        let mut inputs = random_inputs(2, 256, &dev)?;
        let streams = inputs.take_streams()?;
        assert_eq!(blocks[0].ops(&streams), Ops::Fused);
        // Block 0 from the same streams; block 1 from each path's own output of block 0.
        let (mut fused, mut composite) = (streams.clone(), streams);
        for (i, block) in blocks.iter().enumerate() {
            // A step cache hooking the joint attention (its video and text outputs kept
            // together) and the feed-forwards: the block's result the unhooked block's, then
            // reused bit for bit.
            let mut hooks = crate::models::step_cache::ReplayHooks::default();
            let hooked = block.forward_hooked(&fused, &inputs, &mut hooks)?;
            let reused = block.forward_hooked(&fused, &inputs, &mut hooks)?;
            let mut once = vec![Submodule::SelfAttention, Submodule::FeedForward];
            if block
                .feed_forward
                .as_ref()
                .is_some_and(|f| f.ff_context.is_some())
            {
                once.push(Submodule::ContextFeedForward);
            }
            assert_eq!(hooks.asked, [once.clone(), once].concat());
            fused = block.forward_with(&fused, &inputs, Ops::Fused, &mut ComputeAll)?;
            for (a, b, stream) in [
                (&hooked.video, &reused.video, "video"),
                (&hooked.text, &reused.text, "text"),
            ] {
                let gap = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?;
                assert_eq!(gap, 0.0, "block {i}: reused {stream} outputs");
            }
            assert_close(
                &hooked.video,
                &fused.video,
                &format!("block {i} hooked video"),
            )?;
            assert_close(&hooked.text, &fused.text, &format!("block {i} hooked text"))?;
            composite = block.forward_with(&composite, &inputs, Ops::Composite, &mut ComputeAll)?;
            assert_close(&fused.video, &composite.video, &format!("block {i} video"))?;
            assert_close(&fused.text, &composite.text, &format!("block {i} text"))?;
        }
        Ok(())
    }
}
