//! Times the Wan2.1 VAE decode on a CUDA GPU, f32, and measures TF32's error against exact f32:
//! synthetic Wan2.1 1.3B VAE weights (seeded), seeded latents (default `[1, 16, 21, 60, 104]`:
//! 480x832, 81 frames). Every decode is preceded by a warm-up decode of the first two latent
//! frames, which meets every convolution shape of the full decode (cuDNN's algorithms are chosen
//! there, by timing), so the timed decode is the steady state, as in
//! `bench/peer_wan_vae_decode.py`. With `--fixture DIR` it also decodes the fixture's reference
//! latents (`reference/vae.safetensors`) and reports the error against diffusers' frames.
//!
//! `cargo build --release --no-default-features --features cuda --example vae_decode`;
//! `vae_decode [B,C,F,h,w] [--exact] [--bf16] [--fixture DIR]`: `--exact` also decodes with exact f32
//! (`--no-tf32`) and reports max |TF32 - exact|; `--bf16` also decodes with the weights and
//! latents in bf16 and reports max |bf16 - TF32|. One JSON line per measurement on stdout.
//!
//! `vae_decode --family NAME [B,C,F,h,w] [--tiled] [--save FILE]` times another family's VAE instead, bf16, at
//! its pipeline's default size unless a shape is given (`ltx-video`, `cogvideox-5b`,
//! `hunyuanvideo`, `mochi-1`, `latte-1`, `allegro` (always in tiles), `flux.1-dev` (one image:
//! latents `1,16,1,h,w`), `wan2.1-t2v-1.3b` and `wan2.2-ti2v-5b` (the Wan VAEs, f32 as the pipelines load them;
//! `--tiled`: diffusers' default tiles), `minimax-h3` (the video VAE, in clips and 256 px tiles as diffusers
//! decodes by default; `TILES_PER_CALL=N` decodes N tiles of a clip per decoder call), `minimax-h3-audio` (the audio VAE, f32 whatever the flags say, on the 5 s
//! request's stereo latents `2,32,207`): their `synthetic:` configs), as its pipeline calls it (`--tiled`:
//! the tiles of the pipeline's `--vae-tiling`), with the memory pool's peaks above what it
//! held before (weights and latents): `used_peak_gib`, what tensors used (as torch's allocated,
//! which `bench/peer_vae_decode.py` reports for diffusers), and `reserved_peak_gib`; `--save`
//! writes the decoded video (f32 safetensors `video`) to compare two builds or settings. `--f32` decodes
//! in f32 and `--cpu` on the host (no timing of memory there): a GPU decode saved beside the host's at a small
//! shape checks the device kernels at the published widths.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::memory::accounting::MemoryMeter;
use vidgen::models::conv3d;
use vidgen::models::source::{component_weights, ModelSource};
use vidgen::models::wan::vae::{AutoencoderKLWan, WanVaeConfig, WanVaeTiling};
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
    if let Some(family) = args
        .iter()
        .position(|a| a == "--family")
        .and_then(|i| args.get(i + 1))
    {
        let given = args.iter().any(|a| a.contains(',')).then_some(&shape[..]);
        let save = args
            .iter()
            .position(|a| a == "--save")
            .and_then(|i| args.get(i + 1));
        let dtype = match args.iter().any(|a| a == "--f32") {
            true => DType::F32,
            false => DType::BF16,
        };
        let on = match args.iter().any(|a| a == "--cpu") {
            true => Device::Cpu,
            false => dev,
        };
        return family_decode(
            family,
            given,
            args.iter().any(|a| a == "--tiled"),
            save,
            dtype,
            &on,
        );
    }

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
    if args.iter().any(|a| a == "--bf16") {
        // The same weights in bf16: the decoder then runs channels first (its fused kernels are
        // f32), the convolutions in bf16.
        let vae = AutoencoderKLWan::new(&cfg, weights.var_builder(DType::BF16, &dev))?;
        let (out, warm, secs) = timed_decode(&vae, &z.to_dtype(DType::BF16)?, &dev)?;
        let out = out.to_dtype(DType::F32)?;
        println!(
            "{{\"latents\":{shape:?},\"dtype\":\"bf16\",\"decode_s\":{secs:.3},\"warm_up_s\":{warm:.3},\"max_abs_vs_tf32\":{}}}",
            max_abs(&out, &outs[0])?
        );
    }
    Ok(())
}

/// A family's VAE decode as its pipeline calls it, on latents of `shape`.
type Decode = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor>>;

