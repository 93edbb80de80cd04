//! Compiles the CUDA kernels (fat binaries) when the `cuda` feature is on; the default build needs
//! no nvcc.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/models/kernels/tensor_core.cuh");
    println!("cargo:rerun-if-changed=src/models/kernels/activation.cuh");
    println!("cargo:rerun-if-changed=src/models/kernels/e4m3.cuh");
    println!("cargo:rerun-if-changed=src/models/kernels/hopper.cuh");
    println!("cargo:rerun-if-changed=src/models/kernels/sage.cuh");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|home| PathBuf::from(home).join("bin").join("nvcc"))
        .filter(|path| path.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // One fat binary per file: machine code for sm_80 (also run by sm_86/87/89), sm_90, sm_100
    // and sm_120 (also sm_121, GB10), so those GPUs load the kernels without compiling them, and
    // compute_80 PTX (mma.sync bf16 and cp.async need sm_80) that the driver compiles for any
    // other. `flash_attn_sm90`, `sage_attn_sm90` and `fp8_sm90` are Hopper's extras: wgmma and TMA exist on
    // sm_90a alone, so they hold that machine code only and load on compute capability 9.0 alone.
    // The DiT block kernels keep IEEE division and square roots (no fast math): they stand in for
    // candle's f32 ops. `fp8`
    // (the fp8 matmuls' quantizer and epilogue) starts at sm_89, the first GPUs with fp8 tensor
    // cores, whose e4m3 conversions it uses; so does `sage_attn` (8-bit attention: e4m3 mma.sync).
    const PORTABLE: &str = "-gencode=arch=compute_80,code=[compute_80,sm_80,sm_90,sm_100,sm_120]";
    // `row_ops` also makes an fp8 Linear's input codes in its norms: from sm_89 on its machine
    // code comes from compute_89, where the e4m3 conversions are one instruction (compute_80's are
    // emulated, and made the fused norm twice as slow as the norm alone: bench/RESULTS.md
    // session 53).
    const ROWS: &str = "-gencode=arch=compute_80,code=[compute_80,sm_80] \
                        -gencode=arch=compute_89,code=[sm_89,sm_90,sm_100,sm_120]";
    const FP8: &str = "-gencode=arch=compute_89,code=[compute_89,sm_89,sm_90,sm_100,sm_120]";
    for (name, gencode, fast_math) in [
        ("flash_attn", PORTABLE, true),
        (
            "flash_attn_sm90",
            "-gencode=arch=compute_90a,code=sm_90a",
            true,
        ),
        ("row_ops", ROWS, false),
        ("wan_vae_ops", PORTABLE, false),
        ("conv3d", PORTABLE, false),
        ("norms", PORTABLE, false),
        ("channel_ops", PORTABLE, false),
        ("audio_ops", PORTABLE, false),
        ("dequant", PORTABLE, false),
        ("lora_merge", PORTABLE, false),
        ("fp8", FP8, false),
        ("fp8_sm90", "-gencode=arch=compute_90a,code=sm_90a", false),
        ("sage_attn", FP8, false),
        (
            "sage_attn_sm90",
            "-gencode=arch=compute_90a,code=sm_90a",
            false,
        ),
    ] {
        let src = format!("src/models/kernels/{name}.cu");
        println!("cargo:rerun-if-changed={src}");
        let mut cmd = Command::new(&nvcc);
        cmd.arg("--fatbin")
            .args(gencode.split_whitespace())
            .arg("-O3");
        if fast_math {
            cmd.arg("--use_fast_math");
        }
        let status = cmd
            .arg("-o")
            .arg(out_dir.join(format!("{name}.fatbin")))
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {src}");
    }
}
