//! [`Collective`] over NCCL (feature `nccl`): one communicator per process (its
//! sequence-parallel group's, from the id rank 0 published for the group), on the candle
//! device's stream, so a collective is ordered after the kernels that produced its inputs and
//! before those that read its outputs. Every operation is one NCCL group of point-to-point sends
//! and receives, which takes unequal sizes (uneven token and head shares) as they come.
//!
//! FSDP's gathers ahead ([`Collective::all_gather_ahead`]) run on a second communicator of the
//! group on a stream of its own (the group's second published id), ordered against the compute
//! stream with events, so a block's gather overlaps the blocks computing before it; a piece in
//! pinned host memory is copied in on that stream first.
//!
//! A collective that does not complete within the timeout (a rank died or hangs) ends this
//! process with one line naming it: NCCL has no timeout of its own, and the launcher (or the
//! `--num-gpus` supervisor) then stops the other ranks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use candle_core::cuda::cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use candle_core::cuda::cudarc::nccl::safe::{group_end, group_start, Comm, Id, NcclType};
use candle_core::cuda::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Result, Shape, Storage, Tensor};

use super::collective::{Collective, Gathering, Piece, Ready};
use super::rendezvous::ID_BYTES;

/// Ids each group publishes: its communicator's and the one its gathers ahead run on.
pub const IDS_PER_GROUP: usize = 2;

/// A fresh NCCL unique id (rank 0 makes it, the rendezvous publishes it).
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    let id = Id::new().map_err(|e| candle_core::Error::Msg(format!("ncclGetUniqueId: {e:?}")))?;
    Ok(id.internal().map(|c| c as u8))
}

/// This process's member of an NCCL communicator of its group.
pub struct NcclGroup {
    comm: Comm,
    device: Device,
    timeout: Duration,
    watch: Arc<Watch>,
}

// The communicator is used from one thread at a time (each call returns once its work is queued).
unsafe impl Send for NcclGroup {}
unsafe impl Sync for NcclGroup {}

/// The collectives in flight with their deadlines, watched by a thread: one not complete by its
/// deadline ends the process with one line (NCCL has no timeout of its own). A collective the
/// host waits for leaves when it returns; one started ahead, when its event has completed.
struct Watch {
    next: AtomicU64,
    what: Mutex<Vec<Watched>>,
}

struct Watched {
    id: u64,
    deadline: Instant,
    what: String,
    done: Option<Arc<CudaEvent>>,
}

impl Watch {
    /// Watches until `Weak` can no longer reach it (the group was dropped).
    fn spawn(rank: usize, timeout: Duration) -> Arc<Watch> {
        let watch = Arc::new(Watch {
            next: AtomicU64::new(0),
            what: Mutex::new(Vec::new()),
        });
        let weak: Weak<Watch> = Arc::downgrade(&watch);
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            let Some(watch) = weak.upgrade() else { return };
            let Ok(mut w) = watch.what.lock() else { return };
            w.retain(|e| !e.done.as_ref().is_some_and(|d| d.is_complete()));
            if let Some(late) = w.iter().find(|e| Instant::now() > e.deadline) {
                eprintln!(
                    "error: {} on rank {rank} of its group did not complete within {}s: another rank failed or hangs",
                    late.what,
                    timeout.as_secs()
                );
                std::process::exit(1);
            }
        });
        watch
    }

    fn start(&self, what: &str, timeout: Duration, done: Option<Arc<CudaEvent>>) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut w) = self.what.lock() {
            w.push(Watched {
                id,
                deadline: Instant::now() + timeout,
                what: what.to_string(),
                done,
            });
        }
        id
    }

    fn end(&self, id: u64) {
        if let Ok(mut w) = self.what.lock() {
            w.retain(|e| e.id != id);
        }
    }
}

impl NcclGroup {
    /// Joins, as `rank` of `ranks`, the communicator whose `id` rank 0 published, on `device`
    /// (this rank's GPU), its collectives on `stream` (`None`: the device's compute stream);
    /// collectives time out after `timeout`.
    pub fn new(
        (rank, ranks): (usize, usize),
        device: &Device,
        stream: Option<Arc<CudaStream>>,
        id: [u8; ID_BYTES],
        timeout: Duration,
    ) -> Result<Self> {
        let stream = match stream {
            Some(stream) => stream,
            None => device.as_cuda_device()?.cuda_stream(),
        };
        let comm = Comm::from_rank(
            stream,
            rank,
            ranks,
            Id::uninit(id.map(|b| b as std::ffi::c_char)),
        )
        .map_err(|e| candle_core::Error::Msg(format!("ncclCommInitRank (rank {rank}): {e:?}")))?;
        Ok(NcclGroup {
            comm,
            device: device.clone(),
            timeout,
            watch: Watch::spawn(rank, timeout),
        })
    }

