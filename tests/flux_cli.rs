//! FLUX.1 through the command line, driven as PARITY-CLI.md says: the `flux-tiny-a` pipeline
//! runs (real CFG 4 with a negative prompt, and true_cfg_scale 1 where the negative prompt is
//! ignored) reproduced from diffusers' packed initial latents; one PNG file by default; offload
//! modes bit-identical to the resident run; the dry run of the fixture and of
//! `synthetic:flux.1-dev`; flags that do not apply refused.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{max_abs_diff, named_fixture_dir, named_reference};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const FIXTURE: &str = "flux-tiny-a";

fn readme() -> serde_json::Value {
    let path = named_fixture_dir(FIXTURE).join("reference/README.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The pipeline call's prompt and negative prompt.
fn prompts() -> (String, String) {
    let inputs = &readme()["files"]["pipeline.safetensors"]["inputs"];
    let text = |key: &str| inputs[key].as_str().unwrap().to_string();
    (text("prompt"), text("negative_prompt"))
}

fn scratch(name: &str) -> PathBuf {
    common::scratch_dir("flux", name)
}

/// The draws file of the reference runs: `latents` (packed).
fn draws_file(dir: &Path) -> PathBuf {
    let refs = named_reference(FIXTURE, "pipeline");
    let draws: HashMap<String, Tensor> =
        [("latents".to_string(), refs["latents_init"].clone())].into();
    let path = dir.join("draws.safetensors");
    candle_core::safetensors::save(&draws, &path).unwrap();
    path
}

/// The reference call's flags for run `run` (`truecfg4`, `cfg1`), `--num-frames 1` as
/// PARITY-CLI drives an image model, plus `extra`, writing into `dir` as `v`.
fn parity_args(dir: &Path, run: &str, extra: &[&str]) -> Vec<String> {
    let (prompt, negative) = prompts();
    let true_cfg = run.trim_start_matches("truecfg").trim_start_matches("cfg");
    let model = named_fixture_dir(FIXTURE);
    let draws = draws_file(dir);
    let mut args: Vec<String> = [
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        &prompt,
        "--negative-prompt",
        &negative,
        "--height",
        "48",
        "--width",
        "64",
        "--num-frames",
        "1",
        "--num-inference-steps",
        "3",
        "--guidance-scale",
        "3.5",
        "--true-cfg-scale",
        true_cfg,
        "--max-sequence-length",
        "16",
        "--latents",
        draws.to_str().unwrap(),
        "--device",
        "cpu",
        "--dtype",
        "f32",
        "--output-path",
        dir.to_str().unwrap(),
        "--output-video-name",
        "v",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Run `run` written as safetensors with `extra` flags: the frames and stderr.
fn generate(dir: &Path, run: &str, extra: &[&str]) -> (Tensor, String) {
    let mut flags = vec!["--output-type", "safetensors"];
    flags.extend_from_slice(extra);
    let args = parity_args(dir, run, &flags);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = common::vidgen(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "vidgen failed: {stderr}");
    let written = dir.join("v.safetensors");
    let frames = candle_core::safetensors::load(&written, &Device::Cpu).unwrap()["frames"].clone();
    std::fs::remove_file(&written).unwrap();
    (frames, stderr)
}

fn check_run(run: &str) {
    let dir = scratch(run);
    let (frames, _) = generate(&dir, run, &[]);
    common::assert_reference_run(FIXTURE, run, &frames, (1e-4, 1e-4));
}

#[test]
fn true_cfg_run_matches_diffusers() {
    check_run("truecfg4");
}

#[test]
fn run_without_true_cfg_matches_diffusers() {
    check_run("cfg1");
}

/// Without `--output-type` the image is one PNG file, `v.png`, whose pixels are diffusers' PIL
/// rounding of the frames, within one level.
#[test]
fn the_default_output_is_one_png_file() {
    let dir = scratch("png");
    let args = parity_args(&dir, "truecfg4", &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = common::vidgen(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let path = dir.join("v.png");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        path.to_str().unwrap()
    );
    assert!(path.is_file(), "{stderr}");
    let image = image::open(&path).unwrap().to_rgb8();
    let expected = named_reference(FIXTURE, "pipeline")["truecfg4.frames_uint8_round"]
        .squeeze(0)
        .unwrap()
        .squeeze(0)
        .unwrap();
    let (h, w, _) = expected.dims3().unwrap();
    assert_eq!((image.height() as usize, image.width() as usize), (h, w));
    let got = Tensor::from_vec(image.into_raw(), (h, w, 3), &Device::Cpu).unwrap();
    let diff = max_abs_diff(
        &got.to_dtype(DType::F32).unwrap(),
        &expected.to_dtype(DType::F32).unwrap(),
    );
    assert!(diff <= 1.0, "uint8 off by {diff}");
    // The image is the output `--overwrite` and `--resume` know: the same run again fails
    // before any work, naming it, and `--resume` skips it.
    let again = common::vidgen(&args);
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("v.png already exists"), "{stderr}");
    let mut resume = args.clone();
    resume.push("--resume");
    let skipped = common::vidgen(&resume);
    let stderr = String::from_utf8_lossy(&skipped.stderr);
    assert!(skipped.status.success(), "{stderr}");
    assert!(stderr.contains("skipping"), "{stderr}");
}

/// Every offload mode gives the resident run's image, bit for bit.
#[test]
fn offload_modes_are_bit_identical_to_resident() {
    let dir = scratch("offload");
    common::assert_offload_modes_bit_identical(&[], |flags| generate(&dir, "truecfg4", flags));
}

/// `--fp8-matmul`: the blocks' Linears in e4m3 change the image by about e4m3's precision
/// (measured: 1.0% relative L2), and every offload mode gives the resident fp8 run's image bit
/// for bit (each block's weight codes are made where it lands).
#[test]
fn fp8_matmuls_run_in_every_offload_mode() {
    let dir = scratch("fp8");
    common::assert_fp8_runs(0.025, |flags| generate(&dir, "truecfg4", flags));
}

/// The published call defaults (1024x1024, one image as PNG, 28 steps, guidance 3.5, 512
/// tokens) and every stage, for the fixture, the published configs and their Hub id.
#[test]
fn dry_run_plans_the_fixture_and_the_published_model() {
    let fixture = named_fixture_dir(FIXTURE);
    for (model, extra) in [
        (fixture.to_str().unwrap(), &["--device", "cpu"][..]),
        ("synthetic:flux.1-dev", &["--device", "cpu"]),
        // The Hub id plans from the shipped configs, without a download.
        ("black-forest-labs/FLUX.1-dev", &["--device", "cpu"]),
        ("synthetic:flux.1-dev", common::STREAMED_BF16),
    ] {
        common::assert_planned_call(
            &common::dry_run_plan(model, extra),
            &json!({"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 28,
                "guidance_scale": 3.5, "max_sequence_length": 512, "output_type": "png"}),
        );
    }
    let plan = common::dry_run_plan("synthetic:flux.1-dev", &["--device", "cpu"]);
    let model = &plan["model"];
    assert_eq!(model["transformer_dual_stream_layers"], 19, "{plan}");
    assert_eq!(model["transformer_single_stream_layers"], 38, "{plan}");
    assert_eq!(model["latent_shape"], json!([1, 4096, 64]), "{plan}");
}

/// Flags of other families, a video's frame count and output, and more T5 tokens than the
/// pipeline takes are refused with the reason, one line, exit 2, in a dry run too.
#[test]
fn flags_that_do_not_apply_are_refused() {
    let dir = scratch("refused");
    let fixture = named_fixture_dir(FIXTURE);
    let image = dir.join("x.png");
    for (flag, value, why) in [
        ("--image", image.to_str().unwrap(), "image-to-video"),
        ("--guidance-scale-2", "3", "two transformers"),
        ("--decode-timestep", "0.05", "LTX-Video"),
        ("--flow-shift", "3", "flow-matching schedule"),
        ("--scheduler", "euler", "its own scheduler"),
        ("--num-frames", "5", "makes one image"),
        ("--output-type", "mp4", "makes one image"),
        ("--max-sequence-length", "600", "at most 512"),
    ] {
        common::assert_refused(&fixture, &dir, &[flag, value], &[flag, why]);
    }
}

/// A transformer without a guidance embedding (FLUX.1 schnell's config) has no guidance to
/// set: `--guidance-scale` is refused, in a dry run too, and the dry run plans without it.
#[test]
fn guidance_scale_is_refused_without_a_guidance_embedding() {
    let dir = scratch("schnell");
    let fixture = named_fixture_dir(FIXTURE);
    let model = dir.join("model");
    for rel in [
        "model_index.json",
        "transformer/config.json",
        "vae/config.json",
        "text_encoder/config.json",
        "text_encoder_2/config.json",
        "scheduler/scheduler_config.json",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "tokenizer_2/tokenizer.json",
        "tokenizer_2/tokenizer_config.json",
    ] {
        let to = model.join(rel);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        let text = std::fs::read_to_string(fixture.join(rel)).unwrap();
        let text = text.replace("\"guidance_embeds\": true", "\"guidance_embeds\": false");
        std::fs::write(&to, text).unwrap();
    }
    let model = model.to_str().unwrap();
    let base = [
        "generate",
        "--model",
        model,
        "--prompt",
        "a",
        "--device",
        "cpu",
        "--dry-run",
    ];
    let mut guided = base.to_vec();
    guided.extend(["--guidance-scale", "2"]);
    let stderr = common::usage_error(&common::vidgen(&guided), "--guidance-scale");
    assert!(
        stderr.contains("--guidance-scale does not apply"),
        "{stderr}"
    );
    let out = common::vidgen(&base);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
