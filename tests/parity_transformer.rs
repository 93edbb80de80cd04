//! Parity of the Wan transformer with diffusers' `WanTransformer3DModel` on the tiny fixture.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use vidgen::models::wan::transformer::{
    timestep_embedding, WanTransformer3DModel, WanTransformerBlock, WanTransformerConfig,
};

const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn config() -> WanTransformerConfig {
    let path = common::fixture_dir().join("transformer/config.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn weights_path() -> std::path::PathBuf {
    common::fixture_dir().join("transformer/diffusion_pytorch_model.safetensors")
}

fn var_builder() -> VarBuilder<'static> {
    unsafe {
        VarBuilder::from_mmaped_safetensors(&[weights_path()], DType::F32, &Device::Cpu).unwrap()
    }
}

fn weights() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(weights_path(), &Device::Cpu).unwrap()
}

/// A `[seq, D/2]` pair table in diffusers' `[1, seq, 1, D]` repeat-interleaved layout.
fn interleave(t: &Tensor) -> Tensor {
    common::interleave_pairs(t)
        .unsqueeze(0)
        .unwrap()
        .unsqueeze(2)
        .unwrap()
}

#[test]
fn outputs_match_diffusers() {
    let cfg = config();
    let model = WanTransformer3DModel::new(&cfg, var_builder()).unwrap();
    let r = common::reference("transformer");
    let latents = &r["hidden_states"];
    let ehs = &r["encoder_hidden_states"];

    let out = model.forward(latents, &r["timestep_int"], ehs).unwrap();
    assert_eq!(r["timestep_int"].dtype(), DType::I64);
    common::assert_close("output_t999", &out, &r["output_t999"], ATOL, RTOL);

    let out = model.forward(latents, &r["timestep_float"], ehs).unwrap();
    common::assert_close("output_t937_5", &out, &r["output_t937_5"], ATOL, RTOL);
}

#[test]
fn intermediates_match_diffusers() {
    let cfg = config();
    let vb = var_builder();
    // The engine's path: the non-block part alone, each block built on its own.
    let model = WanTransformer3DModel::new_without_blocks(&cfg, vb.clone()).unwrap();
    assert!(model.blocks().is_empty());
    let r = common::reference("transformer");
    let t = &r["timestep_int"];
    let mut inputs = model
        .prepare(&r["hidden_states"], t, &r["encoder_hidden_states"])
        .unwrap();

    common::assert_close(
        "rope_cos",
        &interleave(&inputs.rope_cos),
        &r["debug.rope_cos"],
        ATOL,
        RTOL,
    );
    common::assert_close(
        "rope_sin",
        &interleave(&inputs.rope_sin),
        &r["debug.rope_sin"],
        ATOL,
        RTOL,
    );
    common::assert_close(
        "timesteps_proj",
        &timestep_embedding(t, cfg.freq_dim).unwrap(),
        &r["debug.timesteps_proj"],
        ATOL,
        RTOL,
    );
    common::assert_close("temb", &inputs.temb, &r["debug.temb"], ATOL, RTOL);
    let tp = inputs.timestep_proj.flatten_from(1).unwrap();
    common::assert_close("timestep_proj", &tp, &r["debug.timestep_proj"], ATOL, RTOL);
    common::assert_close(
        "text_embedder",
        &inputs.encoder_hidden_states,
        &r["debug.text_embedder"],
        ATOL,
        RTOL,
    );

    let mut x = inputs.take_hidden_states().unwrap();
    assert!(inputs.take_hidden_states().is_err());
    let [gf, gh, gw] = inputs.grid;
    let patch = x
        .reshape((1, gf, gh, gw, cfg.inner_dim()))
        .unwrap()
        .permute((0, 4, 1, 2, 3))
        .unwrap();
    common::assert_close(
        "patch_embedding",
        &patch,
        &r["debug.patch_embedding"],
        ATOL,
        RTOL,
    );

    for k in 0..cfg.num_layers {
        let block = WanTransformerBlock::new(&cfg, vb.pp(format!("blocks.{k}"))).unwrap();
        x = block.forward(&x, &inputs).unwrap();
        common::assert_close(
            &format!("block.{k}"),
            &x,
            &r[&format!("debug.block.{k}")],
            ATOL,
            RTOL,
        );
    }

    let out = model.finish(&x, &inputs).unwrap();
    common::assert_close("output_t999 (staged)", &out, &r["output_t999"], ATOL, RTOL);
    // proj_out before unpatchify: patchify the output back ([B, C, F, H, W] -> tokens).
    let [pt, ph, pw] = cfg.patch_size;
    let oc = cfg.out_channels();
    let tokens = out
        .reshape(vec![1, oc, gf, pt, gh, ph, gw, pw])
        .unwrap()
        .permute(vec![0, 2, 4, 6, 3, 5, 7, 1])
        .unwrap()
        .reshape((1, gf * gh * gw, pt * ph * pw * oc))
        .unwrap();
    common::assert_close("proj_out", &tokens, &r["debug.proj_out"], ATOL, RTOL);

    // Without its blocks the model must refuse a full forward.
    assert!(model
        .forward(&r["hidden_states"], t, &r["encoder_hidden_states"])
        .is_err());
}

