//! Building blocks shared by MiniMax H3's transformer, text encoder and video VAE decoder.

use candle_core::{Result, Tensor, D};
use candle_nn::VarBuilder;

use crate::models::projection::{Input, Projection};

/// RMSNorm over the last axis, with a learned scale or without one.
#[derive(Debug, Clone)]
pub(crate) struct RmsNorm {
    pub(crate) weight: Tensor,
    pub(crate) eps: f32,
}

impl RmsNorm {
    /// Reads `weight` from `vb`.
    pub(crate) fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get(dim, "weight")?,
            eps: eps as f32,
        })
    }

    /// `elementwise_affine=False`: a unit scale (multiplying by 1 is exact).
    pub(crate) fn without_weight(dim: usize, eps: f64, vb: &VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: Tensor::ones(dim, vb.dtype(), vb.device())?,
            eps: eps as f32,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::rms_norm(x, &self.weight, self.eps)
    }
}

/// diffusers' `FeedForward(activation_fn="swiglu")`: `net.0.proj(x) = [value | gate]`,
/// `net.2(value * silu(gate))` — the value is the *first* half.
#[derive(Debug, Clone)]
pub(crate) struct SwiGlu {
    proj: Projection,
    out: Projection,
}

impl SwiGlu {
    /// Its Linears in fp8 where `fp8` (`--fp8-matmul`: the transformer's main blocks).
    pub(crate) fn new(
        dim: usize,
        inner: usize,
        bias: bool,
        vb: VarBuilder,
        fp8: bool,
    ) -> Result<Self> {
        Ok(Self {
            proj: Projection::load_with((dim, 2 * inner), bias, vb.pp("net.0.proj"), fp8)?,
            out: Projection::load_with((inner, dim), bias, vb.pp("net.2"), fp8)?,
        })
    }

    /// The projections through [`Projection::apply`]: a bias (the video VAE's) in the matmul's
    /// epilogue on CUDA bf16, as torch's Linear adds it.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.proj.apply(&Input::new(x), false)?;
        let half = h.dim(D::Minus1)? / 2;
        // On CUDA bf16 one kernel (SiLU in f32 rounded once, as torch computes it) instead of a
        // SiLU and a product over strided halves.
        #[cfg(feature = "cuda")]
        if crate::models::row_ops::supported(&h) && half % 2 == 0 {
            let mut dims = h.dims().to_vec();
            let rows = h.elem_count() / (2 * half);
            let product = crate::models::row_ops::swiglu(&h.reshape((rows, 2 * half))?)?;
            *dims.last_mut().expect("a Linear's output has a last axis") = half;
            return self.out.apply(&Input::new(&product.reshape(dims)?), false);
        }
        let value = h.narrow(D::Minus1, 0, half)?;
        let gate = candle_nn::ops::silu(&h.narrow(D::Minus1, half, half)?)?;
        self.out.apply(&Input::new(&(value * gate)?), false)
    }
}

/// Rotate-half RoPE on the leading `2 * cos.dim(-1)` channels of each head of `x`
/// `[B, heads, n, head_dim]`; the remaining channels pass through. `cos`/`sin` are the half
/// tables `[n, rotary / 2]` (diffusers' tables are these duplicated).
pub(crate) fn partial_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let head_dim = x.dim(D::Minus1)?;
    let rotary = 2 * cos.dim(D::Minus1)?;
    if rotary == 0 {
        return Ok(x.clone());
    }
    let (cos, sin) = (cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?);
    let rotated = candle_nn::rotary_emb::rope(&x.narrow(3, 0, rotary)?.contiguous()?, &cos, &sin)?;
    if rotary == head_dim {
        return Ok(rotated);
    }
    Tensor::cat(&[rotated, x.narrow(3, rotary, head_dim - rotary)?], 3)
}

/// Host values of an angle table rounded to f32 and turned into (cos, sin) `[rows, width]`
/// tensors: the cosine of an f32 angle computed in f64 and rounded, which is what torch's f32
/// `cos` returns to within an ulp.
pub(crate) fn cos_sin(
    angles: &[f32],
    rows: usize,
    width: usize,
    device: &candle_core::Device,
) -> Result<(Tensor, Tensor)> {
    let cos: Vec<f32> = angles.iter().map(|&a| (a as f64).cos() as f32).collect();
    let sin: Vec<f32> = angles.iter().map(|&a| (a as f64).sin() as f32).collect();
    Ok((
        Tensor::from_vec(cos, (rows, width), device)?,
        Tensor::from_vec(sin, (rows, width), device)?,
    ))
}
