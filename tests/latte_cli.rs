//! Latte-1 through the command line, driven as PARITY-CLI.md says: the `latte-tiny-a`
//! pipeline runs (CFG 7.5 and 1) reproduced from a draws file holding diffusers' initial
//! latents; offload modes bit-identical to the resident run; the dry run of the fixture and of
//! `synthetic:latte-1`; flags and sizes that do not apply refused.

mod common;

use candle_core::Tensor;
use common::{
    generate_frames, max_abs_diff, named_fixture_dir, named_reference, run_vidgen, scratch_dir,
};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const FIXTURE: &str = "latte-tiny-a";

fn preset() -> serde_json::Value {
    let path = named_fixture_dir(FIXTURE).join("reference/README.json");
    let readme: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    readme["preset"].clone()
}

/// The draws file: diffusers' `latents_init` as `latents`.
fn draws_file(dir: &Path) -> PathBuf {
    let refs = named_reference(FIXTURE, "pipeline");
    let draws: HashMap<String, Tensor> =
        [("latents".to_string(), refs["latents_init"].clone())].into();
    let path = dir.join("draws.safetensors");
    candle_core::safetensors::save(&draws, &path).unwrap();
    path
}

/// The parity command line at guidance `guidance` with `extra` flags (diffusers' call: the
/// pipeline prompt, its negative prompt, 5 frames of 32x48, 3 steps).
fn args(guidance: &str, extra: &[&str]) -> Vec<String> {
    let preset = preset();
    let index = preset["pipeline_prompt_index"].as_u64().unwrap() as usize;
    let prompt = preset["prompts"][index].as_str().unwrap();
    let negative = preset["negative_prompt"].as_str().unwrap();
    let model = named_fixture_dir(FIXTURE);
    let mut args: Vec<String> = [
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
        "--negative-prompt",
        negative,
        "--height",
        "32",
        "--width",
        "48",
        "--num-frames",
        "5",
        "--num-inference-steps",
        "3",
        "--guidance-scale",
        guidance,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn check_run(run: &str, guidance: &str) {
    let dir = scratch_dir("latte", run);
    let frames = generate_frames(&args(guidance, &[]), &draws_file(&dir), &dir).unwrap();
    common::assert_reference_run(FIXTURE, run, &frames, (1e-4, 1e-4));
}

#[test]
fn guided_run_matches_diffusers() {
    check_run("cfg7_5", "7.5");
}

#[test]
fn unguided_run_matches_diffusers() {
    check_run("cfg1", "1");
}

/// Every offload mode gives the resident run's frames, bit for bit.
#[test]
fn offload_modes_are_bit_identical_to_resident() {
    let dir = scratch_dir("latte", "offload");
    let draws = draws_file(&dir);
    common::assert_offload_modes_bit_identical(&[], |flags| {
        common::generate_frames_logged(&args("7.5", flags), &draws, &dir)
    });
}

/// `--fp8-matmul`: the blocks' attention and feed-forward Linears in e4m3 change the video by
/// about e4m3's precision (measured: 0.69% relative L2), and every offload mode gives the
/// resident fp8 run's frames bit for bit.
#[test]
fn fp8_matmuls_run_in_every_offload_mode() {
    let dir = scratch_dir("latte", "fp8");
    let draws = draws_file(&dir);
    common::assert_fp8_runs(0.015, |flags| {
        common::generate_frames_logged(&args("7.5", flags), &draws, &dir)
    });
}

/// The published call defaults (512x512, video_length frames, 50 steps, guidance 7.5) and the
/// plan's stages, for the fixture and `synthetic:latte-1`.
#[test]
fn dry_run_plans_the_fixture_and_the_published_model() {
    let fixture = named_fixture_dir(FIXTURE);
    let plan = common::dry_run_plan(fixture.to_str().unwrap(), &["--device", "cpu"]);
    // The fixture's transformer: sample_size 4 (x8 = 32), video_length 5.
    common::assert_planned_call(&plan, &json!({"height": 32, "num_frames": 5}));
    for extra in [&["--device", "cpu"][..], common::STREAMED_BF16] {
        let plan = common::dry_run_plan("synthetic:latte-1", extra);
        common::assert_planned_call(
            &plan,
            &json!({"height": 512, "width": 512, "num_frames": 16, "num_inference_steps": 50,
                "guidance_scale": 7.5, "max_sequence_length": 120}),
        );
        assert_eq!(plan["model"]["transformer_layers"], 28, "{plan}");
        assert_eq!(
            plan["model"]["latent_shape"],
            json!([1, 4, 16, 64, 64]),
            "{plan}"
        );
    }
}

/// Flags of other families, and sizes the transformer cannot take, are refused in one line
/// (exit 2), in a dry run too.
#[test]
fn flags_and_sizes_that_do_not_apply_are_refused() {
    let dir = scratch_dir("latte", "refused");
    let fixture = named_fixture_dir(FIXTURE);
    let image = dir.join("x.png");
    let other_family = "does not apply to Latte";
    let cases: &[(&[&str], &str)] = &[
        (&["--image", image.to_str().unwrap()], other_family),
        (&["--max-sequence-length", "16"], other_family),
        (&["--true-cfg-scale", "3"], other_family),
        (&["--flow-shift", "3"], other_family),
        (&["--scheduler", "euler"], other_family),
        (&["--num-frames", "4"], "video_length"),
        (&["--height", "40"], "multiple of 16"),
    ];
    for (flags, why) in cases {
        common::assert_refused(&fixture, &dir, flags, &[why]);
    }
}

/// A single frame (diffusers' `video_length=1`) runs without the temporal table and writes one
/// frame; the same seed writes the same frame.
#[test]
fn a_single_frame_runs_from_the_seed() {
    let dir = scratch_dir("latte", "one-frame");
    let fixture = named_fixture_dir(FIXTURE);
    let run = |name: &str| {
        let args: Vec<String> = [
            "generate",
            "--model",
            fixture.to_str().unwrap(),
            "--prompt",
            "a red car",
            "--num-frames",
            "1",
            "--num-inference-steps",
            "2",
            "--seed",
            "7",
            "--device",
            "cpu",
            "--output-type",
            "safetensors",
            "--output-path",
            dir.to_str().unwrap(),
            "--output-video-name",
            name,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let out = run_vidgen(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = dir.join(format!("{name}.safetensors"));
        candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap()["frames"].clone()
    };
    let (a, b) = (run("a"), run("b"));
    assert_eq!(a.dims(), [1, 32, 32, 3]);
    assert_eq!(max_abs_diff(&a, &b), 0.0);
}
