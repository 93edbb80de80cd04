//! vidgen's own 3D convolution on CUDA (`conv3d.cu`): an implicit GEMM on the tensor cores
//! that gathers its input straight from `x` (no im2col buffer), for GPUs where cuDNN is not
//! loaded. f32 runs TF32 math, bf16 bf16 math, both accumulating in f32.

use crate::models::kernel_module::{kernel_module, shared_memory_limit, Module};
use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp2, DType, Device, Layout, Result, Shape,
    Tensor,
};

static CONV: Module = kernel_module!("conv3d");
/// Threads per block (8 warps, `THREADS` in the kernel).
const THREADS: usize = 256;
/// Output positions per block (`BN`).
const POSITIONS_PER_BLOCK: usize = 128;
/// Shared-memory row padding in bytes: A rows (weights) and B rows (gathered input).
const A_ROW_PAD_BYTES: usize = 16;
const B_ROW_PAD_ELEMS: usize = 8;
/// Bytes one K tile spans per row (`BK * sizeof(T)`: 16 f32 or 32 bf16).
const K_TILE_BYTES: usize = 64;

/// One compiled launch configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    /// Output channels per block (`BM`).
    pub channels: usize,
    /// Shared-memory pipeline stages.
    pub stages: usize,
    /// Dynamic shared memory per block, bytes.
    pub shared_bytes: usize,
}

/// The compiled configurations for `c_out` output channels, fastest first: 128-channel blocks
/// unless `c_out` leaves most of one idle; f32 four stages before two, bf16 (whose registers
/// hold one tile more in flight) two before four, as measured on an H200.
pub fn tiles(c_out: usize, dtype: DType) -> Vec<Tile> {
    let channel_order: [usize; 2] = if c_out <= 64 { [64, 128] } else { [128, 64] };
    let stage_order: [usize; 2] = if dtype == DType::BF16 { [2, 4] } else { [4, 2] };
    let elem_bytes = dtype.size_in_bytes();
    channel_order
        .into_iter()
        .flat_map(|channels| {
            stage_order.into_iter().map(move |stages| {
                let bk = K_TILE_BYTES / elem_bytes;
                let a = channels * (K_TILE_BYTES + A_ROW_PAD_BYTES);
                let b = bk * (POSITIONS_PER_BLOCK + B_ROW_PAD_ELEMS) * elem_bytes;
                Tile {
                    channels,
                    stages,
                    shared_bytes: stages * (a + b),
                }
            })
        })
        .collect()
}

/// The fastest configuration whose shared memory fits `limit` bytes per block.
pub fn tile_for(c_out: usize, dtype: DType, limit: usize) -> Option<Tile> {
    tiles(c_out, dtype)
        .into_iter()
        .find(|t| t.shared_bytes <= limit)
}

/// Whether the kernel can run on `device`: CUDA of compute capability 8.0 or newer (mma.sync
/// and cp.async).
pub fn available(device: &Device) -> bool {
    match device {
        Device::Cuda(dev) => dev
            .cuda_stream()
            .context()
            .compute_capability()
            .is_ok_and(|(major, _)| major >= 8),
        _ => false,
    }
}

/// Whether [`conv3d`] takes `dtype` with the math allowed: bf16, or f32 where TF32 is.
pub fn takes(dtype: DType, tf32: bool) -> bool {
    match dtype {
        DType::BF16 => true,
        DType::F32 => tf32,
        _ => false,
    }
}

/// Cross-correlation of `x` `[B, C_in, T, H, W]` by `w` `[C_out, C_in, kt, kh, kw]` (both f32,
/// computed in TF32, or both bf16) with `stride` and zero `padding` per (t, h, w), no bias:
/// `[B, C_out, T', H', W']`. An error where the device lacks the kernel or its shared memory.
pub fn conv3d(x: &Tensor, w: &Tensor, stride: [usize; 3], padding: [usize; 3]) -> Result<Tensor> {
    conv3d_tile(x, w, stride, padding, None)
}

