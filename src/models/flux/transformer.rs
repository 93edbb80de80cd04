//! FLUX.1 diffusion transformer (diffusers `FluxTransformer2DModel`).
//!
//! The forward pass is split so that an engine can stream the blocks:
//!
//! 1. [`FluxTransformer2DModel::prepare`]: `x_embedder` over the packed latents,
//!    `context_embedder` over the T5 text, the timestep + guidance + pooled-CLIP conditioning and
//!    the RoPE table of the ids `[text; image]`.
//! 2. [`FluxBlock::forward`] for every block of [`FluxTransformer2DModel::blocks`] in order: the
//!    dual-stream blocks (`transformer_blocks.*`: image and text with their own weights, joint
//!    attention), then the single-stream blocks (`single_transformer_blocks.*`: one weight set
//!    over the joint sequence, attention and MLP in parallel). Both carry the [`Streams`].
//! 3. [`FluxTransformer2DModel::finish`]: the output norm and `proj_out` on the image tokens.
//!
//! The joint sequence is `[text; image]` and no token is masked (FluxPipeline passes no mask).
//! Dtypes: weights and activations in the `VarBuilder` dtype; LayerNorm statistics, RoPE and the
//! attention softmax in f32.

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;

use crate::models::attention::sdpa;
use crate::models::blocks::HookedBlock;
use crate::models::step_cache::{
    Absent, BlockHooks, ComputeAll, HookedBlocks, ModuleNames, Output, Submodule, Through,
};
// The AdaLN-Zero pieces FLUX shares with HunyuanVideo's dual/single-stream DiT (fused on CUDA).
use crate::models::hunyuan_video::transformer::{
    gated, gated_joint_attention, merge_heads, norm_modulate, Mlp, Modulation, QkvProjection,
};
use crate::models::projection::{project, Input, Projection};
use crate::models::wan::transformer::timestep_embedding;

/// Width of the sinusoidal timestep/guidance projection (diffusers' `Timesteps(256, ...)`).
pub const TIMESTEP_CHANNELS: usize = 256;

/// RoPE base of `FluxPosEmbed` (hard-coded in diffusers).
const ROPE_THETA: f64 = 10000.0;

/// MLP width over model width of the blocks (diffusers' `mlp_ratio` default, never overridden).
const MLP_RATIO: usize = 4;

/// `transformer/config.json` of a diffusers FLUX checkpoint; missing keys take diffusers'
/// defaults (those of `FluxTransformer2DModel.__init__`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct FluxTransformerConfig {
    /// Patch size over the packed tokens (1 in every published FLUX.1).
    pub patch_size: usize,
    /// Channels of a packed token (4 x the VAE's latent channels).
    pub in_channels: usize,
    /// `null` means "same as `in_channels`".
    pub out_channels: Option<usize>,
    /// Dual-stream blocks.
    pub num_layers: usize,
    /// Single-stream blocks.
    pub num_single_layers: usize,
    /// Width of one head.
    pub attention_head_dim: usize,
    /// Heads of every attention.
    pub num_attention_heads: usize,
    /// Width of the T5 text embeddings.
    pub joint_attention_dim: usize,
    /// Width of the pooled CLIP embedding.
    pub pooled_projection_dim: usize,
    /// Whether the (distilled) guidance scale is embedded into the conditioning.
    pub guidance_embeds: bool,
    /// RoPE split of a head over the three id axes.
    pub axes_dims_rope: Vec<usize>,
    /// Not in the file: the blocks' Linears run in fp8 (`--fp8-matmul`, set by the pipeline);
    /// the modulations' stay exact.
    #[serde(skip)]
    pub fp8_matmul: bool,
}

impl Default for FluxTransformerConfig {
    fn default() -> Self {
        FluxTransformerConfig {
            patch_size: 1,
            in_channels: 64,
            out_channels: None,
            num_layers: 19,
            num_single_layers: 38,
            attention_head_dim: 128,
            num_attention_heads: 24,
            joint_attention_dim: 4096,
            pooled_projection_dim: 768,
            guidance_embeds: false,
            axes_dims_rope: vec![16, 56, 56],
            fp8_matmul: false,
        }
    }
}

impl FluxTransformerConfig {
    /// Model width: heads x head dim.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Output channels (`out_channels or in_channels`).
    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// Hidden width of the MLPs.
    pub fn mlp_dim(&self) -> usize {
        self.inner_dim() * MLP_RATIO
    }

    /// All blocks: dual-stream, then single-stream.
    pub fn num_blocks(&self) -> usize {
        self.num_layers + self.num_single_layers
    }

    /// Whether block `index` (execution order) is a dual-stream block, and its index within
    /// its kind.
    pub fn block_kind(&self, index: usize) -> Result<(BlockKind, usize)> {
        if index < self.num_layers {
            Ok((BlockKind::DualStream, index))
        } else if index < self.num_blocks() {
            Ok((BlockKind::SingleStream, index - self.num_layers))
        } else {
            candle_core::bail!("block {index} of a {}-block transformer", self.num_blocks())
        }
    }

