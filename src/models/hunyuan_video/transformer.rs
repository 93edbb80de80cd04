//! HunyuanVideo diffusion transformer (diffusers `HunyuanVideoTransformer3DModel`, text-to-video).
//!
//! The forward pass is split so that an external engine can stream the blocks:
//!
//! 1. [`HunyuanVideoTransformer3DModel::prepare`]: patch embedding, the token refiner's
//!    conditioning and input projection (`context_embedder` without its blocks), the time +
//!    guidance + pooled-text embedding and the RoPE table.
//! 2. [`HunyuanVideoBlock::forward`] for every block of [`HunyuanVideoTransformer3DModel::blocks`]
//!    in order: first the token refiner's blocks (`context_embedder.token_refiner.refiner_blocks.*`,
//!    on the text alone), then the dual-stream blocks (`transformer_blocks.*`, video and text with
//!    their own weights, joint attention), then the single-stream blocks
//!    (`single_transformer_blocks.*`, one weight set over the joint sequence). All carry the
//!    [`Streams`] (video, text); a block may also be built and run step by step ([`BlockStep`]).
//! 3. [`HunyuanVideoTransformer3DModel::finish`]: output norm, `proj_out`, unpatchify.
//!
//! A model built with [`HunyuanVideoTransformer3DModel::new_without_blocks`] holds no block
//! weights; the caller builds block `i` with [`HunyuanVideoBlock::new`] from the root
//! `VarBuilder` (its weights live under [`HunyuanVideoTransformerConfig::block_prefix`]).
//!
//! The text padding mask acts on keys only: in the joint attention the text keys past each
//! entry's valid length are masked (padded queries are computed normally), in the token refiner
//! valid queries see the valid keys (and key 0), padded queries only key 0. Attention over a
//! subset of keys is computed by selecting those keys, which is exactly a masked softmax.
//!
//! Dtypes: weights and activations in the `VarBuilder` dtype, LayerNorm statistics, RoPE and
//! the attention softmax in f32.

use std::sync::Arc;

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;

use crate::models::attention::{sdpa, sdpa_key_prefix};
use crate::models::blocks::{Blockwise, HookedBlock};
use crate::models::patches::{text_len, token_grid, unpatchify, whole_patches};
use crate::models::projection::{project, Input, Projection};
#[cfg(feature = "cuda")]
use crate::models::row_ops::{self, BatchRow, Gate, Rows};
use crate::models::step_cache::{
    joint_output, Absent, BlockHooks, ComputeAll, HookedBlocks, ModuleNames, Output, Submodule,
    Through,
};
use crate::models::wan::transformer::timestep_embedding;

/// Width of the sinusoidal timestep/guidance projection (diffusers' `Timesteps(256, ...)`).
pub const TIMESTEP_CHANNELS: usize = 256;

/// Epsilon of every LayerNorm and q/k RMSNorm of the model (hard-coded in diffusers).
const NORM_EPS: f64 = 1e-6;

/// `HunyuanVideoTokenRefiner`'s default `mlp_ratio`, which the model never overrides.
const REFINER_MLP_RATIO: f64 = 4.0;

/// Tokens per MLP chunk: bounds the `[tokens, mlp_dim]` intermediates (2.9 GB each in bf16 for
/// a 720x1280x129 video's single-stream MLP) to ~200 MB. Rows of a Linear are independent.
pub const MLP_CHUNK_TOKENS: usize = 8192;

/// `f` applied to `x` `[B, S, D]` by chunks of at most [`MLP_CHUNK_TOKENS`] tokens along S.
/// `f` receives each chunk's first token index and the chunk.
fn by_token_chunks(x: &Tensor, f: impl Fn(usize, &Tensor) -> Result<Tensor>) -> Result<Tensor> {
    by_chunks_of(x, MLP_CHUNK_TOKENS, f)
}

fn by_chunks_of(
    x: &Tensor,
    chunk: usize,
    f: impl Fn(usize, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let s = x.dim(1)?;
    if s <= chunk {
        return f(0, x);
    }
    let parts = (0..s)
        .step_by(chunk)
        .map(|start| f(start, &x.narrow(1, start, chunk.min(s - start))?))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 1)
}

fn default_in_channels() -> usize {
    16
}
fn default_out_channels() -> Option<usize> {
    Some(16)
}
fn default_heads() -> usize {
    24
}
fn default_head_dim() -> usize {
    128
}
fn default_num_layers() -> usize {
    20
}
fn default_num_single_layers() -> usize {
    40
}
fn default_num_refiner_layers() -> usize {
    2
}
fn default_mlp_ratio() -> f64 {
    4.0
}
fn default_patch_size() -> usize {
    2
}
fn default_patch_size_t() -> usize {
    1
}
fn default_qk_norm() -> Option<String> {
    Some("rms_norm".to_string())
}
fn default_true() -> bool {
    true
}
fn default_text_embed_dim() -> usize {
    4096
}
fn default_pooled_projection_dim() -> usize {
    768
}
fn default_rope_theta() -> f64 {
    256.0
}
fn default_rope_axes_dim() -> Vec<usize> {
    vec![16, 56, 56]
}

/// `transformer/config.json` of a diffusers HunyuanVideo checkpoint; missing keys take
/// diffusers' defaults (the published 13B model).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct HunyuanVideoTransformerConfig {
    /// Latent channels in.
    #[serde(default = "default_in_channels")]
    pub in_channels: usize,
    /// `null` means "same as `in_channels`", as in diffusers.
    #[serde(default = "default_out_channels")]
    pub out_channels: Option<usize>,
    /// Attention heads of every attention (refiner included).
    #[serde(default = "default_heads")]
    pub num_attention_heads: usize,
    /// Width of one head.
    #[serde(default = "default_head_dim")]
    pub attention_head_dim: usize,
    /// Dual-stream blocks.
    #[serde(default = "default_num_layers")]
    pub num_layers: usize,
    /// Single-stream blocks.
    #[serde(default = "default_num_single_layers")]
    pub num_single_layers: usize,
    /// Blocks of the text token refiner.
    #[serde(default = "default_num_refiner_layers")]
    pub num_refiner_layers: usize,
    /// MLP width over model width (`int(inner * mlp_ratio)`).
    #[serde(default = "default_mlp_ratio")]
    pub mlp_ratio: f64,
    /// Spatial patch.
    #[serde(default = "default_patch_size")]
    pub patch_size: usize,
    /// Temporal patch.
    #[serde(default = "default_patch_size_t")]
    pub patch_size_t: usize,
    /// q/k normalisation; only `rms_norm` (per head) is supported.
    #[serde(default = "default_qk_norm")]
    pub qk_norm: Option<String>,
    /// Whether the (distilled) guidance scale is embedded into the conditioning.
    #[serde(default = "default_true")]
    pub guidance_embeds: bool,
    /// Width of the Llama text embeddings.
    #[serde(default = "default_text_embed_dim")]
    pub text_embed_dim: usize,
    /// Width of the pooled CLIP embedding.
    #[serde(default = "default_pooled_projection_dim")]
    pub pooled_projection_dim: usize,
    /// RoPE base.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RoPE split of a head into (frame, height, width) parts.
    #[serde(default = "default_rope_axes_dim")]
    pub rope_axes_dim: Vec<usize>,
    /// Image-to-video conditioning (unsupported; must be `null`).
    #[serde(default)]
    pub image_condition_type: Option<String>,
    /// Not in the file: the blocks are built without their modulation Linears, whose outputs
    /// (which depend on the step's conditioning alone) a [`HunyuanModulations`] computes for
    /// every step before denoising and hands in through [`BlockInputs::modulations`]. A streamed
    /// DiT then moves 27% fewer bytes per forward.
    #[serde(skip)]
    pub modulations_apart: bool,
    /// Not in the file: the dual- and single-stream blocks' Linears run in fp8
    /// (`--fp8-matmul`, set by the pipeline); the refiner's and the modulations' stay exact.
    #[serde(skip)]
    pub fp8_matmul: bool,
}

impl Default for HunyuanVideoTransformerConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("defaults deserialize")
    }
}

/// Which of the three kinds a block is, in execution order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// `context_embedder.token_refiner.refiner_blocks.*`: self-attention over the text alone.
    Refiner,
    /// `transformer_blocks.*`: separate weights per stream, joint attention.
    DualStream,
    /// `single_transformer_blocks.*`: one weight set over the joint sequence.
    SingleStream,
}

impl BlockKind {
    /// Every kind, in execution order.
    pub const ALL: [BlockKind; 3] = [
        BlockKind::Refiner,
        BlockKind::DualStream,
        BlockKind::SingleStream,
    ];

    /// The steps of a block of this kind, in execution order: its modulation steps, then its
    /// body's.
    pub fn steps(self) -> &'static [BlockStep] {
        match self {
            BlockKind::Refiner => &[
                BlockStep::RefinerModulation,
                BlockStep::RefinerAttention,
                BlockStep::RefinerFeedForward,
            ],
            BlockKind::DualStream => &[
                BlockStep::VideoModulation,
                BlockStep::TextModulation,
                BlockStep::JointAttention,
                BlockStep::VideoFeedForward,
                BlockStep::TextFeedForward,
            ],
            BlockKind::SingleStream => &[
                BlockStep::SingleModulation,
                BlockStep::SingleAttention,
                BlockStep::SingleMlp,
            ],
        }
    }

    /// The steps that compute the block's modulations from the conditioning alone (the first).
    pub fn modulation_steps(self) -> &'static [BlockStep] {
        &self.steps()[..self.modulations()]
    }

    /// The steps over the streams: every step but the modulations.
    pub fn body_steps(self) -> &'static [BlockStep] {
        &self.steps()[self.modulations()..]
    }

    /// How many modulation steps lead the block's steps.
    fn modulations(self) -> usize {
        match self {
            BlockKind::DualStream => 2,
            BlockKind::Refiner | BlockKind::SingleStream => 1,
        }
    }
}

