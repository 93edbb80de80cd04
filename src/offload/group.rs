//! What moves together: a group's tensors, laid out once as one host image.

use crate::weights::WeightSet;
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
    pub dtype: DType,
    /// Bytes from the start of the image.
    pub offset: usize,
}

impl Slot {
    /// The tensor's size in bytes.
    pub fn bytes(&self) -> usize {
        self.shape.elem_count() * self.dtype.size_in_bytes()
    }
}

/// A run of same-dtype tensors: one copy and one device allocation.
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
    /// Lays out `requests` (name, shape, dtype) in request order within each dtype; a tensor
    /// asked for twice is stored once.
    fn new(requests: Vec<(String, Shape, DType)>, packing: Packing) -> Self {
        let mut layout = GroupLayout::default();
        let mut dtypes: Vec<DType> = Vec::new();
        for (_, _, dtype) in &requests {
            if !dtypes.contains(dtype) {
                dtypes.push(*dtype);
            }
        }
        let mut offset = 0;
        for dtype in dtypes {
            let start = offset;
            for (name, shape, _) in requests.iter().filter(|r| r.2 == dtype) {
                if layout.slots.iter().any(|s| &s.name == name) {
                    continue;
                }
                let slot = Slot {
                    name: name.clone(),
                    shape: shape.clone(),
                    dtype,
                    offset,
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

    /// Bytes of the tensors themselves (without padding).
    pub fn tensor_bytes(&self) -> usize {
        self.slots.iter().map(Slot::bytes).sum()
    }

    /// The tensors as views of per-section device tensors (`sections[i]` holds section i as a
    /// flat 1-D tensor of its dtype).
    pub fn views(&self, sections: &[Tensor]) -> candle_core::Result<Vec<(String, Tensor)>> {
        self.slots
            .iter()
            .map(|slot| {
                let (index, section) = self
                    .sections
                    .iter()
                    .enumerate()
                    .find(|(_, s)| {
                        s.dtype == slot.dtype
                            && (s.offset..s.offset + s.bytes.max(1)).contains(&slot.offset)
                    })
                    .ok_or_else(|| {
                        candle_core::Error::Msg(format!("no section for {}", slot.name))
                    })?;
                let size = slot.dtype.size_in_bytes();
                let view = sections[index]
                    .narrow(
                        0,
                        (slot.offset - section.offset) / size,
                        slot.shape.elem_count(),
                    )?
                    .reshape(slot.shape.clone())?;
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
    seen: Arc<Mutex<Vec<(String, Shape, DType)>>>,
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
        self.seen
            .lock()
            .map_err(|_| candle_core::Error::Msg("recorder poisoned".into()))?
            .push((name.to_string(), s.clone(), dtype));
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
    seen: Arc<Mutex<Vec<(String, Shape, DType)>>>,
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

    fn requests() -> Vec<(String, Shape, DType)> {
        vec![
            ("a".into(), Shape::from((3, 5)), DType::BF16),
            ("b".into(), Shape::from(7), DType::F32),
            ("c".into(), Shape::from(100), DType::BF16),
            // Asked for twice (a tied weight): stored once.
            ("a".into(), Shape::from((3, 5)), DType::BF16),
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
