//! What a run means, resolved once from what was said: `cli` parses the flags and builds a
//! [`ResolvedConfig`]; everything after it (the pipeline, the memory planner, the launcher)
//! reads its typed groups through accessors and never sees a raw option, nor imports `cli`.
//! (As ripgrep's `LowArgs` -> `HiArgs`.)

pub mod files;
pub mod video;

use crate::memory::{DeviceInfo, MemoryModel, MemoryOptions, Override};
use crate::output::OutputType;
use crate::parallel::{Groups, Ranks};
use crate::schedulers::SchedulerKind;
use candle_core::DType;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::BTreeSet;
use std::path::PathBuf;
use video::{check_flags, FrameRule, VideoSettings};

/// Bad input from the user: reported as one line, exit code 2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(pub String);

impl UsageError {
    pub fn new(message: impl Into<String>) -> Self {
        UsageError(message.into())
    }

    /// `e` (its whole chain, on one line) as bad input: for `map_err` where a failure means the
    /// user's input does not fit (a draws file for another size).
    pub fn from_error(e: anyhow::Error) -> anyhow::Error {
        UsageError::new(format!("{e:#}")).into()
    }
}

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// The resolved run configuration. Nothing after resolution looks at raw flags.
#[derive(Clone, Debug)]
pub struct ResolvedConfig {
    /// What resolution found.
    resolved: Resolved,
    /// What the model family's video sizes must be (Wan's until its defaults are applied).
    frame_rule: FrameRule,
    /// On one rank of a run whose GPUs compute each video together: its group and hooks.
    ranks: Option<Ranks>,
}

/// What resolution hands [`ResolvedConfig::new`], once.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub generation: Generation,
    pub video: Video,
    pub output: OutputSpec,
    pub batch: Batch,
    /// What the memory options mean, after the device's rules.
    pub memory: MemoryOptions,
    /// The selected device and its memory model.
    pub device: DeviceInfo,
    /// The compute dtype.
    pub dtype: DType,
    /// Whether f32 convolutions may use TF32 math (`--tf32`).
    pub tf32: bool,
    /// The GPUs of the run (`--num-gpus`) in sequence-parallel groups (`--sp-size`).
    pub groups: Groups,
    /// What the device changed, in order.
    pub overrides: Vec<Override>,
    /// The option keys the user gave; a model's defaults replace only the others.
    pub given: BTreeSet<String>,
    pub echo: Echo,
    /// Resolve and plan only.
    pub dry_run: bool,
    /// Machine-readable dry-run output.
    pub json: bool,
}

/// The generation settings a pipeline's stages read (per-prompt ones are in [`Video`]).
#[derive(Clone, Debug)]
pub struct Generation {
    /// The model as the user named it.
    pub model: String,
    /// Where the prompts come from (`None`: none given, a dry run).
    pub prompts: Option<Prompts>,
    /// Text tokens per prompt, padded or truncated.
    pub max_sequence_length: usize,
    pub scheduler: SchedulerKind,
    /// Timestep shift over the scheduler config's.
    pub flow_shift: Option<f64>,
    /// The Euler sampler's sigmas before the shift, one per step (`--sigmas`), in place of its
    /// own spacing.
    pub sigmas: Option<Vec<f64>>,
    /// Initial latents (and other random draws) from a file instead of the seed.
    pub latents: Option<PathBuf>,
    /// The conditioning image (image-to-video), for prompts whose line names none.
    pub image: Option<PathBuf>,
    /// Some `.jsonl` prompt line names its own image (known once the prompt file is read).
    pub line_images: bool,
    /// The LoRAs of the transformer and of the second expert (`transformer_2`), in order.
    pub loras: [Vec<crate::lora::LoraSpec>; 2],
    /// Single files replacing the weights of the transformer and of `transformer_2`.
    pub transformer_files: [Option<PathBuf>; 2],
    /// The DiTs' Linear weights stored in fp8 (diffusers' layerwise casting).
    pub storage_dtype: Option<crate::weights::StorageDtype>,
    /// A step cache over the DiT's blocks (`--cache`).
    pub cache: Option<crate::models::step_cache::CacheSpec>,
    /// The DiT blocks' Linears run as fp8 matmuls (`--fp8-matmul`).
    pub fp8_matmul: bool,
    /// How the DiTs' attention computes (`--attention`).
    pub attention: crate::models::sage_attention::AttentionKind,
    /// Guidance of the low-noise expert (Wan2.2 A14B).
    pub guidance_scale_2: Option<f64>,
    /// Real CFG scale of a guidance-distilled model (HunyuanVideo).
    pub true_cfg_scale: Option<f64>,
    /// The decoder's timestep conditioning and its noise (LTX-Video).
    pub decode_timestep: Option<f64>,
    pub decode_noise_scale: Option<f64>,
}

