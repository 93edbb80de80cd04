//! Weight I/O, below models and the offload engine: safetensors (single or sharded) or one GGUF
//! file, memory mapped, checked and converted to the run dtype at load, or seeded random weights
//! for synthetic models. Models see only a `VarBuilder`; where the files are is `models::source`'s.

use anyhow::{Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use rayon::prelude::*;
use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;

pub mod gguf;
pub mod original;
mod packed;
mod storage;

pub use packed::Packed;
pub use storage::{StorageCast, StorageDtype};

/// Where a component's weights come from.
#[derive(Clone, Debug)]
pub enum Weights {
    /// safetensors files (all shards of the component), or one GGUF file.
    Files(Vec<PathBuf>),
    /// Seeded random weights shaped by the model's own requests.
    Synthetic { seed: u64 },
}

/// Called with the bytes of each tensor read (stored size), for progress reports.
pub type OnRead = Arc<dyn Fn(u64) + Send + Sync>;

/// A component's opened weights: memory-mapped safetensors or the seeded synthetic generator.
/// Models read them through a `VarBuilder`; the offload engine reads raw bytes straight into
/// its own host buffers (no intermediate tensor when the stored dtype is the one wanted).
#[derive(Clone)]
pub struct WeightSet {
    source: Source,
    on_read: Option<OnRead>,
    /// LoRA deltas merged into the weights they change as those are read.
    loras: Option<Arc<crate::lora::Loras>>,
    /// Layerwise fp8 storage: the values it rounds are read rounded.
    cast: Option<StorageCast>,
    /// Ranks of the synthetic tensors asked for so far (synthetic weights store none): how
    /// `--storage-dtype` tells a Linear's or a convolution's weights from a norm's there.
    asked_ranks: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
}

#[derive(Clone)]
enum Source {
    /// Memory-mapped files, their keys in `KeyLayout`.
    Mapped(Arc<Mapped>, KeyLayout),
    Synthetic(SyntheticWeights),
}

/// Memory-mapped weight files.
enum Files {
    Safetensors(MmapedSafetensors),
    Gguf(gguf::Gguf),
}

/// [`Files`] unmapped on the teardown thread when the last holder lets go: unmapping the
/// pages a load read costs page-table work that grows with the file (their contents stay in the
/// page cache: nothing is given back).
struct Mapped(std::mem::ManuallyDrop<Files>);

impl std::ops::Deref for Mapped {
    type Target = Files;

    fn deref(&self) -> &Files {
        &self.0
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and never read again.
        let files = unsafe { std::mem::ManuallyDrop::take(&mut self.0) };
        crate::teardown::later(0, move || {
            let ranges = files.data_ranges();
            // SAFETY: the tensors' bytes (and what lies between them in the files), read by
            // nothing now (any page lock on them was released before, on the same thread),
            // unmapped right after.
            unsafe { crate::teardown::discard_pages(ranges) };
            drop(files);
        });
    }
}

/// A stored tensor as its file holds it.
struct View<'a> {
    /// Its dtype where its bytes are its values in a dtype vidgen converts; `None` for a GGUF
    /// block quantization (or another dtype), made by [`Files::load`].
    dtype: Option<DType>,
    /// A GGUF tensor's block quantization.
    blocks: Option<gguf::GgmlType>,
    shape: Vec<usize>,
    data: &'a [u8],
    /// Its values are the stored ones with the halves of the first dimension swapped: `data`
    /// is not them as they are read (see [`Part`]).
    swapped: bool,
}

/// Which part of a stored tensor a weight is, in a file that fuses or reorders what diffusers
/// keeps apart (the original layouts of [`original`]).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    /// The stored tensor as it is.
    Whole,
    /// Rows `range` of the first dimension.
    Rows(std::ops::Range<usize>),
    /// The whole tensor with the two halves of its first dimension swapped.
    SwappedHalves,
}

impl Part {
    /// `t` (as stored) cut to this part.
    fn cut(&self, t: Tensor) -> candle_core::Result<Tensor> {
        match self {
            Part::Whole => Ok(t),
            Part::Rows(r) => t.narrow(0, r.start, r.len())?.contiguous(),
            Part::SwappedHalves => {
                let half = t.dim(0)? / 2;
                Tensor::cat(&[t.narrow(0, half, half)?, t.narrow(0, 0, half)?], 0)
            }
        }
    }
}

impl<'a> View<'a> {
    /// This stored tensor cut to `part` (`None` where its bytes do not split by rows).
    fn part(self, part: &Part) -> Option<View<'a>> {
        if *part == Part::Whole {
            return Some(self);
        }
        let rows = *self.shape.first()?;
        if rows == 0 || !self.data.len().is_multiple_of(rows) {
            return None;
        }
        match part {
            Part::Whole => Some(self),
            Part::Rows(r) => {
                let row = self.data.len() / rows;
                let mut shape = self.shape.clone();
                shape[0] = r.len();
                Some(View {
                    data: &self.data[r.start * row..r.end * row],
                    shape,
                    ..self
                })
            }
            Part::SwappedHalves => rows.is_multiple_of(2).then_some(View {
                swapped: true,
                ..self
            }),
        }
    }
}

impl Files {
    /// The address ranges of every tensor's bytes in the mappings.
    fn data_ranges(&self) -> Vec<std::ops::Range<usize>> {
        self.names()
            .iter()
            .filter_map(|name| self.view(name))
            .map(|v| v.data.as_ptr() as usize..v.data.as_ptr() as usize + v.data.len())
            .collect()
    }

    fn names(&self) -> Vec<String> {
        match self {
            Files::Safetensors(st) => st.tensors().into_iter().map(|(n, _)| n).collect(),
            Files::Gguf(g) => g.names().cloned().collect(),
        }
    }

    fn view(&self, key: &str) -> Option<View<'_>> {
        match self {
            Files::Safetensors(st) => st.get(key).ok().map(|v| View {
                dtype: DType::try_from(v.dtype()).ok(),
                blocks: None,
                shape: v.shape().to_vec(),
                data: v.data(),
                swapped: false,
            }),
            Files::Gguf(g) => g.tensor(key).map(|t| View {
                dtype: t.kind.float(),
                blocks: t.kind.float().is_none().then_some(t.kind),
                shape: t.shape.clone(),
                data: g.data(t),
                swapped: false,
            }),
        }
    }

    /// Tensor `key` on the CPU as stored (a GGUF block quantization decoded to float16, as
    /// diffusers decodes it).
    fn load(&self, key: &str) -> candle_core::Result<Tensor> {
        match self {
            Files::Safetensors(st) => st.load(key, &Device::Cpu),
            Files::Gguf(g) => {
                let t = g
                    .tensor(key)
                    .ok_or_else(|| candle_core::Error::CannotFindTensor { path: key.into() })?;
                match (t.kind.float(), g.dequantize(t)) {
                    (Some(dtype), _) => {
                        Tensor::from_raw_buffer(g.data(t), dtype, &t.shape, &Device::Cpu)
                    }
                    (None, Some(values)) => {
                        Tensor::from_vec(values, t.shape.as_slice(), &Device::Cpu)
                    }
                    (None, None) => unreachable!("a block quantization decodes"),
                }
            }
        }
    }
}

/// How a file names a transformer's weights: diffusers' names, or a single file in a model's
/// original layout ([`original::Model`]: Wan-AI's `blocks.0.self_attn.q.weight`, FLUX.1's and
/// HunyuanVideo's `double_blocks.0.img_attn...`), bare or under ComfyUI's
/// `model.diffusion_model.`; told by the layout's marker key, as diffusers tells them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyLayout {
    Diffusers,
    Original {
        model: original::Model,
        comfyui: bool,
    },
}

impl std::fmt::Display for KeyLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyLayout::Diffusers => write!(f, "diffusers"),
            KeyLayout::Original { model, comfyui } => {
                let prefix = if *comfyui { "ComfyUI " } else { "" };
                write!(f, "{prefix}{} original", model.name())
            }
        }
    }
}

impl KeyLayout {
    /// ComfyUI's prefix of every key.
    const COMFYUI: &'static str = "model.diffusion_model.";

