//! Moving tensors through a small ring of pinned staging buffers, chunk by chunk: the bytes of
//! a run of tensors, laid end to end, are cut into buffer-sized chunks; host threads fill one
//! buffer while the copies out of the others run. The plan and the loop know no device: a
//! [`Ring`] (CUDA's in `transfer.rs`, a host one in the tests) says where the bytes go.

use super::group::Slot;
use crate::weights::WeightSet;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

/// Bytes of each of the two staging buffers a resident load uses. A 64 MiB copy takes ~1.2 ms
/// at the H200's 55 GB/s, so launching it and recording its event (~10 us) costs under 1%,
/// and filling it splits into [`FILL_PIECE`]s for every core; two buffers (128 MiB pinned,
/// page-locked in ~10 ms) are all that double buffering needs.
pub const LOAD_CHUNK: usize = 64 << 20;

/// Bytes one thread copies into a staging buffer at a time: a chunk fills as 16 tasks, one per
/// core of the H200 host (reading the memory map faults its pages in, which one thread alone
/// does at a fraction of the link's speed).
const FILL_PIECE: usize = 4 << 20;

/// Each tensor starts at a multiple of this in a staging buffer (DMA reads aligned sources
/// fastest; the gap is never copied).
const ALIGN: usize = 256;

/// Bytes `bytes` of item `item` sit at `at` in a chunk's staging buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub item: usize,
    pub bytes: Range<usize>,
    pub at: usize,
}

/// What one staging buffer carries at once: its first `len` bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chunk {
    pub len: usize,
    pub pieces: Vec<Piece>,
}

