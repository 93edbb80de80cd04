//! Fused CUDA kernels of the Wan VAE (`wan_vae_ops.cu`, f32): channel RMS norm + SiLU written
//! into a convolution's input buffer, the per-channel bias (and residual) of a convolution's
//! output in place, and the up-sampling interleavings.
//!
//! Every kernel writes in place into a tensor the caller owns, through the one [`Launch`] of
//! the kernel modules: its other tensor arguments are read-only and must not share storage with
//! the destination.

use candle_core::{DType, Result, Tensor};

use crate::models::conv3d::Layout;
use crate::models::kernel_module::{item_launch, kernel_module, Arg, Launch, Module};

static VAE: Module = kernel_module!("wan_vae_ops");

/// Whether the VAE kernels take `x`: f32 on CUDA.
pub(crate) fn vae_supported(x: &Tensor) -> bool {
    x.device().is_cuda() && x.dtype() == DType::F32
}

/// A grid-stride launch of a Wan VAE kernel over `n` items.
fn vae_launch<'a>(func: &'static str, n: usize, args: Vec<Arg<'a>>) -> Launch<'a> {
    item_launch(&VAE, func, n, args)
}

/// Writes `SiLU(x / max(|x|_2, 1e-12) * scale * gamma)`, the norm over the channels of the
/// chunk `x` (f32, `[B, C, T, H, W]` or channels last `[B, T, H, W, C]`, per `layout`), into
/// frames `offset..offset + T` of `buf` (f32, the same layout, contiguous, not sharing storage
/// with `x`); `gamma` holds `C` f32 values. With `in_bias` (`[C]`), `x + in_bias` is normalised.
pub(crate) fn vae_rms_silu_into(
    x: &Tensor,
    in_bias: Option<&Tensor>,
    (gamma, scale, layout): (&Tensor, f64, Layout),
    buf: &Tensor,
    offset: usize,
) -> Result<()> {
    let (b, c, t, h, w) = layout.dims(x)?;
    let (bb, bc, bt, bh, bw) = layout.dims(buf)?;
    if (bb, bc, bh, bw) != (b, c, h, w) || offset + t > bt || gamma.elem_count() != c {
        candle_core::bail!(
            "vae norm: x {:?}, buffer {:?} at frame {offset}, gamma {:?}",
            x.shape(),
            buf.shape(),
            gamma.shape()
        )
    }
    if gamma.dtype() != DType::F32 || buf.dtype() != DType::F32 {
        candle_core::bail!("vae norm: gamma and buffer must be f32")
    }
    let x = x.contiguous()?;
    let gamma = gamma.contiguous()?;
    let in_bias = match in_bias {
        Some(bias) if bias.elem_count() != c || bias.dtype() != DType::F32 => {
            candle_core::bail!(
                "vae norm: input bias {:?} for {c} f32 channels",
                bias.shape()
            )
        }
        Some(bias) => Some(bias.contiguous()?),
        None => None,
    };
    let frame = h * w;
    if layout == Layout::ChannelsFirst {
        let spatial = t * frame;
        return buf.inplace_op1(&vae_launch(
            "wan_vae_rms_silu_f32",
            b * spatial,
            vec![
                Arg::Tensor(Some(&x)),
                Arg::Dst,
                Arg::Tensor(Some(&gamma)),
                Arg::Tensor(in_bias.as_ref()),
                Arg::Int(c as i32),
                Arg::Long(spatial as i64),
                Arg::Long((b * spatial) as i64),
                Arg::Long((c * bt * frame) as i64),
                Arg::Long((bt * frame) as i64),
                Arg::Long((offset * frame) as i64),
                Arg::Float(scale as f32),
            ],
        ));
    }
    // Channels last, each batch entry's frames are one contiguous run of the buffer.
    let pixels = t * frame;
    for i in 0..b {
        let xi = x.narrow(0, i, 1)?;
        buf.inplace_op1(&vae_launch(
            "wan_vae_rms_silu_cl_f32",
            pixels * 32,
            vec![
                Arg::Tensor(Some(&xi)),
                Arg::Dst,
                Arg::Tensor(Some(&gamma)),
                Arg::Tensor(in_bias.as_ref()),
                Arg::Int(c as i32),
                Arg::Long(pixels as i64),
                Arg::Long(((i * bt + offset) * frame * c) as i64),
                Arg::Float(scale as f32),
            ],
        ))?;
    }
    Ok(())
}

