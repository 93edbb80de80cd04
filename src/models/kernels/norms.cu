// Norms of the VAEs, each in few passes over memory where candle's composition makes ten or more.
//
// GroupNorm (optionally followed by SiLU) in three passes over memory instead of candle's ten or
// more: the sum of each group, the sum of squares about its mean, then one pass that normalizes,
// applies the per-channel weight and bias and the SiLU, rounding where the candle composition
// rounds.
//
// The activation is contiguous and seen as rows of `spatial` elements of one channel each: row r
// has channel r % C and belongs to entry r / rows_per_entry, whose group of that channel is one
// normalized group. Channels first [B, C, ...]: rows_per_entry = C; frames-major [B, T, C, ...]
// (statistics over all frames): rows_per_entry = T * C. Block `chunks * r + j` takes chunk j of
// row r. Sums are taken in f32 per block and added across blocks in f64.

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int THREADS = 256;

__device__ __forceinline__ float load(const float *p, long i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16 *p, long i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float *p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, long i, float v) {
  p[i] = __float2bfloat16_rn(v);
}
// v rounded to the storage type T, back in f32.
__device__ __forceinline__ float round_to(const float *, float v) { return v; }
__device__ __forceinline__ float round_to(const __nv_bfloat16 *, float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[THREADS / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < THREADS / 32 ? partial[threadIdx.x] : 0.f;
  if (threadIdx.x < 32)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

struct Rows {
  long spatial;        // elements per row
  int channels;        // C
  long rows_per_entry; // rows of one normalized entry
  int per_group;       // channels per group
  int groups;
  int chunks; // blocks per row

  // The row and chunk of this block, and the group its row belongs to.
  __device__ __forceinline__ void locate(long &row, long &begin, long &end, int &q) const {
    row = blockIdx.x / chunks;
    const long chunk = blockIdx.x % chunks, len = (spatial + chunks - 1) / chunks;
    begin = chunk * len;
    end = min(spatial, begin + len);
    q = (int)(row / rows_per_entry) * groups + (int)(row % channels) / per_group;
  }
};

// acc[q] += the sum of x over this block's chunk of a row of group q, or of (x - mean_q)^2
// where `mean_sums` (the first pass's sums) is given; mean_q = sum / count in f32 as candle
// divides.
template <typename T>
__device__ void group_sums(const T *__restrict__ x, double *__restrict__ acc,
                           const double *__restrict__ mean_sums, Rows rows, float count) {
  long row, begin, end;
  int q;
  rows.locate(row, begin, end, q);
  const T *p = x + row * rows.spatial;
  const float mean = mean_sums ? (float)mean_sums[q] / count : 0.f;
  float s = 0.f;
  for (long i = begin + threadIdx.x; i < end; i += THREADS) {
    const float v = load(p, i);
    if (mean_sums) {
      const float d = v - mean;
      s += d * d;
    } else {
      s += v;
    }
  }
  s = block_sum(s);
  if (threadIdx.x == 0) atomicAdd(acc + q, (double)s);
}

// out = norm(x) per group, then weight and bias per channel, then SiLU where `silu`: with
// `round_first`, the normalized value is rounded to T before the weight and each of the two
// affine ops rounds (candle's GroupNorm on half precision); else the affine is computed in f32
// and rounded once (a norm computed in f32 as a whole). SiLU is taken of the rounded value in
// f32 and rounded.
template <typename T>
__device__ void group_apply(const T *__restrict__ x, T *__restrict__ out,
                            const double *__restrict__ sums, const double *__restrict__ squares,
                            const float *__restrict__ weight, const float *__restrict__ bias,
                            Rows rows, float count, float eps, int round_first, int silu) {
  long row, begin, end;
  int q;
  rows.locate(row, begin, end, q);
  const int c = (int)(row % rows.channels);
  const float mean = (float)sums[q] / count;
  const float std = sqrtf((float)squares[q] / count + eps);
  const float w = weight[c], b = bias[c];
  const long offset = row * rows.spatial;
  for (long i = begin + threadIdx.x; i < end; i += THREADS) {
    // Separate roundings (no contraction into FMAs), as the candle ops compute.
    float v = __fdiv_rn(__fsub_rn(load(x, offset + i), mean), std);
    if (round_first) {
      v = round_to(x, v);
      v = round_to(x, __fmul_rn(v, w));
      v = round_to(x, __fadd_rn(v, b));
    } else {
      v = round_to(x, __fadd_rn(__fmul_rn(v, w), b));
    }
    if (silu) v = __fdiv_rn(v, __fadd_rn(1.f, expf(-v)));
    store(out, offset + i, v);
  }
}

// out[b, c, s] = the RMS norm over the C channels of each position of x [B, C, S] (no weight;
// f32 sums, then x * (1 / sqrt(mean + eps)) rounded), then where given the modulation
// (* scale1[b, c], + shift[b, c], each rounded: scale1 = 1 + scale, already rounded), then SiLU
// where `silu` (of the rounded value, rounded): the candle composition of the LTX-Video
// decoder's resnets. One thread per position: a warp reads 32 consecutive positions of a channel.
template <typename T>
__device__ void channel_rms(const T *__restrict__ x, T *__restrict__ out,
                            const float *__restrict__ scale1, const float *__restrict__ shift,
                            int channels, long spatial, long positions, float eps, int silu) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < positions;
       i += (long)gridDim.x * blockDim.x) {
    const long b = i / spatial, s = i % spatial;
    const long base = b * channels * spatial + s;
    float sq = 0.f;
    for (int c = 0; c < channels; ++c) {
      const float v = load(x, base + c * spatial);
      sq = __fadd_rn(sq, __fmul_rn(v, v));
    }
    const float inv = __frcp_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(sq, 1.f / channels), eps)));
    for (int c = 0; c < channels; ++c) {
      float v = round_to(x, __fmul_rn(load(x, base + c * spatial), inv));
      if (scale1 != nullptr) {
        v = round_to(x, __fmul_rn(v, scale1[b * channels + c]));
        v = round_to(x, __fadd_rn(v, shift[b * channels + c]));
      }
      if (silu) v = __fdiv_rn(v, __fadd_rn(1.f, expf(-v)));
      store(out, base + c * spatial, v);
    }
  }
}

} // namespace

