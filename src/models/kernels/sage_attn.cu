// 8-bit attention (`--attention sage`, models/sage_attention.rs defines the arithmetic):
// SageAttention2's scheme on mma.sync, for every GPU with fp8 tensor cores (sm_89+: Ada, Hopper,
// Blackwell, GB10), within 99 KB of shared memory per block.
//
// Four launches per attention:
// 1. `sage_stats`: per (batch, head) and channel, the sum of k and the sum, max and min of v
//    over the keys (atomics into [bh][4][D]: sums zeroed, max -inf, min +inf by `sage_stats_init`);
// 2. `sage_q` and `sage_k`: q as int8 codes with one f32 scale per token, and k minus its
//    channel means ("smoothed": a constant per query row of the scores, which the softmax drops)
//    as int8 codes with one scale per block of 128 keys (absmax / 127, round to nearest even);
// 3. `sage_v`: v minus its channel means over one f32 scale per channel (max |v - mean| / 448) as
//    e4m3 codes, transposed to [bh][D][pad] (pad: keys rounded up to 128, zero codes) so that the
//    P·V operand is K-major, with the keys of each group of 16 in the order the probabilities'
//    registers hold them (below);
// 4. `sage_fwd` (or, on Hopper, sage_attn_sm90.cu's wgmma kernel): the FlashAttention-2 loop of
//    flash_attn.cu with S = Q K^T on int8 mma.sync (m16n8k32, exact int32 sums) times both tokens'
//    scales, the online softmax in f32 (448 p = 2^(s - max + log2 448)), and P·V on e4m3 mma.sync
//    (m16n8k32); each tile's P·V is summed apart and then added to the f32 accumulators (the fp8
//    mma's own accumulation is narrower than f32). The rows' sums of P's codes come from the same
//    mma against a column of e4m3 ones, summed the same way. The output is
//    acc * scale_v / Σ e4m3(448 p) + mean_v.
//
// The probabilities' registers: for a 32-key step, the score accumulators of a thread hold keys
// {2t, 2t+1} of each 8-key n-tile (t = lane % 4), while the mma's A operand wants 4 consecutive
// keys 4t..4t+3 of each 16. Rather than shuffle registers, V's keys are stored permuted within each
// group of 16: position 4t + i holds key (i / 2) * 8 + 2t + i % 2.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

#include "tensor_core.cuh"
#include "sage.cuh"

