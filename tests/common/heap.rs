//! Counting heap allocations, for the tests that hold a real CPU forward or decode to the memory
//! plan's estimate. A test binary opts in with
//! `#[global_allocator] static ALLOCATOR: common::heap::Counting = common::heap::Counting;`
//! and keeps one test in its file, so no other test's allocations mix in.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes the process holds on the heap now and at most since the last [`start`].
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

pub struct Counting;

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

/// Starts a measurement: the bytes held now, which [`peak_above`] subtracts. What follows runs
/// its CPU matrix products on one thread: each thread of a product takes its own packing
/// scratch, which the plan (a GPU's memory) does not model and which would tie the peak to the
/// host's core count (CogVideoX's decode: 30.6 MB on one thread, 32.7 on two, 45.3 on eight).
pub fn start() -> usize {
    // candle reads the thread count at every product.
    std::env::set_var("RAYON_NUM_THREADS", "1");
    let before = CURRENT.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    before
}

/// The most bytes held since [`start`] returned `before`, above them.
pub fn peak_above(before: usize) -> usize {
    PEAK.load(Ordering::Relaxed) - before
}

/// The bytes held now above `before` (what [`start`] returned).
pub fn held_above(before: usize) -> usize {
    CURRENT.load(Ordering::Relaxed) - before
}

/// Heap bytes of a block's two steps run in turn: what `first` hands on, and the most `second`
/// holds above it, each measured after a first run of both (which grows the CPU products'
/// packing scratch, which each thread keeps and a GPU has none of).
pub fn handed_on_and_peak<C, O>(first: impl Fn() -> C, second: impl Fn(&C) -> O) -> (usize, usize) {
    start();
    drop(second(&first()));
    let before = start();
    let carried = first();
    let handed_on = held_above(before);
    let before = start();
    let out = second(&carried);
    let peak = peak_above(before);
    drop(out);
    (handed_on, peak)
}

/// Decodes random latents of `shape` with `decode`, counting every allocation: the video and
/// the most bytes held during the decode above what was held before it.
pub fn decode_peak(
    shape: &[usize],
    decode: impl FnOnce(&candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>,
) -> (candle_core::Tensor, usize) {
    let z = candle_core::Tensor::randn(0f32, 1., shape, &candle_core::Device::Cpu).unwrap();
    let before = start();
    let video = decode(&z).unwrap();
    (video, peak_above(before))
}

/// Asserts that a decode's `peak` is within the plan's `planned` bytes plus the CPU
/// convolution's own im2col `scratch` (a GPU convolves through cuDNN without one).
pub fn assert_within_plan(peak: usize, planned: usize, scratch: usize) {
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

/// The dry run's JSON plan (on the CPU, in f32) for the model in `dir` at `height` x `width` x `frames`.
pub fn plan(dir: &Path, (height, width, frames): (usize, usize, usize)) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args([
            "generate",
            "--dry-run",
            "--json",
            "--device",
            "cpu",
            "--model",
        ])
        .arg(dir)
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
    assert_eq!(plan["config"]["dtype"], "f32", "{plan}");
    plan
}

/// The planned activation bytes of `stage` in `plan`.
pub fn stage_activations(plan: &serde_json::Value, stage: &str) -> usize {
    plan["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == stage)
        .unwrap()["memory"]["activation_bytes"]
        .as_u64()
        .unwrap() as usize
}

/// The planned activation bytes of the decode of the named fixture at `height` x `width` x `frames`.
pub fn planned_decode(fixture: &str, size: (usize, usize, usize)) -> usize {
    stage_activations(&plan(&super::named_fixture_dir(fixture), size), "decode")
}
