//! Image preprocessing exactly as the Python references compute it: transformers'
//! `CLIPImageProcessorPil` (the backend the fixtures pin) and the PIL resampling under it and
//! under diffusers' `VaeImageProcessor`/`VideoProcessor`.
//!
//! [`resize_like_pil`] is a port of Pillow's `ImagingResample` for 8-bit RGB (two separable
//! passes, coefficients in 22-bit fixed point, horizontal first), so the pixels are bit-identical
//! to `PIL.Image.resize`; a float resize differs by up to one uint8 step, which moves CLIP's
//! `image_embeds` by ~5e-3.

use std::path::Path;

use candle_core::{Device, Result, Tensor};
use image::RgbImage;
use serde::Deserialize;

/// Decodes a PNG or JPEG file to 8-bit RGB (alpha dropped, grey replicated), as
/// `PIL.Image.open(path).convert("RGB")`.
pub fn load_rgb_image(path: &Path) -> Result<RgbImage> {
    let img = image::open(path).map_err(|e| {
        candle_core::Error::Msg(format!("cannot read image {}: {e}", path.display()))
    })?;
    Ok(img.to_rgb8())
}

/// PIL's resampling filters, numbered as `PIL.Image.Resampling` (the `resample` config key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PilFilter {
    Lanczos,
    Bilinear,
    Bicubic,
    Box,
    Hamming,
}

impl PilFilter {
    /// From `PIL.Image.Resampling`'s number; NEAREST (0) is not supported.
    pub fn from_pil(code: u32) -> Result<Self> {
        Ok(match code {
            1 => Self::Lanczos,
            2 => Self::Bilinear,
            3 => Self::Bicubic,
            4 => Self::Box,
            5 => Self::Hamming,
            _ => candle_core::bail!(
                "resample {code} is not supported (1 lanczos, 2 bilinear, 3 bicubic, 4 box, 5 hamming)"
            ),
        })
    }

    fn support(self) -> f64 {
        match self {
            Self::Box => 0.5,
            Self::Bilinear | Self::Hamming => 1.0,
            Self::Bicubic => 2.0,
            Self::Lanczos => 3.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        fn sinc(x: f64) -> f64 {
            if x == 0.0 {
                return 1.0;
            }
            let x = x * std::f64::consts::PI;
            x.sin() / x
        }
        match self {
            Self::Box => {
                if x > -0.5 && x <= 0.5 {
                    1.0
                } else {
                    0.0
                }
            }
            Self::Bilinear => {
                let x = x.abs();
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Self::Hamming => {
                let x = x.abs();
                if x == 0.0 {
                    1.0
                } else if x >= 1.0 {
                    0.0
                } else {
                    let x = x * std::f64::consts::PI;
                    // Pillow's constants are C floats.
                    x.sin() / x * (0.54f32 as f64 + 0.46f32 as f64 * x.cos())
                }
            }
            Self::Bicubic => {
                let a = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * a
                } else {
                    0.0
                }
            }
            Self::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

/// Fixed-point fraction bits of Pillow's 8-bit resampling (`32 - 8 - 2`).
const PRECISION_BITS: u32 = 22;

/// One output position's source window and fixed-point weights.
struct Taps {
    start: usize,
    weights: Vec<i32>,
}

/// Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc` for `in_size -> out_size`.
fn taps(in_size: usize, out_size: usize, filter: PilFilter) -> Vec<Taps> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            let ss = 1.0 / filterscale;
            // C's (int) casts truncate toward zero, as Rust's `as` does.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let w: Vec<f64> = (xmin..xmax.max(xmin))
                .map(|x| filter.weight((x as f64 - center + 0.5) * ss))
                .collect();
            let total: f64 = w.iter().sum();
            let weights = w
                .iter()
                .map(|&k| {
                    let k = if total != 0.0 { k / total } else { k };
                    let fixed = k * (1u32 << PRECISION_BITS) as f64;
                    if k < 0.0 {
                        (fixed - 0.5) as i32
                    } else {
                        (fixed + 0.5) as i32
                    }
                })
                .collect();
            Taps {
                start: xmin,
                weights,
            }
        })
        .collect()
}

/// Pillow's `clip8`: the rounded fixed-point sum, clamped to a byte.
fn clip8(acc: i64) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// `PIL.Image.resize((width, height), resample=filter)` of an RGB image, bit-exact.
pub fn resize_like_pil(img: &RgbImage, width: u32, height: u32, filter: PilFilter) -> RgbImage {
    let (in_w, in_h) = img.dimensions();
    if (in_w, in_h) == (width, height) || width == 0 || height == 0 {
        return if (in_w, in_h) == (width, height) {
            img.clone()
        } else {
            RgbImage::new(width, height)
        };
    }
    let round = 1i64 << (PRECISION_BITS - 1);
    // Horizontal pass (only over the rows the vertical pass reads, like Pillow; the values are
    // the same either way).
    let horizontal = if width != in_w {
        let taps = taps(in_w as usize, width as usize, filter);
        let mut out = RgbImage::new(width, in_h);
        for y in 0..in_h {
            for (xx, t) in taps.iter().enumerate() {
                let mut acc = [round; 3];
                for (i, &k) in t.weights.iter().enumerate() {
                    let p = img.get_pixel((t.start + i) as u32, y);
                    for c in 0..3 {
                        acc[c] += p[c] as i64 * k as i64;
                    }
                }
                out.put_pixel(xx as u32, y, image::Rgb(acc.map(clip8)));
            }
        }
        out
    } else {
        img.clone()
    };
    if height == in_h {
        return horizontal;
    }
    let taps = taps(in_h as usize, height as usize, filter);
    let mut out = RgbImage::new(width, height);
    for (yy, t) in taps.iter().enumerate() {
        for x in 0..width {
            let mut acc = [round; 3];
            for (i, &k) in t.weights.iter().enumerate() {
                let p = horizontal.get_pixel(x, (t.start + i) as u32);
                for c in 0..3 {
                    acc[c] += p[c] as i64 * k as i64;
                }
            }
            out.put_pixel(x, yy as u32, image::Rgb(acc.map(clip8)));
        }
    }
    out
}

/// `size` / `crop_size` of a preprocessor config: `{"shortest_edge": n}` or
/// `{"height": h, "width": w}`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SizeSpec {
    pub shortest_edge: Option<usize>,
    pub height: Option<usize>,
    pub width: Option<usize>,
}