    /// Rejects configurations this model cannot run, naming the key.
    pub fn validate(&self) -> Result<()> {
        if self.patch_size != 1 {
            candle_core::bail!(
                "transformer config: patch_size {} is not supported (FluxPipeline packs 2x2 latents itself; only 1)",
                self.patch_size
            );
        }
        if self.num_attention_heads == 0 || self.attention_head_dim == 0 {
            candle_core::bail!(
                "transformer config: num_attention_heads and attention_head_dim must be positive"
            );
        }
        if self.in_channels == 0 || !self.in_channels.is_multiple_of(4) {
            candle_core::bail!(
                "transformer config: in_channels {} must be a positive multiple of 4 (2x2 packed latents)",
                self.in_channels
            );
        }
        if self.out_channels == Some(0) {
            candle_core::bail!("transformer config: out_channels must be positive");
        }
        if self.joint_attention_dim == 0 || self.pooled_projection_dim == 0 {
            candle_core::bail!(
                "transformer config: joint_attention_dim and pooled_projection_dim must be positive"
            );
        }
        if self.axes_dims_rope.len() != 3
            || self.axes_dims_rope.iter().any(|d| d % 2 != 0)
            || self.axes_dims_rope.iter().sum::<usize>() != self.attention_head_dim
        {
            candle_core::bail!(
                "transformer config: axes_dims_rope {:?} must be three even sizes summing to attention_head_dim {}",
                self.axes_dims_rope,
                self.attention_head_dim
            );
        }
        Ok(())
    }
}

/// Which of the two kinds a block is, in execution order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// `transformer_blocks.*`: separate weights per stream, joint attention.
    DualStream,
    /// `single_transformer_blocks.*`: one weight set over the joint sequence.
    SingleStream,
}

impl BlockKind {
    /// Every kind, in execution order.
    pub const ALL: [BlockKind; 2] = [BlockKind::DualStream, BlockKind::SingleStream];

    /// The steps of a block of this kind, in execution order.
    pub fn steps(self) -> &'static [BlockStep] {
        match self {
            BlockKind::DualStream => &[
                BlockStep::ImageModulation,
                BlockStep::TextModulation,
                BlockStep::JointAttention,
                BlockStep::AttentionOutput,
                BlockStep::ImageFeedForwardIn,
                BlockStep::ImageFeedForwardOut,
                BlockStep::TextFeedForwardIn,
                BlockStep::TextFeedForwardOut,
            ],
            BlockKind::SingleStream => &[
                BlockStep::SingleModulation,
                BlockStep::SingleAttention,
                BlockStep::SingleMlp,
            ],
        }
    }
}

/// The steps of a block, in execution order, each holding a disjoint part of the block's
/// weights (at most ~170 MB in bf16 at the published size, the single-stream MLP, whose two
/// products run by halves of the rows). A block built with only some of them runs just those,
/// with exactly the arithmetic of the whole block, and hands what later steps need on in
/// [`Streams`]. Steps this fine keep leaf level's weights in flight small where the
/// activations peak: beside the single-stream MLP only a modulation is copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockStep {
    /// Dual-stream: `norm1.linear`, the image stream's six modulations.
    ImageModulation,
    /// Dual-stream: `norm1_context.linear`, the text stream's six modulations.
    TextModulation,
    /// Dual-stream: both streams' modulated norms, q/k/v and the joint attention.
    JointAttention,
    /// Dual-stream: `to_out` and `to_add_out` over the attention, the gated residuals.
    AttentionOutput,
    /// Dual-stream: the image stream's modulated norm, `ff.net.0.proj` and its GELU.
    ImageFeedForwardIn,
    /// Dual-stream: `ff.net.2`, the image stream's gated residual.
    ImageFeedForwardOut,
    /// Dual-stream: the text stream's modulated norm, `ff_context.net.0.proj` and its GELU.
    TextFeedForwardIn,
    /// Dual-stream: `ff_context.net.2`, the text stream's gated residual.
    TextFeedForwardOut,
    /// Single-stream: the modulation (`norm.linear`).
    SingleModulation,
    /// Single-stream: the modulated norm of [text; image], q/k/v and attention.
    SingleAttention,
    /// Single-stream: `proj_mlp`, `proj_out` over [attention; MLP], gated residual.
    SingleMlp,
}

/// Everything the blocks and the output head need, computed once per forward by `prepare`.
#[derive(Debug, Clone)]
pub struct BlockInputs {
    streams: Option<Streams>,
    /// Conditioning `[B, inner]`: timestep + guidance + pooled text embeddings.
    pub temb: Tensor,
    /// RoPE cosines `[text + image tokens, head_dim / 2]` in f32, one per interleaved pair.
    pub rope_cos: Tensor,
    /// RoPE sines, same layout as `rope_cos`.
    pub rope_sin: Tensor,
}

impl BlockInputs {
    /// Takes the streams that feed the first block (once; the inputs keep no copy).
    pub fn take_streams(&mut self) -> Result<Streams> {
        match self.streams.take() {
            Some(s) => Ok(s),
            None => candle_core::bail!("block-0 streams already taken"),
        }
    }
}

