//! diffusers' tiled VAE decode (and encode), shared by the VAEs that have it: overlapping tiles,
//! each through the VAE on its own, blended linearly into the neighbours they overlap
//! (`blend_v` / `blend_h` / `blend_t`, in place as diffusers: a later tile reads its
//! neighbours already blended) and cropped, so the decoder's activations are bounded by the
//! tile instead of the frame. Two ways diffusers sizes the spatial tiles: in pixels with a
//! stride ([`SampleTiles`]: HunyuanVideo, LTX-Video, Mochi-1; Wan runs [`spatial_tiles`] in its
//! patchified output space) or from the config's sample size with overlap factors
//! ([`OverlapTiles`]: CogVideoX, AutoencoderKL).

use candle_core::{bail, DType, Result, Tensor};

/// diffusers' `blend_t` / `blend_v` / `blend_h` along `dim`: the first `extent` entries of `b`
/// fade from the last ones of `a` into `b`'s own, rounded as torch rounds
/// `a · (1 − y/extent) + b · (y/extent)`: each product and the sum computed in f32 (the Python
/// weight as an f32) and rounded to the tensors' dtype.
pub fn blend(a: &Tensor, b: &Tensor, extent: usize, dim: usize) -> Result<Tensor> {
    let extent = extent.min(a.dim(dim)?).min(b.dim(dim)?);
    if extent == 0 {
        return Ok(b.clone());
    }
    let dtype = b.dtype();
    let weighted = |x: &Tensor, f: &dyn Fn(f64) -> f64| -> Result<Tensor> {
        let w: Vec<f32> = (0..extent)
            .map(|y| f(y as f64 / extent as f64) as f32)
            .collect();
        let shape: Vec<usize> = (0..b.rank())
            .map(|d| if d == dim { extent } else { 1 })
            .collect();
        let w = Tensor::from_vec(w, shape, b.device())?;
        x.to_dtype(DType::F32)?.broadcast_mul(&w)?.to_dtype(dtype)
    };
    let a_tail = weighted(&a.narrow(dim, a.dim(dim)? - extent, extent)?, &|r| 1.0 - r)?;
    let b_head = weighted(&b.narrow(dim, 0, extent)?, &|r| r)?;
    let mixed = (a_tail.to_dtype(DType::F32)? + b_head.to_dtype(DType::F32)?)?.to_dtype(dtype)?;
    let rest = b.narrow(dim, extent, b.dim(dim)? - extent)?;
    Tensor::cat(&[mixed, rest], dim)
}

/// Which output entry a temporal tile after the first drops (the one it shares with the tile
/// before): HunyuanVideo's decode and every temporal encode drop the first, LTX-Video's decode
/// the last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    First,
    Last,
}

/// Tiles along dim 2 (time) of `[B, C, T, H, W]` as diffusers' temporal tiling runs them: tiles
/// of `len` entries every `stride`, each through `f`; tiles after the first drop one output
/// entry (`dropped`); each tile is blended with the previous one over `blend` entries; the
/// first keeps `keep + 1` entries, the others `keep`; the result is cut to `out_len`.
pub fn temporal_tiles(
    x: &Tensor,
    (len, stride): (usize, usize),
    (blend_extent, keep, out_len): (usize, usize, usize),
    dropped: Dropped,
    mut f: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let t = x.dim(2)?;
    let mut row: Vec<Tensor> = Vec::new();
    for i in (0..t).step_by(stride.max(1)) {
        let mut tile = f(&x.narrow(2, i, len.min(t - i))?)?;
        if i > 0 {
            let n = tile.dim(2)?;
            if n <= 1 {
                // Nothing left: only the last tile can be this short, and it adds nothing.
                continue;
            }
            let first = match dropped {
                Dropped::First => 1,
                Dropped::Last => 0,
            };
            tile = tile.narrow(2, first, n - 1)?;
        }
        row.push(tile);
    }
    let mut parts = Vec::with_capacity(row.len());
    for i in 0..row.len() {
        if i > 0 {
            row[i] = blend(&row[i - 1], &row[i], blend_extent, 2)?;
        }
        let keep = if i > 0 { keep } else { keep + 1 };
        parts.push(row[i].narrow(2, 0, keep.min(row[i].dim(2)?))?);
    }
    let out = Tensor::cat(&parts, 2)?;
    out.narrow(2, 0, out_len.min(out.dim(2)?))
}

