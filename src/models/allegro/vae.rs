//! Allegro's video VAE decoder (diffusers `AutoencoderKLAllegro`), which decodes in tiles only.
//!
//! The decoder is the SD decoder run frame by frame (2-D resnets, mid-block attention,
//! nearest upsamplers) with `AllegroTemporalConvLayer`s after every resnet: four GroupNorm →
//! SiLU → Conv3d stages over the frames, edge frames repeated as padding, added to the input;
//! the temporal upsamplers double the frames by splitting their channels in two. Tiles are
//! `24 × S × S` pixels (`S` = `sample_size`) with diffusers' fixed overlaps of 8 frames, 120 rows
//! and 80 columns; each decoded tile is faded linearly over the overlaps it shares with a
//! neighbour and the tiles are summed. Tensors are `[B, C, T, H, W]`; no encoder (the
//! text-to-video pipeline never encodes).

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Deserialize;

use crate::models::autoencoder_kl::blocks::{Conv2d, MidAttention, ResnetBlock2D, Upsample2D};
use crate::models::conv3d::{add_channel_bias, conv3d_anywhere};
use crate::models::runs::RunGroupNorm;
use crate::models::video::VideoVae;

/// Frames of a pixel tile (`AutoencoderKLAllegro.__init__`'s fixed `sample_frames`).
pub const TILE_FRAMES: usize = 24;

/// Overlaps of neighbouring pixel tiles (frames, rows, columns), fixed in diffusers.
pub const TILE_OVERLAP: [usize; 3] = [8, 120, 80];

/// Epsilon of the decoder's resnets, attention and output norm (`resnet_eps`).
const NORM_EPS: f64 = 1e-6;

/// Epsilon of the temporal layers' GroupNorms (`nn.GroupNorm`'s default).
const TEMPORAL_NORM_EPS: f64 = 1e-5;

/// `vae/config.json` of an `AutoencoderKLAllegro`, with diffusers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct AllegroVaeConfig {
    /// Channels of the video the encoder takes (no encoder here: checked, not used).
    pub in_channels: usize,
    /// Channels of the decoded video.
    pub out_channels: usize,
    /// Only `AllegroUpBlock3D`.
    pub up_block_types: Vec<String>,
    /// Channels per level, image side first (the decoder runs them in reverse).
    pub block_out_channels: Vec<usize>,
    /// Which up blocks double the frames.
    pub temporal_upsample_blocks: Vec<bool>,
    /// Channels of the latents.
    pub latent_channels: usize,
    /// Resnets per down block; the up blocks have one more.
    pub layers_per_block: usize,
    /// Only `silu`.
    pub act_fn: String,
    /// Groups of every GroupNorm.
    pub norm_num_groups: usize,
    /// Frames per latent frame (the temporal upsamplers must make exactly this).
    pub temporal_compression_ratio: f64,
    /// Side of a pixel tile.
    pub sample_size: usize,
    /// The decode input is `1 / scaling_factor · latents`.
    pub scaling_factor: f64,
}

impl Default for AllegroVaeConfig {
    fn default() -> Self {
        // The defaults of `AutoencoderKLAllegro.__init__`.
        Self {
            in_channels: 3,
            out_channels: 3,
            up_block_types: vec!["AllegroUpBlock3D".into(); 4],
            block_out_channels: vec![128, 256, 512, 512],
            temporal_upsample_blocks: vec![false, true, true, false],
            latent_channels: 4,
            layers_per_block: 2,
            act_fn: "silu".into(),
            norm_num_groups: 32,
            temporal_compression_ratio: 4.0,
            sample_size: 320,
            scaling_factor: 0.13,
        }
    }
}

impl AllegroVaeConfig {
    /// Pixels per latent pixel: `2^(levels − 1)`.
    pub fn spatial_compression_ratio(&self) -> usize {
        1 << self.block_out_channels.len().saturating_sub(1).min(16)
    }

    /// Frames per latent frame.
    pub fn temporal_compression_ratio(&self) -> usize {
        self.temporal_compression_ratio as usize
    }

    /// The pixel tile `[frames, rows, columns]`.
    pub fn tile(&self) -> [usize; 3] {
        [TILE_FRAMES, self.sample_size, self.sample_size]
    }

