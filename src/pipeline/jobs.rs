//! Requests: one per prompt, with its sizes, seed and output path, and the tensors that wait
//! between stages (kept small: embeddings, latents, frames).

use crate::config::video::{FrameRule, Spelling, VideoSettings};
use crate::config::{draw_seed, Prompts, ResolvedConfig};
use crate::output::OutputType;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One video to make and its state between stages.
#[derive(Debug)]
pub struct Job {
    /// Position in the batch, from 0.
    pub index: usize,
    /// Where the prompt came from: `FILE:LINE` for a prompt file, `--prompt` otherwise.
    pub origin: String,
    pub prompt: String,
    pub negative_prompt: String,
    pub seed: u64,
    /// The conditioning image: the line's `image`, else `--image`.
    pub image: Option<PathBuf>,
    pub num_frames: u32,
    pub height: u32,
    pub width: u32,
    pub num_inference_steps: u32,
    pub guidance_scale: f64,
    /// Where the output goes (a folder for PNG output).
    pub output: PathBuf,
    pub prompt_embeds: Option<Tensor>,
    /// The attention mask `[B, L]` (u32) of `prompt_embeds` where the DiT reads one.
    pub prompt_mask: Option<Tensor>,
    pub negative_embeds: Option<Tensor>,
    pub latents: Option<Tensor>,
    pub frames: Option<Tensor>,
    /// Whether the output file is complete.
    pub written: bool,
    /// Tensors the safetensors output holds beside the frames (a step cache's record).
    pub extra_outputs: Vec<(String, Tensor)>,
    /// The stage at which Ctrl-C stopped this job, if it did.
    pub stopped_at: Option<&'static str>,
    /// What the pipeline measured (forward times, memory peaks per stage): the job's `metrics`
    /// object in `--stats-json`.
    pub metrics: serde_json::Map<String, serde_json::Value>,
    /// What the family carries for this job from one stage to a later one.
    pub carry: Carry,
}

/// What a stage may change of a job, kept to run the stage again after it ran out of memory.
pub struct JobState {
    prompt_embeds: Option<Tensor>,
    prompt_mask: Option<Tensor>,
    negative_embeds: Option<Tensor>,
    latents: Option<Tensor>,
    frames: Option<Tensor>,
    written: bool,
    extra_outputs: Vec<(String, Tensor)>,
    metrics: serde_json::Map<String, serde_json::Value>,
}

impl Job {
    /// The job's state before a stage, where it can be restored: not while its family carries
    /// something between stages (a stage takes that out, so a failed stage loses it).
    pub fn state(&self) -> Option<JobState> {
        self.carry.0.is_none().then(|| JobState {
            prompt_embeds: self.prompt_embeds.clone(),
            prompt_mask: self.prompt_mask.clone(),
            negative_embeds: self.negative_embeds.clone(),
            latents: self.latents.clone(),
            frames: self.frames.clone(),
            written: self.written,
            extra_outputs: self.extra_outputs.clone(),
            metrics: self.metrics.clone(),
        })
    }

    /// Puts the job back as `state` found it.
    pub fn restore(&mut self, state: JobState) {
        self.prompt_embeds = state.prompt_embeds;
        self.prompt_mask = state.prompt_mask;
        self.negative_embeds = state.negative_embeds;
        self.latents = state.latents;
        self.frames = state.frames;
        self.written = state.written;
        self.extra_outputs = state.extra_outputs;
        self.metrics = state.metrics;
        self.carry.clear();
    }

    /// What a text stage encodes: the prompt, then with `guided` the negative prompt.
    pub fn texts(&self, guided: bool) -> Vec<&str> {
        let mut texts = vec![self.prompt.as_str()];
        if guided {
            texts.push(self.negative_prompt.as_str());
        }
        texts
    }

    /// The prompt embeddings and their attention mask from the text stage, on `device`.
    pub fn take_masked_prompt(&mut self, device: &Device) -> Result<(Tensor, Tensor)> {
        let embeds = self.prompt_embeds.take().context("prompt not encoded")?;
        let mask = self.prompt_mask.take().context("prompt not encoded")?;
        Ok((embeds.to_device(device)?, mask.to_device(device)?))
    }

