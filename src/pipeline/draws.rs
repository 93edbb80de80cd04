//! The random draws of a run read from a file (`--latents`), so a run can use exactly the draws
//! diffusers made: each pipeline takes its draws by name and shape, and a draw it needs that the
//! file lacks, or a tensor in the file it never used, is an error naming it.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The draws of one run.
pub struct Draws {
    path: PathBuf,
    tensors: BTreeMap<String, Tensor>,
    used: BTreeSet<String>,
}

impl Draws {
    /// Reads every tensor of `path` (onto the CPU).
    pub fn open(path: &Path) -> Result<Self> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
