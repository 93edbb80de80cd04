//! Helpers shared by the tests: fixture paths, tolerance checks, the usage-error check.
#![allow(dead_code)]

pub mod heap;

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The tiny diffusers checkpoint with its reference outputs.
pub fn fixture_dir() -> PathBuf {
    named_fixture_dir("wan-tiny-a")
}

/// `tests/fixtures/<name>`: another family's fixture folder (e.g. `ltx-video-tiny-a`).
pub fn named_fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Loads one of the `reference/*.safetensors` files onto the CPU.
pub fn reference(name: &str) -> HashMap<String, Tensor> {
    reference_in(&fixture_dir(), name)
}

/// Loads `reference/<name>.safetensors` of the fixture folder `dir` onto the CPU.
pub fn reference_in(dir: &std::path::Path, name: &str) -> HashMap<String, Tensor> {
    let path = dir.join("reference").join(format!("{name}.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

/// Loads `reference/<name>.safetensors` of fixture folder `fixture` onto the CPU.
pub fn named_reference(fixture: &str, name: &str) -> HashMap<String, Tensor> {
    reference_in(&named_fixture_dir(fixture), name)
}

/// Reads and parses `<fixture>/<relative path>` (a config.json).
pub fn config_in<T: serde::de::DeserializeOwned>(fixture: &str, relative: &str) -> T {
    let path = named_fixture_dir(fixture).join(relative);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// An f32 CPU `VarBuilder` over `<fixture>/<relative path>` (a safetensors file).
pub fn var_builder_in(fixture: &str, relative: &str) -> candle_nn::VarBuilder<'static> {
    let path = named_fixture_dir(fixture).join(relative);
    unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(
            &[path],
            candle_core::DType::F32,
            &Device::Cpu,
        )
        .unwrap()
    }
}

/// max |a - b| over all elements.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_dtype(candle_core::DType::F64).unwrap() - b.to_dtype(candle_core::DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Asserts |actual - expected| <= atol + rtol * |expected| elementwise (the fixture README's rule).
pub fn assert_close(what: &str, actual: &Tensor, expected: &Tensor, atol: f64, rtol: f64) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    let values = |t: &Tensor| -> Vec<f64> {
        t.to_dtype(candle_core::DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
    };
    let (a, e) = (values(actual), values(expected));
    let max_diff = a
        .iter()
        .zip(&e)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    eprintln!("{what}: max |diff| {max_diff:.3e}");
    let mut worst = (0.0f64, 0usize);
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        let excess = (x - y).abs() - (atol + rtol * y.abs());
        if excess.is_nan() || excess > worst.0 {
            worst = (
                if excess.is_nan() {
                    f64::INFINITY
                } else {
                    excess
                },
                i,
            );
        }
    }
    assert!(
        worst.0 <= 0.0,
        "{what}: element {} is {} but the reference is {} (atol {atol}, rtol {rtol})",
        worst.1,
        a[worst.1],
        e[worst.1]
    );
}

/// Asserts that `frames` a run wrote match the fixture's pipeline reference `{run}.frames`
/// within `atol + rtol·|ref|`, printing the largest difference.
pub fn assert_reference_run(fixture: &str, run: &str, frames: &Tensor, (atol, rtol): (f64, f64)) {
    let name = format!("{run}.frames");
    let expected = named_reference(fixture, "pipeline")[&name]
        .squeeze(0)
        .unwrap();
    eprintln!("{name}: max |diff| {:.3e}", max_abs_diff(frames, &expected));
    assert_close(&name, frames, &expected, atol, rtol);
}

/// Asserts that a run failed as bad input (exit 2) with one line on stderr, and returns that
/// line; `what` names the case in the failure message.
pub fn usage_error(out: &std::process::Output, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{what}: {stderr}");
    stderr
}

/// Runs `vidgen generate ARGS --latents DRAWS` on the CPU in f32, writing safetensors into
/// `dir`: the frames written, or stderr where the run failed.
pub fn generate_frames(
    args: &[String],
    draws: &std::path::Path,
    dir: &std::path::Path,
) -> Result<Tensor, String> {
    Ok(generate_outputs(args, draws, dir)?["frames"].clone())
}

/// [`generate_frames`] with the run's log, for [`assert_offload_modes_bit_identical`]; a failed
/// run panics with its stderr.
pub fn generate_frames_logged(
    args: &[String],
    draws: &std::path::Path,
    dir: &std::path::Path,
) -> (Tensor, String) {
    let args = with_draws(args, draws);
    let (written, log) =
        generate_logged(&args, dir).unwrap_or_else(|stderr| panic!("{args:?}: {stderr}"));
    (written["frames"].clone(), log)
}

/// `args` with `--latents DRAWS`.
fn with_draws(args: &[String], draws: &std::path::Path) -> Vec<String> {
    let mut args = args.to_vec();
    args.extend(["--latents".to_string(), draws.to_str().unwrap().to_string()]);
    args
}

/// [`generate_frames`], giving every tensor of the written file.
pub fn generate_outputs(
    args: &[String],
    draws: &std::path::Path,
    dir: &std::path::Path,
) -> Result<std::collections::HashMap<String, Tensor>, String> {
    generate_written(&with_draws(args, draws), dir)
}

/// Runs `vidgen generate ARGS` on the CPU in f32, writing safetensors into `dir`: every tensor
/// of the written file, or stderr where the run failed.
pub fn generate_written(
    args: &[String],
    dir: &std::path::Path,
) -> Result<std::collections::HashMap<String, Tensor>, String> {
    Ok(generate_logged(args, dir)?.0)
}

/// [`generate_written`], with the run's log (stderr).
pub fn generate_logged(
    args: &[String],
    dir: &std::path::Path,
) -> Result<(std::collections::HashMap<String, Tensor>, String), String> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .arg("generate")
        .args(args)
        .args([
            "--device",
            "cpu",
            "--dtype",
            "f32",
            "--output-type",
            "safetensors",
        ])
        .args(["--output-path".as_ref(), dir.as_os_str()])
        .args(["--output-video-name", "v", "--overwrite"])
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).to_string());
    }
    let written = dir.join("v.safetensors");
    Ok((
        candle_core::safetensors::load(&written, &Device::Cpu).unwrap(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    ))
}