/// The steps of a block, in execution order, each holding a disjoint part of the block's
/// weights (at most ~170 MB in bf16 at the published size). A block can be built with only
/// some of them (an offload engine streaming steps rather than whole blocks); running such a
/// partial block applies just its steps, with exactly the arithmetic of the whole block, and
/// hands what later steps need (modulations, the single-stream attention) on in [`Streams`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockStep {
    /// Refiner: `norm_out.linear` (gate_msa and gate_mlp, from the refiner's conditioning).
    RefinerModulation,
    /// Refiner: `norm1`, self-attention over the valid text, gated residual.
    RefinerAttention,
    /// Refiner: `norm2`, SiLU feed-forward, gated residual.
    RefinerFeedForward,
    /// Dual-stream: `norm1.linear` (the video stream's six modulations).
    VideoModulation,
    /// Dual-stream: `norm1_context.linear` (the text stream's six modulations).
    TextModulation,
    /// Dual-stream: both modulated norms, q/k/v of both streams, joint attention, `to_out` and
    /// `to_add_out`, both gated residuals.
    JointAttention,
    /// Dual-stream: the video stream's modulated norm, `ff`, gated residual.
    VideoFeedForward,
    /// Dual-stream: the text stream's modulated norm, `ff_context`, gated residual.
    TextFeedForward,
    /// Single-stream: `norm.linear` (shift, scale, gate).
    SingleModulation,
    /// Single-stream: the modulated norm of the joint sequence, q/k/v and attention.
    SingleAttention,
    /// Single-stream: `proj_mlp`, `proj_out` over [attention; MLP], gated residual.
    SingleMlp,
}

impl HunyuanVideoTransformerConfig {
    /// Model width: heads x head dim.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Output channels (`out_channels or in_channels`).
    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// Hidden width of the MLPs, `int(inner * mlp_ratio)` as Python truncates it.
    pub fn mlp_dim(&self) -> usize {
        (self.inner_dim() as f64 * self.mlp_ratio) as usize
    }

    /// Hidden width of the token refiner's MLPs: diffusers builds the refiner without the
    /// config's `mlp_ratio`, so it is always `int(inner * 4.0)`.
    pub fn refiner_mlp_dim(&self) -> usize {
        (self.inner_dim() as f64 * REFINER_MLP_RATIO) as usize
    }

    /// The steps a block of `kind` is built with: all, or with `modulations_apart` its
    /// body's.
    pub fn steps_of(&self, kind: BlockKind) -> &'static [BlockStep] {
        if self.modulations_apart {
            kind.body_steps()
        } else {
            kind.steps()
        }
    }

    /// All blocks: refiner, dual-stream, then single-stream.
    pub fn num_blocks(&self) -> usize {
        self.num_refiner_layers + self.num_layers + self.num_single_layers
    }

    /// Kind of block `index` (in execution order) and its index within its kind.
    pub fn block_kind(&self, index: usize) -> Result<(BlockKind, usize)> {
        let mut first = 0;
        for (kind, count) in [
            (BlockKind::Refiner, self.num_refiner_layers),
            (BlockKind::DualStream, self.num_layers),
            (BlockKind::SingleStream, self.num_single_layers),
        ] {
            if index < first + count {
                return Ok((kind, index - first));
            }
            first += count;
        }
        candle_core::bail!("block {index} of a {}-block transformer", self.num_blocks())
    }

    /// Weight prefix of block `index` (execution order):
    /// `context_embedder.token_refiner.refiner_blocks.{i}`, `transformer_blocks.{i}` or
    /// `single_transformer_blocks.{i}`.
    pub fn block_prefix(&self, index: usize) -> Result<String> {
        Ok(match self.block_kind(index)? {
            (BlockKind::Refiner, i) => format!("context_embedder.token_refiner.refiner_blocks.{i}"),
            (BlockKind::DualStream, i) => format!("transformer_blocks.{i}"),
            (BlockKind::SingleStream, i) => format!("single_transformer_blocks.{i}"),
        })
    }

    /// Rejects configurations this text-to-video model cannot run, naming the key.
    pub fn validate(&self) -> Result<()> {
        if let Some(kind) = &self.image_condition_type {
            candle_core::bail!(
                "transformer config: image_condition_type {kind:?} (image-to-video) is not supported"
            );
        }
        if self.qk_norm.as_deref() != Some("rms_norm") {
            candle_core::bail!(
                "transformer config: qk_norm {:?} is not supported (only \"rms_norm\")",
                self.qk_norm
            );
        }
        if self.num_attention_heads == 0 || self.attention_head_dim == 0 {
            candle_core::bail!(
                "transformer config: num_attention_heads and attention_head_dim must be positive"
            );
        }
        if self.in_channels == 0 || self.out_channels == Some(0) {
            candle_core::bail!("transformer config: in_channels and out_channels must be positive");
        }
        if self.patch_size == 0 || self.patch_size_t == 0 {
            candle_core::bail!("transformer config: patch_size and patch_size_t must be positive");
        }
        if self.text_embed_dim == 0 || self.pooled_projection_dim == 0 {
            candle_core::bail!(
                "transformer config: text_embed_dim and pooled_projection_dim must be positive"
            );
        }
        if !(self.mlp_ratio.is_finite() && self.mlp_ratio > 0.0) || self.mlp_dim() == 0 {
            candle_core::bail!(
                "transformer config: mlp_ratio {} gives no MLP width",
                self.mlp_ratio
            );
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            candle_core::bail!(
                "transformer config: rope_theta {} must be positive",
                self.rope_theta
            );
        }
        if self.rope_axes_dim.len() != 3
            || self.rope_axes_dim.iter().any(|d| d % 2 != 0)
            || self.rope_axes_dim.iter().sum::<usize>() != self.attention_head_dim
        {
            candle_core::bail!(
                "transformer config: rope_axes_dim {:?} must be three even sizes summing to attention_head_dim {}",
                self.rope_axes_dim,
                self.attention_head_dim
            );
        }
        Ok(())
    }
}

/// Everything the blocks and the output head need, computed once per forward by `prepare`.
#[derive(Debug, Clone)]
pub struct BlockInputs {
    streams: Option<Streams>,
    /// Conditioning `[B, inner]`: timestep + guidance + pooled text embeddings (`None` from a
    /// model built with [`HunyuanVideoTransformerConfig::modulations_apart`]: it holds no
    /// conditioner, the modulations come computed).
    pub temb: Option<Tensor>,
    /// The token refiner's conditioning `[B, inner]`: timestep + mask-weighted mean text
    /// (`None` as `temb`).
    pub refiner_temb: Option<Tensor>,
    /// RoPE cosines `[video tokens, head_dim / 2]` in f32, one per interleaved pair.
    pub rope_cos: Tensor,
    /// RoPE sines, same layout as `rope_cos`.
    pub rope_sin: Tensor,
    /// Valid text tokens per batch entry (the mask's sum): later text keys are masked.
    pub text_lens: Vec<usize>,
    /// `text_valid[b][j]`: whether text token j of entry b is real (the refiner's mask).
    pub text_valid: Vec<Vec<bool>>,
    /// Batch size.
    pub batch: usize,
    /// Token grid (frames, height, width) after patching.
    pub grid: [usize; 3],
    /// With [`HunyuanVideoTransformerConfig::modulations_apart`]: each block's modulation
    /// chunks for this forward, by block index ([`HunyuanVideoBlock::modulation`]'s output).
    pub modulations: Option<Arc<Vec<Vec<Tensor>>>>,
}

impl BlockInputs {
    /// Block `index`'s modulation chunks computed apart, if they were (index `num_blocks`:
    /// the output head's).
    fn modulation(&self, index: usize) -> Option<&[Tensor]> {
        Some(self.modulations.as_ref()?.get(index)?.as_slice())
    }

    /// `temb`, for a part that holds its modulation Linear.
    fn temb(&self) -> Result<&Tensor> {
        conditioning(&self.temb)
    }

    /// `refiner_temb`, for a refiner block that holds its modulation Linear.
    fn refiner_temb(&self) -> Result<&Tensor> {
        conditioning(&self.refiner_temb)
    }

    /// Takes the streams that feed the first block: video `[B, N, inner]` and the projected,
    /// not yet refined, text `[B, L, inner]` (once; the inputs do not keep a copy).
    pub fn take_streams(&mut self) -> Result<Streams> {
        match self.streams.take() {
            Some(s) => Ok(s),
            None => candle_core::bail!("block-0 streams already taken"),
        }
    }
}

/// A conditioning a modulation Linear reads; absent where the model computes none.
fn conditioning(t: &Option<Tensor>) -> Result<&Tensor> {
    t.as_ref().ok_or_else(|| {
        candle_core::Error::Msg(
            "this transformer computes its modulations apart: pass them in BlockInputs::modulations"
                .into(),
        )
    })
}

/// What flows from block to block: the video `[B, N, inner]` and text `[B, L, inner]` streams
/// and, between the steps of a block streamed step by step, what its earlier steps computed
/// for its later ones.
#[derive(Debug, Clone)]
pub struct Streams {
    pub video: Tensor,
    pub text: Tensor,
    carry: Carry,
}

impl Streams {
    /// Streams between whole blocks.
    pub fn new(video: Tensor, text: Tensor) -> Self {
        Self {
            video,
            text,
            carry: Carry::None,
        }
    }

    /// Whether a block's later steps still wait for this state (false between whole blocks).
    pub fn mid_block(&self) -> bool {
        !matches!(self.carry, Carry::None)
    }
}

/// What a block's earlier steps hand its later ones.
#[derive(Debug, Clone)]
enum Carry {
    /// Between blocks.
    None,
    /// Refiner: gate_msa and gate_mlp.
    Refiner { gates: Vec<Tensor> },
    /// Dual-stream: the six modulation chunks of each stream, once computed.
    DualStream {
        video: Option<Vec<Tensor>>,
        text: Option<Vec<Tensor>>,
    },
    /// Single-stream: shift, scale and gate.
    SingleModulation { m: Vec<Tensor> },
    /// Single-stream: the joint sequence's modulated norm, the attention output and the gate.
    SingleStream {
        normed: Tensor,
        attn: Tensor,
        gate: Tensor,
    },
}

impl Carry {
    /// Which block kind left this state, for errors.
    fn after(&self) -> &'static str {
        match self {
            Carry::None => "a whole block",
            Carry::Refiner { .. } => "a refiner step",
            Carry::DualStream { .. } => "a dual-stream step",
            Carry::SingleModulation { .. } | Carry::SingleStream { .. } => "a single-stream step",
        }
    }
}

/// Rows `start..start + len` of the joint sequence [video; text], read from the streams (a
/// copy only where the rows span both).
fn joint_rows(streams: &Streams, start: usize, len: usize) -> Result<Tensor> {
    let n_video = streams.video.dim(1)?;
    if start + len <= n_video {
        return streams.video.narrow(1, start, len);
    }
    if start >= n_video {
        return streams.text.narrow(1, start - n_video, len);
    }
    let video = streams.video.narrow(1, start, n_video - start)?;
    let text = streams.text.narrow(1, 0, start + len - n_video)?;
    Tensor::cat(&[video, text], 1)
}

/// What a step needs from an earlier step of its block, or a one-line error naming it.
fn carried<T>(value: Option<T>, what: &str) -> Result<T> {
    value.ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "HunyuanVideo block step run without its block's {what} (steps must run in order)"
        ))
    })
}

