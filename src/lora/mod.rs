//! LoRA files for a transformer (and FLUX.1's CLIP text encoder): read in the key formats people
//! share (diffusers/PEFT, ComfyUI or the original Wan-AI layout, kohya/musubi), as deltas on the
//! component's diffusers weight names. [`crate::weights::WeightSet`] merges them into each weight as it is read (`W + Σ
//! scale · up @ down` in f32, then the run dtype), so a streamed block is merged when its host
//! copy is made and a LoRA costs no step time.

use crate::weights::original::{Model, Piece};
use anyhow::{bail, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod merge;
use merge::{Delta, Merge};

/// One `--lora FILE[:SCALE]` (in a config file, the same text).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct LoraSpec {
    pub path: PathBuf,
    pub scale: f64,
}

impl TryFrom<String> for LoraSpec {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        parse_spec(&text)
    }
}

impl From<LoraSpec> for String {
    fn from(spec: LoraSpec) -> String {
        format!("{}:{}", spec.path.display(), spec.scale)
    }
}

/// Parses `FILE[:SCALE]` (scale 1 when absent); a `:` followed by something that is not a
/// finite number belongs to the path.
pub fn parse_spec(text: &str) -> Result<LoraSpec, String> {
    if let Some((path, scale)) = text.rsplit_once(':') {
        if let Ok(scale) = scale.parse::<f64>() {
            if !scale.is_finite() {
                return Err(format!(
                    "the scale of {text} is {scale}: give a finite number"
                ));
            }
            if path.is_empty() {
                return Err(format!("{text} names no file: give FILE[:SCALE]"));
            }
            return Ok(LoraSpec {
                path: path.into(),
                scale,
            });
        }
    }
    if text.is_empty() {
        return Err("an empty --lora: give FILE[:SCALE]".into());
    }
    Ok(LoraSpec {
        path: text.into(),
        scale: 1.0,
    })
}

/// The key layout of a LoRA file, told by its keys as diffusers tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `transformer.blocks.N.attn1.to_q.lora_A.weight` (PEFT; alpha folded or in the metadata).
    Diffusers,
    /// `diffusion_model.blocks.N.self_attn.q.lora_down.weight`, `.lora_up.weight`, `.alpha`,
    /// `.diff`, `.diff_b` (ComfyUI and the original Wan-AI names); with `peft_halves`, the halves
    /// named `.lora_A.weight` / `.lora_B.weight` instead (diffusion-pipe's and other trainers'
    /// Wan LoRAs, which diffusers' Wan conversion reads alike, told by any `lora_A` key).
    ComfyUi { peft_halves: bool },
    /// `lora_unet_blocks_N_self_attn_q.lora_down.weight`, `.alpha` (kohya/musubi).
    Musubi,
    /// `diffusion_model.double_blocks.N.img_attn_qkv.lora_A.weight`: a model's original module
    /// names (under `diffusion_model.`, `transformer.` or bare) with PEFT's halves
    /// (HunyuanVideo's, told by `img_attn_qkv` as diffusers tells it; LTX-Video's, diffusers'
    /// names under `diffusion_model.`).
    OriginalPeft,
    /// `double_blocks.N.processor.qkv_lora1.down.weight`, `.up.weight` (XLabs' FLUX.1 LoRAs, told
    /// by `processor` as diffusers tells them; no alpha).
    XLabs,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Diffusers => "diffusers/PEFT",
            Layout::ComfyUi { peft_halves: false } => "ComfyUI/original",
            Layout::ComfyUi { peft_halves: true } => "ComfyUI/original with PEFT halves",
            Layout::Musubi => "kohya/musubi",
            Layout::OriginalPeft => "original/PEFT",
            Layout::XLabs => "XLabs",
        }
    }
}

/// The component of a pipeline whose weights a scan of LoRA files changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// A transformer, whose weights may also go by an original (non-diffusers) layout that LoRA
    /// files use too.
    Transformer(Option<Model>),
    /// FLUX.1's CLIP text encoder, whose modules diffusers' FLUX.1 loader reads from the same
    /// files as the transformer's (kohya's `lora_te1_`, ComfyUI's
    /// `text_encoders.clip_l.transformer.`, PEFT's `text_encoder.`).
    ClipText,
}

/// Every LoRA of one component as its files' headers tell it, in the order given: which
/// weight each file changes, how and with what shape; no values read, so a run checks its LoRAs
/// before any work and reads them once ([`Self::read`]).
pub struct Scanned {
    changes: BTreeMap<String, Vec<Change>>,
    /// Each file's map and layout (for messages).
    files: Vec<(MmapedSafetensors, PathBuf, Layout)>,
    /// One line for each file's modules that diffusers leaves out, and so vidgen too
    /// ([`Self::notices`]).
    notices: Vec<String>,
}

/// One file's change of one weight.
struct Change {
    file: usize,
    /// The shape of the weight it changes.
    dims: Vec<usize>,
    kind: ChangeKind,
}

enum ChangeKind {
    /// `scale · up @ down` from keys `up` (rows x rank; `up_rows` of them where the module is
    /// fused in the LoRA's layout) and `down` (rank x cols).
    LowRank {
        up: String,
        up_rows: Option<std::ops::Range<usize>>,
        /// Both factors' first-dimension halves swapped (diffusers' quirk for a swapped
        /// module: the up rows, and the down half's rank rows too).
        swapped: bool,
        down: String,
        rank: usize,
        scale: f32,
    },
    /// `scale · diff`, key `diff` of the weight's shape.
    Full { diff: String, scale: f32 },
}

