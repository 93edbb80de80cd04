//! Times `sdpa` (the fused kernel where it applies) against the chunked path on a CUDA GPU, at
//! Wan2.1's attention shapes, and checks both against the chunked path in f32.
//!
//! `cargo run --release --no-default-features --features cuda --example attn_bench [plans|hopper|head-dims|sage]`
//! (`plans`: only cuDNN's execution plans for the self-attention shapes, timed one by one;
//! `hopper`: only cuDNN, the Hopper kernel and the portable kernel at the self- and
//! cross-attention shapes and key counts between, in interleaved rounds; `head-dims`: the same
//! at the other families' head dims; `sage [CASE]`: the 8-bit attention against the exact
//! kernels, only the cases whose names start with CASE where one is given)

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use vidgen::models::attention::flash_attn::{self, device_tile, SHARED_MEMORY_LIMIT_ENV};
use vidgen::models::attention::flash_attn_sm90;
use vidgen::models::attention::{sdpa, sdpa_chunked};
use vidgen::models::cudnn::sdpa::sdpa_with_plan;
use vidgen::models::sage_kernels::{self, Kernel};

#[path = "support/median.rs"]
mod median;
use median::median_seconds as time;

/// Per-block shared-memory limits the fused kernel is timed under: the device's own, GB10's 99 KB
/// (sm_121), and one byte less than the two-m-tile configuration needs at head_dim 128.
const LIMITS: [(&str, Option<usize>); 3] = [
    ("device", None),
    ("gb10", Some(101_376)),
    ("<98304", Some(98_303)),
];

/// `hopper`'s cases: Wan's self- and cross-attention and key counts between.
const WAN_CASES: [(&str, usize, usize, usize, usize, usize); 8] = [
    ("1.3B self", 1, 12, 32760, 32760, 128),
    ("14B self", 1, 40, 32760, 32760, 128),
    ("1.3B cross", 1, 12, 32760, 512, 128),
    ("14B cross", 1, 40, 32760, 512, 128),
    ("14B 1024 keys", 1, 40, 32760, 1024, 128),
    ("14B 2048 keys", 1, 40, 32760, 2048, 128),
    ("14B 4096 keys", 1, 40, 32760, 4096, 128),
    ("14B 8192 keys", 1, 40, 32760, 8192, 128),
];

/// `head-dims`' cases: the self-attention of the families below head_dim 128 at their default
/// sizes with guidance (Allegro 88x720x1280, Latte-1's spatial and temporal attention at
/// 16x512x512, CogVideoX-5b 49x480x720 with its text, LTX-Video 161x512x704), and 80.
const HEAD_DIM_CASES: [(&str, usize, usize, usize, usize, usize); 6] = [
    ("Allegro self d96", 2, 24, 79200, 79200, 96),
    ("Latte spatial d72", 32, 16, 1024, 1024, 72),
    ("Latte temporal d72", 2048, 16, 16, 16, 72),
    ("CogVideoX self d64", 2, 48, 17776, 17776, 64),
    ("LTX self d64", 2, 32, 7392, 7392, 64),
    ("d80 self", 1, 24, 32760, 32760, 80),
];

fn set_limit(limit: Option<usize>) {
    match limit {
        Some(bytes) => std::env::set_var(SHARED_MEMORY_LIMIT_ENV, bytes.to_string()),
        None => std::env::remove_var(SHARED_MEMORY_LIMIT_ENV),
    }
}

/// Max absolute and relative-norm error of `out` against `reference`.
fn errors(out: &Tensor, reference: &Tensor) -> Result<(f32, f32)> {
    let diff = (out.to_dtype(DType::F32)? - reference)?;
    let max = diff.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let norm = |t: &Tensor| -> Result<f32> { Ok(t.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?) };
    Ok((max, norm(&diff)? / norm(reference)?))
}

