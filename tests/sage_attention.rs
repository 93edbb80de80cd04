//! `--attention sage` through the command line: every family's DiT attention computes with 8-bit
//! products (`vidgen::models::sage_attention`: int8 Q·Kᵀ over smoothed keys, e4m3 P·V) inside
//! the denoising loop only; the video differs from the exact run's within a small bound, the run's
//! report counts the attentions that ran in 8 bits, and a bad value is refused in one line.

mod common;

use candle_core::Tensor;
use common::{
    cpu_prompt_args, generate_frames, generate_written, named_fixture_dir, relative_l2, run_vidgen,
    scratch_dir,
};
use std::path::Path;

/// The `sage_attentions` count of a `--stats-json` report.
fn sage_attentions(stats: &Path) -> u64 {
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(stats).unwrap()).unwrap();
    report["sage_attentions"].as_u64().unwrap_or(0)
}

/// Wan (tiny checkpoint, three steps with classifier-free guidance, the fixture's draws): the
/// frames with 8-bit attention differ from the exact run's by well under the fp8 matmuls' 6%, and
/// every attention of the six forwards (self and cross, each block) ran in 8 bits; the text
/// encoder's attention did not.
#[test]
fn wan_runs_sage_attention() {
    let fixture = "wan-tiny-a";
    let dir = scratch_dir("sage-attention", "wan");
    let (mut args, draws) = common::wan_tiny_reference_call(&dir);
    let exact = generate_frames(&args, &draws, &dir).unwrap();
    let stats = dir.join("stats.json");
    args.extend(
        [
            "--attention",
            "sage",
            "--stats-json",
            stats.to_str().unwrap(),
        ]
        .map(String::from),
    );
    let sage = generate_frames(&args, &draws, &dir).unwrap();
    let err = relative_l2(&sage, &exact);
    eprintln!("frames: relative L2 {err:.3e}");
    assert!(err > 0.0 && err <= 0.03, "frames: relative L2 {err}");
    let cfg: serde_json::Value = serde_json::from_slice(
        &std::fs::read(named_fixture_dir(fixture).join("transformer/config.json")).unwrap(),
    )
    .unwrap();
    let blocks = cfg["num_layers"].as_u64().unwrap();
    // Three steps, a conditional and an unconditional forward each, two attentions a block.
    assert_eq!(sage_attentions(&stats), 3 * 2 * 2 * blocks);
}

/// Another family (LTX-Video's tiny checkpoint, two steps, seeded): its attention also runs in 8
/// bits, close to the exact video.
#[test]
fn ltx_video_runs_sage_attention() {
    let dir = scratch_dir("sage-attention", "ltx");
    let run = |extra: &[&str]| -> Tensor {
        let mut args = [
            "--model",
            named_fixture_dir("ltx-video-tiny-a").to_str().unwrap(),
            "--prompt",
            "a cat",
            "--height",
            "32",
            "--width",
            "32",
            "--num-frames",
            "9",
            "--num-inference-steps",
            "2",
            "--seed",
            "3",
        ]
        .map(String::from)
        .to_vec();
        args.extend(extra.iter().map(|s| s.to_string()));
        generate_written(&args, &dir).unwrap()["frames"].clone()
    };
    let stats = dir.join("stats.json");
    let exact = run(&[]);
    let sage = run(&[
        "--attention",
        "sage",
        "--stats-json",
        stats.to_str().unwrap(),
    ]);
    let err = relative_l2(&sage, &exact);
    eprintln!("frames: relative L2 {err:.3e}");
    assert!(err > 0.0 && err <= 0.03, "frames: relative L2 {err}");
    assert!(sage_attentions(&stats) > 0);
}

/// An unknown kind is refused in one line naming the kinds there are.
#[test]
fn unknown_kinds_are_refused() {
    let mut args = cpu_prompt_args("wan-tiny-a");
    args.extend(["--attention", "fast", "--dry-run"].map(String::from));
    let out = run_vidgen(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("exact") && stderr.contains("sage"),
        "{stderr}"
    );
}

/// The memory plan counts the 8-bit codes and scales of the self-attention's q, k and v at the
/// run's size (the CPU run's default, 81x480x832) in the denoise stage.
#[test]
fn the_plan_counts_the_codes() {
    use vidgen::models::wan::transformer::WanTransformerConfig;
    let fixture = "wan-tiny-a";
    let added = common::planned_denoise_activations(fixture, &["--attention", "sage"])
        - common::planned_denoise_activations(fixture, &[]);
    let cfg: WanTransformerConfig = common::config_in(fixture, "transformer/config.json");
    let latent = [1, 16, 21, 60, 104];
    let want = vidgen::models::wan::activations::sage_attention_activations(&cfg, latent);
    assert_eq!(added, want);
    // 32,760 tokens (256 blocks of 128 keys less 8) by the fixture's heads and head_dim.
    let (heads, inner) = (
        cfg.num_attention_heads as u64,
        (cfg.num_attention_heads * cfg.attention_head_dim) as u64,
    );
    assert_eq!(
        want,
        (3 * 32760 + 8) * inner + (32760 + 256) * heads * 4 + 4 * inner * 4
    );
}
