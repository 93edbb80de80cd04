//! The HunyuanVideo VAE (diffusers' `AutoencoderKLHunyuanVideo`): the decoder the pipeline
//! uses, and the encoder on request.
//!
//! A causal 3D-conv autoencoder: every conv pads time with k-1 copies of the first frame and
//! space by replication (not zeros), decoder upsamplers double the first frame in space only and
//! the others in time and space (encoder downsamplers are strided convs), and the mid-block
//! attention runs over all positions with a frame-causal mask. Unlike the Wan VAE
//! (`src/models/wan/vae`: zero padding, frame by frame with a feature cache) this model sees
//! whole tiles at once, as diffusers runs it, so no layer is shared.
//!
//! Decoding and encoding are tiled in time by default (diffusers' `use_framewise_decoding` /
//! `use_framewise_encoding`): long inputs run in overlapping tiles blended linearly; spatial
//! tiling (`enable_tiling`) is optional. Within a tile every norm and convolution works in runs
//! of frames written into one output ([`RUN_ELEMENTS`], at least [`MIN_RUNS`] runs), so a
//! full-resolution layer holds its input, its output and one run's temporaries; the own
//! convolution also splits by row bands so that no im2col scratch exceeds
//! [`MAX_IM2COL_ELEMENTS`].
//!
//! Activations are frames-major, `[B, T, C, H, W]`, so a time tap of a conv is a contiguous
//! batch of images for candle's conv2d. Everything runs in the `VarBuilder` dtype (f32 in
//! diffusers' pipeline).

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;

use crate::models::attention::sdpa;
use crate::models::conv3d::{self, Kernel3d};
use crate::models::runs::{fused_group_norm, in_runs, GroupNormSpec, Rounding};
use crate::models::vae_tiling::{
    decode_frame_tiles, spatial_tiles, temporal_tiles, Dropped, SampleTiles, SpatialTiling,
};

/// Epsilon of every GroupNorm of the decoder (hard-coded in diffusers).
const NORM_EPS: f64 = 1e-6;

const UP_BLOCK: &str = "HunyuanVideoUpBlock3D";
const DOWN_BLOCK: &str = "HunyuanVideoDownBlock3D";

fn default_channels() -> usize {
    3
}
fn default_latent_channels() -> usize {
    16
}
fn default_up_block_types() -> Vec<String> {
    vec![UP_BLOCK.to_string(); 4]
}
fn default_down_block_types() -> Vec<String> {
    vec![DOWN_BLOCK.to_string(); 4]
}
fn default_block_out_channels() -> Vec<usize> {
    vec![128, 256, 512, 512]
}
fn default_layers_per_block() -> usize {
    2
}
fn default_act_fn() -> String {
    "silu".into()
}
fn default_norm_num_groups() -> usize {
    32
}
fn default_scaling_factor() -> f64 {
    0.476986
}
fn default_spatial_compression_ratio() -> usize {
    8
}
fn default_temporal_compression_ratio() -> usize {
    4
}
fn default_true() -> bool {
    true
}

/// `vae/config.json` of a diffusers HunyuanVideo checkpoint; missing keys take diffusers'
/// defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct HunyuanVideoVaeConfig {
    #[serde(default = "default_channels")]
    pub in_channels: usize,
    /// Video channels out.
    #[serde(default = "default_channels")]
    pub out_channels: usize,
    #[serde(default = "default_latent_channels")]
    pub latent_channels: usize,
    /// Encoder levels (only checked when the encoder is loaded).
    #[serde(default = "default_down_block_types")]
    pub down_block_types: Vec<String>,
    #[serde(default = "default_up_block_types")]
    pub up_block_types: Vec<String>,
    /// Channels per level; the decoder walks them in reverse.
    #[serde(default = "default_block_out_channels")]
    pub block_out_channels: Vec<usize>,
    /// Res blocks per encoder level (the decoder has one more).
    #[serde(default = "default_layers_per_block")]
    pub layers_per_block: usize,
    #[serde(default = "default_act_fn")]
    pub act_fn: String,
    #[serde(default = "default_norm_num_groups")]
    pub norm_num_groups: usize,
    /// The pipeline decodes `latents / scaling_factor`.
    #[serde(default = "default_scaling_factor")]
    pub scaling_factor: f64,
    #[serde(default = "default_spatial_compression_ratio")]
    pub spatial_compression_ratio: usize,
    #[serde(default = "default_temporal_compression_ratio")]
    pub temporal_compression_ratio: usize,
    #[serde(default = "default_true")]
    pub mid_block_add_attention: bool,
}

impl Default for HunyuanVideoVaeConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("defaults deserialize")
    }
}

impl HunyuanVideoVaeConfig {
    /// Rejects configurations this decoder cannot build, naming the key.
    pub fn validate(&self) -> Result<()> {
        crate::models::config_checks::one_of(
            "vae config",
            ("act_fn", &self.act_fn),
            &["silu", "swish"],
        )?;
        if self.block_out_channels.is_empty() || self.block_out_channels.contains(&0) {
            candle_core::bail!(
                "vae config: block_out_channels {:?} must be non-empty and positive",
                self.block_out_channels
            );
        }
        if self.up_block_types.len() != self.block_out_channels.len()
            || self.up_block_types.iter().any(|t| t != UP_BLOCK)
        {
            candle_core::bail!(
                "vae config: up_block_types must be {} x {UP_BLOCK:?}",
                self.block_out_channels.len()
            );
        }
        if self.temporal_compression_ratio != 4 {
            candle_core::bail!(
                "vae config: temporal_compression_ratio {} is not supported (only 4, as diffusers)",
                self.temporal_compression_ratio
            );
        }
        if !self.spatial_compression_ratio.is_power_of_two() {
            candle_core::bail!(
                "vae config: spatial_compression_ratio {} must be a power of two",
                self.spatial_compression_ratio
            );
        }
        let g = self.norm_num_groups;
        if g == 0 || self.block_out_channels.iter().any(|c| c % g != 0) {
            candle_core::bail!(
                "vae config: norm_num_groups {g} must divide every block_out_channels entry {:?}",
                self.block_out_channels
            );
        }
        if self.latent_channels == 0 || self.out_channels == 0 {
            candle_core::bail!("vae config: latent_channels and out_channels must be positive");
        }
        if !(self.scaling_factor.is_finite() && self.scaling_factor != 0.0) {
            candle_core::bail!(
                "vae config: scaling_factor {} must be a non-zero number",
                self.scaling_factor
            );
        }
        Ok(())
    }

