//! Parity of `LTXVideoTransformer3DModel` with `ltx-video-tiny-a/reference/transformer.safetensors`.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::{assert_close, named_fixture_dir, reference_in};
use std::path::PathBuf;
use vidgen::models::ltx::transformer::{
    rope_tables, LtxStream, LtxTransformer3DModel, LtxTransformerBlock, LtxTransformerConfig,
};

const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn dir() -> PathBuf {
    named_fixture_dir("ltx-video-tiny-a")
}

fn config() -> LtxTransformerConfig {
    serde_json::from_str(&std::fs::read_to_string(dir().join("transformer/config.json")).unwrap())
        .unwrap()
}

fn var_builder() -> VarBuilder<'static> {
    let path = dir().join("transformer/diffusion_pytorch_model.safetensors");
    unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu) }.unwrap()
}

/// The fixture call's grid and `rope_interpolation_scale` (read from README.json).
fn call() -> ([usize; 3], [f64; 3]) {
    let readme: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir().join("reference/README.json")).unwrap(),
    )
    .unwrap();
    let inputs = &readme["files"]["transformer.safetensors"]["inputs"];
    let grid: Vec<usize> = inputs["latent_fhw"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let scale: Vec<f64> = inputs["rope_interpolation_scale"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    ([grid[0], grid[1], grid[2]], [scale[0], scale[1], scale[2]])
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn rope_tables_match() {
    let r = reference_in(&dir(), "transformer");
    let cfg = config();
    let (grid, scale) = call();
    // The pipeline's scale for frame_rate 25 is the fixture's.
    assert_eq!(
        LtxTransformerConfig::rope_interpolation_scale(8, 32, 25.0),
        scale
    );
    let (cos, sin) = rope_tables(cfg.inner_dim(), grid, scale, [1, 1, 1], &Device::Cpu).unwrap();
    assert_close(
        "rope_cos",
        &cos.unsqueeze(0).unwrap(),
        &r["debug.rope_cos"],
        1e-6,
        1e-6,
    );
    assert_close(
        "rope_sin",
        &sin.unsqueeze(0).unwrap(),
        &r["debug.rope_sin"],
        1e-6,
        1e-6,
    );
}

#[test]
fn stages_and_output_match() {
    let r = reference_in(&dir(), "transformer");
    let cfg = config();
    let (grid, scale) = call();
    let model = LtxTransformer3DModel::new(&cfg, var_builder()).unwrap();
    let mask = &r["encoder_attention_mask"];
    let x = &r["hidden_states"];
    let text = &r["encoder_hidden_states"];

    let (temb, embedded) = model.time_embedding(&r["timestep"], DType::F32).unwrap();
    assert_close("temb", &temb, &r["debug.temb"], ATOL, RTOL);
    assert_close(
        "embedded_timestep",
        &embedded,
        &r["debug.embedded_timestep"],
        ATOL,
        RTOL,
    );

    let mut inputs = model
        .prepare(x, text, &r["timestep"], Some(mask), grid, scale)
        .unwrap();
    assert_close(
        "caption_projection",
        &inputs.encoder_hidden_states,
        &r["debug.caption_projection"],
        ATOL,
        RTOL,
    );
    let mut h = inputs.take_hidden_states().unwrap();
    assert_close("proj_in", &h, &r["debug.proj_in"], ATOL, RTOL);
    for (i, block) in model.blocks().iter().enumerate() {
        h = block
            .forward(LtxStream::new(h), &inputs)
            .unwrap()
            .into_hidden()
            .unwrap();
        assert_close(
            &format!("block.{i}"),
            &h,
            &r[&format!("debug.block.{i}")],
            ATOL,
            RTOL,
        );
    }
    let out = model.finish(&h, &inputs).unwrap();
    println!("output max |diff| {}", max_diff(&out, &r["output"]));
    assert_close("output (staged)", &out, &r["output"], ATOL, RTOL);

    let out = model
        .forward(x, text, &r["timestep"], Some(mask), grid, scale)
        .unwrap();
    assert_close("output", &out, &r["output"], ATOL, RTOL);
    let out = model
        .forward(x, text, &r["timestep_1000"], Some(mask), grid, scale)
        .unwrap();
    println!(
        "output_t1000 max |diff| {}",
        max_diff(&out, &r["output_t1000"])
    );
    assert_close("output_t1000", &out, &r["output_t1000"], ATOL, RTOL);
}

#[test]
fn blocks_load_alone_and_batch_of_two() {
    let r = reference_in(&dir(), "transformer");
    let cfg = config();
    let (grid, scale) = call();
    let vb = var_builder();
    let outer = LtxTransformer3DModel::new_without_blocks(&cfg, vb.clone()).unwrap();
    assert!(outer.blocks().is_empty());
    // A batch of two identical entries with one timestep value, as CFG batches them.
    let two = |t: &Tensor| Tensor::cat(&[t, t], 0).unwrap();
    let mut inputs = outer
        .prepare(
            &two(&r["hidden_states"]),
            &two(&r["encoder_hidden_states"]),
            &r["timestep"],
            Some(&two(&r["encoder_attention_mask"])),
            grid,
            scale,
        )
        .unwrap();
    let mut h = inputs.take_hidden_states().unwrap();
    for i in 0..cfg.num_layers {
        let block =
            LtxTransformerBlock::new(&cfg, vb.pp(format!("transformer_blocks.{i}"))).unwrap();
        h = block
            .forward(LtxStream::new(h), &inputs)
            .unwrap()
            .into_hidden()
            .unwrap();
    }
    let out = outer.finish(&h, &inputs).unwrap();
    assert_close("output (batch 2)", &out, &two(&r["output"]), ATOL, RTOL);
}

#[test]
fn hostile_configs_are_errors_naming_the_key() {
    for (json, key) in [
        (r#"{"num_attention_heads": 0}"#, "num_attention_heads"),
        (r#"{"cross_attention_dim": 7}"#, "cross_attention_dim"),
        (r#"{"qk_norm": "rms_norm"}"#, "qk_norm"),
        (r#"{"activation_fn": "swiglu"}"#, "activation_fn"),
        (r#"{"patch_size": 0}"#, "patch_size"),
        (
            r#"{"num_attention_heads": 18446744073709551615}"#,
            "num_attention_heads",
        ),
    ] {
        let cfg: LtxTransformerConfig = serde_json::from_str(json).unwrap();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(key), "{json}: {err}");
    }
}
