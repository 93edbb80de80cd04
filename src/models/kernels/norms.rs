//! The fused norm kernels (`norms.cu`). GroupNorm: the group sums, the sums of squares about the
//! means, then the normalization with the affine and SiLU in one pass (three passes over the
//! activation where candle's composition makes ten or more, half of them in f32).

use candle_core::{DType, Result, Tensor};

use crate::models::kernel_module::{kernel_module, row_launch, Arg, Module, ROW_THREADS};
use crate::models::runs::{GroupNormSpec, Rounding};

static NORMS: Module = kernel_module!("norms");

/// Turns the fused VAE kernels off (`VIDGEN_FUSED_NORMS=off`: the norms here and the channel
/// moves of `channel_ops`): the candle compositions run, to compare the two in one process
/// (bench/).
pub const FUSED_NORMS_ENV: &str = "VIDGEN_FUSED_NORMS";

/// Whether the fused VAE kernels run (read once).
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var(FUSED_NORMS_ENV).map_or(true, |v| v != "off"))
}

/// Positions a block of the channel RMS kernel takes at once (`RMS_POSITIONS` in norms.cu), and
/// the most blocks it launches (each then strides over the rest).
const RMS_POSITIONS: usize = 32;
const MAX_RMS_BLOCKS: usize = 1 << 16;

/// Elements a block of the kernels takes at least (fewer blocks, fewer f64 atomics).
const ELEMENTS_PER_BLOCK: usize = ROW_THREADS * 32;

/// `spec` applied to `x` (bf16 or f32, on CUDA; any layout, copied contiguous), `rows_per_entry`
/// of its rows of `spatial` elements normalized together per group.
pub(crate) fn group_norm(
    x: &Tensor,
    spec: &GroupNormSpec,
    spatial: usize,
    rows_per_entry: usize,
) -> Result<Tensor> {
    let suffix = match x.dtype() {
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        other => candle_core::bail!("group norm kernel: {other:?} activations"),
    };
    let channels = spec.weight.elem_count();
    let rows = x.elem_count() / spatial.max(1);
    if channels == 0
        || spec.groups == 0
        || !channels.is_multiple_of(spec.groups)
        || !rows_per_entry.is_multiple_of(channels)
        || rows * spatial != x.elem_count()
        || !rows.is_multiple_of(rows_per_entry)
    {
        candle_core::bail!(
            "group norm kernel: {:?} as rows of {spatial}, {rows_per_entry} per entry, {channels} channels in {} groups",
            x.shape(),
            spec.groups
        )
    }
    let x = x.contiguous()?;
    let modulation = match spec.modulation {
        Some((scale, shift)) => {
            let same = |t: &Tensor| -> Result<Tensor> {
                if t.shape() != x.shape() || t.dtype() != x.dtype() {
                    candle_core::bail!(
                        "group norm kernel: a modulation {:?} {:?} for {:?} {:?}",
                        t.shape(),
                        t.dtype(),
                        x.shape(),
                        x.dtype()
                    )
                }
                t.contiguous()
            };
            Some((same(scale)?, same(shift)?))
        }
        None => None,
    };
    let entries = rows / rows_per_entry;
    let chunks = spatial.div_ceil(ELEMENTS_PER_BLOCK).clamp(1, 1 << 16);
    let count = (rows_per_entry / channels * (channels / spec.groups) * spatial) as f32;
    let ints = |v: usize| Arg::Int(v as i32);
    let shape_args = || {
        vec![
            Arg::Long(spatial as i64),
            ints(channels),
            Arg::Long(rows_per_entry as i64),
            ints(channels / spec.groups),
            ints(spec.groups),
            ints(chunks),
        ]
    };
    let sums = |mean: Option<&Tensor>| -> Result<Tensor> {
        let acc = Tensor::zeros(entries * spec.groups, DType::F64, x.device())?;
        let mut args = vec![Arg::Tensor(Some(&x)), Arg::Dst, Arg::Tensor(mean)];
        args.extend(shape_args());
        args.push(Arg::Float(count));
        let func = match suffix {
            "bf16" => "group_sums_bf16",
            _ => "group_sums_f32",
        };
        acc.inplace_op1(&row_launch(&NORMS, func, rows * chunks, args))?;
        Ok(acc)
    };
    let sum = sums(None)?;
    let squares = sums(Some(&sum))?;
    let weight = spec.weight.to_dtype(DType::F32)?.contiguous()?;
    let bias = spec.bias.to_dtype(DType::F32)?.contiguous()?;
    // SAFETY: the apply kernel writes every element before anything reads it.
    let out = unsafe { Tensor::empty(x.shape(), x.dtype(), x.device()) }?;
    let mut args = vec![
        Arg::Tensor(Some(&x)),
        Arg::Dst,
        Arg::Tensor(Some(&sum)),
        Arg::Tensor(Some(&squares)),
        Arg::Tensor(Some(&weight)),
        Arg::Tensor(Some(&bias)),
        Arg::Tensor(modulation.as_ref().map(|m| &m.0)),
        Arg::Tensor(modulation.as_ref().map(|m| &m.1)),
    ];
    args.extend(shape_args());
    args.extend([
        Arg::Float(count),
        Arg::Float(spec.eps as f32),
        Arg::Int(i32::from(spec.rounding == Rounding::EachOp)),
        Arg::Int(i32::from(spec.silu)),
    ]);
    let func = match suffix {
        "bf16" => "group_apply_bf16",
        _ => "group_apply_f32",
    };
    out.inplace_op1(&row_launch(&NORMS, func, rows * chunks, args))?;
    Ok(out)
}

