//! [`Collective`] over NCCL (feature `nccl`): one communicator per process (its
//! sequence-parallel group's, from the id rank 0 published for the group), on the candle
//! device's stream, so a collective is ordered after the kernels that produced its inputs and
//! before those that read its outputs. Every operation is one NCCL group of point-to-point sends
//! and receives, which takes unequal sizes (uneven token and head shares) as they come.
//!
//! A collective that does not complete within the timeout (a rank died or hangs) ends this
//! process with one line naming it: NCCL has no timeout of its own, and the launcher (or the
//! `--num-gpus` supervisor) then stops the other ranks.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::cuda::cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda::cudarc::nccl::safe::{group_end, group_start, Comm, Id, NcclType};
use candle_core::cuda::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Result, Shape, Storage, Tensor};

use super::collective::Collective;
use super::rendezvous::ID_BYTES;

/// A fresh NCCL unique id (rank 0 makes it, the rendezvous publishes it).
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    let id = Id::new().map_err(|e| candle_core::Error::Msg(format!("ncclGetUniqueId: {e:?}")))?;
    Ok(id.internal().map(|c| c as u8))
}

/// This process's member of the NCCL communicator of its group.
pub struct NcclGroup {
    comm: Comm,
    device: Device,
    timeout: Duration,
    /// The deadline of the collective in flight and what it is, watched by a thread.
    watched: Arc<Mutex<Option<(Instant, String)>>>,
}

// The communicator is used from one thread at a time (each call completes before it returns).
unsafe impl Send for NcclGroup {}
unsafe impl Sync for NcclGroup {}

impl NcclGroup {
    /// Joins, as `rank` of `ranks`, the communicator whose `id` rank 0 published, on `device`
    /// (this rank's GPU); collectives time out after `timeout`.
    pub fn new(
        (rank, ranks): (usize, usize),
        device: &Device,
        id: [u8; ID_BYTES],
        timeout: Duration,
    ) -> Result<Self> {
        let stream = device.as_cuda_device()?.cuda_stream();
        let comm = Comm::from_rank(
            stream,
            rank,
            ranks,
            Id::uninit(id.map(|b| b as std::ffi::c_char)),
        )
        .map_err(|e| candle_core::Error::Msg(format!("ncclCommInitRank (rank {rank}): {e:?}")))?;
        let watched: Arc<Mutex<Option<(Instant, String)>>> = Arc::new(Mutex::new(None));
        let watch = watched.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            let Ok(w) = watch.lock() else { return };
            if let Some((deadline, what)) = &*w {
                if Instant::now() > *deadline {
                    eprintln!(
                        "error: {what} on rank {rank} of its group did not complete within {}s: another rank failed or hangs",
                        timeout.as_secs()
                    );
                    std::process::exit(1);
                }
            }
        });
        Ok(NcclGroup {
            comm,
            device: device.clone(),
            timeout,
            watched,
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
        *self.watched.lock().unwrap() = Some((Instant::now() + self.timeout, what.to_string()));
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
        *self.watched.lock().unwrap() = None;
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

/// An [`NcclGroup`] joined at the first collective, on the device of its tensors: the pipeline's
/// own candle device, so the communicator runs on the stream of the kernels around it.
pub struct LazyNccl {
    /// (rank, ranks) in the communicator.
    member: (usize, usize),
    id: [u8; ID_BYTES],
    timeout: Duration,
    group: std::sync::OnceLock<NcclGroup>,
}

impl LazyNccl {
    /// Member `rank` of `ranks` of the communicator of `id`.
    pub fn new(member: (usize, usize), id: [u8; ID_BYTES], timeout: Duration) -> Self {
        LazyNccl {
            member,
            id,
            timeout,
            group: std::sync::OnceLock::new(),
        }
    }

    fn on(&self, device: &Device) -> Result<&NcclGroup> {
        if let Some(group) = self.group.get() {
            return Ok(group);
        }
        let group = NcclGroup::new(self.member, device, self.id, self.timeout)?;
        Ok(self.group.get_or_init(|| group))
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

    fn barrier(&self) -> Result<()> {
        let one = Tensor::zeros(1, DType::U8, &self.device)?;
        let shapes = vec![Shape::from(1); self.world_size()];
        self.all_gather(&one, &shapes).map(|_| ())
    }
}
