// Merges LoRA deltas into a weight where it landed on the device (`lora::merge`), bit for bit as
// the host merge: the same chain of fused multiply-adds (`__fmaf_rn`, exactly defined) per value.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Weight dtypes (`merge::DTYPES`).
#define W_F16 0
#define W_BF16 1
#define W_F32 2

// Rows a thread merges at once: each value of `down` is read once for all of them.
#define MERGE_ROWS 8

__device__ __forceinline__ float load_value(const void* src, long long i, int dtype) {
    switch (dtype) {
    case W_F16: return __half2float(((const __half*)src)[i]);
    case W_BF16: return __bfloat162float(((const __nv_bfloat16*)src)[i]);
    default: return ((const float*)src)[i];
    }
}

__device__ __forceinline__ void store_value(void* dst, long long i, int dtype, float v) {
    switch (dtype) {
    case W_F16: ((__half*)dst)[i] = __float2half_rn(v); break;
    case W_BF16: ((__nv_bfloat16*)dst)[i] = __float2bfloat16_rn(v); break;
    default: ((float*)dst)[i] = v;
    }
}

// `out` = `base` (`rows` x `cols` values of `dtype`) with the deltas added, per value in f32:
// w = base; for each delta d in order (4 int64s at deltas + 4d: its rank, the offsets in `factors`
// of its up and down factors (rank 0: of a whole diff shaped as the weight), the bits of its f32
// scale): rank > 0: acc = fma(up[i,k], down[k,j], acc) for k in order from 0, w = fma(acc, scale,
// w); rank 0: w = fma(diff[i,j], scale, w); then w rounded to `dtype`. One thread per column and
// MERGE_ROWS rows (grid-stride over rows); `base` and `out` may be the same memory.
extern "C" __global__ void lora_merge(const void* base, void* out, int dtype, long long rows,
                                      long long cols, const float* factors,
                                      const long long* deltas, int n_deltas) {
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    for (long long i0 = (long long)blockIdx.y * MERGE_ROWS; i0 < rows;
         i0 += (long long)gridDim.y * MERGE_ROWS) {
        const int n = rows - i0 < MERGE_ROWS ? (int)(rows - i0) : MERGE_ROWS;
        float w[MERGE_ROWS];
#pragma unroll
        for (int r = 0; r < MERGE_ROWS; ++r) {
            w[r] = r < n ? load_value(base, (i0 + r) * cols + j, dtype) : 0.f;
        }
        for (int d = 0; d < n_deltas; ++d) {
            const long long rank = deltas[4 * d];
            const float* a = factors + deltas[4 * d + 1];
            const float* b = factors + deltas[4 * d + 2];
            const float scale = __int_as_float((int)deltas[4 * d + 3]);
            if (rank == 0) {
#pragma unroll
                for (int r = 0; r < MERGE_ROWS; ++r) {
                    if (r < n) w[r] = __fmaf_rn(a[(i0 + r) * cols + j], scale, w[r]);
                }
                continue;
            }
            float acc[MERGE_ROWS];
#pragma unroll
            for (int r = 0; r < MERGE_ROWS; ++r) acc[r] = 0.f;
            for (long long k = 0; k < rank; ++k) {
                const float down = b[k * cols + j];
#pragma unroll
                for (int r = 0; r < MERGE_ROWS; ++r) {
                    if (r < n) acc[r] = __fmaf_rn(a[(i0 + r) * rank + k], down, acc[r]);
                }
            }
#pragma unroll
            for (int r = 0; r < MERGE_ROWS; ++r) w[r] = __fmaf_rn(acc[r], scale, w[r]);
        }
#pragma unroll
        for (int r = 0; r < MERGE_ROWS; ++r) {
            if (r < n) store_value(out, (i0 + r) * cols + j, dtype, w[r]);
        }
    }
}
