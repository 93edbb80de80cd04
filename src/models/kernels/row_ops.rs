//! The fused row and element-wise kernels of every DiT block (`row_ops.cu`): norms with
//! modulation, q/k norms with bias and RoPE, gated residuals, a Linear's bias with its activation,
//! SwiGLU; each one pass over bf16 storage with f32 math, rounded where the composition it
//! replaces rounds ([`Rounding`] says how each family rounds).
//!
//! Every kernel writes in place into a tensor the caller owns (a fresh output, or a projection
//! result that is consumed), through [`Launch`]: its other tensor arguments are read-only and
//! must not share storage with the destination.

use crate::models::kernel_module::{
    element_launch, item_launch, kernel_module, row_launch, Arg, Launch, Module, ROW_THREADS,
};
use candle_core::{DType, Result, Tensor, D};

static ROWS: Module = kernel_module!("row_ops");

/// Widest row the block-per-row kernels hold in registers (`2 * MAX_PAIRS * THREADS` in the
/// kernels).
const MAX_DIM: usize = 2 * 16 * ROW_THREADS;
/// 8-element vectors each thread of a grouped row kernel holds (`MAX_VECS` in the kernels).
const MAX_VECS: usize = 8;
/// The same for the grouped modulated norms (`NORM_VECS`), which take groups of up to 256.
const NORM_VECS: usize = 4;

/// How a kernel rounds: which composition it reproduces bit for bit (the suffix of its name in
/// `row_ops.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rounding {
    /// Wan's f32 block: f32 gates and modulation applied unrounded, norm scales as candle's
    /// fused ops, each product of a RoPE rotation rounded.
    F32,
    /// candle's bf16 composition (LTX-Video, CogVideoX, HunyuanVideo, MiniMax H3): bf16 gates
    /// and modulation, each product rounded, norms as the f32 composite.
    Bf16,
}

impl Rounding {
    /// The kernel `name` in this rounding.
    fn kernel(self, [f32, bf16]: [&'static str; 2]) -> &'static str {
        match self {
            Rounding::F32 => f32,
            Rounding::Bf16 => bf16,
        }
    }
}

/// Whether the element-wise kernels take `x` `[rows, dim]`: bf16 on CUDA, even `dim`.
pub(crate) fn supported(x: &Tensor) -> bool {
    x.device().is_cuda() && x.dtype() == DType::BF16 && x.dim(D::Minus1).is_ok_and(|d| d % 2 == 0)
}

/// Whether the row kernels (a row held in registers) take `x`: also `dim` up to [`MAX_DIM`].
pub(crate) fn rows_supported(x: &Tensor) -> bool {
    supported(x) && x.dim(D::Minus1).is_ok_and(|d| d <= MAX_DIM)
}

/// Whether the grouped row kernels ([`rms_mul_f32`]) take `x`: also `dim` a multiple of 8.
pub(crate) fn grouped_rows_supported(x: &Tensor) -> bool {
    supported(x) && x.dim(D::Minus1).is_ok_and(|d| row_group(d).is_some())
}

/// Where a `[rows, dim]` slab sits in a `[batch * seq, dim]` tensor: its first row, and the
/// rows per batch entry (which pick the modulation row and the RoPE position of each row).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows {
    pub row0: usize,
    pub seq: usize,
}

/// Threads per row of the grouped row kernels for rows of `dim`: a warp (several rows per block,
/// shuffle-only reductions) up to 2048, else 2 or 4 warps (2 or 4 rows per block, the warps'
/// partial sums through shared memory) up to 4096 or 8192; each thread holds up to
/// [`MAX_VECS`] 16-byte vectors of its row. `None` (the block-per-row kernels) when `dim` is not
/// a multiple of 8 or is wider.
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

/// Per-batch bf16 modulation rows inside one contiguous `table`: entry `b`'s `shift` row starts
/// at element `b * stride + shift`, its `scale` row at `b * stride + scale`. For a joint
/// sequence, `text` = (split, shift, scale): positions below `split` take those rows. With
/// `rows` (u32, one per row of the whole `[batch * seq, dim]` tensor), row `r` takes entry
/// `rows[r]` of the table instead of its batch entry's (`text` is then not used).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Modulation<'a> {
    pub table: &'a Tensor,
    pub stride: usize,
    pub shift: usize,
    pub scale: usize,
    pub text: Option<(usize, usize, usize)>,
    pub rows: Option<&'a Tensor>,
}

impl<'a> Modulation<'a> {
    /// The kernels' `shift, scale, shift_text, scale_text, rows` arguments, then `split` and
    /// the stride.
    fn args(m: Option<Self>) -> (Vec<Arg<'a>>, usize, usize) {
        let Some(m) = m else {
            return ((0..5).map(|_| Arg::Tensor(None)).collect(), 0, 0);
        };
        let (split, shift_text, scale_text) = m.text.unwrap_or((0, m.shift, m.scale));
        let mut args: Vec<Arg> = [m.shift, m.scale, shift_text, scale_text]
            .into_iter()
            .map(|offset| Arg::At(m.table, offset))
            .collect();
        args.push(Arg::Tensor(m.rows));
        (args, split, m.stride)
    }
}

/// One per-batch bf16 row inside a contiguous `table` (entry `b` at `b * stride + offset`);
/// for a joint sequence, `text` = (split, offset): positions below `split` take that row. With
/// `rows`, row `r` of the whole tensor takes entry `rows[r]` (as in [`Modulation`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchRow<'a> {
    pub table: &'a Tensor,
    pub stride: usize,
    pub offset: usize,
    pub text: Option<(usize, usize)>,
    pub rows: Option<&'a Tensor>,
}

/// `f32(1 / dim)`: the factor candle's `mean_keepdim` multiplies a sum by.
fn inv_dim(dim: usize) -> f32 {
    (1.0 / dim as f64) as f32
}

/// The composite RMSNorm of `x` `[rows, dim]` (`x * recip(sqrt(mean(x^2) + eps))` in f32, times
/// `w` when given, rounded), then `* (1 + scale) + shift` in bf16 when `modulation` is given.
pub(crate) fn rms_modulate(
    x: &Tensor,
    w: Option<&Tensor>,
    modulation: Option<Modulation>,
    at: Rows,
    eps: f64,
) -> Result<Tensor> {
    norm_modulate(x, Norm::Rms(w), modulation, at, eps, Width::Widest)
}

/// The two LayerNorms of [`layer_norm_modulate`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum LayerNorm<'a> {
    /// candle's fused `layer_norm(x, w, b)` (bf16 `w`, `b` `[dim]`).
    Fused { w: &'a Tensor, b: &'a Tensor },
    /// The two-pass f32 composition without affine (`mean_keepdim`, `sub`, `sqr`,
    /// `mean_keepdim`, `+ eps`, `sqrt`, `div`).
    TwoPass,
}

