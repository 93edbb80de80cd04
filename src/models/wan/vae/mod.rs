//! The Wan video VAE (diffusers' `AutoencoderKLWan`): a causal 3D-conv autoencoder that
//! compresses video 4x in time (first frame alone) and 8x in space into `z_dim` channels
//! (Wan2.1), or, with `patch_size` 2 and `is_residual` (Wan2.2 TI2V-5B), 16x in space into 48
//! channels: pixels are folded 2x2 into channels first, and every down/up stage adds a
//! parameter-free shortcut (`AvgDown3D` / `DupUp3D`) to its residual blocks.
//!
//! Like diffusers, decoding runs one latent frame at a time and encoding the first frame, then
//! four frames at a time, with every causal conv caching the last two frames it saw, so memory
//! does not grow with the number of frames (only the output does).

pub(crate) mod blocks;

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Deserialize;

use crate::models::conv3d::Layout;
use crate::models::vae_tiling::spatial_tiles;
use blocks::{
    AttentionBlock, AvgDown3D, CausalConv3d, ChannelNorm, Downsample, DupUp3D, FeatCache, MidBlock,
    ResBlock, Upsample,
};

/// The most spatial resamplings a config may ask: 2^8 = 256x smaller frames is far beyond
/// any video VAE, and keeps `1 << stages` (the scale factor) well inside a usize.
const MAX_RESAMPLINGS: usize = 8;

/// Frames per encoder chunk after the first one (hard-coded in diffusers).
const ENCODE_CHUNK_FRAMES: usize = 4;

fn default_base_dim() -> usize {
    96
}
fn default_z_dim() -> usize {
    16
}
fn default_dim_mult() -> Vec<usize> {
    vec![1, 2, 4, 4]
}
fn default_num_res_blocks() -> usize {
    2
}
fn default_temperal_downsample() -> Vec<bool> {
    vec![false, true, true]
}
fn default_channels() -> usize {
    3
}
fn default_latents_mean() -> Vec<f64> {
    vec![
        -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715,
        0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
    ]
}
fn default_latents_std() -> Vec<f64> {
    vec![
        2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652,
        1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
    ]
}

/// `vae/config.json` of a Wan diffusers checkpoint (Wan2.1, or Wan2.2 with `is_residual` and
/// `patch_size`). Missing keys take diffusers' defaults; keys the sizes are derived from
/// (`scale_factor_*`, ...) are ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct WanVaeConfig {
    /// Channels of the encoder's first stage (and of the decoder's last one).
    #[serde(default = "default_base_dim")]
    pub base_dim: usize,
    /// Decoder base channels when they differ from `base_dim`.
    #[serde(default)]
    pub decoder_base_dim: Option<usize>,
    /// Latent channels.
    #[serde(default = "default_z_dim")]
    pub z_dim: usize,
    /// Channel multiplier per stage; `len - 1` spatial 2x resamplings.
    #[serde(default = "default_dim_mult")]
    pub dim_mult: Vec<usize>,
    /// Residual blocks per encoder stage (the decoder has one more).
    #[serde(default = "default_num_res_blocks")]
    pub num_res_blocks: usize,
    /// Encoder stage scales (1, 1/2, ...) that get an attention block after each res block.
    #[serde(default)]
    pub attn_scales: Vec<f64>,
    /// Which encoder resamplings also halve time (the decoder mirrors it). Sic, diffusers' key.
    #[serde(default = "default_temperal_downsample")]
    pub temperal_downsample: Vec<bool>,
    /// Per-channel mean of the latent distribution (for the pipeline's de-normalisation).
    #[serde(default = "default_latents_mean")]
    pub latents_mean: Vec<f64>,
    /// Per-channel std of the latent distribution.
    #[serde(default = "default_latents_std")]
    pub latents_std: Vec<f64>,
    /// Wan2.2 residual up/down blocks (with the `AvgDown3D`/`DupUp3D` shortcuts).
    #[serde(default)]
    pub is_residual: Option<bool>,
    /// Video channels in.
    #[serde(default = "default_channels")]
    pub in_channels: usize,
    /// Video channels out.
    #[serde(default = "default_channels")]
    pub out_channels: usize,
    /// Wan2.2 pixel patchification: `p x p` pixels folded into channels before the encoder
    /// (`in_channels` = 3p²) and unfolded after the decoder.
    #[serde(default)]
    pub patch_size: Option<usize>,
}

