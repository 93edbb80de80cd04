//! The block protocol: how a model is built whole, or as its outer part plus repeated blocks (or
//! steps of blocks) built apart, so that an engine can place it without the model knowing how
//! ([`Blockwise`]); the common DiT shape declared by a few facts ([`RepeatedBlocks`]); and how
//! model-side code runs a placed model's blocks, wherever they are ([`PlacedBlocks`]).

use crate::models::step_cache::{
    BlockHooks, BlockStreams, Forward, HookedBlocks, StepCache, Through,
};
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// A model with no repeated blocks to stream (a VAE, an image encoder): resident or parked
/// whole. `$new` builds it from its config and root `VarBuilder`.
#[macro_export]
macro_rules! placed_whole {
    ($model:ty, $config:ty, $new:path) => {
        impl $crate::models::blocks::Blockwise for $model {
            type Config = $config;
            type Block = ();
            fn whole(cfg: &$config, vb: candle_nn::VarBuilder) -> candle_core::Result<Self> {
                $new(cfg, vb)
            }
        }
    };
}

/// A model the engine can place: built whole, or as its outer part plus blocks built apart.
pub trait Blockwise: Sized + Send + Sync + 'static {
    type Config: Clone + Send + Sync + 'static;
    type Block: 'static;
    /// The module paths diffusers' layerwise casting (`--storage-dtype`) leaves alone in this
    /// model beyond its defaults: the class's `_skip_layerwise_casting_patterns` and
    /// `_keep_in_fp32_modules`.
    const LAYERWISE_CASTING_SKIP: &'static [&'static str] = &[];
    /// The whole model from its root `VarBuilder`.
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self>;
    /// Everything but the repeated blocks; lookup tables (exact on any device) may come from
    /// `host_vb`, in host memory, when the blocks are streamed. A model without blocks is its
    /// whole self.
    fn outer(cfg: &Self::Config, vb: VarBuilder, host_vb: VarBuilder) -> candle_core::Result<Self> {
        let _ = host_vb;
        Self::whole(cfg, vb)
    }
    /// How many repeated blocks stream one by one (0: the model is placed whole).
    fn num_blocks(cfg: &Self::Config) -> usize {
        let _ = cfg;
        0
    }
    /// Block `i` from the root `VarBuilder`.
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> candle_core::Result<Self::Block> {
        let _ = (cfg, vb);
        candle_core::bail!("block {i} of a model that is placed whole, not block by block")
    }
    /// The kind of block `i` (blocks of different kinds, e.g. HunyuanVideo's refiner, dual- and
    /// single-stream blocks, never share a group, as diffusers groups each block list apart).
    fn block_kind(cfg: &Self::Config, i: usize) -> usize {
        let _ = (cfg, i);
        0
    }
    /// How many steps a block can be split into for finer streaming (1: it cannot); the most
    /// of any block where kinds differ.
    fn steps(_: &Self::Config) -> usize {
        1
    }
    /// How many steps block `i` splits into (at most [`Self::steps`]).
    fn block_steps(cfg: &Self::Config, i: usize) -> usize {
        let _ = i;
        Self::steps(cfg)
    }
    /// Step `step` of block `i` alone, as a block that runs just that step.
    fn block_step(
        cfg: &Self::Config,
        i: usize,
        step: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<Self::Block> {
        let _ = step;
        Self::block(cfg, i, vb)
    }
}

/// Every block of `M`, built from the root `vb` as the engine builds each: what the whole model
/// holds beyond its outer part.
pub fn all_blocks<M: Blockwise>(
    cfg: &M::Config,
    vb: &VarBuilder,
) -> candle_core::Result<Vec<M::Block>> {
    (0..M::num_blocks(cfg))
        .map(|i| M::block(cfg, i, vb.clone()))
        .collect()
}

