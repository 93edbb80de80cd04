//! Mochi-1 video VAE decoder (diffusers `AutoencoderKLMochi`, decode whole or in spatial tiles).
//!
//! Activations are frames-major `[B, T, C, H, W]` (the layout of the causal convolution shared
//! with HunyuanVideo's VAE: replicate padding, `k − 1` copies of the first frame in front, `k/2`
//! edge copies each side in space). GroupNorms normalise each frame alone (32 groups, diffusers'
//! `MochiChunkedGroupNorm3D`). The decoder: `conv_in` (1x1x1), a block of resnets, up blocks
//! (resnets, then a per-position Linear to `C·t·s·s` channels and depth-to-space), a last block
//! of resnets, SiLU, `proj_out`; the first `t_total − 1` frames are dropped (diffusers'
//! `drop_last_temporal_frames`). The VAE computes in the `VarBuilder`'s dtype (`MochiPipeline`
//! does not upcast it); GroupNorm statistics are taken in f32.

use candle_core::{DType, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;

use crate::models::hunyuan_video::vae::CausalConv3d;
use crate::models::runs::{fused_group_norm, in_runs, GroupNormSpec, Rounding};
use crate::models::vae_tiling::{SampleTiles, SpatialTiling};
use crate::models::video::VideoVae;

/// Groups of every GroupNorm (hard-coded in `MochiChunkedGroupNorm3D`).
const NORM_GROUPS: usize = 32;
/// `nn.GroupNorm`'s default epsilon.
const NORM_EPS: f64 = 1e-5;
/// Frames a GroupNorm normalises at once (`MochiChunkedGroupNorm3D`'s `chunk_size`).
pub const NORM_CHUNK_FRAMES: usize = 8;

/// `vae/config.json` of a diffusers `AutoencoderKLMochi`; missing keys take diffusers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct MochiVaeConfig {
    /// Encoder input channels (RGB plus Fourier features; the encoder is not built).
    pub in_channels: usize,
    pub out_channels: usize,
    /// Encoder widths (informational: text-to-video decodes only).
    pub encoder_block_out_channels: Vec<usize>,
    pub decoder_block_out_channels: Vec<usize>,
    pub latent_channels: usize,
    /// Resnets per stage: the first for `block_out`, the last for `block_in`.
    pub layers_per_block: Vec<usize>,
    /// Activation (only `silu` / `swish`).
    pub act_fn: String,
    /// Frame factor of each up block (applied last to first).
    pub temporal_expansions: Vec<usize>,
    /// Height and width factor of each up block (applied last to first).
    pub spatial_expansions: Vec<usize>,
    /// Encoder attention per stage (informational).
    pub add_attention_block: Vec<bool>,
    /// Per-channel mean the pipeline adds back before decoding.
    pub latents_mean: Vec<f64>,
    /// Per-channel std the pipeline multiplies back before decoding.
    pub latents_std: Vec<f64>,
    pub scaling_factor: f64,
}

impl Default for MochiVaeConfig {
    fn default() -> Self {
        Self {
            in_channels: 15,
            out_channels: 3,
            encoder_block_out_channels: vec![64, 128, 256, 384],
            decoder_block_out_channels: vec![128, 256, 512, 768],
            latent_channels: 12,
            layers_per_block: vec![3, 3, 4, 6, 3],
            act_fn: "silu".into(),
            temporal_expansions: vec![1, 2, 3],
            spatial_expansions: vec![2, 2, 2],
            add_attention_block: vec![false, true, true, true, true],
            latents_mean: vec![
                -0.06730895953510081,
                -0.038011381506090416,
                -0.07477820912866141,
                -0.05565264470995561,
                0.012767231469026969,
                -0.04703542746246419,
                0.043896967884726704,
                -0.09346305707025976,
                -0.09918314763016893,
                -0.008729793427399178,
                -0.011931556316503654,
                -0.0321993391887285,
            ],
            latents_std: vec![
                0.9263795028493863,
                0.9248894543193766,
                0.9393059390890617,
                0.959253732819592,
                0.8244560132752793,
                0.917259975397747,
                0.9294154431013696,
                1.3720942357788521,
                0.881393668867029,
                0.9168315692124348,
                0.9185249279345552,
                0.9274757570805041,
            ],
            scaling_factor: 1.0,
        }
    }
}

