//! The memory plan's HunyuanVideo denoise activations against what one transformer forward
//! allocates on the CPU (f32), and its single-stream MLP step (by chunks of
//! `MLP_CHUNK_TOKENS` rows) against the plan's term for it: every heap allocation of this test
//! process is counted, and each peak above what was held before must stay within the plan's
//! estimate and above three quarters of it. One test in the file, so no other test's
//! allocations mix in.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::hunyuan_video::activations::{single_mlp_activations, transformer_activations};
use vidgen::models::hunyuan_video::transformer::{
    BlockStep, HunyuanVideoBlock, HunyuanVideoTransformer3DModel, HunyuanVideoTransformerConfig,
    MLP_CHUNK_TOKENS,
};

#[global_allocator]
static ALLOCATOR: common::heap::Counting = common::heap::Counting;

/// Text rows of every forward here (all valid).
const TEXT: usize = 64;

/// The forward's inputs in argument order: latents `[1, C, frames, side, side]`, timestep, text,
/// text mask, pooled text and guidance.
fn inputs(cfg: &HunyuanVideoTransformerConfig, frames: usize, side: usize) -> [Tensor; 6] {
    let dev = Device::Cpu;
    let randn = |shape: &[usize]| Tensor::randn(0f32, 1., shape, &dev).unwrap();
    [
        randn(&[1, cfg.in_channels, frames, side, side]),
        Tensor::new(&[500f32], &dev).unwrap(),
        randn(&[1, TEXT, cfg.text_embed_dim]),
        Tensor::ones((1, TEXT), DType::F32, &dev).unwrap(),
        randn(&[1, cfg.pooled_projection_dim]),
        Tensor::new(&[6000f32], &dev).unwrap(),
    ]
}

/// Heap bytes one forward of `model` holds at most above its inputs. A first forward grows the
/// CPU products' packing scratch, which each thread keeps (a GPU has none); the measured one is
/// the next.
fn measured(model: &HunyuanVideoTransformer3DModel, frames: usize, side: usize) -> usize {
    let [latents, t, text, mask, pooled, guidance] = inputs(model.config(), frames, side);
    let forward = || {
        model
            .forward(&latents, &t, &text, &mask, &pooled, Some(&guidance))
            .unwrap()
    };
    common::heap::start();
    drop(forward());
    let before = common::heap::start();
    let out = forward();
    let peak = common::heap::peak_above(before);
    drop(out);
    peak
}

/// Heap bytes the single-stream MLP step holds at most, counted with the streams and what the
/// attention step before it hands on (after a first run of both, as [`measured`]).
fn measured_mlp_step(cfg: &HunyuanVideoTransformerConfig, frames: usize, side: usize) -> usize {
    let vb = VarBuilder::zeros(DType::F32, &Device::Cpu);
    let model = HunyuanVideoTransformer3DModel::new_without_blocks(cfg, vb.clone()).unwrap();
    let [latents, t, text, mask, pooled, guidance] = inputs(cfg, frames, side);
    let mut prepared = model
        .prepare(&latents, &t, &text, &mask, &pooled, Some(&guidance))
        .unwrap();
    let streams = prepared.take_streams().unwrap();
    let single = cfg.num_refiner_layers + cfg.num_layers;
    let step = |s: &[BlockStep]| HunyuanVideoBlock::with_steps(cfg, single, vb.clone(), s).unwrap();
    let attention = step(&[BlockStep::SingleModulation, BlockStep::SingleAttention]);
    let mlp = step(&[BlockStep::SingleMlp]);
    let (carry, peak) = common::heap::handed_on_and_peak(
        || attention.forward(&streams, &prepared).unwrap(),
        |carried| mlp.forward(carried, &prepared).unwrap(),
    );
    let stream_bytes = (streams.video.elem_count() + streams.text.elem_count()) * 4;
    stream_bytes + carry + peak
}

/// Heap bytes of the tensors' headers, shapes and strides and the steps' vectors, which a GPU
/// keeps in host memory: not the plan's (a step held 1.6 KB of them at 320 tokens).
const HOST_BOOKKEEPING: usize = 16 << 10;

/// Checks `peak` against `predicted`: within it (and the host's bookkeeping) and above three
/// quarters of it.
fn assert_near_plan(what: &str, peak: usize, predicted: usize) {
    eprintln!("{what}: peak {peak} bytes, predicted {predicted}");
    assert!(
        peak <= predicted + HOST_BOOKKEEPING,
        "{what}: held {peak} bytes, the plan predicts {predicted}"
    );
    assert!(
        4 * peak >= 3 * predicted,
        "{what}: held {peak} bytes, far below the plan's {predicted}"
    );
}

/// The single-stream MLP step over `frames` latent frames of `side` x `side` against the plan's
/// term for it.
fn assert_mlp_step_near_plan(cfg: &HunyuanVideoTransformerConfig, frames: usize, side: usize) {
    let video = frames * (side / cfg.patch_size).pow(2);
    let predicted = single_mlp_activations(cfg, video + TEXT, DType::F32) as usize;
    let peak = measured_mlp_step(cfg, frames, side);
    assert_near_plan(
        &format!("{video} video tokens, the MLP step"),
        peak,
        predicted,
    );
}

/// One block of each kind at the published head width over two video lengths (zero weights:
/// the values do not matter here); then the single-stream MLP step of a narrow model over more
/// tokens than one chunk, where the chunks done so far are held beside the next one.
#[test]
fn one_forward_allocates_about_what_the_plan_predicts() {
    let tiny: HunyuanVideoTransformerConfig =
        common::config_in("hunyuanvideo-tiny-a", "transformer/config.json");
    let one_of_each = HunyuanVideoTransformerConfig {
        num_layers: 1,
        num_single_layers: 1,
        num_refiner_layers: 1,
        ..tiny.clone()
    };
    let cfg = HunyuanVideoTransformerConfig {
        num_attention_heads: 2,
        attention_head_dim: 128,
        rope_axes_dim: vec![16, 56, 56],
        ..one_of_each.clone()
    };
    let model =
        HunyuanVideoTransformer3DModel::new(&cfg, VarBuilder::zeros(DType::F32, &Device::Cpu))
            .unwrap();
    let patch = cfg.patch_size;
    for (frames, side) in [(1, 32), (4, 32)] {
        let latent = [1, cfg.in_channels, frames, side, side];
        let video = frames * (side / patch) * (side / patch);
        let predicted = transformer_activations(&cfg, latent, TEXT, DType::F32) as usize;
        let peak = measured(&model, frames, side);
        assert_near_plan(&format!("{video} video tokens, a forward"), peak, predicted);
        assert_mlp_step_near_plan(&cfg, frames, side);
    }
    // One head of the fixture's width: the attention before the step stays cheap.
    let narrow = HunyuanVideoTransformerConfig {
        num_attention_heads: 1,
        ..one_of_each
    };
    let (frames, side) = (9, 64);
    assert!(frames * (side / patch) * (side / patch) + TEXT > MLP_CHUNK_TOKENS);
    assert_mlp_step_near_plan(&narrow, frames, side);
}
