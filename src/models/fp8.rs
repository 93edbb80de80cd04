//! fp8 matmuls (`--fp8-matmul`): a DiT Linear's product in e4m3 with one f32 scale per output
//! channel of the weight and one per token of the input, accumulated in f32. Defined here on the
//! host (CPU runs, and the reference of the CUDA tests); on CUDA the same codes and scales come
//! from `kernels/fp8.cu` and the product from cuBLASLt (`kernels/fp8.rs`).
//!
//! For `x` `[rows, in]` in dtype T and a weight `[out, in]`:
//! 1. each row r of the weight (once per landing) and of `x` (each product): its scale
//!    s = absmax(row) / 448 in f32, its codes e4m3(v * (1 / s)) rounded to nearest even (448 is
//!    e4m3's largest value; one reciprocal per row, a product per value: a quotient per value
//!    made the GPU quantizer issue-bound). A row whose s is below f32's smallest normal value
//!    (absmax < 5.3e-36, where 1 / s overflows) is a zero row: s = 0 and zero codes;
//! 2. acc = codes(x) @ codes(W)^T summed in f32 (each product of two codes is exact);
//! 3. y = act(acc * s_x[r] * s_w[c] + bias[c]) in f32, rounded to T once.
//!
//! On CUDA in bf16, steps 2 and 3 run in one kernel: on Hopper vidgen's own wgmma kernel
//! (`kernels/fp8_sm90.cu`), elsewhere cuBLASLt with the scales and the bias in its epilogue
//! (outer-vector scaling). Where cuBLASLt's library or the GPU cannot (before cuBLAS 12.9; in
//! f32), the product is stored as T and a second pass scales it: in bf16, one more rounding than
//! the definition.
//!
//! cuBLASLt's fp8 kernels want K and N in multiples of 16: the codes are padded with zeros
//! there (zero codes add nothing; padded weight rows have scale 0 and are cut off), on the host
//! as on the GPU, so the two hold the same tensors.

use std::cell::OnceCell;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Result, Tensor};

use crate::weights::StorageDtype;

/// e4m3's largest finite value: a row's absmax maps to it.
pub const E4M3_MAX: f32 = 448.0;

/// Bytes of the cuBLASLt workspace a product through vidgen's handle uses (fp8 products and the
/// bias epilogue alike): cudarc allocates it per handle, 32 MiB from Hopper on (4 MiB before);
/// the plan counts the larger.
pub const PRODUCT_WORKSPACE: usize = 32 << 20;

/// Device bytes `--fp8-matmul` adds to a forward whose largest Linear input is `rows` x `cols`:
/// that input's codes and row scales, and one product's workspace (the blocks' weight codes are
/// counted apart, [`weight_codes`]).
pub fn forward_bytes((rows, cols): (u64, u64)) -> u64 {
    rows * cols + rows * 4 + PRODUCT_WORKSPACE as u64
}

/// Device bytes of the e4m3 codes and channel scales of Linear weights `(in, out)`.
pub fn weight_codes(linears: &[(usize, usize)]) -> u64 {
    linears
        .iter()
        .map(|&(inner, out)| (inner * out + 4 * out) as u64)
        .sum()
}

/// What cuBLASLt's fp8 kernels want K and N to be multiples of.
const ALIGN: usize = 16;

const E4M3: StorageDtype = StorageDtype::Float8E4m3fn;

/// Refuses a compute dtype the fp8 path does not take: bf16 and f32 hold the f32 sum of code
/// products (up to 448² per term), f16 does not.
pub fn check_dtype(dtype: DType) -> Result<()> {
    if !matches!(dtype, DType::BF16 | DType::F32) {
        candle_core::bail!("fp8 matmuls compute in bf16 or f32, not {dtype:?}")
    }
    Ok(())
}

/// The rows of a matrix in e4m3 codes, each with its f32 scale: row r is about
/// `codes[r] * scale[r]`.
#[derive(Debug, Clone)]
pub struct Fp8Rows {
    /// `[rows, cols]` padded to multiples of 16 columns (and, for a weight, rows), F8E4M3,
    /// zero past the matrix.
    pub q: Tensor,
    /// `[padded rows]` f32, zero past the matrix.
    pub scale: Tensor,
    /// The matrix's rows and columns before padding.
    pub rows: usize,
    pub cols: usize,
}

impl Fp8Rows {
    /// `x` `[rows, cols]` quantized row by row, its columns padded to a multiple of 16 and, with
    /// `pad_rows` (a weight, whose rows are the product's columns), its rows too.
    pub fn quantize(x: &Tensor, pad_rows: bool) -> Result<Self> {
        let (rows, cols) = x.dims2()?;
        let rows_pad = if pad_rows {
            rows.next_multiple_of(ALIGN)
        } else {
            rows
        };
        let cols_pad = cols.next_multiple_of(ALIGN);
        let (q, scale) = match x.device() {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(_) => {
                crate::models::fp8_kernels::quantize_rows(x, rows_pad, cols_pad)?
            }
            _ => quantize_host(x, rows_pad, cols_pad)?,
        };
        Ok(Self {
            q,
            scale,
            rows,
            cols,
        })
    }
}