/// Cuts items of `sizes` bytes, laid end to end (each aligned), into chunks of at most
/// `chunk` bytes: small items share a chunk, a large one spans several. Every item has at
/// least one piece (an empty item an empty one), in order.
pub fn plan(sizes: &[usize], chunk: usize) -> Vec<Chunk> {
    assert!(
        chunk >= ALIGN,
        "a staging buffer holds at least {ALIGN} bytes"
    );
    let mut chunks = Vec::new();
    let mut current = Chunk::default();
    for (item, &size) in sizes.iter().enumerate() {
        let mut done = 0;
        loop {
            if current.len == chunk {
                chunks.push(std::mem::take(&mut current));
            }
            let take = (size - done).min(chunk - current.len);
            current.pieces.push(Piece {
                item,
                bytes: done..done + take,
                at: current.len,
            });
            current.len += take;
            done += take;
            if done == size {
                break;
            }
        }
        current.len = current.len.next_multiple_of(ALIGN).min(chunk);
    }
    if !current.pieces.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Staging buffers and where their bytes go.
pub trait Ring {
    /// Bytes of one staging buffer.
    fn chunk_bytes(&self) -> usize;
    /// Waits until a buffer is free, fills its first `chunk.len` bytes with `fill`, and sends
    /// each piece of `chunk` to its item's destination (asynchronously where the device can).
    fn pass(&mut self, chunk: &Chunk, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()>;
}

/// Sends items of `sizes` bytes through `ring`: `open(ring, i)` gives item i's bytes when its
/// first piece is due (so only the items of the chunk being filled are held on the host),
/// `done(ring, i)` runs once its last piece was sent.
pub fn run<'a, R: Ring>(
    sizes: &[usize],
    ring: &mut R,
    mut open: impl FnMut(&mut R, usize) -> Result<Cow<'a, [u8]>>,
    mut done: impl FnMut(&mut R, usize) -> Result<()>,
) -> Result<()> {
    let mut sources: Vec<Option<Cow<'a, [u8]>>> = vec![None; sizes.len()];
    for chunk in plan(sizes, ring.chunk_bytes()) {
        for piece in chunk.pieces.iter().filter(|p| p.bytes.start == 0) {
            let bytes = open(ring, piece.item)?;
            anyhow::ensure!(
                bytes.len() == sizes[piece.item],
                "item {} has {} bytes, {} expected",
                piece.item,
                bytes.len(),
                sizes[piece.item]
            );
            sources[piece.item] = Some(bytes);
        }
        ring.pass(&chunk, &mut |buffer| fill(&chunk, &sources, buffer))?;
        for piece in &chunk.pieces {
            if piece.bytes.end == sizes[piece.item] {
                sources[piece.item] = None;
                done(ring, piece.item)?;
            }
        }
    }
    Ok(())
}

/// Copies `chunk`'s pieces from their sources into `buffer`, [`FILL_PIECE`] bytes per task.
fn fill(chunk: &Chunk, sources: &[Option<Cow<[u8]>>], buffer: &mut [u8]) -> Result<()> {
    let mut tasks = Vec::new();
    for piece in &chunk.pieces {
        let source = sources[piece.item]
            .as_deref()
            .context("a staged item was not open")?;
        let mut start = piece.bytes.start;
        while start < piece.bytes.end {
            let end = (start + FILL_PIECE).min(piece.bytes.end);
            let at = piece.at + (start - piece.bytes.start);
            tasks.push((at..at + (end - start), &source[start..end]));
            start = end;
        }
    }
    let ranges = tasks.iter().map(|(range, _)| range.clone());
    super::host::carve(buffer, ranges)
        .into_par_iter()
        .zip(tasks.par_iter())
        .for_each(|(dst, (_, src))| dst.copy_from_slice(src));
    Ok(())
}

/// A [`Ring`] that lands each item in a fresh flat tensor of its own.
pub trait Landing: Ring {
    /// Makes item `item`'s destination: `elems` values of `dtype`.
    fn reserve(&mut self, item: usize, dtype: DType, elems: usize) -> Result<()>;
    /// Item `item`, every byte sent, as a flat tensor (usable in stream order).
    fn take(&mut self, item: usize) -> Result<Tensor>;
}

/// The tensors `slots` ask for, from `weights` through `landing`, one allocation per tensor:
/// packed ones as held ([`Slot::packed`]) and expanded, the others in the dtype
/// [`WeightSet::staged_dtype`] gives, reshaped and converted to the slot's dtype; each as soon as
/// its last byte is sent (so at most one tensor is held in both forms at once); LoRA deltas
/// merged where they landed once every copy is queued.
pub fn load_tensors(
    weights: &WeightSet,
    slots: &[Slot],
    landing: &mut impl Landing,
) -> Result<Vec<(String, Tensor)>> {
    let staged = slots
        .iter()
        .map(|s| match s.packed {
            Some(_) => DType::U8,
            None => weights.staged_dtype(&s.name, s.dtype),
        })
        .collect::<Vec<_>>();
    let sizes: Vec<usize> = slots
        .iter()
        .zip(&staged)
        .map(|(s, d)| match s.packed {
            Some(_) => s.bytes(),
            None => s.shape.elem_count() * d.size_in_bytes(),
        })
        .collect();
    let mut out: Vec<Option<Tensor>> = vec![None; slots.len()];
    run(
        &sizes,
        landing,
        |landing, i| {
            let slot = &slots[i];
            landing.reserve(i, staged[i], sizes[i] / staged[i].size_in_bytes())?;
            Ok(match slot.packed {
                Some(packed) => {
                    weights.packed_bytes(&slot.name, &slot.shape, slot.dtype, packed)?
                }
                None => weights.staged_bytes(&slot.name, &slot.shape, slot.dtype)?,
            })
        },
        |landing, i| {
            let slot = &slots[i];
            let landed = landing.take(i)?;
            out[i] = Some(match slot.packed {
                Some(_) => slot.expand(landed)?,
                None => landed.reshape(slot.shape.clone())?.to_dtype(slot.dtype)?,
            });
            Ok(())
        },
    )
    .context("loading weights through the staging buffers")?;
    // LoRA deltas merge once every copy is on its way: a merge sends its factors up from
    // pageable memory, which waits for the copies queued before it, so merging between the
    // chunks would stall the ring once per changed weight.
    slots
        .iter()
        .zip(out)
        .map(|(s, t)| {
            let landed = t.context("a staged tensor never landed")?;
            let tensor = match s.packed {
                Some(_) => landed,
                None => weights.merged_where_landed(&s.name, landed)?,
            };
            Ok((s.name.clone(), tensor))
        })
        .collect()
}

/// Builds a part that lives on `device` from `weights`: `build(vb, host_vb)` gets the device
/// `VarBuilder` and one over host memory (for what stays there, see `Blockwise::outer`). On
/// CUDA the tensors go from the memory map (or the synthetic generator) through two pinned
/// [`LOAD_CHUNK`] buffers straight into device memory ([`build_staged`]); elsewhere `build`
/// reads `weights` directly.
pub fn build_resident<B>(
    weights: &WeightSet,
    dtype: DType,
    device: &Device,
    build: impl Fn(VarBuilder<'static>, VarBuilder<'static>) -> candle_core::Result<B>,
) -> Result<B> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let load = |slots: &[Slot]| {
            super::Transfer::new(device, false, Some(2 * LOAD_CHUNK))?.load(weights, slots)
        };
        return build_staged(weights, dtype, device, load, build);
    }
    Ok(build(
        weights.var_builder(dtype, device),
        weights.var_builder(dtype, &Device::Cpu),
    )?)
}

