// Fused attention forward for Hopper (sm_90a only; built and loaded on compute capability 9.0
// alone, beside the portable kernel of flash_attn.cu): the FlashAttention-3 scheme.
//
// One block takes 128 query rows of one (batch, head) at head_dim 128, bf16, in three warpgroups
// (a smaller head_dim, a multiple of 8, runs in tiles of 128 columns: TMA fills the columns past
// it with zeros; the kernel built for 64, 96 or 128 columns, the narrowest that covers it, runs
// both products over that many, and at 64 loads only the first 64):
// - warpgroup 0 is the producer: one thread loads the query tile once and then each 128-key tile
//   of keys and of values with TMA (128-byte swizzled boxes of 64 columns) into two stages of
//   shared memory, each guarded by a full and an empty mbarrier;
// - warpgroups 1 and 2 each own 64 query rows. S = Q K^T and O += P V run on wgmma
//   (m64n128k16 and m64nVk16, f32 accumulators; Q, K and V from shared memory, P from registers), the softmax
//   online in f32 on the registers. The P V of tile j-1 runs while the softmax of tile j is
//   computed, and the two warpgroups take turns issuing their matrix products (named barriers),
//   so one's softmax overlaps the other's products.
// Inputs [batch, heads, seq, head_dim] of any strides TMA takes (16-byte multiples); rows past the
// ends are zero-filled by TMA and masked (keys) or not stored (queries). Output
// [batch, q_len, heads, head_dim] at the given element strides.

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int D = 128;                // head_dim
constexpr int BM = 128;               // query rows per block
constexpr int BN = 128;               // keys per tile
constexpr int STAGES = 2;             // key and value tiles in flight
constexpr int BOX = 128 * 64 * 2;     // one TMA box: 128 rows x 64 columns, bytes
constexpr int TILE = 2 * BOX;         // a 128 x 128 tile: two boxes side by side
constexpr int CONSUMER_WARPS = 8;     // arrivals that free a stage
static_assert(TILE == BN * D * 2 && BM == BN, "query, key and value tiles are alike");

#include "hopper.cuh"

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}

// D (64 x 128, f32) (+)= A (64 x 16, shared) * B (16 x 128, shared, K-major); scale_d 0 zeroes D.
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      ACCUMULATOR_REGISTERS
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : ACCUMULATORS("+f", d)
      : "l"(a), "l"(b), "r"(scale_d));
}

// D (64 x N, f32) += A (64 x 16, registers) * B (16 x N, shared, MN-major), N = 128, 96 or 64
// (the accumulator array's size, N / 2, picks the instruction); the operands after the
// accumulators are numbered A0-A3 (A's registers), B (its descriptor) and P (the scale flag).
#define WGMMA_RS(N, REGISTERS, BOUND, A0, A1, A2, A3, B, P)                                       \
  __device__ __forceinline__ void wgmma_rs(float(&d)[N / 2], const uint32_t(&a)[4], uint64_t b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n"                                  \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 " REGISTERS             \
                 "{" A0 ", " A1 ", " A2 ", " A3 "}, " B ", p, 1, 1, 1;\n}\n"                      \
                 : BOUND("+f", d)                                                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                  \
  }
WGMMA_RS(128, ACCUMULATOR_REGISTERS, ACCUMULATORS, "%64", "%65", "%66", "%67", "%68", "%69")
WGMMA_RS(96, ACCUMULATOR_REGISTERS_48, ACCUMULATORS_48, "%48", "%49", "%50", "%51", "%52", "%53")
WGMMA_RS(64, ACCUMULATOR_REGISTERS_32, ACCUMULATORS_32, "%32", "%33", "%34", "%35", "%36", "%37")

} // namespace

