//! FluxPipeline's 2x2 packing of the VAE's latents into transformer tokens
//! (`_pack_latents` / `_unpack_latents`): `[B, C, h, w]` <-> `[B, (h/2)·(w/2), 4C]`, token
//! channel `c·4 + dy·2 + dx`, tokens row-major over the `h/2 x w/2` grid.

use candle_core::{Result, Tensor};

/// `[B, C, h, w]` (h, w even) -> `[B, (h/2)·(w/2), 4C]`.
pub fn pack(latents: &Tensor) -> Result<Tensor> {
    let (b, c, h, w) = latents.dims4()?;
    latents
        .reshape(vec![b, c, h / 2, 2, w / 2, 2])?
        .permute(vec![0, 2, 4, 1, 3, 5])?
        .reshape((b, (h / 2) * (w / 2), c * 4))
}

/// `[B, (h/2)·(w/2), 4C]` -> `[B, C, h, w]`, for a latent of `h x w`.
pub fn unpack(tokens: &Tensor, h: usize, w: usize) -> Result<Tensor> {
    let (b, n, channels) = tokens.dims3()?;
    if n != (h / 2) * (w / 2) || !channels.is_multiple_of(4) {
        candle_core::bail!("{n} tokens of {channels} channels are not a packed {h}x{w} latent");
    }
    tokens
        .reshape(vec![b, h / 2, w / 2, channels / 4, 2, 2])?
        .permute(vec![0, 3, 1, 4, 2, 5])?
        .reshape((b, channels / 4, h, w))
}