    /// One NCCL group: `sends` (peer, tensor) and receives (peer, shape), all of `dtype`; waits
    /// for completion under the watchdog and returns the received tensors in order.
    fn exchange(
        &self,
        what: &str,
        sends: &[(usize, Tensor)],
        recvs: &[(usize, Shape)],
        dtype: DType,
    ) -> Result<Vec<Tensor>> {
        match dtype {
            DType::F32 => self.exchange_as::<f32>(what, sends, recvs),
            DType::BF16 => self.exchange_as::<half::bf16>(what, sends, recvs),
            DType::F16 => self.exchange_as::<half::f16>(what, sends, recvs),
            DType::F64 => self.exchange_as::<f64>(what, sends, recvs),
            DType::U8 => self.exchange_as::<u8>(what, sends, recvs),
            DType::U32 => self.exchange_as::<u32>(what, sends, recvs),
            DType::I64 => self.exchange_as::<i64>(what, sends, recvs),
            other => candle_core::bail!("{what}: collectives do not carry {other:?}"),
        }
    }

    fn exchange_as<T>(
        &self,
        what: &str,
        sends: &[(usize, Tensor)],
        recvs: &[(usize, Shape)],
    ) -> Result<Vec<Tensor>>
    where
        T: CudaDType + NcclType + DeviceRepr + ValidAsZeroBits,
    {
        let cuda = self.device.as_cuda_device()?;
        let sends: Vec<(usize, Tensor)> = sends
            .iter()
            .map(|(p, t)| Ok((*p, t.to_device(&self.device)?.contiguous()?)))
            .collect::<Result<_>>()?;
        let mut outs: Vec<CudaSlice<T>> = recvs
            .iter()
            .map(|(_, s)| cuda.alloc_zeros::<T>(s.elem_count()))
            .collect::<Result<_>>()?;
        let nccl = |e| candle_core::Error::Msg(format!("{what}: NCCL: {e:?}"));
        let watched = self.watch.start(what, self.timeout, None);
        {
            let guards: Vec<_> = sends
                .iter()
                .map(|(p, t)| (*p, t.storage_and_layout()))
                .collect();
            group_start().map_err(nccl)?;
            for (peer, (storage, layout)) in &guards {
                let Storage::Cuda(storage) = &**storage else {
                    candle_core::bail!("{what}: a tensor not on the GPU");
                };
                let (start, end) = layout
                    .contiguous_offsets()
                    .ok_or_else(|| candle_core::Error::Msg(format!("{what}: not contiguous")))?;
                if start < end {
                    let slice = storage.as_cuda_slice::<T>()?.slice(start..end);
                    self.comm.send(&slice, *peer as i32).map_err(nccl)?;
                }
            }
            for (out, (peer, _)) in outs.iter_mut().zip(recvs) {
                if !out.is_empty() {
                    self.comm.recv(out, *peer as i32).map_err(nccl)?;
                }
            }
            group_end().map_err(nccl)?;
        }
        self.device.synchronize()?;
        self.watch.end(watched);
        Ok(outs
            .into_iter()
            .zip(recvs)
            .map(|(out, (_, shape))| {
                let storage = CudaStorage::wrap_cuda_slice(out, cuda.clone());
                Tensor::from_storage(
                    Storage::Cuda(storage),
                    shape.clone(),
                    BackpropOp::none(),
                    false,
                )
            })
            .collect())
    }
}

impl NcclGroup {
    /// [`Collective::all_gather_ahead`] on this communicator's stream.
    fn gather_ahead(&self, piece: Piece<'_>, shapes: &[Shape]) -> Result<Gathering> {
        let dtype = match piece {
            Piece::Tensor(t) => t.dtype(),
            Piece::Host { dtype, .. } => dtype,
        };
        match dtype {
            DType::F32 => self.gather_ahead_as::<f32>(piece, shapes),
            DType::BF16 => self.gather_ahead_as::<half::bf16>(piece, shapes),
            DType::F16 => self.gather_ahead_as::<half::f16>(piece, shapes),
            DType::F64 => self.gather_ahead_as::<f64>(piece, shapes),
            DType::U8 => self.gather_ahead_as::<u8>(piece, shapes),
            DType::U32 => self.gather_ahead_as::<u32>(piece, shapes),
            DType::I64 => self.gather_ahead_as::<i64>(piece, shapes),
            other => candle_core::bail!("all_gather ahead: collectives do not carry {other:?}"),
        }
    }

