//! Fused attention forward on CUDA (`flash_attn.cu`, the FlashAttention-2 scheme): scores and
//! probabilities stay on the chip, so one pass reads q, k and v and writes the output once.

pub use crate::models::kernel_module::SHARED_MEMORY_LIMIT_ENV;
use crate::models::kernel_module::{kernel_module, shared_memory_limit, Module};
use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{
    CudaDevice, CudaStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor,
};

static ATTN: Module = kernel_module!("flash_attn");
/// Warps per block (`NW` in the kernel).
const WARPS: usize = 4;
/// Key/value rows per shared-memory tile (`BC` in the kernel).
const KEYS_PER_TILE: usize = 64;
/// Elements of padding per shared-memory row in the padded layout (`PAD` in the kernel).
const ROW_PAD: usize = 8;
/// The compiled configurations, fastest first: (m-tiles of 16 query rows per warp, swizzled
/// layout). Two m-tiles reuse each key/value fragment twice; the padded layout costs no address
/// arithmetic but 16 bytes a row more shared memory than the swizzled one.
const CONFIGS: [(usize, bool); 3] = [(2, false), (2, true), (1, true)];

/// One compiled launch configuration of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    /// m-tiles per warp (`MT`).
    pub m_tiles: usize,
    /// Rows unpadded and XOR-swizzled (`SWIZZLE`) rather than padded.
    pub swizzled: bool,
    /// Query rows per block.
    pub rows: usize,
    /// Dynamic shared memory per block, bytes: query tile plus double-buffered keys and values.
    pub shared_bytes: usize,
}

impl Tile {
    /// The kernel's name suffix.
    fn suffix(&self) -> String {
        let layout = if self.swizzled { "swz" } else { "pad" };
        format!("m{}_{layout}", self.m_tiles)
    }
}

/// The fastest configuration whose shared memory fits `limit` bytes per block.
pub fn tile_for(head_dim: usize, elem_bytes: usize, limit: usize) -> Option<Tile> {
    CONFIGS.iter().find_map(|&(m_tiles, swizzled)| {
        let rows = 16 * m_tiles * WARPS;
        let row_elems = if swizzled {
            head_dim
        } else {
            head_dim + ROW_PAD
        };
        let shared_bytes = (rows + 4 * KEYS_PER_TILE) * row_elems * elem_bytes;
        (shared_bytes <= limit).then_some(Tile {
            m_tiles,
            swizzled,
            rows,
            shared_bytes,
        })
    })
}

/// The configuration the kernel launches with on `dev`, if any fits its launch limits.
pub fn device_tile(dev: &CudaDevice, head_dim: usize, dtype: DType) -> Option<Tile> {
    tile_for(head_dim, dtype.size_in_bytes(), shared_memory_limit(dev)?)
}

/// Whether the fused kernel computes `sdpa` for these inputs: CUDA (compute capability 8.0 or
/// newer), bf16 or f16, head_dim 64 or 128, matching batch and heads, at least one key, and a
/// configuration within the device's shared-memory limit.
pub fn supported(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let (Device::Cuda(dev), Some((b, h, n, m, d))) = (q.device(), super::fused_shapes(q, k, v))
    else {
        return false;
    };
    matches!(d, 64 | 128)
        && b * h <= u16::MAX as usize
        && n.max(m) < i32::MAX as usize
        && dev
            .cuda_stream()
            .context()
            .compute_capability()
            .is_ok_and(|(major, _)| major >= 8)
        && device_tile(dev, d, q.dtype()).is_some()
}

/// Attention over `[batch, heads, seq, head_dim]`; the caller checked [`supported`].
/// The result is a `[batch, heads, q_len, head_dim]` view of `[batch, q_len, heads, head_dim]`
/// storage, so merging the heads afterwards is free.
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    fused(q, k, v, scale, false)
}

/// The fused attention through the portable kernel, or through Hopper's (`hopper`: bf16 only,
/// `flash_attn_sm90`), on inputs `aligned` for their 16-byte loads; the result as
/// [`flash_attn`]'s.
pub(crate) fn fused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    hopper: bool,
) -> Result<Tensor> {
    let op = FlashAttn {
        scale_log2: (scale * std::f64::consts::LOG2_E) as f32,
        hopper,
    };
    aligned(q)?
        .apply_op3_no_bwd(&aligned(k)?, &aligned(v)?, &op)?
        .transpose(1, 2)
}

