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
    /// The memory model, probed or forced.
    pub memory_model: MemoryModel,
    /// Whether `memory_model` came from `--memory-model` rather than the probe.
    pub memory_model_forced: bool,
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

/// A CUDA device as the driver describes it.
struct CudaDevice {
    name: String,
    total_memory: u64,
    integrated: bool,
}

#[cfg(feature = "cuda")]
fn cuda_devices() -> Vec<CudaDevice> {
    use candle_core::cuda::cudarc::driver::{sys::CUdevice_attribute, CudaContext};
    let count = CudaContext::device_count().unwrap_or(0).max(0) as usize;
    (0..count)
        .filter_map(|ordinal| {
            let ctx = CudaContext::new(ordinal).ok()?;
            let integrated = ctx
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)
                .ok()?;
            Some(CudaDevice {
                name: ctx.name().ok()?,
                total_memory: ctx.total_mem().ok()? as u64,
                integrated: integrated != 0,
            })
        })
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices() -> Vec<CudaDevice> {
    Vec::new()
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
    let (kind, ordinal, name, total_memory, probed) = match device {
        DeviceChoice::Cpu => (
            DeviceKind::Cpu,
            0,
            "cpu".to_string(),
            None,
            MemoryModel::None,
        ),
        DeviceChoice::Metal => metal()?,
        DeviceChoice::Cuda(ordinal) => cuda(ordinal.unwrap_or(0), num_gpus)?,
        DeviceChoice::Auto => {
            if !cuda_devices().is_empty() {
                cuda(0, num_gpus)?
            } else if cfg!(feature = "metal") {
                metal()?
            } else {
                (
                    DeviceKind::Cpu,
                    0,
                    "cpu".to_string(),
                    None,
                    MemoryModel::None,
                )
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
    Ok(DeviceInfo {
        kind,
        ordinal,
        name,
        total_memory,
        memory_model,
        memory_model_forced: forced,
    })
}

type Probed = (DeviceKind, usize, String, Option<u64>, MemoryModel);

fn cuda(ordinal: usize, num_gpus: u32) -> Result<Probed, DeviceError> {
    if !cfg!(feature = "cuda") {
        return Err(DeviceError::new(
            "--device cuda: this vidgen was built without CUDA; rebuild with `cargo build --release --features cuda` or use --device cpu",
        ));
    }
    let devices = cuda_devices();
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
    Ok((
        DeviceKind::Cuda,
        ordinal,
        dev.name.clone(),
        Some(dev.total_memory),
        model,
    ))
}

fn metal() -> Result<Probed, DeviceError> {
    if !cfg!(feature = "metal") {
        return Err(DeviceError::new(
            "--device metal: this vidgen was built without Metal; rebuild with `cargo build --release --features metal` or use --device cpu",
        ));
    }
    Ok((
        DeviceKind::Metal,
        0,
        "Apple GPU".into(),
        None,
        MemoryModel::Unified,
    ))
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
