//! The memory plan's Mochi decode activations against what one VAE decode allocates on the
//! CPU (f32, the tiny fixture's VAE, 64x96, 13 frames): every heap allocation of this test
//! process is counted, and the peak above what was held before the decode must not exceed the
//! plan's estimate (the causal convolutions bound their CPU im2col scratch by runs of frames).
//! One test in the file, so no other test's allocations mix in.

mod common;

use vidgen::models::mochi::vae::{AutoencoderKLMochi, MochiVaeConfig};

const FIXTURE: &str = "mochi-tiny-a";

#[global_allocator]
static ALLOCATOR: common::heap::Counting = common::heap::Counting;

#[test]
fn one_decode_allocates_no_more_than_the_plan_predicts() {
    let (height, width, frames) = (64usize, 96usize, 13usize);
    let planned = common::heap::planned_decode(FIXTURE, (height, width, frames));
    let cfg: MochiVaeConfig = common::config_in(FIXTURE, "vae/config.json");
    let vae = AutoencoderKLMochi::new(
        &cfg,
        common::var_builder_in(FIXTURE, "vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let s = cfg.spatial_compression_ratio();
    let latent_frames = (frames - 1) / cfg.temporal_compression_ratio() + 1;
    let shape = [1, cfg.latent_channels, latent_frames, height / s, width / s];
    let (video, peak) = common::heap::decode_peak(&shape, |z| vae.decode(z));
    assert_eq!(video.dims()[2..], [frames, height, width]);
    common::heap::assert_within_plan(peak, planned, 0);
}
