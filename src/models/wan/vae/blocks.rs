//! Layers of the Wan2.1 VAE (diffusers' `AutoencoderKLWan`), working on chunks of frames.
//!
//! Activations are `[batch, channels, frames, height, width]` as in diffusers, or channels last,
//! `[batch, frames, height, width, channels]` (each layer's [`Layout`]), where a channels-last
//! convolution computes: the decoder on CUDA, where cuDNN's and vidgen's tensor-core kernels
//! read that layout without transposing. Every causal conv keeps the last two input frames of
//! the previous chunk in a [`FeatCache`] slot, exactly like diffusers' `feat_cache`, which
//! bounds the memory of a decode by one latent frame.
//!
//! On CUDA the convolution's input is built in place: one buffer holding the zero padding or
//! cached frames, then the chunk, written by the fused channel-RMS-norm + SiLU kernel where a
//! norm precedes the conv (`vae_ops::vae_rms_silu_into`), so neither the norm's
//! intermediate tensors nor a concatenation are ever stored.

use candle_core::{bail, DType, Result, Tensor};
use candle_nn::VarBuilder;

use crate::models::attention::sdpa;
use crate::models::conv3d::{self, Kernel3d, Layout};

/// Frames of context a causal conv keeps between chunks (diffusers' `CACHE_T`).
pub(crate) const CACHE_T: usize = 2;

/// Largest im2col scratch (elements) one conv2d call may build: candle's CUDA conv2d is
/// im2col + matmul, whose scratch is `C_in * k * k` times the output image (1.4 GB in f32 for
/// one 96-channel 480x832 frame). Larger convolutions are split into row bands.
pub(crate) const MAX_IM2COL_ELEMENTS: usize = 1 << 26;

/// State of one cache slot, as diffusers' `feat_cache[idx]` (`None`, `"Rep"` or a tensor).
enum Slot {
    Empty,
    /// An `upsample3d` that has seen its first chunk, which it passed through un-doubled.
    Rep,
    /// The last (up to two) input frames of the previous chunk, `[B, C, t, H, W]`.
    Frames(Tensor),
}

/// Per-call temporal cache: one slot per causal conv (and per 3D resample), visited in order.
#[derive(Default)]
pub(super) struct FeatCache {
    slots: Vec<Slot>,
    idx: usize,
}

impl FeatCache {
    /// Rewinds to the first slot; called before every chunk (diffusers' `feat_idx = [0]`).
    pub(super) fn start_chunk(&mut self) {
        self.idx = 0;
    }

    fn next_slot(&mut self) -> &mut Slot {
        if self.idx == self.slots.len() {
            self.slots.push(Slot::Empty);
        }
        self.idx += 1;
        &mut self.slots[self.idx - 1]
    }
}

/// Frame `t` of `[B, C, T, H, W]`, as a contiguous `[B, C, H, W]`.
fn frame(x: &Tensor, t: usize) -> Result<Tensor> {
    x.narrow(2, t, 1)?.squeeze(2)?.contiguous()
}

/// The last `min(n, T)` frames of `x` (in `layout`), copied so the cache does not keep the
/// whole chunk alive.
fn last_frames(x: &Tensor, n: usize, layout: Layout) -> Result<Tensor> {
    let time = layout.time_dim();
    let t = x.dim(time)?;
    let keep = n.min(t);
    x.narrow(time, t - keep, keep)?.force_contiguous()
}

/// SiLU evaluated in f32 and rounded once, as torch does for half-precision inputs.
pub(super) fn silu(x: &Tensor) -> Result<Tensor> {
    if x.dtype() == DType::F32 {
        x.silu()
    } else {
        x.to_dtype(DType::F32)?.silu()?.to_dtype(x.dtype())
    }
}

/// conv2d (no bias) whose im2col scratch stays below [`MAX_IM2COL_ELEMENTS`].
pub(super) fn conv2d_lean(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    conv2d_banded(x, w, padding, stride, MAX_IM2COL_ELEMENTS)
}

/// conv2d split over images and then over output-row bands so that no call's im2col exceeds
/// `limit` elements. Every output element is computed by the same dot product as unsplit.
fn conv2d_banded(
    x: &Tensor,
    w: &Tensor,
    padding: usize,
    stride: usize,
    limit: usize,
) -> Result<Tensor> {
    let (n, c, h, wd) = x.dims4()?;
    let (_, _, kh, kw) = w.dims4()?;
    if h + 2 * padding < kh || wd + 2 * padding < kw || stride == 0 {
        bail!("conv2d: a {h}x{wd} input (padding {padding}) is smaller than the {kh}x{kw} kernel")
    }
    let h_out = (h + 2 * padding - kh) / stride + 1;
    let w_out = (wd + 2 * padding - kw) / stride + 1;
    let per_row = w_out * c * kh * kw;
    if n * h_out * per_row <= limit {
        return x.conv2d(w, padding, stride, 1, 1);
    }
    let xp = if padding > 0 {
        x.pad_with_zeros(2, padding, padding)?
            .pad_with_zeros(3, padding, padding)?
    } else {
        x.clone()
    };
    let images_per_call = limit / (h_out * per_row);
    let mut outs = Vec::new();
    if images_per_call >= 1 {
        let mut n0 = 0;
        while n0 < n {
            let len = images_per_call.min(n - n0);
            outs.push(xp.narrow(0, n0, len)?.conv2d(w, 0, stride, 1, 1)?);
            n0 += len;
        }
        return Tensor::cat(&outs, 0);
    }
    let rows_per_call = (limit / per_row).max(1);
    for i in 0..n {
        let image = xp.narrow(0, i, 1)?;
        let mut bands = Vec::with_capacity(h_out.div_ceil(rows_per_call));
        let mut r0 = 0;
        while r0 < h_out {
            let rows = rows_per_call.min(h_out - r0);
            let band = image.narrow(2, r0 * stride, (rows - 1) * stride + kh)?;
            bands.push(band.conv2d(w, 0, stride, 1, 1)?);
            r0 += rows;
        }
        outs.push(Tensor::cat(&bands, 2)?);
    }
    Tensor::cat(&outs, 0)
}

/// A 2D convolution with bias (`nn.Conv2d`), memory-lean on large images.
struct Conv2d {
    weight: Tensor,
    bias: Tensor,
    padding: usize,
    stride: usize,
}

impl Conv2d {
    fn new(
        cin: usize,
        cout: usize,
        k: usize,
        padding: usize,
        stride: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        let weight = vb.get((cout, cin, k, k), "weight")?;
        let bias = vb.get(cout, "bias")?;
        Ok(Self {
            weight,
            bias,
            padding,
            stride,
        })
    }

    /// Every frame of `[B, C, T, H, W]` -> `[B, C_out, T, H', W']`: one 3D convolution with a
    /// single-frame kernel through cuDNN where it is loaded, else frame by frame.
    fn forward_frames(&self, x: &Tensor) -> Result<Tensor> {
        if conv3d::accelerated(x.device()) {
            let (s, p) = (self.stride, self.padding);
            let whole = || -> Result<Option<Tensor>> {
                let w = self.weight.unsqueeze(2)?;
                match conv3d::conv3d(x, &w, [1, s, s], [0, p, p])? {
                    Some(y) => Ok(Some(add_bias(y, &self.bias, None, Layout::ChannelsFirst)?)),
                    None => Ok(None),
                }
            };
            if let Some(y) = conv3d::or_fallback(whole) {
                return Ok(y);
            }
        }
        map_frames(x, |f| self.forward(f))
    }

