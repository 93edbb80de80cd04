//! What moves together: a group's tensors, laid out once as one host image.

use crate::weights::{Packed, WeightSet};
use anyhow::Result;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use std::sync::{Arc, Mutex};

/// Byte alignment of every tensor in a host image and on the device (what cuBLAS and
/// vectorised kernels like; the padding is a rounding error next to a weight).
pub(super) const ALIGN: usize = 256;

/// One tensor of a group and where its bytes sit in the group's host image.
#[derive(Clone, Debug)]
pub struct Slot {
    pub name: String,
    pub shape: Shape,
    /// The dtype the model computes with.
    pub dtype: DType,
    /// The compact form its bytes are held and copied in, expanded to `dtype` where they land;
    /// `None`: they are its values in `dtype`.
    pub packed: Option<Packed>,
    /// Bytes from the start of the image.
    pub offset: usize,
}

impl Slot {
    /// The tensor's size in bytes as held and copied.
    pub fn bytes(&self) -> usize {
        match self.packed {
            Some(packed) => packed.bytes(self.shape.elem_count()),
            None => self.device_bytes(),
        }
    }

    /// The tensor's size in bytes as the model computes with it.
    pub fn device_bytes(&self) -> usize {
        self.shape.elem_count() * self.dtype.size_in_bytes()
    }

    /// The dtype its bytes are copied in: its own, or raw bytes when packed.
    pub fn stored_dtype(&self) -> DType {
        match self.packed {
            Some(_) => DType::U8,
            None => self.dtype,
        }
    }

    /// Its bytes as held, where the memory map stores them so.
    pub fn mapped<'w>(&self, weights: &'w WeightSet) -> Option<&'w [u8]> {
        match self.packed {
            Some(packed) => weights.mapped_packed(&self.name, packed),
            None => weights.mapped_bytes(&self.name, self.dtype),
        }
    }

    /// Writes its bytes as held into `dst` (exactly [`Self::bytes`] long).
    pub fn read(&self, weights: &WeightSet, dst: &mut [u8]) -> candle_core::Result<()> {
        match self.packed {
            Some(packed) => weights.read_packed(&self.name, &self.shape, self.dtype, packed, dst),
            None => weights.read_into(&self.name, &self.shape, self.dtype, dst),
        }
    }

    /// The tensor the model gets from `landed`, its bytes on the device: packed ones expanded
    /// (once per landing), the others as they are.
    pub fn expand(&self, landed: Tensor) -> candle_core::Result<Tensor> {
        match self.packed {
            Some(packed) => packed.expand(&landed, &self.shape, self.dtype),
            None => Ok(landed),
        }
    }
}

/// A tensor asked for: its name, shape, dtype, and the compact form it is held in.
type Request = (String, Shape, DType, Option<Packed>);

/// A run of tensors copied in the same dtype: one copy and one device allocation.
#[derive(Clone, Debug)]
pub struct Section {
    pub dtype: DType,
    /// Bytes from the start of the image.
    pub offset: usize,
    pub bytes: usize,
}

/// How a group's tensors share device allocations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    /// One allocation and one copy per dtype: what streamed blocks want (few, large copies).
    ByDtype,
    /// One allocation per tensor: for a whole component whose constructor may derive new
    /// tensors from some weights, so dropping the originals frees them (a shared allocation
    /// would stay alive as long as any one of its views).
    PerTensor,
}

/// A group's host image: its tensors laid out by dtype, each aligned.
#[derive(Clone, Debug, Default)]
pub struct GroupLayout {
    pub slots: Vec<Slot>,
    pub sections: Vec<Section>,
    /// Size of the image in bytes (the tensors plus alignment padding).
    pub bytes: usize,
}

