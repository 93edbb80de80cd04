//! Fused CUDA kernels of the Wan DiT block (`wan_ops.cu`): LayerNorm with modulation, gated
//! residual, q/k RMSNorm with RoPE and bias (+ GELU), each one pass over bf16 storage with f32
//! math. They replace chains of candle ops that each stored a full-size f32 temporary. And two
//! of the Wan VAE (f32): channel RMS norm + SiLU written into a convolution's input buffer, and
//! the per-channel bias of a convolution's output, in place.
//!
//! Every kernel writes in place into a tensor the caller owns (a fresh output, or a projection
//! result that is consumed), through one generic [`InplaceOp1`]: its other tensor arguments
//! are read-only and must not share storage with the destination.

use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp1, Layout, Result, Storage, Tensor, D};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/wan_ops.ptx"));
const MODULE: &str = "vidgen_wan_ops";
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
enum Arg<'a> {
    /// The tensor written in place.
    Dst,
    /// A read-only tensor (bf16 or f32, contiguous); `None` passes a null pointer.
    Tensor(Option<&'a Tensor>),
    Int(i32),
    Long(i64),
    Float(f32),
}

/// One launch of `func` with one block of `block` threads per unit of `grid`.
struct Launch<'a> {
    func: &'static str,
    grid: u32,
    block: u32,
    args: Vec<Arg<'a>>,
}

/// Device address of a contiguous tensor's first element.
fn address(storage: &Storage, layout: &Layout, dev: &candle_core::CudaDevice) -> Result<u64> {
    let Storage::Cuda(s) = storage else {
        candle_core::bail!("wan kernels: an operand is not on CUDA")
    };
    if !layout.is_contiguous() {
        candle_core::bail!("wan kernels: operands must be contiguous")
    }
    let stream = dev.cuda_stream();
    let (base, size) = match &s.slice {
        CudaStorageSlice::BF16(s) => (s.device_ptr(&stream).0, 2),
        CudaStorageSlice::F32(s) => (s.device_ptr(&stream).0, 4),
        _ => candle_core::bail!("wan kernels: operands are bf16 or f32"),
    };
    Ok(base + (layout.start_offset() * size) as u64)
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
                        Value::Ptr(address(&storage, layout, &dev)?)
                    }
                    Arg::Int(v) => Value::Int(*v),
                    Arg::Long(v) => Value::Long(*v),
                    Arg::Float(v) => Value::Float(*v),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let func = dev.get_or_load_custom_func(self.func, MODULE, PTX)?;
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

fn row_launch<'a>(func: &'static str, rows: usize, args: Vec<Arg<'a>>) -> Launch<'a> {
    Launch {
        func,
        grid: rows as u32,
        block: ROW_THREADS as u32,
        args,
    }
}

fn element_launch<'a>(func: &'static str, elements: usize, args: Vec<Arg<'a>>) -> Launch<'a> {
    let blocks = (elements / 2).div_ceil(ELEMENT_THREADS as usize);
    Launch {
        func,
        grid: blocks.clamp(1, ELEMENT_BLOCKS) as u32,
        block: ELEMENT_THREADS,
        args,
    }
}

/// `LayerNorm(x) * w + b` in f32, rounded to bf16; `w`, `b` f32 `[1 or batch, dim]`.
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, at: Rows, eps: f64) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    let wb_stride = if w.dim(0)? == 1 { 0 } else { dim as i64 };
    // SAFETY: the kernel writes every element of `out`.
    let out = unsafe { Tensor::empty((rows, dim), DType::BF16, x.device()) }?;
    out.inplace_op1(&row_launch(
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
            Arg::Long(wb_stride),
            Arg::Float(eps as f32),
        ],
    ))?;
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
    let (rows, dim) = delta.dims2()?;
    if res.dims2()? != (rows, dim) {
        candle_core::bail!("residual: {:?} and {:?} differ", res.shape(), delta.shape())
    }
    delta.inplace_op1(&element_launch(
        "wan_residual_bf16",
        rows * dim,
        vec![
            Arg::Tensor(Some(res)),
            Arg::Dst,
            Arg::Tensor(bias),
            Arg::Tensor(gate),
            Arg::Dst,
            Arg::Long((rows * dim) as i64),
            Arg::Int(dim as i32),
            Arg::Long(at.row0 as i64),
            Arg::Long(at.seq as i64),
        ],
    ))?;
    Ok(delta)
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
    x.inplace_op1(&row_launch(
        "wan_rms_rope_bf16",
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
            Arg::Float(eps),
        ],
    ))?;
    Ok(x)
}

/// In place on `x` `[rows, dim]`: `x + bias`, then GELU(tanh) when `gelu`.
pub(crate) fn bias_act(x: Tensor, bias: &Tensor, gelu: bool) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    x.inplace_op1(&element_launch(
        "wan_bias_act_bf16",
        rows * dim,
        vec![
            Arg::Dst,
            Arg::Tensor(Some(bias)),
            Arg::Long((rows * dim) as i64),
            Arg::Int(dim as i32),
            Arg::Int(gelu.into()),
        ],
    ))?;
    Ok(x)
}

/// Whether the VAE kernels take `x`: f32 on CUDA.
pub(crate) fn vae_supported(x: &Tensor) -> bool {
    x.device().is_cuda() && x.dtype() == DType::F32
}

/// A grid-stride launch over `n` items.
fn vae_launch<'a>(func: &'static str, n: usize, args: Vec<Arg<'a>>) -> Launch<'a> {
    Launch {
        func,
        grid: n
            .div_ceil(ELEMENT_THREADS as usize)
            .clamp(1, ELEMENT_BLOCKS) as u32,
        block: ELEMENT_THREADS,
        args,
    }
}

/// Writes `SiLU(x / max(|x|_2, 1e-12) * scale * gamma)`, the norm over the channels of `x`
/// `[B, C, T, H, W]` (f32), into frames `offset..offset + T` of `buf` `[B, C, T', H, W]`
/// (f32, contiguous, not sharing storage with `x`); `gamma` holds `C` f32 values.
pub(crate) fn vae_rms_silu_into(
    x: &Tensor,
    gamma: &Tensor,
    scale: f64,
    buf: &Tensor,
    offset: usize,
) -> Result<()> {
    let (b, c, t, h, w) = x.dims5()?;
    let (bb, bc, bt, bh, bw) = buf.dims5()?;
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
    let spatial = t * h * w;
    let frame = h * w;
    buf.inplace_op1(&vae_launch(
        "wan_vae_rms_silu_f32",
        b * spatial,
        vec![
            Arg::Tensor(Some(&x)),
            Arg::Dst,
            Arg::Tensor(Some(&gamma)),
            Arg::Int(c as i32),
            Arg::Long(spatial as i64),
            Arg::Long((b * spatial) as i64),
            Arg::Long((c * bt * frame) as i64),
            Arg::Long((bt * frame) as i64),
            Arg::Long((offset * frame) as i64),
            Arg::Float(scale as f32),
        ],
    ))
}

/// `y + bias` per channel of `y` `[B, C, ...]` (f32), plus `residual` (y's shape) when given,
/// in `y`'s storage; `bias` `[C]` f32.
pub(crate) fn vae_bias_add(y: Tensor, bias: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
    let dims = y.dims();
    let c = dims.get(1).copied().unwrap_or(0);
    if dims.len() < 2 || bias.elem_count() != c || bias.dtype() != DType::F32 {
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
    let spatial = n / (dims[0] * c).max(1);
    let bias = bias.contiguous()?;
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
