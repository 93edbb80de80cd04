//! What the options mean, derived once: the one configuration every later stage reads.

use super::args::{
    ComputeDevice, DTypeChoice, GenerateArgs, GenerateOptions, MemoryModelChoice, OffloadType,
    Tristate,
};
use crate::config::files::same_file;
use crate::config::video::{check_flags, FrameRule, VideoSettings};
use crate::config::{
    Batch, Echo, Generation, OutputSpec, Prompts, Resolved, ResolvedConfig, UsageError, Video,
};
use crate::memory::{apply_memory_rules, probe, DeviceKind, MemoryModel, MemoryOptions};
use crate::parallel::launch::{self, Part};
use crate::parallel::world::World;
use crate::parallel::Groups;
use candle_core::DType;
use clap::{Args, Command};
use std::path::Path;

use crate::config::draw_seed;

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
        let mut given = args.given;
        if let Some(steps) = sigma_steps(&options, &given)? {
            // The sigmas count the steps: no model's default replaces the count.
            options.num_inference_steps = steps;
            given.insert("num_inference_steps".into());
        }
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
        let world = World::from_env().map_err(|e| UsageError::new(e.to_string()))?;
        let here = match launch::part(options.num_gpus as usize, world).map_err(UsageError::new)? {
            Part::Rank(w) => w.local_world_size as u32,
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
        let o = options;
        let prompts = match (&o.prompt, &o.prompt_file) {
            (Some(p), _) => Some(Prompts::Text(p.clone())),
            (None, Some(file)) => Some(Prompts::File(file.clone())),
            (None, None) => None,
        };
        Ok(ResolvedConfig::new(Resolved {
            generation: Generation {
                model: o.model.clone(),
                prompts,
                max_sequence_length: o.max_sequence_length as usize,
                scheduler: o.scheduler,
                flow_shift: o.flow_shift,
                sigmas: o.sigmas.clone(),
                latents: o.latents.clone(),
                image: o.image.clone(),
                line_images: false,
                loras: [o.lora.clone(), o.lora_2.clone()],
                transformer_files: [o.transformer.clone(), o.transformer_2.clone()],
                storage_dtype: o.storage_dtype,
                cache: o.cache.clone(),
                fp8_matmul: o.fp8_matmul,
                attention: o.attention,
                guidance_scale_2: o.guidance_scale_2,
                true_cfg_scale: o.true_cfg_scale,
                decode_timestep: o.decode_timestep,
                decode_noise_scale: o.decode_noise_scale,
            },
            video: Video {
                height: o.height,
                width: o.width,
                num_frames: o.num_frames,
                num_inference_steps: o.num_inference_steps,
                guidance_scale: o.guidance_scale,
                negative_prompt: o.negative_prompt.clone(),
                seed: o.seed,
                seed_drawn,
            },
            output: OutputSpec {
                kind: o.output_type,
                fps: o.fps,
                folder: o.output_path.clone(),
                name: o.output_video_name.clone(),
                // The video's metadata records the configuration that made it.
                config_json: serde_json::to_string(&o).unwrap_or_default(),
                image: false,
            },
            batch: Batch {
                order: o.batch_order,
                overwrite: o.overwrite,
                resume: o.resume,
                quiet: o.quiet,
                stats_json: o.stats_json.clone(),
            },
            memory,
            dtype: match o.dtype {
                Some(DTypeChoice::Bf16) => DType::BF16,
                Some(DTypeChoice::F16) => DType::F16,
                Some(DTypeChoice::F32) | None => DType::F32,
            },
            tf32: o.tf32,
            groups: Groups::of(o.num_gpus, o.sp_size),
            device,
            overrides,
            given,
            echo: echo(&o),
            dry_run: args.dry_run,
            json: args.json,
        }))
    }
}

/// Every option with its value, as config-file keys in the order the options are declared.
fn echo(o: &GenerateOptions) -> Echo {
    let serde_json::Value::Object(mut values) =
        serde_json::to_value(o).expect("options serialize to a JSON object")
    else {
        unreachable!("options serialize to a JSON object")
    };
    let order = GenerateOptions::augment_args(Command::new("generate"));
    let keys: Vec<String> = order
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect();
    Echo::new(
        keys.into_iter()
            .filter_map(|key| values.remove(&key).map(|value| (key, value))),
    )
}

