//! Where a model's files come from: a local diffusers folder, the Hugging Face Hub (through its
//! standard cache), or `synthetic:<name>` (published configs shipped in the binary, seeded random
//! weights made at load time so speed and memory can be measured at full size without a download).

use crate::weights::Weights;
use anyhow::{anyhow, bail, Context, Result};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The published configs of a `synthetic:` model, shipped in the binary from `assets/<name>/`:
/// the files every diffusers pipeline has (the index, transformer, VAE, text encoder and
/// scheduler configs, the tokenizer) and any others named; or, after `name:`, exactly the
/// files named.
#[macro_export]
macro_rules! shipped_files {
    ($name:literal: $($file:literal),+) => {
        &[$((
            $file,
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/", $name, "/", $file)),
        )),+]
    };
    ($name:literal $(, $extra:literal)*) => {
        $crate::shipped_files!($name:
            $($extra,)*
            "model_index.json",
            "transformer/config.json",
            "vae/config.json",
            "text_encoder/config.json",
            "scheduler/scheduler_config.json",
            "tokenizer/tokenizer.json"
        )
    };
}

/// Config checks of component classes, each `(class, file in its folder, config type)`: the
/// file is parsed with diffusers' defaults, then the type's `validate` runs.
#[macro_export]
macro_rules! config_checks {
    ($(($class:literal, $file:literal, $config:ty)),+ $(,)?) => {
        &[$($crate::models::source::ConfigCheck {
            class: $class,
            file: $file,
            check: |v| {
                $crate::models::source::parse_keyed::<$config>(v.clone())?
                    .validate()
                    .map_err($crate::models::source::ConfigError::into_message)
            },
        }),+]
    };
}

/// A model whose published configs vidgen ships: `synthetic:<name>` runs them with seeded
/// random weights, and a dry run of its Hub id plans from them without a download.
pub struct Shipped {
    pub name: &'static str,
    /// The Hub repository the configs were published in, if any.
    pub hub: Option<&'static str>,
    /// (relative path, contents), from [`shipped_files!`].
    pub files: &'static [(&'static str, &'static str)],
}

/// What a family's model folder declares to the rest of vidgen: the component configs it
/// interprets and the models whose configs it ships. [`crate::models::FOLDERS`] lists them.
pub struct ModelFolder {
    pub configs: &'static [ConfigCheck],
    pub shipped: &'static [Shipped],
}

