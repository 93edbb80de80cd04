//! Activation estimates of the CogVideoX models: the device bytes their forward passes keep
//! alive at their peak (the weights are counted apart, from the constructors).

use super::transformer::CogVideoXTransformerConfig;
use super::vae::CogVideoXVaeConfig;
use crate::models::attention::{attention_workspace, product_workspace, runs_fused};
use crate::models::fp8::{forward_bytes, weight_codes};
use crate::models::step_cache::{AttentionModules, HookedBlocks};
use crate::models::t5::encoder::T5Config;
use crate::models::vae_tiling::SpatialTiling;
use crate::models::video::{DecodeActivations, DenoiseActivations};
use candle_core::DType;

impl DenoiseActivations for CogVideoXTransformerConfig {
    fn hooked_blocks(&self) -> HookedBlocks {
        HookedBlocks::one_list(self.num_layers, super::transformer::CACHE_NAMES)
    }

    fn denoise_activations(
        &self,
        [f, h, w]: [usize; 3],
        text_len: usize,
        batch: usize,
        dtype: DType,
    ) -> u64 {
        transformer_activations(self, [batch, f, self.in_channels, h, w], text_len, dtype)
    }

    /// The RoPE tables.
    fn forward_held(&self, grid: [usize; 3], text_len: usize, _batch: usize, _dtype: DType) -> u64 {
        rope_tables(self, self.block_state(grid, text_len).0)
    }

    fn in_fp8(&self, on: bool) -> Self {
        Self {
            fp8_matmul: on,
            ..self.clone()
        }
    }

    fn fp8_activations(&self, [f, h, w]: [usize; 3], text_len: usize, batch: usize) -> u64 {
        fp8_matmul_activations(self, [batch, f, self.in_channels, h, w], text_len)
    }

    fn fp8_block_codes(&self) -> Vec<u64> {
        fp8_block_codes(self)
    }

    fn block_state(&self, [f, h, w]: [usize; 3], text_len: usize) -> (usize, usize) {
        let p = self.patch_size;
        (text_len + f * (h / p) * (w / p), self.inner_dim())
    }

    /// `attn1` of every block: the joint self-attention.
    fn attention_modules(&self) -> AttentionModules {
        AttentionModules {
            spatial: self.num_layers,
            ..Default::default()
        }
    }
}

impl DecodeActivations for CogVideoXVaeConfig {
    fn decode_activations(&self, [f, h, w]: [usize; 3], tiled: bool, dtype: DType) -> u64 {
        vae_decode_activations(self, [1, f, self.latent_channels, h, w], tiled, dtype)
    }
}

/// Device bytes of the text encoder's activations for `len` tokens.
pub fn text_encoder_activations(c: &T5Config, len: usize, dtype: DType) -> u64 {
    let bytes = dtype.size_in_bytes() as u64;
    let (len, d, ff, heads) = (
        len as u64,
        c.d_model as u64,
        c.d_ff as u64,
        c.num_heads as u64,
    );
    // The f32 residual stream, a few hidden-sized temporaries, the gated FFN's two
    // projections and the attention scores and their softmax in f32.
    len * d * (4 + 6 * bytes) + 3 * len * ff * bytes + 3 * heads * len * len * 4
}

/// Copies of the batched joint sequence a block holds at its peak with the fused kernels
/// ([`runs_fused`]): its feed-forward step holds eight as it runs (the block's input, the
/// sequence after the attention, the modulated norm, the 4x hidden and its product). At
/// 49x480x720 on an H200 (bench/RESULTS.md, session 56) the guided pair held 9.1 a prompt
/// resident and one prompt at leaf level about 8; nine for both planned the latter 20% over.
const FUSED_COPIES: u64 = 8;

/// Copies the candle composition holds (CPU, f32): hidden states, q/k/v, the attention output
/// and norm temporaries, and the FFN's 4x hidden with its GELU.
const COMPOSITE_COPIES: u64 = 18;

/// Tokens of one prompt's joint sequence of `latent` `[B, F, C, H, W]`: the text's, then the
/// patches'.
fn joint_tokens(c: &CogVideoXTransformerConfig, latent: [usize; 5], text_len: usize) -> usize {
    let p = c.patch_size;
    text_len + latent[1] * (latent[3] / p) * (latent[4] / p)
}

/// The RoPE tables, f32, per token of a `seq`-token sequence and head dim.
fn rope_tables(c: &CogVideoXTransformerConfig, seq: usize) -> u64 {
    2 * seq as u64 * c.attention_head_dim as u64 * 4
}