    fn of(names: &[String]) -> Self {
        let has = |key: &str| names.iter().any(|n| n == key);
        for model in original::Model::ALL {
            for comfyui in [true, false] {
                let prefix = if comfyui { Self::COMFYUI } else { "" };
                if has(&format!("{prefix}{}", model.marker())) {
                    return KeyLayout::Original { model, comfyui };
                }
            }
        }
        KeyLayout::Diffusers
    }

    /// The stored key of `key` as the layout's files name it: under ComfyUI's prefix where
    /// they have it.
    fn prefixed<'a>(self, key: Cow<'a, str>) -> Cow<'a, str> {
        match self {
            KeyLayout::Original { comfyui: true, .. } => {
                Cow::Owned(format!("{}{key}", Self::COMFYUI))
            }
            _ => key,
        }
    }

    /// The stored key of diffusers weight `name` (itself where no mapping applies) and where
    /// the weight lies in it.
    fn locate<'a>(self, name: &'a str) -> (Cow<'a, str>, original::Piece) {
        let (key, piece) = match self {
            KeyLayout::Diffusers => None,
            KeyLayout::Original { model, .. } => model.original(name),
        }
        .map_or((Cow::Borrowed(name), original::Piece::Whole), |(k, p)| {
            (Cow::Owned(k), p)
        });
        (self.prefixed(key), piece)
    }

    /// The stored key of the tensor whose rows give a single block's D.
    fn stored_linear2(self, block: usize) -> String {
        self.prefixed(Cow::Owned(original::linear2(block)))
            .into_owned()
    }
}

impl WeightSet {
    /// Opens (memory maps) the weight files, or sets up the generator.
    pub fn open(weights: &Weights) -> Result<Self> {
        let source = match weights {
            Weights::Files(files) => {
                let opened = match files.as_slice() {
                    [file] if gguf::is_gguf(file) => gguf::Gguf::open(file)
                        .map(Files::Gguf)
                        .with_context(|| format!("reading GGUF file {}", file.display()))?,
                    // SAFETY: the files are memory mapped read-only; vidgen never writes to
                    // model files.
                    _ => unsafe { MmapedSafetensors::multi(files) }
                        .map(Files::Safetensors)
                        .with_context(|| {
                            format!(
                                "opening {} (truncated or not a safetensors or GGUF file?)",
                                describe(files)
                            )
                        })?,
                };
                let keys = KeyLayout::of(&opened.names());
                Source::Mapped(Arc::new(Mapped(std::mem::ManuallyDrop::new(opened))), keys)
            }
            Weights::Synthetic { seed } => Source::Synthetic(SyntheticWeights { seed: *seed }),
        };
        Ok(WeightSet {
            source,
            on_read: None,
            loras: None,
            cast: None,
            asked_ranks: Arc::default(),
        })
    }

    /// The same weights with `loras` merged into every weight they change, whichever way it is
    /// read (a model's `VarBuilder`, the offload engine's host copies).
    pub fn with_loras(mut self, loras: Arc<crate::lora::Loras>) -> Self {
        self.loras = Some(loras).filter(|l| !l.is_empty());
        self
    }

    /// The same weights with the values `cast` rounds read rounded through its fp8 format.
    pub fn with_storage_cast(mut self, cast: StorageCast) -> Self {
        self.cast = Some(cast);
        self
    }

    /// Whether weight `name` is computed from what is stored rather than read as it is: a
    /// LoRA changes it, it is stored in fp8 with a scale, or `--storage-dtype` rounds it.
    fn transforms(&self, name: &str) -> bool {
        self.lora_of(name).is_some() || self.converts(name)
    }

    /// Whether weight `name`'s values are computed from what is stored (before any LoRA): fp8
    /// with a scale, or rounded by `--storage-dtype`.
    fn converts(&self, name: &str) -> bool {
        self.fp8_scale(name).is_some() || self.rounds(name)
    }

    /// Whether a LoRA changes weight `name`.
    pub fn lora_changes(&self, name: &str) -> bool {
        self.lora_of(name).is_some()
    }

    /// The LoRAs, where they change weight `name`.
    fn lora_of(&self, name: &str) -> Option<&crate::lora::Loras> {
        self.loras.as_deref().filter(|l| l.changes(name))
    }

    /// Whether `--storage-dtype` rounds weight `name`.
    fn rounds(&self, name: &str) -> bool {
        self.cast.as_ref().is_some_and(|cast| {
            cast.rounds(name, |weight| match &self.source {
                Source::Mapped(..) => self.stored_shape(weight).map(|s| s.len()),
                Source::Synthetic(_) => self.asked_ranks.lock().ok()?.get(weight).copied(),
            })
        })
    }

    /// Notes the rank of synthetic tensor `name` as a model asks for it (a constructor asks for
    /// a module's weight before its bias).
    fn note_asked(&self, name: &str, shape: &Shape) {
        if let (Source::Synthetic(_), Ok(mut ranks)) = (&self.source, self.asked_ranks.lock()) {
            ranks.insert(name.to_string(), shape.rank());
        }
    }

    /// The stored scale of an fp8 weight `name`: ComfyUI's `<module>.scale_weight` (0-dim) or
    /// LightX2V's `<module>.weight_scale` (one per output row).
    fn fp8_scale(&self, name: &str) -> Option<String> {
        let Source::Mapped(files, keys) = &self.source else {
            return None;
        };
        let (stored, _) = keys.locate(name);
        let module = stored.strip_suffix(".weight")?;
        FP8_SCALES
            .into_iter()
            .map(|s| format!("{module}.{s}"))
            .find(|s| files.view(s).is_some())
    }

    /// Whether the files hold scaled fp8 weights (a scale of [`Self::fp8_scale`]'s).
    pub fn holds_scaled_fp8(&self) -> bool {
        self.names().iter().any(|n| {
            n.rsplit_once('.')
                .is_some_and(|(_, last)| FP8_SCALES.contains(&last))
        })
    }

    /// The packed form of weight `name` where it is stored as float8_e4m3fn with a scale for
    /// the tensor (0-dim) or one per row of a matrix, as [`Self::transformed`] reads them.
    fn scaled_fp8(&self, name: &str) -> Option<Packed> {
        let (Source::Mapped(files, _), Some(scale)) = (&self.source, self.fp8_scale(name)) else {
            return None;
        };
        let (weight, scale) = (self.view(name).filter(|v| !v.swapped)?, files.view(&scale)?);
        let scales = match (scale.shape.as_slice(), weight.shape.as_slice()) {
            ([], _) => 1,
            (dims, &[rows, _]) if dims.iter().product::<usize>() == rows => rows,
            _ => return None,
        };
        (weight.dtype == Some(DType::F8E4M3) && scale.dtype.is_some())
            .then_some(Packed::ScaledFp8 { scales })
    }

