//! The sound of a model that makes it (MiniMax H3): a WAV file, and an AAC track muxed into the
//! MP4 beside the video.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::path::Path;

/// The file name of the waveform inside a PNG frame folder.
pub const WAV_NAME: &str = "audio.wav";

/// A waveform in [-1, 1]: one row of samples per channel, with its sample rate.
#[derive(Clone, Debug)]
pub struct Audio {
    /// `[channels, samples]` f32 on the CPU.
    samples: Tensor,
    sample_rate: u32,
}

impl Audio {
    /// `samples` `[channels, samples]` (any dtype, any device) at `sample_rate` Hz.
    pub fn new(samples: Tensor, sample_rate: u32) -> Result<Self> {
        let (channels, n) = samples
            .dims2()
            .context("audio must be [channels, samples]")?;
        if channels == 0 || n == 0 || sample_rate == 0 {
            bail!(
                "audio must have channels, samples and a sample rate, got [{channels}, {n}] at {sample_rate} Hz"
            );
        }
        Ok(Audio {
            samples: samples.to_dtype(DType::F32)?.to_device(&Device::Cpu)?,
            sample_rate,
        })
    }

    /// The waveform `[channels, samples]` in f32.
    pub fn samples(&self) -> &Tensor {
        &self.samples
    }

    pub fn sample_rate(&self) -> u32 {
        self.sample_rate
    }

    /// Each channel's samples.
    fn planes(&self) -> Result<Vec<Vec<f32>>> {
        Ok(self.samples.to_vec2::<f32>()?)
    }
}

