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
}

/// The predicted device bytes of one stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePlan {
    pub name: &'static str,
    /// Weights of every component alive in the stage (those computing and those waiting).
    pub weight_bytes: u64,
    /// Activations and scratch of the components computing.
    pub activation_bytes: u64,
    /// Weights plus activations.
    pub peak_bytes: u64,
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
            let weight_bytes = alive
                .iter()
                .map(|&c| {
                    if stage.uses.contains(&c) {
                        weights[c].active
                    } else {
                        weights[c].idle
                    }
                })
                .try_fold(0u64, u64::checked_add)
                .ok_or_else(overflow)?;
            let peak_bytes = weight_bytes
                .checked_add(stage.activation_bytes)
                .ok_or_else(overflow)?;
            StagePlan::required(peak_bytes, stage.activation_bytes).ok_or_else(overflow)?;
            alive.retain(|c| !stage.release_after.contains(c));
            planned.push(StagePlan {
                name: stage.name,
                weight_bytes,
                activation_bytes: stage.activation_bytes,
                peak_bytes,
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

/// A memory saving the advice can add: its flag, the option it sets (as `given` names it), how
/// to turn it on and whether it is on.
struct Saving {
    flag: &'static str,
    option: &'static str,
    turn_on: fn(&mut MemoryOptions),
    is_on: fn(&MemoryOptions) -> bool,
}

/// The savings in the order the advice adds them: the cheapest in speed first.
const SAVINGS: [Saving; 5] = [
    Saving {
        flag: "--dit-layerwise-offload",
        option: "dit_layerwise_offload",
        turn_on: |o| o.dit_layerwise_offload = true,
        is_on: |o| o.dit_layerwise_offload,
    },
    Saving {
        flag: "--offload-type leaf-level",
        option: "offload_type",
        turn_on: |o| o.leaf_level = true,
        is_on: |o| o.leaf_level,
    },
    Saving {
        flag: "--text-encoder-cpu-offload",
        option: "text_encoder_cpu_offload",
        turn_on: |o| o.text_encoder_cpu_offload = true,
        is_on: |o| o.text_encoder_cpu_offload,
    },
    Saving {
        flag: "--lazy-module-load",
        option: "lazy_module_load",
        turn_on: |o| o.lazy_module_load = Some(true),
        is_on: |o| o.lazy(),
    },
    Saving {
        flag: "--vae-tiling",
        option: "vae_tiling",
        turn_on: |o| o.vae_tiling = true,
        is_on: |o| o.vae_tiling,
    },
];

/// The flags of the savings the advice may not change because `kept` names their options (the
/// user set them).
pub fn kept_savings(kept: &dyn Fn(&str) -> bool) -> Vec<&'static str> {
    SAVINGS
        .iter()
        .filter(|s| kept(s.option))
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
    // Offers `candidate` with `plan` if it needs less than the last offer.
    let mut offer = |candidate: &Request, plan: MemoryPlan| {
        let flags = changed_flags(request, candidate);
        if !flags.is_empty() && plan.required_bytes() < least {
            least = plan.required_bytes();
            out.push(Candidate {
                flags,
                plan,
                request: candidate.clone(),
            });
        }
    };
    for saving in SAVINGS.iter().filter(|s| !kept(s.option)) {
        let mut tried = next.clone();
        (saving.turn_on)(&mut tried.options);
        apply_memory_rules(&mut tried.options, device);
        // A saving that changes no stage here (e.g. step-by-step streaming with nothing
        // streamed) is left out; one that lowers a stage that is not the peak is kept, as a
        // later saving may make that stage the peak.
        if let Ok(after) = plan_for(&tried) {
            if current.as_ref() != Some(&after) {
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

/// The flags that turn `from` into `to`, among those the advice changes.
fn changed_flags(from: &Request, to: &Request) -> Vec<String> {
    let mut flags: Vec<String> = SAVINGS
        .iter()
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
    if plan_for(request).is_ok_and(|plan| plan.fits(free)) {
        return Fit::AsAsked;
    }
    candidates(request, device, plan_for, None, kept)
        .into_iter()
        .find(|c| c.plan.fits(free))
        .map_or(Fit::Nothing, Fit::Leaner)
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
            },
            DeviceWeights {
                active: 20_000,
                idle: 2_000,
            },
        ];
        let stage =
            |name, uses: &'static [usize], load_before, release_after, activations| PlanStage {
                name,
                uses,
                load_before,
                release_after,
                activation_bytes: activations,
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
        };
        let stage = |activations| PlanStage {
            name: "denoise",
            uses: &[0, 1],
            load_before: &[0, 1],
            release_after: &[],
            activation_bytes: activations,
        };
        for (weights, activations) in [
            (vec![huge, huge], 0),
            (vec![huge, DeviceWeights::default()], u64::MAX / 2 + 1),
            (
                vec![
                    DeviceWeights {
                        active: u64::MAX,
                        idle: u64::MAX,
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
}
