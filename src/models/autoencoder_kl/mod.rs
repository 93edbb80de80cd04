//! diffusers' 2-D `AutoencoderKL` (autoencoders/autoencoder_kl.py) in the Stable Diffusion
//! layout: `Encoder` / `Decoder` of `DownEncoderBlock2D` / `UpDecoderBlock2D` with a mid block
//! that has one attention, the optional `quant_conv` / `post_quant_conv` (`use_quant_conv`,
//! `use_post_quant_conv`), and the config's `scaling_factor` / `shift_factor`. The image VAE
//! of Latte (decoding each frame on its own), FLUX.1 (no quant convs, a shift factor), SD and
//! PixArt. No tiling or slicing: one call decodes the batch it is given.
//!
//! It computes in the `VarBuilder`'s dtype (the pipelines named above do not read
//! `force_upcast`); GroupNorm statistics are taken in f32.

pub(crate) mod blocks;

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Deserialize;

use crate::models::attention::MAX_SCORE_ELEMENTS;
use crate::models::vae_tiling::{OverlapTiles, SpatialTiling};
use crate::models::video::VideoVae;

use blocks::{Conv2d, Decoder, Encoder};

/// The block type every entry of `down_block_types` must name.
pub const DOWN_BLOCK: &str = "DownEncoderBlock2D";
/// The block type every entry of `up_block_types` must name.
pub const UP_BLOCK: &str = "UpDecoderBlock2D";

/// `vae/config.json` of a diffusers `AutoencoderKL`; missing keys take diffusers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct AutoencoderKLConfig {
    /// Image channels in (encoder side).
    pub in_channels: usize,
    /// Image channels out.
    pub out_channels: usize,
    /// Encoder block types; only `DownEncoderBlock2D`.
    pub down_block_types: Vec<String>,
    /// Decoder block types; only `UpDecoderBlock2D`.
    pub up_block_types: Vec<String>,
    /// Channels per resolution level, from the image side.
    pub block_out_channels: Vec<usize>,
    /// Resnets per encoder block; the decoder's blocks have one more.
    pub layers_per_block: usize,
    /// Activation (only `silu`).
    pub act_fn: String,
    /// Latent channels.
    pub latent_channels: usize,
    /// Groups of every GroupNorm.
    pub norm_num_groups: usize,
    /// An int or a pair, whose first is the tile size ([`AutoencoderKLConfig::tiling`]).
    pub sample_size: serde_json::Value,
    /// Latents are divided by it before decoding (0.18215 for SD / Latte, 0.3611 for FLUX.1).
    pub scaling_factor: f64,
    /// Added after the division by `scaling_factor` (FLUX.1: 0.1159); null for SD.
    pub shift_factor: Option<f64>,
    /// Informational (no pipeline here reads it).
    pub latents_mean: Option<Vec<f64>>,
    /// Informational (no pipeline here reads it).
    pub latents_std: Option<Vec<f64>>,
    /// Informational: the pipelines that use this VAE do not read it (the caller picks the
    /// dtype).
    pub force_upcast: bool,
    /// A 1x1 conv on the encoder's moments.
    pub use_quant_conv: bool,
    /// A 1x1 conv on the latents before the decoder.
    pub use_post_quant_conv: bool,
    /// Whether the mid blocks have their attention.
    pub mid_block_add_attention: bool,
}

impl Default for AutoencoderKLConfig {
    fn default() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            down_block_types: vec![DOWN_BLOCK.into()],
            up_block_types: vec![UP_BLOCK.into()],
            block_out_channels: vec![64],
            layers_per_block: 1,
            act_fn: "silu".into(),
            latent_channels: 4,
            norm_num_groups: 32,
            sample_size: serde_json::json!(32),
            scaling_factor: 0.18215,
            shift_factor: None,
            latents_mean: None,
            latents_std: None,
            force_upcast: true,
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
        }
    }
}

