//! PNG folder writer: one 8-bit RGB PNG per frame, rounded like diffusers' PIL path.

use super::audio::{write_wav, Audio, WAV_NAME};
use super::{Clip, Partial};
use anyhow::{Context, Result};
use candle_core::Tensor;
use std::path::Path;

/// Writes `frame_00000.png`, `frame_00001.png`, ... into the folder `dir` (made as a hidden
/// temporary folder, renamed into place when complete; what is at `dir` is replaced). Values become `round_half_even(x * 255)`, as numpy does for
/// `output_type="pil"`.
pub fn write_png_frames(dir: &Path, frames: &Tensor) -> Result<()> {
    write_png_frames_with(dir, frames, None, true)
}

/// [`write_png_frames`], with `audio` as a WAV file in the folder; unless `replace`, a
/// non-empty folder at `dir` is kept and reported; with it, the old folder is swapped out only
/// once the new one is complete.
pub(super) fn write_png_frames_with(
    dir: &Path,
    frames: &Tensor,
    audio: Option<&Audio>,
    replace: bool,
) -> Result<()> {
    let run = || -> Result<()> {
        let clip = Clip::from_tensor(frames)?;
        let (w, h) = size(&clip)?;
        let temp = Partial::dir(dir)?;
        for i in 0..clip.frames {
            let file = temp.path().join(format!("frame_{i:05}.png"));
            save_frame(&clip, i, (w, h), &file)?;
        }
        if let Some(audio) = audio {
            write_wav(&temp.path().join(WAV_NAME), audio)?;
        }
        temp.commit(dir, replace)
    };
    run().with_context(|| format!("writing PNG frames to {}", dir.display()))
}

/// Writes the one frame of `frames` (`[1, H, W, 3]` in [0, 1]: an image model's output) as the
/// PNG file `path`, through a temporary name renamed into place when complete; unless
/// `replace`, a file that appeared at `path` meanwhile is kept and reported.
pub fn write_png_image(path: &Path, frames: &Tensor, replace: bool) -> Result<()> {
    let run = || -> Result<()> {
        let clip = Clip::from_tensor(frames)?;
        if clip.frames != 1 {
            anyhow::bail!("{} frames are not one image", clip.frames);
        }
        let temp = Partial::file(path)?;
        save_frame(&clip, 0, size(&clip)?, temp.path())?;
        temp.commit(path, replace)
    };
    run().with_context(|| format!("writing PNG image {}", path.display()))
}

/// A clip's frame size as the image crate takes it.
fn size(clip: &Clip) -> Result<(u32, u32)> {
    Ok((
        u32::try_from(clip.width).context("frame width")?,
        u32::try_from(clip.height).context("frame height")?,
    ))
}

/// Frame `i` of `clip` (`w` x `h`) as the PNG file `file`; values become
/// `round_half_even(x * 255)`.
fn save_frame(clip: &Clip, i: usize, (w, h): (u32, u32), file: &Path) -> Result<()> {
    let bytes: Vec<u8> = clip.with_frame(i, |values| {
        values
            .iter()
            .map(|&x| (x * 255.0).round_ties_even() as u8)
            .collect()
    })?;
    let image =
        image::RgbImage::from_raw(w, h, bytes).context("frame buffer does not match its size")?;
    image
        .save_with_format(file, image::ImageFormat::Png)
        .with_context(|| format!("writing {}", file.display()))
}