impl WanVaeConfig {
    /// Spatial compression: 2^(number of resampling stages) x `patch_size`.
    pub fn scale_factor_spatial(&self) -> usize {
        (1 << self.dim_mult.len().saturating_sub(1)) * self.patch()
    }

    /// Whether the down/up stages are Wan2.2 residual blocks.
    pub fn is_residual(&self) -> bool {
        self.is_residual == Some(true)
    }

    /// Pixel patch side (1 without patchification).
    pub fn patch(&self) -> usize {
        self.patch_size.unwrap_or(1)
    }

    /// Temporal compression: 2^(number of temporal resamplings).
    pub fn scale_factor_temporal(&self) -> usize {
        1 << self.temporal_resamplings()
    }

    fn temporal_resamplings(&self) -> usize {
        let stages = self.dim_mult.len().saturating_sub(1);
        self.temperal_downsample
            .iter()
            .take(stages)
            .filter(|&&t| t)
            .count()
    }

    /// Rejects configurations this implementation cannot build, naming the key: the config is
    /// checked when it is read, so nothing downstream (constructors, the memory plan) meets an
    /// empty `dim_mult` or a short `temperal_downsample`.
    pub fn validate(&self) -> Result<()> {
        if self.patch_size == Some(0) {
            bail!("`patch_size` must be positive")
        }
        if self.dim_mult.is_empty() || self.dim_mult.contains(&0) {
            bail!(
                "`dim_mult` {:?} must be a non-empty list of positive numbers",
                self.dim_mult
            )
        }
        let stages = self.dim_mult.len() - 1;
        if stages > MAX_RESAMPLINGS {
            bail!(
                "`dim_mult` has {} entries: at most {} (each after the first halves the frame)",
                self.dim_mult.len(),
                MAX_RESAMPLINGS + 1
            )
        }
        if self.temperal_downsample.len() < stages {
            bail!(
                "`temperal_downsample` has {} entries, `dim_mult` {:?} needs {stages} (one per resampling stage)",
                self.temperal_downsample.len(),
                self.dim_mult
            )
        }
        // The widest stage is a base width times the largest multiplier.
        let widest = self.dim_mult.iter().copied().max().unwrap_or(1);
        crate::models::config_checks::bounded_sizes(&[
            ("base_dim", self.base_dim),
            (
                "decoder_base_dim",
                self.decoder_base_dim.unwrap_or(self.base_dim),
            ),
            ("z_dim", self.z_dim),
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("num_res_blocks", self.num_res_blocks.max(1)),
            (
                "base_dim` x `dim_mult",
                self.base_dim.saturating_mul(widest),
            ),
            (
                "decoder_base_dim` x `dim_mult",
                self.decoder_base_dim
                    .unwrap_or(self.base_dim)
                    .saturating_mul(widest),
            ),
        ])?;
        for (key, values) in [
            ("latents_mean", &self.latents_mean),
            ("latents_std", &self.latents_std),
        ] {
            if values.len() != self.z_dim {
                bail!(
                    "`{key}` has {} entries, `z_dim` {} needs one per latent channel",
                    values.len(),
                    self.z_dim
                )
            }
        }
        if let Some(bad) = self
            .latents_std
            .iter()
            .find(|s| !(s.is_finite() && **s > 0.0))
        {
            bail!("`latents_std` holds {bad}: every entry must be a positive number")
        }
        if self.is_residual() {
            // The shortcuts fold/unfold 2x2(x2) cells into channels: group sizes must divide.
            let enc: Vec<usize> = std::iter::once(1)
                .chain(self.dim_mult.iter().copied())
                .map(|m| m * self.base_dim)
                .collect();
            let dec_dim = self.decoder_base_dim.unwrap_or(self.base_dim);
            let dec: Vec<usize> = std::iter::once(self.dim_mult[stages])
                .chain(self.dim_mult.iter().rev().copied())
                .map(|m| m * dec_dim)
                .collect();
            // Stage i < stages resamples (2x2 space, x2 time where temporal); the last does not.
            let cell = |temporal: bool| if temporal { 8 } else { 4 };
            for i in 0..=stages {
                let down_cell = if i < stages {
                    cell(self.temperal_downsample[i])
                } else {
                    1
                };
                let up_ok = i == stages
                    || (dec[i + 1] * cell(self.temperal_downsample[stages - 1 - i]))
                        .is_multiple_of(dec[i]);
                if !(enc[i] * down_cell).is_multiple_of(enc[i + 1]) || !up_ok {
                    bail!(
                        "vae config: dim_mult {:?} with base_dim {} / decoder_base_dim {dec_dim} \
                         gives residual stages whose shortcut channels do not divide",
                        self.dim_mult,
                        self.base_dim
                    )
                }
            }
        }
        Ok(())
    }
}

