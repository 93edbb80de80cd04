//! The memory plan's CogVideoX decode activations against what one VAE decode allocates on the
//! CPU (f32, the tiny fixture's VAE, 64x128, 13 frames): every heap allocation of this test
//! process is counted, and the peak above what was held before the decode must not exceed the
//! plan's estimate plus the CPU convolution's own im2col scratch. One test in the file, so no
//! other test's allocations mix in.

mod common;

use vidgen::models::cogvideox::vae::{AutoencoderKLCogVideoX, CogVideoXVaeConfig};

const FIXTURE: &str = "cogvideox-tiny-a";

#[global_allocator]
static ALLOCATOR: common::heap::Counting = common::heap::Counting;

#[test]
fn one_decode_allocates_no_more_than_the_plan_predicts() {
    let (height, width, frames) = (64usize, 128usize, 13usize);
    let planned = common::heap::planned_decode(FIXTURE, (height, width, frames));
    let cfg: CogVideoXVaeConfig = common::config_in(FIXTURE, "vae/config.json");
    let vae = AutoencoderKLCogVideoX::new_decoder_only(
        &cfg,
        common::var_builder_in(FIXTURE, "vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let s = cfg.scale_factor_spatial();
    let latent_frames = (frames - 1) / cfg.scale_factor_temporal() + 1;
    let shape = [1, cfg.latent_channels, latent_frames, height / s, width / s];
    let (video, peak) = common::heap::decode_peak(&shape, |z| vae.decode(z));
    assert_eq!(video.dims()[3..], [height, width]);
    // The CPU's own convolution adds an im2col scratch (a GPU convolves through cuDNN without
    // one): one output frame of the widest full-resolution conv, its input's 3x3 taps.
    let upsampled = cfg.block_out_channels[1];
    let scratch = upsampled * 9 * height * width * 4;
    common::heap::assert_within_plan(peak, planned, scratch);
}
