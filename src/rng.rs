//! torch's CPU generator, bit for bit: `torch.Generator("cpu").manual_seed(S)` and the
//! `torch.randn(shape, generator=g, dtype=torch.float32)` draws diffusers' pipelines make with
//! it, so `--seed S` reproduces a diffusers run seeded that way (fixtures README, "torch's CPU
//! `randn`, exactly").
//!
//! MT19937 seeded with the seed's low 32 bits. Fewer than 16 values take torch's scalar double
//! Box-Muller (`at::normal_distribution<double>`, whose second value waits in the generator for
//! the next such draw); 16 or more take the 16-wide float Box-Muller that torch runs on x86-64
//! with AVX2 (`normal_fill_16_AVX2`, the Cephes `log` / `sincos` polynomials of
//! `ATen/native/cpu/avx_mathfun.h` with fused multiply-adds where the compiler fuses them), on
//! every machine alike. bf16 and f16 draws (diffusers asks for them where it passes the run
//! dtype) take torch's generic `normal_fill`: uniforms of 8 or 11 bits and Box-Muller in the
//! half type, rounding after each operation as c10's `BFloat16` / `Half` arithmetic does.

use candle_core::{DType, Device, Tensor};

const N: usize = 624;
const M: usize = 397;

/// torch's CPU generator (`at::CPUGeneratorImpl`): its MT19937 engine and the cached second
/// value of the scalar double path.
#[derive(Debug, Clone)]
pub struct TorchGenerator {
    state: Box<[u32; N]>,
    next: usize,
    next_double_normal: Option<f64>,
}

impl TorchGenerator {
    /// `torch.Generator("cpu").manual_seed(seed)`: torch keeps any u64 but seeds MT19937 with
    /// its low 32 bits (`init_genrand`), so 2^32 + 7 draws what 7 draws.
    pub fn new(seed: u64) -> Self {
        let mut state = Box::new([0u32; N]);
        state[0] = seed as u32;
        for j in 1..N {
            let prev = state[j - 1];
            state[j] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(j as u32);
        }
        Self {
            state,
            next: N,
            next_double_normal: None,
        }
    }

    /// The engine's next 32-bit word (`random()`).
    pub fn next_u32(&mut self) -> u32 {
        if self.next >= N {
            self.twist();
        }
        let mut y = self.state[self.next];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9D2C_5680;
        y ^= (y << 15) & 0xEFC6_0000;
        y ^ (y >> 18)
    }

    fn twist(&mut self) {
        let s = &mut self.state;
        for i in 0..N {
            let y = (s[i] & 0x8000_0000) | (s[(i + 1) % N] & 0x7FFF_FFFF);
            let mag = if y & 1 == 1 { 0x9908_B0DF } else { 0 };
            s[i] = s[(i + M) % N] ^ (y >> 1) ^ mag;
        }
        self.next = 0;
    }

