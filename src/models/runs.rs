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

/// How a fused GroupNorm rounds its affine in half precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// Normalized, weighted and biased in f32, rounded once (a norm computed in f32 whole).
    F32,
    /// The normalized value rounded, then each of the weight's product and the bias's sum
    /// (candle's `GroupNorm` on half precision).
    EachOp,
}

/// A GroupNorm as the fused kernels compute it: per-channel `weight` and `bias`, `groups`
/// groups, `eps`, the rounding, an element-wise `(scale, shift)` after the affine where given
/// (of the input's shape and dtype, each op rounded), and whether SiLU follows (of the rounded
/// value, in f32).
pub struct GroupNormSpec<'a> {
    pub weight: &'a Tensor,
    pub bias: &'a Tensor,
    pub groups: usize,
    pub eps: f64,
    pub rounding: Rounding,
    pub modulation: Option<(&'a Tensor, &'a Tensor)>,
    pub silu: bool,
}

/// `spec` applied to `x` by the fused CUDA kernels (three passes over `x`), `Some` on CUDA for
/// bf16 and f32, else `None` (the caller's candle composition runs). Channels are dim
/// `channel_dim`; the first `entry_dims` dims index separately normalized entries and the dims
/// between them and the channels are normalized together (`[B, C, ...]`: 1 and 1;
/// frames-major `[B, T, C, H, W]` over all frames: 1 and 2, each frame alone: 2 and 2).
pub fn fused_group_norm(
    x: &Tensor,
    spec: &GroupNormSpec,
    entry_dims: usize,
    channel_dim: usize,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F32)
        && crate::models::norms::enabled()
    {
        let dims = x.dims();
        if entry_dims > channel_dim || channel_dim >= dims.len() {
            candle_core::bail!("group norm: {dims:?} with channels at {channel_dim}")
        }
        let rows_per_entry = dims[entry_dims..=channel_dim].iter().product();
        let spatial = dims[channel_dim + 1..].iter().product();
        return crate::models::norms::group_norm(x, spec, spatial, rows_per_entry).map(Some);
    }
    let _ = (x, spec, entry_dims, channel_dim);
    Ok(None)
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
        self.forward_then(x, None, false)
    }

    /// The norm, then `* scale + shift` (element-wise, `x`'s shape) where given, then SiLU where
    /// `silu`: one fused pass after the statistics on CUDA, else each op in turn.
    pub fn forward_then(
        &self,
        x: &Tensor,
        modulation: Option<(&Tensor, &Tensor)>,
        silu: bool,
    ) -> Result<Tensor> {
        let spec = GroupNormSpec {
            weight: &self.weight,
            bias: &self.bias,
            groups: self.groups,
            eps: self.eps,
            rounding: Rounding::EachOp,
            modulation,
            silu,
        };
        if let Some(y) = fused_group_norm(x, &spec, 1, 1)? {
            return Ok(y);
        }
        let mut y = self.normalized(x)?;
        if let Some((scale, shift)) = modulation {
            y = ((y * scale)? + shift)?;
        }
        if silu {
            y = y.silu()?;
        }
        Ok(y)
    }

    /// The norm as candle computes it, over runs of groups.
    fn normalized(&self, x: &Tensor) -> Result<Tensor> {
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

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    //! The fused GroupNorm kernels against an f64 reference and against candle's composition.
    use super::*;
    use crate::models::row_ops::test_util::device;
    use candle_core::Device;

    /// GroupNorm in f64 of `x` (host values of `dims`), entries and channels as
    /// [`fused_group_norm`] takes them, then the affine and SiLU where asked.
    fn reference(
        x: &[f32],
        dims: &[usize],
        (entry_dims, channel_dim): (usize, usize),
        (w, b, groups, eps, silu): (&[f32], &[f32], usize, f64, bool),
    ) -> Vec<f64> {
        let c = dims[channel_dim];
        let spatial: usize = dims[channel_dim + 1..].iter().product();
        let rows_per_entry: usize = dims[entry_dims..=channel_dim].iter().product();
        let group_of = |i: usize| {
            let row = i / spatial;
            (row / rows_per_entry, (row % c) / (c / groups), row % c)
        };
        let entries = x.len() / (rows_per_entry * spatial);
        let mut sum = vec![0f64; entries * groups];
        let mut n = vec![0f64; entries * groups];
        for (i, &v) in x.iter().enumerate() {
            let (e, g, _) = group_of(i);
            sum[e * groups + g] += f64::from(v);
            n[e * groups + g] += 1.0;
        }
        let mean: Vec<f64> = sum.iter().zip(&n).map(|(s, n)| s / n).collect();
        let mut sq = vec![0f64; entries * groups];
        for (i, &v) in x.iter().enumerate() {
            let (e, g, _) = group_of(i);
            sq[e * groups + g] += (f64::from(v) - mean[e * groups + g]).powi(2);
        }
        x.iter()
            .enumerate()
            .map(|(i, &v)| {
                let (e, g, ch) = group_of(i);
                let q = e * groups + g;
                let y = (f64::from(v) - mean[q]) / (sq[q] / n[q] + eps).sqrt() * f64::from(w[ch])
                    + f64::from(b[ch]);
                if silu {
                    y / (1.0 + (-y).exp())
                } else {
                    y
                }
            })
            .collect()
    }

    #[test]
    fn fused_group_norm_matches_f64_and_candle() -> Result<()> {
        let Some(dev) = device("fused GroupNorm") else {
            return Ok(());
        };
        // channels first, frames-major over all frames, frames-major per frame.
        let cases: [(&[usize], usize, usize); 3] = [
            (&[2, 64, 3, 17, 23], 1, 1),
            (&[1, 5, 32, 40, 33], 1, 2),
            (&[2, 4, 32, 9, 31], 2, 2),
        ];
        for (dims, entry_dims, channel_dim) in cases {
            let c = dims[channel_dim];
            // An offset mean, as activations have, so the variance is taken about it.
            let x = (Tensor::randn(0f32, 1.5, dims, &Device::Cpu)? + 3.0)?;
            let w = Tensor::randn(1f32, 0.3, c, &Device::Cpu)?;
            let b = Tensor::randn(0f32, 0.3, c, &Device::Cpu)?;
            for (dtype, tol) in [(DType::F32, 2e-5), (DType::BF16, 2e-2)] {
                for (rounding, silu) in [(Rounding::F32, true), (Rounding::EachOp, false)] {
                    let (xd, wd, bd) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?, b.to_dtype(dtype)?);
                    let spec = GroupNormSpec {
                        weight: &wd.to_device(&dev)?,
                        bias: &bd.to_device(&dev)?,
                        groups: 8,
                        eps: 1e-6,
                        rounding,
                        modulation: None,
                        silu,
                    };
                    let got =
                        fused_group_norm(&xd.to_device(&dev)?, &spec, entry_dims, channel_dim)?
                            .expect("CUDA computes it");
                    let host = |t: &Tensor| -> Result<Vec<f32>> {
                        t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
                    };
                    let want = reference(
                        &host(&xd)?,
                        dims,
                        (entry_dims, channel_dim),
                        (&host(&wd)?, &host(&bd)?, 8, 1e-6, silu),
                    );
                    let got = host(&got)?;
                    for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                        let err = (f64::from(*g) - r).abs();
                        assert!(
                            err <= tol * (1.0 + r.abs()),
                            "{dims:?} {dtype:?} {rounding:?}: element {i} {g} vs {r}"
                        );
                    }
                    if (entry_dims, channel_dim, rounding) == (1, 1, Rounding::EachOp) {
                        // candle's composition (RunGroupNorm's own path) on the CPU.
                        let norm = RunGroupNorm {
                            weight: wd.clone(),
                            bias: bd.clone(),
                            groups: 8,
                            eps: 1e-6,
                        };
                        let candle = host(&norm.normalize(&xd, 8, &wd, &bd)?)?;
                        let ulp = if dtype == DType::BF16 { 1e-2 } else { 1e-5 };
                        for (g, r) in got.iter().zip(&candle) {
                            assert!((g - r).abs() <= ulp * (1.0 + r.abs()), "{g} vs candle {r}");
                        }
                        // With CogVideoX's element-wise modulation and SiLU after it.
                        let scale =
                            Tensor::randn(1f32, 0.5, dims, &Device::Cpu)?.to_dtype(dtype)?;
                        let shift =
                            Tensor::randn(0f32, 0.5, dims, &Device::Cpu)?.to_dtype(dtype)?;
                        let on_gpu = |t: &Tensor| t.to_device(&dev);
                        let normed = RunGroupNorm {
                            weight: on_gpu(&wd)?,
                            bias: on_gpu(&bd)?,
                            groups: 8,
                            eps: 1e-6,
                        };
                        let (s_gpu, b_gpu) = (on_gpu(&scale)?, on_gpu(&shift)?);
                        let got = host(&normed.forward_then(
                            &on_gpu(&xd)?,
                            Some((&s_gpu, &b_gpu)),
                            true,
                        )?)?;
                        let candle =
                            host(&norm.forward_then(&xd, Some((&scale, &shift)), true)?)?;
                        for (g, r) in got.iter().zip(&candle) {
                            assert!(
                                (g - r).abs() <= 2.0 * ulp * (1.0 + r.abs()),
                                "modulated: {g} vs candle {r}"
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The apply pass moves 16 bytes at a time where the input and output lie alike modulo 16
    /// bytes, else one element at a time: both give the same bits (an input starting one element
    /// past an aligned address takes the element path throughout).
    #[test]
    fn vector_and_element_applies_give_the_same_bits() -> Result<()> {
        let Some(dev) = device("GroupNorm apply vectors") else {
            return Ok(());
        };
        let dims = [2, 64, 3, 17, 23];
        let n: usize = dims.iter().product();
        let host = |t: &Tensor| -> Result<Vec<u32>> {
            let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            Ok(v.iter().map(|f| f.to_bits()).collect())
        };
        for dtype in [DType::BF16, DType::F32] {
            let flat = (Tensor::randn(0f32, 1.5, n + 1, &dev)? + 3.0)?.to_dtype(dtype)?;
            let shifted = flat.narrow(0, 1, n)?.reshape(&dims[..])?;
            let same_values = shifted.copy()?;
            let weight = Tensor::randn(1f32, 0.3, 64, &dev)?.to_dtype(dtype)?;
            let bias = Tensor::randn(0f32, 0.3, 64, &dev)?.to_dtype(dtype)?;
            for (rounding, silu) in [(Rounding::F32, true), (Rounding::EachOp, false)] {
                let spec = GroupNormSpec {
                    weight: &weight,
                    bias: &bias,
                    groups: 8,
                    eps: 1e-6,
                    rounding,
                    modulation: None,
                    silu,
                };
                let run = |x: &Tensor| -> Result<Vec<u32>> {
                    host(&fused_group_norm(x, &spec, 1, 1)?.expect("CUDA computes it"))
                };
                let (by_elements, by_vectors) = (run(&shifted)?, run(&same_values)?);
                assert!(
                    by_elements == by_vectors,
                    "{dtype:?} {rounding:?}: the vector pass changed bits"
                );
            }
        }
        Ok(())
    }
}
