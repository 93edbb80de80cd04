//! Latte's diffusion transformer (diffusers `LatteTransformer3DModel`, the Latte-XL/2 layout of
//! maxin-cn/Latte-1): PixArt-α blocks applied per frame (spatial: self-attention, cross-attention
//! to the caption, feed-forward) alternating with blocks over the frames of each token position
//! (temporal: self-attention, feed-forward), all modulated by one `AdaLayerNormSingle`.
//!
//! The hidden state stays `[B, F, N, D]` (N tokens of a frame) between blocks; a spatial block
//! attends within each frame, a temporal block within each token position across the frames.
//! The forward is split for streaming: [`LatteTransformer3DModel::prepare`], the blocks in
//! execution order (spatial 0, temporal 0, spatial 1, ...; [`LatteBlock::forward`]), then
//! [`LatteTransformer3DModel::finish`]. Every weight uses the `VarBuilder` dtype, as diffusers
//! keeps none of this model in f32; the sin-cos tables are computed in f64 and rounded to f32.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;

use crate::models::blocks::{Blockwise, HookedBlock};
use crate::models::patches::{text_len, unpatchify_channels_last, whole_patches};
use crate::models::pixart::{
    AdaLayerNormSingle, Attention, Block, BlockAttention, BlockShape, CaptionProjection, OutputHead,
};
use crate::models::step_cache::{
    Absent, BlockHooks, ComputeAll, ModuleNames, Output, Reclassified, Submodule, Through,
};
use crate::models::video::{DitShape, VideoDit};

/// `transformer/config.json` of a `LatteTransformer3DModel`; missing keys take diffusers'
/// defaults (keys that must be given are options).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct LatteTransformerConfig {
    /// Heads of every attention.
    pub num_attention_heads: usize,
    /// Width of a head: the hidden width is heads x this.
    pub attention_head_dim: usize,
    /// Latent channels in.
    pub in_channels: Option<usize>,
    /// Channels out (2 × latent with learned sigma); `in_channels` when null.
    pub out_channels: Option<usize>,
    /// Spatial blocks, and as many temporal ones.
    pub num_layers: usize,
    /// Informational (inference runs no dropout).
    pub dropout: f64,
    /// Width of the (projected) caption the spatial blocks attend to.
    pub cross_attention_dim: Option<usize>,
    /// Biases on q, k and v.
    pub attention_bias: bool,
    /// Latent size of training: sets the 2-D sin-cos table's base size.
    pub sample_size: usize,
    /// Side of a square patch of latent pixels per token.
    pub patch_size: Option<usize>,
    /// Only `gelu-approximate`.
    pub activation_fn: String,
    /// Informational.
    pub num_embeds_ada_norm: Option<usize>,
    /// Only `ada_norm_single`.
    pub norm_type: String,
    /// Whether the blocks' LayerNorms have weights.
    pub norm_elementwise_affine: bool,
    /// Epsilon of the blocks' LayerNorms.
    pub norm_eps: f64,
    /// Width of the text encoder's states.
    pub caption_channels: Option<usize>,
    /// Frames of the 1-D temporal sin-cos table: a video must have this many frames (or one).
    pub video_length: usize,
    /// Not in the file: the blocks' attention and feed-forward Linears run in fp8
    /// (`--fp8-matmul`, set by the pipeline).
    #[serde(skip)]
    pub fp8_matmul: bool,
}

impl Default for LatteTransformerConfig {
    fn default() -> Self {
        // The defaults of `LatteTransformer3DModel.__init__`.
        Self {
            num_attention_heads: 16,
            attention_head_dim: 88,
            in_channels: None,
            out_channels: None,
            num_layers: 1,
            dropout: 0.0,
            cross_attention_dim: None,
            attention_bias: false,
            sample_size: 64,
            patch_size: None,
            activation_fn: "geglu".into(),
            num_embeds_ada_norm: None,
            norm_type: "layer_norm".into(),
            norm_elementwise_affine: true,
            norm_eps: 1e-5,
            caption_channels: None,
            video_length: 16,
            fp8_matmul: false,
        }
    }
}

