//! Activation estimates of the Mochi-1 models: the device bytes their forward passes keep alive
//! at their peak (the weights are counted apart, from the constructors).

use super::transformer::MochiTransformerConfig;
use super::vae::MochiVaeConfig;
use crate::models::attention::runs_fused;
use crate::models::fp8::weight_codes;
use crate::models::step_cache::{AttentionModules, HookedBlocks};
use crate::models::vae_tiling::SpatialTiling;
use crate::models::video::{DecodeActivations, DenoiseActivations};
use candle_core::DType;

impl DenoiseActivations for MochiTransformerConfig {
    fn hooked_blocks(&self) -> HookedBlocks {
        HookedBlocks::one_list(self.num_layers, super::transformer::CACHE_NAMES)
    }

    fn denoise_activations(
        &self,
        grid: [usize; 3],
        text_len: usize,
        batch: usize,
        dtype: DType,
    ) -> u64 {
        transformer_activations(self, self.video_tokens(grid), text_len, batch, dtype)
    }

    fn forward_held(&self, grid: [usize; 3], text_len: usize, batch: usize, dtype: DType) -> u64 {
        let (n, l, b) = (self.video_tokens(grid), text_len, batch);
        forward_held(self, n as u64, l as u64, b as u64, dtype)
    }

    fn in_fp8(&self, on: bool) -> Self {
        Self {
            fp8_matmul: on,
            ..self.clone()
        }
    }

    fn fp8_activations(&self, grid: [usize; 3], text_len: usize, batch: usize) -> u64 {
        fp8_matmul_activations(self, self.video_tokens(grid), text_len, batch)
    }

    fn fp8_block_codes(&self) -> Vec<u64> {
        fp8_block_codes(self)
    }

    fn block_state(&self, grid: [usize; 3], text_len: usize) -> (usize, usize) {
        (self.video_tokens(grid) + text_len, self.inner_dim())
    }

    /// `attn1` of every block: the joint attention, whose video and text outputs PAB keeps
    /// (no wider than a block state).
    fn attention_modules(&self) -> AttentionModules {
        AttentionModules {
            spatial: self.num_layers,
            ..Default::default()
        }
    }
}

impl DecodeActivations for MochiVaeConfig {
    fn decode_activations(&self, grid: [usize; 3], tiled: bool, dtype: DType) -> u64 {
        vae_decode_activations(self, grid, tiled, dtype)
    }
}

/// Device bytes of one transformer forward over a batch of `batch` (2 with guidance) on
/// `tokens` video tokens and `text_len` text tokens.
pub fn transformer_activations(
    c: &MochiTransformerConfig,
    tokens: usize,
    text_len: usize,
    batch: usize,
    dtype: DType,
) -> u64 {
    let bytes = dtype.size_in_bytes() as u64;
    let (n, l, b) = (tokens as u64, text_len as u64, batch as u64);
    let dim = c.inner_dim() as u64;
    let heads = c.num_attention_heads as u64;
    let ff = MochiTransformerConfig::ff_inner_dim(c.inner_dim()) as u64;
    let seq = n + l;
    let (video, scores) = match runs_fused(dtype) {
        // The fused kernels (their attention keeps no scores) peak in the feed-forward: the
        // block's input, which the loop holds, the stream after the attention, its modulated
        // norm and the SwiGLU's output, beside its 2x inner width and gated product (an H100
        // measured 1.94 GiB above the weights at 85x480x848 without guidance, planned 1.92;
        // bench/RESULTS.md session 50).
        true => (b * n * (4 * dim + 3 * ff) * bytes, 0),
        // The candle composition: the video stream, its q/k/v and attention output, f32 norm
        // temporaries (two hidden-sized f32 copies), the SwiGLU's 2x and 1x inner widths; the
        // chunked attention's f32 scores (one sample at a time, up to 1024 queries).
        false => (
            b * n * (dim * (6 * bytes + 2 * 4) + 3 * ff * bytes),
            heads * seq.min(1024) * seq * 4 * 2,
        ),
    };
    video + scores + forward_held(c, n, l, b, dtype)
}

/// What a forward on `n` video tokens and `l` text tokens of `b` prompts holds beside its video
/// stream: the text stream's copies and the per-head RoPE tables in f32.
fn forward_held(c: &MochiTransformerConfig, n: u64, l: u64, b: u64, dtype: DType) -> u64 {
    let (dim, text_dim) = (c.inner_dim() as u64, c.pooled_projection_dim as u64);
    let text = b * l * (text_dim * 6 + 3 * dim) * dtype.size_in_bytes() as u64;
    let rope = 2 * n * dim / 2 * 4;
    text + rope
}

