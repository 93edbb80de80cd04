//! The 3D convolution the causal-conv VAEs share, on CUDA one implicit-GEMM call instead of a
//! sum of 2D convolutions: through cuDNN where it is loaded, else vidgen's own kernel
//! ([`kernel`]: TF32 for f32, bf16); `None` elsewhere (and for exact f32 without cuDNN), and the
//! caller runs its own path unchanged.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{Device, Result, Tensor};

#[cfg(feature = "cuda")]
#[path = "kernels/conv3d.rs"]
pub mod kernel;

/// Whether f32 convolutions may use TF32 tensor-core math (PyTorch's default for convolutions).
static TF32: AtomicBool = AtomicBool::new(true);

/// Allows (the default) or forbids TF32 math in f32 convolutions (`--no-tf32`: exact f32).
pub fn set_tf32(allowed: bool) {
    TF32.store(allowed, Ordering::Relaxed);
}

thread_local! {
    /// This thread's own TF32 setting, over the process's while a [`Tf32Here`] lives.
    static TF32_HERE: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Whether f32 convolutions may use TF32 math (on this thread).
pub fn tf32() -> bool {
    TF32_HERE
        .with(|c| c.get())
        .unwrap_or_else(|| TF32.load(Ordering::Relaxed))
}

/// While alive, TF32 is allowed or not on this thread alone, whatever [`set_tf32`] says: tests
/// that need exact f32 run beside others that do not, each on its own thread.
pub struct Tf32Here {
    before: Option<bool>,
}

/// Sets this thread's TF32 setting until the returned guard drops.
pub fn tf32_here(allowed: bool) -> Tf32Here {
    Tf32Here {
        before: TF32_HERE.with(|c| c.replace(Some(allowed))),
    }
}

impl Drop for Tf32Here {
    fn drop(&mut self) {
        TF32_HERE.with(|c| c.set(self.before));
    }
}

/// Whether [`conv3d`] computes on `device` (CUDA with cuDNN loaded or the own kernel's compute
/// capability); the causal convs then keep their kernel whole instead of split into temporal
/// taps. [`conv3d`] may still return `None` there (exact f32 without cuDNN).
pub fn accelerated(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        // The own kernel first: asking for cuDNN waits until its libraries are open.
        return kernel::available(device) || crate::models::cudnn::api().is_some();
    }
    let _ = device;
    false
}

/// Whether [`conv3d`] computes `dtype` on `device` now (cuDNN, or the own kernel where it takes
/// the dtype under the current TF32 setting), so a caller can take its own path up front.
pub fn computes(device: &Device, dtype: candle_core::DType) -> bool {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return (kernel::takes(dtype, tf32()) && kernel::available(device))
            || crate::models::cudnn::api().is_some();
    }
    let _ = (device, dtype);
    false
}

/// Cross-correlation of `x` `[B, C_in, T, H, W]` by `w` `[C_out, C_in, kt, kh, kw]` with
/// `stride` and zero `padding` (each t, h, w), no bias: `Some([B, C_out, T', H', W'])` through
/// cuDNN or the own kernel, `None` where neither takes it (not [`accelerated`], or exact f32
/// without cuDNN), an error where the convolution fails (callers run it inside
/// [`or_fallback`]).
pub fn conv3d(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
) -> Result<Option<Tensor>> {
    conv3d_math(x, w, stride, padding, tf32())
}

/// [`conv3d`] with TF32 math allowed or not, whatever [`set_tf32`] said.
fn conv3d_math(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    tf32: bool,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if let Some(api) = crate::models::cudnn::api().filter(|_| x.device().is_cuda()) {
        let w = aligned(w)?;
        let conv = |x: &Tensor, padding: [usize; 3]| {
            let op = crate::models::cudnn::conv::Conv3d {
                api,
                stride,
                padding,
                tf32,
                channels_last: false,
            };
            aligned(x)?.apply_op2_no_bwd(&w, &op)
        };
        return in_frame_runs(x, w.dims(), stride, padding, CUDNN_MAX_ELEMENTS, conv).map(Some);
    }
    // The own kernel indexes in 64 bits: no frame runs.
    #[cfg(feature = "cuda")]
    if kernel::takes(x.dtype(), tf32) && kernel::available(x.device()) {
        return kernel::conv3d(x, w, stride, padding).map(Some);
    }
    let _ = (x, w, stride, padding, tf32);
    Ok(None)
}

/// [`conv3d`] with channels last in memory: `x` `[B, T, H, W, C_in]` by `w`
/// `[C_out, kt, kh, kw, C_in]` gives `[B, T', H', W', C_out]` (cuDNN's NDHWC layout, where its
/// tensor-core kernels read without a transposition): through the own kernels where they
/// outrun cuDNN, or where cuDNN is not loaded and they take the shape (TF32 tensor-core kernels;
/// exact f32 for at most 8 output channels), else cuDNN where it is loaded, else `None`. Operands
/// past cuDNN's 32-bit sizes are an error (no frame runs).
pub fn conv3d_channels_last(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if own_channels_last(x, w, stride, padding) {
        return kernel::conv3d_channels_last(x, w, stride, padding).map(Some);
    }
    #[cfg(feature = "cuda")]
    if let Some(api) = crate::models::cudnn::api().filter(|_| x.device().is_cuda()) {
        let op = crate::models::cudnn::conv::Conv3d {
            api,
            stride,
            padding,
            tf32: tf32(),
            channels_last: true,
        };
        return aligned(x)?.apply_op2_no_bwd(&aligned(w)?, &op).map(Some);
    }
    let _ = (x, w, stride, padding);
    Ok(None)
}

/// Output frames `first..` of a convolution of frames gathered from `x` (laid out as `layout`),
/// computed channels last: the frames `index` gathered (each image framed as `framing` says:
/// upsampled, its edges copied outwards), convolved by [`conv3d_channels_last`] (`w_last` `[C_out, kt, kh, kw, C_in]`,
/// `stride`, zero `padding`), and stored with `bias` (and `residual`, of `out`'s shape) into
/// `out` of `layout`: one pass each side of the convolution. `false` where no channels-last
/// convolution takes the shape (nothing is stored).
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv_frames_channels_last(
    (x, front, layout): (
        &Tensor,
        Option<&Tensor>,
        crate::models::channel_ops::VideoLayout,
    ),
    index: &[u32],
    framing: crate::models::channel_ops::Framing,
    (w_last, stride, padding): (&Tensor, [usize; 3], [usize; 3]),
    bias: &Tensor,
    out: &Tensor,
    first: usize,
    residual: Option<&Tensor>,
) -> Result<bool> {
    use crate::models::channel_ops::{gather_padded_frames_channels_last, store_channels_last};
    let frames = gather_padded_frames_channels_last((x, front), index, framing, layout)?;
    let Some(y) = conv3d_channels_last(&frames, w_last, stride, padding)? else {
        return Ok(false);
    };
    drop(frames);
    store_channels_last(&y, bias, (out, layout), first, residual)?;
    Ok(true)
}