impl LatteTransformerConfig {
    /// The sizes of a block of `kind`: a spatial one attends to the caption too.
    pub fn block_shape(&self, kind: BlockKind) -> BlockShape {
        let cross_attention_dim = match kind {
            BlockKind::Spatial => Some(self.cross_attention_dim.unwrap_or(self.inner_dim())),
            BlockKind::Temporal => None,
        };
        BlockShape::new(
            (self.num_attention_heads, self.attention_head_dim),
            self.attention_bias,
            (self.norm_eps, self.norm_elementwise_affine),
            cross_attention_dim,
        )
        .in_fp8(self.fp8_matmul)
    }

    /// Width of the hidden states.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Latent channels in (0 where the config lacks them; `validate` refuses that).
    pub fn in_channels(&self) -> usize {
        self.in_channels.unwrap_or(0)
    }

    /// Channels out.
    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels())
    }

    /// The patch side (0 where the config lacks it).
    pub fn patch_size(&self) -> usize {
        self.patch_size.unwrap_or(0)
    }

    /// Width of the text encoder's states (0 where the config lacks it).
    pub fn caption_channels(&self) -> usize {
        self.caption_channels.unwrap_or(0)
    }

    /// `interpolation_scale` of the 2-D sin-cos table: `max(sample_size // 64, 1)`.
    fn interpolation_scale(&self) -> usize {
        (self.sample_size / 64).max(1)
    }

    /// Rejects configurations this model cannot run, with the key at fault.
    pub fn validate(&self) -> Result<()> {
        let required = [
            ("in_channels", self.in_channels),
            ("patch_size", self.patch_size),
            ("caption_channels", self.caption_channels),
            ("cross_attention_dim", self.cross_attention_dim),
        ];
        if let Some((key, _)) = required.iter().find(|(_, v)| !v.is_some_and(|v| v > 0)) {
            candle_core::bail!("transformer config: {key} must be a positive number");
        }
        let positive = [
            ("num_attention_heads", self.num_attention_heads),
            ("attention_head_dim", self.attention_head_dim),
            ("num_layers", self.num_layers),
            ("sample_size", self.sample_size),
            ("video_length", self.video_length),
            ("out_channels", self.out_channels()),
        ];
        crate::models::config_checks::positive("transformer config", &positive)?;
        // Sizes past these would only overflow the arithmetic below (Latte-1: 1152 wide, patch
        // 2 of 64, 16 frames).
        let inner = self
            .num_attention_heads
            .checked_mul(self.attention_head_dim)
            .filter(|&d| d <= 1 << 16);
        if inner.is_none() {
            candle_core::bail!(
                "transformer config: num_attention_heads x attention_head_dim must be at most 65536"
            );
        }
        if self.sample_size > 1 << 16 || self.video_length > 1 << 16 {
            candle_core::bail!(
                "transformer config: sample_size and video_length must be at most 65536"
            );
        }
        if self.patch_size() > self.sample_size {
            candle_core::bail!(
                "transformer config: patch_size {} is larger than sample_size {}",
                self.patch_size(),
                self.sample_size
            );
        }
        if self.cross_attention_dim != Some(self.inner_dim()) {
            candle_core::bail!(
                "transformer config: cross_attention_dim {:?} must equal num_attention_heads x attention_head_dim ({}): the caption projection feeds the cross-attention",
                self.cross_attention_dim,
                self.inner_dim()
            );
        }
        if !self.inner_dim().is_multiple_of(4) {
            candle_core::bail!(
                "transformer config: num_attention_heads x attention_head_dim ({}) must be a multiple of 4 for the 2-D sin-cos table",
                self.inner_dim()
            );
        }
        crate::models::config_checks::one_of(
            "transformer config",
            ("norm_type", &self.norm_type),
            &["ada_norm_single"],
        )?;
        crate::models::config_checks::one_of(
            "transformer config",
            ("activation_fn", &self.activation_fn),
            &["gelu-approximate"],
        )?;
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            candle_core::bail!("transformer config: norm_eps must be a non-negative number");
        }
        Ok(())
    }
}

impl VideoDit for LatteTransformerConfig {
    fn dit_shape(&self) -> DitShape {
        DitShape::of(self.num_layers, self.inner_dim(), self.in_channels())
    }
}

