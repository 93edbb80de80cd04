//! Where offloaded weights wait: a few large host arenas of exactly the bytes needed (pinned for
//! fast asynchronous copies, or pageable), or the memory map itself (page-locked in place when
//! pinned, read through a staging ring in bounded mode).

use super::group::{GroupLayout, Slot, ALIGN};
#[cfg(feature = "cuda")]
use super::locked::{LockedMap, LOCK_PIECE};
use crate::weights::WeightSet;
use anyhow::{Context, Result};
use candle_core::Device;
use rayon::prelude::*;
use std::ops::Range;
use std::time::Instant;

/// Largest arena: groups are packed into arenas of at most this size (one larger group gets
/// an arena of its own), so arenas are filled and locked in parallel and no allocation is
/// rounded up.
const ARENA_BYTES: usize = 1 << 30;

/// How offloaded weights are held on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum HostMemory {
    /// Page-locked: the memory map's pages in place where tensors are stored as they go to the
    /// device, arenas otherwise. Copies run asynchronously at full link speed.
    Pinned,
    /// Ordinary memory: copies are staged by the driver and block the thread issuing them.
    Pageable,
    /// At most `max_pinned` bytes pinned: weights stay in the memory map (or, where they need
    /// converting or have no file, in pageable memory) and pass through a pinned staging ring.
    Bounded { max_pinned: usize },
    /// As `Bounded` with a ring of two groups: for a part that streams once per job, where
    /// page-locking its weights (serialized in the driver, ~0.09 s per GiB, and as long again to
    /// release) costs more than the ring's CPU copies, which keep pace with the link.
    Staged,
}

impl std::fmt::Display for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostMemory::Pinned => write!(f, "pinned"),
            HostMemory::Pageable => write!(f, "pageable"),
            HostMemory::Bounded { max_pinned } => write!(
                f,
                "in the memory map, through a {:.2} GiB pinned staging ring",
                *max_pinned as f64 / (1u64 << 30) as f64
            ),
            HostMemory::Staged => write!(f, "in the memory map, through a pinned staging ring"),
        }
    }
}

/// One allocation of host memory.
pub enum Arena {
    Pageable(Vec<u8>),
    #[cfg(feature = "cuda")]
    Pinned(Locked),
}

impl Drop for Arena {
    /// A pageable arena is freed on the teardown thread (unmapping gigabytes of anonymous
    /// memory is page-table work that grows with the size); a pinned one frees itself so.
    fn drop(&mut self) {
        match self {
            Arena::Pageable(bytes) => {
                let bytes = std::mem::take(bytes);
                crate::teardown::later(bytes.len() as u64, move || {
                    let start = bytes.as_ptr() as usize;
                    // SAFETY: the arena's own bytes, freed right after.
                    unsafe {
                        crate::teardown::discard_pages(std::iter::once(start..start + bytes.len()))
                    };
                    drop(bytes);
                });
            }
            #[cfg(feature = "cuda")]
            Arena::Pinned(_) => {}
        }
    }
}

impl Arena {
    /// `bytes` of host memory, to be filled and then, when `pinned` and the device is CUDA,
    /// page-locked with [`Arena::lock`].
    pub fn new(bytes: usize, pinned: bool, device: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let (true, Device::Cuda(dev)) = (pinned, device) {
            return Ok(Arena::Pinned(Locked::new(bytes, dev)?));
        }
        let _ = (pinned, device);
        Ok(Arena::Pageable(vec![0; bytes]))
    }

    /// Page-locks a pinned arena (a no-op for pageable ones). Locking memory that is already
    /// filled runs at ~23 GiB/s where allocating pinned memory runs at ~2 GiB/s, and the
    /// filling writes each page once (`bench/pin_cost.py`).
    pub fn lock(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Arena::Pinned(locked) = self {
            locked.lock()?;
        }
        Ok(())
    }

    /// Whether copies from this arena can run asynchronously.
    pub fn is_pinned(&self) -> bool {
        !matches!(self, Arena::Pageable(_))
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            Arena::Pageable(v) => v,
            #[cfg(feature = "cuda")]
            Arena::Pinned(p) => &p.map,
        }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Arena::Pageable(v) => v,
            #[cfg(feature = "cuda")]
            Arena::Pinned(p) => &mut p.map,
        }
    }
}

