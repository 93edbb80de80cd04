//! The memory plan's Latte decode activations against what one per-frame decode allocates on
//! the CPU (f32, the tiny fixture's 2-D VAE, 64x128, its 5 frames): every heap allocation of
//! this test process is counted, and the peak above what was held before the decode must not
//! exceed the plan's estimate plus the CPU convolution's own im2col scratch. One test in the
//! file, so no other test's allocations mix in.

mod common;

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
    let shape = [1, cfg.latent_channels, frames, height / s, width / s];
    let (video, peak) = common::heap::decode_peak(&shape, |z| decode_latents(&vae, z));
    assert_eq!(video.dims(), [1, cfg.out_channels, frames, height, width]);
    // The CPU's own convolution adds an im2col scratch (a GPU convolves through cuDNN without
    // one): the widest full-resolution conv's input taps, for every frame of the chunk.
    let upsampled = cfg.block_out_channels[1];
    let scratch = frames * upsampled * 9 * height * width * 4;
    common::heap::assert_within_plan(peak, planned, scratch);
}