    fn gather_ahead_as<T>(&self, piece: Piece<'_>, shapes: &[Shape]) -> Result<Gathering>
    where
        T: CudaDType + NcclType + DeviceRepr + ValidAsZeroBits,
    {
        let what = "all_gather ahead";
        let nccl = |e| candle_core::Error::Msg(format!("{what}: NCCL: {e:?}"));
        let cuda = self.device.as_cuda_device()?;
        let compute = cuda.cuda_stream();
        let stream = self.comm.stream();
        let wrap = |slice: CudaSlice<T>, shape: Shape| {
            let storage = CudaStorage::wrap_cuda_slice(slice, cuda.clone());
            Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
        };
        // Every buffer is allocated on the compute stream: it is freed there after the block,
        // which `Ahead::wait` has ordered behind the gather.
        // SAFETY: the receives write every element before the compute stream reads any.
        let mut outs: Vec<CudaSlice<T>> = shapes
            .iter()
            .map(|s| unsafe { cuda.alloc::<T>(s.elem_count()) })
            .collect::<Result<_>>()?;
        let host = match piece {
            Piece::Host { bytes, .. } => {
                // SAFETY: the copy below fills it before the sends read it.
                let buffer = unsafe { cuda.alloc::<T>(bytes.len() / std::mem::size_of::<T>()) }?;
                Some((buffer, bytes))
            }
            Piece::Tensor(_) => None,
        };
        // The comm stream starts after the allocations (and whatever made the piece).
        let before = compute
            .record_event(None)
            .map_err(candle_core::Error::wrap)?;
        stream.wait(&before).map_err(candle_core::Error::wrap)?;
        let send = match (host, piece) {
            (Some((mut buffer, bytes)), _) => {
                let n = buffer.len();
                {
                    let (dst, _record) = buffer.device_ptr_mut(&stream);
                    // SAFETY: `dst` holds `bytes.len()` bytes; the host bytes are page-locked
                    // and outlive the copy (the shard lives as long as the model, and a gather
                    // dropped unwaited blocks until it completed).
                    unsafe {
                        candle_core::cuda::cudarc::driver::result::memcpy_htod_async(
                            dst,
                            bytes,
                            stream.cu_stream(),
                        )
                    }
                    .map_err(candle_core::Error::wrap)?;
                }
                wrap(buffer, Shape::from(n))
            }
            (None, Piece::Tensor(t)) => t.to_device(&self.device)?.contiguous()?,
            (None, Piece::Host { .. }) => unreachable!("a host piece has a buffer"),
        };
        {
            let (storage, layout) = send.storage_and_layout();
            let Storage::Cuda(storage) = &*storage else {
                candle_core::bail!("{what}: a piece not on the GPU");
            };
            let (start, end) = layout
                .contiguous_offsets()
                .ok_or_else(|| candle_core::Error::Msg(format!("{what}: not contiguous")))?;
            group_start().map_err(nccl)?;
            if start < end {
                let slice = storage.as_cuda_slice::<T>()?.slice(start..end);
                for peer in 0..self.comm.world_size() {
                    self.comm.send(&slice, peer as i32).map_err(nccl)?;
                }
            }
            for (peer, out) in outs.iter_mut().enumerate() {
                if !out.is_empty() {
                    self.comm.recv(out, peer as i32).map_err(nccl)?;
                }
            }
            group_end().map_err(nccl)?;
        }
        let after = Arc::new(
            stream
                .record_event(None)
                .map_err(candle_core::Error::wrap)?,
        );
        self.watch.start(what, self.timeout, Some(after.clone()));
        let parts = outs
            .into_iter()
            .zip(shapes)
            .map(|(out, shape)| wrap(out, shape.clone()))
            .collect();
        Ok(Gathering::pending(
            parts,
            Box::new(Ahead {
                after,
                compute,
                waited: false,
                _send: send,
            }),
        ))
    }
}

/// A gather in flight on the comm stream.
struct Ahead {
    /// Recorded on the comm stream after the gather.
    after: Arc<CudaEvent>,
    compute: Arc<CudaStream>,
    waited: bool,
    /// The piece sent (freed on the compute stream once it waited).
    _send: Tensor,
}

// Moved between threads only as a whole; the CUDA objects are thread-safe handles.
unsafe impl Send for Ahead {}

impl Ready for Ahead {
    fn wait(&mut self) -> Result<()> {
        if !self.waited {
            self.compute
                .wait(&self.after)
                .map_err(candle_core::Error::wrap)?;
            self.waited = true;
        }
        Ok(())
    }
}

impl Drop for Ahead {
    /// A gather dropped unwaited (an error between its start and its block) completes before
    /// its buffers and the host memory it copies from can go.
    fn drop(&mut self) {
        if !self.waited {
            let _ = self.after.synchronize();
        }
    }
}

/// An [`NcclGroup`] joined at the first collective, on the device of its tensors: the pipeline's
/// own candle device, so the communicator runs on the stream of the kernels around it; the
/// communicator of the gathers ahead is joined at the first of them, on a stream of its own.
pub struct LazyNccl {
    /// (rank, ranks) in the communicators.
    member: (usize, usize),
    /// The group's ids: its communicator's and its gathers ahead's.
    ids: [[u8; ID_BYTES]; IDS_PER_GROUP],
    timeout: Duration,
    group: std::sync::OnceLock<NcclGroup>,
    ahead: std::sync::OnceLock<NcclGroup>,
}

impl LazyNccl {
    /// Member `rank` of `ranks` of the communicators of `ids`.
    pub fn new(
        member: (usize, usize),
        ids: [[u8; ID_BYTES]; IDS_PER_GROUP],
        timeout: Duration,
    ) -> Self {
        LazyNccl {
            member,
            ids,
            timeout,
            group: std::sync::OnceLock::new(),
            ahead: std::sync::OnceLock::new(),
        }
    }

