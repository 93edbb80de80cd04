// The moves around the VAEs' convolutions, each in one pass over memory: a convolution's bias
// added per channel (candle's broadcast add walks every dimension's index per element and was
// the largest kernel of the CogVideoX decode), optionally stored frames-major into a larger
// output; and the frames a causal convolution reads, gathered from a frames-major activation
// with replicate padding into the convolution's channel-major layout (an index_select, two pads
// and a transposing copy before).

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ float load(const float *p, long i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16 *p, long i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float *p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, long i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

// y [B, C, F, S] + bias[c] (or bias[c, s] where `per_position`: an addend broadcast over batch and
// frames), rounded once to T (as candle's add of two T values). Frames-major:
// stored at out[b, first + f, c, s] of out [B, T, C, S]; else at out's index of y. One thread
// per 16 bytes of a row where `vector` (S a multiple of 16 bytes and both operands aligned),
// else per element.
//   With `res` (of out's layout, or null), the rounded sum plus res[dst], rounded again: a
// residual added in the same store, as candle's add of the two would round it.
template <typename T>
__device__ void add_channel_bias(const T *__restrict__ y, T *__restrict__ out,
                                 const float *__restrict__ bias, const T *__restrict__ res,
                                 int channels, long frames, long spatial, long items,
                                 int frames_major, long out_frames, long first, int vector,
                                 int per_position) {
  constexpr int V = 16 / sizeof(T);
  const int per_item = vector ? V : 1;
  const long per_row = spatial / per_item;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < items;
       i += (long)gridDim.x * blockDim.x) {
    const long row = i / per_row, s = (i % per_row) * per_item;
    const long f = row % frames, bc = row / frames;
    const int c = (int)(bc % channels);
    const long b = bc / channels;
    const long src = row * spatial + s;
    const long dst =
        frames_major ? ((b * out_frames + first + f) * channels + c) * spatial + s : src;
    const float *add = per_position ? bias + (long)c * spatial + s : bias + c;
    const int step = per_position ? 1 : 0;
    if (vector) {
      union {
        uint4 v;
        T e[V];
      } u;
      u.v = *reinterpret_cast<const uint4 *>(y + src);
#pragma unroll
      for (int k = 0; k < V; ++k) store(u.e, k, __fadd_rn(load(u.e, k), add[k * step]));
      if (res) {
        union {
          uint4 v;
          T e[V];
        } r;
        r.v = *reinterpret_cast<const uint4 *>(res + dst);
#pragma unroll
        for (int k = 0; k < V; ++k) store(u.e, k, __fadd_rn(load(u.e, k), load(r.e, k)));
      }
      *reinterpret_cast<uint4 *>(out + dst) = u.v;
    } else {
      store(out, dst, __fadd_rn(load(y, src), add[0]));
      if (res) store(out, dst, __fadd_rn(load(out, dst), load(res, dst)));
    }
  }
}

// out [B, C, n, h + 2 ph, w + 2 pw] from frames-major x [B, T, C, h, w]: frame f is x's frame
// index[f], rows and columns outside x replicate its edge (copies, no arithmetic). A warp per
// output row: the row's source is found once and its columns are copied by the warp's lanes
// (coalesced loads and stores; a thread per element spent its time on five 64-bit divisions).
template <typename T>
__device__ void gather_padded_frames(const T *__restrict__ x, T *__restrict__ out,
                                     const uint32_t *__restrict__ index, int channels,
                                     long frames, long n, int h, int w, int ph, int pw,
                                     long rows) {
  const int hp = h + 2 * ph, wp = w + 2 * pw;
  const int lane = threadIdx.x % 32;
  const long warps = (long)gridDim.x * blockDim.x / 32;
  for (long r = (blockIdx.x * (long)blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
    const int row = (int)(r % hp);
    long q = r / hp;
    const long f = q % n;
    q /= n;
    const int c = (int)(q % channels);
    const long b = q / channels;
    const int sy = min(max(row - ph, 0), h - 1);
    const T *src = x + (((b * frames + index[f]) * channels + c) * h + sy) * (long)w;
    T *dst = out + r * wp;
    for (int j = lane; j < wp; j += 32)
      dst[j] = src[min(max(j - pw, 0), w - 1)];
  }
}

} // namespace

#define CHANNEL_OPS(NAME, T)                                                                    \
  extern "C" __global__ void add_channel_bias_##NAME(                                           \
      const T *__restrict__ y, T *__restrict__ out, const float *__restrict__ bias,             \
      const T *__restrict__ res, int channels, long frames, long spatial, long items,           \
      int frames_major, long out_frames, long first, int vector, int per_position) {            \
    add_channel_bias(y, out, bias, res, channels, frames, spatial, items, frames_major,         \
                     out_frames, first, vector, per_position);                                  \
  }                                                                                             \
  extern "C" __global__ void gather_padded_frames_##NAME(                                       \
      const T *__restrict__ x, T *__restrict__ out, const uint32_t *__restrict__ index,         \
      int channels, long frames, long n, int h, int w, int ph, int pw, long rows) {             \
    gather_padded_frames(x, out, index, channels, frames, n, h, w, ph, pw, rows);               \
  }

CHANNEL_OPS(f32, float)
CHANNEL_OPS(bf16, __nv_bfloat16)
