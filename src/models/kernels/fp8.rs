//! The CUDA side of the fp8 matmuls ([`crate::models::fp8`] defines the arithmetic): the row
//! quantizer and the scale epilogue (`fp8.cu`), and the e4m3 x e4m3 product through cuBLASLt
//! (fp32 accumulation, the "TN" layout cuBLASLt's fp8 kernels require: both operands K-major).

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cublaslt::{result, sys, MatmulShared};
use candle_core::cuda::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice};
use candle_core::{CudaDevice, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::bf16;

use crate::models::fp8::{self, Fp8Rows};
use crate::models::kernel_module::{
    item_launch, kernel_module, row_launch, tensor_address, Arg, Module, ROW_THREADS,
};
use crate::models::linear::{handle, lt_error};

static FP8: Module = kernel_module!("fp8");

const WORKSPACE: usize = fp8::PRODUCT_WORKSPACE;

/// The cuBLASLt type of a dtype the fp8 path computes in ([`fp8::check_dtype`]'s).
fn output(dtype: DType) -> Result<sys::cudaDataType> {
    fp8::check_dtype(dtype)?;
    Ok(match dtype {
        DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
        _ => sys::cudaDataType_t::CUDA_R_32F,
    })
}

/// The kernel `names[0]` for bf16, `names[1]` for f32.
fn kernel(dtype: DType, names: [&'static str; 2]) -> &'static str {
    if dtype == DType::BF16 {
        names[0]
    } else {
        names[1]
    }
}

/// Refuses a GPU without fp8 tensor cores (before compute capability 8.9), in one line.
fn check_device(dev: &CudaDevice) -> Result<()> {
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let attr = |a| {
        ctx.attribute(a)
            .map_err(|e| candle_core::Error::Msg(format!("{e:?}")))
    };
    let cc = (
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    );
    if cc < (8, 9) {
        candle_core::bail!(
            "--fp8-matmul needs a GPU with fp8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell, GB10); this one is {}.{}",
            cc.0,
            cc.1
        )
    }
    Ok(())
}

/// `x` `[rows, k]` (bf16 or f32 on CUDA) as e4m3 codes `[rows_pad, k_pad]` and f32 scales
/// `[rows_pad]`, zero past `rows` and `k` (`fp8.cu`'s `quantize_rows`).
pub(crate) fn quantize_rows(x: &Tensor, rows_pad: usize, k_pad: usize) -> Result<(Tensor, Tensor)> {
    check_device(x.device().as_cuda_device()?)?;
    let (rows, k) = x.dims2()?;
    output(x.dtype())?;
    let x = x.contiguous()?;
    // SAFETY: the kernel writes every code and every scale.
    let q = unsafe { Tensor::empty((rows_pad, k_pad), DType::F8E4M3, x.device()) }?;
    let scale = unsafe { Tensor::empty(rows_pad, DType::F32, x.device()) }?;
    if rows_pad == 0 {
        return Ok((q, scale));
    }
    let held = held_kernel(&x, k, k_pad);
    let func = match held {
        Some(HeldKernel { name, .. }) => name,
        None => kernel(x.dtype(), ["quantize_rows_bf16", "quantize_rows_f32"]),
    };
    let args = vec![
        Arg::Tensor(Some(&x)),
        Arg::Out(&q),
        Arg::Dst,
        Arg::Int(i32::try_from(k).map_err(candle_core::Error::wrap)?),
        Arg::Int(i32::try_from(k_pad).map_err(candle_core::Error::wrap)?),
        Arg::Long(rows as i64),
        Arg::Long(rows_pad as i64),
    ];
    scale.inplace_op1(&match held {
        Some(HeldKernel { block: true, .. }) => {
            row_launch(&FP8, func, rows_pad.min(MAX_ROW_BLOCKS), args)
        }
        // A warp per row.
        _ => item_launch(&FP8, func, rows_pad * 32, args),
    })?;
    Ok((q, scale))
}

/// Blocks the held-row quantizer launches at most (grid-stride over the rest).
const MAX_ROW_BLOCKS: usize = 1 << 16;

/// A quantizer kernel that holds each row in registers while it finds the absmax (`fp8.cu`'s
/// `quantize_rows_warp_held` and `quantize_rows_held`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HeldKernel {
    dtype: DType,
    /// A block of [`ROW_THREADS`] per row; else a warp.
    block: bool,
    /// The padded row length it holds at most: 8 values a chunk, its chunks per thread.
    values: usize,
    name: &'static str,
}

/// The held-row kernels `fp8.cu` builds, the smallest of each dtype first.
const HELD_KERNELS: [HeldKernel; 8] = {
    const fn held(dtype: DType, block: bool, chunks: usize, name: &'static str) -> HeldKernel {
        let threads = if block { ROW_THREADS } else { 32 };
        HeldKernel {
            dtype,
            block,
            values: 8 * threads * chunks,
            name,
        }
    }
    [
        held(DType::BF16, false, 8, "quantize_rows_warp_held8_bf16"),
        held(DType::BF16, false, 24, "quantize_rows_warp_held24_bf16"),
        held(DType::BF16, true, 4, "quantize_rows_held4_bf16"),
        held(DType::BF16, true, 8, "quantize_rows_held8_bf16"),
        held(DType::F32, true, 1, "quantize_rows_held1_f32"),
        held(DType::F32, true, 2, "quantize_rows_held2_f32"),
        held(DType::F32, true, 4, "quantize_rows_held4_f32"),
        held(DType::F32, true, 8, "quantize_rows_held8_f32"),
    ]
};

/// The held-row kernel for rows of `k` values of `x` padded to `k_pad`: the smallest that holds
/// the padded row, where `k` and `k_pad` are multiples of 8 and `x` starts 16-byte aligned.
/// `None` elsewhere: the warp-per-row kernel that reads each row twice.
fn held_kernel(x: &Tensor, k: usize, k_pad: usize) -> Option<HeldKernel> {
    let aligned = (x.layout().start_offset() * x.dtype().size_in_bytes()).is_multiple_of(16);
    if k == 0 || !k.is_multiple_of(8) || !k_pad.is_multiple_of(8) || !aligned {
        return None;
    }
    HELD_KERNELS
        .into_iter()
        .find(|h| h.dtype == x.dtype() && k_pad <= h.values)
}

/// `act(acc * scale_a[row] * scale_w[col] + bias[col])` of the product `acc` `[rows, ld]`, its
/// first `n` columns, in `acc`'s dtype: in place where `ld == n` (`fp8.cu`'s `scale_rows`).
pub fn scale_rows(
    acc: Tensor,
    n: usize,
    (scale_a, scale_w): (&Tensor, &Tensor),
    bias: Option<&Tensor>,
    act: i32,
) -> Result<Tensor> {
    let (rows, ld) = acc.dims2()?;
    output(acc.dtype())?;
    let bias = bias
        .map(|b| b.to_dtype(acc.dtype())?.contiguous())
        .transpose()?;
    let func = kernel(acc.dtype(), ["scale_rows_bf16", "scale_rows_f32"]);
    let in_place = ld == n;
    let out = if in_place {
        acc.clone()
    } else {
        // SAFETY: the kernel writes every element.
        unsafe { Tensor::empty((rows, n), acc.dtype(), acc.device()) }?
    };
    if rows == 0 {
        return Ok(out);
    }
    let source = if in_place {
        Arg::Dst
    } else {
        Arg::Tensor(Some(&acc))
    };
    let args = vec![
        source,
        Arg::Long(ld as i64),
        Arg::Dst,
        Arg::Tensor(Some(scale_a)),
        Arg::Tensor(Some(scale_w)),
        Arg::Tensor(bias.as_ref()),
        Arg::Int(i32::try_from(n).map_err(candle_core::Error::wrap)?),
        Arg::Int(act),
    ];
    out.inplace_op1(&row_launch(&FP8, func, rows, args))?;
    Ok(out)
}

/// `x_q @ w_q^T` of e4m3 codes `x_q` `[rows, k]` and `w_q` `[n, k]` (k and n multiples of 16)
/// with f32 accumulation, stored as `dtype` `[rows, n]`.
pub fn product(x_q: &Tensor, w_q: &Tensor, dtype: DType) -> Result<Tensor> {
    x_q.apply_op2_no_bwd(
        w_q,
        &Fp8Product {
            dtype,
            epilogue: None,
        },
    )
}

/// Set once this process's cuBLASLt refused its epilogue to apply the rows' scales (outer-vector
/// scaling needs cuBLAS 12.9 or newer and a GPU it has kernels for): every later product takes
/// [`product`] and [`scale_rows`] instead.
static SCALES_REFUSED: AtomicBool = AtomicBool::new(false);

/// The whole fp8 Linear of [`fp8::linear`] for bf16 in one cuBLASLt call: the f32 accumulator
/// times both rows' scales, plus the bias, then GELU(tanh) where `gelu`, rounded to bf16 once,
/// in the product's epilogue, so no second pass reads and writes the product. `None` where
/// cuBLASLt cannot (then the caller runs [`product`] and [`scale_rows`]).
pub fn scaled_product(
    input: &Fp8Rows,
    weight: &Fp8Rows,
    bias: Option<&Tensor>,
    gelu: bool,
) -> Result<Option<Tensor>> {
    if SCALES_REFUSED.load(Ordering::Relaxed) {
        return Ok(None);
    }
    let n_pad = weight.q.dim(0)?;
    // The bias runs along the padded output columns; the padding's scale is 0, its bias 0.
    let bias = bias
        .map(|b| {
            b.to_dtype(DType::BF16)?
                .pad_with_zeros(0, 0, n_pad - weight.rows)?
                .contiguous()
        })
        .transpose()?;
    let dev = weight.q.device().as_cuda_device()?;
    let address = |t: &Tensor| tensor_address(t, 0, dev);
    let epilogue = Epilogue {
        scale_w: address(&weight.scale)?,
        scale_x: address(&input.scale)?,
        bias: bias.as_ref().map(address).transpose()?,
        gelu,
    };
    let y = match input.q.apply_op2_no_bwd(
        &weight.q,
        &Fp8Product {
            dtype: DType::BF16,
            epilogue: Some(epilogue),
        },
    ) {
        Ok(y) => y,
        Err(_) if SCALES_REFUSED.load(Ordering::Relaxed) => return Ok(None),
        Err(e) => return Err(e),
    };
    if n_pad == weight.rows {
        return Ok(Some(y));
    }
    y.narrow(1, 0, weight.rows)?.contiguous().map(Some)
}

/// The cuBLASLt e4m3 product of [`product`] and [`scaled_product`].
struct Fp8Product {
    dtype: DType,
    /// What the epilogue applies ([`scaled_product`]); `None`: the bare product.
    epilogue: Option<Epilogue>,
}

/// Device addresses of the scales and the bias the epilogue applies: outer-vector scaling, the
/// weight's scales along the output columns and the input's along its rows.
struct Epilogue {
    scale_w: u64,
    scale_x: u64,
    bias: Option<u64>,
    gelu: bool,
}

/// A cuBLASLt status that says this library or GPU does not do what was asked.
fn unsupported(e: &result::CublasError) -> bool {
    matches!(
        e.0,
        sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
            | sys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE
            | sys::cublasStatus_t::CUBLAS_STATUS_ARCH_MISMATCH
    )
}

/// A cuBLASLt descriptor, destroyed when dropped.
struct Owned<T: Copy> {
    handle: T,
    destroy: unsafe fn(T) -> std::result::Result<(), result::CublasError>,
}

impl<T: Copy> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: made by its create function, destroyed once.
        let _ = unsafe { (self.destroy)(self.handle) };
    }
}

