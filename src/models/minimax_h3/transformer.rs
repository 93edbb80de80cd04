//! MiniMax H3 diffusion transformer (diffusers `MiniMaxH3Transformer3DModel`).
//!
//! One stack of blocks runs full self-attention over a single packed sequence holding text,
//! stereo-audio and video rows. Modalities differ only in their input projections, the per-row
//! AdaLN slot (`timestep_index * 3 + modality tag`) and the output heads, so one forward serves
//! rows at different noise levels.
//!
//! The forward is split like Wan's so an engine can stream the blocks:
//! 1. [`MiniMaxH3Transformer3DModel::prepare`]: input projections, token refiner, packing, time
//!    embedding, per-row AdaLN indices and RoPE tables.
//! 2. [`MiniMaxH3TransformerBlock::forward`] for every block, in order, starting from
//!    [`BlockInputs::take_hidden_states`].
//! 3. [`MiniMaxH3Transformer3DModel::finish`]: modulated output norm and the two velocity heads.
//!
//! The token refiner (`num_refiner_layers` plain blocks over the text rows) belongs to the
//! non-block part: it runs once in `prepare`.
//!
//! With `--fp8-matmul` the main blocks' attention and feed-forward Linears run in e4m3
//! ([`Projection`]); the token refiner (text rows only), the AdaLN projections, embedders and
//! output heads stay exact.

use std::sync::Arc;

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;

use crate::models::attention::sdpa;
use crate::models::blocks::{Blockwise, RepeatedBlocks};
use crate::models::projection::{Input, Projection};
use crate::models::wan::transformer::timestep_embedding;

use super::nn::{cos_sin, partial_rope, RmsNorm, SwiGlu};

/// Modalities of the packed sequence, in the order of the AdaLN table: video 0, text 1, audio 2.
pub const MODALITY_COUNT: usize = 3;
/// Modality tag of video rows.
pub const TAG_VIDEO: u32 = 0;
/// Modality tag of text rows.
pub const TAG_TEXT: u32 = 1;
/// Modality tag of audio rows.
pub const TAG_AUDIO: u32 = 2;

/// Elements of the widest per-chunk temporary (the SwiGLU input): 512 Mi, 1 GiB in bf16.
pub const CHUNK_ELEMENTS: usize = 1 << 29;

/// Rows of each of the fewest chunks of at most `most` rows that cover `total` rows, as equal as
/// can be: `ceil(total / n)` for the fewest such `n` (the last chunk the remainder).
pub fn chunk_rows(total: usize, most: usize) -> usize {
    total.div_ceil(total.div_ceil(most.max(1)).max(1)).max(1)
}

/// `(start, len)` of consecutive chunks of [`chunk_rows`] rows covering `0..total`: every matmul
/// of a step runs at one size, never at a short remainder's (which wastes most of a wave of
/// tiles on the GPU).
fn row_chunks(total: usize, rows: usize) -> impl Iterator<Item = (usize, usize)> {
    let rows = chunk_rows(total, rows);
    (0..total)
        .step_by(rows)
        .map(move |start| (start, rows.min(total - start)))
}

/// `transformer/config.json`; missing keys take diffusers' defaults (the published 33B model).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct MiniMaxH3TransformerConfig {
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Width of one head (attention width = heads x head dim, independent of `hidden_size`).
    pub attention_head_dim: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Number of main (AdaLN-modulated) blocks.
    pub num_layers: usize,
    /// Number of plain blocks refining the text rows.
    pub num_refiner_layers: usize,
    /// Inner width of the SwiGLU feed-forwards.
    pub ffn_dim: usize,
    /// Video latent channels.
    pub in_channels: usize,
    /// Audio latent channels (one row per latent per stereo channel).
    pub audio_in_channels: usize,
    /// Video patch (frames, height, width) packed into one row.
    pub patch_size: [usize; 3],
    /// Width of the text-encoder hidden states.
    pub text_dim: usize,
    /// Width of the sinusoidal timestep embedding.
    pub freq_dim: usize,
    /// Inner width of the timestep MLP.
    pub time_embed_hidden_dim: usize,
    /// Output width of the timestep MLP (input of every AdaLN projection).
    pub time_embed_dim: usize,
    /// Rotary frequencies per axis; `6 * rope_freq_dim` channels of each head are rotated.
    pub rope_freq_dim: usize,
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
    /// Epsilon of the pre-attention and pre-feed-forward RMSNorms.
    pub norm_eps: f64,
    /// Epsilon of the per-head query/key RMSNorms.
    pub qk_norm_eps: f64,
    /// Epsilon of the refiner's final norm and of `norm_out`.
    pub final_norm_eps: f64,
    /// Not in the file: the blocks are built without their AdaLN projections, whose tables
    /// (which depend on a step's timesteps alone) a [`MiniMaxH3Modulations`] computes for every
    /// step before denoising and hands in through [`BlockInputs::adaln_tables`]. A streamed DiT
    /// then moves 43% fewer bytes per forward.
    #[serde(skip)]
    pub modulations_apart: bool,
    /// Not in the file: the main blocks' attention and feed-forward Linears run in fp8
    /// (`--fp8-matmul`, set by the pipeline).
    #[serde(skip)]
    pub fp8_matmul: bool,
}

impl Default for MiniMaxH3TransformerConfig {
    fn default() -> Self {
        Self {
            num_attention_heads: 56,
            attention_head_dim: 128,
            hidden_size: 5376,
            num_layers: 50,
            num_refiner_layers: 2,
            ffn_dim: 14336,
            in_channels: 24,
            audio_in_channels: 32,
            patch_size: [1, 2, 2],
            text_dim: 5120,
            freq_dim: 256,
            time_embed_hidden_dim: 5376,
            time_embed_dim: 2688,
            rope_freq_dim: 16,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            qk_norm_eps: 1e-5,
            final_norm_eps: 1e-5,
            modulations_apart: false,
            fp8_matmul: false,
        }
    }
}

impl MiniMaxH3TransformerConfig {
    /// The rotary tables (cos, sin) of `layout`'s rows, for
    /// [`MiniMaxH3Transformer3DModel::prepare`]: made once per video, not per forward (on the
    /// host they take ~75 ms at the published size).
    pub fn rope(&self, layout: &PackedLayout) -> Result<(Tensor, Tensor)> {
        rope_tables(&layout.position_ids, self.rope_freq_dim, self.rope_theta)
    }

    /// Attention width: heads x head dim.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Values in one video row: `in_channels` x the patch volume.
    pub fn video_patch_dim(&self) -> usize {
        self.in_channels * self.patch_size.iter().product::<usize>()
    }

    /// Most rows of the packed sequence one step of a block or of the output head computes at
    /// once, queries of attention included: the SwiGLU input of a chunk (rows x `2 * ffn_dim`)
    /// holds at most [`CHUNK_ELEMENTS`] (18,724 rows at the published width: three chunks of
    /// 12,741 rows for a 5 s request). The full-width temporaries of a block then stay near the
    /// K and V that full attention must hold for every row, and the GPU's matmuls run at full
    /// waves: on an H100 the published block took 0.1132 s in those chunks (its queries whole)
    /// against 0.1183 s in 2340-row ones (bench/RESULTS.md, session 57).
    pub fn rows_per_chunk(&self) -> usize {
        (CHUNK_ELEMENTS / (2 * self.ffn_dim).max(1)).max(1)
    }

    /// Channels of each head that RoPE rotates (`2 * 3 * rope_freq_dim`).
    pub fn rotary_dim(&self) -> usize {
        6 * self.rope_freq_dim
    }