    /// The latent tile: the pixel tile over the compression ratios.
    pub fn latent_tile(&self) -> [usize; 3] {
        let (rt, rs) = (
            self.temporal_compression_ratio().max(1),
            self.spatial_compression_ratio(),
        );
        [
            TILE_FRAMES / rt,
            self.sample_size / rs,
            self.sample_size / rs,
        ]
    }

    /// Pixel strides between tiles (negative where a tile is smaller than its overlap).
    fn stride(&self) -> [i64; 3] {
        let tile = self.tile();
        [0, 1, 2].map(|a| tile[a] as i64 - TILE_OVERLAP[a] as i64)
    }

    /// Latent strides: the pixel strides floor-divided by the ratios, as Python's `//`.
    fn latent_stride(&self) -> [i64; 3] {
        let r = [
            self.temporal_compression_ratio().max(1),
            self.spatial_compression_ratio(),
            self.spatial_compression_ratio(),
        ];
        let stride = self.stride();
        [0, 1, 2].map(|a| stride[a].div_euclid(r[a] as i64))
    }

    /// Tiles along each axis of latents `[F, h, w]`: `⌊(n − k) / s⌋ + 1` (0 or fewer: none).
    pub fn tiles(&self, latent: [usize; 3]) -> [usize; 3] {
        let (k, s) = (self.latent_tile(), self.latent_stride());
        [0, 1, 2].map(|a| {
            let n = (latent[a] as f64 - k[a] as f64) / s[a] as f64;
            (n.floor() + 1.0).max(0.0) as usize
        })
    }

    /// Why latents `[F, h, w]` cannot be decoded, if they cannot: diffusers' tiled decode fails
    /// on an axis shorter than a tile, and decodes nothing along one no tile fits (a frame larger
    /// than a tile whose overlap exceeds it).
    pub fn decode_refusal(&self, latent: [usize; 3]) -> Option<String> {
        let k = self.latent_tile();
        let tiles = self.tiles(latent);
        let axes = ["frames", "rows", "columns"];
        (0..3).find_map(|a| {
            if latent[a] < k[a] {
                Some(format!(
                    "{} latent {} are fewer than a VAE tile's {}",
                    latent[a], axes[a], k[a]
                ))
            } else if tiles[a] == 0 {
                Some(format!(
                    "{} latent {} fit no VAE tile of {} (its tiles overlap by more than they span)",
                    latent[a], axes[a], k[a]
                ))
            } else {
                None
            }
        })
    }

    /// Rejects configurations this decoder cannot run, with the key at fault.
    pub fn validate(&self) -> Result<()> {
        let levels = self.block_out_channels.len();
        if levels == 0 || levels > 16 {
            candle_core::bail!("vae config: block_out_channels must list 1 to 16 levels");
        }
        if self.up_block_types.len() != levels || self.temporal_upsample_blocks.len() != levels {
            candle_core::bail!(
                "vae config: up_block_types and temporal_upsample_blocks must list {levels} entries (one per block_out_channels)"
            );
        }
        if let Some(t) = self
            .up_block_types
            .iter()
            .find(|t| *t != "AllegroUpBlock3D")
        {
            candle_core::bail!(
                "vae config: up block type {t:?} is not supported (only \"AllegroUpBlock3D\")"
            );
        }
        crate::models::config_checks::one_of("vae config", ("act_fn", &self.act_fn), &["silu"])?;
        let g = self.norm_num_groups;
        if g == 0
            || self
                .block_out_channels
                .iter()
                .any(|&c| c == 0 || c > 1 << 16 || c % g != 0)
        {
            candle_core::bail!(
                "vae config: every block_out_channels entry must be a positive multiple of norm_num_groups {g} (at most 65536)"
            );
        }
        let positive = [
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("latent_channels", self.latent_channels),
            ("sample_size", self.sample_size),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0 || *v > 1 << 16) {
            candle_core::bail!("vae config: {key} must be between 1 and 65536");
        }
        if self.layers_per_block > 64 {
            candle_core::bail!("vae config: layers_per_block must be at most 64");
        }
        let doublings = self.temporal_upsample_blocks.iter().filter(|&&t| t).count();
        let rt = self.temporal_compression_ratio;
        if rt.fract() != 0.0 || rt < 1.0 || rt as usize != 1 << doublings {
            candle_core::bail!(
                "vae config: temporal_compression_ratio {rt} must equal 2^(temporal upsample blocks) = {}",
                1usize << doublings
            );
        }
        let rs = self.spatial_compression_ratio();
        if !self.sample_size.is_multiple_of(rs) || !TILE_FRAMES.is_multiple_of(rt as usize) {
            candle_core::bail!(
                "vae config: sample_size {} must be a multiple of {rs} and 24 of temporal_compression_ratio {rt}",
                self.sample_size
            );
        }
        if self.latent_stride().contains(&0) {
            candle_core::bail!(
                "vae config: sample_size {} leaves the decoder's tiles no stride (overlaps are 120 rows and 80 columns)",
                self.sample_size
            );
        }
        if !(self.scaling_factor.is_finite() && self.scaling_factor != 0.0) {
            candle_core::bail!("vae config: scaling_factor must be a non-zero number");
        }
        Ok(())
    }
}

