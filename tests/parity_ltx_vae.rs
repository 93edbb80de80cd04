//! Parity of the `AutoencoderKLLTXVideo` decoder (0.9.1 layout: timestep conditioning, injected
//! noise replayed from the reference draws) with `ltx-video-tiny-a/reference/vae.safetensors`.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::{assert_close, named_fixture_dir, reference_in};
use std::collections::HashMap;
use std::path::PathBuf;
use vidgen::models::ltx::vae::{
    latent_dist, AutoencoderKLLTXVideo, GivenNoise, LtxVaeConfig, LtxVideoEncoder,
};
use vidgen::rng::TorchGenerator;

const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn dir() -> PathBuf {
    named_fixture_dir("ltx-video-tiny-a")
}

fn config() -> LtxVaeConfig {
    serde_json::from_str(&std::fs::read_to_string(dir().join("vae/config.json")).unwrap()).unwrap()
}

fn vae() -> AutoencoderKLLTXVideo {
    let path = dir().join("vae/diffusion_pytorch_model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu) }.unwrap();
    AutoencoderKLLTXVideo::new(&config(), vb).unwrap()
}

fn draws(r: &HashMap<String, Tensor>, prefix: &str) -> Vec<Tensor> {
    (0..)
        .map_while(|k| r.get(&format!("{prefix}injected_noise.{k}")).cloned())
        .collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn compression_ratios_from_the_config() {
    let cfg = config();
    assert_eq!(cfg.spatial_compression_ratio(), 32);
    assert_eq!(cfg.temporal_compression_ratio(), 8);
}

#[test]
fn denormalizes_latents() {
    let r = reference_in(&dir(), "vae");
    let got = vae().denormalize(&r["decode.latents_normalized"]).unwrap();
    assert_close(
        "latents_denormalized",
        &got,
        &r["decode.latents_denormalized"],
        1e-6,
        1e-6,
    );
}

#[test]
fn decode_matches_with_replayed_noise() {
    let r = reference_in(&dir(), "vae");
    let vae = vae();
    let mut noise = GivenNoise::new(draws(&r, "decode_t0_05."));
    assert_eq!(noise.clone().used(), 0);
    let video = vae
        .decode(
            &r["decode.latents_denormalized"],
            Some(&r["decode_t0_05.timestep"]),
            &mut noise,
        )
        .unwrap();
    assert_eq!(noise.used(), 6, "every draw used, in order");
    noise.check_all_used().unwrap();
    println!(
        "decode max |diff| {}",
        max_diff(&video, &r["decode_t0_05.video"])
    );
    assert_close(
        "decode_t0_05.video",
        &video,
        &r["decode_t0_05.video"],
        ATOL,
        RTOL,
    );
}

#[test]
fn missing_or_misshapen_noise_is_an_error() {
    let r = reference_in(&dir(), "vae");
    let vae = vae();
    let z = &r["decode.latents_denormalized"];
    let t = &r["decode_t0_05.timestep"];
    let mut short = GivenNoise::new(draws(&r, "decode_t0_05.")[..3].to_vec());
    let err = vae.decode(z, Some(t), &mut short).unwrap_err().to_string();
    assert!(err.contains("draw 3"), "{err}");
    let mut wrong = GivenNoise::new(vec![
        Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap()
    ]);
    assert!(vae.decode(z, Some(t), &mut wrong).is_err());
    let mut extra = draws(&r, "decode_t0_05.");
    extra.push(extra[0].clone());
    let mut extra = GivenNoise::new(extra);
    vae.decode(z, Some(t), &mut extra).unwrap();
    assert!(extra.check_all_used().is_err(), "an unused draw");
    let mut seeded = TorchGenerator::new(7);
    let a = vae.decode(z, Some(t), &mut seeded).unwrap();
    let b = vae.decode(z, Some(t), &mut TorchGenerator::new(7)).unwrap();
    assert_eq!(max_diff(&a, &b), 0.0, "seeded noise is reproducible");
    let mut none = GivenNoise::new(Vec::new());
    assert!(vae.decode(z, None, &mut none).is_err(), "timestep required");
}

#[test]
fn hostile_configs_are_errors_naming_the_key() {
    for (json, key) in [
        (
            r#"{"decoder_block_out_channels": []}"#,
            "decoder_block_out_channels",
        ),
        (
            r#"{"decoder_layers_per_block": [1]}"#,
            "decoder_layers_per_block",
        ),
        (r#"{"upsample_factor": [3, 3, 3, 3]}"#, "upsample_factor"),
        (r#"{"patch_size": 0}"#, "patch_size"),
        (r#"{"scaling_factor": 0.0}"#, "scaling_factor"),
        (r#"{"patch_size": 4611686018427387904}"#, "patch_size"),
        (
            r#"{"decoder_block_out_channels": [18446744073709551615]}"#,
            "decoder_block_out_channels",
        ),
    ] {
        let cfg: LtxVaeConfig = serde_json::from_str(json).unwrap();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(key), "{json}: {err}");
    }
}

#[test]
fn encode_matches() {
    let r = reference_in(&dir(), "vae");
    let path = dir().join("vae/diffusion_pytorch_model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu) }.unwrap();
    let encoder = LtxVideoEncoder::new(&config(), vb).unwrap();
    let moments = encoder.encode(&r["encode.video"]).unwrap();
    println!(
        "moments max |diff| {}",
        max_diff(&moments, &r["encode.moments"])
    );
    assert_close("encode.moments", &moments, &r["encode.moments"], ATOL, RTOL);
    let (mean, logvar) = latent_dist(&moments).unwrap();
    assert_close(
        "latent_dist.mean",
        &mean,
        &r["encode.latent_dist.mean"],
        ATOL,
        RTOL,
    );
    assert_close(
        "latent_dist.logvar",
        &logvar,
        &r["encode.latent_dist.logvar"],
        ATOL,
        RTOL,
    );
}
