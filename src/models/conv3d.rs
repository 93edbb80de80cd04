//! The 3D convolution the causal-conv VAEs share: through cuDNN where it is loaded (CUDA), so
//! that a VAE layer is one implicit-GEMM call instead of a sum of 2D convolutions; `None`
//! elsewhere, and the caller runs its own path unchanged.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{Device, Result, Tensor};

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
/// cuDNN, `None` where it is not [`accelerated`], an error where cuDNN fails (callers run it
/// inside [`or_fallback`]).
pub fn conv3d(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
) -> Result<Option<Tensor>> {
    conv3d_math(x, w, stride, padding, tf32())
}

/// [`conv3d`] with TF32 math allowed or not, whatever [`set_tf32`] said.
fn conv3d_math(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 3],
    padding: [usize; 3],
    tf32: bool,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if let Some(api) = crate::models::cudnn::api().filter(|_| x.device().is_cuda()) {
        let op = crate::models::cudnn::conv::Conv3d {
            api,
            stride,
            padding,
            tf32,
        };
        return aligned(x)?.apply_op2_no_bwd(&aligned(w)?, &op).map(Some);
    }
    let _ = (x, w, stride, padding, tf32);
    Ok(None)
}

/// Runs `f`, a layer's whole-kernel path (its input padding, [`conv3d`] and the bias): an error
/// (cuDNN declining a shape, or no memory for the padded copy) becomes one note on stderr and
/// `None`, and the caller runs its own path instead.
pub fn or_fallback<T>(f: impl FnOnce() -> Result<Option<T>>) -> Option<T> {
    static NOTED: AtomicBool = AtomicBool::new(false);
    match f() {
        Ok(y) => y,
        Err(e) => {
            if !NOTED.swap(true, Ordering::Relaxed) {
                eprintln!("note: cuDNN conv3d failed ({e}); vidgen's own convolution runs");
            }
            None
        }
    }
}

/// `t` contiguous and starting on a 16-byte boundary (what cuDNN's vectorized kernels assume).
#[cfg(feature = "cuda")]
fn aligned(t: &Tensor) -> Result<Tensor> {
    let misaligned = !(t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16);
    if misaligned {
        t.force_contiguous()
    } else {
        t.contiguous()
    }
}

/// A 3D kernel `[C_out, C_in, kt, kh, kw]` as a causal conv keeps it: whole where [`conv3d`]
/// runs (CUDA with cuDNN), else split once into its temporal taps for the path that sums 2D
/// convolutions (the taps are copies, so only one form is held).
#[derive(Debug, Clone)]
pub enum Kernel3d {
    Whole(Tensor),
    /// `weight[:, :, k]` for each temporal tap `k`, each `[C_out, C_in, kh, kw]`, contiguous.
    Taps(Vec<Tensor>),
}

impl Kernel3d {
    /// The form the device computes with.
    pub fn new(weight: Tensor) -> Result<Self> {
        if accelerated(weight.device()) {
            Ok(Self::Whole(weight))
        } else {
            Ok(Self::Taps(split_taps(&weight)?))
        }
    }

    /// The whole kernel, where [`conv3d`] may run it.
    pub fn whole(&self) -> Option<&Tensor> {
        match self {
            Self::Whole(w) => Some(w),
            Self::Taps(_) => None,
        }
    }

    /// The temporal taps (split on the fly from a whole kernel, the path of a shape cuDNN
    /// declined).
    pub fn taps(&self) -> Result<Cow<'_, [Tensor]>> {
        match self {
            Self::Whole(w) => Ok(Cow::Owned(split_taps(w)?)),
            Self::Taps(taps) => Ok(Cow::Borrowed(taps)),
        }
    }

    /// Temporal kernel size.
    pub fn kt(&self) -> Result<usize> {
        match self {
            Self::Whole(w) => w.dim(2),
            Self::Taps(taps) => Ok(taps.len()),
        }
    }

    /// `[C_out, C_in, kh, kw]` of one tap.
    pub fn tap_dims(&self) -> Result<(usize, usize, usize, usize)> {
        match self {
            Self::Whole(w) => {
                let (o, i, _, h, w) = w.dims5()?;
                Ok((o, i, h, w))
            }
            Self::Taps(taps) => match taps.first() {
                Some(t) => t.dims4(),
                None => candle_core::bail!("a 3D kernel without temporal taps"),
            },
        }
    }
}

