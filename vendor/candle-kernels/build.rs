use cudaforge::{KernelBuilder, Result};
use std::env;
use std::path::PathBuf;

const CUTILE_FEATURE: &str = "CARGO_FEATURE_CUTILE";

fn main() -> Result<()> {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src");
    println!("cargo::rerun-if-changed=src/compatibility.cuh");
    println!("cargo::rerun-if-changed=src/cuda_utils.cuh");
    println!("cargo::rerun-if-changed=src/binary_op_macros.cuh");

    // Build for PTX
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let ptx_path = out_dir.join("ptx.rs");
    let bindings = KernelBuilder::new()
        .source_dir("src") // Scan src/ for .cu files
        .exclude(&["moe_*.cu", "mmvq_gguf.cu", "mmq_*.cu"]) // Exclude statically compiled kernels from ptx build
        .arg("--expt-relaxed-constexpr")
        .arg("-std=c++17")
        .arg("-O3")
        .build_ptx()?;

    bindings.write(&ptx_path)?;
    build_machine_code(&out_dir);

    let mut moe_sources = vec![
        "src/moe/moe_gguf.cu",
        "src/moe/moe_wmma.cu",
        "src/moe/moe_wmma_gguf.cu",
        "src/mmvq_gguf.cu",
        "src/mmq_gguf/mmq_quantize.cu",
        "src/mmq_gguf/mmq_instance_q4_0.cu",
        "src/mmq_gguf/mmq_instance_q4_1.cu",
        "src/mmq_gguf/mmq_instance_q5_0.cu",
        "src/mmq_gguf/mmq_instance_q5_1.cu",
        "src/mmq_gguf/mmq_instance_q8_0.cu",
        "src/mmq_gguf/mmq_instance_q2_k.cu",
        "src/mmq_gguf/mmq_instance_q3_k.cu",
        "src/mmq_gguf/mmq_instance_q4_k.cu",
        "src/mmq_gguf/mmq_instance_q5_k.cu",
        "src/mmq_gguf/mmq_instance_q6_k.cu",
    ];
    if env::var_os(CUTILE_FEATURE).is_some() {
        moe_sources.push("src/moe/moe_align.cu");
    }

    let mut moe_builder = KernelBuilder::default()
        .source_files(moe_sources)
        .arg("--expt-relaxed-constexpr")
        .arg("-std=c++17")
        .arg("-O3");

    // Disable bf16 WMMA kernels on GPUs older than sm_80 (Ampere).
    // bf16 WMMA fragments require compute capability >= 8.0.
    let compute_cap = cudaforge::detect_compute_cap()
        .map(|arch| arch.base())
        .unwrap_or(80);
    if compute_cap < 80 {
        moe_builder = moe_builder.arg("-DNO_BF16_KERNEL");
    }

    let mut is_target_msvc = false;
    if let Ok(target) = std::env::var("TARGET") {
        if target.contains("msvc") {
            is_target_msvc = true;
            moe_builder = moe_builder.arg("-D_USE_MATH_DEFINES");
        }
    }

    if !is_target_msvc {
        moe_builder = moe_builder.arg("-Xcompiler").arg("-fPIC");
    }

    moe_builder.build_lib(out_dir.join("libmoe.a"))?;
    println!("cargo:rustc-link-search={}", out_dir.display());
    println!("cargo:rustc-link-lib=moe");
    println!("cargo:rustc-link-lib=dylib=cudart");
    if !is_target_msvc {
        println!("cargo:rustc-link-lib=stdc++");
    }
    Ok(())
}

/// vidgen's patch: the modules a run loads also as fat binaries holding machine code for sm_80
/// (run by sm_86/87), sm_89, sm_90, sm_100 (sm_103) and sm_120 (sm_121, GB10), plus compute_80
/// PTX for any other GPU, so that a machine's first run loads them instead of waiting seconds per
/// module for the driver to compile PTX. The sm_89+ code is built from compute_89, where the fp8
/// kernels exist (`Module::image` in lib.rs includes them). Modules left out (quantized, sort)
/// keep loading as PTX.
fn build_machine_code(out_dir: &std::path::Path) {
    const MODULES: [&str; 9] = [
        "affine", "binary", "cast", "conv", "fill", "indexing", "reduce", "ternary", "unary",
    ];
    let nvcc = env::var_os("CUDA_HOME")
        .map(|home| PathBuf::from(home).join("bin").join("nvcc"))
        .filter(|path| path.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    std::thread::scope(|scope| {
        for name in MODULES {
            let nvcc = &nvcc;
            scope.spawn(move || {
                let src = format!("src/{name}.cu");
                let status = std::process::Command::new(nvcc)
                    .args([
                        "--fatbin",
                        "-gencode=arch=compute_80,code=[compute_80,sm_80]",
                        "-gencode=arch=compute_89,code=[sm_89,sm_90,sm_100,sm_120]",
                        "--expt-relaxed-constexpr",
                        "-std=c++17",
                        "-O3",
                        "-o",
                    ])
                    .arg(out_dir.join(format!("{name}.fatbin")))
                    .arg(&src)
                    .status()
                    .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
                assert!(status.success(), "nvcc failed on {src}");
            });
        }
    });
}