/// LayerNorm over the last dim with statistics in f32 (two-pass), no affine; cast back.
fn layer_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = x.to_dtype(DType::F32)?;
    let mean = xf.mean_keepdim(D::Minus1)?;
    let xc = xf.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)?.to_dtype(x.dtype())
}

/// Affine LayerNorm (`nn.LayerNorm(elementwise_affine=True)`).
#[derive(Debug, Clone)]
struct AffineLayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl AffineLayerNorm {
    fn new(dim: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get(dim, "weight")?,
            bias: vb.get(dim, "bias")?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        layer_norm(x, NORM_EPS)?
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)
    }
}

/// `norm(x) * (1 + scale) + shift` with per-batch `[B, dim]` scale and shift.
fn modulate(normed: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    normed
        .broadcast_mul(&(scale.unsqueeze(1)? + 1.0)?)?
        .broadcast_add(&shift.unsqueeze(1)?)
}

/// `modulate(&layer_norm(x, NORM_EPS)?, shift, scale)` for `x` `[B, S, dim]`: one fused kernel
/// on CUDA bf16 (same ops, same order).
pub(crate) fn norm_modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    norm_modulate_eps(x, shift, scale, NORM_EPS)
}

/// [`norm_modulate`] with the LayerNorm's `eps`.
pub(crate) fn norm_modulate_eps(
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if row_ops::rows_supported(x) && shift.dtype() == DType::BF16 {
        let (b, s, dim) = x.dims3()?;
        let table = Tensor::cat(&[shift, scale], 1)?;
        let modulation = row_ops::Modulation {
            table: &table,
            stride: 2 * dim,
            shift: 0,
            scale: dim,
            text: None,
            rows: None,
        };
        return row_ops::layer_norm_modulate(
            &x.reshape((b * s, dim))?,
            row_ops::LayerNorm::TwoPass,
            Some(modulation),
            Rows { row0: 0, seq: s },
            eps,
        )?
        .reshape((b, s, dim));
    }
    modulate(&layer_norm(x, eps)?, shift, scale)
}

/// `x + delta * gate` with a per-batch `[B, dim]` gate; on CUDA bf16 one kernel that writes
/// into `delta`'s storage (`delta` is consumed).
pub(crate) fn gated(x: &Tensor, delta: Tensor, gate: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if row_ops::supported(&delta) && x.dtype() == DType::BF16 && gate.dtype() == DType::BF16 {
        let (b, s, dim) = delta.dims3()?;
        let gate = gate.contiguous()?;
        let gate = BatchRow {
            table: &gate,
            stride: dim,
            offset: 0,
            text: None,
            rows: None,
        };
        return row_ops::residual_into_delta(
            &x.reshape((b * s, dim))?,
            delta.reshape((b * s, dim))?,
            None,
            Some(Gate::Bf16(gate)),
            Rows { row0: 0, seq: s },
        )?
        .reshape((b, s, dim));
    }
    x + delta.broadcast_mul(&gate.unsqueeze(1)?)?
}

/// `Linear(SiLU(temb))` split into `n` chunks `[B, dim]` (the AdaLN modulations).
#[derive(Debug, Clone)]
pub(crate) struct Modulation {
    linear: Linear,
    chunks: usize,
}

impl Modulation {
    pub(crate) fn new(dim: usize, chunks: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            linear: candle_nn::linear(dim, chunks * dim, vb.pp("linear"))?,
            chunks,
        })
    }

    pub(crate) fn forward(&self, temb: &Tensor) -> Result<Vec<Tensor>> {
        let emb = project(&self.linear, &candle_nn::ops::silu(temb)?)?;
        emb.chunk(self.chunks, 1)
    }
}

/// Linear -> activation -> Linear (diffusers `FeedForward` `net.0.proj` / `net.2`,
/// `TimestepEmbedding` and `PixArtAlphaTextProjection` `linear_1` / `linear_2`).
#[derive(Debug, Clone)]
pub(crate) struct Mlp {
    fc1: Projection,
    fc2: Projection,
    act: Act,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Act {
    GeluTanh,
    Silu,
}

impl Mlp {
    /// A block's feed-forward, its Linears in fp8 where `fp8` (`--fp8-matmul`).
    pub(crate) fn feed_forward(
        (dim, hidden): (usize, usize),
        act: Act,
        vb: VarBuilder,
        fp8: bool,
    ) -> Result<Self> {
        Ok(Self {
            fc1: Projection::load((dim, hidden), vb.pp("net.0.proj"), fp8)?,
            fc2: Projection::load((hidden, dim), vb.pp("net.2"), fp8)?,
            act,
        })
    }

    /// `linear_1` -> SiLU -> `linear_2`.
    pub(crate) fn embedder(input: usize, dim: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            fc1: Projection::load((input, dim), vb.pp("linear_1"), false)?,
            fc2: Projection::load((dim, dim), vb.pp("linear_2"), false)?,
            act: Act::Silu,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = Input::new(x);
        let h = match self.act {
            Act::GeluTanh => self.fc1.apply(&x, true)?,
            Act::Silu => candle_nn::ops::silu(&self.fc1.apply(&x, false)?)?,
        };
        self.fc2.apply(&Input::new(&h), false)
    }
}

/// `[B, S, inner]` -> `[B, heads, S, head_dim]` (contiguous).
pub(crate) fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, s, dim) = x.dims3()?;
    x.reshape((b, s, heads, dim / heads))?
        .transpose(1, 2)?
        .contiguous()
}

/// `[B, heads, S, head_dim]` -> `[B, S, inner]`.
pub(crate) fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, h, s, d) = x.dims4()?;
    x.transpose(1, 2)?.reshape((b, s, h * d))
}

/// Interleaved-pair RoPE on the first `cos.dim(0)` positions of `x` `[B, heads, S, D]`
/// (computed in f32, cast back); later positions (the text) pass through.
fn rope_prefix(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let n = cos.dim(0)?;
    let s = x.dim(2)?;
    let rotate = |t: &Tensor| -> Result<Tensor> {
        candle_nn::rotary_emb::rope_i(&t.to_dtype(DType::F32)?.contiguous()?, cos, sin)?
            .to_dtype(x.dtype())
    };
    if n == s {
        return rotate(x);
    }
    let video = rotate(&x.narrow(2, 0, n)?)?;
    Tensor::cat(&[video, x.narrow(2, n, s - n)?], 2)
}

/// Joint attention over `[B, heads, S, D]` where only the first `kv_lens[b]` keys of batch
/// entry `b` are visible (the boolean key mask of diffusers, as a selection of keys).
fn attention_key_prefix(q: &Tensor, k: &Tensor, v: &Tensor, kv_lens: &[usize]) -> Result<Tensor> {
    sdpa_key_prefix(q, k, v, 1.0 / (q.dim(3)? as f64).sqrt(), kv_lens)
}

/// q, k, v projections (with bias) and the per-head RMSNorm of q and k (HunyuanVideo's and
/// FLUX.1's attentions).
#[derive(Debug, Clone)]
pub(crate) struct QkvProjection {
    to_q: Projection,
    to_k: Projection,
    to_v: Projection,
    norm_q: Tensor,
    norm_k: Tensor,
    heads: usize,
}

impl QkvProjection {
    /// The projections of `heads` heads of `head_dim` named `names` (q, k, v, q norm, k norm)
    /// under `vb`, in fp8 where `fp8`.
    pub(crate) fn new(
        (heads, head_dim): (usize, usize),
        vb: &VarBuilder,
        names: [&str; 5],
        fp8: bool,
    ) -> Result<Self> {
        let dim = heads * head_dim;
        let linear = |name: &str| Projection::load((dim, dim), vb.pp(name), fp8);
        Ok(Self {
            to_q: linear(names[0])?,
            to_k: linear(names[1])?,
            to_v: linear(names[2])?,
            norm_q: vb.get(head_dim, &format!("{}.weight", names[3]))?,
            norm_k: vb.get(head_dim, &format!("{}.weight", names[4]))?,
            heads,
        })
    }

    /// A joint attention's two sets under `attn`, as diffusers names them: the main stream's
    /// (`to_q`, ..., `norm_k`) and the text stream's (`add_q_proj`, ..., `norm_added_k`).
    pub(crate) fn joint(
        heads: (usize, usize),
        attn: &VarBuilder,
        fp8: bool,
    ) -> Result<(Self, Self)> {
        Ok((
            Self::new(
                heads,
                attn,
                ["to_q", "to_k", "to_v", "norm_q", "norm_k"],
                fp8,
            )?,
            Self::new(
                heads,
                attn,
                [
                    "add_q_proj",
                    "add_k_proj",
                    "add_v_proj",
                    "norm_added_q",
                    "norm_added_k",
                ],
                fp8,
            )?,
        ))
    }

    /// `x` `[B, S, inner]` -> normed q, k and v, each `[B, heads, S, head_dim]`; q and k
    /// rotated at the first `rope.0.dim(0)` positions when `rope` (cos, sin) is given. On CUDA
    /// bf16 the bias, per-head RMSNorm and RoPE of q and k are one kernel each.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, s, dim) = x.dims3()?;
        // One input for q, k and v: quantized once under `--fp8-matmul`.
        let rows = Input::new(&x.reshape((b * s, dim))?);
        let v = split_heads(
            &self.to_v.apply(&rows, false)?.reshape((b, s, dim))?,
            self.heads,
        )?;
        #[cfg(feature = "cuda")]
        if row_ops::supported(x) && self.norm_q.dim(0)? <= row_ops::MAX_HEAD_DIM {
            let head_dim = dim / self.heads;
            let norm_rope = |linear: &Projection, w: &Tensor| -> Result<Tensor> {
                row_ops::head_norm_rope(
                    linear.product(&rows)?,
                    linear.bias(),
                    w,
                    None,
                    rope,
                    head_dim,
                    0,
                    Rows { row0: 0, seq: s },
                    NORM_EPS,
                )?
                .reshape((b, s, self.heads, head_dim))?
                .transpose(1, 2)
            };
            let q = norm_rope(&self.to_q, &self.norm_q)?;
            let k = norm_rope(&self.to_k, &self.norm_k)?;
            return Ok((q, k, v));
        }
        let norm_rope = |linear: &Projection, w: &Tensor| -> Result<Tensor> {
            let t = split_heads(
                &linear.apply(&rows, false)?.reshape((b, s, dim))?,
                self.heads,
            )?;
            let t = candle_nn::ops::rms_norm(&t, w, NORM_EPS as f32)?;
            match rope {
                Some((cos, sin)) => rope_prefix(&t, cos, sin),
                None => Ok(t),
            }
        };
        let q = norm_rope(&self.to_q, &self.norm_q)?;
        let k = norm_rope(&self.to_k, &self.norm_k)?;
        Ok((q, k, v))
    }
}