/// Writes `audio` as a 16-bit PCM WAV file at `path` (samples clamped to [-1, 1], rounded).
pub fn write_wav(path: &Path, audio: &Audio) -> Result<()> {
    let planes = audio.planes()?;
    let (channels, n) = (planes.len(), planes[0].len());
    let data_bytes = u32::try_from(channels * n * 2)
        .ok()
        .filter(|b| *b <= u32::MAX - 36)
        .context("the audio is too long for a WAV file")?;
    let block_align = (channels * 2) as u16;
    let mut out = Vec::with_capacity(44 + data_bytes as usize);
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data_bytes).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes()); // PCM
    out.extend_from_slice(&(channels as u16).to_le_bytes());
    out.extend_from_slice(&audio.sample_rate.to_le_bytes());
    out.extend_from_slice(&(audio.sample_rate * u32::from(block_align)).to_le_bytes());
    out.extend_from_slice(&block_align.to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(b"data");
    out.extend_from_slice(&data_bytes.to_le_bytes());
    for i in 0..n {
        for plane in &planes {
            let v = (plane[i].clamp(-1.0, 1.0) * 32767.0).round() as i16;
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// `planes` resampled from `from` Hz to `to` Hz by linear interpolation, `length` samples each.
#[cfg(any(test, feature = "mp4"))]
fn resample(planes: &[Vec<f32>], from: u32, to: u32, length: usize) -> Vec<Vec<f32>> {
    let ratio = f64::from(from) / f64::from(to);
    planes
        .iter()
        .map(|p| {
            (0..length)
                .map(|i| {
                    let x = i as f64 * ratio;
                    let (k, frac) = (x.floor() as usize, (x - x.floor()) as f32);
                    let a = p.get(k).or(p.last()).copied().unwrap_or(0.0);
                    let b = p.get(k + 1).copied().unwrap_or(a);
                    a + (b - a) * frac
                })
                .collect()
        })
        .collect()
}

#[cfg(feature = "mp4")]
pub(super) use aac::AacTrack;

#[cfg(feature = "mp4")]
mod aac {
    use super::{resample, Audio};
    use crate::output::mp4::{drain, ff};
    use anyhow::{anyhow, bail, Result};
    use ffmpeg::{codec, encoder, format, frame, ChannelLayout, Rational};
    use ffmpeg_next as ffmpeg;

    /// AAC bit rate per channel.
    const BIT_RATE_PER_CHANNEL: usize = 96_000;

    /// An AAC stream of an MP4 being written, with the samples it will hold.
    pub struct AacTrack {
        encoder: encoder::Audio,
        stream: usize,
        planes: Vec<Vec<f32>>,
        layout: ChannelLayout,
        rate: i32,
    }

    impl AacTrack {
        /// Adds the stream to `octx` (before its header is written). The track lasts exactly
        /// `seconds` (the video's length): the waveform is cut or padded with silence to it. AAC
        /// takes only standard sample rates: audio at another rate is resampled (linearly) to
        /// the lowest standard rate above it.
        pub fn add(
            octx: &mut format::context::Output,
            audio: &Audio,
            seconds: f64,
            global_header: bool,
        ) -> Result<Self> {
            let codec = encoder::find(codec::Id::AAC)
                .ok_or_else(|| anyhow!("this FFmpeg build has no AAC encoder"))?;
            let planes = audio.planes()?;
            let layout = match planes.len() {
                1 => ChannelLayout::MONO,
                2 => ChannelLayout::STEREO,
                n => bail!("AAC output takes mono or stereo audio, not {n} channels"),
            };
            let rates: Vec<i32> = codec
                .audio()
                .map_err(ff("reading the AAC encoder"))?
                .rates()
                .map(|r| r.collect())
                .unwrap_or_default();
            let source = audio.sample_rate() as i32;
            let rate = if rates.is_empty() || rates.contains(&source) {
                source
            } else {
                rates
                    .iter()
                    .copied()
                    .filter(|&r| r >= source)
                    .min()
                    .or_else(|| rates.iter().copied().max())
                    .unwrap_or(source)
            };
            let length = (seconds * f64::from(rate)).round() as usize;
            let planes = resample(&planes, source as u32, rate as u32, length);

            let mut ost = octx
                .add_stream(codec)
                .map_err(ff("adding the audio stream"))?;
            let mut enc = codec::context::Context::new_with_codec(codec)
                .encoder()
                .audio()
                .map_err(ff("creating the AAC encoder"))?;
            enc.set_rate(rate);
            enc.set_channel_layout(layout);
            enc.set_format(format::Sample::F32(format::sample::Type::Planar));
            enc.set_bit_rate(BIT_RATE_PER_CHANNEL * planes.len());
            enc.set_time_base(Rational(1, rate));
            if global_header {
                enc.set_flags(codec::Flags::GLOBAL_HEADER);
            }
            let encoder = enc.open_as(codec).map_err(ff("opening the AAC encoder"))?;
            ost.set_parameters(&encoder);
            ost.set_time_base(Rational(1, rate));
            Ok(AacTrack {
                encoder,
                stream: ost.index(),
                planes,
                layout,
                rate,
            })
        }

        /// Encodes every sample into the stream (after the header is written).
        pub fn write(mut self, octx: &mut format::context::Output) -> Result<()> {
            let stream_tb = octx
                .stream(self.stream)
                .ok_or_else(|| anyhow!("the muxer lost the audio stream"))?
                .time_base();
            let enc_tb = Rational(1, self.rate);
            let total = self.planes[0].len();
            let step = match self.encoder.frame_size() as usize {
                0 => 1024,
                n => n,
            };
            let sample_format = format::Sample::F32(format::sample::Type::Planar);
            for start in (0..total).step_by(step) {
                let len = step.min(total - start);
                let mut frame = frame::Audio::new(sample_format, len, self.layout);
                frame.set_rate(self.rate as u32);
                for (c, plane) in self.planes.iter().enumerate() {
                    frame.plane_mut::<f32>(c)[..len].copy_from_slice(&plane[start..start + len]);
                }
                frame.set_pts(Some(start as i64));
                self.encoder
                    .send_frame(&frame)
                    .map_err(ff("encoding audio"))?;
                drain(&mut self.encoder, octx, self.stream, enc_tb, stream_tb)?;
            }
            self.encoder
                .send_eof()
                .map_err(ff("flushing the AAC encoder"))?;
            drain(&mut self.encoder, octx, self.stream, enc_tb, stream_tb)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The WAV header says what the data holds, and the samples come back as written.
    #[test]
    fn wav_holds_the_interleaved_samples() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("vidgen-wav-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("a.wav");
        let samples = Tensor::new(&[[0.5f32, -1.0, 2.0], [0.0, 0.25, -0.5]], &Device::Cpu)?;
        write_wav(&path, &Audio::new(samples, 320)?)?;
        let bytes = std::fs::read(&path)?;
        assert_eq!(&bytes[0..4], b"RIFF");
        assert_eq!(u16::from_le_bytes([bytes[22], bytes[23]]), 2, "channels");
        assert_eq!(
            u32::from_le_bytes(bytes[24..28].try_into().unwrap()),
            320,
            "rate"
        );
        let data: Vec<i16> = bytes[44..]
            .chunks_exact(2)
            .map(|b| i16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(data, vec![16384, 0, -32767, 8192, 32767, -16384]);
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    /// Linear resampling keeps the ends and interpolates between samples.
    #[test]
    fn resampling_interpolates() {
        let out = resample(&[vec![0.0, 1.0]], 1, 4, 6);
        assert_eq!(out[0], vec![0.0, 0.25, 0.5, 0.75, 1.0, 1.0]);
    }
}
