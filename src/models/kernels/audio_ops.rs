//! The audio VAE's kernels (`audio_ops.cu`): BigVGAN's alias-free SnakeBeta in one launch.

use candle_core::{DType, Result, Tensor};

use crate::models::kernel_module::{item_launch, kernel_module, Arg, Module};
use crate::models::minimax_h3::audio_vae::Resampling;

static AUDIO_OPS: Module = kernel_module!("audio_ops");

/// The alias-free SnakeBeta of `x` `[B, C, L]` (f32, on CUDA): per channel `alpha` (`exp α`) and
/// `inv_beta` (`1 / (exp β + 1e-9)`), the resampling's two filters of `resampling.taps` values,
/// all f32 on `x`'s device. `[B, C, L]`.
pub(crate) fn snake_beta_resample(
    x: &Tensor,
    alpha: &Tensor,
    inv_beta: &Tensor,
    (up_filter, down_filter): (&Tensor, &Tensor),
    resampling: Resampling,
) -> Result<Tensor> {
    let (_, channels, length) = x.dims3()?;
    let operands = [x, alpha, inv_beta, up_filter, down_filter];
    if operands.iter().any(|t| t.dtype() != DType::F32)
        || alpha.elem_count() != channels
        || inv_beta.elem_count() != channels
        || up_filter.elem_count() != resampling.taps
        || down_filter.elem_count() != resampling.taps
    {
        candle_core::bail!(
            "snake_beta_resample: f32 operands, {channels} channel parameters and {}-tap filters",
            resampling.taps
        )
    }
    let x = x.contiguous()?;
    let [alpha, inv_beta, up_filter, down_filter] =
        [alpha, inv_beta, up_filter, down_filter].map(|t| t.contiguous());
    let (alpha, inv_beta, up_filter, down_filter) = (alpha?, inv_beta?, up_filter?, down_filter?);
    // SAFETY: the kernel writes every element before anything reads it.
    let y = unsafe { Tensor::empty(x.shape(), DType::F32, x.device()) }?;
    let items = x.elem_count();
    y.inplace_op1(&item_launch(
        &AUDIO_OPS,
        "snake_beta_resample_f32",
        items,
        vec![
            Arg::Tensor(Some(&x)),
            Arg::Dst,
            Arg::Tensor(Some(&alpha)),
            Arg::Tensor(Some(&inv_beta)),
            Arg::Tensor(Some(&up_filter)),
            Arg::Tensor(Some(&down_filter)),
            Arg::Int(channels as i32),
            Arg::Long(length as i64),
            Arg::Long(items as i64),
            Arg::Int(resampling.ratio as i32),
            Arg::Int(resampling.taps as i32),
            Arg::Int(resampling.pad_up() as i32),
            Arg::Int(resampling.crop_left() as i32),
            Arg::Int(resampling.down_left() as i32),
        ],
    ))?;
    Ok(y)
}