/// The common DiT shape, declared by its few facts: an outer part and one list of like blocks
/// under one weight prefix, each block optionally split into steps. Every such model is
/// [`Blockwise`] by the one implementation below.
pub trait RepeatedBlocks: Sized + Send + Sync + 'static {
    type Config: Clone + Send + Sync + 'static;
    type Block: 'static;
    /// What a block can be split into for finer streaming (`()` where it cannot).
    type Step: Copy + 'static;
    /// Where the block list's weights sit under the root: block `i` at `{BLOCKS}.{i}`.
    const BLOCKS: &'static str;
    /// [`Blockwise::LAYERWISE_CASTING_SKIP`].
    const LAYERWISE_CASTING_SKIP: &'static [&'static str] = &[];
    /// Every step of a block, in execution order (empty: a block streams whole).
    const STEPS: &'static [Self::Step];
    /// The whole model from its root `VarBuilder`.
    fn new(cfg: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self>;
    /// Everything but the blocks, from the root `VarBuilder`.
    fn new_without_blocks(cfg: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self>;
    /// How many blocks the list holds.
    fn num_layers(cfg: &Self::Config) -> usize;
    /// Block `i`, whole; `vb` points at `{BLOCKS}.{i}`.
    fn new_block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> candle_core::Result<Self::Block>;
    /// Block `i` with only `steps` (some of [`Self::STEPS`]); `vb` points at `{BLOCKS}.{i}`. A
    /// model whose blocks do not split (no steps) is never asked.
    fn with_steps(
        cfg: &Self::Config,
        i: usize,
        vb: VarBuilder,
        steps: &[Self::Step],
    ) -> candle_core::Result<Self::Block> {
        let _ = steps;
        Self::new_block(cfg, i, vb)
    }
}

/// [`RepeatedBlocks`] for a DiT of the usual shape: the model built by `new` and
/// `new_without_blocks(cfg, vb)`, `cfg.num_layers` blocks under `$prefix.{i}`, each built by
/// `$block::new(cfg, vb)` or, one step at a time, `$block::with_steps(cfg, vb, steps)` over
/// `$step::ALL`; `skip` is its [`Blockwise::LAYERWISE_CASTING_SKIP`].
#[macro_export]
macro_rules! repeated_blocks {
    ($model:ty, $config:ty, $block:ty, $step:ty, $prefix:literal, skip: $skip:expr) => {
        impl $crate::models::blocks::RepeatedBlocks for $model {
            type Config = $config;
            type Block = $block;
            type Step = $step;
            const BLOCKS: &'static str = $prefix;
            const LAYERWISE_CASTING_SKIP: &'static [&'static str] = $skip;
            const STEPS: &'static [$step] = &<$step>::ALL;
            fn new(cfg: &$config, vb: candle_nn::VarBuilder) -> candle_core::Result<Self> {
                <$model>::new(cfg, vb)
            }
            fn new_without_blocks(
                cfg: &$config,
                vb: candle_nn::VarBuilder,
            ) -> candle_core::Result<Self> {
                <$model>::new_without_blocks(cfg, vb)
            }
            fn num_layers(cfg: &$config) -> usize {
                cfg.num_layers
            }
            fn new_block(
                cfg: &$config,
                _: usize,
                vb: candle_nn::VarBuilder,
            ) -> candle_core::Result<$block> {
                <$block>::new(cfg, vb)
            }
            fn with_steps(
                cfg: &$config,
                _: usize,
                vb: candle_nn::VarBuilder,
                steps: &[$step],
            ) -> candle_core::Result<$block> {
                <$block>::with_steps(cfg, vb, steps)
            }
        }
    };
}

