//! CogVideoX diffusion transformer (diffusers `CogVideoXTransformer3DModel`, the 5b flavour:
//! rotary position embeddings, no sincos/learned positional embedding, 2D patches).
//!
//! Text and video tokens run as one joint sequence, text first. The forward pass is split like
//! Wan's so that an engine can stream the blocks:
//!
//! 1. [`CogVideoXTransformer3DModel::prepare`]: time embedding, text projection and patch
//!    embedding (the joint sequence `[B, L + F·h·w, inner]`), 3D RoPE tables.
//! 2. [`CogVideoXBlock::forward`] for every block, in order, starting from
//!    [`BlockInputs::take_hidden_states`] (a block may also be built step by step, see
//!    [`BlockStep`]).
//! 3. [`CogVideoXTransformer3DModel::finish`]: final norms on the video tokens, `proj_out`,
//!    unpatchify to `[B, F, C, H, W]`.
//!
//! diffusers keeps no module of this model in float32, so every weight uses the `VarBuilder`
//! dtype; only the rotation of q and k is computed in f32, as diffusers' `apply_rotary_emb` does.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{LayerNorm, LayerNormConfig, Linear, VarBuilder};
use serde::Deserialize;

use crate::models::attention::sdpa;
use crate::models::blocks::HookedBlock;
use crate::models::patches::{text_len, token_grid, whole_patches};
use crate::models::projection::{Input, Projection};
#[cfg(feature = "cuda")]
use crate::models::row_ops::{self, BatchRow, Gate, Modulation, Rows};
#[cfg(feature = "cuda")]
use crate::models::step_cache::whole_output;
use crate::models::step_cache::{
    BlockHooks, ComputeAll, HookedBlocks, ModuleNames, Output, Submodule, Through,
};
use crate::models::video::{DitShape, VideoDit};
use crate::models::wan::transformer::timestep_embedding;

/// Epsilon of the per-head LayerNorm on q and k (fixed in diffusers' `CogVideoXBlock`).
const QK_NORM_EPS: f64 = 1e-6;

/// RoPE base frequency of diffusers' `get_3d_rotary_pos_embed`.
const ROPE_THETA: f32 = 10000.0;

/// `transformer/config.json` of a diffusers CogVideoX checkpoint; missing keys take diffusers'
/// defaults (those of `CogVideoXTransformer3DModel.__init__`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct CogVideoXTransformerConfig {
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Width of one head (also sets the t/h/w RoPE split).
    pub attention_head_dim: usize,
    /// Latent channels in.
    pub in_channels: usize,
    /// Latent channels out (`null` means `in_channels`).
    pub out_channels: Option<usize>,
    /// Sinusoid order of the timestep embedding (only `true`, cos first, is supported).
    pub flip_sin_to_cos: bool,
    /// Frequency shift of the timestep embedding (only 0 is supported).
    pub freq_shift: usize,
    /// Width of the time embedding that modulates every norm.
    pub time_embed_dim: usize,
    /// CogVideoX 1.5 image-to-video "ofs" embedding (not supported: must be null).
    pub ofs_embed_dim: Option<usize>,
    /// Width of the text-encoder embeddings.
    pub text_embed_dim: usize,
    /// Number of transformer blocks.
    pub num_layers: usize,
    /// Whether q, k and v projections have a bias.
    pub attention_bias: bool,
    /// Latent width the model was trained at: the base grid of the RoPE positions.
    pub sample_width: usize,
    /// Latent height the model was trained at: the base grid of the RoPE positions.
    pub sample_height: usize,
    /// Informational (only the positional-embedding variants use it).
    pub sample_frames: usize,
    /// Spatial patch size (Conv2d kernel = stride).
    pub patch_size: usize,
    /// Temporal patch size of CogVideoX 1.5 (not supported: must be null).
    pub patch_size_t: Option<usize>,
    /// Informational (only the positional-embedding variants use it).
    pub temporal_compression_ratio: usize,
    /// Informational (only the positional-embedding variants use it).
    pub max_text_seq_length: usize,
    /// Feed-forward activation (only `gelu-approximate`).
    pub activation_fn: String,
    /// Activation inside the time embedding (only `silu`).
    pub timestep_activation_fn: String,
    /// Whether the LayerNorms have a weight and bias.
    pub norm_elementwise_affine: bool,
    /// Epsilon of the block and output LayerNorms.
    pub norm_eps: f64,
    /// Informational (sincos positional embedding only).
    pub spatial_interpolation_scale: f64,
    /// Informational (sincos positional embedding only).
    pub temporal_interpolation_scale: f64,
    /// 3D RoPE on the video tokens (required: the CogVideoX-5b layout).
    pub use_rotary_positional_embeddings: bool,
    /// Learned positional embedding (not supported: must be false).
    pub use_learned_positional_embeddings: bool,
    /// Whether the patch-embedding convolution has a bias.
    pub patch_bias: bool,
    /// Dropout (inference ignores it).
    pub dropout: f64,
    /// Not in the file: the blocks' attention and feed-forward Linears run in fp8
    /// (`--fp8-matmul`, set by the pipeline); the modulations' and embedders' stay exact.
    #[serde(skip)]
    pub fp8_matmul: bool,
}

impl Default for CogVideoXTransformerConfig {
    fn default() -> Self {
        Self {
            num_attention_heads: 30,
            attention_head_dim: 64,
            in_channels: 16,
            out_channels: Some(16),
            flip_sin_to_cos: true,
            freq_shift: 0,
            time_embed_dim: 512,
            ofs_embed_dim: None,
            text_embed_dim: 4096,
            num_layers: 30,
            attention_bias: true,
            sample_width: 90,
            sample_height: 60,
            sample_frames: 49,
            patch_size: 2,
            patch_size_t: None,
            temporal_compression_ratio: 4,
            max_text_seq_length: 226,
            activation_fn: "gelu-approximate".into(),
            timestep_activation_fn: "silu".into(),
            norm_elementwise_affine: true,
            norm_eps: 1e-5,
            spatial_interpolation_scale: 1.875,
            temporal_interpolation_scale: 1.0,
            use_rotary_positional_embeddings: false,
            use_learned_positional_embeddings: false,
            patch_bias: true,
            dropout: 0.0,
            fp8_matmul: false,
        }
    }
}