    /// Weight `name` (of `shape`) computed from what is stored, as `dtype` on `dev` (as
    /// [`Self::read_into`] computes it on the host); `None` where it is read as stored.
    fn transformed(
        &self,
        name: &str,
        shape: &Shape,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Option<Tensor>> {
        self.note_asked(name, shape);
        if !self.transforms(name) {
            return Ok(None);
        }
        match self.host_tensor(name, shape, dtype)? {
            Some(t) => t.to_device(dev).map(Some),
            None => candle_core::bail!("{name}: a LoRA or fp8 weight wanted as {dtype:?}"),
        }
    }

    /// The same weights, reporting every tensor read to `on_read`.
    pub fn with_progress(mut self, on_read: OnRead) -> Self {
        self.on_read = Some(on_read);
        self
    }

    /// Bytes of every stored tensor (`None` for synthetic weights, which have no files).
    pub fn stored_bytes(&self) -> Option<u64> {
        match &self.source {
            Source::Mapped(files, _) => Some(
                files
                    .names()
                    .iter()
                    .filter_map(|n| files.view(n))
                    .map(|v| v.data.len() as u64)
                    .sum(),
            ),
            Source::Synthetic(_) => None,
        }
    }

    /// Counts `bytes` as read: tensors used where they are (page-locked in the memory map) are
    /// never read through [`Self::read_into`], but are ready all the same.
    pub fn report(&self, bytes: usize) {
        if let Some(f) = &self.on_read {
            f(bytes as u64);
        }
    }

    /// Reports `name` as read: its stored size in a file, else the size made.
    fn report_read(&self, name: &str, made: &Tensor) {
        let bytes = match &self.source {
            Source::Mapped(..) => self.view(name).map_or(0, |v| v.data.len()),
            Source::Synthetic(_) => made.elem_count() * made.dtype().size_in_bytes(),
        };
        self.report(bytes);
    }

    /// A `VarBuilder` converting each tensor to `dtype` on `device` when a model asks.
    pub fn var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), dtype, device.clone())
    }

    /// The names of every stored tensor (none for synthetic weights).
    pub fn names(&self) -> Vec<String> {
        match &self.source {
            Source::Mapped(files, _) => files.names(),
            Source::Synthetic(_) => Vec::new(),
        }
    }

    /// How the files name the weights, and the stored key of weight `name`.
    pub fn stored_key(&self, name: &str) -> (KeyLayout, String) {
        match &self.source {
            Source::Mapped(_, keys) => (*keys, keys.locate(name).0.into_owned()),
            Source::Synthetic(_) => (KeyLayout::Diffusers, name.to_string()),
        }
    }

    /// The stored shape of weight `name` (`None` where it is not stored, or for synthetic
    /// weights).
    pub fn stored_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.view(name).map(|v| v.shape)
    }

    /// What kind of file the weights are in, for messages: "safetensors", or GGUF with the
    /// architecture it declares.
    pub fn format(&self) -> String {
        match &self.source {
            Source::Mapped(files, _) => match &***files {
                Files::Safetensors(_) => "safetensors".into(),
                Files::Gguf(g) => match &g.architecture {
                    Some(a) => format!("GGUF, architecture \"{a}\""),
                    None => "GGUF".into(),
                },
            },
            Source::Synthetic(_) => "synthetic".into(),
        }
    }

    /// Stored tensor `name` as its file holds it (`None` where it is not stored, or for
    /// synthetic weights).
    fn view(&self, name: &str) -> Option<View<'_>> {
        let (files, key, part) = self.located(name)?;
        files.view(&key)?.part(&part)
    }

    /// The file, stored key and part of the stored tensor that weight `name` is (`None` where
    /// it is not stored, or for synthetic weights).
    fn located(&self, name: &str) -> Option<(&Files, String, Part)> {
        let Source::Mapped(files, keys) = &self.source else {
            return None;
        };
        let (key, piece) = keys.locate(name);
        let part = match piece {
            original::Piece::Whole => Part::Whole,
            original::Piece::SwappedHalves => Part::SwappedHalves,
            piece => {
                let rows = *files.view(&key)?.shape.first()?;
                let d = match piece {
                    original::Piece::Linear1 { block, .. } => {
                        Some(*files.view(&keys.stored_linear2(block))?.shape.first()?)
                    }
                    _ => None,
                };
                Part::Rows(original::rows(piece, rows, d)?)
            }
        };
        Some((files, key.into_owned(), part))
    }

    /// Weight `name` on the CPU as its part of the stored tensor holds it.
    fn load_stored(&self, name: &str) -> candle_core::Result<Tensor> {
        let (files, key, part) = self
            .located(name)
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.into() })?;
        part.cut(files.load(&key)?)
    }

    /// Whether weight `name` is all of a stored tensor as it is stored (read straight from the
    /// file by candle where it lands).
    fn stored_whole(&self, name: &str) -> bool {
        self.located(name)
            .is_some_and(|(_, _, part)| part == Part::Whole)
    }

    /// Checks that `name` exists with `shape` (synthetic weights have every shape asked for).
    pub fn check(&self, name: &str, shape: &Shape) -> candle_core::Result<()> {
        self.note_asked(name, shape);
        if let Source::Mapped(..) = &self.source {
            let stored: Shape = self
                .view(name)
                .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.into() })?
                .shape
                .into();
            if &stored != shape {
                Err(candle_core::Error::UnexpectedShape {
                    msg: format!("shape mismatch for {name}"),
                    expected: shape.clone(),
                    got: stored,
                })?
            }
        }
        Ok(())
    }

    /// The stored bytes of `name` when they already are `dtype` (zero copy from the map).
    pub fn mapped_bytes(&self, name: &str, dtype: DType) -> Option<&[u8]> {
        if self.transforms(name) {
            return None;
        }
        self.stored_bytes_as(name, dtype)
    }

    /// The stored bytes of `name` where they are stored as `dtype`, whatever is done with them.
    fn stored_bytes_as(&self, name: &str, dtype: DType) -> Option<&[u8]> {
        let view = self.view(name)?;
        (view.dtype? == dtype && !view.swapped).then_some(view.data)
    }

    /// The dtype tensor `name`'s bytes go to a device in when a model wants it as `dtype`: as
    /// stored in a file (converted on the device after the copy, as candle's own loading does),
    /// or `dtype` where the host makes them (synthetic weights, or a stored dtype that
    /// [`write_bytes`] does not handle, converted on the host as candle would).
    pub fn staged_dtype(&self, name: &str, dtype: DType) -> DType {
        if self.converts(name) {
            return dtype;
        }
        match self.view(name).and_then(|v| v.dtype) {
            Some(stored) if BYTE_DTYPES.contains(&stored) => stored,
            _ => dtype,
        }
    }

    /// The compact form weight `name` is held and copied in when a model wants it as `dtype`,
    /// expanded where it lands ([`Packed::expand`]): fp8 bytes where `--storage-dtype` rounds
    /// it, a scaled fp8 weight's bytes and scales, GGUF blocks as stored; `None` where it is
    /// held as values (a float tensor, one a LoRA changes, or `dtype` not a float dtype).
    pub fn packed(&self, name: &str, dtype: DType) -> Option<Packed> {
        if !Packed::expands_to(dtype) || self.loras.as_ref().is_some_and(|l| l.changes(name)) {
            return None;
        }
        match &self.cast {
            Some(cast) if self.rounds(name) => Some(Packed::Fp8(cast.dtype)),
            _ if self.fp8_scale(name).is_some() => self.scaled_fp8(name),
            _ => self.view(name)?.blocks.map(Packed::Gguf),
        }
    }

    /// Weight `name`'s bytes in form `packed` for a model that wants it as `dtype`: borrowed
    /// from the map (GGUF blocks), or made on the host (fp8 bytes of the rounded values, a
    /// scaled fp8 weight's scales in f32 and its bytes).
    pub fn packed_bytes(
        &self,
        name: &str,
        shape: &Shape,
        dtype: DType,
        packed: Packed,
    ) -> candle_core::Result<Cow<'_, [u8]>> {
        if let Some(bytes) = self.mapped_packed(name, packed) {
            self.report(bytes.len());
            return Ok(Cow::Borrowed(bytes));
        }
        let mut made = vec![0u8; packed.bytes(shape.elem_count())];
        self.read_packed(name, shape, dtype, packed, &mut made)?;
        Ok(Cow::Owned(made))
    }

    /// The stored bytes of `name` where they are already in form `packed` (GGUF blocks).
    pub fn mapped_packed(&self, name: &str, packed: Packed) -> Option<&[u8]> {
        let view = self.view(name)?;
        (Some(packed) == view.blocks.map(Packed::Gguf) && !view.swapped).then_some(view.data)
    }

    /// Writes weight `name`, wanted as `dtype`, in form `packed` into `dst` (exactly its byte
    /// size).
    pub fn read_packed(
        &self,
        name: &str,
        shape: &Shape,
        dtype: DType,
        packed: Packed,
        dst: &mut [u8],
    ) -> candle_core::Result<()> {
        if dst.len() != packed.bytes(shape.elem_count()) {
            candle_core::bail!("{name}: {packed:?} of {shape:?} in {} bytes", dst.len())
        }
        match packed {
            Packed::Gguf(_) => {
                let view = self
                    .view(name)
                    .filter(|v| Some(packed) == v.blocks.map(Packed::Gguf))
                    .ok_or_else(|| {
                        candle_core::Error::Msg(format!("{name} is not stored as {packed:?}"))
                    })?;
                // A swapped tensor's halves change places: whole rows of blocks each.
                let half = if view.swapped { view.data.len() / 2 } else { 0 };
                let (head, tail) = view.data.split_at(half);
                let (front, back) = dst.split_at_mut(tail.len());
                for (d, s) in [(front, tail), (back, head)] {
                    d.par_chunks_mut(COPY_CHUNK)
                        .zip(s.par_chunks(COPY_CHUNK))
                        .for_each(|(d, s)| d.copy_from_slice(s));
                }
                self.report(view.data.len());
            }
            Packed::ScaledFp8 { scales } => {
                let (Source::Mapped(files, _), Some(scale), Some(view)) =
                    (&self.source, self.fp8_scale(name), self.view(name))
                else {
                    candle_core::bail!("{name} is not stored as scaled fp8")
                };
                let scale: Vec<f32> = files
                    .load(&scale)?
                    .flatten_all()?
                    .to_dtype(DType::F32)?
                    .to_vec1()?;
                if scale.len() != scales {
                    candle_core::bail!("{name}: {} scales stored, {scales} held", scale.len())
                }
                let (held, values) = dst.split_at_mut(4 * scales);
                for (d, s) in held.chunks_exact_mut(4).zip(&scale) {
                    d.copy_from_slice(&s.to_le_bytes());
                }
                values
                    .par_chunks_mut(COPY_CHUNK)
                    .zip(view.data.par_chunks(COPY_CHUNK))
                    .for_each(|(d, s)| d.copy_from_slice(s));
                self.report(view.data.len());
            }
            Packed::Fp8(format) => {
                // The rounded values, exact in `dtype` and so in f32.
                let mut values = vec![0u8; shape.elem_count() * dtype.size_in_bytes()];
                self.read_unmerged_into(name, shape, dtype, &mut values)?;
                let encode = |v: f32| format.encode(v);
                match dtype {
                    DType::F32 => encode_each::<f32>(&mut values, dst, encode)?,
                    DType::BF16 => encode_each::<half::bf16>(&mut values, dst, encode)?,
                    DType::F16 => encode_each::<half::f16>(&mut values, dst, encode)?,
                    other => candle_core::bail!("{name}: fp8 weights wanted as {other:?}"),
                }
            }
        }
        Ok(())
    }

    /// Tensor `name`'s bytes in [`Self::staged_dtype`], before any LoRA (merged where they land:
    /// [`Self::merged_where_landed`]): borrowed from the map, or made on the host (and then held
    /// only until they are copied).
    pub fn staged_bytes(
        &self,
        name: &str,
        shape: &Shape,
        dtype: DType,
    ) -> candle_core::Result<Cow<'_, [u8]>> {
        let staged = self.staged_dtype(name, dtype);
        let stored = (!self.converts(name))
            .then(|| self.stored_bytes_as(name, staged))
            .flatten();
        if let Some(bytes) = stored {
            self.report(bytes.len());
            return Ok(Cow::Borrowed(bytes));
        }
        // Made on the host (a swapped original-layout tensor, converted values), still in the
        // staged dtype: the copy's size and the conversion where it lands go by it.
        let mut made = vec![0u8; shape.elem_count() * staged.size_in_bytes()];
        self.read_unmerged_into(name, shape, staged, &mut made)?;
        Ok(Cow::Owned(made))
    }

    /// `landed`, weight `name` from [`Self::staged_bytes`] on a device in the model's dtype, with
    /// the LoRA deltas merged there (a GPU merges in milliseconds; the same bits as a host copy's
    /// merge, see `lora::merge`).
    pub fn merged_where_landed(&self, name: &str, landed: Tensor) -> candle_core::Result<Tensor> {
        match self.lora_of(name) {
            Some(loras) => loras.merged(name, &landed),
            None => Ok(landed),
        }
    }

    /// Launches the merge of weight `name`'s LoRA deltas into its unmerged values at device
    /// address `weight` (`dims` values of `dtype`) in place on `stream`, where a LoRA changes it
    /// (the host merge's bits); asynchronous, ordered on `stream`.
    #[cfg(feature = "cuda")]
    pub fn merge_in_place(
        &self,
        name: &str,
        dev: &candle_core::CudaDevice,
        stream: &Arc<candle_core::cuda::cudarc::driver::CudaStream>,
        weight: u64,
        dims: &[usize],
        dtype: DType,
    ) -> candle_core::Result<()> {
        match self.lora_of(name) {
            Some(loras) => loras.merge_in_place(name, dev, stream, weight, dims, dtype),
            None => Ok(()),
        }
    }

    /// Writes tensor `name` as `dtype` into `dst` (exactly its byte size), with the LoRA deltas
    /// merged in place.
    pub fn read_into(
        &self,
        name: &str,
        shape: &Shape,
        dtype: DType,
        dst: &mut [u8],
    ) -> candle_core::Result<()> {
        self.read_unmerged_into(name, shape, dtype, dst)?;
        match self.lora_of(name) {
            Some(loras) => loras.merge_into(name, shape.dims(), dtype, dst),
            None => Ok(()),
        }
    }

    /// Writes tensor `name` as `dtype` into `dst` (exactly its byte size), before any LoRA: a
    /// plain copy from the map when the stored dtype matches, a conversion otherwise; an fp8
    /// weight times its scale (`W8 as f32 · scale`, one f32 product); then rounded through the
    /// storage dtype where `--storage-dtype` rounds it (diffusers casts the weights it loaded in
    /// the run dtype).
    pub fn read_unmerged_into(
        &self,
        name: &str,
        shape: &Shape,
        dtype: DType,
        dst: &mut [u8],
    ) -> candle_core::Result<()> {
        self.note_asked(name, shape);
        self.read_stored_into(name, shape, dtype, dst)?;
        match self.cast.as_ref().filter(|_| self.rounds(name)) {
            Some(cast) => round_in_place(cast, dtype, dst),
            None => Ok(()),
        }
    }

    /// [`Self::read_unmerged_into`] before the rounding.
    fn read_stored_into(
        &self,
        name: &str,
        shape: &Shape,
        dtype: DType,
        dst: &mut [u8],
    ) -> candle_core::Result<()> {
        if dst.len() != shape.elem_count() * dtype.size_in_bytes() {
            candle_core::bail!("{name}: {shape:?} of {dtype:?} in {} bytes", dst.len())
        }
        if let (Source::Mapped(files, _), Some(scale)) = (&self.source, self.fp8_scale(name)) {
            let w = self.load_stored(name)?.to_dtype(DType::F32)?;
            let scale = files.load(&scale)?.to_dtype(DType::F32)?;
            // A scale per row is cut as its weight is.
            let scale = match (scale.rank(), self.located(name)) {
                (0, _) | (_, None) => scale,
                (_, Some((_, _, part))) => part.cut(scale.flatten_all()?)?,
            };
            let scale = match scale.rank() {
                0 => scale.broadcast_as(w.shape())?,
                _ => scale.reshape((w.dim(0)?, 1))?.broadcast_as(w.shape())?,
            };
            self.report_read(name, &w);
            return write_bytes(&(w * scale)?.to_dtype(dtype)?, dst);
        }
        if let Some(bytes) = self.stored_bytes_as(name, dtype) {
            if bytes.len() != dst.len() {
                candle_core::bail!(
                    "{name}: {} stored bytes for {} wanted",
                    bytes.len(),
                    dst.len()
                )
            }
            dst.par_chunks_mut(COPY_CHUNK)
                .zip(bytes.par_chunks(COPY_CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s));
            self.report(bytes.len());
            return Ok(());
        }
        if let Some(view) = self.view(name) {
            if !view.swapped
                && view
                    .dtype
                    .is_some_and(|from| convert_into(view.data, from, dtype, dst))
            {
                self.report(view.data.len());
                return Ok(());
            }
        }
        let tensor = match &self.source {
            Source::Mapped(..) => self.load_stored(name)?,
            Source::Synthetic(s) => {
                if s.write(shape, name, dtype, dst) {
                    self.report(dst.len());
                    return Ok(());
                }
                Tensor::from_vec(s.make(shape, name), shape, &Device::Cpu)?
            }
        };
        self.report_read(name, &tensor);
        write_bytes(&tensor.to_dtype(dtype)?, dst)
    }

    /// Tensor `name` as `dtype` in host memory, read by threads in parallel (as [`Self::read_into`]
    /// reads) into memory the allocator hands out zeroed: candle's own loading copies with one
    /// thread (a streamed UMT5 keeps its 2.1 GB token table in host memory). `None` for a dtype
    /// it does not write.
    fn host_tensor(
        &self,
        name: &str,
        shape: &Shape,
        dtype: DType,
    ) -> candle_core::Result<Option<Tensor>> {
        fn read<T: candle_core::WithDType>(
            set: &WeightSet,
            name: &str,
            shape: &Shape,
            mut values: Vec<T>,
        ) -> candle_core::Result<Option<Tensor>> {
            // SAFETY: T is a plain numeric type (no padding, every bit pattern valid).
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(
                    values.as_mut_ptr().cast::<u8>(),
                    std::mem::size_of_val(values.as_slice()),
                )
            };
            set.read_into(name, shape, T::DTYPE, bytes)?;
            Tensor::from_vec(values, shape.clone(), &Device::Cpu).map(Some)
        }
        let n = shape.elem_count();
        match dtype {
            DType::BF16 => read(self, name, shape, zeroed::<u16, half::bf16>(n)),
            DType::F16 => read(self, name, shape, zeroed::<u16, half::f16>(n)),
            DType::F32 => read(self, name, shape, zeroed::<u32, f32>(n)),
            DType::F64 => read(self, name, shape, zeroed::<u64, f64>(n)),
            DType::U8 => read(self, name, shape, zeroed::<u8, u8>(n)),
            DType::U32 => read(self, name, shape, zeroed::<u32, u32>(n)),
            DType::I64 => read(self, name, shape, zeroed::<i64, i64>(n)),
            _ => Ok(None),
        }
    }
}

