//! Fused CUDA kernels shared by the DiT blocks (`dit_ops.cu`): RMSNorm with `(1 + scale)` /
//! shift modulation, q/k RMSNorm across heads with bias and RoPE, gated residual with bias, bias
//! with GELU; each one pass over bf16 storage with f32 math, rounded where the candle composition
//! it replaces rounds. Also the launch plumbing every kernel module of the models uses.
//!
//! Every kernel writes in place into a tensor the caller owns (a fresh output, or a projection
//! result that is consumed), through one generic [`InplaceOp1`]: its other tensor arguments
//! are read-only and must not share storage with the destination.

use crate::models::kernel_module::{kernel_module, Module};
use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp1, Layout, Result, Storage, Tensor, D};

static DIT: Module = kernel_module!("dit_ops");

/// Threads of a row kernel (`THREADS` in the kernel).
const ROW_THREADS: usize = 256;
/// Widest row the row kernels hold in registers (`2 * MAX_PAIRS * THREADS` in the kernel).
const MAX_DIM: usize = 2 * 16 * ROW_THREADS;
/// Threads per block and blocks per SM-ish bound of the element-wise kernels.
const ELEMENT_THREADS: u32 = 256;
const ELEMENT_BLOCKS: usize = 132 * 16;

/// Whether the element-wise kernels take `x` `[rows, dim]`: bf16 on CUDA, even `dim`.
pub(crate) fn supported(x: &Tensor) -> bool {
    x.device().is_cuda() && x.dtype() == DType::BF16 && x.dim(D::Minus1).is_ok_and(|d| d % 2 == 0)
}

/// Whether the row kernels (a row held in registers) take `x`: also `dim` up to [`MAX_DIM`].
pub(crate) fn rows_supported(x: &Tensor) -> bool {
    supported(x) && x.dim(D::Minus1).is_ok_and(|d| d <= MAX_DIM)
}

/// A kernel argument, in the kernel's declaration order.
pub(crate) enum Arg<'a> {
    /// The tensor written in place.
    Dst,
    /// A read-only tensor (bf16, f32 or u32, contiguous); `None` passes a null pointer.
    Tensor(Option<&'a Tensor>),
    /// The address `offset` elements into a read-only contiguous tensor.
    At(&'a Tensor, usize),
    Int(i32),
    Long(i64),
    Float(f32),
}

/// One launch of `func` of `module` with one block of `block` threads per unit of `grid`.
pub(crate) struct Launch<'a> {
    module: &'static Module,
    func: &'static str,
    grid: u32,
    block: u32,
    args: Vec<Arg<'a>>,
}

/// Device address of a contiguous tensor's first element.
fn address(
    storage: &Storage,
    layout: &Layout,
    offset: usize,
    dev: &candle_core::CudaDevice,
) -> Result<u64> {
    let Storage::Cuda(s) = storage else {
        candle_core::bail!("dit kernels: an operand is not on CUDA")
    };
    if !layout.is_contiguous() {
        candle_core::bail!("dit kernels: operands must be contiguous")
    }
    let stream = dev.cuda_stream();
    let (base, size) = match &s.slice {
        CudaStorageSlice::BF16(s) => (s.device_ptr(&stream).0, 2),
        CudaStorageSlice::F32(s) => (s.device_ptr(&stream).0, 4),
        CudaStorageSlice::U32(s) => (s.device_ptr(&stream).0, 4),
        _ => candle_core::bail!("dit kernels: operands are bf16, f32 or u32"),
    };
    Ok(base + ((layout.start_offset() + offset) * size) as u64)
}

