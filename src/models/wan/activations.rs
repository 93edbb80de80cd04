//! Activation estimates of the Wan models: the device bytes their forward passes keep alive at
//! their peak, from the tensors each holds (the weights are counted apart, from the
//! constructors). Checked against the CUDA pool's high-water marks on an H200 (synthetic 1.3B,
//! bf16, lazy load so that each stage holds only its own component; GiB above the weights,
//! predicted / measured):
//!
//! | frames x height x width | encode_text | denoise | decode |
//! |---|---|---|---|
//! | 81 x 480 x 832 | 0.29 / 0.29 | 2.21 / 2.16 (14B: 5.21 / 5.18) | 7.56 / 7.6, tiled 2.34 / 2.00 |
//! | 41 x 480 x 832 | | 1.19 / 1.16 | 7.38 / 7.42 |
//! | 49 x 320 x 576 | | 0.88 / 0.86 | 3.56 / 3.58 |
//! | 33 x 240 x 416 | | 0.65 / 0.65 | 2.02 / 2.05 |
//! | 21 x 720 x 1280 | | 1.46 / 1.42 | tiled 1.82 / 1.67 |
//!
//! (The denoise column is of an older forward that batched both guidance passes; the present
//! one's check is at [`ATTENTION_HIDDEN_COPIES`].)
//!
//! The low-activation DiT (`--low-activation`) is predicted at 1.08 GiB for the 14B at 81 x 480 x
//! 832 (1.65 without it) and its 128 px tiled decode at 1.09 GiB, the video's copies (neither
//! measured yet).

use super::text_encoder::UMT5Config;
use super::transformer::{WanTransformerConfig, FFN_CHUNK, LOW_ACTIVATION_ROWS};
use super::vae::blocks::{CACHE_T, MAX_IM2COL_ELEMENTS};
use super::vae::{WanVaeConfig, WanVaeTiling};
use crate::models::attention::MAX_SCORE_ELEMENTS;
use crate::models::clip::ClipVisionConfig;
use candle_core::DType;

/// Bytes of an f32 element (the VAE, RoPE tables, latents and f32 scratch).
const F32: u64 = 4;

/// Copies of the block's hidden states `[tokens, dim]` (run dtype) alive at the
/// self-attention's peak: the block input, q, k, v (heads are strided views, RoPE and the
/// q/k norms run in place) and the attention output; the normed input is gone before the
/// attention runs, and q, k and v before `to_out` allocates its projection. Measured on an
/// H100 (bench/RESULTS.md session 50, `offload_bench`, the default stream at 81 x 480 x 832):
/// peaks of 3.416 GiB (14B) and 0.751 GiB (1.3B) against 3.447 and 0.782 planned.
const ATTENTION_HIDDEN_COPIES: u64 = 5;
/// Copies alive in the feed-forward, besides one token chunk's intermediate: the block's
/// hidden states (chunks are written back into them) and one chunk's norm and output.
const FFN_HIDDEN_COPIES: u64 = 2;
/// Copies of the hidden states alive in low-activation mode: the hidden states the blocks
/// write over, and the self-attention's keys and values (the output norm before `proj_out`
/// holds two).
const LOW_ACTIVATION_HIDDEN_COPIES: u64 = 3;
/// `[chunk, inner]` tensors of one chunk of a low-activation attention alive at once: its
/// norm, queries, attention output and that output token-major, and the projection.
const LOW_ACTIVATION_CHUNK_COPIES: u64 = 5;
/// f32 copies of the latents alive while denoising besides a noise prediction per guidance
/// pass: latents, model input, the guided prediction and the scheduler's history.
const LATENT_COPIES: u64 = 6;
/// Copies of the VAE decoder's largest chunk feature map alive at once: input, norm and
/// SiLU outputs, the conv's cached frames, per-frame outputs and their stacking.
const DECODE_FEATURE_MAPS: u64 = 6;
/// Copies of the decoded video alive at the end: two at a time (the decoder's pieces and their
/// concatenation, the output and its clamp, then each step of the pipeline's rescale to [0, 1]
/// replacing the last), and one more as margin.
const VIDEO_COPIES: u64 = 3;
/// Elements of the im2col scratch one VAE conv2d may build.
const CONV_SCRATCH_ELEMENTS: u64 = MAX_IM2COL_ELEMENTS as u64;
/// Frames each causal conv of the VAE caches between chunks.
const CACHE_FRAMES: u64 = CACHE_T as u64;

