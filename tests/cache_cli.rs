//! Step caches (`--cache`) through the command line, driven by `cache-a/README.json`'s
//! `cli_cases` on `wan-tiny-a`: First Block Cache, MagCache (skipping nothing, some or many
//! steps, ratios resampled, calibration), TaylorSeer (module patterns and lite mode) and Pyramid
//! Attention Broadcast give diffusers' frames within 1e-4 + 1e-4|ref|, the same modules computed
//! in every pass of every step, and the calibrated ratios. Bad cache specs are refused in one
//! line.

mod common;

use candle_core::{DType, Device};
use common::{
    assert_close, generate_outputs, max_abs_diff, named_fixture_dir, planned_denoise_activations,
    run_vidgen, scratch_dir, usage_error,
};

#[test]
fn caches_skip_and_compute_what_diffusers_does() {
    let fixture = named_fixture_dir("cache-a");
    let readme: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture.join("README.json")).unwrap()).unwrap();
    let refs =
        candle_core::safetensors::load(fixture.join("cache.safetensors"), &Device::Cpu).unwrap();
    let dir = scratch_dir("cache", "cases");
    let draws = dir.join("draws.safetensors");
    let latents =
        std::collections::HashMap::from([("latents".to_string(), refs["latents_init"].clone())]);
    candle_core::safetensors::save(&latents, &draws).unwrap();
    let model = named_fixture_dir("wan-tiny-a");
    let mut ran = 0;
    for case in readme["cli_cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let mut args: Vec<String> = vec!["--model".into(), model.to_str().unwrap().into()];
        args.extend(common::strings(&case["args"]));
        let got = generate_outputs(&args, &draws, &dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let frames = &refs[case["frames"].as_str().unwrap()].squeeze(0).unwrap();
        eprintln!(
            "{name}: max |diff| {:.3e}",
            max_abs_diff(&got["frames"], frames)
        );
        assert_close(name, &got["frames"], frames, 1e-4, 1e-4);
        for (written, reference) in case["computed"].as_object().unwrap() {
            let got = got
                .get(written)
                .unwrap_or_else(|| panic!("{name}: no {written}"));
            assert_eq!(got.dtype(), DType::U8, "{name}: {written}");
            let want = &refs[reference.as_str().unwrap()];
            assert_eq!(
                got.to_vec2::<u8>().unwrap(),
                want.to_vec2::<u8>().unwrap(),
                "{name}: {written}"
            );
        }
        for (written, reference) in case["calibration_ratios"].as_object().unwrap() {
            let got = got
                .get(written)
                .unwrap_or_else(|| panic!("{name}: no {written}"));
            assert_close(name, got, &refs[reference.as_str().unwrap()], 1e-4, 1e-4);
        }
        let extra = got.keys().filter(|k| k.starts_with("cache.")).count();
        let declared = case["computed"].as_object().unwrap().len()
            + case["calibration_ratios"].as_object().unwrap().len();
        assert_eq!(extra, declared, "{name}: {:?}", got.keys());
        ran += 1;
    }
    assert!(ran >= 29, "{ran} cases");
}

#[test]
fn bad_cache_specs_are_refused_in_one_line() {
    let dir = scratch_dir("cache", "refused");
    for (spec, says) in [
        (
            "taylorseer:cache_identifiers=blocks(",
            "not a regular expression",
        ),
        ("magcache:threshold=0.1", "needs mag_ratios"),
        ("first-block:fast", "not a finite number"),
    ] {
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
            "--cache",
            spec,
        ]
        .map(String::from);
        let line = usage_error(&run_vidgen(&args), spec);
        assert!(line.contains(says), "{spec}: {line}");
    }
}

/// The plan counts what a cache holds through the loop: three hidden states per pass for
/// First Block Cache, one for MagCache, one per block and kind of attention for PAB, in the
/// denoise stage's activations.
#[test]
fn the_plan_counts_the_hidden_states_a_cache_holds() {
    let denoise_activations = |cache: &[&str]| planned_denoise_activations("wan-tiny-a", cache);
    let plain = denoise_activations(&[]);
    let first_block = denoise_activations(&["--cache", "first-block:0.1"]) - plain;
    let mag = denoise_activations(&["--cache", "magcache:calibrate=true"]) - plain;
    assert!(mag > 0, "MagCache holds its residuals");
    assert_eq!(first_block, 3 * mag);
    // PAB holds one output per block and kind of attention it reuses (MagCache: two states).
    let config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(named_fixture_dir("wan-tiny-a").join("transformer/config.json")).unwrap(),
    )
    .unwrap();
    let layers = config["num_layers"].as_u64().unwrap();
    let spatial = ["--cache", "pab:spatial_attention_block_skip_range=2"];
    let both = [
        "--cache",
        "pab:spatial_attention_block_skip_range=2,cross_attention_block_skip_range=3",
    ];
    assert_eq!(denoise_activations(&spatial) - plain, layers * mag / 2);
    assert_eq!(denoise_activations(&both) - plain, layers * mag);
}

/// The progress says in one line what the cache stood in for, per pass: the same counts as the
/// modules diffusers skipped in the fixture's run.
#[test]
fn the_progress_line_counts_what_the_cache_stood_in_for() {
    let fixture = named_fixture_dir("cache-a");
    let readme: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture.join("README.json")).unwrap()).unwrap();
    let refs =
        candle_core::safetensors::load(fixture.join("cache.safetensors"), &Device::Cpu).unwrap();
    let case = readme["cli_cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "fbc_some.cfg5")
        .expect("the fixture's first-block case");
    let dir = scratch_dir("cache", "progress");
    let draws = dir.join("draws.safetensors");
    let latents =
        std::collections::HashMap::from([("latents".to_string(), refs["latents_init"].clone())]);
    candle_core::safetensors::save(&latents, &draws).unwrap();
    let model = named_fixture_dir("wan-tiny-a");
    let mut args: Vec<String> = ["generate", "--model", model.to_str().unwrap()]
        .map(String::from)
        .to_vec();
    args.extend(common::strings(&case["args"]));
    args.extend(
        [
            "--latents",
            draws.to_str().unwrap(),
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
        .map(String::from),
    );
    let out = run_vidgen(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let counts = |pass: &str| {
        let reference = case["computed"][format!("cache.computed.{pass}")]
            .as_str()
            .unwrap();
        let rows = refs[reference].to_vec2::<u8>().unwrap();
        let skipped = |r: &Vec<u8>| r.iter().filter(|&&c| c == 0).count();
        format!(
            "{pass}: {} of {} forwards skipped work, {} of {} modules stood in for",
            rows.iter().filter(|r| skipped(r) > 0).count(),
            rows.len(),
            rows.iter().map(skipped).sum::<usize>(),
            rows.iter().map(|r| r.len()).sum::<usize>(),
        )
    };
    let want = format!(
        "  cache first-block: {}; {}",
        counts("cond"),
        counts("uncond")
    );
    assert!(
        stderr.lines().any(|l| l == want),
        "no line {want:?} in:\n{stderr}"
    );
    assert!(!want.contains("cond: 0 of"), "the case skips work: {want}");
}