    /// Rejects configurations the model cannot run, naming the key.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("num_attention_heads", self.num_attention_heads),
            ("attention_head_dim", self.attention_head_dim),
            ("hidden_size", self.hidden_size),
            ("ffn_dim", self.ffn_dim),
            ("in_channels", self.in_channels),
            ("audio_in_channels", self.audio_in_channels),
            ("text_dim", self.text_dim),
            ("freq_dim", self.freq_dim),
            ("time_embed_hidden_dim", self.time_embed_hidden_dim),
            ("time_embed_dim", self.time_embed_dim),
        ];
        crate::models::config_checks::positive("transformer config", &positive)?;
        if self.patch_size.contains(&0) {
            candle_core::bail!("transformer config: patch_size entries must be positive");
        }
        if self.rotary_dim() > self.attention_head_dim {
            candle_core::bail!(
                "transformer config: rope_freq_dim {} rotates {} channels, more than attention_head_dim {}",
                self.rope_freq_dim,
                self.rotary_dim(),
                self.attention_head_dim
            );
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            candle_core::bail!("transformer config: rope_theta must be a positive number");
        }
        for (key, eps) in [
            ("norm_eps", self.norm_eps),
            ("qk_norm_eps", self.qk_norm_eps),
            ("final_norm_eps", self.final_norm_eps),
        ] {
            if !(eps.is_finite() && eps >= 0.0) {
                candle_core::bail!("transformer config: {key} must be a non-negative number");
            }
        }
        Ok(())
    }
}

/// Where every row of the packed sequence comes from and how it is treated: one layout shared
/// by every batch item (diffusers' batch axis is pure replication).
#[derive(Debug, Clone)]
pub struct PackedLayout {
    /// `[S]` modality tag per row (0 video, 1 text, 2 audio); any integer dtype.
    pub token_tags: Tensor,
    /// `[S, 3]` (t, h, w) rotary coordinates per row; cast to f32 as diffusers does.
    pub position_ids: Tensor,
    /// `[Nv]` sequence positions of the video rows, in row order.
    pub video_indices: Tensor,
    /// `[2 Na]` sequence positions of the audio rows (left channel block, then right).
    pub audio_indices: Tensor,
    /// `[L]` sequence positions of the text rows.
    pub text_indices: Tensor,
}

/// Everything the blocks and the output head need, computed once per forward by `prepare`.
#[derive(Debug, Clone)]
pub struct BlockInputs {
    hidden_states: Option<Tensor>,
    /// `[T, time_embed_dim]` f32 time embedding, one row per distinct timestep (`None` from a
    /// model built with [`MiniMaxH3TransformerConfig::modulations_apart`]: it holds no time
    /// embedder, the tables come computed).
    pub temb: Option<Tensor>,
    /// `[S]` u32 row of the `[T * 3, ..]` AdaLN table for each sequence row.
    pub adaln_indices: Tensor,
    /// `[S]` u32 timestep index of each row (the output norm's table row).
    pub timestep_indices: Tensor,
    /// `[S, 3 * rope_freq_dim]` f32 RoPE cosines (the duplicated half of diffusers' table).
    pub rope_cos: Tensor,
    /// `[S, 3 * rope_freq_dim]` f32 RoPE sines.
    pub rope_sin: Tensor,
    /// Rows the blocks and the output head compute at once (`prepare` sets the config's
    /// [`MiniMaxH3TransformerConfig::rows_per_chunk`] whatever the offload mode; another value
    /// changes results only by rounding, where a matmul of fewer rows sums differently).
    pub rows_per_chunk: usize,
    /// Most rows whose queries one attention step takes (`prepare` sets
    /// [`MiniMaxH3TransformerConfig::rows_per_chunk`]; another value changes results only by
    /// rounding).
    pub query_rows_per_chunk: usize,
    /// `[Nv]` u32 positions of the video rows.
    pub video_indices: Tensor,
    /// `[2 Na]` u32 positions of the audio rows.
    pub audio_indices: Tensor,
    /// With [`MiniMaxH3TransformerConfig::modulations_apart`]: each block's AdaLN table for
    /// this forward, by block index ([`AdalnProjection::table`]'s output), then the output
    /// norm's ([`MiniMaxH3Modulations::output_table`]'s).
    pub adaln_tables: Option<Arc<Vec<Tensor>>>,
}

impl BlockInputs {
    /// Takes the packed sequence `[B, S, hidden]` that feeds block 0 (once, so the activation is
    /// not held twice).
    pub fn take_hidden_states(&mut self) -> Result<Tensor> {
        self.hidden_states
            .take()
            .ok_or_else(|| candle_core::Error::Msg("block-0 hidden states already taken".into()))
    }

    /// `temb`, for a part that holds its modulation Linear.
    fn temb(&self) -> Result<&Tensor> {
        self.temb.as_ref().ok_or_else(|| {
            candle_core::Error::Msg(
                "this transformer computes its modulations apart: pass its AdaLN tables".into(),
            )
        })
    }
}

/// Per-row indices as host `u32`s, checked against `bound`.
fn host_indices(what: &str, t: &Tensor, bound: usize) -> Result<Vec<u32>> {
    let values = t.flatten_all()?.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    values
        .into_iter()
        .map(|v| {
            if v < 0 || v as usize >= bound {
                candle_core::bail!("{what}: index {v} outside 0..{bound}")
            }
            Ok(v as u32)
        })
        .collect()
}

/// Attention with per-head RMSNorm on q and k and partial rotate-half RoPE, no biases.
#[derive(Debug, Clone)]
struct Attention {
    to_q: Projection,
    to_k: Projection,
    to_v: Projection,
    to_out: Projection,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    heads: usize,
    head_dim: usize,
}

impl Attention {
    /// Its Linears in fp8 where `fp8`.
    fn new(cfg: &MiniMaxH3TransformerConfig, vb: VarBuilder, fp8: bool) -> Result<Self> {
        let (dim, inner) = (cfg.hidden_size, cfg.inner_dim());
        let linear = |in_out, name| Projection::load_with(in_out, false, vb.pp(name), fp8);
        Ok(Self {
            to_q: linear((dim, inner), "to_q")?,
            to_k: linear((dim, inner), "to_k")?,
            to_v: linear((dim, inner), "to_v")?,
            to_out: linear((inner, dim), "to_out.0")?,
            norm_q: RmsNorm::new(cfg.attention_head_dim, cfg.qk_norm_eps, vb.pp("norm_q"))?,
            norm_k: RmsNorm::new(cfg.attention_head_dim, cfg.qk_norm_eps, vb.pp("norm_k"))?,
            heads: cfg.num_attention_heads,
            head_dim: cfg.attention_head_dim,
        })
    }

