//! Layers that work on a large activation in runs along one axis (frames, channels, samples),
//! each run written into one output as it is computed: the layer holds its input, its output and
//! one run's temporaries instead of every temporary at full size.

use candle_core::{Result, Tensor};

/// `f(first, n)` (the output's entries `first..first + n` along `dim`) for runs of at most
/// `per_run` of `len` entries, written into one output (a single run is returned as it is).
pub fn in_runs(
    len: usize,
    per_run: usize,
    dim: usize,
    mut f: impl FnMut(usize, usize) -> Result<Tensor>,
) -> Result<Tensor> {
    let per_run = per_run.max(1);
    if per_run >= len {
        return f(0, len);
    }
    let mut out: Option<Tensor> = None;
    for first in (0..len).step_by(per_run) {
        let run = f(first, per_run.min(len - first))?.contiguous()?;
        let out = match &mut out {
            Some(out) => out,
            None => {
                let mut dims = run.dims().to_vec();
                dims[dim] = len;
                out.insert(Tensor::zeros(dims, run.dtype(), run.device())?)
            }
        };
        out.slice_set(&run, dim, first)?;
    }
    out.ok_or_else(|| candle_core::Error::Msg("nothing to compute in runs".into()))
}