impl AutoencoderKLConfig {
    /// Pixels per latent pixel along each side: 2 per down block but the last (diffusers'
    /// `vae_scale_factor = 2 ** (len(block_out_channels) - 1)`).
    pub fn scale_factor(&self) -> usize {
        let doublings = self.block_out_channels.len().saturating_sub(1);
        // `validate` allows 16 levels; an unchecked config saturates instead of overflowing.
        if doublings < usize::BITS as usize {
            1 << doublings
        } else {
            usize::MAX
        }
    }

    /// Device bytes the decode of `images` latent images of `(h, w)` keeps alive at its peak
    /// besides the weights and the decoded output, on the path a GPU runs (its convolutions
    /// channels last, [`crate::models::conv3d::images_conv_channels_last`], each with one run of
    /// its gathered input and its output alive). The peak is in the last up block's first resnet,
    /// at full resolution (one tile's, with `tiled`): its input, the upsampler's output at the
    /// second level's channels (counting from the image side), is held throughout; beside it
    /// either its normalized copy and the first convolution's output (at the first level's
    /// channels), or, at the second convolution, that convolution's input, the shortcut's output
    /// and its own output. The mid block's chunked attention scores peak at another time: the
    /// largest of the three counts. With `tiled`, each tile's maps beside the decoded tiles held
    /// until they are blended ([`crate::models::vae_tiling::TileWalk`]). (Latte-1, 14 frames of
    /// 512x512 in bf16 on an H100: 5.38 GiB used above the weights, planned 5.47;
    /// bench/RESULTS.md session 43. Tiled: 1.37 GiB used, its decode stage planned 1.47;
    /// session 44.)
    pub fn decode_activations(
        &self,
        images: usize,
        (h, w): (usize, usize),
        tiled: bool,
        dtype: DType,
    ) -> u64 {
        let bytes = dtype.size_in_bytes() as u64;
        let s = self.scale_factor();
        let walk = tiled.then(|| self.tiling().walk((h, w), s)).flatten();
        let (th, tw) = walk.as_ref().map_or((h * s, w * s), |walk| walk.tile);
        let images = images.max(1) as u64;
        let pixels = images * (th * tw) as u64;
        let boc = &self.block_out_channels;
        let last = boc.first().copied().unwrap_or(128) as u64;
        let upsampled = boc.get(1).copied().unwrap_or(last as usize) as u64;
        // One run of a convolution from `cin` to `cout` channels: its gathered input and output.
        // A run is whole images, at least one, however large (FLUX.1's one 768x768 image at 256
        // channels is 2.25 runs' worth of elements: 1.250 GiB used against 1.059 planned while
        // the run was capped, an H100, bench/RESULTS.md session 48).
        let run = |cin: u64, cout: u64| {
            let cap =
                (crate::models::conv3d::IMAGE_RUN_ELEMENTS as u64).max((th * tw) as u64 * cin);
            let input = (pixels * cin).min(cap);
            (input + input * cout / cin.max(1)) * bytes
        };
        let first = pixels * (2 * upsampled + last) * bytes + run(upsampled, last);
        let second = pixels * (upsampled + 3 * last) * bytes + run(last, last);
        // The mid block's one-head attention over one tile's latent pixels, f32 scores and
        // probabilities, chunked.
        let tokens = ((th / s) * (tw / s)) as u64;
        let scores = (images * tokens * tokens).min(MAX_SCORE_ELEMENTS as u64) * 4 * 2;
        let maps = first.max(second).max(scores);
        match &walk {
            Some(walk) => walk.peak(maps, images * self.out_channels as u64 * bytes),
            None => maps,
        }
    }

    /// The config's `sample_size`, or the first of a pair.
    fn first_sample_size(&self) -> Option<usize> {
        let size = match &self.sample_size {
            serde_json::Value::Array(sizes) => sizes.first()?,
            size => size,
        };
        size.as_u64()
            .filter(|&s| s > 0)
            .and_then(|s| usize::try_from(s).ok())
    }