impl CogVideoXTransformerConfig {
    /// Model width: heads x head dim.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Width of a block's feed-forward hidden layer (diffusers' `FeedForward`, mult 4).
    pub fn ff_dim(&self) -> usize {
        4 * self.inner_dim()
    }

    /// Output channels (`out_channels or in_channels`).
    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// RoPE split of a head into (frame, height, width) parts, as `get_3d_rotary_pos_embed`.
    pub fn rope_dims(&self) -> [usize; 3] {
        let d = self.attention_head_dim;
        [d / 4, d / 8 * 3, d / 8 * 3]
    }

    /// Rejects configurations this implementation cannot run, with the key at fault.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("num_attention_heads", self.num_attention_heads),
            ("attention_head_dim", self.attention_head_dim),
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels()),
            ("time_embed_dim", self.time_embed_dim),
            ("text_embed_dim", self.text_embed_dim),
            ("patch_size", self.patch_size),
            ("sample_height", self.sample_height),
            ("sample_width", self.sample_width),
        ];
        crate::models::config_checks::positive("transformer config", &positive)?;
        // The RoPE base grid is the training latent size in patches.
        if self.sample_height < self.patch_size || self.sample_width < self.patch_size {
            candle_core::bail!(
                "transformer config: sample_height {} and sample_width {} must be at least patch_size {}",
                self.sample_height,
                self.sample_width,
                self.patch_size
            );
        }
        if !self.use_rotary_positional_embeddings || self.use_learned_positional_embeddings {
            candle_core::bail!(
                "transformer config: use_rotary_positional_embeddings must be true and \
                 use_learned_positional_embeddings false (only the CogVideoX-5b layout is supported)"
            );
        }
        if self.patch_size_t.is_some() {
            candle_core::bail!(
                "transformer config: patch_size_t is set (CogVideoX 1.5 is not supported)"
            );
        }
        if self.ofs_embed_dim.is_some() {
            candle_core::bail!(
                "transformer config: ofs_embed_dim is set (CogVideoX 1.5 image-to-video is not supported)"
            );
        }
        if !self.attention_head_dim.is_multiple_of(16) {
            candle_core::bail!(
                "transformer config: attention_head_dim {} must be a multiple of 16 for the t/h/w RoPE split",
                self.attention_head_dim
            );
        }
        if !self.flip_sin_to_cos || self.freq_shift != 0 {
            candle_core::bail!(
                "transformer config: flip_sin_to_cos must be true and freq_shift 0 (got {} and {})",
                self.flip_sin_to_cos,
                self.freq_shift
            );
        }
        crate::models::config_checks::one_of(
            "transformer config",
            ("activation_fn", &self.activation_fn),
            &["gelu-approximate"],
        )?;
        crate::models::config_checks::one_of(
            "transformer config",
            ("timestep_activation_fn", &self.timestep_activation_fn),
            &["silu"],
        )?;
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            candle_core::bail!("transformer config: norm_eps must be a non-negative number");
        }
        Ok(())
    }
}

impl VideoDit for CogVideoXTransformerConfig {
    /// Latents `[1, F', C, H', W']`: frames before channels.
    fn dit_shape(&self) -> DitShape {
        let frames_first = true;
        DitShape {
            frames_first,
            ..DitShape::of(self.num_layers, self.inner_dim(), self.in_channels)
        }
    }
}

/// Everything the blocks and the output head need, computed once per forward by `prepare`.
#[derive(Debug, Clone)]
pub struct BlockInputs {
    hidden_states: Option<Tensor>,
    /// Time embedding `[B, time_embed_dim]` (model dtype): input of every modulation.
    pub temb: Tensor,
    /// RoPE cosines `[F·h·w, head_dim / 2]` in f32, one per interleaved pair.
    pub rope_cos: Tensor,
    /// RoPE sines, same layout as `rope_cos`.
    pub rope_sin: Tensor,
    /// Text tokens at the front of the joint sequence.
    pub text_len: usize,
    /// Batch size.
    pub batch: usize,
    /// Token grid (frames, height, width) after patching.
    pub grid: [usize; 3],
}

impl BlockInputs {
    /// Takes the joint sequence `[B, L + F·h·w, inner]` (text first) that feeds block 0; once.
    pub fn take_hidden_states(&mut self) -> Result<Tensor> {
        self.hidden_states
            .take()
            .ok_or_else(|| candle_core::Error::Msg("block-0 hidden states already taken".into()))
    }
}

/// A LayerNorm over the last dim; with `affine` false (diffusers' `elementwise_affine=False`)
/// the checkpoint holds no weight or bias for it.
fn layer_norm(dim: usize, eps: f64, affine: bool, vb: VarBuilder) -> Result<LayerNorm> {
    if affine {
        let config = LayerNormConfig {
            eps,
            ..Default::default()
        };
        candle_nn::layer_norm(dim, config, vb)
    } else {
        let ones = Tensor::ones(dim, vb.dtype(), vb.device())?;
        let zeros = Tensor::zeros(dim, vb.dtype(), vb.device())?;
        Ok(LayerNorm::new(ones, zeros, eps))
    }
}

/// The six `[B, 1, inner]` modulation vectors of diffusers' `CogVideoXLayerNormZero` (video
/// shift, scale, gate, then the same for text), and the shared LayerNorm.
#[derive(Debug, Clone)]
struct LayerNormZero {
    linear: Linear,
    norm: LayerNorm,
    /// `norm`'s epsilon, for the fused kernel.
    #[cfg(feature = "cuda")]
    eps: f64,
}

/// Output of [`LayerNormZero::forward`]: the normalised, modulated joint sequence and the gates
/// of the residual that follows, per stream.
struct Modulated {
    hidden_states: Tensor,
    video_gate: Tensor,
    text_gate: Tensor,
}

impl LayerNormZero {
    fn new(cfg: &CogVideoXTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let dim = cfg.inner_dim();
        Ok(Self {
            linear: candle_nn::linear(cfg.time_embed_dim, 6 * dim, vb.pp("linear"))?,
            norm: layer_norm(
                dim,
                cfg.norm_eps,
                cfg.norm_elementwise_affine,
                vb.pp("norm"),
            )?,
            #[cfg(feature = "cuda")]
            eps: cfg.norm_eps,
        })
    }

