//! `--fp8-matmul` for MiniMax H3 on the tiny `minimax-h3-tiny-a` checkpoint: the main blocks'
//! attention and feed-forward Linears in e4m3 change each forward by about e4m3's precision
//! (the token refiner, AdaLN projections, embedders and heads stay exact), and the plan counts
//! each block's weight codes and the largest Linear input's codes.

mod common;

use candle_core::{Device, Tensor};
use vidgen::models::minimax_h3::activations::{fp8_block_codes, fp8_matmul_activations};
use vidgen::models::minimax_h3::transformer::{
    MiniMaxH3Transformer3DModel, MiniMaxH3TransformerConfig, PackedLayout,
};

const FIXTURE: &str = "minimax-h3-tiny-a";

fn config() -> MiniMaxH3TransformerConfig {
    common::config_in(FIXTURE, "transformer/config.json")
}

/// The fixture's transformer (two blocks of width 24, attention 32, SwiGLU 48) with its
/// blocks' Linears in fp8, on the fixture's packed reference inputs at step 1's timesteps and
/// at two late ones: each video and audio velocity within 0.65% (relative L2) of the exact
/// one and not equal to it. Measured: video 0.29%, audio 0.50% at both.
#[test]
fn forwards_stay_close_to_the_exact_ones() {
    let model = |fp8_matmul| {
        let cfg = MiniMaxH3TransformerConfig {
            fp8_matmul,
            ..config()
        };
        let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
        MiniMaxH3Transformer3DModel::new(&cfg, vb).unwrap()
    };
    let (exact, fp8) = (model(false), model(true));
    let r = common::named_reference(FIXTURE, "transformer");
    let layout = PackedLayout {
        token_tags: r["token_tags"].clone(),
        position_ids: r["position_ids"].clone(),
        video_indices: r["video_indices"].clone(),
        audio_indices: r["audio_indices"].clone(),
        text_indices: r["text_indices"].clone(),
    };
    let late = Tensor::new(&[0.1f32, 0.05], &Device::Cpu).unwrap();
    for (what, timestep) in [("step 1", &r["timestep"]), ("late", &late)] {
        let run = |m: &MiniMaxH3Transformer3DModel| {
            m.forward(
                &r["hidden_states"],
                &r["audio_hidden_states"],
                &r["encoder_hidden_states"],
                timestep,
                &r["timestep_indices"],
                &layout,
            )
            .unwrap()
        };
        let ((video, audio), (video_exact, audio_exact)) = (run(&fp8), run(&exact));
        for (output, got, want) in [("video", video, video_exact), ("audio", audio, audio_exact)] {
            let err = common::relative_l2(&got, &want);
            eprintln!("MiniMax H3 {what} {output}: relative L2 {err:.3e}");
            assert!(
                err > 0.0 && err <= 0.0065,
                "{what} {output}: relative L2 {err}"
            );
        }
    }
}

/// A resident CPU run's plan adds, with `--fp8-matmul`, every block's weight codes and the
/// largest Linear input's codes with a product's workspace; a streamed one, one block's.
#[test]
fn the_plan_counts_each_blocks_codes() {
    let added_by = |placement: &[&str]| {
        let fp8 = [placement, &["--fp8-matmul"]].concat();
        common::planned_denoise_activations(FIXTURE, &fp8)
            - common::planned_denoise_activations(FIXTURE, placement)
    };
    let cfg = config();
    let codes = fp8_block_codes(&cfg);
    // A block's q, k and v (24 to 32), `to_out` and SwiGLU (24 to 2 x 48, 48 to 24), with an
    // f32 scale per output channel.
    let block =
        3 * (24 * 32 + 4 * 32) + (32 * 24 + 4 * 24) + (24 * 96 + 4 * 96) + (48 * 24 + 4 * 24);
    assert_eq!(codes, vec![block; cfg.num_layers]);
    // The default 124 frames of 768x1344: 37 latent frames of 96 x 168 rows, 414 audio rows,
    // 512 text rows, all in one chunk: its SwiGLU's gated state (48 wide) is the largest input.
    let rows = 37 * 96 * 168 + 414 + 512;
    let inputs = fp8_matmul_activations(&cfg, rows);
    assert_eq!(inputs, rows as u64 * (48 + 4) + (32 << 20));
    assert_eq!(
        added_by(&[]),
        inputs + codes.iter().sum::<u64>(),
        "resident"
    );
    let streamed = ["--memory-model", "discrete"];
    assert_eq!(
        added_by(&streamed),
        inputs + block,
        "streamed block by block"
    );
}