impl InplaceOp1 for Launch<'_> {
    fn name(&self) -> &'static str {
        self.func
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("{} runs on CUDA only", self.func)
    }

    fn cuda_fwd(&self, dst: &mut CudaStorage, dst_layout: &Layout) -> Result<()> {
        let dev = dst.device.clone();
        let stream = dev.cuda_stream();
        if !dst_layout.is_contiguous() {
            candle_core::bail!("{}: the destination must be contiguous", self.func)
        }
        let (base, size) = match &mut dst.slice {
            CudaStorageSlice::BF16(out) => (out.device_ptr_mut(&stream).0, 2),
            CudaStorageSlice::F32(out) => (out.device_ptr_mut(&stream).0, 4),
            _ => candle_core::bail!("{}: the destination is bf16 or f32", self.func),
        };
        let dst_address = base + (dst_layout.start_offset() * size) as u64;
        // Pointers as u64, integers and floats: owned here so the builder can borrow them.
        enum Value {
            Ptr(u64),
            Int(i32),
            Long(i64),
            Float(f32),
        }
        let values = self
            .args
            .iter()
            .map(|arg| {
                Ok(match arg {
                    Arg::Dst => Value::Ptr(dst_address),
                    Arg::Tensor(None) => Value::Ptr(0),
                    Arg::Tensor(Some(t)) => {
                        let (storage, layout) = t.storage_and_layout();
                        Value::Ptr(address(&storage, layout, 0, &dev)?)
                    }
                    Arg::At(t, offset) => {
                        let (storage, layout) = t.storage_and_layout();
                        Value::Ptr(address(&storage, layout, *offset, &dev)?)
                    }
                    Arg::Int(v) => Value::Int(*v),
                    Arg::Long(v) => Value::Long(*v),
                    Arg::Float(v) => Value::Float(*v),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let func = self.module.function(&dev, self.func)?;
        let mut builder = func.builder();
        for value in &values {
            match value {
                Value::Ptr(v) => builder.arg(v),
                Value::Int(v) => builder.arg(v),
                Value::Long(v) => builder.arg(v),
                Value::Float(v) => builder.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (self.grid, 1, 1),
            block_dim: (self.block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments follow the kernel's signature; `supported` and the callers
        // checked dtypes, widths and contiguity, and every pointer covers the rows launched.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    }
}

/// Where a `[rows, dim]` slab sits in a `[batch * seq, dim]` tensor: its first row, and the
/// rows per batch entry (which pick the modulation row and the RoPE position of each row).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows {
    pub row0: usize,
    pub seq: usize,
}

pub(crate) fn row_launch<'a>(
    module: &'static Module,
    func: &'static str,
    rows: usize,
    args: Vec<Arg<'a>>,
) -> Launch<'a> {
    Launch {
        module,
        func,
        grid: rows as u32,
        block: ROW_THREADS as u32,
        args,
    }
}

/// A grid-stride launch over the bf16 pairs of `elements` elements.
pub(crate) fn element_launch<'a>(
    module: &'static Module,
    func: &'static str,
    elements: usize,
    args: Vec<Arg<'a>>,
) -> Launch<'a> {
    item_launch(module, func, elements / 2, args)
}

/// A grid-stride launch with one thread per item (up to the grid's bound).
pub(crate) fn item_launch<'a>(
    module: &'static Module,
    func: &'static str,
    items: usize,
    args: Vec<Arg<'a>>,
) -> Launch<'a> {
    Launch {
        module,
        func,
        grid: items
            .div_ceil(ELEMENT_THREADS as usize)
            .clamp(1, ELEMENT_BLOCKS) as u32,
        block: ELEMENT_THREADS,
        args,
    }
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
    let (rows, dim) = x.dims2()?;
    let (mods, split, stride) = Modulation::args(modulation);
    let mut args = vec![Arg::Tensor(Some(x)), Arg::Dst, Arg::Tensor(w)];
    args.extend(mods);
    args.extend([
        Arg::Int(dim as i32),
        Arg::Long(at.row0 as i64),
        Arg::Long(at.seq as i64),
        Arg::Long(split as i64),
        Arg::Long(stride as i64),
        Arg::Float(inv_dim(dim)),
        Arg::Float(eps as f32),
    ]);
    // SAFETY: the kernel writes every element of `out`.
    let out = unsafe { Tensor::empty((rows, dim), DType::BF16, x.device()) }?;
    out.inplace_op1(&row_launch(&DIT, "dit_rms_mod_bf16", rows, args))?;
    Ok(out)
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
    let (w, b, two_pass) = match norm {
        LayerNorm::Fused { w, b } => (Some(w), Some(b), 0),
        LayerNorm::TwoPass => (None, None, 1),
    };
    let (rows, dim) = x.dims2()?;
    let (mods, split, stride) = Modulation::args(modulation);
    let mut args = vec![
        Arg::Tensor(Some(x)),
        Arg::Dst,
        Arg::Tensor(w),
        Arg::Tensor(b),
    ];
    args.extend(mods);
    args.extend([
        Arg::Int(dim as i32),
        Arg::Long(at.row0 as i64),
        Arg::Long(at.seq as i64),
        Arg::Long(split as i64),
        Arg::Long(stride as i64),
        Arg::Int(two_pass),
        Arg::Float(inv_dim(dim)),
        Arg::Float(eps as f32),
    ]);
    // SAFETY: the kernel writes every element of `out`.
    let out = unsafe { Tensor::empty((rows, dim), DType::BF16, x.device()) }?;
    out.inplace_op1(&row_launch(&DIT, "dit_layer_norm_mod_bf16", rows, args))?;
    Ok(out)
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

/// The per-head norm of [`head_norm_rope`]: `w`, `b` `[head_dim]` (no `b`: RMSNorm).
struct HeadNorm<'a> {
    w: &'a Tensor,
    b: Option<&'a Tensor>,
    head_dim: usize,
    eps: f64,
}

/// `dit_head_norm_rope_bf16` on `x` with RoPE at positions `start..end`, interleaved
/// (`rotary` 0) or rotate-half on `rotary` channels.
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
    let units = rows * (dim / head_dim);
    let warps = ROW_THREADS / 32;
    x.inplace_op1(&Launch {
        module: &DIT,
        func: "dit_head_norm_rope_bf16",
        grid: units.div_ceil(warps) as u32,
        block: ROW_THREADS as u32,
        args: vec![
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
    })?;
    Ok(x)
}

