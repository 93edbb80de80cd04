//! Which device runs the job and what kind of memory it has.

use serde::{Deserialize, Serialize};

/// A device the run cannot have, with the fix (the command line reports it as bad input).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DeviceError(String);

impl DeviceError {
    fn new(message: impl Into<String>) -> Self {
        DeviceError(message.into())
    }
}

/// How the accelerator's memory relates to host memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryModel {
    /// A GPU with its own memory behind a host link: offloading to the host saves device memory.
    Discrete,
    /// GPU and CPU share one memory (DGX Spark/GB10, Jetson, Apple): host copies only duplicate.
    Unified,
    /// No accelerator: there is nowhere to offload from.
    None,
}

/// The kind of compute device.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Cpu,
    Cuda,
    Metal,
}

/// What the probe found about the selected device(s).
#[derive(Clone, Debug, Serialize)]
pub struct DeviceInfo {
    pub kind: DeviceKind,
    /// The first selected ordinal (0 for CPU and Metal).
    pub ordinal: usize,
    /// Human-readable name, e.g. "NVIDIA H200" or "cpu".
    pub name: String,
    /// Total memory of the device in bytes, when known.
    pub total_memory: Option<u64>,
    /// Memory free for this run when it started, when known: the device's free memory once
    /// this process's context exists, and on unified memory no more than the host has
    /// available (one pool shared with everything else the machine runs).
    pub free_memory: Option<u64>,
    /// Host memory this process may still take when it started ([`host_available`]): the
    /// budget of everything vidgen holds in host memory; its share where several processes of
    /// this machine start together ([`Self::host_sharers`]).
    #[serde(skip)]
    pub host_available: Option<u64>,
    /// The processes of this machine that start together and share its host memory (the ranks
    /// of a run on several GPUs; 1 alone): each plans within an equal share, as each would
    /// otherwise plan for all of it.
    #[serde(skip)]
    pub host_sharers: u32,
    /// The memory model, probed or forced.
    pub memory_model: MemoryModel,
    /// Whether `memory_model` came from `--memory-model` rather than the probe.
    pub memory_model_forced: bool,
    /// The selected GPU's context, held while the config lives ([`HeldContext`]).
    #[serde(skip)]
    pub context: HeldContext,
}

impl DeviceInfo {
    /// The device as `--device` would name it.
    pub fn spec(&self) -> String {
        match self.kind {
            DeviceKind::Cpu => "cpu".into(),
            DeviceKind::Cuda => format!("cuda:{}", self.ordinal),
            DeviceKind::Metal => "metal".into(),
        }
    }

    /// The device choice this resolves to.
    pub fn choice(&self) -> DeviceChoice {
        match self.kind {
            DeviceKind::Cpu => DeviceChoice::Cpu,
            DeviceKind::Cuda => DeviceChoice::Cuda(Some(self.ordinal)),
            DeviceKind::Metal => DeviceChoice::Metal,
        }
    }
}

/// A CUDA device as the driver describes it without a context.
struct CudaDevice {
    name: String,
    total_memory: u64,
    integrated: bool,
}

/// Every CUDA device, read from the driver without creating a context on any (a context costs
/// ~0.1 s; one per GPU of an 8-GPU host added up before the first stage).
#[cfg(feature = "cuda")]
fn cuda_devices() -> Vec<CudaDevice> {
    use candle_core::cuda::cudarc::driver::{result::device, sys::CUdevice_attribute, CudaContext};
    let count = CudaContext::device_count().unwrap_or(0).max(0);
    (0..count)
        .filter_map(|ordinal| {
            let dev = device::get(ordinal).ok()?;
            // SAFETY: `dev` is a device handle the driver just returned.
            let (integrated, total) = unsafe {
                (
                    device::get_attribute(dev, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)
                        .ok()?,
                    device::total_mem(dev).ok()?,
                )
            };
            Some(CudaDevice {
                name: device::get_name(dev).ok()?,
                total_memory: total as u64,
                integrated: integrated != 0,
            })
        })
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices() -> Vec<CudaDevice> {
    Vec::new()
}

/// The context this process runs on device `ordinal` (its primary context), created by the
/// probe to read the memory free once it exists, and held for the run: the pipeline's device
/// then retains the same context instead of creating it a second time.
#[derive(Clone, Default)]
pub struct HeldContext {
    /// Held for its lifetime alone: the driver keeps a retained primary context.
    #[cfg(feature = "cuda")]
    _context: Option<std::sync::Arc<candle_core::cuda::cudarc::driver::CudaContext>>,
}

impl std::fmt::Debug for HeldContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HeldContext")
    }
}

