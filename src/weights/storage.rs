//! Layerwise fp8 storage (`--storage-dtype`), as diffusers' `enable_layerwise_casting` stores
//! a transformer: the weight and bias of every Linear and convolution whose module path matches
//! none of the skip patterns are held in fp8 and widened to the compute dtype for each forward.
//! What a forward sees is each such value rounded through fp8 (round to nearest even, fp8's
//! subnormals kept), which is what the reader writes.

use serde::{Deserialize, Serialize};

/// An fp8 storage format, named as torch names it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StorageDtype {
    #[serde(rename = "float8_e4m3fn")]
    Float8E4m3fn,
    #[serde(rename = "float8_e5m2")]
    Float8E5m2,
}

/// Module paths diffusers never casts (`DEFAULT_SKIP_MODULES_PATTERN`): `^name$` matches the
/// whole path, any other pattern a part of it.
const DEFAULT_SKIP: [&str; 5] = [
    "pos_embed",
    "patch_embed",
    "norm",
    "^proj_in$",
    "^proj_out$",
];

impl StorageDtype {
    /// Parses a `--storage-dtype` value.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "float8_e4m3fn" => Ok(StorageDtype::Float8E4m3fn),
            "float8_e5m2" => Ok(StorageDtype::Float8E5m2),
            _ => Err(format!(
                "{text} is not a storage dtype: give float8_e4m3fn or float8_e5m2"
            )),
        }
    }

    /// (mantissa bits, exponent bias, largest finite value).
    fn format(self) -> (i32, i32, f32) {
        match self {
            StorageDtype::Float8E4m3fn => (3, 7, 448.0),
            StorageDtype::Float8E5m2 => (2, 15, 57344.0),
        }
    }

    /// `x` rounded to this format and back, as torch's `x.to(fp8).to(float32)`: to nearest
    /// even, subnormals kept; past the largest value e4m3fn has only NaN, e5m2 infinity.
    pub fn round(self, x: f32) -> f32 {
        let (mantissa, bias, largest) = self.format();
        if !x.is_finite() || x == 0.0 {
            return if x.is_infinite() && self == StorageDtype::Float8E4m3fn {
                f32::NAN
            } else {
                x
            };
        }
        let exponent = ((x.abs().to_bits() >> 23) as i32 - 127).max(1 - bias);
        let quantum = pow2(exponent - mantissa);
        let rounded = (x / quantum).round_ties_even() * quantum;
        if rounded.abs() <= largest {
            rounded
        } else if self == StorageDtype::Float8E4m3fn {
            f32::NAN
        } else {
            rounded.signum() * f32::INFINITY
        }
    }

    /// The byte of value `x`, one [`Self::round`] returns (NaN stored as the positive NaN).
    pub fn encode(self, x: f32) -> u8 {
        let (mantissa, bias, _) = self.format();
        let sign = if x.is_sign_negative() && !x.is_nan() {
            0x80
        } else {
            0
        };
        let top = 0x7f >> mantissa; // the all-ones exponent field
        let magnitude = if x.is_nan() {
            match self {
                StorageDtype::Float8E4m3fn => 0x7f,
                StorageDtype::Float8E5m2 => (top << mantissa) | 2,
            }
        } else if x.is_infinite() {
            top << mantissa
        } else if x == 0.0 {
            0
        } else {
            let exponent = ((x.abs().to_bits() >> 23) as i32 - 127).max(1 - bias);
            let steps = (x.abs() / pow2(exponent - mantissa)) as i32;
            // A normal's steps carry the implicit leading one, which the exponent field stands for.
            let field = if steps >> mantissa == 0 {
                0
            } else {
                exponent + bias
            };
            ((field << mantissa) | (steps & ((1 << mantissa) - 1))) as u8
        };
        sign | magnitude
    }

    /// The value of byte `b` (exact in f32).
    pub fn decode(self, b: u8) -> f32 {
        let (mantissa, bias, _) = self.format();
        let field = i32::from(b & 0x7f) >> mantissa;
        let steps = i32::from(b) & ((1 << mantissa) - 1);
        let top = 0x7f >> mantissa;
        let magnitude = match self {
            StorageDtype::Float8E4m3fn if field == top && steps == (1 << mantissa) - 1 => f32::NAN,
            StorageDtype::Float8E5m2 if field == top && steps == 0 => f32::INFINITY,
            StorageDtype::Float8E5m2 if field == top => f32::NAN,
            _ if field == 0 => steps as f32 * pow2(1 - bias - mantissa),
            _ => (steps + (1 << mantissa)) as f32 * pow2(field - bias - mantissa),
        };
        if b & 0x80 != 0 && !magnitude.is_nan() {
            -magnitude
        } else {
            magnitude
        }
    }
}

/// 2^`e` for a normal f32 exponent (-126..=127), built from its bits: exactly `2f32.powi(e)`,
/// without the library call (the rounding runs once per stored value of a 14B model).
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Which stored values `--storage-dtype` rounds: a model's own skip patterns (its
/// `_skip_layerwise_casting_patterns` and `_keep_in_fp32_modules`) on top of diffusers' defaults.
#[derive(Clone, Debug)]
pub struct StorageCast {
    pub dtype: StorageDtype,
    pub skip: &'static [&'static str],
}

