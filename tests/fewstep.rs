//! Few-step distilled runs (the Wan distillation LoRAs' 4- and 8-step recipes): flow-matching
//! Euler at shift 5 over custom sigmas (`--sigmas`), guidance 1, against diffusers 0.42.1
//! (`tests/fixtures/fewstep`, made by `make_fewstep_fixtures.py` beside it): the schedules and
//! Euler steps, whole runs of the tiny Wan2.1 and Wan2.2 A14B fixtures, and the refusals.

mod common;

use candle_core::{Device, Tensor};
use common::{assert_close, named_fixture_dir, scratch_dir, usage_error};
use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};
use vidgen::schedulers::{build, SchedulerConfig, SchedulerKind};

const STEPS4: &str = "1,0.75,0.5,0.25";
const STEPS8: &str = "1,0.875,0.75,0.625,0.5,0.375,0.25,0.125";
const PROMPT: &str = "  Tom &amp;amp; Jerry\n\n  bake a   cake &lt;together&gt;\tin the kitchen  ";

fn reference() -> HashMap<String, Tensor> {
    let path = named_fixture_dir("fewstep").join("fewstep.safetensors");
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn sigmas(list: &str) -> Vec<f64> {
    list.split(',').map(|s| s.parse().unwrap()).collect()
}

/// The recipes' schedules (timesteps 1000, 937.5, 833.33, 625 for 4 steps) and each Euler step
/// from them equal diffusers' `FlowMatchEulerDiscreteScheduler(shift=5).set_timesteps(sigmas=..)`
/// and `step` (1e-6 relative).
#[test]
fn recipe_schedules_and_steps_match_diffusers() {
    let r = reference();
    let cfg = SchedulerConfig::from_file(
        named_fixture_dir("wan-tiny-a").join("scheduler/scheduler_config.json"),
    )
    .unwrap();
    for (name, list) in [("steps4", STEPS4), ("steps8", STEPS8)] {
        let list = sigmas(list);
        let n = list.len();
        let mut s = build(SchedulerKind::Euler, &cfg, n, Some(5.0), Some(&list)).unwrap();
        let timesteps: Vec<f32> = s.timesteps().iter().map(|&t| t as f32).collect();
        let got = Tensor::new(timesteps.as_slice(), &Device::Cpu).unwrap();
        let want = &r[&format!("{name}.timesteps")];
        assert_close(&format!("{name}.timesteps"), &got, want, 0.0, 1e-6);
        let got = Tensor::new(s.sigmas(), &Device::Cpu).unwrap();
        assert_close(
            &format!("{name}.sigmas"),
            &got,
            &r[&format!("{name}.sigmas")],
            0.0,
            1e-6,
        );
        let mut sample = r[&format!("{name}.sample")].clone();
        for i in 0..n {
            let v = &r[&format!("{name}.model_output.{i}")];
            sample = s.step(v, &sample).unwrap();
            let want = &r[&format!("{name}.step{i}")];
            assert_close(&format!("{name}.step{i}"), &sample, want, 0.0, 1e-6);
        }
    }
}

/// `vidgen generate` on `fixture` with the recipe's flags and the case's initial latents,
/// writing safetensors into `dir`.
fn vidgen(fixture: &str, dir: &Path, latents: Option<&Tensor>, extra: &[&str]) -> Output {
    let draws = dir.join("draws.safetensors");
    if let Some(latents) = latents {
        let init: HashMap<String, Tensor> = [("latents".to_string(), latents.clone())].into();
        candle_core::safetensors::save(&init, &draws).unwrap();
    }
    let model = named_fixture_dir(fixture);
    let mut command = Command::new(env!("CARGO_BIN_EXE_vidgen"));
    command
        .args(["generate", "--model", model.to_str().unwrap()])
        .args([
            "--prompt",
            PROMPT,
            "--negative-prompt",
            "blurry, static, low quality",
        ])
        .args(["--height", "32", "--width", "32", "--num-frames", "9"])
        .args(["--max-sequence-length", "20"])
        .args(["--device", "cpu", "--dtype", "f32"])
        .args(["--output-type", "safetensors"])
        .args(["--output-path", dir.to_str().unwrap()])
        .args(["--output-video-name", "v"])
        .args(extra)
        .env("HF_HUB_OFFLINE", "1");
    if latents.is_some() {
        command.args(["--latents", draws.to_str().unwrap()]);
    }
    command.output().unwrap()
}

/// The README's recipe flags on the tiny fixtures give diffusers' frames (1e-4 + 1e-4·|ref|):
/// Wan2.1's 4-step LightX2V recipe, and Wan2.2 A14B's Lightning recipes in 4 and 8 steps, whose
/// experts switch at the boundary (875) after 2 and 4 steps as diffusers' did. The step count
/// comes from the sigmas.
#[test]
fn recipe_runs_match_diffusers() {
    let r = reference();
    let cases = [
        (
            "wan21_steps4",
            "wan-tiny-a",
            STEPS4,
            [0i64, 0, 0, 0].as_slice(),
        ),
        ("a14b_steps4", "wan22-a14b-tiny-a", STEPS4, &[0, 0, 1, 1]),
        (
            "a14b_steps8",
            "wan22-a14b-tiny-a",
            STEPS8,
            &[0, 0, 0, 0, 1, 1, 1, 1],
        ),
    ];
    for (case, fixture, list, experts) in cases {
        assert_eq!(
            r[&format!("{case}.experts")].to_vec1::<i64>().unwrap(),
            experts,
            "{case}: diffusers' expert per step"
        );
        let dir = scratch_dir("fewstep", case);
        let recipe = [
            "--scheduler",
            "euler",
            "--flow-shift",
            "5",
            "--sigmas",
            list,
            "--guidance-scale",
            "1",
        ];
        let latents = &r[&format!("{case}.latents_init")];
        let out = vidgen(fixture, &dir, Some(latents), &recipe);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{case}: {stderr}");
        let frames = candle_core::safetensors::load(dir.join("v.safetensors"), &Device::Cpu)
            .unwrap()["frames"]
            .clone();
        let want = &r[&format!("{case}.frames")];
        assert_close(case, &frames, want, 1e-4, 1e-4);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The sigmas fix the step count (no --num-inference-steps needed) and are recorded as given,
/// from the command line or a config file.
#[test]
fn sigmas_set_the_step_count_in_the_resolved_config() {
    let dir = scratch_dir("fewstep", "dry-run");
    let toml = dir.join("recipe.toml");
    std::fs::write(
        &toml,
        "scheduler = \"euler\"\nsigmas = [1.0, 0.75, 0.5, 0.25]\n",
    )
    .unwrap();
    let flags: [&[&str]; 2] = [
        &["--scheduler", "euler", "--sigmas", STEPS4],
        &["--config", toml.to_str().unwrap()],
    ];
    for extra in flags {
        let out = vidgen(
            "wan-tiny-a",
            &dir,
            None,
            &[extra, &["--dry-run", "--json"]].concat(),
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["config"]["num_inference_steps"], 4, "{extra:?}");
        assert_eq!(
            json["config"]["sigmas"],
            serde_json::json!([1.0, 0.75, 0.5, 0.25]),
            "{extra:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sigmas that make no schedule, or a schedule nothing here runs, are refused in one line
/// (exit 2) before anything loads or is written.
#[test]
fn bad_sigmas_are_refused_before_any_work() {
    let dir = scratch_dir("fewstep", "refusals");
    let lines = dir.join("prompts.jsonl");
    std::fs::write(
        &lines,
        "{\"prompt\": \"a\"}\n{\"prompt\": \"b\", \"num_inference_steps\": 3}\n",
    )
    .unwrap();
    let euler = ["--scheduler", "euler"];
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        (
            "wan-tiny-a",
            vec!["--sigmas", STEPS4],
            "add --scheduler euler",
        ),
        (
            "wan-tiny-a",
            [&euler[..], &["--sigmas", "1,0.5,0.75"]].concat(),
            "0.5 then 0.75",
        ),
        (
            "wan-tiny-a",
            [&euler[..], &["--sigmas", "1,0.5,0.5"]].concat(),
            "must fall",
        ),
        (
            "wan-tiny-a",
            [&euler[..], &["--sigmas", "1.5,0.5"]].concat(),
            "(0, 1]",
        ),
        (
            "wan-tiny-a",
            [&euler[..], &["--sigmas", "1,0"]].concat(),
            "(0, 1]",
        ),
        (
            "wan-tiny-a",
            [&euler[..], &["--sigmas", "1,x"]].concat(),
            "not a number",
        ),
        (
            "wan-tiny-a",
            [&euler[..], &["--sigmas", "1,nan"]].concat(),
            "finite",
        ),
        (
            "wan-tiny-a",
            [
                &euler[..],
                &["--sigmas", STEPS4, "--num-inference-steps", "8"],
            ]
            .concat(),
            "--num-inference-steps 8 but --sigmas gives 4 sigmas",
        ),
        (
            "ltx-video-tiny-a",
            [&euler[..], &["--sigmas", STEPS4]].concat(),
            "--sigmas does not apply",
        ),
    ];
    for (fixture, extra, says) in cases {
        let out = vidgen(fixture, &dir, None, &extra);
        let line = usage_error(&out, &format!("{fixture} {extra:?}"));
        assert!(line.contains(says), "{fixture} {extra:?}: {line}");
        assert!(!dir.join("v.safetensors").exists());
    }
    // A prompt-file line with its own step count: refused, naming the line.
    let out = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(["generate", "--model"])
        .arg(named_fixture_dir("wan-tiny-a"))
        .arg("--prompt-file")
        .arg(&lines)
        .args(["--scheduler", "euler", "--sigmas", STEPS4, "--quiet"])
        .args(["--height", "32", "--width", "32", "--num-frames", "9"])
        .args([
            "--device",
            "cpu",
            "--dtype",
            "f32",
            "--output-type",
            "safetensors",
        ])
        .arg("--output-path")
        .arg(&dir)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let line = usage_error(&out, "prompt-file line");
    assert!(
        line.contains("prompts.jsonl:2: num_inference_steps 3 but --sigmas gives 4"),
        "{line}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
