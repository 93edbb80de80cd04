//! Activation estimates of the MiniMax H3 models: the device bytes their forward passes keep
//! alive at their peak (the weights are counted apart, from the constructors).

use super::audio_vae::MiniMaxH3AudioVaeConfig;
use super::layout::{T2vaGeometry, AUDIO_CHANNELS};
use super::text_encoder::Qwen3VLTextConfig;
use super::transformer::{chunk_rows, MiniMaxH3TransformerConfig};
use super::vae::{MiniMaxH3VaeConfig, Tiling};
use crate::models::attention::{product_workspace, MAX_SCORE_ELEMENTS};
use crate::models::fp8::weight_codes;
use candle_core::DType;

/// Bytes of an f32 element.
const F32_BYTES: u64 = 4;

/// Device bytes of one Qwen3-VL text forward over `len` tokens: hidden-state copies, then the
/// larger of the MLP's three widest tensors and one layer's attention (q and the repeated k
/// and v, f32 copies of q and k, and three f32 score tensors: scaled, masked, softmax).
pub fn text_encoder_activations(cfg: &Qwen3VLTextConfig, len: usize, dtype: DType) -> u64 {
    let e = dtype.size_in_bytes() as u64;
    let l = len as u64;
    let hidden = l * cfg.hidden_size as u64 * e;
    let mlp = 3 * l * cfg.intermediate_size as u64 * e;
    let heads = cfg.num_attention_heads as u64;
    let width = heads * cfg.head_dim() as u64;
    let attention = 3 * l * width * e + 2 * l * width * F32_BYTES + 3 * heads * l * l * F32_BYTES;
    6 * hidden + mlp.max(attention)
}

/// Device bytes [`crate::models::attention::sdpa`] adds for `q_len` queries over `kv_len` keys:
/// none where CUDA fuses it (bf16/f16, head dim 64 or 128); else the chunked path's transposed
/// copy of K and [`SCORE_COPIES`] score chunks.
fn unfused_attention_scratch(
    heads: usize,
    head_dim: usize,
    q_len: u64,
    kv_len: u64,
    dtype: DType,
) -> u64 {
    if matches!(dtype, DType::BF16 | DType::F16) && matches!(head_dim, 64 | 128) {
        return 0;
    }
    let e = dtype.size_in_bytes() as u64;
    let per_query = (heads as u64 * kv_len).max(1);
    let queries = (MAX_SCORE_ELEMENTS as u64 / per_query).clamp(1, q_len.max(1));
    kv_len * (heads * head_dim) as u64 * e + SCORE_COPIES * queries * per_query * e
}

/// `[rows, hidden]` temporaries one chunk of a block holds at most (besides its attention or
/// feed-forward): the norm output, three gathered modulation parameters, the modulation's two
/// products.
const CHUNK_HIDDEN_COPIES: u64 = 6;
/// `[rows, inner]` temporaries of one chunk's attention: the projection, its per-head norm,
/// head-major copy and RoPE output, then the attention output and its head-merged copy.
const CHUNK_INNER_COPIES: u64 = 5;
/// `[rows, ffn_dim]` temporaries of one chunk's SwiGLU: the projection (two wide), the gate's
/// SiLU and the product.
const CHUNK_FFN_COPIES: u64 = 4;
/// Score chunks alive in unfused attention: the scores, their softmax, and the CPU gemm's
/// packing of the softmax for its product with V (measured at up to a quarter of them;
/// counted as a copy).
const SCORE_COPIES: u64 = 3;
/// f32 copies of the packed latents alive while denoising: video and audio rows, their
/// velocities and each schedule's stepped rows.
const LATENT_COPIES: u64 = 4;