/// One up stage of the decoder as `Decoder::new` builds it.
struct UpStage {
    input: u64,
    output: u64,
    resnets: usize,
    /// `Some(temporal)` when an upsampler (to `output / 2` channels) closes the stage.
    upsample: Option<bool>,
}

/// The decoder's width after `conv_in` and its up stages.
fn decoder(cfg: &WanVaeConfig) -> (u64, Vec<UpStage>) {
    let base = cfg.decoder_base_dim.unwrap_or(cfg.base_dim) as u64;
    let stages = cfg.dim_mult.len();
    let dims: Vec<u64> = std::iter::once(cfg.dim_mult[stages - 1])
        .chain(cfg.dim_mult.iter().rev().copied())
        .map(|m| m as u64 * base)
        .collect();
    let up = (0..stages)
        .map(|i| UpStage {
            input: if i > 0 { dims[i] / 2 } else { dims[i] },
            output: dims[i + 1],
            resnets: cfg.num_res_blocks + 1,
            upsample: (i != stages - 1).then(|| cfg.temperal_downsample[stages - 2 - i]),
        })
        .collect();
    (dims[0], up)
}

/// Score elements one query chunk of `attention::sdpa` materialises (batch 1).
fn score_chunk(heads: u64, q_len: u64, kv_len: u64) -> u64 {
    let per_query = (heads * kv_len).max(1);
    let chunk = (MAX_SCORE_ELEMENTS as u64 / per_query).clamp(1, q_len.max(1));
    chunk * per_query
}

/// The DiT's tokens on `latent` `[1, C, F, H, W]`: one per patch.
fn tokens(cfg: &WanTransformerConfig, latent: [usize; 5]) -> u64 {
    let [_, _, f, h, w] = latent;
    let [pt, ph, pw] = cfg.patch_size;
    ((f / pt) * (h / ph) * (w / pw)) as u64
}

/// Bytes of one hidden state of the DiT on `latent` (what a step cache holds per state).
pub fn hidden_state_bytes(cfg: &WanTransformerConfig, latent: [usize; 5], dtype: DType) -> u64 {
    let tokens = tokens(cfg, latent);
    tokens * cfg.inner_dim() as u64 * dtype.size_in_bytes() as u64
}

/// Peak activation bytes of one DiT forward on `latent` `[1, C, F, H, W]` with `text_len`
/// text tokens in a step of `passes` guidance passes (2 with classifier-free guidance, each a
/// forward of its own), in low-activation mode where `low_activation`: the larger of the
/// self-attention and feed-forward peaks of a block, plus the RoPE tables, latents and text
/// contexts that live through the whole forward.
pub fn transformer_activations(
    cfg: &WanTransformerConfig,
    latent: [usize; 5],
    text: (usize, usize),
    dtype: DType,
    low_activation: bool,
) -> u64 {
    let s = dtype.size_in_bytes() as u64;
    let tokens = tokens(cfg, latent);
    let (d, heads) = (cfg.inner_dim() as u64, cfg.num_attention_heads as u64);
    let text_len = text.0 as u64;
    let hidden = tokens * d * s;
    // The fused CUDA attention (bf16/f16) materialises no scores; f32 takes the chunked path.
    let scores = |queries: u64| {
        if matches!(dtype, DType::BF16 | DType::F16) {
            0
        } else {
            score_chunk(heads, queries, tokens).max(score_chunk(heads, queries, text_len)) * s
        }
    };
    let ffn_chunk = |chunk: u64| chunk * (cfg.ffn_dim as u64 + 2 * d) * s;
    let (attention, ffn) = if low_activation {
        let chunk = tokens.min(LOW_ACTIVATION_ROWS as u64);
        (
            LOW_ACTIVATION_HIDDEN_COPIES * hidden
                + LOW_ACTIVATION_CHUNK_COPIES * chunk * d * s
                + 2 * scores(chunk),
            hidden + ffn_chunk(chunk),
        )
    } else {
        (
            ATTENTION_HIDDEN_COPIES * hidden + 2 * scores(tokens),
            FFN_HIDDEN_COPIES * hidden + ffn_chunk(tokens.min(FFN_CHUNK as u64)),
        )
    };
    attention.max(ffn) + forward_inputs(cfg, latent, text, dtype)
}

