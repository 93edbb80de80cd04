//! The memory plan's Latte decode activations against what one per-frame decode allocates on
//! the CPU (f32, the tiny fixture's 2-D VAE, 64x128, its 5 frames): every heap allocation of
//! this test process is counted, and the peak above what was held before the decode must not
//! exceed the plan's estimate plus the CPU convolution's own im2col scratch. One test in the
//! file, so no other test's allocations mix in.

mod common;

use candle_core::{Device, Tensor};
use vidgen::models::autoencoder_kl::{AutoencoderKL, AutoencoderKLConfig};
use vidgen::models::latte::decode_latents;

const FIXTURE: &str = "latte-tiny-a";

#[global_allocator]
static ALLOCATOR: common::heap::Counting = common::heap::Counting;

#[test]
fn one_decode_allocates_no_more_than_the_plan_predicts() {
    let (height, width, frames) = (64usize, 128usize, 5usize);
    let planned = common::heap::planned_decode(FIXTURE, (height, width, frames));
    let cfg: AutoencoderKLConfig = common::config_in(FIXTURE, "vae/config.json");
    let vae = AutoencoderKL::new_decoder_only(
        &cfg,
        common::var_builder_in(FIXTURE, "vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let s = cfg.scale_factor();
    let z = Tensor::randn(
        0f32,
        1.,
        (1, cfg.latent_channels, frames, height / s, width / s),
        &Device::Cpu,
    )
    .unwrap();
    let before = common::heap::start();
    let video = decode_latents(&vae, &z).unwrap();
    let peak = common::heap::peak_above(before);
    assert_eq!(video.dims(), [1, cfg.out_channels, frames, height, width]);
    // The CPU's own convolution adds an im2col scratch (a GPU convolves through cuDNN without
    // one): the widest full-resolution conv's input taps, for every frame of the chunk.
    let upsampled = cfg.block_out_channels[1];
    let scratch = frames * upsampled * 9 * height * width * 4;
    eprintln!(
        "decode peak {:.2} MB, planned {:.2} MB + {:.2} MB CPU im2col scratch",
        peak as f64 / 1e6,
        planned as f64 / 1e6,
        scratch as f64 / 1e6
    );
    assert!(
        peak <= planned + scratch,
        "the decode held {peak} bytes, the plan predicts {planned} + {scratch}"
    );
}