    /// The prompt embeddings as one batch [negative; positive] on `device` (the prompt alone
    /// without a negative prompt), as diffusers calls a guided DiT.
    pub fn guidance_batch(&self, device: &Device) -> Result<Tensor> {
        let cond = self.prompt_embeds.as_ref().context("prompt not encoded")?;
        let text = match &self.negative_embeds {
            Some(uncond) => Tensor::cat(&[uncond, cond], 0)?,
            None => cond.clone(),
        };
        Ok(text.to_device(device)?)
    }
}

/// What a family carries for a job between its stages beside the job's own fields (a family
/// type of its own, taken by a stage and put back for the next); dropped when a stage fails.
#[derive(Default)]
pub struct Carry(Option<Box<dyn std::any::Any>>);

impl Carry {
    /// What was put here, or a fresh `T` where nothing (of type `T`) was.
    pub fn take<T: Default + 'static>(&mut self) -> T {
        match self.0.take().map(|b| b.downcast::<T>()) {
            Some(Ok(carried)) => *carried,
            _ => T::default(),
        }
    }

    /// Keeps `carried` for the job's next stage.
    pub fn put<T: 'static>(&mut self, carried: T) {
        self.0 = Some(Box::new(carried));
    }

    /// Drops what was carried.
    pub fn clear(&mut self) {
        self.0 = None;
    }
}

impl std::fmt::Debug for Carry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Carry(..)"
        } else {
            "Carry"
        })
    }
}

/// The keys of a `.jsonl` prompt-file line.
const LINE_KEYS: &[&str] = &[
    "prompt",
    "negative_prompt",
    "seed",
    "num_frames",
    "height",
    "width",
    "num_inference_steps",
    "guidance_scale",
    "output_video_name",
    "image",
];

/// Per-prompt overrides accepted on a `.jsonl` prompt-file line.
#[derive(Deserialize, Default, Debug)]
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
    /// Relative to the prompt file's folder.
    image: Option<PathBuf>,
}