/// Anonymous memory that is registered with the CUDA driver, page-locked, once it has been
/// filled.
#[cfg(feature = "cuda")]
pub struct Locked {
    /// Taken by `drop`, which hands it to the teardown thread.
    map: std::mem::ManuallyDrop<memmap2::MmapMut>,
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    locked: bool,
}

#[cfg(feature = "cuda")]
impl Locked {
    fn new(bytes: usize, dev: &candle_core::CudaDevice) -> Result<Self> {
        // Ordinary pages: huge pages lock faster in a process that has used the memory before,
        // but made a process's first setup slow and unpredictable (bench/RESULTS.md).
        let map = memmap2::MmapMut::map_anon(bytes)
            .with_context(|| format!("allocating {bytes} bytes of host memory"))?;
        Ok(Locked {
            map: std::mem::ManuallyDrop::new(map),
            ctx: dev.cuda_stream().context().clone(),
            locked: false,
        })
    }

    fn lock(&mut self) -> Result<()> {
        if self.locked || self.map.is_empty() {
            return Ok(());
        }
        let start = self.map.as_mut_ptr() as usize;
        // SAFETY: the range is a live mapping owned by `self`, unregistered in `drop` before
        // it is unmapped.
        unsafe { super::locked::register(&self.ctx, &(start..start + self.map.len()), 0) }
            .with_context(|| {
                format!(
                    "page-locking {} bytes of host memory failed: pin less with --max-pinned-memory SIZE, or none with --no-pin-cpu-memory",
                    self.map.len()
                )
            })?;
        self.locked = true;
        Ok(())
    }
}

#[cfg(feature = "cuda")]
impl Drop for Locked {
    /// Unlocks and unmaps on the teardown thread (page-table work that grows with the size).
    fn drop(&mut self) {
        // SAFETY: `map` is taken once, here, and never read again.
        let mut map = unsafe { std::mem::ManuallyDrop::take(&mut self.map) };
        let (ctx, locked) = (self.ctx.clone(), self.locked);
        crate::teardown::later(map.len() as u64, move || {
            let start = map.as_mut_ptr() as usize;
            if locked {
                // No copy from it is pending (`Offloaded` waits for its copies before its store
                // is dropped).
                super::locked::unregister(&ctx, start);
            }
            // SAFETY: the arena's own pages, unlocked, unmapped right after.
            unsafe { crate::teardown::discard_pages(std::iter::once(start..start + map.len())) };
            drop(map);
        });
    }
}

/// Where one group's host image lives.
enum Place {
    /// Bytes `offset..offset + layout.bytes` of an arena.
    Arena { arena: usize, offset: usize },
    /// Each tensor read from the memory map when the group moves (through the staging ring in
    /// bounded mode; straight from its locked pages when pinned), except those stored in another
    /// dtype: `converted[k]` is where slot k's converted bytes sit (arena, offset).
    Mapped {
        converted: Vec<Option<(usize, usize)>>,
    },
}

/// A group held on the host.
pub struct HostGroup {
    pub layout: GroupLayout,
    place: Place,
}

/// Where the time to set up a host store went: arenas are filled and locked by parallel tasks,
/// so the parts are summed over tasks and can exceed the wall time.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostSetup {
    /// Wall time of the whole setup.
    pub seconds: f64,
    /// Task time spent reading weights into arenas (allocation and first touch included).
    pub fill_task_seconds: f64,
    /// Task time spent page-locking arenas.
    pub lock_task_seconds: f64,
}

/// Every group of one offloaded model, held on the host.
pub struct HostStore {
    groups: Vec<HostGroup>,
    arenas: Vec<Arena>,
    /// The memory map's pages that hold the mapped groups, when page-locked in place; released
    /// before `weights` (and so the mapping) can be.
    #[cfg(feature = "cuda")]
    locked: Option<LockedMap>,
    weights: WeightSet,
    setup: HostSetup,
}

