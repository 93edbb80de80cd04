//! Weights held compactly until they land on the device: the fp8 bytes of `--storage-dtype`, a
//! scaled fp8 file's bytes and scales, or GGUF blocks. The offload engine holds and copies a
//! packed tensor's bytes as stored and expands them to the compute dtype where they land
//! ([`Packed::expand`]): a CUDA kernel (`kernels/dequant.cu`) on the GPU, the host decoders
//! elsewhere, with the same bits.

use super::gguf::{self, GgmlType};
use super::StorageDtype;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

/// How a packed tensor's bytes hold its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packed {
    /// One fp8 byte per value.
    Fp8(StorageDtype),
    /// GGUF blocks, decoded as diffusers decodes them.
    Gguf(GgmlType),
    /// A scaled fp8 file's float8_e4m3fn weight: `scales` f32 scales (one for the tensor, or one
    /// per output row) then one byte per value; a value is `W8 as f32 · scale`, one f32 product
    /// (what the files' readers compute).
    ScaledFp8 { scales: usize },
}

/// The dtypes a packed tensor expands to (`OUT_*` in the kernel, in this order).
const EXPANDED: [DType; 3] = [DType::F16, DType::BF16, DType::F32];

impl Packed {
    /// Whether packed weights expand to `dtype`.
    pub fn expands_to(dtype: DType) -> bool {
        EXPANDED.contains(&dtype)
    }

    /// This form's number in the kernel (`FP8_*`, `Q*` in `dequant.cu`).
    #[cfg(feature = "cuda")]
    fn kernel_form(self) -> candle_core::Result<i32> {
        Ok(match self {
            Packed::Fp8(StorageDtype::Float8E4m3fn) => 0,
            Packed::Fp8(StorageDtype::Float8E5m2) => 1,
            Packed::Gguf(GgmlType::Q8_0) => 2,
            Packed::Gguf(GgmlType::Q4_0) => 3,
            Packed::Gguf(GgmlType::Q4_1) => 4,
            Packed::Gguf(GgmlType::Q5_0) => 5,
            Packed::Gguf(GgmlType::Q5_1) => 6,
            Packed::Gguf(GgmlType::Q2_K) => 7,
            Packed::Gguf(GgmlType::Q3_K) => 8,
            Packed::Gguf(GgmlType::Q4_K) => 9,
            Packed::Gguf(GgmlType::Q5_K) => 10,
            Packed::Gguf(GgmlType::Q6_K) => 11,
            Packed::Gguf(float) => candle_core::bail!("GGUF {float:?} tensors are not packed"),
            Packed::ScaledFp8 { .. } => 12,
        })
    }

    /// The f32 scales held before the values.
    #[cfg(feature = "cuda")]
    fn scales(self) -> usize {
        match self {
            Packed::ScaledFp8 { scales } => scales,
            _ => 0,
        }
    }

    /// Bytes of `elems` values.
    pub fn bytes(self, elems: usize) -> usize {
        match self {
            Packed::Fp8(_) => elems,
            Packed::Gguf(kind) => {
                let (per_block, block_bytes) = kind.block();
                elems / per_block * block_bytes
            }
            Packed::ScaledFp8 { scales } => 4 * scales + elems,
        }
    }

    /// Values held in `bytes` bytes (a scaled fp8 tensor's: a whole number per scale).
    fn elements(self, bytes: usize) -> candle_core::Result<usize> {
        Ok(match self {
            Packed::Fp8(_) => bytes,
            Packed::Gguf(kind) => {
                let (per_block, block_bytes) = kind.block();
                bytes / block_bytes * per_block
            }
            Packed::ScaledFp8 { scales } => match bytes.checked_sub(4 * scales) {
                Some(n) if scales > 0 && n.is_multiple_of(scales) => n,
                _ => candle_core::bail!("{bytes} bytes are not {scales} scales and their rows"),
            },
        })
    }