fn load_error(tensors: HashMap<String, Tensor>) -> String {
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    match WanTransformer3DModel::new(&config(), vb) {
        Ok(_) => panic!("loading succeeded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_an_error_naming_it() {
    for name in [
        "blocks.1.attn2.norm_k.weight",
        "condition_embedder.time_embedder.linear_1.bias",
    ] {
        let mut w = weights();
        w.remove(name).unwrap();
        let msg = load_error(w);
        assert!(msg.contains(name), "error does not name {name}: {msg}");
    }
}

#[test]
fn wrong_shape_is_an_error_naming_it() {
    for name in [
        "blocks.0.scale_shift_table",
        "patch_embedding.weight",
        "blocks.1.ffn.net.2.weight",
    ] {
        let mut w = weights();
        w.insert(
            name.to_string(),
            Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap(),
        );
        let msg = load_error(w);
        assert!(msg.contains(name), "error does not name {name}: {msg}");
    }
}

#[test]
fn config_rejects_image_to_video() {
    let mut cfg = config();
    cfg.validate().unwrap();
    cfg.image_dim = Some(1280);
    assert!(WanTransformer3DModel::new(&cfg, var_builder()).is_err());
    let mut cfg = config();
    cfg.added_kv_proj_dim = Some(5120);
    assert!(cfg.validate().is_err());
}

#[test]
fn config_defaults_nulls_and_unknown_keys() {
    let cfg: WanTransformerConfig = serde_json::from_str(
        r#"{"num_layers": 3, "in_channels": 36, "out_channels": null, "qk_norm": null,
            "pos_embed_seq_len": null, "some_future_key": [1, 2]}"#,
    )
    .unwrap();
    assert_eq!(cfg.num_layers, 3);
    assert_eq!(cfg.out_channels(), 36);
    assert_eq!(cfg.patch_size, [1, 2, 2]);
    assert_eq!(cfg.rope_dims(), [44, 42, 42]);
    assert_eq!(cfg.inner_dim(), 5120);
    cfg.validate().unwrap();
}

/// A bf16 load (the real models' runtime dtype) runs with the f32-kept modules and lands near
/// the f32 reference; bf16 is a different computation, so only a loose bound applies.
#[test]
fn bf16_forward_runs_and_stays_close() {
    let cfg = config();
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[weights_path()], DType::BF16, &Device::Cpu).unwrap()
    };
    let model = WanTransformer3DModel::new(&cfg, vb).unwrap();
    let r = common::reference("transformer");
    let out = model
        .forward(
            &r["hidden_states"],
            &r["timestep_int"],
            &r["encoder_hidden_states"],
        )
        .unwrap();
    assert_eq!(out.dtype(), DType::BF16);
    let diff = (out.to_dtype(DType::F32).unwrap() - &r["output_t999"])
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    eprintln!("bf16 vs f32 reference: max |diff| = {diff}");
    assert!(
        diff < 0.1,
        "bf16 output is {diff} away from the f32 reference"
    );
}
