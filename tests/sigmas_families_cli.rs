//! `--sigmas` on the families whose diffusers pipeline takes `sigmas=` besides Wan: FLUX.1 (the
//! sequence-length shift applied to them) and HunyuanVideo (its static shift), driven by
//! `sigmas-families/README.json`: each fixture's reference call run again by diffusers with
//! those sigmas (same draws), the frames within 1e-4 + 1e-4|ref| and unlike the default
//! schedule's. A family whose pipeline takes none refuses the flag in one line.

mod common;

use candle_core::Device;
use common::{
    assert_close, max_abs_diff, named_fixture_dir, named_reference, run_reference_case, scratch_dir,
};

const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

#[test]
fn custom_sigmas_make_what_diffusers_makes_of_them() {
    let dir = named_fixture_dir("sigmas-families");
    let readme: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("README.json")).unwrap()).unwrap();
    let refs =
        candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let cases = readme["cli_cases"].as_array().unwrap();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let fixture = case["fixture"].as_str().unwrap();
        let out = scratch_dir("sigmas-families", name);
        let frames = run_reference_case(case, fixture, &[], &out)["frames"].clone();
        let want = refs[case["frames"].as_str().unwrap()].squeeze(0).unwrap();
        assert_close(name, &frames, &want, ATOL, RTOL);
        let default = named_reference(fixture, "pipeline")
            [case["default_frames"].as_str().unwrap()]
        .squeeze(0)
        .unwrap();
        let moved = max_abs_diff(&want, &default);
        assert!(
            moved > 10.0 * ATOL,
            "{name}: the sigmas move frames {moved:.2e}"
        );
    }
    assert_eq!(cases.len(), 2);
    let out = scratch_dir("sigmas-families", "refused");
    let mut args = common::cpu_prompt_args("mochi-tiny-a");
    args.extend(["--sigmas", "1,0.5", "--output-path", out.to_str().unwrap()].map(String::from));
    let line = common::usage_error(&common::run_vidgen(&args), "mochi --sigmas");
    assert!(line.contains("--sigmas does not apply"), "{line}");
}
