//! Model-agnostic offload engine: what lives where, and when it moves.
//!
//! A model exposes its repeated blocks as "build block i from a `VarBuilder`". The engine keeps
//! each group's weights in host memory, converted once to the run dtype, and materialises a
//! group on the device just before it runs: group i+1..i+depth are copied while group i
//! computes, and a finished group's device copy is dropped (the host copy stays, nothing is
//! copied back). Models know nothing of this: they only see a `VarBuilder`.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// The weights of one group, by full tensor name, in host memory.
pub struct HostGroup {
    tensors: Vec<(String, Tensor)>,
}

impl HostGroup {
    /// Bytes held on the host.
    pub fn bytes(&self) -> usize {
        self.tensors
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// Copies the group to `device` and returns a `VarBuilder` over the copies.
    fn to_device(&self, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
        let mut map = HashMap::with_capacity(self.tensors.len());
        for (name, t) in &self.tensors {
            map.insert(name.clone(), t.to_device(device)?);
        }
        Ok(VarBuilder::from_tensors(map, dtype, device))
    }
}

/// Records every tensor a model asks for, so a group's weights can be held apart from the model.
struct Recorder {
    inner: VarBuilder<'static>,
    seen: Arc<Mutex<Vec<(String, Tensor)>>>,
}

impl Recorder {
    /// Notes a tensor handed to the model.
    fn record(&self, name: &str, t: Tensor) -> candle_core::Result<Tensor> {
        self.seen
            .lock()
            .map_err(|_| candle_core::Error::Msg("recorder poisoned".into()))?
            .push((name.to_string(), t.clone()));
        Ok(t)
    }
}

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let vb = self.inner.clone().set_dtype(dtype);
        self.record(name, vb.get_with_hints(s, name, h)?.to_device(dev)?)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let vb = self.inner.clone().set_dtype(dtype);
        self.record(name, vb.get_unchecked(name)?.to_device(dev)?)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// Loads group `index` into host memory by building it once on the host and recording the
/// tensors it asked for (the dtype each sub-module asked for is kept, e.g. f32 norms).
pub fn host_group<B>(
    source: &VarBuilder<'static>,
    build: impl Fn(VarBuilder<'static>) -> candle_core::Result<B>,
) -> Result<HostGroup> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorder = Recorder {
        inner: source.clone(),
        seen: seen.clone(),
    };
    let host_vb = VarBuilder::from_backend(Box::new(recorder), source.dtype(), Device::Cpu);
    drop(build(host_vb)?);
    let tensors = std::mem::take(
        &mut *seen
            .lock()
            .map_err(|_| anyhow::anyhow!("recorder poisoned"))?,
    );
    Ok(HostGroup { tensors })
}

/// Streams groups through the device in order, `depth` groups ahead of the one computing.
pub struct Streamer<B> {
    groups: Vec<HostGroup>,
    build: Box<dyn Fn(usize, VarBuilder<'static>) -> candle_core::Result<B> + Send + Sync>,
    dtype: DType,
    device: Device,
    depth: usize,
}

impl<B> Streamer<B> {
    /// An engine over host `groups`; `build(i, vb)` makes group i from its device copies.
    pub fn new(
        groups: Vec<HostGroup>,
        build: impl Fn(usize, VarBuilder<'static>) -> candle_core::Result<B> + Send + Sync + 'static,
        dtype: DType,
        device: Device,
        depth: usize,
    ) -> Self {
        Streamer {
            groups,
            build: Box::new(build),
            dtype,
            device,
            depth: depth.max(1),
        }
    }

    /// Host bytes held by all groups.
    pub fn host_bytes(&self) -> usize {
        self.groups.iter().map(HostGroup::bytes).sum()
    }

    fn materialise(&self, index: usize) -> Result<B> {
        let vb = self.groups[index].to_device(self.dtype, &self.device)?;
        (self.build)(index, vb)
            .with_context(|| format!("building offloaded group {index} on the device"))
    }

    /// Runs `f` on every group in order; each group is on the device only around its turn.
    pub fn for_each(&self, mut f: impl FnMut(&B) -> Result<()>) -> Result<()> {
        let mut ready: VecDeque<B> = VecDeque::with_capacity(self.depth + 1);
        let mut next = 0;
        while next < self.groups.len().min(self.depth) {
            ready.push_back(self.materialise(next)?);
            next += 1;
        }
        while let Some(group) = ready.pop_front() {
            if next < self.groups.len() {
                ready.push_back(self.materialise(next)?);
                next += 1;
            }
            f(&group)?;
        }
        Ok(())
    }
}
