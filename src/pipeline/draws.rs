//! The random draws of a run read from a file (`--latents`), so a run can use exactly the draws
//! diffusers made: each pipeline takes its draws by name and shape, and a draw it needs that the
//! file lacks, or a tensor in the file it never used, is an error naming it.

use super::frame::Frame;
use super::jobs::Job;
use crate::config::UsageError;
use crate::rng::TorchGenerator;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The most bytes a safetensors header may hold (the safetensors crate's own limit): a longer
/// one is not a draws file, and reading it would be unbounded.
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// One tensor a safetensors header declares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Declared {
    pub dtype: String,
    pub shape: Vec<usize>,
}

/// The tensors of the safetensors file at `path`, from its header alone (the data is not read).
/// A path that is not a regular file (`/dev/zero`, a folder), a header beyond
/// [`MAX_HEADER_BYTES`] or one that does not describe the file's bytes is an error.
pub fn header(path: &Path) -> Result<BTreeMap<String, Declared>> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if !meta.is_file() {
        bail!("{} is not a regular file", path.display());
    }
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    parse_header(file, meta.len())
        .with_context(|| format!("{} is not a safetensors file", path.display()))
}

/// Parses a safetensors header from `reader`, which holds `len` bytes in all: an 8-byte
/// little-endian header length, the JSON header, then the data its offsets point into.
pub fn parse_header(mut reader: impl Read, len: u64) -> Result<BTreeMap<String, Declared>> {
    let mut size = [0u8; 8];
    reader
        .read_exact(&mut size)
        .context("shorter than 8 bytes")?;
    let n = u64::from_le_bytes(size);
    if n > MAX_HEADER_BYTES || n > len.saturating_sub(8) {
        bail!("its header length {n} is past the file's end or the {MAX_HEADER_BYTES}-byte limit");
    }
    let mut text = vec![0u8; n as usize];
    reader
        .read_exact(&mut text)
        .context("its header is cut short")?;
    let data_len = len.saturating_sub(8) - n;
    let value: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| anyhow::anyhow!("its header is not JSON ({e})"))?;
    let serde_json::Value::Object(map) = value else {
        bail!("its header is not a JSON object");
    };
    let mut out = BTreeMap::new();
    for (name, entry) in map {
        if name == "__metadata__" {
            continue;
        }
        let bad = || anyhow::anyhow!("tensor `{name}` has no valid dtype, shape and data_offsets");
        let dtype = entry["dtype"].as_str().ok_or_else(bad)?.to_string();
        let shape: Vec<usize> =
            serde_json::from_value(entry["shape"].clone()).map_err(|_| bad())?;
        let [start, end]: [u64; 2] =
            serde_json::from_value(entry["data_offsets"].clone()).map_err(|_| bad())?;
        let width: u64 = match dtype.as_str() {
            "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
            "U16" | "I16" | "F16" | "BF16" => 2,
            "U32" | "I32" | "F32" => 4,
            "U64" | "I64" | "F64" => 8,
            other => bail!("tensor `{name}` has unknown dtype {other:?}"),
        };
        let bytes = shape
            .iter()
            .try_fold(width, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(bad)?;
        if start > end || end > data_len || end - start != bytes {
            bail!("tensor `{name}`'s data_offsets [{start}, {end}] do not hold its {bytes} bytes within the file's {data_len} bytes of data");
        }
        out.insert(name, Declared { dtype, shape });
    }
    Ok(out)
}

/// The draws of one run.
pub struct Draws {
    path: PathBuf,
    tensors: BTreeMap<String, Tensor>,
    used: BTreeSet<String>,
}

