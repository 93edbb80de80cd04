//! Writers for the generated frames: MP4, PNG folders and safetensors.
//!
//! Every writer takes frames as an `[F, H, W, 3]` tensor in [0, 1] (any dtype, any device), writes
//! to a hidden temporary name next to the destination and renames it into place only when the
//! output is complete, so an interrupted or failed run never leaves a half-written file behind.

mod audio;
#[cfg(feature = "mp4")]
mod mp4;
mod png;

pub use audio::{write_wav, Audio, WAV_NAME};
#[cfg(feature = "mp4")]
pub use mp4::write_mp4;
pub use png::{write_png_frames, write_png_image};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// The denoised latents before the VAE as a safetensors file (tensor `latents`): diffusers'
    /// `output_type="latent"`; the decode stage does not run.
    Latent,
}

impl OutputType {
    /// The file extension: of the output file, or for `Png` of every frame file in the output folder.
    /// Latents get their own (`.latents.safetensors`), so `--resume` never takes a frames file
    /// of the same name for finished latents, or the other way round.
    pub fn extension(self) -> &'static str {
        match self {
            OutputType::Mp4 => "mp4",
            OutputType::Png => "png",
            OutputType::Safetensors => "safetensors",
            OutputType::Latent => "latents.safetensors",
        }
    }
}

/// Writes `frames` ([F, H, W, 3] in [0, 1]) as `output_type` to `path` (a folder for `Png`).
/// `fps` is used by MP4 only; `metadata` becomes MP4 container tags or the safetensors header
/// metadata, and is not stored in PNGs. An existing file at `path` is replaced.
pub fn write(
    output_type: OutputType,
    path: &Path,
    frames: &Tensor,
    fps: u32,
    metadata: &[(String, String)],
) -> Result<()> {
    write_with(output_type, path, frames, fps, metadata, true)
}

/// [`write`], replacing what is at `path` only when `replace`: otherwise a file that appeared
/// there meanwhile (another run writing the same name) is kept and reported as an error.
pub fn write_with(
    output_type: OutputType,
    path: &Path,
    frames: &Tensor,
    fps: u32,
    metadata: &[(String, String)],
    replace: bool,
) -> Result<()> {
    write_with_beside(
        output_type,
        path,
        frames,
        Beside::default(),
        fps,
        metadata,
        replace,
    )
}

/// What is written beside the frames.
#[derive(Default, Clone, Copy)]
pub struct Beside<'a> {
    /// The sound of a model that makes it: MP4 gets an AAC track of the video's length,
    /// safetensors an `audio` tensor `[channels, samples]`, a PNG folder a WAV file
    /// ([`WAV_NAME`]).
    pub audio: Option<&'a Audio>,
    /// Named tensors for the safetensors output only (a step cache's record); u8 tensors stay
    /// u8, others are written as f32.
    pub tensors: &'a [(String, Tensor)],
}

/// [`write_with`] with what goes `beside` the frames.
pub fn write_with_beside(
    output_type: OutputType,
    path: &Path,
    frames: &Tensor,
    beside: Beside,
    fps: u32,
    metadata: &[(String, String)],
    replace: bool,
) -> Result<()> {
    let audio = beside.audio;
    match output_type {
        #[cfg(feature = "mp4")]
        OutputType::Mp4 => mp4::write_mp4_with(path, frames, audio, fps, metadata, replace),
        #[cfg(not(feature = "mp4"))]
        OutputType::Mp4 => {
            let _ = (fps, path, replace, audio);
            anyhow::bail!("this vidgen was built without MP4 support (cargo feature `mp4`); use --output-type png or safetensors")
        }
        OutputType::Png => png::write_png_frames_with(path, frames, audio, replace),
        OutputType::Safetensors => write_safetensors_inner(path, frames, beside, metadata, replace),
        OutputType::Latent => bail!("--output-type latent writes latents, not frames"),
    }
}

/// Writes `latents` (any shape, as f32) as a safetensors tensor named `latents`, with `metadata`
/// in the header (`--output-type latent`); replaces what is at `path` only when `replace`.
pub fn write_latents(
    path: &Path,
    latents: &Tensor,
    metadata: &[(String, String)],
    replace: bool,
) -> Result<()> {
    let run = || -> Result<()> {
        let temp = Partial::reserved(path)?;
        serialize_f32(&[("latents", latents)], metadata, temp.path())?;
        temp.commit(path, replace)
    };
    run().with_context(|| format!("writing latents {}", path.display()))
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
    write_safetensors_inner(path, frames, Beside::default(), metadata, true)
}

