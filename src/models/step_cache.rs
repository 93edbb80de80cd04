//! Step caches over a DiT's blocks (`--cache`), computing what diffusers' hooks compute:
//! First Block Cache (`FirstBlockCacheConfig`), MagCache (`MagCacheConfig`, with its
//! calibration mode) and Pyramid Attention Broadcast (`PyramidAttentionBroadcastConfig`). The
//! first two keep one state per pass (the conditional and the unconditional forward never share
//! one, as diffusers' `cache_context("cond")` / `("uncond")`); PAB keeps one per attention
//! module across both passes, as diffusers does. Each records which modules ran in each forward.
//! A cache knows blocks as "the first" and "the rest" and, inside a block, the outputs a model
//! hands it ([`BlockHooks`]); which model it serves and how its blocks are placed it does not
//! know.

use candle_core::{DType, Result, Tensor, D};
use serde::{Deserialize, Serialize};

/// A `--cache HOOK:SPEC` value: the hook and its config, fields as diffusers names them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "hook", rename_all = "kebab-case")]
pub enum CacheSpec {
    /// Skips every block after the first while the first block's residual changes by at most
    /// `threshold` (relative mean absolute difference) from the last fully computed step.
    FirstBlock { threshold: f64 },
    /// Skips whole forwards while the accumulated error of the magnitude ratios stays small.
    #[serde(rename = "magcache")]
    Mag(MagCacheConfig),
    /// Reuses attention outputs of earlier calls inside a timestep range.
    Pab(PabConfig),
    /// Predicts hooked modules' outputs by Taylor series between full steps.
    #[serde(rename = "taylorseer")]
    TaylorSeer(TaylorSeerConfig),
}

/// diffusers' `TaylorSeerCacheConfig`, its defaults included.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaylorSeerConfig {
    pub cache_interval: u64,
    pub disable_cache_before_step: u64,
    pub disable_cache_after_step: Option<u64>,
    pub max_order: usize,
    /// The dtype the factors are stored in (`taylor_factors_dtype`): float32, bfloat16, float16.
    pub factors_dtype: String,
    /// Regular expressions (`re.fullmatch`) of the modules that return zeros between full steps.
    pub skip_predict_identifiers: Vec<String>,
    /// Those whose outputs are predicted.
    pub cache_identifiers: Vec<String>,
    pub use_lite_mode: bool,
}

impl Default for TaylorSeerConfig {
    fn default() -> Self {
        TaylorSeerConfig {
            cache_interval: 5,
            disable_cache_before_step: 3,
            disable_cache_after_step: None,
            max_order: 1,
            factors_dtype: "bfloat16".into(),
            skip_predict_identifiers: Vec::new(),
            cache_identifiers: Vec::new(),
            use_lite_mode: false,
        }
    }
}

/// diffusers' default `cache_identifiers` (its `_TRANSFORMER_BLOCK_IDENTIFIERS`), and lite mode's
/// predicted and zeroed modules.
const TAYLORSEER_DEFAULT: [&str; 4] = [
    "^blocks.*attn",
    "^transformer_blocks.*attn",
    "^single_transformer_blocks.*attn",
    "^temporal_transformer_blocks.*attn",
];
const TAYLORSEER_LITE_PREDICTED: &str = "^proj_out$";
const TAYLORSEER_LITE_ZEROED: &str = "^[^.]*block[^.]*\\.[^.]+$";

impl TaylorSeerConfig {
    /// The compiled (zeroed, predicted) patterns, matched against whole module names.
    fn patterns(&self) -> std::result::Result<(Vec<regex::Regex>, Vec<regex::Regex>), String> {
        let compile = |list: &[&str]| {
            list.iter()
                .map(|p| {
                    regex::Regex::new(&format!("^(?:{p})$"))
                        .map_err(|e| format!("{p} is not a regular expression: {e}"))
                })
                .collect::<std::result::Result<Vec<_>, _>>()
        };
        fn own(list: &[String]) -> Vec<&str> {
            list.iter().map(String::as_str).collect()
        }
        if self.use_lite_mode {
            return Ok((
                compile(&[TAYLORSEER_LITE_ZEROED])?,
                compile(&[TAYLORSEER_LITE_PREDICTED])?,
            ));
        }
        let predicted = match self.cache_identifiers.is_empty() {
            true => TAYLORSEER_DEFAULT.to_vec(),
            false => own(&self.cache_identifiers),
        };
        Ok((
            compile(&own(&self.skip_predict_identifiers))?,
            compile(&predicted)?,
        ))
    }

    fn dtype(&self) -> DType {
        match self.factors_dtype.as_str() {
            "float32" => DType::F32,
            "float16" => DType::F16,
            _ => DType::BF16,
        }
    }
}

/// diffusers' `PyramidAttentionBroadcastConfig` (its block identifiers left at their defaults,
/// which name every block of the models vidgen runs): per kind of attention, reuse the last
/// output for `range − 1` of every `range` calls while the timestep lies strictly inside
/// `timesteps`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PabConfig {
    pub spatial: Option<(u32, (f64, f64))>,
    pub temporal: Option<(u32, (f64, f64))>,
    pub cross: Option<(u32, (f64, f64))>,
}

/// How many attention modules of each kind of PAB's a transformer has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionModules {
    pub spatial: usize,
    pub temporal: usize,
    pub cross: usize,
}

impl PabConfig {
    /// The attention outputs PAB holds (one prompt's each) in a transformer of `modules`.
    /// diffusers tells the kinds apart by name, and its spatial identifier `blocks` is in a
    /// temporal module's name too (`temporal_transformer_blocks.N.attn1`): a temporal attention
    /// takes the spatial setting where it is set, its own only where it is not
    /// ([`Submodule::TemporalAttention`]).
    pub fn held_outputs(&self, modules: AttentionModules) -> usize {
        let temporal = self.spatial.or(self.temporal);
        [
            (self.spatial, modules.spatial),
            (temporal, modules.temporal),
            (self.cross, modules.cross),
        ]
        .iter()
        .map(|(setting, count)| if setting.is_some() { *count } else { 0 })
        .sum()
    }
}

/// diffusers' `MagCacheConfig`, its defaults included.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MagCacheConfig {
    pub threshold: f64,
    pub max_skip_steps: u32,
    pub retention_ratio: f64,
    pub num_inference_steps: usize,
    /// One ratio per step, resampled to `num_inference_steps` (nearest, as diffusers).
    pub mag_ratios: Option<Vec<f32>>,
    pub calibrate: bool,
}

impl Default for MagCacheConfig {
    fn default() -> Self {
        MagCacheConfig {
            threshold: 0.06,
            max_skip_steps: 3,
            retention_ratio: 0.2,
            num_inference_steps: 28,
            mag_ratios: None,
            calibrate: false,
        }
    }
}