constexpr int BC = 64;        // keys per tile
constexpr int ROW_PAD = 16;   // bytes added to each shared-memory row: conflict-free ldmatrix
constexpr float I8_MAX = 127.f;
__device__ __forceinline__ float2 load2(const __nv_bfloat16 *p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(p));
}
__device__ __forceinline__ float2 load2(const __half *p) {
  return __half22float2(*reinterpret_cast<const __half2 *>(p));
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// c += a b: int8 16x8x32, exact int32 sums (sm_80+).
__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a b: e4m3 16x8x32 into f32 (sm_89+).
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Float max/min through integer atomics (ordered for non-negative values as int, for negative
// ones reversed as unsigned).
__device__ __forceinline__ void atomic_max(float *a, float v) {
  if (v >= 0.f) {
    atomicMax(reinterpret_cast<int *>(a), __float_as_int(v));
  } else {
    atomicMin(reinterpret_cast<unsigned *>(a), __float_as_uint(v));
  }
}
__device__ __forceinline__ void atomic_min(float *a, float v) {
  if (v >= 0.f) {
    atomicMin(reinterpret_cast<int *>(a), __float_as_int(v));
  } else {
    atomicMax(reinterpret_cast<unsigned *>(a), __float_as_uint(v));
  }
}

// Rows per block of `sage_stats`.
constexpr int STAT_ROWS = 512;

// stats [bh][4][D]: sum k, sum v, max v, min v. Block: D / 2 * 4 threads (a channel pair and one
// of 4 row phases each); grid (ceil(len / STAT_ROWS), bh).
template <typename T, int D>
__device__ __forceinline__ void stats_kernel(const T *k, const T *v, float *stats, int len,
                                             int heads, long long k_sb, long long k_sh,
                                             long long k_ss, long long v_sb, long long v_sh,
                                             long long v_ss) {
  constexpr int P = D / 2, R = 4;
  __shared__ float part[R][8][P];
  const int c = threadIdx.x % P, r0 = threadIdx.x / P;
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const T *kp = k + b * k_sb + h * k_sh + 2 * c;
  const T *vp = v + b * v_sb + h * v_sh + 2 * c;
  const int start = blockIdx.x * STAT_ROWS, end = min(start + STAT_ROWS, len);
  float acc[8] = {0.f, 0.f, 0.f, 0.f, -INFINITY, -INFINITY, INFINITY, INFINITY};
  for (int r = start + r0; r < end; r += R) {
    const float2 a = load2(kp + r * k_ss), x = load2(vp + r * v_ss);
    acc[0] += a.x, acc[1] += a.y, acc[2] += x.x, acc[3] += x.y;
    acc[4] = fmaxf(acc[4], x.x), acc[5] = fmaxf(acc[5], x.y);
    acc[6] = fminf(acc[6], x.x), acc[7] = fminf(acc[7], x.y);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) part[r0][i][c] = acc[i];
  __syncthreads();
  if (r0 != 0) return;
#pragma unroll
  for (int r = 1; r < R; ++r) {
    acc[0] += part[r][0][c], acc[1] += part[r][1][c], acc[2] += part[r][2][c];
    acc[3] += part[r][3][c];
    acc[4] = fmaxf(acc[4], part[r][4][c]), acc[5] = fmaxf(acc[5], part[r][5][c]);
    acc[6] = fminf(acc[6], part[r][6][c]), acc[7] = fminf(acc[7], part[r][7][c]);
  }
  float *s = stats + static_cast<long long>(bh) * 4 * D + 2 * c;
  atomicAdd(s, acc[0]), atomicAdd(s + 1, acc[1]);
  atomicAdd(s + D, acc[2]), atomicAdd(s + D + 1, acc[3]);
  atomic_max(s + 2 * D, acc[4]), atomic_max(s + 2 * D + 1, acc[5]);
  atomic_min(s + 3 * D, acc[6]), atomic_min(s + 3 * D + 1, acc[7]);
}

// Keys per scale of the key codes.
constexpr int KEY_BLOCK = 128;

// Loads E = D / 32 consecutive values of a row at p into v (a lane's share of the row).
template <typename T, int E> __device__ __forceinline__ void load_lane(const T *p, float (&v)[E]) {
#pragma unroll
  for (int i = 0; i < E; i += 2) {
    const float2 f = load2(p + i);
    v[i] = f.x, v[i + 1] = f.y;
  }
}

// A lane's E values over `scale` as int8 codes, stored at out.
template <int E> __device__ __forceinline__ void store_codes(const float (&v)[E], float scale,
                                                             int8_t *out) {
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const int q = scale > 0.f ? max(-127, min(127, __float2int_rn(v[i] / scale))) : 0;
    packed |= (static_cast<uint32_t>(q) & 0xffu) << (8 * i);
  }
  if constexpr (E == 4) {
    *reinterpret_cast<uint32_t *>(out) = packed;
  } else {
    *reinterpret_cast<uint16_t *>(out) = static_cast<uint16_t>(packed);
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Rows of q [b, h, len, D] as int8 codes [bh][len][D], one scale each [bh][len]: one warp a row.
// Block 256 threads (8 rows); grid (ceil(len / 8), bh).
template <typename T, int D>
__device__ __forceinline__ void q_kernel(const T *x, int8_t *codes, float *scales, int len,
                                         int heads, long long sb, long long sh, long long ss) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * 8 + threadIdx.x / 32;
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  if (row >= len) return;
  float v[E];
  load_lane<T, E>(x + b * sb + h * sh + row * ss + lane * E, v);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < E; ++i) amax = fmaxf(amax, fabsf(v[i]));
  const float scale = warp_max(amax) / I8_MAX;
  const long long out_row = static_cast<long long>(bh) * len + row;
  store_codes<E>(v, scale, codes + out_row * D + lane * E);
  if (lane == 0) scales[out_row] = scale;
}

// Blocks of KEY_BLOCK rows of k [b, h, len, D] minus the channel means of `stats` as int8 codes
// [bh][len][D] with one scale per block [bh][blocks] (blocks past `len` get scale 0). Block 256
// threads, 8 warps of 16 rows each, the rows held in registers; grid (blocks, bh).
template <typename T, int D>
__device__ __forceinline__ void k_kernel(const T *x, const float *stats, int8_t *codes,
                                         float *scales, int len, int heads, long long sb,
                                         long long sh, long long ss) {
  constexpr int E = D / 32, ROWS = KEY_BLOCK / 8;
  __shared__ float warp_amax[8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int row0 = blockIdx.x * KEY_BLOCK + warp * ROWS;
  const float *sum = stats + static_cast<long long>(bh) * 4 * D + lane * E;
  float mean[E];
#pragma unroll
  for (int i = 0; i < E; ++i) mean[i] = sum[i] / static_cast<float>(len);
  float v[ROWS][E];
  float amax = 0.f;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (row0 + r < len) {
      load_lane<T, E>(x + b * sb + h * sh + (row0 + r) * ss + lane * E, v[r]);
#pragma unroll
      for (int i = 0; i < E; ++i) {
        v[r][i] = v[r][i] - mean[i];
        amax = fmaxf(amax, fabsf(v[r][i]));
      }
    }
  }
  amax = warp_max(amax);
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
  amax = lane < 8 ? warp_amax[lane] : 0.f;
  const float scale = warp_max(amax) / I8_MAX;
  if (threadIdx.x == 0) scales[static_cast<long long>(bh) * gridDim.x + blockIdx.x] = scale;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (row0 + r < len) {
      store_codes<E>(v[r], scale, codes + (static_cast<long long>(bh) * len + row0 + r) * D + lane * E);
    }
  }
}