/// `norm` of `x` `[rows, dim]`, rounded, then `* (1 + scale) + shift` in bf16 when
/// `modulation` is given.
pub(crate) fn layer_norm_modulate(
    x: &Tensor,
    norm: LayerNorm,
    modulation: Option<Modulation>,
    at: Rows,
    eps: f64,
) -> Result<Tensor> {
    norm_modulate(x, Norm::Layer(norm), modulation, at, eps, Width::Widest)
}

/// The norms the bf16 modulated-norm kernels compute.
#[derive(Debug, Clone, Copy)]
enum Norm<'a> {
    /// The composite RMSNorm, times `w` when given.
    Rms(Option<&'a Tensor>),
    Layer(LayerNorm<'a>),
}

/// [`rms_modulate`] and [`layer_norm_modulate`]: the grouped vector kernel where rows are whole
/// 8-element vectors and every index fits its 32 bits, else the block-per-row one (the same
/// arithmetic, summed in another order).
fn norm_modulate(
    x: &Tensor,
    norm: Norm,
    modulation: Option<Modulation>,
    at: Rows,
    eps: f64,
    width: Width,
) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    // SAFETY: the kernel writes every element of `out`.
    let out = unsafe { Tensor::empty((rows, dim), DType::BF16, x.device()) }?;
    if rows == 0 {
        return Ok(out);
    }
    let (w, b, rms, two_pass) = match norm {
        Norm::Rms(w) => (w, None, 1, 0),
        Norm::Layer(LayerNorm::Fused { w, b }) => (Some(w), Some(b), 0, 0),
        Norm::Layer(LayerNorm::TwoPass) => (None, None, 0, 1),
    };
    let table_len = modulation.map_or(0, |m| m.table.elem_count());
    let (mods, split, stride) = Modulation::args(modulation);
    let indices = [rows, dim, at.row0 + rows, at.seq, split, stride, table_len];
    let group = [32, 64, 128, 256]
        .into_iter()
        .find(|g| dim <= 8 * NORM_VECS * g)
        .filter(|_| width.vectors(dim, &indices));
    let launch = match group {
        Some(g) => {
            let mut args = vec![
                Arg::Tensor(Some(x)),
                Arg::Dst,
                Arg::Tensor(w),
                Arg::Tensor(b),
            ];
            args.extend(mods);
            args.extend(
                [rows, dim, at.row0, at.seq, split, stride, rms, two_pass]
                    .map(|v| Arg::Int(v as i32)),
            );
            args.extend([Arg::Float(inv_dim(dim)), Arg::Float(eps as f32)]);
            let (aligned, unaligned) = match g {
                32 => ("norm_mod_g32_bf16", "norm_mod_g32_unaligned_bf16"),
                64 => ("norm_mod_g64_bf16", "norm_mod_g64_unaligned_bf16"),
                128 => ("norm_mod_g128_bf16", "norm_mod_g128_unaligned_bf16"),
                _ => ("norm_mod_g256_bf16", "norm_mod_g256_unaligned_bf16"),
            };
            // Modulation rows a whole number of vectors apart, or scalar accesses throughout.
            let func = if stride.is_multiple_of(8) {
                aligned
            } else {
                unaligned
            };
            row_launch(&ROWS, func, rows.div_ceil(ROW_THREADS / g), args).or_unaligned(unaligned)
        }
        None => {
            let mut args = vec![Arg::Tensor(Some(x)), Arg::Dst, Arg::Tensor(w)];
            if rms == 0 {
                args.push(Arg::Tensor(b));
            }
            args.extend(mods);
            args.push(Arg::Int(dim as i32));
            args.extend([at.row0, at.seq, split, stride].map(|v| Arg::Long(v as i64)));
            if rms == 0 {
                args.push(Arg::Int(two_pass as i32));
            }
            args.extend([Arg::Float(inv_dim(dim)), Arg::Float(eps as f32)]);
            let name = if rms == 1 {
                "rms_mod_bf16"
            } else {
                "layer_norm_mod_bf16"
            };
            row_launch(&ROWS, name, rows, args)
        }
    };
    out.inplace_op1(&launch)?;
    Ok(out)
}

/// `LayerNorm(x) * w + b` of `x` `[rows, dim]` in f32 (no affine of its own, two-pass mean and
/// variance), rounded once; `w`, `b` f32 `[1 or batch, dim]` (the modulation `1 + scale` and
/// `shift`, or an affine): `layer_norm_f32` then f32 `broadcast_mul` / `broadcast_add`.
pub(crate) fn layer_norm_affine_f32(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    at: Rows,
    eps: f64,
) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    let stride = if w.dim(0)? == 1 { 0 } else { dim };
    // SAFETY: the kernel writes every element of `out`.
    let out = unsafe { Tensor::empty((rows, dim), DType::BF16, x.device()) }?;
    if rows == 0 {
        return Ok(out);
    }
    let launch = match row_group(dim) {
        Some(g) if fits_i32(&[rows, dim, at.row0 + rows, at.seq, stride]) => {
            let names = [
                "layer_norm_mod_g32_f32",
                "layer_norm_mod_g64_f32",
                "layer_norm_mod_g128_f32",
            ];
            grouped_layer_norm(names, g, vec![Arg::Dst], (x, w, b), at, eps)?
        }
        _ => row_launch(
            &ROWS,
            "layer_norm_mod_f32",
            rows,
            vec![
                Arg::Tensor(Some(x)),
                Arg::Dst,
                Arg::Tensor(Some(b)),
                Arg::Tensor(Some(w)),
                Arg::Int(dim as i32),
                Arg::Long(at.row0 as i64),
                Arg::Long(at.seq as i64),
                Arg::Long(stride as i64),
                Arg::Float(eps as f32),
            ],
        ),
    };
    out.inplace_op1(&launch)?;
    Ok(out)
}

/// [`layer_norm_affine_f32`] of `x` as an fp8 Linear's input: e4m3 codes `[rows, dim]` and their
/// f32 scales `[rows]`, the bytes [`crate::models::fp8::Fp8Rows::quantize`] makes of the bf16 rows,
/// which are never stored (one pass over `x` instead of the norm's store and the quantizer's
/// read). `None` where the fused kernel does not take the rows: `dim` not a multiple of 16 or
/// wider than the grouped kernels, an operand not contiguous or not 16-byte aligned, or indices
/// past 32 bits; the caller then stores the rows and quantizes them.
pub(crate) fn layer_norm_affine_codes(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    at: Rows,
    eps: f64,
) -> Result<Option<(Tensor, Tensor)>> {
    let (rows, dim) = x.dims2()?;
    let stride = if w.dim(0)? == 1 { 0 } else { dim };
    let aligned = |t: &Tensor| {
        t.is_contiguous()
            && (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16)
    };
    let Some(g) = row_group(dim) else {
        return Ok(None);
    };
    if !rows_supported(x)
        || !dim.is_multiple_of(16)
        || rows == 0
        || ![x, w, b].into_iter().all(aligned)
        || !fits_i32(&[rows, dim, at.row0 + rows, at.seq, stride])
    {
        return Ok(None);
    }
    // SAFETY: the kernel writes every code and every scale.
    let q = unsafe { Tensor::empty((rows, dim), DType::F8E4M3, x.device()) }?;
    let scale = unsafe { Tensor::empty(rows, DType::F32, x.device()) }?;
    let names = [
        "layer_norm_mod_codes_g32_f32",
        "layer_norm_mod_codes_g64_f32",
        "layer_norm_mod_codes_g128_f32",
    ];
    let outputs = vec![Arg::Out(&q), Arg::Dst];
    scale.inplace_op1(&grouped_layer_norm(names, g, outputs, (x, w, b), at, eps)?)?;
    Ok(Some((q, scale)))
}

