//! The collectives the parallel modes need, on tensors, behind one trait: NCCL on GPUs
//! (`super::nccl`, feature `nccl`) and [`ThreadGroup`], threads standing in for ranks on the
//! CPU, which is what the tests run.
//!
//! Every rank knows the shapes it receives (they follow from the split plan and the configs), as
//! NCCL needs: a receive buffer is allocated before the data arrives. The stand-in checks them.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Result, Shape, Tensor};

/// Collective operations among the ranks of one world. Every rank calls the same operations in
/// the same order; a rank that does not arrive within the timeout fails the operation on every
/// rank (never a hang).
pub trait Collective: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the world.
    fn world_size(&self) -> usize;
    /// Every rank's `t`, in rank order; `shapes[r]` is rank r's shape (same dtype everywhere).
    fn all_gather(&self, t: &Tensor, shapes: &[Shape]) -> Result<Vec<Tensor>>;
    /// Sends `send[r]` to rank r and returns, in rank order, what each rank sent to this one
    /// (`recv_shapes[r]` from rank r).
    fn all_to_all(&self, send: &[Tensor], recv_shapes: &[Shape]) -> Result<Vec<Tensor>>;
    /// `root`'s `t` on every rank; the others pass a tensor of the same shape and dtype whose
    /// values are ignored.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;
    /// Returns once every rank called it.
    fn barrier(&self) -> Result<()>;

    /// [`Collective::all_gather`] of this rank's `piece`, started ahead of its use so that it
    /// overlaps the work queued before it (NCCL: on a communication stream of its own, a piece
    /// in host memory copied in on that stream first); the parts are on `device` and may be
    /// read after [`Gathering::wait`]. Every rank starts its gathers in the same order. By
    /// default it completes before it returns.
    fn all_gather_ahead(
        &self,
        piece: Piece<'_>,
        shapes: &[Shape],
        device: &Device,
    ) -> Result<Gathering> {
        let piece = piece.to_tensor(device)?;
        Ok(Gathering::done(self.all_gather(&piece, shapes)?))
    }
}

/// This rank's piece of a gather ahead: a tensor, or the bytes of a flat `dtype` vector in
/// host memory (pinned where the device is CUDA, so the copy in runs asynchronously).
#[derive(Clone, Copy, Debug)]
pub enum Piece<'a> {
    Tensor(&'a Tensor),
    Host { bytes: &'a [u8], dtype: DType },
}

impl Piece<'_> {
    /// The piece as a tensor on `device`.
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        match self {
            Piece::Tensor(t) => t.to_device(device),
            Piece::Host { bytes, dtype } => {
                let elems = bytes.len() / dtype.size_in_bytes();
                Tensor::from_raw_buffer(bytes, *dtype, &[elems], device)
            }
        }
    }
}

/// What orders the caller's later work after a gather started ahead.
pub trait Ready: Send {
    /// Makes the work queued from now on wait for the gather (idempotent).
    fn wait(&mut self) -> Result<()>;
}

/// A gather started ahead of its use: its parts, and what must run before they are read.
pub struct Gathering {
    /// Dropped first (fields drop in order): a gather dropped unwaited finishes before its
    /// parts' memory goes.
    ready: Option<Box<dyn Ready>>,
    parts: Vec<Tensor>,
}

impl Gathering {
    /// A gather already complete.
    pub fn done(parts: Vec<Tensor>) -> Self {
        Gathering { ready: None, parts }
    }

    /// A gather in flight: `parts` may be read once `ready` waited.
    pub fn pending(parts: Vec<Tensor>, ready: Box<dyn Ready>) -> Self {
        Gathering {
            ready: Some(ready),
            parts,
        }
    }

    /// Every rank's part, in rank order, safe to read by the work queued from now on.
    pub fn wait(mut self) -> Result<Vec<Tensor>> {
        if let Some(ready) = &mut self.ready {
            ready.wait()?;
        }
        Ok(std::mem::take(&mut self.parts))
    }
}

