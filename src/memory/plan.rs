//! The memory plan: the device bytes of every stage, predicted from the model's configs and the
//! resolved options alone, so `--dry-run` shows what a run needs before anything loads and an
//! out-of-memory error can name option sets that fit.
//!
//! Planning is generic: the runner's [`Schedule`] says which components are alive in each stage
//! and each component's [`Footprint`] what it holds on the device while its stage runs and while
//! it waits. [`wan`] gives the Wan2.1 footprints: parameters counted by the shapes the model
//! constructors request, activations estimated from the tensors their forward passes keep alive.
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

use crate::cli::args::{GenerateOptions, OffloadType, Tristate};
use crate::cli::ResolvedConfig;
use crate::memory::apply_memory_rules;
use crate::pipeline::placement::Residency;
use crate::pipeline::runner::{Schedule, StageSpec};
use candle_core::DType;

const GIB: u64 = 1 << 30;

/// Bytes as GiB, for people.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB as f64
}

/// Device memory a run needs beyond its tensors: the CUDA context and library workspaces.
const CONTEXT_BYTES: u64 = GIB;

/// Parameters of a module: how many, and how many stay f32 whatever the run dtype (the
/// `_keep_in_fp32_modules` of diffusers and transformers), so its bytes follow from the dtype.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Params {
    /// Every parameter, the f32 ones included.
    pub count: u64,
    /// Parameters held in f32 whatever the run dtype.
    pub kept_f32: u64,
}

impl Params {
    /// Parameters in the run dtype.
    fn new(count: u64) -> Self {
        Params { count, kept_f32: 0 }
    }

    /// Parameters kept in f32.
    fn f32(count: u64) -> Self {
        Params {
            count,
            kept_f32: count,
        }
    }

    /// Bytes when loaded in `dtype`.
    pub fn bytes(self, dtype: DType) -> u64 {
        let f32_size = DType::F32.size_in_bytes() as u64;
        (self.count - self.kept_f32) * dtype.size_in_bytes() as u64 + self.kept_f32 * f32_size
    }
}

impl std::ops::Add for Params {
    type Output = Params;
    fn add(self, other: Params) -> Params {
        Params {
            count: self.count + other.count,
            kept_f32: self.kept_f32 + other.kept_f32,
        }
    }
}

impl std::ops::Mul<u64> for Params {
    type Output = Params;
    fn mul(self, n: u64) -> Params {
        Params {
            count: self.count * n,
            kept_f32: self.kept_f32 * n,
        }
    }
}

/// What one component holds on the device under the resolved options.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Weight bytes on the device while a stage that uses the component runs.
    pub active_weights: u64,
    /// Weight bytes on the device while it is loaded but another stage runs (0 when its
    /// weights wait in host memory).
    pub idle_weights: u64,
    /// Peak bytes of activations and scratch while it computes.
    pub activations: u64,
}

impl Footprint {
    /// What a component placed as `residency` holds: `outer` bytes besides `blocks` repeated
    /// blocks of `block` bytes each (a component without blocks is all `outer`).
    ///
    /// Resident weights stay on the device; parked ones come in whole for the component's
    /// stage; streamed blocks pass through `depth + 1` device slots of a group each, which stay
    /// allocated between passes (without a stream, one group at a time). On the CPU nothing is on the
    /// device.
    pub fn placed(
        residency: Residency,
        (outer, block, blocks): (u64, u64, u64),
        activations: u64,
    ) -> Self {
        let whole = outer + block * blocks;
        let (active_weights, idle_weights) = match residency {
            Residency::Resident => (whole, whole),
            Residency::OnCpu => return Footprint::default(),
            Residency::Parked => (whole, 0),
            // Step by step, `blocks` counts steps and `block` is the largest one.
            Residency::Streamed {
                blocks_per_group,
                options,
                ..
            } => {
                let per_group = blocks_per_group.max(1) as u64;
                let groups = blocks.div_ceil(per_group);
                let (computing, waiting) = if options.stream {
                    // depth + 1 device slots, kept between passes (the first groups of the next
                    // pass are prefetched into them).
                    let depth = (options.depth.max(1) as u64).min(groups);
                    ((depth + 1).min(groups), (depth + 1).min(groups))
                } else {
                    (1, 0)
                };
                let on_device = |g: u64| outer + (g * per_group).min(blocks) * block;
                (on_device(computing), on_device(waiting))
            }
        };
        Footprint {
            active_weights,
            idle_weights,
            activations,
        }
    }
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
        self.peak_bytes + self.activation_bytes * 2 / 5 + CONTEXT_BYTES
    }
}

/// The predicted device bytes of every stage of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    pub stages: Vec<StagePlan>,
}

