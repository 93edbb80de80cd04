//! Classifier-free guidance as diffusers combines the two predictions, one formula for every
//! family that guides (Wan, LTX-Video, CogVideoX, HunyuanVideo's real CFG).

use candle_core::{Result, Tensor};

/// `uncond + scale · (cond − uncond)`, in the predictions' dtype.
pub fn guide(uncond: &Tensor, cond: &Tensor, scale: f64) -> Result<Tensor> {
    uncond + ((cond - uncond)? * scale)?
}

/// [`guide`] over one batched `[uncond; cond]` prediction.
pub fn guide_batched(prediction: &Tensor, scale: f64) -> Result<Tensor> {
    guide(
        &prediction.narrow(0, 0, 1)?,
        &prediction.narrow(0, 1, 1)?,
        scale,
    )
}