    /// A 1x1 conv of rows of channels, `[..., C]` -> `[..., C_out]` (channels last, so on CUDA
    /// with cuDNN): one channels-last convolution (TF32 where allowed, as the channels-first
    /// path), plus the bias.
    fn pixels(&self, x: &Tensor) -> Result<Tensor> {
        let (c_out, c_in, _, _) = self.weight.dims4()?;
        let rows = x.elem_count() / c_in;
        let x5 = x.contiguous()?.reshape((1, 1, rows, 1, c_in))?;
        let w5 = self.weight.reshape((c_out, 1, 1, 1, c_in))?;
        let last = Layout::ChannelsLast;
        let Some(y) = conv3d::conv3d_in(last, &x5, &w5, [1, 1, 1], [0, 0, 0])? else {
            bail!("vae attention: no convolution computes channels last here")
        };
        let mut dims = x.dims().to_vec();
        if let Some(d) = dims.last_mut() {
            *d = c_out;
        }
        add_bias(y.reshape(dims)?, &self.bias, None, last)
    }

    /// `[N, C, H, W]` -> `[N, C_out, H', W']`: through cuDNN (as a 3D convolution of one frame
    /// per image) where it is loaded, else memory-lean im2col.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if conv3d::accelerated(x.device()) {
            let (s, p) = (self.stride, self.padding);
            let whole = || -> Result<Option<Tensor>> {
                let w = self.weight.unsqueeze(2)?;
                match conv3d::conv3d(&x.unsqueeze(2)?, &w, [1, s, s], [0, p, p])? {
                    Some(y) => Ok(Some(
                        add_bias(y, &self.bias, None, Layout::ChannelsFirst)?.squeeze(2)?,
                    )),
                    None => Ok(None),
                }
            };
            if let Some(y) = conv3d::or_fallback(whole) {
                return Ok(y);
            }
        }
        add_bias(
            conv2d_lean(x, &self.weight, self.padding, self.stride)?,
            &self.bias,
            None,
            Layout::ChannelsFirst,
        )
    }
}

/// `y + bias` per channel of `y` (`[N, C, ...]` channels first, `[..., C]` channels last), then
/// `+ residual` when given: in place through the fused kernel where it takes `y` (f32 on CUDA),
/// else candle's adds.
fn add_bias(y: Tensor, bias: &Tensor, residual: Option<&Tensor>, layout: Layout) -> Result<Tensor> {
    let channel_dim = layout.channel_dim(y.rank());
    #[cfg(feature = "cuda")]
    if crate::models::wan::vae_ops::vae_supported(&y) {
        return crate::models::wan::vae_ops::vae_bias_add(y, bias, residual, channel_dim);
    }
    let shape: Vec<usize> = (0..y.rank())
        .map(|d| {
            if d == channel_dim {
                bias.elem_count()
            } else {
                1
            }
        })
        .collect();
    let y = y.broadcast_add(&bias.reshape(shape)?)?;
    match residual {
        Some(r) => y + r,
        None => Ok(y),
    }
}

/// diffusers' `WanCausalConv3d`: zero padding of `2 * pad_t` frames in front (or the cached
/// frames of the previous chunk instead), none behind; symmetric spatial padding. One 3D
/// convolution through cuDNN where it is loaded ([`conv3d`]); otherwise computed one output
/// frame at a time as a sum over the temporal taps of 2D convolutions.
pub(super) struct CausalConv3d {
    /// The kernel in `layout`'s order (`[C_out, kt, kh, kw, C_in]` when channels last).
    kernel: Kernel3d,
    /// `[C_out]`.
    bias: Tensor,
    front_pad: usize,
    pad_s: usize,
    stride_t: usize,
    layout: Layout,
    /// Returns its output without the bias, which its reader (the next norm) adds.
    defers_bias: bool,
}

impl CausalConv3d {
    /// A conv with a cubic `k` kernel and padding `pad` in every dimension.
    pub(super) fn cube(
        cin: usize,
        cout: usize,
        k: usize,
        pad: usize,
        layout: Layout,
        vb: VarBuilder,
    ) -> Result<Self> {
        Self::new(cin, cout, (k, k, k), 1, (pad, pad), layout, vb)
    }

    /// `kernel` = (t, h, w) with h == w, `pad` = (temporal, spatial).
    fn new(
        cin: usize,
        cout: usize,
        kernel: (usize, usize, usize),
        stride_t: usize,
        pad: (usize, usize),
        layout: Layout,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (kt, kh, kw) = kernel;
        let weight = vb.get((cout, cin, kt, kh, kw), "weight")?;
        let bias = vb.get(cout, "bias")?;
        let weight = match layout {
            Layout::ChannelsFirst => weight,
            Layout::ChannelsLast => layout.from_channels_first(&weight)?,
        };
        Ok(Self {
            kernel: Kernel3d::new(weight)?,
            bias,
            front_pad: 2 * pad.0,
            pad_s: pad.1,
            stride_t,
            layout,
            defers_bias: false,
        })
    }

    /// This conv's output without its bias (see [`Self::bias`]): for a conv whose only reader
    /// adds the bias as it reads (a norm, or the temporal upsampler's frame interleaving): one
    /// pass less over the output.
    fn deferring_bias(self) -> Self {
        Self {
            defers_bias: true,
            ..self
        }
    }

    /// `[C_out]`.
    fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// `y` plus the bias unless deferred, plus `residual` when given.
    fn finish(&self, y: Tensor, residual: Option<&Tensor>, layout: Layout) -> Result<Tensor> {
        match (self.defers_bias, residual) {
            (false, _) => add_bias(y, &self.bias, residual, layout),
            (true, None) => Ok(y),
            (true, Some(r)) => y + r,
        }
    }

