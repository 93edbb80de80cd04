//! Allegro's diffusion transformer (diffusers `AllegroTransformer3DModel`): PixArt-α blocks
//! over every token of the video at once (self-attention with a 3-D rotary embedding,
//! cross-attention to the caption with its padding masked, feed-forward), modulated by one
//! `AdaLayerNormSingle`.
//!
//! The hidden state is `[B, F·h·w, D]` (frame-major, then rows, then columns). The forward is
//! split for streaming: [`AllegroTransformer3DModel::prepare`], the blocks
//! ([`AllegroBlock::forward`]), then [`AllegroTransformer3DModel::finish`]. Every weight uses
//! the `VarBuilder` dtype; the rotary tables are f32 as diffusers computes them.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;

use crate::models::attention::{mask_prefix_lens, sdpa, sdpa_key_prefix, sdpa_with_bias};
use crate::models::blocks::{Blockwise, HookedBlock};
use crate::models::patches::{text_len, token_grid, unpatchify_channels_last, whole_patches};
use crate::models::pixart::{
    AdaLayerNormSingle, Attention, Block, BlockAttention, BlockShape, CaptionProjection, OutputHead,
};
#[cfg(feature = "cuda")]
use crate::models::row_ops::{self, Rows};
use crate::models::step_cache::{BlockHooks, ComputeAll, ModuleNames, Output, Through};
use crate::models::video::{DitShape, VideoDit};

/// θ of the rotary embedding (`get_3d_rotary_pos_embed_allegro`'s default).
const ROPE_THETA: f32 = 10000.0;

/// The bias diffusers adds to the scores of masked caption tokens.
const MASKED_KEY_BIAS: f64 = -10000.0;

/// `transformer/config.json` of an `AllegroTransformer3DModel`, with diffusers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct AllegroTransformerConfig {
    /// Side of a square patch of latent pixels per token.
    pub patch_size: usize,
    /// Frames per token (only 1: the patch embedding works per frame).
    pub patch_size_t: usize,
    /// Heads of every attention.
    pub num_attention_heads: usize,
    /// Width of a head: split in thirds (frame, row, column) by the rotary embedding.
    pub attention_head_dim: usize,
    /// Latent channels in.
    pub in_channels: usize,
    /// Channels out.
    pub out_channels: usize,
    /// Blocks.
    pub num_layers: usize,
    /// Informational (inference runs no dropout).
    pub dropout: f64,
    /// Width the cross-attention's keys and values are projected from (the projected caption).
    pub cross_attention_dim: usize,
    /// Biases on q, k and v.
    pub attention_bias: bool,
    /// Latent rows of training: the default height (× the VAE's factor).
    pub sample_height: usize,
    /// Latent columns of training: the default width.
    pub sample_width: usize,
    /// Latent frames of training: the default frame count (× the VAE's temporal factor).
    pub sample_frames: usize,
    /// Only `gelu-approximate`.
    pub activation_fn: String,
    /// Whether the blocks' LayerNorms have weights.
    pub norm_elementwise_affine: bool,
    /// Epsilon of the blocks' LayerNorms.
    pub norm_eps: f64,
    /// Width of the text encoder's states.
    pub caption_channels: usize,
    /// Positions of the rotary embedding are grid index / this, per axis.
    pub interpolation_scale_h: f64,
    pub interpolation_scale_w: f64,
    pub interpolation_scale_t: f64,
    /// Not in the file: the blocks' attention and feed-forward Linears run in fp8
    /// (`--fp8-matmul`, set by the pipeline).
    #[serde(skip)]
    pub fp8_matmul: bool,
}

impl Default for AllegroTransformerConfig {
    fn default() -> Self {
        // The defaults of `AllegroTransformer3DModel.__init__`.
        Self {
            patch_size: 2,
            patch_size_t: 1,
            num_attention_heads: 24,
            attention_head_dim: 96,
            in_channels: 4,
            out_channels: 4,
            num_layers: 32,
            dropout: 0.0,
            cross_attention_dim: 2304,
            attention_bias: true,
            sample_height: 90,
            sample_width: 160,
            sample_frames: 22,
            activation_fn: "gelu-approximate".into(),
            norm_elementwise_affine: false,
            norm_eps: 1e-6,
            caption_channels: 4096,
            interpolation_scale_h: 2.0,
            interpolation_scale_w: 2.0,
            interpolation_scale_t: 2.2,
            fp8_matmul: false,
        }
    }
}