    /// Rejects encoder settings the encoder cannot build, naming the key.
    fn validate_encoder(&self) -> Result<()> {
        if self.down_block_types.len() != self.block_out_channels.len()
            || self.down_block_types.iter().any(|t| t != DOWN_BLOCK)
        {
            candle_core::bail!(
                "vae config: down_block_types must be {} x {DOWN_BLOCK:?}",
                self.block_out_channels.len()
            );
        }
        if self.in_channels == 0 {
            candle_core::bail!("vae config: in_channels must be positive");
        }
        Ok(())
    }

    /// `(time, space)` resampling of level `i` (encoder down block `i`, decoder up block `i`),
    /// as diffusers derives it for a temporal compression of 4.
    fn resampling(&self, i: usize) -> (bool, bool) {
        let n = self.block_out_channels.len();
        let spatial_layers = self.spatial_compression_ratio.trailing_zeros() as usize;
        let time_layers = self.temporal_compression_ratio.trailing_zeros() as usize;
        let is_final = i == n - 1;
        let space = i < spatial_layers;
        let time = i + 1 + time_layers >= n && !is_final;
        (time, space)
    }

    /// The decoder's channels at full resolution: the activation its last spatial upsampler
    /// writes there, and the last up block's (what a memory plan counts the decode's peak by).
    pub fn full_resolution_channels(&self) -> (usize, usize) {
        let n = self.block_out_channels.len();
        let last = self.block_out_channels.first().copied().unwrap_or(0);
        let upsampled = (0..n)
            .rev()
            .find(|&i| self.resampling(i).1)
            .map_or(last, |i| self.block_out_channels[n - 1 - i]);
        (upsampled, last)
    }
}

/// The tiling of [`AutoencoderKLHunyuanVideo::decode`], in video pixels and frames (diffusers'
/// attributes and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HunyuanVideoVaeTiling {
    /// Temporal tiling (`use_framewise_decoding`, on by default).
    pub framewise: bool,
    /// Spatial tiling (`use_tiling`, off unless `enable_tiling()`).
    pub spatial: bool,
    pub tile_sample_min_height: usize,
    pub tile_sample_min_width: usize,
    pub tile_sample_min_num_frames: usize,
    pub tile_sample_stride_height: usize,
    pub tile_sample_stride_width: usize,
    pub tile_sample_stride_num_frames: usize,
}

impl Default for HunyuanVideoVaeTiling {
    fn default() -> Self {
        Self {
            framewise: true,
            spatial: false,
            tile_sample_min_height: 256,
            tile_sample_min_width: 256,
            tile_sample_min_num_frames: 16,
            tile_sample_stride_height: 192,
            tile_sample_stride_width: 192,
            tile_sample_stride_num_frames: 12,
        }
    }
}

impl HunyuanVideoVaeTiling {
    /// The spatial tiles `tiled_decode` runs.
    fn spatial_tiles(&self) -> SampleTiles {
        SampleTiles {
            min_height: self.tile_sample_min_height,
            min_width: self.tile_sample_min_width,
            stride_height: self.tile_sample_stride_height,
            stride_width: self.tile_sample_stride_width,
        }
    }

    fn validate(&self, cfg: &HunyuanVideoVaeConfig) -> Result<()> {
        let (s, t) = (
            cfg.spatial_compression_ratio,
            cfg.temporal_compression_ratio,
        );
        if self.framewise
            && (self.tile_sample_stride_num_frames < t
                || self.tile_sample_min_num_frames < self.tile_sample_stride_num_frames)
        {
            candle_core::bail!(
                "vae tiling: frame tiles of {} every {} frames do not fit the temporal compression {t}",
                self.tile_sample_min_num_frames,
                self.tile_sample_stride_num_frames
            );
        }
        if self.spatial
            && (self.tile_sample_stride_height < s
                || self.tile_sample_stride_width < s
                || self.tile_sample_min_height < self.tile_sample_stride_height
                || self.tile_sample_min_width < self.tile_sample_stride_width)
        {
            candle_core::bail!(
                "vae tiling: spatial tiles must be at least their stride and the stride at least {s} pixels"
            );
        }
        Ok(())
    }
}

/// SiLU in f32, rounded once.
fn silu(x: &Tensor) -> Result<Tensor> {
    x.to_dtype(DType::F32)?.silu()?.to_dtype(x.dtype())
}

/// Elements of an activation a layer works on at once: norms and convolutions run over runs of
/// frames written into one output, so a 17-frame full-resolution tile (2 billion elements at
/// 720x1280 and 128 channels) holds a layer's input, its output and one run's temporaries.
pub const RUN_ELEMENTS: usize = 1 << 26;

/// Runs a layer splits `frames` frames into at least, whatever their size: a run's
/// temporaries stay a small share of the layer's input and output at every size.
pub const MIN_RUNS: usize = 8;

/// Frames per run of `frames` frames of `frame_elements` elements each.
pub(crate) fn frames_per_run(frames: usize, frame_elements: usize, run_elements: usize) -> usize {
    (run_elements / frame_elements.max(1)).clamp(1, frames.div_ceil(MIN_RUNS).max(1))
}

/// `nn.GroupNorm` over frames-major `[B, T, C, H, W]` (statistics over C/G channels, all
/// frames and pixels), computed in f32 over runs of frames.
#[derive(Debug, Clone)]
struct GroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: usize,
}

impl GroupNorm {
    fn new(channels: usize, groups: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get(channels, "weight")?,
            bias: vb.get(channels, "bias")?,
            groups,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.normalize(x, false, RUN_ELEMENTS)
    }

