//! Activation estimates of the Latte models: the device bytes their forward passes keep alive
//! at their peak (the weights are counted apart, from the constructors). The text encoder is
//! the T5 v1.1 one CogVideoX estimates ([`crate::models::cogvideox::activations`]).

use super::transformer::{BlockKind, LatteTransformerConfig};
use crate::models::attention::{product_workspace, runs_fused, MAX_SCORE_ELEMENTS};
use crate::models::autoencoder_kl::AutoencoderKLConfig;
use crate::models::fp8::forward_bytes;
use crate::models::step_cache::{AttentionModules, HookedBlocks};
use crate::models::video::{DecodeActivations, DenoiseActivations};
use candle_core::DType;

impl DenoiseActivations for LatteTransformerConfig {
    fn hooked_blocks(&self) -> HookedBlocks {
        HookedBlocks {
            first: 0,
            count: 2 * self.num_layers,
            split: self.num_layers,
            names: super::transformer::CACHE_NAMES,
        }
    }

    fn denoise_activations(
        &self,
        [f, h, w]: [usize; 3],
        text_len: usize,
        batch: usize,
        dtype: DType,
    ) -> u64 {
        transformer_activations(self, [batch, self.in_channels(), f, h, w], text_len, dtype)
    }

    /// The caption's copies.
    fn forward_held(&self, _grid: [usize; 3], text_len: usize, batch: usize, dtype: DType) -> u64 {
        caption_bytes(self, text_len, batch as u64, dtype)
    }

    fn in_fp8(&self, on: bool) -> Self {
        Self {
            fp8_matmul: on,
            ..self.clone()
        }
    }

    /// The largest Linear input: the batch's feed-forward hidden states, every token of every
    /// frame (spatial and temporal blocks group the same rows).
    fn fp8_activations(&self, grid: [usize; 3], text_len: usize, batch: usize) -> u64 {
        let (tokens, dim) = self.block_state(grid, text_len);
        forward_bytes(((batch * tokens) as u64, 4 * dim as u64))
    }

    /// Spatial and temporal blocks in turn.
    fn fp8_block_codes(&self) -> Vec<u64> {
        let [spatial, temporal] = [BlockKind::Spatial, BlockKind::Temporal]
            .map(|kind| self.block_shape(kind).fp8_codes());
        (0..self.num_layers)
            .flat_map(|_| [spatial, temporal])
            .collect()
    }

    /// The blocks thread the video tokens alone (the caption is an input of each).
    fn block_state(&self, [f, h, w]: [usize; 3], _text_len: usize) -> (usize, usize) {
        let p = self.patch_size().max(1);
        (f * (h / p) * (w / p), self.inner_dim())
    }

    /// Per layer the spatial block's `attn1` and `attn2` and the temporal block's `attn1`.
    fn attention_modules(&self) -> AttentionModules {
        AttentionModules {
            spatial: self.num_layers,
            temporal: self.num_layers,
            cross: self.num_layers,
        }
    }
}

/// Latte's decode: every frame on its own, [`super::DECODE_CHUNK_FRAMES`] at a time.
impl DecodeActivations for AutoencoderKLConfig {
    fn decode_activations(&self, [f, h, w]: [usize; 3], tiled: bool, dtype: DType) -> u64 {
        let latent = [1, self.latent_channels, f, h, w];
        vae_decode_activations(self, latent, super::DECODE_CHUNK_FRAMES, tiled, dtype)
    }
}

/// Copies of the batched video tokens a temporal block holds at its peak with the fused kernels
/// ([`runs_fused`]), in its feed-forward: the block's input, its frames-last copy, both
/// modulated norms, the sequence after the attention, the 4x hidden and its product (an H100
/// measured 10.5 copies' worth at 16x512x512, bench/RESULTS.md session 46; a spatial block
/// holds one fewer).
const FUSED_COPIES: u64 = 10;

/// The caption's four copies at the model width, for `batch` prompts of `text_len` tokens.
fn caption_bytes(c: &LatteTransformerConfig, text_len: usize, batch: u64, dtype: DType) -> u64 {
    4 * batch * text_len as u64 * c.inner_dim() as u64 * dtype.size_in_bytes() as u64
}

/// Device bytes of one transformer forward over the batch of latents `[B, C, F, h, w]` (2: the
/// guided `[negative; positive]` pair, 1 without guidance).
pub fn transformer_activations(
    c: &LatteTransformerConfig,
    latent: [usize; 5],
    text_len: usize,
    dtype: DType,
) -> u64 {
    let bytes = dtype.size_in_bytes() as u64;
    let p = c.patch_size().max(1);
    let batch = latent[0] as u64;
    let frames = latent[2] as u64;
    let tokens = ((latent[3] / p) * (latent[4] / p)) as u64;
    let dim = c.inner_dim() as u64;
    let heads = c.num_attention_heads as u64;
    let hidden = batch * frames * tokens * dim * bytes;
    let text = caption_bytes(c, text_len, batch, dtype);
    if runs_fused(dtype) {
        return FUSED_COPIES * hidden + product_workspace(dtype) + text;
    }
    // Hidden states, the modulated norm, q/k/v, the attention output and the transposed copy
    // of a temporal block; the feed-forward's 4x hidden and its GELU; the 2-D table in f32.
    let table = frames * tokens * dim * 4 * 2;
    // The chunked attention's f32 scores of the spatial blocks (one frame's tokens attend to
    // each other), bounded by the chunking; the cross-attention's are smaller.
    let scores = (batch * frames * heads * tokens * tokens).min(MAX_SCORE_ELEMENTS as u64) * 4 * 2;
    hidden * 10 + hidden * 4 * 2 + table + scores + text
}

/// Device bytes of the per-frame decode: one chunk of `chunk` frames through the decoder
/// ([`AutoencoderKLConfig::decode_activations`]; with `tiled` one tile's, diffusers' tiles) and
/// every decoded frame in f32.
pub fn vae_decode_activations(
    vae: &AutoencoderKLConfig,
    latent: [usize; 5],
    chunk: usize,
    tiled: bool,
    dtype: DType,
) -> u64 {
    let s = vae.scale_factor() as u64;
    let frames = latent[2].min(chunk);
    let decode = vae.decode_activations(frames, (latent[3], latent[4]), tiled, dtype);
    let full = latent[3] as u64 * latent[4] as u64 * s * s;
    let output = latent[2] as u64 * full * vae.out_channels as u64 * 4 * 2;
    decode + output
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused attention (bf16) makes no scores: at one width its plan does not grow with the
    /// heads, where the chunked attention's (f32) does. Two frames of 8x8 tokens keep the
    /// scores under the chunking's bound.
    #[test]
    fn only_the_chunked_attention_plans_scores() {
        let cfg = |heads, head_dim| LatteTransformerConfig {
            num_attention_heads: heads,
            attention_head_dim: head_dim,
            ..Default::default()
        };
        let (few, many) = (cfg(2, 64), cfg(4, 32));
        let plan = |c: &LatteTransformerConfig, dtype| {
            transformer_activations(c, [1, c.in_channels(), 2, 16, 16], 8, dtype)
        };
        assert_eq!(plan(&few, DType::BF16), plan(&many, DType::BF16));
        assert!(plan(&many, DType::F32) > plan(&few, DType::F32));
    }
}
