//! HunyuanVideo end to end through `vidgen generate`, driven as ../shared/fixtures/PARITY-CLI.md
//! says: `hunyuanvideo-tiny-a`'s runs `cfg1` (embedded guidance 6, no real CFG) and `truecfg4`
//! (true_cfg_scale 4 with the negative prompt) reproduce diffusers' frames; offload modes give
//! bit-identical frames; the dry run plans the fixture and `synthetic:hunyuanvideo`; flags that
//! do not apply are refused.

mod common;

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const FIXTURE: &str = "hunyuanvideo-tiny-a";
/// The fixture README's pipeline tolerance.
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn vidgen() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vidgen"))
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("vidgen-hunyuan-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn preset() -> serde_json::Value {
    let text =
        std::fs::read_to_string(common::named_fixture_dir(FIXTURE).join("reference/README.json"))
            .unwrap();
    serde_json::from_str::<serde_json::Value>(&text).unwrap()["preset"].clone()
}

/// The draws file of the fixture's runs: `latents` = `latents_init`.
fn draws(dir: &Path) -> PathBuf {
    let r = common::named_reference(FIXTURE, "pipeline");
    let path = dir.join("draws.safetensors");
    let tensors: HashMap<String, Tensor> =
        [("latents".to_string(), r["latents_init"].clone())].into();
    candle_core::safetensors::save(&tensors, &path).unwrap();
    path
}

/// The fixture's pipeline call at `true_cfg_scale`, writing `name` into `dir`.
fn parity_call(dir: &Path, name: &str, true_cfg_scale: f64) -> Command {
    let p = preset();
    let prompt = p["prompts"][p["pipeline_prompt_index"].as_u64().unwrap() as usize]
        .as_str()
        .unwrap()
        .to_string();
    let model = common::named_fixture_dir(FIXTURE);
    let draws = draws(dir);
    let mut command = vidgen();
    command
        .args(["generate", "--model"])
        .arg(&model)
        .args(["--prompt", &prompt])
        .args(["--negative-prompt", p["negative_prompt"].as_str().unwrap()])
        .args(["--height", "32", "--width", "48", "--num-frames", "17"])
        .args(["--num-inference-steps", "3", "--guidance-scale", "6"])
        .args(["--true-cfg-scale", &true_cfg_scale.to_string()])
        .args(["--max-sequence-length", "16", "--latents"])
        .arg(&draws)
        .args([
            "--device",
            "cpu",
            "--dtype",
            "f32",
            "--output-type",
            "safetensors",
            "--overwrite",
        ])
        .args(["--output-path"])
        .arg(dir)
        .args(["--output-video-name", name]);
    command
}

/// Runs the fixture's pipeline call with `extra` flags: the written frames and the log.
fn generate(dir: &Path, name: &str, true_cfg_scale: f64, extra: &[&str]) -> (Tensor, String) {
    let out = parity_call(dir, name, true_cfg_scale)
        .args(extra)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "vidgen failed: {log}");
    let file = dir.join(format!("{name}.safetensors"));
    let frames = candle_core::safetensors::load(&file, &Device::Cpu).unwrap()["frames"].clone();
    (frames, log)
}

