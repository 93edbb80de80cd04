//! What the user said: every `generate` option, defined once.
//!
//! The same struct is parsed from the command line (clap, hyphenated flags) and from a `--config`
//! TOML file (serde, snake_case keys), so a flag and its config key can never drift apart. Values
//! here are validated for form only; what they mean is derived once, in [`super::resolve`].

use crate::lora::LoraSpec;
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

use crate::config::video::parse_finite;
pub use crate::config::BatchOrderChoice;
pub use crate::memory::probe::{parse_device, DeviceChoice};
pub use crate::output::OutputType;
pub use crate::schedulers::SchedulerKind;

/// The command line of the `vidgen` binary.
#[derive(Parser, Debug)]
#[command(
    name = "vidgen",
    version,
    about = "Text to video with open video diffusion models, on whatever memory the machine has"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands of `vidgen`.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate videos from text prompts.
    #[command(
        allow_negative_numbers = true,
        args_override_self = true,
        after_help = "Every on/off flag also takes a value (--vae-cpu-offload=false) and has a \
                            --no- form (--no-vae-cpu-offload).\n\
                            Resolution order: defaults < --config file < command line < what the device forces."
    )]
    Generate(Box<GenerateArgs>),
}

/// Flags of `vidgen generate` that steer this invocation but are not options of the run.
#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    /// TOML file with the same options as snake_case keys; command-line flags win over it.
    #[arg(long, value_name = "FILE.toml")]
    pub config: Option<PathBuf>,
    /// Resolve everything, print the resolved config and the planned stages, load nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub options: GenerateOptions,
    /// The option keys the user gave (on the command line or in the config file): a model's own
    /// defaults replace only the others.
    #[arg(skip)]
    pub given: std::collections::BTreeSet<String>,
}

