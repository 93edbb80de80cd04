//! Parity of `LatteTransformer3DModel` with diffusers on the `latte-tiny-a` references: the
//! sin-cos tables, the timestep and caption embeddings, every block's output and the whole
//! forward at two timesteps.

mod common;

use candle_core::{Device, Tensor};
use vidgen::models::latte::transformer::{
    temporal_pos_embed, LatteTransformer3DModel, LatteTransformerConfig,
};

const FIXTURE: &str = "latte-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn config() -> LatteTransformerConfig {
    common::config_in(FIXTURE, "transformer/config.json")
}

fn model() -> LatteTransformer3DModel {
    let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
    LatteTransformer3DModel::new(&config(), vb).unwrap()
}

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, ATOL, RTOL);
}

/// The 2-D table is checked inside `debug.pos_embed` (patch projection plus table).
#[test]
fn temporal_table_matches_diffusers() {
    let r = common::named_reference(FIXTURE, "transformer");
    let cfg = config();
    let temporal = temporal_pos_embed(cfg.inner_dim(), cfg.video_length, &Device::Cpu).unwrap();
    check(
        "debug.temp_pos_embed",
        &temporal.unsqueeze(0).unwrap(),
        &r["debug.temp_pos_embed"],
    );
}

#[test]
fn embeddings_and_blocks_match_diffusers() {
    let model = model();
    let r = common::named_reference(FIXTURE, "transformer");
    let mut inputs = model
        .prepare(
            &r["hidden_states"],
            &r["timestep"],
            &r["encoder_hidden_states"],
        )
        .unwrap();
    check("debug.temb", &inputs.timestep, &r["debug.temb"]);
    check(
        "debug.embedded_timestep",
        &inputs.embedded_timestep,
        &r["debug.embedded_timestep"],
    );
    check(
        "debug.caption_projection",
        &inputs.text,
        &r["debug.caption_projection"],
    );
    let mut x = inputs.take_hidden_states().unwrap();
    check(
        "debug.pos_embed",
        &x.squeeze(0).unwrap(),
        &r["debug.pos_embed"],
    );
    for (i, block) in model.blocks().iter().enumerate() {
        x = block.forward(&x, &inputs).unwrap();
        let layer = i / 2;
        if i % 2 == 0 {
            check(
                &format!("debug.spatial_block.{layer}"),
                &x.squeeze(0).unwrap(),
                &r[&format!("debug.spatial_block.{layer}")],
            );
        } else {
            check(
                &format!("debug.temporal_block.{layer}"),
                &x.squeeze(0).unwrap().transpose(0, 1).unwrap(),
                &r[&format!("debug.temporal_block.{layer}")],
            );
        }
    }
    check("output", &model.finish(&x, &inputs).unwrap(), &r["output"]);
}

#[test]
fn forward_matches_diffusers_at_two_timesteps() {
    let model = model();
    let r = common::named_reference(FIXTURE, "transformer");
    for (t, out) in [("timestep", "output"), ("timestep_500", "output_t500")] {
        let y = model
            .forward(&r["hidden_states"], &r[t], &r["encoder_hidden_states"])
            .unwrap();
        check(out, &y, &r[out]);
    }
}

#[test]
fn a_frame_count_other_than_video_length_is_refused() {
    let model = model();
    let r = common::named_reference(FIXTURE, "transformer");
    let four = r["hidden_states"].narrow(2, 0, 4).unwrap();
    let err = model
        .forward(&four, &r["timestep"], &r["encoder_hidden_states"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("video_length"), "{err}");
}
