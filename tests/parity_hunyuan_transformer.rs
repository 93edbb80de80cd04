//! Parity of `HunyuanVideoTransformer3DModel` with diffusers on `hunyuanvideo-tiny-a`.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::hunyuan_video::transformer::{
    BlockKind, BlockStep, HunyuanModulations, HunyuanVideoBlock, HunyuanVideoTransformer3DModel,
    HunyuanVideoTransformerConfig,
};

const FIXTURE: &str = "hunyuanvideo-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn config() -> HunyuanVideoTransformerConfig {
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
    let model = HunyuanVideoTransformer3DModel::new(&config(), var_builder()).unwrap();
    let r = common::named_reference(FIXTURE, "transformer");
    let run = |t: &str, g: &str| {
        model
            .forward(
                &r["hidden_states"],
                &r[t],
                &r["encoder_hidden_states"],
                &r["encoder_attention_mask"],
                &r["pooled_projections"],
                Some(&r[g]),
            )
            .unwrap()
    };
    check("output", &run("timestep", "guidance"), &r["output"]);
    check(
        "output_guidance_1000",
        &run("timestep", "guidance_1000"),
        &r["output_guidance_1000"],
    );
    check(
        "output_t1000",
        &run("timestep_1000", "guidance"),
        &r["output_t1000"],
    );
}

#[test]
fn intermediates_match_diffusers() {
    let cfg = config();
    let vb = var_builder();
    // The engine's path: the non-block part alone, each block built on its own.
    let model = HunyuanVideoTransformer3DModel::new_without_blocks(&cfg, vb.clone()).unwrap();
    assert!(model.blocks().is_empty());
    let r = common::named_reference(FIXTURE, "transformer");
    let mut inputs = model
        .prepare(
            &r["hidden_states"],
            &r["timestep"],
            &r["encoder_hidden_states"],
            &r["encoder_attention_mask"],
            &r["pooled_projections"],
            Some(&r["guidance"]),
        )
        .unwrap();
    check(
        "rope_cos",
        &common::interleave_pairs(&inputs.rope_cos),
        &r["debug.rope_cos"],
    );
    check(
        "rope_sin",
        &common::interleave_pairs(&inputs.rope_sin),
        &r["debug.rope_sin"],
    );
    check("temb", inputs.temb.as_ref().unwrap(), &r["debug.temb"]);
    let mut streams = inputs.take_streams().unwrap();
    assert!(inputs.take_streams().is_err());
    check("x_embedder", &streams.video, &r["debug.x_embedder"]);

    let (mut refiner, mut dual, mut single) = (0, 0, 0);
    for i in 0..cfg.num_blocks() {
        let block = HunyuanVideoBlock::new(&cfg, i, vb.clone()).unwrap();
        streams = block.forward(&streams, &inputs).unwrap();
        let name = match block.kind() {
            // The refiner's blocks end the context embedder.
            BlockKind::Refiner => {
                refiner += 1;
                if refiner == cfg.num_refiner_layers {
                    check(
                        "context_embedder",
                        &streams.text,
                        &r["debug.context_embedder"],
                    );
                }
                continue;
            }
            BlockKind::DualStream => {
                dual += 1;
                format!("debug.block.{}", dual - 1)
            }
            BlockKind::SingleStream => {
                single += 1;
                format!("debug.single_block.{}", single - 1)
            }
        };
        check(
            &format!("{name}.hidden_states"),
            &streams.video,
            &r[&format!("{name}.hidden_states")],
        );
        check(
            &format!("{name}.encoder_hidden_states"),
            &streams.text,
            &r[&format!("{name}.encoder_hidden_states")],
        );
    }
    assert_eq!(
        (refiner, dual, single),
        (
            cfg.num_refiner_layers,
            cfg.num_layers,
            cfg.num_single_layers
        )
    );
    let out = model.finish(&streams.video, &inputs).unwrap();
    check("output", &out, &r["output"]);
}

#[test]
fn hostile_configs_are_refused_with_the_key() {
    let base = config();
    let cases: Vec<(&str, HunyuanVideoTransformerConfig)> = vec![
        (
            "rope_axes_dim",
            HunyuanVideoTransformerConfig {
                rope_axes_dim: vec![4, 6],
                ..base.clone()
            },
        ),
        (
            "attention_head_dim",
            HunyuanVideoTransformerConfig {
                attention_head_dim: 0,
                ..base.clone()
            },
        ),
        (
            "patch_size",
            HunyuanVideoTransformerConfig {
                patch_size: 0,
                ..base.clone()
            },
        ),
        (
            "mlp_ratio",
            HunyuanVideoTransformerConfig {
                mlp_ratio: f64::NAN,
                ..base.clone()
            },
        ),
        (
            "image_condition_type",
            HunyuanVideoTransformerConfig {
                image_condition_type: Some("token_replace".into()),
                ..base.clone()
            },
        ),
    ];
    for (key, cfg) in cases {
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(key), "{key}: {err}");
        assert!(HunyuanVideoTransformer3DModel::new(&cfg, var_builder()).is_err());
    }
    // The published defaults validate.
    HunyuanVideoTransformerConfig::default().validate().unwrap();
}