/// Device bytes `--fp8-matmul` adds to a forward over a batch of `batch` on `tokens` video
/// tokens and `text_len` text tokens besides the blocks' weight codes ([`fp8_block_codes`]): the
/// codes of its largest Linear input, every sample's rows at once (a SwiGLU's gated hidden state,
/// wider than its stream, or the text attention's output into `to_add_out`, as wide as the
/// video), and a product's workspace.
pub fn fp8_matmul_activations(
    c: &MochiTransformerConfig,
    tokens: usize,
    text_len: usize,
    batch: usize,
) -> u64 {
    let (video, text) = ((batch * tokens) as u64, (batch * text_len) as u64);
    let (d, t) = (c.inner_dim(), c.pooled_projection_dim);
    let ff = MochiTransformerConfig::ff_inner_dim;
    let largest = [(video, ff(d)), (text, d), (text, ff(t))]
        .into_iter()
        .map(|(rows, cols)| (rows, cols as u64))
        .max_by_key(|(rows, cols)| rows * cols)
        .unwrap_or_default();
    crate::models::fp8::forward_bytes(largest)
}

/// Device bytes of each block's weight codes under `--fp8-matmul`, in execution order: every
/// block's video q, k, v and `to_out`, text `add_k_proj` and `add_v_proj` and video SwiGLU; and,
/// but for a `context_pre_only` block, `add_q_proj`, `to_add_out` and the text SwiGLU. The
/// modulations stay exact.
pub fn fp8_block_codes(c: &MochiTransformerConfig) -> Vec<u64> {
    let (d, t) = (c.inner_dim(), c.pooled_projection_dim);
    let ff = MochiTransformerConfig::ff_inner_dim;
    let mut reads_text = vec![(d, d); 4];
    reads_text.extend([(t, d), (t, d), (d, 2 * ff(d)), (ff(d), d)]);
    let mut updates_text = reads_text.clone();
    updates_text.extend([(t, d), (d, t), (t, 2 * ff(t)), (ff(t), t)]);
    (0..c.num_layers)
        .map(|i| {
            if c.context_pre_only(i) {
                weight_codes(&reads_text)
            } else {
                weight_codes(&updates_text)
            }
        })
        .collect()
}

/// Device bytes of the decode: at full resolution, activations at the first stage's channels.
/// Composed (f32): four (the last up block's output and its depth-to-space copy, then a
/// resnet's input, norm, conv output and sum) with one GroupNorm run's f32 temporaries
/// ([`super::vae::NORM_CHUNK_FRAMES`] frames). In bf16 three: the norm is fused, the up block
/// stores its depth-to-space in place, and a resnet holds its input, a norm and one
/// convolution's output (the second convolution adds the residual as it stores). Measured on
/// an H200 at 85x480x848: 26.59 GiB used above the weights, planned 27.0 (bench/RESULTS.md
/// session 35). Plus the frames in f32 twice (the decoded video and its conversion). With
/// `tiled` (diffusers' `enable_tiling()` tiles) the activations are each tile's, beside the
/// decoded tiles held until they are blended ([`crate::models::vae_tiling::TileWalk`]).
pub fn vae_decode_activations(
    vae: &MochiVaeConfig,
    grid: [usize; 3],
    tiled: bool,
    dtype: DType,
) -> u64 {
    let bytes = dtype.size_in_bytes() as u64;
    let s = vae.spatial_compression_ratio();
    let t = vae.temporal_compression_ratio() as u64;
    let frames = grid[0] as u64 * t;
    let full_pixels = (grid[1] * s * grid[2] * s) as u64;
    let walk = tiled
        .then(|| super::vae::DEFAULT_TILING.walk((grid[1], grid[2]), s))
        .flatten();
    let (tile_h, tile_w) = walk
        .as_ref()
        .map_or((grid[1] * s, grid[2] * s), |walk| walk.tile);
    let tile_pixels = (tile_h * tile_w) as u64;
    let channels = vae
        .decoder_block_out_channels
        .first()
        .copied()
        .unwrap_or(128) as u64;
    let out = vae.out_channels as u64;
    let activation = frames * tile_pixels * channels * bytes;
    let working = if dtype == DType::BF16 {
        3 * activation
    } else {
        let norm_run =
            frames.min(super::vae::NORM_CHUNK_FRAMES as u64) * tile_pixels * channels * 4;
        4 * activation + 3 * norm_run
    };
    let decoded = match &walk {
        Some(walk) => walk.peak(working, frames * out * bytes),
        None => working,
    };
    decoded + frames * full_pixels * out * 4 * 2
}
