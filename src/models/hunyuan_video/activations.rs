//! Activation estimates of the HunyuanVideo models: the device bytes their forward passes keep
//! alive at their peak (the weights are counted apart, from the constructors).

use super::text_encoder::{LlamaConfig, DEFAULT_CROP_START};
use super::transformer::{HunyuanVideoTransformerConfig, MLP_CHUNK_TOKENS};
use super::vae::{self, HunyuanVideoVaeConfig, HunyuanVideoVaeTiling};
use crate::models::attention::joint_block_activations;
use crate::models::clip::ClipTextConfig;
use crate::models::fp8::weight_codes;
use candle_core::DType;

/// Bytes of one element of `dtype`.
fn size(dtype: DType) -> u64 {
    dtype.size_in_bytes() as u64
}

/// Device bytes of the text stage for `text_len` prompt tokens: the template's tokens plus the
/// prompt's, through one Llama layer at a time, and CLIP's `clip_len` tokens through one of its
/// layers.
pub fn text_encoder_activations(
    llama: &LlamaConfig,
    clip: &ClipTextConfig,
    text_len: usize,
    clip_len: usize,
    dtype: DType,
) -> u64 {
    let d = size(dtype);
    let seq = (DEFAULT_CROP_START + text_len) as u64;
    seq * (llama.hidden_size as u64 * 6 + llama.intermediate_size as u64 * 3) * d
        + llama.num_attention_heads as u64 * seq * seq * 4
        + clip_len as u64 * clip.intermediate_size as u64 * 4 * 4
}

/// Copies of the joint sequence `[tokens, inner]` a block's attention holds at once: the
/// streams, the modulated norm, q/k/v and the attention's output (the joined streams go once
/// normed, q/k/v before the heads are merged; a dual-stream block's joined q/k/v replace its
/// streams' one at a time), on the device as on the host (bench/RESULTS.md session 49).
const ATTENTION_COPIES: u64 = 6;

/// Copies of the joint sequence the single-stream MLP step holds beside its chunks: the streams,
/// the modulated norm and the attention's output.
const MLP_STEP_COPIES: u64 = 3;

/// The single-stream modulation's chunks (shift, scale, gate), each `[inner]`.
const SINGLE_MODULATIONS: u64 = 3;

/// Device bytes of one transformer forward: the larger of a block's joint attention and the
/// single-stream MLP step ([`single_mlp_activations`]) with the products' workspace
/// ([`joint_block_activations`]), plus the RoPE tables and the latents in f32.
pub fn transformer_activations(
    t: &HunyuanVideoTransformerConfig,
    latent: [usize; 5],
    text_len: usize,
    dtype: DType,
) -> u64 {
    let video = video_tokens(t, latent);
    let tokens = video + text_len as u64;
    let blocks = joint_block_activations(
        ATTENTION_COPIES,
        t.num_attention_heads,
        tokens as usize,
        t.inner_dim(),
        single_mlp_activations(t, tokens as usize, dtype),
        dtype,
    );
    // Cosines and sines of half a head per video token, f32.
    let rope = video * t.attention_head_dim as u64 * 4;
    let latent_bytes = latent.iter().product::<usize>() as u64 * 4 * 4;
    blocks + rope + latent_bytes
}

/// Device bytes of a single-stream block's MLP step over `tokens` joint tokens, which runs by
/// chunks of [`MLP_CHUNK_TOKENS`] rows: beside the step's inputs and its modulation, the chunks
/// done so far and one chunk's MLP with [attention; MLP] (a chunk's GELU, fused or not, and its
/// output projection hold less), or at the end the joined output and its streams apart.
pub fn single_mlp_activations(
    t: &HunyuanVideoTransformerConfig,
    tokens: usize,
    dtype: DType,
) -> u64 {
    let (inner, mlp) = (t.inner_dim() as u64, t.mlp_dim() as u64);
    let chunk = (0..tokens)
        .step_by(MLP_CHUNK_TOKENS)
        .map(|done| {
            let rows = MLP_CHUNK_TOKENS.min(tokens - done) as u64;
            done as u64 * inner + rows * (2 * mlp + inner)
        })
        .max()
        .unwrap_or(0);
    let tokens = tokens as u64;
    let held = MLP_STEP_COPIES * tokens * inner + SINGLE_MODULATIONS * inner;
    (held + chunk.max(2 * tokens * inner)) * size(dtype)
}

