//! The Wan diffusion transformer (diffusers `WanTransformer3DModel`): Wan2.1 T2V and I2V
//! (image embedder and the image branch of cross-attention), Wan2.2 TI2V-5B (per-token
//! timesteps) and each A14B expert.
//!
//! The forward pass is split in three public stages so that an external engine can run the
//! blocks one at a time (loading each block's weights just before it runs) without the model
//! knowing anything about it:
//!
//! 1. [`WanTransformer3DModel::prepare`]: patch embedding, time and text embeddings, RoPE tables.
//! 2. [`WanTransformerBlock::forward`] for every block, in order, starting from
//!    [`BlockInputs::take_hidden_states`].
//! 3. [`WanTransformer3DModel::finish`]: output norm and modulation, `proj_out`, unpatchify.
//!
//! [`WanTransformer3DModel::forward`] chains the three
//! ([`WanTransformer3DModel::prepare_with_image`] and
//! [`WanTransformer3DModel::forward_with_image`] for image-to-video checkpoints). A model built
//! with [`WanTransformer3DModel::new_without_blocks`] holds no block weights; the caller then
//! builds each block with [`WanTransformerBlock::new`] from `vb.pp("blocks.{i}")`.
//!
//! Dtypes follow diffusers' bf16 runs: the modules diffusers keeps in float32
//! (`_keep_in_fp32_modules`: rope, time_embedder, scale_shift_table, norm1/norm2/norm3) are loaded
//! and computed in f32, every other weight uses the `VarBuilder` dtype, and the modulation and
//! residual updates are upcast to f32 exactly where diffusers upcasts.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;

use std::sync::Arc;

use crate::models::attention::sdpa;
use crate::models::fp8::Fp8Rows;
use crate::models::patches::{text_len, token_grid, unpatchify_channels_last, whole_patches};
use crate::models::projection::{Input, Projection};
use crate::models::sequence_parallel::SequenceParallel;
use crate::models::step_cache::{
    whole_output, BlockHooks, ComputeAll, HookedBlocks, ModuleNames, Submodule, Through,
};

#[cfg(feature = "cuda")]
use crate::models::row_ops;

/// Tokens per feed-forward chunk: bounds the `[tokens, ffn_dim]` intermediate (and its GELU)
/// to a few hundred MB instead of ~1.8 GB at 14B and 480x832x81.
pub const FFN_CHUNK: usize = 8192;

/// Rows per chunk in low-activation mode ([`BlockInputs::low_activation`]): every step of a
/// block runs over chunks of this many tokens, so besides the hidden states, keys and values
/// only a chunk's intermediates exist (~50 MB at 14B instead of ~1.6 GB), while a chunk's
/// matrix products and attention still fill an H200 (1024 queries x 40 heads).
pub const LOW_ACTIVATION_ROWS: usize = 1024;

/// diffusers' names of the modules a step cache hooks: `blocks.N`, `blocks.N.attn1`, `.attn2`,
/// `.ffn` and `proj_out` (the columns of `--cache`'s record, the names its patterns match).
pub const CACHE_NAMES: ModuleNames = ModuleNames::DIFFUSERS;

impl WanTransformerConfig {
    /// The blocks diffusers' cache hooks see, by their names.
    pub fn hooked_blocks(&self) -> HookedBlocks {
        HookedBlocks::one_list(self.num_layers, CACHE_NAMES)
    }
}

/// The modules diffusers' layerwise casting leaves alone in `WanTransformer3DModel` (its
/// `_skip_layerwise_casting_patterns` and `_keep_in_fp32_modules`).
pub const LAYERWISE_CASTING_SKIP: &[&str] = &[
    "patch_embedding",
    "condition_embedder",
    "norm",
    "rope",
    "time_embedder",
    "scale_shift_table",
    "norm1",
    "norm2",
    "norm3",
];

/// `transformer/config.json` of a diffusers Wan checkpoint; missing keys take diffusers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct WanTransformerConfig {
    /// Conv3d patch (frames, height, width).
    pub patch_size: [usize; 3],
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Width of one head (also sets the RoPE split).
    pub attention_head_dim: usize,
    /// Latent channels in.
    pub in_channels: usize,
    /// `null` means "same as `in_channels`", as in diffusers.
    pub out_channels: Option<usize>,
    /// Width of the text-encoder embeddings.
    pub text_dim: usize,
    /// Width of the sinusoidal timestep embedding.
    pub freq_dim: usize,
    /// Hidden width of each block's feed-forward.
    pub ffn_dim: usize,
    /// Number of transformer blocks.
    pub num_layers: usize,
    /// Whether cross-attention queries go through an affine LayerNorm (`norm2`).
    pub cross_attn_norm: bool,
    /// Informational: diffusers 0.42.1 always applies RMSNorm across heads to q and k.
    pub qk_norm: Option<String>,
    /// Epsilon of every LayerNorm and RMSNorm.
    pub eps: f64,
    /// Width of the CLIP image embeddings (Wan2.1 I2V); `null` without an image branch.
    pub image_dim: Option<usize>,
    /// Input width of the image keys/values of cross-attention (`add_k_proj`/`add_v_proj`);
    /// set together with `image_dim` and equal to the inner dim (the image tokens are embedded
    /// to it first).
    pub added_kv_proj_dim: Option<usize>,
    /// Longest grid extent (in patches) along any axis that RoPE supports.
    pub rope_max_seq_len: usize,
    /// First-last-frame (FLF2V) image position embedding; not supported.
    pub pos_embed_seq_len: Option<usize>,
    /// Not in the file: the blocks' Linears run in fp8 (`--fp8-matmul`, set by the pipeline).
    #[serde(skip)]
    pub fp8_matmul: bool,
}

impl Default for WanTransformerConfig {
    fn default() -> Self {
        Self {
            patch_size: [1, 2, 2],
            num_attention_heads: 40,
            attention_head_dim: 128,
            in_channels: 16,
            out_channels: Some(16),
            text_dim: 4096,
            freq_dim: 256,
            ffn_dim: 13824,
            num_layers: 40,
            cross_attn_norm: true,
            qk_norm: Some("rms_norm_across_heads".to_string()),
            eps: 1e-6,
            image_dim: None,
            added_kv_proj_dim: None,
            rope_max_seq_len: 1024,
            pos_embed_seq_len: None,
            fp8_matmul: false,
        }
    }
}

impl WanTransformerConfig {
    /// Model width: heads x head dim.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Output channels (`out_channels or in_channels`).
    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// RoPE split of a head into (frame, height, width) parts, as diffusers computes it.
    pub fn rope_dims(&self) -> [usize; 3] {
        let hw = 2 * (self.attention_head_dim / 6);
        [self.attention_head_dim - 2 * hw, hw, hw]
    }

    /// Whether the model has the image branch (Wan2.1 I2V: image embedder, added k/v).
    pub fn has_image_branch(&self) -> bool {
        self.added_kv_proj_dim.is_some()
    }

    /// Rejects configurations this model cannot run.
    pub fn validate(&self) -> Result<()> {
        match (self.image_dim, self.added_kv_proj_dim) {
            (None, None) => {}
            (Some(image_dim), Some(kv)) => {
                if image_dim == 0 {
                    candle_core::bail!("transformer config: image_dim must be positive");
                }
                if kv != self.inner_dim() {
                    candle_core::bail!(
                        "transformer config: added_kv_proj_dim {kv} must equal the inner dim {} \
                         (heads x head dim): the image tokens are embedded to it",
                        self.inner_dim()
                    );
                }
            }
            _ => candle_core::bail!(
                "transformer config: image_dim and added_kv_proj_dim must be set together"
            ),
        }
        if let Some(n) = self.pos_embed_seq_len {
            candle_core::bail!(
                "transformer config: pos_embed_seq_len {n} (first-last-frame image position \
                 embedding) is not supported"
            );
        }
        if self.patch_size.contains(&0) {
            candle_core::bail!(
                "`patch_size` {:?} must be three positive numbers",
                self.patch_size
            );
        }
        crate::models::config_checks::bounded_sizes(&[
            ("num_attention_heads", self.num_attention_heads),
            ("attention_head_dim", self.attention_head_dim),
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels()),
            ("text_dim", self.text_dim),
            ("freq_dim", self.freq_dim),
            ("ffn_dim", self.ffn_dim),
            ("num_layers", self.num_layers),
            ("rope_max_seq_len", self.rope_max_seq_len),
        ])?;
        // Heads x head width is the model's width: bounded like every other width.
        crate::models::config_checks::bounded_sizes(&[(
            "num_attention_heads` x `attention_head_dim",
            self.num_attention_heads
                .saturating_mul(self.attention_head_dim),
        )])?;
        if self
            .patch_size
            .iter()
            .any(|&p| p > crate::models::config_checks::MAX_CONFIG_SIZE)
        {
            candle_core::bail!(
                "`patch_size` {:?} is larger than any model",
                self.patch_size
            );
        }
        if !self.attention_head_dim.is_multiple_of(2) {
            candle_core::bail!(
                "`attention_head_dim` {} must be even for RoPE",
                self.attention_head_dim
            );
        }
        if !self.freq_dim.is_multiple_of(2) {
            candle_core::bail!(
                "`freq_dim` {} must be even (half sines, half cosines)",
                self.freq_dim
            );
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            candle_core::bail!("`eps` {} must be a finite number >= 0", self.eps);
        }
        Ok(())
    }
}

/// diffusers' cross-attention takes the *last* 512 context rows as text and the rows before
/// them as image tokens (hard-coded: "512 is the context length of the text encoder"), so an
/// image-to-video model only computes what diffusers computes with exactly 512 text rows.
pub const IMAGE_BRANCH_TEXT_LEN: usize = 512;