/// [`Blockwise`] for a DiT whose blocks come in kinds, each kind its own weight list and its own
/// steps (FLUX.1's dual- and single-stream blocks; HunyuanVideo's refiner, dual- and
/// single-stream ones): the model built by `new` and `new_without_blocks(cfg, vb)`; the config
/// numbers the blocks in execution order (`cfg.num_blocks()`, and `cfg.block_kind(i)`: the kind
/// and the index within it); block `i` is built from the root by `$block::new(cfg, i, vb)` or,
/// one step at a time, `$block::with_steps(cfg, i, vb, steps)`; `steps` gives a kind's steps
/// (every kind listed in `$kind::ALL`); `skip` is [`Blockwise::LAYERWISE_CASTING_SKIP`].
#[macro_export]
macro_rules! kinded_blocks {
    ($model:ty, $config:ty, $block:ty, $kind:ty, skip: $skip:expr,
     steps: |$cfg:pat_param, $k:pat_param| $steps:expr) => {
        impl $crate::models::blocks::Blockwise for $model {
            const LAYERWISE_CASTING_SKIP: &'static [&'static str] = $skip;
            type Config = $config;
            type Block = $block;
            fn whole(cfg: &$config, vb: candle_nn::VarBuilder) -> candle_core::Result<Self> {
                <$model>::new(cfg, vb)
            }
            fn outer(
                cfg: &$config,
                vb: candle_nn::VarBuilder,
                _: candle_nn::VarBuilder,
            ) -> candle_core::Result<Self> {
                <$model>::new_without_blocks(cfg, vb)
            }
            fn num_blocks(cfg: &$config) -> usize {
                cfg.num_blocks()
            }
            fn block_kind(cfg: &$config, i: usize) -> usize {
                cfg.block_kind(i)
                    .map_or(usize::MAX, |(kind, _)| kind as usize)
            }
            fn block(
                cfg: &$config,
                i: usize,
                vb: candle_nn::VarBuilder,
            ) -> candle_core::Result<$block> {
                <$block>::new(cfg, i, vb)
            }
            fn steps(cfg: &$config) -> usize {
                let steps_of = |$cfg: &$config, $k: $kind| $steps;
                <$kind>::ALL
                    .iter()
                    .map(|&kind| steps_of(cfg, kind).len())
                    .max()
                    .unwrap_or(1)
            }
            fn block_steps(cfg: &$config, i: usize) -> usize {
                let steps_of = |$cfg: &$config, $k: $kind| $steps;
                cfg.block_kind(i)
                    .map_or(1, |(kind, _)| steps_of(cfg, kind).len())
            }
            fn block_step(
                cfg: &$config,
                i: usize,
                step: usize,
                vb: candle_nn::VarBuilder,
            ) -> candle_core::Result<$block> {
                let steps_of = |$cfg: &$config, $k: $kind| $steps;
                let steps = steps_of(cfg, cfg.block_kind(i)?.0);
                match steps.get(step) {
                    Some(s) => <$block>::with_steps(cfg, i, vb, std::slice::from_ref(s)),
                    None => candle_core::bail!("step {step} of a {}-step block", steps.len()),
                }
            }
        }
    };
}

/// Block `i`'s `VarBuilder` under the root `vb`.
fn block_vb<M: RepeatedBlocks>(vb: VarBuilder, i: usize) -> VarBuilder {
    vb.pp(format!("{}.{i}", M::BLOCKS))
}

/// A model of the common DiT shape streams its blocks (and, where they split, their steps).
impl<M: RepeatedBlocks> Blockwise for M {
    type Config = M::Config;
    type Block = M::Block;
    const LAYERWISE_CASTING_SKIP: &'static [&'static str] = M::LAYERWISE_CASTING_SKIP;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self> {
        M::new(cfg, vb)
    }
    fn outer(cfg: &Self::Config, vb: VarBuilder, _: VarBuilder) -> candle_core::Result<Self> {
        M::new_without_blocks(cfg, vb)
    }
    fn num_blocks(cfg: &Self::Config) -> usize {
        M::num_layers(cfg)
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> candle_core::Result<Self::Block> {
        M::new_block(cfg, i, block_vb::<M>(vb, i))
    }
    fn steps(_: &Self::Config) -> usize {
        M::STEPS.len().max(1)
    }
    fn block_step(
        cfg: &Self::Config,
        i: usize,
        step: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<Self::Block> {
        if M::STEPS.is_empty() {
            return Self::block(cfg, i, vb);
        }
        M::with_steps(cfg, i, block_vb::<M>(vb, i), &[M::STEPS[step]])
    }
}

/// A DiT's forward once its own `prepare` has made the inputs: the blocks thread a state taken
/// from the inputs, each block mapping it to the next, and the model finishes from the last
/// ([`PlacedBlocks::forward`] runs it wherever the blocks are placed).
pub trait BlockForward: Blockwise {
    /// What `prepare` makes: what the blocks and the finish read, and the first state.
    type Inputs;
    /// What the blocks thread.
    type State;
    type Output;
    /// The configuration the model was built with.
    fn config(&self) -> &Self::Config;
    /// The blocks loaded with the model (none when they are placed apart).
    fn resident_blocks(&self) -> &[Self::Block];
    /// Takes the first state from the inputs.
    fn first_state(inputs: &mut Self::Inputs) -> candle_core::Result<Self::State>;
    /// One block on the state.
    fn through(
        block: &Self::Block,
        state: &Self::State,
        inputs: &Self::Inputs,
    ) -> candle_core::Result<Self::State>;
    /// The output from the last state.
    fn finish_forward(
        &self,
        state: Self::State,
        inputs: &Self::Inputs,
    ) -> candle_core::Result<Self::Output>;

    /// The forward of a model holding its blocks: the first state through every resident
    /// block, then the finish. A model built without them (they are placed apart) refuses.
    fn forward_resident(&self, mut inputs: Self::Inputs) -> candle_core::Result<Self::Output> {
        let (held, all) = (
            self.resident_blocks().len(),
            Self::num_blocks(self.config()),
        );
        if held != all {
            candle_core::bail!(
                "transformer holds {held} of {all} blocks; run them through blocks() instead"
            );
        }
        let mut state = Self::first_state(&mut inputs)?;
        for block in self.resident_blocks() {
            state = Self::through(block, &state, &inputs)?;
        }
        self.finish_forward(state, &inputs)
    }
}

/// A DiT block that runs on a state `S` with its forward's inputs `I`, asking `hooks` (a step
/// cache) for the outputs inside it that its model hands one (those
/// [`HookedBlocks::names`] lists).
pub trait HookedBlock<S, I> {
    fn forward_hooked(
        &self,
        state: &S,
        inputs: &I,
        hooks: &mut dyn BlockHooks,
    ) -> candle_core::Result<S>;
}

/// A [`BlockForward`] DiT whose blocks take diffusers' step caches (`--cache ...`): which of its
/// blocks diffusers hooks, and how its state splits into diffusers' streams; its blocks hand the
/// cache their outputs inside ([`HookedBlock`]). Declaring it is all a model does to take them.
pub trait CachedForward:
    BlockForward<State: Clone, Block: HookedBlock<Self::State, Self::Inputs>>
{
    /// The blocks diffusers' cache hooks see, among those the forward folds.
    fn hooked_blocks(&self) -> HookedBlocks;
    /// A state's streams, diffusers' `hidden_states` (the video or image tokens) first.
    fn streams(state: &Self::State, inputs: &Self::Inputs) -> candle_core::Result<Vec<Tensor>>;
    /// The state between whole blocks of `streams`.
    fn state(streams: Vec<Tensor>, inputs: &Self::Inputs) -> candle_core::Result<Self::State>;
    /// [`BlockForward::finish_forward`], the output projection's output through `project` (a
    /// step cache's, which may stand in for it).
    fn finish_hooked(
        &self,
        state: Self::State,
        inputs: &Self::Inputs,
        project: &mut Through,
    ) -> candle_core::Result<Self::Output>;
}

/// A [`CachedForward`] model's states as a step cache reads them.
struct StreamsOf<'i, M: CachedForward>(&'i M::Inputs);

