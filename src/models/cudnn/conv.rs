//! 3D convolution forward through cuDNN's legacy convolution API (Nd tensor, filter and
//! convolution descriptors, `cudnnConvolutionForward`): the algorithm is chosen once per shape
//! with `cudnnGetConvolutionForwardAlgorithm_v7`; its workspace comes from candle's allocator.
//! f32 runs with TF32 tensor-core math unless exact f32 is asked for.

use std::ffi::c_void;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::DevicePtr;
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape};

use super::sdpa::{alloc, ptr, ptr_mut};
use super::{data, data_type, with_handle, Api, Desc, Handle, PlanCache};

/// `cudnnConvolutionFwdAlgoPerf_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AlgoPerf {
    algo: i32,
    status: i32,
    time: f32,
    memory: usize,
    determinism: i32,
    math_type: i32,
    reserved: [i32; 3],
}

/// `CUDNN_TENSOR_NCHW` (filters `[C_out, C_in, kt, kh, kw]`, packed).
const FORMAT_NCHW: i32 = 0;
/// `CUDNN_CROSS_CORRELATION`: what deep-learning frameworks call convolution.
const CROSS_CORRELATION: i32 = 1;
// cudnnMathType_t
const DEFAULT_MATH: i32 = 0;
const TENSOR_OP_MATH: i32 = 1;
const FMA_MATH: i32 = 3;
/// `CUDNN_CONVOLUTION_FWD_ALGO_COUNT`.
const ALGO_COUNT: i32 = 8;
/// Largest workspace an algorithm may ask for: the same budget as the im2col scratch of the
/// path without cuDNN (`MAX_IM2COL_ELEMENTS` f32 values).
const MAX_WORKSPACE_BYTES: usize = 1 << 28;

/// A legacy descriptor and the function that destroys it.
struct Owned {
    desc: Desc,
    destroy: unsafe extern "C" fn(Desc) -> i32,
}

// SAFETY: descriptors are plain heap objects, used under the handle lock.
unsafe impl Send for Owned {}
unsafe impl Sync for Owned {}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: created by the matching cudnnCreate*Descriptor, destroyed once.
        unsafe { (self.destroy)(self.desc) };
    }
}

fn create(
    api: &Api,
    create: unsafe extern "C" fn(*mut Desc) -> i32,
    destroy: unsafe extern "C" fn(Desc) -> i32,
    what: &str,
) -> Result<Owned> {
    let mut desc: Desc = std::ptr::null_mut();
    // SAFETY: writes one descriptor pointer.
    api.check(unsafe { create(&mut desc) }, what)?;
    Ok(Owned { desc, destroy })
}

/// Sizes and settings a plan depends on.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    ordinal: usize,
    dtype: DType,
    tf32: bool,
    x: [usize; 5],
    w: [usize; 5],
    stride: [usize; 3],
    padding: [usize; 3],
}

/// Descriptors and the chosen algorithm for one shape.
struct Plan {
    x: Owned,
    w: Owned,
    conv: Owned,
    y: Owned,
    y_dims: [usize; 5],
    algo: i32,
    workspace: usize,
}

static PLANS: PlanCache<Key, Plan> = PlanCache::new();

fn to_i32(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("cuDNN conv: {v} exceeds i32")))
}

/// Packed strides of `dims`, checked to fit cuDNN's 32-bit descriptors.
fn packed_i32(dims: &[usize; 5]) -> Result<([i32; 5], [i32; 5])> {
    let mut strides = [1usize; 5];
    for i in (0..4).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    let d = [
        to_i32(dims[0])?,
        to_i32(dims[1])?,
        to_i32(dims[2])?,
        to_i32(dims[3])?,
        to_i32(dims[4])?,
    ];
    let s = [
        to_i32(strides[0])?,
        to_i32(strides[1])?,
        to_i32(strides[2])?,
        to_i32(strides[3])?,
        to_i32(strides[4])?,
    ];
    to_i32(dims[0] * strides[0])?;
    Ok((d, s))
}