/// The grouped kernel of `names` (`g` threads a row) for `LayerNorm(x) * w + b`, `outputs` its
/// arguments after `x` (the bf16 rows, or the codes and the scales); the indices fit 32 bits.
fn grouped_layer_norm<'a>(
    names: [&'static str; 3],
    g: usize,
    outputs: Vec<Arg<'a>>,
    (x, w, b): (&'a Tensor, &'a Tensor, &'a Tensor),
    at: Rows,
    eps: f64,
) -> Result<Launch<'a>> {
    let (rows, dim) = x.dims2()?;
    let stride = if w.dim(0)? == 1 { 0 } else { dim };
    let mut args = vec![Arg::Tensor(Some(x))];
    args.extend(outputs);
    args.extend([
        Arg::Tensor(Some(b)),
        Arg::Tensor(Some(w)),
        Arg::Int(rows as i32),
        Arg::Int(dim as i32),
        Arg::Int(at.row0 as i32),
        Arg::Int(at.seq as i32),
        Arg::Int(stride as i32),
        Arg::Float(eps as f32),
    ]);
    Ok(row_launch(
        &ROWS,
        grouped(names, g),
        rows.div_ceil(ROW_THREADS / g),
        args,
    ))
}

/// `RMSNorm(x) * w` of `x` `[rows, dim]` (rows of [`grouped_rows_supported`]): candle's fused
/// f32 `rms_norm` without a weight, times `w` f32 `[1 or batch, dim]` (a modulation's `1 + scale`,
/// a gate) unrounded, rounded once: `rms_norm` on an f32 copy, an f32 `broadcast_mul`, the cast
/// back to bf16.
pub(crate) fn rms_mul_f32(x: &Tensor, w: &Tensor, at: Rows, eps: f64) -> Result<Tensor> {
    let dims = x.dims2()?;
    // SAFETY: the kernel writes every element of `out`.
    let out = unsafe { Tensor::empty(dims, DType::BF16, x.device()) }?;
    if dims.0 > 0 {
        out.inplace_op1(&rms_mul_launch(x, false, None, w, at, eps)?)?;
    }
    Ok(out)
}

/// `res + RMSNorm(delta) * w` ([`rms_mul_f32`] of `delta`, then the bf16 add), written into
/// `delta`'s storage.
pub(crate) fn rms_mul_residual_f32(
    res: &Tensor,
    delta: Tensor,
    w: &Tensor,
    at: Rows,
    eps: f64,
) -> Result<Tensor> {
    if res.dims2()? != delta.dims2()? {
        candle_core::bail!(
            "rms_mul residual: {:?} and {:?} differ",
            res.dims(),
            delta.dims()
        )
    }
    if delta.dim(0)? > 0 {
        delta.inplace_op1(&rms_mul_launch(&delta, true, Some(res), w, at, eps)?)?;
    }
    Ok(delta)
}

/// The `rms_mul` kernel's launch over the rows of `x` (when `x_is_dst`, the destination: each
/// row is read before it is written), adding `res` where given.
fn rms_mul_launch<'a>(
    x: &'a Tensor,
    x_is_dst: bool,
    res: Option<&'a Tensor>,
    w: &'a Tensor,
    at: Rows,
    eps: f64,
) -> Result<Launch<'a>> {
    let (rows, dim) = x.dims2()?;
    let (w_rows, w_dim) = w.dims2()?;
    let Some(g) = row_group(dim) else {
        candle_core::bail!("rms_mul: rows of {dim} (a multiple of 8 up to {MAX_DIM})")
    };
    let batches = (at.row0 + rows).div_ceil(at.seq.max(1));
    if x.dtype() != DType::BF16
        || res.is_some_and(|r| r.dtype() != DType::BF16)
        || w.dtype() != DType::F32
        || w_dim != dim
        || at.seq == 0
        || (w_rows != 1 && w_rows < batches)
    {
        candle_core::bail!(
            "rms_mul: x {:?} {:?}, w {:?} {:?} for {batches} batch entries",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        )
    }
    Ok(row_launch(
        &ROWS,
        grouped(
            ["rms_mul_g32_f32", "rms_mul_g64_f32", "rms_mul_g128_f32"],
            g,
        ),
        rows.div_ceil(ROW_THREADS / g),
        vec![
            if x_is_dst {
                Arg::Dst
            } else {
                Arg::Tensor(Some(x))
            },
            Arg::Tensor(res),
            Arg::Dst,
            Arg::Tensor(Some(w)),
            Arg::Long(rows as i64),
            Arg::Int(dim as i32),
            Arg::Long(at.row0 as i64),
            Arg::Long(at.seq as i64),
            Arg::Long(if w_rows == 1 { 0 } else { dim as i64 }),
            Arg::Float(eps as f32),
        ],
    ))
}

/// Widest head [`head_norm_rope`] takes (`2 * 32 * MAX_HEAD_PAIRS` in the kernel).
pub(crate) const MAX_HEAD_DIM: usize = 256;

/// In place on `x` `[rows, heads * head_dim]`: bias, per head candle's fused `layer_norm` with
/// `w`, `b` `[head_dim]` (`b` given) or its fused `rms_norm` with `w` (`b` `None`), then RoPE
/// at the positions `rope_start..` (cos, sin `[n, head_dim / 2]` f32: n positions) when `rope`
/// is given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_norm_rope(
    x: Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    b: Option<&Tensor>,
    rope: Option<(&Tensor, &Tensor)>,
    head_dim: usize,
    rope_start: usize,
    at: Rows,
    eps: f64,
) -> Result<Tensor> {
    let rope_end = match rope {
        Some((cos, _)) => rope_start + cos.dim(0)?,
        None => 0,
    };
    let norm = HeadNorm {
        w,
        b,
        head_dim,
        eps,
    };
    launch_head_norm_rope(x, bias, norm, rope, (rope_start, rope_end, 0), at)
}

