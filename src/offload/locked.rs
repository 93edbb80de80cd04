//! Weights page-locked where they already are: the pages of the memory map (the file's page
//! cache) that hold a set of tensors, registered with the CUDA driver in place, so copies read
//! them asynchronously at link speed with no host copy and no second host image. Registering
//! pages already in the page cache ran at 13.5 GiB/s (tmpfs) to 36 GiB/s (a disk file's page
//! cache) on the H200 host, where filling an arena runs at ~1.4 GiB/s per thread before it is
//! locked (`bench/RESULTS.md`, session 12).

use std::ops::Range;

/// The page-aligned address runs that cover `ranges` (byte ranges, in any order), merged where
/// they share or touch a page: a page can be registered once only, and a copy must read from a
/// single registration, so each run is registered whole.
pub fn page_runs(ranges: impl IntoIterator<Item = Range<usize>>, page: usize) -> Vec<Range<usize>> {
    assert!(page.is_power_of_two());
    let mut spans: Vec<Range<usize>> = ranges
        .into_iter()
        .filter(|r| !r.is_empty())
        .map(|r| r.start / page * page..r.end.next_multiple_of(page))
        .collect();
    spans.sort_by_key(|r| r.start);
    let mut runs: Vec<Range<usize>> = Vec::with_capacity(spans.len());
    for span in spans {
        match runs.last_mut() {
            Some(last) if span.start <= last.end => last.end = last.end.max(span.end),
            _ => runs.push(span),
        }
    }
    runs
}

/// Largest single registration: a run of the map is locked in pieces of this many bytes, by
/// threads in parallel (the pages of a whole file make one run, which one call locked at
/// 13.5 GiB/s on tmpfs); a copy that spans two pieces is issued as two ([`LockedMap::pieces`]).
pub const LOCK_PIECE: usize = 128 << 20;

/// `runs` cut into consecutive pieces of at most `piece` bytes (a multiple of the page size).
pub fn split_runs(runs: Vec<Range<usize>>, piece: usize) -> Vec<Range<usize>> {
    assert!(piece > 0);
    runs.into_iter()
        .flat_map(|run| {
            (run.start..run.end)
                .step_by(piece)
                .map(move |a| a..(a + piece).min(run.end))
        })
        .collect()
}

/// `range` cut where the pieces of `runs` (sorted, disjoint) end, so each part lies in one piece
/// (a part outside every piece is left whole).
pub fn cut_at_run_ends(runs: &[Range<usize>], range: Range<usize>) -> Vec<Range<usize>> {
    let mut parts = Vec::new();
    let mut at = range.start;
    while at < range.end {
        let k = runs.partition_point(|r| r.end <= at);
        let stop = match runs.get(k) {
            Some(run) if run.start <= at => run.end.min(range.end),
            _ => range.end,
        };
        parts.push(at..stop);
        at = stop;
    }
    parts
}

/// `run` cut where the pieces of `registered` (sorted, disjoint) begin and end: each part with
/// whether it lies in one of them (registered already) or in none (free to register).
pub fn split_by_registered(
    registered: &[Range<usize>],
    run: Range<usize>,
) -> Vec<(Range<usize>, bool)> {
    let mut parts = Vec::new();
    let mut at = run.start;
    let first = registered.partition_point(|r| r.end <= run.start);
    for r in registered[first..].iter().take_while(|r| r.start < run.end) {
        if r.start > at {
            parts.push((at..r.start, false));
        }
        let end = r.end.min(run.end);
        if end > at.max(r.start) {
            parts.push((at.max(r.start)..end, true));
        }
        at = at.max(end);
    }
    if at < run.end {
        parts.push((at..run.end, false));
    }
    parts
}

#[cfg(feature = "cuda")]
pub use cuda::{register, unregister, LockedMap};

#[cfg(feature = "cuda")]
mod cuda {
    use super::{cut_at_run_ends, page_runs, split_by_registered, split_runs};
    use anyhow::{Context, Result};
    use cudarc::driver::{sys, CudaContext, DriverError};
    use rayon::prelude::*;
    use std::ops::Range;
    use std::sync::Arc;

