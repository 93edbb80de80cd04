//! The hook through which a model's self-attention runs when its token sequence is split across
//! processes (Ulysses sequence parallelism). The model computes everything token by token on its
//! own share of the tokens; only self-attention needs the whole sequence, and it asks the hook,
//! which the pipeline supplies (`crate::parallel`): models know nothing of ranks or transports.

use std::ops::Range;

use candle_core::{Result, Tensor};

/// One rank's view of a sequence split across ranks.
pub trait SequenceParallel: Send + Sync + std::fmt::Debug {
    /// This rank's tokens among `seq` (the same range in every batch entry).
    fn tokens(&self, seq: usize) -> Range<usize>;

    /// Self-attention of this rank's tokens over the whole sequence of `seq` tokens: `q`, `k`,
    /// `v` `[batch, heads, local, head_dim]` (this rank's tokens, every head) in, the attention
    /// output of the same shape out. `attend` computes attention over whole sequences
    /// (`[batch, some heads, seq, head_dim]`).
    fn self_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seq: usize,
        attend: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor>;

    /// Every rank's tokens `[batch, local, dim]` put back together: `[batch, seq, dim]`.
    fn gather_tokens(&self, x: &Tensor, seq: usize) -> Result<Tensor>;
}
