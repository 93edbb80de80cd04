//! Running groups through the device in order, `depth` groups ahead of the one computing.

use super::group::GroupLayout;
use super::group::{record, Packing};
use super::host::{HostMemory, HostSetup, HostStore};
use super::residency::{prefetch_depth, slot_count, ComponentLayout, Residency};
use super::transfer::{CopyStats, DeviceSlot, Transfer, Uploaded};
use crate::weights::WeightSet;
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};

/// Builds group `i` (e.g. a run of transformer blocks) from a `VarBuilder` over its device copies.
pub type BuildGroup<B> =
    Box<dyn Fn(usize, VarBuilder<'static>) -> candle_core::Result<B> + Send + Sync>;

/// What an offloaded part holds on the host and has moved.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub copies: CopyStats,
    /// Pinned host bytes: arenas, the memory map's pages locked in place, the staging ring.
    pub pinned_bytes: usize,
    /// Bytes held in host arenas, pinned or not (the memory map is not counted).
    pub host_bytes: usize,
    /// How long filling and locking the host arenas took.
    pub setup: HostSetup,
    /// Device bytes the part takes while it computes: its slots, or without a copy stream the
    /// largest group in fresh memory ([`ComponentLayout::device_weights`]'s rule, which the
    /// memory plan counts by).
    pub device_bytes: usize,
}

/// How groups move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StreamOptions {
    /// Copy on a stream of their own, on a thread of their own, while groups compute; off:
    /// each group is copied on the compute stream just before it runs.
    pub stream: bool,
    /// Groups on the device ahead of the computing one.
    pub depth: usize,
}

/// An offloaded model part: groups held on the host, moved to the device around their use.
pub struct Offloaded<B> {
    store: HostStore,
    transfer: Transfer,
    build: BuildGroup<B>,
    dtype: DType,
    device: Device,
    options: StreamOptions,
    /// The first groups of the next pass, prefetched while the last ones computed.
    pending: Mutex<VecDeque<Uploaded>>,
    /// Device slots for streamed groups ([`slot_count`]), made on the first pass after each
    /// [`Self::release`].
    slots: Mutex<Option<Arc<Vec<DeviceSlot>>>>,
    /// Uploads so far: upload k goes to slot k mod the slot count.
    uploads: AtomicUsize,
}

