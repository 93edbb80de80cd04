//! Layerwise fp8 storage (`--storage-dtype float8_e4m3fn|float8_e5m2`) on every family beyond
//! Wan whose transformer is diffusers', driven by `storage-families/README.json`'s `cli_cases`
//! (diffusers' `pipe.transformer.enable_layerwise_casting(storage_dtype, compute_dtype=float32)`
//! around each tiny fixture's reference call, same draws): the frames within 1e-4 + 1e-4|ref|
//! of diffusers', which are not the float32 weights' frames (each model's own skip patterns
//! decide which Linears are rounded).

mod common;

use candle_core::Device;
use common::{
    assert_close, max_abs_diff, named_fixture_dir, named_reference, run_reference_case, run_vidgen,
    scratch_dir,
};

const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

#[test]
fn fp8_storage_computes_what_diffusers_layerwise_casting_does_in_every_family() {
    let dir = named_fixture_dir("storage-families");
    let readme: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("README.json")).unwrap()).unwrap();
    let refs =
        candle_core::safetensors::load(dir.join("storage.safetensors"), &Device::Cpu).unwrap();
    let mut fixtures = std::collections::BTreeSet::new();
    for case in readme["cli_cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let fixture = case["fixture"].as_str().unwrap();
        let out = scratch_dir("storage-families", name);
        let frames = run_reference_case(case, fixture, &[], &out)["frames"].clone();
        let pipeline = named_reference(fixture, "pipeline");
        let want = refs[case["frames"].as_str().unwrap()].squeeze(0).unwrap();
        assert_close(name, &frames, &want, ATOL, RTOL);
        // The rounding moves the frames: a run that reads the weights unrounded fails above.
        let float32 = pipeline[case["float32_frames"].as_str().unwrap()]
            .squeeze(0)
            .unwrap();
        let moved = max_abs_diff(&want, &float32);
        assert!(moved > 10.0 * ATOL, "{name}: fp8 moves frames {moved:.2e}");
        fixtures.insert(fixture.to_string());
    }
    assert_eq!(fixtures.len(), 7, "{fixtures:?}");
}

/// MiniMax H3's transformer is not diffusers': `--storage-dtype` is refused for it in one line.
#[test]
fn fp8_storage_is_refused_where_no_diffusers_model_defines_it() {
    let dir = scratch_dir("storage-families", "refused");
    let mut args = common::cpu_prompt_args("minimax-h3-tiny-a");
    args.extend(
        [
            "--output-path",
            dir.to_str().unwrap(),
            "--storage-dtype",
            "float8_e4m3fn",
        ]
        .map(String::from),
    );
    let line = common::usage_error(&run_vidgen(&args), "minimax-h3-tiny-a");
    assert!(line.contains("--storage-dtype does not apply"), "{line}");
}