    /// The six modulation rows `[B, 6·inner]` (video shift, scale, gate, text shift, scale,
    /// gate).
    fn embedding(&self, temb: &Tensor) -> Result<Tensor> {
        self.linear.forward(&candle_nn::ops::silu(temb)?)
    }

    /// [`Self::forward`]'s modulated sequence as one fused kernel, on `x` `[B·S, inner]`
    /// (CUDA bf16); `emb` from [`Self::embedding`].
    #[cfg(feature = "cuda")]
    fn forward_fused(&self, x: &Tensor, emb: &Tensor, at: Rows, text_len: usize) -> Result<Tensor> {
        let dim = x.dim(1)?;
        let Some(bias) = self.norm.bias() else {
            candle_core::bail!("cogvideox LayerNormZero without a bias")
        };
        let modulation = Modulation {
            table: emb,
            stride: 6 * dim,
            shift: 0,
            scale: dim,
            text: Some((text_len, 3 * dim, 4 * dim)),
            rows: None,
        };
        row_ops::layer_norm_modulate(
            x,
            row_ops::LayerNorm::Fused {
                w: self.norm.weight(),
                b: bias,
            },
            Some(modulation),
            at,
            self.eps,
        )
    }

    /// `x` is the joint `[B, L + N, inner]` sequence; text tokens `0..text_len` take the `enc_`
    /// modulation, video tokens the other.
    fn forward(&self, x: &Tensor, temb: &Tensor, text_len: usize) -> Result<Modulated> {
        let (_, seq, dim) = x.dims3()?;
        let emb = self.embedding(temb)?;
        let m = |i: usize| emb.narrow(1, i * dim, dim)?.unsqueeze(1);
        let normed = self.norm.forward(x)?;
        let modulate = |part: Tensor, shift: Tensor, scale: Tensor| -> Result<Tensor> {
            part.broadcast_mul(&(scale + 1.0)?)?.broadcast_add(&shift)
        };
        let text = modulate(normed.narrow(1, 0, text_len)?, m(3)?, m(4)?)?;
        let video = modulate(normed.narrow(1, text_len, seq - text_len)?, m(0)?, m(1)?)?;
        Ok(Modulated {
            hidden_states: Tensor::cat(&[text, video], 1)?,
            video_gate: m(2)?,
            text_gate: m(5)?,
        })
    }
}

/// `x + gate · delta` per stream of the joint sequence (diffusers adds the gated attention and
/// feed-forward outputs to text and video separately).
fn gated_residual(x: &Tensor, delta: &Tensor, mods: &Modulated, text_len: usize) -> Result<Tensor> {
    let seq = x.dim(1)?;
    let part = |t: &Tensor, text: bool| {
        if text {
            t.narrow(1, 0, text_len)
        } else {
            t.narrow(1, text_len, seq - text_len)
        }
    };
    let text = (part(x, true)? + part(delta, true)?.broadcast_mul(&mods.text_gate)?)?;
    let video = (part(x, false)? + part(delta, false)?.broadcast_mul(&mods.video_gate)?)?;
    Tensor::cat(&[text, video], 1)
}

/// Full self-attention over the joint sequence with per-head LayerNorm on q and k and RoPE on
/// the video part (diffusers' `Attention` + `CogVideoXAttnProcessor2_0`).
#[derive(Debug, Clone)]
struct JointAttention {
    to_q: Projection,
    to_k: Projection,
    to_v: Projection,
    to_out: Projection,
    norm_q: LayerNorm,
    norm_k: LayerNorm,
    heads: usize,
    head_dim: usize,
}

impl JointAttention {
    fn new(cfg: &CogVideoXTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let dim = cfg.inner_dim();
        let head_dim = cfg.attention_head_dim;
        let fp8 = cfg.fp8_matmul;
        let qkv = |name: &str| -> Result<Projection> {
            let linear = candle_nn::linear_b(dim, dim, cfg.attention_bias, vb.pp(name))?;
            Ok(Projection::new(linear, fp8))
        };
        Ok(Self {
            to_q: qkv("to_q")?,
            to_k: qkv("to_k")?,
            to_v: qkv("to_v")?,
            to_out: Projection::load((dim, dim), vb.pp("to_out.0"), fp8)?,
            norm_q: layer_norm(head_dim, QK_NORM_EPS, true, vb.pp("norm_q"))?,
            norm_k: layer_norm(head_dim, QK_NORM_EPS, true, vb.pp("norm_k"))?,
            heads: cfg.num_attention_heads,
            head_dim,
        })
    }

