//! Writing a video holds the frames once: the MP4 and PNG writers read a contiguous f32 host
//! tensor in place, frame by frame, instead of copying the whole video first (a 15 s MiniMax H3
//! video is 4.5 GB of f32 frames). Every heap allocation of this test process is counted; one
//! test in the file, so no other test's allocations mix in.

mod common;

use candle_core::{Device, Tensor};
use vidgen::output::{self, OutputType};

#[global_allocator]
static ALLOCATOR: common::heap::Counting = common::heap::Counting;

#[test]
fn writers_read_the_frames_in_place() {
    let (frames, height, width) = (24usize, 128usize, 192usize);
    let values: Vec<f32> = (0..frames * height * width * 3)
        .map(|i| (i % 251) as f32 / 250.0)
        .collect();
    let video = Tensor::from_vec(values, (frames, height, width, 3), &Device::Cpu).unwrap();
    let bytes = video.elem_count() * 4;
    let dir = std::env::temp_dir().join(format!("vidgen-output-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut kinds = vec![OutputType::Png];
    if cfg!(feature = "mp4") {
        kinds.push(OutputType::Mp4);
    }
    for kind in kinds {
        let path = dir.join(format!("clip.{}", kind.extension()));
        let before = common::heap::start();
        output::write(kind, &path, &video, 16, &[]).unwrap();
        let peak = common::heap::peak_above(before);
        eprintln!(
            "{kind:?}: peak {:.2} MB above the {:.2} MB video",
            peak as f64 / 1e6,
            bytes as f64 / 1e6
        );
        assert!(
            peak < bytes / 4,
            "{kind:?} held {peak} bytes while writing a {bytes}-byte video"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