/// Every LoRA of one transformer, in the order given: the deltas of each weight name.
#[derive(Clone, Debug, Default)]
pub struct Loras {
    deltas: BTreeMap<String, Vec<Delta>>,
}

impl Loras {
    /// Whether no LoRA was given.
    pub fn is_empty(&self) -> bool {
        self.deltas.is_empty()
    }

    /// Whether weight `name` has a delta.
    pub fn changes(&self, name: &str) -> bool {
        self.deltas.contains_key(name)
    }

    /// `base`, weight `name` on any device (contiguous, in a float dtype), with its deltas
    /// merged there ([`merge`]).
    pub fn merged(&self, name: &str, base: &Tensor) -> candle_core::Result<Tensor> {
        base.contiguous()?.apply_op1_no_bwd(&Merge {
            deltas: self.deltas(name),
        })
    }

    /// Merges weight `name`'s deltas into `values`, its values of `dims` stored as `dtype`, in
    /// place on the host ([`merge`]: the bits [`Self::merged`] gives on any device).
    pub fn merge_into(
        &self,
        name: &str,
        dims: &[usize],
        dtype: DType,
        values: &mut [u8],
    ) -> candle_core::Result<()> {
        merge::merge_into(self.deltas(name), dims, dtype, values)
    }

    /// Launches the merge of weight `name`'s deltas into its values at device address `weight`
    /// (`dims` values of `dtype`), in place, on `stream` ([`merge`]: the host merge's bits);
    /// asynchronous, ordered on `stream`.
    #[cfg(feature = "cuda")]
    pub fn merge_in_place(
        &self,
        name: &str,
        dev: &candle_core::CudaDevice,
        stream: &std::sync::Arc<candle_core::cuda::cudarc::driver::CudaStream>,
        weight: u64,
        dims: &[usize],
        dtype: DType,
    ) -> candle_core::Result<()> {
        merge::launch(dev, stream, weight, weight, dims, dtype, self.deltas(name))
    }

    fn deltas(&self, name: &str) -> &[Delta] {
        self.deltas.get(name).map(Vec::as_slice).unwrap_or_default()
    }
}

impl Scanned {
    /// Reads the headers of every file of `specs` (and alphas, a value each), in order, for the
    /// component `target`: a transformer's keys in any layout for the Wan family, diffusers/PEFT,
    /// kohya, ComfyUI or XLabs for FLUX.1, its original names with PEFT halves for HunyuanVideo
    /// and LTX-Video, diffusers/PEFT for any other model; FLUX.1's CLIP keys in kohya's,
    /// ComfyUI's or PEFT's layout. A file holding no key of `target` but keys of another
    /// component the pipeline reads changes nothing here.
    pub fn scan(specs: &[LoraSpec], target: Target) -> Result<Self> {
        let mut scanned = Scanned {
            changes: BTreeMap::new(),
            files: Vec::new(),
            notices: Vec::new(),
        };
        for spec in specs {
            scanned.add(spec, target)?;
        }
        Ok(scanned)
    }

    /// One line per file naming the modules it holds that diffusers leaves out, and so vidgen
    /// too: those outside FLUX.1's blocks in a kohya file, T5's in a ComfyUI one.
    pub fn notices(&self) -> &[String] {
        &self.notices
    }

    /// The same changes named as the component's weights are: a text encoder's weights saved
    /// without the `text_model.` root (transformers 5 flattens CLIP) take the LoRA's names
    /// without it, as diffusers drops it then; `holds` tells whether the component has a weight.
    pub fn rooted(mut self, holds: impl Fn(&str) -> bool) -> Self {
        self.changes = std::mem::take(&mut self.changes)
            .into_iter()
            .map(|(name, changes)| match name.strip_prefix("text_model.") {
                Some(bare) if !holds(&name) && holds(bare) => (bare.to_string(), changes),
                _ => (name, changes),
            })
            .collect();
        self
    }