/// Every shipped model, in the order the folders list them.
fn shipped() -> impl Iterator<Item = &'static Shipped> {
    crate::models::FOLDERS.iter().flat_map(|f| f.shipped)
}

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
    /// Interprets `--model`: `synthetic:<name>`, an existing folder, or a Hub id, and checks
    /// every config it can read without a download (see [`ModelSource::check_configs`]), so a
    /// config the model cannot run is refused before anything loads, in a dry run too.
    pub fn parse(model: &str) -> Result<Self> {
        let source = Self::locate(model)?;
        source.check_configs()?;
        Ok(source)
    }

    /// Where `--model` points, nothing read yet.
    fn locate(model: &str) -> Result<Self> {
        if let Some(name) = model.strip_prefix("synthetic:") {
            return match shipped().find(|m| m.name == name) {
                Some(m) => Ok(ModelSource::Synthetic(m.name)),
                None => bail!(
                    "unknown synthetic model '{name}'; use one of: {}",
                    shipped()
                        .map(|m| format!("synthetic:{}", m.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
        }
        let path = Path::new(model);
        if path.is_dir() {
            return Ok(ModelSource::Local(path.to_path_buf()));
        }
        if path.exists() {
            bail!("--model '{model}' is a file, not a folder; pass the diffusers model folder (the one holding model_index.json), a Hub id or synthetic:wan2.1-t2v-1.3b");
        }
        let looks_like_path = model.starts_with(['.', '/', '~']) || model.matches('/').count() != 1;
        if looks_like_path {
            bail!("model folder '{model}' does not exist; pass a diffusers folder, a Hub id like Wan-AI/Wan2.1-T2V-1.3B-Diffusers, or synthetic:wan2.1-t2v-1.3b");
        }
        Ok(ModelSource::Hub(model.to_string()))
    }

    /// The shipped model whose published configs a Hub id's are, if vidgen ships them.
    pub fn shipped_for(&self) -> Option<ModelSource> {
        let ModelSource::Hub(repo) = self else {
            return None;
        };
        // Hub ids are case-insensitive.
        shipped()
            .find(|m| m.hub.is_some_and(|hub| hub.eq_ignore_ascii_case(repo)))
            .map(|m| ModelSource::Synthetic(m.name))
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
            ModelSource::Synthetic(name) => Ok(shipped()
                .find(|m| m.name == *name)
                .and_then(|m| m.files.iter().find(|(p, _)| *p == relative))
                .map(|(_, text)| FileRef::Embedded(text))),
            ModelSource::Hub(repo) => hub::fetch(repo, relative),
        }
    }

    /// A tokenizer folder's `tokenizer.json` text and its `tokenizer_config.json`'s when
    /// present (from the folder, the Hub, or for a synthetic model the stand-ins it ships).
    pub fn tokenizer_files(&self, folder: &str) -> Result<(String, Option<String>)> {
        let json = self.require(&format!("{folder}/tokenizer.json"))?.read()?;
        let config = self
            .file(&format!("{folder}/tokenizer_config.json"))?
            .map(|f| f.read())
            .transpose()?;
        Ok((json, config))
    }

    /// A file the model must have.
    pub fn require(&self, relative: &str) -> Result<FileRef> {
        self.file(relative)?.with_context(|| {
            format!("{self} has no {relative}: is it a diffusers model folder (model_index.json, transformer/, vae/, ...)?")
        })
    }

    /// Reads and parses a JSON file of the model; a config is checked as it is read
    /// ([`ModelSource::read_config`]).
    pub fn json<T: DeserializeOwned>(&self, relative: &str) -> Result<T> {
        let file = self.require(relative)?;
        let value = self.read_config(relative, &file)?;
        parse_keyed(value).with_context(|| format!("{self}: {relative}"))
    }

    /// Reads a config without fetching anything: for `--dry-run`, which never downloads. `None`
    /// when it is not readable so, or does not pass its check (which `parse` already reported).
    pub fn cached_json(&self, relative: &str) -> Option<Value> {
        let file = self.readable(relative).ok()??;
        self.read_config(relative, &file).ok()
    }

    /// Reads `model_index.json` and the config of every component it names that vidgen knows
    /// (see [`ConfigCheck`]), each checked as it is read: an error is one line naming the
    /// file and the key. Only what is readable without a download is read; a missing file is
    /// left to the stage that needs it, which names it.
    pub fn check_configs(&self) -> Result<()> {
        let Some((name, index)) = self.index()? else {
            return Ok(());
        };
        let index = self.read_config(name, &index)?;
        for (folder, class) in components(&index) {
            let Some(config) = config_checks().find(|c| c.class == class) else {
                continue;
            };
            let relative = format!("{folder}/{}", config.file);
            if let Some(file) = self.readable(&relative)? {
                self.read_config(&relative, &file)?;
            }
        }
        Ok(())
    }

    /// The model's index readable without a download: `model_index.json`, else a modular
    /// pipeline's `modular_model_index.json`.
    fn index(&self) -> Result<Option<(&'static str, FileRef)>> {
        for name in [MODEL_INDEX, MODULAR_MODEL_INDEX] {
            if let Some(file) = self.readable(name)? {
                return Ok(Some((name, file)));
            }
        }
        Ok(None)
    }

    /// A file of the model where it is readable without a download (the Hub cache only).
    fn readable(&self, relative: &str) -> Result<Option<FileRef>> {
        match self {
            ModelSource::Hub(repo) => Ok(hub::cached(repo, relative).map(FileRef::Path)),
            _ => self.file(relative),
        }
    }

    /// The one place a config is read: parsed as JSON, then checked by the rules of what it
    /// configures (`model_index.json` by its own, a component's config by the class
    /// `model_index.json` gives its folder). Errors name the file and the key.
    fn read_config(&self, relative: &str, file: &FileRef) -> Result<Value> {
        let at = || format!("{self}: {relative}");
        let text = file.read().with_context(at)?;
        let value: Value = serde_json::from_str(&text).map_err(|e| {
            anyhow!(
                "{}: not valid JSON ({e}); fix the file or download the model again",
                at()
            )
        })?;
        let check = if relative == MODEL_INDEX {
            Some(check_model_index as fn(&Value) -> Result<()>)
        } else {
            self.config_check(relative)
        };
        if let Some(check) = check {
            check(&value).map_err(|e| anyhow!("{}: {e:#}", at()))?;
        }
        Ok(value)
    }

    /// The check of a component's config file, by the class `model_index.json` names for its
    /// folder (`None` for files vidgen does not interpret, or without a readable index).
    fn config_check(&self, relative: &str) -> Option<fn(&Value) -> Result<()>> {
        let (folder, file) = relative.split_once('/')?;
        let index: Value = serde_json::from_str(&self.index().ok()??.1.read().ok()?).ok()?;
        let class = components(&index).into_iter().find(|(f, _)| f == folder)?.1;
        config_checks()
            .find(|c| c.class == class && c.file == file)
            .map(|c| c.check)
    }
}

const MODEL_INDEX: &str = "model_index.json";
/// A modular pipeline's index (components as `[library, class, loading spec]`).
const MODULAR_MODEL_INDEX: &str = "modular_model_index.json";

/// A component class whose config vidgen interprets: the file in its folder and its check
/// (parsed with diffusers' defaults, then the config type's `validate`), made by
/// [`config_checks!`] in the model folder of the class.
pub struct ConfigCheck {
    pub class: &'static str,
    pub file: &'static str,
    pub check: fn(&Value) -> Result<()>,
}

/// Every config check of every model folder.
fn config_checks() -> impl Iterator<Item = &'static ConfigCheck> {
    crate::models::FOLDERS.iter().flat_map(|f| f.configs)
}

/// A config's `validate` error, either kind, as one line.
pub trait ConfigError {
    fn into_message(self) -> anyhow::Error;
}

impl ConfigError for candle_core::Error {
    fn into_message(self) -> anyhow::Error {
        message(self)
    }
}

impl ConfigError for anyhow::Error {
    fn into_message(self) -> anyhow::Error {
        self
    }
}

/// A model error as its message alone: a one-line error has no room for the backtrace candle
/// attaches when `RUST_BACKTRACE` is set.
pub(crate) fn message(e: candle_core::Error) -> anyhow::Error {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => anyhow!("{inner}"),
        other => anyhow!("{other}"),
    }
}

