//! The memory plan's HunyuanVideo decode activations against what one VAE decode allocates on
//! the CPU (f32, the tiny fixture's VAE, one 17-frame tile at 64x128): every heap allocation of
//! this test process is counted, and the peak above what was held before the decode must not
//! exceed the plan's estimate plus the CPU convolution's own im2col scratch (a GPU convolves
//! through cuDNN without one). One test in the file, so no other test's allocations mix in.

mod common;

use candle_core::DType;
use vidgen::models::hunyuan_video::vae::{
    AutoencoderKLHunyuanVideo, HunyuanVideoVaeConfig, MIN_RUNS,
};

const FIXTURE: &str = "hunyuanvideo-tiny-a";

#[global_allocator]
static ALLOCATOR: common::heap::Counting = common::heap::Counting;

#[test]
fn one_decode_allocates_no_more_than_the_plan_predicts() {
    let (height, width, frames) = (64usize, 128usize, 17usize);
    let planned = common::heap::planned_decode(FIXTURE, (height, width, frames));

    let cfg: HunyuanVideoVaeConfig = common::config_in(FIXTURE, "vae/config.json");
    let vae = AutoencoderKLHunyuanVideo::new(
        &cfg,
        common::var_builder_in(FIXTURE, "vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let s = cfg.spatial_compression_ratio;
    let shape = [
        1,
        cfg.latent_channels,
        vae.num_latent_frames(frames),
        height / s,
        width / s,
    ];
    let (video, peak) = common::heap::decode_peak(&shape, |z| vae.decode(z));
    assert_eq!(video.dims(), [1, 3, frames, height, width]);
    assert_eq!(video.dtype(), DType::F32);
    // The CPU's own convolution adds an im2col scratch (a GPU convolves through cuDNN without
    // one): for the widest full-resolution conv, one run of frames' taps of its input.
    let (upsampled, _) = cfg.full_resolution_channels();
    let run_frames = frames.div_ceil(MIN_RUNS);
    let scratch = run_frames * height * width * upsampled * 9 * 4;
    common::heap::assert_within_plan(peak, planned, scratch);
}
