//! The memory plan: the device bytes of every stage, predicted from the model's configs and the
//! resolved options alone, so `--dry-run` shows what a run needs before anything loads and an
//! out-of-memory error can name option sets that fit.
//!
//! Planning is generic: a pipeline gives its stages (the components each uses, which load before
//! it and which are freed after it, and the activations it holds) and each component's device
//! weights as the offload engine would hold them ([`DeviceWeights`], counted by running the
//! model constructors through the engine's recorder, never by formula).
//!
//! The activation estimates were checked against the CUDA pool's high-water marks on an H200
//! (synthetic 1.3B, bf16, lazy load so that each stage holds only its own component, chunked
//! attention; the 14B figure from bench/RESULTS.md). GiB above the weights, predicted / measured:
//!
//! | frames x height x width | encode_text | denoise | decode |
//! |---|---|---|---|
//! | 81 x 480 x 832 | 0.29 / 0.29 | 2.21 / 2.16 (14B: 5.21 / 5.18) | 7.56 / 7.6, tiled 2.34 / 2.00 |
//! | 41 x 480 x 832 | | 1.19 / 1.16 | 7.38 / 7.42 |
//! | 49 x 320 x 576 | | 0.88 / 0.86 | 3.56 / 3.58 |
//! | 33 x 240 x 416 | | 0.65 / 0.65 | 2.02 / 2.05 |
//! | 21 x 720 x 1280 | | 1.46 / 1.42 | tiled 1.82 / 1.67 |

use super::options::MemoryOptions;
use super::overrides::apply_memory_rules;
use super::probe::DeviceInfo;
use crate::offload::DeviceWeights;

const GIB: u64 = 1 << 30;

/// Bytes as GiB, for people.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB as f64
}

/// Device memory a run needs beyond its tensors: the CUDA context and library workspaces.
const CONTEXT_BYTES: u64 = GIB;

/// The part of [`CONTEXT_BYTES`] the CUDA context itself takes when the device opens (0.51 GiB
/// on an H200): the free memory a run fits to is read after that, so it lacks it already.
const OPENED_CONTEXT_BYTES: u64 = GIB / 2;

/// One stage as the plan sees it.
#[derive(Clone, Debug)]
pub struct PlanStage<'a> {
    pub name: &'static str,
    /// Components computing in the stage (indices into the weights given with it).
    pub uses: &'a [usize],
    /// Components loaded just before it.
    pub load_before: &'a [usize],
    /// Components freed just after it.
    pub release_after: &'a [usize],
    /// Activations and scratch of the stage's computation.
    pub activation_bytes: u64,
    /// Activations while a used component's outer part computes apart from its blocks (the
    /// moment of [`DeviceWeights::apart`]); `None`: `activation_bytes` then too.
    pub apart_activation_bytes: Option<u64>,
    /// Host bytes the stage holds beyond the components' weights: what it computes on the CPU,
    /// the decoded video.
    pub host_activation_bytes: u64,
}

/// What the components hold in host memory.
#[derive(Clone, Copy, Debug)]
pub struct HostSide<'a> {
    /// Each component's host bytes for as long as it is loaded.
    pub weights: &'a [u64],
    /// The device's memory is host memory (unified memory, or no accelerator): every device
    /// byte of the plan is a host byte too.
    pub shared: bool,
}

/// The predicted device bytes of one stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePlan {
    pub name: &'static str,
    /// Weights of every component alive in the stage (those computing and those waiting), at
    /// its peak moment (a streamed DiT's blocks running, or its outer part computing).
    pub weight_bytes: u64,
    /// Activations and scratch of the components computing, at that moment.
    pub activation_bytes: u64,
    /// Weights plus activations.
    pub peak_bytes: u64,
    /// Host bytes at the stage's peak: the loaded components' host weights and the stage's host
    /// activations (with a shared pool, its device bytes too).
    pub host_bytes: u64,
}

impl StagePlan {
    /// Device bytes the stage needs in all: its peak, the allocator's slack (the CUDA pool held
    /// up to two fifths more than the activations used in the measurements) and the context.
    pub fn required_bytes(&self) -> u64 {
        Self::required(self.peak_bytes, self.activation_bytes).unwrap_or(u64::MAX)
    }

    /// [`StagePlan::required_bytes`] in checked arithmetic (`None`: beyond 2^64 bytes).
    fn required(peak: u64, activations: u64) -> Option<u64> {
        peak.checked_add(activations / 5 * 2 + activations % 5 * 2 / 5)?
            .checked_add(CONTEXT_BYTES)
    }
}

/// The predicted device bytes of every stage of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    pub stages: Vec<StagePlan>,
}

impl MemoryPlan {
    /// Plans `stages`: in each, the components alive hold their active weights if the stage
    /// uses them, their idle weights otherwise (`weights[i]` is component i's). Sums are
    /// checked: a plan beyond 2^64 bytes (sizes no machine has) is an error, never a wrapped
    /// figure that would look small.
    pub fn new(stages: &[PlanStage], weights: &[DeviceWeights]) -> anyhow::Result<Self> {
        let none = vec![0; weights.len()];
        let host = HostSide {
            weights: &none,
            shared: false,
        };
        Self::with_host(stages, weights, host)
    }