/// diffusers' `_temporal_tiled_decode` of latents `z` `[B, C, F, H, W]` with `ratio` video
/// frames per latent frame: tiles of `min_frames` video frames every `stride_frames` (each
/// decoding one latent frame more, the frame it shares with the next), through `decode`,
/// blended over `min_frames - stride_frames` frames, `(F - 1)·ratio + 1` frames in all.
pub fn decode_frame_tiles(
    z: &Tensor,
    (min_frames, stride_frames): (usize, usize),
    ratio: usize,
    dropped: Dropped,
    decode: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let frames = z.dim(2)?;
    temporal_tiles(
        z,
        (min_frames / ratio + 1, stride_frames / ratio),
        (
            min_frames - stride_frames,
            stride_frames,
            frames.saturating_sub(1) * ratio + 1,
        ),
        dropped,
        decode,
    )
}

/// Spatial tiles over the last two dims (height, width) as diffusers' `tiled_encode` /
/// `tiled_decode` run them: input tiles of `tile` (h, w) every `stride`, each through `f`; each
/// output tile blended with the one above and the one to the left over `blend` (h, w), cropped
/// to `keep`; the result cut to `out` (h, w). A row's tiles are blended as soon as the row is
/// made, so two rows of tiles wait at most (diffusers makes them all first: the same values).
pub fn spatial_tiles(
    x: &Tensor,
    (tile, stride): ((usize, usize), (usize, usize)),
    (blend_extent, keep, out): ((usize, usize), (usize, usize), (usize, usize)),
    mut f: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (hd, wd) = (x.rank() - 2, x.rank() - 1);
    let (h, w) = (x.dim(hd)?, x.dim(wd)?);
    let mut above: Vec<Tensor> = Vec::new();
    let mut result_rows = Vec::new();
    for i in (0..h).step_by(stride.0.max(1)) {
        let mut row: Vec<Tensor> = Vec::new();
        let mut result_row = Vec::new();
        for (column, j) in (0..w).step_by(stride.1.max(1)).enumerate() {
            let part = x
                .narrow(hd, i, tile.0.min(h - i))?
                .narrow(wd, j, tile.1.min(w - j))?;
            // In place, as diffusers: a tile reads its neighbours already blended.
            let mut tile = f(&part)?;
            if let Some(up) = above.get(column) {
                tile = blend(up, &tile, blend_extent.0, hd)?;
            }
            if let Some(left) = row.last() {
                tile = blend(left, &tile, blend_extent.1, wd)?;
            }
            let (th, tw) = (tile.dim(hd)?, tile.dim(wd)?);
            result_row.push(
                tile.narrow(hd, 0, keep.0.min(th))?
                    .narrow(wd, 0, keep.1.min(tw))?,
            );
            row.push(tile);
        }
        result_rows.push(Tensor::cat(&result_row, wd)?);
        above = row;
    }
    drop(above);
    let result = Tensor::cat(&result_rows, hd)?;
    let (rh, rw) = (result.dim(hd)?, result.dim(wd)?);
    result
        .narrow(hd, 0, out.0.min(rh))?
        .narrow(wd, 0, out.1.min(rw))
}

/// A tiled decode's decoder calls for the memory plan, in video pixels: the largest call (the
/// first, a whole tile), and for each call in order its pixels and the decoded pixels held
/// while it runs (the row above and this row's tiles, whole, the kept rows before them, its own
/// output); at the end the kept rows and their concatenation. The largest call's maps beside
/// the fewest held pixels, or a smaller call's beside more, whichever is larger: LTX-Video's
/// 161x512x704 tiled decode used 3.30 GiB above the weights where two rows and the result twice
/// beside the largest call's maps counted 4.50 (an H100, bench/RESULTS.md sessions 39 and 48).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TileWalk {
    pub tile: (usize, usize),
    pub calls: Vec<(u64, u64)>,
    pub end: u64,
}

