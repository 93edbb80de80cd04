// 8-bit attention for Hopper (sm_90a only; built and loaded on compute capability 9.0 alone, beside
// the portable kernel of sage_attn.cu, whose preparation launches make its inputs): the
// FlashAttention-3 loop of flash_attn_sm90.cu on wgmma's 8-bit products.
//
// One block takes 128 query rows of one (batch, head) at head_dim 128: a producer warpgroup loads
// the query codes once and each 128-key tile of key codes and of transposed value codes with TMA
// (one 128-byte swizzled box of 128 x 128 bytes each) into four stages, keys and values by threads
// of two warps (two stages from one thread ran 3% slower on an H100, bench/RESULTS.md session 48);
// two consumer warpgroups of 64 rows each compute S = Q K^T on wgmma m64n128k32 s8 (exact int32
// sums), scale it by both tokens' scales, run the online softmax in f32, and add P V on wgmma
// m64n136k32 e4m3 with P from registers
// (times 448, in the value codes' permuted key order, see sage_attn.cu), each tile's product summed
// apart and then added to the f32 accumulators. Eight rows of e4m3 ones after each stage of value
// codes make columns 128-135 of P V the rows' sums of P's codes, the softmax's denominator, on the
// tensor core rather than in 64 adds per thread and tile. The P V of tile j-1 runs while tile j's softmax is
// computed, and the two warpgroups take turns issuing their products.
// Inputs: int8 codes of q [bh][q_len][128] and k [bh][kv_len][128], e4m3 value codes
// [bh][128][pad] (pad a multiple of 128), f32 scales of q's rows [bh][q_len] and of k's blocks of
// 128 keys [bh][pad / 128], the
// channel statistics [bh][4][128]. Output [batch, q_len, heads, 128] at the given element strides.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

#include "hopper.cuh"
#include "sage.cuh"

constexpr int D = 128;                 // head_dim, bytes per code row
constexpr int BM = 128;                // query rows per block
constexpr int BN = 128;                // keys per tile
constexpr int STAGES = 4;              // key and value tiles in flight
constexpr int TILE = 128 * 128;        // one tile of codes: a 128 x 128-byte TMA box
constexpr int V_STAGE = TILE + 1024;   // a stage of value codes and the 8 rows of ones after it
constexpr int CONSUMER_WARPS = 8;      // arrivals that free a stage
// S (64 x 128, s32) (+)= A (64 x 32 int8, shared) * B (32 x 128 int8, shared, K-major).
__device__ __forceinline__ void wgmma_s8(uint32_t (&d)[64], uint64_t a, uint64_t b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
      ACCUMULATOR_REGISTERS
      "%64, %65, p;\n}\n"
      : ACCUMULATORS("+r", d)
      : "l"(a), "l"(b), "r"(scale_d));
}