    /// diffusers' tiles (`enable_tiling()` takes no sizes): `sample_size` pixels (the first of
    /// a pair) overlapping by a quarter.
    pub fn tiling(&self) -> OverlapTiles {
        let size = self.first_sample_size().unwrap_or(0);
        OverlapTiles {
            min_height: size,
            min_width: size,
            overlap_factor_height: 0.25,
            overlap_factor_width: 0.25,
        }
    }

    /// Rejects configurations whose decoder cannot be built, with the key at fault.
    pub fn validate(&self) -> Result<()> {
        if self.first_sample_size().is_none() {
            candle_core::bail!(
                "vae config: sample_size must be a positive integer or a list of them, got {}",
                self.sample_size
            );
        }
        if self.block_out_channels.is_empty() || self.block_out_channels.contains(&0) {
            candle_core::bail!(
                "vae config: block_out_channels must be a non-empty list of positive numbers"
            );
        }
        if self.block_out_channels.len() > 16 {
            candle_core::bail!(
                "vae config: block_out_channels has {} entries (at most 16)",
                self.block_out_channels.len()
            );
        }
        if self.up_block_types.len() != self.block_out_channels.len() {
            candle_core::bail!(
                "vae config: up_block_types has {} entries for {} block_out_channels",
                self.up_block_types.len(),
                self.block_out_channels.len()
            );
        }
        if let Some(t) = self.up_block_types.iter().find(|t| *t != UP_BLOCK) {
            candle_core::bail!(
                "vae config: up_block_types entry {t:?} is not supported (only {UP_BLOCK:?})"
            );
        }
        if self.latent_channels == 0 || self.out_channels == 0 {
            candle_core::bail!("vae config: latent_channels and out_channels must be positive");
        }
        let groups = self.norm_num_groups;
        if groups == 0
            || self
                .block_out_channels
                .iter()
                .any(|c| !c.is_multiple_of(groups))
        {
            candle_core::bail!(
                "vae config: norm_num_groups {groups} must divide every block_out_channels entry {:?}",
                self.block_out_channels
            );
        }
        crate::models::config_checks::one_of(
            "vae config",
            ("act_fn", &self.act_fn),
            &["silu", "swish"],
        )?;
        if !(self.scaling_factor.is_finite() && self.scaling_factor != 0.0) {
            candle_core::bail!("vae config: scaling_factor must be a non-zero number");
        }
        if self.shift_factor.is_some_and(|s| !s.is_finite()) {
            candle_core::bail!("vae config: shift_factor must be a number or null");
        }
        Ok(())
    }

    /// Rejects configurations whose encoder cannot be built, with the key at fault.
    pub fn validate_encoder(&self) -> Result<()> {
        self.validate()?;
        if self.down_block_types.len() != self.block_out_channels.len() {
            candle_core::bail!(
                "vae config: down_block_types has {} entries for {} block_out_channels",
                self.down_block_types.len(),
                self.block_out_channels.len()
            );
        }
        if let Some(t) = self.down_block_types.iter().find(|t| *t != DOWN_BLOCK) {
            candle_core::bail!(
                "vae config: down_block_types entry {t:?} is not supported (only {DOWN_BLOCK:?})"
            );
        }
        if self.in_channels == 0 {
            candle_core::bail!("vae config: in_channels must be positive");
        }
        if self.layers_per_block == 0 {
            candle_core::bail!("vae config: layers_per_block must be at least 1 to encode");
        }
        Ok(())
    }
}

/// An image VAE under a video DiT (Latte): every frame its own latent frame.
impl VideoVae for AutoencoderKLConfig {
    fn compression(&self) -> (usize, usize) {
        (1, self.scale_factor())
    }

    fn latent_grid(&self, num_frames: u32, height: u32, width: u32) -> [usize; 3] {
        let s = self.scale_factor();
        [num_frames as usize, height as usize / s, width as usize / s]
    }
}