impl GroupLayout {
    /// Lays out `requests` in request order within each dtype they are copied in; a tensor
    /// asked for twice is stored once.
    fn new(requests: Vec<Request>, packing: Packing) -> Self {
        let mut layout = GroupLayout::default();
        let slots: Vec<Slot> = requests
            .into_iter()
            .map(|(name, shape, dtype, packed)| Slot {
                name,
                shape,
                dtype,
                packed,
                offset: 0,
            })
            .collect();
        let mut dtypes: Vec<DType> = Vec::new();
        for slot in &slots {
            if !dtypes.contains(&slot.stored_dtype()) {
                dtypes.push(slot.stored_dtype());
            }
        }
        let mut offset = 0;
        for dtype in dtypes {
            let start = offset;
            for slot in slots.iter().filter(|s| s.stored_dtype() == dtype) {
                if layout.slots.iter().any(|s| s.name == slot.name) {
                    continue;
                }
                let slot = Slot {
                    offset,
                    ..slot.clone()
                };
                let end = (offset + slot.bytes()).next_multiple_of(ALIGN);
                if packing == Packing::PerTensor {
                    layout.sections.push(Section {
                        dtype,
                        offset,
                        bytes: end - offset,
                    });
                }
                offset = end;
                layout.slots.push(slot);
            }
            if packing == Packing::ByDtype {
                layout.sections.push(Section {
                    dtype,
                    offset: start,
                    bytes: offset - start,
                });
            }
        }
        layout.bytes = offset;
        layout
    }

    /// Bytes of the tensors themselves as held (without padding).
    pub fn tensor_bytes(&self) -> usize {
        self.slots.iter().map(Slot::bytes).sum()
    }

    /// Bytes of the tensors as the model computes with them.
    pub fn device_bytes(&self) -> usize {
        self.slots.iter().map(Slot::device_bytes).sum()
    }

    /// Device bytes of the expanded copies of the packed tensors, made when the group lands
    /// and held while it computes.
    pub fn expanded_bytes(&self) -> usize {
        let packed = self.slots.iter().filter(|s| s.packed.is_some());
        packed.map(Slot::device_bytes).sum()
    }

    /// The tensors the model gets from the group's landed `views` ([`Self::views`]), packed
    /// ones expanded.
    pub fn expand(
        &self,
        views: Vec<(String, Tensor)>,
    ) -> candle_core::Result<Vec<(String, Tensor)>> {
        self.slots
            .iter()
            .zip(views)
            .map(|(slot, (name, view))| Ok((name, slot.expand(view)?)))
            .collect()
    }

    /// The tensors' bytes as views of per-section device tensors (`sections[i]` holds section i
    /// as a flat 1-D tensor of its dtype): shaped, or flat bytes where packed.
    pub fn views(&self, sections: &[Tensor]) -> candle_core::Result<Vec<(String, Tensor)>> {
        self.slots
            .iter()
            .map(|slot| {
                let (index, section) = self
                    .sections
                    .iter()
                    .enumerate()
                    .find(|(_, s)| {
                        s.dtype == slot.stored_dtype()
                            && (s.offset..s.offset + s.bytes.max(1)).contains(&slot.offset)
                    })
                    .ok_or_else(|| {
                        candle_core::Error::Msg(format!("no section for {}", slot.name))
                    })?;
                let size = section.dtype.size_in_bytes();
                let view = sections[index].narrow(
                    0,
                    (slot.offset - section.offset) / size,
                    slot.bytes() / size,
                )?;
                let view = match slot.packed {
                    Some(_) => view,
                    None => view.reshape(slot.shape.clone())?,
                };
                Ok((slot.name.clone(), view))
            })
            .collect()
    }
}

/// Notes the tensors a model's constructor asks for and hands it zero placeholders (no weight
/// is read and no memory is written: recording a 14B model costs nothing). With weights, each
/// request is checked against them so a missing tensor or a wrong shape fails here, at load
/// time; without, the shapes are what the constructors ask for (the memory plan's count).
struct Recorder {
    weights: Option<WeightSet>,
    seen: Arc<Mutex<Vec<Request>>>,
}

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        if let Some(weights) = &self.weights {
            weights.check(name, &s)?;
        }
        let packed = self.weights.as_ref().and_then(|w| w.packed(name, dtype));
        self.seen
            .lock()
            .map_err(|_| candle_core::Error::Msg("recorder poisoned".into()))?
            .push((name.to_string(), s.clone(), dtype, packed));
        // One zero broadcast to the shape: no memory, however large the tensor.
        Tensor::zeros((), dtype, &Device::Cpu)?.broadcast_as(s)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("offloaded models must give the shape of {name}")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.weights
            .as_ref()
            .is_none_or(|w| w.contains_tensor(name))
    }
}

