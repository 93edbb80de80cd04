//! The Wan family in the Hugging Face diffusers layout: Wan2.1 text- and image-to-video, Wan2.2
//! TI2V-5B and the A14B experts.

pub mod activations;
pub mod condition;
pub mod prompt;
pub mod text_encoder;
pub mod transformer;
pub mod vae;
#[cfg(feature = "cuda")]
#[path = "../kernels/wan_ops.rs"]
pub(crate) mod wan_ops;

/// The largest size a config may give (a width, a count of layers or heads): far above any
/// published model, and low enough that the sizes derived from it (parameter counts, bytes)
/// cannot overflow where they are multiplied.
pub(crate) const MAX_CONFIG_SIZE: usize = 1 << 16;

/// Checks that each named size of a config is positive and at most [`MAX_CONFIG_SIZE`], naming
/// the first key that is not.
pub(crate) fn check_sizes(sizes: &[(&str, usize)]) -> candle_core::Result<()> {
    for &(key, value) in sizes {
        if value == 0 {
            candle_core::bail!("`{key}` is 0: it must be positive");
        }
        if value > MAX_CONFIG_SIZE {
            candle_core::bail!(
                "`{key}` is {value}: larger than any model (at most {MAX_CONFIG_SIZE})"
            );
        }
    }
    Ok(())
}
