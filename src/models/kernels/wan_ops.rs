//! Fused CUDA kernels of the Wan DiT block (`wan_ops.cu`): LayerNorm with modulation, gated
//! residual, q/k RMSNorm with RoPE and bias (+ GELU), each one pass over bf16 storage with f32
//! math. They replace chains of candle ops that each stored a full-size f32 temporary. And two
//! of the Wan VAE (f32): channel RMS norm + SiLU written into a convolution's input buffer, and
//! the per-channel bias of a convolution's output, in place.
//!
//! Every kernel writes in place into a tensor the caller owns (a fresh output, or a projection
//! result that is consumed), through the generic launch of `dit_ops`: its other tensor arguments
//! are read-only and must not share storage with the destination.

use candle_core::{DType, Result, Tensor};

use crate::models::conv3d::Layout;
use crate::models::dit_ops::{element_launch, item_launch, row_launch, Arg, Launch};
pub(crate) use crate::models::dit_ops::{rows_supported, supported, Rows};
use crate::models::kernel_module::{kernel_module, Module};

static WAN: Module = kernel_module!("wan_ops");

/// Threads of a block of [`row_launch`] (`THREADS` in the kernels).
const ROW_BLOCK: usize = 256;
/// 8-element vectors each thread of a grouped row kernel holds (`MAX_VECS` in the kernels).
const MAX_VECS: usize = 8;

/// Threads per row of the grouped row kernels for rows of `dim`: a warp (several rows per block,
/// shuffle-only reductions) up to 2048, else 2 or 4 warps (2 or 4 rows per block, the warps'
/// partial sums through shared memory) up to 4096 or 8192; each thread holds up to
/// [`MAX_VECS`] 16-byte vectors of its row. `None` (the generic kernels) when `dim` is not a
/// multiple of 8 or is wider.
fn row_group(dim: usize) -> Option<usize> {
    if !dim.is_multiple_of(8) {
        return None;
    }
    [32, 64, 128].into_iter().find(|g| dim <= 8 * MAX_VECS * g)
}

/// The grouped kernel `names[i]` for `g` = 32, 64 or 128 threads per row.
fn grouped(names: [&'static str; 3], g: usize) -> &'static str {
    match g {
        32 => names[0],
        64 => names[1],
        _ => names[2],
    }
}

/// Whether every value fits the kernels' 32-bit indices.
fn fits_i32(values: &[usize]) -> bool {
    values.iter().all(|&v| i32::try_from(v).is_ok())
}

/// `LayerNorm(x) * w + b` in f32, rounded to bf16; `w`, `b` f32 `[1 or batch, dim]`.
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, at: Rows, eps: f64) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    let wb_stride = if w.dim(0)? == 1 { 0 } else { dim };
    // SAFETY: the kernel writes every element of `out`.
    let out = unsafe { Tensor::empty((rows, dim), DType::BF16, x.device()) }?;
    if rows == 0 {
        return Ok(out);
    }
    let launch = match row_group(dim) {
        Some(g) if fits_i32(&[rows, dim, at.row0 + rows, at.seq, wb_stride]) => row_launch(
            &WAN,
            grouped(
                [
                    "wan_layer_norm_g32_bf16",
                    "wan_layer_norm_g64_bf16",
                    "wan_layer_norm_g128_bf16",
                ],
                g,
            ),
            rows.div_ceil(ROW_BLOCK / g),
            vec![
                Arg::Tensor(Some(x)),
                Arg::Dst,
                Arg::Tensor(Some(w)),
                Arg::Tensor(Some(b)),
                Arg::Int(rows as i32),
                Arg::Int(dim as i32),
                Arg::Int(at.row0 as i32),
                Arg::Int(at.seq as i32),
                Arg::Int(wb_stride as i32),
                Arg::Float(eps as f32),
            ],
        ),
        _ => row_launch(
            &WAN,
            "wan_layer_norm_bf16",
            rows,
            vec![
                Arg::Tensor(Some(x)),
                Arg::Dst,
                Arg::Tensor(Some(w)),
                Arg::Tensor(Some(b)),
                Arg::Int(dim as i32),
                Arg::Long(at.row0 as i64),
                Arg::Long(at.seq as i64),
                Arg::Long(wb_stride as i64),
                Arg::Float(eps as f32),
            ],
        ),
    };
    out.inplace_op1(&launch)?;
    Ok(out)
}

/// `res + (delta + bias) * gate` (bias and gate optional), written into `delta`'s storage.
pub(crate) fn residual_into_delta(
    res: &Tensor,
    delta: Tensor,
    bias: Option<&Tensor>,
    gate: Option<&Tensor>,
    at: Rows,
) -> Result<Tensor> {
    delta.inplace_op1(&residual_launch(
        res,
        delta.dims2()?,
        [Arg::Tensor(Some(res)), Arg::Dst],
        bias,
        gate,
        at,
    )?)?;
    Ok(delta)
}

/// `res + (delta + bias) * gate` (bias and gate optional), written over `res`'s storage: rows
/// of a tensor the caller owns, updated where they lie (no copy of the sum into them).
pub(crate) fn residual_over(
    res: &Tensor,
    delta: &Tensor,
    bias: Option<&Tensor>,
    gate: Option<&Tensor>,
    at: Rows,
) -> Result<()> {
    res.inplace_op1(&residual_launch(
        res,
        delta.dims2()?,
        [Arg::Dst, Arg::Tensor(Some(delta))],
        bias,
        gate,
        at,
    )?)
}