/// The tensors one or more `VarBuilder`s handed out were asked for.
#[derive(Clone, Default)]
pub struct Recording {
    seen: Arc<Mutex<Vec<Request>>>,
}

impl Recording {
    /// A recording `VarBuilder` (checked against `weights` when given).
    pub fn var_builder(&self, weights: Option<&WeightSet>, dtype: DType) -> VarBuilder<'static> {
        let recorder = Recorder {
            weights: weights.cloned(),
            seen: self.seen.clone(),
        };
        VarBuilder::from_backend(Box::new(recorder), dtype, Device::Cpu)
    }

    /// What was asked for so far, laid out as one group.
    pub fn layout(&self, packing: Packing) -> Result<GroupLayout> {
        let requests = self
            .seen
            .lock()
            .map_err(|_| anyhow::anyhow!("recorder poisoned"))?
            .clone();
        Ok(GroupLayout::new(requests, packing))
    }
}

/// The layout of the group that `build` makes: the tensors it asks for, in the dtypes it asks
/// for them (a module kept in f32 stays f32), checked against `weights` when given.
pub fn record<B>(
    weights: Option<&WeightSet>,
    dtype: DType,
    packing: Packing,
    build: impl FnOnce(VarBuilder<'static>) -> candle_core::Result<B>,
) -> Result<GroupLayout> {
    let recording = Recording::default();
    drop(build(recording.var_builder(weights, dtype))?);
    recording.layout(packing)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn requests() -> Vec<Request> {
        vec![
            ("a".into(), Shape::from((3, 5)), DType::BF16, None),
            ("b".into(), Shape::from(7), DType::F32, None),
            ("c".into(), Shape::from(100), DType::BF16, None),
            // Asked for twice (a tied weight): stored once.
            ("a".into(), Shape::from((3, 5)), DType::BF16, None),
        ]
    }

    /// By dtype: one section per dtype in first-request order, every tensor at an aligned
    /// offset, a tensor asked for twice stored once, the image as long as its sections.
    #[test]
    fn layouts_group_by_dtype_and_align_every_tensor() {
        let layout = GroupLayout::new(requests(), Packing::ByDtype);
        let names: Vec<&str> = layout.slots.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "c", "b"]);
        assert!(layout.slots.iter().all(|s| s.offset % ALIGN == 0));
        assert_eq!(layout.sections.len(), 2);
        assert_eq!(
            (layout.sections[0].dtype, layout.sections[0].bytes),
            (DType::BF16, 2 * ALIGN)
        );
        assert_eq!(layout.sections[1].offset, 2 * ALIGN);
        assert_eq!(layout.bytes, 3 * ALIGN);
        assert_eq!(layout.tensor_bytes(), 15 * 2 + 100 * 2 + 7 * 4);
        let per_tensor = GroupLayout::new(requests(), Packing::PerTensor);
        assert_eq!(per_tensor.sections.len(), 3);
        assert_eq!(per_tensor.bytes, layout.bytes);
    }

    /// Views read each tensor back from its section, whatever the packing.
    #[test]
    fn views_read_each_tensor_from_its_section() -> candle_core::Result<()> {
        for packing in [Packing::ByDtype, Packing::PerTensor] {
            let layout = GroupLayout::new(requests(), packing);
            let sections: Vec<Tensor> = layout
                .sections
                .iter()
                .map(|s| {
                    let n = s.bytes / s.dtype.size_in_bytes();
                    Tensor::arange(0u32, n as u32, &Device::Cpu)?.to_dtype(s.dtype)
                })
                .collect::<candle_core::Result<_>>()?;
            let views = layout.views(&sections)?;
            for (name, view) in &views {
                let slot = layout.slots.iter().find(|s| &s.name == name).unwrap();
                assert_eq!(view.shape(), &slot.shape, "{name}");
                let section = layout
                    .sections
                    .iter()
                    .find(|s| {
                        s.dtype == slot.dtype
                            && (s.offset..s.offset + s.bytes).contains(&slot.offset)
                    })
                    .unwrap();
                let first = (slot.offset - section.offset) / slot.dtype.size_in_bytes();
                let value = view.flatten_all()?.to_dtype(DType::F32)?.get(0)?;
                assert_eq!(
                    value.to_scalar::<f32>()?,
                    first as f32,
                    "{name} {packing:?}"
                );
            }
        }
        Ok(())
    }
}
