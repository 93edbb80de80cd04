//! LTX-Video's VAE (diffusers `AutoencoderKLLTXVideo`), in the 0.9.1 layout as well
//! as the 0.9.0 one: a non-causal 3D-conv decoder whose up blocks upsample 2x in time, height
//! and width by depth-to-space (dropping the first output frame, so T -> 2T - 1), followed by a
//! 4x4 un-patchify. With `timestep_conditioning` every block modulates its norms by an embedding
//! of the decode timestep, and with `decoder_inject_noise` resnets add per-channel-scaled
//! spatial noise after their convs. That noise is `torch.randn` from the global RNG in diffusers;
//! here it is an input ([`InjectedNoise`]) so the draws of a reference run can be replayed.
//!
//! The decoder ([`AutoencoderKLLTXVideo`]) is what text-to-video needs; the encoder
//! ([`LtxVideoEncoder`]) is built separately, for image-to-video. Activations stay
//! `[B, C, T, H, W]` like diffusers'.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;

use crate::models::conv3d;
use crate::models::vae_tiling::{decode_frame_tiles, Dropped, SampleTiles, SpatialTiling};
use crate::models::video::VideoVae;
use crate::models::wan::transformer::timestep_embedding;
use crate::rng::TorchGenerator;

/// Epsilon of the resnets' and the output's RMSNorms (hard-coded in diffusers).
const RMS_EPS: f64 = 1e-8;
/// Width of the sinusoidal timestep projection of the PixArt time embedders.
const TIMESTEP_PROJ_DIM: usize = 256;
/// Largest channel count or patch size a config may give (far above any real model).
const MAX_SIZE: usize = 1 << 16;
/// Upper bound on im2col elements of one conv2d call (frames are convolved in batches).
const MAX_IM2COL_ELEMENTS: usize = 1 << 27;

/// `vae/config.json` of `AutoencoderKLLTXVideo`; missing keys take diffusers' defaults. The
/// encoder keys are read for the compression ratios only.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct LtxVaeConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub latent_channels: usize,
    /// Encoder widths.
    pub block_out_channels: Vec<usize>,
    /// Decoder widths, listed from the output side (the decoder runs them reversed).
    pub decoder_block_out_channels: Vec<usize>,
    pub layers_per_block: Vec<usize>,
    /// Resnets of the mid block and each up block (listed from the output side, mid last).
    pub decoder_layers_per_block: Vec<usize>,
    /// Encoder downsampling per block: sets the compression ratios.
    pub spatio_temporal_scaling: Vec<bool>,
    /// Whether each decoder up block upsamples (listed from the output side).
    pub decoder_spatio_temporal_scaling: Vec<bool>,
    /// Noise injection of the up blocks and the mid block (listed from the output side).
    pub decoder_inject_noise: Vec<bool>,
    /// Whether each upsampler adds its depth-to-space input back (listed from the output side).
    pub upsample_residual: Vec<bool>,
    /// Channel reduction of each upsampler (listed from the output side).
    pub upsample_factor: Vec<usize>,
    /// 0.9.1: blocks are modulated by the decode timestep.
    pub timestep_conditioning: bool,
    pub patch_size: usize,
    pub patch_size_t: usize,
    /// LayerNorm epsilon of the channel-changing resnet shortcuts.
    pub resnet_norm_eps: f64,
    pub scaling_factor: f64,
    /// Causal time padding in the decoder (LTX-Video: false, replicate both ends).
    pub decoder_causal: bool,
    /// Causal time padding in the encoder (LTX-Video: true).
    pub encoder_causal: bool,
    /// `LTXVideoDownBlock3D` (or `LTXVideo095DownBlock3D` with `conv` downsampling) per block.
    pub down_block_types: Vec<String>,
    /// Downsampling of each `LTXVideo095DownBlock3D` (only `conv` is supported).
    pub downsample_type: Vec<String>,
    pub spatial_compression_ratio: Option<usize>,
    pub temporal_compression_ratio: Option<usize>,
}

impl Default for LtxVaeConfig {
    fn default() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            latent_channels: 128,
            block_out_channels: vec![128, 256, 512, 512],
            decoder_block_out_channels: vec![128, 256, 512, 512],
            layers_per_block: vec![4, 3, 3, 3, 4],
            decoder_layers_per_block: vec![4, 3, 3, 3, 4],
            spatio_temporal_scaling: vec![true, true, true, false],
            decoder_spatio_temporal_scaling: vec![true, true, true, false],
            decoder_inject_noise: vec![false; 5],
            upsample_residual: vec![false; 4],
            upsample_factor: vec![1; 4],
            timestep_conditioning: false,
            patch_size: 4,
            patch_size_t: 1,
            resnet_norm_eps: 1e-6,
            scaling_factor: 1.0,
            decoder_causal: false,
            encoder_causal: true,
            down_block_types: vec!["LTXVideoDownBlock3D".into(); 4],
            downsample_type: vec!["conv".into(); 4],
            spatial_compression_ratio: None,
            temporal_compression_ratio: None,
        }
    }
}

/// `v[len - 1 - i]`: diffusers reverses the decoder's per-block lists before indexing them.
fn reversed<T: Copy>(v: &[T], i: usize) -> T {
    v[v.len() - 1 - i]
}

impl LtxVaeConfig {
    fn upsamplings(&self) -> u32 {
        self.spatio_temporal_scaling.iter().filter(|&&s| s).count() as u32
    }

    /// Channels of the decoder's full-resolution feature maps (its last up block's output):
    /// the first of `decoder_block_out_channels` over its upsampler's factor.
    pub fn decoder_output_channels(&self) -> usize {
        let last_block = self
            .decoder_block_out_channels
            .first()
            .copied()
            .unwrap_or(0);
        last_block / self.upsample_factor.first().copied().unwrap_or(1).max(1)
    }

    /// Pixels per latent pixel (`patch_size * 2^downsamplings` unless the config says).
    pub fn spatial_compression_ratio(&self) -> usize {
        self.spatial_compression_ratio
            .unwrap_or(self.patch_size << self.upsamplings())
    }