#define CHANNEL_RMS(NAME, T)                                                                    \
  extern "C" __global__ void channel_rms_##NAME(                                                \
      const T *__restrict__ x, T *__restrict__ out, const float *__restrict__ scale1,           \
      const float *__restrict__ shift, int channels, long spatial, long positions, float eps,   \
      int silu) {                                                                               \
    channel_rms(x, out, scale1, shift, channels, spatial, positions, eps, silu);                \
  }

CHANNEL_RMS(f32, float)
CHANNEL_RMS(bf16, __nv_bfloat16)

#define GROUP_NORM(NAME, T)                                                                     \
  extern "C" __global__ void __launch_bounds__(THREADS) group_sums_##NAME(                      \
      const T *__restrict__ x, double *__restrict__ acc, const double *__restrict__ mean_sums,  \
      long spatial, int channels, long rows_per_entry, int per_group, int groups, int chunks,   \
      float count) {                                                                            \
    group_sums(x, acc, mean_sums,                                                               \
               Rows{spatial, channels, rows_per_entry, per_group, groups, chunks}, count);      \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(THREADS) group_apply_##NAME(                     \
      const T *__restrict__ x, T *__restrict__ out, const double *__restrict__ sums,            \
      const double *__restrict__ squares, const float *__restrict__ weight,                     \
      const float *__restrict__ bias, long spatial, int channels, long rows_per_entry,          \
      int per_group, int groups, int chunks, float count, float eps, int round_first,           \
      int silu) {                                                                               \
    group_apply(x, out, sums, squares, weight, bias,                                            \
                Rows{spatial, channels, rows_per_entry, per_group, groups, chunks}, count, eps,  \
                round_first, silu);                                                             \
  }

GROUP_NORM(f32, float)
GROUP_NORM(bf16, __nv_bfloat16)
