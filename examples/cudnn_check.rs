//! On a CUDA GPU: is cuDNN found, and do its attention and 3D convolution agree with vidgen's own
//! kernels, how fast are both (CUDA events, interleaved). With `VIDGEN_CUDNN=off` it shows the
//! fallback: no cuDNN, and attention still runs (the own kernel).
//!
//! `cargo build --release --no-default-features --features cuda --example cudnn_check`;
//! `bench/cudnn_check.sh` runs it on the GPU machine.

use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::cuda::cudarc::driver::{sys::CUevent_flags, CudaStream};
use candle_core::{DType, Device, Tensor};
use vidgen::models::attention::{flash_attn, sdpa, sdpa_chunked};
use vidgen::models::{conv3d, cudnn};

/// Milliseconds `f` takes on `stream` (CUDA events around it).
fn timed(stream: &Arc<CudaStream>, f: &dyn Fn() -> Result<Tensor>) -> Result<f32> {
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let out = f()?;
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    drop(out);
    Ok(start.elapsed_ms(&end)?)
}

/// Median milliseconds of each of `fs`, timed interleaved (`reps` rounds after one warm-up).
fn interleaved(
    stream: &Arc<CudaStream>,
    reps: usize,
    fs: &[&dyn Fn() -> Result<Tensor>],
) -> Result<Vec<f32>> {
    let mut times = vec![Vec::with_capacity(reps); fs.len()];
    for round in 0..=reps {
        for (i, f) in fs.iter().enumerate() {
            let ms = timed(stream, *f)?;
            if round > 0 {
                times[i].push(ms);
            }
        }
    }
    Ok(times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f32::total_cmp);
            t[t.len() / 2]
        })
        .collect())
}

/// Max |a - b| (in f32) and max |b|.
fn max_err(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let max = |t: &Tensor| -> Result<f32> { Ok(t.abs()?.flatten_all()?.max(0)?.to_scalar()?) };
    Ok((max(&(a - &b)?)?, max(&b)?))
}

fn attention(dev: &Device, stream: &Arc<CudaStream>) -> Result<()> {
    println!(
        "\n== attention: cuDNN SDPA vs the own fused kernel (inputs in Wan's [b, s, h, d] layout)"
    );
    println!(
        "{:<12} {:>5} {:>24} {:>10} {:>10} {:>11} {:>11} {:>11}",
        "shape",
        "dtype",
        "b,h,q,kv,d",
        "own ms",
        "cudnn ms",
        "max|c-own|",
        "max|own-32|",
        "max|c-32|"
    );
    let shapes = [
        ("odd", DType::BF16, 2, 3, 1000, 333, 128),
        ("f16 cross", DType::F16, 1, 12, 4096, 512, 128),
        ("d64", DType::BF16, 1, 24, 8192, 8192, 64),
        ("1.3B cross", DType::BF16, 1, 12, 32760, 512, 128),
        ("1.3B self", DType::BF16, 1, 12, 32760, 32760, 128),
        ("14B self", DType::BF16, 1, 40, 32760, 32760, 128),
    ];
    for (name, dtype, b, h, n, m, d) in shapes {
        // Heads-major views of [b, seq, h, d] storage, as the Wan DiT passes them.
        let rand = |len: usize| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, 1f32, (b, len, h, d), dev)?
                .to_dtype(dtype)?
                .transpose(1, 2)?)
        };
        let (q, k, v) = (rand(n)?, rand(m)?, rand(m)?);
        let scale = 1.0 / (d as f64).sqrt();
        let own_ok = flash_attn::supported(&q, &k, &v);
        let Some(cu) = cudnn::sdpa::sdpa(&q, &k, &v, scale) else {
            println!("{name:<12} cuDNN declined (see the note above)");
            continue;
        };
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        // The f32 chunked reference on the smaller shapes only (it is slow on the largest).
        let reference = if n * m * h <= 12 * 32760 * 512 {
            Some(sdpa_chunked(&f32(&q)?, &f32(&k)?, &f32(&v)?, scale)?)
        } else {
            None
        };
        let fmt = |e: Option<(f32, f32)>| e.map_or("-".to_string(), |(e, _)| format!("{e:.2e}"));
        let cu_ref = reference.as_ref().map(|r| max_err(&cu, r)).transpose()?;
        if !own_ok {
            let t = interleaved(
                stream,
                5,
                &[&|| Ok(cudnn::sdpa::sdpa(&q, &k, &v, scale).expect("cuDNN ran above"))],
            )?;
            println!(
                "{name:<12} {:>5} {:>24} {:>10} {:>10.3} {:>11} {:>11} {:>11}",
                format!("{dtype:?}"),
                format!("{b},{h},{n},{m},{d}"),
                "n/a",
                t[0],
                "-",
                "-",
                fmt(cu_ref)
            );
            continue;
        }
        let own = flash_attn::flash_attn(&q, &k, &v, scale)?;
        let (diff, _) = max_err(&cu, &own)?;
        let own_ref = reference.as_ref().map(|r| max_err(&own, r)).transpose()?;
        let t = interleaved(
            stream,
            10,
            &[&|| Ok(flash_attn::flash_attn(&q, &k, &v, scale)?), &|| {
                Ok(cudnn::sdpa::sdpa(&q, &k, &v, scale).expect("cuDNN ran above"))
            }],
        )?;
        println!(
            "{name:<12} {:>5} {:>24} {:>10.3} {:>10.3} {diff:>11.2e} {:>11} {:>11}",
            format!("{dtype:?}"),
            format!("{b},{h},{n},{m},{d}"),
            t[0],
            t[1],
            fmt(own_ref),
            fmt(cu_ref)
        );
    }
    Ok(())
}

