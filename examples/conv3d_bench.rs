//! Times vidgen's own 3D convolution kernels (channels first: each configuration, TF32 and bf16;
//! channels last: each configuration, gather and halo in TF32, narrow in exact f32) against cuDNN (where it is loaded)
//! and the sum of 2D convolutions they replace, at the Wan VAE decoder's shapes, and checks each
//! against the exact f32 tap sum.
//!
//! `cargo run --release --no-default-features --features cuda --example conv3d_bench [subpixel]`
//! (`subpixel`: only the upsamplers' 2x2 convolutions)

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use vidgen::models::conv3d::{self, kernel};

#[path = "support/median.rs"]
mod median;
use median::median_seconds as time;

/// The decoder's convolutions: (x dims, output channels, kernel, padding), stride 1, the causal
/// temporal padding already in `x`. First the 3x3x3 ones; the one to 3 channels is the head (96
/// channels to RGB) of a 4-frame chunk, which the narrow channels-last kernel takes. Then the
/// upsamplers' 2x2 parity convolutions (nearest x2 then 3x3, as four 2x2 kernels on the frame:
/// 4 x C_out channels, padding 1).
const SHAPES: [Shape; 9] = [
    ([1, 384, 3, 60, 104], 384, [3, 3, 3], [0, 1, 1]),
    ([1, 384, 4, 120, 208], 384, [3, 3, 3], [0, 1, 1]),
    ([1, 192, 6, 240, 416], 192, [3, 3, 3], [0, 1, 1]),
    ([1, 96, 6, 480, 832], 96, [3, 3, 3], [0, 1, 1]),
    ([1, 192, 6, 480, 832], 96, [3, 3, 3], [0, 1, 1]),
    ([1, 96, 6, 480, 832], 3, [3, 3, 3], [0, 1, 1]),
    ([1, 384, 2, 60, 104], 768, [1, 2, 2], [0, 1, 1]),
    ([1, 384, 4, 120, 208], 768, [1, 2, 2], [0, 1, 1]),
    ([1, 192, 4, 240, 416], 384, [1, 2, 2], [0, 1, 1]),
];
const STRIDE: [usize; 3] = [1, 1, 1];

/// x dims (NCDHW), output channels, kernel (t, h, w), padding (t, h, w).
type Shape = ([usize; 5], usize, [usize; 3], [usize; 3]);

/// The fallback without cuDNN: every output frame a sum over temporal taps of 2D convolutions
/// (candle's, exact f32).
fn tap_sum(x: &Tensor, w: &Tensor, padding: usize) -> Result<Tensor> {
    let kt = w.dim(2)?;
    let taps = (0..kt)
        .map(|k| w.narrow(2, k, 1)?.squeeze(2)?.contiguous())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let frames = x.dim(2)? + 1 - kt;
    let mut out = Vec::with_capacity(frames);
    for o in 0..frames {
        let mut acc: Option<Tensor> = None;
        for (k, tap) in taps.iter().enumerate() {
            let frame = x.narrow(2, o + k, 1)?.squeeze(2)?.contiguous()?;
            let y = frame.conv2d(tap, padding, STRIDE[1], 1, 1)?;
            acc = Some(match acc {
                Some(a) => (a + y)?,
                None => y,
            });
        }
        out.push(acc.expect("a kernel has taps"));
    }
    Ok(Tensor::stack(&out, 2)?)
}

/// Max absolute error of `y` against `reference`, and that over max |reference|.
fn errors(y: &Tensor, reference: &Tensor) -> Result<(f32, f32)> {
    let max =
        |t: &Tensor| -> Result<f32> { Ok(t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?) };
    let diff = max(&(y.to_dtype(DType::F32)? - reference)?)?;
    Ok((diff, diff / max(reference)?))
}

