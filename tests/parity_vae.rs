//! Parity of the Wan2.1 VAE against diffusers' `AutoencoderKLWan` on the tiny fixture.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use vidgen::models::wan::vae::{AutoencoderKLWan, WanVaeConfig};

const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn config() -> WanVaeConfig {
    let path = common::fixture_dir().join("vae/config.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn weights_path() -> std::path::PathBuf {
    common::fixture_dir().join("vae/diffusion_pytorch_model.safetensors")
}

fn load() -> AutoencoderKLWan {
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[weights_path()], DType::F32, &Device::Cpu).unwrap()
    };
    AutoencoderKLWan::new(&config(), vb).unwrap()
}

#[test]
fn config_derived_sizes() {
    let cfg = config();
    assert_eq!(cfg.z_dim, 16);
    assert_eq!(cfg.scale_factor_spatial(), 8);
    assert_eq!(cfg.scale_factor_temporal(), 4);
}

#[test]
fn config_accepts_published_keys_and_checks_wan22_keys() {
    let mut json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixture_dir().join("vae/config.json")).unwrap(),
    )
    .unwrap();
    let obj = json.as_object_mut().unwrap();
    // The published 2025 configs lack the newer keys.
    for key in [
        "decoder_base_dim",
        "is_residual",
        "patch_size",
        "scale_factor_spatial",
        "scale_factor_temporal",
    ] {
        obj.remove(key);
    }
    let cfg: WanVaeConfig = serde_json::from_value(json.clone()).unwrap();
    cfg.validate().unwrap();
    // The Wan2.2 keys are supported (tests/parity_wan_family.rs); a zero patch is refused.
    let mut patch = json;
    patch["patch_size"] = serde_json::json!(2);
    let cfg: WanVaeConfig = serde_json::from_value(patch.clone()).unwrap();
    cfg.validate().unwrap();
    assert_eq!(cfg.scale_factor_spatial(), 16);
    patch["patch_size"] = serde_json::json!(0);
    let cfg: WanVaeConfig = serde_json::from_value(patch).unwrap();
    assert!(cfg
        .validate()
        .unwrap_err()
        .to_string()
        .contains("patch_size"));
}

#[test]
fn denormalize_matches() {
    let vae = load();
    let r = common::reference("vae");
    let out = vae.denormalize(&r["decode.latents_normalized"]).unwrap();
    common::assert_close(
        "denormalize",
        &out,
        &r["decode.latents_denormalized"],
        ATOL,
        RTOL,
    );
}

#[test]
fn decode_matches() {
    let vae = load();
    let r = common::reference("vae");
    let video = vae.decode(&r["decode.latents_denormalized"]).unwrap();
    common::assert_close("decode.video", &video, &r["decode.video"], ATOL, RTOL);
}

#[test]
fn batch_of_two_decodes_each() {
    let vae = load();
    let r = common::reference("vae");
    let z = &r["decode.latents_denormalized"];
    let video = vae.decode(&Tensor::cat(&[z, z], 0).unwrap()).unwrap();
    for b in 0..2 {
        let one = video.narrow(0, b, 1).unwrap();
        common::assert_close("batched decode.video", &one, &r["decode.video"], ATOL, RTOL);
    }
}

#[test]
fn decode_one_frame_matches() {
    let vae = load();
    let r = common::reference("vae");
    let z = r["decode.latents_denormalized"].narrow(2, 0, 1).unwrap();
    let video = vae.decode(&z).unwrap();
    common::assert_close("decode1.video", &video, &r["decode1.video"], ATOL, RTOL);
}

#[test]
fn encode_matches() {
    let vae = load();
    let r = common::reference("vae");
    let (mean, logvar) = vae.encode(&r["encode.video"]).unwrap();
    common::assert_close(
        "encode.mean",
        &mean,
        &r["encode.latent_dist.mean"],
        ATOL,
        RTOL,
    );
    common::assert_close(
        "encode.mode",
        &mean,
        &r["encode.latent_dist.mode"],
        ATOL,
        RTOL,
    );
    common::assert_close(
        "encode.logvar",
        &logvar,
        &r["encode.latent_dist.logvar"],
        ATOL,
        RTOL,
    );
}

fn fixture_tensors() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(weights_path(), &Device::Cpu).unwrap()
}

#[test]
fn missing_tensor_is_an_error_naming_it() {
    let mut ts = fixture_tensors();
    let name = "decoder.up_blocks.1.upsamplers.0.time_conv.weight";
    assert!(ts.remove(name).is_some());
    let vb = VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu);
    let err = AutoencoderKLWan::new(&config(), vb)
        .err()
        .expect("missing tensor must fail");
    assert!(err.to_string().contains(name), "{err}");
}

#[test]
fn wrong_shape_is_an_error_naming_it() {
    let mut ts = fixture_tensors();
    let name = "encoder.mid_block.attentions.0.norm.gamma";
    ts.insert(
        name.to_string(),
        Tensor::ones((3, 1, 1), DType::F32, &Device::Cpu).unwrap(),
    );
    let vb = VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu);
    let err = AutoencoderKLWan::new(&config(), vb)
        .err()
        .expect("wrong shape must fail");
    assert!(err.to_string().contains(name), "{err}");
}

