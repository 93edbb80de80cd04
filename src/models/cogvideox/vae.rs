//! CogVideoX video VAE (diffusers `AutoencoderKLCogVideoX`), frame-batched as diffusers
//! decodes and encodes.
//!
//! Tensors keep diffusers' `[B, C, T, H, W]` layout. Every norm of the decoder is a *spatial
//! norm*: a GroupNorm whose scale and shift come from 1x1x1 convolutions of the latent chunk
//! resized (nearest) to the feature map. Causal 3D convolutions pad time in front with the first
//! frame repeated, or, from the second chunk on, with the last input frames of the previous chunk
//! (diffusers' `conv_cache`), and space with zeros; they run one output frame at a time as a sum
//! over temporal taps of 2D convolutions. The VAE computes in the `VarBuilder`'s dtype:
//! `CogVideoXPipeline` does not upcast its VAE (`force_upcast` is not read), so a bf16 run
//! decodes in bf16; GroupNorm statistics are taken in f32.

use crate::models::runs::RunGroupNorm;
use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Deserialize;

use crate::models::conv3d::{self, Kernel3d};
use crate::models::vae_tiling::{OverlapTiles, SpatialTiling};
use crate::models::video::VideoVae;

/// GroupNorm epsilon that diffusers fixes whatever the config says: the decoder's spatial norms
/// and the encoder's `norm_out`.
const FIXED_NORM_EPS: f64 = 1e-6;

/// Video frames per encoder call (diffusers' `num_sample_frames_batch_size`); the first chunk
/// also takes the remainder.
pub const SAMPLE_FRAMES_PER_CHUNK: usize = 8;

/// Latent frames per decoder call (diffusers' `num_latent_frames_batch_size`); the first chunk
/// also takes the remainder.
pub const LATENT_FRAMES_PER_CHUNK: usize = 2;

/// `vae/config.json` of a diffusers `AutoencoderKLCogVideoX`; missing keys take diffusers'
/// defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct CogVideoXVaeConfig {
    /// Video channels in (encoder side).
    pub in_channels: usize,
    /// Video channels out.
    pub out_channels: usize,
    /// Encoder block types; only `CogVideoXDownBlock3D`.
    pub down_block_types: Vec<String>,
    /// Decoder block types; only `CogVideoXUpBlock3D`.
    pub up_block_types: Vec<String>,
    /// Channels per resolution level, from the image side.
    pub block_out_channels: Vec<usize>,
    /// Latent channels.
    pub latent_channels: usize,
    /// Resnets per encoder block; the decoder's blocks have one more.
    pub layers_per_block: usize,
    /// Activation (only `silu`).
    pub act_fn: String,
    /// Epsilon of the encoder's GroupNorms (the decoder's spatial norms use 1e-6).
    pub norm_eps: f64,
    /// Groups of every GroupNorm.
    pub norm_num_groups: usize,
    /// Frames per latent frame; `log2` of it is the number of up blocks that double time.
    pub temporal_compression_ratio: f64,
    /// Half of it is the default tile height ([`CogVideoXVaeConfig::tiling`]).
    pub sample_height: usize,
    /// Half of it is the default tile width ([`CogVideoXVaeConfig::tiling`]).
    pub sample_width: usize,
    /// Latents are divided by it before decoding (0.7 for CogVideoX-5b).
    pub scaling_factor: f64,
    /// Must be null (no CogVideoX checkpoint shifts its latents).
    pub shift_factor: Option<f64>,
    /// Informational.
    pub latents_mean: Option<Vec<f64>>,
    /// Informational.
    pub latents_std: Option<Vec<f64>>,
    /// Informational: `CogVideoXPipeline` does not read it (the caller picks the dtype).
    pub force_upcast: bool,
    /// Not supported (no published checkpoint uses it).
    pub use_quant_conv: bool,
    /// Not supported (no published checkpoint uses it).
    pub use_post_quant_conv: bool,
    /// Image-to-video only (informational).
    pub invert_scale_latents: bool,
}

impl Default for CogVideoXVaeConfig {
    fn default() -> Self {
        let blocks = |name: &str| vec![name.to_string(); 4];
        Self {
            in_channels: 3,
            out_channels: 3,
            down_block_types: blocks("CogVideoXDownBlock3D"),
            up_block_types: blocks("CogVideoXUpBlock3D"),
            block_out_channels: vec![128, 256, 256, 512],
            latent_channels: 16,
            layers_per_block: 3,
            act_fn: "silu".into(),
            norm_eps: 1e-6,
            norm_num_groups: 32,
            temporal_compression_ratio: 4.0,
            sample_height: 480,
            sample_width: 720,
            scaling_factor: 1.15258426,
            shift_factor: None,
            latents_mean: None,
            latents_std: None,
            force_upcast: true,
            use_quant_conv: false,
            use_post_quant_conv: false,
            invert_scale_latents: false,
        }
    }
}

