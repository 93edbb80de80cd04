//! Transformer weights from one file (`--transformer FILE`) through the command line, driven by
//! `weights-a/reference/README.json`: the original Wan-AI and ComfyUI layouts in float32 (the
//! folder's frames, bit for bit), float16, ComfyUI scaled fp8, LightX2V fp8 with per-row scales
//! and city96-style GGUF files (Q8_0, Q4_0 + Q4_1, Q4_K + Q6_K), and layerwise fp8 storage
//! (`--storage-dtype`), each within 1e-4 + 1e-4|ref| of diffusers' frames. A missing file, a GGUF of another model and a quantization vidgen does
//! not decode are refused up front; a scaled fp8 file is planned as held (fp8 on the host).

mod common;

use candle_core::{Device, Tensor};
use common::{
    assert_close, generate_frames, max_abs_diff, named_fixture_dir, run_vidgen, scratch_dir,
    usage_error,
};
use std::path::Path;

const FIXTURE: &str = "weights-a";

/// `vidgen generate` of the fixture's call on `model` with `flags`, replaying `draws`.
fn generate(model: &str, dir: &Path, draws: &Path, flags: &[String]) -> Result<Tensor, String> {
    let readme: serde_json::Value = serde_json::from_slice(
        &std::fs::read(named_fixture_dir(FIXTURE).join("reference/README.json")).unwrap(),
    )
    .unwrap();
    let call = &readme["call"];
    let text = |k: &str| call[k].as_str().unwrap().to_string();
    let number = |k: &str| call[k].to_string();
    let mut args: Vec<String> = vec![
        "--model".into(),
        named_fixture_dir(model).to_str().unwrap().into(),
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
        line.contains("has no blocks.1.cross_attn.o.weight")
            && line.contains("Wan-AI original layout"),
        "{line}"
    );
}

/// A streamed DiT read from a scaled fp8 file is planned as the engine holds it: its fp8 bytes
/// and scales wait in host memory (less than the float file's weights in bf16, in every stage),
/// and the device adds the expanded copy of the computing block while it denoises.
#[test]
fn a_scaled_fp8_file_is_planned_as_held() {
    let stages = |file: &str| -> Vec<(String, u64, u64)> {
        let args = [
            "generate",
            "--dry-run",
            "--json",
            "--device",
            "cpu",
            "--memory-model",
            "discrete",
            "--dtype",
            "bf16",
            "--dit-layerwise-offload",
            "--prompt",
            "a cat",
            "--model",
            named_fixture_dir("wan-tiny-a").to_str().unwrap(),
            "--transformer",
            named_fixture_dir(FIXTURE).join(file).to_str().unwrap(),
        ]
        .map(String::from);
        let out = run_vidgen(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        json["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                let bytes = |k: &str| s["memory"][k].as_u64().unwrap();
                let name = s["name"].as_str().unwrap().to_string();
                (name, bytes("host_bytes"), bytes("weight_bytes"))
            })
            .collect()
    };
    let float = stages("wan-tiny-a-comfyui.safetensors");
    let scaled = stages("wan-tiny-a-comfyui-fp8-scaled.safetensors");
    assert_eq!(float.len(), scaled.len());
    for ((name, float_host, float_device), (_, scaled_host, scaled_device)) in
        float.iter().zip(&scaled)
    {
        // The one prompt releases the transformer after denoising: the stages after hold
        // neither file's weights.
        match name.as_str() {
            "encode_text" | "denoise" => {
                assert!(scaled_host < float_host, "{name}: {scaled_host} host bytes")
            }
            _ => assert_eq!(scaled_host, float_host, "{name}"),
        }
        if name == "denoise" {
            assert!(
                scaled_device > float_device,
                "{name}: {scaled_device} device bytes"
            );
        }
    }
}