impl HostStore {
    /// Holds the groups of `layouts`, reading each tensor from `weights` straight into its
    /// place in an arena (threads in parallel; no intermediate copy when no conversion is due).
    /// Pinned on a CUDA device, the tensors stored as they go to the device stay in the memory
    /// map, page-locked in place ([`LockedMap`]), and only the others are converted into pinned
    /// arenas; where the driver refuses to lock the map, every tensor goes to an arena.
    pub fn new(
        layouts: Vec<GroupLayout>,
        weights: &WeightSet,
        memory: HostMemory,
        device: &Device,
    ) -> Result<Self> {
        let started = Instant::now();
        let in_map = |s: &Slot| s.mapped(weights);
        #[cfg(feature = "cuda")]
        if let (HostMemory::Pinned, Device::Cuda(dev)) = (memory, device) {
            let ranges: Vec<Range<usize>> = layouts
                .iter()
                .flat_map(|l| &l.slots)
                .filter_map(in_map)
                .map(|b| b.as_ptr() as usize..b.as_ptr() as usize + b.len())
                .collect();
            if !ranges.is_empty() {
                let in_place = ranges.iter().map(Range::len).sum();
                match LockedMap::lock(ranges, LOCK_PIECE, dev.cuda_stream().context()) {
                    Ok(locked) => {
                        weights.report(in_place);
                        let any = |l: &GroupLayout| l.slots.iter().any(|s| in_map(s).is_some());
                        return Self::place(layouts, weights, memory, device, any, started)
                            .map(|store| store.with_locked_map(locked));
                    }
                    Err(e) => eprintln!(
                        "note: {e:#}; copying the weights into pinned host memory instead"
                    ),
                }
            }
        }
        // Bounded: tensors stored as they stream are read through the staging ring from the
        // map; only the others are converted into (pageable) arenas.
        let bounded = matches!(memory, HostMemory::Bounded { .. } | HostMemory::Staged);
        let any = |l: &GroupLayout| bounded && l.slots.iter().any(|s| in_map(s).is_some());
        Self::place(layouts, weights, memory, device, any, started)
    }

