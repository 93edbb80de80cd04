//! Writers for the generated frames: MP4, PNG folders and safetensors.
//!
//! Every writer takes frames as an `[F, H, W, 3]` tensor in [0, 1] (any dtype, any device), writes
//! to a hidden temporary name next to the destination and renames it into place only when the
//! output is complete, so an interrupted or failed run never leaves a half-written file behind.

#[cfg(feature = "mp4")]
mod mp4;
mod png;

#[cfg(feature = "mp4")]
pub use mp4::write_mp4;
pub use png::write_png_frames;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The kind of output file (`--output-type`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum OutputType {
    /// H.264 video in an MP4 container.
    #[default]
    Mp4,
    /// A folder with one PNG per frame.
    Png,
    /// The raw float frames as a safetensors file (tensor `frames`).
    Safetensors,
}

impl OutputType {
    /// The file extension: of the output file, or for `Png` of every frame file in the output folder.
    pub fn extension(self) -> &'static str {
        match self {
            OutputType::Mp4 => "mp4",
            OutputType::Png => "png",
            OutputType::Safetensors => "safetensors",
        }
    }
}

/// Writes `frames` ([F, H, W, 3] in [0, 1]) as `output_type` to `path` (a folder for `Png`).
/// `fps` is used by MP4 only; `metadata` becomes MP4 container tags or the safetensors header
/// metadata, and is not stored in PNGs.
pub fn write(
    output_type: OutputType,
    path: &Path,
    frames: &Tensor,
    fps: u32,
    metadata: &[(String, String)],
) -> Result<()> {
    match output_type {
        #[cfg(feature = "mp4")]
        OutputType::Mp4 => write_mp4(path, frames, fps, metadata),
        #[cfg(not(feature = "mp4"))]
        OutputType::Mp4 => {
            let _ = (fps, path);
            anyhow::bail!("this vidgen was built without MP4 support (cargo feature `mp4`); use --output-type png or safetensors")
        }
        OutputType::Png => write_png_frames(path, frames),
        OutputType::Safetensors => write_safetensors_with_metadata(path, frames, metadata),
    }
}

/// Writes the frames as an f32 `[F, H, W, 3]` tensor named `frames`.
pub fn write_safetensors(path: &Path, frames: &Tensor) -> Result<()> {
    write_safetensors_with_metadata(path, frames, &[])
}

/// [`write_safetensors`] with string metadata in the safetensors header.
pub fn write_safetensors_with_metadata(
    path: &Path,
    frames: &Tensor,
    metadata: &[(String, String)],
) -> Result<()> {
    let run = || -> Result<()> {
        let clip = Clip::from_tensor(frames)?;
        let tensor = Tensor::from_vec(
            clip.data,
            (clip.frames, clip.height, clip.width, 3),
            &Device::Cpu,
        )?;
        let temp = Partial::file(path)?;
        let info: HashMap<String, String> = metadata.iter().cloned().collect();
        let info = (!info.is_empty()).then_some(info);
        safetensors::serialize_to_file([("frames", &tensor)], info, temp.path())?;
        temp.commit(path)
    };
    run().with_context(|| format!("writing safetensors {}", path.display()))
}

/// The frames as host f32 values, row-major `[F, H, W, 3]`.
struct Clip {
    frames: usize,
    height: usize,
    width: usize,
    data: Vec<f32>,
}

impl Clip {
    /// Checks the shape and copies the values to the host as f32.
    fn from_tensor(frames: &Tensor) -> Result<Self> {
        let (f, h, w, c) = match frames.dims() {
            &[f, h, w, c] => (f, h, w, c),
            dims => bail!("frames must be [F, H, W, 3], got shape {dims:?}"),
        };
        if c != 3 || f == 0 || h == 0 || w == 0 {
            bail!(
                "frames must be [F, H, W, 3] with F, H, W > 0, got shape {:?}",
                frames.dims()
            );
        }
        let data = frames
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Ok(Self {
            frames: f,
            height: h,
            width: w,
            data,
        })
    }

    /// Frame `i` as interleaved RGB floats.
    fn frame(&self, i: usize) -> &[f32] {
        let n = self.height * self.width * 3;
        &self.data[i * n..(i + 1) * n]
    }
}

/// A temporary file or folder next to its destination that is deleted unless committed.
struct Partial {
    path: PathBuf,
    is_dir: bool,
    armed: bool,
}

impl Partial {
    /// `.<name>.partial` in the destination's folder.
    fn temp_name(dest: &Path) -> Result<PathBuf> {
        let name = dest
            .file_name()
            .with_context(|| format!("{} does not name a file", dest.display()))?;
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        Ok(parent.join(format!(".{}.partial", name.to_string_lossy())))
    }

    /// A temporary file for `dest` (created by the caller's writer).
    fn file(dest: &Path) -> Result<Self> {
        Ok(Self {
            path: Self::temp_name(dest)?,
            is_dir: false,
            armed: true,
        })
    }

    /// A freshly created, empty temporary folder for `dest` (a stale one is replaced).
    fn dir(dest: &Path) -> Result<Self> {
        let path = Self::temp_name(dest)?;
        if path.is_dir() {
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("removing stale {}", path.display()))?;
        }
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self {
            path,
            is_dir: true,
            armed: true,
        })
    }

    fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the finished temporary into place.
    fn commit(mut self, dest: &Path) -> Result<()> {
        std::fs::rename(&self.path, dest)
            .with_context(|| format!("renaming {} to {}", self.path.display(), dest.display()))?;
        self.armed = false;
        Ok(())
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if self.armed {
            // Best effort: the error that got us here is the one worth reporting.
            let _ = if self.is_dir {
                std::fs::remove_dir_all(&self.path)
            } else {
                std::fs::remove_file(&self.path)
            };
        }
    }
}
