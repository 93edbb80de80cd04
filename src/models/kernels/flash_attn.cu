// Fused attention forward (the FlashAttention-2 scheme) for vidgen's `sdpa`.
//
// One block takes BR = 16 * MT * NW query rows of one (batch, head); each of its NW warps owns
// MT m-tiles of 16 rows. Key and value tiles of BC rows stream through double-buffered shared
// memory (cp.async); scores and P·V run on the tensor cores (mma.sync m16n8k16, operands fetched
// with ldmatrix) with f32 accumulators, and the softmax is computed online in f32, so no score
// ever reaches global memory.
// Shared-memory rows are laid out so the 8 rows one ldmatrix reads fall in 8 different bank
// groups, one of two ways: padded by 16 bytes (addresses are a constant offset from a base,
// free in the load instruction: the fastest), or unpadded and XOR-swizzled in 16-byte chunks
// (chunk ^ row % 8; one more integer op per load), which needs exactly
// (BR + 4 * BC) * D * sizeof(T) bytes: 98,304 at D = 128, BR = 128, under the 99 KB per block of
// sm_120/sm_121 GPUs such as GB10, where the padded layout's 104,448 bytes do not fit.
// Inputs: [batch, heads, seq, head_dim] with any strides whose last dimension is contiguous and
// whose other strides and offsets are multiples of 8 elements (16 bytes). Any q/kv lengths.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

#include "tensor_core.cuh"

constexpr int BC = 64;  // keys per tile
constexpr int PAD = 8;  // elements added to each row of the padded layout

// Row stride of a tile of D-element rows, in elements.
template <int D, bool SWIZZLE> __host__ __device__ constexpr int stride() {
  return SWIZZLE ? D : D + PAD;
}

// Element offset of (row, col) in a tile of D-element rows; col is a multiple of 8.
template <int D, bool SWIZZLE> __device__ __forceinline__ int at(int row, int col) {
  if constexpr (SWIZZLE) {
    return row * D + (((col >> 3) ^ (row & 7)) << 3);
  } else {
    return row * (D + PAD) + col;
  }
}

template <typename T> struct Ops;

template <> struct Ops<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    mma_bf16(c, a, b0, b1);
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
  }
};

template <> struct Ops<__half> {
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
  }
};