/// Records the tensors `build` asks for on the device (nothing is read), has `load` bring them
/// in (one allocation per tensor: a constructor that derives tensors and drops the originals
/// frees them, as with candle's own loading), then builds from them; what `build` keeps in
/// host memory is read from `weights` as usual.
#[cfg(any(feature = "cuda", test))]
fn build_staged<B>(
    weights: &WeightSet,
    dtype: DType,
    device: &Device,
    load: impl FnOnce(&[Slot]) -> Result<Vec<(String, Tensor)>>,
    build: impl Fn(VarBuilder<'static>, VarBuilder<'static>) -> candle_core::Result<B>,
) -> Result<B> {
    use super::group::{Packing, Recording};
    let (wanted, on_host) = (Recording::default(), Recording::default());
    drop(build(
        wanted.var_builder(Some(weights), dtype),
        on_host.var_builder(Some(weights), dtype),
    )?);
    let slots = wanted.layout(Packing::PerTensor)?.slots;
    let tensors = load(&slots)?.into_iter().collect();
    Ok(build(
        VarBuilder::from_tensors(tensors, dtype, device),
        weights.var_builder(dtype, &Device::Cpu),
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::Weights;
    use candle_core::Shape;

    /// A host ring: `count` buffers used in turn, each piece copied into its item's vector.
    struct HostRing {
        chunk: usize,
        buffers: Vec<Vec<u8>>,
        next: usize,
        items: Vec<Vec<u8>>,
        dtypes: Vec<DType>,
        passes: usize,
    }

    impl HostRing {
        fn new(chunk: usize, count: usize, items: usize) -> Self {
            HostRing {
                chunk,
                buffers: vec![vec![0; chunk]; count],
                next: 0,
                items: vec![Vec::new(); items],
                dtypes: vec![DType::U8; items],
                passes: 0,
            }
        }
    }

    impl Ring for HostRing {
        fn chunk_bytes(&self) -> usize {
            self.chunk
        }

        fn pass(
            &mut self,
            chunk: &Chunk,
            fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
        ) -> Result<()> {
            let k = self.next;
            self.next = (k + 1) % self.buffers.len();
            let buffer = &mut self.buffers[k];
            // Stale bytes from the previous use must never reach an item.
            buffer.fill(0xAB);
            fill(&mut buffer[..chunk.len])?;
            for p in &chunk.pieces {
                let item = &mut self.items[p.item];
                assert_eq!(item.len(), p.bytes.start, "pieces arrive in order");
                item.extend_from_slice(&buffer[p.at..p.at + p.bytes.len()]);
            }
            self.passes += 1;
            Ok(())
        }
    }

    impl Landing for HostRing {
        fn reserve(&mut self, item: usize, dtype: DType, elems: usize) -> Result<()> {
            self.dtypes[item] = dtype;
            self.items[item] = Vec::with_capacity(elems * dtype.size_in_bytes());
            Ok(())
        }

        fn take(&mut self, item: usize) -> Result<Tensor> {
            let bytes = std::mem::take(&mut self.items[item]);
            let dtype = self.dtypes[item];
            let elems = bytes.len() / dtype.size_in_bytes();
            Ok(Tensor::from_raw_buffer(
                &bytes,
                dtype,
                &[elems],
                &Device::Cpu,
            )?)
        }
    }

    /// Sizes around a 1 KiB chunk: empty, tiny, unaligned, exactly a chunk, straddling,
    /// several chunks long.
    const CHUNK: usize = 1024;
    const SIZES: [usize; 11] = [0, 1, 255, 256, 257, 1023, 1024, 1025, 3 * 1024 + 5, 7, 0];

    /// Every item's pieces cover it once, in order; pieces fit their chunk and never overlap;
    /// chunks are full except where alignment or the end leaves a gap.
    #[test]
    fn plans_cover_every_byte_once_within_chunks() {
        let chunks = plan(&SIZES, CHUNK);
        let mut next = vec![0usize; SIZES.len()];
        let mut last_item = 0;
        for chunk in &chunks {
            assert!(chunk.len <= CHUNK);
            let mut end = 0;
            for p in &chunk.pieces {
                assert_eq!(p.bytes.start, next[p.item], "item {} in order", p.item);
                assert!(p.item >= last_item);
                assert!(p.at >= end, "pieces overlap");
                if p.bytes.start == 0 {
                    assert_eq!(p.at % ALIGN, 0, "item {} starts aligned", p.item);
                } else {
                    assert_eq!(p.at, 0, "a continued item starts its chunk");
                }
                end = p.at + p.bytes.len();
                assert!(end <= chunk.len);
                next[p.item] = p.bytes.end;
                last_item = p.item;
            }
        }
        assert_eq!(next, SIZES);
        // A tensor that starts a chunk mid-way is aligned; 3 KiB + 5 spans four chunks.
        let spans = chunks
            .iter()
            .filter(|c| c.pieces.iter().any(|p| p.item == 8))
            .count();
        assert_eq!(spans, 4);
        // 1 + 255 + 256 + 257 share the first chunk (each aligned: 0, 256, 512, 768).
        assert_eq!(
            chunks[0].pieces.iter().map(|p| p.at).collect::<Vec<_>>(),
            [0, 0, 256, 512, 768]
        );
    }

    /// Bytes sent through a two-buffer ring reach every item unchanged, whatever their sizes;
    /// only the items of the chunk being filled are open at once.
    #[test]
    fn the_ring_delivers_every_byte_unchanged() -> Result<()> {
        let sources: Vec<Vec<u8>> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|b| (b * 31 + i * 7) as u8).collect())
            .collect();
        let mut ring = HostRing::new(CHUNK, 2, SIZES.len());
        let (mut open, mut most_open, mut done) = (0usize, 0usize, Vec::new());
        let open_now = std::cell::Cell::new(0usize);
        run(
            &SIZES,
            &mut ring,
            |_, i| {
                open += 1;
                open_now.set(open_now.get() + 1);
                most_open = most_open.max(open_now.get());
                Ok(Cow::Borrowed(&sources[i][..]))
            },
            |_, i| {
                open_now.set(open_now.get() - 1);
                done.push(i);
                Ok(())
            },
        )?;
        assert_eq!(ring.items, sources);
        assert_eq!(open, SIZES.len());
        assert_eq!(done, (0..SIZES.len()).collect::<Vec<_>>());
        assert!(most_open <= 6, "{most_open} items open at once");
        assert_eq!(ring.passes, plan(&SIZES, CHUNK).len());
        Ok(())
    }

    /// A huge item (several fill pieces per chunk) arrives unchanged.
    #[test]
    fn huge_items_fill_in_pieces_and_arrive_unchanged() -> Result<()> {
        let chunk = 2 * FILL_PIECE + 4096;
        let source: Vec<u8> = (0..5 * FILL_PIECE + 3).map(|b| (b % 251) as u8).collect();
        let mut ring = HostRing::new(chunk, 2, 2);
        let sizes = [source.len(), 3];
        run(
            &sizes,
            &mut ring,
            |_, i| {
                Ok(Cow::Borrowed(if i == 0 {
                    &source[..]
                } else {
                    &[1, 2, 3][..]
                }))
            },
            |_, _| Ok(()),
        )?;
        assert!(ring.items[0] == source);
        assert_eq!(ring.items[1], [1, 2, 3]);
        Ok(())
    }

    fn slot(name: &str, shape: impl Into<Shape>, dtype: DType) -> Slot {
        Slot {
            name: name.into(),
            shape: shape.into(),
            dtype,
            packed: None,
            offset: 0,
        }
    }

    fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
        let bits = |t: &Tensor| -> Result<Vec<u8>> {
            let mut out = vec![0u8; t.elem_count() * t.dtype().size_in_bytes()];
            crate::weights::write_bytes(t, &mut out)?;
            Ok(out)
        };
        Ok(a.shape() == b.shape() && a.dtype() == b.dtype() && bits(a)? == bits(b)?)
    }

    /// Through a tiny ring (tensors straddling chunks), weights read from a file (bf16 and
    /// f32, asked for as stored and converted) and synthetic weights land bit-identical to
    /// what the `VarBuilder` path reads.
    #[test]
    fn staged_tensors_match_the_var_builder_bit_for_bit() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("vidgen-staging-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("w.safetensors");
        let dev = Device::Cpu;
        let a = (Tensor::arange(0f32, 700., &dev)? * 0.37)?
            .sin()?
            .reshape((7, 100))?
            .to_dtype(DType::BF16)?;
        let b = Tensor::arange(0f32, 1000., &dev)?.cos()?;
        let c = Tensor::arange(0f32, 3., &dev)?.to_dtype(DType::BF16)?;
        candle_core::safetensors::save(
            &[("a", a), ("b", b), ("c", c)].into_iter().collect(),
            &path,
        )?;
        let files = WeightSet::open(&Weights::Files(vec![path]))?;
        let synthetic = WeightSet::open(&Weights::Synthetic { seed: 7 })?;
        let slots = [
            slot("a", (7, 100), DType::F32),
            slot("b", 1000, DType::BF16),
            slot("c", 3, DType::BF16),
            slot("a2", (7, 100), DType::F32),
        ];
        for (weights, slots) in [(&files, &slots[..3]), (&synthetic, &slots[..])] {
            let mut ring = HostRing::new(512, 2, slots.len());
            let loaded = load_tensors(weights, slots, &mut ring)?;
            for ((name, tensor), slot) in loaded.iter().zip(slots) {
                let vb = weights.var_builder(slot.dtype, &dev);
                let expected = vb.get(slot.shape.clone(), &slot.name)?;
                assert_eq!(name, &slot.name);
                assert!(same_bits(tensor, &expected)?, "{name}");
            }
        }
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    /// Packed weights (Q8_0 blocks, fp8 bytes) load resident through the ring as held (raw
    /// bytes) and land expanded, bit-identical to what the `VarBuilder` path reads.
    #[test]
    fn packed_tensors_load_as_held_and_land_as_read() -> Result<()> {
        for weights in crate::offload::streamer::tests::packed_weight_sets()? {
            let names = crate::offload::streamer::tests::block_tensors(&weights, 0);
            let build = |vb: VarBuilder<'static>, _: VarBuilder<'static>| {
                names
                    .iter()
                    .map(|(n, s)| vb.get(s.as_slice(), n))
                    .collect::<candle_core::Result<Vec<_>>>()
            };
            let dev = Device::Cpu;
            let direct = build(
                weights.var_builder(DType::BF16, &dev),
                weights.var_builder(DType::BF16, &dev),
            )?;
            let mut packed = 0;
            let staged = build_staged(
                &weights,
                DType::BF16,
                &dev,
                |slots| {
                    packed = slots.iter().filter(|s| s.packed.is_some()).count();
                    let mut ring = HostRing::new(1024, 2, slots.len());
                    let loaded = load_tensors(&weights, slots, &mut ring)?;
                    // Packed tensors went through the ring as held: raw bytes.
                    for (slot, dtype) in slots.iter().zip(&ring.dtypes) {
                        assert_eq!(slot.packed.is_some(), *dtype == DType::U8, "{}", slot.name);
                    }
                    Ok(loaded)
                },
                build,
            )?;
            assert!(packed > 0);
            for (a, b) in staged.iter().zip(&direct) {
                assert!(same_bits(a, b)?);
            }
        }
        Ok(())
    }

    /// Built through the recording and a staging ring, a part gets the tensors it asks for,
    /// in the dtypes it asks for (an f32-kept one stays f32), bit-identical to reading them
    /// directly; what it keeps in host memory is read from the weights.
    #[test]
    fn staged_builds_match_direct_builds() -> Result<()> {
        let weights = WeightSet::open(&Weights::Synthetic { seed: 3 })?;
        let build = |vb: VarBuilder<'static>, host: VarBuilder<'static>| {
            Ok(vec![
                vb.pp("proj").get((40, 30), "weight")?,
                vb.get_with_hints_dtype(40, "norm.weight", candle_nn::Init::Const(1.), DType::F32)?,
                vb.pp("proj").get((40, 30), "weight")?,
                host.get((50, 30), "table")?,
            ])
        };
        let dev = Device::Cpu;
        let direct = build(
            weights.var_builder(DType::BF16, &dev),
            weights.var_builder(DType::BF16, &dev),
        )?;
        let mut loaded_names = Vec::new();
        let staged = build_staged(
            &weights,
            DType::BF16,
            &dev,
            |slots| {
                loaded_names = slots.iter().map(|s| s.name.clone()).collect();
                load_tensors(&weights, slots, &mut HostRing::new(1024, 2, slots.len()))
            },
            build,
        )?;
        // The host table is not loaded through the ring; the weight asked twice comes once.
        assert_eq!(loaded_names, ["proj.weight", "norm.weight"]);
        assert_eq!(staged[1].dtype(), DType::F32);
        for (a, b) in staged.iter().zip(&direct) {
            assert!(same_bits(a, b)?);
        }
        Ok(())
    }

    /// A LoRA'd weight lands unmerged and is merged where it landed, with the bits of the host
    /// merge a var builder (or a streamed block's host copy) reads; the LoRA changes it.
    #[test]
    fn lora_weights_merge_where_they_land_as_on_the_host() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("vidgen-staging-lora-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("lora.safetensors");
        let cpu = Device::Cpu;
        let a = (Tensor::arange(0f32, 120., &cpu)? * 0.1)?
            .sin()?
            .reshape((4, 30))?;
        let b = (Tensor::arange(0f32, 160., &cpu)? * 0.3)?
            .cos()?
            .reshape((40, 4))?;
        candle_core::safetensors::save(
            &std::collections::HashMap::from([
                ("transformer.proj.lora_A.weight".to_string(), a),
                ("transformer.proj.lora_B.weight".to_string(), b),
            ]),
            &path,
        )?;
        let spec = crate::lora::parse_spec(&format!("{}:0.5", path.display()))
            .map_err(anyhow::Error::msg)?;
        let loras =
            crate::lora::Scanned::scan(&[spec], crate::lora::Target::Transformer(None))?.read()?;
        std::fs::remove_dir_all(&dir)?;
        let plain = WeightSet::open(&Weights::Synthetic { seed: 3 })?;
        let weights = plain.clone().with_loras(std::sync::Arc::new(loras));
        let build = |vb: VarBuilder<'static>, _: VarBuilder<'static>| {
            Ok(vec![
                vb.pp("proj").get((40, 30), "weight")?,
                vb.get(40, "norm.weight")?,
            ])
        };
        let direct = build(
            weights.var_builder(DType::BF16, &cpu),
            weights.var_builder(DType::BF16, &cpu),
        )?;
        let staged = build_staged(
            &weights,
            DType::BF16,
            &cpu,
            |slots| load_tensors(&weights, slots, &mut HostRing::new(1024, 2, slots.len())),
            build,
        )?;
        let unchanged = build(
            plain.var_builder(DType::BF16, &cpu),
            plain.var_builder(DType::BF16, &cpu),
        )?;
        for (a, b) in staged.iter().zip(&direct) {
            assert!(same_bits(a, b)?);
        }
        assert!(
            !same_bits(&staged[0], &unchanged[0])?,
            "the LoRA changed nothing"
        );
        assert!(same_bits(&staged[1], &unchanged[1])?);
        Ok(())
    }

    /// On a GPU, resident loading through the staging ring gives the bits candle's own loading
    /// gives: file tensors as stored and converted both ways (one longer than a staging buffer,
    /// so it straddles chunks), and synthetic ones.
    #[cfg(feature = "cuda")]
    #[test]
    fn staged_loading_on_cuda_matches_candle() -> Result<()> {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: staged loading test skipped");
            return Ok(());
        };
        let dir = std::env::temp_dir().join(format!("vidgen-staging-cuda-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("w.safetensors");
        let cpu = Device::Cpu;
        let long = LOAD_CHUNK / 4 / 2 + 7;
        // Counted in u32: an f32 `arange` stops advancing at 2^24 (x + 1 rounds back to x) and
        // never ends.
        let big = Tensor::arange(0u32, (3 * long) as u32, &cpu)?
            .to_dtype(DType::F32)?
            .sin()?
            .reshape((3, long))?;
        let small = Tensor::arange(0f32, 99., &cpu)?
            .cos()?
            .to_dtype(DType::BF16)?;
        candle_core::safetensors::save(
            &[("big", big), ("small", small.clone()), ("same", small)]
                .into_iter()
                .collect(),
            &path,
        )?;
        let asked = [
            ("big", Shape::from((3, long)), DType::BF16),
            ("small", Shape::from(99), DType::F32),
            ("same", Shape::from(99), DType::BF16),
        ];
        let build = |vb: VarBuilder<'static>, _: VarBuilder<'static>| {
            asked
                .iter()
                .map(|(name, shape, dtype)| {
                    vb.get_with_hints_dtype(shape.clone(), name, candle_nn::Init::Const(0.), *dtype)
                })
                .collect::<candle_core::Result<Vec<_>>>()
        };
        for weights in [
            WeightSet::open(&Weights::Files(vec![path.clone()]))?,
            WeightSet::open(&Weights::Synthetic { seed: 5 })?,
        ] {
            let staged = build_resident(&weights, DType::BF16, &gpu, build)?;
            let direct = build(
                weights.var_builder(DType::BF16, &gpu),
                weights.var_builder(DType::BF16, &cpu),
            )?;
            for ((a, b), (name, ..)) in staged.iter().zip(&direct).zip(&asked) {
                assert!(a.device().is_cuda(), "{name}");
                assert!(
                    same_bits(&a.to_device(&cpu)?, &b.to_device(&cpu)?)?,
                    "{name}"
                );
            }
        }
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