/// The kernel reads rows with 16-byte copies: every stride but the last (1) and the start
/// offset must be multiples of 8 elements; otherwise a contiguous copy is made.
pub(crate) fn aligned(t: &Tensor) -> Result<Tensor> {
    let layout = t.layout();
    let ok = layout.start_offset().is_multiple_of(8)
        && layout.stride().last() == Some(&1)
        && layout
            .dims()
            .iter()
            .zip(layout.stride())
            .all(|(&dim, &stride)| dim == 1 || stride == 1 || stride.is_multiple_of(8));
    if ok {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

struct FlashAttn {
    /// `scale * log2(e)`: the kernels exponentiate in base 2.
    scale_log2: f32,
    /// Hopper's kernel rather than the portable one.
    hopper: bool,
}

impl FlashAttn {
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
        let limit = shared_memory_limit(dev).unwrap_or(0);
        let Some(tile) = tile_for(d, std::mem::size_of::<T>(), limit) else {
            candle_core::bail!("flash-attn: no configuration fits {limit} B of shared memory")
        };
        let name = format!("flash_fwd_{dtype}_d{d}_{}", tile.suffix());
        let func = ATTN.function(dev, &name)?;
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            tile.shared_bytes as i32,
        )
        .w()?;
        // SAFETY: every element is written by the kernel (each query row of each head).
        let out = unsafe { dev.alloc::<T>(b * n * h * d) }?;
        let q = q.slice(ql.start_offset()..);
        let k = k.slice(kl.start_offset()..);
        let v = v.slice(vl.start_offset()..);
        let (q_len, kv_len, heads) = (n as i32, m as i32, h as i32);
        let strides = |l: &Layout| -> [i64; 3] {
            let s = l.stride();
            [s[0] as i64, s[1] as i64, s[2] as i64]
        };
        let (qs, ks, vs) = (strides(ql), strides(kl), strides(vl));
        // Output storage is [batch, q_len, heads, head_dim].
        let os = [(n * h * d) as i64, d as i64, (h * d) as i64];
        let mut builder = func.builder();
        builder.arg(&q).arg(&k).arg(&v).arg(&out);
        builder.arg(&q_len).arg(&kv_len).arg(&heads);
        for s in qs.iter().chain(&ks).chain(&vs).chain(&os) {
            builder.arg(s);
        }
        builder.arg(&self.scale_log2);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(tile.rows) as u32, (b * h) as u32, 1),
            block_dim: ((32 * WARPS) as u32, 1, 1),
            shared_mem_bytes: tile.shared_bytes as u32,
        };
        // SAFETY: the arguments match the kernel's signature; `supported` and `aligned` checked
        // the shapes, head_dim and the 16-byte alignment the kernel's copies need.
        unsafe { builder.launch(cfg) }.w()?;
        Ok((out, Shape::from((b, n, h, d))))
    }
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flash-attn"
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
            (S::BF16(q), S::BF16(k), S::BF16(v)) if self.hopper => {
                let (o, shape) = super::flash_attn_sm90::launch(
                    dev,
                    (q, ql),
                    (k, kl),
                    (v, vl),
                    self.scale_log2,
                )?;
                (S::BF16(o), shape)
            }
            _ if self.hopper => candle_core::bail!("Hopper's flash-attn takes bf16 q, k and v"),
            (S::BF16(q), S::BF16(k), S::BF16(v)) => {
                let (o, shape) = self.launch(dev, "bf16", q, ql, k, kl, v, vl)?;
                (S::BF16(o), shape)
            }
            (S::F16(q), S::F16(k), S::F16(v)) => {
                let (o, shape) = self.launch(dev, "f16", q, ql, k, kl, v, vl)?;
                (S::F16(o), shape)
            }
            _ => candle_core::bail!("flash-attn takes bf16 or f16 q, k and v of one dtype"),
        };
        let device = dev.clone();
        Ok((CudaStorage { slice, device }, shape))
    }
}
