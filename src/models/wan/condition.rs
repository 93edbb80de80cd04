//! The image conditioning of the Wan image-to-video pipelines, as pure functions of the image,
//! the VAE and the sizes: diffusers' `VideoProcessor.preprocess` for one image, then
//! `WanImageToVideoPipeline.prepare_latents` in its two forms:
//!
//! - Wan2.1 I2V (and Wan2.2 I2V-A14B): the image followed by `num_frames - 1` grey frames,
//!   encoded (`mode()`), normalised, behind a 4-channel first-frame mask:
//!   [`image_condition`] -> `[B, 4 + z_dim, F, h, w]`, concatenated after the noise channels
//!   at every step (`cat([latents, condition], dim=1)`).
//! - Wan2.2 TI2V (`expand_timesteps`): the image alone, encoded and normalised
//!   ([`first_frame_condition`] -> `[B, z_dim, 1, h, w]`), written over latent frame 0 at every
//!   step and after the loop ([`replace_first_frame`]), whose tokens get timestep 0
//!   ([`per_token_timesteps`]).

use candle_core::{bail, DType, Device, Result, Tensor};
use image::RgbImage;

use super::vae::AutoencoderKLWan;
use crate::models::clip::image_processor::{resize_like_pil, PilFilter};

/// diffusers' `VideoProcessor.preprocess(image, height, width)` for one RGB image: sizes
/// rounded down to multiples of `vae_scale_factor` (the VAE's spatial factor), PIL Lanczos
/// resize when the image has another size, `[0, 1]` in f32, then `2x - 1`. Returns
/// `[1, 3, H, W]` f32.
pub fn preprocess_image(
    img: &RgbImage,
    height: usize,
    width: usize,
    vae_scale_factor: usize,
    device: &Device,
) -> Result<Tensor> {
    let f = vae_scale_factor.max(1);
    let (h, w) = (height - height % f, width - width % f);
    if h == 0 || w == 0 {
        bail!("image preprocessing: {height}x{width} is smaller than the VAE factor {f}")
    }
    let img = resize_like_pil(img, w as u32, h as u32, PilFilter::Lanczos);
    let mut data = vec![0f32; 3 * h * w];
    for (x, y, p) in img.enumerate_pixels() {
        for c in 0..3 {
            // np.float32(pixel) / 255.0 in f32, then 2x - 1 in f32.
            let v = p[c] as f32 / 255.0;
            data[c * h * w + y as usize * w + x as usize] = 2.0 * v - 1.0;
        }
    }
    Tensor::from_vec(data, (1, 3, h, w), device)
}

/// Latent frames of a `num_frames` video (`(num_frames - 1) / temporal + 1`).
pub fn latent_frames(num_frames: usize, temporal: usize) -> usize {
    (num_frames.saturating_sub(1)) / temporal.max(1) + 1
}

/// Encodes `video` `[B, 3, T, H, W]` and returns the normalised mode `(mean - latents_mean) *
/// (1 / latents_std)` in `dtype` (the transformer's), on the VAE's device.
fn encode_normalized(vae: &AutoencoderKLWan, video: &Tensor, dtype: DType) -> Result<Tensor> {
    let (mean, _) = vae.encode(video)?;
    vae.normalize(&mean.to_dtype(dtype)?)
}

/// Wan2.1 I2V's condition for `image` `[1, 3, H, W]` in [-1, 1] (from [`preprocess_image`]):
/// `cat([mask, latent], dim=1)`, `[batch, temporal + z_dim, F, H/s, W/s]` in `dtype`, where
/// `latent` is the normalised VAE mode of `[image, zeros x (num_frames - 1)]` and `mask`
/// ([`first_frame_mask_channels`]) marks latent frame 0. `num_frames` must be `1 + 4k`.
pub fn image_condition(
    vae: &AutoencoderKLWan,
    image: &Tensor,
    num_frames: usize,
    batch: usize,
    dtype: DType,
) -> Result<Tensor> {
    let (b, c, h, w) = image.dims4()?;
    let temporal = vae.config().scale_factor_temporal();
    if b != 1 || num_frames == 0 || !(num_frames - 1).is_multiple_of(temporal) {
        bail!(
            "image condition: one image and 1 + {temporal}k frames expected, got {:?} and {num_frames}",
            image.dims()
        )
    }
    let image = image.to_dtype(vae.dtype())?;
    let video = Tensor::cat(
        &[
            image.unsqueeze(2)?,
            Tensor::zeros((1, c, num_frames - 1, h, w), image.dtype(), image.device())?,
        ],
        2,
    )?;
    let latent = encode_normalized(vae, &video, dtype)?.repeat((batch, 1, 1, 1, 1))?;
    let (_, _, frames, lh, lw) = latent.dims5()?;
    let mask = first_frame_mask_channels(batch, frames, temporal, (lh, lw), latent.device())?
        .to_dtype(dtype)?;
    Tensor::cat(&[mask, latent], 1)
}

