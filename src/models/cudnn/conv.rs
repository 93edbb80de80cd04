//! 3D convolution forward through cuDNN's legacy convolution API (Nd tensor, filter and
//! convolution descriptors, `cudnnConvolutionForward`). The algorithm is chosen once per shape,
//! dtype and math setting: by cuDNN's heuristic, or for large convolutions where asked
//! ([`SEARCH_ENV`]) by timing every algorithm cuDNN offers on the call's own buffers
//! (`cudnnFindConvolutionForwardAlgorithmEx`, with TF32 and exact math both tried where TF32 is
//! allowed). Workspaces come from candle's
//! allocator for the call and are released after it. f32 runs with TF32 tensor-core math unless
//! exact f32 is asked for.

use std::ffi::c_void;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use candle_core::{bail, CudaDevice, CudaStorage, CustomOp2, DType, Layout, Result, Shape};

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
/// `CUDNN_TENSOR_NHWC` (filters `[C_out, kt, kh, kw, C_in]`, packed).
const FORMAT_NHWC: i32 = 1;
/// `CUDNN_CROSS_CORRELATION`: what deep-learning frameworks call convolution.
const CROSS_CORRELATION: i32 = 1;
// cudnnMathType_t
const DEFAULT_MATH: i32 = 0;
const TENSOR_OP_MATH: i32 = 1;
const FMA_MATH: i32 = 3;
/// `CUDNN_CONVOLUTION_FWD_ALGO_COUNT`.
const ALGO_COUNT: i32 = 8;
/// Convolutions of at least this many floating-point operations get their algorithm by timing;
/// below it (a few microseconds of work) timing is noise and cuDNN's heuristic decides, which
/// also keeps small shapes (the tiny test fixtures) on one algorithm from run to run.
const TIMED_MIN_FLOPS: f64 = 4e9;
/// Algorithms within this factor of the fastest count as equally fast; among them the one with
/// the smallest workspace (then the lowest number) is taken, so timing noise rarely changes the
/// choice and memory is not spent for nothing.
const TIE: f32 = 1.05;
/// The largest workspace an algorithm may use, before the free-memory bound: the fast TF32
/// kernels at the Wan VAE's 480x832 frames need more than the 256 MiB this module used to allow
/// (it left the heuristic a TF32 algorithm twice as slow as exact f32 at 96 and 192 channels);
/// PyTorch allows whatever its allocator can give. 4 GiB keeps a decode's peak near PyTorch's.
const MAX_WORKSPACE_BYTES: usize = 4 << 30;
/// The smallest workspace worth offering to the timed search.
const MIN_SEARCH_WORKSPACE: usize = 64 << 20;
/// `timed` times every algorithm on a large shape's first call (`cudnnFindConvolutionForwardAlgorithmEx`)
/// instead of taking cuDNN's heuristic order: on the Wan decode the search cost 3.8 s and saved
/// 0.01 s (2.388 vs 2.399 s, bench/RESULTS.md), so a pipeline's one decode takes the heuristic.
pub const SEARCH_ENV: &str = "VIDGEN_CUDNN_CONV_ALGO";

/// Whether large convolutions get their algorithm by timing (see [`SEARCH_ENV`]); read when a
/// shape's plan is made, which happens once per shape.
fn timed_search() -> bool {
    std::env::var(SEARCH_ENV).is_ok_and(|v| v.trim().eq_ignore_ascii_case("timed"))
}

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
    /// Channels last in memory (NDHWC activations, `[C_out, kt, kh, kw, C_in]` filters); the
    /// dims above stay in NCDHW order, as cuDNN's descriptors take them.
    channels_last: bool,
}

/// An algorithm with the math type it runs in and the workspace it needs.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Choice {
    algo: i32,
    math: i32,
    workspace: usize,
}

/// Descriptors and the algorithms for one shape, best first (the next one runs where the
/// workspace of the first cannot be allocated at the time of a call).
struct Plan {
    x: Owned,
    w: Owned,
    conv: Owned,
    y: Owned,
    choices: Vec<Choice>,
}