fn main() -> Result<()> {
    let dev = Device::cuda_if_available(0)?;
    if !dev.is_cuda() {
        bail!("attn_bench needs a CUDA build (--features cuda) and a GPU");
    }
    // (name, dtype, batch, heads, q_len, kv_len, head_dim)
    let shapes = [
        ("1.3B self", DType::BF16, 1, 12, 32760, 32760, 128),
        ("1.3B cross", DType::BF16, 1, 12, 32760, 512, 128),
        ("14B self", DType::BF16, 1, 40, 32760, 32760, 128),
        ("14B cross", DType::BF16, 1, 40, 32760, 512, 128),
        ("odd", DType::BF16, 2, 3, 1000, 333, 128),
        ("f16 self", DType::F16, 1, 12, 32760, 32760, 128),
        ("d64 self", DType::BF16, 1, 24, 32760, 32760, 64),
    ];
    match std::env::args().nth(1).as_deref() {
        Some("plans") => return cudnn_plans(&dev),
        Some("hopper") => return hopper(&dev, &WAN_CASES),
        Some("head-dims") => return hopper(&dev, &HEAD_DIM_CASES),
        Some("sage") => return sage(&dev, std::env::args().nth(2).as_deref()),
        _ => {}
    }
    let Device::Cuda(cuda) = &dev else {
        unreachable!("checked above")
    };
    println!(
        "{:<11} {:>5} {:>24} {:>10} {:>7} {:>16} {:>10} {:>8} {:>10} {:>10} {:>10} {:>10}",
        "shape",
        "dtype",
        "b,h,q,kv,d",
        "chunked ms",
        "limit",
        "rows/smem B",
        "fused ms",
        "TFLOP/s",
        "fused max",
        "fused rel",
        "chunk max",
        "chunk rel"
    );
    for (name, dtype, b, h, n, m, d) in shapes {
        let rand = |len: usize| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, 1f32, (b, h, len, d), &dev)?.to_dtype(dtype)?)
        };
        let (q, k, v) = (rand(n)?, rand(m)?, rand(m)?);
        let scale = 1.0 / (d as f64).sqrt();
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let reference = sdpa_chunked(&f32(&q)?, &f32(&k)?, &f32(&v)?, scale)?;
        let (old_max, old_rel) = errors(&sdpa_chunked(&q, &k, &v, scale)?, &reference)?;
        let old = time(&dev, 3, || sdpa_chunked(&q, &k, &v, scale))?;
        // The limits are interleaved within a shape, so clock drift hits them alike.
        for (label, limit) in LIMITS {
            set_limit(limit);
            let tile = device_tile(cuda, d, dtype).map_or("chunked".to_string(), |t| {
                format!("{}/{}", t.rows, t.shared_bytes)
            });
            let (fused_max, fused_rel) = errors(&sdpa(&q, &k, &v, scale)?, &reference)?;
            let fused = time(&dev, 10, || sdpa(&q, &k, &v, scale))?;
            let tflops = 4.0 * (b * h * n * m * d) as f64 / fused / 1e12;
            println!(
                "{name:<11} {:>5} {:>24} {:>10.3} {label:>7} {tile:>16} {:>10.3} {tflops:>8.1} {fused_max:>10.2e} {fused_rel:>10.2e} {old_max:>10.2e} {old_rel:>10.2e}",
                format!("{dtype:?}"),
                format!("{b},{h},{n},{m},{d}"),
                old * 1e3,
                fused * 1e3,
            );
        }
        set_limit(None);
    }
    cudnn_plans(&dev)
}

