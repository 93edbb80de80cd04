//! cuDNN as an optional accelerator, found at run time: `libcudnn.so.9` is opened with
//! `dlopen` (never linked), so the binary starts and runs where it is absent, with vidgen's own
//! kernels. Only the few C functions and enum values used here are declared (from cuDNN 9's
//! `cudnn_graph.h`, `cudnn_ops.h` and `cudnn_cnn.h`).
//!
//! Where it is looked for, in order: `VIDGEN_CUDNN` (a `libcudnn.so.9` file or its folder; `off`
//! hides cuDNN), the loader's search path, then the `nvidia/cudnn/lib` folder of a Python
//! environment's cuDNN wheel. Every failure (not found, wrong version, a status other than
//! success) is one note on stderr and a fallback to the own path, never an error of the run.

pub mod conv;
pub mod sdpa;

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_void, CStr};
use std::hash::Hash;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda::cudarc::driver::CudaStream;
use candle_core::{bail, Result};
use libloading::Library;

/// Points at a `libcudnn.so.9` (or the folder holding it); `off` hides cuDNN from the process.
pub const ENV: &str = "VIDGEN_CUDNN";
/// The cuDNN major version whose ABI is declared here.
const MAJOR: usize = 9;
/// The sub-libraries of cuDNN 9's `libcudnn.so.9` shim that the functions used here live in, in
/// dependency order: the backend API, and the legacy operations and convolutions.
const SUBLIBRARIES: [&str; 3] = [
    "libcudnn_graph.so.9",
    "libcudnn_ops.so.9",
    "libcudnn_cnn.so.9",
];
/// The sub-libraries cuDNN opens by itself at its first convolution's heuristic query (seen with
/// `LD_DEBUG=files`, bench/RESULTS.md session 43): its heuristics and engines, a few hundred MB
/// to map, read from disk on a machine's first run. [`load`] opens them too, where present, so
/// that (as [`api`] runs on the preload thread beside the first weights' read) the first
/// convolution does not wait for them.
const ENGINE_SUBLIBRARIES: [&str; 3] = [
    "libcudnn_heuristic.so.9",
    "libcudnn_engines_precompiled.so.9",
    "libcudnn_engines_runtime_compiled.so.9",
];
/// Where the H200 image's PyTorch keeps its cuDNN wheel.
const TORCH_VENV_LIB: &str = "/opt/torch/.venv/lib";

type Status = i32;
/// `cudnnHandle_t`.
pub(crate) type Handle = *mut c_void;
/// `cudnnBackendDescriptor_t` and the legacy tensor, filter and convolution descriptors.
pub(crate) type Desc = *mut c_void;

/// `CUDNN_STATUS_SUCCESS`.
const SUCCESS: Status = 0;

/// Values of `cudnnDataType_t`.
pub(crate) mod data {
    pub const FLOAT: i32 = 0;
    pub const HALF: i32 = 2;
    pub const BFLOAT16: i32 = 9;
}

/// The cuDNN data type of a candle dtype, for the dtypes the accelerated paths take.
pub(crate) fn data_type(dtype: candle_core::DType) -> Option<i32> {
    use candle_core::DType;
    match dtype {
        DType::F32 => Some(data::FLOAT),
        DType::F16 => Some(data::HALF),
        DType::BF16 => Some(data::BFLOAT16),
        _ => None,
    }
}

