//! Scaled dot-product attention that never materialises the whole score matrix.
//!
//! On CUDA, bf16/f16 inputs go to a fused attention that keeps scores on the chip: on Hopper
//! (compute capability 9.0), bf16 at head_dim up to 128 to the own wgmma kernel
//! (`kernels/flash_attn_sm90.cu`); else to cuDNN's fused attention where cuDNN >= 9.13.1 is
//! loaded (`models::cudnn`, head_dim up to 256); else with head_dim 64 or 128 to the own
//! portable kernel (`kernels/flash_attn.cu`). Everything else takes the chunked path below.
//! cuDNN compiles its attention kernels when a process first runs them (0.6 s in Wan's first
//! forward on a machine whose driver cache is empty, 1.0-1.9 s in LTX-Video's and Latte-1's;
//! 0.06-0.08 s in every process's first forward after that), while the own kernels are machine
//! code and level with cuDNN's from head_dim 64 (bench/RESULTS.md, sessions 29, 35 and 41), so
//! where an own kernel computes the shape, cuDNN is not asked.
//!
//! At 480x832x81 a Wan self-attention layer has 32,760 tokens: the full score matrix would be
//! ~26 GB per layer. Queries are processed in chunks so the scratch stays bounded by
//! `heads * chunk * kv_len` elements.
//!
//! At that size the passes over the score chunks dominate (the matmuls are cheap next to
//! them), so the scale is folded into the queries and, on CUDA, half-precision scores are
//! normalised in place by candle's softmax kernel (which accumulates in f32) instead of making
//! round trips through an f32 copy: three passes over each score chunk instead of seven.

use crate::models::sage_attention::{self, AttentionKind};
use candle_core::{DType, Result, Tensor, D};

#[cfg(feature = "cuda")]
#[path = "kernels/flash_attn.rs"]
pub mod flash_attn;
#[cfg(feature = "cuda")]
#[path = "kernels/flash_attn_sm90.rs"]
pub mod flash_attn_sm90;