/// In place on `x` `[rows, heads * head_dim]`: per head candle's fused `rms_norm` with `w`, then
/// candle's rotate-half `rope` on the leading `rotary` channels of each head (cos, sin
/// `[seq, rotary / 2]` f32, a row at each position of the sequence), the rest passing through.
pub(crate) fn head_rms_rope_half(
    x: Tensor,
    w: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    head_dim: usize,
    rotary: usize,
    at: Rows,
    eps: f64,
) -> Result<Tensor> {
    if rotary == 0 || !rotary.is_multiple_of(2) || rotary > head_dim || cos.dim(1)? != rotary / 2 {
        candle_core::bail!("head_rms_rope_half: {rotary} rotary channels of {head_dim}")
    }
    let norm = HeadNorm {
        w,
        b: None,
        head_dim,
        eps,
    };
    launch_head_norm_rope(
        x,
        None,
        norm,
        Some((cos, sin)),
        (0, cos.dim(0)?, rotary),
        at,
    )
}

/// In place on `x` `[rows, heads * head_dim]`: each head's `sections` equal sections rotated by
/// half, `x * cos + [-x2 | x1] * sin` with cos, sin `[seq, head_dim]` f32 at each row's position,
/// in f32 with each product and the sum rounded (torch's `(x.float() * cos + rotated.float() *
/// sin).to(bf16)`, Allegro's rotary embedding).
pub(crate) fn rope_sections(
    x: Tensor,
    (cos, sin): (&Tensor, &Tensor),
    head_dim: usize,
    sections: usize,
    at: Rows,
) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    let width = head_dim.checked_div(sections).unwrap_or(0);
    if width == 0
        || width * sections != head_dim
        || !width.is_multiple_of(2)
        || !dim.is_multiple_of(head_dim)
        || cos.dims2()? != (at.seq, head_dim)
        || sin.dims2()? != (at.seq, head_dim)
        || !fits_i32(&[dim])
    {
        candle_core::bail!(
            "rope_sections: {sections} sections of {head_dim} channels in rows of {dim}, tables {:?}",
            cos.dims()
        )
    }
    let pairs = rows * dim / 2;
    x.inplace_op1(&item_launch(
        &ROWS,
        "rope_sections_bf16",
        pairs,
        vec![
            Arg::Dst,
            Arg::Tensor(Some(cos)),
            Arg::Tensor(Some(sin)),
            Arg::Long(pairs as i64),
            Arg::Int(dim as i32),
            Arg::Int(head_dim as i32),
            Arg::Int((width / 2) as i32),
            Arg::Long(at.row0 as i64),
            Arg::Long(at.seq as i64),
        ],
    ))?;
    Ok(x)
}

/// The per-head norm of [`head_norm_rope`]: `w`, `b` `[head_dim]` (no `b`: RMSNorm).
struct HeadNorm<'a> {
    w: &'a Tensor,
    b: Option<&'a Tensor>,
    head_dim: usize,
    eps: f64,
}

/// `head_norm_rope_bf16` on `x` with RoPE at positions `start..end`, interleaved (`rotary` 0)
/// or rotate-half on `rotary` channels.
fn launch_head_norm_rope(
    x: Tensor,
    bias: Option<&Tensor>,
    HeadNorm {
        w,
        b,
        head_dim,
        eps,
    }: HeadNorm,
    rope: Option<(&Tensor, &Tensor)>,
    (rope_start, rope_end, rotary): (usize, usize, usize),
    at: Rows,
) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    if head_dim == 0
        || head_dim > MAX_HEAD_DIM
        || !head_dim.is_multiple_of(2)
        || !dim.is_multiple_of(head_dim)
    {
        candle_core::bail!("head_norm_rope: head_dim {head_dim} does not fit rows of {dim}")
    }
    // One warp per (row, head).
    let units = rows * (dim / head_dim);
    x.inplace_op1(&row_launch(
        &ROWS,
        "head_norm_rope_bf16",
        units.div_ceil(ROW_THREADS / 32),
        vec![
            Arg::Dst,
            Arg::Tensor(bias),
            Arg::Tensor(Some(w)),
            Arg::Tensor(b),
            Arg::Tensor(rope.map(|r| r.0)),
            Arg::Tensor(rope.map(|r| r.1)),
            Arg::Long(units as i64),
            Arg::Int(dim as i32),
            Arg::Int(head_dim as i32),
            Arg::Long(at.row0 as i64),
            Arg::Long(at.seq as i64),
            Arg::Int(b.is_none().into()),
            Arg::Long(rope_start as i64),
            Arg::Long(rope_end as i64),
            Arg::Int(rotary as i32),
            Arg::Float(eps as f32),
        ],
    ))?;
    Ok(x)
}

/// In place on `x` `[rows, heads * head_dim]`: bias, RMSNorm across the row with `w`, then RoPE
/// per head when `rope` (cos, sin `[seq, head_dim / 2]` f32) is given, in `rounding`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_rope(
    x: Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    rope: Option<(&Tensor, &Tensor)>,
    head_dim: usize,
    at: Rows,
    eps: f64,
    rounding: Rounding,
) -> Result<Tensor> {
    let norm = RmsRope {
        bias,
        w,
        rope,
        head_dim,
        eps,
        rounding,
    };
    norm.apply(x, at, Width::Widest)
}

/// What [`rms_rope`] computes over each row.
struct RmsRope<'a> {
    bias: Option<&'a Tensor>,
    w: &'a Tensor,
    rope: Option<(&'a Tensor, &'a Tensor)>,
    head_dim: usize,
    eps: f64,
    rounding: Rounding,
}

impl RmsRope<'_> {
    /// [`rms_rope`] through the grouped vector kernel where `width` and the row allow it, else
    /// the block-per-row one.
    fn apply(&self, x: Tensor, at: Rows, width: Width) -> Result<Tensor> {
        let RmsRope {
            bias,
            w,
            rope,
            head_dim,
            eps,
            rounding,
        } = *self;
        let (rows, dim) = x.dims2()?;
        if rows == 0 {
            return Ok(x);
        }
        let (cos, sin) = (rope.map(|r| r.0), rope.map(|r| r.1));
        let group = row_group(dim).filter(|_| {
            (rope.is_none() || head_dim.is_multiple_of(8))
                && width.vectors(dim, &[rows, dim, head_dim, at.row0 + rows, at.seq])
        });
        // The pointers both kernels take first.
        let mut args = vec![
            Arg::Dst,
            Arg::Tensor(bias),
            Arg::Tensor(Some(w)),
            Arg::Tensor(cos),
            Arg::Tensor(sin),
        ];
        let launch = match group {
            Some(g) => {
                args.extend([rows, dim, head_dim, at.row0, at.seq].map(|v| Arg::Int(v as i32)));
                args.extend([Arg::Float(inv_dim(dim)), Arg::Float(eps as f32)]);
                let names = match rounding {
                    Rounding::F32 => ["rms_rope_g32_f32", "rms_rope_g64_f32", "rms_rope_g128_f32"],
                    Rounding::Bf16 => [
                        "rms_rope_g32_bf16",
                        "rms_rope_g64_bf16",
                        "rms_rope_g128_bf16",
                    ],
                };
                row_launch(
                    &ROWS,
                    grouped(names, g),
                    rows.div_ceil(ROW_THREADS / g),
                    args,
                )
            }
            None => {
                args.extend([Arg::Int(dim as i32), Arg::Int(head_dim as i32)]);
                args.extend([at.row0, at.seq].map(|v| Arg::Long(v as i64)));
                args.extend([Arg::Float(inv_dim(dim)), Arg::Float(eps as f32)]);
                row_launch(
                    &ROWS,
                    rounding.kernel(["rms_rope_f32", "rms_rope_bf16"]),
                    rows,
                    args,
                )
            }
        };
        x.inplace_op1(&launch)?;
        Ok(x)
    }
}