static PLANS: PlanCache<Key, Plan> = PlanCache::new();

fn to_i32(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("cuDNN conv: {v} exceeds i32")))
}

/// NCDHW `dims` with the strides of packed memory, NCDHW or (`channels_last`) NDHWC,
/// checked to fit cuDNN's 32-bit descriptors.
fn packed_i32(dims: &[usize; 5], channels_last: bool) -> Result<([i32; 5], [i32; 5])> {
    let mut strides = [1usize; 5];
    if channels_last {
        // Memory order N, D, H, W, C.
        strides[1] = 1;
        strides[4] = dims[1];
        strides[3] = strides[4] * dims[4];
        strides[2] = strides[3] * dims[3];
        strides[0] = strides[2] * dims[2];
    } else {
        for i in (0..4).rev() {
            strides[i] = strides[i + 1] * dims[i + 1];
        }
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

/// `[B, C_out, T', H', W']` of a convolution.
fn out_dims(key: &Key) -> Result<[usize; 5]> {
    let [_, _, kt, kh, kw] = key.w;
    let out = |i: usize, k: usize, s: usize, p: usize| -> Result<usize> {
        if i + 2 * p < k || s == 0 {
            bail!("cuDNN conv: input {i} (padding {p}) smaller than kernel {k}")
        }
        Ok((i + 2 * p - k) / s + 1)
    };
    Ok([
        key.x[0],
        key.w[0],
        out(key.x[2], kt, key.stride[0], key.padding[0])?,
        out(key.x[3], kh, key.stride[1], key.padding[1])?,
        out(key.x[4], kw, key.stride[2], key.padding[2])?,
    ])
}

/// The buffers of the call a plan is built for (the timed search runs on them).
struct Buffers<'a> {
    x: *const c_void,
    w: *const c_void,
    y: *mut c_void,
    dev: &'a CudaDevice,
    stream: &'a CudaStream,
}

/// Descriptors for `key`, then the algorithms to run.
fn build(api: &Api, handle: Handle, key: &Key, bufs: &Buffers) -> Result<Plan> {
    let dt = data_type(key.dtype).expect("bf16, f16 or f32");
    let y_dims = out_dims(key)?;
    let x = create(api, api.create_tensor, api.destroy_tensor, "creating x")?;
    let (xd, xs) = packed_i32(&key.x, key.channels_last)?;
    // SAFETY: 5 dims and strides.
    api.check(
        unsafe { (api.set_tensor_nd)(x.desc, dt, 5, xd.as_ptr(), xs.as_ptr()) },
        "cudnnSetTensorNdDescriptor(x)",
    )?;
    let y = create(api, api.create_tensor, api.destroy_tensor, "creating y")?;
    let (yd, ys) = packed_i32(&y_dims, key.channels_last)?;
    // SAFETY: 5 dims and strides.
    api.check(
        unsafe { (api.set_tensor_nd)(y.desc, dt, 5, yd.as_ptr(), ys.as_ptr()) },
        "cudnnSetTensorNdDescriptor(y)",
    )?;
    let w = create(api, api.create_filter, api.destroy_filter, "creating w")?;
    let (wd, _) = packed_i32(&key.w, false)?;
    let format = if key.channels_last {
        FORMAT_NHWC
    } else {
        FORMAT_NCHW
    };
    // SAFETY: 5 filter dims.
    api.check(
        unsafe { (api.set_filter_nd)(w.desc, dt, format, 5, wd.as_ptr()) },
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
    let mut check_dims = [0i32; 5];
    // SAFETY: writes 5 output dims.
    api.check(
        unsafe { (api.conv_output_dim)(conv.desc, x.desc, w.desc, 5, check_dims.as_mut_ptr()) },
        "cudnnGetConvolutionNdForwardOutputDim",
    )?;
    if check_dims != yd {
        bail!("cuDNN conv: output dims {check_dims:?}, expected {yd:?}")
    }
    let mut plan = Plan {
        x,
        w,
        conv,
        y,
        choices: Vec::new(),
    };
    // The workspace bound: what the device has free now, halved so that the activations that
    // follow keep the other half, and at most MAX_WORKSPACE_BYTES.
    let free = bufs
        .stream
        .context()
        .mem_get_info()
        .map_or(0, |(free, _)| free);
    let allowance = (free / 2).min(MAX_WORKSPACE_BYTES);
    let [_, cin, kt, kh, kw] = key.w;
    let flops = 2.0 * y_dims.iter().product::<usize>() as f64 * (cin * kt * kh * kw) as f64;
    if flops >= TIMED_MIN_FLOPS && timed_search() {
        // A search that fails (or finds nothing) leaves the shape to the heuristic.
        match timed(api, handle, key, &plan, bufs, allowance) {
            Ok(found) => plan.choices = found,
            Err(e) => super::note_once(
                "conv-search",
                &format!("cuDNN's timed convolution search failed ({e}); its heuristic decides"),
            ),
        }
    }
    if plan.choices.is_empty() {
        plan.choices = heuristic(api, handle, key, &plan, allowance)?;
    }
    if plan.choices.is_empty() {
        bail!("cuDNN conv: no algorithm for this shape within {allowance} B of workspace")
    }
    Ok(plan)
}

/// The math types to try: as PyTorch, f32 with TF32 allowed takes the default math (tensor
/// cores in TF32 on Ampere and newer) and, timed beside it, FMA (exact) kernels, which are the
/// faster ones at some shapes; exact f32 only FMA; half precision tensor cores.
fn maths(key: &Key) -> &'static [i32] {
    match (key.dtype, key.tf32) {
        (DType::F32, true) => &[DEFAULT_MATH, FMA_MATH],
        (DType::F32, false) => &[FMA_MATH],
        _ => &[TENSOR_OP_MATH],
    }
}

/// Whether a result may run under `key`: exact f32 takes only FMA kernels.
fn allowed(key: &Key, p: &AlgoPerf) -> bool {
    p.status == 0 && !(key.dtype == DType::F32 && !key.tf32 && p.math_type != FMA_MATH)
}

fn set_math(api: &Api, plan: &Plan, math: i32) -> Result<()> {
    // SAFETY: a live convolution descriptor.
    api.check(
        unsafe { (api.set_conv_math)(plan.conv.desc, math) },
        "cudnnSetConvolutionMathType",
    )
}

/// The workspace `algo` needs under the math type set last, or `None` if cuDNN declines it.
fn workspace_of(api: &Api, handle: Handle, plan: &Plan, algo: i32) -> Option<usize> {
    let mut workspace = 0usize;
    // SAFETY: writes one size.
    let status = unsafe {
        (api.conv_fwd_workspace)(
            handle,
            plan.x.desc,
            plan.w.desc,
            plan.conv.desc,
            plan.y.desc,
            algo,
            &mut workspace,
        )
    };
    (status == 0).then_some(workspace)
}

/// cuDNN's heuristic order (`cudnnGetConvolutionForwardAlgorithm_v7`) for every math type of
/// `key`, keeping what fits in `allowance`.
fn heuristic(
    api: &Api,
    handle: Handle,
    key: &Key,
    plan: &Plan,
    allowance: usize,
) -> Result<Vec<Choice>> {
    let mut choices = Vec::new();
    for &math in maths(key) {
        set_math(api, plan, math)?;
        let mut perf = [AlgoPerf::default(); ALGO_COUNT as usize];
        let mut returned = 0i32;
        // SAFETY: room for ALGO_COUNT results.
        api.check(
            unsafe {
                (api.conv_fwd_algos)(
                    handle,
                    plan.x.desc,
                    plan.w.desc,
                    plan.conv.desc,
                    plan.y.desc,
                    ALGO_COUNT,
                    &mut returned,
                    perf.as_mut_ptr(),
                )
            },
            "cudnnGetConvolutionForwardAlgorithm_v7",
        )?;
        let returned = (returned.max(0) as usize).min(perf.len());
        for p in perf[..returned].iter().filter(|p| allowed(key, p)) {
            let Some(choice) = choice_of(api, handle, plan, p)? else {
                continue;
            };
            if choice.workspace <= allowance && !choices.contains(&choice) {
                choices.push(choice);
            }
        }
    }
    Ok(choices)
}

/// What running `p` takes: its algorithm and math type (cuDNN picks tensor-core kernels by
/// both together, as PyTorch does) and its workspace; `None` where cuDNN cannot size it.
fn choice_of(api: &Api, handle: Handle, plan: &Plan, p: &AlgoPerf) -> Result<Option<Choice>> {
    set_math(api, plan, p.math_type)?;
    Ok(
        workspace_of(api, handle, plan, p.algo).map(|workspace| Choice {
            algo: p.algo,
            math: p.math_type,
            workspace: workspace.max(p.memory),
        }),
    )
}

/// Every algorithm cuDNN can run for `key` within `allowance`, timed on the call's buffers
/// (`cudnnFindConvolutionForwardAlgorithmEx`; it overwrites `y`, which the call writes after),
/// fastest first with near-ties (see [`TIE`]) ordered by workspace. The search workspace is
/// allocated for the search only and released before the call runs.
fn timed(
    api: &Api,
    handle: Handle,
    key: &Key,
    plan: &Plan,
    bufs: &Buffers,
    allowance: usize,
) -> Result<Vec<Choice>> {
    let mut size = allowance;
    let search: Option<CudaSlice<u8>> = loop {
        if size < MIN_SEARCH_WORKSPACE {
            break None;
        }
        // SAFETY: scratch cuDNN writes before it reads.
        match unsafe { bufs.dev.alloc::<u8>(size) } {
            Ok(ws) => break Some(ws),
            Err(_) => size /= 2,
        }
    };
    let size = if search.is_some() { size } else { 0 };
    let mut found: Vec<(f32, Choice)> = Vec::new();
    {
        let (wsp, _guard) = match &search {
            Some(ws) => {
                let (p, g) = ws.device_ptr(bufs.stream);
                (p as *mut c_void, Some(g))
            }
            None => (std::ptr::null_mut(), None),
        };
        for &math in maths(key) {
            set_math(api, plan, math)?;
            let mut perf = [AlgoPerf::default(); ALGO_COUNT as usize];
            let mut returned = 0i32;
            // SAFETY: the descriptors describe exactly these buffers; room for ALGO_COUNT
            // results; the workspace holds `size` bytes.
            api.check(
                unsafe {
                    (api.conv_fwd_find)(
                        handle,
                        plan.x.desc,
                        bufs.x,
                        plan.w.desc,
                        bufs.w,
                        plan.conv.desc,
                        plan.y.desc,
                        bufs.y,
                        ALGO_COUNT,
                        &mut returned,
                        perf.as_mut_ptr(),
                        wsp,
                        size,
                    )
                },
                "cudnnFindConvolutionForwardAlgorithmEx",
            )?;
            let returned = (returned.max(0) as usize).min(perf.len());
            for p in perf[..returned].iter().filter(|p| allowed(key, p)) {
                let Some(choice) = choice_of(api, handle, plan, p)? else {
                    continue;
                };
                if choice.workspace <= size && !found.iter().any(|(_, c)| *c == choice) {
                    found.push((p.time, choice));
                }
            }
        }
    }
    drop(search);
    let Some(best) = found.iter().map(|(t, _)| *t).reduce(f32::min) else {
        return Ok(Vec::new());
    };
    found.sort_by(|(ta, a), (tb, b)| {
        let (tie_a, tie_b) = (*ta <= best * TIE, *tb <= best * TIE);
        tie_b.cmp(&tie_a).then(if tie_a && tie_b {
            (a.workspace, a.algo, a.math).cmp(&(b.workspace, b.algo, b.math))
        } else {
            ta.total_cmp(tb)
        })
    });
    Ok(found.into_iter().map(|(_, c)| c).collect())
}

/// Runs the first of `plan`'s algorithms whose workspace can be allocated now.
fn run(api: &Api, handle: Handle, plan: &Plan, bufs: &Buffers) -> Result<()> {
    let mut last = None;
    for choice in &plan.choices {
        let ws = if choice.workspace > 0 {
            // SAFETY: scratch cuDNN writes before it reads.
            match unsafe { bufs.dev.alloc::<u8>(choice.workspace) } {
                Ok(ws) => Some(ws),
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            }
        } else {
            None
        };
        let (wsp, _gws) = match &ws {
            Some(ws) => {
                let (p, g) = ws.device_ptr(bufs.stream);
                (p as *mut c_void, Some(g))
            }
            None => (std::ptr::null_mut(), None),
        };
        set_math(api, plan, choice.math)?;
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the descriptors describe exactly these buffers; alpha and beta are f32 for
        // every non-double data type; the workspace holds `choice.workspace` bytes.
        let status = unsafe {
            (api.conv_fwd)(
                handle,
                &alpha as *const f32 as *const c_void,
                plan.x.desc,
                bufs.x,
                plan.w.desc,
                bufs.w,
                plan.conv.desc,
                choice.algo,
                wsp,
                choice.workspace,
                &beta as *const f32 as *const c_void,
                plan.y.desc,
                bufs.y,
            )
        };
        return api.check(status, "cudnnConvolutionForward");
    }
    match last {
        Some(e) => Err(e),
        None => bail!("cuDNN conv: no algorithm to run"),
    }
}

/// Cross-correlation of `[B, C_in, T, H, W]` by `[C_out, C_in, kt, kh, kw]` (both contiguous),
/// no bias: `[B, C_out, T', H', W']`; with `channels_last`, of `[B, T, H, W, C_in]` by
/// `[C_out, kt, kh, kw, C_in]`: `[B, T', H', W', C_out]`.
pub(crate) struct Conv3d {
    pub api: &'static Api,
    pub stride: [usize; 3],
    pub padding: [usize; 3],
    pub tf32: bool,
    pub channels_last: bool,
}

/// Channels-last `[a, b, c, d, e]` (channels last) as the NCDHW dims cuDNN's descriptors take.
fn channels_first([n, d, h, w, c]: [usize; 5]) -> [usize; 5] {
    [n, c, d, h, w]
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

    crate::models::kernel_module::cuda_only_cpu_fwd!(a a_layout, b b_layout);

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
        let (x_dims, w_dims) = (dims5(xl)?, dims5(wl)?);
        let key = Key {
            ordinal: stream.context().ordinal(),
            dtype,
            tf32: self.tf32,
            x: if self.channels_last {
                channels_first(x_dims)
            } else {
                x_dims
            },
            w: if self.channels_last {
                channels_first(w_dims)
            } else {
                w_dims
            },
            stride: self.stride,
            padding: self.padding,
            channels_last: self.channels_last,
        };
        if key.w[1] != key.x[1] {
            bail!(
                "cuDNN conv: {} input channels, weight for {}",
                key.x[1],
                key.w[1]
            )
        }
        let api = self.api;
        let y_dims = out_dims(&key)?;
        let out = with_handle(api, &stream, |handle| {
            let mut out = alloc(dev, dtype, y_dims.iter().product())?;
            let (xp, _gx) = ptr(&x.slice, xl, &stream)?;
            let (wp, _gw) = ptr(&w.slice, wl, &stream)?;
            let (yp, _gy) = ptr_mut(&mut out, &stream)?;
            let bufs = Buffers {
                x: xp,
                w: wp,
                y: yp,
                dev,
                stream: &stream,
            };
            let plan = PLANS.get_or_build(&key, || build(api, handle, &key, &bufs))?;
            match run(api, handle, &plan, &bufs) {
                Ok(()) => {}
                Err(e) => {
                    PLANS.decline(&key);
                    return Err(e);
                }
            }
            drop((_gx, _gw, _gy));
            Ok(out)
        })?;
        Ok((
            CudaStorage {
                slice: out,
                device: dev.clone(),
            },
            Shape::from(match self.channels_last {
                true => vec![y_dims[0], y_dims[2], y_dims[3], y_dims[4], y_dims[1]],
                false => y_dims.to_vec(),
            }),
        ))
    }
}
