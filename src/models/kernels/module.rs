//! The own kernels' compiled modules. Each `.cu` file is built (build.rs) into one fat binary
//! holding machine code for sm_80 (which also runs on sm_86/87/89), sm_90, sm_100 and sm_120
//! (also sm_121, GB10) and compute_80 PTX for any other GPU. With PTX alone the driver compiled
//! every kernel of a module when it first loaded on a machine: seconds per module before the first
//! video (the implicit-GEMM and attention modules hold many variants).

use std::ops::Deref;
use std::sync::{Arc, Mutex};

use candle_core::cuda::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda::cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig,
    PushKernelArg,
};
use candle_core::cuda::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{kernels, CudaStorageSlice, WrapErr};
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, InplaceOp1, Layout, Result, Storage, Tensor,
};

/// Starts, each on a thread of its own, what the first stages would otherwise wait for inside
/// their first component: opening cuDNN's libraries (most of a second, its engines among them),
/// and loading the candle
/// kernel modules every run uses (machine code for the common GPUs, see vendor/README.md; PTX
/// that the driver compiles, seconds per module, on any other), so that work overlaps the first
/// weights' read instead of following it. A module loads once per device whichever thread asks
/// first.
/// The threads are joined when the returned guard drops, so none is inside the driver when the
/// process exits.
pub(crate) fn preload(dev: &CudaDevice) -> Preloading {
    let cudnn = std::thread::spawn(|| {
        crate::models::cudnn::api();
    });
    let dev = dev.clone();
    let modules = std::thread::spawn(move || {
        let mut noted = false;
        for module in [
            &kernels::CAST,
            &kernels::FILL,
            &kernels::AFFINE,
            &kernels::UNARY,
            &kernels::BINARY,
            &kernels::REDUCE,
            &kernels::INDEXING,
            &kernels::TERNARY,
            &kernels::CONV,
        ] {
            let start = std::time::Instant::now();
            // The module stays loaded whether or not the (empty) function name resolves.
            let _ = dev.get_or_load_func("", module);
            // Machine code, or PTX from the driver's cache, loads in milliseconds; compiling PTX
            // takes 0.2-7 s a module (18 s for all nine on an H200 host), and every CUDA call of
            // the process waits meanwhile.
            if !noted && start.elapsed() > COMPILING {
                noted = true;
                eprintln!(
                    "note: the CUDA driver is compiling candle's kernels for this GPU, once per \
                     machine and driver (cached in ~/.nv/ComputeCache, or CUDA_CACHE_PATH): this \
                     first run waits for it"
                );
            }
        }
    });
    Preloading(vec![cudnn, modules])
}

/// A module load longer than this is the driver compiling its PTX, not reading its cache.
const COMPILING: std::time::Duration = std::time::Duration::from_millis(150);

/// The threads [`preload`] started; dropping it waits for them.
pub(crate) struct Preloading(Vec<std::thread::JoinHandle<()>>);

impl Drop for Preloading {
    fn drop(&mut self) {
        for thread in self.0.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Caps the per-block shared memory the own kernels may use below what the device allows, in
/// bytes: runs the configurations a smaller GPU would get (e.g. 101376, GB10's 99 KB, on an H200).
pub const SHARED_MEMORY_LIMIT_ENV: &str = "VIDGEN_MAX_SHARED_MEMORY_PER_BLOCK";

/// Shared memory a block may opt into on `dev` (`SHARED_MEMORY_LIMIT_ENV` can lower it).
pub(crate) fn shared_memory_limit(dev: &CudaDevice) -> Option<usize> {
    let device = dev
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .ok()?;
    let device = usize::try_from(device).ok()?;
    let cap = std::env::var(SHARED_MEMORY_LIMIT_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok());
    Some(cap.map_or(device, |cap| cap.min(device)))
}

/// A fat binary and the name it is known by.
pub(crate) struct Module {
    pub name: &'static str,
    pub image: &'static [u8],
}

/// The [`Module`] built from `src/models/kernels/NAME.cu`.
macro_rules! kernel_module {
    ($name:literal) => {
        $crate::models::kernel_module::Module {
            name: $name,
            image: include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".fatbin")),
        }
    };
}
pub(crate) use kernel_module;