impl CogVideoXVaeConfig {
    /// diffusers' `enable_tiling()` defaults: tiles of half the sample size, overlapping by a
    /// sixth of their height and a fifth of their width.
    pub fn tiling(&self) -> OverlapTiles {
        OverlapTiles {
            min_height: self.sample_height / 2,
            min_width: self.sample_width / 2,
            overlap_factor_height: 1.0 / 6.0,
            overlap_factor_width: 1.0 / 5.0,
        }
    }

    /// Pixels per latent pixel: 2 per up block that upsamples.
    pub fn scale_factor_spatial(&self) -> usize {
        1 << self.block_out_channels.len().saturating_sub(1)
    }

    /// Up blocks that also double time (diffusers' `int(np.log2(temporal_compression_ratio))`).
    fn time_doublings(&self) -> usize {
        self.temporal_compression_ratio.log2().floor().max(0.0) as usize
    }

    /// Frames per latent frame (diffusers' `vae_scale_factor_temporal`).
    pub fn scale_factor_temporal(&self) -> usize {
        1 << self.time_doublings()
    }

    /// Rejects configurations whose encoder cannot be built, with the key at fault.
    pub fn validate_encoder(&self) -> Result<()> {
        self.validate()?;
        if self.down_block_types.len() != self.block_out_channels.len() {
            candle_core::bail!(
                "vae config: down_block_types has {} entries for {} block_out_channels",
                self.down_block_types.len(),
                self.block_out_channels.len()
            );
        }
        if let Some(t) = self
            .down_block_types
            .iter()
            .find(|t| *t != "CogVideoXDownBlock3D")
        {
            candle_core::bail!(
                "vae config: down_block_types entry {t:?} is not supported (only \"CogVideoXDownBlock3D\")"
            );
        }
        if self.in_channels == 0 {
            candle_core::bail!("vae config: in_channels must be positive");
        }
        if self.use_quant_conv {
            candle_core::bail!("vae config: use_quant_conv = true is not supported");
        }
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            candle_core::bail!("vae config: norm_eps must be a non-negative number");
        }
        Ok(())
    }

    /// Rejects configurations this decoder cannot build, with the key at fault.
    pub fn validate(&self) -> Result<()> {
        if self.block_out_channels.is_empty() || self.block_out_channels.contains(&0) {
            candle_core::bail!(
                "vae config: block_out_channels must be a non-empty list of positive numbers"
            );
        }
        if self.up_block_types.len() != self.block_out_channels.len() {
            candle_core::bail!(
                "vae config: up_block_types has {} entries for {} block_out_channels",
                self.up_block_types.len(),
                self.block_out_channels.len()
            );
        }
        if let Some(t) = self
            .up_block_types
            .iter()
            .find(|t| *t != "CogVideoXUpBlock3D")
        {
            candle_core::bail!("vae config: up_block_types entry {t:?} is not supported (only \"CogVideoXUpBlock3D\")");
        }
        if self.latent_channels == 0 || self.out_channels == 0 {
            candle_core::bail!("vae config: latent_channels and out_channels must be positive");
        }
        let groups = self.norm_num_groups;
        if groups == 0
            || self
                .block_out_channels
                .iter()
                .any(|c| !c.is_multiple_of(groups))
        {
            candle_core::bail!(
                "vae config: norm_num_groups {groups} must divide every block_out_channels entry {:?}",
                self.block_out_channels
            );
        }
        crate::models::config_checks::one_of(
            "vae config",
            ("act_fn", &self.act_fn),
            &["silu", "swish"],
        )?;
        if !(self.temporal_compression_ratio.is_finite() && self.temporal_compression_ratio >= 1.0)
        {
            candle_core::bail!("vae config: temporal_compression_ratio must be at least 1");
        }
        if !(self.scaling_factor.is_finite() && self.scaling_factor != 0.0) {
            candle_core::bail!("vae config: scaling_factor must be a non-zero number");
        }
        if self.shift_factor.is_some_and(|s| s != 0.0) {
            candle_core::bail!("vae config: shift_factor is not supported");
        }
        if self.use_post_quant_conv {
            candle_core::bail!("vae config: use_post_quant_conv = true is not supported");
        }
        Ok(())
    }
}

impl VideoVae for CogVideoXVaeConfig {
    fn compression(&self) -> (usize, usize) {
        (self.scale_factor_temporal(), self.scale_factor_spatial())
    }
}

/// The temporal context of every causal conv between decoder chunks, visited in call order
/// (diffusers' nested `conv_cache` dict, flattened).
#[derive(Default)]
struct ConvCache {
    slots: Vec<Option<Tensor>>,
    next: usize,
}

impl ConvCache {
    /// Rewinds to the first slot before a chunk.
    fn start_chunk(&mut self) {
        self.next = 0;
    }

    fn slot(&mut self) -> &mut Option<Tensor> {
        if self.next == self.slots.len() {
            self.slots.push(None);
        }
        self.next += 1;
        &mut self.slots[self.next - 1]
    }
}

/// Frame `t` of `[B, C, T, H, W]` as a contiguous `[B, C, H, W]` image.
fn frame(x: &Tensor, t: usize) -> Result<Tensor> {
    x.narrow(2, t, 1)?.squeeze(2)?.contiguous()
}