    /// `raw` (this form's bytes as a flat u8 tensor) expanded to `shape` in `dtype`, on
    /// `raw`'s device.
    pub fn expand(self, raw: &Tensor, shape: &Shape, dtype: DType) -> candle_core::Result<Tensor> {
        raw.apply_op1_no_bwd(&Expand {
            packed: self,
            dtype,
        })?
        .reshape(shape)
    }

    /// The values of `bytes` as the host decodes them (exact in f32; a scaled fp8 value is its
    /// f32 product).
    fn decode(self, bytes: &[u8]) -> candle_core::Result<Vec<f32>> {
        Ok(match self {
            Packed::Fp8(format) => bytes.par_iter().map(|&b| format.decode(b)).collect(),
            Packed::Gguf(kind) => gguf::decode(kind, bytes)
                .into_par_iter()
                .map(|v| v.to_f32())
                .collect(),
            Packed::ScaledFp8 { scales } => {
                self.elements(bytes.len())?;
                let (scales, values) = bytes.split_at(4 * scales);
                let scales: Vec<f32> = scales
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                // Every byte's value as candle's float8_e4m3fn load widens it (the files' read).
                let every_byte: Vec<u8> = (0..=255).collect();
                let widened: Vec<f32> =
                    Tensor::from_raw_buffer(&every_byte, DType::F8E4M3, &[256], &Device::Cpu)?
                        .to_dtype(DType::F32)?
                        .to_vec1()?;
                let per_scale = values.len() / scales.len();
                values
                    .par_iter()
                    .enumerate()
                    .map(|(i, &b)| widened[usize::from(b)] * scales[i / per_scale])
                    .collect()
            }
        })
    }
}

/// [`Packed::expand`] as a candle op: flat u8 in, flat `dtype` out.
struct Expand {
    packed: Packed,
    dtype: DType,
}