/// What flows from block to block: the image `[B, N, inner]` and text `[B, L, inner]` streams
/// and, between the steps of a block streamed step by step, what its earlier steps computed
/// for its later ones.
#[derive(Debug, Clone)]
pub struct Streams {
    pub image: Tensor,
    pub text: Tensor,
    carry: Carry,
}

impl Streams {
    /// Streams between whole blocks.
    pub fn new(image: Tensor, text: Tensor) -> Self {
        Self {
            image,
            text,
            carry: Carry::None,
        }
    }
}

/// What a dual-stream block's earlier steps hand its later ones: each stream's six modulation
/// chunks, the joint attention's output before its projections, and each stream's
/// feed-forward hidden layer, as far as computed.
#[derive(Debug, Clone, Default)]
struct DualCarry {
    image: Option<Vec<Tensor>>,
    text: Option<Vec<Tensor>>,
    attended: Option<Tensor>,
    image_hidden: Option<Tensor>,
    text_hidden: Option<Tensor>,
}

/// What a block's earlier steps hand its later ones.
#[derive(Debug, Clone)]
enum Carry {
    /// Between blocks.
    None,
    DualStream(Box<DualCarry>),
    /// Single-stream: the modulation's three chunks (shift, scale, gate).
    SingleModulated(Vec<Tensor>),
    /// Single-stream: the modulated norm of [text; image], the attention's output and the
    /// gate.
    SingleStream {
        normed: Tensor,
        attention: Tensor,
        gate: Tensor,
    },
}

/// A step run without the earlier step of its block that computes what it needs.
fn out_of_order(step: BlockStep) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "FLUX block step {step:?} run without its block's earlier steps (steps must run in order)"
    ))
}

/// What `step` needs from an earlier step of its block.
fn needed<T: Clone>(value: &Option<T>, step: BlockStep) -> Result<T> {
    value.clone().ok_or_else(|| out_of_order(step))
}

/// The rows `start..start + len` of the RoPE table: the positions of one stream in the joint
/// sequence.
fn rope_rows(inputs: &BlockInputs, start: usize, len: usize) -> Result<(Tensor, Tensor)> {
    Ok((
        inputs.rope_cos.narrow(0, start, len)?,
        inputs.rope_sin.narrow(0, start, len)?,
    ))
}

/// Attention over q, k (normed and rotated) and v of the whole joint sequence (no mask), as
/// `[B, S, inner]`; q, k and v go before the heads are merged.
fn attention(q: Tensor, k: Tensor, v: Tensor) -> Result<Tensor> {
    let scale = 1.0 / (q.dim(3)? as f64).sqrt();
    let out = sdpa(&q, &k, &v, scale)?;
    drop((q, k, v));
    merge_heads(&out)
}

/// Both streams' modulated norms with their modulations `m` and `c` (chunks: shift_msa,
/// scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp), each projected to q/k/v and rotated
/// at its positions, and the joint attention over [text; image]: `[B, L + N, inner]`.
fn attend(
    (image_qkv, text_qkv): &(QkvProjection, QkvProjection),
    (image, text): (&Tensor, &Tensor),
    m: &[Tensor],
    c: &[Tensor],
    inputs: &BlockInputs,
) -> Result<Tensor> {
    let (text_len, image_len) = (text.dim(1)?, image.dim(1)?);
    // Each modulated norm goes once projected.
    let (cos, sin) = rope_rows(inputs, text_len, image_len)?;
    let (q, k, v) = image_qkv.forward(&norm_modulate(image, &m[0], &m[1])?, Some((&cos, &sin)))?;
    let (cos, sin) = rope_rows(inputs, 0, text_len)?;
    let (tq, tk, tv) = text_qkv.forward(&norm_modulate(text, &c[0], &c[1])?, Some((&cos, &sin)))?;
    let cat = |a: Tensor, b: Tensor| Tensor::cat(&[a, b], 2);
    attention(cat(tq, q)?, cat(tk, k)?, cat(tv, v)?)
}

/// `to_out` and `to_add_out` over the joint attention's output `[B, L + N, inner]` of a text
/// of `text_len` tokens: `attn`'s image and text outputs.
fn project_attended(
    (to_out, to_add_out): &(Projection, Projection),
    attended: &Tensor,
    text_len: usize,
) -> Result<(Tensor, Tensor)> {
    let image_len = attended.dim(1)? - text_len;
    let project = |linear: &Projection, x: Tensor| linear.apply(&Input::new(&x), false);
    let attn_image = project(to_out, attended.narrow(1, text_len, image_len)?)?;
    let attn_text = project(to_add_out, attended.narrow(1, 0, text_len)?)?;
    Ok((attn_image, attn_text))
}

/// A stream's feed-forward (diffusers `FeedForward`, GELU-tanh), or one of its two steps:
/// `net.0.proj` with its GELU, and `net.2`.
#[derive(Debug, Clone)]
struct FeedForward {
    proj: Option<Projection>,
    out: Option<Projection>,
}