/// The gate of a residual update, whose dtype is the rounding of the product.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Gate<'a> {
    /// f32 `[batch, dim]`, one row per batch entry; the product is not rounded (Wan).
    F32(&'a Tensor),
    /// A bf16 row per batch entry (or table row); the product is rounded.
    Bf16(BatchRow<'a>),
}

/// `res + (delta + bias) * gate` (bias and gate optional), written into `delta`'s storage.
pub(crate) fn residual_into_delta(
    res: &Tensor,
    delta: Tensor,
    bias: Option<&Tensor>,
    gate: Option<Gate>,
    at: Rows,
) -> Result<Tensor> {
    delta.inplace_op1(&residual_launch(
        res.dims2()?,
        delta.dims2()?,
        [Arg::Tensor(Some(res)), Arg::Dst],
        bias,
        gate,
        at,
        Width::Widest,
    )?)?;
    Ok(delta)
}

/// `res + (delta + bias) * gate` (bias and gate optional), written over `res`'s storage: rows
/// of a tensor the caller owns (a contiguous view of the residual stream), updated where they
/// lie, with no copy of the sum into them.
pub(crate) fn residual_over(
    res: &Tensor,
    delta: &Tensor,
    bias: Option<&Tensor>,
    gate: Option<Gate>,
    at: Rows,
) -> Result<()> {
    res.inplace_op1(&residual_launch(
        res.dims2()?,
        delta.dims2()?,
        [Arg::Dst, Arg::Tensor(Some(delta))],
        bias,
        gate,
        at,
        Width::Widest,
    )?)
}

/// Which version of an element-wise or row kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Width {
    /// The vector kernel where rows are whole 8-element vectors and every index fits its 32
    /// bits, else the pair kernel (for rows: the block-per-row one).
    Widest,
    /// The pair kernel (bf16 pairs, 64-bit indices): the tests' reference for the vector one.
    #[cfg(test)]
    Pairs,
}

impl Width {
    /// Whether the vector kernel runs over rows of `dim` with these `indices`.
    fn vectors(self, dim: usize, indices: &[usize]) -> bool {
        self == Width::Widest && dim.is_multiple_of(8) && fits_i32(indices)
    }
}

/// The gated residual kernel's launch over `(rows, dim)` with `operands` (res, delta), one of
/// them the destination it writes.
#[allow(clippy::too_many_arguments)]
fn residual_launch<'a>(
    res_dims: (usize, usize),
    (rows, dim): (usize, usize),
    [res_arg, delta_arg]: [Arg<'a>; 2],
    bias: Option<&'a Tensor>,
    gate: Option<Gate<'a>>,
    at: Rows,
    width: Width,
) -> Result<Launch<'a>> {
    if res_dims != (rows, dim) {
        candle_core::bail!("residual: {res_dims:?} and {:?} differ", (rows, dim))
    }
    let (rounding, [gate, gate_text, row_table], split, stride, table_len) = match gate {
        Some(Gate::F32(g)) => (
            Rounding::F32,
            [
                Arg::Tensor(Some(g)),
                Arg::Tensor(Some(g)),
                Arg::Tensor(None),
            ],
            0,
            dim,
            g.elem_count(),
        ),
        Some(Gate::Bf16(g)) => {
            let (split, text) = g.text.unwrap_or((0, g.offset));
            (
                Rounding::Bf16,
                [
                    Arg::At(g.table, g.offset),
                    Arg::At(g.table, text),
                    Arg::Tensor(g.rows),
                ],
                split,
                g.stride,
                g.table.elem_count(),
            )
        }
        None => (
            Rounding::Bf16,
            [Arg::Tensor(None), Arg::Tensor(None), Arg::Tensor(None)],
            0,
            0,
            0,
        ),
    };
    let n = rows * dim;
    let vectors = width.vectors(dim, &[n, at.row0 + rows, at.seq, split, stride, table_len]);
    let index = |v: usize| {
        if vectors {
            Arg::Int(v as i32)
        } else {
            Arg::Long(v as i64)
        }
    };
    let args = vec![
        res_arg,
        delta_arg,
        Arg::Tensor(bias),
        gate,
        gate_text,
        row_table,
        Arg::Dst,
        index(n),
        Arg::Int(dim as i32),
        index(at.row0),
        index(at.seq),
        index(split),
        index(stride),
    ];
    Ok(if vectors {
        item_launch(
            &ROWS,
            rounding.kernel(["residual_v8_f32", "residual_v8_bf16"]),
            n / 8,
            args,
        )
    } else {
        element_launch(
            &ROWS,
            rounding.kernel(["residual_f32", "residual_bf16"]),
            n,
            args,
        )
    })
}

/// The activation after a bias in [`bias_act`], in f32 and rounded once, as torch computes it
/// on bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Act {
    GeluTanh = 1,
    GeluErf = 2,
}

/// In place on `x` `[rows, dim]`: `x + bias`, then `act`.
pub(crate) fn bias_act(x: Tensor, bias: &Tensor, act: Act) -> Result<Tensor> {
    x.inplace_op1(&bias_act_launch(x.dims2()?, bias, act, Width::Widest))?;
    Ok(x)
}

/// The bias + activation kernel's launch over `(rows, dim)`.
fn bias_act_launch(
    (rows, dim): (usize, usize),
    bias: &Tensor,
    act: Act,
    width: Width,
) -> Launch<'_> {
    let n = rows * dim;
    let vectors = width.vectors(dim, &[n]);
    let args = vec![
        Arg::Dst,
        Arg::Tensor(Some(bias)),
        if vectors {
            Arg::Int(n as i32)
        } else {
            Arg::Long(n as i64)
        },
        Arg::Int(dim as i32),
        Arg::Int(act as i32),
    ];
    if vectors {
        item_launch(&ROWS, "bias_act_v8", n / 8, args)
    } else {
        element_launch(&ROWS, "bias_act", n, args)
    }
}

/// `x @ weight^T + bias`, then `act`, for `x` `[rows, in]`: the bias and a tanh GELU in the
/// matmul's epilogue where cuBLASLt takes them (bf16, as PyTorch adds a Linear's bias), else the
/// product followed by [`bias_act`] (an erf GELU always).
pub(crate) fn matmul_bias_act(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    act: Act,
) -> Result<Tensor> {
    if act != Act::GeluErf {
        let gelu = act == Act::GeluTanh;
        if let Some(y) = crate::models::linear::linear_bias_act(x, weight, bias, gelu)? {
            return Ok(y);
        }
    }
    bias_act(x.matmul(&weight.t()?)?, bias, act)
}

