//! LTX-Video through the command line, as PARITY-CLI.md drives a fixture: `ltx-video-tiny-a`'s
//! guided (CFG 3) and unguided runs with diffusers' draws from a draws file, every offload mode
//! bit-identical to the resident run (with `--fp8-matmul` too), the dry run on the fixture and
//! on `synthetic:ltx-video`, and the flags that do not apply refused.

mod common;

use candle_core::{Device, Tensor};
use common::{max_abs_diff, named_fixture_dir, reference_in, usage_error};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The README's pipeline tolerance for this fixture.
const ATOL: f64 = 1e-4;

fn fixture() -> PathBuf {
    named_fixture_dir("ltx-video-tiny-a")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-ltx-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn preset() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture().join("reference/README.json")).unwrap();
    serde_json::from_str::<serde_json::Value>(&text).unwrap()["preset"].clone()
}

/// The draws file of reference run `run` (`cfg3`, `cfg1`): `latents`, `decode_noise`,
/// `injected_noise.K`, the run's prefix removed.
fn draws_file(run: &str, dir: &Path) -> PathBuf {
    let r = reference_in(&fixture(), "pipeline");
    let mut draws: HashMap<String, Tensor> = HashMap::new();
    draws.insert("latents".into(), r["latents_init"].clone());
    draws.insert(
        "decode_noise".into(),
        r[&format!("{run}.decode_noise")].clone(),
    );
    for k in 0.. {
        match r.get(&format!("{run}.injected_noise.{k}")) {
            Some(t) => draws.insert(format!("injected_noise.{k}"), t.clone()),
            None => break,
        };
    }
    let path = dir.join(format!("{run}-draws.safetensors"));
    candle_core::safetensors::save(&draws, &path).unwrap();
    path
}

/// `vidgen generate` on the fixture with the reference call's settings and `extra` flags.
fn generate(dir: &Path, name: &str, guidance: &str, draws: &Path, extra: &[&str]) -> Output {
    parity_call(dir, name, guidance, draws)
        .arg("--quiet")
        .args(extra)
        .output()
        .unwrap()
}

/// The reference call with the fixture's prompt, writing `name` into `dir`.
fn parity_call(dir: &Path, name: &str, guidance: &str, draws: &Path) -> Command {
    let p = preset();
    let prompt = p["prompts"][p["pipeline_prompt_index"].as_u64().unwrap() as usize]
        .as_str()
        .unwrap()
        .to_string();
    let mut command = reference_call(guidance, draws);
    command.args(["--prompt", &prompt]).args([
        "--output-path",
        dir.to_str().unwrap(),
        "--output-video-name",
        name,
    ]);
    command
}

/// `vidgen generate` on the fixture with the reference call's settings but no prompt.
fn reference_call(guidance: &str, draws: &Path) -> Command {
    let p = preset();
    let num = |key: &str| p[key].to_string();
    let mut command = Command::new(env!("CARGO_BIN_EXE_vidgen"));
    command
        .args(["generate", "--model", fixture().to_str().unwrap()])
        .args(["--negative-prompt", p["negative_prompt"].as_str().unwrap()])
        .args(["--height", &num("height"), "--width", &num("width")])
        .args([
            "--num-frames",
            &num("num_frames"),
            "--num-inference-steps",
            "3",
        ])
        .args(["--guidance-scale", guidance])
        .args(["--max-sequence-length", &num("max_sequence_length")])
        .args(["--fps", &num("frame_rate")])
        .args(["--decode-timestep", &num("decode_timestep")])
        .args(["--decode-noise-scale", &num("decode_noise_scale")])
        .args(["--latents", draws.to_str().unwrap()])
        .args([
            "--device",
            "cpu",
            "--dtype",
            "f32",
            "--output-type",
            "safetensors",
        ])
        .env("HF_HUB_OFFLINE", "1");
    command
}

/// The frames a run wrote, `[F, H, W, 3]`.
fn frames(dir: &Path, name: &str, run: &Output) -> Tensor {
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let out = candle_core::safetensors::load(dir.join(format!("{name}.safetensors")), &Device::Cpu)
        .unwrap();
    out["frames"].clone()
}

fn parity(run: &str, guidance: &str) {
    let dir = scratch(run);
    let draws = draws_file(run, &dir);
    let got = frames(&dir, run, &generate(&dir, run, guidance, &draws, &[]));
    let r = reference_in(&fixture(), "pipeline");
    let want = r[&format!("{run}.frames")].squeeze(0).unwrap();
    assert_eq!(got.dims(), want.dims());
    let diff = max_abs_diff(&got, &want);
    println!("{run}.frames max |diff| {diff:e}");
    assert!(diff <= ATOL, "{run}.frames max |diff| {diff} > {ATOL}");
}

#[test]
fn guided_run_matches_diffusers() {
    parity("cfg3", "3");
}

