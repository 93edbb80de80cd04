//! Where offloaded weights wait: a few large host arenas of exactly the bytes needed (pinned for
//! fast asynchronous copies, or pageable), or, in bounded mode, the memory map itself.

use super::group::GroupLayout;
use crate::models::loader::WeightSet;
use anyhow::{Context, Result};
use candle_core::Device;
use rayon::prelude::*;
use std::ops::Range;

/// Largest arena: groups are packed into arenas of at most this size (one larger group gets
/// an arena of its own), so pinning runs in parallel and no allocation is rounded up.
const ARENA_BYTES: usize = 1 << 30;

/// How offloaded weights are held on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostMemory {
    /// Page-locked arenas: copies run asynchronously at full link speed.
    Pinned,
    /// Ordinary memory: copies are staged by the driver and block the thread issuing them.
    Pageable,
    /// At most `max_pinned` bytes pinned: weights stay in the memory map (or, where they need
    /// converting or have no file, in pageable memory) and pass through a pinned staging ring.
    Bounded { max_pinned: usize },
}

/// One allocation of host memory.
pub enum Arena {
    Pageable(Vec<u8>),
    #[cfg(feature = "cuda")]
    Pinned(cudarc::driver::PinnedHostSlice<u8>),
}

impl Arena {
    /// `bytes` of pinned memory when `pinned` and the device is CUDA, pageable otherwise.
    pub fn new(bytes: usize, pinned: bool, device: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let (true, Device::Cuda(dev)) = (pinned, device) {
            let ctx = dev.cuda_stream().context().clone();
            // SAFETY: the memory is written in full before any byte of it is read.
            let slice = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }
                .with_context(|| format!("pinning {bytes} bytes of host memory"))?;
            return Ok(Arena::Pinned(slice));
        }
        let _ = (pinned, device);
        Ok(Arena::Pageable(vec![0; bytes]))
    }

    /// Whether copies from this arena can run asynchronously.
    pub fn is_pinned(&self) -> bool {
        !matches!(self, Arena::Pageable(_))
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            Arena::Pageable(v) => v,
            #[cfg(feature = "cuda")]
            // The slice's event is never recorded (copies take raw pointers), so this never waits.
            Arena::Pinned(p) => p.as_slice().unwrap_or(&[]),
        }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Arena::Pageable(v) => v,
            #[cfg(feature = "cuda")]
            Arena::Pinned(p) => p.as_mut_slice().unwrap_or(&mut []),
        }
    }
}

/// Where one group's host image lives.
enum Place {
    /// Bytes `offset..offset + layout.bytes` of an arena.
    Arena { arena: usize, offset: usize },
    /// Each tensor read from the memory map when the group moves (bounded mode).
    Mapped,
}

/// A group held on the host.
pub struct HostGroup {
    pub layout: GroupLayout,
    place: Place,
}

/// Every group of one offloaded model, held on the host.
pub struct HostStore {
    groups: Vec<HostGroup>,
    arenas: Vec<Arena>,
    weights: WeightSet,
}