// The kernel computing NV output columns (head_dim <= NV).
template <int NV>
__device__ __forceinline__ void
flash_fwd(const CUtensorMap *q_map, const CUtensorMap *k_map, const CUtensorMap *v_map,
          __nv_bfloat16 *out, int q_len, int kv_len, long long out_batch, long long out_row,
          long long out_head, int head_dim, float scale_log2) {
  static_assert(NV == 64 || NV == 96 || NV == 128, "an m64nNVk16 product");
  // The 64-column boxes of each tile loaded: the second only where columns past 64 are read.
  constexpr int BOXES = NV > 64 ? 2 : 1;
  extern __shared__ uint8_t raw[];
  __shared__ __align__(8) Barriers<STAGES> bars;
  const uint32_t base = (smem_addr(raw) + 1023) & ~1023u; // swizzled boxes need 1024-byte alignment
  const uint32_t sq = base, sk = base + TILE, sv = base + TILE * (1 + STAGES);
  const int q_tile = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int tiles = (kv_len + BN - 1) / BN;
  const int wg = threadIdx.x / 128;
  bars.init(CONSUMER_WARPS);

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (threadIdx.x == 0) {
      mbar_expect_tx(bars.q(), BOXES * BOX);
      for (int x = 0; x < BOXES; ++x)
        tma_load(sq + x * BOX, q_map, bars.q(), 64 * x, q_tile * BM, head, batch);
      for (int j = 0; j < tiles; ++j) {
        const int s = j % STAGES;
        const uint32_t phase = (j / STAGES) & 1;
        mbar_wait(bars.empty_k(s), phase ^ 1);
        mbar_expect_tx(bars.full_k(s), BOXES * BOX);
        for (int x = 0; x < BOXES; ++x)
          tma_load(sk + s * TILE + x * BOX, k_map, bars.full_k(s), 64 * x, j * BN, head, batch);
        mbar_wait(bars.empty_v(s), phase ^ 1);
        mbar_expect_tx(bars.full_v(s), BOXES * BOX);
        for (int x = 0; x < BOXES; ++x)
          tma_load(sv + s * TILE + x * BOX, v_map, bars.full_v(s), 64 * x, j * BN, head, batch);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int consumer = wg - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const bool warp_leader = lane == 0;
  float o[NV / 2], s[64];
  uint32_t p[32];
#pragma unroll
  for (int i = 0; i < NV / 2; ++i) o[i] = 0.f;
  // Row statistics of the thread's two rows (g and g + 8 of its warp's 16).
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f}, correction[2] = {1.f, 1.f};

  // S = Q K^T over the NV columns in steps of 16 (32 bytes within a 128-byte swizzled row; the
  // zero-filled columns past head_dim add exact zeros).
  auto scores = [&](int stage) {
#pragma unroll
    for (int kk = 0; kk < NV / 16; ++kk) {
      const uint32_t col = (kk / 4) * BOX + (kk % 4) * 32;
      const uint64_t a = smem_desc(sq + consumer * 64 * 128 + col, 16, 1024);
      const uint64_t b = smem_desc(sk + stage * TILE + col, 16, 1024);
      wgmma_ss(s, a, b, kk > 0);
    }
    wgmma_commit();
  };
  // O += P V over the tile's keys in 8 steps of 16 rows; V is MN-major (head_dim contiguous),
  // its NV columns read across the tile's boxes.
  auto values = [&](int stage) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const uint32_t a[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
      wgmma_rs(o, a, smem_desc(sv + stage * TILE + kk * 16 * 128, BOX, 1024));
    }
    wgmma_commit();
  };
  // Online softmax of tile j's scores, in place: exponentials in `s`, the rescale of O the new
  // maxima ask for in `correction` (applied before the next P V).
  auto softmax = [&](int j) {
    if ((j + 1) * BN > kv_len) {
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        const int key = j * BN + 8 * (i / 4) + 2 * t + (i % 2);
        if (key >= kv_len) s[i] = -INFINITY;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int i = 0; i < 16; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      correction[r] = exp2_approx((row_max[r] - mx) * scale_log2);
      row_max[r] = mx;
      const float shift = mx * scale_log2;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float &x = s[4 * i + 2 * r + e];
          x = exp2_approx(fmaf(x, scale_log2, -shift));
          sum += x;
        }
      }
      row_sum[r] = row_sum[r] * correction[r] + sum;
    }
  };
  auto rescale = [&]() {
#pragma unroll
    for (int i = 0; i < NV / 2; ++i) o[i] *= correction[(i / 2) % 2];
  };
  auto to_p = [&]() {
#pragma unroll
    for (int i = 0; i < 32; ++i) p[i] = pack_bf16(s[2 * i], s[2 * i + 1]);
  };
  auto release = [&](uint32_t bar) {
    if (warp_leader) mbar_arrive(bar);
  };

  if (consumer == 1) turn_pass(1); // warpgroup 1 issues first
  mbar_wait(bars.q(), 0);
  mbar_wait(bars.full_k(0), 0);
  turn_wait(consumer);
  wgmma_fence();
  scores(0);
  turn_pass(consumer);
  wgmma_wait<0>();
  release(bars.empty_k(0));
  softmax(0);
  to_p();
  for (int j = 1; j < tiles; ++j) {
    const int s_now = j % STAGES, s_prev = (j - 1) % STAGES;
    mbar_wait(bars.full_k(s_now), (j / STAGES) & 1);
    turn_wait(consumer);
    wgmma_fence();
    scores(s_now);
    rescale();
    mbar_wait(bars.full_v(s_prev), ((j - 1) / STAGES) & 1);
    wgmma_fence();
    values(s_prev);
    turn_pass(consumer);
    wgmma_wait<1>();
    release(bars.empty_k(s_now));
    softmax(j);
    wgmma_wait<0>();
    release(bars.empty_v(s_prev));
    to_p();
  }
  const int s_last = (tiles - 1) % STAGES;
  rescale();
  mbar_wait(bars.full_v(s_last), ((tiles - 1) / STAGES) & 1);
  turn_wait(consumer);
  wgmma_fence();
  values(s_last);
  turn_pass(consumer);
  wgmma_wait<0>();
  release(bars.empty_v(s_last));

  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    inv[r] = 1.f / sum;
  }
  const int row0 = q_tile * BM + consumer * 64 + warp * 16 + g;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    if (row >= q_len) continue;
    __nv_bfloat16 *dst = out + batch * out_batch + row * out_row + head * out_head + 2 * t;
#pragma unroll
    for (int i = 0; i < NV / 8; ++i) {
      if (8 * i >= head_dim) break;
      *reinterpret_cast<uint32_t *>(dst + 8 * i) =
          pack_bf16(o[4 * i + 2 * r] * inv[r], o[4 * i + 2 * r + 1] * inv[r]);
    }
  }
}

#define FLASH_FWD(NV)                                                                             \
  extern "C" __global__ void __launch_bounds__(384, 1) flash_fwd_sm90_bf16_d##NV(               \
      const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,     \
      const __grid_constant__ CUtensorMap v_map, __nv_bfloat16 *out, int q_len, int kv_len,     \
      long long out_batch, long long out_row, long long out_head, int head_dim,                 \
      float scale_log2) {                                                                       \
    flash_fwd<NV>(&q_map, &k_map, &v_map, out, q_len, kv_len, out_batch, out_row, out_head,     \
                  head_dim, scale_log2);                                                        \
  }
FLASH_FWD(64)
FLASH_FWD(96)
FLASH_FWD(128)
