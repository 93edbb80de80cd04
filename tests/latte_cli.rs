//! Latte-1 through the command line, driven as PARITY-CLI.md says: the `latte-tiny-a`
//! pipeline runs (CFG 7.5 and 1) reproduced from a draws file holding diffusers' initial
//! latents; offload modes bit-identical to the resident run; the dry run of the fixture and of
//! `synthetic:latte-1`; flags and sizes that do not apply refused.

mod common;

use candle_core::Tensor;
use common::{
    assert_close, generate_frames, max_abs_diff, named_fixture_dir, named_reference, run_vidgen,
    scratch_dir,
};
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
    let expected = named_reference(FIXTURE, "pipeline")[&format!("{run}.frames")]
        .squeeze(0)
        .unwrap();
    eprintln!(
        "{run}.frames: max |diff| {:.3e}",
        max_abs_diff(&frames, &expected)
    );
    assert_close(&format!("{run}.frames"), &frames, &expected, 1e-4, 1e-4);
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
    let resident = generate_frames(
        &args(
            "7.5",
            &[
                "--memory-model",
                "discrete",
                "--no-dit-layerwise-offload",
                "--no-dit-cpu-offload",
                "--no-text-encoder-cpu-offload",
                "--no-vae-cpu-offload",
            ],
        ),
        &draws,
        &dir,
    )
    .unwrap();
    let modes: &[&[&str]] = &[
        &["--dit-layerwise-offload", "--offload-type", "leaf-level"],
        &["--dit-layerwise-offload", "--num-blocks-per-group", "1"],
        &["--dit-layerwise-offload", "--num-blocks-per-group", "8"],
        &[
            "--dit-layerwise-offload",
            "--num-blocks-per-group",
            "1",
            "--no-offload-stream",
        ],
        &[
            "--dit-layerwise-offload",
            "--num-blocks-per-group",
            "8",
            "--no-offload-stream",
        ],
        &[
            "--dit-layerwise-offload",
            "--num-blocks-per-group",
            "2",
            "--prefetch-depth",
            "2",
        ],
        &["--dit-layerwise-offload", "--max-pinned-memory", "1MiB"],
        &["--text-encoder-cpu-offload", "--vae-cpu-offload"],
        &["--model-cpu-offload"],
        &["--sequential-cpu-offload"],
        &["--lazy-module-load"],
    ];
    for flags in modes {
        let mut extra = vec!["--memory-model", "discrete"];
        extra.extend_from_slice(flags);
        let frames = generate_frames(&args("7.5", &extra), &draws, &dir)
            .unwrap_or_else(|e| panic!("{flags:?}: {e}"));
        assert_eq!(
            max_abs_diff(&frames, &resident),
            0.0,
            "{flags:?} differs from the resident run"
        );
    }
    // Unified memory's rules (host offload off, components loaded in turn).
    let unified = generate_frames(&args("7.5", &["--memory-model", "unified"]), &draws, &dir)
        .unwrap_or_else(|e| panic!("unified: {e}"));
    assert_eq!(max_abs_diff(&unified, &resident), 0.0, "unified memory");
}

/// The published call defaults (512x512, video_length frames, 50 steps, guidance 7.5) and the
/// plan's stages, for the fixture and `synthetic:latte-1`.
#[test]
fn dry_run_plans_the_fixture_and_the_published_model() {
    let fixture = named_fixture_dir(FIXTURE);
    let plan = common::dry_run_plan(fixture.to_str().unwrap(), &["--device", "cpu"]);
    // The fixture's transformer: sample_size 4 (x8 = 32), video_length 5.
    assert_eq!(plan["config"]["height"], 32, "{plan}");
    assert_eq!(plan["config"]["num_frames"], 5, "{plan}");
    for extra in [
        vec!["--device", "cpu"],
        vec![
            "--device",
            "cpu",
            "--dit-layerwise-offload",
            "--dtype",
            "bf16",
        ],
    ] {
        let plan = common::dry_run_plan("synthetic:latte-1", &extra);
        let text = plan.to_string();
        let config = &plan["config"];
        assert_eq!(config["height"], 512, "{text}");
        assert_eq!(config["width"], 512, "{text}");
        assert_eq!(config["num_frames"], 16, "{text}");
        assert_eq!(config["num_inference_steps"], 50, "{text}");
        assert_eq!(config["guidance_scale"], 7.5, "{text}");
        assert_eq!(config["max_sequence_length"], 120, "{text}");
        for stage in ["encode_text", "denoise", "decode", "write"] {
            assert!(text.contains(stage), "no stage {stage}: {text}");
        }
        assert!(!text.contains("\"error\""), "{text}");
        assert_eq!(plan["model"]["transformer_layers"], 28, "{text}");
        assert_eq!(
            plan["model"]["latent_shape"],
            serde_json::json!([1, 4, 16, 64, 64]),
            "{text}"
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
    let cases: &[(&[&str], &str)] = &[
        (
            &["--image", image.to_str().unwrap()],
            "does not apply to Latte",
        ),
        (&["--max-sequence-length", "16"], "does not apply to Latte"),
        (&["--true-cfg-scale", "3"], "does not apply to Latte"),
        (&["--flow-shift", "3"], "does not apply to Latte"),
        (&["--scheduler", "euler"], "does not apply to Latte"),
        (&["--num-frames", "4"], "video_length"),
        (&["--height", "40"], "multiple of 16"),
    ];
    for (flags, why) in cases {
        for dry in [false, true] {
            let mut args: Vec<String> = [
                "generate",
                "--model",
                fixture.to_str().unwrap(),
                "--prompt",
                "a",
                "--device",
                "cpu",
                "--output-path",
                dir.to_str().unwrap(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            args.extend(flags.iter().map(|s| s.to_string()));
            if dry {
                args.push("--dry-run".into());
            }
            let out = run_vidgen(&args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
            let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
            assert_eq!(errors.len(), 1, "{flags:?}: {stderr}");
            assert!(errors[0].contains(why), "{flags:?}: {stderr}");
        }
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
