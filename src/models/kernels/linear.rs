//! A Linear layer's product with its bias (and GELU) added in the matmul's epilogue (cuBLASLt),
//! as PyTorch's `addmm` adds a bias: the f32 accumulator gets the bias before the one rounding to
//! bf16, and no separate pass reads and writes the product again (a [tokens, ffn_dim] product is
//! the largest tensor of a DiT block).

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cublaslt::{Activation, CudaBlasLT, Matmul, MatmulConfig};
use candle_core::{CudaStorage, CustomOp3, DType, InplaceOp3, Layout, Result, Shape, Tensor};
use half::bf16;

/// `x @ weight^T + bias`, then GELU(tanh) when `gelu`, for `x` `[rows, in]` and `weight`
/// `[out, in]` bf16 on CUDA (contiguous), `bias` bf16 `[out]`: `None` for anything else (the
/// caller composes it).
pub(crate) fn linear_bias_act(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    gelu: bool,
) -> Result<Option<Tensor>> {
    let takes = |t: &Tensor| t.device().is_cuda() && t.dtype() == DType::BF16;
    if !(takes(x) && takes(weight) && takes(bias)) || x.rank() != 2 || weight.rank() != 2 {
        return Ok(None);
    }
    let x = x.contiguous()?;
    let weight = weight.contiguous()?;
    let bias = bias.contiguous()?;
    x.apply_op3_no_bwd(&weight, &bias, &BiasEpilogue { gelu })
        .map(Some)
}

/// The cuBLASLt matmul with a bias (+ GELU) epilogue.
struct BiasEpilogue {
    gelu: bool,
}

/// The cuBLASLt product `y = x W^T` of `rows` x `k` inputs and `out` x `k` weights, both
/// row-major, into a row-major `[rows, out]`: column-major, y^T [out, rows] = W [out, in] (stored
/// [in, out]: transposed) x x^T [in, rows].
fn linear_product(rows: usize, k: usize, out: usize) -> MatmulConfig {
    MatmulConfig {
        transa: true,
        transb: false,
        transc: false,
        m: out as u64,
        n: rows as u64,
        k: k as u64,
        alpha: 1.0,
        lda: k as i64,
        ldb: k as i64,
        beta: 0.0,
        ldc: out as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    }
}

/// The element range a contiguous `layout` covers in its storage.
fn layout_range(layout: &Layout) -> std::ops::Range<usize> {
    layout.start_offset()..layout.start_offset() + layout.shape().elem_count()
}

/// The bf16 elements of a contiguous operand.
fn elements<'a>(
    storage: &'a CudaStorage,
    layout: &Layout,
) -> Result<candle_core::cuda::cudarc::driver::CudaView<'a, bf16>> {
    Ok(storage.as_cuda_slice::<bf16>()?.slice(layout_range(layout)))
}

/// One cuBLASLt handle (and its workspace) per device stream, made on first use.
pub(crate) fn handle(dev: &candle_core::CudaDevice) -> Result<Arc<CudaBlasLT>> {
    static HANDLES: Mutex<Vec<(usize, Arc<CudaBlasLT>)>> = Mutex::new(Vec::new());
    let stream = dev.cuda_stream();
    let key = stream.cu_stream() as usize;
    let mut handles = HANDLES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, h)) = handles.iter().find(|(k, _)| *k == key) {
        return Ok(h.clone());
    }
    let h = Arc::new(CudaBlasLT::new(stream).map_err(lt_error)?);
    handles.push((key, h.clone()));
    Ok(h)
}

pub(crate) fn lt_error(
    e: candle_core::cuda::cudarc::cublaslt::result::CublasError,
) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt: {e:?}"))
}

impl CustomOp3 for BiasEpilogue {
    fn name(&self) -> &'static str {
        "linear-bias-epilogue"
    }

    crate::models::kernel_module::cuda_only_cpu_fwd!(a a_layout, b b_layout, c c_layout);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_l: &Layout,
        w: &CudaStorage,
        w_l: &Layout,
        b: &CudaStorage,
        b_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, k) = x_l.shape().dims2()?;
        let (out, k_w) = w_l.shape().dims2()?;
        if k != k_w || b_l.shape().elem_count() != out {
            candle_core::bail!(
                "linear epilogue: x {:?}, weight {:?}, bias {:?}",
                x_l.dims(),
                w_l.dims(),
                b_l.dims()
            )
        }
        let dev = x.device().clone();
        let (xs, ws, bs) = (elements(x, x_l)?, elements(w, w_l)?, elements(b, b_l)?);
        // SAFETY: the matmul writes every element.
        let mut y = unsafe { dev.alloc::<bf16>(rows * out)? };
        // The bias runs along y^T's rows, one per output feature.
        let cfg = linear_product(rows, k, out);
        let act = self.gelu.then_some(Activation::Gelu);
        let lt = handle(&dev)?;
        // SAFETY: the shapes above match the buffers; all three are on the handle's stream.
        unsafe { lt.matmul(cfg, &ws, &xs, &mut y, Some(&bs), act.as_ref()) }.map_err(lt_error)?;
        Ok((
            CudaStorage::wrap_cuda_slice(y, dev),
            Shape::from((rows, out)),
        ))
    }
}