    /// `[B, S, inner]` -> `[B, heads, S, head_dim]` after the per-head RMSNorm and, when given,
    /// RoPE on the leading rotary channels of each head. With `fused` = (first row, sequence
    /// length) of one batch entry's rows, whose RoPE tables `rope` holds for the whole sequence,
    /// one CUDA kernel does both in place and the result is a view of token-major
    /// `[B, S, heads, head_dim]` storage.
    fn heads_normed(
        &self,
        x: Tensor,
        norm: &RmsNorm,
        rope: Option<(&Tensor, &Tensor)>,
        fused: Option<(usize, usize)>,
    ) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        #[cfg(feature = "cuda")]
        if let (Some((row0, seq)), Some((cos, sin))) = (fused, rope) {
            return crate::models::row_ops::head_rms_rope_half(
                x.reshape((b * s, self.heads * self.head_dim))?,
                &norm.weight,
                (cos, sin),
                self.head_dim,
                2 * cos.dim(1)?,
                crate::models::row_ops::Rows { row0, seq },
                norm.eps as f64,
            )?
            .reshape((b, s, self.heads, self.head_dim))?
            .transpose(1, 2);
        }
        let _ = fused;
        let x = norm
            .forward(&x.reshape((b, s, self.heads, self.head_dim))?)?
            .transpose(1, 2)?
            .contiguous()?;
        match rope {
            Some((cos, sin)) => partial_rope(&x, cos, sin),
            None => Ok(x),
        }
    }

    /// `[B, n, inner]` -> `[B, heads, n, head_dim]` (a view).
    fn split_heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        x.reshape((b, n, self.heads, self.head_dim))?
            .transpose(1, 2)
    }

    /// Attention of the queries `q` over `k` and `v` (all `[B, heads, n, head_dim]`), heads
    /// merged back and projected out: `[B, n_q, hidden]`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (b, _, n, _) = q.dims4()?;
        let out = sdpa(q, k, v, 1.0 / (self.head_dim as f64).sqrt())?
            .transpose(1, 2)?
            .reshape((b, n, self.heads * self.head_dim))?;
        self.to_out.forward(&out)
    }

    /// Full self-attention of `x` `[B, S, hidden]` over itself.
    fn forward(&self, x: &Tensor, rope: Option<(&Tensor, &Tensor)>) -> Result<Tensor> {
        let x = Input::new(x);
        let q = self.heads_normed(self.to_q.forward_input(&x)?, &self.norm_q, rope, None)?;
        let k = self.heads_normed(self.to_k.forward_input(&x)?, &self.norm_k, rope, None)?;
        let v = self.split_heads(&self.to_v.forward_input(&x)?)?;
        self.attend(&q, &k, &v)
    }

    /// K and V `[B, heads, S, head_dim]` of all `S` rows, projected chunk by chunk into buffers
    /// allocated once (`input(c)` gives chunk `c`'s attention input, `key_heads(k, c)` its keys'
    /// norm and RoPE). `token_major` buffers (`[1, S, heads, head_dim]`, the fused kernels'
    /// layout, which attention reads through strides) give views of them, and an exact product
    /// is written straight into its chunk's rows there (the keys then normed and rotated in
    /// place) instead of being copied in.
    fn keys_values(
        &self,
        like: &Tensor,
        chunks: &[(usize, usize)],
        input: impl Fn((usize, usize)) -> Result<Tensor>,
        key_heads: impl Fn(Tensor, (usize, usize)) -> Result<Tensor>,
        token_major: bool,
    ) -> Result<(Tensor, Tensor)> {
        let (b, s, _) = like.dims3()?;
        let inner = self.heads * self.head_dim;
        let (dims, seq_axis) = if token_major {
            ((b, s, self.heads, self.head_dim), 1)
        } else {
            ((b, self.heads, s, self.head_dim), 2)
        };
        let end = chunks.iter().try_fold(0, |next, &(start, len)| {
            (start == next).then_some(next + len)
        });
        if end != Some(s) {
            candle_core::bail!("key chunks {chunks:?} do not tile the {s} rows in order");
        }
        // SAFETY: the chunks tile the rows, and each chunk's rows of both are written below
        // before anything reads them.
        let (k, v) = unsafe {
            (
                Tensor::empty(dims, like.dtype(), like.device())?,
                Tensor::empty(dims, like.dtype(), like.device())?,
            )
        };
        // A chunk's `[B, heads, n, head_dim]` in the buffers' layout.
        let stored = |t: Tensor| {
            if token_major {
                t.transpose(1, 2)?.contiguous()
            } else {
                t.contiguous()
            }
        };
        for &c in chunks {
            // One input for K and V: quantized once under `--fp8-matmul`.
            let h = Input::new(&input(c)?);
            // Rows `c` of `buf` from `proj`, `finish` applied (in place where written there).
            let project =
                |proj: &Projection, buf: &Tensor, finish: &dyn Fn(Tensor) -> Result<Tensor>| {
                    if token_major {
                        let rows = buf.narrow(1, c.0, c.1)?;
                        // Contiguous (one batch entry): the reshapes are views of the buffer.
                        if rows.is_contiguous()
                            && proj.product_into(&h, &rows.reshape((b * c.1, inner))?)?
                        {
                            return finish(rows.reshape((b, c.1, inner))?).map(drop);
                        }
                    }
                    buf.slice_set(&stored(finish(proj.forward_input(&h)?)?)?, seq_axis, c.0)
                };
            project(&self.to_k, &k, &|t| key_heads(t, c))?;
            project(&self.to_v, &v, &|t| self.split_heads(&t))?;
        }
        if token_major {
            Ok((k.transpose(1, 2)?, v.transpose(1, 2)?))
        } else {
            Ok((k, v))
        }
    }
}

/// Plain pre-norm block of the token refiner (no AdaLN, no RoPE); exact under `--fp8-matmul`:
/// it runs once per forward, over the text rows alone.
#[derive(Debug, Clone)]
struct RefinerBlock {
    norm1: RmsNorm,
    attn: Attention,
    norm2: RmsNorm,
    ff: SwiGlu,
}

impl RefinerBlock {
    fn new(cfg: &MiniMaxH3TransformerConfig, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            norm1: RmsNorm::new(cfg.hidden_size, cfg.norm_eps, vb.pp("norm1"))?,
            attn: Attention::new(cfg, vb.pp("attn"), false)?,
            norm2: RmsNorm::new(cfg.hidden_size, cfg.norm_eps, vb.pp("norm2"))?,
            ff: SwiGlu::new(cfg.hidden_size, cfg.ffn_dim, false, vb.pp("ff"), false)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + self.attn.forward(&self.norm1.forward(x)?, None)?)?;
        &x + self.ff.forward(&self.norm2.forward(&x)?)?
    }
}

/// `x * (1 + scale) + shift` with per-row `[S, dim]` modulation broadcast over the batch.
fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    x.broadcast_mul(&(scale + 1.0)?)?.broadcast_add(shift)
}

/// `time_embedder` (kept in f32): the sinusoid of each distinct timestep through two Linears.
/// The transformer holds it, and so does [`MiniMaxH3Modulations`].
#[derive(Debug, Clone)]
struct TimeEmbedder {
    linear_1: Linear,
    linear_2: Linear,
    freq_dim: usize,
}

impl TimeEmbedder {
    /// `vb` is the transformer's root.
    fn new(cfg: &MiniMaxH3TransformerConfig, vb: &VarBuilder) -> Result<Self> {
        let vb = vb.clone().set_dtype(DType::F32).pp("time_embedder");
        Ok(Self {
            linear_1: candle_nn::linear(
                cfg.freq_dim,
                cfg.time_embed_hidden_dim,
                vb.pp("linear_1"),
            )?,
            linear_2: candle_nn::linear(
                cfg.time_embed_hidden_dim,
                cfg.time_embed_dim,
                vb.pp("linear_2"),
            )?,
            freq_dim: cfg.freq_dim,
        })
    }

    /// `[T]` distinct timesteps -> `[T, time_embed_dim]` f32.
    fn forward(&self, timestep: &Tensor) -> Result<Tensor> {
        let t = timestep_embedding(timestep, self.freq_dim)?;
        self.linear_2
            .forward(&candle_nn::ops::silu(&self.linear_1.forward(&t)?)?)
    }
}

/// Every main block's AdaLN projection alone (43% of a block at the published size): what a
/// model built with [`MiniMaxH3TransformerConfig::modulations_apart`] leaves out. The tables
/// depend on a step's timesteps only, so one pass over the projections before denoising
/// computes every step's ([`BlockInputs::adaln_tables`]).
#[derive(Debug, Clone)]
pub struct MiniMaxH3Modulations {
    time_embedder: TimeEmbedder,
    /// The output norm's modulation Linear (`norm_out.linear`).
    norm_out_linear: Linear,
    blocks: Vec<AdalnProjection>,
}