    /// The norm, then SiLU (on the norm's output in `x`'s dtype, as the two layers compute).
    fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        self.normalize(x, true, RUN_ELEMENTS)
    }

    /// Mean, then variance about it, summed in f32 over runs of frames of about
    /// `run_elements`; then each run normalized (and SiLU'd) into the output: the input, the
    /// output and one run's f32 temporaries at once.
    fn normalize(&self, x: &Tensor, then_silu: bool, run_elements: usize) -> Result<Tensor> {
        let spec = GroupNormSpec {
            weight: &self.weight,
            bias: &self.bias,
            groups: self.groups,
            eps: NORM_EPS,
            rounding: Rounding::F32,
            modulation: None,
            silu: then_silu,
        };
        if let Some(y) = fused_group_norm(x, &spec, 1, 2)? {
            return Ok(y);
        }
        let (b, t, c, h, w) = x.dims5()?;
        let g = self.groups;
        let per_run = frames_per_run(t, b * c * h * w, run_elements);
        let runs = || {
            (0..t)
                .step_by(per_run)
                .map(move |f| (f, per_run.min(t - f)))
        };
        // A run as `[B, n, G, C/G * H * W]` in f32.
        let grouped = |f: usize, n: usize| {
            x.narrow(1, f, n)?
                .to_dtype(DType::F32)?
                .contiguous()?
                .reshape((b, n, g, (c / g) * h * w))
        };
        let count = ((c / g) * t * h * w) as f64;
        let total = |per_run_sum: &dyn Fn(usize, usize) -> Result<Tensor>| -> Result<Tensor> {
            let mut sum: Option<Tensor> = None;
            for (f, n) in runs() {
                let s = per_run_sum(f, n)?;
                sum = Some(match sum {
                    Some(acc) => (acc + s)?,
                    None => s,
                });
            }
            (sum.ok_or_else(|| candle_core::Error::Msg("GroupNorm of no frames".into()))? / count)?
                .reshape((b, 1, g, 1))
        };
        let mean = total(&|f, n| grouped(f, n)?.sum(3)?.sum(1))?;
        let var = total(&|f, n| grouped(f, n)?.broadcast_sub(&mean)?.sqr()?.sum(3)?.sum(1))?;
        let std = (var + NORM_EPS)?.sqrt()?;
        let shape = (1, 1, c, 1, 1);
        let weight = self.weight.to_dtype(DType::F32)?.reshape(shape)?;
        let bias = self.bias.to_dtype(DType::F32)?.reshape(shape)?;
        // One statement per op, so each temporary goes as the next exists.
        in_runs(t, per_run, 1, |f, n| {
            let mut y = grouped(f, n)?.broadcast_sub(&mean)?;
            y = y.broadcast_div(&std)?.reshape((b, n, c, h, w))?;
            y = y.broadcast_mul(&weight)?;
            y = y.broadcast_add(&bias)?.to_dtype(x.dtype())?;
            if then_silu {
                y = silu(&y)?;
            }
            Ok(y)
        })
    }
}

/// Largest im2col scratch (elements) one conv2d call may build: candle's conv2d is im2col +
/// matmul, whose scratch is `C_in * k * k` times the output (72 G elements for a 17-frame
/// 720x1280 tile at 128 channels). Larger convolutions run by frames, then by row bands.
/// (The Wan VAE bounds its convs the same way in its private `conv2d_lean`; a shared helper
/// would serve both.)
pub const MAX_IM2COL_ELEMENTS: usize = 1 << 26;

