// Expands packed weights to the compute dtype where they land (`weights::packed`): fp8 bytes of
// `--storage-dtype`, a scaled fp8 file's bytes times their f32 scales, and GGUF blocks decoded with diffusers' float16 arithmetic, bit for bit as
// the host decoders (`StorageDtype::decode`, `gguf::decode_block`). Every product and sum is an
// explicit round-to-nearest float op (`__fmul_rn`, `__fadd_rn`): nvcc must not fuse them into an
// FMA, which would skip the rounding the host does.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Packed forms (`Packed::code`).
#define FP8_E4M3FN 0
#define FP8_E5M2 1
#define Q8_0 2
#define Q4_0 3
#define Q4_1 4
#define Q5_0 5
#define Q5_1 6
#define Q2_K 7
#define Q3_K 8
#define Q4_K 9
#define Q5_K 10
#define Q6_K 11
#define FP8_E4M3FN_SCALED 12

// Bytes of one block of each GGUF form (from Q8_0 on), and values per block.
__constant__ int BLOCK_BYTES[10] = {34, 18, 20, 22, 24, 84, 110, 144, 176, 210};

// Output dtypes (`Packed::expand`).
#define OUT_F16 0
#define OUT_BF16 1
#define OUT_F32 2

// The value of fp8 byte `b` with `mantissa` bits and exponent `bias` (exact in f32); NaN as the
// positive quiet NaN, as the host decodes it.
__device__ float fp8_value(uint8_t b, int format) {
    const int mantissa = format == FP8_E4M3FN ? 3 : 2;
    const int bias = format == FP8_E4M3FN ? 7 : 15;
    const int top = 0x7f >> mantissa;
    const int field = (b & 0x7f) >> mantissa;
    const int steps = b & ((1 << mantissa) - 1);
    float magnitude;
    if (format == FP8_E4M3FN && field == top && steps == (1 << mantissa) - 1) {
        return __int_as_float(0x7fc00000);
    } else if (format == FP8_E5M2 && field == top) {
        if (steps != 0) return __int_as_float(0x7fc00000);
        magnitude = __int_as_float(0x7f800000);
    } else if (field == 0) {
        magnitude = ldexpf((float)steps, 1 - bias - mantissa);
    } else {
        magnitude = ldexpf((float)(steps + (1 << mantissa)), field - bias - mantissa);
    }
    return (b & 0x80) ? -magnitude : magnitude;
}

// The little-endian f32 at `b` (any alignment).
__device__ float float_at(const uint8_t* b) {
    return __uint_as_float(b[0] | (b[1] << 8) | (b[2] << 16) | ((uint32_t)b[3] << 24));
}

// Value `i` of a scaled fp8 tensor at `src`: `scales` f32 scales (one per `per_scale` values)
// then the float8_e4m3fn bytes; the byte widened as candle's load widens it (a NaN as float16's
// all-ones NaN in f32) times its scale, one f32 product. One scale needs no 64-bit division.
__device__ float scaled_fp8_value(const uint8_t* src, long long i, long long scales,
                                  long long per_scale) {
    const float v = fp8_value(src[4 * scales + i], FP8_E4M3FN);
    if (isnan(v)) return __uint_as_float(0x7fffe000);
    return __fmul_rn(v, float_at(src + 4 * (scales == 1 ? 0 : i / per_scale)));
}

__device__ float half_at(const uint8_t* b) {
    return __half2float(__ushort_as_half((unsigned short)(b[0] | (b[1] << 8))));
}

// `x` rounded to float16.
__device__ float h(float x) { return __half2float(__float2half_rn(x)); }

// The 4-bit value of element `j` of a 32-element block whose nibbles start at `qs`.
__device__ float nibble(const uint8_t* qs, int j) {
    return (float)(j < 16 ? qs[j] & 15 : qs[j - 16] >> 4);
}