impl AllegroTransformerConfig {
    /// The sizes of every block (all alike).
    pub fn block_shape(&self) -> BlockShape {
        BlockShape::new(
            (self.num_attention_heads, self.attention_head_dim),
            self.attention_bias,
            (self.norm_eps, self.norm_elementwise_affine),
            Some(self.cross_attention_dim),
        )
        .in_fp8(self.fp8_matmul)
    }

    /// Video tokens of a latent grid `[F, h, w]`: every frame patched.
    pub fn video_tokens(&self, grid: [usize; 3]) -> usize {
        let p = self.patch_size.max(1);
        grid[0] * (grid[1] / p) * (grid[2] / p)
    }

    /// Width of the hidden states (saturating: `validate` bounds it).
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads
            .saturating_mul(self.attention_head_dim)
    }

    /// Rejects configurations this model cannot run, with the key at fault.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("patch_size", self.patch_size),
            ("num_attention_heads", self.num_attention_heads),
            ("attention_head_dim", self.attention_head_dim),
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("num_layers", self.num_layers),
            ("caption_channels", self.caption_channels),
            ("sample_height", self.sample_height),
            ("sample_width", self.sample_width),
            ("sample_frames", self.sample_frames),
        ];
        crate::models::config_checks::positive("transformer config", &sizes)?;
        let inner = [("inner width", self.inner_dim())];
        if let Some((key, _)) = sizes.iter().chain(&inner).find(|(_, v)| *v > 1 << 16) {
            candle_core::bail!("transformer config: {key} must be at most 65536");
        }
        if self.patch_size_t != 1 {
            candle_core::bail!(
                "transformer config: patch_size_t {} is not supported (only 1: AllegroTransformer3DModel embeds patches frame by frame)",
                self.patch_size_t
            );
        }
        if !self.attention_head_dim.is_multiple_of(6) {
            candle_core::bail!(
                "transformer config: attention_head_dim {} must be a multiple of 6 (three rotary axes of even width)",
                self.attention_head_dim
            );
        }
        if self.cross_attention_dim != self.inner_dim() {
            candle_core::bail!(
                "transformer config: cross_attention_dim {} must equal num_attention_heads x attention_head_dim ({}): the caption projection feeds the cross-attention",
                self.cross_attention_dim,
                self.inner_dim()
            );
        }
        crate::models::config_checks::one_of(
            "transformer config",
            ("activation_fn", &self.activation_fn),
            &["gelu-approximate"],
        )?;
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            candle_core::bail!("transformer config: norm_eps must be a non-negative number");
        }
        let scales = [
            ("interpolation_scale_t", self.interpolation_scale_t),
            ("interpolation_scale_h", self.interpolation_scale_h),
            ("interpolation_scale_w", self.interpolation_scale_w),
        ];
        if let Some((key, _)) = scales.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
            candle_core::bail!("transformer config: {key} must be a positive number");
        }
        Ok(())
    }
}

impl VideoDit for AllegroTransformerConfig {
    fn dit_shape(&self) -> DitShape {
        DitShape::of(self.num_layers, self.inner_dim(), self.in_channels)
    }
}

/// One axis of `get_3d_rotary_pos_embed_allegro`: `get_1d_rotary_pos_embed(dim, grid / scale,
/// use_real, repeat_interleave_real=False)` at grid positions `0..len`, in f32 as torch computes
/// it: `(cos, sin)` rows `[len, dim]`, each `[half | half]`.
fn rope_axis(dim: usize, len: usize, scale: f64) -> (Vec<f32>, Vec<f32>) {
    let half = dim / 2;
    let freqs: Vec<f32> = (0..half)
        .map(|j| 1.0 / ROPE_THETA.powf((2 * j) as f32 / dim as f32))
        .collect();
    let (mut cos, mut sin) = (Vec::with_capacity(len * dim), Vec::with_capacity(len * dim));
    for i in 0..len {
        let pos = i as f32 / scale as f32;
        let args: Vec<f32> = freqs.iter().map(|f| pos * f).collect();
        for _ in 0..2 {
            cos.extend(args.iter().map(|a| a.cos()));
            sin.extend(args.iter().map(|a| a.sin()));
        }
    }
    (cos, sin)
}