/// Spatial tiling of [`AutoencoderKLWan::decode_tiled`], in video pixels (diffusers'
/// `enable_tiling` arguments): tiles of `min` pixels start every `stride` pixels and the
/// `min - stride` overlap is blended linearly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WanVaeTiling {
    /// Tile height; latents no taller than `tile_min_height / 8` are decoded in one piece.
    pub tile_min_height: usize,
    /// Tile width; latents no wider than `tile_min_width / 8` are decoded in one piece.
    pub tile_min_width: usize,
    /// Vertical distance between tile starts.
    pub tile_stride_height: usize,
    /// Horizontal distance between tile starts.
    pub tile_stride_width: usize,
}

impl Default for WanVaeTiling {
    /// diffusers' defaults: 256-pixel tiles every 192 pixels.
    fn default() -> Self {
        Self {
            tile_min_height: 256,
            tile_min_width: 256,
            tile_stride_height: 192,
            tile_stride_width: 192,
        }
    }
}

impl WanVaeTiling {
    /// Tiles of `px` pixels every three quarters of it (`--vae-tile-size`), diffusers' default
    /// ratio; `None`: the defaults.
    pub fn sized(px: Option<u32>) -> Self {
        match px {
            Some(px) => {
                let (tile, stride) = (px as usize, px as usize / 4 * 3);
                Self {
                    tile_min_height: tile,
                    tile_min_width: tile,
                    tile_stride_height: stride,
                    tile_stride_width: stride,
                }
            }
            None => Self::default(),
        }
    }
}

/// diffusers' `patchify`: `[B, C, T, H, W]` -> `[B, C·p², T, H/p, W/p]`, channel
/// `c·p² + pw·p + ph` holding pixel `(p·i + ph, p·j + pw)` (the w offset before the h offset).
pub fn patchify(x: &Tensor, p: usize) -> Result<Tensor> {
    if p == 1 {
        return Ok(x.clone());
    }
    let (b, c, t, h, w) = x.dims5()?;
    x.contiguous()?
        .reshape(vec![b, c, t, h / p, p, w / p, p])?
        .permute(vec![0, 1, 6, 4, 2, 3, 5])?
        .contiguous()?
        .reshape((b, c * p * p, t, h / p, w / p))
}

/// diffusers' `unpatchify`, the inverse of [`patchify`].
pub fn unpatchify(x: &Tensor, p: usize) -> Result<Tensor> {
    if p == 1 {
        return Ok(x.clone());
    }
    let (b, cp, t, h, w) = x.dims5()?;
    let c = cp / (p * p);
    x.contiguous()?
        .reshape(vec![b, c, p, p, t, h, w])?
        .permute(vec![0, 1, 4, 5, 3, 6, 2])?
        .contiguous()?
        .reshape((b, c, t, h * p, w * p))
}

/// A layer of the encoder's flat `down_blocks` list.
enum DownLayer {
    Res(ResBlock),
    Attention(AttentionBlock),
    Resample(Downsample),
    /// Wan2.2: a whole stage with its shortcut.
    Residual(ResidualDownBlock),
}

/// diffusers' `WanResidualDownBlock`: res blocks and an optional downsampler, plus
/// `AvgDown3D` of the stage's input.
struct ResidualDownBlock {
    resnets: Vec<ResBlock>,
    downsampler: Option<Downsample>,
    shortcut: AvgDown3D,
}