/// Every engine config cuDNN finalizes for the Wan self-attention shapes (its heuristics'
/// configs, then the other knob settings of their engines, then its other engines), timed at
/// 1.3B's shape, and those within 10% of candidate 0 (the one vidgen runs) again at 14B's, with
/// their error against candidate 0.
fn cudnn_plans(dev: &Device) -> Result<()> {
    /// Candidates tried.
    const MAX_CANDIDATES: usize = 2000;
    let (b, n, d) = (1, 32760, 128);
    let scale = 1.0 / (d as f64).sqrt();
    let mut near = vec![0];
    for (name, h) in [("1.3B self", 12), ("14B self", 40)] {
        let rand = || -> Result<Tensor> {
            Ok(Tensor::randn(0f32, 1f32, (b, h, n, d), dev)?.to_dtype(DType::BF16)?)
        };
        let (q, k, v) = (rand()?, rand()?, rand()?);
        let run = |plan| sdpa_with_plan(&q, &k, &v, scale, plan);
        let first = run(0)?.0.to_dtype(DType::F32)?;
        let once = |plan| -> Result<f64> {
            let started = std::time::Instant::now();
            run(plan)?;
            dev.synchronize()?;
            Ok(started.elapsed().as_secs_f64())
        };
        let base = time(dev, 5, || run(0).map(|r| r.0))?;
        let candidates: Vec<usize> = if h == 12 {
            (0..MAX_CANDIDATES).collect()
        } else {
            std::mem::take(&mut near)
        };
        for plan in candidates {
            let (out, choice) = match run(plan) {
                Ok(done) => done,
                Err(e) if e.to_string().contains("no candidate") => break,
                Err(e) => {
                    println!(
                        "{name} candidate {plan}: {}",
                        e.to_string().lines().next().unwrap_or("")
                    );
                    continue;
                }
            };
            let (max, _) = errors(&out, &first)?;
            let single = once(plan)?;
            if single > 1.5 * base {
                println!(
                    "{name} candidate {plan} ({choice}): one run {:.3} ms, not timed",
                    single * 1e3
                );
                continue;
            }
            let s = time(dev, 5, || run(plan).map(|r| r.0))?;
            if s <= 1.1 * base && plan > 0 {
                near.push(plan);
            }
            let tflops = 4.0 * (b * h * n * n * d) as f64 / s / 1e12;
            println!(
                "{name} candidate {plan} ({choice}): {:.3} ms {tflops:.1} TFLOP/s (candidate 0 {:.3} ms), max vs 0 {max:.2e}",
                s * 1e3,
                base * 1e3
            );
        }
    }
    Ok(())
}

/// cuDNN's attention (its first plan), the Hopper kernel and the portable kernel (where it takes
/// the head_dim) at `cases` `(name, batch, heads, queries, keys, head_dim)`: rounds of each in
/// turn, so the clocks' drift under sustained load hits them alike; the error of each against
/// cuDNN's output. `hopper`: the Wan self- and cross-attention shapes and key counts between;
/// `head-dims`: the other families' head dims (the Hopper kernel computes those below 128 as 128).
fn hopper(dev: &Device, cases: &[(&str, usize, usize, usize, usize, usize)]) -> Result<()> {
    /// Rounds, and timed calls of each kernel per round.
    const ROUNDS: usize = 3;
    const REPS: usize = 10;
    for &(name, b, h, n, m, d) in cases {
        let scale = 1.0 / (d as f64).sqrt();
        let rand = |len: usize| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, 1f32, (b, len, h, d), dev)?
                .to_dtype(DType::BF16)?
                .transpose(1, 2)?)
        };
        let (q, k, v) = (rand(n)?, rand(m)?, rand(m)?);
        if !flash_attn_sm90::supported(&q, &k, &v) {
            bail!("the Hopper kernel does not take {name} on this GPU");
        }
        let cudnn = || sdpa_with_plan(&q, &k, &v, scale, 0).map(|r| r.0);
        let sm90 = || flash_attn_sm90::flash_attn(&q, &k, &v, scale);
        let portable = || flash_attn::flash_attn(&q, &k, &v, scale);
        let with_portable = flash_attn::supported(&q, &k, &v);
        let reference = cudnn()?.to_dtype(DType::F32)?;
        let mut outs = vec![("sm90", sm90()?)];
        if with_portable {
            outs.push(("portable", portable()?));
        }
        for (label, out) in outs {
            let (max, rel) = errors(&out, &reference)?;
            println!("{name} {label} vs cuDNN: max {max:.2e}, relative {rel:.2e}");
        }
        let flops = 4.0 * (b * h * n * m * d) as f64;
        for round in 0..ROUNDS {
            let mut times = vec![
                ("cuDNN", time(dev, REPS, cudnn)?),
                ("sm90", time(dev, REPS, sm90)?),
            ];
            if with_portable {
                times.push(("portable", time(dev, REPS, portable)?));
            }
            let line: Vec<String> = times
                .iter()
                .map(|(label, s)| {
                    format!(
                        "{label} {:.3} ms ({:.0} TFLOP/s)",
                        s * 1e3,
                        flops / s / 1e12
                    )
                })
                .collect();
            println!("{name} round {round}: {}", line.join(", "));
        }
    }
    Ok(())
}

