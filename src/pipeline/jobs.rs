//! Requests: one per prompt, with its sizes, seed and output path, and the tensors that wait
//! between stages (kept small: embeddings, latents, frames).

use crate::cli::ResolvedConfig;
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// One video to make and its state between stages.
#[derive(Debug)]
pub struct Job {
    pub prompt: String,
    pub negative_prompt: String,
    pub seed: u64,
    pub num_frames: u32,
    pub height: u32,
    pub width: u32,
    pub num_inference_steps: u32,
    pub guidance_scale: f64,
    /// Where the output goes (a folder for PNG output).
    pub output: PathBuf,
    pub prompt_embeds: Option<Tensor>,
    pub negative_embeds: Option<Tensor>,
    pub latents: Option<Tensor>,
    pub frames: Option<Tensor>,
    /// Whether the output file is complete.
    pub written: bool,
    /// What the pipeline measured (forward times, memory peaks per stage), for --stats-json.
    pub metrics: serde_json::Map<String, serde_json::Value>,
}

/// Per-prompt overrides accepted on a `.jsonl` prompt-file line.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct PromptLine {
    prompt: String,
    negative_prompt: Option<String>,
    seed: Option<u64>,
    num_frames: Option<u32>,
    height: Option<u32>,
    width: Option<u32>,
    num_inference_steps: Option<u32>,
    guidance_scale: Option<f64>,
    output_video_name: Option<String>,
}

/// Builds the jobs of a run from `--prompt` or `--prompt-file`; every line is checked before
/// any model loads.
pub fn jobs(config: &ResolvedConfig) -> Result<Vec<Job>> {
    let o = &config.options;
    let lines = match (&o.prompt, &o.prompt_file) {
        (Some(p), _) => vec![PromptLine {
            prompt: p.clone(),
            ..Default::default()
        }],
        (None, Some(file)) => read_prompt_file(file)?,
        (None, None) => bail!("no prompt given; pass --prompt \"...\" or --prompt-file FILE"),
    };
    let base_seed = o.seed.unwrap_or_else(random_seed);
    let batch = lines.len() > 1;
    let mut jobs = Vec::with_capacity(lines.len());
    for (i, line) in lines.into_iter().enumerate() {
        let seed = line.seed.unwrap_or(base_seed.wrapping_add(i as u64));
        let name = match line
            .output_video_name
            .or_else(|| o.output_video_name.clone().filter(|_| !batch))
        {
            Some(n) => n,
            None if batch => format!("{}_{:03}_seed{seed}", slug(&line.prompt), i + 1),
            None => format!("{}_seed{seed}", slug(&line.prompt)),
        };
        let ext = o.output_type.extension();
        let file = if ext == "png" {
            name
        } else {
            format!("{name}.{ext}")
        };
        jobs.push(Job {
            negative_prompt: line
                .negative_prompt
                .unwrap_or_else(|| o.negative_prompt.clone()),
            seed,
            num_frames: line.num_frames.unwrap_or(o.num_frames),
            height: line.height.unwrap_or(o.height),
            width: line.width.unwrap_or(o.width),
            num_inference_steps: line.num_inference_steps.unwrap_or(o.num_inference_steps),
            guidance_scale: line.guidance_scale.unwrap_or(o.guidance_scale),
            output: o.output_path.join(file),
            prompt: line.prompt,
            prompt_embeds: None,
            negative_embeds: None,
            latents: None,
            frames: None,
            written: false,
            metrics: serde_json::Map::new(),
        });
    }
    Ok(jobs)
}

fn read_prompt_file(path: &Path) -> Result<Vec<PromptLine>> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read --prompt-file {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "--prompt-file {} is not valid UTF-8 (byte {}); save it as UTF-8",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    let mut lines = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = || format!("{}:{}", path.display(), n + 1);
        if jsonl {
            let parsed: PromptLine =
                serde_json::from_str(line).with_context(|| format!("{}: bad JSON line", at()))?;
            check_line(&parsed).with_context(|| format!("{}: bad value", at()))?;
            lines.push(parsed);
        } else {
            lines.push(PromptLine {
                prompt: line.to_string(),
                ..Default::default()
            });
        }
    }
    if lines.is_empty() {
        bail!(
            "--prompt-file {} has no prompts (blank lines and # comments are skipped)",
            path.display()
        );
    }
    Ok(lines)
}

fn check_line(line: &PromptLine) -> Result<()> {
    for (name, v) in [("height", line.height), ("width", line.width)] {
        if let Some(v) = v.filter(|v| *v == 0 || v % 16 != 0) {
            bail!("{name} {v} is not a positive multiple of 16");
        }
    }
    if let Some(f) = line.num_frames.filter(|f| *f == 0 || (f - 1) % 4 != 0) {
        bail!("num_frames {f} is not of the form 4k+1");
    }
    if line.num_inference_steps == Some(0) {
        bail!("num_inference_steps must be at least 1");
    }
    if let Some(name) = &line.output_video_name {
        if name.is_empty() || name.contains(['/', '\\']) {
            bail!("output_video_name {name:?} must be a plain file name");
        }
    }
    Ok(())
}

/// A file-name-safe summary of a prompt: lowercase words joined by '-', at most 48 bytes.
pub fn slug(prompt: &str) -> String {
    let mut out = String::new();
    for word in prompt
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        let word: String = word.chars().flat_map(char::to_lowercase).collect();
        if out.len() + word.len() + 1 > 48 {
            break;
        }
        if !out.is_empty() {
            out.push('-');
        }
        out.push_str(&word);
    }
    if out.is_empty() {
        "video".into()
    } else {
        out
    }
}

fn random_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    crate::models::loader::fnv1a(&format!("{nanos}-{}", std::process::id())) % 1_000_000_000
}
