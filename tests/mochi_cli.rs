//! Mochi-1 through the command line, driven as PARITY-CLI.md says: the `mochi-tiny-a` pipeline
//! runs (guided and at CFG 1) reproduced from a draws file holding diffusers' initial latents;
//! a frame count that is not 6k+1 makes 6·((n − 1) // 6) + 1 frames; offload modes
//! bit-identical to the resident run, with `--fp8-matmul` too (within a bound of the exact
//! run); the dry run of the fixture and of `synthetic:mochi-1`;
//! flags that do not apply refused.

mod common;

use candle_core::Tensor;
use common::{named_fixture_dir, named_reference, usage_error};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const FIXTURE: &str = "mochi-tiny-a";
const PROMPT: &str = "A red car drives along a coastal road.";
const NEGATIVE: &str = "blurry, static, low quality";

fn scratch(name: &str) -> PathBuf {
    common::scratch_dir("mochi", name)
}

/// The draws file of the reference runs: `latents` (the pipeline draws nothing else).
fn draws_file(dir: &Path) -> PathBuf {
    let refs = named_reference(FIXTURE, "pipeline");
    let draws: HashMap<String, Tensor> =
        [("latents".to_string(), refs["latents_init"].clone())].into();
    let path = dir.join("draws.safetensors");
    candle_core::safetensors::save(&draws, &path).unwrap();
    path
}

/// The parity command line at guidance `guidance` for `frames` frames with `extra` flags; the
/// written frames and stderr.
fn generate(dir: &Path, guidance: &str, frames: &str, extra: &[&str]) -> (Tensor, String) {
    let draws = draws_file(dir);
    let model = named_fixture_dir(FIXTURE);
    let args: Vec<String> = [
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        PROMPT,
        "--negative-prompt",
        NEGATIVE,
        "--height",
        "32",
        "--width",
        "48",
        "--num-frames",
        frames,
        "--num-inference-steps",
        "3",
        "--guidance-scale",
        guidance,
        "--max-sequence-length",
        "16",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    common::generate_frames_logged(&args, &draws, dir)
}

/// The reference run `run` with `frames` frames asked; stderr.
fn check_run(run: &str, guidance: &str, frames: &str) -> String {
    let dir = scratch(&format!("{run}-{frames}"));
    let (written, log) = generate(&dir, guidance, frames, &[]);
    common::assert_reference_run(FIXTURE, run, &written, (1e-4, 1e-4));
    log
}

#[test]
fn guided_run_matches_diffusers() {
    let log = check_run("cfg4_5", "4.5", "13");
    assert!(!log.contains("frames asked"), "{log}");
}

#[test]
fn unguided_run_matches_diffusers() {
    check_run("cfg1", "1", "13");
}

/// 18 frames asked: the same 3 latent frames, so diffusers' 13 frames, said on stderr.
#[test]
fn frames_are_six_k_plus_one_of_the_latents() {
    let log = check_run("cfg1", "1", "18");
    assert!(log.contains("18 frames asked, 13 made"), "{log}");
}

/// Every offload mode gives the resident run's frames, bit for bit.
#[test]
fn offload_modes_are_bit_identical_to_resident() {
    let dir = scratch("offload");
    common::assert_offload_modes_bit_identical(&[], |flags| generate(&dir, "4.5", "13", flags));
}

/// `--fp8-matmul`: the blocks' attention and feed-forward Linears in e4m3 change the guided
/// video by about e4m3's precision (measured: 1.0% relative L2, through the tiny VAE), and
/// every offload mode gives the resident fp8 run's frames bit for bit (each block's weight codes
/// are made where it lands).
#[test]
fn fp8_matmuls_run_in_every_offload_mode() {
    let dir = scratch("fp8");
    common::assert_fp8_runs(0.013, |flags| generate(&dir, "4.5", "13", flags));
}

#[test]
fn dry_run_plans_the_fixture_and_the_published_model() {
    let fixture = named_fixture_dir(FIXTURE);
    for (model, extra) in [
        (fixture.to_str().unwrap(), &["--device", "cpu"][..]),
        ("synthetic:mochi-1", &["--device", "cpu"]),
        ("synthetic:mochi-1", common::STREAMED_BF16),
    ] {
        common::assert_planned_call(
            &common::dry_run_plan(model, extra),
            &json!({"height": 480, "width": 848, "num_frames": 19, "num_inference_steps": 64,
                "guidance_scale": 4.5, "max_sequence_length": 256}),
        );
    }
    // The benchmark's 480x848x85: 15 latent frames of 60x106, 85 frames out.
    let plan = common::dry_run_plan(
        "synthetic:mochi-1",
        &["--device", "cpu", "--num-frames", "85"],
    );
    assert_eq!(plan["model"]["transformer_layers"], 48, "{plan}");
    assert_eq!(
        plan["model"]["latent_shape"],
        json!([1, 12, 15, 60, 106]),
        "{plan}"
    );
    assert_eq!(plan["model"]["frames_out"], 85, "{plan}");
}

/// Flags of other families are refused with what they are for, one line, exit 2, in a dry run
/// too; so are one-step schedules and sizes the patches do not tile.
#[test]
fn flags_that_do_not_apply_are_refused() {
    let dir = scratch("refused");
    let fixture = named_fixture_dir(FIXTURE);
    let image = dir.join("x.png");
    for (flag, value, why) in [
        ("--image", image.to_str().unwrap(), "image-to-video"),
        ("--guidance-scale-2", "3", "two transformers"),
        ("--true-cfg-scale", "3", "guidance-distilled"),
        ("--decode-timestep", "0.05", "LTX-Video"),
        ("--flow-shift", "3", "flow-matching schedule"),
        ("--scheduler", "euler", "its own scheduler"),
        ("--num-inference-steps", "1", "at least 2"),
        ("--height", "40", "16"),
    ] {
        common::assert_refused(&fixture, &dir, &[flag, value], &[why]);
    }
}

/// A draws file whose `latents` do not fit the run, or that holds a draw Mochi never makes, is
/// bad input (exit 2, one line) naming the tensor, before anything loads.
#[test]
fn draws_file_mistakes_are_named() {
    let dir = scratch("draws");
    let refs = named_reference(FIXTURE, "pipeline");
    let fixture = named_fixture_dir(FIXTURE);
    let latents = refs["latents_init"].clone();
    let cases: [(&str, HashMap<String, Tensor>, &str); 2] = [
        (
            "wrong shape",
            [("latents".to_string(), latents.narrow(2, 0, 2).unwrap())].into(),
            "latents",
        ),
        (
            "unused draw",
            [
                ("latents".to_string(), latents.clone()),
                ("step0.scheduler_noise.0".to_string(), latents.clone()),
            ]
            .into(),
            "step0.scheduler_noise.0",
        ),
    ];
    for (what, draws, named) in cases {
        let path = dir.join("draws.safetensors");
        candle_core::safetensors::save(&draws, &path).unwrap();
        let out = common::vidgen(&[
            "generate",
            "--model",
            fixture.to_str().unwrap(),
            "--prompt",
            "a",
            "--height",
            "32",
            "--width",
            "48",
            "--num-frames",
            "13",
            "--num-inference-steps",
            "3",
            "--latents",
            path.to_str().unwrap(),
            "--device",
            "cpu",
            "--output-path",
            dir.to_str().unwrap(),
            "--quiet",
        ]);
        let line = usage_error(&out, what);
        assert!(line.contains(named), "{what}: {line}");
    }
}