/// The 8-bit attention (`--attention sage`, both launch configurations, then under GB10's
/// shared-memory limit) against `sdpa`'s exact path (the Hopper kernel or cuDNN) and the portable
/// bf16 kernel, at Wan's self- and cross-attention shapes, in interleaved rounds; each output's
/// relative L2 error and cosine similarity against the f32 attention.
fn sage(dev: &Device, only: Option<&str>) -> Result<()> {
    const ROUNDS: usize = 3;
    const REPS: usize = 10;
    let b = 1;
    for (name, h, n, m, d) in [
        ("1.3B self", 12, 32760, 32760, 128),
        ("14B self", 40, 32760, 32760, 128),
        ("14B cross", 40, 32760, 512, 128),
        ("d64 self", 24, 32760, 32760, 64),
    ]
    .into_iter()
    .filter(|(name, ..)| only.is_none_or(|only| name.starts_with(only)))
    {
        let rand = |len: usize| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, 1f32, (b, len, h, d), dev)?
                .to_dtype(DType::BF16)?
                .transpose(1, 2)?)
        };
        let (q, k, v) = (rand(n)?, rand(m)?, rand(m)?);
        let scale = 1.0 / (d as f64).sqrt();
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let reference = sdpa_chunked(&f32(&q)?, &f32(&k)?, &f32(&v)?, scale)?;
        let exact = || sdpa(&q, &k, &v, scale);
        let portable = || flash_attn::flash_attn(&q, &k, &v, scale);
        let with = |kernel| sage_kernels::attend_with(&q, &k, &v, scale, Some(kernel));
        let sage2 = || with(Kernel::Portable(2));
        let sage1 = || with(Kernel::Portable(1));
        let Device::Cuda(cuda) = dev else {
            bail!("sage needs a CUDA device")
        };
        let hopper = sage_kernels::device_kernel(cuda, d) == Some(Kernel::Hopper);
        let sm90 = || {
            with(if hopper {
                Kernel::Hopper
            } else {
                Kernel::Portable(2)
            })
        };
        let cosine = |out: &Tensor| -> Result<f32> {
            let out = out.to_dtype(DType::F32)?;
            let dot = |a: &Tensor, b: &Tensor| -> Result<f32> {
                Ok((a * b)?.sum_all()?.to_scalar::<f32>()?)
            };
            Ok(dot(&out, &reference)? / (dot(&out, &out)? * dot(&reference, &reference)?).sqrt())
        };
        for (label, out) in [
            ("exact", exact()?),
            ("portable", portable()?),
            ("sage m2", sage2()?),
            ("sage m1", sage1()?),
            ("sage sm90", sm90()?),
        ] {
            let (max, rel) = errors(&out, &reference)?;
            let cos = cosine(&out)?;
            println!("{name} {label} vs f32: max {max:.2e}, relative {rel:.2e}, cosine {cos:.6}");
        }
        let flops = 4.0 * (b * h * n * m * d) as f64;
        for round in 0..ROUNDS {
            let mut times = vec![
                ("exact", time(dev, REPS, exact)?),
                ("portable", time(dev, REPS, portable)?),
                ("sage m2", time(dev, REPS, sage2)?),
                ("sage m1", time(dev, REPS, sage1)?),
                ("sage sm90", time(dev, REPS, sm90)?),
            ];
            set_limit(Some(101_376));
            times.push((
                "sage gb10",
                time(dev, REPS, || sage_kernels::attend(&q, &k, &v, scale))?,
            ));
            set_limit(None);
            let base = times[0].1;
            let line: Vec<String> = times
                .iter()
                .map(|(label, s)| {
                    format!(
                        "{label} {:.3} ms ({:.0} TFLOP/s, {:.2}x)",
                        s * 1e3,
                        flops / s / 1e12,
                        base / s
                    )
                })
                .collect();
            println!("{name} round {round}: {}", line.join(", "));
        }
    }
    Ok(())
}
