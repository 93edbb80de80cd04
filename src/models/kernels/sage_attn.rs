//! 8-bit attention on CUDA (`sage_attn.cu`; `models::sage_attention` defines the arithmetic):
//! the column statistics of k and v, int8 codes of q and of the smoothed k, e4m3 codes of v
//! transposed, then the attention (on Hopper at head_dim 128 `sage_attn_sm90.cu`'s wgmma kernel,
//! elsewhere the portable one), launches on the device's stream.

use crate::models::attention::flash_attn::aligned;
use crate::models::attention::flash_attn_sm90::TensorMap;
use crate::models::kernel_module::{kernel_module, shared_memory_limit, Module};
use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, CustomOp3, Device, Layout, Result, Shape, Tensor};

static SAGE: Module = kernel_module!("sage_attn");
static SAGE_SM90: Module = kernel_module!("sage_attn_sm90");
/// Warps per block of the portable attention.
const WARPS: usize = 4;
/// Keys per shared-memory tile of the portable attention (`BC`).
const KEYS_PER_TILE: usize = 64;
/// Keys per scale of the key codes (`KEY_BLOCK`), and what the transposed values are padded to.
const KEY_BLOCK: usize = crate::models::sage_attention::KEY_BLOCK;
/// The Hopper kernel: query rows per block, threads (a producer and two consumer warpgroups), and
/// shared memory (the query codes and four stages of key and value codes, 128 x 128 bytes each,
/// 1024 bytes of e4m3 ones after each value stage, and 1024 bytes to align the swizzled tiles;
/// `STAGES` and `V_STAGE` of sage_attn_sm90.cu).
const SM90_ROWS: usize = 128;
const SM90_THREADS: usize = 384;
const SM90_SHARED: usize = (1 + 2 * 4) * 128 * 128 + 4 * 1024 + 1024;
/// Bytes added to each shared-memory row (`ROW_PAD`).
const ROW_PAD: usize = 16;
/// Key rows per block of the statistics (`STAT_ROWS`).
const STAT_ROWS: usize = 512;
/// m-tiles of 16 query rows per warp, fastest first.
const M_TILES: [usize; 2] = [2, 1];

/// The kernel that computes the attention from the codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// `sage_attn.cu`'s mma.sync kernel with this many m-tiles per warp (any GPU with fp8 tensor
    /// cores).
    Portable(usize),
    /// `sage_attn_sm90.cu`'s wgmma kernel (compute capability 9.0, head_dim 128).
    Hopper,
}

/// Dynamic shared memory of the portable attention with `m_tiles` per warp: the query tile and
/// double-buffered key and transposed value tiles.
pub fn shared_bytes(head_dim: usize, m_tiles: usize) -> usize {
    let rows = 16 * m_tiles * WARPS;
    (rows + 2 * KEYS_PER_TILE) * (head_dim + ROW_PAD) + 2 * head_dim * (KEYS_PER_TILE + ROW_PAD)
}

/// Whether `dev` has the fp8 tensor cores the kernel needs (compute capability 8.9 or newer).
pub fn device_runs(dev: &CudaDevice) -> bool {
    compute_capability(dev).is_some_and(|cc| cc >= (8, 9))
}

fn compute_capability(dev: &CudaDevice) -> Option<(i32, i32)> {
    dev.cuda_stream().context().compute_capability().ok()
}

/// The kernel the attention launches on `dev`: Hopper's where it runs, else the portable one with
/// the most m-tiles that fit its shared memory.
pub fn device_kernel(dev: &CudaDevice, head_dim: usize) -> Option<Kernel> {
    let limit = shared_memory_limit(dev)?;
    let hopper = head_dim == 128 && limit >= SM90_SHARED && compute_capability(dev) == Some((9, 0));
    if hopper {
        return Some(Kernel::Hopper);
    }
    M_TILES
        .into_iter()
        .find(|&m| shared_bytes(head_dim, m) <= limit)
        .map(Kernel::Portable)
}

/// Whether the kernel computes these inputs: CUDA with fp8 tensor cores, bf16 or f16 of one dtype,
/// head_dim 64 or 128, matching batch and heads, at least one key.
pub fn supported(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let (Device::Cuda(dev), Some((b, h, n, m, d))) =
        (q.device(), crate::models::attention::fused_shapes(q, k, v))
    else {
        return false;
    };
    matches!(d, 64 | 128)
        && b * h <= u16::MAX as usize
        && n.max(m) < i32::MAX as usize / 2
        && device_runs(dev)
        && device_kernel(dev, d).is_some()
}