/// Every case of the README on `model` through the command line: its folder first, then each
/// weight file (`--transformer`) or storage dtype, within 1e-4 + 1e-4|ref| of diffusers' frames,
/// bit for bit the folder's where the README says the weights are the folder's, and otherwise
/// away from the folder's frames.
fn cases_reproduce_diffusers(model: &str) {
    let dir = scratch_dir("weights", model);
    let fixture = named_fixture_dir(FIXTURE);
    let readme: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture.join("reference/README.json")).unwrap())
            .unwrap();
    let refs = candle_core::safetensors::load(
        fixture.join(format!("reference/{model}.safetensors")),
        &Device::Cpu,
    )
    .unwrap();
    let draws = dir.join("draws.safetensors");
    let latents =
        std::collections::HashMap::from([("latents".to_string(), refs["latents_init"].clone())]);
    candle_core::safetensors::save(&latents, &draws).unwrap();
    let cases: Vec<&serde_json::Value> = readme["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["model"] == model)
        .collect();
    assert_eq!(cases[0]["case"], "folder");
    let mut folder = None;
    for case in &cases {
        let name = case["case"].as_str().unwrap();
        let flags: Vec<String> = case["flags"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap())
            .map(|f| match fixture.join(f).is_file() {
                true => fixture.join(f).to_str().unwrap().to_string(),
                false => f.to_string(),
            })
            .collect();
        let got = generate(model, &dir, &draws, &flags).unwrap_or_else(|e| panic!("{name}: {e}"));
        let expected = refs[case["frames"].as_str().unwrap()].squeeze(0).unwrap();
        eprintln!("{name}: max |diff| {:.3e}", max_abs_diff(&got, &expected));
        assert_close(name, &got, &expected, 1e-4, 1e-4);
        match &folder {
            None => folder = Some(got),
            Some(folder) if case["equals"] == "folder" => {
                assert_eq!(max_abs_diff(&got, folder), 0.0, "{name}")
            }
            Some(folder) => assert!(
                max_abs_diff(&got, folder) > 1e-3,
                "{name}: the folder's frames"
            ),
        }
    }
}

/// `wan-tiny-a`: the original Wan-AI and ComfyUI float32 files, float16, ComfyUI scaled fp8,
/// LightX2V fp8 and `--storage-dtype` float8_e4m3fn / float8_e5m2.
#[test]
fn single_files_and_fp8_storage_reproduce_diffusers() {
    cases_reproduce_diffusers("wan-tiny-a");
}

/// `wan-q-tiny-a`: the GGUF files.
#[test]
fn gguf_transformers_reproduce_diffusers() {
    cases_reproduce_diffusers("wan-q-tiny-a");
}

/// A GGUF file holding `tensors` (name, ggml type id, dimensions slowest first, bytes) under
/// `general.architecture = architecture`.
fn write_gguf(path: &Path, architecture: &str, tensors: &[(&str, u32, Vec<u64>, Vec<u8>)]) {
    let mut out: Vec<u8> = b"GGUF".to_vec();
    let string = |out: &mut Vec<u8>, s: &str| {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    };
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend(1u64.to_le_bytes());
    string(&mut out, "general.architecture");
    out.extend(8u32.to_le_bytes());
    string(&mut out, architecture);
    let mut offset = 0u64;
    for (name, kind, dims, bytes) in tensors {
        string(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        for d in dims.iter().rev() {
            out.extend(d.to_le_bytes());
        }
        out.extend(kind.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += (bytes.len() as u64).div_ceil(32) * 32;
    }
    out.resize(out.len().div_ceil(32) * 32, 0);
    for (_, _, _, bytes) in tensors {
        out.extend(bytes);
        out.resize(out.len().div_ceil(32) * 32, 0);
    }
    std::fs::write(path, out).unwrap();
}

#[test]
fn a_gguf_of_another_model_or_an_unknown_quantization_is_refused_before_anything_loads() {
    let dir = scratch_dir("weights", "gguf-bad");
    let run = |file: &Path| {
        let args = [
            "generate",
            "--model",
            named_fixture_dir("wan-q-tiny-a").to_str().unwrap(),
            "--prompt",
            "a cat",
            "--device",
            "cpu",
            "--output-path",
            dir.to_str().unwrap(),
            "--transformer",
            file.to_str().unwrap(),
        ]
        .map(String::from);
        run_vidgen(&args)
    };
    let other = dir.join("flux.gguf");
    write_gguf(
        &other,
        "flux",
        &[("img_in.weight", 0, vec![2, 2], vec![0; 16])],
    );
    let line = usage_error(&run(&other), "another architecture");
    assert!(
        line.contains("flux.gguf")
            && line.contains("GGUF, architecture \"flux\"")
            && line.contains("has no "),
        "{line}"
    );
    // IQ4_XS (type 23): 136 bytes per 256 weights.
    let unknown = dir.join("iq4.gguf");
    write_gguf(
        &unknown,
        "wan",
        &[("head.head.weight", 23, vec![1, 256], vec![0; 136])],
    );
    let line = usage_error(&run(&unknown), "unknown quantization");
    assert!(
        line.contains("iq4.gguf") && line.contains("head.head.weight is stored as IQ4_XS"),
        "{line}"
    );
}
