//! The layers of diffusers' 2-D `Encoder` / `Decoder` (autoencoders/vae.py) in the SD layout:
//! `ResnetBlock2D` without time embedding, `UNetMidBlock2D` with its one-head attention,
//! `DownEncoderBlock2D` / `UpDecoderBlock2D` and their resamplers. Tensors are `[B, C, H, W]`.

use crate::models::runs::RunGroupNorm;
use candle_core::{Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};

use super::AutoencoderKLConfig;
use crate::models::attention::sdpa;
use crate::models::conv3d;

/// Epsilon of every GroupNorm of the encoder and decoder (diffusers passes `resnet_eps=1e-6`
/// and `eps=1e-6` to `conv_norm_out` whatever the config says).
const NORM_EPS: f64 = 1e-6;

/// `nn.Conv2d` with bias (square kernel, zero padding). On CUDA a stride-1 convolution runs
/// channels last over the images as one video's frames
/// ([`conv3d::images_conv_channels_last`]: an upsampler's input and a resnet's residual read in
/// the same passes); others through the 3D convolution (cuDNN or vidgen's kernel, one temporal
/// tap) where it computes; else candle's conv2d.
#[derive(Debug, Clone)]
pub(crate) struct Conv2d {
    weight: Tensor,
    bias: Tensor,
    stride: usize,
    padding: usize,
}

impl Conv2d {
    pub(crate) fn new(
        cin: usize,
        cout: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            weight: vb.get((cout, cin, kernel, kernel), "weight")?,
            bias: vb.get(cout, "bias")?.reshape((1, cout, 1, 1))?,
            stride,
            padding,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, 1, None)
    }

    /// The convolution of `x` `[B, C, H, W]` upsampled `up` times (nearest, as
    /// `F.interpolate(scale_factor=up)`), plus `residual` (of the output's shape) where given.
    fn forward_with(&self, x: &Tensor, up: usize, residual: Option<&Tensor>) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.stride == 1 {
            let conv = (&self.weight, self.padding, up);
            let channels_last = || conv3d::images_conv_channels_last(x, conv, &self.bias, residual);
            if let Some(y) = conv3d::or_fallback(channels_last) {
                return Ok(y);
            }
        }
        let upsampled;
        let x = match up {
            1 => x,
            _ => {
                let (_, _, h, w) = x.dims4()?;
                upsampled = x.contiguous()?.upsample_nearest2d(up * h, up * w)?;
                &upsampled
            }
        };
        let y = self.composed(x)?;
        match residual {
            Some(r) => r + y,
            None => Ok(y),
        }
    }

    /// The convolution and then its bias, each its own pass.
    fn composed(&self, x: &Tensor) -> Result<Tensor> {
        if conv3d::accelerated(x.device()) {
            let whole = || -> Result<Option<Tensor>> {
                let (s, p) = (self.stride, self.padding);
                match conv3d::conv3d(
                    &x.unsqueeze(2)?,
                    &self.weight.unsqueeze(2)?,
                    [1, s, s],
                    [0, p, p],
                )? {
                    Some(y) => Ok(Some(conv3d::add_channel_bias(y, &self.bias)?.squeeze(2)?)),
                    None => Ok(None),
                }
            };
            if let Some(y) = conv3d::or_fallback(whole) {
                return Ok(y);
            }
        }
        x.contiguous()?
            .conv2d(&self.weight, self.padding, self.stride, 1, 1)?
            .broadcast_add(&self.bias)
    }
}

/// diffusers' `ResnetBlock2D` with `temb_channels=None`, `time_embedding_norm="default"`,
/// output scale 1: `x + conv2(silu(norm2(conv1(silu(norm1(x))))))`, the skip through a 1x1
/// `conv_shortcut` when the channel count changes.
#[derive(Debug, Clone)]
pub(crate) struct ResnetBlock2D {
    norm1: RunGroupNorm,
    conv1: Conv2d,
    norm2: RunGroupNorm,
    conv2: Conv2d,
    shortcut: Option<Conv2d>,
}

impl ResnetBlock2D {
    pub(crate) fn new(cin: usize, cout: usize, groups: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            norm1: RunGroupNorm::new(groups, cin, NORM_EPS, vb.pp("norm1"))?,
            conv1: Conv2d::new(cin, cout, 3, 1, 1, vb.pp("conv1"))?,
            norm2: RunGroupNorm::new(groups, cout, NORM_EPS, vb.pp("norm2"))?,
            conv2: Conv2d::new(cout, cout, 3, 1, 1, vb.pp("conv2"))?,
            shortcut: if cin != cout {
                Some(Conv2d::new(cin, cout, 1, 1, 0, vb.pp("conv_shortcut"))?)
            } else {
                None
            },
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // Each intermediate dropped as the next exists (a shadowed binding lives to the end).
        let h = self
            .conv1
            .forward(&self.norm1.forward_then(x, None, true)?)?;
        let normed = self.norm2.forward_then(&h, None, true)?;
        drop(h);
        let skip = match &self.shortcut {
            Some(conv) => conv.forward(x)?,
            None => x.clone(),
        };
        self.conv2.forward_with(&normed, 1, Some(&skip))
    }
}