// The 6-bit scale and minimum of group `j` of a Q4_K/Q5_K super-block's 12 scale bytes.
__device__ void scale_min(const uint8_t* s, int j, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *m = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        *m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// Element `e` of a 256-element K-quant super-block `b` of `format`, before its rounding to
// float16.
__device__ float k_quant_value(const uint8_t* b, int e, int format) {
    switch (format) {
        case Q4_K:
        case Q5_K: {
            const float d = half_at(b), dmin = half_at(b + 2);
            const int group = e / 32, l = e % 32;
            const uint8_t* qs = b + (format == Q5_K ? 48 : 16);
            const uint8_t byte = qs[32 * (group / 2) + l];
            float q = (float)(group % 2 == 0 ? byte & 15 : byte >> 4);
            if (format == Q5_K) q = __fadd_rn(q, 16.0f * (float)((b[16 + l] >> group) & 1));
            float sc, m;
            scale_min(b + 4, group, &sc, &m);
            return __fsub_rn(h(__fmul_rn(h(__fmul_rn(d, sc)), q)), h(__fmul_rn(dmin, m)));
        }
        case Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t* sc = (const int8_t*)(b + 192);
            const float d = half_at(b + 208);
            const int half = e / 128, r = e % 128, quarter = r / 32, l = r % 32;
            const uint8_t low_byte = ql[64 * half + l + 32 * (quarter % 2)];
            const int low = quarter < 2 ? low_byte & 15 : low_byte >> 4;
            const int high = (qh[32 * half + l] >> (2 * quarter)) & 3;
            const float q = (float)(low | (high << 4)) - 32.0f;
            return __fmul_rn(h(__fmul_rn(d, (float)sc[e / 16])), q);
        }
        case Q3_K: {
            const uint8_t *hmask = b, *qs = b + 32, *s = b + 96;
            const float d = half_at(b + 108);
            const int g = e / 16;
            const int low = g < 8 ? s[g] & 15 : s[g - 8] >> 4;
            const int high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
            const float scale = (float)(low | (high << 4)) - 32.0f;
            const int a = e / 128, r = e % 128, k = r / 32, l = r % 32;
            float q = (float)((qs[32 * a + l] >> (2 * k)) & 3);
            if (((hmask[l] >> (e / 32)) & 1) == 0) q -= 4.0f;
            return __fmul_rn(h(__fmul_rn(d, scale)), q);
        }
        default: {  // Q2_K
            const uint8_t *s = b, *qs = b + 16;
            const float d = half_at(b + 80), dmin = half_at(b + 82);
            const int g = e / 16, a = e / 128, r = e % 128, k = r / 32, l = r % 32;
            const float q = (float)((qs[32 * a + l] >> (2 * k)) & 3);
            const float dl = h(__fmul_rn(d, (float)(s[g] & 15)));
            const float ml = h(__fmul_rn(dmin, (float)(s[g] >> 4)));
            return __fsub_rn(h(__fmul_rn(dl, q)), ml);
        }
    }
}

// Element `j` of 32-element GGUF block `b` of `format`, before its rounding to float16.
__device__ float gguf_value(const uint8_t* b, int j, int format) {
    switch (format) {
        case Q8_0:
            return __fmul_rn(half_at(b), (float)(int8_t)b[2 + j]);
        case Q4_0:
            return __fmul_rn(half_at(b), nibble(b + 2, j) - 8.0f);
        case Q4_1:
            return __fadd_rn(h(__fmul_rn(half_at(b), nibble(b + 4, j))), half_at(b + 2));
        default: {
            const bool with_min = format == Q5_1;
            const int at = with_min ? 4 : 2;
            const uint32_t qh = b[at] | (b[at + 1] << 8) | (b[at + 2] << 16) | ((uint32_t)b[at + 3] << 24);
            const float q = nibble(b + at + 4, j) + 16.0f * (float)((qh >> j) & 1);
            if (with_min) return __fadd_rn(h(__fmul_rn(half_at(b), q)), half_at(b + 2));
            return __fmul_rn(half_at(b), q - 16.0f);
        }
    }
}

// `v` stored as `out`, as the host's `half` conversions store it (round to nearest even; a NaN
// keeps its sign and top payload bits, quieted).
__device__ void store(void* dst, long long i, int out, float v) {
    const uint32_t bits = __float_as_uint(v);
    if (out == OUT_F32) {
        ((float*)dst)[i] = v;
    } else if (out == OUT_BF16) {
        ((unsigned short*)dst)[i] = (bits & 0x7fffffff) > 0x7f800000
                                        ? (unsigned short)((bits >> 16) | 0x40)
                                        : __bfloat16_as_ushort(__float2bfloat16_rn(v));
    } else {
        ((unsigned short*)dst)[i] =
            (bits & 0x7fffffff) > 0x7f800000
                ? (unsigned short)(((bits >> 16) & 0x8000) | 0x7e00 | ((bits & 0x7fffff) >> 13))
                : __half_as_ushort(__float2half_rn(v));
    }
}

// `n` values of packed form `format` at `src` expanded into `dst` as `out`, one thread per value
// (grid-stride; blocks of 32 and 256 values are found by shifts, not 64-bit divisions);
// `scales`: the f32 scales before a scaled fp8 tensor's bytes.
extern "C" __global__ void expand(const uint8_t* src, void* dst, long long n, int format, int out,
                                  long long scales) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long per_scale = scales > 0 ? n / scales : n;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v;
        if (format == FP8_E4M3FN_SCALED) {
            v = scaled_fp8_value(src, i, scales, per_scale);
        } else if (format == FP8_E4M3FN || format == FP8_E5M2) {
            v = fp8_value(src[i], format);
        } else if (format < Q2_K) {
            const uint8_t* block = src + (i >> 5) * BLOCK_BYTES[format - Q8_0];
            v = h(gguf_value(block, (int)(i & 31), format));
        } else {
            const uint8_t* block = src + (i >> 8) * BLOCK_BYTES[format - Q8_0];
            v = h(k_quant_value(block, (int)(i & 255), format));
        }
        store(dst, i, out, v);
    }
}