/// A dual-stream block's attention step (HunyuanVideo's, FLUX.1's): `attend` (the module
/// `attn`: both streams' outputs after their projections) through `hooks`, then each stream's
/// gated residual (gates at 2 of `m` and `c`).
pub(crate) fn gated_joint_attention(
    hooks: &mut dyn BlockHooks,
    (video, text): (&Tensor, &Tensor),
    (m, c): (&[Tensor], &[Tensor]),
    mut attend: impl FnMut() -> Result<(Tensor, Tensor)>,
) -> Result<(Tensor, Tensor)> {
    let (attn_video, attn_text) = joint_output(
        hooks,
        Submodule::SelfAttention,
        video.dims(),
        Some(text.dims()),
        || attend().map(|(v, t)| (v, Some(t))),
    )?;
    let attn_text = carried(attn_text, "the joint attention's text output")?;
    Ok((
        gated(video, attn_video, &m[2])?,
        gated(text, attn_text, &c[2])?,
    ))
}

/// The joint attention of a dual-stream block: q/k/v of each stream and both output
/// projections.
#[derive(Debug, Clone)]
struct JointAttention {
    video_qkv: QkvProjection,
    text_qkv: QkvProjection,
    to_out: Projection,
    to_add_out: Projection,
}

impl JointAttention {
    /// Modulated norms of both streams (`m`, `c`: shift, scale at 0, 1), joint attention over
    /// [video; text], the output projections and the gated residuals (gates at 2).
    fn forward(
        &self,
        hidden: &Tensor,
        encoder: &Tensor,
        m: &[Tensor],
        c: &[Tensor],
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<(Tensor, Tensor)> {
        gated_joint_attention(hooks, (hidden, encoder), (m, c), || {
            self.attend(hidden, encoder, m, c, inputs)
        })
    }

    /// `attn` itself: the modulated norms, the joint attention and its output projections.
    fn attend(
        &self,
        hidden: &Tensor,
        encoder: &Tensor,
        m: &[Tensor],
        c: &[Tensor],
        inputs: &BlockInputs,
    ) -> Result<(Tensor, Tensor)> {
        let n_video = hidden.dim(1)?;
        let norm_hidden = norm_modulate(hidden, &m[0], &m[1])?;
        let norm_encoder = norm_modulate(encoder, &c[0], &c[1])?;
        // q, k and v are dropped once attended.
        let out = {
            let rope = (&inputs.rope_cos, &inputs.rope_sin);
            let (q, k, v) = self.video_qkv.forward(&norm_hidden, Some(rope))?;
            let (eq, ek, ev) = self.text_qkv.forward(&norm_encoder, None)?;
            let cat = |a: Tensor, b: Tensor| Tensor::cat(&[a, b], 2);
            let kv_lens: Vec<usize> = inputs.text_lens.iter().map(|l| n_video + l).collect();
            let out = attention_key_prefix(&cat(q, eq)?, &cat(k, ek)?, &cat(v, ev)?, &kv_lens)?;
            merge_heads(&out)?
        };
        let total = out.dim(1)?;
        let project = |linear: &Projection, x: Tensor| linear.apply(&Input::new(&x), false);
        let attn_video = project(&self.to_out, out.narrow(1, 0, n_video)?)?;
        let attn_text = project(&self.to_add_out, out.narrow(1, n_video, total - n_video)?)?;
        Ok((attn_video, attn_text))
    }
}

/// One dual-stream block (diffusers `HunyuanVideoTransformerBlock`), or some of its steps
/// (see [`BlockStep`]).
#[derive(Debug, Clone)]
pub struct HunyuanVideoTransformerBlock {
    norm1: Option<Modulation>,
    norm1_context: Option<Modulation>,
    attn: Option<JointAttention>,
    ff: Option<Mlp>,
    ff_context: Option<Mlp>,
}

impl HunyuanVideoTransformerBlock {
    /// Loads only the weights of `steps`; `vb` points at `transformer_blocks.{i}`.
    pub fn with_steps(
        cfg: &HunyuanVideoTransformerConfig,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let has = |s| steps.contains(&s);
        let attn = vb.pp("attn");
        let fp8 = cfg.fp8_matmul;
        let ff =
            |name: &str| Mlp::feed_forward((dim, cfg.mlp_dim()), Act::GeluTanh, vb.pp(name), fp8);
        Ok(Self {
            norm1: has(BlockStep::VideoModulation)
                .then(|| Modulation::new(dim, 6, vb.pp("norm1")))
                .transpose()?,
            norm1_context: has(BlockStep::TextModulation)
                .then(|| Modulation::new(dim, 6, vb.pp("norm1_context")))
                .transpose()?,
            attn: has(BlockStep::JointAttention)
                .then(|| -> Result<_> {
                    let (video_qkv, text_qkv) = QkvProjection::joint(
                        (cfg.num_attention_heads, cfg.attention_head_dim),
                        &attn,
                        fp8,
                    )?;
                    Ok(JointAttention {
                        video_qkv,
                        text_qkv,
                        to_out: Projection::load((dim, dim), attn.pp("to_out.0"), fp8)?,
                        to_add_out: Projection::load((dim, dim), attn.pp("to_add_out"), fp8)?,
                    })
                })
                .transpose()?,
            ff: has(BlockStep::VideoFeedForward)
                .then(|| ff("ff"))
                .transpose()?,
            ff_context: has(BlockStep::TextFeedForward)
                .then(|| ff("ff_context"))
                .transpose()?,
        })
    }

    /// Runs the block's steps on the streams, with the modulations computed `apart` where its
    /// modulation steps are not among them; returns the streams with what later steps need.
    fn forward(
        &self,
        streams: &Streams,
        inputs: &BlockInputs,
        apart: Option<&[Tensor]>,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Streams> {
        let (mut m, mut c) = match &streams.carry {
            Carry::None => (None, None),
            Carry::DualStream { video, text } => (video.clone(), text.clone()),
            other => candle_core::bail!("a dual-stream block step after {}", other.after()),
        };
        // Chunks: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp.
        if let Some(norm1) = &self.norm1 {
            m = Some(norm1.forward(inputs.temb()?)?);
        }
        if let Some(norm1_context) = &self.norm1_context {
            c = Some(norm1_context.forward(inputs.temb()?)?);
        }
        // Computed apart: the video stream's six chunks, then the text stream's.
        if let Some(apart) = apart {
            m = m.or_else(|| apart.get(..6).map(<[Tensor]>::to_vec));
            c = c.or_else(|| apart.get(6..).map(<[Tensor]>::to_vec));
        }
        let (mut hidden, mut encoder) = (streams.video.clone(), streams.text.clone());
        if let Some(attn) = &self.attn {
            let (mv, mc) = (
                carried(m.as_ref(), "video modulation")?,
                carried(c.as_ref(), "text modulation")?,
            );
            (hidden, encoder) = attn.forward(&hidden, &encoder, mv, mc, inputs, hooks)?;
        }
        // A stream's feed-forward and gated residual, by token chunks; a feed-forward a step
        // cache hooks (`module`) gives its whole output, which the cache keeps or stands in for.
        let mut feed_forward = |(ff, module): (&Mlp, Submodule), x: &Tensor, m: &[Tensor]| {
            let ff_out = |rows: &Tensor| ff.forward(&norm_modulate(rows, &m[3], &m[4])?);
            if hooks.wants(module) {
                let out =
                    hooks.output(module, &mut || by_token_chunks(x, |_, rows| ff_out(rows)))?;
                return gated(x, out, &m[5]);
            }
            by_token_chunks(x, |_, rows| gated(rows, ff_out(rows)?, &m[5]))
        };
        if let Some(ff) = &self.ff {
            let m = carried(m.as_ref(), "video modulation")?;
            hidden = feed_forward((ff, Submodule::FeedForward), &hidden, m)?;
        }
        if let Some(ff_context) = &self.ff_context {
            let c = carried(c.as_ref(), "text modulation")?;
            encoder = feed_forward((ff_context, Submodule::ContextFeedForward), &encoder, c)?;
        }
        // The text feed-forward is the block's last step.
        let carry = match self.ff_context {
            Some(_) => Carry::None,
            None => Carry::DualStream { video: m, text: c },
        };
        Ok(Streams {
            video: hidden,
            text: encoder,
            carry,
        })
    }
}

/// One single-stream block (diffusers `HunyuanVideoSingleTransformerBlock`): attention and MLP
/// in parallel over the joint [video; text] sequence, one output projection; or some of its
/// steps (see [`BlockStep`]).
#[derive(Debug, Clone)]
pub struct HunyuanVideoSingleTransformerBlock {
    /// `norm`: shift, scale, gate.
    norm: Option<Modulation>,
    /// The attention's q/k/v.
    attn: Option<QkvProjection>,
    /// `proj_mlp` and `proj_out`.
    mlp: Option<(Projection, Projection)>,
}

impl HunyuanVideoSingleTransformerBlock {
    /// Loads only the weights of `steps`; `vb` points at `single_transformer_blocks.{i}`.
    pub fn with_steps(
        cfg: &HunyuanVideoTransformerConfig,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let mlp = cfg.mlp_dim();
        Ok(Self {
            norm: steps
                .contains(&BlockStep::SingleModulation)
                .then(|| Modulation::new(dim, 3, vb.pp("norm")))
                .transpose()?,
            attn: steps
                .contains(&BlockStep::SingleAttention)
                .then(|| {
                    QkvProjection::new(
                        (cfg.num_attention_heads, cfg.attention_head_dim),
                        &vb.pp("attn"),
                        ["to_q", "to_k", "to_v", "norm_q", "norm_k"],
                        cfg.fp8_matmul,
                    )
                })
                .transpose()?,
            mlp: steps
                .contains(&BlockStep::SingleMlp)
                .then(|| -> Result<_> {
                    let fp8 = cfg.fp8_matmul;
                    Ok((
                        Projection::load((dim, mlp), vb.pp("proj_mlp"), fp8)?,
                        Projection::load((dim + mlp, dim), vb.pp("proj_out"), fp8)?,
                    ))
                })
                .transpose()?,
        })
    }