/// Device `ordinal`'s context and the memory free on it once the context exists.
#[cfg(feature = "cuda")]
fn cuda_context(ordinal: usize) -> Option<(HeldContext, u64)> {
    let ctx = candle_core::cuda::cudarc::driver::CudaContext::new(ordinal).ok()?;
    let (free, _) = ctx.mem_get_info().ok()?;
    Some((
        HeldContext {
            _context: Some(ctx),
        },
        free as u64,
    ))
}

#[cfg(not(feature = "cuda"))]
fn cuda_context(_ordinal: usize) -> Option<(HeldContext, u64)> {
    None
}

/// Selects the device the user asked for and finds its memory model.
///
/// `--memory-model discrete|unified` replaces the probe's answer, so a plan for another machine
/// (or a test) can be made anywhere, for any `--num-gpus`.
pub fn probe(
    device: DeviceChoice,
    num_gpus: u32,
    forced: Option<MemoryModel>,
) -> Result<DeviceInfo, DeviceError> {
    let Probed {
        kind,
        ordinal,
        name,
        total_memory,
        free_memory,
        model: probed,
        context,
    } = match device {
        DeviceChoice::Cpu => Probed::cpu(),
        DeviceChoice::Metal => metal()?,
        DeviceChoice::Cuda(ordinal) => cuda(&cuda_devices(), ordinal.unwrap_or(0), num_gpus)?,
        DeviceChoice::Auto => {
            let devices = cuda_devices();
            if !devices.is_empty() {
                cuda(&devices, 0, num_gpus)?
            } else if cfg!(feature = "metal") {
                metal()?
            } else {
                Probed::cpu()
            }
        }
    };
    // A forced memory model plans for another machine: its GPUs need not be here.
    if kind != DeviceKind::Cuda && num_gpus > 1 && forced.is_none() {
        return Err(DeviceError::new(format!(
            "--num-gpus {num_gpus} asks for more GPUs than there are: 0 CUDA GPUs on the selected device {}; use --num-gpus 1 or --device cuda on a machine with {num_gpus} GPUs",
            name
        )));
    }
    let (memory_model, forced) = match forced {
        None => (probed, false),
        Some(model) => (model, true),
    };
    // A memory model forced to other than the device's plans for another machine, whose host
    // this one's memory says nothing of.
    let host_sharers = num_gpus.max(1);
    let host_available = host_budget(memory_model == probed)?.map(|h| host_share(h, host_sharers));
    // Unified memory is one pool with the host: what the host has available bounds it.
    let free_memory = match (free_memory, memory_model) {
        (Some(free), MemoryModel::Unified) => Some(host_available.map_or(free, |h| h.min(free))),
        (free, _) => free,
    };
    Ok(DeviceInfo {
        kind,
        ordinal,
        name,
        total_memory,
        free_memory,
        host_available,
        host_sharers,
        memory_model,
        memory_model_forced: forced,
        context,
    })
}

/// One process's equal share of `budget` bytes among `sharers`.
fn host_share(budget: u64, sharers: u32) -> u64 {
    budget / u64::from(sharers.max(1))
}

/// What the probe found of the selected device.
struct Probed {
    kind: DeviceKind,
    ordinal: usize,
    name: String,
    total_memory: Option<u64>,
    free_memory: Option<u64>,
    model: MemoryModel,
    context: HeldContext,
}

impl Probed {
    fn cpu() -> Self {
        Probed {
            kind: DeviceKind::Cpu,
            ordinal: 0,
            name: "cpu".into(),
            total_memory: None,
            free_memory: None,
            model: MemoryModel::None,
            context: HeldContext::default(),
        }
    }
}