/// conv2d (no padding, `stride` in both directions) of `x` `[N, C, H, W]`, split over images
/// and then over output-row bands so that no call's im2col exceeds `limit` elements. Every
/// output element is the same dot product as unsplit.
fn conv2d_banded(x: &Tensor, w: &Tensor, stride: usize, limit: usize) -> Result<Tensor> {
    let (n, c, h, wd) = x.dims4()?;
    let (_, _, kh, kw) = w.dims4()?;
    if h < kh || wd < kw || stride == 0 {
        candle_core::bail!("conv: a {h}x{wd} input is smaller than the {kh}x{kw} kernel")
    }
    let (h_out, w_out) = ((h - kh) / stride + 1, (wd - kw) / stride + 1);
    let per_row = w_out * c * kh * kw;
    if n * h_out * per_row <= limit {
        return x.conv2d(w, 0, stride, 1, 1);
    }
    let rows_per_call = (limit / per_row).max(1);
    let images = (0..n)
        .map(|i| {
            let image = x.narrow(0, i, 1)?;
            let bands = (0..h_out)
                .step_by(rows_per_call)
                .map(|r0| {
                    let rows = rows_per_call.min(h_out - r0);
                    image
                        .narrow(2, r0 * stride, (rows - 1) * stride + kh)?
                        .conv2d(w, 0, stride, 1, 1)
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&bands, 2)
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&images, 0)
}

/// `HunyuanVideoCausalConv3d`: replicate padding, k-1 copies of the first frame in front,
/// then a Conv3d (stride `(time, space, space)`): one 3D convolution through cuDNN where it is
/// loaded ([`conv3d`]), else one conv2d per time tap, by chunks of output frames.
#[derive(Debug, Clone)]
pub(crate) struct CausalConv3d {
    kernel: Kernel3d,
    bias: Tensor,
    /// (time in front, height each side, width each side), as diffusers' padding tuple.
    pad: (usize, usize, usize),
    /// (time, space) strides.
    stride: (usize, usize),
}

impl CausalConv3d {
    pub(crate) fn new(in_ch: usize, out_ch: usize, k: usize, vb: VarBuilder) -> Result<Self> {
        Self::strided(in_ch, out_ch, k, (1, 1), vb)
    }

    fn strided(
        in_ch: usize,
        out_ch: usize,
        k: usize,
        stride: (usize, usize),
        vb: VarBuilder,
    ) -> Result<Self> {
        let vb = vb.pp("conv");
        let weight = vb.get((out_ch, in_ch, k, k, k), "weight")?;
        Ok(Self {
            kernel: Kernel3d::new(weight)?,
            bias: vb.get(out_ch, "bias")?,
            // diffusers: (k_t // 2, k_t // 2, k_h // 2, k_h // 2, k_w - 1, 0) for (W, H, T).
            pad: (k - 1, k / 2, k / 2),
            stride,
        })
    }

    /// `x` `[B, T, C, H, W]` -> `[B, T, out, H', W']`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_plus(x, None)
    }

    /// [`Self::forward`] plus `residual` (of the output's shape) where given: a resnet's
    /// `conv(h) + x`, added as the fused path stores each frame (the same bits as the add).
    pub(crate) fn forward_plus(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        if let Some(w) = self.kernel.whole() {
            let whole = || self.forward_whole(w, x, residual, RUN_ELEMENTS);
            if let Some((y, added)) = conv3d::or_fallback(whole) {
                return conv3d::plus(y, residual.filter(|_| !added));
            }
        }
        conv3d::plus(self.forward_bounded(x, MAX_IM2COL_ELEMENTS)?, residual)
    }

    /// The conv as 3D convolutions (cuDNN) over runs of output frames, each from a
    /// replicate-padded copy of the input frames it reads (about `run_elements`), or `None`
    /// where [`conv3d`] does not run it; with whether `residual` was added.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn forward_whole(
        &self,
        w: &Tensor,
        x: &Tensor,
        residual: Option<&Tensor>,
        run_elements: usize,
    ) -> Result<Option<(Tensor, bool)>> {
        if !conv3d::computes(x.device(), x.dtype()) {
            return Ok(None);
        }
        let (b, t, c, h, wd) = x.dims5()?;
        let (pt, ph, pw) = self.pad;
        let (st, ss) = self.stride;
        let kt = w.dim(2)?;
        if t + pt < kt {
            candle_core::bail!("conv: a {t}x{h}x{wd} input is smaller than the kernel")
        }
        let t_out = (t + pt - kt) / st + 1;
        let padded_frame = b * c * (h + 2 * ph) * (wd + 2 * pw);
        let per_run = frames_per_run(t_out, padded_frame * st, run_elements);
        // Padded frames first * st .. (first + n - 1) * st + kt of a run; those before frame 0
        // replicate it.
        let frames_of = |first: usize, n: usize| -> Vec<u32> {
            (first * st..(first + n - 1) * st + kt)
                .map(|j| j.saturating_sub(pt) as u32)
                .collect()
        };
        #[cfg(feature = "cuda")]
        if x.device().is_cuda()
            && matches!(x.dtype(), DType::BF16 | DType::F32)
            && crate::models::norms::enabled()
        {
            // Each run's frames gathered padded into the convolution's layout, and its output
            // stored with the bias into the frames-major result: one pass each. Channels last
            // where a channels-last convolution runs (cuDNN's NDHWC kernels read it without
            // transposing: the gather and the store transpose instead).
            use crate::models::channel_ops::{
                add_channel_bias, gather_padded_frames, BiasOut, Framing, VideoLayout,
            };
            let (kh, kw) = (w.dim(3)?, w.dim(4)?);
            let (h_out, w_out) = ((h + 2 * ph - kh) / ss + 1, (wd + 2 * pw - kw) / ss + 1);
            // SAFETY: every run's frames are stored below before the result is returned.
            let out = unsafe {
                Tensor::empty((b, t_out, w.dim(0)?, h_out, w_out), x.dtype(), x.device())
            }?;
            // The residual is added in the same store where it has the output's layout.
            let residual = residual.filter(|r| r.dims() == out.dims() && r.is_contiguous());
            let w_last = w.permute((0, 2, 3, 4, 1))?.contiguous()?;
            let stride = [st, ss, ss];
            for first in (0..t_out).step_by(per_run) {
                let index = frames_of(first, per_run.min(t_out - first));
                let input = (x, None, VideoLayout::FramesMajor);
                let conv = (&w_last, stride, [0; 3]);
                let bias = &self.bias;
                if conv3d::conv_frames_channels_last(
                    input,
                    &index,
                    Framing::padded((ph, pw)),
                    conv,
                    bias,
                    &out,
                    first,
                    residual,
                )? {
                    continue;
                }
                let frames = gather_padded_frames(x, &index, ph, pw)?;
                let Some(y) = conv3d::conv3d(&frames, w, stride, [0; 3])? else {
                    candle_core::bail!("conv3d declined the convolution")
                };
                add_channel_bias(&y, &self.bias, BiasOut::FramesOf(&out, first), residual)?;
            }
            return Ok(Some((out, residual.is_some())));
        }
        let bias = self.bias.reshape((1, (), 1, 1))?;
        let y = in_runs(t_out, per_run, 1, |first, n| {
            let idx = frames_of(first, n);
            let mut frames = x.index_select(&Tensor::new(idx.as_slice(), x.device())?, 1)?;
            if ph > 0 {
                frames = frames.pad_with_same(3, ph, ph)?;
            }
            if pw > 0 {
                frames = frames.pad_with_same(4, pw, pw)?;
            }
            // Frames-major [B, T, C, H, W] <-> the convolution's [B, C, T, H, W].
            match conv3d::conv3d(&frames.transpose(1, 2)?, w, [st, ss, ss], [0; 3])? {
                Some(y) => y.transpose(1, 2)?.broadcast_add(&bias),
                None => candle_core::bail!("conv3d declined the convolution"),
            }
        })?;
        Ok(Some((y, false)))
    }

    fn forward_bounded(&self, x: &Tensor, limit: usize) -> Result<Tensor> {
        let (b, t, c, h, w) = x.dims5()?;
        let (pt, ph, pw) = self.pad;
        let (st, ss) = self.stride;
        let kt = self.kernel.kt()?;
        let (_, _, kh, kw) = self.kernel.tap_dims()?;
        let taps = self.kernel.taps()?;
        let (hp, wp) = (h + 2 * ph, w + 2 * pw);
        if hp < kh || wp < kw || t + pt < kt {
            candle_core::bail!("conv: a {t}x{h}x{w} input is smaller than the kernel")
        }
        let t_out = (t + pt - kt) / st + 1;
        let per_frame = b * ((hp - kh) / ss + 1) * ((wp - kw) / ss + 1) * c * kh * kw;
        let chunk = frames_per_run(t_out, per_frame, limit);
        in_runs(t_out, chunk, 1, |t0, len| {
            let mut acc: Option<Tensor> = None;
            for (i, tap) in taps.iter().enumerate() {
                // Output frame j reads padded frame j * st + i, i.e. input frame
                // j * st + i - pt; frames before 0 replicate frame 0.
                let idx: Vec<u32> = (t0..t0 + len)
                    .map(|j| (j * st + i).saturating_sub(pt) as u32)
                    .collect();
                let mut frames = x.index_select(&Tensor::new(idx.as_slice(), x.device())?, 1)?;
                if ph > 0 {
                    frames = frames.pad_with_same(3, ph, ph)?;
                }
                if pw > 0 {
                    frames = frames.pad_with_same(4, pw, pw)?;
                }
                let frames = frames.reshape((b * len, c, hp, wp))?;
                let y = conv2d_banded(&frames, tap, ss, limit)?;
                acc = Some(match acc {
                    Some(a) => (a + y)?,
                    None => y,
                });
            }
            let y = acc.expect("a conv has at least one tap");
            let (_, o, ho, wo) = y.dims4()?;
            y.broadcast_add(&self.bias.reshape((1, o, 1, 1))?)?
                .reshape((b, len, o, ho, wo))
        })
    }
}