/// Where the prompts come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompts {
    /// `--prompt`: one prompt.
    Text(String),
    /// `--prompt-file`: one per line (or `.jsonl` objects).
    File(PathBuf),
}

/// Each video's settings unless its prompt-file line gives its own.
#[derive(Clone, Debug)]
pub struct Video {
    pub height: u32,
    pub width: u32,
    pub num_frames: u32,
    pub num_inference_steps: u32,
    pub guidance_scale: f64,
    pub negative_prompt: String,
    /// The base seed: prompt *i* gets it + *i* − 1 (`None` only in a dry run without `--seed`).
    pub seed: Option<u64>,
    /// Whether `seed` was drawn at random because none was given (see [`draw_seed`]).
    pub seed_drawn: bool,
}

/// How each video is written.
#[derive(Clone, Debug)]
pub struct OutputSpec {
    pub kind: OutputType,
    /// Frames per second of the video file.
    pub fps: u32,
    /// The folder outputs are written to.
    pub folder: PathBuf,
    /// The file name without extension of a single prompt's output (`None`: from the prompt).
    pub name: Option<String>,
    /// The resolved configuration as JSON, for the file's metadata.
    pub config_json: String,
    /// The model makes one image: `png` is one file `NAME.png`, not a folder of frames.
    pub image: bool,
}

/// How a batch of prompts runs.
#[derive(Clone, Debug)]
pub struct Batch {
    pub order: BatchOrderChoice,
    /// Replace outputs that already exist.
    pub overwrite: bool,
    /// Skip the prompts whose output already exists.
    pub resume: bool,
    /// Print only errors.
    pub quiet: bool,
    /// Where the run's figures go.
    pub stats_json: Option<PathBuf>,
}

/// The order a batch walks the stages in, as asked.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BatchOrderChoice {
    /// Stage-major when components load late (lazy or sequential load), else prompt-major.
    Auto,
    /// Each prompt goes through every stage before the next starts.
    Prompt,
    /// Every prompt passes a stage before any goes to the next.
    Stage,
}

/// A model family's own defaults (`None`: vidgen's); a key the user gave is never replaced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelDefaults {
    pub height: Option<u32>,
    pub width: Option<u32>,
    pub num_frames: Option<u32>,
    pub fps: Option<u32>,
    pub num_inference_steps: Option<u32>,
    pub guidance_scale: Option<f64>,
    pub max_sequence_length: Option<u32>,
    /// The family's rule for frame counts and sizes (`None`: Wan's 4k+1 and 16).
    pub frame_rule: Option<FrameRule>,
    /// The sampler the published pipeline ships with.
    pub scheduler: Option<SchedulerKind>,
    /// The model samples with its own scheduler (`--scheduler` picks none of it): the reports
    /// leave `scheduler` out rather than echo a sampler that does not run.
    pub own_sampler: bool,
    /// The model makes one image, not a video (FLUX.1): `--output-type` defaults to `png`,
    /// written as one file `NAME.png`.
    pub image: bool,
}

impl ModelDefaults {
    /// A published pipeline's video: `height` x `width`, `num_frames` frames at `fps`.
    pub fn video(height: u32, width: u32, num_frames: u32, fps: u32) -> Self {
        ModelDefaults {
            height: Some(height),
            width: Some(width),
            num_frames: Some(num_frames),
            fps: Some(fps),
            ..ModelDefaults::default()
        }
    }

    /// These defaults with the published pipeline's sampling: `steps` steps at guidance
    /// `guidance_scale`, prompts of `text_tokens` tokens.
    pub fn sampling(self, steps: u32, guidance_scale: f64, text_tokens: u32) -> Self {
        ModelDefaults {
            num_inference_steps: Some(steps),
            guidance_scale: Some(guidance_scale),
            max_sequence_length: Some(text_tokens),
            ..self
        }
    }
}

