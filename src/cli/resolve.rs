//! What the options mean, derived once: the one configuration every later stage reads.

use super::args::{
    ComputeDevice, DTypeChoice, GenerateArgs, GenerateOptions, MemoryModelChoice, OffloadType,
    Tristate,
};
use super::video::{FrameRule, Spelling, VideoSettings};
use super::UsageError;
use crate::memory::{
    apply_memory_rules, probe, DeviceInfo, DeviceKind, MemoryModel, MemoryOptions, Override,
};
use crate::output::OutputType;
use crate::schedulers::SchedulerKind;
use candle_core::DType;
use serde_json::json;
use std::path::{Path, PathBuf};

/// The resolved run configuration. Nothing after resolution looks at raw flags.
#[derive(Clone, Debug)]
pub struct ResolvedConfig {
    /// Every option with its final value: tri-states resolved, device and dtype concrete.
    pub options: GenerateOptions,
    /// What the memory options mean, after the device's rules.
    pub memory: MemoryOptions,
    /// What the pipeline's stages read of the generation options.
    pub generation: Generation,
    /// Where and how videos are written.
    pub output: OutputSpec,
    /// The option keys the user gave; a model's defaults replace only the others.
    pub given: std::collections::BTreeSet<String>,
    /// The selected device and its memory model.
    pub device: DeviceInfo,
    /// What the device changed, in order.
    pub overrides: Vec<Override>,
    /// Whether `options.seed` was drawn at random because none was given (see [`draw_seed`]).
    pub seed_drawn: bool,
    /// What the model family's video sizes must be (Wan's until its defaults are applied).
    pub frame_rule: FrameRule,
    /// Resolve and plan only.
    pub dry_run: bool,
    /// Machine-readable dry-run output.
    pub json: bool,
    /// On one rank of a run whose GPUs compute each video together: its group and hooks.
    pub ranks: Option<crate::parallel::Ranks>,
}

/// The generation settings a pipeline's stages read (per-prompt ones travel with each job).
#[derive(Clone, Debug)]
pub struct Generation {
    /// The model as the user named it.
    pub model: String,
    /// Text tokens per prompt, padded or truncated.
    pub max_sequence_length: usize,
    pub scheduler: SchedulerKind,
    /// Timestep shift over the scheduler config's.
    pub flow_shift: Option<f64>,
    /// Initial latents (and other random draws) from a file instead of the seed.
    pub latents: Option<PathBuf>,
    /// The conditioning image (image-to-video), for prompts whose line names none.
    pub image: Option<PathBuf>,
    /// Some `.jsonl` prompt line names its own image (known once the prompt file is read).
    pub line_images: bool,
    /// Guidance of the low-noise expert (Wan2.2 A14B).
    pub guidance_scale_2: Option<f64>,
    /// Real CFG scale of a guidance-distilled model (HunyuanVideo).
    pub true_cfg_scale: Option<f64>,
    /// The decoder's timestep conditioning and its noise (LTX-Video).
    pub decode_timestep: Option<f64>,
    pub decode_noise_scale: Option<f64>,
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
}

/// How each video is written.
#[derive(Clone, Debug)]
pub struct OutputSpec {
    pub kind: OutputType,
    /// Frames per second of the video file.
    pub fps: u32,
    /// The resolved configuration as JSON, for the file's metadata.
    pub config_json: String,
}