fn build(api: &Api, handle: Handle, key: &Key) -> Result<Plan> {
    let dt = data_type(key.dtype).expect("bf16, f16 or f32");
    let [_, _, kt, kh, kw] = key.w;
    let out = |i: usize, k: usize, s: usize, p: usize| -> Result<usize> {
        if i + 2 * p < k || s == 0 {
            bail!("cuDNN conv: input {i} (padding {p}) smaller than kernel {k}")
        }
        Ok((i + 2 * p - k) / s + 1)
    };
    let y_dims = [
        key.x[0],
        key.w[0],
        out(key.x[2], kt, key.stride[0], key.padding[0])?,
        out(key.x[3], kh, key.stride[1], key.padding[1])?,
        out(key.x[4], kw, key.stride[2], key.padding[2])?,
    ];
    let x = create(api, api.create_tensor, api.destroy_tensor, "creating x")?;
    let (xd, xs) = packed_i32(&key.x)?;
    // SAFETY: 5 dims and strides.
    api.check(
        unsafe { (api.set_tensor_nd)(x.desc, dt, 5, xd.as_ptr(), xs.as_ptr()) },
        "cudnnSetTensorNdDescriptor(x)",
    )?;
    let y = create(api, api.create_tensor, api.destroy_tensor, "creating y")?;
    let (yd, ys) = packed_i32(&y_dims)?;
    // SAFETY: 5 dims and strides.
    api.check(
        unsafe { (api.set_tensor_nd)(y.desc, dt, 5, yd.as_ptr(), ys.as_ptr()) },
        "cudnnSetTensorNdDescriptor(y)",
    )?;
    let w = create(api, api.create_filter, api.destroy_filter, "creating w")?;
    let (wd, _) = packed_i32(&key.w)?;
    // SAFETY: 5 filter dims.
    api.check(
        unsafe { (api.set_filter_nd)(w.desc, dt, FORMAT_NCHW, 5, wd.as_ptr()) },
        "cudnnSetFilterNdDescriptor",
    )?;
    let conv = create(api, api.create_conv, api.destroy_conv, "creating conv")?;
    let pad = key.padding.map(|p| p as i32);
    let stride = key.stride.map(|s| s as i32);
    let dilation = [1i32; 3];
    // SAFETY: 3 spatial entries each; f32 accumulation for every data type.
    api.check(
        unsafe {
            (api.set_conv_nd)(
                conv.desc,
                3,
                pad.as_ptr(),
                stride.as_ptr(),
                dilation.as_ptr(),
                CROSS_CORRELATION,
                data::FLOAT,
            )
        },
        "cudnnSetConvolutionNdDescriptor",
    )?;
    // As PyTorch: f32 with TF32 allowed takes the default math (tensor cores in TF32 on Ampere
    // and newer), exact f32 only FMA kernels, half precision tensor cores.
    let exact = key.dtype == DType::F32 && !key.tf32;
    let math = match (key.dtype, key.tf32) {
        (DType::F32, true) => DEFAULT_MATH,
        (DType::F32, false) => FMA_MATH,
        _ => TENSOR_OP_MATH,
    };
    // SAFETY: a live convolution descriptor.
    api.check(
        unsafe { (api.set_conv_math)(conv.desc, math) },
        "cudnnSetConvolutionMathType",
    )?;
    let mut check_dims = [0i32; 5];
    // SAFETY: writes 5 output dims.
    api.check(
        unsafe { (api.conv_output_dim)(conv.desc, x.desc, w.desc, 5, check_dims.as_mut_ptr()) },
        "cudnnGetConvolutionNdForwardOutputDim",
    )?;
    if check_dims != yd {
        bail!("cuDNN conv: output dims {check_dims:?}, expected {yd:?}")
    }
    let mut perf = [AlgoPerf::default(); ALGO_COUNT as usize];
    let mut returned = 0i32;
    // SAFETY: room for ALGO_COUNT results.
    api.check(
        unsafe {
            (api.conv_fwd_algos)(
                handle,
                x.desc,
                w.desc,
                conv.desc,
                y.desc,
                ALGO_COUNT,
                &mut returned,
                perf.as_mut_ptr(),
            )
        },
        "cudnnGetConvolutionForwardAlgorithm_v7",
    )?;
    let returned = (returned.max(0) as usize).min(perf.len());
    for p in &perf[..returned] {
        if p.status != 0 || p.memory > MAX_WORKSPACE_BYTES || (exact && p.math_type != FMA_MATH) {
            continue;
        }
        // cuDNN picks tensor-core kernels by algorithm and math type together (as PyTorch does).
        // SAFETY: a live convolution descriptor.
        api.check(
            unsafe { (api.set_conv_math)(conv.desc, p.math_type) },
            "cudnnSetConvolutionMathType",
        )?;
        let mut workspace = 0usize;
        // SAFETY: writes one size.
        let status = unsafe {
            (api.conv_fwd_workspace)(
                handle,
                x.desc,
                w.desc,
                conv.desc,
                y.desc,
                p.algo,
                &mut workspace,
            )
        };
        if status != 0 || workspace > MAX_WORKSPACE_BYTES {
            continue;
        }
        return Ok(Plan {
            x,
            w,
            conv,
            y,
            y_dims,
            algo: p.algo,
            workspace: workspace.max(p.memory),
        });
    }
    bail!("cuDNN conv: no algorithm for this shape within {MAX_WORKSPACE_BYTES} B of workspace")
}