impl CustomOp1 for Expand {
    fn name(&self) -> &'static str {
        "expand-packed"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::U8(bytes), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("packed weights are contiguous bytes")
        };
        let values = self.packed.decode(&bytes[start..end])?;
        let n = values.len();
        // As candle's casts from f32 convert (f16 values convert exactly to f32 and back).
        let out = match self.dtype {
            DType::F32 => CpuStorage::F32(values),
            DType::F16 => {
                CpuStorage::F16(values.into_par_iter().map(half::f16::from_f32).collect())
            }
            DType::BF16 => {
                CpuStorage::BF16(values.into_par_iter().map(half::bf16::from_f32).collect())
            }
            other => candle_core::bail!("packed weights do not expand to {other:?}"),
        };
        Ok((out, Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::models::kernel_module::{kernel_module, Module};
        use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::WrapErr;
        use candle_core::CudaStorage;
        static DEQUANT: Module = kernel_module!("dequant");

        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("packed weights are contiguous bytes")
        };
        let dev = &storage.device;
        let src = storage.as_cuda_slice::<u8>()?.slice(start..end);
        let n = self.packed.elements(end - start)?;
        let format = self.packed.kernel_form()?;
        let Some(out) = EXPANDED.iter().position(|d| *d == self.dtype) else {
            candle_core::bail!("packed weights do not expand to {:?}", self.dtype)
        };
        let func = DEQUANT.function(dev, "expand")?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 132 * 16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        macro_rules! launch {
            ($t:ty) => {{
                // SAFETY: the kernel writes all `n` values.
                let dst = unsafe { dev.alloc::<$t>(n) }?;
                let mut builder = func.builder();
                let (n, out, scales) = (n as i64, out as i32, self.packed.scales() as i64);
                builder
                    .arg(&src)
                    .arg(&dst)
                    .arg(&n)
                    .arg(&format)
                    .arg(&out)
                    .arg(&scales);
                // SAFETY: the arguments follow `expand`'s signature; `src` holds the bytes of
                // `n` values of `format` (after their `scales`, a whole number of values
                // each) and `dst` `n` values of the output dtype.
                unsafe { builder.launch(cfg) }.w()?;
                CudaStorage::wrap_cuda_slice(dst, dev.clone())
            }};
        }
        let out_storage = match self.dtype {
            DType::F16 => launch!(half::f16),
            DType::BF16 => launch!(half::bf16),
            _ => launch!(f32),
        };
        Ok((out_storage, Shape::from(n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every GGUF block quantization.
    pub(super) const BLOCK_TYPES: [GgmlType; 10] = [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// Expanding on the host gives the bits of the host decoders followed by candle's casts:
    /// fp8 bytes (every byte) as `--storage-dtype`'s f32 values cast, scaled fp8 (every byte,
    /// one scale and one per row) as a scaled file's weight is read (and refused without a
    /// whole number of values a scale), GGUF blocks of every type as the f16 values diffusers
    /// decodes cast; packed weights expand to float dtypes only.
    #[test]
    fn host_expansion_is_the_host_decode_cast() -> candle_core::Result<()> {
        let cpu = Device::Cpu;
        let every_byte: Vec<u8> = (0..=255).collect();
        for format in [StorageDtype::Float8E4m3fn, StorageDtype::Float8E5m2] {
            let values: Vec<f32> = every_byte.iter().map(|&b| format.decode(b)).collect();
            let want = Tensor::from_vec(values, (16, 16), &cpu)?;
            let raw = Tensor::new(every_byte.as_slice(), &cpu)?;
            for dtype in EXPANDED {
                let got = Packed::Fp8(format).expand(&raw, &Shape::from((16, 16)), dtype)?;
                assert_eq!(got.dims(), [16, 16]);
                assert!(
                    same_bits(&got, &want.to_dtype(dtype)?)?,
                    "{format:?} {dtype:?}"
                );
            }
        }
        for scales in [vec![0.0123f32], row_scales(16)] {
            let form = Packed::ScaledFp8 {
                scales: scales.len(),
            };
            // What a scaled fp8 file's weight is read as: candle's float8_e4m3fn load widened
            // to f32, times the scale in f32.
            let w = Tensor::from_raw_buffer(&every_byte, DType::F8E4M3, &[16, 16], &cpu)?
                .to_dtype(DType::F32)?;
            let scale = match scales.as_slice() {
                [one] => Tensor::new(*one, &cpu)?.broadcast_as((16, 16))?,
                rows => Tensor::new(rows, &cpu)?
                    .reshape((16, 1))?
                    .broadcast_as((16, 16))?,
            };
            let want = (w * scale)?;
            let raw = Tensor::new(scaled_fp8_bytes(&scales, &every_byte).as_slice(), &cpu)?;
            assert_eq!(form.bytes(256), raw.elem_count());
            for dtype in EXPANDED {
                let got = form.expand(&raw, &Shape::from((16, 16)), dtype)?;
                assert!(
                    same_bits(&got, &want.to_dtype(dtype)?)?,
                    "{form:?} {dtype:?}"
                );
            }
        }
        // Scales without a whole number of values each are refused.
        for (scales, bytes) in [(2, 13), (4, 12), (0, 8)] {
            let raw = Tensor::new(&every_byte[..bytes], &cpu)?;
            let form = Packed::ScaledFp8 { scales };
            assert!(form.expand(&raw, &Shape::from(bytes), DType::F32).is_err());
        }
        for kind in BLOCK_TYPES {
            let per_block = kind.block().0;
            let bytes = gguf::random_blocks(kind, 6, 3);
            let want = Tensor::from_vec(gguf::decode(kind, &bytes), (6, per_block), &cpu)?;
            let raw = Tensor::new(bytes.as_slice(), &cpu)?;
            assert_eq!(Packed::Gguf(kind).bytes(6 * per_block), bytes.len());
            for dtype in EXPANDED {
                let got = Packed::Gguf(kind).expand(&raw, &Shape::from((6, per_block)), dtype)?;
                assert!(
                    same_bits(&got, &want.to_dtype(dtype)?)?,
                    "{kind:?} {dtype:?}"
                );
            }
        }
        assert!(Packed::expands_to(DType::BF16) && !Packed::expands_to(DType::F64));
        Ok(())
    }

    /// `rows` scales of every kind a row can have: negative, tiny (subnormal products), huge
    /// (products past f16 and bf16), and plain.
    pub(super) fn row_scales(rows: usize) -> Vec<f32> {
        [-0.37, 1e-38, 3e36, 0.0071, 1.0]
            .into_iter()
            .cycle()
            .take(rows)
            .collect()
    }

    /// A scaled fp8 tensor as held: its `scales` in f32, then its `values` bytes.
    pub(super) fn scaled_fp8_bytes(scales: &[f32], values: &[u8]) -> Vec<u8> {
        let mut bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        bytes.extend_from_slice(values);
        bytes
    }

    /// Whether `a` and `b` hold the same dtype, shape and bits.
    pub(super) fn same_bits(a: &Tensor, b: &Tensor) -> candle_core::Result<bool> {
        let bits = |t: &Tensor| -> candle_core::Result<Vec<u8>> {
            let mut out = vec![0u8; t.elem_count() * t.dtype().size_in_bytes()];
            crate::weights::write_bytes(&t.to_device(&Device::Cpu)?, &mut out)?;
            Ok(out)
        };
        Ok(a.shape() == b.shape() && a.dtype() == b.dtype() && bits(a)? == bits(b)?)
    }
}

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    use super::tests::{row_scales, same_bits, scaled_fp8_bytes, BLOCK_TYPES};
    use super::*;

    /// On the GPU, every packed form expands to the bits the host expansion gives: fp8 bytes
    /// (every byte, NaNs and infinities included), scaled fp8 (every byte, one scale and one
    /// per row) and random blocks of every GGUF block type,
    /// in f16, bf16 and f32, from an offset into the raw bytes.
    #[test]
    fn device_expansion_matches_the_host_bit_for_bit() -> candle_core::Result<()> {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: device expansion test skipped");
            return Ok(());
        };
        let cpu = Device::Cpu;
        let mut cases: Vec<(Packed, Vec<u8>, usize)> = Vec::new();
        for format in [StorageDtype::Float8E4m3fn, StorageDtype::Float8E5m2] {
            let bytes: Vec<u8> = (0..=255u8).cycle().take(256 * 37 + 1).collect();
            cases.push((Packed::Fp8(format), bytes, 256 * 37 + 1));
        }
        let values: Vec<u8> = (0..=255u8).cycle().take(256 * 37).collect();
        for scales in [vec![0.0123f32], row_scales(37)] {
            let form = Packed::ScaledFp8 {
                scales: scales.len(),
            };
            cases.push((form, scaled_fp8_bytes(&scales, &values), values.len()));
        }
        for kind in BLOCK_TYPES {
            let bytes = gguf::random_blocks(kind, 4099, 5);
            cases.push((Packed::Gguf(kind), bytes, 4099 * kind.block().0));
        }
        for (packed, bytes, elems) in cases {
            // A leading byte, so the raw tensor is a view that starts past its allocation.
            let mut padded = vec![0u8];
            padded.extend_from_slice(&bytes);
            let padded = Tensor::new(padded.as_slice(), &cpu)?;
            let raw = padded.narrow(0, 1, bytes.len())?;
            let on_gpu = padded.to_device(&gpu)?.narrow(0, 1, bytes.len())?;
            for dtype in EXPANDED {
                let want = packed.expand(&raw, &Shape::from(elems), dtype)?;
                let got = packed.expand(&on_gpu, &Shape::from(elems), dtype)?;
                assert!(got.device().is_cuda());
                assert!(same_bits(&got, &want)?, "{packed:?} {dtype:?}");
            }
        }
        Ok(())
    }
}