/// The `cpu_fwd` of a candle custom op that exists on CUDA alone, its operands named as
/// `storage layout` pairs: an error naming the op.
macro_rules! cuda_only_cpu_fwd {
    ($($storage:ident $layout:ident),+) => {
        fn cpu_fwd(
            &self,
            $($storage: &candle_core::CpuStorage, $layout: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            let _ = ($($storage, $layout),+);
            candle_core::bail!("{} runs on CUDA only", self.name())
        }
    };
}
pub(crate) use cuda_only_cpu_fwd;

/// A kernel of a loaded module, launched on the device's stream.
pub(crate) struct Func {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Deref for Func {
    type Target = CudaFunction;

    fn deref(&self) -> &CudaFunction {
        &self.func
    }
}

impl Func {
    /// A launch of the kernel on the device's stream.
    pub(crate) fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }
}

impl Module {
    /// Kernel `func` of this module on `dev`, loading the module into the device's context on
    /// first use.
    pub(crate) fn function(&'static self, dev: &CudaDevice, func: &str) -> Result<Func> {
        /// Modules loaded so far: (context, module name, module).
        type Loaded = Vec<(usize, &'static str, Arc<CudaModule>)>;
        static LOADED: Mutex<Loaded> = Mutex::new(Vec::new());
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        let key = ctx.cu_ctx() as usize;
        let module = {
            let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
            match loaded.iter().find(|(c, n, _)| *c == key && *n == self.name) {
                Some((_, _, m)) => m.clone(),
                None => {
                    let m = ctx.load_module(Ptx::from_binary(self.image.to_vec())).w()?;
                    loaded.push((key, self.name, m.clone()));
                    m
                }
            }
        };
        let func = module.load_function(func).w()?;
        Ok(Func { func, stream })
    }
}

/// Threads of a block of [`row_launch`] (`THREADS` in the row kernels).
pub(crate) const ROW_THREADS: usize = 256;
/// Threads per block and blocks per SM-ish bound of the element-wise kernels.
const ELEMENT_THREADS: u32 = 256;
const ELEMENT_BLOCKS: usize = 132 * 16;

/// A kernel argument, in the kernel's declaration order.
pub(crate) enum Arg<'a> {
    /// The tensor written in place.
    Dst,
    /// A read-only tensor (bf16, f32, f64, u32 or e4m3 codes, contiguous); `None` passes a null
    /// pointer.
    Tensor(Option<&'a Tensor>),
    /// A second tensor the kernel writes (a fresh one the caller made for it, as the
    /// destination).
    Out(&'a Tensor),
    /// The address `offset` elements into a read-only contiguous tensor.
    At(&'a Tensor, usize),
    Int(i32),
    Long(i64),
    Float(f32),
}

/// One launch of `func` of `module` with one block of `block` threads per unit of `grid`.
pub(crate) struct Launch<'a> {
    module: &'static Module,
    func: &'static str,
    /// The kernel launched instead where a pointer argument is not 16-byte aligned (`func`
    /// then reads 16 bytes at a time).
    unaligned: Option<&'static str>,
    grid: u32,
    block: u32,
    args: Vec<Arg<'a>>,
}

impl Launch<'_> {
    /// This launch, with `func` replaced by `unaligned` where a pointer is not 16-byte aligned.
    pub(crate) fn or_unaligned(self, unaligned: &'static str) -> Self {
        Self {
            unaligned: Some(unaligned),
            ..self
        }
    }
}

/// Device address of the element `offset` into the contiguous CUDA tensor `t` (bf16, f32, f64,
/// u32 or e4m3), on `dev`'s stream.
pub(crate) fn tensor_address(
    t: &Tensor,
    offset: usize,
    dev: &candle_core::CudaDevice,
) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        candle_core::bail!("kernel launch: an operand is not on CUDA")
    };
    if !layout.is_contiguous() {
        candle_core::bail!("kernel launch: operands must be contiguous")
    }
    let stream = dev.cuda_stream();
    let (base, size) = match &s.slice {
        CudaStorageSlice::BF16(s) => (s.device_ptr(&stream).0, 2),
        CudaStorageSlice::F32(s) => (s.device_ptr(&stream).0, 4),
        CudaStorageSlice::U32(s) => (s.device_ptr(&stream).0, 4),
        CudaStorageSlice::F64(s) => (s.device_ptr(&stream).0, 8),
        CudaStorageSlice::F8E4M3(s) => (s.device_ptr(&stream).0, 1),
        _ => candle_core::bail!("kernel launch: operands are bf16, f32, f64, u32 or e4m3"),
    };
    Ok(base + ((layout.start_offset() + offset) * size) as u64)
}