/// Elements of the input frames [`padded_conv_channels_last`] gathers per run (512 MiB in bf16):
/// at CogVideoX's and LTX-Video's full resolution, runs of several frames, so the temporal halo
/// each run gathers again stays small (runs of one frame read the input three times over:
/// CogVideoX's decode took 1.50 s against 1.36 s, LTX-Video's 0.230 against 0.218 s, same
/// peaks used; an H200, bench/RESULTS.md session 36).
#[cfg(feature = "cuda")]
const RUN_ELEMENTS: usize = 1 << 28;

/// Elements of the input images [`images_conv_channels_last`] gathers per run (128 MiB in bf16).
/// A 2D convolution has no temporal halo to gather again, so short runs cost no extra reads and
/// keep the gathered input and cuDNN's output small beside the layer's own tensors (Latte-1's
/// 16x512x512 decode: 4.63 GiB used against 5.38 in runs of 2^28 elements, +3% time; an H100,
/// bench/RESULTS.md session 44). The memory plan
/// ([`crate::models::autoencoder_kl::AutoencoderKLConfig::decode_activations`]) counts one run's
/// input and output.
pub const IMAGE_RUN_ELEMENTS: usize = 1 << 26;

/// A VAE convolution of the channels-first `x` `[B, C, T, H, W]` by `weight` `[C_out, C, kt, kh,
/// kw]` with `stride` in every dim and `pad` zeros around each image, over `t_padded` frames in
/// time: padded frame j is frame `source(j)` of `front` and then `x` (as
/// [`gather_padded_frames_channels_last`] names them; `front`: a causal convolution's context
/// kept from the chunk before), each upsampled `up` times in height and width (nearest: an
/// upsampler's convolution reads its input's pixels where they lie), plus `bias` (and
/// `residual`, of the output's shape). Computed
/// channels last in runs of output frames: each run's frames gathered straight into cuDNN's NDHWC
/// layout and its output stored with the bias (and residual) into the channels-first result, so
/// no padded copy of the whole input and no transposes (nor their workspace) inside cuDNN.
/// `None` where it does not apply: off CUDA, outside bf16/f32, with the fused moves off, or a
/// shape no channels-last convolution takes.
///
/// [`gather_padded_frames_channels_last`]: crate::models::channel_ops::gather_padded_frames_channels_last
#[cfg(feature = "cuda")]
pub(crate) fn padded_conv_channels_last(
    (x, front): (&Tensor, Option<&Tensor>),
    frames: (usize, &dyn Fn(usize) -> u32, usize),
    conv: (&Tensor, usize, usize),
    bias: &Tensor,
    residual: Option<&Tensor>,
) -> Result<Option<Tensor>> {
    use crate::models::channel_ops::VideoLayout;
    padded_conv_in_runs(
        (x, front, VideoLayout::ChannelsFirst),
        frames,
        conv,
        bias,
        residual,
        RUN_ELEMENTS,
    )
}

/// 2D convolutions of images `x` `[N, C, H, W]` by `weight` `[C_out, C, kh, kw]` (stride 1,
/// `pad` zeros around each image), each image upsampled `up` times first (nearest), plus `bias`
/// (and `residual`, of the output's shape): [`padded_conv_channels_last`] over the images as the
/// frames of one frames-major video (a temporal kernel of one tap), in runs of images. The
/// image VAEs' convolutions (`AutoencoderKL`'s, Allegro's spatial ones): no transposes inside
/// cuDNN, the upsampled copy, bias and residual folded into the gather and the store. `None`
/// where it does not apply.
#[cfg(feature = "cuda")]
pub(crate) fn images_conv_channels_last(
    x: &Tensor,
    conv: (&Tensor, usize, usize),
    bias: &Tensor,
    residual: Option<&Tensor>,
) -> Result<Option<Tensor>> {
    images_conv_in_runs(x, conv, bias, residual, IMAGE_RUN_ELEMENTS)
}

/// [`images_conv_channels_last`] gathering about `run_elements` input elements a run.
#[cfg(feature = "cuda")]
fn images_conv_in_runs(
    x: &Tensor,
    (weight, pad, up): (&Tensor, usize, usize),
    bias: &Tensor,
    residual: Option<&Tensor>,
    run_elements: usize,
) -> Result<Option<Tensor>> {
    use crate::models::channel_ops::VideoLayout;
    let n = x.dim(0)?;
    let video = |t: &Tensor| t.unsqueeze(0);
    let residual = residual.map(video).transpose()?;
    let y = padded_conv_in_runs(
        (&video(x)?, None, VideoLayout::FramesMajor),
        (n, &|j| j as u32, up),
        (&weight.unsqueeze(2)?, 1, pad),
        bias,
        residual.as_ref(),
        run_elements,
    )?;
    y.map(|y| y.squeeze(0)).transpose()
}

/// [`padded_conv_channels_last`] of `x` in `layout` (the result in it too), gathering about
/// `run_elements` input elements a run.
#[cfg(feature = "cuda")]
fn padded_conv_in_runs(
    (x, front, layout): (
        &Tensor,
        Option<&Tensor>,
        crate::models::channel_ops::VideoLayout,
    ),
    (t_padded, source, up): (usize, &dyn Fn(usize) -> u32, usize),
    (weight, stride, pad): (&Tensor, usize, usize),
    bias: &Tensor,
    residual: Option<&Tensor>,
    run_elements: usize,
) -> Result<Option<Tensor>> {
    use crate::models::channel_ops::{Framing, VideoLayout};
    use candle_core::DType;
    if !(x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F32)
        && crate::models::norms::enabled()
        && computes(x.device(), x.dtype()))
    {
        return Ok(None);
    }
    let (b, t, cin, h, w) = layout.dims(x)?;
    let (h, w) = (h * up, w * up);
    let (cout, _, kt, kh, kw) = weight.dims5()?;
    let st = stride.max(1);
    if t == 0 || up == 0 || t_padded < kt || h + 2 * pad < kh || w + 2 * pad < kw {
        return Ok(None);
    }
    let t_out = (t_padded - kt) / st + 1;
    let (h_out, w_out) = ((h + 2 * pad - kh) / st + 1, (w + 2 * pad - kw) / st + 1);
    let shape = match layout {
        VideoLayout::ChannelsFirst => (b, cout, t_out, h_out, w_out),
        VideoLayout::FramesMajor => (b, t_out, cout, h_out, w_out),
    };
    // SAFETY: every run's frames are stored below before the result is returned.
    let out = unsafe { Tensor::empty(shape, x.dtype(), x.device()) }?;
    // The residual is added in the same store where it has the output's layout.
    let fused = residual.filter(|r| r.dims() == out.dims() && r.is_contiguous());
    let w_last = weight.permute((0, 2, 3, 4, 1))?.contiguous()?;
    let per_run = (run_elements / (b * cin * h * w * st).max(1)).clamp(1, t_out);
    for first in (0..t_out).step_by(per_run) {
        let n = per_run.min(t_out - first);
        let index: Vec<u32> = (first * st..(first + n - 1) * st + kt)
            .map(source)
            .collect();
        let stored = conv_frames_channels_last(
            (x, front, layout),
            &index,
            Framing { up, pad: (0, 0) },
            (&w_last, [st; 3], [0, pad, pad]),
            bias,
            &out,
            first,
            fused,
        )?;
        if !stored {
            // Every run has the first's shape but maybe the last: declined at the first.
            return match first {
                0 => Ok(None),
                _ => candle_core::bail!("a channels-last convolution declined a run"),
            };
        }
    }
    match fused {
        Some(_) => Ok(Some(out)),
        None => plus(out, residual).map(Some),
    }
}

