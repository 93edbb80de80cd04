//! MiniMax H3's video VAE decoder (diffusers `AutoencoderKLMiniMaxH3`, decode path only).
//!
//! The decoder is a non-causal ViT: every latent voxel of a clip is a token; learned register
//! tokens and one all-zero token are appended, and `proj_out` expands each latent token into a
//! `temporal ratio x spatial ratio²` pixel block. A video is decoded in clips of
//! `tokens_chunk_size + token_overlap` latent frames (5 + 2 with the published settings) whose
//! pixel frames overlap and are cross-faded, and each clip is spatially tiled (256 px tiles with
//! at least 64 px overlap, linear blends) when larger than a tile. The encoder (used by the
//! image/video-conditioned workflows only) is not implemented; its weights are never read.
//!
//! Dtypes follow diffusers' reduced-precision runs: what `AutoencoderKLMiniMaxH3` keeps in
//! float32 (`_keep_in_fp32_modules`: the blocks' `norm1`/`norm2` and `scale1`/`scale2`, `norm_out`)
//! is loaded and computed in f32, so the residual stream of the block stack is f32 (a bf16
//! product times an f32 scale promotes); the projections, attention and feed-forward compute in
//! the `VarBuilder` dtype, their inputs cast to it after each f32 norm.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{LayerNorm, Linear, VarBuilder};
use serde::Deserialize;

use super::nn::{cos_sin, partial_rope, RmsNorm, SwiGlu};
use crate::models::attention::sdpa;
use crate::models::projection::project;

/// ImageNet statistics the decoder's RGB output is normalised with.
pub const PIXEL_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// See [`PIXEL_MEAN`].
pub const PIXEL_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// `vae/config.json`; missing keys take diffusers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct MiniMaxH3VaeConfig {
    /// Pixel channels out.
    pub out_channels: usize,
    /// Latent channels.
    pub latent_channels: usize,
    /// Per-stage spatial downsampling; their product is the spatial ratio.
    pub spatial_downsample_factors: Vec<usize>,
    /// Per-stage temporal downsampling; their product is the temporal ratio.
    pub temporal_downsample_factors: Vec<usize>,
    /// ViT decoder depth.
    pub decoder_num_layers: usize,
    /// ViT decoder heads.
    pub decoder_num_attention_heads: usize,
    /// ViT decoder head width.
    pub decoder_attention_head_dim: usize,
    /// Learned register tokens appended to every clip.
    pub decoder_num_register_tokens: usize,
    /// SwiGLU inner width = decoder width x this.
    pub decoder_ffn_mult: usize,
    /// Rotary base of the decoder.
    pub decoder_rope_theta: f64,
    /// Fraction of each head's channels that RoPE rotates.
    pub decoder_rope_dim_ratio: f64,
    /// Epsilon of the decoder's norms.
    pub decoder_norm_eps: f64,
    /// Pixel frames per encoded clip.
    pub clip_length: usize,
    /// Trailing latent frames the encoder drops per clip (sets the decode overlap).
    pub token_drop: usize,
    /// Per-channel latent mean: the pipeline decodes `z * std + mean`.
    pub latents_mean: Vec<f32>,
    /// Per-channel latent standard deviation.
    pub latents_std: Vec<f32>,
}

impl Default for MiniMaxH3VaeConfig {
    fn default() -> Self {
        Self {
            out_channels: 3,
            latent_channels: 24,
            spatial_downsample_factors: vec![2, 2, 2, 2, 1, 1],
            temporal_downsample_factors: vec![1, 2, 2, 1, 1, 1],
            decoder_num_layers: 36,
            decoder_num_attention_heads: 32,
            decoder_attention_head_dim: 64,
            decoder_num_register_tokens: 4,
            decoder_ffn_mult: 4,
            decoder_rope_theta: 100.0,
            decoder_rope_dim_ratio: 0.75,
            decoder_norm_eps: 1e-5,
            clip_length: 17,
            token_drop: 3,
            latents_mean: vec![0.0; 24],
            latents_std: vec![1.0; 24],
        }
    }
}

impl MiniMaxH3VaeConfig {
    /// Pixels per latent along height and width.
    pub fn spatial_ratio(&self) -> usize {
        self.spatial_downsample_factors.iter().product()
    }

    /// Pixel frames per latent frame.
    pub fn temporal_ratio(&self) -> usize {
        self.temporal_downsample_factors.iter().product()
    }

    /// Latent frames per encoded clip (`ceil(clip_length / temporal ratio)`).
    pub fn tokens_chunk_size(&self) -> usize {
        self.clip_length.div_ceil(self.temporal_ratio())
    }

    /// Pixel frames of padding the encoder implies in front of every clip.
    pub fn frame_pre_padding(&self) -> usize {
        (self.temporal_ratio() - self.clip_length % self.temporal_ratio()) % self.temporal_ratio()
    }

    /// Latent frames consecutive decode clips share.
    pub fn token_overlap(&self) -> usize {
        let chunk = self.tokens_chunk_size();
        (chunk - self.token_drop % chunk) % chunk
    }

