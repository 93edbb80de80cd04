//! The moves around the VAEs' convolutions (`channel_ops.cu`), each one pass over memory: a
//! convolution's per-channel bias (optionally stored frames-major into a larger output), and the
//! frames a causal convolution reads gathered with replicate padding into its layout, and a
//! per-position Linear's channels expanded into frames, rows and columns (depth to space).

use candle_core::{DType, Result, Tensor};

use crate::models::kernel_module::{item_launch, kernel_module, row_launch, Arg, Module};

static CHANNEL_OPS: Module = kernel_module!("channel_ops");

/// The kernel of `name` for `x`'s dtype (bf16 or f32).
fn func(name: &str, x: &Tensor) -> Result<&'static str> {
    Ok(match (name, x.dtype()) {
        ("add_channel_bias", DType::BF16) => "add_channel_bias_bf16",
        ("add_channel_bias", DType::F32) => "add_channel_bias_f32",
        ("gather_padded_frames", DType::BF16) => "gather_padded_frames_bf16",
        ("gather_padded_frames", DType::F32) => "gather_padded_frames_f32",
        ("gather_padded_frames_cl", DType::BF16) => "gather_padded_frames_cl_bf16",
        ("gather_padded_frames_cl", DType::F32) => "gather_padded_frames_cl_f32",
        ("store_channels_last", DType::BF16) => "store_channels_last_bf16",
        ("store_channels_last", DType::F32) => "store_channels_last_f32",
        ("depth_to_space", DType::BF16) => "depth_to_space_bf16",
        ("depth_to_space", DType::F32) => "depth_to_space_f32",
        (name, other) => candle_core::bail!("{name} kernel: {other:?} activations"),
    })
}

/// A bias (or addend) as the kernels read it: f32, flat, contiguous.
fn f32_values(bias: &Tensor) -> Result<Tensor> {
    bias.to_dtype(DType::F32)?.flatten_all()?.contiguous()
}

/// Where [`add_channel_bias`] stores.
pub(crate) enum BiasOut<'a> {
    /// A new tensor of `y`'s shape.
    New,
    /// `y`'s own memory, where `y` is contiguous (else a new tensor): for a convolution's fresh
    /// output, which nothing else holds (one activation less at a decode's peak).
    InPlace,
    /// Frames `first..first + F` of a frames-major `[B, T, C, ...]` output, in place.
    FramesOf(&'a Tensor, usize),
}

/// `y` `[B, C, F, ...]` (bf16 or f32, on CUDA) plus `bias` of `y`'s dtype: `C` values (one per
/// channel), or `C` times the positions of a frame (an addend broadcast over batch and frames),
/// each sum rounded once as candle's add: a new tensor, or stored frames-major into `out`.
/// With `residual` (contiguous, of the stored layout: `y`'s, or `out`'s whole), each rounded
/// sum plus the residual's element where it is stored, rounded again: a resnet's
/// `conv(h) + x` in one store, the same bits as candle's two adds.
pub(crate) fn add_channel_bias(
    y: &Tensor,
    bias: &Tensor,
    out: BiasOut,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let func = func("add_channel_bias", y)?;
    let dims = y.dims();
    let spatial: usize = dims.get(3..).map_or(0, |d| d.iter().product());
    let per_position = dims.len() >= 3 && spatial > 1 && bias.elem_count() == dims[1] * spatial;
    if dims.len() < 3
        || !(bias.elem_count() == dims[1] || per_position)
        || bias.dtype() != y.dtype()
    {
        candle_core::bail!(
            "channel bias: {:?} and a bias of {:?}",
            y.shape(),
            bias.shape()
        )
    }
    let (b, c, frames) = (dims[0], dims[1], dims[2]);
    let in_place = matches!(out, BiasOut::InPlace) && y.is_contiguous();
    let y = y.contiguous()?;
    let bias = f32_values(bias)?;
    let (dst, frames_major, out_frames, first) = match out {
        BiasOut::InPlace if in_place => (y.clone(), false, frames, 0),
        BiasOut::New | BiasOut::InPlace => {
            // SAFETY: the kernel writes every element before anything reads it.
            let dst = unsafe { Tensor::empty(y.shape(), y.dtype(), y.device()) }?;
            (dst, false, frames, 0)
        }
        BiasOut::FramesOf(out, first) => {
            let od = out.dims();
            let fits = od.len() == dims.len()
                && od[0] == b
                && od[2] == c
                && first + frames <= od[1]
                && od[3..] == dims[3..]
                && out.dtype() == y.dtype()
                && out.is_contiguous();
            if !fits {
                candle_core::bail!(
                    "channel bias: {:?} as frames {first}.. of {:?}",
                    y.shape(),
                    out.shape()
                )
            }
            (out.clone(), true, od[1], first)
        }
    };
    if let Some(r) = residual {
        if r.dims() != dst.dims() || r.dtype() != y.dtype() || !r.is_contiguous() {
            candle_core::bail!(
                "channel bias: a residual of {:?} for a store of {:?}",
                r.shape(),
                dst.shape()
            )
        }
    }
    // 16-byte items where every row starts 16-byte aligned in every tensor.
    let lanes = 16 / y.dtype().size_in_bytes();
    let vector = spatial.is_multiple_of(lanes)
        && y.layout().start_offset().is_multiple_of(lanes)
        && dst.layout().start_offset().is_multiple_of(lanes)
        && residual.is_none_or(|r| r.layout().start_offset().is_multiple_of(lanes));
    let items = y.elem_count() / if vector { lanes } else { 1 };
    dst.inplace_op1(&item_launch(
        &CHANNEL_OPS,
        func,
        items,
        vec![
            // In place, the destination's own pointer: its storage is locked for writing.
            if in_place {
                Arg::Dst
            } else {
                Arg::Tensor(Some(&y))
            },
            Arg::Dst,
            Arg::Tensor(Some(&bias)),
            Arg::Tensor(residual),
            Arg::Int(c as i32),
            Arg::Long(frames as i64),
            Arg::Long(spatial as i64),
            Arg::Long(items as i64),
            Arg::Int(i32::from(frames_major)),
            Arg::Long(out_frames as i64),
            Arg::Long(first as i64),
            Arg::Int(i32::from(vector)),
            Arg::Int(i32::from(per_position)),
        ],
    ))?;
    Ok(dst)
}