/// Whether [`conv3d_channels_last`] runs the own kernel: where it outruns cuDNN, or where cuDNN
/// is not loaded and it takes the shape.
#[cfg(feature = "cuda")]
fn own_channels_last(x: &Tensor, w: &Tensor, stride: [usize; 3], padding: [usize; 3]) -> bool {
    kernel::outruns_cudnn(x, w, stride, padding, tf32())
        || (crate::models::cudnn::api().is_none()
            && kernel::takes_channels_last(x, w, stride, padding, tf32()))
}

/// How a VAE's activations lie in memory. cuDNN's tensor-core convolutions read channels last;
/// given channels first it transposes every input and output around them (a tenth of a Wan
/// decode's time), and its channels-last TF32 convolutions run 1.2-1.6x faster at the Wan
/// decoder's shapes; vidgen's own kernel reads channels last with 16-byte copies (4-byte
/// gathers channels first) and runs 1.1-1.5x faster there too (bench/RESULTS.md, session 14).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `[B, C, T, H, W]`, diffusers' layout (every device and path).
    ChannelsFirst,
    /// `[B, T, H, W, C]`, where cuDNN computes.
    ChannelsLast,
}

impl Layout {
    /// Channels last where [`conv3d_channels_last`] computes f32 on `device` (cuDNN loaded, or
    /// the own kernel's GPUs with TF32 allowed), else channels first.
    pub fn for_device(device: &Device) -> Self {
        #[cfg(feature = "cuda")]
        // The own kernel first: asking for cuDNN waits until its libraries are open.
        if device.is_cuda()
            && ((tf32() && kernel::available(device)) || crate::models::cudnn::api().is_some())
        {
            return Layout::ChannelsLast;
        }
        let _ = device;
        Layout::ChannelsFirst
    }

    /// The dim that indexes frames.
    pub fn time_dim(self) -> usize {
        match self {
            Layout::ChannelsFirst => 2,
            Layout::ChannelsLast => 1,
        }
    }

    /// The dim that indexes channels in a tensor of `rank` dims (`[N, C, ...]` channels first,
    /// `[..., C]` channels last: frames, images or rows of pixels alike).
    pub fn channel_dim(self, rank: usize) -> usize {
        match self {
            Layout::ChannelsFirst => 1,
            Layout::ChannelsLast => rank.saturating_sub(1),
        }
    }

    /// `(b, c, t, h, w)` of an activation in this layout.
    pub fn dims(self, x: &Tensor) -> Result<(usize, usize, usize, usize, usize)> {
        let (d0, d1, d2, d3, d4) = x.dims5()?;
        Ok(match self {
            Layout::ChannelsFirst => (d0, d1, d2, d3, d4),
            Layout::ChannelsLast => (d0, d4, d1, d2, d3),
        })
    }

    /// The dims of a `(b, c, t, h, w)` activation in this layout.
    pub fn shape(self, b: usize, c: usize, t: usize, h: usize, w: usize) -> [usize; 5] {
        match self {
            Layout::ChannelsFirst => [b, c, t, h, w],
            Layout::ChannelsLast => [b, t, h, w, c],
        }
    }

    /// `x` `[B, C, T, H, W]` (or a kernel `[C_out, C_in, kt, kh, kw]`) in this layout,
    /// contiguous.
    pub fn from_channels_first(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Layout::ChannelsFirst => x.contiguous(),
            Layout::ChannelsLast => x.permute((0, 2, 3, 4, 1))?.contiguous(),
        }
    }

    /// `x` in this layout (or a kernel) back to channels first, contiguous.
    pub fn to_channels_first(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Layout::ChannelsFirst => x.contiguous(),
            Layout::ChannelsLast => x.permute((0, 4, 1, 2, 3))?.contiguous(),
        }
    }
}

/// [`conv3d`] of `x` and `w` both in `layout` (the kernel `[C_out, kt, kh, kw, C_in]` when
/// channels last). Channels last runs through [`conv3d_channels_last`]; a shape it declines runs
/// channels first on transposed copies, through [`conv3d`] or else as the exact sum of 2D
/// convolutions. `None` where no accelerated path computes a channels-first convolution.
pub fn conv3d_in(
    layout: Layout,
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
) -> Result<Option<Tensor>> {
    if layout == Layout::ChannelsFirst {
        return conv3d(x, w, stride, padding);
    }
    if let Ok(Some(y)) = conv3d_channels_last(x, w, stride, padding) {
        return Ok(Some(y));
    }
    let (x, w) = (layout.to_channels_first(x)?, layout.to_channels_first(w)?);
    let y = match conv3d(&x, &w, stride, padding)? {
        Some(y) => y,
        None => tap_sum(&x, &w, stride, padding)?,
    };
    layout.from_channels_first(&y).map(Some)
}

