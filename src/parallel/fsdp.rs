//! FSDP flat shards: each of a block's tensors is laid end to end in one flat buffer per dtype
//! (the offload engine's group image order), and rank r keeps the r-th of `ranks` consecutive
//! pieces of it ([`super::split`]: exact sizes, the first pieces one element longer). Before the
//! block runs, one all-gather of the pieces rebuilds the buffer on every rank, byte for byte, and
//! the block is built from views into it; after the block it is dropped. A [`ShardedBlocks`]
//! gathers blocks `depth` ahead of the one computing, as the offload engine prefetches groups.

use std::collections::VecDeque;

use candle_core::{DType, Device, Result, Shape, Tensor};

use super::collective::Collective;
use super::split;

/// One block's tensors as flat shards: the names and shapes, and this rank's piece of each
/// dtype's flat buffer.
#[derive(Clone, Debug)]
pub struct FlatShard {
    /// (name, shape, dtype, offset in its dtype's flat buffer), in layout order.
    entries: Vec<(String, Shape, DType, usize)>,
    /// Per dtype: (dtype, elements of the whole buffer, this rank's piece).
    pieces: Vec<(DType, usize, Tensor)>,
}

impl FlatShard {
    /// Rank `rank`'s shard of a block's `tensors` (name, tensor) among `ranks`.
    pub fn new(tensors: &[(String, Tensor)], rank: usize, ranks: usize) -> Result<Self> {
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
            pieces.push((
                dtype,
                offset,
                whole.narrow(0, mine.start, mine.len())?.copy()?,
            ));
        }
        Ok(FlatShard { entries, pieces })
    }

    /// The shard with its pieces on `device` (host memory with `--dit-cpu-offload`).
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        let pieces = self
            .pieces
            .iter()
            .map(|(d, n, p)| Ok((*d, *n, p.to_device(device)?)))
            .collect::<Result<_>>()?;
        Ok(FlatShard {
            entries: self.entries.clone(),
            pieces,
        })
    }

    /// Elements this rank holds per dtype.
    pub fn held(&self) -> Vec<(DType, usize)> {
        self.pieces
            .iter()
            .map(|(d, _, p)| (*d, p.elem_count()))
            .collect()
    }

    /// The whole block on `device`: one all-gather per dtype of every rank's piece, the
    /// tensors as views into the gathered buffers, by name.
    pub fn gather(&self, group: &dyn Collective, device: &Device) -> Result<Vec<(String, Tensor)>> {
        let ranks = group.world_size();
        let mut buffers = Vec::with_capacity(self.pieces.len());
        for (dtype, total, piece) in &self.pieces {
            let shapes: Vec<Shape> = split(*total, ranks)
                .iter()
                .map(|r| Shape::from(r.len()))
                .collect();
            let parts = group.all_gather(&piece.to_device(device)?, &shapes)?;
            // A rank with an empty piece (fewer elements than ranks) sent nothing to join.
            let parts: Vec<Tensor> = parts.into_iter().filter(|p| p.elem_count() > 0).collect();
            buffers.push((*dtype, Tensor::cat(&parts, 0)?));
        }
        self.entries
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

    /// Calls `run(i, tensors)` for every block in order with its gathered tensors; the blocks
    /// up to `depth` ahead are gathered before it runs, each freed after its block.
    pub fn for_each(
        &self,
        mut run: impl FnMut(usize, &[(String, Tensor)]) -> Result<()>,
    ) -> Result<()> {
        let mut ready: VecDeque<Vec<(String, Tensor)>> = VecDeque::new();
        let mut next = 0;
        for i in 0..self.shards.len() {
            while next < self.shards.len() && next <= i + self.depth {
                ready.push_back(self.shards[next].gather(self.group, &self.device)?);
                next += 1;
            }
            let block = ready.pop_front().expect("gathered ahead");
            run(i, &block)?;
        }
        Ok(())
    }
}