    /// Pixel frames consecutive decoded chunks are cross-faded over.
    pub fn frame_overlap(&self) -> usize {
        (self.token_overlap() * self.temporal_ratio()).saturating_sub(self.frame_pre_padding())
    }

    /// Width of the decoder's residual stream.
    pub fn decoder_dim(&self) -> usize {
        self.decoder_num_attention_heads * self.decoder_attention_head_dim
    }

    /// Channels of each decoder head that RoPE rotates (`int(head_dim * ratio)`).
    pub fn decoder_rotary_dim(&self) -> usize {
        (self.decoder_attention_head_dim as f64 * self.decoder_rope_dim_ratio) as usize
    }

    /// Rejects configurations the decoder cannot run, naming the key.
    pub fn validate(&self) -> Result<()> {
        crate::models::config_checks::positive(
            "vae config",
            &[
                ("out_channels", self.out_channels),
                ("latent_channels", self.latent_channels),
                (
                    "decoder_num_attention_heads",
                    self.decoder_num_attention_heads,
                ),
                (
                    "decoder_attention_head_dim",
                    self.decoder_attention_head_dim,
                ),
                ("decoder_ffn_mult", self.decoder_ffn_mult),
                ("clip_length", self.clip_length),
            ],
        )?;
        if self.spatial_downsample_factors.is_empty()
            || self.spatial_downsample_factors.contains(&0)
        {
            candle_core::bail!("vae config: spatial_downsample_factors must be positive");
        }
        if self.temporal_downsample_factors.is_empty()
            || self.temporal_downsample_factors.contains(&0)
        {
            candle_core::bail!("vae config: temporal_downsample_factors must be positive");
        }
        let rotary = self.decoder_rotary_dim();
        if !(0.0..=1.0).contains(&self.decoder_rope_dim_ratio) || !rotary.is_multiple_of(6) {
            candle_core::bail!(
                "vae config: decoder_rope_dim_ratio {} gives {rotary} rotary channels, which must be a multiple of 6 within the head",
                self.decoder_rope_dim_ratio
            );
        }
        if !(self.decoder_rope_theta.is_finite() && self.decoder_rope_theta > 0.0) {
            candle_core::bail!("vae config: decoder_rope_theta must be a positive number");
        }
        if self.latents_mean.len() != self.latent_channels
            || self.latents_std.len() != self.latent_channels
        {
            candle_core::bail!(
                "vae config: latents_mean and latents_std need {} values (latent_channels), got {} and {}",
                self.latent_channels,
                self.latents_mean.len(),
                self.latents_std.len()
            );
        }
        Ok(())
    }
}

/// Spatial tiling of the decode (pixel units). diffusers' `AutoencoderKLMiniMaxH3` has it on with
/// 256 px tiles and at least 64 px overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tiling {
    /// Tile height.
    pub tile_height: usize,
    /// Tile width.
    pub tile_width: usize,
    /// Smallest overlap between vertically adjacent tiles.
    pub min_overlap_height: usize,
    /// Smallest overlap between horizontally adjacent tiles.
    pub min_overlap_width: usize,
}

impl Default for Tiling {
    fn default() -> Self {
        Self {
            tile_height: 256,
            tile_width: 256,
            min_overlap_height: 64,
            min_overlap_width: 64,
        }
    }
}

/// Tile starts and per-boundary overlaps covering `length` pixels (diffusers' `_split_tiles`):
/// the fewest `tile`-wide tiles whose overlaps are all at least `min_overlap`, the slack spread
/// round-robin over the overlaps in steps of `step` so every boundary stays latent-aligned.
fn split_tiles(
    length: usize,
    tile: usize,
    min_overlap: usize,
    step: usize,
) -> Result<(Vec<usize>, Vec<usize>)> {
    if tile >= length {
        return Ok((vec![0], Vec::new()));
    }
    if min_overlap >= tile {
        candle_core::bail!("tile overlap {min_overlap} must be smaller than the tile {tile}");
    }
    let mut tiles = length.div_ceil(tile);
    while tile * tiles < min_overlap * (tiles - 1) + length {
        tiles += 1;
    }
    let mut overlaps = vec![min_overlap; tiles - 1];
    let slack = tile * tiles - min_overlap * (tiles - 1) - length;
    for i in 0..slack / step {
        overlaps[i % (tiles - 1)] += step;
    }
    let mut starts = vec![0];
    for overlap in &overlaps {
        starts.push(starts[starts.len() - 1] + tile - overlap);
    }
    Ok((starts, overlaps))
}