/// Consecutive rows of the `[batch * seq, inner]` hidden states that share one timestep (so one
/// time embedding and one modulation): per-token timesteps are stored per run, not per token
/// (Wan2.2 TI2V image-to-video has two runs per video: the first frame's tokens at 0, the rest
/// at t), which spares the `[tokens, 6, inner]` tables diffusers builds (4 GB in bf16 at
/// 704x1280x121, 8 GB more in f32 inside every block) with the same values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimestepRun {
    /// First row, counted over the whole batch (`batch entry * seq + token`).
    pub row0: usize,
    /// Rows in the run.
    pub len: usize,
}

/// Splits per-token timesteps (`values` `[batch * seq]`) into runs of equal values, never
/// across batch entries.
fn split_timestep_runs(values: &[f32], seq: usize) -> Vec<TimestepRun> {
    let mut runs = Vec::new();
    for entry in values.chunks(seq) {
        let base = runs.last().map_or(0, |r: &TimestepRun| r.row0 + r.len);
        let mut start = 0;
        for i in 1..=entry.len() {
            if i == entry.len() || entry[i].to_bits() != entry[start].to_bits() {
                runs.push(TimestepRun {
                    row0: base + start,
                    len: i - start,
                });
                start = i;
            }
        }
    }
    runs
}

/// Everything the blocks and the output head need, computed once per forward by `prepare`.
#[derive(Debug, Clone)]
pub struct BlockInputs {
    hidden_states: Option<Tensor>,
    /// Time embedding `[entries, inner]` (model dtype), used by the output head: one entry per
    /// batch entry, or per [`TimestepRun`] with per-token timesteps (Wan2.2
    /// `expand_timesteps`).
    pub temb: Tensor,
    /// Per-block modulation input `[entries, 6, inner]` (model dtype), entries as `temb`.
    pub timestep_proj: Tensor,
    /// With per-token timesteps that differ within a batch entry: the runs, entry `k` of `temb`
    /// and `timestep_proj` being run `k`'s. `None`: entry `b` is batch entry `b`'s.
    pub timestep_runs: Option<Vec<TimestepRun>>,
    /// Projected text `[B, L, inner]` (model dtype): keys and values of cross-attention.
    pub encoder_hidden_states: Tensor,
    /// Embedded image tokens `[B, N, inner]` (model dtype) of an image-to-video model: the keys
    /// and values of cross-attention's image branch.
    pub encoder_hidden_states_image: Option<Tensor>,
    /// RoPE cosines `[seq, head_dim / 2]` in f32, one per interleaved pair.
    pub rope_cos: Tensor,
    /// RoPE sines, same layout as `rope_cos`.
    pub rope_sin: Tensor,
    /// Batch size.
    pub batch: usize,
    /// Token grid (frames, height, width) after patching.
    pub grid: [usize; 3],
    /// Set on one rank's share of a sequence split across ranks ([`Self::split_sequence`]):
    /// self-attention goes through it.
    pub sequence: Option<Arc<dyn SequenceParallel>>,
    /// Low-activation mode (`--low-activation`): every step of a block runs by chunks of
    /// [`LOW_ACTIVATION_ROWS`] tokens written over the hidden states, so that only they, the
    /// self-attention's keys and values and one chunk's intermediates exist at once; the same
    /// arithmetic per row as the whole tensors. A rank of a split sequence attends whole (its
    /// all-to-all needs every query).
    pub low_activation: bool,
}

impl BlockInputs {
    /// Whether the timesteps differ within a batch entry (entries are [`TimestepRun`]s).
    pub fn per_token_timesteps(&self) -> bool {
        self.timestep_runs.is_some()
    }