/// [`conv3d_in`] then `+ bias` (per output channel, where given) and `+ residual`: added by the
/// own channels-last kernel as it stores the output where it computes (no pass over the
/// output), else left to the caller. `Some((y, true))` when they are in `y`.
pub fn conv3d_in_adding(
    layout: Layout,
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<Option<(Tensor, bool)>> {
    #[cfg(feature = "cuda")]
    if layout == Layout::ChannelsLast
        && (bias.is_some() || residual.is_some())
        && own_channels_last(x, w, stride, padding)
    {
        let y = kernel::conv3d_channels_last_with(x, w, stride, padding, bias, residual)?;
        return Ok(Some((y, true)));
    }
    let _ = (bias, residual);
    Ok(conv3d_in(layout, x, w, stride, padding)?.map(|y| (y, false)))
}

/// An upsampler's parity convolution `w` `[4 C, kt, kh, kw, C_in]` stored interleaved with
/// `bias` added (see [`kernel::conv3d_channels_last_parities`]) where the own channels-last
/// kernel computes it; `None` otherwise (the caller runs [`conv3d_in`] and interleaves).
pub fn conv3d_parities_in(
    layout: Layout,
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    bias: &Tensor,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if layout == Layout::ChannelsLast
        && w.dim(0)?.is_multiple_of(8)
        && own_channels_last(x, w, stride, padding)
    {
        return kernel::conv3d_channels_last_parities(x, w, stride, padding, Some(bias)).map(Some);
    }
    let _ = (layout, x, w, stride, padding, bias);
    Ok(None)
}

/// cuDNN's tensor descriptors hold sizes and strides as i32: no operand may have more
/// elements.
#[cfg(feature = "cuda")]
const CUDNN_MAX_ELEMENTS: usize = i32::MAX as usize;

/// `conv(x, padding)` (a 3D convolution by a kernel of dims `w`) where input and output hold at
/// most `max_elements`; a larger one (a 720x1280x129 decode's full-resolution layers hold 4.5
/// billion) runs over runs of output frames, each from a copy of the input frames it reads
/// (zero frames where the temporal padding reaches), into one output.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn in_frame_runs(
    x: &Tensor,
    w: &[usize],
    stride: [usize; 3],
    padding: [usize; 3],
    max_elements: usize,
    conv: impl Fn(&Tensor, [usize; 3]) -> Result<Tensor>,
) -> Result<Tensor> {
    let (b, c_in, t, h, wd) = x.dims5()?;
    let &[c_out, _, kt, kh, kw] = w else {
        candle_core::bail!("a 3D kernel has 5 dims, got {w:?}");
    };
    let out_len = |n: usize, k: usize, s: usize, p: usize| (n + 2 * p).saturating_sub(k) / s + 1;
    let frames_out = out_len(t, kt, stride[0], padding[0]);
    let out_frame =
        b * c_out * out_len(h, kh, stride[1], padding[1]) * out_len(wd, kw, stride[2], padding[2]);
    let in_frame = b * c_in * h * wd;
    if x.elem_count().max(frames_out * out_frame) <= max_elements {
        return conv(x, padding);
    }
    // Output frames per run: as many as keep the run's output and input within the bound.
    let reads = |n: usize| (n - 1) * stride[0] + kt;
    let per_run = (1..=frames_out)
        .take_while(|&n| n * out_frame <= max_elements && reads(n) * in_frame <= max_elements)
        .last()
        .ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "conv3d: one output frame of {x:?} by {w:?} exceeds {max_elements} elements",
                x = x.dims()
            ))
        })?;
    crate::models::runs::in_runs(frames_out, per_run, 2, |first, n| {
        // Input frames [start, end) in padded coordinates, shifted to x's.
        let start = (first * stride[0]) as isize - padding[0] as isize;
        let end = start + reads(n) as isize;
        let (lo, hi) = (start.max(0) as usize, (end.min(t as isize)).max(0) as usize);
        let zeros = |frames: usize| Tensor::zeros((b, c_in, frames, h, wd), x.dtype(), x.device());
        let mut parts = Vec::with_capacity(3);
        if start < 0 {
            parts.push(zeros((-start) as usize)?);
        }
        if hi > lo {
            parts.push(x.narrow(2, lo, hi - lo)?);
        }
        if end > t as isize {
            parts.push(zeros((end - t as isize) as usize)?);
        }
        conv(&Tensor::cat(&parts, 2)?, [0, padding[1], padding[2]])
    })
}

/// Runs `f`, a layer's whole-kernel path (its input padding, [`conv3d`] and the bias): an error
/// (cuDNN or the own kernel declining a shape, or no memory for the padded copy) becomes one
/// note on stderr and `None`, and the caller runs its own path instead.
pub fn or_fallback<T>(f: impl FnOnce() -> Result<Option<T>>) -> Option<T> {
    static NOTED: AtomicBool = AtomicBool::new(false);
    match f() {
        Ok(y) => y,
        Err(e) => {
            if !NOTED.swap(true, Ordering::Relaxed) {
                eprintln!("note: conv3d failed ({e}); the sum of 2D convolutions runs");
            }
            None
        }
    }
}

/// A convolution's fresh output `y` `[B, C, ...]` plus a per-channel `bias` (`C` values of
/// `y`'s dtype): on CUDA one pass of the fused kernel into `y`'s own memory (the same sums,
/// rounded once, as candle's broadcast add, which walks every dimension's index per element),
/// else candle's broadcast add.
pub fn add_channel_bias(y: Tensor, bias: &Tensor) -> Result<Tensor> {
    add_channel_bias_plus(y, bias, None)
}

/// [`add_channel_bias`], then plus `residual` (of `y`'s shape) where given: a resnet's
/// `conv(h) + x` in the same pass on CUDA (the same bits as the two adds).
pub fn add_channel_bias_plus(
    y: Tensor,
    bias: &Tensor,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let mut shape = vec![1; y.rank()];
    shape[1] = bias.elem_count();
    add_broadcast_plus(&y, &bias.reshape(shape)?, residual, true)
}

/// `y` `[B, C, F, ...]` plus `addend`, which `y` broadcasts over batch and frames (`[1, C, 1,
/// ...]` with ones or `y`'s sizes after, of `y`'s dtype): the fused kernel on CUDA, as
/// [`add_channel_bias`] (into a new tensor), else candle's broadcast add.
pub fn add_broadcast(y: &Tensor, addend: &Tensor) -> Result<Tensor> {
    add_broadcast_plus(y, addend, None, false)
}

/// [`add_broadcast`], then plus `residual` where given; stored into `y` where `in_place` (its
/// caller's own fresh tensor).
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn add_broadcast_plus(
    y: &Tensor,
    addend: &Tensor,
    residual: Option<&Tensor>,
    in_place: bool,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if y.device().is_cuda()
        && y.rank() >= 3
        && matches!(
            y.dtype(),
            candle_core::DType::BF16 | candle_core::DType::F32
        )
        && crate::models::norms::enabled()
    {
        let (dims, wanted) = (addend.dims(), y.dims());
        let over_batch_and_frames = dims.len() == wanted.len()
            && dims[0] == 1
            && dims[1] == wanted[1]
            && dims[2] == 1
            && (dims[3..].iter().all(|&d| d == 1) || dims[3..] == wanted[3..]);
        let fused_residual = residual.is_none_or(|r| r.dims() == wanted && r.is_contiguous());
        if over_batch_and_frames && addend.dtype() == y.dtype() && fused_residual {
            use crate::models::channel_ops::{add_channel_bias, BiasOut};
            let out = if in_place {
                BiasOut::InPlace
            } else {
                BiasOut::New
            };
            return add_channel_bias(y, &addend.flatten_all()?, out, residual);
        }
    }
    plus(y.broadcast_add(addend)?, residual)
}