/// The published model's plan streamed in bf16 on the CPU: what each family's dry-run test plans
/// beside the CPU's defaults.
pub const STREAMED_BF16: &[&str] = &[
    "--device",
    "cpu",
    "--dit-layerwise-offload",
    "--dtype",
    "bf16",
];

/// The flags that keep every component resident under a discrete device's rules: the run each
/// of [`OFFLOAD_MODES`] must reproduce bit for bit.
pub const RESIDENT: &[&str] = &[
    "--memory-model",
    "discrete",
    "--no-dit-layerwise-offload",
    "--no-dit-cpu-offload",
    "--no-text-encoder-cpu-offload",
    "--no-vae-cpu-offload",
];

/// Every way of placing a pipeline's components, each with what the run's log then says of a
/// placement: block level with one and with eight blocks a group, with and without the copy
/// stream, with a deeper prefetch and under a pinned-memory cap; leaf level; the text encoder
/// and the VAE offloaded; model offload; sequential offload; lazy loading; unified memory's
/// rules (host offload off, components loaded in turn).
pub const OFFLOAD_MODES: &[(&[&str], &str)] = &[
    (
        &["--dit-layerwise-offload", "--offload-type", "leaf-level"],
        "transformer: streamed",
    ),
    (
        &["--dit-layerwise-offload", "--num-blocks-per-group", "1"],
        "transformer: streamed",
    ),
    (
        &["--dit-layerwise-offload", "--num-blocks-per-group", "8"],
        "transformer: streamed",
    ),
    (
        &[
            "--dit-layerwise-offload",
            "--num-blocks-per-group",
            "1",
            "--no-offload-stream",
        ],
        "transformer: streamed",
    ),
    (
        &[
            "--dit-layerwise-offload",
            "--num-blocks-per-group",
            "8",
            "--no-offload-stream",
        ],
        "transformer: streamed",
    ),
    (
        &[
            "--dit-layerwise-offload",
            "--num-blocks-per-group",
            "2",
            "--prefetch-depth",
            "2",
        ],
        "transformer: streamed",
    ),
    (
        &["--dit-layerwise-offload", "--max-pinned-memory", "1MiB"],
        "transformer: streamed",
    ),
    (
        &["--text-encoder-cpu-offload", "--vae-cpu-offload"],
        "text_encoder: streamed",
    ),
    (&["--model-cpu-offload"], "transformer: parked"),
    (&["--sequential-cpu-offload"], "transformer: streamed"),
    (&["--lazy-module-load"], "transformer"),
    (&["--memory-model", "unified"], "transformer: resident"),
];

