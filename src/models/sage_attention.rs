//! 8-bit attention (`--attention sage`): SageAttention2's scheme, defined here on the host (CPU
//! runs, and the reference of the CUDA tests); on CUDA `kernels/sage_attn.cu` computes it
//! (`kernels/sage_attn.rs`) on every GPU with fp8 tensor cores.
//!
//! For one (batch, head) with queries q `[n, D]`, keys k and values v `[m, D]` and the score
//! scale `scale`, in f32:
//! 1. k̄ and v̄: the channel means over the keys. k - k̄ ("smoothed keys") changes every score of a
//!    query by the same amount, which the softmax drops, and leaves int8 codes more range;
//! 2. each query row, and each block of 128 smoothed key rows (the last one shorter), as int8
//!    codes c = round_even(x / s) with s = absmax / 127 over the row or block (zero: s = 0,
//!    codes 0);
//! 3. each channel of v - v̄ over its scale s_v = max |v - v̄| / 448 as e4m3 codes;
//! 4. scores t = (c_q · c_k) · (s_q · scale · log2 e) · s_k: the code products are exact sums;
//! 5. p = 2^(t - max t); P's codes e4m3(448 p) and their sum l = Σ e4m3(448 p) in f32 (the
//!    kernels take l from the tensor cores beside P V);
//! 6. out = (Σ e4m3(448 p) · codes(v)) · s_v / l + v̄ (the rounded probabilities sum to one, so
//!    the mean comes back exactly).
//!
//! The kernel takes the softmax's max tile by tile (FlashAttention's online softmax), so its
//! probabilities are rounded to e4m3 against a running max rather than the row's; it differs
//! from this definition by those roundings.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Result, Tensor};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::models::fp8::E4M3_MAX;
use crate::weights::StorageDtype;

/// int8's largest code used: a row's absmax maps to it.
pub const I8_MAX: f32 = 127.0;

/// Keys that share one scale of their int8 codes.
pub const KEY_BLOCK: usize = 128;

/// How the attention of the DiTs' forwards computes (`--attention`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKind {
    /// In the run's dtype with an f32 softmax: diffusers' result.
    #[default]
    Exact,
    /// 8-bit products by the definition above.
    Sage,
}

impl AttentionKind {
    /// The flag's value: `exact` or `sage`.
    pub fn parse(value: &str) -> std::result::Result<Self, String> {
        match value {
            "exact" => Ok(Self::Exact),
            "sage" => Ok(Self::Sage),
            other => Err(format!(
                "unknown attention `{other}`: use exact (diffusers' arithmetic) or sage (8-bit products, SageAttention2's scheme)"
            )),
        }
    }

    /// The flag's value of this kind.
    pub fn name(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::Sage => "sage",
        }
    }
}

thread_local! {
    /// The kind [`crate::models::attention::sdpa`] computes on this thread.
    static KIND: Cell<AttentionKind> = const { Cell::new(AttentionKind::Exact) };
}

/// Runs `f` with this thread's attention computing as `kind`, as before afterwards: the denoising
/// loop runs each DiT forward so, while text encoders and VAEs stay exact.
pub fn computing<T>(kind: AttentionKind, f: impl FnOnce() -> T) -> T {
    struct Restore(AttentionKind);
    impl Drop for Restore {
        fn drop(&mut self) {
            KIND.with(|k| k.set(self.0));
        }
    }
    let _restore = Restore(KIND.with(|k| k.replace(kind)));
    f()
}

/// The kind this thread's attention computes as now.
pub fn current() -> AttentionKind {
    KIND.with(Cell::get)
}

/// Attentions this process computed in 8 bits, for the run's report.
static CALLS: AtomicU64 = AtomicU64::new(0);