impl TileWalk {
    /// The peak over the calls of the feature maps, `maps` at the largest call and in
    /// proportion to its pixels at the others, and `per_pixel` bytes of every held pixel.
    pub fn peak(&self, maps: u64, per_pixel: u64) -> u64 {
        let largest = (self.tile.0 * self.tile.1).max(1) as u128;
        self.calls
            .iter()
            .map(|&(pixels, held)| {
                let maps = (maps as u128 * pixels as u128 / largest) as u64;
                maps.saturating_add(held.saturating_mul(per_pixel))
            })
            .chain([self.end.saturating_mul(per_pixel)])
            .max()
            .unwrap_or(0)
    }

    /// The calls [`spatial_tiles`] makes over latents `(h, w)` with tiles of `tile` latent
    /// pixels every `stride`, each keeping `kept` video pixels of its output, `ratio` video
    /// pixels per latent pixel: one walk for both tilings, since both run [`spatial_tiles`].
    fn of_spatial_tiles(
        (h, w): (usize, usize),
        (tile, stride): ((usize, usize), (usize, usize)),
        kept: (usize, usize),
        ratio: usize,
    ) -> Self {
        let size = |at: usize, tile: usize, len: usize| tile.min(len - at) * ratio;
        let columns: Vec<usize> = (0..w)
            .step_by(stride.1.max(1))
            .map(|j| size(j, tile.1, w))
            .collect();
        let (mut calls, mut above, mut kept_rows) = (Vec::new(), 0u64, 0u64);
        for i in (0..h).step_by(stride.0.max(1)) {
            let rows = size(i, tile.0, h);
            let (mut row, mut kept_row) = (0u64, 0u64);
            for &cols in &columns {
                row += (rows * cols) as u64;
                calls.push(((rows * cols) as u64, above + kept_rows + row));
                kept_row += (rows.min(kept.0) * cols.min(kept.1)) as u64;
            }
            kept_rows += kept_row;
            above = row;
        }
        Self {
            tile: (tile.0.min(h) * ratio, tile.1.min(w) * ratio),
            calls,
            end: 2 * kept_rows,
        }
    }
}

/// What the two tilings share: tiles of a size in video pixels starting a stride apart in latent
/// pixels, each keeping part of its decoded pixels and blending the rest into the next; the
/// memory plan's walk and the decode both follow from them ([`spatial_tiles`]).
pub trait SpatialTiling {
    /// The tile in video pixels (height, width).
    fn min_size(&self) -> (usize, usize);
    /// The distance between tile starts, in latent pixels of `ratio` video pixels.
    fn latent_stride(&self, ratio: usize) -> (usize, usize);
    /// The overlap blended into the next tile, in video pixels.
    fn blend(&self) -> (usize, usize);
    /// The video pixels each tile keeps.
    fn kept(&self) -> (usize, usize);
    /// The size the blended `frame` (the latents' size in video pixels) is cropped to.
    fn crop(&self, frame: (usize, usize)) -> (usize, usize);

    /// The tile in latent pixels (diffusers' `tile_latent_min_*`).
    fn latent_tile(&self, ratio: usize) -> (usize, usize) {
        let (h, w) = self.min_size();
        (h / ratio, w / ratio)
    }

    /// Whether latents of `h` x `w` are larger than one tile (diffusers' condition for
    /// `tiled_decode`).
    fn splits(&self, (h, w): (usize, usize), ratio: usize) -> bool {
        let (min_h, min_w) = self.latent_tile(ratio);
        w > min_w || h > min_h
    }

    /// The decoder calls of a decode of latents `(h, w)` in these tiles, in the order
    /// [`spatial_tiles`] makes them, with what each finds held; `None` where the latents fit in
    /// one tile and are decoded whole.
    fn walk(&self, (h, w): (usize, usize), ratio: usize) -> Option<TileWalk> {
        let tiles = (self.latent_tile(ratio), self.latent_stride(ratio));
        self.splits((h, w), ratio)
            .then(|| TileWalk::of_spatial_tiles((h, w), tiles, self.kept(), ratio))
    }

