//! The memory plan's FLUX.1 denoise activations against what one transformer forward allocates
//! on the CPU (f32), and its single-stream MLP step against the plan's term for it: every heap
//! allocation of this test process is counted, and each peak above what was held before must
//! stay within the plan's estimate and above three quarters of it. One test in the file, so no
//! other test's allocations mix in.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::flux::activations::{single_mlp_activations, transformer_activations};
use vidgen::models::flux::transformer::{
    image_ids, BlockStep, FluxBlock, FluxTransformer2DModel, FluxTransformerConfig,
};

#[global_allocator]
static ALLOCATOR: common::heap::Counting = common::heap::Counting;

/// The model's forward inputs in argument order: latents, timestep, prompt, pooled prompt,
/// guidance, text ids and image ids.
type Inputs = [Tensor; 7];

/// Random inputs of a forward over `image` packed image tokens (a square grid) and `text`
/// prompt rows.
fn inputs(cfg: &FluxTransformerConfig, image: usize, text: usize) -> Inputs {
    let dev = Device::Cpu;
    let side = (image as f64).sqrt() as usize;
    assert_eq!(side * side, image);
    [
        Tensor::randn(0f32, 1., (1, image, cfg.in_channels), &dev).unwrap(),
        Tensor::new(&[0.5f32], &dev).unwrap(),
        Tensor::randn(0f32, 1., (1, text, cfg.joint_attention_dim), &dev).unwrap(),
        Tensor::randn(0f32, 1., (1, cfg.pooled_projection_dim), &dev).unwrap(),
        Tensor::new(&[3.5f32], &dev).unwrap(),
        Tensor::zeros((text, 3), DType::F32, &dev).unwrap(),
        image_ids(side, side, &dev).unwrap(),
    ]
}

/// A model method that takes the forward's inputs (`forward`, `prepare`), called with `inputs`.
type Call<'a, R> =
    &'a dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor, Option<&Tensor>, &Tensor, &Tensor) -> R;

fn call<R>(inputs: &Inputs, f: Call<R>) -> R {
    let [latents, t, prompt, pooled, guidance, txt_ids, img_ids] = inputs;
    f(latents, t, prompt, pooled, Some(guidance), txt_ids, img_ids)
}

/// Heap bytes one forward of `model` holds at most above its inputs. A first forward grows the
/// CPU products' packing scratch, which each thread keeps (a GPU has none); the measured one is
/// the next.
fn measured(model: &FluxTransformer2DModel, image: usize, text: usize) -> usize {
    let inputs = inputs(model.config(), image, text);
    let forward = || {
        call(&inputs, &|a, b, c, d, e, f, g| {
            model.forward(a, b, c, d, e, f, g)
        })
    };
    common::heap::start();
    drop(forward().unwrap());
    let before = common::heap::start();
    let out = forward().unwrap();
    let peak = common::heap::peak_above(before);
    drop(out);
    peak
}

/// Heap bytes the single-stream MLP step holds at most, counted with the streams and what the
/// attention step before it hands on (after a first run of both, as [`measured`]).
fn measured_mlp_step(model: &FluxTransformer2DModel, image: usize, text: usize) -> usize {
    let cfg = model.config();
    let inputs = inputs(cfg, image, text);
    let mut prepared = call(&inputs, &|a, b, c, d, e, f, g| {
        model.prepare(a, b, c, d, e, f, g)
    })
    .unwrap();
    let streams = prepared.take_streams().unwrap();
    let single = cfg.num_layers;
    let steps = |s: &[BlockStep]| {
        FluxBlock::with_steps(cfg, single, VarBuilder::zeros(DType::F32, &Device::Cpu), s).unwrap()
    };
    let attention = steps(&[BlockStep::SingleModulation, BlockStep::SingleAttention]);
    let mlp = steps(&[BlockStep::SingleMlp]);
    let (carry, peak) = common::heap::handed_on_and_peak(
        || attention.forward(&streams, &prepared).unwrap(),
        |carried| mlp.forward(carried, &prepared).unwrap(),
    );
    let stream_bytes = (streams.image.elem_count() + streams.text.elem_count()) * 4;
    stream_bytes + carry + peak
}

/// One block of each kind at a published head width over two lengths of the joint sequence
/// (zero weights: the values do not matter here). In f32 the chunked attention is the plan's
/// peak, and the single-stream MLP, run by halves of the rows, stays under it: whole, its MLP,
/// GELU and [attention; MLP] would hold half again as much.
#[test]
fn one_forward_allocates_about_what_the_plan_predicts() {
    let tiny: FluxTransformerConfig = common::config_in("flux-tiny-a", "transformer/config.json");
    let cfg = FluxTransformerConfig {
        num_layers: 1,
        num_single_layers: 1,
        num_attention_heads: 2,
        attention_head_dim: 128,
        axes_dims_rope: vec![16, 56, 56],
        ..tiny
    };
    let model =
        FluxTransformer2DModel::new(&cfg, VarBuilder::zeros(DType::F32, &Device::Cpu)).unwrap();
    for (image, text) in [(256, 64), (1024, 64)] {
        let predicted = transformer_activations(&cfg, image, text, DType::F32) as usize;
        let peak = measured(&model, image, text);
        eprintln!("{image} image + {text} text tokens: peak {peak} bytes, predicted {predicted}");
        assert!(
            peak <= predicted,
            "{image} image tokens: one forward held {peak} bytes, the plan predicts {predicted}"
        );
        assert!(
            4 * peak >= 3 * predicted,
            "{image} image tokens: one forward held {peak} bytes, far below the plan's {predicted}"
        );
        let predicted = single_mlp_activations(&cfg, image + text, DType::F32) as usize;
        let peak = measured_mlp_step(&model, image, text);
        eprintln!("  the single-stream MLP step: peak {peak} bytes, predicted {predicted}");
        assert!(
            peak <= predicted && 4 * peak >= 3 * predicted,
            "{image} image tokens: the MLP step held {peak} bytes, the plan predicts {predicted}"
        );
    }
}