    /// Zero frames and cached frames in front of a chunk, given the cache (ignored by a conv
    /// without temporal padding).
    fn front<'a>(&self, cache: Option<&'a Tensor>) -> Result<(usize, Option<&'a Tensor>)> {
        let cache = cache.filter(|_| self.front_pad > 0);
        let cached = match cache {
            Some(c) => c.dim(self.layout.time_dim())?,
            None => 0,
        };
        Ok((self.front_pad.saturating_sub(cached), cache))
    }

    /// The whole-kernel path where it runs: channels last always (its errors are the caller's:
    /// there is no other path in that layout), channels first where [`conv3d`] computes, with
    /// any error noted and `None` (the tap sum runs instead).
    fn whole<T>(&self, f: impl FnOnce() -> Result<Option<T>>) -> Result<Option<T>> {
        match self.layout {
            Layout::ChannelsLast => match f()? {
                Some(y) => Ok(Some(y)),
                None => bail!("causal conv3d: no convolution computes channels last here"),
            },
            Layout::ChannelsFirst if self.kernel.whole().is_some() => Ok(conv3d::or_fallback(f)),
            Layout::ChannelsFirst => Ok(None),
        }
    }

    /// `x`: `[B, C, T, H, W]` (in the conv's layout); `cache`: frames that precede `x`
    /// (replacing front zero padding).
    pub(super) fn forward(&self, x: &Tensor, cache: Option<&Tensor>) -> Result<Tensor> {
        let (zeros, cache) = self.front(cache)?;
        let dims = self.layout.dims(x)?;
        let whole = || self.forward_whole(dims, zeros, cache, Input::Copy(x), None);
        if let Some((y, _)) = self.whole(whole)? {
            return Ok(y);
        }
        self.forward_taps(x, zeros, cache)
    }

    /// The tap-sum path (channels first): every output frame a sum of 2D convolutions of input
    /// frames.
    fn forward_taps(&self, x: &Tensor, zeros: usize, cache: Option<&Tensor>) -> Result<Tensor> {
        let t_in = x.dim(2)?;
        let cached = match cache {
            Some(c) => c.dim(2)?,
            None => 0,
        };
        let t_full = zeros + cached + t_in;
        let kt = self.kernel.kt()?;
        if t_full < kt {
            bail!("causal conv3d: {t_full} frames (with padding) for a temporal kernel of {kt}")
        }
        let t_out = (t_full - kt) / self.stride_t + 1;
        let taps = self.kernel.taps()?;
        let mut outs = Vec::with_capacity(t_out);
        for o in 0..t_out {
            let mut acc: Option<Tensor> = None;
            for (k, tap) in taps.iter().enumerate() {
                let i = o * self.stride_t + k;
                // A zero padding frame contributes exactly nothing.
                let input = if i < zeros {
                    continue;
                } else if i < zeros + cached {
                    match cache {
                        Some(c) => frame(c, i - zeros)?,
                        None => continue,
                    }
                } else {
                    frame(x, i - zeros - cached)?
                };
                let y = conv2d_lean(&input, tap, self.pad_s, 1)?;
                acc = Some(match acc {
                    Some(a) => (a + y)?,
                    None => y,
                });
            }
            let y = match acc {
                Some(a) => self.finish(a, None, Layout::ChannelsFirst)?,
                None => bail!("causal conv3d: output frame {o} sees only padding"),
            };
            outs.push(y);
        }
        Tensor::stack(&outs, 2)
    }

    /// The conv as one 3D convolution over one buffer of `zeros + cached + T` frames (`dims`
    /// those of the chunk, `(b, c, t, h, w)`) holding the padding, the cached frames and the
    /// chunk's `input`; returns the output and the buffer, or `None` where [`conv3d`] does not
    /// run it.
    fn forward_whole(
        &self,
        dims: (usize, usize, usize, usize, usize),
        zeros: usize,
        cache: Option<&Tensor>,
        input: Input,
        residual: Option<&Tensor>,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let layout = self.layout;
        // Channels last computes on any device ([`conv3d::conv3d_in`]).
        let w = match (layout, self.kernel.whole()) {
            (Layout::ChannelsLast, _) => self.kernel.weight(),
            (Layout::ChannelsFirst, Some(w)) => w,
            (Layout::ChannelsFirst, None) => return Ok(None),
        };
        let time = layout.time_dim();
        let (b, c, t, h, wd) = dims;
        let cached = match cache {
            Some(p) => p.dim(time)?,
            None => 0,
        };
        let front = zeros + cached;
        let (dtype, device) = (w.dtype(), w.device());
        let buf = if front == 0 {
            None
        } else if zeros > 0 {
            Some(Tensor::zeros(
                &layout.shape(b, c, front + t, h, wd)[..],
                dtype,
                device,
            )?)
        } else {
            // SAFETY: every frame is written below (the cache, then the chunk).
            let shape = layout.shape(b, c, front + t, h, wd);
            Some(unsafe { Tensor::empty(&shape[..], dtype, device) }?)
        };
        if let (Some(buf), Some(p)) = (&buf, cache) {
            buf.slice_set(&p.contiguous()?, time, zeros)?;
        }
        let buf = match (buf, input) {
            (None, Input::Copy(x)) => x.clone(),
            (Some(buf), Input::Copy(x)) => {
                buf.slice_set(&x.contiguous()?, time, front)?;
                buf
            }
            (buf, Input::Normed(norm, x, in_bias)) => match buf {
                Some(buf) => {
                    norm.silu_into(x, in_bias, &buf, front)?;
                    buf
                }
                None => {
                    // SAFETY: the norm writes every element.
                    let shape = layout.shape(b, c, t, h, wd);
                    let buf = unsafe { Tensor::empty(&shape[..], dtype, device) }?;
                    norm.silu_into(x, in_bias, &buf, 0)?;
                    buf
                }
            },
        };
        let stride = [self.stride_t, 1, 1];
        let padding = [0, self.pad_s, self.pad_s];
        let bias = (!self.defers_bias).then_some(&self.bias);
        match conv3d::conv3d_in_adding(layout, &buf, w, stride, padding, bias, residual)? {
            Some((y, true)) => Ok(Some((y, buf))),
            Some((y, false)) => Ok(Some((self.finish(y, residual, layout)?, buf))),
            None => Ok(None),
        }
    }

    /// Runs the conv on one chunk with this conv's cache slot, then stores the last
    /// [`CACHE_T`] input frames (topped up with the previous chunk's last frame when the
    /// chunk is a single frame), as every cached conv of diffusers' Wan VAE does. With `norm`,
    /// the conv's input is `SiLU(norm(x + in_bias))` (fused into the input buffer where the
    /// kernel runs; `in_bias` the deferred bias of the conv that made `x`); `residual` is
    /// added to the output (with the bias where the kernel runs).
    pub(super) fn forward_cached(
        &self,
        x: &Tensor,
        norm: Option<(&ChannelNorm, Option<&Tensor>)>,
        residual: Option<&Tensor>,
        cache: &mut FeatCache,
    ) -> Result<Tensor> {
        let layout = self.layout;
        let time = layout.time_dim();
        let slot = cache.next_slot();
        let prev = match slot {
            Slot::Frames(p) => Some(p.clone()),
            _ => None,
        };
        let t = x.dim(time)?;
        // Frames kept: the last two of the input, or one of the previous chunk and this one.
        let keep = CACHE_T.min(t + usize::from(prev.is_some()));
        let (zeros, front_cache) = self.front(prev.as_ref())?;
        let input = match norm {
            Some((norm, in_bias)) => Input::Normed(norm, x, in_bias),
            None => Input::Copy(x),
        };
        let dims = layout.dims(x)?;
        let whole = || self.forward_whole(dims, zeros, front_cache, input, residual);
        if let Some((y, buf)) = self.whole(whole)? {
            // The buffer ends with the input frames, preceded by the cached ones when the
            // conv pads in time; otherwise the cache is assembled from `prev`.
            let total = buf.dim(time)?;
            let cache_x = match &prev {
                Some(p) if front_cache.is_none() && keep > t => Tensor::cat(
                    &[last_frames(p, 1, layout)?, last_frames(&buf, t, layout)?],
                    time,
                )?,
                _ => buf.narrow(time, total - keep, keep)?.force_contiguous()?,
            };
            *slot = Slot::Frames(cache_x);
            return Ok(y);
        }
        let input = match norm {
            Some((norm, None)) => silu(&norm.forward(x)?)?,
            Some((norm, Some(bias))) => {
                silu(&norm.forward(&add_bias(x.copy()?, bias, None, layout)?)?)?
            }
            None => x.clone(),
        };
        let mut cache_x = last_frames(&input, CACHE_T, layout)?;
        if cache_x.dim(2)? < CACHE_T {
            if let Some(p) = &prev {
                cache_x = Tensor::cat(&[last_frames(p, 1, layout)?, cache_x], 2)?;
            }
        }
        let y = self.forward_taps(&input, zeros, front_cache)?;
        *slot = Slot::Frames(cache_x);
        match residual {
            Some(r) => y + r,
            None => Ok(y),
        }
    }
}