impl MiniMaxH3Modulations {
    /// Loads the time embedder and every block's projection; `vb` is the transformer's root.
    pub fn new(cfg: &MiniMaxH3TransformerConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads the time embedder and the output norm's Linear only (an engine streams the
    /// projections itself).
    pub fn new_without_blocks(cfg: &MiniMaxH3TransformerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            time_embedder: TimeEmbedder::new(cfg, &vb)?,
            norm_out_linear: norm_out_linear(cfg, &vb)?,
            blocks: Vec::new(),
        })
    }

    /// The output norm's table `[T, 2 * hidden]` (shift, scale per distinct timestep) for the
    /// time embedding `temb`: [`BlockInputs::adaln_tables`]' entry after the blocks'.
    pub fn output_table(&self, temb: &Tensor) -> Result<Tensor> {
        output_table(&self.norm_out_linear, temb)
    }

    /// The loaded projections, in block order (empty after `new_without_blocks`).
    pub fn blocks(&self) -> &[AdalnProjection] {
        &self.blocks
    }

    /// The time embedding the tables are computed from, exactly as the transformer's
    /// ([`MiniMaxH3Transformer3DModel::time_embedding`]).
    pub fn time_embedding(&self, timestep: &Tensor) -> Result<Tensor> {
        self.time_embedder.forward(timestep)
    }
}

/// `norm_out.linear`: a `[T, time_embed_dim]` time embedding to the output norm's shift and
/// scale.
fn norm_out_linear(cfg: &MiniMaxH3TransformerConfig, vb: &VarBuilder) -> Result<Linear> {
    candle_nn::linear(
        cfg.time_embed_dim,
        2 * cfg.hidden_size,
        vb.pp("norm_out.linear"),
    )
}

/// The output norm's table `[T, 2 * hidden]`: `silu` on the f32 `temb`, cast to the Linear's
/// dtype, as diffusers does.
fn output_table(linear: &Linear, temb: &Tensor) -> Result<Tensor> {
    linear.forward(&candle_nn::ops::silu(temb)?.to_dtype(linear.weight().dtype())?)
}

/// A main block's AdaLN projection (`adaln_proj.linear`): a step's `[T, time_embed_dim]` time
/// embedding to its `[T * 3, 6 * hidden]` table.
#[derive(Debug, Clone)]
pub struct AdalnProjection {
    linear: Linear,
    hidden: usize,
}

impl AdalnProjection {
    /// Loads block `index`'s projection; `vb` is the transformer's root.
    pub fn new(cfg: &MiniMaxH3TransformerConfig, index: usize, vb: VarBuilder) -> Result<Self> {
        Self::in_block(cfg, vb.pp(format!("transformer_blocks.{index}")))
    }

    /// Loads a block's projection; `vb` points at the block (`transformer_blocks.{index}`).
    fn in_block(cfg: &MiniMaxH3TransformerConfig, vb: VarBuilder) -> Result<Self> {
        let dim = cfg.hidden_size;
        Ok(Self {
            linear: candle_nn::linear(
                cfg.time_embed_dim,
                6 * dim * MODALITY_COUNT,
                vb.pp("adaln_proj.linear"),
            )?,
            hidden: dim,
        })
    }

    /// The AdaLN table `[T * 3, 6 * hidden]` (row `t_index * 3 + tag`; columns shift_msa,
    /// scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp). `silu` runs on the f32 `temb`,
    /// then the result is cast to the projection's dtype, as diffusers does.
    pub fn table(&self, temb: &Tensor) -> Result<Tensor> {
        let act = candle_nn::ops::silu(temb)?.to_dtype(self.linear.weight().dtype())?;
        self.linear.forward(&act)?.reshape(((), 6 * self.hidden))
    }
}

/// One main block: AdaLN-modulated self-attention and SwiGLU, parameters picked per row from
/// the `(timestep, modality)` table.
#[derive(Debug, Clone)]
pub struct MiniMaxH3TransformerBlock {
    /// Its place in execution order: which table computed apart is its.
    index: usize,
    norm1: RmsNorm,
    attn: Attention,
    norm2: RmsNorm,
    ff: SwiGlu,
    /// `None` with the modulations apart.
    adaln: Option<AdalnProjection>,
    hidden: usize,
}

impl MiniMaxH3TransformerBlock {
    /// Loads block `index` (without its AdaLN projection where the config says the
    /// modulations are apart); `vb` is the transformer's root.
    pub fn new(cfg: &MiniMaxH3TransformerConfig, index: usize, vb: VarBuilder) -> Result<Self> {
        Self::in_block(cfg, index, vb.pp(format!("transformer_blocks.{index}")))
    }

    /// [`Self::new`] with `bvb` pointing at the block (`transformer_blocks.{index}`).
    pub fn in_block(
        cfg: &MiniMaxH3TransformerConfig,
        index: usize,
        bvb: VarBuilder,
    ) -> Result<Self> {
        let dim = cfg.hidden_size;
        Ok(Self {
            index,
            norm1: RmsNorm::new(dim, cfg.norm_eps, bvb.pp("norm1"))?,
            attn: Attention::new(cfg, bvb.pp("attn"), cfg.fp8_matmul)?,
            norm2: RmsNorm::new(dim, cfg.norm_eps, bvb.pp("norm2"))?,
            ff: SwiGlu::new(
                cfg.hidden_size,
                cfg.ffn_dim,
                false,
                bvb.pp("ff"),
                cfg.fp8_matmul,
            )?,
            adaln: (!cfg.modulations_apart)
                .then(|| AdalnProjection::in_block(cfg, bvb))
                .transpose()?,
            hidden: dim,
        })
    }

