//! The Wan family through the binary, as ../shared/fixtures/PARITY-CLI.md drives it, against
//! diffusers 0.42.1 on the tiny fixtures: Wan2.1 I2V (`wan21-i2v-tiny-a`), Wan2.2 TI2V-5B
//! with and without `--image` (`wan22-ti2v-tiny-a`) and Wan2.2 A14B's two experts
//! (`wan22-a14b-tiny-a`); every offload mode bit-identical to resident; dry runs; refusals.

mod common;

use candle_core::{Device, Tensor};
use common::{assert_close, named_fixture_dir, named_reference};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const I2V: &str = "wan21-i2v-tiny-a";
const TI2V: &str = "wan22-ti2v-tiny-a";
const A14B: &str = "wan22-a14b-tiny-a";
const PROMPT: &str = "  Tom &amp;amp; Jerry\n\n  bake a   cake &lt;together&gt;\tin the kitchen  ";
const NEGATIVE: &str = "blurry, static, low quality";

/// One reference run: its fixture, reference file, size and flags.
struct Run {
    fixture: &'static str,
    reference: &'static str,
    size: [&'static str; 4],
    flags: Vec<&'static str>,
}

impl Run {
    fn i2v() -> Self {
        Run {
            fixture: I2V,
            reference: "pipeline",
            size: ["32", "48", "9", "3"],
            flags: vec!["--max-sequence-length", "512", "--image", "IMAGE"],
        }
    }
    fn ti2v() -> Self {
        Run {
            fixture: TI2V,
            reference: "pipeline",
            size: ["64", "64", "5", "3"],
            flags: vec!["--max-sequence-length", "20"],
        }
    }
    fn ti2v_image() -> Self {
        Run {
            reference: "pipeline_i2v",
            flags: vec!["--max-sequence-length", "20", "--image", "IMAGE"],
            ..Self::ti2v()
        }
    }
    fn a14b() -> Self {
        Run {
            fixture: A14B,
            reference: "pipeline",
            size: ["32", "32", "9", "4"],
            flags: vec!["--max-sequence-length", "20"],
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-wanfam-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn vidgen(run: &Run, dir: &Path, extra: &[&str]) -> Output {
    let fixture = named_fixture_dir(run.fixture);
    let refs = named_reference(run.fixture, run.reference);
    let draws = dir.join("draws.safetensors");
    let init: HashMap<String, Tensor> =
        [("latents".to_string(), refs["latents_init"].clone())].into();
    candle_core::safetensors::save(&init, &draws).unwrap();
    let image = fixture.join("reference/input.png");
    let flags: Vec<&str> = run
        .flags
        .iter()
        .map(|f| {
            if *f == "IMAGE" {
                image.to_str().unwrap()
            } else {
                *f
            }
        })
        .collect();
    let [h, w, f, s] = run.size;
    Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(["generate", "--model", fixture.to_str().unwrap()])
        .args(["--prompt", PROMPT, "--negative-prompt", NEGATIVE])
        .args(["--height", h, "--width", w, "--num-frames", f])
        .args(["--num-inference-steps", s])
        .args(flags)
        .args(["--latents", draws.to_str().unwrap()])
        .args(["--device", "cpu", "--dtype", "f32"])
        .args(["--output-type", "safetensors"])
        .args(["--output-path", dir.to_str().unwrap()])
        .args(["--output-video-name", "v"])
        .args(extra)
        .output()
        .unwrap()
}

/// Runs the parity command line; returns the written frames and the log.
fn generate(run: &Run, name: &str, extra: &[&str]) -> (Tensor, String) {
    let dir = scratch(name);
    let out = vidgen(run, &dir, extra);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "vidgen {extra:?} failed: {stderr}");
    let frames = candle_core::safetensors::load(dir.join("v.safetensors"), &Device::Cpu).unwrap()
        ["frames"]
        .clone();
    let _ = std::fs::remove_dir_all(&dir);
    (frames, stderr)
}

fn check_frames(run: &Run, name: &str, tag: &str, extra: &[&str]) -> Tensor {
    let (frames, _) = generate(run, name, extra);
    let expected = named_reference(run.fixture, run.reference)[&format!("{tag}.frames")]
        .squeeze(0)
        .unwrap();
    eprintln!(
        "{} {tag}: max |diff| {:e}",
        run.fixture,
        common::max_abs_diff(&frames, &expected)
    );
    assert_close(
        &format!("{} {tag}", run.fixture),
        &frames,
        &expected,
        1e-4,
        1e-4,
    );
    frames
}

#[test]
fn wan21_i2v_frames_match_diffusers() {
    check_frames(&Run::i2v(), "i2v5", "cfg5", &["--guidance-scale", "5"]);
    check_frames(&Run::i2v(), "i2v1", "cfg1", &["--guidance-scale", "1"]);
}

#[test]
fn wan22_ti2v_frames_match_diffusers() {
    check_frames(&Run::ti2v(), "ti2v5", "cfg5", &["--guidance-scale", "5"]);
    check_frames(&Run::ti2v(), "ti2v1", "cfg1", &["--guidance-scale", "1"]);
    check_frames(
        &Run::ti2v_image(),
        "ti2v-i2v5",
        "i2v_cfg5",
        &["--guidance-scale", "5"],
    );
}

#[test]
fn wan22_a14b_frames_match_diffusers() {
    check_frames(
        &Run::a14b(),
        "a14b5",
        "cfg5",
        &["--guidance-scale", "5", "--guidance-scale-2", "3"],
    );
    check_frames(
        &Run::a14b(),
        "a14b1",
        "cfg1",
        &["--guidance-scale", "1", "--guidance-scale-2", "1"],
    );
}

/// Every placement mode computes what the resident run computes, bit for bit (planned as on a
/// discrete GPU, run on the CPU), for each model of the family.
#[test]
fn every_offload_mode_equals_resident_bit_for_bit() {
    let resident_only = [common::RESIDENT, &["--no-image-encoder-cpu-offload"]].concat();
    let modes: [&[&str]; 6] = [
        &[],
        &["--dit-layerwise-offload", "--offload-type", "leaf-level"],
        &["--no-dit-layerwise-offload"],
        &["--model-cpu-offload"],
        &["--lazy-module-load"],
        &["--no-lazy-module-load", "--sequential-load"],
    ];
    let runs = [
        (Run::i2v(), "5"),
        (Run::ti2v_image(), "5"),
        (Run::a14b(), "5"),
    ];
    for (run, g) in runs {
        let mut args = vec!["--guidance-scale", g];
        args.extend_from_slice(&resident_only);
        let (resident, log) = generate(&run, "resident", &args);
        assert!(log.contains("transformer: resident"), "{log}");
        let resident = resident.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for flags in modes {
            let mut args = vec!["--guidance-scale", g, "--memory-model", "discrete"];
            args.extend_from_slice(flags);
            let (frames, log) = generate(&run, "mode", &args);
            let frames = frames.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(
                frames == resident,
                "{} {flags:?} differs from resident; log: {log}",
                run.fixture
            );
            if run.fixture == A14B && flags == ["--lazy-module-load"] {
                // The first expert is freed at the switch: transformer_2 loads after the
                // high-noise stage.
                let high = log.find("denoise_high_noise:").expect("high-noise stage");
                let second = log.find("loaded transformer_2").expect("second expert");
                assert!(second > high, "{log}");
            }
            if run.fixture == I2V && flags.is_empty() {
                assert!(log.contains("image_encoder: parked"), "{log}");
            }
        }
    }
}

fn dry_run(model: &str, extra: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args([
            "generate",
            "--model",
            model,
            "--prompt",
            "a",
            "--dry-run",
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{model}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn stage_names(plan: &serde_json::Value) -> Vec<String> {
    let text = plan.to_string();
    [
        "encode_text",
        "encode_image",
        "denoise",
        "denoise_high_noise",
        "denoise_low_noise",
        "decode",
    ]
    .iter()
    .filter(|s| text.contains(&format!("\"{s}\"")))
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn dry_runs_plan_every_stage() {
    let image = named_fixture_dir(I2V).join("reference/input.png");
    let image = image.to_str().unwrap();
    let i2v = named_fixture_dir(I2V);
    let plan = dry_run(i2v.to_str().unwrap(), &["--image", image]);
    let stages = stage_names(&plan);
    assert!(stages.contains(&"encode_image".to_string()), "{plan}");
    assert!(plan.to_string().contains("image_encoder"), "{plan}");
    let a14b = named_fixture_dir(A14B);
    let plan = dry_run(a14b.to_str().unwrap(), &[]);
    let stages = stage_names(&plan);
    assert!(stages.contains(&"denoise_high_noise".to_string()), "{plan}");
    assert!(stages.contains(&"denoise_low_noise".to_string()), "{plan}");
    assert!(plan.to_string().contains("transformer_2"), "{plan}");
    for (name, extra) in [
        ("synthetic:wan2.1-i2v-14b-480p", vec!["--image", image]),
        ("synthetic:wan2.2-ti2v-5b", vec![]),
        ("synthetic:wan2.2-ti2v-5b", vec!["--image", image]),
        ("synthetic:wan2.2-t2v-a14b", vec![]),
    ] {
        let plan = dry_run(name, &extra);
        assert!(plan.to_string().contains("denoise"), "{name}: {plan}");
    }
    // The published call defaults.
    let plan = dry_run("synthetic:wan2.2-ti2v-5b", &[]);
    let config = plan["config"].to_string();
    assert!(
        config.contains("704") && config.contains("1280") && config.contains("121"),
        "{config}"
    );
    let plan = dry_run("synthetic:wan2.1-i2v-14b-480p", &["--image", image]);
    let config = plan["config"].to_string();
    assert!(config.contains("480") && config.contains("832"), "{config}");
}

/// Flags that do not apply are refused in one line, with exit 2.
#[test]
fn flags_that_do_not_apply_are_refused() {
    let image = named_fixture_dir(I2V).join("reference/input.png");
    let image = image.to_str().unwrap();
    let cases: [(&str, Vec<&str>, &str); 7] = [
        (TI2V, vec!["--guidance-scale-2", "3"], "--guidance-scale-2"),
        (A14B, vec!["--image", image], "--image"),
        (I2V, vec![], "--image"),
        (
            I2V,
            vec!["--image", image, "--max-sequence-length", "20"],
            "512",
        ),
        (A14B, vec!["--true-cfg-scale", "4"], "--true-cfg-scale"),
        (I2V, vec!["--image", "/nonexistent.png"], "no such file"),
        (
            TI2V,
            vec!["--height", "48", "--width", "64"],
            "multiple of 32",
        ),
    ];
    let dir = scratch("refused");
    for (fixture, extra, says) in cases {
        common::assert_refused(&named_fixture_dir(fixture), &dir, &extra, &[says]);
    }
}

/// A conditioning image that cannot be one (a folder, a FIFO, a text file, a truncated PNG, a
/// PNG wider than any image vidgen decodes) is refused before anything loads, saying what is
/// wrong with it: as `--image` in a run and in a dry run, and as a prompt-file line's `image`.
#[test]
fn bad_images_are_refused_before_anything_loads() {
    let dir = scratch("bad-images");
    let good = std::fs::read(named_fixture_dir(I2V).join("reference/input.png")).unwrap();
    std::fs::create_dir_all(dir.join("folder.png")).unwrap();
    let fifo = Command::new("mkfifo")
        .arg(dir.join("fifo.png"))
        .status()
        .unwrap();
    assert!(fifo.success());
    std::fs::write(dir.join("text.png"), "not an image\n").unwrap();
    std::fs::write(dir.join("cut.png"), &good[..good.len() / 2]).unwrap();
    image::RgbImage::new(20_000, 1)
        .save(dir.join("wide.png"))
        .unwrap();
    let model = named_fixture_dir(I2V);
    for (name, says) in [
        ("folder.png", "is a folder"),
        ("fifo.png", "is not a regular file"),
        ("text.png", "does not decode"),
        ("cut.png", "does not decode"),
        ("wide.png", "larger than 16384 pixels a side"),
    ] {
        let image = dir.join(name);
        let lines = dir.join("p.jsonl");
        std::fs::write(
            &lines,
            format!("{{\"prompt\": \"a\", \"image\": \"{name}\"}}\n"),
        )
        .unwrap();
        let (image, lines) = (image.to_str().unwrap(), lines.to_str().unwrap());
        for extra in [
            &["--prompt", "a", "--image", image][..],
            &["--prompt", "a", "--image", image, "--dry-run"],
            &["--prompt-file", lines],
        ] {
            let out = Command::new(env!("CARGO_BIN_EXE_vidgen"))
                .args(["generate", "--model", model.to_str().unwrap()])
                .args(["--device", "cpu", "--dtype", "f32"])
                .args(["--output-path", dir.join("out").to_str().unwrap()])
                .args(extra)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
            let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
            assert_eq!(errors.len(), 1, "{extra:?}: {stderr}");
            assert!(errors[0].contains(says), "{extra:?}: {stderr}");
            assert!(errors[0].contains(name), "{extra:?}: {stderr}");
            assert!(!stderr.contains("loading"), "nothing loads: {stderr}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `.jsonl` batch where each line names its own image (relative to the prompt file) or
/// none: Wan2.2 TI2V makes the first video from its image and the second from text alone, in
/// one stage-major batch, each as diffusers makes it.
#[test]
fn prompt_lines_carry_their_own_images() {
    let dir = scratch("line-images");
    let fixture = named_fixture_dir(TI2V);
    std::fs::copy(fixture.join("reference/input.png"), dir.join("first.png")).unwrap();
    let line = |extra: &str| {
        format!(
            "{{\"prompt\": {}, {extra}}}\n",
            serde_json::to_string(PROMPT).unwrap()
        )
    };
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        line(r#""image": "first.png", "output_video_name": "with""#)
            + &line(r#""output_video_name": "without""#),
    )
    .unwrap();
    let refs = named_reference(TI2V, "pipeline");
    let draws = dir.join("draws.safetensors");
    let init: HashMap<String, Tensor> =
        [("latents".to_string(), refs["latents_init"].clone())].into();
    candle_core::safetensors::save(&init, &draws).unwrap();
    let run = |prompt_file: &Path, model: &str, extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_vidgen"))
            .args(["generate", "--model", model])
            .args(["--prompt-file", prompt_file.to_str().unwrap()])
            .args(["--negative-prompt", NEGATIVE, "--guidance-scale", "5"])
            .args(["--height", "64", "--width", "64", "--num-frames", "5"])
            .args(["--num-inference-steps", "3"])
            .args(extra)
            .args([
                "--device",
                "cpu",
                "--dtype",
                "f32",
                "--batch-order",
                "stage",
            ])
            .args(["--output-type", "safetensors"])
            .args(["--output-path", dir.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let parity = [
        "--max-sequence-length",
        "20",
        "--latents",
        draws.to_str().unwrap(),
    ];
    let out = run(&prompts, fixture.to_str().unwrap(), &parity);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let frames = |name: &str| {
        candle_core::safetensors::load(dir.join(format!("{name}.safetensors")), &Device::Cpu)
            .unwrap()["frames"]
            .clone()
    };
    let expected =
        |reference: &str, key: &str| named_reference(TI2V, reference)[key].squeeze(0).unwrap();
    let with = expected("pipeline_i2v", "i2v_cfg5.frames");
    assert_close("line with image", &frames("with"), &with, 1e-4, 1e-4);
    let without = expected("pipeline", "cfg5.frames");
    assert_close("line without", &frames("without"), &without, 1e-4, 1e-4);

    // Before anything loads: an image-to-video model needs an image on every line, a
    // text-to-video model takes none, and a line's image must exist.
    let cases = [
        (I2V, "512", r#""output_video_name": "a""#, "needs an image"),
        (A14B, "20", r#""image": "first.png""#, "does not apply"),
        (
            TI2V,
            "20",
            r#""image": "missing.png""#,
            "missing.png: no such file",
        ),
    ];
    for (model, text_len, extra, says) in cases {
        let file = dir.join("bad.jsonl");
        std::fs::write(&file, line(extra)).unwrap();
        let text_len = ["--max-sequence-length", text_len];
        let out = run(&file, named_fixture_dir(model).to_str().unwrap(), &text_len);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{model} {extra}: {stderr}");
        assert!(stderr.contains(says), "{model} {extra}: {stderr}");
        assert!(stderr.contains("bad.jsonl:1"), "names the line: {stderr}");
        assert!(!stderr.contains("loading"), "nothing loads: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `run` with `--stats-json` and returns the first job's `metrics`.
fn metrics(run: &Run, name: &str, extra: &[&str]) -> serde_json::Value {
    let dir = scratch(name);
    let stats = dir.join("stats.json");
    let mut args = vec!["--stats-json", stats.to_str().unwrap()];
    args.extend_from_slice(extra);
    let out = vidgen(run, &dir, &args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    stats["jobs"][0]["metrics"].clone()
}

/// `--stats-json` times A14B's expert switch and places it among the forwards: it comes after
/// the high-noise steps (the reference's timesteps at or above `boundary_ratio` x 1000), two
/// forwards each with CFG; and it times the image stage's two parts.
#[test]
fn stats_time_the_expert_switch_and_the_image_stage() {
    let readme: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(named_fixture_dir(A14B).join("reference/README.json")).unwrap(),
    )
    .unwrap();
    let boundary = readme["preset"]["boundary_ratio"].as_f64().unwrap() * 1000.0;
    let timesteps = readme["derived"]["scheduler_timesteps"].as_array().unwrap();
    let high = timesteps
        .iter()
        .filter(|t| t.as_f64().unwrap() >= boundary)
        .count();
    for flags in [&[][..], &["--lazy-module-load"][..]] {
        let mut args = vec!["--guidance-scale", "5", "--memory-model", "discrete"];
        args.extend_from_slice(flags);
        let m = metrics(&Run::a14b(), "switch", &args);
        let switch = &m["expert_switch"];
        assert_eq!(switch["after_forward"], 2 * high, "{flags:?}: {m}");
        let seconds = switch["seconds"].as_f64().unwrap();
        assert!(seconds > 0.0 && seconds < 60.0, "{flags:?}: {m}");
        assert_eq!(
            m["forward_seconds"].as_array().unwrap().len(),
            2 * timesteps.len(),
            "{m}"
        );
    }
    let m = metrics(&Run::i2v(), "image-stage", &["--guidance-scale", "5"]);
    for part in ["image_encoder", "vae_encode"] {
        let s = m["encode_image_seconds"][part].as_f64().unwrap();
        assert!(s > 0.0 && s < 60.0, "{part}: {m}");
    }
    assert!(m["stages"]["encode_image"].is_object(), "{m}");
    let m = metrics(
        &Run::ti2v_image(),
        "ti2v-image-stage",
        &["--guidance-scale", "5"],
    );
    assert!(m["encode_image_seconds"]["vae_encode"].as_f64().unwrap() > 0.0);
    assert!(m["encode_image_seconds"]["image_encoder"].is_null(), "{m}");
    assert!(m.get("expert_switch").is_none(), "{m}");
}

/// `--output-type latent` writes the latents diffusers' `output_type="latent"` returns (the
/// reference's last step, before the VAE) and leaves the decode out: A14B never loads the VAE,
/// Wan2.1 I2V loads it for the image stage only; the dry run plans no decode stage; a family
/// without latent output refuses the flag as bad input.
#[test]
fn latent_output_is_the_denoised_latents() {
    for (run, key, vae_loads) in [
        (Run::a14b(), "cfg5.step3.latents", 0),
        (Run::i2v(), "cfg5.step2.latents", 1),
    ] {
        let dir = scratch("latent");
        let args = [
            "--guidance-scale",
            "5",
            "--guidance-scale-2",
            "3",
            "--output-type",
            "latent",
        ];
        let args = if run.fixture == A14B {
            &args[..]
        } else {
            &[&args[..2], &args[4..]].concat()
        };
        let out = vidgen(&run, &dir, args);
        let log = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{log}");
        let written =
            candle_core::safetensors::load(dir.join("v.latents.safetensors"), &Device::Cpu)
                .unwrap();
        let expected = &named_reference(run.fixture, run.reference)[key];
        assert_close(run.fixture, &written["latents"], expected, 1e-4, 1e-4);
        assert!(!written.contains_key("frames"));
        assert_eq!(log.matches("loaded vae").count(), vae_loads, "{log}");
        assert!(!log.contains("decode"), "{log}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    let a14b = named_fixture_dir(A14B);
    let plan = dry_run(a14b.to_str().unwrap(), &["--output-type", "latent"]);
    assert!(
        !stage_names(&plan).contains(&"decode".to_string()),
        "{plan}"
    );
    assert!(stage_names(&dry_run(a14b.to_str().unwrap(), &[])).contains(&"decode".to_string()));
    let ltx = named_fixture_dir("ltx-video-tiny-a");
    let out = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args([
            "generate",
            "--model",
            ltx.to_str().unwrap(),
            "--prompt",
            "a",
        ])
        .args(["--device", "cpu", "--output-type", "latent", "--dry-run"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("--output-type latent is not supported for LTX-Video"));
}