/// diffusers' `_blend`: the last `extent` entries of `a` cross-faded into the first of `b`
/// along `dim` (weights `1 - k/extent` and `k/extent`), then the rest of `b`.
fn blend(a: &Tensor, b: &Tensor, extent: usize, dim: usize) -> Result<Tensor> {
    let (len_a, len_b) = (a.dim(dim)?, b.dim(dim)?);
    let extent = extent.min(len_a).min(len_b);
    if extent == 0 {
        return Ok(b.clone());
    }
    let mut shape = vec![1; b.rank()];
    shape[dim] = extent;
    let ramp: Vec<f32> = (0..extent).map(|k| k as f32 / extent as f32).collect();
    let weight_b = Tensor::from_vec(ramp, shape, b.device())?.to_dtype(b.dtype())?;
    let weight_a = weight_b.affine(-1.0, 1.0)?;
    let blended = (a
        .narrow(dim, len_a - extent, extent)?
        .broadcast_mul(&weight_a)?
        + b.narrow(dim, 0, extent)?.broadcast_mul(&weight_b)?)?;
    if extent == len_b {
        return Ok(blended);
    }
    Tensor::cat(&[blended, b.narrow(dim, extent, len_b - extent)?], dim)
}

/// Self-attention of the ViT decoder: biased projections, weightless per-head RMSNorm on q and
/// k, partial RoPE.
#[derive(Debug, Clone)]
struct DecoderAttention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    norm: RmsNorm,
    heads: usize,
    head_dim: usize,
}

impl DecoderAttention {
    fn new(cfg: &MiniMaxH3VaeConfig, vb: VarBuilder) -> Result<Self> {
        let dim = cfg.decoder_dim();
        Ok(Self {
            to_q: candle_nn::linear(dim, dim, vb.pp("to_q"))?,
            to_k: candle_nn::linear(dim, dim, vb.pp("to_k"))?,
            to_v: candle_nn::linear(dim, dim, vb.pp("to_v"))?,
            to_out: candle_nn::linear(dim, dim, vb.pp("to_out.0"))?,
            norm: RmsNorm::without_weight(
                cfg.decoder_attention_head_dim,
                cfg.decoder_norm_eps,
                &vb,
            )?,
            heads: cfg.decoder_num_attention_heads,
            head_dim: cfg.decoder_attention_head_dim,
        })
    }

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if crate::models::row_ops::supported(x) && cos.dim(1)? > 0 {
            return self.forward_fused(x, cos, sin);
        }
        self.forward_composed(x, cos, sin)
    }

    /// [`forward`](Self::forward) in candle's operations, on any device and dtype.
    fn forward_composed(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (b, n, dim) = x.dims3()?;
        let split = |t: Tensor, norm: bool| -> Result<Tensor> {
            let t = t.reshape((b, n, self.heads, self.head_dim))?;
            let t = if norm { self.norm.forward(&t)? } else { t };
            t.transpose(1, 2)?.contiguous()
        };
        let q = partial_rope(&split(project(&self.to_q, x)?, true)?, cos, sin)?;
        let k = partial_rope(&split(project(&self.to_k, x)?, true)?, cos, sin)?;
        let v = split(project(&self.to_v, x)?, false)?;
        let out = sdpa(&q, &k, &v, 1.0 / (self.head_dim as f64).sqrt())?;
        project(&self.to_out, &out.transpose(1, 2)?.reshape((b, n, dim))?)
    }

    /// [`forward`](Self::forward) on CUDA in bf16: each projection's bias in its matmul's
    /// epilogue (rounded once, as torch's Linear), and each head's q/k norm and RoPE one kernel
    /// in place over the token-major rows, which attention reads through strides.
    #[cfg(feature = "cuda")]
    fn forward_fused(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        use crate::models::row_ops::{self, Rows};
        let (b, n, dim) = x.dims3()?;
        let at = Rows { row0: 0, seq: n };
        let rotary = 2 * cos.dim(1)?;
        let eps = self.norm.eps as f64;
        let heads = |t: Tensor| {
            let t = row_ops::head_rms_rope_half(
                t,
                &self.norm.weight,
                (cos, sin),
                self.head_dim,
                rotary,
                at,
                eps,
            )?;
            t.reshape((b, n, self.heads, self.head_dim))?
                .transpose(1, 2)
        };
        let rows = x.reshape((b * n, dim))?;
        let q = heads(project(&self.to_q, &rows)?)?;
        let k = heads(project(&self.to_k, &rows)?)?;
        let v = project(&self.to_v, &rows)?
            .reshape((b, n, self.heads, self.head_dim))?
            .transpose(1, 2)?;
        let out = sdpa(&q, &k, &v, 1.0 / (self.head_dim as f64).sqrt())?
            .transpose(1, 2)?
            .reshape((b * n, dim))?;
        project(&self.to_out, &out)?.reshape((b, n, dim))
    }
}

/// One ViT decoder block: `x += attn(norm1(x)) * scale1; x += ffn(norm2(x)) * scale2`, the
/// residual stream, norms and scales in f32.
#[derive(Debug, Clone)]
pub struct MiniMaxH3VaeDecoderBlock {
    norm1: RmsNorm,
    attn: DecoderAttention,
    scale1: Tensor,
    norm2: RmsNorm,
    ff: SwiGlu,
    scale2: Tensor,
}

