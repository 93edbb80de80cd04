//! MiniMax H3's audio VAE decoder (diffusers `AutoencoderKLMiniMaxH3Audio`, decode path only):
//! a 1x1 `dec_in_proj` then a BigVGAN vocoder with alias-free SnakeBeta activations. The VAE is
//! mono; the pipeline decodes stereo as a batch of two. The encoder (reference-audio workflows
//! only) is not implemented.

use candle_core::{Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use serde::Deserialize;

/// `audio_vae/config.json`; missing keys take diffusers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct MiniMaxH3AudioVaeConfig {
    /// Encoder strides; their product is the hop length the decoder must match.
    pub encoder_rates: Vec<usize>,
    /// Width of the vocoder input (`dec_in_proj` output).
    pub latent_dim: usize,
    /// Audio latent channels.
    pub latent_channels: usize,
    /// Channels after `conv_pre`; halved by every upsampling stage.
    pub decoder_dim: usize,
    /// Upsampling factor of each stage.
    pub decoder_rates: Vec<usize>,
    /// Transposed-convolution kernel of each stage.
    pub decoder_kernel_sizes: Vec<usize>,
    /// Kernels of the AMP blocks of every stage.
    pub resblock_kernel_sizes: Vec<usize>,
    /// Dilations of each AMP block.
    pub resblock_dilation_sizes: Vec<Vec<usize>>,
    /// Output sample rate (Hz).
    pub sampling_rate: usize,
    /// Per-channel latent mean: the pipeline decodes `z * std + mean` (`null`: 0).
    pub latents_mean: Option<Vec<f32>>,
    /// Per-channel latent standard deviation (`null`: 1).
    pub latents_std: Option<Vec<f32>>,
}

impl Default for MiniMaxH3AudioVaeConfig {
    fn default() -> Self {
        Self {
            encoder_rates: vec![2, 4, 4, 5, 5],
            latent_dim: 2048,
            latent_channels: 32,
            decoder_dim: 1024,
            decoder_rates: vec![5, 5, 2, 2, 2, 2, 2],
            decoder_kernel_sizes: vec![9, 9, 4, 4, 4, 4, 4],
            resblock_kernel_sizes: vec![3, 7, 11],
            resblock_dilation_sizes: vec![vec![1, 3, 5]; 3],
            sampling_rate: 32000,
            latents_mean: None,
            latents_std: None,
        }
    }
}

impl MiniMaxH3AudioVaeConfig {
    /// Waveform samples per latent.
    pub fn hop_length(&self) -> usize {
        self.encoder_rates.iter().product()
    }

    /// Rejects configurations the decoder cannot run, naming the key.
    pub fn validate(&self) -> Result<()> {
        crate::models::config_checks::positive(
            "audio_vae config",
            &[
                ("latent_dim", self.latent_dim),
                ("latent_channels", self.latent_channels),
                ("decoder_dim", self.decoder_dim),
                ("sampling_rate", self.sampling_rate),
            ],
        )?;
        if self.encoder_rates.contains(&0)
            || self.decoder_rates.is_empty()
            || self.decoder_rates.contains(&0)
        {
            candle_core::bail!(
                "audio_vae config: encoder_rates and decoder_rates must be positive"
            );
        }
        let upsampling: usize = self.decoder_rates.iter().product();
        if upsampling != self.hop_length() {
            candle_core::bail!(
                "audio_vae config: decoder_rates upsample by {upsampling}, not the encoder hop length {}",
                self.hop_length()
            );
        }
        if self.decoder_kernel_sizes.len() != self.decoder_rates.len() {
            candle_core::bail!(
                "audio_vae config: decoder_kernel_sizes needs one kernel per decoder_rates entry"
            );
        }
        if let Some((k, r)) = self
            .decoder_kernel_sizes
            .iter()
            .zip(&self.decoder_rates)
            .find(|(k, r)| k < r || (*k - *r) % 2 != 0)
        {
            candle_core::bail!("audio_vae config: decoder_kernel_sizes entry {k} does not fit rate {r} (kernel - rate must be even and >= 0)");
        }
        if self.decoder_dim >> self.decoder_rates.len() == 0 {
            candle_core::bail!(
                "audio_vae config: decoder_dim {} is halved to 0 by {} stages",
                self.decoder_dim,
                self.decoder_rates.len()
            );
        }
        if self.resblock_kernel_sizes.is_empty()
            || self.resblock_kernel_sizes.len() != self.resblock_dilation_sizes.len()
            || self.resblock_kernel_sizes.iter().any(|k| k % 2 == 0)
            || self
                .resblock_dilation_sizes
                .iter()
                .flatten()
                .any(|&d| d == 0)
        {
            candle_core::bail!("audio_vae config: resblock_kernel_sizes (odd) and resblock_dilation_sizes (positive) must pair up");
        }
        for (key, values) in [
            ("latents_mean", &self.latents_mean),
            ("latents_std", &self.latents_std),
        ] {
            if let Some(v) = values.as_ref().filter(|v| v.len() != self.latent_channels) {
                candle_core::bail!(
                    "audio_vae config: {key} has {} values, latent_channels is {}",
                    v.len(),
                    self.latent_channels
                );
            }
        }
        Ok(())
    }
}