/// `y + bias` per channel of `y` (f32; channels at `channel_dim`), plus `residual` (y's shape)
/// when given, in `y`'s storage; `bias` `[C]` f32.
pub(crate) fn vae_bias_add(
    y: Tensor,
    bias: &Tensor,
    residual: Option<&Tensor>,
    channel_dim: usize,
) -> Result<Tensor> {
    let dims = y.dims();
    let c = dims.get(channel_dim).copied().unwrap_or(0);
    if channel_dim == 0 || bias.elem_count() != c || bias.dtype() != DType::F32 {
        candle_core::bail!("vae bias: y {:?}, bias {:?}", y.shape(), bias.shape())
    }
    let residual = match residual {
        Some(r) if r.dims() != dims || r.dtype() != DType::F32 => {
            candle_core::bail!("vae bias: y {:?}, residual {:?}", y.shape(), r.shape())
        }
        Some(r) => Some(r.contiguous()?),
        None => None,
    };
    let y = y.contiguous()?;
    let n = y.elem_count();
    // Elements between consecutive channels (1 when channels are last).
    let spatial: usize = dims[channel_dim + 1..].iter().product();
    let bias = bias.contiguous()?;
    let aligned = |t: &Tensor| (t.layout().start_offset() * 4).is_multiple_of(16);
    if spatial == 1 && c % 4 == 0 && aligned(&y) && residual.as_ref().is_none_or(aligned) {
        y.inplace_op1(&vae_launch(
            "wan_vae_bias_add_cl_v4_f32",
            n / 4,
            vec![
                Arg::Dst,
                Arg::Tensor(Some(&bias)),
                Arg::Tensor(residual.as_ref()),
                Arg::Int(c as i32),
                Arg::Long((n / 4) as i64),
            ],
        ))?;
        return Ok(y);
    }
    y.inplace_op1(&vae_launch(
        "wan_vae_bias_add_f32",
        n,
        vec![
            Arg::Dst,
            Arg::Tensor(Some(&bias)),
            Arg::Tensor(residual.as_ref()),
            Arg::Int(c as i32),
            Arg::Long(spatial as i64),
            Arg::Long(n as i64),
        ],
    ))?;
    Ok(y)
}

/// `[B, 4C, T, H + 1, W + 1]` parities interleaved into `[B, C, T, 2H, 2W]` plus `bias` `[C]`
/// (f32): output `(2i + a, 2j + b)` is parity `2a + b` at `(i + a, j + b)`.
pub(crate) fn vae_subpixel(y: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let (b, c4, t, h1, w1) = y.dims5()?;
    let c = c4 / 4;
    if c4 % 4 != 0 || h1 < 2 || w1 < 2 || bias.elem_count() != c || bias.dtype() != DType::F32 {
        candle_core::bail!("vae subpixel: y {:?}, bias {:?}", y.shape(), bias.shape())
    }
    let (h, w) = (h1 - 1, w1 - 1);
    let y = y.contiguous()?;
    let bias = bias.contiguous()?;
    // SAFETY: the kernel writes every element.
    let out = unsafe { Tensor::empty((b, c, t, 2 * h, 2 * w), DType::F32, y.device()) }?;
    let n = out.elem_count();
    out.inplace_op1(&vae_launch(
        "wan_vae_subpixel_f32",
        n,
        vec![
            Arg::Tensor(Some(&y)),
            Arg::Dst,
            Arg::Tensor(Some(&bias)),
            Arg::Int(c as i32),
            Arg::Long(t as i64),
            Arg::Long(h as i64),
            Arg::Long(w as i64),
            Arg::Long(n as i64),
        ],
    ))?;
    Ok(out)
}

/// A temporal upsampler's output channels last: `y` `[B, T, H, W, 2C]` (channels `[0, C)` frame
/// `2t`, `[C, 2C)` frame `2t + 1`) plus `bias` (f32 `[2C]`) as `[B, 2T, H, W, C]`: the bias
/// pass and the frame interleaving in one pass, the same bits as the two.
pub(crate) fn vae_time_interleave_cl(y: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let (b, t, h, w, c2) = y.dims5()?;
    let c = c2 / 2;
    if c2 % 2 != 0 || bias.elem_count() != c2 || bias.dtype() != DType::F32 {
        candle_core::bail!(
            "vae time interleave: y {:?}, bias {:?}",
            y.shape(),
            bias.shape()
        )
    }
    let y = y.contiguous()?;
    let bias = bias.contiguous()?;
    // SAFETY: the kernel writes every element.
    let out = unsafe { Tensor::empty((b, 2 * t, h, w, c), DType::F32, y.device()) }?;
    let n = out.elem_count();
    // float4s where every channel run starts on 16 bytes (the output's do).
    let v4 = c.is_multiple_of(4) && y.layout().start_offset().is_multiple_of(4);
    let (func, items) = if v4 {
        ("wan_vae_time_interleave_cl_v4_f32", n / 4)
    } else {
        ("wan_vae_time_interleave_cl_f32", n)
    };
    out.inplace_op1(&vae_launch(
        func,
        items,
        vec![
            Arg::Tensor(Some(&y)),
            Arg::Dst,
            Arg::Tensor(Some(&bias)),
            Arg::Int(c as i32),
            Arg::Long((h * w) as i64),
            Arg::Long(items as i64),
        ],
    ))?;
    Ok(out)
}

