//! The one arithmetic of a LoRA merge, run where the weight is: in a host copy (in place, by
//! threads in parallel) or where it landed on the device (a kernel, `kernels/lora_merge.cu`).
//! Both compute, per value in f32, `w = base`, then for each delta in order `acc = Σ_k up[i,k] ·
//! down[k,j]` as a chain of fused multiply-adds in k's order (`acc = fma(up, down, acc)` from 0),
//! `w = fma(acc, scale, w)` (a whole delta: `w = fma(diff[i,j], scale, w)`), and round `w` to the
//! weight's dtype. An FMA is exactly defined (one rounding), so a streamed block merged in its host
//! copy and a resident one merged on the GPU hold the same bits.

use crate::weights::{host_values_mut, HostFloat as Value};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape};
use rayon::prelude::*;

/// One change to a weight, in f32, row-major.
#[derive(Clone, Debug)]
pub(super) enum Delta {
    /// `scale · up @ down`: `up` is rows x rank, `down` rank x cols.
    LowRank {
        up: Vec<f32>,
        down: Vec<f32>,
        rank: usize,
        scale: f32,
    },
    /// `scale · diff`, `diff` of the weight's shape.
    Full { diff: Vec<f32>, scale: f32 },
}

/// The weight dtypes a merge reads and writes, in the kernel's order (`W_*` in lora_merge.cu).
#[cfg(feature = "cuda")]
const DTYPES: [DType; 3] = [DType::F16, DType::BF16, DType::F32];

/// Rows and columns of a weight of `dims` as the merge sees it (a vector: one column).
fn rows_cols(dims: &[usize]) -> (usize, usize) {
    let rows = dims.first().copied().unwrap_or(1).max(1);
    (rows, dims.iter().product::<usize>() / rows)
}

/// Merges `deltas` into `values`, a weight of `dims` stored as `dtype`, in place.
pub(super) fn merge_into(
    deltas: &[Delta],
    dims: &[usize],
    dtype: DType,
    values: &mut [u8],
) -> candle_core::Result<()> {
    fn typed<T: Value>(
        deltas: &[Delta],
        dims: &[usize],
        values: &mut [u8],
    ) -> candle_core::Result<()> {
        merge_values(deltas, dims, host_values_mut::<T>(values)?);
        Ok(())
    }
    if values.len() != dims.iter().product::<usize>() * dtype.size_in_bytes() {
        candle_core::bail!(
            "{} bytes to merge into a {dims:?} {dtype:?} weight",
            values.len()
        )
    }
    match dtype {
        DType::F32 => typed::<f32>(deltas, dims, values),
        DType::BF16 => typed::<half::bf16>(deltas, dims, values),
        DType::F16 => typed::<half::f16>(deltas, dims, values),
        other => candle_core::bail!("LoRA deltas merge into float weights, not {other:?}"),
    }
}

/// Rows one task merges: enough work to be worth a thread, few enough to spread (a multiple
/// of the register block's rows).
const TASK_ROWS: usize = 16;

fn merge_values<T: Value>(deltas: &[Delta], dims: &[usize], values: &mut [T]) {
    let (_, cols) = rows_cols(dims);
    values
        .par_chunks_mut(TASK_ROWS * cols.max(1))
        .enumerate()
        .for_each(|(task, rows)| merge_rows(deltas, cols, task * TASK_ROWS, rows));
}

/// Merges whole rows `rows` (the first is row `first` of the weight, `cols` values each).
fn merge_rows<T: Value>(deltas: &[Delta], cols: usize, first: usize, rows: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        unsafe { merge_rows_fma(deltas, cols, first, rows) };
        return;
    }
    merge_rows_with(deltas, cols, first, rows, add_low_rank);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn merge_rows_fma<T: Value>(deltas: &[Delta], cols: usize, first: usize, rows: &mut [T]) {
    merge_rows_with(
        deltas,
        cols,
        first,
        rows,
        |w, cols, up, down, rank, scale| {
            // SAFETY: this function runs only where the CPU has AVX2 and FMA.
            unsafe { add_low_rank_fma(w, cols, up, down, rank, scale) }
        },
    );
}