/// diffusers' `CogVideoXCausalConv3d` (constant pad mode) with kernel (kt, k, k), stride 1:
/// `kt − 1` frames of context in front, `(k − 1) / 2` zeros around each image. One 3D
/// convolution through cuDNN where it is loaded ([`conv3d`]), else a sum of 2D convolutions.
struct CausalConv3d {
    kernel: Kernel3d,
    bias: Tensor,
    pad: usize,
}

impl CausalConv3d {
    fn new(cin: usize, cout: usize, kernel: usize, vb: VarBuilder) -> Result<Self> {
        Self::from_weights(cin, cout, kernel, vb.pp("conv"))
    }

    /// The weights directly under `vb` (diffusers' plain `CogVideoXSafeConv3d`).
    fn from_weights(cin: usize, cout: usize, kernel: usize, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get((cout, cin, kernel, kernel, kernel), "weight")?;
        Ok(Self {
            kernel: Kernel3d::new(weight)?,
            bias: vb.get(cout, "bias")?.reshape((1, cout, 1, 1))?,
            pad: (kernel - 1) / 2,
        })
    }

    /// `x` `[B, C, T, H, W]` -> `[B, C_out, T, H, W]`. A conv with a temporal kernel takes the
    /// next slot of `cache` as its front context (the first frame repeated when empty) and leaves
    /// its last `kt − 1` input frames there. Only a window of `kt` input frames is copied at a
    /// time and each output frame is written into the result in place, so the peak stays near
    /// input + output + one frame's im2col.
    fn forward(&self, x: &Tensor, cache: Option<&mut ConvCache>) -> Result<Tensor> {
        self.forward_plus(x, cache, None)
    }

    /// [`Self::forward`] plus `residual` (of the output's shape) where given: a resnet's
    /// `conv(h) + x`, added with the bias in one pass on the fused path.
    fn forward_plus(
        &self,
        x: &Tensor,
        cache: Option<&mut ConvCache>,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let kt = self.kernel.kt()?;
        let context = kt.saturating_sub(1);
        let (b, _, t_in, _, _) = x.dims5()?;
        let (slot, prev) = if context > 0 {
            let Some(cache) = cache else {
                candle_core::bail!("causal conv3d with a temporal kernel needs a conv cache");
            };
            let slot = cache.slot();
            let prev = slot.clone();
            (Some(slot), prev)
        } else {
            (None, None)
        };
        // Frame `i` of the padded sequence [context | x].
        let source = |i: usize| -> Result<Tensor> {
            if i >= context {
                frame(x, i - context)
            } else {
                match &prev {
                    Some(p) => frame(p, i),
                    None => frame(x, 0),
                }
            }
        };
        if let Some(slot) = slot {
            *slot = Some(if t_in >= context {
                x.narrow(2, t_in - context, context)?.contiguous()?
            } else {
                let kept = (t_in..t_in + context)
                    .map(source)
                    .collect::<Result<Vec<_>>>()?;
                Tensor::stack(&kept, 2)?
            });
        }
        #[cfg(feature = "cuda")]
        if let Some(w) = self.kernel.whole() {
            // Channels last, the context read where it lies: the frames kept from the chunk
            // before, or x's first frame repeated.
            let from = |j: usize| match prev {
                Some(_) => j as u32,
                None => j.saturating_sub(context) as u32,
            };
            let channels_last = || {
                conv3d::padded_conv_channels_last(
                    (x, prev.as_ref()),
                    (context + t_in, &from, 1),
                    (w, 1, self.pad),
                    &self.bias,
                    residual,
                )
            };
            if let Some(y) = conv3d::or_fallback(channels_last) {
                return Ok(y);
            }
        }
        if let Some(w) = self.kernel.whole() {
            // One 3D convolution over [context | x] (cuDNN).
            let whole = || -> Result<Option<Tensor>> {
                let front = (0..context).map(&source).collect::<Result<Vec<_>>>()?;
                let padded = if front.is_empty() {
                    x.clone()
                } else {
                    Tensor::cat(&[&Tensor::stack(&front, 2)?, x], 2)?
                };
                match conv3d::conv3d(&padded, w, [1; 3], [0, self.pad, self.pad])? {
                    Some(y) => Ok(Some(conv3d::add_channel_bias_plus(
                        y, &self.bias, residual,
                    )?)),
                    None => Ok(None),
                }
            };
            if let Some(y) = conv3d::or_fallback(whole) {
                return Ok(y);
            }
        }
        let taps = self.kernel.taps()?;
        let mut window = (0..context)
            .map(source)
            .collect::<Result<std::collections::VecDeque<_>>>()?;
        let mut out: Option<Tensor> = None;
        for o in 0..t_in {
            window.push_back(source(o + context)?);
            let mut acc: Option<Tensor> = None;
            for (input, tap) in window.iter().zip(taps.iter()) {
                let y = input.conv2d(tap, self.pad, 1, 1, 1)?;
                acc = Some(match acc {
                    Some(a) => (a + y)?,
                    None => y,
                });
            }
            let Some(y) = acc else {
                candle_core::bail!("causal conv3d without taps");
            };
            let y = y.broadcast_add(&self.bias)?.unsqueeze(2)?;
            let out = match &out {
                Some(out) => out,
                None => {
                    let (_, cout, _, h, w) = y.dims5()?;
                    out.insert(Tensor::zeros((b, cout, t_in, h, w), y.dtype(), y.device())?)
                }
            };
            out.slice_set(&y, 2, o)?;
            window.pop_front();
        }
        let out =
            out.ok_or_else(|| candle_core::Error::Msg("causal conv3d on zero frames".into()))?;
        conv3d::plus(out, residual)
    }
}

