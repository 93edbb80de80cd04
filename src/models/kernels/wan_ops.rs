//! Fused CUDA kernels of the Wan DiT block (`wan_ops.cu`): LayerNorm with modulation, gated
//! residual, q/k RMSNorm with RoPE and bias (+ GELU), each one pass over bf16 storage with f32
//! math. They replace chains of candle ops that each stored a full-size f32 temporary.
//!
//! Every kernel writes in place into a tensor the caller owns (a fresh output, or a projection
//! result that is consumed), through the generic launch of `dit_ops`: its other tensor arguments
//! are read-only and must not share storage with the destination.

use candle_core::{DType, Result, Tensor};

use crate::models::dit_ops::{element_launch, row_launch, Arg, Module};
pub(crate) use crate::models::dit_ops::{rows_supported, supported, Rows};

static WAN: Module = Module {
    name: "vidgen_wan_ops",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/wan_ops.ptx")),
};

/// `LayerNorm(x) * w + b` in f32, rounded to bf16; `w`, `b` f32 `[1 or batch, dim]`.
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, at: Rows, eps: f64) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    let wb_stride = if w.dim(0)? == 1 { 0 } else { dim as i64 };
    // SAFETY: the kernel writes every element of `out`.
    let out = unsafe { Tensor::empty((rows, dim), DType::BF16, x.device()) }?;
    out.inplace_op1(&row_launch(
        &WAN,
        "wan_layer_norm_bf16",
        rows,
        vec![
            Arg::Tensor(Some(x)),
            Arg::Dst,
            Arg::Tensor(Some(w)),
            Arg::Tensor(Some(b)),
            Arg::Int(dim as i32),
            Arg::Long(at.row0 as i64),
            Arg::Long(at.seq as i64),
            Arg::Long(wb_stride),
            Arg::Float(eps as f32),
        ],
    ))?;
    Ok(out)
}

/// `res + (delta + bias) * gate` (bias and gate optional), written into `delta`'s storage.
pub(crate) fn residual_into_delta(
    res: &Tensor,
    delta: Tensor,
    bias: Option<&Tensor>,
    gate: Option<&Tensor>,
    at: Rows,
) -> Result<Tensor> {
    let (rows, dim) = delta.dims2()?;
    if res.dims2()? != (rows, dim) {
        candle_core::bail!("residual: {:?} and {:?} differ", res.shape(), delta.shape())
    }
    delta.inplace_op1(&element_launch(
        &WAN,
        "wan_residual_bf16",
        rows * dim,
        vec![
            Arg::Tensor(Some(res)),
            Arg::Dst,
            Arg::Tensor(bias),
            Arg::Tensor(gate),
            Arg::Dst,
            Arg::Long((rows * dim) as i64),
            Arg::Int(dim as i32),
            Arg::Long(at.row0 as i64),
            Arg::Long(at.seq as i64),
        ],
    ))?;
    Ok(delta)
}

/// In place on `x` `[rows, heads * head_dim]`: bias, RMSNorm across the row with `w`, then RoPE
/// per head when `rope` (cos, sin `[seq, head_dim / 2]` f32) is given.
pub(crate) fn rms_rope(
    x: Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    rope: Option<(&Tensor, &Tensor)>,
    head_dim: usize,
    at: Rows,
    eps: f32,
) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    x.inplace_op1(&row_launch(
        &WAN,
        "wan_rms_rope_bf16",
        rows,
        vec![
            Arg::Dst,
            Arg::Tensor(bias),
            Arg::Tensor(Some(w)),
            Arg::Tensor(rope.map(|r| r.0)),
            Arg::Tensor(rope.map(|r| r.1)),
            Arg::Int(dim as i32),
            Arg::Int(head_dim as i32),
            Arg::Long(at.row0 as i64),
            Arg::Long(at.seq as i64),
            Arg::Float(eps),
        ],
    ))?;
    Ok(x)
}

/// In place on `x` `[rows, dim]`: `x + bias`, then GELU(tanh) when `gelu`.
pub(crate) fn bias_act(x: Tensor, bias: &Tensor, gelu: bool) -> Result<Tensor> {
    let (rows, dim) = x.dims2()?;
    x.inplace_op1(&element_launch(
        &WAN,
        "wan_bias_act_bf16",
        rows * dim,
        vec![
            Arg::Dst,
            Arg::Tensor(Some(bias)),
            Arg::Long((rows * dim) as i64),
            Arg::Int(dim as i32),
            Arg::Int(gelu.into()),
        ],
    ))?;
    Ok(x)
}
