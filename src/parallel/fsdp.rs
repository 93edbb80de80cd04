//! FSDP flat shards: each of a block's tensors is laid end to end in one flat buffer per dtype
//! (the offload engine's group image order), and rank r keeps the r-th of `ranks` consecutive
//! pieces of it ([`super::split`]: exact sizes, the first pieces one element longer). Before the
//! block runs, one all-gather of the pieces rebuilds the buffer on every rank, byte for byte, and
//! the block is built from views into it; after the block it is dropped. A [`ShardedBlocks`]
//! starts the gathers of blocks `depth` ahead of the one computing, as the offload engine
//! prefetches groups, so that they overlap its compute; with `--dit-cpu-offload` the pieces
//! wait in (pinned) host memory and are copied in just before their gather.

use std::collections::VecDeque;

use candle_core::{DType, Device, Result, Shape, Tensor};

use super::collective::{Collective, Gathering, Piece};
use super::split;
use crate::offload::host::Arena;

/// Where a rank keeps its pieces.
#[derive(Clone, Debug)]
pub enum Home {
    /// On the device the blocks compute on.
    Device(Device),
    /// In host memory (`--dit-cpu-offload`), page-locked where this device is CUDA so that the
    /// copy in before each gather runs asynchronously.
    Host(Device),
}

/// One dtype's piece as a rank keeps it.
enum Kept {
    Tensor(Tensor),
    Host(Arena),
}

/// One block's tensors as flat shards: the names and shapes, and this rank's piece of each
/// dtype's flat buffer.
pub struct FlatShard {
    /// (name, shape, dtype, offset in its dtype's flat buffer), in layout order.
    entries: Vec<(String, Shape, DType, usize)>,
    /// Per dtype: (dtype, elements of the whole buffer, this rank's piece).
    pieces: Vec<(DType, usize, Kept)>,
}

impl FlatShard {
    /// Rank `rank`'s shard of a block's `tensors` (name, tensor) among `ranks`, kept at `home`.
    pub fn new(
        tensors: &[(String, Tensor)],
        rank: usize,
        ranks: usize,
        home: &Home,
    ) -> Result<Self> {
        let mut dtypes: Vec<DType> = Vec::new();
        for (_, t) in tensors {
            if !dtypes.contains(&t.dtype()) {
                dtypes.push(t.dtype());
            }
        }
        let mut entries = Vec::with_capacity(tensors.len());
        let mut pieces = Vec::with_capacity(dtypes.len());
        for dtype in dtypes {
            let mut flat = Vec::new();
            let mut offset = 0;
            for (name, t) in tensors.iter().filter(|(_, t)| t.dtype() == dtype) {
                entries.push((name.clone(), t.shape().clone(), dtype, offset));
                offset += t.elem_count();
                flat.push(t.flatten_all()?);
            }
            let whole = Tensor::cat(&flat, 0)?;
            let mine = split(offset, ranks)[rank].clone();
            let piece = whole.narrow(0, mine.start, mine.len())?;
            let kept = match home {
                Home::Device(device) => Kept::Tensor(piece.to_device(device)?.copy()?),
                Home::Host(device) => {
                    let bytes = mine.len() * dtype.size_in_bytes();
                    let mut arena =
                        Arena::new(bytes, true, device).map_err(candle_core::Error::wrap)?;
                    piece
                        .to_device(&Device::Cpu)?
                        .write_bytes(&mut arena.bytes_mut())?;
                    arena.lock().map_err(candle_core::Error::wrap)?;
                    Kept::Host(arena)
                }
            };
            pieces.push((dtype, offset, kept));
        }
        Ok(FlatShard { entries, pieces })
    }

    /// Elements this rank holds per dtype.
    pub fn held(&self) -> Vec<(DType, usize)> {
        self.pieces
            .iter()
            .map(|(d, _, kept)| {
                let n = match kept {
                    Kept::Tensor(t) => t.elem_count(),
                    Kept::Host(a) => a.bytes().len() / d.size_in_bytes(),
                };
                (*d, n)
            })
            .collect()
    }