    /// Runs the block's steps on the streams, with the modulation computed `apart` where its
    /// modulation step is not among them; returns the streams with what later steps need.
    fn forward(
        &self,
        streams: &Streams,
        inputs: &BlockInputs,
        apart: Option<&[Tensor]>,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Streams> {
        let (mut m, mut carry) = match &streams.carry {
            Carry::None => (None, None),
            Carry::SingleModulation { m } => (Some(m.clone()), None),
            Carry::SingleStream { normed, attn, gate } => {
                (None, Some((normed.clone(), attn.clone(), gate.clone())))
            }
            other => candle_core::bail!("a single-stream block step after {}", other.after()),
        };
        // Chunks: shift, scale, gate.
        if let Some(norm) = &self.norm {
            m = Some(norm.forward(inputs.temb()?)?);
        }
        let n_video = streams.video.dim(1)?;
        if let Some(qkv) = &self.attn {
            let m = carried(
                m.take().or_else(|| apart.map(<[Tensor]>::to_vec)),
                "modulation",
            )?;
            // The joined sequence lives only to be normed: the residual reads the streams.
            let joint = Tensor::cat(&[&streams.video, &streams.text], 1)?;
            let normed = norm_modulate(&joint, &m[0], &m[1])?;
            drop(joint);
            // `attn`'s output (its video and text parts joined, as the block joins them) goes
            // through `hooks`; q, k and v go before the heads are merged.
            let attn = hooks.output(Submodule::SelfAttention, &mut || {
                let rope = (&inputs.rope_cos, &inputs.rope_sin);
                let (q, k, v) = qkv.forward(&normed, Some(rope))?;
                let kv_lens: Vec<usize> = inputs.text_lens.iter().map(|l| n_video + l).collect();
                let out = attention_key_prefix(&q, &k, &v, &kv_lens)?;
                drop((q, k, v));
                merge_heads(&out)
            })?;
            carry = Some((normed, attn, m[2].clone()));
        }
        let Some((proj_mlp, proj_out)) = &self.mlp else {
            let carry = match (carry, m) {
                (Some((normed, attn, gate)), _) => Carry::SingleStream { normed, attn, gate },
                (None, m) => Carry::SingleModulation {
                    m: carried(m, "modulation")?,
                },
            };
            return Ok(Streams {
                video: streams.video.clone(),
                text: streams.text.clone(),
                carry,
            });
        };
        let (normed, attn, gate) = carried(carry, "attention")?;
        // MLP in parallel with the attention, one output projection over both and the gated
        // residual, by token chunks.
        let x = by_token_chunks(&normed, |start, normed| {
            let len = normed.dim(1)?;
            let mlp = proj_mlp.apply(&Input::new(normed), true)?;
            let both = Tensor::cat(&[attn.narrow(1, start, len)?, mlp], 2)?;
            let out = proj_out.apply(&Input::new(&both), false)?;
            drop(both);
            gated(&joint_rows(streams, start, len)?, out, &gate)
        })?;
        let total = x.dim(1)?;
        Ok(Streams::new(
            x.narrow(1, 0, n_video)?.contiguous()?,
            x.narrow(1, n_video, total - n_video)?.contiguous()?,
        ))
    }
}

/// A block of any kind, in execution order (what an engine streams).
#[derive(Debug, Clone)]
pub struct HunyuanVideoBlock {
    /// Its place in execution order: which modulations computed apart are its.
    index: usize,
    part: BlockPart,
}

#[derive(Debug, Clone)]
enum BlockPart {
    Refiner(RefinerBlock),
    DualStream(Box<HunyuanVideoTransformerBlock>),
    SingleStream(HunyuanVideoSingleTransformerBlock),
}

impl HunyuanVideoBlock {
    /// Loads block `index` (execution order: refiner, dual-stream, single-stream blocks): all
    /// its steps, or with [`HunyuanVideoTransformerConfig::modulations_apart`] its body's;
    /// `vb` is the model root.
    pub fn new(cfg: &HunyuanVideoTransformerConfig, index: usize, vb: VarBuilder) -> Result<Self> {
        Self::with_steps(cfg, index, vb, cfg.steps_of(cfg.block_kind(index)?.0))
    }

    /// Loads only the weights of `steps` of block `index` (steps of its kind; see
    /// [`BlockKind::steps`]); `vb` is the model root.
    pub fn with_steps(
        cfg: &HunyuanVideoTransformerConfig,
        index: usize,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self> {
        let kind = cfg.block_kind(index)?.0;
        if let Some(step) = steps.iter().find(|s| !kind.steps().contains(s)) {
            candle_core::bail!("{step:?} is not a step of a {kind:?} block");
        }
        let block_vb = vb.pp(cfg.block_prefix(index)?);
        let part = match kind {
            BlockKind::Refiner => {
                BlockPart::Refiner(RefinerBlock::with_steps(cfg, block_vb, steps)?)
            }
            BlockKind::DualStream => BlockPart::DualStream(Box::new(
                HunyuanVideoTransformerBlock::with_steps(cfg, block_vb, steps)?,
            )),
            BlockKind::SingleStream => BlockPart::SingleStream(
                HunyuanVideoSingleTransformerBlock::with_steps(cfg, block_vb, steps)?,
            ),
        };
        Ok(Self { index, part })
    }

    /// The block's kind.
    pub fn kind(&self) -> BlockKind {
        match self.part {
            BlockPart::Refiner(_) => BlockKind::Refiner,
            BlockPart::DualStream(_) => BlockKind::DualStream,
            BlockPart::SingleStream(_) => BlockKind::SingleStream,
        }
    }

    /// Runs the block (or its steps) on the streams: the refiner on the text alone, the
    /// others on both.
    pub fn forward(&self, streams: &Streams, inputs: &BlockInputs) -> Result<Streams> {
        self.forward_hooked(streams, inputs, &mut ComputeAll)
    }

    /// The block's modulation chunks for conditionings `temb` and `refiner_temb` (the refiner
    /// reads the latter), what [`BlockInputs::modulations`] hands a block built without its
    /// modulation steps; needs a block built with them.
    pub fn modulation(&self, temb: &Tensor, refiner_temb: &Tensor) -> Result<Vec<Tensor>> {
        let missing = || {
            candle_core::Error::Msg(format!(
                "block {} was built without its modulation steps",
                self.index
            ))
        };
        match &self.part {
            BlockPart::Refiner(b) => b
                .norm_out
                .as_ref()
                .ok_or_else(missing)?
                .forward(refiner_temb),
            BlockPart::DualStream(b) => {
                let video = b.norm1.as_ref().ok_or_else(missing)?.forward(temb)?;
                let text = b
                    .norm1_context
                    .as_ref()
                    .ok_or_else(missing)?
                    .forward(temb)?;
                Ok([video, text].concat())
            }
            BlockPart::SingleStream(b) => b.norm.as_ref().ok_or_else(missing)?.forward(temb),
        }
    }
}

/// Every block's modulation Linears alone: what a model built with
/// [`HunyuanVideoTransformerConfig::modulations_apart`] leaves out of its blocks. They depend on
/// a step's conditioning only, so one pass over them before denoising computes every step's
/// modulations ([`BlockInputs::modulations`]), and the blocks streamed at every step carry 27%
/// fewer bytes at the published size.
#[derive(Debug, Clone)]
pub struct HunyuanModulations {
    conditioner: Conditioner,
    /// The output head's AdaLayerNormContinuous Linear (scale, shift).
    norm_out: Modulation,
    blocks: Vec<HunyuanVideoBlock>,
}

impl HunyuanModulations {
    /// Loads the conditioning embedders and every block's modulation steps; `vb` is the
    /// transformer's root.
    pub fn new(cfg: &HunyuanVideoTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads the conditioning embedders and the output head's modulation only (an engine
    /// streams the blocks itself).
    pub fn new_without_blocks(cfg: &HunyuanVideoTransformerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            conditioner: Conditioner::new(cfg, &vb)?,
            norm_out: Modulation::new(cfg.inner_dim(), 2, vb.pp("norm_out"))?,
            blocks: Vec::new(),
        })
    }

    /// The output head's modulation (scale, shift) for conditioning `temb`: the table's entry
    /// after the blocks' ([`BlockInputs::modulations`]).
    pub fn output(&self, temb: &Tensor) -> Result<Vec<Tensor>> {
        self.norm_out.forward(temb)
    }

    /// The conditionings the blocks' modulations are computed from, `temb` and the token
    /// refiner's, each `[B, inner]`, exactly as the transformer computes them (arguments as
    /// [`HunyuanVideoTransformer3DModel::prepare`]'s, the text in the model dtype).
    pub fn conditioning(
        &self,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
        encoder_attention_mask: &Tensor,
        pooled_projections: &Tensor,
        guidance: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        self.conditioner.forward(
            timestep,
            encoder_hidden_states,
            encoder_attention_mask,
            pooled_projections,
            guidance,
        )
    }

    /// Block `index`'s modulation steps; `vb` is the transformer's root.
    pub fn block(
        cfg: &HunyuanVideoTransformerConfig,
        index: usize,
        vb: VarBuilder,
    ) -> Result<HunyuanVideoBlock> {
        let kind = cfg.block_kind(index)?.0;
        HunyuanVideoBlock::with_steps(cfg, index, vb, kind.modulation_steps())
    }