/// diffusers' `AutoencoderKL` (no slicing): the decoder, and the encoder unless built with
/// [`Self::new_decoder_only`].
#[derive(Debug, Clone)]
pub struct AutoencoderKL {
    cfg: AutoencoderKLConfig,
    encoder: Option<(Encoder, Option<Conv2d>)>,
    post_quant_conv: Option<Conv2d>,
    decoder: Decoder,
    dtype: DType,
    /// How [`Self::decode`] tiles; `None` decodes whole (diffusers' default).
    tiling: Option<OverlapTiles>,
}

impl AutoencoderKL {
    /// Loads encoder and decoder from a `vae/` checkpoint, in the `VarBuilder`'s dtype.
    pub fn new(cfg: &AutoencoderKLConfig, vb: VarBuilder) -> Result<Self> {
        let mut vae = Self::new_decoder_only(cfg, vb.clone())?;
        cfg.validate_encoder()?;
        let latent2 = 2 * cfg.latent_channels;
        let quant_conv = if cfg.use_quant_conv {
            Some(Conv2d::new(latent2, latent2, 1, 1, 0, vb.pp("quant_conv"))?)
        } else {
            None
        };
        vae.encoder = Some((Encoder::new(cfg, vb.pp("encoder"))?, quant_conv));
        Ok(vae)
    }

    /// Loads only the decoder (and `post_quant_conv`): all text-to-image/video needs;
    /// [`Self::encode`] then refuses to run.
    pub fn new_decoder_only(cfg: &AutoencoderKLConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let latent = cfg.latent_channels;
        Ok(Self {
            cfg: cfg.clone(),
            encoder: None,
            post_quant_conv: if cfg.use_post_quant_conv {
                Some(Conv2d::new(
                    latent,
                    latent,
                    1,
                    1,
                    0,
                    vb.pp("post_quant_conv"),
                )?)
            } else {
                None
            },
            decoder: Decoder::new(cfg, vb.pp("decoder"))?,
            dtype: vb.dtype(),
            tiling: None,
        })
    }

    /// This VAE decoding in `tiling`'s tiles (diffusers' `tiled_decode`; whole with `None`),
    /// checked against the scale factor.
    pub fn with_tiling(&self, tiling: Option<OverlapTiles>) -> Result<Self> {
        if let Some(tiles) = &tiling {
            tiles.validate(self.cfg.scale_factor())?;
        }
        Ok(Self {
            tiling,
            ..self.clone()
        })
    }

    /// The configuration the VAE was built with.
    pub fn config(&self) -> &AutoencoderKLConfig {
        &self.cfg
    }

    /// The dtype the VAE computes in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// `latents / scaling_factor + shift_factor` (FluxPipeline's decode input; no shift where
    /// the config has none): a true division, each operation rounded to the latents' dtype as
    /// torch rounds it.
    pub fn unscale(&self, latents: &Tensor) -> Result<Tensor> {
        let dtype = latents.dtype();
        let x = latents.to_dtype(DType::F32)?;
        let sf = Tensor::new(self.cfg.scaling_factor as f32, x.device())?;
        let mut x = x.broadcast_div(&sf)?.to_dtype(dtype)?;
        if let Some(shift) = self.cfg.shift_factor {
            let shift = Tensor::new(shift as f32, x.device())?;
            x = x
                .to_dtype(DType::F32)?
                .broadcast_add(&shift)?
                .to_dtype(dtype)?;
        }
        Ok(x)
    }

    /// `1 / scaling_factor * latents` (the SD-style pipelines' decode input, Latte's among
    /// them): the Python float's reciprocal, rounded to f32, times the latents; no shift.
    pub fn unscale_by_reciprocal(&self, latents: &Tensor) -> Result<Tensor> {
        times_reciprocal(latents, self.cfg.scaling_factor)
    }