/// diffusers' `get_1d_sincos_pos_embed_from_grid` (float64, `[sin | cos]`) rows for `positions`.
fn sincos_rows(dim: usize, positions: &[f64]) -> Vec<Vec<f64>> {
    let half = dim / 2;
    let omega: Vec<f64> = (0..half)
        .map(|j| 1.0 / 10000f64.powf(j as f64 / (dim as f64 / 2.0)))
        .collect();
    positions
        .iter()
        .map(|&p| {
            let args = omega.iter().map(|w| p * w);
            args.clone()
                .map(f64::sin)
                .chain(args.map(f64::cos))
                .collect()
        })
        .collect()
}

/// The 2-D sin-cos table `[gh·gw, dim]` (f32) of `PatchEmbed` for a `gh × gw` token grid:
/// diffusers' `get_2d_sincos_pos_embed(dim, (gh, gw), base_size, interpolation_scale)`, whose
/// first half encodes the column and second half the row of each token (row-major order).
fn spatial_pos_embed(
    dim: usize,
    grid: [usize; 2],
    base_size: usize,
    interpolation_scale: usize,
    device: &Device,
) -> Result<Tensor> {
    let [gh, gw] = grid;
    // arange(n, f32) / (n / base_size) / interpolation_scale, in f32 as torch computes it.
    let axis = |n: usize| -> Vec<f64> {
        let ratio = (n as f64 / base_size as f64) as f32;
        (0..n)
            .map(|i| f64::from(i as f32 / ratio / interpolation_scale as f32))
            .collect()
    };
    let (rows, cols) = (axis(gh), axis(gw));
    let col_table = sincos_rows(dim / 2, &cols);
    let row_table = sincos_rows(dim / 2, &rows);
    let mut table = Vec::with_capacity(gh * gw * dim);
    for row in &row_table {
        for col in &col_table {
            table.extend(col.iter().chain(row).map(|&v| v as f32));
        }
    }
    Tensor::from_vec(table, (gh * gw, dim), device)
}

/// The 1-D temporal sin-cos table `[frames, dim]` (f32) added before the first temporal block.
pub fn temporal_pos_embed(dim: usize, frames: usize, device: &Device) -> Result<Tensor> {
    let positions: Vec<f64> = (0..frames).map(|f| f as f64).collect();
    let table: Vec<f32> = sincos_rows(dim, &positions)
        .into_iter()
        .flatten()
        .map(|v| v as f32)
        .collect();
    Tensor::from_vec(table, (frames, dim), device)
}

/// Which of the two block lists a block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// `transformer_blocks.{i}`: within each frame, with cross-attention to the caption.
    Spatial,
    /// `temporal_transformer_blocks.{i}`: within each token position, across the frames.
    Temporal,
}

/// One `BasicTransformerBlock` with `norm_type="ada_norm_single"`, spatial or temporal.
#[derive(Debug, Clone)]
pub struct LatteBlock {
    kind: BlockKind,
    /// Layer index: the temporal block of layer 0 adds the temporal sin-cos table first.
    layer: usize,
    /// Its weights; cross-attention in spatial blocks only.
    block: Block,
}

impl LatteBlock {
    /// Block `i` in execution order (spatial `i / 2` for even `i`, temporal `i / 2` for odd),
    /// from the model's root `vb`.
    pub fn new(cfg: &LatteTransformerConfig, i: usize, vb: VarBuilder) -> Result<Self> {
        let (kind, layer) = block_at(cfg, i)?;
        let vb = match kind {
            BlockKind::Spatial => vb.pp(format!("transformer_blocks.{layer}")),
            BlockKind::Temporal => vb.pp(format!("temporal_transformer_blocks.{layer}")),
        };
        Ok(Self {
            kind,
            layer,
            block: Block::new(cfg.block_shape(kind), vb)?,
        })
    }

    /// `x` `[B, F, N, D]` -> the same, through this block.
    pub fn forward(&self, x: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        self.forward_hooked(x, inputs, &mut ComputeAll)
    }
}

/// Latte's attentions: self-attention within each of a video's `groups` sequences of `seq`
/// tokens (frames, or token positions across the frames); cross-attention of every token of a
/// video to its caption.
struct Sequences<'a> {
    groups: usize,
    seq: usize,
    text: &'a Tensor,
}

