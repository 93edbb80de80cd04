//! The checks a component's config gets before anything is built from it: bad input naming the
//! component and the key at fault.

/// An error naming the first of `sizes` that is 0: `"{what}: {key} must be positive"`.
pub fn positive(what: &str, sizes: &[(&str, usize)]) -> candle_core::Result<()> {
    match sizes.iter().find(|(_, value)| *value == 0) {
        Some((key, _)) => candle_core::bail!("{what}: {key} must be positive"),
        None => Ok(()),
    }
}

/// The largest size a config may give (a width, a count of layers or heads): far above any
/// published model, and low enough that the sizes derived from it (parameter counts, bytes)
/// cannot overflow where they are multiplied.
pub const MAX_CONFIG_SIZE: usize = 1 << 16;

/// Checks that each named size of a config is positive and at most [`MAX_CONFIG_SIZE`], naming
/// the first key that is not.
pub fn bounded_sizes(sizes: &[(&str, usize)]) -> candle_core::Result<()> {
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

/// An error where `value` of `key` is none of `supported`:
/// `"{what}: {key} {value:?} is not supported (only \"a\" or \"b\")"`.
pub fn one_of(
    what: &str,
    (key, value): (&str, &str),
    supported: &[&str],
) -> candle_core::Result<()> {
    if supported.contains(&value) {
        return Ok(());
    }
    let only: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
    candle_core::bail!(
        "{what}: {key} {value:?} is not supported (only {})",
        only.join(" or ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The message alone (candle appends a backtrace where RUST_BACKTRACE asks for one).
    fn message(err: candle_core::Error) -> String {
        err.to_string()
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    }

    #[test]
    fn the_key_at_fault_is_named() {
        assert!(positive("vae config", &[("a", 1), ("b", 2)]).is_ok());
        let err = positive("vae config", &[("a", 1), ("b", 0), ("c", 0)]).unwrap_err();
        assert_eq!(message(err), "vae config: b must be positive");
        assert!(one_of("transformer config", ("act", "silu"), &["silu", "swish"]).is_ok());
        let err = one_of("transformer config", ("act", "gelu"), &["silu", "swish"]).unwrap_err();
        assert_eq!(
            message(err),
            "transformer config: act \"gelu\" is not supported (only \"silu\" or \"swish\")"
        );
    }
}
