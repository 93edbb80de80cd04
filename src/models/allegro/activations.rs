//! Activation estimates of the Allegro models: the device bytes their forward passes keep alive
//! at their peak (the weights are counted apart, from the constructors). The text encoder is
//! the T5 v1.1 one CogVideoX estimates ([`crate::models::cogvideox::activations`]).

use super::transformer::AllegroTransformerConfig;
use super::vae::AllegroVaeConfig;
use crate::models::attention::{runs_fused, MAX_SCORE_ELEMENTS};
use crate::models::fp8::forward_bytes;
use crate::models::step_cache::{AttentionModules, HookedBlocks};
use crate::models::video::{DecodeActivations, DenoiseActivations};
use candle_core::DType;

impl DenoiseActivations for AllegroTransformerConfig {
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

    /// The largest Linear input: the batch's feed-forward hidden states.
    fn fp8_activations(&self, grid: [usize; 3], _text_len: usize, batch: usize) -> u64 {
        let rows = (batch * self.video_tokens(grid)) as u64;
        forward_bytes((rows, 4 * self.inner_dim() as u64))
    }

    fn fp8_block_codes(&self) -> Vec<u64> {
        vec![self.block_shape().fp8_codes(); self.num_layers]
    }

    /// The blocks thread the video tokens alone (the caption is an input of each).
    fn block_state(&self, grid: [usize; 3], _text_len: usize) -> (usize, usize) {
        (self.video_tokens(grid), self.inner_dim())
    }

    /// `attn1` and `attn2` of every block.
    fn attention_modules(&self) -> AttentionModules {
        AttentionModules {
            spatial: self.num_layers,
            temporal: 0,
            cross: self.num_layers,
        }
    }
}

/// The VAE decodes in tiles only: `--vae-tiling` changes nothing.
impl DecodeActivations for AllegroVaeConfig {
    fn decode_activations(&self, grid: [usize; 3], _tiled: bool, dtype: DType) -> u64 {
        vae_decode_activations(self, grid, dtype)
    }
}

/// Device bytes of one transformer forward over a batch of `batch` (2 with guidance) on
/// `tokens` video tokens and `text_len` text tokens.
pub fn transformer_activations(
    c: &AllegroTransformerConfig,
    tokens: usize,
    text_len: usize,
    batch: usize,
    dtype: DType,
) -> u64 {
    let bytes = dtype.size_in_bytes() as u64;
    let (n, l, b) = (tokens as u64, text_len as u64, batch as u64);
    let dim = c.inner_dim() as u64;
    let heads = c.num_attention_heads as u64;
    // Hidden states, the modulated norm, q/k/v, the attention output and its projection (one
    // copy fewer with the fused kernels, whose peak is in the feed-forward: the block's input,
    // the stream after the attention, its norm, the output and its gated sum); q and k rotated
    // in f32 (two copies each) where the rotary embedding is composed (bf16 rotates them in
    // place, in one kernel on CUDA); the feed-forward's 4x hidden, with its GELU a copy more
    // where it is not fused into the product (bf16); the rotary tables in f32; the caption and
    // its projection. (bf16 at 88x720x1280, above the held DiT: an H200 measured 6.90 GiB in
    // denoise with guidance, session 33, and an H100 3.15 in one forward without, session 50;
    // planned 6.88 and 3.47.)
    let hidden = b * n * dim * bytes;
    let streams = if runs_fused(dtype) { 6 } else { 7 };
    let feed_forward = if dtype == DType::BF16 {
        hidden * 4
    } else {
        hidden * 4 * 2
    };
    let rotated = if dtype == DType::BF16 {
        0
    } else {
        b * n * dim * 4 * 4
    };
    // The chunked attention's f32 scores (every token attends to every token), bounded by the
    // chunking; the fused CUDA attention (bf16, f16) keeps none.
    let scores = if matches!(dtype, DType::BF16 | DType::F16) {
        0
    } else {
        (b * heads * n * n).min(MAX_SCORE_ELEMENTS as u64) * 4 * 2
    };
    hidden * streams + feed_forward + rotated + scores + forward_held(c, n, l, b, dtype)
}

/// What a forward on `n` video tokens of `b` prompts of `l` tokens holds beside its stream: the
/// rotary tables in f32, the caption and its projection.
fn forward_held(c: &AllegroTransformerConfig, n: u64, l: u64, b: u64, dtype: DType) -> u64 {
    let tables = 2 * n * c.attention_head_dim as u64 * 4;
    let text = b * l * (c.caption_channels as u64 + 4 * c.inner_dim() as u64);
    tables + text * dtype.size_in_bytes() as u64
}

/// Device bytes of the tiled decode of latents `[F, h, w]`: one tile through the decoder at
/// full resolution (the last levels' activations at the first level's channels: a resnet's
/// input, norm, conv output and sum, a temporal layer's padded copies), its mid-block attention
/// over a frame's latent pixels, and the sum of the tiles in the VAE's dtype; or, after the
/// tiles, the whole video in f32 twice (the sum converted, and its conversion to frames).
pub fn vae_decode_activations(vae: &AllegroVaeConfig, latent: [usize; 3], dtype: DType) -> u64 {
    let bytes = dtype.size_in_bytes() as u64;
    let [tf, th, tw] = vae.tile();
    let tile_pixels = (tf * th * tw) as u64;
    let channels = vae.block_out_channels.first().copied().unwrap_or(128) as u64;
    let upsampled = vae
        .block_out_channels
        .get(1)
        .copied()
        .unwrap_or(channels as usize) as u64;
    let levels = tile_pixels * (2 * upsampled + 6 * channels) * bytes;
    let [lf, lh, lw] = vae.latent_tile();
    let tokens = (lh * lw) as u64;
    let scores = (lf as u64 * tokens * tokens).min(MAX_SCORE_ELEMENTS as u64) * 4 * 2;
    let (rt, rs) = (
        vae.temporal_compression_ratio() as u64,
        vae.spatial_compression_ratio() as u64,
    );
    let video = latent[0] as u64 * rt * latent[1] as u64 * rs * latent[2] as u64 * rs;
    let video = video * vae.out_channels as u64;
    (levels + scores + video * bytes).max(video * 4 * 2)
}