impl ResidualDownBlock {
    fn new(
        cfg: &WanVaeConfig,
        (in_dim, out_dim): (usize, usize),
        temporal: bool,
        down: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        let shortcut = AvgDown3D::new(
            in_dim,
            out_dim,
            if temporal { 2 } else { 1 },
            if down { 2 } else { 1 },
        )?;
        let mut resnets = Vec::with_capacity(cfg.num_res_blocks);
        let mut dim = in_dim;
        for j in 0..cfg.num_res_blocks {
            resnets.push(ResBlock::new(
                dim,
                out_dim,
                Layout::ChannelsFirst,
                vb.pp("resnets").pp(j),
            )?);
            dim = out_dim;
        }
        let downsampler = if down {
            Some(Downsample::new(out_dim, temporal, vb.pp("downsampler"))?)
        } else {
            None
        };
        Ok(Self {
            resnets,
            downsampler,
            shortcut,
        })
    }

    fn forward(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let mut h = x.clone();
        for res in &self.resnets {
            h = res.forward(&h, cache)?;
        }
        if let Some(down) = &self.downsampler {
            h = down.forward(&h, cache)?;
        }
        h + self.shortcut.forward(x)?
    }
}

/// diffusers' `WanEncoder3d`: (patchified) video -> `2 * z_dim` channels (before quant_conv).
struct Encoder {
    conv_in: CausalConv3d,
    down: Vec<DownLayer>,
    mid: MidBlock,
    head: Head,
}

impl Encoder {
    fn new(cfg: &WanVaeConfig, vb: VarBuilder) -> Result<Self> {
        let dim = cfg.base_dim;
        let dims: Vec<usize> = std::iter::once(1)
            .chain(cfg.dim_mult.iter().copied())
            .map(|m| m * dim)
            .collect();
        let first = Layout::ChannelsFirst;
        let conv_in = CausalConv3d::cube(cfg.in_channels, dims[0], 3, 1, first, vb.pp("conv_in"))?;
        let vb_down = vb.pp("down_blocks");
        let mut down = Vec::new();
        let mut scale = 1.0f64;
        let stages = cfg.dim_mult.len();
        for i in (0..stages).filter(|_| cfg.is_residual()) {
            // Wan2.2: one block per stage; no attention in the down path.
            let last = i == stages - 1;
            let temporal = !last && cfg.temperal_downsample[i];
            down.push(DownLayer::Residual(ResidualDownBlock::new(
                cfg,
                (dims[i], dims[i + 1]),
                temporal,
                !last,
                vb_down.pp(i),
            )?));
        }
        for i in (0..stages).filter(|_| !cfg.is_residual()) {
            let mut in_dim = dims[i];
            let out_dim = dims[i + 1];
            for _ in 0..cfg.num_res_blocks {
                down.push(DownLayer::Res(ResBlock::new(
                    in_dim,
                    out_dim,
                    first,
                    vb_down.pp(down.len()),
                )?));
                if cfg.attn_scales.contains(&scale) {
                    down.push(DownLayer::Attention(AttentionBlock::new(
                        out_dim,
                        first,
                        vb_down.pp(down.len()),
                    )?));
                }
                in_dim = out_dim;
            }
            if i != stages - 1 {
                let temporal = cfg.temperal_downsample[i];
                down.push(DownLayer::Resample(Downsample::new(
                    out_dim,
                    temporal,
                    vb_down.pp(down.len()),
                )?));
                scale /= 2.0;
            }
        }
        let out_dim = dims[stages];
        Ok(Self {
            conv_in,
            down,
            mid: MidBlock::new(out_dim, first, vb.pp("mid_block"))?,
            head: Head::new(out_dim, 2 * cfg.z_dim, first, vb)?,
        })
    }

    /// One chunk `[B, C, T, H, W]` with the cache of the previous chunks.
    fn forward(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let mut x = self.conv_in.forward_cached(x, None, None, cache)?;
        for layer in &self.down {
            x = match layer {
                DownLayer::Res(res) => res.forward(&x, cache)?,
                DownLayer::Attention(attn) => attn.forward(&x)?,
                DownLayer::Resample(resample) => resample.forward(&x, cache)?,
                DownLayer::Residual(block) => block.forward(&x, cache)?,
            };
        }
        let x = self.mid.forward(&x, cache)?;
        self.head.forward(&x, cache)
    }
}