impl<M: CachedForward> BlockStreams<M::State> for StreamsOf<'_, M> {
    fn streams(&self, state: &M::State) -> candle_core::Result<Vec<Tensor>> {
        M::streams(state, self.0)
    }

    fn state(&self, streams: Vec<Tensor>) -> candle_core::Result<M::State> {
        M::state(streams, self.0)
    }
}

/// [`BlockForward`] for a DiT whose `prepare` makes `$inputs`, whose blocks (its `blocks()`)
/// thread the `$state` that `$inputs::$take` takes through `Block::forward(&state, &inputs)`,
/// and whose `$output` is `$finish` of the model, the last state and the inputs.
#[macro_export]
macro_rules! block_forward {
    ($model:ty, $inputs:ty, $take:ident, $state:ty, |$m:ident, $s:ident, $i:ident| $finish:expr => $output:ty) => {
        impl $crate::models::blocks::BlockForward for $model {
            type Inputs = $inputs;
            type State = $state;
            type Output = $output;
            fn config(&self) -> &Self::Config {
                self.config()
            }
            fn resident_blocks(&self) -> &[Self::Block] {
                self.blocks()
            }
            fn first_state(inputs: &mut $inputs) -> candle_core::Result<$state> {
                inputs.$take()
            }
            fn through(
                block: &Self::Block,
                state: &$state,
                inputs: &$inputs,
            ) -> candle_core::Result<$state> {
                block.forward(state, inputs)
            }
            fn finish_forward(&self, $s: $state, $i: &$inputs) -> candle_core::Result<$output> {
                let $m = self;
                $finish
            }
        }
    };
}