/// Device bytes `--fp8-matmul` adds to a forward besides the blocks' weight codes
/// ([`fp8_block_codes`]): the codes of its largest Linear input (the joint sequence for q, k and
/// v, or a chunk of [attention; MLP] rows) and a product's workspace.
pub fn fp8_matmul_activations(
    t: &HunyuanVideoTransformerConfig,
    latent: [usize; 5],
    text_len: usize,
) -> u64 {
    let (d, mlp) = (t.inner_dim() as u64, t.mlp_dim() as u64);
    let tokens = video_tokens(t, latent) + text_len as u64;
    let chunk = tokens.min(MLP_CHUNK_TOKENS as u64);
    let largest = if tokens * d >= chunk * (d + mlp) {
        (tokens, d)
    } else {
        (chunk, d + mlp)
    };
    crate::models::fp8::forward_bytes(largest)
}

/// Device bytes of each block's weight codes under `--fp8-matmul`, in execution order: none for
/// the token refiner's (exact: 256 text tokens), then the dual- and single-stream blocks'
/// ([`stream_block_codes`]).
pub fn fp8_block_codes(t: &HunyuanVideoTransformerConfig) -> Vec<u64> {
    let (dual, single) = stream_block_codes(t.inner_dim(), t.mlp_dim());
    let mut codes = vec![0; t.num_refiner_layers];
    codes.extend(vec![dual; t.num_layers]);
    codes.extend(vec![single; t.num_single_layers]);
    codes
}

/// Device bytes of the weight codes of a dual-stream block and of a single-stream block of width
/// `d` and MLP width `mlp` under `--fp8-matmul` (HunyuanVideo's and FLUX.1's blocks alike): q, k,
/// v and out of both streams and their feed-forwards; q, k, v, `proj_mlp` and `proj_out`. The
/// modulations stay exact.
pub(crate) fn stream_block_codes(d: usize, mlp: usize) -> (u64, u64) {
    let mut dual = vec![(d, d); 8];
    dual.extend([(d, mlp), (mlp, d), (d, mlp), (mlp, d)]);
    let single = [(d, d), (d, d), (d, d), (d, mlp), (d + mlp, d)];
    (weight_codes(&dual), weight_codes(&single))
}

/// Video tokens of `latent` after patching.
fn video_tokens(t: &HunyuanVideoTransformerConfig, latent: [usize; 5]) -> u64 {
    let patch = (t.patch_size_t * t.patch_size * t.patch_size).max(1);
    (latent[2] * latent[3] * latent[4] / patch) as u64
}

/// Device bytes of the modulations' pass: one block's modulations (at most 12 chunks, a
/// dual-stream block's) for up to 100 conditionings (50 steps with true CFG), and their stacked
/// copy.
pub fn modulations_activations(t: &HunyuanVideoTransformerConfig, dtype: DType) -> u64 {
    let inner = t.inner_dim() as u64;
    12 * inner * size(dtype) * 100 * 2
}

/// Device bytes of the decode of `latent` into `num_frames` frames of `height` x `width`: one
/// temporal tile (5 latent frames, 17 video frames) at full size (256x256 with `tiling`). Its
/// peak is at full resolution: the last upsampler's output and the first conv's input of the
/// last up block at the upsampled channels, that block's output at its own, plus one run of
/// frames' f32 temporaries (two, a layer working in runs of whole frames, `vae::RUN_ELEMENTS`
/// and at least `vae::MIN_RUNS` of them), beside the decoded video in `dtype` that the tiles
/// fill; or, once the maps are gone, that video beside its f32 copy. Measured on an H100 in
/// bf16 (bench/RESULTS.md session 48): 3.64, 3.65, 3.70 GiB at 17, 33 and 65 frames of 320x512
/// (planned 3.65, 3.66, 3.69), 8.97 at 33x480x848 (9.10) and 21.01 at 129x720x1280 (21.09);
/// tiled at 129x720x1280, 2.44 (an H200, session 35; planned 2.37).
pub fn vae_decode_activations(
    cfg: &HunyuanVideoVaeConfig,
    latent: [usize; 5],
    (num_frames, height, width): (u32, u32, u32),
    tiling: bool,
    dtype: DType,
) -> u64 {
    let d = size(dtype);
    let frames = (latent[2].min(5) - 1) as u64 * cfg.temporal_compression_ratio as u64 + 1;
    let tile = HunyuanVideoVaeTiling::default();
    let (h, w) = match tiling {
        true => (
            height.min(tile.tile_sample_min_height as u32),
            width.min(tile.tile_sample_min_width as u32),
        ),
        false => (height, width),
    };
    let pixels = h as u64 * w as u64;
    let (upsampled, last) = cfg.full_resolution_channels();
    let (upsampled, last) = (upsampled as u64, last as u64);
    let frame = pixels * upsampled.max(last);
    let run =
        vae::frames_per_run(frames as usize, frame as usize, vae::RUN_ELEMENTS) as u64 * frame;
    let video = num_frames as u64 * height as u64 * width as u64 * 3;
    (frames * pixels * (2 * upsampled + last) * d + 2 * run * 4 + video * d).max(video * (d + 4))
}
