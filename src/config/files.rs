//! The files a configuration names: read with a cap on their size, compared by identity.

use std::path::{Path, PathBuf};

/// Reads at most `max` bytes of the file `what` names (`--prompt-file`, `config file`): a
/// larger one, or an endless one such as `/dev/zero`, is an error naming it and the limit, after
/// reading only `max + 1` bytes. Pipes (`<(...)`) are read like files.
pub fn read_capped(what: &str, path: &Path, max: u64) -> anyhow::Result<Vec<u8>> {
    use anyhow::Context;
    use std::io::Read;
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot read {what} {}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {what} {}", path.display()))?;
    if bytes.len() as u64 > max {
        anyhow::bail!(
            "{what} {} is larger than {} MiB (the wrong file, or an endless one such as /dev/zero)",
            path.display(),
            max >> 20
        );
    }
    Ok(bytes)
}

/// Whether `a` and `b` name one file: the same path once made absolute (for files yet to be
/// written), or the same inode (links, `..`, symlinks).
pub fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
    }
    fn absolute(p: &Path) -> Option<PathBuf> {
        if let Ok(c) = std::fs::canonicalize(p) {
            return Some(c);
        }
        let parent = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        Some(std::fs::canonicalize(parent).ok()?.join(p.file_name()?))
    }
    match (absolute(a), absolute(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// The largest side of a conditioning image, in pixels.
const MAX_IMAGE_SIDE: u32 = 1 << 14;
/// The most bytes decoding a conditioning image may allocate.
const MAX_IMAGE_BYTES: u64 = 1 << 30;

/// Why the file at `path` cannot be a conditioning image, if it cannot: it must be a regular
/// file (not a folder, a FIFO or a device) holding a PNG or JPEG that decodes whole within
/// [`MAX_IMAGE_SIDE`] pixels a side and [`MAX_IMAGE_BYTES`] (a decompression bomb, a small file
/// that decodes to gigabytes, is refused from its header).
pub fn check_image(path: &Path) -> Result<(), String> {
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_string(),
        _ => format!("cannot be read: {}", io_reason(&e)),
    })?;
    if meta.is_dir() {
        return Err("is a folder, not an image file".into());
    }
    if !meta.is_file() {
        return Err("is not a regular file (a FIFO, socket or device)".into());
    }
    let mut reader = image::ImageReader::open(path)
        .and_then(|r| r.with_guessed_format())
        .map_err(|e| format!("cannot be read: {}", io_reason(&e)))?;
    if !matches!(
        reader.format(),
        Some(image::ImageFormat::Png | image::ImageFormat::Jpeg)
    ) {
        return Err("is not a PNG or JPEG image".into());
    }
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    limits.max_alloc = Some(MAX_IMAGE_BYTES);
    reader.limits(limits);
    match reader.decode() {
        Ok(_) => Ok(()),
        Err(image::ImageError::Limits(_)) => Err(format!(
            "is larger than {MAX_IMAGE_SIDE} pixels a side or {} GiB decoded",
            MAX_IMAGE_BYTES >> 30
        )),
        Err(e) => Err(format!(
            "does not decode: {}",
            e.to_string().trim_end_matches('.')
        )),
    }
}

/// An I/O error's reason without the OS's error number (`Permission denied`).
fn io_reason(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error") {
        Some(end) => text[..end].to_string(),
        None => text,
    }
}
