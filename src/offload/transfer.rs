//! Moving a group's host image to the device: one copy per dtype section, into device slots
//! reused round-robin, on a dedicated copy stream ordered with CUDA events (or one copy per
//! tensor from the page-locked memory map, or through a pinned staging ring in bounded mode); a
//! whole parked component gets fresh memory instead. Resident parts load through the same
//! staging ring straight from the weights ([`Transfer::load`]).

use super::group::GroupLayout;
use super::host::HostStore;
#[cfg(feature = "cuda")]
use anyhow::Context;
use anyhow::Result;
use candle_core::{Device, Tensor};
use serde::Serialize;
use std::sync::Mutex;

/// What the copies cost.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct CopyStats {
    /// Bytes copied host -> device.
    pub bytes: u64,
    /// Groups moved.
    pub groups: u64,
    /// Time the copy engine spent copying (CUDA events around each group's copies).
    pub busy_seconds: f64,
}

impl CopyStats {
    /// What was copied since `earlier` (a snapshot of the same counters).
    pub fn since(&self, earlier: &CopyStats) -> CopyStats {
        CopyStats {
            bytes: self.bytes - earlier.bytes,
            groups: self.groups - earlier.groups,
            busy_seconds: self.busy_seconds - earlier.busy_seconds,
        }
    }

    /// Copy throughput while busy, GB/s.
    pub fn gb_per_second(&self) -> f64 {
        if self.busy_seconds > 0.0 {
            self.bytes as f64 / self.busy_seconds / 1e9
        } else {
            0.0
        }
    }
}

/// A group on the device, waiting for its copies to land.
pub struct Uploaded {
    pub index: usize,
    /// The device slot it was copied into (streamed groups), to retire after use.
    pub slot: Option<usize>,
    pub tensors: Vec<(String, Tensor)>,
    #[cfg(feature = "cuda")]
    ready: Option<cudarc::driver::CudaEvent>,
}

/// Device buffers that streamed groups are copied into, reused round-robin: no allocation or
/// free per group, so nothing on the copy stream waits for the allocator, and the pool holds
/// exactly what is used. In exact fills ([`super::StreamOptions::exact_fills`]) each fill
/// allocates the slot's buffers at its own size on the copy stream, where the last fill's
/// are freed once its work is done.
#[derive(Default)]
pub struct DeviceSlot {
    /// One flat buffer per dtype (holding the sections of that dtype of the groups it carries),
    /// with its address.
    #[cfg(feature = "cuda")]
    buffers: Mutex<Vec<(candle_core::DType, Tensor, u64)>>,
    /// Recorded on the compute stream once the slot's last group was used: the next copy into
    /// the slot waits for it.
    #[cfg(feature = "cuda")]
    done: Mutex<Option<cudarc::driver::CudaEvent>>,
    /// Set by a copy into the slot, cleared when the slot is retired: retiring is invisible off
    /// CUDA, and this lets CPU tests check that every pass, one ended early included, retires
    /// the slots it used.
    #[cfg(test)]
    in_use: std::sync::atomic::AtomicBool,
}

#[cfg(test)]
impl DeviceSlot {
    /// Whether a group copied into the slot has not been retired yet.
    pub(super) fn in_use(&self) -> bool {
        self.in_use.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Where a streamed group lands: slot `index`, each of its sections at its byte offset in
/// the slot's buffer of that dtype ([`super::residency::SlotRuns`]); `first`: the first group
/// of this fill of the slot; `exact`: the fill allocates the slot's buffers at its own size.
#[derive(Clone, Copy)]
pub struct SlotPlace<'a> {
    pub index: usize,
    pub slot: &'a DeviceSlot,
    pub offsets: &'a [usize],
    pub first: bool,
    pub exact: bool,
}

/// Moves groups from a `HostStore` to a device.
pub struct Transfer {
    device: Device,
    stats: Mutex<CopyStats>,
    #[cfg(feature = "cuda")]
    cuda: Option<cuda::CudaTransfer>,
}

impl Transfer {
    /// Copies to `device`; with `stream`, streamed groups are copied on a stream of their own
    /// (CUDA). `staging_bytes` sets up a ring of two pinned buffers of half that size each
    /// (bounded mode, resident loading).
    pub fn new(device: &Device, stream: bool, staging_bytes: Option<usize>) -> Result<Self> {
        let _ = (stream, staging_bytes);
        Ok(Transfer {
            device: device.clone(),
            stats: Mutex::new(CopyStats::default()),
            #[cfg(feature = "cuda")]
            cuda: match device {
                Device::Cuda(dev) => Some(cuda::CudaTransfer::new(dev, stream, staging_bytes)?),
                _ => None,
            },
        })
    }

    /// Pinned bytes of the staging ring.
    pub fn staging_bytes(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            return cuda.staging_bytes();
        }
        0
    }

