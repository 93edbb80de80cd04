// The moves around the VAEs' convolutions, each in one pass over memory: a convolution's bias
// added per channel (candle's broadcast add walks every dimension's index per element and was
// the largest kernel of the CogVideoX decode), optionally stored frames-major into a larger
// output; and the frames a causal convolution reads, gathered from a frames-major activation
// with replicate padding into the convolution's channel-major layout (an index_select, two pads
// and a transposing copy before); and a per-position Linear's output expanded depth to space.

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
// v rounded to the storage type T, back in f32.
template <typename T> __device__ __forceinline__ float round_to_storage(float v);
template <> __device__ __forceinline__ float round_to_storage<float>(float v) { return v; }
template <> __device__ __forceinline__ float round_to_storage<__nv_bfloat16>(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
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

// The channels-last moves around cuDNN's NDHWC convolutions, each a tiled transpose in one pass
// (cuDNN given channels first transposes every input and output itself, two more passes): a
// tile of 64 channels by 64 columns at a time, through shared memory, so that loads and stores
// both run along rows. On the channels-first side a warp moves
// 8 channel rows of 64 columns (two elements a lane); on the channels-last side 8 columns of
// 64 channels, a lane moving a pair of channels in one access. Every thread issues all 16 of its
// loads before its first store to shared memory: the moves are bound by how many bytes are in
// flight, and a loop that waits on each load ran at a third of a plain pass's rate.
// 256 threads: 8 warps.
constexpr int TILE_C = 64, TILE_W = 64, WARPS = 8;
constexpr int ROWS_PER_WARP = TILE_C / WARPS;  // channels-first side: channel rows of a warp
constexpr int COLS_PER_LANE = TILE_W / 32;     // channels-first side: columns of a lane
constexpr int COLS_PER_WARP = TILE_W / WARPS;  // channels-last side: columns of a warp

__device__ __forceinline__ int clamp_to(int v, int hi) { return min(max(v, 0), hi); }

// Two neighbouring channels of one position: the channels-last side's access.
template <typename T> struct alignas(2 * sizeof(T)) Pair {
  T e[2];
};

// A tile in shared memory: channel pairs by columns, with a column of padding, so that the
// channels-first side's row of consecutive columns and the channels-last side's column of 32
// pairs (a stride of 65 words in bf16) each fall in distinct banks.
template <typename T> using TileMem = Pair<T>[TILE_C / 2][TILE_W + 1];

// Whether pairs of neighbouring elements along a dimension of `len` may move in one access: an
// even length (every tile's pairs start at an even element) and storage aligned to a pair.
template <typename T> __device__ __forceinline__ bool pairs_fit(const T *p, int len) {
  return len % 2 == 0 && reinterpret_cast<uintptr_t>(p) % sizeof(Pair<T>) == 0;
}

// Line `line` of the moves' grid: batch entries of n frames of `rows` rows. A block moves one
// line at a time (grid-stride), all its tiles of channels and columns in turn, so the 64-bit
// divisions that place a line are paid once per line, not once per tile.
struct Line {
  long b, f;
  int row;
};
__device__ __forceinline__ Line line_at(long line, long n, int rows) {
  const long bf = line / rows;
  return Line{bf / n, bf % n, (int)(line - bf * rows)};
}

// Strides (elements) of a frame and of a channel in a video [B, T, C, h, w] (frames-major) or
// [B, C, T, h, w] (channels first) of T frames; a batch entry is C T h w either way.
struct Strides {
  long frame, channel;
};
__device__ __forceinline__ Strides strides_of(int channels_first, int channels, long frames,
                                              long plane) {
  return channels_first ? Strides{plane, frames * plane} : Strides{channels * plane, plane};
}

// out [B, n, h up + 2 ph, w up + 2 pw, C] (channels last) from the frames of `front`
// [B, F, C, h, w] and then x [B, T, C, h, w] (or, where `channels_first`, [B, C, F, h, w] and
// [B, C, T, h, w]): frame f is front's frame index[f] where index[f] < F (`front_frames`;
// `front` may be null where F is 0), else x's frame index[f] - F, first upsampled
// `up` = 2^up_shift times in height and width (nearest); rows and columns outside a frame
// replicate its edge (copies). `lines` = B n (h up + 2 ph).
template <typename T>
__device__ void gather_padded_frames_cl(const T *__restrict__ x, const T *__restrict__ front,
                                        long front_frames, T *__restrict__ out,
                                        const uint32_t *__restrict__ index, int channels,
                                        long frames, long n, int h, int w, int up_shift, int ph,
                                        int pw, long lines, int channels_first) {
  __shared__ TileMem<T> tile;
  const int hu = h << up_shift, wu = w << up_shift;
  const int hp = hu + 2 * ph, wp = wu + 2 * pw;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool pairs = pairs_fit(out, channels);
  const long plane = (long)h * w;
  for (long line = blockIdx.x; line < lines; line += gridDim.x) {
    const Line at = line_at(line, n, hp);
    const long i = index[at.f];
    const bool ahead = i < front_frames;
    const T *src_video = ahead ? front : x;
    const long src_frames = ahead ? front_frames : frames;
    const Strides at_x = strides_of(channels_first, channels, src_frames, plane);
    const T *src_row = src_video + at.b * channels * src_frames * plane +
                       (ahead ? i : i - front_frames) * at_x.frame +
                       (long)(clamp_to(at.row - ph, hu - 1) >> up_shift) * w;
    T *dst_row = out + ((at.b * n + at.f) * hp + at.row) * (long)wp * channels;
    for (int c0 = 0; c0 < channels; c0 += TILE_C) {
      const int chans = min(TILE_C, channels - c0);
      const T *frame = src_row + c0 * at_x.channel;
      for (int w0 = 0; w0 < wp; w0 += TILE_W) {
        const int cols = min(TILE_W, wp - w0);
        // Rows of x: channel c0 + k, padded columns w0 + j.
        T v[ROWS_PER_WARP][COLS_PER_LANE];
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r)
#pragma unroll
          for (int q = 0; q < COLS_PER_LANE; ++q) {
            const int k = warp + r * WARPS, j = lane + q * 32;
            if (k < chans && j < cols)
              v[r][q] = frame[k * at_x.channel + (clamp_to(w0 + j - pw, wu - 1) >> up_shift)];
          }
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r)
#pragma unroll
          for (int q = 0; q < COLS_PER_LANE; ++q) {
            const int k = warp + r * WARPS, j = lane + q * 32;
            if (k < chans && j < cols) tile[k / 2][j].e[k % 2] = v[r][q];
          }
        __syncthreads();
        // Rows of out: padded column w0 + j, channels c0 + 2 lane and the next.
        T *dst = dst_row + (long)w0 * channels + c0;
        const int c = 2 * lane;
#pragma unroll
        for (int q = 0; q < COLS_PER_WARP; ++q) {
          const int j = warp + q * WARPS;
          if (j < cols && c < chans) {
            const Pair<T> p = tile[lane][j];
            T *d = dst + (long)j * channels + c;
            if (pairs) {
              *reinterpret_cast<Pair<T> *>(d) = p;
            } else {
              d[0] = p.e[0];
              if (c + 1 < chans) d[1] = p.e[1];
            }
          }
        }
        __syncthreads();
      }
    }
  }
}