// D (64 x 136, f32) (+)= A (64 x 32 e4m3, registers) * B (32 x 136 e4m3, shared, K-major).
__device__ __forceinline__ void wgmma_e4m3(float (&d)[68], const uint32_t (&a)[4], uint64_t b,
                                           int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %73, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 "
      ACCUMULATOR_REGISTERS_68
      "{%68, %69, %70, %71}, %72, p, 1, 1;\n}\n"
      : ACCUMULATORS_68("+f", d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

template <typename T>
__device__ __forceinline__ void sage_sm90(const CUtensorMap &q_map, const CUtensorMap &k_map,
                                          const CUtensorMap &v_map, const float *q_scales,
                                          const float *k_scales, const float *stats, T *out,
                                          int q_len, int kv_len, int pad, int heads,
                                          long long out_batch, long long out_row,
                                          long long out_head, float scale_log2) {
  extern __shared__ uint8_t raw[];
  __shared__ __align__(8) Barriers<STAGES> bars;
  const uint32_t base = (smem_addr(raw) + 1023) & ~1023u;  // swizzled boxes need 1024-byte alignment
  const uint32_t sq = base, sk = base + TILE, sv = base + TILE * (1 + STAGES);
  const int q_tile = blockIdx.x, bh = blockIdx.y;
  const int tiles = (kv_len + BN - 1) / BN;
  // Broadcast from lane 0, so the compiler knows it is warp-uniform and keeps what derives from
  // it (the descriptors) in uniform registers: 17 fewer instructions per tile.
  const int wg = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
  if (wg == 0) {
    // The ones after each value stage (e4m3 1.0 is 0x38), then made visible to the tensor cores.
    for (int i = threadIdx.x; i < STAGES * 64; i += 128) {
      asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(
                       sv + (i / 64) * V_STAGE + TILE + (i % 64) * 16),
                   "r"(0x38383838u)
                   : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  bars.init(CONSUMER_WARPS);

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    // Keys and values are loaded by threads of two warps, so a key tile never waits behind a
    // value stage still in use (values are consumed a tile later than keys).
    if (threadIdx.x == 0) {
      mbar_expect_tx(bars.q(), TILE);
      tma_load(sq, &q_map, bars.q(), 0, q_tile * BM, bh, 0);
      for (int j = 0; j < tiles; ++j) {
        const int s = j % STAGES;
        mbar_wait(bars.empty_k(s), ((j / STAGES) & 1) ^ 1);
        mbar_expect_tx(bars.full_k(s), TILE);
        tma_load(sk + s * TILE, &k_map, bars.full_k(s), 0, j * BN, bh, 0);
      }
    } else if (threadIdx.x == 32) {
      for (int j = 0; j < tiles; ++j) {
        const int s = j % STAGES;
        mbar_wait(bars.empty_v(s), ((j / STAGES) & 1) ^ 1);
        mbar_expect_tx(bars.full_v(s), TILE);
        tma_load(sv + s * V_STAGE, &v_map, bars.full_v(s), j * BN, 0, bh, 0);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int consumer = wg - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const bool warp_leader = lane == 0;
  // Scores: int32 sums from the product, then f32 (their bits) in place. `part` holds a tile's
  // P V and, in 64-67, its rows' sums of P's codes.
  uint32_t s[64], p[16];
  float o[64], part[68];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  const int row0 = q_tile * BM + consumer * 64 + warp * 16 + g;
  // The thread's two rows (g and g + 8 of its warp's 16): scales times scale_log2, statistics.
  float q_scale[2], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f},
                    correction[2] = {1.f, 1.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    q_scale[r] = row < q_len ? q_scales[static_cast<long long>(bh) * q_len + row] * scale_log2 : 0.f;
  }
  const float *k_scale = k_scales + static_cast<long long>(bh) * (pad / BN);

  // Descriptors count shared memory in 16 bytes: a stage or a 32-byte step is an add to the
  // first (rebuilding each one per tile took ~60 instructions per tile and thread).
  const uint64_t q_desc = smem_desc(sq + consumer * 64 * 128, 16, 1024);
  const uint64_t k_desc = smem_desc(sk, 16, 1024), v_desc = smem_desc(sv, 16, 1024);
  // S = Q K^T over head_dim in 4 steps of 32 bytes within the 128-byte swizzled rows.
  auto scores = [&](int stage) {
    const uint64_t b = k_desc + stage * (TILE / 16);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_s8(s, q_desc + 2 * kk, b + 2 * kk, kk > 0);
    wgmma_commit();
  };
  // part = P V over the tile's keys in 4 steps of 32 (value codes K-major: keys contiguous).
  auto values = [&](int stage) {
    const uint64_t b = v_desc + stage * (V_STAGE / 16);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t a[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
      wgmma_e4m3(part, a, b + 2 * kk, kk > 0);
    }
    wgmma_commit();
  };
  // Online softmax of tile j's scores, in place. As floats (MAGIC_INT added), the raw sums give
  // the scores s = (raw - MAGIC_FLOAT) * a, a the row's scale times the key block's `ks`: the max
  // is taken on raw, and 448 p = 2^(raw * a - (MAGIC_FLOAT * a + max - log2 448)) is one fma. The
  // rescale of O the new maxima ask for goes to `correction`.
  // `partial` (the last tile, keys past the end masked) is a constant where it is called: the
  // other tiles carry no per-key test.
  auto softmax_tile = [&](int j, float ks, bool partial) {
    auto masked = [&](int i) { return j * BN + 8 * (i / 4) + 2 * t + (i % 2) >= kv_len; };
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      s[i] = __float_as_uint(__int_as_float(static_cast<int>(s[i]) + MAGIC_INT));
      if (partial && masked(i)) s[i] = __float_as_uint(-INFINITY);
    }
    // Both rows at once, each reduced over four partial maxima (a chain of 32 dependent
    // operations per row kept the two warps per scheduler waiting).
    float m[2][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float pair =
            fmaxf(__uint_as_float(s[4 * i + 2 * r]), __uint_as_float(s[4 * i + 2 * r + 1]));
        m[r][i % 4] = i < 4 ? pair : fmaxf(m[r][i % 4], pair);
      }
    }
    float mx[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) mx[r] = fmaxf(fmaxf(m[r][0], m[r][1]), fmaxf(m[r][2], m[r][3]));
#pragma unroll
    for (int r = 0; r < 2; ++r) mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
#pragma unroll
    for (int r = 0; r < 2; ++r) mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
    float a[2], bias[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      a[r] = q_scale[r] * ks;
      const float m_new = fmaxf(row_max[r], (mx[r] - MAGIC_FLOAT) * a[r]);
      correction[r] = exp2_approx(row_max[r] - m_new);
      row_max[r] = m_new;
      bias[r] = fmaf(MAGIC_FLOAT, a[r], m_new - LOG2_E4M3_MAX);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int k = 4 * i + 2 * r + e;
          float y = exp2_approx(fmaf(__uint_as_float(s[k]), a[r], -bias[r]));
          // -inf times a zero scale is NaN: masked keys get 0 outright.
          if (partial && masked(k)) y = 0.f;
          s[k] = __float_as_uint(y);
        }
      }
    }
  };
  auto softmax = [&](int j, float ks) {
    if ((j + 1) * BN > kv_len) {
      softmax_tile(j, ks, true);
    } else {
      softmax_tile(j, ks, false);
    }
  };
  // O = O * c + P V of the last tile, c its maxima's correction; the same for the row sums.
  auto accumulate = [&](const float (&c)[2]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = fmaf(o[i], c[(i / 2) % 2], part[i]);
#pragma unroll
    for (int r = 0; r < 2; ++r) row_sum[r] = fmaf(row_sum[r], c[r], part[64 + 2 * r]);
  };
  // P as e4m3 A operands: step kk's registers hold n-tiles 4kk..4kk+3 in the value codes' order.
  auto to_p = [&]() {
    auto f = [&](int i, int r, int e) { return __uint_as_float(s[4 * i + 2 * r + e]); };
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int n = 4 * kk;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        p[4 * kk + r] = e4m3x4(f(n, r, 0), f(n, r, 1), f(n + 1, r, 0), f(n + 1, r, 1));
        p[4 * kk + 2 + r] = e4m3x4(f(n + 2, r, 0), f(n + 2, r, 1), f(n + 3, r, 0), f(n + 3, r, 1));
      }
    }
  };
  auto release = [&](uint32_t bar) {
    if (warp_leader) mbar_arrive(bar);
  };

  // Tile j's Q K^T and tile j-1's P V are issued in one turn, and tile j's softmax is computed
  // while P V runs (session 28 measured this 5-7% faster than issuing them one at a time, with or
  // without turns).
  if (consumer == 1) turn_pass(1);  // warpgroup 1 issues first
  float ks = k_scale[0];
  mbar_wait(bars.q(), 0);
  mbar_wait(bars.full_k(0), 0);
  turn_wait(consumer);
  wgmma_fence();
  scores(0);
  turn_pass(consumer);
  wgmma_wait<0>();
  release(bars.empty_k(0));
  softmax(0, ks);
  to_p();
  for (int j = 1; j < tiles; ++j) {
    const int s_now = j % STAGES, s_prev = (j - 1) % STAGES;
    ks = k_scale[j];  // read early: used after this tile's Q K^T
    const float c[2] = {correction[0], correction[1]};
    mbar_wait(bars.full_k(s_now), (j / STAGES) & 1);
    turn_wait(consumer);
    wgmma_fence();
    scores(s_now);
    mbar_wait(bars.full_v(s_prev), ((j - 1) / STAGES) & 1);
    values(s_prev);
    turn_pass(consumer);
    wgmma_wait<1>();
    release(bars.empty_k(s_now));
    softmax(j, ks);
    wgmma_wait<0>();
    release(bars.empty_v(s_prev));
    accumulate(c);
    to_p();
  }
  const int s_last = (tiles - 1) % STAGES;
  const float c[2] = {correction[0], correction[1]};
  mbar_wait(bars.full_v(s_last), ((tiles - 1) / STAGES) & 1);
  turn_wait(consumer);
  wgmma_fence();
  values(s_last);
  turn_pass(consumer);
  wgmma_wait<0>();
  release(bars.empty_v(s_last));
  accumulate(c);

  const float *st = stats + static_cast<long long>(bh) * 4 * D;
  const int batch = bh / heads, head = bh % heads;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float inv = 1.f / row_sum[r];
    const int row = row0 + 8 * r;
    if (row >= q_len) continue;
    T *dst = out + batch * out_batch + row * out_row + head * out_head + 2 * t;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int col = 8 * i + 2 * t;
      const float2 c0 = v_channel(st, D, col, kv_len), c1 = v_channel(st, D, col + 1, kv_len);
      *reinterpret_cast<uint32_t *>(dst + 8 * i) =
          pack2(o[4 * i + 2 * r] * inv * c0.y + c0.x, o[4 * i + 2 * r + 1] * inv * c1.y + c1.x, T());
    }
  }
}

}  // namespace

#define SAGE_SM90(TN, T)                                                                       \
  extern "C" __global__ void __launch_bounds__(384, 1) sage_fwd_sm90_##TN##_d128(              \
      const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,    \
      const __grid_constant__ CUtensorMap v_map, const float *q_scales, const float *k_scales, \
      const float *stats, T *out, int q_len, int kv_len, int pad, int heads,                   \
      long long out_batch, long long out_row, long long out_head, float scale_log2) {          \
    sage_sm90<T>(q_map, k_map, v_map, q_scales, k_scales, stats, out, q_len, kv_len, pad,      \
                 heads, out_batch, out_row, out_head, scale_log2);                             \
  }

SAGE_SM90(bf16, __nv_bfloat16)
SAGE_SM90(f16, __half)