/// The bf16 path (what GPUs run) stays close to the f32 reference: catches dtype plumbing
/// mistakes, not rounding (bf16 keeps ~3 significant digits).
#[test]
fn bf16_forward_tracks_the_reference() {
    let path =
        common::named_fixture_dir(FIXTURE).join("transformer/diffusion_pytorch_model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::BF16, &Device::Cpu).unwrap() };
    let model = HunyuanVideoTransformer3DModel::new(&config(), vb).unwrap();
    let r = common::named_reference(FIXTURE, "transformer");
    let bf16 = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let out = model
        .forward(
            &bf16(&r["hidden_states"]),
            &r["timestep"],
            &bf16(&r["encoder_hidden_states"]),
            &r["encoder_attention_mask"],
            &bf16(&r["pooled_projections"]),
            Some(&r["guidance"]),
        )
        .unwrap();
    assert_eq!(out.dtype(), DType::BF16);
    let reference = &r["output"];
    let scale = common::max_abs_diff(reference, &reference.zeros_like().unwrap());
    let err = common::max_abs_diff(&out, reference) / scale;
    eprintln!("bf16 output: max |diff| / max |ref| = {err:.3e}");
    assert!(err < 5e-2, "bf16 output drifts {err} from the reference");
}

/// Every block built and run one step at a time (as leaf-level streaming runs them, the steps'
/// modulations and attention carried between them) gives exactly the whole blocks' output.
#[test]
fn blocks_run_step_by_step_are_bit_identical() {
    let cfg = config();
    let vb = var_builder();
    let whole = HunyuanVideoTransformer3DModel::new(&cfg, vb.clone()).unwrap();
    let outer = HunyuanVideoTransformer3DModel::new_without_blocks(&cfg, vb.clone()).unwrap();
    let r = common::named_reference(FIXTURE, "transformer");
    let args = (
        &r["hidden_states"],
        &r["timestep"],
        &r["encoder_hidden_states"],
        &r["encoder_attention_mask"],
        &r["pooled_projections"],
        Some(&r["guidance"]),
    );
    let want = whole
        .forward(args.0, args.1, args.2, args.3, args.4, args.5)
        .unwrap();
    let mut inputs = outer
        .prepare(args.0, args.1, args.2, args.3, args.4, args.5)
        .unwrap();
    let mut streams = inputs.take_streams().unwrap();
    let mut steps_run = 0;
    for i in 0..cfg.num_blocks() {
        let steps = cfg.block_kind(i).unwrap().0.steps();
        for (s, step) in steps.iter().enumerate() {
            let block = HunyuanVideoBlock::with_steps(&cfg, i, vb.clone(), &[*step]).unwrap();
            streams = block.forward(&streams, &inputs).unwrap();
            assert_eq!(
                streams.mid_block(),
                s + 1 < steps.len(),
                "block {i} {step:?}"
            );
            steps_run += 1;
        }
    }
    // Refiner 3 steps, dual-stream 5, single-stream 3.
    assert_eq!(
        steps_run,
        3 * cfg.num_refiner_layers + 5 * cfg.num_layers + 3 * cfg.num_single_layers
    );
    let got = outer.finish(&streams.video, &inputs).unwrap();
    assert_eq!(common::max_abs_diff(&got, &want), 0.0);
    // The modulations computed apart, in one pass before the blocks, and the blocks without
    // their modulation Linears: the same bits.
    let apart = HunyuanVideoTransformerConfig {
        modulations_apart: true,
        ..cfg.clone()
    };
    let bodies = HunyuanVideoTransformer3DModel::new(&apart, vb.clone()).unwrap();
    let modulations = HunyuanModulations::new(&cfg, vb.clone()).unwrap();
    let mut inputs = bodies
        .prepare(args.0, args.1, args.2, args.3, args.4, args.5)
        .unwrap();
    // The bodies' model holds no conditioner: the modulation component conditions.
    assert!(inputs.temb.is_none() && inputs.refiner_temb.is_none());
    let (temb, refiner_temb) = modulations
        .conditioning(args.1, args.2, args.3, args.4, args.5)
        .unwrap();
    let mut table = modulations
        .blocks()
        .iter()
        .map(|b| b.modulation(&temb, &refiner_temb))
        .collect::<candle_core::Result<Vec<_>>>()
        .unwrap();
    table.push(modulations.output(&temb).unwrap());
    inputs.modulations = Some(Arc::new(table));
    let mut streams = inputs.take_streams().unwrap();
    for block in bodies.blocks() {
        streams = block.forward(&streams, &inputs).unwrap();
    }
    let got = bodies.finish(&streams.video, &inputs).unwrap();
    assert_eq!(common::max_abs_diff(&got, &want), 0.0);
    // A step out of order is refused, naming what it lacks.
    let mut inputs = outer
        .prepare(args.0, args.1, args.2, args.3, args.4, args.5)
        .unwrap();
    let streams = inputs.take_streams().unwrap();
    let late = HunyuanVideoBlock::with_steps(
        &cfg,
        cfg.num_refiner_layers,
        vb,
        &[BlockStep::JointAttention],
    )
    .unwrap();
    let err = late.forward(&streams, &inputs).unwrap_err().to_string();
    assert!(err.contains("modulation"), "{err}");
}