    /// [`MemoryPlan::new`] with the host bytes of every stage from `host`: the host weights of
    /// every component loaded, whether or not it computes, and the stage's host activations.
    pub fn with_host(
        stages: &[PlanStage],
        weights: &[DeviceWeights],
        host: HostSide,
    ) -> anyhow::Result<Self> {
        let mut alive: Vec<usize> = Vec::new();
        let mut planned = Vec::with_capacity(stages.len());
        for stage in stages {
            for &c in stage.load_before.iter().chain(stage.uses) {
                if !alive.contains(&c) {
                    alive.push(c);
                }
            }
            let overflow = || {
                anyhow::anyhow!(
                    "the memory plan of stage {} is beyond 2^64 bytes: a size in the configs or the options is larger than any machine",
                    stage.name
                )
            };
            // The weights held while the used components' blocks run, or (`apart`) while their
            // outer parts compute.
            let held = |apart: bool| {
                alive
                    .iter()
                    .map(|&c| match (stage.uses.contains(&c), weights[c].apart) {
                        (true, Some(w)) if apart => w,
                        (true, _) => weights[c].active,
                        (false, _) => weights[c].idle,
                    })
                    .try_fold(0u64, u64::checked_add)
                    .ok_or_else(overflow)
            };
            let mut moment = (held(false)?, stage.activation_bytes);
            if stage.uses.iter().any(|&c| weights[c].apart.is_some()) {
                let apart = (
                    held(true)?,
                    stage
                        .apart_activation_bytes
                        .unwrap_or(stage.activation_bytes),
                );
                let bytes = |(w, a): (u64, u64)| w.checked_add(a).ok_or_else(overflow);
                if bytes(apart)? > bytes(moment)? {
                    moment = apart;
                }
            }
            let (weight_bytes, activation_bytes) = moment;
            let peak_bytes = weight_bytes
                .checked_add(activation_bytes)
                .ok_or_else(overflow)?;
            StagePlan::required(peak_bytes, activation_bytes).ok_or_else(overflow)?;
            let host_bytes = alive
                .iter()
                .map(|&c| host.weights[c])
                .chain([
                    stage.host_activation_bytes,
                    if host.shared { peak_bytes } else { 0 },
                ])
                .try_fold(0u64, u64::checked_add)
                .ok_or_else(overflow)?;
            alive.retain(|c| !stage.release_after.contains(c));
            planned.push(StagePlan {
                name: stage.name,
                weight_bytes,
                activation_bytes,
                peak_bytes,
                host_bytes,
            });
        }
        Ok(MemoryPlan { stages: planned })
    }

    /// The stage with the highest peak (the first of equals).
    pub fn peak(&self) -> Option<&StagePlan> {
        self.stages.iter().reduce(|best, s| {
            if s.peak_bytes > best.peak_bytes {
                s
            } else {
                best
            }
        })
    }

    /// The stage called `name`.
    pub fn stage(&self, name: &str) -> Option<&StagePlan> {
        self.stages.iter().find(|s| s.name == name)
    }

    /// Device bytes the run needs in all: the most any stage needs.
    pub fn required_bytes(&self) -> u64 {
        self.stages
            .iter()
            .map(StagePlan::required_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Whether every stage is predicted to fit in a device of `total` bytes.
    pub fn fits(&self, total: u64) -> bool {
        self.required_bytes() <= total
    }

    /// Device bytes the run needs free once this process's context exists: [`Self::required_bytes`]
    /// less the part of the context already open (which the free memory lacks already).
    pub fn required_free_bytes(&self) -> u64 {
        self.required_bytes().saturating_sub(OPENED_CONTEXT_BYTES)
    }

    /// Whether every stage is predicted to fit in `free` bytes read once this process's context
    /// exists.
    pub fn fits_free(&self, free: u64) -> bool {
        self.required_free_bytes() <= free
    }

    /// The stage with the highest host peak (the first of equals).
    pub fn host_peak(&self) -> Option<&StagePlan> {
        self.stages.iter().reduce(|best, s| {
            if s.host_bytes > best.host_bytes {
                s
            } else {
                best
            }
        })
    }

    /// Host bytes the run holds at most.
    pub fn host_required_bytes(&self) -> u64 {
        self.host_peak().map_or(0, |s| s.host_bytes)
    }

    /// Whether every stage is predicted to fit in `budget` bytes of host memory.
    pub fn fits_host(&self, budget: u64) -> bool {
        self.host_required_bytes() <= budget
    }

    /// "61.70 GiB in denoise", of host memory.
    pub fn describe_host_peak(&self) -> String {
        match self.host_peak() {
            Some(s) => format!("{:.2} GiB in {}", gib(s.host_bytes), s.name),
            None => "nothing".into(),
        }
    }

    /// Whether `other` predicts the same device bytes for every stage (host bytes aside).
    fn same_device(&self, other: &MemoryPlan) -> bool {
        let device = |p: &MemoryPlan| -> Vec<(u64, u64)> {
            p.stages
                .iter()
                .map(|s| (s.weight_bytes, s.activation_bytes))
                .collect()
        };
        device(self) == device(other)
    }

    /// "31.79 GiB in denoise".
    pub fn describe_peak(&self) -> String {
        match self.peak() {
            Some(s) => format!("{:.2} GiB in {}", gib(s.peak_bytes), s.name),
            None => "nothing".into(),
        }
    }
}

/// An option set the out-of-memory advice weighs: the flags that differ from the run's, and
/// the plan under them.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub flags: Vec<String>,
    pub plan: MemoryPlan,
    /// The options and frames it plans.
    pub request: Request,
}

/// A memory saving the advice can add: its flag, the options it sets or overrules (as `given`
/// names them), how to turn it on and whether it is on, and what it changes in the output
/// beside the memory, if anything.
struct Saving {
    flag: &'static str,
    options: &'static [&'static str],
    turn_on: fn(&mut MemoryOptions),
    is_on: fn(&MemoryOptions) -> bool,
    caveat: Option<&'static str>,
}

