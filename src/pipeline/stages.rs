//! What every family's pipeline does alike around its own math: building a component as the
//! placement says, timing forwards, reporting what the offload engine moved, explaining an
//! out-of-memory error, writing the video.

use super::frame::Frame;
use super::jobs::Job;
use super::placement::Held;
use super::plan::Planner;
use super::progress::{describe_peaks, Progress};
use super::registry::Family;
use super::spec::Slot;
use crate::config::ResolvedConfig;
use crate::memory::accounting::MemoryMeter;
use crate::memory::plan::gib;
use crate::models::hunyuan_video::scheduler::uses_true_cfg;
use crate::models::t5::encoder::{attention_mask, encode_masked, encode_unmasked, T5EncoderModel};
use crate::models::t5::tokenizer::PromptTokenizer;
use crate::offload::Usage;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};

/// Runs `f` and records its wall time, waiting for the device so the time is the work's.
pub(crate) fn timed<T>(
    device: &Device,
    seconds: &mut Vec<f64>,
    f: impl FnOnce() -> candle_core::Result<T>,
) -> Result<T> {
    let start = std::time::Instant::now();
    let out = f()?;
    device.synchronize()?;
    seconds.push(start.elapsed().as_secs_f64());
    Ok(out)
}

/// Ends denoising step `done` of `total`: fails the prompt if the latents hold a NaN or an
/// infinity (an overflowing guidance scale, broken weights or `--latents`), which would
/// otherwise decode to a blank video reported as written; then shows the step. Every family's
/// loop ends its steps here, so the check is one.
pub(crate) fn step_done(
    progress: &Progress,
    latents: &Tensor,
    done: usize,
    total: usize,
) -> Result<()> {
    check_finite(latents, done, total)?;
    progress.step(done, total);
    Ok(())
}

/// Fails when `latents` hold a NaN or an infinity after denoising step `done` of `total`.
pub(crate) fn check_finite(latents: &Tensor, done: usize, total: usize) -> Result<()> {
    if !all_finite(latents)? {
        anyhow::bail!(
            "the latents became NaN or infinite at denoising step {done} of {total}; lower --guidance-scale, try --dtype f32, or check the weights and --latents"
        );
    }
    Ok(())
}

/// Fails when `values` (`what` a stage made: embeddings, a decoded video, a waveform) hold a
/// NaN or an infinity, so that nothing made of them is reported as written.
pub(crate) fn ensure_finite(values: &Tensor, what: &str) -> Result<()> {
    if !all_finite(values)? {
        anyhow::bail!(non_finite(what));
    }
    Ok(())
}

/// The error line of `what` holding a NaN or an infinity.
pub(crate) fn non_finite(what: &str) -> String {
    format!(
        "{what} became NaN or infinite; try --dtype f32, or check the weights, the draws in --latents and --decode-timestep / --decode-noise-scale"
    )
}

/// Whether every value of `t` is finite.
pub(crate) fn all_finite(t: &Tensor) -> candle_core::Result<bool> {
    // `x - x` is exactly 0 for a finite x and NaN otherwise; the sum cannot overflow.
    let probe = t
        .sub(t)?
        .sum_all()?
        .to_dtype(DType::F32)?
        .to_scalar::<f32>()?;
    Ok(probe == 0.0)
}

/// Reports what the offload engine moved for a part between `before` and `after` (usage taken
/// around a stage): a note, and the job's metric `key`, summed over the stages that use the
/// part.
pub(crate) fn report_offload(
    progress: &Progress,
    job: &mut Job,
    key: &str,
    before: Option<Usage>,
    after: Option<Usage>,
) {
    let (Some(before), Some(after)) = (before, after) else {
        return;
    };
    let (mut copies, pinned) = (after.copies.since(&before.copies), after.pinned_bytes);
    progress.note(&format!(
        "  {key}: {:.2} GB copied in {:.2}s of copy-stream time ({:.1} GB/s), {:.2} GiB pinned",
        copies.bytes as f64 / 1e9,
        copies.busy_seconds,
        copies.gb_per_second(),
        pinned as f64 / (1u64 << 30) as f64
    ));
    if let Some(earlier) = job.metrics.get(key) {
        let get = |k: &str| earlier[k].as_f64().unwrap_or(0.0);
        copies.bytes += get("bytes_copied") as u64;
        copies.groups += get("groups_copied") as u64;
        copies.busy_seconds += get("copy_busy_seconds");
    }
    job.metrics.insert(
        key.into(),
        serde_json::json!({
            "bytes_copied": copies.bytes,
            "groups_copied": copies.groups,
            "copy_busy_seconds": copies.busy_seconds,
            "copy_gb_per_second": copies.gb_per_second(),
            "pinned_bytes": pinned,
            "host_bytes": after.host_bytes,
            "device_bytes": after.device_bytes,
            "kept_groups": after.kept_groups,
            "kept_bytes": after.kept_bytes,
        }),
    );
}