/// The gated residual kernel's launch over `(rows, dim)` with `operands` (res, delta), one of
/// them the destination it writes.
fn residual_launch<'a>(
    res: &Tensor,
    (rows, dim): (usize, usize),
    [res_arg, delta_arg]: [Arg<'a>; 2],
    bias: Option<&'a Tensor>,
    gate: Option<&'a Tensor>,
    at: Rows,
) -> Result<Launch<'a>> {
    if res.dims2()? != (rows, dim) {
        candle_core::bail!("residual: {:?} and {:?} differ", res.shape(), (rows, dim))
    }
    let n = rows * dim;
    Ok(
        if dim.is_multiple_of(8) && fits_i32(&[n, at.row0 + rows, at.seq]) {
            item_launch(
                &WAN,
                "wan_residual_v8_bf16",
                n / 8,
                vec![
                    res_arg,
                    delta_arg,
                    Arg::Tensor(bias),
                    Arg::Tensor(gate),
                    Arg::Dst,
                    Arg::Int((n / 8) as i32),
                    Arg::Int(dim as i32),
                    Arg::Int(at.row0 as i32),
                    Arg::Int(at.seq as i32),
                ],
            )
        } else {
            element_launch(
                &WAN,
                "wan_residual_bf16",
                n,
                vec![
                    res_arg,
                    delta_arg,
                    Arg::Tensor(bias),
                    Arg::Tensor(gate),
                    Arg::Dst,
                    Arg::Long(n as i64),
                    Arg::Int(dim as i32),
                    Arg::Long(at.row0 as i64),
                    Arg::Long(at.seq as i64),
                ],
            )
        },
    )
}

/// In place on `x` `[rows, heads * head_dim]`: bias, RMSNorm across the row with `w`, then RoPE
/// per head when `rope` (cos, sin `[seq, head_dim / 2]` f32) is given.
pub(crate) fn rms_rope(
    x: Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    rope: Option<(&Tensor, &Tensor)>,
    head_dim: usize,
    at: Rows,
    eps: f32,
) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    if rows == 0 {
        return Ok(x);
    }
    let (cos, sin) = (rope.map(|r| r.0), rope.map(|r| r.1));
    let group = row_group(dim).filter(|_| {
        (rope.is_none() || head_dim.is_multiple_of(8))
            && fits_i32(&[rows, dim, head_dim, at.row0 + rows, at.seq])
    });
    let launch = match group {
        Some(g) => row_launch(
            &WAN,
            grouped(
                [
                    "wan_rms_rope_g32_bf16",
                    "wan_rms_rope_g64_bf16",
                    "wan_rms_rope_g128_bf16",
                ],
                g,
            ),
            rows.div_ceil(ROW_BLOCK / g),
            vec![
                Arg::Dst,
                Arg::Tensor(bias),
                Arg::Tensor(Some(w)),
                Arg::Tensor(cos),
                Arg::Tensor(sin),
                Arg::Int(rows as i32),
                Arg::Int(dim as i32),
                Arg::Int(head_dim as i32),
                Arg::Int(at.row0 as i32),
                Arg::Int(at.seq as i32),
                Arg::Float(eps),
            ],
        ),
        None => row_launch(
            &WAN,
            "wan_rms_rope_bf16",
            rows,
            vec![
                Arg::Dst,
                Arg::Tensor(bias),
                Arg::Tensor(Some(w)),
                Arg::Tensor(cos),
                Arg::Tensor(sin),
                Arg::Int(dim as i32),
                Arg::Int(head_dim as i32),
                Arg::Long(at.row0 as i64),
                Arg::Long(at.seq as i64),
                Arg::Float(eps),
            ],
        ),
    };
    x.inplace_op1(&launch)?;
    Ok(x)
}

/// In place on `x` `[rows, dim]`: `x + bias`, then GELU(tanh) when `gelu`.
pub(crate) fn bias_act(x: Tensor, bias: &Tensor, gelu: bool) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    let n = rows * dim;
    let launch = if dim.is_multiple_of(8) && fits_i32(&[n]) {
        item_launch(
            &WAN,
            "wan_bias_act_v8_bf16",
            n / 8,
            vec![
                Arg::Dst,
                Arg::Tensor(Some(bias)),
                Arg::Int((n / 8) as i32),
                Arg::Int(dim as i32),
                Arg::Int(gelu.into()),
            ],
        )
    } else {
        element_launch(
            &WAN,
            "wan_bias_act_bf16",
            n,
            vec![
                Arg::Dst,
                Arg::Tensor(Some(bias)),
                Arg::Long(n as i64),
                Arg::Int(dim as i32),
                Arg::Int(gelu.into()),
            ],
        )
    };
    x.inplace_op1(&launch)?;
    Ok(x)
}

/// Whether the VAE kernels take `x`: f32 on CUDA.
pub(crate) fn vae_supported(x: &Tensor) -> bool {
    x.device().is_cuda() && x.dtype() == DType::F32
}

/// A grid-stride launch of a Wan VAE kernel over `n` items.
fn vae_launch<'a>(func: &'static str, n: usize, args: Vec<Arg<'a>>) -> Launch<'a> {
    item_launch(&WAN, func, n, args)
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
