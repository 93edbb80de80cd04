//! The denoising loop every family runs around its own step: Ctrl-C honoured before each step,
//! each forward timed, the latents checked finite and the step shown after it, the forward
//! times reported at the end. (Guidance's combine is [`crate::models::guidance`].)

use super::frame::Frame;
use super::interrupt;
use super::jobs::Job;
use super::stages;
use crate::models::guidance::guide;
use anyhow::Result;
use candle_core::{Device, Tensor};
use std::ops::Range;

/// A denoising loop of `total` steps, possibly run in parts (one per expert).
pub(crate) struct Denoise<'a> {
    frame: &'a Frame,
    total: usize,
    forwards: Forwards<'a>,
}

/// The transformer forwards of a loop, each timed.
pub(crate) struct Forwards<'a> {
    device: &'a Device,
    seconds: Vec<f64>,
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
                seconds,
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

    /// The forward times so far, for the loop's next part.
    pub fn into_seconds(self) -> Vec<f64> {
        self.forwards.seconds
    }

    /// Ends the loop: its forward times are the job's `forward_seconds`.
    pub fn finish(self, job: &mut Job) {
        stages::report_forwards(&self.frame.progress, job, self.forwards.seconds);
    }

    /// Ends the loop ([`Self::finish`]) with the denoised `latents`, which wait for decoding
    /// in host memory; the prompt embeddings are spent.
    pub fn finish_with(self, job: &mut Job, latents: &Tensor) -> Result<()> {
        self.finish(job);
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
        stages::timed(self.device, &mut self.seconds, forward)
    }

    /// One step's prediction with real classifier-free guidance: the forward of the prompt's
    /// conditioning `cond`, and where `negative` gives the negative prompt's and the scale,
    /// that forward too, combined in the predictions' dtype ([`guide`]).
    pub fn guided<C>(
        &mut self,
        cond: C,
        negative: Option<(C, f64)>,
        mut forward: impl FnMut(C) -> candle_core::Result<Tensor>,
    ) -> Result<Tensor> {
        let noise_cond = self.run(|| forward(cond))?;
        Ok(match negative {
            Some((negative, scale)) => guide(&self.run(|| forward(negative))?, &noise_cond, scale)?,
            None => noise_cond,
        })
    }
}