/// The variable that replaces what the probe reads of the host ([`host_budget`]).
pub const HOST_MEMORY_VAR: &str = "VIDGEN_HOST_MEMORY";

/// The host budget of a run: `VIDGEN_HOST_MEMORY` (a size such as `64GiB`) where set, which plans
/// for another machine (or a test) as `--memory-model` does, else, where the run is for this
/// host (`here`), [`host_available`].
fn host_budget(here: bool) -> Result<Option<u64>, DeviceError> {
    match std::env::var(HOST_MEMORY_VAR) {
        Ok(size) => crate::cli::args::parse_size(&size)
            .map(Some)
            .map_err(|e| DeviceError::new(format!("{HOST_MEMORY_VAR}: {e}"))),
        Err(_) => Ok(host_available().filter(|_| here)),
    }
}

/// Host memory this process may still take: the kernel's estimate of what is available
/// (`MemAvailable`), bounded by the process's cgroup (v2 `memory.max` less `memory.current`)
/// and its `RLIMIT_AS` and `RLIMIT_DATA` (the limit less what the process has mapped, or
/// holds as data, already); `None` where none is readable.
pub fn host_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let available = meminfo.as_deref().and_then(mem_available);
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_room(&c, |file| std::fs::read_to_string(file).ok()));
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let rlimits = [(libc::RLIMIT_AS, "VmSize:"), (libc::RLIMIT_DATA, "VmData:")]
        .map(|(resource, used)| rlimit_room(rlimit(resource), status_bytes(&status, used)));
    [available, cgroup, rlimits[0], rlimits[1]]
        .into_iter()
        .flatten()
        .min()
}

/// Host memory this process may hold in all right now, one of `sharers` processes of this
/// machine: what it holds (`VmRSS`) and its share of what they may still take
/// ([`host_available`]); with `VIDGEN_HOST_MEMORY`, its share of that budget.
pub fn host_room(sharers: u32) -> Option<u64> {
    if let Ok(size) = std::env::var(HOST_MEMORY_VAR) {
        return crate::cli::args::parse_size(&size)
            .ok()
            .map(|budget| host_share(budget, sharers));
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let held = status_bytes(&status, "VmRSS:").unwrap_or(0);
    host_available().map(|available| host_share(available, sharers).saturating_add(held))
}

/// The type of `getrlimit`'s resource argument.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
type Resource = libc::__rlimit_resource_t;
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
type Resource = libc::c_int;

/// The soft limit of `resource`; `None` when unlimited or unreadable.
fn rlimit(resource: Resource) -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer.
    let read = unsafe { libc::getrlimit(resource, &mut limit) } == 0;
    (read && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

/// Room under a limit of `limit` bytes with `used` bytes counted against it already.
fn rlimit_room(limit: Option<u64>, used: Option<u64>) -> Option<u64> {
    Some(limit?.saturating_sub(used.unwrap_or(0)))
}

/// A `/proc/self/status` field given in kB (`VmSize:`), in bytes.
fn status_bytes(status: &str, field: &str) -> Option<u64> {
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Room left under the cgroup v2 limit of the process whose `/proc/self/cgroup` is `cgroup`:
/// `memory.max` less `memory.current` of its folder (`read` reads a file); `None` without a
/// limit (`max`) or a v2 entry.
fn cgroup_room(cgroup: &str, read: impl Fn(&str) -> Option<String>) -> Option<u64> {
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let folder = format!("/sys/fs/cgroup{}", path.trim_end_matches('/'));
    let max: u64 = read(&format!("{folder}/memory.max"))?.trim().parse().ok()?;
    let current: u64 = read(&format!("{folder}/memory.current"))?
        .trim()
        .parse()
        .ok()?;
    Some(max.saturating_sub(current))
}

/// Device `ordinal` of `devices` (every CUDA GPU here), with its context, for a run on
/// `num_gpus` of them from it.
fn cuda(devices: &[CudaDevice], ordinal: usize, num_gpus: u32) -> Result<Probed, DeviceError> {
    if !cfg!(feature = "cuda") {
        return Err(DeviceError::new(
            "--device cuda: this vidgen was built without CUDA; rebuild with `cargo build --release --features cuda` or use --device cpu",
        ));
    }
    let wanted = ordinal + num_gpus as usize;
    if devices.len() < wanted {
        return Err(DeviceError::new(format!(
            "--num-gpus {num_gpus} from cuda:{ordinal} needs {wanted} CUDA GPUs but {} found; lower --num-gpus or pick another --device",
            devices.len()
        )));
    }
    let dev = &devices[ordinal];
    let model = if devices[ordinal..wanted].iter().all(|d| d.integrated) {
        MemoryModel::Unified
    } else {
        MemoryModel::Discrete
    };
    let (context, free) = cuda_context(ordinal).ok_or_else(|| {
        DeviceError::new(format!(
            "cuda:{ordinal} ({}): the driver could not create a context on it; check that no other program holds it exclusively, or pick another --device (--device cpu runs without a GPU)",
            dev.name
        ))
    })?;
    Ok(Probed {
        kind: DeviceKind::Cuda,
        ordinal,
        name: dev.name.clone(),
        total_memory: Some(dev.total_memory),
        free_memory: Some(free),
        model,
        context,
    })
}

fn metal() -> Result<Probed, DeviceError> {
    if !cfg!(feature = "metal") {
        return Err(DeviceError::new(
            "--device metal: this vidgen was built without Metal; rebuild with `cargo build --release --features metal` or use --device cpu",
        ));
    }
    Ok(Probed {
        kind: DeviceKind::Metal,
        name: "Apple GPU".into(),
        model: MemoryModel::Unified,
        ..Probed::cpu()
    })
}

/// The device, as asked.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceChoice {
    Auto,
    Cpu,
    /// A CUDA device; `None` is `cuda` (device 0).
    Cuda(Option<usize>),
    Metal,
}

pub fn parse_device(s: &str) -> Result<DeviceChoice, String> {
    s.parse()
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(None)),
            "metal" => Ok(DeviceChoice::Metal),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceChoice::Cuda(Some(n))),
                _ => Err(format!(
                    "unknown device '{s}': use auto, cpu, cuda, cuda:N or metal"
                )),
            },
        }
    }
}