/// The rotary tables of every token of an `f × h × w` grid, `(cos, sin)` each `[N, head_dim]`
/// (frame, row and column thirds side by side), f32: diffusers' per-axis tables looked up by
/// each token's grid index.
pub fn rope_tables(
    cfg: &AllegroTransformerConfig,
    grid: [usize; 3],
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let dim = cfg.attention_head_dim / 3;
    let [f, h, w] = grid;
    let axes = [
        rope_axis(dim, f, cfg.interpolation_scale_t),
        rope_axis(dim, h, cfg.interpolation_scale_h),
        rope_axis(dim, w, cfg.interpolation_scale_w),
    ];
    let n = f * h * w;
    let (mut cos, mut sin) = (
        Vec::with_capacity(n * 3 * dim),
        Vec::with_capacity(n * 3 * dim),
    );
    for ti in 0..f {
        for hi in 0..h {
            for wi in 0..w {
                for (axis, i) in axes.iter().zip([ti, hi, wi]) {
                    cos.extend_from_slice(&axis.0[i * dim..(i + 1) * dim]);
                    sin.extend_from_slice(&axis.1[i * dim..(i + 1) * dim]);
                }
            }
        }
    }
    Ok((
        Tensor::from_vec(cos, (n, 3 * dim), device)?,
        Tensor::from_vec(sin, (n, 3 * dim), device)?,
    ))
}

/// `apply_rotary_emb_allegro` on `x` `[B, H, N, head_dim]`: each third rotated by half
/// (`x·cos + [−x₂ | x₁]·sin`) in f32, back in `x`'s dtype.
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let third = x.dim(3)? / 3;
    let half = third / 2;
    let mut rotated = Vec::with_capacity(6);
    for k in 0..3 {
        let part = x.narrow(3, k * third, third)?;
        rotated.push(part.narrow(3, half, half)?.neg()?);
        rotated.push(part.narrow(3, 0, half)?);
    }
    let rotated = Tensor::cat(&rotated, 3)?;
    let out = (x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?;
    out.to_dtype(dtype)
}

/// [`apply_rope`] on a head view `[B, H, N, head_dim]` of a projection's `[B, N, H * head_dim]`
/// rows: in one kernel over those rows where it runs (bf16 on CUDA), else composed.
fn rope_heads(x: Tensor, (cos, sin): &(Tensor, Tensor)) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let (b, h, n, d) = x.dims4()?;
        let rows = x.transpose(1, 2)?;
        if rows.is_contiguous() && row_ops::supported(&rows) {
            drop(x);
            let at = Rows { row0: 0, seq: n };
            return row_ops::rope_sections(rows.reshape((b * n, h * d))?, (cos, sin), d, 3, at)?
                .reshape((b, n, h, d))?
                .transpose(1, 2);
        }
    }
    apply_rope(&x, cos, sin)
}

/// `Attention` with `AllegroAttnProcessor2_0`: self-attention over every token with the rotary
/// embedding on q and k; the merged heads before `to_out`.
fn self_attention(attn: &Attention, x: &Tensor, rope: &(Tensor, Tensor)) -> Result<Tensor> {
    let (q, k, v) = attn.heads(x, x)?;
    let q = rope_heads(q, rope)?;
    let k = rope_heads(k, rope)?;
    attn.merge_heads(sdpa(&q, &k, &v, attn.scale())?)
}

/// Cross-attention of every token to the caption, padding keys masked; the merged heads before
/// `to_out`.
fn cross_attention(attn: &Attention, x: &Tensor, text: &Tensor, mask: &TextMask) -> Result<Tensor> {
    let (q, k, v) = attn.heads(x, text)?;
    let out = match mask {
        TextMask::Prefix(lens) => sdpa_key_prefix(&q, &k, &v, attn.scale(), lens)?,
        TextMask::Bias(bias) => sdpa_with_bias(&q, &k, &v, attn.scale(), bias)?,
    };
    attn.merge_heads(out)
}

