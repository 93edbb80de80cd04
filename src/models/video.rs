//! What planning and the reports read of a video model's configs whatever its family: the
//! latent grid its VAE makes of a video size, and its DiT's size.

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

/// A video DiT's config.
pub trait VideoDit {
    /// Its transformer blocks (the reports' `transformer_layers`).
    fn num_layers(&self) -> usize;
    /// The width of its hidden states (the reports' `transformer_inner_dim`).
    fn hidden_dim(&self) -> usize;
    /// The channels of the latents it denoises.
    fn in_channels(&self) -> usize;

    /// The shape of the latents it denoises for a latent grid `[F', H', W']`: `[1, C, F', H',
    /// W']` unless it takes frames before channels.
    fn latent_shape(&self, [f, h, w]: [usize; 3]) -> [usize; 5] {
        [1, self.in_channels(), f, h, w]
    }
}

/// A video DiT's activation estimate, for planning.
pub trait DenoiseActivations {
    /// Device bytes one denoising forward over the guided `[negative; positive]` pair keeps
    /// alive at its peak (the weights counted apart), for a latent grid `[F', H', W']` and
    /// prompts of `text_len` tokens.
    fn denoise_activations(&self, grid: [usize; 3], text_len: usize, dtype: DType) -> u64;
}

/// A video VAE's activation estimate, for planning.
pub trait DecodeActivations {
    /// Device bytes the decode of a latent grid `[F', H', W']` keeps alive at its peak (the
    /// weights counted apart), in tiles where `tiled` (`--vae-tiling`) or where the VAE has no
    /// other decode.
    fn decode_activations(&self, grid: [usize; 3], tiled: bool, dtype: DType) -> u64;
}