// v [b, h, len, D] as e4m3 codes of (v - mean) / scale per channel, transposed and permuted:
// vt [bh][D][pad]. Block 256 threads takes BC keys; grid (pad / BC, bh).
template <typename T, int D>
__device__ __forceinline__ void v_kernel(const T *v, const float *stats, uint8_t *vt, int len,
                                         int pad, int heads, long long sb, long long sh,
                                         long long ss) {
  __shared__ float tile[BC][D + 1];
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int k0 = blockIdx.x * BC;
  const float *st = stats + static_cast<long long>(bh) * 4 * D;
  const T *vp = v + b * sb + h * sh;
  for (int i = threadIdx.x; i < BC * D / 2; i += blockDim.x) {
    const int r = i / (D / 2), c = 2 * (i % (D / 2));
    if (k0 + r < len) {
      const float2 x = load2(vp + (k0 + r) * ss + c);
      const float2 m0 = v_channel(st, D, c, len), m1 = v_channel(st, D, c + 1, len);
      tile[r][c] = m0.y > 0.f ? (x.x - m0.x) / m0.y : 0.f;
      tile[r][c + 1] = m1.y > 0.f ? (x.y - m1.x) / m1.y : 0.f;
    } else {
      tile[r][c] = tile[r][c + 1] = 0.f;
    }
  }
  __syncthreads();
  // Item (channel, group of 16, t): positions 4t..4t+3 hold keys 2t, 2t+1, 8+2t, 9+2t.
  for (int i = threadIdx.x; i < D * BC / 4; i += blockDim.x) {
    const int c = i / (BC / 4), q = i % (BC / 4);
    const int g = q / 4, t = q % 4;
    const int key = g * 16 + 2 * t;
    *reinterpret_cast<uint32_t *>(vt + (static_cast<long long>(bh) * D + c) * pad + k0 + 4 * q) =
        e4m3x4(tile[key][c], tile[key + 1][c], tile[key + 8][c], tile[key + 9][c]);
  }
}

