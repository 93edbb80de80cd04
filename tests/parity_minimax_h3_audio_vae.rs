//! Parity of MiniMax H3's audio VAE decode (dec_in_proj + BigVGAN, stereo as a batch of two)
//! with diffusers' `AutoencoderKLMiniMaxH3Audio` on the tiny fixture.

mod common;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use vidgen::models::minimax_h3::audio_vae::{
    stereo_from_batch, MiniMaxH3AudioVaeConfig, MiniMaxH3AudioVaeDecoder,
};

/// The fixture README's tolerance for audio-VAE decodes.
const ATOL: f64 = 3e-5;
const RTOL: f64 = 3e-5;

fn dir() -> std::path::PathBuf {
    common::named_fixture_dir("minimax-h3-tiny-a")
}

fn decoder() -> MiniMaxH3AudioVaeDecoder {
    let text = std::fs::read_to_string(dir().join("audio_vae/config.json")).unwrap();
    let cfg: MiniMaxH3AudioVaeConfig = serde_json::from_str(&text).unwrap();
    let path = dir().join("audio_vae/diffusion_pytorch_model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu).unwrap() };
    MiniMaxH3AudioVaeDecoder::new(&cfg, vb).unwrap()
}

#[test]
fn decode_matches_diffusers() {
    let vae = decoder();
    let r = common::reference_in(&dir(), "audio_vae");
    let z = vae.denormalize(&r["decode.latents_normalized"]).unwrap();
    common::assert_close(
        "denormalized",
        &z,
        &r["decode.latents_denormalized"],
        1e-6,
        1e-6,
    );
    let projected = vae.project_in(&z).unwrap();
    common::assert_close(
        "dec_in_proj",
        &projected,
        &r["debug.dec_in_proj"],
        ATOL,
        RTOL,
    );
    let waveform = vae.decode(&z).unwrap();
    common::assert_close(
        "decode.waveform",
        &waveform,
        &r["decode.waveform"],
        ATOL,
        RTOL,
    );
    let stereo = stereo_from_batch(&waveform).unwrap();
    common::assert_close("decode.stereo", &stereo, &r["decode.stereo"], ATOL, RTOL);
}

#[test]
fn pipeline_audio_matches_diffusers() {
    let vae = decoder();
    let r = common::reference_in(&dir(), "pipeline");
    let z = vae.denormalize(&r["final.audio_latents"]).unwrap();
    common::assert_close(
        "audio_vae_decode_input",
        &z,
        &r["audio_vae_decode_input"],
        1e-6,
        1e-6,
    );
    let audio = stereo_from_batch(&vae.decode(&z).unwrap()).unwrap();
    common::assert_close("audio", &audio, &r["audio"], ATOL, RTOL);
}

#[test]
fn hostile_configs_are_one_line_errors() {
    let cfg = MiniMaxH3AudioVaeConfig {
        decoder_rates: vec![5, 5],
        ..Default::default()
    };
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("decoder_rates"), "{err}");
    let cfg = MiniMaxH3AudioVaeConfig {
        latents_mean: Some(vec![0.0; 3]),
        ..Default::default()
    };
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("latents_mean"), "{err}");
}