/// The 8-bit attention over `[batch, heads, seq, head_dim]`; the caller checked [`supported`].
/// The result is a `[batch, heads, q_len, head_dim]` view of `[batch, q_len, heads, head_dim]`
/// storage, as the fused attention's.
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    attend_with(q, k, v, scale, None)
}

/// [`attend`] through `kernel` where given (for tests and benchmarks; it must run on the
/// device), else the device's.
pub fn attend_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    kernel: Option<Kernel>,
) -> Result<Tensor> {
    let op = SageAttn {
        scale_log2: (scale * std::f64::consts::LOG2_E) as f32,
        kernel,
    };
    aligned(q)?
        .apply_op3_no_bwd(&aligned(k)?, &aligned(v)?, &op)?
        .transpose(1, 2)
}

struct SageAttn {
    /// `scale * log2(e)`: the kernel exponentiates in base 2.
    scale_log2: f32,
    kernel: Option<Kernel>,
}

/// `(batch, head, seq)` strides of a `[batch, heads, seq, head_dim]` layout.
fn strides(l: &Layout) -> [i64; 3] {
    let s = l.stride();
    [s[0] as i64, s[1] as i64, s[2] as i64]
}

fn grid(x: usize, y: usize, threads: usize, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

impl SageAttn {
    #[allow(clippy::too_many_arguments)]
    fn launch<T: DeviceRepr>(
        &self,
        dev: &CudaDevice,
        dtype: &str,
        q: &CudaSlice<T>,
        ql: &Layout,
        k: &CudaSlice<T>,
        kl: &Layout,
        v: &CudaSlice<T>,
        vl: &Layout,
    ) -> Result<(CudaSlice<T>, Shape)> {
        let (b, h, n, d) = ql.shape().dims4()?;
        let m = kl.dims()[2];
        let bh = b * h;
        let pad = m.next_multiple_of(KEY_BLOCK);
        let Some(kernel) = self.kernel.or_else(|| device_kernel(dev, d)) else {
            candle_core::bail!("sage attention: no configuration fits this GPU's shared memory")
        };
        let (q, k, v) = (
            q.slice(ql.start_offset()..),
            k.slice(kl.start_offset()..),
            v.slice(vl.start_offset()..),
        );
        let (qs, ks, vs) = (strides(ql), strides(kl), strides(vl));
        let (n32, m32, pad32, h32, d32, bh32) = (
            n as i32, m as i32, pad as i32, h as i32, d as i32, bh as i32,
        );

        // SAFETY (every launch below): the arguments match the kernel's signature; `supported` and
        // `aligned` checked the shapes, head_dim and the alignment of the inputs' rows; each
        // buffer is sized for every element its kernel writes, and read only after.
        let mut stats = unsafe { dev.alloc::<f32>(bh * 4 * d) }?;
        let func = SAGE.function(dev, "sage_stats_init")?;
        let mut builder = func.builder();
        builder.arg(&mut stats).arg(&bh32).arg(&d32);
        unsafe { builder.launch(grid((bh * 4 * d).div_ceil(256), 1, 256, 0)) }.w()?;

        let func = SAGE.function(dev, &format!("sage_stats_{dtype}_d{d}"))?;
        let mut builder = func.builder();
        builder.arg(&k).arg(&v).arg(&mut stats).arg(&m32).arg(&h32);
        for s in ks.iter().chain(&vs) {
            builder.arg(s);
        }
        unsafe { builder.launch(grid(m.div_ceil(STAT_ROWS), bh, 2 * d, 0)) }.w()?;

        let func = SAGE.function(dev, &format!("sage_q_{dtype}_d{d}"))?;
        let mut q_codes = unsafe { dev.alloc::<i8>(bh * n * d) }?;
        let mut q_scales = unsafe { dev.alloc::<f32>(bh * n) }?;
        let mut builder = func.builder();
        builder.arg(&q).arg(&mut q_codes).arg(&mut q_scales);
        builder.arg(&n32).arg(&h32);
        for s in &qs {
            builder.arg(s);
        }
        unsafe { builder.launch(grid(n.div_ceil(8), bh, 256, 0)) }.w()?;

        let func = SAGE.function(dev, &format!("sage_k_{dtype}_d{d}"))?;
        let mut k_codes = unsafe { dev.alloc::<i8>(bh * m * d) }?;
        let mut k_scales = unsafe { dev.alloc::<f32>(bh * pad / KEY_BLOCK) }?;
        let mut builder = func.builder();
        builder
            .arg(&k)
            .arg(&stats)
            .arg(&mut k_codes)
            .arg(&mut k_scales);
        builder.arg(&m32).arg(&h32);
        for s in &ks {
            builder.arg(s);
        }
        unsafe { builder.launch(grid(pad / KEY_BLOCK, bh, 256, 0)) }.w()?;

        let mut v_codes = unsafe { dev.alloc::<u8>(bh * d * pad) }?;
        let func = SAGE.function(dev, &format!("sage_v_{dtype}_d{d}"))?;
        let mut builder = func.builder();
        builder.arg(&v).arg(&stats).arg(&mut v_codes);
        builder.arg(&m32).arg(&pad32).arg(&h32);
        for s in &vs {
            builder.arg(s);
        }
        unsafe { builder.launch(grid(pad / KEYS_PER_TILE, bh, 256, 0)) }.w()?;

        let mut out = unsafe { dev.alloc::<T>(b * n * h * d) }?;
        // Output storage is [batch, q_len, heads, head_dim].
        let os = [(n * h * d) as i64, d as i64, (h * d) as i64];
        match kernel {
            Kernel::Portable(m_tiles) => {
                let shared = shared_bytes(d, m_tiles);
                let func = SAGE.function(dev, &format!("sage_fwd_{dtype}_d{d}_m{m_tiles}"))?;
                func.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared as i32,
                )
                .w()?;
                let mut builder = func.builder();
                builder
                    .arg(&q_codes)
                    .arg(&q_scales)
                    .arg(&k_codes)
                    .arg(&k_scales);
                builder.arg(&v_codes).arg(&stats).arg(&mut out);
                builder.arg(&n32).arg(&m32).arg(&pad32).arg(&h32);
                for s in &os {
                    builder.arg(s);
                }
                builder.arg(&self.scale_log2);
                let rows = 16 * m_tiles * WARPS;
                unsafe { builder.launch(grid(n.div_ceil(rows), bh, 32 * WARPS, shared)) }.w()?;
            }
            Kernel::Hopper => {
                let func = SAGE_SM90.function(dev, &format!("sage_fwd_sm90_{dtype}_d128"))?;
                func.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    SM90_SHARED as i32,
                )
                .w()?;
                let stream = dev.cuda_stream();
                // The guards keep the codes' stream order while the kernel reads them through
                // the maps.
                let (q_ptr, _q_guard) = q_codes.device_ptr(&stream);
                let (k_ptr, _k_guard) = k_codes.device_ptr(&stream);
                let (v_ptr, _v_guard) = v_codes.device_ptr(&stream);
                let maps = [
                    TensorMap::byte_tiles(q_ptr, d, n, bh, 128)?,
                    TensorMap::byte_tiles(k_ptr, d, m, bh, 128)?,
                    TensorMap::byte_tiles(v_ptr, pad, d, bh, 128)?,
                ];
                let mut builder = func.builder();
                builder.arg(&maps[0]).arg(&maps[1]).arg(&maps[2]);
                builder
                    .arg(&q_scales)
                    .arg(&k_scales)
                    .arg(&stats)
                    .arg(&mut out);
                builder.arg(&n32).arg(&m32).arg(&pad32).arg(&h32);
                let (batch, row, head) = (os[0], os[2], os[1]);
                builder.arg(&batch).arg(&row).arg(&head);
                builder.arg(&self.scale_log2);
                let cfg = grid(n.div_ceil(SM90_ROWS), bh, SM90_THREADS, SM90_SHARED);
                unsafe { builder.launch(cfg) }.w()?;
            }
        }
        Ok((out, Shape::from((b, n, h, d))))
    }
}