/// A fresh `[len]` output of `T` and its device address.
fn alloc_output<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    len: usize,
) -> Result<(CudaStorage, u64)> {
    // SAFETY: the product writes every element.
    let mut slice = unsafe { dev.alloc::<T>(len)? };
    let ptr = slice.device_ptr_mut(&dev.cuda_stream()).0;
    Ok((CudaStorage::wrap_cuda_slice(slice, dev.clone()), ptr))
}

/// The device address of an e4m3 operand's first element.
fn fp8_address(s: &CudaStorage, l: &Layout, dev: &CudaDevice) -> Result<u64> {
    let CudaStorageSlice::F8E4M3(slice) = &s.slice else {
        candle_core::bail!("fp8 product: the operands are e4m3 codes")
    };
    if !l.is_contiguous() {
        candle_core::bail!("fp8 product: the operands must be contiguous")
    }
    Ok(slice.device_ptr(&dev.cuda_stream()).0 + l.start_offset() as u64)
}

impl CustomOp2 for Fp8Product {
    fn name(&self) -> &'static str {
        "fp8-product"
    }

    crate::models::kernel_module::cuda_only_cpu_fwd!(a a_layout, b b_layout);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_l: &Layout,
        w: &CudaStorage,
        w_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, k) = x_l.shape().dims2()?;
        let (n, k_w) = w_l.shape().dims2()?;
        if k != k_w || !k.is_multiple_of(16) || !n.is_multiple_of(16) {
            candle_core::bail!(
                "fp8 product: x {:?}, weight {:?} (k and n must be equal multiples of 16)",
                x_l.dims(),
                w_l.dims()
            )
        }
        let dev = x.device().clone();
        let out_type = output(self.dtype)?;
        let (x_ptr, w_ptr) = (fp8_address(x, x_l, &dev)?, fp8_address(w, w_l, &dev)?);
        let (y, y_ptr) = match self.dtype {
            DType::BF16 => alloc_output::<bf16>(&dev, rows * n)?,
            _ => alloc_output::<f32>(&dev, rows * n)?,
        };
        let lt = handle(&dev)?;
        let stream = dev.cuda_stream();
        // SAFETY: the workspace is only this product's, on the handle's stream.
        let mut workspace = unsafe { dev.alloc::<u8>(WORKSPACE)? };
        let e4m3 = sys::cudaDataType_t::CUDA_R_8F_E4M3;
        let layout = |ty, rows: usize, cols: usize, ld: usize| -> Result<Owned<_>> {
            let handle = result::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
                .map_err(lt_error)?;
            Ok(Owned {
                handle,
                destroy: result::destroy_matrix_layout,
            })
        };
        // Column-major view, as the bf16 Linear: y^T [n, rows] = W [n, k] (stored [k, n]:
        // transposed) x x^T [k, rows]. A transposed and B not: the "TN" layout.
        let a = layout(e4m3, k, n, k)?;
        let b = layout(e4m3, k, rows, k)?;
        let c = layout(out_type, n, rows, n)?;
        let desc = Owned {
            handle: result::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType_t::CUDA_R_32F,
            )
            .map_err(lt_error)?,
            destroy: result::destroy_matmul_desc,
        };
        /// Sets one attribute of the descriptor to `value` (the type the attribute takes).
        fn set<T>(
            desc: sys::cublasLtMatmulDesc_t,
            attr: sys::cublasLtMatmulDescAttributes_t,
            value: &T,
        ) -> std::result::Result<(), result::CublasError> {
            // SAFETY: `value` is the attribute's type, alive for the call.
            unsafe {
                result::set_matmul_desc_attribute(
                    desc,
                    attr,
                    value as *const T as _,
                    std::mem::size_of::<T>(),
                )
            }
        }
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        let (transposed, straight) = (1i32, 0i32);
        set(desc.handle, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &transposed).map_err(lt_error)?;
        set(desc.handle, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &straight).map_err(lt_error)?;
        let refused = |e: result::CublasError| {
            if self.epilogue.is_some() && unsupported(&e) {
                SCALES_REFUSED.store(true, Ordering::Relaxed);
            }
            lt_error(e)
        };
        if let Some(ep) = &self.epilogue {
            // cublasLtMatmulMatrixScale_t's OUTER_VEC_32F: a scale per row of op(A) (the
            // weight's output channels) and per column of B (the input's rows).
            const OUTER_VEC_32F: i32 = 3;
            let kind = match (ep.bias.is_some(), ep.gelu) {
                (false, false) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
                (false, true) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU,
                (true, false) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
                (true, true) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
            };
            let (scale_w, scale_x) = (ep.scale_w as *const f32, ep.scale_x as *const f32);
            set(
                desc.handle,
                Attr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                &OUTER_VEC_32F,
            )
            .map_err(refused)?;
            set(
                desc.handle,
                Attr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                &OUTER_VEC_32F,
            )
            .map_err(refused)?;
            set(
                desc.handle,
                Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                &scale_w,
            )
            .map_err(refused)?;
            set(
                desc.handle,
                Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                &scale_x,
            )
            .map_err(refused)?;
            set(desc.handle, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE, &kind).map_err(refused)?;
            if let Some(bias) = ep.bias {
                let bias = bias as *const bf16;
                let bf16_type = sys::cudaDataType_t::CUDA_R_16BF;
                set(desc.handle, Attr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)
                    .map_err(refused)?;
                set(
                    desc.handle,
                    Attr::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &bf16_type,
                )
                .map_err(refused)?;
            }
        }
        let pref = Owned {
            handle: result::create_matmul_pref().map_err(lt_error)?,
            destroy: result::destroy_matmul_pref,
        };
        // SAFETY: the attribute takes a usize; every descriptor is alive; the pointers cover
        // the shapes checked above, on the handle's stream.
        unsafe {
            result::set_matmul_pref_attribute(
                pref.handle,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &WORKSPACE as *const usize as _,
                std::mem::size_of::<usize>(),
            )
            .map_err(lt_error)?;
            let heuristic = result::get_matmul_algo_heuristic(
                *lt.handle(),
                desc.handle,
                a.handle,
                b.handle,
                c.handle,
                c.handle,
                pref.handle,
            )
            .map_err(refused)?;
            let (alpha, beta) = (1f32, 0f32);
            let ws = workspace.device_ptr_mut(&stream).0;
            result::matmul(
                *lt.handle(),
                desc.handle,
                &alpha as *const f32 as _,
                &beta as *const f32 as _,
                w_ptr as _,
                a.handle,
                x_ptr as _,
                b.handle,
                y_ptr as _,
                c.handle,
                y_ptr as _,
                c.handle,
                &heuristic.algo,
                ws as _,
                WORKSPACE,
                stream.cu_stream() as _,
            )
            .map_err(refused)?;
        }
        Ok((y, Shape::from((rows, n))))
    }
}

