//! Tearing down large host memory off the run's critical path. Unmapping an 11 GB weight file
//! after its tensors landed on the device, or unlocking 27 GB of page-locked memory when a
//! component is released, costs the calling thread 60 ms per GB of page-table work (an H200
//! host, `bench/RESULTS.md` session 30): done on one background thread, in the order queued, it
//! overlaps the next load or stage instead of delaying it.
//!
//! What a queued teardown still holds is counted: [`settle`] waits for the memory a teardown
//! returns (anonymous memory) before anything allocates against a host budget, and [`finish`]
//! waits for every teardown before the process exits.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, OnceLock};

type Work = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queue {
    work: VecDeque<(Work, u64)>,
    /// Teardowns queued or running.
    pending: usize,
    /// Bytes of memory that queued or running teardowns give back.
    holding: u64,
    /// Whether the thread runs (it starts with the first teardown).
    started: bool,
}

struct Teardowns {
    queue: Mutex<Queue>,
    /// Signalled when work is queued, and when a teardown ends.
    changed: Condvar,
}

fn teardowns() -> &'static Teardowns {
    static T: OnceLock<Teardowns> = OnceLock::new();
    T.get_or_init(|| Teardowns {
        queue: Mutex::new(Queue::default()),
        changed: Condvar::new(),
    })
}

/// Runs `work` on the teardown thread after the teardowns queued before it; `returns` is the
/// memory it gives back that the system would otherwise count as in use (anonymous memory;
/// 0 for a file's mapping, whose pages stay in the page cache whether mapped or not). Where the
/// thread cannot be started, `work` runs here and now.
pub fn later(returns: u64, work: impl FnOnce() + Send + 'static) {
    let t = teardowns();
    let mut q = t.queue.lock().unwrap_or_else(|e| e.into_inner());
    if !q.started {
        let spawned = std::thread::Builder::new()
            .name("vidgen-teardown".into())
            .spawn(run);
        if spawned.is_err() {
            drop(q);
            work();
            return;
        }
        q.started = true;
    }
    q.work.push_back((Box::new(work), returns));
    q.pending += 1;
    q.holding += returns;
    t.changed.notify_all();
}

/// The teardown thread: runs each queued teardown in turn.
fn run() {
    let t = teardowns();
    loop {
        let (work, returns) = {
            let mut q = t.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                match q.work.pop_front() {
                    Some(next) => break next,
                    None => q = t.changed.wait(q).unwrap_or_else(|e| e.into_inner()),
                }
            }
        };
        work();
        let mut q = t.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.pending -= 1;
        q.holding -= returns;
        t.changed.notify_all();
    }
}

/// Waits until `done` holds of the queue.
fn wait_until(done: impl Fn(&Queue) -> bool) {
    let t = teardowns();
    let mut q = t.queue.lock().unwrap_or_else(|e| e.into_inner());
    while !done(&q) {
        q = t.changed.wait(q).unwrap_or_else(|e| e.into_inner());
    }
}

/// Waits until every teardown that gives memory back has run: before a load or a stage that
/// a host budget limits, so memory released earlier is free again.
pub fn settle() {
    wait_until(|q| q.holding == 0);
}

/// Waits until every teardown has run (before the process exits, so none is cut short).
pub fn finish() {
    wait_until(|q| q.pending == 0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// Teardowns run in the order queued, off the calling thread; `settle` waits for those that
    /// give memory back, `finish` for every one.
    #[test]
    fn teardowns_run_in_order_and_are_waited_for() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let ran = Arc::new(AtomicUsize::new(0));
        let caller = std::thread::current().id();
        for (i, returns) in [(0, 0), (1, 1 << 20), (2, 0)] {
            let (order, ran) = (order.clone(), ran.clone());
            later(returns, move || {
                std::thread::sleep(Duration::from_millis(20));
                assert_ne!(std::thread::current().id(), caller);
                order.lock().unwrap().push(i);
                ran.fetch_add(1, Ordering::SeqCst);
            });
        }
        settle();
        // The one that gives memory back has run, and so has everything queued before it.
        assert!(ran.load(Ordering::SeqCst) >= 2);
        finish();
        assert_eq!(ran.load(Ordering::SeqCst), 3);
        assert_eq!(*order.lock().unwrap(), [0, 1, 2]);
    }
}