    /// Decodes latents `z` `[B, latent_channels, h, w]` (already unscaled) to images
    /// `[B, out_channels, h·f, w·f]` (f = [`AutoencoderKLConfig::scale_factor`]), not clamped:
    /// `post_quant_conv` where the config has it, then the decoder; in tiles where
    /// [`Self::with_tiling`] set them and the latents exceed one.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        let ratio = self.cfg.scale_factor();
        match self.tiling {
            Some(tiles) if tiles.splits((z.dim(2)?, z.dim(3)?), ratio) => {
                tiles.decode(z, ratio, |tile| self.decode_whole(tile))
            }
            _ => self.decode_whole(z),
        }
    }

    /// One decoder call on `z`, untiled.
    fn decode_whole(&self, z: &Tensor) -> Result<Tensor> {
        let (_, c, h, w) = z.dims4()?;
        if c != self.cfg.latent_channels {
            candle_core::bail!(
                "latents have {c} channels, the VAE expects {}",
                self.cfg.latent_channels
            );
        }
        if z.dim(0)? == 0 || h == 0 || w == 0 {
            candle_core::bail!("cannot decode empty latents {:?}", z.dims());
        }
        let mut z = z.to_dtype(self.dtype)?;
        if let Some(conv) = &self.post_quant_conv {
            z = conv.forward(&z)?;
        }
        self.decoder.forward(&z)
    }

    /// Encodes images `[B, in_channels, H, W]` in [-1, 1] to the latent distribution's
    /// `(mean, logvar)`, each `[B, latent_channels, H/f, W/f]`, unscaled (after `quant_conv`
    /// where the config has it), `logvar` clamped to [-30, 20].
    pub fn encode(&self, images: &Tensor) -> Result<(Tensor, Tensor)> {
        let Some((encoder, quant_conv)) = &self.encoder else {
            candle_core::bail!("this VAE was loaded without its encoder");
        };
        let (b, c, h, w) = images.dims4()?;
        if c != self.cfg.in_channels {
            candle_core::bail!(
                "images have {c} channels, the VAE expects {}",
                self.cfg.in_channels
            );
        }
        if b == 0 || h == 0 || w == 0 {
            candle_core::bail!("cannot encode empty images {:?}", images.dims());
        }
        let mut moments = encoder.forward(&images.to_dtype(self.dtype)?)?;
        if let Some(conv) = quant_conv {
            moments = conv.forward(&moments)?;
        }
        let latent = self.cfg.latent_channels;
        let mean = moments.narrow(1, 0, latent)?;
        let logvar = moments.narrow(1, latent, latent)?.clamp(-30.0, 20.0)?;
        Ok((mean, logvar))
    }
}

/// `1 / scaling_factor * latents` as the SD-style pipelines compute it (Latte, Allegro): the
/// Python float's reciprocal, rounded to f32, times the latents.
pub fn times_reciprocal(latents: &Tensor, scaling_factor: f64) -> Result<Tensor> {
    let inv = Tensor::new((1.0 / scaling_factor) as f32, latents.device())?;
    latents
        .to_dtype(DType::F32)?
        .broadcast_mul(&inv)?
        .to_dtype(latents.dtype())
}

crate::placed_whole!(
    AutoencoderKL,
    AutoencoderKLConfig,
    AutoencoderKL::new_decoder_only
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_diffusers() {
        let cfg: AutoencoderKLConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(cfg, AutoencoderKLConfig::default());
        assert_eq!(cfg.scale_factor(), 1);
        assert!(cfg.validate_encoder().is_ok());
        let four = AutoencoderKLConfig {
            block_out_channels: vec![128, 256, 512, 512],
            down_block_types: vec![DOWN_BLOCK.into(); 4],
            up_block_types: vec![UP_BLOCK.into(); 4],
            ..cfg
        };
        assert_eq!(four.scale_factor(), 8);
        assert!(four.validate_encoder().is_ok());
    }

    #[test]
    fn a_pair_sample_size_parses() {
        let cfg: AutoencoderKLConfig =
            serde_json::from_str(r#"{"sample_size": [512, 512]}"#).unwrap();
        assert!(cfg.validate().is_ok());
    }
}