    /// `uniform_real_distribution<float>(0, 1)`: 24 random bits of one word.
    fn uniform_f32(&mut self) -> f32 {
        (self.next_u32() & 0xFF_FFFF) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// `uniform_real_distribution<double>(0, 1)`: 53 bits of two words, the first high.
    fn uniform_f64(&mut self) -> f64 {
        let hi = self.next_u32() as u64;
        let bits = (hi << 32) | self.next_u32() as u64;
        (bits & ((1u64 << 53) - 1)) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// `at::normal_distribution<double>`: one value, the sine of each pair cached for the next.
    fn normal_f64(&mut self) -> f64 {
        if let Some(cached) = self.next_double_normal.take() {
            return cached;
        }
        let u1 = self.uniform_f64();
        let u2 = self.uniform_f64();
        let r = (-2.0 * (-u2).ln_1p()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u1;
        self.next_double_normal = Some(r * theta.sin());
        r * theta.cos()
    }

    /// `torch.randn(n, generator=self, dtype=torch.float32)` on the CPU, as a flat vector.
    fn randn_values(&mut self, n: usize) -> Vec<f32> {
        if n < 16 {
            return (0..n).map(|_| self.normal_f64() as f32).collect();
        }
        self.normal_fill(n, Self::uniform_f32, fill16)
    }

    /// torch's `normal_fill` (n >= 16): all n uniforms first, then Box-Muller on each block of
    /// 16 in place; a partial last block: 16 more uniforms, from which the last 16 values are
    /// recomputed.
    fn normal_fill(
        &mut self,
        n: usize,
        uniform: impl Fn(&mut Self) -> f32,
        fill: impl Fn(&mut [f32]),
    ) -> Vec<f32> {
        let mut data: Vec<f32> = (0..n).map(|_| uniform(self)).collect();
        data.chunks_exact_mut(16).for_each(&fill);
        if !n.is_multiple_of(16) {
            let tail = &mut data[n - 16..];
            for v in tail.iter_mut() {
                *v = uniform(self);
            }
            fill(tail);
        }
        data
    }

    /// `torch.randn(shape, generator=self, dtype=torch.float32)`: an f32 tensor on the CPU.
    pub fn randn(&mut self, shape: &[usize]) -> candle_core::Result<Tensor> {
        let values = self.randn_values(shape.iter().product());
        Tensor::from_vec(values, shape, &Device::Cpu)
    }

    /// `torch.randn(shape, generator=self, dtype=dtype)` on the CPU, for f32, bf16 and f16.
    pub fn randn_as(&mut self, shape: &[usize], dtype: DType) -> candle_core::Result<Tensor> {
        let n = shape.iter().product();
        let (digits, round): (u32, fn(f32) -> f32) = match dtype {
            DType::F32 => return self.randn(shape),
            DType::BF16 => (8, |x| half::bf16::from_f32(x).to_f32()),
            DType::F16 => (11, |x| half::f16::from_f32(x).to_f32()),
            _ => {
                candle_core::bail!("torch's draws are made here in f32, bf16 or f16, not {dtype:?}")
            }
        };
        let values = if n < 16 {
            // The double value goes to the half type through float, as c10's constructors take it.
            (0..n).map(|_| round(self.normal_f64() as f32)).collect()
        } else {
            self.normal_fill(n, |g| g.uniform_bits(digits), |d| fill16_rounded(d, round))
        };
        Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)
    }

    /// `uniform_real_distribution<T>(0, 1)` of a half type: `digits` random bits of one word.
    fn uniform_bits(&mut self, digits: u32) -> f32 {
        (self.next_u32() & ((1 << digits) - 1)) as f32 / (1u32 << digits) as f32
    }
}

/// torch's generic `normal_fill_16` in a half type: every operation rounds to it (`round`).
fn fill16_rounded(d: &mut [f32], round: fn(f32) -> f32) {
    for j in 0..8 {
        let u1 = round(1.0 - d[j]);
        let radius = round(round(-2.0 * round(u1.ln())).sqrt());
        // `2.0f * pi<double> * u2` is a double, which reaches the half type through float.
        let theta = round((2.0 * std::f64::consts::PI * d[j + 8] as f64) as f32);
        d[j] = round(radius * round(theta.cos())) + 0.0;
        d[j + 8] = round(radius * round(theta.sin())) + 0.0;
    }
}

/// Constants go through f64 to f32 as the C++ `static const float` of a double literal does.
const fn f(x: f64) -> f32 {
    x as f32
}

/// `normal_fill_16_AVX2`: Box-Muller over the pairs (j, j + 8) of 16 uniforms, in place.
fn fill16(d: &mut [f32]) {
    for j in 0..8 {
        let radius = (-2.0f32 * log_ps(1.0 - d[j])).sqrt();
        let (sin, cos) = sincos_ps(f(2.0 * std::f64::consts::PI) * d[j + 8]);
        // torch multiplies by std (1) and adds mean (0): a -0 becomes +0.
        d[j] = radius * cos + 0.0;
        d[j + 8] = radius * sin + 0.0;
    }
}

/// `log256_ps` of avx_mathfun.h for x in (0, 1].
fn log_ps(x: f32) -> f32 {
    let x = x.max(f32::MIN_POSITIVE);
    let bits = x.to_bits();
    let mut e = ((bits >> 23) as i32 - 0x7F) as f32 + 1.0;
    // The mantissa, in [0.5, 1).
    let mut x = f32::from_bits((bits & 0x807F_FFFF) | 0.5f32.to_bits());
    let below = x < f(std::f64::consts::FRAC_1_SQRT_2);
    let tmp = if below { x } else { 0.0 };
    x -= 1.0;
    e -= if below { 1.0 } else { 0.0 };
    x += tmp;
    let z = x * x;
    let mut y = f(7.0376836292e-2);
    for c in [
        -1.1514610310e-1,
        1.1676998740e-1,
        -1.2420140846e-1,
        1.4249322787e-1,
        -1.6668057665e-1,
        2.0000714765e-1,
        -2.4999993993e-1,
        3.3333331174e-1,
    ] {
        y = y.mul_add(x, f(c));
    }
    y *= x;
    y = y.mul_add(z, e * f(-2.12194440e-4));
    y -= z * 0.5;
    x += y;
    e.mul_add(f(0.693359375), x)
}

/// `sincos256_ps` of avx_mathfun.h for x >= 0: (sin x, cos x).
fn sincos_ps(x: f32) -> (f32, f32) {
    let j = (((x * f(1.27323954473516)) as i32) + 1) & !1;
    let y = j as f32;
    let sign_sin = ((j & 4) as u32) << 29;
    let poly_sin = j & 2 == 0;
    let mut x = x;
    for dp in [
        -0.78515625,
        -2.418_756_484_985_351_6e-4,
        -3.774_894_977_445_941e-8,
    ] {
        x = y.mul_add(f(dp), x);
    }
    let sign_cos = ((!(j - 2) & 4) as u32) << 29;
    let z = x * x;
    let yc = f(2.443315711809948e-5).mul_add(z, f(-1.388731625493765e-3));
    let yc = yc.mul_add(z, f(4.166664568298827e-2));
    let yc = (yc * z).mul_add(z, -(z * 0.5)) + 1.0;
    let ys = f(-1.9515295891e-4).mul_add(z, f(8.3321608736e-3));
    let ys = ys.mul_add(z, f(-1.6666654611e-1));
    let ys = (ys * z).mul_add(x, x);
    let (ysin1, ysin2) = if poly_sin { (0.0, ys) } else { (yc, 0.0) };
    let sin = f32::from_bits((ysin1 + ysin2).to_bits() ^ sign_sin);
    let cos = f32::from_bits(((yc - ysin1) + (ys - ysin2)).to_bits() ^ sign_cos);
    (sin, cos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// `seeds.safetensors` of the ecosystem fixture: torch's own draws.
    fn reference() -> HashMap<String, Tensor> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/ecosystem-a/seeds.safetensors"
        );
        candle_core::safetensors::load(path, &Device::Cpu).unwrap()
    }

    const SEEDS: [u64; 3] = [0, 4_294_967_303, 42];

    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.into_iter().map(f32::to_bits).collect()
    }