impl ResolvedConfig {
    /// Validates the options, probes the device and applies what it forces.
    pub fn resolve(args: GenerateArgs) -> Result<Self, UsageError> {
        let mut options = args.options;
        if args.json && !args.dry_run {
            return Err(UsageError::new(
                "--json prints the dry run's report as JSON; add --dry-run, or drop --json (a run's figures go to --stats-json FILE)",
            ));
        }
        // Frame counts and sizes follow the model family's rule, checked once it is known
        // ([`Self::with_model_defaults`]).
        validate(&options, args.dry_run, FrameRule::ANY)?;
        if let Some(stats) = &options.stats_json {
            let inputs = [
                ("--prompt-file", options.prompt_file.as_deref()),
                ("--config", args.config.as_deref()),
                ("--latents", options.latents.as_deref()),
            ];
            check_stats_target(stats, &inputs)?;
        }
        let forced = match options.memory_model {
            MemoryModelChoice::Auto => None,
            MemoryModelChoice::Discrete => Some(MemoryModel::Discrete),
            MemoryModelChoice::Unified => Some(MemoryModel::Unified),
        };
        options.sp_size = Some(sp_size(&options)?);
        // Under a launcher (whose world must be --num-gpus) this machine runs LOCAL_WORLD_SIZE
        // of the ranks.
        let world = crate::parallel::world::World::from_env()
            .map_err(|e| UsageError::new(e.to_string()))?;
        let here = match crate::parallel::launch::part(&options, world).map_err(UsageError::new)? {
            crate::parallel::launch::Part::Rank(w) => w.local_world_size as u32,
            _ => options.num_gpus,
        };
        let device =
            probe(options.device, here, forced).map_err(|e| UsageError::new(e.to_string()))?;
        options.device = device.choice();
        options.dtype = Some(options.dtype.unwrap_or(match device.kind {
            DeviceKind::Cpu => DTypeChoice::F32,
            DeviceKind::Cuda | DeviceKind::Metal => DTypeChoice::Bf16,
        }));
        let mut memory = memory_options(&options);
        let overrides = apply_memory_rules(&mut memory, &device);
        report_memory_options(&memory, &mut options);
        // A run without --seed still has one base seed, recorded with the resolved options
        // (--stats-json, the video's metadata); a dry run makes nothing, so draws none.
        let seed_drawn = options.seed.is_none() && !args.dry_run;
        if seed_drawn {
            options.seed = Some(draw_seed());
        }
        let generation = Generation {
            model: options.model.clone(),
            max_sequence_length: options.max_sequence_length as usize,
            scheduler: options.scheduler,
            flow_shift: options.flow_shift,
            latents: options.latents.clone(),
            image: options.image.clone(),
            line_images: false,
            guidance_scale_2: options.guidance_scale_2,
            true_cfg_scale: options.true_cfg_scale,
            decode_timestep: options.decode_timestep,
            decode_noise_scale: options.decode_noise_scale,
        };
        let output = OutputSpec {
            kind: options.output_type,
            fps: options.fps,
            // The video's metadata records the configuration that made it.
            config_json: serde_json::to_string(&options).unwrap_or_default(),
        };
        Ok(ResolvedConfig {
            given: args.given,
            generation,
            output,
            options,
            memory,
            device,
            overrides,
            seed_drawn,
            frame_rule: FrameRule::default(),
            dry_run: args.dry_run,
            json: args.json,
            ranks: None,
        })
    }

    /// The configuration with `defaults` in place of every option of theirs the user did not
    /// give, checked again as a whole.
    pub fn with_model_defaults(mut self, defaults: &ModelDefaults) -> Result<Self, UsageError> {
        let o = &mut self.options;
        let given = |key: &str| self.given.contains(key);
        macro_rules! default {
            ($($key:ident),*) => {$(
                if let Some(value) = defaults.$key.filter(|_| !given(stringify!($key))) {
                    o.$key = value;
                }
            )*};
        }
        default!(
            height,
            width,
            num_frames,
            fps,
            num_inference_steps,
            guidance_scale,
            max_sequence_length,
            scheduler
        );
        if let Some(rule) = defaults.frame_rule {
            self.frame_rule = rule;
        }
        validate(o, self.dry_run, self.frame_rule)?;
        self.generation.max_sequence_length = o.max_sequence_length as usize;
        self.generation.scheduler = o.scheduler;
        self.output.fps = o.fps;
        self.output.config_json = serde_json::to_string(o).unwrap_or_default();
        Ok(self)
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        match self.options.dtype {
            Some(DTypeChoice::Bf16) => DType::BF16,
            Some(DTypeChoice::F16) => DType::F16,
            Some(DTypeChoice::F32) | None => DType::F32,
        }
    }

    /// The memory model in force.
    pub fn memory_model(&self) -> MemoryModel {
        self.device.memory_model
    }

    /// The `--dry-run --json` keys this struct owns; later stages add their own keys.
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "config": self.options,
            "memory_model": self.device.memory_model,
            "device": self.device,
            "overrides": self.overrides,
            "seed_drawn": self.seed_drawn,
        })
    }
}