impl CacheSpec {
    /// Parses `HOOK:SPEC`: `first-block:THRESHOLD` (or `first-block:threshold=T`) and
    /// `magcache:K=V,...`; lists with `;` between items.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let (hook, spec) = text.split_once(':').unwrap_or((text, ""));
        let pairs = || -> std::result::Result<Vec<(&str, &str)>, String> {
            spec.split(',')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    p.split_once('=')
                        .ok_or_else(|| format!("--cache {text}: `{p}` is not KEY=VALUE"))
                })
                .collect()
        };
        let number = |key: &str, v: &str| -> std::result::Result<f64, String> {
            v.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite())
                .ok_or_else(|| format!("--cache {text}: {key}={v} is not a finite number"))
        };
        let count = |key: &str, v: &str| -> std::result::Result<usize, String> {
            v.parse::<usize>()
                .map_err(|_| format!("--cache {text}: {key}={v} is not a whole number"))
        };
        match hook {
            "first-block" => {
                let threshold = match pairs() {
                    Ok(p) if p.len() == 1 && p[0].0 == "threshold" => number("threshold", p[0].1)?,
                    _ if !spec.contains('=') && !spec.is_empty() => number("threshold", spec)?,
                    _ if spec.is_empty() => 0.05,
                    _ => {
                        return Err(format!(
                            "--cache {text}: first-block takes one key, threshold"
                        ))
                    }
                };
                Ok(CacheSpec::FirstBlock { threshold })
            }
            "magcache" => {
                let mut c = MagCacheConfig::default();
                for (key, v) in pairs()? {
                    match key {
                        "threshold" => c.threshold = number(key, v)?,
                        "max_skip_steps" => c.max_skip_steps = count(key, v)? as u32,
                        "retention_ratio" => c.retention_ratio = number(key, v)?,
                        "num_inference_steps" => c.num_inference_steps = count(key, v)?.max(1),
                        "calibrate" => {
                            c.calibrate = match v {
                                "true" => true,
                                "false" => false,
                                _ => return Err(format!("--cache {text}: calibrate={v} is not true or false")),
                            }
                        }
                        "mag_ratios" => {
                            c.mag_ratios = match v {
                                "none" => None,
                                _ => Some(
                                    v.split(';')
                                        .map(|r| number(key, r).map(|r| r as f32))
                                        .collect::<std::result::Result<_, _>>()?,
                                ),
                            }
                        }
                        _ => {
                            return Err(format!(
                                "--cache {text}: magcache has no key {key} (threshold, max_skip_steps, retention_ratio, num_inference_steps, mag_ratios, calibrate)"
                            ))
                        }
                    }
                }
                if c.mag_ratios.is_none() && !c.calibrate {
                    return Err(format!(
                        "--cache {text}: magcache needs mag_ratios=R1;R2;... (run once with calibrate=true to get them)"
                    ));
                }
                Ok(CacheSpec::Mag(c))
            }
            "pab" => {
                let (mut ranges, mut windows) = ([None; 3], [(100.0, 800.0); 3]);
                let kind = |key: &str, suffix: &str| {
                    ["spatial", "temporal", "cross"]
                        .iter()
                        .position(|k| key == format!("{k}_attention_{suffix}"))
                };
                for (key, v) in pairs()? {
                    if let Some(i) = kind(key, "block_skip_range") {
                        ranges[i] = match v {
                            "none" => None,
                            _ => Some(count(key, v)?.max(1) as u32),
                        };
                    } else if let Some(i) = kind(key, "timestep_skip_range") {
                        let bounds = v
                            .split(';')
                            .map(|b| number(key, b))
                            .collect::<std::result::Result<Vec<_>, _>>()?;
                        let [lo, hi] = bounds[..] else {
                            return Err(format!(
                                "--cache {text}: {key} takes two bounds, LOW;HIGH"
                            ));
                        };
                        windows[i] = (lo, hi);
                    } else {
                        return Err(format!(
                            "--cache {text}: pab has no key {key} vidgen reads ({{spatial,temporal,cross}}_attention_block_skip_range, ..._timestep_skip_range)"
                        ));
                    }
                }
                // diffusers' default when no range is given.
                if ranges.iter().all(Option::is_none) {
                    ranges[0] = Some(2);
                }
                let with = |i: usize| ranges[i].map(|r| (r, windows[i]));
                Ok(CacheSpec::Pab(PabConfig {
                    spatial: with(0),
                    temporal: with(1),
                    cross: with(2),
                }))
            }
            "taylorseer" => {
                let mut c = TaylorSeerConfig::default();
                let list = |v: &str| match v {
                    "none" => Vec::new(),
                    _ => v.split(';').map(String::from).collect(),
                };
                for (key, v) in pairs()? {
                    match key {
                        "cache_interval" => c.cache_interval = count(key, v)?.max(1) as u64,
                        "disable_cache_before_step" => {
                            c.disable_cache_before_step = count(key, v)? as u64
                        }
                        "disable_cache_after_step" => {
                            c.disable_cache_after_step = match v {
                                "none" => None,
                                _ => Some(count(key, v)? as u64),
                            }
                        }
                        "max_order" => c.max_order = count(key, v)?,
                        "taylor_factors_dtype" => match v {
                            "float32" | "bfloat16" | "float16" => c.factors_dtype = v.into(),
                            _ => {
                                return Err(format!(
                                    "--cache {text}: taylor_factors_dtype={v}: give float32, bfloat16 or float16"
                                ))
                            }
                        },
                        "skip_predict_identifiers" => c.skip_predict_identifiers = list(v),
                        "cache_identifiers" => c.cache_identifiers = list(v),
                        "use_lite_mode" => {
                            c.use_lite_mode = match v {
                                "true" => true,
                                "false" => false,
                                _ => return Err(format!("--cache {text}: use_lite_mode={v} is not true or false")),
                            }
                        }
                        _ => {
                            return Err(format!(
                                "--cache {text}: taylorseer has no key {key} (cache_interval, disable_cache_before_step, disable_cache_after_step, max_order, taylor_factors_dtype, skip_predict_identifiers, cache_identifiers, use_lite_mode)"
                            ))
                        }
                    }
                }
                c.patterns().map_err(|e| format!("--cache {text}: {e}"))?;
                Ok(CacheSpec::TaylorSeer(c))
            }
            _ => Err(format!(
                "--cache {text}: no cache named {hook} (first-block:THRESHOLD or magcache:K=V,...)"
            )),
        }
    }

    /// How many hidden states the cache holds between forwards in a transformer whose blocks
    /// it sees as `hooked`: per pass (conditional and unconditional) the first block's residual
    /// and output and the rest's residual (First Block Cache) or the whole residual (MagCache);
    /// per pass and predicted module up to max_order + 1 factors (TaylorSeer; a block's
    /// streams and a module's output counted a hidden state each). PAB's attention outputs
    /// are the transformer's own count ([`PabConfig::held_outputs`]).
    pub fn held_states(&self, hooked: &HookedBlocks) -> usize {
        match self {
            CacheSpec::FirstBlock { .. } => 6,
            CacheSpec::Mag(_) => 2,
            CacheSpec::Pab(_) => 0,
            CacheSpec::TaylorSeer(c) => {
                let Ok((_, predicted)) = c.patterns() else {
                    return 0;
                };
                let modules = hooked.modules();
                let matched = modules
                    .iter()
                    .filter(|name| predicted.iter().any(|p| p.is_match(name)))
                    .count();
                matched * 2 * (c.max_order + 1)
            }
        }
    }

    /// The first of a transformer's `modules` (diffusers' module paths) that one of
    /// TaylorSeer's patterns matches although the blocks (`hooked`) do not hand it to the
    /// cache: diffusers would predict or zero it, vidgen could not.
    pub fn unhooked_module<'m>(
        &self,
        hooked: &HookedBlocks,
        modules: impl IntoIterator<Item = &'m str>,
    ) -> Option<&'m str> {
        let CacheSpec::TaylorSeer(c) = self else {
            return None;
        };
        let (zeroed, predicted) = c.patterns().ok()?;
        let own: std::collections::HashSet<String> = hooked.modules().into_iter().collect();
        modules.into_iter().find(|name| {
            zeroed.iter().chain(&predicted).any(|p| p.is_match(name)) && !own.contains(*name)
        })
    }

    /// The hook's name as `--cache` spells it.
    pub fn name(&self) -> &'static str {
        match self {
            CacheSpec::FirstBlock { .. } => "first-block",
            CacheSpec::Mag(_) => "magcache",
            CacheSpec::Pab(_) => "pab",
            CacheSpec::TaylorSeer(_) => "taylorseer",
        }
    }
}