    /// diffusers' `tiled_decode` of latents `z` (height and width last) with `ratio` video
    /// pixels per latent pixel: each tile through `decode`, blended in video pixels.
    fn decode(
        &self,
        z: &Tensor,
        ratio: usize,
        decode: impl FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (h, w) = (z.dim(z.rank() - 2)?, z.dim(z.rank() - 1)?);
        spatial_tiles(
            z,
            (self.latent_tile(ratio), self.latent_stride(ratio)),
            (self.blend(), self.kept(), self.crop((h * ratio, w * ratio))),
            decode,
        )
    }
}

/// Spatial tiles in video pixels, as `enable_tiling(tile_sample_min_*, tile_sample_stride_*)`
/// of HunyuanVideo's, LTX-Video's and Mochi-1's VAEs takes them: tiles of `min` pixels start
/// every `stride` pixels and the `min - stride` overlap is blended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleTiles {
    pub min_height: usize,
    pub min_width: usize,
    pub stride_height: usize,
    pub stride_width: usize,
}

impl SampleTiles {
    /// Tiles of `min` pixels every `stride` both ways.
    pub const fn square(min: usize, stride: usize) -> Self {
        Self {
            min_height: min,
            min_width: min,
            stride_height: stride,
            stride_width: stride,
        }
    }

    /// Tiles at least as large as their stride, the stride at least one latent pixel of
    /// `ratio` video pixels.
    pub fn validate(&self, ratio: usize) -> Result<()> {
        if self.stride_height < ratio
            || self.stride_width < ratio
            || self.min_height < self.stride_height
            || self.min_width < self.stride_width
        {
            bail!(
                "vae tiling: tiles of {}x{} pixels every {}x{} must be at least their stride and the stride at least {ratio} pixels",
                self.min_height,
                self.min_width,
                self.stride_height,
                self.stride_width
            );
        }
        Ok(())
    }
}

impl SpatialTiling for SampleTiles {
    fn min_size(&self) -> (usize, usize) {
        (self.min_height, self.min_width)
    }

    /// diffusers' `tile_latent_stride_*`.
    fn latent_stride(&self, ratio: usize) -> (usize, usize) {
        (self.stride_height / ratio, self.stride_width / ratio)
    }

    fn blend(&self) -> (usize, usize) {
        (
            self.min_height - self.stride_height,
            self.min_width - self.stride_width,
        )
    }

    fn kept(&self) -> (usize, usize) {
        (self.stride_height, self.stride_width)
    }

    /// The frame, cropped to the latents' size.
    fn crop(&self, frame: (usize, usize)) -> (usize, usize) {
        frame
    }
}

/// Spatial tiles sized from a sample size and overlap factors, as CogVideoX's
/// (`tile_overlap_factor_height` / `_width`) and AutoencoderKL's (`tile_overlap_factor`) VAEs
/// size them: a tile of `min` pixels (`min / ratio` latent pixels, truncated) starts every
/// `int(latent tile · (1 − factor))` latent pixels, is blended over `int(min · factor)` pixels
/// and keeps `min` minus that; the result is not cropped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlapTiles {
    pub min_height: usize,
    pub min_width: usize,
    pub overlap_factor_height: f64,
    pub overlap_factor_width: f64,
}

impl OverlapTiles {
    /// Factors in [0, 1) that leave tiles of at least one latent pixel a step apart.
    pub fn validate(&self, ratio: usize) -> Result<()> {
        let factors = [self.overlap_factor_height, self.overlap_factor_width];
        let (stride_h, stride_w) = self.latent_stride(ratio);
        if factors.iter().any(|f| !(0.0..1.0).contains(f)) || stride_h == 0 || stride_w == 0 {
            bail!(
                "vae tiling: tiles of {}x{} pixels with overlap factors {}x{} must be at least {ratio} pixels a step apart",
                self.min_height,
                self.min_width,
                self.overlap_factor_height,
                self.overlap_factor_width
            );
        }
        Ok(())
    }
}