/// What lives through a whole forward on `latent` in a step of `passes` guidance passes: the
/// RoPE tables, the latents' f32 copies (a noise prediction per pass) and each pass's text
/// context beside the projected one.
fn forward_inputs(
    cfg: &WanTransformerConfig,
    latent: [usize; 5],
    (text_len, passes): (usize, usize),
    dtype: DType,
) -> u64 {
    let s = dtype.size_in_bytes() as u64;
    let [_, c, f, h, w] = latent;
    let (text_len, passes) = (text_len as u64, passes as u64);
    let rope = 2 * tokens(cfg, latent) * (cfg.attention_head_dim / 2) as u64 * F32;
    let latents = (LATENT_COPIES + passes) * (c * f * h * w) as u64 * F32;
    let text = passes * text_len * cfg.text_dim as u64 * s + text_len * cfg.inner_dim() as u64 * s;
    rope + latents + text
}

/// Peak activation bytes while the DiT's outer part computes apart from the blocks (an outer
/// part moved in per use), `text` as [`transformer_activations`] takes it: the hidden states and
/// the output norm's modulated copy of them
/// (`proj_out`'s output is `out_channels` wide), beside what lives through the forward. The
/// patch embedding before the blocks holds less: its patches and one hidden state.
pub fn outer_activations(
    cfg: &WanTransformerConfig,
    latent: [usize; 5],
    text: (usize, usize),
    dtype: DType,
) -> u64 {
    2 * hidden_state_bytes(cfg, latent, dtype) + forward_inputs(cfg, latent, text, dtype)
}

/// Device bytes of the e4m3 codes of one block's Linear weights under `--fp8-matmul` (made where
/// the block lands, held while it stays): self- and cross-attention's q, k, v and out, the
/// feed-forward's two, and an I2V block's image keys and values.
pub fn fp8_block_codes(cfg: &WanTransformerConfig) -> u64 {
    let (d, ffn) = (cfg.inner_dim(), cfg.ffn_dim);
    let mut linears = vec![(d, d); 8];
    linears.extend([(d, ffn), (ffn, d)]);
    if let Some(kv) = cfg.added_kv_proj_dim {
        linears.extend([(kv, d), (kv, d)]);
    }
    crate::models::fp8::weight_codes(&linears)
}

/// Device bytes `--fp8-matmul` adds to a forward on `latent` besides the blocks' weight codes
/// ([`fp8_block_codes`]): the codes of the largest Linear input (all tokens, or a low-activation
/// chunk, by the model width; a feed-forward chunk by its width) and one product's workspace.
pub fn fp8_matmul_activations(
    cfg: &WanTransformerConfig,
    latent: [usize; 5],
    low_activation: bool,
) -> u64 {
    let tokens = tokens(cfg, latent);
    let (d, ffn) = (cfg.inner_dim() as u64, cfg.ffn_dim as u64);
    let rows = if low_activation {
        tokens.min(LOW_ACTIVATION_ROWS as u64)
    } else {
        tokens
    };
    let chunk = rows.min(FFN_CHUNK as u64);
    let largest = if rows * d >= chunk * ffn {
        (rows, d)
    } else {
        (chunk, ffn)
    };
    crate::models::fp8::forward_bytes(largest)
}

/// Device bytes `--attention sage` adds to a forward on `latent`: the self-attention's int8 codes
/// of q and k and e4m3 codes of v (one byte an element, v padded to whole blocks of 128 keys), the
/// f32 scales of q's rows and k's blocks, and the channel statistics.
pub fn sage_attention_activations(cfg: &WanTransformerConfig, latent: [usize; 5]) -> u64 {
    let tokens = tokens(cfg, latent);
    let (heads, head_dim) = (
        cfg.num_attention_heads as u64,
        cfg.attention_head_dim as u64,
    );
    let block = crate::models::sage_attention::KEY_BLOCK as u64;
    let padded = tokens.next_multiple_of(block);
    let codes = (2 * tokens + padded) * heads * head_dim;
    let scales = (tokens + padded / block) * heads * F32;
    codes + scales + 4 * heads * head_dim * F32
}