/// Builds the jobs of a run from `--prompt` or `--prompt-file`; every line is checked before
/// any model loads, and two prompts may not write the same file.
///
/// Seeds: prompt *i* gets the base seed + *i* − 1 unless its line sets one. Without `--seed`
/// the base seed is drawn (said by the notice returned beside the jobs, for the caller to print
/// once the jobs pass its checks, and in `--stats-json` as `config.seed`), so
/// such a prompt's seed is free: it asked for a video of its prompt with any seed. `--resume`
/// therefore counts it finished when its derived name exists with any seed
/// (`<slug>_<iii>_seed<N>`), and reports that file and its seed. Refusing `--resume` without
/// `--seed` was the other choice; it was not taken because whoever reruns an interrupted
/// overnight batch expects the same command line to finish it, and a first run started without
/// `--seed` could then never be resumed. A fixed seed (`--seed`, a line's `seed`) or an
/// explicit name still needs that exact file.
pub fn jobs(config: &ResolvedConfig) -> Result<(Vec<Job>, Option<String>)> {
    let (v, out, b) = (config.video(), config.output(), config.batch());
    let lines = match &config.generation().prompts {
        Some(Prompts::Text(p)) => vec![(
            "--prompt".to_string(),
            PromptLine {
                prompt: p.clone(),
                ..Default::default()
            },
        )],
        Some(Prompts::File(file)) => read_prompt_file(file, config.frame_rule())?,
        None => bail!("no prompt given; pass --prompt \"...\" or --prompt-file FILE"),
    };
    let base_seed = v.seed.unwrap_or_else(draw_seed);
    let seed_free = v.seed_drawn || v.seed.is_none();
    let batch = lines.len() > 1;
    let ext = out.kind.extension();
    // PNG output is a folder of frames, named without an extension (an image model's one frame
    // is one file).
    let folder = out.kind == OutputType::Png && !out.image;
    let file_name = |name: &str| match folder {
        true => name.to_string(),
        false => format!("{name}.{ext}"),
    };
    let mut jobs: Vec<Job> = Vec::with_capacity(lines.len());
    // Each output's job, so that a name written twice is found in one look-up (the list is
    // built in linear time: a prompt file may hold 100,000 lines).
    let mut writers: HashMap<PathBuf, usize> = HashMap::with_capacity(lines.len());
    // `--resume`'s finished outputs by stem, read from the folder once.
    let finished = (b.resume && seed_free).then(|| finished_by_stem(&out.folder, ext, folder));
    // Whether some prompt to be made takes its seed from the drawn base seed.
    let mut base_seed_used = false;
    for (i, (origin, line)) in lines.into_iter().enumerate() {
        let mut seed = line.seed.unwrap_or(base_seed.wrapping_add(i as u64));
        let explicit_name = line
            .output_video_name
            .clone()
            .or_else(|| out.name.clone().filter(|_| !batch));
        let stem = match &explicit_name {
            Some(_) => String::new(),
            None if batch => format!("{}_{:03}_seed", slug(&line.prompt), i + 1),
            None => format!("{}_seed", slug(&line.prompt)),
        };
        let mut output = out.folder.join(match &explicit_name {
            Some(name) => file_name(name),
            None => file_name(&format!("{stem}{seed}")),
        });
        if line.seed.is_none() && explicit_name.is_none() {
            if let Some((found, found_seed)) = finished.as_ref().and_then(|f| f.get(&stem)) {
                (output, seed) = (found.clone(), *found_seed);
            }
        }
        base_seed_used |= line.seed.is_none() && seed == base_seed.wrapping_add(i as u64);
        if let Some(&other) = writers.get(&output) {
            bail!(
                "{origin}: writes {} like {}; give one of them another output_video_name",
                output.display(),
                jobs[other].origin
            );
        }
        writers.insert(output.clone(), jobs.len());
        // A line's size merged with the flags' may be more than any machine holds.
        let (num_frames, height, width) = (
            line.num_frames.unwrap_or(v.num_frames),
            line.height.unwrap_or(v.height),
            line.width.unwrap_or(v.width),
        );
        crate::config::video::check_frame_bytes(height, width, num_frames)
            .map_err(|why| anyhow!("{origin}: {why}"))?;
        jobs.push(Job {
            index: i,
            origin,
            negative_prompt: line
                .negative_prompt
                .unwrap_or_else(|| v.negative_prompt.clone()),
            seed,
            image: line.image.or_else(|| config.generation().image.clone()),
            num_frames,
            height,
            width,
            num_inference_steps: line.num_inference_steps.unwrap_or(v.num_inference_steps),
            guidance_scale: line.guidance_scale.unwrap_or(v.guidance_scale),
            output,
            prompt: line.prompt,
            prompt_embeds: None,
            prompt_mask: None,
            negative_embeds: None,
            latents: None,
            frames: None,
            written: false,
            extra_outputs: Vec::new(),
            stopped_at: None,
            metrics: serde_json::Map::new(),
            carry: Carry::default(),
        });
    }
    let seed_notice = (seed_free && base_seed_used).then(|| {
        format!("seed: none given, drew base seed {base_seed} (prompt i gets {base_seed} + i - 1); pass --seed {base_seed} to make the same videos again")
    });
    Ok((jobs, seed_notice))
}

/// The finished outputs in `dir` named `<stem><seed>.ext` (a PNG `folder`: `<stem><seed>`), by
/// stem, each with its seed: what `--resume` finds for a prompt whose seed is free. Where
/// several runs finished one stem, the first path in order is taken (deterministic).
/// Temporaries (`.NAME.partial`) do not match.
fn finished_by_stem(dir: &Path, ext: &str, folder: bool) -> HashMap<String, (PathBuf, u64)> {
    let suffix = if folder {
        String::new()
    } else {
        format!(".{ext}")
    };
    let mut found: HashMap<String, (PathBuf, u64)> = HashMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let Some(base) = name.strip_suffix(suffix.as_str()) else {
            continue;
        };
        // A stem ends in `_seed`: the digits after it are the whole trailing run.
        let stem = base.trim_end_matches(|c: char| c.is_ascii_digit());
        let Ok(seed) = base[stem.len()..].parse::<u64>() else {
            continue;
        };
        let path = entry.path();
        match found.get(stem) {
            Some((kept, _)) if *kept <= path => {}
            _ => {
                found.insert(stem.to_string(), (path, seed));
            }
        }
    }
    found
}