/// Merges whole rows with `add` adding a low-rank delta to rows of f32 values (`cols` each)
/// from their rows of `up`.
#[inline(always)]
fn merge_rows_with<T: Value>(
    deltas: &[Delta],
    cols: usize,
    first: usize,
    rows: &mut [T],
    add: impl Fn(&mut [f32], usize, &[f32], &[f32], usize, f32),
) {
    let n = rows.len() / cols.max(1);
    let mut w: Vec<f32> = rows.iter().map(|v| v.get()).collect();
    for delta in deltas {
        match delta {
            Delta::LowRank {
                up,
                down,
                rank,
                scale,
            } => add(
                &mut w,
                cols,
                &up[first * rank..(first + n) * rank],
                down,
                *rank,
                *scale,
            ),
            Delta::Full { diff, scale } => {
                for (w, d) in w.iter_mut().zip(&diff[first * cols..(first + n) * cols]) {
                    *w = d.mul_add(*scale, *w);
                }
            }
        }
    }
    for (v, w) in rows.iter_mut().zip(&w) {
        *v = T::put(*w);
    }
}

/// `w[r, j] = fma(Σ_k up[r, k] · down[k, j], scale, w[r, j])`, the sum an FMA chain in k's order.
fn add_low_rank(w: &mut [f32], cols: usize, up: &[f32], down: &[f32], rank: usize, scale: f32) {
    let mut acc = vec![0f32; cols];
    for (r, w) in w.chunks_exact_mut(cols).enumerate() {
        acc.fill(0.0);
        for (k, down) in down.chunks_exact(cols).enumerate().take(rank) {
            let u = up[r * rank + k];
            for (a, d) in acc.iter_mut().zip(down) {
                *a = u.mul_add(*d, *a);
            }
        }
        for (w, a) in w.iter_mut().zip(&acc) {
            *w = a.mul_add(scale, *w);
        }
    }
}

/// Rows and columns of the register block [`add_low_rank_fma`] computes at once.
#[cfg(target_arch = "x86_64")]
const BLOCK: (usize, usize) = (4, 16);

/// [`add_low_rank`] with AVX2 FMAs: blocks of 4 rows x 16 columns kept in eight registers over
/// the whole rank (each `down` value loaded once for four rows); the same FMA chain per value,
/// so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn add_low_rank_fma(
    w: &mut [f32],
    cols: usize,
    up: &[f32],
    down: &[f32],
    rank: usize,
    scale: f32,
) {
    use std::arch::x86_64::*;
    let n = w.len() / cols;
    let (block_rows, block_cols) = BLOCK;
    let full_rows = n - n % block_rows;
    let full_cols = cols - cols % block_cols;
    let scale8 = _mm256_set1_ps(scale);
    for r0 in (0..full_rows).step_by(block_rows) {
        for j in (0..full_cols).step_by(block_cols) {
            let mut acc = [_mm256_setzero_ps(); 8];
            for k in 0..rank {
                // SAFETY: k < rank and j + 16 <= cols: inside `down` (rank x cols).
                let d = unsafe {
                    let at = down.as_ptr().add(k * cols + j);
                    [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))]
                };
                for r in 0..block_rows {
                    let u = _mm256_set1_ps(up[(r0 + r) * rank + k]);
                    acc[2 * r] = _mm256_fmadd_ps(u, d[0], acc[2 * r]);
                    acc[2 * r + 1] = _mm256_fmadd_ps(u, d[1], acc[2 * r + 1]);
                }
            }
            for r in 0..block_rows {
                for half in 0..2 {
                    let at = &mut w[(r0 + r) * cols + j + 8 * half..][..8];
                    // SAFETY: `at` holds 8 values.
                    unsafe {
                        let old = _mm256_loadu_ps(at.as_ptr());
                        let new = _mm256_fmadd_ps(acc[2 * r + half], scale8, old);
                        _mm256_storeu_ps(at.as_mut_ptr(), new);
                    }
                }
            }
        }
        // Columns past the last whole block, one value at a time (the same chain).
        add_values(
            w,
            cols,
            up,
            down,
            rank,
            scale,
            r0..r0 + block_rows,
            full_cols,
        );
    }
    add_values(w, cols, up, down, rank, scale, full_rows..n, 0);
}

/// The values of rows `rows` from column `from` on, one at a time (FMA instructions here, where
/// the caller enables them).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn add_values(
    w: &mut [f32],
    cols: usize,
    up: &[f32],
    down: &[f32],
    rank: usize,
    scale: f32,
    rows: std::ops::Range<usize>,
    from: usize,
) {
    for r in rows {
        for j in from..cols {
            let mut a = 0f32;
            for k in 0..rank {
                a = up[r * rank + k].mul_add(down[k * cols + j], a);
            }
            w[r * cols + j] = a.mul_add(scale, w[r * cols + j]);
        }
    }
}

/// The merge as a candle op on a weight tensor (contiguous, of a [`DTYPES`] dtype): the same
/// tensor with `deltas` added, on its device.
pub(super) struct Merge<'a> {
    pub deltas: &'a [Delta],
}