/// A collective that failed on this rank: a rank missing past the timeout, or gone.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error(
        "rank {rank}: a collective timed out after {secs:.1}s waiting for rank(s) {missing:?}"
    )]
    Timeout {
        rank: usize,
        secs: f64,
        missing: Vec<usize>,
    },
    #[error("rank {rank}: rank {gone} left the group (failed or finished early)")]
    Gone { rank: usize, gone: usize },
    #[error("rank {rank}: received {got:?} from rank {from}, expected {want:?}")]
    Shape {
        rank: usize,
        from: usize,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("rank {rank}: the group's first rank failed the work it does for the group")]
    RootFailed { rank: usize },
    #[error("rank {rank}: {ranks} ranks' parts for {world} ranks")]
    Parts {
        rank: usize,
        ranks: usize,
        world: usize,
    },
}

/// What the threads of a [`ThreadGroup`] share.
struct Hub {
    world: usize,
    timeout: Duration,
    state: Mutex<HubState>,
    changed: Condvar,
}

struct HubState {
    /// `mail[src][dst]`: what rank src leaves for rank dst in the current operation.
    mail: Vec<Vec<Option<Tensor>>>,
    /// Ranks arrived at the current barrier, and which barrier it is.
    arrived: Vec<bool>,
    generation: u64,
    /// Ranks whose member was dropped, in the order they went (the first is the cause).
    gone: Vec<usize>,
}

/// One rank of a group of threads standing in for processes: the CPU stand-in for NCCL.
pub struct ThreadGroup {
    rank: usize,
    hub: Arc<Hub>,
}

impl ThreadGroup {
    /// `world` members, one per thread (member r is rank r).
    pub fn new(world: usize, timeout: Duration) -> Vec<ThreadGroup> {
        let hub = Arc::new(Hub {
            world,
            timeout,
            state: Mutex::new(HubState {
                mail: vec![vec![None; world]; world],
                arrived: vec![false; world],
                generation: 0,
                gone: Vec::new(),
            }),
            changed: Condvar::new(),
        });
        (0..world)
            .map(|rank| ThreadGroup {
                rank,
                hub: hub.clone(),
            })
            .collect()
    }

    fn wrap(e: CollectiveError) -> candle_core::Error {
        candle_core::Error::wrap(e)
    }

    /// Waits until every rank arrived (then all leave together), failing on a timeout or a rank
    /// gone.
    fn sync(&self) -> Result<()> {
        let hub = &self.hub;
        let mut st = hub.state.lock().unwrap();
        let generation = st.generation;
        st.arrived[self.rank] = true;
        if st.arrived.iter().all(|&a| a) {
            st.arrived.iter_mut().for_each(|a| *a = false);
            st.generation += 1;
            hub.changed.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + hub.timeout;
        loop {
            if let Some(&gone) = st.gone.iter().find(|&&r| !st.arrived[r]) {
                st.arrived[self.rank] = false;
                return Err(Self::wrap(CollectiveError::Gone {
                    rank: self.rank,
                    gone,
                }));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = (0..hub.world).filter(|&r| !st.arrived[r]).collect();
                st.arrived[self.rank] = false;
                return Err(Self::wrap(CollectiveError::Timeout {
                    rank: self.rank,
                    secs: hub.timeout.as_secs_f64(),
                    missing,
                }));
            }
            st = hub.changed.wait_timeout(st, deadline - now).unwrap().0;
            if st.generation != generation {
                return Ok(());
            }
        }
    }

    /// One exchange: leaves `send[dst]` for each dst, waits for all, takes what each src left
    /// for this rank, waits again (so nobody overwrites mail not yet read).
    fn exchange(&self, send: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> {
        {
            let mut st = self.hub.state.lock().unwrap();
            for (dst, t) in send.into_iter().enumerate() {
                // A real transport copies: the receiver never shares the sender's storage.
                st.mail[self.rank][dst] = t.map(|t| t.copy()).transpose()?;
            }
        }
        self.sync()?;
        let got = {
            let mut st = self.hub.state.lock().unwrap();
            (0..self.hub.world)
                .map(|src| st.mail[src][self.rank].take())
                .collect()
        };
        self.sync()?;
        Ok(got)
    }

    fn check(&self, from: usize, t: Tensor, want: &Shape) -> Result<Tensor> {
        if t.shape() != want {
            return Err(Self::wrap(CollectiveError::Shape {
                rank: self.rank,
                from,
                got: t.dims().to_vec(),
                want: want.dims().to_vec(),
            }));
        }
        Ok(t)
    }

    fn parts(&self, n: usize) -> Result<()> {
        if n != self.hub.world {
            return Err(Self::wrap(CollectiveError::Parts {
                rank: self.rank,
                ranks: n,
                world: self.hub.world,
            }));
        }
        Ok(())
    }
}

impl Drop for ThreadGroup {
    /// A member that goes (its thread failed or returned) fails the others' next wait at once.
    fn drop(&mut self) {
        if let Ok(mut st) = self.hub.state.lock() {
            st.gone.push(self.rank);
            self.hub.changed.notify_all();
        }
    }
}

impl Collective for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.hub.world
    }