/// `bf16(RMSNorm(x) * w)` of an f32 residual stream `x` `[rows, dim]` with an f32 weight `w`
/// `[dim]` (candle's fused f32 `rms_norm`, then the cast): the bf16 input of the layers after an
/// f32 norm, in one pass.
pub(crate) fn rms_norm_f32_to_bf16(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    if x.dtype() != DType::F32 || w.dtype() != DType::F32 || w.dims1()? != dim {
        candle_core::bail!(
            "rms_norm_f32_to_bf16: x {:?} {:?}, w {:?} {:?}",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        )
    }
    // SAFETY: the kernel writes every element of `out`.
    let out = unsafe { Tensor::empty((rows, dim), DType::BF16, x.device()) }?;
    if rows > 0 {
        out.inplace_op1(&row_launch(
            &ROWS,
            "rms_norm_f32_to_bf16",
            rows,
            vec![
                Arg::Tensor(Some(x)),
                Arg::Tensor(Some(w)),
                Arg::Dst,
                Arg::Int(dim as i32),
                Arg::Float(eps as f32),
            ],
        ))?;
    }
    Ok(out)
}

/// In place on the f32 residual stream `x` `[rows, dim]`: `x + f32(delta) * scale` of a bf16
/// layer output `delta` `[rows, dim]` and an f32 `scale` `[dim]`, the product and the sum each
/// rounded to f32, as torch promotes them.
pub(crate) fn residual_scaled_f32(x: &Tensor, delta: &Tensor, scale: &Tensor) -> Result<()> {
    let (rows, dim) = x.dims2()?;
    if x.dtype() != DType::F32
        || delta.dtype() != DType::BF16
        || scale.dtype() != DType::F32
        || delta.dims2()? != (rows, dim)
        || scale.dims1()? != dim
        || !fits_i32(&[rows * dim])
    {
        candle_core::bail!(
            "residual_scaled_f32: x {:?} {:?}, delta {:?} {:?}, scale {:?} {:?}",
            x.dims(),
            x.dtype(),
            delta.dims(),
            delta.dtype(),
            scale.dims(),
            scale.dtype()
        )
    }
    let n = rows * dim;
    x.inplace_op1(&item_launch(
        &ROWS,
        "residual_scaled_f32",
        n,
        vec![
            Arg::Dst,
            Arg::Tensor(Some(delta)),
            Arg::Tensor(Some(scale)),
            Arg::Int(n as i32),
            Arg::Int(dim as i32),
        ],
    ))
}

/// `value * silu(gate)` of `h` `[rows, 2 * inner]` = `[value | gate]`: SiLU in f32 rounded once
/// (as torch's bf16 `silu`), then the rounded product; `[rows, inner]`.
pub(crate) fn swiglu(h: &Tensor) -> Result<Tensor> {
    let (rows, width) = h.dims2()?;
    let inner = width / 2;
    if !inner.is_multiple_of(2) || width != 2 * inner {
        candle_core::bail!(
            "swiglu: a [rows, 2 * inner] input with an even inner width, got {width}"
        )
    }
    // SAFETY: the kernel writes every element of `out`.
    let out = unsafe { Tensor::empty((rows, inner), DType::BF16, h.device()) }?;
    out.inplace_op1(&element_launch(
        &ROWS,
        "swiglu_bf16",
        rows * inner,
        vec![
            Arg::Tensor(Some(h)),
            Arg::Dst,
            Arg::Long((rows * inner) as i64),
            Arg::Int(inner as i32),
        ],
    ))?;
    Ok(out)
}

/// Helpers of the CUDA tests that compare the fused kernels with the candle compositions.
#[cfg(test)]
pub(crate) mod test_util {
    use candle_core::{DType, Device, Result, Tensor};

    /// The first CUDA device, or `None` (and a note that `what` was skipped) without one.
    pub(crate) fn device(what: &str) -> Option<Device> {
        let dev = Device::new_cuda(0).ok();
        if dev.is_none() {
            eprintln!("no CUDA device: {what} test skipped");
        }
        dev
    }

    /// Normal random bf16 values of standard deviation `std`.
    pub(crate) fn randn(shape: &[usize], std: f64, dev: &Device) -> Result<Tensor> {
        Tensor::randn(0f32, std as f32, shape, dev)?.to_dtype(DType::BF16)
    }

    fn values(t: &Tensor) -> Result<Vec<f32>> {
        t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
    }

    /// One bf16 ulp at magnitude `m`: 2^(floor(log2 m) - 7).
    fn ulp(m: f32) -> f32 {
        2f32.powi(m.abs().max(f32::MIN_POSITIVE).log2().floor() as i32 - 7)
    }

    /// Asserts `|got - want| <= ulp(max(|want|, |term|))` element-wise, where `term` is the
    /// largest operand of the last rounded step (a summation-order change flips at most that
    /// rounding by one ulp; a cancelling add after it must not shrink the bound below that ulp).
    pub(crate) fn assert_within_ulp(
        got: &Tensor,
        want: &Tensor,
        term: &Tensor,
        what: &str,
    ) -> Result<()> {
        assert_within(got, want, term, None, what)
    }

    /// [`assert_within_ulp`] for a result computed from a rounded reduction (a norm) through two
    /// further rounded steps (`n * g`, then `+ shift`): a one-ulp flip of the reduced value
    /// `carried.0` reaches the result multiplied by `|carried.1|` (the gain `g`, e.g. the
    /// `1 + scale` of a modulation), and each of the two roundings after it may then land one
    /// ulp apart.
    pub(crate) fn assert_within_ulp_carrying(
        got: &Tensor,
        want: &Tensor,
        term: &Tensor,
        carried: (&Tensor, &Tensor),
        what: &str,
    ) -> Result<()> {
        assert_within(got, want, term, Some(carried), what)
    }

    fn assert_within(
        got: &Tensor,
        want: &Tensor,
        term: &Tensor,
        carried: Option<(&Tensor, &Tensor)>,
        what: &str,
    ) -> Result<()> {
        assert_eq!(got.dims(), want.dims(), "{what}: shapes");
        let (g, w, t) = (values(got)?, values(want)?, values(term)?);
        let carried = match carried {
            // The flip through the gain, plus the second rounding's ulp (the loop adds the
            // first's).
            Some((value, gain)) => {
                let (v, k) = (
                    values(&value.broadcast_as(want.shape())?)?,
                    values(&gain.broadcast_as(want.shape())?)?,
                );
                (0..g.len())
                    .map(|i| ulp(v[i]) * k[i].abs() + ulp(w[i].abs().max(t[i].abs())))
                    .collect()
            }
            None => vec![0f32; g.len()],
        };
        let (mut worst, mut worst_at, mut over) = (0f32, 0, 0usize);
        for i in 0..g.len() {
            assert!(g[i].is_finite(), "{what}: element {i} is {}", g[i]);
            let bound = ulp(w[i].abs().max(t[i].abs())) + carried[i];
            let ratio = (g[i] - w[i]).abs() / bound;
            over += usize::from(ratio > 1.0);
            if ratio > worst {
                (worst, worst_at) = (ratio, i);
            }
        }
        let i = worst_at;
        eprintln!(
            "{what}: worst difference {worst} of its bound at element {i} ({} vs {}, term {}), {over} of {} over it",
            g[i], w[i], t[i], g.len()
        );
        assert!(over == 0, "{what}: {over} elements over their bound");
        Ok(())
    }
}