    /// `count` device slots big enough for any of `groups` (empty off CUDA, where each group
    /// gets fresh tensors).
    pub fn slots(&self, groups: &[GroupLayout], count: usize) -> Result<Vec<DeviceSlot>> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            return cuda.slots(groups, count);
        }
        let _ = groups;
        Ok((0..count).map(|_| DeviceSlot::default()).collect())
    }

    /// Starts moving group `index` to the device: into its place in a slot (on the copy
    /// stream) or into fresh memory (on the compute stream). Its tensors may be used once
    /// `ready` ran.
    pub fn upload(
        &self,
        store: &HostStore,
        index: usize,
        place: Option<SlotPlace>,
    ) -> Result<Uploaded> {
        // Marked before the copy is counted: a test that waits for the count sees the mark.
        #[cfg(test)]
        if let Some(place) = place {
            place
                .slot
                .in_use
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let layout = &store.group(index).layout;
        self.count(layout.bytes);
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            let (tensors, ready) = cuda.upload(store, index, place)?;
            return Ok(Uploaded {
                index,
                slot: place.map(|p| p.index),
                tensors,
                ready,
            });
        }
        // Other devices: assemble the image on the host and let candle copy each section.
        let mut image = vec![0u8; layout.bytes];
        store.gather(index, &mut image)?;
        let sections = layout
            .sections
            .iter()
            .map(|s| {
                Tensor::from_raw_buffer(
                    &image[s.offset..s.offset + s.bytes],
                    s.dtype,
                    &[s.bytes / s.dtype.size_in_bytes()],
                    &self.device,
                )
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Uploaded {
            index,
            slot: place.map(|p| p.index),
            tensors: layout.views(&sections)?,
            #[cfg(feature = "cuda")]
            ready: None,
        })
    }

    /// The tensors `slots` ask for, from `weights` into fresh device memory (one allocation
    /// each) through the staging ring, on the compute stream; returns once every copy is done.
    #[cfg(feature = "cuda")]
    pub fn load(
        &self,
        weights: &crate::weights::WeightSet,
        slots: &[super::group::Slot],
    ) -> Result<Vec<(String, Tensor)>> {
        self.cuda
            .as_ref()
            .context("staged loading needs a CUDA device")?
            .load(weights, slots)
    }

    /// Makes the compute stream wait for the group's copies (call on the computing thread,
    /// just before the group computes: the wait is placed at that point of the stream).
    pub fn ready(&self, uploaded: &Uploaded) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let (Some(cuda), Some(event)) = (&self.cuda, &uploaded.ready) {
            cuda.compute_waits(event)?;
        }
        let _ = uploaded;
        Ok(())
    }

    /// Blocks until every copy issued so far has completed, so the host memory they read can be
    /// released.
    pub fn wait_idle(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            cuda.wait_idle()?;
        }
        Ok(())
    }

    /// Call on the computing thread once a streamed group's work is queued: the next copy into
    /// its slot waits for that work to finish.
    pub fn retire(&self, slot: &DeviceSlot) -> Result<()> {
        #[cfg(test)]
        slot.in_use
            .store(false, std::sync::atomic::Ordering::Relaxed);
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            cuda.retire(slot)?;
        }
        let _ = slot;
        Ok(())
    }

    /// Frees `slot`'s buffers (exact fills) once the work of its last fill is done, ordered on
    /// the copy stream: call on the computing thread when no copy is being issued.
    pub fn free_fill(&self, slot: &DeviceSlot) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            cuda.free_fill(slot)?;
        }
        let _ = slot;
        Ok(())
    }

    /// The copies so far; reads the copy timing events, so call it after a device sync.
    pub fn stats(&self) -> CopyStats {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            let busy = cuda.busy_seconds();
            if let Ok(mut s) = self.stats.lock() {
                s.busy_seconds += busy;
            }
        }
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }

    fn count(&self, bytes: usize) {
        if let Ok(mut s) = self.stats.lock() {
            s.bytes += bytes as u64;
            s.groups += 1;
        }
    }
}

/// `tensor` in host memory. A CUDA tensor comes through two pinned buffers that the device fills
/// in turn while every core copies the other out: a decoded 81x480x832 video (388 MB of f32)
/// took 0.24-0.29 s through the driver's pageable copy (an H200, `bench/RESULTS.md` session 31).
pub fn to_host(tensor: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = tensor.device() {
        return cuda::download(tensor, dev);
    }
    Ok(tensor.to_device(&Device::Cpu)?)
}

/// Tensors appended to host memory piece by piece (a video decoded clip by clip): on CUDA
/// through two pinned buffers made at the first piece and kept for the rest, straight into the
/// values' spare capacity. A 5 s MiniMax H3 video leaves the device in 31 pieces: with buffers
/// made and locked for each and a second host copy, its handoff cost 2.1-2.4 s of the decode
/// stage on an H100, about 0.3 s so (`bench/RESULTS.md`, session 60).
#[derive(Default)]
pub struct Download {
    #[cfg(feature = "cuda")]
    pinned: Option<cuda::PinnedPair>,
}

