//! Running groups through the device in order, `depth` groups ahead of the one computing.

use super::group::GroupLayout;
use super::group::{record, Packing};
use super::host::{HostMemory, HostSetup, HostStore};
use super::residency::{
    kept_groups, prefetch_depth, prefetches_across_passes, slot_count, streamed_bytes, SlotRuns,
};
use super::transfer::{CopyStats, DeviceSlot, SlotPlace, Transfer, Uploaded};
use crate::weights::WeightSet;
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};

/// A landed group's tensors by name, as its constructor asks for them.
type NamedTensors = HashMap<String, candle_core::Tensor>;

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
    /// largest group in fresh memory, and the expanded copy of a group's packed tensors
    /// ([`streamed_bytes`], the rule the memory plan counts by).
    pub device_bytes: usize,
    /// The groups kept on the device through a stage ([`kept_groups`]), and their bytes.
    pub kept_groups: usize,
    pub kept_bytes: u64,
}

/// How groups move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StreamOptions {
    /// Copy on a stream of their own, on a thread of their own, while groups compute; off:
    /// each group is copied on the compute stream just before it runs.
    pub stream: bool,
    /// Groups on the device ahead of the computing one.
    pub depth: usize,
    /// Up to this many bytes of groups stay on the device from their first pass in a stage to
    /// its end ([`kept_groups`]), copied once; the rest move every pass.
    pub kept_bytes: u64,
    /// Each slot fill in device memory of its own size, given back once its group has
    /// computed, where slots otherwise take the largest fill's size for the whole stage: the
    /// device holds the fills in flight and no more, at an allocation per fill (leaf level,
    /// where memory is what counts). One group per fill ([`SlotRuns::each`]).
    pub exact_fills: bool,
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
    /// The tensors of the groups kept on the device through a stage, landed on its first pass
    /// (`None` where a group moves, or before that pass); each pass builds them anew.
    kept: Mutex<Vec<Option<NamedTensors>>>,
    /// Whether each group is kept ([`kept_groups`]).
    is_kept: Vec<bool>,
    /// The moved groups, in order: a run's positions index this list.
    moved: Vec<usize>,
    /// Each moved group's position in `moved`.
    position: Vec<usize>,
    /// Which moved groups share a slot, and where in it each lands.
    runs: SlotRuns,
    /// Whether the next pass's first fills are copied while a pass's last ones compute
    /// ([`prefetches_across_passes`]); else once the pass is done.
    across_passes: bool,
    /// Device slots for streamed groups ([`slot_count`]), made on the first pass after each
    /// [`Self::release`].
    slots: Mutex<Option<Arc<Vec<DeviceSlot>>>>,
    /// Slot fills so far: fill k goes to slot k mod the slot count.
    fills: AtomicUsize,
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
        let layouts = store.layouts();
        let is_kept = kept_groups(&layouts, options.kept_bytes);
        let moved: Vec<usize> = (0..layouts.len()).filter(|&i| !is_kept[i]).collect();
        let mut position = vec![usize::MAX; layouts.len()];
        for (at, &index) in moved.iter().enumerate() {
            position[index] = at;
        }
        let moved_layouts = picked(&layouts, &moved);
        Offloaded {
            runs: SlotRuns::under(&moved_layouts, options),
            across_passes: prefetches_across_passes(&moved_layouts, options),
            kept: Mutex::new((0..layouts.len()).map(|_| None).collect()),
            is_kept,
            moved,
            position,
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
            fills: AtomicUsize::new(0),
        }
    }

    /// What the engine holds on the host and has copied so far (call after a device sync:
    /// the copy times come from CUDA events).
    pub fn usage(&self) -> Usage {
        Usage {
            copies: self.transfer.stats(),
            pinned_bytes: self.store.pinned_bytes() + self.transfer.staging_bytes(),
            host_bytes: self.store.arena_bytes(),
            setup: self.store.setup(),
            device_bytes: streamed_bytes(&self.layouts(), self.options) as usize,
            kept_groups: self.is_kept.iter().filter(|&&k| k).count(),
            kept_bytes: (0..self.store.len())
                .filter(|&i| self.is_kept[i])
                .map(|i| crate::offload::residency::landed_bytes(&self.store.group(i).layout))
                .sum(),
        }
    }

    /// The layouts of the part's groups, in order.
    pub fn layouts(&self) -> Vec<GroupLayout> {
        self.store.layouts()
    }

    /// Group `index` in fresh device memory, built; copied on the compute stream, so the
    /// caller just drops it when done.
    pub fn fetch(&self, index: usize) -> Result<B> {
        let uploaded = self.transfer.upload(&self.store, index, None)?;
        self.make(uploaded)
    }

    /// Builds a landed group on the computing thread (see [`Self::land`]).
    fn make(&self, uploaded: Uploaded) -> Result<B> {
        let index = uploaded.index;
        self.build_group(index, self.land(uploaded)?)
    }

    /// A group's tensors once its copies are waited for: its packed tensors are expanded here,
    /// on the compute stream.
    fn land(&self, uploaded: Uploaded) -> Result<NamedTensors> {
        self.transfer.ready(&uploaded)?;
        let layout = &self.store.group(uploaded.index).layout;
        Ok(layout.expand(uploaded.tensors)?.into_iter().collect())
    }

    /// Builds group `index` from its landed `tensors`.
    fn build_group(&self, index: usize, tensors: NamedTensors) -> Result<B> {
        (self.build)(
            index,
            VarBuilder::from_tensors(tensors, self.dtype, &self.device),
        )
        .with_context(|| format!("building offloaded group {index} on the device"))
    }

    /// Runs `f` on every group in order; a kept group is on the device from its stage's first
    /// pass to [`Self::release`], each other group only around its turn, and at most
    /// [`slot_count`] slot fills ([`SlotRuns`]) of those are on the device at once.
    pub fn for_each(&self, mut f: impl FnMut(&B) -> Result<()>) -> Result<()> {
        let n = self.store.len();
        let poisoned = || anyhow::anyhow!("offload state poisoned");
        let mut kept = self.kept.lock().map_err(|_| poisoned())?;
        // Built before any copy of the moved groups starts, in fresh memory on the compute
        // stream: the copy thread below owns the copy stream.
        for (index, tensors) in kept.iter_mut().enumerate() {
            if self.is_kept[index] && tensors.is_none() {
                let uploaded = self.transfer.upload(&self.store, index, None)?;
                *tensors = Some(self.land(uploaded)?);
            }
        }
        let kept_group = |index: usize| -> Option<Result<B>> {
            let tensors = kept[index].clone()?;
            Some(self.build_group(index, tensors))
        };
        // Without a copy stream, or with every group kept, nothing is copied ahead.
        if !self.options.stream || self.moved.is_empty() {
            for index in 0..n {
                match kept_group(index) {
                    Some(group) => f(&group?)?,
                    None => f(&self.fetch(index)?)?,
                }
            }
            return Ok(());
        }
        let runs = &self.runs.runs;
        let depth = prefetch_depth(runs.len(), self.options);
        let slots = {
            let mut kept = self.slots.lock().map_err(|_| poisoned())?;
            match &*kept {
                Some(slots) => slots.clone(),
                None => {
                    let count = slot_count(runs.len(), self.options);
                    // Exact fills allocate their own buffers: the slots start empty.
                    let moved = match self.options.exact_fills {
                        true => Vec::new(),
                        false => picked(&self.layouts(), &self.moved),
                    };
                    let made = Arc::new(self.transfer.slots(&moved, count)?);
                    *kept = Some(made.clone());
                    made
                }
            }
        };
        let slots = &*slots;
        let mut ready = std::mem::take(&mut *self.pending.lock().map_err(|_| poisoned())?);
        let ends_run = |index: usize| self.runs.ends_run(self.position[index]);
        // Whole runs are prefetched: the ready groups are the first runs of the pass.
        let first_missing = ready.iter().filter(|u| ends_run(u.index)).count();
        // A copy thread fills slots in order: the rest of this pass, then the first `depth`
        // runs of the next one (unless they are copied once this pass is done, so as not to be
        // in flight beside its last ones). It takes a permit per fill; a retired run returns one.
        let ahead = if self.across_passes { depth } else { 0 };
        let (uploads, received) = sync_channel::<Result<Uploaded>>(2 * n);
        let (permits, permit) = sync_channel::<()>(runs.len() + depth);
        for _ in first_missing..=depth {
            permits.send(()).ok();
        }
        std::thread::scope(|scope| -> Result<()> {
            let copier = scope.spawn(move || {
                for run in first_missing..runs.len() + ahead {
                    if permit.recv().is_err() {
                        break;
                    }
                    for uploaded in self.fill(slots, run % runs.len()) {
                        let failed = uploaded.is_err();
                        if uploads.send(uploaded).is_err() || failed {
                            return;
                        }
                    }
                }
            });
            let stopped = || anyhow::anyhow!("offload copy thread stopped");
            let result = (|| -> Result<()> {
                for index in 0..n {
                    if let Some(group) = kept_group(index) {
                        f(&group?)?;
                        continue;
                    }
                    let uploaded = match ready.pop_front() {
                        Some(u) => u,
                        None => received.recv().map_err(|_| stopped())??,
                    };
                    let (slot, index) = (uploaded.slot, uploaded.index);
                    let group = self.make(uploaded)?;
                    f(&group)?;
                    drop(group);
                    if let Some(k) = slot {
                        self.transfer.retire(&slots[k])?;
                    }
                    if ends_run(index) {
                        permits.send(()).ok();
                    }
                }
                for run in &runs[..ahead] {
                    for _ in run.clone() {
                        ready.push_back(received.recv().map_err(|_| stopped())??);
                    }
                }
                Ok(())
            })();
            // Stops the copy thread if the pass ended early (it may finish the copy it is on:
            // the rest of a fill needs no permit), and waits for it.
            drop(permits);
            drop(received);
            let copied = copier.join();
            if result.is_err() || copied.is_err() {
                // Whatever the early exit left queued must finish before a slot is refilled.
                for slot in slots {
                    self.transfer.retire(slot).ok();
                }
            }
            copied.map_err(|_| anyhow::anyhow!("offload copy thread panicked"))?;
            // Exact fills hold only what the next pass starts with between passes: the other
            // slots are freed once their work is done, and the next pass's first runs copied
            // where the copy thread did not.
            if self.options.exact_fills {
                for (k, slot) in slots.iter().enumerate() {
                    if !ready.iter().any(|u| u.slot == Some(k)) {
                        self.transfer.free_fill(slot)?;
                    }
                }
                if result.is_ok() && ahead == 0 {
                    for run in 0..depth {
                        for uploaded in self.fill(slots, run) {
                            ready.push_back(uploaded?);
                        }
                    }
                }
            }
            result
        })?;
        *self.pending.lock().map_err(|_| poisoned())? = ready;
        Ok(())
    }
}

