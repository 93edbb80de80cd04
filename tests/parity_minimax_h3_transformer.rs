//! Parity of the MiniMax H3 transformer with diffusers' `MiniMaxH3Transformer3DModel` on the
//! tiny fixture (one forward on the pipeline's packed layout at step 1's two timesteps).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::sync::Arc;
use vidgen::models::minimax_h3::transformer::{
    rope_tables, MiniMaxH3Modulations, MiniMaxH3Transformer3DModel, MiniMaxH3TransformerBlock,
    MiniMaxH3TransformerConfig, PackedLayout,
};

/// The fixture README's tolerance for transformer outputs and debug tensors.
const ATOL: f64 = 3e-5;
const RTOL: f64 = 3e-5;

fn dir() -> std::path::PathBuf {
    common::named_fixture_dir("minimax-h3-tiny-a")
}

fn config() -> MiniMaxH3TransformerConfig {
    let path = dir().join("transformer/config.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn var_builder() -> VarBuilder<'static> {
    let path = dir().join("transformer/diffusion_pytorch_model.safetensors");
    unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu).unwrap() }
}

fn layout(r: &HashMap<String, Tensor>) -> PackedLayout {
    PackedLayout {
        token_tags: r["token_tags"].clone(),
        position_ids: r["position_ids"].clone(),
        video_indices: r["video_indices"].clone(),
        audio_indices: r["audio_indices"].clone(),
        text_indices: r["text_indices"].clone(),
    }
}

/// The whole model's forward on the reference inputs: (video, audio) velocities.
fn reference_forward(
    model: &MiniMaxH3Transformer3DModel,
    r: &HashMap<String, Tensor>,
) -> (Tensor, Tensor) {
    model
        .forward(
            &r["hidden_states"],
            &r["audio_hidden_states"],
            &r["encoder_hidden_states"],
            &r["timestep"],
            &r["timestep_indices"],
            &layout(r),
        )
        .unwrap()
}

#[test]
fn forward_matches_diffusers() {
    let model = MiniMaxH3Transformer3DModel::new(&config(), var_builder()).unwrap();
    let r = common::reference_in(&dir(), "transformer");
    let (video, audio) = reference_forward(&model, &r);
    common::assert_close("output.sample", &video, &r["output.sample"], ATOL, RTOL);
    common::assert_close(
        "output.audio_sample",
        &audio,
        &r["output.audio_sample"],
        ATOL,
        RTOL,
    );
}

#[test]
fn streamed_blocks_and_intermediates_match_diffusers() {
    let cfg = config();
    let vb = var_builder();
    let model = MiniMaxH3Transformer3DModel::new_without_blocks(&cfg, vb.clone()).unwrap();
    assert!(model.blocks().is_empty());
    let r = common::reference_in(&dir(), "transformer");

    let (cos, sin) = rope_tables(&r["position_ids"], cfg.rope_freq_dim, cfg.rope_theta).unwrap();
    // diffusers' table is the half duplicated for rotate-half.
    let dup = |t: &Tensor| Tensor::cat(&[t, t], 1).unwrap();
    common::assert_close("rope_cos", &dup(&cos), &r["debug.rope_cos"], ATOL, RTOL);
    common::assert_close("rope_sin", &dup(&sin), &r["debug.rope_sin"], ATOL, RTOL);
    let refined = model.refine_text(&r["encoder_hidden_states"]).unwrap();
    common::assert_close(
        "token_refiner",
        &refined,
        &r["debug.token_refiner"],
        ATOL,
        RTOL,
    );
    let temb = model.time_embedding(&r["timestep"]).unwrap();
    common::assert_close("temb", &temb, &r["debug.temb"], ATOL, RTOL);

    let layout = layout(&r);
    let mut inputs = model
        .prepare(
            &r["hidden_states"],
            &r["audio_hidden_states"],
            &r["encoder_hidden_states"],
            &r["timestep"],
            &r["timestep_indices"],
            &layout,
            &cfg.rope(&layout).unwrap(),
        )
        .unwrap();
    let mut x = inputs.take_hidden_states().unwrap();
    assert!(inputs.take_hidden_states().is_err());
    // The AdaLN tables computed apart (as the pipeline does, before denoising), the blocks
    // built without their projections.
    let modulations = MiniMaxH3Modulations::new(&cfg, vb.clone()).unwrap();
    let temb = inputs.temb.clone().unwrap();
    let mut tables = modulations
        .blocks()
        .iter()
        .map(|b| b.table(&temb))
        .collect::<candle_core::Result<Vec<_>>>()
        .unwrap();
    tables.push(modulations.output_table(&temb).unwrap());
    common::assert_close(
        "block0_adaln",
        &tables[0],
        &r["debug.block0_adaln"],
        ATOL,
        RTOL,
    );
    inputs.adaln_tables = Some(Arc::new(tables));
    let apart = MiniMaxH3TransformerConfig {
        modulations_apart: true,
        ..cfg.clone()
    };
    for i in 0..cfg.num_layers {
        let block = MiniMaxH3TransformerBlock::new(&apart, i, vb.clone()).unwrap();
        x = block.forward(&x, &inputs).unwrap();
        common::assert_close(
            &format!("block.{i}"),
            &x,
            &r[&format!("debug.block.{i}")],
            ATOL,
            RTOL,
        );
    }
    let all_rows = Tensor::arange(0u32, x.dim(1).unwrap() as u32, &Device::Cpu).unwrap();
    let normed = model.norm_out(&x, &all_rows, &inputs).unwrap();
    common::assert_close("norm_out", &normed, &r["debug.norm_out"], ATOL, RTOL);
    let (video, audio) = model.finish(&x, &inputs).unwrap();
    // The outer part built with the modulations apart holds neither the time embedder nor
    // the output norm's Linear (the modulation component does): it reads the output norm's
    // table after the blocks' and finishes with the same bits.
    let apart_outer = MiniMaxH3Transformer3DModel::new_without_blocks(&apart, vb.clone()).unwrap();
    assert!(apart_outer.time_embedding(&r["timestep"]).is_err());
    let mut apart_inputs = inputs.clone();
    apart_inputs.temb = None;
    let (apart_video, apart_audio) = apart_outer.finish(&x, &apart_inputs).unwrap();
    assert_eq!(common::max_abs_diff(&apart_video, &video), 0.0);
    assert_eq!(common::max_abs_diff(&apart_audio, &audio), 0.0);
    // Bit for bit the whole model's forward, projections inside the blocks.
    let whole = MiniMaxH3Transformer3DModel::new(&cfg, vb.clone()).unwrap();
    let (whole_video, whole_audio) = reference_forward(&whole, &r);
    assert_eq!(common::max_abs_diff(&video, &whole_video), 0.0);
    assert_eq!(common::max_abs_diff(&audio, &whole_audio), 0.0);
    common::assert_close("output.sample", &video, &r["output.sample"], ATOL, RTOL);
    common::assert_close(
        "output.audio_sample",
        &audio,
        &r["output.audio_sample"],
        ATOL,
        RTOL,
    );
}

