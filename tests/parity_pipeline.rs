//! The whole pipeline through the binary, against diffusers' WanPipeline output on the fixture.

mod common;

use candle_core::{Device, Tensor};
use common::{assert_close, fixture_dir, reference};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture_prompt() -> (String, String) {
    let readme: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir().join("reference/README.json")).unwrap(),
    )
    .unwrap();
    let inputs = &readme["files"]["pipeline.safetensors"]["inputs"];
    (
        inputs["prompt"].as_str().unwrap().to_string(),
        inputs["negative_prompt"].as_str().unwrap().to_string(),
    )
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-pipeline-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the documented parity command line and returns the written frames.
fn generate(dir: &Path, guidance: &str, extra: &[&str]) -> Tensor {
    generate_logged(dir, guidance, extra).0
}

/// [`generate`], also returning stderr.
fn generate_logged(dir: &Path, guidance: &str, extra: &[&str]) -> (Tensor, String) {
    let refs = reference("pipeline");
    let latents = dir.join("latents.safetensors");
    let init: HashMap<String, Tensor> =
        [("latents".to_string(), refs["latents_init"].clone())].into();
    candle_core::safetensors::save(&init, &latents).unwrap();
    let (prompt, negative) = fixture_prompt();
    let model = fixture_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args([
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            &prompt,
            "--negative-prompt",
            &negative,
        ])
        .args([
            "--height",
            "32",
            "--width",
            "32",
            "--num-frames",
            "9",
            "--num-inference-steps",
            "3",
        ])
        .args(["--guidance-scale", guidance, "--max-sequence-length", "20"])
        .args([
            "--latents",
            latents.to_str().unwrap(),
            "--device",
            "cpu",
            "--dtype",
            "f32",
        ])
        .args([
            "--output-type",
            "safetensors",
            "--output-path",
            dir.to_str().unwrap(),
            "--output-video-name",
            "v",
        ])
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "vidgen failed: {stderr}");
    let written = dir.join("v.safetensors");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        written.display().to_string(),
        "stdout carries only the path"
    );
    let frames = candle_core::safetensors::load(&written, &Device::Cpu).unwrap()["frames"].clone();
    (frames, stderr.to_string())
}

#[test]
fn cfg5_frames_match_diffusers() {
    let dir = scratch("cfg5");
    let frames = generate(&dir, "5", &[]);
    let expected = reference("pipeline")["cfg5.frames"].squeeze(0).unwrap();
    assert_close("cfg5.frames", &frames, &expected, 1e-4, 1e-4);
    // The uint8 MP4 path truncates: at most 1 off, on at most 0.1% of values.
    let trunc = reference("pipeline")["cfg5.frames_uint8_trunc"]
        .squeeze(0)
        .unwrap();
    let ours = (frames * 255.0).unwrap().floor().unwrap();
    let diff: Vec<f32> = (ours - trunc.to_dtype(candle_core::DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert!(diff.iter().all(|d| *d <= 1.0));
    assert!(diff.iter().filter(|d| **d > 0.0).count() * 1000 <= diff.len());
}

#[test]
fn cfg1_frames_match_diffusers_under_every_load_policy() {
    let expected = reference("pipeline")["cfg1.frames"].squeeze(0).unwrap();
    for extra in [
        &["--lazy-module-load=false", "--sequential-load=false"][..],
        &["--lazy-module-load"],
        &["--no-lazy-module-load", "--sequential-load"],
    ] {
        let dir = scratch(&format!("cfg1-{}", extra.len() + extra[0].len()));
        let frames = generate(&dir, "1", extra);
        assert_close(
            &format!("cfg1.frames {extra:?}"),
            &frames,
            &expected,
            1e-4,
            1e-4,
        );
    }
}

/// The offload engine changes where weights live, never what is computed: every placement
/// mode gives the resident output bit for bit (planned as on a discrete GPU, run on the CPU).
#[test]
fn every_offload_mode_equals_resident_bit_for_bit() {
    let (resident, log) = generate_logged(&scratch("resident"), "5", common::RESIDENT);
    assert!(log.contains("transformer: resident"), "{log}");
    let expected = reference("pipeline")["cfg5.frames"].squeeze(0).unwrap();
    assert_close("resident", &resident, &expected, 1e-4, 1e-4);
    let resident = resident.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // (flags, a line the log must show: the mode really ran)
    let modes: [(&[&str], &str); 13] = [
        // Of the tiny Wan's two blocks (32.5 KB each in f32) the first is kept, then both.
        (
            &["--dit-resident-memory", "40KiB"],
            "prefetch depth 1 on a copy stream, up to 0.04 MiB of groups kept on the device; kept on the device: 1 group(s)",
        ),
        (
            &["--dit-resident-memory", "1MiB"],
            "up to 1.00 MiB of groups kept on the device; kept on the device: 2 group(s)",
        ),
        (
            &[],
            "transformer: streamed in groups of 1 block(s), prefetch depth 1 on a copy stream",
        ),
        (
            &["--prefetch-depth", "2"],
            "groups of 1 block(s), prefetch depth 2",
        ),
        (
            &["--num-blocks-per-group", "2", "--no-offload-stream"],
            "groups of 2 block(s), synchronous copies",
        ),
        (
            &["--no-offload-stream"],
            "transformer: streamed in groups of 1 block(s), synchronous copies",
        ),
        (&["--no-pin-cpu-memory"], "transformer: streamed"),
        (&["--max-pinned-memory", "1MiB"], "transformer: streamed"),
        (
            &["--no-dit-layerwise-offload"],
            "transformer: parked in host memory",
        ),
        (
            &["--text-encoder-compute", "cpu"],
            "text_encoder: on the CPU",
        ),
        (
            &["--model-cpu-offload"],
            "text_encoder: parked in host memory",
        ),
        (
            &["--sequential-cpu-offload"],
            "transformer: streamed step by step (each step of a block its own group), synchronous copies",
        ),
        (
            // The largest of the tiny Wan's three steps is about a third of a block: the copy
            // stream runs two steps ahead.
            &["--offload-type", "leaf-level"],
            "transformer: streamed step by step (each step of a block its own group), prefetch depth 2 on a copy stream",
        ),
    ];
    for (flags, shows) in modes {
        let mut args = vec!["--memory-model", "discrete"];
        args.extend_from_slice(flags);
        let dir = scratch(&format!("offload-{}", flags.join("").replace('-', "")));
        let (offloaded, log) = generate_logged(&dir, "5", &args);
        assert!(
            log.contains(shows),
            "{flags:?}: expected `{shows}` in {log}"
        );
        assert!(
            log.contains("vae: parked in host memory"),
            "{flags:?}: {log}"
        );
        let offloaded = offloaded.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(
            offloaded == resident,
            "{flags:?}: offloaded output differs from resident"
        );
    }
}