    /// Frames per latent frame after the first (`patch_size_t * 2^downsamplings`).
    pub fn temporal_compression_ratio(&self) -> usize {
        self.temporal_compression_ratio
            .unwrap_or(self.patch_size_t << self.upsamplings())
    }

    /// Rejects a config the decoder cannot run, with a one-line error naming the key.
    pub fn validate(&self) -> Result<()> {
        let n = self.decoder_block_out_channels.len();
        crate::models::config_checks::positive(
            "ltx vae config",
            &[
                ("latent_channels", self.latent_channels),
                ("out_channels", self.out_channels),
                ("patch_size", self.patch_size),
                ("patch_size_t", self.patch_size_t),
                ("decoder_block_out_channels", n),
            ],
        )?;
        // Bounds far above any real model keep the size arithmetic below from overflowing.
        let widths = self.decoder_block_out_channels.iter();
        for (key, value) in [
            ("latent_channels", self.latent_channels),
            ("out_channels", self.out_channels),
            ("patch_size", self.patch_size),
            ("patch_size_t", self.patch_size_t),
        ]
        .into_iter()
        .chain(widths.map(|&w| ("decoder_block_out_channels", w)))
        {
            if value > MAX_SIZE {
                candle_core::bail!("ltx vae config: {key} {value} is larger than {MAX_SIZE}");
            }
        }
        if self.spatio_temporal_scaling.len() > 16 {
            candle_core::bail!("ltx vae config: spatio_temporal_scaling has too many entries");
        }
        for (key, len, need) in [
            (
                "decoder_layers_per_block",
                self.decoder_layers_per_block.len(),
                n + 1,
            ),
            (
                "decoder_inject_noise",
                self.decoder_inject_noise.len(),
                n + 1,
            ),
            (
                "decoder_spatio_temporal_scaling",
                self.decoder_spatio_temporal_scaling.len(),
                n,
            ),
            ("upsample_residual", self.upsample_residual.len(), n),
            ("upsample_factor", self.upsample_factor.len(), n),
        ] {
            if len < need {
                candle_core::bail!(
                    "ltx vae config: {key} has {len} entries, the decoder needs {need}"
                );
            }
        }
        let mut channels = reversed(&self.decoder_block_out_channels, 0);
        for i in 0..n {
            let factor = reversed(&self.upsample_factor, i);
            let out = reversed(&self.decoder_block_out_channels, i);
            if factor == 0 || !8usize.is_multiple_of(factor) || out % factor != 0 || out == 0 {
                candle_core::bail!(
                    "ltx vae config: upsample_factor {factor} must divide 8 and the block's {out} channels"
                );
            }
            let input = channels / factor;
            if input != out / factor && self.timestep_conditioning {
                candle_core::bail!(
                    "ltx vae config: decoder_block_out_channels changes width inside an up block, which diffusers cannot run with timestep_conditioning"
                );
            }
            if reversed(&self.upsample_residual, i) && !out.is_multiple_of(8) {
                candle_core::bail!(
                    "ltx vae config: a residual upsampler needs decoder_block_out_channels divisible by 8, got {out}"
                );
            }
            channels = out / factor;
        }
        if !(self.scaling_factor.is_finite() && self.scaling_factor != 0.0) {
            candle_core::bail!("ltx vae config: scaling_factor must be a non-zero number");
        }
        if !(self.resnet_norm_eps.is_finite() && self.resnet_norm_eps >= 0.0) {
            candle_core::bail!(
                "ltx vae config: resnet_norm_eps must be a finite non-negative number"
            );
        }
        Ok(())
    }
}

impl VideoVae for LtxVaeConfig {
    fn compression(&self) -> (usize, usize) {
        (
            self.temporal_compression_ratio(),
            self.spatial_compression_ratio(),
        )
    }
}

/// The decoder's injected noise, one `[height, width]` f32 N(0, 1) draw per call, in diffusers'
/// call order (resnet by resnet: after conv1, then after conv2).
pub trait InjectedNoise {
    fn next(&mut self, height: usize, width: usize, device: &Device) -> Result<Tensor>;
}

/// Noise drawn by a closure `(height, width, device) -> [height, width]`.
impl<F: FnMut(usize, usize, &Device) -> Result<Tensor>> InjectedNoise for F {
    fn next(&mut self, height: usize, width: usize, device: &Device) -> Result<Tensor> {
        self(height, width, device)
    }
}

/// Draws given in advance (e.g. a reference run's `injected_noise.K`), used in order; a draw
/// missing or of the wrong shape is an error.
#[derive(Debug, Clone)]
pub struct GivenNoise {
    draws: Vec<Tensor>,
    used: usize,
}

impl GivenNoise {
    pub fn new(draws: Vec<Tensor>) -> Self {
        Self { draws, used: 0 }
    }

    /// How many draws the decoder took.
    pub fn used(&self) -> usize {
        self.used
    }

    /// After a decode: an error when some given draws were never used (a draws file with
    /// tensors the run does not need).
    pub fn check_all_used(&self) -> Result<()> {
        if self.used != self.draws.len() {
            candle_core::bail!(
                "{} injected noise draws were given but the decoder used {}",
                self.draws.len(),
                self.used
            );
        }
        Ok(())
    }
}

/// Runs without a draws file: `torch.randn((height, width))` of the generator standing for
/// diffusers' global one.
impl InjectedNoise for TorchGenerator {
    fn next(&mut self, height: usize, width: usize, device: &Device) -> Result<Tensor> {
        self.randn(&[height, width])?.to_device(device)
    }
}

impl InjectedNoise for GivenNoise {
    fn next(&mut self, height: usize, width: usize, device: &Device) -> Result<Tensor> {
        let k = self.used;
        let Some(draw) = self.draws.get(k) else {
            candle_core::bail!(
                "the decoder needs injected noise draw {k}, but only {k} were given"
            );
        };
        if draw.dims() != [height, width] {
            candle_core::bail!(
                "injected noise draw {k} has shape {:?}, the decoder needs [{height}, {width}]",
                draw.dims()
            );
        }
        self.used += 1;
        draw.to_device(device)?.to_dtype(DType::F32)
    }
}

