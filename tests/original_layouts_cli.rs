//! Single files in the original layouts diffusers converts with `from_single_file`, through
//! `--transformer`: FLUX.1's (Black Forest Labs), HunyuanVideo's and Mochi-1's, whose q, k and v
//! are fused in one matrix (with the MLP's input in a single block's `linear1`) and whose output
//! norm's modulation (Mochi-1: its SwiGLU's halves too) is stored swapped, and LTX-Video's (a
//! renaming, the VAE in the same file); bare in float32, as a Q8_0 GGUF (the fused matrices cut
//! by rows of quantized blocks), and in the forms the community shares (ComfyUI's prefix, bf16,
//! fp8 block weights). Driven by `original-layouts/README.json`: each file's frames within
//! 1e-4 + 1e-4|ref| of diffusers' with the transformer it converts from the file (`make.py`),
//! the same draws as the fixture's call.

mod common;

use common::{
    assert_close, max_abs_diff, named_fixture_dir, named_reference, references, run_reference_case,
    scratch_dir,
};

const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

#[test]
fn original_layout_files_make_what_diffusers_makes_of_them() {
    let dir = named_fixture_dir("original-layouts");
    let (readme, refs) = references("original-layouts", "reference.safetensors");
    let cases = readme["cases"].as_array().unwrap();
    let mut fixtures = std::collections::BTreeSet::new();
    // MiniMax H3's files (no diffusers pipeline to make frames of them) are run by its own
    // suite against the fixture's reference.
    let cases: Vec<_> = cases.iter().filter(|c| !c["frames"].is_null()).collect();
    for case in &cases {
        let file = case["file"].as_str().unwrap();
        let fixture = case["fixture"].as_str().unwrap();
        let out = scratch_dir("original-layouts", file);
        let transformer = ["--transformer", dir.join(file).to_str().unwrap()].map(String::from);
        let frames = run_reference_case(case, fixture, &transformer, &out)["frames"].clone();
        let pipeline = named_reference(fixture, "pipeline");
        let want = refs[case["frames"].as_str().unwrap()].squeeze(0).unwrap();
        assert_close(file, &frames, &want, ATOL, RTOL);
        // The other files' rounding moves the frames from the folder's: a run that read the
        // folder's weights instead fails above.
        let folder = pipeline[case["folder_frames"].as_str().unwrap()]
            .squeeze(0)
            .unwrap();
        let moved = max_abs_diff(&want, &folder);
        assert_eq!(
            moved > 10.0 * ATOL,
            !file.ends_with("-original.safetensors"),
            "{file}: {moved:.2e}"
        );
        fixtures.insert(fixture.to_string());
    }
    assert_eq!((cases.len(), fixtures.len()), (12, 4));
}