/// `x @ weight^T` written into `dst`'s storage, for `dst` a contiguous `[rows, out]` view (rows of
/// a larger buffer: a block's keys or values), `x` `[rows, in]` and `weight` `[out, in]` bf16 on
/// CUDA: the product lands where it is kept instead of being copied there. `false` (nothing
/// written) for any other input.
pub(crate) fn product_into(dst: &Tensor, x: &Tensor, weight: &Tensor) -> Result<bool> {
    let takes = |t: &Tensor| t.device().is_cuda() && t.dtype() == DType::BF16 && t.rank() == 2;
    if !(takes(dst) && takes(x) && takes(weight) && dst.is_contiguous()) {
        return Ok(false);
    }
    dst.inplace_op3(&x.contiguous()?, &weight.contiguous()?, &ProductInto)?;
    Ok(true)
}

/// The cuBLASLt product of [`product_into`].
struct ProductInto;

impl InplaceOp3 for ProductInto {
    fn name(&self) -> &'static str {
        "linear-product-into"
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        candle_core::bail!("linear product into: CUDA only")
    }

    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dst_l: &Layout,
        x: &CudaStorage,
        x_l: &Layout,
        w: &CudaStorage,
        w_l: &Layout,
    ) -> Result<()> {
        let (rows, k) = x_l.shape().dims2()?;
        let (out, k_w) = w_l.shape().dims2()?;
        if k != k_w || dst_l.shape().dims2()? != (rows, out) {
            candle_core::bail!(
                "linear product into: x {:?}, weight {:?}, destination {:?}",
                x_l.dims(),
                w_l.dims(),
                dst_l.dims()
            )
        }
        let dev = x.device().clone();
        let (xs, ws) = (elements(x, x_l)?, elements(w, w_l)?);
        let mut ys = dst
            .as_cuda_slice_mut::<bf16>()?
            .slice_mut(layout_range(dst_l));
        let cfg = linear_product(rows, k, out);
        let lt = handle(&dev)?;
        // SAFETY: the shapes above match the buffers; all three are on the handle's stream.
        unsafe { lt.matmul(cfg, &ws, &xs, &mut ys, None, None) }.map_err(lt_error)
    }
}

#[cfg(test)]
mod cuda_tests {
    use super::*;
    use crate::models::row_ops::test_util::device;

    /// The epilogue against the f32 composition rounded once: bias in the accumulator, GELU(tanh)
    /// in f32 (cuBLASLt's own GELU may differ by float rounding: a bf16 ulp or two at most).
    #[test]
    fn epilogue_matches_f32_composition() -> Result<()> {
        let Some(dev) = device("cuBLASLt bias epilogue") else {
            return Ok(());
        };
        let (rows, k, out) = (300, 256, 520);
        let x = Tensor::randn(0f32, 1.0, (rows, k), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::randn(0f32, 0.05, (out, k), &dev)?.to_dtype(DType::BF16)?;
        let b = Tensor::randn(0f32, 0.5, out, &dev)?.to_dtype(DType::BF16)?;
        for gelu in [false, true] {
            let got = linear_bias_act(&x, &w, &b, gelu)?
                .expect("bf16 on CUDA takes the epilogue")
                .to_dtype(DType::F32)?;
            let f = |t: &Tensor| t.to_dtype(DType::F32);
            let mut want = f(&x)?.matmul(&f(&w)?.t()?)?.broadcast_add(&f(&b)?)?;
            if gelu {
                want = want.gelu()?;
            }
            // Each element within two bf16 ulps of the f32 value (plus the f32 matmul's own
            // summation-order noise).
            let bound = ((want.abs()? * (2.0 / 128.0))? + 1e-3)?;
            let excess = ((got - &want)?.abs()? - bound)?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(excess <= 0.0, "gelu {gelu}: {excess} over the bound");
        }
        Ok(())
    }

    /// The product written into rows 7.. of a larger buffer: those rows within two bf16 ulps of
    /// the f32 product, the rows around them untouched.
    #[test]
    fn product_into_writes_only_its_rows() -> Result<()> {
        let Some(dev) = device("cuBLASLt product into a buffer") else {
            return Ok(());
        };
        let (rows, k, out, first) = (300, 256, 520, 7);
        let x = Tensor::randn(0f32, 1.0, (rows, k), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::randn(0f32, 0.05, (out, k), &dev)?.to_dtype(DType::BF16)?;
        let buffer = Tensor::ones((rows + 2 * first, out), DType::BF16, &dev)?;
        assert!(product_into(&buffer.narrow(0, first, rows)?, &x, &w)?);
        let f = |t: &Tensor| t.to_dtype(DType::F32);
        let want = f(&x)?.matmul(&f(&w)?.t()?)?;
        let got = f(&buffer.narrow(0, first, rows)?)?;
        let bound = ((want.abs()? * (2.0 / 128.0))? + 1e-3)?;
        let excess = ((got - &want)?.abs()? - bound)?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(excess <= 0.0, "{excess} over the bound");
        for start in [0, first + rows] {
            let around = f(&buffer.narrow(0, start, first)?)?;
            assert_eq!(around.min_all()?.to_scalar::<f32>()?, 1.0);
            assert_eq!(around.max_all()?.to_scalar::<f32>()?, 1.0);
        }
        Ok(())
    }
}
