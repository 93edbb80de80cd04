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
fn config_rejects_wan22_and_accepts_published_keys() {
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
    let mut residual = json.clone();
    residual["is_residual"] = serde_json::Value::Bool(true);
    let cfg: WanVaeConfig = serde_json::from_value(residual).unwrap();
    assert!(cfg
        .validate()
        .unwrap_err()
        .to_string()
        .contains("is_residual"));
    let mut patch = json;
    patch["patch_size"] = serde_json::json!(2);
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
