//! vidgen's own 3D convolution on CUDA (`conv3d.cu`): an implicit GEMM on the tensor cores
//! that gathers its input straight from `x` (no im2col buffer), for GPUs where cuDNN is not
//! loaded. f32 runs TF32 math, bf16 bf16 math, both accumulating in f32.

use crate::models::kernel_module::{kernel_module, shared_memory_limit, Module};
use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{
    bail, CudaDevice, CudaStorage, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor,
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

/// How a channels-last configuration reaches its activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClKind {
    /// `conv3d_cl`: any kernel and stride; a block of positions copies each tap's activations.
    Gather,
    /// `conv3d_cl_halo`: 3x3 spatial kernels of spatial stride 1 only; a block of 16-wide rows of
    /// one output frame copies the input they read once per temporal tap and channel chunk, and
    /// its 9 spatial taps read that copy shifted.
    Halo,
    /// `conv3d_cl_narrow`: at most `channels` (<= 8) output channels, kh and kw at most 3,
    /// spatial stride 1; exact f32 on the FMA units (no TF32), a halo per temporal tap and channel
    /// chunk as [`ClKind::Halo`], each thread 8 positions by all output channels: the tensor-core
    /// tiles would leave most of their 96 channels idle.
    Narrow,
}

/// One compiled channels-last configuration (`conv3d_cl_m{positions}_n{channels}_k{k}_s{stages}_w{warps}`,
/// or `conv3d_clh_t{positions / 16}_n.._k.._s.._w..` for [`ClKind::Halo`] and
/// `conv3d_cln_t{positions / 64}_..` for [`ClKind::Narrow`], in the kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClTile {
    pub kind: ClKind,
    /// Output positions per block (`BM`; halo: 16 x `TH`; narrow: 64 x `TH`).
    pub positions: usize,
    /// Output channels per block (`BN`; narrow: the most output channels it takes).
    pub channels: usize,
    /// Input channels per K tile (`BK`).
    pub k: usize,
    /// Shared-memory pipeline stages (halo: of the weights).
    pub stages: usize,
    /// Warps per block (half of them along the positions, two along the channels).
    pub warps: usize,
}

/// Output columns of a halo block (one m16 tile per output row).
const HALO_COLUMNS: usize = 16;

/// Output columns of a narrow block (two warps of 4 x 8 positions per row).
const NARROW_COLUMNS: usize = 64;

impl ClTile {
    /// Dynamic shared memory per block, bytes, in rows of `k` + 4 floats: gather, `stages` x
    /// (activation + weight rows); halo, two input halos of (rows + 2) x 18 positions and
    /// `stages` x the weights of 3 taps. Narrow: `stages` (2) x (a halo of (rows + 2) x 67
    /// positions of `k` floats and the weights of 3 x 3 taps, `channels` x `k` floats each).
    pub fn shared_bytes(&self) -> usize {
        if self.kind == ClKind::Narrow {
            let halo = (self.positions / NARROW_COLUMNS + 2) * (NARROW_COLUMNS + 3);
            return self.stages * (halo + 9 * self.channels) * self.k * 4;
        }
        let rows = match self.kind {
            ClKind::Gather => self.stages * (self.positions + self.channels),
            ClKind::Halo => {
                let halo = (self.positions / HALO_COLUMNS + 2) * (HALO_COLUMNS + 2);
                2 * halo + self.stages * 3 * self.channels
            }
            ClKind::Narrow => unreachable!("returned above"),
        };
        rows * (self.k + 4) * 4
    }

    /// Whether the configuration computes `c_out` output channels of a `kernel` (kt, kh, kw) of
    /// `stride`.
    pub fn takes(&self, c_out: usize, kernel: [usize; 3], stride: [usize; 3]) -> bool {
        match self.kind {
            ClKind::Gather => true,
            ClKind::Halo => kernel[1..] == [3, 3] && stride[1..] == [1, 1],
            ClKind::Narrow => {
                c_out <= self.channels && kernel[1] <= 3 && kernel[2] <= 3 && stride[1..] == [1, 1]
            }
        }
    }

    fn name(&self) -> String {
        let (prefix, m) = match self.kind {
            ClKind::Gather => ("conv3d_cl_m", self.positions),
            ClKind::Halo => ("conv3d_clh_t", self.positions / HALO_COLUMNS),
            ClKind::Narrow => ("conv3d_cln_t", self.positions / NARROW_COLUMNS),
        };
        format!(
            "{prefix}{m}_n{}_k{}_s{}_w{}",
            self.channels, self.k, self.stages, self.warps
        )
    }

    /// Blocks for output `[B, T', H', W', C_out]`.
    fn blocks(&self, out: [usize; 5]) -> usize {
        let [b, t, h, w, c_out] = out;
        let channel_tiles = c_out.div_ceil(self.channels);
        match self.kind {
            ClKind::Gather => channel_tiles * (b * t * h * w).div_ceil(self.positions),
            ClKind::Halo => {
                let rows = self.positions / HALO_COLUMNS;
                channel_tiles * w.div_ceil(HALO_COLUMNS) * h.div_ceil(rows) * b * t
            }
            ClKind::Narrow => {
                let rows = self.positions / NARROW_COLUMNS;
                w.div_ceil(NARROW_COLUMNS) * h.div_ceil(rows) * b * t
            }
        }
    }
}

/// The compiled channels-last configurations (ptxas: no spills for sm_80/90/120 but 4-16 bytes
/// in the 128-channel gather tile on sm_90/120). All fit GB10's 99 KB of shared memory per block.
///
/// Halo first, 64 x 48 warp tiles (186-230 registers): 256 positions (16 x 16) with 8 warps, one
/// block per SM, K chunks of 16 channels and 2 weight stages (96 KB: the weights of one K tile in
/// flight) or of 8 and 4 (84 KB); 128 positions (8 x 16) with 4 warps, two blocks per SM where
/// shared memory allows (96 KB each, H100/H200), which read the weights twice as often. On the
/// H200 at the Wan decoder's 96-channel full-resolution shapes (bench/RESULTS.md, session 15)
/// the first ran 6.66 / 11.05 ms (96 / 192 input channels), the second 7.41 / 12.54, the third
/// 6.95 / 11.49, gather's best 7.12 / 12.57, cuDNN 6.89 / 12.56; with the residual's loads
/// batched in the store, the first 6.07 / 10.53.
///
/// Gather: the 8-warp 128-position tiles (32 x 48 or 32 x 64 warp tiles, at most 128 registers)
/// run two blocks per SM where shared memory allows (H100/H200: 2 x 97 KB with K tiles of 32
/// channels; 2 x 70 KB with 16, which leaves more L1 for the activations' reuse); the 64 x 48 warp
/// tiles (BM 256 with 8 warps, BM 128 with 4) read less shared memory per product but hold
/// 166-188 registers.
///
/// Narrow (exact f32, 146-221 registers): for 1, 2, 3, 4 and 8 output channels each, 8 x 64
/// positions with 2 warps (45-47 KB: four blocks per SM on H100/H200) and 16 x 64 with 4 (79-82
/// KB, two), K chunks of 8 channels (one 32-byte sector per position) double buffered. At the
/// Wan head's shape on the H200 (session 15): 1.15 / 1.20 ms with 3 channels, 1.21 / 1.27 with 4,
/// where cuDNN took ~2 ms and converted its input for 0.6 ms more. Where
/// C_out is at most 8 a 96-channel tensor-core tile leaves at least 88 of its channels idle
/// (cuDNN's 32-wide ones 24): the Wan decoder's 3-channel head.
const CL_TILES: [ClTile; 18] = [
    cl_tile(ClKind::Narrow, 512, 1, 8, 2, 2),
    cl_tile(ClKind::Narrow, 1024, 1, 8, 2, 4),
    cl_tile(ClKind::Narrow, 512, 2, 8, 2, 2),
    cl_tile(ClKind::Narrow, 1024, 2, 8, 2, 4),
    cl_tile(ClKind::Narrow, 512, 3, 8, 2, 2),
    cl_tile(ClKind::Narrow, 1024, 3, 8, 2, 4),
    cl_tile(ClKind::Narrow, 512, 4, 8, 2, 2),
    cl_tile(ClKind::Narrow, 1024, 4, 8, 2, 4),
    cl_tile(ClKind::Narrow, 512, 8, 8, 2, 2),
    cl_tile(ClKind::Narrow, 1024, 8, 8, 2, 4),
    cl_tile(ClKind::Halo, 256, 96, 16, 2, 8),
    cl_tile(ClKind::Halo, 256, 96, 8, 4, 8),
    cl_tile(ClKind::Halo, 128, 96, 16, 3, 4),
    cl_tile(ClKind::Gather, 128, 96, 32, 3, 8),
    cl_tile(ClKind::Gather, 128, 96, 16, 4, 8),
    cl_tile(ClKind::Gather, 256, 96, 16, 3, 8),
    cl_tile(ClKind::Gather, 128, 96, 16, 4, 4),
    cl_tile(ClKind::Gather, 128, 128, 16, 4, 8),
];

