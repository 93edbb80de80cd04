//! Video latents as patch tokens and back: the layout of every DiT's patch embedding (a
//! convolution whose kernel is its stride, computed as a matmul over flattened patches) and of
//! the pipelines that pack latents into tokens (LTX-Video's `_pack_latents`, FLUX.1's 2x2
//! packing with one frame, MiniMax H3's rows); and the checks that latents and text fit a DiT
//! before it patches them.

use candle_core::{Result, Tensor};

/// The batch and the grid of whole `patch`es of `[B, C, F, H, W]` latents for a transformer that
/// takes `channels`; an error naming the mismatch where the channels differ or a side holds no
/// whole patch.
pub fn token_grid(
    latents: &Tensor,
    channels: usize,
    patch: [usize; 3],
) -> Result<(usize, [usize; 3])> {
    let (b, c, f, h, w) = latents.dims5()?;
    if c != channels {
        candle_core::bail!("latents have {c} channels, the transformer expects {channels}");
    }
    let [pt, ph, pw] = patch;
    if patch.contains(&0) || f < pt || h < ph || w < pw {
        candle_core::bail!("latents [{f}, {h}, {w}] are smaller than one {pt}x{ph}x{pw} patch");
    }
    Ok((b, [f / pt, h / ph, w / pw]))
}

/// The length of `[B, L, dim]` text states for a batch of `batch`; an error naming the config
/// key of `dim` where they do not fit.
pub fn text_len(text: &Tensor, batch: usize, (key, dim): (&str, usize)) -> Result<usize> {
    let (b, len, d) = text.dims3()?;
    if b != batch || d != dim {
        candle_core::bail!(
            "encoder_hidden_states {:?} do not match batch {batch} and {key} {dim}",
            text.dims()
        );
    }
    Ok(len)
}

/// `[B, C, F, H, W]` latents -> `[B, F/pt · H/ph · W/pw, C·pt·ph·pw]` tokens for the patch
/// `[pt, ph, pw]`: frame-major then row-major, each token's values in (c, pt, ph, pw) order.
/// The sizes must be whole patches (a strided convolution's caller narrows them first).
pub fn patchify(latents: &Tensor, patch: [usize; 3]) -> Result<Tensor> {
    let (b, c, f, h, w) = latents.dims5()?;
    let [pt, ph, pw] = patch;
    if patch.contains(&0) || f % pt != 0 || h % ph != 0 || w % pw != 0 {
        candle_core::bail!("latents [{f}, {h}, {w}] do not split into {pt}x{ph}x{pw} patches");
    }
    let grid = [f / pt, h / ph, w / pw];
    latents
        .reshape(vec![b, c, grid[0], pt, grid[1], ph, grid[2], pw])?
        .permute(vec![0, 2, 4, 6, 1, 3, 5, 7])?
        .reshape((b, grid.iter().product::<usize>(), c * pt * ph * pw))
}

/// The whole patches of `latents` as [`patchify`]'s tokens: frames, rows and columns past the
/// last whole patch dropped, as a convolution whose stride is its kernel drops them.
pub fn whole_patches(latents: &Tensor, patch: [usize; 3]) -> Result<Tensor> {
    let (_, _, f, h, w) = latents.dims5()?;
    let [pt, ph, pw] = patch;
    if patch.contains(&0) {
        candle_core::bail!("a patch of {pt}x{ph}x{pw}");
    }
    let whole = latents
        .narrow(2, 0, f - f % pt)?
        .narrow(3, 0, h - h % ph)?
        .narrow(4, 0, w - w % pw)?;
    patchify(&whole, patch)
}

/// Inverse of [`patchify`]: `[B, f·h·w, C·pt·ph·pw]` tokens of the grid `[f, h, w]` (in
/// patches) -> `[B, C, f·pt, h·ph, w·pw]`.
pub fn unpatchify(tokens: &Tensor, grid: [usize; 3], patch: [usize; 3]) -> Result<Tensor> {
    tokens_to_video(tokens, grid, patch, false)
}