/// diffusers' `nearest_interp`: ratio k of `n` is `ratios[round(k · (L−1)/(n−1))]`, the product
/// in float32 and rounded half to even.
fn resample(ratios: &[f32], n: usize) -> Vec<f32> {
    if ratios.len() == n {
        return ratios.to_vec();
    }
    if n == 1 {
        return ratios[ratios.len() - 1..].to_vec();
    }
    let scale = ((ratios.len() - 1) as f64 / (n - 1) as f64) as f32;
    (0..n)
        .map(|k| ratios[((k as f32) * scale).round_ties_even() as usize])
        .collect()
}

/// How a DiT names, in diffusers, the modules a step cache hooks: its block lists (block `i`
/// of a list is `{list}.{i}`), the outputs each block hands the cache (`{list}.{i}.{submodule}`)
/// and the output projection.
#[derive(Clone, Copy, Debug)]
pub struct ModuleNames {
    /// diffusers' block lists, in the order the forward runs them.
    pub lists: &'static [&'static str],
    /// Whether the forward takes the lists' blocks in turns (Latte: spatial 0, temporal 0,
    /// spatial 1, ...) rather than one list after the other.
    pub interleaved: bool,
    /// The outputs the blocks hand the cache, by kind and diffusers' name, in the order of the
    /// columns of a block's record (after the block's own); none where the model hands the
    /// cache no outputs inside its blocks (the caches that act between blocks only). A block
    /// without one of them (FLUX.1's single blocks have no `ff`) never asks for it: its column
    /// reads computed.
    pub submodules: &'static [(Output, &'static str)],
    /// Which blocks lack some of `submodules`.
    pub absent: Absent,
    pub proj_out: &'static str,
}

/// Which blocks lack an output the others hand the cache (diffusers' module is absent: its
/// record column reads computed, even in a block the cache skips whole).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Absent {
    /// Every block has every output.
    Nothing,
    /// The second list's blocks (FLUX.1's and HunyuanVideo's single-stream blocks) have no
    /// feed-forwards.
    FeedForwardsAfterFirstList,
    /// The last block has no text feed-forward (Mochi-1's `context_pre_only` block).
    LastContextFeedForward,
}

impl ModuleNames {
    /// The names of diffusers' Wan transformer (and most DiTs'), whose TaylorSeer patterns the
    /// plan reads.
    pub const DIFFUSERS: ModuleNames = ModuleNames {
        lists: &["blocks"],
        interleaved: false,
        submodules: &[
            (Output::Attention, "attn1"),
            (Output::CrossAttention, "attn2"),
            (Output::FeedForward, "ffn"),
        ],
        absent: Absent::Nothing,
        proj_out: "proj_out",
    };

    /// One list of `transformer_blocks` handing the cache `submodules`.
    pub const fn transformer_blocks(submodules: &'static [(Output, &'static str)]) -> ModuleNames {
        ModuleNames {
            lists: &["transformer_blocks"],
            interleaved: false,
            submodules,
            absent: Absent::Nothing,
            proj_out: "proj_out",
        }
    }

    /// The column of `module` in a block's record (the block's own is 0), where the blocks
    /// name it.
    fn column(&self, module: Submodule) -> Option<usize> {
        let kind = module.output();
        self.submodules
            .iter()
            .position(|(output, _)| *output == kind)
            .map(|i| i + 1)
    }

    /// The names of the outputs the blocks hand the cache, in column order.
    pub fn submodule_names(&self) -> impl Iterator<Item = &'static str> {
        self.submodules.iter().map(|(_, name)| *name)
    }
}

/// The module paths (diffusers' `named_modules()` names, the root `""` first) of a model whose
/// parameters are `tensors` (`blocks.0.attn1.to_q.weight`: `blocks`, `blocks.0`, ...), sorted.
pub fn module_paths<'t>(tensors: impl IntoIterator<Item = &'t str>) -> Vec<String> {
    let mut paths = std::collections::BTreeSet::from([String::new()]);
    for name in tensors {
        let mut end = 0;
        while let Some(dot) = name[end..].find('.') {
            end += dot;
            paths.insert(name[..end].to_string());
            end += 1;
        }
    }
    paths.into_iter().collect()
}

/// Which forward of a guided step: the passes keep separate cache states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Cond,
    Uncond,
}

/// The outputs inside a block a step cache may stand in for, in the block's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Submodule {
    /// Self-attention over the video tokens (PAB's "spatial" attention).
    SelfAttention,
    /// Self-attention across the frames of each token position (Latte's temporal blocks'
    /// `attn1`: PAB's "temporal" attention, where the spatial range is not set).
    TemporalAttention,
    /// Attention to the text (PAB's "cross" attention).
    CrossAttention,
    /// Attention to the text in a module diffusers does not flag as cross-attention
    /// (LTX-Video's `LTXAttention` has no `is_cross_attention`): PAB takes it for a spatial
    /// self-attention by its name, so it takes the spatial settings.
    UnflaggedCrossAttention,
    /// The (image stream's) feed-forward module.
    FeedForward,
    /// The text stream's feed-forward module in a dual-stream block (`ff_context`).
    ContextFeedForward,
}

impl Submodule {
    /// The kind of output it is, by which a model names it ([`ModuleNames::submodules`]).
    fn output(self) -> Output {
        match self {
            Submodule::SelfAttention | Submodule::TemporalAttention => Output::Attention,
            Submodule::CrossAttention | Submodule::UnflaggedCrossAttention => {
                Output::CrossAttention
            }
            Submodule::FeedForward => Output::FeedForward,
            Submodule::ContextFeedForward => Output::ContextFeedForward,
        }
    }
}

/// The kinds of output inside a block a model may hand a step cache, each named once by the
/// model (a block's spatial and temporal attentions share a name: Latte's `attn1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    Attention,
    CrossAttention,
    FeedForward,
    ContextFeedForward,
}