#[cfg(test)]
mod cuda_tests {
    use super::*;
    use crate::models::fp8::Fp8Rows;
    use crate::models::row_ops::test_util::device;
    use candle_core::Device;

    /// Random `[rows, cols]` values of `dtype` with rows of very different magnitudes (each row
    /// scaled by 10^u, u in -3..3) and, past two rows, a zero row, as activations have, and past
    /// three a row too small for a normal scale (10^-37: a zero row by the definition).
    fn values(rows: usize, cols: usize, seed: u64, dtype: DType, dev: &Device) -> Result<Tensor> {
        let x = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu)?;
        let mut state = seed;
        let gains: Vec<f32> = (0..rows)
            .map(|r| {
                let u = crate::weights::splitmix64(&mut state) % 6000;
                if rows > 2 && r == rows / 2 {
                    0.0
                } else if rows > 3 && r == rows - 1 {
                    1e-37
                } else {
                    10f32.powf(u as f32 / 1000.0 - 3.0)
                }
            })
            .collect();
        let gains = Tensor::from_vec(gains, (rows, 1), &Device::Cpu)?;
        x.broadcast_mul(&gains)?.to_dtype(dtype)?.to_device(dev)
    }

    /// The GPU quantizer writes exactly the host's codes and scales, padding included: rows
    /// held in a warp's or a block's registers (widths of multiples of 8 up to 16,384, each
    /// kernel), rows read twice by a warp (16,400) and one value at a time (100).
    #[test]
    fn quantizer_matches_the_host_definition() -> Result<()> {
        let Some(dev) = device("fp8 quantizer") else {
            return Ok(());
        };
        for (dtype, rows, cols) in [
            (DType::BF16, 37, 200),
            (DType::F32, 5, 5120),
            (DType::F32, 64, 13824),
            (DType::BF16, 33, 5120),
            (DType::BF16, 9, 13824),
            (DType::BF16, 7, 8000),
            (DType::F32, 4, 1000),
            (DType::F32, 4, 3000),
            (DType::BF16, 3, 16400),
            (DType::BF16, 3, 24),
            (DType::BF16, 5, 100),
        ] {
            let x = values(rows, cols, 3, dtype, &dev)?;
            for pad_rows in [false, true] {
                let gpu = Fp8Rows::quantize(&x, pad_rows)?;
                let cpu = Fp8Rows::quantize(&x.to_device(&Device::Cpu)?, pad_rows)?;
                let bits = |t: &Tensor| -> Result<Vec<u32>> {
                    let v = t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
                    Ok(v.flatten_all()?
                        .to_vec1::<f32>()?
                        .iter()
                        .map(|f| f.to_bits())
                        .collect())
                };
                assert_eq!(gpu.q.dims(), cpu.q.dims());
                assert_eq!(
                    bits(&gpu.scale)?,
                    bits(&cpu.scale)?,
                    "{dtype:?} {rows}x{cols}"
                );
                assert_eq!(bits(&gpu.q)?, bits(&cpu.q)?, "{dtype:?} {rows}x{cols}");
            }
        }
        Ok(())
    }

    /// The GPU fp8 Linear against the host definition on random shapes, sizes that are not
    /// multiples of 16 among them (padded to 16 on the GPU), with and without bias and GELU:
    /// the same codes and scales, so only the f32 accumulation order (and, in bf16, a rounding
    /// of the product it moves) may differ: relative L2 under 0.5%, and the fp8 result within
    /// 8% (relative L2) of the exact f32 product.
    #[test]
    fn fp8_linear_matches_the_host_definition() -> Result<()> {
        let Some(dev) = device("fp8 matmul") else {
            return Ok(());
        };
        let rel = |a: &Tensor, b: &Tensor| -> Result<f32> {
            let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
            let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
            let d = (&a - &b)?.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
            Ok(d / b
                .sqr()?
                .sum_all()?
                .sqrt()?
                .to_scalar::<f32>()?
                .max(f32::MIN_POSITIVE))
        };
        for (i, &(dtype, rows, k, n)) in [
            (DType::BF16, 300, 256, 520),
            (DType::BF16, 77, 24, 48),
            (DType::F32, 129, 5120, 40),
            (DType::F32, 16, 100, 30),
            (DType::BF16, 1, 13824, 5120),
        ]
        .iter()
        .enumerate()
        {
            let x = values(rows, k, 10 + i as u64, dtype, &dev)?;
            let w = (Tensor::randn(0f32, 0.05, (n, k), &Device::Cpu)?.to_dtype(dtype)?)
                .to_device(&dev)?;
            let b = Tensor::randn(0f32, 0.5, n, &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(&dev)?;
            let weight = Fp8Rows::quantize(&w, true)?;
            let host_weight = Fp8Rows::quantize(&w.to_device(&Device::Cpu)?, true)?;
            let cpu = |t: &Tensor| t.to_device(&Device::Cpu);
            for (bias, gelu) in [(None, false), (Some(&b), false), (Some(&b), true)] {
                let got = fp8::linear(&x, &weight, bias, gelu)?;
                assert_eq!(got.dims(), [rows, n]);
                assert_eq!(got.dtype(), dtype);
                let host_bias = bias.map(cpu).transpose()?;
                let want = fp8::linear(&cpu(&x)?, &host_weight, host_bias.as_ref(), gelu)?;
                let err = rel(&got, &want)?;
                assert!(
                    err < 5e-3,
                    "{dtype:?} {rows}x{k}x{n} bias {} gelu {gelu}: {err}",
                    bias.is_some()
                );
                let f = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
                let mut exact = f(&x)?.matmul(&f(&w)?.t()?)?;
                if let Some(b) = bias {
                    exact = exact.broadcast_add(&f(b)?)?;
                }
                if gelu {
                    exact = exact.gelu()?;
                }
                let err = rel(&got, &exact)?;
                assert!(
                    err < 0.08,
                    "{dtype:?} {rows}x{k}x{n} against the exact product: {err}"
                );
            }
        }
        Ok(())
    }
    /// On Hopper, the own wgmma kernel runs the bf16 Linear (on other GPUs, for outputs not a
    /// multiple of 8 and for fewer than 4,096 inputs, it declines): against the host definition
    /// within 0.5% (relative L2: the same codes and scales, another f32 summation order), and
    /// level with cuBLASLt's scaled product. The shapes span several tiles of 128 x 256 with
    /// partial ones in rows, columns and K, a group of 8 row tiles and the partial group after
    /// it, and K of many stages.
    #[test]
    fn hopper_kernel_matches_the_host_definition() -> Result<()> {
        let Some(dev) = device("fp8 Hopper kernel") else {
            return Ok(());
        };
        let cuda = dev.as_cuda_device()?;
        let hopper = cuda.cuda_stream().context().compute_capability().ok() == Some((9, 0));
        let rel = |a: &Tensor, b: &Tensor| -> Result<f32> {
            let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
            let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
            let d = (&a - &b)?.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
            Ok(d / b.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?)
        };
        for (i, &(rows, k, n)) in [(1100, 4100, 1032), (130, 5120, 512), (5, 8960, 264)]
            .iter()
            .enumerate()
        {
            let x = values(rows, k, 20 + i as u64, DType::BF16, &dev)?;
            let w = Tensor::randn(0f32, 0.05, (n, k), &Device::Cpu)?.to_dtype(DType::BF16)?;
            let b = Tensor::randn(0f32, 0.5, n, &Device::Cpu)?.to_dtype(DType::BF16)?;
            let host_weight = Fp8Rows::quantize(&w, true)?;
            let weight = Fp8Rows::quantize(&w.to_device(&dev)?, true)?;
            let input = Fp8Rows::quantize(&x, false)?;
            let odd = Fp8Rows::quantize(&w.narrow(0, 0, n - 2)?.to_device(&dev)?, true)?;
            let declined = crate::models::fp8_sm90::linear(&input, &odd, None, false)?;
            assert!(
                declined.is_none(),
                "{n} - 2 outputs taken by the Hopper kernel"
            );
            let short = Fp8Rows::quantize(&w.narrow(1, 0, 4000)?.to_device(&dev)?, true)?;
            let short_input = Fp8Rows::quantize(&x.narrow(1, 0, 4000)?, false)?;
            let declined = crate::models::fp8_sm90::linear(&short_input, &short, None, false)?;
            assert!(
                declined.is_none(),
                "4,000 inputs taken by the Hopper kernel"
            );
            let cpu_x = x.to_device(&Device::Cpu)?;
            for (bias, gelu) in [(None, false), (Some(&b), false), (Some(&b), true)] {
                let gpu_bias = bias.map(|b| b.to_device(&dev)).transpose()?;
                let got =
                    crate::models::fp8_sm90::linear(&input, &weight, gpu_bias.as_ref(), gelu)?;
                let Some(got) = got else {
                    assert!(
                        !hopper,
                        "{rows}x{k}x{n}: the Hopper kernel declined on Hopper"
                    );
                    continue;
                };
                assert!(hopper, "the Hopper kernel ran on another GPU");
                assert_eq!(got.dims(), [rows, n]);
                let want = fp8::linear(&cpu_x, &host_weight, bias, gelu)?;
                let err = rel(&got, &want)?;
                assert!(
                    err < 5e-3,
                    "{rows}x{k}x{n} bias {} gelu {gelu}: {err}",
                    bias.is_some()
                );
                if let Some(lt) = scaled_product(&input, &weight, gpu_bias.as_ref(), gelu)? {
                    let err = rel(&got, &lt)?;
                    assert!(err < 5e-3, "{rows}x{k}x{n} against cuBLASLt: {err}");
                }
            }
        }
        Ok(())
    }
}