    fn add(&mut self, spec: &LoraSpec, target: Target) -> Result<()> {
        let path = &spec.path;
        let local = crate::models::source::flag_file(path)
            .with_context(|| format!("--lora {}", path.display()))?;
        // SAFETY: mapped read-only; vidgen never writes to the files it reads.
        let st = unsafe { MmapedSafetensors::new(&local) }
            .with_context(|| format!("--lora {}: not a safetensors file", path.display()))?;
        // Each tensor's shape and dtype (`None`: one candle does not read).
        let shapes: BTreeMap<String, (Vec<usize>, Option<DType>)> = st
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let dtype = DType::try_from(view.dtype()).ok();
                (name, (view.shape().to_vec(), dtype))
            })
            .collect();
        let original = match target {
            Target::Transformer(original) => original,
            Target::ClipText => None,
        };
        // The transformer's keys' layout, told as diffusers' loaders tell it: HunyuanVideo's by
        // `img_attn_qkv`, LTX-Video's by the prefix.
        // Each key's text-encoder reading, told once ([`TextKey::of`]); the others are the
        // transformer's.
        let mut text_keys: BTreeMap<&str, TextKey> = shapes
            .keys()
            .filter_map(|k| Some((k.as_str(), TextKey::of(k)?)))
            .collect();
        let dit_keys = || {
            let text_keys = &text_keys;
            shapes
                .keys()
                .filter(move |k| !text_keys.contains_key(k.as_str()))
        };
        let original_peft = match original {
            Some(Model::HunyuanVideo) => dit_keys().any(|k| k.contains("img_attn_qkv")),
            Some(Model::LtxVideo) => dit_keys().any(|k| k.starts_with("diffusion_model.")),
            _ => false,
        };
        // BFL's Control LoRAs (told by `query_norm.scale`, as diffusers tells them) widen
        // `img_in` to take a control image's latents beside the noise: FluxControlPipeline's,
        // which FluxPipeline cannot run either.
        if original == Some(Model::Flux) {
            if let Some(key) = dit_keys().find(|k| k.contains("query_norm.scale")) {
                bail!(
                    "--lora {}: a FLUX.1 Control LoRA (BFL's layout, key {key}), which widens img_in for a control image's latents (FluxControlPipeline); vidgen runs FluxPipeline: give a LoRA for FLUX.1 itself",
                    path.display()
                );
            }
        }
        let xlabs = original == Some(Model::Flux) && dit_keys().any(|k| k.contains("processor"));
        let layout = if xlabs {
            Layout::XLabs
        } else if original_peft {
            Layout::OriginalPeft
        } else if dit_keys().any(|k| k.starts_with("diffusion_model.")) {
            Layout::ComfyUi {
                peft_halves: dit_keys().any(|k| k.contains("lora_A")),
            }
        } else if dit_keys().any(|k| k.starts_with("lora_unet_")) {
            Layout::Musubi
        } else {
            Layout::Diffusers
        };
        let bad = |layout: Layout, key: &str, why: &str| {
            anyhow::anyhow!(
                "--lora {}: {why} ({} layout, key {key})",
                path.display(),
                layout.name()
            )
        };
        let maps = matches!(
            (layout, original),
            (Layout::Diffusers | Layout::OriginalPeft | Layout::XLabs, _)
                | (
                    Layout::ComfyUi { peft_halves: false } | Layout::Musubi,
                    Some(Model::Wan | Model::Flux)
                )
                | (Layout::ComfyUi { peft_halves: true }, Some(Model::Wan))
        );
        if !maps && target != Target::ClipText {
            let models = match layout {
                Layout::ComfyUi { peft_halves: true } => "the Wan family",
                _ => "the Wan family and FLUX.1 (and ComfyUI's for HunyuanVideo and LTX-Video)",
            };
            bail!(
                "--lora {}: a {} layout LoRA, which vidgen maps for {models} only, as diffusers' loaders do; give this model a diffusers/PEFT LoRA (transformer.<module>.lora_A.weight)",
                path.display(),
                layout.name()
            );
        }
        let mut left_out = Vec::new();
        let mut t5 = Vec::new();
        // Keys of another component the pipeline reads from the same file.
        let mut others = 0;
        let peft_alpha = peft_alphas(
            &local,
            match target {
                Target::Transformer(_) => "transformer",
                Target::ClipText => "text_encoder",
            },
        )?;
        let file = self.files.len();
        let mut changes_any = false;
        for (key, (dims, dtype)) in &shapes {
            let text = text_keys.remove(key.as_str());
            let (layout, module, part) = match (target, text) {
                (Target::ClipText, None) => {
                    others += 1;
                    continue;
                }
                (_, Some(TextKey::T5 { module, part })) => {
                    if original == Some(Model::Flux) && part == Part::Down {
                        t5.push(module.to_string());
                    }
                    continue;
                }
                (Target::Transformer(Some(Model::Flux)), Some(_)) => {
                    others += 1;
                    continue;
                }
                (Target::Transformer(_), Some(TextKey::Clip { layout, .. })) => {
                    return Err(bad(
                        layout,
                        key,
                        "a text encoder's module, which diffusers' LoRA loader for this model does not read (vidgen reads text-encoder LoRAs for FLUX.1's CLIP, as diffusers does)",
                    ))
                }
                (Target::ClipText, Some(TextKey::Clip { layout, module, part })) => {
                    let module = module.ok_or_else(|| {
                        bad(layout, key, "it names no Linear of CLIP's encoder layers")
                    })?;
                    (layout, module, part)
                }
                (Target::Transformer(_), None) => {
                    let (module, part) = split_key(key, layout).ok_or_else(|| {
                        bad(
                            layout,
                            key,
                            "a key of no LoRA layout vidgen reads; give a diffusers/PEFT LoRA (transformer.<module>.lora_A.weight)",
                        )
                    })?;
                    (layout, module.to_string(), part)
                }
            };
            let bad = |key: &str, why: &str| bad(layout, key, why);
            if part == Part::Alpha {
                continue; // read with its module's down half
            }
            // Factors are floats (alphas may be any number: LightX2V's are i64).
            match *dtype {
                Some(dtype) if dtype.is_float() => {}
                dtype => {
                    let stored =
                        dtype.map_or("a type vidgen cannot read".into(), |d| format!("{d:?}"));
                    return Err(bad(
                        key,
                        &format!("a LoRA factor stored as {stored}, not as floats"),
                    ));
                }
            }
            if part == Part::Up {
                continue; // read with its module's down half
            }
            let module = module.as_str();
            let whole = |m: Option<String>| m.map(|m| vec![(m, Piece::Whole)]);
            let targets = match (target, layout, original) {
                (Target::ClipText, _, _) if part == Part::Down => whole(Some(module.to_string())),
                (Target::ClipText, _, _) => {
                    return Err(bad(
                        key,
                        "a full delta of a text encoder's module, which diffusers drops; give its low-rank halves",
                    ))
                }
                (_, Layout::Diffusers, _) => whole(Some(module.to_string())),
                (_, Layout::Musubi, Some(Model::Flux)) => Model::Flux.kohya_targets(module),
                // diffusers renames ComfyUI's FLUX.1 modules to kohya's.
                (_, Layout::ComfyUi { .. }, Some(Model::Flux)) if matches!(part, Part::Down) => {
                    Model::Flux.kohya_targets(&module.replace('.', "_"))
                }
                (_, Layout::ComfyUi { .. }, Some(Model::Flux)) => {
                    return Err(bad(
                        key,
                        "a full delta of a FLUX.1 LoRA, which diffusers' conversion drops; give its low-rank halves",
                    ))
                }
                (_, Layout::OriginalPeft, Some(model)) => model.original_targets(module),
                (_, Layout::OriginalPeft, None) => None,
                (_, Layout::XLabs, _) => xlabs_targets(module),
                (_, Layout::ComfyUi { .. }, _) => whole(original_to_diffusers(module)),
                (_, Layout::Musubi, _) => {
                    whole(musubi_to_original(module).and_then(|m| original_to_diffusers(&m)))
                }
            }
            .ok_or_else(|| {
                bad(
                    key,
                    "it names no layer of this transformer (a LoRA for another model? diffusers/PEFT names them transformer.<module>.lora_A.weight)",
                )
            })?;
            if targets.is_empty() {
                left_out.push(module.to_string());
            }
            for (target, piece) in targets {
                let (weight, change) = match part {
                    Part::Down => {
                        let up_key = key_of(key, layout, Part::Up);
                        let (up_dims, _) = shapes.get(&up_key).ok_or_else(|| {
                            bad(key, &format!("its other half {up_key} is missing"))
                        })?;
                        let &[rank, cols] = &dims[..] else {
                            return Err(bad(key, "not a matrix"));
                        };
                        let &[stored_rows, up_rank] = &up_dims[..] else {
                            return Err(bad(&up_key, "not a matrix"));
                        };
                        // A fused module's up rows split as diffusers splits them: thirds, or a
                        // single block's (D, D, D, 4D) (its hard-coded widths, scaled); a swapped
                        // module's halves swap in both factors, as diffusers swaps them.
                        let swapped = piece == Piece::SwappedHalves;
                        let up_rows = match piece {
                            Piece::Whole | Piece::SwappedHalves => None,
                            piece => Some(
                                crate::weights::original::rows(
                                    piece,
                                    stored_rows,
                                    Some(stored_rows / 7),
                                )
                                .ok_or_else(|| {
                                    bad(&up_key, "its rows do not split into the fused layers")
                                })?,
                            ),
                        };
                        let rows = up_rows.as_ref().map_or(stored_rows, |r| r.len());
                        if up_rank != rank {
                            return Err(bad(
                                key,
                                &format!("rank {rank} against its up half's {up_rank}"),
                            ));
                        }
                        let alpha = match layout {
                            Layout::Diffusers => peft_alpha(module),
                            Layout::OriginalPeft => peft_alpha(&target),
                            _ => {
                                let alpha_key = key_of(key, layout, Part::Alpha);
                                match shapes.contains_key(&alpha_key) {
                                    // Any stored dtype: LightX2V's LoRAs store an i64 alpha.
                                    true => Some(
                                        *read_f32(&st, &alpha_key)?
                                            .first()
                                            .ok_or_else(|| bad(&alpha_key, "an empty alpha"))?
                                            as f64,
                                    ),
                                    false => None,
                                }
                            }
                        };
                        let scale = spec.scale * alpha.map_or(1.0, |a| a / rank as f64);
                        let kind = ChangeKind::LowRank {
                            up: up_key,
                            up_rows,
                            swapped,
                            down: key.clone(),
                            rank,
                            scale: scale as f32,
                        };
                        let dims = vec![rows, cols];
                        (format!("{target}.weight"), Change { file, dims, kind })
                    }
                    Part::Diff | Part::DiffBias => {
                        let suffix = if part == Part::Diff { "weight" } else { "bias" };
                        let kind = ChangeKind::Full {
                            diff: key.clone(),
                            scale: spec.scale as f32,
                        };
                        let dims = dims.clone();
                        (format!("{target}.{suffix}"), Change { file, dims, kind })
                    }
                    Part::Up | Part::Alpha => unreachable!("skipped above"),
                };
                changes_any = true;
                self.changes.entry(weight).or_default().push(change);
            }
        }
        let mut notice = |modules: Vec<String>, what: &str, why: &str| {
            if !modules.is_empty() {
                self.notices.push(format!(
                    "--lora {}: {} {what} ({}) left out, as {why}",
                    path.display(),
                    modules.len(),
                    modules.join(", ")
                ));
            }
        };
        notice(
            left_out,
            "modules outside the transformer's blocks",
            "diffusers' kohya FLUX.1 conversion leaves them out",
        );
        notice(
            t5,
            "T5 text-encoder modules",
            "diffusers' FLUX.1 loader drops them",
        );
        if !changes_any && others == 0 {
            bail!(
                "--lora {}: no LoRA weights in it ({} layout)",
                path.display(),
                layout.name()
            );
        }
        self.files.push((st, path.clone(), layout));
        Ok(())
    }

    /// Checks every changed weight against the component's weights: it exists (`shape_of`
    /// gives its shape) and the delta has that shape; a file for another model fails here,
    /// before anything loads.
    pub fn check(&self, shape_of: impl Fn(&str) -> Option<Vec<usize>>) -> Result<()> {
        for (name, changes) in &self.changes {
            for change in changes {
                let file = || {
                    let (_, path, layout) = &self.files[change.file];
                    format!("{} ({} layout)", path.display(), layout.name())
                };
                let Some(shape) = shape_of(name) else {
                    bail!(
                        "--lora {}: {name} is not a weight of this model: a LoRA for another model?",
                        file()
                    );
                };
                let got = &change.dims;
                if got.iter().product::<usize>() != shape.iter().product::<usize>()
                    || got[0] != shape[0]
                {
                    bail!(
                        "--lora {}: its change of {name} is {got:?}, the weight is {shape:?}: a LoRA for another model size?",
                        file()
                    );
                }
            }
        }
        Ok(())
    }

    /// Reads every change's values (as f32: exact for every float dtype), all in parallel.
    pub fn read(self) -> Result<Loras> {
        let changes: Vec<(&String, &Change)> = self
            .changes
            .iter()
            .flat_map(|(name, changes)| changes.iter().map(move |c| (name, c)))
            .collect();
        let deltas: Vec<Delta> = changes
            .par_iter()
            .map(|(_, change)| {
                let (st, path, ..) = &self.files[change.file];
                let read = |key: &str| {
                    read_f32(st, key)
                        .with_context(|| format!("--lora {}: reading {key}", path.display()))
                };
                Ok(match &change.kind {
                    ChangeKind::LowRank {
                        up,
                        up_rows,
                        swapped,
                        down,
                        rank,
                        scale,
                    } => {
                        let (mut up, mut down) = (read(up)?, read(down)?);
                        if let Some(r) = up_rows {
                            up = up[r.start * rank..r.end * rank].to_vec();
                        }
                        if *swapped {
                            let rows = up.len() / rank;
                            up = swap_halves(up, rows);
                            down = swap_halves(down, *rank);
                        }
                        Delta::LowRank {
                            up,
                            down,
                            rank: *rank,
                            scale: *scale,
                        }
                    }
                    ChangeKind::Full { diff, scale } => Delta::Full {
                        diff: read(diff)?,
                        scale: *scale,
                    },
                })
            })
            .collect::<Result<_>>()?;
        let mut loras = Loras::default();
        for ((name, _), delta) in changes.into_iter().zip(deltas) {
            loras.deltas.entry(name.clone()).or_default().push(delta);
        }
        Ok(loras)
    }
}