/// What a block asks of a step cache while it runs: each hooked output (the module's whole
/// output, its bias included), computed by `compute` or stood in for (the model runs the rest
/// of its arithmetic on what it gets). Outputs not [`BlockHooks::wants`]ed are not asked for.
/// The tensor given is the caller's (the fused residual kernels write their sums into it): a
/// cache that keeps an output keeps its own copy.
pub trait BlockHooks {
    /// Whether the cache hooks `module` of the block running.
    fn wants(&self, module: Submodule) -> bool;
    fn output(
        &mut self,
        module: Submodule,
        compute: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor>;
}

/// A module's output through a step cache's `hooks` where they hook `module`: computed whole
/// (`bias`, its Linear's, added), which the cache keeps or stands in for, and no bias left for
/// the caller's residual; otherwise computed as it is, `bias` left for the residual's fused add.
pub fn whole_output<'b>(
    hooks: &mut dyn BlockHooks,
    module: Submodule,
    mut compute: impl FnMut() -> Result<Tensor>,
    bias: Option<&'b Tensor>,
) -> Result<(Tensor, Option<&'b Tensor>)> {
    if !hooks.wants(module) {
        return Ok((compute()?, bias));
    }
    let out = hooks.output(module, &mut || match bias {
        Some(b) => compute()?.broadcast_add(b),
        None => compute(),
    })?;
    Ok((out, None))
}

/// A joint attention's outputs through a step cache's `hooks` where they hook `module`: the
/// video output of shape `video` and, where the module has one, the text output of shape
/// `text`, kept and stood in for together (diffusers' hook keeps the module's tuple); otherwise
/// computed as they are.
pub fn joint_output(
    hooks: &mut dyn BlockHooks,
    module: Submodule,
    video: &[usize],
    text: Option<&[usize]>,
    mut compute: impl FnMut() -> Result<(Tensor, Option<Tensor>)>,
) -> Result<(Tensor, Option<Tensor>)> {
    if !hooks.wants(module) {
        return compute();
    }
    // One tensor per sample: the video output's elements, then the text output's.
    let batch = video.first().copied().unwrap_or(1);
    let packed = hooks.output(module, &mut || {
        let (v, t) = compute()?;
        let mut parts = vec![v.reshape((batch, ()))?];
        if let Some(t) = t {
            parts.push(t.reshape((batch, ()))?);
        }
        Tensor::cat(&parts, 1)
    })?;
    let elements = |shape: &[usize]| shape.iter().skip(1).product::<usize>();
    let v = packed.narrow(1, 0, elements(video))?.reshape(video)?;
    let t = match text {
        Some(shape) => Some(
            packed
                .narrow(1, elements(video), elements(shape))?
                .reshape(shape)?,
        ),
        None => None,
    };
    Ok((v, t))
}

/// A block's hooks with its `from` output handed on as `to`: a module that diffusers' hooks
/// classify otherwise than its place in a shared block says (Latte's temporal blocks are PixArt
/// blocks whose `attn1` PAB takes for temporal attention).
pub struct Reclassified<'h> {
    pub hooks: &'h mut dyn BlockHooks,
    pub from: Submodule,
    pub to: Submodule,
}

impl Reclassified<'_> {
    fn kind(&self, module: Submodule) -> Submodule {
        if module == self.from {
            self.to
        } else {
            module
        }
    }
}

impl BlockHooks for Reclassified<'_> {
    fn wants(&self, module: Submodule) -> bool {
        self.hooks.wants(self.kind(module))
    }

    fn output(
        &mut self,
        module: Submodule,
        compute: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        let kind = self.kind(module);
        self.hooks.output(kind, compute)
    }
}

/// Computes a module's output (what a cache runs, or stands in for).
pub type Compute<'a> = dyn FnMut() -> Result<Tensor> + 'a;

/// Gives a module's output from its computation: a step cache's hook.
pub type Through<'a> = dyn FnMut(&mut Compute) -> Result<Tensor> + 'a;

/// One forward, as the cache needs to know it.
#[derive(Clone, Copy, Debug)]
pub struct Forward {
    pub pass: Pass,
    /// The scheduler's timestep (PAB's `current_timestep`).
    pub timestep: f64,
}

/// How a step cache reads and rebuilds the state a DiT's blocks thread between whole blocks:
/// as its streams, diffusers' `hidden_states` first (what First Block Cache decides on and
/// MagCache's residual is of), then `encoder_hidden_states` where the blocks return it (whose
/// residual First Block Cache keeps too).
pub trait BlockStreams<S> {
    fn streams(&self, state: &S) -> Result<Vec<Tensor>>;
    /// The state of `streams`, in [`Self::streams`]' order.
    fn state(&self, streams: Vec<Tensor>) -> Result<S>;
}

/// A state that is the hidden states alone (blocks that return no text stream).
pub struct HiddenStates;

impl BlockStreams<Tensor> for HiddenStates {
    fn streams(&self, state: &Tensor) -> Result<Vec<Tensor>> {
        Ok(vec![state.clone()])
    }

    fn state(&self, mut streams: Vec<Tensor>) -> Result<Tensor> {
        streams
            .pop()
            .ok_or_else(|| candle_core::Error::Msg("a block state without streams".into()))
    }
}

/// The blocks a step cache hooks among those a forward folds: diffusers' block lists
/// (`transformer_blocks`, then `single_transformer_blocks` where there are two), `count` blocks
/// from fold position `first` (blocks before it, as HunyuanVideo's token refiner, which
/// diffusers runs inside an embedder, are left to PAB alone, which hooks attention modules by
/// name), `split` of them in the first list, named as `names` says.
#[derive(Clone, Copy, Debug)]
pub struct HookedBlocks {
    pub first: usize,
    pub count: usize,
    pub split: usize,
    pub names: ModuleNames,
}

impl HookedBlocks {
    /// `count` blocks of one list named `names`, from the forward's first block.
    pub fn one_list(count: usize, names: ModuleNames) -> Self {
        HookedBlocks {
            first: 0,
            count,
            split: count,
            names,
        }
    }

    /// diffusers' name of hooked block `i` (in the forward's order).
    pub fn block(&self, i: usize) -> String {
        let lists = self.names.lists;
        let (list, index) = match (lists.len(), self.names.interleaved) {
            (1, _) => (0, i),
            (n, true) => (i % n, i / n),
            (_, false) if i < self.split => (0, i),
            (_, false) => (1, i - self.split),
        };
        format!("{}.{index}", lists[list.min(lists.len() - 1)])
    }

    /// Whether hooked block `i` has `output` ([`ModuleNames::absent`]).
    fn has(&self, i: usize, output: Output) -> bool {
        match (self.names.absent, output) {
            (
                Absent::FeedForwardsAfterFirstList,
                Output::FeedForward | Output::ContextFeedForward,
            ) => i < self.split,
            (Absent::LastContextFeedForward, Output::ContextFeedForward) => i + 1 < self.count,
            _ => true,
        }
    }

    /// Every module these blocks let a step cache hook, by diffusers' names: each block, its
    /// hooked outputs, and the output projection.
    pub fn modules(&self) -> Vec<String> {
        let mut names = Vec::new();
        for i in 0..self.count {
            let block = self.block(i);
            let outputs = self.names.submodules.iter();
            let present = outputs.filter(|(output, _)| self.has(i, *output));
            names.extend(present.map(|(_, s)| format!("{block}.{s}")));
            names.push(block);
        }
        names.push(self.names.proj_out.to_string());
        names
    }