/// Device bytes of one transformer forward over the packed sequence of `rows` (`text_len` of
/// them text), as [`MiniMaxH3TransformerBlock::forward`](super::transformer::MiniMaxH3TransformerBlock::forward) computes it: the residual stream
/// (updated in place), K and V of every row, and one chunk's attention temporaries
/// or feed-forward temporaries (one chunk's rows, [`chunk_rows`] of
/// [`MiniMaxH3TransformerConfig::rows_per_chunk`]; fewer temporaries in bf16, which takes the
/// fused kernels);
/// before the blocks, the unpacked rows and the packed sequence (and an f32 chunk of the video
/// projection); attention's own scratch where it is not fused ([`unfused_attention_scratch`]).
/// Plus the RoPE tables, the latents and the prompt embeddings.
pub fn transformer_activations(
    cfg: &MiniMaxH3TransformerConfig,
    rows: usize,
    text_len: usize,
    dtype: DType,
) -> u64 {
    let e = dtype.size_in_bytes() as u64;
    let s = rows as u64;
    let chunk = chunk_rows(rows, cfg.rows_per_chunk()) as u64;
    let (hidden, inner, ffn) = (
        cfg.hidden_size as u64,
        cfg.inner_dim() as u64,
        cfg.ffn_dim as u64,
    );
    let stream = s * hidden * e;
    let keys_values = 2 * s * inner * e;
    let blocks = if dtype == DType::BF16 {
        // The fused CUDA block (bf16): the modulated norms read the stream in place, q and k are
        // normed and rotated in place and attention's output is token-major, so a query chunk
        // holds q, the attention output and its projection; a feed-forward chunk its input,
        // the SwiGLU's two-wide projection, its product and its output. Counted so, the 5 s
        // request's one-block DiT plans 4.19 GiB for the 4.12 measured on an H100, where the
        // composed count below planned 5.30 (bench/RESULTS.md, session 60).
        let attention = keys_values + chunk * (2 * inner + hidden) * e;
        let feed_forward = chunk * (2 * hidden + 3 * ffn) * e;
        stream + attention.max(feed_forward) + product_workspace(dtype)
    } else {
        let scores = unfused_attention_scratch(
            cfg.num_attention_heads,
            cfg.attention_head_dim,
            chunk,
            s,
            dtype,
        );
        let chunk_hidden = CHUNK_HIDDEN_COPIES * chunk * hidden * e;
        let attention = keys_values + scores + CHUNK_INNER_COPIES * chunk * inner * e;
        let feed_forward = CHUNK_FFN_COPIES * chunk * ffn * e;
        stream + chunk_hidden + attention.max(feed_forward)
    };
    // The video rows alone may split into fewer, longer chunks than the whole sequence.
    let prepare = 2 * stream + s.min(cfg.rows_per_chunk() as u64) * hidden * F32_BYTES;
    let rope = 2 * s * 3 * cfg.rope_freq_dim as u64 * F32_BYTES;
    let latents =
        LATENT_COPIES * s * cfg.video_patch_dim().max(cfg.audio_in_channels) as u64 * F32_BYTES;
    let text = text_len as u64 * cfg.text_dim as u64 * e;
    blocks.max(prepare) + rope + latents + text
}

/// Device bytes `--fp8-matmul` adds to a forward over the packed sequence of `rows` besides the
/// blocks' weight codes ([`fp8_block_codes`]): the codes of its largest Linear input, one
/// chunk's widest (its attention input or output, or its gated SwiGLU state), and a product's
/// workspace.
pub fn fp8_matmul_activations(cfg: &MiniMaxH3TransformerConfig, rows: usize) -> u64 {
    let chunk = chunk_rows(rows, cfg.rows_per_chunk()) as u64;
    let widest = cfg.hidden_size.max(cfg.inner_dim()).max(cfg.ffn_dim) as u64;
    crate::models::fp8::forward_bytes((chunk, widest))
}

/// Device bytes of each main block's weight codes under `--fp8-matmul`, in execution order: its
/// q, k, v and `to_out` and its SwiGLU (the AdaLN projection, computed apart, stays exact; the
/// token refiner is not a block).
pub fn fp8_block_codes(cfg: &MiniMaxH3TransformerConfig) -> Vec<u64> {
    let (d, inner, ffn) = (cfg.hidden_size, cfg.inner_dim(), cfg.ffn_dim);
    let codes = weight_codes(&[
        (d, inner),
        (d, inner),
        (d, inner),
        (inner, d),
        (d, 2 * ffn),
        (ffn, d),
    ]);
    vec![codes; cfg.num_layers]
}