/// How a video's frames and channels lie in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum VideoLayout {
    /// `[B, T, C, H, W]`: the VAEs that run their frames as images (HunyuanVideo, Mochi-1).
    FramesMajor,
    /// `[B, C, T, H, W]`: diffusers' layout (LTX-Video).
    ChannelsFirst,
}

impl VideoLayout {
    /// `(B, T, C, H, W)` of a video in this layout.
    pub(crate) fn dims(self, video: &Tensor) -> Result<(usize, usize, usize, usize, usize)> {
        let (b, d1, d2, h, w) = video.dims5()?;
        Ok(match self {
            VideoLayout::FramesMajor => (b, d1, d2, h, w),
            VideoLayout::ChannelsFirst => (b, d2, d1, h, w),
        })
    }
}

/// How a gather frames each source image: upsampled `up` times in height and width (nearest,
/// as `F.interpolate(scale_factor=up)`), then its edges replicated `pad` (height, width) outwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Framing {
    pub up: usize,
    pub pad: (usize, usize),
}

impl Framing {
    /// Edges replicated `pad` (height, width) outwards, no upsampling.
    pub(crate) const fn padded(pad: (usize, usize)) -> Self {
        Self { up: 1, pad }
    }
}

/// `[B, C, N, H + 2 pad_h, W + 2 pad_w]` from the frames-major `x` `[B, T, C, H, W]` (bf16 or
/// f32, on CUDA): frame `n` is `x`'s frame `index[n]`, its edges replicated outwards.
pub(crate) fn gather_padded_frames(
    x: &Tensor,
    index: &[u32],
    pad_h: usize,
    pad_w: usize,
) -> Result<Tensor> {
    gather((x, None), index, Framing::padded((pad_h, pad_w)), None)
}

/// [`gather_padded_frames`] into cuDNN's channels-last layout, from `x` in `layout` behind the
/// frames of `front` (of `x`'s layout, batch, channels and size; a causal convolution's context
/// kept from the previous chunk), each image framed as `framing` says: `[B, N, H up + 2 pad_h,
/// W up + 2 pad_w, C]`, in one tiled pass (cuDNN transposes a channels-first input itself, one
/// more pass). `index[n]` below `front`'s frame count F names a frame of `front`, any other
/// `x`'s frame `index[n] - F`.
pub(crate) fn gather_padded_frames_channels_last(
    (x, front): (&Tensor, Option<&Tensor>),
    index: &[u32],
    framing: Framing,
    layout: VideoLayout,
) -> Result<Tensor> {
    gather((x, front), index, framing, Some(layout))
}