/// Reports the denoise stage's forward times (the job's `forward_seconds` metric).
pub(crate) fn report_forwards(progress: &Progress, job: &mut Job, forward_seconds: Vec<f64>) {
    progress.note(&format!(
        "  transformer forwards: {}",
        forward_seconds
            .iter()
            .map(|s| format!("{s:.3}s"))
            .collect::<Vec<_>>()
            .join(" ")
    ));
    job.metrics
        .insert("forward_seconds".into(), serde_json::json!(forward_seconds));
}

/// Whether `e` is the device running out of memory (CUDA's `CUDA_ERROR_OUT_OF_MEMORY`, or an
/// "out of memory" in its text).
pub(crate) fn is_out_of_memory(e: &anyhow::Error) -> bool {
    let text = format!("{e:#}");
    text.contains("OUT_OF_MEMORY") || text.to_ascii_lowercase().contains("out of memory")
}

/// Turns a device out-of-memory error into one that names the stage, the memory in use, the
/// peak and the device's size, and the option set the memory plan predicts to fit; other
/// errors pass through.
pub(crate) fn explain_out_of_memory(
    family: &dyn Family,
    config: &ResolvedConfig,
    meter: &MemoryMeter,
    when: &str,
    e: anyhow::Error,
) -> anyhow::Error {
    if !is_out_of_memory(&e) {
        return e;
    }
    let peaks = meter.peaks();
    let total = config.device().total_memory;
    let in_use = match (peaks.device_in_use_now, total) {
        (0, _) => String::new(),
        (used, Some(total)) => format!(
            "; {:.2} of {:.2} GiB in use on the device",
            gib(used),
            gib(total)
        ),
        (used, None) => format!("; {:.2} GiB in use on the device", gib(used)),
    };
    let advice = Planner::new(family, config).advice();
    e.context(format!(
        "out of device memory {when} ({}{in_use}); {advice}",
        describe_peaks(&peaks)
    ))
}

/// Each of `texts` tokenized to `--max-sequence-length` and through T5 (its blocks resident or
/// streamed, the texts through them together): the `last_hidden_state` `[1, L, D]` in the run
/// dtype in host memory, and its token count. `masked`: the encoder masks the pad keys (else
/// every token, `<pad>` included, attends to every token, as the T5 v1.1 pipelines call it).
pub(crate) fn t5_embeds(
    frame: &Frame,
    encoder: &Held<'_, T5EncoderModel>,
    tokenizer: &PromptTokenizer,
    texts: &[impl AsRef<str>],
    masked: bool,
) -> Result<Vec<(Tensor, usize)>> {
    let max_len = frame.config.generation().max_sequence_length;
    let tokens = texts
        .iter()
        .map(|text| tokenizer.encode(text.as_ref(), max_len))
        .collect::<Result<Vec<_>>>()?;
    let ids: Vec<&[u32]> = tokens.iter().map(|(ids, _)| ids.as_slice()).collect();
    let embeds = if masked {
        let lens: Vec<usize> = tokens.iter().map(|(_, len)| *len).collect();
        encode_masked(encoder, &ids, &lens)?
    } else {
        encode_unmasked(encoder, &ids)?
    };
    embeds
        .into_iter()
        .zip(&tokens)
        .map(|(t, (_, len))| Ok((t.to_dtype(frame.dtype())?.to_device(&Device::Cpu)?, *len)))
        .collect()
}

/// A text stage: the job's prompt and, with guidance, its negative prompt (each made ready by
/// `prepare`) through the T5 encoder in `slot` ([`t5_embeds`]) as one batch [negative;
/// positive], waiting for denoising in host memory: the job's prompt embeddings `[B, L, D]`
/// and prompt mask `[B, L]` (u32).
pub(crate) fn encode_prompt_batch(
    frame: &Frame,
    job: &mut Job,
    slot: Slot<T5EncoderModel>,
    tokenizer: &PromptTokenizer,
    prepare: impl Fn(&str) -> String,
    masked: bool,
) -> Result<()> {
    let max_len = frame.config.generation().max_sequence_length;
    let texts: Vec<String> = job
        .texts(job.guidance_scale > 1.0)
        .into_iter()
        .map(prepare)
        .collect();
    let encoder = frame.hold(slot)?;
    let mut embeds = t5_embeds(frame, &encoder, tokenizer, &texts, masked)?;
    drop(encoder);
    // [negative; positive]: the reverse of the encoding order.
    embeds.reverse();
    let lens: Vec<usize> = embeds.iter().map(|(_, len)| *len).collect();
    let embeds: Vec<Tensor> = embeds.into_iter().map(|(t, _)| t).collect();
    job.prompt_embeds = Some(Tensor::cat(&embeds, 0)?);
    job.prompt_mask = Some(attention_mask(&lens, max_len, &Device::Cpu)?);
    Ok(())
}