/// In place on `x` `[rows, heads * head_dim]`: bias, the composite RMSNorm across the row with
/// `w`, then RoPE per head when `rope` (cos, sin `[seq, head_dim / 2]` f32) is given.
pub(crate) fn rms_rope(
    x: Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    rope: Option<(&Tensor, &Tensor)>,
    head_dim: usize,
    at: Rows,
    eps: f64,
) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    x.inplace_op1(&row_launch(
        &DIT,
        "dit_rms_rope_bf16",
        rows,
        vec![
            Arg::Dst,
            Arg::Tensor(bias),
            Arg::Tensor(Some(w)),
            Arg::Tensor(rope.map(|r| r.0)),
            Arg::Tensor(rope.map(|r| r.1)),
            Arg::Int(dim as i32),
            Arg::Int(head_dim as i32),
            Arg::Long(at.row0 as i64),
            Arg::Long(at.seq as i64),
            Arg::Float(inv_dim(dim)),
            Arg::Float(eps as f32),
        ],
    ))?;
    Ok(x)
}

/// `res + (delta + bias) * gate` in bf16 steps (bias and gate optional), written into `delta`'s
/// storage.
pub(crate) fn residual_into_delta(
    res: &Tensor,
    delta: Tensor,
    bias: Option<&Tensor>,
    gate: Option<BatchRow>,
    at: Rows,
) -> Result<Tensor> {
    let (rows, dim) = delta.dims2()?;
    if res.dims2()? != (rows, dim) {
        candle_core::bail!("residual: {:?} and {:?} differ", res.shape(), delta.shape())
    }
    let mut args = vec![Arg::Tensor(Some(res)), Arg::Dst, Arg::Tensor(bias)];
    args.extend(gate_args(gate, at, (rows, dim)));
    delta.inplace_op1(&element_launch(&DIT, "dit_residual_bf16", rows * dim, args))?;
    Ok(delta)
}

/// `x + delta * gate` in bf16 steps, written into `x` (rows `at.row0..` of the residual stream,
/// a contiguous view of it): the gated residual update with no copy of the stream.
pub(crate) fn residual_in_place(
    x: &Tensor,
    delta: &Tensor,
    gate: BatchRow,
    at: Rows,
) -> Result<()> {
    let (rows, dim) = x.dims2()?;
    if delta.dims2()? != (rows, dim) {
        candle_core::bail!("residual: {:?} and {:?} differ", x.shape(), delta.shape())
    }
    let mut args = vec![Arg::Dst, Arg::Tensor(Some(delta)), Arg::Tensor(None)];
    args.extend(gate_args(Some(gate), at, (rows, dim)));
    x.inplace_op1(&element_launch(&DIT, "dit_residual_bf16", rows * dim, args))
}

/// `dit_residual_bf16`'s arguments from `gate` on: gate, gate_text, rows, out (the destination),
/// then the sizes of the `[rows, dim]` slab at `at`.
fn gate_args<'a>(
    gate: Option<BatchRow<'a>>,
    at: Rows,
    (rows, dim): (usize, usize),
) -> Vec<Arg<'a>> {
    let (gate, gate_text, row_table, split, stride) = match gate {
        Some(g) => {
            let (split, text) = g.text.unwrap_or((0, g.offset));
            (
                Arg::At(g.table, g.offset),
                Arg::At(g.table, text),
                Arg::Tensor(g.rows),
                split,
                g.stride,
            )
        }
        None => (
            Arg::Tensor(None),
            Arg::Tensor(None),
            Arg::Tensor(None),
            0,
            0,
        ),
    };
    vec![
        gate,
        gate_text,
        row_table,
        Arg::Dst,
        Arg::Long((rows * dim) as i64),
        Arg::Int(dim as i32),
        Arg::Long(at.row0 as i64),
        Arg::Long(at.seq as i64),
        Arg::Long(split as i64),
        Arg::Long(stride as i64),
    ]
}

/// The activation after a bias in [`bias_act`], as candle computes it on bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Act {
    None = 0,
    GeluTanh = 1,
    GeluErf = 2,
}

/// In place on `x` `[rows, dim]`: `x + bias`, then `act`.
pub(crate) fn bias_act(x: Tensor, bias: &Tensor, act: Act) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    x.inplace_op1(&element_launch(
        &DIT,
        "dit_bias_act_bf16",
        rows * dim,
        vec![
            Arg::Dst,
            Arg::Tensor(Some(bias)),
            Arg::Long((rows * dim) as i64),
            Arg::Int(dim as i32),
            Arg::Int(act as i32),
        ],
    ))?;
    Ok(x)
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
        &DIT,
        "dit_swiglu_bf16",
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