    #[test]
    fn the_engine_gives_torchs_first_words() {
        let r = reference();
        for seed in SEEDS {
            let want: Vec<i64> = r[&format!("mt19937.seed{seed}.first16")].to_vec1().unwrap();
            let mut g = TorchGenerator::new(seed);
            let got: Vec<i64> = (0..16).map(|_| g.next_u32() as i64).collect();
            assert_eq!(got, want, "seed {seed}");
        }
    }

    /// Every recorded draw, bit for bit: the double path (1, 15), the float path (16, 100),
    /// its tail rule (17) and the latent shape.
    #[test]
    fn randn_is_torchs_bit_for_bit() {
        let r = reference();
        for seed in SEEDS {
            for n in [1usize, 15, 16, 17, 100] {
                let got = TorchGenerator::new(seed).randn(&[n]).unwrap();
                let want = &r[&format!("randn.seed{seed}.n{n}")];
                assert_eq!(bits(&got), bits(want), "seed {seed}, n {n}");
            }
            let want = &r[&format!("randn.seed{seed}.latent")];
            let got = TorchGenerator::new(seed).randn(want.dims()).unwrap();
            assert_eq!(bits(&got), bits(want), "seed {seed}, latent");
        }
    }

    /// A batch of two is one draw from one generator: two consecutive latent-sized draws.
    #[test]
    fn consecutive_draws_are_diffusers_batch() {
        let r = reference();
        let batch = &r["batch.latents"];
        let mut g = TorchGenerator::new(0);
        let one = &batch.dims()[1..];
        let got = Tensor::cat(&[g.randn(one).unwrap(), g.randn(one).unwrap()], 0).unwrap();
        assert_eq!(bits(&got), bits(&batch.reshape(got.dims()).unwrap()));
    }

    /// Half-type draws: values of that type; below 16 values the double path rounded through
    /// float; 16 or more from 8 (bf16) or 11 (f16) bits a uniform, standard normal in the mean.
    #[test]
    fn half_type_draws_follow_torchs_generic_path() {
        for (dtype, digits) in [(DType::BF16, 8), (DType::F16, 11)] {
            let small = TorchGenerator::new(3).randn_as(&[15], dtype).unwrap();
            let want = TorchGenerator::new(3)
                .randn(&[15])
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            assert_eq!(
                bits(&small.to_dtype(DType::F32).unwrap()),
                bits(&want.to_dtype(DType::F32).unwrap())
            );
            let mut g = TorchGenerator::new(3);
            let u: Vec<f32> = (0..16).map(|_| g.uniform_bits(digits)).collect();
            assert!(u
                .iter()
                .all(|v| (v * (1u32 << digits) as f32).fract() == 0.0 && *v < 1.0));
            let big = TorchGenerator::new(3).randn_as(&[100_003], dtype).unwrap();
            assert_eq!(big.dtype(), dtype);
            let v: Vec<f32> = big.to_dtype(DType::F32).unwrap().to_vec1().unwrap();
            let mean = v.iter().sum::<f32>() / v.len() as f32;
            let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
            assert!(
                mean.abs() < 0.02 && (var - 1.0).abs() < 0.02,
                "{dtype:?}: {mean} {var}"
            );
        }
        assert!(TorchGenerator::new(3).randn_as(&[4], DType::F64).is_err());
    }

    /// An odd draw on the double path leaves its sine for the next one; a float-path draw
    /// neither uses nor clears it.
    #[test]
    fn the_cached_sine_carries_to_the_next_small_draw() {
        let two = TorchGenerator::new(5).randn_values(2);
        let mut g = TorchGenerator::new(5);
        assert_eq!(g.randn_values(1), [two[0]]);
        g.randn_values(16);
        assert_eq!(g.randn_values(1), [two[1]]);
    }
}