impl VideoVae for AllegroVaeConfig {
    fn compression(&self) -> (usize, usize) {
        (
            self.temporal_compression_ratio(),
            self.spatial_compression_ratio(),
        )
    }

    /// `prepare_latents`: `⌈n / rt⌉` frames for an even count n, `⌈(n − 1) / rt⌉ + 1` for an
    /// odd one.
    fn latent_grid(&self, num_frames: u32, height: u32, width: u32) -> [usize; 3] {
        let (rt, rs) = (
            self.temporal_compression_ratio().max(1),
            self.spatial_compression_ratio(),
        );
        let n = num_frames as usize;
        let frames = if n.is_multiple_of(2) {
            n.div_ceil(rt)
        } else {
            n.saturating_sub(1).div_ceil(rt) + 1
        };
        [frames, height as usize / rs, width as usize / rs]
    }
}

/// `f` on every frame of `x` `[B, C, T, H, W]` as images `[B·T, C, H, W]`.
fn per_frame(x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let (b, c, t, h, w) = x.dims5()?;
    let frames = x
        .permute((0, 2, 1, 3, 4))?
        .contiguous()?
        .reshape((b * t, c, h, w))?;
    let y = f(&frames)?;
    let (_, c, h, w) = y.dims4()?;
    y.reshape((b, t, c, h, w))?
        .permute((0, 2, 1, 3, 4))?
        .contiguous()
}

/// The first and last frames repeated once each (`_pad_temporal_dim`).
fn pad_edges(x: &Tensor) -> Result<Tensor> {
    let t = x.dim(2)?;
    Tensor::cat(&[&x.narrow(2, 0, 1)?, x, &x.narrow(2, t - 1, 1)?], 2)
}

/// An `nn.Conv3d` with bias and zero padding.
#[derive(Debug, Clone)]
struct Conv3d {
    weight: Tensor,
    bias: Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
}

impl Conv3d {
    fn new(
        cin: usize,
        cout: usize,
        kernel: [usize; 3],
        stride: [usize; 3],
        padding: [usize; 3],
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            weight: vb.get((cout, cin, kernel[0], kernel[1], kernel[2]), "weight")?,
            bias: vb.get(cout, "bias")?.reshape((1, cout, 1, 1, 1))?,
            stride,
            padding,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = conv3d_anywhere(&x.contiguous()?, &self.weight, self.stride, self.padding)?;
        add_channel_bias(y, &self.bias)
    }
}

/// One stage of a temporal layer: GroupNorm over the frames, SiLU, Conv3d.
#[derive(Debug, Clone)]
struct NormConv {
    norm: RunGroupNorm,
    conv: Conv3d,
}

impl NormConv {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.conv.forward(&self.norm.forward_then(x, None, true)?)
    }
}

/// What an `AllegroTemporalConvLayer` does to the frame count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frames {
    Keep,
    Double,
}

/// `AllegroTemporalConvLayer` (decoder kinds: plain, and the upsampler with `stride=3`).
#[derive(Debug, Clone)]
struct TemporalConvLayer {
    frames: Frames,
    convs: [NormConv; 4],
}

