//! Compiles the CUDA kernels to PTX when the `cuda` feature is on; the default build needs no nvcc.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|home| PathBuf::from(home).join("bin").join("nvcc"))
        .filter(|path| path.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // compute_80 PTX: the oldest target with the instructions used (mma.sync bf16, cp.async);
    // the driver compiles it for the GPU at hand when the module loads. The DiT block kernels
    // keep IEEE division and square roots (no fast math): they stand in for candle's f32 ops.
    for (name, fast_math) in [
        ("flash_attn", true),
        ("wan_ops", false),
        ("dit_ops", false),
        ("conv3d", false),
    ] {
        let src = format!("src/models/kernels/{name}.cu");
        println!("cargo:rerun-if-changed={src}");
        let mut cmd = Command::new(&nvcc);
        cmd.args(["--ptx", "-arch=compute_80", "-O3"]);
        if fast_math {
            cmd.arg("--use_fast_math");
        }
        let status = cmd
            .arg("-o")
            .arg(out_dir.join(format!("{name}.ptx")))
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {src}");
    }
}
