//! The one arithmetic of a LoRA merge, run where the weight is: in a host copy (in place, by
//! threads in parallel) or where it landed on the device (a kernel, `kernels/lora_merge.cu`).
//! Both compute, per value in f32, `w = base`, then for each delta in order `acc = Σ_k up[i,k] ·
//! down[k,j]` summed in k's order, `w = w + acc · scale` (a whole delta: `w = w + diff[i,j] ·
//! scale`), each product and sum rounded (never fused), and round `w` to the weight's dtype: a
//! streamed block merged in its host copy and a resident one merged on the GPU hold the same bits.

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
    /// `scale · diff`, `diff` of the weight's shape `dims`.
    Full {
        diff: Vec<f32>,
        dims: Vec<usize>,
        scale: f32,
    },
}

impl Delta {
    /// The shape of the weight it changes.
    pub(super) fn dims(&self) -> Vec<usize> {
        match self {
            Delta::LowRank { up, down, rank, .. } => {
                vec![up.len() / rank.max(&1), down.len() / rank.max(&1)]
            }
            Delta::Full { dims, .. } => dims.clone(),
        }
    }
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

/// Rows one task merges: enough work to be worth a thread, few enough to spread.
const TASK_ROWS: usize = 16;

fn merge_values<T: Value>(deltas: &[Delta], dims: &[usize], values: &mut [T]) {
    let (_, cols) = rows_cols(dims);
    values
        .par_chunks_mut(TASK_ROWS * cols.max(1))
        .enumerate()
        .for_each(|(task, rows)| merge_rows(deltas, cols, task * TASK_ROWS, rows));
}

/// Rows merged at once by the host: each value of `down` is loaded once for all of them.
const BLOCK_ROWS: usize = 4;
/// Columns merged at once by the host: the accumulators stay in vector registers.
const BLOCK_COLS: usize = 16;

/// Merges whole rows `rows` (the first is row `first` of the weight, `cols` values each).
fn merge_rows<T: Value>(deltas: &[Delta], cols: usize, first: usize, rows: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above). Without FMA enabled no product and sum
        // fuse, so the bits are those of the portable path.
        unsafe { merge_rows_avx2(deltas, cols, first, rows) };
        return;
    }
    merge_rows_portable(deltas, cols, first, rows);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn merge_rows_avx2<T: Value>(deltas: &[Delta], cols: usize, first: usize, rows: &mut [T]) {
    merge_rows_portable(deltas, cols, first, rows);
}

#[inline(always)]
fn merge_rows_portable<T: Value>(deltas: &[Delta], cols: usize, first: usize, rows: &mut [T]) {
    let mut w = vec![0f32; BLOCK_ROWS * cols];
    for (block, values) in rows.chunks_mut(BLOCK_ROWS * cols).enumerate() {
        let n = values.len() / cols;
        let i0 = first + block * BLOCK_ROWS;
        let w = &mut w[..n * cols];
        for (w, v) in w.iter_mut().zip(values.iter()) {
            *w = v.get();
        }
        for delta in deltas {
            match delta {
                Delta::LowRank {
                    up,
                    down,
                    rank,
                    scale,
                } => add_low_rank(
                    w,
                    n,
                    cols,
                    &up[i0 * rank..(i0 + n) * rank],
                    down,
                    *rank,
                    *scale,
                ),
                Delta::Full { diff, scale, .. } => {
                    for (w, d) in w.iter_mut().zip(&diff[i0 * cols..(i0 + n) * cols]) {
                        *w += *d * *scale;
                    }
                }
            }
        }
        for (v, w) in values.iter_mut().zip(w.iter()) {
            *v = T::put(*w);
        }
    }
}