/// `y + residual` (of one shape) where a residual is given, by runs along dim 1 (frames or
/// channels: the add is element-wise): candle's element-wise kernels index with 32 bits, and a
/// full-resolution activation can be larger (Mochi's at 85x480x848).
pub fn plus(y: Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
    let Some(r) = residual else {
        return Ok(y);
    };
    let len = y.dim(1)?;
    let per_slice = (y.elem_count() / len.max(1)).max(1);
    crate::models::runs::in_runs(len, PLUS_RUN_ELEMENTS / per_slice, 1, |first, n| {
        y.narrow(1, first, n)? + r.narrow(1, first, n)?
    })
}

/// Elements [`plus`] adds at once at most.
const PLUS_RUN_ELEMENTS: usize = 1 << 26;

/// `t` contiguous and starting on a 16-byte boundary (what cuDNN's vectorized kernels assume).
#[cfg(feature = "cuda")]
fn aligned(t: &Tensor) -> Result<Tensor> {
    let misaligned = !(t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16);
    if misaligned {
        t.force_contiguous()
    } else {
        t.contiguous()
    }
}

/// Cross-correlation of `x` `[B, C_in, T, H, W]` by `w` `[C_out, C_in, kt, kh, kw]` (zero
/// padding; height and width share stride and padding), no bias, on any device: [`conv3d`]
/// where an accelerated path computes it, else the exact sum of 2D convolutions.
pub fn conv3d_anywhere(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
) -> Result<Tensor> {
    if accelerated(x.device()) {
        if let Some(y) = or_fallback(|| conv3d(x, w, stride, padding)) {
            return Ok(y);
        }
    }
    tap_sum(x, w, stride, padding)
}

/// A 3D convolution as a sum of 2D ones over temporal taps (zero frames for the temporal
/// padding; height and width share stride and padding): exact on any device, the last resort of
/// [`conv3d_in`] and the tests' reference.
fn tap_sum(x: &Tensor, w: &Tensor, stride: [usize; 3], padding: [usize; 3]) -> Result<Tensor> {
    if padding[1] != padding[2] || stride[1] != stride[2] {
        candle_core::bail!("conv3d taps: height and width must share stride and padding")
    }
    let (b, c, t, h, wd) = x.dims5()?;
    let pad = Tensor::zeros((b, c, padding[0], h, wd), x.dtype(), x.device())?;
    let x = Tensor::cat(&[&pad, x, &pad], 2)?;
    let taps = split_taps(w)?;
    let frames = (t + 2 * padding[0] - taps.len()) / stride[0] + 1;
    let mut out = Vec::new();
    for o in 0..frames {
        let mut acc: Option<Tensor> = None;
        for (k, tap) in taps.iter().enumerate() {
            let frame = x
                .narrow(2, o * stride[0] + k, 1)?
                .squeeze(2)?
                .contiguous()?;
            let y = frame.conv2d(tap, padding[1], stride[1], 1, 1)?;
            acc = Some(match acc {
                Some(a) => (a + y)?,
                None => y,
            });
        }
        out.push(
            acc.ok_or_else(|| candle_core::Error::Msg("conv3d taps: an empty kernel".into()))?,
        );
    }
    Tensor::stack(&out, 2)
}

/// A 3D kernel `[C_out, C_in, kt, kh, kw]` as a causal conv keeps it: whole, run by [`conv3d`]
/// where it computes ([`accelerated`]), else split into its temporal taps at each use for the path
/// that sums 2D convolutions. Splitting at construction cost every load (and every recording of
/// a constructor, which sees placeholders on the CPU) a copy of every kernel: 0.8 s for the Wan
/// VAE, against a copy of each kernel per call on the CPU path, small beside its convolutions.
#[derive(Debug, Clone)]
pub struct Kernel3d {
    weight: Tensor,
    accelerated: bool,
}

impl Kernel3d {
    pub fn new(weight: Tensor) -> Result<Self> {
        weight.dims5()?;
        Ok(Self {
            accelerated: accelerated(weight.device()),
            weight,
        })
    }

    /// The whole kernel, where [`conv3d`] may run it.
    pub fn whole(&self) -> Option<&Tensor> {
        self.accelerated.then_some(&self.weight)
    }

    /// The kernel as given, on any device (for [`conv3d_in`], which computes everywhere).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The temporal taps, each `[C_out, C_in, kh, kw]` and contiguous (the path of a device
    /// [`conv3d`] does not compute on, or of a shape it declined).
    pub fn taps(&self) -> Result<Vec<Tensor>> {
        split_taps(&self.weight)
    }

    /// Temporal kernel size.
    pub fn kt(&self) -> Result<usize> {
        self.weight.dim(2)
    }

    /// `[C_out, C_in, kh, kw]` of one tap.
    pub fn tap_dims(&self) -> Result<(usize, usize, usize, usize)> {
        let (o, i, _, h, w) = self.weight.dims5()?;
        Ok((o, i, h, w))
    }
}

