//! The 3D convolution the causal-conv VAEs share: through cuDNN where it is loaded (CUDA), so
//! that a VAE layer is one implicit-GEMM call instead of a sum of 2D convolutions; `None`
//! elsewhere, and the caller runs its own path unchanged.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{Device, Tensor};

/// Whether f32 convolutions may use TF32 tensor-core math (PyTorch's default for convolutions).
static TF32: AtomicBool = AtomicBool::new(true);

/// Allows (the default) or forbids TF32 math in f32 convolutions (`--no-tf32`: exact f32).
pub fn set_tf32(allowed: bool) {
    TF32.store(allowed, Ordering::Relaxed);
}

/// Whether f32 convolutions may use TF32 math.
pub fn tf32() -> bool {
    TF32.load(Ordering::Relaxed)
}

/// Whether [`conv3d`] computes on `device` (CUDA with cuDNN loaded); the causal convs then keep
/// their kernel whole instead of split into temporal taps.
pub fn accelerated(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return crate::models::cudnn::api().is_some();
    }
    let _ = device;
    false
}

/// Cross-correlation of `x` `[B, C_in, T, H, W]` by `w` `[C_out, C_in, kt, kh, kw]` with
/// `stride` and zero `padding` (each t, h, w), no bias: `Some([B, C_out, T', H', W'])` through
/// cuDNN, or `None` where it is not [`accelerated`] or fails (one note on stderr).
pub fn conv3d(x: &Tensor, w: &Tensor, stride: [usize; 3], padding: [usize; 3]) -> Option<Tensor> {
    #[cfg(feature = "cuda")]
    if accelerated(x.device()) {
        let api = crate::models::cudnn::api()?;
        let op = crate::models::cudnn::conv::Conv3d {
            api,
            stride,
            padding,
            tf32: tf32(),
        };
        let run = || x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &op);
        return match run() {
            Ok(y) => Some(y),
            Err(e) => {
                crate::models::cudnn::note_once(
                    "conv-failed",
                    &format!("cuDNN conv3d failed ({e}); vidgen's own convolution runs"),
                );
                None
            }
        };
    }
    let _ = (x, w, stride, padding);
    None
}
