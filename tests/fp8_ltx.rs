//! `--fp8-matmul` for LTX-Video: the fixture transformer's block Linears in e4m3 change each
//! forward by about e4m3's precision and no more, and the plan counts what they add.

mod common;

use candle_core::Tensor;
use vidgen::models::ltx::activations::{fp8_block_codes, fp8_matmul_activations};
use vidgen::models::ltx::defaults::MAX_SEQUENCE_LENGTH;
use vidgen::models::ltx::transformer::{LtxTransformer3DModel, LtxTransformerConfig};

const FIXTURE: &str = "ltx-video-tiny-a";

fn config() -> LtxTransformerConfig {
    common::config_in(FIXTURE, "transformer/config.json")
}

/// The fixture's transformer, its blocks' Linears in fp8 where `fp8`.
fn transformer(fp8: bool) -> LtxTransformer3DModel {
    let cfg = LtxTransformerConfig {
        fp8_matmul: fp8,
        ..config()
    };
    let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
    LtxTransformer3DModel::new(&cfg, vb).unwrap()
}

/// The fixture's transformer with its blocks' Linears in fp8, on the reference inputs (2 x 2 x 2
/// tokens, 16 masked text tokens) at both timesteps, alone and as a CFG batch of two: each
/// output within 3.4% (relative L2) of the exact one and not equal to it. Measured: 2.6% at
/// timestep 937.5 and 2.2% at 1000, alone and batched alike (width 32: sums of few terms average
/// little of e4m3's rounding away).
#[test]
fn forwards_stay_close_to_the_exact_ones() {
    let (exact, fp8) = (transformer(false), transformer(true));
    let r = common::named_reference(FIXTURE, "transformer");
    let two = |t: &Tensor| Tensor::cat(&[t, t], 0).unwrap();
    let (grid, scale) = ([2, 2, 2], [0.32, 32.0, 32.0]);
    for t in ["timestep", "timestep_1000"] {
        for batch in [1, 2] {
            let input = |name: &str| match batch {
                1 => r[name].clone(),
                _ => two(&r[name]),
            };
            let mask = input("encoder_attention_mask");
            let run = |m: &LtxTransformer3DModel| {
                let (x, text) = (input("hidden_states"), input("encoder_hidden_states"));
                m.forward(&x, &text, &r[t], Some(&mask), grid, scale)
                    .unwrap()
            };
            let err = common::relative_l2(&run(&fp8), &run(&exact));
            eprintln!("{t}, batch {batch}: relative L2 {err:.3e}");
            assert!(err > 0.0 && err <= 0.034, "{t}, batch {batch}: {err}");
        }
    }
}

/// The plan adds, for a resident CPU run, the largest Linear input's codes (the feed-forward's
/// hidden state over the CFG batch's video tokens) and every block's weight codes.
#[test]
fn the_plan_counts_the_fp8_codes() {
    let placement = ["--height", "512", "--width", "704", "--num-frames", "161"];
    let fp8 = [&placement[..], &["--fp8-matmul"]].concat();
    let added = common::planned_denoise_activations(FIXTURE, &fp8)
        - common::planned_denoise_activations(FIXTURE, &placement);
    let cfg = config();
    let codes = fp8_block_codes(&cfg);
    assert_eq!(codes.len(), cfg.num_layers);
    // A width-32 block's six attention Linears over the video and two over the text (width
    // 32), and its feed-forward's two (width 128), with an f32 scale per output channel.
    assert_eq!(
        codes[0],
        8 * (32 * 32 + 4 * 32) + (32 * 128 + 4 * 128) + (128 * 32 + 4 * 32)
    );
    // 21 x 16 x 22 latent tokens (32x spatial, 8x temporal compression) twice, by 128: more
    // than the 128 text tokens twice by 32.
    let tokens = 21 * 16 * 22;
    let inputs = fp8_matmul_activations(&cfg, tokens, MAX_SEQUENCE_LENGTH, 2);
    assert_eq!(inputs, 2 * tokens as u64 * (128 + 4) + (32 << 20));
    assert_eq!(added, inputs + codes.iter().sum::<u64>(), "resident");
}
