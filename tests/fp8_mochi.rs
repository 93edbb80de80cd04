//! `--fp8-matmul` for Mochi-1 on the tiny `mochi-tiny-a` checkpoint: the blocks' attention and
//! feed-forward Linears in e4m3 change each forward by about e4m3's precision, and the plan
//! counts each block's weight codes (the last, `context_pre_only`, holds fewer) and the largest
//! Linear input's codes.

mod common;

use vidgen::models::mochi::activations::{fp8_block_codes, fp8_matmul_activations};
use vidgen::models::mochi::transformer::{MochiTransformer3DModel, MochiTransformerConfig};

const FIXTURE: &str = "mochi-tiny-a";

fn config() -> MochiTransformerConfig {
    common::config_in(FIXTURE, "transformer/config.json")
}

/// The fixture's transformer (two blocks, widths 32 and 24) with its blocks' Linears in fp8, on
/// the fixture's reference inputs: each output within 5.3% (relative L2) of the exact one and
/// not equal to it. Measured: 3.8% at t = 212.5, 4.1% at t = 0 (widths 24-85: sums of few
/// terms average little of e4m3's rounding away).
#[test]
fn forwards_stay_close_to_the_exact_ones() {
    let model = |fp8_matmul| {
        let cfg = MochiTransformerConfig {
            fp8_matmul,
            ..config()
        };
        let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
        MochiTransformer3DModel::new(&cfg, vb).unwrap()
    };
    let (exact, fp8) = (model(false), model(true));
    let r = common::named_reference(FIXTURE, "transformer");
    for t in ["timestep", "timestep_0"] {
        let run = |m: &MochiTransformer3DModel| {
            m.forward(
                &r["hidden_states"],
                &r[t],
                &r["encoder_hidden_states"],
                &r["encoder_attention_mask"],
            )
            .unwrap()
        };
        let err = common::relative_l2(&run(&fp8), &run(&exact));
        eprintln!("Mochi-1 {t}: relative L2 {err:.3e}");
        assert!(err > 0.0 && err <= 0.053, "{t}: relative L2 {err}");
    }
}

/// A resident CPU run's plan adds, with `--fp8-matmul`, every block's weight codes (the
/// `context_pre_only` block's fewer: no text queries, text output or text feed-forward) and the
/// largest Linear input's codes with a product's workspace.
#[test]
fn the_plan_counts_each_blocks_codes() {
    let size = [
        "--height",
        "480",
        "--width",
        "848",
        "--num-frames",
        "19",
        "--max-sequence-length",
        "256",
    ];
    let fp8 = [&size[..], &["--fp8-matmul"]].concat();
    let added = common::planned_denoise_activations(FIXTURE, &fp8)
        - common::planned_denoise_activations(FIXTURE, &size);
    let cfg = config();
    let codes = fp8_block_codes(&cfg);
    assert_eq!(codes.len(), cfg.num_layers);
    // 4 latent frames of 30 x 53 patches, both prompts of the guided batch: their SwiGLU's
    // gated hidden state (85 wide) is the largest input at this size.
    let tokens = 4 * 30 * 53;
    let inputs = fp8_matmul_activations(&cfg, tokens, 256, 2);
    let ff = MochiTransformerConfig::ff_inner_dim(cfg.inner_dim()) as u64;
    assert_eq!(inputs, 2 * tokens as u64 * (ff + 4) + (32 << 20));
    assert_eq!(added, inputs + codes.iter().sum::<u64>(), "resident");
    assert!(codes[0] > codes[cfg.num_layers - 1], "{codes:?}");
}