/// Every option of a run. Field names are the config-file keys; the flags are their hyphenated forms.
#[derive(Args, Serialize, Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct GenerateOptions {
    // ----- FastVideo's inference options -----
    /// Keep the DiT's weights in host memory when it is not computing.
    #[arg(long = "[no-]dit-cpu-offload", alias = "dit-cpu-offload", help_heading = "Offload (FastVideo)", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub dit_cpu_offload: bool,
    /// Shard the DiT across GPUs with FSDP (multi-GPU).
    #[arg(long = "[no-]use-fsdp-inference", alias = "use-fsdp-inference", help_heading = "Offload (FastVideo)", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub use_fsdp_inference: bool,
    /// Stream the DiT's blocks from host memory, prefetching the next while one computes.
    #[arg(long = "[no-]dit-layerwise-offload", alias = "dit-layerwise-offload", help_heading = "Offload (FastVideo)", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub dit_layerwise_offload: bool,
    /// Keep the text encoder's weights off the GPU.
    #[arg(long = "[no-]text-encoder-cpu-offload", alias = "text-encoder-cpu-offload", help_heading = "Offload (FastVideo)", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub text_encoder_cpu_offload: bool,
    /// Keep the image encoder's weights in host memory between uses.
    #[arg(long = "[no-]image-encoder-cpu-offload", alias = "image-encoder-cpu-offload", help_heading = "Offload (FastVideo)", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub image_encoder_cpu_offload: bool,
    /// Keep the VAE's weights in host memory, copied to the GPU for decoding only.
    #[arg(long = "[no-]vae-cpu-offload", alias = "vae-cpu-offload", help_heading = "Offload (FastVideo)", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub vae_cpu_offload: bool,
    /// Hold offloaded weights in page-locked host memory (fast, asynchronous copies).
    #[arg(long = "[no-]pin-cpu-memory", alias = "pin-cpu-memory", help_heading = "Offload (FastVideo)", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub pin_cpu_memory: bool,
    /// Of a streamed DiT, keep up to SIZE of its blocks on the device (e.g. 12GiB): spread
    /// through each pass and copied once per stage; the rest stream every step. Unset: none
    /// where a DiT placement option is given; with the default placement, where the whole DiT
    /// does not fit, what the free memory allows.
    #[arg(long, help_heading = "Offload (FastVideo)", value_name = "SIZE", value_parser = parse_size)]
    #[serde(default, deserialize_with = "size_or_bytes")]
    pub dit_resident_memory: Option<u64>,
    /// Pin at most SIZE of host memory (e.g. 2GiB): offloaded weights stay in the memory map
    /// and stream through a pinned staging ring. Unset: every offloaded weight is pinned.
    #[arg(long, help_heading = "Offload (FastVideo)", value_name = "SIZE", value_parser = parse_size)]
    #[serde(default, deserialize_with = "size_or_bytes")]
    pub max_pinned_memory: Option<u64>,
    /// Where an offloaded text encoder computes: streamed through the GPU block by block, or
    /// on the CPU.
    #[arg(long, help_heading = "Offload (FastVideo)", value_enum, default_value_t = ComputeDevice::Gpu)]
    pub text_encoder_compute: ComputeDevice,
    /// Load each component on first use and free it after its last stage (auto: by the device).
    #[arg(long = "[no-]lazy-module-load", alias = "lazy-module-load", help_heading = "Offload (FastVideo)", default_value = "auto", num_args = 0..=1, default_missing_value = "true", value_name = "auto|BOOL")]
    pub lazy_module_load: Tristate,
    /// Load the text encoder, encode, free it, then load the DiT and VAE (auto: by the device).
    #[arg(long = "[no-]h3-sequential-load", alias = "h3-sequential-load", visible_alias = "sequential-load", help_heading = "Offload (FastVideo)", default_value = "auto", num_args = 0..=1, default_missing_value = "true", value_name = "auto|BOOL")]
    pub h3_sequential_load: Tristate,

    // ----- diffusers-style group offloading -----
    /// What moves together: a run of blocks, or (leaf-level) each step of a block alone.
    #[arg(long, help_heading = "Group offload (diffusers)", value_enum, default_value_t = OffloadType::BlockLevel)]
    pub offload_type: OffloadType,
    /// Blocks per group with --offload-type block-level and --no-offload-stream (with a copy
    /// stream groups are single blocks, as diffusers' use_stream makes them).
    #[arg(long, help_heading = "Group offload (diffusers)", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    pub num_blocks_per_group: u32,
    /// Prefetch groups on a dedicated copy stream (off: synchronous copies).
    #[arg(long = "[no-]offload-stream", alias = "offload-stream", help_heading = "Group offload (diffusers)", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub offload_stream: bool,
    /// How many device slots ahead the copy stream fills (a slot holds the largest group, or
    /// as many consecutive smaller ones as fit) [default: 1; leaf level: as many steps as make
    /// the smallest block].
    #[arg(long, help_heading = "Group offload (diffusers)", value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    pub prefetch_depth: Option<u32>,
    /// diffusers' enable_model_cpu_offload: whole components move to the GPU in pipeline order.
    #[arg(long = "[no-]model-cpu-offload", alias = "model-cpu-offload", help_heading = "Group offload (diffusers)", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub model_cpu_offload: bool,
    /// diffusers' enable_sequential_cpu_offload: step by step, copied synchronously when used.
    #[arg(long = "[no-]sequential-cpu-offload", alias = "sequential-cpu-offload", help_heading = "Group offload (diffusers)", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub sequential_cpu_offload: bool,

    // ----- generation -----
    /// A Hub repo id, a local diffusers folder, or synthetic:<name> (random weights, real configs).
    #[arg(
        long,
        help_heading = "Generation",
        default_value = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    )]
    pub model: String,
    /// The text prompt.
    #[arg(long, help_heading = "Generation")]
    pub prompt: Option<String>,
    /// A file of prompts, one per line (or .jsonl objects).
    #[arg(long, help_heading = "Generation", value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,
    /// What the video should not show (classifier-free guidance).
    #[arg(long, help_heading = "Generation", default_value = "")]
    pub negative_prompt: String,
    /// Frame height in pixels (a multiple of 16).
    #[arg(long, help_heading = "Generation", default_value_t = 480, value_parser = clap::value_parser!(u32).range(1..))]
    pub height: u32,
    /// Frame width in pixels (a multiple of 16).
    #[arg(long, help_heading = "Generation", default_value_t = 832, value_parser = clap::value_parser!(u32).range(1..))]
    pub width: u32,
    /// Number of frames, 4k+1.
    #[arg(long, help_heading = "Generation", default_value_t = 81, value_parser = clap::value_parser!(u32).range(1..))]
    pub num_frames: u32,
    /// Frames per second of the video file.
    #[arg(long, help_heading = "Generation", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub fps: u32,
    /// Denoising steps.
    #[arg(long, help_heading = "Generation", default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
    pub num_inference_steps: u32,
    /// Classifier-free guidance scale (1 disables the negative pass).
    #[arg(long, help_heading = "Generation", default_value_t = 5.0, value_parser = parse_finite)]
    pub guidance_scale: f64,
    /// Timestep shift of the flow schedule [default: the scheduler config's].
    #[arg(long, help_heading = "Generation", value_parser = parse_finite)]
    pub flow_shift: Option<f64>,
    /// Sampler: UniPC multistep (diffusers' default for Wan) or flow-matching Euler.
    #[arg(long, help_heading = "Generation", value_enum, default_value_t = SchedulerKind::UniPc)]
    pub scheduler: SchedulerKind,
    /// The schedule's sigmas before the shift, one per step from 1 (pure noise) down, as
    /// diffusers' `FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=...)` takes them (with
    /// --scheduler euler): 1,0.75,0.5,0.25 is the 4-step distillation recipes' schedule
    /// [default: the scheduler's own spacing of --num-inference-steps].
    #[arg(long, help_heading = "Generation", value_delimiter = ',', value_parser = parse_finite, value_name = "S1,S2,...")]
    pub sigmas: Option<Vec<f64>>,
    /// Text tokens per prompt (padded or truncated).
    #[arg(long, help_heading = "Generation", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_sequence_length: u32,
    /// Seed of the random draws, as diffusers' `torch.Generator("cpu").manual_seed(S)`
    /// [default: random].
    #[arg(long, help_heading = "Generation")]
    pub seed: Option<u64>,
    /// Initial latents (safetensors, tensor `latents`) instead of seeded noise; for pipelines
    /// with more random draws, every draw under its name (see PARITY-CLI in the README).
    #[arg(long, help_heading = "Generation", value_name = "FILE")]
    pub latents: Option<PathBuf>,
    /// The conditioning image of image-to-video pipelines (PNG or JPEG).
    #[arg(long, help_heading = "Generation", value_name = "FILE")]
    pub image: Option<PathBuf>,
    /// The transformer's weights from one file instead of the model folder's (whose config.json
    /// still gives the architecture): diffusers keys, or the original Wan-AI layout bare or
    /// under ComfyUI's `model.diffusion_model.`, in any float dtype, or fp8 with ComfyUI's
    /// `scale_weight` or LightX2V's `weight_scale`, or GGUF. `hf:OWNER/REPO/PATH` names a file of
    /// a Hugging Face Hub repository (from the cache, or downloaded).
    #[arg(long, help_heading = "Generation", value_name = "FILE")]
    pub transformer: Option<PathBuf>,
    /// The second expert's weights (Wan2.2 A14B's transformer_2) from one file, as --transformer.
    #[arg(long, help_heading = "Generation", value_name = "FILE")]
    pub transformer_2: Option<PathBuf>,
    /// Store the transformer's Linear weights and biases in fp8 and widen them to the run dtype
    /// for each forward, as diffusers' `enable_layerwise_casting(storage_dtype=...)`
    /// (float8_e4m3fn or float8_e5m2; its skip patterns: norms, embeddings, modulation).
    #[arg(long, help_heading = "Generation", value_name = "DTYPE", value_parser = crate::weights::StorageDtype::parse)]
    pub storage_dtype: Option<crate::weights::StorageDtype>,
    /// A step cache over the transformer's blocks, as diffusers' `enable_cache`:
    /// `first-block:THRESHOLD` (FirstBlockCacheConfig), `magcache:K=V,...` (MagCacheConfig
    /// fields: threshold, max_skip_steps, retention_ratio, num_inference_steps,
    /// mag_ratios=R1;R2;..., calibrate=true), `taylorseer:K=V,...` (TaylorSeerCacheConfig) or
    /// `pab:K=V,...` (PyramidAttentionBroadcastConfig:
    /// spatial_attention_block_skip_range=N, cross_attention_timestep_skip_range=LOW;HIGH, ...).
    /// Skipped work trades exactness for speed.
    #[arg(long, help_heading = "Generation", value_name = "HOOK:SPEC", value_parser = crate::models::step_cache::CacheSpec::parse)]
    pub cache: Option<crate::models::step_cache::CacheSpec>,
    /// Run the transformer blocks' Linear layers as fp8 matmuls: weights and inputs in e4m3
    /// with one scale per output channel and per token, f32 accumulation (GPUs of compute
    /// capability 8.9 or newer, or the CPU). Faster; trades exactness for speed (every family).
    #[arg(long = "[no-]fp8-matmul", alias = "fp8-matmul", help_heading = "Generation", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub fp8_matmul: bool,
    /// How the transformer's attention computes: exact (diffusers' arithmetic) or sage (8-bit
    /// products, SageAttention2's scheme: int8 Q·Kᵀ over mean-smoothed keys, e4m3 P·V, f32
    /// sums; GPUs of compute capability 8.9 or newer, or the CPU). Text encoders and VAEs stay
    /// exact. Faster; trades exactness for speed (every family).
    #[arg(long, help_heading = "Generation", value_name = "KIND", default_value = "exact", value_parser = crate::models::sage_attention::AttentionKind::parse)]
    pub attention: crate::models::sage_attention::AttentionKind,
    /// A LoRA for the transformer, FILE[:SCALE] (scale 1 by default), in the diffusers/PEFT,
    /// ComfyUI/original or kohya/musubi key layout; repeat to stack LoRAs, applied in the order
    /// given. Merged into each weight as it loads: no step time. `hf:OWNER/REPO/PATH` names a file
    /// of a Hugging Face Hub repository (from the cache, or downloaded).
    #[arg(long, help_heading = "Generation", value_name = "FILE[:SCALE]", value_parser = crate::lora::parse_spec)]
    pub lora: Vec<LoraSpec>,
    /// A LoRA for the second expert (Wan2.2 A14B's transformer_2), as --lora.
    #[arg(long, help_heading = "Generation", value_name = "FILE[:SCALE]", value_parser = crate::lora::parse_spec)]
    pub lora_2: Vec<LoraSpec>,
    /// Guidance scale of the low-noise expert (Wan2.2 A14B) [default: --guidance-scale].
    #[arg(long, help_heading = "Generation", value_parser = parse_finite)]
    pub guidance_scale_2: Option<f64>,
    /// Real classifier-free guidance with the negative prompt, for guidance-distilled models
    /// whose --guidance-scale is embedded (HunyuanVideo) [default: off].
    #[arg(long, help_heading = "Generation", value_parser = parse_finite)]
    pub true_cfg_scale: Option<f64>,
    /// Timestep the VAE decoder is conditioned on (LTX-Video) [default: the model's].
    #[arg(long, help_heading = "Generation", value_parser = parse_finite)]
    pub decode_timestep: Option<f64>,
    /// Noise mixed into the latents before decoding (LTX-Video) [default: the model's].
    #[arg(long, help_heading = "Generation", value_parser = parse_finite)]
    pub decode_noise_scale: Option<f64>,
    /// Decode the VAE in spatial tiles (less memory).
    #[arg(long = "[no-]vae-tiling", alias = "vae-tiling", help_heading = "Generation", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub vae_tiling: bool,
    /// With --vae-tiling: tiles of PX pixels every 3/4 PX, as diffusers' `enable_tiling` with
    /// these sizes (a multiple of 64; smaller tiles hold less memory and blend more seams: the
    /// frames differ slightly) [default: 256, every 192] (Wan family).
    #[arg(long, help_heading = "Generation", value_name = "PX", value_parser = parse_tile_size)]
    pub vae_tile_size: Option<u32>,
    /// Run the transformer's blocks by chunks of tokens written over the hidden states: a
    /// fraction of the activation memory, the same frames, a little slower (Wan family).
    #[arg(long = "[no-]low-activation", alias = "low-activation", help_heading = "Generation", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub low_activation: bool,

    // ----- output -----
    /// Folder the outputs are written to.
    #[arg(
        long,
        help_heading = "Output",
        default_value = "outputs",
        value_name = "DIR"
    )]
    pub output_path: PathBuf,
    /// File name without extension [default: a slug of the prompt plus the seed].
    #[arg(long, help_heading = "Output", value_name = "NAME")]
    pub output_video_name: Option<String>,
    /// mp4 (H.264), png (one file per frame) or safetensors (f32 frames, for exact comparison).
    #[arg(long, help_heading = "Output", value_enum, default_value_t = OutputType::Mp4)]
    pub output_type: OutputType,

    // ----- batches and unattended runs -----
    /// prompt: each prompt through every stage; stage: every prompt through a stage before the
    /// next (each component loads once); auto: stage with lazy or sequential load, else prompt.
    #[arg(long, help_heading = "Batch", value_enum, default_value_t = BatchOrderChoice::Auto)]
    pub batch_order: BatchOrderChoice,
    /// Replace outputs that already exist (otherwise such a prompt fails and the others go on).
    #[arg(long = "[no-]overwrite", alias = "overwrite", help_heading = "Batch", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub overwrite: bool,
    /// Skip the prompts whose output already exists (rerun an interrupted batch).
    #[arg(long = "[no-]resume", alias = "resume", help_heading = "Batch", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub resume: bool,
    /// Print only errors on stderr (no progress).
    #[arg(long = "[no-]quiet", alias = "quiet", help_heading = "Batch", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub quiet: bool,
    /// Write per-prompt stage timings and metrics as JSON to FILE (also when the run fails).
    #[arg(long, help_heading = "Batch", value_name = "FILE")]
    pub stats_json: Option<PathBuf>,

    // ----- device -----
    /// auto, cpu, cuda, cuda:N or metal.
    #[arg(long, help_heading = "Device", default_value = "auto", value_parser = parse_device)]
    pub device: DeviceChoice,
    /// Number of GPUs (at most 1024: every rank is planned and started).
    #[arg(long, help_heading = "Device", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_GPUS), value_name = "N")]
    pub num_gpus: u32,
    /// GPUs that split each video's tokens (Ulysses sequence parallelism); the --num-gpus /
    /// --sp-size groups run different prompts [default: --num-gpus].
    #[arg(long, help_heading = "Device", value_parser = clap::value_parser!(u32).range(1..=MAX_GPUS), value_name = "N")]
    pub sp_size: Option<u32>,
    /// Compute dtype [default: bf16 on a GPU, f32 on the CPU].
    #[arg(long, help_heading = "Device", value_enum)]
    pub dtype: Option<DTypeChoice>,
    /// Memory model of the device; auto probes it (forcing it plans for another machine).
    #[arg(long, help_heading = "Device", value_enum, default_value_t = MemoryModelChoice::Auto)]
    pub memory_model: MemoryModelChoice,
    /// Let f32 convolutions use TF32 tensor-core math (cuDNN, as PyTorch's default);
    /// --no-tf32 computes them in exact f32.
    #[arg(long = "[no-]tf32", alias = "tf32", help_heading = "Device", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub tf32: bool,
}

