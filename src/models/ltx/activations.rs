//! Activation estimates of the LTX-Video models (and of the T5 v1.1 encoder as LTX-Video runs
//! it): the device bytes their forward passes keep alive at their peak (the weights are counted
//! apart, from the constructors).

use super::transformer::LtxTransformerConfig;
use super::vae::{LtxVaeConfig, LtxVaeTiling};
use crate::models::attention::runs_fused;
use crate::models::t5::encoder::T5Config;
use crate::models::vae_tiling::SpatialTiling;
use candle_core::DType;

/// Device bytes of one T5 forward over `batch` prompts of `len` tokens: a few hidden-state
/// copies, the FFN's widest tensor and one head's attention scores per head.
pub fn text_encoder_activations(cfg: &T5Config, batch: usize, len: usize, dtype: DType) -> u64 {
    let e = dtype.size_in_bytes() as u64;
    let (b, l) = (batch as u64, len as u64);
    let hidden = b * l * cfg.d_model as u64 * e;
    let ffn = 3 * b * l * cfg.d_ff as u64 * e;
    let scores = 2 * b * cfg.num_heads as u64 * l * l * 4;
    6 * hidden + ffn + scores
}

/// Device bytes of one transformer forward over `batch` prompts (2: the CFG batch, 1 without
/// guidance): hidden states and their copies, the MLP's 4x widening, the RoPE tables and the
/// packed latents in f32. With the fused kernels the block peaks in its feed-forward, holding
/// four copies beside the 4x hidden: its input (the loop holds it), the stream after the
/// attentions, the modulated norm and the output (an H100 measured 0.309 GiB above the weights
/// in one forward at 161x512x768 without guidance, planned 0.325; bench/RESULTS.md session 50);
/// the candle composition eight.
pub fn transformer_activations(
    cfg: &LtxTransformerConfig,
    tokens: usize,
    text_len: usize,
    batch: usize,
    dtype: DType,
) -> u64 {
    let hidden = hidden_bytes(cfg, tokens, batch, dtype);
    let mlp = 4 * hidden;
    let copies = if runs_fused(dtype) { 4 } else { 8 };
    copies * hidden + mlp + forward_held(cfg, tokens, text_len, batch, dtype)
}

/// Device bytes of the same forward while its outer part (embedders, output head) computes
/// apart from the blocks: the stream entering the blocks and the head's normed copy, beside
/// what the forward holds throughout.
pub fn outer_activations(
    cfg: &LtxTransformerConfig,
    tokens: usize,
    text_len: usize,
    batch: usize,
    dtype: DType,
) -> u64 {
    2 * hidden_bytes(cfg, tokens, batch, dtype) + forward_held(cfg, tokens, text_len, batch, dtype)
}

/// One copy of the hidden states of `batch` prompts.
fn hidden_bytes(cfg: &LtxTransformerConfig, tokens: usize, batch: usize, dtype: DType) -> u64 {
    (batch * tokens * cfg.inner_dim() * dtype.size_in_bytes()) as u64
}

/// What a forward holds throughout: the RoPE tables, the caption and its projection, and the
/// packed latents in f32.
fn forward_held(
    cfg: &LtxTransformerConfig,
    tokens: usize,
    text_len: usize,
    batch: usize,
    dtype: DType,
) -> u64 {
    let (b, s, d) = (batch as u64, tokens as u64, cfg.inner_dim() as u64);
    let rope = 2 * s * (d / 2) * 4;
    let text =
        b * text_len as u64 * (d + cfg.caption_channels as u64) * dtype.size_in_bytes() as u64;
    let latents = 4 * b * s * cfg.in_channels as u64 * 4;
    rope + text + latents
}

/// Device bytes `--fp8-matmul` adds to a forward over the CFG batch besides the blocks' weight
/// codes ([`fp8_block_codes`]): the codes of its largest Linear input (the feed-forward's hidden
/// state over the video tokens, or the text under cross-attention's k and v) and a product's
/// workspace.
pub fn fp8_matmul_activations(
    cfg: &LtxTransformerConfig,
    tokens: usize,
    text_len: usize,
    batch: usize,
) -> u64 {
    let b = batch as u64;
    let video = (b * tokens as u64, cfg.ff_inner_dim() as u64);
    let text = (b * text_len as u64, cfg.cross_attention_dim as u64);
    let largest = [video, text]
        .into_iter()
        .max_by_key(|(rows, cols)| rows * cols)
        .unwrap_or_default();
    crate::models::fp8::forward_bytes(largest)
}