    /// This forward's AdaLN table: computed from `inputs.temb`, or the one computed apart.
    fn adaln_table(&self, inputs: &BlockInputs) -> Result<Tensor> {
        match &self.adaln {
            Some(adaln) => adaln.table(inputs.temb()?),
            None => inputs
                .adaln_tables
                .as_ref()
                .and_then(|tables| tables.get(self.index))
                .cloned()
                .ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "block {} has its AdaLN projection apart: pass its table",
                        self.index
                    ))
                }),
        }
    }

    /// `x` `[B, S, hidden]` -> `[B, S, hidden]`, in chunks of `inputs.rows_per_chunk` rows:
    /// everything but attention is row-wise, and attention builds K and V of every row first,
    /// then attends chunk by chunk (`inputs.query_rows_per_chunk` queries at a time). The
    /// residual stream is updated in place: for a contiguous `x` the result shares its storage,
    /// so `x` is spent (the stream is never copied whole).
    /// On CUDA bf16 with one batch entry, fused kernels read each row's modulation through its
    /// AdaLN index (no gathered copies), norm and rotate q and k in place, and add the gated
    /// updates into the stream.
    pub fn forward(&self, x: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        let x = x.contiguous()?;
        let seq = x.dim(1)?;
        let chunks: Vec<(usize, usize)> = row_chunks(seq, inputs.rows_per_chunk).collect();
        let query_chunks: Vec<(usize, usize)> =
            row_chunks(seq, inputs.query_rows_per_chunk).collect();
        // The six `[T * 3, hidden]` parameter tables side by side; each row picks its own.
        let table = self
            .adaln_table(inputs)?
            .to_dtype(x.dtype())?
            .contiguous()?;
        let fused = self.fused(&x);
        let params = if fused {
            Vec::new()
        } else {
            (0..6)
                .map(|i| table.narrow(1, i * self.hidden, self.hidden)?.contiguous())
                .collect::<Result<Vec<_>>>()?
        };
        let m = |i: usize, (start, len): (usize, usize)| {
            params[i].index_select(&inputs.adaln_indices.narrow(0, start, len)?, 0)
        };
        let rows = |(start, len): (usize, usize)| x.narrow(1, start, len)?.contiguous();
        // `norm(rows) * (1 + scale) + shift` with parameters `shift`, `shift + 1`.
        let modulated = |norm: &RmsNorm, shift: usize, c: (usize, usize)| -> Result<Tensor> {
            #[cfg(feature = "cuda")]
            if fused {
                return self.fused_modulated(&x, norm, &table, shift, c, inputs);
            }
            modulate(&norm.forward(&rows(c)?)?, &m(shift, c)?, &m(shift + 1, c)?)
        };
        // `x[rows] += out * gate` with parameter `gate`.
        let gated = |out: Tensor, gate: usize, c: (usize, usize)| -> Result<()> {
            #[cfg(feature = "cuda")]
            if fused {
                return self.fused_gated(&x, &out, &table, gate, c, inputs);
            }
            x.slice_set(&(rows(c)? + out.broadcast_mul(&m(gate, c)?)?)?, 1, c.0)
        };
        let heads = |proj: Tensor, norm: &RmsNorm, (start, len): (usize, usize)| {
            if fused {
                let rope = (&inputs.rope_cos, &inputs.rope_sin);
                self.attn
                    .heads_normed(proj, norm, Some(rope), Some((start, seq)))
            } else {
                let (cos, sin) = (
                    inputs.rope_cos.narrow(0, start, len)?,
                    inputs.rope_sin.narrow(0, start, len)?,
                );
                self.attn.heads_normed(proj, norm, Some((&cos, &sin)), None)
            }
        };
        let attn_input = |c| modulated(&self.norm1, 0, c);
        {
            // K and V hold the pre-update rows; a chunk's queries read its rows before they
            // are overwritten.
            let key_heads = |k, c| heads(k, &self.attn.norm_k, c);
            let (k, v) = self
                .attn
                .keys_values(&x, &chunks, attn_input, key_heads, fused)?;
            for &c in &query_chunks {
                let q = heads(
                    self.attn.to_q.forward(&attn_input(c)?)?,
                    &self.attn.norm_q,
                    c,
                )?;
                gated(self.attn.attend(&q, &k, &v)?, 2, c)?;
            }
        }
        for &c in &chunks {
            let h = modulated(&self.norm2, 3, c)?;
            gated(self.ff.forward(&h)?, 5, c)?;
        }
        Ok(x)
    }

    /// Whether the fused CUDA kernels take this block's stream `x` `[B, S, hidden]`: bf16 on
    /// CUDA, one batch entry (the kernels index rows of one sequence), widths they hold.
    fn fused(&self, x: &Tensor) -> bool {
        #[cfg(feature = "cuda")]
        {
            use crate::models::row_ops;
            x.dim(0).is_ok_and(|b| b == 1)
                && row_ops::rows_supported(x)
                && self.attn.head_dim <= row_ops::MAX_HEAD_DIM
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = x;
            false
        }
    }

    /// The fused `norm(x[rows c]) * (1 + scale) + shift`, the parameters at columns `shift` and
    /// `shift + 1` of each row's AdaLN table row: `[1, n, hidden]`.
    #[cfg(feature = "cuda")]
    fn fused_modulated(
        &self,
        x: &Tensor,
        norm: &RmsNorm,
        table: &Tensor,
        shift: usize,
        (start, len): (usize, usize),
        inputs: &BlockInputs,
    ) -> Result<Tensor> {
        use crate::models::row_ops::{self, Modulation, Rows};
        let dim = self.hidden;
        let modulation = Modulation {
            table,
            stride: 6 * dim,
            shift: shift * dim,
            scale: (shift + 1) * dim,
            text: None,
            rows: Some(&inputs.adaln_indices),
        };
        row_ops::rms_modulate(
            &x.narrow(1, start, len)?.reshape((len, dim))?,
            Some(&norm.weight),
            Some(modulation),
            Rows {
                row0: start,
                seq: x.dim(1)?,
            },
            norm.eps as f64,
        )?
        .reshape((1, len, dim))
    }

    /// The fused `x[rows c] += out * gate`, the gate at column `gate` of each row's AdaLN table
    /// row, written into `x`'s storage.
    #[cfg(feature = "cuda")]
    fn fused_gated(
        &self,
        x: &Tensor,
        out: &Tensor,
        table: &Tensor,
        gate: usize,
        (start, len): (usize, usize),
        inputs: &BlockInputs,
    ) -> Result<()> {
        use crate::models::row_ops::{self, BatchRow, Gate, Rows};
        let dim = self.hidden;
        let gate = BatchRow {
            table,
            stride: 6 * dim,
            offset: gate * dim,
            text: None,
            rows: Some(&inputs.adaln_indices),
        };
        row_ops::residual_over(
            &x.narrow(1, start, len)?.reshape((len, dim))?,
            &out.contiguous()?.reshape((len, dim))?,
            None,
            Some(Gate::Bf16(gate)),
            Rows {
                row0: start,
                seq: x.dim(1)?,
            },
        )
    }
}

/// Rotary tables `[S, 3F]` (cos, sin) of `position_ids` `[S, 3]`: for each row the t, h and w
/// angles `pos * inv_freq` concatenated, with `inv_freq_j = 1 / theta^(2j / 2F)` in f32 as torch
/// computes it. (diffusers duplicates the table to `6F` for rotate-half; candle's `rope` takes
/// the half.)
pub fn rope_tables(
    position_ids: &Tensor,
    rope_freq_dim: usize,
    rope_theta: f64,
) -> Result<(Tensor, Tensor)> {
    let (rows, axes) = position_ids.dims2()?;
    if axes != 3 {
        candle_core::bail!(
            "position_ids must be [seq, 3], got {:?}",
            position_ids.dims()
        );
    }
    let theta = rope_theta as f32;
    let inv_freq: Vec<f32> = (0..rope_freq_dim)
        .map(|j| {
            let exponent = (2 * j) as f32 / (2 * rope_freq_dim) as f32;
            1.0 / ((theta as f64).powf(exponent as f64) as f32)
        })
        .collect();
    let pos = position_ids
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let width = 3 * rope_freq_dim;
    let angles: Vec<f32> = pos
        .iter()
        .flat_map(|&p| inv_freq.iter().map(move |&f| p * f))
        .collect();
    cos_sin(&angles, rows, width, position_ids.device())
}

/// The diffusers `MiniMaxH3Transformer3DModel`.
#[derive(Debug, Clone)]
pub struct MiniMaxH3Transformer3DModel {
    cfg: MiniMaxH3TransformerConfig,
    proj_in: Linear,
    audio_proj_in: Linear,
    context_embedder: Linear,
    /// The time embedder and the output norm's Linear, absent with
    /// [`MiniMaxH3TransformerConfig::modulations_apart`] ([`MiniMaxH3Modulations`] holds them).
    time_embedder: Option<TimeEmbedder>,
    refiner_blocks: Vec<RefinerBlock>,
    refiner_norm: RmsNorm,
    blocks: Vec<MiniMaxH3TransformerBlock>,
    norm_out: RmsNorm,
    norm_out_linear: Option<Linear>,
    proj_out: Linear,
    audio_proj_out: Linear,
    dtype: DType,
}

