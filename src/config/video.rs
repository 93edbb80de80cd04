//! The checks of one video's settings, in one place: the flags (`--height`, `--output-video-name`,
//! ...) and each prompt-file line's overrides go through the same rules, before anything loads.

/// The longest file name (without extension) vidgen writes: room is left for the extension and
/// the temporary `.NAME.EXT.PID-N.partial` within the usual 255-byte limit.
pub const MAX_NAME_BYTES: usize = 200;

use super::UsageError;

/// How a setting is named in an error: as the flag that gave it or as a prompt-file key.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Spelling {
    /// `--num-frames 80`
    Flag,
    /// `` `num_frames` is 80 ``
    LineKey,
}

impl Spelling {
    /// The setting `key` (snake_case) with its value, as the user wrote it.
    fn said(self, key: &str, value: impl std::fmt::Display) -> String {
        match self {
            Spelling::Flag => format!("--{} {value}", key.replace('_', "-")),
            Spelling::LineKey => format!("`{key}` is {value}"),
        }
    }
}

/// What a family's video sizes must be: frames of the form `frame_step·k + 1` (the VAE's
/// temporal compression), height and width multiples of `size_step`; and the fewest denoising
/// steps its schedule can be made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameRule {
    pub frame_step: u32,
    pub size_step: u32,
    pub min_steps: u32,
}

impl FrameRule {
    /// Any frame count and size (before the model's family is known).
    pub const ANY: FrameRule = FrameRule {
        frame_step: 1,
        size_step: 1,
        min_steps: 1,
    };

    /// Any frame count, heights and widths in multiples of `size_step`, at least `min_steps`
    /// denoising steps.
    pub fn any_frames(size_step: u32, min_steps: u32) -> Self {
        FrameRule {
            frame_step: 1,
            size_step,
            min_steps,
        }
    }
}

impl Default for FrameRule {
    /// Wan's: 4k+1 frames, multiples of 16, any step count.
    fn default() -> Self {
        FrameRule {
            frame_step: 4,
            size_step: 16,
            min_steps: 1,
        }
    }
}

/// The settings of one video that a flag or a prompt-file line may set; `None` is not given
/// here (a line then takes the flag's value, which was checked on its own).
#[derive(Clone, Debug, Default)]
pub struct VideoSettings<'a> {
    pub height: Option<u32>,
    pub width: Option<u32>,
    pub num_frames: Option<u32>,
    pub num_inference_steps: Option<u32>,
    pub guidance_scale: Option<f64>,
    pub output_video_name: Option<&'a str>,
    /// The model family's rule for sizes.
    pub rule: FrameRule,
}

impl VideoSettings<'_> {
    /// The first setting no video can have, as one line naming it (spelled as `spelling`
    /// says) and the fix.
    pub fn check(&self, spelling: Spelling) -> Result<(), String> {
        let FrameRule {
            frame_step: k,
            size_step: m,
            min_steps,
        } = self.rule;
        for (key, value) in [("height", self.height), ("width", self.width)] {
            if let Some(v) = value.filter(|v| *v == 0 || v % m != 0) {
                let up = v.div_ceil(m).max(1) * m;
                return Err(format!(
                    "{}: not a positive multiple of {m}; use e.g. {up}",
                    spelling.said(key, v)
                ));
            }
        }
        if let Some(f) = self
            .num_frames
            .filter(|f| *f == 0 || !(f - 1).is_multiple_of(k))
        {
            let down = (f.saturating_sub(1) / k) * k + 1;
            return Err(format!(
                "{}: not of the form {k}k+1; use e.g. {down} or {}",
                spelling.said("num_frames", f),
                down + k
            ));
        }
        // Sizes no machine can hold are refused before anything allocates: each side, the
        // frame count, and the decoded frames (f32 RGB) as a whole.
        for (key, value, max) in [
            ("height", self.height, MAX_SIDE),
            ("width", self.width, MAX_SIDE),
            ("num_frames", self.num_frames, MAX_FRAMES),
        ] {
            if let Some(v) = value.filter(|v| *v > max) {
                return Err(format!(
                    "{}: more than {max}, larger than any machine can hold; use a smaller value",
                    spelling.said(key, v)
                ));
            }
        }
        if let (Some(h), Some(w), Some(f)) = (self.height, self.width, self.num_frames) {
            check_frame_bytes(h, w, f)?;
        }
        let min_steps = min_steps.max(1);
        if let Some(steps) = self.num_inference_steps.filter(|s| *s < min_steps) {
            let why = match min_steps {
                1 => "",
                _ => " for this model's schedule",
            };
            return Err(format!(
                "{}: must be at least {min_steps}{why}; pass {min_steps} or more",
                spelling.said("num_inference_steps", steps)
            ));
        }
        if let Some(g) = self
            .guidance_scale
            .filter(|g| finite(*g).is_err() || *g < 0.0)
        {
            return Err(format!(
                "{}: must be a finite number >= 0 (1 disables guidance)",
                spelling.said("guidance_scale", g)
            ));
        }
        if let Some(name) = self.output_video_name {
            check_name(name).map_err(|why| {
                format!(
                    "{}: {why}; it must be a plain file name (folders go in --output-path)",
                    spelling.said("output_video_name", format!("{name:?}"))
                )
            })?;
        }
        Ok(())
    }
}