// y [B, n, h, w, C] (channels last, a convolution's output) + bias[c], rounded to T (then + res,
// of out's layout, rounded again, where res is given: as add_channel_bias), stored at
// out[b, first + f, c, :, :] of out [B, out_frames, C, h, w] (or, where `channels_first`, at
// out[b, c, first + f, :, :] of out [B, C, out_frames, h, w]). `lines` = B n h.
template <typename T>
__device__ void store_channels_last(const T *__restrict__ y, T *__restrict__ out,
                                    const float *__restrict__ bias, const T *__restrict__ res,
                                    int channels, long n, int h, int w, long out_frames,
                                    long first, long lines, int channels_first) {
  __shared__ TileMem<T> tile;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool pairs = pairs_fit(y, channels);
  // Every output row starts at an even element where w is even (tiles start at even columns).
  const bool column_pairs = pairs_fit(out, w) && (res == nullptr || pairs_fit(res, w));
  const long plane = (long)h * w;
  const Strides at_out = strides_of(channels_first, channels, out_frames, plane);
  for (long line = blockIdx.x; line < lines; line += gridDim.x) {
    const Line at = line_at(line, n, h);
    const T *src_row = y + ((at.b * n + at.f) * h + at.row) * (long)w * channels;
    const long out_row = at.b * channels * out_frames * plane + (first + at.f) * at_out.frame +
                         (long)at.row * w;
    for (int c0 = 0; c0 < channels; c0 += TILE_C) {
      const int chans = min(TILE_C, channels - c0);
      for (int w0 = 0; w0 < w; w0 += TILE_W) {
        const int cols = min(TILE_W, w - w0);
        // Rows of y: column w0 + j, channels c0 + 2 lane and the next.
        const T *src = src_row + (long)w0 * channels + c0;
        const int c = 2 * lane;
        Pair<T> v[COLS_PER_WARP];
#pragma unroll
        for (int q = 0; q < COLS_PER_WARP; ++q) {
          const int j = warp + q * WARPS;
          if (j < cols && c < chans) {
            const T *s = src + (long)j * channels + c;
            if (pairs) {
              v[q] = *reinterpret_cast<const Pair<T> *>(s);
            } else {
              v[q].e[0] = s[0];
              v[q].e[1] = c + 1 < chans ? s[1] : s[0];
            }
          }
        }
#pragma unroll
        for (int q = 0; q < COLS_PER_WARP; ++q) {
          const int j = warp + q * WARPS;
          if (j < cols && c < chans) tile[lane][j] = v[q];
        }
        __syncthreads();
        // Rows of out: channel c0 + k, columns w0 + j (a lane's two neighbouring columns in one
        // access where the rows' pairs are aligned).
        const long base = out_row + c0 * at_out.channel + w0;
        auto sum = [&](int k, int j, float add, long at) {
          float s = round_to_storage<T>(__fadd_rn(load(&tile[k / 2][j].e[k % 2], 0), add));
          return res ? __fadd_rn(s, load(res, at)) : s;
        };
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
          const int k = warp + r * WARPS;
          if (k >= chans) continue;
          const float add = bias[c0 + k];
          const long row_k = base + k * at_out.channel;
          if (column_pairs) {
            const int j = 2 * lane;
            if (j >= cols) continue;
            Pair<T> p;
            store(p.e, 0, sum(k, j, add, row_k + j));
            store(p.e, 1, sum(k, j + 1, add, row_k + j + 1));
            *reinterpret_cast<Pair<T> *>(out + row_k + j) = p;
            continue;
          }
#pragma unroll
          for (int q = 0; q < COLS_PER_LANE; ++q) {
            const int j = lane + q * 32;
            if (j < cols) store(out, row_k + j, sum(k, j, add, row_k + j));
          }
        }
        __syncthreads();
      }
    }
  }
}