/// `HunyuanVideoResnetBlockCausal3D`.
#[derive(Debug, Clone)]
struct ResnetBlock {
    norm1: GroupNorm,
    conv1: CausalConv3d,
    norm2: GroupNorm,
    conv2: CausalConv3d,
    conv_shortcut: Option<CausalConv3d>,
}

impl ResnetBlock {
    fn new(in_ch: usize, out_ch: usize, groups: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            norm1: GroupNorm::new(in_ch, groups, vb.pp("norm1"))?,
            conv1: CausalConv3d::new(in_ch, out_ch, 3, vb.pp("conv1"))?,
            norm2: GroupNorm::new(out_ch, groups, vb.pp("norm2"))?,
            conv2: CausalConv3d::new(out_ch, out_ch, 3, vb.pp("conv2"))?,
            conv_shortcut: if in_ch != out_ch {
                Some(CausalConv3d::new(in_ch, out_ch, 1, vb.pp("conv_shortcut"))?)
            } else {
                None
            },
        })
    }

    /// Each intermediate is dropped as soon as the next exists: at full resolution an
    /// activation is gigabytes.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let normed = self.norm1.forward_silu(x)?;
        let h = self.conv1.forward(&normed)?;
        drop(normed);
        let normed = self.norm2.forward_silu(&h)?;
        drop(h);
        let residual = match &self.conv_shortcut {
            Some(conv) => conv.forward(x)?,
            None => x.clone(),
        };
        self.conv2.forward_plus(&normed, Some(&residual))
    }
}

/// The mid-block attention: GroupNorm, one head over all positions, frame-causal (a position
/// sees its own and earlier frames), residual.
#[derive(Debug, Clone)]
struct FrameCausalAttention {
    group_norm: GroupNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
}

