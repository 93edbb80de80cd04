//! Where a model's files come from: a local diffusers folder, the Hugging Face Hub (through its
//! standard cache), or `synthetic:<name>` (published configs shipped in the binary, seeded random
//! weights made at load time so speed and memory can be measured at full size without a download).

use crate::weights::Weights;
use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

macro_rules! synthetic_files {
    ($name:literal) => {
        &[
            (
                "model_index.json",
                include_str!(concat!("../../assets/", $name, "/model_index.json")),
            ),
            (
                "transformer/config.json",
                include_str!(concat!("../../assets/", $name, "/transformer/config.json")),
            ),
            (
                "vae/config.json",
                include_str!(concat!("../../assets/", $name, "/vae/config.json")),
            ),
            (
                "text_encoder/config.json",
                include_str!(concat!("../../assets/", $name, "/text_encoder/config.json")),
            ),
            (
                "scheduler/scheduler_config.json",
                include_str!(concat!(
                    "../../assets/",
                    $name,
                    "/scheduler/scheduler_config.json"
                )),
            ),
            (
                "tokenizer/tokenizer.json",
                include_str!(concat!("../../assets/", $name, "/tokenizer/tokenizer.json")),
            ),
        ]
    };
}

/// The configs shipped for synthetic models: (name, [(relative path, contents)]).
const SYNTHETIC: &[(&str, &[(&str, &str)])] = &[
    ("wan2.1-t2v-1.3b", synthetic_files!("wan2.1-t2v-1.3b")),
    ("wan2.1-t2v-14b", synthetic_files!("wan2.1-t2v-14b")),
    ("wan2.1-tiny", synthetic_files!("wan2.1-tiny")),
];

/// A model as named by `--model`.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A folder in diffusers layout.
    Local(PathBuf),
    /// A Hugging Face Hub repository id, fetched through the standard cache.
    Hub(String),
    /// Shipped configs with seeded random weights.
    Synthetic(&'static str),
}

impl ModelSource {
    /// Interprets `--model`: `synthetic:<name>`, an existing folder, or a Hub id.
    pub fn parse(model: &str) -> Result<Self> {
        if let Some(name) = model.strip_prefix("synthetic:") {
            return match SYNTHETIC.iter().find(|(n, _)| *n == name) {
                Some((n, _)) => Ok(ModelSource::Synthetic(n)),
                None => bail!(
                    "unknown synthetic model '{name}'; use one of: {}",
                    SYNTHETIC
                        .iter()
                        .map(|(n, _)| format!("synthetic:{n}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
        }
        let path = Path::new(model);
        if path.is_dir() {
            return Ok(ModelSource::Local(path.to_path_buf()));
        }
        let looks_like_path = model.starts_with(['.', '/', '~']) || model.matches('/').count() != 1;
        if looks_like_path {
            bail!("model folder '{model}' does not exist; pass a diffusers folder, a Hub id like Wan-AI/Wan2.1-T2V-1.3B-Diffusers, or synthetic:wan2.1-t2v-1.3b");
        }
        Ok(ModelSource::Hub(model.to_string()))
    }

    /// Whether weights are made up at load time.
    pub fn is_synthetic(&self) -> bool {
        matches!(self, ModelSource::Synthetic(_))
    }

    /// A file of the model, fetched if needed. `None` when it does not exist in the model.
    pub fn file(&self, relative: &str) -> Result<Option<FileRef>> {
        match self {
            ModelSource::Local(dir) => {
                let p = dir.join(relative);
                Ok(p.is_file().then_some(FileRef::Path(p)))
            }
            ModelSource::Synthetic(name) => Ok(SYNTHETIC
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, files)| files.iter().find(|(p, _)| *p == relative))
                .map(|(_, text)| FileRef::Embedded(text))),
            ModelSource::Hub(repo) => hub::fetch(repo, relative),
        }
    }

    /// A file the model must have.
    pub fn require(&self, relative: &str) -> Result<FileRef> {
        self.file(relative)?.with_context(|| {
            format!("{self} has no {relative}: is it a diffusers model folder (model_index.json, transformer/, vae/, ...)?")
        })
    }

    /// Reads and parses a JSON file of the model.
    pub fn json<T: DeserializeOwned>(&self, relative: &str) -> Result<T> {
        let file = self.require(relative)?;
        let text = file.read()?;
        serde_json::from_str(&text)
            .with_context(|| format!("{self}: {relative} is not a valid config"))
    }

    /// Reads a config without fetching anything: for `--dry-run`, which never downloads.
    pub fn cached_json(&self, relative: &str) -> Option<serde_json::Value> {
        let file = match self {
            ModelSource::Hub(repo) => hub::cached(repo, relative).map(FileRef::Path),
            _ => self.file(relative).ok().flatten(),
        }?;
        serde_json::from_str(&file.read().ok()?).ok()
    }
}

impl std::fmt::Display for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::Local(p) => write!(f, "model folder {}", p.display()),
            ModelSource::Hub(r) => write!(f, "Hub model {r}"),
            ModelSource::Synthetic(n) => write!(f, "synthetic:{n}"),
        }
    }
}

