//! GGUF files, the format llama.cpp defined and city96's Wan GGUFs ship transformers in: the
//! header is parsed here (any number of dimensions: those files hold a 5-D patch embedding that
//! ggml itself cannot), the tensors stay memory mapped. Quantized blocks decode the way
//! diffusers decodes them (`GGUFLinear.forward_native`): the block scales stay float16 and every
//! product and sum is rounded to float16, so the weights, and the frames, equal diffusers'. The
//! exact float32 decode of llama.cpp differs by up to a few float16 ulps per weight and moves
//! frames by up to 3.4e-3.

use anyhow::{ensure, Context, Result};
use candle_core::DType;
use half::f16;
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

/// The first bytes of every GGUF file.
const MAGIC: &[u8; 4] = b"GGUF";

/// Tensor data starts at a multiple of this unless `general.alignment` says otherwise.
const DEFAULT_ALIGNMENT: u64 = 32;

/// Elements per K-quant super-block.
const QK_K: usize = 256;

/// Whether `path` starts with GGUF's magic (what a `.gguf` file is, whatever its name).
pub fn is_gguf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok_and(|()| &magic == MAGIC)
}

/// How a GGUF tensor is stored: a float type, or a block quantization that diffusers decodes.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl GgmlType {
    /// The type of ggml's id `id`, or the name of a type vidgen does not decode.
    fn of_id(id: u32) -> Result<Self, String> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            other => {
                let names = [
                    (9, "Q8_1"),
                    (15, "Q8_K"),
                    (16, "IQ2_XXS"),
                    (17, "IQ2_XS"),
                    (18, "IQ3_XXS"),
                    (19, "IQ1_S"),
                    (20, "IQ4_NL"),
                    (21, "IQ3_S"),
                    (22, "IQ2_S"),
                    (23, "IQ4_XS"),
                    (24, "I8"),
                    (25, "I16"),
                    (26, "I32"),
                    (27, "I64"),
                    (28, "F64"),
                    (29, "IQ1_M"),
                    (34, "TQ1_0"),
                    (35, "TQ2_0"),
                ];
                return Err(names
                    .iter()
                    .find(|(i, _)| *i == other)
                    .map_or(format!("unknown type {other}"), |(_, n)| n.to_string()));
            }
        })
    }

    /// Elements per block and bytes per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q2_K => (QK_K, 84),
            GgmlType::Q3_K => (QK_K, 110),
            GgmlType::Q4_K => (QK_K, 144),
            GgmlType::Q5_K => (QK_K, 176),
            GgmlType::Q6_K => (QK_K, 210),
        }
    }

    /// The candle dtype of a float type (`None` for a block quantization).
    pub fn float(self) -> Option<DType> {
        match self {
            GgmlType::F32 => Some(DType::F32),
            GgmlType::F16 => Some(DType::F16),
            GgmlType::BF16 => Some(DType::BF16),
            _ => None,
        }
    }
}

/// One tensor of a GGUF file.
#[derive(Clone, Debug)]
pub struct GgufTensor {
    pub kind: GgmlType,
    /// Dimensions slowest first (numpy's and candle's order; the file lists them fastest first).
    pub shape: Vec<usize>,
    /// Where its bytes are in the file.
    range: std::ops::Range<usize>,
}

/// An opened GGUF file: its metadata that vidgen reads, its tensors, the file mapped.
pub struct Gguf {
    map: memmap2::Mmap,
    /// `general.architecture` ("wan" for city96's Wan files).
    pub architecture: Option<String>,
    tensors: BTreeMap<String, GgufTensor>,
}

/// Reads GGUF's little-endian fields, checking every length against the file.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: u64) -> Result<&[u8]> {
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| self.at.checked_add(n))
            .filter(|&end| end <= self.bytes.len())
            .context("the header runs past the end of the file (truncated?)")?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into()?))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }

    /// A metadata value of type `kind`: an integer or a string where vidgen reads it, else
    /// skipped (`None`).
    fn value(&mut self, kind: u32) -> Result<Option<Value>> {
        const SIZES: [(u32, u64); 10] = [
            (0, 1),
            (1, 1),
            (2, 2),
            (3, 2),
            (4, 4),
            (5, 4),
            (6, 4),
            (7, 1),
            (10, 8),
            (11, 8),
        ];
        Ok(match kind {
            4 => Some(Value::Int(u64::from(self.u32()?))),
            10 => Some(Value::Int(self.u64()?)),
            8 => Some(Value::Text(self.string()?)),
            9 => {
                let (inner, n) = (self.u32()?, self.u64()?);
                for _ in 0..n {
                    self.value(inner)?;
                }
                None
            }
            12 => {
                self.take(8)?;
                None
            }
            _ => {
                let size = SIZES
                    .iter()
                    .find(|(k, _)| *k == kind)
                    .with_context(|| format!("a metadata value of unknown type {kind}"))?;
                self.take(size.1)?;
                None
            }
        })
    }
}