/// How many attentions this process has computed in 8 bits so far.
pub fn calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// On CUDA, attentions over at most this many keys stay exact: the 8-bit path's preparation
/// passes (statistics, codes) cost more there than its products save (session 28, H200: Wan2.1
/// 14B's cross-attention over 512 keys took 2.5 ms against the exact path's 1.4 ms, while its
/// self-attention over 32,760 keys took 32.4 ms against 36.2).
pub const CUDA_FROM_KEYS: usize = 8192;

/// `softmax(q kᵀ · scale) v` over `[batch, heads, seq, head_dim]` by the 8-bit definition where
/// the device computes it: the host always; CUDA where the kernel takes the inputs (fp8 tensor
/// cores, bf16 or f16, head_dim 64 or 128) over more than [`CUDA_FROM_KEYS`] keys. `None`
/// elsewhere: the caller computes it exactly.
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Option<Tensor>> {
    let out = match q.device() {
        Device::Cpu => Some(attend_host(q, k, v, scale)?),
        #[cfg(feature = "cuda")]
        Device::Cuda(_)
            if k.dim(2)? > CUDA_FROM_KEYS && crate::models::sage_kernels::supported(q, k, v) =>
        {
            Some(crate::models::sage_kernels::attend(q, k, v, scale)?)
        }
        _ => None,
    };
    if out.is_some() {
        CALLS.fetch_add(1, Ordering::Relaxed);
    }
    Ok(out)
}