    fn on(&self, device: &Device) -> Result<&NcclGroup> {
        if let Some(group) = self.group.get() {
            return Ok(group);
        }
        let group = NcclGroup::new(self.member, device, None, self.ids[0], self.timeout)?;
        Ok(self.group.get_or_init(|| group))
    }

    fn ahead_on(&self, device: &Device) -> Result<&NcclGroup> {
        if let Some(group) = self.ahead.get() {
            return Ok(group);
        }
        let stream = device
            .as_cuda_device()?
            .cuda_stream()
            .context()
            .new_stream()
            .map_err(candle_core::Error::wrap)?;
        let group = NcclGroup::new(self.member, device, Some(stream), self.ids[1], self.timeout)?;
        Ok(self.ahead.get_or_init(|| group))
    }
}

impl Collective for LazyNccl {
    fn rank(&self) -> usize {
        self.member.0
    }

    fn world_size(&self) -> usize {
        self.member.1
    }

    fn all_gather(&self, t: &Tensor, shapes: &[Shape]) -> Result<Vec<Tensor>> {
        self.on(t.device())?.all_gather(t, shapes)
    }

    fn all_to_all(&self, send: &[Tensor], recv_shapes: &[Shape]) -> Result<Vec<Tensor>> {
        let first = send
            .first()
            .ok_or_else(|| candle_core::Error::Msg("all_to_all with nothing to send".into()))?;
        self.on(first.device())?.all_to_all(send, recv_shapes)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.on(t.device())?.broadcast(t, root)
    }

    fn all_gather_ahead(
        &self,
        piece: Piece<'_>,
        shapes: &[Shape],
        device: &Device,
    ) -> Result<Gathering> {
        self.ahead_on(device)?.gather_ahead(piece, shapes)
    }

    fn barrier(&self) -> Result<()> {
        match self.group.get() {
            Some(group) => group.barrier(),
            None => candle_core::bail!(
                "barrier before any collective: the NCCL group has no device yet"
            ),
        }
    }
}

impl Collective for NcclGroup {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_gather(&self, t: &Tensor, shapes: &[Shape]) -> Result<Vec<Tensor>> {
        let sends: Vec<(usize, Tensor)> = (0..self.world_size()).map(|r| (r, t.clone())).collect();
        let recvs: Vec<(usize, Shape)> = shapes.iter().cloned().enumerate().collect();
        self.exchange("all_gather", &sends, &recvs, t.dtype())
    }

    fn all_to_all(&self, send: &[Tensor], recv_shapes: &[Shape]) -> Result<Vec<Tensor>> {
        let dtype = send[0].dtype();
        let sends: Vec<(usize, Tensor)> = send.iter().cloned().enumerate().collect();
        let recvs: Vec<(usize, Shape)> = recv_shapes.iter().cloned().enumerate().collect();
        self.exchange("all_to_all", &sends, &recvs, dtype)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if self.rank() == root {
            let sends: Vec<(usize, Tensor)> = (0..self.world_size())
                .filter(|&r| r != root)
                .map(|r| (r, t.clone()))
                .collect();
            self.exchange("broadcast", &sends, &[], t.dtype())?;
            Ok(t.clone())
        } else {
            let got = self.exchange("broadcast", &[], &[(root, t.shape().clone())], t.dtype())?;
            Ok(got.into_iter().next().expect("one receive"))
        }
    }

    fn all_gather_ahead(
        &self,
        piece: Piece<'_>,
        shapes: &[Shape],
        _device: &Device,
    ) -> Result<Gathering> {
        self.gather_ahead(piece, shapes)
    }

    fn barrier(&self) -> Result<()> {
        let one = Tensor::zeros(1, DType::U8, &self.device)?;
        let shapes = vec![Shape::from(1); self.world_size()];
        self.all_gather(&one, &shapes).map(|_| ())
    }
}