impl Saving {
    /// Whether the user set an option this saving would change.
    fn is_kept(&self, kept: &dyn Fn(&str) -> bool) -> bool {
        self.options.iter().any(|o| kept(o))
    }
}

const LAZY_LOAD: Saving = Saving {
    flag: "--lazy-module-load",
    options: &["lazy_module_load"],
    turn_on: |o| o.lazy_module_load = Some(true),
    is_on: |o| o.lazy(),
    caveat: None,
};

/// The VAE tiles (pixels) the last saving decodes in: half diffusers' default, the same
/// overlap ratio.
pub const SMALL_VAE_TILE: u32 = 128;

/// The savings of device memory in the order the advice adds them: the cheapest in speed first,
/// and those that change the frames last.
const SAVINGS: [Saving; 8] = [
    Saving {
        flag: "--dit-layerwise-offload",
        options: &["dit_layerwise_offload"],
        turn_on: |o| o.dit_layerwise_offload = true,
        is_on: |o| o.dit_layerwise_offload,
        caveat: None,
    },
    Saving {
        flag: "--offload-type leaf-level",
        options: &["offload_type"],
        turn_on: |o| o.leaf_level = true,
        is_on: |o| o.leaf_level,
        caveat: None,
    },
    Saving {
        flag: "--text-encoder-cpu-offload",
        options: &["text_encoder_cpu_offload"],
        turn_on: |o| o.text_encoder_cpu_offload = true,
        is_on: |o| o.text_encoder_cpu_offload,
        caveat: None,
    },
    LAZY_LOAD,
    Saving {
        flag: "--vae-tiling",
        options: &["vae_tiling"],
        turn_on: |o| o.vae_tiling = true,
        is_on: |o| o.vae_tiling,
        caveat: None,
    },
    Saving {
        flag: "--low-activation",
        options: &["low_activation"],
        turn_on: |o| o.low_activation = true,
        is_on: |o| o.low_activation,
        caveat: None,
    },
    Saving {
        flag: "--no-offload-stream",
        options: &["offload_stream"],
        turn_on: |o| o.offload_stream = false,
        is_on: |o| !o.offload_stream,
        caveat: None,
    },
    Saving {
        flag: "--vae-tile-size 128",
        // The tiles of the VAE tiling above: with tiling off (kept by the user) they change no
        // stage, so they are not offered.
        options: &["vae_tile_size"],
        turn_on: |o| o.vae_tile_size = Some(SMALL_VAE_TILE),
        is_on: |o| o.vae_tiling && o.vae_tile_size.is_some_and(|px| px <= SMALL_VAE_TILE),
        caveat: Some(
            "128 px VAE tiles blend more seams than diffusers' default 256 px tiles: the frames differ slightly",
        ),
    },
];

const SEQUENTIAL_LOAD: Saving = Saving {
    flag: "--h3-sequential-load",
    options: &["h3_sequential_load"],
    turn_on: |o| o.h3_sequential_load = Some(true),
    is_on: |o| o.sequential(),
    caveat: None,
};

/// The pinned staging ring a host too small to pin every offloaded weight gets: the size the
/// README's example gives.
pub const BOUNDED_PINNED_BYTES: u64 = 2 * GIB;

const BOUNDED_PINNED: Saving = Saving {
    flag: "--max-pinned-memory 2GiB",
    options: &["max_pinned_memory", "pin_cpu_memory"],
    turn_on: |o| o.max_pinned_memory = Some(BOUNDED_PINNED_BYTES),
    is_on: |o| o.max_pinned_memory.is_some(),
    caveat: None,
};

/// The option sets that lower what a run holds in host memory, the cheapest in speed first:
/// the encoder freed before the rest loads; every component loaded for its stages alone; each
/// with the weights left in the memory map (where the kernel can drop and reread their pages)
/// and a bounded pinned staging ring instead of page-locked images.
const HOST_SAVINGS: [&[Saving]; 4] = [
    &[SEQUENTIAL_LOAD],
    &[LAZY_LOAD],
    &[SEQUENTIAL_LOAD, BOUNDED_PINNED],
    &[LAZY_LOAD, BOUNDED_PINNED],
];

/// The flags of the savings the advice may not change because `kept` names their options (the
/// user set them).
pub fn kept_savings(kept: &dyn Fn(&str) -> bool) -> Vec<&'static str> {
    SAVINGS
        .iter()
        .filter(|s| s.is_kept(kept))
        .map(|s| s.flag)
        .collect()
}