    fn all_gather(&self, t: &Tensor, shapes: &[Shape]) -> Result<Vec<Tensor>> {
        self.parts(shapes.len())?;
        let got = self.exchange(vec![Some(t.clone()); self.hub.world])?;
        got.into_iter()
            .zip(shapes)
            .enumerate()
            .map(|(src, (t, want))| self.check(src, t.expect("every rank sends"), want))
            .collect()
    }

    fn all_to_all(&self, send: &[Tensor], recv_shapes: &[Shape]) -> Result<Vec<Tensor>> {
        self.parts(send.len())?;
        self.parts(recv_shapes.len())?;
        let got = self.exchange(send.iter().cloned().map(Some).collect())?;
        got.into_iter()
            .zip(recv_shapes)
            .enumerate()
            .map(|(src, (t, want))| self.check(src, t.expect("every rank sends"), want))
            .collect()
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let send = if self.rank == root {
            vec![Some(t.clone()); self.hub.world]
        } else {
            vec![None; self.hub.world]
        };
        let mut got = self.exchange(send)?;
        let from_root = got[root].take().expect("the root sends");
        self.check(root, from_root, t.shape())
    }

    fn barrier(&self) -> Result<()> {
        self.sync()
    }
}

/// The dtypes [`broadcast_tensors`] carries, by their code in its header.
const DTYPES: [DType; 7] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::F64,
    DType::U8,
    DType::U32,
    DType::I64,
];

/// Dimensions a header entry has room for.
const MAX_DIMS: usize = 6;

/// Rank 0's `tensors` on every rank of `group`, on `device` (the others pass `None`). A header
/// with their number, dtypes and shapes goes first, so no other rank need know them; rank 0
/// passing `None` (its work failed) fails the call on every rank at once instead of leaving
/// them to a collective's timeout.
pub fn broadcast_tensors(
    group: &dyn Collective,
    tensors: Option<&[Tensor]>,
    device: &Device,
) -> Result<Vec<Tensor>> {
    let root = group.rank() == 0;
    let sent = if root { tensors } else { None };
    // [made it, how many]
    let head: Vec<u32> = match sent {
        Some(ts) => vec![1, ts.len() as u32],
        None => vec![0, 0],
    };
    let head = group
        .broadcast(&Tensor::new(head.as_slice(), device)?, 0)?
        .to_vec1::<u32>()?;
    if head[0] == 0 {
        return Err(candle_core::Error::wrap(CollectiveError::RootFailed {
            rank: group.rank(),
        }));
    }
    let count = head[1] as usize;
    let entry = 2 + MAX_DIMS;
    let mut shapes = vec![0u32; count * entry];
    for (i, t) in sent.unwrap_or_default().iter().enumerate() {
        let code = DTYPES.iter().position(|d| *d == t.dtype()).ok_or_else(|| {
            candle_core::Error::Msg(format!("collectives do not carry {:?}", t.dtype()))
        })?;
        let dims = t.dims();
        if dims.len() > MAX_DIMS || dims.iter().any(|&d| d > u32::MAX as usize) {
            candle_core::bail!("a tensor of shape {dims:?} does not fit the broadcast header");
        }
        let e = &mut shapes[i * entry..(i + 1) * entry];
        e[0] = code as u32;
        e[1] = dims.len() as u32;
        for (slot, &d) in e[2..].iter_mut().zip(dims) {
            *slot = d as u32;
        }
    }
    if count == 0 {
        return Ok(Vec::new());
    }
    let shapes = group
        .broadcast(&Tensor::new(shapes.as_slice(), device)?, 0)?
        .to_vec1::<u32>()?;
    shapes
        .chunks(entry)
        .enumerate()
        .map(|(i, e)| {
            let dtype = *DTYPES
                .get(e[0] as usize)
                .ok_or_else(|| candle_core::Error::Msg("a broadcast of an unknown dtype".into()))?;
            let shape: Vec<usize> = e[2..2 + e[1] as usize]
                .iter()
                .map(|&d| d as usize)
                .collect();
            let t = match sent {
                Some(ts) => ts[i].to_device(device)?.contiguous()?,
                None => Tensor::zeros(shape, dtype, device)?,
            };
            group.broadcast(&t, 0)
        })
        .collect()
}