/// `model_index.json`: an object naming its pipeline class, each component a
/// `[library, class]` pair (`[null, null]` for an absent one).
fn check_model_index(index: &Value) -> Result<()> {
    let Value::Object(map) = index else {
        bail!("must be a JSON object with `_class_name` and the components");
    };
    match map.get("_class_name") {
        Some(Value::String(_)) => {}
        Some(other) => bail!("`_class_name` is {other}: it must name the pipeline class"),
        None => bail!("`_class_name` is missing: it names the pipeline class"),
    }
    for (key, value) in map.iter().filter(|(k, _)| !k.starts_with('_')) {
        let Value::Array(pair) = value else {
            continue; // a pipeline argument such as `boundary_ratio`, not a component
        };
        let names_ok = pair.len() == 2 && pair.iter().all(|v| v.is_string() || v.is_null());
        if !names_ok {
            bail!(
                "`{key}` is {value}: a component must be [\"library\", \"Class\"] or [null, null]"
            );
        }
    }
    Ok(())
}

/// The components `model_index.json` names: (folder, class), absent ones left out.
fn components(index: &Value) -> Vec<(String, String)> {
    let Value::Object(map) = index else {
        return Vec::new();
    };
    map.iter()
        .filter(|(k, _)| !k.starts_with('_'))
        .filter_map(|(k, v)| Some((k.clone(), v.get(1)?.as_str()?.to_string())))
        .collect()
}

