//! A stage that runs out of device memory part-way (another process took memory after the plan):
//! every component is freed, the stage runs once more from the same state with a leaner option
//! set, and if that fails too the prompt fails alone. The failures are injected on the CPU with
//! `VIDGEN_INJECT_OOM=STAGE[:N]` (the stage fails its first N runs with CUDA's error text).

use candle_core::{Device, Tensor};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A scratch folder of this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-oom-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Two prompts of the tiny synthetic Wan on the CPU, planned for a discrete GPU (so leaner
/// option sets exist), written into `out`, with `VIDGEN_INJECT_OOM` set to `inject`.
fn run(out: &Path, inject: Option<&str>) -> Output {
    let prompts = out.join("p.txt");
    std::fs::write(&prompts, "a fox\na cat\n").unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_vidgen"));
    command
        .args([
            "generate",
            "--model",
            "synthetic:wan2.1-tiny",
            "--device",
            "cpu",
        ])
        .args([
            "--memory-model",
            "discrete",
            "--seed",
            "1",
            "--num-frames",
            "5",
        ])
        .args([
            "--height",
            "32",
            "--width",
            "32",
            "--num-inference-steps",
            "2",
        ])
        .args([
            "--max-sequence-length",
            "16",
            "--output-type",
            "safetensors",
        ])
        .arg("--prompt-file")
        .arg(&prompts)
        .arg("--output-path")
        .arg(out)
        .arg("--stats-json")
        .arg(out.join("stats.json"))
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("VIDGEN_INJECT_OOM");
    if let Some(inject) = inject {
        command.env("VIDGEN_INJECT_OOM", inject);
    }
    command.output().unwrap()
}

fn frames(path: &Path) -> Tensor {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .remove("frames")
        .unwrap()
}

fn stats(out: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("stats.json")).unwrap()).unwrap()
}

/// Out of memory once in any stage that uses a model: the stage runs again with the first leaner
/// set (said on stderr, recorded in the prompt's metrics) and the videos are those of a run
/// that never ran out of memory (every offload mode computes the same).
#[test]
fn a_stage_out_of_memory_once_runs_again_with_a_leaner_set() {
    let clean = scratch("clean");
    let done = run(&clean, None);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    for stage in ["encode_text", "denoise", "decode"] {
        let out = scratch(stage);
        let retried = run(&out, Some(stage));
        let stderr = String::from_utf8_lossy(&retried.stderr);
        assert!(retried.status.success(), "{stage}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "out of device memory in stage {stage}; retrying once with --"
            )),
            "{stderr}"
        );
        for name in ["a-fox_001_seed1.safetensors", "a-cat_002_seed2.safetensors"] {
            let (want, got) = (frames(&clean.join(name)), frames(&out.join(name)));
            let diff = (want - got).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{stage}: {name}");
        }
        let json = stats(&out);
        let retry = &json["jobs"][0]["metrics"]["out_of_memory_retry"];
        assert_eq!(retry["stage"], stage, "{json}");
        assert!(!retry["with"].as_array().unwrap().is_empty(), "{retry}");
        assert!(
            retry["error"]
                .as_str()
                .unwrap()
                .contains("CUDA_ERROR_OUT_OF_MEMORY"),
            "{retry}"
        );
        assert!(json["jobs"][1]["metrics"]
            .get("out_of_memory_retry")
            .is_none());
    }
}

/// Out of memory while loading a component beside the first stage: it loads again before its
/// own stage, and out of memory there, every other component is freed and the load runs again
/// with a leaner set; the videos are the same.
#[test]
fn a_load_out_of_memory_once_loads_again_with_a_leaner_set() {
    let clean = scratch("load-clean");
    assert!(run(&clean, None).status.success());
    let out = scratch("load");
    let retried = run(&out, Some("transformer:2"));
    let stderr = String::from_utf8_lossy(&retried.stderr);
    assert!(retried.status.success(), "{stderr}");
    assert!(
        stderr.contains("transformer did not load beside encode_text ("),
        "{stderr}"
    );
    assert!(
        stderr.contains("out of device memory while loading transformer; retrying once with --"),
        "{stderr}"
    );
    for name in ["a-fox_001_seed1.safetensors", "a-cat_002_seed2.safetensors"] {
        let (want, got) = (frames(&clean.join(name)), frames(&out.join(name)));
        let diff = (want - got).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{name}");
    }
}

/// Out of memory again in the retry: that prompt fails alone with one line, leaves no file or
/// temporary, and the next prompt is written.
#[test]
fn a_stage_out_of_memory_twice_fails_its_prompt_alone() {
    let out = scratch("twice");
    let failed = run(&out, Some("denoise:2"));
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert_eq!(failed.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].contains("p.txt:1"), "{}", errors[0]);
    assert!(
        errors[0].contains("out of device memory in stage denoise"),
        "{}",
        errors[0]
    );
    assert!(!stderr.contains("stack backtrace"), "{stderr}");
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        ["a-cat_002_seed2.safetensors", "p.txt", "stats.json"]
    );
    let json = stats(&out);
    assert_eq!(json["jobs"][0]["status"], "failed");
    assert_eq!(json["jobs"][1]["status"], "written");
}