/// `image_processor/preprocessor_config.json` of a `CLIPImageProcessor`; missing keys take
/// transformers' `CLIPImageProcessorPil` defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct ClipImageProcessorConfig {
    pub do_resize: bool,
    pub size: SizeSpec,
    /// `PIL.Image.Resampling` number (3 = bicubic).
    pub resample: u32,
    pub do_center_crop: bool,
    pub crop_size: SizeSpec,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: Vec<f64>,
    pub image_std: Vec<f64>,
}

impl Default for ClipImageProcessorConfig {
    fn default() -> Self {
        Self {
            do_resize: true,
            size: SizeSpec {
                shortest_edge: Some(224),
                ..Default::default()
            },
            resample: 3,
            do_center_crop: true,
            crop_size: SizeSpec {
                height: Some(224),
                width: Some(224),
                ..Default::default()
            },
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: true,
            image_mean: vec![0.48145466, 0.4578275, 0.40821073],
            image_std: vec![0.26862954, 0.26130258, 0.27577711],
        }
    }
}

impl ClipImageProcessorConfig {
    /// Rejects settings the processor cannot apply, naming the key.
    pub fn validate(&self) -> Result<()> {
        if self.do_resize {
            PilFilter::from_pil(self.resample)?;
            let s = &self.size;
            match (s.shortest_edge, s.height, s.width) {
                (Some(n), _, _) if n > 0 => {}
                (None, Some(h), Some(w)) if h > 0 && w > 0 => {}
                _ => candle_core::bail!(
                    "image processor: size must be {{shortest_edge}} or {{height, width}}, positive"
                ),
            }
        }
        if self.do_center_crop {
            match (self.crop_size.height, self.crop_size.width) {
                (Some(h), Some(w)) if h > 0 && w > 0 => {}
                _ => {
                    candle_core::bail!("image processor: crop_size needs positive height and width")
                }
            }
        }
        if self.do_normalize
            && (self.image_mean.len() != 3
                || self.image_std.len() != 3
                || self.image_std.contains(&0.0))
        {
            candle_core::bail!("image processor: image_mean/image_std need 3 values, std non-zero")
        }
        Ok(())
    }
}