impl SimpleBackend for WeightSet {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if let Some(made) = self.transformed(name, &s, dtype, dev)? {
            return Ok(made);
        }
        let t = match &self.source {
            Source::Mapped(..) if dev.is_cpu() => {
                self.check(name, &s)?;
                if let Some(t) = self.host_tensor(name, &s, dtype)? {
                    return Ok(t);
                }
                // A dtype the parallel read does not write: candle's loading.
                return self.get_unchecked(name, dtype, dev);
            }
            Source::Mapped(files, keys) => match &***files {
                Files::Safetensors(st) if self.stored_whole(name) => {
                    SimpleBackend::get(st, s, &keys.locate(name).0, h, dtype, dev)?
                }
                // Read on the host: a GGUF decodes there, a part of a fused tensor is cut there.
                _ => return self.get(s, name, h, dtype, &Device::Cpu)?.to_device(dev),
            },
            Source::Synthetic(g) => g.get(s, name, h, dtype, dev)?,
        };
        self.report_read(name, &t);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = match &self.source {
            Source::Mapped(files, keys) => {
                let shape: Shape = self
                    .view(name)
                    .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.into() })?
                    .shape
                    .into();
                if let Some(made) = self.transformed(name, &shape, dtype, dev)? {
                    return Ok(made);
                }
                match &***files {
                    Files::Safetensors(st) if self.stored_whole(name) => {
                        SimpleBackend::get_unchecked(st, &keys.locate(name).0, dtype, dev)?
                    }
                    _ => {
                        let h = candle_nn::Init::Const(0.);
                        return self
                            .get(shape, name, h, dtype, &Device::Cpu)?
                            .to_device(dev);
                    }
                }
            }
            Source::Synthetic(g) => g.get_unchecked(name, dtype, dev)?,
        };
        self.report_read(name, &t);
        Ok(t)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        match &self.source {
            Source::Mapped(..) => self.view(name).is_some(),
            Source::Synthetic(_) => true,
        }
    }
}