impl CustomOp1 for Merge<'_> {
    fn name(&self) -> &'static str {
        "lora-merge"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("a weight to merge into is contiguous")
        };
        let dims = layout.dims();
        let mut out = storage.clone();
        match &mut out {
            CpuStorage::F32(v) => merge_values(self.deltas, dims, &mut v[start..end]),
            CpuStorage::BF16(v) => merge_values(self.deltas, dims, &mut v[start..end]),
            CpuStorage::F16(v) => merge_values(self.deltas, dims, &mut v[start..end]),
            _ => candle_core::bail!("LoRA deltas merge into float weights"),
        }
        let out = match out {
            CpuStorage::F32(v) => CpuStorage::F32(v[start..end].to_vec()),
            CpuStorage::BF16(v) => CpuStorage::BF16(v[start..end].to_vec()),
            CpuStorage::F16(v) => CpuStorage::F16(v[start..end].to_vec()),
            _ => unreachable!("matched above"),
        };
        Ok((out, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut};
        use candle_core::CudaStorage;

        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("a weight to merge into is contiguous")
        };
        let dev = &storage.device;
        let stream = dev.cuda_stream();
        macro_rules! merged {
            ($t:ty) => {{
                let src = storage.as_cuda_slice::<$t>()?.slice(start..end);
                // SAFETY: the kernel writes all `end - start` values.
                let mut dst = unsafe { dev.alloc::<$t>(end - start) }?;
                {
                    let (base, _read) = src.device_ptr(&stream);
                    let (out, _write) = dst.device_ptr_mut(&stream);
                    launch(
                        dev,
                        &stream,
                        base,
                        out,
                        layout.dims(),
                        storage.dtype(),
                        self.deltas,
                    )?;
                }
                CudaStorage::wrap_cuda_slice(dst, dev.clone())
            }};
        }
        let out = match storage.dtype() {
            DType::F16 => merged!(half::f16),
            DType::BF16 => merged!(half::bf16),
            DType::F32 => merged!(f32),
            other => candle_core::bail!("LoRA deltas merge into float weights, not {other:?}"),
        };
        Ok((out, layout.shape().clone()))
    }
}