fn check_run(tag: &str, true_cfg_scale: f64) {
    let dir = scratch(tag);
    let (frames, _) = generate(&dir, tag, true_cfg_scale, &[]);
    common::assert_reference_run(FIXTURE, tag, &frames, (ATOL, RTOL));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn embedded_guidance_run_matches_diffusers() {
    check_run("cfg1", 1.0);
}

#[test]
fn true_cfg_run_matches_diffusers() {
    check_run("truecfg4", 4.0);
}

/// Every offload mode gives the resident run's frames, bit for bit, with both text encoders
/// streamed or computed on the CPU where components load lazily or one stage at a time; leaf
/// level streams each step of a block as a group of its own (the plan says so).
#[test]
fn offload_modes_are_bit_identical_to_resident() {
    let dir = scratch("offload");
    let fixture = common::named_fixture_dir(FIXTURE);
    let plan = common::dry_run_plan(
        fixture.to_str().unwrap(),
        &[
            "--memory-model",
            "discrete",
            "--dit-layerwise-offload",
            "--offload-type",
            "leaf-level",
        ],
    );
    let placed = plan["placement"]["dit"].to_string();
    assert!(placed.contains(r#""by_step":true"#), "{placed}");
    let more: &[(&[&str], &str)] = &[
        (
            &["--lazy-module-load", "--text-encoder-cpu-offload"],
            "text_encoder: streamed",
        ),
        (
            &[
                "--h3-sequential-load",
                "--text-encoder-cpu-offload",
                "--text-encoder-compute",
                "cpu",
            ],
            "text_encoder: on the CPU",
        ),
    ];
    common::assert_offload_modes_bit_identical(more, |flags| generate(&dir, "mode", 4.0, flags));
}

/// `--fp8-matmul`: the dual- and single-stream blocks' Linears in e4m3 change the video by about
/// e4m3's precision (measured: 0.15% relative L2, through the tiny VAE), and every offload mode
/// gives the resident fp8 run's frames bit for bit.
#[test]
fn fp8_matmuls_run_in_every_offload_mode() {
    let dir = scratch("fp8");
    common::assert_fp8_runs(0.005, |flags| generate(&dir, "fp8", 1.0, flags));
    std::fs::remove_dir_all(&dir).ok();
}

/// Every stage planned with weights and activations, and both text encoders released before
/// the DiT loads where components load one stage at a time.
fn check_stages(model: &str, plan: &serde_json::Value, one_at_a_time: bool) {
    let stages = plan["stages"].as_array().unwrap();
    let names: Vec<&str> = stages.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["encode_text", "modulate", "denoise", "decode", "write"],
        "{model}"
    );
    assert_eq!(
        stages[0]["components"],
        serde_json::json!(["text_encoder", "text_encoder_2"]),
        "{model}"
    );
    // Every step's modulations come first, from their own component in the transformer's
    // folder; the transformer alone denoises.
    assert_eq!(
        stages[1]["components"],
        serde_json::json!(["transformer_modulations"]),
        "{model}"
    );
    assert_eq!(
        stages[2]["components"],
        serde_json::json!(["transformer"]),
        "{model}"
    );
    for stage in &stages[..4] {
        let memory = &stage["memory"];
        assert!(
            memory["activation_bytes"].as_u64().unwrap() > 0,
            "{model}: {stage}"
        );
        assert!(
            memory["peak_bytes"].as_u64().unwrap() > 0,
            "{model}: {stage}"
        );
    }
    if one_at_a_time {
        assert_eq!(
            stages[0]["release_after"],
            serde_json::json!(["text_encoder", "text_encoder_2"]),
            "{model}: {plan}"
        );
        assert_eq!(
            stages[1]["load_before"],
            serde_json::json!(["transformer_modulations"]),
            "{model}"
        );
        assert_eq!(
            stages[1]["release_after"],
            serde_json::json!(["transformer_modulations"]),
            "{model}: {plan}"
        );
        assert_eq!(
            stages[2]["load_before"],
            serde_json::json!(["transformer"]),
            "{model}"
        );
    }
}

#[test]
fn dry_run_plans_the_fixture_and_the_full_size_model_with_its_defaults() {
    let fixture = common::named_fixture_dir(FIXTURE);
    for model in [fixture.to_str().unwrap(), "synthetic:hunyuanvideo"] {
        for (extra, one_at_a_time) in [
            (&[][..], false),
            (
                &["--dit-layerwise-offload", "--text-encoder-cpu-offload"][..],
                false,
            ),
            (&["--sequential-cpu-offload"][..], false),
            (&["--h3-sequential-load"][..], true),
            (&["--lazy-module-load"][..], true),
        ] {
            let plan = common::dry_run_plan(model, extra);
            let config = &plan["config"];
            assert_eq!(config["height"], 720, "{model}: {config}");
            assert_eq!(config["width"], 1280, "{model}: {config}");
            assert_eq!(config["num_frames"], 129, "{model}: {config}");
            assert_eq!(config["fps"], 24, "{model}: {config}");
            assert_eq!(config["num_inference_steps"], 50, "{model}: {config}");
            assert_eq!(config["guidance_scale"], 6.0, "{model}: {config}");
            assert_eq!(config["max_sequence_length"], 256, "{model}: {config}");
            assert_eq!(config["scheduler"], "euler", "{model}: {config}");
            check_stages(model, &plan, one_at_a_time);
        }
    }
    // The full-size model's weights as published: a 12.8 B-parameter DiT, its blocks'
    // modulations (27%) apart from the rest (both hold the small conditioning embedders).
    let plan = common::dry_run_plan("synthetic:hunyuanvideo", &["--dtype", "bf16"]);
    let weights = |stage: usize| {
        plan["stages"][stage]["memory"]["weight_bytes"]
            .as_u64()
            .unwrap()
    };
    let (modulations, dit) = (weights(1), weights(2));
    assert!(
        (25_000_000_000..26_500_000_000).contains(&(modulations + dit)),
        "{modulations} + {dit}"
    );
    let share = modulations as f64 / (modulations + dit) as f64;
    assert!((0.25..0.30).contains(&share), "{share}");
}

/// The DiT's device weights while it denoises 320x512x61 in bf16 with only it loaded (the seed
/// table's HunyuanVideo size), under `extra`.
fn dit_weight_bytes(extra: &[&str]) -> u64 {
    let flags = [
        &[
            "--dtype",
            "bf16",
            "--height",
            "320",
            "--width",
            "512",
            "--num-frames",
            "61",
            "--memory-model",
            "discrete",
            "--lazy-module-load",
            "--dit-layerwise-offload",
        ][..],
        extra,
    ]
    .concat();
    let plan = common::dry_run_plan("synthetic:hunyuanvideo", &flags);
    let denoise = &plan["stages"][2];
    assert_eq!(denoise["components"], serde_json::json!(["transformer"]));
    denoise["memory"]["weight_bytes"].as_u64().unwrap()
}

#[test]
fn streamed_dit_keeps_only_the_embedders_and_leaf_level_moves_block_steps() {
    const GIB: f64 = (1u64 << 30) as f64;
    // Block level: the input embedders and the output projection (0.03 GiB; the token
    // refiner's blocks stream with the others, the conditioning embedders and every
    // modulation Linear live in the modulation component) plus two slots of the largest
    // block body, a dual-stream one (0.45 GB without its 0.23 GB of modulations): one slot
    // ahead, which carries two single-stream blocks. Two slots ahead when asked: three.
    let block = dit_weight_bytes(&[]) as f64 / GIB;
    assert!((0.8..0.9).contains(&block), "block level {block:.3} GiB");
    let two_ahead = dit_weight_bytes(&["--prefetch-depth", "2"]) as f64 / GIB;
    assert!(
        (1.2..1.35).contains(&two_ahead),
        "block level, depth 2 {two_ahead:.3} GiB"
    );
    // Leaf level: each step in memory of its own size, one ahead of the computing one (as many
    // as make the smallest block, a refiner block's body, 0.23 GB): at most two consecutive
    // steps, a single-stream block's proj_mlp and proj_out (0.17 GB) and the next block's
    // first; the outer part comes in around its uses, beside less.
    let leaf = dit_weight_bytes(&["--offload-type", "leaf-level"]) as f64 / GIB;
    assert!((0.26..0.3).contains(&leaf), "leaf level {leaf:.3} GiB");
    // Three steps ahead when asked: four consecutive steps, still less than block level's two
    // slots.
    let deeper = dit_weight_bytes(&["--offload-type", "leaf-level", "--prefetch-depth", "3"]);
    let deeper = deeper as f64 / GIB;
    assert!(
        (0.52..0.6).contains(&deeper),
        "leaf level, depth 3: {deeper:.3} GiB"
    );
}

#[test]
fn flags_that_do_not_apply_are_refused() {
    let dir = scratch("refused");
    let model = common::named_fixture_dir(FIXTURE);
    for flags in [
        &["--guidance-scale-2", "3"][..],
        &["--decode-timestep", "0.05"][..],
        &["--scheduler", "unipc"][..],
    ] {
        common::assert_refused(&model, &dir, flags, &[flags[0], "does not apply"]);
    }
    std::fs::remove_dir_all(&dir).ok();
}
