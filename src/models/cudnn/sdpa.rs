//! cuDNN's unified scaled-dot-product-attention forward (one
//! `CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR` node of the backend API, cuDNN >= 9.13.1):
//! `O = softmax(scale * Q Kᵀ) V` with bf16/f16 inputs and head_dim up to 256. q, k and v are
//! described with their own strides (no copies); execution plans are built once per shape.

use std::ffi::c_void;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Tensor,
};

use super::{api, data_type, note_once, with_handle, Api, Desc, Handle, PlanCache};

/// The first cuDNN with the unified SDPA node.
const MIN_VERSION: usize = 91301;
/// Largest head dimension the node takes.
const MAX_HEAD_DIM: usize = 256;
/// Bytes every device tensor's address and non-unit strides are a multiple of.
const ALIGNMENT: i64 = 16;

// cudnnBackendDescriptorType_t
const TENSOR_DESCRIPTOR: i32 = 17;
const OPERATION_SDPA_FWD_DESCRIPTOR: i32 = 41;
const OPERATIONGRAPH_DESCRIPTOR: i32 = 15;
const ENGINEHEUR_DESCRIPTOR: i32 = 4;
const ENGINECFG_DESCRIPTOR: i32 = 3;
const EXECUTION_PLAN_DESCRIPTOR: i32 = 5;
const VARIANT_PACK_DESCRIPTOR: i32 = 16;
// cudnnBackendAttributeType_t
const TYPE_HANDLE: i32 = 0;
const TYPE_DATA_TYPE: i32 = 1;
const TYPE_BOOLEAN: i32 = 2;
const TYPE_INT64: i32 = 3;
const TYPE_VOID_PTR: i32 = 6;
const TYPE_HEUR_MODE: i32 = 8;
const TYPE_BACKEND_DESCRIPTOR: i32 = 15;
// cudnnBackendAttributeName_t
const ATTR_TENSOR_BYTE_ALIGNMENT: i32 = 900;
const ATTR_TENSOR_DATA_TYPE: i32 = 901;
const ATTR_TENSOR_DIMENSIONS: i32 = 902;
const ATTR_TENSOR_STRIDES: i32 = 903;
const ATTR_TENSOR_UNIQUE_ID: i32 = 906;
const ATTR_TENSOR_IS_BY_VALUE: i32 = 908;
const ATTR_SDPA_FWD_QDESC: i32 = 2800;
const ATTR_SDPA_FWD_KDESC: i32 = 2801;
const ATTR_SDPA_FWD_VDESC: i32 = 2802;
const ATTR_SDPA_FWD_ODESC: i32 = 2803;
const ATTR_SDPA_FWD_SCALEDESC: i32 = 2805;
const ATTR_OPERATIONGRAPH_HANDLE: i32 = 800;
const ATTR_OPERATIONGRAPH_OPS: i32 = 801;
const ATTR_ENGINEHEUR_MODE: i32 = 200;
const ATTR_ENGINEHEUR_OPERATION_GRAPH: i32 = 201;
const ATTR_ENGINEHEUR_RESULTS: i32 = 202;
const ATTR_EXECUTION_PLAN_HANDLE: i32 = 400;
const ATTR_EXECUTION_PLAN_ENGINE_CONFIG: i32 = 401;
const ATTR_EXECUTION_PLAN_WORKSPACE_SIZE: i32 = 402;
const ATTR_VARIANT_PACK_UNIQUE_IDS: i32 = 1000;
const ATTR_VARIANT_PACK_DATA_POINTERS: i32 = 1001;
const ATTR_VARIANT_PACK_WORKSPACE: i32 = 1003;
// cudnnBackendHeurMode_t: the default heuristic, then the fallback list.
const HEUR_MODES: [i32; 2] = [3, 2];

/// Unique ids of the graph's tensors (the variant pack binds pointers by these).
const UID_Q: i64 = 1;
const UID_K: i64 = 2;
const UID_V: i64 = 3;
const UID_O: i64 = 4;
const UID_SCALE: i64 = 5;

/// A backend descriptor, destroyed on drop.
pub(crate) struct Backend {
    api: &'static Api,
    desc: Desc,
}

// SAFETY: backend descriptors are plain heap objects; they are used under the handle lock.
unsafe impl Send for Backend {}
unsafe impl Sync for Backend {}

