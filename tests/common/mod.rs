//! Helpers shared by the parity tests: fixture paths and tolerance checks.
#![allow(dead_code)]

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::PathBuf;

/// The tiny diffusers checkpoint with its reference outputs.
pub fn fixture_dir() -> PathBuf {
    named_fixture_dir("wan-tiny-a")
}

/// Another fixture folder under `tests/fixtures/` (e.g. `minimax-h3-tiny-a`).
pub fn named_fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Loads one of the `reference/*.safetensors` files onto the CPU.
pub fn reference(name: &str) -> HashMap<String, Tensor> {
    reference_in(&fixture_dir(), name)
}

/// Loads `reference/{name}.safetensors` of the fixture folder `dir` onto the CPU.
pub fn reference_in(dir: &std::path::Path, name: &str) -> HashMap<String, Tensor> {
    let path = dir.join("reference").join(format!("{name}.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

/// Asserts |actual - expected| <= atol + rtol * |expected| elementwise (the fixture README's rule).
pub fn assert_close(what: &str, actual: &Tensor, expected: &Tensor, atol: f64, rtol: f64) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    let values = |t: &Tensor| -> Vec<f64> {
        t.to_dtype(candle_core::DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
    };
    let (a, e) = (values(actual), values(expected));
    let max_diff = a
        .iter()
        .zip(&e)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    eprintln!("{what}: max |diff| {max_diff:.3e}");
    let mut worst = (0.0f64, 0usize);
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        let excess = (x - y).abs() - (atol + rtol * y.abs());
        if excess.is_nan() || excess > worst.0 {
            worst = (
                if excess.is_nan() {
                    f64::INFINITY
                } else {
                    excess
                },
                i,
            );
        }
    }
    assert!(
        worst.0 <= 0.0,
        "{what}: element {} is {} but the reference is {} (atol {atol}, rtol {rtol})",
        worst.1,
        a[worst.1],
        e[worst.1]
    );
}