/// `norm_out` -> SiLU -> `conv_out`, the tail shared by encoder and decoder.
struct Head {
    norm: ChannelNorm,
    conv: CausalConv3d,
}

impl Head {
    fn new(dim: usize, out: usize, layout: Layout, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            norm: ChannelNorm::new(dim, false, layout, vb.pp("norm_out"))?,
            conv: CausalConv3d::cube(dim, out, 3, 1, layout, vb.pp("conv_out"))?,
        })
    }

    fn forward(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        self.conv
            .forward_cached(x, Some((&self.norm, None)), None, cache)
    }
}

/// An up stage of the decoder: `num_res_blocks + 1` res blocks and an optional upsampler
/// (Wan2.2: plus `DupUp3D` of the stage's input).
struct UpBlock {
    resnets: Vec<ResBlock>,
    upsampler: Option<Upsample>,
    shortcut: Option<DupUp3D>,
    layout: Layout,
}

impl UpBlock {
    fn forward(&self, x: &Tensor, cache: &mut FeatCache, first_chunk: bool) -> Result<Tensor> {
        let mut h = x.clone();
        for res in &self.resnets {
            h = res.forward(&h, cache)?;
        }
        if let Some(upsampler) = &self.upsampler {
            h = upsampler.forward(&h, cache)?;
        }
        match &self.shortcut {
            Some(shortcut) => shortcut.add_to(&h, x, first_chunk, self.layout),
            None => Ok(h),
        }
    }
}

/// diffusers' `WanDecoder3d`: `z_dim` channels -> (patchified) video.
struct Decoder {
    conv_in: CausalConv3d,
    mid: MidBlock,
    up: Vec<UpBlock>,
    head: Head,
    /// Channels last where a channels-last convolution computes f32 (the fused kernels' dtype),
    /// else first.
    layout: Layout,
}

impl Decoder {
    /// The decoder with activations in `layout`.
    fn new(cfg: &WanVaeConfig, layout: Layout, vb: VarBuilder) -> Result<Self> {
        let dim = cfg.decoder_base_dim.unwrap_or(cfg.base_dim);
        let stages = cfg.dim_mult.len();
        let dims: Vec<usize> = std::iter::once(cfg.dim_mult[stages - 1])
            .chain(cfg.dim_mult.iter().rev().copied())
            .map(|m| m * dim)
            .collect();
        let temporal_up: Vec<bool> = cfg.temperal_downsample[..stages - 1]
            .iter()
            .rev()
            .copied()
            .collect();
        let conv_in = CausalConv3d::cube(cfg.z_dim, dims[0], 3, 1, layout, vb.pp("conv_in"))?;
        let mid = MidBlock::new(dims[0], layout, vb.pp("mid_block"))?;
        let mut up = Vec::with_capacity(stages);
        for i in 0..stages {
            let vb_up = vb.pp("up_blocks").pp(i);
            let residual = cfg.is_residual();
            // Wan2.1: every upsampler halves the channels, so later stages start at half;
            // Wan2.2's upsamplers keep them.
            let stage_in = if i > 0 && !residual {
                dims[i] / 2
            } else {
                dims[i]
            };
            let mut in_dim = stage_in;
            let out_dim = dims[i + 1];
            let mut resnets = Vec::with_capacity(cfg.num_res_blocks + 1);
            for j in 0..=cfg.num_res_blocks {
                resnets.push(ResBlock::new(
                    in_dim,
                    out_dim,
                    layout,
                    vb_up.pp("resnets").pp(j),
                )?);
                in_dim = out_dim;
            }
            let up_flag = i != stages - 1;
            let upsampler = match (up_flag, residual) {
                (false, _) => None,
                (true, false) => Some(Upsample::new(
                    out_dim,
                    out_dim / 2,
                    temporal_up[i],
                    layout,
                    vb_up.pp("upsamplers.0"),
                )?),
                (true, true) => Some(Upsample::new(
                    out_dim,
                    out_dim,
                    temporal_up[i],
                    layout,
                    vb_up.pp("upsampler"),
                )?),
            };
            let shortcut = if up_flag && residual {
                let factor_t = if temporal_up[i] { 2 } else { 1 };
                Some(DupUp3D::new(stage_in, out_dim, factor_t, 2)?)
            } else {
                None
            };
            up.push(UpBlock {
                resnets,
                upsampler,
                shortcut,
                layout,
            });
        }
        let last = dims[stages];
        Ok(Self {
            conv_in,
            mid,
            up,
            head: Head::new(last, cfg.out_channels, layout, vb)?,
            layout,
        })
    }