impl Draws {
    /// Reads every tensor of `path` (onto the CPU).
    pub fn open(path: &Path) -> Result<Self> {
        header(path).with_context(|| format!("reading the draws file {}", path.display()))?;
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)
            .with_context(|| format!("reading the draws file {}", path.display()))?;
        Ok(Draws {
            path: path.to_path_buf(),
            tensors: tensors.into_iter().collect(),
            used: BTreeSet::new(),
        })
    }

    /// Draw `name`, which must have `shape`.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let Some(tensor) = self.tensors.get(name) else {
            bail!(
                "the draws file {} has no tensor `{name}` {shape:?}, which this run needs; add it (see PARITY-CLI)",
                self.path.display()
            )
        };
        if tensor.dims() != shape {
            bail!(
                "the draws file {} holds `{name}` as {:?}, but this run needs {shape:?}",
                self.path.display(),
                tensor.dims()
            )
        }
        self.used.insert(name.to_string());
        Ok(tensor.clone())
    }

    /// Checks that every tensor of the file was used: one the run never drew is a mistake.
    pub fn finish(&self) -> Result<()> {
        let unused: Vec<&str> = self
            .tensors
            .keys()
            .filter(|k| !self.used.contains(*k))
            .map(String::as_str)
            .collect();
        if !unused.is_empty() {
            bail!(
                "the draws file {} holds tensors this run does not use: {}; remove them or check the run's settings",
                self.path.display(),
                unused.join(", ")
            )
        }
        Ok(())
    }
}

/// A run's random draws: from the `--latents` file, or from the seed's generator (the
/// stochastic samplers' pipelines, CogVideoX's and Allegro's, draw the latents and every step's
/// noise from their one `generator`, in the run dtype).
pub enum RunDraws {
    File(Draws),
    Seeded(TorchGenerator, DType),
}

impl RunDraws {
    /// The draw `name` of `shape`: the file's tensor, or the generator's next draw.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        match self {
            RunDraws::File(draws) => draws.take(name, shape),
            RunDraws::Seeded(generator, dtype) => Ok(generator.randn_as(shape, *dtype)?),
        }
    }

    /// A file holding a tensor the run never took is an error naming it.
    pub fn finish(&self) -> Result<()> {
        match self {
            RunDraws::File(draws) => draws.finish(),
            RunDraws::Seeded(..) => Ok(()),
        }
    }

    /// `job`'s draws, taken by `take` for its sizes: from the draws file, which must hold
    /// nothing else, or from the job's seed's generator drawing in `dtype`.
    pub fn take_for<T>(
        frame: &Frame,
        job: &Job,
        dtype: DType,
        take: impl FnOnce(&mut RunDraws, Sizes) -> Result<T>,
    ) -> Result<T> {
        let mut draws = match &frame.config.generation().latents {
            Some(path) => RunDraws::File(Draws::open(path)?),
            None => RunDraws::Seeded(TorchGenerator::new(job.seed), dtype),
        };
        let taken = take(&mut draws, Sizes::of(job))?;
        draws.finish()?;
        Ok(taken)
    }

    /// Checks the run's draws file, where one is given, before anything loads: `take` takes
    /// what a job of the run's sizes takes. A draws file that does not fit the run is bad input.
    pub fn check(
        frame: &Frame,
        take: impl FnOnce(&mut RunDraws, Sizes) -> Result<()>,
    ) -> Result<()> {
        let Some(path) = &frame.config.generation().latents else {
            return Ok(());
        };
        let o = frame.config.video();
        let sizes = Sizes {
            num_frames: o.num_frames,
            height: o.height,
            width: o.width,
            steps: o.num_inference_steps,
        };
        let mut draws = RunDraws::File(Draws::open(path).map_err(UsageError::from_error)?);
        take(&mut draws, sizes)
            .and_then(|_| draws.finish())
            .map_err(UsageError::from_error)
    }
}

/// The sizes a job's draws depend on.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub num_frames: u32,
    pub height: u32,
    pub width: u32,
    /// Denoising steps.
    pub steps: u32,
}