/// `w[r, j] += (Σ_k up[r, k] · down[k, j]) · scale` for the `n` (at most [`BLOCK_ROWS`]) rows of `w`.
#[inline(always)]
fn add_low_rank(
    w: &mut [f32],
    n: usize,
    cols: usize,
    up: &[f32],
    down: &[f32],
    rank: usize,
    scale: f32,
) {
    let mut j = 0;
    while j < cols {
        let width = BLOCK_COLS.min(cols - j);
        let mut acc = [[0f32; BLOCK_COLS]; BLOCK_ROWS];
        if width == BLOCK_COLS && n == BLOCK_ROWS {
            // The common case, with fixed sizes the compiler keeps in registers.
            for k in 0..rank {
                let d: &[f32; BLOCK_COLS] = down[k * cols + j..][..BLOCK_COLS]
                    .try_into()
                    .expect("BLOCK_COLS values");
                for (r, acc) in acc.iter_mut().enumerate() {
                    let u = up[r * rank + k];
                    for (a, d) in acc.iter_mut().zip(d) {
                        *a += u * *d;
                    }
                }
            }
        } else {
            for k in 0..rank {
                let d = &down[k * cols + j..][..width];
                for (r, acc) in acc.iter_mut().enumerate().take(n) {
                    let u = up[r * rank + k];
                    for (a, d) in acc.iter_mut().zip(d) {
                        *a += u * *d;
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate().take(n) {
            for (w, a) in w[r * cols + j..][..width].iter_mut().zip(acc) {
                *w += *a * scale;
            }
        }
        j += width;
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
        use crate::models::kernel_module::{kernel_module, Module};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::WrapErr;
        use candle_core::CudaStorage;
        static LORA_MERGE: Module = kernel_module!("lora_merge");

        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("a weight to merge into is contiguous")
        };
        let dtype = storage.dtype();
        let Some(code) = DTYPES.iter().position(|d| *d == dtype) else {
            candle_core::bail!("LoRA deltas merge into float weights, not {dtype:?}")
        };
        let (rows, cols) = rows_cols(layout.dims());
        // Every factor in one buffer, and each delta's rank, offsets and scale bits.
        let mut factors = Vec::new();
        let mut table = Vec::new();
        for delta in self.deltas {
            let (rank, a, b, scale) = match delta {
                Delta::LowRank {
                    up,
                    down,
                    rank,
                    scale,
                } => (*rank, up.as_slice(), down.as_slice(), *scale),
                Delta::Full { diff, scale, .. } => (0, diff.as_slice(), &[][..], *scale),
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
        let dev = &storage.device;
        let stream = dev.cuda_stream();
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
        macro_rules! launch {
            ($t:ty) => {{
                let src = storage.as_cuda_slice::<$t>()?.slice(start..end);
                // SAFETY: the kernel writes all `rows * cols` values.
                let dst = unsafe { dev.alloc::<$t>(end - start) }?;
                let (code, rows, cols, n) = (
                    code as i32,
                    rows as i64,
                    cols as i64,
                    self.deltas.len() as i32,
                );
                let mut builder = func.builder();
                builder
                    .arg(&src)
                    .arg(&dst)
                    .arg(&code)
                    .arg(&rows)
                    .arg(&cols)
                    .arg(&factors)
                    .arg(&table)
                    .arg(&n);
                // SAFETY: the arguments follow `lora_merge`'s signature; `src` and `dst` hold
                // `rows * cols` values of `dtype`, `factors` every offset `table` names.
                unsafe { builder.launch(cfg) }.w()?;
                CudaStorage::wrap_cuda_slice(dst, dev.clone())
            }};
        }
        let out = match dtype {
            DType::F16 => launch!(half::f16),
            DType::BF16 => launch!(half::bf16),
            _ => launch!(f32),
        };
        Ok((out, layout.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// A rank-3 delta, a whole one and a second low-rank one on an 11 x 37 weight (rows and
    /// columns that are no multiple of the blocks).
    fn deltas() -> (Vec<Delta>, Vec<usize>) {
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
                dims: vec![rows, cols],
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
                            acc += up[i * rank + k] * down[k * cols + j];
                        }
                        *w += acc * scale;
                    }
                    Delta::Full { diff, scale, .. } => *w += diff[at] * scale,
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

    /// The GPU's merge holds the host's bits.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_gpu_merges_the_bits_of_the_host() -> candle_core::Result<()> {
        let gpu = Device::new_cuda(0)?;
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