/// The caption mask as the attention takes it: a prefix of real tokens per batch entry (the
/// tokenizer's padding), or else diffusers' additive bias `[B, 1, 1, L]`.
#[derive(Debug, Clone)]
pub enum TextMask {
    Prefix(Vec<usize>),
    Bias(Tensor),
}

/// One `AllegroTransformerBlock` (its `norm3` is unused).
#[derive(Debug, Clone)]
pub struct AllegroBlock {
    block: Block,
}

impl AllegroBlock {
    /// The block under `vb` (`transformer_blocks.{i}`).
    pub fn new(cfg: &AllegroTransformerConfig, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            block: Block::new(cfg.block_shape(), vb)?,
        })
    }

    /// `x` `[B, N, D]` -> the same, through this block.
    pub fn forward(&self, x: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        self.forward_hooked(x, inputs, &mut ComputeAll)
    }
}

/// Allegro's attentions: rotary self-attention over every token, masked cross-attention.
impl BlockAttention for BlockInputs {
    fn self_attention(&self, attn: &Attention, normed: &Tensor) -> Result<Tensor> {
        self_attention(attn, normed, &self.rope)
    }

    fn cross_attention(&self, attn: &Attention, states: &Tensor) -> Result<Tensor> {
        cross_attention(attn, states, &self.text, &self.mask)
    }
}

/// Everything the blocks and the output head need, computed once per forward by `prepare`.
#[derive(Debug, Clone)]
pub struct BlockInputs {
    hidden_states: Option<Tensor>,
    /// `adaln_single`'s modulation `[B, 6·D]`.
    pub timestep: Tensor,
    /// `adaln_single`'s embedded timestep `[B, D]`: the output head's modulation.
    pub embedded_timestep: Tensor,
    /// The projected caption `[B, L, D]`.
    pub text: Tensor,
    /// Which caption tokens the cross-attention sees.
    pub mask: TextMask,
    /// The rotary tables `(cos, sin)` `[N, head_dim]`, f32.
    pub rope: (Tensor, Tensor),
    /// Token grid (frames, rows, columns).
    pub grid: [usize; 3],
}

impl BlockInputs {
    /// Takes the hidden states `[B, N, D]` that feed block 0; once.
    pub fn take_hidden_states(&mut self) -> Result<Tensor> {
        self.hidden_states
            .take()
            .ok_or_else(|| candle_core::Error::Msg("block-0 hidden states already taken".into()))
    }
}

/// The diffusers `AllegroTransformer3DModel`.
#[derive(Debug, Clone)]
pub struct AllegroTransformer3DModel {
    cfg: AllegroTransformerConfig,
    /// `pos_embed.proj`: Conv2d with kernel = stride = patch, as a linear over patches.
    patch_proj: Linear,
    adaln_single: AdaLayerNormSingle,
    caption_projection: CaptionProjection,
    blocks: Vec<AllegroBlock>,
    head: OutputHead,
    dtype: DType,
}

