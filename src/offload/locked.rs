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

#[cfg(feature = "cuda")]
pub use cuda::{register, unregister, LockedMap};

#[cfg(feature = "cuda")]
mod cuda {
    use super::page_runs;
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

    /// Pages of a memory map, page-locked in place (read-only) until dropped. The owner keeps
    /// the mapping alive longer than this, and no copy from it pending when it drops.
    pub struct LockedMap {
        runs: Vec<Range<usize>>,
        ctx: Arc<CudaContext>,
    }

    impl LockedMap {
        /// Locks the pages holding `ranges` (addresses in a live read-only mapping), runs in
        /// parallel. On any failure, what did lock is released again.
        pub fn lock(
            ranges: impl IntoIterator<Item = Range<usize>>,
            ctx: &Arc<CudaContext>,
        ) -> Result<Self> {
            // SAFETY: sysconf has no preconditions.
            let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
                .ok()
                .filter(|p| p.is_power_of_two())
                .context("reading the host page size")?;
            let runs = page_runs(ranges, page);
            let results: Vec<Result<()>> = runs
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
            let mut locked = Vec::with_capacity(runs.len());
            for (run, result) in runs.into_iter().zip(results) {
                match result {
                    Ok(()) => locked.push(run),
                    Err(e) => failure = failure.or(Some(e)),
                }
            }
            let map = LockedMap {
                runs: locked,
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
    }

    impl Drop for LockedMap {
        fn drop(&mut self) {
            // The owner has no copy from the runs pending.
            for run in &self.runs {
                unregister(&self.ctx, run.start);
            }
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
}