/// A weight-normed kernel as stored (`weight_v`, `weight_g`), folded into `w = g · v / ‖v‖`
/// (norm over every axis but 0, as torch's `weight_norm` computes it) when a layer runs: a
/// kernel folded at load would sit on the device beside the stored tensors wherever the weights
/// are placed by an engine that keeps them (a parked VAE), doubling the VAE's bytes.
#[derive(Debug, Clone)]
struct WeightNormed {
    v: Tensor,
    g: Tensor,
}

impl WeightNormed {
    fn new(vb: &VarBuilder, shape: (usize, usize, usize)) -> Result<Self> {
        Ok(Self {
            v: vb.get(shape, "weight_v")?,
            g: vb.get((shape.0, 1, 1), "weight_g")?,
        })
    }

    /// The folded kernel (one op per statement: the squares go before the kernel exists).
    fn kernel(&self) -> Result<Tensor> {
        let norm = self.v.sqr()?.sum_keepdim((1, 2))?.sqrt()?;
        let gain = (&self.g / norm)?;
        self.v.broadcast_mul(&gain)
    }

    fn kernel_size(&self) -> Result<usize> {
        self.v.dim(2)
    }
}

/// Conv1d (weight-normed kernel, optional bias) with symmetric zero padding.
#[derive(Debug, Clone)]
struct Conv1d {
    weight: WeightNormed,
    bias: Option<Tensor>,
    padding: usize,
    dilation: usize,
}

impl Conv1d {
    #[allow(clippy::too_many_arguments)]
    fn weight_normed(
        cin: usize,
        cout: usize,
        kernel: usize,
        dilation: usize,
        padding: usize,
        bias: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            weight: WeightNormed::new(&vb, (cout, cin, kernel))?,
            bias: if bias {
                Some(vb.get(cout, "bias")?)
            } else {
                None
            },
            padding,
            dilation,
        })
    }

    /// The convolution over runs of output samples, each from its window of the zero-padded
    /// input, so the im2col scratch (input channels x kernel taps per output sample) stays
    /// within about the input's size rather than `kernel` times it.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let l = x.dim(2)?;
        let (k, d, p) = (self.weight.kernel_size()?, self.dilation, self.padding);
        let span = (k - 1) * d + 1;
        if l + 2 * p < span {
            candle_core::bail!(
                "conv1d: {l} samples (padding {p}) are fewer than the kernel's {span}"
            )
        }
        let out_len = l + 2 * p - span + 1;
        let per_run = out_len.div_ceil(k).max(1);
        let weight = self.weight.kernel()?;
        let y = if per_run >= out_len {
            x.conv1d(&weight, p, 1, d, 1)?
        } else {
            let padded = x.pad_with_zeros(2, p, p)?;
            crate::models::runs::in_runs(out_len, per_run, 2, |first, n| {
                let window = padded.narrow(2, first, n + span - 1)?.contiguous()?;
                window.conv1d(&weight, 0, 1, d, 1)
            })?
        };
        match &self.bias {
            Some(b) => y.broadcast_add(&b.reshape((1, (), 1))?),
            None => Ok(y),
        }
    }
}