/// The flags of the host savings `kept` keeps from changing.
pub fn kept_host_savings(kept: &dyn Fn(&str) -> bool) -> Vec<&'static str> {
    [SEQUENTIAL_LOAD, LAZY_LOAD, BOUNDED_PINNED]
        .iter()
        .filter(|s| s.is_kept(kept))
        .map(|s| s.flag)
        .collect()
}

/// What the advice varies: the memory options and the number of frames.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub options: MemoryOptions,
    pub num_frames: u32,
    /// The family's frame counts are `frame_step·k + 1` (its frame rule): fewer frames are
    /// offered in those steps.
    pub frame_step: u32,
}

/// A pipeline's memory plan for a request (an error where the options cannot be placed).
pub type PlanFor<'a> = &'a dyn Fn(&Request) -> anyhow::Result<MemoryPlan>;

/// Option sets from the run's own, each adding one saving to the previous (DiT layerwise
/// offload, step-by-step streaming, text encoder offload, lazy load, VAE tiling; none that sets
/// an option `kept` names), then, when the device size is known, with the most frames (fewer
/// than asked) that fit. Each set goes through the device's memory rules, so a saving the
/// device would undo (host offload on unified memory) is not offered, and a set is offered only
/// if it needs less than the last.
pub fn candidates(
    request: &Request,
    device: &DeviceInfo,
    plan_for: PlanFor,
    total: Option<u64>,
    kept: &dyn Fn(&str) -> bool,
) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = Vec::new();
    let mut next = request.clone();
    let mut current = plan_for(request).ok();
    let mut least = current.as_ref().map_or(u64::MAX, |p| p.required_bytes());
    // Offers `candidate` with `plan` if it needs less than the last offer, without the savings
    // it does not need for that.
    let mut offer = |candidate: &Request, plan: MemoryPlan| {
        if plan.required_bytes() >= least {
            return;
        }
        let (candidate, plan) = needed_savings(request, candidate, plan, device, plan_for);
        let flags = changed_flags(request, &candidate);
        if !flags.is_empty() {
            least = plan.required_bytes();
            out.push(Candidate {
                flags,
                plan,
                request: candidate,
            });
        }
    };
    for saving in SAVINGS.iter().filter(|s| !s.is_kept(kept)) {
        let mut tried = next.clone();
        (saving.turn_on)(&mut tried.options);
        apply_memory_rules(&mut tried.options, device);
        // A saving that changes no stage here (e.g. step-by-step streaming with nothing
        // streamed) is left out; one that lowers a stage that is not the peak is kept, as a
        // later saving may make that stage the peak.
        if let Ok(after) = plan_for(&tried) {
            if !current.as_ref().is_some_and(|c| c.same_device(&after)) {
                next = tried;
                current = Some(after.clone());
                offer(&next, after);
            }
        }
    }
    if let Some(total) = total {
        // Frames come as step·k+1 (the family's rule); take the largest k below the run's that
        // fits, else one frame.
        let step = request.frame_step.max(1);
        for k in (0..request.num_frames.saturating_sub(1) / step).rev() {
            next.num_frames = step * k + 1;
            if let Ok(plan) = plan_for(&next) {
                if k == 0 || plan.fits(total) {
                    offer(&next, plan);
                    break;
                }
            }
        }
    }
    out
}

/// `candidate` (`request` with some savings turned on, `plan` its plan) without those of its
/// savings it needs no more: from the costliest (the last in [`SAVINGS`]) on, each is left out
/// where the plan without it needs no more device memory. A saving that lowered a stage which a
/// later one left below the peak then costs the run nothing (e.g. low activation where the
/// peak moved to the decode).
fn needed_savings(
    request: &Request,
    candidate: &Request,
    plan: MemoryPlan,
    device: &DeviceInfo,
    plan_for: PlanFor,
) -> (Request, MemoryPlan) {
    let mut added: Vec<&Saving> = SAVINGS
        .iter()
        .filter(|s| (s.is_on)(&candidate.options) && !(s.is_on)(&request.options))
        .collect();
    let (mut kept, mut plan) = (candidate.clone(), plan);
    for k in (0..added.len()).rev() {
        let mut without = Request {
            options: request.options.clone(),
            ..candidate.clone()
        };
        for (i, saving) in added.iter().enumerate() {
            if i != k {
                (saving.turn_on)(&mut without.options);
            }
        }
        apply_memory_rules(&mut without.options, device);
        if let Ok(lighter) = plan_for(&without) {
            if lighter.required_bytes() <= plan.required_bytes() {
                added.remove(k);
                (kept, plan) = (without, lighter);
            }
        }
    }
    (kept, plan)
}

/// What the savings that turn the options `from` into `to` change in the output beside the
/// memory.
pub fn caveats(from: &MemoryOptions, to: &MemoryOptions) -> Vec<&'static str> {
    SAVINGS
        .iter()
        .filter(|s| (s.is_on)(to) && !(s.is_on)(from))
        .filter_map(|s| s.caveat)
        .collect()
}