impl HostStore {
    /// Holds the groups of `layouts`, reading each tensor from `weights` straight into its
    /// place in an arena (threads in parallel; no intermediate copy when no conversion is due).
    pub fn new(
        layouts: Vec<GroupLayout>,
        weights: &WeightSet,
        memory: HostMemory,
        device: &Device,
    ) -> Result<Self> {
        let mut groups = Vec::with_capacity(layouts.len());
        let mut arena_sizes: Vec<usize> = Vec::new();
        for layout in layouts {
            let mapped = matches!(memory, HostMemory::Bounded { .. })
                && layout
                    .slots
                    .iter()
                    .all(|s| weights.mapped_bytes(&s.name, s.dtype).is_some());
            let place = if mapped {
                Place::Mapped
            } else {
                let count = arena_sizes.len();
                match arena_sizes.last_mut() {
                    Some(size) if *size + layout.bytes <= ARENA_BYTES => {
                        *size += layout.bytes;
                        Place::Arena {
                            arena: count - 1,
                            offset: *size - layout.bytes,
                        }
                    }
                    _ => {
                        arena_sizes.push(layout.bytes);
                        Place::Arena {
                            arena: arena_sizes.len() - 1,
                            offset: 0,
                        }
                    }
                }
            };
            groups.push(HostGroup { layout, place });
        }
        // Each arena is pinned and then filled by its own task, so filling the first arenas
        // overlaps pinning the later ones (the driver may pin one allocation at a time).
        let pinned = memory == HostMemory::Pinned;
        let arenas = arena_sizes
            .par_iter()
            .enumerate()
            .map(|(index, &bytes)| {
                let mut arena = Arena::new(bytes, pinned, device)?;
                fill(&groups, index, &mut arena, weights)?;
                Ok(arena)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(HostStore {
            groups,
            arenas,
            weights: weights.clone(),
        })
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

    /// Bytes held in host arenas (pinned or pageable; the memory map is not counted).
    pub fn arena_bytes(&self) -> usize {
        self.arenas.iter().map(|a| a.bytes().len()).sum()
    }

    /// Bytes held in pinned arenas.
    pub fn pinned_bytes(&self) -> usize {
        self.arenas
            .iter()
            .filter(|a| a.is_pinned())
            .map(|a| a.bytes().len())
            .sum()
    }

    /// The group's whole image when it sits in an arena.
    pub fn image(&self, index: usize) -> Option<&[u8]> {
        match self.groups[index].place {
            Place::Arena { arena, offset } => {
                Some(&self.arenas[arena].bytes()[offset..offset + self.groups[index].layout.bytes])
            }
            Place::Mapped => None,
        }
    }

    /// Copies bytes `range` of group `index`'s image into `dst` (CPU threads in parallel).
    pub fn gather(&self, index: usize, range: Range<usize>, dst: &mut [u8]) -> Result<()> {
        const PIECE: usize = 8 << 20;
        if let Some(image) = self.image(index) {
            dst.par_chunks_mut(PIECE)
                .zip(image[range].par_chunks(PIECE))
                .for_each(|(d, s)| d.copy_from_slice(s));
            return Ok(());
        }
        let layout = &self.groups[index].layout;
        let mut sources = Vec::new();
        let mut ranges = Vec::new();
        for slot in &layout.slots {
            let (start, end) = (slot.offset, slot.offset + slot.bytes());
            let (lo, hi) = (start.max(range.start), end.min(range.end));
            if lo >= hi {
                continue;
            }
            let bytes = self
                .weights
                .mapped_bytes(&slot.name, slot.dtype)
                .with_context(|| format!("{} is no longer mapped", slot.name))?;
            sources.push(&bytes[lo - start..hi - start]);
            ranges.push(lo - range.start..hi - range.start);
        }
        let pieces: Vec<_> = carve(dst, ranges).into_iter().zip(sources).collect();
        pieces
            .into_par_iter()
            .for_each(|(d, s)| d.copy_from_slice(s));
        Ok(())
    }
}

/// Reads every tensor placed in arena `index` into its bytes of `arena`, in parallel.
fn fill(groups: &[HostGroup], index: usize, arena: &mut Arena, weights: &WeightSet) -> Result<()> {
    let mut slots: Vec<(usize, &super::group::Slot)> = groups
        .iter()
        .filter_map(|g| match g.place {
            Place::Arena { arena, offset } if arena == index => Some((offset, &g.layout.slots)),
            _ => None,
        })
        .flat_map(|(offset, slots)| slots.iter().map(move |s| (offset + s.offset, s)))
        .collect();
    slots.sort_by_key(|(at, _)| *at);
    let ranges = slots.iter().map(|(at, s)| *at..at + s.bytes());
    carve(arena.bytes_mut(), ranges)
        .into_par_iter()
        .zip(slots.par_iter())
        .try_for_each(|(dst, (_, slot))| {
            weights.read_into(&slot.name, &slot.shape, slot.dtype, dst)
        })
        .context("reading offloaded weights into host memory")
}

/// Disjoint mutable pieces of `buffer` at `ranges` (sorted, not overlapping), so threads can
/// fill them in parallel.
fn carve(buffer: &mut [u8], ranges: impl IntoIterator<Item = Range<usize>>) -> Vec<&mut [u8]> {
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