/// Peak activation bytes of encoding one prompt of `len` tokens: four f32 score tensors
/// (scores, position bias and the two masked sums) or the feed-forward's intermediates,
/// over the f32 residual stream.
pub fn text_encoder_activations(cfg: &UMT5Config, len: usize, dtype: DType) -> u64 {
    let s = dtype.size_in_bytes() as u64;
    let len = len as u64;
    let scores = cfg.num_heads as u64 * len * len * F32;
    let ffn = len * cfg.d_ff as u64 * (3 * s + F32);
    let hidden = len * cfg.d_model as u64 * F32;
    (4 * scores).max(ffn) + 4 * hidden + 2 * len * cfg.d_model as u64 * s
}

/// Bytes of decoding one latent frame of `h x w` latents: every causal conv's cached
/// frames, the largest chunk's working feature maps and one conv's im2col scratch.
fn decode_chunk(cfg: &WanVaeConfig, h: usize, w: usize) -> u64 {
    let (width, up) = decoder(cfg);
    let mut px = (h * w) as u64;
    let mut frames = 1;
    // conv_in's input, then the mid block's two residual blocks of two convs each.
    let mut cached = cfg.z_dim as u64 * px + 4 * width * px;
    let mut largest = width * px;
    let mut im2col = 9 * width * px;
    for s in &up {
        let mut cin = s.input;
        for _ in 0..s.resnets {
            cached += (cin + s.output) * px;
            im2col = im2col.max(9 * cin.max(s.output) * px);
            cin = s.output;
        }
        largest = largest.max(frames * s.input.max(s.output) * px);
        if let Some(temporal) = s.upsample {
            if temporal {
                cached += s.output * px;
                frames *= 2;
            }
            px *= 4;
            im2col = im2col.max(9 * s.output * px);
        }
    }
    cached += up.last().map_or(width, |s| s.output) * px;
    (CACHE_FRAMES * cached + DECODE_FEATURE_MAPS * largest + im2col.min(CONV_SCRATCH_ELEMENTS))
        * F32
}

/// Peak activation bytes of decoding `latent` `[1, C, F, H, W]`, whole or in `tiling`'s
/// spatial tiles (two rows of decoded tiles wait to be blended).
pub fn vae_decode_activations(
    cfg: &WanVaeConfig,
    latent: [usize; 5],
    tiling: Option<&WanVaeTiling>,
) -> u64 {
    let [_, _, f, h, w] = latent;
    let sf = cfg.scale_factor_spatial();
    let frames_out = ((f.max(1) - 1) * cfg.scale_factor_temporal() + 1) as u64;
    let video_of =
        |h: usize, w: usize| frames_out * (cfg.out_channels * h * sf * w * sf) as u64 * F32;
    let video = video_of(h, w);
    let tiles = tiling.and_then(|t| {
        let tile = (t.tile_min_height / sf, t.tile_min_width / sf);
        let stride_w = t.tile_stride_width / sf;
        let whole = h <= tile.0 && w <= tile.1;
        (!whole && tile.0 > 0 && tile.1 > 0 && stride_w > 0).then(|| {
            let (th, tw) = (tile.0.min(h), tile.1.min(w));
            decode_chunk(cfg, th, tw) + 2 * w.div_ceil(stride_w) as u64 * video_of(th, tw)
        })
    });
    let decoding = tiles.unwrap_or_else(|| decode_chunk(cfg, h, w)) + video;
    decoding.max(VIDEO_COPIES * video)
}

/// A rough peak of the CLIP tower's forward (Wan's image encoder): a few copies of the token
/// stream and one layer's intermediates and scores, in f32.
pub fn image_encoder_activations(c: &ClipVisionConfig) -> u64 {
    let n = c.num_positions() as u64;
    let d = c.hidden_size as u64;
    let heads = c.num_attention_heads as u64;
    4 * (6 * n * d + n * c.intermediate_size as u64 + 2 * heads * n * n)
}