/// The sizes `(batch, heads, queries, keys, head_dim)` of CUDA half-precision (bf16 or f16)
/// q `[B, H, N, D]` and k, v `[B, H, M, D]` of one dtype with at least one query and one key:
/// the inputs both fused paths (cuDNN's node and the own kernel) start from.
#[cfg(feature = "cuda")]
pub(crate) fn fused_shapes(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Option<(usize, usize, usize, usize, usize)> {
    let (b, h, n, d) = q.dims4().ok()?;
    let (kb, kh, m, kd) = k.dims4().ok()?;
    let fits = q.device().is_cuda()
        && matches!(q.dtype(), DType::BF16 | DType::F16)
        && k.dtype() == q.dtype()
        && v.dtype() == q.dtype()
        && (kb, kh, kd) == (b, h, d)
        && v.dims4().ok()? == (b, h, m, d)
        && n > 0
        && m > 0;
    fits.then_some((b, h, n, m, d))
}

/// Upper bound on score-matrix elements materialised at once.
pub const MAX_SCORE_ELEMENTS: usize = 1 << 27;

/// Whether a forward in `dtype` runs the fused kernels on the device (bf16, f16): attention that
/// keeps its scores on the chip, and the products' bias + GELU epilogue with its cuBLASLt
/// workspace ([`crate::models::fp8::PRODUCT_WORKSPACE`]). Other dtypes take [`sdpa_chunked`].
pub fn runs_fused(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// The cuBLASLt workspace the fused products take from the pool ([`runs_fused`]), else nothing.
pub fn product_workspace(dtype: DType) -> u64 {
    match runs_fused(dtype) {
        true => crate::models::fp8::PRODUCT_WORKSPACE as u64,
        false => 0,
    }
}

/// Device bytes of a joint-sequence DiT's blocks at their peak: the larger of an attention over
/// one sequence of `tokens` rows (`heads` heads `inner` wide in all) holding `copies` copies of
/// it at once (streams, norms, q/k/v, outputs: the same on the device, where HunyuanVideo's
/// blocks peaked at six copies at 720x1280x129, bench/RESULTS.md session 49) with its
/// [`attention_workspace`], and the block's largest other step (`step` bytes); plus the
/// products' workspace ([`product_workspace`]).
pub fn joint_block_activations(
    copies: u64,
    heads: usize,
    tokens: usize,
    inner: usize,
    step: u64,
    dtype: DType,
) -> u64 {
    let held = copies * (tokens * inner) as u64 * dtype.size_in_bytes() as u64;
    let attention = held + attention_workspace(1, heads, tokens, inner, dtype);
    attention.max(step) + product_workspace(dtype)
}

/// Copies of the queries the chunked attention adds: the scaled queries, the transposed keys,
/// the chunks' outputs and their concatenation.
const CHUNKED_ATTENTION_COPIES: u64 = 4;

/// Device bytes [`sdpa`] holds beyond its q, k, v and output over `sequences` sequences of
/// `tokens` queries and keys, `heads` heads `inner` wide in all: nothing where it runs fused
/// ([`runs_fused`]); else the chunked path's copies and one chunk's scores and probabilities
/// ([`MAX_SCORE_ELEMENTS`]).
pub fn attention_workspace(
    sequences: usize,
    heads: usize,
    tokens: usize,
    inner: usize,
    dtype: DType,
) -> u64 {
    if runs_fused(dtype) {
        return 0;
    }
    let d = dtype.size_in_bytes() as u64;
    let (sequences, tokens) = (sequences as u64, tokens as u64);
    let per_query = sequences * heads as u64 * tokens;
    let queries = (MAX_SCORE_ELEMENTS as u64 / per_query.max(1)).clamp(1, tokens);
    CHUNKED_ATTENTION_COPIES * sequences * tokens * inner as u64 * d + 2 * queries * per_query * d
}

/// Attention over `[batch, heads, seq, head_dim]` tensors; `scale` multiplies q·kᵀ.
/// Softmax accumulates in f32 for every dtype.
/// Inside a DiT forward of `--attention sage` (`sage_attention::computing`), where the device
/// computes it, with 8-bit products instead.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    if sage_attention::current() == AttentionKind::Sage {
        if let Some(out) = sage_attention::attend(q, k, v, scale)? {
            return Ok(out);
        }
    }
    #[cfg(feature = "cuda")]
    {
        if flash_attn_sm90::supported(q, k, v) {
            return flash_attn_sm90::flash_attn(q, k, v, scale);
        }
        if let Some(out) = crate::models::cudnn::sdpa::sdpa(q, k, v, scale) {
            return Ok(out);
        }
        if flash_attn::supported(q, k, v) {
            return flash_attn::flash_attn(q, k, v, scale);
        }
    }
    sdpa_chunked(q, k, v, scale)
}

/// [`sdpa`] by query chunks through matmul and softmax, on any device and dtype: the path of
/// every input the fused CUDA kernel does not take, and the reference it is checked against.
pub fn sdpa_chunked(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    sdpa_chunked_with_bias(q, k, v, scale, None)
}

/// [`sdpa`] with an additive bias on the scores before the softmax (a float `attn_mask`),
/// e.g. `[batch, 1, 1, kv_len]` to mask padded keys; any shape that broadcasts to
/// `[batch, heads, q_len, kv_len]` works. Always the chunked path.
pub fn sdpa_with_bias(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    bias: &Tensor,
) -> Result<Tensor> {
    sdpa_chunked_with_bias(q, k, v, scale, Some(bias))
}

