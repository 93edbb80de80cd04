//! Compiles the CUDA kernels to PTX when the `cuda` feature is on; the default build needs no nvcc.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let src = "src/models/kernels/flash_attn.cu";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|home| PathBuf::from(home).join("bin").join("nvcc"))
        .filter(|path| path.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("flash_attn.ptx");
    // compute_80 PTX: the oldest target with the instructions used (mma.sync bf16, cp.async);
    // the driver compiles it for the GPU at hand when the module loads.
    let status = Command::new(&nvcc)
        .args(["--ptx", "-arch=compute_80", "-O3", "--use_fast_math", "-o"])
        .arg(&out)
        .arg(src)
        .status()
        .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
    assert!(status.success(), "nvcc failed on {src}");
}