/// Source index of each output position of torch's `interpolate(mode="nearest")` to
/// `out_size` (`floor(dst · (in / out))` in f32, exact shortcuts for equal and doubled sizes).
fn nearest_indices(in_size: usize, out_size: usize) -> Vec<u32> {
    let last = in_size.saturating_sub(1);
    (0..out_size)
        .map(|o| {
            let src = if out_size == in_size {
                o
            } else if out_size == 2 * in_size {
                o >> 1
            } else {
                let scale = in_size as f32 / out_size as f32;
                ((o as f32 * scale).floor() as usize).min(last)
            };
            src as u32
        })
        .collect()
}

/// Nearest resize of `x` `[B, C, T, H, W]` to `(t, h, w)` (torch's `F.interpolate(x, size=...)`).
fn resize_nearest(x: &Tensor, size: [usize; 3]) -> Result<Tensor> {
    let mut x = x.clone();
    for (axis, &out) in size.iter().enumerate() {
        let dim = axis + 2;
        let len = x.dim(dim)?;
        if len != out {
            let idx = nearest_indices(len, out);
            let idx = Tensor::from_vec(idx, out, x.device())?;
            x = x.contiguous()?.index_select(&idx, dim)?;
        }
    }
    Ok(x)
}

/// `[B, C, T, H, W]` -> `[B, C, T, 2H, 2W]`, nearest.
fn double_space(x: &Tensor) -> Result<Tensor> {
    let (b, c, t, h, w) = x.dims5()?;
    x.contiguous()?
        .reshape((b, c * t, h, w))?
        .upsample_nearest2d(2 * h, 2 * w)?
        .reshape((b, c, t, 2 * h, 2 * w))
}

/// `[B, C, T, H, W]` -> `[B, C, 2T, 2H, 2W]`, nearest.
fn double_space_time(x: &Tensor) -> Result<Tensor> {
    let t = x.dim(2)?;
    let idx = Tensor::from_vec(nearest_indices(t, 2 * t), 2 * t, x.device())?;
    double_space(&x.contiguous()?.index_select(&idx, 2)?)
}

/// diffusers' `CogVideoXSpatialNorm3D`: `GroupNorm(f) · conv_y(zq) + conv_b(zq)` with `zq` the
/// latent chunk resized to `f` (its first frame resized on its own when `f` has an odd number of
/// frames above one). Every use is followed by SiLU, taken with it.
struct SpatialNorm3D {
    norm: RunGroupNorm,
    conv_y: CausalConv3d,
    conv_b: CausalConv3d,
}

impl SpatialNorm3D {
    fn new(channels: usize, zq_channels: usize, groups: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            norm: RunGroupNorm::new(groups, channels, FIXED_NORM_EPS, vb.pp("norm_layer"))?,
            conv_y: CausalConv3d::new(zq_channels, channels, 1, vb.pp("conv_y"))?,
            conv_b: CausalConv3d::new(zq_channels, channels, 1, vb.pp("conv_b"))?,
        })
    }

    /// The norm, then SiLU.
    fn forward_silu(&self, f: &Tensor, zq: &Tensor) -> Result<Tensor> {
        let (_, _, t, h, w) = f.dims5()?;
        let zq = if t > 1 && !t.is_multiple_of(2) {
            let z_len = zq.dim(2)?;
            let first = resize_nearest(&zq.narrow(2, 0, 1)?, [1, h, w])?;
            let rest = resize_nearest(&zq.narrow(2, 1, z_len.saturating_sub(1))?, [t - 1, h, w])?;
            Tensor::cat(&[first, rest], 2)?
        } else {
            resize_nearest(zq, [t, h, w])?
        };
        let y = self.conv_y.forward(&zq, None)?;
        let b = self.conv_b.forward(&zq, None)?;
        drop(zq);
        self.norm.forward_then(f, Some((&y, &b)), true)
    }
}

/// The norm of a resnet: a spatial norm conditioned on the latents (decoder) or a plain
/// GroupNorm (encoder).
enum ResnetNorm {
    Spatial(SpatialNorm3D),
    Group(RunGroupNorm),
}

impl ResnetNorm {
    /// Spatial norms when `latent_channels` is given (the decoder), else a GroupNorm with `eps`.
    fn new(
        channels: usize,
        latent_channels: Option<usize>,
        groups: usize,
        eps: f64,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(match latent_channels {
            Some(zc) => Self::Spatial(SpatialNorm3D::new(channels, zc, groups, vb)?),
            None => Self::Group(RunGroupNorm::new(groups, channels, eps, vb)?),
        })
    }