/// transformers' `CLIPImageProcessorPil`: resize (shortest edge), center crop, rescale,
/// normalize.
#[derive(Debug, Clone)]
pub struct ClipImageProcessor {
    cfg: ClipImageProcessorConfig,
}

impl ClipImageProcessor {
    pub fn new(cfg: &ClipImageProcessorConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self { cfg: cfg.clone() })
    }

    /// `pixel_values` `[1, 3, H, W]` (f32) of one RGB image.
    pub fn preprocess(&self, img: &RgbImage, device: &Device) -> Result<Tensor> {
        let cfg = &self.cfg;
        let mut img = img.clone();
        if cfg.do_resize {
            let (w, h) = (img.width() as usize, img.height() as usize);
            let (new_h, new_w) = match cfg.size.shortest_edge {
                Some(short) => {
                    // transformers' get_resize_output_image_size(default_to_square=False).
                    let (s, l) = if w <= h { (w, h) } else { (h, w) };
                    let long = (short as f64 * l as f64 / s as f64) as usize;
                    if w <= h {
                        (long, short)
                    } else {
                        (short, long)
                    }
                }
                None => (cfg.size.height.unwrap_or(h), cfg.size.width.unwrap_or(w)),
            };
            let filter = PilFilter::from_pil(cfg.resample)?;
            img = resize_like_pil(&img, new_w as u32, new_h as u32, filter);
        }
        let (h, w) = (img.height() as usize, img.width() as usize);
        let (ch, cw) = if cfg.do_center_crop {
            (
                cfg.crop_size.height.unwrap_or(h),
                cfg.crop_size.width.unwrap_or(w),
            )
        } else {
            (h, w)
        };
        let pixels = center_crop(&img, ch, cw);
        let mut data = vec![0f32; 3 * ch * cw];
        for c in 0..3 {
            let (mean, std) = (
                cfg.image_mean.get(c).copied().unwrap_or(0.0) as f32,
                cfg.image_std.get(c).copied().unwrap_or(1.0) as f32,
            );
            for i in 0..ch * cw {
                let v = pixels[i * 3 + c];
                // numpy: rescale in f64 then cast; normalise in f32.
                let mut x = if cfg.do_rescale {
                    (v as f64 * cfg.rescale_factor) as f32
                } else {
                    v as f32
                };
                if cfg.do_normalize {
                    x = (x - mean) / std;
                }
                data[c * ch * cw + i] = x;
            }
        }
        Tensor::from_vec(data, (1, 3, ch, cw), device)
    }
}

/// transformers' `center_crop` on an RGB image: top = (h - ch) // 2, left = (w - cw) // 2,
/// zero padding (centred, rounded up) where the crop is larger. Returns `[ch * cw * 3]` bytes.
fn center_crop(img: &RgbImage, ch: usize, cw: usize) -> Vec<u8> {
    let (h, w) = (img.height() as i64, img.width() as i64);
    let (chi, cwi) = (ch as i64, cw as i64);
    let (mut top, mut left) = ((h - chi).div_euclid(2), (w - cwi).div_euclid(2));
    // Padding: the image sits at (top_pad, left_pad) of a zero canvas of max sizes.
    let (new_h, new_w) = (chi.max(h), cwi.max(w));
    let (top_pad, left_pad) = if top >= 0 && top + chi <= h && left >= 0 && left + cwi <= w {
        (0, 0)
    } else {
        let tp = (new_h - h + 1) / 2;
        let lp = (new_w - w + 1) / 2;
        top += tp;
        left += lp;
        (tp, lp)
    };
    let mut out = vec![0u8; ch * cw * 3];
    for y in 0..chi {
        for x in 0..cwi {
            let (cy, cx) = (top + y - top_pad, left + x - left_pad);
            if (0..h).contains(&cy) && (0..w).contains(&cx) && top + y >= 0 && left + x >= 0 {
                let p = img.get_pixel(cx as u32, cy as u32);
                let o = ((y * cwi + x) * 3) as usize;
                out[o..o + 3].copy_from_slice(&p.0);
            }
        }
    }
    out
}
