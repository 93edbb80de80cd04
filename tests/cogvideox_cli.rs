//! CogVideoX through the command line, driven as PARITY-CLI.md says: the `cogvideox-tiny-a`
//! pipeline runs (guided and at CFG 1) reproduced from a draws file holding diffusers' initial
//! latents and scheduler noise, and with the DDIM sampler the CogVideoX-5b repo ships
//! (`cogvideox-ddim`); offload modes bit-identical to the resident run, with `--fp8-matmul` too;
//! the dry run of the fixture and of `synthetic:cogvideox-5b`; flags that do not apply refused.

mod common;

use candle_core::Tensor;
use common::{named_fixture_dir, named_reference};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const FIXTURE: &str = "cogvideox-tiny-a";
const PROMPT: &str = "A red car drives along a coastal road.";
const NEGATIVE: &str = "blurry, static, low quality";

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-cogvideox-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The draws file of reference run `run` (`cfg1`, `cfg6`): `latents` and every
/// `stepN.scheduler_noise.K`, prefix removed.
fn draws_file(dir: &Path, run: &str) -> PathBuf {
    let refs = named_reference(FIXTURE, "pipeline");
    let prefix = format!("{run}.");
    let mut draws: HashMap<String, Tensor> = refs
        .iter()
        .filter_map(|(k, v)| {
            let name = k.strip_prefix(&prefix)?;
            name.contains(".scheduler_noise.")
                .then(|| (name.to_string(), v.clone()))
        })
        .collect();
    draws.insert("latents".into(), refs["latents_init"].clone());
    let path = dir.join(format!("draws-{run}.safetensors"));
    candle_core::safetensors::save(&draws, &path).unwrap();
    path
}

/// The parity command line of run `run` with `extra` flags; the written frames and stderr.
fn generate(dir: &Path, run: &str, extra: &[&str]) -> (Tensor, String) {
    let draws = draws_file(dir, run);
    generate_with(&named_fixture_dir(FIXTURE), &draws, dir, run, extra)
}

/// The parity command line of run `run` of `model` replaying `draws`.
fn generate_with(
    model: &Path,
    draws: &Path,
    dir: &Path,
    run: &str,
    extra: &[&str],
) -> (Tensor, String) {
    let guidance = run.trim_start_matches("cfg");
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
        "17",
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
    common::generate_frames_logged(&args, draws, dir)
}

/// The tiny model as the CogVideoX-5b repo names its sampler (`CogVideoXDDIMScheduler`, in
/// `model_index.json` and the scheduler config; same values): the other components linked from
/// the fixture.
fn ddim_model(dir: &Path) -> PathBuf {
    let fixture = named_fixture_dir(FIXTURE);
    let model = dir.join("model");
    std::fs::create_dir_all(model.join("scheduler")).unwrap();
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let name = entry.unwrap().file_name();
        if name != "scheduler" && name != "model_index.json" {
            std::os::unix::fs::symlink(fixture.join(&name), model.join(&name)).unwrap();
        }
    }
    for (file, pointer) in [
        ("model_index.json", "/scheduler/1"),
        ("scheduler/scheduler_config.json", "/_class_name"),
    ] {
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture.join(file)).unwrap()).unwrap();
        *json.pointer_mut(pointer).unwrap() = json!("CogVideoXDDIMScheduler");
        std::fs::write(model.join(file), json.to_string()).unwrap();
    }
    model
}

fn check_run(run: &str) {
    let dir = scratch(run);
    let (frames, _) = generate(&dir, run, &[]);
    common::assert_reference_run(FIXTURE, run, &frames, (1e-4, 1e-4));
}

#[test]
fn guided_run_matches_diffusers() {
    check_run("cfg6");
}

#[test]
fn unguided_run_matches_diffusers() {
    check_run("cfg1");
}