impl Download {
    /// Appends `tensor`'s values, in row-major order, to `values` (of the tensor's dtype).
    pub fn append<T: candle_core::WithDType>(
        &mut self,
        tensor: &Tensor,
        values: &mut Vec<T>,
    ) -> Result<()> {
        anyhow::ensure!(
            tensor.dtype() == T::DTYPE,
            "cannot append {:?} values to {:?} ones",
            tensor.dtype(),
            T::DTYPE
        );
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = tensor.device() {
            let pinned = match &mut self.pinned {
                Some(pinned) => pinned,
                none => none.insert(cuda::PinnedPair::new(dev)?),
            };
            return cuda::append(tensor, dev, pinned, values);
        }
        let host = tensor.to_device(&Device::Cpu)?.contiguous()?;
        let (storage, layout) = host.storage_and_layout();
        let candle_core::Storage::Cpu(storage) = &*storage else {
            anyhow::bail!("a host tensor without host storage")
        };
        let start = layout.start_offset();
        values.extend_from_slice(&storage.as_slice::<T>()?[start..start + host.elem_count()]);
        Ok(())
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::super::group::Slot;
    use super::super::host::{Arena, HostStore};
    use super::super::staging::{self, Chunk, Landing, Ring};
    use super::{DeviceSlot, GroupLayout, SlotPlace};
    use crate::weights::WeightSet;
    use anyhow::{Context, Result};
    use candle_core::cuda_backend::{CudaDevice, CudaStorage};
    use candle_core::{op::BackpropOp, DType, Device, Storage, Tensor, WithDType};
    use cudarc::driver::{sys, CudaEvent, CudaStream, DevicePtr};
    use rayon::prelude::*;
    use std::borrow::Cow;
    use std::mem::MaybeUninit;
    use std::sync::{Arc, Mutex};

    /// `$each!(T)` for the Rust type `T` of `$dtype` (a dtype the engine moves); any other is
    /// an error: "cannot `$what` .. tensors".
    macro_rules! by_dtype {
        ($dtype:expr, $what:expr, $each:ident) => {
            match $dtype {
                DType::BF16 => $each!(half::bf16),
                DType::F16 => $each!(half::f16),
                DType::F32 => $each!(f32),
                DType::F64 => $each!(f64),
                DType::U8 => $each!(u8),
                DType::U32 => $each!(u32),
                DType::I64 => $each!(i64),
                other => anyhow::bail!("cannot {} {other:?} tensors", $what),
            }
        };
    }

    /// A group's tensors by name.
    type NamedTensors = Vec<(String, Tensor)>;

    /// One buffer of the staging ring and the copy that last read it.
    struct StagingSlot {
        buffer: Arena,
        done: Option<CudaEvent>,
    }

    /// Copies on a stream of their own, ordered against candle's compute stream with events.
    pub struct CudaTransfer {
        device: CudaDevice,
        /// Where streamed groups are copied (the compute stream itself without `stream`).
        copy: Arc<CudaStream>,
        staging: Option<Vec<Mutex<StagingSlot>>>,
        next_staging: Mutex<usize>,
        /// Timing events around each group's copies, read (and cleared) by `busy_seconds`.
        timings: Mutex<Vec<(CudaEvent, CudaEvent)>>,
    }

    /// Allocates `elems` of `dtype` on `stream`: a flat tensor and its address.
    fn alloc(
        device: &CudaDevice,
        stream: &Arc<CudaStream>,
        dtype: DType,
        elems: usize,
    ) -> Result<(Tensor, u64)> {
        macro_rules! alloc {
            ($t:ty) => {{
                // SAFETY: every byte a tensor view covers is written by a copy before use.
                let slice = unsafe { stream.alloc::<$t>(elems) }?;
                let ptr = slice.device_ptr(stream).0;
                (CudaStorage::wrap_cuda_slice(slice, device.clone()), ptr)
            }};
        }
        let (storage, ptr) = by_dtype!(dtype, "offload", alloc);
        let tensor = Tensor::from_storage(Storage::Cuda(storage), elems, BackpropOp::none(), false);
        Ok((tensor, ptr))
    }

    impl CudaTransfer {
        pub fn new(
            device: &CudaDevice,
            stream: bool,
            staging_bytes: Option<usize>,
        ) -> Result<Self> {
            let compute = device.cuda_stream();
            let copy = if stream {
                // cudarc would otherwise track every tensor's use across streams with events on
                // each kernel launch; candle computes on one stream and the offload engine
                // orders its copies with its own events, so that tracking is turned off.
                // SAFETY: the only cross-stream memory is the engine's slots, ordered below.
                unsafe { compute.context().disable_event_tracking() };
                compute
                    .context()
                    .new_stream()
                    .context("creating the offload copy stream")?
            } else {
                compute
            };
            let staging = match staging_bytes {
                Some(total) => Some(
                    (0..2)
                        .map(|_| {
                            let bytes = (total / 2).max(1 << 20);
                            let mut buffer =
                                Arena::new(bytes, true, &Device::Cuda(device.clone()))?;
                            // Touched by every core first: page-locking memory already
                            // there is ~10x faster than locking untouched pages.
                            buffer
                                .bytes_mut()
                                .par_chunks_mut(1 << 20)
                                .for_each(|page| page.fill(0));
                            buffer.lock()?;
                            Ok(Mutex::new(StagingSlot { buffer, done: None }))
                        })
                        .collect::<Result<Vec<_>>>()?,
                ),
                None => None,
            };
            Ok(CudaTransfer {
                device: device.clone(),
                copy,
                staging,
                next_staging: Mutex::new(0),
                timings: Mutex::new(Vec::new()),
            })
        }

        pub fn staging_bytes(&self) -> usize {
            self.staging.as_ref().map_or(0, |ring| {
                ring.iter()
                    .filter_map(|s| s.lock().ok().map(|s| s.buffer.bytes().len()))
                    .sum()
            })
        }

        pub fn slots(&self, groups: &[GroupLayout], count: usize) -> Result<Vec<DeviceSlot>> {
            let need = crate::offload::residency::slot_sections(groups);
            let compute = self.device.cuda_stream();
            let slots = (0..count)
                .map(|_| {
                    let buffers = need
                        .iter()
                        .map(|&(dtype, bytes)| {
                            let (t, ptr) = alloc(
                                &self.device,
                                &compute,
                                dtype,
                                bytes / dtype.size_in_bytes(),
                            )?;
                            Ok((dtype, t, ptr))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Ok(DeviceSlot {
                        buffers: Mutex::new(buffers),
                        done: Mutex::new(None),
                        #[cfg(test)]
                        in_use: Default::default(),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            // The slots are used from the copy stream: their allocation must be complete.
            compute.synchronize()?;
            Ok(slots)
        }

        /// Copies group `index` into its place in a slot on the copy stream, or into fresh
        /// memory on the compute stream; returns its tensors and, for a slot, the event the
        /// compute waits for.
        pub fn upload(
            &self,
            store: &HostStore,
            index: usize,
            place: Option<SlotPlace>,
        ) -> Result<(NamedTensors, Option<CudaEvent>)> {
            let layout = &store.group(index).layout;
            let (stream, mut sections, mut targets) = (
                match place {
                    Some(_) => self.copy.clone(),
                    None => self.device.cuda_stream(),
                },
                Vec::with_capacity(layout.sections.len()),
                Vec::with_capacity(layout.sections.len()),
            );
            let poisoned = || anyhow::anyhow!("slot poisoned");
            // The fill's first group waits for the slot's last use; the others follow it on the
            // copy stream (a group of this fill retired meanwhile must not hold them back). An
            // exact fill then frees the slot's last buffers, ordered after that wait, and
            // allocates its own.
            if let Some(place) = place.filter(|p| p.first) {
                let done = place.slot.done.lock().map_err(|_| poisoned())?.take();
                if let Some(done) = done {
                    stream.wait(&done)?;
                }
                if place.exact {
                    let mut buffers = place.slot.buffers.lock().map_err(|_| poisoned())?;
                    buffers.clear();
                    for (dtype, bytes) in crate::offload::residency::dtype_bytes(layout) {
                        let (t, ptr) =
                            alloc(&self.device, &stream, dtype, bytes / dtype.size_in_bytes())?;
                        buffers.push((dtype, t, ptr));
                    }
                }
            }
            let buffers = match place {
                Some(place) => Some(place.slot.buffers.lock().map_err(|_| poisoned())?),
                None => None,
            };
            for (k, s) in layout.sections.iter().enumerate() {
                let size = s.dtype.size_in_bytes();
                let elems = s.bytes / size;
                let (tensor, ptr) = match (place, &buffers) {
                    (Some(place), Some(buffers)) => {
                        let (_, base, ptr) = buffers
                            .iter()
                            .find(|(d, _, _)| *d == s.dtype)
                            .context("device slot lacks a dtype")?;
                        let at = place.offsets[k];
                        (base.narrow(0, at / size, elems)?, *ptr + at as u64)
                    }
                    _ => alloc(&self.device, &stream, s.dtype, elems)?,
                };
                sections.push(tensor);
                targets.push((s.offset..s.offset + s.bytes, ptr));
            }
            drop(buffers);
            let begin = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            match (store.image(index), &self.staging) {
                (Some(image), None) => {
                    for (range, ptr) in &targets {
                        copy(&stream, *ptr, &image[range.clone()])?;
                    }
                }
                (_, Some(ring)) => self.staged(&stream, store, index, &targets, ring)?,
                (None, None) if store.map_is_locked() => {
                    // Each tensor straight from its page-locked pages in the memory map (or its
                    // pinned arena, converted).
                    let slots = &store.group(index).layout.slots;
                    for (k, address) in slot_addresses(slots, &targets).into_iter().enumerate() {
                        let mut at = address;
                        for piece in store.slot_pieces(index, k)? {
                            if !piece.is_empty() {
                                copy(&stream, at, piece)?;
                            }
                            at += piece.len() as u64;
                        }
                    }
                }
                (None, None) => {
                    anyhow::bail!("group {index} has no host image and no staging ring")
                }
            }
            let end = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            let ready = place.map(|_| stream.record_event(None)).transpose()?;
            if let Ok(mut t) = self.timings.lock() {
                t.push((begin, end));
            }
            Ok((layout.views(&sections)?, ready))
        }

        /// Bounded mode: each tensor of the group from its arena or the memory map, chunk by
        /// chunk through the pinned staging ring (CPU threads fill), to its place in its section.
        fn staged(
            &self,
            stream: &Arc<CudaStream>,
            store: &HostStore,
            index: usize,
            targets: &[(std::ops::Range<usize>, u64)],
            ring: &[Mutex<StagingSlot>],
        ) -> Result<()> {
            let slots = &store.group(index).layout.slots;
            let mut ring = CudaRing::new(self, ring, stream, slot_addresses(slots, targets))?;
            let sizes: Vec<usize> = slots.iter().map(Slot::bytes).collect();
            staging::run(
                &sizes,
                &mut ring,
                |_, i| Ok(Cow::Borrowed(store.slot_bytes(index, i)?)),
                |_, _| Ok(()),
            )
        }

        /// The tensors `slots` ask for, each in fresh memory on the compute stream, through
        /// the staging ring ([`staging::load_tensors`]); waits for the copies, so the ring may
        /// be released.
        pub fn load(&self, weights: &WeightSet, slots: &[Slot]) -> Result<Vec<(String, Tensor)>> {
            let ring = self.staging.as_deref().context("no staging ring")?;
            let stream = self.device.cuda_stream();
            let mut landing = CudaLanding {
                ring: CudaRing::new(self, ring, &stream, vec![0; slots.len()])?,
                tensors: vec![None; slots.len()],
            };
            let loaded = staging::load_tensors(weights, slots, &mut landing);
            self.wait_idle()?;
            loaded
        }

        /// Waits for the copy stream and the compute stream (copies without `stream` run there).
        pub fn wait_idle(&self) -> Result<()> {
            self.copy.synchronize()?;
            Ok(self.device.cuda_stream().synchronize()?)
        }

        /// The compute stream (this thread's) waits for `event`.
        pub fn compute_waits(&self, event: &CudaEvent) -> Result<()> {
            Ok(self.device.cuda_stream().wait(event)?)
        }

        /// Records, on this thread's compute stream, that `slot`'s group is no longer needed.
        pub fn retire(&self, slot: &DeviceSlot) -> Result<()> {
            let event = self.device.cuda_stream().record_event(None)?;
            *slot
                .done
                .lock()
                .map_err(|_| anyhow::anyhow!("slot poisoned"))? = Some(event);
            Ok(())
        }

        /// Frees `slot`'s buffers on the copy stream once the work its last fill retired is
        /// done (exact fills; the buffers were allocated there).
        pub fn free_fill(&self, slot: &DeviceSlot) -> Result<()> {
            let poisoned = || anyhow::anyhow!("slot poisoned");
            if let Some(done) = slot.done.lock().map_err(|_| poisoned())?.take() {
                self.copy.wait(&done)?;
            }
            slot.buffers.lock().map_err(|_| poisoned())?.clear();
            Ok(())
        }

        /// Seconds spent in the recorded copies (their events must have completed).
        pub fn busy_seconds(&self) -> f64 {
            let Ok(mut timings) = self.timings.lock() else {
                return 0.0;
            };
            let total = timings
                .iter()
                .filter_map(|(b, e)| b.elapsed_ms(e).ok())
                .map(|ms| ms as f64 / 1e3)
                .sum();
            timings.clear();
            total
        }
    }

    /// The device address of each of `slots`, in the sections at `targets` (image byte ranges
    /// and the device address each starts at).
    fn slot_addresses(slots: &[Slot], targets: &[(std::ops::Range<usize>, u64)]) -> Vec<u64> {
        slots
            .iter()
            .map(|slot| {
                targets
                    .iter()
                    .find(|(range, _)| range.contains(&slot.offset))
                    .map_or(0, |(range, ptr)| ptr + (slot.offset - range.start) as u64)
            })
            .collect()
    }

    /// The staging ring's buffers, used in turn across calls, and the device address each
    /// item's bytes go to.
    struct CudaRing<'a> {
        transfer: &'a CudaTransfer,
        ring: &'a [Mutex<StagingSlot>],
        stream: &'a Arc<CudaStream>,
        chunk: usize,
        targets: Vec<u64>,
    }

    impl<'a> CudaRing<'a> {
        fn new(
            transfer: &'a CudaTransfer,
            ring: &'a [Mutex<StagingSlot>],
            stream: &'a Arc<CudaStream>,
            targets: Vec<u64>,
        ) -> Result<Self> {
            let chunk = ring[0]
                .lock()
                .map_err(|_| anyhow::anyhow!("staging ring poisoned"))?
                .buffer
                .bytes()
                .len();
            Ok(CudaRing {
                transfer,
                ring,
                stream,
                chunk,
                targets,
            })
        }
    }

    impl Ring for CudaRing<'_> {
        fn chunk_bytes(&self) -> usize {
            self.chunk
        }

        fn pass(
            &mut self,
            chunk: &Chunk,
            fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
        ) -> Result<()> {
            let poisoned = || anyhow::anyhow!("staging ring poisoned");
            let next = {
                let mut next = self.transfer.next_staging.lock().map_err(|_| poisoned())?;
                *next = (*next + 1) % self.ring.len();
                *next
            };
            let mut staging = self.ring[next].lock().map_err(|_| poisoned())?;
            if let Some(done) = staging.done.take() {
                done.synchronize()?;
            }
            fill(&mut staging.buffer.bytes_mut()[..chunk.len])?;
            for piece in chunk.pieces.iter().filter(|p| !p.bytes.is_empty()) {
                let src = &staging.buffer.bytes()[piece.at..piece.at + piece.bytes.len()];
                let dst = self.targets[piece.item] + piece.bytes.start as u64;
                copy(self.stream, dst, src)?;
            }
            staging.done = Some(self.stream.record_event(None)?);
            Ok(())
        }
    }

    /// Resident loading: each tensor lands in fresh memory of its own.
    struct CudaLanding<'a> {
        ring: CudaRing<'a>,
        tensors: Vec<Option<Tensor>>,
    }

    impl Ring for CudaLanding<'_> {
        fn chunk_bytes(&self) -> usize {
            self.ring.chunk_bytes()
        }

        fn pass(
            &mut self,
            chunk: &Chunk,
            fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
        ) -> Result<()> {
            self.ring.pass(chunk, fill)
        }
    }

    impl Landing for CudaLanding<'_> {
        fn reserve(&mut self, item: usize, dtype: DType, elems: usize) -> Result<()> {
            let (tensor, ptr) = alloc(&self.ring.transfer.device, self.ring.stream, dtype, elems)?;
            self.ring.targets[item] = ptr;
            self.tensors[item] = Some(tensor);
            Ok(())
        }

        fn take(&mut self, item: usize) -> Result<Tensor> {
            self.tensors[item]
                .take()
                .context("a staged tensor was never reserved")
        }
    }

    /// Copies `src` (pinned: asynchronous; pageable: staged by the driver) to `dst` on `stream`.
    fn copy(stream: &CudaStream, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: `dst` is a live device buffer of at least `src.len()` bytes; host memory
        // outlives the copy (arenas live as long as the engine; a staging buffer is refilled
        // only after the event recorded after its copies completed).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, stream.cu_stream()) }?;
        Ok(())
    }

    /// Bytes of each of [`PinnedPair`]'s buffers: a 32 MiB copy takes ~0.6 ms at the link's
    /// speed, and copying it out splits into 1 MiB pieces for every core.
    const DOWNLOAD_CHUNK: usize = 32 << 20;

    /// [`super::to_host`] on CUDA: what fits one buffer through the driver's copy, the rest
    /// through a [`super::Download`] of its own.
    pub fn download(tensor: &Tensor, dev: &CudaDevice) -> Result<Tensor> {
        let (dtype, shape) = (tensor.dtype(), tensor.shape().clone());
        if tensor.elem_count() * dtype.size_in_bytes() <= DOWNLOAD_CHUNK {
            return Ok(tensor.to_device(&Device::Cpu)?);
        }
        let mut download = super::Download {
            pinned: Some(PinnedPair::new(dev)?),
        };
        macro_rules! host_tensor {
            ($t:ty) => {{
                let mut values = Vec::<$t>::new();
                download.append(tensor, &mut values)?;
                Tensor::from_vec(values, shape, &Device::Cpu)?
            }};
        }
        Ok(by_dtype!(dtype, "copy to the host", host_tensor))
    }

    /// [`super::Download::append`] on CUDA (which checked that `T` is the tensor's dtype):
    /// copies on candle's stream after the work that made `tensor`, through `pinned`, straight
    /// into `values`' spare capacity.
    pub fn append<T: WithDType>(
        tensor: &Tensor,
        dev: &CudaDevice,
        pinned: &mut PinnedPair,
        values: &mut Vec<T>,
    ) -> Result<()> {
        let tensor = tensor.contiguous()?;
        let (dtype, elems) = (tensor.dtype(), tensor.elem_count());
        let stream = dev.cuda_stream();
        let src = {
            let (storage, layout) = tensor.storage_and_layout();
            let Storage::Cuda(storage) = &*storage else {
                anyhow::bail!("a CUDA tensor without CUDA storage")
            };
            macro_rules! address {
                ($t:ty) => {
                    storage.as_cuda_slice::<$t>()?.device_ptr(&stream).0
                };
            }
            let base = by_dtype!(dtype, "copy to the host", address);
            base + (layout.start_offset() * dtype.size_in_bytes()) as u64
        };
        values.reserve(elems);
        let spare = &mut values.spare_capacity_mut()[..elems];
        // SAFETY: the view covers the reserved elements alone (`T` is the tensor's dtype, so as
        // many bytes as the device holds), written as bytes before any is read (plain numbers:
        // any byte pattern is a value).
        let view = unsafe {
            std::slice::from_raw_parts_mut(
                spare.as_mut_ptr().cast::<MaybeUninit<u8>>(),
                std::mem::size_of_val(spare),
            )
        };
        pinned.download_into(view, src, &stream)?;
        // SAFETY: `download_into` wrote every byte of the `elems` reserved values.
        unsafe { values.set_len(values.len() + elems) };
        Ok(())
    }

    /// Two pinned buffers that the device fills in turn while every core copies the other out;
    /// kept across the pieces of one download (allocating and locking them costs more than
    /// a 32 MiB copy).
    pub struct PinnedPair {
        buffers: [Arena; 2],
    }

    impl PinnedPair {
        pub fn new(dev: &CudaDevice) -> Result<Self> {
            let device = Device::Cuda(dev.clone());
            let buffer = || -> Result<Arena> {
                let mut buffer = Arena::new(DOWNLOAD_CHUNK, true, &device)?;
                // Touched by every core first: locking pages already there is ~10x faster.
                buffer
                    .bytes_mut()
                    .par_chunks_mut(1 << 20)
                    .for_each(|page| page.fill(0));
                buffer.lock()?;
                Ok(buffer)
            };
            Ok(PinnedPair {
                buffers: [buffer()?, buffer()?],
            })
        }

        /// Fills `host` with the bytes at device address `src`.
        fn download_into(
            &mut self,
            host: &mut [MaybeUninit<u8>],
            src: u64,
            stream: &Arc<CudaStream>,
        ) -> Result<()> {
            let buffers = &mut self.buffers;
            let chunks: Vec<std::ops::Range<usize>> = (0..host.len())
                .step_by(DOWNLOAD_CHUNK)
                .map(|at| at..(at + DOWNLOAD_CHUNK).min(host.len()))
                .collect();
            let start = |i: usize, buffers: &mut [Arena; 2]| -> Result<CudaEvent> {
                let range = chunks[i].clone();
                let dst = &mut buffers[i % 2].bytes_mut()[..range.len()];
                // SAFETY: `src` holds `host.len()` bytes that nothing writes before this returns
                // (it waits for every copy); the pinned buffer is read only once the event
                // completed.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        dst,
                        src + range.start as u64,
                        stream.cu_stream(),
                    )
                }?;
                Ok(stream.record_event(None)?)
            };
            let mut pending = if chunks.is_empty() {
                None
            } else {
                Some(start(0, buffers)?)
            };
            for (i, range) in chunks.iter().enumerate() {
                let landed = pending
                    .take()
                    .context("a download chunk was never started")?;
                // The other buffer was copied out in the previous turn: the device may fill it.
                if i + 1 < chunks.len() {
                    pending = Some(start(i + 1, buffers)?);
                }
                landed.synchronize()?;
                host[range.clone()]
                    .par_chunks_mut(1 << 20)
                    .zip(buffers[i % 2].bytes()[..range.len()].par_chunks(1 << 20))
                    // SAFETY: equal lengths (zipped 1 MiB pieces of equal ranges), no overlap.
                    .for_each(|(dst, src)| unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.as_ptr(),
                            dst.as_mut_ptr().cast::<u8>(),
                            src.len(),
                        )
                    });
            }
            Ok(())
        }
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    use super::super::group::{record, Packing};
    use super::super::host::{HostMemory, HostStore};
    use super::{SlotPlace, Transfer};
    use crate::weights::{WeightSet, Weights};
    use anyhow::Result;
    use candle_core::{DType, Device, Tensor};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// Through the two pinned buffers (several chunks and a partial one; a view that starts
    /// inside its storage; bf16 and f32) a tensor reaches the host bit for bit as the driver's
    /// own copy brings it.
    #[test]
    fn a_tensor_reaches_the_host_through_the_pinned_buffers_bit_for_bit() -> Result<()> {
        let dev = Device::new_cuda(0)?;
        let elems = 3 * (32 << 20) / 4 + 12_345;
        let whole = Tensor::randn(0f32, 1f32, (2, elems), &dev)?;
        for tensor in [
            whole.clone(),
            whole.narrow(0, 1, 1)?,
            whole.to_dtype(DType::BF16)?,
        ] {
            let ours = super::to_host(&tensor)?;
            let theirs = tensor.to_device(&Device::Cpu)?;
            assert!(ours.device().is_cpu());
            assert_eq!(ours.dims(), theirs.dims());
            assert_eq!(ours.dtype(), theirs.dtype());
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .into_iter()
                    .map(f32::to_bits)
                    .collect())
            };
            assert!(
                bits(&ours)? == bits(&theirs)?,
                "{:?} differs",
                tensor.dims()
            );
        }
        Ok(())
    }

    /// Pieces appended through one [`super::Download`] (larger than a buffer, smaller, empty,
    /// a view inside its storage) come out in order, bit for bit as the driver copies them.
    #[test]
    fn pieces_append_bit_for_bit_through_kept_buffers() -> Result<()> {
        let dev = Device::new_cuda(0)?;
        let whole = Tensor::randn(0f32, 1f32, (3 * (32 << 20) / 4 + 777,), &dev)?;
        let pieces = [
            whole.clone(),
            whole.narrow(0, 5, 1000)?,
            whole.narrow(0, 0, 0)?,
            whole.narrow(0, 12_345, (32 << 20) / 4)?,
        ];
        let mut download = super::Download::default();
        let mut ours: Vec<f32> = Vec::new();
        let mut theirs: Vec<f32> = Vec::new();
        for piece in &pieces {
            download.append(piece, &mut ours)?;
            theirs.extend(piece.to_device(&Device::Cpu)?.to_vec1::<f32>()?);
        }
        assert_eq!(ours.len(), theirs.len());
        assert!(ours
            .iter()
            .zip(&theirs)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(download
            .append(&whole.to_dtype(DType::BF16)?, &mut ours)
            .is_err());
        Ok(())
    }

    fn same(gpu: &Tensor, cpu: &Tensor) -> Result<bool> {
        let gpu = gpu
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?;
        let cpu = cpu.to_dtype(DType::F32)?.flatten_all()?;
        Ok(gpu.to_vec1::<f32>()? == cpu.to_vec1::<f32>()?)
    }

    /// Pinned on CUDA, a group's tensors stored as they stream stay in the memory map,
    /// page-locked in place; only the one stored in another dtype is converted into an arena.
    /// Every tensor arrives as the CPU reads it.
    #[test]
    fn pinned_groups_stream_from_the_locked_map() -> Result<()> {
        let dev = Device::new_cuda(0)?;
        // bf16 and f32 tensors of odd sizes (none ends on a page boundary).
        let dir = std::env::temp_dir().join(format!("vidgen-locked-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("w.safetensors");
        let cpu = Device::Cpu;
        let a = (Tensor::arange(0f32, 70_001., &cpu)? * 0.37)?
            .sin()?
            .to_dtype(DType::BF16)?;
        let b = Tensor::arange(0f32, 3_000_003., &cpu)?.cos()?;
        let c = Tensor::arange(0f32, 5., &cpu)?.to_dtype(DType::BF16)?;
        candle_core::safetensors::save(
            &[("a", a), ("b", b), ("c", c)].into_iter().collect(),
            &path,
        )?;
        let read = Arc::new(AtomicU64::new(0));
        let counter = read.clone();
        let weights =
            WeightSet::open(&Weights::Files(vec![path]))?.with_progress(Arc::new(move |bytes| {
                counter.fetch_add(bytes, Ordering::Relaxed);
            }));
        let layout = record(Some(&weights), DType::BF16, Packing::ByDtype, |vb| {
            Ok(vec![
                vb.get(70_001, "a")?,
                vb.get(3_000_003, "b")?,
                vb.get(5, "c")?,
            ])
        })?;
        let store = HostStore::new(vec![layout], &weights, HostMemory::Pinned, &dev)?;
        assert!(store.map_is_locked());
        assert_eq!(store.arena_bytes(), 3_000_003 * 2, "only b is converted");
        let in_map = (70_001 + 5) * 2;
        let pinned = store.pinned_bytes() - store.arena_bytes();
        assert!(pinned >= in_map && pinned <= in_map + 3 * 4096, "{pinned}");
        // Progress counts the locked tensors as read, b as its stored f32 bytes.
        assert_eq!(read.load(Ordering::Relaxed), in_map as u64 + 3_000_003 * 4);
        let transfer = Transfer::new(&dev, true, None)?;
        let slots = transfer.slots(&store.layouts(), 1)?;
        let offsets = vec![0; store.group(0).layout.sections.len()];
        let place = SlotPlace {
            index: 0,
            slot: &slots[0],
            offsets: &offsets,
            first: true,
            exact: false,
        };
        let uploaded = transfer.upload(&store, 0, Some(place))?;
        transfer.ready(&uploaded)?;
        let cpu = weights.var_builder(DType::BF16, &Device::Cpu);
        for (name, tensor) in &uploaded.tensors {
            let want = cpu.get(tensor.dims(), name)?;
            assert!(same(tensor, &want)?, "{name}");
        }
        transfer.wait_idle()?;
        drop(store);
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