/// Every option with its final value, as config-file keys in the options' order: the run's
/// configuration as the reports show it (`--stats-json`, the dry run, a video's metadata).
#[derive(Clone, Debug, Default)]
pub struct Echo(Vec<(String, serde_json::Value)>);

impl Echo {
    pub fn new(entries: impl IntoIterator<Item = (String, serde_json::Value)>) -> Self {
        Echo(entries.into_iter().collect())
    }

    /// Records `key`'s new value.
    fn set(&mut self, key: &str, value: impl Serialize) {
        if let Some((_, old)) = self.0.iter_mut().find(|(k, _)| k == key) {
            *old = serde_json::to_value(value).expect("option values serialize");
        }
    }

    /// Leaves `key` out of the reports (an option the model has no use for).
    fn remove(&mut self, key: &str) {
        self.0.retain(|(k, _)| k != key);
    }
}

impl Serialize for Echo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (key, value) in &self.0 {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// One rank's place in a run on several GPUs: what its configuration changes.
pub struct Rank {
    /// Its rank in the world: a group leader other than rank 0 writes its stats as
    /// `NAME.rankR.EXT`.
    pub rank: usize,
    /// The GPU it drives.
    pub local_rank: usize,
    /// Its sequence-parallel group's collective and hooks (`None`: prompt parallelism).
    pub ranks: Option<Ranks>,
    /// Where a rank that does not lead its group writes (nothing the run keeps), with no stats.
    pub scratch: Option<PathBuf>,
}

impl ResolvedConfig {
    /// The configuration of what `resolved` says, sized by Wan's frame rule until
    /// [`Self::with_model_defaults`].
    pub fn new(resolved: Resolved) -> Self {
        ResolvedConfig {
            resolved,
            frame_rule: FrameRule::default(),
            ranks: None,
        }
    }

    /// The configuration with `defaults` in place of every option of theirs the user did not
    /// give, checked again as a whole.
    pub fn with_model_defaults(mut self, defaults: &ModelDefaults) -> Result<Self, UsageError> {
        macro_rules! default {
            ($($key:ident: $field:expr),*) => {$(
                if let Some(value) = defaults.$key.filter(|_| !self.resolved.given.contains(stringify!($key))) {
                    self.resolved.echo.set(stringify!($key), value);
                    $field = value;
                }
            )*};
        }
        default!(
            height: self.resolved.video.height,
            width: self.resolved.video.width,
            num_frames: self.resolved.video.num_frames,
            fps: self.resolved.output.fps,
            num_inference_steps: self.resolved.video.num_inference_steps,
            guidance_scale: self.resolved.video.guidance_scale,
            scheduler: self.resolved.generation.scheduler
        );
        if defaults.own_sampler {
            self.resolved.echo.remove("scheduler");
        }
        if defaults.image {
            if !self.resolved.given.contains("output_type") {
                self.resolved.echo.set("output_type", OutputType::Png);
                self.resolved.output.kind = OutputType::Png;
            }
            self.resolved.output.image = true;
        }
        let max_sequence_length = defaults
            .max_sequence_length
            .filter(|_| !self.resolved.given.contains("max_sequence_length"));
        if let Some(value) = max_sequence_length {
            self.resolved.echo.set("max_sequence_length", value);
            self.resolved.generation.max_sequence_length = value as usize;
        }
        if let Some(rule) = defaults.frame_rule {
            self.frame_rule = rule;
        }
        let v = &self.resolved.video;
        check_flags(
            &VideoSettings {
                height: Some(v.height),
                width: Some(v.width),
                num_frames: Some(v.num_frames),
                num_inference_steps: Some(v.num_inference_steps),
                guidance_scale: Some(v.guidance_scale),
                output_video_name: self.resolved.output.name.as_deref(),
                rule: self.frame_rule,
            },
            self.resolved.output.fps,
            self.resolved.generation.max_sequence_length as u32,
        )?;
        self.resolved.output.config_json =
            serde_json::to_string(&self.resolved.echo).unwrap_or_default();
        Ok(self)
    }

    /// The configuration with `line_images` known (some prompt-file line names its own image).
    pub fn with_line_images(mut self, line_images: bool) -> Self {
        self.resolved.generation.line_images = line_images;
        self
    }

    /// The configuration with the memory options `options` in place of its own (the leaner set
    /// the free memory asks for), each change recorded as an override for `reason`.
    pub fn with_memory_options(mut self, options: MemoryOptions, reason: &str) -> Self {
        let changes = crate::memory::overrides::changes(&self.resolved.memory, &options, reason);
        self.resolved.overrides.extend(changes);
        self.resolved.memory = options;
        self
    }