    /// One latent frame (`[B, z_dim, 1, h, w]` in the decoder's layout) with the cache of the previous ones;
    /// `first_chunk` for latent frame 0.
    fn forward(&self, x: &Tensor, cache: &mut FeatCache, first_chunk: bool) -> Result<Tensor> {
        let x = self.conv_in.forward_cached(x, None, None, cache)?;
        let mut x = self.mid.forward(&x, cache)?;
        for block in &self.up {
            x = block.forward(&x, cache, first_chunk)?;
        }
        self.head.forward(&x, cache)
    }
}

/// diffusers' `AutoencoderKLWan` (Wan2.1): `encode` video to a diagonal Gaussian, `decode`
/// latents to video. Runs in the dtype of its `VarBuilder` (f32 normally; bf16 works, with the
/// norms computed in f32).
pub struct AutoencoderKLWan {
    cfg: WanVaeConfig,
    encoder: Encoder,
    quant_conv: CausalConv3d,
    post_quant_conv: CausalConv3d,
    decoder: Decoder,
    dtype: DType,
    device: Device,
}

impl AutoencoderKLWan {
    /// Builds the VAE from `vae/diffusion_pytorch_model.safetensors` (diffusers names); its
    /// decoder channels last where a channels-last convolution computes f32 (the fused kernels'
    /// dtype), else channels first.
    pub fn new(cfg: &WanVaeConfig, vb: VarBuilder) -> Result<Self> {
        let layout = match vb.dtype() {
            DType::F32 => Layout::for_device(vb.device()),
            _ => Layout::ChannelsFirst,
        };
        Self::with_decoder_layout(cfg, layout, vb)
    }

    /// [`Self::new`] with the decoder's activations in `layout`.
    fn with_decoder_layout(cfg: &WanVaeConfig, layout: Layout, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let z = cfg.z_dim;
        let first = Layout::ChannelsFirst;
        Ok(Self {
            encoder: Encoder::new(cfg, vb.pp("encoder"))?,
            quant_conv: CausalConv3d::cube(2 * z, 2 * z, 1, 0, first, vb.pp("quant_conv"))?,
            post_quant_conv: CausalConv3d::cube(z, z, 1, 0, first, vb.pp("post_quant_conv"))?,
            decoder: Decoder::new(cfg, layout, vb.pp("decoder"))?,
            cfg: cfg.clone(),
            dtype: vb.dtype(),
            device: vb.device().clone(),
        })
    }

    /// The configuration the VAE was built from.
    pub fn config(&self) -> &WanVaeConfig {
        &self.cfg
    }

    /// The dtype the VAE computes in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Maps latents from the transformer's normalised space to the VAE's, exactly as
    /// `WanPipeline` does: `z / (1 / latents_std) + latents_mean` per channel, in the VAE dtype.
    pub fn denormalize(&self, latents: &Tensor) -> Result<Tensor> {
        let z = self.cfg.z_dim;
        let latents = self.check_latents(latents)?;
        let stats = |v: &[f64]| -> Result<Tensor> {
            let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
            Tensor::from_vec(v, (1, z, 1, 1, 1), &self.device)?.to_dtype(self.dtype)
        };
        let mean = stats(&self.cfg.latents_mean)?;
        let inv_std = stats(&self.cfg.latents_std)?.recip()?;
        latents.broadcast_div(&inv_std)?.broadcast_add(&mean)
    }