impl MiniMaxH3VaeDecoderBlock {
    /// Loads one block from `vb` = `decoder.transformer_blocks.{i}`.
    pub fn new(cfg: &MiniMaxH3VaeConfig, vb: VarBuilder) -> Result<Self> {
        let dim = cfg.decoder_dim();
        let f32_vb = vb.clone().set_dtype(DType::F32);
        Ok(Self {
            norm1: RmsNorm::new(dim, cfg.decoder_norm_eps, f32_vb.pp("norm1"))?,
            attn: DecoderAttention::new(cfg, vb.pp("attn"))?,
            scale1: f32_vb.get(dim, "scale1")?,
            norm2: RmsNorm::new(dim, cfg.decoder_norm_eps, f32_vb.pp("norm2"))?,
            ff: SwiGlu::new(dim, dim * cfg.decoder_ffn_mult, true, vb.pp("ff"), false)?,
            scale2: f32_vb.get(dim, "scale2")?,
        })
    }

    /// `x` f32 `[B, tokens, dim]`, the residual stream (on CUDA with bf16 layers updated in
    /// place); `cos`/`sin` the half RoPE tables `[tokens, rotary / 2]`.
    pub fn forward(&self, x: Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda()
            && x.dtype() == DType::F32
            && self.attn.to_q.weight().dtype() == DType::BF16
        {
            return self.forward_fused(x, cos, sin);
        }
        self.forward_composed(&x, cos, sin)
    }

    /// [`forward`](Self::forward) in candle's operations, on any device and dtype.
    fn forward_composed(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let dtype = self.attn.to_q.weight().dtype();
        let h = self.norm1.forward(x)?.to_dtype(dtype)?;
        let attn = self.attn.forward(&h, cos, sin)?.to_dtype(DType::F32)?;
        let x = (x + attn.broadcast_mul(&self.scale1)?)?;
        let h = self.norm2.forward(&x)?.to_dtype(dtype)?;
        let ff = self.ff.forward(&h)?.to_dtype(DType::F32)?;
        &x + ff.broadcast_mul(&self.scale2)?
    }

    /// [`forward`](Self::forward) on CUDA with bf16 layers: each f32 norm and the cast of its
    /// output one kernel, each scaled residual update one kernel in place on the stream.
    #[cfg(feature = "cuda")]
    fn forward_fused(&self, x: Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        use crate::models::row_ops;
        let (b, n, dim) = x.dims3()?;
        let x = x.contiguous()?;
        let rows = x.reshape((b * n, dim))?;
        let normed = |norm: &RmsNorm| {
            row_ops::rms_norm_f32_to_bf16(&rows, &norm.weight, norm.eps as f64)?
                .reshape((b, n, dim))
        };
        let attn = self.attn.forward(&normed(&self.norm1)?, cos, sin)?;
        row_ops::residual_scaled_f32(&rows, &attn.reshape((b * n, dim))?, &self.scale1)?;
        let ff = self.ff.forward(&normed(&self.norm2)?)?;
        row_ops::residual_scaled_f32(&rows, &ff.reshape((b * n, dim))?, &self.scale2)?;
        Ok(x)
    }
}

/// The decode half of `AutoencoderKLMiniMaxH3`: `post_quant_conv`, the ViT decoder, clip
/// chunking with cross-fades and spatial tiling.
#[derive(Debug, Clone)]
pub struct MiniMaxH3VaeDecoder {
    cfg: MiniMaxH3VaeConfig,
    /// 1x1x1 Conv3d as a linear over channels.
    post_quant_conv: Linear,
    proj_in: Linear,
    register_tokens: Tensor,
    blocks: Vec<MiniMaxH3VaeDecoderBlock>,
    norm_out: LayerNorm,
    proj_out: Linear,
    /// Spatial tiling of each clip; `None` decodes whole frames.
    pub tiling: Option<Tiling>,
    /// How many tiles of a clip one decoder call takes as a batch. 1 by default: a whole clip's
    /// 28 tiles per call decoded the 5 s request 4% faster on an H100 at 3.4x the device memory
    /// (bench/RESULTS.md, session 58), above diffusers' tiled peak.
    pub tiles_per_call: usize,
}