    /// Marks block `i` skipped whole in its record `cells` (the block's own column and those of
    /// the outputs it has).
    fn skip(&self, i: usize, cells: &mut [u8]) {
        cells[0] = 0;
        for (column, (output, _)) in self.names.submodules.iter().enumerate() {
            if self.has(i, *output) {
                cells[column + 1] = 0;
            }
        }
    }
}

/// One pass's state.
#[derive(Default)]
struct PassState {
    /// First Block Cache: the first block's hidden-state residual and its output streams at
    /// the last full step, and the residual of the rest of the blocks then (per stream).
    head_residual: Option<Tensor>,
    head_output: Option<Vec<Tensor>>,
    tail_residual: Option<Vec<Tensor>>,
    /// MagCache: the hidden-state residual of all blocks at the last computed step, and its
    /// accumulators.
    previous_residual: Option<Tensor>,
    accumulated_ratio: f32,
    accumulated_err: f32,
    accumulated_steps: u32,
    step_index: usize,
    calibration: Vec<f32>,
    /// The last complete calibration (what diffusers prints).
    calibrated: Option<Vec<f32>>,
    /// Per forward, 1 for each module that ran: per block the block and its hooked modules,
    /// then the output projection.
    rows: Vec<Vec<u8>>,
}

/// PAB's state of one attention module: calls so far (both passes) and its last output.
#[derive(Default)]
struct Broadcast {
    iteration: u64,
    cached: Option<Tensor>,
}

/// A step cache for one denoising run of one transformer.
pub struct StepCache {
    spec: CacheSpec,
    /// Resampled MagCache ratios.
    ratios: Vec<f32>,
    /// The blocks it hooks, known from the first forward on.
    hooked: Option<HookedBlocks>,
    passes: [PassState; 2],
    /// PAB: per block, the self- and cross-attention states.
    broadcasts: Vec<[Broadcast; 2]>,
    /// TaylorSeer's settings and, per pass, each hooked module's state.
    taylor: Option<TaylorSeer>,
    taylor_states: [std::collections::HashMap<String, Taylor>; 2],
}

/// The hooks of one block in one forward under PAB.
struct PabHooks<'a> {
    config: &'a PabConfig,
    names: ModuleNames,
    timestep: f64,
    states: &'a mut [Broadcast; 2],
    row: &'a mut [u8],
}

impl PabHooks<'_> {
    fn setting(&self, module: Submodule) -> Option<(u32, (f64, f64))> {
        match module {
            Submodule::SelfAttention => self.config.spatial,
            Submodule::TemporalAttention => self.config.spatial.or(self.config.temporal),
            Submodule::CrossAttention => self.config.cross,
            Submodule::UnflaggedCrossAttention => self.config.spatial,
            Submodule::FeedForward | Submodule::ContextFeedForward => None,
        }
    }
}

impl BlockHooks for PabHooks<'_> {
    fn wants(&self, module: Submodule) -> bool {
        self.setting(module).is_some()
    }

    fn output(
        &mut self,
        module: Submodule,
        compute: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        let Some((range, (low, high))) = self.setting(module) else {
            return compute();
        };
        let state = match module {
            Submodule::SelfAttention | Submodule::TemporalAttention => &mut self.states[0],
            _ => &mut self.states[1],
        };
        let inside = low < self.timestep && self.timestep < high;
        // The caller writes into what it gets: the cache keeps storage of its own.
        let (out, kept) = match &state.cached {
            Some(cached)
                if state.iteration != 0 && inside && state.iteration % u64::from(range) != 0 =>
            {
                if let Some(column) = self.names.column(module) {
                    self.row[column] = 0;
                }
                (cached.copy()?, cached.clone())
            }
            _ => {
                let out = compute()?;
                let kept = out.copy()?;
                (out, kept)
            }
        };
        state.cached = Some(kept);
        state.iteration += 1;
        Ok(out)
    }
}

/// Hooks that compute everything (a forward without a cache, and First Block Cache and
/// MagCache, which act between blocks).
pub struct ComputeAll;

impl BlockHooks for ComputeAll {
    fn wants(&self, _: Submodule) -> bool {
        false
    }

    fn output(
        &mut self,
        _: Submodule,
        compute: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        compute()
    }
}

/// TaylorSeer's state of one hooked module in one pass.
#[derive(Default)]
struct Taylor {
    /// Calls so far, less one (diffusers starts at −1 and counts before deciding).
    calls: u64,
    /// The call of the last full computation, and per output its factors F_0.. (in the
    /// factors' dtype).
    last_update: Option<u64>,
    factors: Vec<Vec<Tensor>>,
    /// Each output's shape, dtype and device at its last computation (what a zeroed module
    /// returns zeros of, and the dtype predictions take).
    outputs: Vec<(candle_core::Shape, DType, candle_core::Device)>,
}

/// TaylorSeer's compiled settings.
struct TaylorSeer {
    config: TaylorSeerConfig,
    zeroed: Vec<regex::Regex>,
    predicted: Vec<regex::Regex>,
}

impl TaylorSeer {
    /// Whether `name` is hooked, and whether it returns zeros between full steps.
    fn hooks(&self, name: &str) -> Option<bool> {
        let matches = |list: &[regex::Regex]| list.iter().any(|p| p.is_match(name));
        let zeroed = matches(&self.zeroed);
        (zeroed || matches(&self.predicted)).then_some(zeroed)
    }

    /// The outputs of a hooked module at its next call (a block's are its streams): computed
    /// (and the factors updated) on a full step, else predicted (or zeros); the flag says
    /// whether they were computed.
    fn output(
        &self,
        state: &mut Taylor,
        zeroed: bool,
        compute: &mut dyn FnMut() -> Result<Vec<Tensor>>,
    ) -> Result<(Vec<Tensor>, bool)> {
        let c = &self.config;
        let step = state.calls;
        state.calls += 1;
        let before = c.disable_cache_before_step;
        let full = step < before
            || (step as i64 - before as i64 - 1).rem_euclid(c.cache_interval as i64) == 0
            || c.disable_cache_after_step
                .is_some_and(|after| step >= after);
        if full || state.last_update.is_none() {
            let outs = compute()?;
            state.outputs = outs
                .iter()
                .map(|o| (o.shape().clone(), o.dtype(), o.device().clone()))
                .collect();
            if !zeroed {
                let mut factors = Vec::with_capacity(outs.len());
                for (k, out) in outs.iter().enumerate() {
                    factors.push(self.factors(state, k, out, step)?);
                }
                state.factors = factors;
            }
            state.last_update = Some(step);
            return Ok((outs, true));
        }
        let offset = step - state.last_update.unwrap_or(step);
        if state.outputs.is_empty() {
            candle_core::bail!("TaylorSeer predicts before a full step");
        }
        let mut outs = Vec::with_capacity(state.outputs.len());
        // diffusers takes the number of orders from the first output's factors.
        let orders = state.factors.first().map_or(0, Vec::len);
        for (k, (shape, dtype, device)) in state.outputs.iter().enumerate() {
            let mut out = Tensor::zeros(shape, *dtype, device)?;
            if !zeroed {
                // Σ_j F_j · offset^j / j!, each term in the output's dtype.
                let mut factorial = 1.0f64;
                for order in 0..orders {
                    factorial *= order.max(1) as f64;
                    let coeff = (offset as f64).powi(order as i32) / factorial;
                    let factor = state.factors[k].get(order).ok_or_else(|| {
                        candle_core::Error::Msg("TaylorSeer's outputs hold unequal orders".into())
                    })?;
                    out = (out + factor.to_dtype(*dtype)?.affine(coeff as f32 as f64, 0.0)?)?;
                }
            }
            outs.push(out);
        }
        Ok((outs, false))
    }