/// The path without cuDNN: a sum over temporal taps of 2D convolutions, one output frame at a
/// time, as the Wan VAE's causal conv computes it.
fn conv_by_taps(x: &Tensor, w: &Tensor, pad: usize) -> Result<Tensor> {
    let (_, _, t, _, _) = x.dims5()?;
    let kt = w.dim(2)?;
    let taps = (0..kt)
        .map(|k| w.narrow(2, k, 1)?.squeeze(2)?.contiguous())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let mut outs = Vec::new();
    for o in 0..=(t - kt) {
        let mut acc: Option<Tensor> = None;
        for (k, tap) in taps.iter().enumerate() {
            let frame = x.narrow(2, o + k, 1)?.squeeze(2)?.contiguous()?;
            let y = frame.conv2d(tap, pad, 1, 1, 1)?;
            acc = Some(match acc {
                Some(a) => (a + y)?,
                None => y,
            });
        }
        outs.push(acc.expect("kt >= 1"));
    }
    Ok(Tensor::stack(&outs, 2)?)
}

fn convolution(dev: &Device, stream: &Arc<CudaStream>) -> Result<()> {
    println!("\n== Wan VAE decoder 3x3x3 convs (f32): cuDNN (TF32 / exact) vs the own path");
    println!(
        "{:<16} {:>24} {:>9} {:>9} {:>9} {:>11} {:>11} {:>9}",
        "shape",
        "b,c,t,h,w",
        "own ms",
        "tf32 ms",
        "exact ms",
        "max|tf32|",
        "max|exact|",
        "max|own|"
    );
    // (name, channels, frames including the two cached ones, height, width)
    let shapes = [
        ("mid 384", 384, 3, 60, 104),
        ("up 384", 384, 4, 120, 208),
        ("up 192", 192, 6, 240, 416),
        ("out 96", 96, 6, 480, 832),
    ];
    for (name, c, t, h, wd) in shapes {
        let x = Tensor::randn(0f32, 1f32, (1, c, t, h, wd), dev)?;
        let w = (Tensor::randn(0f32, 1f32, (c, c, 3, 3, 3), dev)? / ((c * 27) as f64).sqrt())?;
        let own = conv_by_taps(&x, &w, 1)?;
        let run = |tf32: bool| -> Result<Tensor> {
            conv3d::set_tf32(tf32);
            conv3d::conv3d(&x, &w, [1, 1, 1], [0, 1, 1])?
                .ok_or_else(|| anyhow::anyhow!("cuDNN conv3d did not run"))
        };
        let (tf32, exact) = match (run(true), run(false)) {
            (Ok(a), Ok(b)) => (a, b),
            (a, b) => {
                println!("{name:<16} {:?} {:?}", a.err(), b.err());
                continue;
            }
        };
        let (e_tf32, scale) = max_err(&tf32, &own)?;
        let (e_exact, _) = max_err(&exact, &own)?;
        let times = interleaved(
            stream,
            5,
            &[&|| conv_by_taps(&x, &w, 1), &|| run(true), &|| run(false)],
        )?;
        println!(
            "{name:<16} {:>24} {:>9.3} {:>9.3} {:>9.3} {e_tf32:>11.2e} {e_exact:>11.2e} {scale:>9.2}",
            format!("1,{c},{t},{h},{wd}"),
            times[0],
            times[1],
            times[2]
        );
    }
    conv3d::set_tf32(true);
    Ok(())
}