/// The most GPUs a run takes (`--num-gpus`, `--sp-size`): the dry run plans, and a run starts,
/// every rank, so the count is capped before anything is allocated for them.
const MAX_GPUS: i64 = 1024;

/// An on/off option whose default is decided by the device.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "TristateRepr", into = "TristateRepr")]
pub enum Tristate {
    Auto,
    On,
    Off,
}

/// How a tri-state is written in a config file: `true`, `false` or `"auto"`.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum TristateRepr {
    Bool(bool),
    Word(String),
}

impl TryFrom<TristateRepr> for Tristate {
    type Error = String;
    fn try_from(repr: TristateRepr) -> Result<Self, String> {
        match repr {
            TristateRepr::Bool(b) => Ok(if b { Tristate::On } else { Tristate::Off }),
            TristateRepr::Word(w) => w.parse(),
        }
    }
}

impl From<Tristate> for TristateRepr {
    fn from(t: Tristate) -> Self {
        match t {
            Tristate::Auto => TristateRepr::Word("auto".into()),
            Tristate::On => TristateRepr::Bool(true),
            Tristate::Off => TristateRepr::Bool(false),
        }
    }
}

impl std::str::FromStr for Tristate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Tristate::Auto),
            "true" | "on" | "yes" | "1" => Ok(Tristate::On),
            "false" | "off" | "no" | "0" => Ok(Tristate::Off),
            _ => Err(format!("'{s}' is not auto, true or false")),
        }
    }
}

