//! The binary end to end: MP4 output read back by ffprobe, and bad model inputs.

mod common;

use common::fixture_dir;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-generate-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn vidgen(model: &Path, out: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args([
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--device",
            "cpu",
        ])
        .args([
            "--height",
            "32",
            "--width",
            "48",
            "--num-frames",
            "9",
            "--num-inference-steps",
            "2",
        ])
        .args([
            "--max-sequence-length",
            "16",
            "--output-path",
            out.to_str().unwrap(),
        ])
        .args(extra)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap()
}

#[test]
fn mp4_has_the_right_frames_size_and_fps() {
    let out = scratch("mp4");
    let run = vidgen(
        &fixture_dir(),
        &out,
        &["--prompt", "a red fox", "--seed", "3", "--fps", "12"],
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let path = out.join("a-red-fox_seed3.mp4");
    assert_eq!(
        String::from_utf8_lossy(&run.stdout).trim(),
        path.display().to_string()
    );
    let probe = Command::new("ffprobe")
        .args([
            "-v",
            "error",
            "-count_frames",
            "-show_entries",
            "stream=codec_name,pix_fmt,width,height,nb_read_frames,r_frame_rate:format_tags",
            "-of",
            "json",
        ])
        .arg(&path)
        .output()
        .expect("ffprobe");
    let info: serde_json::Value = serde_json::from_slice(&probe.stdout).unwrap();
    let s = &info["streams"][0];
    assert_eq!(s["codec_name"], "h264");
    assert_eq!(s["pix_fmt"], "yuv420p");
    assert_eq!(
        (s["width"].as_u64(), s["height"].as_u64()),
        (Some(48), Some(32))
    );
    assert_eq!(s["nb_read_frames"], "9");
    assert_eq!(s["r_frame_rate"], "12/1");
    let tags = &info["format"]["tags"];
    assert_eq!(tags["vidgen_prompt"], "a red fox");
    assert_eq!(tags["vidgen_seed"], "3");
    let leftovers: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("partial"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn same_seed_same_video_other_seed_other_video() {
    let out = scratch("seed");
    let frames = |seed: &str, name: &str| {
        let run = vidgen(
            &fixture_dir(),
            &out,
            &[
                "--prompt",
                "a boat",
                "--seed",
                seed,
                "--output-type",
                "safetensors",
                "--output-video-name",
                name,
            ],
        );
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let t = candle_core::safetensors::load(
            out.join(format!("{name}.safetensors")),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        t["frames"].flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let a = frames("1", "a");
    assert_eq!(a, frames("1", "b"));
    assert_ne!(a, frames("2", "c"));
}

/// Loaded eagerly, the components a stage does not use load beside it on a thread of their own
/// (the DiT and the VAE beside the text encoding), and the video is the one that loading each
/// component before its own stage makes.
#[test]
fn components_load_beside_the_first_stage_and_change_nothing() {
    let out = scratch("beside");
    let run = |name: &str, flags: &[&str]| {
        let mut args = vec![
            "--prompt",
            "a boat",
            "--seed",
            "3",
            "--output-type",
            "safetensors",
        ];
        args.extend(["--output-video-name", name]);
        args.extend(flags);
        let run = vidgen(&fixture_dir(), &out, &args);
        let log = String::from_utf8_lossy(&run.stderr).to_string();
        assert!(run.status.success(), "{log}");
        let t = candle_core::safetensors::load(
            out.join(format!("{name}.safetensors")),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        (
            t["frames"].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            log,
        )
    };
    let stats = out.join("eager.stats.json");
    let stats_flag = stats.to_str().unwrap();
    let eager = [
        "--lazy-module-load=false",
        "--h3-sequential-load=false",
        "--stats-json",
        stats_flag,
    ];
    let (beside, log) = run("eager", &eager);
    // The stage's wait for those loads after its own work, within the stage's time.
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let job = &stats["jobs"][0];
    let waited = job["metrics"]["waited_for_loads_beside"]["encode_text"]
        .as_f64()
        .unwrap_or_else(|| panic!("no wait for the loads beside encode_text: {stats}"));
    let stage = job["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "encode_text")
        .unwrap()["seconds"]
        .as_f64()
        .unwrap();
    assert!((0.0..=stage).contains(&waited), "{waited} of {stage} s");
    for name in ["transformer", "vae"] {
        assert!(
            log.contains(&format!("loading {name} beside encode_text")),
            "{log}"
        );
        assert!(
            log.contains(&format!("loaded {name} beside encode_text, in ")),
            "{log}"
        );
    }
    let (lazy, log) = run("lazy", &["--lazy-module-load"]);
    assert!(!log.contains("beside"), "{log}");
    assert_eq!(beside, lazy);
}

fn copy_fixture(dst: &Path) {
    for entry in walk(&fixture_dir()) {
        let rel = entry.strip_prefix(fixture_dir()).unwrap();
        if rel.starts_with("reference") {
            continue;
        }
        let target = dst.join(rel);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(&entry, &target).unwrap();
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().filter_map(|e| e.ok()) {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p))
        } else {
            out.push(p)
        }
    }
    out
}

fn assert_fails(run: &Output, needles: &[&str], out: &Path) {
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "should fail");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{stderr:?} lacks {n:?}");
    }
    let files: Vec<_> = std::fs::read_dir(out)
        .map(|r| r.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(files.is_empty(), "left behind: {files:?}");
}

#[test]
fn bad_models_fail_with_a_message_and_leave_nothing() {
    // A tensor whose shape disagrees with the config: the error names it and both shapes.
    let model = scratch("bad-shape-model");
    copy_fixture(&model);
    let weights = model.join("transformer/diffusion_pytorch_model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).unwrap();
    let t = tensors["proj_out.bias"].clone();
    tensors.insert(
        "proj_out.bias".into(),
        candle_core::Tensor::cat(&[&t, &t], 0).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    let out = scratch("bad-shape-out");
    assert_fails(
        &vidgen(&model, &out, &["--prompt", "x"]),
        &["proj_out.bias", "[64]", "[128]"],
        &out,
    );

    // A truncated weights file.
    let model = scratch("truncated-model");
    copy_fixture(&model);
    let weights = model.join("vae/diffusion_pytorch_model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let out = scratch("truncated-out");
    assert_fails(&vidgen(&model, &out, &["--prompt", "x"]), &["vae"], &out);

    // Pickle weights are refused (loading them could run code).
    let model = scratch("pickle-model");
    copy_fixture(&model);
    std::fs::rename(
        model.join("vae/diffusion_pytorch_model.safetensors"),
        model.join("vae/diffusion_pytorch_model.bin"),
    )
    .unwrap();
    let out = scratch("pickle-out");
    assert_fails(
        &vidgen(&model, &out, &["--prompt", "x"]),
        &["pickle", "diffusion_pytorch_model.bin", "safetensors"],
        &out,
    );

    // A folder that is not a diffusers model.
    let model = scratch("not-a-model");
    let out = scratch("not-a-model-out");
    assert_fails(
        &vidgen(&model, &out, &["--prompt", "x"]),
        &["model_index.json"],
        &out,
    );

    // A Hub id that is not cached while offline.
    let out = scratch("offline-out");
    let run = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args([
            "generate",
            "--model",
            "nobody/not-cached-model",
            "--prompt",
            "x",
            "--device",
            "cpu",
            "--output-path",
            out.to_str().unwrap(),
        ])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HUB_CACHE", scratch("empty-cache"))
        .output()
        .unwrap();
    assert_fails(&run, &["nobody/not-cached-model", "HF_HUB_OFFLINE"], &out);
}

#[test]
fn latents_of_the_wrong_shape_are_refused() {
    let dir = scratch("latents");
    let path = dir.join("l.safetensors");
    let t = candle_core::Tensor::zeros(
        (1, 16, 3, 4, 5),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    candle_core::safetensors::save(&[("latents".to_string(), t)].into_iter().collect(), &path)
        .unwrap();
    let out = scratch("latents-out");
    let run = vidgen(
        &fixture_dir(),
        &out,
        &["--prompt", "x", "--latents", path.to_str().unwrap()],
    );
    assert_fails(
        &run,
        &["--latents", "[1, 16, 3, 4, 5]", "[1, 16, 3, 4, 6]"],
        &out,
    );
}

/// Loading reports its bytes: without a terminal, a line per quarter of each component's
/// stored bytes, ending at 100%, in every placement (resident and offloaded).
#[test]
fn loading_reports_progress_in_bytes() {
    let out = scratch("load-progress");
    for placement in [&["--memory-model", "discrete"][..], &[]] {
        let mut args = vec!["--prompt", "a boat", "--output-type", "safetensors"];
        args.extend_from_slice(placement);
        let run = vidgen(&fixture_dir(), &out, &args);
        let log = String::from_utf8_lossy(&run.stderr);
        assert!(run.status.success(), "{log}");
        for component in ["text_encoder", "transformer", "vae"] {
            let stored: u64 = walk(&fixture_dir().join(component))
                .iter()
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .map(|p| std::fs::metadata(p).unwrap().len())
                .sum();
            let done = format!("reading {component}: 100% of ");
            let line = log
                .lines()
                .find(|l| l.contains(&done))
                .unwrap_or_else(|| panic!("{placement:?}: no `{done}` in {log}"));
            let bytes: u64 = line.rsplit(' ').nth(1).unwrap().parse().unwrap();
            // A file is its tensors' bytes plus a JSON header.
            assert!(bytes <= stored && bytes > stored / 2, "{line}");
        }
    }
}

/// `--stats-json` carries the offload engine's copies for the denoise stage: every pass moves
/// each block once, plus the first block of the pass after the last (prefetched); a resident
/// run has none. The text encoder's copies are counted apart.
#[test]
fn stats_count_the_blocks_the_engine_moved() {
    let out = scratch("offload-stats");
    let stats = |name: &str, flags: &[&str]| {
        let path = out.join(format!("{name}.json"));
        let mut args = vec![
            "--prompt",
            "a boat",
            "--output-type",
            "safetensors",
            "--memory-model",
            "discrete",
        ];
        args.extend_from_slice(&["--stats-json", path.to_str().unwrap()]);
        args.extend_from_slice(flags);
        let run = vidgen(&fixture_dir(), &out, &args);
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        json["jobs"][0]["metrics"].clone()
    };
    let layers = 2; // tests/fixtures/wan-tiny-a/transformer/config.json
    let passes = 2 * 2; // 2 steps, each with the negative prompt's pass (guidance 5)
    let streamed = stats("streamed", &["--dit-layerwise-offload"]);
    assert_eq!(
        streamed["forward_seconds"].as_array().unwrap().len(),
        passes
    );
    assert_eq!(streamed["offload"]["groups_copied"], passes * layers + 1);
    assert!(streamed["offload"]["bytes_copied"].as_u64().unwrap() > 0);
    // The streamed text encoder passes once for the prompt and the negative prompt together:
    // each of its blocks moved once, plus the next pass's first (prefetched).
    let encoder_layers = 2; // tests/fixtures/wan-tiny-a/text_encoder/config.json
    assert_eq!(
        streamed["offload_text_encoder"]["groups_copied"],
        encoder_layers + 1,
        "{streamed}"
    );
    // One of the two blocks kept: copied once, the other every pass (alone in its slot run,
    // nothing is prefetched against it); both kept: each copied once.
    for (budget, kept, copied) in [("40KiB", 1, 1 + passes), ("1MiB", 2, 2)] {
        let flags = ["--dit-layerwise-offload", "--dit-resident-memory", budget];
        let m = stats(&format!("kept-{budget}"), &flags);
        assert_eq!(m["offload"]["kept_groups"], kept, "{m}");
        assert!(m["offload"]["kept_bytes"].as_u64() > Some(0), "{m}");
        assert_eq!(m["offload"]["groups_copied"], copied, "{m}");
    }
    let resident = stats(
        "resident",
        &["--no-dit-layerwise-offload", "--no-dit-cpu-offload"],
    );
    assert!(resident.get("offload").is_none(), "{resident}");

    // Bounded below the blocks' size, weights stay in the memory map (the fixture is f32, as
    // the CPU runs); bounded above it, they are all held, as when pinned without a bound.
    let held = |m: &serde_json::Value| m["offload"]["host_bytes"].as_u64().unwrap();
    let bounded = stats("bounded", &["--max-pinned-memory", "4KiB"]);
    assert_eq!(held(&bounded), 0, "{bounded}");
    assert_eq!(bounded["offload"]["groups_copied"], passes * layers + 1);
    let roomy = stats("roomy", &["--max-pinned-memory", "1GiB"]);
    assert_eq!(held(&roomy), held(&streamed), "{roomy}");
    assert!(held(&streamed) > 0);
}