/// The `[batch, temporal, frames, h, w]` mask of Wan2.1 I2V: diffusers marks video frame 0
/// (repeated `temporal` times) with 1 and every other video frame with 0, then views the
/// `temporal * frames` video frames as `temporal` channels per latent frame: all ones on latent
/// frame 0, zeros elsewhere.
pub fn first_frame_mask_channels(
    batch: usize,
    frames: usize,
    temporal: usize,
    (h, w): (usize, usize),
    device: &Device,
) -> Result<Tensor> {
    let ones = Tensor::ones((batch, temporal, 1, h, w), DType::F32, device)?;
    if frames == 1 {
        return Ok(ones);
    }
    let zeros = Tensor::zeros((batch, temporal, frames - 1, h, w), DType::F32, device)?;
    Tensor::cat(&[ones, zeros], 2)
}

/// Wan2.2 TI2V's condition: the normalised VAE mode of `image` `[1, 3, H, W]` (one frame),
/// repeated to `[batch, z_dim, 1, H/s, W/s]`, in `dtype`.
pub fn first_frame_condition(
    vae: &AutoencoderKLWan,
    image: &Tensor,
    batch: usize,
    dtype: DType,
) -> Result<Tensor> {
    let image = image.to_dtype(vae.dtype())?.unsqueeze(2)?;
    encode_normalized(vae, &image, dtype)?.repeat((batch, 1, 1, 1, 1))
}

/// Wan2.2 TI2V's `first_frame_mask` `[1, 1, frames, h, w]` in `dtype`: 0 on latent frame 0,
/// 1 elsewhere.
pub fn first_frame_mask(
    frames: usize,
    (h, w): (usize, usize),
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let zeros = Tensor::zeros((1, 1, 1, h, w), dtype, device)?;
    if frames <= 1 {
        return Ok(zeros);
    }
    Tensor::cat(
        &[
            zeros,
            Tensor::ones((1, 1, frames - 1, h, w), dtype, device)?,
        ],
        2,
    )
}

/// `(1 - mask) * condition + mask * latents` (diffusers' expression, in the latents' dtype):
/// latent frame 0 becomes the condition, the rest stays the latents.
pub fn replace_first_frame(latents: &Tensor, condition: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let mask = mask.to_dtype(latents.dtype())?;
    let keep = mask.affine(-1.0, 1.0)?;
    keep.broadcast_mul(&condition.to_dtype(latents.dtype())?)?
        .broadcast_add(&mask.broadcast_mul(latents)?)
}

/// `expand_timesteps`' per-token timesteps `[batch, F * (h / ph) * (w / pw)]` (f32):
/// `mask[0][0][:, ::ph, ::pw] * t` flattened in (frame, row, column) order, the same for every
/// batch entry. `mask` is [`first_frame_mask`] (I2V) or ones (T2V); `patch` = the
/// transformer's (ph, pw) (diffusers hard-codes 2, the value of every Wan checkpoint).
pub fn per_token_timesteps(
    t: f64,
    mask: &Tensor,
    batch: usize,
    (ph, pw): (usize, usize),
) -> Result<Tensor> {
    let (_, _, frames, h, w) = mask.dims5()?;
    if ph == 0 || pw == 0 {
        bail!("per-token timesteps: patch ({ph}, {pw}) must be positive")
    }
    let (gh, gw) = (h.div_ceil(ph), w.div_ceil(pw));
    let grid = mask
        .get(0)?
        .get(0)?
        .to_dtype(DType::F32)?
        .to_vec3::<f32>()?;
    let t = t as f32;
    let mut values = Vec::with_capacity(frames * gh * gw);
    for frame in &grid {
        for row in frame.iter().step_by(ph) {
            values.extend(row.iter().step_by(pw).map(|&m| m * t));
        }
    }
    let n = values.len();
    Tensor::from_vec(values, (1, n), mask.device())?.repeat((batch, 1))
}
