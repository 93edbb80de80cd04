//! Parity of the Mochi VAE decoder (`AutoencoderKLMochi.decode` after `MochiPipeline`'s
//! de-normalisation) with `mochi-tiny-a/reference/vae.safetensors`.

mod common;

use vidgen::models::mochi::vae::{AutoencoderKLMochi, MochiVaeConfig};

const FIXTURE: &str = "mochi-tiny-a";

fn vae() -> AutoencoderKLMochi {
    let cfg: MochiVaeConfig = common::config_in(FIXTURE, "vae/config.json");
    let vb = common::var_builder_in(FIXTURE, "vae/diffusion_pytorch_model.safetensors");
    AutoencoderKLMochi::new(&cfg, vb).unwrap()
}

fn check(what: &str, actual: &candle_core::Tensor, expected: &candle_core::Tensor) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, 1e-4, 1e-4);
}

#[test]
fn decode_matches_diffusers() {
    let vae = vae();
    let r = common::named_reference(FIXTURE, "vae");
    let z = vae.denormalize(&r["decode.latents_normalized"]).unwrap();
    check(
        "latents_denormalized",
        &z,
        &r["decode.latents_denormalized"],
    );
    let video = vae.decode(&r["decode.latents_denormalized"]).unwrap();
    check("decode.video", &video, &r["decode.video"]);
}

/// One latent frame decodes to one frame (the first 5 of 6 dropped).
#[test]
fn one_latent_frame_decodes_to_one_frame() {
    let vae = vae();
    let r = common::named_reference(FIXTURE, "vae");
    let z = r["decode.latents_denormalized"].narrow(2, 0, 1).unwrap();
    let video = vae.decode(&z).unwrap();
    check("decode1.video", &video, &r["decode1.video"]);
}