/// `h + DupUp3D(x)` channels last (a Wan2.2 residual up block's output and its shortcut) in
/// one pass: `x` `[B, T, H, W, Cin]`, `h` `[B, T', H * fs, W * fs, Cout]` with `T' = T * ft -
/// skip` (`skip`: the frames a first chunk drops), f32; each output channel's cell reads input
/// channel `cell / repeats` (`Cout * ft * fs² = Cin * repeats`).
pub(crate) fn vae_dup_up_add_cl(
    h: &Tensor,
    x: &Tensor,
    (factor_t, factor_s, repeats): (usize, usize, usize),
    skip: usize,
) -> Result<Tensor> {
    let (b, t, height, width, c_in) = x.dims5()?;
    let (hb, t_out, hh, hw, c_out) = h.dims5()?;
    let fits = hb == b
        && t * factor_t == t_out + skip
        && (hh, hw) == (height * factor_s, width * factor_s)
        && c_out * factor_t * factor_s * factor_s == c_in * repeats;
    if !fits || h.dtype() != DType::F32 || x.dtype() != DType::F32 {
        candle_core::bail!(
            "vae dup-up shortcut: h {:?}, x {:?}, factors ({factor_t}, {factor_s}), {repeats} repeats, skip {skip}",
            h.shape(),
            x.shape()
        )
    }
    let (h, x) = (h.contiguous()?, x.contiguous()?);
    // SAFETY: the kernel writes every element.
    let out = unsafe { Tensor::empty(h.shape(), DType::F32, h.device()) }?;
    let n = out.elem_count();
    out.inplace_op1(&vae_launch(
        "wan_vae_dup_up_add_cl_f32",
        n,
        vec![
            Arg::Tensor(Some(&h)),
            Arg::Tensor(Some(&x)),
            Arg::Dst,
            Arg::Int(c_in as i32),
            Arg::Int(c_out as i32),
            Arg::Int(factor_t as i32),
            Arg::Int(factor_s as i32),
            Arg::Int(repeats as i32),
            Arg::Int(skip as i32),
            Arg::Long(t as i64),
            Arg::Long(t_out as i64),
            Arg::Long(height as i64),
            Arg::Long(width as i64),
            Arg::Long(n as i64),
        ],
    ))?;
    Ok(out)
}

/// [`vae_subpixel`] channels last: `[B, T, H + 1, W + 1, 4C]` parities interleaved into
/// `[B, T, 2H, 2W, C]` plus `bias` `[C]` (f32).
pub(crate) fn vae_subpixel_cl(y: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let (b, t, h1, w1, c4) = y.dims5()?;
    let c = c4 / 4;
    if c4 % 4 != 0 || h1 < 2 || w1 < 2 || bias.elem_count() != c || bias.dtype() != DType::F32 {
        candle_core::bail!("vae subpixel: y {:?}, bias {:?}", y.shape(), bias.shape())
    }
    let (h, w) = (h1 - 1, w1 - 1);
    let y = y.contiguous()?;
    let bias = bias.contiguous()?;
    // SAFETY: the kernel writes every element.
    let out = unsafe { Tensor::empty((b, t, 2 * h, 2 * w, c), DType::F32, y.device()) }?;
    let n = out.elem_count();
    out.inplace_op1(&vae_launch(
        "wan_vae_subpixel_cl_f32",
        n,
        vec![
            Arg::Tensor(Some(&y)),
            Arg::Dst,
            Arg::Tensor(Some(&bias)),
            Arg::Int(c as i32),
            Arg::Long(h as i64),
            Arg::Long(w as i64),
            Arg::Long(n as i64),
        ],
    ))?;
    Ok(out)
}