/// `(latents - mean) * scaling_factor / std` per channel of `[B, C, F, H, W]`.
pub fn normalize_latents(
    latents: &Tensor,
    mean: &Tensor,
    std: &Tensor,
    scaling_factor: f64,
) -> Result<Tensor> {
    let shape = (1, mean.dim(0)?, 1, 1, 1);
    let mean = mean.reshape(shape)?.to_dtype(latents.dtype())?;
    let std = std.reshape(shape)?.to_dtype(latents.dtype())?;
    (latents.broadcast_sub(&mean)? * scaling_factor)?.broadcast_div(&std)
}

/// `latents * std / scaling_factor + mean` per channel (the pipeline's `_denormalize_latents`).
pub fn denormalize_latents(
    latents: &Tensor,
    mean: &Tensor,
    std: &Tensor,
    scaling_factor: f64,
) -> Result<Tensor> {
    let shape = (1, mean.dim(0)?, 1, 1, 1);
    let mean = mean.reshape(shape)?.to_dtype(latents.dtype())?;
    let std = std.reshape(shape)?.to_dtype(latents.dtype())?;
    (latents.broadcast_mul(&std)? / scaling_factor)?.broadcast_add(&mean)
}

/// RMSNorm over the channels (dim 1) without weight, computed in f32.
fn channel_rms_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = x.to_dtype(DType::F32)?;
    let inv = (xf.sqr()?.mean_keepdim(1)? + eps)?.sqrt()?.recip()?;
    xf.broadcast_mul(&inv)?.to_dtype(x.dtype())
}

/// [`channel_rms_norm`], then `* (1 + scale) + shift` per `[B, C]` channel where `modulation`
/// `(scale, shift)` is given, then SiLU: one fused kernel on CUDA.
fn rms_modulate_silu(x: &Tensor, modulation: Option<(&Tensor, &Tensor)>) -> Result<Tensor> {
    let scale1 = modulation.map(|(scale, _)| scale + 1.0).transpose()?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && crate::models::norms::enabled() {
        let modulation = scale1.as_ref().zip(modulation.map(|(_, shift)| shift));
        return crate::models::norms::channel_rms(x, modulation, RMS_EPS, true);
    }
    let mut h = channel_rms_norm(x, RMS_EPS)?;
    if let (Some(scale1), Some((_, shift))) = (&scale1, modulation) {
        h = h.broadcast_mul(scale1)?.broadcast_add(shift)?;
    }
    h.silu()
}

/// Affine LayerNorm over the channels (dim 1), computed in f32.
fn channel_layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let c = weight.dim(0)?;
    let xf = x.to_dtype(DType::F32)?;
    let xc = xf.broadcast_sub(&xf.mean_keepdim(1)?)?;
    let var = xc.sqr()?.mean_keepdim(1)?;
    let shape = (1, c, 1, 1, 1);
    xc.broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(&weight.to_dtype(DType::F32)?.reshape(shape)?)?
        .broadcast_add(&bias.to_dtype(DType::F32)?.reshape(shape)?)?
        .to_dtype(x.dtype())
}

/// `LTXVideoCausalConv3d` with a cubic kernel and the same stride on every axis: time padded
/// by replicating the first frame (causal: `k - 1` in front; else `(k - 1) / 2` at each end,
/// the last frame behind), space zero-padded by `k / 2`. One 3D convolution through cuDNN
/// where it is loaded ([`conv3d`]), else a sum over temporal taps of 2D convs over batches of
/// frames.
#[derive(Debug, Clone)]
struct CausalConv3d {
    /// `[C_out, C_in, k, k, k]`, as loaded (a temporal tap is sliced out when it runs).
    weight: Tensor,
    bias: Tensor,
    causal: bool,
    stride: usize,
}

impl CausalConv3d {
    fn new(cin: usize, cout: usize, k: usize, causal: bool, vb: VarBuilder) -> Result<Self> {
        Self::strided(cin, cout, k, 1, causal, vb)
    }

    fn strided(
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        causal: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        let vb = vb.pp("conv");
        Ok(Self {
            weight: vb.get((cout, cin, k, k, k), "weight")?,
            bias: vb.get(cout, "bias")?.reshape((1, cout, 1, 1))?,
            causal,
            stride,
        })
    }

