//! The packed sequence of a `t2va` request (diffusers `MiniMaxH3PrepareLayoutStep`): rows
//! `[text (L) | audio left (Na) | audio right (Na) | video (F·h·w patches)]`, their modality
//! tags, (t, h, w) rotary coordinates and per-row timesteps, plus packing and unpacking of the
//! latents into rows.

use candle_core::{DType, Device, Result, Tensor};

use super::transformer::{PackedLayout, TAG_AUDIO, TAG_TEXT, TAG_VIDEO};

/// Rotary time units per latent frame group: one latent frame spans `5/3 · (1, 4, 4, 4, 4)[f % 5]`
/// (the VAE's 17-frames-to-5-latents grouping, in units of 24 fps · 5/3 per audio latent).
const ROPE_FRAME_RESCALE: f64 = 5.0 / 3.0;
const ROPE_FRAMES_PER_LATENT: [f64; 5] = [1.0, 4.0, 4.0, 4.0, 4.0];
/// Spatial rotary axes are normalised by √(latent area) and scaled by this.
const ROPE_SPATIAL_SCALE: f64 = 32.0;

/// Sizes of one `t2va` request in latent units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutSizes {
    /// Text tokens (L).
    pub num_text_tokens: usize,
    /// Latent frames (F).
    pub num_latent_frames: usize,
    /// Latent height.
    pub latent_height: usize,
    /// Latent width.
    pub latent_width: usize,
    /// Audio latents per channel (Na).
    pub num_audio_latents: usize,
    /// Audio channels packed channel-major (2: stereo).
    pub audio_channels: usize,
}

/// `np.linspace(left, left + ratio, num, endpoint=False) · 32` for one spatial axis of `dim`
/// latents: numpy's `i·step + start` with `step = (stop − start) / num`, in f64.
fn spatial_grid(dim: usize, patch: usize, sqrt_area: f64) -> Vec<f64> {
    let ratio = dim as f64 / sqrt_area;
    let left = (1.0 - ratio) / 2.0;
    let num = dim / patch;
    let step = ((left + ratio) - left) / num as f64;
    (0..num)
        .map(|i| (i as f64 * step + left) * ROPE_SPATIAL_SCALE)
        .collect()
}

/// The packed layout of a `t2va` request for a transformer with `patch_size`; every text row is
/// tagged text. `position_ids` are f64 as diffusers builds them (the transformer casts to f32).
pub fn t2va_layout(
    sizes: &LayoutSizes,
    patch_size: [usize; 3],
    device: &Device,
) -> Result<PackedLayout> {
    let [patch_t, patch_h, patch_w] = patch_size;
    let LayoutSizes {
        num_text_tokens: text,
        num_latent_frames: frames,
        latent_height,
        latent_width,
        num_audio_latents,
        audio_channels,
    } = *sizes;
    if patch_t != 1 {
        candle_core::bail!(
            "patch_size[0] = {patch_t}: the t2va layout packs one latent frame per row group"
        );
    }
    if patch_h == 0 || patch_w == 0 || latent_height % patch_h != 0 || latent_width % patch_w != 0 {
        candle_core::bail!(
            "latent size {latent_height}x{latent_width} is not a multiple of the patch {patch_h}x{patch_w}"
        );
    }
    if frames == 0 || latent_height == 0 || latent_width == 0 {
        candle_core::bail!("the video needs at least one latent frame, row and column");
    }
    let sqrt_area = ((latent_height * latent_width) as f64).sqrt();
    let height_grid = spatial_grid(latent_height, patch_h, sqrt_area);
    let width_grid = spatial_grid(latent_width, patch_w, sqrt_area);
    let rows_per_frame = height_grid.len() * width_grid.len();
    let audio_rows = num_audio_latents * audio_channels;
    let seq = text + audio_rows + frames * rows_per_frame;

    let mut positions = Vec::with_capacity(seq * 3);
    let mut tags = Vec::with_capacity(seq);
    for i in 0..text {
        positions.extend([i as f64, 0.0, 0.0]);
        tags.push(TAG_TEXT as i64);
    }
    // Audio rows share the video's rotary clock (one unit per latent), no height, and sit at
    // the left (first channel) and right (every later channel) extreme of the width grid.
    for channel in 0..audio_channels {
        let w = if channel == 0 {
            width_grid[0]
        } else {
            width_grid[width_grid.len() - 1]
        };
        for k in 0..num_audio_latents {
            positions.extend([text as f64 + k as f64, 0.0, w]);
            tags.push(TAG_AUDIO as i64);
        }
    }
    // Video frames: cumulative rotary time with the (1, 4, 4, 4, 4) · 5/3 spacing, summed in
    // order as torch's cumsum does.
    let mut elapsed = 0.0f64;
    for f in 0..frames {
        let t = text as f64 + elapsed;
        for &h in &height_grid {
            for &w in &width_grid {
                positions.extend([t, h, w]);
                tags.push(TAG_VIDEO as i64);
            }
        }
        elapsed += ROPE_FRAME_RESCALE * ROPE_FRAMES_PER_LATENT[f % ROPE_FRAMES_PER_LATENT.len()];
    }
    let range = |start: usize, end: usize| Tensor::arange(start as i64, end as i64, device);
    Ok(PackedLayout {
        token_tags: Tensor::from_vec(tags, seq, device)?,
        position_ids: Tensor::from_vec(positions, (seq, 3), device)?,
        video_indices: range(text + audio_rows, seq)?,
        audio_indices: range(text, text + audio_rows)?,
        text_indices: range(0, text)?,
    })
}