/// [`conv3d`] in configuration `tile` (one of [`tiles`]), or the device's best with `None`.
pub fn conv3d_tile(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    tile: Option<Tile>,
) -> Result<Tensor> {
    if !available(x.device()) {
        bail!("conv3d kernel: needs a CUDA GPU of compute capability 8.0 or newer")
    }
    let op = Conv3d {
        stride,
        padding,
        tile,
    };
    x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &op)
}

/// The kernel's `Geometry`: sizes of input, output and kernel, stride, padding.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Geometry {
    c_in: i32,
    t_in: i32,
    h_in: i32,
    w_in: i32,
    c_out: i32,
    t_out: i32,
    h_out: i32,
    w_out: i32,
    kt: i32,
    kh: i32,
    kw: i32,
    st: i32,
    sh: i32,
    sw: i32,
    pt: i32,
    ph: i32,
    pw: i32,
    c_in_pad: i32,
    positions: i32,
}

// SAFETY: plain `repr(C)` i32 fields, laid out as the kernel's struct.
unsafe impl DeviceRepr for Geometry {}

struct Conv3d {
    stride: [usize; 3],
    padding: [usize; 3],
    /// The configuration asked for; `None`: the fastest that fits the device.
    tile: Option<Tile>,
}

impl Conv3d {
    /// The geometry of `x` by `w`, every size checked to fit the kernel's 32-bit fields.
    fn geometry(&self, x: &Layout, w: &Layout, chunk: usize) -> Result<(Geometry, Shape)> {
        let (b, c_in, t, h, wd) = x.shape().dims5()?;
        let (c_out, w_in, kt, kh, kw) = w.shape().dims5()?;
        if w_in != c_in {
            bail!("conv3d kernel: {c_in} input channels, weight for {w_in}")
        }
        let [st, sh, sw] = self.stride;
        let [pt, ph, pw] = self.padding;
        if st == 0 || sh == 0 || sw == 0 {
            bail!("conv3d kernel: zero stride {:?}", self.stride)
        }
        let out = |n: usize, k: usize, s: usize, p: usize| -> Result<usize> {
            match (n + 2 * p).checked_sub(k) {
                Some(d) => Ok(d / s + 1),
                None => bail!("conv3d kernel: input {n} + padding {p} smaller than kernel {k}"),
            }
        };
        let (t_out, h_out, w_out) = (
            out(t, kt, st, pt)?,
            out(h, kh, sh, ph)?,
            out(wd, kw, sw, pw)?,
        );
        let positions = b * t_out * h_out * w_out;
        let c_in_pad = c_in.next_multiple_of(chunk);
        let int = |v: usize| -> Result<i32> {
            i32::try_from(v)
                .map_err(|_| candle_core::Error::Msg(format!("conv3d kernel: {v} exceeds i32")))
        };
        let g = Geometry {
            c_in: int(c_in)?,
            t_in: int(t)?,
            h_in: int(h)?,
            w_in: int(wd)?,
            c_out: int(c_out)?,
            t_out: int(t_out)?,
            h_out: int(h_out)?,
            w_out: int(w_out)?,
            kt: int(kt)?,
            kh: int(kh)?,
            kw: int(kw)?,
            st: int(st)?,
            sh: int(sh)?,
            sw: int(sw)?,
            pt: int(pt)?,
            ph: int(ph)?,
            pw: int(pw)?,
            c_in_pad: int(c_in_pad)?,
            positions: int(positions)?,
        };
        // K tiles and the kernel's per-frame products stay within i32 as well.
        int(kt * kh * kw * c_in_pad)?;
        int(h_out * w_out)?;
        Ok((g, Shape::from((b, c_out, t_out, h_out, w_out))))
    }

