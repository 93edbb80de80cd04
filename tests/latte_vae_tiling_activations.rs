//! The memory plan's tiled Latte decode activations against what one tiled per-frame decode
//! allocates on the CPU (f32, the tiny fixture's 2-D VAE with diffusers' default tiles of its
//! `sample_size`, 256 px, one 320x320 frame: 2x2 tiles): every heap allocation of this test
//! process is counted, and the peak above what was held before the decode must not exceed the
//! plan's estimate plus the CPU convolution's own im2col scratch of one tile. One test in the
//! file, so no other test's allocations mix in.

mod common;

use candle_core::DType;
use vidgen::models::autoencoder_kl::{AutoencoderKL, AutoencoderKLConfig};
use vidgen::models::latte::{activations, decode_latents, DECODE_CHUNK_FRAMES};

const FIXTURE: &str = "latte-tiny-a";

#[global_allocator]
static ALLOCATOR: common::heap::Counting = common::heap::Counting;

#[test]
fn one_tiled_decode_allocates_no_more_than_the_plan_predicts() {
    let (height, width, frames) = (320usize, 320usize, 1usize);
    let cfg: AutoencoderKLConfig = common::config_in(FIXTURE, "vae/config.json");
    let s = cfg.scale_factor();
    let latent = [1, cfg.latent_channels, frames, height / s, width / s];
    let planned =
        activations::vae_decode_activations(&cfg, latent, DECODE_CHUNK_FRAMES, true, DType::F32)
            as usize;
    let untiled =
        activations::vae_decode_activations(&cfg, latent, DECODE_CHUNK_FRAMES, false, DType::F32)
            as usize;
    assert!(planned < untiled, "tiles lower the estimate");
    let vae = AutoencoderKL::new_decoder_only(
        &cfg,
        common::var_builder_in(FIXTURE, "vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap()
    .with_tiling(Some(cfg.tiling()))
    .unwrap();
    let (video, peak) = common::heap::decode_peak(&latent, |z| decode_latents(&vae, z));
    assert_eq!(video.dims(), [1, cfg.out_channels, frames, height, width]);
    // The CPU's own convolution adds an im2col scratch (a GPU convolves through cuDNN without
    // one): the widest full-resolution conv's input taps over one tile.
    let tile = cfg.tiling().min_height;
    let upsampled = cfg.block_out_channels[1];
    let scratch = frames * upsampled * 9 * tile * tile * 4;
    eprintln!(
        "tiled decode peak {:.2} MB, planned {:.2} MB (untiled {:.2} MB) + {:.2} MB CPU im2col scratch",
        peak as f64 / 1e6,
        planned as f64 / 1e6,
        untiled as f64 / 1e6,
        scratch as f64 / 1e6
    );
    assert!(
        peak <= planned + scratch,
        "the decode held {peak} bytes, the plan predicts {planned} + {scratch}"
    );
}