impl AllegroTransformer3DModel {
    /// Loads the whole model, blocks included.
    pub fn new(cfg: &AllegroTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads everything except the blocks (an engine that streams them builds each with
    /// [`AllegroBlock::new`]); `blocks()` is then empty and `forward` refuses to run.
    pub fn new_without_blocks(cfg: &AllegroTransformerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let (c, p) = (cfg.in_channels, cfg.patch_size);
        let pvb = vb.pp("pos_embed.proj");
        let patch_w = pvb
            .get((dim, c, p, p), "weight")?
            .reshape((dim, c * p * p))?;
        Ok(Self {
            cfg: cfg.clone(),
            patch_proj: Linear::new(patch_w, Some(pvb.get(dim, "bias")?)),
            adaln_single: AdaLayerNormSingle::new(dim, vb.pp("adaln_single"))?,
            caption_projection: CaptionProjection::new(
                cfg.caption_channels,
                dim,
                vb.pp("caption_projection"),
            )?,
            blocks: Vec::new(),
            head: OutputHead::new(dim, p * p * cfg.out_channels, vb.clone())?,
            dtype: vb.dtype(),
        })
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &AllegroTransformerConfig {
        &self.cfg
    }

    /// The loaded blocks (empty after `new_without_blocks`).
    pub fn blocks(&self) -> &[AllegroBlock] {
        &self.blocks
    }

    /// Patch embedding, timestep modulation, caption projection, caption mask and rotary
    /// tables for `latents` `[B, C, F, H, W]`, `timestep` `[B]` (or one value),
    /// `encoder_hidden_states` `[B, L, caption_channels]` and its keep-mask `[B, L]` (1 keep).
    pub fn prepare(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
        encoder_attention_mask: &Tensor,
    ) -> Result<BlockInputs> {
        let cfg = &self.cfg;
        let p = cfg.patch_size;
        let (b, grid) = token_grid(latents, cfg.in_channels, [1, p, p])?;
        text_len(
            encoder_hidden_states,
            b,
            ("caption_channels", cfg.caption_channels),
        )?;
        // Patches of each frame in row-major token order, frames one after another.
        let patches = whole_patches(&latents.to_dtype(self.dtype)?, [1, p, p])?;
        let hidden_states = self.patch_proj.forward(&patches)?;
        let (modulation, embedded_timestep) = self.adaln_single.forward(timestep, b)?;
        let text = self.caption_projection.forward(encoder_hidden_states)?;
        let mask = match mask_prefix_lens(encoder_attention_mask)? {
            Some(lens) => TextMask::Prefix(lens),
            None => {
                let keep = encoder_attention_mask.to_dtype(self.dtype)?;
                let bias = keep.affine(-1.0, 1.0)?.affine(MASKED_KEY_BIAS, 0.0)?;
                let l = bias.dim(1)?;
                TextMask::Bias(bias.reshape((b, 1, 1, l))?)
            }
        };
        Ok(BlockInputs {
            hidden_states: Some(hidden_states),
            timestep: modulation,
            embedded_timestep,
            text,
            mask,
            rope: rope_tables(cfg, grid, latents.device())?,
            grid,
        })
    }

    /// The output head on `x` `[B, N, D]` and unpatchify: `[B, out_channels, F, H, W]`.
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
        let out = self.head.forward(x, &inputs.embedded_timestep, project)?;
        let p = self.cfg.patch_size;
        unpatchify_channels_last(&out, inputs.grid, [1, p, p])
    }

    /// Full forward: `prepare`, every block, `finish`. Needs a model built with `new`.
    pub fn forward(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
        encoder_attention_mask: &Tensor,
    ) -> Result<Tensor> {
        let inputs = self.prepare(
            latents,
            timestep,
            encoder_hidden_states,
            encoder_attention_mask,
        )?;
        crate::models::blocks::BlockForward::forward_resident(self, inputs)
    }
}

/// Placed block by block: the blocks stream one by one, whole.
/// The modules diffusers' layerwise casting leaves alone in `AllegroTransformer3DModel` (its
/// `_skip_layerwise_casting_patterns`).
const LAYERWISE_CASTING_SKIP: &[&str] = &["pos_embed", "norm", "adaln_single"];

impl Blockwise for AllegroTransformer3DModel {
    const LAYERWISE_CASTING_SKIP: &'static [&'static str] = LAYERWISE_CASTING_SKIP;
    type Config = AllegroTransformerConfig;
    type Block = AllegroBlock;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        Self::new(cfg, vb)
    }
    fn outer(cfg: &Self::Config, vb: VarBuilder, _: VarBuilder) -> Result<Self> {
        Self::new_without_blocks(cfg, vb)
    }
    fn num_blocks(cfg: &Self::Config) -> usize {
        cfg.num_layers
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> Result<Self::Block> {
        AllegroBlock::new(cfg, vb.pp(format!("transformer_blocks.{i}")))
    }
}

crate::block_forward!(
    AllegroTransformer3DModel, BlockInputs, take_hidden_states, Tensor,
    |m, x, inputs| m.finish(&x, inputs) => Tensor
);

impl HookedBlock<Tensor, BlockInputs> for AllegroBlock {
    /// [`Self::forward`], asking `hooks` (a step cache) for `attn1`'s and `attn2`'s outputs.
    fn forward_hooked(
        &self,
        x: &Tensor,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Tensor> {
        self.block
            .forward_hooked(x, &inputs.timestep, inputs, hooks)
    }
}

/// How diffusers names what PAB hooks in Allegro: `transformer_blocks`, and in each the
/// self-attention over every token (`attn1`, PAB's spatial attention) and the cross-attention
/// to the caption (`attn2`). diffusers' block hooks (First Block Cache, MagCache) do not take
/// Allegro's blocks, which its hook registry does not list; PAB hooks attention modules by name.
pub(super) const CACHE_NAMES: ModuleNames = ModuleNames::transformer_blocks(&[
    (Output::Attention, "attn1"),
    (Output::CrossAttention, "attn2"),
]);

crate::video_tokens_cached_forward!(AllegroTransformer3DModel, BlockInputs);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_the_model_cannot_run_are_refused_with_the_key() {
        let good = AllegroTransformerConfig::default();
        assert!(good.validate().is_ok());
        let cases = [
            (
                AllegroTransformerConfig {
                    patch_size_t: 2,
                    ..good.clone()
                },
                "patch_size_t",
            ),
            (
                AllegroTransformerConfig {
                    attention_head_dim: 64,
                    cross_attention_dim: 24 * 64,
                    ..good.clone()
                },
                "attention_head_dim",
            ),
            (
                AllegroTransformerConfig {
                    cross_attention_dim: 4096,
                    ..good.clone()
                },
                "cross_attention_dim",
            ),
            (
                AllegroTransformerConfig {
                    num_attention_heads: usize::MAX,
                    ..good.clone()
                },
                "num_attention_heads",
            ),
            (
                AllegroTransformerConfig {
                    interpolation_scale_t: 0.0,
                    ..good.clone()
                },
                "interpolation_scale_t",
            ),
        ];
        for (bad, key) in cases {
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    /// Each token's table is its frame's, row's and column's rows side by side, and position 0
    /// does not rotate.
    #[test]
    fn rope_tables_follow_the_token_grid() -> Result<()> {
        let cfg = AllegroTransformerConfig {
            attention_head_dim: 12,
            ..Default::default()
        };
        let (cos, sin) = rope_tables(&cfg, [2, 3, 4], &Device::Cpu)?;
        assert_eq!(cos.dims(), [24, 12]);
        let first = cos.get(0)?.to_vec1::<f32>()?;
        assert!(first.iter().all(|&c| c == 1.0));
        assert!(sin.get(0)?.to_vec1::<f32>()?.iter().all(|&s| s == 0.0));
        // Token (1, 2, 3): the frame third at 1 / 2.2, the row third at 2 / 2, the column
        // third at 3 / 2.
        let last = cos.get(23)?.to_vec1::<f32>()?;
        let (tc, _) = rope_axis(4, 2, 2.2);
        assert_eq!(&last[0..4], &tc[4..8]);
        let (hc, _) = rope_axis(4, 3, 2.0);
        assert_eq!(&last[4..8], &hc[8..12]);
        let (wc, _) = rope_axis(4, 4, 2.0);
        assert_eq!(&last[8..12], &wc[12..16]);
        Ok(())
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    //! The rotary embedding's kernel against its candle composition on the GPU, bit for bit.
    use super::*;
    use crate::models::row_ops::test_util::{device, randn};

    /// q of Allegro's head width (96: three sections of 32) over a 3 x 5 x 7 token grid with
    /// guidance's batch of 2, as the projection's head view, and the model's own tables.
    #[test]
    fn rope_kernel_matches_composite() -> Result<()> {
        let Some(dev) = device("Allegro rotary kernel") else {
            return Ok(());
        };
        let cfg = AllegroTransformerConfig::default();
        let (heads, d) = (4, cfg.attention_head_dim);
        let grid = [3, 5, 7];
        let n: usize = grid.iter().product();
        let tables = rope_tables(&cfg, grid, &dev)?;
        let rows = (randn(&[2, n, heads * d], 1.0, &dev)? * 4.0)?;
        let view = || -> Result<Tensor> { rows.copy()?.reshape((2, n, heads, d))?.transpose(1, 2) };
        let want = apply_rope(&view()?, &tables.0, &tables.1)?;
        let got = rope_heads(view()?, &tables)?;
        assert_eq!(got.dims(), want.dims());
        let gap = (got.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(gap, 0.0, "fused rotary embedding differs by {gap}");
        Ok(())
    }
}
