//! Layerwise fp8 storage (`--storage-dtype float8_e4m3fn|float8_e5m2`) on every family beyond
//! Wan whose transformer is diffusers', driven by `storage-families/README.json`'s `cli_cases`
//! (diffusers' `pipe.transformer.enable_layerwise_casting(storage_dtype, compute_dtype=float32)`
//! around each tiny fixture's reference call, same draws): the frames within 1e-4 + 1e-4|ref|
//! of diffusers', which are not the float32 weights' frames (each model's own skip patterns
//! decide which Linears are rounded).

mod common;

use common::{check_reference_frames, references, run_vidgen, scratch_dir};

#[test]
fn fp8_storage_computes_what_diffusers_layerwise_casting_does_in_every_family() {
    let (readme, refs) = references("storage-families", "storage.safetensors");
    let mut fixtures = std::collections::BTreeSet::new();
    for case in readme["cli_cases"].as_array().unwrap() {
        check_reference_frames(case, &refs, &[], ("storage-families", "float32_frames"));
        fixtures.insert(case["fixture"].as_str().unwrap().to_string());
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
