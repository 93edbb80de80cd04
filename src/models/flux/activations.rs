//! Activation estimates of the FLUX models: the device bytes their forward passes keep alive at
//! their peak (the weights are counted apart, from the constructors).

use super::transformer::FluxTransformerConfig;
use crate::models::attention::{joint_block_activations, runs_fused};
use crate::models::autoencoder_kl::AutoencoderKLConfig;
use crate::models::clip::ClipTextConfig;
use crate::models::cogvideox::activations::text_encoder_activations as t5_activations;
use crate::models::hunyuan_video::activations::stream_block_codes;
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

/// Copies of the joint sequence a block's attention holds at once: the streams, the modulated
/// norm, q/k/v and one projection's product in flight (the attention's output comes once the
/// products are gone; q/k/v go before its heads are merged).
const ATTENTION_COPIES: u64 = 6;

/// Device bytes of one transformer forward over `image_tokens` packed tokens and `text_len`
/// text tokens: the larger of a block's attention and the single-stream MLP
/// ([`single_mlp_activations`]) with the products' workspace ([`joint_block_activations`]),
/// plus the RoPE tables and the latents in f32.
pub fn transformer_activations(
    t: &FluxTransformerConfig,
    image_tokens: usize,
    text_len: usize,
    dtype: DType,
) -> u64 {
    let tokens = (image_tokens + text_len) as u64;
    let blocks = joint_block_activations(
        ATTENTION_COPIES,
        t.num_attention_heads,
        tokens as usize,
        t.inner_dim(),
        single_mlp_activations(t, tokens as usize, dtype),
        dtype,
    );
    let rope = 2 * tokens * t.attention_head_dim as u64 * 4;
    let latents = image_tokens as u64 * t.in_channels as u64 * 4 * 4;
    blocks + rope + latents
}

/// Device bytes `--fp8-matmul` adds to a forward besides the blocks' weight codes
/// ([`fp8_block_codes`]): the codes of its largest Linear input (a stream's feed-forward hidden
/// state, the joint sequence, or a single-stream half's [attention; MLP]) and a product's
/// workspace.
pub fn fp8_matmul_activations(
    t: &FluxTransformerConfig,
    image_tokens: usize,
    text_len: usize,
) -> u64 {
    let (d, mlp) = (t.inner_dim() as u64, t.mlp_dim() as u64);
    let (image, text) = (image_tokens as u64, text_len as u64);
    let tokens = image + text;
    let largest = [
        (image, mlp),
        (text, mlp),
        (tokens, d),
        (tokens.div_ceil(2), d + mlp),
    ]
    .into_iter()
    .max_by_key(|(rows, cols)| rows * cols)
    .unwrap_or_default();
    crate::models::fp8::forward_bytes(largest)
}

/// Device bytes of each block's weight codes under `--fp8-matmul`, in execution order
/// ([`stream_block_codes`]).
pub fn fp8_block_codes(t: &FluxTransformerConfig) -> Vec<u64> {
    let (dual, single) = stream_block_codes(t.inner_dim(), t.mlp_dim());
    let mut codes = vec![dual; t.num_layers];
    codes.extend(vec![single; t.num_single_layers]);
    codes
}

/// Device bytes of a single-stream block's MLP step over `tokens` joint tokens: the block's
/// input, the modulated norm, the attention's output and one half's output, with a half's MLP
/// (and, without the products' GELU epilogue, the MLP before its GELU) and [attention; MLP]
/// (the step runs by halves of the rows).
pub fn single_mlp_activations(t: &FluxTransformerConfig, tokens: usize, dtype: DType) -> u64 {
    let d = dtype.size_in_bytes() as u64;
    let (inner, mlp) = (t.inner_dim() as u64, t.mlp_dim() as u64);
    let (tokens, half) = (tokens as u64, tokens.div_ceil(2) as u64);
    let unfused_gelu = if runs_fused(dtype) { 0 } else { mlp };
    (tokens * 3 * inner + half * (2 * inner + 2 * mlp + unfused_gelu)) * d
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