impl TemporalConvLayer {
    fn new(channels: usize, groups: usize, frames: Frames, vb: VarBuilder) -> Result<Self> {
        // The upsampler's convs are 3x3 in space (its `stride=3`), the plain layer's 1x1.
        let (k, p) = match frames {
            Frames::Keep => (1, 0),
            Frames::Double => (3, 1),
        };
        let stage = |name: &str, conv: &str, cout: usize, kt: usize| -> Result<NormConv> {
            Ok(NormConv {
                norm: RunGroupNorm::new(groups, channels, TEMPORAL_NORM_EPS, vb.pp(name).pp("0"))?,
                conv: Conv3d::new(
                    channels,
                    cout,
                    [kt, k, k],
                    [1, 1, 1],
                    [0, p, p],
                    vb.pp(name).pp(conv),
                )?,
            })
        };
        let conv1 = match frames {
            Frames::Keep => stage("conv1", "2", channels, 3)?,
            Frames::Double => stage("conv1", "2", 2 * channels, 1)?,
        };
        Ok(Self {
            frames,
            convs: [
                conv1,
                stage("conv2", "3", channels, 3)?,
                stage("conv3", "3", channels, 3)?,
                stage("conv4", "2", channels, 3)?,
            ],
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, c, t, h, w) = x.dims5()?;
        let (identity, mut y) = match self.frames {
            Frames::Keep => (x.clone(), self.convs[0].forward(&pad_edges(x)?)?),
            Frames::Double => {
                let doubled = x.unsqueeze(3)?.broadcast_as((b, c, t, 2, h, w))?.reshape((
                    b,
                    c,
                    2 * t,
                    h,
                    w,
                ))?;
                // The 2C output channels are (copy, channel): copy k is frame 2t + k.
                let y = self.convs[0]
                    .forward(x)?
                    .reshape(vec![b, 2, c, t, h, w])?
                    .permute(vec![0, 2, 3, 1, 4, 5])?
                    .reshape((b, c, 2 * t, h, w))?;
                (doubled, y)
            }
        };
        for conv in &self.convs[1..] {
            y = conv.forward(&pad_edges(&y)?)?;
        }
        identity + y
    }
}

/// A resnet (per frame) followed by its temporal layer.
#[derive(Debug, Clone)]
struct ResnetWithTime {
    resnet: ResnetBlock2D,
    temporal: TemporalConvLayer,
}

impl ResnetWithTime {
    fn new(cin: usize, cout: usize, groups: usize, i: usize, vb: &VarBuilder) -> Result<Self> {
        Ok(Self {
            resnet: ResnetBlock2D::new(cin, cout, groups, vb.pp(format!("resnets.{i}")))?,
            temporal: TemporalConvLayer::new(
                cout,
                groups,
                Frames::Keep,
                vb.pp(format!("temp_convs.{i}")),
            )?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = per_frame(x, |f| self.resnet.forward(f))?;
        self.temporal.forward(&h)
    }
}

/// `AllegroUpBlock3D`.
#[derive(Debug, Clone)]
struct UpBlock {
    layers: Vec<ResnetWithTime>,
    temporal_up: Option<TemporalConvLayer>,
    spatial_up: Option<Upsample2D>,
}

impl UpBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for layer in &self.layers {
            h = layer.forward(&h)?;
        }
        if let Some(up) = &self.temporal_up {
            h = up.forward(&h)?;
        }
        match &self.spatial_up {
            Some(up) => per_frame(&h, |f| up.forward(f)),
            None => Ok(h),
        }
    }
}

/// `AllegroDecoder3D`.
#[derive(Debug, Clone)]
struct Decoder {
    conv_in: Conv2d,
    temp_conv_in: Conv3d,
    mid_first: ResnetWithTime,
    mid_attention: MidAttention,
    mid_second: ResnetWithTime,
    up_blocks: Vec<UpBlock>,
    conv_norm_out: RunGroupNorm,
    temp_conv_out: Conv3d,
    conv_out: Conv2d,
}

impl Decoder {
    fn new(cfg: &AllegroVaeConfig, vb: VarBuilder) -> Result<Self> {
        let boc = &cfg.block_out_channels;
        let groups = cfg.norm_num_groups;
        let top = boc[boc.len() - 1];
        let time_conv =
            |c: usize, vb: VarBuilder| Conv3d::new(c, c, [3, 1, 1], [1; 3], [1, 0, 0], vb);
        let mvb = vb.pp("mid_block");
        let mut up_blocks = Vec::with_capacity(boc.len());
        let mut prev = top;
        for (i, &out) in boc.iter().rev().enumerate() {
            let bvb = vb.pp(format!("up_blocks.{i}"));
            let layers = (0..=cfg.layers_per_block)
                .map(|l| ResnetWithTime::new(if l == 0 { prev } else { out }, out, groups, l, &bvb))
                .collect::<Result<_>>()?;
            let temporal_up = if cfg.temporal_upsample_blocks[i] {
                Some(TemporalConvLayer::new(
                    out,
                    groups,
                    Frames::Double,
                    bvb.pp("temp_conv_up"),
                )?)
            } else {
                None
            };
            let spatial_up = if i + 1 < boc.len() {
                Some(Upsample2D::new(out, bvb.pp("upsamplers.0"))?)
            } else {
                None
            };
            up_blocks.push(UpBlock {
                layers,
                temporal_up,
                spatial_up,
            });
            prev = out;
        }
        let bottom = boc[0];
        Ok(Self {
            conv_in: Conv2d::new(cfg.latent_channels, top, 3, 1, 1, vb.pp("conv_in"))?,
            temp_conv_in: time_conv(top, vb.pp("temp_conv_in"))?,
            mid_first: ResnetWithTime::new(top, top, groups, 0, &mvb)?,
            mid_attention: MidAttention::new(top, groups, mvb.pp("attentions.0"))?,
            mid_second: ResnetWithTime::new(top, top, groups, 1, &mvb)?,
            up_blocks,
            conv_norm_out: RunGroupNorm::new(groups, bottom, NORM_EPS, vb.pp("conv_norm_out"))?,
            temp_conv_out: time_conv(bottom, vb.pp("temp_conv_out"))?,
            conv_out: Conv2d::new(bottom, cfg.out_channels, 3, 1, 1, vb.pp("conv_out"))?,
        })
    }