impl MiniMaxH3VaeDecoder {
    /// Loads the decoder from the VAE root `vb` (`vae/diffusion_pytorch_model.safetensors`),
    /// with diffusers' default tiling.
    pub fn new(cfg: &MiniMaxH3VaeConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let (c, dim) = (cfg.latent_channels, cfg.decoder_dim());
        let pq = vb.pp("post_quant_conv");
        let post_quant_conv = Linear::new(
            pq.get((c, c, 1, 1, 1), "weight")?.reshape((c, c))?,
            Some(pq.get(c, "bias")?),
        );
        let dvb = vb.pp("decoder");
        let blocks = (0..cfg.decoder_num_layers)
            .map(|i| MiniMaxH3VaeDecoderBlock::new(cfg, dvb.pp(format!("transformer_blocks.{i}"))))
            .collect::<Result<_>>()?;
        let pixels_per_token = cfg.out_channels * cfg.temporal_ratio() * cfg.spatial_ratio().pow(2);
        Ok(Self {
            post_quant_conv,
            proj_in: candle_nn::linear(c, dim, dvb.pp("proj_in"))?,
            register_tokens: dvb
                .get((1, cfg.decoder_num_register_tokens, dim), "register_tokens")?,
            blocks,
            norm_out: candle_nn::layer_norm(
                dim,
                cfg.decoder_norm_eps,
                dvb.clone().set_dtype(DType::F32).pp("norm_out"),
            )?,
            proj_out: candle_nn::linear(dim, pixels_per_token, dvb.pp("proj_out"))?,
            tiling: Some(Tiling::default()),
            tiles_per_call: 1,
            cfg: cfg.clone(),
        })
    }

    /// The configuration the decoder was built with.
    pub fn config(&self) -> &MiniMaxH3VaeConfig {
        &self.cfg
    }

    /// `z * latents_std + latents_mean` per channel of `[B, C, F, H, W]` normalised latents.
    pub fn denormalize(&self, latents: &Tensor) -> Result<Tensor> {
        let c = self.cfg.latent_channels;
        let device = latents.device();
        let std = Tensor::new(self.cfg.latents_std.as_slice(), device)?.reshape((1, c, 1, 1, 1))?;
        let mean =
            Tensor::new(self.cfg.latents_mean.as_slice(), device)?.reshape((1, c, 1, 1, 1))?;
        latents
            .broadcast_mul(&std.to_dtype(latents.dtype())?)?
            .broadcast_add(&mean.to_dtype(latents.dtype())?)
    }

    /// RoPE half tables for a `[frames, height, width]` token grid plus the extra tokens (at
    /// position 0): per axis positions `2 (i + 0.5) / size - 1`, angles `2π · pos · inv_freq`
    /// with `inv_freq = 1 / theta^(arange(0, 1, 6 / rotary))`, in f32 as diffusers computes them.
    fn rope(&self, grid: [usize; 3], device: &Device) -> Result<(Tensor, Tensor)> {
        let rotary = self.cfg.decoder_rotary_dim();
        let per_axis = rotary / 6;
        let theta = self.cfg.decoder_rope_theta as f32 as f64;
        let step = 6.0 / rotary as f64;
        let inv_freq: Vec<f32> = (0..per_axis)
            .map(|j| 1.0 / (theta.powf((j as f64 * step) as f32 as f64) as f32))
            .collect();
        let axis = |size: usize| -> Vec<f32> {
            (0..size)
                .map(|i| 2.0 * ((i as f32 + 0.5) / size as f32) - 1.0)
                .collect()
        };
        let [f, h, w] = grid;
        let (tf, th, tw) = (axis(f), axis(h), axis(w));
        let two_pi = (2.0 * std::f64::consts::PI) as f32;
        let extra = self.cfg.decoder_num_register_tokens + 1;
        let tokens = f * h * w + extra;
        let width = 3 * per_axis;
        let mut angles = Vec::with_capacity(tokens * width);
        for &pt in &tf {
            for &ph in &th {
                for &pw in &tw {
                    for pos in [pt, ph, pw] {
                        angles.extend(inv_freq.iter().map(|&inv| (two_pi * pos) * inv));
                    }
                }
            }
        }
        angles.resize(tokens * width, 0.0);
        cos_sin(&angles, tokens, width, device)
    }

    /// One decoder call without chunking or tiling: denormalised latents `[B, C, F, H, W]` ->
    /// ImageNet-normalised RGB `[B, 3, F·rt, H·rs, W·rs]` (`decoder(post_quant_conv(z))`).
    pub fn decode_clip_untiled(&self, z: &Tensor) -> Result<Tensor> {
        let (b, c, f, h, w) = z.dims5()?;
        if c != self.cfg.latent_channels {
            candle_core::bail!(
                "latents have {c} channels, the VAE expects {}",
                self.cfg.latent_channels
            );
        }
        let tokens = f * h * w;
        let x = z.permute((0, 2, 3, 4, 1))?.reshape((b, tokens, c))?;
        let x = project(&self.proj_in, &project(&self.post_quant_conv, &x)?)?;
        let dim = x.dim(D::Minus1)?;
        let registers = self.register_tokens.to_dtype(x.dtype())?.broadcast_as((
            b,
            self.cfg.decoder_num_register_tokens,
            dim,
        ))?;
        let zero = Tensor::zeros((b, 1, dim), x.dtype(), x.device())?;
        // The residual stream in f32 from the first block on (exact: a bf16 value is an f32).
        let mut x = Tensor::cat(&[&x, &registers, &zero], 1)?.to_dtype(DType::F32)?;
        let (cos, sin) = self.rope([f, h, w], x.device())?;
        for block in &self.blocks {
            x = block.forward(x, &cos, &sin)?;
        }
        let normed = self.norm_out.forward(&x)?;
        let x = project(
            &self.proj_out,
            &normed.to_dtype(self.proj_out.weight().dtype())?,
        )?
        .narrow(1, 0, tokens)?;
        let (rt, rs) = (self.cfg.temporal_ratio(), self.cfg.spatial_ratio());
        crate::models::patches::unpatchify(&x, [f, h, w], [rt, rs, rs])
    }