/// `values`, `rows` rows of a matrix, with its first `ceil(rows / 2)` rows moved after the
/// rest (torch's `cat(chunk(2)[::-1])`).
fn swap_halves(values: Vec<f32>, rows: usize) -> Vec<f32> {
    let cols = values.len() / rows.max(1);
    let head = rows.div_ceil(2) * cols;
    [&values[head..], &values[..head]].concat()
}

/// Tensor `key` of `st` as f32 values.
fn read_f32(st: &MmapedSafetensors, key: &str) -> candle_core::Result<Vec<f32>> {
    st.load(key, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()
}

/// The part of a LoRA module a key holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Down,
    Up,
    Alpha,
    Diff,
    DiffBias,
}

/// The key suffixes of each part, per layout.
fn suffix(layout: Layout, part: Part) -> &'static str {
    match (layout, part) {
        (
            Layout::Diffusers | Layout::OriginalPeft | Layout::ComfyUi { peft_halves: true },
            Part::Down,
        ) => ".lora_A.weight",
        (
            Layout::Diffusers | Layout::OriginalPeft | Layout::ComfyUi { peft_halves: true },
            Part::Up,
        ) => ".lora_B.weight",
        (Layout::XLabs, Part::Down) => ".down.weight",
        (Layout::XLabs, Part::Up) => ".up.weight",
        (_, Part::Down) => ".lora_down.weight",
        (_, Part::Up) => ".lora_up.weight",
        (_, Part::Alpha) => ".alpha",
        (_, Part::Diff) => ".diff",
        (_, Part::DiffBias) => ".diff_b",
    }
}