/// Asserts that each of [`OFFLOAD_MODES`] and `more` reproduces the [`RESIDENT`] run's output
/// bit for bit, placed as its log says. `generate(flags)` is a family's parity run with `flags`
/// added: its output and its log. A mode runs under a discrete device's rules unless it names
/// its memory model: on the CPU the device rules turn offloading off, the discrete model keeps
/// it, so every mode really moves weights.
pub fn assert_offload_modes_bit_identical(
    more: &[(&[&str], &str)],
    generate: impl Fn(&[&str]) -> (Tensor, String),
) {
    let (resident, log) = generate(RESIDENT);
    assert!(log.contains("transformer: resident"), "{log}");
    for (flags, placed) in OFFLOAD_MODES.iter().chain(more) {
        let mut args = flags.to_vec();
        if !flags.contains(&"--memory-model") {
            args.splice(0..0, ["--memory-model", "discrete"]);
        }
        let (output, log) = generate(&args);
        assert!(log.contains(placed), "{flags:?}: {log}");
        assert_eq!(
            max_abs_diff(&output, &resident),
            0.0,
            "{flags:?} differs from the resident run"
        );
    }
}

/// `--fp8-matmul` through `generate` (a run of a family's fixture with extra flags: its frames
/// and log): the frames move from the exact run's, by at most `bound` (relative L2, printed), the
/// log counts the fp8 products, and every offload mode gives the resident fp8 run's frames bit
/// for bit (each block's weight codes are made where it lands).
pub fn assert_fp8_runs(bound: f32, generate: impl Fn(&[&str]) -> (Tensor, String)) {
    let (exact, _) = generate(&[]);
    let (fp8, log) = generate(&["--fp8-matmul"]);
    let err = relative_l2(&fp8, &exact);
    eprintln!("fp8 frames: relative L2 {err:.3e}");
    assert!(err > 0.0 && err <= bound, "relative L2 {err}");
    assert!(log.contains("fp8 matmuls"), "{log}");
    assert_offload_modes_bit_identical(&[], |flags| generate(&[flags, &["--fp8-matmul"]].concat()));
}

/// Asserts that `plan` (a `--dry-run --json` plan) calls the pipeline with each `config` value
/// of `expected` (a JSON object) and plans every stage of a run without an error.
pub fn assert_planned_call(plan: &serde_json::Value, expected: &serde_json::Value) {
    let text = plan.to_string();
    for (key, value) in expected.as_object().unwrap() {
        assert_eq!(&plan["config"][key], value, "{key}: {text}");
    }
    let stages: Vec<&str> = plan["stages"]
        .as_array()
        .unwrap_or_else(|| panic!("no stages: {text}"))
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        stages,
        ["encode_text", "denoise", "decode", "write"],
        "{text}"
    );
    assert!(!text.contains("\"error\""), "{text}");
}

/// Asserts that `vidgen generate --model MODEL --prompt a --device cpu --output-path DIR FLAGS`
/// is refused as bad input before any work, with and without `--dry-run`: exit 2, one line on
/// stderr, naming each of `says`.
pub fn assert_refused(model: &Path, dir: &Path, flags: &[&str], says: &[&str]) {
    for dry in [false, true] {
        let mut args = vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "a",
            "--device",
            "cpu",
            "--output-path",
            dir.to_str().unwrap(),
        ];
        args.extend_from_slice(flags);
        if dry {
            args.push("--dry-run");
        }
        let line = usage_error(&vidgen(&args), &format!("{flags:?}"));
        for said in says {
            assert!(line.contains(said), "{flags:?} (dry run: {dry}): {line}");
        }
    }
}

