//! MiniMax H3's audio VAE decoder (diffusers `AutoencoderKLMiniMaxH3Audio`, decode path only):
//! a 1x1 `dec_in_proj` then a BigVGAN vocoder with alias-free SnakeBeta activations. The VAE is
//! mono; the pipeline decodes stereo as a batch of two. The encoder (reference-audio workflows
//! only) is not implemented.

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Module, Result, Shape, Tensor};
use candle_nn::VarBuilder;
use rayon::prelude::*;
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

/// The resampling around BigVGAN's activations (diffusers' `MiniMaxH3AudioActivation1d`
/// defaults): `ratio`x upsampling by a replicate-padded transposed convolution with a `taps`
/// Kaiser-sinc filter, cropped; the activation; a replicate-padded low-pass of `taps` with stride
/// `ratio`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Resampling {
    pub ratio: usize,
    pub taps: usize,
}

impl Resampling {
    const BIGVGAN: Self = Self { ratio: 2, taps: 12 };

    /// Input samples replicated on each side before the transposed convolution.
    pub fn pad_up(self) -> usize {
        self.taps / self.ratio - 1
    }

    /// Samples of the transposed convolution's output cropped on the left.
    pub fn crop_left(self) -> usize {
        self.pad_up() * self.ratio + (self.taps - self.ratio) / 2
    }

    /// Upsampled samples replicated on the left before the low-pass.
    pub fn down_left(self) -> usize {
        self.taps / 2 - usize::from(self.taps.is_multiple_of(2))
    }
}

/// BigVGAN's alias-free SnakeBeta: 2x Kaiser-sinc upsampling, `x + sin²(e^α x) / (e^β + 1e-9)`,
/// low-pass 2x downsampling. The filters are the checkpoint's stored buffers. One pass over the
/// input, each output sample from the few input samples its filters reach (one kernel on CUDA):
/// composed of tensor ops it was ~200 launches per activation.
#[derive(Debug, Clone)]
struct AliasFreeSnakeBeta {
    /// `exp(α)` per channel.
    alpha: Tensor,
    /// `1 / (exp(β) + 1e-9)` per channel.
    inv_beta: Tensor,
    up_filter: Tensor,
    down_filter: Tensor,
}

impl AliasFreeSnakeBeta {
    fn new(channels: usize, vb: VarBuilder) -> Result<Self> {
        let taps = Resampling::BIGVGAN.taps;
        let alpha = vb.get(channels, "act.alpha")?.exp()?;
        let beta = vb.get(channels, "act.beta")?.exp()?;
        Ok(Self {
            alpha,
            inv_beta: (beta + 1e-9)?.recip()?,
            up_filter: vb.get((1, 1, taps), "upsample.filter")?.flatten_all()?,
            down_filter: vb
                .get((1, 1, taps), "downsample.lowpass.filter")?
                .flatten_all()?,
        })
    }

    /// `[B, C, L]` -> `[B, C, L]`, computed in f32 (the audio VAE's dtype) and returned in `x`'s.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        let [alpha, inv_beta, up, down] = [
            &self.alpha,
            &self.inv_beta,
            &self.up_filter,
            &self.down_filter,
        ]
        .map(|t| t.to_dtype(DType::F32));
        let (alpha, inv_beta, up, down) = (alpha?, inv_beta?, up?, down?);
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return crate::models::audio_ops::snake_beta_resample(
                &x,
                &alpha,
                &inv_beta,
                (&up, &down),
                Resampling::BIGVGAN,
            )?
            .to_dtype(dtype);
        }
        let host = HostSnakeBeta {
            alpha: alpha.to_device(&Device::Cpu)?.to_vec1()?,
            inv_beta: inv_beta.to_device(&Device::Cpu)?.to_vec1()?,
            up: up.to_device(&Device::Cpu)?.to_vec1()?,
            down: down.to_device(&Device::Cpu)?.to_vec1()?,
            resampling: Resampling::BIGVGAN,
        };
        x.apply_op1_no_bwd(&host)?.to_dtype(dtype)
    }
}

/// [`AliasFreeSnakeBeta`] on the host: per row, the activation of the upsampled signal, then its
/// low-pass; the same sums in the same order as `snake_beta_resample_f32`.
struct HostSnakeBeta {
    alpha: Vec<f32>,
    inv_beta: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    resampling: Resampling,
}

impl HostSnakeBeta {
    /// One row (`channel`'s) of `x` into `y`.
    fn row(&self, channel: usize, x: &[f32], y: &mut [f32]) {
        let Resampling { ratio, taps } = self.resampling;
        let (length, pad_up, crop_left) = (
            x.len(),
            self.resampling.pad_up(),
            self.resampling.crop_left(),
        );
        let padded = length + 2 * pad_up;
        let (a, ib) = (self.alpha[channel], self.inv_beta[channel]);
        let activation: Vec<f32> = (0..length * ratio)
            .map(|t| {
                let top = t + crop_left;
                let lo = (top + 1).saturating_sub(taps).div_ceil(ratio);
                let hi = (top / ratio).min(padded - 1);
                let mut u = 0f32;
                for j in lo..=hi {
                    u += self.up[top - ratio * j] * x[j.saturating_sub(pad_up).min(length - 1)];
                }
                u *= ratio as f32;
                let s = (a * u).sin();
                u + s * s * ib
            })
            .collect();
        let down_left = self.resampling.down_left();
        for (n, out) in y.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (m, g) in self.down.iter().enumerate() {
                let t = (n * ratio + m)
                    .saturating_sub(down_left)
                    .min(activation.len() - 1);
                acc += g * activation[t];
            }
            *out = acc;
        }
    }
}