/// What fills a convolution's input buffer after its front frames.
enum Input<'a> {
    /// The chunk itself.
    Copy(&'a Tensor),
    /// `SiLU(norm(x + bias))` of the chunk (`bias` a conv's deferred bias).
    Normed(&'a ChannelNorm, &'a Tensor, Option<&'a Tensor>),
}

/// diffusers' `WanRMS_norm`: `F.normalize` over channels (x / max(|x|_2, 1e-12)) * sqrt(C) * gamma,
/// the normalisation computed in f32.
pub(super) struct ChannelNorm {
    /// `[C, 1, 1]` (images) or `[C, 1, 1, 1]` (video), broadcast over dim 1; `[C]` channels
    /// last.
    gamma: Tensor,
    scale: f64,
    layout: Layout,
}

impl ChannelNorm {
    /// `images`: the 2D variant (gamma `[C, 1, 1]`, in attention) rather than the 3D one
    /// (gamma `[C, 1, 1, 1]`).
    pub(super) fn new(dim: usize, images: bool, layout: Layout, vb: VarBuilder) -> Result<Self> {
        let gamma = if images {
            vb.get((dim, 1, 1), "gamma")?
        } else {
            vb.get((dim, 1, 1, 1), "gamma")?
        };
        let gamma = match layout {
            Layout::ChannelsFirst => gamma,
            Layout::ChannelsLast => gamma.flatten_all()?,
        };
        Ok(Self {
            gamma,
            scale: (dim as f64).sqrt(),
            layout,
        })
    }

    /// Normalises over the channels: dim 1 channels first (`[N, C, H, W]` or `[B, C, T, H,
    /// W]`), the last dim channels last.
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let channels = self.layout.channel_dim(x.rank());
        let xf = x.to_dtype(DType::F32)?;
        let norm = xf.sqr()?.sum_keepdim(channels)?.sqrt()?.maximum(1e-12)?;
        let normalized = xf.broadcast_div(&norm)?;
        // torch rounds the normalised tensor to the input dtype, then scales in f32 and rounds.
        let scaled = if dtype == DType::F32 {
            (normalized * self.scale)?
        } else {
            (normalized.to_dtype(dtype)?.to_dtype(DType::F32)? * self.scale)?.to_dtype(dtype)?
        };
        scaled.broadcast_mul(&self.gamma)
    }

    /// Writes `SiLU(self.forward(x + in_bias))` of the chunk `x` (`in_bias` per channel, when
    /// given) into frames `offset..offset + T` of `buf` (both in the norm's layout, `buf`
    /// contiguous): one pass through the fused kernel where it takes `x` (f32 on CUDA), else the
    /// candle composition copied in.
    fn silu_into(
        &self,
        x: &Tensor,
        in_bias: Option<&Tensor>,
        buf: &Tensor,
        offset: usize,
    ) -> Result<()> {
        #[cfg(feature = "cuda")]
        if crate::models::wan::vae_ops::vae_supported(x) {
            let norm = (&self.gamma, self.scale, self.layout);
            return crate::models::wan::vae_ops::vae_rms_silu_into(x, in_bias, norm, buf, offset);
        }
        let x = match in_bias {
            Some(bias) => add_bias(x.copy()?, bias, None, self.layout)?,
            None => x.clone(),
        };
        let y = silu(&self.forward(&x)?)?.contiguous()?;
        buf.slice_set(&y, self.layout.time_dim(), offset)
    }
}

/// diffusers' `WanResidualBlock`.
pub(super) struct ResBlock {
    norm1: ChannelNorm,
    conv1: CausalConv3d,
    norm2: ChannelNorm,
    conv2: CausalConv3d,
    shortcut: Option<CausalConv3d>,
}

impl ResBlock {
    pub(super) fn new(
        in_dim: usize,
        out_dim: usize,
        layout: Layout,
        vb: VarBuilder,
    ) -> Result<Self> {
        let shortcut = if in_dim != out_dim {
            Some(CausalConv3d::cube(
                in_dim,
                out_dim,
                1,
                0,
                layout,
                vb.pp("conv_shortcut"),
            )?)
        } else {
            None
        };
        Ok(Self {
            norm1: ChannelNorm::new(in_dim, false, layout, vb.pp("norm1"))?,
            conv1: CausalConv3d::cube(in_dim, out_dim, 3, 1, layout, vb.pp("conv1"))?
                .deferring_bias(),
            norm2: ChannelNorm::new(out_dim, false, layout, vb.pp("norm2"))?,
            conv2: CausalConv3d::cube(out_dim, out_dim, 3, 1, layout, vb.pp("conv2"))?,
            shortcut,
        })
    }

    pub(super) fn forward(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let h = match &self.shortcut {
            Some(conv) => conv.forward(x, None)?,
            None => x.clone(),
        };
        // conv1's output has one reader, norm2, which adds conv1's bias as it reads.
        let y = self
            .conv1
            .forward_cached(x, Some((&self.norm1, None)), None, cache)?;
        let norm2 = (&self.norm2, Some(self.conv1.bias()));
        self.conv2.forward_cached(&y, Some(norm2), Some(&h), cache)
    }
}

/// diffusers' `WanAttentionBlock`: single-head self-attention over the pixels of each frame.
pub(super) struct AttentionBlock {
    norm: ChannelNorm,
    to_qkv: Conv2d,
    proj: Conv2d,
    layout: Layout,
}

impl AttentionBlock {
    pub(super) fn new(dim: usize, layout: Layout, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            norm: ChannelNorm::new(dim, true, layout, vb.pp("norm"))?,
            to_qkv: Conv2d::new(dim, 3 * dim, 1, 0, 1, vb.pp("to_qkv"))?,
            proj: Conv2d::new(dim, dim, 1, 0, 1, vb.pp("proj"))?,
            layout,
        })
    }

    /// `x`: a chunk in the block's layout; attention within each frame.
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, c, t, h, w) = self.layout.dims(x)?;
        let scale = 1.0 / (c as f64).sqrt();
        if self.layout == Layout::ChannelsLast {
            // Every frame's pixels are already rows of channels: the 1x1 convs are products.
            let frames = x.reshape((b * t, h * w, c))?;
            let qkv = self.to_qkv.pixels(&self.norm.forward(&frames)?)?;
            let qkv = qkv.unsqueeze(1)?;
            let part = |i: usize| qkv.narrow(3, i * c, c);
            let o = sdpa(&part(0)?, &part(1)?, &part(2)?, scale)?.squeeze(1)?;
            return self.proj.pixels(&o)?.reshape((b, t, h, w, c))? + x;
        }
        let frames = x
            .permute((0, 2, 1, 3, 4))?
            .contiguous()?
            .reshape((b * t, c, h, w))?;
        let qkv = self.to_qkv.forward(&self.norm.forward(&frames)?)?;
        let qkv = qkv.reshape((b * t, 1, 3 * c, h * w))?.transpose(2, 3)?;
        let q = qkv.narrow(3, 0, c)?;
        let k = qkv.narrow(3, c, c)?;
        let v = qkv.narrow(3, 2 * c, c)?;
        let o = sdpa(&q, &k, &v, scale)?;
        let o = o.squeeze(1)?.transpose(1, 2)?.reshape((b * t, c, h, w))?;
        let o = self.proj.forward(&o)?.reshape((b, t, c, h, w))?;
        o.permute((0, 2, 1, 3, 4))? + x
    }
}

/// diffusers' `WanMidBlock` with one attention layer: res, attention, res.
pub(super) struct MidBlock {
    res0: ResBlock,
    attn: AttentionBlock,
    res1: ResBlock,
}

impl MidBlock {
    pub(super) fn new(dim: usize, layout: Layout, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            res0: ResBlock::new(dim, dim, layout, vb.pp("resnets.0"))?,
            attn: AttentionBlock::new(dim, layout, vb.pp("attentions.0"))?,
            res1: ResBlock::new(dim, dim, layout, vb.pp("resnets.1"))?,
        })
    }

    pub(super) fn forward(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let x = self.res0.forward(x, cache)?;
        let x = self.attn.forward(&x)?;
        self.res1.forward(&x, cache)
    }
}

/// Applies a per-image operation to every frame of `[B, C, T, H, W]`, one frame at a time.
fn map_frames(x: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let outs = (0..x.dim(2)?)
        .map(|t| f(&frame(x, t)?))
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&outs, 2)
}

/// diffusers' `WanResample` in `upsample2d` / `upsample3d` mode: (3D: a temporal conv C -> 2C
/// whose halves become two consecutive frames) then nearest x2 and a 3x3 conv.
pub(super) struct Upsample {
    conv: Conv2d,
    /// Where cuDNN computes: the 3x3 conv of the nearest x2 frames as four 2x2 convs of the
    /// frames themselves (see [`subpixel_weight`]), 2.25x fewer operations and no upsampled copy.
    subpixel: Option<Tensor>,
    time_conv: Option<CausalConv3d>,
    layout: Layout,
}

