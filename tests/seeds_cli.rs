//! `--seed S` without `--latents` reproduces diffusers' `WanPipeline` called with
//! `generator=torch.Generator("cpu").manual_seed(S)` on the tiny Wan2.1 checkpoint
//! (`ecosystem-a/seeds.safetensors`, the runs of `cli_cases` in its README.json).

mod common;

use candle_core::{Device, Tensor};
use common::{assert_close, fixture_dir, named_fixture_dir};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn readme() -> serde_json::Value {
    let path = named_fixture_dir("ecosystem-a").join("README.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn seeds() -> HashMap<String, Tensor> {
    let path = named_fixture_dir("ecosystem-a").join("seeds.safetensors");
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-seeds-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `vidgen generate` on the fixture's model with `args`, on the CPU in f32, writing
/// safetensors frames into `dir`; returns stdout's paths.
fn generate(dir: &Path, args: &[String]) -> Vec<PathBuf> {
    let out = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(["generate", "--model", fixture_dir().to_str().unwrap()])
        .args(args)
        .args([
            "--device",
            "cpu",
            "--dtype",
            "f32",
            "--output-type",
            "safetensors",
        ])
        .args(["--output-path", dir.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "vidgen failed: {stderr}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(PathBuf::from)
        .collect()
}

fn frames(path: &Path) -> Tensor {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()["frames"].clone()
}

#[test]
fn seeds_give_diffusers_frames() {
    let refs = seeds();
    let readme = readme();
    let cases: Vec<&serde_json::Value> = readme["cli_cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["ref"] == "seeds.safetensors")
        .collect();
    assert_eq!(cases.len(), 6, "seeds 0, 2^32 + 7, 42 at CFG 5 and 1");
    let dir = scratch("cases");
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut args = common::strings(&case["args"]);
        assert!(!args.iter().any(|a| a == "--latents"));
        args.extend(["--output-video-name".into(), name.into()]);
        let written = generate(&dir, &args);
        assert_eq!(written, [dir.join(format!("{name}.safetensors"))]);
        let expected = refs[case["tensor"].as_str().unwrap()].squeeze(0).unwrap();
        assert_close(name, &frames(&written[0]), &expected, 1e-4, 1e-4);
    }
}

/// diffusers' batch of two prompts draws both latents from one generator; vidgen gives each
/// prompt of a file its own generator (prompt i: seed `--seed` + i - 1), so the file's first
/// video is the batch's first (the second is seed 1's, not the batch's second draw).
#[test]
fn a_prompt_files_first_video_is_diffusers_batchs_first() {
    let readme = readme();
    let prompts = &readme["files"]["seeds.safetensors"]["batch_prompts"];
    let case = &readme["cli_cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "seed0.cfg5")
        .unwrap()["args"];
    let flag = |name: &str| {
        let args = case.as_array().unwrap();
        let at = args.iter().position(|a| a == name).unwrap();
        args[at + 1].as_str().unwrap().to_string()
    };
    let dir = scratch("batch");
    let file = dir.join("prompts.jsonl");
    let lines: Vec<String> = prompts
        .as_array()
        .unwrap()
        .iter()
        .map(|p| serde_json::json!({ "prompt": p }).to_string())
        .collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let mut args = vec!["--prompt-file".to_string(), file.display().to_string()];
    for name in [
        "--negative-prompt",
        "--height",
        "--width",
        "--num-frames",
        "--num-inference-steps",
        "--max-sequence-length",
        "--guidance-scale",
        "--seed",
    ] {
        args.extend([name.to_string(), flag(name)]);
    }
    let written = generate(&dir, &args);
    assert_eq!(written.len(), 2);
    assert!(written[0]
        .to_str()
        .unwrap()
        .ends_with("_001_seed0.safetensors"));
    let expected = seeds()["batch.frames"].get(0).unwrap();
    assert_close("batch video 0", &frames(&written[0]), &expected, 1e-4, 1e-4);
}
