//! cuDNN's unified scaled-dot-product-attention forward (one
//! `CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR` node of the backend API, cuDNN >= 9.13.1):
//! `O = softmax(scale * Q Kᵀ) V` with bf16/f16 inputs and head_dim up to 256. q, k and v are
//! described with their own strides (no copies); execution plans are built once per shape.

use std::ffi::c_void;
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{bail, CudaDevice, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::{api, data_type, note_once, with_handle, Api, Desc, Handle, PlanCache};

/// The first cuDNN with the unified SDPA node.
const MIN_VERSION: usize = 91301;
/// Largest head dimension the node takes.
const MAX_HEAD_DIM: usize = 256;
/// Bytes every device tensor's address and non-unit strides are a multiple of.
const ALIGNMENT: i64 = 16;

// cudnnBackendDescriptorType_t
const ENGINE_DESCRIPTOR: i32 = 2;
const KNOB_CHOICE_DESCRIPTOR: i32 = 7;
const KNOB_INFO_DESCRIPTOR: i32 = 8;
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
const TYPE_KNOB_TYPE: i32 = 9;
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
const ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT: i32 = 802;
const ATTR_ENGINEHEUR_MODE: i32 = 200;
const ATTR_ENGINEHEUR_OPERATION_GRAPH: i32 = 201;
const ATTR_ENGINEHEUR_RESULTS: i32 = 202;
const ATTR_ENGINECFG_ENGINE: i32 = 300;
const ATTR_ENGINECFG_KNOB_CHOICES: i32 = 302;
const ATTR_KNOB_CHOICE_KNOB_TYPE: i32 = 600;
const ATTR_KNOB_CHOICE_KNOB_VALUE: i32 = 601;
const ATTR_KNOB_INFO_TYPE: i32 = 1200;
const ATTR_KNOB_INFO_MAXIMUM_VALUE: i32 = 1201;
const ATTR_KNOB_INFO_MINIMUM_VALUE: i32 = 1202;
const ATTR_KNOB_INFO_STRIDE: i32 = 1203;
const ATTR_ENGINE_OPERATION_GRAPH: i32 = 1300;
const ATTR_ENGINE_GLOBAL_INDEX: i32 = 1301;
const ATTR_ENGINE_KNOB_INFO: i32 = 1302;
const ATTR_EXECUTION_PLAN_HANDLE: i32 = 400;
const ATTR_EXECUTION_PLAN_ENGINE_CONFIG: i32 = 401;
const ATTR_EXECUTION_PLAN_WORKSPACE_SIZE: i32 = 402;
const ATTR_VARIANT_PACK_UNIQUE_IDS: i32 = 1000;
const ATTR_VARIANT_PACK_DATA_POINTERS: i32 = 1001;
const ATTR_VARIANT_PACK_WORKSPACE: i32 = 1003;
// cudnnBackendHeurMode_t: the default heuristic, then the fallback list.
const HEUR_MODES: [i32; 2] = [3, 2];
/// More knobs than any engine has (cuDNN 9 names fewer than 64 knob types).
const MAX_KNOBS: usize = 64;
/// Most knob combinations tried per engine beyond cuDNN's own choices (benches only).
const MAX_VARIANTS: usize = 512;

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

    /// Reads attribute `name` (type `ty`) into `out`, which holds `requested` elements of that
    /// C type (0: only the count is wanted); returns how many cuDNN has.
    ///
    /// # Safety
    /// `out` must hold `requested` elements of the C type `ty` names.
    unsafe fn get(&self, name: i32, ty: i32, requested: usize, out: *mut c_void) -> Result<i64> {
        let mut count: i64 = 0;
        // SAFETY: the caller's contract.
        let status = unsafe {
            (self.api.backend_get)(self.desc, name, ty, requested as i64, &mut count, out)
        };
        self.api
            .check(status, &format!("cudnnBackendGetAttribute({name})"))?;
        Ok(count)
    }

    /// How many values attribute `name` (of type `ty`) holds.
    fn count(&self, name: i32, ty: i32) -> Result<usize> {
        // SAFETY: nothing is requested, so nothing is written.
        Ok(unsafe { self.get(name, ty, 0, std::ptr::null_mut()) }?.max(0) as usize)
    }

    /// Attribute `name`'s descriptors of `kind` (at most `max`): cuDNN fills descriptors made here.
    fn descriptors(&self, name: i32, kind: i32, max: usize) -> Result<Vec<Backend>> {
        let made = (0..max)
            .map(|_| Backend::new(self.api, kind))
            .collect::<Result<Vec<_>>>()?;
        let mut raw: Vec<Desc> = made.iter().map(|d| d.desc).collect();
        // SAFETY: `raw` holds `max` created descriptors of the attribute's kind to fill.
        let out = raw.as_mut_ptr() as *mut c_void;
        let returned = unsafe { self.get(name, TYPE_BACKEND_DESCRIPTOR, max, out) }?;
        Ok(made
            .into_iter()
            .take(returned.clamp(0, max as i64) as usize)
            .collect())
    }

    /// Attribute `name`'s one value of C type `T` (matching `ty`).
    fn scalar<T: Default>(&self, name: i32, ty: i32) -> Result<T> {
        let mut value = T::default();
        // SAFETY: one element of type T, which the callers match to `ty`.
        unsafe { self.get(name, ty, 1, &mut value as *mut T as *mut c_void) }?;
        Ok(value)
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
    /// The engine and knob settings it runs, for benches to print.
    choice: String,
    /// Descriptors the plan was made from, kept alive with it.
    _parts: Vec<Backend>,
}

/// Which engine config a plan runs.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Pick {
    /// The first of cuDNN's heuristic configs that finalizes (what [`sdpa`] runs).
    First,
    /// Candidate `n` (see [`sdpa_with_plan`]), or an error where it does not finalize.
    Candidate(usize),
}

