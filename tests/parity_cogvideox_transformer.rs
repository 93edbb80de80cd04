//! Parity of the CogVideoX transformer with diffusers' `CogVideoXTransformer3DModel` on the tiny
//! `cogvideox-tiny-a` fixture (5b flags), using the reference prompt embeddings as input.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::cogvideox::transformer::{
    rotary_embedding, BlockStep, CogVideoXBlock, CogVideoXTransformer3DModel,
    CogVideoXTransformerConfig,
};
use vidgen::models::wan::transformer::timestep_embedding;

const FIXTURE: &str = "cogvideox-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn config() -> CogVideoXTransformerConfig {
    common::config_in(FIXTURE, "transformer/config.json")
}

fn var_builder() -> VarBuilder<'static> {
    common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors")
}

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, ATOL, RTOL);
}

#[test]
fn outputs_match_diffusers() {
    let model = CogVideoXTransformer3DModel::new(&config(), var_builder()).unwrap();
    let r = common::named_reference(FIXTURE, "transformer");
    let latents = &r["hidden_states"];
    let text = &r["encoder_hidden_states"];
    assert_eq!(r["timestep"].dtype(), DType::I64);
    let out = model.forward(latents, &r["timestep"], text).unwrap();
    check("output (t = 999)", &out, &r["output"]);
    let out = model.forward(latents, &r["timestep_500"], text).unwrap();
    check("output_t500", &out, &r["output_t500"]);
}

/// The guided pipeline's batched call: each batch entry must equal its own single run (the
/// per-entry modulation, RoPE and attention do not mix entries).
#[test]
fn batched_call_equals_single_calls() {
    let model = CogVideoXTransformer3DModel::new(&config(), var_builder()).unwrap();
    let r = common::named_reference(FIXTURE, "transformer");
    let text = common::named_reference(FIXTURE, "text_encoder");
    let prompts = text["prompt_embeds"].narrow(0, 0, 2).unwrap();
    let latents = &r["hidden_states"];
    let scaled = (latents * 0.5).unwrap();
    let both = Tensor::cat(&[latents, &scaled], 0).unwrap();
    let t = Tensor::new(&[999i64, 500], &Device::Cpu).unwrap();
    let batched = model.forward(&both, &t, &prompts).unwrap();
    for (i, (x, step)) in [(latents, 999i64), (&scaled, 500)].into_iter().enumerate() {
        let single = model
            .forward(
                x,
                &Tensor::new(&[step], &Device::Cpu).unwrap(),
                &prompts.narrow(0, i, 1).unwrap(),
            )
            .unwrap();
        common::assert_close(
            &format!("batch entry {i}"),
            &batched.narrow(0, i, 1).unwrap(),
            &single,
            1e-5,
            1e-5,
        );
    }
    // One timestep for the whole batch is broadcast.
    let shared = model
        .forward(
            &both,
            &Tensor::new(&[999i64], &Device::Cpu).unwrap(),
            &prompts,
        )
        .unwrap();
    assert_eq!(shared.dims(), batched.dims());
}

#[test]
fn intermediates_match_diffusers() {
    let cfg = config();
    let vb = var_builder();
    // The engine's path: the non-block part alone, each block built on its own.
    let model = CogVideoXTransformer3DModel::new_without_blocks(&cfg, vb.clone()).unwrap();
    assert!(model.blocks().is_empty());
    let r = common::named_reference(FIXTURE, "transformer");
    let t = &r["timestep"];
    // Without its blocks the model refuses a whole forward, saying what it holds.
    let refused = model
        .forward(&r["hidden_states"], t, &r["encoder_hidden_states"])
        .unwrap_err()
        .to_string();
    assert!(refused.contains("holds 0 of"), "{refused}");
    let mut inputs = model
        .prepare(&r["hidden_states"], t, &r["encoder_hidden_states"])
        .unwrap();

    check(
        "rope_cos",
        &common::interleave_pairs(&inputs.rope_cos),
        &r["rope_cos"],
    );
    check(
        "rope_sin",
        &common::interleave_pairs(&inputs.rope_sin),
        &r["rope_sin"],
    );
    let (cos, _) = rotary_embedding(&cfg, inputs.grid, &Device::Cpu).unwrap();
    assert_eq!(cos.dims(), inputs.rope_cos.dims());
    check(
        "time_proj",
        &timestep_embedding(t, cfg.inner_dim()).unwrap(),
        &r["debug.time_proj"],
    );
    check("time_embedding", &inputs.temb, &r["debug.time_embedding"]);

    let mut x = inputs.take_hidden_states().unwrap();
    assert!(inputs.take_hidden_states().is_err());
    check("patch_embed", &x, &r["debug.patch_embed"]);

    let text_len = inputs.text_len;
    let seq = x.dim(1).unwrap();
    for i in 0..cfg.num_layers {
        let bvb = vb.pp(format!("transformer_blocks.{i}"));
        let block = CogVideoXBlock::new(&cfg, bvb.clone()).unwrap();
        let whole = block.forward(&x, &inputs).unwrap();
        // Leaf-level streaming: the same block as its steps, each built and run on its own.
        let mut stepped = x.clone();
        for step in BlockStep::ALL {
            let part = CogVideoXBlock::with_steps(&cfg, bvb.clone(), &[step]).unwrap();
            stepped = part.forward(&stepped, &inputs).unwrap();
        }
        common::assert_close(&format!("block {i} by steps"), &stepped, &whole, 0.0, 0.0);
        x = whole;
        check(
            &format!("block {i} video"),
            &x.narrow(1, text_len, seq - text_len).unwrap(),
            &r[&format!("debug.block.{i}.hidden_states")],
        );
        check(
            &format!("block {i} text"),
            &x.narrow(1, 0, text_len).unwrap(),
            &r[&format!("debug.block.{i}.encoder_hidden_states")],
        );
    }
    check(
        "proj_out",
        &model.head(&x, &inputs, &mut |compute| compute()).unwrap(),
        &r["debug.proj_out"],
    );
    check("output", &model.finish(&x, &inputs).unwrap(), &r["output"]);
}