    /// The factors of output `k` after a full computation `out` at call `step`: F_0 = `out`,
    /// then the divided differences against the last full step's factors, up to max_order (no
    /// further where a factor's shape changed), stored in the factors' dtype.
    fn factors(&self, state: &Taylor, k: usize, out: &Tensor, step: u64) -> Result<Vec<Tensor>> {
        // The caller writes into `out`: F_0 is a copy (`to_dtype` below keeps the storage
        // where the dtypes agree).
        let mut factors = vec![out.copy()?];
        if let (Some(last), Some(previous)) = (state.last_update, state.factors.get(k)) {
            let delta = (step - last) as f64;
            for j in 0..self.config.max_order {
                let Some(prev) = previous.get(j) else {
                    break;
                };
                if prev.shape() != factors[j].shape() {
                    break;
                }
                let prev = prev.to_dtype(out.dtype())?;
                // A true division, as torch's (candle's `/ f64` multiplies by 1/delta).
                let delta = Tensor::new(delta as f32, out.device())?.to_dtype(out.dtype())?;
                let next = (&factors[j] - prev)?.broadcast_div(&delta)?;
                factors.push(next);
            }
        }
        let dtype = self.config.dtype();
        factors.iter().map(|f| f.to_dtype(dtype)).collect()
    }
}

/// The hooks of one block in one forward under TaylorSeer.
struct TaylorHooks<'a> {
    seer: &'a TaylorSeer,
    hooked: HookedBlocks,
    block: usize,
    states: &'a mut std::collections::HashMap<String, Taylor>,
    row: &'a mut [u8],
}

impl TaylorHooks<'_> {
    /// The module's diffusers name and record column, where the model names it.
    fn name(&self, module: Submodule) -> Option<(String, usize)> {
        let names = &self.hooked.names;
        let column = names.column(module)?;
        let (_, name) = names.submodules[column - 1];
        Some((format!("{}.{name}", self.hooked.block(self.block)), column))
    }
}

impl BlockHooks for TaylorHooks<'_> {
    fn wants(&self, module: Submodule) -> bool {
        self.name(module)
            .is_some_and(|(name, _)| self.seer.hooks(&name).is_some())
    }

    fn output(
        &mut self,
        module: Submodule,
        compute: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        let Some((name, column)) = self.name(module) else {
            return compute();
        };
        let Some(zeroed) = self.seer.hooks(&name) else {
            return compute();
        };
        let state = self.states.entry(name).or_default();
        let (mut outs, computed) = self
            .seer
            .output(state, zeroed, &mut || Ok(vec![compute()?]))?;
        if !computed {
            self.row[column] = 0;
        }
        outs.pop()
            .ok_or_else(|| candle_core::Error::Msg("a hooked module without an output".into()))
    }
}

