//! Times a DiT Linear exact (bf16, bias and GELU in cuBLASLt's epilogue) against `--fp8-matmul`'s
//! (the input quantized per row, then the e4m3 product with its scales and bias: on Hopper
//! vidgen's own kernel, elsewhere cuBLASLt's), at Wan2.1 14B's and 1.3B's shapes (480x832x81:
//! 32,760 tokens; the feed-forward runs in chunks of 8,192), in interleaved rounds. Also timed:
//! the input's quantization alone, cuBLASLt's scaled product (what GPUs other than Hopper run) and
//! cuBLASLt's bare e4m3 product, no scales.
//! Then a whole block's Linears as Wan's forward runs them, where self-attention's q, k and v
//! share one quantization of their input (`VIDGEN_MAX_SHARED_MEMORY_PER_BLOCK=180000` keeps the
//! Hopper kernel out: the block then runs cuBLASLt's products).
//!
//! `cargo run --release --no-default-features --features cuda --example linear_bench`

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::Linear;
use vidgen::memory::accounting::MemoryMeter;
use vidgen::models::fp8::{self, Fp8Rows};
use vidgen::models::fp8_kernels::{product, scaled_product};
use vidgen::models::fp8_sm90;
use vidgen::models::projection::{project, project_gelu_tanh, Input, Projection};

#[path = "support/median.rs"]
mod median;
use median::median_seconds as time;

/// (model, rows, in, out, GELU): the attention projections and the feed-forward's two Linears.
const SHAPES: [(&str, usize, usize, usize, bool); 6] = [
    ("14B q/k/v/o", 32760, 5120, 5120, false),
    ("14B ffn up", 8192, 5120, 13824, true),
    ("14B ffn down", 8192, 13824, 5120, false),
    ("1.3B q/k/v/o", 32760, 1536, 1536, false),
    ("1.3B ffn up", 8192, 1536, 8960, true),
    ("1.3B ffn down", 8192, 8960, 1536, false),
];

const ROUNDS: usize = 3;
const REPS: usize = 20;

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    // Freed memory stays in the pool across synchronizations, as in a run (else every timed call
    // maps its outputs anew).
    let _pool = MemoryMeter::new(&dev);
    println!("| shape | bf16 ms | fp8 ms | of which the input's quantization ms | the Hopper kernel ms | cuBLASLt's scaled product ms | cuBLASLt's bare product ms | bf16 / fp8 | TFLOP/s bf16, fp8 |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (name, rows, inner, out, gelu) in SHAPES {
        let randn = |shape: (usize, usize), std: f32| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, std, shape, &dev)?.to_dtype(DType::BF16)?)
        };
        let x = randn((rows, inner), 1.0)?;
        let w = randn((out, inner), 0.02)?;
        let b = randn((1, out), 0.1)?.squeeze(0)?;
        let weight = Fp8Rows::quantize(&w, true)?;
        let linear = Linear::new(w, Some(b.clone()));
        let exact = || {
            if gelu {
                project_gelu_tanh(&linear, &x)
            } else {
                project(&linear, &x)
            }
        };
        let input = Fp8Rows::quantize(&x, false)?;
        // The e4m3 product alone, no scales (cuBLASLt's plain fp8 kernels, which its scaled
        // product cannot use: bench/RESULTS.md session 51).
        let bare = || product(&input.q, &weight.q, DType::BF16);
        let (mut bf16, mut fp8, mut quant, mut hopper) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut cublaslt_scaled, mut bare_product) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            bf16.push(time(&dev, REPS, exact)?);
            fp8.push(time(&dev, REPS, || {
                fp8::linear(&x, &weight, Some(&b), gelu)
            })?);
            quant.push(time(&dev, REPS, || Fp8Rows::quantize(&x, false))?);
            hopper.push(time(&dev, REPS, || {
                fp8_sm90::linear(&input, &weight, Some(&b), gelu)
            })?);
            cublaslt_scaled.push(time(&dev, REPS, || {
                scaled_product(&input, &weight, Some(&b), gelu)
            })?);
            bare_product.push(time(&dev, REPS, bare)?);
        }
        let flop = 2.0 * (rows * inner * out) as f64;
        let ms = |v: &[f64]| {
            let (lo, hi) = v
                .iter()
                .fold((f64::MAX, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
            format!("{:.3}-{:.3}", lo * 1e3, hi * 1e3)
        };
        let best = |v: &[f64]| v.iter().copied().fold(f64::MAX, f64::min);
        println!(
            "| {name} [{rows}, {inner}] x [{inner}, {out}]{} | {} | {} | {} | {} | {} | {} | {:.2}x | {:.0}, {:.0} |",
            if gelu { " + GELU" } else { "" },
            ms(&bf16),
            ms(&fp8),
            ms(&quant),
            ms(&hopper),
            ms(&cublaslt_scaled),
            ms(&bare_product),
            best(&bf16) / best(&fp8),
            flop / best(&bf16) / 1e12,
            flop / best(&fp8) / 1e12,
        );
    }
    println!();
    println!("| a block's Linears, 32,760 tokens | bf16 ms | fp8 ms | bf16 / fp8 |");
    println!("|---|---|---|---|");
    for (name, dim, ffn) in [("14B", 5120, 13824), ("1.3B", 1536, 8960)] {
        let (mut bf16, mut fp8) = (Vec::new(), Vec::new());
        let exact = BlockLinears::new(&dev, dim, ffn, false)?;
        let quantized = BlockLinears::new(&dev, dim, ffn, true)?;
        for _ in 0..ROUNDS {
            bf16.push(time(&dev, REPS, || exact.run())?);
            fp8.push(time(&dev, REPS, || quantized.run())?);
        }
        let best = |v: &[f64]| v.iter().copied().fold(f64::MAX, f64::min);
        let ms = |v: &[f64]| {
            let hi = v.iter().copied().fold(0f64, f64::max);
            format!("{:.2}-{:.2}", best(v) * 1e3, hi * 1e3)
        };
        println!(
            "| {name} | {} | {} | {:.2}x |",
            ms(&bf16),
            ms(&fp8),
            best(&bf16) / best(&fp8)
        );
    }
    println!("fp8 products run: {}", fp8::products());
    Ok(())
}