    /// The loaded blocks (empty after `new_without_blocks`).
    pub fn blocks(&self) -> &[HunyuanVideoBlock] {
        &self.blocks
    }
}

/// The self-attention of a refiner block with its norm.
#[derive(Debug, Clone)]
struct RefinerAttention {
    norm1: AffineLayerNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    heads: usize,
}

impl RefinerAttention {
    /// `x` `[B, L, inner]` -> `to_out` of the attention over the valid text.
    fn forward(&self, x: &Tensor, valid: &[Vec<bool>]) -> Result<Tensor> {
        let h = self.norm1.forward(x)?;
        let q = split_heads(&project(&self.to_q, &h)?, self.heads)?;
        let k = split_heads(&project(&self.to_k, &h)?, self.heads)?;
        let v = split_heads(&project(&self.to_v, &h)?, self.heads)?;
        let scale = 1.0 / (q.dim(3)? as f64).sqrt();
        let outs = valid
            .iter()
            .enumerate()
            .map(|(b, valid)| {
                let (q, k, v) = (q.narrow(0, b, 1)?, k.narrow(0, b, 1)?, v.narrow(0, b, 1)?);
                // Valid queries see the valid keys and key 0; padded queries only key 0.
                let keys: Vec<u32> = (0..valid.len())
                    .filter(|&j| j == 0 || valid[j])
                    .map(|j| j as u32)
                    .collect();
                let keys = Tensor::new(keys.as_slice(), x.device())?;
                let out = sdpa(
                    &q,
                    &k.index_select(&keys, 2)?,
                    &v.index_select(&keys, 2)?,
                    scale,
                )?;
                let rows: Vec<u8> = valid.iter().map(|&m| u8::from(m)).collect();
                let rows =
                    Tensor::new(rows.as_slice(), x.device())?.reshape((1, 1, valid.len(), 1))?;
                rows.broadcast_as(out.shape())?
                    .where_cond(&out, &v.narrow(2, 0, 1)?.broadcast_as(out.shape())?)
            })
            .collect::<Result<Vec<_>>>()?;
        project(&self.to_out, &merge_heads(&Tensor::cat(&outs, 0)?)?)
    }
}

/// One block of the token refiner (diffusers `HunyuanVideoIndividualTokenRefinerBlock`), or
/// some of its steps (see [`BlockStep`]); it runs on the text stream alone.
#[derive(Debug, Clone)]
pub struct RefinerBlock {
    /// `norm_out`: gate_msa, gate_mlp.
    norm_out: Option<Modulation>,
    attn: Option<RefinerAttention>,
    /// `norm2` and the feed-forward.
    ff: Option<(AffineLayerNorm, Mlp)>,
}

impl RefinerBlock {
    /// Loads only the weights of `steps`; `vb` points at
    /// `context_embedder.token_refiner.refiner_blocks.{i}`.
    fn with_steps(
        cfg: &HunyuanVideoTransformerConfig,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let attn = vb.pp("attn");
        Ok(Self {
            norm_out: steps
                .contains(&BlockStep::RefinerModulation)
                .then(|| Modulation::new(dim, 2, vb.pp("norm_out")))
                .transpose()?,
            attn: steps
                .contains(&BlockStep::RefinerAttention)
                .then(|| -> Result<_> {
                    Ok(RefinerAttention {
                        norm1: AffineLayerNorm::new(dim, vb.pp("norm1"))?,
                        to_q: candle_nn::linear(dim, dim, attn.pp("to_q"))?,
                        to_k: candle_nn::linear(dim, dim, attn.pp("to_k"))?,
                        to_v: candle_nn::linear(dim, dim, attn.pp("to_v"))?,
                        to_out: candle_nn::linear(dim, dim, attn.pp("to_out.0"))?,
                        heads: cfg.num_attention_heads,
                    })
                })
                .transpose()?,
            ff: steps
                .contains(&BlockStep::RefinerFeedForward)
                .then(|| -> Result<_> {
                    Ok((
                        AffineLayerNorm::new(dim, vb.pp("norm2"))?,
                        Mlp::feed_forward(
                            (dim, cfg.refiner_mlp_dim()),
                            Act::Silu,
                            vb.pp("ff"),
                            false,
                        )?,
                    ))
                })
                .transpose()?,
        })
    }

    /// Runs the block's steps on the text stream (`inputs.text_valid` masks it), with the
    /// gates computed `apart` where its modulation step is not among them; the video stream
    /// passes.
    fn forward(
        &self,
        streams: &Streams,
        inputs: &BlockInputs,
        apart: Option<&[Tensor]>,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Streams> {
        let mut gates = match &streams.carry {
            Carry::None => None,
            Carry::Refiner { gates } => Some(gates.clone()),
            other => candle_core::bail!("a refiner block step after {}", other.after()),
        };
        if let Some(norm_out) = &self.norm_out {
            gates = Some(norm_out.forward(inputs.refiner_temb()?)?);
        }
        let gates = carried(gates.or_else(|| apart.map(<[Tensor]>::to_vec)), "gates")?;
        let mut x = streams.text.clone();
        if let Some(attn) = &self.attn {
            let out = hooks.output(Submodule::SelfAttention, &mut || {
                attn.forward(&x, &inputs.text_valid)
            })?;
            x = gated(&x, out, &gates[0])?;
        }
        let carry = match &self.ff {
            Some((norm2, ff)) => {
                x = gated(&x, ff.forward(&norm2.forward(&x)?)?, &gates[1])?;
                Carry::None
            }
            None => Carry::Refiner { gates },
        };
        Ok(Streams {
            video: streams.video.clone(),
            text: x,
            carry,
        })
    }
}

/// The embedders of the blocks' conditionings: the timestep, guidance and pooled-CLIP
/// embedders (`time_text_embed`) and the token refiner's timestep and mean-text embedders
/// (`context_embedder.time_text_embed`). The transformer holds them, and so does
/// [`HunyuanModulations`], which computes every step's modulations before the transformer
/// runs.
#[derive(Debug, Clone)]
struct Conditioner {
    timestep_embedder: Mlp,
    guidance_embedder: Option<Mlp>,
    text_embedder: Mlp,
    refiner_timestep_embedder: Mlp,
    refiner_text_embedder: Mlp,
    dtype: DType,
}

impl Conditioner {
    /// `vb` is the transformer's root.
    fn new(cfg: &HunyuanVideoTransformerConfig, vb: &VarBuilder) -> Result<Self> {
        let dim = cfg.inner_dim();
        let tvb = vb.pp("time_text_embed");
        let rvb = vb.pp("context_embedder.time_text_embed");
        Ok(Self {
            timestep_embedder: Mlp::embedder(TIMESTEP_CHANNELS, dim, tvb.pp("timestep_embedder"))?,
            guidance_embedder: cfg
                .guidance_embeds
                .then(|| Mlp::embedder(TIMESTEP_CHANNELS, dim, tvb.pp("guidance_embedder")))
                .transpose()?,
            text_embedder: Mlp::embedder(cfg.pooled_projection_dim, dim, tvb.pp("text_embedder"))?,
            refiner_timestep_embedder: Mlp::embedder(
                TIMESTEP_CHANNELS,
                dim,
                rvb.pp("timestep_embedder"),
            )?,
            refiner_text_embedder: Mlp::embedder(cfg.text_embed_dim, dim, rvb.pp("text_embedder"))?,
            dtype: vb.dtype(),
        })
    }

