//! The memory plan's tile walk (`vae_tiling::TileWalk`) against the decode it plans, for both
//! tilings: the same decoder calls in the same order, the first the largest, the whole frame
//! twice at the end, and as each call begins `spatial_tiles` holds on the heap the decoded
//! pixels the walk counts for it (less the call's own output, not made yet). The decoder
//! allocates only its output. One test in the file, so no other test's allocations mix in.

mod common;

use candle_core::{DType, Device, Result, Tensor};
use vidgen::models::vae_tiling::{OverlapTiles, SampleTiles, SpatialTiling};

#[global_allocator]
static ALLOCATOR: common::heap::Counting = common::heap::Counting;

/// Channels of the decoded tiles (f32): enough bytes a pixel that the tensors' own bookkeeping,
/// a few hundred bytes each, stays under [`SLACK`].
const CHANNELS: usize = 16;
const SLACK: usize = 16 << 10;

/// Checks the walk of `tiles` over latents of `(h, w)` against the decoder calls of their decode
/// of zero latents (its decoder makes zeros of `ratio` video pixels per latent pixel) and the
/// heap bytes held, above what was held before, as each begins.
fn assert_walk_holds_what_the_decode_holds(
    tiles: &(impl SpatialTiling + std::fmt::Debug),
    (h, w): (usize, usize),
    ratio: usize,
) {
    assert_eq!(tiles.walk((4, 4), ratio), None, "one tile is decoded whole");
    let walk = tiles.walk((h, w), ratio).unwrap();
    let z = Tensor::zeros((1, 1, h, w), DType::F32, &Device::Cpu).unwrap();
    let (mut held, mut pixels) = (Vec::with_capacity(walk.calls.len()), Vec::new());
    let before = common::heap::start();
    let out = tiles
        .decode(&z, ratio, |part: &Tensor| -> Result<Tensor> {
            held.push(common::heap::held_above(before));
            let (ph, pw) = (part.dim(2)? * ratio, part.dim(3)? * ratio);
            pixels.push((ph * pw) as u64);
            Tensor::zeros((1, CHANNELS, ph, pw), DType::F32, &Device::Cpu)
        })
        .unwrap();
    let frame = (out.dim(2).unwrap() * out.dim(3).unwrap()) as u64;
    drop(out);
    let planned: Vec<u64> = walk.calls.iter().map(|&(p, _)| p).collect();
    assert_eq!(planned, pixels, "{tiles:?}");
    assert_eq!(pixels[0], (walk.tile.0 * walk.tile.1) as u64, "{tiles:?}");
    assert_eq!(walk.end, 2 * frame, "{tiles:?}");
    let pixel = (CHANNELS * 4) as u64;
    for (call, (&(pixels, planned), &held)) in walk.calls.iter().zip(&held).enumerate() {
        let planned = ((planned - pixels) * pixel) as usize;
        assert!(
            held >= planned && held <= planned + SLACK,
            "{tiles:?}, call {call}: {held} bytes held, the walk counts {planned}"
        );
    }
}

#[test]
fn each_decoder_call_finds_held_what_the_walk_counts() {
    // LTX-Video's tiles over 161x512x704 and a square frame.
    for (tiles, ratio, (h, w)) in [
        (SampleTiles::square(512, 448), 32, (16, 22)),
        (SampleTiles::square(16, 12), 2, (20, 20)),
    ] {
        assert_walk_holds_what_the_decode_holds(&tiles, (h, w), ratio);
    }
    // CogVideoX's tiles over 49x480x720 and a square frame.
    let cogvideox = OverlapTiles {
        min_height: 240,
        min_width: 360,
        overlap_factor_height: 1.0 / 6.0,
        overlap_factor_width: 1.0 / 5.0,
    };
    let square = OverlapTiles {
        min_height: 16,
        min_width: 16,
        overlap_factor_height: 0.25,
        overlap_factor_width: 0.25,
    };
    for (tiles, ratio, (h, w)) in [(cogvideox, 8, (60, 90)), (square, 2, (21, 21))] {
        assert_walk_holds_what_the_decode_holds(&tiles, (h, w), ratio);
    }
}