impl FeedForward {
    /// The halves of the feed-forward at `vb` that `(proj, out)` ask for.
    fn new(cfg: &FluxTransformerConfig, vb: VarBuilder, (proj, out): (bool, bool)) -> Result<Self> {
        let (dim, hidden, fp8) = (cfg.inner_dim(), cfg.mlp_dim(), cfg.fp8_matmul);
        Ok(Self {
            proj: proj
                .then(|| Projection::load((dim, hidden), vb.pp("net.0.proj"), fp8))
                .transpose()?,
            out: out
                .then(|| Projection::load((hidden, dim), vb.pp("net.2"), fp8))
                .transpose()?,
        })
    }

    /// The stream `x` after the steps this holds, with its modulation `m` (chunks 3, 4, 5:
    /// the modulated norm's shift and scale, the residual's gate): the modulated norm through
    /// `net.0.proj` and GELU becomes `hidden`; `net.2` of `hidden` (the module's output, which
    /// goes through `hooks` as `module`) is added to `x` gated. Whole, the module runs at once
    /// inside `hooks`, so a step cache that stands in for it skips all of it.
    fn forward(
        &self,
        module: Submodule,
        x: Tensor,
        m: &[Tensor],
        hidden: &mut Option<Tensor>,
        hooks: &mut dyn BlockHooks,
        out_step: BlockStep,
    ) -> Result<Tensor> {
        let expand =
            |proj: &Projection| proj.apply(&Input::new(&norm_modulate(&x, &m[3], &m[4])?), true);
        let project = |out: &Projection, h: &Tensor| out.apply(&Input::new(h), false);
        let out = match (&self.proj, &self.out) {
            (Some(proj), Some(out)) => {
                hooks.output(module, &mut || project(out, &expand(proj)?))?
            }
            (Some(proj), None) => {
                *hidden = Some(expand(proj)?);
                return Ok(x);
            }
            (None, Some(out)) => {
                let h = hidden.take().ok_or_else(|| out_of_order(out_step))?;
                hooks.output(module, &mut || project(out, &h))?
            }
            (None, None) => return Ok(x),
        };
        gated(&x, out, &m[5])
    }
}

/// One dual-stream block (diffusers `FluxTransformerBlock`), or some of its steps.
#[derive(Debug, Clone)]
pub struct FluxTransformerBlock {
    norm1: Option<Modulation>,
    norm1_context: Option<Modulation>,
    /// `attn`'s q/k/v of the image and of the text stream.
    qkv: Option<(QkvProjection, QkvProjection)>,
    /// `attn.to_out.0` and `attn.to_add_out`.
    projections: Option<(Projection, Projection)>,
    ff: FeedForward,
    ff_context: FeedForward,
}