impl CustomOp1 for HostSnakeBeta {
    fn name(&self) -> &'static str {
        "alias-free-snake-beta"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(values), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("alias-free SnakeBeta: contiguous f32 input")
        };
        let (_, channels, length) = layout.shape().dims3()?;
        if channels != self.alpha.len() || length == 0 {
            candle_core::bail!(
                "alias-free SnakeBeta: {:?} against {} channels",
                layout.shape(),
                self.alpha.len()
            )
        }
        let x = &values[start..end];
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(length)
            .zip(x.par_chunks(length))
            .enumerate()
            .for_each(|(row, (y, x))| self.row(row % channels, x, y));
        Ok((CpuStorage::F32(y), layout.shape().clone()))
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
    /// The unpadded transposed convolution, cropped by `padding` on each side: the same sums,
    /// and candle takes its matmul path (one GEMM and a col2im) without padding, its direct
    /// kernel (slow on CUDA) with it. That GEMM reads the input channels last: stored so, as
    /// candle 0.11's CPU batched matmul returns wrong values for the transposed view of a
    /// channels-first input with a batch > 1 (huggingface/candle#3758).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let channels_last = x.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
        let full =
            channels_last.conv_transpose1d(&self.weight.kernel()?, 0, 0, self.stride, 1, 1)?;
        let length = full.dim(2)? - 2 * self.padding;
        full.narrow(2, self.padding, length)?
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

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    //! The audio VAE's CUDA paths against the host's, f32, at a stage's shape of the published
    //! decoder (two batch entries).
    use super::*;
    use crate::models::row_ops::test_util::device;
    use std::collections::HashMap;

    fn randn(shape: &[usize], std: f32, dev: &Device) -> Result<Tensor> {
        Tensor::randn(0f32, std, shape, dev)
    }

    /// Largest difference of `got` from `want`, over `want`'s largest magnitude.
    fn relative_max(got: &Tensor, want: &Tensor) -> Result<f32> {
        let got = got.to_device(&Device::Cpu)?;
        let diff = (&got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok(diff / want.abs()?.max_all()?.to_scalar::<f32>()?)
    }

    #[test]
    fn snake_beta_kernel_matches_the_host() -> Result<()> {
        let Some(dev) = device("audio VAE SnakeBeta") else {
            return Ok(());
        };
        let (channels, length) = (64, 5175);
        let taps = Resampling::BIGVGAN.taps;
        let mut weights = HashMap::new();
        weights.insert("act.alpha".to_string(), randn(&[channels], 0.5, &dev)?);
        weights.insert("act.beta".to_string(), randn(&[channels], 0.5, &dev)?);
        for name in ["upsample.filter", "downsample.lowpass.filter"] {
            weights.insert(name.to_string(), randn(&[1, 1, taps], 0.3, &dev)?);
        }
        let host_weights = weights
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.to_device(&Device::Cpu)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        let gpu = AliasFreeSnakeBeta::new(
            channels,
            VarBuilder::from_tensors(weights, DType::F32, &dev),
        )?;
        let host = AliasFreeSnakeBeta::new(
            channels,
            VarBuilder::from_tensors(host_weights, DType::F32, &Device::Cpu),
        )?;
        let x = randn(&[2, channels, length], 2.0, &Device::Cpu)?;
        let want = host.forward(&x)?;
        let got = gpu.forward(&x.to_device(&dev)?)?;
        assert_eq!(got.dims(), [2, channels, length]);
        let err = relative_max(&got, &want)?;
        assert!(err < 1e-5, "SnakeBeta on the GPU off the host's by {err}");
        Ok(())
    }

    #[test]
    fn upsample_matches_the_host() -> Result<()> {
        let Some(dev) = device("audio VAE upsampling") else {
            return Ok(());
        };
        // The published first stage: 1024 -> 512 channels, rate 5, kernel 9 (padding 2).
        let (cin, cout, kernel, rate, length) = (1024, 512, 9, 5, 207);
        let host = Upsample {
            weight: WeightNormed {
                v: randn(&[cin, cout, kernel], 1.0, &Device::Cpu)?,
                g: randn(&[cin, 1, 1], 1.0, &Device::Cpu)?,
            },
            bias: randn(&[cout], 1.0, &Device::Cpu)?,
            stride: rate,
            padding: (kernel - rate) / 2,
        };
        let gpu = Upsample {
            weight: WeightNormed {
                v: host.weight.v.to_device(&dev)?,
                g: host.weight.g.to_device(&dev)?,
            },
            bias: host.bias.to_device(&dev)?,
            ..host.clone()
        };
        let x = randn(&[2, cin, length], 1.0, &Device::Cpu)?;
        let want = host.forward(&x)?;
        assert_eq!(want.dims(), [2, cout, length * rate]);
        // Against the padded transposed convolution (candle's direct kernel) on the host.
        let direct = x
            .conv_transpose1d(&host.weight.kernel()?, host.padding, 0, rate, 1, 1)?
            .broadcast_add(&host.bias.reshape((1, (), 1))?)?;
        assert!(relative_max(&want, &direct)? < 1e-5);
        let err = relative_max(&gpu.forward(&x.to_device(&dev)?)?, &want)?;
        assert!(err < 1e-4, "upsampling on the GPU off the host's by {err}");
        Ok(())
    }
}