/// Times `family`'s decode (synthetic weights in `dtype`) after a warm-up on two latent frames.
fn family_decode(
    family: &str,
    shape: Option<&[usize]>,
    tiled: bool,
    save: Option<&String>,
    dtype: DType,
    dev: &Device,
) -> Result<()> {
    use vidgen::models::{allegro, cogvideox, hunyuan_video, ltx, minimax_h3, mochi};
    // MiniMax H3's audio VAE is a component of the minimax-h3 checkpoint; it decodes in f32, as
    // diffusers keeps it (`_keep_in_fp32_modules`) and the pipeline runs it.
    let (model, component, dtype) = match family {
        "minimax-h3-audio" => ("minimax-h3", "audio_vae", DType::F32),
        // The Wan pipelines load their VAE in f32.
        wan if wan.starts_with("wan") => (wan, "vae", DType::F32),
        _ => (family, "vae", dtype),
    };
    let source = ModelSource::parse(&format!("synthetic:{model}"))?;
    let weights = WeightSet::open(&component_weights(&source, component)?)?;
    let vb = weights.var_builder(dtype, dev);
    let used_before = used_bytes(dev)?;
    // The warm-up decodes the first two latent frames, or (`Some`) at most this many frames,
    // rows and columns: one tile of a VAE that decodes whole tiles only, one clip of one that
    // decodes whole clips only.
    let mut warm_up: Option<[usize; 3]> = None;
    let (decode, default): (Decode, Vec<usize>) = match family {
        "ltx-video" => {
            let vae = ltx::vae::AutoencoderKLLTXVideo::new(&source.json("vae/config.json")?, vb)?
                .with_tiling(tiled.then(ltx::vae::LtxVaeTiling::default))?;
            // 704x512x161; the pipeline's decode timestep 0.05 where the VAE is conditioned.
            let t = Tensor::new(&[0.05f32], dev)?;
            let decode = move |z: &Tensor| {
                let t = vae.timestep_conditioning().then_some(&t);
                vae.decode(z, t, &mut TorchGenerator::new(0))
            };
            (Box::new(decode), vec![1, 128, 21, 16, 22])
        }
        "cogvideox-5b" => {
            let cfg = source.json("vae/config.json")?;
            let vae = cogvideox::vae::AutoencoderKLCogVideoX::new_decoder_only(&cfg, vb)?;
            let decode = move |z: &Tensor| match tiled {
                true => vae.decode_tiled(z, &vae.config().tiling()),
                false => vae.decode(z),
            };
            (Box::new(decode), vec![1, 16, 13, 60, 90])
        }
        "hunyuanvideo" => {
            let cfg = source.json("vae/config.json")?;
            let mut vae = hunyuan_video::vae::AutoencoderKLHunyuanVideo::new(&cfg, vb)?;
            if tiled {
                let mut t = vae.tiling();
                t.spatial = true;
                vae.set_tiling(t)?;
            }
            (Box::new(move |z| vae.decode(z)), vec![1, 16, 33, 90, 160])
        }
        "latte-1" => {
            let cfg = source.json("vae/config.json")?;
            let vae = vidgen::models::autoencoder_kl::AutoencoderKL::new_decoder_only(&cfg, vb)?;
            let vae = vae.with_tiling(tiled.then(|| vae.config().tiling()))?;
            // 16x512x512, decoded as the pipeline does: frames in chunks of 14.
            let decode = move |z: &Tensor| vidgen::models::latte::decode_latents(&vae, z);
            (Box::new(decode), vec![1, 4, 16, 64, 64])
        }
        "flux.1-dev" => {
            let cfg = source.json("vae/config.json")?;
            let vae = vidgen::models::autoencoder_kl::AutoencoderKL::new_decoder_only(&cfg, vb)?;
            let vae = vae.with_tiling(tiled.then(|| vae.config().tiling()))?;
            // One 1024x1024 image (its frame axis of one dropped), as FluxPipeline decodes it.
            let decode = move |z: &Tensor| vae.decode(&vae.unscale(&z.squeeze(2)?)?);
            (Box::new(decode), vec![1, 16, 1, 128, 128])
        }
        "allegro" => {
            let cfg: allegro::vae::AllegroVaeConfig = source.json("vae/config.json")?;
            warm_up = Some(cfg.latent_tile());
            let vae = allegro::vae::AutoencoderKLAllegro::new(&cfg, vb)?;
            // 88x720x1280, in tiles whatever `--tiled` says (the VAE has no other decode).
            (
                Box::new(move |z| vae.decode(&vae.unscale(z)?)),
                vec![1, 4, 22, 90, 160],
            )
        }
        "mochi-1" => {
            let vae = mochi::vae::AutoencoderKLMochi::new(&source.json("vae/config.json")?, vb)?
                .with_tiling(tiled.then_some(mochi::vae::DEFAULT_TILING))?;
            (Box::new(move |z| vae.decode(z)), vec![1, 12, 15, 60, 106])
        }
        "minimax-h3" => {
            let cfg: minimax_h3::vae::MiniMaxH3VaeConfig = source.json("vae/config.json")?;
            // One clip: the decoder takes no fewer latent frames.
            warm_up = Some([
                cfg.tokens_chunk_size() + cfg.token_overlap(),
                usize::MAX,
                usize::MAX,
            ]);
            let mut vae = minimax_h3::vae::MiniMaxH3VaeDecoder::new(&cfg, vb)?;
            if let Ok(n) = std::env::var("TILES_PER_CALL") {
                vae.tiles_per_call = n.parse().context("TILES_PER_CALL is a count")?;
            }
            // 124x768x1344 (5 s): 37 latent frames of 48x84.
            (Box::new(move |z| vae.decode(z)), vec![1, 24, 37, 48, 84])
        }
        "minimax-h3-audio" => {
            let cfg = source.json("audio_vae/config.json")?;
            let vae = minimax_h3::audio_vae::MiniMaxH3AudioVaeDecoder::new(&cfg, vb)?;
            // The 5 s request's stereo latents (a batch of two, 207 latents: 165,600 samples),
            // denormalized and decoded as the pipeline does.
            let decode = move |z: &Tensor| vae.decode(&vae.denormalize(z)?);
            (Box::new(decode), vec![2, 32, 207])
        }
        "wan2.1-t2v-1.3b" | "wan2.2-ti2v-5b" => {
            let vae = AutoencoderKLWan::new(&WanConfigs::read(&source)?.vae, vb)?;
            let decode = move |z: &Tensor| match tiled {
                true => vae.decode_tiled(z, &WanVaeTiling::default()),
                false => vae.decode(z),
            };
            // 81x480x832 and TI2V-5B's 121x704x1280 (16x in space into 48 channels).
            let shape = match family {
                "wan2.1-t2v-1.3b" => vec![1, 16, 21, 60, 104],
                _ => vec![1, 48, 31, 44, 80],
            };
            (Box::new(decode), shape)
        }
        other => anyhow::bail!("no decode for family {other:?}"),
    };
    dev.synchronize()?;
    let weights_bytes = used_bytes(dev)? - used_before;
    let shape = shape.unwrap_or(&default);
    let z = TorchGenerator::new(1)
        .randn(shape)?
        .to_dtype(dtype)?
        .to_device(dev)?;
    let first = match warm_up {
        Some([f, h, w]) => z
            .narrow(2, 0, f.min(shape[2]))?
            .narrow(3, 0, h.min(shape[3]))?
            .narrow(4, 0, w.min(shape[4]))?,
        None => z.narrow(2, 0, shape[2].min(2))?,
    };
    let start = Instant::now();
    drop(decode(&first)?);
    dev.synchronize()?;
    let warm = start.elapsed().as_secs_f64();
    // The memory pool's high-water marks over the decode, above what it held before (weights
    // and latents): what tensors used (as torch's allocated) and what the pool held (reserved).
    let meter = MemoryMeter::new(dev);
    meter.reset();
    let before = meter.peaks().device_used_peak;
    let start = Instant::now();
    let out = decode(&z)?;
    dev.synchronize()?;
    let secs = start.elapsed().as_secs_f64();
    let peaks = meter.peaks();
    let (used, reserved) = (
        peaks.device_used_peak.saturating_sub(before),
        peaks.device_reserved_peak.saturating_sub(before),
    );
    let out = out.to_dtype(DType::F32)?;
    if let Some(path) = save {
        let video = out.to_device(&Device::Cpu)?;
        let tensors: std::collections::HashMap<&str, Tensor> = [("video", video)].into();
        candle_core::safetensors::save(&tensors, path)?;
    }
    let finite = out
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .all(|v| v.is_finite());
    println!(
        "{{\"family\":\"{family}\",\"tiled\":{tiled},\"latents\":{shape:?},\"frames\":{:?},\"cudnn\":{cudnn:?},\"decode_s\":{secs:.3},\"warm_up_s\":{warm:.3},\"weights_gib\":{:.2},\"used_peak_gib\":{:.2},\"reserved_peak_gib\":{:.2},\"finite\":{finite}}}",
        out.dims(),
        weights_bytes as f64 / GIB,
        used as f64 / GIB,
        reserved as f64 / GIB,
        cudnn = vidgen::models::cudnn::api().map(|api| api.version_string()),
    );
    Ok(())
}

const GIB: f64 = (1u64 << 30) as f64;

/// Device memory in use (the driver's count: every process's allocations, candle's included); 0 on the host.
fn used_bytes(dev: &Device) -> Result<u64> {
    let Device::Cuda(cuda) = dev else {
        return Ok(0);
    };
    let (free, total) = cuda.cuda_stream().context().mem_get_info()?;
    Ok((total - free) as u64)
}