enum Value {
    Int(u64),
    Text(String),
}

impl Gguf {
    /// Maps `path` and reads its header: every tensor's type, shape and place, checked to lie
    /// inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path)?;
        // SAFETY: mapped read-only; vidgen never writes to model files.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        let mut r = Reader { bytes: &map, at: 0 };
        ensure!(r.take(4)? == MAGIC, "not a GGUF file (no GGUF magic)");
        let version = r.u32()?;
        ensure!(
            matches!(version, 2 | 3),
            "GGUF version {version}, which vidgen does not read (it reads versions 2 and 3)"
        );
        let (tensor_count, kv_count) = (r.u64()?, r.u64()?);
        let (mut architecture, mut alignment) = (None, DEFAULT_ALIGNMENT);
        for _ in 0..kv_count {
            let key = r.string()?;
            let kind = r.u32()?;
            match (key.as_str(), r.value(kind)?) {
                ("general.architecture", Some(Value::Text(a))) => architecture = Some(a),
                ("general.alignment", Some(Value::Int(a))) if a > 0 => alignment = a,
                _ => {}
            }
        }
        let mut infos = Vec::new();
        for _ in 0..tensor_count {
            let name = r.string()?;
            let n_dims = r.u32()?;
            ensure!(n_dims <= 8, "{name}: {n_dims} dimensions");
            let mut shape = (0..n_dims)
                .map(|_| r.u64().map(|d| d as usize))
                .collect::<Result<Vec<_>>>()?;
            shape.reverse();
            let kind = GgmlType::of_id(r.u32()?)
                .map_err(|t| anyhow::anyhow!("{name} is stored as {t}, which vidgen does not decode (it decodes F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K to Q6_K)"))?;
            let offset = r.u64()?;
            infos.push((name, shape, kind, offset));
        }
        let data_start = (r.at as u64).div_ceil(alignment) * alignment;
        let mut tensors = BTreeMap::new();
        for (name, shape, kind, offset) in infos {
            let (per_block, block_bytes) = kind.block();
            let elements = shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .with_context(|| format!("{name}: shape {shape:?} overflows"))?;
            ensure!(
                elements % per_block == 0 && shape.last().is_some_and(|&d| d % per_block == 0),
                "{name}: rows of {:?} are not whole {kind:?} blocks of {per_block}",
                shape.last()
            );
            let len = elements / per_block * block_bytes;
            let start = usize::try_from(data_start + offset)?;
            let range = start..start + len;
            ensure!(
                range.end <= map.len(),
                "{name}: its {len} bytes at {start} run past the end of the file (truncated?)"
            );
            tensors.insert(name, GgufTensor { kind, shape, range });
        }
        Ok(Gguf {
            map,
            architecture,
            tensors,
        })
    }

    /// Every tensor's name, in name order.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.get(name)
    }

    /// Tensor `t`'s stored bytes.
    pub fn data(&self, t: &GgufTensor) -> &[u8] {
        &self.map[t.range.clone()]
    }

    /// The weights of block-quantized tensor `t` as diffusers decodes them (float16 values);
    /// `None` for a float type, whose bytes are its values.
    pub fn dequantize(&self, t: &GgufTensor) -> Option<Vec<f16>> {
        if t.kind.float().is_some() {
            return None;
        }
        Some(decode(t.kind, self.data(t)))
    }
}

/// Blocks of `kind` decoded as diffusers decodes them (threads in parallel).
pub fn decode(kind: GgmlType, data: &[u8]) -> Vec<f16> {
    let (per_block, block_bytes) = kind.block();
    let mut out = vec![f16::ZERO; data.len() / block_bytes * per_block];
    out.par_chunks_mut(per_block)
        .zip(data.par_chunks(block_bytes))
        .for_each(|(out, block)| decode_block(kind, block, out));
    out
}

/// `x` rounded to float16: every step of diffusers' decode (a float16 tensor times an integer
/// tensor, plus a float16 tensor) computes exactly in float32 and rounds to nearest even.
fn h(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

fn half_at(block: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

/// The 6-bit scale and minimum of group `j` of a Q4_K/Q5_K super-block's 12 scale bytes.
fn scale_min(s: &[u8], j: usize) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    };
    (f32::from(sc), f32::from(m))
}