    #[allow(clippy::too_many_arguments)]
    fn launch<T: DeviceRepr>(
        &self,
        dev: &CudaDevice,
        dtype: DType,
        x: &CudaSlice<T>,
        xl: &Layout,
        w: &CudaSlice<T>,
        wl: &Layout,
    ) -> Result<(CudaSlice<T>, Shape)> {
        if !xl.is_contiguous() || !wl.is_contiguous() {
            bail!("conv3d kernel: x and w must be contiguous")
        }
        let name = match dtype {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            other => bail!("conv3d kernel: no {other:?} kernel"),
        };
        let chunk = 16 / dtype.size_in_bytes();
        let (g, shape) = self.geometry(xl, wl, chunk)?;
        let limit = shared_memory_limit(dev).unwrap_or(0);
        let tile = match self.tile {
            Some(tile) if tile.shared_bytes <= limit => tile,
            Some(tile) => bail!("conv3d kernel: {tile:?} exceeds {limit} B of shared memory"),
            None => match tile_for(g.c_out as usize, dtype, limit) {
                Some(tile) => tile,
                None => bail!("conv3d kernel: no configuration fits {limit} B of shared memory"),
            },
        };
        let x = x.slice(xl.start_offset()..);
        let w = w.slice(wl.start_offset()..);

        // The weight as [C_out][taps][c_in_pad] (f32 rounded to TF32).
        let taps = g.kt * g.kh * g.kw;
        let packed_len = g.c_out as usize * taps as usize * g.c_in_pad as usize;
        // SAFETY: the pack kernel writes every element.
        let packed = unsafe { dev.alloc::<T>(packed_len) }?;
        let pack = CONV.function(dev, &format!("conv3d_pack_{name}"))?;
        let mut builder = pack.builder();
        builder.arg(&w).arg(&packed);
        builder
            .arg(&g.c_out)
            .arg(&g.c_in)
            .arg(&taps)
            .arg(&g.c_in_pad);
        let cfg = LaunchConfig {
            grid_dim: (packed_len.div_ceil(256).min(65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; `w` holds c_out * c_in * taps
        // elements and `packed` packed_len.
        unsafe { builder.launch(cfg) }.w()?;

        let func = CONV.function(
            dev,
            &format!("conv3d_{name}_m{}_s{}", tile.channels, tile.stages),
        )?;
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            tile.shared_bytes as i32,
        )
        .w()?;
        let out_len = shape.elem_count();
        // SAFETY: the kernel writes every output element (each channel of each position).
        let out = unsafe { dev.alloc::<T>(out_len) }?;
        let blocks = (g.c_out as usize).div_ceil(tile.channels)
            * (g.positions as usize).div_ceil(POSITIONS_PER_BLOCK);
        let Some(blocks) = u32::try_from(blocks).ok().filter(|&b| b <= i32::MAX as u32) else {
            bail!("conv3d kernel: {blocks} blocks exceed a grid")
        };
        let mut builder = func.builder();
        builder.arg(&x).arg(&packed).arg(&out).arg(&g);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: tile.shared_bytes as u32,
        };
        // SAFETY: the arguments match the kernel's signature; x and w are contiguous with the
        // geometry's sizes, and every offset the kernel forms is in bounds or zero-filled.
        unsafe { builder.launch(cfg) }.w()?;
        Ok((out, shape))
    }
}

impl CustomOp2 for Conv3d {
    fn name(&self) -> &'static str {
        "vidgen-conv3d"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("the conv3d kernel runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        use CudaStorageSlice as S;
        let dev = &x.device;
        let (slice, shape) = match (&x.slice, &w.slice) {
            (S::F32(x), S::F32(w)) => {
                let (y, shape) = self.launch(dev, DType::F32, x, xl, w, wl)?;
                (S::F32(y), shape)
            }
            (S::BF16(x), S::BF16(w)) => {
                let (y, shape) = self.launch(dev, DType::BF16, x, xl, w, wl)?;
                (S::BF16(y), shape)
            }
            _ => bail!("the conv3d kernel takes f32 or bf16 x and w of one dtype"),
        };
        let device = dev.clone();
        Ok((CudaStorage { slice, device }, shape))
    }
}