    /// `[B, C, T, H, W]` -> `[B, C_out, T', H', W']` (the same sizes at stride 1).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_plus(x, None)
    }

    /// Copies of the first and last frames in front of and behind the input.
    fn time_padding(&self) -> (usize, usize) {
        let k = self.weight.dim(2).unwrap_or(1);
        match self.causal {
            true => (k - 1, 0),
            false => ((k - 1) / 2, (k - 1) / 2),
        }
    }

    /// The convolution channels last ([`conv3d::padded_conv_channels_last`]), its first and last
    /// frames replicated in time; `None` where that does not apply.
    #[cfg(feature = "cuda")]
    fn forward_channels_last(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let t = x.dim(2)?;
        let k = self.weight.dim(2)?;
        let (front, back) = self.time_padding();
        // Padded frames outside x replicate its first or last frame.
        let source = |j: usize| j.saturating_sub(front).min(t.saturating_sub(1)) as u32;
        conv3d::padded_conv_channels_last(
            (x, None),
            (t + front + back, &source, 1),
            (&self.weight, self.stride, k / 2),
            &self.bias,
            residual,
        )
    }

    /// [`Self::forward`] plus `residual` (of the output's shape) where given: a resnet's
    /// `conv(h) + x`, added with the bias in one pass on the fused path.
    fn forward_plus(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(y) = conv3d::or_fallback(|| self.forward_channels_last(x, residual)) {
            return Ok(y);
        }
        let (b, c, t, h, w) = x.dims5()?;
        let k = self.weight.dim(2)?;
        let (front, back) = self.time_padding();
        let mut parts = Vec::with_capacity(3);
        if front > 0 {
            parts.push(x.narrow(2, 0, 1)?.repeat((1, 1, front, 1, 1))?);
        }
        parts.push(x.clone());
        if back > 0 {
            parts.push(x.narrow(2, t - 1, 1)?.repeat((1, 1, back, 1, 1))?);
        }
        let padded = Tensor::cat(&parts, 2)?;
        let st = self.stride;
        let pad = k / 2;
        let whole = || -> Result<Option<Tensor>> {
            match conv3d::conv3d(&padded, &self.weight, [st; 3], [0, pad, pad])? {
                Some(y) => Ok(Some(conv3d::add_channel_bias_plus(
                    y, &self.bias, residual,
                )?)),
                None => Ok(None),
            }
        };
        if let Some(y) = conv3d::or_fallback(whole) {
            return Ok(y);
        }
        // Frames-major so a run of frames is a batch of images.
        let padded = padded.permute((0, 2, 1, 3, 4))?.contiguous()?;
        let taps = (0..k)
            .map(|tap| self.weight.narrow(2, tap, 1)?.squeeze(2)?.contiguous())
            .collect::<Result<Vec<_>>>()?;
        let t_out = (t + front + back - k) / st + 1;
        let per_frame = (h * w * c * k * k).max(1);
        let frames_per_call = (MAX_IM2COL_ELEMENTS / per_frame).clamp(1, t_out.max(1));
        let mut outs = Vec::with_capacity(b * t_out.div_ceil(frames_per_call));
        for bi in 0..b {
            let video = padded.narrow(0, bi, 1)?.squeeze(0)?;
            let mut t0 = 0;
            while t0 < t_out {
                let len = frames_per_call.min(t_out - t0);
                let mut acc: Option<Tensor> = None;
                for (tap, weight) in taps.iter().enumerate() {
                    // Input frames (t0 + j)·stride + tap of the padded video, j < len.
                    let frames = if st == 1 {
                        video.narrow(0, t0 + tap, len)?
                    } else {
                        let index: Vec<u32> =
                            (0..len).map(|j| ((t0 + j) * st + tap) as u32).collect();
                        video.index_select(&Tensor::new(index, video.device())?, 0)?
                    };
                    let y = frames.conv2d(weight, pad, st, 1, 1)?;
                    acc = Some(match acc {
                        Some(a) => (a + y)?,
                        None => y,
                    });
                }
                match acc {
                    Some(a) => outs.push(a.broadcast_add(&self.bias)?),
                    None => candle_core::bail!("conv3d with an empty kernel"),
                }
                t0 += len;
            }
        }
        let y = Tensor::cat(&outs, 0)?;
        let (_, cout, ho, wo) = y.dims4()?;
        let y = y
            .reshape((b, t_out, cout, ho, wo))?
            .permute((0, 2, 1, 3, 4))?
            .contiguous()?;
        conv3d::plus(y, residual)
    }
}

/// PixArt combined timestep embedding (no size conditions): sinusoid(256) -> Linear -> SiLU ->
/// Linear.
#[derive(Debug, Clone)]
struct TimeEmbedder {
    linear_1: Linear,
    linear_2: Linear,
}

impl TimeEmbedder {
    fn new(dim: usize, vb: VarBuilder) -> Result<Self> {
        let vb = vb.pp("timestep_embedder");
        Ok(Self {
            linear_1: candle_nn::linear(TIMESTEP_PROJ_DIM, dim, vb.pp("linear_1"))?,
            linear_2: candle_nn::linear(dim, dim, vb.pp("linear_2"))?,
        })
    }

    /// `[B]` timesteps -> `[B, dim, 1, 1, 1]`.
    fn forward(&self, timestep: &Tensor, dtype: DType) -> Result<Tensor> {
        let proj = timestep_embedding(timestep, TIMESTEP_PROJ_DIM)?.to_dtype(dtype)?;
        let emb = self
            .linear_2
            .forward(&self.linear_1.forward(&proj)?.silu()?)?;
        let (b, dim) = emb.dims2()?;
        emb.reshape((b, dim, 1, 1, 1))
    }
}

/// Rows `i` of a `[B, n·C, 1, 1, 1]` time embedding plus `table` `[n, C]`: `[B, C, 1, 1, 1]`.
fn modulation_row(temb: &Tensor, table: &Tensor, i: usize) -> Result<Tensor> {
    let (n, c) = table.dims2()?;
    let b = temb.dim(0)?;
    let row = temb.reshape((b, n, c))?.narrow(1, i, 1)?;
    row.broadcast_add(&table.narrow(0, i, 1)?.unsqueeze(0)?)?
        .reshape((b, c, 1, 1, 1))
}

/// `LTXVideoResnetBlock3d`.
#[derive(Debug, Clone)]
struct ResnetBlock {
    conv1: CausalConv3d,
    conv2: CausalConv3d,
    /// `norm3` (LayerNorm weight, bias) and `conv_shortcut` when the width changes.
    shortcut: Option<(Tensor, Tensor, CausalConv3d)>,
    /// `per_channel_scale1`, `per_channel_scale2` `[C, 1, 1]` with noise injection.
    noise_scales: Option<(Tensor, Tensor)>,
    /// `[4, C_in]` with timestep conditioning.
    scale_shift_table: Option<Tensor>,
    eps: f64,
}

/// What a resnet of the encoder or the decoder has.
#[derive(Debug, Clone, Copy)]
struct ResnetOptions {
    causal: bool,
    timestep_conditioning: bool,
    inject_noise: bool,
    eps: f64,
}

impl ResnetOptions {
    fn decoder(cfg: &LtxVaeConfig, inject_noise: bool) -> Self {
        Self {
            causal: cfg.decoder_causal,
            timestep_conditioning: cfg.timestep_conditioning,
            inject_noise,
            eps: cfg.resnet_norm_eps,
        }
    }

    fn encoder(cfg: &LtxVaeConfig) -> Self {
        Self {
            causal: cfg.encoder_causal,
            timestep_conditioning: false,
            inject_noise: false,
            eps: cfg.resnet_norm_eps,
        }
    }
}