    /// `temb` (timestep + guidance + pooled CLIP) and the token refiner's conditioning
    /// (timestep + mask-weighted mean text), each `[B, inner]`, for `timestep` and
    /// `guidance` (`[B]` or one value), the Llama text `[B, L, text_dim]` in the model dtype,
    /// its mask `[B, L]` and the pooled CLIP `[B, pooled_dim]`.
    fn forward(
        &self,
        timestep: &Tensor,
        text: &Tensor,
        mask: &Tensor,
        pooled: &Tensor,
        guidance: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let b = pooled.dim(0)?;
        let device = pooled.device();
        let per_batch = |t: &Tensor, what: &str| -> Result<Tensor> {
            match t.elem_count() {
                1 if b > 1 => t.flatten_all()?.repeat(b),
                n if n == b => t.flatten_all(),
                n => candle_core::bail!("{what} has {n} values for a batch of {b}"),
            }
        };
        let t_proj = timestep_embedding(&per_batch(timestep, "timestep")?, TIMESTEP_CHANNELS)?
            .to_device(device)?;
        let mut temb = (self
            .timestep_embedder
            .forward(&t_proj.to_dtype(self.dtype)?)?
            + self.text_embedder.forward(&pooled.to_dtype(self.dtype)?)?)?;
        if let Some(embedder) = &self.guidance_embedder {
            let Some(guidance) = guidance else {
                candle_core::bail!("this transformer embeds guidance: pass the guidance (x1000)");
            };
            let g_proj = timestep_embedding(&per_batch(guidance, "guidance")?, TIMESTEP_CHANNELS)?
                .to_device(device)?;
            temb = (temb + embedder.forward(&g_proj.to_dtype(self.dtype)?)?)?;
        }
        // The refiner's: the mask-weighted mean of the raw text embeddings, in f32.
        let m = mask.to_device(device)?.to_dtype(DType::F32)?.unsqueeze(2)?;
        let mean = text
            .to_dtype(DType::F32)?
            .broadcast_mul(&m)?
            .sum(1)?
            .broadcast_div(&m.sum(1)?)?
            .to_dtype(text.dtype())?;
        let refiner_temb = (self
            .refiner_timestep_embedder
            .forward(&t_proj.to_dtype(text.dtype())?)?
            + self.refiner_text_embedder.forward(&mean)?)?;
        Ok((temb, refiner_temb))
    }
}

/// Per-axis RoPE table `[len, dim / 2]` (cos, sin) of integer positions, with diffusers'
/// `get_1d_rotary_pos_embed(use_real=True)` f32 arithmetic (frequencies and angles in f32).
fn rope_axis(dim: usize, len: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let half = dim / 2;
    let theta = theta as f32;
    let freqs: Vec<f32> = (0..half)
        .map(|j| 1.0 / theta.powf((2 * j) as f32 / dim as f32))
        .collect();
    let mut cos = Vec::with_capacity(len * half);
    let mut sin = Vec::with_capacity(len * half);
    for p in 0..len {
        for &f in &freqs {
            let angle = p as f32 * f;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    (cos, sin)
}

/// RoPE tables `[F·H·W, head_dim / 2]` for a token grid, the [t | h | w] parts concatenated.
pub fn rope_tables(
    cfg: &HunyuanVideoTransformerConfig,
    grid: [usize; 3],
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let axes: Vec<(Vec<f32>, Vec<f32>)> = (0..3)
        .map(|a| rope_axis(cfg.rope_axes_dim[a], grid[a], cfg.rope_theta))
        .collect();
    let half = cfg.attention_head_dim / 2;
    let seq = grid.iter().product::<usize>();
    let mut cos = Vec::with_capacity(seq * half);
    let mut sin = Vec::with_capacity(seq * half);
    for f in 0..grid[0] {
        for h in 0..grid[1] {
            for w in 0..grid[2] {
                for (a, pos) in [f, h, w].into_iter().enumerate() {
                    let n = cfg.rope_axes_dim[a] / 2;
                    cos.extend_from_slice(&axes[a].0[pos * n..(pos + 1) * n]);
                    sin.extend_from_slice(&axes[a].1[pos * n..(pos + 1) * n]);
                }
            }
        }
    }
    Ok((
        Tensor::from_vec(cos, (seq, half), device)?,
        Tensor::from_vec(sin, (seq, half), device)?,
    ))
}

/// The diffusers `HunyuanVideoTransformer3DModel` for text-to-video.
#[derive(Debug, Clone)]
pub struct HunyuanVideoTransformer3DModel {
    cfg: HunyuanVideoTransformerConfig,
    /// Conv3d with kernel = stride = patch, stored as a linear over flattened patches.
    x_embedder: Linear,
    /// The conditioning embedders and the output head's modulation, absent with
    /// [`HunyuanVideoTransformerConfig::modulations_apart`] ([`HunyuanModulations`] holds them).
    conditioner: Option<Conditioner>,
    /// The token refiner's input projection (`context_embedder.proj_in`).
    text_proj_in: Linear,
    blocks: Vec<HunyuanVideoBlock>,
    /// AdaLayerNormContinuous: scale, shift.
    norm_out: Option<Modulation>,
    proj_out: Linear,
    dtype: DType,
}

impl HunyuanVideoTransformer3DModel {
    /// Loads the whole model, blocks included.
    pub fn new(cfg: &HunyuanVideoTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads everything except the blocks (for an engine that streams blocks itself);
    /// `blocks()` is then empty and `forward` refuses to run.
    pub fn new_without_blocks(cfg: &HunyuanVideoTransformerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let (pt, p) = (cfg.patch_size_t, cfg.patch_size);
        let xvb = vb.pp("x_embedder.proj");
        let patch_w = xvb
            .get((dim, cfg.in_channels, pt, p, p), "weight")?
            .reshape((dim, cfg.in_channels * pt * p * p))?;
        let x_embedder = Linear::new(patch_w, Some(xvb.get(dim, "bias")?));
        let conditioned = !cfg.modulations_apart;
        Ok(Self {
            cfg: cfg.clone(),
            x_embedder,
            conditioner: conditioned
                .then(|| Conditioner::new(cfg, &vb))
                .transpose()?,
            text_proj_in: candle_nn::linear(
                cfg.text_embed_dim,
                dim,
                vb.pp("context_embedder.proj_in"),
            )?,
            blocks: Vec::new(),
            norm_out: conditioned
                .then(|| Modulation::new(dim, 2, vb.pp("norm_out")))
                .transpose()?,
            proj_out: candle_nn::linear(dim, pt * p * p * cfg.out_channels(), vb.pp("proj_out"))?,
            dtype: vb.dtype(),
        })
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &HunyuanVideoTransformerConfig {
        &self.cfg
    }

    /// The loaded blocks, refiner, dual-stream then single-stream (empty after
    /// `new_without_blocks`).
    pub fn blocks(&self) -> &[HunyuanVideoBlock] {
        &self.blocks
    }

    /// Embeddings and tables for `latents` `[B, C, F, H, W]`, `timestep` `[B]` (or one value),
    /// `encoder_hidden_states` `[B, L, text_dim]` (Llama), `encoder_attention_mask` `[B, L]`
    /// (1 real, 0 padding; any dtype), `pooled_projections` `[B, pooled_dim]` (CLIP) and
    /// `guidance` `[B]` (or one value; already x1000, required when `guidance_embeds`).
    pub fn prepare(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
        encoder_attention_mask: &Tensor,
        pooled_projections: &Tensor,
        guidance: Option<&Tensor>,
    ) -> Result<BlockInputs> {
        let cfg = &self.cfg;
        let (pt, p) = (cfg.patch_size_t, cfg.patch_size);
        let (b, grid) = token_grid(latents, cfg.in_channels, [pt, p, p])?;
        let len = text_len(
            encoder_hidden_states,
            b,
            ("text_embed_dim", cfg.text_embed_dim),
        )?;
        if encoder_attention_mask.dims() != [b, len] {
            candle_core::bail!(
                "encoder_attention_mask {:?} does not match the text [{b}, {len}]",
                encoder_attention_mask.dims()
            );
        }
        if pooled_projections.dims() != [b, cfg.pooled_projection_dim] {
            candle_core::bail!(
                "pooled_projections {:?} do not match [{b}, {}]",
                pooled_projections.dims(),
                cfg.pooled_projection_dim
            );
        }
        let device = latents.device();

        // Patch embedding: Conv3d with kernel = stride = patch, as a matmul over patches.
        let patches = whole_patches(&latents.to_dtype(self.dtype)?, [pt, p, p])?;
        let hidden_states = self.x_embedder.forward(&patches)?;

        // Text: the token refiner's conditioning and input; its blocks run with the others.
        let mask_rows = encoder_attention_mask
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec2::<f32>()?;
        let valid: Vec<Vec<bool>> = mask_rows
            .iter()
            .map(|r| r.iter().map(|&m| m != 0.0).collect())
            .collect();
        let text_lens: Vec<usize> = mask_rows
            .iter()
            .map(|r| r.iter().sum::<f32>() as usize)
            .collect();
        if text_lens.iter().any(|&l| l > len) {
            candle_core::bail!("encoder_attention_mask holds values other than 0 and 1");
        }
        let text = encoder_hidden_states.to_dtype(self.dtype)?;
        let (temb, refiner_temb) = match &self.conditioner {
            Some(conditioner) => {
                let (temb, refiner_temb) = conditioner.forward(
                    timestep,
                    &text,
                    encoder_attention_mask,
                    pooled_projections,
                    guidance,
                )?;
                (Some(temb), Some(refiner_temb))
            }
            None => (None, None),
        };
        let text = self.text_proj_in.forward(&text)?;

        let (rope_cos, rope_sin) = rope_tables(cfg, grid, device)?;
        Ok(BlockInputs {
            streams: Some(Streams::new(hidden_states, text)),
            temb,
            refiner_temb,
            rope_cos,
            rope_sin,
            text_lens,
            text_valid: valid,
            batch: b,
            grid,
            modulations: None,
        })
    }

    /// Output norm (AdaLayerNormContinuous, scale then shift), `proj_out` and unpatchify:
    /// video tokens `[B, N, inner]` -> `[B, out_channels, F, H, W]`.
    pub fn finish(&self, hidden: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        self.finish_projecting(hidden, inputs, &mut |compute| compute())
    }

    /// [`Self::finish`], the output projection's output through `project` (a step cache's,
    /// which may stand in for it).
    pub fn finish_projecting(
        &self,
        hidden: &Tensor,
        inputs: &BlockInputs,
        project: &mut Through,
    ) -> Result<Tensor> {
        let m = match &self.norm_out {
            Some(norm_out) => norm_out.forward(inputs.temb()?)?,
            None => match inputs.modulation(self.cfg.num_blocks()) {
                Some(m) => m.to_vec(),
                None => candle_core::bail!(
                    "the output head's modulation was computed apart: pass it after the blocks'"
                ),
            },
        };
        // The blocks' fused norm (on CUDA): the composite's f32 temporaries over the video tokens
        // were the forward's peak, 1.35 GiB above the blocks' at 720x1280x129 (bench/RESULTS.md
        // session 49).
        let h = norm_modulate(hidden, &m[1], &m[0])?;
        let h = project(&mut || self.proj_out.forward(&h))?;
        let (pt, p) = (self.cfg.patch_size_t, self.cfg.patch_size);
        unpatchify(&h, inputs.grid, [pt, p, p])
    }

    /// Full forward: `prepare`, every block, `finish`. Needs a model built with `new`.
    pub fn forward(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
        encoder_attention_mask: &Tensor,
        pooled_projections: &Tensor,
        guidance: Option<&Tensor>,
    ) -> Result<Tensor> {
        let inputs = self.prepare(
            latents,
            timestep,
            encoder_hidden_states,
            encoder_attention_mask,
            pooled_projections,
            guidance,
        )?;
        crate::models::blocks::BlockForward::forward_resident(self, inputs)
    }
}

/// The modules diffusers' layerwise casting leaves alone in `HunyuanVideoTransformer3DModel` (its
/// `_skip_layerwise_casting_patterns`); its modulations are read from the same weights.
const LAYERWISE_CASTING_SKIP: &[&str] = &["x_embedder", "context_embedder", "norm"];

// Placed by the block protocol: refiner blocks, dual-stream blocks, then single-stream ones,
// each kind with its own steps.
crate::kinded_blocks!(
    HunyuanVideoTransformer3DModel, HunyuanVideoTransformerConfig, HunyuanVideoBlock, BlockKind,
    skip: LAYERWISE_CASTING_SKIP, steps: |cfg, kind| cfg.steps_of(kind)
);

/// The modulation Linears of every block, streamed (or placed) as a DiT of their own: one pass
/// before denoising computes every step's modulations.
impl Blockwise for HunyuanModulations {
    const LAYERWISE_CASTING_SKIP: &'static [&'static str] = LAYERWISE_CASTING_SKIP;
    type Config = HunyuanVideoTransformerConfig;
    type Block = HunyuanVideoBlock;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        Self::new(cfg, vb)
    }
    fn outer(cfg: &Self::Config, vb: VarBuilder, _: VarBuilder) -> Result<Self> {
        Self::new_without_blocks(cfg, vb)
    }
    fn num_blocks(cfg: &Self::Config) -> usize {
        cfg.num_blocks()
    }
    fn block_kind(cfg: &Self::Config, i: usize) -> usize {
        cfg.block_kind(i)
            .map_or(usize::MAX, |(kind, _)| kind as usize)
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> Result<Self::Block> {
        Self::block(cfg, i, vb)
    }
}

crate::block_forward!(
    HunyuanVideoTransformer3DModel, BlockInputs, take_streams, Streams,
    |m, s, inputs| m.finish(&s.video, inputs) => Tensor
);

impl HookedBlock<Streams, BlockInputs> for HunyuanVideoBlock {
    /// [`Self::forward`], asking `hooks` (a step cache) for the output of the block's `attn`.
    fn forward_hooked(
        &self,
        streams: &Streams,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Streams> {
        let apart = inputs.modulation(self.index);
        match &self.part {
            BlockPart::Refiner(b) => b.forward(streams, inputs, apart, hooks),
            BlockPart::DualStream(b) => b.forward(streams, inputs, apart, hooks),
            BlockPart::SingleStream(b) => b.forward(streams, inputs, apart, hooks),
        }
    }
}

/// How diffusers names what its cache hooks see in HunyuanVideo: `transformer_blocks` then
/// `single_transformer_blocks` (the token refiner runs inside `context_embedder`, where only
/// PAB reaches its `attn`), each returning the video and text streams, and in each `attn` and,
/// in the dual-stream blocks, the streams' feed-forwards `ff` and `ff_context`.
const CACHE_NAMES: ModuleNames = ModuleNames {
    lists: &["transformer_blocks", "single_transformer_blocks"],
    interleaved: false,
    submodules: &[
        (Output::Attention, "attn"),
        (Output::FeedForward, "ff"),
        (Output::ContextFeedForward, "ff_context"),
    ],
    absent: Absent::FeedForwardsAfterFirstList,
    proj_out: "proj_out",
};

impl HunyuanVideoTransformerConfig {
    /// The blocks diffusers' cache hooks see, by their names.
    pub fn hooked_blocks(&self) -> HookedBlocks {
        HookedBlocks {
            first: self.num_refiner_layers,
            count: self.num_layers + self.num_single_layers,
            split: self.num_layers,
            names: CACHE_NAMES,
        }
    }
}

impl crate::models::blocks::CachedForward for HunyuanVideoTransformer3DModel {
    fn finish_hooked(
        &self,
        s: Streams,
        inputs: &BlockInputs,
        project: &mut Through,
    ) -> Result<Tensor> {
        self.finish_projecting(&s.video, inputs, project)
    }

    fn hooked_blocks(&self) -> HookedBlocks {
        self.cfg.hooked_blocks()
    }

    fn streams(s: &Streams, _: &BlockInputs) -> Result<Vec<Tensor>> {
        if s.mid_block() {
            candle_core::bail!("a step cache reads HunyuanVideo's streams between whole blocks");
        }
        Ok(vec![s.video.clone(), s.text.clone()])
    }

    fn state(streams: Vec<Tensor>, _: &BlockInputs) -> Result<Streams> {
        match <[Tensor; 2]>::try_from(streams) {
            Ok([video, text]) => Ok(Streams::new(video, text)),
            Err(_) => candle_core::bail!("HunyuanVideo's blocks thread two streams"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_chunks_cover_every_token_once() -> Result<()> {
        let x = Tensor::arange(0f32, 2.0 * 23.0 * 3.0, &Device::Cpu)?.reshape((2, 23, 3))?;
        let offsets = Tensor::arange(0f32, 23.0, &Device::Cpu)?.reshape((1, 23, 1))?;
        // A row-wise map that also uses the chunk's offset, as the single-stream block does.
        let f = |start: usize, rows: &Tensor| {
            let len = rows.dim(1)?;
            (rows * 2.0)?.broadcast_add(&offsets.narrow(1, start, len)?)
        };
        let whole = f(0, &x)?;
        let chunked = by_chunks_of(&x, 7, f)?;
        let diff = (whole - chunked)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        Ok(())
    }

    /// Every kind of block of `cfg` with random bf16 weights on `dev`, run whole and one step
    /// at a time (each step built on its own, as leaf-level streaming builds it), on `video`
    /// video tokens and `text` text tokens of which the last 8 are padding: both streams come
    /// out bit-identical.
    pub(super) fn steps_match_whole_blocks(
        cfg: &HunyuanVideoTransformerConfig,
        dev: &Device,
        video: usize,
        text: usize,
    ) -> Result<()> {
        let randn = |shape: &[usize], std: f32| -> Result<Tensor> {
            Tensor::randn(0f32, std, shape, dev)?.to_dtype(DType::BF16)
        };
        let map = candle_nn::VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::BF16, dev);
        let dim = cfg.inner_dim();
        let half = cfg.attention_head_dim / 2;
        let angles = Tensor::rand(0f32, 6.3, (video, half), dev)?;
        let valid = (0..text).map(|j| j + 8 < text).collect::<Vec<_>>();
        let inputs = BlockInputs {
            streams: None,
            temb: Some(randn(&[1, dim], 1.0)?),
            refiner_temb: Some(randn(&[1, dim], 1.0)?),
            rope_cos: angles.cos()?,
            rope_sin: angles.sin()?,
            text_lens: vec![text - 8],
            text_valid: vec![valid],
            batch: 1,
            grid: [1, 1, video],
            modulations: None,
        };
        let first = |kind| {
            (0..cfg.num_blocks())
                .find(|&i| cfg.block_kind(i).ok().map(|k| k.0) == Some(kind))
                .expect("every kind has a block")
        };
        for kind in BlockKind::ALL {
            let i = first(kind);
            let whole = HunyuanVideoBlock::new(cfg, i, vb.clone())?;
            // The VarMap's init leaves norms and biases plain: draw them too.
            for (name, var) in map.data().lock().expect("varmap lock").iter() {
                if (name.contains("norm") && !name.contains("linear")) || name.ends_with("bias") {
                    var.set(&randn(var.dims(), 0.5)?)?;
                }
            }
            let streams = Streams::new(randn(&[1, video, dim], 1.0)?, randn(&[1, text, dim], 1.0)?);
            let want = whole.forward(&streams, &inputs)?;
            let same = |got: &Streams, how: &str| -> Result<()> {
                assert!(!got.mid_block(), "{kind:?} {how}");
                for (a, b, what) in [
                    (&got.video, &want.video, "video"),
                    (&got.text, &want.text, "text"),
                ] {
                    let diff = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
                        .abs()?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    assert_eq!(diff, 0.0, "{kind:?} {how} {what}");
                }
                Ok(())
            };
            let by_steps = |steps: &[BlockStep], inputs: &BlockInputs| -> Result<Streams> {
                let mut got = streams.clone();
                for step in steps {
                    let part = HunyuanVideoBlock::with_steps(cfg, i, vb.clone(), &[*step])?;
                    got = part.forward(&got, inputs)?;
                }
                Ok(got)
            };
            same(&by_steps(kind.steps(), &inputs)?, "step by step")?;
            // The modulations computed apart by a block of the modulation steps alone; the body,
            // whole or step by step, reads them from the inputs.
            let mut table = vec![Vec::new(); cfg.num_blocks()];
            table[i] = HunyuanVideoBlock::with_steps(cfg, i, vb.clone(), kind.modulation_steps())?
                .modulation(inputs.temb()?, inputs.refiner_temb()?)?;
            let apart = BlockInputs {
                modulations: Some(Arc::new(table)),
                ..inputs.clone()
            };
            let apart_cfg = HunyuanVideoTransformerConfig {
                modulations_apart: true,
                ..cfg.clone()
            };
            let body = HunyuanVideoBlock::new(&apart_cfg, i, vb.clone())?;
            same(&body.forward(&streams, &apart)?, "modulations apart")?;
            same(
                &by_steps(kind.body_steps(), &apart)?,
                "modulations apart, step by step",
            )?;
            // Without them the body refuses to run.
            assert!(body.forward(&streams, &inputs).is_err(), "{kind:?}");
        }
        Ok(())
    }

    #[test]
    fn steps_match_whole_blocks_in_bf16() -> Result<()> {
        let cfg = HunyuanVideoTransformerConfig {
            num_attention_heads: 2,
            attention_head_dim: 16,
            rope_axes_dim: vec![4, 6, 6],
            text_embed_dim: 32,
            pooled_projection_dim: 24,
            num_layers: 1,
            num_single_layers: 1,
            num_refiner_layers: 1,
            ..Default::default()
        };
        steps_match_whole_blocks(&cfg, &Device::Cpu, 60, 20)
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    //! The fused paths against the candle compositions they replace, on random bf16 inputs of
    //! HunyuanVideo sizes (3072 wide, 24 heads of 128; 17·30·40 video tokens and 256 text
    //! tokens), on the GPU.
    use super::*;
    use crate::models::row_ops::test_util::{
        assert_within_ulp, assert_within_ulp_carrying, device, randn,
    };

    const DIM: usize = 3072;
    const HEADS: usize = 24;
    const VIDEO: usize = 17 * 30 * 40;
    const TEXT: usize = 256;

    /// The fused paths run block by block and step by step give the same bits.
    #[test]
    fn steps_match_whole_blocks_on_the_fused_path() -> Result<()> {
        let Some(dev) = device("HunyuanVideo block steps") else {
            return Ok(());
        };
        let cfg = HunyuanVideoTransformerConfig::default();
        super::tests::steps_match_whole_blocks(&cfg, &dev, 17 * 30 * 4, TEXT)
    }

    #[test]
    fn norm_modulate_matches_composite() -> Result<()> {
        let Some(dev) = device("HunyuanVideo fused kernels") else {
            return Ok(());
        };
        for (b, s) in [(1, VIDEO + TEXT), (2, 1000)] {
            let x = (randn(&[b, s, DIM], 1.0, &dev)? * 3.0)?;
            let (shift, scale) = (randn(&[b, DIM], 0.5, &dev)?, randn(&[b, DIM], 0.5, &dev)?);
            let normed = layer_norm(&x, NORM_EPS)?;
            let want = modulate(&normed, &shift, &scale)?;
            let got = norm_modulate(&x, &shift, &scale)?;
            // The last rounded step adds the shift to n·(1 + scale): bound by that term, plus a
            // one-ulp flip of the norm n carried through 1 + scale.
            let term = want
                .to_dtype(DType::F32)?
                .broadcast_sub(&shift.unsqueeze(1)?.to_dtype(DType::F32)?)?;
            let gain = (scale.unsqueeze(1)?.to_dtype(DType::F32)? + 1.0)?;
            let what = format!("norm_modulate b={b}");
            assert_within_ulp_carrying(&got, &want, &term, (&normed, &gain), &what)?;
        }
        Ok(())
    }

    #[test]
    fn gated_matches_composite() -> Result<()> {
        let Some(dev) = device("HunyuanVideo fused kernels") else {
            return Ok(());
        };
        for (b, s) in [(1, VIDEO), (2, 1000)] {
            let x = randn(&[b, s, DIM], 1.0, &dev)?;
            let delta = randn(&[b, s, DIM], 1.0, &dev)?;
            let gate = randn(&[b, DIM], 0.5, &dev)?;
            let product = delta.broadcast_mul(&gate.unsqueeze(1)?)?;
            let want = (&x + &product)?;
            let term = x.abs()?.maximum(&product.abs()?)?;
            let got = gated(&x, delta.copy()?, &gate)?;
            assert_within_ulp(&got, &want, &term, &format!("gated b={b}"))?;
        }
        Ok(())
    }

    #[test]
    fn qk_rms_rope_matches_composite() -> Result<()> {
        let Some(dev) = device("HunyuanVideo fused kernels") else {
            return Ok(());
        };
        let head_dim = DIM / HEADS;
        // The single-stream joint sequence: RoPE on the video prefix, the text passes.
        for (b, n, l) in [(1, VIDEO, TEXT), (2, 1000, 100)] {
            let s = n + l;
            let angles = Tensor::rand(0f32, 6.3, (n, head_dim / 2), &dev)?;
            let (cos, sin) = (angles.cos()?, angles.sin()?);
            let p = randn(&[b, s, DIM], 1.0, &dev)?;
            let bias = randn(&[DIM], 0.2, &dev)?;
            let w = randn(&[head_dim], 1.0, &dev)?;
            let normed = candle_nn::ops::rms_norm(
                &split_heads(&p.broadcast_add(&bias)?, HEADS)?,
                &w,
                NORM_EPS as f32,
            )?;
            let want = rope_prefix(&normed, &cos, &sin)?;
            // A rotated pair mixes both members: bound by the larger normalised one.
            let shape = (b, HEADS, s, head_dim / 2, 2);
            let term = normed
                .abs()?
                .reshape(shape)?
                .max_keepdim(4)?
                .broadcast_as(shape)?
                .reshape((b, HEADS, s, head_dim))?;
            let got = row_ops::head_norm_rope(
                p.reshape((b * s, DIM))?,
                Some(&bias),
                &w,
                None,
                Some((&cos, &sin)),
                head_dim,
                0,
                Rows { row0: 0, seq: s },
                NORM_EPS,
            )?
            .reshape((b, s, HEADS, head_dim))?
            .transpose(1, 2)?;
            assert_within_ulp(&got, &want, &term, &format!("q/k RMSNorm + RoPE b={b}"))?;
        }
        Ok(())
    }
}