impl MemoryPlan {
    /// Plans `stages`: in each, the components the schedule has alive hold their active
    /// weights and activations if the stage uses them, their idle weights otherwise.
    pub fn new<C: Copy + PartialEq>(
        stages: &[StageSpec<C>],
        schedule: &Schedule<C>,
        footprint: impl Fn(C) -> Footprint,
    ) -> Self {
        let mut alive: Vec<C> = Vec::new();
        let mut planned = Vec::with_capacity(stages.len());
        for (i, stage) in stages.iter().enumerate() {
            for &c in schedule.load_before[i].iter().chain(stage.uses) {
                if !alive.contains(&c) {
                    alive.push(c);
                }
            }
            let (mut weight_bytes, mut activation_bytes) = (0, 0);
            for &c in &alive {
                let f = footprint(c);
                if stage.uses.contains(&c) {
                    weight_bytes += f.active_weights;
                    activation_bytes += f.activations;
                } else {
                    weight_bytes += f.idle_weights;
                }
            }
            alive.retain(|c| !schedule.release_after[i].contains(c));
            planned.push(StagePlan {
                name: stage.name,
                weight_bytes,
                activation_bytes,
                peak_bytes: weight_bytes + activation_bytes,
            });
        }
        MemoryPlan { stages: planned }
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
}

/// A memory saving the advice can add: its flag, how to turn it on and whether it is on.
struct Saving {
    flag: &'static str,
    turn_on: fn(&mut GenerateOptions),
    is_on: fn(&GenerateOptions) -> bool,
}

/// The savings in the order the advice adds them: the cheapest in speed first.
const SAVINGS: [Saving; 5] = [
    Saving {
        flag: "--dit-layerwise-offload",
        turn_on: |o| o.dit_layerwise_offload = true,
        is_on: |o| o.dit_layerwise_offload,
    },
    Saving {
        flag: "--offload-type leaf-level",
        turn_on: |o| o.offload_type = OffloadType::LeafLevel,
        is_on: |o| o.offload_type == OffloadType::LeafLevel,
    },
    Saving {
        flag: "--text-encoder-cpu-offload",
        turn_on: |o| o.text_encoder_cpu_offload = true,
        is_on: |o| o.text_encoder_cpu_offload,
    },
    Saving {
        flag: "--lazy-module-load",
        turn_on: |o| o.lazy_module_load = Tristate::On,
        is_on: |o| o.lazy_module_load == Tristate::On,
    },
    Saving {
        flag: "--vae-tiling",
        turn_on: |o| o.vae_tiling = true,
        is_on: |o| o.vae_tiling,
    },
];

/// A pipeline's memory plan for a configuration (an error where the options cannot be placed).
pub type PlanFor<'a> = &'a dyn Fn(&ResolvedConfig) -> anyhow::Result<MemoryPlan>;

/// Option sets from the run's own, each adding one saving to the previous (DiT layerwise
/// offload, step-by-step streaming, text encoder offload, lazy load, VAE tiling), then, when
/// the device size is known, with the most frames (fewer than asked) that fit. Each set goes
/// through the device's memory rules, so a saving the device would undo (host offload on
/// unified memory) is not offered, and a set is offered only if it needs less than the last.
pub fn candidates(
    config: &ResolvedConfig,
    plan_for: PlanFor,
    total: Option<u64>,
) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = Vec::new();
    let mut next = config.clone();
    let mut current = plan_for(config).ok();
    let mut least = current.as_ref().map_or(u64::MAX, |p| p.required_bytes());
    // Offers `candidate` with `plan` if it needs less than the last offer.
    let mut offer = |candidate: &ResolvedConfig, plan: MemoryPlan| {
        let flags = changed_flags(&config.options, &candidate.options);
        if !flags.is_empty() && plan.required_bytes() < least {
            least = plan.required_bytes();
            out.push(Candidate { flags, plan });
        }
    };
    for saving in &SAVINGS {
        let mut tried = next.clone();
        (saving.turn_on)(&mut tried.options);
        apply_memory_rules(&mut tried.options, &tried.device);
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
        // Frames come as 4k+1; take the largest k below the run's that fits, else one frame.
        for k in (0..(config.options.num_frames - 1) / 4).rev() {
            next.options.num_frames = 4 * k + 1;
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
fn changed_flags(from: &GenerateOptions, to: &GenerateOptions) -> Vec<String> {
    let mut flags: Vec<String> = SAVINGS
        .iter()
        .filter(|s| (s.is_on)(to) && !(s.is_on)(from))
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

/// Out-of-memory advice from the plan: the predicted peak of the run's options, the device's
/// size, and the first candidate predicted to fit; where the run's own options are predicted
/// to fit (memory held elsewhere, or an estimate too low) or the size is unknown, the leanest.
pub fn advice(config: &ResolvedConfig, plan_for: PlanFor, total: Option<u64>) -> String {
    let current = match plan_for(config) {
        Ok(plan) => plan,
        Err(e) => return format!("no memory plan: {e:#}"),
    };
    let mut text = format!(
        "the memory plan predicts a peak of {} for these options",
        current.describe_peak()
    );
    let found = candidates(config, plan_for, total);
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

/// Wan2.1 sizes from its configs: parameters by the shapes the constructors in
/// `models::wan` request, activations from the tensors their forward passes keep alive.
pub mod wan {
    use super::{Footprint, MemoryPlan, Params};
    use crate::cli::ResolvedConfig;
    use crate::models::attention::MAX_SCORE_ELEMENTS;
    use crate::models::wan::text_encoder::UMT5Config;
    use crate::models::wan::transformer::{WanTransformerConfig, FFN_CHUNK};
    use crate::models::wan::vae::{WanVaeConfig, WanVaeTiling};
    use crate::pipeline::placement::Residency;
    use crate::pipeline::runner::Schedule;
    use crate::pipeline::wan_t2v::{self, Component, WanConfigs};
    use candle_core::DType;

    /// Bytes of an f32 element (the VAE, RoPE tables, latents and f32 scratch).
    const F32: u64 = 4;

    /// Copies of the block's hidden states `[tokens, dim]` (run dtype) alive at the
    /// self-attention's peak: the block input, q, k, v (heads are strided views, RoPE and the
    /// q/k norms run in place), the attention output and its projection (measured on the H200:
    /// 1.3B 0.59 GiB, 14B 1.90 GiB of activations in all).
    const ATTENTION_HIDDEN_COPIES: u64 = 6;
    /// Copies alive in the feed-forward, besides one token chunk's intermediate: the block's
    /// hidden states (chunks are written back into them) and one chunk's norm and output.
    const FFN_HIDDEN_COPIES: u64 = 2;
    /// f32 copies of the latents alive while denoising: latents, model input, both noise
    /// predictions and the scheduler's history.
    const LATENT_COPIES: u64 = 8;
    /// Copies of the VAE decoder's largest chunk feature map alive at once: input, norm and
    /// SiLU outputs, the conv's cached frames, per-frame outputs and their stacking.
    const DECODE_FEATURE_MAPS: u64 = 6;
    /// Copies of the decoded video alive at the end: the decoder's output, its clamp, and the
    /// pipeline's rescale to [0, 1].
    const VIDEO_COPIES: u64 = 4;
    /// Elements of the im2col scratch one VAE conv2d may build: `MAX_IM2COL_ELEMENTS` of
    /// `models::wan::vae::blocks`, where it is private.
    const CONV_SCRATCH_ELEMENTS: u64 = 1 << 26;
    /// Frames each causal conv of the VAE caches between chunks (diffusers' `CACHE_T`).
    const CACHE_FRAMES: u64 = 2;

    /// A linear layer with bias.
    fn linear(fan_in: usize, fan_out: usize) -> u64 {
        (fan_in * fan_out + fan_out) as u64
    }

    /// One block, as `WanTransformerBlock::new` requests it (norm2 and the modulation table
    /// kept f32).
    pub fn transformer_block(cfg: &WanTransformerConfig) -> Params {
        let (attention, norm2, ffn, modulation) = transformer_block_parts(cfg);
        attention * 2 + norm2 + ffn + modulation
    }

    /// Each step of a DiT block as `WanTransformerBlock::with_steps` requests it alone
    /// (self-attention, cross-attention, feed-forward): the groups of step-by-step streaming.
    /// The modulated steps each hold the block's modulation table.
    pub fn transformer_steps(cfg: &WanTransformerConfig) -> [Params; 3] {
        let (attention, norm2, ffn, modulation) = transformer_block_parts(cfg);
        [attention + modulation, attention + norm2, ffn + modulation]
    }

    /// A DiT block's parts: one attention, the cross-attention norm, the feed-forward and the
    /// modulation table (the norm and the table kept in f32).
    fn transformer_block_parts(cfg: &WanTransformerConfig) -> (Params, Params, Params, Params) {
        let d = cfg.inner_dim();
        let attention = Params::new(4 * linear(d, d) + 2 * d as u64);
        let norm2 = if cfg.cross_attn_norm {
            Params::f32(2 * d as u64)
        } else {
            Params::default()
        };
        let ffn = Params::new(linear(d, cfg.ffn_dim) + linear(cfg.ffn_dim, d));
        (attention, norm2, ffn, Params::f32(6 * d as u64))
    }

    /// Everything but the blocks, as `WanTransformer3DModel::new_without_blocks` requests it
    /// (the time embedder and the output modulation table kept f32).
    pub fn transformer_shared(cfg: &WanTransformerConfig) -> Params {
        let d = cfg.inner_dim();
        let patch: usize = cfg.patch_size.iter().product();
        Params::new(linear(cfg.in_channels * patch, d))
            + Params::f32(linear(cfg.freq_dim, d) + linear(d, d))
            + Params::new(linear(d, 6 * d))
            + Params::new(linear(cfg.text_dim, d) + linear(d, d))
            + Params::new(linear(d, cfg.out_channels() * patch))
            + Params::f32(2 * d as u64)
    }

    /// The whole DiT.
    pub fn transformer(cfg: &WanTransformerConfig) -> Params {
        transformer_shared(cfg) + transformer_block(cfg) * cfg.num_layers as u64
    }

    /// The UMT5 encoder's embedding (tied, requested once) and final norm, as
    /// `UMT5EncoderModel::new_without_blocks` requests them.
    pub fn text_encoder_outer(cfg: &UMT5Config) -> Params {
        let d = cfg.d_model as u64;
        Params::new(cfg.vocab_size as u64 * d + d)
    }

    /// The UMT5 token table alone: it stays in host memory when the blocks are streamed.
    pub fn text_encoder_table(cfg: &UMT5Config) -> Params {
        Params::new(cfg.vocab_size as u64 * cfg.d_model as u64)
    }

    /// One UMT5 block, as `UMT5EncoderModel::block` requests it: no biases, the FFN output
    /// projection kept f32.
    pub fn text_encoder_block(cfg: &UMT5Config) -> Params {
        let (d, inner) = (cfg.d_model as u64, (cfg.num_heads * cfg.d_kv) as u64);
        let ff = cfg.d_ff as u64;
        let ffn_in = if cfg.feed_forward_proj.starts_with("gated-") {
            2
        } else {
            1
        };
        let bias = (cfg.relative_attention_num_buckets * cfg.num_heads) as u64;
        Params::new(4 * d * inner + bias + 2 * d + ffn_in * d * ff) + Params::f32(ff * d)
    }

    /// The whole UMT5 encoder.
    pub fn text_encoder(cfg: &UMT5Config) -> Params {
        text_encoder_outer(cfg) + text_encoder_block(cfg) * cfg.num_layers as u64
    }

    /// A conv with bias over `taps` kernel positions.
    fn conv(cin: u64, cout: u64, taps: u64) -> u64 {
        cin * cout * taps + cout
    }

    /// A VAE residual block (3x3x3 convs, 1x1x1 shortcut when the width changes).
    fn res_block(cin: u64, cout: u64) -> u64 {
        let shortcut = if cin != cout { conv(cin, cout, 1) } else { 0 };
        cin + conv(cin, cout, 27) + cout + conv(cout, cout, 27) + shortcut
    }

    /// A VAE attention block over the pixels of each frame.
    fn attention_block(d: u64) -> u64 {
        d + conv(d, 3 * d, 1) + conv(d, d, 1)
    }

    /// Res, attention, res.
    fn mid_block(d: u64) -> u64 {
        2 * res_block(d, d) + attention_block(d)
    }

    /// Channel norm and the closing 3x3x3 conv.
    fn head(d: u64, out: u64) -> u64 {
        d + conv(d, out, 27)
    }

    /// One up stage of the decoder as `Decoder::new` builds it.
    struct UpStage {
        input: u64,
        output: u64,
        resnets: usize,
        /// `Some(temporal)` when an upsampler (to `output / 2` channels) closes the stage.
        upsample: Option<bool>,
    }

    /// The decoder's width after `conv_in` and its up stages.
    fn decoder(cfg: &WanVaeConfig) -> (u64, Vec<UpStage>) {
        let base = cfg.decoder_base_dim.unwrap_or(cfg.base_dim) as u64;
        let stages = cfg.dim_mult.len();
        let dims: Vec<u64> = std::iter::once(cfg.dim_mult[stages - 1])
            .chain(cfg.dim_mult.iter().rev().copied())
            .map(|m| m as u64 * base)
            .collect();
        let up = (0..stages)
            .map(|i| UpStage {
                input: if i > 0 { dims[i] / 2 } else { dims[i] },
                output: dims[i + 1],
                resnets: cfg.num_res_blocks + 1,
                upsample: (i != stages - 1).then(|| cfg.temperal_downsample[stages - 2 - i]),
            })
            .collect();
        (dims[0], up)
    }

    /// The VAE (encoder and decoder), as `AutoencoderKLWan::new` requests it; it runs in f32.
    pub fn vae(cfg: &WanVaeConfig) -> Params {
        let z = cfg.z_dim as u64;
        let base = cfg.base_dim as u64;
        let stages = cfg.dim_mult.len();
        let dims: Vec<u64> = std::iter::once(1)
            .chain(cfg.dim_mult.iter().copied())
            .map(|m| m as u64 * base)
            .collect();
        let mut n = conv(cfg.in_channels as u64, dims[0], 27);
        let mut scale = 1.0f64;
        for i in 0..stages {
            let mut cin = dims[i];
            for _ in 0..cfg.num_res_blocks {
                n += res_block(cin, dims[i + 1]);
                if cfg.attn_scales.contains(&scale) {
                    n += attention_block(dims[i + 1]);
                }
                cin = dims[i + 1];
            }
            if i != stages - 1 {
                let d = dims[i + 1];
                let temporal = if cfg.temperal_downsample[i] {
                    conv(d, d, 3)
                } else {
                    0
                };
                n += conv(d, d, 9) + temporal;
                scale /= 2.0;
            }
        }
        n += mid_block(dims[stages]) + head(dims[stages], 2 * z);
        n += conv(2 * z, 2 * z, 1) + conv(z, z, 1);
        let (width, up) = decoder(cfg);
        n += conv(z, width, 27) + mid_block(width);
        for s in &up {
            n += res_block(s.input, s.output)
                + (s.resnets as u64 - 1) * res_block(s.output, s.output);
            n += match s.upsample {
                Some(temporal) => {
                    let time_conv = if temporal {
                        conv(s.output, 2 * s.output, 3)
                    } else {
                        0
                    };
                    conv(s.output, s.output / 2, 9) + time_conv
                }
                None => 0,
            };
        }
        let last = up.last().map_or(width, |s| s.output);
        n += head(last, cfg.out_channels as u64);
        Params::f32(n)
    }

    /// Score elements one query chunk of `attention::sdpa` materialises (batch 1).
    fn score_chunk(heads: u64, q_len: u64, kv_len: u64) -> u64 {
        let per_query = (heads * kv_len).max(1);
        let chunk = (MAX_SCORE_ELEMENTS as u64 / per_query).clamp(1, q_len.max(1));
        chunk * per_query
    }

    /// Peak activation bytes of one DiT forward on `latent` `[1, C, F, H, W]` with `text_len`
    /// text tokens: the larger of the self-attention and feed-forward peaks of a block, plus
    /// the RoPE tables, latents and text context that live through the whole forward.
    pub fn transformer_activations(
        cfg: &WanTransformerConfig,
        latent: [usize; 5],
        text_len: usize,
        dtype: DType,
    ) -> u64 {
        let s = dtype.size_in_bytes() as u64;
        let [_, c, f, h, w] = latent;
        let [pt, ph, pw] = cfg.patch_size;
        let tokens = ((f / pt) * (h / ph) * (w / pw)) as u64;
        let (d, heads) = (cfg.inner_dim() as u64, cfg.num_attention_heads as u64);
        let text_len = text_len as u64;
        let hidden = tokens * d * s;
        // The fused CUDA attention (bf16/f16) materialises no scores; f32 takes the chunked path.
        let scores = if matches!(dtype, DType::BF16 | DType::F16) {
            0
        } else {
            score_chunk(heads, tokens, tokens).max(score_chunk(heads, tokens, text_len)) * s
        };
        let attention = ATTENTION_HIDDEN_COPIES * hidden + 2 * scores;
        let chunk = tokens.min(FFN_CHUNK as u64);
        let ffn = FFN_HIDDEN_COPIES * hidden + chunk * (cfg.ffn_dim as u64 + 2 * d) * s;
        let rope = 2 * tokens * (cfg.attention_head_dim / 2) as u64 * F32;
        let latents = LATENT_COPIES * (c * f * h * w) as u64 * F32;
        let text = 2 * text_len * cfg.text_dim as u64 * s + text_len * d * s;
        attention.max(ffn) + rope + latents + text
    }

    /// Peak activation bytes of encoding one prompt of `len` tokens: four f32 score tensors
    /// (scores, position bias and the two masked sums) or the feed-forward's intermediates,
    /// over the f32 residual stream.
    pub fn text_encoder_activations(cfg: &UMT5Config, len: usize, dtype: DType) -> u64 {
        let s = dtype.size_in_bytes() as u64;
        let len = len as u64;
        let scores = cfg.num_heads as u64 * len * len * F32;
        let ffn = len * cfg.d_ff as u64 * (3 * s + F32);
        let hidden = len * cfg.d_model as u64 * F32;
        (4 * scores).max(ffn) + 4 * hidden + 2 * len * cfg.d_model as u64 * s
    }

    /// Bytes of decoding one latent frame of `h x w` latents: every causal conv's cached
    /// frames, the largest chunk's working feature maps and one conv's im2col scratch.
    fn decode_chunk(cfg: &WanVaeConfig, h: usize, w: usize) -> u64 {
        let (width, up) = decoder(cfg);
        let mut px = (h * w) as u64;
        let mut frames = 1;
        // conv_in's input, then the mid block's two residual blocks of two convs each.
        let mut cached = cfg.z_dim as u64 * px + 4 * width * px;
        let mut largest = width * px;
        let mut im2col = 9 * width * px;
        for s in &up {
            let mut cin = s.input;
            for _ in 0..s.resnets {
                cached += (cin + s.output) * px;
                im2col = im2col.max(9 * cin.max(s.output) * px);
                cin = s.output;
            }
            largest = largest.max(frames * s.input.max(s.output) * px);
            if let Some(temporal) = s.upsample {
                if temporal {
                    cached += s.output * px;
                    frames *= 2;
                }
                px *= 4;
                im2col = im2col.max(9 * s.output * px);
            }
        }
        cached += up.last().map_or(width, |s| s.output) * px;
        (CACHE_FRAMES * cached + DECODE_FEATURE_MAPS * largest + im2col.min(CONV_SCRATCH_ELEMENTS))
            * F32
    }

    /// Peak activation bytes of decoding `latent` `[1, C, F, H, W]`, whole or in `tiling`'s
    /// spatial tiles (two rows of decoded tiles wait to be blended).
    pub fn vae_decode_activations(
        cfg: &WanVaeConfig,
        latent: [usize; 5],
        tiling: Option<&WanVaeTiling>,
    ) -> u64 {
        let [_, _, f, h, w] = latent;
        let sf = cfg.scale_factor_spatial();
        let frames_out = ((f.max(1) - 1) * cfg.scale_factor_temporal() + 1) as u64;
        let video_of =
            |h: usize, w: usize| frames_out * (cfg.out_channels * h * sf * w * sf) as u64 * F32;
        let video = video_of(h, w);
        let tiles = tiling.and_then(|t| {
            let tile = (t.tile_min_height / sf, t.tile_min_width / sf);
            let stride_w = t.tile_stride_width / sf;
            let whole = h <= tile.0 && w <= tile.1;
            (!whole && tile.0 > 0 && tile.1 > 0 && stride_w > 0).then(|| {
                let (th, tw) = (tile.0.min(h), tile.1.min(w));
                decode_chunk(cfg, th, tw) + 2 * w.div_ceil(stride_w) as u64 * video_of(th, tw)
            })
        });
        let decoding = tiles.unwrap_or_else(|| decode_chunk(cfg, h, w)) + video;
        decoding.max(VIDEO_COPIES * video)
    }

    /// The plan of a Wan T2V run: the runner's schedule under the run's load policy, each
    /// component's weights in the run dtype (the VAE's in f32) as the run's placement puts
    /// them, and its activations at the run's video size.
    pub fn plan(configs: &WanConfigs, config: &ResolvedConfig) -> anyhow::Result<MemoryPlan> {
        let o = &config.options;
        let placement = wan_t2v::placement(o, configs)?;
        let dtype = config.dtype();
        let latent = configs.latent_shape(o.num_frames, o.height, o.width);
        let text_len = o.max_sequence_length as usize;
        let (te, dit, vae_cfg) = (&configs.text_encoder, &configs.transformer, &configs.vae);
        let footprint = |c: Component| match c {
            Component::TextEncoder => Footprint::placed(
                placement.text_encoder,
                (
                    text_encoder_outer(te).bytes(dtype)
                        - match placement.text_encoder {
                            Residency::Streamed { .. } => text_encoder_table(te).bytes(dtype),
                            _ => 0,
                        },
                    text_encoder_block(te).bytes(dtype),
                    te.num_layers as u64,
                ),
                text_encoder_activations(te, text_len, dtype),
            ),
            Component::Transformer => {
                let layers = dit.num_layers as u64;
                // Step by step, every group is counted as the largest step (an upper bound).
                let (unit, units) = match placement.dit {
                    Residency::Streamed { by_step: true, .. } => {
                        let steps = transformer_steps(dit).map(|p| p.bytes(dtype));
                        (
                            steps.into_iter().max().unwrap_or(0),
                            layers * steps.len() as u64,
                        )
                    }
                    _ => (transformer_block(dit).bytes(dtype), layers),
                };
                Footprint::placed(
                    placement.dit,
                    (transformer_shared(dit).bytes(dtype), unit, units),
                    transformer_activations(dit, latent, text_len, dtype),
                )
            }
            Component::Vae => Footprint::placed(
                placement.vae,
                (vae(vae_cfg).bytes(DType::F32), 0, 0),
                vae_decode_activations(
                    vae_cfg,
                    latent,
                    o.vae_tiling.then(WanVaeTiling::default).as_ref(),
                ),
            ),
        };
        let policy = crate::pipeline::load_policy(config);
        let schedule = Schedule::plan(wan_t2v::stages(), wan_t2v::deferrable(), policy);
        Ok(MemoryPlan::new(wan_t2v::stages(), &schedule, footprint))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{parse, Parsed};
    use crate::models::source::ModelSource;
    use crate::offload::StreamOptions;
    use crate::pipeline::runner::LoadPolicy;
    use crate::pipeline::wan_t2v::WanConfigs;

    /// A resolved `vidgen generate --dry-run --device cpu ARGS`.
    fn resolve(args: &[&str]) -> ResolvedConfig {
        let argv = ["vidgen", "generate", "--dry-run", "--device", "cpu"]
            .iter()
            .chain(args)
            .map(std::ffi::OsString::from);
        match parse(argv).expect("arguments parse") {
            Parsed::Generate(a) => ResolvedConfig::resolve(*a).expect("arguments resolve"),
            Parsed::Info(text) => panic!("not a generate command: {text}"),
        }
    }

    fn wan14b() -> WanConfigs {
        WanConfigs::read(&ModelSource::parse("synthetic:wan2.1-t2v-14b").unwrap()).unwrap()
    }

    #[derive(Copy, Clone, Debug, PartialEq, Eq)]
    enum Toy {
        A,
        B,
    }

    const TOY: &[StageSpec<Toy>] = &[
        StageSpec {
            name: "first",
            uses: &[Toy::A],
        },
        StageSpec {
            name: "second",
            uses: &[Toy::B],
        },
    ];

    /// Components alive but not computing count their idle weights and no activations;
    /// a lazy schedule keeps only the stage's own component.
    #[test]
    fn stages_count_what_the_schedule_keeps_alive() {
        let footprint = |c| match c {
            Toy::A => Footprint {
                active_weights: 1000,
                idle_weights: 100,
                activations: 7,
            },
            Toy::B => Footprint {
                active_weights: 20_000,
                idle_weights: 2_000,
                activations: 30,
            },
        };
        let (a, b) = (footprint(Toy::A), footprint(Toy::B));
        let eager = Schedule::plan(TOY, &[Toy::A, Toy::B], LoadPolicy::Eager);
        let plan = MemoryPlan::new(TOY, &eager, footprint);
        let first = plan.stage("first").unwrap();
        assert_eq!(first.weight_bytes, a.active_weights + b.idle_weights);
        assert_eq!(first.activation_bytes, a.activations);
        assert_eq!(
            first.peak_bytes,
            first.weight_bytes + first.activation_bytes
        );
        let second = plan.stage("second").unwrap();
        assert_eq!(second.weight_bytes, a.idle_weights + b.active_weights);
        assert_eq!(plan.peak().unwrap().name, "second");

        let lazy = Schedule::plan(TOY, &[Toy::A, Toy::B], LoadPolicy::Lazy);
        let plan = MemoryPlan::new(TOY, &lazy, footprint);
        assert_eq!(plan.stage("first").unwrap().weight_bytes, a.active_weights);
        assert_eq!(plan.stage("second").unwrap().weight_bytes, b.active_weights);
    }

    /// Streaming keeps depth + 1 groups on the device while computing and between passes (its
    /// device slots); without a copy stream one group; parked weights leave.
    #[test]
    fn placement_decides_the_weights_on_the_device() {
        let (outer, block, blocks) = (1_000_000, 1_000, 10);
        let whole = outer + block * blocks;
        let streamed = |per_group, stream, depth| Residency::Streamed {
            blocks_per_group: per_group,
            by_step: false,
            options: StreamOptions { stream, depth },
        };
        let at = |r| Footprint::placed(r, (outer, block, blocks), 5);
        assert_eq!(at(Residency::Resident).idle_weights, whole);
        assert_eq!(at(Residency::Parked).active_weights, whole);
        assert_eq!(at(Residency::Parked).idle_weights, 0);
        assert_eq!(at(Residency::OnCpu), Footprint::default());
        let f = at(streamed(2, true, 1));
        assert_eq!(f.active_weights, outer + 2 * 2 * block);
        assert_eq!(f.idle_weights, outer + 2 * 2 * block);
        // Depth beyond the groups there are: every block, never more.
        assert_eq!(at(streamed(4, true, 8)).active_weights, whole);
        let f = at(streamed(3, false, 4));
        assert_eq!(
            (f.active_weights, f.idle_weights),
            (outer + 3 * block, outer)
        );
    }

    /// The plan of 14B with every component resident and loaded eagerly: the candidates in
    /// order, each needing less than the one before here (a precondition the test checks).
    fn resident_14b() -> (
        ResolvedConfig,
        impl Fn(&ResolvedConfig) -> anyhow::Result<MemoryPlan>,
    ) {
        let configs = wan14b();
        let config = resolve(&[
            "--memory-model",
            "discrete",
            "--dtype",
            "bf16",
            "--no-dit-layerwise-offload",
            "--no-dit-cpu-offload",
            "--no-text-encoder-cpu-offload",
            "--no-vae-cpu-offload",
        ]);
        (config, move |c: &ResolvedConfig| wan::plan(&configs, c))
    }

    #[test]
    fn the_first_candidate_that_fits_is_chosen() {
        let (config, plan_for) = resident_14b();
        let current = plan_for(&config).unwrap();
        let generous = current.required_bytes();
        let found = candidates(&config, &plan_for, Some(generous));
        let flags: Vec<String> = found.iter().map(|c| c.flags.join(" ")).collect();
        assert_eq!(
            flags[..5],
            [
                "--dit-layerwise-offload",
                "--dit-layerwise-offload --offload-type leaf-level",
                "--dit-layerwise-offload --offload-type leaf-level --text-encoder-cpu-offload",
                "--dit-layerwise-offload --offload-type leaf-level --text-encoder-cpu-offload --lazy-module-load",
                "--dit-layerwise-offload --offload-type leaf-level --text-encoder-cpu-offload --lazy-module-load --vae-tiling",
            ]
        );
        for (k, c) in found.iter().enumerate() {
            assert!(
                found[..k]
                    .iter()
                    .all(|e| e.plan.required_bytes() > c.plan.required_bytes()),
                "candidate {k} ({}) needs no less than an earlier one",
                flags[k]
            );
            let total = c.plan.required_bytes();
            let chosen = first_fitting(&found, total).expect("a candidate fits");
            assert_eq!(chosen.flags, c.flags, "device of {:.2} GiB", gib(total));
            let text = advice(&config, &plan_for, Some(total));
            assert!(
                text.contains(&format!("predicted to fit: {}", flags[k])),
                "{text}"
            );
            assert!(text.contains(&format!("{:.2} GiB", gib(total))), "{text}");
        }
        let too_small = found.last().unwrap().plan.required_bytes() - 1;
        assert!(first_fitting(&found, too_small).is_none());
    }

    /// With the device a little smaller than the tiled 81-frame run needs, the last candidate
    /// is the most frames (4k+1) that fit: four more would not.
    #[test]
    fn fewer_frames_are_the_most_that_fit() {
        let (config, plan_for) = resident_14b();
        let all_savings = candidates(&config, &plan_for, None);
        let total = all_savings.last().unwrap().plan.required_bytes() - 1;
        let found = candidates(&config, &plan_for, Some(total));
        let last = found.last().unwrap();
        let frames: u32 = last
            .flags
            .last()
            .and_then(|f| f.strip_prefix("--num-frames "))
            .expect("a --num-frames candidate")
            .parse()
            .unwrap();
        assert!(frames < config.options.num_frames && (frames - 1).is_multiple_of(4));
        assert!(last.plan.fits(total));
        let mut more = config.clone();
        for s in &SAVINGS {
            (s.turn_on)(&mut more.options);
        }
        more.options.num_frames = frames + 4;
        assert!(!plan_for(&more).unwrap().fits(total));
        assert_eq!(first_fitting(&found, total).unwrap().flags, last.flags);
    }

    /// On unified memory the device rules turn host offload off, so it is never offered.
    #[test]
    fn savings_the_device_would_undo_are_not_offered() {
        let configs = wan14b();
        let config = resolve(&["--memory-model", "unified", "--no-lazy-module-load"]);
        let plan_for = |c: &ResolvedConfig| wan::plan(&configs, c);
        let found = candidates(&config, &plan_for, Some(1 << 40));
        assert!(!found.is_empty());
        for c in &found {
            assert!(
                !c.flags.iter().any(|f| f.contains("offload")),
                "{:?}",
                c.flags
            );
        }
        assert_eq!(found[0].flags, ["--lazy-module-load"]);
    }

    /// Nothing fits a device smaller than the leanest candidate: the advice says so and names
    /// the leanest; without a known size, or when the run's own options should fit, it names the
    /// leanest too.
    #[test]
    fn advice_without_a_fit_names_the_leanest() {
        let (config, plan_for) = resident_14b();
        let text = advice(&config, &plan_for, Some(GIB));
        assert!(
            text.contains("nothing the plan knows is predicted to fit"),
            "{text}"
        );
        assert!(text.contains("--num-frames 1 (predicted peak"), "{text}");
        let current = plan_for(&config).unwrap();
        for total in [None, Some(current.required_bytes())] {
            let text = advice(&config, &plan_for, total);
            assert!(text.contains(&current.describe_peak()), "{text}");
            assert!(
                text.contains("the leanest option set: --dit-layerwise-offload"),
                "{text}"
            );
            assert_eq!(
                text.contains("other processes may hold device memory"),
                total.is_some(),
                "{text}"
            );
        }
    }
}