/// The padded frames `index` of `front` and then `x`, channels first from a frames-major `x`
/// (a warp per output row; no `front`), or last from `x` in the layout given (a block per
/// output line).
fn gather(
    (x, front): (&Tensor, Option<&Tensor>),
    index: &[u32],
    Framing {
        up,
        pad: (pad_h, pad_w),
    }: Framing,
    last: Option<VideoLayout>,
) -> Result<Tensor> {
    if !up.is_power_of_two() || (up > 1 && last.is_none()) {
        candle_core::bail!("gather frames: upsampling by {up} (channels last only, a power of 2)")
    }
    let layout = last.unwrap_or(VideoLayout::FramesMajor);
    let (b, t, c, h, w) = layout.dims(x)?;
    let front = front.map(|f| f.contiguous()).transpose()?;
    let ahead = match &front {
        Some(f) => {
            let (fb, ft, fc, fh, fw) = layout.dims(f)?;
            if last.is_none() || (fb, fc, fh, fw) != (b, c, h, w) {
                candle_core::bail!("gather frames: {:?} ahead of {:?}", f.shape(), x.shape())
            }
            ft
        }
        None => 0,
    };
    if index.iter().any(|&i| i as usize >= ahead + t) || h == 0 || w == 0 || c == 0 {
        candle_core::bail!("gather frames: {index:?} of {:?}", x.shape())
    }
    let x = x.contiguous()?;
    let n = index.len();
    let (hp, wp) = (h * up + 2 * pad_h, w * up + 2 * pad_w);
    let shape = match last {
        Some(_) => (b, n, hp, wp, c),
        None => (b, c, n, hp, wp),
    };
    // SAFETY: the kernel writes every element before anything reads it.
    let out = unsafe { Tensor::empty(shape, x.dtype(), x.device()) }?;
    let index = Tensor::new(index, x.device())?;
    // Channels last: output lines (a block each); else output rows (a warp each).
    let items = match last {
        Some(_) => b * n * hp,
        None => b * c * n * hp,
    };
    let mut args = vec![Arg::Tensor(Some(&x))];
    if last.is_some() {
        args.extend([Arg::Tensor(front.as_ref()), Arg::Long(ahead as i64)]);
    }
    args.extend([
        Arg::Dst,
        Arg::Tensor(Some(&index)),
        Arg::Int(c as i32),
        Arg::Long(t as i64),
        Arg::Long(n as i64),
        Arg::Int(h as i32),
        Arg::Int(w as i32),
    ]);
    if last.is_some() {
        // The kernel divides by `up` as a shift.
        args.push(Arg::Int(up.trailing_zeros() as i32));
    }
    args.extend([
        Arg::Int(pad_h as i32),
        Arg::Int(pad_w as i32),
        Arg::Long(items as i64),
    ]);
    out.inplace_op1(&match last {
        Some(layout) => {
            args.push(Arg::Int(i32::from(layout == VideoLayout::ChannelsFirst)));
            let func = func("gather_padded_frames_cl", &x)?;
            row_launch(&CHANNEL_OPS, func, items.min(MAX_LINE_BLOCKS), args)
        }
        None => item_launch(
            &CHANNEL_OPS,
            func("gather_padded_frames", &x)?,
            items * 32,
            args,
        ),
    })?;
    Ok(out)
}

/// Blocks a channels-last move launches at most, a line of output at a time (grid-stride over
/// the rest).
const MAX_LINE_BLOCKS: usize = 1 << 16;

