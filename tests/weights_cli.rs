//! Transformer weights from one file (`--transformer FILE`) through the command line, driven by
//! `weights-a/reference/README.json`: the original Wan-AI and ComfyUI layouts in float32 (the
//! folder's frames, bit for bit), float16, ComfyUI scaled fp8 and LightX2V fp8 with per-row
//! scales, each within 1e-4 + 1e-4|ref| of diffusers' frames. A missing file is refused up front.

mod common;

use candle_core::{Device, Tensor};
use common::{
    assert_close, generate_frames, max_abs_diff, named_fixture_dir, run_vidgen, scratch_dir,
    usage_error,
};
use std::path::Path;

const FIXTURE: &str = "weights-a";

/// `vidgen generate` of the fixture's call on `wan-tiny-a` with `flags`, replaying `draws`.
fn generate(dir: &Path, draws: &Path, flags: &[String]) -> Result<Tensor, String> {
    let readme: serde_json::Value = serde_json::from_slice(
        &std::fs::read(named_fixture_dir(FIXTURE).join("reference/README.json")).unwrap(),
    )
    .unwrap();
    let call = &readme["call"];
    let text = |k: &str| call[k].as_str().unwrap().to_string();
    let number = |k: &str| call[k].to_string();
    let mut args: Vec<String> = vec![
        "--model".into(),
        named_fixture_dir("wan-tiny-a").to_str().unwrap().into(),
        "--prompt".into(),
        text("prompt"),
        "--negative-prompt".into(),
        text("negative_prompt"),
    ];
    for (flag, key) in [
        ("--num-frames", "num_frames"),
        ("--height", "height"),
        ("--width", "width"),
        ("--num-inference-steps", "num_inference_steps"),
        ("--guidance-scale", "guidance_scale"),
        ("--max-sequence-length", "max_sequence_length"),
    ] {
        args.extend([flag.to_string(), number(key)]);
    }
    args.extend_from_slice(flags);
    generate_frames(&args, draws, dir)
}

#[test]
fn single_file_transformers_reproduce_diffusers() {
    let dir = scratch_dir("weights", "parity");
    let fixture = named_fixture_dir(FIXTURE);
    let refs = candle_core::safetensors::load(
        fixture.join("reference/wan-tiny-a.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let draws = dir.join("draws.safetensors");
    let latents =
        std::collections::HashMap::from([("latents".to_string(), refs["latents_init"].clone())]);
    candle_core::safetensors::save(&latents, &draws).unwrap();
    let folder = generate(&dir, &draws, &[]).unwrap();
    assert_close(
        "folder",
        &folder,
        &refs["folder.frames"].squeeze(0).unwrap(),
        1e-4,
        1e-4,
    );
    for (file, frames) in [
        ("wan-tiny-a-original.safetensors", None),
        ("wan-tiny-a-comfyui.safetensors", None),
        (
            "wan-tiny-a-comfyui-float16.safetensors",
            Some("comfyui_float16.frames"),
        ),
        (
            "wan-tiny-a-comfyui-fp8-scaled.safetensors",
            Some("comfyui_fp8_scaled.frames"),
        ),
        (
            "wan-tiny-a-fp8-e4m3fn-lightx2v.safetensors",
            Some("lightx2v_fp8_weight_scale.frames"),
        ),
    ] {
        let flags = [
            "--transformer".to_string(),
            fixture.join(file).to_str().unwrap().to_string(),
        ];
        let got = generate(&dir, &draws, &flags).unwrap_or_else(|e| panic!("{file}: {e}"));
        match frames {
            // The float32 single files hold the folder's weights under other names.
            None => assert_eq!(max_abs_diff(&got, &folder), 0.0, "{file}"),
            Some(frames) => {
                let expected = refs[frames].squeeze(0).unwrap();
                eprintln!("{file}: max |diff| {:.3e}", max_abs_diff(&got, &expected));
                assert_close(file, &got, &expected, 1e-4, 1e-4);
                assert!(
                    max_abs_diff(&got, &folder) > 1e-3,
                    "{file}: the folder's frames"
                );
            }
        }
    }
}

#[test]
fn a_missing_transformer_file_is_refused_before_anything_loads() {
    let dir = scratch_dir("weights", "missing");
    let args = [
        "generate",
        "--model",
        named_fixture_dir("wan-tiny-a").to_str().unwrap(),
        "--prompt",
        "a cat",
        "--device",
        "cpu",
        "--output-path",
        dir.to_str().unwrap(),
        "--transformer",
        "/nonexistent/wan.safetensors",
    ]
    .map(String::from);
    let line = usage_error(&run_vidgen(&args), "missing file");
    assert!(line.contains("/nonexistent/wan.safetensors"), "{line}");
    // A file without one of the transformer's tensors, named in the file's own layout.
    let original = named_fixture_dir(FIXTURE).join("wan-tiny-a-original.safetensors");
    let tensors = candle_core::safetensors::load(&original, &Device::Cpu).unwrap();
    let partial: std::collections::HashMap<_, _> = tensors
        .into_iter()
        .filter(|(k, _)| k != "blocks.1.cross_attn.o.weight")
        .collect();
    let path = dir.join("partial.safetensors");
    candle_core::safetensors::save(&partial, &path).unwrap();
    let mut args = args;
    args[args.len() - 1] = path.to_str().unwrap().to_string();
    let line = usage_error(&run_vidgen(&args), "missing tensor");
    assert!(
        line.contains("has no blocks.1.cross_attn.o.weight") && line.contains("Original layout"),
        "{line}"
    );
}