impl StorageCast {
    /// Whether the module at `path` is skipped.
    fn skips(&self, path: &str) -> bool {
        DEFAULT_SKIP.iter().chain(self.skip).any(|pattern| {
            match pattern.strip_prefix('^').and_then(|p| p.strip_suffix('$')) {
                Some(whole) => path == whole,
                None => path.contains(pattern),
            }
        })
    }

    /// Whether weight `name` is rounded: the weight or bias of a module whose weight has two
    /// or more dimensions (a Linear or convolution; norms hold vectors) and no skip pattern
    /// matches. `weight_rank` gives a module weight's rank where it is stored.
    pub fn rounds(&self, name: &str, weight_rank: impl Fn(&str) -> Option<usize>) -> bool {
        let Some(module) = name
            .strip_suffix(".weight")
            .or_else(|| name.strip_suffix(".bias"))
        else {
            return false;
        };
        !self.skips(module) && weight_rank(&format!("{module}.weight")).is_some_and(|r| r >= 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_keeps_fp8_values_and_rounds_ties_to_even() {
        let e4 = StorageDtype::Float8E4m3fn;
        // Every e4m3fn value is kept: normals 1.mmm·2^e (e in -6..=8), subnormals m·2^-9.
        for e in -6..=8 {
            for m in 0..8 {
                let v = (1.0 + m as f32 / 8.0) * 2f32.powi(e);
                if v <= 448.0 {
                    assert_eq!(e4.round(v), v);
                    assert_eq!(e4.round(-v), -v);
                }
            }
        }
        for m in 1..8 {
            assert_eq!(e4.round(m as f32 * 2f32.powi(-9)), m as f32 * 2f32.powi(-9));
        }
        // Halfway between 1 and 1.125 goes to the even 1; between 1.125 and 1.25 to 1.25.
        assert_eq!(e4.round(1.0625), 1.0);
        assert_eq!(e4.round(1.1875), 1.25);
        // Half the smallest subnormal rounds to 0, three halves to 2^-8.
        assert_eq!(e4.round(2f32.powi(-10)), 0.0);
        assert_eq!(e4.round(3.0 * 2f32.powi(-10)), 2f32.powi(-8));
        assert!(e4.round(1e6).is_nan());
        let e5 = StorageDtype::Float8E5m2;
        assert_eq!(e5.round(1.1), 1.0);
        assert_eq!(e5.round(2f32.powi(-16)), 2f32.powi(-16));
        assert_eq!(e5.round(1e6), f32::INFINITY);
    }

    /// Every byte decodes to a value rounding keeps and encodes back to itself (NaNs to the
    /// one stored NaN), and any value rounded then encoded decodes to the rounded bits.
    #[test]
    fn bytes_round_trip_through_values() {
        for format in [StorageDtype::Float8E4m3fn, StorageDtype::Float8E5m2] {
            let mut nans = 0;
            for b in 0..=255u8 {
                let v = format.decode(b);
                if v.is_nan() {
                    nans += 1;
                    assert!(format.decode(format.encode(v)).is_nan());
                    continue;
                }
                assert_eq!(format.round(v).to_bits(), v.to_bits(), "{format:?} {b:#x}");
                assert_eq!(format.encode(v), b, "{format:?} {b:#x} = {v}");
            }
            assert_eq!(
                nans,
                if format == StorageDtype::Float8E4m3fn {
                    2
                } else {
                    6
                }
            );
            let mut state = 11u64;
            for _ in 0..100_000 {
                // Any sign and mantissa, exponents from past the subnormals to past the largest.
                let bits = crate::weights::splitmix64(&mut state);
                let exponent = (bits >> 32) % 44;
                let x =
                    f32::from_bits((bits as u32 & 0x807f_ffff) | ((exponent as u32 + 103) << 23));
                let rounded = format.round(x);
                let back = format.decode(format.encode(rounded));
                assert!(
                    back.to_bits() == rounded.to_bits() || back.is_nan() && rounded.is_nan(),
                    "{format:?} {x} -> {rounded} -> {back}"
                );
            }
        }
    }

    /// On `wan-tiny-a` with Wan's skip patterns, exactly the modules diffusers casted (the
    /// fixture README's `casted_modules`) are rounded, weight and bias.
    #[test]
    fn wan_rounds_exactly_the_modules_diffusers_casts() -> anyhow::Result<()> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let readme: serde_json::Value = serde_json::from_slice(&std::fs::read(
            root.join("weights-a/reference/README.json"),
        )?)?;
        let case = readme["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["case"] == "layerwise_float8_e4m3fn")
            .unwrap();
        let mut casted: Vec<&str> = case["casted_modules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap())
            .collect();
        casted.sort();
        let weights = candle_core::safetensors::load(
            root.join("wan-tiny-a/transformer/diffusion_pytorch_model.safetensors"),
            &candle_core::Device::Cpu,
        )?;
        let cast = StorageCast {
            dtype: StorageDtype::Float8E4m3fn,
            skip: crate::models::wan::transformer::LAYERWISE_CASTING_SKIP,
        };
        let rank = |name: &str| weights.get(name).map(|t| t.rank());
        let mut rounded: Vec<&str> = weights
            .keys()
            .filter(|name| cast.rounds(name, rank))
            .map(|name| name.rsplit_once('.').unwrap().0)
            .collect();
        rounded.sort();
        let weights_and_biases: Vec<&str> = casted.iter().flat_map(|m| [*m, *m]).collect();
        assert_eq!(rounded, weights_and_biases);
        Ok(())
    }
}
