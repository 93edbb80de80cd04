//! Hopper's fused attention forward (`flash_attn_sm90.cu`, the FlashAttention-3 scheme: TMA
//! loads, wgmma, a producer warpgroup and two consumer warpgroups taking turns). Its machine code
//! exists for sm_90a alone (wgmma and TMA are Hopper's), so it runs on compute capability 9.0
//! only, in bf16 at head_dim 128 or a smaller multiple of 8 (in tiles of 128 columns: the tensor
//! maps fill the columns past the head_dim with zeros, and the kernel built for 64, 96 or 128
//! output columns, the narrowest covering it, runs); every other GPU and input takes the
//! portable kernel.

use std::ffi::c_void;

use crate::models::kernel_module::{kernel_module, shared_memory_limit, Module};
use candle_core::cuda::cudarc::driver::sys::{self, CUfunction_attribute, CUtensorMap};
use candle_core::cuda::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Device, Layout, Result, Shape, Tensor};
use half::bf16;

static ATTN: Module = kernel_module!("flash_attn_sm90");
/// The kernels by the output columns they compute: the narrowest that covers the head_dim runs.
const KERNELS: [(usize, &str); 3] = [
    (64, "flash_fwd_sm90_bf16_d64"),
    (96, "flash_fwd_sm90_bf16_d96"),
    (128, "flash_fwd_sm90_bf16_d128"),
];
/// The widest head_dim the kernels take (their tiles' columns).
const HEAD_DIM: usize = 128;
/// Query rows per block (`BM`) and keys per tile (`BN`).
const ROWS: usize = 128;
/// One producer and two consumer warpgroups.
const THREADS: u32 = 384;
/// Shared memory: the query tile and two stages of key and value tiles (128 x 128 bf16 each), plus
/// 1024 bytes to align the swizzled tiles.
const SHARED_BYTES: usize = 5 * ROWS * HEAD_DIM * 2 + 1024;

/// Whether the Hopper kernel can compute these inputs: compute capability 9.0, bf16, head_dim
/// a multiple of 8 up to 128, matching batch and heads, at least one key, strides TMA can address (multiples
/// of 8 elements, checked by [`super::flash_attn::aligned`]'s copy where needed) and the
/// shared memory the kernel needs.
pub fn supported(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let (Device::Cuda(dev), Some((b, h, n, m, d))) = (q.device(), super::fused_shapes(q, k, v))
    else {
        return false;
    };
    q.dtype() == DType::BF16
        && d.is_multiple_of(8)
        && d <= HEAD_DIM
        && b.max(h) <= u16::MAX as usize
        && n.max(m) < i32::MAX as usize
        && dev.cuda_stream().context().compute_capability().ok() == Some((9, 0))
        && shared_memory_limit(dev).is_some_and(|limit| limit >= SHARED_BYTES)
}

/// Attention over `[batch, heads, seq, head_dim]` bf16; the caller checked [`supported`]. The
/// result is a `[batch, heads, q_len, head_dim]` view of `[batch, q_len, heads, head_dim]` storage.
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    super::flash_attn::fused(q, k, v, scale, true)
}

/// A TMA descriptor, passed by value as the kernel's `__grid_constant__ CUtensorMap`.
#[repr(transparent)]
pub(crate) struct TensorMap(CUtensorMap);

// SAFETY: a CUtensorMap is plain bytes the driver copies into the kernel's parameters.
unsafe impl DeviceRepr for TensorMap {}

impl TensorMap {
    /// Boxes of 128 rows x 64 head-dim columns, 128-byte swizzled, over `[batch, heads, seq,
    /// head_dim]` bf16 at `ptr` with the element strides of `layout`; rows past the end read as
    /// zeros.
    fn new(ptr: u64, layout: &Layout) -> Result<Self> {
        let dims = layout.dims();
        let strides = layout.stride();
        let (b, h, n, d) = (dims[0], dims[1], dims[2], dims[3]);
        // A dimension of size one may carry any stride; TMA wants multiples of 16 bytes.
        let stride = |i: usize, fallback: usize| {
            let s = if dims[i] == 1 { fallback } else { strides[i] };
            (s * 2) as u64
        };
        let row = stride(2, d);
        let head = stride(1, n * row as usize / 2);
        let batch = stride(0, h * head as usize / 2);
        let global_dim = [d as u64, n as u64, h as u64, b as u64];
        Self::encode(
            ptr,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            global_dim,
            [row, head, batch],
            [64, ROWS as u32, 1, 1],
        )
    }

    /// Boxes of `box_rows` rows x 128 bytes, 128-byte swizzled, over `planes` contiguous planes of
    /// `rows` x `cols` bytes at `ptr` (`cols` a multiple of 16); rows and columns past the ends read
    /// as zeros. The 8-bit attention's codes (`sage_attn_sm90.cu`, 128 rows) and the fp8 Linear's
    /// (`fp8_sm90.cu`).
    pub(crate) fn byte_tiles(
        ptr: u64,
        cols: usize,
        rows: usize,
        planes: usize,
        box_rows: u32,
    ) -> Result<Self> {
        let (cols, rows, planes) = (cols as u64, rows as u64, planes as u64);
        Self::encode(
            ptr,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            [cols, rows, planes, 1],
            [cols, cols * rows, cols * rows * planes],
            [128, box_rows, 1, 1],
        )
    }