/// The entry points used, resolved once from the opened library.
pub struct Api {
    /// `cudnnGetVersion()`, e.g. 91900 for 9.19.0.
    pub version: usize,
    create: unsafe extern "C" fn(*mut Handle) -> Status,
    set_stream: unsafe extern "C" fn(Handle, *mut c_void) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub(crate) backend_create: unsafe extern "C" fn(i32, *mut Desc) -> Status,
    pub(crate) backend_destroy: unsafe extern "C" fn(Desc) -> Status,
    pub(crate) backend_finalize: unsafe extern "C" fn(Desc) -> Status,
    pub(crate) backend_set: unsafe extern "C" fn(Desc, i32, i32, i64, *const c_void) -> Status,
    pub(crate) backend_get:
        unsafe extern "C" fn(Desc, i32, i32, i64, *mut i64, *mut c_void) -> Status,
    pub(crate) backend_execute: unsafe extern "C" fn(Handle, Desc, Desc) -> Status,
    pub(crate) create_tensor: unsafe extern "C" fn(*mut Desc) -> Status,
    pub(crate) set_tensor_nd:
        unsafe extern "C" fn(Desc, i32, i32, *const i32, *const i32) -> Status,
    pub(crate) destroy_tensor: unsafe extern "C" fn(Desc) -> Status,
    pub(crate) create_filter: unsafe extern "C" fn(*mut Desc) -> Status,
    pub(crate) set_filter_nd: unsafe extern "C" fn(Desc, i32, i32, i32, *const i32) -> Status,
    pub(crate) destroy_filter: unsafe extern "C" fn(Desc) -> Status,
    pub(crate) create_conv: unsafe extern "C" fn(*mut Desc) -> Status,
    pub(crate) set_conv_nd:
        unsafe extern "C" fn(Desc, i32, *const i32, *const i32, *const i32, i32, i32) -> Status,
    pub(crate) set_conv_math: unsafe extern "C" fn(Desc, i32) -> Status,
    pub(crate) destroy_conv: unsafe extern "C" fn(Desc) -> Status,
    pub(crate) conv_output_dim: unsafe extern "C" fn(Desc, Desc, Desc, i32, *mut i32) -> Status,
    pub(crate) conv_fwd_algos: unsafe extern "C" fn(
        Handle,
        Desc,
        Desc,
        Desc,
        Desc,
        i32,
        *mut i32,
        *mut conv::AlgoPerf,
    ) -> Status,
    pub(crate) conv_fwd_workspace:
        unsafe extern "C" fn(Handle, Desc, Desc, Desc, Desc, i32, *mut usize) -> Status,
    /// `cudnnFindConvolutionForwardAlgorithmEx`: runs the algorithms on the given buffers and
    /// returns them fastest first.
    #[allow(clippy::type_complexity)]
    pub(crate) conv_fwd_find: unsafe extern "C" fn(
        Handle,
        Desc,
        *const c_void,
        Desc,
        *const c_void,
        Desc,
        Desc,
        *mut c_void,
        i32,
        *mut i32,
        *mut conv::AlgoPerf,
        *mut c_void,
        usize,
    ) -> Status,
    #[allow(clippy::type_complexity)]
    pub(crate) conv_fwd: unsafe extern "C" fn(
        Handle,
        *const c_void,
        Desc,
        *const c_void,
        Desc,
        *const c_void,
        Desc,
        i32,
        *mut c_void,
        usize,
        *const c_void,
        Desc,
        *mut c_void,
    ) -> Status,
    /// Keeps the entry points valid; never closed.
    _lib: Library,
    /// The sub-libraries opened before the shim (see [`SUBLIBRARIES`]).
    _sublibs: Vec<Library>,
}

impl Api {
    /// Resolves every entry point of `lib`.
    ///
    /// # Safety
    /// `lib` must be cuDNN 9: the declared signatures are its ABI.
    unsafe fn new(lib: Library) -> std::result::Result<Self, String> {
        let get_version: unsafe extern "C" fn() -> usize = sym_of(&lib, "cudnnGetVersion")?;
        Ok(Self {
            version: get_version(),
            create: sym_of(&lib, "cudnnCreate")?,
            set_stream: sym_of(&lib, "cudnnSetStream")?,
            error_string: sym_of(&lib, "cudnnGetErrorString")?,
            backend_create: sym_of(&lib, "cudnnBackendCreateDescriptor")?,
            backend_destroy: sym_of(&lib, "cudnnBackendDestroyDescriptor")?,
            backend_finalize: sym_of(&lib, "cudnnBackendFinalize")?,
            backend_set: sym_of(&lib, "cudnnBackendSetAttribute")?,
            backend_get: sym_of(&lib, "cudnnBackendGetAttribute")?,
            backend_execute: sym_of(&lib, "cudnnBackendExecute")?,
            create_tensor: sym_of(&lib, "cudnnCreateTensorDescriptor")?,
            set_tensor_nd: sym_of(&lib, "cudnnSetTensorNdDescriptor")?,
            destroy_tensor: sym_of(&lib, "cudnnDestroyTensorDescriptor")?,
            create_filter: sym_of(&lib, "cudnnCreateFilterDescriptor")?,
            set_filter_nd: sym_of(&lib, "cudnnSetFilterNdDescriptor")?,
            destroy_filter: sym_of(&lib, "cudnnDestroyFilterDescriptor")?,
            create_conv: sym_of(&lib, "cudnnCreateConvolutionDescriptor")?,
            set_conv_nd: sym_of(&lib, "cudnnSetConvolutionNdDescriptor")?,
            set_conv_math: sym_of(&lib, "cudnnSetConvolutionMathType")?,
            destroy_conv: sym_of(&lib, "cudnnDestroyConvolutionDescriptor")?,
            conv_output_dim: sym_of(&lib, "cudnnGetConvolutionNdForwardOutputDim")?,
            conv_fwd_algos: sym_of(&lib, "cudnnGetConvolutionForwardAlgorithm_v7")?,
            conv_fwd_workspace: sym_of(&lib, "cudnnGetConvolutionForwardWorkspaceSize")?,
            conv_fwd_find: sym_of(&lib, "cudnnFindConvolutionForwardAlgorithmEx")?,
            conv_fwd: sym_of(&lib, "cudnnConvolutionForward")?,
            _lib: lib,
            _sublibs: Vec::new(),
        })
    }

