//! Activation estimates of the FLUX models: the device bytes their forward passes keep alive at
//! their peak (the weights are counted apart, from the constructors).

use super::transformer::FluxTransformerConfig;
use crate::models::autoencoder_kl::AutoencoderKLConfig;
use crate::models::clip::ClipTextConfig;
use crate::models::cogvideox::activations::text_encoder_activations as t5_activations;
use crate::models::t5::encoder::T5Config;
use candle_core::DType;

/// Device bytes of the text stage: CLIP's `clip_len` tokens through one of its layers, then T5's
/// `text_len` tokens (the two encoders run one after the other).
pub fn text_encoder_activations(
    clip: &ClipTextConfig,
    t5: &T5Config,
    clip_len: usize,
    text_len: usize,
    dtype: DType,
) -> u64 {
    let clip =
        clip_len as u64 * (clip.hidden_size as u64 * 6 + clip.intermediate_size as u64 * 2) * 4
            + clip.num_attention_heads as u64 * (clip_len * clip_len) as u64 * 4 * 2;
    clip.max(t5_activations(t5, text_len, dtype))
}

/// Device bytes of one transformer forward over `image_tokens` packed tokens and `text_len`
/// text tokens: the joint sequence through a single-stream block (the streams, the modulated
/// copy, q/k/v, the attention output, the MLP and the concatenation before `proj_out`), the
/// attention's scores (f32, up to 1024 queries at a time), the RoPE tables and the latents in
/// f32.
pub fn transformer_activations(
    t: &FluxTransformerConfig,
    image_tokens: usize,
    text_len: usize,
    dtype: DType,
) -> u64 {
    let d = dtype.size_in_bytes() as u64;
    let tokens = (image_tokens + text_len) as u64;
    let inner = t.inner_dim() as u64;
    let mlp = t.mlp_dim() as u64;
    let scores = t.num_attention_heads as u64 * tokens.min(1024) * tokens * 4 * 2;
    let rope = 2 * tokens * t.attention_head_dim as u64 * 4;
    let latents = image_tokens as u64 * t.in_channels as u64 * 4 * 4;
    tokens * (inner * 10 + (inner + mlp) * 3) * d + scores + rope + latents
}

/// Device bytes of the decode of an `h x w` latent into one image: at full resolution the last
/// upsampler's output (the second-last level's channels) and the last up block's resnet at its
/// own channels (input, norm, activation, conv output, residual), the mid block's attention
/// scores over the latent's tokens (f32, chunked as [`crate::models::attention::sdpa`] bounds
/// them), and the image in f32; with `tiled` (diffusers' tiles) the levels and attention are
/// one tile's, and the tiles and their blended whole are held besides.
pub fn vae_decode_activations(
    vae: &AutoencoderKLConfig,
    h: usize,
    w: usize,
    tiled: bool,
    dtype: DType,
) -> u64 {
    let d = dtype.size_in_bytes() as u64;
    let scale = vae.scale_factor();
    let full = (h * scale * w * scale) as u64;
    let ((tile_h, tile_w), held) = match tiled {
        true => vae.tiling().footprint((h, w), scale),
        false => ((h * scale, w * scale), 0),
    };
    let pixels = (tile_h * tile_w) as u64;
    let held = held as u64 * vae.out_channels as u64 * d;
    let channels = &vae.block_out_channels;
    let last = channels.first().copied().unwrap_or(0) as u64;
    let upsampled = channels.get(1).copied().unwrap_or(0) as u64;
    let tokens = pixels / (scale * scale) as u64;
    let scores = (tokens * tokens).min(crate::models::attention::MAX_SCORE_ELEMENTS as u64) * 4;
    pixels * (2 * upsampled + 5 * last) * d + scores + held + full * 3 * 4 * 2
}
