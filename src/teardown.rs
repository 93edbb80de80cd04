//! Tearing down large host memory off the run's critical path. Unmapping an 11 GB weight file
//! after its tensors landed on the device cost the loading thread 0.72 s of page-table work (an
//! H200 host, `bench/RESULTS.md` session 30): done on a background thread, in the order queued,
//! it overlaps the next load or stage instead of delaying it. One `munmap` of gigabytes also holds
//! every other thread's `mmap` for its whole length, so the pages go first in pieces
//! ([`discard_pages`]).
//!
//! Teardowns that give memory back (anonymous memory) have a thread of their own, which
//! [`settle`] waits for before anything allocates against a host budget; [`finish`] waits for
//! every teardown before the process exits.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, OnceLock};

type Work = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queue {
    work: VecDeque<Work>,
    /// Teardowns queued or running.
    pending: usize,
    /// Whether the lane's thread runs (it starts with the lane's first teardown).
    started: bool,
}

/// One thread and its queue of teardowns.
#[derive(Default)]
struct Lane {
    queue: Mutex<Queue>,
    /// Signalled when work is queued, and when a teardown ends.
    changed: Condvar,
}

/// The lane of teardowns that give memory back ([`settle`] waits for it alone), and the lane
/// of those that only unmap or unlock pages whose contents stay in the page cache: unlocking a
/// file's pages must come before unmapping them, so each kind keeps its order in its own lane.
fn lane(returns_memory: bool) -> &'static Lane {
    static LANES: OnceLock<[Lane; 2]> = OnceLock::new();
    &LANES.get_or_init(Default::default)[usize::from(returns_memory)]
}

/// Runs `work` on a teardown thread after the teardowns of its kind queued before it;
/// `returns` is the memory it gives back that the system would otherwise count as in use
/// (anonymous memory; 0 for a file's mapping, whose pages stay in the page cache whether
/// mapped or not). Where the thread cannot be started, `work` runs here and now.
pub fn later(returns: u64, work: impl FnOnce() + Send + 'static) {
    let lane = lane(returns > 0);
    let mut q = lane.queue.lock().unwrap_or_else(|e| e.into_inner());
    if !q.started {
        let spawned = std::thread::Builder::new()
            .name("vidgen-teardown".into())
            .spawn(move || run(lane));
        if spawned.is_err() {
            drop(q);
            work();
            return;
        }
        q.started = true;
    }
    q.work.push_back(Box::new(work));
    q.pending += 1;
    lane.changed.notify_all();
}

/// A lane's thread: runs each queued teardown in turn.
fn run(lane: &'static Lane) {
    loop {
        let work = {
            let mut q = lane.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                match q.work.pop_front() {
                    Some(next) => break next,
                    None => q = lane.changed.wait(q).unwrap_or_else(|e| e.into_inner()),
                }
            }
        };
        work();
        let mut q = lane.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.pending -= 1;
        lane.changed.notify_all();
    }
}

/// Waits until `lane` has run everything queued on it.
fn drain(lane: &Lane) {
    let mut q = lane.queue.lock().unwrap_or_else(|e| e.into_inner());
    while q.pending > 0 {
        q = lane.changed.wait(q).unwrap_or_else(|e| e.into_inner());
    }
}

/// Waits until every teardown that gives memory back has run: before a load or a stage that
/// a host budget limits, so memory released earlier is free again.
pub fn settle() {
    drain(lane(true));
}

/// The host room `room()` reads now, and where that is less than `need`, what it reads once the
/// teardowns that give memory back have run ([`settle`]): only then is waiting for them worth
/// it (unlocking a streamed text encoder's 11 GB held up the start of its denoising by 0.3 s).
pub fn room_for(need: u64, room: impl Fn() -> Option<u64>) -> Option<u64> {
    let now = room()?;
    if need <= now {
        return Some(now);
    }
    settle();
    room()
}

/// Waits until every teardown has run (before the process exits, so none is cut short).
pub fn finish() {
    drain(lane(true));
    drain(lane(false));
}

/// Most bytes one call drops from the page tables: a single `munmap` of gigabytes holds every
/// other thread's `mmap` (thread starts, large allocations, the CUDA driver's own) for its whole
/// length; in pieces of this size each waits at most one piece's work (`bench/unmap_stall.c`).
const DISCARD_PIECE: usize = 64 << 20;