impl MochiVaeConfig {
    /// Pixels per latent pixel (the product of the spatial expansions).
    pub fn spatial_compression_ratio(&self) -> usize {
        self.spatial_expansions.iter().product()
    }

    /// Frames per latent frame (the product of the temporal expansions).
    pub fn temporal_compression_ratio(&self) -> usize {
        self.temporal_expansions.iter().product()
    }

    /// Frames a decode of `latent_frames` gives: `t·F` less the `t − 1` dropped in front.
    pub fn decoded_frames(&self, latent_frames: usize) -> usize {
        let t = self.temporal_compression_ratio();
        match latent_frames * t {
            n if n >= t => n - (t - 1),
            n => n,
        }
    }

    /// Rejects configurations the decoder cannot run, with the key at fault.
    pub fn validate(&self) -> Result<()> {
        let stages = self.decoder_block_out_channels.len();
        if stages == 0 {
            candle_core::bail!("vae config: decoder_block_out_channels is empty");
        }
        if let Some(c) = self
            .decoder_block_out_channels
            .iter()
            .find(|&&c| c == 0 || !c.is_multiple_of(NORM_GROUPS))
        {
            candle_core::bail!(
                "vae config: decoder_block_out_channels {c} must be a positive multiple of {NORM_GROUPS} (its GroupNorm groups)"
            );
        }
        if self.layers_per_block.len() != stages + 1 {
            candle_core::bail!(
                "vae config: layers_per_block needs {} entries (one per decoder stage and one for block_in), got {}",
                stages + 1,
                self.layers_per_block.len()
            );
        }
        for (key, list) in [
            ("temporal_expansions", &self.temporal_expansions),
            ("spatial_expansions", &self.spatial_expansions),
        ] {
            if list.len() != stages - 1 {
                candle_core::bail!(
                    "vae config: {key} needs {} entries (one per up block), got {}",
                    stages - 1,
                    list.len()
                );
            }
            if list.contains(&0) {
                candle_core::bail!("vae config: {key} must be positive");
            }
        }
        if self.latent_channels == 0 || self.out_channels == 0 {
            candle_core::bail!("vae config: latent_channels and out_channels must be positive");
        }
        for (key, list) in [
            ("latents_mean", &self.latents_mean),
            ("latents_std", &self.latents_std),
        ] {
            if list.len() != self.latent_channels {
                candle_core::bail!(
                    "vae config: {key} has {} values for {} latent channels",
                    list.len(),
                    self.latent_channels
                );
            }
        }
        if !(self.scaling_factor.is_finite() && self.scaling_factor != 0.0) {
            candle_core::bail!("vae config: scaling_factor must be a non-zero number");
        }
        crate::models::config_checks::one_of(
            "vae config",
            ("act_fn", &self.act_fn),
            &["silu", "swish"],
        )?;
        Ok(())
    }
}

impl VideoVae for MochiVaeConfig {
    fn compression(&self) -> (usize, usize) {
        (
            self.temporal_compression_ratio(),
            self.spatial_compression_ratio(),
        )
    }
}

/// A GroupNorm applied to each frame alone, `x` `[B, T, C, H, W]`; statistics in f32, the
/// output (and SiLU after it) in `x`'s dtype.
#[derive(Debug, Clone)]
struct FrameGroupNorm {
    weight: Tensor,
    bias: Tensor,
}

impl FrameGroupNorm {
    fn new(channels: usize, vb: VarBuilder) -> Result<Self> {
        let vb = vb.pp("norm_layer");
        Ok(Self {
            weight: vb.get(channels, "weight")?,
            bias: vb.get(channels, "bias")?,
        })
    }