    /// `Ok` for `CUDNN_STATUS_SUCCESS`, else an error naming the call and cuDNN's message.
    pub(crate) fn check(&self, status: Status, what: &str) -> Result<()> {
        if status == SUCCESS {
            return Ok(());
        }
        // SAFETY: cudnnGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe {
            let p = (self.error_string)(status);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        bail!("cuDNN {what}: status {status} {text}")
    }

    /// The version as `major.minor.patch`.
    pub fn version_string(&self) -> String {
        let v = self.version;
        format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
    }
}

/// The entry point `name` of `lib`, as the function pointer type `T`.
///
/// # Safety
/// `T` must be the symbol's C signature.
unsafe fn sym_of<T: Copy>(lib: &Library, name: &str) -> std::result::Result<T, String> {
    let mut bytes = name.as_bytes().to_vec();
    bytes.push(0);
    lib.get::<T>(&bytes)
        .map(|s| *s)
        .map_err(|e| format!("{name} missing: {e}"))
}

/// Prints `text` on stderr the first time `key` is seen in this process.
pub(crate) fn note_once(key: &str, text: &str) {
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let seen = SEEN.get_or_init(Default::default);
    if seen
        .lock()
        .map(|mut s| s.insert(key.to_string()))
        .unwrap_or(false)
    {
        eprintln!("note: {text}");
    }
}

/// The loaded cuDNN, or `None` (with one note on stderr) where it is absent, hidden or unusable.
pub fn api() -> Option<&'static Api> {
    static API: OnceLock<Option<Api>> = OnceLock::new();
    API.get_or_init(|| match load() {
        Ok(api) => Some(api),
        Err(why) => {
            note_once("load", &format!("{why}; vidgen's own kernels run instead"));
            None
        }
    })
    .as_ref()
}

/// Opens the first cuDNN 9 found (see the module documentation).
fn load() -> std::result::Result<Api, String> {
    let setting = std::env::var(ENV).ok().filter(|v| !v.trim().is_empty());
    let candidates: Vec<PathBuf> = match setting.as_deref().map(str::trim) {
        Some(off) if off.eq_ignore_ascii_case("off") => {
            return Err(format!("cuDNN is hidden ({ENV}=off)"))
        }
        Some(path) => {
            let path = PathBuf::from(path);
            vec![if path.is_dir() {
                path.join("libcudnn.so.9")
            } else {
                path
            }]
        }
        None => {
            let mut c = vec![PathBuf::from("libcudnn.so.9")];
            c.extend(wheel_dirs().into_iter().map(|d| d.join("libcudnn.so.9")));
            c
        }
    };
    let mut tried = Vec::new();
    for path in &candidates {
        // The shim aborts the process when a call needs a sub-library it cannot load, so the
        // ones used here are opened first (from the shim's folder): failing that, cuDNN is
        // skipped before any of its functions runs.
        let mut sublibs = Vec::new();
        let beside = |name: &str| match path.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(dir) => dir.join(name),
            None => PathBuf::from(name),
        };
        for name in SUBLIBRARIES {
            let sub = beside(name);
            // SAFETY: as for the shim below.
            match unsafe { Library::new(&sub) } {
                Ok(lib) => sublibs.push(lib),
                Err(e) => {
                    tried.push(e.to_string());
                    break;
                }
            }
        }
        if sublibs.len() < SUBLIBRARIES.len() {
            continue;
        }
        // SAFETY: loading cuDNN runs only its initialisers, which have no preconditions.
        match unsafe { Library::new(path) } {
            Ok(lib) => {
                // SAFETY: the file is named libcudnn.so.9; the version is checked right after.
                let mut api =
                    unsafe { Api::new(lib) }.map_err(|e| format!("{}: {e}", path.display()))?;
                if api.version / 10000 != MAJOR {
                    return Err(format!(
                        "{} is cuDNN {}, not {MAJOR}.x",
                        path.display(),
                        api.version_string()
                    ));
                }
                // Best effort: cuDNN opens any that is missing here itself, when it needs it.
                // SAFETY: as for the sub-libraries above.
                sublibs.extend(
                    ENGINE_SUBLIBRARIES
                        .iter()
                        .filter_map(|name| unsafe { Library::new(beside(name)) }.ok()),
                );
                api._sublibs = sublibs;
                return Ok(api);
            }
            Err(e) => tried.push(e.to_string()),
        }
    }
    Err(format!(
        "cuDNN 9 not found (set {ENV} to a libcudnn.so.9 or its folder; tried {})",
        tried.join("; ")
    ))
}