impl FluxTransformerBlock {
    /// Loads only the weights of `steps`; `vb` points at `transformer_blocks.{i}`.
    pub fn with_steps(
        cfg: &FluxTransformerConfig,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self> {
        let dim = cfg.inner_dim();
        let has = |s| steps.contains(&s);
        let attn = vb.pp("attn");
        let heads = (cfg.num_attention_heads, cfg.attention_head_dim);
        let feed_forward =
            |name: &str, proj, out| FeedForward::new(cfg, vb.pp(name), (has(proj), has(out)));
        Ok(Self {
            norm1: has(BlockStep::ImageModulation)
                .then(|| Modulation::new(dim, 6, vb.pp("norm1")))
                .transpose()?,
            norm1_context: has(BlockStep::TextModulation)
                .then(|| Modulation::new(dim, 6, vb.pp("norm1_context")))
                .transpose()?,
            qkv: has(BlockStep::JointAttention)
                .then(|| QkvProjection::joint(heads, &attn, cfg.fp8_matmul))
                .transpose()?,
            projections: has(BlockStep::AttentionOutput)
                .then(|| -> Result<_> {
                    Ok((
                        Projection::load((dim, dim), attn.pp("to_out.0"), cfg.fp8_matmul)?,
                        Projection::load((dim, dim), attn.pp("to_add_out"), cfg.fp8_matmul)?,
                    ))
                })
                .transpose()?,
            ff: feed_forward(
                "ff",
                BlockStep::ImageFeedForwardIn,
                BlockStep::ImageFeedForwardOut,
            )?,
            ff_context: feed_forward(
                "ff_context",
                BlockStep::TextFeedForwardIn,
                BlockStep::TextFeedForwardOut,
            )?,
        })
    }

    /// Runs the block's steps on the streams; returns them with what later steps need. The
    /// attention (`attn`'s image and text outputs after `to_out` / `to_add_out`) and each
    /// feed-forward go through `hooks`, whole where the block holds both of their steps.
    fn forward(
        &self,
        streams: &Streams,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Streams> {
        let mut carry = match &streams.carry {
            Carry::DualStream(carry) => (**carry).clone(),
            _ => DualCarry::default(),
        };
        if let Some(norm1) = &self.norm1 {
            carry.image = Some(norm1.forward(&inputs.temb)?);
        }
        if let Some(norm1_context) = &self.norm1_context {
            carry.text = Some(norm1_context.forward(&inputs.temb)?);
        }
        let (mut image, mut text) = (streams.image.clone(), streams.text.clone());
        let text_len = text.dim(1)?;
        if self.qkv.is_some() || self.projections.is_some() {
            let step = BlockStep::JointAttention;
            let (m, c) = (needed(&carry.image, step)?, needed(&carry.text, step)?);
            let streams = (&image, &text);
            let attended = match &self.qkv {
                Some(qkv) if self.projections.is_none() => {
                    carry.attended = Some(attend(qkv, streams, &m, &c, inputs)?);
                    None
                }
                Some(_) => None,
                None => Some(needed(&carry.attended, BlockStep::AttentionOutput)?),
            };
            if let Some(out) = &self.projections {
                (image, text) = gated_joint_attention(hooks, streams, (&m, &c), || {
                    let attended = match (&self.qkv, &attended) {
                        (Some(qkv), _) => attend(qkv, streams, &m, &c, inputs)?,
                        (None, Some(attended)) => attended.clone(),
                        (None, None) => return Err(out_of_order(BlockStep::AttentionOutput)),
                    };
                    project_attended(out, &attended, text_len)
                })?;
                carry.attended = None;
            }
        }
        if self.ff.proj.is_some() || self.ff.out.is_some() {
            let m = needed(&carry.image, BlockStep::ImageFeedForwardIn)?;
            let hidden = &mut carry.image_hidden;
            let out = BlockStep::ImageFeedForwardOut;
            image = self
                .ff
                .forward(Submodule::FeedForward, image, &m, hidden, hooks, out)?;
        }
        if self.ff_context.proj.is_some() || self.ff_context.out.is_some() {
            let c = needed(&carry.text, BlockStep::TextFeedForwardIn)?;
            let hidden = &mut carry.text_hidden;
            let (module, out) = (Submodule::ContextFeedForward, BlockStep::TextFeedForwardOut);
            text = self
                .ff_context
                .forward(module, text, &c, hidden, hooks, out)?;
        }
        // The text feed-forward's output projection is the block's last step.
        let carry = match self.ff_context.out {
            Some(_) => Carry::None,
            None => Carry::DualStream(Box::new(carry)),
        };
        Ok(Streams { image, text, carry })
    }
}

/// One single-stream block (diffusers `FluxSingleTransformerBlock`): attention and MLP in
/// parallel over the joint [text; image] sequence, one output projection; or some of its steps.
#[derive(Debug, Clone)]
pub struct FluxSingleTransformerBlock {
    /// `norm` (shift, scale, gate).
    norm: Option<Modulation>,
    /// The attention's q/k/v.
    qkv: Option<QkvProjection>,
    /// `proj_mlp` and `proj_out`.
    mlp: Option<(Projection, Projection)>,
}

impl FluxSingleTransformerBlock {
    /// Loads only the weights of `steps`; `vb` points at `single_transformer_blocks.{i}`.
    pub fn with_steps(
        cfg: &FluxTransformerConfig,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self> {
        let (dim, mlp) = (cfg.inner_dim(), cfg.mlp_dim());
        let has = |s| steps.contains(&s);
        Ok(Self {
            norm: has(BlockStep::SingleModulation)
                .then(|| Modulation::new(dim, 3, vb.pp("norm")))
                .transpose()?,
            qkv: has(BlockStep::SingleAttention)
                .then(|| {
                    QkvProjection::new(
                        (cfg.num_attention_heads, cfg.attention_head_dim),
                        &vb.pp("attn"),
                        ["to_q", "to_k", "to_v", "norm_q", "norm_k"],
                        cfg.fp8_matmul,
                    )
                })
                .transpose()?,
            mlp: has(BlockStep::SingleMlp)
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

    /// The modulation (shift, scale, gate), the modulated norm of [text; image] and the
    /// attention (`attn`, whose output goes through `hooks`), then the GELU-tanh MLP beside it,
    /// `proj_out` over both and the gated residual.
    fn forward(
        &self,
        streams: &Streams,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Streams> {
        let mut streams = streams.clone();
        if let Some(norm) = &self.norm {
            streams.carry = Carry::SingleModulated(norm.forward(&inputs.temb)?);
        }
        if let Some(qkv) = &self.qkv {
            let Carry::SingleModulated(m) = std::mem::replace(&mut streams.carry, Carry::None)
            else {
                return Err(out_of_order(BlockStep::SingleAttention));
            };
            let normed = norm_modulate(
                &Tensor::cat(&[&streams.text, &streams.image], 1)?,
                &m[0],
                &m[1],
            )?;
            let rope = (&inputs.rope_cos, &inputs.rope_sin);
            let attention = hooks.output(Submodule::SelfAttention, &mut || {
                let (q, k, v) = qkv.forward(&normed, Some(rope))?;
                attention(q, k, v)
            })?;
            streams.carry = Carry::SingleStream {
                attention,
                normed,
                gate: m[2].clone(),
            };
        }
        if let Some((proj_mlp, proj_out)) = &self.mlp {
            let Carry::SingleStream {
                normed,
                attention,
                gate,
            } = std::mem::replace(&mut streams.carry, Carry::None)
            else {
                return Err(out_of_order(BlockStep::SingleMlp));
            };
            // The MLP and [attention; MLP] (the block's largest tensors) exist for one half
            // of the rows at a time: the same products, row by row, in half the memory.
            let rows = normed.dim(1)?;
            let half = rows.div_ceil(2);
            let mut halves = Vec::with_capacity(2);
            for (start, len) in [(0, half), (half, rows - half)] {
                if len == 0 {
                    continue;
                }
                let mlp = proj_mlp.apply(&Input::new(&normed.narrow(1, start, len)?), true)?;
                let joined = Tensor::cat(&[&attention.narrow(1, start, len)?, &mlp], 2)?;
                drop(mlp);
                halves.push(proj_out.apply(&Input::new(&joined), false)?);
            }
            drop((normed, attention));
            let out = Tensor::cat(&halves, 1)?;
            drop(halves);
            let text_len = streams.text.dim(1)?;
            let x = Tensor::cat(&[&streams.text, &streams.image], 1)?;
            let x = gated(&x, out, &gate)?;
            let total = x.dim(1)?;
            streams = Streams::new(
                x.narrow(1, text_len, total - text_len)?,
                x.narrow(1, 0, text_len)?,
            );
        }
        Ok(streams)
    }
}

/// A block of either kind, as the engine streams them.
#[derive(Debug, Clone)]
pub enum FluxBlock {
    Dual(Box<FluxTransformerBlock>),
    Single(FluxSingleTransformerBlock),
}

impl FluxBlock {
    /// Block `index` in execution order, whole, from the root `VarBuilder`.
    pub fn new(cfg: &FluxTransformerConfig, index: usize, vb: VarBuilder) -> Result<Self> {
        Self::with_steps(cfg, index, vb, cfg.block_kind(index)?.0.steps())
    }

    /// Block `index` with only `steps` (of its kind's), from the root `VarBuilder`.
    pub fn with_steps(
        cfg: &FluxTransformerConfig,
        index: usize,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self> {
        cfg.validate()?;
        Ok(match cfg.block_kind(index)? {
            (BlockKind::DualStream, i) => {
                FluxBlock::Dual(Box::new(FluxTransformerBlock::with_steps(
                    cfg,
                    vb.pp(format!("transformer_blocks.{i}")),
                    steps,
                )?))
            }
            (BlockKind::SingleStream, i) => {
                FluxBlock::Single(FluxSingleTransformerBlock::with_steps(
                    cfg,
                    vb.pp(format!("single_transformer_blocks.{i}")),
                    steps,
                )?)
            }
        })
    }

    /// Runs the block (or its steps) on the streams.
    pub fn forward(&self, streams: &Streams, inputs: &BlockInputs) -> Result<Streams> {
        self.forward_hooked(streams, inputs, &mut ComputeAll)
    }
}

/// `time_text_embed`: timestep, guidance (where embedded) and pooled-text embedders.
#[derive(Debug, Clone)]
struct Conditioner {
    timestep_embedder: Mlp,
    guidance_embedder: Option<Mlp>,
    text_embedder: Mlp,
    dtype: DType,
}

impl Conditioner {
    fn new(cfg: &FluxTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let dim = cfg.inner_dim();
        Ok(Self {
            timestep_embedder: Mlp::embedder(TIMESTEP_CHANNELS, dim, vb.pp("timestep_embedder"))?,
            guidance_embedder: cfg
                .guidance_embeds
                .then(|| Mlp::embedder(TIMESTEP_CHANNELS, dim, vb.pp("guidance_embedder")))
                .transpose()?,
            text_embedder: Mlp::embedder(cfg.pooled_projection_dim, dim, vb.pp("text_embedder"))?,
            dtype: vb.dtype(),
        })
    }

    /// `[B, inner]` for `timestep` and `guidance` (`[B]`, already x1000) and `pooled`.
    fn forward(
        &self,
        timestep: &Tensor,
        guidance: Option<&Tensor>,
        pooled: &Tensor,
    ) -> Result<Tensor> {
        let embed = |mlp: &Mlp, t: &Tensor| -> Result<Tensor> {
            mlp.forward(&timestep_embedding(t, TIMESTEP_CHANNELS)?.to_dtype(self.dtype)?)
        };
        let mut temb = embed(&self.timestep_embedder, timestep)?;
        if let Some(embedder) = &self.guidance_embedder {
            let Some(guidance) = guidance else {
                candle_core::bail!("this transformer embeds guidance: pass the guidance scale");
            };
            temb = (temb + embed(embedder, guidance)?)?;
        }
        temb + self.text_embedder.forward(&pooled.to_dtype(self.dtype)?)?
    }
}

/// `FluxPosEmbed` of `ids` `[S, 3]` (f32 positions): per axis `d`, the angles `pos · θ^(-2j/d)`
/// in f64, cast to f32, the axes side by side: cos and sin `[S, head_dim / 2]`, one per
/// interleaved pair.
pub fn rope_tables(axes_dims: &[usize], ids: &Tensor, device: &Device) -> Result<(Tensor, Tensor)> {
    let ids = ids
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .to_vec2::<f32>()?;
    let half: usize = axes_dims.iter().sum::<usize>() / 2;
    let (mut cos, mut sin) = (
        Vec::with_capacity(ids.len() * half),
        Vec::with_capacity(ids.len() * half),
    );
    for row in &ids {
        for (axis, &dim) in axes_dims.iter().enumerate() {
            let pos = f64::from(row[axis]);
            for j in 0..dim / 2 {
                let angle = pos * (1.0 / ROPE_THETA.powf((2 * j) as f64 / dim as f64));
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
    }
    Ok((
        Tensor::from_vec(cos, (ids.len(), half), device)?,
        Tensor::from_vec(sin, (ids.len(), half), device)?,
    ))
}

/// The image ids of `_prepare_latent_image_ids`: `(0, row, col)` for each packed token of an
/// `h x w` grid, row-major, `[h·w, 3]` f32.
pub fn image_ids(h: usize, w: usize, device: &Device) -> Result<Tensor> {
    let ids: Vec<f32> = (0..h * w)
        .flat_map(|i| [0.0, (i / w) as f32, (i % w) as f32])
        .collect();
    Tensor::from_vec(ids, (h * w, 3), device)
}

/// The transformer's `timestep` input `[1]` at scheduler timestep `t`: FluxPipeline's
/// `t.expand(B).to(latents.dtype) / 1000`, divided in that dtype (the model multiplies it by
/// 1000 again).
pub fn timestep_input(t: f64, dtype: DType, device: &Device) -> Result<Tensor> {
    Tensor::new(&[t as f32], device)?
        .to_dtype(dtype)?
        .to_dtype(DType::F32)?
        .broadcast_div(&Tensor::new(1000f32, device)?)?
        .to_dtype(dtype)
}

/// The diffusers `FluxTransformer2DModel`.
#[derive(Debug, Clone)]
pub struct FluxTransformer2DModel {
    cfg: FluxTransformerConfig,
    x_embedder: Linear,
    context_embedder: Linear,
    conditioner: Conditioner,
    blocks: Vec<FluxBlock>,
    /// AdaLayerNormContinuous: scale, shift.
    norm_out: Modulation,
    proj_out: Linear,
    dtype: DType,
}

impl FluxTransformer2DModel {
    /// Loads the whole model, blocks included.
    pub fn new(cfg: &FluxTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads everything except the blocks (for an engine that streams blocks itself).
    pub fn new_without_blocks(cfg: &FluxTransformerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        Ok(Self {
            cfg: cfg.clone(),
            x_embedder: candle_nn::linear(cfg.in_channels, dim, vb.pp("x_embedder"))?,
            context_embedder: candle_nn::linear(
                cfg.joint_attention_dim,
                dim,
                vb.pp("context_embedder"),
            )?,
            conditioner: Conditioner::new(cfg, vb.pp("time_text_embed"))?,
            blocks: Vec::new(),
            norm_out: Modulation::new(dim, 2, vb.pp("norm_out"))?,
            proj_out: candle_nn::linear(
                dim,
                cfg.patch_size * cfg.patch_size * cfg.out_channels(),
                vb.pp("proj_out"),
            )?,
            dtype: vb.dtype(),
        })
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &FluxTransformerConfig {
        &self.cfg
    }

    /// The loaded blocks, dual-stream then single-stream (empty after `new_without_blocks`).
    pub fn blocks(&self) -> &[FluxBlock] {
        &self.blocks
    }

    /// Embeddings and tables for packed `latents` `[B, N, in_channels]`, `timestep` `[B]` (the
    /// pipeline's `t / 1000`), the T5 text `[B, L, joint_attention_dim]`, the pooled CLIP
    /// `[B, pooled_dim]`, `guidance` `[B]` (the scale; required when `guidance_embeds`) and the
    /// ids `[L, 3]` and `[N, 3]`.
    #[allow(clippy::too_many_arguments)]
    pub fn prepare(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
        pooled_projections: &Tensor,
        guidance: Option<&Tensor>,
        txt_ids: &Tensor,
        img_ids: &Tensor,
    ) -> Result<BlockInputs> {
        let cfg = &self.cfg;
        let (b, n, c) = latents.dims3()?;
        if c != cfg.in_channels {
            candle_core::bail!(
                "latents have {c} channels, the transformer expects {}",
                cfg.in_channels
            );
        }
        let len = crate::models::patches::text_len(
            encoder_hidden_states,
            b,
            ("joint_attention_dim", cfg.joint_attention_dim),
        )?;
        if pooled_projections.dims() != [b, cfg.pooled_projection_dim] {
            candle_core::bail!(
                "pooled_projections {:?} do not match [{b}, {}]",
                pooled_projections.dims(),
                cfg.pooled_projection_dim
            );
        }
        if txt_ids.dims() != [len, 3] || img_ids.dims() != [n, 3] {
            candle_core::bail!(
                "txt_ids {:?} and img_ids {:?} do not match [{len}, 3] and [{n}, 3]",
                txt_ids.dims(),
                img_ids.dims()
            );
        }
        let image = project(&self.x_embedder, &latents.to_dtype(self.dtype)?)?;
        // diffusers: timestep.to(dtype) * 1000, guidance.to(dtype) * 1000.
        let thousand = |t: &Tensor| t.to_dtype(self.dtype)? * 1000.0;
        let guidance = guidance.map(thousand).transpose()?;
        let temb = self.conditioner.forward(
            &thousand(timestep)?,
            guidance.as_ref(),
            pooled_projections,
        )?;
        let text = project(
            &self.context_embedder,
            &encoder_hidden_states.to_dtype(self.dtype)?,
        )?;
        let ids = Tensor::cat(
            &[txt_ids.to_dtype(DType::F32)?, img_ids.to_dtype(DType::F32)?],
            0,
        )?;
        let (rope_cos, rope_sin) = rope_tables(&cfg.axes_dims_rope, &ids, latents.device())?;
        Ok(BlockInputs {
            streams: Some(Streams::new(image, text)),
            temb,
            rope_cos,
            rope_sin,
        })
    }

    /// Output norm (AdaLayerNormContinuous: scale then shift) and `proj_out` of the image
    /// tokens `[B, N, inner]` -> `[B, N, out_channels]`.
    pub fn finish(&self, image: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        self.finish_projecting(image, inputs, &mut |compute| compute())
    }

    /// [`Self::finish`], the output projection's output through `through` (a step cache's,
    /// which may stand in for it).
    pub fn finish_projecting(
        &self,
        image: &Tensor,
        inputs: &BlockInputs,
        through: &mut Through,
    ) -> Result<Tensor> {
        through(&mut || project(&self.proj_out, &self.norm_out_forward(image, inputs)?))
    }

    /// `norm_out` alone (the output head before `proj_out`).
    pub fn norm_out_forward(&self, image: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        let m = self.norm_out.forward(&inputs.temb)?;
        norm_modulate(image, &m[1], &m[0])
    }

    /// Full forward: `prepare`, every block, `finish`. Needs a model built with `new`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
        pooled_projections: &Tensor,
        guidance: Option<&Tensor>,
        txt_ids: &Tensor,
        img_ids: &Tensor,
    ) -> Result<Tensor> {
        let inputs = self.prepare(
            latents,
            timestep,
            encoder_hidden_states,
            pooled_projections,
            guidance,
            txt_ids,
            img_ids,
        )?;
        crate::models::blocks::BlockForward::forward_resident(self, inputs)
    }
}

/// The modules diffusers' layerwise casting leaves alone in `FluxTransformer2DModel` (its
/// `_skip_layerwise_casting_patterns`).
const LAYERWISE_CASTING_SKIP: &[&str] = &["pos_embed", "norm"];

// Placed by the block protocol: dual-stream blocks, then single-stream ones (two kinds, never
// in one group, as diffusers groups each block list apart).
crate::kinded_blocks!(
    FluxTransformer2DModel, FluxTransformerConfig, FluxBlock, BlockKind,
    skip: LAYERWISE_CASTING_SKIP, steps: |_, kind| kind.steps()
);

crate::block_forward!(
    FluxTransformer2DModel, BlockInputs, take_streams, Streams,
    |m, s, inputs| m.finish(&s.image, inputs) => Tensor
);

impl HookedBlock<Streams, BlockInputs> for FluxBlock {
    /// [`Self::forward`], asking `hooks` (a step cache) for the output of `attn`.
    fn forward_hooked(
        &self,
        streams: &Streams,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Streams> {
        match self {
            FluxBlock::Dual(block) => block.forward(streams, inputs, hooks),
            FluxBlock::Single(block) => block.forward(streams, inputs, hooks),
        }
    }
}

/// How diffusers names what its cache hooks see in FLUX.1: `transformer_blocks` then
/// `single_transformer_blocks`, each returning the image and text streams, and in each its
/// attention `attn` (PAB's) and, in the dual-stream blocks, the streams' feed-forwards `ff`
/// and `ff_context` (TaylorSeer's, where its patterns name them).
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

impl FluxTransformerConfig {
    /// The blocks diffusers' cache hooks see, by their names.
    pub fn hooked_blocks(&self) -> HookedBlocks {
        HookedBlocks {
            first: 0,
            count: self.num_blocks(),
            split: self.num_layers,
            names: CACHE_NAMES,
        }
    }
}

impl crate::models::blocks::CachedForward for FluxTransformer2DModel {
    fn finish_hooked(
        &self,
        s: Streams,
        inputs: &BlockInputs,
        project: &mut Through,
    ) -> Result<Tensor> {
        self.finish_projecting(&s.image, inputs, project)
    }

    fn hooked_blocks(&self) -> HookedBlocks {
        self.cfg.hooked_blocks()
    }

    fn streams(s: &Streams, _: &BlockInputs) -> Result<Vec<Tensor>> {
        if !matches!(s.carry, Carry::None) {
            candle_core::bail!("a step cache reads FLUX.1's streams between whole blocks");
        }
        Ok(vec![s.image.clone(), s.text.clone()])
    }

    fn state(streams: Vec<Tensor>, _: &BlockInputs) -> Result<Streams> {
        match <[Tensor; 2]>::try_from(streams) {
            Ok([image, text]) => Ok(Streams::new(image, text)),
            Err(_) => candle_core::bail!("FLUX.1's blocks thread two streams"),
        }
    }
}