/// [`Fp8Rows::quantize`] on the host, by the definition.
fn quantize_host(x: &Tensor, rows_pad: usize, cols_pad: usize) -> Result<(Tensor, Tensor)> {
    let (rows, cols) = x.dims2()?;
    let values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut codes = vec![0u8; rows_pad * cols_pad];
    let mut scales = vec![0f32; rows_pad];
    for (r, row) in values.chunks_exact(cols.max(1)).take(rows).enumerate() {
        let scale = row.iter().fold(0f32, |m, v| m.max(v.abs())) / E4M3_MAX;
        if scale < f32::MIN_POSITIVE {
            continue;
        }
        scales[r] = scale;
        let inverse = 1.0 / scale;
        for (code, v) in codes[r * cols_pad..].iter_mut().zip(row) {
            *code = E4M3.encode(E4M3.round(v * inverse));
        }
    }
    let dev = x.device();
    Ok((
        Tensor::from_raw_buffer(&codes, DType::F8E4M3, &[rows_pad, cols_pad], dev)?,
        Tensor::from_vec(scales, rows_pad, dev)?,
    ))
}

/// fp8 products this process has run ([`linear`] calls), for the run's report.
static PRODUCTS: AtomicU64 = AtomicU64::new(0);

/// How many fp8 products this process has run so far.
pub fn products() -> u64 {
    PRODUCTS.load(Ordering::Relaxed)
}

/// `x @ W^T` (+ `bias`, then GELU(tanh) where `gelu`) for `x` `[rows, in]` and the quantized
/// weight `weight` `[out, in]`, in `x`'s dtype, by the definition above.
pub fn linear(x: &Tensor, weight: &Fp8Rows, bias: Option<&Tensor>, gelu: bool) -> Result<Tensor> {
    linear_sharing(x, &OnceCell::new(), weight, bias, gelu)
}

/// [`linear`] with `x`'s codes taken from `codes`, or made there for the next layer that reads
/// the same input (self-attention's q, k and v: one quantization of the input, not three).
pub fn linear_sharing(
    x: &Tensor,
    codes: &OnceCell<Fp8Rows>,
    weight: &Fp8Rows,
    bias: Option<&Tensor>,
    gelu: bool,
) -> Result<Tensor> {
    let (rows, inner) = x.dims2()?;
    check_dtype(x.dtype())?;
    let input = match codes.get() {
        Some(input) if input.rows == rows && input.cols == inner => input,
        Some(_) => candle_core::bail!("fp8 Linear: codes of another input"),
        None => {
            let _ = codes.set(Fp8Rows::quantize(x, false)?);
            codes.get().unwrap_or_else(|| unreachable!("set above"))
        }
    };
    linear_codes(input, x.dtype(), weight, bias, gelu)
}