impl FrameCausalAttention {
    fn new(channels: usize, groups: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            group_norm: GroupNorm::new(channels, groups, vb.pp("group_norm"))?,
            to_q: candle_nn::linear(channels, channels, vb.pp("to_q"))?,
            to_k: candle_nn::linear(channels, channels, vb.pp("to_k"))?,
            to_v: candle_nn::linear(channels, channels, vb.pp("to_v"))?,
            to_out: candle_nn::linear(channels, channels, vb.pp("to_out.0"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c, h, w) = x.dims5()?;
        let hw = h * w;
        let tokens =
            |y: &Tensor| -> Result<Tensor> { y.permute((0, 1, 3, 4, 2))?.reshape((b, t * hw, c)) };
        let normed = tokens(&self.group_norm.forward(x)?)?;
        let heads = |l: &Linear| -> Result<Tensor> { l.forward(&normed)?.unsqueeze(1) };
        let (q, k, v) = (heads(&self.to_q)?, heads(&self.to_k)?, heads(&self.to_v)?);
        let scale = 1.0 / (c as f64).sqrt();
        // The causal mask as key prefixes: frame f's queries see the first (f + 1) frames.
        let outs = (0..t)
            .map(|f| {
                let n = (f + 1) * hw;
                sdpa(
                    &q.narrow(2, f * hw, hw)?,
                    &k.narrow(2, 0, n)?,
                    &v.narrow(2, 0, n)?,
                    scale,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let out = self.to_out.forward(&Tensor::cat(&outs, 2)?.squeeze(1)?)?;
        (out + tokens(x)?)?
            .reshape((b, t, h, w, c))?
            .permute((0, 1, 4, 2, 3))?
            .contiguous()
    }
}

/// `HunyuanVideoUpsampleCausal3D`: nearest upsampling (the first frame in space only), then a
/// causal conv.
#[derive(Debug, Clone)]
struct Upsampler {
    conv: CausalConv3d,
    time: bool,
    space: bool,
}

impl Upsampler {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c, h, w) = x.dims5()?;
        let mut x = x.clone();
        let mut frames = t;
        if self.time && t > 1 {
            // Frame 0 once, every later frame twice.
            let idx: Vec<u32> = std::iter::once(0)
                .chain((1..t as u32).flat_map(|f| [f, f]))
                .collect();
            frames = idx.len();
            x = x.index_select(&Tensor::new(idx.as_slice(), x.device())?, 1)?;
        }
        if self.space {
            x = x
                .reshape((b * frames, c, h, w))?
                .upsample_nearest2d(2 * h, 2 * w)?
                .reshape((b, frames, c, 2 * h, 2 * w))?;
        }
        self.conv.forward(&x)
    }
}

#[derive(Debug, Clone)]
struct UpBlock {
    resnets: Vec<ResnetBlock>,
    upsampler: Option<Upsampler>,
}

/// `HunyuanVideoDecoder3D`.
#[derive(Debug, Clone)]
struct Decoder {
    conv_in: CausalConv3d,
    mid_resnets: Vec<ResnetBlock>,
    mid_attention: Option<FrameCausalAttention>,
    up_blocks: Vec<UpBlock>,
    conv_norm_out: GroupNorm,
    conv_out: CausalConv3d,
}

impl Decoder {
    fn new(cfg: &HunyuanVideoVaeConfig, vb: VarBuilder) -> Result<Self> {
        let g = cfg.norm_num_groups;
        let reversed: Vec<usize> = cfg.block_out_channels.iter().rev().copied().collect();
        let top = reversed[0];
        let mid = vb.pp("mid_block");
        let mut up_blocks = Vec::with_capacity(reversed.len());
        let mut prev = top;
        for (i, &out) in reversed.iter().enumerate() {
            let bvb = vb.pp(format!("up_blocks.{i}"));
            let resnets = (0..cfg.layers_per_block + 1)
                .map(|j| {
                    let input = if j == 0 { prev } else { out };
                    ResnetBlock::new(input, out, g, bvb.pp(format!("resnets.{j}")))
                })
                .collect::<Result<_>>()?;
            let (time, space) = cfg.resampling(i);
            let upsampler = if time || space {
                Some(Upsampler {
                    conv: CausalConv3d::new(out, out, 3, bvb.pp("upsamplers.0.conv"))?,
                    time,
                    space,
                })
            } else {
                None
            };
            up_blocks.push(UpBlock { resnets, upsampler });
            prev = out;
        }
        let bottom = cfg.block_out_channels[0];
        Ok(Self {
            conv_in: CausalConv3d::new(cfg.latent_channels, top, 3, vb.pp("conv_in"))?,
            mid_resnets: (0..2)
                .map(|j| ResnetBlock::new(top, top, g, mid.pp(format!("resnets.{j}"))))
                .collect::<Result<_>>()?,
            mid_attention: if cfg.mid_block_add_attention {
                Some(FrameCausalAttention::new(top, g, mid.pp("attentions.0"))?)
            } else {
                None
            },
            up_blocks,
            conv_norm_out: GroupNorm::new(bottom, g, vb.pp("conv_norm_out"))?,
            conv_out: CausalConv3d::new(bottom, cfg.out_channels, 3, vb.pp("conv_out"))?,
        })
    }

    /// Frames-major latents -> frames-major video.
    fn forward(&self, z: &Tensor) -> Result<Tensor> {
        let mut x = self.conv_in.forward(z)?;
        x = self.mid_resnets[0].forward(&x)?;
        if let Some(attn) = &self.mid_attention {
            x = attn.forward(&x)?;
        }
        x = self.mid_resnets[1].forward(&x)?;
        for block in &self.up_blocks {
            for resnet in &block.resnets {
                x = resnet.forward(&x)?;
            }
            if let Some(up) = &block.upsampler {
                x = up.forward(&x)?;
            }
        }
        self.conv_out.forward(&self.conv_norm_out.forward_silu(&x)?)
    }
}

crate::placed_whole!(
    AutoencoderKLHunyuanVideo,
    HunyuanVideoVaeConfig,
    AutoencoderKLHunyuanVideo::new
);

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The norm over runs of one frame equals the norm over one run (and diffusers'
    /// composition: channel-major groups, mean, variance about it) up to f32 summation order;
    /// with SiLU it is SiLU of the norm.
    #[test]
    fn group_norm_in_runs_of_frames_equals_the_whole() -> Result<()> {
        let dev = Device::Cpu;
        let (b, t, c, h, w, g) = (2, 5, 8, 3, 4, 4);
        let x = (Tensor::randn(0f32, 1.0, (b, t, c, h, w), &dev)? * 3.0)?;
        let norm = GroupNorm {
            weight: Tensor::randn(0f32, 1.0, c, &dev)?,
            bias: Tensor::randn(0f32, 1.0, c, &dev)?,
            groups: g,
        };
        let xf = x.transpose(1, 2)?.contiguous()?.reshape((b, g, ()))?;
        let mean = xf.mean_keepdim(2)?;
        let xc = xf.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(2)?;
        let want = xc
            .broadcast_div(&(var + NORM_EPS)?.sqrt()?)?
            .reshape((b, c, t, h, w))?
            .transpose(1, 2)?
            .broadcast_mul(&norm.weight.reshape((1, 1, c, 1, 1))?)?
            .broadcast_add(&norm.bias.reshape((1, 1, c, 1, 1))?)?;
        let max_diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
            (a - b)?.abs()?.max_all()?.to_scalar::<f32>()
        };
        let frame = b * c * h * w;
        for run in [usize::MAX, frame, 2 * frame] {
            let got = norm.normalize(&x, false, run)?;
            assert!(max_diff(&got, &want)? < 1e-5, "runs of {run}");
            let got = norm.normalize(&x, true, run)?;
            assert!(max_diff(&got, &want.silu()?)? < 1e-5, "runs of {run}, SiLU");
        }
        Ok(())
    }

    #[test]
    fn bounded_conv_equals_unbounded() -> Result<()> {
        let dev = Device::Cpu;
        let vb = VarBuilder::from_tensors(
            [
                (
                    "conv.weight".to_string(),
                    Tensor::randn(0f32, 1.0, (5, 4, 3, 3, 3), &dev)?,
                ),
                ("conv.bias".to_string(), Tensor::randn(0f32, 1.0, 5, &dev)?),
            ]
            .into_iter()
            .collect(),
            DType::F32,
            &dev,
        );
        let x = Tensor::randn(0f32, 1.0, (2, 6, 4, 7, 9), &dev)?;
        for stride in [(1, 1), (2, 2), (1, 2)] {
            let conv = CausalConv3d::strided(4, 5, 3, stride, vb.clone())?;
            let whole = conv.forward_bounded(&x, usize::MAX)?;
            // One frame per chunk and 2-row bands.
            let banded = conv.forward_bounded(&x, 2 * 9 * 4 * 9)?;
            assert_eq!(whole.dims(), banded.dims());
            let diff = (whole - banded)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{stride:?}: {diff}");
        }
        Ok(())
    }
}

/// `HunyuanVideoEncoder3D` (with `double_z`: mean and log-variance channels).
#[derive(Debug, Clone)]
struct Encoder {
    conv_in: CausalConv3d,
    /// Res blocks and the optional strided downsampling conv of each level.
    down_blocks: Vec<(Vec<ResnetBlock>, Option<CausalConv3d>)>,
    mid_resnets: Vec<ResnetBlock>,
    mid_attention: Option<FrameCausalAttention>,
    conv_norm_out: GroupNorm,
    conv_out: CausalConv3d,
}

impl Encoder {
    fn new(cfg: &HunyuanVideoVaeConfig, vb: VarBuilder) -> Result<Self> {
        let g = cfg.norm_num_groups;
        let boc = &cfg.block_out_channels;
        let top = boc[boc.len() - 1];
        let mut prev = boc[0];
        let mut down_blocks = Vec::with_capacity(boc.len());
        for (i, &out) in boc.iter().enumerate() {
            let bvb = vb.pp(format!("down_blocks.{i}"));
            let resnets = (0..cfg.layers_per_block)
                .map(|j| {
                    let input = if j == 0 { prev } else { out };
                    ResnetBlock::new(input, out, g, bvb.pp(format!("resnets.{j}")))
                })
                .collect::<Result<_>>()?;
            let (time, space) = cfg.resampling(i);
            let downsampler = if time || space {
                let stride = (if time { 2 } else { 1 }, if space { 2 } else { 1 });
                Some(CausalConv3d::strided(
                    out,
                    out,
                    3,
                    stride,
                    bvb.pp("downsamplers.0.conv"),
                )?)
            } else {
                None
            };
            down_blocks.push((resnets, downsampler));
            prev = out;
        }
        let mid = vb.pp("mid_block");
        Ok(Self {
            conv_in: CausalConv3d::new(cfg.in_channels, boc[0], 3, vb.pp("conv_in"))?,
            down_blocks,
            mid_resnets: (0..2)
                .map(|j| ResnetBlock::new(top, top, g, mid.pp(format!("resnets.{j}"))))
                .collect::<Result<_>>()?,
            mid_attention: if cfg.mid_block_add_attention {
                Some(FrameCausalAttention::new(top, g, mid.pp("attentions.0"))?)
            } else {
                None
            },
            conv_norm_out: GroupNorm::new(top, g, vb.pp("conv_norm_out"))?,
            conv_out: CausalConv3d::new(top, 2 * cfg.latent_channels, 3, vb.pp("conv_out"))?,
        })
    }