impl ResnetBlock {
    fn new(cin: usize, cout: usize, options: ResnetOptions, vb: VarBuilder) -> Result<Self> {
        let causal = options.causal;
        let shortcut = if cin != cout {
            Some((
                vb.get(cin, "norm3.weight")?,
                vb.get(cin, "norm3.bias")?,
                CausalConv3d::new(cin, cout, 1, causal, vb.pp("conv_shortcut"))?,
            ))
        } else {
            None
        };
        let noise_scales = if options.inject_noise {
            Some((
                vb.get((cin, 1, 1), "per_channel_scale1")?,
                vb.get((cin, 1, 1), "per_channel_scale2")?,
            ))
        } else {
            None
        };
        let scale_shift_table = if options.timestep_conditioning {
            Some(vb.get((4, cin), "scale_shift_table")?)
        } else {
            None
        };
        Ok(Self {
            conv1: CausalConv3d::new(cin, cout, 3, causal, vb.pp("conv1"))?,
            conv2: CausalConv3d::new(cout, cout, 3, causal, vb.pp("conv2"))?,
            shortcut,
            noise_scales,
            scale_shift_table,
            eps: options.eps,
        })
    }

    /// Adds `noise[None] * scale` (`[1, C, 1, H, W]`), broadcast over batch and frames.
    fn inject(x: &Tensor, scale: &Tensor, noise: &mut dyn InjectedNoise) -> Result<Tensor> {
        let (_, _, _, h, w) = x.dims5()?;
        let draw = noise.next(h, w, x.device())?.to_dtype(x.dtype())?;
        let spatial = draw
            .unsqueeze(0)?
            .broadcast_mul(&scale.to_dtype(x.dtype())?)?;
        conv3d::add_broadcast(x, &spatial.unsqueeze(0)?.unsqueeze(2)?)
    }

    fn forward(
        &self,
        input: &Tensor,
        temb: Option<&Tensor>,
        noise: &mut dyn InjectedNoise,
    ) -> Result<Tensor> {
        let modulation = match (&self.scale_shift_table, temb) {
            (Some(table), Some(temb)) => Some((
                modulation_row(temb, table, 0)?,
                modulation_row(temb, table, 1)?,
                modulation_row(temb, table, 2)?,
                modulation_row(temb, table, 3)?,
            )),
            (Some(_), None) => candle_core::bail!("this VAE decoder needs a decode timestep"),
            _ => None,
        };
        let first = modulation
            .as_ref()
            .map(|(shift, scale, _, _)| (scale, shift));
        let mut h = self.conv1.forward(&rms_modulate_silu(input, first)?)?;
        if let Some((scale1, _)) = &self.noise_scales {
            h = Self::inject(&h, scale1, noise)?;
        }
        let second = modulation
            .as_ref()
            .map(|(_, _, shift, scale)| (scale, shift));
        // Assigned, not shadowed: the convolution's output is dropped here, not at the end.
        h = rms_modulate_silu(&h, second)?;
        let residual = match &self.shortcut {
            Some((w, b, conv)) => conv.forward(&channel_layer_norm(input, w, b, self.eps)?)?,
            None => input.clone(),
        };
        match &self.noise_scales {
            // The noise lands between the convolution and the residual.
            Some((_, scale2)) => Self::inject(&self.conv2.forward(&h)?, scale2, noise)? + residual,
            None => self.conv2.forward_plus(&h, Some(&residual)),
        }
    }
}

/// `[B, C·8, T, H, W]` -> `[B, C, 2T - 1, 2H, 2W]` (channel = c·8 + t·4 + h·2 + w), the first
/// frame dropped: one move into a contiguous result on CUDA (a copy walking eight dimensions,
/// left as a view whose every reader copied it again, before).
fn depth_to_space_drop_first(x: &Tensor) -> Result<Tensor> {
    let (b, c8, t, h, w) = x.dims5()?;
    let c = c8 / 8;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F32)
        && crate::models::norms::enabled()
    {
        use crate::models::channel_ops::{depth_to_space, VideoLayout};
        // SAFETY: the move writes every element.
        let out = unsafe { Tensor::empty((b, c, 2 * t - 1, 2 * h, 2 * w), x.dtype(), x.device()) }?;
        depth_to_space(x, None, (2, 2), (&out, VideoLayout::ChannelsFirst), 0, 1)?;
        return Ok(out);
    }
    x.reshape(vec![b, c, 2, 2, 2, t, h, w])?
        .permute(vec![0, 1, 5, 2, 6, 3, 7, 4])?
        .reshape((b, c, 2 * t, 2 * h, 2 * w))?
        .narrow(2, 1, 2 * t - 1)
}

/// `LTXVideoUpsampler3d` with stride (2, 2, 2): conv to `8C / factor` channels,
/// depth-to-space, first frame dropped, plus (residual) the depth-to-spaced input tiled over
/// the channels.
#[derive(Debug, Clone)]
struct Upsampler {
    conv: CausalConv3d,
    residual: bool,
    factor: usize,
}

impl Upsampler {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = depth_to_space_drop_first(&self.conv.forward(x)?)?;
        if !self.residual {
            return Ok(y);
        }
        let r = depth_to_space_drop_first(x)?;
        let repeats = 8 / self.factor;
        y + r.repeat((1, repeats, 1, 1, 1))?
    }
}

/// The mid block or an up block: optional width-changing resnet, time embedder, optional
/// upsampler, resnets.
#[derive(Debug, Clone)]
struct DecoderBlock {
    conv_in: Option<ResnetBlock>,
    time_embedder: Option<TimeEmbedder>,
    upsampler: Option<Upsampler>,
    resnets: Vec<ResnetBlock>,
}

impl DecoderBlock {
    fn forward(
        &self,
        x: &Tensor,
        timestep: Option<&Tensor>,
        noise: &mut dyn InjectedNoise,
    ) -> Result<Tensor> {
        let mut h = match &self.conv_in {
            // Only reachable without timestep conditioning (validated).
            Some(conv_in) => conv_in.forward(x, None, noise)?,
            None => x.clone(),
        };
        let temb = match (&self.time_embedder, timestep) {
            (Some(embedder), Some(t)) => Some(embedder.forward(t, h.dtype())?),
            (Some(_), None) => candle_core::bail!("this VAE decoder needs a decode timestep"),
            _ => None,
        };
        if let Some(up) = &self.upsampler {
            h = up.forward(&h)?;
        }
        for resnet in &self.resnets {
            h = resnet.forward(&h, temb.as_ref(), noise)?;
        }
        Ok(h)
    }
}

