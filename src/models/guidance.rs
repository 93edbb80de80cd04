//! Classifier-free guidance as diffusers combines the two predictions, one formula for every
//! family that guides (Wan, LTX-Video, CogVideoX, HunyuanVideo's real CFG).

use candle_core::{Result, Tensor};

/// `uncond + scale · (cond − uncond)`, in the predictions' dtype.
pub fn guide(uncond: &Tensor, cond: &Tensor, scale: f64) -> Result<Tensor> {
    uncond + ((cond - uncond)? * scale)?
}

/// The latents once for each of a guidance batch's `rows` (diffusers'
/// `torch.cat([latents] * 2)` when guided): one forward for [negative; positive].
pub fn batch_input(latents: &Tensor, rows: usize) -> Result<Tensor> {
    Tensor::cat(&vec![latents; rows], 0)
}

/// [`guide`] over one batched `[uncond; cond]` prediction.
pub fn guide_batched(prediction: &Tensor, scale: f64) -> Result<Tensor> {
    guide(
        &prediction.narrow(0, 0, 1)?,
        &prediction.narrow(0, 1, 1)?,
        scale,
    )
}

/// [`guide_batched`] over a guided prediction (a batch of two); an unguided one (one row) as it
/// is.
pub fn guide_if_batched(prediction: Tensor, scale: f64) -> Result<Tensor> {
    match prediction.dim(0)? > 1 {
        true => guide_batched(&prediction, scale),
        false => Ok(prediction),
    }
}