/// The blocks and the output head compute a few rows at a time (a chunk holds at most
/// `CHUNK_ELEMENTS`); any chunk size gives the same outputs up to f32 rounding (the CPU's
/// gemm blocks a matmul of fewer rows differently: under 1e-6 here), and uneven chunks (the last
/// one short) stay within the fixture's tolerances of diffusers.
#[test]
fn chunked_rows_give_the_same_forward() {
    let cfg = config();
    let model = MiniMaxH3Transformer3DModel::new(&cfg, var_builder()).unwrap();
    let r = common::reference_in(&dir(), "transformer");
    let run = |rows: Option<usize>| {
        let layout = layout(&r);
        let mut inputs = model
            .prepare(
                &r["hidden_states"],
                &r["audio_hidden_states"],
                &r["encoder_hidden_states"],
                &r["timestep"],
                &r["timestep_indices"],
                &layout,
                &cfg.rope(&layout).unwrap(),
            )
            .unwrap();
        let mut x = inputs.take_hidden_states().unwrap();
        if let Some(rows) = rows {
            inputs.rows_per_chunk = rows;
            inputs.query_rows_per_chunk = 2 * rows + 1;
        }
        let blocks: Vec<Tensor> = model
            .blocks()
            .iter()
            .map(|block| {
                x = block.forward(&x, &inputs).unwrap();
                x.copy().unwrap()
            })
            .collect();
        let (video, audio) = model.finish(&x, &inputs).unwrap();
        (inputs.rows_per_chunk, blocks, video, audio)
    };
    let (default_rows, whole_blocks, whole_video, whole_audio) = run(None);
    assert_eq!(default_rows, cfg.rows_per_chunk());
    let seq = r["position_ids"].dim(0).unwrap();
    assert!(default_rows >= seq, "the fixture's sequence fits one chunk");
    for rows in [1, 7, seq - 1] {
        let (_, blocks, video, audio) = run(Some(rows));
        for (i, (got, want)) in blocks.iter().zip(&whole_blocks).enumerate() {
            common::assert_close(
                &format!("block.{i} in {rows}-row chunks"),
                got,
                want,
                1e-6,
                1e-6,
            );
            common::assert_close(
                &format!("block.{i} in {rows}-row chunks"),
                got,
                &r[&format!("debug.block.{i}")],
                ATOL,
                RTOL,
            );
        }
        common::assert_close("sample in chunks", &video, &whole_video, 1e-6, 1e-6);
        common::assert_close("audio in chunks", &audio, &whole_audio, 1e-6, 1e-6);
        common::assert_close("sample in chunks", &video, &r["output.sample"], ATOL, RTOL);
    }
}

#[test]
fn hostile_configs_are_one_line_errors() {
    let mut cfg = config();
    cfg.rope_freq_dim = 100;
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("rope_freq_dim"), "{err}");
    let mut cfg = config();
    cfg.num_attention_heads = 0;
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("num_attention_heads"), "{err}");
}

/// The GPU path runs the published mixed-precision checkpoint in bf16 (patch projections, time
/// embedder and heads in f32): the same forward must run with a bf16 `VarBuilder` and stay near
/// the f32 result (no reference at that precision, so only a loose sanity bound).
#[test]
fn bf16_forward_runs_near_f32() {
    let path = dir().join("transformer/diffusion_pytorch_model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::BF16, &Device::Cpu).unwrap() };
    let model = MiniMaxH3Transformer3DModel::new(&config(), vb).unwrap();
    let r = common::reference_in(&dir(), "transformer");
    let (video, audio) = reference_forward(&model, &r);
    assert_eq!(video.dtype(), DType::F32);
    common::assert_close("bf16 sample", &video, &r["output.sample"], 0.15, 0.05);
    common::assert_close(
        "bf16 audio_sample",
        &audio,
        &r["output.audio_sample"],
        0.15,
        0.05,
    );
}