/// `--sp-size`, defaulting to `--num-gpus`: a divisor of the GPU count (the groups it leaves run
/// other prompts).
fn sp_size(o: &GenerateOptions) -> Result<u32, UsageError> {
    let sp = o.sp_size.unwrap_or(o.num_gpus);
    if sp == 0 || sp > o.num_gpus || !o.num_gpus.is_multiple_of(sp) {
        return Err(UsageError::new(format!(
            "--sp-size {sp} must divide --num-gpus {}: each group of --sp-size GPUs splits one video; pass --sp-size {} or a divisor of it",
            o.num_gpus, o.num_gpus
        )));
    }
    Ok(sp)
}

/// What the memory flags mean.
pub fn memory_options(o: &GenerateOptions) -> MemoryOptions {
    let tristate = |t: Tristate| match t {
        Tristate::Auto => None,
        Tristate::On => Some(true),
        Tristate::Off => Some(false),
    };
    MemoryOptions {
        dit_cpu_offload: o.dit_cpu_offload,
        use_fsdp_inference: o.use_fsdp_inference,
        dit_layerwise_offload: o.dit_layerwise_offload,
        text_encoder_cpu_offload: o.text_encoder_cpu_offload,
        image_encoder_cpu_offload: o.image_encoder_cpu_offload,
        vae_cpu_offload: o.vae_cpu_offload,
        pin_cpu_memory: o.pin_cpu_memory,
        max_pinned_memory: o.max_pinned_memory,
        text_encoder_on_cpu: o.text_encoder_compute == ComputeDevice::Cpu,
        lazy_module_load: tristate(o.lazy_module_load),
        h3_sequential_load: tristate(o.h3_sequential_load),
        leaf_level: o.offload_type == OffloadType::LeafLevel,
        num_blocks_per_group: o.num_blocks_per_group as usize,
        offload_stream: o.offload_stream,
        prefetch_depth: o.prefetch_depth.map(|d| d as usize),
        model_cpu_offload: o.model_cpu_offload,
        sequential_cpu_offload: o.sequential_cpu_offload,
        vae_tiling: o.vae_tiling,
    }
}

/// Writes what the device's rules decided back into the options, so the reported `config` is
/// the configuration that runs.
fn report_memory_options(m: &MemoryOptions, o: &mut GenerateOptions) {
    let tristate = |t: Option<bool>| match t {
        None => Tristate::Auto,
        Some(true) => Tristate::On,
        Some(false) => Tristate::Off,
    };
    o.dit_cpu_offload = m.dit_cpu_offload;
    o.use_fsdp_inference = m.use_fsdp_inference;
    o.dit_layerwise_offload = m.dit_layerwise_offload;
    o.text_encoder_cpu_offload = m.text_encoder_cpu_offload;
    o.image_encoder_cpu_offload = m.image_encoder_cpu_offload;
    o.vae_cpu_offload = m.vae_cpu_offload;
    o.pin_cpu_memory = m.pin_cpu_memory;
    o.model_cpu_offload = m.model_cpu_offload;
    o.sequential_cpu_offload = m.sequential_cpu_offload;
    o.lazy_module_load = tristate(m.lazy_module_load);
    o.h3_sequential_load = tristate(m.h3_sequential_load);
}

/// A base seed for a run without `--seed`: below 10^9, so it is short to read and retype.
pub fn draw_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    crate::weights::fnv1a(&format!("{nanos}-{}", std::process::id())) % 1_000_000_000
}

/// Refuses a `--stats-json` path that is not a regular file, or that is one of the run's own
/// files (`others`: flag and path): its file is renamed over the path at the end of the run.
pub fn check_stats_target(
    stats: &Path,
    others: &[(&str, Option<&Path>)],
) -> Result<(), UsageError> {
    if let Ok(meta) = std::fs::metadata(stats) {
        if !meta.is_file() {
            return Err(UsageError::new(format!(
                "--stats-json {} exists and is not a regular file; pass a path to a new or regular file",
                stats.display()
            )));
        }
    }
    for (flag, other) in others {
        if let Some(other) = other.filter(|o| same_file(stats, o)) {
            return Err(UsageError::new(format!(
                "--stats-json {} is the {flag} file {}; writing the stats would replace it: pass another path",
                stats.display(),
                other.display()
            )));
        }
    }
    Ok(())
}

