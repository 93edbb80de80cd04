// The fp8 Linear for Hopper (sm_90a only; built and loaded on compute capability 9.0 alone, beside
// cuBLASLt's product, which every other GPU takes): y = act(acc * s_x[row] * s_w[col] + bias[col])
// rounded to bf16 once, acc the f32 sum of the e4m3 codes' products x [rows, k] . w [n, k] (both
// K-major), the whole Linear of fp8.rs's definition in one kernel. cuBLASLt has one fp8 kernel with
// per-row and per-column scales (128 x 128 tiles, no cluster), and it slows by 13-17% when its
// epilogue adds a bias (bench/RESULTS.md, session 51).
//
// A persistent block per SM walks output tiles of 128 rows x 256 columns, in groups of 8 row tiles
// (the blocks running at once share their operands in L2). One producer thread loads 128-byte
// slices of K of both operands with TMA (128-byte swizzled boxes: 128 rows of x, 256 of w) into
// three stages; two consumer warpgroups of 64 rows each run wgmma m64n256k32 e4m3 from shared
// memory, then the epilogue from their accumulators into shared memory, which TMA stores while
// the next tile's products run (the producer fills its stages meanwhile). Rows, columns and K past
// the ends read as zeros and are not stored (TMA).

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

#include "hopper.cuh"

constexpr int BM = 128;                         // output rows per tile (64 per consumer)
constexpr int BN = 256;                         // output columns per tile
constexpr int BK = 128;                         // bytes of K per stage: one swizzled box row
constexpr int A_BYTES = BM * BK;                // a stage's slice of x
constexpr int STAGE_BYTES = A_BYTES + BN * BK;  // and of w after it
constexpr int GROUP_M = 8;                      // row tiles walked together
constexpr int CONSUMER_WARPS = 8;               // arrivals that free a stage
constexpr int OUT_BOX = 64 * 128;               // a 64 x 64 box of the output, 128-byte swizzled

// One box of the output from shared memory at `src` to (column, row) of `map`.
__device__ __forceinline__ void tma_store(const CUtensorMap *map, uint32_t src, int col, int row) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %4}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(col), "r"(row), "r"(0)
      : "memory");
}

#define ACCUMULATOR_REGISTERS_128 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "  \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "  \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "  \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "  \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "  \

#define ACCUMULATORS_128(C, d) \
      C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7]), C(d[8]), C(d[9]), C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15]),\
      C(d[16]), C(d[17]), C(d[18]), C(d[19]), C(d[20]), C(d[21]), C(d[22]), C(d[23]), C(d[24]), C(d[25]), C(d[26]), C(d[27]), C(d[28]), C(d[29]), C(d[30]), C(d[31]),\
      C(d[32]), C(d[33]), C(d[34]), C(d[35]), C(d[36]), C(d[37]), C(d[38]), C(d[39]), C(d[40]), C(d[41]), C(d[42]), C(d[43]), C(d[44]), C(d[45]), C(d[46]), C(d[47]),\
      C(d[48]), C(d[49]), C(d[50]), C(d[51]), C(d[52]), C(d[53]), C(d[54]), C(d[55]), C(d[56]), C(d[57]), C(d[58]), C(d[59]), C(d[60]), C(d[61]), C(d[62]), C(d[63]),\
      C(d[64]), C(d[65]), C(d[66]), C(d[67]), C(d[68]), C(d[69]), C(d[70]), C(d[71]), C(d[72]), C(d[73]), C(d[74]), C(d[75]), C(d[76]), C(d[77]), C(d[78]), C(d[79]),\
      C(d[80]), C(d[81]), C(d[82]), C(d[83]), C(d[84]), C(d[85]), C(d[86]), C(d[87]), C(d[88]), C(d[89]), C(d[90]), C(d[91]), C(d[92]), C(d[93]), C(d[94]), C(d[95]),\
      C(d[96]), C(d[97]), C(d[98]), C(d[99]), C(d[100]), C(d[101]), C(d[102]), C(d[103]), C(d[104]), C(d[105]), C(d[106]), C(d[107]), C(d[108]), C(d[109]), C(d[110]), C(d[111]),\
      C(d[112]), C(d[113]), C(d[114]), C(d[115]), C(d[116]), C(d[117]), C(d[118]), C(d[119]), C(d[120]), C(d[121]), C(d[122]), C(d[123]), C(d[124]), C(d[125]), C(d[126]), C(d[127])

// D (64 x 256, f32) (+)= A (64 x 32 e4m3, shared) * B (32 x 256 e4m3, shared), both K-major.
__device__ __forceinline__ void wgmma_e4m3_n256(float (&d)[128], uint64_t a, uint64_t b,
                                                int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
      ACCUMULATOR_REGISTERS_128
      "%128, %129, p, 1, 1;\n}\n"
      : ACCUMULATORS_128("+f", d)
      : "l"(a), "l"(b), "r"(scale_d));
}