    /// The norm, then SiLU: every frame at once by the fused kernels (each frame its own
    /// statistics, one output written once), else composed over runs of [`NORM_CHUNK_FRAMES`]
    /// frames (diffusers' chunks), so the f32 temporaries hold one run.
    fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        let spec = GroupNormSpec {
            weight: &self.weight,
            bias: &self.bias,
            groups: NORM_GROUPS,
            eps: NORM_EPS,
            rounding: Rounding::F32,
            modulation: None,
            silu: true,
        };
        if let Some(y) = fused_group_norm(x, &spec, 2, 2)? {
            return Ok(y);
        }
        let t = x.dim(1)?;
        let runs = (0..t)
            .step_by(NORM_CHUNK_FRAMES)
            .map(|f| self.normalize_silu(&x.narrow(1, f, NORM_CHUNK_FRAMES.min(t - f))?))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&runs, 1)
    }

    /// The norm and SiLU composed, in f32.
    fn normalize_silu(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c, h, w) = x.dims5()?;
        let grouped =
            x.to_dtype(DType::F32)?
                .reshape((b * t, NORM_GROUPS, (c / NORM_GROUPS) * h * w))?;
        let centred = grouped.broadcast_sub(&grouped.mean_keepdim(2)?)?;
        let std = (centred.sqr()?.mean_keepdim(2)? + NORM_EPS)?.sqrt()?;
        let shape = (1, 1, c, 1, 1);
        let normed = centred
            .broadcast_div(&std)?
            .reshape((b, t, c, h, w))?
            .broadcast_mul(&self.weight.to_dtype(DType::F32)?.reshape(shape)?)?
            .broadcast_add(&self.bias.to_dtype(DType::F32)?.reshape(shape)?)?;
        candle_nn::ops::silu(&normed.to_dtype(x.dtype())?)
    }
}

/// `MochiResnetBlock3D`: (GroupNorm, SiLU, causal conv) twice, plus the input.
#[derive(Debug, Clone)]
struct ResnetBlock {
    norm1: FrameGroupNorm,
    conv1: CausalConv3d,
    norm2: FrameGroupNorm,
    conv2: CausalConv3d,
}

impl ResnetBlock {
    fn new(channels: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            norm1: FrameGroupNorm::new(channels, vb.pp("norm1"))?,
            conv1: CausalConv3d::new(channels, channels, 3, vb.pp("conv1"))?,
            norm2: FrameGroupNorm::new(channels, vb.pp("norm2"))?,
            conv2: CausalConv3d::new(channels, channels, 3, vb.pp("conv2"))?,
        })
    }

    /// Each intermediate is dropped as soon as the next exists: at full resolution an
    /// activation is gigabytes.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.conv1.forward(&self.norm1.forward_silu(x)?)?;
        let normed = self.norm2.forward_silu(&h)?;
        drop(h);
        self.conv2.forward_plus(&normed, Some(x))
    }
}

/// Elements one per-frame op of the decoder takes at most: candle's element-wise and copy
/// kernels index with 32 bits, and a full-resolution activation is larger (4.4 G elements at
/// 128 channels for 85 frames of 480x848), so those ops run over runs of frames.
const RUN_ELEMENTS: usize = 1 << 30;

/// `f(first, n)` on input frames `first..first + n` of frames-major `x` `[B, T, ...]`, each
/// giving `out_per_in` output frames of `out_frame_elements` elements per input frame, over
/// runs of frames within `run_elements` ([`RUN_ELEMENTS`]), written into one output.
fn by_frames(
    x: &Tensor,
    out_per_in: usize,
    out_frame_elements: usize,
    f: impl Fn(usize, usize) -> Result<Tensor>,
) -> Result<Tensor> {
    by_frames_within(x, out_per_in, out_frame_elements, RUN_ELEMENTS, f)
}