/// The flags that turn `from` into `to`, among those the advice changes.
fn changed_flags(from: &Request, to: &Request) -> Vec<String> {
    let mut flags: Vec<String> = SAVINGS
        .iter()
        .chain([&SEQUENTIAL_LOAD, &BOUNDED_PINNED])
        .filter(|s| (s.is_on)(&to.options) && !(s.is_on)(&from.options))
        .map(|s| s.flag.to_string())
        .collect();
    if to.num_frames != from.num_frames {
        flags.push(format!("--num-frames {}", to.num_frames));
    }
    flags
}

/// The first candidate predicted to fit in a device of `total` bytes.
pub fn first_fitting(candidates: &[Candidate], total: u64) -> Option<&Candidate> {
    candidates.iter().find(|c| c.plan.fits(total))
}

/// How a run fits the memory that is free when it starts.
#[derive(Clone, Debug)]
pub enum Fit {
    /// Its own options are predicted to fit.
    AsAsked,
    /// They are not; this option set, the first (cheapest in speed) predicted to fit, is.
    Leaner(Candidate),
    /// Nothing is predicted to fit without changing the frames or an option the user set.
    Nothing,
}

/// Fits the run `request` asks for to `free` bytes: its own options where they fit, else the
/// first candidate set that fits, changing no option `kept` names and never the frames (a
/// shorter video is not what was asked: the advice offers it, the run does not take it).
pub fn fit(
    request: &Request,
    device: &DeviceInfo,
    plan_for: PlanFor,
    free: u64,
    kept: &dyn Fn(&str) -> bool,
) -> Fit {
    if plan_for(request).is_ok_and(|plan| plan.fits_free(free)) {
        return Fit::AsAsked;
    }
    candidates(request, device, plan_for, None, kept)
        .into_iter()
        .find(|c| c.plan.fits_free(free))
        .map_or(Fit::Nothing, Fit::Leaner)
}

/// What a placement that moves weights onto the device may plan to use of `free` bytes: all but a
/// tenth (the plan's margin: it is within 10% of the measured peaks).
fn room(free: u64) -> u64 {
    free - free / 10
}

/// The options that say where a DiT's weights wait and how they stream (config-file keys).
const DIT_PLACEMENT: [&str; 10] = [
    "dit_cpu_offload",
    "dit_layerwise_offload",
    "dit_resident_memory",
    "offload_type",
    "num_blocks_per_group",
    "offload_stream",
    "prefetch_depth",
    "model_cpu_offload",
    "sequential_cpu_offload",
    "use_fsdp_inference",
];

/// `request` with its DiT held on the device instead of in host memory, with that set's plan,
/// where `request` offloads the DiT by default only (`given` names none of
/// [`DIT_PLACEMENT`]) and the set is predicted to fit `free` bytes with a tenth of them to
/// spare (the plan's margin: it is within 10% of the measured peaks); else `None`. A streamed
/// DiT copies its weights every forward: where the copies outlast the compute (FLUX.1's forward
/// is a fifth of its copies' time on an H200, bench/RESULTS.md session 25) the run is several
/// times slower, and each weight a LoRA changes needs its merged copy in page-locked host
/// memory (a 14B with a LoRA on every projection: 28 GB, built in 4.8-7.0 s; session 29),
/// while a DiT held on the device costs nothing per step and is merged where it lands.
pub fn dit_on_device(
    request: &Request,
    device: &DeviceInfo,
    plan_for: PlanFor,
    free: u64,
    given: &dyn Fn(&str) -> bool,
) -> Option<(Request, MemoryPlan)> {
    let o = &request.options;
    if !(o.dit_cpu_offload || o.dit_layerwise_offload) || DIT_PLACEMENT.iter().any(|k| given(k)) {
        return None;
    }
    let mut resident = request.clone();
    resident.options.dit_cpu_offload = false;
    resident.options.dit_layerwise_offload = false;
    apply_memory_rules(&mut resident.options, device);
    with_plan_within(resident, plan_for, room(free))
}

/// `request` with its plan, where that plan fits `room` bytes; else `None`.
fn with_plan_within(
    request: Request,
    plan_for: PlanFor,
    room: u64,
) -> Option<(Request, MemoryPlan)> {
    let plan = plan_for(&request).ok()?;
    plan.fits_free(room).then_some((request, plan))
}

/// `request` with as many of its streamed DiT's blocks kept on the device
/// ([`MemoryOptions::dit_resident_memory`]) as `free` bytes hold with a tenth of them to spare
/// (the largest budget whose plan fits),
/// with that set's plan, where `request` streams the DiT by default only (`given` names none of
/// [`DIT_PLACEMENT`]) and fits as it is; else `None` (nothing fits, or no block would be kept).
/// Each kept block is copied once per stage instead of every step: where the whole DiT does not
/// fit, the copies left hide behind more compute (FLUX.1's forward copies for five times as long
/// as it computes, HunyuanVideo's dual-stream blocks for 1.3 times; bench/RESULTS.md sessions
/// 25 and 46).
pub fn dit_kept_on_device(
    request: &Request,
    plan_for: PlanFor,
    free: u64,
    given: &dyn Fn(&str) -> bool,
) -> Option<(Request, MemoryPlan)> {
    if !request.options.dit_layerwise_offload || DIT_PLACEMENT.iter().any(|k| given(k)) {
        return None;
    }
    let room = room(free);
    let streamed = plan_for(request).ok()?;
    if !streamed.fits_free(room) {
        return None;
    }
    let keeping = |budget: u64| {
        let mut kept = request.clone();
        kept.options.dit_resident_memory = budget;
        with_plan_within(kept, plan_for, room)
    };
    // The largest budget that fits, to a MiB: kept bytes count only in the stages that hold
    // the DiT, which need not be the run's peak, and in each of two experts' own stages.
    let (mut fits, mut fails) = (0u64, room.saturating_add(1));
    let mut found = None;
    while fails - fits > 1 << 20 {
        let budget = fits + (fails - fits) / 2;
        match keeping(budget) {
            Some(kept) => (fits, found) = (budget, Some(kept)),
            None => fails = budget,
        }
    }
    found.filter(|(_, plan)| *plan != streamed)
}

