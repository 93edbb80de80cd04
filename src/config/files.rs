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
