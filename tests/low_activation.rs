//! The Wan transformer's low-activation mode (`--low-activation`: every step of a block by
//! chunks of tokens written over the hidden states) against its normal path on the CPU: the
//! same bits over a sequence of several chunks in a batch of two, with the image branch (Wan2.1
//! I2V), per-token timesteps whose runs cross chunks (Wan2.2 TI2V), and blocks split into their
//! steps (leaf-level streaming); and against diffusers on the tiny fixture's inputs.

mod common;

use candle_core::{DType, Device, Tensor};
use vidgen::models::wan::transformer::{
    BlockInputs, BlockStep, WanTransformer3DModel, WanTransformerBlock, WanTransformerConfig,
    LOW_ACTIVATION_ROWS,
};

const T2V: &str = "wan-tiny-a";
const I2V: &str = "wan21-i2v-tiny-a";
const TI2V: &str = "wan22-ti2v-tiny-a";

/// Latent frames, height and width: 2 x 30 x 36 tokens after the 1x2x2 patch, a chunk of
/// [`LOW_ACTIVATION_ROWS`] and a short one per batch entry.
const LATENT: [usize; 3] = [2, 60, 72];

fn transformer(fixture: &str) -> (WanTransformerConfig, WanTransformer3DModel) {
    let cfg: WanTransformerConfig = common::config_in(fixture, "transformer/config.json");
    let model = WanTransformer3DModel::new(&cfg, block_weights(fixture)).unwrap();
    (cfg, model)
}

fn block_weights(fixture: &str) -> candle_nn::VarBuilder<'static> {
    common::var_builder_in(fixture, "transformer/diffusion_pytorch_model.safetensors")
}

/// Deterministic values in [-1, 1] of `shape` (`sin` of a ramp, `seed` its phase).
fn values(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f64 * 0.618_034 + seed as f64).sin()) as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = t
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    v.into_iter().map(f32::to_bits).collect()
}

/// The blocks of `model` on `inputs` through `forward_owned`, in low-activation mode where `low`,
/// then the output head.
fn forward(model: &WanTransformer3DModel, inputs: &BlockInputs, low: bool) -> Tensor {
    let mut inputs = inputs.clone();
    inputs.low_activation = low;
    let mut x = inputs.take_hidden_states().unwrap();
    for block in model.blocks() {
        x = block.forward_owned(x, &inputs).unwrap();
    }
    model.finish(&x, &inputs).unwrap()
}

/// Inputs for a batch of two of the model's latents at [`LATENT`] with `text_len` text tokens,
/// `timestep` (`[2]` or per token) and image tokens where the model has an image branch.
fn inputs(
    cfg: &WanTransformerConfig,
    model: &WanTransformer3DModel,
    timestep: &Tensor,
) -> BlockInputs {
    let [f, h, w] = LATENT;
    let latents = values(&[2, cfg.in_channels, f, h, w], 1);
    let text_len = if cfg.has_image_branch() { 512 } else { 9 };
    let text = values(&[2, text_len, cfg.text_dim], 2);
    let image = cfg.image_dim.map(|d| values(&[2, 5, d], 3));
    let inputs = model
        .prepare_with_image(&latents, timestep, &text, image.as_ref())
        .unwrap();
    let seq: usize = inputs.grid.iter().product();
    assert!(seq > LOW_ACTIVATION_ROWS && !seq.is_multiple_of(LOW_ACTIVATION_ROWS));
    inputs
}

fn check_same(fixture: &str, timestep: &Tensor) {
    let (cfg, model) = transformer(fixture);
    let inputs = inputs(&cfg, &model, timestep);
    let normal = forward(&model, &inputs, false);
    let low = forward(&model, &inputs, true);
    assert!(
        bits(&normal) == bits(&low),
        "{fixture}: low-activation output differs"
    );
}

#[test]
fn low_activation_blocks_give_the_same_bits() {
    let both = Tensor::new(&[999f32, 421.5], &Device::Cpu).unwrap();
    check_same(T2V, &both);
    check_same(I2V, &both);
    // Wan2.2 TI2V image-to-video: frame 0's tokens at 0, the rest at t (runs crossing chunks).
    let [f, h, w] = LATENT;
    let frame = (h / 2) * (w / 2);
    let per_token: Vec<f32> = (0..2 * f * frame)
        .map(|i| match (i / (f * frame), i % (f * frame) < frame) {
            (0, true) => 0.0,
            (0, false) => 700.0,
            _ => 300.0,
        })
        .collect();
    let per_token = Tensor::from_vec(per_token, (2, f * frame), &Device::Cpu).unwrap();
    check_same(TI2V, &per_token);
}