    /// Frames-major video -> frames-major moments.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = self.conv_in.forward(x)?;
        for (resnets, downsampler) in &self.down_blocks {
            for resnet in resnets {
                x = resnet.forward(&x)?;
            }
            if let Some(down) = downsampler {
                x = down.forward(&x)?;
            }
        }
        x = self.mid_resnets[0].forward(&x)?;
        if let Some(attn) = &self.mid_attention {
            x = attn.forward(&x)?;
        }
        x = self.mid_resnets[1].forward(&x)?;
        self.conv_out.forward(&self.conv_norm_out.forward_silu(&x)?)
    }
}

/// A 1x1x1 Conv3d (`quant_conv` / `post_quant_conv`) over channel-major `[B, C, T, H, W]`.
fn pointwise_conv(conv: &Linear, x: &Tensor) -> Result<Tensor> {
    let (b, c, f, h, w) = x.dims5()?;
    let out = conv.weight().dim(0)?;
    conv.forward(&x.permute((0, 2, 3, 4, 1))?.reshape((b * f * h * w, c))?)?
        .reshape((b, f, h, w, out))?
        .permute((0, 4, 1, 2, 3))?
        .contiguous()
}

fn pointwise_conv_weights(channels: usize, vb: VarBuilder) -> Result<Linear> {
    Ok(Linear::new(
        vb.get((channels, channels, 1, 1, 1), "weight")?
            .reshape((channels, channels))?,
        Some(vb.get(channels, "bias")?),
    ))
}

/// Channel-major `[B, C, T, H, W]` <-> frames-major `[B, T, C, H, W]` (its own inverse).
fn swap_frames_channels(x: &Tensor) -> Result<Tensor> {
    x.transpose(1, 2)?.contiguous()
}

/// diffusers' `AutoencoderKLHunyuanVideo`: the decoder, and the encoder when asked for.
#[derive(Debug, Clone)]
pub struct AutoencoderKLHunyuanVideo {
    cfg: HunyuanVideoVaeConfig,
    post_quant_conv: Linear,
    decoder: Decoder,
    /// `quant_conv` and the encoder (only with [`AutoencoderKLHunyuanVideo::with_encoder`]).
    encoder: Option<(Linear, Encoder)>,
    tiling: HunyuanVideoVaeTiling,
}