#[test]
fn unguided_run_matches_diffusers() {
    parity("cfg1", "1");
}

/// The guided reference call with `draws` and `flags`, written into `dir` over any earlier run:
/// its frames and its log.
fn guided_run(dir: &Path, draws: &Path, flags: &[&str]) -> (Tensor, String) {
    let run = parity_call(dir, "mode", "3", draws)
        .arg("--overwrite")
        .args(flags)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&run.stderr).to_string();
    (frames(dir, "mode", &run), log)
}

/// Every offload mode gives the resident run's frames, bit for bit.
#[test]
fn offload_modes_are_bit_identical_to_resident() {
    let dir = scratch("offload");
    let draws = draws_file("cfg3", &dir);
    common::assert_offload_modes_bit_identical(&[], |flags| guided_run(&dir, &draws, flags));
}

/// `--fp8-matmul`: the blocks' Linears in e4m3 change the video by about e4m3's precision
/// (measured: 1.35% relative L2 of the frames), and every offload mode gives the resident fp8
/// run's frames bit for bit (each block's weight codes are made where it lands).
#[test]
fn fp8_matmuls_run_in_every_offload_mode() {
    let dir = scratch("fp8");
    let draws = draws_file("cfg3", &dir);
    common::assert_fp8_runs(0.018, |flags| guided_run(&dir, &draws, flags));
}

/// `--dry-run --json` of `model` with `extra` flags.
fn dry_run(model: &str, extra: &[&str]) -> serde_json::Value {
    common::dry_run_plan(model, &[&["--device", "cpu"][..], extra].concat())
}

fn check_plan(plan: &serde_json::Value) {
    assert_eq!(plan["pipeline"], "LTX-Video text-to-video");
    let stages: Vec<&str> = plan["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(stages, ["encode_text", "denoise", "decode", "write"]);
    for stage in plan["stages"].as_array().unwrap() {
        assert!(stage["memory"]["peak_bytes"].as_u64().is_some(), "{stage}");
    }
    assert!(plan["memory_plan"]["peak_bytes"].as_u64().unwrap() > 0);
}

#[test]
fn dry_run_plans_the_fixture_and_the_published_model() {
    let plan = dry_run(fixture().to_str().unwrap(), &[]);
    check_plan(&plan);
    // LTXPipeline's call defaults where the user gave none.
    let c = &plan["config"];
    assert_eq!(c["height"], 512);
    assert_eq!(c["width"], 704);
    assert_eq!(c["num_frames"], 161);
    assert_eq!(c["fps"], 25);
    assert_eq!(c["num_inference_steps"], 50);
    assert_eq!(c["guidance_scale"], 3.0);
    assert_eq!(c["max_sequence_length"], 128);

    let plan = dry_run("synthetic:ltx-video", &["--dtype", "bf16"]);
    check_plan(&plan);
    assert_eq!(plan["model"]["transformer_layers"], 28);
    assert_eq!(
        plan["model"]["latent_shape"],
        serde_json::json!([1, 128, 21, 16, 22])
    );
    // About 2 B transformer parameters and a 4.8 B T5 in bf16: well past 10 GB at the peak.
    let peak = plan["memory_plan"]["peak_bytes"].as_u64().unwrap();
    assert!(peak > 10_000_000_000 && peak < 100_000_000_000, "{peak}");
    // Given sizes replace the defaults; the user's value is kept.
    let plan = dry_run(
        "synthetic:ltx-video",
        &["--height", "512", "--width", "768", "--num-frames", "161"],
    );
    assert_eq!(plan["config"]["width"], 768);
    assert_eq!(
        plan["model"]["latent_shape"],
        serde_json::json!([1, 128, 21, 16, 24])
    );
    let streamed = dry_run(
        "synthetic:ltx-video",
        &[
            "--memory-model",
            "discrete",
            "--dit-layerwise-offload",
            "--offload-type",
            "leaf-level",
        ],
    );
    check_plan(&streamed);
    // Four steps of about a quarter block each: the copy stream runs three steps ahead (a
    // block's worth of steps on the device), past the cheap cross-attention step.
    let dit = &streamed["placement"]["dit"];
    assert_eq!(
        (&dit["by_step"], &dit["depth"]),
        (&true.into(), &3.into()),
        "{dit}"
    );
}

#[test]
fn flags_that_do_not_apply_are_refused() {
    let dir = scratch("refused");
    let draws = draws_file("cfg3", &dir);
    for flags in [
        &["--guidance-scale-2", "2"][..],
        &["--true-cfg-scale", "4"],
        &["--flow-shift", "3"],
        &["--scheduler", "unipc"],
    ] {
        let run = generate(&dir, "refused", "3", &draws, flags);
        let stderr = usage_error(&run, &format!("{flags:?}"));
        assert!(stderr.contains(flags[0]), "{flags:?}: {stderr}");
        assert!(stderr.contains("does not apply"), "{flags:?}: {stderr}");
    }
    // LTX-Video's sizes follow its VAE: 8k+1 frames, multiples of 32; one step's schedule ends
    // at sigma 1, which the scheduler's shift_terminal cannot stretch.
    let lines = dir.join("p.jsonl");
    std::fs::write(
        &lines,
        "{\"prompt\": \"a\"}\n{\"prompt\": \"b\", \"num_inference_steps\": 1}\n",
    )
    .unwrap();
    for (flags, rule) in [
        (&["--num-frames", "13"][..], "8k+1"),
        (&["--height", "48"], "multiple of 32"),
        (&["--num-inference-steps", "1"], "must be at least 2"),
        (
            &["--dry-run", "--num-inference-steps", "1"],
            "must be at least 2",
        ),
    ] {
        let run = generate(&dir, "refused", "3", &draws, flags);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(rule), "{flags:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{flags:?}: {stderr}");
    }
    // A prompt-file line's steps meet the same rule, before anything loads.
    let run = reference_call("3", &draws)
        .args(["--prompt-file", lines.to_str().unwrap(), "--quiet"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("p.jsonl:2"), "{stderr}");
    assert!(stderr.contains("must be at least 2"), "{stderr}");
    // A dry run refuses them too: every check comes before the work.
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(["generate", "--dry-run", "--device", "cpu", "--model"])
        .arg(fixture())
        .args(["--flow-shift", "3"])
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("--flow-shift"));
}