/// The prefixes a key of a layout may have (diffusers' and original/PEFT's: optional).
fn prefixes(layout: Layout) -> &'static [&'static str] {
    match layout {
        Layout::Diffusers => &["transformer."],
        Layout::ComfyUi { .. } => &["diffusion_model."],
        Layout::Musubi => &["lora_unet_"],
        Layout::OriginalPeft => &["diffusion_model.", "transformer."],
        Layout::XLabs => &["diffusion_model."],
    }
}

/// A key as (module, part), prefix removed.
fn split_key(key: &str, layout: Layout) -> Option<(&str, Part)> {
    let peft = matches!(
        layout,
        Layout::Diffusers | Layout::OriginalPeft | Layout::XLabs
    );
    let rest = prefixes(layout)
        .iter()
        .find_map(|p| key.strip_prefix(p))
        // PEFT files may name the modules without a prefix.
        .or_else(|| peft.then_some(key))?;
    [
        Part::Down,
        Part::Up,
        Part::Alpha,
        Part::Diff,
        Part::DiffBias,
    ]
    .into_iter()
    .filter(|&p| !peft || matches!(p, Part::Down | Part::Up))
    .find_map(|p| Some((rest.strip_suffix(suffix(layout, p))?, p)))
}

/// The key of `part` of the module of `key` (a `Part::Down` key).
fn key_of(key: &str, layout: Layout, part: Part) -> String {
    let stem = key.strip_suffix(suffix(layout, Part::Down)).unwrap_or(key);
    format!("{stem}{}", suffix(layout, part))
}

