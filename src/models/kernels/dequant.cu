// Expands packed weights to the compute dtype where they land (`weights::packed`): fp8 bytes of
// `--storage-dtype`, and GGUF blocks decoded with diffusers' float16 arithmetic, bit for bit as
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

__device__ float half_at(const uint8_t* b) {
    return __half2float(__ushort_as_half((unsigned short)(b[0] | (b[1] << 8))));
}

// `x` rounded to float16.
__device__ float h(float x) { return __half2float(__float2half_rn(x)); }

// The 4-bit value of element `j` of a 32-element block whose nibbles start at `qs`.
__device__ float nibble(const uint8_t* qs, int j) {
    return (float)(j < 16 ? qs[j] & 15 : qs[j - 16] >> 4);
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
// (grid-stride).
extern "C" __global__ void expand(const uint8_t* src, void* dst, long long n, int format, int out) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v;
        if (format == FP8_E4M3FN || format == FP8_E5M2) {
            v = fp8_value(src[i], format);
        } else {
            const int block_bytes = format == Q8_0 ? 34
                                    : format == Q4_0 ? 18
                                    : format == Q4_1 ? 20
                                    : format == Q5_0 ? 22
                                                     : 24;
            v = h(gguf_value(src + (i / 32) * block_bytes, (int)(i % 32), format));
        }
        store(dst, i, out, v);
    }
}