// The attention proper. One block takes BR = 16 * MT * 4 query rows of one (batch, head); each
// of its 4 warps owns MT m-tiles of 16 rows.
template <typename T, int D, int MT>
__device__ __forceinline__ void fwd_kernel(const int8_t *__restrict__ qc,
                                           const float *__restrict__ qs,
                                           const int8_t *__restrict__ kc,
                                           const float *__restrict__ ks,
                                           const uint8_t *__restrict__ vt,
                                           const float *__restrict__ stats, T *__restrict__ o,
                                           int q_len, int kv_len, int pad, int heads,
                                           long long o_sb, long long o_sh, long long o_ss,
                                           float scale_log2) {
  constexpr int NW = 4, BR = 16 * MT * NW, NT = 32 * NW;
  constexpr int QS = D + ROW_PAD;   // bytes per query/key row in shared memory
  constexpr int VS = BC + ROW_PAD;  // bytes per transposed value row
  constexpr int CH = D / 16;        // 16-byte chunks per query/key row

  extern __shared__ __align__(16) unsigned char smem[];
  uint8_t *sQ = smem;                                         // [BR][QS]
  uint8_t *sK = sQ + BR * QS;                                 // [2][BC][QS]
  uint8_t *sV = sK + 2 * BC * QS;                             // [2][D][VS]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int q0 = blockIdx.x * BR;
  const int wrow = warp * 16 * MT;
  const int8_t *qp = qc + static_cast<long long>(bh) * q_len * D;
  const int8_t *kp = kc + static_cast<long long>(bh) * kv_len * D;
  const float *ksp = ks + static_cast<long long>(bh) * (pad / KEY_BLOCK);
  const uint8_t *vp = vt + static_cast<long long>(bh) * D * pad;
  const float *st = stats + static_cast<long long>(bh) * 4 * D;

#pragma unroll
  for (int c = tid; c < BR * CH; c += NT) {
    const int r = c / CH, col = (c % CH) * 16;
    const bool ok = q0 + r < q_len;
    cp_async16(smem_addr(sQ + r * QS + col), qp + static_cast<long long>(ok ? q0 + r : 0) * D + col,
               ok ? 16 : 0);
  }
  auto load_kv = [&](int tile, int buf) {
    const int k0 = tile * BC;
#pragma unroll
    for (int c = tid; c < BC * CH; c += NT) {
      const int r = c / CH, col = (c % CH) * 16;
      const bool ok = k0 + r < kv_len;
      cp_async16(smem_addr(sK + (buf * BC + r) * QS + col),
                 kp + static_cast<long long>(ok ? k0 + r : 0) * D + col, ok ? 16 : 0);
    }
#pragma unroll
    for (int c = tid; c < D * (BC / 16); c += NT) {
      const int d = c / (BC / 16), col = (c % (BC / 16)) * 16;
      cp_async16(smem_addr(sV + (buf * D + d) * VS + col),
                 vp + static_cast<long long>(d) * pad + k0 + col, 16);
    }
  };
  load_kv(0, 0);
  cp_async_commit();

  // Each thread's rows lane/4 and lane/4 + 8 of each m-tile: their scales times scale_log2.
  float q_scale[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = q0 + wrow + mt * 16 + lane / 4 + hf * 8;
      q_scale[mt][hf] =
          row < q_len ? qs[static_cast<long long>(bh) * q_len + row] * scale_log2 : 0.f;
    }
  }

  const int n_tiles = (kv_len + BC - 1) / BC;
  float acc[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int d = 0; d < D / 8; ++d) acc[mt][d][0] = acc[mt][d][1] = acc[mt][d][2] = acc[mt][d][3] = 0.f;
  }
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m_run[mt][0] = m_run[mt][1] = -INFINITY;
    l_run[mt][0] = l_run[mt][1] = 0.f;
  }

  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < n_tiles) load_kv(j + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const float k_scale = ksp[j * BC / KEY_BLOCK];

    // Integer scores of this warp's rows against the tile's keys.
    int si[MT][BC / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) si[mt][n][0] = si[mt][n][1] = si[mt][n][2] = si[mt][n][3] = 0;
    }
    const uint8_t *sKb = sK + buf * BC * QS;
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int row = wrow + mt * 16 + lane % 16;
        ldsm_x4(qa[mt], smem_addr(sQ + row * QS + kk * 32 + (lane / 16) * 16));
      }