/// A channels-last convolution output `y` `[B, N, H, W, C]` plus its per-channel `bias` (and
/// `residual`, of `out`'s shape, where given), stored as frames `first..first + N` of `out` in
/// `layout`: [`add_channel_bias`]'s sums and roundings, transposed in the same pass.
pub(crate) fn store_channels_last(
    y: &Tensor,
    bias: &Tensor,
    (out, layout): (&Tensor, VideoLayout),
    first: usize,
    residual: Option<&Tensor>,
) -> Result<()> {
    let func = func("store_channels_last", y)?;
    let (b, n, h, w, c) = y.dims5()?;
    let (ob, ot, oc, oh, ow) = layout.dims(out)?;
    let fits = (ob, oc, oh, ow) == (b, c, h, w)
        && first + n <= ot
        && out.dtype() == y.dtype()
        && out.is_contiguous()
        && bias.elem_count() == c
        && residual.is_none_or(|r| r.dims() == out.dims() && r.is_contiguous());
    if !fits {
        candle_core::bail!(
            "channels-last store: {:?} as frames {first}.. of {:?}",
            y.shape(),
            out.shape()
        )
    }
    let y = y.contiguous()?;
    let bias = f32_values(bias)?;
    let lines = b * n * h;
    out.inplace_op1(&row_launch(
        &CHANNEL_OPS,
        func,
        lines.min(MAX_LINE_BLOCKS),
        vec![
            Arg::Tensor(Some(&y)),
            Arg::Dst,
            Arg::Tensor(Some(&bias)),
            Arg::Tensor(residual),
            Arg::Int(c as i32),
            Arg::Long(n as i64),
            Arg::Int(h as i32),
            Arg::Int(w as i32),
            Arg::Long(ot as i64),
            Arg::Long(first as i64),
            Arg::Long(lines as i64),
            Arg::Int(i32::from(layout == VideoLayout::ChannelsFirst)),
        ],
    ))
}

/// A per-position Linear's or a convolution's output `y` (`[B, N, C·st·s·s, H, W]` frames-major,
/// or `[B, C·st·s·s, N, H, W]` channels first: `layout`'s) plus `bias` (one per channel of `y`)
/// where given, stored as frames `first..` of `out` `[B, T, C, H·s, W·s]` (`layout`'s):
/// channel `(c, t', h', w')` of input frame `f` lands at frame `f·st + t' - skip`, row
/// `h·s + h'`, column `w·s + w'`, the first `skip` expanded frames dropped.
/// [`add_channel_bias`]'s sum and rounding, moved in the same pass.
pub(crate) fn depth_to_space(
    y: &Tensor,
    bias: Option<&Tensor>,
    (st, s): (usize, usize),
    (out, layout): (&Tensor, VideoLayout),
    first: usize,
    skip: usize,
) -> Result<()> {
    let func = func("depth_to_space", y)?;
    let (b, n, cy, h, w) = layout.dims(y)?;
    let (ob, ot, c, oh, ow) = layout.dims(out)?;
    let fits = st > 0
        && s > 0
        && ob == b
        && cy == c * st * s * s
        && (oh, ow) == (h * s, w * s)
        && skip <= n * st
        && first + n * st - skip <= ot
        && out.dtype() == y.dtype()
        && out.is_contiguous()
        && bias.is_none_or(|bias| bias.elem_count() == cy);
    if !fits {
        candle_core::bail!(
            "depth to space: {:?} by ({st}, {s}) as frames {first}.. of {:?}",
            y.shape(),
            out.shape()
        )
    }
    let y = y.contiguous()?;
    let bias = bias.map(f32_values).transpose()?;
    let rows = b * (n * st - skip) * c * oh;
    out.inplace_op1(&item_launch(
        &CHANNEL_OPS,
        func,
        rows * 32,
        vec![
            Arg::Tensor(Some(&y)),
            Arg::Dst,
            Arg::Tensor(bias.as_ref()),
            Arg::Int(c as i32),
            Arg::Int(st as i32),
            Arg::Int(s as i32),
            Arg::Int(h as i32),
            Arg::Int(w as i32),
            Arg::Long(n as i64),
            Arg::Long(ot as i64),
            Arg::Long(first as i64),
            Arg::Long(skip as i64),
            Arg::Long(rows as i64),
            Arg::Int(i32::from(layout == VideoLayout::ChannelsFirst)),
        ],
    ))
}