#[test]
fn hostile_configs_are_refused_with_the_key() {
    let cfg = config();
    let cases: Vec<(CogVideoXTransformerConfig, &str)> = vec![
        (
            CogVideoXTransformerConfig {
                use_rotary_positional_embeddings: false,
                ..cfg.clone()
            },
            "use_rotary_positional_embeddings",
        ),
        (
            CogVideoXTransformerConfig {
                patch_size: 0,
                ..cfg.clone()
            },
            "patch_size",
        ),
        (
            CogVideoXTransformerConfig {
                attention_head_dim: 24,
                ..cfg.clone()
            },
            "attention_head_dim",
        ),
        (
            CogVideoXTransformerConfig {
                patch_size_t: Some(2),
                ..cfg.clone()
            },
            "patch_size_t",
        ),
        (
            CogVideoXTransformerConfig {
                num_attention_heads: 0,
                ..cfg.clone()
            },
            "num_attention_heads",
        ),
        (
            CogVideoXTransformerConfig {
                sample_height: 1,
                ..cfg.clone()
            },
            "sample_height",
        ),
    ];
    for (bad, key) in cases {
        let err = CogVideoXTransformer3DModel::new(&bad, var_builder())
            .err()
            .unwrap_or_else(|| panic!("{key}: accepted"))
            .to_string();
        // The first line is the message (a backtrace may follow when RUST_BACKTRACE is set).
        let first = err.lines().next().unwrap_or_default();
        assert!(first.contains(key), "{key}: {err}");
    }
}

/// `norm_elementwise_affine: false`: the checkpoint has no LayerNorm weights and none are read.
#[test]
fn non_affine_norms_need_no_weights() {
    let path =
        common::named_fixture_dir(FIXTURE).join("transformer/diffusion_pytorch_model.safetensors");
    let mut weights = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    weights.retain(|name, _| {
        !(name.contains(".norm.")
            || name.starts_with("norm_final")
            || name.contains("norm_out.norm"))
    });
    let cfg = CogVideoXTransformerConfig {
        norm_elementwise_affine: false,
        ..config()
    };
    let vb = VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
    let model = CogVideoXTransformer3DModel::new(&cfg, vb).unwrap();
    let r = common::named_reference(FIXTURE, "transformer");
    let out = model
        .forward(
            &r["hidden_states"],
            &r["timestep"],
            &r["encoder_hidden_states"],
        )
        .unwrap();
    assert_eq!(out.dims(), r["output"].dims());
}

/// The bf16 path (what GPU runs use): the same model loaded in bf16 runs end to end and stays
/// near the f32 reference (bf16 keeps ~3 significant digits).
#[test]
fn bf16_run_stays_near_the_reference() {
    let path =
        common::named_fixture_dir(FIXTURE).join("transformer/diffusion_pytorch_model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::BF16, &Device::Cpu).unwrap() };
    let model = CogVideoXTransformer3DModel::new(&config(), vb).unwrap();
    let r = common::named_reference(FIXTURE, "transformer");
    let out = model
        .forward(
            &r["hidden_states"].to_dtype(DType::BF16).unwrap(),
            &r["timestep"],
            &r["encoder_hidden_states"].to_dtype(DType::BF16).unwrap(),
        )
        .unwrap();
    assert_eq!(out.dtype(), DType::BF16);
    let err = common::max_abs_diff(&out, &r["output"]);
    eprintln!("bf16 output: max |diff| {err:.3e}");
    assert!(err < 0.1, "bf16 output off by {err}");
}