/// The scale of real classifier-free guidance (HunyuanVideo's, FLUX's) where `job` runs the
/// negative prompt's forward (diffusers: `true_cfg_scale > 1` and a negative prompt given).
pub(crate) fn true_cfg(frame: &Frame, job: &Job) -> Option<f64> {
    let scale = frame.config.generation().true_cfg_scale.unwrap_or(1.0);
    let has_negative = !job.negative_prompt.is_empty() || frame.config.given("negative_prompt");
    uses_true_cfg(scale, has_negative).then_some(scale)
}

/// What the text stage of a family with real CFG encodes: the prompt, then the negative prompt
/// where [`true_cfg`] runs; a `--true-cfg-scale` without a negative prompt is noted.
pub(crate) fn true_cfg_texts<'a>(frame: &Frame, job: &'a Job) -> Vec<&'a str> {
    let negative = true_cfg(frame, job).is_some();
    if !negative && frame.config.generation().true_cfg_scale.unwrap_or(1.0) > 1.0 {
        frame.progress.note(
            "  note: --true-cfg-scale needs a --negative-prompt (as in diffusers); running without real CFG",
        );
    }
    job.texts(negative)
}

/// The conditionings a family with real CFG made of [`true_cfg_texts`]: the prompt's, and the
/// negative prompt's where it runs, each checked finite: its embeddings and pooled embedding
/// (`[embeds, pooled]` of a conditioning).
pub(crate) fn prompt_and_negative<T>(
    conds: impl IntoIterator<Item = T>,
    embeds_and_pooled: impl Fn(&T) -> [&Tensor; 2],
) -> Result<(T, Option<T>)> {
    let mut conds = conds.into_iter();
    let cond = conds.next().context("no prompt embeddings")?;
    let negative = conds.next();
    for c in std::iter::once(&cond).chain(&negative) {
        let [embeds, pooled] = embeds_and_pooled(c);
        ensure_finite(embeds, "the prompt embeddings")?;
        ensure_finite(pooled, "the pooled prompt embeddings")?;
    }
    Ok((cond, negative))
}

/// Video `[1, 3, T, H, W]` in [-1, 1] as frames `[T, H, W, 3]` in [0, 1] on the CPU, in f32
/// (`output_type="np"`: `(video / 2 + 0.5).clamp(0, 1)`), contiguous so the writers read them in
/// place. One op per statement, each result replacing the last (the decoded video is spent):
/// the device holds two copies of the video at most, where a method chain keeps every
/// temporary to its end; host memory gets one.
pub(crate) fn video_frames(video: Tensor) -> Result<Tensor> {
    // Before the clamp, which would turn an infinity into a blank frame.
    ensure_finite(&video, "the decoded video")?;
    let mut frames = (&video * 0.5)?;
    drop(video);
    frames = (frames + 0.5)?;
    frames = frames.clamp(0f32, 1f32)?;
    frames = frames
        .squeeze(0)?
        .permute((1, 2, 3, 0))?
        .to_dtype(DType::F32)?
        .contiguous()?;
    crate::offload::transfer::to_host(&frames)
}

/// Writes the job's decoded frames (with the sound of a model that makes it) and the run's
/// metadata; its latents with `--output-type latent`.
pub(crate) fn write_output(
    config: &ResolvedConfig,
    job: &mut Job,
    audio: Option<&crate::output::Audio>,
) -> Result<()> {
    let metadata = vec![
        ("title".to_string(), job.prompt.clone()),
        (
            "comment".to_string(),
            format!("vidgen: {} seed {}", config.generation().model, job.seed),
        ),
        ("vidgen_prompt".to_string(), job.prompt.clone()),
        (
            "vidgen_negative_prompt".to_string(),
            job.negative_prompt.clone(),
        ),
        ("vidgen_seed".to_string(), job.seed.to_string()),
        (
            "vidgen_model".to_string(),
            config.generation().model.clone(),
        ),
        (
            "vidgen_config".to_string(),
            config.output().config_json.clone(),
        ),
    ];
    if config.output().kind == crate::output::OutputType::Latent {
        let latents = job.latents.take().context("nothing denoised")?;
        crate::output::write_latents(&job.output, &latents, &metadata, config.batch().overwrite)?;
        job.written = true;
        return Ok(());
    }
    let frames = job.frames.take().context("nothing decoded")?;
    let (out, overwrite) = (config.output(), config.batch().overwrite);
    if out.image && out.kind == crate::output::OutputType::Png {
        crate::output::write_png_image(&job.output, &frames, overwrite)?;
    } else {
        let beside = crate::output::Beside {
            audio,
            tensors: &job.extra_outputs,
        };
        crate::output::write_with_beside(
            out.kind,
            &job.output,
            &frames,
            beside,
            out.fps,
            &metadata,
            overwrite,
        )?;
    }
    job.written = true;
    Ok(())
}