impl<B> Offloaded<B> {
    /// The next slot's fill with run `run`: each of its groups' uploads, started as the
    /// iterator comes to it.
    fn fill<'a>(
        &'a self,
        slots: &'a [DeviceSlot],
        run: usize,
    ) -> impl Iterator<Item = Result<Uploaded>> + 'a {
        let k = self.fills.fetch_add(1, Ordering::Relaxed) % slots.len();
        let groups = self.runs.runs[run].clone();
        let first = groups.start;
        groups.map(move |at| {
            let place = SlotPlace {
                index: k,
                slot: &slots[k],
                offsets: &self.runs.offsets[at],
                first: at == first,
                exact: self.options.exact_fills,
            };
            self.transfer
                .upload(&self.store, self.moved[at], Some(place))
        })
    }

    /// Gives the device slots back, with the next pass's groups prefetched into them, and the
    /// kept groups: between its stages the part holds no device memory (the next pass makes
    /// slots and keeps groups again).
    pub fn release(&self) -> Result<()> {
        // Prefetches may still be copying into the slots.
        self.transfer.wait_idle()?;
        let poisoned = || anyhow::anyhow!("offload state poisoned");
        self.pending.lock().map_err(|_| poisoned())?.clear();
        *self.slots.lock().map_err(|_| poisoned())? = None;
        self.kept
            .lock()
            .map_err(|_| poisoned())?
            .iter_mut()
            .for_each(|tensors| *tensors = None);
        Ok(())
    }
}