/// `AutoencoderKLLTXVideo` for decoding: the decoder and the latent statistics buffers.
#[derive(Debug, Clone)]
pub struct AutoencoderKLLTXVideo {
    cfg: LtxVaeConfig,
    conv_in: CausalConv3d,
    mid_block: DecoderBlock,
    up_blocks: Vec<DecoderBlock>,
    /// `timestep_scale_multiplier`, `time_embedder` and `scale_shift_table` `[2, C]` of the
    /// output modulation (timestep conditioning).
    output_time: Option<(Tensor, TimeEmbedder, Tensor)>,
    conv_out: CausalConv3d,
    latents_mean: Tensor,
    latents_std: Tensor,
    /// How [`Self::decode`] tiles; `None` decodes whole (diffusers' default).
    tiling: Option<LtxVaeTiling>,
}

/// The tiling of [`AutoencoderKLLTXVideo::decode`] (diffusers' `enable_tiling` sizes, in video
/// pixels and frames, and `use_framewise_decoding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LtxVaeTiling {
    /// Spatial tiles (`tiled_decode`).
    pub spatial: SampleTiles,
    /// Frame tiles (`_temporal_tiled_decode`): `tile_sample_min_num_frames` every
    /// `tile_sample_stride_num_frames`; `None` as diffusers' `use_framewise_decoding = False`.
    pub frames: Option<(usize, usize)>,
}

impl Default for LtxVaeTiling {
    /// `enable_tiling()`: 512-pixel tiles every 448, no frame tiles.
    fn default() -> Self {
        Self {
            spatial: SampleTiles::square(512, 448),
            frames: None,
        }
    }
}