/// Device bytes of each block's weight codes under `--fp8-matmul`, in execution order: the self-
/// and cross-attention's q, k, v and out and the feed-forward's two Linears.
pub fn fp8_block_codes(cfg: &LtxTransformerConfig) -> Vec<u64> {
    let (d, text, ff) = (cfg.inner_dim(), cfg.cross_attention_dim, cfg.ff_inner_dim());
    let codes = crate::models::fp8::weight_codes(&[
        (d, d),
        (d, d),
        (d, d),
        (d, d),
        (d, d),
        (text, d),
        (text, d),
        (d, d),
        (d, ff),
        (ff, d),
    ]);
    vec![codes; cfg.num_layers]
}

/// Device bytes of the decode stage: the decoder in `dtype`, then (its maps gone) the video in
/// `dtype` beside its f32 frames (`stages::video_frames`). Half precision runs the fused path
/// (CUDA): five maps of the full-resolution level (a resnet there holds its input, a norm, the
/// second convolution's output, the noise injected into it and the sum with the residual) and
/// the video; an H200 at 161x512x704 in bf16 held 4.54 GiB above the weights, video included,
/// where these are 4.64 (bench/RESULTS.md session 35), and a whole run's decode stage 5.99 GiB
/// with the weights, where the frames' f32 copy never met the maps (session 42). f32 composes:
/// three f32 maps of its largest level and a video of temporaries, the maps counted at each
/// level's widths (each level doubles frames, height and width and takes the next of the
/// decoder's widths, from the widest at the latent grid). With `tiled` (diffusers'
/// `enable_tiling()` tiles) the feature maps are each tile's, beside the decoded tiles held
/// until they are blended ([`crate::models::vae_tiling::TileWalk`]).
pub fn vae_decode_activations(
    cfg: &LtxVaeConfig,
    grid: [usize; 3],
    tiled: bool,
    dtype: DType,
) -> u64 {
    let (r_t, r_s) = (
        cfg.temporal_compression_ratio() as u64,
        cfg.spatial_compression_ratio() as u64,
    );
    let frames = (grid[0] as u64 - 1) * r_t + 1;
    let (h, w) = (grid[1] as u64 * r_s, grid[2] as u64 * r_s);
    let s = r_s as usize;
    let walk = tiled
        .then(|| LtxVaeTiling::default().spatial.walk((grid[1], grid[2]), s))
        .flatten();
    let (tile_h, tile_w) = walk
        .as_ref()
        .map_or((grid[1] * s, grid[2] * s), |walk| walk.tile);
    let d = dtype.size_in_bytes() as u64;
    let video = 3 * frames * h * w;
    let grid = [grid[0], tile_h / s, tile_w / s];
    let tokens: u64 = grid.iter().map(|&g| g as u64).product();
    let widths: Vec<u64> = cfg
        .decoder_block_out_channels
        .iter()
        .rev()
        .map(|&c| c as u64)
        .collect();
    let largest = (0..=widths.len())
        .map(|level| {
            let c = widths
                .get(level.min(widths.len().saturating_sub(1)))
                .copied()
                .unwrap_or(cfg.latent_channels as u64);
            c * tokens * 8u64.pow(level as u32)
        })
        .max()
        .unwrap_or(0);
    let maps = match dtype {
        DType::BF16 | DType::F16 => {
            let patch = cfg.patch_size.max(1) as u64;
            let full_level = frames * (tile_h as u64 / patch) * (tile_w as u64 / patch);
            5 * full_level * cfg.decoder_output_channels() as u64 * d
        }
        // The composed path's temporaries hold about one video besides (the CPU heap test).
        _ => 3 * largest * 4 + video * 4,
    };
    // The decoder's output beside its maps: the video, or each tile in the walk.
    let decoded = match &walk {
        Some(walk) => walk.peak(maps, 3 * frames * d),
        None => maps + video * d,
    };
    decoded.max(video * (d + 4))
}