    /// Page-locks host memory `range` with the driver (`flags` as `cuMemHostRegister` takes them).
    ///
    /// # Safety
    /// `range` is whole pages of a live mapping that stays mapped until [`unregister`].
    pub unsafe fn register(
        ctx: &CudaContext,
        range: &Range<usize>,
        flags: u32,
    ) -> std::result::Result<(), DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: the caller's promise.
        unsafe {
            sys::cuMemHostRegister_v2(range.start as *mut std::ffi::c_void, range.len(), flags)
        }
        .result()
    }

    /// Releases memory that [`register`] page-locked at `start` (no copy from it may be pending).
    pub fn unregister(ctx: &CudaContext, start: usize) {
        if ctx.bind_to_thread().is_ok() {
            // SAFETY: a failed call (nothing registered there) only returns an error.
            let _ = unsafe { sys::cuMemHostUnregister(start as *mut std::ffi::c_void) };
        }
    }

    /// The pieces of host memory this process registered through [`LockedMap`], sorted by
    /// address and disjoint. Two stores of one component read one mapping (a parked outer part
    /// and the streamed blocks), and the page where one's tensors end and the other's begin is
    /// theirs both: a page can be registered once, so the second reads it where the first
    /// registered it.
    static REGISTERED: std::sync::Mutex<Vec<Range<usize>>> = std::sync::Mutex::new(Vec::new());

    fn registered() -> std::sync::MutexGuard<'static, Vec<Range<usize>>> {
        REGISTERED.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pages of a memory map, page-locked in place (read-only) until dropped. The owner keeps
    /// the mapping alive longer than this, and no copy from it pending when it drops.
    pub struct LockedMap {
        /// Every piece holding the ranges, each inside one registration (a copy is cut at
        /// their ends).
        runs: Vec<Range<usize>>,
        /// The pieces this map registered (the others another map registered first); released
        /// when it drops.
        owned: Vec<Range<usize>>,
        ctx: Arc<CudaContext>,
    }

    impl LockedMap {
        /// Locks the pages holding `ranges` (addresses in a live read-only mapping) in pieces of
        /// at most `piece` bytes (a multiple of the page size), in parallel. On any failure,
        /// what did lock is released again.
        pub fn lock(
            ranges: impl IntoIterator<Item = Range<usize>>,
            piece: usize,
            ctx: &Arc<CudaContext>,
        ) -> Result<Self> {
            // SAFETY: sysconf has no preconditions.
            let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
                .ok()
                .filter(|p| p.is_power_of_two())
                .context("reading the host page size")?;
            let pieces = split_runs(page_runs(ranges, page), piece.next_multiple_of(page));
            // Held while registering, so no other map takes a page this one finds free.
            let mut registry = registered();
            let (mut runs, mut free) = (Vec::new(), Vec::new());
            for piece in pieces {
                for (part, taken) in split_by_registered(&registry, piece) {
                    if !taken {
                        free.push(part.clone());
                    }
                    runs.push(part);
                }
            }
            let results: Vec<Result<()>> = free
                .par_iter()
                .map(|run| {
                    // SAFETY: the run is whole pages of a live mapping (the caller's promise);
                    // unregistered in `drop`.
                    unsafe { register(ctx, run, sys::CU_MEMHOSTREGISTER_READ_ONLY) }.with_context(
                        || format!("page-locking {} bytes of the memory map", run.len()),
                    )
                })
                .collect();
            let mut failure = None;
            let mut owned = Vec::with_capacity(free.len());
            for (run, result) in free.into_iter().zip(results) {
                match result {
                    Ok(()) => owned.push(run),
                    Err(e) => failure = failure.or(Some(e)),
                }
            }
            registry.extend(owned.iter().cloned());
            registry.sort_by_key(|r| r.start);
            drop(registry);
            let map = LockedMap {
                runs,
                owned,
                ctx: ctx.clone(),
            };
            match failure {
                // Dropping `map` releases the runs that did lock.
                Some(e) => Err(e),
                None => Ok(map),
            }
        }

        /// Bytes locked (whole pages).
        pub fn bytes(&self) -> usize {
            self.runs.iter().map(Range::len).sum()
        }

        /// `bytes` (inside the locked pages) cut where a registration ends: a copy must read
        /// from one registration.
        pub fn pieces<'a>(&self, bytes: &'a [u8]) -> Vec<&'a [u8]> {
            let start = bytes.as_ptr() as usize;
            cut_at_run_ends(&self.runs, start..start + bytes.len())
                .into_iter()
                .map(|r| &bytes[r.start - start..r.end - start])
                .collect()
        }
    }

    impl Drop for LockedMap {
        /// Unlocks on the teardown thread, queued before the owner's mapping is (its pages
        /// stay in the page cache: nothing is given back).
        fn drop(&mut self) {
            // The owner has no copy from the runs pending.
            let (owned, ctx) = (std::mem::take(&mut self.owned), self.ctx.clone());
            crate::teardown::later(0, move || {
                for run in &owned {
                    unregister(&ctx, run.start);
                }
                registered().retain(|r| !owned.contains(r));
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranges are widened to whole pages and merged where they share or touch a page; nothing
    /// outside the ranges' pages is covered.
    #[test]
    fn runs_cover_the_ranges_pages_once() {
        // 0..10 and 4090..4100 share the first page, 4100..4200 is the second, 9000..30000 is
        // pages 8192..32768, touching them: one run. 40000..40001 stands alone.
        let runs = page_runs(
            [
                4100..4200,
                0..10,
                40_000..40_001,
                4090..4100,
                20_000..20_000,
                9000..30_000,
            ],
            4096,
        );
        assert_eq!(runs, [0..32_768, 36_864..40_960]);
        assert!(page_runs(std::iter::once(5..5), 4096).is_empty());
    }

    /// A run is cut where registered pieces begin and end: the parts cover it exactly, in
    /// order, those inside a registered piece marked taken.
    #[test]
    fn runs_are_split_around_what_is_registered() {
        let registered = [0..4096, 8192..16_384, 20_480..24_576, 40_960..45_056];
        assert_eq!(
            split_by_registered(&registered, 4096..28_672),
            [
                (4096..8192, false),
                (8192..16_384, true),
                (16_384..20_480, false),
                (20_480..24_576, true),
                (24_576..28_672, false),
            ]
        );
        // Inside one piece, starting inside one, or touching none.
        assert_eq!(
            split_by_registered(&registered, 12_288..16_384),
            [(12_288..16_384, true)]
        );
        assert_eq!(
            split_by_registered(&registered, 12_288..20_480),
            [(12_288..16_384, true), (16_384..20_480, false)]
        );
        assert_eq!(
            split_by_registered(&registered, 28_672..32_768),
            [(28_672..32_768, false)]
        );
        assert_eq!(split_by_registered(&[], 0..4096), [(0..4096, false)]);
    }

    /// Runs split into pieces of at most the piece size, covering the runs exactly; a range cut
    /// at the pieces' ends gives parts inside one piece each that put the range back together.
    #[test]
    fn ranges_are_cut_where_registrations_end() {
        let pieces = split_runs(vec![0..32_768, 36_864..40_960], 12_288);
        assert_eq!(
            pieces,
            [0..12_288, 12_288..24_576, 24_576..32_768, 36_864..40_960]
        );
        assert_eq!(
            cut_at_run_ends(&pieces, 100..30_000),
            [100..12_288, 12_288..24_576, 24_576..30_000]
        );
        let within = cut_at_run_ends(&pieces, 12_288..12_289);
        assert!(within.len() == 1 && within[0] == (12_288..12_289));
        assert!(cut_at_run_ends(&pieces, 37_000..37_000).is_empty());
        // Past the last piece's end, or in a gap: left whole.
        assert_eq!(
            cut_at_run_ends(&pieces, 32_000..36_900),
            [32_000..32_768, 32_768..36_900]
        );
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    use super::LockedMap;
    use anyhow::Result;
    use candle_core::Device;
    use cudarc::driver::{CudaStream, DevicePtrMut};
    use std::sync::Arc;

    /// `pieces` copied to the device one after the other, one copy each, and read back.
    fn copied(stream: &Arc<CudaStream>, pieces: &[&[u8]]) -> Result<Vec<u8>> {
        let len = pieces.iter().map(|p| p.len()).sum();
        let mut on_device = stream.alloc_zeros::<u8>(len)?;
        {
            let (mut at, _guard) = on_device.device_ptr_mut(stream);
            for piece in pieces {
                // SAFETY: the buffer holds every piece's bytes; the caller's map outlives the
                // copies (synchronized below).
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(at, piece, stream.cu_stream())
                }?;
                at += piece.len() as u64;
            }
        }
        stream.synchronize()?;
        Ok(stream.clone_dtoh(&on_device)?)
    }

    /// A file of `len` bytes (byte i is `i * step % 251`) written for one test and mapped.
    fn mapped_file(
        name: &str,
        len: usize,
        step: usize,
    ) -> Result<(std::path::PathBuf, memmap2::Mmap)> {
        let path = std::env::temp_dir().join(format!("vidgen-{name}-{}", std::process::id()));
        let content: Vec<u8> = (0..len).map(|i| (i * step % 251) as u8).collect();
        std::fs::write(&path, &content)?;
        let file = std::fs::File::open(&path)?;
        // SAFETY: the test's own file, not written while mapped.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        Ok((path, map))
    }

    /// Locked in pieces of one page, bytes that span many pieces copy to the device piece by
    /// piece and arrive as they are in the file.
    #[test]
    fn copies_across_registrations_arrive_whole() -> Result<()> {
        let Device::Cuda(dev) = Device::new_cuda(0)? else {
            unreachable!()
        };
        let page = 4096;
        let (path, map) = mapped_file("pieces", 5 * page + 123, 7)?;
        let bytes = &map[1000..map.len() - 77];
        let start = bytes.as_ptr() as usize;
        let stream = dev.cuda_stream();
        let locked = LockedMap::lock(
            std::iter::once(start..start + bytes.len()),
            page,
            stream.context(),
        )?;
        let pieces = locked.pieces(bytes);
        assert!(pieces.len() >= 5, "{} pieces", pieces.len());
        assert!(copied(&stream, &pieces)? == bytes);
        drop(locked);
        // Unlocked (on the teardown thread) before it is unmapped.
        crate::teardown::finish();
        drop(map);
        std::fs::remove_file(&path)?;
        Ok(())
    }

    /// Two maps over one mapping whose ranges share a page (a parked outer part and streamed
    /// blocks whose tensors meet mid-page) both lock: the second reads the shared page where
    /// the first registered it, its copies cut there, and every byte arrives.
    #[test]
    fn maps_that_share_a_page_both_lock() -> Result<()> {
        let Device::Cuda(dev) = Device::new_cuda(0)? else {
            unreachable!()
        };
        let page = 4096;
        let (path, map) = mapped_file("shared", 6 * page, 13)?;
        let start = map.as_ptr() as usize;
        let stream = dev.cuda_stream();
        // The first ends, and the second begins, inside page 2.
        let (first, second) = (
            &map[100..2 * page + 500],
            &map[2 * page + 500..6 * page - 9],
        );
        let range = |b: &[u8]| b.as_ptr() as usize..b.as_ptr() as usize + b.len();
        let a = LockedMap::lock(std::iter::once(range(first)), page, stream.context())?;
        let b = LockedMap::lock(std::iter::once(range(second)), page, stream.context())?;
        assert_eq!(a.bytes(), 3 * page);
        assert_eq!(b.bytes(), 4 * page);
        // The second's first piece is the shared page, registered by the first.
        let pieces = b.pieces(second);
        assert_eq!(pieces[0].as_ptr() as usize, start + 2 * page + 500);
        assert_eq!(pieces[0].len(), page - 500);
        assert!(copied(&stream, &pieces)? == second);
        drop((a, b));
        crate::teardown::finish();
        // Every page is free to lock again.
        let again = LockedMap::lock(
            std::iter::once(start..start + map.len()),
            page,
            stream.context(),
        )?;
        assert_eq!(again.bytes(), 6 * page);
        drop(again);
        crate::teardown::finish();
        drop(map);
        std::fs::remove_file(&path)?;
        Ok(())
    }
}
