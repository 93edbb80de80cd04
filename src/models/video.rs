//! What planning and the reports read of a video model's configs whatever its family: the
//! latent grid its VAE makes of a video size, and its DiT's size.

use crate::models::step_cache::{AttentionModules, HookedBlocks};
use candle_core::DType;

/// The latent grid `[F', H', W']` of a video size under a causal video VAE that compresses time
/// `temporal` times and space `spatial` times: the first frame alone, then `temporal` frames
/// to a latent frame.
pub fn causal_latent_grid(
    num_frames: u32,
    height: u32,
    width: u32,
    temporal: usize,
    spatial: usize,
) -> [usize; 3] {
    let (t, s) = (temporal.max(1), spatial.max(1));
    [
        (num_frames as usize).saturating_sub(1) / t + 1,
        height as usize / s,
        width as usize / s,
    ]
}

/// A video VAE's config.
pub trait VideoVae {
    /// How many frames, and pixels along a side, one latent stands for: `(temporal, spatial)`.
    fn compression(&self) -> (usize, usize);

    /// The latent grid `[F', H', W']` of a video size: a causal VAE's
    /// ([`causal_latent_grid`]) unless the VAE counts its frames otherwise.
    fn latent_grid(&self, num_frames: u32, height: u32, width: u32) -> [usize; 3] {
        let (temporal, spatial) = self.compression();
        causal_latent_grid(num_frames, height, width, temporal, spatial)
    }
}

/// What planning and the reports read of a video DiT's config.
#[derive(Clone, Copy, Debug)]
pub struct DitShape {
    /// Its transformer blocks (the reports' `transformer_layers`).
    pub num_layers: usize,
    /// The width of its hidden states (the reports' `transformer_inner_dim`).
    pub hidden_dim: usize,
    /// The channels of the latents it denoises.
    pub in_channels: usize,
    /// Whether it takes latents `[1, F', C, H', W']` (CogVideoX) rather than `[1, C, F', H', W']`.
    pub frames_first: bool,
}

impl DitShape {
    /// A DiT of `num_layers` blocks of width `hidden_dim` over `in_channels` latent channels,
    /// frames after channels.
    pub fn of(num_layers: usize, hidden_dim: usize, in_channels: usize) -> Self {
        let frames_first = false;
        DitShape {
            num_layers,
            hidden_dim,
            in_channels,
            frames_first,
        }
    }
}

/// A video DiT's config.
pub trait VideoDit {
    /// Its sizes as planning reads them.
    fn dit_shape(&self) -> DitShape;

    /// The shape of the latents it denoises for a latent grid `[F', H', W']`.
    fn latent_shape(&self, [f, h, w]: [usize; 3]) -> [usize; 5] {
        let DitShape {
            in_channels: c,
            frames_first,
            ..
        } = self.dit_shape();
        if frames_first {
            [1, f, c, h, w]
        } else {
            [1, c, f, h, w]
        }
    }
}

/// A video DiT's activation estimate, for planning.
pub trait DenoiseActivations {
    /// Device bytes one denoising forward over `batch` prompts (2: the guided `[negative;
    /// positive]` pair, 1 without guidance) keeps alive at its peak (the weights counted
    /// apart), for a latent grid `[F', H', W']` and prompts of `text_len` tokens.
    fn denoise_activations(
        &self,
        grid: [usize; 3],
        text_len: usize,
        batch: usize,
        dtype: DType,
    ) -> u64;

    /// Device bytes the same forward holds throughout beside its streams: tables, text.
    fn forward_held(&self, grid: [usize; 3], text_len: usize, batch: usize, dtype: DType) -> u64;

    /// Device bytes of the same forward while its outer part (embedders, output head) computes
    /// apart from the blocks, an outer part moved in per use: the batch's block state entering
    /// the blocks and the head's normed copy of it, beside what the forward holds throughout.
    fn outer_activations(
        &self,
        grid: [usize; 3],
        text_len: usize,
        batch: usize,
        dtype: DType,
    ) -> u64 {
        let (tokens, dim) = self.block_state(grid, text_len);
        (2 * batch * tokens * dim * dtype.size_in_bytes()) as u64
            + self.forward_held(grid, text_len, batch, dtype)
    }

    /// The tokens (video and text) and width of one prompt's block state: what its blocks
    /// thread, of which a step cache (`--cache`) holds copies through the loop.
    fn block_state(&self, grid: [usize; 3], text_len: usize) -> (usize, usize);

    /// The attention modules, by PAB's kinds, whose outputs the DiT hands a step cache that
    /// reaches inside its blocks (a block state each): none where it hands none.
    fn attention_modules(&self) -> AttentionModules {
        AttentionModules::default()
    }

    /// The blocks diffusers' cache hooks see, by their names.
    fn hooked_blocks(&self) -> HookedBlocks;

    /// This config with its blocks' Linears in fp8 where `on` (`--fp8-matmul`).
    fn in_fp8(&self, on: bool) -> Self;

    /// What `--fp8-matmul` adds to a forward of `batch` prompts over `grid` besides the blocks'
    /// weight codes: its largest Linear input's codes and a product's workspace
    /// ([`crate::models::fp8::forward_bytes`]).
    fn fp8_activations(&self, grid: [usize; 3], text_len: usize, batch: usize) -> u64;

    /// Each block's weight codes under `--fp8-matmul`, in execution order.
    fn fp8_block_codes(&self) -> Vec<u64>;
}

/// A video VAE's activation estimate, for planning.
pub trait DecodeActivations {
    /// Device bytes the decode of a latent grid `[F', H', W']` keeps alive at its peak (the
    /// weights counted apart), in tiles where `tiled` (`--vae-tiling`) or where the VAE has no
    /// other decode.
    fn decode_activations(&self, grid: [usize; 3], tiled: bool, dtype: DType) -> u64;
}