template <typename T, int D, int NW, int MT, bool SWIZZLE>
__device__ __forceinline__ void flash_fwd(const T *__restrict__ q, const T *__restrict__ k,
                                          const T *__restrict__ v, T *__restrict__ o, int q_len,
                                          int kv_len, int heads, long long q_sb, long long q_sh,
                                          long long q_ss, long long k_sb, long long k_sh,
                                          long long k_ss, long long v_sb, long long v_sh,
                                          long long v_ss, long long o_sb, long long o_sh,
                                          long long o_ss, float scale_log2) {
  constexpr int BR = 16 * MT * NW;  // query rows per block
  constexpr int NT = 32 * NW;       // threads
  constexpr int CH = D / 8;         // 16-byte chunks per row
  using O = Ops<T>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sQ = reinterpret_cast<T *>(smem_raw);
  constexpr int S = stride<D, SWIZZLE>();
  T *sK = sQ + BR * S;      // [2][BC][S]
  T *sV = sK + 2 * BC * S;  // [2][BC][S]

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int b = blockIdx.y / heads;
  const int h = blockIdx.y % heads;
  const int q0 = blockIdx.x * BR;
  const int wrow = warp * 16 * MT;  // this warp's first row in the block
  const T *qp = q + b * q_sb + h * q_sh;
  const T *kp = k + b * k_sb + h * k_sh;
  const T *vp = v + b * v_sb + h * v_sh;

  // Query tile; rows past the end are zero-filled and never stored.
#pragma unroll
  for (int c = tid; c < BR * CH; c += NT) {
    const int r = c / CH, col = (c % CH) * 8;
    const bool ok = q0 + r < q_len;
    cp_async16(smem_addr(sQ + at<D, SWIZZLE>(r, col)), qp + (ok ? q0 + r : 0) * q_ss + col, ok ? 16 : 0);
  }
  // Key/value tile; rows past kv_len are zero-filled (and their scores masked).
  auto load_kv = [&](int tile, int buf) {
    const int k0 = tile * BC;
#pragma unroll
    for (int c = tid; c < BC * CH; c += NT) {
      const int r = c / CH, col = (c % CH) * 8;
      const bool ok = k0 + r < kv_len;
      const long long row = ok ? k0 + r : 0;
      cp_async16(smem_addr(sK + at<D, SWIZZLE>(buf * BC + r, col)), kp + row * k_ss + col, ok ? 16 : 0);
      cp_async16(smem_addr(sV + at<D, SWIZZLE>(buf * BC + r, col)), vp + row * v_ss + col, ok ? 16 : 0);
    }
  };
  // Query A fragment (16 rows x 16 columns) of m-tile mt at column kk * 16.
  auto load_q = [&](uint32_t(&r)[4], int mt, int kk) {
    const int row = wrow + mt * 16 + (lane % 16);
    const int col = kk * 16 + (lane / 16) * 8;
    ldsm_x4(r, smem_addr(sQ + at<D, SWIZZLE>(row, col)));
  };
  load_kv(0, 0);
  cp_async_commit();

  const int n_tiles = (kv_len + BC - 1) / BC;
  float acc[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      acc[mt][d][0] = acc[mt][d][1] = acc[mt][d][2] = acc[mt][d][3] = 0.f;
    }
  }
  // Running max (log2 domain, scaled) and partial row sums for rows lane/4 and lane/4 + 8.
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

    // Scores S = Q K^T for this warp's rows and the tile's BC keys.
    float s[MT][BC / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
    }
    const T *sKb = sK + buf * BC * S;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // Query fragments are re-read from shared memory: registers go to the accumulators.
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) load_q(qa[mt], mt, kk);
#pragma unroll
      for (int np = 0; np < BC / 16; ++np) {
        const int mi = lane / 8;
        const int key = np * 16 + (mi / 2) * 8 + lane % 8;
        const int col = kk * 16 + (mi % 2) * 8;
        uint32_t kb[4];
        ldsm_x4(kb, smem_addr(sKb + at<D, SWIZZLE>(key, col)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          O::mma(s[mt][2 * np], qa[mt], kb[0], kb[1]);
          O::mma(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }
    if ((j + 1) * BC > kv_len) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (j * BC + n * 8 + 2 * (lane % 4) + (e & 1) >= kv_len) s[mt][n][e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax: every tile holds at least one valid key, so the new max is finite.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) {
          mx = fmaxf(mx, fmaxf(s[mt][n][2 * hf], s[mt][n][2 * hf + 1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[mt][hf], mx * scale_log2);
        const float alpha = exp2f(m_run[mt][hf] - m_new);
        m_run[mt][hf] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) {
#pragma unroll
          for (int e = 2 * hf; e < 2 * hf + 2; ++e) {
            const float p = exp2f(fmaf(s[mt][n][e], scale_log2, -m_new));
            s[mt][n][e] = p;
            sum += p;
          }
        }
        l_run[mt][hf] = l_run[mt][hf] * alpha + sum;
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
          acc[mt][d][2 * hf] *= alpha;
          acc[mt][d][2 * hf + 1] *= alpha;
        }
      }
    }

    // acc += P V; the score accumulators are already laid out as mma A fragments.
    const T *sVb = sV + buf * BC * S;
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = O::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = O::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = O::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = O::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int mi = lane / 8;
        const int key = kk * 16 + (mi % 2) * 8 + lane % 8;
        const int col = dp * 16 + (mi / 2) * 8;
        uint32_t vb[4];
        ldsm_x4_t(vb, smem_addr(sVb + at<D, SWIZZLE>(key, col)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          O::mma(acc[mt][2 * dp], pa[mt], vb[0], vb[1]);
          O::mma(acc[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
    __syncthreads();
  }

  T *op = o + b * o_sb + h * o_sh;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float l = l_run[mt][hf];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = 1.f / l;
      const int row = q0 + wrow + mt * 16 + lane / 4 + hf * 8;
      if (row < q_len) {
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
          const int col = d * 8 + 2 * (lane % 4);
          *reinterpret_cast<uint32_t *>(op + row * o_ss + col) =
              O::pack(acc[mt][d][2 * hf] * inv, acc[mt][d][2 * hf + 1] * inv);
        }
      }
    }
  }
}

}  // namespace

// Kernels are named flash_fwd_<dtype>_d<head_dim>_m<MT>_<pad|swz>. Four warps of two m-tiles each (128 rows
// a block, two blocks a multiprocessor) measured 20% faster on an H200 than one m-tile a warp,
// since each key/value fragment read from shared memory then feeds two mma instructions. The
// one-m-tile variant (64 rows, 81,920 B at D = 128) is for GPUs whose per-block limit is lower.
#define FLASH_FWD(NAME, T, D, NW, MT, SWIZZLE)                                                 \
  extern "C" __global__ void __launch_bounds__(32 * NW)                                       \
      NAME(const T *q, const T *k, const T *v, T *o, int q_len, int kv_len, int heads,         \
           long long q_sb, long long q_sh, long long q_ss, long long k_sb, long long k_sh,     \
           long long k_ss, long long v_sb, long long v_sh, long long v_ss, long long o_sb,     \
           long long o_sh, long long o_ss, float scale_log2) {                                 \
    flash_fwd<T, D, NW, MT, SWIZZLE>(q, k, v, o, q_len, kv_len, heads, q_sb, q_sh, q_ss, k_sb, k_sh,    \
                            k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss, scale_log2);             \
  }

#define FLASH_FWD_DTYPES(D, MT, LAYOUT, SWIZZLE)                                                \
  FLASH_FWD(flash_fwd_bf16_d##D##_m##MT##_##LAYOUT, __nv_bfloat16, D, 4, MT, SWIZZLE)          \
  FLASH_FWD(flash_fwd_f16_d##D##_m##MT##_##LAYOUT, __half, D, 4, MT, SWIZZLE)

FLASH_FWD_DTYPES(64, 2, pad, false)
FLASH_FWD_DTYPES(64, 2, swz, true)
FLASH_FWD_DTYPES(64, 1, swz, true)
FLASH_FWD_DTYPES(128, 2, pad, false)
FLASH_FWD_DTYPES(128, 2, swz, true)
FLASH_FWD_DTYPES(128, 1, swz, true)