impl BlockAttention for Sequences<'_> {
    fn self_attention(&self, attn: &Attention, normed: &Tensor) -> Result<Tensor> {
        let (b, _, d) = normed.dims3()?;
        let normed = normed.reshape((b * self.groups, self.seq, d))?;
        attn.attend(&normed, &normed)?
            .reshape((b, self.groups * self.seq, d))
    }

    fn cross_attention(&self, attn: &Attention, states: &Tensor) -> Result<Tensor> {
        attn.attend(states, self.text)
    }
}

fn block_at(cfg: &LatteTransformerConfig, i: usize) -> Result<(BlockKind, usize)> {
    if i >= 2 * cfg.num_layers {
        candle_core::bail!("block {i} of {} blocks", 2 * cfg.num_layers);
    }
    let kind = if i.is_multiple_of(2) {
        BlockKind::Spatial
    } else {
        BlockKind::Temporal
    };
    Ok((kind, i / 2))
}

/// Everything the blocks and the output head need, computed once per forward by `prepare`.
#[derive(Debug, Clone)]
pub struct BlockInputs {
    hidden_states: Option<Tensor>,
    /// `adaln_single`'s modulation `[B, 6·D]` (model dtype).
    pub timestep: Tensor,
    /// `adaln_single`'s embedded timestep `[B, D]`: the output head's modulation.
    pub embedded_timestep: Tensor,
    /// The projected caption `[B, L, D]`.
    pub text: Tensor,
    /// The temporal sin-cos table `[F, D]` in the model dtype (none for a single frame).
    pub temp_pos_embed: Option<Tensor>,
    /// Batch size.
    pub batch: usize,
    /// Frames.
    pub frames: usize,
    /// Token grid of a frame (rows, columns).
    pub grid: [usize; 2],
}

impl BlockInputs {
    /// Takes the hidden states `[B, F, N, D]` that feed block 0; once.
    pub fn take_hidden_states(&mut self) -> Result<Tensor> {
        self.hidden_states
            .take()
            .ok_or_else(|| candle_core::Error::Msg("block-0 hidden states already taken".into()))
    }
}

/// The diffusers `LatteTransformer3DModel`.
#[derive(Debug, Clone)]
pub struct LatteTransformer3DModel {
    cfg: LatteTransformerConfig,
    /// `pos_embed.proj`: Conv2d with kernel = stride = patch, as a linear over patches.
    patch_proj: Linear,
    adaln_single: AdaLayerNormSingle,
    caption_projection: CaptionProjection,
    blocks: Vec<LatteBlock>,
    head: OutputHead,
    dtype: DType,
}