/// Where a component computes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDevice {
    Gpu,
    Cpu,
}

/// Parses `--vae-tile-size`: pixels, a multiple of 64 (so that three quarters of it is whole
/// latents of every Wan VAE) from 64 to 4096.
fn parse_tile_size(text: &str) -> Result<u32, String> {
    match text.trim().parse::<u32>() {
        Ok(px) if px % 64 == 0 && (64..=4096).contains(&px) => Ok(px),
        _ => Err(format!(
            "'{text}' is not a tile size: pixels, a multiple of 64 from 64 to 4096 (e.g. 128)"
        )),
    }
}

/// Parses a byte size: a number with an optional unit (B, K/KB/KiB, M/MB/MiB, G/GB/GiB,
/// T/TB/TiB; every unit is a power of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("'{text}' is not a size like 2GiB, 512M or 1073741824"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "'{text}' has an unknown unit (use B, KiB, MiB, GiB or TiB)"
            ))
        }
    };
    let bytes = value * (1u64 << shift) as f64;
    if !(1.0..=u64::MAX as f64).contains(&bytes) {
        return Err(format!("'{text}' is not a positive size"));
    }
    Ok(bytes as u64)
}

/// A size in a config file: bytes as a number, or a string such as "2GiB".
fn size_or_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Option::<Size>::deserialize(d)? {
        None => Ok(None),
        Some(Size::Bytes(b)) => Ok(Some(b)),
        Some(Size::Text(t)) => parse_size(&t).map(Some).map_err(serde::de::Error::custom),
    }
}

/// diffusers' group-offload granularity.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OffloadType {
    BlockLevel,
    LeafLevel,
}

/// The compute dtype.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DTypeChoice {
    Bf16,
    F16,
    F32,
}

/// The memory model, as asked.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryModelChoice {
    Auto,
    Discrete,
    Unified,
}