// y [B, n, C, st, s, s, h, w] (a per-position Linear's or a convolution's output: channel
// (c, t', h', w')) + bias[channel of y] where bias is given, rounded to T (as add_channel_bias),
// stored at out[b, first + f st + t' - skip, c, hh s + h', ww s + w'] of out [B, out_frames, C,
// h s, w s]; with `channels_first`, y is [B, C st s s, n, h, w] and out [B, C, out_frames, h s,
// w s]. The first `skip` expanded frames of the run are dropped. diffusers' view and permute
// that expand time and space (and a Linear's bias) in one pass (a strided copy walking eight
// dimensions per element and a broadcast add before). A warp per output row, the row's source
// found once; a lane per source column stores its s output columns (one store where s is 2).
template <typename T>
__device__ void depth_to_space(const T *__restrict__ y, T *__restrict__ out,
                               const float *__restrict__ bias, int channels, int st, int s, int h,
                               int w, long n, long out_frames, long first, long skip, long rows,
                               int channels_first) {
  const int hs = h * s;
  const long plane = (long)h * w, y_channels = (long)channels * st * s * s;
  const long kept = n * st - skip;  // expanded frames stored per batch entry
  const Strides at_y = strides_of(channels_first, (int)y_channels, n, plane);
  const Strides at_out = strides_of(channels_first, channels, out_frames, (long)hs * w * s);
  const int lane = threadIdx.x % 32;
  const long warps = (long)gridDim.x * blockDim.x / 32;
  for (long r = (blockIdx.x * (long)blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
    const int row = (int)(r % hs);
    long q = r / hs;
    const int c = (int)(q % channels);
    q /= channels;
    const long kf = q % kept, b = q / kept;
    const long tf = kf + skip, f = tf / st;
    const int tp = (int)(tf % st), hp = row % s, hh = row / s;
    const long ch0 = (((long)c * st + tp) * s + hp) * s;  // y's channel of w' = 0
    const T *src = y + b * y_channels * n * plane + f * at_y.frame + ch0 * at_y.channel +
                   (long)hh * w;
    T *dst = out + b * channels * out_frames * (long)hs * w * s + (first + kf) * at_out.frame +
             c * at_out.channel + (long)row * w * s;
    const float *add = bias ? bias + ch0 : nullptr;
    auto value = [&](int wp, int ww) {
      const float v = load(src, wp * at_y.channel + ww);
      return add ? __fadd_rn(v, add[wp]) : v;
    };
    if (s == 2) {
      struct alignas(2 * sizeof(T)) Pair {
        T e[2];
      };
      for (int ww = lane; ww < w; ww += 32) {
        Pair p;
        store(p.e, 0, value(0, ww));
        store(p.e, 1, value(1, ww));
        reinterpret_cast<Pair *>(dst)[ww] = p;
      }
    } else {
      for (int ww = lane; ww < w; ww += 32)
        for (int wp = 0; wp < s; ++wp) store(dst, (long)ww * s + wp, value(wp, ww));
    }
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
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(WARPS * 32) gather_padded_frames_cl_##NAME(     \
      const T *__restrict__ x, const T *__restrict__ front, long front_frames,                  \
      T *__restrict__ out, const uint32_t *__restrict__ index, int channels, long frames,       \
      long n, int h, int w, int up_shift, int ph, int pw, long lines, int channels_first) {     \
    gather_padded_frames_cl(x, front, front_frames, out, index, channels, frames, n, h, w,      \
                            up_shift,                                                           \
                            ph, pw, lines, channels_first);                                     \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(WARPS * 32) store_channels_last_##NAME(          \
      const T *__restrict__ y, T *__restrict__ out, const float *__restrict__ bias,             \
      const T *__restrict__ res, int channels, long n, int h, int w, long out_frames,           \
      long first, long lines, int channels_first) {                                             \
    store_channels_last(y, out, bias, res, channels, n, h, w, out_frames, first, lines,         \
                        channels_first);                                                        \
  }                                                                                             \
  extern "C" __global__ void depth_to_space_##NAME(                                             \
      const T *__restrict__ y, T *__restrict__ out, const float *__restrict__ bias,             \
      int channels, int st, int s, int h, int w, long n, long out_frames, long first,          \
      long skip, long rows, int channels_first) {                                               \
    depth_to_space(y, out, bias, channels, st, s, h, w, n, out_frames, first, skip, rows,       \
                   channels_first);                                                             \
  }

CHANNEL_OPS(f32, float)
CHANNEL_OPS(bf16, __nv_bfloat16)
