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
// 16 bytes of T values holding `v` (4 f32, or 8 bf16 each rounded to nearest).
__device__ __forceinline__ uint4 pack16(const float *v, const float *) {
  return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                    __float_as_uint(v[3]));
}
__device__ __forceinline__ uint4 pack16(const float *v, const __nv_bfloat16 *) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    w[k] = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(v[2 * k])) |
           ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(v[2 * k + 1])) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
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

// out = norm(x) per group, then weight and bias per channel, then where given the element-wise
// `scale` and `shift` (x's shape: CogVideoX's spatial norm), then SiLU where `silu`: with
// `round_first`, the normalized value is rounded to T before the weight and each of the two
// affine ops rounds (candle's GroupNorm on half precision); else the affine is computed in f32
// and rounded once (a norm computed in f32 as a whole). The product with `scale` and the sum
// with `shift` each round; SiLU is taken of the rounded value in f32 and rounded.
template <typename T>
__device__ void group_apply(const T *__restrict__ x, T *__restrict__ out,
                            const double *__restrict__ sums, const double *__restrict__ squares,
                            const float *__restrict__ weight, const float *__restrict__ bias,
                            const T *__restrict__ scale, const T *__restrict__ shift, Rows rows,
                            float count, float eps, int round_first, int silu) {
  long row, begin, end;
  int q;
  rows.locate(row, begin, end, q);
  const int c = (int)(row % rows.channels);
  const float mean = (float)sums[q] / count;
  const float std = sqrtf((float)squares[q] / count + eps);
  const float w = weight[c], b = bias[c];
  const long offset = row * rows.spatial;
  // One element, at `at`: separate roundings (no contraction into FMAs), as the candle ops
  // compute.
  auto apply = [&](float v, long at) {
    v = __fdiv_rn(__fsub_rn(v, mean), std);
    if (round_first) {
      v = round_to(x, v);
      v = round_to(x, __fmul_rn(v, w));
      v = round_to(x, __fadd_rn(v, b));
    } else {
      v = round_to(x, __fadd_rn(__fmul_rn(v, w), b));
    }
    if (scale) {
      v = round_to(x, __fmul_rn(v, load(scale, at)));
      v = round_to(x, __fadd_rn(v, load(shift, at)));
    }
    if (silu) v = __fdiv_rn(v, __fadd_rn(1.f, expf(-v)));
    return v;
  };
  // Elements [head, tail) move 16 bytes a load and a store where x and out lie alike modulo 16
  // bytes (and no element-wise modulation is read): the same arithmetic per element, an eighth
  // of the bf16 load and store instructions. The rest of the chunk goes one element at a time.
  constexpr int VEC = 16 / sizeof(T);
  const T *xs = x + offset;
  T *outs = out + offset;
  long head = end, tail = end;
  const uintptr_t at_x = reinterpret_cast<uintptr_t>(xs + begin);
  if (!scale && (at_x - reinterpret_cast<uintptr_t>(outs + begin)) % 16 == 0) {
    head = min(end, begin + (long)((16 - at_x % 16) % 16 / sizeof(T)));
    tail = head + (end - head) / VEC * VEC;
  }
  for (long i = begin + threadIdx.x; i < head; i += THREADS) {
    store(out, offset + i, apply(load(x, offset + i), offset + i));
  }
  for (long j = head + (long)threadIdx.x * VEC; j < tail; j += (long)THREADS * VEC) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4 *>(xs + j));
    const T *in = reinterpret_cast<const T *>(&raw);
    float res[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) res[k] = apply(load(in, k), offset + j + k);
    __stwb(reinterpret_cast<uint4 *>(outs + j), pack16(res, x));
  }
  for (long i = tail + threadIdx.x; i < end; i += THREADS) {
    store(out, offset + i, apply(load(x, offset + i), offset + i));
  }
}

// out[b, c, s] = the RMS norm over the C channels of each position of x [B, C, S] (no weight;
// f32 sums, then x * (1 / sqrt(mean + eps)) rounded), then where given the modulation
// (* scale1[b, c], + shift[b, c], each rounded: scale1 = 1 + scale, already rounded), then SiLU
// where `silu` (of the rounded value, rounded): the candle composition of the LTX-Video
// decoder's resnets. A block takes RMS_POSITIONS·V consecutive positions (a warp reads them for
// one channel, V adjacent positions a lane: one 8- or 16-byte load where V = 4), its RMS_SLICES
// warps each a slice of the channels, so that the low-resolution stages (hundreds of channels,
// few positions) still fill the GPU. Every position's sum runs in the same order whatever V.
constexpr int RMS_POSITIONS = 32, RMS_SLICES = THREADS / RMS_POSITIONS;

