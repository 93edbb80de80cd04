//! `--stats-json` reads the same for every family: the frame records what each stage took and
//! what the offload engine moved for every component a stage uses, so no family reports less.

mod common;

use common::named_fixture_dir;
use serde_json::Value;
use std::collections::BTreeSet;
use std::process::Command;

/// Every family's tiny fixture.
const FIXTURES: [&str; 9] = [
    "wan-tiny-a",
    "ltx-video-tiny-a",
    "cogvideox-tiny-a",
    "hunyuanvideo-tiny-a",
    "minimax-h3-tiny-a",
    "latte-tiny-a",
    "mochi-tiny-a",
    "allegro-tiny-a",
    "flux-tiny-a",
];

/// The keys of a JSON object.
fn keys(value: &Value) -> BTreeSet<String> {
    value
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {value}"))
        .keys()
        .cloned()
        .collect()
}

/// The stats of a two-step run of `fixture` at its reference size, the DiT streamed and the
/// text encoders and VAEs offloaded.
fn stats(fixture: &str, dir: &std::path::Path) -> Value {
    let model = named_fixture_dir(fixture);
    let readme: Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("reference/README.json")).unwrap(),
    )
    .unwrap();
    let preset = &readme["preset"];
    let path = dir.join(format!("{fixture}.json"));
    let mut command = Command::new(env!("CARGO_BIN_EXE_vidgen"));
    command
        .args(["generate", "--model"])
        .arg(&model)
        .args(["--prompt", "a boat", "--device", "cpu", "--output-path"])
        .arg(dir)
        .args(["--output-type", "safetensors", "--num-inference-steps", "2"])
        .args(["--memory-model", "discrete", "--dit-layerwise-offload"])
        .args(["--text-encoder-cpu-offload", "--vae-cpu-offload"])
        .arg("--stats-json")
        .arg(&path)
        .env("HF_HUB_OFFLINE", "1");
    for key in ["height", "width", "num_frames", "max_sequence_length"] {
        if let Some(v) = preset[key].as_u64() {
            command.arg(format!("--{}", key.replace('_', "-")));
            command.arg(v.to_string());
        }
    }
    let out = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{fixture}: {stderr}");
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

#[test]
fn every_family_reports_the_same_keys() {
    let dir = std::env::temp_dir().join(format!("vidgen-stats-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let runs: Vec<(&str, Value)> = FIXTURES.iter().map(|f| (*f, stats(f, &dir))).collect();
    let (first, reference) = &runs[0];
    // What every family's run and job report, and the metrics of the stages every family has:
    // each stage's time and peaks, the forwards, and what moved for the DiT, the text
    // encoder and the VAE.
    let shared: BTreeSet<String> = ["stages", "forward_seconds", "offload"]
        .into_iter()
        .chain(["offload_text_encoder", "offload_vae"])
        .map(String::from)
        .collect();
    for (fixture, run) in &runs {
        assert_eq!(keys(run), keys(reference), "{fixture} vs {first}");
        let job = &run["jobs"][0];
        assert_eq!(
            keys(job),
            keys(&reference["jobs"][0]),
            "{fixture} vs {first}"
        );
        let metrics = keys(&job["metrics"]);
        assert!(metrics.is_superset(&shared), "{fixture}: {metrics:?}");
        // The rest is what moved for the family's other components, and where components
        // loaded beside a stage, the seconds each such stage waited for them.
        for key in metrics.difference(&shared) {
            if key == "waited_for_loads_beside" {
                for (stage, waited) in job["metrics"][key].as_object().unwrap() {
                    assert!(
                        job["metrics"]["stages"].get(stage).is_some(),
                        "{fixture}: {stage}"
                    );
                    assert!(waited.as_f64() >= Some(0.0), "{fixture}: {stage} {waited}");
                }
                continue;
            }
            assert!(key.starts_with("offload_"), "{fixture}: {key}");
            let moved = &job["metrics"][key];
            assert_eq!(keys(moved), keys(&job["metrics"]["offload"]), "{fixture}");
        }
        assert!(job["metrics"]["offload"]["groups_copied"].as_u64() > Some(0));
    }
    std::fs::remove_dir_all(&dir).ok();
}