    /// The configuration as planned for a device of `total` bytes (`None`: size unknown).
    pub fn with_total_memory(mut self, total: Option<u64>) -> Self {
        self.resolved.device.total_memory = total;
        self
    }

    /// What `rank` of a run on several GPUs runs with: the GPU of its local rank, its group's
    /// hooks, and its outputs in its scratch folder (a rank that does not lead its group) or its
    /// stats next to rank 0's as `NAME.rankR.EXT` (a leader other than rank 0).
    pub fn for_rank(mut self, rank: Rank) -> Self {
        if rank.local_rank != self.resolved.device.ordinal {
            // The probe's context is on another GPU: it would hold that GPU's memory for nothing.
            self.resolved.device.context = Default::default();
        }
        self.resolved.device.ordinal = rank.local_rank;
        self.resolved
            .echo
            .set("device", self.resolved.device.choice());
        self.ranks = rank.ranks;
        if let Some(dir) = rank.scratch {
            self.resolved.output.folder = dir;
            self.resolved.batch.stats_json = None;
        } else if let Some(path) = self
            .resolved
            .batch
            .stats_json
            .as_mut()
            .filter(|_| rank.rank > 0)
        {
            let stem = path
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string();
            let name = match path.extension() {
                Some(ext) => format!("{stem}.rank{}.{}", rank.rank, ext.to_string_lossy()),
                None => format!("{stem}.rank{}", rank.rank),
            };
            path.set_file_name(name);
        }
        self.resolved
            .echo
            .set("output_path", &self.resolved.output.folder);
        self.resolved
            .echo
            .set("stats_json", &self.resolved.batch.stats_json);
        self
    }

    pub fn generation(&self) -> &Generation {
        &self.resolved.generation
    }

    pub fn video(&self) -> &Video {
        &self.resolved.video
    }

    pub fn output(&self) -> &OutputSpec {
        &self.resolved.output
    }

    pub fn batch(&self) -> &Batch {
        &self.resolved.batch
    }

    /// What the memory options mean, after the device's rules.
    pub fn memory(&self) -> &MemoryOptions {
        &self.resolved.memory
    }

    /// The selected device and its memory model.
    pub fn device(&self) -> &DeviceInfo {
        &self.resolved.device
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.resolved.dtype
    }

    /// Whether f32 convolutions may use TF32 math.
    pub fn tf32(&self) -> bool {
        self.resolved.tf32
    }

    /// The GPUs of the run in sequence-parallel groups.
    pub fn groups(&self) -> Groups {
        self.resolved.groups
    }

    /// The memory model in force.
    pub fn memory_model(&self) -> MemoryModel {
        self.resolved.device.memory_model
    }

    /// What the device changed, in order.
    pub fn overrides(&self) -> &[Override] {
        &self.resolved.overrides
    }

    /// Whether the user gave the option `key` (a config-file key).
    pub fn given(&self, key: &str) -> bool {
        self.resolved.given.contains(key)
    }

    /// Every option with its final value.
    pub fn echo(&self) -> &Echo {
        &self.resolved.echo
    }

    /// What the model family's video sizes must be (Wan's until its defaults are applied).
    pub fn frame_rule(&self) -> FrameRule {
        self.frame_rule
    }

    /// Resolve and plan only.
    pub fn dry_run(&self) -> bool {
        self.resolved.dry_run
    }

    /// Machine-readable dry-run output.
    pub fn json(&self) -> bool {
        self.resolved.json
    }

    /// On one rank of a run whose GPUs compute each video together: its group and hooks.
    pub fn ranks(&self) -> Option<&Ranks> {
        self.ranks.as_ref()
    }

    /// The `--dry-run --json` keys this struct owns; later stages add their own keys.
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "config": self.resolved.echo,
            "memory_model": self.resolved.device.memory_model,
            "device": self.resolved.device,
            "overrides": self.resolved.overrides,
            "seed_drawn": self.resolved.video.seed_drawn,
        })
    }
}

/// A base seed for a run without `--seed`: below 10^9, so it is short to read and retype.
pub fn draw_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    crate::weights::fnv1a(&format!("{nanos}-{}", std::process::id())) % 1_000_000_000
}