/// The number of steps `--sigmas` gives (one sigma per step), once the sigmas are checked to
/// be a schedule: each in (0, 1], falling step by step, as many as `--num-inference-steps`
/// where that is given too (the family checks that its sampler takes them).
fn sigma_steps(
    o: &GenerateOptions,
    given: &std::collections::BTreeSet<String>,
) -> Result<Option<u32>, UsageError> {
    let Some(sigmas) = &o.sigmas else {
        return Ok(None);
    };
    if sigmas.is_empty() {
        return Err(UsageError::new(
            "--sigmas is empty; give one sigma per step, e.g. 1,0.75,0.5,0.25",
        ));
    }
    if let Some(s) = sigmas.iter().find(|s| !(**s > 0.0 && **s <= 1.0)) {
        return Err(UsageError::new(format!(
            "--sigmas {s}: each sigma must be in (0, 1] (1 is pure noise; the shift and the final 0 are added), e.g. 1,0.75,0.5,0.25"
        )));
    }
    if let Some(pair) = sigmas.windows(2).find(|w| w[1] >= w[0]) {
        return Err(UsageError::new(format!(
            "--sigmas {} then {}: the sigmas must fall from step to step, e.g. 1,0.75,0.5,0.25",
            pair[0], pair[1]
        )));
    }
    let steps = u32::try_from(sigmas.len())
        .map_err(|_| UsageError::new("--sigmas gives more steps than any run can take"))?;
    if given.contains("num_inference_steps") && o.num_inference_steps != steps {
        return Err(UsageError::new(format!(
            "--num-inference-steps {} but --sigmas gives {steps} sigmas, one per step; drop --num-inference-steps or give {} sigmas",
            o.num_inference_steps, o.num_inference_steps
        )));
    }
    Ok(Some(steps))
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
        dit_resident_memory: o.dit_resident_memory.unwrap_or(0),
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
        vae_tile_size: o.vae_tile_size,
        low_activation: o.low_activation,
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
    o.dit_resident_memory = Some(m.dit_resident_memory).filter(|&b| b > 0);
    o.text_encoder_cpu_offload = m.text_encoder_cpu_offload;
    o.image_encoder_cpu_offload = m.image_encoder_cpu_offload;
    o.vae_cpu_offload = m.vae_cpu_offload;
    o.pin_cpu_memory = m.pin_cpu_memory;
    o.model_cpu_offload = m.model_cpu_offload;
    o.sequential_cpu_offload = m.sequential_cpu_offload;
    o.lazy_module_load = tristate(m.lazy_module_load);
    o.h3_sequential_load = tristate(m.h3_sequential_load);
}

/// Refuses a `--stats-json` path that the stats, renamed over it at the end of the run, would
/// destroy: a symbolic link, what is not a regular file, one of the run's own files (`others`:
/// flag and path), or a file that is not stats vidgen wrote (another run's video, a document).
pub fn check_stats_target(
    stats: &Path,
    others: &[(&str, Option<&Path>)],
) -> Result<(), UsageError> {
    let Ok(meta) = std::fs::symlink_metadata(stats) else {
        return Ok(());
    };
    if meta.file_type().is_symlink() {
        return Err(UsageError::new(format!(
            "--stats-json {} is a symbolic link; vidgen writes the stats only to a new file or stats it wrote: pass the path of the file itself, or another",
            stats.display()
        )));
    }
    if !meta.is_file() {
        return Err(UsageError::new(format!(
            "--stats-json {} exists and is not a regular file; pass a path to a new or regular file",
            stats.display()
        )));
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
    if meta.len() > 0 && !written_by_stats(stats) {
        return Err(UsageError::new(format!(
            "--stats-json {} exists and is not stats vidgen wrote; writing the stats would replace it: pass a new path (or remove the file)",
            stats.display()
        )));
    }
    Ok(())
}

/// Whether the file at `path` is a `--stats-json` document: a JSON object with vidgen's
/// version and the jobs (read as a stream, whatever its size).
fn written_by_stats(path: &Path) -> bool {
    #[derive(serde::Deserialize)]
    struct Stats {
        #[serde(rename = "vidgen_version")]
        _version: String,
        #[serde(rename = "jobs")]
        _jobs: Vec<serde::de::IgnoredAny>,
    }
    std::fs::File::open(path).is_ok_and(|file| {
        serde_json::from_reader::<_, Stats>(std::io::BufReader::new(file)).is_ok()
    })
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
    check_flags(
        &VideoSettings {
            height: Some(o.height),
            width: Some(o.width),
            num_frames: Some(o.num_frames),
            num_inference_steps: Some(o.num_inference_steps),
            guidance_scale: Some(o.guidance_scale),
            output_video_name: o.output_video_name.as_deref(),
            rule,
        },
        o.fps,
        o.max_sequence_length,
    )?;
    if let Some(shift) = o.flow_shift {
        if !shift.is_finite() || shift <= 0.0 {
            return Err(UsageError::new(format!(
                "--flow-shift {shift} must be a positive number (Wan uses 3.0 at 480p, 5.0 at 720p)"
            )));
        }
    }
    if let (Some(px), false) = (o.vae_tile_size, o.vae_tiling) {
        return Err(UsageError::new(format!(
            "--vae-tile-size {px} sizes the tiles of --vae-tiling, which is off; add --vae-tiling"
        )));
    }
    if o.dit_resident_memory.is_some() {
        let not_streamed = [
            (!o.dit_layerwise_offload, "--no-dit-layerwise-offload"),
            (o.model_cpu_offload, "--model-cpu-offload"),
            (o.sequential_cpu_offload, "--sequential-cpu-offload"),
            (o.use_fsdp_inference, "--use-fsdp-inference"),
        ];
        if let Some((_, flag)) = not_streamed.iter().find(|(given, _)| *given) {
            return Err(UsageError::new(format!(
                "--dit-resident-memory keeps blocks of a DiT streamed by --dit-layerwise-offload, which {flag} replaces; drop one of them"
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    /// The echo is the options as they serialize, key for key and in their order, so the
    /// reports and a video's metadata show the same text as before a model's defaults.
    #[test]
    fn the_echo_is_the_options_in_their_order() {
        let argv = ["vidgen", "generate", "--prompt", "a", "--height", "256"];
        let super::super::Parsed::Generate(args) =
            super::super::parse(argv.map(OsString::from)).unwrap()
        else {
            panic!("not a generate command")
        };
        let o = args.options;
        assert_eq!(
            serde_json::to_string(&echo(&o)).unwrap(),
            serde_json::to_string(&o).unwrap()
        );
    }
}