/// A model file: on disk, or shipped in the binary.
#[derive(Clone, Debug)]
pub enum FileRef {
    Path(PathBuf),
    Embedded(&'static str),
}

impl FileRef {
    /// The file's text.
    pub fn read(&self) -> Result<String> {
        match self {
            FileRef::Path(p) => {
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
            }
            FileRef::Embedded(t) => Ok(t.to_string()),
        }
    }
}

/// The Hugging Face cache and downloads.
mod hub {
    use super::FileRef;
    use anyhow::{bail, Context, Result};
    use hf_hub::{Cache, Repo};
    use std::path::PathBuf;

    /// The cache folder: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub.
    fn cache() -> Cache {
        match std::env::var_os("HF_HUB_CACHE") {
            Some(dir) if !dir.is_empty() => Cache::new(PathBuf::from(dir)),
            _ => Cache::from_env(),
        }
    }

    fn offline() -> bool {
        std::env::var("HF_HUB_OFFLINE")
            .is_ok_and(|v| !matches!(v.as_str(), "" | "0" | "false" | "FALSE"))
    }

    /// A file already in the cache.
    pub fn cached(repo: &str, relative: &str) -> Option<PathBuf> {
        cache().repo(Repo::model(repo.to_string())).get(relative)
    }

    /// A file from the cache, downloaded (with a progress bar) when missing and allowed.
    pub fn fetch(repo: &str, relative: &str) -> Result<Option<FileRef>> {
        if let Some(p) = cached(repo, relative) {
            return Ok(Some(FileRef::Path(p)));
        }
        if offline() {
            if relative == "model_index.json" {
                bail!("{repo} is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE=1; download it first (unset HF_HUB_OFFLINE) or pass a local folder to --model", cache().path().display());
            }
            return Ok(None);
        }
        let token = std::env::var("HF_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .or_else(|| cache().token());
        let api = hf_hub::api::sync::ApiBuilder::from_cache(cache())
            .with_token(token)
            .with_progress(true)
            .build()
            .context("setting up the Hugging Face Hub client")?;
        match api.model(repo.to_string()).get(relative) {
            Ok(p) => Ok(Some(FileRef::Path(p))),
            Err(hf_hub::api::sync::ApiError::RequestError(e)) if e.to_string().contains("404") => Ok(None),
            Err(e) => Err(e).with_context(|| format!("downloading {relative} of {repo} (set HF_TOKEN for gated repos, HF_HUB_OFFLINE=1 to use only the cache)")),
        }
    }
}

/// File names diffusers and transformers use for a component's weights, sharded first.
const WEIGHT_NAMES: [&str; 2] = ["diffusion_pytorch_model", "model"];
const PICKLE_SUFFIXES: [&str; 5] = [".bin", ".pt", ".pth", ".ckpt", ".pkl"];

/// Finds the weight files of `component` (e.g. "transformer").
pub fn component_weights(source: &ModelSource, component: &str) -> Result<Weights> {
    if let ModelSource::Synthetic(name) = source {
        return Ok(Weights::Synthetic {
            seed: crate::weights::fnv1a(&format!("{name}/{component}")),
        });
    }
    for base in WEIGHT_NAMES {
        let index = format!("{component}/{base}.safetensors.index.json");
        if let Some(FileRef::Path(index_path)) = source.file(&index)? {
            return sharded(source, component, &index_path).map(Weights::Files);
        }
        if let Some(FileRef::Path(p)) = source.file(&format!("{component}/{base}.safetensors"))? {
            return Ok(Weights::Files(vec![p]));
        }
    }
    if let ModelSource::Local(dir) = source {
        let folder = dir.join(component);
        let entries: Vec<String> = std::fs::read_dir(&folder)
            .map(|rd| {
                rd.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        let mut found: Vec<&String> = entries
            .iter()
            .filter(|n| n.ends_with(".safetensors"))
            .collect();
        found.sort();
        if !found.is_empty() {
            return Ok(Weights::Files(
                found.into_iter().map(|n| folder.join(n)).collect(),
            ));
        }
        if let Some(p) = entries
            .iter()
            .find(|n| PICKLE_SUFFIXES.iter().any(|s| n.ends_with(s)))
        {
            bail!("{} holds only pickle weights ({p}); vidgen loads safetensors only (pickle can run code): convert them, e.g. with diffusers' save_pretrained(safe_serialization=True)", folder.display());
        }
    }
    bail!("{source} has no safetensors weights for {component} ({component}/diffusion_pytorch_model.safetensors or model.safetensors, or a .safetensors.index.json)")
}

/// The shard files named by a `*.safetensors.index.json`, each checked to exist.
fn sharded(source: &ModelSource, component: &str, index_path: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index_path)
        .with_context(|| format!("reading {}", index_path.display()))?;
    let index: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
    let map = index["weight_map"]
        .as_object()
        .with_context(|| format!("{} has no weight_map", index_path.display()))?;
    let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    shards
        .into_iter()
        .map(
            |shard| match source.file(&format!("{component}/{shard}"))? {
                Some(FileRef::Path(p)) => Ok(p),
                _ => bail!(
                    "shard {component}/{shard} named in {} is missing; re-download the model",
                    index_path.display()
                ),
            },
        )
        .collect()
}