#[cfg(test)]
mod cuda_tests {
    //! The fused moves against the candle compositions they replace: the same bits.
    use super::*;
    use crate::models::row_ops::test_util::device;

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()
    }

    #[test]
    fn channel_bias_is_candles_broadcast_add_bit_for_bit() -> Result<()> {
        let Some(dev) = device("channel bias") else {
            return Ok(());
        };
        for dtype in [DType::BF16, DType::F32] {
            // 16-byte rows (vector path), odd rows (element path), and a view at an offset.
            for dims in [[2, 3, 4, 6, 8], [1, 5, 3, 7, 9]] {
                let y = Tensor::randn(0f32, 3.0, &dims[..], &dev)?.to_dtype(dtype)?;
                let bias = Tensor::randn(0f32, 3.0, dims[1], &dev)?.to_dtype(dtype)?;
                let want = y.broadcast_add(&bias.reshape((1, dims[1], 1, 1, 1))?)?;
                let got = add_channel_bias(&y, &bias, BiasOut::New, None)?;
                assert_eq!(max_diff(&got, &want)?, 0.0, "{dtype:?} {dims:?}");
                // In place: the sums in y's own memory.
                let own = y.copy()?;
                let got = add_channel_bias(&own, &bias, BiasOut::InPlace, None)?;
                assert_eq!(max_diff(&own, &want)?, 0.0, "{dtype:?} {dims:?} in place");
                assert_eq!(max_diff(&got, &want)?, 0.0, "{dtype:?} {dims:?} in place");
                // An addend per channel and position, broadcast over batch and frames.
                let plane = (1, dims[1], 1, dims[3], dims[4]);
                let addend = Tensor::randn(0f32, 3.0, plane, &dev)?.to_dtype(dtype)?;
                let want_plane = y.broadcast_add(&addend)?;
                let got = add_channel_bias(&y, &addend, BiasOut::New, None)?;
                assert_eq!(
                    max_diff(&got, &want_plane)?,
                    0.0,
                    "{dtype:?} {dims:?} per position"
                );
                let frames_major = want.transpose(1, 2)?.contiguous()?;
                let (b, c, t, h, w) = y.dims5()?;
                let out = Tensor::zeros((b, t + 3, c, h, w), dtype, &dev)?;
                for (first, n) in [(0, 1), (1, t - 1)] {
                    let part = y.narrow(2, first, n)?;
                    add_channel_bias(&part, &bias, BiasOut::FramesOf(&out, first + 2), None)?;
                }
                let got = out.narrow(1, 2, t)?;
                assert_eq!(
                    max_diff(&got, &frames_major)?,
                    0.0,
                    "{dtype:?} {dims:?} frames-major"
                );
                assert_eq!(
                    out.narrow(1, 0, 2)?
                        .abs()?
                        .sum_all()?
                        .to_dtype(DType::F32)?
                        .to_scalar::<f32>()?,
                    0.0
                );
                // A residual added in the same store: candle's add of the biased sum and it.
                let residual = Tensor::randn(0f32, 3.0, &dims[..], &dev)?.to_dtype(dtype)?;
                let got = add_channel_bias(&y, &bias, BiasOut::New, Some(&residual))?;
                let want_res = (&want + &residual)?;
                assert_eq!(
                    max_diff(&got, &want_res)?,
                    0.0,
                    "{dtype:?} {dims:?} residual"
                );
                let out_res = Tensor::randn(0f32, 3.0, out.dims(), &dev)?.to_dtype(dtype)?;
                let stored = out_res.copy()?;
                for (first, n) in [(0, 1), (1, t - 1)] {
                    let part = y.narrow(2, first, n)?;
                    let place = BiasOut::FramesOf(&stored, first + 2);
                    add_channel_bias(&part, &bias, place, Some(&out_res))?;
                }
                let want_frames = (&frames_major + out_res.narrow(1, 2, t)?)?;
                assert_eq!(
                    max_diff(&stored.narrow(1, 2, t)?, &want_frames)?,
                    0.0,
                    "{dtype:?} {dims:?} frames-major residual"
                );
            }
        }
        Ok(())
    }

    /// The channels-last moves are the channels-first ones transposed, bit for bit: shapes
    /// with whole and partial tiles of channels and columns, even and odd channel counts.
    #[test]
    fn channels_last_moves_are_the_transposed_channels_first_ones() -> Result<()> {
        let Some(dev) = device("channels-last moves") else {
            return Ok(());
        };
        for dtype in [DType::BF16, DType::F32] {
            for (dims, index, ph, pw) in [
                ([2, 5, 40, 4, 37], vec![0u32, 0, 1, 2, 4], 1, 1),
                ([1, 3, 7, 3, 70], vec![2u32, 1], 0, 2),
                // Whole tiles of 64 channels and a partial one of an odd count.
                ([1, 3, 131, 2, 66], vec![0u32, 2, 1], 1, 1),
            ] {
                let x = Tensor::randn(0f32, 1.0, &dims[..], &dev)?.to_dtype(dtype)?;
                let want = gather_padded_frames(&x, &index, ph, pw)?.permute((0, 2, 3, 4, 1))?;
                let framing = Framing::padded((ph, pw));
                let got = gather_padded_frames_channels_last(
                    (&x, None),
                    &index,
                    framing,
                    VideoLayout::FramesMajor,
                )?;
                assert_eq!(got.dims(), want.dims());
                assert_eq!(max_diff(&got, &want)?, 0.0, "{dtype:?} {dims:?} gather");
                // The same frames gathered from the video laid out channels first.
                let x_cf = x.transpose(1, 2)?.contiguous()?;
                let got_cf = gather_padded_frames_channels_last(
                    (&x_cf, None),
                    &index,
                    framing,
                    VideoLayout::ChannelsFirst,
                )?;
                assert_eq!(
                    max_diff(&got_cf, &want)?,
                    0.0,
                    "{dtype:?} {dims:?} gather cf"
                );
                // The same frames with the video's first two held apart, ahead of the rest (a
                // causal convolution's context from the chunk before), in either layout.
                let (ahead, rest) = (2, dims[1] - 2);
                for (video, layout) in [
                    (&x, VideoLayout::FramesMajor),
                    (&x_cf, VideoLayout::ChannelsFirst),
                ] {
                    let time = if layout == VideoLayout::FramesMajor {
                        1
                    } else {
                        2
                    };
                    let front = video.narrow(time, 0, ahead)?;
                    let behind = video.narrow(time, ahead, rest)?;
                    let got_split = gather_padded_frames_channels_last(
                        (&behind, Some(&front)),
                        &index,
                        framing,
                        layout,
                    )?;
                    let what = format!("{dtype:?} {dims:?} {layout:?} gather with frames ahead");
                    assert_eq!(max_diff(&got_split, &want)?, 0.0, "{what}");
                }
                // The frames upsampled twice (nearest) before the padding, as gathered from the
                // upsampled video (CogVideoX's upsampler before its convolution).
                let (b, t, c, h, w) = x.dims5()?;
                let upsampled = x
                    .reshape((b * t, c, h, w))?
                    .upsample_nearest2d(2 * h, 2 * w)?
                    .reshape((b, t, c, 2 * h, 2 * w))?;
                let want_up = gather_padded_frames_channels_last(
                    (&upsampled, None),
                    &index,
                    framing,
                    VideoLayout::FramesMajor,
                )?;
                let got_up = gather_padded_frames_channels_last(
                    (&x_cf, None),
                    &index,
                    Framing {
                        up: 2,
                        pad: (ph, pw),
                    },
                    VideoLayout::ChannelsFirst,
                )?;
                assert_eq!(got_up.dims(), want_up.dims());
                let what = format!("{dtype:?} {dims:?} gather upsampled");
                assert_eq!(max_diff(&got_up, &want_up)?, 0.0, "{what}");
                // The gathered frames as a convolution's output: stored with a bias (and a
                // residual) into frames 1.. of a frames-major output, as add_channel_bias does,
                // and of the channels-first output, transposed.
                let (b, n, hp, wp, c) = got.dims5()?;
                let bias = Tensor::randn(0f32, 1.0, c, &dev)?.to_dtype(dtype)?;
                let residual = Tensor::randn(0f32, 1.0, (b, n + 1, c, hp, wp), &dev)?;
                let residual = residual.to_dtype(dtype)?;
                let residual_cf = residual.transpose(1, 2)?.contiguous()?;
                for (r, r_cf) in [(None, None), (Some(&residual), Some(&residual_cf))] {
                    let want_out = Tensor::zeros((b, n + 1, c, hp, wp), dtype, &dev)?;
                    let channels_first = got.permute((0, 4, 1, 2, 3))?.contiguous()?;
                    add_channel_bias(&channels_first, &bias, BiasOut::FramesOf(&want_out, 1), r)?;
                    let out = Tensor::zeros((b, n + 1, c, hp, wp), dtype, &dev)?;
                    store_channels_last(&got, &bias, (&out, VideoLayout::FramesMajor), 1, r)?;
                    let what = format!("{dtype:?} {dims:?} store, residual {}", r.is_some());
                    assert_eq!(max_diff(&out, &want_out)?, 0.0, "{what}");
                    let out_cf = Tensor::zeros((b, c, n + 1, hp, wp), dtype, &dev)?;
                    store_channels_last(
                        &got,
                        &bias,
                        (&out_cf, VideoLayout::ChannelsFirst),
                        1,
                        r_cf,
                    )?;
                    let want_cf = want_out.transpose(1, 2)?;
                    assert_eq!(max_diff(&out_cf, &want_cf)?, 0.0, "{what} cf");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn gathered_frames_are_index_select_and_replicate_padding() -> Result<()> {
        let Some(dev) = device("gathered frames") else {
            return Ok(());
        };
        for dtype in [DType::BF16, DType::F32] {
            let x = Tensor::randn(0f32, 1.0, (2, 5, 3, 4, 6), &dev)?.to_dtype(dtype)?;
            for (index, ph, pw) in [
                (vec![0u32, 0, 1, 2], 1, 1),
                (vec![4, 3], 0, 2),
                (vec![2], 2, 0),
            ] {
                let idx = Tensor::new(index.as_slice(), &dev)?;
                let mut want = x.index_select(&idx, 1)?;
                if ph > 0 {
                    want = want.pad_with_same(3, ph, ph)?;
                }
                if pw > 0 {
                    want = want.pad_with_same(4, pw, pw)?;
                }
                let want = want.transpose(1, 2)?.contiguous()?;
                let got = gather_padded_frames(&x, &index, ph, pw)?;
                assert_eq!(got.dims(), want.dims());
                assert_eq!(max_diff(&got, &want)?, 0.0, "{dtype:?} {index:?} {ph} {pw}");
            }
        }
        Ok(())
    }

    /// The depth-to-space store is the view, permute and broadcast add it replaces, bit for
    /// bit: Mochi-1's expansions (time 1-3, space 2), space 3, odd columns, and runs stored
    /// at frame offsets of one output.
    #[test]
    fn depth_to_space_is_the_permuted_broadcast_add() -> Result<()> {
        let Some(dev) = device("depth to space") else {
            return Ok(());
        };
        for dtype in [DType::BF16, DType::F32] {
            for (b, n, c, st, s, h, w) in [
                (1, 3, 5, 3, 2, 4, 37),
                (2, 2, 3, 2, 2, 3, 64),
                (1, 2, 4, 1, 2, 5, 33),
                (1, 2, 2, 2, 3, 3, 7),
            ] {
                let y = Tensor::randn(0f32, 3.0, (b, n, c * st * s * s, h, w), &dev)?;
                let y = y.to_dtype(dtype)?;
                let bias = Tensor::randn(0f32, 3.0, c * st * s * s, &dev)?.to_dtype(dtype)?;
                let want = y
                    .broadcast_add(&bias.reshape((1, 1, (), 1, 1))?)?
                    .reshape(vec![b, n, c, st, s, s, h, w])?
                    .permute(vec![0, 1, 3, 2, 6, 4, 7, 5])?
                    .reshape((b, n * st, c, h * s, w * s))?;
                let out = Tensor::zeros((b, (n + 1) * st, c, h * s, w * s), dtype, &dev)?;
                for f in 0..n {
                    let run = y.narrow(1, f, 1)?;
                    let place = (&out, VideoLayout::FramesMajor);
                    depth_to_space(&run, Some(&bias), (st, s), place, (f + 1) * st, 0)?;
                }
                let what = format!("{dtype:?} {:?} by ({st}, {s})", y.dims());
                let got = out.narrow(1, st, n * st)?;
                assert_eq!(max_diff(&got, &want)?, 0.0, "{what}");
                let untouched = out.narrow(1, 0, st)?.abs()?.sum_all()?;
                assert_eq!(
                    untouched.to_dtype(DType::F32)?.to_scalar::<f32>()?,
                    0.0,
                    "{what}"
                );
                // Channels first, no bias, the first expanded frame dropped (LTX-Video's
                // upsampler): the same values transposed.
                let y_cf = y.transpose(1, 2)?.contiguous()?;
                let out_cf = Tensor::zeros((b, c, n * st - 1, h * s, w * s), dtype, &dev)?;
                let place = (&out_cf, VideoLayout::ChannelsFirst);
                depth_to_space(&y_cf, None, (st, s), place, 0, 1)?;
                let want_cf = y
                    .reshape(vec![b, n, c, st, s, s, h, w])?
                    .permute(vec![0, 1, 3, 2, 6, 4, 7, 5])?
                    .reshape((b, n * st, c, h * s, w * s))?
                    .narrow(1, 1, n * st - 1)?
                    .transpose(1, 2)?;
                assert_eq!(max_diff(&out_cf, &want_cf)?, 0.0, "{what} channels first");
            }
        }
        Ok(())
    }
}