    /// The norm, then SiLU (as every resnet takes it).
    fn forward_silu(&self, x: &Tensor, zq: Option<&Tensor>) -> Result<Tensor> {
        match (self, zq) {
            (Self::Spatial(norm), Some(zq)) => norm.forward_silu(x, zq),
            (Self::Group(norm), _) => norm.forward_then(x, None, true),
            (Self::Spatial(_), None) => candle_core::bail!("a spatial norm needs the latents"),
        }
    }
}

/// diffusers' `CogVideoXResnetBlock3D` without time embedding: spatial norms in the decoder,
/// GroupNorms in the encoder.
struct ResnetBlock3D {
    norm1: ResnetNorm,
    conv1: CausalConv3d,
    norm2: ResnetNorm,
    conv2: CausalConv3d,
    /// 1x1x1 conv when the channel count changes.
    shortcut: Option<CausalConv3d>,
}

impl ResnetBlock3D {
    /// A decoder resnet (spatial norms conditioned on the latents).
    fn new(cin: usize, cout: usize, cfg: &CogVideoXVaeConfig, vb: VarBuilder) -> Result<Self> {
        Self::build(cin, cout, cfg, Some(cfg.latent_channels), vb)
    }

    /// An encoder resnet (GroupNorms with the config's `norm_eps`).
    fn new_encoder(
        cin: usize,
        cout: usize,
        cfg: &CogVideoXVaeConfig,
        vb: VarBuilder,
    ) -> Result<Self> {
        Self::build(cin, cout, cfg, None, vb)
    }

    fn build(
        cin: usize,
        cout: usize,
        cfg: &CogVideoXVaeConfig,
        latent_channels: Option<usize>,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (groups, eps) = (cfg.norm_num_groups, cfg.norm_eps);
        Ok(Self {
            norm1: ResnetNorm::new(cin, latent_channels, groups, eps, vb.pp("norm1"))?,
            conv1: CausalConv3d::new(cin, cout, 3, vb.pp("conv1"))?,
            norm2: ResnetNorm::new(cout, latent_channels, groups, eps, vb.pp("norm2"))?,
            conv2: CausalConv3d::new(cout, cout, 3, vb.pp("conv2"))?,
            shortcut: if cin != cout {
                Some(CausalConv3d::from_weights(
                    cin,
                    cout,
                    1,
                    vb.pp("conv_shortcut"),
                )?)
            } else {
                None
            },
        })
    }

    fn forward(&self, x: &Tensor, zq: Option<&Tensor>, cache: &mut ConvCache) -> Result<Tensor> {
        // Each intermediate dropped as the next exists (a shadowed binding lives to the end).
        let h = self
            .conv1
            .forward(&self.norm1.forward_silu(x, zq)?, Some(cache))?;
        let normed = self.norm2.forward_silu(&h, zq)?;
        drop(h);
        let res = match &self.shortcut {
            Some(conv) => conv.forward(x, None)?,
            None => x.clone(),
        };
        self.conv2.forward_plus(&normed, Some(cache), Some(&res))
    }
}

/// Mean of consecutive frame pairs of `[B, C, T, H, W]` (`avg_pool1d(kernel 2, stride 2)` over
/// time; an odd last frame is dropped).
fn average_frame_pairs(x: &Tensor) -> Result<Tensor> {
    let (b, c, t, h, w) = x.dims5()?;
    let pairs = t / 2;
    x.narrow(2, 0, 2 * pairs)?
        .reshape((b, c, pairs, 2, h, w))?
        .sum(3)?
        .affine(0.5, 0.0)
}

/// diffusers' `CogVideoXDownsample3D`: time halved by averaging frame pairs (a lone first frame
/// kept) in the first down blocks, then zero padding right and bottom and a stride-2 3x3 Conv2d
/// per frame.
struct Downsample3D {
    weight: Tensor,
    bias: Tensor,
    compress_time: bool,
}

