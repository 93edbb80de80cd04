//! Layers that work on a large activation in runs along one axis (frames, channels, samples),
//! each run written into one output as it is computed: the layer holds its input, its output and
//! one run's temporaries instead of every temporary at full size.

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

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

/// Runs of groups a GroupNorm works in (at most).
const NORM_RUNS: usize = 8;

/// `nn.GroupNorm` over channel-major `[B, C, ...]`, computed as candle's `GroupNorm` computes it
/// (f32 statistics for half precision) but over runs of groups written into one output: a
/// group's statistics are its own, so the result is the same and the temporaries are a run's.
#[derive(Debug, Clone)]
pub struct RunGroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: usize,
    eps: f64,
}

impl RunGroupNorm {
    pub fn new(groups: usize, channels: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(channels, "weight", candle_nn::Init::Const(1.))?,
            bias: vb.get_with_hints(channels, "bias", candle_nn::Init::Const(0.))?,
            groups,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let c = dims[1];
        let per_group = c / self.groups;
        let run = self.groups.div_ceil(NORM_RUNS).max(1);
        // Runs of whole groups, counted in channels.
        in_runs(c, run * per_group, 1, |c0, cn| {
            self.normalize(
                &x.narrow(1, c0, cn)?,
                cn / per_group,
                &self.weight.narrow(0, c0, cn)?,
                &self.bias.narrow(0, c0, cn)?,
            )
        })
    }

    /// candle's `GroupNorm::forward` on `groups` groups, one op per statement.
    fn normalize(
        &self,
        x: &Tensor,
        groups: usize,
        weight: &Tensor,
        bias: &Tensor,
    ) -> Result<Tensor> {
        let shape = x.dims().to_vec();
        let (b, c) = (shape[0], shape[1]);
        let hidden = shape[2..].iter().product::<usize>() * c / groups;
        let internal = match x.dtype() {
            DType::F16 | DType::BF16 => DType::F32,
            d => d,
        };
        let mut y = x
            .contiguous()?
            .reshape((b, groups, hidden))?
            .to_dtype(internal)?;
        let mean = (y.sum_keepdim(2)? / hidden as f64)?;
        y = y.broadcast_sub(&mean)?;
        let var = (y.sqr()?.sum_keepdim(2)? / hidden as f64)?;
        y = y.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        y = y.to_dtype(x.dtype())?.reshape(shape.as_slice())?;
        let mut w_dims = vec![1; shape.len()];
        w_dims[1] = c;
        y = y.broadcast_mul(&weight.reshape(w_dims.as_slice())?)?;
        y.broadcast_add(&bias.reshape(w_dims.as_slice())?)?
            .contiguous()
    }
}
