//! `--lora` and `--transformer` name files of Hugging Face Hub repositories as
//! `hf:OWNER/REPO/PATH`, read from the Hub cache (`HF_HUB_CACHE`, no network here) as `--model`'s
//! files are: the same frames as the local files give (a LoRA against diffusers' reference, a
//! GGUF single file against the run of its local copy); a file the cache lacks offline, or a
//! name without a repository, is refused in one line before any work.

mod common;

use candle_core::{Device, Tensor};
use common::{assert_close, max_abs_diff, named_fixture_dir, scratch_dir};
use std::collections::HashMap;
use std::path::Path;

/// The Hub repository the fake cache holds.
const REPO: &str = "vidgen-tests/community";

/// A Hub cache holding `files` (its path in the repository, the fixture file) in `REPO`'s
/// snapshot of `main`, as huggingface_hub lays one out.
fn hub_cache(dir: &Path, files: &[(&str, &Path)]) -> std::path::PathBuf {
    let cache = dir.join("hub");
    let repo = cache.join(format!("models--{}", REPO.replace('/', "--")));
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123456789abcdef").unwrap();
    for (path, fixture) in files {
        let target = repo.join("snapshots/0123456789abcdef").join(path);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(fixture, target).unwrap();
    }
    cache
}

/// `vidgen generate ARGS` on the CPU in f32 with the Hub cache `cache`, offline, writing into
/// `dir`: the frames, or the exit code and stderr.
fn generate(args: &[String], cache: &Path, dir: &Path) -> Result<Tensor, (Option<i32>, String)> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .arg("generate")
        .args(args)
        .args(["--device", "cpu", "--dtype", "f32"])
        .args(["--output-type", "safetensors", "--overwrite"])
        .args(["--output-path".as_ref(), dir.as_os_str()])
        .args(["--output-video-name", "v"])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HUB_CACHE", cache)
        .output()
        .unwrap();
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        return Err((out.status.code(), stderr));
    }
    let written = candle_core::safetensors::load(dir.join("v.safetensors"), &Device::Cpu).unwrap();
    Ok(written["frames"].clone())
}

#[test]
fn hub_files_are_read_from_the_cache() {
    let dir = scratch_dir("hub-files", "cache");
    let lora = named_fixture_dir("wan-loras").join("wan-original-peft.safetensors");
    let gguf = named_fixture_dir("original-layouts").join("flux-tiny-a-Q8_0.gguf");
    let cache = hub_cache(
        &dir,
        &[("loras/wan.safetensors", &lora), ("flux/q8.gguf", &gguf)],
    );

    // The Wan LoRA of `wan-loras` at scale 0.7, named on the Hub: diffusers' frames.
    let (readme, refs) = common::references("wan-loras", "reference.safetensors");
    let case = &readme["cli_cases"][1];
    assert_eq!(case["scale"], 0.7);
    let ecosystem = candle_core::safetensors::load(
        named_fixture_dir("ecosystem-a").join("lora.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let draws = dir.join("draws.safetensors");
    let latents = HashMap::from([("latents".to_string(), ecosystem["latents_init"].clone())]);
    candle_core::safetensors::save(&latents, &draws).unwrap();
    let wan = named_fixture_dir("wan-tiny-a");
    let mut args = vec!["--model".to_string(), wan.to_str().unwrap().to_string()];
    args.extend(common::strings(&case["args"]));
    args.extend(["--latents".to_string(), draws.to_str().unwrap().to_string()]);
    let mut hub = args.clone();
    hub.extend([
        "--lora".into(),
        format!("hf:{REPO}/loras/wan.safetensors:0.7"),
    ]);
    let frames = generate(&hub, &cache, &dir).unwrap_or_else(|(_, e)| panic!("{e}"));
    let expected = refs[case["frames"].as_str().unwrap()].squeeze(0).unwrap();
    assert_close("hub LoRA", &frames, &expected, 1e-4, 1e-4);

    // A GGUF single file of FLUX.1 named on the Hub: the run of its local copy, bit for bit.
    let flux = named_fixture_dir("flux-tiny-a");
    let run = |transformer: &str| {
        let mut args = vec!["--model".to_string(), flux.to_str().unwrap().to_string()];
        args.extend(
            [
                "--prompt",
                "a red fox",
                "--seed",
                "1",
                "--height",
                "64",
                "--width",
                "64",
                "--num-inference-steps",
                "2",
                "--transformer",
                transformer,
            ]
            .map(String::from),
        );
        generate(&args, &cache, &dir).unwrap_or_else(|(_, e)| panic!("{transformer}: {e}"))
    };
    let local = run(gguf.to_str().unwrap());
    let hub = run(&format!("hf:{REPO}/flux/q8.gguf"));
    assert_eq!(max_abs_diff(&local, &hub), 0.0);

    // Refused in one line before any work: a file the cache lacks offline, a name without a
    // repository.
    for (flag, value, says) in [
        (
            "--lora",
            format!("hf:{REPO}/loras/missing.safetensors"),
            "has no file loras/missing.safetensors in the Hugging Face cache",
        ),
        (
            "--transformer",
            format!("hf:{REPO}/flux/missing.gguf"),
            "has no file flux/missing.gguf in the Hugging Face cache",
        ),
        (
            "--lora",
            "hf:community".to_string(),
            "name a file of a Hugging Face Hub repository as hf:OWNER/REPO/PATH",
        ),
    ] {
        let mut bad = args.clone();
        bad.extend([flag.to_string(), value.clone()]);
        let (code, stderr) = generate(&bad, &cache, &dir).expect_err(&value);
        assert_eq!(code, Some(2), "{value}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{value}: {stderr}");
        assert!(stderr.contains(says), "{value}: {stderr}");
    }
}
