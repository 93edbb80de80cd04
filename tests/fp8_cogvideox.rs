//! `--fp8-matmul` for CogVideoX: the blocks' attention and feed-forward Linears as fp8 matmuls
//! change the tiny fixture's forward by about e4m3's precision and no more, and the memory plan
//! counts what the codes add to the denoise stage.

mod common;

use vidgen::models::cogvideox::activations::{fp8_block_codes, fp8_matmul_activations};
use vidgen::models::cogvideox::transformer::{
    CogVideoXTransformer3DModel, CogVideoXTransformerConfig,
};

const FIXTURE: &str = "cogvideox-tiny-a";

fn config() -> CogVideoXTransformerConfig {
    common::config_in(FIXTURE, "transformer/config.json")
}

/// The fixture's transformer (two blocks of width 32), its blocks' Linears in fp8 where `fp8`,
/// on its reference inputs at both timesteps: each fp8 output within 2% (relative L2) of the
/// exact one and not equal to it. Measured: 1.32% at t = 999, 1.53% at t = 500.
#[test]
fn forwards_stay_close_to_the_exact_ones() {
    const BOUND: f32 = 0.02;
    let model = |fp8_matmul: bool| {
        let cfg = CogVideoXTransformerConfig {
            fp8_matmul,
            ..config()
        };
        let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
        CogVideoXTransformer3DModel::new(&cfg, vb).unwrap()
    };
    let (exact, fp8) = (model(false), model(true));
    let r = common::named_reference(FIXTURE, "transformer");
    for t in ["timestep", "timestep_500"] {
        let run = |m: &CogVideoXTransformer3DModel| {
            m.forward(&r["hidden_states"], &r[t], &r["encoder_hidden_states"])
                .unwrap()
        };
        let err = common::relative_l2(&run(&fp8), &run(&exact));
        eprintln!("{t}: relative L2 {err:.3e}");
        assert!(err > 0.0 && err <= BOUND, "{t}: relative L2 {err}");
    }
}

/// The plan of a resident CPU run (the call's defaults: 480x720x49, 226 tokens, guided) adds
/// under `--fp8-matmul` the codes of the largest Linear input and a product's workspace, and
/// every block's weight codes.
#[test]
fn the_plan_counts_the_fp8_codes() {
    let added = common::planned_denoise_activations(FIXTURE, &["--fp8-matmul"])
        - common::planned_denoise_activations(FIXTURE, &[]);
    let cfg = config();
    let codes = fp8_block_codes(&cfg);
    assert_eq!(codes.len(), cfg.num_layers);
    // 13 latent frames of 60x90, the guided batch of two: both prompts' 226 + 13·30·45 tokens by
    // the feed-forward's width 128, with their row scales; 32 MiB.
    let inputs = fp8_matmul_activations(&cfg, [2, 13, 16, 60, 90], 226);
    assert_eq!(inputs, 2 * 17776 * (128 + 4) + (32 << 20));
    assert_eq!(added, inputs + codes.iter().sum::<u64>(), "resident");
    // q, k, v and out (32 by 32) and the feed-forward's 32 by 128 and 128 by 32, with an f32
    // scale per output channel.
    let d = 32;
    assert_eq!(
        codes[0],
        4 * (d * d + 4 * d) + (d * 4 * d + 4 * 4 * d) + (4 * d * d + 4 * d)
    );
}