/// The temporal taps of a `[C_out, C_in, kt, kh, kw]` kernel.
fn split_taps(weight: &Tensor) -> Result<Vec<Tensor>> {
    (0..weight.dim(2)?)
        .map(|k| weight.narrow(2, k, 1)?.squeeze(2)?.contiguous())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A channels-last convolution no accelerated path takes (here: on the CPU) runs channels
    /// first as the exact tap sum and comes back channels last.
    #[test]
    fn channels_last_without_accelerator_is_the_exact_tap_sum() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1f32, (2, 3, 5, 6, 7), &dev)?;
        let w = Tensor::randn(0f32, 1f32, (4, 3, 3, 3, 3), &dev)?;
        let last = Layout::ChannelsLast;
        for (stride, padding) in [([1, 1, 1], [0, 1, 1]), ([2, 1, 1], [1, 0, 0])] {
            let want = tap_sum(&x, &w, stride, padding)?;
            let got = conv3d_in(
                last,
                &last.from_channels_first(&x)?,
                &last.from_channels_first(&w)?,
                stride,
                padding,
            )?
            .expect("the tap sum computes it");
            assert_eq!(got.dims(), last.from_channels_first(&want)?.dims());
            let diff = (last.to_channels_first(&got)? - &want)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "stride {stride:?} padding {padding:?}");
        }
        // The channels-first entry declines instead (its callers run their own path).
        assert!(conv3d_in(Layout::ChannelsFirst, &x, &w, [1, 1, 1], [0, 1, 1])?.is_none());
        Ok(())
    }

    /// Runs of output frames (temporal padding and stride included) give exactly the whole
    /// convolution; a bound below one output frame is an error, not a wrong result.
    #[test]
    fn frame_runs_equal_the_whole_convolution() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1f32, (1, 3, 9, 6, 5), &dev)?;
        let w = Tensor::randn(0f32, 1f32, (4, 3, 3, 3, 3), &dev)?;
        for (stride, padding) in [
            ([1, 1, 1], [1, 1, 1]),
            ([2, 1, 1], [2, 1, 1]),
            ([1, 1, 1], [0, 0, 0]),
        ] {
            let conv = |x: &Tensor, p: [usize; 3]| tap_sum(x, &w, stride, p);
            let whole = in_frame_runs(&x, w.dims(), stride, padding, usize::MAX, conv)?;
            assert_eq!(whole.dims(), tap_sum(&x, &w, stride, padding)?.dims());
            // x has 810 elements: runs of one to a few frames.
            for max_elements in [300, 450, 700] {
                let runs = in_frame_runs(&x, w.dims(), stride, padding, max_elements, conv)?;
                let diff = (&runs - &whole)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?;
                assert_eq!(
                    diff, 0.0,
                    "stride {stride:?} padding {padding:?} bound {max_elements}"
                );
            }
        }
        assert!(
            in_frame_runs(&x, w.dims(), [1, 1, 1], [1, 1, 1], 100, |x, p| tap_sum(
                x,
                &w,
                [1, 1, 1],
                p
            ))
            .is_err()
        );
        Ok(())
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    use super::*;
    use candle_core::DType;

    /// Whether cuDNN is loaded: the cuDNN tests skip without it.
    fn cudnn_loaded() -> bool {
        crate::models::cudnn::api().is_some()
    }

    /// The GPU, where the own kernel runs on it.
    fn own_kernel_device() -> Option<Device> {
        let dev = Device::new_cuda(0).ok().filter(kernel::available);
        if dev.is_none() {
            eprintln!("no CUDA device of compute capability 8.0+: conv3d kernel test skipped");
        }
        dev
    }

    /// Max over outputs of |`got` - exact| / sum |w||x| (exact: the tap sum in f64 on the CPU,
    /// of `x` and `w` as they are), where `got` is `x` by `w` (height and width share stride
    /// and padding).
    fn error_per_magnitude(
        got: &Tensor,
        x: &Tensor,
        w: &Tensor,
        stride: [usize; 3],
        padding: [usize; 3],
    ) -> Result<f64> {
        let f64_cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F64);
        let (x, w) = (f64_cpu(x)?, f64_cpu(w)?);
        let exact = tap_sum(&x, &w, stride, padding)?;
        let magnitude = tap_sum(&x.abs()?, &w.abs()?, stride, padding)?;
        let got = f64_cpu(got)?;
        assert_eq!(got.dims(), exact.dims());
        ((got - exact)?.abs()? / (magnitude + 1e-30)?)?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()
    }

    /// (x dims, w dims, stride, padding): odd channel counts and sizes, batch 2, strides, 1- and
    /// 3-frame kernels, padding on every dimension, more channels than one block holds.
    type Case = ([usize; 5], [usize; 5], [usize; 3], [usize; 3]);
    const CASES: [Case; 6] = [
        ([2, 3, 5, 9, 11], [12, 3, 3, 3, 3], [1, 1, 1], [1, 1, 1]),
        ([1, 5, 4, 13, 7], [7, 5, 1, 3, 3], [1, 2, 2], [0, 1, 1]),
        ([1, 20, 7, 10, 12], [70, 20, 3, 3, 3], [2, 1, 1], [2, 0, 0]),
        ([1, 96, 4, 17, 33], [96, 96, 3, 3, 3], [1, 1, 1], [0, 1, 1]),
        ([2, 40, 3, 8, 9], [136, 40, 1, 1, 1], [1, 1, 1], [0, 0, 0]),
        ([1, 16, 3, 31, 5], [33, 16, 3, 3, 3], [1, 2, 2], [1, 1, 1]),
    ];

    /// The own kernel in TF32 (every compiled configuration) within TF32's rounding of the exact
    /// convolution: each product's operands are rounded to 10 mantissa bits, so an output is off
    /// by at most about 2^-10 of sum |w||x|.
    #[test]
    fn own_kernel_tf32_matches_tap_sum() -> Result<()> {
        let Some(dev) = own_kernel_device() else {
            return Ok(());
        };
        for (xd, wd, stride, padding) in CASES {
            let x = Tensor::randn(0f32, 1f32, &xd[..], &dev)?;
            let w = Tensor::randn(0f32, 1f32, &wd[..], &dev)?;
            for tile in kernel::tiles(wd[0], DType::F32) {
                let y = kernel::conv3d_tile(&x, &w, stride, padding, Some(tile))?;
                let err = error_per_magnitude(&y, &x, &w, stride, padding)?;
                assert!(err < 1e-3, "{xd:?} by {wd:?}, {tile:?}: {err:.2e}");
            }
        }
        Ok(())
    }

    /// The own kernel in bf16 (f32 accumulation, the output rounded to bf16) against the exact
    /// convolution of the same bf16 values.
    #[test]
    fn own_kernel_bf16_matches_tap_sum() -> Result<()> {
        let Some(dev) = own_kernel_device() else {
            return Ok(());
        };
        for (xd, wd, stride, padding) in CASES {
            let x = Tensor::randn(0f32, 1f32, &xd[..], &dev)?.to_dtype(DType::BF16)?;
            let w = Tensor::randn(0f32, 1f32, &wd[..], &dev)?.to_dtype(DType::BF16)?;
            for tile in kernel::tiles(wd[0], DType::BF16) {
                let y = kernel::conv3d_tile(&x, &w, stride, padding, Some(tile))?;
                assert_eq!(y.dtype(), DType::BF16);
                let err = error_per_magnitude(&y, &x, &w, stride, padding)?;
                assert!(err < 5e-3, "{xd:?} by {wd:?}, {tile:?}: {err:.2e}");
            }
        }
        Ok(())
    }

    /// Without cuDNN, [`conv3d`] runs the own kernel where TF32 is allowed and declines exact
    /// f32 (the tap sum runs); with cuDNN it runs both.
    #[test]
    fn conv3d_without_cudnn_runs_the_own_kernel_in_tf32_only() -> Result<()> {
        let Some(dev) = own_kernel_device() else {
            return Ok(());
        };
        assert!(accelerated(&dev));
        let x = Tensor::randn(0f32, 1f32, (1, 8, 4, 6, 10), &dev)?;
        let w = Tensor::randn(0f32, 1f32, (16, 8, 3, 3, 3), &dev)?;
        let tf32 = conv3d_math(&x, &w, [1, 1, 1], [0, 1, 1], true)?;
        let exact = conv3d_math(&x, &w, [1, 1, 1], [0, 1, 1], false)?;
        assert_eq!(exact.is_some(), cudnn_loaded());
        let y = tf32.expect("TF32 convolutions always run on CUDA");
        let err = error_per_magnitude(&y, &x, &w, [1, 1, 1], [0, 1, 1])?;
        assert!(err < 1e-3, "TF32 conv3d: {err:.2e}");
        Ok(())
    }

    /// cuDNN's convolution in exact f32 against the tap sum of 2D convolutions.
    #[test]
    fn cudnn_conv3d_matches_tap_sum() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: cuDNN conv3d test skipped");
            return Ok(());
        };
        if !cudnn_loaded() {
            eprintln!("no cuDNN: cuDNN conv3d test skipped");
            return Ok(());
        }
        let x = Tensor::randn(0f32, 1f32, (2, 5, 4, 9, 11), &dev)?;
        let w = Tensor::randn(0f32, 1f32, (6, 5, 3, 3, 3), &dev)?;
        let y = conv3d_math(&x, &w, [1, 1, 1], [0, 1, 1], false)?;
        let y = y.expect("cuDNN ran the convolution");
        let taps = split_taps(&w)?;
        let mut frames = Vec::new();
        for o in 0..2 {
            let mut acc = x
                .narrow(2, o, 1)?
                .squeeze(2)?
                .contiguous()?
                .conv2d(&taps[0], 1, 1, 1, 1)?;
            for (k, tap) in taps.iter().enumerate().skip(1) {
                let frame = x.narrow(2, o + k, 1)?.squeeze(2)?.contiguous()?;
                acc = (acc + frame.conv2d(tap, 1, 1, 1, 1)?)?;
            }
            frames.push(acc);
        }
        let reference = Tensor::stack(&frames, 2)?;
        assert_eq!(y.dims(), reference.dims());
        let err = (y - reference)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(err < 1e-4, "max |cuDNN - taps| {err:.2e}");
        Ok(())
    }

    /// Where the own channels-last kernel computes (TF32; the Wan decoder's 96-channel shapes,
    /// with or without cuDNN), `conv3d_in_adding` adds the bias and the residual as it stores:
    /// the same bits as the convolution followed by the two adds.
    #[test]
    fn adding_in_the_kernel_equals_adding_after() -> Result<()> {
        let Some(dev) = own_kernel_device() else {
            return Ok(());
        };
        let _tf32 = tf32_here(true);
        let (c_in, c_out) = (96, 96);
        let x = Tensor::randn(0f32, 1f32, (1, 4, 18, 20, c_in), &dev)?;
        let w = (Tensor::randn(0f32, 1f32, (c_out, 3, 3, 3, c_in), &dev)? / 50.0)?;
        let bias = Tensor::randn(0f32, 1f32, c_out, &dev)?;
        let residual = Tensor::randn(0f32, 1f32, (1, 2, 18, 20, c_out), &dev)?;
        let (stride, padding) = ([1, 1, 1], [0, 1, 1]);
        let layout = Layout::ChannelsLast;
        let plain = conv3d_in(layout, &x, &w, stride, padding)?.expect("a CUDA path ran");
        let after = (plain.broadcast_add(&bias)? + &residual)?;
        let (added, in_kernel) = conv3d_in_adding(
            layout,
            &x,
            &w,
            stride,
            padding,
            Some(&bias),
            Some(&residual),
        )?
        .expect("a CUDA path ran");
        assert!(
            in_kernel,
            "the own kernel did not add the bias and the residual"
        );
        let diff = (added - after)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "in the kernel vs after it: {diff:.2e}");
        Ok(())
    }

    /// Channels last (NDHWC activations, `[C_out, kt, kh, kw, C_in]` filters) computes the same
    /// convolution as channels first: exact f32 to f32 rounding, bf16 to a few bf16 ulps.
    #[test]
    fn channels_last_equals_channels_first() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: cuDNN conv3d test skipped");
            return Ok(());
        };
        if !cudnn_loaded() {
            eprintln!("no cuDNN: cuDNN conv3d test skipped");
            return Ok(());
        }
        let _exact = tf32_here(false);
        let x = Tensor::randn(0f32, 1f32, (2, 32, 5, 12, 20), &dev)?;
        let w = (Tensor::randn(0f32, 1f32, (16, 32, 3, 3, 3), &dev)? / (32.0 * 27.0f64).sqrt())?;
        for (dtype, tolerance) in [(DType::F32, 1e-4f32), (DType::BF16, 5e-2)] {
            let (x, w) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?);
            let first = conv3d(&x, &w, [1, 2, 2], [0, 1, 1])?.expect("cuDNN ran");
            let last = conv3d_channels_last(
                &x.permute((0, 2, 3, 4, 1))?.contiguous()?,
                &w.permute((0, 2, 3, 4, 1))?.contiguous()?,
                [1, 2, 2],
                [0, 1, 1],
            )?
            .expect("cuDNN ran");
            let last = last.permute((0, 4, 1, 2, 3))?;
            assert_eq!(first.dims(), last.dims());
            let err = (first.to_dtype(DType::F32)? - last.to_dtype(DType::F32)?)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(err < tolerance, "{dtype:?}: max |last - first| {err:.2e}");
        }
        Ok(())
    }

    /// A causal convolution channels last with its context frames read from a second tensor
    /// (CogVideoX's cache) or repeated from x's first frame, in runs of output frames, against
    /// the composition it replaces: the padded input concatenated, convolved channels first,
    /// plus the bias and a residual. Exact f32 to f32 rounding, bf16 to a few bf16 ulps.
    #[test]
    fn padded_channels_last_equals_the_concatenated_convolution() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: padded channels-last test skipped");
            return Ok(());
        };
        if !cudnn_loaded() {
            eprintln!("no cuDNN: padded channels-last test skipped");
            return Ok(());
        }
        let _exact = tf32_here(false);
        let (cin, cout, t, h, w) = (24, 40, 5, 9, 14);
        let x = Tensor::randn(0f32, 1f32, (1, cin, t, h, w), &dev)?;
        let context = Tensor::randn(0f32, 1f32, (1, cin, 2, h, w), &dev)?;
        let weight = (Tensor::randn(0f32, 1f32, (cout, cin, 3, 3, 3), &dev)? / 27.0)?;
        let bias = Tensor::randn(0f32, 1f32, cout, &dev)?;
        let residual = Tensor::randn(0f32, 1f32, (1, cout, t, h, w), &dev)?;
        for (dtype, tolerance) in [(DType::F32, 1e-4f32), (DType::BF16, 6e-2)] {
            let cast = |v: &Tensor| v.to_dtype(dtype);
            let (x, context, weight) = (cast(&x)?, cast(&context)?, cast(&weight)?);
            let (bias, residual) = (cast(&bias)?, cast(&residual)?);
            let first = x.narrow(2, 0, 1)?;
            for (front, padded, runs) in [
                (Some(&context), Tensor::cat(&[&context, &x], 2)?, false),
                (None, Tensor::cat(&[&first, &first, &x], 2)?, false),
                (Some(&context), Tensor::cat(&[&context, &x], 2)?, true),
            ] {
                let want = conv3d(&padded, &weight, [1; 3], [0, 1, 1])?.expect("cuDNN ran");
                let want = want
                    .to_dtype(DType::F32)?
                    .broadcast_add(&bias.to_dtype(DType::F32)?.reshape((1, cout, 1, 1, 1))?)?
                    .to_dtype(dtype)?;
                let want = (want + &residual)?;
                let source = |j: usize| match front {
                    Some(_) => j as u32,
                    None => j.saturating_sub(2) as u32,
                };
                // Two output frames a run where `runs` (as a large activation runs).
                let run_elements = if runs { 2 * cin * h * w } else { RUN_ELEMENTS };
                let got = padded_conv_in_runs(
                    (
                        &x,
                        front,
                        crate::models::channel_ops::VideoLayout::ChannelsFirst,
                    ),
                    (t + 2, &source, 1),
                    (&weight, 1, 1),
                    &bias,
                    Some(&residual),
                    run_elements,
                )?
                .expect("a channels-last convolution ran");
                assert_eq!(got.dims(), want.dims());
                let err = (got.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?;
                let what = format!("{dtype:?}, context {}, runs {runs}", front.is_some());
                assert!(err < tolerance, "{what}: max |got - want| {err:.2e}");
            }
        }
        Ok(())
    }

    /// Images convolved as the frames of one channels-last video (the image VAEs' path), each
    /// upsampled first where asked, in runs of images, against candle's f32 2D convolution of the
    /// same operands (rounded to the dtype first) upsampled, plus the bias, rounded to the dtype,
    /// plus a residual (a 3x3 and a 1x1 kernel). Within f32 rounding, and bf16 within a few of
    /// its ulps (the output's roundings), relative to 1 + |convolution| + |want|.
    #[test]
    fn images_channels_last_equal_candles_conv2d() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: channels-last image test skipped");
            return Ok(());
        };
        if !computes(&dev, DType::BF16) {
            eprintln!("no channels-last convolution here: image test skipped");
            return Ok(());
        }
        let _exact = tf32_here(false);
        let (n, cin, cout, h, w) = (5, 24, 40, 9, 14);
        for (k, pad, up) in [(3, 1, 1), (3, 1, 2), (1, 0, 1)] {
            let x = Tensor::randn(0f32, 1f32, (n, cin, h, w), &dev)?;
            let weight = (Tensor::randn(0f32, 1f32, (cout, cin, k, k), &dev)? / (k * k) as f64)?;
            let bias = Tensor::randn(0f32, 1f32, cout, &dev)?;
            let residual = Tensor::randn(0f32, 1f32, (n, cout, h * up, w * up), &dev)?;
            for (dtype, tolerance) in [(DType::F32, 1e-5f32), (DType::BF16, 1.2e-2)] {
                let cast = |v: &Tensor| v.to_dtype(dtype);
                let (x, weight) = (cast(&x)?, cast(&weight)?);
                let (bias, residual) = (cast(&bias)?, cast(&residual)?);
                let f32 = |v: &Tensor| v.to_dtype(DType::F32);
                let conv = f32(&x)?.upsample_nearest2d(h * up, w * up)?.conv2d(
                    &f32(&weight)?,
                    pad,
                    1,
                    1,
                    1,
                )?;
                let want = conv.broadcast_add(&f32(&bias)?.reshape((1, cout, 1, 1))?)?;
                let want = f32(&(cast(&want)? + &residual)?)?;
                // The convolution is rounded before the bias is added: its magnitude counts too.
                let scale = ((want.abs()? + conv.abs()?)? + 1.0)?;
                // Two images a run where `runs` (as a large activation runs).
                for runs in [false, true] {
                    let run_elements = if runs {
                        2 * cin * h * w * up * up
                    } else {
                        RUN_ELEMENTS
                    };
                    let got = images_conv_in_runs(
                        &x,
                        (&weight, pad, up),
                        &bias,
                        Some(&residual),
                        run_elements,
                    )?
                    .expect("a channels-last convolution ran");
                    assert_eq!(got.dims(), want.dims());
                    let err = ((f32(&got)? - &want)?.abs()? / &scale)?
                        .flatten_all()?
                        .max(0)?
                        .to_scalar::<f32>()?;
                    let what = format!("{dtype:?}, {k}x{k} up {up}, runs {runs}");
                    assert!(err < tolerance, "{what}: max relative error {err:.2e}");
                }
            }
        }
        Ok(())
    }

    /// A convolution large enough that its algorithm is chosen by timing (TF32 and exact math
    /// tried): exact f32 stays exact, TF32 within TF32's rounding, against the tap sum.
    #[test]
    fn timed_cudnn_conv3d_matches_tap_sum() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: cuDNN conv3d test skipped");
            return Ok(());
        };
        if !cudnn_loaded() {
            eprintln!("no cuDNN: cuDNN conv3d test skipped");
            return Ok(());
        }
        // The search is asked for (it is off by default) in a process of its own: it is read from
        // the environment whenever a shape's plan is made, by any test running beside this one.
        use crate::models::kernel_module::isolated;
        let test = "models::conv3d::cuda_tests::timed_cudnn_conv3d_matches_tap_sum";
        if !isolated::is_child(test) {
            let timed = Some("timed".to_string());
            return isolated::run(test, &[(crate::models::cudnn::conv::SEARCH_ENV, timed)])
                .map_err(|e| candle_core::Error::Msg(format!("{e:#}")));
        }
        // 2 * 96 * 96 * 27 * (2 * 94 * 94) = 17.6 GFLOP: above the timing threshold.
        let x = Tensor::randn(0f32, 1f32, (1, 96, 4, 96, 96), &dev)?;
        let w = Tensor::randn(0f32, 0.02f32, (96, 96, 3, 3, 3), &dev)?;
        let taps = split_taps(&w)?;
        let mut frames = Vec::new();
        for o in 0..2 {
            let mut acc: Option<Tensor> = None;
            for (k, tap) in taps.iter().enumerate() {
                let frame = x.narrow(2, o + k, 1)?.squeeze(2)?.contiguous()?;
                let y = frame.conv2d(tap, 0, 1, 1, 1)?;
                acc = Some(match acc {
                    Some(a) => (a + y)?,
                    None => y,
                });
            }
            frames.push(acc.expect("three taps"));
        }
        let reference = Tensor::stack(&frames, 2)?;
        let scale = reference.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        for (tf32, tolerance) in [(false, 1e-5f32), (true, 5e-3)] {
            let y = conv3d_math(&x, &w, [1, 1, 1], [0, 0, 0], tf32)?;
            let y = y.expect("cuDNN ran the convolution");
            let err = (y - &reference)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(
                err / scale < tolerance,
                "tf32 {tf32}: max |cuDNN - taps| {err:.2e} of {scale:.2e}"
            );
        }
        Ok(())
    }
}
