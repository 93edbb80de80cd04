//! The own kernels' compiled modules. Each `.cu` file is built (build.rs) into one fat binary
//! holding machine code for sm_80 (which also runs on sm_86/87/89), sm_90, sm_100 and sm_120
//! (also sm_121, GB10) and compute_80 PTX for any other GPU. With PTX alone the driver compiled
//! every kernel of a module when it first loaded on a machine: seconds per module before the first
//! video (the implicit-GEMM and attention modules hold many variants).

use std::ops::Deref;
use std::sync::{Arc, Mutex};

use candle_core::cuda::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda::cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchArgs};
use candle_core::cuda::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{kernels, WrapErr};
use candle_core::{CudaDevice, Result};

/// Starts, each on a thread of its own, what the first stages would otherwise wait for inside
/// their first component: opening cuDNN's libraries (most of a second), and loading the candle
/// kernel modules every run uses. Those are PTX, which the driver compiles on a machine's first
/// run (seconds per module; cached by the driver after), so that work overlaps the first weights'
/// read instead of following it. A module loads once per device whichever thread asks first.
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
            // From the driver's cache a module loads in milliseconds; compiling one takes
            // 0.2-7 s (18 s for all nine on an H200 host), and every CUDA call of the process
            // waits meanwhile.
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