/// The names beside a module's fp8 weight of its scale: ComfyUI's (0-dim) and LightX2V's (one
/// per output row).
const FP8_SCALES: [&str; 2] = ["scale_weight", "weight_scale"];

/// The dtypes [`write_bytes`] and the offload engine's device buffers handle.
pub const BYTE_DTYPES: [DType; 7] = [
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
    DType::U8,
    DType::U32,
    DType::I64,
];

/// Elements converted per task of [`convert_into`].
const CONVERT_CHUNK: usize = 1 << 18;

/// Bytes copied per task when a stored tensor is read as it is stored.
const COPY_CHUNK: usize = 1 << 20;

/// `n` zeros of `T`, allocated as zeros of `Z`, an integer type of `T`'s size and alignment: a
/// large zeroed allocation takes fresh pages from the kernel without writing them, so the
/// parallel read that follows is the first to touch them.
fn zeroed<Z: Clone + Default, T>(n: usize) -> Vec<T> {
    assert!(
        std::mem::size_of::<Z>() == std::mem::size_of::<T>()
            && std::mem::align_of::<Z>() == std::mem::align_of::<T>()
    );
    let mut zeros = std::mem::ManuallyDrop::new(vec![Z::default(); n]);
    // SAFETY: same size and alignment (asserted), and T is a plain numeric type whose all-zero
    // bits are a valid value (0); the allocation is handed over whole.
    unsafe {
        Vec::from_raw_parts(
            zeros.as_mut_ptr().cast::<T>(),
            zeros.len(),
            zeros.capacity(),
        )
    }
}

/// Writes the little-endian `from` values of `src` into `dst` as `to`, exactly as candle's CPU
/// conversion does (widening is exact; narrowing rounds to nearest even), threads in parallel
/// and without intermediate tensors; false, writing nothing, for other pairs of dtypes or
/// sizes that do not match.
fn convert_into(src: &[u8], from: DType, to: DType, dst: &mut [u8]) -> bool {
    fn run<const A: usize, const B: usize>(
        src: &[u8],
        dst: &mut [u8],
        f: impl Fn([u8; A]) -> [u8; B] + Sync,
    ) -> bool {
        if src.len() / A * B != dst.len() || !src.len().is_multiple_of(A) {
            return false;
        }
        dst.par_chunks_mut(CONVERT_CHUNK * B)
            .zip(src.par_chunks(CONVERT_CHUNK * A))
            .for_each(|(d, s)| {
                for (d, s) in d.chunks_exact_mut(B).zip(s.chunks_exact(A)) {
                    d.copy_from_slice(&f(s.try_into().expect("A bytes")));
                }
            });
        true
    }
    use half::{bf16, f16};
    match (from, to) {
        (DType::BF16, DType::F32) => {
            run(src, dst, |b| bf16::from_le_bytes(b).to_f32().to_le_bytes())
        }
        (DType::F16, DType::F32) => run(src, dst, |b| f16::from_le_bytes(b).to_f32().to_le_bytes()),
        (DType::F32, DType::BF16) => run(src, dst, |b| {
            bf16::from_f32(f32::from_le_bytes(b)).to_le_bytes()
        }),
        (DType::F32, DType::F16) => run(src, dst, |b| {
            f16::from_f32(f32::from_le_bytes(b)).to_le_bytes()
        }),
        _ => false,
    }
}

/// A float dtype whose values host code reads and writes as f32 (widening exactly, rounding to
/// nearest even as candle's casts do).
pub(crate) trait HostFloat: Copy + Send + Sync {
    fn get(self) -> f32;
    fn put(v: f32) -> Self;
}

impl HostFloat for f32 {
    fn get(self) -> f32 {
        self
    }
    fn put(v: f32) -> Self {
        v
    }
}

impl HostFloat for half::bf16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}

impl HostFloat for half::f16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

