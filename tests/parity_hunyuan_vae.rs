//! Parity of the HunyuanVideo VAE decoder (`AutoencoderKLHunyuanVideo.decode`) with diffusers on
//! `hunyuanvideo-tiny-a`.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::hunyuan_video::vae::{
    AutoencoderKLHunyuanVideo, HunyuanVideoVaeConfig, HunyuanVideoVaeTiling,
};

const FIXTURE: &str = "hunyuanvideo-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn config() -> HunyuanVideoVaeConfig {
    common::config_in(FIXTURE, "vae/config.json")
}

fn vae() -> AutoencoderKLHunyuanVideo {
    let path = common::named_fixture_dir(FIXTURE).join("vae/diffusion_pytorch_model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu).unwrap() };
    AutoencoderKLHunyuanVideo::new(&config(), vb).unwrap()
}

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, ATOL, RTOL);
}

#[test]
fn temporally_tiled_decode_matches_diffusers() {
    let vae = vae();
    assert!(
        vae.tiling().framewise,
        "diffusers decodes frame-wise by default"
    );
    let r = common::named_reference(FIXTURE, "vae");
    let scaled = vae.scale_latents(&r["decode.latents"]).unwrap();
    check("latents_scaled", &scaled, &r["decode.latents_scaled"]);
    // 5 latent frames: tiles 0:5 and 3:5, blended over 4 frames.
    check(
        "decode.video",
        &vae.decode(&r["decode.latents_scaled"]).unwrap(),
        &r["decode.video"],
    );
}

#[test]
fn single_frame_decode_matches_diffusers() {
    let vae = vae();
    let r = common::named_reference(FIXTURE, "vae");
    let one = r["decode.latents_scaled"].narrow(2, 0, 1).unwrap();
    check(
        "decode1.video",
        &vae.decode(&one).unwrap(),
        &r["decode1.video"],
    );
}

#[test]
fn spatial_tiling_covers_the_whole_video() {
    // Tiles smaller than the latent (3x3 latent pixels every 2) exercise the blending paths;
    // with tiles as large as the video the result equals the untiled decode.
    let mut vae = vae();
    let r = common::named_reference(FIXTURE, "vae");
    let z = r["decode.latents_scaled"].narrow(2, 0, 1).unwrap();
    let whole = vae.decode(&z).unwrap();
    vae.set_tiling(HunyuanVideoVaeTiling {
        spatial: true,
        tile_sample_min_height: 24,
        tile_sample_min_width: 24,
        tile_sample_stride_height: 16,
        tile_sample_stride_width: 16,
        ..Default::default()
    })
    .unwrap();
    let tiled = vae.decode(&z).unwrap();
    assert_eq!(tiled.dims(), whole.dims());
    vae.set_tiling(HunyuanVideoVaeTiling {
        spatial: true,
        tile_sample_min_height: 256,
        tile_sample_min_width: 256,
        ..Default::default()
    })
    .unwrap();
    check("one-tile decode", &vae.decode(&z).unwrap(), &whole);
}

#[test]
fn hostile_configs_are_refused_with_the_key() {
    let base = config();
    for (key, cfg) in [
        (
            "norm_num_groups",
            HunyuanVideoVaeConfig {
                norm_num_groups: 3,
                ..base.clone()
            },
        ),
        (
            "temporal_compression_ratio",
            HunyuanVideoVaeConfig {
                temporal_compression_ratio: 8,
                ..base.clone()
            },
        ),
        (
            "block_out_channels",
            HunyuanVideoVaeConfig {
                block_out_channels: vec![],
                ..base.clone()
            },
        ),
        (
            "up_block_types",
            HunyuanVideoVaeConfig {
                up_block_types: vec!["HunyuanVideoUpBlock3D".into()],
                ..base.clone()
            },
        ),
        (
            "scaling_factor",
            HunyuanVideoVaeConfig {
                scaling_factor: 0.0,
                ..base.clone()
            },
        ),
    ] {
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(key), "{key}: {err}");
    }
    HunyuanVideoVaeConfig::default().validate().unwrap();
}

#[test]
fn temporally_tiled_encode_matches_diffusers() {
    let path = common::named_fixture_dir(FIXTURE).join("vae/diffusion_pytorch_model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu).unwrap() };
    let vae = AutoencoderKLHunyuanVideo::with_encoder(&config(), vb).unwrap();
    let r = common::named_reference(FIXTURE, "vae");
    // 17 frames: tiles 0:17 and 12:17, blended over one latent frame.
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
    assert!(self::vae().encode(&r["encode.video"]).is_err());
}