#pragma unroll
      for (int np = 0; np < BC / 16; ++np) {
        const int mi = lane / 8;
        const int key = np * 16 + (mi / 2) * 8 + lane % 8;
        uint32_t kb[4];
        ldsm_x4(kb, smem_addr(sKb + key * QS + kk * 32 + (mi % 2) * 16));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_s8(si[mt][2 * np], qa[mt], kb[0], kb[1]);
          mma_s8(si[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }

    // Online softmax in f32 on the raw sums: as floats (MAGIC_INT added), the scores are
    // s = (raw - MAGIC_FLOAT) * a with a = the row's scale times the key block's, so the max is
    // taken on raw and 448 p = 2^(raw * a - (MAGIC_FLOAT * a + max - log2 448)), one fma.
    // Every tile holds at least one valid key, so the new max is finite.
    float s[MT][BC / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = __int_as_float(si[mt][n][e] + MAGIC_INT);
      }
    }
    // `partial` (the last tile, keys past the end masked) is a constant where it is called: the
    // other tiles carry no per-key test.
    float alpha[MT][2];
    auto softmax_tile = [&](bool partial) {
      auto masked = [&](int n, int e) { return j * BC + n * 8 + 2 * (lane % 4) + (e & 1) >= kv_len; };
      if (partial) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int n = 0; n < BC / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (masked(n, e)) s[mt][n][e] = -INFINITY;
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * hf], s[mt][n][2 * hf + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float a = q_scale[mt][hf] * k_scale;
          const float m_new = fmaxf(m_run[mt][hf], (mx - MAGIC_FLOAT) * a);
          alpha[mt][hf] = ex2(m_run[mt][hf] - m_new);
          m_run[mt][hf] = m_new;
          const float bias = fmaf(MAGIC_FLOAT, a, m_new - LOG2_E4M3_MAX);
#pragma unroll
          for (int n = 0; n < BC / 8; ++n) {
#pragma unroll
            for (int e = 2 * hf; e < 2 * hf + 2; ++e) {
              float p = ex2(fmaf(s[mt][n][e], a, -bias));
              // -inf times a zero scale is NaN: masked keys get 0 outright.
              if (partial && masked(n, e)) p = 0.f;
              s[mt][n][e] = p;
            }
          }
        }
      }
    };
    if ((j + 1) * BC > kv_len) {
      softmax_tile(true);
    } else {
      softmax_tile(false);
    }

    // P as e4m3 A operands, 32 keys per step, in V's permuted key order.
    uint32_t pa[MT][BC / 32][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int kk = 0; kk < BC / 32; ++kk) {
        const int n = 4 * kk;
        pa[mt][kk][0] = e4m3x4(s[mt][n][0], s[mt][n][1], s[mt][n + 1][0], s[mt][n + 1][1]);
        pa[mt][kk][1] = e4m3x4(s[mt][n][2], s[mt][n][3], s[mt][n + 1][2], s[mt][n + 1][3]);
        pa[mt][kk][2] = e4m3x4(s[mt][n + 2][0], s[mt][n + 2][1], s[mt][n + 3][0], s[mt][n + 3][1]);
        pa[mt][kk][3] = e4m3x4(s[mt][n + 2][2], s[mt][n + 2][3], s[mt][n + 3][2], s[mt][n + 3][3]);
      }
    }

    // acc = acc * alpha + P V: each tile's sums apart first.
    const uint8_t *sVb = sV + buf * D * VS;
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      float t[MT][2][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int x = 0; x < 2; ++x) t[mt][x][0] = t[mt][x][1] = t[mt][x][2] = t[mt][x][3] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < BC / 32; ++kk) {
        const int mi = lane / 8;
        const int d = dp * 16 + (mi / 2) * 8 + lane % 8;
        uint32_t vb[4];
        ldsm_x4(vb, smem_addr(sVb + d * VS + kk * 32 + (mi % 2) * 16));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_e4m3(t[mt][0], pa[mt][kk], vb[0], vb[1]);
          mma_e4m3(t[mt][1], pa[mt][kk], vb[2], vb[3]);
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int x = 0; x < 2; ++x) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            acc[mt][2 * dp + x][e] = fmaf(acc[mt][2 * dp + x][e], alpha[mt][e / 2], t[mt][x][e]);
          }
        }
      }
    }
    // The rows' sums of P's codes: P times e4m3 ones (0x38) in every column of the B operand.
    float ones[MT][4] = {};