/// Runs a single-channel kernel `[1, 1, k]` over every channel of `[B, C, L]` (a depthwise
/// convolution with one shared filter) by folding the channels into the batch.
fn depthwise<F: Fn(&Tensor) -> Result<Tensor>>(x: &Tensor, op: F) -> Result<Tensor> {
    let (b, c, l) = x.dims3()?;
    let y = op(&x.reshape((b * c, 1, l))?)?;
    let out = y.dim(2)?;
    y.reshape((b, c, out))
}

/// BigVGAN's alias-free SnakeBeta: 2x Kaiser-sinc upsampling, `x + sin²(e^α x) / (e^β + 1e-9)`,
/// low-pass 2x downsampling. The filters are the checkpoint's stored buffers.
#[derive(Debug, Clone)]
struct AliasFreeSnakeBeta {
    alpha: Tensor,
    inv_beta: Tensor,
    up_filter: Tensor,
    down_filter: Tensor,
}

/// The resampling ratio and filter length of diffusers' `MiniMaxH3AudioActivation1d` defaults.
const RESAMPLE_RATIO: usize = 2;
const RESAMPLE_KERNEL: usize = 12;
/// Runs of channels an activation works in (at most).
const ACTIVATION_RUNS: usize = 16;

impl AliasFreeSnakeBeta {
    fn new(channels: usize, vb: VarBuilder) -> Result<Self> {
        let alpha = vb
            .get(channels, "act.alpha")?
            .exp()?
            .reshape((1, channels, 1))?;
        let beta = vb
            .get(channels, "act.beta")?
            .exp()?
            .reshape((1, channels, 1))?;
        Ok(Self {
            alpha,
            inv_beta: (beta + 1e-9)?.recip()?,
            up_filter: vb.get((1, 1, RESAMPLE_KERNEL), "upsample.filter")?,
            down_filter: vb.get((1, 1, RESAMPLE_KERNEL), "downsample.lowpass.filter")?,
        })
    }

    /// Over runs of channels (each channel's computation is its own), written into one
    /// output: the resampling's scratch (filter taps per sample, at twice the length) stays a
    /// small share of the input's size.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let c = x.dim(1)?;
        let per_run = c.div_ceil(ACTIVATION_RUNS);
        if per_run >= c {
            return self.forward_channels(x, 0);
        }
        crate::models::runs::in_runs(c, per_run, 1, |first, n| {
            self.forward_channels(&x.narrow(1, first, n)?.contiguous()?, first)
        })
    }

    /// The activation of `x`'s channels, which start at channel `first` of the layer's.
    fn forward_channels(&self, x: &Tensor, first: usize) -> Result<Tensor> {
        let n = x.dim(1)?;
        let (alpha, inv_beta) = (
            self.alpha.narrow(1, first, n)?,
            self.inv_beta.narrow(1, first, n)?,
        );
        let (ratio, k) = (RESAMPLE_RATIO, RESAMPLE_KERNEL);
        // Upsample: replicate pad, transposed conv with stride `ratio`, x ratio, crop.
        let pad = k / ratio - 1;
        let crop_left = pad * ratio + (k - ratio) / 2;
        let crop_right = pad * ratio + (k - ratio).div_ceil(2);
        let up = depthwise(x, |x| {
            let y = x.pad_with_same(D::Minus1, pad, pad)?.conv_transpose1d(
                &self.up_filter,
                0,
                0,
                ratio,
                1,
                1,
            )?;
            let len = y.dim(2)?;
            (y * ratio as f64)?.narrow(2, crop_left, len - crop_left - crop_right)
        })?;
        // One statement per op, so each temporary goes as the next exists.
        let mut snake = alpha.broadcast_mul(&up)?;
        snake = snake.sin()?;
        snake = snake.sqr()?;
        snake = snake.broadcast_mul(&inv_beta)?;
        let act = (&up + snake)?;
        drop(up);
        // Downsample: replicate pad, low-pass conv with stride `ratio`.
        let pad_left = k / 2 - usize::from(k % 2 == 0);
        let pad_right = k / 2;
        depthwise(&act, |x| {
            x.pad_with_same(D::Minus1, pad_left, pad_right)?.conv1d(
                &self.down_filter,
                0,
                ratio,
                1,
                1,
            )
        })
    }
}