#[test]
fn wrong_latent_channels_is_an_error() {
    let vae = load();
    let z = Tensor::zeros((1, 5, 2, 4, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(vae.decode(&z).is_err());
    let v = Tensor::zeros((1, 2, 5, 32, 32), DType::F32, &Device::Cpu).unwrap();
    assert!(vae.encode(&v).is_err());
}

/// The half-precision path (norms and SiLU in f32, the rest in the weights' dtype). candle's CPU
/// matmul has no bf16, so f16 stands in for the bf16 a CUDA run uses.
#[test]
fn decode_runs_in_half_precision() {
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[weights_path()], DType::F16, &Device::Cpu).unwrap()
    };
    let vae = AutoencoderKLWan::new(&config(), vb).unwrap();
    let r = common::reference("vae");
    let z = vae.denormalize(&r["decode.latents_normalized"]).unwrap();
    assert_eq!(z.dtype(), DType::F16);
    let video = vae.decode(&z).unwrap();
    assert_eq!(video.dtype(), DType::F16);
    let video = video.to_dtype(DType::F32).unwrap();
    let diff = (video - &r["decode.video"]).unwrap().abs().unwrap();
    let max = diff
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let mean = diff.mean_all().unwrap().to_scalar::<f32>().unwrap();
    eprintln!("f16 decode: max |d| {max}, mean |d| {mean}");
    assert!(
        max < 0.05 && mean < 0.005,
        "f16 decode: max {max}, mean {mean}"
    );
}

/// diffusers' tiled decode on 16-pixel tiles every 8 pixels (2x2 latents, stride 1): regions that
/// no blend touches equal the plain decode of their tile, and the horizontal overlaps of the first
/// row of tiles are the linear fade `a * (1 - x/8) + b * (x/8)` between neighbouring tiles.
#[test]
fn tiled_decode_places_and_blends_tiles() {
    use vidgen::models::wan::vae::WanVaeTiling;
    let vae = load();
    let r = common::reference("vae");
    let z = &r["decode.latents_denormalized"];
    // One tile covering everything is the plain decode.
    let whole = WanVaeTiling::default();
    let plain = vae.decode(z).unwrap();
    common::assert_close(
        "untiled",
        &vae.decode_tiled(z, &whole).unwrap(),
        &plain,
        0.0,
        0.0,
    );

    let tiling = WanVaeTiling {
        tile_min_height: 16,
        tile_min_width: 16,
        tile_stride_height: 8,
        tile_stride_width: 8,
    };
    let tiled = vae.decode_tiled(z, &tiling).unwrap();
    assert_eq!(tiled.dims(), plain.dims());
    let tile = |i: usize, j: usize| {
        vae.decode(&z.narrow(3, i, 2).unwrap().narrow(4, j, 2).unwrap())
            .unwrap()
    };
    let region = |t: &Tensor, h0: usize, h: usize, w0: usize, w: usize| {
        t.narrow(3, h0, h).unwrap().narrow(4, w0, w).unwrap()
    };
    let t00 = tile(0, 0);
    let t01 = tile(0, 1);
    common::assert_close(
        "tile 0,0",
        &region(&tiled, 0, 8, 0, 8),
        &region(&t00, 0, 8, 0, 8),
        1e-6,
        0.0,
    );
    // Tile (0, 1) lands at x = 8..16; its columns 0..8 are blended with tile (0, 0)'s 8..16.
    let a = flat(&region(&t00, 0, 8, 8, 8));
    let b = flat(&region(&t01, 0, 8, 0, 8));
    let got = flat(&region(&tiled, 0, 8, 8, 8));
    let mut checked = 0;
    for (idx, ((a, b), g)) in a.iter().zip(&b).zip(&got).enumerate() {
        let x = (idx % 8) as f32;
        // Where a tile hit the clamp, the un-clamped value it blended is unknown here.
        if a.abs() < 1.0 && b.abs() < 1.0 {
            let want = a * (1.0 - x / 8.0) + b * (x / 8.0);
            assert!((g - want).abs() <= 1e-6, "blend at {idx}: {g} vs {want}");
            checked += 1;
        }
    }
    assert!(checked > 1000);
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// On CUDA (cuDNN where found, else the own convolution): exact f32 within the CPU tolerances,
/// TF32 within TF32's rounding. Skipped without a CUDA device.
#[cfg(feature = "cuda")]
#[test]
fn cuda_decode_matches_exact_and_tf32() {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: CUDA VAE decode test skipped");
        return;
    };
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[weights_path()], DType::F32, &dev).unwrap()
    };
    let vae = AutoencoderKLWan::new(&config(), vb).unwrap();
    let r = common::reference("vae");
    let z = r["decode.latents_denormalized"].to_device(&dev).unwrap();
    let want = &r["decode.video"];
    let exact = {
        let _exact = vidgen::models::conv3d::tf32_here(false);
        vae.decode(&z).unwrap().to_device(&Device::Cpu).unwrap()
    };
    common::assert_close("cuda decode (exact f32)", &exact, want, ATOL, RTOL);
    let tf32 = vae.decode(&z).unwrap().to_device(&Device::Cpu).unwrap();
    let err = (&tf32 - want)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    eprintln!("cuda decode: max |TF32 - diffusers| {err:.3e}");
    assert!(err < 2e-2, "TF32 decode off by {err}");
}