    /// Groups for which `mapped` holds stay in the memory map, but for their tensors stored in
    /// another dtype; the other groups' images and those tensors are packed into arenas, each
    /// filled and then page-locked (when `memory` pins) by its own task.
    fn place(
        layouts: Vec<GroupLayout>,
        weights: &WeightSet,
        memory: HostMemory,
        device: &Device,
        mapped: impl Fn(&GroupLayout) -> bool,
        started: Instant,
    ) -> Result<Self> {
        let mut arena_sizes: Vec<usize> = Vec::new();
        // Room for `bytes` at the end of the last arena, or in a new one.
        let mut pack = |bytes: usize| match arena_sizes.last_mut() {
            Some(size) if size.next_multiple_of(ALIGN) + bytes <= ARENA_BYTES => {
                let offset = size.next_multiple_of(ALIGN);
                *size = offset + bytes;
                (arena_sizes.len() - 1, offset)
            }
            _ => {
                arena_sizes.push(bytes);
                (arena_sizes.len() - 1, 0)
            }
        };
        let groups: Vec<HostGroup> = layouts
            .into_iter()
            .map(|layout| {
                let place = if mapped(&layout) {
                    let converted = layout
                        .slots
                        .iter()
                        .map(|s| match s.mapped(weights) {
                            Some(_) => None,
                            None => Some(pack(s.bytes())),
                        })
                        .collect();
                    Place::Mapped { converted }
                } else {
                    let (arena, offset) = pack(layout.bytes);
                    Place::Arena { arena, offset }
                };
                HostGroup { layout, place }
            })
            .collect();
        let pinned = memory == HostMemory::Pinned;
        let merges = |index: usize| {
            arena_slots(&groups, index)
                .iter()
                .any(|(_, s)| merges_on_device(weights, s, device))
        };
        // Where a LoRA is merged on the GPU ([`merge_on_device`]), the arenas are filled one at
        // a time, each by every thread, and pass in turn to one thread that locks them and on
        // to one that merges their deltas, while the pool fills the next: filled side by side,
        // they would all be ready near the end, and the merges (bound by the link) would follow
        // the filling instead of running beside it. Otherwise arenas are filled and locked side
        // by side.
        let lora_on_device = (0..arena_sizes.len()).any(merges);
        let at_once = if lora_on_device { 1 } else { arena_sizes.len() };
        let slots: Vec<std::sync::Mutex<Option<Arena>>> =
            arena_sizes.iter().map(|_| Default::default()).collect();
        let (filled, locking, merging) = std::thread::scope(|scope| {
            let (slots, groups) = (&slots, &groups);
            // Arena `index`'s place (each thread holds it only while it works on that arena).
            let slot = |index: usize| slots[index].lock().unwrap_or_else(|e| e.into_inner());
            let (ready, arrivals) = std::sync::mpsc::channel::<usize>();
            let (locked, to_merge) = std::sync::mpsc::channel::<usize>();
            // Each thread's busy time, in seconds. A closed channel means the next thread
            // failed: its error is returned.
            let locker = scope.spawn(move || -> Result<f64> {
                let mut busy = 0.0;
                for index in arrivals {
                    let start = Instant::now();
                    if let Some(arena) = slot(index).as_mut() {
                        arena.lock()?;
                    }
                    busy += start.elapsed().as_secs_f64();
                    let _ = locked.send(index);
                }
                Ok(busy)
            });
            let merger = scope.spawn(move || -> Result<f64> {
                let mut busy = 0.0;
                for index in to_merge {
                    let start = Instant::now();
                    #[cfg(feature = "cuda")]
                    if let Some(arena) = slot(index).as_mut() {
                        merge_on_device(groups, index, arena, weights, device)?;
                    }
                    // Nothing arrives without CUDA ([`merges_on_device`]).
                    #[cfg(not(feature = "cuda"))]
                    let _ = index;
                    busy += start.elapsed().as_secs_f64();
                }
                Ok(busy)
            });
            let indices: Vec<usize> = (0..arena_sizes.len()).collect();
            let filled = indices
                .chunks(at_once.max(1))
                .map(|turn| {
                    turn.par_iter()
                        .map_with(ready.clone(), |ready, &index| {
                            let start = Instant::now();
                            let mut arena = Arena::new(arena_sizes[index], pinned, device)?;
                            fill(groups, index, &mut arena, weights, device)?;
                            let filled = Instant::now();
                            if !lora_on_device {
                                arena.lock()?;
                            }
                            let locked = Instant::now();
                            *slot(index) = Some(arena);
                            if lora_on_device {
                                let _ = ready.send(index);
                            }
                            Ok((
                                (filled - start).as_secs_f64(),
                                (locked - filled).as_secs_f64(),
                            ))
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>();
            drop(ready);
            let joined = |thread: std::thread::ScopedJoinHandle<'_, Result<f64>>| {
                thread
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("an arena thread panicked")))
            };
            (filled, joined(locker), joined(merger))
        });
        // Merging on the device finishes the filling: counted with it.
        let (locking, merging, times) = (locking?, merging?, filled?.concat());
        let arenas = slots
            .into_iter()
            .map(|a| a.into_inner().unwrap_or_else(|e| e.into_inner()))
            .collect::<Option<Vec<Arena>>>()
            .context("an arena was never filled")?;
        Ok(HostStore {
            groups,
            arenas,
            #[cfg(feature = "cuda")]
            locked: None,
            weights: weights.clone(),
            setup: HostSetup {
                seconds: started.elapsed().as_secs_f64(),
                // Folded from +0.0: an empty f64 sum is -0.0.
                fill_task_seconds: times.iter().fold(merging, |s, t| s + t.0),
                lock_task_seconds: times.iter().fold(locking, |s, t| s + t.1),
            },
        })
    }

    /// The store whose mapped groups sit in `locked` (its setup time counted from the start).
    #[cfg(feature = "cuda")]
    fn with_locked_map(mut self, locked: LockedMap) -> Self {
        self.locked = Some(locked);
        self
    }

    /// Whether copies from the memory map can run asynchronously: its groups' pages are
    /// page-locked in place.
    pub fn map_is_locked(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.locked.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Where the setup's time went.
    pub fn setup(&self) -> HostSetup {
        self.setup
    }

    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    pub fn group(&self, index: usize) -> &HostGroup {
        &self.groups[index]
    }

    /// The layouts of the groups, in order.
    pub fn layouts(&self) -> Vec<super::group::GroupLayout> {
        self.groups.iter().map(|g| g.layout.clone()).collect()
    }

    /// Bytes held in host arenas (pinned or pageable; the memory map is not counted).
    pub fn arena_bytes(&self) -> usize {
        self.arenas.iter().map(|a| a.bytes().len()).sum()
    }

    /// Bytes page-locked: pinned arenas, and the memory map's pages locked in place.
    pub fn pinned_bytes(&self) -> usize {
        let arenas: usize = self
            .arenas
            .iter()
            .filter(|a| a.is_pinned())
            .map(|a| a.bytes().len())
            .sum();
        #[cfg(feature = "cuda")]
        return arenas + self.locked.as_ref().map_or(0, LockedMap::bytes);
        #[cfg(not(feature = "cuda"))]
        arenas
    }

    /// The group's whole image when it sits in an arena.
    pub fn image(&self, index: usize) -> Option<&[u8]> {
        match self.groups[index].place {
            Place::Arena { arena, offset } => {
                Some(&self.arenas[arena].bytes()[offset..offset + self.groups[index].layout.bytes])
            }
            Place::Mapped { .. } => None,
        }
    }

    /// The bytes of slot `k` of group `index`: in its arena, or in the memory map.
    pub fn slot_bytes(&self, index: usize, k: usize) -> Result<&[u8]> {
        let slot = &self.groups[index].layout.slots[k];
        match &self.groups[index].place {
            Place::Arena { arena, offset } => {
                let at = offset + slot.offset;
                Ok(&self.arenas[*arena].bytes()[at..at + slot.bytes()])
            }
            Place::Mapped { converted } => match converted[k] {
                Some((arena, at)) => Ok(&self.arenas[arena].bytes()[at..at + slot.bytes()]),
                None => slot
                    .mapped(&self.weights)
                    .with_context(|| format!("{} is no longer mapped", slot.name)),
            },
        }
    }

    /// The bytes of slot `k` of group `index` in the parts a copy reads each: one, but where
    /// the slot lies in the locked memory map across two of its registrations.
    pub fn slot_pieces(&self, index: usize, k: usize) -> Result<Vec<&[u8]>> {
        let bytes = self.slot_bytes(index, k)?;
        #[cfg(feature = "cuda")]
        if let (Some(locked), Place::Mapped { converted }) =
            (&self.locked, &self.groups[index].place)
        {
            if converted[k].is_none() {
                return Ok(locked.pieces(bytes));
            }
        }
        Ok(vec![bytes])
    }

    /// Copies group `index`'s image into `dst` (CPU threads in parallel; alignment gaps are
    /// left as they are).
    pub fn gather(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let slots = &self.groups[index].layout.slots;
        let ranges = slots.iter().map(|s| s.offset..s.offset + s.bytes());
        let sources = (0..slots.len())
            .map(|k| self.slot_bytes(index, k))
            .collect::<Result<Vec<_>>>()?;
        carve(dst, ranges)
            .into_par_iter()
            .zip(sources)
            .for_each(|(d, s)| d.copy_from_slice(s));
        Ok(())
    }
}

/// Every tensor placed in arena `index` (whole group images, and the converted tensors of mapped
/// groups), with its offset in the arena, in offset order.
fn arena_slots(groups: &[HostGroup], index: usize) -> Vec<(usize, &Slot)> {
    let mut slots: Vec<(usize, &Slot)> = groups
        .iter()
        .flat_map(|g| -> Vec<(usize, &Slot)> {
            match &g.place {
                Place::Arena { arena, offset } if *arena == index => g
                    .layout
                    .slots
                    .iter()
                    .map(|s| (offset + s.offset, s))
                    .collect(),
                Place::Mapped { converted } => converted
                    .iter()
                    .zip(&g.layout.slots)
                    .filter_map(|(c, s)| {
                        c.filter(|(arena, _)| *arena == index)
                            .map(|(_, at)| (at, s))
                    })
                    .collect(),
                Place::Arena { .. } => Vec::new(),
            }
        })
        .collect();
    slots.sort_by_key(|(at, _)| *at);
    slots
}

/// Whether `slot`'s LoRA deltas are merged on the device after its arena is filled and locked
/// ([`merge_on_device`]) rather than by the host threads that fill it.
fn merges_on_device(weights: &WeightSet, slot: &Slot, device: &Device) -> bool {
    cfg!(feature = "cuda")
        && device.is_cuda()
        && slot.packed.is_none()
        && weights.lora_changes(&slot.name)
}

/// Reads every tensor placed in arena `index` into its bytes of `arena`, in parallel (those a
/// LoRA changes unmerged where [`merges_on_device`]).
fn fill(
    groups: &[HostGroup],
    index: usize,
    arena: &mut Arena,
    weights: &WeightSet,
    device: &Device,
) -> Result<()> {
    let slots = arena_slots(groups, index);
    let ranges = slots.iter().map(|(at, s)| *at..at + s.bytes());
    carve(arena.bytes_mut(), ranges)
        .into_par_iter()
        .zip(slots.par_iter())
        .try_for_each(|(dst, (_, slot))| {
            if merges_on_device(weights, slot, device) {
                weights.read_unmerged_into(&slot.name, &slot.shape, slot.dtype, dst)
            } else {
                slot.read(weights, dst)
            }
        })
        .context("reading offloaded weights into host memory")
}

/// Merges the LoRA deltas of arena `index`'s tensors that [`merges_on_device`] on the GPU, in
/// place: each goes up from the (page-locked) arena, is merged where it landed
/// ([`WeightSet::merge_in_place`]: the host merge's bits) and comes back. A 14B's LoRA on every
/// projection sends 28 GB each way, which is the link's time (~0.5 s a direction) when the
/// copies are all that the GPU does: the weights alternate between two streams, so one weight's
/// copy up runs beside the other's copy down, and the next waits only for the weight two before
/// it (so the device holds two weights at most). One thread merges, arena after arena, while the
/// others fill.
#[cfg(feature = "cuda")]
fn merge_on_device(
    groups: &[HostGroup],
    index: usize,
    arena: &mut Arena,
    weights: &WeightSet,
    device: &Device,
) -> Result<()> {
    use candle_core::cuda::cudarc::driver::DevicePtrMut;
    let Device::Cuda(dev) = device else {
        return Ok(());
    };
    let slots: Vec<(usize, &Slot)> = arena_slots(groups, index)
        .into_iter()
        .filter(|(_, s)| merges_on_device(weights, s, device))
        .collect();
    if slots.is_empty() {
        return Ok(());
    }
    let ctx = dev.cuda_stream().context().clone();
    // SAFETY: as for the offload copy stream (transfer.rs): the only memory these streams share
    // with candle's is the arena, whose copies are waited for below before it is read again.
    unsafe { ctx.disable_event_tracking() };
    let streams = [ctx.new_stream()?, ctx.new_stream()?];
    let bytes = arena.bytes_mut();
    for (n, (at, slot)) in slots.into_iter().enumerate() {
        let stream = &streams[n % 2];
        // The weight two before is back in the arena and its device copy free.
        if n >= 2 {
            stream.synchronize()?;
        }
        let piece = &mut bytes[at..at + slot.bytes()];
        // SAFETY: the copy up below writes every byte before the kernel reads any.
        let mut landed = unsafe { stream.alloc::<u8>(piece.len()) }?;
        stream.memcpy_htod(&*piece, &mut landed)?;
        {
            let (address, _write) = landed.device_ptr_mut(stream);
            weights.merge_in_place(
                &slot.name,
                dev,
                stream,
                address,
                slot.shape.dims(),
                slot.dtype,
            )?;
        }
        stream.memcpy_dtoh(&landed, piece)?;
    }
    for stream in &streams {
        stream.synchronize()?;
    }
    Ok(())
}

/// Disjoint mutable pieces of `buffer` at `ranges` (sorted, not overlapping), so threads can
/// fill them in parallel.
pub(super) fn carve(
    buffer: &mut [u8],
    ranges: impl IntoIterator<Item = Range<usize>>,
) -> Vec<&mut [u8]> {
    let mut pieces = Vec::new();
    let mut rest = buffer;
    let mut consumed = 0;
    for range in ranges {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(range.start - consumed);
        let (piece, tail) = tail.split_at_mut(range.len());
        pieces.push(piece);
        rest = tail;
        consumed = range.end;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::carve;

    /// Carved pieces are exactly the ranges asked for, and writing them fills only those bytes.
    #[test]
    fn carve_gives_the_ranges_and_nothing_else() {
        let mut buffer = vec![0u8; 32];
        let pieces = carve(&mut buffer, [2..5, 5..6, 10..32]);
        assert_eq!(
            pieces.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [3, 1, 22]
        );
        for (i, piece) in pieces.into_iter().enumerate() {
            piece.fill(i as u8 + 1);
        }
        assert_eq!(&buffer[..6], &[0, 0, 1, 1, 1, 2]);
        assert!(buffer[6..10].iter().all(|&b| b == 0));
        assert!(buffer[10..].iter().all(|&b| b == 3));
    }
}
