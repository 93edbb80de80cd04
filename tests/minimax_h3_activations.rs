//! The memory plan's MiniMax H3 denoise activations against what one transformer forward
//! allocates on the CPU (f32, the tiny fixture at a 64x96 canvas with a 512-token prompt, as
//! the plan assumes): every heap allocation of this test process is counted, and the peak
//! above what was held before the forward must not exceed the plan's estimate. One test in the
//! file, so no other test's allocations mix in.

mod common;

use candle_core::{DType, Device, Tensor};
use std::alloc::{GlobalAlloc, Layout, System};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use vidgen::models::minimax_h3::layout::{
    pack_audio, patchify, row_timesteps, t2va_layout, T2vaGeometry,
};
use vidgen::models::minimax_h3::transformer::{
    MiniMaxH3Transformer3DModel, MiniMaxH3TransformerConfig,
};
use vidgen::models::minimax_h3::vae::MiniMaxH3VaeConfig;

const FIXTURE: &str = "minimax-h3-tiny-a";

/// Bytes the process holds on the heap now and at most since the last reset.
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

struct Counting;

// SAFETY: every call is forwarded to the system allocator; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn one_forward_allocates_no_more_than_the_plan_predicts() {
    let (height, width, frames, text_len) = (64usize, 96usize, 121usize, 512usize);
    let fixture = common::named_fixture_dir(FIXTURE);
    let out = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args([
            "generate",
            "--dry-run",
            "--json",
            "--device",
            "cpu",
            "--model",
        ])
        .arg(&fixture)
        .args([
            "--height",
            &height.to_string(),
            "--width",
            &width.to_string(),
        ])
        .args(["--num-frames", &frames.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["config"]["max_sequence_length"], text_len, "{plan}");
    assert_eq!(plan["config"]["dtype"], "f32", "{plan}");
    let predicted = plan["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "denoise")
        .unwrap()["memory"]["activation_bytes"]
        .as_u64()
        .unwrap() as usize;

    let cfg: MiniMaxH3TransformerConfig = common::config_in(FIXTURE, "transformer/config.json");
    let vae: MiniMaxH3VaeConfig = common::config_in(FIXTURE, "vae/config.json");
    let model = MiniMaxH3Transformer3DModel::new(
        &cfg,
        common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let g = T2vaGeometry::new(height, width, frames, &vae, cfg.patch_size).unwrap();
    let dev = Device::Cpu;
    let latents = Tensor::randn(
        0f32,
        1.,
        (
            1,
            cfg.in_channels,
            g.num_latent_frames,
            g.latent_height,
            g.latent_width,
        ),
        &dev,
    )
    .unwrap();
    let video = patchify(&latents, cfg.patch_size).unwrap();
    let audio = pack_audio(
        &Tensor::randn(
            0f32,
            1.,
            (2, cfg.audio_in_channels, g.num_audio_latents),
            &dev,
        )
        .unwrap(),
    )
    .unwrap();
    let text = Tensor::randn(0f32, 1., (1, text_len, cfg.text_dim), &dev).unwrap();
    let layout = t2va_layout(&g.layout_sizes(text_len), cfg.patch_size, &dev).unwrap();
    let (t, t_idx) = row_timesteps(&layout, 900.0, 700.0).unwrap();
    assert_eq!(video.dtype(), DType::F32);

    let before = CURRENT.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let (v, a) = model
        .forward(&video, &audio, &text, &t, &t_idx, &layout)
        .unwrap();
    let measured = PEAK.load(Ordering::Relaxed) - before;
    drop((v, a));
    let rows = layout.position_ids.dim(0).unwrap();
    eprintln!("{rows} packed rows: peak {measured} bytes above the inputs, predicted {predicted}");
    assert!(
        measured <= predicted,
        "one forward held {measured} bytes, the plan predicts {predicted}"
    );
}