    /// One clip, spatially tiled when tiling is on and the clip exceeds a tile.
    pub fn decode_clip(&self, z: &Tensor) -> Result<Tensor> {
        let Some(tiling) = self.tiling else {
            return self.decode_clip_untiled(z);
        };
        let ratio = self.cfg.spatial_ratio();
        let (height, width) = (z.dim(3)? * ratio, z.dim(4)? * ratio);
        let (ys, y_overlaps) =
            split_tiles(height, tiling.tile_height, tiling.min_overlap_height, ratio)?;
        let (xs, x_overlaps) =
            split_tiles(width, tiling.tile_width, tiling.min_overlap_width, ratio)?;
        let (tile_h, tile_w) = (tiling.tile_height.min(height), tiling.tile_width.min(width));
        let mut inputs = Vec::with_capacity(ys.len() * xs.len());
        for &y in &ys {
            for &x in &xs {
                let rows = z.narrow(3, y / ratio, tile_h / ratio)?;
                inputs.push(rows.narrow(4, x / ratio, tile_w / ratio)?);
            }
        }
        // Tiles are equal in size and decoded independently: `tiles_per_call` of them share
        // each decoder call as one batch (wider matmuls, the same math per tile).
        let b = z.dim(0)?;
        let mut decoded = Vec::with_capacity(inputs.len());
        for group in inputs.chunks(self.tiles_per_call.max(1)) {
            let out = self.decode_clip_untiled(&Tensor::cat(group, 0)?)?;
            for i in 0..group.len() {
                decoded.push(out.narrow(0, i * b, b)?);
            }
        }
        let tiles: Vec<Vec<Tensor>> = decoded.chunks(xs.len()).map(<[Tensor]>::to_vec).collect();
        stitch_tiles(&tiles, &y_overlaps, &x_overlaps)
    }

    /// `vae.decode` of denormalised latents `[B, C, F, H, W]`: clips of latent frames
    /// `[i·chunk, i·chunk + chunk + overlap)`, each decoded clip split into the chunk (after the
    /// implicit pre-padding) and the tail the next chunk is cross-faded with; lengths that are
    /// not whole chunks are padded by repeating the last latent frame and cropped after. For
    /// `F = 5n + 2` the result has `17n + 5` frames with the published settings.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        let mut pieces = Vec::new();
        let frames = self.decode_into(z, |piece| {
            pieces.push(piece);
            Ok(())
        })?;
        Tensor::cat(&pieces, 2)?.narrow(2, 0, frames)
    }

    /// [`decode`](Self::decode) handing each finished stretch of frames `[B, 3, n, H, W]` to
    /// `sink`, in order, as soon as it is cross-faded (so the caller decides where the video
    /// waits); returns how many of the frames handed out make the video (the padding's frames
    /// at the end are not part of it).
    pub fn decode_into(
        &self,
        z: &Tensor,
        mut sink: impl FnMut(Tensor) -> Result<()>,
    ) -> Result<usize> {
        let cfg = &self.cfg;
        let chunk = cfg.tokens_chunk_size();
        let rt = cfg.temporal_ratio();
        let chunk_frames = chunk * rt;
        let pre = cfg.frame_pre_padding();
        let drop = cfg.token_drop;
        let frames = z.dim(2)?;
        if frames == 0 {
            candle_core::bail!("no latent frames to decode");
        }
        let tokens = frames + drop;
        let pad = (chunk - tokens % chunk) % chunk;
        let chunks = (tokens + pad) / chunk - usize::from(drop > 0);
        if chunks == 0 {
            candle_core::bail!("{frames} latent frames are too few to decode (token_drop {drop})");
        }
        let z = if pad > 0 {
            let last = z.narrow(2, frames - 1, 1)?;
            let repeats: Vec<&Tensor> = std::iter::repeat_n(&last, pad).collect();
            Tensor::cat(&[&[z], repeats.as_slice()].concat(), 2)?
        } else {
            z.clone()
        };
        let total = z.dim(2)?;
        let mut emitted = 0;
        let mut tail: Option<Tensor> = None;
        for i in 0..chunks {
            let start = i * chunk;
            let len = (chunk + cfg.token_overlap()).min(total.saturating_sub(start));
            if len == 0 {
                candle_core::bail!("decode clip {i} starts past the latents");
            }
            let clip = self.decode_clip(&z.narrow(2, start, len)?)?;
            let clip_frames = clip.dim(2)?;
            for part in 0..=usize::from(drop > 0) {
                let from = (part * chunk_frames + pre).min(clip_frames);
                let to = ((part + 1) * chunk_frames).min(clip_frames);
                let piece = clip.narrow(2, from, to.saturating_sub(from))?;
                if part == 0 {
                    let piece = match &tail {
                        Some(prev) => blend(prev, &piece, cfg.frame_overlap(), 2)?,
                        None => piece,
                    };
                    emitted += piece.dim(2)?;
                    sink(piece)?;
                } else {
                    tail = Some(piece);
                }
            }
        }
        if let Some(piece) = tail {
            emitted += piece.dim(2)?;
            sink(piece)?;
        }
        if pad == 0 {
            return Ok(emitted);
        }
        // A chunk's last latent frame covers only `clip_length % rt` pixel frames.
        let intra_tail = cfg.clip_length % rt;
        let before_pad = total - pad;
        let extra: usize = (0..pad)
            .map(|k| {
                if intra_tail > 0 && (before_pad + k).is_multiple_of(chunk) {
                    intra_tail
                } else {
                    rt
                }
            })
            .sum();
        Ok(emitted.saturating_sub(extra))
    }
}