/// The PEFT scaling alpha of each module of `component` (`transformer`, `text_encoder`) in a
/// diffusers file with `lora_adapter_metadata` (`lora_alpha`, `alpha_pattern`, under the
/// component's prefix or, in a file of one component, bare); `None` for a file without it (alpha
/// folded: scale 1).
fn peft_alphas(path: &Path, component: &str) -> Result<impl Fn(&str) -> Option<f64>> {
    // The header alone (8 bytes of length, then JSON), not the whole file again.
    let header = || -> std::io::Result<serde_json::Value> {
        use std::io::Read;
        let mut file = std::fs::File::open(path)?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len)?;
        let mut json = Vec::new();
        file.take(u64::from_le_bytes(len)).read_to_end(&mut json)?;
        Ok(serde_json::from_slice(&json)?)
    };
    let header =
        header().with_context(|| format!("--lora {}: reading its header", path.display()))?;
    let config = header["__metadata__"]["lora_adapter_metadata"]
        .as_str()
        .map(serde_json::from_str::<serde_json::Value>)
        .transpose()
        .with_context(|| {
            format!(
                "--lora {}: its lora_adapter_metadata is not JSON",
                path.display()
            )
        })?;
    let field = |name: &str| {
        config
            .as_ref()
            .and_then(|c| c.get(format!("{component}.{name}")).or_else(|| c.get(name)))
            .cloned()
    };
    let (alpha, alpha_pattern) = (field("lora_alpha"), field("alpha_pattern"));
    // PEFT scales a module by its alpha over its rank, the rank of its stored matrices; a text
    // encoder's patterns name its modules as the model does (without CLIP's `text_model.` in
    // transformers 5).
    Ok(move |module: &str| {
        let bare = module.strip_prefix("text_model.").unwrap_or(module);
        alpha_pattern
            .as_ref()
            .and_then(|p| p.get(module).or_else(|| p.get(bare)))
            .or(alpha.as_ref())
            .and_then(|v| v.as_f64())
    })
}

/// A key of a text encoder's module, told by the prefix each layout gives them.
enum TextKey {
    /// CLIP's, in `layout`: its module under `text_model.` (`None`: no Linear of its encoder
    /// layers, the only modules diffusers' FLUX.1 loader gives a CLIP LoRA).
    Clip {
        layout: Layout,
        module: Option<String>,
        part: Part,
    },
    /// T5's (ComfyUI's `text_encoders.t5xxl.transformer.`), which diffusers' FLUX.1 loader
    /// drops.
    T5 { module: String, part: Part },
}

/// CLIP's Linears in an encoder layer: (kohya's name, the model's).
const CLIP_LINEARS: [(&str, &str); 6] = [
    ("self_attn_q_proj", "self_attn.q_proj"),
    ("self_attn_k_proj", "self_attn.k_proj"),
    ("self_attn_v_proj", "self_attn.v_proj"),
    ("self_attn_out_proj", "self_attn.out_proj"),
    ("mlp_fc1", "mlp.fc1"),
    ("mlp_fc2", "mlp.fc2"),
];

impl TextKey {
    /// `key` as a text encoder's (kohya's `lora_te1_` / `lora_te_`, ComfyUI's
    /// `text_encoders.clip_l.transformer.` / `text_encoders.t5xxl.transformer.`, PEFT's
    /// `text_encoder.`); `None` for any other key.
    fn of(key: &str) -> Option<TextKey> {
        let (layout, rest) = [
            ("lora_te1_", Layout::Musubi),
            ("lora_te_", Layout::Musubi),
            (
                "text_encoders.clip_l.transformer.",
                Layout::ComfyUi { peft_halves: false },
            ),
            (
                "text_encoders.t5xxl.transformer.",
                Layout::ComfyUi { peft_halves: false },
            ),
            ("text_encoder.", Layout::Diffusers),
        ]
        .into_iter()
        .find_map(|(prefix, layout)| Some((layout, key.strip_prefix(prefix)?)))?;
        let parts: &[Part] = match layout {
            Layout::Diffusers => &[Part::Down, Part::Up],
            _ => &[
                Part::Down,
                Part::Up,
                Part::Alpha,
                Part::Diff,
                Part::DiffBias,
            ],
        };
        let (stem, part) = parts
            .iter()
            .find_map(|&p| Some((rest.strip_suffix(suffix(layout, p))?, p)))
            .unwrap_or((rest, Part::Down));
        if key.starts_with("text_encoders.t5xxl.") {
            let module = stem.to_string();
            return Some(TextKey::T5 { module, part });
        }
        let layer = |n: &str, linear: &str| {
            n.parse::<usize>().ok()?;
            Some(format!("text_model.encoder.layers.{n}.{linear}"))
        };
        let module = match layout {
            Layout::Musubi => stem
                .strip_prefix("text_model_encoder_layers_")
                .and_then(|rest| rest.split_once('_'))
                .and_then(|(n, linear)| {
                    let (_, linear) = CLIP_LINEARS.iter().find(|(k, _)| *k == linear)?;
                    layer(n, linear)
                }),
            _ => stem
                .strip_prefix("text_model.")
                .unwrap_or(stem)
                .strip_prefix("encoder.layers.")
                .and_then(|rest| rest.split_once('.'))
                .and_then(|(n, linear)| {
                    let (_, linear) = CLIP_LINEARS.iter().find(|(_, m)| *m == linear)?;
                    layer(n, linear)
                }),
        };
        Some(TextKey::Clip {
            layout,
            module,
            part,
        })
    }
}