/// The layouts of the groups at `indices`, in their order.
fn picked(layouts: &[GroupLayout], indices: &[usize]) -> Vec<GroupLayout> {
    indices.iter().map(|&i| layouts[i].clone()).collect()
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
pub(super) mod tests {
    use super::*;
    use crate::offload::residency::slot_sections;
    use crate::weights::{Packed, StorageCast, StorageDtype, Weights};
    use candle_core::Tensor;
    use std::time::{Duration, Instant};

    /// Groups of the test parts.
    const GROUPS: usize = 5;

    /// A group as built on the device: group i's f32 weight holds i, its bf16 scale i + 0.5.
    pub(super) struct Group {
        pub(super) index: usize,
        weight: Tensor,
        scale: Tensor,
    }

    /// A part of [`GROUPS`] groups read from a safetensors file, each of two tensors in two
    /// dtypes (two sections), held in pageable arenas and streamed `depth` groups ahead.
    fn part(name: &str, depth: usize) -> Result<Offloaded<Group>> {
        part_on(name, ahead(depth), &[(3, 2); GROUPS], &Device::Cpu)
    }

    /// Streaming on a copy stream `depth` slot fills ahead, keeping nothing.
    pub(super) fn ahead(depth: usize) -> StreamOptions {
        StreamOptions {
            stream: true,
            depth,
            kept_bytes: 0,
            exact_fills: false,
        }
    }

    /// A part of one group per entry of `lens` (its f32 weight's and bf16 scale's lengths) on
    /// `device`, read from a safetensors file, held in pageable arenas and moved as `options`
    /// say.
    pub(super) fn part_on(
        name: &str,
        options: StreamOptions,
        lens: &[(usize, usize)],
        device: &Device,
    ) -> Result<Offloaded<Group>> {
        let cpu = Device::Cpu;
        let dir =
            std::env::temp_dir().join(format!("vidgen-streamer-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("w.safetensors");
        let mut tensors = HashMap::new();
        for (i, &(w, s)) in lens.iter().enumerate() {
            let weight = Tensor::full(i as f32, w, &cpu)?;
            let scale = Tensor::full(i as f32 + 0.5, s, &cpu)?.to_dtype(DType::BF16)?;
            tensors.insert(format!("blocks.{i}.weight"), weight);
            tensors.insert(format!("blocks.{i}.scale"), scale);
        }
        candle_core::safetensors::save(&tensors, &path)?;
        let weights = WeightSet::open(&Weights::Files(vec![path]))?;
        let lens = lens.to_vec();
        let part = Offloaded::from_weights(
            &weights,
            lens.len(),
            Packing::ByDtype,
            move |index, vb| {
                let vb = vb.pp(format!("blocks.{index}"));
                let (w, s) = lens[index];
                Ok(Group {
                    index,
                    weight: vb.get(w, "weight")?,
                    scale: vb.to_dtype(DType::BF16).get(s, "scale")?,
                })
            },
            DType::F32,
            device,
            HostMemory::Pageable,
            options,
        )?;
        // Every group was read into an arena: the file is not read again.
        std::fs::remove_dir_all(&dir)?;
        Ok(part)
    }

    /// One whole pass: the groups it visited, in order, each checked to hold its own values.
    pub(super) fn visit_all(part: &Offloaded<Group>) -> Result<Vec<usize>> {
        let mut seen = Vec::new();
        part.for_each(|group| {
            let i = group.index as f32;
            let weight = group.weight.to_vec1::<f32>()?;
            let scale = group.scale.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            anyhow::ensure!(
                weight.iter().all(|&w| w == i),
                "group {i}: weight {weight:?}"
            );
            anyhow::ensure!(
                scale.iter().all(|&s| s == i + 0.5),
                "group {i}: scale {scale:?}"
            );
            seen.push(group.index);
            Ok(())
        })?;
        Ok(seen)
    }

    /// Group lengths where the middle three share a slot the size of the outer ones.
    pub(super) const UNEVEN: [(usize, usize); 5] =
        [(256, 512), (64, 128), (64, 128), (64, 128), (256, 512)];

    /// Smaller groups share a slot: with three that fit one slot between two that fill one,
    /// a pass fills three slots, prefetches the next pass's first fills whole (the large
    /// group, then the three small ones), and every pass visits each group in order with its
    /// own tensors and copies each once; a pass that stops in the shared slot leaves nothing
    /// behind.
    #[test]
    fn small_groups_fill_one_slot_together() -> Result<()> {
        let all: Vec<usize> = (0..UNEVEN.len()).collect();
        for (depth, prefetched) in [(1, vec![0]), (2, vec![0, 1, 2, 3])] {
            let part = part_on(
                &format!("uneven-{depth}"),
                ahead(depth),
                &UNEVEN,
                &Device::Cpu,
            )?;
            assert_eq!(part.runs.runs, [0..1, 1..4, 4..5]);
            assert_eq!(visit_all(&part)?, all);
            assert_eq!(copies(&part), UNEVEN.len() + prefetched.len());
            // A pass that stops inside the shared slot keeps nothing and retires every slot;
            // the next one copies and visits every group again.
            passes_visit_each_group_once(&part, depth, &prefetched)?;
            let before = copies(&part);
            assert_eq!(visit_all(&part)?, all, "depth {depth}, after stopping");
            assert_eq!(copies(&part) - before, UNEVEN.len() + prefetched.len());
        }
        Ok(())
    }

    /// Streaming on a copy stream in exact fills ([`StreamOptions::exact_fills`]) `depth` fills
    /// ahead.
    pub(super) fn exact(depth: usize) -> StreamOptions {
        StreamOptions {
            exact_fills: true,
            ..ahead(depth)
        }
    }

    /// Exact fills take one group each: every pass visits each group in order with its own
    /// tensors, copies each once, and prefetches the next pass's first `depth` groups (beside
    /// its last ones or after them); a pass that stops early keeps nothing and retires every
    /// slot.
    #[test]
    fn exact_fills_visit_every_group_once_per_pass() -> Result<()> {
        let all: Vec<usize> = (0..UNEVEN.len()).collect();
        // The next pass's first fill copied once a pass is done, and beside its last one.
        let mut second = UNEVEN;
        second.swap(0, 1);
        for (depth, groups, across) in [(1, UNEVEN, false), (2, UNEVEN, false), (1, second, true)] {
            let name = format!("exact-{depth}-{across}");
            let part = part_on(&name, exact(depth), &groups, &Device::Cpu)?;
            assert_eq!(part.runs.runs, [0..1, 1..2, 2..3, 3..4, 4..5]);
            assert_eq!(part.across_passes, across);
            assert_eq!(visit_all(&part)?, all);
            let prefetched: Vec<usize> = (0..depth).collect();
            passes_visit_each_group_once(&part, depth, &prefetched)?;
            assert_eq!(visit_all(&part)?, all, "depth {depth}, after stopping");
        }
        Ok(())
    }

    /// After a first pass of `part` (five groups, `depth` fills ahead): its
    /// slots, then three passes, each finding `prefetched` copied ahead by the one before,
    /// visiting every group in order and copying each once; then a pass that stops at group
    /// 2, which keeps nothing and retires every slot.
    fn passes_visit_each_group_once(
        part: &Offloaded<Group>,
        depth: usize,
        prefetched: &[usize],
    ) -> Result<()> {
        let all: Vec<usize> = (0..UNEVEN.len()).collect();
        assert_eq!(slots(part).expect("slots made").len(), depth + 1);
        for pass in 1..4 {
            assert_eq!(pending(part), prefetched, "depth {depth}, pass {pass}");
            let before = copies(part);
            assert_eq!(visit_all(part)?, all, "depth {depth}, pass {pass}");
            assert_eq!(copies(part) - before, UNEVEN.len());
        }
        let stopped = part.for_each(|group| match group.index {
            2 => anyhow::bail!("stopped"),
            _ => Ok(()),
        });
        assert_eq!(stopped.expect_err("stopped").to_string(), "stopped");
        assert_eq!((pending(part), in_use(part)), (vec![], vec![]));
        Ok(())
    }

    /// Groups kept within two groups' bytes (the second and fourth of five equal ones) land on a
    /// stage's first pass and stay: later passes copy only the three moved groups (and, on a
    /// copy stream, the next pass's first), into slots sized by those, and visit every group in
    /// order with its own tensors; `release` gives the kept ones back, so the next stage copies
    /// them again. With every group kept, a pass after the first copies nothing.
    #[test]
    fn kept_groups_are_copied_once_per_stage() -> Result<()> {
        let all: Vec<usize> = (0..GROUPS).collect();
        let lens = [(3, 2); GROUPS];
        let probe = part_on("kept-probe", ahead(1), &lens, &Device::Cpu)?;
        let group_bytes = crate::offload::residency::landed_bytes(&probe.layouts()[0]);
        for stream in [true, false] {
            let options = StreamOptions {
                stream,
                depth: 1,
                kept_bytes: 2 * group_bytes,
                exact_fills: false,
            };
            let part = part_on(&format!("kept-{stream}"), options, &lens, &Device::Cpu)?;
            assert_eq!(part.is_kept, [false, true, false, true, false]);
            let prefetched = usize::from(stream);
            for stage in 0..2 {
                let before = copies(&part);
                assert_eq!(visit_all(&part)?, all, "stream {stream}, stage {stage}");
                assert_eq!(copies(&part) - before, GROUPS + prefetched);
                for pass in 1..3 {
                    let before = copies(&part);
                    assert_eq!(visit_all(&part)?, all, "stream {stream}, pass {pass}");
                    assert_eq!(copies(&part) - before, 3, "stream {stream}, pass {pass}");
                }
                let kept = part
                    .kept
                    .lock()
                    .unwrap()
                    .iter()
                    .map(Option::is_some)
                    .collect::<Vec<_>>();
                assert_eq!(kept, part.is_kept);
                assert_eq!(slots(&part).map(|s| s.len()), stream.then_some(2));
                part.release()?;
                assert!(part.kept.lock().unwrap().iter().all(Option::is_none));
            }
        }
        // Every group kept: the first pass copies each once, the next ones nothing, and no
        // slot is made.
        let options = StreamOptions {
            kept_bytes: u64::MAX,
            ..ahead(1)
        };
        let part = part_on("kept-all", options, &lens, &Device::Cpu)?;
        assert_eq!(part.is_kept, [true; GROUPS]);
        for pass in 0..3 {
            let before = copies(&part);
            assert_eq!(visit_all(&part)?, all, "every group kept, pass {pass}");
            assert_eq!(copies(&part) - before, if pass == 0 { GROUPS } else { 0 });
        }
        assert!(slots(&part).is_none());
        Ok(())
    }

    /// Groups copied to the device so far.
    fn copies(part: &Offloaded<Group>) -> usize {
        part.usage().copies.groups as usize
    }

    /// The groups prefetched for the next pass, in order.
    fn pending(part: &Offloaded<Group>) -> Vec<usize> {
        part.pending
            .lock()
            .unwrap()
            .iter()
            .map(|u| u.index)
            .collect()
    }

    /// The slots the prefetched groups were copied into, in slot order.
    fn pending_slots(part: &Offloaded<Group>) -> Vec<usize> {
        let mut slots: Vec<usize> = part
            .pending
            .lock()
            .unwrap()
            .iter()
            .map(|u| u.slot.expect("a streamed group has a slot"))
            .collect();
        slots.sort();
        slots
    }

    /// The part's device slots (made by a pass, dropped by `release`).
    fn slots(part: &Offloaded<Group>) -> Option<Arc<Vec<DeviceSlot>>> {
        part.slots.lock().unwrap().clone()
    }

    /// The slots holding a group not retired yet.
    fn in_use(part: &Offloaded<Group>) -> Vec<usize> {
        slots(part)
            .expect("slots made")
            .iter()
            .enumerate()
            .filter(|(_, slot)| slot.in_use())
            .map(|(k, _)| k)
            .collect()
    }

    /// Waits, at most ten seconds, until `done`.
    fn wait_for(done: impl Fn() -> bool) -> Result<()> {
        let start = Instant::now();
        while !done() {
            anyhow::ensure!(start.elapsed() < Duration::from_secs(10), "timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// A pass that stops early (its closure fails at group `stop`, with groups prefetched by the
    /// last pass still queued and others being copied) returns the closure's error, keeps nothing
    /// for the next pass, and retires every slot; the next pass copies every group again and
    /// visits each in order with its own tensors.
    #[test]
    fn an_early_exit_retires_its_slots_and_keeps_nothing() -> Result<()> {
        const DEPTH: usize = 2;
        let part = part("early-exit", DEPTH)?;
        let all: Vec<usize> = (0..GROUPS).collect();
        assert_eq!(visit_all(&part)?, all);
        for stop in 0..GROUPS {
            assert_eq!(pending(&part), (0..DEPTH).collect::<Vec<_>>());
            let before = copies(&part);
            // With DEPTH groups prefetched, the copy thread may copy one group, and one more per
            // group done: once it has, it stays idle, so every copy of this pass comes before
            // the exit.
            let allowed = stop + 1;
            let mut seen = Vec::new();
            let stopped = part.for_each(|group| {
                if group.index == stop {
                    wait_for(|| copies(&part) - before >= allowed)?;
                    anyhow::bail!("stopped at {stop}");
                }
                seen.push(group.index);
                Ok(())
            });
            let error = stopped.expect_err("the closure's error");
            assert_eq!(error.to_string(), format!("stopped at {stop}"));
            assert_eq!(seen, all[..stop]);
            assert_eq!(copies(&part) - before, allowed, "stopped at {stop}");
            assert_eq!(pending(&part), [0; 0], "kept after stopping at {stop}");
            assert_eq!(
                in_use(&part),
                [0; 0],
                "not retired after stopping at {stop}"
            );
            let before = copies(&part);
            assert_eq!(visit_all(&part)?, all, "after stopping at {stop}");
            assert_eq!(copies(&part) - before, GROUPS + DEPTH);
        }
        Ok(())
    }

    /// A pass ends with the next pass's first groups copied into slots it keeps (not retired);
    /// the next pass starts from them, so it copies each group once and the same slots stay, and
    /// it visits every group in order with its own tensors. A depth beyond the other groups is
    /// cut to them.
    #[test]
    fn the_next_pass_consumes_what_the_last_prefetched() -> Result<()> {
        let all: Vec<usize> = (0..GROUPS).collect();
        for (asked, depth) in [(1, 1), (2, 2), (9, GROUPS - 1)] {
            let part = part(&format!("prefetch-{asked}"), asked)?;
            assert_eq!(visit_all(&part)?, all);
            assert_eq!(copies(&part), GROUPS + depth);
            let kept = slots(&part).expect("slots made");
            assert_eq!(kept.len(), depth + 1);
            for pass in 1..4 {
                assert_eq!(pending(&part), all[..depth], "depth {asked}, pass {pass}");
                assert_eq!(in_use(&part), pending_slots(&part), "depth {asked}");
                let before = copies(&part);
                assert_eq!(visit_all(&part)?, all, "depth {asked}, pass {pass}");
                assert_eq!(copies(&part) - before, GROUPS, "depth {asked}, pass {pass}");
                assert!(Arc::ptr_eq(&kept, &slots(&part).expect("slots kept")));
            }
        }
        Ok(())
    }

    /// `release` (before any pass, or between passes) drops the prefetched groups and the
    /// slots; the next pass makes new slots, copies every group again, and visits each in order
    /// with its own tensors.
    #[test]
    fn release_between_passes_remakes_the_slots() -> Result<()> {
        const DEPTH: usize = 2;
        let part = part("release", DEPTH)?;
        let all: Vec<usize> = (0..GROUPS).collect();
        part.release()?;
        assert!(slots(&part).is_none());
        assert_eq!(visit_all(&part)?, all);
        let mut last = slots(&part).expect("slots made");
        for _ in 0..2 {
            part.release()?;
            assert_eq!(pending(&part), [0; 0]);
            assert!(slots(&part).is_none(), "slots kept by release");
            let before = copies(&part);
            assert_eq!(visit_all(&part)?, all);
            assert_eq!(copies(&part) - before, GROUPS + DEPTH);
            assert_eq!(pending(&part), all[..DEPTH]);
            // The last slots are still held here, so new ones are elsewhere.
            let made = slots(&part).expect("slots remade");
            assert!(!Arc::ptr_eq(&last, &made));
            assert_eq!(made.len(), DEPTH + 1);
            last = made;
        }
        Ok(())
    }

    /// The fixture weight sets whose tensors are packed: a Q8_0 GGUF (its blocks as stored),
    /// and wan-tiny-a under `--storage-dtype` in both fp8 formats.
    pub(in crate::offload) fn packed_weight_sets() -> Result<Vec<WeightSet>> {
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let gguf = fixtures.join("weights-a/wan-q-tiny-a-Q8_0.gguf");
        let folder = fixtures.join("wan-tiny-a/transformer/diffusion_pytorch_model.safetensors");
        let mut sets = vec![WeightSet::open(&Weights::Files(vec![gguf]))?];
        for scaled in [
            "wan-tiny-a-comfyui-fp8-scaled.safetensors",
            "wan-tiny-a-fp8-e4m3fn-lightx2v.safetensors",
        ] {
            let file = fixtures.join("weights-a").join(scaled);
            sets.push(WeightSet::open(&Weights::Files(vec![file]))?);
        }
        for dtype in [StorageDtype::Float8E4m3fn, StorageDtype::Float8E5m2] {
            let cast = StorageCast {
                dtype,
                skip: crate::models::wan::transformer::LAYERWISE_CASTING_SKIP,
            };
            let files = Weights::Files(vec![folder.clone()]);
            sets.push(WeightSet::open(&files)?.with_storage_cast(cast));
        }
        Ok(sets)
    }

    /// A group as built: its tensors by name.
    pub(super) type Named = Vec<(String, Tensor)>;

    /// Every stored tensor of block `b` of `weights`, with its shape (named without ComfyUI's
    /// prefix, as models ask).
    pub(in crate::offload) fn block_tensors(
        weights: &WeightSet,
        b: usize,
    ) -> Vec<(String, Vec<usize>)> {
        let prefix = format!("blocks.{b}.");
        weights
            .names()
            .into_iter()
            .map(|n| n.trim_start_matches("model.diffusion_model.").to_string())
            .filter(|n| n.starts_with(&prefix))
            .filter_map(|n| Some((n.clone(), weights.stored_shape(&n)?)))
            .collect()
    }

    /// The first two blocks of `weights` (every stored tensor of each, in bf16), one group per
    /// block, held as `memory` says and streamed to `device` one group ahead (in exact fills
    /// where `exact_fills`).
    pub(super) fn stream_blocks(
        weights: &WeightSet,
        device: &Device,
        memory: HostMemory,
        exact_fills: bool,
    ) -> Result<Offloaded<Named>> {
        let blocks: Vec<_> = (0..2).map(|b| block_tensors(weights, b)).collect();
        Offloaded::from_weights(
            weights,
            blocks.len(),
            Packing::ByDtype,
            move |i, vb| {
                let get = |(name, shape): &(String, Vec<usize>)| {
                    Ok((name.clone(), vb.get(shape.as_slice(), name)?))
                };
                blocks[i].iter().map(get).collect()
            },
            DType::BF16,
            device,
            memory,
            StreamOptions {
                stream: true,
                depth: 1,
                kept_bytes: 0,
                exact_fills,
            },
        )
    }

    /// Checks, over two passes (the second takes what the first prefetched), that every tensor
    /// of every group of `part` is, bit for bit, what the `VarBuilder` reads on the CPU;
    /// returns how many a pass saw.
    pub(super) fn lands_as_read(part: &Offloaded<Named>, weights: &WeightSet) -> Result<usize> {
        let reference = weights.var_builder(DType::BF16, &Device::Cpu);
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            let values = t
                .to_device(&Device::Cpu)?
                .flatten_all()?
                .to_dtype(DType::F32)?;
            Ok(values
                .to_vec1::<f32>()?
                .iter()
                .map(|v| v.to_bits())
                .collect())
        };
        let mut seen = [0; 2];
        for pass in &mut seen {
            part.for_each(|group| {
                for (name, tensor) in group {
                    let want = reference.get(tensor.dims(), name)?;
                    anyhow::ensure!(
                        tensor.dtype() == DType::BF16,
                        "{name} in {:?}",
                        tensor.dtype()
                    );
                    anyhow::ensure!(bits(tensor)? == bits(&want)?, "{name} differs");
                    *pass += 1;
                }
                Ok(())
            })?;
        }
        anyhow::ensure!(seen[0] == seen[1], "passes saw {seen:?} tensors");
        Ok(seen[0])
    }

    /// Packed weights are held and moved as stored: a Q8_0 tensor's image is its bytes in the
    /// file, an fp8-stored one one byte a value (half of bf16); the device holds its slots and
    /// the expanded copy of a group. Every tensor lands as the `VarBuilder` reads it.
    #[test]
    fn packed_weights_are_held_as_stored_and_land_as_read() -> Result<()> {
        for weights in packed_weight_sets()? {
            let part = stream_blocks(&weights, &Device::Cpu, HostMemory::Pageable, false)?;
            let layouts = part.layouts();
            let slots: Vec<&super::super::group::Slot> =
                layouts.iter().flat_map(|l| &l.slots).collect();
            let mut packed = 0;
            for slot in &slots {
                let Some(form) = slot.packed else { continue };
                let stored = match form {
                    Packed::Gguf(_) => weights.mapped_packed(&slot.name, form).map(<[u8]>::len),
                    Packed::Fp8(_) => Some(slot.shape.elem_count()),
                    Packed::ScaledFp8 { scales } => Some(4 * scales + slot.shape.elem_count()),
                };
                assert_eq!(Some(slot.bytes()), stored, "{}", slot.name);
                assert_eq!(slot.device_bytes(), 2 * slot.shape.elem_count());
                packed += 1;
            }
            assert!(packed >= 10, "{packed} packed tensors of {}", slots.len());
            let usage = part.usage();
            let images: usize = layouts.iter().map(|l| l.bytes).sum();
            assert_eq!(usage.host_bytes, images);
            let expanded = layouts.iter().map(|l| l.expanded_bytes()).max().unwrap();
            let slot_bytes: usize = slot_sections(&layouts).iter().map(|s| s.1).sum();
            // Two slots, or one where the blocks hold different dtypes and share it.
            let fills = part.runs.runs.len().min(2);
            assert_eq!(usage.device_bytes, fills * slot_bytes + expanded);
            assert_eq!(lands_as_read(&part, &weights)?, slots.len());
        }
        Ok(())
    }

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

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    use super::super::staging::build_resident;
    use super::tests::{
        ahead, lands_as_read, packed_weight_sets, part_on, stream_blocks, visit_all, UNEVEN,
    };
    use super::*;
    use candle_core::Tensor;

    /// On the GPU, packed weights (Q8_0 blocks, fp8 bytes) streamed from pinned arenas or the
    /// locked map, pageable memory or through the staging ring, in slots or exact fills, and
    /// loaded resident through the staging ring, expand to what the host reads, bit for bit.
    #[test]
    fn packed_weights_land_on_the_gpu_as_the_host_reads_them() -> Result<()> {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: packed streaming test skipped");
            return Ok(());
        };
        for weights in packed_weight_sets()? {
            for memory in [
                HostMemory::Pinned,
                HostMemory::Pageable,
                HostMemory::Bounded {
                    max_pinned: 1 << 16,
                },
            ] {
                for exact in [false, true] {
                    let part = stream_blocks(&weights, &gpu, memory, exact)?;
                    assert!(lands_as_read(&part, &weights)? > 0, "{memory} {exact}");
                }
            }
            lands_resident_as_read(&weights, &gpu)?;
        }
        Ok(())
    }

    /// On the GPU, groups that share a slot land each at its own place in it: every pass
    /// visits each group with its own tensors, one and two fills ahead, and with a large group
    /// kept through two stages.
    #[test]
    fn groups_sharing_a_slot_keep_their_own_tensors() -> Result<()> {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: shared-slot test skipped");
            return Ok(());
        };
        let all: Vec<usize> = (0..UNEVEN.len()).collect();
        for depth in [1, 2] {
            let part = part_on(&format!("uneven-gpu-{depth}"), ahead(depth), &UNEVEN, &gpu)?;
            for pass in 0..4 {
                assert_eq!(visit_all(&part)?, all, "depth {depth}, pass {pass}");
            }
        }
        // Kept within one large group's bytes: the three small ones (the share reaches a large
        // one only after it), the large ones moving one fill each.
        let probe = part_on("uneven-gpu-probe", ahead(1), &UNEVEN, &gpu)?;
        let kept_bytes = crate::offload::residency::landed_bytes(&probe.layouts()[0]);
        let options = StreamOptions {
            kept_bytes,
            ..ahead(1)
        };
        let part = part_on("uneven-gpu-kept", options, &UNEVEN, &gpu)?;
        assert_eq!(part.is_kept, [false, true, true, true, false]);
        assert_eq!(part.runs.runs, [0..1, 1..2]);
        for stage in 0..2 {
            for pass in 0..3 {
                assert_eq!(visit_all(&part)?, all, "kept, stage {stage}, pass {pass}");
            }
            part.release()?;
        }
        Ok(())
    }

    /// On the GPU, exact fills land each group in memory of its own size: every pass visits
    /// each group with its own tensors, one and two fills ahead, after a pass stopped early
    /// too; between passes the device holds the next pass's first fills and no more, and while
    /// a pass runs no more than the plan's fills in flight.
    #[test]
    fn exact_fills_hold_only_the_groups_in_flight() -> Result<()> {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: exact-fill test skipped");
            return Ok(());
        };
        let Device::Cuda(cuda) = &gpu else {
            unreachable!()
        };
        let pool = crate::memory::accounting::cuda::Pool::of(cuda).expect("a memory pool");
        let all: Vec<usize> = (0..UNEVEN.len()).collect();
        // The large groups last and first: the next pass's first fill is copied once a pass is
        // done. The large group second: one fill ahead, beside the pass's last one, by the copy
        // thread (two ahead would hold both large groups at once).
        let mut second = UNEVEN;
        second.swap(0, 1);
        for (groups, across) in [(UNEVEN, [false, false]), (second, [true, false])] {
            // Large enough that the groups, not the pool's granularity, decide.
            let lens: Vec<(usize, usize)> =
                groups.iter().map(|&(w, s)| (w << 12, s << 12)).collect();
            for (depth, across) in [1, 2].into_iter().zip(across) {
                let what = format!("depth {depth}, across passes {across}");
                let name = format!("exact-gpu-{depth}-{across}");
                let part = part_on(&name, super::tests::exact(depth), &lens, &gpu)?;
                assert_eq!(part.across_passes, across, "{what}");
                let (before, _) = pool.used();
                pool.reset();
                for pass in 0..4 {
                    assert_eq!(visit_all(&part)?, all, "{what}, pass {pass}");
                }
                let (now, high) = pool.used();
                let (peak, between) = (high - before, now - before);
                let layouts = part.layouts();
                let planned = crate::offload::residency::streamed_bytes(&layouts, part.options);
                let next = crate::offload::residency::between_passes_bytes(&layouts, part.options);
                // The visits' own copies of the values come and go beside the fills.
                let slack = 2 * (lens[0].0.max(lens[1].0) * 4 + lens[0].1.max(lens[1].1) * 2);
                assert!(peak <= planned + slack as u64, "{what}: {peak} > {planned}");
                let largest = layouts.iter().map(|l| l.bytes).max().unwrap_or(0) as u64;
                assert!(planned < (depth as u64 + 1) * largest, "{what}");
                assert_eq!(between, next, "{what}: held between passes");
                let stopped = part.for_each(|group| match group.index {
                    2 => anyhow::bail!("stopped"),
                    _ => Ok(()),
                });
                assert!(stopped.is_err());
                assert_eq!(visit_all(&part)?, all, "{what}, after stopping");
                part.release()?;
            }
        }
        Ok(())
    }

    /// LoRA'd weights streamed from pinned arenas (merged on the GPU, two streams, while other
    /// arenas fill) or pageable ones, and loaded resident (merged where they landed), hold what
    /// the host reads with the LoRA merged, bit for bit.
    #[test]
    fn lora_weights_land_on_the_gpu_as_the_host_merges_them() -> Result<()> {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: LoRA streaming test skipped");
            return Ok(());
        };
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        // Two LoRAs stacked, in two layouts.
        let specs = [
            "lora1.comfyui.safetensors:0.7",
            "lora2.diffusers.safetensors:0.5",
        ]
        .map(|f| crate::lora::parse_spec(&format!("{}/ecosystem-a/lora/{f}", fixtures.display())))
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .map_err(anyhow::Error::msg)?;
        let wan = crate::lora::Target::Transformer(Some(crate::weights::original::Model::Wan));
        let loras = crate::lora::Scanned::scan(&specs, wan)?.read()?;
        let folder = fixtures.join("wan-tiny-a/transformer/diffusion_pytorch_model.safetensors");
        let weights = WeightSet::open(&crate::weights::Weights::Files(vec![folder]))?
            .with_loras(std::sync::Arc::new(loras));
        let changed = |b| {
            super::tests::block_tensors(&weights, b)
                .iter()
                .filter(|(n, _)| weights.lora_changes(n))
                .count()
        };
        assert!(
            changed(0) > 1 && changed(1) > 1,
            "the LoRA changes the streamed blocks"
        );
        for (memory, exact) in [HostMemory::Pinned, HostMemory::Pageable]
            .into_iter()
            .flat_map(|m| [(m, false), (m, true)])
        {
            let part = stream_blocks(&weights, &gpu, memory, exact)?;
            assert!(lands_as_read(&part, &weights)? > 0, "{memory} {exact}");
        }
        lands_resident_as_read(&weights, &gpu)
    }

    /// Block 0 of `weights` loaded resident on `gpu` through the staging ring holds what the host
    /// reads, bit for bit.
    fn lands_resident_as_read(weights: &WeightSet, gpu: &Device) -> Result<()> {
        let names = super::tests::block_tensors(weights, 0);
        let resident = build_resident(weights, DType::BF16, gpu, |vb, _| {
            names
                .iter()
                .map(|(n, s)| vb.get(s.as_slice(), n))
                .collect::<candle_core::Result<Vec<Tensor>>>()
        })?;
        let host = weights.var_builder(DType::BF16, &Device::Cpu);
        for ((name, shape), got) in names.iter().zip(&resident) {
            let want = host.get(shape.as_slice(), name)?;
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                let t = t
                    .to_device(&Device::Cpu)?
                    .flatten_all()?
                    .to_dtype(DType::F32)?;
                Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
            };
            anyhow::ensure!(bits(got)? == bits(&want)?, "{name} resident");
        }
        Ok(())
    }
}