// GELU(tanh) on the hardware's tanh (relative error 2^-11, far under e4m3's 2^-4).
__device__ __forceinline__ float gelu_tanh_approx(float v) {
  const float inner = 0.7978845608028654f * fmaf(0.044715f * v, v * v, v);
  float t;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(inner));
  return 0.5f * v * (1.f + t);
}

// The tile of `tile` (of pairs of row tiles where PAIRED) this block computes: groups of GROUP_M
// row tiles, columns outer within a group; in a pair, the block of cluster rank r takes row tile
// 2p + r.
template <bool PAIRED>
__device__ __forceinline__ void tile_origin(int tile, int m_tiles, int n_tiles, int rank, int &m0,
                                            int &n0) {
  const int units = PAIRED ? (m_tiles + 1) / 2 : m_tiles, group = PAIRED ? GROUP_M / 2 : GROUP_M;
  const int per_group = group * n_tiles;
  const int first = tile / per_group * group;
  const int group_rows = min(units - first, group);
  const int in_group = tile % per_group;
  const int unit = first + in_group % group_rows;
  m0 = (PAIRED ? 2 * unit + rank : unit) * BM;
  n0 = in_group / group_rows * BN;
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// One box of `map` at (column, row) into shared memory at `dst` of both blocks of the cluster,
// completing its bytes on the mbarrier at `bar` of each.
__device__ __forceinline__ void tma_load_both(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                              int col, int row) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(0), "r"(bar), "h"(uint16_t(3))
      : "memory");
}

// An arrival on the mbarrier at `bar` of the other block of the cluster.
__device__ __forceinline__ void mbar_arrive_peer(uint32_t bar, uint32_t peer) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(peer)
      : "memory");
}

// The kernel's body. PAIRED: blocks run in clusters of two on row tiles side by side; each loads
// half of the weight tile they share and multicasts it to both (half the weight bytes read from
// L2 per block), so a stage is free only once both blocks' consumers are done with it.
template <bool PAIRED, int STAGES>
__device__ __forceinline__ void fp8_linear(const CUtensorMap &x_map, const CUtensorMap &w_map,
                                           const CUtensorMap &out_map, const float *scale_x,
                                           const float *scale_w, const __nv_bfloat16 *bias,
                                           int rows, int n, int k_tiles, int gelu) {
  extern __shared__ uint8_t raw[];
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  const uint32_t base = (smem_addr(raw) + 1023) & ~1023u;  // swizzled boxes need 1024-byte alignment
  const int m_tiles = (rows + BM - 1) / BM, n_tiles = (n + BN - 1) / BN;
  const int tiles = (PAIRED ? (m_tiles + 1) / 2 : m_tiles) * n_tiles;
  const int rank = PAIRED ? cluster_rank() : 0;
  const int first_tile = PAIRED ? blockIdx.x / 2 : blockIdx.x;
  const int tile_step = PAIRED ? gridDim.x / 2 : gridDim.x;
  const int wg = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), (PAIRED ? 2 : 1) * CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // The other block's multicasts and arrivals find these barriers initialised.
  if (PAIRED) {
    cluster_sync();
  } else {
    __syncthreads();
  }

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      int it = 0;
      for (int tile = first_tile; tile < tiles; tile += tile_step) {
        int m0, n0;
        tile_origin<PAIRED>(tile, m_tiles, n_tiles, rank, m0, n0);
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const int s = it % STAGES;
          mbar_wait(smem_addr(&empty[s]), ((it / STAGES) & 1) ^ 1);
          const uint32_t stage = base + s * STAGE_BYTES, bar = smem_addr(&full[s]);
          mbar_expect_tx(bar, STAGE_BYTES);
          tma_load(stage, &x_map, bar, kt * BK, m0, 0, 0);
          if (PAIRED) {
            const int half = BN / 2;
            tma_load_both(stage + A_BYTES + rank * half * BK, &w_map, bar, kt * BK, n0 + rank * half);
          } else {
            tma_load(stage + A_BYTES, &w_map, bar, kt * BK, n0, 0, 0);
          }
        }
      }
    }
    // Neither block of a pair leaves while the other may still arrive on its barriers.
    if (PAIRED) cluster_sync();
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int consumer = wg - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  // Descriptors count shared memory in 16 bytes: a stage, this warpgroup's 64 rows of x or a
  // 32-byte step of K is an add to the first.
  const uint64_t desc = smem_desc(base, 16, 1024);
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  int it = 0;
  // A stage is freed in this block and, where PAIRED, in the other one, whose multicasts fill it.
  auto release = [&](int s) {
    if (lane != 0) return;
    mbar_arrive(smem_addr(&empty[s]));
    if (PAIRED) mbar_arrive_peer(smem_addr(&empty[s]), rank ^ 1);
  };
  for (int tile = first_tile; tile < tiles; tile += tile_step) {
    int m0, n0;
    tile_origin<PAIRED>(tile, m_tiles, n_tiles, rank, m0, n0);
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const int s = it % STAGES;
      mbar_wait(smem_addr(&full[s]), (it / STAGES) & 1);
      const uint64_t a = desc + (s * STAGE_BYTES + consumer * 64 * BK) / 16;
      const uint64_t b = desc + (s * STAGE_BYTES + A_BYTES) / 16;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_e4m3_n256(acc, a + 2 * kk, b + 2 * kk, kt > 0 || kk > 0);
      wgmma_commit();
      // The previous stage's products are done once at most this one is in flight.
      wgmma_wait<1>();
      if (kt > 0) release((it - 1) % STAGES);
    }
    wgmma_wait<0>();
    release((it - 1) % STAGES);

    // The thread holds rows g and g + 8 of its warp's 16, columns 8i + 2t and 8i + 2t + 1. They
    // go to this warpgroup's four 64 x 64 boxes in shared memory (16-byte chunks XORed by the row
    // mod 8: no bank conflicts), and TMA stores the boxes (rows and columns past the ends are
    // not written) while the next tile's products run.
    const int row0 = m0 + consumer * 64 + warp * 16 + g;
    float sx[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) sx[r] = row0 + 8 * r < rows ? scale_x[row0 + 8 * r] : 0.f;
    // Three stages leave room to stage a consumer's four 64 x 64 boxes at once; four stages, two
    // at a time (two parts, the second waiting for the first's stores to read them).
    constexpr int BOXES = STAGES == 3 ? 4 : 2;
    const uint32_t staging = base + STAGES * STAGE_BYTES + consumer * BOXES * OUT_BOX;