const fn cl_tile(
    kind: ClKind,
    positions: usize,
    channels: usize,
    k: usize,
    stages: usize,
    warps: usize,
) -> ClTile {
    ClTile {
        kind,
        positions,
        channels,
        k,
        stages,
        warps,
    }
}

/// The most positions a channels-last block covers.
const MAX_BLOCK_POSITIONS: usize = 256;

/// The most taps a channels-last kernel takes (a bit mask per position says which are inside
/// `x`).
const MAX_CL_TAPS: usize = 32;

/// The channels-last configurations that compute a `kernel` (kt, kh, kw) of `stride` with `c_out`
/// output channels, the likely fastest first: the channel tiles that leave the fewest output
/// channels idle, in `CL_TILES`' order (gather measured on the H200 at the Wan decoder's shapes,
/// bench/RESULTS.md session 14: its first was the fastest or within 3% of it at 96, 192 and 384
/// output channels, where the 128-channel tile, fewer blocks at 384, ran 6% slower; halo, with
/// a quarter of gather's L2 traffic, ran 6-23% faster than gather's best at every one of those
/// shapes, session 15). Narrow configurations, offered only for at most 8 output channels, come
/// first there (the fewest idle channels: the compiled count nearest above C_out).
pub fn channels_last_tiles(c_out: usize, kernel: [usize; 3], stride: [usize; 3]) -> Vec<ClTile> {
    let mut tiles: Vec<ClTile> = CL_TILES
        .into_iter()
        .filter(|t| t.takes(c_out, kernel, stride))
        .collect();
    tiles.sort_by_key(|t| c_out.div_ceil(t.channels) * t.channels - c_out);
    tiles
}

/// Whether [`conv3d_channels_last`] computes `x` by `w` with this `stride` and `padding`: f32 on
/// a CUDA GPU of compute capability 8.0+ with `tf32` allowed (the tensor-core configurations
/// compute in TF32), or without it where a narrow configuration (exact f32) takes the shape;
/// input channels a multiple of 4 (16-byte copies), at most 32 taps, sizes within its 32-bit
/// fields, and a configuration within the device's shared memory. `x` need not be contiguous
/// (it is copied then).
pub fn takes_channels_last(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    tf32: bool,
) -> bool {
    first_fitting(x, w, stride, padding, tf32).is_some()
}

/// Whether the own channels-last kernel is the one to run even with cuDNN loaded: a narrow
/// configuration takes the shape (at most 8 output channels, which idle most of cuDNN's
/// tensor-core tiles; the Wan decoder's 3-channel head), or a halo configuration takes it and
/// one block covers every output channel with at most a quarter of its channels idle (cuDNN's
/// 32-wide channel tiles then gather each activation several times; the Wan decoder's
/// 96-channel full-resolution convolutions, bench/RESULTS.md session 15). Gather takes a 2x2
/// spatial kernel of one frame with at most [`GATHER_2X2_MAX_C_IN`] input channels: there
/// cuDNN's channels-last path ran at 37 TFLOP/s through a channels-first output and its
/// transposition (the Wan decoder's last upsampler, 192 channels at 240x416: 6.4 ms, gather
/// 3.3; with 384 input channels cuDNN's own channels-last kernels led, session 16).
pub fn outruns_cudnn(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    tf32: bool,
) -> bool {
    first_fitting(x, w, stride, padding, tf32)
        .zip(w.dims().first())
        .is_some_and(|(t, &c_out)| match t.kind {
            ClKind::Narrow => true,
            ClKind::Halo => c_out <= t.channels && 4 * (t.channels - c_out) <= t.channels,
            ClKind::Gather => {
                let (_, kt, kh, kw, c_in) = w.dims5().unwrap_or_default();
                (kt, kh, kw) == (1, 2, 2) && c_in <= GATHER_2X2_MAX_C_IN
            }
        })
}

/// The most input channels of a 2x2 kernel that the gather kernel takes from cuDNN
/// ([`outruns_cudnn`]).
const GATHER_2X2_MAX_C_IN: usize = 192;

/// The first configuration (in [`channels_last_tiles`]' order) that computes the shape within
/// the device's shared memory, under the conditions [`takes_channels_last`] names (without
/// `tf32` only the exact narrow ones).
fn first_fitting(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    tf32: bool,
) -> Option<ClTile> {
    let Device::Cuda(dev) = x.device() else {
        return None;
    };
    if x.dtype() != DType::F32 || w.dtype() != DType::F32 || !available(x.device()) {
        return None;
    }
    let (Ok(xd), Ok(wd)) = (x.dims5(), w.dims5()) else {
        return None;
    };
    cl_geometry(xd.into(), wd.into(), stride, padding).ok()?;
    let (c_out, kt, kh, kw, _) = wd;
    let limit = shared_memory_limit(dev).unwrap_or(0);
    channels_last_tiles(c_out, [kt, kh, kw], stride)
        .into_iter()
        .find(|t| (tf32 || t.kind == ClKind::Narrow) && t.shared_bytes() <= limit)
}

/// Cross-correlation of `x` `[B, T, H, W, C_in]` by `w` `[C_out, kt, kh, kw, C_in]` (f32,
/// computed in TF32, or exact by a narrow configuration) with `stride` and zero `padding` per (t, h, w), no bias:
/// `[B, T', H', W', C_out]`. An error where [`takes_channels_last`] would say no.
pub fn conv3d_channels_last(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
) -> Result<Tensor> {
    conv3d_channels_last_with(x, w, stride, padding, None, None)
}

/// [`conv3d_channels_last`] plus `bias` (f32 `[C_out]`) and `residual` (f32 of the output's dims
/// `[B, T', H', W', C_out]`), each where given, added as the kernel stores the output: the same
/// bits as `(y.broadcast_add(bias)? + residual)?` without a pass that reads and writes y again.
/// A wrong dtype, shape or device of either is an error.
pub fn conv3d_channels_last_with(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    channels_last(x, w, stride, padding, Store::Plain(None), bias, residual)
}