/// Whether `a` and `b` name one file: the same path once made absolute (for files yet to be
/// written), or the same inode (links, `..`, symlinks).
pub fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
    }
    fn absolute(p: &Path) -> Option<PathBuf> {
        if let Ok(c) = std::fs::canonicalize(p) {
            return Some(c);
        }
        let parent = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        Some(std::fs::canonicalize(parent).ok()?.join(p.file_name()?))
    }
    match (absolute(a), absolute(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// Checks what no later stage could fix, with one line naming the problem and the fix.
fn validate(o: &GenerateOptions, dry_run: bool, rule: FrameRule) -> Result<(), UsageError> {
    match (&o.prompt, &o.prompt_file) {
        (Some(_), Some(_)) => {
            return Err(UsageError::new(
                "both --prompt and --prompt-file given; use one of them",
            ))
        }
        (None, None) if !dry_run => {
            return Err(UsageError::new(
                "no prompt given; pass --prompt \"...\" or --prompt-file FILE",
            ))
        }
        (Some(p), None) if p.trim().is_empty() => {
            return Err(UsageError::new(
                "--prompt is empty (only spaces); describe the video, e.g. --prompt \"a red fox in the snow\"",
            ))
        }
        _ => {}
    }
    VideoSettings {
        height: Some(o.height),
        width: Some(o.width),
        num_frames: Some(o.num_frames),
        num_inference_steps: Some(o.num_inference_steps),
        guidance_scale: Some(o.guidance_scale),
        output_video_name: o.output_video_name.as_deref(),
        rule,
    }
    .check(Spelling::Flag)
    .map_err(UsageError)?;
    for (name, value) in [
        ("fps", o.fps),
        ("max-sequence-length", o.max_sequence_length),
    ] {
        // A config file bypasses clap's range checks.
        if value == 0 {
            return Err(UsageError::new(format!(
                "--{name} 0: must be at least 1; pass a positive number"
            )));
        }
    }
    // Attention over the text grows with its square: far past any text encoder's training
    // length, and where the memory plan's byte counts would overflow.
    const MAX_TEXT_TOKENS: u32 = 1 << 16;
    if o.max_sequence_length > MAX_TEXT_TOKENS {
        return Err(UsageError::new(format!(
            "--max-sequence-length {} is more than {MAX_TEXT_TOKENS} tokens; Wan uses 512",
            o.max_sequence_length
        )));
    }
    if let Some(shift) = o.flow_shift {
        if !shift.is_finite() || shift <= 0.0 {
            return Err(UsageError::new(format!(
                "--flow-shift {shift} must be a positive number (Wan uses 3.0 at 480p, 5.0 at 720p)"
            )));
        }
    }
    if o.resume && o.overwrite {
        return Err(UsageError::new(
            "--resume skips existing outputs and --overwrite replaces them; pass only one",
        ));
    }
    // A config file can spell a NUL byte, which no path may hold.
    for (flag, path) in [
        ("--output-path", Some(&o.output_path)),
        ("--stats-json", o.stats_json.as_ref()),
        ("--prompt-file", o.prompt_file.as_ref()),
        ("--latents", o.latents.as_ref()),
    ] {
        if let Some(path) = path.filter(|p| p.as_os_str().as_encoded_bytes().contains(&0)) {
            return Err(UsageError::new(format!(
                "{flag} {:?} holds a NUL byte, which no path may; pass another path",
                path.display().to_string()
            )));
        }
    }
    if let Some(path) = &o.stats_json {
        if path.is_dir() {
            return Err(UsageError::new(format!(
                "--stats-json {} is a folder; pass a file path such as {}",
                path.display(),
                path.join("stats.json").display()
            )));
        }
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
        if let Some(parent) = parent.filter(|p| !p.is_dir()) {
            return Err(UsageError::new(format!(
                "--stats-json {}: the folder {} does not exist; create it or pass another path",
                path.display(),
                parent.display()
            )));
        }
    }
    Ok(())
}
