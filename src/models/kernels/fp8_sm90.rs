//! The fp8 Linear on Hopper's wgmma (`fp8_sm90.cu`): the product of the e4m3 codes, both rows'
//! scales, the bias and GELU in one kernel. Its machine code exists for sm_90a alone (wgmma and
//! TMA are Hopper's), so it runs on compute capability 9.0 only, in bf16; every other GPU, dtype
//! or shape takes cuBLASLt's product ([`super::fp8_kernels`]).

use candle_core::cuda::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Device, Result, Tensor};

use crate::models::attention::flash_attn_sm90::TensorMap;
use crate::models::fp8::Fp8Rows;
use crate::models::kernel_module::{kernel_module, shared_memory_limit, tensor_address, Module};

static FP8_SM90: Module = kernel_module!("fp8_sm90");
/// Output rows and columns of a tile, and bytes of K a stage holds (`BM`, `BN`, `BK`).
const TILE_ROWS: usize = 128;
const TILE_COLUMNS: usize = 256;
const K_BYTES: usize = 128;
const STAGES: usize = 4;
/// Rows of the output boxes each consumer warpgroup stores (its half of a tile).
const STORE_ROWS: u32 = 64;
/// The fewest inputs (K) it takes: below, a tile's few K steps leave its epilogue exposed and
/// cuBLASLt's kernel is as fast or faster (Wan 1.3B's 1,536: bench/RESULTS.md session 52).
const MIN_K: usize = 4096;
/// One producer and two consumer warpgroups.
const THREADS: u32 = 384;
/// The stages of both operands' codes, half a tile of bf16 outputs on their way out (each
/// consumer stages two 64 x 64 boxes at a time), and 1024 bytes to align the swizzled boxes:
/// 230,400 bytes, under Hopper's 232,448 a block.
const SHARED_BYTES: usize =
    STAGES * (TILE_ROWS + TILE_COLUMNS) * K_BYTES + TILE_ROWS * TILE_COLUMNS + 1024;

/// `act(x @ W^T * scales + bias)` of [`crate::models::fp8::linear`] in bf16 by the Hopper kernel,
/// or `None` where it does not run: not compute capability 9.0, less shared memory than it needs
/// (`VIDGEN_MAX_SHARED_MEMORY_PER_BLOCK` can say so), fewer than [`MIN_K`] inputs, outputs not a
/// multiple of 8 (TMA stores rows of multiples of 16 bytes), or sizes past i32.
pub fn linear(
    input: &Fp8Rows,
    weight: &Fp8Rows,
    bias: Option<&Tensor>,
    gelu: bool,
) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = input.q.device() else {
        return Ok(None);
    };
    let (rows, k_pad) = input.q.dims2()?;
    let (n_pad, n) = (weight.q.dim(0)?, weight.rows);
    let fits_i32 = [rows, n_pad, k_pad].iter().all(|&v| v < i32::MAX as usize);
    if !(dev.cuda_stream().context().compute_capability().ok() == Some((9, 0))
        && shared_memory_limit(dev).is_some_and(|limit| limit >= SHARED_BYTES)
        && k_pad >= MIN_K
        && n.is_multiple_of(8)
        && rows > 0
        && fits_i32
        && weight.q.dim(1)? == k_pad)
    {
        return Ok(None);
    }
    let bias = bias
        .map(|b| b.to_dtype(DType::BF16)?.contiguous())
        .transpose()?;
    if let Some(b) = &bias {
        if b.dims() != [n] {
            candle_core::bail!("fp8 Linear: a bias of {:?} for {n} outputs", b.dims())
        }
    }
    let func = FP8_SM90.function(dev, "fp8_linear_sm90_bf16")?;
    func.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        SHARED_BYTES as i32,
    )
    .w()?;
    // SAFETY: the kernel writes every element (each row below `rows`, each column below `n`).
    let out = unsafe { Tensor::empty((rows, n), DType::BF16, input.q.device()) }?;
    let address = |t: &Tensor| tensor_address(t, 0, dev);
    let maps = [
        TensorMap::byte_tiles(address(&input.q)?, k_pad, rows, 1, TILE_ROWS as u32)?,
        TensorMap::byte_tiles(address(&weight.q)?, k_pad, n_pad, 1, TILE_COLUMNS as u32)?,
        TensorMap::bf16_tiles(address(&out)?, n, rows, STORE_ROWS)?,
    ];
    let (scale_x, scale_w) = (address(&input.scale)?, address(&weight.scale)?);
    let bias = bias.as_ref().map(address).transpose()?.unwrap_or(0);
    let (rows32, n32) = (rows as i32, n as i32);
    let k_tiles = k_pad.div_ceil(K_BYTES) as i32;
    let gelu = i32::from(gelu);
    let tiles = rows.div_ceil(TILE_ROWS) * n.div_ceil(TILE_COLUMNS);
    let sms = dev
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    let mut builder = func.builder();
    builder.arg(&maps[0]).arg(&maps[1]).arg(&maps[2]);
    builder.arg(&scale_x).arg(&scale_w).arg(&bias);
    builder.arg(&rows32).arg(&n32).arg(&k_tiles).arg(&gelu);
    let cfg = LaunchConfig {
        // Persistent: a block per SM walks the tiles.
        grid_dim: (tiles.min(sms.max(1) as usize) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: SHARED_BYTES as u32,
    };
    // SAFETY: the arguments match the kernel's signature; the maps cover the codes (contiguous,
    // rows of `k_pad` bytes, a multiple of 16) and the `[rows, n]` bf16 output, the scales cover
    // `rows` and `n_pad` entries and the bias `n`.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(Some(out))
}
