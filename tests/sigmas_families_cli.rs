//! `--sigmas` on the families whose diffusers pipeline takes `sigmas=` besides Wan: FLUX.1 (the
//! sequence-length shift applied to them) and HunyuanVideo (its static shift), driven by
//! `sigmas-families/README.json`: each fixture's reference call run again by diffusers with
//! those sigmas (same draws), the frames within 1e-4 + 1e-4|ref| and unlike the default
//! schedule's. A family whose pipeline takes none refuses the flag in one line.

mod common;

use common::{check_reference_frames, references, scratch_dir};

#[test]
fn custom_sigmas_make_what_diffusers_makes_of_them() {
    let (readme, refs) = references("sigmas-families", "reference.safetensors");
    let cases = readme["cli_cases"].as_array().unwrap();
    for case in cases {
        check_reference_frames(case, &refs, &[], ("sigmas-families", "default_frames"));
    }
    assert_eq!(cases.len(), 2);
    let out = scratch_dir("sigmas-families", "refused");
    let mut args = common::cpu_prompt_args("mochi-tiny-a");
    args.extend(["--sigmas", "1,0.5", "--output-path", out.to_str().unwrap()].map(String::from));
    let line = common::usage_error(&common::run_vidgen(&args), "mochi --sigmas");
    assert!(line.contains("--sigmas does not apply"), "{line}");
}