    /// An entry-indexed tensor (`temb`, `timestep_proj`: `[entries, ...]`) spread to one row
    /// per token, `[batch, seq, ...]`: the layout diffusers computes (for inspection and tests).
    pub fn per_token(&self, t: &Tensor) -> Result<Tensor> {
        let [gf, gh, gw] = self.grid;
        let seq = gf * gh * gw;
        let rest = t.dims()[1..].to_vec();
        let parts = match &self.timestep_runs {
            Some(runs) => runs
                .iter()
                .enumerate()
                .map(|(k, r)| {
                    let mut shape = vec![r.len];
                    shape.extend(&rest);
                    t.narrow(0, k, 1)?.broadcast_as(shape)
                })
                .collect::<Result<Vec<_>>>()?,
            None => (0..self.batch)
                .map(|b| {
                    let mut shape = vec![seq];
                    shape.extend(&rest);
                    t.narrow(0, b, 1)?.broadcast_as(shape)
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let mut shape = vec![self.batch, seq];
        shape.extend(rest);
        Tensor::cat(&parts, 0)?.reshape(shape)
    }

    /// `table` `[1, k, inner]` (f32) + `emb` (`timestep_proj` with `emb_k` = 6, or `temb` with
    /// `emb_k` = 1) in f32: `[entries, k, inner]`.
    fn modulation(&self, table: &Tensor, emb: &Tensor, emb_k: usize) -> Result<Tensor> {
        let dim = table.dim(2)?;
        table.broadcast_add(&emb.to_dtype(DType::F32)?.reshape(((), emb_k, dim))?)
    }

    /// The slab `row0..row0 + rows` of the `[batch * seq]` hidden states as runs of rows that
    /// pick their modulation alike: one, whose rows pick their batch entry's through [`Rows`],
    /// or (with timestep runs) one per run it meets, each with its run's entry.
    fn slabs(&self, row0: usize, rows: usize, seq: usize) -> Vec<Slab> {
        let Some(runs) = &self.timestep_runs else {
            return vec![Slab {
                start: 0,
                len: rows,
                entry: None,
                at: Rows { row0, seq },
            }];
        };
        let end = row0 + rows;
        runs.iter()
            .enumerate()
            .filter_map(|(k, r)| {
                let (a, b) = (r.row0.max(row0), (r.row0 + r.len).min(end));
                (a < b).then(|| Slab {
                    start: a - row0,
                    len: b - a,
                    entry: Some(k),
                    at: Rows {
                        row0: 0,
                        seq: b - a,
                    },
                })
            })
            .collect()
    }

    /// [`norm_affine`] of the slab `x` (rows `row0..` of the `[batch * seq]` hidden states),
    /// each row with its entry's `scale` and `shift` (`[entries, inner]`).
    fn modulated_norm(
        &self,
        x: &Tensor,
        (scale, shift): (&Tensor, &Tensor),
        (row0, seq): (usize, usize),
        eps: f64,
    ) -> Result<Tensor> {
        let parts = self
            .slabs(row0, x.dim(0)?, seq)
            .into_iter()
            .map(|s| norm_affine(&s.rows(x)?, &s.of(scale)?, &s.of(shift)?, s.at, eps))
            .collect::<Result<Vec<_>>>()?;
        joined(parts)
    }

    /// [`Self::modulated_norm`] as the input of `layers`: where there is one slab, through
    /// [`norm_input`] (codes straight from the norm when every layer is fp8).
    fn modulated_input(
        &self,
        x: &Tensor,
        (scale, shift): (&Tensor, &Tensor),
        (row0, seq): (usize, usize),
        eps: f64,
        layers: &[&Projection],
    ) -> Result<Input> {
        match self.slabs(row0, x.dim(0)?, seq).as_slice() {
            [s] => norm_input(&s.rows(x)?, &s.of(scale)?, &s.of(shift)?, s.at, eps, layers),
            _ => Ok(Input::new(&self.modulated_norm(
                x,
                (scale, shift),
                (row0, seq),
                eps,
            )?)),
        }
    }

    /// [`residual`] with a gate `[entries, inner]` for the slab at `row0`, each row with its
    /// entry's gate.
    fn modulated_residual(
        &self,
        res: &Tensor,
        delta: Tensor,
        (bias, gate): (Option<&Tensor>, &Tensor),
        (row0, seq): (usize, usize),
    ) -> Result<Tensor> {
        let parts = self
            .slabs(row0, res.dim(0)?, seq)
            .into_iter()
            .map(|s| {
                residual(
                    &s.rows(res)?,
                    s.rows(&delta)?,
                    bias,
                    Some(&s.of(gate)?),
                    s.at,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        joined(parts)
    }

    /// [`Self::modulated_residual`] of rows `row0..` of `hidden` (hidden states the caller owns),
    /// stored into those rows: by the fused kernel where it computes the sum, so the sum is never
    /// copied into them.
    fn modulated_residual_over(
        &self,
        hidden: &Tensor,
        delta: Tensor,
        (bias, gate): (Option<&Tensor>, &Tensor),
        (row0, seq): (usize, usize),
    ) -> Result<()> {
        let res = hidden.narrow(0, row0, delta.dim(0)?)?;
        #[cfg(feature = "cuda")]
        if row_ops::supported(&delta) && res.is_contiguous() {
            for s in self.slabs(row0, res.dim(0)?, seq) {
                let gate = s.of(gate)?;
                let at = s.at.kernel();
                let gate = Some(row_ops::Gate::F32(&gate));
                row_ops::residual_over(&s.rows(&res)?, &s.rows(&delta)?, bias, gate, at)?;
            }
            return Ok(());
        }
        let sum = self.modulated_residual(&res, delta, (bias, gate), (row0, seq))?;
        hidden.slice_set(&sum, 0, row0)
    }

    /// This rank's share of the inputs with the sequence split across ranks by `sp`: its tokens
    /// of the block-0 hidden states (taken from `self`), their RoPE rows and timestep runs. The
    /// blocks run on that share, attending through `sp`; [`Self::gather_sequence`] puts the
    /// blocks' output back together for [`WanTransformer3DModel::finish`] with `self`.
    pub fn split_sequence(&mut self, sp: Arc<dyn SequenceParallel>) -> Result<BlockInputs> {
        let seq = self.grid.iter().product::<usize>();
        let mine = sp.tokens(seq);
        let (start, len) = (mine.start, mine.len());
        let hidden_states = self
            .take_hidden_states()?
            .narrow(1, start, len)?
            .contiguous()?;
        // A run lies in one batch entry: its rows among this rank's, possibly none.
        let timestep_runs = self.timestep_runs.as_ref().map(|runs| {
            runs.iter()
                .map(|r| {
                    let (entry, first) = (r.row0 / seq, r.row0 % seq);
                    let a = first.clamp(start, start + len);
                    let b = (first + r.len).clamp(start, start + len);
                    TimestepRun {
                        row0: entry * len + a - start,
                        len: b - a,
                    }
                })
                .collect()
        });
        Ok(BlockInputs {
            hidden_states: Some(hidden_states),
            timestep_runs,
            rope_cos: self.rope_cos.narrow(0, start, len)?.contiguous()?,
            rope_sin: self.rope_sin.narrow(0, start, len)?.contiguous()?,
            sequence: Some(sp),
            ..self.clone()
        })
    }

    /// The whole sequence `[B, seq, inner]` from this rank's share of the tokens (`x` itself
    /// when the sequence is not split).
    pub fn gather_sequence(&self, x: &Tensor) -> Result<Tensor> {
        match &self.sequence {
            Some(sp) => sp.gather_tokens(x, self.grid.iter().product()),
            None => Ok(x.clone()),
        }
    }

    /// Takes the patch tokens `[B, seq, inner]` that feed block 0 (once; the inputs do not keep
    /// a copy, so the activation memory is not held twice).
    pub fn take_hidden_states(&mut self) -> Result<Tensor> {
        self.hidden_states
            .take()
            .ok_or_else(|| candle_core::Error::Msg("block-0 hidden states already taken".into()))
    }
}

/// Where a `[rows, dim]` slab sits in the block's `[batch * seq, dim]` hidden states: its first
/// row and the rows per batch entry, which pick each row's modulation and RoPE position.
#[derive(Debug, Clone, Copy)]
struct Rows {
    row0: usize,
    seq: usize,
}

impl Rows {
    /// `[batch, dim]` per-batch-entry rows of `m` shaped to broadcast over the slab viewed as
    /// `[groups, rows / groups, dim]`, and that view's shape: one group when the slab lies in one
    /// batch entry, else the whole tensor (one group per batch entry).
    fn per_batch(&self, m: &Tensor, rows: usize) -> Result<(Tensor, (usize, usize))> {
        let entries = m.dim(0)?;
        let first = self.row0 / self.seq;
        if entries == 1 || self.row0 % self.seq + rows <= self.seq {
            let m = m.narrow(0, if entries == 1 { 0 } else { first }, 1)?;
            Ok((m.unsqueeze(1)?, (1, rows)))
        } else if self.row0 == 0 && rows == entries * self.seq {
            Ok((m.unsqueeze(1)?, (entries, self.seq)))
        } else {
            candle_core::bail!("rows {}..+{rows} straddle batch entries", self.row0)
        }
    }

    #[cfg(feature = "cuda")]
    fn kernel(self) -> row_ops::Rows {
        row_ops::Rows {
            row0: self.row0,
            seq: self.seq,
        }
    }
}

/// Rows `start..start + len` of a slab of hidden states that pick their modulation alike
/// ([`BlockInputs::slabs`]).
struct Slab {
    start: usize,
    len: usize,
    /// The timestep run's entry whose modulation every row takes; `None`: each row its batch
    /// entry's, through `at`.
    entry: Option<usize>,
    at: Rows,
}

impl Slab {
    /// This slab's rows of `t`.
    fn rows(&self, t: &Tensor) -> Result<Tensor> {
        t.narrow(0, self.start, self.len)
    }

    /// The modulation `m` `[entries, inner]` as this slab's rows read it.
    fn of(&self, m: &Tensor) -> Result<Tensor> {
        match self.entry {
            Some(k) => m.narrow(0, k, 1),
            None => Ok(m.clone()),
        }
    }
}

/// The slabs' results in order: the one result itself where there is one.
fn joined(mut parts: Vec<Tensor>) -> Result<Tensor> {
    if parts.len() == 1 {
        return Ok(parts.remove(0));
    }
    Tensor::cat(&parts, 0)
}

/// `LayerNorm(x) * w + b` in f32, cast to `x`'s dtype; `x` `[rows, dim]`, `w` and `b` f32
/// `[1 or batch, dim]`: the modulated norms (w = 1 + scale, b = shift) and the affine `norm2`.
fn norm_affine(x: &Tensor, w: &Tensor, b: &Tensor, at: Rows, eps: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if row_ops::rows_supported(x) {
        return row_ops::layer_norm_affine_f32(x, w, b, at.kernel(), eps);
    }
    // Two-pass mean and variance (no E[x^2]-E[x]^2 cancellation), as diffusers'
    // `FP32LayerNorm`; the modulation is applied in f32 too.
    let (rows, dim) = x.dims2()?;
    let (w, (groups, per)) = at.per_batch(w, rows)?;
    let (b, _) = at.per_batch(b, rows)?;
    let xf = x.to_dtype(DType::F32)?.reshape((groups, per, dim))?;
    let mean = xf.mean_keepdim(D::Minus1)?;
    let xc = xf.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(&w)?
        .broadcast_add(&b)?
        .reshape((rows, dim))?
        .to_dtype(x.dtype())
}

/// [`norm_affine`] as the input of `layers` (at least one): where every one is fp8 and the fused
/// kernel takes the rows, their e4m3 codes straight from the norm, the bytes quantizing the
/// stored rows would give (the rows themselves are never stored); else the rows.
fn norm_input(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    at: Rows,
    eps: f64,
    layers: &[&Projection],
) -> Result<Input> {
    if layers.iter().all(|l| l.is_fp8()) {
        if let Some(codes) = norm_codes(x, w, b, at, eps)? {
            return Ok(Input::quantized(codes, x.dtype()));
        }
    }
    Ok(Input::new(&norm_affine(x, w, b, at, eps)?))
}

/// [`norm_affine`]'s rows as e4m3 codes by the fused CUDA kernel; `None` where it does not run
/// (the host, or rows it does not take).
fn norm_codes(x: &Tensor, w: &Tensor, b: &Tensor, at: Rows, eps: f64) -> Result<Option<Fp8Rows>> {
    #[cfg(feature = "cuda")]
    if let Some((q, scale)) = row_ops::layer_norm_affine_codes(x, w, b, at.kernel(), eps)? {
        let (rows, cols) = x.dims2()?;
        return Ok(Some(Fp8Rows {
            q,
            scale,
            rows,
            cols,
        }));
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (x, w, b, at, eps);
    Ok(None)
}

/// `res + (delta + bias) * gate` with the gate product and sum in f32 (diffusers' gated
/// residual); without a gate, `res + (delta + bias)` in the model dtype. `delta` is consumed:
/// the CUDA kernel writes the result into its storage.
fn residual(
    res: &Tensor,
    delta: Tensor,
    bias: Option<&Tensor>,
    gate: Option<&Tensor>,
    at: Rows,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if row_ops::supported(&delta) {
        let gate = gate.map(row_ops::Gate::F32);
        return row_ops::residual_into_delta(res, delta, bias, gate, at.kernel());
    }
    let delta = match bias {
        Some(bias) => delta.broadcast_add(bias)?,
        None => delta,
    };
    let Some(gate) = gate else {
        return res + delta;
    };
    let (rows, dim) = delta.dims2()?;
    let (gate, (groups, per)) = at.per_batch(gate, rows)?;
    let shape = (groups, per, dim);
    let sum = (res.to_dtype(DType::F32)?.reshape(shape)?
        + delta
            .to_dtype(DType::F32)?
            .reshape(shape)?
            .broadcast_mul(&gate)?)?;
    sum.reshape((rows, dim))?.to_dtype(res.dtype())
}

/// [`residual`] without a gate of rows `at.row0..` of `hidden` (hidden states the caller owns),
/// stored into those rows (by the fused kernel where it computes the sum).
fn residual_over(hidden: &Tensor, delta: Tensor, bias: Option<&Tensor>, at: Rows) -> Result<()> {
    let res = hidden.narrow(0, at.row0, delta.dim(0)?)?;
    #[cfg(feature = "cuda")]
    if row_ops::supported(&delta) && res.is_contiguous() {
        return row_ops::residual_over(&res, &delta, bias, None, at.kernel());
    }
    let sum = residual(&res, delta, bias, None, at)?;
    hidden.slice_set(&sum, 0, at.row0)
}

/// The chunks `(row0, rows)` of at most `chunk` rows of `[batch * seq]` hidden states, none
/// across batch entries.
fn row_chunks(batch: usize, seq: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..batch).flat_map(move |b| {
        (0..seq)
            .step_by(chunk)
            .map(move |start| (b * seq + start, chunk.min(seq - start)))
    })
}

/// A block's Linear `(in, out)` under `vb`: in fp8 where the config asks (`--fp8-matmul`).
fn block_linear(
    cfg: &WanTransformerConfig,
    (inner, out): (usize, usize),
    vb: VarBuilder,
) -> Result<Projection> {
    Projection::load((inner, out), vb, cfg.fp8_matmul)
}

/// Linear -> GELU(tanh) -> Linear (diffusers `FeedForward` / `PixArtAlphaTextProjection`).
#[derive(Debug, Clone)]
struct GeluMlp {
    fc1: Projection,
    fc2: Projection,
}

impl GeluMlp {
    fn new(fc1: Projection, fc2: Projection) -> Self {
        Self { fc1, fc2 }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.gelu()?)
    }

    /// `fc2(gelu(fc1(x)))` for `x` `[rows, in]`, leaving out `fc2`'s bias (the residual adds it).
    fn forward_without_out_bias(&self, x: &Input) -> Result<Tensor> {
        let h = self.fc1.apply(x, true)?;
        self.fc2.product(&Input::new(&h))
    }
}

/// The image branch of an I2V cross-attention: keys (RMSNorm across heads) and values of the
/// embedded image tokens.
#[derive(Debug, Clone)]
struct AddedKv {
    add_k_proj: Projection,
    add_v_proj: Projection,
    norm_added_k: Tensor,
}

/// What a cross-attention attends to: the projected text and, for I2V, the image tokens.
#[derive(Debug, Clone, Copy)]
struct CrossContext<'a> {
    /// `[batch, L, inner]`.
    text: &'a Tensor,
    /// `[batch, N, inner]`.
    image: Option<&'a Tensor>,
}

/// Self- or cross-attention with RMSNorm across heads on q and k.
#[derive(Debug, Clone)]
struct WanAttention {
    to_q: Projection,
    to_k: Projection,
    to_v: Projection,
    to_out: Projection,
    norm_q: Tensor,
    norm_k: Tensor,
    /// Cross-attention of an image-to-video model only.
    added: Option<AddedKv>,
    heads: usize,
    head_dim: usize,
    eps: f32,
}

impl WanAttention {
    /// Self-attention, or cross-attention without an image branch.
    fn new(cfg: &WanTransformerConfig, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, None, vb)
    }

    /// Cross-attention, with the image branch when the config has one.
    fn cross(cfg: &WanTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let added = match cfg.added_kv_proj_dim {
            Some(kv) => {
                let dim = cfg.inner_dim();
                Some(AddedKv {
                    add_k_proj: block_linear(cfg, (kv, dim), vb.pp("add_k_proj"))?,
                    add_v_proj: block_linear(cfg, (kv, dim), vb.pp("add_v_proj"))?,
                    norm_added_k: vb.get(dim, "norm_added_k.weight")?,
                })
            }
            None => None,
        };
        Self::build(cfg, added, vb)
    }

    fn build(cfg: &WanTransformerConfig, added: Option<AddedKv>, vb: VarBuilder) -> Result<Self> {
        let dim = cfg.inner_dim();
        Ok(Self {
            added,
            to_q: block_linear(cfg, (dim, dim), vb.pp("to_q"))?,
            to_k: block_linear(cfg, (dim, dim), vb.pp("to_k"))?,
            to_v: block_linear(cfg, (dim, dim), vb.pp("to_v"))?,
            to_out: block_linear(cfg, (dim, dim), vb.pp("to_out.0"))?,
            norm_q: vb.get(dim, "norm_q.weight")?,
            norm_k: vb.get(dim, "norm_k.weight")?,
            heads: cfg.num_attention_heads,
            head_dim: cfg.attention_head_dim,
            eps: cfg.eps as f32,
        })
    }

    /// `to_q`/`to_k` output `x` `[rows, inner]` (bias not yet added): bias, RMSNorm across heads
    /// and, for self-attention, RoPE, in place on CUDA.
    fn norm_rope(
        &self,
        x: Tensor,
        linear: &Projection,
        weight: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
        at: Rows,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if row_ops::rows_supported(&x) {
            return row_ops::rms_rope(
                x,
                linear.bias(),
                weight,
                rope,
                self.head_dim,
                at.kernel(),
                self.eps.into(),
                row_ops::Rounding::F32,
            );
        }
        let x = match linear.bias() {
            Some(bias) => x.broadcast_add(bias)?,
            None => x,
        };
        let x = candle_nn::ops::rms_norm(&x, weight, self.eps)?;
        let Some((cos, sin)) = rope else {
            return Ok(x);
        };
        // Interleaved-pair rotation computed in f32 (as diffusers does), cast back.
        let (rows, dim) = x.dims2()?;
        let first = at.row0 % at.seq;
        let (groups, per, cos, sin) = if at.row0 == 0 && rows.is_multiple_of(at.seq) {
            (rows / at.seq, at.seq, cos.clone(), sin.clone())
        } else if first + rows <= at.seq {
            // A chunk inside one sequence: its positions' rows of the tables.
            (
                1,
                rows,
                cos.narrow(0, first, rows)?,
                sin.narrow(0, first, rows)?,
            )
        } else {
            candle_core::bail!("RoPE rows {}..+{rows} straddle sequences", at.row0)
        };
        let heads = x
            .reshape((groups, per, self.heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()?
            .to_dtype(DType::F32)?;
        candle_nn::rotary_emb::rope_i(&heads, &cos, &sin)?
            .to_dtype(x.dtype())?
            .transpose(1, 2)?
            .reshape((rows, dim))
    }

    /// Keys and values `[batch * len, inner]` of `context` `[batch, len, inner]` through
    /// (`to_k`, `norm_k`, `to_v`) or the image branch's (`add_k_proj`, `norm_added_k`,
    /// `add_v_proj`); no RoPE.
    fn context_kv(
        &self,
        context: &Tensor,
        (k_proj, k_norm, v_proj): (&Projection, &Tensor, &Projection),
    ) -> Result<(Tensor, Tensor, usize)> {
        let (batch, len, dim) = context.dims3()?;
        let context = context.reshape((batch * len, dim))?;
        let context = Input::new(&context);
        let k = k_proj.product(&context)?;
        let k = self.norm_rope(k, k_proj, k_norm, None, Rows { row0: 0, seq: len })?;
        Ok((k, v_proj.apply(&context, false)?, len))
    }

    /// Attention of `input` `[batch * seq, inner]` (consumed, so it is freed once projected) over
    /// itself (`context` `None`, with `rope` (cos, sin)) or over a cross context; an image
    /// branch's attention output is added to the text one before `to_out`, as diffusers does.
    /// Returns `[batch * seq, inner]` before `to_out`'s bias, which the residual adds.
    fn forward(
        &self,
        input: Input,
        batch: usize,
        context: Option<CrossContext>,
        rope: Option<(&Tensor, &Tensor)>,
        sequence: Option<(&dyn SequenceParallel, usize)>,
    ) -> Result<Tensor> {
        let (rows, dim) = input.dims2()?;
        let seq = rows / batch;
        // One input for q, k and v: quantized once under `--fp8-matmul`.
        let q = self.to_q.product(&input)?;
        let q = self.norm_rope(q, &self.to_q, &self.norm_q, rope, Rows { row0: 0, seq })?;
        let (k, v, kv_len) = match context {
            None => {
                let k = self.to_k.product(&input)?;
                let k = self.norm_rope(k, &self.to_k, &self.norm_k, rope, Rows { row0: 0, seq })?;
                (k, self.to_v.apply(&input, false)?, seq)
            }
            Some(context) => {
                self.context_kv(context.text, (&self.to_k, &self.norm_k, &self.to_v))?
            }
        };
        drop(input);
        // [batch * n, inner] -> [batch, heads, n, head_dim] views: the fused attention reads
        // strided heads, the chunked path copies what it needs.
        let split = |t: Tensor, n: usize| {
            t.reshape((batch, n, self.heads, self.head_dim))?
                .transpose(1, 2)
        };
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let q = split(q, seq)?;
        let (k, v) = (split(k, kv_len)?, split(v, kv_len)?);
        let mut out = match sequence {
            // This rank's tokens of a split sequence: whole sequences for some heads.
            Some((sp, whole)) if context.is_none() => {
                sp.self_attention(&q, &k, &v, whole, &|q, k, v| sdpa(q, k, v, scale))?
            }
            _ => sdpa(&q, &k, &v, scale)?,
        };
        drop((k, v));
        if let Some((k, v, n)) = self.image_kv(context)? {
            out = (out + sdpa(&q, &split(k, n)?, &split(v, n)?, scale)?)?;
        }
        // Only the output is still needed: q, k and v (each as large as the hidden states) go
        // before `to_out` allocates, which keeps the block's peak at x, q, k, v and the output.
        drop(q);
        let out = {
            let heads = out;
            heads.transpose(1, 2)?.reshape((rows, dim))?
        };
        self.to_out.product(&Input::new(&out))
    }

    /// Keys and values `[batch * n, inner]` of the image tokens of a cross `context` through the
    /// image branch; `None` without image tokens (refused where the branch and the tokens do
    /// not go together).
    fn image_kv(&self, context: Option<CrossContext>) -> Result<Option<(Tensor, Tensor, usize)>> {
        match (&self.added, context.and_then(|c| c.image)) {
            (Some(added), Some(image)) => self
                .context_kv(
                    image,
                    (&added.add_k_proj, &added.norm_added_k, &added.add_v_proj),
                )
                .map(Some),
            (Some(_), None) if context.is_some() => {
                candle_core::bail!("image-to-video cross-attention needs the image tokens")
            }
            (None, Some(_)) => {
                candle_core::bail!("image tokens given to a cross-attention without image branch")
            }
            _ => Ok(None),
        }
    }

    /// [`Self::forward`] in low-activation mode, by chunks of [`LOW_ACTIVATION_ROWS`] rows of
    /// `x` `[batch * seq, inner]`, the block's hidden states: `norm` makes a chunk's input from
    /// its rows; self-attention's keys and values are made chunk by chunk into whole tensors
    /// first, then each chunk of queries attends and `write` gets the chunk's output before
    /// `to_out`'s bias and its rows (it may write over those rows of `x`: nothing reads them
    /// again). Only `x`, the keys and the values exist whole; each row's arithmetic is
    /// [`Self::forward`]'s.
    fn forward_rows(
        &self,
        x: &Tensor,
        batch: usize,
        norm: &dyn Fn(&Tensor, Rows) -> Result<Input>,
        (context, rope): (Option<CrossContext>, Option<(&Tensor, &Tensor)>),
        write: &mut dyn FnMut(Tensor, Rows) -> Result<()>,
    ) -> Result<()> {
        let (rows, dim) = x.dims2()?;
        let seq = rows / batch;
        let chunks = || row_chunks(batch, seq, LOW_ACTIVATION_ROWS);
        let split = |t: Tensor, n: usize| {
            t.reshape(((), n, self.heads, self.head_dim))?
                .transpose(1, 2)
        };
        let (k, v, kv_len) = match context {
            None => {
                let k = Tensor::zeros((rows, dim), x.dtype(), x.device())?;
                let v = k.zeros_like()?;
                for (row0, len) in chunks() {
                    let at = Rows { row0, seq };
                    let h = norm(&x.narrow(0, row0, len)?, at)?;
                    let kc = self.to_k.product(&h)?;
                    let kc = self.norm_rope(kc, &self.to_k, &self.norm_k, rope, at)?;
                    k.slice_set(&kc, 0, row0)?;
                    v.slice_set(&self.to_v.apply(&h, false)?, 0, row0)?;
                }
                (k, v, seq)
            }
            Some(context) => {
                self.context_kv(context.text, (&self.to_k, &self.norm_k, &self.to_v))?
            }
        };
        let (k, v) = (split(k, kv_len)?, split(v, kv_len)?);
        let image = match self.image_kv(context)? {
            Some((k, v, n)) => Some((split(k, n)?, split(v, n)?)),
            None => None,
        };
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        for (row0, len) in chunks() {
            let at = Rows { row0, seq };
            let entry = |t: &Tensor| t.narrow(0, row0 / seq, 1);
            let rows_x = x.narrow(0, row0, len)?;
            let q = self.to_q.product(&norm(&rows_x, at)?)?;
            let q = split(self.norm_rope(q, &self.to_q, &self.norm_q, rope, at)?, len)?;
            let mut out = sdpa(&q, &entry(&k)?, &entry(&v)?, scale)?;
            if let Some((k, v)) = &image {
                out = (out + sdpa(&q, &entry(k)?, &entry(v)?, scale)?)?;
            }
            drop(q);
            let out = out.transpose(1, 2)?.reshape((len, dim))?;
            write(self.to_out.product(&Input::new(&out))?, at)?;
        }
        Ok(())
    }
}

/// The steps of a block, in execution order. A block can be built with only some of them (an
/// offload engine streaming steps rather than whole blocks); running such a partial block
/// applies just its steps, with exactly the arithmetic of the whole block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockStep {
    /// Modulated LayerNorm, self-attention with RoPE, gated residual.
    SelfAttention,
    /// Optional affine LayerNorm, cross-attention to the text (and, for I2V, the image tokens
    /// through `add_k_proj`/`add_v_proj`/`norm_added_k`), residual.
    CrossAttention,
    /// Modulated LayerNorm, GELU MLP by token chunks, gated residual.
    FeedForward,
}

impl BlockStep {
    pub const ALL: [BlockStep; 3] = [
        BlockStep::SelfAttention,
        BlockStep::CrossAttention,
        BlockStep::FeedForward,
    ];
}

/// One `WanTransformerBlock` of diffusers (or some of its steps, see [`BlockStep`]).
#[derive(Debug, Clone)]
pub struct WanTransformerBlock {
    attn1: Option<WanAttention>,
    /// Cross-attention and its affine LayerNorm (f32 weight, bias; absent when
    /// `cross_attn_norm` is false).
    attn2: Option<(WanAttention, Option<(Tensor, Tensor)>)>,
    ffn: Option<GeluMlp>,
    /// `[1, 6, inner]` in f32 (loaded by the steps that modulate).
    scale_shift_table: Option<Tensor>,
    eps: f64,
}

impl WanTransformerBlock {
    /// Loads one block; `vb` points at `blocks.{i}`. norm2 and scale_shift_table load in f32.
    pub fn new(cfg: &WanTransformerConfig, vb: VarBuilder) -> Result<Self> {
        Self::with_steps(cfg, vb, &BlockStep::ALL)
    }

    /// Loads only the weights of `steps`; `vb` points at `blocks.{i}`.
    pub fn with_steps(
        cfg: &WanTransformerConfig,
        vb: VarBuilder,
        steps: &[BlockStep],
    ) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let f32_vb = vb.clone().set_dtype(DType::F32);
        let has = |s| steps.contains(&s);
        let attn2 = if has(BlockStep::CrossAttention) {
            let norm2 = if cfg.cross_attn_norm {
                let nvb = f32_vb.pp("norm2");
                Some((nvb.get(dim, "weight")?, nvb.get(dim, "bias")?))
            } else {
                None
            };
            Some((WanAttention::cross(cfg, vb.pp("attn2"))?, norm2))
        } else {
            None
        };
        let ffn = if has(BlockStep::FeedForward) {
            Some(GeluMlp::new(
                block_linear(cfg, (dim, cfg.ffn_dim), vb.pp("ffn.net.0.proj"))?,
                block_linear(cfg, (cfg.ffn_dim, dim), vb.pp("ffn.net.2"))?,
            ))
        } else {
            None
        };
        let modulated = has(BlockStep::SelfAttention) || has(BlockStep::FeedForward);
        Ok(Self {
            attn1: if has(BlockStep::SelfAttention) {
                Some(WanAttention::new(cfg, vb.pp("attn1"))?)
            } else {
                None
            },
            attn2,
            ffn,
            scale_shift_table: if modulated {
                Some(f32_vb.get((1, 6, dim), "scale_shift_table")?)
            } else {
                None
            },
            eps: cfg.eps,
        })
    }

    /// Runs the block's steps on `x` `[B, seq, inner]` (model dtype); returns the same shape
    /// and dtype.
    pub fn forward(&self, x: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        self.forward_hooked(x, inputs, &mut ComputeAll)
    }

    /// [`Self::forward`] on hidden states the caller gives up: in low-activation mode
    /// ([`BlockInputs::low_activation`]) the block writes its output over `x`'s storage, so the
    /// hidden states exist once (the caller holds no other view of them that it reads again).
    pub fn forward_owned(&self, x: Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        self.run(x, true, inputs, &mut ComputeAll)
    }

    /// [`Self::forward`], asking `hooks` (a step cache) for the self- and cross-attention
    /// outputs (before their output bias, which the residual adds).
    pub fn forward_hooked(
        &self,
        x: &Tensor,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Tensor> {
        self.run(x.clone(), false, inputs, hooks)
    }

    /// The block on `x`, whose storage is the block's to write where `owned` and in
    /// low-activation mode (else the first step that writes in place writes into a copy).
    fn run(
        &self,
        x: Tensor,
        owned: bool,
        inputs: &BlockInputs,
        hooks: &mut dyn BlockHooks,
    ) -> Result<Tensor> {
        let (batch, seq, dim) = x.dims3()?;
        let all = Rows { row0: 0, seq };
        let low = inputs.low_activation && inputs.sequence.is_none();
        // (scale_shift_table + temb.float()).chunk(6): shift, scale, gate, c_shift, c_scale,
        // c_gate, each [entries, inner] f32 (an entry per batch entry, or per timestep run);
        // scales as 1 + scale.
        let e = match &self.scale_shift_table {
            Some(table) => Some(inputs.modulation(table, &inputs.timestep_proj, 6)?),
            None => None,
        };
        let m = |i: usize| match &e {
            Some(e) => e.narrow(1, i, 1)?.squeeze(1)?.contiguous(),
            None => candle_core::bail!("block step needs the scale_shift_table"),
        };
        let mut x = x.reshape((batch * seq, dim))?;
        // Whether `x` is this block's to write over: given up by the caller in low-activation
        // mode, or made by a step.
        let mut own = owned && low;
        let own_x = |x: &mut Tensor, own: &mut bool| -> Result<()> {
            if !*own {
                *x = x.copy()?;
                *own = true;
            }
            Ok(())
        };

        // 1. Self-attention.
        if let Some(attn1) = &self.attn1 {
            let (shift, scale, gate) = (m(0)?, (m(1)? + 1.0)?, m(2)?);
            let rope = (&inputs.rope_cos, &inputs.rope_sin);
            if low && !hooks.wants(Submodule::SelfAttention) {
                own_x(&mut x, &mut own)?;
                let qkv = [&attn1.to_q, &attn1.to_k, &attn1.to_v];
                let norm = |rows: &Tensor, at: Rows| {
                    let place = (at.row0, seq);
                    inputs.modulated_input(rows, (&scale, &shift), place, self.eps, &qkv)
                };
                let bias = attn1.to_out.bias();
                attn1.forward_rows(&x, batch, &norm, (None, Some(rope)), &mut |out, at| {
                    inputs.modulated_residual_over(&x, out, (bias, &gate), (at.row0, seq))
                })?;
            } else {
                let whole = inputs.grid.iter().product();
                let sp = inputs.sequence.as_deref().map(|sp| (sp, whole));
                let compute = || {
                    let qkv = [&attn1.to_q, &attn1.to_k, &attn1.to_v];
                    let h =
                        inputs.modulated_input(&x, (&scale, &shift), (0, seq), self.eps, &qkv)?;
                    attn1.forward(h, batch, None, Some(rope), sp)
                };
                let (attn, bias) = whole_output(
                    hooks,
                    Submodule::SelfAttention,
                    compute,
                    attn1.to_out.bias(),
                )?;
                x = inputs.modulated_residual(&x, attn, (bias, &gate), (0, seq))?;
                own = true;
            }
        }

        // 2. Cross-attention (no gate, residual in the model dtype).
        if let Some((attn2, norm2)) = &self.attn2 {
            let norm = |rows: &Tensor, at: Rows| match norm2 {
                Some((w, b)) => {
                    let (w, b) = (w.unsqueeze(0)?, b.unsqueeze(0)?);
                    norm_input(rows, &w, &b, at, self.eps, &[&attn2.to_q])
                }
                None => Ok(Input::new(rows)),
            };
            let context = CrossContext {
                text: &inputs.encoder_hidden_states,
                image: inputs.encoder_hidden_states_image.as_ref(),
            };
            if low && !hooks.wants(Submodule::CrossAttention) {
                own_x(&mut x, &mut own)?;
                let bias = attn2.to_out.bias();
                attn2.forward_rows(&x, batch, &norm, (Some(context), None), &mut |out, at| {
                    residual_over(&x, out, bias, at)
                })?;
            } else {
                let compute = || attn2.forward(norm(&x, all)?, batch, Some(context), None, None);
                let (attn, bias) = whole_output(
                    hooks,
                    Submodule::CrossAttention,
                    compute,
                    attn2.to_out.bias(),
                )?;
                x = residual(&x, attn, bias, None, all)?;
                own = true;
            }
        }

        // 3. Feed-forward by token chunks, each written back into `x` (which this block owns):
        // the [tokens, ffn_dim] intermediate never exists whole. Row chunks of a Linear are
        // exact.
        if let Some(ffn) = &self.ffn {
            let (c_shift, c_scale, c_gate) = (m(3)?, (m(4)? + 1.0)?, m(5)?);
            if hooks.wants(Submodule::FeedForward) {
                // A step cache stands in for the whole output: computed unchunked.
                let compute = || {
                    let mod_shift = (&c_scale, &c_shift);
                    let fc1 = [&ffn.fc1];
                    let h = inputs.modulated_input(&x, mod_shift, (0, seq), self.eps, &fc1)?;
                    ffn.forward_without_out_bias(&h)
                };
                let (ff, bias) =
                    whole_output(hooks, Submodule::FeedForward, compute, ffn.fc2.bias())?;
                let x = inputs.modulated_residual(&x, ff, (bias, &c_gate), (0, seq))?;
                return x.reshape((batch, seq, dim));
            }
            own_x(&mut x, &mut own)?;
            let chunk = if low { LOW_ACTIVATION_ROWS } else { FFN_CHUNK };
            for (row0, len) in row_chunks(batch, seq, chunk) {
                let rows = x.narrow(0, row0, len)?;
                let place = (row0, seq);
                let fc1 = [&ffn.fc1];
                let h =
                    inputs.modulated_input(&rows, (&c_scale, &c_shift), place, self.eps, &fc1)?;
                let ff = ffn.forward_without_out_bias(&h)?;
                let bias_gate = (ffn.fc2.bias(), &c_gate);
                inputs.modulated_residual_over(&x, ff, bias_gate, place)?;
            }
        }
        x.reshape((batch, seq, dim))
    }
}

/// Sinusoidal timestep embedding `[B, freq_dim]` in f32, `[cos | sin]`, exactly as diffusers'
/// `Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0)`; `timestep` may be of any dtype.
pub fn timestep_embedding(timestep: &Tensor, freq_dim: usize) -> Result<Tensor> {
    let half = freq_dim / 2;
    // exponent = (-ln(10000) * arange(half)) / half in f32, then exp; computed on the host in
    // f64 and rounded, which is the correctly rounded value of torch's f32 ops.
    let neg_log = -(10000f64.ln()) as f32;
    let freqs: Vec<f32> = (0..half)
        .map(|j| {
            let e = (neg_log * j as f32) / half as f32;
            (e as f64).exp() as f32
        })
        .collect();
    let t = timestep.to_dtype(DType::F32)?.flatten_all()?;
    let b = t.dim(0)?;
    let freqs = Tensor::from_vec(freqs, (1, half), timestep.device())?;
    let args = t.reshape((b, 1))?.broadcast_mul(&freqs)?;
    let mut parts = vec![args.cos()?, args.sin()?];
    if !freq_dim.is_multiple_of(2) {
        parts.push(Tensor::zeros((b, 1), DType::F32, timestep.device())?);
    }
    Tensor::cat(&parts, 1)
}

/// Per-axis RoPE table `[len, dim / 2]` (cos, sin) of positions `0..len`, computed in f64 and
/// cast to f32 like diffusers' `get_1d_rotary_pos_embed(freqs_dtype=float64)`.
fn rope_axis(dim: usize, len: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = dim / 2;
    let mut cos = Vec::with_capacity(len * half);
    let mut sin = Vec::with_capacity(len * half);
    for p in 0..len {
        for j in 0..half {
            let inv_freq = 1.0 / 10000f64.powf((2 * j) as f64 / dim as f64);
            let angle = p as f64 * inv_freq;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (len, half), device)?,
        Tensor::from_vec(sin, (len, half), device)?,
    ))
}

/// diffusers' `WanImageEmbedding`: FP32LayerNorm -> Linear -> GELU (erf) -> Linear ->
/// FP32LayerNorm, embedding CLIP image tokens `[B, N, image_dim]` to `[B, N, inner]`.
#[derive(Debug, Clone)]
struct ImageEmbedder {
    /// f32 (weight, bias) of both norms.
    norm1: (Tensor, Tensor),
    fc1: Linear,
    fc2: Linear,
    norm2: (Tensor, Tensor),
}

/// Epsilon of `WanImageEmbedding`'s FP32LayerNorms (diffusers' default, not the config's).
const IMAGE_EMBEDDER_NORM_EPS: f64 = 1e-5;

impl ImageEmbedder {
    fn new(image_dim: usize, dim: usize, vb: VarBuilder) -> Result<Self> {
        let f32_vb = vb.clone().set_dtype(DType::F32);
        let norm = |name: &str, n: usize| -> Result<(Tensor, Tensor)> {
            let nvb = f32_vb.pp(name);
            Ok((nvb.get(n, "weight")?, nvb.get(n, "bias")?))
        };
        Ok(Self {
            norm1: norm("norm1", image_dim)?,
            fc1: candle_nn::linear(image_dim, image_dim, vb.pp("ff.net.0.proj"))?,
            fc2: candle_nn::linear(image_dim, dim, vb.pp("ff.net.2"))?,
            norm2: norm("norm2", dim)?,
        })
    }

    /// `[B, N, image_dim]` -> `[B, N, inner]` in `dtype`; the norms run in f32 (FP32LayerNorm
    /// casts its output back to the input dtype).
    fn forward(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let norm = |x: &Tensor, (w, bias): &(Tensor, Tensor)| -> Result<Tensor> {
            let d = x.dim(D::Minus1)?;
            let rows = x.reshape((b * n, d))?;
            let whole = Rows {
                row0: 0,
                seq: b * n,
            };
            norm_affine(
                &rows,
                &w.unsqueeze(0)?,
                &bias.unsqueeze(0)?,
                whole,
                IMAGE_EMBEDDER_NORM_EPS,
            )?
            .reshape((b, n, d))
        };
        let h = norm(&x.to_dtype(dtype)?, &self.norm1)?;
        let h = self.fc2.forward(&self.fc1.forward(&h)?.gelu_erf()?)?;
        norm(&h, &self.norm2)
    }
}

/// The diffusers `WanTransformer3DModel` (Wan2.1 T2V/I2V, Wan2.2 TI2V and A14B experts).
#[derive(Debug, Clone)]
pub struct WanTransformer3DModel {
    cfg: WanTransformerConfig,
    /// Conv3d with kernel = stride = patch, stored as a linear over flattened patches.
    patch_embedding: Linear,
    /// f32 (kept in fp32).
    time_embedder: (Linear, Linear),
    time_proj: Linear,
    text_embedder: GeluMlp,
    /// Image-to-video models only.
    image_embedder: Option<ImageEmbedder>,
    blocks: Vec<WanTransformerBlock>,
    /// `[1, 2, inner]` in f32.
    scale_shift_table: Tensor,
    proj_out: Linear,
    dtype: DType,
}

impl WanTransformer3DModel {
    /// Loads the whole model, blocks included.
    pub fn new(cfg: &WanTransformerConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads everything except the blocks (for an engine that streams blocks itself);
    /// `blocks()` is then empty and `forward` refuses to run.
    pub fn new_without_blocks(cfg: &WanTransformerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let [pt, ph, pw] = cfg.patch_size;
        let pvb = vb.pp("patch_embedding");
        let patch_w = pvb
            .get((dim, cfg.in_channels, pt, ph, pw), "weight")?
            .reshape((dim, cfg.in_channels * pt * ph * pw))?;
        let patch_embedding = Linear::new(patch_w, Some(pvb.get(dim, "bias")?));

        let cvb = vb.pp("condition_embedder");
        let tvb = cvb.pp("time_embedder").set_dtype(DType::F32);
        let time_embedder = (
            candle_nn::linear(cfg.freq_dim, dim, tvb.pp("linear_1"))?,
            candle_nn::linear(dim, dim, tvb.pp("linear_2"))?,
        );
        let time_proj = candle_nn::linear(dim, 6 * dim, cvb.pp("time_proj"))?;
        let exact = |linear| Projection::new(linear, false);
        let text_embedder = GeluMlp::new(
            exact(candle_nn::linear(
                cfg.text_dim,
                dim,
                cvb.pp("text_embedder.linear_1"),
            )?),
            exact(candle_nn::linear(
                dim,
                dim,
                cvb.pp("text_embedder.linear_2"),
            )?),
        );
        let image_embedder = match cfg.image_dim {
            Some(image_dim) => Some(ImageEmbedder::new(
                image_dim,
                dim,
                cvb.pp("image_embedder"),
            )?),
            None => None,
        };
        let proj_out =
            candle_nn::linear(dim, cfg.out_channels() * pt * ph * pw, vb.pp("proj_out"))?;
        let scale_shift_table = vb
            .clone()
            .set_dtype(DType::F32)
            .get((1, 2, dim), "scale_shift_table")?;
        Ok(Self {
            cfg: cfg.clone(),
            patch_embedding,
            time_embedder,
            time_proj,
            text_embedder,
            image_embedder,
            blocks: Vec::new(),
            scale_shift_table,
            proj_out,
            dtype: vb.dtype(),
        })
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &WanTransformerConfig {
        &self.cfg
    }

    /// The loaded blocks, in execution order (empty after `new_without_blocks`).
    pub fn blocks(&self) -> &[WanTransformerBlock] {
        &self.blocks
    }

    /// Patch embedding, time/text embeddings and RoPE tables for `latents` `[B, C, F, H, W]`,
    /// `timestep` and `encoder_hidden_states` `[B, L, text_dim]` of a model without image
    /// branch. `timestep` (any dtype, cast to f32) is `[B]` (or one value for the whole batch),
    /// or `[B or 1, seq]` for per-token timesteps (Wan2.2 `expand_timesteps`: one value per
    /// token in (frame, row, column) order).
    pub fn prepare(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
    ) -> Result<BlockInputs> {
        self.prepare_with_image(latents, timestep, encoder_hidden_states, None)
    }

    /// [`Self::prepare`] with, for an image-to-video model, the CLIP image tokens
    /// `encoder_hidden_states_image` `[B, N, image_dim]` (the image encoder's penultimate hidden
    /// states). Such a model needs them and exactly [`IMAGE_BRANCH_TEXT_LEN`] text rows.
    pub fn prepare_with_image(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
        encoder_hidden_states_image: Option<&Tensor>,
    ) -> Result<BlockInputs> {
        let cfg = &self.cfg;
        let (b, grid) = token_grid(latents, cfg.in_channels, cfg.patch_size)?;
        let [pt, ph, pw] = cfg.patch_size;
        if let Some(&g) = grid.iter().find(|&&g| g > cfg.rope_max_seq_len) {
            candle_core::bail!(
                "latent grid extent {g} exceeds rope_max_seq_len {}",
                cfg.rope_max_seq_len
            );
        }
        let text_len = text_len(encoder_hidden_states, b, ("text_dim", cfg.text_dim))?;
        let image_tokens = match (&self.image_embedder, encoder_hidden_states_image) {
            (Some(embedder), Some(image)) => {
                let (ib, _, image_dim) = image.dims3()?;
                if ib != b || Some(image_dim) != cfg.image_dim {
                    candle_core::bail!(
                        "encoder_hidden_states_image {:?} do not match batch {b} and image_dim {:?}",
                        image.dims(),
                        cfg.image_dim
                    );
                }
                if text_len != IMAGE_BRANCH_TEXT_LEN {
                    candle_core::bail!(
                        "image-to-video needs exactly {IMAGE_BRANCH_TEXT_LEN} text rows \
                         (max_sequence_length {IMAGE_BRANCH_TEXT_LEN}), got {text_len}: diffusers \
                         splits the joint context at len - {IMAGE_BRANCH_TEXT_LEN}"
                    );
                }
                Some(embedder.forward(&image.to_device(latents.device())?, self.dtype)?)
            }
            (Some(_), None) => candle_core::bail!(
                "this image-to-video transformer needs the image encoder's hidden states"
            ),
            (None, Some(_)) => {
                candle_core::bail!("image embeddings given to a transformer without image_dim")
            }
            (None, None) => None,
        };
        let device = latents.device();

        // Patch embedding: Conv3d with kernel = stride = patch, as a matmul over patches.
        let [gf, gh, gw] = grid;
        let patches = whole_patches(&latents.to_dtype(self.dtype)?, [pt, ph, pw])?;
        let hidden_states = self.patch_embedding.forward(&patches)?;

        // Time embedding (time_embedder in f32, then cast to the text dtype), per batch entry
        // or, for a 2-D timestep, per token.
        let seq = gf * gh * gw;
        let mut timestep_runs = None;
        let timestep = if timestep.rank() == 2 {
            let (tb, tseq) = timestep.dims2()?;
            if tseq != seq || (tb != b && tb != 1) {
                candle_core::bail!(
                    "per-token timestep {:?} does not match batch {b} and {seq} tokens",
                    timestep.dims()
                );
            }
            // One embedding per run of equal timesteps (the values per token are the same).
            let values: Vec<f32> = timestep
                .to_dtype(DType::F32)?
                .broadcast_as((b, seq))?
                .flatten_all()?
                .to_vec1()?;
            let runs = split_timestep_runs(&values, seq);
            let starts: Vec<f32> = runs.iter().map(|r| values[r.row0]).collect();
            if runs.len() > b {
                timestep_runs = Some(runs);
            }
            Tensor::new(starts, &Device::Cpu)?
        } else {
            match timestep.elem_count() {
                1 if b > 1 => timestep.flatten_all()?.repeat(b)?,
                n if n == b => timestep.flatten_all()?,
                n => candle_core::bail!("timestep has {n} values for a batch of {b}"),
            }
        };
        let t_emb = timestep_embedding(&timestep.to_device(device)?, cfg.freq_dim)?;
        let (lin1, lin2) = &self.time_embedder;
        let temb = lin2
            .forward(&candle_nn::ops::silu(&lin1.forward(&t_emb)?)?)?
            .to_dtype(self.dtype)?;
        let timestep_proj = self
            .time_proj
            .forward(&candle_nn::ops::silu(&temb)?)?
            .reshape(((), 6, cfg.inner_dim()))?;
        let encoder_hidden_states = self
            .text_embedder
            .forward(&encoder_hidden_states.to_dtype(self.dtype)?)?;

        // RoPE: per token (frame, row, col), the t|h|w parts concatenated.
        let dims = cfg.rope_dims();
        let mut cos_parts = Vec::with_capacity(3);
        let mut sin_parts = Vec::with_capacity(3);
        for (axis, (&dim, &len)) in dims.iter().zip(grid.iter()).enumerate() {
            let (cos, sin) = rope_axis(dim, len, device)?;
            let mut shape = [1, 1, 1, dim / 2];
            shape[axis] = len;
            let target = (gf, gh, gw, dim / 2);
            cos_parts.push(cos.reshape(shape.to_vec())?.broadcast_as(target)?);
            sin_parts.push(sin.reshape(shape.to_vec())?.broadcast_as(target)?);
        }
        let half = cfg.attention_head_dim / 2;
        let rope_cos = Tensor::cat(&cos_parts, 3)?
            .reshape((seq, half))?
            .contiguous()?;
        let rope_sin = Tensor::cat(&sin_parts, 3)?
            .reshape((seq, half))?
            .contiguous()?;

        Ok(BlockInputs {
            hidden_states: Some(hidden_states),
            temb,
            timestep_proj,
            timestep_runs,
            encoder_hidden_states,
            encoder_hidden_states_image: image_tokens,
            rope_cos,
            rope_sin,
            batch: b,
            grid,
            sequence: None,
            low_activation: false,
        })
    }

    /// Output norm with (scale_shift_table + temb) modulation, `proj_out` and unpatchify:
    /// `[B, seq, inner]` -> `[B, out_channels, F, H, W]` (model dtype).
    pub fn finish(&self, x: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        self.finish_projecting(x, inputs, &mut |compute| compute())
    }

    /// [`Self::finish`], the output projection's output through `project` (a step cache's,
    /// which may stand in for it).
    pub fn finish_projecting(
        &self,
        x: &Tensor,
        inputs: &BlockInputs,
        project: &mut Through,
    ) -> Result<Tensor> {
        let (batch, seq, dim) = x.dims3()?;
        let e = inputs.modulation(&self.scale_shift_table, &inputs.temb, 1)?;
        let m = |i: usize| e.narrow(1, i, 1)?.squeeze(1)?.contiguous();
        let (shift, scale) = (m(0)?, (m(1)? + 1.0)?);
        let x = x.reshape((batch * seq, dim))?;
        let h = project(&mut || {
            let h = inputs.modulated_norm(&x, (&scale, &shift), (0, seq), self.cfg.eps)?;
            self.proj_out.forward(&h)
        })?;

        let h = h.reshape((inputs.batch, seq, ()))?;
        unpatchify_channels_last(&h, inputs.grid, self.cfg.patch_size)
    }

    /// Full forward: `prepare`, every block, `finish`. Needs a model built with `new`.
    pub fn forward(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
    ) -> Result<Tensor> {
        self.forward_with_image(latents, timestep, encoder_hidden_states, None)
    }

    /// [`Self::forward`] with the image tokens of an image-to-video model (see
    /// [`Self::prepare_with_image`]).
    pub fn forward_with_image(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        encoder_hidden_states: &Tensor,
        encoder_hidden_states_image: Option<&Tensor>,
    ) -> Result<Tensor> {
        if self.blocks.len() != self.cfg.num_layers {
            candle_core::bail!(
                "transformer holds {} of {} blocks; run them through blocks() instead",
                self.blocks.len(),
                self.cfg.num_layers
            );
        }
        let mut inputs = self.prepare_with_image(
            latents,
            timestep,
            encoder_hidden_states,
            encoder_hidden_states_image,
        )?;
        let mut x = inputs.take_hidden_states()?;
        for block in &self.blocks {
            x = block.forward(&x, &inputs)?;
        }
        self.finish(&x, &inputs)
    }
}

// Placed by the block protocol: `blocks.{i}`, each streamed whole or step by step.
crate::repeated_blocks!(
    WanTransformer3DModel,
    WanTransformerConfig,
    WanTransformerBlock,
    BlockStep,
    "blocks",
    skip: LAYERWISE_CASTING_SKIP
);

/// The fused CUDA kernels against the candle compositions they stand in for (run on the CPU in
/// f32 on the same bf16-rounded inputs); skipped without a CUDA device.
#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    use super::*;

    /// Random `shape` rounded to bf16, as (CUDA bf16, CPU f32) copies of the same values.
    fn pair(seed: u64, shape: &[usize], dev: &Device) -> (Tensor, Tensor) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect();
        let cpu = Tensor::from_vec(v, shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::BF16))
            .and_then(|t| t.to_dtype(DType::F32))
            .unwrap();
        let gpu = cpu.to_dtype(DType::BF16).unwrap().to_device(dev).unwrap();
        (gpu, cpu)
    }

    /// max |gpu - cpu| / max |cpu|.
    fn rel(gpu: &Tensor, cpu: &Tensor) -> f32 {
        let gpu = gpu
            .to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let diff = (gpu - cpu).unwrap().abs().unwrap().max_all().unwrap();
        let scale = cpu.abs().unwrap().max_all().unwrap();
        diff.to_scalar::<f32>().unwrap() / scale.to_scalar::<f32>().unwrap()
    }

    #[test]
    fn fused_kernels_match_compositions() {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: skipped");
            return;
        };
        // (heads, head_dim, seq): Wan2.1 1.3B's width (a warp per row), Wan2.2 5B's (2 warps
        // per row), 14B's (4 warps per row) with odd row counts, and widths the grouped and
        // vector kernels do not take (not a multiple of 8; RoPE heads not a multiple of 8).
        for (heads, head_dim, seq) in [(12, 128, 300), (24, 128, 40), (40, 128, 37), (3, 12, 50)] {
            check_fused_kernels(&dev, heads, head_dim, seq);
        }
        check_fused_kernels(&dev, 2, 12, 30);
    }

    /// Every fused kernel against its composition, for batch 2 of `seq` tokens of `heads *
    /// head_dim`: whole tensors, a chunk of rows inside the second batch entry (row0 > 0, the
    /// second entry's modulation), and views whose first element is not 16-byte aligned.
    fn check_fused_kernels(dev: &Device, heads: usize, head_dim: usize, seq: usize) {
        let batch = 2;
        let dim = heads * head_dim;
        let rows = batch * seq;
        let what = format!("dim {dim} (heads {heads} x {head_dim}), seq {seq}");
        let (x, x_ref) = pair(1, &[rows, dim], dev);
        let f32_pair = |seed, shape: &[usize]| {
            let (_, cpu) = pair(seed, shape, dev);
            (cpu.to_device(dev).unwrap(), cpu)
        };
        let (w, w_ref) = f32_pair(2, &[batch, dim]);
        let (b, b_ref) = f32_pair(3, &[batch, dim]);
        let all = Rows { row0: 0, seq };
        // An odd number of rows from a third into the second batch entry.
        let chunk = Rows {
            row0: seq + seq / 3,
            seq,
        };
        let len = (seq / 2) | 1;
        let part = |t: &Tensor| t.narrow(0, chunk.row0, len).unwrap();
        // The first `seq` rows of `t` seen `offset` elements further on (contiguous, storage
        // shared with `t`).
        let shifted = |t: &Tensor, offset: usize| {
            t.flatten_all()
                .unwrap()
                .narrow(0, offset, seq * dim)
                .unwrap()
                .reshape((seq, dim))
                .unwrap()
        };
        let tol = 1e-2;
        let check = |name: &str, got: &Tensor, want: &Tensor| {
            let r = rel(got, want);
            assert!(r < tol, "{name}, {what}: {r}");
        };

        // Modulated LayerNorm: whole tensor, a chunk inside the second batch entry, one row of
        // w/b shared by all (norm2), a misaligned view.
        let got = norm_affine(&x, &w, &b, all, 1e-6).unwrap();
        let want = norm_affine(&x_ref, &w_ref, &b_ref, all, 1e-6).unwrap();
        check("norm", &got, &want);
        let got = norm_affine(&part(&x), &w, &b, chunk, 1e-6).unwrap();
        let want = norm_affine(&part(&x_ref), &w_ref, &b_ref, chunk, 1e-6).unwrap();
        check("chunk norm", &got, &want);
        let first = |t: &Tensor| t.narrow(0, 0, 1).unwrap();
        let got = norm_affine(&x, &first(&w), &first(&b), all, 1e-6).unwrap();
        let want = norm_affine(&x_ref, &first(&w_ref), &first(&b_ref), all, 1e-6).unwrap();
        check("shared norm", &got, &want);
        let got = norm_affine(&shifted(&x, 2), &w, &b, all, 1e-6).unwrap();
        let want = norm_affine(&shifted(&x_ref, 2), &w_ref, &b_ref, all, 1e-6).unwrap();
        check("misaligned norm", &got, &want);

        // Gated residual with a bias, plain, on a chunk, and on misaligned views.
        let (d, d_ref) = pair(4, &[rows, dim], dev);
        let (bias, bias_ref) = pair(5, &[dim], dev);
        let got = residual(&x, d.copy().unwrap(), Some(&bias), Some(&w), all).unwrap();
        let want = residual(&x_ref, d_ref.clone(), Some(&bias_ref), Some(&w_ref), all).unwrap();
        check("residual", &got, &want);
        let got = residual(&x, d.copy().unwrap(), None, None, all).unwrap();
        let want = residual(&x_ref, d_ref.clone(), None, None, all).unwrap();
        check("plain residual", &got, &want);
        let got = residual(
            &part(&x),
            part(&d).copy().unwrap(),
            Some(&bias),
            Some(&w),
            chunk,
        );
        let want = residual(
            &part(&x_ref),
            part(&d_ref),
            Some(&bias_ref),
            Some(&w_ref),
            chunk,
        );
        check("chunk residual", &got.unwrap(), &want.unwrap());
        let delta = shifted(&d.copy().unwrap(), 6);
        let got = residual(&shifted(&x, 2), delta, Some(&bias), Some(&w), all).unwrap();
        let want = residual(
            &shifted(&x_ref, 2),
            shifted(&d_ref, 6),
            Some(&bias_ref),
            Some(&w_ref),
            all,
        )
        .unwrap();
        check("misaligned residual", &got, &want);
        // Written over a chunk of rows where they lie: the bits of the sum written into delta,
        // and the rows around it untouched.
        let over = x.copy().unwrap();
        row_ops::residual_over(
            &part(&over),
            &part(&d),
            Some(&bias),
            Some(row_ops::Gate::F32(&w)),
            chunk.kernel(),
        )
        .unwrap();
        let into = residual(
            &part(&x),
            part(&d).copy().unwrap(),
            Some(&bias),
            Some(&w),
            chunk,
        );
        let values = |t: &Tensor| -> Vec<f32> {
            let t = t.to_dtype(DType::F32).unwrap();
            t.flatten_all().unwrap().to_vec1().unwrap()
        };
        assert_eq!(
            values(&part(&over)),
            values(&into.unwrap()),
            "over rows, {what}"
        );
        let (end, all_rows) = (chunk.row0 + len, x.dim(0).unwrap());
        for (from, n) in [(0, chunk.row0), (end, all_rows - end)] {
            let around = |t: &Tensor| values(&t.narrow(0, from, n).unwrap());
            assert_eq!(around(&over), around(&x), "rows around, {what}");
        }

        // q/k: bias, RMSNorm across heads, RoPE.
        let attn = |dev: &Device, dtype| {
            let (wq, wq_ref) = pair(6, &[dim, dim], &Device::Cpu);
            let w = if dtype == DType::BF16 { wq } else { wq_ref };
            let t = |v: &Tensor| v.to_dtype(dtype).unwrap().to_device(dev).unwrap();
            let lin = Projection::new(Linear::new(t(&w), Some(t(&bias_ref))), false);
            WanAttention {
                to_q: lin.clone(),
                to_k: lin.clone(),
                to_v: lin.clone(),
                to_out: lin,
                norm_q: t(&(bias_ref.abs().unwrap() + 0.5).unwrap()),
                norm_k: t(&bias_ref),
                added: None,
                heads,
                head_dim,
                eps: 1e-6,
            }
        };
        let (gpu_attn, cpu_attn) = (attn(dev, DType::BF16), attn(&Device::Cpu, DType::F32));
        let (angles, _) = f32_pair(7, &[seq, head_dim / 2]);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let cpu_rope = (
            cos.to_device(&Device::Cpu).unwrap(),
            sin.to_device(&Device::Cpu).unwrap(),
        );
        let gpu_q = |x: Tensor, at: Rows, rope: bool| {
            let rope = rope.then_some((&cos, &sin));
            let a = &gpu_attn;
            a.norm_rope(x, &a.to_q, &a.norm_q, rope, at).unwrap()
        };
        let cpu_q = |x: Tensor, at: Rows, rope: bool| {
            let rope = rope.then_some((&cpu_rope.0, &cpu_rope.1));
            let a = &cpu_attn;
            a.norm_rope(x, &a.to_q, &a.norm_q, rope, at).unwrap()
        };
        let want = cpu_q(d_ref.clone(), all, true);
        check("rms+rope", &gpu_q(d.copy().unwrap(), all, true), &want);
        // Rows of the second entry: their RoPE positions follow row0.
        let got = gpu_q(part(&d).copy().unwrap(), chunk, true);
        check("chunk rms+rope", &got, &part(&want));
        let got = gpu_q(shifted(&d.copy().unwrap(), 4), all, true);
        check(
            "misaligned rms+rope",
            &got,
            &cpu_q(shifted(&d_ref, 4), all, true),
        );
        // Keys of a cross-attention: no RoPE.
        let got = gpu_q(d.copy().unwrap(), all, false);
        check("rms", &got, &cpu_q(d_ref.clone(), all, false));

        // Bias in place (the v projection).
        let got = gpu_attn.to_v.apply(&Input::new(&x), false).unwrap();
        let want = cpu_attn.to_v.apply(&Input::new(&x_ref), false).unwrap();
        check("linear", &got, &want);

        // Bias + GELU inside the feed-forward.
        let mlp = |a: &WanAttention| GeluMlp::new(a.to_q.clone(), a.to_k.clone());
        let got = mlp(&gpu_attn)
            .forward_without_out_bias(&Input::new(&x))
            .unwrap();
        let want = mlp(&cpu_attn)
            .forward_without_out_bias(&Input::new(&x_ref))
            .unwrap();
        check("ffn", &got, &want);

        // The bias + GELU kernel itself (`Projection::apply` may fuse it into the matmul), also
        // on a misaligned view.
        let act = row_ops::Act::GeluTanh;
        let want = x_ref.broadcast_add(&bias_ref).unwrap().gelu().unwrap();
        let got = row_ops::bias_act(x.copy().unwrap(), &bias, act).unwrap();
        check("bias_act", &got, &want);
        let got = row_ops::bias_act(shifted(&x.copy().unwrap(), 2), &bias, act).unwrap();
        let want = shifted(&x_ref, 2)
            .broadcast_add(&bias_ref)
            .unwrap()
            .gelu()
            .unwrap();
        check("misaligned bias_act", &got, &want);
    }
}