impl TryFrom<String> for DeviceChoice {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<DeviceChoice> for String {
    fn from(d: DeviceChoice) -> String {
        d.to_string()
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Auto => f.write_str("auto"),
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda(None) => f.write_str("cuda"),
            DeviceChoice::Cuda(Some(n)) => write!(f, "cuda:{n}"),
            DeviceChoice::Metal => f.write_str("metal"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_is_read_from_meminfo_and_the_cgroup_limit() {
        let meminfo =
            "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   65536000 kB\n";
        assert_eq!(mem_available(meminfo), Some(65_536_000 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        let files = |limit: &'static str| {
            move |file: &str| match file {
                "/sys/fs/cgroup/user.slice/job/memory.max" => Some(limit.to_string()),
                "/sys/fs/cgroup/user.slice/job/memory.current" => Some("1000\n".to_string()),
                _ => None,
            }
        };
        let cgroup = "0::/user.slice/job\n";
        assert_eq!(cgroup_room(cgroup, files("5000\n")), Some(4000));
        // No limit, or a v1-only hierarchy: nothing bounds the process here.
        assert_eq!(cgroup_room(cgroup, files("max\n")), None);
        assert_eq!(cgroup_room("4:memory:/job\n", files("5000\n")), None);
        // An address-space or data limit leaves what the process has not used of it.
        let status = "VmPeak:\t  300 kB\nVmSize:\t  200 kB\nVmData:\t   50 kB\n";
        assert_eq!(status_bytes(status, "VmSize:"), Some(200 * 1024));
        assert_eq!(
            rlimit_room(Some(1 << 20), status_bytes(status, "VmData:")),
            Some((1 << 20) - 50 * 1024)
        );
        assert_eq!(rlimit_room(Some(1000), Some(5000)), Some(0));
        assert_eq!(rlimit_room(None, Some(5000)), None);
    }
}