/// Rows of the feed-forward's chunks (`wan::transformer`'s): 32,760 tokens in four.
const FFN_CHUNKS: [usize; 4] = [8192, 8192, 8192, 8184];

/// A Wan block's Linears at 480x832x81: self-attention's q, k, v (one input) and output,
/// cross-attention's q and output (its keys and values read 512 text tokens: left out), and
/// the feed-forward's two Linears over each chunk of rows.
struct BlockLinears {
    x: Tensor,
    attention: Projection,
    up: Projection,
    down: Projection,
}

impl BlockLinears {
    fn new(dev: &Device, dim: usize, ffn: usize, fp8: bool) -> Result<Self> {
        let randn = |shape: (usize, usize), std: f32| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, std, shape, dev)?.to_dtype(DType::BF16)?)
        };
        let layer = |inner: usize, out: usize| -> Result<Projection> {
            let bias = randn((1, out), 0.1)?.squeeze(0)?;
            let linear = Linear::new(randn((out, inner), 0.02)?, Some(bias));
            Ok(Projection::new(linear, fp8))
        };
        Ok(Self {
            x: randn((32760, dim), 1.0)?,
            attention: layer(dim, dim)?,
            up: layer(dim, ffn)?,
            down: layer(ffn, dim)?,
        })
    }

    /// `layer(x)` (+ GELU), by the fp8 product where the layer is fp8, else the exact one.
    fn apply(layer: &Projection, x: &Input, gelu: bool) -> Result<Tensor> {
        if let Some(y) = layer.fp8_product(x, layer.bias(), gelu)? {
            return Ok(y);
        }
        let linear = Linear::new(layer.weight().clone(), layer.bias().cloned());
        Ok(if gelu {
            project_gelu_tanh(&linear, x.tensor()?)?
        } else {
            project(&linear, x.tensor()?)?
        })
    }

    fn run(&self) -> Result<()> {
        let shared = Input::new(&self.x);
        for _ in 0..3 {
            Self::apply(&self.attention, &shared, false)?;
        }
        for _ in 0..3 {
            Self::apply(&self.attention, &Input::new(&self.x), false)?;
        }
        let mut row0 = 0;
        for rows in FFN_CHUNKS {
            let chunk = self.x.narrow(0, row0, rows)?;
            let h = Self::apply(&self.up, &Input::new(&chunk), true)?;
            Self::apply(&self.down, &Input::new(&h), false)?;
            row0 += rows;
        }
        Ok(())
    }
}