/// BigVGAN's `AMPBlock1`: per dilation, `x += conv2(act2(conv1(act1(x))))`.
#[derive(Debug, Clone)]
struct AmpBlock {
    convs1: Vec<Conv1d>,
    convs2: Vec<Conv1d>,
    activations: Vec<AliasFreeSnakeBeta>,
}

impl AmpBlock {
    fn new(channels: usize, kernel: usize, dilations: &[usize], vb: VarBuilder) -> Result<Self> {
        let conv = |i: usize, name: &str, d: usize| {
            Conv1d::weight_normed(
                channels,
                channels,
                kernel,
                d,
                (kernel * d - d) / 2,
                true,
                vb.pp(format!("{name}.{i}")),
            )
        };
        Ok(Self {
            convs1: dilations
                .iter()
                .enumerate()
                .map(|(i, &d)| conv(i, "convs1", d))
                .collect::<Result<_>>()?,
            convs2: (0..dilations.len())
                .map(|i| conv(i, "convs2", 1))
                .collect::<Result<_>>()?,
            activations: (0..2 * dilations.len())
                .map(|i| AliasFreeSnakeBeta::new(channels, vb.pp(format!("activations.{i}"))))
                .collect::<Result<_>>()?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for (i, (conv1, conv2)) in self.convs1.iter().zip(&self.convs2).enumerate() {
            let r = conv1.forward(&self.activations[2 * i].forward(&x)?)?;
            let r = conv2.forward(&self.activations[2 * i + 1].forward(&r)?)?;
            x = (r + x)?;
        }
        Ok(x)
    }
}

/// Weight-normed ConvTranspose1d of one upsampling stage.
#[derive(Debug, Clone)]
struct Upsample {
    weight: WeightNormed,
    bias: Tensor,
    stride: usize,
    padding: usize,
}

impl Upsample {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.conv_transpose1d(&self.weight.kernel()?, self.padding, 0, self.stride, 1, 1)?
            .broadcast_add(&self.bias.reshape((1, (), 1))?)
    }
}

/// The decode half of `AutoencoderKLMiniMaxH3Audio`.
#[derive(Debug, Clone)]
pub struct MiniMaxH3AudioVaeDecoder {
    cfg: MiniMaxH3AudioVaeConfig,
    dec_in_proj: candle_nn::Linear,
    conv_pre: Conv1d,
    ups: Vec<Upsample>,
    /// `resblock_kernel_sizes.len()` blocks per stage, stage-major.
    resblocks: Vec<AmpBlock>,
    activation_post: AliasFreeSnakeBeta,
    conv_post: Conv1d,
}

impl MiniMaxH3AudioVaeDecoder {
    /// Loads the decoder from the audio VAE root `vb`.
    pub fn new(cfg: &MiniMaxH3AudioVaeConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let (ca, dim) = (cfg.latent_channels, cfg.latent_dim);
        let pvb = vb.pp("dec_in_proj");
        let dec_in_proj = candle_nn::Linear::new(
            pvb.get((dim, ca, 1), "weight")?.reshape((dim, ca))?,
            Some(pvb.get(dim, "bias")?),
        );
        let dvb = vb.pp("decoder");
        let conv_pre =
            Conv1d::weight_normed(dim, cfg.decoder_dim, 7, 1, 3, true, dvb.pp("conv_pre"))?;
        let mut ups = Vec::new();
        let mut resblocks = Vec::new();
        let mut channels = cfg.decoder_dim;
        for (i, (&rate, &kernel)) in cfg
            .decoder_rates
            .iter()
            .zip(&cfg.decoder_kernel_sizes)
            .enumerate()
        {
            let uvb = dvb.pp(format!("ups.{i}.0"));
            let out = channels / 2;
            ups.push(Upsample {
                // ConvTranspose1d weights are [in, out, k]: weight norm runs over axis 0 = in.
                weight: WeightNormed::new(&uvb, (channels, out, kernel))?,
                bias: uvb.get(out, "bias")?,
                stride: rate,
                padding: (kernel - rate) / 2,
            });
            channels = out;
            for (j, (&k, dilations)) in cfg
                .resblock_kernel_sizes
                .iter()
                .zip(&cfg.resblock_dilation_sizes)
                .enumerate()
            {
                let index = i * cfg.resblock_kernel_sizes.len() + j;
                resblocks.push(AmpBlock::new(
                    channels,
                    k,
                    dilations,
                    dvb.pp(format!("resblocks.{index}")),
                )?);
            }
        }
        Ok(Self {
            dec_in_proj,
            conv_pre,
            ups,
            resblocks,
            activation_post: AliasFreeSnakeBeta::new(channels, dvb.pp("activation_post"))?,
            conv_post: Conv1d::weight_normed(channels, 1, 7, 1, 3, false, dvb.pp("conv_post"))?,
            cfg: cfg.clone(),
        })
    }