/// The parser of every float option, whether it comes from a flag, a config file (through its
/// flag's parser) or a prompt-file line: a finite number.
pub fn parse_finite(text: &str) -> Result<f64, String> {
    let value: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a number; pass a number such as 3.5"))?;
    finite(value)
}

/// `value` if it is finite; else why not, and the fix.
pub fn finite(value: f64) -> Result<f64, String> {
    if !value.is_finite() {
        return Err(format!(
            "{value} is not a finite number; pass a number such as 3.5"
        ));
    }
    Ok(value)
}

/// The checks of the flags a model's defaults may set: the video's settings, `--fps` and
/// `--max-sequence-length`.
pub fn check_flags(
    video: &VideoSettings,
    fps: u32,
    max_sequence_length: u32,
) -> Result<(), UsageError> {
    video.check(Spelling::Flag).map_err(UsageError)?;
    for (name, value) in [("fps", fps), ("max-sequence-length", max_sequence_length)] {
        // A config file bypasses clap's range checks.
        if value == 0 {
            return Err(UsageError::new(format!(
                "--{name} 0: must be at least 1; pass a positive number"
            )));
        }
    }
    // Attention over the text grows with its square (65536 tokens: tens of GiB of scores in
    // each layer of the encoder, which no allocation failure could be recovered from): eight
    // times the longest length any pipeline uses is the most taken.
    const MAX_TEXT_TOKENS: u32 = 1 << 12;
    if max_sequence_length > MAX_TEXT_TOKENS {
        return Err(UsageError::new(format!(
            "--max-sequence-length {max_sequence_length} is more than {MAX_TEXT_TOKENS} tokens; pass at most {MAX_TEXT_TOKENS} (Wan uses 512)"
        )));
    }
    Ok(())
}

/// Why `name` cannot be an output file name, if it cannot: it must stay one file in the output
/// folder, visible, and short enough for the temporary name next to it.
/// Refuses `num_frames` frames of `height` x `width` whose decoded f32 RGB frames alone would
/// take more than any machine holds.
pub fn check_frame_bytes(height: u32, width: u32, num_frames: u32) -> Result<(), String> {
    let bytes = u128::from(height) * u128::from(width) * u128::from(num_frames) * 3 * 4;
    if bytes > MAX_FRAME_BYTES {
        return Err(format!(
            "{num_frames} frames of {height}x{width} would take {} GiB as decoded f32 frames, more than any machine can hold; use fewer frames or a smaller size",
            bytes >> 30
        ));
    }
    Ok(())
}

/// The largest height or width accepted, in pixels.
const MAX_SIDE: u32 = 1 << 14;
/// The most frames accepted.
const MAX_FRAMES: u32 = 1 << 16;
/// The most bytes the decoded frames (f32 RGB) may take: 1 TiB.
const MAX_FRAME_BYTES: u128 = 1 << 40;

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("it is empty".into());
    }
    if name.contains(['/', '\\']) {
        return Err("it holds a path separator".into());
    }
    if name.chars().any(char::is_control) {
        return Err("it holds a control character".into());
    }
    if name.starts_with('.') {
        return Err("it starts with '.' (a hidden file)".into());
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(format!(
            "it is {} bytes, more than {MAX_NAME_BYTES}",
            name.len()
        ));
    }
    Ok(())
}