/// Host bytes as the `T` values they hold (an error where they are not aligned for `T`).
pub(crate) fn host_values_mut<T: HostFloat>(bytes: &mut [u8]) -> candle_core::Result<&mut [T]> {
    // SAFETY: T is a plain numeric type: every bit pattern is a valid value.
    match unsafe { bytes.align_to_mut::<T>() } {
        (&mut [], values, &mut []) => Ok(values),
        _ => candle_core::bail!("host values not aligned for their dtype"),
    }
}

/// Rounds every value of `dst` (values of `dtype`) through `cast`'s fp8 format, in parallel.
fn round_in_place(cast: &StorageCast, dtype: DType, dst: &mut [u8]) -> candle_core::Result<()> {
    fn each<T: HostFloat>(cast: &StorageCast, dst: &mut [u8]) -> candle_core::Result<()> {
        let values = host_values_mut::<T>(dst)?;
        values
            .par_iter_mut()
            .for_each(|v| *v = T::put(cast.dtype.round(v.get())));
        Ok(())
    }
    match dtype {
        DType::F32 => each::<f32>(cast, dst),
        DType::BF16 => each::<half::bf16>(cast, dst),
        DType::F16 => each::<half::f16>(cast, dst),
        other => candle_core::bail!("--storage-dtype rounds float weights, not {other:?}"),
    }
}

/// `encode` of every value of `values` (host bytes of `T`s) into `dst`, one byte each.
fn encode_each<T: HostFloat>(
    values: &mut [u8],
    dst: &mut [u8],
    encode: impl Fn(f32) -> u8 + Sync,
) -> candle_core::Result<()> {
    host_values_mut::<T>(values)?
        .par_iter()
        .zip(dst.par_iter_mut())
        .for_each(|(v, d)| *d = encode(v.get()));
    Ok(())
}

/// Copies a host tensor's elements, as laid out in memory, into `dst`.
pub fn write_bytes(tensor: &Tensor, dst: &mut [u8]) -> candle_core::Result<()> {
    fn copy<T: Copy>(values: &[T], dst: &mut [u8]) {
        // SAFETY: T is a plain numeric type (no padding, every bit pattern valid as bytes).
        let bytes = unsafe {
            std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
        };
        dst.copy_from_slice(bytes);
    }
    let flat = tensor.flatten_all()?;
    match flat.dtype() {
        DType::BF16 => copy(&flat.to_vec1::<half::bf16>()?, dst),
        DType::F16 => copy(&flat.to_vec1::<half::f16>()?, dst),
        DType::F32 => copy(&flat.to_vec1::<f32>()?, dst),
        DType::F64 => copy(&flat.to_vec1::<f64>()?, dst),
        DType::U8 => copy(&flat.to_vec1::<u8>()?, dst),
        DType::U32 => copy(&flat.to_vec1::<u32>()?, dst),
        DType::I64 => copy(&flat.to_vec1::<i64>()?, dst),
        other => candle_core::bail!("cannot offload {other:?} tensors"),
    }
    Ok(())
}

/// A `VarBuilder` over the weights, converting each tensor to `dtype` on `device` when a model asks.
pub fn var_builder(
    weights: &Weights,
    dtype: DType,
    device: &Device,
) -> Result<VarBuilder<'static>> {
    Ok(WeightSet::open(weights)?.var_builder(dtype, device))
}

