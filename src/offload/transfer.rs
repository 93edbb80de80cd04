//! Moving a group's host image to the device: one allocation and one copy per dtype section,
//! on a dedicated copy stream ordered with CUDA events, or through a pinned staging ring.

#[cfg(feature = "cuda")]
use super::host::Arena;
use super::host::HostStore;
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
    pub tensors: Vec<(String, Tensor)>,
    #[cfg(feature = "cuda")]
    ready: Option<cudarc::driver::CudaEvent>,
}

/// Moves groups from a `HostStore` to a device.
pub struct Transfer {
    device: Device,
    /// The bounded mode's pinned staging ring (CUDA only: elsewhere copies need no staging).
    #[cfg(feature = "cuda")]
    staging: Option<Vec<Mutex<StagingSlot>>>,
    #[cfg(feature = "cuda")]
    next_slot: Mutex<usize>,
    stats: Mutex<CopyStats>,
    #[cfg(feature = "cuda")]
    cuda: Option<cuda::Copier>,
}

/// One buffer of the staging ring and the copy that last read it.
#[cfg(feature = "cuda")]
struct StagingSlot {
    buffer: Arena,
    done: Option<cudarc::driver::CudaEvent>,
}

impl Transfer {
    /// Copies to `device`; with `stream`, on a copy stream of its own (CUDA). `staging_bytes`
    /// sets up the bounded mode's ring of two pinned buffers of half that size each.
    pub fn new(device: &Device, stream: bool, staging_bytes: Option<usize>) -> Result<Self> {
        #[cfg(feature = "cuda")]
        let staging = match (staging_bytes, device) {
            (Some(total), Device::Cuda(_)) => Some(
                (0..2)
                    .map(|_| {
                        Ok(Mutex::new(StagingSlot {
                            buffer: Arena::new((total / 2).max(1 << 20), true, device)?,
                            done: None,
                        }))
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
            _ => None,
        };
        let _ = (stream, staging_bytes);
        Ok(Transfer {
            device: device.clone(),
            #[cfg(feature = "cuda")]
            staging,
            #[cfg(feature = "cuda")]
            next_slot: Mutex::new(0),
            stats: Mutex::new(CopyStats::default()),
            #[cfg(feature = "cuda")]
            cuda: match device {
                Device::Cuda(dev) => Some(cuda::Copier::new(dev, stream)?),
                _ => None,
            },
        })
    }

    /// Pinned bytes of the staging ring.
    pub fn staging_bytes(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(ring) = &self.staging {
            return ring
                .iter()
                .filter_map(|s| s.lock().ok().map(|s| s.buffer.bytes().len()))
                .sum();
        }
        0
    }

    /// Starts moving group `index` to the device; its tensors may be used once `ready` ran.
    pub fn upload(&self, store: &HostStore, index: usize) -> Result<Uploaded> {
        let layout = &store.group(index).layout;
        #[cfg(feature = "cuda")]
        if let Some(copier) = &self.cuda {
            return self.upload_cuda(copier, store, index);
        }
        // Other devices: assemble the image on the host and let candle copy each section.
        let mut image = vec![0u8; layout.bytes];
        store.gather(index, 0..layout.bytes, &mut image)?;
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
        self.count(layout.bytes);
        Ok(Uploaded {
            index,
            tensors: layout.views(&sections)?,
            #[cfg(feature = "cuda")]
            ready: None,
        })
    }

    /// Makes the compute stream wait for the group's copies (call on the computing thread,
    /// just before the group computes: the wait is placed at that point of the stream).
    pub fn ready(&self, uploaded: &Uploaded) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let (Some(copier), Some(event)) = (&self.cuda, &uploaded.ready) {
            copier.compute_waits(event)?;
        }
        let _ = uploaded;
        Ok(())
    }

    /// Call on the computing thread after a group's last use and before dropping it: its
    /// memory is freed on the copy stream, which must first see the compute finish.
    pub fn retire(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(copier) = &self.cuda {
            copier.copy_waits_for_compute()?;
        }
        Ok(())
    }

    /// The copies so far; reads the copy stream's timing events, so call it after a sync.
    pub fn stats(&self) -> CopyStats {
        #[cfg(feature = "cuda")]
        if let Some(copier) = &self.cuda {
            self.count_busy(copier.busy_seconds());
        }
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }

    fn count(&self, bytes: usize) {
        if let Ok(mut s) = self.stats.lock() {
            s.bytes += bytes as u64;
            s.groups += 1;
        }
    }

    #[cfg(feature = "cuda")]
    fn count_busy(&self, seconds: f64) {
        if let Ok(mut s) = self.stats.lock() {
            s.busy_seconds += seconds;
        }
    }

    #[cfg(feature = "cuda")]
    fn upload_cuda(
        &self,
        copier: &cuda::Copier,
        store: &HostStore,
        index: usize,
    ) -> Result<Uploaded> {
        let layout = &store.group(index).layout;
        let mut targets = Vec::with_capacity(layout.sections.len());
        let mut sections = Vec::with_capacity(layout.sections.len());
        for s in &layout.sections {
            let (tensor, ptr) = copier.alloc(s.dtype, s.bytes / s.dtype.size_in_bytes())?;
            sections.push(tensor);
            targets.push((s.offset..s.offset + s.bytes, ptr));
        }
        let timing = copier.begin()?;
        match (store.image(index), &self.staging) {
            (Some((image, _)), None) => {
                for (range, ptr) in &targets {
                    copier.copy(*ptr, &image[range.clone()])?;
                }
            }
            (_, Some(ring)) => {
                let chunk = ring[0].lock().map_or(1 << 20, |s| s.buffer.bytes().len());
                let mut start = 0;
                while start < layout.bytes {
                    let end = (start + chunk).min(layout.bytes);
                    let slot_index = {
                        let mut next = self
                            .next_slot
                            .lock()
                            .map_err(|_| anyhow::anyhow!("staging ring poisoned"))?;
                        *next = (*next + 1) % ring.len();
                        *next
                    };
                    let mut slot = ring[slot_index]
                        .lock()
                        .map_err(|_| anyhow::anyhow!("staging ring poisoned"))?;
                    if let Some(done) = slot.done.take() {
                        done.synchronize()?;
                    }
                    let staged = &mut slot.buffer.bytes_mut()[..end - start];
                    store.gather(index, start..end, staged)?;
                    for (range, ptr) in &targets {
                        let (lo, hi) = (range.start.max(start), range.end.min(end));
                        if lo < hi {
                            copier.copy(
                                ptr + (lo - range.start) as u64,
                                &slot.buffer.bytes()[lo - start..hi - start],
                            )?;
                        }
                    }
                    slot.done = Some(copier.mark()?);
                    start = end;
                }
            }
            (None, None) => anyhow::bail!("group {index} has no host image and no staging ring"),
        }
        let ready = copier.end(timing)?;
        self.count(layout.bytes);
        Ok(Uploaded {
            index,
            tensors: layout.views(&sections)?,
            ready: Some(ready),
        })
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use anyhow::{Context, Result};
    use candle_core::cuda_backend::{CudaDevice, CudaStorage};
    use candle_core::{op::BackpropOp, DType, Storage, Tensor};
    use cudarc::driver::{sys, CudaEvent, CudaStream, DevicePtr};
    use std::sync::{Arc, Mutex};

    /// Issues copies on a stream of its own and orders them against candle's compute stream.
    pub struct Copier {
        device: CudaDevice,
        copy: Arc<CudaStream>,
        /// Timing events around each group's copies, read (and cleared) by `busy_seconds`.
        timings: Mutex<Vec<(CudaEvent, CudaEvent)>>,
    }

    impl Copier {
        pub fn new(device: &CudaDevice, stream: bool) -> Result<Self> {
            let compute = device.cuda_stream();
            let copy = if stream {
                // cudarc would otherwise track every tensor's use across streams with events on
                // each kernel launch; candle computes on one stream and the offload engine
                // orders its copies with its own events, so that tracking is turned off.
                // SAFETY: the only cross-stream tensors are the engine's, synchronised below.
                unsafe { compute.context().disable_event_tracking() };
                compute
                    .context()
                    .new_stream()
                    .context("creating the offload copy stream")?
            } else {
                compute
            };
            Ok(Copier {
                device: device.clone(),
                copy,
                timings: Mutex::new(Vec::new()),
            })
        }

        /// `elems` of `dtype` on the device, allocated in copy-stream order, as a flat tensor,
        /// with the raw address the copies write to.
        pub fn alloc(&self, dtype: DType, elems: usize) -> Result<(Tensor, u64)> {
            macro_rules! alloc {
                ($t:ty) => {{
                    // SAFETY: every byte is written by the copies before the compute reads it.
                    let slice = unsafe { self.copy.alloc::<$t>(elems) }?;
                    let ptr = slice.device_ptr(&self.copy).0;
                    (
                        CudaStorage::wrap_cuda_slice(slice, self.device.clone()),
                        ptr,
                    )
                }};
            }
            let (storage, ptr) = match dtype {
                DType::BF16 => alloc!(half::bf16),
                DType::F16 => alloc!(half::f16),
                DType::F32 => alloc!(f32),
                DType::F64 => alloc!(f64),
                DType::U8 => alloc!(u8),
                DType::U32 => alloc!(u32),
                DType::I64 => alloc!(i64),
                other => anyhow::bail!("cannot offload {other:?} tensors"),
            };
            let tensor =
                Tensor::from_storage(Storage::Cuda(storage), elems, BackpropOp::none(), false);
            Ok((tensor, ptr))
        }

        /// Starts a group's copies: a timing event on the copy stream.
        pub fn begin(&self) -> Result<CudaEvent> {
            Ok(self
                .copy
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?)
        }

        /// Copies `src` (pinned: asynchronous; pageable: staged by the driver) to `dst`.
        pub fn copy(&self, dst: u64, src: &[u8]) -> Result<()> {
            // SAFETY: `dst` is a live allocation of at least `src.len()` bytes made by `alloc`;
            // host memory outlives the copy (arenas live as long as the engine; a staging slot
            // is reused only after its `mark` event completed).
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.copy.cu_stream()) }?;
            Ok(())
        }

        /// An event after the copies issued so far (a staging slot may be refilled after it).
        pub fn mark(&self) -> Result<CudaEvent> {
            Ok(self.copy.record_event(None)?)
        }

        /// Ends a group's copies: returns the event the compute stream waits for.
        pub fn end(&self, begin: CudaEvent) -> Result<CudaEvent> {
            let end = self
                .copy
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            let ready = self.copy.record_event(None)?;
            if let Ok(mut t) = self.timings.lock() {
                t.push((begin, end));
            }
            Ok(ready)
        }

        /// The compute stream (this thread's) waits for `event`.
        pub fn compute_waits(&self, event: &CudaEvent) -> Result<()> {
            Ok(self.device.cuda_stream().wait(event)?)
        }

        /// The copy stream waits for the work queued on this thread's compute stream so far.
        pub fn copy_waits_for_compute(&self) -> Result<()> {
            if !Arc::ptr_eq(&self.copy, &self.device.cuda_stream()) {
                self.copy.join(&self.device.cuda_stream())?;
            }
            Ok(())
        }

        /// Seconds the copy stream spent in the recorded copies (events must have completed).
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
}