    /// `[B, S, inner]` -> `[B, heads, S, head_dim]`.
    fn split_heads(&self, x: Tensor) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        x.reshape((b, s, self.heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    }

    /// LayerNorm per head, then the interleaved-pair rotation of the video tokens in f32.
    fn norm_rope(&self, x: Tensor, norm: &LayerNorm, inputs: &BlockInputs) -> Result<Tensor> {
        let x = norm.forward(&self.split_heads(x)?)?;
        let seq = x.dim(2)?;
        let text = x.narrow(2, 0, inputs.text_len)?;
        let video = x
            .narrow(2, inputs.text_len, seq - inputs.text_len)?
            .contiguous()?;
        let rotated = candle_nn::rotary_emb::rope_i(
            &video.to_dtype(DType::F32)?,
            &inputs.rope_cos,
            &inputs.rope_sin,
        )?
        .to_dtype(x.dtype())?;
        Tensor::cat(&[text, rotated], 2)
    }

    /// [`Self::forward`] on `x` `[B·S, inner]` (`b` batch entries) with the q/k bias, per-head
    /// LayerNorm and RoPE fused (CUDA bf16); returns `to_out` *without* its bias (the residual
    /// kernel adds it).
    #[cfg(feature = "cuda")]
    fn forward_fused(&self, x: &Tensor, b: usize, inputs: &BlockInputs) -> Result<Tensor> {
        let (rows, dim) = x.dims2()?;
        let s = rows / b;
        let at = Rows { row0: 0, seq: s };
        let rope = Some((&inputs.rope_cos, &inputs.rope_sin));
        // One input for q, k and v: quantized once under `--fp8-matmul`.
        let x = Input::new(x);
        let norm_rope = |linear: &Projection, norm: &LayerNorm| -> Result<Tensor> {
            let Some(norm_bias) = norm.bias() else {
                candle_core::bail!("cogvideox q/k LayerNorm without a bias")
            };
            row_ops::head_norm_rope(
                linear.product(&x)?,
                linear.bias(),
                norm.weight(),
                Some(norm_bias),
                rope,
                self.head_dim,
                inputs.text_len,
                at,
                QK_NORM_EPS,
            )
        };
        let q = norm_rope(&self.to_q, &self.norm_q)?;
        let k = norm_rope(&self.to_k, &self.norm_k)?;
        let v = self.to_v.apply(&x, false)?;
        let split = |t: Tensor| {
            t.reshape((b, s, self.heads, self.head_dim))?
                .transpose(1, 2)
        };
        let out = sdpa(
            &split(q)?,
            &split(k)?,
            &split(v)?,
            1.0 / (self.head_dim as f64).sqrt(),
        )?;
        let out = out.transpose(1, 2)?.reshape((rows, dim))?;
        self.to_out.product(&Input::new(&out))
    }

    /// `x` `[B, S, inner]` -> attention output after `to_out`, same shape.
    fn forward(&self, x: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        let (b, s, dim) = x.dims3()?;
        // One input for q, k and v: quantized once under `--fp8-matmul`.
        let x = Input::new(x);
        let q = self.norm_rope(self.to_q.apply(&x, false)?, &self.norm_q, inputs)?;
        let k = self.norm_rope(self.to_k.apply(&x, false)?, &self.norm_k, inputs)?;
        let v = self.split_heads(self.to_v.apply(&x, false)?)?;
        let out = sdpa(&q, &k, &v, 1.0 / (self.head_dim as f64).sqrt())?;
        let out = out.transpose(1, 2)?.reshape((b, s, dim))?;
        self.to_out.apply(&Input::new(&out), false)
    }
}

/// The steps of a block, in execution order. A block can be built with only some of them (an
/// offload engine streaming steps rather than whole blocks); running such a partial block
/// applies just its steps, with exactly the arithmetic of the whole block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockStep {
    /// `norm1` (modulated LayerNorm), joint self-attention with RoPE, gated residuals.
    Attention,
    /// `norm2` (modulated LayerNorm), GELU(tanh) feed-forward, gated residuals.
    FeedForward,
}

impl BlockStep {
    pub const ALL: [BlockStep; 2] = [BlockStep::Attention, BlockStep::FeedForward];
}

/// One `CogVideoXBlock` of diffusers (or some of its steps, see [`BlockStep`]), on the joint
/// (text first) sequence.
#[derive(Debug, Clone)]
pub struct CogVideoXBlock {
    attention: Option<(LayerNormZero, JointAttention)>,
    /// `norm2` and the feed-forward Linear -> GELU(tanh) -> Linear.
    feed_forward: Option<(LayerNormZero, Projection, Projection)>,
}

impl CogVideoXBlock {
    /// Loads one block; `vb` points at `transformer_blocks.{i}`.
    pub fn new(cfg: &CogVideoXTransformerConfig, vb: VarBuilder) -> Result<Self> {
        Self::with_steps(cfg, vb, &BlockStep::ALL)
    }

