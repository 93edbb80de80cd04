//! LoRAs through the command line on the tiny Wan2.1 checkpoint, driven by the `cli_cases` of
//! `ecosystem-a/README.json` (diffusers 0.42.1's `load_lora_weights` + `set_adapters`): the
//! three key layouts and PEFT metadata at scale 1, a scale of 0.6, two LoRAs stacked; and on the
//! tiny Wan2.2 A14B checkpoint, `--lora-2` on its second expert alone and with `--lora` on the
//! first (`wan22-a14b-lora2/README.json`); the frames within 1e-4 + 1e-4|ref|. Bad LoRA input is
//! refused in one line before anything loads.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{
    assert_close, generate_frames, max_abs_diff, named_fixture_dir, named_reference, run_vidgen,
    scratch_dir, usage_error,
};
use std::path::{Path, PathBuf};

const FIXTURE: &str = "ecosystem-a";
/// The LoRA references of Wan2.2 A14B's two experts, made by its `make.py`.
const A14B_FIXTURE: &str = "wan22-a14b-lora2";

/// The LoRA runs of the LoRA fixture `fixture`: (name, arguments with the LoRA paths made
/// absolute, reference tensor name).
fn lora_cases(fixture: &str) -> Vec<(String, Vec<String>, String)> {
    let dir = named_fixture_dir(fixture);
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
                lora_next = a == "--lora" || a == "--lora-2";
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

/// `vidgen generate` on the tiny checkpoint `model` with the case's arguments; the frames.
fn generate(model: &str, dir: &Path, draws: &Path, case_args: &[String]) -> Result<Tensor, String> {
    let model = named_fixture_dir(model);
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
    let cases = lora_cases(FIXTURE);
    assert!(cases.len() >= 6, "{} LoRA cases", cases.len());
    for (name, args, tensor) in &cases {
        let frames =
            generate("wan-tiny-a", &dir, &draws, args).unwrap_or_else(|e| panic!("{name}: {e}"));
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
    let frames = generate("wan-tiny-a", &dir, &draws, &without).unwrap();
    assert!(max_abs_diff(&frames, &refs[tensor].squeeze(0).unwrap()) > 0.05);
}

/// Wan LoRAs under the original names with PEFT's halves (`diffusion_model.blocks.N.self_attn.q.
/// lora_A.weight`, diffusion-pipe's layout), with alphas and bias deltas (`diff_b`) on every module
/// and modules outside the blocks, as diffusers' Wan conversion reads them
/// (`wan-loras/README.json`, ecosystem-a's call and latents), at scales 1 and 0.7.
#[test]
fn original_names_with_peft_halves_reproduce_diffusers() {
    let dir = scratch_dir("lora", "original-peft");
    let ecosystem = candle_core::safetensors::load(
        named_fixture_dir(FIXTURE).join("lora.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let draws = draws(&dir, &ecosystem);
    let (readme, refs) = common::references("wan-loras", "reference.safetensors");
    let cases = readme["cli_cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let lora = named_fixture_dir("wan-loras").join(case["lora"].as_str().unwrap());
        let mut args = common::strings(&case["args"]);
        let scale = case["scale"].as_f64().unwrap();
        args.extend(["--lora".to_string(), format!("{}:{scale}", lora.display())]);
        let frames =
            generate("wan-tiny-a", &dir, &draws, &args).unwrap_or_else(|e| panic!("{name}: {e}"));
        let expected = refs[case["frames"].as_str().unwrap()].squeeze(0).unwrap();
        assert_close(name, &frames, &expected, 1e-4, 1e-4);
    }
}

/// `--lora-2` loads a LoRA into Wan2.2 A14B's low-noise expert (`transformer_2`, the last two of
/// the four steps) as diffusers' `load_lora_weights(..., load_into_transformer_2=True)` does,
/// alone at scales 1 and 0.6 and together with `--lora` on the high-noise expert, from files in
/// the diffusers, ComfyUI and kohya layouts.
#[test]
fn a14b_expert_loras_reproduce_diffusers() {
    let dir = scratch_dir("lora", "a14b");
    let refs = candle_core::safetensors::load(
        named_fixture_dir(A14B_FIXTURE).join("lora.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let draws = draws(&dir, &refs);
    let cases = lora_cases(A14B_FIXTURE);
    let flags = |args: &[String], flag: &str| args.iter().filter(|a| *a == flag).count();
    assert!(
        cases
            .iter()
            .any(|(_, a, _)| flags(a, "--lora-2") == 1 && flags(a, "--lora") == 0)
            && cases
                .iter()
                .any(|(_, a, _)| flags(a, "--lora-2") == 1 && flags(a, "--lora") == 1),
        "the fixture runs --lora-2 alone and with --lora"
    );
    // The same draws and call without LoRAs: the checkpoint's own reference.
    let plain = named_reference("wan22-a14b-tiny-a", "pipeline")["cfg5.frames"]
        .squeeze(0)
        .unwrap();
    for (name, args, tensor) in &cases {
        let expected = refs[tensor].squeeze(0).unwrap();
        // The LoRAs move the frames far beyond the tolerance: matching them needs the LoRAs.
        assert!(
            max_abs_diff(&expected, &plain) > 0.05,
            "{name}: the LoRA changes nothing"
        );
        let frames = generate("wan22-a14b-tiny-a", &dir, &draws, args)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_close(name, &frames, &expected, 1e-4, 1e-4);
    }
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
    // A factor stored as integers.
    let ints: std::collections::HashMap<String, Tensor> = src
        .iter()
        .map(|(k, v)| {
            let v = if k.ends_with("blocks.0.self_attn.q.lora_up.weight") {
                v.to_dtype(candle_core::DType::U8).unwrap()
            } else {
                v.clone()
            };
            (k.clone(), v)
        })
        .collect();
    let ints_path = dir.join("ints.safetensors");
    candle_core::safetensors::save(&ints, &ints_path).unwrap();
    let line = usage_error(&run(&model, ints_path.to_str().unwrap()), "integer factor");
    assert!(
        line.contains("ints.safetensors") && line.contains("q.lora_up") && line.contains("U8"),
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
    // A Wan LoRA for CogVideoX: a layer its transformer does not have.
    let wan_lora = lora_dir.join("lora2.diffusers.safetensors");
    let cog = named_fixture_dir("cogvideox-tiny-a");
    let line = usage_error(&run(&cog, wan_lora.to_str().unwrap()), "cogvideox");
    assert!(line.contains("a LoRA for another model"), "{line}");
    // A family whose LoRAs vidgen does not read.
    let minimax = named_fixture_dir("minimax-h3-tiny-a");
    let line = usage_error(&run(&minimax, wan_lora.to_str().unwrap()), "minimax");
    assert!(line.contains("--lora does not apply"), "{line}");
}

/// A diffusers/PEFT LoRA on LTX-Video, CogVideoX, HunyuanVideo, Mochi-1 and FLUX.1 (whose
/// diffusers pipelines load LoRAs) gives the frames of the same model with `W + scale · alpha / rank · B @ A` written into
/// its transformer weights (computed here in f32); a ComfyUI-layout LoRA is refused for them in
/// one line.
#[test]
fn diffusers_loras_merge_into_every_family_that_loads_them() {
    for (fixture, size) in [
        ("ltx-video-tiny-a", ["9", "64", "64"]),
        ("cogvideox-tiny-a", ["17", "32", "48"]),
        ("hunyuanvideo-tiny-a", ["17", "32", "48"]),
        ("mochi-tiny-a", ["13", "32", "48"]),
        ("flux-tiny-a", ["1", "48", "64"]),
    ] {
        let dir = scratch_dir("lora", fixture);
        let source = named_fixture_dir(fixture);
        let weights_file = source.join("transformer/diffusion_pytorch_model.safetensors");
        let mut weights = candle_core::safetensors::load(&weights_file, &Device::Cpu).unwrap();
        // The largest matrix of the transformer: a Linear of every block type's size.
        let (name, base) = weights
            .iter()
            .filter(|(_, t)| t.rank() == 2)
            .max_by_key(|(n, t)| (t.elem_count(), n.to_string()))
            .map(|(n, t)| (n.clone(), t.clone()))
            .unwrap();
        let module = name.strip_suffix(".weight").unwrap();
        let (out, inp) = base.dims2().unwrap();
        let rank = 2;
        let down = Tensor::randn(0f32, 0.3, (rank, inp), &Device::Cpu).unwrap();
        let up = Tensor::randn(0f32, 0.3, (out, rank), &Device::Cpu).unwrap();
        let lora = dir.join("lora.safetensors");
        let tensors = std::collections::HashMap::from([
            (format!("transformer.{module}.lora_A.weight"), down.clone()),
            (format!("transformer.{module}.lora_B.weight"), up.clone()),
        ]);
        candle_core::safetensors::save(&tensors, &lora).unwrap();
        // The same model with the change written into its transformer.
        let merged = dir.join("merged");
        for entry in std::fs::read_dir(&source).unwrap() {
            let entry = entry.unwrap();
            if entry.file_name() != "transformer" {
                std::os::unix::fs::symlink(entry.path(), merged_path(&merged, &entry)).unwrap();
            }
        }
        std::fs::create_dir_all(merged.join("transformer")).unwrap();
        std::fs::copy(
            source.join("transformer/config.json"),
            merged.join("transformer/config.json"),
        )
        .unwrap();
        let scale = 0.5;
        let changed = (base.to_dtype(DType::F32).unwrap()
            + (up.matmul(&down).unwrap() * scale).unwrap())
        .unwrap();
        weights.insert(name.clone(), changed);
        candle_core::safetensors::save(
            &weights,
            merged.join("transformer/diffusion_pytorch_model.safetensors"),
        )
        .unwrap();
        let run = |model: &Path, extra: &[String]| -> Tensor {
            let mut args: Vec<String> = [
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--prompt",
                "a cat on a roof",
                "--num-frames",
                size[0],
                "--height",
                size[1],
                "--width",
                size[2],
                "--num-inference-steps",
                "2",
                "--seed",
                "7",
                "--device",
                "cpu",
                "--dtype",
                "f32",
                "--output-type",
                "safetensors",
                "--output-path",
                dir.to_str().unwrap(),
                "--output-video-name",
                "v",
                "--overwrite",
            ]
            .map(String::from)
            .to_vec();
            args.extend_from_slice(extra);
            let out = run_vidgen(&args);
            assert!(
                out.status.success(),
                "{fixture}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            candle_core::safetensors::load(dir.join("v.safetensors"), &Device::Cpu).unwrap()
                ["frames"]
                .clone()
        };
        let plain = run(&source, &[]);
        let with_lora = run(
            &source,
            &["--lora".into(), format!("{}:{scale}", lora.display())],
        );
        let expected = run(&merged, &[]);
        let diff = max_abs_diff(&with_lora, &expected);
        eprintln!("{fixture}: LoRA vs merged weights {diff:.3e}");
        assert!(diff <= 1e-5, "{fixture}: {diff}");
        assert!(
            max_abs_diff(&with_lora, &plain) > 1e-3,
            "{fixture}: the LoRA changed nothing"
        );
        // A ComfyUI-layout file (Wan's module names, `lora_down` halves): refused in one line.
        let comfy = dir.join("comfy.safetensors");
        let tensors = std::collections::HashMap::from([
            (format!("diffusion_model.{module}.lora_down.weight"), down),
            (format!("diffusion_model.{module}.lora_up.weight"), up),
        ]);
        candle_core::safetensors::save(&tensors, &comfy).unwrap();
        let args: Vec<String> = [
            "generate",
            "--model",
            source.to_str().unwrap(),
            "--prompt",
            "a cat",
            "--device",
            "cpu",
            "--output-path",
            dir.to_str().unwrap(),
            "--lora",
            comfy.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec();
        let line = usage_error(&run_vidgen(&args), "ComfyUI layout");
        assert!(line.contains("diffusers/PEFT"), "{fixture}: {line}");
    }
}

fn merged_path(merged: &Path, entry: &std::fs::DirEntry) -> PathBuf {
    std::fs::create_dir_all(merged).unwrap();
    merged.join(entry.file_name())
}
