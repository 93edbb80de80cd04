//! Weights page-locked where they already are: the pages of the memory map (the file's page
//! cache) that hold a set of tensors, registered with the CUDA driver in place, so copies read
//! them asynchronously at link speed with no host copy and no second host image. Registering
//! pages already in the page cache runs at 13-36 GiB/s on the H200 host, where filling an arena
//! and locking it runs at ~1.4 GiB/s per thread (`bench/RESULTS.md`, session 12).

use std::ops::Range;

/// Largest piece registered by one task: pieces register in parallel, and a copy can start once
/// the piece holding its bytes is locked.
pub const PIECE_BYTES: usize = 256 << 20;

/// The page-aligned address ranges that cover `ranges` (byte ranges, in any order), merged where
/// they share or touch a page (a page can be registered once only), then cut into pieces of at
/// most `piece` bytes (a multiple of `page`).
pub fn page_pieces(
    ranges: impl IntoIterator<Item = Range<usize>>,
    page: usize,
    piece: usize,
) -> Vec<Range<usize>> {
    assert!(page.is_power_of_two() && piece >= page && piece.is_multiple_of(page));
    let mut spans: Vec<Range<usize>> = ranges
        .into_iter()
        .filter(|r| !r.is_empty())
        .map(|r| r.start / page * page..r.end.next_multiple_of(page))
        .collect();
    spans.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<usize>> = Vec::with_capacity(spans.len());
    for span in spans {
        match merged.last_mut() {
            Some(last) if span.start <= last.end => last.end = last.end.max(span.end),
            _ => merged.push(span),
        }
    }
    merged
        .into_iter()
        .flat_map(|run| {
            (run.start..run.end)
                .step_by(piece)
                .map(move |start| start..(start + piece).min(run.end))
        })
        .collect()
}

/// The parts of `ranges` inside `piece`, as (index into `ranges`, the overlapping byte range).
pub fn overlaps<'a>(
    ranges: &'a [Range<usize>],
    piece: &'a Range<usize>,
) -> impl Iterator<Item = (usize, Range<usize>)> + 'a {
    ranges.iter().enumerate().filter_map(|(i, r)| {
        let (start, end) = (r.start.max(piece.start), r.end.min(piece.end));
        (start < end).then_some((i, start..end))
    })
}

#[cfg(feature = "cuda")]
pub use cuda::LockedMap;

#[cfg(feature = "cuda")]
mod cuda {
    use super::{page_pieces, PIECE_BYTES};
    use anyhow::{Context, Result};
    use cudarc::driver::{sys, CudaContext};
    use rayon::prelude::*;
    use std::ops::Range;
    use std::sync::Arc;

    /// Pages of a memory map, page-locked in place (read-only) until dropped. The owner keeps
    /// the mapping alive longer than this, and no copy from it pending when it drops.
    pub struct LockedMap {
        pieces: Vec<Range<usize>>,
        ctx: Arc<CudaContext>,
    }

    impl LockedMap {
        /// Locks the pages holding `ranges` (addresses in a live read-only mapping), pieces in
        /// parallel; `then(piece)` runs as soon as a piece is locked (e.g. to start the copies
        /// of the bytes in it). Returns what locked, and whether every piece did: copies started
        /// from the pieces that locked must complete before the map drops.
        pub fn lock(
            ranges: impl IntoIterator<Item = Range<usize>>,
            ctx: &Arc<CudaContext>,
            then: impl Fn(&Range<usize>) -> Result<()> + Sync,
        ) -> (Self, Result<()>) {
            // SAFETY: sysconf has no preconditions.
            let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
                .ok()
                .filter(|p| p.is_power_of_two())
                .unwrap_or(4096);
            let pieces = page_pieces(ranges, page, PIECE_BYTES);
            let results: Vec<(bool, Result<()>)> = pieces
                .par_iter()
                .map(|piece| {
                    let registered =
                        ctx.bind_to_thread()
                            .map_err(anyhow::Error::from)
                            .and_then(|()| {
                                // SAFETY: the piece lies in whole pages of a live mapping (the caller's
                                // promise); unregistered in `drop`.
                                unsafe {
                                    sys::cuMemHostRegister_v2(
                                        piece.start as *mut std::ffi::c_void,
                                        piece.len(),
                                        sys::CU_MEMHOSTREGISTER_READ_ONLY,
                                    )
                                }
                                .result()
                                .with_context(|| {
                                    format!("page-locking {} bytes of the memory map", piece.len())
                                })
                            });
                    match registered {
                        Ok(()) => (true, then(piece)),
                        Err(e) => (false, Err(e)),
                    }
                })
                .collect();
            let mut outcome = Ok(());
            let mut locked = Vec::with_capacity(pieces.len());
            for (piece, (registered, result)) in pieces.into_iter().zip(results) {
                if registered {
                    locked.push(piece);
                }
                if let (Err(e), Ok(())) = (result, &outcome) {
                    outcome = Err(e);
                }
            }
            let map = LockedMap {
                pieces: locked,
                ctx: ctx.clone(),
            };
            (map, outcome)
        }

        /// Bytes locked (whole pages).
        pub fn bytes(&self) -> usize {
            self.pieces.iter().map(Range::len).sum()
        }
    }

    impl Drop for LockedMap {
        fn drop(&mut self) {
            if self.ctx.bind_to_thread().is_ok() {
                for piece in &self.pieces {
                    // SAFETY: registered in `new`; the owner has no copy from it pending.
                    let _ =
                        unsafe { sys::cuMemHostUnregister(piece.start as *mut std::ffi::c_void) };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranges are widened to whole pages, merged where they share or touch a page, and long runs
    /// cut into pieces of at most the piece size; nothing outside the ranges' pages is covered.
    #[test]
    fn pieces_cover_the_ranges_pages_once() {
        let pieces = page_pieces(
            [4100..4200, 0..10, 4090..4100, 20_000..20_000, 9000..30_000],
            4096,
            8192,
        );
        // 0..10 and 4090..4100 share the first page, 4100..4200 is the second, 9000..30000 pages
        // 8192..32768 touch them: one run 0..32768, cut every 8192.
        assert_eq!(pieces, [0..8192, 8192..16384, 16384..24576, 24576..32768]);
        let pieces = page_pieces([100..200, 70_000..70_001], 4096, 1 << 20);
        assert_eq!(pieces, [0..4096, 69_632..73_728]);
        assert!(page_pieces(std::iter::once(5..5), 4096, 4096).is_empty());
    }

    /// Each range's bytes inside a piece, and only those.
    #[test]
    fn overlaps_are_the_intersections() {
        let ranges = [0..10, 10..30, 40..50];
        let got: Vec<_> = overlaps(&ranges, &(5..41)).collect();
        assert_eq!(got, [(0, 5..10), (1, 10..30), (2, 40..41)]);
        assert_eq!(overlaps(&ranges, &(30..40)).count(), 0);
    }
}