/// Decoded clips alive on the device at once: the previous one (its tail is cross-faded into
/// this one), this one's tiles, their stitched rows and the stitched clip, and the finished
/// stretch on its way to host memory (a few frames at a time in f32, the pipeline's
/// `HANDOFF_FRAMES`).
const DECODED_CLIP_COPIES: u64 = 5;

/// Device bytes of the video decode: one decoder call over a clip (or a tile of it) with its
/// tokens at the decoder's width, the SwiGLU widening and its attention's scratch, and [`DECODED_CLIP_COPIES`] decoded
/// clips; the whole video never waits on the device.
pub fn vae_decode_activations(cfg: &MiniMaxH3VaeConfig, g: &T2vaGeometry, dtype: DType) -> u64 {
    let e = dtype.size_in_bytes() as u64;
    let (rs, rt) = (cfg.spatial_ratio() as u64, cfg.temporal_ratio() as u64);
    let tile = Tiling::default();
    let tile_h = (tile.tile_height as u64).min(g.height as u64);
    let tile_w = (tile.tile_width as u64).min(g.width as u64);
    let clip_latents = (cfg.tokens_chunk_size() + cfg.token_overlap()) as u64;
    let tokens = clip_latents * (tile_h / rs) * (tile_w / rs) + 5;
    let dim = cfg.decoder_dim() as u64;
    let decoder = tokens * dim * e * (6 + 3 * cfg.decoder_ffn_mult as u64)
        + unfused_attention_scratch(
            cfg.decoder_num_attention_heads,
            cfg.decoder_attention_head_dim,
            tokens,
            tokens,
            dtype,
        );
    let clip = 3 * clip_latents * rt * g.height as u64 * g.width as u64 * e;
    decoder + DECODED_CLIP_COPIES * clip
}

/// Copies of the stereo batch at a stage's width that the audio decode holds at once (f32): ten
/// whole tensors (the stage's input, the AMP blocks' running sum with its next value, a block's
/// input and residual, a convolution's padded input, output and biased copy, the activation's
/// input and output) and, within one more, one convolution's im2col (convolutions work in runs
/// of output samples, `audio_vae`; the activations need no scratch). The CPU heap test on the
/// fixture measured ten before the activation was one pass (465,680 of the 587,008 bytes predicted
/// since); an H200 held fewer at full size (bench/RESULTS.md, session 56).
const AUDIO_DECODE_COPIES: u64 = 11;

/// Device bytes of the audio decode at its peak moment: at each upsampling stage,
/// [`AUDIO_DECODE_COPIES`] copies at the stage's width beside the stage's largest weight-normed
/// kernel, folded while its layer runs (the stored `weight_v`, `weight_g` are the VAE's
/// weights); at `conv_pre`, its kernel (the decoder's largest) beside its input and output.
pub fn audio_decode_activations(cfg: &MiniMaxH3AudioVaeConfig, latents: usize) -> u64 {
    let stereo = AUDIO_CHANNELS as u64;
    let (latent_dim, mut channels) = (cfg.latent_dim as u64, cfg.decoder_dim as u64);
    let mut length = latents as u64;
    let resblock_kernel = cfg.resblock_kernel_sizes.iter().max().copied().unwrap_or(0) as u64;
    let mut peak = channels * latent_dim * 7 + stereo * (latent_dim + channels) * length;
    for (&rate, &up_kernel) in cfg.decoder_rates.iter().zip(&cfg.decoder_kernel_sizes) {
        let upsample = channels * (channels / 2) * up_kernel as u64;
        channels /= 2;
        length *= rate as u64;
        let kernel = upsample.max(channels * channels * resblock_kernel);
        peak = peak.max(stereo * channels * length * AUDIO_DECODE_COPIES + kernel);
    }
    peak * 4
}
