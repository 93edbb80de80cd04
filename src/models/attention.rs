//! Scaled dot-product attention that never materialises the whole score matrix.
//!
//! At 480x832x81 a Wan self-attention layer has 32,760 tokens: the full score matrix would be
//! ~26 GB per layer. Queries are processed in chunks so the scratch stays bounded by
//! `heads * chunk * kv_len` elements.

use candle_core::{DType, Result, Tensor, D};

/// Upper bound on score-matrix elements materialised at once (x4 bytes in f32).
const MAX_SCORE_ELEMENTS: usize = 1 << 26;

/// Attention over `[batch, heads, seq, head_dim]` tensors with softmax computed in f32.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, q_len, _) = q.dims4()?;
    let kv_len = k.dim(2)?;
    let per_query = (b * h * kv_len).max(1);
    let chunk = (MAX_SCORE_ELEMENTS / per_query).clamp(1, q_len.max(1));
    let k_t = k.t()?.contiguous()?;
    let v = v.contiguous()?;
    let mut outs = Vec::with_capacity(q_len.div_ceil(chunk));
    let mut start = 0;
    while start < q_len {
        let len = chunk.min(q_len - start);
        let q_chunk = q.narrow(2, start, len)?.contiguous()?;
        let scores = (q_chunk.matmul(&k_t)? * scale)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?;
        outs.push(probs.to_dtype(v.dtype())?.matmul(&v)?);
        start += len;
    }
    Tensor::cat(&outs, D::Minus2)
}