/// The four 2x2 parities of an upsampler (nearest x2 then a 3x3 convolution of each frame,
/// computed as four 2x2 kernels on the frame: `w` `[4 C, kt, kh, kw, C_in]`, parity `2a + b`
/// first, C even) stored interleaved: `[B, T', 2 (H' - 1), 2 (W' - 1), C]`, where parity `p` at
/// position `(i, j)` of the convolution's `H' x W'` grid is output pixel `(2i - a, 2j - b)`,
/// plus `bias` (f32 `[C]`) where given. The same bits as [`conv3d_channels_last`] (in the same
/// configuration) then that interleaving and bias pass, without writing the grid. Gather
/// configurations only (TF32); an error where none takes the shape.
pub fn conv3d_channels_last_parities(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    channels_last(x, w, stride, padding, Store::Parities, bias, None)
}

/// [`conv3d_channels_last`] in configuration `tile` (one of [`channels_last_tiles`]; an error
/// where it does not take the kernel or stride), or the device's best with `None`.
pub fn conv3d_channels_last_tile(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    tile: Option<ClTile>,
) -> Result<Tensor> {
    channels_last(x, w, stride, padding, Store::Plain(tile), None, None)
}

/// How a channels-last kernel stores its output.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Store {
    /// As computed, `[B, T', H', W', C_out]`, in configuration `tile` (`None`: the device's best).
    Plain(Option<ClTile>),
    /// The 2x2 parities interleaved ([`conv3d_channels_last_parities`]), by the device's best
    /// gather configuration.
    Parities,
}

/// [`conv3d_channels_last_with`] stored as `store` says.
fn channels_last(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    store: Store,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    if !available(x.device()) {
        bail!("conv3d kernel: needs a CUDA GPU of compute capability 8.0 or newer")
    }
    let (_, grid) = cl_geometry(x.dims5()?.into(), w.dims5()?.into(), stride, padding)?;
    let out = store.dims(grid)?;
    let operand = |what: &str, t: Option<&Tensor>, dims: &[usize]| -> Result<Option<Tensor>> {
        let Some(t) = t else { return Ok(None) };
        if t.dtype() != DType::F32 {
            bail!("conv3d kernel: {what} must be f32, not {:?}", t.dtype())
        }
        if t.dims() != dims {
            bail!("conv3d kernel: {what} of dims {:?}, not {dims:?}", t.dims())
        }
        if !t.device().same_device(x.device()) {
            bail!("conv3d kernel: {what} is not on x's device")
        }
        // Contiguous and 16-byte aligned: the kernel reads channel pairs as float2.
        super::aligned(t).map(Some)
    };
    if store == Store::Parities && residual.is_some() {
        bail!("conv3d kernel: the interleaved parities take no residual")
    }
    let op = Conv3dCl {
        stride,
        padding,
        store,
        bias: operand("bias", bias, &out[4..])?,
        residual: operand("residual", residual, &out)?,
    };
    super::aligned(x)?.apply_op2_no_bwd(&super::aligned(w)?, &op)
}

/// The channels-last geometry of `x` `[B, T, H, W, C_in]` by `w` `[C_out, kt, kh, kw, C_in]`
/// (the weight's channels per tap: C_in itself), and the output's dims `[B, T', H', W', C_out]`.
fn cl_geometry(
    x: [usize; 5],
    w: [usize; 5],
    stride: [usize; 3],
    padding: [usize; 3],
) -> Result<(Geometry, [usize; 5])> {
    let [b, t, h, wd, c_in] = x;
    let [c_out, kt, kh, kw, w_in] = w;
    if !c_in.is_multiple_of(4) {
        bail!("conv3d kernel: channels last needs input channels in fours, not {c_in}")
    }
    if kt * kh * kw > MAX_CL_TAPS {
        bail!("conv3d kernel: channels last takes at most {MAX_CL_TAPS} taps, not {kt}x{kh}x{kw}")
    }
    // The narrow kernel indexes an input frame's positions in 32 bits.
    if i32::try_from(h * wd).is_err() {
        bail!("conv3d kernel: a {h}x{wd} frame exceeds i32 positions")
    }
    let (g, [b, c_out, t_out, h_out, w_out]) = geometry(
        [b, c_in, t, h, wd],
        [c_out, w_in, kt, kh, kw],
        stride,
        padding,
        1,
    )?;
    Ok((g, [b, t_out, h_out, w_out, c_out]))
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

/// The geometry of `x` `[B, C_in, T, H, W]` by `w` `[C_out, C_in, kt, kh, kw]` (the weight's
/// channels per tap rounded up to `chunk`), every size checked to fit the kernels' 32-bit fields,
/// and the output's dims `[B, C_out, T', H', W']`.
fn geometry(
    x: [usize; 5],
    w: [usize; 5],
    stride: [usize; 3],
    padding: [usize; 3],
    chunk: usize,
) -> Result<(Geometry, [usize; 5])> {
    let [b, c_in, t, h, wd] = x;
    let [c_out, w_in, kt, kh, kw] = w;
    if w_in != c_in {
        bail!("conv3d kernel: {c_in} input channels, weight for {w_in}")
    }
    let [st, sh, sw] = stride;
    let [pt, ph, pw] = padding;
    if st == 0 || sh == 0 || sw == 0 {
        bail!("conv3d kernel: zero stride {stride:?}")
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
    // K tiles, the kernels' per-frame products and the last block's positions stay within i32
    // as well.
    int(kt * kh * kw * c_in_pad)?;
    int(h_out * w_out)?;
    int(positions + MAX_BLOCK_POSITIONS)?;
    Ok((g, [b, c_out, t_out, h_out, w_out]))
}

impl Conv3d {
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
        let dims = |l: &Layout| -> Result<[usize; 5]> {
            let (a, b, c, d, e) = l.shape().dims5()?;
            Ok([a, b, c, d, e])
        };
        let (g, out_dims) = geometry(dims(xl)?, dims(wl)?, self.stride, self.padding, chunk)?;
        let shape = Shape::from(out_dims.to_vec());
        let tile = fitting(dev, self.tile, tiles(g.c_out as usize, dtype), |t| {
            t.shared_bytes
        })?;
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

        let name = format!("conv3d_{name}_m{}_s{}", tile.channels, tile.stages);
        let grid = Grid {
            blocks: (g.c_out as usize).div_ceil(tile.channels)
                * (g.positions as usize).div_ceil(POSITIONS_PER_BLOCK),
            threads: THREADS,
            shared_bytes: tile.shared_bytes,
        };
        let out = run(
            dev,
            &name,
            grid,
            &x,
            &packed.slice(..),
            None,
            &g,
            shape.elem_count(),
        )?;
        Ok((out, shape))
    }
}

/// A convolution kernel's launch: blocks, threads per block, dynamic shared memory per block.
struct Grid {
    blocks: usize,
    threads: usize,
    shared_bytes: usize,
}

/// The configuration asked for where it fits the device's shared memory per block (an error
/// where it does not), or without one the first of `tiles` (fastest first) that fits.
fn fitting<T: Copy + std::fmt::Debug>(
    dev: &CudaDevice,
    asked: Option<T>,
    tiles: Vec<T>,
    bytes: impl Fn(&T) -> usize,
) -> Result<T> {
    let limit = shared_memory_limit(dev).unwrap_or(0);
    match asked {
        Some(tile) if bytes(&tile) <= limit => Ok(tile),
        Some(tile) => bail!("conv3d kernel: {tile:?} exceeds {limit} B of shared memory"),
        None => match tiles.into_iter().find(|t| bytes(t) <= limit) {
            Some(tile) => Ok(tile),
            None => bail!("conv3d kernel: no configuration fits {limit} B of shared memory"),
        },
    }
}

/// What a channels-last kernel adds to its output (`None`: a null pointer, nothing).
struct Epilogue<'a> {
    /// `[C_out]`.
    bias: Option<CudaView<'a, f32>>,
    /// Laid out as the output.
    residual: Option<CudaView<'a, f32>>,
    /// The kernels' `parity_channels` (0: the output as computed).
    parity_channels: i32,
}