impl CustomOp3 for SageAttn {
    fn name(&self) -> &'static str {
        "sage-attn"
    }

    crate::models::kernel_module::cuda_only_cpu_fwd!(a a_layout, b b_layout, c c_layout);

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        use CudaStorageSlice as S;
        let dev = &q.device;
        let (slice, shape) = match (&q.slice, &k.slice, &v.slice) {
            (S::BF16(q), S::BF16(k), S::BF16(v)) => {
                let (o, shape) = self.launch(dev, "bf16", q, ql, k, kl, v, vl)?;
                (S::BF16(o), shape)
            }
            (S::F16(q), S::F16(k), S::F16(v)) => {
                let (o, shape) = self.launch(dev, "f16", q, ql, k, kl, v, vl)?;
                (S::F16(o), shape)
            }
            _ => candle_core::bail!("sage attention takes bf16 or f16 q, k and v of one dtype"),
        };
        let device = dev.clone();
        Ok((CudaStorage { slice, device }, shape))
    }
}

#[cfg(test)]
mod cuda_tests {
    use super::*;
    use crate::models::attention::cuda_tests::FUSED_CASES;
    use crate::models::attention::sdpa_chunked;
    use crate::models::sage_attention::attend_host;
    use crate::models::sage_attention::tests::compare;
    use candle_core::DType;