#[cfg(test)]
mod cuda_tests {
    //! The vector kernels against the pair kernels, which compute the same arithmetic element by
    //! element: equal bits in both roundings, through 16-byte and scalar accesses, with a text
    //! part and a row table; the grouped row kernels against the block-per-row ones, which sum
    //! a row in another order: within the ulp such an order moves. (Each family's tests compare
    //! the kernels with its compositions.)
    use super::test_util::{assert_within_ulp, assert_within_ulp_carrying, device, randn};
    use super::*;
    use candle_core::Device;

    /// The bits of a bf16 tensor.
    fn bits(t: &Tensor) -> Result<Vec<u16>> {
        Ok(t.flatten_all()?
            .to_vec1::<half::bf16>()?
            .into_iter()
            .map(|v| v.to_bits())
            .collect())
    }

    /// The first `rows` rows of `t` (`[.., dim]`) seen `offset` elements further on: a view that
    /// is not 16-byte aligned where `offset` is not a multiple of 8 (and even: the pair kernels
    /// read bf16 pairs, 4-byte aligned, as every caller's views are).
    fn shifted(t: &Tensor, offset: usize, rows: usize) -> Result<Tensor> {
        let dim = t.dim(1)?;
        t.flatten_all()?
            .narrow(0, offset, rows * dim)?
            .reshape((rows, dim))
    }

    /// Asserts that `run` writes the same bits through the vector kernel as through the pair one.
    fn widths_agree(run: impl Fn(Width) -> Result<Vec<u16>>, what: &str) -> Result<()> {
        let (vectors, pairs) = (run(Width::Widest)?, run(Width::Pairs)?);
        let differ = vectors.iter().zip(&pairs).filter(|(a, b)| a != b).count();
        assert!(
            differ == 0,
            "{what}: {differ} of {} elements differ",
            pairs.len()
        );
        Ok(())
    }

    #[test]
    fn vector_residuals_equal_pair_residuals() -> Result<()> {
        let Some(dev) = device("row kernels") else {
            return Ok(());
        };
        let (rows, dim, seq) = (300, 1536, 150);
        let res = randn(&[rows + 1, dim], 1.0, &dev)?;
        let delta = randn(&[rows + 1, dim], 1.0, &dev)?;
        let bias = randn(&[dim], 0.2, &dev)?;
        let f32_gate = randn(&[2, dim], 0.5, &dev)?.to_dtype(DType::F32)?;
        let table = randn(&[4, 6 * dim], 0.5, &dev)?;
        let entries: Vec<u32> = (0..rows as u32).map(|r| (r * 7) % 4).collect();
        let entries = Tensor::new(entries, &dev)?;
        let row = |text, rows| BatchRow {
            table: &table,
            stride: 6 * dim,
            offset: 2 * dim,
            text,
            rows,
        };
        let gates = [
            None,
            Some(Gate::F32(&f32_gate)),
            Some(Gate::Bf16(row(None, None))),
            Some(Gate::Bf16(row(Some((20, 5 * dim)), None))),
            Some(Gate::Bf16(row(None, Some(&entries)))),
        ];
        let at = Rows { row0: 0, seq };
        for (i, gate) in gates.into_iter().enumerate() {
            for offset in [0, 8, 6] {
                let run = |width| -> Result<Vec<u16>> {
                    let res = shifted(&res, offset, rows)?;
                    let delta = shifted(&delta.copy()?, offset, rows)?;
                    delta.inplace_op1(&residual_launch(
                        res.dims2()?,
                        delta.dims2()?,
                        [Arg::Tensor(Some(&res)), Arg::Dst],
                        Some(&bias),
                        gate,
                        at,
                        width,
                    )?)?;
                    bits(&delta)
                };
                widths_agree(run, &format!("gate {i}, offset {offset}"))?;
            }
        }
        Ok(())
    }

    #[test]
    fn vector_bias_act_equals_pair_bias_act() -> Result<()> {
        let Some(dev) = device("row kernels") else {
            return Ok(());
        };
        let (rows, dim) = (257, 1024);
        let x = (randn(&[rows + 1, dim], 1.0, &dev)? * 3.0)?;
        let bias = randn(&[dim], 0.5, &dev)?;
        for act in [Act::GeluTanh, Act::GeluErf] {
            for offset in [0, 2] {
                let run = |width| -> Result<Vec<u16>> {
                    let x = shifted(&x.copy()?, offset, rows)?;
                    x.inplace_op1(&bias_act_launch(x.dims2()?, &bias, act, width))?;
                    bits(&x)
                };
                widths_agree(run, &format!("{act:?}, offset {offset}"))?;
            }
        }
        Ok(())
    }
    /// The modulated LayerNorm's rows as an fp8 Linear's input are the codes and scales that
    /// quantizing its stored bf16 rows gives, bit for bit: at 32, 64 and 128 threads a row, with
    /// a modulation row per batch entry (a slab starting inside the first) and one shared, and a
    /// row that normalizes to zeros (scale 0, zero codes). Declined: rows whose width is not a
    /// multiple of 16, and rows not 16-byte aligned.
    #[test]
    fn layer_norm_codes_are_the_quantized_rows() -> Result<()> {
        use crate::models::fp8::Fp8Rows;
        let Some(dev) = device("row kernels") else {
            return Ok(());
        };
        let (rows, eps) = (37, 1e-6);
        let at = Rows { row0: 3, seq: 20 };
        // On the host: candle has no CUDA cast from e4m3.
        let floats = |t: &Tensor| -> Result<Vec<u32>> {
            let t = t.to_device(&Device::Cpu)?.flatten_all()?;
            let v = t.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            Ok(v.into_iter().map(f32::to_bits).collect())
        };
        for (dim, entries, zero_shift) in [
            (256, 2, true),
            (1536, 2, false),
            (3072, 1, false),
            (5120, 1, false),
        ] {
            let x = ((randn(&[rows, dim], 1.0, &dev)? * 3.0)? + 0.5)?;
            // Row 5 is constant: it normalizes to zeros, then takes the shift.
            let x = x.slice_assign(
                &[5..6, 0..dim],
                &(Tensor::ones((1, dim), DType::BF16, &dev)? * 0.7)?,
            )?;
            let w = (randn(&[entries, dim], 0.5, &dev)?.to_dtype(DType::F32)? + 1.0)?;
            let b = randn(&[entries, dim], 0.5, &dev)?.to_dtype(DType::F32)?;
            let b = if zero_shift { b.zeros_like()? } else { b };
            let want = Fp8Rows::quantize(&layer_norm_affine_f32(&x, &w, &b, at, eps)?, false)?;
            let (q, scale) = layer_norm_affine_codes(&x, &w, &b, at, eps)?
                .unwrap_or_else(|| panic!("dim {dim}: declined"));
            assert_eq!(q.dims(), want.q.dims(), "dim {dim}");
            assert!(floats(&q)? == floats(&want.q)?, "dim {dim}: codes differ");
            assert!(
                floats(&scale)? == floats(&want.scale)?,
                "dim {dim}: scales differ"
            );
            let scales = scale.to_vec1::<f32>()?;
            assert_eq!(
                scales[5] == 0.0,
                zero_shift,
                "dim {dim}: the constant row's scale"
            );
        }
        let (w, b) = (
            Tensor::ones((1, 1544), DType::F32, &dev)?,
            Tensor::zeros((1, 1544), DType::F32, &dev)?,
        );
        let x = randn(&[rows, 1544], 1.0, &dev)?;
        assert!(
            layer_norm_affine_codes(&x, &w, &b, at, eps)?.is_none(),
            "1544 columns"
        );
        let (w, b) = (
            w.narrow(1, 0, 1536)?.contiguous()?,
            b.narrow(1, 0, 1536)?.contiguous()?,
        );
        let x = randn(&[rows * 1536 + 4], 1.0, &dev)?
            .narrow(0, 4, rows * 1536)?
            .reshape((rows, 1536))?;
        assert!(
            layer_norm_affine_codes(&x, &w, &b, at, eps)?.is_none(),
            "unaligned rows"
        );
        Ok(())
    }