/// The 3x3 kernel `w` `[C_out, C_in, 3, 3]` (padding 1) applied to a nearest x2 upsampling, as
/// one 2x2 kernel per output parity `(a, b)` applied to the frame itself (padding 1):
/// `[4 C_out, C_in, 1, 2, 2]`, parity `2a + b` first. Output row `2i + a` reads upsampled rows
/// `2i + a - 1 ..= 2i + a + 1`, which are source rows `i - 1, i, i` (a = 0) or `i, i, i + 1`
/// (a = 1): taps that read the same source row are summed. Likewise for columns.
fn subpixel_weight(w: &Tensor) -> Result<Tensor> {
    let merge = |w: &Tensor, dim: usize, parity: usize| -> Result<Tensor> {
        let tap = |k: usize| w.narrow(dim, k, 1);
        let (first, second) = if parity == 0 {
            (tap(0)?, (tap(1)? + tap(2)?)?)
        } else {
            ((tap(0)? + tap(1)?)?, tap(2)?)
        };
        Tensor::cat(&[first, second], dim)
    };
    let mut parts = Vec::with_capacity(4);
    for a in 0..2 {
        let rows = merge(w, 2, a)?;
        for b in 0..2 {
            parts.push(merge(&rows, 3, b)?);
        }
    }
    Tensor::cat(&parts, 0)?.unsqueeze(2)?.contiguous()
}

/// The parities `y` `[B, 4 C, T, H + 1, W + 1]` (the 2x2 convs of [`subpixel_weight`] with
/// padding 1) interleaved into `[B, C, T, 2H, 2W]`, plus `bias`: output `(2i + a, 2j + b)` is
/// parity `2a + b` at `(i + a, j + b)`. Channels last alike (`[B, T, H + 1, W + 1, 4C]` ->
/// `[B, T, 2H, 2W, C]`). One pass through the kernel on CUDA f32, else candle's.
fn subpixel_shuffle(y: &Tensor, bias: &Tensor, layout: Layout) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::models::wan::vae_ops::vae_supported(y) {
        return match layout {
            Layout::ChannelsFirst => crate::models::wan::vae_ops::vae_subpixel(y, bias),
            Layout::ChannelsLast => crate::models::wan::vae_ops::vae_subpixel_cl(y, bias),
        };
    }
    if layout == Layout::ChannelsLast {
        let first = subpixel_shuffle(&layout.to_channels_first(y)?, bias, Layout::ChannelsFirst)?;
        return layout.from_channels_first(&first);
    }
    let (_, c4, _, h1, w1) = y.dims5()?;
    let (c, h, w) = (c4 / 4, h1 - 1, w1 - 1);
    let rows = (0..2)
        .map(|a| {
            let cols = (0..2)
                .map(|b| {
                    y.narrow(1, (2 * a + b) * c, c)?
                        .narrow(3, a, h)?
                        .narrow(4, b, w)
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::stack(&cols, 5)
        })
        .collect::<Result<Vec<_>>>()?;
    let (bs, _, t, _, _) = y.dims5()?;
    let out = Tensor::stack(&rows, 4)?.reshape((bs, c, t, 2 * h, 2 * w))?;
    add_bias(out, bias, None, Layout::ChannelsFirst)
}

impl Upsample {
    pub(super) fn new(
        dim: usize,
        out_dim: usize,
        temporal: bool,
        layout: Layout,
        vb: VarBuilder,
    ) -> Result<Self> {
        let time_conv = if temporal {
            // Its bias is added as its frames are interleaved (`time_upsample`).
            let conv = CausalConv3d::new(
                dim,
                2 * dim,
                (3, 1, 1),
                1,
                (1, 0),
                layout,
                vb.pp("time_conv"),
            )?;
            Some(conv.deferring_bias())
        } else {
            None
        };
        let conv = Conv2d::new(dim, out_dim, 3, 1, 1, vb.pp("resample.1"))?;
        let subpixel = if conv3d::accelerated(conv.weight.device()) {
            Some(layout.from_channels_first(&subpixel_weight(&conv.weight)?)?)
        } else {
            None
        };
        Ok(Self {
            conv,
            subpixel,
            time_conv,
            layout,
        })
    }

    pub(super) fn forward(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let layout = self.layout;
        let x = match &self.time_conv {
            Some(time_conv) => Self::time_upsample(time_conv, x, layout, cache)?,
            None => x.clone(),
        };
        if let Some(w) = &self.subpixel {
            let (stride, padding) = ([1, 1, 1], [0, 1, 1]);
            let bias = &self.conv.bias;
            if let Some(y) = conv3d::conv3d_parities_in(layout, &x, w, stride, padding, bias)? {
                return Ok(y);
            }
            let subpixel = || -> Result<Option<Tensor>> {
                match conv3d::conv3d_in(layout, &x, w, stride, padding)? {
                    Some(y) => Ok(Some(subpixel_shuffle(&y, bias, layout)?)),
                    None => Ok(None),
                }
            };
            match layout {
                // No other path in that layout: errors are the caller's.
                Layout::ChannelsLast => {
                    if let Some(y) = subpixel()? {
                        return Ok(y);
                    }
                }
                Layout::ChannelsFirst => {
                    if let Some(y) = conv3d::or_fallback(subpixel) {
                        return Ok(y);
                    }
                }
            }
        }
        if layout == Layout::ChannelsLast {
            // Not accelerated (the CPU): the channels-first path on copies.
            let up = self.upsample_frames(&layout.to_channels_first(&x)?)?;
            return layout.from_channels_first(&up);
        }
        self.upsample_frames(&x)
    }

    /// Nearest x2 of every frame of `x` `[B, C, T, H, W]` and the 3x3 conv, frame by frame.
    fn upsample_frames(&self, x: &Tensor) -> Result<Tensor> {
        // Nearest x2 of every frame at once (frames folded into the image channels).
        let (b, c, t, h, w) = x.dims5()?;
        let up = x
            .reshape((b, c * t, h, w))?
            .upsample_nearest2d(2 * h, 2 * w)?
            .reshape((b, c, t, 2 * h, 2 * w))?;
        self.conv.forward_frames(&up)
    }

    /// The first chunk passes through un-doubled (slot becomes `Rep`); later chunks run the
    /// temporal conv over zero padding (after `Rep`) or the cached frames, doubling the frames.
    fn time_upsample(
        time_conv: &CausalConv3d,
        x: &Tensor,
        layout: Layout,
        cache: &mut FeatCache,
    ) -> Result<Tensor> {
        let time = layout.time_dim();
        let slot = cache.next_slot();
        let y = match slot {
            Slot::Empty => {
                *slot = Slot::Rep;
                return Ok(x.clone());
            }
            Slot::Rep => {
                let mut cache_x = last_frames(x, CACHE_T, layout)?;
                if cache_x.dim(time)? < CACHE_T {
                    cache_x = Tensor::cat(&[cache_x.zeros_like()?, cache_x], time)?;
                }
                let y = time_conv.forward(x, None)?;
                *slot = Slot::Frames(cache_x);
                y
            }
            Slot::Frames(prev) => {
                let prev = prev.clone();
                let mut cache_x = last_frames(x, CACHE_T, layout)?;
                if cache_x.dim(time)? < CACHE_T {
                    cache_x = Tensor::cat(&[last_frames(&prev, 1, layout)?, cache_x], time)?;
                }
                let y = time_conv.forward(x, Some(&prev))?;
                *slot = Slot::Frames(cache_x);
                y
            }
        };
        // Channels [0, C) are frame 2t, channels [C, 2C) frame 2t + 1; the conv left its bias.
        #[cfg(feature = "cuda")]
        if layout == Layout::ChannelsLast && crate::models::wan::vae_ops::vae_supported(&y) {
            return crate::models::wan::vae_ops::vae_time_interleave_cl(&y, time_conv.bias());
        }
        let y = add_bias(y, time_conv.bias(), None, layout)?;
        let (b, c2, t, h, w) = layout.dims(&y)?;
        match layout {
            Layout::ChannelsFirst => y
                .reshape((b, 2, c2 / 2, t, h * w))?
                .permute((0, 2, 3, 1, 4))?
                .contiguous()?
                .reshape((b, c2 / 2, 2 * t, h, w)),
            Layout::ChannelsLast => y
                .reshape((b, t, h * w, 2, c2 / 2))?
                .permute((0, 1, 3, 2, 4))?
                .contiguous()?
                .reshape((b, 2 * t, h, w, c2 / 2)),
        }
    }
}

/// diffusers' `WanResample` in `downsample2d` / `downsample3d` mode: zero pad right/bottom, 3x3
/// stride-2 conv, then (3D) a stride-2 temporal conv over the previous chunk's last frame and
/// this chunk; the very first chunk passes through.
pub(super) struct Downsample {
    conv: Conv2d,
    time_conv: Option<CausalConv3d>,
}

impl Downsample {
    pub(super) fn new(dim: usize, temporal: bool, vb: VarBuilder) -> Result<Self> {
        let time_conv = if temporal {
            Some(CausalConv3d::new(
                dim,
                dim,
                (3, 1, 1),
                2,
                (0, 0),
                Layout::ChannelsFirst,
                vb.pp("time_conv"),
            )?)
        } else {
            None
        };
        Ok(Self {
            conv: Conv2d::new(dim, dim, 3, 0, 2, vb.pp("resample.1"))?,
            time_conv,
        })
    }

    pub(super) fn forward(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let x = self
            .conv
            .forward_frames(&x.pad_with_zeros(4, 0, 1)?.pad_with_zeros(3, 0, 1)?)?;
        let Some(time_conv) = &self.time_conv else {
            return Ok(x);
        };
        let slot = cache.next_slot();
        match slot {
            Slot::Frames(prev) => {
                let first = Layout::ChannelsFirst;
                let input = Tensor::cat(&[last_frames(prev, 1, first)?, x.clone()], 2)?;
                *slot = Slot::Frames(last_frames(&x, 1, first)?);
                time_conv.forward(&input, None)
            }
            _ => {
                *slot = Slot::Frames(x.clone());
                Ok(x)
            }
        }
    }
}

/// diffusers' `AvgDown3D`, the parameter-free shortcut of a Wan2.2 residual down block: frames
/// zero-padded in front to a multiple of `factor_t`, each `factor_t x factor_s x factor_s` cell
/// folded into channels, and groups of channels averaged down to `out_dim`.
pub(super) struct AvgDown3D {
    out_dim: usize,
    factor_t: usize,
    factor_s: usize,
}

impl AvgDown3D {
    /// Fails unless `in_dim * factor_t * factor_s^2` is a multiple of `out_dim`.
    pub(super) fn new(
        in_dim: usize,
        out_dim: usize,
        factor_t: usize,
        factor_s: usize,
    ) -> Result<Self> {
        if out_dim == 0 || !(in_dim * factor_t * factor_s * factor_s).is_multiple_of(out_dim) {
            bail!("vae: residual down block {in_dim} -> {out_dim} channels cannot average groups")
        }
        Ok(Self {
            out_dim,
            factor_t,
            factor_s,
        })
    }

    /// `[B, C, T, H, W]` -> `[B, out, ceil(T / f_t), H / f_s, W / f_s]`.
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (ft, fs) = (self.factor_t, self.factor_s);
        let (b, c, t, h, w) = x.dims5()?;
        let pad = (ft - t % ft) % ft;
        let x = if pad > 0 {
            x.pad_with_zeros(2, pad, 0)?
        } else {
            x.clone()
        };
        let (t2, h2, w2) = ((t + pad) / ft, h / fs, w / fs);
        let group = c * ft * fs * fs / self.out_dim;
        x.contiguous()?
            .reshape(vec![b, c, t2, ft, h2, fs, w2, fs])?
            .permute(vec![0, 1, 3, 5, 7, 2, 4, 6])?
            .contiguous()?
            .reshape(vec![b, self.out_dim, group, t2, h2, w2])?
            .mean(2)
    }
}