impl StepCache {
    /// A fresh cache for one transformer's denoising loop; it learns the transformer's blocks
    /// at the first forward.
    pub fn new(spec: &CacheSpec) -> Self {
        let ratios = match spec {
            CacheSpec::Mag(c) => c
                .mag_ratios
                .as_deref()
                .map(|r| resample(r, c.num_inference_steps))
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        let pass = || PassState {
            accumulated_ratio: 1.0,
            ..Default::default()
        };
        let taylor = match spec {
            CacheSpec::TaylorSeer(c) => c.patterns().ok().map(|(zeroed, predicted)| TaylorSeer {
                config: c.clone(),
                zeroed,
                predicted,
            }),
            _ => None,
        };
        StepCache {
            spec: spec.clone(),
            ratios,
            hooked: None,
            passes: [pass(), pass()],
            broadcasts: Vec::new(),
            taylor,
            taylor_states: Default::default(),
        }
    }

    /// The blocks this cache hooks: those of the first forward, which every later forward
    /// must have.
    fn hook(&mut self, hooked: HookedBlocks) -> Result<HookedBlocks> {
        match self.hooked {
            None => {
                self.hooked = Some(hooked);
                let folded = hooked.first + hooked.count;
                self.broadcasts = (0..folded).map(|_| Default::default()).collect();
            }
            Some(known) if known.first != hooked.first || known.count != hooked.count => {
                candle_core::bail!(
                    "a step cache of {} blocks handed a transformer of {}",
                    known.count,
                    hooked.count
                )
            }
            Some(_) => {}
        }
        Ok(hooked)
    }

    /// One forward's blocks under the cache: `fold(x, f)` folds `f` over the blocks in order
    /// (resident or streamed), `run(block, x, hooks)` runs one, asking `hooks` for each hooked
    /// output; `hooked` says which of the folded blocks the cache hooks and `streams` how their
    /// state splits. Gives the state after the blocks, computed or stood in for as diffusers'
    /// hooks do.
    pub fn through_blocks<B, S: Clone>(
        &mut self,
        forward: Forward,
        x: S,
        hooked: HookedBlocks,
        streams: &dyn BlockStreams<S>,
        fold: impl FnOnce(S, &mut dyn FnMut(&B, &S) -> Result<S>) -> Result<S>,
        run: impl Fn(&B, &S, &mut dyn BlockHooks) -> Result<S>,
    ) -> Result<S> {
        let hooked = self.hook(hooked)?;
        let pass = forward.pass;
        let (num_blocks, per_block) = (hooked.count, 1 + hooked.names.submodules.len());
        let mut row = vec![1u8; num_blocks * per_block + 1];
        let threshold = match &self.spec {
            CacheSpec::FirstBlock { threshold } => Some(*threshold),
            _ => None,
        };
        let (pab, mag) = match &self.spec {
            CacheSpec::Pab(c) => (Some(c), None),
            CacheSpec::Mag(c) => (None, Some(c)),
            _ => (None, None),
        };
        let ratios = &self.ratios;
        let state = &mut self.passes[pass as usize];
        let broadcasts = &mut self.broadcasts;
        let taylor = self.taylor.as_ref();
        let taylor_states = &mut self.taylor_states[pass as usize];
        let (mut position, mut skipped, mut mag_skipped) = (0usize, false, false);
        let (mut head_output, mut head_residual, mut head_input) = (None, None, None);
        // MagCache decides at the first hooked block's input: where that is the forward's own,
        // a skipped forward folds no block at all (a streamed one is not even copied).
        if let (0, Some(c)) = (hooked.first, mag) {
            let mut input = streams.streams(&x)?;
            if let Some(hidden) = state.mag_skip(c, ratios, &input[0])? {
                for (i, cells) in row.chunks_mut(per_block).take(num_blocks).enumerate() {
                    hooked.skip(i, cells);
                }
                state.rows.push(row);
                state.advance(c);
                input[0] = hidden;
                return streams.state(input);
            }
            head_input = Some(input.swap_remove(0));
        }
        let mut f = |block: &B, x: &S| -> Result<S> {
            let Some(i) = position.checked_sub(hooked.first) else {
                // Unhooked by the block hooks; PAB hooks attention modules by name wherever
                // they are (HunyuanVideo's token refiner's `refiner_blocks.N.attn`), unrecorded.
                let states = &mut broadcasts[position];
                position += 1;
                return match pab {
                    Some(config) => run(
                        block,
                        x,
                        &mut PabHooks {
                            config,
                            names: hooked.names,
                            timestep: forward.timestep,
                            states,
                            row: &mut [1; 4],
                        },
                    ),
                    None => run(block, x, &mut ComputeAll),
                };
            };
            position += 1;
            if i >= num_blocks {
                candle_core::bail!("a step cache of {num_blocks} blocks handed more");
            }
            if skipped {
                hooked.skip(i, &mut row[i * per_block..(i + 1) * per_block]);
                return Ok(x.clone());
            }
            if let (0, Some(c), None) = (i, mag, &head_input) {
                let mut input = streams.streams(x)?;
                if let Some(hidden) = state.mag_skip(c, ratios, &input[0])? {
                    skipped = true;
                    mag_skipped = true;
                    hooked.skip(0, &mut row[..per_block]);
                    input[0] = hidden;
                    return streams.state(input);
                }
                head_input = Some(input.swap_remove(0));
            }
            let cells = &mut row[i * per_block..(i + 1) * per_block];
            let out = match (pab, taylor) {
                (Some(config), _) => {
                    let mut hooks = PabHooks {
                        config,
                        names: hooked.names,
                        timestep: forward.timestep,
                        states: &mut broadcasts[hooked.first + i],
                        row: cells,
                    };
                    run(block, x, &mut hooks)?
                }
                (None, Some(seer)) => {
                    let name = hooked.block(i);
                    let mode = seer.hooks(&name);
                    let mut block_state = taylor_states.remove(&name).unwrap_or_default();
                    let mut compute = || {
                        let mut hooks = TaylorHooks {
                            seer,
                            hooked,
                            block: i,
                            states: &mut *taylor_states,
                            row: &mut *cells,
                        };
                        streams.streams(&run(block, x, &mut hooks)?)
                    };
                    let out = match mode {
                        Some(zeroed) => {
                            let (out, computed) =
                                seer.output(&mut block_state, zeroed, &mut compute)?;
                            if !computed {
                                hooked.skip(i, cells);
                            }
                            out
                        }
                        None => compute()?,
                    };
                    if mode.is_some() {
                        taylor_states.insert(name, block_state);
                    }
                    streams.state(out)?
                }
                (None, None) => run(block, x, &mut ComputeAll)?,
            };
            if let (0, Some(threshold)) = (i, threshold) {
                let output = streams.streams(&out)?;
                let residual = (&output[0] - &streams.streams(x)?[0])?;
                let compute = match &state.head_residual {
                    None => true,
                    Some(prev) => relative_change(&residual, prev)? > threshold,
                };
                if !compute {
                    skipped = true;
                    let tail = state.tail_residual.as_ref().ok_or_else(|| {
                        candle_core::Error::Msg("first-block cache without a tail residual".into())
                    })?;
                    return streams.state(zip_streams(tail, &output, |t, o| t + o)?);
                }
                head_residual = Some(residual);
                head_output = Some(output);
            }
            Ok(out)
        };
        let out = fold(x, &mut f)?;
        if position != hooked.first + num_blocks {
            candle_core::bail!(
                "a step cache of {num_blocks} blocks from position {} handed {position} (block steps streamed apart are not whole blocks)",
                hooked.first
            );
        }
        let state = &mut self.passes[pass as usize];
        state.rows.push(row);
        match &self.spec {
            CacheSpec::FirstBlock { .. } if !skipped => {
                let head = head_output.ok_or_else(|| {
                    candle_core::Error::Msg("a transformer without blocks".into())
                })?;
                state.tail_residual =
                    Some(zip_streams(&streams.streams(&out)?, &head, |o, h| o - h)?);
                state.head_output = Some(head);
                state.head_residual = head_residual;
            }
            CacheSpec::Mag(c) => {
                if !mag_skipped {
                    let input = head_input.ok_or_else(|| {
                        candle_core::Error::Msg("a transformer without blocks".into())
                    })?;
                    let residual = (&streams.streams(&out)?[0] - &input)?;
                    if c.calibrate {
                        let ratio = match &state.previous_residual {
                            None => 1.0,
                            Some(prev) => norm_ratio(&residual, prev)?,
                        };
                        state.calibration.push(ratio);
                    }
                    state.previous_residual = Some(residual);
                }
                state.advance(c);
            }
            _ => {}
        }
        Ok(out)
    }

    /// The output projection of a forward (after [`Self::through_blocks`]): computed by
    /// `compute`, or TaylorSeer's stand-in where it hooks it.
    pub fn project(
        &mut self,
        forward: Forward,
        compute: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (Some(seer), Some(hooked)) = (&self.taylor, self.hooked) else {
            return compute();
        };
        let name = hooked.names.proj_out;
        let Some(zeroed) = seer.hooks(name) else {
            return compute();
        };
        let pass = forward.pass as usize;
        let state = self.taylor_states[pass]
            .entry(name.to_string())
            .or_default();
        let (mut outs, computed) = seer.output(state, zeroed, &mut || Ok(vec![compute()?]))?;
        let out = outs
            .pop()
            .ok_or_else(|| candle_core::Error::Msg("proj_out without an output".into()))?;
        if let (false, Some(row)) = (computed, self.passes[pass].rows.last_mut()) {
            if let Some(cell) = row.last_mut() {
                *cell = 0;
            }
        }
        Ok(out)
    }

    /// Which modules ran in each forward of `pass`, as diffusers' fixtures record it: u8
    /// `[forwards, num_blocks · modules_per_block + 1]`, per block the block then its hooked
    /// modules, then the output projection (which always runs); 1 where it ran.
    pub fn computed(&self, pass: Pass) -> Result<Tensor> {
        let rows = &self.passes[pass as usize].rows;
        let columns = self
            .hooked
            .map_or(1, |h| h.count * (1 + h.names.submodules.len()) + 1);
        let flat: Vec<u8> = rows.iter().flatten().copied().collect();
        Tensor::from_vec(flat, (rows.len(), columns), &candle_core::Device::Cpu)
    }

    /// What `--stats-json` reports: the hook, and per pass the forwards run, those in which
    /// the cache stood in for something, and the modules it stood in for.
    pub fn report(&self) -> serde_json::Value {
        let pass = |p: Pass| {
            let rows = &self.passes[p as usize].rows;
            let skipped = |row: &Vec<u8>| row.iter().filter(|&&c| c == 0).count();
            serde_json::json!({
                "forwards": rows.len(),
                "forwards_with_skips": rows.iter().filter(|r| skipped(r) > 0).count(),
                "modules_skipped": rows.iter().map(skipped).sum::<usize>(),
            })
        };
        serde_json::json!({
            "hook": self.spec.name(),
            "cond": pass(Pass::Cond),
            "uncond": pass(Pass::Uncond),
        })
    }

    /// Whether the loop ran unconditional forwards apart (guidance not batched with the
    /// conditional ones).
    pub fn guided(&self) -> bool {
        !self.passes[Pass::Uncond as usize].rows.is_empty()
    }

    /// The progress line of a finished loop: the hook and, per pass, the forwards in which it
    /// stood in for something and the modules it stood in for.
    pub fn summary(&self) -> String {
        let pass = |p: Pass, name: &str| {
            let rows = &self.passes[p as usize].rows;
            let skipped = |row: &Vec<u8>| row.iter().filter(|&&c| c == 0).count();
            let modules: usize = rows.iter().map(|r| r.len()).sum();
            format!(
                "{name}: {} of {} forwards skipped work, {} of {modules} modules stood in for",
                rows.iter().filter(|r| skipped(r) > 0).count(),
                rows.len(),
                rows.iter().map(skipped).sum::<usize>(),
            )
        };
        let mut line = format!("  cache {}: {}", self.spec.name(), pass(Pass::Cond, "cond"));
        if self.guided() {
            line += &format!("; {}", pass(Pass::Uncond, "uncond"));
        }
        line
    }

    /// The calibrated MagCache ratios of `pass` (the last complete run, else those so far).
    pub fn calibration(&self, pass: Pass) -> Option<Vec<f32>> {
        let CacheSpec::Mag(c) = &self.spec else {
            return None;
        };
        let state = &self.passes[pass as usize];
        c.calibrate.then(|| {
            state
                .calibrated
                .clone()
                .unwrap_or_else(|| state.calibration.clone())
        })
    }
}

impl PassState {
    /// MagCache's decision at the first hooked block, whose input's hidden states are
    /// `hidden`: the hidden states after the blocks when this forward is skipped (the input
    /// plus the last computed residual), else `None`.
    fn mag_skip(
        &mut self,
        c: &MagCacheConfig,
        ratios: &[f32],
        hidden: &Tensor,
    ) -> Result<Option<Tensor>> {
        if c.calibrate {
            return Ok(None);
        }
        let step = self.step_index;
        let retention = (c.retention_ratio * c.num_inference_steps as f64 + 0.5) as usize;
        if step < retention {
            return Ok(None);
        }
        let scale = ratios.get(step).copied().unwrap_or(1.0);
        self.accumulated_ratio *= scale;
        self.accumulated_steps += 1;
        self.accumulated_err += (1.0 - self.accumulated_ratio).abs();
        match &self.previous_residual {
            Some(residual)
                if self.accumulated_err <= c.threshold as f32
                    && self.accumulated_steps <= c.max_skip_steps =>
            {
                Ok(Some((hidden + residual)?))
            }
            _ => {
                self.accumulated_ratio = 1.0;
                self.accumulated_steps = 0;
                self.accumulated_err = 0.0;
                Ok(None)
            }
        }
    }