/// Runs the convolution kernel `name` over `grid` on (x, w, a fresh output of `out_len`
/// elements, the `epilogue`'s bias and residual where the kernel takes them (channels last), g)
/// and returns the output.
#[allow(clippy::too_many_arguments)]
fn run<T: DeviceRepr>(
    dev: &CudaDevice,
    name: &str,
    grid: Grid,
    x: &CudaView<T>,
    w: &CudaView<T>,
    epilogue: Option<&Epilogue>,
    g: &Geometry,
    out_len: usize,
) -> Result<CudaSlice<T>> {
    let func = CONV.function(dev, name)?;
    func.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        grid.shared_bytes as i32,
    )
    .w()?;
    // SAFETY: the kernel writes every output element (each channel of each position).
    let out = unsafe { dev.alloc::<T>(out_len) }?;
    let blocks = grid.blocks;
    let Some(blocks) = u32::try_from(blocks).ok().filter(|&b| b <= i32::MAX as u32) else {
        bail!("conv3d kernel: {blocks} blocks exceed a grid")
    };
    let mut builder = func.builder();
    builder.arg(x).arg(w).arg(&out);
    if let Some(epilogue) = epilogue {
        for operand in [&epilogue.bias, &epilogue.residual] {
            match operand {
                Some(view) => builder.arg(view),
                None => builder.arg(&0u64),
            };
        }
        builder.arg(&epilogue.parity_channels);
    }
    builder.arg(g);
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (grid.threads as u32, 1, 1),
        shared_mem_bytes: grid.shared_bytes as u32,
    };
    // SAFETY: the arguments match the kernels' signature (x, w, y, [bias, residual,
    // parity_channels,] geometry);
    // the callers checked x and w against the geometry's sizes (contiguous, and 16-byte aligned
    // where a kernel copies 16 bytes), bias (C_out) and residual (out_len, contiguous and
    // aligned), and every offset the kernels form is in bounds or zero-filled.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(out)
}

impl CustomOp2 for Conv3d {
    fn name(&self) -> &'static str {
        "vidgen-conv3d"
    }

    crate::models::kernel_module::cuda_only_cpu_fwd!(a a_layout, b b_layout);

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

impl Store {
    /// The output's dims given the convolution's `[B, T', H', W', C_out]`.
    fn dims(self, [b, t, h, w, c_out]: [usize; 5]) -> Result<[usize; 5]> {
        match self {
            Store::Plain(_) => Ok([b, t, h, w, c_out]),
            Store::Parities => {
                let c = c_out / 4;
                if c_out % 8 != 0 || h == 0 || w == 0 {
                    bail!(
                        "conv3d kernel: interleaved parities need 4 x an even number of output \
                         channels and a non-empty grid, not {c_out} over {h}x{w}"
                    )
                }
                Ok([b, t, 2 * (h - 1), 2 * (w - 1), c])
            }
        }
    }

    /// The `parity_channels` kernel argument (0: a plain store).
    fn parity_channels(self, c_out: usize) -> i32 {
        match self {
            Store::Plain(_) => 0,
            Store::Parities => (c_out / 4) as i32,
        }
    }
}

struct Conv3dCl {
    stride: [usize; 3],
    padding: [usize; 3],
    store: Store,
    /// Added to the output as it is stored (checked f32 of C_out or of the output's dims, on the
    /// device, contiguous and aligned): carried here, a CustomOp2 taking two tensors.
    bias: Option<Tensor>,
    residual: Option<Tensor>,
}

impl Conv3dCl {
    fn launch(
        &self,
        dev: &CudaDevice,
        x: &CudaSlice<f32>,
        xl: &Layout,
        w: &CudaSlice<f32>,
        wl: &Layout,
    ) -> Result<(CudaSlice<f32>, Shape)> {
        if !xl.is_contiguous() || !wl.is_contiguous() {
            bail!("conv3d kernel: x and w must be contiguous")
        }
        // 16-byte copies from every channel chunk: C_in % 4 == 0 and 16-byte aligned starts.
        if !xl.start_offset().is_multiple_of(4) || !wl.start_offset().is_multiple_of(4) {
            bail!("conv3d kernel: channels last needs x and w on 16-byte boundaries")
        }
        let dims = |l: &Layout| -> Result<[usize; 5]> { Ok(l.shape().dims5()?.into()) };
        let [c_out, kt, kh, kw, _] = dims(wl)?;
        let (g, grid_dims) = cl_geometry(dims(xl)?, dims(wl)?, self.stride, self.padding)?;
        let out_dims = self.store.dims(grid_dims)?;
        let mut tiles = channels_last_tiles(c_out, [kt, kh, kw], self.stride);
        let asked = match self.store {
            Store::Plain(tile) => tile,
            Store::Parities => {
                // Only conv3d_cl interleaves parities as it stores.
                tiles.retain(|t| t.kind == ClKind::Gather);
                None
            }
        };
        let tile = fitting(dev, asked, tiles, ClTile::shared_bytes)?;
        if !CL_TILES.contains(&tile) {
            bail!("conv3d kernel: {tile:?} is not compiled")
        }
        if !tile.takes(c_out, [kt, kh, kw], self.stride) {
            bail!(
                "conv3d kernel: {tile:?} does not take {c_out} output channels of a {kt}x{kh}x{kw} \
                 kernel of stride {:?}",
                self.stride
            )
        }
        let x = x.slice(xl.start_offset()..);
        let w = w.slice(wl.start_offset()..);
        let shape = Shape::from(out_dims.to_vec());
        let grid = Grid {
            blocks: tile.blocks(grid_dims),
            threads: 32 * tile.warps,
            shared_bytes: tile.shared_bytes(),
        };
        // Read locks on the epilogue's storage, held through the launch.
        let bias = self.bias.as_ref().map(Tensor::storage_and_layout);
        let residual = self.residual.as_ref().map(Tensor::storage_and_layout);
        let epilogue = Epilogue {
            bias: bias.as_ref().map(|(s, l)| f32_view(s, l)).transpose()?,
            residual: residual.as_ref().map(|(s, l)| f32_view(s, l)).transpose()?,
            parity_channels: self.store.parity_channels(c_out),
        };
        let out = run(
            dev,
            &tile.name(),
            grid,
            &x,
            &w,
            Some(&epilogue),
            &g,
            shape.elem_count(),
        )?;
        Ok((out, shape))
    }
}

/// An f32 CUDA tensor's storage from its first element.
fn f32_view<'a>(storage: &'a Storage, layout: &Layout) -> Result<CudaView<'a, f32>> {
    let Storage::Cuda(s) = storage else {
        bail!("conv3d kernel: an epilogue operand is not on CUDA")
    };
    Ok(s.as_cuda_slice::<f32>()?.slice(layout.start_offset()..))
}