/// diffusers' `_stitch_tiles`: blend each tile into its upper and left neighbours, crop the
/// overlaps, concatenate.
fn stitch_tiles(
    tiles: &[Vec<Tensor>],
    y_overlaps: &[usize],
    x_overlaps: &[usize],
) -> Result<Tensor> {
    let (h_dim, w_dim) = (3, 4);
    let mut rows = Vec::with_capacity(tiles.len());
    for (i, row) in tiles.iter().enumerate() {
        let mut out_row = Vec::with_capacity(row.len());
        for (j, tile) in row.iter().enumerate() {
            let mut tile = tile.clone();
            if i > 0 {
                tile = blend(&tiles[i - 1][j], &tile, y_overlaps[i - 1], h_dim)?;
            }
            if j > 0 {
                tile = blend(&row[j - 1], &tile, x_overlaps[j - 1], w_dim)?;
            }
            if i + 1 < tiles.len() {
                let n = tile.dim(h_dim)?;
                tile = tile.narrow(h_dim, 0, n - y_overlaps[i])?;
            }
            if j + 1 < row.len() {
                let n = tile.dim(w_dim)?;
                tile = tile.narrow(w_dim, 0, n - x_overlaps[j])?;
            }
            out_row.push(tile);
        }
        rows.push(Tensor::cat(&out_row, w_dim)?);
    }
    Tensor::cat(&rows, h_dim)
}

/// The pipeline's frames from a decode: `clamp(decoded · PIXEL_STD + PIXEL_MEAN, 0, 1)` of
/// `[B, 3, T, H, W]`, in f32 and the same layout. One op per statement, so at most two f32
/// copies exist at once (a method chain keeps every temporary to its end).
pub fn decoded_to_unit_range(decoded: &Tensor) -> Result<Tensor> {
    let device = decoded.device();
    let std = Tensor::new(&PIXEL_STD, device)?.reshape((1, 3, 1, 1, 1))?;
    let mean = Tensor::new(&PIXEL_MEAN, device)?.reshape((1, 3, 1, 1, 1))?;
    let mut x = decoded.to_dtype(DType::F32)?;
    x = x.broadcast_mul(&std)?;
    x = x.broadcast_add(&mean)?;
    x.clamp(0f32, 1f32)
}