    /// Loads only the weights of `steps`; `vb` points at `transformer_blocks.{i}`.
    pub fn with_steps(
        cfg: &CogVideoXTransformerConfig,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self> {
        cfg.validate()?;
        let (dim, ff_dim, fp8) = (cfg.inner_dim(), cfg.ff_dim(), cfg.fp8_matmul);
        let attention = if steps.contains(&BlockStep::Attention) {
            Some((
                LayerNormZero::new(cfg, vb.pp("norm1"))?,
                JointAttention::new(cfg, vb.pp("attn1"))?,
            ))
        } else {
            None
        };
        let feed_forward = if steps.contains(&BlockStep::FeedForward) {
            Some((
                LayerNormZero::new(cfg, vb.pp("norm2"))?,
                Projection::load((dim, ff_dim), vb.pp("ff.net.0.proj"), fp8)?,
                Projection::load((ff_dim, dim), vb.pp("ff.net.2"), fp8)?,
            ))
        } else {
            None
        };
        Ok(Self {
            attention,
            feed_forward,
        })
    }

    /// Runs the block's steps on the joint sequence `x` `[B, L + N, inner]`; returns the same
    /// shape. Fused kernels on CUDA bf16, else the candle composition (the same ops in the
    /// same order).
    pub fn forward(&self, x: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        self.forward_hooked(x, inputs, &mut ComputeAll)
    }

    /// [`Self::forward`] as fused kernels: each modulated LayerNorm, q/k bias + per-head norm +
    /// RoPE, bias + GELU and bias + gate + residual is one pass over bf16 storage.
    #[cfg(feature = "cuda")]
    fn forward_fused(
        &self,
        x: &Tensor,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Tensor> {
        let (b, seq, dim) = x.dims3()?;
        let text_len = inputs.text_len;
        let at = Rows { row0: 0, seq };
        // The video gate (row 2) and, before `text_len`, the text gate (row 5) of `emb`.
        fn gate(emb: &Tensor, dim: usize, text_len: usize) -> BatchRow<'_> {
            BatchRow {
                table: emb,
                stride: 6 * dim,
                offset: 2 * dim,
                text: Some((text_len, 5 * dim)),
                rows: None,
            }
        }
        let mut x = x.reshape((b * seq, dim))?;
        if let Some((norm1, attn1)) = &self.attention {
            let emb = norm1.embedding(&inputs.temb)?;
            let h = norm1.forward_fused(&x, &emb, at, text_len)?;
            let compute = || attn1.forward_fused(&h, b, inputs);
            let module = Submodule::SelfAttention;
            let (attn, bias) = whole_output(hooks, module, compute, attn1.to_out.bias())?;
            x = row_ops::residual_into_delta(
                &x,
                attn,
                bias,
                Some(Gate::Bf16(gate(&emb, dim, text_len))),
                at,
            )?;
        }
        if let Some((norm2, fc1, fc2)) = &self.feed_forward {
            let emb = norm2.embedding(&inputs.temb)?;
            let h = norm2.forward_fused(&x, &emb, at, text_len)?;
            let compute = || fc2.product(&Input::new(&fc1.apply(&Input::new(&h), true)?));
            let (ff, bias) = whole_output(hooks, Submodule::FeedForward, compute, fc2.bias())?;
            x = row_ops::residual_into_delta(
                &x,
                ff,
                bias,
                Some(Gate::Bf16(gate(&emb, dim, text_len))),
                at,
            )?;
        }
        x.reshape((b, seq, dim))
    }

    /// [`Self::forward`] as candle ops (CPU, f32, other dtypes).
    fn forward_composite(
        &self,
        x: &Tensor,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Tensor> {
        let text_len = inputs.text_len;
        let mut x = x.clone();
        if let Some((norm1, attn1)) = &self.attention {
            let mods = norm1.forward(&x, &inputs.temb, text_len)?;
            let attn = hooks.output(Submodule::SelfAttention, &mut || {
                attn1.forward(&mods.hidden_states, inputs)
            })?;
            x = gated_residual(&x, &attn, &mods, text_len)?;
        }
        if let Some((norm2, fc1, fc2)) = &self.feed_forward {
            let mods = norm2.forward(&x, &inputs.temb, text_len)?;
            let ff = hooks.output(Submodule::FeedForward, &mut || {
                let h = fc1.apply(&Input::new(&mods.hidden_states), true)?;
                fc2.apply(&Input::new(&h), false)
            })?;
            x = gated_residual(&x, &ff, &mods, text_len)?;
        }
        Ok(x)
    }
}

/// diffusers' `get_resize_crop_region_for_grid`: where a `(h, w)` token grid lands when resized
/// into the `base_h x base_w` grid the model was trained at, as `((top, left), (bottom, right))`.
/// Python's `round` (ties to even) included.
pub fn resize_crop_region(
    grid: (usize, usize),
    base_w: usize,
    base_h: usize,
) -> ((usize, usize), (usize, usize)) {
    let (h, w) = (grid.0 as f64, grid.1 as f64);
    let (tw, th) = (base_w as f64, base_h as f64);
    let (resize_h, resize_w) = if h / w > th / tw {
        (th, (th / h * w).round_ties_even())
    } else {
        ((tw / w * h).round_ties_even(), tw)
    };
    let top = ((th - resize_h) / 2.0).round_ties_even();
    let left = ((tw - resize_w) / 2.0).round_ties_even();
    // Non-negative by construction: resize_h <= th and resize_w <= tw.
    let (top, left) = (top.max(0.0) as usize, left.max(0.0) as usize);
    (
        (top, left),
        (top + resize_h as usize, left + resize_w as usize),
    )
}

/// `torch.linspace(start, end, steps, dtype=float32)` with torch's CPU formula (from the start
/// for the first half, from the end for the second).
pub(crate) fn linspace_f32(start: f64, end: f64, steps: usize) -> Vec<f32> {
    let (start, end) = (start as f32, end as f32);
    if steps <= 1 {
        return vec![start; steps];
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

/// Per-axis RoPE table `[positions, dim / 2]` (cos, sin) in f32 as diffusers'
/// `get_1d_rotary_pos_embed(dim, pos, use_real=True)` with its float32 frequencies.
fn rope_axis(dim: usize, positions: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let inv_freq: Vec<f32> = (0..dim / 2)
        .map(|j| {
            let exponent = (2 * j) as f32 / dim as f32;
            1.0 / (f64::from(ROPE_THETA).powf(f64::from(exponent)) as f32)
        })
        .collect();
    let mut cos = Vec::with_capacity(positions.len() * inv_freq.len());
    let mut sin = Vec::with_capacity(positions.len() * inv_freq.len());
    for &p in positions {
        for &f in &inv_freq {
            let angle = f64::from(p * f);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// The 3D RoPE tables of CogVideoX 1.0 (`CogVideoXPipeline._prepare_rotary_positional_embeddings`)
/// for a `(frames, grid_h, grid_w)` token grid: `[F·h·w, head_dim / 2]` (cos, sin) in f32, one
/// angle per interleaved pair, the t | h | w parts concatenated per token. Frame positions are
/// `0..F`; row and column positions are the fractional positions of the grid resized into the
/// training grid (`sample_height / patch`, `sample_width / patch`).
pub fn rotary_embedding(
    cfg: &CogVideoXTransformerConfig,
    grid: [usize; 3],
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let [frames, gh, gw] = grid;
    let base_h = cfg.sample_height / cfg.patch_size;
    let base_w = cfg.sample_width / cfg.patch_size;
    if grid.contains(&0) || base_h == 0 || base_w == 0 {
        candle_core::bail!("rotary embedding: empty token grid {grid:?} or training grid");
    }
    let ((top, left), (bottom, right)) = resize_crop_region((gh, gw), base_w, base_h);
    let end = |stop: usize, n: usize| (stop * (n - 1)) as f64 / n as f64;
    let pos_t = linspace_f32(0.0, end(frames, frames), frames);
    let pos_h = linspace_f32(top as f64, end(bottom, gh), gh);
    let pos_w = linspace_f32(left as f64, end(right, gw), gw);
    let [dt, dh, dw] = cfg.rope_dims();
    let tables = [
        rope_axis(dt, &pos_t),
        rope_axis(dh, &pos_h),
        rope_axis(dw, &pos_w),
    ];
    let halves = [dt / 2, dh / 2, dw / 2];
    let half = cfg.attention_head_dim / 2;
    let tokens = frames * gh * gw;
    let mut cos = Vec::with_capacity(tokens * half);
    let mut sin = Vec::with_capacity(tokens * half);
    for f in 0..frames {
        for y in 0..gh {
            for x in 0..gw {
                for (axis, pos) in [f, y, x].into_iter().enumerate() {
                    let n = halves[axis];
                    let (c, s) = &tables[axis];
                    cos.extend_from_slice(&c[pos * n..(pos + 1) * n]);
                    sin.extend_from_slice(&s[pos * n..(pos + 1) * n]);
                }
            }
        }
    }
    Ok((
        Tensor::from_vec(cos, (tokens, half), device)?,
        Tensor::from_vec(sin, (tokens, half), device)?,
    ))
}

/// The diffusers `CogVideoXTransformer3DModel` (CogVideoX 1.0 with RoPE, e.g. CogVideoX-5b).
#[derive(Debug, Clone)]
pub struct CogVideoXTransformer3DModel {
    cfg: CogVideoXTransformerConfig,
    /// `patch_embed.text_proj`.
    text_proj: Linear,
    /// `patch_embed.proj`: Conv2d with kernel = stride = patch, as a linear over patches.
    patch_proj: Linear,
    /// `time_embedding`: linear_1 -> SiLU -> linear_2.
    time_embedding: (Linear, Linear),
    blocks: Vec<CogVideoXBlock>,
    norm_final: LayerNorm,
    /// `norm_out` (AdaLayerNorm): Linear(SiLU(temb)) -> shift, scale; then its LayerNorm.
    norm_out_linear: Linear,
    norm_out_norm: LayerNorm,
    proj_out: Linear,
    dtype: DType,
}

impl CogVideoXTransformer3DModel {
    /// Loads the whole model, blocks included.
    pub fn new(cfg: &CogVideoXTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads everything except the blocks (for an engine that streams blocks itself, building
    /// each with [`CogVideoXBlock::new`] from `vb.pp("transformer_blocks.{i}")`); `blocks()` is
    /// then empty and `forward` refuses to run.
    pub fn new_without_blocks(cfg: &CogVideoXTransformerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let p = cfg.patch_size;
        let pvb = vb.pp("patch_embed");
        let patch_w = pvb
            .get((dim, cfg.in_channels, p, p), "proj.weight")?
            .reshape((dim, cfg.in_channels * p * p))?;
        let patch_b = if cfg.patch_bias {
            Some(pvb.get(dim, "proj.bias")?)
        } else {
            None
        };
        let tvb = vb.pp("time_embedding");
        let affine = cfg.norm_elementwise_affine;
        Ok(Self {
            cfg: cfg.clone(),
            text_proj: candle_nn::linear(cfg.text_embed_dim, dim, pvb.pp("text_proj"))?,
            patch_proj: Linear::new(patch_w, patch_b),
            time_embedding: (
                candle_nn::linear(dim, cfg.time_embed_dim, tvb.pp("linear_1"))?,
                candle_nn::linear(cfg.time_embed_dim, cfg.time_embed_dim, tvb.pp("linear_2"))?,
            ),
            blocks: Vec::new(),
            norm_final: layer_norm(dim, cfg.norm_eps, affine, vb.pp("norm_final"))?,
            norm_out_linear: candle_nn::linear(
                cfg.time_embed_dim,
                2 * dim,
                vb.pp("norm_out.linear"),
            )?,
            norm_out_norm: layer_norm(dim, cfg.norm_eps, affine, vb.pp("norm_out.norm"))?,
            proj_out: candle_nn::linear(dim, p * p * cfg.out_channels(), vb.pp("proj_out"))?,
            dtype: vb.dtype(),
        })
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &CogVideoXTransformerConfig {
        &self.cfg
    }

    /// The loaded blocks, in execution order (empty after `new_without_blocks`).
    pub fn blocks(&self) -> &[CogVideoXBlock] {
        &self.blocks
    }

    /// Time embedding, joint sequence and RoPE tables for `latents` `[B, F, C, H, W]` (frames
    /// before channels, as the CogVideoX pipeline keeps them), `timestep` `[B]` (or one value;
    /// any dtype) and `encoder_hidden_states` `[B, L, text_embed_dim]` (all L tokens attended).
    pub fn prepare(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
    ) -> Result<BlockInputs> {
        let cfg = &self.cfg;
        let p = cfg.patch_size;
        // Frames before channels: the patches of the channels-second view.
        let latents = latents.transpose(1, 2)?;
        let (b, grid) = token_grid(&latents, cfg.in_channels, [1, p, p])?;
        let text_len = text_len(
            encoder_hidden_states,
            b,
            ("text_embed_dim", cfg.text_embed_dim),
        )?;
        let device = latents.device();

        // Time embedding: sinusoid in f32, cast to the model dtype, then the MLP.
        let timestep = match timestep.elem_count() {
            1 if b > 1 => timestep.flatten_all()?.repeat(b)?,
            n if n == b => timestep.flatten_all()?,
            n => candle_core::bail!("timestep has {n} values for a batch of {b}"),
        };
        let t_emb = timestep_embedding(&timestep.to_device(device)?, cfg.inner_dim())?
            .to_dtype(self.dtype)?;
        let (lin1, lin2) = &self.time_embedding;
        let temb = lin2.forward(&candle_nn::ops::silu(&lin1.forward(&t_emb)?)?)?;

        // Joint sequence: projected text, then per-frame patches in (f, h, w) order.
        let text = self
            .text_proj
            .forward(&encoder_hidden_states.to_dtype(self.dtype)?)?;
        let patches = whole_patches(&latents.to_dtype(self.dtype)?, [1, p, p])?;
        let video = self.patch_proj.forward(&patches)?;
        let hidden_states = Tensor::cat(&[text, video], 1)?;

        let (rope_cos, rope_sin) = rotary_embedding(cfg, grid, device)?;
        Ok(BlockInputs {
            hidden_states: Some(hidden_states),
            temb,
            rope_cos,
            rope_sin,
            text_len,
            batch: b,
            grid,
        })
    }

    /// `norm_final` and the AdaLayerNorm on the video tokens of the joint sequence `x`, then
    /// `proj_out`: `[B, F·h·w, p·p·C_out]`, before unpatchifying.
    pub fn head(&self, x: &Tensor, inputs: &BlockInputs, project: &mut Through) -> Result<Tensor> {
        let seq = x.dim(1)?;
        let dim = self.cfg.inner_dim();
        let video = x.narrow(1, inputs.text_len, seq - inputs.text_len)?;
        let video = self.norm_final.forward(&video)?;
        let emb = self
            .norm_out_linear
            .forward(&candle_nn::ops::silu(&inputs.temb)?)?;
        let shift = emb.narrow(1, 0, dim)?.unsqueeze(1)?;
        let scale = emb.narrow(1, dim, dim)?.unsqueeze(1)?;
        let video = self
            .norm_out_norm
            .forward(&video)?
            .broadcast_mul(&(scale + 1.0)?)?
            .broadcast_add(&shift)?;
        project(&mut || self.proj_out.forward(&video))
    }

    /// Output head and unpatchify: joint `[B, L + N, inner]` -> `[B, F, C_out, H, W]`.
    pub fn finish(&self, x: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        self.finish_projecting(x, inputs, &mut |compute| compute())
    }

    /// [`Self::finish`], the output projection's output through `project` (a step cache's,
    /// which may stand in for it).
    pub fn finish_projecting(
        &self,
        x: &Tensor,
        inputs: &BlockInputs,
        project: &mut Through,
    ) -> Result<Tensor> {
        let out = self.head(x, inputs, project)?;
        let p = self.cfg.patch_size;
        let [f, gh, gw] = inputs.grid;
        let oc = self.cfg.out_channels();
        out.reshape(vec![inputs.batch, f, gh, gw, oc, p, p])?
            .permute(vec![0, 1, 4, 2, 5, 3, 6])?
            .reshape((inputs.batch, f, oc, gh * p, gw * p))
    }

    /// Full forward: `prepare`, every block, `finish`. Needs a model built with `new`.
    pub fn forward(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
    ) -> Result<Tensor> {
        let inputs = self.prepare(latents, timestep, encoder_hidden_states)?;
        crate::models::blocks::BlockForward::forward_resident(self, inputs)
    }
}

// Placed by the block protocol: `transformer_blocks.{i}`, each streamed whole or step by step.
/// The modules diffusers' layerwise casting leaves alone in `CogVideoXTransformer3DModel` (its
/// `_skip_layerwise_casting_patterns`).
const LAYERWISE_CASTING_SKIP: &[&str] = &["patch_embed", "norm"];

crate::repeated_blocks!(
    CogVideoXTransformer3DModel,
    CogVideoXTransformerConfig,
    CogVideoXBlock,
    BlockStep,
    "transformer_blocks",
    skip: LAYERWISE_CASTING_SKIP
);

crate::block_forward!(
    CogVideoXTransformer3DModel, BlockInputs, take_hidden_states, Tensor,
    |m, x, inputs| m.finish(&x, inputs) => Tensor
);

impl HookedBlock<Tensor, BlockInputs> for CogVideoXBlock {
    /// [`Self::forward`], asking `hooks` (a step cache) for `attn1`'s output: the joint
    /// sequence's attention after `to_out`, its bias included (diffusers' `attn1` module).
    fn forward_hooked(
        &self,
        x: &Tensor,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if row_ops::rows_supported(x)
            && inputs.temb.dtype() == DType::BF16
            && self.attention.as_ref().is_none_or(|(_, a)| {
                a.head_dim <= row_ops::MAX_HEAD_DIM && a.head_dim.is_multiple_of(2)
            })
        {
            return self.forward_fused(x, inputs, hooks);
        }
        self.forward_composite(x, inputs, hooks)
    }
}

/// How diffusers names what its cache hooks see: `transformer_blocks`, and in each its joint
/// self-attention `attn1` (PAB's spatial attention) and its feed-forward `ff`.
pub(super) const CACHE_NAMES: ModuleNames =
    ModuleNames::transformer_blocks(&[(Output::Attention, "attn1"), (Output::FeedForward, "ff")]);

/// diffusers' cache hooks see `transformer_blocks`, each returning the video tokens
/// (`hidden_states`) and the text (`encoder_hidden_states`): the joint sequence's two parts.
impl crate::models::blocks::CachedForward for CogVideoXTransformer3DModel {
    fn finish_hooked(
        &self,
        x: Tensor,
        inputs: &BlockInputs,
        project: &mut Through,
    ) -> Result<Tensor> {
        self.finish_projecting(&x, inputs, project)
    }

    fn hooked_blocks(&self) -> HookedBlocks {
        crate::models::video::DenoiseActivations::hooked_blocks(&self.cfg)
    }

    fn streams(x: &Tensor, inputs: &BlockInputs) -> Result<Vec<Tensor>> {
        let video = x.dim(1)? - inputs.text_len;
        Ok(vec![
            x.narrow(1, inputs.text_len, video)?,
            x.narrow(1, 0, inputs.text_len)?,
        ])
    }

    fn state(streams: Vec<Tensor>, _: &BlockInputs) -> Result<Tensor> {
        match &streams[..] {
            [video, text] => Tensor::cat(&[text, video], 1),
            _ => candle_core::bail!("CogVideoX's blocks thread two streams"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crop_region_matches_diffusers() {
        // 5b at 480x720: the token grid is the training grid.
        assert_eq!(resize_crop_region((30, 45), 45, 30), ((0, 0), (30, 45)));
        // The tiny fixture's 2x3 grid has the same aspect ratio.
        assert_eq!(resize_crop_region((2, 3), 45, 30), ((0, 0), (30, 45)));
        // A square grid: full height, centred columns (round(7.5) = 8, ties to even).
        assert_eq!(resize_crop_region((10, 10), 45, 30), ((0, 8), (30, 38)));
    }

    #[test]
    fn linspace_matches_torch() {
        assert_eq!(linspace_f32(0.0, 15.0, 2), vec![0.0, 15.0]);
        assert_eq!(linspace_f32(0.0, 30.0, 3), vec![0.0, 15.0, 30.0]);
        assert_eq!(linspace_f32(0.0, 4.0, 5), vec![0.0, 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(linspace_f32(3.0, 9.0, 1), vec![3.0]);
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    //! Each fused path against the candle composition it replaces, on random bf16 inputs of
    //! CogVideoX-5b 720x480x49 sizes (226 text + 13·30·45 video tokens of 48x64), on the GPU.
    use super::*;
    use crate::models::row_ops::test_util::{
        assert_within_ulp, assert_within_ulp_carrying, device, randn,
    };

    const TEXT: usize = 226;
    const VIDEO: usize = 13 * 30 * 45;

    fn config() -> CogVideoXTransformerConfig {
        // CogVideoX-5b: 48 heads and 3D rotary embeddings.
        CogVideoXTransformerConfig {
            num_attention_heads: 48,
            use_rotary_positional_embeddings: true,
            ..Default::default()
        }
    }

    /// Loads `build` from random weights (the VarMap's init, with norms and biases drawn too).
    fn random<T>(dev: &Device, build: impl FnOnce(VarBuilder) -> Result<T>) -> Result<T> {
        let map = candle_nn::VarMap::new();
        let built = build(VarBuilder::from_varmap(&map, DType::BF16, dev))?;
        for (name, var) in map.data().lock().expect("varmap lock").iter() {
            if (name.contains("norm") && !name.contains("linear")) || name.ends_with("bias") {
                var.set(&randn(var.dims(), 0.5, dev)?)?;
            }
        }
        Ok(built)
    }

    fn inputs(b: usize, video: usize, dev: &Device) -> Result<BlockInputs> {
        let half = config().attention_head_dim / 2;
        let angles = Tensor::rand(0f32, 6.3, (video, half), dev)?;
        Ok(BlockInputs {
            hidden_states: None,
            temb: randn(&[b, config().time_embed_dim], 1.0, dev)?,
            rope_cos: angles.cos()?,
            rope_sin: angles.sin()?,
            text_len: TEXT,
            batch: b,
            grid: [1, 1, video],
        })
    }

    #[test]
    fn layer_norm_zero_matches_composite() -> Result<()> {
        let Some(dev) = device("CogVideoX fused kernels") else {
            return Ok(());
        };
        let cfg = config();
        let dim = cfg.inner_dim();
        let norm = random(&dev, |vb| LayerNormZero::new(&cfg, vb))?;
        for (b, video) in [(1, VIDEO), (2, 1350)] {
            let seq = TEXT + video;
            let inputs = inputs(b, video, &dev)?;
            let x = (randn(&[b, seq, dim], 1.0, &dev)? * 3.0)?;
            let want = norm.forward(&x, &inputs.temb, TEXT)?.hidden_states;
            let emb = norm.embedding(&inputs.temb)?;
            let got = norm.forward_fused(
                &x.reshape((b * seq, dim))?,
                &emb,
                Rows { row0: 0, seq },
                TEXT,
            )?;
            // The last rounded step adds the shift to n·(1 + scale): bound by that term, plus
            // a one-ulp flip of the norm n carried through 1 + scale.
            let row = |i: usize, len: usize| {
                emb.narrow(1, i * dim, dim)?
                    .unsqueeze(1)?
                    .broadcast_as((b, len, dim))
            };
            let shift = Tensor::cat(&[row(3, TEXT)?, row(0, video)?], 1)?;
            let gain = (Tensor::cat(&[row(4, TEXT)?, row(1, video)?], 1)? + 1.0)?;
            let normed = norm.norm.forward(&x)?;
            let term = (want.to_dtype(DType::F32)? - shift.to_dtype(DType::F32)?)?;
            let what = format!("LayerNormZero b={b}");
            let got = got.reshape((b, seq, dim))?;
            assert_within_ulp_carrying(&got, &want, &term, (&normed, &gain), &what)?;
        }
        Ok(())
    }

    #[test]
    fn qk_head_norm_rope_matches_composite() -> Result<()> {
        let Some(dev) = device("CogVideoX fused kernels") else {
            return Ok(());
        };
        let cfg = config();
        let (dim, heads, head_dim) = (cfg.inner_dim(), 48, cfg.attention_head_dim);
        let attn = random(&dev, |vb| JointAttention::new(&cfg, vb))?;
        for (b, video) in [(1, VIDEO), (2, 1350)] {
            let seq = TEXT + video;
            let inputs = inputs(b, video, &dev)?;
            // A projection without its bias; both paths add `to_q`'s.
            let p = randn(&[b, seq, dim], 1.0, &dev)?;
            let bias = attn.to_q.bias().expect("to_q has a bias");
            let biased = p.broadcast_add(bias)?;
            let want = attn.norm_rope(biased.clone(), &attn.norm_q, &inputs)?;
            // A rotated pair mixes both members: bound by the larger normalised one.
            let normed = attn.norm_q.forward(&attn.split_heads(biased)?)?;
            let term = normed
                .abs()?
                .reshape((b, heads, seq, head_dim / 2, 2))?
                .max_keepdim(4)?
                .broadcast_as((b, heads, seq, head_dim / 2, 2))?
                .reshape((b, heads, seq, head_dim))?;
            let got = row_ops::head_norm_rope(
                p.reshape((b * seq, dim))?,
                Some(bias),
                attn.norm_q.weight(),
                attn.norm_q.bias(),
                Some((&inputs.rope_cos, &inputs.rope_sin)),
                head_dim,
                TEXT,
                Rows { row0: 0, seq },
                QK_NORM_EPS,
            )?
            .reshape((b, seq, heads, head_dim))?
            .transpose(1, 2)?;
            let what = format!("q norm + RoPE b={b}");
            assert_within_ulp(&got, &want, &term, &what)?;
        }
        Ok(())
    }

    #[test]
    fn block_fused_matches_composite() -> Result<()> {
        let Some(dev) = device("CogVideoX fused block") else {
            return Ok(());
        };
        let cfg = config();
        let (b, video) = (2, 1350);
        let block = random(&dev, |vb| CogVideoXBlock::new(&cfg, vb))?;
        let inputs = inputs(b, video, &dev)?;
        let x = randn(&[b, TEXT + video, cfg.inner_dim()], 1.0, &dev)?;
        let fused = block.forward(&x, &inputs)?.to_dtype(DType::F32)?;
        let composite = block
            .forward_composite(&x, &inputs, &mut ComputeAll)?
            .to_dtype(DType::F32)?;
        // GEMMs and attention follow each kernel, so a one-ulp flip inside can grow: compare
        // the relative L2 error instead, bf16-sized.
        let err = ((&fused - &composite)?.sqr()?.sum_all()?.sqrt()?
            / composite.sqr()?.sum_all()?.sqrt()?)?
        .to_scalar::<f32>()?;
        eprintln!("CogVideoX block fused vs composite: relative L2 error {err}");
        assert!(err < 1e-2, "relative L2 error {err}");

        // A step cache hooking `attn1` and `ff`: their whole joint outputs (bias included)
        // computed once, the block's result that of the unhooked block; then reused, the same
        // bits.
        let mut hooks = crate::models::step_cache::ReplayHooks::default();
        let hooked = block
            .forward_hooked(&x, &inputs, &mut hooks)?
            .to_dtype(DType::F32)?;
        let err = ((&hooked - &fused)?.sqr()?.sum_all()?.sqrt()?
            / fused.sqr()?.sum_all()?.sqrt()?)?
        .to_scalar::<f32>()?;
        assert!(err < 1e-2, "hooked: relative L2 error {err}");
        let reused = block.forward_hooked(&x, &inputs, &mut hooks)?;
        let gap = (reused.to_dtype(DType::F32)? - &hooked)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(gap, 0.0, "reused output");
        let once = [Submodule::SelfAttention, Submodule::FeedForward];
        assert_eq!(hooks.asked, [once, once].concat());
        Ok(())
    }
}