/// The temporal taps of a `[C_out, C_in, kt, kh, kw]` kernel.
fn split_taps(weight: &Tensor) -> Result<Vec<Tensor>> {
    (0..weight.dim(2)?)
        .map(|k| weight.narrow(2, k, 1)?.squeeze(2)?.contiguous())
        .collect()
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    use super::*;

    /// cuDNN's convolution in exact f32 against the tap sum of 2D convolutions.
    #[test]
    fn cudnn_conv3d_matches_tap_sum() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: cuDNN conv3d test skipped");
            return Ok(());
        };
        if !accelerated(&dev) {
            eprintln!("no cuDNN: cuDNN conv3d test skipped");
            return Ok(());
        }
        let x = Tensor::randn(0f32, 1f32, (2, 5, 4, 9, 11), &dev)?;
        let w = Tensor::randn(0f32, 1f32, (6, 5, 3, 3, 3), &dev)?;
        let y = conv3d_math(&x, &w, [1, 1, 1], [0, 1, 1], false)?;
        let y = y.expect("cuDNN ran the convolution");
        let taps = split_taps(&w)?;
        let mut frames = Vec::new();
        for o in 0..2 {
            let mut acc = x
                .narrow(2, o, 1)?
                .squeeze(2)?
                .contiguous()?
                .conv2d(&taps[0], 1, 1, 1, 1)?;
            for (k, tap) in taps.iter().enumerate().skip(1) {
                let frame = x.narrow(2, o + k, 1)?.squeeze(2)?.contiguous()?;
                acc = (acc + frame.conv2d(tap, 1, 1, 1, 1)?)?;
            }
            frames.push(acc);
        }
        let reference = Tensor::stack(&frames, 2)?;
        assert_eq!(y.dims(), reference.dims());
        let err = (y - reference)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(err < 1e-4, "max |cuDNN - taps| {err:.2e}");
        Ok(())
    }

    /// A convolution large enough that its algorithm is chosen by timing (TF32 and exact math
    /// tried): exact f32 stays exact, TF32 within TF32's rounding, against the tap sum.
    #[test]
    fn timed_cudnn_conv3d_matches_tap_sum() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: cuDNN conv3d test skipped");
            return Ok(());
        };
        if !accelerated(&dev) {
            eprintln!("no cuDNN: cuDNN conv3d test skipped");
            return Ok(());
        }
        // 2 * 96 * 96 * 27 * (2 * 94 * 94) = 17.6 GFLOP: above the timing threshold.
        let x = Tensor::randn(0f32, 1f32, (1, 96, 4, 96, 96), &dev)?;
        let w = Tensor::randn(0f32, 0.02f32, (96, 96, 3, 3, 3), &dev)?;
        let taps = split_taps(&w)?;
        let mut frames = Vec::new();
        for o in 0..2 {
            let mut acc: Option<Tensor> = None;
            for (k, tap) in taps.iter().enumerate() {
                let frame = x.narrow(2, o + k, 1)?.squeeze(2)?.contiguous()?;
                let y = frame.conv2d(tap, 0, 1, 1, 1)?;
                acc = Some(match acc {
                    Some(a) => (a + y)?,
                    None => y,
                });
            }
            frames.push(acc.expect("three taps"));
        }
        let reference = Tensor::stack(&frames, 2)?;
        let scale = reference.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        for (tf32, tolerance) in [(false, 1e-5f32), (true, 5e-3)] {
            let y = conv3d_math(&x, &w, [1, 1, 1], [0, 0, 0], tf32)?;
            let y = y.expect("cuDNN ran the convolution");
            let err = (y - &reference)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(
                err / scale < tolerance,
                "tf32 {tf32}: max |cuDNN - taps| {err:.2e} of {scale:.2e}"
            );
        }
        Ok(())
    }
}
