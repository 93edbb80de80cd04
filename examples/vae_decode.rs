//! Times the Wan2.1 VAE decode on a CUDA GPU, f32, and measures TF32's error against exact f32:
//! synthetic Wan2.1 1.3B VAE weights (seeded), seeded latents (default `[1, 16, 21, 60, 104]`:
//! 480x832, 81 frames). Every decode is preceded by a warm-up decode of the first two latent
//! frames, which meets every convolution shape of the full decode (cuDNN's algorithms are chosen
//! there, by timing), so the timed decode is the steady state, as in
//! `bench/peer_wan_vae_decode.py`. With `--fixture DIR` it also decodes the fixture's reference
//! latents (`reference/vae.safetensors`) and reports the error against diffusers' frames.
//!
//! `cargo build --release --no-default-features --features cuda --example vae_decode`;
//! `vae_decode [B,C,F,h,w] [--exact] [--fixture DIR]`: `--exact` also decodes with exact f32
//! (`--no-tf32`) and reports max |TF32 - exact|. One JSON line per measurement on stdout.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::conv3d;
use vidgen::models::source::{component_weights, ModelSource};
use vidgen::models::wan::vae::{AutoencoderKLWan, WanVaeConfig};
use vidgen::pipeline::wan_t2v::WanConfigs;
use vidgen::rng::TorchGenerator;
use vidgen::weights::WeightSet;

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// Decodes `z` after a warm-up on its first two latent frames; the output on the host and the
/// seconds of the warm-up and of the decode.
fn timed_decode(vae: &AutoencoderKLWan, z: &Tensor, dev: &Device) -> Result<(Tensor, f64, f64)> {
    let start = Instant::now();
    drop(vae.decode(&z.narrow(2, 0, z.dim(2)?.min(2))?)?);
    dev.synchronize()?;
    let warm = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let out = vae.decode(z)?;
    dev.synchronize()?;
    let secs = start.elapsed().as_secs_f64();
    Ok((out.to_device(&Device::Cpu)?, warm, secs))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let shape: Vec<usize> = args
        .iter()
        .find(|a| a.contains(','))
        .map_or("1,16,21,60,104", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .context("latent shape is B,C,F,h,w")?;
    let exact = args.iter().any(|a| a == "--exact");
    let fixture = args
        .iter()
        .position(|a| a == "--fixture")
        .and_then(|i| args.get(i + 1));
    let dev = Device::new_cuda(0)?;
    let cudnn = vidgen::models::cudnn::api().map(|api| api.version_string());

    if let Some(dir) = fixture {
        let dir = std::path::Path::new(dir);
        let cfg: WanVaeConfig =
            serde_json::from_str(&std::fs::read_to_string(dir.join("vae/config.json"))?)?;
        let files = [dir.join("vae/diffusion_pytorch_model.safetensors")];
        // SAFETY: the fixture's files are only read.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &dev)? };
        let vae = AutoencoderKLWan::new(&cfg, vb)?;
        let r =
            candle_core::safetensors::load(dir.join("reference/vae.safetensors"), &Device::Cpu)?;
        let z = r["decode.latents_denormalized"].to_device(&dev)?;
        let want = &r["decode.video"];
        let mut outs = Vec::new();
        for tf32 in [true, false] {
            conv3d::set_tf32(tf32);
            let out = vae.decode(&z)?.to_device(&Device::Cpu)?;
            println!(
                "{{\"fixture\":\"{}\",\"tf32\":{tf32},\"cudnn\":{:?},\"max_abs_vs_diffusers\":{}}}",
                dir.display(),
                cudnn,
                max_abs(&out, want)?
            );
            outs.push(out);
        }
        conv3d::set_tf32(true);
        println!(
            "{{\"fixture\":\"{}\",\"max_abs_tf32_vs_exact\":{}}}",
            dir.display(),
            max_abs(&outs[0], &outs[1])?
        );
    }

    let source = ModelSource::parse("synthetic:wan2.1-t2v-1.3b")?;
    let cfg = WanConfigs::read(&source)?.vae;
    let weights = WeightSet::open(&component_weights(&source, "vae")?)?;
    let start = Instant::now();
    let vae = AutoencoderKLWan::new(&cfg, weights.var_builder(DType::F32, &dev))?;
    dev.synchronize()?;
    let setup = start.elapsed().as_secs_f64();
    let z = TorchGenerator::new(1).randn(&shape)?.to_device(&dev)?;
    let mut outs = Vec::new();
    for tf32 in std::iter::once(true).chain(exact.then_some(false)) {
        conv3d::set_tf32(tf32);
        let (out, warm, secs) = timed_decode(&vae, &z, &dev)?;
        println!(
            "{{\"latents\":{shape:?},\"frames\":{:?},\"tf32\":{tf32},\"cudnn\":{cudnn:?},\"decode_s\":{secs:.3},\"warm_up_s\":{warm:.3},\"setup_s\":{setup:.2},\"finite\":{}}}",
            out.dims(),
            out.flatten_all()?.to_vec1::<f32>()?.iter().all(|v| v.is_finite())
        );
        outs.push(out);
    }
    conv3d::set_tf32(true);
    if let [tf32, exact] = &outs[..] {
        println!(
            "{{\"latents\":{shape:?},\"max_abs_tf32_vs_exact\":{}}}",
            max_abs(tf32, exact)?
        );
    }
    Ok(())
}