/// The options that say where a text encoder's weights wait and where it computes.
const TEXT_ENCODER_PLACEMENT: [&str; 2] = ["text_encoder_cpu_offload", "text_encoder_compute"];

/// `request` with its text encoders loaded whole on the device for their stage instead of
/// streamed from host memory, with that set's plan, where `request` offloads them by default
/// only (`given` names none of [`TEXT_ENCODER_PLACEMENT`]) and the set is predicted to fit
/// `free` bytes with a tenth of them to spare; else `None`. A streamed encoder copies all its
/// weights through its pinned slots for every prompt's encode: Wan2.1 1.3B's UMT5 stage took
/// 1.09 s streamed against 0.78 s loaded whole (an H200, bench/RESULTS.md session 55), and a
/// prompt file's next prompts copy them again.
pub fn text_encoders_on_device(
    request: &Request,
    plan_for: PlanFor,
    free: u64,
    given: &dyn Fn(&str) -> bool,
) -> Option<(Request, MemoryPlan)> {
    let o = &request.options;
    if !o.text_encoder_cpu_offload || TEXT_ENCODER_PLACEMENT.iter().any(|k| given(k)) {
        return None;
    }
    let mut whole = request.clone();
    whole.options.text_encoder_cpu_offload = false;
    with_plan_within(whole, plan_for, room(free))
}

/// The sets of [`HOST_SAVINGS`] that change no option `kept` names, each through the device's
/// memory rules, with their plans, in order.
fn host_candidates<'a>(
    request: &'a Request,
    device: &'a DeviceInfo,
    plan_for: PlanFor<'a>,
    kept: &'a dyn Fn(&str) -> bool,
) -> impl Iterator<Item = Candidate> + 'a {
    HOST_SAVINGS
        .iter()
        .filter(|set| !set.iter().any(|s| s.is_kept(kept)))
        .filter_map(move |set| {
            let mut tried = request.clone();
            for saving in set.iter() {
                (saving.turn_on)(&mut tried.options);
            }
            apply_memory_rules(&mut tried.options, device);
            let plan = plan_for(&tried).ok()?;
            let flags = changed_flags(request, &tried);
            // A set that changes nothing here (lazy load where it is on already) is no option.
            (!flags.is_empty()).then_some(Candidate {
                flags,
                plan,
                request: tried,
            })
        })
}

/// Fits the run `request` asks for (whose device memory [`fit`] has settled) to `host` bytes of
/// host memory: its own options where their host peak fits, else the first of the
/// [`host_candidates`] predicted to fit both the host and, where known, the `free` device bytes.
pub fn fit_host(
    request: &Request,
    device: &DeviceInfo,
    plan_for: PlanFor,
    host: u64,
    free: Option<u64>,
    kept: &dyn Fn(&str) -> bool,
) -> Fit {
    let fits = |plan: &MemoryPlan| plan.fits_host(host) && free.is_none_or(|f| plan.fits_free(f));
    if plan_for(request).is_ok_and(|plan| fits(&plan)) {
        return Fit::AsAsked;
    }
    host_candidates(request, device, plan_for, kept)
        .find(|c| fits(&c.plan))
        .map_or(Fit::Nothing, Fit::Leaner)
}

/// The host candidate with the lowest host peak: what the advice names when nothing fits.
pub fn leanest_host(
    request: &Request,
    device: &DeviceInfo,
    plan_for: PlanFor,
    kept: &dyn Fn(&str) -> bool,
) -> Option<Candidate> {
    host_candidates(request, device, plan_for, kept).min_by_key(|c| c.plan.host_required_bytes())
}