fn describe(files: &[PathBuf]) -> String {
    files
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Seeded random weights: each tensor's values depend only on the model seed and the tensor's
/// name, so runs are repeatable and every device sees the same model.
#[derive(Clone)]
pub struct SyntheticWeights {
    pub seed: u64,
}

impl SyntheticWeights {
    /// Values scaled so activations stay O(1) through deep stacks: matrices U(±√(3/fan_in)),
    /// norm scales 1, biases and tables small.
    fn make(&self, shape: &Shape, name: &str) -> Vec<f32> {
        let mut values = vec![0f32; shape.elem_count()];
        self.fill(shape, name, &mut values, |v| v);
        values
    }

    /// Writes tensor `name`'s values as `dtype` straight into `dst` (its exact byte size),
    /// converting in parallel: the same bits as [`Self::make`] then a conversion. `false`
    /// where `dtype` or `dst`'s alignment is not one it writes (the caller converts).
    fn write(&self, shape: &Shape, name: &str, dtype: DType, dst: &mut [u8]) -> bool {
        fn typed<T>(dst: &mut [u8]) -> Option<&mut [T]> {
            // SAFETY: T is a plain numeric type: every bit pattern is a valid value.
            match unsafe { dst.align_to_mut::<T>() } {
                (&mut [], values, &mut []) => Some(values),
                _ => None,
            }
        }
        if dst.len() != shape.elem_count() * dtype.size_in_bytes() {
            return false;
        }
        match dtype {
            DType::F32 => typed::<f32>(dst).map(|v| self.fill(shape, name, v, |x| x)),
            DType::BF16 => {
                typed::<half::bf16>(dst).map(|v| self.fill(shape, name, v, half::bf16::from_f32))
            }
            DType::F16 => {
                typed::<half::f16>(dst).map(|v| self.fill(shape, name, v, half::f16::from_f32))
            }
            _ => None,
        }
        .is_some()
    }

    /// Fills `out` with tensor `name`'s values through `convert`, in parallel chunks: chunk i
    /// of the values comes from its own generator state, so any chunk computes alone.
    fn fill<T: Send>(
        &self,
        shape: &Shape,
        name: &str,
        out: &mut [T],
        convert: impl Fn(f32) -> T + Sync,
    ) {
        let dims = shape.dims();
        let leaf = name.rsplit('.').next().unwrap_or(name);
        let is_norm = name.contains("norm") && dims.len() == 1 || leaf == "gamma";
        if is_norm {
            out.par_iter_mut().for_each(|v| *v = convert(1.0));
            return;
        }
        let amplitude =
            if dims.len() >= 2 && !name.contains("embed_tokens") && !name.starts_with("shared") {
                let fan_in: usize = dims[1..].iter().product();
                (3.0 / fan_in.max(1) as f32).sqrt()
            } else {
                0.05
            };
        let tensor_seed = self.seed ^ fnv1a(name);
        const CHUNK: usize = 1 << 16;
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(i, chunk)| {
                let mut state = tensor_seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                for v in chunk {
                    let bits = splitmix64(&mut state);
                    let unit = (bits >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                    *v = convert((unit * 2.0 - 1.0) * amplitude);
                }
            });
    }
}

impl SimpleBackend for SyntheticWeights {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let values = self.make(&s, name);
        Tensor::from_vec(values, s, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("synthetic weights need a shape for {name}")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A stable 64-bit hash of a name (FNV-1a).
pub fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Converting straight from the memory map (the path `read_into` takes) gives the bits
    /// candle's conversion gives, both ways between f32 and bf16/f16: special values, ties,
    /// subnormals, and a tensor longer than a conversion task; also as host tensors, which are
    /// read in parallel too.
    #[test]
    fn mapped_tensors_convert_as_candle_converts() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("vidgen-convert-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("w.safetensors");
        let mut values: Vec<f32> = vec![
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1.0 + f32::EPSILON * 64.0, // a bf16 tie
            1e-40,                     // subnormal
            65520.0,                   // f16 overflow
            -3.3e38,
        ];
        values.extend((0..CONVERT_CHUNK + 1001).map(|i| (i as f32 * 0.37).sin() * 1e3));
        let n = values.len();
        let f32s = Tensor::from_vec(values, n, &Device::Cpu)?;
        let stored = [
            ("f32", f32s.clone()),
            ("bf16", f32s.to_dtype(DType::BF16)?),
            ("f16", f32s.to_dtype(DType::F16)?),
        ];
        candle_core::safetensors::save(&stored.iter().cloned().collect(), &path)?;
        let weights = WeightSet::open(&Weights::Files(vec![path]))?;
        for (name, tensor, to) in [
            ("f32", &stored[0].1, DType::BF16),
            ("f32", &stored[0].1, DType::F16),
            ("bf16", &stored[1].1, DType::F32),
            ("f16", &stored[2].1, DType::F32),
        ] {
            let mut want = vec![0u8; n * to.size_in_bytes()];
            write_bytes(&tensor.to_dtype(to)?, &mut want)?;
            let mut got = vec![0u8; want.len()];
            let src = weights.mapped_bytes(name, tensor.dtype()).expect("mapped");
            assert!(
                convert_into(src, tensor.dtype(), to, &mut got),
                "{name} -> {to:?} taken"
            );
            assert!(got == want, "{name} -> {to:?}");
            got.fill(0);
            weights.read_into(name, &Shape::from(n), to, &mut got)?;
            assert!(got == want, "{name} -> {to:?} through read_into");
            let host = weights.var_builder(to, &Device::Cpu).get(n, name)?;
            write_bytes(&host, &mut got)?;
            assert!(got == want, "{name} -> {to:?} as a host tensor");
        }
        // Host tensors in their stored dtype are the stored bits; a wrong shape is refused.
        for (name, tensor) in &stored {
            let host = weights
                .var_builder(tensor.dtype(), &Device::Cpu)
                .get(n, name)?;
            assert_eq!(host.dtype(), tensor.dtype());
            let (mut got, mut want) = (vec![0u8; n * 4], vec![0u8; n * 4]);
            let len = n * tensor.dtype().size_in_bytes();
            write_bytes(&host, &mut got[..len])?;
            write_bytes(tensor, &mut want[..len])?;
            assert!(got == want, "{name} as stored");
            let wrong = weights
                .var_builder(tensor.dtype(), &Device::Cpu)
                .get(n + 1, name);
            assert!(wrong.is_err(), "{name} with a wrong shape");
        }
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    /// Which weights are held packed: a GGUF file's block-quantized tensors (asked for in a
    /// float dtype) as its blocks, its float tensors not; a scaled fp8 weight as its bytes and
    /// its scales (one, or one per row); under `--storage-dtype` the rounded weights as fp8
    /// bytes (a scaled fp8 weight too, rounded from its scaled values), the others not.
    #[test]
    fn packed_forms_follow_what_is_stored_and_rounded() -> anyhow::Result<()> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/weights-a");
        let gguf = WeightSet::open(&Weights::Files(vec![dir.join("wan-q-tiny-a-Q8_0.gguf")]))?;
        let names = gguf.names();
        let blocks = |n: &&String| gguf.view(n).is_some_and(|v| v.blocks.is_some());
        let quantized = names.iter().find(blocks).expect("a Q8_0 tensor");
        let float = names.iter().find(|n| !blocks(n)).expect("a float tensor");
        let q8 = Some(Packed::Gguf(gguf::GgmlType::Q8_0));
        assert_eq!(gguf.packed(quantized, DType::BF16), q8);
        assert_eq!(gguf.packed(quantized, DType::F32), q8);
        assert_eq!(gguf.packed(quantized, DType::F64), None);
        assert_eq!(gguf.packed(float, DType::BF16), None);
        let file = dir.join("wan-tiny-a-comfyui-fp8-scaled.safetensors");
        let scaled = WeightSet::open(&Weights::Files(vec![file]))?;
        let (linear, norm) = ("blocks.0.attn1.to_q.weight", "blocks.0.attn1.norm_q.weight");
        assert!(scaled.fp8_scale(linear).is_some() && scaled.holds_scaled_fp8());
        let one_scale = Some(Packed::ScaledFp8 { scales: 1 });
        assert_eq!(scaled.packed(linear, DType::BF16), one_scale);
        assert_eq!(scaled.packed(linear, DType::F64), None);
        assert_eq!(scaled.packed(norm, DType::BF16), None);
        assert!(!gguf.holds_scaled_fp8());
        let file = dir.join("wan-tiny-a-fp8-e4m3fn-lightx2v.safetensors");
        let per_row = WeightSet::open(&Weights::Files(vec![file]))?;
        let rows = per_row.stored_shape(linear).expect("stored")[0];
        let row_scales = Some(Packed::ScaledFp8 { scales: rows });
        assert_eq!(per_row.packed(linear, DType::BF16), row_scales);
        let format = StorageDtype::Float8E5m2;
        let cast = StorageCast {
            dtype: format,
            skip: crate::models::wan::transformer::LAYERWISE_CASTING_SKIP,
        };
        let cast = scaled.with_storage_cast(cast);
        assert_eq!(cast.packed(linear, DType::BF16), Some(Packed::Fp8(format)));
        assert!(cast.view(norm).is_some());
        assert_eq!(cast.packed(norm, DType::BF16), None);
        Ok(())
    }

    /// A scaled fp8 weight is held as its scales in f32 and its fp8 bytes (about half of its
    /// bf16 bytes: one byte a value) and expands, on the host, to the bits it is read as
    /// (`W8 as f32 · scale`, then the run dtype): ComfyUI's one scale and LightX2V's per row.
    #[test]
    fn staged_bytes_are_in_the_staged_dtype_for_every_original_layout() -> anyhow::Result<()> {
        // What a resident load copies of each weight (borrowed row cuts, swapped halves made on
        // the host, converted values) is the staged dtype's size, in bf16 and f32 runs alike,
        // and lands as the values read (a swapped bf16 tensor of an f32 run was once made in
        // f32 while its copy was sized for bf16).
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let mut swapped = 0;
        for file in std::fs::read_dir(fixtures.join("original-layouts"))? {
            let path = file?.path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            let Some(folder) = ["flux-tiny-a", "hunyuanvideo-tiny-a", "mochi-tiny-a"]
                .into_iter()
                .find(|f| name.starts_with(f))
            else {
                continue;
            };
            if !(name.ends_with(".gguf") || name.ends_with(".safetensors")) {
                continue;
            }
            let weights = WeightSet::open(&Weights::Files(vec![path.clone()]))?;
            let reference = fixtures
                .join(folder)
                .join("transformer/diffusion_pytorch_model.safetensors");
            for weight in WeightSet::open(&Weights::Files(vec![reference]))?.names() {
                let shape = Shape::from(weights.stored_shape(&weight).expect("stored"));
                if matches!(weights.located(&weight), Some((_, _, Part::SwappedHalves))) {
                    swapped += 1;
                }
                for dtype in [DType::BF16, DType::F32] {
                    let staged = weights.staged_dtype(&weight, dtype);
                    let bytes = weights.staged_bytes(&weight, &shape, dtype)?;
                    let what = format!("{name}: {weight} in a {dtype:?} run");
                    assert_eq!(
                        bytes.len(),
                        shape.elem_count() * staged.size_in_bytes(),
                        "{what}"
                    );
                    let landed =
                        Tensor::from_raw_buffer(&bytes, staged, shape.dims(), &Device::Cpu)?
                            .to_dtype(dtype)?;
                    let want = weights
                        .var_builder(dtype, &Device::Cpu)
                        .get(&shape, &weight)?;
                    let diff = (landed.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?
                        .abs()?
                        .flatten_all()?
                        .max(0)?
                        .to_scalar::<f32>()?;
                    assert_eq!(diff, 0.0, "{what}");
                }
            }
        }
        assert!(swapped > 0, "no swapped tensor checked");
        Ok(())
    }

    #[test]
    fn original_layout_gguf_weights_are_held_quantized_and_expand_as_read() -> anyhow::Result<()> {
        // Every weight of the original-layout GGUF fixtures held in a block quantization (a
        // fused matrix's rows cut, a swapped one's halves moved) expands to the values read.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/original-layouts");
        let (mut cut, mut swapped) = (0, 0);
        for file in std::fs::read_dir(&dir)? {
            let path = file?.path();
            if path.extension().is_none_or(|e| e != "gguf") {
                continue;
            }
            let weights = WeightSet::open(&Weights::Files(vec![path.clone()]))?;
            let folder = path
                .file_name()
                .unwrap()
                .to_string_lossy()
                .replace("-Q8_0.gguf", "");
            let reference = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures")
                .join(&folder)
                .join("transformer/diffusion_pytorch_model.safetensors");
            let names = WeightSet::open(&Weights::Files(vec![reference]))?.names();
            for name in &names {
                let Some(form) = weights.packed(name, DType::F32) else {
                    continue;
                };
                let (_, _, part) = weights.located(name).expect("stored");
                match part {
                    Part::Rows(_) => cut += 1,
                    Part::SwappedHalves => swapped += 1,
                    Part::Whole => {}
                }
                let shape = Shape::from(weights.stored_shape(name).expect("stored"));
                let bytes = weights.packed_bytes(name, &shape, DType::F32, form)?;
                let got = form.expand(&Tensor::new(&*bytes, &Device::Cpu)?, &shape, DType::F32)?;
                let want = weights
                    .var_builder(DType::F32, &Device::Cpu)
                    .get(&shape, name)?;
                let diff = (got - want)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?;
                assert_eq!(diff, 0.0, "{folder}: {name}");
            }
        }
        // FLUX.1's, HunyuanVideo's and Mochi-1's fused q, k, v; Mochi-1's swapped SwiGLU inputs.
        assert!(cut >= 20 && swapped >= 2, "{cut} cut, {swapped} swapped");
        Ok(())
    }

    #[test]
    fn scaled_fp8_weights_are_held_as_stored_and_expand_as_read() -> anyhow::Result<()> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/weights-a");
        for file in [
            "wan-tiny-a-comfyui-fp8-scaled.safetensors",
            "wan-tiny-a-fp8-e4m3fn-lightx2v.safetensors",
        ] {
            let weights = WeightSet::open(&Weights::Files(vec![dir.join(file)]))?;
            let (mut held, mut bf16, mut packed) = (0, 0, 0);
            for stored in weights.names() {
                let name = stored.trim_start_matches(KeyLayout::COMFYUI);
                let Some(form) = weights.packed(name, DType::BF16) else {
                    continue;
                };
                let Packed::ScaledFp8 { scales } = form else {
                    panic!("{name} held as {form:?}")
                };
                let shape = Shape::from(weights.stored_shape(name).expect("stored"));
                let bytes = weights.packed_bytes(name, &shape, DType::BF16, form)?;
                assert_eq!(bytes.len(), 4 * scales + shape.elem_count(), "{name}");
                let raw = Tensor::new(&*bytes, &Device::Cpu)?;
                for dtype in [DType::BF16, DType::F16, DType::F32] {
                    let want = weights.var_builder(dtype, &Device::Cpu).get(&shape, name)?;
                    let got = form.expand(&raw, &shape, dtype)?;
                    let bits = |t: &Tensor| -> anyhow::Result<Vec<u8>> {
                        let mut out = vec![0u8; t.elem_count() * dtype.size_in_bytes()];
                        write_bytes(t, &mut out)?;
                        Ok(out)
                    };
                    assert!(bits(&got)? == bits(&want)?, "{name} {dtype:?}");
                }
                held += bytes.len();
                bf16 += 2 * shape.elem_count();
                packed += 1;
            }
            assert!(packed >= 20, "{file}: {packed} packed");
            // Per-row scales add 4 bytes a row (7% on this fixture's short rows).
            let ratio = held as f64 / bf16 as f64;
            assert!((0.5..0.6).contains(&ratio), "{file}: {ratio}");
        }
        Ok(())
    }

    /// `--storage-dtype` rounds a weight as diffusers stores it: loaded in the run dtype, then
    /// cast to fp8. An f32 value just above an fp8 tie rounds up in an f32 run, but to the tie
    /// in bf16 first and then to even in a bf16 run; the fp8 bytes held for each are those.
    #[test]
    fn storage_rounding_goes_through_the_run_dtype() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("vidgen-fp8-run-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("w.safetensors");
        let name = "blocks.0.attn1.to_q.weight";
        let above_tie = 1.0625 + 2f32.powi(-20);
        let w = Tensor::new(&[[above_tie, -above_tie]], &Device::Cpu)?;
        candle_core::safetensors::save(&[(name, w)].into_iter().collect(), &path)?;
        let format = StorageDtype::Float8E4m3fn;
        let cast = StorageCast {
            dtype: format,
            skip: crate::models::wan::transformer::LAYERWISE_CASTING_SKIP,
        };
        let weights = WeightSet::open(&Weights::Files(vec![path]))?.with_storage_cast(cast);
        let shape = Shape::from((1, 2));
        for (dtype, want) in [(DType::F32, 1.125f32), (DType::BF16, 1.0)] {
            let got = weights.var_builder(dtype, &Device::Cpu).get((1, 2), name)?;
            let got: Vec<f32> = got.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
            assert_eq!(got, [want, -want], "{dtype:?}");
            let packed = weights.packed_bytes(name, &shape, dtype, Packed::Fp8(format))?;
            assert_eq!(
                *packed,
                [format.encode(want), format.encode(-want)],
                "{dtype:?}"
            );
        }
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    /// `--storage-dtype` on synthetic weights rounds what it rounds on stored ones: a Linear's
    /// weight and bias (told by the rank its weight was asked for with), not a norm's, and the
    /// engine holds those as fp8 bytes.
    #[test]
    fn synthetic_weights_round_the_modules_diffusers_casts() -> anyhow::Result<()> {
        let format = StorageDtype::Float8E4m3fn;
        let cast = StorageCast {
            dtype: format,
            skip: crate::models::wan::transformer::LAYERWISE_CASTING_SKIP,
        };
        let weights = WeightSet::open(&Weights::Synthetic { seed: 5 })?.with_storage_cast(cast);
        let plain = WeightSet::open(&Weights::Synthetic { seed: 5 })?;
        let ask = |w: &WeightSet, name: &str, dims: &[usize]| -> anyhow::Result<Vec<f32>> {
            let t = w.var_builder(DType::F32, &Device::Cpu).get(dims, name)?;
            Ok(t.flatten_all()?.to_vec1()?)
        };
        for (name, dims, rounded) in [
            ("blocks.0.proj.weight", &[64, 48][..], true),
            ("blocks.0.proj.bias", &[64][..], true),
            ("blocks.0.norm.weight", &[48][..], false),
            ("blocks.0.norm.bias", &[48][..], false),
        ] {
            let (got, raw) = (ask(&weights, name, dims)?, ask(&plain, name, dims)?);
            let want: Vec<f32> = raw.iter().map(|&v| format.round(v)).collect();
            assert_eq!(got, if rounded { want } else { raw.clone() }, "{name}");
            assert_eq!(
                weights.packed(name, DType::BF16),
                rounded.then_some(Packed::Fp8(format)),
                "{name}"
            );
            if rounded {
                assert_ne!(got, raw, "{name}: the synthetic values were fp8 already");
            }
        }
        Ok(())
    }

    /// Synthetic values written straight in a dtype are the bits of the f32 values converted
    /// as candle converts them (a matrix, and a norm scale), and the same through
    /// `read_into`, which the loaders call.
    #[test]
    fn synthetic_values_written_in_a_dtype_equal_the_converted_ones() -> candle_core::Result<()> {
        let weights = WeightSet::open(&Weights::Synthetic { seed: 7 }).expect("synthetic");
        let synthetic = SyntheticWeights { seed: 7 };
        for (name, dims) in [
            ("blocks.0.proj.weight", vec![300, 700]),
            ("norm.weight", vec![70]),
        ] {
            let shape = Shape::from_dims(&dims);
            let made = Tensor::from_vec(synthetic.make(&shape, name), &shape, &Device::Cpu)?;
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let n = shape.elem_count() * dtype.size_in_bytes();
                let mut want = vec![0u8; n];
                write_bytes(&made.to_dtype(dtype)?, &mut want)?;
                // An f32-aligned buffer, as the host arenas and staging buffers are.
                let mut words = vec![0u32; n.div_ceil(4)];
                // SAFETY: u32 words viewed as their bytes.
                let got =
                    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), n) };
                assert!(
                    synthetic.write(&shape, name, dtype, got),
                    "{name} {dtype:?}"
                );
                assert!(got == want.as_slice(), "{name} {dtype:?}");
                got.fill(0);
                weights.read_into(name, &shape, dtype, got)?;
                assert!(got == want.as_slice(), "{name} {dtype:?} through read_into");
            }
        }
        Ok(())
    }
}