/// What a plan depends on: device, dtype, sizes and the strides of q, k and v.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    ordinal: usize,
    pick: Pick,
    dtype: DType,
    dims: [usize; 5],
    strides: [[usize; 3]; 3],
}

/// An engine and its knob settings (`cudnnBackendKnobType_t` value, setting): what an engine
/// config is made of.
#[derive(Clone, PartialEq, Eq)]
struct EngineChoice {
    engine: i64,
    knobs: Vec<(i32, i64)>,
}

impl std::fmt::Display for EngineChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "engine {} knobs", self.engine)?;
        for (ty, value) in &self.knobs {
            write!(f, " {ty}={value}")?;
        }
        Ok(())
    }
}

impl EngineChoice {
    /// What an engine config (one of cuDNN's heuristic results) chose.
    fn of(config: &Backend) -> Result<Self> {
        let Some(engine) = config
            .descriptors(ATTR_ENGINECFG_ENGINE, ENGINE_DESCRIPTOR, 1)?
            .pop()
        else {
            bail!("cuDNN attention: an engine config without an engine")
        };
        let mut knobs = config
            .descriptors(
                ATTR_ENGINECFG_KNOB_CHOICES,
                KNOB_CHOICE_DESCRIPTOR,
                MAX_KNOBS,
            )?
            .iter()
            .map(|c| {
                Ok((
                    c.scalar::<i32>(ATTR_KNOB_CHOICE_KNOB_TYPE, TYPE_KNOB_TYPE)?,
                    c.scalar::<i64>(ATTR_KNOB_CHOICE_KNOB_VALUE, TYPE_INT64)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        knobs.sort_unstable();
        Ok(Self {
            engine: engine.scalar(ATTR_ENGINE_GLOBAL_INDEX, TYPE_INT64)?,
            knobs,
        })
    }

    /// A finalized engine descriptor of this engine for `graph`.
    fn engine(&self, api: &'static Api, graph: &Backend) -> Result<Backend> {
        let engine = Backend::new(api, ENGINE_DESCRIPTOR)?;
        engine.set(
            ATTR_ENGINE_OPERATION_GRAPH,
            TYPE_BACKEND_DESCRIPTOR,
            &[graph.desc],
        )?;
        engine.set(ATTR_ENGINE_GLOBAL_INDEX, TYPE_INT64, &[self.engine])?;
        engine.finalize("engine")?;
        Ok(engine)
    }

    /// Other settings of this engine's knobs, at most [`MAX_VARIANTS`]: each knob alone through
    /// its range first, then every combination of the ranges.
    fn variants(&self, api: &'static Api, graph: &Backend) -> Result<Vec<EngineChoice>> {
        /// Most settings tried per knob.
        const MAX_SETTINGS: usize = 256;
        let engine = self.engine(api, graph)?;
        let mut space = Vec::new();
        for info in engine.descriptors(ATTR_ENGINE_KNOB_INFO, KNOB_INFO_DESCRIPTOR, MAX_KNOBS)? {
            let ty = info.scalar::<i32>(ATTR_KNOB_INFO_TYPE, TYPE_KNOB_TYPE)?;
            let min = info.scalar::<i64>(ATTR_KNOB_INFO_MINIMUM_VALUE, TYPE_INT64)?;
            let max = info.scalar::<i64>(ATTR_KNOB_INFO_MAXIMUM_VALUE, TYPE_INT64)?;
            let stride = info
                .scalar::<i64>(ATTR_KNOB_INFO_STRIDE, TYPE_INT64)?
                .max(1);
            let settings: Vec<i64> = (min..=max)
                .step_by(stride as usize)
                .take(MAX_SETTINGS)
                .collect();
            space.push((ty, settings));
        }
        space.sort_unstable();
        let with = |ty: i32, value: i64| {
            let mut knobs = self.knobs.clone();
            match knobs.iter_mut().find(|(t, _)| *t == ty) {
                Some(knob) => knob.1 = value,
                None => knobs.push((ty, value)),
            }
            knobs.sort_unstable();
            EngineChoice {
                engine: self.engine,
                knobs,
            }
        };
        let mut out: Vec<EngineChoice> = Vec::new();
        let mut push = |choice: EngineChoice| {
            if choice != *self && !out.contains(&choice) && out.len() < MAX_VARIANTS {
                out.push(choice);
            }
        };
        for (ty, settings) in &space {
            settings.iter().for_each(|&v| push(with(*ty, v)));
        }
        // The product of the ranges, cut early: past MAX_VARIANTS nothing more is kept, and a
        // few times that leaves room for the combinations already pushed above.
        let mut combos: Vec<Vec<(i32, i64)>> = vec![Vec::new()];
        for (ty, settings) in &space {
            combos = combos
                .iter()
                .flat_map(|c| {
                    settings.iter().map(move |&v| {
                        let mut c = c.clone();
                        c.push((*ty, v));
                        c
                    })
                })
                .take(4 * MAX_VARIANTS)
                .collect();
        }
        for knobs in combos {
            push(EngineChoice {
                engine: self.engine,
                knobs,
            });
        }
        Ok(out)
    }

    /// A finalized engine config with these settings, and the descriptors it holds.
    fn config(&self, api: &'static Api, graph: &Backend) -> Result<(Backend, Vec<Backend>)> {
        let engine = self.engine(api, graph)?;
        let mut parts = Vec::new();
        for &(ty, value) in &self.knobs {
            let choice = Backend::new(api, KNOB_CHOICE_DESCRIPTOR)?;
            choice.set(ATTR_KNOB_CHOICE_KNOB_TYPE, TYPE_KNOB_TYPE, &[ty])?;
            choice.set(ATTR_KNOB_CHOICE_KNOB_VALUE, TYPE_INT64, &[value])?;
            choice.finalize("knob choice")?;
            parts.push(choice);
        }
        let config = Backend::new(api, ENGINECFG_DESCRIPTOR)?;
        config.set(
            ATTR_ENGINECFG_ENGINE,
            TYPE_BACKEND_DESCRIPTOR,
            &[engine.desc],
        )?;
        let knobs: Vec<Desc> = parts.iter().map(|c| c.desc).collect();
        if !knobs.is_empty() {
            config.set(ATTR_ENGINECFG_KNOB_CHOICES, TYPE_BACKEND_DESCRIPTOR, &knobs)?;
        }
        config.finalize("engine config")?;
        parts.push(engine);
        Ok((config, parts))
    }
}

impl Plan {
    /// The plan, also holding `parts` alive.
    fn with_parts(mut self, parts: impl IntoIterator<Item = Backend>) -> Self {
        self._parts.extend(parts);
        self
    }
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
    match run_plan(api, q, k, v, scale, Pick::First) {
        Ok((out, _)) => Some(out),
        Err(e) => {
            note_once(
                "sdpa-failed",
                &format!("cuDNN attention failed ({e}); vidgen's own attention kernel runs"),
            );
            None
        }
    }
}

/// [`sdpa`] through candidate `n` of the engine configs for the shape, with the engine and knob
/// settings it runs: for benches comparing them. The candidates are cuDNN's heuristic configs in
/// their order (0 is the one [`sdpa`] runs where it finalizes), then the other knob settings of
/// their engines. An error where candidate `n` does not finalize (past the last one: "no
/// candidate"), where cuDNN is absent or older than the node, or the inputs are not of a kind it
/// takes.
pub fn sdpa_with_plan(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    n: usize,
) -> Result<(Tensor, String)> {
    let api = api().filter(|api| api.version >= MIN_VERSION && eligible(q, k, v));
    let Some(api) = api else {
        bail!("cuDNN attention: no cuDNN >= 9.13.1, or inputs it does not take")
    };
    run_plan(api, q, k, v, scale, Pick::Candidate(n))
}

/// Attention through the picked plan, and the engine and knob settings that plan runs.
fn run_plan(
    api: &'static Api,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    pick: Pick,
) -> Result<(Tensor, String)> {
    let aligned = crate::models::attention::flash_attn::aligned;
    let op = Sdpa {
        api,
        scale: scale as f32,
        pick,
        choice: Mutex::new(String::new()),
    };
    let out = aligned(q)?
        .apply_op3_no_bwd(&aligned(k)?, &aligned(v)?, &op)?
        .transpose(1, 2)?;
    let choice = op.choice.into_inner().unwrap_or_default();
    Ok((out, choice))
}

struct Sdpa {
    api: &'static Api,
    scale: f32,
    pick: Pick,
    /// The engine and knob settings the plan ran, written by the run.
    choice: Mutex<String>,
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
        let mut chosen: Vec<EngineChoice> = Vec::new();
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
            let count = heur.count(ATTR_ENGINEHEUR_RESULTS, TYPE_BACKEND_DESCRIPTOR)?;
            let configs = heur.descriptors(ATTR_ENGINEHEUR_RESULTS, ENGINECFG_DESCRIPTOR, count)?;
            for config in configs {
                // A config that cannot be read back is still run, but never counted as a candidate.
                let choice = EngineChoice::of(&config).ok();
                let wanted = match (&choice, key.pick) {
                    (Some(c), _) if chosen.contains(c) => false,
                    (Some(c), pick) => {
                        chosen.push(c.clone());
                        pick == Pick::First || pick == Pick::Candidate(chosen.len() - 1)
                    }
                    (None, pick) => pick == Pick::First,
                };
                if !wanted {
                    continue;
                }
                let label = choice.map_or_else(|| "engine ?".into(), |c| c.to_string());
                match self.plan(handle, config, label, Vec::new()) {
                    Ok(plan) => return Ok(plan.with_parts([heur, graph, op, qd, kd, vd, od, sd])),
                    Err(e) if key.pick == Pick::First => last_error = Some(e),
                    Err(e) => return Err(e),
                }
            }
        }
        // Past cuDNN's own configs (benches only): the other knob settings of their engines,
        // then every other engine of the graph with its own defaults and their variants.
        if let Pick::Candidate(n) = key.pick {
            let engines: i64 = graph.scalar(ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT, TYPE_INT64)?;
            let mut bases = chosen.clone();
            for engine in 0..engines {
                if !bases.iter().any(|b| b.engine == engine) {
                    bases.push(EngineChoice {
                        engine,
                        knobs: Vec::new(),
                    });
                }
            }
            for base in bases {
                let variants = base.variants(api, &graph).unwrap_or_default();
                for choice in std::iter::once(base).chain(variants) {
                    if chosen.contains(&choice) {
                        continue;
                    }
                    chosen.push(choice.clone());
                    if n + 1 == chosen.len() {
                        let (config, parts) = choice.config(api, &graph)?;
                        let plan = self.plan(handle, config, choice.to_string(), parts)?;
                        return Ok(plan.with_parts([graph, op, qd, kd, vd, od, sd]));
                    }
                }
            }
            bail!("cuDNN attention: no candidate {n} for this shape")
        }
        match last_error {
            Some(e) => Err(e),
            None => bail!("cuDNN attention: no engine for this shape"),
        }
    }

    /// The execution plan of a finalized engine config, holding `parts` alive.
    fn plan(
        &self,
        handle: Handle,
        config: Backend,
        choice: String,
        mut parts: Vec<Backend>,
    ) -> Result<Plan> {
        let api = self.api;
        let plan = Backend::new(api, EXECUTION_PLAN_DESCRIPTOR)?;
        plan.set(ATTR_EXECUTION_PLAN_HANDLE, TYPE_HANDLE, &[handle])?;
        plan.set(
            ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
            TYPE_BACKEND_DESCRIPTOR,
            &[config.desc],
        )?;
        plan.finalize("execution plan")?;
        let workspace: i64 = plan.scalar(ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, TYPE_INT64)?;
        parts.push(config);
        Ok(Plan {
            plan,
            workspace: workspace.max(0) as usize,
            choice,
            _parts: parts,
        })
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
            pick: self.pick,
            dtype,
            dims: [b, h, n, m, d],
            strides: [strides3(ql)?, strides3(kl)?, strides3(vl)?],
        };
        let out = with_handle(self.api, &stream, |handle| {
            let plan = PLANS.get_or_build(&key, || self.build(handle, &key))?;
            if let Ok(mut choice) = self.choice.lock() {
                choice.clone_from(&plan.choice);
            }
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