    /// MagCache's step counter, starting over after `num_inference_steps` forwards.
    fn advance(&mut self, c: &MagCacheConfig) {
        self.step_index += 1;
        if self.step_index >= c.num_inference_steps {
            if c.calibrate {
                self.calibrated = Some(std::mem::take(&mut self.calibration));
            }
            self.step_index = 0;
            self.accumulated_ratio = 1.0;
            self.accumulated_steps = 0;
            self.accumulated_err = 0.0;
            self.previous_residual = None;
            self.calibration.clear();
        }
    }
}

/// Two states' streams combined stream by stream.
fn zip_streams(
    a: &[Tensor],
    b: &[Tensor],
    f: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    if a.len() != b.len() {
        candle_core::bail!("block states of {} and {} streams", a.len(), b.len());
    }
    a.iter().zip(b).map(|(a, b)| f(a, b)).collect()
}

/// `mean|a − b| / mean|b|`, in f32 as diffusers computes it.
fn relative_change(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(DType::F32)?;
    let b = b.to_dtype(DType::F32)?;
    let change = (&a - &b)?.abs()?.mean_all()?.to_scalar::<f32>()?;
    let size = b.abs()?.mean_all()?.to_scalar::<f32>()?;
    Ok(f64::from(change / size))
}

/// The mean over tokens of ‖residual‖ / (‖previous‖ + 1e-8), norms over channels, in f32.
fn norm_ratio(residual: &Tensor, previous: &Tensor) -> Result<f32> {
    let norm =
        |t: &Tensor| -> Result<Tensor> { t.to_dtype(DType::F32)?.sqr()?.sum(D::Minus1)?.sqrt() };
    let ratio = (norm(residual)? / (norm(previous)? + 1e-8)?)?;
    ratio.mean_all()?.to_scalar::<f32>()
}

/// A hook for the models' tests: each module's first output computed and kept, every later
/// one the kept output (PAB's reuse, every call after the first), with the modules asked.
#[cfg(all(test, feature = "cuda"))]
#[derive(Default)]
pub(crate) struct ReplayHooks {
    pub kept: Vec<(Submodule, Tensor)>,
    pub asked: Vec<Submodule>,
}

#[cfg(all(test, feature = "cuda"))]
impl BlockHooks for ReplayHooks {
    fn wants(&self, _: Submodule) -> bool {
        true
    }

    fn output(
        &mut self,
        module: Submodule,
        compute: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.asked.push(module);
        if let Some((_, kept)) = self.kept.iter().find(|(m, _)| *m == module) {
            return kept.copy();
        }
        let out = compute()?;
        self.kept.push((module, out.copy()?));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_resample_half_to_even_as_diffusers() {
        // 16 → 11: k = 3 maps to 4.5 → 4, k = 7 to 10.5 → 10.
        let ratios: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let got = resample(&ratios, 11);
        assert_eq!(got[3], 4.0);
        assert_eq!(got[7], 10.0);
        assert_eq!(got[10], 15.0);
    }

    #[test]
    fn specs_parse_as_diffusers_fields_and_refuse_the_rest() {
        assert_eq!(
            CacheSpec::parse("first-block:0.3"),
            Ok(CacheSpec::FirstBlock { threshold: 0.3 })
        );
        assert_eq!(
            CacheSpec::parse("first-block:threshold=0.3"),
            Ok(CacheSpec::FirstBlock { threshold: 0.3 })
        );
        let CacheSpec::Mag(c) =
            CacheSpec::parse("magcache:threshold=0.03,num_inference_steps=11,mag_ratios=1.0;0.5")
                .unwrap()
        else {
            panic!("magcache")
        };
        assert_eq!((c.threshold, c.num_inference_steps), (0.03, 11));
        assert_eq!(c.mag_ratios, Some(vec![1.0, 0.5]));
        assert_eq!(c.max_skip_steps, 3);
        for bad in [
            "magcache:threshold=0.1",
            "magcache:ratio=1",
            "first-block:nan",
            "teacache:0.1",
            "taylorseer:max_order=x",
            "pab:spatial_attention_timestep_skip_range=1",
        ] {
            assert!(CacheSpec::parse(bad).is_err(), "{bad}");
        }
    }
}