impl CustomOp2 for Conv3dCl {
    fn name(&self) -> &'static str {
        "vidgen-conv3d-channels-last"
    }

    crate::models::kernel_module::cuda_only_cpu_fwd!(a a_layout, b b_layout);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (CudaStorageSlice::F32(xs), CudaStorageSlice::F32(ws)) = (&x.slice, &w.slice) else {
            bail!("the channels-last conv3d kernel takes f32 x and w")
        };
        let (y, shape) = self.launch(&x.device, xs, xl, ws, wl)?;
        let device = x.device.clone();
        Ok((
            CudaStorage {
                slice: CudaStorageSlice::F32(y),
                device,
            },
            shape,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GPU, where the kernels run on it.
    fn device() -> Option<Device> {
        let dev = Device::new_cuda(0).ok().filter(available);
        if dev.is_none() {
            eprintln!(
                "no CUDA device of compute capability 8.0+: channels-last kernel test skipped"
            );
        }
        dev
    }

    /// The exact outputs of a convolution and, per output, sum |w||x|.
    type Exact = (Vec<f64>, Vec<f64>);

    /// The exact convolution of channels-last `x` by `w` (f64 on the CPU, of the f32 values as
    /// they are) and, per output, sum |w||x|, which bounds TF32's rounding error.
    fn exact(x: &Tensor, w: &Tensor, stride: [usize; 3], padding: [usize; 3]) -> Result<Exact> {
        let [b, t, h, wd, c_in] = x.dims5()?.into();
        let [c_out, kt, kh, kw, _] = w.dims5()?.into();
        let (_, [_, t_out, h_out, w_out, _]) =
            cl_geometry(x.dims5()?.into(), w.dims5()?.into(), stride, padding)?;
        let xv = x.flatten_all()?.to_vec1::<f32>()?;
        let wv = w.flatten_all()?.to_vec1::<f32>()?;
        let at = |o: usize, k: usize, d: usize| (o * stride[d] + k).checked_sub(padding[d]);
        let (mut sum, mut magnitude) = (Vec::new(), Vec::new());
        for bi in 0..b {
            for to in 0..t_out {
                for ho in 0..h_out {
                    for wo in 0..w_out {
                        for n in 0..c_out {
                            let (mut s, mut m) = (0f64, 0f64);
                            for dt in 0..kt {
                                for dh in 0..kh {
                                    for dw in 0..kw {
                                        let (Some(ti), Some(hi), Some(wi)) =
                                            (at(to, dt, 0), at(ho, dh, 1), at(wo, dw, 2))
                                        else {
                                            continue;
                                        };
                                        if ti >= t || hi >= h || wi >= wd {
                                            continue;
                                        }
                                        let xo = (((bi * t + ti) * h + hi) * wd + wi) * c_in;
                                        let wo = (((n * kt + dt) * kh + dh) * kw + dw) * c_in;
                                        for (&a, &c) in
                                            xv[xo..xo + c_in].iter().zip(&wv[wo..wo + c_in])
                                        {
                                            let p = a as f64 * c as f64;
                                            s += p;
                                            m += p.abs();
                                        }
                                    }
                                }
                            }
                            sum.push(s);
                            magnitude.push(m);
                        }
                    }
                }
            }
        }
        Ok((sum, magnitude))
    }

    /// Max over outputs of |`got` - exact| / sum |w||x|.
    fn error_per_magnitude(got: &Tensor, exact: &Exact) -> Result<f64> {
        let got = got.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(got.len(), exact.0.len());
        Ok(got
            .iter()
            .zip(exact.0.iter().zip(&exact.1))
            .map(|(&g, (&e, &m))| (g as f64 - e).abs() / (m + 1e-30))
            .fold(0.0, f64::max))
    }

    /// (x dims `[B, T, H, W, C_in]`, w dims `[C_out, kt, kh, kw, C_in]`, stride, padding).
    type Case = ([usize; 5], [usize; 5], [usize; 3], [usize; 3]);

    /// The GPU (where the kernels run on it) and its shared-memory limit per block.
    fn device_and_limit() -> Option<(Device, usize)> {
        let dev = device()?;
        let Device::Cuda(cuda) = &dev else {
            unreachable!("a CUDA device")
        };
        let limit = shared_memory_limit(cuda).unwrap_or(0);
        Some((dev, limit))
    }

    /// A case's x and w, drawn on the CPU and moved to `dev`, and their exact convolution.
    fn drawn(dev: &Device, (xd, wd, stride, padding): Case) -> Result<(Tensor, Tensor, Exact)> {
        let x = Tensor::randn(0f32, 1f32, &xd[..], &Device::Cpu)?;
        let w = Tensor::randn(0f32, 1f32, &wd[..], &Device::Cpu)?;
        let reference = exact(&x, &w, stride, padding)?;
        Ok((x.to_device(dev)?, w.to_device(dev)?, reference))
    }

    /// Asserts `y` within `tolerance` of sum |w||x| of the exact convolution.
    fn assert_near(y: &Tensor, reference: &Exact, tolerance: f64, what: &str) -> Result<()> {
        let err = error_per_magnitude(&y.to_device(&Device::Cpu)?, reference)?;
        assert!(err < tolerance, "{what}: {err:.2e}");
        Ok(())
    }
    /// The decoder's kinds of convolution at small sizes: 3x3x3 with spatial padding (batch 2,
    /// odd sizes, C_in 32 / 96 / 192, C_out 96 / 128), temporal padding, a 1x1x1 shortcut, a
    /// 3x1x1 temporal conv, a 1x2x2 kernel with padding 1 (H + 1 x W + 1 outputs) and output
    /// channels no tile divides, input channels not a whole K tile, spatial stride 2.
    const CASES: [Case; 7] = [
        ([2, 4, 7, 9, 32], [96, 3, 3, 3, 32], [1, 1, 1], [0, 1, 1]),
        ([1, 4, 17, 33, 96], [96, 3, 3, 3, 96], [1, 1, 1], [0, 1, 1]),
        (
            [1, 3, 9, 12, 192],
            [128, 3, 3, 3, 192],
            [1, 1, 1],
            [1, 1, 1],
        ),
        ([2, 5, 7, 9, 96], [192, 1, 1, 1, 96], [1, 1, 1], [0, 0, 0]),
        ([1, 6, 8, 10, 32], [96, 3, 1, 1, 32], [1, 1, 1], [1, 0, 0]),
        ([1, 2, 7, 9, 96], [40, 1, 2, 2, 96], [1, 1, 1], [0, 1, 1]),
        ([1, 3, 11, 13, 20], [100, 3, 3, 3, 20], [1, 2, 2], [1, 1, 1]),
    ];

    /// Every compiled configuration (and the default) within TF32's rounding of the exact
    /// convolution: each product's operands are rounded to 10 mantissa bits, so an output is off
    /// by at most about 2^-10 of sum |w||x|.
    #[test]
    fn channels_last_kernel_matches_exact_convolution() -> Result<()> {
        let Some((dev, limit)) = device_and_limit() else {
            return Ok(());
        };
        for case in CASES {
            let (xd, wd, stride, padding) = case;
            let (x, w, reference) = drawn(&dev, case)?;
            assert!(takes_channels_last(&x, &w, stride, padding, true));
            let y = conv3d_channels_last(&x, &w, stride, padding)?;
            assert_near(&y, &reference, 1e-3, &format!("{xd:?} by {wd:?}"))?;
            for tile in channels_last_tiles(wd[0], [wd[1], wd[2], wd[3]], stride) {
                if tile.shared_bytes() > limit {
                    continue;
                }
                let y = conv3d_channels_last_tile(&x, &w, stride, padding, Some(tile))?;
                assert_near(&y, &reference, 1e-3, &format!("{xd:?} by {wd:?}, {tile:?}"))?;
            }
        }
        // A strided x (channels first in memory) is copied first.
        let (xd, wd, stride, padding) = CASES[0];
        let [b, t, h, wid, c] = xd;
        let x =
            Tensor::randn(0f32, 1f32, (b, c, t, h, wid), &Device::Cpu)?.permute((0, 2, 3, 4, 1))?;
        let w = Tensor::randn(0f32, 1f32, &wd[..], &Device::Cpu)?;
        let reference = exact(&x.contiguous()?, &w, stride, padding)?;
        let y = conv3d_channels_last(&x.to_device(&dev)?, &w.to_device(&dev)?, stride, padding)?;
        assert_near(&y, &reference, 1e-3, "strided x")?;
        Ok(())
    }

    /// The halo kernels' cases (3x3 spatial taps, spatial stride 1): the Wan decoder's
    /// full-resolution convolutions at reduced size (rows and columns of partial tiles), batch 2
    /// with no padding, C_in 4 and C_out 20; C_in 8, kt 2 of temporal stride 2 and C_out 101 (two
    /// channel tiles, odd); C_in 36 (a partial K chunk) with spatial padding 2 and 0; kt 1.
    const HALO_CASES: [Case; 6] = [
        ([1, 4, 19, 35, 96], [96, 3, 3, 3, 96], [1, 1, 1], [0, 1, 1]),
        (
            [1, 3, 18, 34, 192],
            [96, 3, 3, 3, 192],
            [1, 1, 1],
            [0, 1, 1],
        ),
        ([2, 3, 9, 21, 4], [20, 3, 3, 3, 4], [1, 1, 1], [0, 0, 0]),
        ([1, 5, 10, 17, 8], [101, 2, 3, 3, 8], [2, 1, 1], [1, 1, 1]),
        ([1, 3, 20, 18, 36], [96, 3, 3, 3, 36], [1, 1, 1], [0, 2, 0]),
        ([1, 1, 9, 40, 16], [96, 1, 3, 3, 16], [1, 1, 1], [0, 1, 1]),
    ];

    /// Every halo configuration that fits the device within TF32's rounding of the exact
    /// convolution at [`HALO_CASES`], and the default configuration a halo one at the decoder's
    /// 96-channel shapes.
    #[test]
    fn channels_last_halo_kernel_matches_exact_convolution() -> Result<()> {
        let Some((dev, limit)) = device_and_limit() else {
            return Ok(());
        };
        let halo: Vec<ClTile> = CL_TILES
            .into_iter()
            .filter(|t| t.kind == ClKind::Halo && t.shared_bytes() <= limit)
            .collect();
        assert!(!halo.is_empty(), "no halo configuration fits {limit} B");
        for case in HALO_CASES {
            let (xd, wd, stride, padding) = case;
            let (x, w, reference) = drawn(&dev, case)?;
            let tiles = channels_last_tiles(wd[0], [wd[1], wd[2], wd[3]], stride);
            for &tile in &halo {
                assert!(tiles.contains(&tile), "{wd:?}: {tile:?} not offered");
                let y = conv3d_channels_last_tile(&x, &w, stride, padding, Some(tile))?;
                assert_near(&y, &reference, 1e-3, &format!("{xd:?} by {wd:?}, {tile:?}"))?;
            }
            if wd[0] == 96 {
                assert_eq!(tiles[0].kind, ClKind::Halo, "{wd:?}: {tiles:?}");
            }
        }
        Ok(())
    }

    /// The narrow kernel's cases (at most 8 output channels): C_out 3 at batch 2 with partial
    /// tiles (19 rows, 70 columns) and C_in 12 (a partial chunk); the Wan decoder's head at
    /// reduced size (C_in 96); C_out 4 of C_in 4 with temporal stride 2 and padding; C_out 8 of
    /// kt 1 without padding; C_out 1 of a 1x1x1 kernel whose temporal padding leaves the first
    /// and last output frames with no tap (zeros); C_out 2 of a 2x2x2 kernel with padding on one
    /// side; C_out 5 (idle accumulators) of a 3x3x1 kernel with spatial padding 2.
    const NARROW_CASES: [Case; 7] = [
        ([2, 5, 19, 70, 12], [3, 3, 3, 3, 12], [1, 1, 1], [0, 1, 1]),
        ([1, 6, 20, 40, 96], [3, 3, 3, 3, 96], [1, 1, 1], [0, 1, 1]),
        ([1, 7, 9, 33, 4], [4, 3, 3, 3, 4], [2, 1, 1], [1, 1, 1]),
        ([2, 3, 17, 65, 12], [8, 1, 3, 3, 12], [1, 1, 1], [0, 0, 0]),
        ([1, 2, 9, 70, 4], [1, 1, 1, 1, 4], [1, 1, 1], [1, 0, 0]),
        ([1, 3, 10, 11, 12], [2, 2, 2, 2, 12], [1, 1, 1], [0, 1, 0]),
        ([1, 3, 12, 20, 8], [5, 3, 3, 1, 8], [1, 1, 1], [1, 2, 0]),
    ];

    /// Every narrow configuration that takes the shape (C_out at most its channels) and fits the
    /// device within f32 rounding of the exact convolution at [`NARROW_CASES`] (1e-5 of
    /// sum |w||x|: TF32 would be off by ~1e-3, one missing channel of one tap by ~1e-4), offered
    /// first, and taken without TF32.
    #[test]
    fn channels_last_narrow_kernel_matches_exact_convolution() -> Result<()> {
        let Some((dev, limit)) = device_and_limit() else {
            return Ok(());
        };
        for case in NARROW_CASES {
            let (xd, wd, stride, padding) = case;
            let (x, w, reference) = drawn(&dev, case)?;
            let tiles = channels_last_tiles(wd[0], [wd[1], wd[2], wd[3]], stride);
            assert_eq!(tiles[0].kind, ClKind::Narrow, "{wd:?}: {tiles:?}");
            assert!(takes_channels_last(&x, &w, stride, padding, false));
            assert!(outruns_cudnn(&x, &w, stride, padding, false));
            let narrow: Vec<ClTile> = CL_TILES
                .into_iter()
                .filter(|t| t.kind == ClKind::Narrow && t.channels >= wd[0])
                .collect();
            assert!(!narrow.is_empty(), "{wd:?}: no narrow configuration");
            for tile in narrow {
                assert!(tiles.contains(&tile), "{wd:?}: {tile:?} not offered");
                if tile.shared_bytes() > limit {
                    continue;
                }
                let y = conv3d_channels_last_tile(&x, &w, stride, padding, Some(tile))?;
                assert_near(&y, &reference, 1e-5, &format!("{xd:?} by {wd:?}, {tile:?}"))?;
            }
            let y = conv3d_channels_last(&x, &w, stride, padding)?;
            assert_near(&y, &reference, 1e-5, &format!("{xd:?} by {wd:?}, default"))?;
        }
        Ok(())
    }

    /// The epilogue's cases: 3x3 spatial taps of stride 1 (every halo and gather configuration)
    /// at batch 2 with partial position tiles and C_out 20, and at C_out 101 (two channel tiles,
    /// odd: single stores) with temporal stride 2; a 1x1x1 shortcut (gather only); C_out 3 at
    /// batch 2 with partial tiles (narrow, halo and gather) and C_out 8 of a 1x1x1 kernel whose
    /// temporal padding leaves the first and last output frames with no tap (narrow and gather).
    const EPILOGUE_CASES: [Case; 5] = [
        ([2, 3, 9, 21, 4], [20, 3, 3, 3, 4], [1, 1, 1], [0, 1, 1]),
        ([1, 5, 10, 17, 8], [101, 2, 3, 3, 8], [2, 1, 1], [1, 1, 1]),
        ([2, 2, 5, 7, 16], [36, 1, 1, 1, 16], [1, 1, 1], [0, 0, 0]),
        ([2, 3, 19, 70, 12], [3, 3, 3, 3, 12], [1, 1, 1], [0, 1, 1]),
        ([1, 2, 9, 70, 4], [8, 1, 1, 1, 4], [1, 1, 1], [1, 0, 0]),
    ];

    /// Asserts `got` and `want` hold the same f32 bits.
    fn assert_same_bits(got: &Tensor, want: &Tensor, what: &str) -> Result<()> {
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            let v = t.flatten_all()?.to_vec1::<f32>()?;
            Ok(v.into_iter().map(f32::to_bits).collect())
        };
        let max_diff = (got - want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(
            bits(got)? == bits(want)?,
            "{what}: max abs diff {max_diff:e}"
        );
        Ok(())
    }

    /// Bias and residual added by the kernel's store, in every configuration that takes the
    /// shape (and the default), are the bits of the convolution followed by the separate
    /// `(y + bias) + residual` (and of bias or residual alone); a residual that is a strided view
    /// is copied first.
    #[test]
    fn channels_last_epilogue_matches_separate_adds() -> Result<()> {
        let Some((dev, limit)) = device_and_limit() else {
            return Ok(());
        };
        for (xd, wd, stride, padding) in EPILOGUE_CASES {
            let x = Tensor::randn(0f32, 1f32, &xd[..], &dev)?;
            let w = Tensor::randn(0f32, 1f32, &wd[..], &dev)?;
            let (_, out) = cl_geometry(xd, wd, stride, padding)?;
            let bias = Tensor::randn(0f32, 1f32, out[4], &dev)?;
            let residual = Tensor::randn(0f32, 1f32, &out[..], &dev)?;
            let [b, t, h, wid, c] = out;
            let strided =
                Tensor::randn(0f32, 1f32, (b, c, t, h, wid), &dev)?.permute((0, 2, 3, 4, 1))?;
            let tiles = channels_last_tiles(wd[0], [wd[1], wd[2], wd[3]], stride);
            for tile in tiles.into_iter().filter(|t| t.shared_bytes() <= limit) {
                let what = format!("{xd:?} by {wd:?}, {tile:?}");
                let y = conv3d_channels_last_tile(&x, &w, stride, padding, Some(tile))?;
                let with = |bias: Option<&Tensor>, residual: Option<&Tensor>| {
                    channels_last(
                        &x,
                        &w,
                        stride,
                        padding,
                        Store::Plain(Some(tile)),
                        bias,
                        residual,
                    )
                };
                let biased = y.broadcast_add(&bias)?;
                assert_same_bits(
                    &with(Some(&bias), Some(&residual))?,
                    &(&biased + &residual)?,
                    &format!("{what}: bias and residual"),
                )?;
                assert_same_bits(&with(Some(&bias), None)?, &biased, &format!("{what}: bias"))?;
                assert_same_bits(
                    &with(None, Some(&residual))?,
                    &(&y + &residual)?,
                    &format!("{what}: residual"),
                )?;
                assert_same_bits(
                    &with(None, Some(&strided))?,
                    &(&y + &strided)?,
                    &format!("{what}: strided residual"),
                )?;
            }
            let y = conv3d_channels_last(&x, &w, stride, padding)?;
            assert_same_bits(
                &conv3d_channels_last_with(&x, &w, stride, padding, Some(&bias), Some(&residual))?,
                &(y.broadcast_add(&bias)? + &residual)?,
                &format!("{xd:?} by {wd:?}: conv3d_channels_last_with"),
            )?;
        }
        Ok(())
    }

    /// A bias not of C_out f32 values and a residual not f32 of the output's dims are errors
    /// that name them.
    #[test]
    fn channels_last_epilogue_rejects_wrong_operands() -> Result<()> {
        let Some(dev) = device() else {
            return Ok(());
        };
        let (xd, wd, stride, padding) = EPILOGUE_CASES[0];
        let x = Tensor::randn(0f32, 1f32, &xd[..], &dev)?;
        let w = Tensor::randn(0f32, 1f32, &wd[..], &dev)?;
        let (_, out) = cl_geometry(xd, wd, stride, padding)?;
        let [b, t, h, wid, c] = out;
        let conv = |bias: Option<&Tensor>, residual: Option<&Tensor>| {
            conv3d_channels_last_with(&x, &w, stride, padding, bias, residual)
        };
        let f32_zeros = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &dev);
        let biases = [
            f32_zeros(&[c + 1])?,
            f32_zeros(&[1, c])?,
            Tensor::zeros(c, DType::BF16, &dev)?,
            Tensor::zeros(c, DType::F32, &Device::Cpu)?,
        ];
        let residuals = [
            f32_zeros(&[b, t, h, wid, c - 1])?,
            f32_zeros(&[b, t + 1, h, wid, c])?,
            f32_zeros(&[1, t, h, wid, c])?,
            f32_zeros(&[out.iter().product()])?,
            Tensor::zeros(&out[..], DType::BF16, &dev)?,
        ];
        let cases = biases.iter().map(|t| ("bias", conv(Some(t), None)));
        for (what, result) in
            cases.chain(residuals.iter().map(|t| ("residual", conv(None, Some(t)))))
        {
            let err = result.expect_err(what).to_string();
            assert!(err.contains(what), "{what}: {err}");
        }
        Ok(())
    }

    /// Exact f32 (but for at most 8 output channels), bf16, input channels not in fours, more
    /// than 32 taps and the CPU are declined (and the channel count is an error, not a wrong
    /// result).
    #[test]
    fn channels_last_kernel_declines_what_it_cannot_compute() -> Result<()> {
        let Some(dev) = device() else {
            return Ok(());
        };
        let (s, p) = ([1, 1, 1], [0, 1, 1]);
        let x = Tensor::randn(0f32, 1f32, (1, 3, 6, 8, 32), &dev)?;
        let w = Tensor::randn(0f32, 1f32, (96, 3, 3, 3, 32), &dev)?;
        assert!(takes_channels_last(&x, &w, s, p, true));
        assert!(!takes_channels_last(&x, &w, s, p, false));
        let (xb, wb) = (x.to_dtype(DType::BF16)?, w.to_dtype(DType::BF16)?);
        assert!(!takes_channels_last(&xb, &wb, s, p, true));
        let (xc, wc) = (x.to_device(&Device::Cpu)?, w.to_device(&Device::Cpu)?);
        assert!(!takes_channels_last(&xc, &wc, s, p, true));
        let wide = Tensor::randn(0f32, 1f32, (96, 1, 7, 7, 32), &dev)?;
        assert!(!takes_channels_last(&x, &wide, s, [0, 3, 3], true));
        let x6 = Tensor::randn(0f32, 1f32, (1, 3, 6, 8, 6), &dev)?;
        let w6 = Tensor::randn(0f32, 1f32, (96, 3, 3, 3, 6), &dev)?;
        assert!(!takes_channels_last(&x6, &w6, s, p, true));
        assert!(conv3d_channels_last(&x6, &w6, s, p).is_err());
        // The halo kernels take 3x3 spatial taps of spatial stride 1 only: not offered otherwise,
        // and an error (not a wrong result) where forced.
        let halo = CL_TILES
            .into_iter()
            .find(|t| t.kind == ClKind::Halo)
            .expect("a halo configuration");
        for (kernel, stride) in [
            ([1, 1, 1], s),
            ([3, 1, 1], s),
            ([1, 2, 2], s),
            ([3, 3, 3], [1, 2, 2]),
        ] {
            assert!(channels_last_tiles(96, kernel, stride)
                .iter()
                .all(|t| t.kind == ClKind::Gather));
        }
        let w1 = Tensor::randn(0f32, 1f32, (96, 1, 1, 1, 32), &dev)?;
        assert!(conv3d_channels_last_tile(&x, &w1, s, [0, 0, 0], Some(halo)).is_err());
        assert!(conv3d_channels_last_tile(&x, &w, [1, 2, 2], p, Some(halo)).is_err());
        // The narrow kernels take at most their channels (8 in all), kh and kw at most 3 and
        // spatial stride 1: not offered otherwise, an error where forced; they take exact f32
        // (TF32 off), the tensor-core configurations do not.
        for (c_out, kernel, stride) in [
            (9, [3, 3, 3], s),
            (96, [3, 3, 3], s),
            (3, [1, 4, 4], s),
            (3, [1, 1, 5], s),
            (3, [3, 3, 3], [1, 2, 2]),
            (3, [3, 3, 3], [1, 1, 2]),
        ] {
            assert!(
                channels_last_tiles(c_out, kernel, stride)
                    .iter()
                    .all(|t| t.kind != ClKind::Narrow),
                "{c_out} by {kernel:?} of stride {stride:?}"
            );
        }
        assert!(channels_last_tiles(8, [3, 3, 3], s)
            .iter()
            .any(|t| t.kind == ClKind::Narrow && t.channels == 8));
        let narrow3 = CL_TILES
            .into_iter()
            .find(|t| t.kind == ClKind::Narrow && t.channels == 3)
            .expect("a 3-channel narrow configuration");
        let w4 = Tensor::randn(0f32, 1f32, (4, 3, 3, 3, 32), &dev)?;
        assert!(conv3d_channels_last_tile(&x, &w4, s, p, Some(narrow3)).is_err());
        let w3 = w4.narrow(0, 0, 3)?;
        assert!(conv3d_channels_last_tile(&x, &w3, [1, 2, 2], p, Some(narrow3)).is_err());
        assert!(conv3d_channels_last_tile(&x, &w3, s, p, Some(narrow3)).is_ok());
        let w9 = Tensor::randn(0f32, 1f32, (9, 3, 3, 3, 32), &dev)?;
        assert!(takes_channels_last(&x, &w3, s, p, false));
        assert!(outruns_cudnn(&x, &w3, s, p, false) && outruns_cudnn(&x, &w3, s, p, true));
        assert!(!takes_channels_last(&x, &w9, s, p, false));
        assert!(!outruns_cudnn(&x, &w9, s, p, true));
        let w3s = Tensor::randn(0f32, 1f32, (3, 3, 3, 3, 32), &dev)?;
        assert!(!takes_channels_last(&x, &w3s, [1, 2, 2], p, false));
        Ok(())
    }

    /// The interleaved parities are the plain store's grid interleaved (parity 2a + b at grid
    /// (i, j) to pixel (2i - a, 2j - b)) plus the bias, bit for bit, in the same configuration:
    /// at batch 2, odd frame sizes, several channel tiles and a temporal kernel; a residual or
    /// an odd parity width is an error.
    #[test]
    fn channels_last_parities_interleave_the_plain_store() -> Result<()> {
        let Some((dev, limit)) = device_and_limit() else {
            return Ok(());
        };
        let (s, p) = ([1, 1, 1], [0, 1, 1]);
        for (xd, c, kernel) in [
            ([1, 2, 5, 7, 8], 4, [1, 2, 2]),
            ([2, 3, 6, 9, 12], 24, [1, 2, 2]),
            ([1, 4, 9, 10, 16], 96, [2, 2, 2]),
        ] {
            let [b, _, h, wd, c_in] = xd;
            let [kt, kh, kw] = kernel;
            let x = Tensor::randn(0f32, 1f32, &xd[..], &dev)?;
            let w = Tensor::randn(0f32, 1f32, (4 * c, kt, kh, kw, c_in), &dev)?;
            let bias = Tensor::randn(0f32, 1f32, c, &dev)?;
            let got = conv3d_channels_last_parities(&x, &w, s, p, Some(&bias))?;
            let tile = channels_last_tiles(4 * c, kernel, s)
                .into_iter()
                .find(|t| t.kind == ClKind::Gather && t.shared_bytes() <= limit)
                .expect("a gather configuration fits");
            let grid = conv3d_channels_last_tile(&x, &w, s, p, Some(tile))?;
            let t = grid.dim(1)?;
            let grid = grid.reshape(vec![b, t, h + 1, wd + 1, 2, 2, c])?;
            let parity = |a: usize, bb: usize| -> Result<Tensor> {
                grid.narrow(2, a, h)?
                    .narrow(3, bb, wd)?
                    .narrow(4, a, 1)?
                    .narrow(5, bb, 1)?
                    .squeeze(5)?
                    .squeeze(4)
            };
            let row = |a: usize| Tensor::stack(&[parity(a, 0)?, parity(a, 1)?], 4);
            let want = Tensor::stack(&[row(0)?, row(1)?], 3)?
                .reshape((b, t, 2 * h, 2 * wd, c))?
                .broadcast_add(&bias)?;
            assert_same_bits(&got, &want, &format!("{xd:?} by {kernel:?} to {c}"))?;
        }
        let x = Tensor::randn(0f32, 1f32, (1, 2, 5, 7, 8), &dev)?;
        let w = Tensor::randn(0f32, 1f32, (12, 1, 2, 2, 8), &dev)?;
        assert!(conv3d_channels_last_parities(&x, &w, s, p, None).is_err());
        let w = Tensor::randn(0f32, 1f32, (16, 1, 2, 2, 8), &dev)?;
        let r = Tensor::zeros((1, 2, 8, 12, 4), DType::F32, &dev)?;
        assert!(channels_last(&x, &w, s, p, Store::Parities, None, Some(&r)).is_err());
        Ok(())
    }

    /// With cuDNN loaded the gather kernel computes the 2x2 kernels of one frame (the upsamplers'
    /// parity convolutions) up to 192 input channels in TF32, and no other of its shapes.
    #[test]
    fn gather_takes_the_narrow_parity_convolutions_from_cudnn() -> Result<()> {
        let Some(dev) = device() else {
            return Ok(());
        };
        let (s, p) = ([1, 1, 1], [0, 1, 1]);
        for (c_in, kernel, routed) in [
            (192, [1, 2, 2], true),
            (8, [1, 2, 2], true),
            (196, [1, 2, 2], false),
            (384, [1, 2, 2], false),
            (192, [2, 2, 2], false),
            (192, [1, 3, 3], false),
            (192, [1, 1, 1], false),
        ] {
            let x = Tensor::zeros((1, 2, 6, 8, c_in), DType::F32, &dev)?;
            let [kt, kh, kw] = kernel;
            let w = Tensor::zeros((384, kt, kh, kw, c_in), DType::F32, &dev)?;
            assert_eq!(
                outruns_cudnn(&x, &w, s, p, true),
                routed,
                "{c_in} channels by {kernel:?}"
            );
            assert!(
                !outruns_cudnn(&x, &w, s, p, false),
                "exact f32 stays with cuDNN"
            );
        }
        Ok(())
    }
}