fn write_safetensors_inner(
    path: &Path,
    frames: &Tensor,
    beside: Beside,
    metadata: &[(String, String)],
    replace: bool,
) -> Result<()> {
    let run = || -> Result<()> {
        let clip = Clip::from_tensor(frames)?;
        let temp = Partial::reserved(path)?;
        let mut tensors = vec![("frames", &clip.values)];
        tensors.extend(beside.audio.map(|a| ("audio", a.samples())));
        tensors.extend(beside.tensors.iter().map(|(n, t)| (n.as_str(), t)));
        serialize_f32(&tensors, metadata, temp.path())?;
        temp.commit(path, replace)
    };
    run().with_context(|| format!("writing safetensors {}", path.display()))
}

/// One tensor's values as safetensors stores them (little-endian): f32 borrowed from host
/// storage, or u8.
struct HostBytes<'a> {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: std::borrow::Cow<'a, [u8]>,
}

impl safetensors::View for HostBytes<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes `tensors` as safetensors at `path`, with `metadata` in the header: u8 tensors as u8,
/// the others as f32 straight from their host storage (candle's own `View` copies a tensor
/// twice before it is written: a 480x832x81 video is 388 MB).
fn serialize_f32(
    tensors: &[(&str, &Tensor)],
    metadata: &[(String, String)],
    path: &Path,
) -> Result<()> {
    let host = tensors
        .iter()
        .map(|(_, t)| {
            let t = t.to_device(&Device::Cpu)?;
            match t.dtype() {
                DType::U8 => t.contiguous(),
                _ => t.to_dtype(DType::F32)?.contiguous(),
            }
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let held: Vec<_> = host.iter().map(|t| t.storage_and_layout()).collect();
    let views = held
        .iter()
        .zip(&host)
        .map(|((storage, layout), t)| {
            let shape = t.dims().to_vec();
            if t.dtype() == DType::U8 {
                let bytes = t.flatten_all()?.to_vec1::<u8>()?;
                return Ok(HostBytes {
                    dtype: safetensors::Dtype::U8,
                    shape,
                    bytes: std::borrow::Cow::Owned(bytes),
                });
            }
            let values = host_f32(storage, layout.start_offset(), t.elem_count())?;
            // SAFETY: f32 has no padding and every byte pattern is a valid u8; the bytes are
            // read as safetensors' little-endian f32 on the little-endian hosts vidgen builds for.
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    values.as_ptr().cast::<u8>(),
                    std::mem::size_of_val(values),
                )
            };
            Ok(HostBytes {
                dtype: safetensors::Dtype::F32,
                shape,
                bytes: std::borrow::Cow::Borrowed(bytes),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let info: HashMap<String, String> = metadata.iter().cloned().collect();
    let info = (!info.is_empty()).then_some(info);
    let named = tensors.iter().map(|(name, _)| *name).zip(views);
    safetensors::serialize_to_file(named, info, path)?;
    Ok(())
}

/// The frames as host f32 values, row-major `[F, H, W, 3]`: the caller's tensor itself when it
/// is one already (a whole video is not copied to be written), else one converted copy.
struct Clip {
    frames: usize,
    height: usize,
    width: usize,
    values: Tensor,
}

impl Clip {
    /// Checks the shape and brings the values to the host as contiguous f32.
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
        let values = frames
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .contiguous()?;
        Ok(Self {
            frames: f,
            height: h,
            width: w,
            values,
        })
    }

    /// `f` of frame `i` as interleaved RGB floats.
    fn with_frame<R>(&self, i: usize, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        let n = self.height * self.width * 3;
        let (storage, layout) = self.values.storage_and_layout();
        Ok(f(host_f32(&storage, layout.start_offset() + i * n, n)?))
    }
}

/// `len` values of host f32 `storage` from element `start`.
fn host_f32(storage: &candle_core::Storage, start: usize, len: usize) -> Result<&[f32]> {
    match storage {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(all)) => {
            Ok(&all[start..start + len])
        }
        _ => bail!("the values are not f32 in host memory"),
    }
}

/// A temporary file or folder next to its destination that is deleted unless committed.
struct Partial {
    path: PathBuf,
    is_dir: bool,
    armed: bool,
}

/// Tells apart the temporary files of one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Partial {
    /// `.<name>.<pid>-<n>.partial` in the destination's folder: unique to this process and
    /// call, so two runs (or two threads) writing one name never share a temporary.
    fn temp_name(dest: &Path) -> Result<PathBuf> {
        let name = dest
            .file_name()
            .with_context(|| format!("{} does not name a file", dest.display()))?;
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        Ok(parent.join(format!(
            ".{}.{}-{n}.partial",
            name.to_string_lossy(),
            std::process::id()
        )))
    }

    /// A freshly and exclusively created, empty temporary file for `dest`.
    fn file(dest: &Path) -> Result<Self> {
        loop {
            let path = Self::temp_name(dest)?;
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(_) => {
                    return Ok(Self {
                        path,
                        is_dir: false,
                        armed: true,
                    })
                }
                // A leftover of an earlier process with this pid: take the next number.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
            }
        }
    }

    /// A temporary name for `dest` that nothing holds, for a writer that makes a temporary of
    /// its own and renames it there (safetensors' `serialize_to_file`): renamed onto an existing
    /// file, even an empty one, ext4 writes the new file's data out at once (its
    /// `auto_da_alloc`), 0.1-0.15 s more for a 388 MB video. The name is taken exclusively and
    /// let go, so no other writer of this process or a leftover shares it.
    fn reserved(dest: &Path) -> Result<Self> {
        let temp = Self::file(dest)?;
        std::fs::remove_file(&temp.path)
            .with_context(|| format!("removing {}", temp.path.display()))?;
        Ok(temp)
    }

    /// A freshly and exclusively created, empty temporary folder for `dest`.
    fn dir(dest: &Path) -> Result<Self> {
        loop {
            let path = Self::temp_name(dest)?;
            match std::fs::create_dir(&path) {
                Ok(()) => {
                    return Ok(Self {
                        path,
                        is_dir: true,
                        armed: true,
                    })
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
            }
        }
    }

    fn path(&self) -> &Path {
        &self.path
    }

    /// Moves the finished temporary into place: over what is there when `replace`, otherwise
    /// only if nothing is there (a file another run wrote meanwhile is kept and reported).
    fn commit(mut self, dest: &Path, replace: bool) -> Result<()> {
        let exists = || {
            anyhow::anyhow!(
                "{} already exists (another run wrote it meanwhile); kept it; pass --overwrite to replace it",
                dest.display()
            )
        };
        if !replace && !self.is_dir {
            // A hard link fails if `dest` exists: an atomic "rename unless taken".
            match std::fs::hard_link(&self.path, dest) {
                Ok(()) => {
                    // Dropping `self` (still armed) removes the temporary name.
                    return Ok(());
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Err(exists()),
                // A file system without hard links: check, then rename.
                Err(_) if dest.symlink_metadata().is_ok() => return Err(exists()),
                Err(_) => {}
            }
        }
        if !replace && self.is_dir && dest.symlink_metadata().is_ok() && !is_empty_dir(dest) {
            return Err(exists());
        }
        if replace && self.is_dir && dest.symlink_metadata().is_ok() && !is_empty_dir(dest) {
            return self.swap_into(dest);
        }
        if let Err(e) = std::fs::rename(&self.path, dest) {
            // A folder another run put there between the check and the rename.
            if !replace && dest.symlink_metadata().is_ok() {
                return Err(exists());
            }
            return Err(e).with_context(|| {
                format!("renaming {} to {}", self.path.display(), dest.display())
            });
        }
        self.armed = false;
        Ok(())
    }
}

impl Partial {
    /// Replaces what is at `dest` (a folder with files, which a rename cannot replace, or a
    /// file) with this finished folder: the old one is moved aside under a hidden name, the new
    /// one renamed in (on failure the old one is put back), then the old one is removed.
    fn swap_into(mut self, dest: &Path) -> Result<()> {
        let aside = self.path.with_extension("replaced");
        std::fs::rename(dest, &aside)
            .with_context(|| format!("moving the old {} aside to replace it", dest.display()))?;
        if let Err(e) = std::fs::rename(&self.path, dest) {
            // Best effort: the old output goes back; the rename's error is the one to report.
            let _ = std::fs::rename(&aside, dest);
            return Err(e).with_context(|| {
                format!("renaming {} to {}", self.path.display(), dest.display())
            });
        }
        self.armed = false;
        // A link is removed, never followed; the new output is in place either way.
        let removed = match aside.symlink_metadata() {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&aside),
            _ => std::fs::remove_file(&aside),
        };
        removed.with_context(|| format!("removing the replaced output {}", aside.display()))
    }
}

/// Whether `path` is a folder with nothing in it.
fn is_empty_dir(path: &Path) -> bool {
    std::fs::read_dir(path).is_ok_and(|mut entries| entries.next().is_none())
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

/// The name of the file a vidgen temporary was writing and the id of the process that wrote
/// it: `.NAME.PID-N.partial` (an output) or `.NAME.PID.partial` (`--stats-json`); `None` for
/// any other name.
fn temporary_of(name: &str) -> Option<(&str, u32)> {
    let inner = name.strip_prefix('.')?.strip_suffix(".partial")?;
    let (dest, tag) = inner.rsplit_once('.')?;
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let pid = match tag.split_once('-') {
        Some((pid, n)) if digits(n) => pid,
        Some(_) => return None,
        None => tag,
    };
    match (dest.is_empty(), digits(pid)) {
        (false, true) => Some((dest, pid.parse().ok()?)),
        _ => None,
    }
}

/// Whether process `pid` is running (a process that cannot be asked counts as running).
fn running(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return true;
        };
        // SAFETY: signal 0 only asks whether the process exists.
        pid <= 0
            || unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Removes the temporaries in `dir` of the files `wanted` names that vidgen processes no
/// longer running left behind (a run killed by SIGKILL, or by a signal it could not handle)
/// and returns them; those of a running process (another run writing now) stay.
pub fn remove_stale_temporaries(dir: &Path, wanted: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let Some((dest, pid)) = name.to_str().and_then(temporary_of) else {
            continue;
        };
        if !wanted(dest) || running(pid) {
            continue;
        }
        let path = entry.path();
        // A link is removed, never followed.
        let gone = match path.symlink_metadata() {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path),
            _ => std::fs::remove_file(&path),
        };
        if gone.is_ok() {
            removed.push(path);
        }
    }
    removed.sort();
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reserved temporary names nothing on disk (a writer renames its own file there, never
    /// onto an existing one), each reservation another name; one committed becomes the
    /// destination, one dropped leaves nothing.
    #[test]
    fn reserved_temporaries_name_nothing_on_disk() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("vidgen-reserved-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let dest = dir.join("video.safetensors");
        let first = Partial::reserved(&dest)?;
        let second = Partial::reserved(&dest)?;
        for temp in [&first, &second] {
            assert!(!temp.path().exists(), "{}", temp.path().display());
        }
        assert_ne!(first.path(), second.path());
        std::fs::write(first.path(), b"frames")?;
        first.commit(&dest, false)?;
        assert_eq!(std::fs::read(&dest)?, b"frames");
        std::fs::write(second.path(), b"dropped")?;
        drop(second);
        let names: Vec<_> = std::fs::read_dir(&dir)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<std::io::Result<_>>()?;
        assert_eq!(names, vec![std::ffi::OsString::from("video.safetensors")]);
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    /// Only vidgen's temporaries are taken for one: outputs' (`PID-N`) and the stats' (`PID`).
    #[test]
    fn temporaries_are_told_by_their_names() {
        assert_eq!(
            temporary_of(".a_seed1.mp4.42-0.partial"),
            Some(("a_seed1.mp4", 42))
        );
        assert_eq!(
            temporary_of(".stats.json.7.partial"),
            Some(("stats.json", 7))
        );
        for other in [
            "a.mp4",
            ".a.mp4.partial",
            ".a.mp4.x-1.partial",
            ".a.mp4.1-x.partial",
            ".a.mp4.1-.partial",
            "..1-0.partial",
            ".a.mp4.1-0.replaced",
        ] {
            assert_eq!(temporary_of(other), None, "{other}");
        }
    }

    /// Tensors written from their storage read back as the f32 values candle gives, whatever
    /// their dtype and layout (a transposed bf16 view, an offset narrow), with the metadata.
    #[test]
    fn f32_safetensors_hold_the_values_and_metadata() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("vidgen-f32st-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("t.safetensors");
        let base = (Tensor::arange(0u32, 24, &Device::Cpu)?.to_dtype(DType::F32)? * 0.37)?;
        let a = base.reshape((4, 6))?.to_dtype(DType::BF16)?.t()?;
        let b = base.narrow(0, 5, 7)?;
        let metadata = [("k".to_string(), "v".to_string())];
        serialize_f32(&[("a", &a), ("b", &b)], &metadata, &path)?;
        let bytes = std::fs::read(&path)?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)?;
        assert_eq!(
            header
                .metadata()
                .as_ref()
                .and_then(|m| m.get("k"))
                .map(String::as_str),
            Some("v")
        );
        let read = candle_core::safetensors::load(&path, &Device::Cpu)?;
        for (name, want) in [("a", &a), ("b", &b)] {
            let got = &read[name];
            assert_eq!(got.dtype(), DType::F32);
            assert_eq!(got.dims(), want.dims(), "{name}");
            let want = want.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(got.flatten_all()?.to_vec1::<f32>()?, want, "{name}");
        }
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