    #[test]
    fn grouped_norms_agree_with_block_norms() -> Result<()> {
        let Some(dev) = device("row kernels") else {
            return Ok(());
        };
        // Groups of 64 and 256 threads; modulation rows a whole number of vectors apart, and
        // not (the scalar kernel).
        for (dim, stride) in [(1152, 6 * 1152), (4608, 6 * 4608 + 4)] {
            norms_agree(&dev, dim, stride)?;
        }
        Ok(())
    }

    fn norms_agree(dev: &Device, dim: usize, stride: usize) -> Result<()> {
        let (rows, seq) = (300, 150);
        let x = ((randn(&[rows + 1, dim], 1.0, dev)? * 3.0)? + 0.5)?;
        let (w, b) = (randn(&[dim], 1.0, dev)?, randn(&[dim], 0.5, dev)?);
        let table = randn(&[4, stride], 0.5, dev)?;
        let entries: Vec<u32> = (0..rows as u32).map(|r| (r * 7) % 4).collect();
        let entries = Tensor::new(entries, dev)?;
        let modulation = |text, rows| Modulation {
            table: &table,
            stride,
            shift: 0,
            scale: dim,
            text,
            rows,
        };
        let modulations = [
            None,
            Some(modulation(None, None)),
            Some(modulation(Some((20, 3 * dim, 4 * dim)), None)),
            Some(modulation(None, Some(&entries))),
        ];
        // The largest gain `1 + scale` of any modulation row: what a flip of the norm carries.
        let gain = (table.to_dtype(DType::F32)?.abs()?.max_all()? + 1.0)?.reshape((1, 1))?;
        let norms = [
            Norm::Rms(None),
            Norm::Rms(Some(&w)),
            Norm::Layer(LayerNorm::Fused { w: &w, b: &b }),
            Norm::Layer(LayerNorm::TwoPass),
        ];
        let at = Rows { row0: 0, seq };
        for (n, norm) in norms.into_iter().enumerate() {
            for offset in [0, 8, 2] {
                let x = shifted(&x, offset, rows)?;
                let normed = norm_modulate(&x, norm, None, at, 1e-6, Width::Pairs)?;
                // The magnitude a flip of the norm's rounding is an ulp of: the affine's last add
                // may cancel, so its operands', |n·w| = |normed - b| and |b|, at most
                // |normed| + |b|; and near the row's mean, x - mean carries the mean's own
                // summation error (a few f32 ulps of the mean over std): at least 1e-3.
                let normed_abs = normed.to_dtype(DType::F32)?.abs()?;
                let flipped = match norm {
                    Norm::Layer(LayerNorm::Fused { b, .. }) => {
                        normed_abs.broadcast_add(&b.to_dtype(DType::F32)?.abs()?)?
                    }
                    _ => normed_abs,
                }
                .maximum(1e-3)?;
                for (m, modulation) in modulations.into_iter().enumerate() {
                    let what = format!("dim {dim}, norm {n}, modulation {m}, offset {offset}");
                    let run = |width| norm_modulate(&x, norm, modulation, at, 1e-6, width);
                    let (got, want) = (run(Width::Widest)?, run(Width::Pairs)?);
                    if modulation.is_none() {
                        assert_within_ulp(&got, &want, &flipped, &what)?;
                    } else {
                        let term = flipped.broadcast_mul(&gain.broadcast_as((rows, dim))?)?;
                        let gain = gain.broadcast_as((rows, dim))?;
                        assert_within_ulp_carrying(&got, &want, &term, (&flipped, &gain), &what)?;
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn grouped_rms_rope_agrees_with_block_rms_rope() -> Result<()> {
        let Some(dev) = device("row kernels") else {
            return Ok(());
        };
        let (rows, dim, head_dim, seq) = (300, 1024, 64, 150);
        let x = (randn(&[rows + 1, dim], 1.0, &dev)? * 3.0)?;
        let (w, bias) = (randn(&[dim], 1.0, &dev)?, randn(&[dim], 0.5, &dev)?);
        let angles = Tensor::arange(0f32, (seq * head_dim / 2) as f32, &dev)?
            .affine(0.01, 0.0)?
            .reshape((seq, head_dim / 2))?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let at = Rows { row0: 0, seq };
        for rounding in [Rounding::F32, Rounding::Bf16] {
            for offset in [0, 2] {
                let norm = |rope| RmsRope {
                    bias: Some(&bias),
                    w: &w,
                    rope,
                    head_dim,
                    eps: 1e-6,
                    rounding,
                };
                let run =
                    |rope, width| norm(rope).apply(shifted(&x.copy()?, offset, rows)?, at, width);
                // A rotated pair mixes both members: bound by the larger normalised one.
                let term = run(None, Width::Pairs)?
                    .abs()?
                    .reshape((rows, dim / 2, 2))?
                    .max_keepdim(2)?
                    .broadcast_as((rows, dim / 2, 2))?
                    .reshape((rows, dim))?;
                let rope = Some((&cos, &sin));
                let (got, want) = (run(rope, Width::Widest)?, run(rope, Width::Pairs)?);
                let what = format!("{rounding:?}, offset {offset}");
                assert_within_ulp(&got, &want, &term, &what)?;
            }
        }
        Ok(())
    }
}