/// Whether something (a file, folder or dangling link) is already at `path`.
pub fn output_exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// The most bytes `--prompt-file` may hold: some hundred thousand long prompts.
const MAX_PROMPT_FILE_BYTES: u64 = 64 << 20;

/// The prompts of a file with their `FILE:LINE` origins.
fn read_prompt_file(path: &Path, rule: FrameRule) -> Result<Vec<(String, PromptLine)>> {
    let bytes = crate::config::files::read_capped("--prompt-file", path, MAX_PROMPT_FILE_BYTES)?;
    parse_prompt_file(path, bytes, rule)
}

/// The prompts of the bytes of prompt file `path` (a `.jsonl` file by its extension).
fn parse_prompt_file(
    path: &Path,
    bytes: Vec<u8>,
    rule: FrameRule,
) -> Result<Vec<(String, PromptLine)>> {
    let text = String::from_utf8(bytes).map_err(|e| {
        let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let line = valid.iter().filter(|b| **b == b'\n').count() + 1;
        let column = valid.len() - valid.iter().rposition(|b| *b == b'\n').map_or(0, |p| p + 1) + 1;
        anyhow!(
            "{}:{line}: not valid UTF-8 (byte {column} of the line); save the file as UTF-8",
            path.display()
        )
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    let mut lines = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = format!("{}:{}", path.display(), n + 1);
        let parsed = if jsonl {
            parse_line(line).with_context(|| at.clone())?
        } else {
            PromptLine {
                prompt: line.to_string(),
                ..Default::default()
            }
        };
        let mut parsed = parsed;
        if let Some(image) = parsed.image.take() {
            let image = path.parent().unwrap_or(Path::new("")).join(image);
            if let Err(why) = crate::config::files::check_image(&image) {
                bail!(
                    "{at}: image {}: {why}; give a PNG or JPEG file (a relative path is read from the prompt file's folder)",
                    image.display()
                );
            }
            parsed.image = Some(image);
        }
        check_line(&parsed, rule).with_context(|| at.clone())?;
        lines.push((at, parsed));
    }
    if lines.is_empty() {
        bail!(
            "--prompt-file {} has no prompts (blank lines and # comments are skipped); put one prompt per line",
            path.display()
        );
    }
    Ok(lines)
}

/// One `.jsonl` line: a JSON object with `prompt` and optional overrides; an error names the
/// bad key.
fn parse_line(line: &str) -> Result<PromptLine> {
    let value: serde_json::Value = serde_json::from_str(line).map_err(|e| {
        let message = e.to_string();
        let message = message
            .rfind(" at line ")
            .map_or(message.as_str(), |i| &message[..i]);
        anyhow!(
            "not valid JSON ({message} at column {}); each line must be one JSON object",
            e.column()
        )
    })?;
    let serde_json::Value::Object(map) = value else {
        bail!("expected a JSON object such as {{\"prompt\": \"a red fox\", \"seed\": 1}}");
    };
    let keys = LINE_KEYS.join(", ");
    if !map.contains_key("prompt") {
        bail!("no `prompt` key; each line needs one (keys: {keys})");
    }
    for (key, value) in &map {
        if !LINE_KEYS.contains(&key.as_str()) {
            bail!("unknown key `{}`; keys are {keys}", key.escape_debug());
        }
        // Each key alone against a valid prompt, so a bad value is reported with its key.
        let single = serde_json::json!({ "prompt": "", key.as_str(): value });
        if let Err(e) = serde_json::from_value::<PromptLine>(single) {
            bail!("bad value for `{key}`: {e}");
        }
    }
    Ok(serde_json::from_value(serde_json::Value::Object(map))?)
}

fn check_line(line: &PromptLine, rule: FrameRule) -> Result<()> {
    if line.prompt.trim().is_empty() {
        bail!("the prompt is empty");
    }
    VideoSettings {
        height: line.height,
        width: line.width,
        num_frames: line.num_frames,
        num_inference_steps: line.num_inference_steps,
        guidance_scale: line.guidance_scale,
        output_video_name: line.output_video_name.as_deref(),
        rule,
    }
    .check(Spelling::LineKey)
    .map_err(|e| anyhow!(e))
}

/// A prompt as logs show it: quoted, and cut after 80 characters with its full length noted
/// (a prompt file may hold a megabyte on one line; `--stats-json` keeps it whole).
pub fn excerpt(prompt: &str) -> String {
    const MAX: usize = 80;
    match prompt.char_indices().nth(MAX) {
        None => format!("{prompt:?}"),
        Some((end, _)) => format!("{:?}... ({} bytes)", &prompt[..end], prompt.len()),
    }
}

/// A file-name-safe summary of a prompt: lowercase alphanumeric words joined by '-', at most 48
/// bytes, never empty (so no path separators, dots or control characters).
pub fn slug(prompt: &str) -> String {
    const MAX: usize = 48;
    let mut out = String::new();
    for word in prompt.split(|c: char| !c.is_alphanumeric()) {
        // Lowercasing can yield combining marks (e.g. from 'İ'): keep only alphanumerics.
        let word: String = word
            .chars()
            .flat_map(char::to_lowercase)
            .filter(|c| c.is_alphanumeric())
            .collect();
        if word.is_empty() {
            continue;
        }
        if out.is_empty() {
            // A first word longer than the bound is cut at a character boundary.
            let mut end = 0;
            for c in word.chars().take_while(|c| {
                end += c.len_utf8();
                end <= MAX
            }) {
                out.push(c);
            }
        } else if out.len() + 1 + word.len() <= MAX {
            out.push('-');
            out.push_str(&word);
        } else {
            break;
        }
    }
    if out.is_empty() {
        "video".into()
    } else {
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(argv: &[&str]) -> ResolvedConfig {
        let argv = [
            "vidgen",
            "generate",
            "--model",
            "synthetic:wan2.1-tiny",
            "--device",
            "cpu",
        ]
        .iter()
        .chain(argv)
        .map(|a| a.into());
        let crate::cli::Parsed::Generate(args) = crate::cli::parse(argv).unwrap() else {
            panic!("not a generate command")
        };
        ResolvedConfig::resolve(*args).unwrap()
    }

    /// 100,000 prompts make 100,000 jobs (the list is built in linear time: quadratic, this
    /// took minutes), and a name written twice is still found, naming both lines.
    #[test]
    fn a_hundred_thousand_prompts_make_their_jobs_and_duplicates_are_found() {
        let dir = std::env::temp_dir().join(format!("vidgen-jobs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("p.jsonl");
        let n = 100_000;
        let mut text: String = (0..n)
            .map(|i| format!("{{\"prompt\": \"prompt number {i}\"}}\n"))
            .collect();
        std::fs::write(&file, &text).unwrap();
        let path = file.to_str().unwrap();
        let out = dir.join("out");
        let argv = [
            "--prompt-file",
            path,
            "--seed",
            "1",
            "--resume",
            "--output-path",
        ];
        let (made, _) = jobs(&config(&[&argv[..], &[out.to_str().unwrap()]].concat())).unwrap();
        assert_eq!(made.len(), n);
        assert_eq!(made[n - 1].seed, n as u64);
        text += "{\"prompt\": \"again\", \"output_video_name\": \"same\"}\n";
        text += "{\"prompt\": \"and again\", \"output_video_name\": \"same\"}\n";
        std::fs::write(&file, &text).unwrap();
        let e = jobs(&config(&[&argv[..], &[out.to_str().unwrap()]].concat())).unwrap_err();
        let e = format!("{e:#}");
        assert!(e.contains(&format!("p.jsonl:{}: writes", n + 2)), "{e}");
        assert!(e.contains(&format!("like {path}:{}", n + 1)), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Mutated prompt files and `.jsonl` lines never panic the parser; what it accepts is a
    /// list of non-blank prompts, each with its `FILE:LINE`.
    #[test]
    fn fuzzed_prompt_files_are_refused_or_read_never_panic() {
        let seeds: &[&[u8]] = &[
            b"a fox\n# comment\n\n  a boat  \r\n",
            b"{\"prompt\": \"a\", \"seed\": 3, \"num_frames\": 9, \"height\": 64}\n{\"prompt\": \"b\", \"guidance_scale\": 1.5, \"output_video_name\": \"v\"}\n",
            b"{\"prompt\": \"x\", \"negative_prompt\": \"y\", \"width\": 32, \"num_inference_steps\": 2}\n",
        ];
        for name in ["p.txt", "p.jsonl"] {
            crate::fuzz::mutate(seeds, 3000, |bytes| {
                let path = Path::new(name);
                match parse_prompt_file(path, bytes.to_vec(), FrameRule::default()) {
                    Ok(lines) => {
                        assert!(!lines.is_empty());
                        for (at, line) in lines {
                            assert!(at.starts_with(name), "{at}");
                            assert!(!line.prompt.trim().is_empty(), "{at}");
                        }
                    }
                    Err(e) => assert!(!format!("{e:#}").contains('\n'), "not one line: {e:#}"),
                }
            });
        }
    }

    /// Inputs the fuzzer tried that are worth keeping: each is refused with the line named.
    #[test]
    fn fuzz_regressions_in_prompt_files() {
        let cases: &[(&str, &[u8], &str)] = &[
            ("p.jsonl", b"{\"prompt\": \"a\\ud800\"}\n", "p.jsonl:1"),
            (
                "p.jsonl",
                b"{\"prompt\": \"a\", \"seed\": 18446744073709551616}\n",
                "`seed`",
            ),
            (
                "p.jsonl",
                b"{\"prompt\": \"a\", \"guidance_scale\": 1e309}\n",
                "p.jsonl:1",
            ),
            ("p.jsonl", b"[\"prompt\"]\n", "JSON object"),
            ("p.txt", b"\xef\xbb\xbf\n\xff\n", "p.txt:2: not valid UTF-8"),
            // Found by the fuzzer: a key holding a line break broke the one-line error.
            (
                "p.jsonl",
                b"{\"prompt\": \"x\", \"\\negative_prompt\": \"y\"}\n",
                "unknown key `\\negative_prompt`",
            ),
            ("p.txt", b"\xef\xbb\xbf#\n \r\n", "has no prompts"),
        ];
        for (name, bytes, needle) in cases {
            let e = parse_prompt_file(Path::new(name), bytes.to_vec(), FrameRule::default())
                .unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{e:#}");
            assert!(!format!("{e:#}").contains('\n'), "not one line: {e:#}");
        }
    }

    /// `--resume` without `--seed` finds a prompt's output made with any seed, the first by
    /// name where several runs made it; temporaries and other stems do not match.
    #[test]
    fn resume_finds_a_free_seed_output_by_its_stem() {
        let dir = std::env::temp_dir().join(format!("vidgen-resume-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in [
            "a-fox_001_seed9.mp4",
            "a-fox_001_seed12.mp4",
            ".a-fox_002_seed5.mp4.1-0.partial",
            "a-fox_0010_seed3.mp4",
        ] {
            std::fs::write(dir.join(name), "").unwrap();
        }
        let found = finished_by_stem(&dir, "mp4", false);
        assert_eq!(
            found["a-fox_001_seed"],
            (dir.join("a-fox_001_seed12.mp4"), 12)
        );
        assert!(!found.contains_key("a-fox_002_seed"));
        assert_eq!(found["a-fox_0010_seed"].1, 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Frames and latents of one prompt are different outputs to `--resume`.
    #[test]
    fn resume_tells_latents_from_frames() {
        let dir = std::env::temp_dir().join(format!("vidgen-resume-kinds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a-fox_001_seed9.safetensors"), "").unwrap();
        let latents = OutputType::Latent.extension();
        assert!(finished_by_stem(&dir, latents, false).is_empty());
        std::fs::write(dir.join("a-fox_001_seed4.latents.safetensors"), "").unwrap();
        assert_eq!(
            finished_by_stem(&dir, latents, false)["a-fox_001_seed"].1,
            4
        );
        let frames = finished_by_stem(&dir, OutputType::Safetensors.extension(), false);
        assert_eq!(frames["a-fox_001_seed"].1, 9);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