impl SpatialTiling for OverlapTiles {
    fn min_size(&self) -> (usize, usize) {
        (self.min_height, self.min_width)
    }

    /// diffusers' `overlap_*`.
    fn latent_stride(&self, ratio: usize) -> (usize, usize) {
        let (h, w) = self.latent_tile(ratio);
        (
            (h as f64 * (1.0 - self.overlap_factor_height)) as usize,
            (w as f64 * (1.0 - self.overlap_factor_width)) as usize,
        )
    }

    /// diffusers' `blend_extent_*`.
    fn blend(&self) -> (usize, usize) {
        (
            (self.min_height as f64 * self.overlap_factor_height) as usize,
            (self.min_width as f64 * self.overlap_factor_width) as usize,
        )
    }

    /// diffusers' `row_limit_*`.
    fn kept(&self) -> (usize, usize) {
        let blend = self.blend();
        (self.min_height - blend.0, self.min_width - blend.1)
    }

    /// The frame as the tiles leave it: not cropped.
    fn crop(&self, _frame: (usize, usize)) -> (usize, usize) {
        (usize::MAX, usize::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// diffusers' loop `b[y] = a[-extent + y] · (1 − y/extent) + b[y] · y/extent`.
    #[test]
    fn blend_fades_the_overlap_linearly() -> Result<()> {
        let a = Tensor::new(&[[10f32, 20., 30., 40.]], &Device::Cpu)?;
        let b = Tensor::new(&[[1f32, 2., 3., 4.]], &Device::Cpu)?;
        let got: Vec<f32> = blend(&a, &b, 2, 1)?.flatten_all()?.to_vec1()?;
        assert_eq!(got, vec![30.0, 0.5 * 40.0 + 0.5 * 2.0, 3.0, 4.0]);
        // An extent beyond either tensor is cut to the shorter.
        let short = Tensor::new(&[[5f32]], &Device::Cpu)?;
        let got: Vec<f32> = blend(&short, &b, 3, 1)?.flatten_all()?.to_vec1()?;
        assert_eq!(got, vec![5.0, 2.0, 3.0, 4.0]);
        Ok(())
    }

    /// Tiles of an identity "decoder" blended with themselves give the input back: every
    /// overlap mixes equal values and the crops tile the whole.
    #[test]
    fn identity_tiles_rebuild_the_input() -> Result<()> {
        let x = Tensor::arange(0f32, 2.0 * 7.0 * 9.0, &Device::Cpu)?.reshape((1, 2, 7, 9))?;
        let tiles = SampleTiles {
            min_height: 4,
            min_width: 5,
            stride_height: 3,
            stride_width: 3,
        };
        assert!(tiles.splits((7, 9), 1));
        let got = tiles.decode(&x, 1, |t| Ok(t.clone()))?;
        assert_eq!(
            got.squeeze(0)?.to_vec3::<f32>()?,
            x.squeeze(0)?.to_vec3::<f32>()?
        );
        let overlap = OverlapTiles {
            min_height: 4,
            min_width: 4,
            overlap_factor_height: 0.25,
            overlap_factor_width: 0.25,
        };
        overlap.validate(1)?;
        let got = overlap.decode(&x, 1, |t| Ok(t.clone()))?;
        assert_eq!(
            got.squeeze(0)?.to_vec3::<f32>()?,
            x.squeeze(0)?.to_vec3::<f32>()?
        );
        Ok(())
    }

    #[test]
    fn tiles_that_cannot_step_are_refused() {
        assert!(SampleTiles::square(16, 4).validate(8).is_err());
        assert!(SampleTiles::square(4, 8).validate(8).is_err());
        assert!(SampleTiles::square(256, 192).validate(8).is_ok());
        let overlap = OverlapTiles {
            min_height: 8,
            min_width: 8,
            overlap_factor_height: 0.5,
            overlap_factor_width: 0.5,
        };
        assert!(overlap.validate(8).is_err(), "a one-pixel tile cannot step");
    }
}