/// The FLUX.1 modules an XLabs LoRA module changes and the piece of its up matrix each takes, as
/// diffusers' `_convert_xlabs_flux_lora_to_diffusers` maps them: a double block's `qkv_lora1` /
/// `qkv_lora2` (image / text q, k, v) and `proj_lora1` / `proj_lora2`, a single block's
/// `qkv_lora` and `proj_lora` (its `proj_out`).
fn xlabs_targets(module: &str) -> Option<Vec<(String, Piece)>> {
    let (blocks, rest) = module.split_once('.')?;
    let (n, processor) = rest.split_once(".processor.")?;
    n.parse::<usize>().ok()?;
    let whole = |m: String| Some(vec![(m, Piece::Whole)]);
    let thirds = |m: [String; 3]| {
        Some(
            m.into_iter()
                .zip(0..)
                .map(|(m, i)| (m, Piece::Third(i)))
                .collect(),
        )
    };
    match (blocks, processor) {
        ("double_blocks", p) => {
            let at = |l: &str| format!("transformer_blocks.{n}.attn.{l}");
            match p {
                "qkv_lora1" => thirds([at("to_q"), at("to_k"), at("to_v")]),
                "qkv_lora2" => thirds([at("add_q_proj"), at("add_k_proj"), at("add_v_proj")]),
                "proj_lora1" => whole(at("to_out.0")),
                "proj_lora2" => whole(at("to_add_out")),
                _ => None,
            }
        }
        ("single_blocks", p) => {
            let at = |l: &str| format!("single_transformer_blocks.{n}.{l}");
            match p {
                "qkv_lora" => thirds([at("attn.to_q"), at("attn.to_k"), at("attn.to_v")]),
                "proj_lora" => whole(at("proj_out")),
                _ => None,
            }
        }
        _ => None,
    }
}

/// A musubi module name (`blocks_0_self_attn_q`) as the original one (`blocks.0.self_attn.q`).
fn musubi_to_original(module: &str) -> Option<String> {
    let rest = module.strip_prefix("blocks_")?;
    let (n, rest) = rest.split_once('_')?;
    n.parse::<usize>().ok()?;
    let (group, layer) = ["self_attn", "cross_attn", "ffn"]
        .into_iter()
        .find_map(|g| Some((g, rest.strip_prefix(g)?.strip_prefix('_')?)))?;
    Some(format!("blocks.{n}.{group}.{layer}"))
}

/// The layers of a block: (original Wan-AI name, diffusers name).
const ORIGINAL_BLOCK_LAYERS: [(&str, &str); 19] = [
    ("self_attn.q", "attn1.to_q"),
    ("self_attn.k", "attn1.to_k"),
    ("self_attn.v", "attn1.to_v"),
    ("self_attn.o", "attn1.to_out.0"),
    ("self_attn.norm_q", "attn1.norm_q"),
    ("self_attn.norm_k", "attn1.norm_k"),
    ("cross_attn.q", "attn2.to_q"),
    ("cross_attn.k", "attn2.to_k"),
    ("cross_attn.v", "attn2.to_v"),
    ("cross_attn.o", "attn2.to_out.0"),
    ("cross_attn.norm_q", "attn2.norm_q"),
    ("cross_attn.norm_k", "attn2.norm_k"),
    ("cross_attn.k_img", "attn2.add_k_proj"),
    ("cross_attn.v_img", "attn2.add_v_proj"),
    ("cross_attn.norm_k_img", "attn2.norm_added_k"),
    ("ffn.0", "ffn.net.0.proj"),
    ("ffn.2", "ffn.net.2"),
    ("norm3", "norm2"),
    ("modulation", "scale_shift_table"),
];

/// The layers outside the blocks: (original Wan-AI name, diffusers name).
const ORIGINAL_TOP_LAYERS: [(&str, &str); 7] = [
    ("head.head", "proj_out"),
    ("patch_embedding", "patch_embedding"),
    (
        "text_embedding.0",
        "condition_embedder.text_embedder.linear_1",
    ),
    (
        "text_embedding.2",
        "condition_embedder.text_embedder.linear_2",
    ),
    (
        "time_embedding.0",
        "condition_embedder.time_embedder.linear_1",
    ),
    (
        "time_embedding.2",
        "condition_embedder.time_embedder.linear_2",
    ),
    ("time_projection.1", "condition_embedder.time_proj"),
];

/// An original Wan-AI module name as the diffusers one.
fn original_to_diffusers(module: &str) -> Option<String> {
    if let Some(rest) = module.strip_prefix("blocks.") {
        let (n, layer) = rest.split_once('.')?;
        n.parse::<usize>().ok()?;
        let (_, mapped) = ORIGINAL_BLOCK_LAYERS.iter().find(|(o, _)| *o == layer)?;
        return Some(format!("blocks.{n}.{mapped}"));
    }
    ORIGINAL_TOP_LAYERS
        .iter()
        .find(|(o, _)| *o == module)
        .map(|(_, d)| d.to_string())
}