    /// Boxes of `box_rows` rows x 64 columns, 128-byte swizzled, over a `[rows, cols]` bf16
    /// matrix at `ptr` (`cols` a multiple of 8): the fp8 Linear's output (`fp8_sm90.cu` stores
    /// through it; what falls past the ends is not written).
    pub(crate) fn bf16_tiles(ptr: u64, cols: usize, rows: usize, box_rows: u32) -> Result<Self> {
        let (cols, rows) = (cols as u64, rows as u64);
        let row = cols * 2;
        Self::encode(
            ptr,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            [cols, rows, 1, 1],
            [row, row * rows, row * rows],
            [64, box_rows, 1, 1],
        )
    }

    /// A rank-4 map of `global_dim` elements (innermost first) with byte strides
    /// `global_strides` of the outer three, read in boxes of `box_dim`, 128-byte swizzled.
    fn encode(
        ptr: u64,
        dtype: sys::CUtensorMapDataType,
        global_dim: [u64; 4],
        global_strides: [u64; 3],
        box_dim: [u32; 4],
    ) -> Result<Self> {
        let element_strides = [1u32; 4];
        let mut map = std::mem::MaybeUninit::<CUtensorMap>::zeroed();
        // SAFETY: the arrays have the lengths rank 4 asks for; `map` is written by the call.
        let status = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                dtype,
                4,
                ptr as *mut c_void,
                global_dim.as_ptr(),
                global_strides.as_ptr(),
                box_dim.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if status != sys::CUresult::CUDA_SUCCESS {
            candle_core::bail!(
                "sm_90 kernel: TMA descriptor of {global_dim:?} / {global_strides:?} bytes: {status:?}"
            )
        }
        // SAFETY: initialised by the successful call above.
        Ok(Self(unsafe { map.assume_init() }))
    }
}

/// Launches the kernel on q, k and v `[batch, heads, seq, head_dim]` (their storage and layouts);
/// `scale_log2` is the softmax scale times log2(e). Returns the `[batch, q_len, heads, head_dim]`
/// output.
pub(super) fn launch(
    dev: &CudaDevice,
    (q, ql): (&CudaSlice<bf16>, &Layout),
    (k, kl): (&CudaSlice<bf16>, &Layout),
    (v, vl): (&CudaSlice<bf16>, &Layout),
    scale_log2: f32,
) -> Result<(CudaSlice<bf16>, Shape)> {
    let (b, h, n, d) = ql.shape().dims4()?;
    let m = kl.dims()[2];
    let Some(&(_, kernel)) = KERNELS.iter().find(|(width, _)| d <= *width) else {
        candle_core::bail!("Hopper attention: head_dim {d} above {HEAD_DIM}")
    };
    let func = ATTN.function(dev, kernel)?;
    func.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        SHARED_BYTES as i32,
    )
    .w()?;
    let stream = dev.cuda_stream();
    let q = q.slice(ql.start_offset()..);
    let k = k.slice(kl.start_offset()..);
    let v = v.slice(vl.start_offset()..);
    // The guards keep the inputs' stream order while the kernel reads them through the maps.
    let (q_ptr, _q_guard) = q.device_ptr(&stream);
    let (k_ptr, _k_guard) = k.device_ptr(&stream);
    let (v_ptr, _v_guard) = v.device_ptr(&stream);
    let maps = [
        TensorMap::new(q_ptr, ql)?,
        TensorMap::new(k_ptr, kl)?,
        TensorMap::new(v_ptr, vl)?,
    ];
    // SAFETY: every element is written by the kernel (each query row of each head).
    let out = unsafe { dev.alloc::<bf16>(b * n * h * d) }?;
    let (q_len, kv_len) = (n as i32, m as i32);
    // Output storage is [batch, q_len, heads, head_dim].
    let (out_batch, out_row, out_head) = ((n * h * d) as i64, (h * d) as i64, d as i64);
    let mut builder = func.builder();
    builder.arg(&maps[0]).arg(&maps[1]).arg(&maps[2]).arg(&out);
    builder.arg(&q_len).arg(&kv_len);
    builder.arg(&out_batch).arg(&out_row).arg(&out_head);
    let head_dim = d as i32;
    builder.arg(&head_dim).arg(&scale_log2);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(ROWS) as u32, h as u32, b as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: SHARED_BYTES as u32,
    };
    // SAFETY: the arguments match the kernel's signature; `supported` checked the device,
    // dtype and head_dim, and `aligned` the 16-byte strides the maps need.
    unsafe { builder.launch(cfg) }.w()?;
    Ok((out, Shape::from((b, n, h, d))))
}