/// [`CachedForward`] for a DiT whose blocks thread the video tokens alone (one `Tensor`
/// stream), whose `finish_projecting(x, inputs, project)` is its output head and whose config
/// names the hooked blocks ([`crate::models::video::DenoiseActivations::hooked_blocks`]).
#[macro_export]
macro_rules! video_tokens_cached_forward {
    ($model:ty, $inputs:ty) => {
        impl $crate::models::blocks::CachedForward for $model {
            fn finish_hooked(
                &self,
                x: candle_core::Tensor,
                inputs: &$inputs,
                project: &mut $crate::models::step_cache::Through,
            ) -> candle_core::Result<candle_core::Tensor> {
                self.finish_projecting(&x, inputs, project)
            }

            fn hooked_blocks(&self) -> $crate::models::step_cache::HookedBlocks {
                $crate::models::video::DenoiseActivations::hooked_blocks(self.config())
            }

            fn streams(
                x: &candle_core::Tensor,
                _: &$inputs,
            ) -> candle_core::Result<Vec<candle_core::Tensor>> {
                $crate::models::step_cache::BlockStreams::streams(
                    &$crate::models::step_cache::HiddenStates,
                    x,
                )
            }

            fn state(
                streams: Vec<candle_core::Tensor>,
                _: &$inputs,
            ) -> candle_core::Result<candle_core::Tensor> {
                $crate::models::step_cache::BlockStreams::state(
                    &$crate::models::step_cache::HiddenStates,
                    streams,
                )
            }
        }
    };
}

/// A placed model (its outer part when its blocks are apart) for one use: borrowed where it
/// stays on the device, or moved in for this use alone, its device memory freed on drop.
pub enum OuterUse<'a, M> {
    Borrowed(&'a M),
    Moved(M),
}

impl<M> std::ops::Deref for OuterUse<'_, M> {
    type Target = M;
    fn deref(&self) -> &M {
        match self {
            OuterUse::Borrowed(m) => m,
            OuterUse::Moved(m) => m,
        }
    }
}

/// A placed model's blocks, wherever they are (resident, streamed through the device or
/// gathered from shards), run in order: how model-side code runs a placed model without
/// knowing how it is placed.
pub trait PlacedBlocks<M: Blockwise> {
    /// The model (its outer part when its blocks are apart) for one use: hold it no longer
    /// than the use, since it may be moved in for it alone (leaf level's outer part).
    fn model(&self) -> candle_core::Result<OuterUse<'_, M>>;

    /// Threads `state` through every block in order, streamed, gathered or resident
    /// (`resident` lists them): each block maps the state to the next. Errors come back as the
    /// models' own error type, messages kept.
    fn fold_blocks<'b, T>(
        &'b self,
        resident: impl FnOnce(&'b M) -> &'b [M::Block],
        init: T,
        f: impl FnMut(&M::Block, &T) -> candle_core::Result<T>,
    ) -> candle_core::Result<T>;

    /// One forward of a [`BlockForward`] model from its prepared `inputs`: every block in order,
    /// then the finish.
    fn forward(&self, mut inputs: M::Inputs) -> candle_core::Result<M::Output>
    where
        M: BlockForward,
    {
        let state = M::first_state(&mut inputs)?;
        let state = self.fold_blocks(M::resident_blocks, state, |block, state| {
            M::through(block, state, &inputs)
        })?;
        self.model()?.finish_forward(state, &inputs)
    }

    /// [`Self::forward`] through a step cache where `cache` gives one (the forward's pass and
    /// timestep with it): the cache decides which blocks run.
    fn forward_cached(
        &self,
        mut inputs: M::Inputs,
        cache: Option<(&mut StepCache, Forward)>,
    ) -> candle_core::Result<M::Output>
    where
        M: CachedForward,
    {
        let Some((cache, step)) = cache else {
            return self.forward(inputs);
        };
        let state = M::first_state(&mut inputs)?;
        let streams = StreamsOf::<M>(&inputs);
        let hooked = self.model()?.hooked_blocks();
        let state = cache.through_blocks(
            step,
            state,
            hooked,
            &streams,
            |state, f| self.fold_blocks(M::resident_blocks, state, |block, s| f(block, s)),
            |block, state, hooks| block.forward_hooked(state, &inputs, hooks),
        )?;
        self.model()?
            .finish_hooked(state, &inputs, &mut |compute| cache.project(step, compute))
    }

    /// [`Self::fold_blocks`] over several independent states at once: each block maps every
    /// state in turn (`f` gets the state's index), so a streamed part's blocks pass once for all
    /// of them, and each state ends as folding it alone would leave it.
    fn fold_blocks_each<'b, T>(
        &'b self,
        resident: impl FnOnce(&'b M) -> &'b [M::Block],
        init: Vec<T>,
        mut f: impl FnMut(&M::Block, usize, &T) -> candle_core::Result<T>,
    ) -> candle_core::Result<Vec<T>> {
        self.fold_blocks(resident, init, |block, states| {
            states
                .iter()
                .enumerate()
                .map(|(i, state)| f(block, i, state))
                .collect()
        })
    }
}