crate::placed_whole!(
    MiniMaxH3VaeDecoder,
    MiniMaxH3VaeConfig,
    MiniMaxH3VaeDecoder::new
);

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    //! The decoder's fused attention against the composition it replaces, on the GPU in bf16 at
    //! the published width (32 heads of 64, 48 rotary channels), two batch entries.
    use super::*;
    use crate::models::row_ops::test_util::{device, randn};
    use std::collections::HashMap;

    #[test]
    fn fused_attention_matches_composition() -> Result<()> {
        let Some(dev) = device("MiniMax H3 VAE attention") else {
            return Ok(());
        };
        let cfg = MiniMaxH3VaeConfig::default();
        let (dim, n) = (cfg.decoder_dim(), 300);
        let mut weights = HashMap::new();
        attention_weights(&mut weights, "", dim, &dev)?;
        let vb = VarBuilder::from_tensors(weights, DType::BF16, &dev);
        let attn = DecoderAttention::new(&cfg, vb)?;
        let (cos, sin) = rope_tables(&cfg, n, &dev)?;
        let x = randn(&[2, n, dim], 1.0, &dev)?;
        let fused = attn.forward_fused(&x, &cos, &sin)?.to_dtype(DType::F32)?;
        let composed = attn
            .forward_composed(&x, &cos, &sin)?
            .to_dtype(DType::F32)?;
        let rel = relative_l2(&fused, &composed)?;
        println!("fused vs composed attention: relative L2 {rel:.2e}");
        assert!(rel < 1e-2, "relative L2 {rel}");
        Ok(())
    }

    /// Random bf16 weights and biases of the attention's four Linears under `prefix`.
    fn attention_weights(
        weights: &mut HashMap<String, Tensor>,
        prefix: &str,
        dim: usize,
        dev: &Device,
    ) -> Result<()> {
        let std = 1.0 / (dim as f64).sqrt();
        for name in ["to_q", "to_k", "to_v", "to_out.0"] {
            weights.insert(
                format!("{prefix}{name}.weight"),
                randn(&[dim, dim], std, dev)?,
            );
            weights.insert(format!("{prefix}{name}.bias"), randn(&[dim], 0.1, dev)?);
        }
        Ok(())
    }

    /// Half RoPE tables of `n` positions at arbitrary angles.
    fn rope_tables(cfg: &MiniMaxH3VaeConfig, n: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let half = cfg.decoder_rotary_dim() / 2;
        let angles: Vec<f32> = (0..n * half).map(|i| (i % 97) as f32 * 0.37).collect();
        cos_sin(&angles, n, half, dev)
    }

    fn relative_l2(a: &Tensor, b: &Tensor) -> Result<f32> {
        let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
        ((&a - &b)?.sqr()?.sum_all()?.sqrt()? / b.sqr()?.sum_all()?.sqrt()?)?.to_scalar::<f32>()
    }

    /// The f32-stream kernels against candle's operations: the scaled residual update bit for
    /// bit, the norm and its cast within a bf16 unit in the last place, a whole block (its
    /// attention fused too) close to the composed one.
    #[test]
    fn fused_block_matches_composition() -> Result<()> {
        let Some(dev) = device("MiniMax H3 VAE block") else {
            return Ok(());
        };
        let cfg = MiniMaxH3VaeConfig::default();
        let (dim, n) = (cfg.decoder_dim(), 300);
        let rows = 2 * n;
        let x = Tensor::randn(0f32, 2.0, (rows, dim), &dev)?;
        let delta = randn(&[rows, dim], 1.0, &dev)?;
        let scale = Tensor::randn(0.5f32, 0.1, dim, &dev)?;
        let want = (&x + delta.to_dtype(DType::F32)?.broadcast_mul(&scale)?)?;
        let got = x.copy()?;
        crate::models::row_ops::residual_scaled_f32(&got, &delta, &scale)?;
        let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "scaled residual update");

        let w = Tensor::randn(1f32, 0.1, dim, &dev)?;
        let norm = RmsNorm {
            weight: w,
            eps: 1e-5,
        };
        let want = norm
            .forward(&x)?
            .to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?;
        let got = crate::models::row_ops::rms_norm_f32_to_bf16(&x, &norm.weight, 1e-5)?
            .to_dtype(DType::F32)?;
        // One bf16 unit in the last place at each value: 2^(floor(log2 |v|) - 7).
        let ulp = want.abs()?.log()?.affine(1.0 / 2f64.ln(), 0.0)?.floor()?;
        let ulp = (ulp.affine(1.0, -7.0)? * 2f64.ln())?.exp()?;
        let over = (((&got - &want)?.abs()? - ulp)?.max_all()?).to_scalar::<f32>()?;
        assert!(
            over <= 0.0,
            "norm to bf16 beyond a unit in the last place by {over}"
        );

        let mut weights = HashMap::new();
        attention_weights(&mut weights, "attn.", dim, &dev)?;
        let std = 1.0 / (dim as f64).sqrt();
        let inner = dim * cfg.decoder_ffn_mult;
        weights.insert(
            "ff.net.0.proj.weight".into(),
            randn(&[2 * inner, dim], std, &dev)?,
        );
        weights.insert("ff.net.0.proj.bias".into(), randn(&[2 * inner], 0.1, &dev)?);
        let std_out = 1.0 / (inner as f64).sqrt();
        weights.insert(
            "ff.net.2.weight".into(),
            randn(&[dim, inner], std_out, &dev)?,
        );
        weights.insert("ff.net.2.bias".into(), randn(&[dim], 0.1, &dev)?);
        for name in ["norm1.weight", "norm2.weight"] {
            weights.insert(name.into(), Tensor::randn(1f32, 0.1, dim, &dev)?);
        }
        for name in ["scale1", "scale2"] {
            weights.insert(name.into(), Tensor::randn(0.5f32, 0.1, dim, &dev)?);
        }
        let vb = VarBuilder::from_tensors(weights, DType::BF16, &dev);
        let block = MiniMaxH3VaeDecoderBlock::new(&cfg, vb)?;
        let (cos, sin) = rope_tables(&cfg, n, &dev)?;
        let x = x.reshape((2, n, dim))?;
        let composed = block.forward_composed(&x, &cos, &sin)?;
        let fused = block.forward_fused(x.copy()?, &cos, &sin)?;
        assert_eq!(fused.dtype(), DType::F32);
        let rel = relative_l2(&fused, &composed)?;
        println!("fused vs composed block: relative L2 {rel:.2e}");
        assert!(rel < 5e-3, "relative L2 {rel}");
        Ok(())
    }
}
