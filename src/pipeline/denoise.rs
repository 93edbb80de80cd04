//! The denoising loop every family runs around its own step: Ctrl-C honoured before each step,
//! each forward timed (and run through the step cache `--cache` asks for), the latents checked
//! finite and the step shown after it, the forward times and what the cache skipped reported
//! at the end. (Guidance's combine is [`crate::models::guidance`].)

use super::frame::Frame;
use super::interrupt;
use super::jobs::Job;
use super::placement::Held;
use super::stages;
use crate::models::blocks::{CachedForward, PlacedBlocks};
use crate::models::guidance::guide;
use crate::models::sage_attention::{self, AttentionKind};
use crate::models::step_cache::{Forward, Pass, StepCache};
use anyhow::Result;
use candle_core::{Device, Tensor};
use std::ops::Range;

/// A denoising loop of `total` steps, possibly run in parts (one per expert).
pub(crate) struct Denoise<'a> {
    frame: &'a Frame,
    total: usize,
    forwards: Forwards<'a>,
}

/// The transformer forwards of a loop, each timed, and the loop's step cache (one per
/// transformer: each has its own hooks in diffusers).
pub(crate) struct Forwards<'a> {
    device: &'a Device,
    /// How each forward's attention computes (`--attention`).
    attention: AttentionKind,
    seconds: Vec<f64>,
    cache: Option<StepCache>,
}

impl<'a> Denoise<'a> {
    /// A loop of `total` steps on `frame`'s device, run whole ([`Self::run`] over every step).
    pub fn all(
        frame: &'a Frame,
        total: usize,
        step: impl FnMut(&mut Forwards<'a>, usize) -> Result<Tensor>,
    ) -> Result<Self> {
        let mut denoise = Self::resume(frame, total, Vec::new());
        denoise.run(0..total, step)?;
        Ok(denoise)
    }

    /// A loop whose earlier part (another expert's stage) took `seconds` of forwards.
    pub fn resume(frame: &'a Frame, total: usize, seconds: Vec<f64>) -> Self {
        Denoise {
            frame,
            total,
            forwards: Forwards {
                device: &frame.device,
                attention: frame.config.generation().attention,
                seconds,
                cache: frame.config.generation().cache.as_ref().map(StepCache::new),
            },
        }
    }

    /// Runs steps `range`: `step(forwards, i)` runs step i's forwards through `forwards` and
    /// gives the latents it leaves, which must be finite.
    pub fn run(
        &mut self,
        range: Range<usize>,
        mut step: impl FnMut(&mut Forwards<'a>, usize) -> Result<Tensor>,
    ) -> Result<()> {
        for i in range {
            interrupt::check()?;
            let latents = step(&mut self.forwards, i)?;
            stages::step_done(&self.frame.progress, &latents, i + 1, self.total)?;
        }
        Ok(())
    }

    /// How many forwards ran so far.
    pub fn forwards_run(&self) -> usize {
        self.forwards.seconds.len()
    }

    /// Ends this part of the loop (another transformer runs the next): what its cache skipped
    /// is recorded in `job`; gives the forward times so far.
    pub fn into_seconds(self, job: &mut Job) -> Result<Vec<f64>> {
        if let Some(cache) = &self.forwards.cache {
            stages::record_cache(job, cache, &self.frame.progress)?;
        }
        Ok(self.forwards.seconds)
    }

    /// Ends the loop: what its cache skipped is recorded in `job`, its forward times are the
    /// job's `forward_seconds`.
    pub fn finish(self, job: &mut Job) -> Result<()> {
        let progress = &self.frame.progress;
        let generation = self.frame.config.generation();
        let (fp8, attention) = (generation.fp8_matmul, generation.attention);
        let seconds = self.into_seconds(job)?;
        stages::report_forwards(progress, job, seconds);
        if fp8 {
            let products = crate::models::fp8::products();
            progress.note(&format!(
                "  fp8 matmuls: {products} products so far in this process"
            ));
        }
        if attention == AttentionKind::Sage {
            let calls = sage_attention::calls();
            progress.note(&format!(
                "  8-bit attention: {calls} attentions so far in this process"
            ));
        }
        Ok(())
    }

    /// Ends the loop ([`Self::finish`]) with the denoised `latents`, which wait for decoding
    /// in host memory; the prompt embeddings are spent.
    pub fn finish_with(self, job: &mut Job, latents: &Tensor) -> Result<()> {
        self.finish(job)?;
        job.latents = Some(latents.to_device(&Device::Cpu)?);
        job.prompt_embeds = None;
        job.prompt_mask = None;
        job.negative_embeds = None;
        Ok(())
    }
}

impl Forwards<'_> {
    /// Runs one forward, timed (waiting for the device, so the time is the work's).
    pub fn run<T>(&mut self, forward: impl FnOnce() -> candle_core::Result<T>) -> Result<T> {
        let attention = self.attention;
        stages::timed(self.device, &mut self.seconds, || {
            sage_attention::computing(attention, forward)
        })
    }

    /// Runs one forward of `pass` at `timestep`, timed, handing it the loop's step cache where
    /// the run has one.
    pub fn run_cached<T>(
        &mut self,
        pass: Pass,
        timestep: f64,
        forward: impl FnOnce(Option<(&mut StepCache, Forward)>) -> candle_core::Result<T>,
    ) -> Result<T> {
        let cache = self.cache.as_mut().map(|c| (c, Forward { pass, timestep }));
        let attention = self.attention;
        stages::timed(self.device, &mut self.seconds, || {
            sage_attention::computing(attention, || forward(cache))
        })
    }

    /// One forward of the DiT `model` on the inputs `prepare` makes, as pass `pass` at
    /// `timestep`, through the loop's step cache where the run has one (a batched guided
    /// forward is one conditional pass, as diffusers' `cache_context("cond_uncond")`).
    pub fn dit<M: CachedForward>(
        &mut self,
        model: &Held<'_, M>,
        pass: Pass,
        timestep: f64,
        prepare: impl FnOnce(&M) -> candle_core::Result<M::Inputs>,
    ) -> Result<M::Output> {
        self.run_cached(pass, timestep, |cache| {
            // The outer part is let go before the blocks run (it may be held per use).
            let inputs = prepare(&*model.model()?)?;
            model.forward_cached(inputs, cache)
        })
    }

    /// One step's prediction of the DiT `model` at `timestep` with real classifier-free
    /// guidance: the forward of the inputs `prepare` makes of the prompt's conditioning `cond`
    /// and, where `negative` gives the negative prompt's and the scale, that forward too (the
    /// unconditional pass), combined in the predictions' dtype ([`guide`]).
    pub fn guided<M, C>(
        &mut self,
        model: &Held<'_, M>,
        timestep: f64,
        cond: C,
        negative: Option<(C, f64)>,
        mut prepare: impl FnMut(&M, C) -> candle_core::Result<M::Inputs>,
    ) -> Result<Tensor>
    where
        M: CachedForward<Output = Tensor>,
    {
        let noise_cond = self.dit(model, Pass::Cond, timestep, |m| prepare(m, cond))?;
        Ok(match negative {
            Some((negative, scale)) => {
                let noise_uncond =
                    self.dit(model, Pass::Uncond, timestep, |m| prepare(m, negative))?;
                guide(&noise_uncond, &noise_cond, scale)?
            }
            None => noise_cond,
        })
    }
}
