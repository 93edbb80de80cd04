//! MP4 writer: H.264 (libx264), yuv420p, through the FFmpeg libraries; with a model's sound, an
//! AAC track of the video's length beside it.

use super::audio::{AacTrack, Audio};
use super::{Clip, Partial};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::Tensor;
use ffmpeg::{codec, encoder, format, frame, software::scaling, Dictionary, Packet, Rational};
use ffmpeg_next as ffmpeg;
use std::path::Path;
use std::sync::Once;

/// x264 constant rate factor: imageio-ffmpeg's mapping of diffusers' default quality 5
/// (`int((1 - 5/10) * 51)`), so the files look like `export_to_video`'s.
const CRF: &str = "25";

/// Writes `frames` ([F, H, W, 3] in [0, 1]) as an H.264 yuv420p MP4 at `fps` frames per second.
///
/// Pixels become `(x * 255) as u8` (truncation, like diffusers' `export_to_video`). `metadata`
/// pairs are stored as container tags (any key; standard ones like `title` or `comment` are
/// understood by every player). Width and height must be even (yuv420p).
pub fn write_mp4(
    path: &Path,
    frames: &Tensor,
    fps: u32,
    metadata: &[(String, String)],
) -> Result<()> {
    write_mp4_with(path, frames, None, fps, metadata, true)
}

/// [`write_mp4`] with `audio` muxed in, replacing a file at `path` only when `replace`.
pub(super) fn write_mp4_with(
    path: &Path,
    frames: &Tensor,
    audio: Option<&Audio>,
    fps: u32,
    metadata: &[(String, String)],
    replace: bool,
) -> Result<()> {
    let run = || -> Result<()> {
        let clip = Clip::from_tensor(frames)?;
        if fps == 0 || fps > i32::MAX as u32 {
            bail!("fps must be a positive integer, got {fps}");
        }
        if clip.width % 2 != 0 || clip.height % 2 != 0 {
            bail!(
                "H.264 yuv420p needs an even width and height, got {}x{}",
                clip.width,
                clip.height
            );
        }
        let temp = Partial::file(path)?;
        encode(&clip, audio, temp.path(), fps, metadata)?;
        temp.commit(path, replace)
    };
    run().with_context(|| format!("writing MP4 {}", path.display()))
}

/// Initialises FFmpeg once and keeps its (and x264's) informational logging off stderr.
fn init() -> Result<()> {
    static LOG: Once = Once::new();
    ffmpeg::init().context("initialising FFmpeg")?;
    LOG.call_once(|| ffmpeg::log::set_level(ffmpeg::log::Level::Error));
    Ok(())
}

