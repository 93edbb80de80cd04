//! Parity of MiniMax H3's video VAE decode (ViT decoder, clip chunking with cross-fades,
//! spatial tiling) with diffusers' `AutoencoderKLMiniMaxH3` on the tiny fixture.

mod common;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use vidgen::models::minimax_h3::vae::{
    decoded_to_unit_range, MiniMaxH3VaeConfig, MiniMaxH3VaeDecoder, Tiling,
};

/// The fixture README's tolerance for VAE decodes.
const ATOL: f64 = 3e-5;
const RTOL: f64 = 3e-5;

fn dir() -> std::path::PathBuf {
    common::named_fixture_dir("minimax-h3-tiny-a")
}

fn decoder() -> MiniMaxH3VaeDecoder {
    let cfg: MiniMaxH3VaeConfig =
        serde_json::from_str(&std::fs::read_to_string(dir().join("vae/config.json")).unwrap())
            .unwrap();
    let path = dir().join("vae/diffusion_pytorch_model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu).unwrap() };
    MiniMaxH3VaeDecoder::new(&cfg, vb).unwrap()
}

#[test]
fn one_decoder_call_matches_diffusers() {
    let vae = decoder();
    let r = common::reference_in(&dir(), "vae");
    let z = r["decode.latents_denormalized"].narrow(2, 0, 7).unwrap();
    let clip = vae.decode_clip_untiled(&z).unwrap();
    common::assert_close(
        "decoder_chunk0",
        &clip,
        &r["debug.decoder_chunk0"],
        ATOL,
        RTOL,
    );
}

#[test]
fn chunked_decode_matches_diffusers() {
    let vae = decoder();
    let r = common::reference_in(&dir(), "vae");
    let z = vae.denormalize(&r["decode.latents_normalized"]).unwrap();
    common::assert_close(
        "denormalized",
        &z,
        &r["decode.latents_denormalized"],
        1e-6,
        1e-6,
    );
    let video = vae.decode(&z).unwrap();
    common::assert_close("decode.video", &video, &r["decode.video"], ATOL, RTOL);
    let frames = decoded_to_unit_range(&video).unwrap();
    common::assert_close("decode.frames", &frames, &r["decode.frames"], ATOL, RTOL);
}

#[test]
fn tiled_decode_matches_diffusers() {
    let mut vae = decoder();
    vae.tiling = Some(Tiling {
        tile_height: 16,
        tile_width: 16,
        min_overlap_height: 8,
        min_overlap_width: 8,
    });
    let r = common::reference_in(&dir(), "vae");
    // Four tiles a clip: one per decoder call, three and one, all four in one call.
    for tiles in [1, 3, 64] {
        vae.tiles_per_call = tiles;
        let video = vae.decode(&r["tiled.latents_denormalized"]).unwrap();
        let what = format!("tiled.video, {tiles} tiles per call");
        common::assert_close(&what, &video, &r["tiled.video"], ATOL, RTOL);
    }
}

#[test]
fn pipeline_decode_matches_diffusers() {
    let vae = decoder();
    let r = common::reference_in(&dir(), "pipeline");
    let z = vae.denormalize(&r["final.latents"]).unwrap();
    common::assert_close("vae_decode_input", &z, &r["vae_decode_input"], 1e-6, 1e-6);
    let video = vae.decode(&z).unwrap();
    let first = video.narrow(2, 0, 22).unwrap();
    common::assert_close(
        "vae_decode_output_first22",
        &first,
        &r["vae_decode_output_first22"],
        ATOL,
        RTOL,
    );
    let frames = decoded_to_unit_range(&video)
        .unwrap()
        .permute((0, 2, 3, 4, 1))
        .unwrap();
    common::assert_close("videos", &frames, &r["videos"], ATOL, RTOL);
}

#[test]
fn hostile_configs_are_one_line_errors() {
    let cfg = MiniMaxH3VaeConfig {
        decoder_rope_dim_ratio: 0.5,
        ..Default::default()
    };
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("decoder_rope_dim_ratio"), "{err}");
    let mut cfg = MiniMaxH3VaeConfig::default();
    cfg.latents_std.pop();
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("latents_std"), "{err}");
}
