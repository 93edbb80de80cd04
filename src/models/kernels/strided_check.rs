//! Every strided kernel family vidgen's candle-kernels patch touches (binary, unary, cast,
//! affine) gives, on broadcast, transposed, narrowed, size-1 and many-dim layouts, exactly what
//! the untouched contiguous path gives for the same values (made contiguous on the CPU).

use candle_core::{DType, Device, Result, Tensor};

/// A strided view of a seeded tensor: `view` turns a contiguous base into the layout under test.
type View = fn(&Tensor) -> Result<Tensor>;

fn base(shape: &[usize], seed: u64, device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 - 500.0) / 37.0)
        .collect();
    Tensor::from_vec(v, shape, device)
}

/// The view on the GPU (the patched strided path) and the same values made contiguous on the
/// CPU, then moved to the GPU (the contiguous path).
fn pair(
    shape: &[usize],
    seed: u64,
    view: View,
    dtype: DType,
    gpu: &Device,
) -> Result<(Tensor, Tensor)> {
    let cpu = base(shape, seed, &Device::Cpu)?.to_dtype(dtype)?;
    let strided = view(&cpu.to_device(gpu)?)?;
    let contiguous = view(&cpu)?.contiguous()?.to_device(gpu)?;
    assert!(
        !strided.is_contiguous(),
        "{shape:?}: the view must be strided"
    );
    Ok((strided, contiguous))
}

fn same(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    let (a, b) = (
        a.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
        b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
    );
    assert_eq!(a.len(), b.len(), "{what}");
    let bad = a
        .iter()
        .zip(&b)
        .position(|(x, y)| x.to_bits() != y.to_bits());
    assert!(bad.is_none(), "{what}: element {bad:?} differs");
    Ok(())
}

fn transposed(t: &Tensor) -> Result<Tensor> {
    t.transpose(1, 2)
}
fn narrowed(t: &Tensor) -> Result<Tensor> {
    t.narrow(2, 3, t.dim(2)? - 5)
}
fn permuted(t: &Tensor) -> Result<Tensor> {
    t.permute((0, 3, 1, 4, 2))
}
/// Seven dims that cannot collapse: more than the fast layout holds (the fallback path).
fn scrambled(t: &Tensor) -> Result<Tensor> {
    t.permute(vec![6, 0, 5, 1, 4, 2, 3])
}

#[test]
fn strided_kernels_match_contiguous() -> Result<()> {
    let Ok(gpu) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return Ok(());
    };
    let views: [(&str, &[usize], View); 4] = [
        ("transposed", &[2, 37, 130], transposed),
        ("narrowed", &[3, 5, 1000, 7], narrowed),
        ("permuted 5d", &[2, 3, 4, 5, 6], permuted),
        ("7 dims", &[2, 3, 2, 3, 2, 3, 2], scrambled),
    ];
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (name, shape, view) in views {
            let (s, c) = pair(shape, 1, view, dtype, &gpu)?;
            let what = |op: &str| format!("{op} {name} {dtype:?}");
            same(&s.contiguous()?, &c, &what("copy"))?;
            same(
                &s.to_dtype(DType::F32)?,
                &c.to_dtype(DType::F32)?,
                &what("cast"),
            )?;
            same(
                &s.affine(0.5, -1.25)?,
                &c.affine(0.5, -1.25)?,
                &what("affine"),
            )?;
            same(&s.exp()?, &c.exp()?, &what("exp"))?;
            same(&s.gelu()?, &c.gelu()?, &what("gelu"))?;
            let (s2, c2) = pair(shape, 2, view, dtype, &gpu)?;
            same(&(&s + &s2)?, &(&c + &c2)?, &what("add both strided"))?;
            same(&(&s * &c2)?, &(&c * &c2)?, &what("mul lhs strided"))?;
            same(&(&c - &s2)?, &(&c - &c2)?, &what("sub rhs strided"))?;
        }
        // Broadcasts as models make them: a bias row, a per-batch modulation, a per-channel scale.
        let x = base(&[2, 3000, 700], 3, &Device::Cpu)?.to_dtype(dtype)?;
        for (name, shape) in [
            ("bias", &[700][..]),
            ("per batch", &[2, 1, 700]),
            ("per token", &[2, 3000, 1]),
            ("scalar", &[1, 1, 1]),
        ] {
            let y = base(shape, 4, &Device::Cpu)?.to_dtype(dtype)?;
            let full = y.broadcast_as(x.shape())?.contiguous()?.to_device(&gpu)?;
            let (xg, yg) = (x.to_device(&gpu)?, y.to_device(&gpu)?);
            let what = |op: &str| format!("{op} {name} {dtype:?}");
            same(&xg.broadcast_add(&yg)?, &(&xg + &full)?, &what("add"))?;
            same(&xg.broadcast_mul(&yg)?, &(&xg * &full)?, &what("mul"))?;
            same(
                &yg.broadcast_sub(&xg)?,
                &(&full - &xg)?,
                &what("sub lhs broadcast"),
            )?;
            same(&xg.broadcast_div(&yg)?, &(&xg / &full)?, &what("div"))?;
            same(
                &xg.broadcast_maximum(&yg)?,
                &xg.maximum(&full)?,
                &what("max"),
            )?;
        }
    }
    Ok(())
}