impl Downsample3D {
    fn new(channels: usize, compress_time: bool, vb: VarBuilder) -> Result<Self> {
        let vb = vb.pp("conv");
        Ok(Self {
            weight: vb.get((channels, channels, 3, 3), "weight")?,
            bias: vb.get(channels, "bias")?.reshape((1, channels, 1, 1))?,
            compress_time,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.dim(2)?;
        let x = if self.compress_time && !t.is_multiple_of(2) {
            let first = x.narrow(2, 0, 1)?;
            if t > 1 {
                Tensor::cat(&[first, average_frame_pairs(&x.narrow(2, 1, t - 1)?)?], 2)?
            } else {
                first
            }
        } else if self.compress_time {
            average_frame_pairs(x)?
        } else {
            x.clone()
        };
        let x = x.pad_with_zeros(3, 0, 1)?.pad_with_zeros(4, 0, 1)?;
        let frames = (0..x.dim(2)?)
            .map(|t| {
                frame(&x, t)?
                    .conv2d(&self.weight, 0, 2, 1, 1)?
                    .broadcast_add(&self.bias)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&frames, 2)
    }
}

/// diffusers' `CogVideoXEncoder3D`.
struct Encoder3D {
    conv_in: CausalConv3d,
    /// Each down block: its resnets and its downsampler (all but the last block).
    down_blocks: Vec<(Vec<ResnetBlock3D>, Option<Downsample3D>)>,
    mid: Vec<ResnetBlock3D>,
    norm_out: RunGroupNorm,
    conv_out: CausalConv3d,
}

impl Encoder3D {
    fn new(cfg: &CogVideoXVaeConfig, vb: VarBuilder) -> Result<Self> {
        let channels = &cfg.block_out_channels;
        let doublings = cfg.time_doublings();
        let mut down_blocks = Vec::with_capacity(channels.len());
        let mut prev = channels[0];
        for (i, &out) in channels.iter().enumerate() {
            let bvb = vb.pp(format!("down_blocks.{i}"));
            let resnets = (0..cfg.layers_per_block)
                .map(|j| {
                    let cin = if j == 0 { prev } else { out };
                    ResnetBlock3D::new_encoder(cin, out, cfg, bvb.pp(format!("resnets.{j}")))
                })
                .collect::<Result<Vec<_>>>()?;
            let down = if i + 1 < channels.len() {
                Some(Downsample3D::new(
                    out,
                    i < doublings,
                    bvb.pp("downsamplers.0"),
                )?)
            } else {
                None
            };
            down_blocks.push((resnets, down));
            prev = out;
        }
        let last = channels[channels.len() - 1];
        let mid = (0..2)
            .map(|i| {
                ResnetBlock3D::new_encoder(last, last, cfg, vb.pp(format!("mid_block.resnets.{i}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            conv_in: CausalConv3d::new(cfg.in_channels, channels[0], 3, vb.pp("conv_in"))?,
            down_blocks,
            mid,
            norm_out: RunGroupNorm::new(
                cfg.norm_num_groups,
                last,
                FIXED_NORM_EPS,
                vb.pp("norm_out"),
            )?,
            conv_out: CausalConv3d::new(last, 2 * cfg.latent_channels, 3, vb.pp("conv_out"))?,
        })
    }

    /// One chunk of video frames -> `[B, 2 · latent_channels, t, h, w]` (mean | logvar).
    fn forward(&self, x: &Tensor, cache: &mut ConvCache) -> Result<Tensor> {
        cache.start_chunk();
        let mut h = self.conv_in.forward(x, Some(cache))?;
        for (resnets, down) in &self.down_blocks {
            for resnet in resnets {
                h = resnet.forward(&h, None, cache)?;
            }
            if let Some(down) = down {
                h = down.forward(&h)?;
            }
        }
        for resnet in &self.mid {
            h = resnet.forward(&h, None, cache)?;
        }
        let h = self.norm_out.forward_then(&h, None, true)?;
        self.conv_out.forward(&h, Some(cache))
    }
}

/// diffusers' `CogVideoXUpsample3D`: nearest 2x in space (and in time for the first up blocks,
/// keeping a lone first frame single), then a 3x3 Conv2d per frame.
struct Upsample3D {
    conv: CausalConv3d,
    compress_time: bool,
}

impl Upsample3D {
    fn new(channels: usize, compress_time: bool, vb: VarBuilder) -> Result<Self> {
        let vb = vb.pp("conv");
        let weight = vb.get((channels, channels, 3, 3), "weight")?;
        Ok(Self {
            conv: CausalConv3d {
                // A 2D conv is a 3D conv with one temporal tap (one cuDNN call for all frames).
                kernel: Kernel3d::new(weight.unsqueeze(2)?)?,
                bias: vb.get(channels, "bias")?.reshape((1, channels, 1, 1))?,
                pad: 1,
            },
            compress_time,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.dim(2)?;
        // Time doubles where it is compressed; with an odd count the first frame stays single.
        let doubled = self.compress_time && t > 1;
        let odd = doubled && !t.is_multiple_of(2);
        #[cfg(feature = "cuda")]
        if let Some(w) = self.conv.kernel.whole() {
            // The convolution gathers each upsampled frame's pixels from x where they lie: no
            // upsampled copy (output frame j is x's frame `source(j)`).
            let frames = if doubled { 2 * t - usize::from(odd) } else { t };
            let source = |j: usize| match (doubled, odd) {
                (true, true) => j.div_ceil(2) as u32,
                (true, false) => (j / 2) as u32,
                _ => j as u32,
            };
            let upsampled = || {
                conv3d::padded_conv_channels_last(
                    (x, None),
                    (frames, &source, 2),
                    (w, 1, self.conv.pad),
                    &self.conv.bias,
                    None,
                )
            };
            if let Some(y) = conv3d::or_fallback(upsampled) {
                return Ok(y);
            }
        }
        let x = if odd {
            let first = double_space(&x.narrow(2, 0, 1)?)?;
            let rest = double_space_time(&x.narrow(2, 1, t - 1)?)?;
            Tensor::cat(&[first, rest], 2)?
        } else if doubled {
            double_space_time(x)?
        } else {
            double_space(x)?
        };
        self.conv.forward(&x, None)
    }
}

/// One `CogVideoXUpBlock3D`.
struct UpBlock3D {
    resnets: Vec<ResnetBlock3D>,
    upsampler: Option<Upsample3D>,
}

/// diffusers' `CogVideoXDecoder3D`.
struct Decoder3D {
    conv_in: CausalConv3d,
    mid: Vec<ResnetBlock3D>,
    up_blocks: Vec<UpBlock3D>,
    norm_out: SpatialNorm3D,
    conv_out: CausalConv3d,
}

impl Decoder3D {
    fn new(cfg: &CogVideoXVaeConfig, vb: VarBuilder) -> Result<Self> {
        let channels: Vec<usize> = cfg.block_out_channels.iter().rev().copied().collect();
        let top = channels[0];
        let mid = (0..2)
            .map(|i| ResnetBlock3D::new(top, top, cfg, vb.pp(format!("mid_block.resnets.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let doublings = cfg.time_doublings();
        let mut up_blocks = Vec::with_capacity(channels.len());
        let mut prev = top;
        for (i, &out) in channels.iter().enumerate() {
            let bvb = vb.pp(format!("up_blocks.{i}"));
            let resnets = (0..=cfg.layers_per_block)
                .map(|j| {
                    let cin = if j == 0 { prev } else { out };
                    ResnetBlock3D::new(cin, out, cfg, bvb.pp(format!("resnets.{j}")))
                })
                .collect::<Result<Vec<_>>>()?;
            let upsampler = if i + 1 < channels.len() {
                Some(Upsample3D::new(out, i < doublings, bvb.pp("upsamplers.0"))?)
            } else {
                None
            };
            up_blocks.push(UpBlock3D { resnets, upsampler });
            prev = out;
        }
        let last = channels[channels.len() - 1];
        Ok(Self {
            conv_in: CausalConv3d::new(cfg.latent_channels, top, 3, vb.pp("conv_in"))?,
            mid,
            up_blocks,
            norm_out: SpatialNorm3D::new(
                last,
                cfg.latent_channels,
                cfg.norm_num_groups,
                vb.pp("norm_out"),
            )?,
            conv_out: CausalConv3d::new(last, cfg.out_channels, 3, vb.pp("conv_out"))?,
        })
    }

    /// One chunk of latent frames `z` `[B, C, t, h, w]` -> video frames.
    fn forward(&self, z: &Tensor, cache: &mut ConvCache) -> Result<Tensor> {
        cache.start_chunk();
        let mut h = self.conv_in.forward(z, Some(cache))?;
        for resnet in &self.mid {
            h = resnet.forward(&h, Some(z), cache)?;
        }
        for block in &self.up_blocks {
            for resnet in &block.resnets {
                h = resnet.forward(&h, Some(z), cache)?;
            }
            if let Some(up) = &block.upsampler {
                h = up.forward(&h)?;
            }
        }
        let h = self.norm_out.forward_silu(&h, z)?;
        self.conv_out.forward(&h, Some(cache))
    }
}

/// diffusers' `AutoencoderKLCogVideoX`: the decoder, and the encoder unless built
/// with [`Self::new_decoder_only`].
pub struct AutoencoderKLCogVideoX {
    cfg: CogVideoXVaeConfig,
    encoder: Option<Encoder3D>,
    decoder: Decoder3D,
    dtype: DType,
}

impl AutoencoderKLCogVideoX {
    /// Loads encoder and decoder from a `vae/` checkpoint, in the `VarBuilder`'s dtype.
    pub fn new(cfg: &CogVideoXVaeConfig, vb: VarBuilder) -> Result<Self> {
        let mut vae = Self::new_decoder_only(cfg, vb.clone())?;
        cfg.validate_encoder()?;
        vae.encoder = Some(Encoder3D::new(cfg, vb.pp("encoder"))?);
        Ok(vae)
    }

    /// Loads only the decoder (all text-to-video needs); [`Self::encode`] then refuses to run.
    pub fn new_decoder_only(cfg: &CogVideoXVaeConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            cfg: cfg.clone(),
            encoder: None,
            decoder: Decoder3D::new(cfg, vb.pp("decoder"))?,
            dtype: vb.dtype(),
        })
    }

    /// The configuration the VAE was built with.
    pub fn config(&self) -> &CogVideoXVaeConfig {
        &self.cfg
    }

    /// The dtype the VAE computes in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The pipeline's `decode_latents` input: transformer-space latents `[B, F, C, H, W]` ->
    /// `[B, C, F, H, W]` times `1 / scaling_factor` (the Python float, rounded to f32), in the
    /// latents' dtype as diffusers computes it.
    pub fn scale_latents(&self, latents: &Tensor) -> Result<Tensor> {
        let inv = (1.0 / self.cfg.scaling_factor) as f32;
        latents
            .permute((0, 2, 1, 3, 4))?
            .affine(f64::from(inv), 0.0)
    }

    /// Decodes scaled latents `z` `[B, C, F, H, W]` to video `[B, out_channels, T, 8H, 8W]` (not
    /// clamped), `T = 4(F − 1) + 1` for odd `F`, in chunks of [`LATENT_FRAMES_PER_CHUNK`]
    /// latent frames (the first taking the remainder) with the conv caches carried over, as
    /// diffusers' `_decode` without tiling.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        let (_, c, frames, h, w) = z.dims5()?;
        if c != self.cfg.latent_channels {
            candle_core::bail!(
                "latents have {c} channels, the VAE expects {}",
                self.cfg.latent_channels
            );
        }
        if frames == 0 || h == 0 || w == 0 {
            candle_core::bail!("cannot decode empty latents [{frames}, {h}, {w}]");
        }
        let z = z.to_dtype(self.dtype)?;
        let per = LATENT_FRAMES_PER_CHUNK;
        let chunks = (frames / per).max(1);
        let remainder = frames % per;
        let mut cache = ConvCache::default();
        let mut out = Vec::with_capacity(chunks);
        for i in 0..chunks {
            let start = per * i + if i == 0 { 0 } else { remainder };
            let end = (per * (i + 1) + remainder).min(frames);
            out.push(
                self.decoder
                    .forward(&z.narrow(2, start, end - start)?, &mut cache)?,
            );
        }
        Tensor::cat(&out, 2)
    }

    /// Decodes like [`Self::decode`] in overlapping spatial tiles, each decoded frame-batched,
    /// blended together, as diffusers' `tiled_decode`; latents no larger than a tile are
    /// decoded whole.
    pub fn decode_tiled(&self, z: &Tensor, tiles: &OverlapTiles) -> Result<Tensor> {
        let ratio = self.cfg.scale_factor_spatial();
        tiles.validate(ratio)?;
        let (_, _, _, h, w) = z.dims5()?;
        if !tiles.splits((h, w), ratio) {
            return self.decode(z);
        }
        tiles.decode(z, ratio, |tile| self.decode(tile))
    }

    /// Encodes video `[B, in_channels, T, H, W]` in [-1, 1] to the latent distribution's
    /// `(mean, logvar)`, each `[B, latent_channels, F, H/8, W/8]`, unscaled, `logvar` clamped
    /// to [-30, 20]; in chunks of [`SAMPLE_FRAMES_PER_CHUNK`] frames (the first taking the
    /// remainder) with the conv caches carried over, as diffusers' `_encode` without tiling.
    pub fn encode(&self, video: &Tensor) -> Result<(Tensor, Tensor)> {
        let Some(encoder) = &self.encoder else {
            candle_core::bail!("this VAE was loaded without its encoder");
        };
        let (_, c, frames, h, w) = video.dims5()?;
        if c != self.cfg.in_channels {
            candle_core::bail!(
                "video has {c} channels, the VAE expects {}",
                self.cfg.in_channels
            );
        }
        if frames == 0 || h == 0 || w == 0 {
            candle_core::bail!("cannot encode an empty video [{frames}, {h}, {w}]");
        }
        let video = video.to_dtype(self.dtype)?;
        let per = SAMPLE_FRAMES_PER_CHUNK;
        let chunks = (frames / per).max(1);
        let remainder = frames % per;
        let mut cache = ConvCache::default();
        let mut out = Vec::with_capacity(chunks);
        for i in 0..chunks {
            let start = per * i + if i == 0 { 0 } else { remainder };
            let end = (per * (i + 1) + remainder).min(frames);
            out.push(encoder.forward(&video.narrow(2, start, end - start)?, &mut cache)?);
        }
        let moments = Tensor::cat(&out, 2)?;
        let latent = self.cfg.latent_channels;
        let mean = moments.narrow(1, 0, latent)?;
        let logvar = moments.narrow(1, latent, latent)?.clamp(-30.0, 20.0)?;
        Ok((mean, logvar))
    }
}

crate::placed_whole!(
    AutoencoderKLCogVideoX,
    CogVideoXVaeConfig,
    AutoencoderKLCogVideoX::new_decoder_only
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_indices_match_torch() {
        assert_eq!(nearest_indices(2, 4), vec![0, 0, 1, 1]);
        assert_eq!(
            nearest_indices(4, 16),
            (0..16).map(|i| i / 4).collect::<Vec<u32>>()
        );
        assert_eq!(nearest_indices(3, 3), vec![0, 1, 2]);
        // Downsizing and non-integer ratios: floor(dst * in / out).
        assert_eq!(nearest_indices(3, 2), vec![0, 1]);
        assert_eq!(nearest_indices(2, 3), vec![0, 0, 1]);
    }

    #[test]
    fn frame_counts_follow_diffusers() {
        let cfg = CogVideoXVaeConfig::default();
        assert_eq!(cfg.scale_factor_spatial(), 8);
        assert_eq!(cfg.scale_factor_temporal(), 4);
        assert!(cfg.validate().is_ok());
        let bad = CogVideoXVaeConfig {
            norm_num_groups: 7,
            ..cfg
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("norm_num_groups"));
    }
}