/// Device bytes of one transformer forward over the batch of `latent` `[B, F, C, H, W]` (2: the
/// guided `[negative; positive]` pair, 1 without guidance): the block's copies of the joint
/// sequence, the RoPE tables, and with the fused kernels the products' cuBLASLt workspace, else
/// the chunked attention's ([`attention_workspace`]).
pub fn transformer_activations(
    c: &CogVideoXTransformerConfig,
    latent: [usize; 5],
    text_len: usize,
    dtype: DType,
) -> u64 {
    let bytes = dtype.size_in_bytes() as u64;
    let seq = joint_tokens(c, latent, text_len);
    let batch = latent[0];
    let hidden = (batch * seq * c.inner_dim()) as u64 * bytes;
    let rope = rope_tables(c, seq);
    let blocks = match runs_fused(dtype) {
        true => FUSED_COPIES * hidden + product_workspace(dtype),
        false => {
            let heads = c.num_attention_heads;
            COMPOSITE_COPIES * hidden + attention_workspace(batch, heads, seq, c.inner_dim(), dtype)
        }
    };
    blocks + rope
}

/// Device bytes `--fp8-matmul` adds to a forward besides the blocks' weight codes
/// ([`fp8_block_codes`]): the codes of its largest Linear input, the feed-forward's hidden
/// state (`ff.net.2` reads the whole batched joint sequence at 4x the width, unchunked), and a
/// product's workspace.
pub fn fp8_matmul_activations(
    c: &CogVideoXTransformerConfig,
    latent: [usize; 5],
    text_len: usize,
) -> u64 {
    let rows = latent[0] * joint_tokens(c, latent, text_len);
    forward_bytes((rows as u64, c.ff_dim() as u64))
}

/// Device bytes of each block's weight codes under `--fp8-matmul`, in execution order: its
/// attention's q, k, v and out and its feed-forward's two Linears (the modulations stay exact).
pub fn fp8_block_codes(c: &CogVideoXTransformerConfig) -> Vec<u64> {
    let (d, ff) = (c.inner_dim(), c.ff_dim());
    let codes = weight_codes(&[(d, d), (d, d), (d, d), (d, d), (d, ff), (ff, d)]);
    vec![codes; c.num_layers]
}

/// Device bytes of the frame-batched decode: the widest level at full resolution over one
/// chunk (up to 3 latent frames), with the conv caches; with `tiled` (diffusers'
/// `enable_tiling()` sizes) over each tile instead of the frame, beside the decoded tiles in the
/// VAE dtype that diffusers holds until they are blended ([`crate::models::vae_tiling::TileWalk`]:
/// an H200 at 49x480x720 in bf16 used 2.28 GiB above the weights, planned 2.33; bench/RESULTS.md
/// session 39).
pub fn vae_decode_activations(
    vae: &CogVideoXVaeConfig,
    latent: [usize; 5],
    tiled: bool,
    dtype: DType,
) -> u64 {
    let bytes = dtype.size_in_bytes() as u64;
    let s = vae.scale_factor_spatial();
    let t = vae.scale_factor_temporal() as u64;
    let video_frames = latent[1] as u64 * t;
    let (full_h, full_w) = (latent[3] * s, latent[4] * s);
    let walk = tiled
        .then(|| vae.tiling().walk((latent[3], latent[4]), s))
        .flatten();
    let (h, w) = walk.as_ref().map_or((full_h, full_w), |walk| walk.tile);
    let (h, w) = (h as u64, w as u64);
    let frames = latent[1].min(3) as u64 * t;
    // At full resolution: the last upsampler's output, which the last up block's first
    // resnet reads (the second up block's channels, counting from the top), and that
    // block's spatial norms at its own channels (the resized latents' scale and shift, the
    // norm, its product). The convolutions gather their padded input channels last run by
    // run and need no transposing workspace (an H200 at 49x480x720 in bf16: 8.13 GiB used
    // above the weights, planned 8.10; bench/RESULTS.md session 36).
    let boc = &vae.block_out_channels;
    let last = boc.first().copied().unwrap_or(128) as u64;
    let upsampled = boc.get(1).copied().unwrap_or(128) as u64;
    let channels = vae.out_channels as u64;
    let output = video_frames * full_h as u64 * full_w as u64 * channels * 4;
    let maps = frames * h * w * (2 * upsampled + 4 * last) * bytes;
    let decoded = match &walk {
        Some(walk) => walk.peak(maps, video_frames * channels * bytes),
        None => maps,
    };
    decoded + output
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused attention (bf16) makes no scores: at one width, twice the heads of half the
    /// width plan no more than the RoPE tables' difference, where the chunked attention's (f32)
    /// scores grow with them.
    #[test]
    fn only_the_chunked_attention_plans_scores() {
        let cfg = |heads, head_dim| CogVideoXTransformerConfig {
            num_attention_heads: heads,
            attention_head_dim: head_dim,
            ..Default::default()
        };
        let (few, many) = (cfg(2, 64), cfg(4, 32));
        let text = 8;
        let latent = [1, 2, few.in_channels, 16, 16];
        let plan =
            |c: &CogVideoXTransformerConfig, dtype| transformer_activations(c, latent, text, dtype);
        let seq = text + 2 * (16 / few.patch_size) * (16 / few.patch_size);
        let rope_difference = 2 * seq as u64 * (64 - 32) * 4;
        assert_eq!(
            plan(&few, DType::BF16),
            plan(&many, DType::BF16) + rope_difference
        );
        assert!(plan(&many, DType::F32) > plan(&few, DType::F32) - rope_difference);
    }
}