fn by_frames_within(
    x: &Tensor,
    out_per_in: usize,
    out_frame_elements: usize,
    run_elements: usize,
    f: impl Fn(usize, usize) -> Result<Tensor>,
) -> Result<Tensor> {
    let t = x.dim(1)?;
    let in_frame = x.elem_count() / t.max(1);
    let per_input_frame = in_frame.max(out_frame_elements * out_per_in).max(1);
    let inputs_per_run = (run_elements / per_input_frame).max(1);
    in_runs(
        t * out_per_in,
        inputs_per_run * out_per_in,
        1,
        |first, n| f(first / out_per_in, n / out_per_in),
    )
}

/// A run of resnets (`MochiMidBlock3D` without attention, or an up block's).
fn resnets(channels: usize, layers: usize, vb: VarBuilder) -> Result<Vec<ResnetBlock>> {
    (0..layers)
        .map(|i| ResnetBlock::new(channels, vb.pp(format!("resnets.{i}"))))
        .collect()
}

fn run(blocks: &[ResnetBlock], x: Tensor) -> Result<Tensor> {
    blocks.iter().try_fold(x, |x, block| block.forward(&x))
}

/// A Linear's weight `[out, C]` over the channels of every position, without its bias: `[B, T,
/// C, H, W]` -> `[B, T, out, H, W]`, one matmul per frame on the frames-major layout (the weight
/// broadcast over frames, not copied), no transposing copy on either side.
fn project(weight: &Tensor, x: &Tensor) -> Result<Tensor> {
    let (b, t, c, h, w) = x.dims5()?;
    let out = weight.dim(0)?;
    let y = weight
        .broadcast_as((b * t, out, c))?
        .matmul(&x.reshape((b * t, c, h * w))?)?;
    y.reshape((b, t, out, h, w))
}

/// A Linear over the channels of every position: `[B, T, C, H, W]` -> `[B, T, out, H, W]`.
fn per_position(linear: &Linear, x: &Tensor) -> Result<Tensor> {
    let y = project(linear.weight(), x)?;
    match linear.bias() {
        Some(bias) => y.broadcast_add(&bias.reshape((1, 1, (), 1, 1))?),
        None => Ok(y),
    }
}

/// `MochiUpBlock3D`: resnets, then a Linear to `out·t·s·s` channels and depth-to-space.
#[derive(Debug, Clone)]
struct UpBlock {
    resnets: Vec<ResnetBlock>,
    proj: Linear,
    out_channels: usize,
    temporal: usize,
    spatial: usize,
}

impl UpBlock {
    fn forward(&self, x: Tensor) -> Result<Tensor> {
        let x = run(&self.resnets, x)?;
        let (b, _, _, h, w) = x.dims5()?;
        let (c, st, s) = (self.out_channels, self.temporal, self.spatial);
        let frame = b * c * h * s * w * s;
        #[cfg(feature = "cuda")]
        if x.device().is_cuda()
            && matches!(x.dtype(), DType::BF16 | DType::F32)
            && crate::models::norms::enabled()
        {
            // The projection of each run of frames stored with its bias straight into its
            // place in the expanded output: one pass after the matmul.
            use crate::models::channel_ops::{depth_to_space, VideoLayout};
            let bias = self.proj.bias().ok_or_else(|| {
                candle_core::Error::Msg("an up block's projection without a bias".into())
            })?;
            let t = x.dim(1)?;
            // SAFETY: every run's frames are stored below before the result is returned.
            let out =
                unsafe { Tensor::empty((b, t * st, c, h * s, w * s), x.dtype(), x.device()) }?;
            let per_run = (RUN_ELEMENTS / (frame * st).max(1)).max(1);
            for first in (0..t).step_by(per_run) {
                let y = project(
                    self.proj.weight(),
                    &x.narrow(1, first, per_run.min(t - first))?,
                )?;
                let place = (&out, VideoLayout::FramesMajor);
                depth_to_space(&y, Some(bias), (st, s), place, first * st, 0)?;
            }
            return Ok(out);
        }
        // Channel (c, t', h', w') of the Linear lands at frame t·st + t', row h·s + h', column
        // w·s + w' (diffusers' view + permute).
        by_frames(&x, st, frame, |first, n| {
            per_position(&self.proj, &x.narrow(1, first, n)?)?
                .reshape(vec![b, n, c, st, s, s, h, w])?
                .permute(vec![0, 1, 3, 2, 6, 4, 7, 5])?
                .reshape((b, n * st, c, h * s, w * s))
        })
    }
}