    /// Maps VAE latents (a mode of [`Self::encode`]) to the transformer's normalised space as
    /// `WanImageToVideoPipeline` does: `(z - latents_mean) * (1 / latents_std)` per channel,
    /// the reciprocal taken in f32 and everything else in `latents`' dtype and device.
    pub fn normalize(&self, latents: &Tensor) -> Result<Tensor> {
        let z = self.cfg.z_dim;
        let (_, c, _, _, _) = latents.dims5()?;
        if c != z {
            bail!(
                "vae normalize: expected {z} latent channels, got {:?}",
                latents.dims()
            )
        }
        let (dtype, device) = (latents.dtype(), latents.device());
        let stats = |v: &[f64]| -> Result<Tensor> {
            let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
            Tensor::from_vec(v, (1, z, 1, 1, 1), device)
        };
        let mean = stats(&self.cfg.latents_mean)?.to_dtype(dtype)?;
        let inv_std = stats(&self.cfg.latents_std)?.recip()?.to_dtype(dtype)?;
        latents.broadcast_sub(&mean)?.broadcast_mul(&inv_std)
    }

    /// Decodes de-normalised latents `[B, z_dim, F, h, w]` to video `[B, C_out / p², 1 + 4(F-1),
    /// s·h, s·w]` (`s` = [`WanVaeConfig::scale_factor_spatial`], `p` the patch) clamped to
    /// [-1, 1], in the VAE dtype.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        self.decode_unclamped(z)?.clamp(-1.0, 1.0)
    }

    /// Decodes like [`Self::decode`] but in overlapping spatial tiles blended together, exactly
    /// as diffusers' `tiled_decode`, so memory is bounded by the tile size instead of the frame
    /// size. Latents that fit in one tile are decoded directly.
    pub fn decode_tiled(&self, z: &Tensor, tiling: &WanVaeTiling) -> Result<Tensor> {
        let (_, _, _, height, width) = z.dims5()?;
        let sf = self.cfg.scale_factor_spatial();
        let (min_h, min_w) = (tiling.tile_min_height / sf, tiling.tile_min_width / sf);
        let (stride_h, stride_w) = (
            tiling.tile_stride_height / sf,
            tiling.tile_stride_width / sf,
        );
        if min_h == 0 || min_w == 0 || stride_h == 0 || stride_w == 0 {
            bail!("vae tiling: tiles and strides must be at least {sf} pixels, got {tiling:?}")
        }
        if width <= min_w && height <= min_h {
            return self.decode(z);
        }
        // Tiles are blended in the decoder's (patchified) output space, as diffusers does.
        let p = self.cfg.patch();
        let (sample_stride_h, sample_stride_w) =
            (tiling.tile_stride_height / p, tiling.tile_stride_width / p);
        let out = spatial_tiles(
            z,
            ((min_h, min_w), (stride_h, stride_w)),
            (
                (
                    (tiling.tile_min_height / p).saturating_sub(sample_stride_h),
                    (tiling.tile_min_width / p).saturating_sub(sample_stride_w),
                ),
                (sample_stride_h, sample_stride_w),
                (height * sf / p, width * sf / p),
            ),
            |tile| self.decode_patched(tile),
        )?;
        unpatchify(&out, p)?.clamp(-1.0, 1.0)
    }

    /// Decode without the final clamp.
    fn decode_unclamped(&self, z: &Tensor) -> Result<Tensor> {
        unpatchify(&self.decode_patched(z)?, self.cfg.patch())
    }

    /// The decoder's output before unpatchify and clamp, `[B, C_out, T, H / p, W / p]` (the
    /// tiles of a tiled decode are blended in this space).
    fn decode_patched(&self, z: &Tensor) -> Result<Tensor> {
        let z = self.check_latents(z)?;
        let frames = z.dim(2)?;
        let x = self.post_quant_conv.forward(&z, None)?;
        let mut cache = FeatCache::default();
        let mut outs = Vec::with_capacity(frames);
        let layout = self.decoder.layout;
        for i in 0..frames {
            cache.start_chunk();
            let latent = layout.from_channels_first(&x.narrow(2, i, 1)?)?;
            let out = self.decoder.forward(&latent, &mut cache, i == 0)?;
            // Each chunk back to diffusers' layout as it is made: the video exists twice at most.
            outs.push(layout.to_channels_first(&out)?);
        }
        Tensor::cat(&outs, 2)
    }

    /// Encodes video `[B, C_in / p², T, H, W]` in [-1, 1] to the latent distribution
    /// `(mean, logvar)`, each `[B, z_dim, 1 + (T-1)/4, H/s, W/s]` (`s` =
    /// [`WanVaeConfig::scale_factor_spatial`]); logvar clamped to [-30, 20]. The mean is also
    /// the mode. Trailing frames beyond `1 + 4k` are ignored, as in diffusers.
    pub fn encode(&self, video: &Tensor) -> Result<(Tensor, Tensor)> {
        let (_, c, t, h, w) = video.dims5()?;
        let p = self.cfg.patch();
        if c * p * p != self.cfg.in_channels || t == 0 || h % p != 0 || w % p != 0 {
            bail!(
                "vae encode: expected [B, {}, T>0, H, W] video with H, W multiples of {p}, got {:?}",
                self.cfg.in_channels / (p * p),
                video.dims()
            )
        }
        let video = video.to_dtype(self.dtype)?.to_device(&self.device)?;
        let x = patchify(&video, p)?.contiguous()?;
        let mut cache = FeatCache::default();
        let chunks = 1 + (t - 1) / ENCODE_CHUNK_FRAMES;
        let mut outs = Vec::with_capacity(chunks);
        for i in 0..chunks {
            cache.start_chunk();
            let chunk = if i == 0 {
                x.narrow(2, 0, 1)?
            } else {
                x.narrow(2, 1 + ENCODE_CHUNK_FRAMES * (i - 1), ENCODE_CHUNK_FRAMES)?
            };
            outs.push(self.encoder.forward(&chunk, &mut cache)?);
        }
        let moments = self.quant_conv.forward(&Tensor::cat(&outs, 2)?, None)?;
        let z = self.cfg.z_dim;
        let mean = moments.narrow(1, 0, z)?.contiguous()?;
        let logvar = moments.narrow(1, z, z)?.clamp(-30.0, 20.0)?;
        Ok((mean, logvar))
    }

    /// Casts latents to the VAE's dtype and device after checking they are `[B, z_dim, F>0, h, w]`.
    fn check_latents(&self, z: &Tensor) -> Result<Tensor> {
        let (_, c, f, _, _) = z.dims5()?;
        if c != self.cfg.z_dim || f == 0 {
            bail!(
                "vae: expected [B, {}, F>0, h, w] latents, got {:?}",
                self.cfg.z_dim,
                z.dims()
            )
        }
        z.to_dtype(self.dtype)?.to_device(&self.device)
    }
}