impl Sizes {
    /// `job`'s sizes.
    pub fn of(job: &Job) -> Self {
        Sizes {
            num_frames: job.num_frames,
            height: job.height,
            width: job.width,
            steps: job.num_inference_steps,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small valid safetensors file's bytes: two tensors and metadata.
    fn sample() -> Vec<u8> {
        let a = Tensor::zeros((1, 2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::ones(4, candle_core::DType::BF16, &Device::Cpu).unwrap();
        let info: std::collections::HashMap<String, String> = [("k".into(), "v".into())].into();
        safetensors::serialize([("latents", &a), ("noise.0", &b)], Some(info)).unwrap()
    }

    /// Mutated files never panic the header parser (nor the safetensors crate's, which loads
    /// the weights); a header it accepts points only inside the file, and one the crate
    /// accepts, it accepts too.
    #[test]
    fn fuzzed_safetensors_headers_are_refused_or_read_never_panic() {
        let valid = sample();
        let header_only = valid[..valid.len() - 8].to_vec();
        let seeds: &[&[u8]] = &[&valid, &header_only];
        crate::fuzz::mutate(seeds, 3000, |bytes| {
            let ours = parse_header(bytes, bytes.len() as u64);
            if let Ok(tensors) = &ours {
                assert!(tensors
                    .values()
                    .all(|t| t.shape.iter().all(|&d| d <= bytes.len())));
            }
            if safetensors::SafeTensors::deserialize(bytes).is_ok() {
                assert!(ours.is_ok(), "the crate reads it, we do not: {ours:?}");
            }
        });
    }

    /// Headers worth keeping: each is refused with the reason.
    #[test]
    fn fuzz_regressions_in_safetensors_headers() {
        let valid = sample();
        let n = u64::from_le_bytes(valid[..8].try_into().unwrap()) as usize;
        let with_header = |json: &str| {
            let mut out = (json.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(json.as_bytes());
            out.extend_from_slice(&valid[8 + n..]);
            out
        };
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![1, 2, 3], "shorter than 8 bytes"),
            (u64::MAX.to_le_bytes().to_vec(), "past the file's end"),
            (with_header("[1]"), "not a JSON object"),
            (with_header("{\"a\": {\"dtype\": \"F32\", \"shape\": [18446744073709551615, 2], \"data_offsets\": [0, 8]}}"), "no valid dtype"),
            (with_header("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 4]}}"), "data_offsets [8, 4]"),
            (with_header("{\"a\": {\"dtype\": \"F32\", \"shape\": [1000], \"data_offsets\": [0, 4000]}}"), "within the file's"),
            (with_header("{\"a\": {\"dtype\": \"Q4\", \"shape\": [1], \"data_offsets\": [0, 4]}}"), "unknown dtype"),
            (with_header("{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}"), "no valid dtype"),
        ];
        for (bytes, needle) in cases {
            let e = parse_header(bytes.as_slice(), bytes.len() as u64).unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{e:#}");
        }
        assert_eq!(
            parse_header(valid.as_slice(), valid.len() as u64).unwrap()["latents"].shape,
            [1, 2, 3]
        );
    }

    #[test]
    fn draws_are_taken_by_name_and_shape_and_leftovers_are_errors() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("vidgen-draws-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("draws.safetensors");
        let a = Tensor::zeros((1, 2), candle_core::DType::F32, &Device::Cpu)?;
        let b = Tensor::ones(3, candle_core::DType::F32, &Device::Cpu)?;
        let tensors: std::collections::HashMap<String, Tensor> =
            [("latents".to_string(), a), ("noise.0".to_string(), b)].into();
        candle_core::safetensors::save(&tensors, &path)?;
        let mut draws = Draws::open(&path)?;
        assert!(format!("{:#}", draws.take("latents", &[2, 1]).unwrap_err()).contains("[1, 2]"));
        assert!(format!("{:#}", draws.take("missing", &[1]).unwrap_err()).contains("`missing`"));
        draws.take("latents", &[1, 2])?;
        assert!(format!("{:#}", draws.finish().unwrap_err()).contains("noise.0"));
        draws.take("noise.0", &[3])?;
        draws.finish()?;
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