/// The mid block's `Attention` (`_from_deprecated_attn_block`): GroupNorm, one head over every
/// position with head_dim = channels, biased projections, residual. Weights are read under
/// diffusers' names (`to_q`, `to_k`, `to_v`, `to_out.0`) or the deprecated ones of older
/// checkpoints (`query`, `key`, `value`, `proj_attn`), which diffusers converts on load.
#[derive(Debug, Clone)]
pub(crate) struct MidAttention {
    group_norm: RunGroupNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
}

impl MidAttention {
    pub(crate) fn new(channels: usize, groups: usize, vb: VarBuilder) -> Result<Self> {
        let deprecated = !vb.contains_tensor("to_q.weight") && vb.contains_tensor("query.weight");
        let names = if deprecated {
            ["query", "key", "value", "proj_attn"]
        } else {
            ["to_q", "to_k", "to_v", "to_out.0"]
        };
        let linear = |name: &str| candle_nn::linear(channels, channels, vb.pp(name));
        Ok(Self {
            group_norm: RunGroupNorm::new(groups, channels, NORM_EPS, vb.pp("group_norm"))?,
            to_q: linear(names[0])?,
            to_k: linear(names[1])?,
            to_v: linear(names[2])?,
            to_out: linear(names[3])?,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        let tokens = self
            .group_norm
            .forward(x)?
            .reshape((b, c, h * w))?
            .transpose(1, 2)?
            .contiguous()?;
        let head = |l: &Linear| -> Result<Tensor> { l.forward(&tokens)?.unsqueeze(1) };
        let (q, k, v) = (head(&self.to_q)?, head(&self.to_k)?, head(&self.to_v)?);
        drop(tokens);
        let out = sdpa(&q, &k, &v, 1.0 / (c as f64).sqrt())?.squeeze(1)?;
        let out = self
            .to_out
            .forward(&out)?
            .transpose(1, 2)?
            .reshape((b, c, h, w))?;
        out + x
    }
}

/// diffusers' `UNetMidBlock2D` (one layer, no time embedding): resnet, attention (unless
/// `mid_block_add_attention` is false), resnet.
#[derive(Debug, Clone)]
pub(crate) struct MidBlock2D {
    resnet0: ResnetBlock2D,
    attention: Option<MidAttention>,
    resnet1: ResnetBlock2D,
}

impl MidBlock2D {
    pub(crate) fn new(cfg: &AutoencoderKLConfig, channels: usize, vb: VarBuilder) -> Result<Self> {
        let groups = cfg.norm_num_groups;
        Ok(Self {
            resnet0: ResnetBlock2D::new(channels, channels, groups, vb.pp("resnets.0"))?,
            attention: if cfg.mid_block_add_attention {
                Some(MidAttention::new(channels, groups, vb.pp("attentions.0"))?)
            } else {
                None
            },
            resnet1: ResnetBlock2D::new(channels, channels, groups, vb.pp("resnets.1"))?,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.resnet0.forward(x)?;
        if let Some(attention) = &self.attention {
            h = attention.forward(&h)?;
        }
        self.resnet1.forward(&h)
    }
}

/// diffusers' `Downsample2D` with `use_conv` and `padding=0`: zero padding right and bottom,
/// then a stride-2 3x3 conv.
#[derive(Debug, Clone)]
struct Downsample2D {
    conv: Conv2d,
}

impl Downsample2D {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.pad_with_zeros(2, 0, 1)?.pad_with_zeros(3, 0, 1)?;
        self.conv.forward(&x)
    }
}

/// diffusers' `Upsample2D` with `use_conv`: nearest 2x, then a 3x3 conv.
#[derive(Debug, Clone)]
pub(crate) struct Upsample2D {
    conv: Conv2d,
}

impl Upsample2D {
    /// The upsampler under `vb` (`upsamplers.0`) on `channels` channels.
    pub(crate) fn new(channels: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            conv: Conv2d::new(channels, channels, 3, 1, 1, vb.pp("conv"))?,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.conv.forward_with(x, 2, None)
    }
}

/// diffusers' `Encoder` (`double_z`): `[B, in, H, W]` -> `[B, 2 · latent, H/f, W/f]`.
#[derive(Debug, Clone)]
pub(crate) struct Encoder {
    conv_in: Conv2d,
    down_blocks: Vec<(Vec<ResnetBlock2D>, Option<Downsample2D>)>,
    mid_block: MidBlock2D,
    conv_norm_out: RunGroupNorm,
    conv_out: Conv2d,
}

impl Encoder {
    pub(crate) fn new(cfg: &AutoencoderKLConfig, vb: VarBuilder) -> Result<Self> {
        let channels = &cfg.block_out_channels;
        let groups = cfg.norm_num_groups;
        let mut down_blocks = Vec::with_capacity(channels.len());
        let mut prev = channels[0];
        for (i, &out) in channels.iter().enumerate() {
            let bvb = vb.pp(format!("down_blocks.{i}"));
            let resnets = (0..cfg.layers_per_block)
                .map(|j| {
                    let cin = if j == 0 { prev } else { out };
                    ResnetBlock2D::new(cin, out, groups, bvb.pp(format!("resnets.{j}")))
                })
                .collect::<Result<Vec<_>>>()?;
            let down = if i + 1 < channels.len() {
                Some(Downsample2D {
                    conv: Conv2d::new(out, out, 3, 2, 0, bvb.pp("downsamplers.0.conv"))?,
                })
            } else {
                None
            };
            down_blocks.push((resnets, down));
            prev = out;
        }
        let last = channels[channels.len() - 1];
        Ok(Self {
            conv_in: Conv2d::new(cfg.in_channels, channels[0], 3, 1, 1, vb.pp("conv_in"))?,
            down_blocks,
            mid_block: MidBlock2D::new(cfg, last, vb.pp("mid_block"))?,
            conv_norm_out: RunGroupNorm::new(groups, last, NORM_EPS, vb.pp("conv_norm_out"))?,
            conv_out: Conv2d::new(last, 2 * cfg.latent_channels, 3, 1, 1, vb.pp("conv_out"))?,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.conv_in.forward(x)?;
        for (resnets, down) in &self.down_blocks {
            for resnet in resnets {
                h = resnet.forward(&h)?;
            }
            if let Some(down) = down {
                h = down.forward(&h)?;
            }
        }
        h = self.mid_block.forward(&h)?;
        let h = self.conv_norm_out.forward_then(&h, None, true)?;
        self.conv_out.forward(&h)
    }
}

/// One `UpDecoderBlock2D`: `layers_per_block + 1` resnets, then the upsampler (all but the
/// last block).
#[derive(Debug, Clone)]
struct UpBlock {
    resnets: Vec<ResnetBlock2D>,
    upsampler: Option<Upsample2D>,
}

/// diffusers' `Decoder`: `[B, latent, h, w]` -> `[B, out, h·f, w·f]`.
#[derive(Debug, Clone)]
pub(crate) struct Decoder {
    conv_in: Conv2d,
    mid_block: MidBlock2D,
    up_blocks: Vec<UpBlock>,
    conv_norm_out: RunGroupNorm,
    conv_out: Conv2d,
}

impl Decoder {
    pub(crate) fn new(cfg: &AutoencoderKLConfig, vb: VarBuilder) -> Result<Self> {
        let channels: Vec<usize> = cfg.block_out_channels.iter().rev().copied().collect();
        let groups = cfg.norm_num_groups;
        let top = channels[0];
        let mut up_blocks = Vec::with_capacity(channels.len());
        let mut prev = top;
        for (i, &out) in channels.iter().enumerate() {
            let bvb = vb.pp(format!("up_blocks.{i}"));
            let resnets = (0..=cfg.layers_per_block)
                .map(|j| {
                    let cin = if j == 0 { prev } else { out };
                    ResnetBlock2D::new(cin, out, groups, bvb.pp(format!("resnets.{j}")))
                })
                .collect::<Result<Vec<_>>>()?;
            let upsampler = if i + 1 < channels.len() {
                Some(Upsample2D::new(out, bvb.pp("upsamplers.0"))?)
            } else {
                None
            };
            up_blocks.push(UpBlock { resnets, upsampler });
            prev = out;
        }
        let last = channels[channels.len() - 1];
        Ok(Self {
            conv_in: Conv2d::new(cfg.latent_channels, top, 3, 1, 1, vb.pp("conv_in"))?,
            mid_block: MidBlock2D::new(cfg, top, vb.pp("mid_block"))?,
            up_blocks,
            conv_norm_out: RunGroupNorm::new(groups, last, NORM_EPS, vb.pp("conv_norm_out"))?,
            conv_out: Conv2d::new(last, cfg.out_channels, 3, 1, 1, vb.pp("conv_out"))?,
        })
    }

    pub(crate) fn forward(&self, z: &Tensor) -> Result<Tensor> {
        let mut h = self.conv_in.forward(z)?;
        h = self.mid_block.forward(&h)?;
        for block in &self.up_blocks {
            for resnet in &block.resnets {
                h = resnet.forward(&h)?;
            }
            if let Some(up) = &block.upsampler {
                h = up.forward(&h)?;
            }
        }
        let h = self.conv_norm_out.forward_then(&h, None, true)?;
        self.conv_out.forward(&h)
    }
}
