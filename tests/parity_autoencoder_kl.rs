//! Parity of the 2-D `AutoencoderKL` with diffusers on two tiny fixtures: Latte's (SD layout,
//! quant convs, scaling 0.18215, five frames decoded as a batch) and FLUX.1-dev's (no quant
//! convs, latent 16, scaling 0.3611 and shift 0.1159).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::autoencoder_kl::{AutoencoderKL, AutoencoderKLConfig};

const LATTE: &str = "latte-tiny-a";
const FLUX: &str = "flux-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn config(fixture: &str) -> AutoencoderKLConfig {
    common::config_in(fixture, "vae/config.json")
}

fn vae(fixture: &str) -> AutoencoderKL {
    let vb = common::var_builder_in(fixture, "vae/diffusion_pytorch_model.safetensors");
    AutoencoderKL::new(&config(fixture), vb).unwrap()
}

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, ATOL, RTOL);
}

#[test]
fn latte_decode_matches_diffusers() {
    let vae = vae(LATTE);
    assert!(vae.config().use_post_quant_conv && vae.config().shift_factor.is_none());
    let r = common::named_reference(LATTE, "vae");
    // LattePipeline.decode_latents: [1, C, F, h, w] -> [F, C, h, w], then 1 / scaling_factor * z.
    let frames = r["decode.latents"]
        .permute((0, 2, 1, 3, 4))
        .unwrap()
        .squeeze(0)
        .unwrap();
    let scaled = vae.unscale_by_reciprocal(&frames).unwrap();
    check(
        "latte decode.latents_scaled",
        &scaled,
        &r["decode.latents_scaled"],
    );
    let images = vae.decode(&r["decode.latents_scaled"]).unwrap();
    check("latte decode.images", &images, &r["decode.images"]);
}

#[test]
fn flux_decode_matches_diffusers() {
    let vae = vae(FLUX);
    assert!(!vae.config().use_post_quant_conv && vae.config().shift_factor.is_some());
    let r = common::named_reference(FLUX, "vae");
    let denormalized = vae.unscale(&r["decode.latents"]).unwrap();
    check(
        "flux decode.latents_denormalized",
        &denormalized,
        &r["decode.latents_denormalized"],
    );
    let image = vae.decode(&r["decode.latents_denormalized"]).unwrap();
    check("flux decode.image", &image, &r["decode.image"]);
}

#[test]
fn encode_matches_diffusers() {
    for (fixture, input) in [(LATTE, "encode.images"), (FLUX, "encode.image")] {
        let vae = vae(fixture);
        let r = common::named_reference(fixture, "vae");
        let (mean, logvar) = vae.encode(&r[input]).unwrap();
        check(
            &format!("{fixture} encode.latent_dist.mean"),
            &mean,
            &r["encode.latent_dist.mean"],
        );
        check(
            &format!("{fixture} encode.latent_dist.logvar"),
            &logvar,
            &r["encode.latent_dist.logvar"],
        );
    }
}

#[test]
fn decoder_only_vae_decodes_and_refuses_to_encode() {
    for (fixture, input, output) in [
        (LATTE, "decode.latents_scaled", "decode.images"),
        (FLUX, "decode.latents_denormalized", "decode.image"),
    ] {
        let path =
            common::named_fixture_dir(fixture).join("vae/diffusion_pytorch_model.safetensors");
        let weights = candle_core::safetensors::load(path, &Device::Cpu)
            .unwrap()
            .into_iter()
            .filter(|(name, _)| !name.starts_with("encoder.") && name != "quant_conv.weight")
            .collect();
        let vae = AutoencoderKL::new_decoder_only(
            &config(fixture),
            VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu),
        )
        .unwrap();
        let r = common::named_reference(fixture, "vae");
        check(
            &format!("{fixture} {output} (decoder only)"),
            &vae.decode(&r[input]).unwrap(),
            &r[output],
        );
        let images = Tensor::zeros((1, 3, 16, 16), DType::F32, &Device::Cpu).unwrap();
        assert!(vae.encode(&images).is_err());
    }
}

#[test]
fn deprecated_attention_names_load() {
    // Older SD-layout checkpoints name the mid-block attention query/key/value/proj_attn.
    let path = common::named_fixture_dir(LATTE).join("vae/diffusion_pytorch_model.safetensors");
    let weights = candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(name, t)| {
            let name = name
                .replace("attentions.0.to_q", "attentions.0.query")
                .replace("attentions.0.to_k", "attentions.0.key")
                .replace("attentions.0.to_v", "attentions.0.value")
                .replace("attentions.0.to_out.0", "attentions.0.proj_attn");
            (name, t)
        })
        .collect();
    let vae = AutoencoderKL::new(
        &config(LATTE),
        VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let r = common::named_reference(LATTE, "vae");
    check(
        "latte decode.images (deprecated names)",
        &vae.decode(&r["decode.latents_scaled"]).unwrap(),
        &r["decode.images"],
    );
}

#[test]
fn wrong_latent_channels_are_refused() {
    let vae = vae(FLUX);
    let z = Tensor::zeros((1, 4, 6, 8), DType::F32, &Device::Cpu).unwrap();
    let err = vae.decode(&z).unwrap_err().to_string();
    assert!(err.contains("channels"), "{err}");
}

#[test]
fn hostile_configs_are_refused_with_the_key() {
    let cfg = config(LATTE);
    let cases = vec![
        (
            AutoencoderKLConfig {
                block_out_channels: vec![],
                ..cfg.clone()
            },
            "block_out_channels",
        ),
        (
            AutoencoderKLConfig {
                norm_num_groups: 3,
                ..cfg.clone()
            },
            "norm_num_groups",
        ),
        (
            AutoencoderKLConfig {
                scaling_factor: 0.0,
                ..cfg.clone()
            },
            "scaling_factor",
        ),
        (
            AutoencoderKLConfig {
                up_block_types: vec!["AttnUpDecoderBlock2D".into(); 4],
                ..cfg.clone()
            },
            "up_block_types",
        ),
        (
            AutoencoderKLConfig {
                act_fn: "gelu".into(),
                ..cfg.clone()
            },
            "act_fn",
        ),
        (
            AutoencoderKLConfig {
                sample_size: serde_json::json!("256"),
                ..cfg.clone()
            },
            "sample_size",
        ),
        (
            AutoencoderKLConfig {
                sample_size: serde_json::json!([]),
                ..cfg.clone()
            },
            "sample_size",
        ),
    ];
    for (bad, key) in cases {
        let err = bad.validate().unwrap_err().to_string();
        assert!(
            err.lines().next().unwrap_or_default().contains(key),
            "{key}: {err}"
        );
    }
    let encoder_cases = vec![
        (
            AutoencoderKLConfig {
                down_block_types: vec!["DownEncoderBlock2D".into(); 3],
                ..cfg.clone()
            },
            "down_block_types",
        ),
        (
            AutoencoderKLConfig {
                layers_per_block: 0,
                ..cfg.clone()
            },
            "layers_per_block",
        ),
    ];
    for (bad, key) in encoder_cases {
        assert!(bad.validate().is_ok(), "{key}: the decoder alone is fine");
        let err = bad.validate_encoder().unwrap_err().to_string();
        assert!(
            err.lines().next().unwrap_or_default().contains(key),
            "{key}: {err}"
        );
    }
}