/// Cross-correlation of `[B, C_in, T, H, W]` by `[C_out, C_in, kt, kh, kw]` (both contiguous),
/// no bias: `[B, C_out, T', H', W']`.
pub(crate) struct Conv3d {
    pub api: &'static Api,
    pub stride: [usize; 3],
    pub padding: [usize; 3],
    pub tf32: bool,
}

fn dims5(l: &Layout) -> Result<[usize; 5]> {
    if !l.is_contiguous() {
        bail!("cuDNN conv: contiguous tensors expected")
    }
    match l.dims() {
        &[a, b, c, d, e] => Ok([a, b, c, d, e]),
        other => bail!("cuDNN conv: 5D tensors expected, got {other:?}"),
    }
}

impl CustomOp2 for Conv3d {
    fn name(&self) -> &'static str {
        "cudnn-conv3d"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("cuDNN conv3d runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = &x.device;
        let dtype = x.dtype();
        if w.dtype() != dtype {
            bail!("cuDNN conv: input {dtype:?}, weight {:?}", w.dtype())
        }
        let stream = dev.cuda_stream();
        let key = Key {
            ordinal: stream.context().ordinal(),
            dtype,
            tf32: self.tf32,
            x: dims5(xl)?,
            w: dims5(wl)?,
            stride: self.stride,
            padding: self.padding,
        };
        if key.w[1] != key.x[1] {
            bail!(
                "cuDNN conv: {} input channels, weight for {}",
                key.x[1],
                key.w[1]
            )
        }
        let api = self.api;
        let (out, y_dims) = with_handle(api, &stream, |handle| {
            let plan = PLANS.get_or_build(&key, || build(api, handle, &key))?;
            let mut out = alloc(dev, dtype, plan.y_dims.iter().product())?;
            let ws = if plan.workspace > 0 {
                // SAFETY: scratch cuDNN writes before it reads.
                Some(unsafe { dev.alloc::<u8>(plan.workspace) }?)
            } else {
                None
            };
            {
                let (xp, _gx) = ptr(&x.slice, xl, &stream)?;
                let (wp, _gw) = ptr(&w.slice, wl, &stream)?;
                let (yp, _gy) = ptr_mut(&mut out, &stream)?;
                let (wsp, _gws) = match &ws {
                    Some(ws) => {
                        let (p, g) = ws.device_ptr(&stream);
                        (p as *mut c_void, Some(g))
                    }
                    None => (std::ptr::null_mut(), None),
                };
                let (alpha, beta) = (1f32, 0f32);
                // SAFETY: descriptors describe exactly these buffers; alpha and beta are f32
                // for every non-double data type.
                let status = unsafe {
                    (api.conv_fwd)(
                        handle,
                        &alpha as *const f32 as *const c_void,
                        plan.x.desc,
                        xp,
                        plan.w.desc,
                        wp,
                        plan.conv.desc,
                        plan.algo,
                        wsp,
                        plan.workspace,
                        &beta as *const f32 as *const c_void,
                        plan.y.desc,
                        yp,
                    )
                };
                if let Err(e) = api.check(status, "cudnnConvolutionForward") {
                    PLANS.decline(&key);
                    return Err(e);
                }
            }
            Ok((out, plan.y_dims))
        })?;
        Ok((
            CudaStorage {
                slice: out,
                device: dev.clone(),
            },
            Shape::from(y_dims.to_vec()),
        ))
    }
}