/// The transformer's `(timestep, timestep_indices)` for one step of a `t2va` request: the sorted
/// distinct values of the video and audio timesteps, and per row the index of its own (text rows
/// take the video timestep, audio rows the audio one).
pub fn row_timesteps(
    layout: &PackedLayout,
    video_timestep: f32,
    audio_timestep: f32,
) -> Result<(Tensor, Tensor)> {
    let (values, video_index, audio_index) =
        crate::schedulers::minimax_h3::distinct_timesteps(video_timestep, audio_timestep);
    let device = layout.token_tags.device();
    let seq = layout.token_tags.dim(0)?;
    let mut indices = vec![video_index as i64; seq];
    for a in layout
        .audio_indices
        .to_dtype(DType::I64)?
        .to_vec1::<i64>()?
    {
        let slot = usize::try_from(a)
            .ok()
            .filter(|&a| a < seq)
            .ok_or_else(|| {
                candle_core::Error::Msg(format!("audio index {a} outside the sequence"))
            })?;
        indices[slot] = audio_index as i64;
    }
    Ok((
        Tensor::new(values.as_slice(), device)?,
        Tensor::from_vec(indices, seq, device)?,
    ))
}

/// Audio latents `[channels, Ca, Na]` -> rows `[1, channels·Na, Ca]` (channel-major: all of the
/// left channel, then the right).
pub fn pack_audio(latents: &Tensor) -> Result<Tensor> {
    let (channels, ca, na) = latents.dims3()?;
    latents.permute((0, 2, 1))?.reshape((1, channels * na, ca))
}

/// Inverse of [`pack_audio`]: rows `[1, channels·Na, Ca]` -> `[channels, Ca, Na]`, the batch the
/// mono audio VAE decodes stereo as.
pub fn unpack_audio(rows: &Tensor, channels: usize) -> Result<Tensor> {
    let (_, n, ca) = rows.dims3()?;
    if channels == 0 || n % channels != 0 {
        candle_core::bail!("{n} audio rows do not split into {channels} channels");
    }
    rows.reshape((channels, n / channels, ca))?
        .permute((0, 2, 1))
}

/// MiniMax H3's frame rate: everything it generates is at 24 fps.
pub const FPS: usize = 24;
/// Audio latents per second of video (fixed; *not* read from the audio VAE config).
pub const AUDIO_LATENTS_PER_SECOND: usize = 40;
/// Stereo: two channel-major blocks of audio rows.
pub const AUDIO_CHANNELS: usize = 2;
/// Shortest video the model generates, in seconds (checked on the snapped frame count).
pub const MIN_DURATION_S: f64 = 5.0;
/// Longest video the model generates, in seconds.
pub const MAX_DURATION_S: f64 = 15.0;