/// cuDNN's bf16 3x3x3 convolutions at the HunyuanVideo VAE decoder's shapes (a 17-frame tile of a
/// 720x1280 video; inputs already replicate-padded, as the decoder hands them over): time and
/// throughput, for one output frame (how the decoder's runs call it at full resolution) and for
/// whole tiles (split where an operand passes cuDNN's 32-bit sizes).
fn bf16_convolution(dev: &Device, stream: &Arc<CudaStream>) -> Result<()> {
    println!(
        "\n== HunyuanVideo VAE decoder 3x3x3 convs (bf16, cuDNN): time and throughput, NCDHW and NDHWC"
    );
    println!(
        "{:<24} {:>28} {:>10} {:>9} {:>10} {:>9} {:>11}",
        "shape", "c_in,c_out,t_in,h,w", "NCDHW ms", "TFLOP/s", "NDHWC ms", "TFLOP/s", "max|diff|"
    );
    // (name, in channels, out channels, padded input frames, output height, output width)
    let shapes = [
        ("full 128, 1 frame", 128, 128, 3, 720, 1280),
        ("full 256->128, 1 frame", 256, 128, 3, 720, 1280),
        ("full 256, 1 frame", 256, 256, 3, 720, 1280),
        ("full 128, 17 frames", 128, 128, 19, 720, 1280),
        ("half 512, 9 frames", 512, 512, 11, 360, 640),
        ("quarter 512, 5 frames", 512, 512, 7, 180, 320),
    ];
    for (name, c_in, c_out, t, h, wd) in shapes {
        let x =
            Tensor::randn(0f32, 1f32, (1, c_in, t, h + 2, wd + 2), dev)?.to_dtype(DType::BF16)?;
        let w = (Tensor::randn(0f32, 1f32, (c_out, c_in, 3, 3, 3), dev)?
            / ((c_in * 27) as f64).sqrt())?
        .to_dtype(DType::BF16)?;
        let run = || -> Result<Tensor> {
            conv3d::conv3d(&x, &w, [1, 1, 1], [0, 0, 0])?
                .ok_or_else(|| anyhow::anyhow!("cuDNN conv3d did not run"))
        };
        let (xl, wl) = (
            x.permute((0, 2, 3, 4, 1))?.contiguous()?,
            w.permute((0, 2, 3, 4, 1))?.contiguous()?,
        );
        let run_last = || -> Result<Tensor> {
            conv3d::conv3d_channels_last(&xl, &wl, [1, 1, 1], [0, 0, 0])?
                .ok_or_else(|| anyhow::anyhow!("cuDNN conv3d did not run"))
        };
        let first = match run() {
            Ok(y) => y,
            Err(e) => {
                println!("{name:<24} {e}");
                continue;
            }
        };
        // Past cuDNN's 32-bit sizes the channels-last call has no frame runs: NCDHW alone.
        let diff = match run_last() {
            Ok(last) => Some(max_err(&last.permute((0, 4, 1, 2, 3))?, &first)?.0),
            Err(_) => None,
        };
        drop(first);
        let flops = 2.0 * (c_in * c_out * 27) as f64 * ((t - 2) * h * wd) as f64;
        let tflops = |ms: f32| flops / (ms as f64 * 1e-3) / 1e12;
        let shape = format!("{c_in},{c_out},{t},{h},{wd}");
        match diff {
            Some(diff) => {
                let ms = interleaved(stream, 3, &[&run, &run_last])?;
                println!(
                    "{name:<24} {shape:>28} {:>10.2} {:>9.1} {:>10.2} {:>9.1} {diff:>11.2e}",
                    ms[0],
                    tflops(ms[0]),
                    ms[1],
                    tflops(ms[1])
                );
            }
            None => {
                let ms = interleaved(stream, 3, &[&run])?[0];
                println!("{name:<24} {shape:>28} {ms:>10.2} {:>9.1}", tflops(ms));
            }
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let dev = Device::cuda_if_available(0)?;
    let Device::Cuda(cuda) = &dev else {
        bail!("cudnn_check needs a CUDA build (--features cuda) and a GPU");
    };
    let stream = cuda.cuda_stream();
    match cudnn::api() {
        Some(api) => println!("cuDNN {} loaded", api.version_string()),
        None => {
            println!(
                "cuDNN not loaded ({}={:?})",
                cudnn::ENV,
                std::env::var(cudnn::ENV).ok()
            );
            // The fallback: attention through `sdpa` still runs (the own kernel), cuDNN's
            // attention and convolution decline.
            let q = Tensor::randn(0f32, 1f32, (1, 12, 4096, 128), &dev)?.to_dtype(DType::BF16)?;
            let scale = 1.0 / 128f64.sqrt();
            let out = sdpa(&q, &q, &q, scale)?;
            let q32 = q.to_dtype(DType::F32)?;
            let (e, _) = max_err(&out, &sdpa_chunked(&q32, &q32, &q32, scale)?)?;
            let x = Tensor::zeros((1, 4, 3, 8, 8), DType::F32, &dev)?;
            let w = Tensor::zeros((4, 4, 3, 3, 3), DType::F32, &dev)?;
            let said = |ran: bool| if ran { "RAN (unexpected)" } else { "declined" };
            println!(
                "fallback: sdpa ran (own kernel: {}), max |out - f32 reference| {e:.2e}; \
                 cuDNN sdpa {}, cuDNN conv3d {}",
                flash_attn::supported(&q, &q, &q),
                said(cudnn::sdpa::sdpa(&q, &q, &q, scale).is_some()),
                said(conv3d::conv3d(&x, &w, [1, 1, 1], [0, 1, 1])?.is_some()),
            );
            return Ok(());
        }
    }
    attention(&dev, &stream)?;
    convolution(&dev, &stream)?;
    bf16_convolution(&dev, &stream)?;
    Ok(())
}
