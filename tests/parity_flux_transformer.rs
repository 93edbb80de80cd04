//! Parity of the FLUX transformer with diffusers' `FluxTransformer2DModel` on the tiny
//! `flux-tiny-a` fixture (1 dual-stream + 2 single-stream blocks, guidance embedded), with the
//! reference prompt embeddings and ids as input.

mod common;

use candle_core::{DType, Device, Tensor};
use vidgen::models::flux::transformer::{
    image_ids, rope_tables, FluxTransformer2DModel, FluxTransformerConfig,
};

const FIXTURE: &str = "flux-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn config() -> FluxTransformerConfig {
    common::config_in(FIXTURE, "transformer/config.json")
}

fn model() -> FluxTransformer2DModel {
    let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
    FluxTransformer2DModel::new(&config(), vb).unwrap()
}

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    common::assert_close(what, actual, expected, ATOL, RTOL);
}

/// The output for the reference call, with guidance 1 and at timestep 1.
#[test]
fn outputs_match_diffusers() {
    let model = model();
    let r = common::named_reference(FIXTURE, "transformer");
    let run = |timestep: &str, guidance: &str| {
        model
            .forward(
                &r["hidden_states"],
                &r[timestep],
                &r["encoder_hidden_states"],
                &r["pooled_projections"],
                Some(&r[guidance]),
                &r["txt_ids"],
                &r["img_ids"],
            )
            .unwrap()
    };
    check("output", &run("timestep", "guidance"), &r["output"]);
    check(
        "output_guidance_1",
        &run("timestep", "guidance_1"),
        &r["output_guidance_1"],
    );
    check("output_t1", &run("timestep_1", "guidance"), &r["output_t1"]);
}

/// Every intermediate the fixture records: the RoPE table, the conditioning, both input
/// projections, each block's streams and the output norm.
#[test]
fn intermediates_match_diffusers() {
    let model = model();
    let r = common::named_reference(FIXTURE, "transformer");
    // The pipeline's image ids for the fixture's 6x8 latent (3x4 packed tokens).
    let (n, _) = r["img_ids"].dims2().unwrap();
    let ids = image_ids(3, 4, &Device::Cpu).unwrap();
    assert_eq!(n, 12);
    check("img_ids", &ids, &r["img_ids"]);
    let all = Tensor::cat(&[&r["txt_ids"], &r["img_ids"]], 0).unwrap();
    let (cos, sin) = rope_tables(&config().axes_dims_rope, &all, &Device::Cpu).unwrap();
    check(
        "rope_cos",
        &common::interleave_pairs(&cos),
        &r["debug.rope_cos"],
    );
    check(
        "rope_sin",
        &common::interleave_pairs(&sin),
        &r["debug.rope_sin"],
    );

    let mut inputs = model
        .prepare(
            &r["hidden_states"],
            &r["timestep"],
            &r["encoder_hidden_states"],
            &r["pooled_projections"],
            Some(&r["guidance"]),
            &r["txt_ids"],
            &r["img_ids"],
        )
        .unwrap();
    check("temb", &inputs.temb, &r["debug.temb"]);
    let mut streams = inputs.take_streams().unwrap();
    check("x_embedder", &streams.image, &r["debug.x_embedder"]);
    check(
        "context_embedder",
        &streams.text,
        &r["debug.context_embedder"],
    );
    let cfg = config();
    for (i, block) in model.blocks().iter().enumerate() {
        streams = block.forward(&streams, &inputs).unwrap();
        let name = match i.checked_sub(cfg.num_layers) {
            None => format!("debug.block.{i}"),
            Some(j) => format!("debug.single_block.{j}"),
        };
        check(
            &format!("{name}.hidden_states"),
            &streams.image,
            &r[&format!("{name}.hidden_states")],
        );
        check(
            &format!("{name}.encoder_hidden_states"),
            &streams.text,
            &r[&format!("{name}.encoder_hidden_states")],
        );
    }
    let normed = model.norm_out_forward(&streams.image, &inputs).unwrap();
    check("norm_out", &normed, &r["debug.norm_out"]);
    assert_eq!(normed.dtype(), DType::F32);
}

/// The blocks built step by step (as leaf-level offload streams them) and run in order give
/// diffusers' output.
#[test]
fn steps_in_order_match_diffusers() {
    use vidgen::models::blocks::Blockwise;
    let cfg = config();
    let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
    let outer = FluxTransformer2DModel::new_without_blocks(&cfg, vb.clone()).unwrap();
    let r = common::named_reference(FIXTURE, "transformer");
    let mut inputs = outer
        .prepare(
            &r["hidden_states"],
            &r["timestep"],
            &r["encoder_hidden_states"],
            &r["pooled_projections"],
            Some(&r["guidance"]),
            &r["txt_ids"],
            &r["img_ids"],
        )
        .unwrap();
    let mut streams = inputs.take_streams().unwrap();
    for i in 0..FluxTransformer2DModel::num_blocks(&cfg) {
        assert!(FluxTransformer2DModel::block_steps(&cfg, i) > 1);
        for step in 0..FluxTransformer2DModel::block_steps(&cfg, i) {
            let block = FluxTransformer2DModel::block_step(&cfg, i, step, vb.clone()).unwrap();
            streams = block.forward(&streams, &inputs).unwrap();
        }
    }
    check(
        "output (step by step)",
        &outer.finish(&streams.image, &inputs).unwrap(),
        &r["output"],
    );
}