/// Out-of-memory advice from the plan: the predicted peak of the run's options, the device's
/// size, and the first candidate predicted to fit; where the run's own options are predicted
/// to fit (memory held elsewhere, or an estimate too low) or the size is unknown, the leanest.
pub fn advice(
    request: &Request,
    device: &DeviceInfo,
    plan_for: PlanFor,
    total: Option<u64>,
) -> String {
    let current = match plan_for(request) {
        Ok(plan) => plan,
        Err(e) => return format!("no memory plan: {e:#}"),
    };
    let mut text = format!(
        "the memory plan predicts a peak of {} for these options",
        current.describe_peak()
    );
    let found = candidates(request, device, plan_for, total, &|_| false);
    let describe = |c: &Candidate| {
        format!(
            "{} (predicted peak {})",
            c.flags.join(" "),
            c.plan.describe_peak()
        )
    };
    let leanest = found
        .iter()
        .filter(|c| c.plan.required_bytes() < current.required_bytes())
        .min_by_key(|c| c.plan.required_bytes());
    if let Some(total) = total {
        text += &format!("; the device has {:.2} GiB", gib(total));
        if current.fits(total) {
            text += ", which the plan predicts is enough: other processes may hold device memory";
        } else if let Some(c) = first_fitting(&found, total) {
            return text + &format!("; predicted to fit: {}", describe(c));
        } else {
            text += "; nothing the plan knows is predicted to fit";
        }
    }
    if let Some(c) = leanest {
        text += &format!("; the leanest option set: {}", describe(c));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::probe::{DeviceKind, MemoryModel};

    /// A discrete GPU's run with both load levers off and every weight pinned.
    fn discrete_request() -> (Request, DeviceInfo) {
        let options = MemoryOptions {
            dit_cpu_offload: true,
            use_fsdp_inference: false,
            dit_layerwise_offload: true,
            text_encoder_cpu_offload: true,
            image_encoder_cpu_offload: true,
            vae_cpu_offload: true,
            pin_cpu_memory: true,
            max_pinned_memory: None,
            text_encoder_on_cpu: false,
            lazy_module_load: Some(false),
            h3_sequential_load: Some(false),
            leaf_level: false,
            num_blocks_per_group: 1,
            offload_stream: true,
            prefetch_depth: None,
            dit_resident_memory: 0,
            model_cpu_offload: false,
            sequential_cpu_offload: false,
            vae_tiling: false,
            vae_tile_size: None,
            low_activation: false,
        };
        let device = DeviceInfo {
            kind: DeviceKind::Cuda,
            ordinal: 0,
            name: "a GPU".into(),
            total_memory: None,
            free_memory: None,
            host_available: None,
            host_sharers: 1,
            memory_model: MemoryModel::Discrete,
            memory_model_forced: true,
            context: Default::default(),
        };
        let request = Request {
            options,
            num_frames: 81,
            frame_step: 4,
        };
        (request, device)
    }

    /// A one-stage plan of `device` bytes and `host` bytes of host memory.
    fn one_stage(device: u64, host: u64) -> MemoryPlan {
        MemoryPlan {
            stages: vec![StagePlan {
                name: "denoise",
                weight_bytes: device,
                activation_bytes: 0,
                peak_bytes: device,
                host_bytes: host,
            }],
        }
    }

    /// Host fitting, budgets in and option set out: the run's own options where they fit; else
    /// the first set that fits, in order (sequential load, lazy load, each with a bounded pinned
    /// ring); none that changes an option the user set, nor one the free device memory cannot
    /// hold; nothing below the leanest.
    #[test]
    fn the_host_takes_the_first_set_that_fits_it() {
        let (request, device) = discrete_request();
        // Host bytes: 100 eager, 70 sequential, 50 lazy, 20 less with a bounded ring; the
        // bounded lazy set needs more of the device.
        let plan_for = |r: &Request| -> anyhow::Result<MemoryPlan> {
            let o = &r.options;
            let host = match (o.lazy(), o.sequential()) {
                (true, _) => 50,
                (false, true) => 70,
                (false, false) => 100,
            } - if o.max_pinned_memory.is_some() { 20 } else { 0 };
            let device = if o.lazy() && o.max_pinned_memory.is_some() {
                5_000
            } else {
                1_000
            };
            Ok(one_stage(device, host))
        };
        let fit = |host, free, kept: &dyn Fn(&str) -> bool| match fit_host(
            &request, &device, &plan_for, host, free, kept,
        ) {
            Fit::AsAsked => Vec::new(),
            Fit::Leaner(c) => c.flags,
            Fit::Nothing => vec!["nothing".to_string()],
        };
        let none = |_: &str| false;
        assert!(fit(100, None, &none).is_empty());
        assert_eq!(fit(99, None, &none), ["--h3-sequential-load"]);
        assert_eq!(fit(55, None, &none), ["--lazy-module-load"]);
        assert_eq!(
            fit(40, None, &none),
            ["--lazy-module-load", "--max-pinned-memory 2GiB"]
        );
        assert_eq!(fit(29, None, &none), ["nothing"]);
        // The device cannot hold the bounded lazy set.
        // Free memory is read after the context opened: that part of the context is not
        // counted twice.
        let opened = CONTEXT_BYTES - OPENED_CONTEXT_BYTES;
        assert_eq!(fit(40, Some(opened + 2_000), &none), ["nothing"]);
        assert_eq!(
            fit(40, Some(opened + 5_000), &none),
            ["--lazy-module-load", "--max-pinned-memory 2GiB"]
        );
        assert_eq!(fit(40, Some(opened + 4_999), &none), ["nothing"]);
        // The user set lazy loading (off): the encoder freed first, with a bounded ring.
        let lazy_kept = |o: &str| o == "lazy_module_load";
        assert_eq!(
            fit(55, None, &lazy_kept),
            ["--h3-sequential-load", "--max-pinned-memory 2GiB"]
        );
        // The user set pinning: no bounded ring.
        assert_eq!(fit(40, None, &|o: &str| o == "pin_cpu_memory"), ["nothing"]);
        let leanest = leanest_host(&request, &device, &plan_for, &none).unwrap();
        assert_eq!(leanest.plan.host_required_bytes(), 30);
    }

    /// The savings the user set are named by their flags, in the advice's order.
    #[test]
    fn kept_savings_name_the_flags_the_user_set() {
        let kept = kept_savings(&|o| matches!(o, "vae_tiling" | "offload_type"));
        assert_eq!(kept, ["--offload-type leaf-level", "--vae-tiling"]);
        assert!(kept_savings(&|_| false).is_empty());
    }

    /// Components alive but not computing count their idle weights and no activations;
    /// a schedule that frees each component after its stage keeps only the stage's own.
    #[test]
    fn stages_count_what_the_schedule_keeps_alive() {
        let weights = [
            DeviceWeights {
                active: 1000,
                idle: 100,
                apart: None,
            },
            DeviceWeights {
                active: 20_000,
                idle: 2_000,
                apart: None,
            },
        ];
        let stage =
            |name, uses: &'static [usize], load_before, release_after, activations| PlanStage {
                name,
                uses,
                load_before,
                release_after,
                activation_bytes: activations,
                apart_activation_bytes: None,
                host_activation_bytes: 0,
            };
        let eager = [
            stage("first", &[0], &[0, 1], &[], 7),
            stage("second", &[1], &[], &[0, 1], 30),
        ];
        let plan = MemoryPlan::new(&eager, &weights).unwrap();
        let first = plan.stage("first").unwrap();
        assert_eq!(first.weight_bytes, 1000 + 2_000);
        assert_eq!(first.activation_bytes, 7);
        assert_eq!(first.peak_bytes, first.weight_bytes + 7);
        assert_eq!(plan.stage("second").unwrap().weight_bytes, 100 + 20_000);
        assert_eq!(plan.peak().unwrap().name, "second");
        let lazy = [
            stage("first", &[0], &[0], &[0], 7),
            stage("second", &[1], &[1], &[1], 30),
        ];
        let plan = MemoryPlan::new(&lazy, &weights).unwrap();
        assert_eq!(plan.stage("first").unwrap().weight_bytes, 1000);
        assert_eq!(plan.stage("second").unwrap().weight_bytes, 20_000);
    }

    /// Weights or activations whose sum passes 2^64 bytes make no plan (an error naming the
    /// stage), never a wrapped figure; a saturated layout (`u64::MAX`) does the same.
    #[test]
    fn a_plan_beyond_two_to_the_64_bytes_is_an_error() {
        let huge = DeviceWeights {
            active: u64::MAX / 2 + 1,
            idle: u64::MAX / 2 + 1,
            apart: None,
        };
        let stage = |activations| PlanStage {
            name: "denoise",
            uses: &[0, 1],
            load_before: &[0, 1],
            release_after: &[],
            activation_bytes: activations,
            apart_activation_bytes: None,
            host_activation_bytes: 0,
        };
        for (weights, activations) in [
            (vec![huge, huge], 0),
            (vec![huge, DeviceWeights::default()], u64::MAX / 2 + 1),
            (
                vec![
                    DeviceWeights {
                        active: u64::MAX,
                        idle: u64::MAX,
                        apart: None,
                    },
                    DeviceWeights::default(),
                ],
                0,
            ),
            (vec![DeviceWeights::default(); 2], u64::MAX - CONTEXT_BYTES),
        ] {
            let e = MemoryPlan::new(&[stage(activations)], &weights).unwrap_err();
            assert!(
                format!("{e}").contains("stage denoise is beyond 2^64 bytes"),
                "{e}"
            );
        }
        let plan = MemoryPlan::new(&[stage(5)], &[huge, DeviceWeights::default()]).unwrap();
        assert_eq!(
            plan.required_bytes(),
            u64::MAX / 2 + 1 + 5 + 2 + CONTEXT_BYTES
        );
    }

    /// A component whose outer part computes apart from its blocks: the stage's peak is the
    /// larger moment, each with its own weights and activations, and without an estimate of the
    /// apart moment's activations the stage's own count there too.
    #[test]
    fn a_stage_peaks_at_the_larger_of_its_two_moments() {
        let weights = [
            DeviceWeights {
                active: 500,
                idle: 0,
                apart: Some(800),
            },
            DeviceWeights {
                active: 40,
                idle: 40,
                apart: None,
            },
        ];
        let stage = |activations, apart| PlanStage {
            name: "denoise",
            uses: &[0],
            load_before: &[0, 1],
            release_after: &[],
            activation_bytes: activations,
            apart_activation_bytes: apart,
            host_activation_bytes: 0,
        };
        let plan = |activations, apart| {
            let s = MemoryPlan::new(&[stage(activations, apart)], &weights).unwrap();
            let s = &s.stages[0];
            (s.weight_bytes, s.activation_bytes, s.peak_bytes)
        };
        // Blocks: 500 + 40 + 1000; apart: 800 + 40 + 300.
        assert_eq!(plan(1000, Some(300)), (540, 1000, 1540));
        // Apart: 800 + 40 + 900 beats the blocks' 1540.
        assert_eq!(plan(1000, Some(900)), (840, 900, 1740));
        // No estimate: the larger weights with the stage's activations.
        assert_eq!(plan(1000, None), (840, 1000, 1840));
    }
}