/// Launches the merge of `deltas` into the weight at device address `base` (`dims` values of
/// `dtype`, contiguous), writing them to `out` (which may be `base`: a merge in place), on
/// `stream`: the factors go up first, on the same stream, and are freed in its order after the
/// kernel, so the caller may return at once.
#[cfg(feature = "cuda")]
pub(super) fn launch(
    dev: &candle_core::CudaDevice,
    stream: &std::sync::Arc<candle_core::cuda::cudarc::driver::CudaStream>,
    base: u64,
    out: u64,
    dims: &[usize],
    dtype: DType,
    deltas: &[Delta],
) -> candle_core::Result<()> {
    use crate::models::kernel_module::{kernel_module, Module};
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    static LORA_MERGE: Module = kernel_module!("lora_merge");

    let Some(code) = DTYPES.iter().position(|d| *d == dtype) else {
        candle_core::bail!("LoRA deltas merge into float weights, not {dtype:?}")
    };
    let (rows, cols) = rows_cols(dims);
    // Every factor in one buffer, and each delta's rank, offsets and scale bits.
    let mut factors = Vec::new();
    let mut table = Vec::new();
    for delta in deltas {
        let (rank, a, b, scale) = match delta {
            Delta::LowRank {
                up,
                down,
                rank,
                scale,
            } => (*rank, up.as_slice(), down.as_slice(), *scale),
            Delta::Full { diff, scale } => (0, diff.as_slice(), &[][..], *scale),
        };
        table.extend([
            rank as i64,
            factors.len() as i64,
            (factors.len() + a.len()) as i64,
            i64::from(scale.to_bits() as i32),
        ]);
        factors.extend_from_slice(a);
        factors.extend_from_slice(b);
    }
    let factors = stream.clone_htod(&factors).w()?;
    let table = stream.clone_htod(&table).w()?;
    let func = LORA_MERGE.function(dev, "lora_merge")?;
    const THREADS: u32 = 128;
    let cfg = LaunchConfig {
        grid_dim: (
            (cols as u32).div_ceil(THREADS),
            (rows.div_ceil(8) as u32).clamp(1, 65535),
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (code, rows, cols, n) = (code as i32, rows as i64, cols as i64, deltas.len() as i32);
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&base)
        .arg(&out)
        .arg(&code)
        .arg(&rows)
        .arg(&cols)
        .arg(&factors)
        .arg(&table)
        .arg(&n);
    // SAFETY: the arguments follow `lora_merge`'s signature; `base` and `out` hold `rows * cols`
    // values of `dtype` (the caller's word), `factors` every offset `table` names.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// A rank-3 delta, a whole one and a second low-rank one on an 11 x 37 weight (rows and
    /// columns that are no multiple of the blocks).
    pub(super) fn deltas() -> (Vec<Delta>, Vec<usize>) {
        let (rows, cols, rank) = (11, 37, 3);
        let wave = |n: usize, k: f32| (0..n).map(|i| (i as f32 * k).sin()).collect::<Vec<_>>();
        let deltas = vec![
            Delta::LowRank {
                up: wave(rows * rank, 0.37),
                down: wave(rank * cols, 1.3),
                rank,
                scale: 0.7,
            },
            Delta::Full {
                diff: wave(rows * cols, 0.11),
                scale: -0.25,
            },
            Delta::LowRank {
                up: wave(rows * 2, 2.1),
                down: wave(2 * cols, 0.9),
                rank: 2,
                scale: 1.5,
            },
        ];
        (deltas, vec![rows, cols])
    }

    /// The merge, value by value, as the module's doc states it.
    fn by_the_definition(
        base: &[f32],
        deltas: &[Delta],
        cols: usize,
        round: fn(f32) -> f32,
    ) -> Vec<f32> {
        let mut out = base.to_vec();
        for (at, w) in out.iter_mut().enumerate() {
            let (i, j) = (at / cols, at % cols);
            for delta in deltas {
                match delta {
                    Delta::LowRank {
                        up,
                        down,
                        rank,
                        scale,
                    } => {
                        let mut acc = 0f32;
                        for k in 0..*rank {
                            acc = up[i * rank + k].mul_add(down[k * cols + j], acc);
                        }
                        *w = acc.mul_add(*scale, *w);
                    }
                    Delta::Full { diff, scale } => *w = diff[at].mul_add(*scale, *w),
                }
            }
            *w = round(*w);
        }
        out
    }

    /// In place on host bytes and as a candle op, in every dtype: the values the definition
    /// gives, bit for bit (the blocked loops change no sum's order).
    #[test]
    fn host_merges_follow_the_definition() -> candle_core::Result<()> {
        let (deltas, dims) = deltas();
        let n = dims[0] * dims[1];
        let base: Vec<f32> = (0..n).map(|i| (i as f32 * 0.013).cos()).collect();
        type Round = fn(f32) -> f32;
        let cases: [(DType, Round); 3] = [
            (DType::F32, |v| v),
            (DType::BF16, |v| half::bf16::from_f32(v).to_f32()),
            (DType::F16, |v| half::f16::from_f32(v).to_f32()),
        ];
        for (dtype, round) in cases {
            let t =
                Tensor::from_vec(base.clone(), dims.as_slice(), &Device::Cpu)?.to_dtype(dtype)?;
            let start: Vec<f32> = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
            let want = by_the_definition(&start, &deltas, dims[1], round);
            let op = t.apply_op1_no_bwd(&Merge { deltas: &deltas })?;
            let got: Vec<f32> = op.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
            assert_eq!(got, want, "{dtype:?} as a candle op");
            let mut bytes = vec![0u8; n * dtype.size_in_bytes()];
            crate::weights::write_bytes(&t, &mut bytes)?;
            merge_into(&deltas, &dims, dtype, &mut bytes)?;
            let merged = Tensor::from_raw_buffer(&bytes, dtype, &dims, &Device::Cpu)?;
            let got: Vec<f32> = merged.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
            assert_eq!(got, want, "{dtype:?} in place");
        }
        Ok(())
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    use super::tests::deltas;
    use super::*;
    use candle_core::{Device, Tensor};

    /// The GPU's merge holds the host's bits.
    #[test]
    fn the_gpu_merges_the_bits_of_the_host() -> candle_core::Result<()> {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: LoRA merge test skipped");
            return Ok(());
        };
        let (deltas, dims) = deltas();
        let n = dims[0] * dims[1];
        let base: Vec<f32> = (0..n).map(|i| (i as f32 * 0.013).cos()).collect();
        for dtype in DTYPES {
            let t =
                Tensor::from_vec(base.clone(), dims.as_slice(), &Device::Cpu)?.to_dtype(dtype)?;
            let host = t.apply_op1_no_bwd(&Merge { deltas: &deltas })?;
            let device = t
                .to_device(&gpu)?
                .apply_op1_no_bwd(&Merge { deltas: &deltas })?;
            let (host, device): (Vec<f32>, Vec<f32>) = (
                host.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?,
                device
                    .flatten_all()?
                    .to_dtype(DType::F32)?
                    .to_device(&Device::Cpu)?
                    .to_vec1()?,
            );
            assert_eq!(
                host.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                device.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{dtype:?}"
            );
        }
        Ok(())
    }
}
