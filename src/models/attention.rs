//! Scaled dot-product attention that never materialises the whole score matrix.
//!
//! At 480x832x81 a Wan self-attention layer has 32,760 tokens: the full score matrix would be
//! ~26 GB per layer. Queries are processed in chunks so the scratch stays bounded by
//! `heads * chunk * kv_len` elements.
//!
//! At that size the passes over the score chunks dominate (the matmuls are cheap next to
//! them), so the scale is folded into the queries and, on CUDA, half-precision scores are
//! normalised in place by candle's softmax kernel (which accumulates in f32) instead of making
//! round trips through an f32 copy: three passes over each score chunk instead of seven.

use candle_core::{DType, Result, Tensor, D};

/// Upper bound on score-matrix elements materialised at once.
pub const MAX_SCORE_ELEMENTS: usize = 1 << 27;

/// Attention over `[batch, heads, seq, head_dim]` tensors; `scale` multiplies q·kᵀ.
/// Softmax accumulates in f32 for every dtype.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, q_len, _) = q.dims4()?;
    let kv_len = k.dim(2)?;
    let per_query = (b * h * kv_len).max(1);
    let chunk = (MAX_SCORE_ELEMENTS / per_query).clamp(1, q_len.max(1));
    let dtype = q.dtype();
    // Scaling the queries (in f32) costs one pass over [q_len, head_dim] instead of one over
    // every score, and spares low-precision scores a second rounding.
    let q = if scale == 1.0 {
        q.clone()
    } else {
        (q.to_dtype(DType::F32)? * scale)?.to_dtype(dtype)?
    };
    let softmax_in_place = dtype == DType::F32
        || dtype == DType::F64
        || (q.device().is_cuda() && matches!(dtype, DType::BF16 | DType::F16));
    let k_t = k.t()?.contiguous()?;
    let v = v.contiguous()?;
    let mut outs = Vec::with_capacity(q_len.div_ceil(chunk));
    let mut start = 0;
    while start < q_len {
        let len = chunk.min(q_len - start);
        let q_chunk = q.narrow(2, start, len)?.contiguous()?;
        let scores = q_chunk.matmul(&k_t)?;
        let probs = if softmax_in_place {
            candle_nn::ops::softmax_last_dim(&scores)?
        } else {
            candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(v.dtype())?
        };
        outs.push(probs.matmul(&v)?);
        start += len;
    }
    Tensor::cat(&outs, D::Minus2)
}