impl Drop for Backend {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor and destroyed once.
        unsafe { (self.api.backend_destroy)(self.desc) };
    }
}

impl Backend {
    fn new(api: &'static Api, kind: i32) -> Result<Self> {
        let mut desc: Desc = std::ptr::null_mut();
        // SAFETY: writes one descriptor pointer.
        api.check(
            unsafe { (api.backend_create)(kind, &mut desc) },
            "cudnnBackendCreateDescriptor",
        )?;
        Ok(Self { api, desc })
    }

    /// Sets attribute `name` to `values` (of C type `T`, matching `ty`).
    fn set<T>(&self, name: i32, ty: i32, values: &[T]) -> Result<()> {
        // SAFETY: `values` holds `len` elements of the C type `ty` names.
        let status = unsafe {
            (self.api.backend_set)(
                self.desc,
                name,
                ty,
                values.len() as i64,
                values.as_ptr() as *const c_void,
            )
        };
        self.api
            .check(status, &format!("cudnnBackendSetAttribute({name})"))
    }

    fn finalize(&self, what: &str) -> Result<()> {
        // SAFETY: a live descriptor.
        let status = unsafe { (self.api.backend_finalize)(self.desc) };
        self.api.check(status, &format!("finalizing the {what}"))
    }

    /// A finalized tensor descriptor.
    fn tensor(
        api: &'static Api,
        uid: i64,
        dtype: i32,
        dims: &[i64],
        strides: &[i64],
        by_value: bool,
    ) -> Result<Self> {
        let t = Self::new(api, TENSOR_DESCRIPTOR)?;
        t.set(ATTR_TENSOR_DATA_TYPE, TYPE_DATA_TYPE, &[dtype])?;
        t.set(ATTR_TENSOR_DIMENSIONS, TYPE_INT64, dims)?;
        t.set(ATTR_TENSOR_STRIDES, TYPE_INT64, strides)?;
        t.set(ATTR_TENSOR_UNIQUE_ID, TYPE_INT64, &[uid])?;
        t.set(ATTR_TENSOR_BYTE_ALIGNMENT, TYPE_INT64, &[ALIGNMENT])?;
        if by_value {
            t.set(ATTR_TENSOR_IS_BY_VALUE, TYPE_BOOLEAN, &[true])?;
        }
        t.finalize("tensor descriptor")?;
        Ok(t)
    }
}

/// A finalized execution plan and everything it was built from.
struct Plan {
    plan: Backend,
    workspace: usize,
    /// Descriptors the plan was made from, kept alive with it.
    _parts: Vec<Backend>,
}

/// What a plan depends on: device, dtype, sizes and the strides of q, k and v.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    ordinal: usize,
    /// Which finalizable plan, in cuDNN's heuristic order.
    plan: usize,
    dtype: DType,
    dims: [usize; 5],
    strides: [[usize; 3]; 3],
}

static PLANS: PlanCache<Key, Plan> = PlanCache::new();

/// Whether the inputs are of a kind the node takes (the plan may still decline the shape):
/// CUDA, cuDNN >= 9.13.1 loaded, bf16 or f16, equal batch and heads, head_dim a multiple of 8
/// up to 256, at least one key.
fn eligible(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    crate::models::attention::fused_shapes(q, k, v)
        .is_some_and(|(.., d)| d <= MAX_HEAD_DIM && d.is_multiple_of(8))
}

/// Attention over `[batch, heads, seq, head_dim]` through cuDNN, or `None` (the caller runs its
/// own kernel) where cuDNN is absent, too old, declines the shape or fails; a failure is one
/// note on stderr. The result is a `[batch, heads, q_len, head_dim]` view of
/// `[batch, q_len, heads, head_dim]` storage, as the own fused kernel returns.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Option<Tensor> {
    if !eligible(q, k, v) {
        return None;
    }
    let api = api()?;
    if api.version < MIN_VERSION {
        note_once(
            "sdpa-version",
            &format!(
                "cuDNN {} has no unified attention node (needs 9.13.1): vidgen's own attention kernel runs",
                api.version_string()
            ),
        );
        return None;
    }
    match run_plan(api, q, k, v, scale, 0) {
        Ok(out) => Some(out),
        Err(e) => {
            note_once(
                "sdpa-failed",
                &format!("cuDNN attention failed ({e}); vidgen's own attention kernel runs"),
            );
            None
        }
    }
}