/// `MochiDecoder3D`.
#[derive(Debug, Clone)]
struct Decoder {
    conv_in: Linear,
    block_in: Vec<ResnetBlock>,
    up_blocks: Vec<UpBlock>,
    block_out: Vec<ResnetBlock>,
    proj_out: Linear,
}

impl Decoder {
    fn new(cfg: &MochiVaeConfig, vb: VarBuilder) -> Result<Self> {
        let ch = &cfg.decoder_block_out_channels;
        let layers = &cfg.layers_per_block;
        let n = ch.len();
        let top = ch[n - 1];
        let conv_in = Linear::new(
            vb.get((top, cfg.latent_channels, 1, 1, 1), "conv_in.weight")?
                .reshape((top, cfg.latent_channels))?,
            Some(vb.get(top, "conv_in.bias")?),
        );
        let up_blocks = (0..n - 1)
            .map(|i| {
                let ub = vb.pp(format!("up_blocks.{i}"));
                let (c_in, c_out) = (ch[n - 1 - i], ch[n - 2 - i]);
                let (st, s) = (
                    cfg.temporal_expansions[n - 2 - i],
                    cfg.spatial_expansions[n - 2 - i],
                );
                Ok(UpBlock {
                    resnets: resnets(c_in, layers[n - 1 - i], ub.clone())?,
                    proj: candle_nn::linear(c_in, c_out * st * s * s, ub.pp("proj"))?,
                    out_channels: c_out,
                    temporal: st,
                    spatial: s,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            conv_in,
            block_in: resnets(top, layers[n], vb.pp("block_in"))?,
            up_blocks,
            block_out: resnets(ch[0], layers[0], vb.pp("block_out"))?,
            proj_out: candle_nn::linear(ch[0], cfg.out_channels, vb.pp("proj_out"))?,
        })
    }

    /// `z` `[B, T, C, H, W]` -> `[B, T', out, H', W']`.
    fn forward(&self, z: &Tensor) -> Result<Tensor> {
        let x = per_position(&self.conv_in, z)?;
        let x = run(&self.block_in, x)?;
        let x = self.up_blocks.iter().try_fold(x, |x, up| up.forward(x))?;
        let x = run(&self.block_out, x)?;
        let (b, _, _, h, w) = x.dims5()?;
        let out = self.proj_out.weight().dim(0)?;
        by_frames(&x, 1, b * out * h * w, |first, n| {
            let x = candle_nn::ops::silu(&x.narrow(1, first, n)?)?;
            per_position(&self.proj_out, &x)
        })
    }
}

/// The diffusers `AutoencoderKLMochi`, its decoder.
#[derive(Debug, Clone)]
pub struct AutoencoderKLMochi {
    cfg: MochiVaeConfig,
    decoder: Decoder,
    dtype: DType,
    /// How [`Self::decode`] tiles; `None` decodes whole (diffusers' default).
    tiling: Option<SampleTiles>,
}

/// diffusers' `enable_tiling()` tiles: 256 pixels every 192.
pub const DEFAULT_TILING: SampleTiles = SampleTiles::square(256, 192);

impl AutoencoderKLMochi {
    /// Loads the decoder from a `vae/` checkpoint, in the `VarBuilder`'s dtype (text-to-video
    /// never encodes).
    pub fn new(cfg: &MochiVaeConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            cfg: cfg.clone(),
            decoder: Decoder::new(cfg, vb.pp("decoder"))?,
            dtype: vb.dtype(),
            tiling: None,
        })
    }