// V adjacent elements, loaded and stored at once.
template <typename T, int V> struct alignas(sizeof(T) * V) Lanes {
  T e[V];
};

template <typename T, int V>
__device__ void channel_rms(const T *__restrict__ x, T *__restrict__ out,
                            const float *__restrict__ scale1, const float *__restrict__ shift,
                            int channels, long spatial, long positions, float eps, int silu) {
  constexpr int P = RMS_POSITIONS * V;
  __shared__ float partial[RMS_SLICES][P];
  const int lane = threadIdx.x % RMS_POSITIONS, slice = threadIdx.x / RMS_POSITIONS;
  // With V > 1, `spatial` is a multiple of V: a lane's positions share their batch entry.
  for (long first = blockIdx.x * (long)P; first < positions; first += (long)gridDim.x * P) {
    const long i = first + (long)lane * V;
    const bool live = i < positions;
    const long b = live ? i / spatial : 0;
    const long base = live ? b * channels * spatial + i % spatial : 0;
    float sq[V];
#pragma unroll
    for (int k = 0; k < V; ++k) sq[k] = 0.f;
    if (live)
      for (int c = slice; c < channels; c += RMS_SLICES) {
        const Lanes<T, V> q = *reinterpret_cast<const Lanes<T, V> *>(x + base + c * spatial);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float v = load(q.e, k);
          sq[k] = __fadd_rn(sq[k], __fmul_rn(v, v));
        }
      }
#pragma unroll
    for (int k = 0; k < V; ++k) partial[slice][lane * V + k] = sq[k];
    __syncthreads();
    float inv[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float total = 0.f;
      for (int s = 0; s < RMS_SLICES; ++s) total = __fadd_rn(total, partial[s][lane * V + k]);
      inv[k] = __frcp_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(total, 1.f / channels), eps)));
    }
    __syncthreads();
    if (!live) continue;
    for (int c = slice; c < channels; c += RMS_SLICES) {
      Lanes<T, V> q = *reinterpret_cast<const Lanes<T, V> *>(x + base + c * spatial);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float v = round_to(x, __fmul_rn(load(q.e, k), inv[k]));
        if (scale1 != nullptr) {
          v = round_to(x, __fmul_rn(v, scale1[b * channels + c]));
          v = round_to(x, __fadd_rn(v, shift[b * channels + c]));
        }
        if (silu) v = __fdiv_rn(v, __fadd_rn(1.f, expf(-v)));
        store(q.e, k, v);
      }
      *reinterpret_cast<Lanes<T, V> *>(out + base + c * spatial) = q;
    }
  }
}

} // namespace

#define CHANNEL_RMS(NAME, V, T)                                                                 \
  extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                   \
      const T *__restrict__ x, T *__restrict__ out, const float *__restrict__ scale1,           \
      const float *__restrict__ shift, int channels, long spatial, long positions, float eps,   \
      int silu) {                                                                               \
    channel_rms<T, V>(x, out, scale1, shift, channels, spatial, positions, eps, silu);          \
  }

CHANNEL_RMS(channel_rms_f32, 1, float)
CHANNEL_RMS(channel_rms_bf16, 1, __nv_bfloat16)
CHANNEL_RMS(channel_rms4_f32, 4, float)
CHANNEL_RMS(channel_rms4_bf16, 4, __nv_bfloat16)

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
      const float *__restrict__ bias, const T *__restrict__ scale, const T *__restrict__ shift, \
      long spatial, int channels, long rows_per_entry, int per_group, int groups, int chunks,   \
      float count, float eps, int round_first, int silu) {                                      \
    group_apply(x, out, sums, squares, weight, bias, scale, shift,                              \
                Rows{spatial, channels, rows_per_entry, per_group, groups, chunks}, count, eps,  \
                round_first, silu);                                                             \
  }

GROUP_NORM(f32, float)
GROUP_NORM(bf16, __nv_bfloat16)