/// [`sdpa`] through the `plan`-th execution plan cuDNN finalizes for the shape, in its
/// heuristics' order (0 is the one [`sdpa`] runs): for benches comparing cuDNN's candidates. An
/// error past the last plan, where cuDNN is absent or older than the node, or the inputs are not
/// of a kind it takes.
pub fn sdpa_with_plan(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    plan: usize,
) -> Result<Tensor> {
    let api = api().filter(|api| api.version >= MIN_VERSION && eligible(q, k, v));
    let Some(api) = api else {
        bail!("cuDNN attention: no cuDNN >= 9.13.1, or inputs it does not take")
    };
    run_plan(api, q, k, v, scale, plan)
}

fn run_plan(
    api: &'static Api,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    plan: usize,
) -> Result<Tensor> {
    let aligned = crate::models::attention::flash_attn::aligned;
    let op = Sdpa {
        api,
        scale: scale as f32,
        plan,
    };
    aligned(q)?
        .apply_op3_no_bwd(&aligned(k)?, &aligned(v)?, &op)?
        .transpose(1, 2)
}

struct Sdpa {
    api: &'static Api,
    scale: f32,
    /// Which finalizable plan to run (0: cuDNN's first choice).
    plan: usize,
}

/// The first three strides of a 4D layout whose last stride is 1.
fn strides3(l: &Layout) -> Result<[usize; 3]> {
    let s = l.stride();
    if s.len() != 4 || s[3] != 1 {
        bail!("cuDNN attention: the head dimension must be contiguous")
    }
    Ok([s[0], s[1], s[2]])
}