/// The sizes of a `t2va` request as diffusers resolves them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct T2vaGeometry {
    /// Pixel height (a multiple of the canvas multiple).
    pub height: usize,
    /// Pixel width.
    pub width: usize,
    /// Frames generated: the request snapped up to `clip_length · n + tokens_chunk_size`.
    pub num_frames: usize,
    /// Latent frames (`5n + 2` with the published VAE).
    pub num_latent_frames: usize,
    /// Latent height.
    pub latent_height: usize,
    /// Latent width.
    pub latent_width: usize,
    /// Audio latents per channel: `round(frames / 24 · 40)` (ties to even, as Python rounds).
    pub num_audio_latents: usize,
}

impl T2vaGeometry {
    /// Checks the canvas against `vae spatial ratio × patch width`, snaps `num_frames` up as
    /// diffusers does (the caller reports a change on stderr) and checks the 5–15 s window on the
    /// snapped count.
    pub fn new(
        height: usize,
        width: usize,
        num_frames: usize,
        vae: &crate::models::minimax_h3::vae::MiniMaxH3VaeConfig,
        patch_size: [usize; 3],
    ) -> Result<Self> {
        let ratio = vae.spatial_ratio();
        let multiple = ratio * patch_size[2];
        if multiple == 0
            || height == 0
            || width == 0
            || !height.is_multiple_of(multiple)
            || !width.is_multiple_of(multiple)
        {
            candle_core::bail!(
                "height and width must be positive multiples of {multiple}, got {height}x{width}"
            );
        }
        let frames_per_chunk = vae.clip_length;
        let latents_per_chunk = vae.tokens_chunk_size();
        if num_frames == 0 {
            candle_core::bail!("num_frames must be positive");
        }
        if latents_per_chunk >= frames_per_chunk {
            candle_core::bail!(
                "vae config: clip_length {frames_per_chunk} leaves no frame count of the form {frames_per_chunk}·n + {latents_per_chunk}"
            );
        }
        let remainder = num_frames % frames_per_chunk;
        let snapped =
            num_frames + (latents_per_chunk + frames_per_chunk - remainder) % frames_per_chunk;
        let duration = snapped as f64 / FPS as f64;
        if !(MIN_DURATION_S..=MAX_DURATION_S).contains(&duration) {
            candle_core::bail!(
                "MiniMax H3 generates {MIN_DURATION_S}-{MAX_DURATION_S} s at {FPS} fps: num_frames {num_frames} (rounded up to {snapped}) must be within {}..={}",
                (MIN_DURATION_S * FPS as f64) as usize,
                (MAX_DURATION_S * FPS as f64) as usize
            );
        }
        let num_latent_frames =
            (snapped - latents_per_chunk) / frames_per_chunk * latents_per_chunk + 2;
        let num_audio_latents = (snapped as f64 / FPS as f64 * AUDIO_LATENTS_PER_SECOND as f64)
            .round_ties_even() as usize;
        Ok(Self {
            height,
            width,
            num_frames: snapped,
            num_latent_frames,
            latent_height: height / ratio,
            latent_width: width / ratio,
            num_audio_latents,
        })
    }

    /// The video's grid of whole `patch`es of its latents (frames, rows, columns).
    pub fn token_grid(&self, patch: [usize; 3]) -> [usize; 3] {
        let [pt, ph, pw] = patch.map(|p| p.max(1));
        [
            self.num_latent_frames / pt,
            self.latent_height / ph,
            self.latent_width / pw,
        ]
    }

    /// The layout sizes for a prompt of `num_text_tokens` tokens.
    pub fn layout_sizes(&self, num_text_tokens: usize) -> LayoutSizes {
        LayoutSizes {
            num_text_tokens,
            num_latent_frames: self.num_latent_frames,
            latent_height: self.latent_height,
            latent_width: self.latent_width,
            num_audio_latents: self.num_audio_latents,
            audio_channels: AUDIO_CHANNELS,
        }
    }
}