    /// This VAE decoding in `tiling`'s tiles (diffusers' `tiled_decode`; whole with `None`),
    /// checked against the spatial compression.
    pub fn with_tiling(&self, tiling: Option<SampleTiles>) -> Result<Self> {
        if let Some(tiles) = &tiling {
            tiles.validate(self.cfg.spatial_compression_ratio())?;
        }
        Ok(Self {
            tiling,
            ..self.clone()
        })
    }

    /// The configuration the VAE was built with.
    pub fn config(&self) -> &MochiVaeConfig {
        &self.cfg
    }

    /// `MochiPipeline`'s de-normalisation: `z · latents_std / scaling_factor + latents_mean`
    /// per channel of `[B, C, F, H, W]`, in `z`'s dtype.
    pub fn denormalize(&self, z: &Tensor) -> Result<Tensor> {
        let c = self.cfg.latent_channels;
        let per_channel = |values: &[f64]| {
            let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
            Tensor::from_vec(v, (1, c, 1, 1, 1), z.device())?.to_dtype(z.dtype())
        };
        z.broadcast_mul(&per_channel(&self.cfg.latents_std)?)?
            .affine(1.0 / self.cfg.scaling_factor, 0.0)?
            .broadcast_add(&per_channel(&self.cfg.latents_mean)?)
    }

    /// Decodes de-normalised latents `[B, C, F, H, W]` to video `[B, out, T, H·s, W·s]` (not
    /// clamped), `T` = [`MochiVaeConfig::decoded_frames`]; in tiles where
    /// [`Self::with_tiling`] set them and the latents exceed one.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        let ratio = self.cfg.spatial_compression_ratio();
        match self.tiling {
            Some(tiles) if tiles.splits((z.dim(3)?, z.dim(4)?), ratio) => {
                tiles.decode(z, ratio, |tile| self.decode_whole(tile))
            }
            _ => self.decode_whole(z),
        }
    }

    /// One decoder call on `z`, untiled (the first frames dropped, as diffusers'
    /// `drop_last_temporal_frames`).
    fn decode_whole(&self, z: &Tensor) -> Result<Tensor> {
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
        let z = z.to_dtype(self.dtype)?.permute((0, 2, 1, 3, 4))?;
        let video = self.decoder.forward(&z)?;
        let t = video.dim(1)?;
        let keep = self.cfg.decoded_frames(frames);
        video.narrow(1, t - keep, keep)?.permute((0, 2, 1, 3, 4))
    }
}

crate::placed_whole!(AutoencoderKLMochi, MochiVaeConfig, AutoencoderKLMochi::new);

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A per-frame op that doubles the frames, over runs of one or two input frames, gives
    /// exactly what it gives over all frames at once.
    #[test]
    fn per_frame_ops_in_runs_of_frames_are_the_whole_op() -> Result<()> {
        let x = Tensor::randn(0f32, 1.0, (1, 5, 2, 3, 4), &Device::Cpu)?;
        let double = |first: usize, n: usize| -> Result<Tensor> {
            let part = x.narrow(1, first, n)?;
            Tensor::cat(&[&part, &(&part * 2.0)?], 2)?.reshape((1, 2 * n, 2, 3, 4))
        };
        let frame = 2 * 3 * 4;
        let whole = by_frames_within(&x, 2, frame, usize::MAX, double)?;
        for budget in [1, 2 * frame, 4 * frame] {
            let runs = by_frames_within(&x, 2, frame, budget, double)?;
            let diff = (&runs - &whole)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "runs within {budget} elements");
        }
        assert_eq!(whole.dims(), &[1, 10, 2, 3, 4]);
        Ok(())
    }
}