crate::placed_whole!(AutoencoderKLWan, WanVaeConfig, AutoencoderKLWan::new);

#[cfg(test)]
mod tests {
    use super::*;

    /// The decoder channels last (here on the CPU, every convolution the exact tap sum) decodes
    /// what channels first decodes: Wan2.1's decoder and Wan2.2's (residual up blocks with their
    /// shortcuts, patchified output), each tiny fixture's weights, three latent frames (the first
    /// chunk, the temporal upsamplers' zero padding, then cached frames).
    #[test]
    fn channels_last_decoder_matches_channels_first() -> anyhow::Result<()> {
        for fixture in ["wan-tiny-a", "wan22-ti2v-tiny-a"] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures")
                .join(fixture)
                .join("vae");
            let cfg: WanVaeConfig =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
            let weights = dir.join("diffusion_pytorch_model.safetensors");
            let build = |layout: Layout| -> Result<AutoencoderKLWan> {
                // SAFETY: the fixture is not modified while mapped.
                let vb = unsafe {
                    VarBuilder::from_mmaped_safetensors(&[&weights], DType::F32, &Device::Cpu)
                }?;
                AutoencoderKLWan::with_decoder_layout(&cfg, layout, vb)
            };
            let z = Tensor::randn(0f32, 1f32, (1, cfg.z_dim, 3, 4, 6), &Device::Cpu)?;
            let first = build(Layout::ChannelsFirst)?.decode(&z)?;
            let last = build(Layout::ChannelsLast)?.decode(&z)?;
            assert_eq!(first.dims(), last.dims(), "{fixture}");
            let diff = (&first - &last)?.abs()?.flatten_all()?.max(0)?;
            let diff = diff.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{fixture}: channels last vs first {diff:.2e}");
        }
        Ok(())
    }
}