impl Sdpa {
    /// Builds the graph (one SDPA node) and the `key.plan`-th execution plan cuDNN can finalize.
    fn build(&self, handle: Handle, key: &Key) -> Result<Plan> {
        let api = self.api;
        let dt = data_type(key.dtype).expect("bf16 or f16");
        let [b, h, n, m, d] = key.dims.map(|x| x as i64);
        let st = |s: [usize; 3]| [s[0] as i64, s[1] as i64, s[2] as i64, 1];
        let qd = Backend::tensor(api, UID_Q, dt, &[b, h, n, d], &st(key.strides[0]), false)?;
        let kd = Backend::tensor(api, UID_K, dt, &[b, h, m, d], &st(key.strides[1]), false)?;
        let vd = Backend::tensor(api, UID_V, dt, &[b, h, m, d], &st(key.strides[2]), false)?;
        // The output is written as [batch, q_len, heads, head_dim] storage.
        let os = [n * h * d, d, h * d, 1];
        let od = Backend::tensor(api, UID_O, dt, &[b, h, n, d], &os, false)?;
        let sd = Backend::tensor(
            api,
            UID_SCALE,
            super::data::FLOAT,
            &[1, 1, 1, 1],
            &[1, 1, 1, 1],
            true,
        )?;
        let op = Backend::new(api, OPERATION_SDPA_FWD_DESCRIPTOR)?;
        op.set(ATTR_SDPA_FWD_QDESC, TYPE_BACKEND_DESCRIPTOR, &[qd.desc])?;
        op.set(ATTR_SDPA_FWD_KDESC, TYPE_BACKEND_DESCRIPTOR, &[kd.desc])?;
        op.set(ATTR_SDPA_FWD_VDESC, TYPE_BACKEND_DESCRIPTOR, &[vd.desc])?;
        op.set(ATTR_SDPA_FWD_ODESC, TYPE_BACKEND_DESCRIPTOR, &[od.desc])?;
        op.set(ATTR_SDPA_FWD_SCALEDESC, TYPE_BACKEND_DESCRIPTOR, &[sd.desc])?;
        op.finalize("SDPA operation")?;
        let graph = Backend::new(api, OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set(ATTR_OPERATIONGRAPH_OPS, TYPE_BACKEND_DESCRIPTOR, &[op.desc])?;
        graph.set(ATTR_OPERATIONGRAPH_HANDLE, TYPE_HANDLE, &[handle])?;
        graph.finalize("operation graph")?;
        let mut last_error = None;
        let mut skip = key.plan;
        for mode in HEUR_MODES {
            let heur = Backend::new(api, ENGINEHEUR_DESCRIPTOR)?;
            heur.set(
                ATTR_ENGINEHEUR_OPERATION_GRAPH,
                TYPE_BACKEND_DESCRIPTOR,
                &[graph.desc],
            )?;
            heur.set(ATTR_ENGINEHEUR_MODE, TYPE_HEUR_MODE, &[mode])?;
            if let Err(e) = heur.finalize("engine heuristics") {
                last_error = Some(e);
                continue;
            }
            let mut count: i64 = 0;
            // SAFETY: with a requested count of 0 only the available count is written.
            api.check(
                unsafe {
                    (api.backend_get)(
                        heur.desc,
                        ATTR_ENGINEHEUR_RESULTS,
                        TYPE_BACKEND_DESCRIPTOR,
                        0,
                        &mut count,
                        std::ptr::null_mut(),
                    )
                },
                "counting engine configs",
            )?;
            let configs = (0..count.max(0))
                .map(|_| Backend::new(api, ENGINECFG_DESCRIPTOR))
                .collect::<Result<Vec<_>>>()?;
            let mut raw: Vec<Desc> = configs.iter().map(|c| c.desc).collect();
            let mut returned: i64 = 0;
            // SAFETY: `raw` holds `count` created engine-config descriptors to fill.
            api.check(
                unsafe {
                    (api.backend_get)(
                        heur.desc,
                        ATTR_ENGINEHEUR_RESULTS,
                        TYPE_BACKEND_DESCRIPTOR,
                        raw.len() as i64,
                        &mut returned,
                        raw.as_mut_ptr() as *mut c_void,
                    )
                },
                "reading engine configs",
            )?;
            let returned = (returned.max(0) as usize).min(configs.len());
            for config in configs.into_iter().take(returned) {
                let plan = Backend::new(api, EXECUTION_PLAN_DESCRIPTOR)?;
                plan.set(ATTR_EXECUTION_PLAN_HANDLE, TYPE_HANDLE, &[handle])?;
                plan.set(
                    ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                    TYPE_BACKEND_DESCRIPTOR,
                    &[config.desc],
                )?;
                if let Err(e) = plan.finalize("execution plan") {
                    last_error = Some(e);
                    continue;
                }
                if skip > 0 {
                    skip -= 1;
                    continue;
                }
                let mut workspace: i64 = 0;
                let mut got: i64 = 0;
                // SAFETY: one int64 is written.
                api.check(
                    unsafe {
                        (api.backend_get)(
                            plan.desc,
                            ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                            TYPE_INT64,
                            1,
                            &mut got,
                            &mut workspace as *mut i64 as *mut c_void,
                        )
                    },
                    "reading the workspace size",
                )?;
                return Ok(Plan {
                    plan,
                    workspace: workspace.max(0) as usize,
                    _parts: vec![config, heur, graph, op, qd, kd, vd, od, sd],
                });
            }
        }
        match last_error {
            _ if key.plan > 0 => bail!("cuDNN attention: no plan {} for this shape", key.plan),
            Some(e) => Err(e),
            None => bail!("cuDNN attention: no engine for this shape"),
        }
    }

    /// Runs the plan on raw device pointers (already offset to each tensor's start).
    fn execute(
        &self,
        handle: Handle,
        plan: &Plan,
        pointers: [*mut c_void; 4],
        workspace: *mut c_void,
    ) -> Result<()> {
        let api = self.api;
        let mut scale = self.scale;
        let pack = Backend::new(api, VARIANT_PACK_DESCRIPTOR)?;
        let uids = [UID_Q, UID_K, UID_V, UID_O, UID_SCALE];
        let ptrs: [*mut c_void; 5] = [
            pointers[0],
            pointers[1],
            pointers[2],
            pointers[3],
            // The scale is passed by value: a host pointer to the f32.
            &mut scale as *mut f32 as *mut c_void,
        ];
        pack.set(ATTR_VARIANT_PACK_UNIQUE_IDS, TYPE_INT64, &uids)?;
        pack.set(ATTR_VARIANT_PACK_DATA_POINTERS, TYPE_VOID_PTR, &ptrs)?;
        pack.set(ATTR_VARIANT_PACK_WORKSPACE, TYPE_VOID_PTR, &[workspace])?;
        pack.finalize("variant pack")?;
        // SAFETY: the plan was finalized for this handle; the pointers match its tensors.
        let status = unsafe { (api.backend_execute)(handle, plan.plan.desc, pack.desc) };
        api.check(status, "cudnnBackendExecute (attention)")
    }

    /// Attention over the storages of q, k and v with their layouts.
    fn run(
        &self,
        (q, ql): (&CudaStorage, &Layout),
        (k, kl): (&CudaStorage, &Layout),
        (v, vl): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorageSlice, Shape)> {
        let dev = &q.device;
        let (b, h, n, d) = ql.shape().dims4()?;
        let m = kl.dims()[2];
        let dtype = q.dtype();
        let stream = dev.cuda_stream();
        let key = Key {
            ordinal: stream.context().ordinal(),
            plan: self.plan,
            dtype,
            dims: [b, h, n, m, d],
            strides: [strides3(ql)?, strides3(kl)?, strides3(vl)?],
        };
        let out = with_handle(self.api, &stream, |handle| {
            let plan = PLANS.get_or_build(&key, || self.build(handle, &key))?;
            let mut out = alloc(dev, dtype, b * n * h * d)?;
            let ws = if plan.workspace > 0 {
                // SAFETY: scratch cuDNN writes before it reads.
                Some(unsafe { dev.alloc::<u8>(plan.workspace) }?)
            } else {
                None
            };
            let (qp, _gq) = ptr(&q.slice, ql, &stream)?;
            let (kp, _gk) = ptr(&k.slice, kl, &stream)?;
            let (vp, _gv) = ptr(&v.slice, vl, &stream)?;
            let (op, _go) = ptr_mut(&mut out, &stream)?;
            let (wp, _gw) = match &ws {
                Some(ws) => {
                    let (p, g) = ws.device_ptr(&stream);
                    (p as *mut c_void, Some(g))
                }
                None => (std::ptr::null_mut(), None),
            };
            if let Err(e) = self.execute(handle, &plan, [qp, kp, vp, op], wp) {
                PLANS.decline(&key);
                return Err(e);
            }
            drop((_gq, _gk, _gv, _go, _gw));
            Ok(out)
        })?;
        Ok((out, Shape::from((b, n, h, d))))
    }
}

/// Fresh device storage of `len` elements of `dtype` (bf16, f16 or f32).
pub(crate) fn alloc(dev: &CudaDevice, dtype: DType, len: usize) -> Result<CudaStorageSlice> {
    // SAFETY: every element is written by the cuDNN call the storage is made for.
    Ok(match dtype {
        DType::BF16 => CudaStorageSlice::BF16(unsafe { dev.alloc(len) }?),
        DType::F16 => CudaStorageSlice::F16(unsafe { dev.alloc(len) }?),
        DType::F32 => CudaStorageSlice::F32(unsafe { dev.alloc(len) }?),
        other => bail!("cuDNN: {other:?} is not supported"),
    })
}

/// The device address of `layout`'s first element in `slice`, with the guard that records the
/// use on `stream` when dropped.
pub(crate) fn ptr<'a>(
    slice: &'a CudaStorageSlice,
    layout: &Layout,
    stream: &'a CudaStream,
) -> Result<(
    *mut c_void,
    candle_core::cuda::cudarc::driver::SyncOnDrop<'a>,
)> {
    let (base, guard, size) = match slice {
        CudaStorageSlice::BF16(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, g, 2)
        }
        CudaStorageSlice::F16(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, g, 2)
        }
        CudaStorageSlice::F32(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, g, 4)
        }
        _ => bail!("cuDNN: bf16, f16 or f32 storage expected"),
    };
    let addr = base + (layout.start_offset() * size) as u64;
    Ok((addr as *mut c_void, guard))
}

/// The device address of a fresh output's first element.
pub(crate) fn ptr_mut<'a>(
    slice: &'a mut CudaStorageSlice,
    stream: &'a CudaStream,
) -> Result<(
    *mut c_void,
    candle_core::cuda::cudarc::driver::SyncOnDrop<'a>,
)> {
    let (p, g) = match slice {
        CudaStorageSlice::BF16(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::F16(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::F32(s) => s.device_ptr_mut(stream),
        _ => bail!("cuDNN: bf16, f16 or f32 storage expected"),
    };
    Ok((p as *mut c_void, g))
}

impl CustomOp3 for Sdpa {
    fn name(&self) -> &'static str {
        "cudnn-sdpa"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("cuDNN attention runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (slice, shape) = self.run((q, ql), (k, kl), (v, vl))?;
        Ok((
            CudaStorage {
                slice,
                device: q.device.clone(),
            },
            shape,
        ))
    }
}