/// Runs `f(member)` on one thread per rank of a fresh [`ThreadGroup`] and returns the results
/// in rank order (for tests and the CPU stand-in runs).
pub fn run_threads<T: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(ThreadGroup) -> T + Sync,
) -> Vec<T> {
    run_members(ThreadGroup::new(world, timeout), |_, member| f(member))
}

/// Runs `f(rank, member)` on one thread per rank of `groups`, each rank a member of its own
/// group's [`ThreadGroup`] (the groups share nothing, as separate communicators), and returns
/// the results in rank order.
pub fn run_groups<T: Send>(
    groups: super::Groups,
    timeout: Duration,
    f: impl Fn(usize, ThreadGroup) -> T + Sync,
) -> Vec<T> {
    let members = (0..groups.count())
        .flat_map(|_| ThreadGroup::new(groups.sp, timeout))
        .collect();
    run_members(members, f)
}

fn run_members<T: Send>(
    members: Vec<ThreadGroup>,
    f: impl Fn(usize, ThreadGroup) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = members
            .into_iter()
            .enumerate()
            .map(|(rank, m)| {
                let f = &f;
                s.spawn(move || f(rank, m))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    const T: Duration = Duration::from_secs(20);

    fn filled(rank: usize, shape: &[usize]) -> Tensor {
        Tensor::full(rank as f32 + 1.0, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn all_gather_unequal_shapes() {
        let out = run_threads(3, T, |g| {
            let shapes: Vec<Shape> = (0..3).map(|r| Shape::from((r + 1, 2))).collect();
            let mine = filled(g.rank(), &[g.rank() + 1, 2]);
            let all = g.all_gather(&mine, &shapes).unwrap();
            Tensor::cat(&all, 0).unwrap().to_vec2::<f32>().unwrap()
        });
        let want = vec![
            vec![1.0, 1.0],
            vec![2.0, 2.0],
            vec![2.0, 2.0],
            vec![3.0, 3.0],
            vec![3.0, 3.0],
            vec![3.0, 3.0],
        ];
        assert!(out.iter().all(|o| *o == want));
    }

    #[test]
    fn all_to_all_routes_each_part() {
        // Rank s sends rank d the value 10 s + d, d + 1 long.
        let out = run_threads(3, T, |g| {
            let send: Vec<Tensor> = (0..3)
                .map(|d| Tensor::full((10 * g.rank() + d) as f32, d + 1, &Device::Cpu).unwrap())
                .collect();
            let shapes: Vec<Shape> = (0..3).map(|_| Shape::from(g.rank() + 1)).collect();
            g.all_to_all(&send, &shapes)
                .unwrap()
                .iter()
                .map(|t| t.to_vec1::<f32>().unwrap())
                .collect::<Vec<_>>()
        });
        for (d, got) in out.iter().enumerate() {
            for (s, part) in got.iter().enumerate() {
                assert_eq!(*part, vec![(10 * s + d) as f32; d + 1]);
            }
        }
    }

    #[test]
    fn broadcast_and_barrier() {
        let out = run_threads(2, T, |g| {
            let t = filled(g.rank() * 5, &[2]);
            g.barrier().unwrap();
            g.broadcast(&t, 1).unwrap().to_vec1::<f32>().unwrap()
        });
        assert_eq!(out, vec![vec![6.0, 6.0]; 2]);
    }

    #[test]
    fn groups_are_separate_communicators() {
        // Four ranks in groups of two: each all-gather sees its own group's ranks only.
        let groups = crate::parallel::Groups { ranks: 4, sp: 2 };
        let out = run_groups(groups, T, |rank, g| {
            let shapes = vec![Shape::from(1); g.world_size()];
            let mine = Tensor::new(&[rank as f32], &Device::Cpu).unwrap();
            let all = g.all_gather(&mine, &shapes).unwrap();
            (
                g.rank(),
                Tensor::cat(&all, 0).unwrap().to_vec1::<f32>().unwrap(),
            )
        });
        assert_eq!(
            out,
            vec![
                (0, vec![0.0, 1.0]),
                (1, vec![0.0, 1.0]),
                (0, vec![2.0, 3.0]),
                (1, vec![2.0, 3.0]),
            ]
        );
    }

    #[test]
    fn broadcast_tensors_carries_shapes_and_dtypes_the_others_do_not_know() {
        let out = run_threads(3, T, |g| {
            let made = [
                Tensor::arange(0f32, 6.0, &Device::Cpu)
                    .unwrap()
                    .reshape((1, 2, 3))
                    .unwrap(),
                Tensor::new(&[7u32, 8], &Device::Cpu).unwrap(),
            ];
            let sent = (g.rank() == 0).then_some(&made[..]);
            let got = broadcast_tensors(&g, sent, &Device::Cpu).unwrap();
            (
                got[0].dims().to_vec(),
                got[0].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                got[1].to_vec1::<u32>().unwrap(),
            )
        });
        for o in out {
            assert_eq!(o, (vec![1, 2, 3], vec![0., 1., 2., 3., 4., 5.], vec![7, 8]));
        }
    }

    #[test]
    fn a_failed_root_fails_broadcast_tensors_on_every_rank() {
        let out = run_threads(2, Duration::from_secs(600), |g| {
            broadcast_tensors(&g, None, &Device::Cpu)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        assert!(out[1].as_ref().unwrap_err().contains("first rank failed"));
        assert!(out[0].is_err());
    }

    #[test]
    fn a_wrong_shape_is_an_error() {
        let out = run_threads(2, T, |g| {
            let t = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
            g.all_gather(&t, &[Shape::from(3), Shape::from(4)])
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        assert!(out[0].as_ref().unwrap_err().contains("expected [4]"));
    }

    #[test]
    fn a_failed_rank_stops_the_others_without_waiting_for_the_timeout() {
        let out = run_threads(3, Duration::from_secs(600), |g| {
            if g.rank() == 2 {
                // This rank fails before the collective: its member is dropped.
                return Err("rank 2 failed".to_string());
            }
            g.barrier().map_err(|e| e.to_string())
        });
        assert!(out[0].as_ref().unwrap_err().contains("rank 2 left"));
        assert!(out[1].as_ref().unwrap_err().contains("rank 2 left"));
    }

    #[test]
    fn a_hung_rank_times_out_naming_it() {
        // Rank 1 stays alive without arriving until rank 0 has given up.
        let gave_up = std::sync::Barrier::new(2);
        let out = run_threads(2, Duration::from_millis(200), |g| {
            let result = if g.rank() == 0 {
                g.barrier().map_err(|e| e.to_string())
            } else {
                Ok(())
            };
            gave_up.wait();
            result
        });
        assert!(out[0].as_ref().unwrap_err().contains("rank(s) [1]"));
    }
}