impl AutoencoderKLHunyuanVideo {
    /// Loads `post_quant_conv` and the decoder (what text-to-video needs); default tiling.
    pub fn new(cfg: &HunyuanVideoVaeConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            cfg: cfg.clone(),
            post_quant_conv: pointwise_conv_weights(cfg.latent_channels, vb.pp("post_quant_conv"))?,
            decoder: Decoder::new(cfg, vb.pp("decoder"))?,
            encoder: None,
            tiling: HunyuanVideoVaeTiling::default(),
        })
    }

    /// Loads the encoder and `quant_conv` too.
    pub fn with_encoder(cfg: &HunyuanVideoVaeConfig, vb: VarBuilder) -> Result<Self> {
        let mut vae = Self::new(cfg, vb.clone())?;
        cfg.validate_encoder()?;
        vae.encoder = Some((
            pointwise_conv_weights(2 * cfg.latent_channels, vb.pp("quant_conv"))?,
            Encoder::new(cfg, vb.pp("encoder"))?,
        ));
        Ok(vae)
    }

    pub fn config(&self) -> &HunyuanVideoVaeConfig {
        &self.cfg
    }

    /// Sets the tiling (diffusers' `enable_tiling(...)` / `use_framewise_decoding`).
    pub fn set_tiling(&mut self, tiling: HunyuanVideoVaeTiling) -> Result<()> {
        tiling.validate(&self.cfg)?;
        self.tiling = tiling;
        Ok(())
    }

    pub fn tiling(&self) -> HunyuanVideoVaeTiling {
        self.tiling
    }

    /// The pipeline's decoder input: `latents / scaling_factor`.
    pub fn scale_latents(&self, latents: &Tensor) -> Result<Tensor> {
        latents.affine(1.0 / self.cfg.scaling_factor, 0.0)
    }

    /// Video frames that `latent_frames` decode to: 4(F - 1) + 1.
    pub fn num_sample_frames(&self, latent_frames: usize) -> usize {
        latent_frames.saturating_sub(1) * self.cfg.temporal_compression_ratio + 1
    }

    /// Latent frames of `frames` video frames: (T - 1) / 4 + 1.
    pub fn num_latent_frames(&self, frames: usize) -> usize {
        frames.saturating_sub(1) / self.cfg.temporal_compression_ratio + 1
    }

    /// Decodes already scaled latents `[B, C, F, H, W]` into video `[B, 3, 4(F-1)+1, 8H, 8W]`
    /// (not clamped), tiled as [`HunyuanVideoVaeTiling`] says.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        let (_, c, f, _, _) = z.dims5()?;
        if c != self.cfg.latent_channels {
            candle_core::bail!(
                "latents have {c} channels, the VAE expects {}",
                self.cfg.latent_channels
            );
        }
        if f == 0 {
            candle_core::bail!("no latent frames to decode");
        }
        let tl = self.tiling;
        let tc = self.cfg.temporal_compression_ratio;
        let min_latent = tl.tile_sample_min_num_frames / tc;
        if tl.framewise && f > min_latent {
            // diffusers' `_temporal_tiled_decode`.
            return decode_frame_tiles(
                z,
                (
                    tl.tile_sample_min_num_frames,
                    tl.tile_sample_stride_num_frames,
                ),
                tc,
                Dropped::First,
                |tile| self.decode_tile(tile),
            );
        }
        self.decode_tile(z)
    }

    /// One temporal tile: spatially tiled (`tiled_decode`) when enabled and larger than a
    /// tile, else whole.
    fn decode_tile(&self, z: &Tensor) -> Result<Tensor> {
        let (_, _, _, h, w) = z.dims5()?;
        let s = self.cfg.spatial_compression_ratio;
        let tl = self.tiling;
        let tiles = tl.spatial_tiles();
        if tl.spatial && tiles.splits((h, w), s) {
            return tiles.decode(z, s, |tile| self.decode_whole(tile));
        }
        self.decode_whole(z)
    }

    /// `post_quant_conv` and the decoder on `[B, C, F, H, W]`.
    fn decode_whole(&self, z: &Tensor) -> Result<Tensor> {
        let z = swap_frames_channels(&pointwise_conv(&self.post_quant_conv, z)?)?;
        swap_frames_channels(&self.decoder.forward(&z)?)
    }

    /// Encodes video `[B, 3, T, H, W]` (values in [-1, 1]) into the latent distribution's
    /// `(mean, logvar)`, each `[B, C, (T-1)/4+1, H/8, W/8]` (logvar clamped to [-30, 20]).
    /// Needs a VAE built with [`AutoencoderKLHunyuanVideo::with_encoder`].
    pub fn encode(&self, video: &Tensor) -> Result<(Tensor, Tensor)> {
        let Some((quant_conv, encoder)) = &self.encoder else {
            candle_core::bail!("this VAE was loaded without its encoder");
        };
        let (_, c, t, _, _) = video.dims5()?;
        if c != self.cfg.in_channels || t == 0 {
            candle_core::bail!(
                "video has {c} channels and {t} frames, the VAE expects {} channels",
                self.cfg.in_channels
            );
        }
        let whole = |x: &Tensor| -> Result<Tensor> {
            let moments = encoder.forward(&swap_frames_channels(x)?)?;
            pointwise_conv(quant_conv, &swap_frames_channels(&moments)?)
        };
        let tl = self.tiling;
        let s = self.cfg.spatial_compression_ratio;
        let tc = self.cfg.temporal_compression_ratio;
        let tile = |x: &Tensor| -> Result<Tensor> {
            let (_, _, _, h, w) = x.dims5()?;
            if tl.spatial && (h > tl.tile_sample_min_height || w > tl.tile_sample_min_width) {
                // diffusers' `tiled_encode`.
                let (min_h, min_w) = (tl.tile_sample_min_height / s, tl.tile_sample_min_width / s);
                let (stride_h, stride_w) = (
                    tl.tile_sample_stride_height / s,
                    tl.tile_sample_stride_width / s,
                );
                return spatial_tiles(
                    x,
                    (
                        (tl.tile_sample_min_height, tl.tile_sample_min_width),
                        (tl.tile_sample_stride_height, tl.tile_sample_stride_width),
                    ),
                    (
                        (min_h - stride_h, min_w - stride_w),
                        (stride_h, stride_w),
                        (h / s, w / s),
                    ),
                    whole,
                );
            }
            whole(x)
        };
        let moments = if tl.framewise && t > tl.tile_sample_min_num_frames {
            // diffusers' `_temporal_tiled_encode`.
            let (min_latent, stride_latent) = (
                tl.tile_sample_min_num_frames / tc,
                tl.tile_sample_stride_num_frames / tc,
            );
            temporal_tiles(
                video,
                (
                    tl.tile_sample_min_num_frames + 1,
                    tl.tile_sample_stride_num_frames,
                ),
                (
                    min_latent - stride_latent,
                    stride_latent,
                    self.num_latent_frames(t),
                ),
                Dropped::First,
                tile,
            )?
        } else {
            tile(video)?
        };
        let l = self.cfg.latent_channels;
        let mean = moments.narrow(1, 0, l)?;
        let logvar = moments.narrow(1, l, l)?.clamp(-30f32, 20f32)?;
        Ok((mean, logvar))
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    //! The cuDNN path in runs of output frames against the own convolution, on the GPU.
    use super::*;
    use crate::models::row_ops::test_util::device;

    #[test]
    fn cudnn_conv_in_runs_of_frames_equals_the_own_conv() -> Result<()> {
        let Some(dev) = device("HunyuanVideo VAE conv in frame runs") else {
            return Ok(());
        };
        let _exact = conv3d::tf32_here(false);
        if !conv3d::computes(&dev, DType::F32) {
            eprintln!("skipped: no exact f32 conv3d without cuDNN");
            return Ok(());
        }
        // One draw of the weights, placed on each device (two draws would differ).
        let cpu = candle_core::Device::Cpu;
        let kernel = Tensor::randn(0f32, 0.2, (5, 4, 3, 3, 3), &cpu)?;
        let bias = Tensor::randn(0f32, 1.0, 5, &cpu)?;
        let weights = |dev: &candle_core::Device| -> Result<VarBuilder<'static>> {
            let map = std::collections::HashMap::from([
                ("conv.weight".to_string(), kernel.to_device(dev)?),
                ("conv.bias".to_string(), bias.to_device(dev)?),
            ]);
            Ok(VarBuilder::from_tensors(map, DType::F32, dev))
        };
        let x = Tensor::randn(0f32, 1.0, (2, 7, 4, 9, 11), &candle_core::Device::Cpu)?;
        for stride in [(1, 1), (2, 2)] {
            let own = CausalConv3d::strided(4, 5, 3, stride, weights(&candle_core::Device::Cpu)?)?
                .forward_bounded(&x, usize::MAX)?;
            let conv = CausalConv3d::strided(4, 5, 3, stride, weights(&dev)?)?;
            let w = conv
                .kernel
                .whole()
                .expect("a whole kernel on the GPU")
                .clone();
            let xd = x.to_device(&dev)?;
            // A residual of the output's shape, added as each run is stored.
            let residual = Tensor::randn(0f32, 1.0, own.dims(), &dev)?;
            let with_residual = (&own + residual.to_device(&cpu)?)?;
            for run in [usize::MAX, 1] {
                for (r, want) in [(None, &own), (Some(&residual), &with_residual)] {
                    let (got, added) = conv
                        .forward_whole(&w, &xd, r, run)?
                        .expect("cuDNN computes exact f32");
                    assert_eq!(added, r.is_some());
                    let got = got.to_device(&cpu)?;
                    let diff = (&got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(diff < 1e-4, "{stride:?}, runs of {run}: {diff}");
                }
            }
        }
        Ok(())
    }
}