/// The RMS norm over the channels of each position of `x` `[B, C, ...]` (bf16 or f32, on CUDA)
/// without weight, then `* scale1 + shift` (each `[B, C]` of f32 values, `scale1` = 1 + scale as
/// the caller rounded it) where given, then SiLU where `silu`, rounding as the candle composition.
pub(crate) fn channel_rms(
    x: &Tensor,
    modulation: Option<(&Tensor, &Tensor)>,
    eps: f64,
    silu: bool,
) -> Result<Tensor> {
    let positions = x.elem_count() / x.dim(1)?.max(1);
    let vector = if positions >= RMS_VECTOR_MIN_POSITIONS {
        RMS_VECTOR
    } else {
        1
    };
    channel_rms_with(x, modulation, eps, silu, vector)
}

/// Adjacent positions a lane of the channel RMS kernel takes at once where the frame's size and
/// the storage allow (one load of each): 1 or 4.
const RMS_VECTOR: usize = 4;

/// Positions from which four a lane pay: a quarter of the blocks still fill an H200 (session
/// 34: 0.82-0.84x the time of one a lane at 50k-96k positions, 1.6x at 7k and fewer, where the
/// grid was a few dozen blocks).
const RMS_VECTOR_MIN_POSITIONS: usize = 1 << 15;

