//! Parity of the Mochi transformer with diffusers' `MochiTransformer3DModel` on the tiny
//! `mochi-tiny-a` fixture, from the reference prompt embeddings and mask.

mod common;

use candle_core::{Device, Tensor};
use vidgen::models::mochi::transformer::{
    rope_tables, BlockStep, MochiBlock, MochiTransformer3DModel, MochiTransformerConfig,
};

const FIXTURE: &str = "mochi-tiny-a";

fn model() -> MochiTransformer3DModel {
    let cfg: MochiTransformerConfig = common::config_in(FIXTURE, "transformer/config.json");
    let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
    MochiTransformer3DModel::new(&cfg, vb).unwrap()
}

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, 1e-4, 1e-4);
}

#[test]
fn outputs_match_diffusers() {
    let model = model();
    let r = common::named_reference(FIXTURE, "transformer");
    let (x, text, mask) = (
        &r["hidden_states"],
        &r["encoder_hidden_states"],
        &r["encoder_attention_mask"],
    );
    let out = model.forward(x, &r["timestep"], text, mask).unwrap();
    check("output (t = 212.5)", &out, &r["output"]);
    let out = model.forward(x, &r["timestep_0"], text, mask).unwrap();
    check("output_t0", &out, &r["output_t0"]);
}

#[test]
fn conditioning_and_rope_match_diffusers() {
    let model = model();
    let r = common::named_reference(FIXTURE, "transformer");
    let temb = model
        .conditioning(
            &r["timestep"],
            &r["encoder_hidden_states"],
            &r["encoder_attention_mask"],
        )
        .unwrap();
    check("temb", &temb, &r["debug.temb"]);
    let freqs = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors")
        .get((3, 2, 8), "pos_frequencies")
        .unwrap();
    let (cos, sin) = rope_tables(&freqs, [3, 2, 3], &Device::Cpu).unwrap();
    check("rope_cos", &cos, &r["debug.rope_cos"]);
    check("rope_sin", &sin, &r["debug.rope_sin"]);
}

/// The guided pipeline's batched call: each entry equals its own single run (masks of
/// different lengths remove different text tokens per sample).
#[test]
fn batched_call_equals_single_calls() {
    let model = model();
    let r = common::named_reference(FIXTURE, "transformer");
    let text = common::named_reference(FIXTURE, "text_encoder");
    // Prompts 3 (empty: one valid token) and 0.
    let pick = |name: &str| {
        Tensor::cat(
            &[
                text[name].narrow(0, 3, 1).unwrap(),
                text[name].narrow(0, 0, 1).unwrap(),
            ],
            0,
        )
        .unwrap()
    };
    let (embeds, masks) = (pick("prompt_embeds"), pick("prompt_attention_mask"));
    let x = &r["hidden_states"];
    let both = Tensor::cat(&[x, x], 0).unwrap();
    let t = r["timestep"].repeat(2).unwrap();
    let batched = model.forward(&both, &t, &embeds, &masks).unwrap();
    for i in 0..2 {
        let single = model
            .forward(
                x,
                &r["timestep"],
                &embeds.narrow(0, i, 1).unwrap(),
                &masks.narrow(0, i, 1).unwrap(),
            )
            .unwrap();
        check(
            &format!("batch entry {i}"),
            &batched.narrow(0, i, 1).unwrap(),
            &single,
        );
    }
    check(
        "entry 1 is the reference run",
        &batched.narrow(0, 1, 1).unwrap(),
        &r["output"],
    );
}

/// Each block built as its two steps apart (leaf-level streaming) gives the whole blocks'
/// output bit for bit.
#[test]
fn blocks_run_step_by_step_give_the_same_output() {
    let cfg: MochiTransformerConfig = common::config_in(FIXTURE, "transformer/config.json");
    let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
    let model = model();
    let r = common::named_reference(FIXTURE, "transformer");
    let (x, t, text, mask) = (
        &r["hidden_states"],
        &r["timestep"],
        &r["encoder_hidden_states"],
        &r["encoder_attention_mask"],
    );
    let whole = model.forward(x, t, text, mask).unwrap();
    let mut inputs = model.prepare(x, t, text, mask).unwrap();
    let mut streams = inputs.take_streams().unwrap();
    for i in 0..cfg.num_layers {
        for step in BlockStep::ALL {
            let block_vb = vb.pp(format!("transformer_blocks.{i}"));
            let block = MochiBlock::with_steps(&cfg, i, block_vb, &[step]).unwrap();
            streams = block.forward(&streams, &inputs).unwrap();
        }
    }
    let stepped = model.finish(&streams.video, &inputs).unwrap();
    assert_eq!(common::max_abs_diff(&stepped, &whole), 0.0);
}
