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

/// Device bytes of the decode of one image's latents `[h, w]`
/// ([`AutoencoderKLConfig::decode_activations`]; with `tiled` one tile's) and the image in f32.
pub fn vae_decode_activations(
    vae: &AutoencoderKLConfig,
    h: usize,
    w: usize,
    tiled: bool,
    dtype: DType,
) -> u64 {
    let scale = vae.scale_factor();
    let full = (h * scale * w * scale) as u64;
    vae.decode_activations(1, (h, w), tiled, dtype) + full * vae.out_channels as u64 * 4 * 2
}