/// diffusers' `DupUp3D`, the parameter-free shortcut of a Wan2.2 residual up block: channels
/// repeated, then unfolded into `factor_t x factor_s x factor_s` cells; on the first chunk the
/// first `factor_t - 1` output frames are dropped.
pub(super) struct DupUp3D {
    out_dim: usize,
    factor_t: usize,
    factor_s: usize,
    repeats: usize,
}

impl DupUp3D {
    /// Fails unless `out_dim * factor_t * factor_s^2` is a multiple of `in_dim`.
    pub(super) fn new(
        in_dim: usize,
        out_dim: usize,
        factor_t: usize,
        factor_s: usize,
    ) -> Result<Self> {
        let cells = out_dim * factor_t * factor_s * factor_s;
        if in_dim == 0 || !cells.is_multiple_of(in_dim) {
            bail!("vae: residual up block {in_dim} -> {out_dim} channels cannot repeat evenly")
        }
        Ok(Self {
            out_dim,
            factor_t,
            factor_s,
            repeats: cells / in_dim,
        })
    }

    /// `h + self.forward(x)` with `h` and `x` in `layout`: on CUDA f32 channels last in one
    /// pass (the shortcut's rearrangement was a fifth of the TI2V-5B decode's kernel time,
    /// bench/RESULTS.md session 61), elsewhere through the channels-first rearrangement.
    pub(super) fn add_to(
        &self,
        h: &Tensor,
        x: &Tensor,
        first_chunk: bool,
        layout: Layout,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if layout == Layout::ChannelsLast && crate::models::wan::vae_ops::vae_supported(x) {
            let skip = if first_chunk { self.factor_t - 1 } else { 0 };
            let factors = (self.factor_t, self.factor_s, self.repeats);
            return crate::models::wan::vae_ops::vae_dup_up_add_cl(h, x, factors, skip);
        }
        let x = layout.to_channels_first(x)?;
        h + layout.from_channels_first(&self.forward(&x, first_chunk)?)?
    }