    /// Starts gathering the whole block on `device`: one all-gather ahead per dtype of every
    /// rank's piece ([`Collective::all_gather_ahead`]).
    pub fn gather_ahead(&self, group: &dyn Collective, device: &Device) -> Result<Gathered<'_>> {
        let ranks = group.world_size();
        let gatherings = self
            .pieces
            .iter()
            .map(|(dtype, total, kept)| {
                let shapes: Vec<Shape> = split(*total, ranks)
                    .iter()
                    .map(|r| Shape::from(r.len()))
                    .collect();
                let piece = match kept {
                    Kept::Tensor(t) => Piece::Tensor(t),
                    Kept::Host(a) => Piece::Host {
                        bytes: a.bytes(),
                        dtype: *dtype,
                    },
                };
                Ok((*dtype, group.all_gather_ahead(piece, &shapes, device)?))
            })
            .collect::<Result<_>>()?;
        Ok(Gathered {
            shard: self,
            gatherings,
        })
    }

    /// The whole block on `device`, gathered now.
    pub fn gather(&self, group: &dyn Collective, device: &Device) -> Result<Vec<(String, Tensor)>> {
        self.gather_ahead(group, device)?.wait()
    }
}

/// A block whose gathers are in flight.
pub struct Gathered<'a> {
    shard: &'a FlatShard,
    gatherings: Vec<(DType, Gathering)>,
}

impl Gathered<'_> {
    /// The block's tensors by name, views into the gathered buffers, safe to read by the work
    /// queued from now on.
    pub fn wait(self) -> Result<Vec<(String, Tensor)>> {
        let mut buffers = Vec::with_capacity(self.gatherings.len());
        for (dtype, gathering) in self.gatherings {
            // A rank with an empty piece (fewer elements than ranks) sent nothing to join.
            let parts: Vec<Tensor> = gathering
                .wait()?
                .into_iter()
                .filter(|p| p.elem_count() > 0)
                .collect();
            buffers.push((dtype, Tensor::cat(&parts, 0)?));
        }
        self.shard
            .entries
            .iter()
            .map(|(name, shape, dtype, offset)| {
                let buffer = &buffers
                    .iter()
                    .find(|(d, _)| d == dtype)
                    .expect("a buffer per dtype")
                    .1;
                let t = buffer
                    .narrow(0, *offset, shape.elem_count())?
                    .reshape(shape.clone())?;
                Ok((name.clone(), t))
            })
            .collect()
    }
}

/// Bytes rank `rank` of `ranks` holds of blocks of `block_bytes` each (flat shards, exact).
pub fn shard_bytes(block_bytes: &[usize], rank: usize, ranks: usize) -> usize {
    block_bytes
        .iter()
        .map(|&b| split(b, ranks)[rank].len())
        .sum()
}

/// The blocks of a model as flat shards, gathered `depth` blocks ahead of the one computing
/// (the offload engine's slot discipline: at most `depth + 1` whole blocks at once).
pub struct ShardedBlocks<'a> {
    shards: &'a [FlatShard],
    group: &'a dyn Collective,
    device: Device,
    depth: usize,
}

impl<'a> ShardedBlocks<'a> {
    pub fn new(
        shards: &'a [FlatShard],
        group: &'a dyn Collective,
        device: &Device,
        depth: usize,
    ) -> Self {
        ShardedBlocks {
            shards,
            group,
            device: device.clone(),
            depth: depth.max(1),
        }
    }

    /// Calls `run(i, tensors)` for every block in order with its gathered tensors; the gathers
    /// of the blocks up to `depth` ahead are started before it runs (they overlap its compute),
    /// and each block's buffers are freed after it: at most `depth + 1` whole blocks at once.
    pub fn for_each(
        &self,
        mut run: impl FnMut(usize, &[(String, Tensor)]) -> Result<()>,
    ) -> Result<()> {
        let mut ahead: VecDeque<Gathered<'_>> = VecDeque::new();
        let mut next = 0;
        for i in 0..self.shards.len() {
            while next < self.shards.len() && next <= i + self.depth {
                ahead.push_back(self.shards[next].gather_ahead(self.group, &self.device)?);
                next += 1;
            }
            let block = ahead.pop_front().expect("gathered ahead").wait()?;
            run(i, &block)?;
        }
        Ok(())
    }
}