/// Records a denoising stage's step cache in `job`: which modules ran in each forward of each
/// pass (`cache.computed.cond`, `.uncond` with guidance: rows appended across experts) and,
/// when calibrating, the MagCache ratios (`cache.calibration_ratios.*`), for the safetensors
/// output; what it skipped for `--stats-json` (`metrics.cache`) and, in one line, the progress.
pub fn record_cache(
    job: &mut Job,
    cache: &crate::models::step_cache::StepCache,
    progress: &Progress,
) -> Result<()> {
    progress.note(&cache.summary());
    use crate::models::step_cache::Pass;
    let passes: &[(Pass, &str)] = match cache.guided() {
        true => &[(Pass::Cond, "cond"), (Pass::Uncond, "uncond")],
        false => &[(Pass::Cond, "cond")],
    };
    for &(pass, name) in passes {
        let computed = cache.computed(pass)?;
        let key = format!("cache.computed.{name}");
        match job.extra_outputs.iter_mut().find(|(k, _)| *k == key) {
            Some((_, earlier)) => *earlier = Tensor::cat(&[&*earlier, &computed], 0)?,
            None => job.extra_outputs.push((key, computed)),
        }
        if let Some(ratios) = cache.calibration(pass) {
            let n = ratios.len();
            let ratios = Tensor::from_vec(ratios, n, &candle_core::Device::Cpu)?;
            let key = format!("cache.calibration_ratios.{name}");
            job.extra_outputs.retain(|(k, _)| *k != key);
            job.extra_outputs.push((key, ratios));
        }
    }
    let report = cache.report();
    match job.metrics.get_mut("cache") {
        Some(serde_json::Value::Array(stages)) => stages.push(report),
        _ => {
            job.metrics
                .insert("cache".into(), serde_json::Value::Array(vec![report]));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::source::ModelSource;
    use crate::pipeline::wan_t2v::WanConfigs;

    /// A device out-of-memory error, at load or in a stage, names when it happened and what to
    /// change; any other error passes through untouched.
    #[test]
    fn out_of_memory_errors_say_when_and_what_fits() {
        // Published sizes: the DiT's weights weigh in the peak.
        let fixture = "synthetic:wan2.1-t2v-1.3b";
        let argv = ["vidgen", "generate", "--model", fixture, "--prompt", "a"]
            .into_iter()
            .chain(["--device", "cpu", "--memory-model", "discrete"])
            .chain(["--no-dit-layerwise-offload"]);
        let crate::cli::Parsed::Generate(args) = crate::cli::parse(argv.map(Into::into)).unwrap()
        else {
            panic!("not a generate command")
        };
        let config = ResolvedConfig::resolve(*args).unwrap();
        let source = ModelSource::parse(fixture).unwrap();
        let family = WanConfigs::read(&source).unwrap();
        let meter = MemoryMeter::new(&Device::Cpu);
        let explain = |when: &str, e| explain_out_of_memory(&family, &config, &meter, when, e);
        let oom = anyhow::anyhow!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")");
        let text = format!("{:#}", explain("while loading transformer", oom));
        assert!(
            text.starts_with("out of device memory while loading transformer ("),
            "{text}"
        );
        assert!(text.contains("host RSS peak"), "{text}");
        assert!(text.contains("--dit-layerwise-offload"), "advice: {text}");
        assert!(
            text.contains("CUDA_ERROR_OUT_OF_MEMORY"),
            "the cause is kept: {text}"
        );
        let other = anyhow::anyhow!("shape mismatch for blocks.0.attn1.to_q.weight");
        let text = format!("{:#}", explain("in stage denoise", other));
        assert_eq!(text, "shape mismatch for blocks.0.attn1.to_q.weight");
    }
}