/// [`sdpa`] where batch entry `b` sees only its first `kv_lens[b]` keys: a padding mask as a
/// selection of keys, so the fused paths run. It equals an additive mask bias of -10000 (or
/// -inf) on the other keys, whose softmax weights underflow to exactly 0.
pub fn sdpa_key_prefix(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    kv_lens: &[usize],
) -> Result<Tensor> {
    let (batch, _, _, _) = q.dims4()?;
    let keys = k.dim(2)?;
    if kv_lens.len() != batch || kv_lens.iter().any(|&n| n == 0 || n > keys) {
        candle_core::bail!(
            "attention: key lengths {kv_lens:?} for a batch of {batch} x {keys} keys"
        );
    }
    if kv_lens.iter().all(|&n| n == kv_lens[0]) {
        let n = kv_lens[0];
        return sdpa(q, &k.narrow(2, 0, n)?, &v.narrow(2, 0, n)?, scale);
    }
    let outs = (0..batch)
        .map(|b| {
            let n = kv_lens[b];
            sdpa(
                &q.narrow(0, b, 1)?,
                &k.narrow(0, b, 1)?.narrow(2, 0, n)?,
                &v.narrow(0, b, 1)?.narrow(2, 0, n)?,
                scale,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&outs, 0)
}

/// The key lengths of a `[B, L]` keep-mask (1 keep, 0 masked) whose every row keeps a
/// non-empty prefix, else `None` (a mask [`sdpa_key_prefix`] cannot express).
pub fn mask_prefix_lens(mask: &Tensor) -> Result<Option<Vec<usize>>> {
    let rows = mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .iter()
        .map(|row| {
            let n = row.iter().take_while(|&&m| m != 0.0).count();
            (n > 0 && row[n..].iter().all(|&m| m == 0.0)).then_some(n)
        })
        .collect())
}

fn sdpa_chunked_with_bias(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let (b, h, q_len, _) = q.dims4()?;
    let kv_len = k.dim(2)?;
    let per_query = (b * h * kv_len).max(1);
    let chunk = (MAX_SCORE_ELEMENTS / per_query).clamp(1, q_len.max(1));
    let dtype = q.dtype();
    // Scaling the queries (in f32) costs one pass over [q_len, head_dim] instead of one over
    // every score, and spares low-precision scores a second rounding.
    let q = if scale == 1.0 {
        q.clone()
    } else {
        (q.to_dtype(DType::F32)? * scale)?.to_dtype(dtype)?
    };
    let softmax_in_place = dtype == DType::F32
        || dtype == DType::F64
        || (q.device().is_cuda() && matches!(dtype, DType::BF16 | DType::F16));
    let k_t = k.t()?.contiguous()?;
    let v = v.contiguous()?;
    let mut outs = Vec::with_capacity(q_len.div_ceil(chunk));
    let mut start = 0;
    while start < q_len {
        let len = chunk.min(q_len - start);
        let q_chunk = q.narrow(2, start, len)?.contiguous()?;
        let mut scores = q_chunk.matmul(&k_t)?;
        if let Some(bias) = bias {
            // A bias with a query axis longer than 1 is cut to this chunk's queries.
            let bias = if bias.rank() == 4 && bias.dim(2)? == q_len && q_len > 1 {
                bias.narrow(2, start, len)?
            } else {
                bias.clone()
            };
            scores = scores.broadcast_add(&bias.to_dtype(scores.dtype())?)?;
        }
        let probs = if softmax_in_place {
            candle_nn::ops::softmax_last_dim(&scores)?
        } else {
            candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(v.dtype())?
        };
        outs.push(probs.matmul(&v)?);
        start += len;
    }
    Tensor::cat(&outs, D::Minus2)
}

#[cfg(all(test, feature = "cuda"))]
pub(crate) mod cuda_tests {
    use super::*;
    use candle_core::Device;

    /// An attention implementation under test.
    type Attend = fn(&Tensor, &Tensor, &Tensor, f64) -> Result<Tensor>;

    /// The own fused kernel itself (`sdpa` would take cuDNN where it is loaded).
    fn fused(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        assert!(flash_attn::supported(q, k, v));
        flash_attn::flash_attn(q, k, v, scale)
    }

    /// `attend` against the chunked path in f32 on the same inputs; returns ‖out − ref‖ / ‖ref‖.
    fn relative_error(
        dev: &Device,
        dtype: DType,
        (b, h, n, m, d): Dims,
        spread: f64,
        attend: Attend,
    ) -> Result<f64> {
        // Fresh random inputs; `spread` sharpens the softmax. Heads-major views of
        // [b, seq, h, d] storage exercise the kernel's strides.
        let rand = |len: usize, s: f64| -> Result<Tensor> {
            (Tensor::randn(0f32, 1f32, (b, len, h, d), dev)? * s)?
                .to_dtype(dtype)?
                .transpose(1, 2)
        };
        let (q, k, v) = (rand(n, spread)?, rand(m, spread)?, rand(m, 1.0)?);
        let scale = 1.0 / (d as f64).sqrt();
        let out = attend(&q, &k, &v, scale)?.to_dtype(DType::F32)?;
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let reference = sdpa_chunked(&f32(&q)?, &f32(&k)?, &f32(&v)?, scale)?;
        assert_eq!(out.dims(), reference.dims());
        let norm = |t: &Tensor| -> Result<f64> {
            t.sqr()?
                .sum_all()?
                .sqrt()?
                .to_scalar::<f32>()
                .map(f64::from)
        };
        let err = norm(&(out - &reference)?)? / norm(&reference)?;
        assert!(err.is_finite(), "non-finite output");
        Ok(err)
    }

    /// (batch, heads, queries, keys, head_dim).
    pub(crate) type Dims = (usize, usize, usize, usize, usize);

    /// The fused kernels' cases: (dtype, (batch, heads, queries, keys, head_dim), the spread of
    /// the values): whole and partial tiles, one key, batches, both head sizes and dtypes.
    pub(crate) const FUSED_CASES: [(DType, Dims, f64); 6] = [
        (DType::BF16, (1, 2, 1000, 333, 128), 1.0),
        (DType::BF16, (2, 3, 64, 64, 128), 3.0),
        (DType::BF16, (1, 4, 517, 512, 128), 2.0),
        (DType::F16, (1, 2, 129, 77, 128), 2.0),
        (DType::BF16, (1, 2, 300, 1, 64), 1.0),
        (DType::F16, (2, 2, 250, 700, 64), 3.0),
    ];

    #[test]
    fn fused_kernel_matches_chunked_reference() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: fused attention test skipped");
            return Ok(());
        };
        // Every configuration: the device's own (padded), GB10's 99 KB per block (swizzled), and
        // a limit only the one-m-tile configuration fits; each in a process of its own, as the
        // limit is read from the environment.
        use crate::models::kernel_module::isolated;
        let test = "models::attention::cuda_tests::fused_kernel_matches_chunked_reference";
        if !isolated::is_child(test) {
            for limit in [None, Some(101_376), Some(90_000)] {
                let limit = limit.map(|bytes: usize| bytes.to_string());
                isolated::run(test, &[(flash_attn::SHARED_MEMORY_LIMIT_ENV, limit)])
                    .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
            }
            return Ok(());
        }
        let limit = std::env::var(flash_attn::SHARED_MEMORY_LIMIT_ENV).ok();
        for (dtype, dims, spread) in FUSED_CASES {
            let err = relative_error(&dev, dtype, dims, spread, fused)?;
            assert!(
                err < 1e-2,
                "{dtype:?} {dims:?} limit {limit:?}: relative error {err:.2e}"
            );
        }
        Ok(())
    }

    #[test]
    fn hopper_kernel_matches_chunked_reference() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: Hopper attention test skipped");
            return Ok(());
        };
        fn hopper(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
            assert!(flash_attn_sm90::supported(q, k, v));
            flash_attn_sm90::flash_attn(q, k, v, scale)
        }
        let probe = Tensor::zeros((1, 1, 1, 128), DType::BF16, &dev)?;
        if !flash_attn_sm90::supported(&probe, &probe, &probe) {
            eprintln!("not a compute capability 9.0 GPU: Hopper attention test skipped");
            return Ok(());
        }
        // Whole and partial tiles of queries and keys, one key, batches, sharp softmaxes; smaller
        // head dims (zero-filled columns), Latte's 16-frame sequences among them.
        for (dims, spread) in [
            ((1, 3, 1000, 333, 96), 2.0),
            ((2, 2, 130, 700, 72), 3.0),
            ((64, 2, 16, 16, 72), 2.0),
            ((1, 2, 300, 17, 64), 1.0),
            ((1, 2, 1000, 333, 128), 1.0),
            ((2, 3, 64, 64, 128), 3.0),
            ((1, 4, 517, 512, 128), 2.0),
            ((1, 2, 300, 1, 128), 1.0),
            ((2, 2, 256, 700, 128), 3.0),
            ((1, 1, 129, 4097, 128), 4.0),
        ] {
            let err = relative_error(&dev, DType::BF16, dims, spread, hopper)?;
            assert!(err < 1e-2, "{dims:?}: relative error {err:.2e}");
        }
        Ok(())
    }

    /// On Hopper, bf16 at head_dim 128 takes the own kernel over short and long key sequences
    /// alike (cross-attention's 512 text tokens, self-attention's video tokens), never cuDNN.
    #[test]
    fn every_key_length_takes_the_hopper_kernel() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: attention routing test skipped");
            return Ok(());
        };
        let rand = |len: usize| -> Result<Tensor> {
            Tensor::randn(0f32, 1f32, (1, 2, len, 128), &dev)?.to_dtype(DType::BF16)
        };
        let q = rand(100)?;
        if !flash_attn_sm90::supported(&q, &q, &q) {
            eprintln!("not a compute capability 9.0 GPU: attention routing test skipped");
            return Ok(());
        }
        let same = |a: &Tensor, b: &Tensor| -> Result<bool> {
            let gap = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            Ok(gap == 0.0)
        };
        for keys in [512, 8192, 8193] {
            let (k, v) = (rand(keys)?, rand(keys)?);
            let out = sdpa(&q, &k, &v, 0.1)?;
            let hopper = flash_attn_sm90::flash_attn(&q, &k, &v, 0.1)?;
            assert!(same(&out, &hopper)?, "{keys} keys");
        }
        Ok(())
    }

    #[test]
    fn cudnn_attention_matches_chunked_reference() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: cuDNN attention test skipped");
            return Ok(());
        };
        if crate::models::cudnn::api().is_none_or(|api| api.version < 91301) {
            eprintln!("no cuDNN >= 9.13.1: cuDNN attention test skipped");
            return Ok(());
        }
        fn cudnn(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
            crate::models::cudnn::sdpa::sdpa(q, k, v, scale)
                .ok_or_else(|| candle_core::Error::Msg("cuDNN declined".into()))
        }
        for (dtype, dims, spread) in [
            (DType::BF16, (1, 2, 1000, 333, 128), 1.0),
            (DType::BF16, (2, 3, 64, 64, 128), 3.0),
            (DType::F16, (1, 2, 129, 77, 128), 2.0),
            (DType::BF16, (2, 2, 250, 700, 64), 3.0),
            (DType::BF16, (1, 2, 200, 200, 256), 1.0),
        ] {
            let err = relative_error(&dev, dtype, dims, spread, cudnn)?;
            assert!(err < 1e-2, "{dtype:?} {dims:?}: relative error {err:.2e}");
        }
        Ok(())
    }

    #[test]
    fn tiles_fit_gb10_shared_memory() {
        use flash_attn::tile_for;
        let at = |d, limit| tile_for(d, 2, limit).map(|t| (t.m_tiles, t.swizzled, t.shared_bytes));
        // H100/H200 (227 KB) take the padded layout.
        assert_eq!(at(128, 232_448), Some((2, false, 104_448)));
        // GB10 (sm_121) allows 101,376 B per block: the swizzled layout fits at head_dim 128.
        assert_eq!(at(128, 101_376), Some((2, true, 98_304)));
        assert_eq!(at(128, 98_303), Some((1, true, 81_920)));
        assert_eq!(at(128, 48 * 1024), None);
        // head_dim 64 needs about half.
        assert_eq!(at(64, 101_376), Some((2, false, 55_296)));
        assert_eq!(at(64, 48 * 1024), Some((2, true, 49_152)));
        assert_eq!(at(64, 48 * 1024 - 1), Some((1, true, 40_960)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn key_prefix_equals_the_masking_bias() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, n, m, d) = (2, 3, 7, 9, 16);
        let q = Tensor::randn(0f32, 1.0, (b, h, n, d), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (b, h, m, d), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (b, h, m, d), &dev)?;
        let mask = Tensor::from_vec(
            [
                [1f32; 9].to_vec(),
                [1, 1, 1, 1, 0, 0, 0, 0, 0].map(|x| x as f32).to_vec(),
            ]
            .concat(),
            (b, m),
            &dev,
        )?;
        let lens = mask_prefix_lens(&mask)?.expect("a prefix mask");
        assert_eq!(lens, [9, 4]);
        // diffusers' additive form: (1 - mask) * -10000.
        let bias = mask.affine(10000.0, -10000.0)?.reshape((b, 1, 1, m))?;
        let want = sdpa_with_bias(&q, &k, &v, 0.25, &bias)?;
        let got = sdpa_key_prefix(&q, &k, &v, 0.25, &lens)?;
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "max |diff| {diff}");
        Ok(())
    }

    #[test]
    fn masks_that_are_not_a_prefix_are_told_apart() -> Result<()> {
        let dev = Device::Cpu;
        let rows = |v: Vec<f32>| Tensor::from_vec(v, (1, 4), &dev);
        assert_eq!(
            mask_prefix_lens(&rows(vec![1., 1., 0., 0.])?)?,
            Some(vec![2])
        );
        assert_eq!(mask_prefix_lens(&rows(vec![1., 0., 1., 0.])?)?, None);
        assert_eq!(mask_prefix_lens(&rows(vec![0., 0., 0., 0.])?)?, None);
        Ok(())
    }
}