impl InplaceOp1 for Launch<'_> {
    fn name(&self) -> &'static str {
        self.func
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("{} runs on CUDA only", self.func)
    }

    fn cuda_fwd(&self, dst: &mut CudaStorage, dst_layout: &Layout) -> Result<()> {
        let dev = dst.device.clone();
        let stream = dev.cuda_stream();
        if !dst_layout.is_contiguous() {
            candle_core::bail!("{}: the destination must be contiguous", self.func)
        }
        let (base, size) = match &mut dst.slice {
            CudaStorageSlice::BF16(out) => (out.device_ptr_mut(&stream).0, 2),
            CudaStorageSlice::F32(out) => (out.device_ptr_mut(&stream).0, 4),
            CudaStorageSlice::F64(out) => (out.device_ptr_mut(&stream).0, 8),
            _ => candle_core::bail!("{}: the destination is bf16, f32 or f64", self.func),
        };
        let dst_address = base + (dst_layout.start_offset() * size) as u64;
        // Pointers as u64, integers and floats: owned here so the builder can borrow them.
        enum Value {
            Ptr(u64),
            Int(i32),
            Long(i64),
            Float(f32),
        }
        let values = self
            .args
            .iter()
            .map(|arg| {
                Ok(match arg {
                    Arg::Dst => Value::Ptr(dst_address),
                    Arg::Tensor(None) => Value::Ptr(0),
                    Arg::Tensor(Some(t)) | Arg::Out(t) => Value::Ptr(tensor_address(t, 0, &dev)?),
                    Arg::At(t, offset) => Value::Ptr(tensor_address(t, *offset, &dev)?),
                    Arg::Int(v) => Value::Int(*v),
                    Arg::Long(v) => Value::Long(*v),
                    Arg::Float(v) => Value::Float(*v),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let aligned = values
            .iter()
            .all(|v| !matches!(v, Value::Ptr(p) if p % 16 != 0));
        let name = match self.unaligned {
            Some(unaligned) if !aligned => unaligned,
            _ => self.func,
        };
        let func = self.module.function(&dev, name)?;
        let mut builder = func.builder();
        for value in &values {
            match value {
                Value::Ptr(v) => builder.arg(v),
                Value::Int(v) => builder.arg(v),
                Value::Long(v) => builder.arg(v),
                Value::Float(v) => builder.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (self.grid, 1, 1),
            block_dim: (self.block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments follow the kernel's signature; `supported` and the callers
        // checked dtypes, widths and contiguity, and every pointer covers the rows launched.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    }
}

/// One block of [`ROW_THREADS`] threads per unit of `grid` (a row, or a group of rows).
pub(crate) fn row_launch<'a>(
    module: &'static Module,
    func: &'static str,
    grid: usize,
    args: Vec<Arg<'a>>,
) -> Launch<'a> {
    Launch {
        module,
        func,
        unaligned: None,
        grid: grid as u32,
        block: ROW_THREADS as u32,
        args,
    }
}

/// A grid-stride launch over the bf16 pairs of `elements` elements.
pub(crate) fn element_launch<'a>(
    module: &'static Module,
    func: &'static str,
    elements: usize,
    args: Vec<Arg<'a>>,
) -> Launch<'a> {
    item_launch(module, func, elements / 2, args)
}

/// A grid-stride launch with one thread per item (up to the grid's bound).
pub(crate) fn item_launch<'a>(
    module: &'static Module,
    func: &'static str,
    items: usize,
    args: Vec<Arg<'a>>,
) -> Launch<'a> {
    Launch {
        module,
        func,
        unaligned: None,
        grid: items
            .div_ceil(ELEMENT_THREADS as usize)
            .clamp(1, ELEMENT_BLOCKS) as u32,
        block: ELEMENT_THREADS,
        args,
    }
}

/// For tests that switch a process-wide setting through the environment: each runs again in a
/// child test process with the variables set from its start, so the tests running beside it in
/// this process never see them.
#[cfg(test)]
pub(crate) mod isolated {
    /// Set in the child to the test it runs.
    const CHILD: &str = "VIDGEN_ISOLATED_TEST";

    /// Whether this process is the child running `test` (its path below the crate): then the
    /// caller runs the test's body under the environment it was given.
    pub(crate) fn is_child(test: &str) -> bool {
        std::env::var(CHILD).is_ok_and(|t| t == test)
    }

    /// Runs `test` alone in a child process with `vars` set (or, for `None`, removed); fails
    /// unless it ran and passed there.
    pub(crate) fn run(test: &str, vars: &[(&str, Option<String>)]) -> anyhow::Result<()> {
        let mut child = std::process::Command::new(std::env::current_exe()?);
        child
            .args([test, "--exact", "--test-threads", "1", "--nocapture"])
            .env(CHILD, test);
        for (name, value) in vars {
            match value {
                Some(v) => child.env(name, v),
                None => child.env_remove(name),
            };
        }
        let out = child.output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        anyhow::ensure!(
            out.status.success() && stdout.contains("1 passed"),
            "{test} with {vars:?} in a child process:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
}