    /// A latent tile `[1, C, f, h, w]` (after `post_quant_conv`) to pixels `[1, 3, T, H, W]`.
    fn forward(&self, z: &Tensor) -> Result<Tensor> {
        let x = per_frame(z, |f| self.conv_in.forward(f))?;
        let mut x = (self.temp_conv_in.forward(&x)? + x)?;
        x = self.mid_first.forward(&x)?;
        x = per_frame(&x, |f| self.mid_attention.forward(f))?;
        x = self.mid_second.forward(&x)?;
        for block in &self.up_blocks {
            x = block.forward(&x)?;
        }
        let x = per_frame(&x, |f| self.conv_norm_out.forward_then(f, None, true))?;
        let x = (self.temp_conv_out.forward(&x)? + x)?;
        per_frame(&x, |f| self.conv_out.forward(f))
    }
}

/// The linear fade of a tile over `overlap` entries of `axis` (2, 3 or 4) at its head
/// (`i / overlap`) or its tail (`1 − i / overlap`), 1 elsewhere: multiplied in f32 and rounded
/// to the tile's dtype, as diffusers stores each f32 product back into the tile.
fn fade(x: &Tensor, axis: usize, overlap: usize, head: bool) -> Result<Tensor> {
    let len = x.dim(axis)?;
    let mut ramp = vec![1f32; len];
    for i in 0..overlap.min(len) {
        let r = i as f32 / overlap as f32;
        if head {
            ramp[i] = r;
        } else {
            ramp[len - overlap.min(len) + i] = 1.0 - r;
        }
    }
    let mut shape = vec![1; 5];
    shape[axis] = len;
    x.to_dtype(DType::F32)?
        .broadcast_mul(&Tensor::from_vec(ramp, shape, x.device())?)?
        .to_dtype(x.dtype())
}

/// The diffusers `AutoencoderKLAllegro`, decoder side.
#[derive(Debug, Clone)]
pub struct AutoencoderKLAllegro {
    cfg: AllegroVaeConfig,
    post_quant_conv: Conv2d,
    decoder: Decoder,
    dtype: DType,
}

impl AutoencoderKLAllegro {
    /// The decoder and `post_quant_conv` (the encoder's weights are not read).
    pub fn new(cfg: &AllegroVaeConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let c = cfg.latent_channels;
        Ok(Self {
            cfg: cfg.clone(),
            post_quant_conv: Conv2d::new(c, c, 1, 1, 0, vb.pp("post_quant_conv"))?,
            decoder: Decoder::new(cfg, vb.pp("decoder"))?,
            dtype: vb.dtype(),
        })
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &AllegroVaeConfig {
        &self.cfg
    }

    /// `decode_latents`' input: `1 / scaling_factor · latents`.
    pub fn unscale(&self, latents: &Tensor) -> Result<Tensor> {
        crate::models::autoencoder_kl::times_reciprocal(latents, self.cfg.scaling_factor)
    }

    /// `tiled_decode` of unscaled latents `[1, C, F, h, w]` to the video `[1, 3, F·rt, h·rs,
    /// w·rs]` in f32 (not clamped; frames no tile covers stay 0, as in diffusers). The faded
    /// tiles are summed in the VAE's dtype, as diffusers sums them (and half the memory of an
    /// f32 sum in bf16).
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        let (b, c, f, h, w) = z.dims5()?;
        if b != 1 || c != self.cfg.latent_channels {
            candle_core::bail!(
                "latents {:?} are not one video of {} channels",
                z.dims(),
                self.cfg.latent_channels
            );
        }
        if let Some(why) = self.cfg.decode_refusal([f, h, w]) {
            candle_core::bail!("{why}");
        }
        let z = z.to_dtype(self.dtype)?;
        let z = per_frame(&z, |x| self.post_quant_conv.forward(x))?;
        let (k, s) = (self.cfg.latent_tile(), self.cfg.latent_stride());
        let (tile, stride) = (self.cfg.tile(), self.cfg.stride());
        let tiles = self.cfg.tiles([f, h, w]);
        let (rt, rs) = (
            self.cfg.temporal_compression_ratio(),
            self.cfg.spatial_compression_ratio(),
        );
        let out = [f * rt, h * rs, w * rs];
        let mut video = Tensor::zeros(
            (1, self.cfg.out_channels, out[0], out[1], out[2]),
            self.dtype,
            z.device(),
        )?;
        // Python's `start = index · stride` for either sign of stride (a lone tile starts at 0).
        let start = |i: usize, s: i64| (i as i64 * s) as usize;
        for i in 0..tiles[0] {
            for j in 0..tiles[1] {
                for l in 0..tiles[2] {
                    let index = [i, j, l];
                    let latent = z
                        .narrow(2, start(i, s[0]), k[0])?
                        .narrow(3, start(j, s[1]), k[1])?
                        .narrow(4, start(l, s[2]), k[2])?;
                    let mut pixels = self.decoder.forward(&latent)?;
                    for a in 0..3 {
                        if index[a] > 0 {
                            pixels = fade(&pixels, a + 2, TILE_OVERLAP[a], true)?;
                        }
                        if index[a] + 1 < tiles[a] {
                            pixels = fade(&pixels, a + 2, TILE_OVERLAP[a], false)?;
                        }
                    }
                    let p0 = [0, 1, 2].map(|a| start(index[a], stride[a]));
                    let ranges = [
                        0..1,
                        0..self.cfg.out_channels,
                        p0[0]..p0[0] + tile[0],
                        p0[1]..p0[1] + tile[1],
                        p0[2]..p0[2] + tile[2],
                    ];
                    let current = video
                        .narrow(2, p0[0], tile[0])?
                        .narrow(3, p0[1], tile[1])?
                        .narrow(4, p0[2], tile[2])?;
                    video = video.slice_assign(&ranges, &(current + pixels)?)?;
                }
            }
        }
        video.to_dtype(DType::F32)
    }
}

crate::placed_whole!(
    AutoencoderKLAllegro,
    AllegroVaeConfig,
    AutoencoderKLAllegro::new
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_tiles_cover_the_default_video() {
        let cfg = AllegroVaeConfig::default();
        assert!(cfg.validate().is_ok());
        assert_eq!(cfg.latent_tile(), [6, 40, 40]);
        assert_eq!(cfg.latent_stride(), [4, 25, 30]);
        // 88 frames of 720x1280: 5 x 3 x 5 tiles reach every latent frame, row and column.
        assert_eq!(cfg.tiles([22, 90, 160]), [5, 3, 5]);
        assert!(cfg.decode_refusal([22, 90, 160]).is_none());
        // Smaller than one tile: diffusers fails, vidgen refuses.
        let why = cfg.decode_refusal([22, 30, 160]).unwrap();
        assert!(
            why.contains("30 latent rows are fewer than a VAE tile's 40"),
            "{why}"
        );
    }

    #[test]
    fn a_tile_smaller_than_its_overlap_strides_backwards() {
        let cfg = AllegroVaeConfig {
            block_out_channels: vec![8, 8, 16, 16],
            norm_num_groups: 4,
            sample_size: 64,
            ..Default::default()
        };
        assert!(cfg.validate().is_ok());
        // Python's floor division: -56 // 8 = -7, -16 // 8 = -2.
        assert_eq!(cfg.latent_stride(), [4, -7, -2]);
        assert_eq!(cfg.tiles([6, 8, 8]), [1, 1, 1]);
        assert_eq!(cfg.tiles([10, 8, 8]), [2, 1, 1]);
        // A larger frame fits no tile at all.
        assert_eq!(cfg.tiles([6, 16, 8]), [1, 0, 1]);
        let why = cfg.decode_refusal([6, 16, 8]).unwrap();
        assert!(why.contains("16 latent rows fit no VAE tile of 8"), "{why}");
    }

    #[test]
    fn configs_the_decoder_cannot_run_are_refused_with_the_key() {
        let good = AllegroVaeConfig::default();
        let cases = [
            (
                AllegroVaeConfig {
                    temporal_compression_ratio: 8.0,
                    ..good.clone()
                },
                "temporal_compression_ratio",
            ),
            (
                AllegroVaeConfig {
                    sample_size: 120,
                    ..good.clone()
                },
                "sample_size",
            ),
            (
                AllegroVaeConfig {
                    norm_num_groups: 48,
                    ..good.clone()
                },
                "norm_num_groups",
            ),
            (
                AllegroVaeConfig {
                    temporal_upsample_blocks: vec![true],
                    ..good.clone()
                },
                "temporal_upsample_blocks",
            ),
        ];
        for (bad, key) in cases {
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    #[test]
    fn fades_ramp_over_the_overlap() -> Result<()> {
        let x = Tensor::ones((1, 1, 4, 1, 1), DType::F32, &candle_core::Device::Cpu)?;
        let head = fade(&x, 2, 2, true)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(head, [0.0, 0.5, 1.0, 1.0]);
        let tail = fade(&x, 2, 2, false)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(tail, [1.0, 1.0, 1.0, 0.5]);
        Ok(())
    }

    /// A bf16 tile is faded as diffusers fades it: each value times the f32 ramp, rounded once
    /// to bf16 (the tile stays bf16, so the tiles sum in bf16 as diffusers' `z.new_zeros` does).
    #[test]
    fn a_bf16_tile_fades_in_f32_rounded_to_bf16() -> Result<()> {
        let values: Vec<f32> = (0..7).map(|i| 1.0 + i as f32 / 3.0).collect();
        let x = Tensor::from_vec(values.clone(), (1, 1, 7, 1, 1), &candle_core::Device::Cpu)?
            .to_dtype(DType::BF16)?;
        let faded = fade(&x, 2, 7, true)?;
        assert_eq!(faded.dtype(), DType::BF16);
        let got = faded
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for (i, (g, v)) in got.iter().zip(&values).enumerate() {
            let stored = half::bf16::from_f32(*v).to_f32();
            let want = half::bf16::from_f32(stored * (i as f32 / 7.0)).to_f32();
            assert_eq!(*g, want, "entry {i}");
        }
        Ok(())
    }
}
