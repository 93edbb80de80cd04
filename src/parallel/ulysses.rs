//! Ulysses sequence parallelism: every rank holds a share of the tokens; around self-attention
//! one all-to-all trades "my tokens, every head" for "every token, my heads", so each rank
//! attends over whole sequences for its heads, and a second all-to-all trades back. Uneven
//! splits (tokens or heads not a multiple of the ranks) are exact: the first ranks take one more
//! ([`split`]), and every rank knows every other's sizes.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Result, Shape, Tensor};

use super::collective::Collective;
use super::split;
use crate::models::sequence_parallel::SequenceParallel;

/// The hook a model's self-attention runs through on one rank of a sequence-parallel group.
pub struct Ulysses {
    group: Arc<dyn Collective>,
}

impl std::fmt::Debug for Ulysses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Ulysses(rank {} of {})",
            self.group.rank(),
            self.group.world_size()
        )
    }
}

impl Ulysses {
    pub fn new(group: Arc<dyn Collective>) -> Self {
        Ulysses { group }
    }

    /// Every rank's share of `seq` tokens, refusing a rank with none.
    fn token_shares(&self, seq: usize) -> Result<Vec<Range<usize>>> {
        let ranks = self.group.world_size();
        if seq < ranks {
            candle_core::bail!(
                "sequence parallelism over {ranks} ranks needs at least {ranks} tokens, the video has {seq}: lower --sp-size"
            );
        }
        Ok(split(seq, ranks))
    }
}

impl SequenceParallel for Ulysses {
    fn tokens(&self, seq: usize) -> Range<usize> {
        split(seq, self.group.world_size())[self.group.rank()].clone()
    }

    fn self_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seq: usize,
        attend: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (batch, heads, local, head_dim) = q.dims4()?;
        let me = self.group.rank();
        let tokens = self.token_shares(seq)?;
        // Fewer heads than ranks leaves some ranks without one: they only relay tokens.
        let head_shares = split(heads, self.group.world_size());
        if tokens[me].len() != local {
            candle_core::bail!(
                "rank {me} holds {local} tokens, its share of {seq} is {}",
                tokens[me].len()
            );
        }
        // q, k, v stacked, one all-to-all: rank r gets my tokens of its heads.
        let qkv = Tensor::stack(&[q, k, v], 0)?;
        let send = head_shares
            .iter()
            .map(|h| qkv.narrow(2, h.start, h.len())?.contiguous())
            .collect::<Result<Vec<_>>>()?;
        let mine = head_shares[me].len();
        let shapes: Vec<Shape> = tokens
            .iter()
            .map(|t| Shape::from((3, batch, mine, t.len(), head_dim)))
            .collect();
        let parts = self.group.all_to_all(&send, &shapes)?;
        let out = if mine == 0 {
            Tensor::zeros((batch, 0, seq, head_dim), q.dtype(), q.device())?
        } else {
            let whole = Tensor::cat(&parts, 3)?;
            let part = |i| whole.get(i);
            attend(&part(0)?, &part(1)?, &part(2)?)?
        };
        // Back: rank r gets its tokens of my heads.
        let send = tokens
            .iter()
            .map(|t| out.narrow(2, t.start, t.len())?.contiguous())
            .collect::<Result<Vec<_>>>()?;
        let shapes: Vec<Shape> = head_shares
            .iter()
            .map(|h| Shape::from((batch, h.len(), local, head_dim)))
            .collect();
        let parts = self.group.all_to_all(&send, &shapes)?;
        // candle's cat does not take empty parts (ranks without a head sent none).
        let parts: Vec<Tensor> = parts.into_iter().filter(|p| p.dims()[1] != 0).collect();
        Tensor::cat(&parts, 1)
    }

    fn gather_tokens(&self, x: &Tensor, seq: usize) -> Result<Tensor> {
        let (batch, _, dim) = x.dims3()?;
        let shapes: Vec<Shape> = self
            .token_shares(seq)?
            .iter()
            .map(|t| Shape::from((batch, t.len(), dim)))
            .collect();
        Tensor::cat(&self.group.all_gather(&x.contiguous()?, &shapes)?, 1)
    }
}