    /// `[B, C, T, H, W]` -> `[B, out, T * f_t (- (f_t - 1) on the first chunk), H * f_s,
    /// W * f_s]`.
    pub(super) fn forward(&self, x: &Tensor, first_chunk: bool) -> Result<Tensor> {
        let (ft, fs, out) = (self.factor_t, self.factor_s, self.out_dim);
        let (b, c, t, h, w) = x.dims5()?;
        // repeat_interleave over channels: channel j comes from j / repeats.
        let x = x
            .unsqueeze(2)?
            .broadcast_as(vec![b, c, self.repeats, t, h, w])?
            .contiguous()?
            .reshape(vec![b, out, ft, fs, fs, t, h, w])?
            .permute(vec![0, 1, 5, 2, 6, 3, 7, 4])?
            .contiguous()?
            .reshape((b, out, t * ft, h * fs, w * fs))?;
        if first_chunk && ft > 1 {
            x.narrow(2, ft - 1, t * ft - (ft - 1))?.contiguous()
        } else {
            Ok(x)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The 3x3 conv of a nearest x2 upsampling equals the four 2x2 parity convs of the frame,
    /// interleaved (the path where cuDNN computes), here with candle's conv2d on the CPU.
    #[test]
    fn subpixel_equals_upsample_then_conv() -> Result<()> {
        let dev = Device::Cpu;
        let (cin, cout, h, w) = (5, 4, 6, 7);
        let x = Tensor::randn(0f32, 1.0, (2, cin, h, w), &dev)?;
        let weight = Tensor::randn(0f32, 1.0, (cout, cin, 3, 3), &dev)?;
        let bias = Tensor::randn(0f32, 1.0, cout, &dev)?;
        let direct = x
            .upsample_nearest2d(2 * h, 2 * w)?
            .conv2d(&weight, 1, 1, 1, 1)?
            .broadcast_add(&bias.reshape((1, cout, 1, 1))?)?;
        let sub = subpixel_weight(&weight)?.squeeze(2)?;
        let parities = x.conv2d(&sub, 1, 1, 1, 1)?.unsqueeze(2)?;
        let got = subpixel_shuffle(&parities, &bias, Layout::ChannelsFirst)?;
        let diff = (got.squeeze(2)? - &direct)?.abs()?.flatten_all()?.max(0)?;
        assert!(diff.to_scalar::<f32>()? < 1e-4);
        // Channels last gives the same frames in its own order.
        let last = Layout::ChannelsLast;
        let got = subpixel_shuffle(&last.from_channels_first(&parities)?, &bias, last)?;
        let diff = (last.to_channels_first(&got)?.squeeze(2)? - direct)?
            .abs()?
            .flatten_all()?
            .max(0)?;
        assert!(diff.to_scalar::<f32>()? < 1e-4);
        Ok(())
    }

    /// Splitting a conv2d over images and row bands must not change any output value.
    #[test]
    fn banded_conv2d_equals_direct() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (3, 5, 13, 11), &dev)?;
        let w = Tensor::randn(0f32, 1.0, (4, 5, 3, 3), &dev)?;
        for (padding, stride) in [(1, 1), (0, 2), (1, 2)] {
            let direct = x.conv2d(&w, padding, stride, 1, 1)?;
            // Limits forcing: one image per call, several rows per call, one row per call.
            for limit in [2000, 200, 1] {
                let banded = conv2d_banded(&x, &w, padding, stride, limit)?;
                let diff = (banded - &direct)?.abs()?.flatten_all()?.max(0)?;
                assert!(
                    diff.to_scalar::<f32>()? < 1e-5,
                    "pad {padding} stride {stride}"
                );
            }
        }
        Ok(())
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    use super::*;
    use candle_core::Device;

    const LAYOUTS: [Layout; 2] = [Layout::ChannelsFirst, Layout::ChannelsLast];

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// Wan2.2's shortcut added channels last in one pass against the channels-first
    /// rearrangement and add on the CPU, bit for bit: with and without the first chunk's
    /// dropped frames, with and without temporal doubling, channels repeated 2 and 4 times.
    #[test]
    fn dup_up_add_channels_last_matches_composition() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: VAE kernel test skipped");
            return Ok(());
        };
        let last = Layout::ChannelsLast;
        for (c_in, out, ft, first) in [
            (8, 4, 2, true),
            (8, 4, 2, false),
            (16, 8, 1, false),
            (6, 3, 2, true),
        ] {
            let shortcut = DupUp3D::new(c_in, out, ft, 2)?;
            let x = Tensor::randn(0f32, 1.0, (2, c_in, 3, 3, 5), &Device::Cpu)?;
            let frames = 3 * ft - if first { ft - 1 } else { 0 };
            let h = Tensor::randn(0f32, 1.0, (2, out, frames, 6, 10), &Device::Cpu)?;
            let want = shortcut.add_to(&h, &x, first, Layout::ChannelsFirst)?;
            let on_device = |t: &Tensor| last.from_channels_first(&t.to_device(&dev)?);
            let got = shortcut.add_to(&on_device(&h)?, &on_device(&x)?, first, last)?;
            let got = last.to_channels_first(&got)?.to_device(&Device::Cpu)?;
            let case = format!("{c_in} -> {out} channels, ft {ft}, first chunk {first}");
            assert_eq!(max_diff(&got, &want)?, 0.0, "{case}");
        }
        Ok(())
    }

    /// The fused norm + SiLU kernels (each layout, with and without an input bias) against the
    /// candle composition (CPU fallback), written at a frame offset of a buffer whose other
    /// frames stay untouched.
    #[test]
    fn fused_rms_silu_matches_composition() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: VAE kernel test skipped");
            return Ok(());
        };
        for (layout, biased) in [LAYOUTS, LAYOUTS]
            .concat()
            .into_iter()
            .zip([false, false, true, true])
        {
            // The last: gammas so wide that exp(-y) overflows (SiLU's full division) for some.
            for (b, c, t, spread) in [
                (1, 96, 3, 0.5),
                (2, 5, 1, 0.5),
                (2, 384, 2, 0.5),
                (1, 8, 2, 60.0),
            ] {
                let in_bias = Tensor::randn(0f32, 1f32, c, &dev)?;
                let in_bias = biased.then_some(&in_bias);
                let x = Tensor::randn(0f32, 3f32, (b, c, t, 7, 9), &dev)?;
                let gamma = Tensor::randn(1f32, spread, (c, 1, 1, 1), &dev)?;
                let norm = |device: &Device| -> Result<ChannelNorm> {
                    let gamma = gamma.to_device(device)?;
                    Ok(ChannelNorm {
                        gamma: match layout {
                            Layout::ChannelsFirst => gamma,
                            Layout::ChannelsLast => gamma.flatten_all()?,
                        },
                        scale: (c as f64).sqrt(),
                        layout,
                    })
                };
                let buf = Tensor::full(7f32, (b, c, t + 2, 7, 9), &dev)?;
                let buf = layout.from_channels_first(&buf)?;
                let xl = layout.from_channels_first(&x)?;
                norm(&dev)?.silu_into(&xl, in_bias, &buf, 2)?;
                let got = layout.to_channels_first(&buf)?;
                let first = ChannelNorm {
                    gamma: gamma.clone(),
                    scale: (c as f64).sqrt(),
                    layout: Layout::ChannelsFirst,
                };
                let x_biased = match in_bias {
                    Some(bias) => x.broadcast_add(&bias.reshape((1, c, 1, 1, 1))?)?,
                    None => x.clone(),
                };
                let want = silu(&first.forward(&x_biased)?)?;
                assert!(want
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .all(|v| v.is_finite()));
                // Within 1e-5 of the output's magnitude (at least 1).
                let tolerance = 1e-5
                    * want
                        .abs()?
                        .flatten_all()?
                        .max(0)?
                        .to_scalar::<f32>()?
                        .max(1.0);
                let err = max_diff(&got.narrow(2, 2, t)?, &want)?;
                assert!(err < tolerance, "{layout:?} norm + SiLU kernel: {err:.2e}");
                let front = got.narrow(2, 0, 2)?.flatten_all()?.to_vec1::<f32>()?;
                assert!(front.iter().all(|&v| v == 7.0), "{layout:?}: front changed");
                // The CPU fallback of the same layout computes the same.
                let cpu = Tensor::zeros(xl.dims(), DType::F32, &Device::Cpu)?;
                let cpu_bias = in_bias.map(|b| b.to_device(&Device::Cpu)).transpose()?;
                let cpu_x = xl.to_device(&Device::Cpu)?;
                norm(&Device::Cpu)?.silu_into(&cpu_x, cpu_bias.as_ref(), &cpu, 0)?;
                let cpu = layout.to_channels_first(&cpu)?;
                let err = max_diff(&got.narrow(2, 2, t)?.to_device(&Device::Cpu)?, &cpu)?;
                assert!(
                    err < tolerance,
                    "{layout:?} kernel vs CPU fallback: {err:.2e}"
                );
            }
        }
        Ok(())
    }

    /// The parity interleave kernels against the candle composition (CPU fallback).
    #[test]
    fn subpixel_kernel_matches_composition() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: VAE kernel test skipped");
            return Ok(());
        };
        let y = Tensor::randn(0f32, 1f32, (2, 12, 3, 6, 8), &dev)?;
        let bias = Tensor::randn(0f32, 1f32, 3, &dev)?;
        let want = subpixel_shuffle(
            &y.to_device(&Device::Cpu)?,
            &bias.to_device(&Device::Cpu)?,
            Layout::ChannelsFirst,
        )?;
        assert_eq!(want.dims(), &[2, 3, 3, 10, 14]);
        for layout in LAYOUTS {
            let got = subpixel_shuffle(&layout.from_channels_first(&y)?, &bias, layout)?;
            let got = layout.to_channels_first(&got)?.to_device(&Device::Cpu)?;
            assert_eq!(max_diff(&got, &want)?, 0.0, "{layout:?}");
        }
        Ok(())
    }

    /// The temporal upsampler's bias + frame interleave kernel (6 channels per frame: one float
    /// at a time; 8: float4s) against candle's broadcast add and permuted copy, bit for bit.
    #[test]
    fn time_interleave_kernel_matches_composition() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: VAE kernel test skipped");
            return Ok(());
        };
        for c in [6, 8] {
            let (b, t, h, w) = (2, 3, 5, 4);
            let y = Tensor::randn(0f32, 1f32, (b, t, h, w, 2 * c), &Device::Cpu)?;
            let bias = Tensor::randn(0f32, 1f32, 2 * c, &Device::Cpu)?;
            let want = y
                .broadcast_add(&bias)?
                .reshape((b, t, h * w, 2, c))?
                .permute((0, 1, 3, 2, 4))?
                .contiguous()?
                .reshape((b, 2 * t, h, w, c))?;
            let got = crate::models::wan::vae_ops::vae_time_interleave_cl(
                &y.to_device(&dev)?,
                &bias.to_device(&dev)?,
            )?;
            assert_eq!(max_diff(&got.to_device(&Device::Cpu)?, &want)?, 0.0, "{c}");
        }
        Ok(())
    }

    /// The in-place bias kernels (each layout; channels last with 4 and 6 channels, the
    /// vectorized and the plain kernel) against candle's broadcast add.
    #[test]
    fn bias_kernel_matches_broadcast_add() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: VAE kernel test skipped");
            return Ok(());
        };
        for c in [6, 8] {
            let y = Tensor::randn(0f32, 1f32, (2, c, 3, 5, 4), &dev)?;
            let r = Tensor::randn(0f32, 1f32, (2, c, 3, 5, 4), &dev)?;
            let bias = Tensor::randn(0f32, 1f32, c, &dev)?;
            let want = y.broadcast_add(&bias.reshape((1, c, 1, 1, 1))?)?;
            let want_r = (&want + &r)?;
            for layout in LAYOUTS {
                let (yl, rl) = (
                    layout.from_channels_first(&y)?,
                    layout.from_channels_first(&r)?,
                );
                let got = layout.to_channels_first(&add_bias(yl.copy()?, &bias, None, layout)?)?;
                assert_eq!(max_diff(&got, &want)?, 0.0, "{layout:?} {c}");
                // A copy: channels first, `yl` shares `y`'s storage.
                let got = add_bias(yl.copy()?, &bias, Some(&rl), layout)?;
                let got = layout.to_channels_first(&got)?;
                assert_eq!(max_diff(&got, &want_r)?, 0.0, "{layout:?} {c} residual");
            }
            // 4D (a Conv2d's output) too.
            let y = Tensor::randn(0f32, 1f32, (3, c, 5, 4), &dev)?;
            let want = y.broadcast_add(&bias.reshape((1, c, 1, 1))?)?;
            let got = add_bias(y.copy()?, &bias, None, Layout::ChannelsFirst)?;
            assert_eq!(max_diff(&got, &want)?, 0.0);
        }
        Ok(())
    }

    /// Weights of a block, drawn on the CPU.
    fn weights(shapes: &[(&str, Vec<usize>)]) -> Result<std::collections::HashMap<String, Tensor>> {
        let mut weights = std::collections::HashMap::new();
        for (name, shape) in shapes {
            let t = Tensor::randn(0f32, 0.3f32, shape.clone(), &Device::Cpu)?;
            weights.insert(name.to_string(), t);
        }
        Ok(weights)
    }

    /// A residual block on CUDA (fused input buffers, cuDNN or the tap sum, exact f32; channels
    /// first, and channels last where cuDNN is loaded) against the same block on the CPU, over
    /// three chunks so that the cached frames are used.
    #[test]
    fn res_block_chunks_match_cpu() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: VAE block test skipped");
            return Ok(());
        };
        let (cin, cout) = (8, 12);
        let weights = weights(&[
            ("norm1.gamma", vec![cin, 1, 1, 1]),
            ("conv1.weight", vec![cout, cin, 3, 3, 3]),
            ("conv1.bias", vec![cout]),
            ("norm2.gamma", vec![cout, 1, 1, 1]),
            ("conv2.weight", vec![cout, cout, 3, 3, 3]),
            ("conv2.bias", vec![cout]),
            ("conv_shortcut.weight", vec![cout, cin, 1, 1, 1]),
            ("conv_shortcut.bias", vec![cout]),
        ])?;
        let block = |device: &Device, layout: Layout| -> Result<ResBlock> {
            let vb = VarBuilder::from_tensors(weights.clone(), DType::F32, device);
            ResBlock::new(cin, cout, layout, vb)
        };
        let cpu = block(&Device::Cpu, Layout::ChannelsFirst)?;
        let _exact = conv3d::tf32_here(false);
        for layout in [Layout::ChannelsFirst, Layout::for_device(&dev)] {
            let gpu = block(&dev, layout)?;
            let (mut gpu_cache, mut cpu_cache) = (FeatCache::default(), FeatCache::default());
            let mut worst = 0f32;
            for t in [1, 2, 4] {
                let x = Tensor::randn(0f32, 1f32, (1, cin, t, 6, 10), &Device::Cpu)?;
                gpu_cache.start_chunk();
                cpu_cache.start_chunk();
                let g = gpu.forward(
                    &layout.from_channels_first(&x.to_device(&dev)?)?,
                    &mut gpu_cache,
                );
                let c = cpu.forward(&x, &mut cpu_cache)?;
                let g = layout.to_channels_first(&g?)?.to_device(&Device::Cpu)?;
                worst = worst.max(max_diff(&g, &c)?);
            }
            assert!(
                worst < 1e-4,
                "{layout:?} CUDA vs CPU residual block: {worst:.2e}"
            );
        }
        Ok(())
    }

    /// The mid block's attention and a temporal upsampler (its frame doubling and subpixel
    /// conv) channels last on CUDA against channels first on the CPU, over three chunks.
    #[test]
    fn attention_and_upsampler_channels_last_match_cpu() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: VAE block test skipped");
            return Ok(());
        };
        let layout = Layout::for_device(&dev);
        if layout == Layout::ChannelsFirst {
            eprintln!("no cuDNN: channels-last VAE test skipped");
            return Ok(());
        }
        let c = 8;
        let weights = weights(&[
            ("attn.norm.gamma", vec![c, 1, 1]),
            ("attn.to_qkv.weight", vec![3 * c, c, 1, 1]),
            ("attn.to_qkv.bias", vec![3 * c]),
            ("attn.proj.weight", vec![c, c, 1, 1]),
            ("attn.proj.bias", vec![c]),
            ("up.time_conv.weight", vec![2 * c, c, 3, 1, 1]),
            ("up.time_conv.bias", vec![2 * c]),
            ("up.resample.1.weight", vec![c / 2, c, 3, 3]),
            ("up.resample.1.bias", vec![c / 2]),
        ])?;
        let build = |device: &Device, layout: Layout| -> Result<(AttentionBlock, Upsample)> {
            let vb = VarBuilder::from_tensors(weights.clone(), DType::F32, device);
            Ok((
                AttentionBlock::new(c, layout, vb.pp("attn"))?,
                Upsample::new(c, c / 2, true, layout, vb.pp("up"))?,
            ))
        };
        let (gpu_attn, gpu_up) = build(&dev, layout)?;
        let (cpu_attn, cpu_up) = build(&Device::Cpu, Layout::ChannelsFirst)?;
        let (mut gpu_cache, mut cpu_cache) = (FeatCache::default(), FeatCache::default());
        let _exact = conv3d::tf32_here(false);
        let mut worst = 0f32;
        for t in [1, 1, 2] {
            let x = Tensor::randn(0f32, 1f32, (1, c, t, 5, 7), &Device::Cpu)?;
            gpu_cache.start_chunk();
            cpu_cache.start_chunk();
            let g = gpu_attn.forward(&layout.from_channels_first(&x.to_device(&dev)?)?)?;
            let g = gpu_up.forward(&g, &mut gpu_cache)?;
            let want = cpu_up.forward(&cpu_attn.forward(&x)?, &mut cpu_cache)?;
            let g = layout.to_channels_first(&g)?.to_device(&Device::Cpu)?;
            assert_eq!(g.dims(), want.dims());
            worst = worst.max(max_diff(&g, &want)?);
        }
        assert!(
            worst < 1e-4,
            "channels-last attention + upsampler vs CPU: {worst:.2e}"
        );
        Ok(())
    }
}