/// Deserializes a config; a value of the wrong type is reported with its key (each key is
/// tried alone, the others taking their defaults, where the type has defaults for all).
pub fn parse_keyed<T: DeserializeOwned>(value: Value) -> Result<T> {
    serde_json::from_value::<T>(value.clone()).map_err(|e| {
        let all_defaults = serde_json::from_value::<T>(serde_json::json!({})).is_ok();
        let bad_key = value.as_object().filter(|_| all_defaults).and_then(|map| {
            map.iter().find_map(|(key, v)| {
                let alone = serde_json::json!({ key.as_str(): v });
                serde_json::from_value::<T>(alone)
                    .err()
                    .map(|e| anyhow!("`{key}`: {e}"))
            })
        });
        bad_key.unwrap_or_else(|| anyhow!("{e}"))
    })
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

    /// The cache folder's path (for messages).
    pub fn cache_path() -> PathBuf {
        cache().path().clone()
    }

    pub fn offline() -> bool {
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

/// The local file a flag names (`--lora`, `--transformer`): its path, or for
/// `hf:OWNER/REPO/PATH` the file `PATH` of the Hugging Face Hub repository `OWNER/REPO`, from the
/// cache or downloaded (with a progress bar) as `--model`'s files are. Its errors name no flag:
/// the caller's context does.
pub fn flag_file(path: &Path) -> Result<PathBuf> {
    let Some(hub_path) = path.to_str().and_then(|p| p.strip_prefix("hf:")) else {
        return Ok(path.to_path_buf());
    };
    let mut parts = hub_path.splitn(3, '/');
    let (Some(owner), Some(name), Some(file)) = (parts.next(), parts.next(), parts.next()) else {
        bail!("name a file of a Hugging Face Hub repository as hf:OWNER/REPO/PATH");
    };
    let repo = format!("{owner}/{name}");
    match hub::fetch(&repo, file)? {
        Some(FileRef::Path(local)) => Ok(local),
        _ if hub::offline() => bail!(
            "{repo} has no file {file} in the Hugging Face cache ({}) and HF_HUB_OFFLINE=1; download it first (unset HF_HUB_OFFLINE) or pass a local file",
            hub::cache_path().display()
        ),
        _ => bail!("the Hugging Face Hub repository {repo} has no file {file}"),
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

/// The shard files named by a `*.safetensors.index.json`, each checked to exist. A shard name
/// is a file name in the component's folder (no path: `../../etc/passwd` and `/etc/passwd` are
/// refused), and what it resolves to, links followed, stays in the model (see [`confinement`]).
/// Checks the shard index of `component` of a local model folder as loading it would (every
/// shard a file name in the component's folder that resolves inside the model), so that a
/// corrupt or escaping index is found before anything loads. Shards that are missing, like
/// weights missing altogether, and other sources (fetched as they load) are left to the load.
pub fn check_shards(source: &ModelSource, component: &str) -> Result<()> {
    if !matches!(source, ModelSource::Local(_)) {
        return Ok(());
    }
    for base in WEIGHT_NAMES {
        let index = format!("{component}/{base}.safetensors.index.json");
        if let Some(FileRef::Path(index_path)) = source.file(&index)? {
            return shards(source, component, &index_path).map(|_| ());
        }
        if source
            .file(&format!("{component}/{base}.safetensors"))?
            .is_some()
        {
            return Ok(());
        }
    }
    Ok(())
}

/// The shard files the index at `index_path` names, each present.
fn sharded(source: &ModelSource, component: &str, index_path: &Path) -> Result<Vec<PathBuf>> {
    shards(source, component, index_path)?
        .into_iter()
        .map(|(shard, path)| {
            path.with_context(|| {
                format!(
                    "shard {component}/{shard} named in {} is missing; re-download the model",
                    index_path.display()
                )
            })
        })
        .collect()
}

/// The shards the index at `index_path` names, each with its file where present: a name that
/// is not a file name in `component`'s folder, or a file that resolves outside the model, is
/// an error.
fn shards(
    source: &ModelSource,
    component: &str,
    index_path: &Path,
) -> Result<Vec<(String, Option<PathBuf>)>> {
    let text = std::fs::read_to_string(index_path)
        .with_context(|| format!("reading {}", index_path.display()))?;
    let index: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
    let map = index["weight_map"]
        .as_object()
        .with_context(|| format!("{} has no weight_map", index_path.display()))?;
    let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    // The model folder is the index's grandparent (`<model>/<component>/<index>`).
    let model = index_path
        .parent()
        .and_then(Path::parent)
        .context("the index has no model folder")?;
    let root = confinement(model)?;
    shards
        .into_iter()
        .map(|shard| {
            let mut parts = Path::new(shard).components();
            if !matches!(
                (parts.next(), parts.next()),
                (Some(std::path::Component::Normal(_)), None)
            ) {
                bail!(
                    "shard {shard:?} named in {} is not a file name in {component}/; the index is corrupt: re-download the model",
                    index_path.display()
                );
            }
            let path = match source.file(&format!("{component}/{shard}"))? {
                Some(FileRef::Path(p)) => {
                    let real = p
                        .canonicalize()
                        .with_context(|| format!("resolving shard {}", p.display()))?;
                    if !real.starts_with(&root) {
                        bail!(
                            "shard {component}/{shard} named in {} links outside the model ({}); replace the link with the file",
                            index_path.display(),
                            real.display()
                        );
                    }
                    Some(p)
                }
                _ => None,
            };
            Ok((shard.to_string(), path))
        })
        .collect()
}

/// The folder a model's shards must resolve into: the model folder, or, for a Hugging Face cache
/// snapshot (`models--org--name/snapshots/<rev>`, whose files link into `../../blobs`), the
/// cached repository.
fn confinement(model: &Path) -> Result<PathBuf> {
    let dir = model
        .canonicalize()
        .with_context(|| format!("resolving the model folder {}", model.display()))?;
    Ok(match dir.parent() {
        Some(parent) if parent.file_name().is_some_and(|n| n == "snapshots") => {
            parent.parent().unwrap_or(parent).to_path_buf()
        }
        _ => dir,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every config a shipped model carries for a component (not its tokenizer's files) is
    /// checked by its class's entry: a family that forgets one would silently skip checking it.
    #[test]
    fn every_shipped_component_config_has_a_check() {
        for model in shipped() {
            let source = ModelSource::Synthetic(model.name);
            let (_, index) = source.index().unwrap().expect("an index");
            let index: Value = serde_json::from_str(&index.read().unwrap()).unwrap();
            let components = components(&index);
            assert!(components.len() >= 3, "{}: {components:?}", model.name);
            for (folder, class) in components {
                let configs = model
                    .files
                    .iter()
                    .filter_map(|(path, _)| path.strip_prefix(&format!("{folder}/")))
                    .filter(|file| !file.starts_with("tokenizer"));
                for file in configs {
                    assert!(
                        config_checks().any(|c| c.class == class && c.file == file),
                        "{}: {folder}/{file} ({class}) has no check",
                        model.name
                    );
                }
            }
        }
    }

    /// A Hub id whose configs vidgen ships is planned from them, whatever its case.
    #[test]
    fn hub_ids_find_their_shipped_configs() {
        let hub = |id: &str| {
            ModelSource::Hub(id.into())
                .shipped_for()
                .map(|s| s.to_string())
        };
        let want = Some("synthetic:ltx-video".to_string());
        assert_eq!(hub("Lightricks/LTX-Video"), want);
        assert_eq!(hub("lightricks/ltx-video"), want);
        assert_eq!(hub("someone/not-a-model"), None);
        for model in shipped() {
            if let Some(id) = model.hub {
                let found = ModelSource::Hub(id.into()).shipped_for();
                assert!(
                    matches!(found, Some(ModelSource::Synthetic(n)) if n == model.name),
                    "{id}"
                );
            }
        }
    }
}