/// The guided run with the DDIM sampler: the initial latents are its only draw.
#[test]
fn ddim_run_matches_diffusers() {
    let dir = scratch("ddim");
    let refs = named_reference("cogvideox-ddim", "ddim");
    let draws = dir.join("draws.safetensors");
    let latents: HashMap<&str, Tensor> = [("latents", refs["cfg6.latents_init"].clone())].into();
    candle_core::safetensors::save(&latents, &draws).unwrap();
    let (frames, _) = generate_with(&ddim_model(&dir), &draws, &dir, "cfg6", &[]);
    let expected = refs["cfg6.frames"].squeeze(0).unwrap();
    eprintln!(
        "ddim cfg6.frames: max |diff| {:.3e}",
        common::max_abs_diff(&frames, &expected)
    );
    common::assert_close("ddim cfg6.frames", &frames, &expected, 1e-4, 1e-4);
}

/// Every offload mode gives the resident run's frames, bit for bit.
#[test]
fn offload_modes_are_bit_identical_to_resident() {
    let dir = scratch("offload");
    common::assert_offload_modes_bit_identical(&[], |flags| generate(&dir, "cfg6", flags));
}

/// `--fp8-matmul`: the blocks' Linears in e4m3 change the video by about e4m3's precision
/// (measured: 2.5% relative L2, through the tiny VAE), and every offload mode gives the
/// resident fp8 run's frames bit for bit (each block's weight codes are made where it lands).
#[test]
fn fp8_matmuls_run_in_every_offload_mode() {
    let dir = scratch("fp8");
    common::assert_fp8_runs(0.032, |flags| generate(&dir, "cfg6", flags));
}

#[test]
fn dry_run_plans_the_fixture_and_the_published_model() {
    let fixture = named_fixture_dir(FIXTURE);
    for (model, extra) in [
        (fixture.to_str().unwrap(), &["--device", "cpu"][..]),
        ("synthetic:cogvideox-5b", &["--device", "cpu"]),
        ("synthetic:cogvideox-5b", common::STREAMED_BF16),
    ] {
        common::assert_planned_call(
            &common::dry_run_plan(model, extra),
            &json!({"height": 480, "width": 720, "num_frames": 49, "fps": 8,
                "guidance_scale": 6.0, "max_sequence_length": 226}),
        );
    }
    let plan = common::dry_run_plan("synthetic:cogvideox-5b", &["--device", "cpu"]);
    assert_eq!(plan["model"]["transformer_layers"], 42, "{plan}");
    assert_eq!(
        plan["model"]["latent_shape"],
        json!([1, 13, 16, 60, 90]),
        "{plan}"
    );
    // The sampler each checkpoint names: the published repo's DDIM, the fixture's DPM; the
    // configuration echoes no `--scheduler` (it picks none of them).
    assert!(plan["config"].get("scheduler").is_none(), "{plan}");
    assert_eq!(
        plan["model"]["scheduler"], "CogVideoXDDIMScheduler",
        "{plan}"
    );
    let plan = common::dry_run_plan(fixture.to_str().unwrap(), &["--device", "cpu"]);
    assert_eq!(
        plan["model"]["scheduler"], "CogVideoXDPMScheduler",
        "{plan}"
    );
}

/// Flags of other families are refused with what they are for, one line, exit 2.
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
    ] {
        let refusal = "does not apply to CogVideoX text-to-video";
        common::assert_refused(&fixture, &dir, &[flag, value], &[flag, why, refusal]);
    }
}

/// A draws file missing a draw, or holding one the run does not use, is bad input (exit 2)
/// naming the tensor, before anything loads.
#[test]
fn draws_file_mistakes_are_named() {
    let dir = scratch("draws");
    let refs = named_reference(FIXTURE, "pipeline");
    let path = dir.join("partial.safetensors");
    let partial: HashMap<String, Tensor> = [
        ("latents".to_string(), refs["latents_init"].clone()),
        (
            "step0.scheduler_noise.0".to_string(),
            refs["cfg1.step0.scheduler_noise.0"].clone(),
        ),
    ]
    .into();
    candle_core::safetensors::save(&partial, &path).unwrap();
    let fixture = named_fixture_dir(FIXTURE);
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
        "17",
        "--num-inference-steps",
        "3",
        "--latents",
        path.to_str().unwrap(),
        "--device",
        "cpu",
        "--output-path",
        dir.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("step1.scheduler_noise.0"), "{stderr}");
}