/// Drops the pages wholly inside `ranges` from the process's page tables, piece by piece, so
/// that the unmapping or freeing that follows is cheap and holds up no other thread. Ranges that
/// meet or lie less than a page apart are taken as one (the tensors of one file).
///
/// # Safety
/// The ranges, and what lies less than a page between two of them, are memory of this process
/// that nothing reads or writes any more (a file mapping or anonymous memory about to be
/// unmapped or freed, no longer page-locked).
pub unsafe fn discard_pages(ranges: impl IntoIterator<Item = std::ops::Range<usize>>) {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let page = match usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }) {
            Ok(p) if p.is_power_of_two() => p,
            _ => return,
        };
        let mut ranges: Vec<std::ops::Range<usize>> = ranges.into_iter().collect();
        ranges.sort_by_key(|r| r.start);
        let mut merged: Vec<std::ops::Range<usize>> = Vec::with_capacity(ranges.len());
        for r in ranges {
            match merged.last_mut() {
                Some(last) if r.start < last.end + page => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        for range in merged {
            // Whole pages only: the first and last may hold another allocation's bytes.
            let (start, end) = (range.start.next_multiple_of(page), range.end / page * page);
            let mut at = start;
            while at < end {
                let len = DISCARD_PIECE.min(end - at);
                // SAFETY: the caller's promise; a failure (nothing mapped there) changes nothing.
                unsafe { libc::madvise(at as *mut libc::c_void, len, libc::MADV_DONTNEED) };
                at += len;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = ranges.into_iter();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// Teardowns of a kind run in the order queued, off the calling thread; `settle` waits for
    /// those that give memory back, `finish` for every one.
    #[test]
    fn teardowns_run_in_order_and_are_waited_for() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let ran = Arc::new(AtomicUsize::new(0));
        let caller = std::thread::current().id();
        for (i, returns) in [(0, 1 << 20), (1, 1 << 20), (2, 0)] {
            let (order, ran) = (order.clone(), ran.clone());
            later(returns, move || {
                std::thread::sleep(Duration::from_millis(20));
                assert_ne!(std::thread::current().id(), caller);
                order.lock().unwrap().push(i);
                ran.fetch_add(1, Ordering::SeqCst);
            });
        }
        settle();
        // Those that give memory back have run, in order.
        let order_now = order.lock().unwrap().clone();
        assert_eq!(
            order_now.iter().filter(|&&i| i < 2).count(),
            2,
            "{order_now:?}"
        );
        assert!(order_now.iter().position(|&i| i == 0) < order_now.iter().position(|&i| i == 1));
        finish();
        assert_eq!(ran.load(Ordering::SeqCst), 3);
    }

    /// The room is read again after the teardowns that give memory back only where it is short
    /// without them.
    #[test]
    fn the_room_waits_for_teardowns_only_where_it_is_short() {
        let (open, gate) = std::sync::mpsc::channel::<()>();
        let freed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let teardown_freed = freed.clone();
        later(1 << 20, move || {
            let _ = gate.recv();
            teardown_freed.store(true, Ordering::SeqCst);
        });
        let opener = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let _ = open.send(());
        });
        let room = || {
            Some(if freed.load(Ordering::SeqCst) {
                200
            } else {
                100
            })
        };
        // Enough now: read at once, while the teardown still waits at its gate.
        assert_eq!(room_for(100, room), Some(100));
        // Short now: read again once the teardown gave its memory back.
        assert_eq!(room_for(150, room), Some(200));
        opener.join().unwrap();
    }

    /// Discarded pages of anonymous memory read as zeros again; the bytes of the partial pages
    /// at either end are kept, and the page where two ranges meet is dropped.
    #[test]
    fn discarded_pages_are_dropped_and_partial_pages_kept() {
        let mut bytes = vec![7u8; 3 * DISCARD_PIECE + 12_345];
        let start = bytes.as_ptr() as usize;
        // SAFETY: the pages wholly inside the range are this test's and read only below.
        // Two ranges that meet mid-page are one: the page where they meet goes too.
        let (mid, end) = (start + DISCARD_PIECE + 2000, start + bytes.len() - 100);
        unsafe { discard_pages([mid..end, start + 100..mid]) };
        assert_eq!(bytes[..100], [7; 100]);
        assert_eq!(bytes[bytes.len() - 100..], [7; 100]);
        let zeros = bytes.iter().filter(|&&b| b == 0).count();
        assert!(zeros >= 3 * DISCARD_PIECE - 2 * 4096, "{zeros} zeros");
        assert_eq!(
            bytes[DISCARD_PIECE + 2000 - 1..DISCARD_PIECE + 2000 + 1],
            [0, 0]
        );
        bytes.fill(1);
        assert!(bytes.iter().all(|&b| b == 1));
    }
}
