//! The memory plan's LTX-Video decode activations against what one VAE decode allocates on the
//! CPU (f32, the tiny fixture's VAE with timestep conditioning and injected noise, 128x192, 17
//! frames): every heap allocation of this test process is counted, and the peak above what was
//! held before the decode must not exceed the plan's estimate plus the CPU convolution's own
//! im2col scratch. One test in the file, so no other test's allocations mix in.

mod common;

use candle_core::{Device, Tensor};
use vidgen::models::ltx::vae::{AutoencoderKLLTXVideo, LtxVaeConfig};
use vidgen::rng::TorchGenerator;

const FIXTURE: &str = "ltx-video-tiny-a";

#[global_allocator]
static ALLOCATOR: common::heap::Counting = common::heap::Counting;

#[test]
fn one_decode_allocates_no_more_than_the_plan_predicts() {
    let (height, width, frames) = (128usize, 192usize, 17usize);
    let planned = common::heap::planned_decode(FIXTURE, (height, width, frames));
    let cfg: LtxVaeConfig = common::config_in(FIXTURE, "vae/config.json");
    let vae = AutoencoderKLLTXVideo::new(
        &cfg,
        common::var_builder_in(FIXTURE, "vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let (rs, rt) = (
        cfg.spatial_compression_ratio(),
        cfg.temporal_compression_ratio(),
    );
    let shape = [
        1,
        cfg.latent_channels,
        (frames - 1) / rt + 1,
        height / rs,
        width / rs,
    ];
    let timestep = Tensor::new(&[0.05f32], &Device::Cpu).unwrap();
    let (video, peak) = common::heap::decode_peak(&shape, |z| {
        vae.decode(z, Some(&timestep), &mut TorchGenerator::new(7))
    });
    assert_eq!(video.dims()[2..], [frames, height, width]);
    // The CPU's own convolution adds an im2col scratch (a GPU convolves through cuDNN without
    // one): every output frame of the widest conv at the decoder's last level, its input's 3x3
    // taps (the frames of one call).
    let last = cfg.decoder_block_out_channels[0];
    let scratch = last * 9 * frames * (height / cfg.patch_size) * (width / cfg.patch_size) * 4;
    common::heap::assert_within_plan(peak, planned, scratch);
}