#pragma unroll
    for (int kk = 0; kk < BC / 32; ++kk) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_e4m3(ones[mt], pa[mt][kk], 0x38383838u, 0x38383838u);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        l_run[mt][hf] = fmaf(l_run[mt][hf], alpha[mt][hf], ones[mt][2 * hf]);
      }
    }
    __syncthreads();
  }

  T *op = o + b * o_sb + h * o_sh;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float inv = 1.f / l_run[mt][hf];  // l sums the codes of 448 p
      const int row = q0 + wrow + mt * 16 + lane / 4 + hf * 8;
      if (row < q_len) {
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
          const int col = d * 8 + 2 * (lane % 4);
          const float2 c0 = v_channel(st, D, col, kv_len), c1 = v_channel(st, D, col + 1, kv_len);
          *reinterpret_cast<uint32_t *>(op + row * o_ss + col) =
              pack2(acc[mt][d][2 * hf] * inv * c0.y + c0.x,
                    acc[mt][d][2 * hf + 1] * inv * c1.y + c1.x, T());
        }
      }
    }
  }
}

}  // namespace

extern "C" __global__ void sage_stats_init(float *stats, int bh, int d) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= bh * 4 * d) return;
  const int part = (i / d) % 4;
  stats[i] = part < 2 ? 0.f : (part == 2 ? -INFINITY : INFINITY);
}

// Kernels are named sage_<step>_<dtype>_d<head_dim>[_m<MT>]. Two m-tiles a warp reuse each key
// and value fragment twice; one (64 rows a block) holds half the accumulators.
#define SAGE_FWD(TN, T, D, MT)                                                                 \
  extern "C" __global__ void __launch_bounds__(128)                                            \
      sage_fwd_##TN##_d##D##_m##MT(const int8_t *qc, const float *qs, const int8_t *kc,        \
                                   const float *ks, const uint8_t *vt, const float *stats,     \
                                   T *o, int q_len, int kv_len, int pad, int heads,            \
                                   long long o_sb, long long o_sh, long long o_ss,             \
                                   float scale_log2) {                                         \
    fwd_kernel<T, D, MT>(qc, qs, kc, ks, vt, stats, o, q_len, kv_len, pad, heads, o_sb, o_sh,  \
                         o_ss, scale_log2);                                                    \
  }

#define SAGE_KERNELS(TN, T, D)                                                                 \
  extern "C" __global__ void __launch_bounds__(D * 2)                                          \
      sage_stats_##TN##_d##D(const T *k, const T *v, float *stats, int len, int heads,        \
                             long long k_sb, long long k_sh, long long k_ss, long long v_sb,   \
                             long long v_sh, long long v_ss) {                                 \
    stats_kernel<T, D>(k, v, stats, len, heads, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss);           \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(256)                                            \
      sage_q_##TN##_d##D(const T *x, int8_t *codes, float *scales, int len, int heads,         \
                         long long sb, long long sh, long long ss) {                           \
    q_kernel<T, D>(x, codes, scales, len, heads, sb, sh, ss);                                  \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(256)                                            \
      sage_k_##TN##_d##D(const T *x, const float *stats, int8_t *codes, float *scales,         \
                         int len, int heads, long long sb, long long sh, long long ss) {       \
    k_kernel<T, D>(x, stats, codes, scales, len, heads, sb, sh, ss);                           \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(256)                                            \
      sage_v_##TN##_d##D(const T *v, const float *stats, uint8_t *vt, int len, int pad,        \
                         int heads, long long sb, long long sh, long long ss) {                \
    v_kernel<T, D>(v, stats, vt, len, pad, heads, sb, sh, ss);                                 \
  }                                                                                            \
  SAGE_FWD(TN, T, D, 1)                                                                        \
  SAGE_FWD(TN, T, D, 2)

SAGE_KERNELS(bf16, __nv_bfloat16, 64)
SAGE_KERNELS(bf16, __nv_bfloat16, 128)
SAGE_KERNELS(f16, __half, 64)
SAGE_KERNELS(f16, __half, 128)