/// Decodes one block of `kind` into `out` (its elements in order).
fn decode_block(kind: GgmlType, b: &[u8], out: &mut [f16]) {
    let mut put = |i: usize, v: f32| out[i] = f16::from_f32(v);
    // The 4-bit value of element `j` of a 32-element block whose nibbles start at `qs`.
    let nibble = |qs: &[u8], j: usize| f32::from(if j < 16 { qs[j] & 15 } else { qs[j - 16] >> 4 });
    match kind {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            unreachable!("float types are not decoded")
        }
        GgmlType::Q8_0 => {
            let d = half_at(b, 0);
            for j in 0..32 {
                put(j, d * f32::from(b[2 + j] as i8));
            }
        }
        GgmlType::Q4_0 => {
            let d = half_at(b, 0);
            for j in 0..32 {
                put(j, d * (nibble(&b[2..], j) - 8.0));
            }
        }
        GgmlType::Q4_1 => {
            let (d, m) = (half_at(b, 0), half_at(b, 2));
            for j in 0..32 {
                put(j, h(d * nibble(&b[4..], j)) + m);
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let with_min = kind == GgmlType::Q5_1;
            let (d, m) = (half_at(b, 0), if with_min { half_at(b, 2) } else { 0.0 });
            let at = if with_min { 4 } else { 2 };
            let qh = u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
            for j in 0..32 {
                let q = nibble(&b[at + 4..], j) + 16.0 * ((qh >> j) & 1) as f32;
                if with_min {
                    put(j, h(d * q) + m);
                } else {
                    put(j, d * (q - 16.0));
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let scales = &b[4..16];
            let (qh, qs) = match kind {
                GgmlType::Q5_K => (Some(&b[16..48]), &b[48..176]),
                _ => (None, &b[16..144]),
            };
            for e in 0..QK_K {
                let (group, l) = (e / 32, e % 32);
                let byte = qs[32 * (group / 2) + l];
                let mut q = f32::from(if group % 2 == 0 { byte & 15 } else { byte >> 4 });
                if let Some(qh) = qh {
                    q += 16.0 * f32::from((qh[l] >> group) & 1);
                }
                let (sc, m) = scale_min(scales, group);
                put(e, h(h(d * sc) * q) - h(dmin * m));
            }
        }
        GgmlType::Q6_K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = half_at(b, 208);
            for e in 0..QK_K {
                let (half, r) = (e / 128, e % 128);
                let (quarter, l) = (r / 32, r % 32);
                let low = ql[64 * half + l + 32 * (quarter % 2)];
                let low = if quarter < 2 { low & 15 } else { low >> 4 };
                let high = (qh[32 * half + l] >> (2 * quarter)) & 3;
                let q = f32::from(low | (high << 4)) - 32.0;
                put(e, h(d * f32::from(sc[e / 16] as i8)) * q);
            }
        }
        GgmlType::Q3_K => {
            let (hmask, qs, s) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = half_at(b, 108);
            for e in 0..QK_K {
                let g = e / 16;
                let low = if g < 8 { s[g] & 15 } else { s[g - 8] >> 4 };
                let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
                let scale = f32::from(low | (high << 4)) - 32.0;
                let (a, r) = (e / 128, e % 128);
                let (k, l) = (r / 32, r % 32);
                let q = f32::from((qs[32 * a + l] >> (2 * k)) & 3);
                let bit = (hmask[l] >> (e / 32)) & 1;
                let q = if bit == 1 { q } else { q - 4.0 };
                put(e, h(d * scale) * q);
            }
        }
        GgmlType::Q2_K => {
            let (s, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (half_at(b, 80), half_at(b, 82));
            for e in 0..QK_K {
                let g = e / 16;
                let (a, r) = (e / 128, e % 128);
                let (k, l) = (r / 32, r % 32);
                let q = f32::from((qs[32 * a + l] >> (2 * k)) & 3);
                let dl = h(d * f32::from(s[g] & 15));
                let ml = h(dmin * f32::from(s[g] >> 4));
                put(e, h(dl * q) - ml);
            }
        }
    }
}

/// Random blocks of `kind` with float16 scales of a sane size (the quantized bytes random).
#[cfg(test)]
pub(super) fn random_blocks(kind: GgmlType, blocks: usize, seed: u64) -> Vec<u8> {
    let (_, size) = kind.block();
    let mut state = seed;
    let mut bytes: Vec<u8> = (0..blocks * size)
        .map(|_| (crate::weights::splitmix64(&mut state) >> 56) as u8)
        .collect();
    let scale_at: &[usize] = match kind {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    };
    for (i, block) in bytes.chunks_mut(size).enumerate() {
        for (k, &at) in scale_at.iter().enumerate() {
            let v = f16::from_f32(
                0.003 * (1.0 + ((i + k) % 7) as f32) * if k == 1 { -1.0 } else { 1.0 },
            );
            block[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
    use candle_core::{Device, Tensor};

    /// Each decoder puts every element where llama.cpp's exact decode (candle's port) puts it:
    /// the two agree within the float16 rounding diffusers' arithmetic adds (a few ulps of the
    /// largest weight of a block), for every type, including those no fixture file holds.
    #[test]
    fn decoders_agree_with_exact_decode_up_to_float16_rounding() -> candle_core::Result<()> {
        let types = [
            (GgmlType::Q4_0, GgmlDType::Q4_0),
            (GgmlType::Q4_1, GgmlDType::Q4_1),
            (GgmlType::Q5_0, GgmlDType::Q5_0),
            (GgmlType::Q5_1, GgmlDType::Q5_1),
            (GgmlType::Q8_0, GgmlDType::Q8_0),
            (GgmlType::Q2_K, GgmlDType::Q2K),
            (GgmlType::Q3_K, GgmlDType::Q3K),
            (GgmlType::Q4_K, GgmlDType::Q4K),
            (GgmlType::Q5_K, GgmlDType::Q5K),
            (GgmlType::Q6_K, GgmlDType::Q6K),
        ];
        for (ours, theirs) in types {
            let blocks = 8;
            let bytes = random_blocks(ours, blocks, 7);
            let (per_block, size) = ours.block();
            let exact = qtensor_from_ggml(theirs, &bytes, vec![blocks * per_block], &Device::Cpu)?
                .dequantize(&Device::Cpu)?
                .to_vec1::<f32>()?;
            let mut decoded = vec![f16::ZERO; blocks * per_block];
            for (out, block) in decoded.chunks_mut(per_block).zip(bytes.chunks(size)) {
                decode_block(ours, block, out);
            }
            for (b, (ours_block, exact_block)) in decoded
                .chunks(per_block)
                .zip(exact.chunks(per_block))
                .enumerate()
            {
                let largest = exact_block.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (i, (a, e)) in ours_block.iter().zip(exact_block).enumerate() {
                    let diff = (a.to_f32() - e).abs();
                    assert!(
                        diff <= largest * 8.0 * 2f32.powi(-10),
                        "{ours:?} block {b} element {i}: {} against exact {e}",
                        a.to_f32()
                    );
                }
            }
        }
        Ok(())
    }

    /// The first four rows of each tensor type of each fixture GGUF file decode bit for bit
    /// as diffusers decodes them, and (for the block types) not as the exact decode does.
    #[test]
    fn fixture_files_decode_as_diffusers_does() -> anyhow::Result<()> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/weights-a");
        let samples = candle_core::safetensors::load(
            dir.join("reference/gguf-dequant.safetensors"),
            &Device::Cpu,
        )?;
        let mut checked = 0;
        for (key, want) in &samples {
            let Some(at) = key.strip_suffix(".diffusers_rows0_4") else {
                continue;
            };
            let (file_type, name) = at.split_once('.').expect("<type>.<name>");
            let gguf = Gguf::open(&dir.join(format!("wan-q-tiny-a-{file_type}.gguf")))?;
            let t = gguf.tensor(name).expect("sampled tensor");
            let row = t.shape[1..].iter().product::<usize>();
            let got: Vec<f32> = match gguf.dequantize(t) {
                Some(values) => values[..4 * row].iter().map(|v| v.to_f32()).collect(),
                None => Tensor::from_raw_buffer(
                    gguf.data(t),
                    t.kind.float().unwrap(),
                    &t.shape,
                    &Device::Cpu,
                )?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .narrow(0, 0, 4 * row)?
                .to_vec1()?,
            };
            assert_eq!(got, want.flatten_all()?.to_vec1::<f32>()?, "{key}");
            if t.kind.float().is_none() {
                let exact = &samples[&format!("{at}.exact_rows0_4")];
                assert_ne!(got, exact.flatten_all()?.to_vec1::<f32>()?, "{key}");
            }
            checked += 1;
        }
        assert!(checked >= 8, "{checked} samples");
        Ok(())
    }
}