/// [`linear`] of an input given as its codes alone (`[rows, in]`, see
/// [`Fp8Rows::quantize`]), the product in `dtype`.
pub fn linear_codes(
    input: &Fp8Rows,
    dtype: DType,
    weight: &Fp8Rows,
    bias: Option<&Tensor>,
    gelu: bool,
) -> Result<Tensor> {
    if input.cols != weight.cols {
        candle_core::bail!(
            "fp8 Linear: an input of {} columns against a weight of {} inputs",
            input.cols,
            weight.cols
        )
    }
    check_dtype(dtype)?;
    if input.rows == 0 {
        return Tensor::zeros((0, weight.rows), dtype, input.q.device());
    }
    PRODUCTS.fetch_add(1, Ordering::Relaxed);
    let scale_w = weight.scale.narrow(0, 0, weight.rows)?;
    #[cfg(feature = "cuda")]
    if input.q.device().is_cuda() {
        use crate::models::fp8_kernels::{product, scale_rows, scaled_product};
        if dtype == DType::BF16 {
            if let Some(y) = crate::models::fp8_sm90::linear(input, weight, bias, gelu)? {
                return Ok(y);
            }
            if let Some(y) = scaled_product(input, weight, bias, gelu)? {
                return Ok(y);
            }
        }
        let acc = product(&input.q, &weight.q, dtype)?;
        let act = i32::from(gelu);
        return scale_rows(acc, weight.rows, (&input.scale, &scale_w), bias, act);
    }
    let codes = |t: &Tensor| t.to_dtype(DType::F32);
    let acc = codes(&input.q)?
        .matmul(&codes(&weight.q)?.t()?)?
        .narrow(1, 0, weight.rows)?;
    let y = acc
        .broadcast_mul(&input.scale.unsqueeze(1)?)?
        .broadcast_mul(&scale_w.unsqueeze(0)?)?;
    let y = match bias {
        Some(b) => y.broadcast_add(&b.to_dtype(DType::F32)?)?,
        None => y,
    };
    let y = if gelu { y.gelu()? } else { y };
    y.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// candle's e4m3 values (what the host product widens the codes to) are the definition's,
    /// byte for byte.
    #[test]
    fn candle_widens_codes_as_defined() -> Result<()> {
        let bytes: Vec<u8> = (0..=255).collect();
        let t = Tensor::from_raw_buffer(&bytes, DType::F8E4M3, &[256], &Device::Cpu)?;
        let widened = t.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        for (b, v) in bytes.iter().zip(widened) {
            let want = E4M3.decode(*b);
            assert!(
                v.to_bits() == want.to_bits() || v.is_nan() && want.is_nan(),
                "{b:#x}: {v} against {want}"
            );
        }
        Ok(())
    }

    /// A row's absmax maps to ±448 exactly, every code decodes to within half an e4m3 step of
    /// value / scale, and the codes times the scale give the row back within e4m3's precision
    /// (2^-4 relative, subnormal steps of 2^-9 · scale); zero rows and the padding are zero.
    #[test]
    fn rows_quantize_to_scaled_codes() -> Result<()> {
        let (rows, cols) = (7, 37);
        // 1e-37: a scale below f32's normal range, quantized as a zero row.
        let gains = [1.0f32, 1e-3, 0.0, 250.0, 1e-6, 3.0, 1e-37];
        let mut state = 5u64;
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let u = crate::weights::splitmix64(&mut state) as f32 / u64::MAX as f32;
                (u * 2.0 - 1.0) * gains[i / cols]
            })
            .collect();
        let x = Tensor::from_vec(values.clone(), (rows, cols), &Device::Cpu)?;
        let q = Fp8Rows::quantize(&x, true)?;
        assert_eq!(q.q.dims(), [16, 48]);
        assert_eq!((q.rows, q.cols), (rows, cols));
        let codes = q.q.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let scales = q.scale.to_vec1::<f32>()?;
        for r in 0..16 {
            let row = values.get(r * cols..(r + 1) * cols).filter(|_| r < rows);
            let absmax = row.map_or(0.0, |row| row.iter().fold(0f32, |m, v| m.max(v.abs())));
            let absmax = if absmax / E4M3_MAX < f32::MIN_POSITIVE {
                0.0
            } else {
                absmax
            };
            assert_eq!(scales[r], absmax / E4M3_MAX, "row {r}");
            for (c, &code) in codes[r].iter().enumerate() {
                let Some(v) = row.and_then(|row| row.get(c)).filter(|_| absmax > 0.0) else {
                    assert_eq!(code, 0.0, "padding or zero row {r}, {c}");
                    continue;
                };
                if v.abs() == absmax {
                    assert_eq!(code.abs(), E4M3_MAX);
                }
                let target = v * (1.0 / scales[r]);
                let step = 2f32.powi((target.abs().log2().floor() as i32).max(-6) - 3);
                assert!(
                    (code - target).abs() <= step / 2.0,
                    "{r},{c}: {code} for {target}"
                );
                let back = code * scales[r];
                assert!(
                    (back - v).abs() <= (v.abs() / 16.0).max(scales[r] * 2f32.powi(-10)) * 1.001,
                    "{r},{c}: {back} for {v}"
                );
            }
        }
        Ok(())
    }

    /// The host fp8 Linear against the exact f32 Linear on a random layer: about e4m3's
    /// precision off (relative L2 between 0.5% and 5%), the shape and dtype kept; a zero input
    /// row gives the bias alone.
    #[test]
    fn host_linear_is_close_to_exact() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, inner, out) = (33, 70, 45);
        let x = Tensor::randn(0f32, 1.0, (rows, inner), &dev)?;
        let x = x.slice_assign(
            &[3..4, 0..inner],
            &Tensor::zeros((1, inner), DType::F32, &dev)?,
        )?;
        let w = Tensor::randn(0f32, 0.1, (out, inner), &dev)?;
        let b = Tensor::randn(0f32, 1.0, out, &dev)?;
        let weight = Fp8Rows::quantize(&w, true)?;
        for gelu in [false, true] {
            let got = linear(&x, &weight, Some(&b), gelu)?;
            assert_eq!(got.dims(), [rows, out]);
            let mut want = x.matmul(&w.t()?)?.broadcast_add(&b)?;
            if gelu {
                want = want.gelu()?;
            }
            let err = ((&got - &want)?.sqr()?.sum_all()?.sqrt()?
                / want.sqr()?.sum_all()?.sqrt()?)?
            .to_scalar::<f32>()?;
            assert!((5e-3..5e-2).contains(&err), "gelu {gelu}: {err}");
            let zero_row = got.narrow(0, 3, 1)?.squeeze(0)?;
            let bias_only = if gelu { b.gelu()? } else { b.clone() };
            assert_eq!(zero_row.to_vec1::<f32>()?, bias_only.to_vec1::<f32>()?);
        }
        let half = linear(&x.to_dtype(DType::BF16)?, &weight, None, false)?;
        assert_eq!(half.dtype(), DType::BF16);
        Ok(())
    }
}