impl<B> Offloaded<B> {
    /// Offloads `count` parts of a model whose weights are `weights`: part i is what
    /// `build(i, vb)` asks for, held on the host as `memory` says and moved as `options` say.
    /// `packing` chooses how a part's tensors share device allocations.
    #[allow(clippy::too_many_arguments)]
    pub fn from_weights(
        weights: &WeightSet,
        count: usize,
        packing: Packing,
        build: impl Fn(usize, VarBuilder<'static>) -> candle_core::Result<B> + Send + Sync + 'static,
        dtype: DType,
        device: &Device,
        memory: HostMemory,
        options: StreamOptions,
    ) -> Result<Self> {
        let layouts = (0..count)
            .map(|i| record(Some(weights), dtype, packing, |vb| build(i, vb)))
            .collect::<Result<Vec<_>>>()?;
        let total: usize = layouts.iter().map(|l| l.bytes).sum();
        let largest = layouts.iter().map(|l| l.bytes).max().unwrap_or(0);
        let (memory, staging) = host_holding(memory, total, largest);
        let store = HostStore::new(layouts, weights, memory, device)?;
        let transfer = Transfer::new(device, options.stream, staging)?;
        Ok(Self::new(
            store,
            transfer,
            Box::new(build),
            dtype,
            device,
            options,
        ))
    }

    pub fn new(
        store: HostStore,
        transfer: Transfer,
        build: BuildGroup<B>,
        dtype: DType,
        device: &Device,
        options: StreamOptions,
    ) -> Self {
        Offloaded {
            store,
            transfer,
            build,
            dtype,
            device: device.clone(),
            options: StreamOptions {
                depth: options.depth.max(1),
                ..options
            },
            pending: Mutex::new(VecDeque::new()),
            slots: Mutex::new(None),
            uploads: AtomicUsize::new(0),
        }
    }

    /// What the engine holds on the host and has copied so far (call after a device sync:
    /// the copy times come from CUDA events).
    pub fn usage(&self) -> Usage {
        let residency = Residency::Streamed {
            blocks_per_group: 1,
            by_step: false,
            options: self.options,
        };
        let layout = ComponentLayout {
            groups: self.layouts(),
            ..Default::default()
        };
        Usage {
            copies: self.transfer.stats(),
            pinned_bytes: self.store.pinned_bytes() + self.transfer.staging_bytes(),
            host_bytes: self.store.arena_bytes(),
            setup: self.store.setup(),
            device_bytes: layout.device_weights(residency).active as usize,
        }
    }

    /// The layouts of the part's groups, in order.
    pub fn layouts(&self) -> Vec<GroupLayout> {
        (0..self.store.len())
            .map(|i| self.store.group(i).layout.clone())
            .collect()
    }

    /// Group `index` in fresh device memory, built; copied on the compute stream, so the
    /// caller just drops it when done.
    pub fn fetch(&self, index: usize) -> Result<B> {
        let uploaded = self.transfer.upload(&self.store, index, None)?;
        self.make(uploaded)
    }

    fn make(&self, uploaded: Uploaded) -> Result<B> {
        self.transfer.ready(&uploaded)?;
        let index = uploaded.index;
        let map: HashMap<String, candle_core::Tensor> = uploaded.tensors.into_iter().collect();
        (self.build)(
            index,
            VarBuilder::from_tensors(map, self.dtype, &self.device),
        )
        .with_context(|| format!("building offloaded group {index} on the device"))
    }

    /// Runs `f` on every group in order; each group is on the device only around its turn,
    /// and at most [`slot_count`] groups are on the device at once.
    pub fn for_each(&self, mut f: impl FnMut(&B) -> Result<()>) -> Result<()> {
        let n = self.store.len();
        if !self.options.stream {
            for index in 0..n {
                f(&self.fetch(index)?)?;
            }
            return Ok(());
        }
        let depth = prefetch_depth(n, self.options);
        let poisoned = || anyhow::anyhow!("offload state poisoned");
        let slots = {
            let mut kept = self.slots.lock().map_err(|_| poisoned())?;
            match &*kept {
                Some(slots) => slots.clone(),
                None => {
                    let made = Arc::new(
                        self.transfer
                            .slots(&self.store, slot_count(n, self.options))?,
                    );
                    *kept = Some(made.clone());
                    made
                }
            }
        };
        let slots = &*slots;
        let mut ready = std::mem::take(&mut *self.pending.lock().map_err(|_| poisoned())?);
        let first_missing = ready.len();
        // A copy thread uploads in order: the rest of this pass, then the first `depth` groups
        // of the next one. It takes a permit per upload; a retired group returns one.
        let (uploads, received) = sync_channel::<Result<Uploaded>>(n + depth);
        let (permits, permit) = sync_channel::<()>(n + depth);
        for _ in first_missing..=depth {
            permits.send(()).ok();
        }
        std::thread::scope(|scope| -> Result<()> {
            scope.spawn(move || {
                for index in first_missing..n + depth {
                    if permit.recv().is_err() {
                        break;
                    }
                    let k = self.uploads.fetch_add(1, Ordering::Relaxed) % slots.len();
                    let uploaded =
                        self.transfer
                            .upload(&self.store, index % n, Some((k, &slots[k])));
                    let failed = uploaded.is_err();
                    if uploads.send(uploaded).is_err() || failed {
                        break;
                    }
                }
            });
            let stopped = || anyhow::anyhow!("offload copy thread stopped");
            let result = (|| -> Result<()> {
                for _ in 0..n {
                    let uploaded = match ready.pop_front() {
                        Some(u) => u,
                        None => received.recv().map_err(|_| stopped())??,
                    };
                    let slot = uploaded.slot;
                    let group = self.make(uploaded)?;
                    f(&group)?;
                    drop(group);
                    if let Some(k) = slot {
                        self.transfer.retire(&slots[k])?;
                    }
                    permits.send(()).ok();
                }
                for _ in 0..depth {
                    ready.push_back(received.recv().map_err(|_| stopped())??);
                }
                Ok(())
            })();
            if result.is_err() {
                // Whatever the early exit left queued must finish before a slot is refilled.
                for slot in slots {
                    self.transfer.retire(slot).ok();
                }
            }
            // Stops the copy thread if the pass ended early; the scope joins it.
            drop(permits);
            drop(received);
            result
        })?;
        *self.pending.lock().map_err(|_| poisoned())? = ready;
        Ok(())
    }
}

impl<B> Offloaded<B> {
    /// Gives the device slots back, with the next pass's groups prefetched into them: between
    /// its stages the part holds no device memory (the next pass makes slots again).
    pub fn release(&self) -> Result<()> {
        // Prefetches may still be copying into the slots.
        self.transfer.wait_idle()?;
        let poisoned = || anyhow::anyhow!("offload state poisoned");
        self.pending.lock().map_err(|_| poisoned())?.clear();
        *self.slots.lock().map_err(|_| poisoned())? = None;
        Ok(())
    }
}

/// How a part of `total` bytes whose largest group has `largest` bytes is held on the host, and
/// the staging ring's size: a bound the whole part fits in pins it all (no staging); otherwise
/// the ring's two buffers need be no larger than a group each.
fn host_holding(memory: HostMemory, total: usize, largest: usize) -> (HostMemory, Option<usize>) {
    match memory {
        HostMemory::Bounded { max_pinned } if max_pinned >= total => (HostMemory::Pinned, None),
        HostMemory::Bounded { max_pinned } => (memory, Some(max_pinned.min(2 * largest))),
        HostMemory::Staged => host_holding(
            HostMemory::Bounded {
                max_pinned: 2 * largest,
            },
            total,
            largest,
        ),
        other => (other, None),
    }
}

impl<B> Drop for Offloaded<B> {
    /// Copies prefetched for a next pass may still be reading host memory: they finish before
    /// the arenas are released.
    fn drop(&mut self) {
        let _ = self.transfer.wait_idle();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bound above the part pins it all; below, the ring is the bound or two groups, the
    /// smaller; a staged part has a ring of two groups (all of it pinned when that is all);
    /// unbounded memory has no ring.
    #[test]
    fn the_staging_ring_is_at_most_two_groups() {
        let bounded = |max_pinned| HostMemory::Bounded { max_pinned };
        assert_eq!(
            host_holding(bounded(1000), 1000, 100),
            (HostMemory::Pinned, None)
        );
        assert_eq!(
            host_holding(bounded(999), 1000, 100),
            (bounded(999), Some(200))
        );
        assert_eq!(
            host_holding(bounded(150), 1000, 100),
            (bounded(150), Some(150))
        );
        assert_eq!(
            host_holding(HostMemory::Staged, 1000, 100),
            (bounded(200), Some(200))
        );
        assert_eq!(
            host_holding(HostMemory::Staged, 200, 100),
            (HostMemory::Pinned, None)
        );
        assert_eq!(
            host_holding(HostMemory::Pageable, 1000, 100),
            (HostMemory::Pageable, None)
        );
        assert_eq!(
            host_holding(HostMemory::Pinned, 1000, 100),
            (HostMemory::Pinned, None)
        );
    }
}
