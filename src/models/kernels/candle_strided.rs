//! CUDA tests of the vendored candle kernels' strided paths (vendor/README.md): broadcast binary
//! operations and copies of permuted views, read 16 bytes at a time where rows allow and with
//! 32-bit index arithmetic elsewhere, must give exactly what the CPU gives (a sum, difference or
//! product of two bf16/f16 values is exact in f32, so both devices round it once).

use candle_core::{DType, Device, Result, Tensor};

use crate::models::row_ops::test_util::device;

/// `x` on the CPU and on `dev`, of `dtype`.
fn both(shape: &[usize], dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
    let cpu = Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)?;
    let gpu = cpu.to_device(dev)?;
    Ok((cpu, gpu))
}

fn assert_same(got: &Tensor, want: &Tensor, what: &str) -> Result<()> {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let got = got
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?;
    let want = want.to_dtype(DType::F32)?.flatten_all()?;
    let (got, want) = (got.to_vec1::<f32>()?, want.to_vec1::<f32>()?);
    let diff = got
        .iter()
        .zip(&want)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    assert!(diff.is_none(), "{what}: first difference at {diff:?}");
    Ok(())
}

/// Every binary op over every layout class: contiguous, a broadcast row (last stride 1), a
/// broadcast column (last stride 0), a permuted view, an unaligned narrow and a last dim that
/// is no whole number of vectors.
#[test]
fn broadcast_binary_ops_match_the_cpu() -> Result<()> {
    let Some(dev) = device("strided binary ops") else {
        return Ok(());
    };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for last in [96, 36] {
            let (x, xg) = both(&[2, 6, 40, last], dtype, &dev)?;
            let (row, rowg) = both(&[last], dtype, &dev)?;
            let (per_batch, per_batchg) = both(&[2, 1, 1, last], dtype, &dev)?;
            let (col, colg) = both(&[2, 6, 40, 1], dtype, &dev)?;
            let (t, tg) = both(&[2, 40, 6, last], dtype, &dev)?;
            let (wide, wideg) = both(&[2, 6, 40, last + 1], dtype, &dev)?;
            type Op = fn(&Tensor, &Tensor) -> Result<Tensor>;
            let ops: [(&str, Op); 3] = [
                ("add", |a, b| a.broadcast_add(b)),
                ("mul", |a, b| a.broadcast_mul(b)),
                ("sub", |a, b| a.broadcast_sub(b)),
            ];
            for (name, op) in ops {
                let cases = [
                    ("row", op(&x, &row)?, op(&xg, &rowg)?),
                    ("row first", op(&row, &x)?, op(&rowg, &xg)?),
                    ("batch row", op(&x, &per_batch)?, op(&xg, &per_batchg)?),
                    ("column", op(&x, &col)?, op(&xg, &colg)?),
                    (
                        "permuted",
                        op(&x, &t.transpose(1, 2)?)?,
                        op(&xg, &tg.transpose(1, 2)?)?,
                    ),
                    (
                        "permuted with a row",
                        op(&t.transpose(1, 2)?, &row)?,
                        op(&tg.transpose(1, 2)?, &rowg)?,
                    ),
                    (
                        "unaligned narrow",
                        op(&wide.narrow(3, 1, last)?, &row)?,
                        op(&wideg.narrow(3, 1, last)?, &rowg)?,
                    ),
                ];
                for (case, want, got) in cases {
                    assert_same(
                        &got,
                        &want,
                        &format!("{dtype:?} {name} {case}, last dim {last}"),
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// Copies of permuted, narrowed and broadcast views, as `.contiguous()` makes them.
#[test]
fn strided_copies_match_the_cpu() -> Result<()> {
    let Some(dev) = device("strided copies") else {
        return Ok(());
    };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for last in [72, 36] {
            let (x, xg) = both(&[2, 16, 64, last], dtype, &dev)?;
            let (row, rowg) = both(&[last], dtype, &dev)?;
            type View = fn(&Tensor) -> Result<Tensor>;
            let views: [(&str, View); 5] = [
                ("transpose(1, 2)", |t| t.transpose(1, 2)),
                ("permute(2, 0, 1, 3)", |t| t.permute((2, 0, 1, 3))),
                ("narrow(2, 8, 32)", |t| t.narrow(2, 8, 32)),
                ("narrow(3, 1, ..)", |t| t.narrow(3, 1, 8)),
                ("transpose(2, 3)", |t| t.transpose(2, 3)),
            ];
            for (name, view) in views {
                let want = view(&x)?.contiguous()?;
                let got = view(&xg)?.contiguous()?;
                assert_same(&got, &want, &format!("{dtype:?} {name}, last dim {last}"))?;
            }
            let want = row.broadcast_as((3, 5, last))?.contiguous()?;
            let got = rowg.broadcast_as((3, 5, last))?.contiguous()?;
            assert_same(
                &got,
                &want,
                &format!("{dtype:?} broadcast row, last dim {last}"),
            )?;
        }
    }
    Ok(())
}

/// `cat` along every dim (2-D copies: whole 16-byte vectors as such where pointers, rows and
/// strides allow, elementwise elsewhere), into offsets that break the vectors' alignment too.
#[test]
fn concatenations_match_the_cpu() -> Result<()> {
    let Some(dev) = device("2-D copies") else {
        return Ok(());
    };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (first, last) in [(24, 64), (5, 36), (3, 8)] {
            let dims = [2, first, 4, last];
            let (a, ag) = both(&dims, dtype, &dev)?;
            for dim in 0..4 {
                // b as a but 3 long on `dim`.
                let mut b_dims = dims;
                b_dims[dim] = 3;
                let (b, bg) = both(&b_dims, dtype, &dev)?;
                let want = Tensor::cat(&[&a, &b, &a], dim)?;
                let got = Tensor::cat(&[&ag, &bg, &ag], dim)?;
                assert_same(
                    &got,
                    &want,
                    &format!("{dtype:?} cat on dim {dim}, {dims:?}"),
                )?;
            }
        }
    }
    Ok(())
}
