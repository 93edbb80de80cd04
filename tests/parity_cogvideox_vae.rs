//! Parity of the CogVideoX VAE decoder with diffusers' `AutoencoderKLCogVideoX.decode` on the
//! tiny `cogvideox-tiny-a` fixture (frame-batched decode: 5 latent frames as [0:3], [3:5]).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::cogvideox::vae::{AutoencoderKLCogVideoX, CogVideoXVaeConfig};

const FIXTURE: &str = "cogvideox-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn vae() -> AutoencoderKLCogVideoX {
    let dir = common::named_fixture_dir(FIXTURE).join("vae");
    let cfg: CogVideoXVaeConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let weights = dir.join("diffusion_pytorch_model.safetensors");
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[weights], DType::F32, &Device::Cpu) }
        .unwrap();
    AutoencoderKLCogVideoX::new(&cfg, vb).unwrap()
}

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, ATOL, RTOL);
}

#[test]
fn decode_matches_diffusers() {
    let vae = vae();
    let r = common::named_reference(FIXTURE, "vae");
    let scaled = vae.scale_latents(&r["decode.latents"]).unwrap();
    check(
        "decode.latents_scaled",
        &scaled,
        &r["decode.latents_scaled"],
    );
    let video = vae.decode(&r["decode.latents_scaled"]).unwrap();
    check("decode.video", &video, &r["decode.video"]);
}

#[test]
fn single_latent_frame_decodes_to_one_frame() {
    let vae = vae();
    let r = common::named_reference(FIXTURE, "vae");
    let one = r["decode.latents_scaled"].narrow(2, 0, 1).unwrap();
    let video = vae.decode(&one).unwrap();
    check("decode1.video", &video, &r["decode1.video"]);
}

#[test]
fn encode_matches_diffusers() {
    let vae = vae();
    let r = common::named_reference(FIXTURE, "vae");
    let (mean, logvar) = vae.encode(&r["encode.video"]).unwrap();
    check(
        "encode.latent_dist.mean",
        &mean,
        &r["encode.latent_dist.mean"],
    );
    check(
        "encode.latent_dist.logvar",
        &logvar,
        &r["encode.latent_dist.logvar"],
    );
}

#[test]
fn decoder_only_vae_decodes_and_refuses_to_encode() {
    let dir = common::named_fixture_dir(FIXTURE).join("vae");
    let cfg: CogVideoXVaeConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let weights = candle_core::safetensors::load(
        dir.join("diffusion_pytorch_model.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
    .into_iter()
    .filter(|(name, _)| name.starts_with("decoder."))
    .collect();
    let vae = AutoencoderKLCogVideoX::new_decoder_only(
        &cfg,
        VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let r = common::named_reference(FIXTURE, "vae");
    let one = r["decode.latents_scaled"].narrow(2, 0, 1).unwrap();
    check(
        "decode1.video (decoder only)",
        &vae.decode(&one).unwrap(),
        &r["decode1.video"],
    );
    assert!(vae.encode(&r["encode.video"]).is_err());
}

#[test]
fn hostile_configs_are_refused_with_the_key() {
    let dir = common::named_fixture_dir(FIXTURE).join("vae");
    let cfg: CogVideoXVaeConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cases = vec![
        (
            CogVideoXVaeConfig {
                block_out_channels: vec![],
                ..cfg.clone()
            },
            "block_out_channels",
        ),
        (
            CogVideoXVaeConfig {
                norm_num_groups: 0,
                ..cfg.clone()
            },
            "norm_num_groups",
        ),
        (
            CogVideoXVaeConfig {
                scaling_factor: 0.0,
                ..cfg.clone()
            },
            "scaling_factor",
        ),
        (
            CogVideoXVaeConfig {
                up_block_types: vec!["UpDecoderBlock2D".into(); 4],
                ..cfg.clone()
            },
            "up_block_types",
        ),
    ];
    let encoder_cases = vec![
        (
            CogVideoXVaeConfig {
                down_block_types: vec!["DownEncoderBlock2D".into(); 4],
                ..cfg.clone()
            },
            "down_block_types",
        ),
        (
            CogVideoXVaeConfig {
                use_quant_conv: true,
                ..cfg.clone()
            },
            "use_quant_conv",
        ),
    ];
    for (bad, key) in &encoder_cases {
        assert!(bad.validate().is_ok(), "{key}: the decoder alone is fine");
        let err = bad.validate_encoder().unwrap_err().to_string();
        assert!(
            err.lines().next().unwrap_or_default().contains(key),
            "{key}: {err}"
        );
    }
    for (bad, key) in cases {
        let err = bad.validate().unwrap_err().to_string();
        let first = err.lines().next().unwrap_or_default();
        assert!(first.contains(key), "{key}: {err}");
    }
}