impl AutoencoderKLLTXVideo {
    /// Loads the decoder and `latents_mean`/`latents_std` from `vb`
    /// (`vae/diffusion_pytorch_model.safetensors`).
    pub fn new(cfg: &LtxVaeConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let n = cfg.decoder_block_out_channels.len();
        let causal = cfg.decoder_causal;
        let dvb = vb.pp("decoder");
        let mut channels = reversed(&cfg.decoder_block_out_channels, 0);
        let conv_in =
            CausalConv3d::new(cfg.latent_channels, channels, 3, causal, dvb.pp("conv_in"))?;
        let time_embedder = |dim: usize, vb: VarBuilder| -> Result<Option<TimeEmbedder>> {
            if cfg.timestep_conditioning {
                Ok(Some(TimeEmbedder::new(dim, vb.pp("time_embedder"))?))
            } else {
                Ok(None)
            }
        };
        let mid_vb = dvb.pp("mid_block");
        let mid_block = DecoderBlock {
            conv_in: None,
            time_embedder: time_embedder(4 * channels, mid_vb.clone())?,
            upsampler: None,
            resnets: (0..reversed(&cfg.decoder_layers_per_block, 0))
                .map(|i| {
                    ResnetBlock::new(
                        channels,
                        channels,
                        ResnetOptions::decoder(cfg, reversed(&cfg.decoder_inject_noise, 0)),
                        mid_vb.pp(format!("resnets.{i}")),
                    )
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let mut up_blocks = Vec::with_capacity(n);
        for i in 0..n {
            let vb = dvb.pp(format!("up_blocks.{i}"));
            let factor = reversed(&cfg.upsample_factor, i);
            let input = channels / factor;
            let output = reversed(&cfg.decoder_block_out_channels, i) / factor;
            let inject = reversed(&cfg.decoder_inject_noise, i + 1);
            let conv_in = if input != output {
                Some(ResnetBlock::new(
                    input,
                    output,
                    ResnetOptions::decoder(cfg, inject),
                    vb.pp("conv_in"),
                )?)
            } else {
                None
            };
            let upsampler = if reversed(&cfg.decoder_spatio_temporal_scaling, i) {
                let cin = output * factor;
                Some(Upsampler {
                    conv: CausalConv3d::new(
                        cin,
                        cin * 8 / factor,
                        3,
                        causal,
                        vb.pp("upsamplers.0.conv"),
                    )?,
                    residual: reversed(&cfg.upsample_residual, i),
                    factor,
                })
            } else {
                None
            };
            let resnets = (0..reversed(&cfg.decoder_layers_per_block, i + 1))
                .map(|j| {
                    ResnetBlock::new(
                        output,
                        output,
                        ResnetOptions::decoder(cfg, inject),
                        vb.pp(format!("resnets.{j}")),
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            up_blocks.push(DecoderBlock {
                conv_in,
                time_embedder: time_embedder(4 * input, vb.clone())?,
                upsampler,
                resnets,
            });
            channels = output;
        }
        let output_time = if cfg.timestep_conditioning {
            Some((
                dvb.get((), "timestep_scale_multiplier")?,
                TimeEmbedder::new(2 * channels, dvb.pp("time_embedder"))?,
                dvb.get((2, channels), "scale_shift_table")?,
            ))
        } else {
            None
        };
        let patch = cfg.patch_size;
        let conv_out = CausalConv3d::new(
            channels,
            cfg.out_channels * patch * patch * cfg.patch_size_t,
            3,
            causal,
            dvb.pp("conv_out"),
        )?;
        Ok(Self {
            cfg: cfg.clone(),
            conv_in,
            mid_block,
            up_blocks,
            output_time,
            conv_out,
            latents_mean: vb.get(cfg.latent_channels, "latents_mean")?,
            latents_std: vb.get(cfg.latent_channels, "latents_std")?,
            tiling: None,
        })
    }

    /// This VAE decoding in `tiling`'s tiles (or whole with `None`), checked against the
    /// compression ratios.
    pub fn with_tiling(&self, tiling: Option<LtxVaeTiling>) -> Result<Self> {
        if let Some(t) = &tiling {
            t.spatial.validate(self.cfg.spatial_compression_ratio())?;
            let ratio = self.cfg.temporal_compression_ratio();
            if let Some((min, stride)) = t
                .frames
                .filter(|&(min, stride)| stride < ratio || min < stride)
            {
                candle_core::bail!(
                    "vae tiling: frame tiles of {min} every {stride} frames must be at least their stride and the stride at least {ratio} frames"
                );
            }
        }
        Ok(Self {
            tiling,
            ..self.clone()
        })
    }

    pub fn config(&self) -> &LtxVaeConfig {
        &self.cfg
    }

    /// `latents_mean` `[C]`.
    pub fn latents_mean(&self) -> &Tensor {
        &self.latents_mean
    }

    /// `latents_std` `[C]`.
    pub fn latents_std(&self) -> &Tensor {
        &self.latents_std
    }

    /// The pipeline's `_denormalize_latents` with this VAE's buffers and scaling factor.
    pub fn denormalize(&self, latents: &Tensor) -> Result<Tensor> {
        denormalize_latents(
            latents,
            &self.latents_mean,
            &self.latents_std,
            self.cfg.scaling_factor,
        )
    }

    /// Whether [`Self::decode`] takes a decode timestep (0.9.1 layout).
    pub fn timestep_conditioning(&self) -> bool {
        self.cfg.timestep_conditioning
    }

    /// `vae.decode(z, temb)`: `z` `[B, C, F, H, W]` (de-normalised latents) -> video `[B,
    /// out_channels, (F - 1)·r_t + 1, H·r_s, W·r_s]`, not clamped, tiled as
    /// [`Self::with_tiling`] set. `timestep` `[B]` (or one value) is the decode timestep,
    /// required with timestep conditioning; `noise` supplies the injected noise draws (tile
    /// after tile, as diffusers draws them).
    pub fn decode(
        &self,
        z: &Tensor,
        timestep: Option<&Tensor>,
        noise: &mut dyn InjectedNoise,
    ) -> Result<Tensor> {
        let Some(tiling) = self.tiling else {
            return self.decode_whole(z, timestep, noise);
        };
        let (s, r_t) = (
            self.cfg.spatial_compression_ratio(),
            self.cfg.temporal_compression_ratio(),
        );
        // diffusers' `tiled_decode` where the latents exceed a tile.
        let mut decode_tile = |z: &Tensor| -> Result<Tensor> {
            let (_, _, _, h, w) = z.dims5()?;
            match tiling.spatial.splits((h, w), s) {
                true => tiling
                    .spatial
                    .decode(z, s, |tile| self.decode_whole(tile, timestep, noise)),
                false => self.decode_whole(z, timestep, noise),
            }
        };
        match tiling.frames {
            // diffusers' `_temporal_tiled_decode`.
            Some(frames) if z.dim(2)? > frames.0 / r_t => {
                decode_frame_tiles(z, frames, r_t, Dropped::Last, decode_tile)
            }
            _ => decode_tile(z),
        }
    }

    /// One decoder call on `z`, untiled.
    fn decode_whole(
        &self,
        z: &Tensor,
        timestep: Option<&Tensor>,
        noise: &mut dyn InjectedNoise,
    ) -> Result<Tensor> {
        let b = z.dim(0)?;
        let mut h = self.conv_in.forward(z)?;
        let temb = match (&self.output_time, timestep) {
            (Some((multiplier, _, _)), Some(t)) => {
                let t = t.to_dtype(DType::F32)?.flatten_all()?;
                let t = if t.dim(0)? == 1 && b > 1 {
                    t.broadcast_as(b)?.contiguous()?
                } else {
                    t
                };
                Some(t.broadcast_mul(&multiplier.to_dtype(DType::F32)?)?)
            }
            (Some(_), None) => candle_core::bail!("this VAE decoder needs a decode timestep"),
            (None, _) => None,
        };
        h = self.mid_block.forward(&h, temb.as_ref(), noise)?;
        for block in &self.up_blocks {
            h = block.forward(&h, temb.as_ref(), noise)?;
        }
        let modulation = match (&self.output_time, &temb) {
            (Some((_, embedder, table)), Some(t)) => {
                let emb = embedder.forward(t, h.dtype())?;
                Some((
                    modulation_row(&emb, table, 1)?,
                    modulation_row(&emb, table, 0)?,
                ))
            }
            _ => None,
        };
        let modulation = modulation.as_ref().map(|(scale, shift)| (scale, shift));
        let h = self.conv_out.forward(&rms_modulate_silu(&h, modulation)?)?;
        // Un-patchify: channel = c·(p_t·p·p) + t·p·p + w·p + h.
        let (b, _, f, hh, ww) = h.dims5()?;
        let (p, pt) = (self.cfg.patch_size, self.cfg.patch_size_t);
        h.reshape(vec![b, self.cfg.out_channels, pt, p, p, f, hh, ww])?
            .permute(vec![0, 1, 5, 2, 6, 4, 7, 3])?
            .reshape((b, self.cfg.out_channels, f * pt, hh * p, ww * p))
    }
}

/// The pipeline's step before decoding with timestep conditioning: `(1 - s)·z + s·noise`,
/// `s` = `decode_noise_scale` as an f32 (as the pipeline's f32 tensor holds it).
pub fn add_decode_noise(latents: &Tensor, noise: &Tensor, scale: f64) -> Result<Tensor> {
    let s = scale as f32;
    let keep = 1.0f32 - s;
    latents.affine(f64::from(keep), 0.0)?
        + noise.to_dtype(latents.dtype())?.affine(f64::from(s), 0.0)?
}

/// One `LTXVideoDownBlock3D`: resnets, an optional stride-2 conv, an optional
/// width-changing resnet.
#[derive(Debug, Clone)]
struct EncoderBlock {
    resnets: Vec<ResnetBlock>,
    downsampler: Option<CausalConv3d>,
    conv_out: Option<ResnetBlock>,
}

/// The VAE encoder (`encoder.*`, diffusers' `LTXVideoEncoder3d` with `LTXVideoDownBlock3D`s):
/// patchify, conv_in, down blocks, mid block, RMSNorm, SiLU, conv_out to `latent_channels + 1`
/// (the mean channels and one log-variance channel). Not needed for text-to-video.
#[derive(Debug, Clone)]
pub struct LtxVideoEncoder {
    cfg: LtxVaeConfig,
    conv_in: CausalConv3d,
    down_blocks: Vec<EncoderBlock>,
    mid_resnets: Vec<ResnetBlock>,
    conv_out: CausalConv3d,
}

impl LtxVideoEncoder {
    /// Loads `encoder.*` from the VAE checkpoint root `vb`.
    pub fn new(cfg: &LtxVaeConfig, vb: VarBuilder) -> Result<Self> {
        let n = cfg.block_out_channels.len();
        if n == 0 || cfg.in_channels == 0 {
            candle_core::bail!(
                "ltx vae config: block_out_channels and in_channels must be non-empty"
            );
        }
        for (key, len, need) in [
            ("layers_per_block", cfg.layers_per_block.len(), n + 1),
            (
                "spatio_temporal_scaling",
                cfg.spatio_temporal_scaling.len(),
                n,
            ),
            ("down_block_types", cfg.down_block_types.len(), n),
        ] {
            if len < need {
                candle_core::bail!(
                    "ltx vae config: {key} has {len} entries, the encoder needs {need}"
                );
            }
        }
        if let Some(other) = cfg.down_block_types[..n]
            .iter()
            .find(|t| t.as_str() != "LTXVideoDownBlock3D")
        {
            candle_core::bail!(
                "ltx vae config: down_block_types {other:?} is not supported (only LTXVideoDownBlock3D)"
            );
        }
        if cfg
            .block_out_channels
            .iter()
            .chain([&cfg.in_channels])
            .any(|&c| c > MAX_SIZE)
        {
            candle_core::bail!(
                "ltx vae config: block_out_channels or in_channels larger than {MAX_SIZE}"
            );
        }
        cfg.validate()?;
        let vb = vb.pp("encoder");
        let options = ResnetOptions::encoder(cfg);
        let causal = cfg.encoder_causal;
        let patch_channels = cfg.in_channels * cfg.patch_size * cfg.patch_size * cfg.patch_size_t;
        let mut output = cfg.block_out_channels[0];
        let conv_in = CausalConv3d::new(patch_channels, output, 3, causal, vb.pp("conv_in"))?;
        let mut down_blocks = Vec::with_capacity(n);
        for i in 0..n {
            let input = output;
            output = cfg.block_out_channels[(i + 1).min(n - 1)];
            let bvb = vb.pp(format!("down_blocks.{i}"));
            let resnets = (0..cfg.layers_per_block[i])
                .map(|j| ResnetBlock::new(input, input, options, bvb.pp(format!("resnets.{j}"))))
                .collect::<Result<Vec<_>>>()?;
            let downsampler = if cfg.spatio_temporal_scaling[i] {
                Some(CausalConv3d::strided(
                    input,
                    input,
                    3,
                    2,
                    causal,
                    bvb.pp("downsamplers.0"),
                )?)
            } else {
                None
            };
            let conv_out = if input != output {
                Some(ResnetBlock::new(
                    input,
                    output,
                    options,
                    bvb.pp("conv_out"),
                )?)
            } else {
                None
            };
            down_blocks.push(EncoderBlock {
                resnets,
                downsampler,
                conv_out,
            });
        }
        let mid_resnets = (0..cfg.layers_per_block[n])
            .map(|j| {
                ResnetBlock::new(
                    output,
                    output,
                    options,
                    vb.pp(format!("mid_block.resnets.{j}")),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let conv_out = CausalConv3d::new(
            output,
            cfg.latent_channels + 1,
            3,
            causal,
            vb.pp("conv_out"),
        )?;
        Ok(Self {
            cfg: cfg.clone(),
            conv_in,
            down_blocks,
            mid_resnets,
            conv_out,
        })
    }

    /// `video` `[B, in_channels, T, H, W]` in [-1, 1] (T = 1 + 8k, H and W multiples of the
    /// spatial ratio) -> moments `[B, 2·latent_channels, T', H', W']`: the means, then the
    /// log-variance channel repeated `latent_channels` times.
    pub fn encode(&self, video: &Tensor) -> Result<Tensor> {
        let (b, c, t, h, w) = video.dims5()?;
        let (p, pt) = (self.cfg.patch_size, self.cfg.patch_size_t);
        if t % pt != 0 || h % p != 0 || w % p != 0 {
            candle_core::bail!("a {t}x{h}x{w} video does not split into {pt}x{p}x{p} patches");
        }
        let (tp, hp, wp) = (t / pt, h / p, w / p);
        // Patchify: channel = c·(p_t·p·p) + t·p·p + w·p + h, as diffusers orders it.
        let x = video
            .reshape(vec![b, c, tp, pt, hp, p, wp, p])?
            .permute(vec![0, 1, 3, 7, 5, 2, 4, 6])?
            .reshape((b, c * pt * p * p, tp, hp, wp))?;
        let mut noise = GivenNoise::new(Vec::new());
        let mut h = self.conv_in.forward(&x)?;
        for block in &self.down_blocks {
            for resnet in &block.resnets {
                h = resnet.forward(&h, None, &mut noise)?;
            }
            if let Some(down) = &block.downsampler {
                h = down.forward(&h)?;
            }
            if let Some(conv_out) = &block.conv_out {
                h = conv_out.forward(&h, None, &mut noise)?;
            }
        }
        for resnet in &self.mid_resnets {
            h = resnet.forward(&h, None, &mut noise)?;
        }
        let h = self
            .conv_out
            .forward(&channel_rms_norm(&h, RMS_EPS)?.silu()?)?;
        let latent = self.cfg.latent_channels;
        let logvar = h.narrow(1, latent, 1)?;
        Tensor::cat(&[h, logvar.repeat((1, latent - 1, 1, 1, 1))?], 1)
    }
}

/// `DiagonalGaussianDistribution(moments)`: (mean, logvar clamped to [-30, 20]).
pub fn latent_dist(moments: &Tensor) -> Result<(Tensor, Tensor)> {
    let c = moments.dim(1)? / 2;
    Ok((
        moments.narrow(1, 0, c)?,
        moments.narrow(1, c, c)?.clamp(-30f32, 20f32)?,
    ))
}

crate::placed_whole!(
    AutoencoderKLLTXVideo,
    LtxVaeConfig,
    AutoencoderKLLTXVideo::new
);