/// A fresh scratch folder for test `name` of `suite`, unique to this process.
pub fn scratch_dir(suite: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-{suite}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the vidgen binary with `args` (no network).
pub fn run_vidgen(args: &[String]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap()
}

/// `vidgen ARGS`, offline.
pub fn vidgen(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap()
}

/// The plan of `vidgen generate --model MODEL --dry-run --json EXTRA`, which must succeed.
pub fn dry_run_plan(model: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["generate", "--model", model, "--dry-run", "--json"];
    args.extend_from_slice(extra);
    let out = vidgen(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "dry run of {model} failed: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `generate --model FIXTURE --prompt "a cat" --device cpu`: a one-prompt CPU run of `fixture`.
pub fn cpu_prompt_args(fixture: &str) -> Vec<String> {
    [
        "generate",
        "--model",
        named_fixture_dir(fixture).to_str().unwrap(),
        "--prompt",
        "a cat",
        "--device",
        "cpu",
    ]
    .map(String::from)
    .to_vec()
}

/// The activation bytes the dry-run plan of a one-prompt CPU run of `fixture` predicts for its
/// denoise stage, with `extra` flags.
pub fn planned_denoise_activations(fixture: &str, extra: &[&str]) -> u64 {
    let mut args = cpu_prompt_args(fixture);
    args.extend(
        ["--dry-run", "--json"]
            .iter()
            .chain(extra)
            .map(|s| s.to_string()),
    );
    let out = run_vidgen(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{fixture}: {stderr}");
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let stage = plan["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "denoise")
        .unwrap();
    stage["memory"]["activation_bytes"].as_u64().unwrap()
}

/// A `[seq, D/2]` RoPE pair table in diffusers' repeat-interleaved `[seq, D]` layout.
pub fn interleave_pairs(t: &Tensor) -> Tensor {
    let (seq, half) = t.dims2().unwrap();
    t.unsqueeze(2)
        .unwrap()
        .broadcast_as((seq, half, 2))
        .unwrap()
        .reshape((seq, 2 * half))
        .unwrap()
}

/// Deterministic values in [-1, 1] of `shape` on the CPU (`sin` of a ramp, `seed` its phase).
pub fn values(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f64 * 0.618_034 + seed as f64).sin()) as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// ‖a − b‖ / ‖b‖ over all elements, in f32.
pub fn relative_l2(a: &Tensor, b: &Tensor) -> f32 {
    let f = |t: &Tensor| {
        t.to_dtype(candle_core::DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
    };
    let (a, b) = (f(a), f(b));
    let norm = |t: &Tensor| t.sqr().unwrap().sum_all().unwrap().sqrt().unwrap();
    let num = norm(&(&a - &b).unwrap()).to_scalar::<f32>().unwrap();
    num / norm(&b).to_scalar::<f32>().unwrap()
}

/// The tiny Wan checkpoint's reference call through the command line (its prompt, 32x32x9, three
/// steps with classifier-free guidance) and the draws file of its initial latents, written into
/// `dir`: the arguments for [`generate_frames`] and the draws.
pub fn wan_tiny_reference_call(dir: &std::path::Path) -> (Vec<String>, PathBuf) {
    let fixture = named_fixture_dir("wan-tiny-a");
    let refs = candle_core::safetensors::load(
        fixture.join("reference/pipeline.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let draws = dir.join("draws.safetensors");
    let latents = HashMap::from([("latents".to_string(), refs["latents_init"].clone())]);
    candle_core::safetensors::save(&latents, &draws).unwrap();
    let args = [
        "--model",
        fixture.to_str().unwrap(),
        "--prompt",
        "A red car drives along a coastal road.",
        "--height",
        "32",
        "--width",
        "32",
        "--num-frames",
        "9",
        "--num-inference-steps",
        "3",
        "--max-sequence-length",
        "20",
    ]
    .map(String::from)
    .to_vec();
    (args, draws)
}

/// The `--latents` draws file of a fixture case (`cli_cases` of a references README.json): each reference tensor its `draws` names (`N`, `K`: every step and
/// draw the fixture's pipeline reference holds) under its draw name.
pub fn draws_file(case: &serde_json::Value, refs: &HashMap<String, Tensor>, dir: &Path) -> PathBuf {
    let mut draws = HashMap::new();
    for (from, to) in case["draws"].as_object().unwrap() {
        let to = to.as_str().unwrap();
        let pattern = regex::Regex::new(&format!(
            "^{}$",
            regex::escape(from).replace(['N', 'K'], "(\\d+)")
        ))
        .unwrap();
        let mut found = 0;
        for (name, tensor) in refs {
            let Some(captures) = pattern.captures(name) else {
                continue;
            };
            let mut numbers = captures.iter().skip(1).map(|c| c.unwrap().as_str());
            let mut draw = String::new();
            for c in to.chars() {
                match c {
                    'N' | 'K' => draw.push_str(numbers.next().unwrap()),
                    c => draw.push(c),
                }
            }
            draws.insert(draw, tensor.clone());
            found += 1;
        }
        assert!(found > 0, "{}: no reference tensor {from}", case["name"]);
    }
    let path = dir.join("draws.safetensors");
    candle_core::safetensors::save(&draws, &path).unwrap();
    path
}

/// A JSON array of strings (a case's `args`) as strings.
pub fn strings(value: &serde_json::Value) -> Vec<String> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// Runs a fixture case of a references README.json (`cli_cases`: its `args` and `draws` from
/// `fixture`'s `reference/pipeline.safetensors`) through `vidgen generate --model FIXTURE` with
/// `extra` flags, on the CPU in f32, in `dir`: every tensor of the written file.
pub fn run_reference_case(
    case: &serde_json::Value,
    fixture: &str,
    extra: &[String],
    dir: &Path,
) -> HashMap<String, Tensor> {
    let fixture = named_fixture_dir(fixture);
    let pipeline = candle_core::safetensors::load(
        fixture.join("reference/pipeline.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let draws = draws_file(case, &pipeline, dir);
    let mut args = vec!["--model".to_string(), fixture.to_str().unwrap().to_string()];
    args.extend(strings(&case["args"]));
    args.extend_from_slice(extra);
    generate_outputs(&args, &draws, dir).unwrap_or_else(|stderr| panic!("{case}: {stderr}"))
}

/// A references folder's `README.json` and its reference tensors file `file`.
pub fn references(name: &str, file: &str) -> (serde_json::Value, HashMap<String, Tensor>) {
    let dir = named_fixture_dir(name);
    let readme = serde_json::from_slice(&std::fs::read(dir.join("README.json")).unwrap()).unwrap();
    let refs = candle_core::safetensors::load(dir.join(file), &Device::Cpu).unwrap();
    (readme, refs)
}

/// Runs `case` ([`run_reference_case`] with `extra`, in a scratch folder of `suite`) and checks
/// its frames against `refs[case.frames]` (1e-4 + 1e-4|ref|), and that those differ from the
/// fixture's own reference frames `case[baseline]` (by more than 1e-3: a run that ignored what
/// the case changes fails).
pub fn check_reference_frames(
    case: &serde_json::Value,
    refs: &HashMap<String, Tensor>,
    extra: &[String],
    (suite, baseline): (&str, &str),
) {
    let name = case["name"].as_str().unwrap();
    let fixture = case["fixture"].as_str().unwrap();
    let out = scratch_dir(suite, name);
    let frames = run_reference_case(case, fixture, extra, &out)["frames"].clone();
    let want = refs[case["frames"].as_str().unwrap()].squeeze(0).unwrap();
    assert_close(name, &frames, &want, 1e-4, 1e-4);
    let plain = named_reference(fixture, "pipeline")[case[baseline].as_str().unwrap()]
        .squeeze(0)
        .unwrap();
    let moved = max_abs_diff(&want, &plain);
    assert!(moved > 1e-3, "{name}: the case moves frames {moved:.2e}");
}
