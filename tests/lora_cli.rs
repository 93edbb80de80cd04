//! LoRAs through the command line on the tiny Wan2.1 checkpoint, driven by the `cli_cases` of
//! `ecosystem-a/README.json` (diffusers 0.42.1's `load_lora_weights` + `set_adapters`): the
//! three key layouts and PEFT metadata at scale 1, a scale of 0.6, two LoRAs stacked; the frames
//! within 1e-4 + 1e-4|ref|. Bad LoRA input is refused in one line before anything loads.

mod common;

use candle_core::{Device, Tensor};
use common::{
    assert_close, generate_frames, max_abs_diff, named_fixture_dir, run_vidgen, scratch_dir,
    usage_error,
};
use std::path::{Path, PathBuf};

const FIXTURE: &str = "ecosystem-a";

/// The fixture's LoRA runs: (name, arguments with the LoRA paths made absolute, reference
/// tensor name).
fn lora_cases() -> Vec<(String, Vec<String>, String)> {
    let dir = named_fixture_dir(FIXTURE);
    let readme: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("README.json")).unwrap()).unwrap();
    readme["cli_cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["ref"] == "lora.safetensors")
        .map(|c| {
            let mut args: Vec<String> = Vec::new();
            let mut lora_next = false;
            for a in c["args"].as_array().unwrap() {
                let a = a.as_str().unwrap();
                args.push(if lora_next {
                    dir.join(a).to_str().unwrap().to_string()
                } else {
                    a.to_string()
                });
                lora_next = a == "--lora";
            }
            let name = c["name"].as_str().unwrap().to_string();
            (name, args, c["tensor"].as_str().unwrap().to_string())
        })
        .collect()
}

/// The draws file every LoRA run replays: `latents` = the reference's `latents_init`.
fn draws(dir: &Path, refs: &std::collections::HashMap<String, Tensor>) -> PathBuf {
    let path = dir.join("draws.safetensors");
    let draws =
        std::collections::HashMap::from([("latents".to_string(), refs["latents_init"].clone())]);
    candle_core::safetensors::save(&draws, &path).unwrap();
    path
}

/// `vidgen generate` on the tiny Wan2.1 checkpoint with the case's arguments; the frames.
fn generate(dir: &Path, draws: &Path, case_args: &[String]) -> Result<Tensor, String> {
    let model = named_fixture_dir("wan-tiny-a");
    let mut args = vec!["--model".to_string(), model.to_str().unwrap().to_string()];
    args.extend_from_slice(case_args);
    generate_frames(&args, draws, dir)
}

#[test]
fn loras_in_every_layout_reproduce_diffusers() {
    let dir = scratch_dir("lora", "parity");
    let refs = candle_core::safetensors::load(
        named_fixture_dir(FIXTURE).join("lora.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let draws = draws(&dir, &refs);
    let cases = lora_cases();
    assert!(cases.len() >= 6, "{} LoRA cases", cases.len());
    for (name, args, tensor) in &cases {
        let frames = generate(&dir, &draws, args).unwrap_or_else(|e| panic!("{name}: {e}"));
        let expected = refs[tensor].squeeze(0).unwrap();
        eprintln!(
            "{name}: max |diff| {:.3e}",
            max_abs_diff(&frames, &expected)
        );
        assert_close(name, &frames, &expected, 1e-4, 1e-4);
    }
    // Without the LoRA the frames are far from the reference: the LoRA is what matched.
    let (_, args, tensor) = &cases[0];
    let without: Vec<String> = args
        .iter()
        .enumerate()
        .filter(|(i, a)| *a != "--lora" && (*i == 0 || args[i - 1] != "--lora"))
        .map(|(_, a)| a.clone())
        .collect();
    let frames = generate(&dir, &draws, &without).unwrap();
    assert!(max_abs_diff(&frames, &refs[tensor].squeeze(0).unwrap()) > 0.05);
}

#[test]
fn bad_lora_input_is_refused_before_anything_loads() {
    let dir = scratch_dir("lora", "bad");
    let lora_dir = named_fixture_dir(FIXTURE).join("lora");
    let model = named_fixture_dir("wan-tiny-a");
    let run_with = |model: &Path, flag: &str, lora: &str| {
        run_vidgen(
            &[
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--prompt",
                "a cat",
                "--device",
                "cpu",
                "--num-frames",
                "5",
                "--height",
                "32",
                "--width",
                "32",
                "--output-path",
                dir.to_str().unwrap(),
                flag,
                lora,
            ]
            .map(String::from),
        )
    };
    let run = |model: &Path, lora: &str| run_with(model, "--lora", lora);
    // A LoRA whose up half is missing.
    let src =
        candle_core::safetensors::load(lora_dir.join("lora1.comfyui.safetensors"), &Device::Cpu)
            .unwrap();
    let half: std::collections::HashMap<String, Tensor> = src
        .iter()
        .filter(|(k, _)| !k.ends_with("blocks.1.ffn.2.lora_up.weight"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let half_path = dir.join("half.safetensors");
    candle_core::safetensors::save(&half, &half_path).unwrap();
    let line = usage_error(&run(&model, half_path.to_str().unwrap()), "missing half");
    assert!(
        line.contains("half.safetensors") && line.contains("lora_up"),
        "{line}"
    );
    // A LoRA for a layer the model does not have (a third block).
    let renamed: std::collections::HashMap<String, Tensor> = src
        .iter()
        .map(|(k, v)| (k.replace("blocks.1.", "blocks.7."), v.clone()))
        .collect();
    let other = dir.join("other.safetensors");
    candle_core::safetensors::save(&renamed, &other).unwrap();
    let line = usage_error(&run(&model, other.to_str().unwrap()), "other model");
    assert!(
        line.contains("blocks.7.") && line.contains("another model"),
        "{line}"
    );
    // Not a LoRA file at all, and a file that is not there.
    let line = usage_error(
        &run(&model, model.join("model_index.json").to_str().unwrap()),
        "not safetensors",
    );
    assert!(line.contains("model_index.json"), "{line}");
    usage_error(
        &run(&model, "/nonexistent/lora.safetensors:0.5"),
        "missing file",
    );
    // A second expert's LoRA for a model with one transformer.
    let lora2 = lora_dir.join("lora2.diffusers.safetensors");
    let line = usage_error(
        &run_with(&model, "--lora-2", lora2.to_str().unwrap()),
        "lora-2",
    );
    assert!(line.contains("--lora-2 does not apply"), "{line}");
    // A family whose LoRAs vidgen does not read.
    let cog = named_fixture_dir("cogvideox-tiny-a");
    let line = usage_error(
        &run(
            &cog,
            lora_dir
                .join("lora2.diffusers.safetensors")
                .to_str()
                .unwrap(),
        ),
        "cogvideox",
    );
    assert!(line.contains("--lora does not apply"), "{line}");
}