    /// The configuration the decoder was built with.
    pub fn config(&self) -> &MiniMaxH3AudioVaeConfig {
        &self.cfg
    }

    /// `z * latents_std + latents_mean` per channel of `[B, Ca, N]` normalised latents.
    pub fn denormalize(&self, latents: &Tensor) -> Result<Tensor> {
        let c = self.cfg.latent_channels;
        let device = latents.device();
        let mut z = latents.clone();
        if let Some(std) = &self.cfg.latents_std {
            z = z.broadcast_mul(&Tensor::new(std.as_slice(), device)?.reshape((1, c, 1))?)?;
        }
        if let Some(mean) = &self.cfg.latents_mean {
            z = z.broadcast_add(&Tensor::new(mean.as_slice(), device)?.reshape((1, c, 1))?)?;
        }
        Ok(z)
    }

    /// `dec_in_proj` (1x1 conv): `[B, Ca, N]` -> `[B, latent_dim, N]`.
    pub fn project_in(&self, latents: &Tensor) -> Result<Tensor> {
        // The transposed view must be made contiguous: candle 0.11's CPU batched matmul returns
        // wrong values for it with a batch > 1 (huggingface/candle#3758).
        self.dec_in_proj
            .forward(&latents.transpose(1, 2)?.contiguous()?)?
            .transpose(1, 2)?
            .contiguous()
    }

    /// `audio_vae.decode` of denormalised latents `[B, Ca, N]`: the waveform `[B, 1, N·hop]`,
    /// clamped to [-1, 1].
    pub fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        let (_, c, _) = latents.dims3()?;
        if c != self.cfg.latent_channels {
            candle_core::bail!(
                "audio latents have {c} channels, the audio VAE expects {}",
                self.cfg.latent_channels
            );
        }
        let mut x = self.conv_pre.forward(&self.project_in(latents)?)?;
        let per_stage = self.cfg.resblock_kernel_sizes.len();
        for (i, up) in self.ups.iter().enumerate() {
            x = up.forward(&x)?;
            let mut sum: Option<Tensor> = None;
            for block in &self.resblocks[i * per_stage..(i + 1) * per_stage] {
                let y = block.forward(&x)?;
                sum = Some(match sum {
                    Some(s) => (s + y)?,
                    None => y,
                });
            }
            x = match sum {
                Some(s) => (s / per_stage as f64)?,
                None => x,
            };
        }
        let x = self.conv_post.forward(&self.activation_post.forward(&x)?)?;
        x.clamp(-1f32, 1f32)
    }
}

/// The pipeline's stereo layout: the `[channels, 1, samples]` batch of mono decodes ->
/// `[1, channels, samples]` (left, right).
pub fn stereo_from_batch(waveform: &Tensor) -> Result<Tensor> {
    waveform.permute((1, 0, 2))
}

crate::placed_whole!(
    MiniMaxH3AudioVaeDecoder,
    MiniMaxH3AudioVaeConfig,
    MiniMaxH3AudioVaeDecoder::new
);