/// The definition on the host, in f32; the result in q's dtype.
pub fn attend_host(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, n, d) = q.dims4()?;
    let m = k.dim(2)?;
    if k.dims4()? != (b, h, m, d) || v.dims4()? != (b, h, m, d) || m == 0 {
        candle_core::bail!(
            "sage attention: q {:?}, k {:?}, v {:?} do not make one attention",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    let values = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
    let (qv, kv, vv) = (values(q)?, values(k)?, values(v)?);
    let scale_log2 = (scale * std::f64::consts::LOG2_E) as f32;
    let mut out = vec![0f32; b * h * n * d];
    out.par_chunks_mut(n * d).enumerate().for_each(|(bh, out)| {
        let keys = Head::new(&kv[bh * m * d..][..m * d], &vv[bh * m * d..][..m * d], d);
        out.par_chunks_mut(d)
            .zip(qv[bh * n * d..][..n * d].par_chunks(d))
            .for_each(|(out, query)| keys.attend(query, scale_log2, out));
    });
    Tensor::from_vec(out, (b, h, n, d), &Device::Cpu)?
        .to_dtype(q.dtype())?
        .to_device(q.device())
}

/// Values as int8 codes (held as f32) over one scale, and the scale.
fn int8_codes(row: &[f32]) -> (Vec<f32>, f32) {
    let scale = row.iter().fold(0f32, |m, x| m.max(x.abs())) / I8_MAX;
    let codes = row
        .iter()
        .map(|&x| {
            if scale > 0.0 {
                (x / scale).round_ties_even().clamp(-I8_MAX, I8_MAX)
            } else {
                0.0
            }
        })
        .collect();
    (codes, scale)
}

/// One (batch, head)'s keys and values, quantized.
struct Head {
    d: usize,
    /// Smoothed keys' int8 codes `[m, D]` and each key's block's scale `[m]`.
    key_codes: Vec<f32>,
    key_scales: Vec<f32>,
    /// Values' e4m3 codes `[m, D]` (centred, over their channel's scale).
    value_codes: Vec<f32>,
    value_mean: Vec<f32>,
    value_scale: Vec<f32>,
}

impl Head {
    fn new(k: &[f32], v: &[f32], d: usize) -> Self {
        let m = k.len() / d;
        let mean = |x: &[f32]| -> Vec<f32> {
            let mut sum = vec![0f32; d];
            for row in x.chunks_exact(d) {
                sum.iter_mut().zip(row).for_each(|(s, x)| *s += x);
            }
            sum.iter().map(|s| s / m as f32).collect()
        };
        let (key_mean, value_mean) = (mean(k), mean(v));
        let mut key_codes = Vec::with_capacity(m * d);
        let mut key_scales = Vec::with_capacity(m);
        for block in k.chunks(KEY_BLOCK * d) {
            let smoothed: Vec<f32> = block
                .chunks_exact(d)
                .flat_map(|row| row.iter().zip(&key_mean).map(|(x, m)| x - m))
                .collect();
            let (codes, scale) = int8_codes(&smoothed);
            key_codes.extend(codes);
            key_scales.extend(std::iter::repeat_n(scale, block.len() / d));
        }
        let (mut lo, mut hi) = (vec![f32::INFINITY; d], vec![f32::NEG_INFINITY; d]);
        for row in v.chunks_exact(d) {
            for (c, &x) in row.iter().enumerate() {
                lo[c] = lo[c].min(x);
                hi[c] = hi[c].max(x);
            }
        }
        let value_scale: Vec<f32> = (0..d)
            .map(|c| (hi[c] - value_mean[c]).max(value_mean[c] - lo[c]) / E4M3_MAX)
            .collect();
        let e4m3 = StorageDtype::Float8E4m3fn;
        let value_codes = v
            .chunks_exact(d)
            .flat_map(|row| {
                row.iter()
                    .zip(&value_mean)
                    .zip(&value_scale)
                    .map(|((x, mean), s)| {
                        if *s > 0.0 {
                            e4m3.round((x - mean) / s)
                        } else {
                            0.0
                        }
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        Head {
            d,
            key_codes,
            key_scales,
            value_codes,
            value_mean,
            value_scale,
        }
    }

    /// One query row's output.
    fn attend(&self, query: &[f32], scale_log2: f32, out: &mut [f32]) {
        let (codes, q_scale) = int8_codes(query);
        let row_scale = q_scale * scale_log2;
        let scores: Vec<f32> = self
            .key_codes
            .chunks_exact(self.d)
            .zip(&self.key_scales)
            .map(|(key, s)| codes.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() * row_scale * s)
            .collect();
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let e4m3 = StorageDtype::Float8E4m3fn;
        let mut sum = 0f32;
        let mut acc = vec![0f32; self.d];
        for (t, values) in scores.iter().zip(self.value_codes.chunks_exact(self.d)) {
            let code = e4m3.round((t - max).exp2() * E4M3_MAX);
            sum += code;
            acc.iter_mut().zip(values).for_each(|(a, v)| *a += code * v);
        }
        let inv = 1.0 / sum;
        for (c, o) in out.iter_mut().enumerate() {
            *o = acc[c] * inv * self.value_scale[c] + self.value_mean[c];
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::models::attention::sdpa_chunked;

    /// ‖a − b‖ / ‖b‖ and the cosine similarity of two tensors.
    pub(crate) fn compare(a: &Tensor, b: &Tensor) -> Result<(f64, f64)> {
        let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
        let dot = |x: &Tensor, y: &Tensor| -> Result<f64> {
            Ok(f64::from((x * y)?.sum_all()?.to_scalar::<f32>()?))
        };
        let diff = (&a - &b)?;
        let (ab, aa, bb) = (dot(&a, &b)?, dot(&a, &a)?, dot(&b, &b)?);
        Ok(((dot(&diff, &diff)? / bb).sqrt(), ab / (aa * bb).sqrt()))
    }

    fn inputs(dims: (usize, usize, usize, usize, usize), spread: f64) -> Result<[Tensor; 3]> {
        let (b, h, n, m, d) = dims;
        let dev = Device::Cpu;
        // Values with a common part per channel, as a DiT's have: the mean comes back exactly.
        let offset = (Tensor::randn(0f32, 1.0, (1, 1, 1, d), &dev)? * 3.0)?;
        Ok([
            (Tensor::randn(0f32, 1.0, (b, h, n, d), &dev)? * spread)?,
            ((Tensor::randn(0f32, 1.0, (b, h, m, d), &dev)? * spread)? + 0.5)?,
            Tensor::randn(0f32, 1.0, (b, h, m, d), &dev)?.broadcast_add(&offset)?,
        ])
    }

    /// The 8-bit definition errs by about e4m3's precision on the probabilities and values,
    /// not more, and it is not the exact attention.
    #[test]
    fn host_definition_is_close_to_exact_attention() -> Result<()> {
        for (dims, spread) in [((1, 2, 40, 300, 64), 1.0), ((2, 1, 17, 129, 128), 2.0)] {
            let [q, k, v] = inputs(dims, spread)?;
            let scale = 1.0 / (dims.4 as f64).sqrt();
            let exact = sdpa_chunked(&q, &k, &v, scale)?;
            let (err, cos) = compare(&attend_host(&q, &k, &v, scale)?, &exact)?;
            assert!(
                err > 1e-4 && err < 2e-2,
                "{dims:?}: relative error {err:.2e}"
            );
            assert!(cos > 0.999, "{dims:?}: cosine {cos}");
        }
        Ok(())
    }

    /// The values are weighted by the probabilities' e4m3 codes over the codes' sum, so the
    /// weights sum to one: two keys at probabilities 1 and 0.6 carry codes 448 and 256 (448 x 0.6
    /// = 268.8 rounds to e4m3's 256), and values +1 and -1 give (448 - 256) / 704, not the
    /// (448 - 256) / 716.8 a sum of the unrounded probabilities would.
    #[test]
    fn values_are_weighted_by_the_codes_over_their_sum() -> Result<()> {
        let dev = Device::Cpu;
        // Smoothed keys +-a score +-a log2(e) against the query: p = e^(-2a) for the second.
        let a = -(0.6f32.ln()) / 2.0;
        let q = Tensor::new(&[1f32, 0.0], &dev)?.reshape((1, 1, 1, 2))?;
        let k = Tensor::new(&[a, 0.0, -a, 0.0], &dev)?.reshape((1, 1, 2, 2))?;
        let v = Tensor::new(&[1f32, 0.0, -1.0, 0.0], &dev)?.reshape((1, 1, 2, 2))?;
        let out: Vec<f32> = attend_host(&q, &k, &v, 1.0)?.flatten_all()?.to_vec1()?;
        assert!((out[0] - 192.0 / 704.0).abs() < 1e-6, "{out:?}");
        assert_eq!(out[1], 0.0);
        Ok(())
    }

    /// Adding one vector to every key shifts each query's scores by a constant, which the
    /// smoothing removes before quantizing: the output stays (to rounding of the mean).
    #[test]
    fn keys_are_smoothed_before_quantizing() -> Result<()> {
        let [q, k, v] = inputs((1, 1, 8, 64, 64), 1.0)?;
        let shift = (Tensor::randn(0f32, 1.0, (1, 1, 1, 64), &Device::Cpu)? * 20.0)?;
        let shifted = k.broadcast_add(&shift)?;
        let a = attend_host(&q, &k, &v, 0.125)?;
        let b = attend_host(&q, &shifted, &v, 0.125)?;
        // Without the smoothing the shift would take most of the int8 range: errors of percents.
        let (err, _) = compare(&b, &a)?;
        assert!(err < 2e-3, "relative change {err:.2e}");
        Ok(())
    }

    #[test]
    fn kinds_parse_and_scope_to_the_thread() {
        assert_eq!(AttentionKind::parse("sage"), Ok(AttentionKind::Sage));
        assert!(AttentionKind::parse("fast").unwrap_err().contains("exact"));
        assert_eq!(current(), AttentionKind::Exact);
        let inside = computing(AttentionKind::Sage, || {
            std::thread::spawn(current)
                .join()
                .map(|other| (current(), other))
        });
        assert_eq!(
            inside.expect("thread"),
            (AttentionKind::Sage, AttentionKind::Exact)
        );
        assert_eq!(current(), AttentionKind::Exact);
    }
}