/// `nvidia/cudnn/lib` of the Python environments where a cuDNN wheel usually is: the active
/// virtual environment, the H200 image's PyTorch, the user's and the system's site-packages.
fn wheel_dirs() -> Vec<PathBuf> {
    let mut lib_dirs: Vec<PathBuf> = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        lib_dirs.push(Path::new(&venv).join("lib"));
    }
    lib_dirs.push(PathBuf::from(TORCH_VENV_LIB));
    if let Some(home) = std::env::var_os("HOME") {
        lib_dirs.push(Path::new(&home).join(".local/lib"));
    }
    lib_dirs.push(PathBuf::from("/usr/local/lib"));
    lib_dirs.push(PathBuf::from("/usr/lib"));
    let mut out = Vec::new();
    for lib in lib_dirs {
        let Ok(entries) = std::fs::read_dir(&lib) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons {
            for site in ["site-packages", "dist-packages"] {
                let dir = py.join(site).join("nvidia/cudnn/lib");
                if dir.join("libcudnn.so.9").is_file() {
                    out.push(dir);
                }
            }
        }
    }
    out
}

/// A cuDNN handle; used only under [`HANDLES`]' lock.
struct SendHandle(Handle);
// SAFETY: a cuDNN handle may be used from any thread, one at a time (the lock ensures that).
unsafe impl Send for SendHandle {}

/// One handle per device ordinal, created on first use.
static HANDLES: Mutex<Option<HashMap<usize, SendHandle>>> = Mutex::new(None);

/// Runs `f` with the handle of `stream`'s device, bound to `stream` (candle's stream), under a
/// lock so that cuDNN calls never interleave.
pub(crate) fn with_handle<R>(
    api: &Api,
    stream: &CudaStream,
    f: impl FnOnce(Handle) -> Result<R>,
) -> Result<R> {
    let ctx = stream.context();
    ctx.bind_to_thread()
        .map_err(|e| candle_core::Error::Msg(format!("cuDNN: binding the context: {e}")))?;
    let mut guard = HANDLES
        .lock()
        .map_err(|_| candle_core::Error::Msg("cuDNN: handle lock poisoned".into()))?;
    let handles = guard.get_or_insert_with(HashMap::new);
    let ordinal = ctx.ordinal();
    let handle = match handles.entry(ordinal) {
        Entry::Occupied(e) => e.get().0,
        Entry::Vacant(e) => {
            let mut h: Handle = std::ptr::null_mut();
            // SAFETY: cudnnCreate writes a handle for the current device (bound above).
            api.check(unsafe { (api.create)(&mut h) }, "cudnnCreate")?;
            e.insert(SendHandle(h)).0
        }
    };
    // SAFETY: the handle is live; the stream belongs to the handle's device.
    api.check(
        unsafe { (api.set_stream)(handle, stream.cu_stream() as *mut c_void) },
        "cudnnSetStream",
    )?;
    f(handle)
}

/// Plans by shape, each built once; `None` remembers a shape cuDNN declined or failed to run, so
/// it goes straight to the own path afterwards.
pub(crate) struct PlanCache<K, P>(Mutex<Option<HashMap<K, Option<Arc<P>>>>>);

impl<K: Hash + Eq + Clone, P> PlanCache<K, P> {
    pub(crate) const fn new() -> Self {
        Self(Mutex::new(None))
    }

    /// The plan for `key`, built with `build` on first use.
    pub(crate) fn get_or_build(
        &self,
        key: &K,
        build: impl FnOnce() -> Result<P>,
    ) -> Result<Arc<P>> {
        let mut guard = self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("cuDNN: plan cache poisoned".into()))?;
        let plans = guard.get_or_insert_with(HashMap::new);
        if let Some(found) = plans.get(key) {
            return match found {
                Some(plan) => Ok(plan.clone()),
                None => bail!("cuDNN declined this shape before"),
            };
        }
        let built = build().map(Arc::new);
        plans.insert(key.clone(), built.as_ref().ok().cloned());
        built
    }

    /// Sends `key` to the own path from now on (its plan failed to run).
    pub(crate) fn decline(&self, key: &K) {
        if let Ok(mut guard) = self.0.lock() {
            guard
                .get_or_insert_with(HashMap::new)
                .insert(key.clone(), None);
        }
    }
}