/// A diffusers weight name (`blocks.0.attn1.to_q.weight`, `scale_shift_table`) as the original
/// Wan-AI file stores it (`blocks.0.self_attn.q.weight`, `head.modulation`); `None` where the
/// names agree or no mapping applies.
pub fn diffusers_to_original(name: &str) -> Option<String> {
    if name == "scale_shift_table" {
        return Some("head.modulation".into());
    }
    let (module, param) = name.rsplit_once('.')?;
    if param == "scale_shift_table" {
        return Some(format!("{module}.modulation"));
    }
    let block = |n: &str, layer: &str| format!("blocks.{n}.{layer}");
    let original = if let Some(rest) = module.strip_prefix("blocks.") {
        let (n, layer) = rest.split_once('.')?;
        ORIGINAL_BLOCK_LAYERS
            .iter()
            .find(|(_, d)| *d == layer)
            .map(|(o, _)| block(n, o))?
    } else {
        ORIGINAL_TOP_LAYERS
            .iter()
            .find(|(_, d)| *d == module)
            .map(|(o, _)| o.to_string())?
    };
    (original != module).then(|| format!("{original}.{param}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_take_a_scale_after_the_last_colon() {
        let spec = |s: &str| parse_spec(s).unwrap();
        assert_eq!(spec("a.safetensors").scale, 1.0);
        assert_eq!(spec("a.safetensors:0.6").scale, 0.6);
        assert_eq!(
            spec("a.safetensors:0.6").path,
            PathBuf::from("a.safetensors")
        );
        // A colon inside the path, not followed by a number, is the path's.
        assert_eq!(
            spec("C:/loras/a.safetensors").path,
            PathBuf::from("C:/loras/a.safetensors")
        );
        assert!(parse_spec("a.safetensors:nan").is_err());
        assert!(parse_spec(":2").is_err());
        assert!(parse_spec("").is_err());
    }

    /// CLIP's modules in the three layouts land on the weight names of either CLIP save: under
    /// `text_model.` (transformers 4, FLUX.1-dev's) or flattened (transformers 5).
    #[test]
    fn clip_keys_name_the_weights_of_either_clip_layout() -> Result<()> {
        let module = |key: &str| match TextKey::of(key) {
            Some(TextKey::Clip { module, .. }) => module,
            _ => None,
        };
        let q = "text_model.encoder.layers.3.self_attn.q_proj";
        for key in [
            "lora_te1_text_model_encoder_layers_3_self_attn_q_proj.lora_down.weight",
            "lora_te_text_model_encoder_layers_3_self_attn_q_proj.alpha",
            "text_encoders.clip_l.transformer.text_model.encoder.layers.3.self_attn.q_proj.lora_up.weight",
            "text_encoder.encoder.layers.3.self_attn.q_proj.lora_A.weight",
            "text_encoder.text_model.encoder.layers.3.self_attn.q_proj.lora_B.weight",
        ] {
            assert_eq!(module(key).as_deref(), Some(q), "{key}");
        }
        assert_eq!(
            module("lora_te1_text_model_encoder_layers_0_mlp_fc2.lora_down.weight").as_deref(),
            Some("text_model.encoder.layers.0.mlp.fc2")
        );
        assert_eq!(
            module("lora_te1_text_model_final_layer_norm.lora_down.weight"),
            None
        );
        assert!(matches!(
            TextKey::of(
                "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.alpha"
            ),
            Some(TextKey::T5 {
                part: Part::Alpha,
                ..
            })
        ));
        assert!(TextKey::of("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight").is_none());

        let dir = std::env::temp_dir().join(format!("vidgen-lora-clip-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("te.safetensors");
        let stem = "lora_te1_text_model_encoder_layers_3_self_attn_q_proj";
        let factor = Tensor::ones((2, 8), DType::F32, &Device::Cpu)?;
        candle_core::safetensors::save(
            &std::collections::HashMap::from([
                (format!("{stem}.lora_down.weight"), factor.clone()),
                (format!("{stem}.lora_up.weight"), factor.t()?),
            ]),
            &path,
        )?;
        let spec = LoraSpec { path, scale: 1.0 };
        let names = |holds: &[&str]| -> Result<Vec<String>> {
            let holds: Vec<String> = holds.iter().map(|m| format!("{m}.weight")).collect();
            let scanned = Scanned::scan(std::slice::from_ref(&spec), Target::ClipText)?
                .rooted(|n| holds.iter().any(|h| h == n));
            Ok(scanned.changes.into_keys().collect())
        };
        assert_eq!(names(&[q])?, [format!("{q}.weight")]);
        let bare = q.strip_prefix("text_model.").unwrap();
        assert_eq!(names(&[bare])?, [format!("{bare}.weight")]);
        // The transformer's scan of the same file changes nothing and asks nothing of it.
        let dit = Scanned::scan(
            std::slice::from_ref(&spec),
            Target::Transformer(Some(Model::Flux)),
        )?;
        assert!(dit.changes.is_empty());
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    #[test]
    fn module_names_map_to_diffusers() {
        let m = |s: &str| musubi_to_original(s).and_then(|o| original_to_diffusers(&o));
        assert_eq!(
            m("blocks_3_self_attn_o").as_deref(),
            Some("blocks.3.attn1.to_out.0")
        );
        assert_eq!(
            m("blocks_0_cross_attn_k_img").as_deref(),
            Some("blocks.0.attn2.add_k_proj")
        );
        assert_eq!(
            m("blocks_1_ffn_0").as_deref(),
            Some("blocks.1.ffn.net.0.proj")
        );
        assert_eq!(
            original_to_diffusers("blocks.2.norm3").as_deref(),
            Some("blocks.2.norm2")
        );
        assert_eq!(
            original_to_diffusers("head.head").as_deref(),
            Some("proj_out")
        );
        assert_eq!(original_to_diffusers("blocks.x.self_attn.q"), None);
        assert_eq!(m("double_blocks_0_img_attn_qkv"), None);
    }

    #[test]
    fn diffusers_weight_names_map_to_the_original_layout() {
        let o = |s: &str| diffusers_to_original(s);
        assert_eq!(
            o("blocks.1.attn2.to_out.0.weight").as_deref(),
            Some("blocks.1.cross_attn.o.weight")
        );
        assert_eq!(
            o("blocks.0.norm2.bias").as_deref(),
            Some("blocks.0.norm3.bias")
        );
        assert_eq!(
            o("blocks.0.scale_shift_table").as_deref(),
            Some("blocks.0.modulation")
        );
        assert_eq!(o("scale_shift_table").as_deref(), Some("head.modulation"));
        assert_eq!(o("proj_out.weight").as_deref(), Some("head.head.weight"));
        assert_eq!(
            o("condition_embedder.time_proj.bias").as_deref(),
            Some("time_projection.1.bias")
        );
        // Names the layouts share need no mapping.
        assert_eq!(o("patch_embedding.weight"), None);
        assert_eq!(
            o("blocks.0.attn1.norm_q.weight").as_deref(),
            Some("blocks.0.self_attn.norm_q.weight")
        );
    }
}
