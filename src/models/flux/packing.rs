//! FluxPipeline's 2x2 packing of the VAE's latents into transformer tokens
//! (`_pack_latents` / `_unpack_latents`): `[B, C, h, w]` <-> `[B, (h/2)·(w/2), 4C]`, token
//! channel `c·4 + dy·2 + dx`, tokens row-major over the `h/2 x w/2` grid: the video patches of
//! [`crate::models::patches`] of one frame.

use crate::models::patches::{patchify, unpatchify};
use candle_core::{Result, Tensor};

/// The patch of one frame by 2x2 latent pixels.
const PATCH: [usize; 3] = [1, 2, 2];

/// `[B, C, h, w]` (h, w even) -> `[B, (h/2)·(w/2), 4C]`.
pub fn pack(latents: &Tensor) -> Result<Tensor> {
    patchify(&latents.unsqueeze(2)?, PATCH)
}

/// `[B, (h/2)·(w/2), 4C]` -> `[B, C, h, w]`, for a latent of `h x w`.
pub fn unpack(tokens: &Tensor, h: usize, w: usize) -> Result<Tensor> {
    if !h.is_multiple_of(2) || !w.is_multiple_of(2) {
        candle_core::bail!("a packed latent of {h}x{w}: its sides are even");
    }
    unpatchify(tokens, [1, h / 2, w / 2], PATCH)?.squeeze(2)
}