/// [`unpatchify`] of tokens whose values are in (pt, ph, pw, c) order, channels last (Wan's,
/// Allegro's, Latte's and Mochi-1's output projections).
pub fn unpatchify_channels_last(
    tokens: &Tensor,
    grid: [usize; 3],
    patch: [usize; 3],
) -> Result<Tensor> {
    tokens_to_video(tokens, grid, patch, true)
}

fn tokens_to_video(
    tokens: &Tensor,
    grid: [usize; 3],
    patch: [usize; 3],
    channels_last: bool,
) -> Result<Tensor> {
    let (b, n, d) = tokens.dims3()?;
    let [f, h, w] = grid;
    let [pt, ph, pw] = patch;
    let values = pt * ph * pw;
    if n != f * h * w || values == 0 || d % values != 0 {
        candle_core::bail!(
            "{n} tokens of {d} values are not a {f}x{h}x{w} grid of {pt}x{ph}x{pw} patches"
        );
    }
    let c = d / values;
    let (split, order) = match channels_last {
        false => (
            vec![b, f, h, w, c, pt, ph, pw],
            vec![0, 4, 1, 5, 2, 6, 3, 7],
        ),
        true => (
            vec![b, f, h, w, pt, ph, pw, c],
            vec![0, 7, 1, 4, 2, 5, 3, 6],
        ),
    };
    tokens
        .reshape(split)?
        .permute(order)?
        .reshape((b, c, f * pt, h * ph, w * pw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A token holds its patch's values in (c, pt, ph, pw) order, tokens frame-major then
    /// row-major; unpatchify puts every value back.
    #[test]
    fn tokens_hold_their_patch_and_come_back_whole() -> Result<()> {
        let (c, f, h, w) = (3, 4, 6, 4);
        let latents = Tensor::arange(0f32, (2 * c * f * h * w) as f32, &Device::Cpu)?
            .reshape((2, c, f, h, w))?;
        let patch = [2, 3, 2];
        let tokens = patchify(&latents, patch)?;
        assert_eq!(tokens.dims(), [2, 2 * 2 * 2, c * 12]);
        let at = |b: usize, c: usize, t: usize, y: usize, x: usize| -> f32 {
            ((((b * 3 + c) * f + t) * h + y) * w + x) as f32
        };
        // Batch 1, the token of patch (frame 1, row 0, column 1): (1·2 + 0)·2 + 1; its value
        // (c 2, pt 1, ph 2, pw 0): ((2·2 + 1)·3 + 2)·2 + 0.
        let (token, value) = (5, 34);
        let got = tokens.get(1)?.get(token)?.get(value)?.to_scalar::<f32>()?;
        assert_eq!(got, at(1, 2, 2 + 1, 2, 2));
        let back = unpatchify(&tokens, [2, 2, 2], patch)?;
        assert_eq!(
            back.flatten_all()?.to_vec1::<f32>()?,
            latents.flatten_all()?.to_vec1::<f32>()?
        );
        // The same tokens with each token's values reordered to (pt, ph, pw, c).
        let channels_last = tokens
            .reshape(vec![2, 8, c, 2, 3, 2])?
            .permute(vec![0, 1, 3, 4, 5, 2])?
            .reshape((2, 8, c * 12))?;
        let back = unpatchify_channels_last(&channels_last, [2, 2, 2], patch)?;
        assert_eq!(
            back.flatten_all()?.to_vec1::<f32>()?,
            latents.flatten_all()?.to_vec1::<f32>()?
        );
        Ok(())
    }

    #[test]
    fn sizes_that_are_not_whole_patches_are_refused() {
        let latents =
            Tensor::zeros((1, 2, 3, 4, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = patchify(&latents, [2, 2, 2]).unwrap_err().to_string();
        assert!(err.contains("do not split into 2x2x2 patches"), "{err}");
        let tokens = Tensor::zeros((1, 5, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = unpatchify(&tokens, [1, 2, 2], [1, 2, 2])
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a 1x2x2 grid"), "{err}");
    }
}