#pragma unroll
    for (int part = 0; part < 4 / BOXES; ++part) {
      // The boxes' last stores have read them.
      if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + consumer) : "memory");
#pragma unroll
      for (int j = 0; j < 8 * BOXES; ++j) {
        const int i = part * 8 * BOXES + j;
        const int col = n0 + 8 * i + 2 * t;
        const bool inside = col < n;  // n is a multiple of 8: a pair is whole or past the end
        const float2 sw = inside ? *reinterpret_cast<const float2 *>(scale_w + col) : make_float2(0.f, 0.f);
        const float2 b = bias && inside
                             ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(bias + col))
                             : make_float2(0.f, 0.f);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float y0 = fmaf(acc[4 * i + 2 * r] * sx[r], sw.x, b.x);
          float y1 = fmaf(acc[4 * i + 2 * r + 1] * sx[r], sw.y, b.y);
          if (gelu) {
            y0 = gelu_tanh_approx(y0);
            y1 = gelu_tanh_approx(y1);
          }
          const __nv_bfloat162 v = __floats2bfloat162_rn(y0, y1);
          const int row = warp * 16 + g + 8 * r;  // within the warpgroup's 64
          const int chunk = (i % 8) ^ (row % 8);
          const uint32_t at = staging + (j / 8) * OUT_BOX + row * 128 + chunk * 16 + t * 4;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(*reinterpret_cast<const uint32_t *>(&v)));
        }
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + consumer) : "memory");
      if (tid == 0) {
#pragma unroll
        for (int box = 0; box < BOXES; ++box)
          tma_store(&out_map, staging + box * OUT_BOX, n0 + 64 * (part * BOXES + box), m0 + consumer * 64);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      }
    }
  }
  if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  if (PAIRED) cluster_sync();
}

}  // namespace

#define FP8_LINEAR(NAME, PAIRED, STAGES, CLUSTER)                                                \
  extern "C" __global__ void CLUSTER __launch_bounds__(384, 1)                                   \
      NAME(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,   \
           const __grid_constant__ CUtensorMap out_map, const float *scale_x,                     \
           const float *scale_w, const __nv_bfloat16 *bias, int rows, int n, int k_tiles,        \
           int gelu) {                                                                           \
    fp8_linear<PAIRED, STAGES>(x_map, w_map, out_map, scale_x, scale_w, bias, rows, n, k_tiles,  \
                               gelu);                                                            \
  }
#define PAIR __cluster_dims__(2, 1, 1)
FP8_LINEAR(fp8_linear_sm90_bf16, false, 3, )
FP8_LINEAR(fp8_linear_sm90_s4_bf16, false, 4, )
FP8_LINEAR(fp8_linear_sm90_p3_bf16, true, 3, PAIR)
FP8_LINEAR(fp8_linear_sm90_p4_bf16, true, 4, PAIR)