impl LatteTransformer3DModel {
    /// Loads the whole model, blocks included.
    pub fn new(cfg: &LatteTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads everything except the blocks (an engine that streams them builds each with
    /// [`LatteBlock::new`]); `blocks()` is then empty and `forward` refuses to run.
    pub fn new_without_blocks(cfg: &LatteTransformerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let (c, p) = (cfg.in_channels(), cfg.patch_size());
        let pvb = vb.pp("pos_embed.proj");
        let patch_w = pvb
            .get((dim, c, p, p), "weight")?
            .reshape((dim, c * p * p))?;
        Ok(Self {
            cfg: cfg.clone(),
            patch_proj: Linear::new(patch_w, Some(pvb.get(dim, "bias")?)),
            adaln_single: AdaLayerNormSingle::new(dim, vb.pp("adaln_single"))?,
            caption_projection: CaptionProjection::new(
                cfg.caption_channels(),
                dim,
                vb.pp("caption_projection"),
            )?,
            blocks: Vec::new(),
            head: OutputHead::new(dim, p * p * cfg.out_channels(), vb.clone())?,
            dtype: vb.dtype(),
        })
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &LatteTransformerConfig {
        &self.cfg
    }

    /// The loaded blocks in execution order (empty after `new_without_blocks`).
    pub fn blocks(&self) -> &[LatteBlock] {
        &self.blocks
    }

    /// Patch embedding with its sin-cos table, timestep modulation, caption projection and
    /// temporal table for `latents` `[B, C, F, H, W]`, `timestep` `[B]` (or one value; integer
    /// timesteps of any dtype) and `encoder_hidden_states` `[B, L, caption_channels]`.
    pub fn prepare(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
    ) -> Result<BlockInputs> {
        let cfg = &self.cfg;
        let (b, c, f, h, w) = latents.dims5()?;
        if c != cfg.in_channels() {
            candle_core::bail!(
                "latents [B, C, F, H, W] have {c} channels, the transformer expects {}",
                cfg.in_channels()
            );
        }
        if f != 1 && f != cfg.video_length {
            candle_core::bail!(
                "latents have {f} frames; this transformer's temporal table takes video_length {} (or 1)",
                cfg.video_length
            );
        }
        let p = cfg.patch_size();
        let grid = [h / p, w / p];
        if grid.contains(&0) {
            candle_core::bail!("latents [{h}, {w}] are smaller than one {p}x{p} patch");
        }
        text_len(
            encoder_hidden_states,
            b,
            ("caption_channels", cfg.caption_channels()),
        )?;
        let device = latents.device();
        let dim = cfg.inner_dim();

        // Patches of each frame in row-major token order, plus the 2-D sin-cos table (added in
        // f32, as diffusers adds its float table, then rounded to the model dtype).
        let [gh, gw] = grid;
        let patches = whole_patches(&latents.to_dtype(self.dtype)?, [1, p, p])?.reshape((
            b,
            f,
            gh * gw,
            (),
        ))?;
        let table = spatial_pos_embed(
            dim,
            grid,
            cfg.sample_size / p,
            cfg.interpolation_scale(),
            device,
        )?;
        let hidden_states = self
            .patch_proj
            .forward(&patches)?
            .to_dtype(DType::F32)?
            .broadcast_add(&table)?
            .to_dtype(self.dtype)?;

        let (modulation, embedded_timestep) = self.adaln_single.forward(timestep, b)?;
        let text = self.caption_projection.forward(encoder_hidden_states)?;
        let temp_pos_embed = if f > 1 {
            Some(temporal_pos_embed(dim, cfg.video_length, device)?.to_dtype(self.dtype)?)
        } else {
            None
        };
        Ok(BlockInputs {
            hidden_states: Some(hidden_states),
            timestep: modulation,
            embedded_timestep,
            text,
            temp_pos_embed,
            batch: b,
            frames: f,
            grid,
        })
    }

    /// The output head on `x` `[B, F, N, D]` and unpatchify: `[B, out_channels, F, H, W]`.
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
        let (b, f, n, _) = x.dims4()?;
        let out = self.head.forward(x, &inputs.embedded_timestep, project)?;
        let p = self.cfg.patch_size();
        let [gh, gw] = inputs.grid;
        debug_assert_eq!(n, gh * gw);
        let out = out.reshape((b, f * n, ()))?;
        unpatchify_channels_last(&out, [f, gh, gw], [1, p, p])
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

/// Placed block by block: spatial and temporal blocks alternate in execution order (each kind
/// in its own weight list), and a streamed group takes consecutive blocks of that order, both
/// kinds: groups of one kind would hold one block each, whatever `--num-blocks-per-group` says.
/// The modules diffusers' layerwise casting leaves alone in `LatteTransformer3DModel` (its
/// `_skip_layerwise_casting_patterns`).
const LAYERWISE_CASTING_SKIP: &[&str] = &["pos_embed", "norm"];

impl Blockwise for LatteTransformer3DModel {
    const LAYERWISE_CASTING_SKIP: &'static [&'static str] = LAYERWISE_CASTING_SKIP;
    type Config = LatteTransformerConfig;
    type Block = LatteBlock;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        Self::new(cfg, vb)
    }
    fn outer(cfg: &Self::Config, vb: VarBuilder, _: VarBuilder) -> Result<Self> {
        Self::new_without_blocks(cfg, vb)
    }
    fn num_blocks(cfg: &Self::Config) -> usize {
        2 * cfg.num_layers
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> Result<Self::Block> {
        LatteBlock::new(cfg, i, vb)
    }
}

crate::block_forward!(
    LatteTransformer3DModel, BlockInputs, take_hidden_states, Tensor,
    |m, x, inputs| m.finish(&x, inputs) => Tensor
);

impl HookedBlock<Tensor, BlockInputs> for LatteBlock {
    /// [`Self::forward`], asking `hooks` (a step cache) for the attention outputs: a temporal
    /// block's `attn1` as [`Submodule::TemporalAttention`].
    fn forward_hooked(
        &self,
        x: &Tensor,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Tensor> {
        let (b, f, n, d) = x.dims4()?;
        // Sequences of this block: frames (spatial) or token positions (temporal), `[B', S, D]`.
        let h = match self.kind {
            BlockKind::Spatial => x.reshape((b, f * n, d))?,
            BlockKind::Temporal => {
                let h = x.transpose(1, 2)?.contiguous()?;
                match (&inputs.temp_pos_embed, self.layer) {
                    (Some(table), 0) => h.broadcast_add(&table.unsqueeze(0)?)?,
                    _ => h,
                }
                .reshape((b, n * f, d))?
            }
        };
        let (groups, seq) = match self.kind {
            BlockKind::Spatial => (f, n),
            BlockKind::Temporal => (n, f),
        };
        let attention = Sequences {
            groups,
            seq,
            text: &inputs.text,
        };
        let h = match self.kind {
            BlockKind::Spatial => {
                self.block
                    .forward_hooked(&h, &inputs.timestep, &attention, hooks)
            }
            BlockKind::Temporal => {
                let mut temporal = Reclassified {
                    hooks,
                    from: Submodule::SelfAttention,
                    to: Submodule::TemporalAttention,
                };
                self.block
                    .forward_hooked(&h, &inputs.timestep, &attention, &mut temporal)
            }
        }?;
        match self.kind {
            BlockKind::Spatial => h.reshape((b, f, n, d)),
            BlockKind::Temporal => h.reshape((b, n, f, d))?.transpose(1, 2)?.contiguous(),
        }
    }
}

/// What PAB hooks in Latte, named as diffusers names it: `attn1` and `attn2` of each block
/// (a temporal block has no `attn2`), the blocks in execution order (spatial 0, temporal 0,
/// spatial 1, ...). diffusers' block hooks (First Block Cache, MagCache) do not run in Latte:
/// they need a cache context, which its pipeline does not open; PAB's hooks need none.
pub(super) const CACHE_NAMES: ModuleNames = ModuleNames {
    lists: &["transformer_blocks", "temporal_transformer_blocks"],
    interleaved: true,
    submodules: &[
        (Output::Attention, "attn1"),
        (Output::CrossAttention, "attn2"),
    ],
    absent: Absent::Nothing,
    proj_out: "proj_out",
};

crate::video_tokens_cached_forward!(LatteTransformer3DModel, BlockInputs);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_alternate_spatial_and_temporal() {
        let cfg = LatteTransformerConfig {
            num_layers: 2,
            ..Default::default()
        };
        let kinds: Vec<_> = (0..4).map(|i| block_at(&cfg, i).unwrap()).collect();
        assert_eq!(
            kinds,
            vec![
                (BlockKind::Spatial, 0),
                (BlockKind::Temporal, 0),
                (BlockKind::Spatial, 1),
                (BlockKind::Temporal, 1)
            ]
        );
        assert!(block_at(&cfg, 4).is_err());
    }

    #[test]
    fn hostile_configs_are_refused_with_the_key() {
        let good = LatteTransformerConfig {
            in_channels: Some(4),
            out_channels: Some(8),
            patch_size: Some(2),
            caption_channels: Some(32),
            cross_attention_dim: Some(32),
            num_attention_heads: 2,
            attention_head_dim: 16,
            sample_size: 4,
            norm_type: "ada_norm_single".into(),
            activation_fn: "gelu-approximate".into(),
            ..Default::default()
        };
        assert!(good.validate().is_ok());
        let cases = [
            (
                LatteTransformerConfig {
                    num_attention_heads: usize::MAX,
                    ..good.clone()
                },
                "num_attention_heads",
            ),
            (
                LatteTransformerConfig {
                    patch_size: Some(8),
                    ..good.clone()
                },
                "patch_size",
            ),
            (
                LatteTransformerConfig {
                    cross_attention_dim: Some(64),
                    ..good.clone()
                },
                "cross_attention_dim",
            ),
            (
                LatteTransformerConfig {
                    norm_type: "layer_norm".into(),
                    ..good.clone()
                },
                "norm_type",
            ),
            (
                LatteTransformerConfig {
                    in_channels: None,
                    ..good.clone()
                },
                "in_channels",
            ),
        ];
        for (bad, key) in cases {
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }
}