/// A video that decodes to NaN (NaN decode noise in the draws file) is a failed prompt, not a
/// blank video written as success: one error line per prompt, exit 1, no file and no temporary
/// left, and the batch goes on to the next prompt; the stats say why.
#[test]
fn a_video_that_decodes_to_nan_fails_its_prompt_and_writes_nothing() {
    let dir = scratch("nan-decode");
    let draws = draws_file("cfg1", &dir);
    let mut tensors = candle_core::safetensors::load(&draws, &Device::Cpu).unwrap();
    let dims = tensors["decode_noise"].dims().to_vec();
    let nan = Tensor::full(f32::NAN, dims, &Device::Cpu).unwrap();
    tensors.insert("decode_noise".into(), nan);
    candle_core::safetensors::save(&tensors, &draws).unwrap();
    let prompts = dir.join("prompts.txt");
    std::fs::write(&prompts, "a red car\na blue car\n").unwrap();
    let (out, stats) = (dir.join("out"), dir.join("stats.json"));
    let run = reference_call("1", &draws)
        .args(["--prompt-file", prompts.to_str().unwrap()])
        .args(["--output-path", out.to_str().unwrap()])
        .args(["--stats-json", stats.to_str().unwrap(), "--quiet"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        run.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&run.stdout)
    );
    let failures: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("the decoded video became NaN or infinite"))
        .collect();
    assert_eq!(failures.len(), 2, "one line per prompt: {stderr}");
    let left: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
    assert!(left.is_empty(), "nothing written, no temporary: {left:?}");
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    for job in stats["jobs"].as_array().unwrap() {
        assert_eq!(job["status"], "failed", "{job}");
        let error = job["error"].as_str().unwrap();
        assert!(
            error.contains("--decode-noise-scale"),
            "names the fix: {error}"
        );
        let stages: Vec<&str> = job["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["name"].as_str().unwrap())
            .collect();
        assert_eq!(stages, ["encode_text", "denoise", "decode"], "{job}");
    }
}

/// Every draw the run takes from `--latents` whose shape the sizes fix is checked before
/// anything loads, in a run and a dry run: the decoder's `decode_noise` too, not only at decode.
#[test]
fn the_decode_noise_draw_is_checked_before_anything_loads() {
    let dir = scratch("draws-checked");
    let draws = draws_file("cfg1", &dir);
    let tensors = candle_core::safetensors::load(&draws, &Device::Cpu).unwrap();
    let noise = &tensors["decode_noise"];
    let mut wrong = tensors.clone();
    wrong.insert("decode_noise".into(), noise.narrow(2, 0, 1).unwrap());
    let mut missing = tensors.clone();
    missing.remove("decode_noise");
    for (name, files, says) in [
        ("wrong", wrong, "holds decode_noise of shape"),
        ("missing", missing, "no tensor named `decode_noise`"),
    ] {
        let path = dir.join(format!("{name}-draws.safetensors"));
        candle_core::safetensors::save(&files, &path).unwrap();
        for extra in [&[][..], &["--dry-run"][..]] {
            let run = generate(&dir, name, "1", &path, extra);
            let stderr = String::from_utf8_lossy(&run.stderr);
            assert_eq!(run.status.code(), Some(2), "{name} {extra:?}: {stderr}");
            assert!(stderr.contains(says), "{name} {extra:?}: {stderr}");
            assert_eq!(stderr.lines().count(), 1, "{name} {extra:?}: {stderr}");
        }
    }
}