impl MiniMaxH3Transformer3DModel {
    /// Loads the whole model, blocks included.
    pub fn new(cfg: &MiniMaxH3TransformerConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads everything except the main blocks (for an engine that streams them from
    /// `transformer_blocks.{i}`); `blocks()` is then empty and `forward` refuses to run.
    /// The patch projections, time embedder and output heads are kept in f32, as the published
    /// mixed-precision checkpoint stores them.
    pub fn new_without_blocks(cfg: &MiniMaxH3TransformerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.hidden_size;
        let f32_vb = vb.clone().set_dtype(DType::F32);
        let refiner_vb = vb.pp("token_refiner");
        let conditioned = !cfg.modulations_apart;
        let refiner_blocks = (0..cfg.num_refiner_layers)
            .map(|i| RefinerBlock::new(cfg, refiner_vb.pp(format!("refiner_blocks.{i}"))))
            .collect::<Result<_>>()?;
        Ok(Self {
            proj_in: candle_nn::linear(cfg.video_patch_dim(), dim, f32_vb.pp("proj_in"))?,
            audio_proj_in: candle_nn::linear(
                cfg.audio_in_channels,
                dim,
                f32_vb.pp("audio_proj_in"),
            )?,
            context_embedder: candle_nn::linear(cfg.text_dim, dim, vb.pp("context_embedder"))?,
            time_embedder: conditioned
                .then(|| TimeEmbedder::new(cfg, &vb))
                .transpose()?,
            refiner_blocks,
            refiner_norm: RmsNorm::new(dim, cfg.final_norm_eps, refiner_vb.pp("final_norm"))?,
            blocks: Vec::new(),
            norm_out: RmsNorm::new(dim, cfg.final_norm_eps, vb.pp("norm_out.norm"))?,
            norm_out_linear: conditioned.then(|| norm_out_linear(cfg, &vb)).transpose()?,
            proj_out: candle_nn::linear(dim, cfg.video_patch_dim(), f32_vb.pp("proj_out"))?,
            audio_proj_out: candle_nn::linear(
                dim,
                cfg.audio_in_channels,
                f32_vb.pp("audio_proj_out"),
            )?,
            dtype: vb.dtype(),
            cfg: cfg.clone(),
        })
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &MiniMaxH3TransformerConfig {
        &self.cfg
    }

    /// The loaded main blocks, in execution order (empty after `new_without_blocks`).
    pub fn blocks(&self) -> &[MiniMaxH3TransformerBlock] {
        &self.blocks
    }

    /// `context_embedder` then the token refiner (with its final norm): `[B, L, text_dim]` ->
    /// the text rows `[B, L, hidden]`.
    pub fn refine_text(&self, encoder_hidden_states: &Tensor) -> Result<Tensor> {
        let mut x = self
            .context_embedder
            .forward(&encoder_hidden_states.to_dtype(self.dtype)?)?;
        for block in &self.refiner_blocks {
            x = block.forward(&x)?;
        }
        self.refiner_norm.forward(&x)
    }

    /// `time_embedder(sinusoid(t))` in f32 for the distinct timesteps `[T]` (unscaled, in [0, 1]).
    /// Refused by a model built with the modulations apart (the modulation component embeds).
    pub fn time_embedding(&self, timestep: &Tensor) -> Result<Tensor> {
        match &self.time_embedder {
            Some(embedder) => embedder.forward(timestep),
            None => candle_core::bail!(
                "this transformer computes its modulations apart: its modulation component embeds the timesteps"
            ),
        }
    }

    /// Projects each modality, refines the text and packs the rows of `layout` into one sequence.
    /// `video` `[B, Nv, C·pt·ph·pw]` (patchified rows), `audio` `[B, 2Na, Ca]`, `text`
    /// `[B, L, text_dim]`, `timestep` `[T]` the distinct timesteps, `timestep_indices` `[S]`
    /// each row's index into them, `rope` the layout's [`MiniMaxH3TransformerConfig::rope`].
    #[allow(clippy::too_many_arguments)]
    pub fn prepare(
        &self,
        video: &Tensor,
        audio: &Tensor,
        text: &Tensor,
        timestep: &Tensor,
        timestep_indices: &Tensor,
        layout: &PackedLayout,
        (rope_cos, rope_sin): &(Tensor, Tensor),
    ) -> Result<BlockInputs> {
        let cfg = &self.cfg;
        let (seq, _) = layout.position_ids.dims2()?;
        let (b, nv, vdim) = video.dims3()?;
        let (ab, na, adim) = audio.dims3()?;
        let (tb, nt, tdim) = text.dims3()?;
        if vdim != cfg.video_patch_dim() || adim != cfg.audio_in_channels || tdim != cfg.text_dim {
            candle_core::bail!(
                "row widths video {vdim}, audio {adim}, text {tdim} do not match the config's {}, {}, {}",
                cfg.video_patch_dim(),
                cfg.audio_in_channels,
                cfg.text_dim
            );
        }
        if ab != b || tb != b {
            candle_core::bail!("video, audio and text batches differ: {b}, {ab}, {tb}");
        }
        let num_timesteps = timestep.elem_count();
        let t_idx = host_indices("timestep_indices", timestep_indices, num_timesteps)?;
        let tags = host_indices("token_tags", &layout.token_tags, MODALITY_COUNT)?;
        let video_idx = host_indices("video_indices", &layout.video_indices, seq)?;
        let audio_idx = host_indices("audio_indices", &layout.audio_indices, seq)?;
        let text_idx = host_indices("text_indices", &layout.text_indices, seq)?;
        if t_idx.len() != seq || tags.len() != seq {
            candle_core::bail!(
                "timestep_indices ({}) and token_tags ({}) must have one entry per row ({seq})",
                t_idx.len(),
                tags.len()
            );
        }
        if video_idx.len() != nv || audio_idx.len() != na || text_idx.len() != nt {
            candle_core::bail!(
                "index counts video {}, audio {}, text {} do not match the rows given ({nv}, {na}, {nt})",
                video_idx.len(),
                audio_idx.len(),
                text_idx.len()
            );
        }
        // Packing = one gather from [text | video | audio]: source row of every sequence row.
        let mut source = vec![u32::MAX; seq];
        let sources = text_idx.iter().chain(&video_idx).chain(&audio_idx);
        for (i, &pos) in sources.enumerate() {
            if source[pos as usize] != u32::MAX {
                candle_core::bail!("sequence row {pos} is claimed by two inputs");
            }
            source[pos as usize] = i as u32;
        }
        if source.contains(&u32::MAX) {
            candle_core::bail!("the layout leaves sequence rows without an input");
        }
        let device = video.device();
        let u32_tensor = |v: Vec<u32>| Tensor::from_vec(v.clone(), v.len(), device);

        // Contiguous inputs: candle 0.11's CPU batched matmul (under `Linear` with a batch > 1)
        // returns wrong values for some strided views (huggingface/candle#3758).
        let text_rows = self.refine_text(&text.contiguous()?)?;
        let dtype = text_rows.dtype();
        let rows_per_chunk = cfg.rows_per_chunk();
        // The f32 video projection chunk by chunk: whole, it would be twice the packed
        // sequence's bytes in bf16.
        let video = video.to_dtype(DType::F32)?;
        let video_rows = row_chunks(nv, rows_per_chunk)
            .map(|(start, len)| {
                let rows = video.narrow(1, start, len)?.contiguous()?;
                self.proj_in.forward(&rows)?.to_dtype(dtype)
            })
            .collect::<Result<Vec<_>>>()?;
        let video_rows = Tensor::cat(&video_rows, 1)?;
        let audio_rows = self
            .audio_proj_in
            .forward(&audio.to_dtype(DType::F32)?.contiguous()?)?
            .to_dtype(dtype)?;
        let unpacked = Tensor::cat(&[text_rows, video_rows, audio_rows], 1)?;
        let hidden_states = unpacked.index_select(&u32_tensor(source)?, 1)?;
        drop(unpacked);

        let temb = self
            .time_embedder
            .as_ref()
            .map(|embedder| embedder.forward(timestep))
            .transpose()?;
        let adaln: Vec<u32> = t_idx
            .iter()
            .zip(&tags)
            .map(|(&t, &tag)| t * MODALITY_COUNT as u32 + tag)
            .collect();
        Ok(BlockInputs {
            hidden_states: Some(hidden_states),
            temb,
            adaln_indices: u32_tensor(adaln)?,
            timestep_indices: u32_tensor(t_idx)?,
            rope_cos: rope_cos.clone(),
            rope_sin: rope_sin.clone(),
            rows_per_chunk,
            query_rows_per_chunk: rows_per_chunk,
            video_indices: u32_tensor(video_idx)?,
            audio_indices: u32_tensor(audio_idx)?,
            adaln_tables: None,
        })
    }

    /// The output norm modulated per timestep for the sequence rows `rows` `[n]` of `x`
    /// `[B, S, hidden]`: `[B, n, hidden]`.
    pub fn norm_out(&self, x: &Tensor, rows: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        let table = match &self.norm_out_linear {
            Some(linear) => output_table(linear, inputs.temb()?)?,
            None => inputs
                .adaln_tables
                .as_ref()
                .and_then(|tables| tables.get(self.cfg.num_layers))
                .cloned()
                .ok_or_else(|| {
                    candle_core::Error::Msg(
                        "the output norm's table was computed apart: pass it after the blocks'"
                            .into(),
                    )
                })?,
        };
        let table = table
            .index_select(&inputs.timestep_indices.index_select(rows, 0)?, 0)?
            .to_dtype(x.dtype())?;
        let dim = self.cfg.hidden_size;
        let (shift, scale) = (table.narrow(1, 0, dim)?, table.narrow(1, dim, dim)?);
        modulate(
            &self.norm_out.forward(&x.index_select(rows, 1)?)?,
            &shift,
            &scale,
        )
    }

    /// Output norm and both velocity heads (f32): video `[B, Nv, C·pt·ph·pw]` and audio
    /// `[B, 2Na, Ca]`, in the order of the layout's indices; `inputs.rows_per_chunk` rows at
    /// a time, so no f32 copy of the whole sequence exists.
    pub fn finish(&self, x: &Tensor, inputs: &BlockInputs) -> Result<(Tensor, Tensor)> {
        let head = |indices: &Tensor, proj: &Linear| -> Result<Tensor> {
            let chunks = row_chunks(indices.dim(0)?, inputs.rows_per_chunk)
                .map(|(start, len)| {
                    let h = self.norm_out(x, &indices.narrow(0, start, len)?, inputs)?;
                    proj.forward(&h.to_dtype(DType::F32)?)
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&chunks, 1)
        };
        Ok((
            head(&inputs.video_indices, &self.proj_out)?,
            head(&inputs.audio_indices, &self.audio_proj_out)?,
        ))
    }

    /// Full forward: `prepare`, every block, `finish`. Needs a model built with `new`.
    pub fn forward(
        &self,
        video: &Tensor,
        audio: &Tensor,
        text: &Tensor,
        timestep: &Tensor,
        timestep_indices: &Tensor,
        layout: &PackedLayout,
    ) -> Result<(Tensor, Tensor)> {
        let rope = self.cfg.rope(layout)?;
        let inputs = self.prepare(
            video,
            audio,
            text,
            timestep,
            timestep_indices,
            layout,
            &rope,
        )?;
        crate::models::blocks::BlockForward::forward_resident(self, inputs)
    }
}

/// Placed by the block protocol: `transformer_blocks.{i}`, each streamed whole (a block knows
/// its index: which AdaLN table computed apart is its).
impl RepeatedBlocks for MiniMaxH3Transformer3DModel {
    type Config = MiniMaxH3TransformerConfig;
    type Block = MiniMaxH3TransformerBlock;
    type Step = ();
    const BLOCKS: &'static str = "transformer_blocks";
    const STEPS: &'static [()] = &[];
    fn new(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        MiniMaxH3Transformer3DModel::new(cfg, vb)
    }
    fn new_without_blocks(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        MiniMaxH3Transformer3DModel::new_without_blocks(cfg, vb)
    }
    fn num_layers(cfg: &Self::Config) -> usize {
        cfg.num_layers
    }
    fn new_block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> Result<Self::Block> {
        MiniMaxH3TransformerBlock::in_block(cfg, i, vb)
    }
}

/// The blocks' AdaLN projections, streamed (or placed) as a DiT of their own: one pass before
/// denoising computes every step's tables.
impl Blockwise for MiniMaxH3Modulations {
    type Config = MiniMaxH3TransformerConfig;
    type Block = AdalnProjection;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        Self::new(cfg, vb)
    }
    fn outer(cfg: &Self::Config, vb: VarBuilder, _: VarBuilder) -> Result<Self> {
        Self::new_without_blocks(cfg, vb)
    }
    fn num_blocks(cfg: &Self::Config) -> usize {
        cfg.num_layers
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> Result<Self::Block> {
        AdalnProjection::new(cfg, i, vb)
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    //! The fused paths against the candle compositions they replace, on random bf16 inputs of
    //! the published width (5376 wide, 56 heads of 128, 96 rotary channels), on the GPU: rows
    //! of a chunk that starts inside the sequence, each with its own AdaLN table row.
    use super::*;
    use crate::models::row_ops::test_util::{
        assert_within_ulp, assert_within_ulp_carrying, device, randn,
    };
    use crate::models::row_ops::{self, BatchRow, Gate, Modulation, Rows};
    use candle_core::Device;

    const SEQ: usize = 3000;
    const CHUNK: (usize, usize) = (1100, 1300);
    const TABLE_ROWS: usize = 6;

    fn row_indices(dev: &Device) -> Result<Tensor> {
        let rows: Vec<u32> = (0..SEQ).map(|r| ((r * 7) % TABLE_ROWS) as u32).collect();
        Tensor::new(rows, dev)
    }

    #[test]
    fn row_indexed_modulation_matches_gathered_rows() -> Result<()> {
        let Some(dev) = device("MiniMax H3 fused kernels") else {
            return Ok(());
        };
        let cfg = MiniMaxH3TransformerConfig::default();
        let dim = cfg.hidden_size;
        let (start, len) = CHUNK;
        let x = (randn(&[SEQ, dim], 1.0, &dev)? * 3.0)?;
        let w = randn(&[dim], 1.0, &dev)?;
        let table = randn(&[TABLE_ROWS, 6 * dim], 0.5, &dev)?;
        let indices = row_indices(&dev)?;
        let picked = |i: usize| {
            table
                .narrow(1, i * dim, dim)?
                .contiguous()?
                .index_select(&indices.narrow(0, start, len)?, 0)
        };
        let (shift, scale) = (picked(3)?, picked(4)?);
        let normed = candle_nn::ops::rms_norm(&x.narrow(0, start, len)?, &w, 1e-5)?;
        let want = modulate(&normed, &shift, &scale)?;
        let got = row_ops::rms_modulate(
            &x.narrow(0, start, len)?,
            Some(&w),
            Some(Modulation {
                table: &table,
                stride: 6 * dim,
                shift: 3 * dim,
                scale: 4 * dim,
                text: None,
                rows: Some(&indices),
            }),
            Rows {
                row0: start,
                seq: SEQ,
            },
            1e-5,
        )?;
        let term = (want.to_dtype(DType::F32)? - shift.to_dtype(DType::F32)?)?;
        let gain = (scale.to_dtype(DType::F32)? + 1.0)?;
        assert_within_ulp_carrying(&got, &want, &term, (&normed, &gain), "row-indexed norm")
    }

    #[test]
    fn row_indexed_gate_updates_only_its_rows() -> Result<()> {
        let Some(dev) = device("MiniMax H3 fused kernels") else {
            return Ok(());
        };
        let dim = MiniMaxH3TransformerConfig::default().hidden_size;
        let (start, len) = CHUNK;
        let x = randn(&[SEQ, dim], 1.0, &dev)?;
        let before = x.copy()?;
        let out = randn(&[len, dim], 1.0, &dev)?;
        let table = randn(&[TABLE_ROWS, 6 * dim], 0.5, &dev)?;
        let indices = row_indices(&dev)?;
        let gate = table
            .narrow(1, 5 * dim, dim)?
            .contiguous()?
            .index_select(&indices.narrow(0, start, len)?, 0)?;
        let product = out.broadcast_mul(&gate)?;
        let rows = before.narrow(0, start, len)?;
        let want = (&rows + &product)?;
        row_ops::residual_over(
            &x.narrow(0, start, len)?,
            &out,
            None,
            Some(Gate::Bf16(BatchRow {
                table: &table,
                stride: 6 * dim,
                offset: 5 * dim,
                text: None,
                rows: Some(&indices),
            })),
            Rows {
                row0: start,
                seq: SEQ,
            },
        )?;
        let term = rows.abs()?.maximum(&product.abs()?)?;
        assert_within_ulp(&x.narrow(0, start, len)?, &want, &term, "row-indexed gate")?;
        for (a, n) in [(0, start), (start + len, SEQ - start - len)] {
            let diff = (x.narrow(0, a, n)? - before.narrow(0, a, n)?)?
                .abs()?
                .to_dtype(DType::F32)?
                .max_all()?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "rows {a}..{} changed", a + n);
        }
        Ok(())
    }

    #[test]
    fn head_norm_rotate_half_matches_composite() -> Result<()> {
        let Some(dev) = device("MiniMax H3 fused kernels") else {
            return Ok(());
        };
        let cfg = MiniMaxH3TransformerConfig::default();
        let (heads, d, rotary) = (
            cfg.num_attention_heads,
            cfg.attention_head_dim,
            cfg.rotary_dim(),
        );
        let (start, len) = CHUNK;
        let angles = Tensor::rand(0f32, 6.3, (SEQ, rotary / 2), &dev)?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let p = randn(&[len, heads * d], 1.0, &dev)?;
        let w = randn(&[d], 1.0, &dev)?;
        // candle's fused RMSNorm, then candle's rotate-half RoPE in f32 on the rotary channels,
        // rounded once.
        let normed = candle_nn::ops::rms_norm(&p.reshape((1, len, heads, d))?, &w, 1e-5)?
            .transpose(1, 2)?
            .contiguous()?;
        let (c, s) = (cos.narrow(0, start, len)?, sin.narrow(0, start, len)?);
        let rotated = candle_nn::rotary_emb::rope(
            &normed
                .narrow(3, 0, rotary)?
                .to_dtype(DType::F32)?
                .contiguous()?,
            &c,
            &s,
        )?
        .to_dtype(DType::BF16)?;
        let want = Tensor::cat(&[rotated, normed.narrow(3, rotary, d - rotary)?], 3)?;
        // Channel e < rotary / 2 mixes with e + rotary / 2: bound by the larger of the two.
        let half = rotary / 2;
        let lo = normed.narrow(3, 0, half)?.abs()?;
        let hi = normed.narrow(3, half, half)?.abs()?;
        let pair = lo.maximum(&hi)?;
        let term = Tensor::cat(
            &[
                pair.clone(),
                pair,
                normed.narrow(3, rotary, d - rotary)?.abs()?,
            ],
            3,
        )?;
        let got = row_ops::head_rms_rope_half(
            p,
            &w,
            (&cos, &sin),
            d,
            rotary,
            Rows {
                row0: start,
                seq: SEQ,
            },
            1e-5,
        )?
        .reshape((1, len, heads, d))?
        .transpose(1, 2)?;
        assert_within_ulp(&got, &want, &term, "q/k RMSNorm + rotate-half RoPE")
    }

    #[test]
    fn swiglu_matches_f32_silu_rounded_once() -> Result<()> {
        let Some(dev) = device("MiniMax H3 fused kernels") else {
            return Ok(());
        };
        let inner = MiniMaxH3TransformerConfig::default().ffn_dim;
        let h = (randn(&[700, 2 * inner], 1.0, &dev)? * 3.0)?;
        let value = h.narrow(1, 0, inner)?.to_dtype(DType::F32)?;
        let silu = candle_nn::ops::silu(&h.narrow(1, inner, inner)?.to_dtype(DType::F32)?)?
            .to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?;
        let want = (value * silu)?.to_dtype(DType::BF16)?;
        let got = row_ops::swiglu(&h)?;
        assert_within_ulp(&got, &want, &want, "SwiGLU")
    }

    /// One published-width block on the fused path against the same block's candle
    /// composition (a batch of two copies takes it), bf16 on the GPU.
    #[test]
    fn fused_block_matches_composition() -> Result<()> {
        let Some(dev) = device("MiniMax H3 fused block") else {
            return Ok(());
        };
        let cfg = MiniMaxH3TransformerConfig::default();
        let weights = crate::weights::Weights::Synthetic { seed: 3 };
        let vb = crate::weights::WeightSet::open(&weights)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?
            .var_builder(DType::BF16, &dev);
        let block = MiniMaxH3TransformerBlock::new(&cfg, 0, vb)?;
        let angles = Tensor::rand(0f32, 6.3, (SEQ, cfg.rotary_dim() / 2), &dev)?;
        let inputs = BlockInputs {
            hidden_states: None,
            temb: Some(Tensor::randn(0f32, 1., (2, cfg.time_embed_dim), &dev)?),
            adaln_indices: row_indices(&dev)?,
            timestep_indices: Tensor::zeros(SEQ, DType::U32, &dev)?,
            rope_cos: angles.cos()?,
            rope_sin: angles.sin()?,
            rows_per_chunk: 1024,
            query_rows_per_chunk: 2048,
            video_indices: Tensor::zeros(1, DType::U32, &dev)?,
            audio_indices: Tensor::zeros(1, DType::U32, &dev)?,
            adaln_tables: None,
        };
        let x = randn(&[1, SEQ, cfg.hidden_size], 1.0, &dev)?;
        let composed = block
            .forward(&Tensor::cat(&[&x, &x], 0)?, &inputs)?
            .narrow(0, 0, 1)?;
        let fused = block.forward(&x.copy()?, &inputs)?;
        let (a, b) = (fused.to_dtype(DType::F32)?, composed.to_dtype(DType::F32)?);
        let rel = ((&a - &b)?.sqr()?.sum_all()?.to_scalar::<f32>()?
            / b.sqr()?.sum_all()?.to_scalar::<f32>()?)
        .sqrt();
        eprintln!("fused vs composed block: relative L2 {rel:.3e}");
        assert!(rel < 1e-2, "relative L2 {rel}");
        Ok(())
    }
}

crate::block_forward!(
    MiniMaxH3Transformer3DModel, BlockInputs, take_hidden_states, Tensor,
    |m, x, inputs| m.finish(&x, inputs) => (Tensor, Tensor)
);