    /// Each kernel the device runs (both portable launch configurations, and Hopper's there)
    /// against the host definition (the same codes but for the probabilities' running max, see
    /// `sage_attention`) and against the exact f32 attention, on strided views, partial tiles, one
    /// key, both head sizes and dtypes.
    #[test]
    fn kernel_matches_the_host_definition() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: sage attention test skipped");
            return Ok(());
        };
        if !device_runs(dev.as_cuda_device()?) {
            eprintln!("no fp8 tensor cores: sage attention test skipped");
            return Ok(());
        }
        for (dtype, (b, h, n, m, d), spread) in FUSED_CASES {
            // Heads-major views of [b, seq, h, d] storage; values with a common part per channel.
            let rand = |len: usize, s: f64| -> Result<Tensor> {
                (Tensor::randn(0f32, 1f32, (b, len, h, d), &dev)? * s)?
                    .to_dtype(dtype)?
                    .transpose(1, 2)
            };
            let offset = Tensor::randn(0f32, 2f32, (1, 1, 1, d), &dev)?.to_dtype(dtype)?;
            let (q, k) = (rand(n, spread)?, rand(m, spread)?);
            let v = rand(m, 1.0)?.broadcast_add(&offset)?;
            let scale = 1.0 / (d as f64).sqrt();
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            let exact = sdpa_chunked(&f32(&q)?, &f32(&k)?, &f32(&v)?, scale)?;
            let host = attend_host(
                &q.to_device(&Device::Cpu)?,
                &k.to_device(&Device::Cpu)?,
                &v.to_device(&Device::Cpu)?,
                scale,
            )?
            .to_dtype(DType::F32)?;
            let (to_exact, _) = compare(&host, &exact.to_device(&Device::Cpu)?)?;
            let hopper = device_kernel(dev.as_cuda_device()?, d) == Some(Kernel::Hopper);
            let kernels = M_TILES
                .map(Kernel::Portable)
                .into_iter()
                .chain(hopper.then_some(Kernel::Hopper));
            for kernel in kernels {
                let out = attend_with(&q, &k, &v, scale, Some(kernel))?;
                assert_eq!(out.dims(), q.dims());
                let out = out.to_device(&Device::Cpu)?;
                let (to_host, _) = compare(&out, &host)?;
                let (err, cos) = compare(&out, &exact.to_device(&Device::Cpu)?)?;
                let case = format!("{dtype:?} {:?} {kernel:?}", (b, h, n, m, d));
                eprintln!("{case}: to host {to_host:.2e}, to exact {err:.2e} (host {to_exact:.2e}), cosine {cos:.6}");
                // One key tile: the running max is the row's, so only the exponentials'
                // rounding differs; over many tiles the probabilities round against running
                // maxima, about as far from the definition's roundings as those are from exact.
                let one_tile = match kernel {
                    Kernel::Portable(_) => KEYS_PER_TILE,
                    Kernel::Hopper => KEY_BLOCK,
                };
                let bound = if m <= one_tile { 0.2 } else { 2.0 };
                assert!(
                    to_host < bound * to_exact.max(1e-3),
                    "{case}: {to_host:.2e} from the definition"
                );
                assert!(
                    err < 2e-2 && cos > 0.999,
                    "{case}: {err:.2e} from exact, cosine {cos}"
                );
            }
        }
        Ok(())
    }
}