/// [`channel_rms`] with lanes of up to `vector` positions.
fn channel_rms_with(
    x: &Tensor,
    modulation: Option<(&Tensor, &Tensor)>,
    eps: f64,
    silu: bool,
    vector: usize,
) -> Result<Tensor> {
    let dims = x.dims();
    let (b, c) = (dims[0], dims.get(1).copied().unwrap_or(0));
    let spatial: usize = dims[2..].iter().product();
    let modulation = match modulation {
        Some((scale1, shift)) => {
            let flat = |t: &Tensor| -> Result<Tensor> {
                let t = t.to_dtype(DType::F32)?.flatten_all()?.contiguous()?;
                if t.elem_count() != b * c {
                    candle_core::bail!("channel RMS kernel: modulation {:?} for {b}x{c}", t.shape())
                }
                Ok(t)
            };
            Some((flat(scale1)?, flat(shift)?))
        }
        None => None,
    };
    let x = x.contiguous()?;
    // SAFETY: the kernel writes every element before anything reads it.
    let out = unsafe { Tensor::empty(x.shape(), x.dtype(), x.device()) }?;
    let positions = b * spatial;
    // Four positions a lane where every lane's four lie in one frame and load aligned.
    let lanes = if vector == 4
        && spatial.is_multiple_of(4)
        && x.layout().start_offset().is_multiple_of(4)
        && out.layout().start_offset().is_multiple_of(4)
    {
        4
    } else {
        1
    };
    let func = match (x.dtype(), lanes) {
        (DType::BF16, 4) => "channel_rms4_bf16",
        (DType::BF16, _) => "channel_rms_bf16",
        (DType::F32, 4) => "channel_rms4_f32",
        (DType::F32, _) => "channel_rms_f32",
        (other, _) => candle_core::bail!("channel RMS kernel: {other:?} activations"),
    };
    out.inplace_op1(&row_launch(
        &NORMS,
        func,
        positions
            .div_ceil(RMS_POSITIONS * lanes)
            .min(MAX_RMS_BLOCKS),
        vec![
            Arg::Tensor(Some(&x)),
            Arg::Dst,
            Arg::Tensor(modulation.as_ref().map(|m| &m.0)),
            Arg::Tensor(modulation.as_ref().map(|m| &m.1)),
            Arg::Int(c as i32),
            Arg::Long(spatial as i64),
            Arg::Long(positions as i64),
            Arg::Float(eps as f32),
            Arg::Int(i32::from(silu)),
        ],
    ))?;
    Ok(out)
}

#[cfg(test)]
mod cuda_tests {
    use super::*;
    use crate::models::row_ops::test_util::device;

    /// Four positions a lane give each position's norm bit for bit as one a lane (the sums run in
    /// the same order), with and without the modulation and SiLU, and the norm is the f64 one
    /// within rounding.
    #[test]
    fn channel_rms_lanes_of_four_match_lanes_of_one() -> Result<()> {
        let Some(dev) = device("channel RMS") else {
            return Ok(());
        };
        for dtype in [DType::BF16, DType::F32] {
            // Several blocks' worth of positions, a partial last block, two batch entries.
            for dims in [[2, 24, 3, 8, 12], [1, 520, 2, 4, 6]] {
                let x = Tensor::randn(0f32, 2.0, &dims[..], &dev)?.to_dtype(dtype)?;
                let (b, c) = (dims[0], dims[1]);
                let scale1 = Tensor::randn(1f32, 0.5, (b, c), &dev)?;
                let shift = Tensor::randn(0f32, 0.5, (b, c), &dev)?;
                for (modulation, silu) in [(None, false), (Some((&scale1, &shift)), true)] {
                    let one = channel_rms_with(&x, modulation, 1e-6, silu, 1)?;
                    let four = channel_rms_with(&x, modulation, 1e-6, silu, 4)?;
                    let gap = (one.to_dtype(DType::F32)? - four.to_dtype(DType::F32)?)?
                        .abs()?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    assert_eq!(gap, 0.0, "{dtype:?} {dims:?} silu {silu}");
                }
                let xf = x.to_dtype(DType::F64)?;
                let want = xf.broadcast_div(&(xf.sqr()?.mean_keepdim(1)? + 1e-6)?.sqrt()?)?;
                let got = channel_rms_with(&x, None, 1e-6, false, 4)?.to_dtype(DType::F64)?;
                let err = (got - &want)?.abs()?.max_all()?.to_scalar::<f64>()?;
                let peak = want.abs()?.max_all()?.to_scalar::<f64>()?;
                assert!(err <= peak / 128.0, "{dtype:?} {dims:?}: {err} of {peak}");
            }
        }
        Ok(())
    }
}