/// Encodes the whole clip into `out` (the temporary file).
fn encode(
    clip: &Clip,
    audio: Option<&Audio>,
    out: &Path,
    fps: u32,
    metadata: &[(String, String)],
) -> Result<()> {
    init()?;
    // ffmpeg-next panics on non-UTF-8 paths or NUL bytes: refuse them here instead.
    let out_str = out
        .to_str()
        .filter(|s| !s.contains('\0'))
        .with_context(|| format!("{} is not a valid UTF-8 path", out.display()))?;
    let (width, height) = (
        u32::try_from(clip.width).context("frame width")?,
        u32::try_from(clip.height).context("frame height")?,
    );
    let fps = fps as i32;
    let time_base = Rational(1, fps);

    let mut octx = format::output_as(&out_str, "mp4").map_err(ff("opening the output"))?;
    let global_header = octx.format().flags().contains(format::Flags::GLOBAL_HEADER);
    let codec = encoder::find_by_name("libx264")
        .ok_or_else(|| anyhow!("this FFmpeg build has no libx264 encoder"))?;
    let mut ost = octx
        .add_stream(codec)
        .map_err(ff("adding the video stream"))?;
    let mut enc = codec::context::Context::new_with_codec(codec)
        .encoder()
        .video()
        .map_err(ff("creating the encoder"))?;
    enc.set_width(width);
    enc.set_height(height);
    enc.set_format(format::Pixel::YUV420P);
    enc.set_time_base(time_base);
    enc.set_frame_rate(Some(Rational(fps, 1)));
    if global_header {
        enc.set_flags(codec::Flags::GLOBAL_HEADER);
    }
    let mut opts = Dictionary::new();
    opts.set("preset", "medium");
    opts.set("crf", CRF);
    let mut enc = enc.open_with(opts).map_err(ff("opening libx264"))?;
    ost.set_parameters(&enc);
    ost.set_time_base(time_base);
    ost.set_avg_frame_rate(Rational(fps, 1));
    ost.set_rate(Rational(fps, 1));
    let seconds = clip.frames as f64 / f64::from(fps);
    let track = audio
        .map(|a| AacTrack::add(&mut octx, a, seconds, global_header))
        .transpose()?;

    let mut tags = Dictionary::new();
    for (k, v) in metadata {
        // FFmpeg's tags are C strings: a NUL byte (from a prompt) would end them, and
        // ffmpeg-next panics on it. Store it escaped, the way JSON writes it.
        tags.set(&escape_nul(k), &escape_nul(v));
    }
    octx.set_metadata(tags);
    let mut mux_opts = Dictionary::new();
    // use_metadata_tags keeps arbitrary keys; faststart puts the index first for streaming.
    mux_opts.set("movflags", "+use_metadata_tags+faststart");
    octx.write_header_with(mux_opts)
        .map_err(ff("writing the MP4 header"))?;
    let stream_tb = octx
        .stream(0)
        .ok_or_else(|| anyhow!("the muxer lost the video stream"))?
        .time_base();

    let mut scaler = scaling::Context::get(
        format::Pixel::RGB24,
        width,
        height,
        format::Pixel::YUV420P,
        width,
        height,
        scaling::Flags::BICUBIC,
    )
    .map_err(ff("creating the RGB to YUV converter"))?;
    let mut rgb = frame::Video::new(format::Pixel::RGB24, width, height);
    let row = clip.width * 3;
    for i in 0..clip.frames {
        let stride = rgb.stride(0);
        let data = rgb.data_mut(0);
        clip.with_frame(i, |values| {
            for (y, src) in values.chunks_exact(row).enumerate() {
                for (dst, &x) in data[y * stride..y * stride + row].iter_mut().zip(src) {
                    *dst = (x * 255.0) as u8;
                }
            }
        })?;
        let mut yuv = frame::Video::empty();
        scaler
            .run(&rgb, &mut yuv)
            .map_err(ff("converting RGB to YUV"))?;
        yuv.set_pts(Some(i as i64));
        enc.send_frame(&yuv).map_err(ff("encoding a frame"))?;
        drain(&mut enc, &mut octx, 0, time_base, stream_tb)?;
    }
    enc.send_eof().map_err(ff("flushing the encoder"))?;
    drain(&mut enc, &mut octx, 0, time_base, stream_tb)?;
    if let Some(track) = track {
        track.write(&mut octx)?;
    }
    octx.write_trailer().map_err(ff("finishing the MP4"))?;
    Ok(())
}

/// `text` with every NUL byte written as `\\u0000`, so it fits in a C string.
fn escape_nul(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') {
        text.replace('\0', "\\u0000").into()
    } else {
        text.into()
    }
}

/// Moves every packet the encoder has ready into stream `stream` of the container.
pub(super) fn drain(
    enc: &mut encoder::Encoder,
    octx: &mut format::context::Output,
    stream: usize,
    enc_tb: Rational,
    stream_tb: Rational,
) -> Result<()> {
    let mut packet = Packet::empty();
    loop {
        match enc.receive_packet(&mut packet) {
            Ok(()) => {
                packet.set_stream(stream);
                packet.rescale_ts(enc_tb, stream_tb);
                packet
                    .write_interleaved(octx)
                    .map_err(ff("writing a packet"))?;
            }
            Err(ffmpeg::Error::Eof) => return Ok(()),
            Err(ffmpeg::Error::Other { errno }) if errno == ffmpeg::error::EAGAIN => return Ok(()),
            Err(e) => return Err(ff("receiving a packet")(e)),
        }
    }
}

/// Turns an FFmpeg error into an anyhow error saying what was being done.
pub(super) fn ff(what: &'static str) -> impl Fn(ffmpeg::Error) -> anyhow::Error {
    move |e| anyhow!("FFmpeg: {what}: {e}")
}