fn main() -> Result<()> {
    let dev = Device::cuda_if_available(0)?;
    if !dev.is_cuda() {
        bail!("conv3d_bench needs a CUDA build (--features cuda) and a GPU");
    }
    let cudnn = vidgen::models::cudnn::api().is_some();
    println!(
        "{:<24} {:>4} {:>8} {:>5} {:<34} {:>9} {:>8} {:>10} {:>10}",
        "x", "Cout", "GFLOP", "dtype", "path", "ms", "TFLOP/s", "max diff", "rel diff"
    );
    let only_subpixel = std::env::args().nth(1).as_deref() == Some("subpixel");
    for (xd, c_out, kernel, padding) in SHAPES {
        if only_subpixel && kernel[1] != 2 {
            continue;
        }
        let x = Tensor::randn(0f32, 1f32, &xd[..], &dev)?;
        let taps: usize = kernel.iter().product();
        let fan_in = (xd[1] * taps) as f64;
        let w = (Tensor::randn(
            0f32,
            1f32,
            (c_out, xd[1], kernel[0], kernel[1], kernel[2]),
            &dev,
        )? / fan_in.sqrt())?;
        let out = |i: usize| xd[i + 2] + 2 * padding[i] + 1 - kernel[i];
        let gflop = 2.0 * (c_out * xd[1] * taps * out(0) * out(1) * out(2)) as f64 / 1e9;
        let reference = tap_sum(&x, &w, padding[1])?;
        let row = |dtype: &str, path: &str, seconds: f64, y: &Tensor| -> Result<()> {
            let (max, rel) = errors(y, &reference)?;
            println!(
                "{:<24} {c_out:>4} {gflop:>8.1} {dtype:>5} {path:<34} {:>9.3} {:>8.1} {max:>10.2e} {rel:>10.2e}",
                format!("{xd:?}"),
                seconds * 1e3,
                gflop / seconds / 1e3,
            );
            Ok(())
        };
        let taps = time(&dev, 3, || tap_sum(&x, &w, padding[1]))?;
        row("f32", "tap sum", taps, &reference)?;
        if cudnn {
            conv3d::set_tf32(true);
            let run = || conv3d::conv3d(&x, &w, STRIDE, padding);
            let y = run()?.expect("cuDNN runs f32");
            row("f32", "cuDNN tf32", time(&dev, 10, run)?, &y)?;
            // Channels last (NDHWC activations, [C_out, kt, kh, kw, C_in] filters), where cuDNN's
            // tensor-core kernels read without transposing; the output compared channels first.
            for dtype in [DType::F32, DType::BF16] {
                let xl = x.to_dtype(dtype)?.permute((0, 2, 3, 4, 1))?.contiguous()?;
                let wl = w.to_dtype(dtype)?.permute((0, 2, 3, 4, 1))?.contiguous()?;
                let run = || conv3d::conv3d_channels_last(&xl, &wl, STRIDE, padding);
                let y = run()?.expect("cuDNN runs channels last");
                let y = y.permute((0, 4, 1, 2, 3))?.contiguous()?;
                let name = if dtype == DType::F32 { "tf32" } else { "bf16" };
                // conv3d_channels_last runs the own kernel where it outruns cuDNN: named so.
                let path = if kernel::outruns_cudnn(&xl, &wl, STRIDE, padding, true) {
                    "NDHWC routed to own kernel"
                } else {
                    "cuDNN NDHWC"
                };
                row(name, path, time(&dev, 10, run)?, &y)?;
            }
        }
        // The own channels-last kernel (TF32; narrow: exact f32), each configuration, from and to
        // NDHWC like the cuDNN NDHWC rows.
        {
            let xl = x.permute((0, 2, 3, 4, 1))?.contiguous()?;
            let wl = w.permute((0, 2, 3, 4, 1))?.contiguous()?;
            for tile in kernel::channels_last_tiles(c_out, kernel, STRIDE) {
                let run =
                    || kernel::conv3d_channels_last_tile(&xl, &wl, STRIDE, padding, Some(tile));
                let block = match tile.kind {
                    kernel::ClKind::Gather => format!("m{}", tile.positions),
                    kernel::ClKind::Halo => format!("halo t{}", tile.positions / 16),
                    kernel::ClKind::Narrow => format!("narrow t{}", tile.positions / 64),
                };
                let path = format!(
                    "own NDHWC {block} n{} k{} s{} w{}",
                    tile.channels, tile.k, tile.stages, tile.warps
                );
                // A configuration beyond this device's shared memory is an error: noted, skipped.
                match run() {
                    Ok(y) => {
                        let y = y.permute((0, 4, 1, 2, 3))?.contiguous()?;
                        let dtype = if tile.kind == kernel::ClKind::Narrow {
                            "f32"
                        } else {
                            "tf32"
                        };
                        row(dtype, &path, time(&dev, 10, run)?, &y)?;
                    }
                    Err(e) => println!("{path}: {e}"),
                }
            }
        }
        for dtype in [DType::F32, DType::BF16] {
            let (x, w) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?);
            let name = if dtype == DType::F32 { "tf32" } else { "bf16" };
            for tile in kernel::tiles(c_out, dtype) {
                let run = || kernel::conv3d_tile(&x, &w, STRIDE, padding, Some(tile));
                let path = format!("own m{} s{}", tile.channels, tile.stages);
                row(name, &path, time(&dev, 10, run)?, &run()?)?;
            }
            if cudnn && dtype == DType::BF16 {
                let run = || conv3d::conv3d(&x, &w, STRIDE, padding);
                let y = run()?.expect("cuDNN runs bf16");
                row(name, "cuDNN", time(&dev, 10, run)?, &y)?;
            }
        }
    }
    Ok(())
}