/// Leaf-level streaming runs each step of a block as a block of its own: in low-activation mode
/// each step writes over the hidden states it is given (`forward_owned`), with the bits of the
/// whole block; `forward` (whose input is the caller's) leaves its input as it was.
#[test]
fn low_activation_steps_write_over_their_input_only_when_given_it() {
    let (cfg, model) = transformer(T2V);
    let timestep = Tensor::new(&[999f32, 421.5], &Device::Cpu).unwrap();
    let mut inputs = inputs(&cfg, &model, &timestep);
    let x = inputs.take_hidden_states().unwrap();
    let whole = model.blocks()[0].forward(&x, &inputs).unwrap();
    let mut low = inputs.clone();
    low.low_activation = true;
    let before = bits(&x);
    let copied = model.blocks()[0].forward(&x, &low).unwrap();
    assert!(bits(&x) == before, "forward wrote over the caller's input");
    assert!(bits(&copied) == bits(&whole));
    let vb = block_weights(T2V).pp("blocks.0");
    let mut h = x.copy().unwrap();
    for step in BlockStep::ALL {
        let part = WanTransformerBlock::with_steps(&cfg, vb.clone(), &[step]).unwrap();
        let given = h.clone();
        h = part.forward_owned(h, &low).unwrap();
        assert!(
            bits(&given) == bits(&h),
            "{step:?} did not write over its input"
        );
    }
    assert!(
        bits(&h) == bits(&whole),
        "steps apart differ from the block"
    );
}

/// On the fixture's own inputs (one chunk) the low-activation forward matches diffusers as the
/// normal one does.
#[test]
fn low_activation_matches_diffusers() {
    let (_, model) = transformer(T2V);
    let r = common::reference("transformer");
    let inputs = model
        .prepare(
            &r["hidden_states"],
            &r["timestep_float"],
            &r["encoder_hidden_states"],
        )
        .unwrap();
    let out = forward(&model, &inputs, true);
    common::assert_close("output_t937_5", &out, &r["output_t937_5"], 1e-4, 1e-4);
}

/// `--low-activation` reaches the pipeline's transformer: a tiny synthetic run over 1,280 tokens
/// (two chunks) writes the frames of the run without it, bit for bit; another family refuses
/// the flag (exit 2).
#[test]
fn the_flag_gives_the_same_frames_end_to_end() {
    let dir = common::scratch_dir("low-activation", "e2e");
    let frames = |extra: &[&str]| {
        let mut args: Vec<String> = [
            "generate",
            "--model",
            "synthetic:wan2.1-tiny",
            "--prompt",
            "a fox",
            "--seed",
            "1",
            "--num-frames",
            "17",
            "--height",
            "256",
            "--width",
            "256",
            "--num-inference-steps",
            "2",
            "--device",
            "cpu",
            "--output-type",
            "safetensors",
            "--overwrite",
            "--output-video-name",
            "v",
            "--output-path",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push(dir.display().to_string());
        args.extend(extra.iter().map(|s| s.to_string()));
        let out = common::run_vidgen(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let written = candle_core::safetensors::load(dir.join("v.safetensors"), &Device::Cpu);
        written.unwrap()["frames"].clone()
    };
    assert!(bits(&frames(&[])) == bits(&frames(&["--low-activation"])));
    let refused = common::run_vidgen(
        &[
            "generate",
            "--model",
            "synthetic:ltx-video",
            "--prompt",
            "x",
            "--dry-run",
        ]
        .iter()
        .chain(&["--low-activation"])
        .map(|s| s.to_string())
        .collect::<Vec<_>>(),
    );
    let line = common::usage_error(&refused, "--low-activation on LTX-Video");
    assert!(line.contains("--low-activation does not apply"), "{line}");
}

/// On CUDA in bf16 (the fused row kernels, cuBLAS, the fused attention over 9,360 keys), with
/// seeded weights of a 128-wide head: the low-activation forward writes over the hidden states
/// and stays within bf16 rounding of the normal one (cuBLAS may pick other kernels for a chunk's
/// rows than for all of them). Skipped without a CUDA device.
#[cfg(feature = "cuda")]
#[test]
fn low_activation_on_cuda_stays_within_bf16_rounding() {
    use vidgen::weights::{WeightSet, Weights};
    let Ok(device) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return;
    };
    let cfg = WanTransformerConfig {
        num_attention_heads: 4,
        attention_head_dim: 128,
        ffn_dim: 1024,
        num_layers: 2,
        text_dim: 64,
        freq_dim: 32,
        ..WanTransformerConfig::default()
    };
    let vb = WeightSet::open(&Weights::Synthetic { seed: 7 })
        .unwrap()
        .var_builder(DType::BF16, &device);
    let model = WanTransformer3DModel::new(&cfg, vb).unwrap();
    let on_gpu = |t: Tensor| t.to_dtype(DType::BF16).unwrap().to_device(&device).unwrap();
    let latents = on_gpu(values(&[1, 16, 3, 120, 104], 1));
    let text = on_gpu(values(&[1, 512, 64], 2));
    let timestep = Tensor::new(&[812f32], &device).unwrap();
    let inputs = model.prepare(&latents, &timestep, &text).unwrap();
    let normal = forward(&model, &inputs, false);
    let low = forward(&model, &inputs, true);
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    let (low, normal) = (cpu(&low), cpu(&normal));
    let diff = common::max_abs_diff(&low, &normal);
    let scale = common::max_abs_diff(&normal, &normal.zeros_like().unwrap());
    eprintln!("low-activation vs normal on CUDA: max |diff| {diff:e} of max |out| {scale:e}");
    assert!(diff <= 1e-2 * scale, "{diff} of {scale}");
    let mut low_inputs = inputs.clone();
    low_inputs.low_activation = true;
    let x = low_inputs.take_hidden_states().unwrap();
    let given = x.clone();
    let out = model.blocks()[0].forward_owned(x, &low_inputs).unwrap();
    assert!(
        bits(&given) == bits(&out),
        "the block did not write over its input"
    );
}
