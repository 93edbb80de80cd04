// Implicit-GEMM 3D convolution (cross-correlation, zero padding) on the tensor cores: channels
// first (NCDHW, f32 or bf16, no bias, below), for vidgen's `conv3d` where cuDNN is not loaded,
// and channels last (NDHWC, f32 in TF32, `conv3d_cl` further down, optionally adding a bias and
// a residual as it stores).
//
// Channels first, GEMM view: M = C_out, N = B * T' * H' * W' output positions, K = taps * C_in,
// with K ordered tap-major (tap = (dt, dh, dw), then input channel). A is the weight packed by
// `conv3d_pack_*` into [C_out][taps][C_in rounded up to a 16-byte chunk] (f32 already rounded to
// TF32, so its fragments need no conversion); B is gathered from x while it is copied to shared
// memory: one K tile is one tap and BK channels, so whether a position's tap reads padding is one
// test per tile, and the channels are a fixed stride apart. No im2col buffer exists.
//
// A block computes BM x BN outputs with 8 warps (2 along M, 4 along N); K tiles stream through
// STAGES shared-memory buffers. f32 runs TF32 mma.sync m16n8k8 (x rounded with cvt.rna as its
// fragments are read) and copies x with 4-byte cp.async, whose zero fill is the padding; bf16
// runs mma.sync m16n8k16 and, cp.async copying at least 4 bytes, stages x through registers (the
// loads of the next tile are in flight while the current one is multiplied). Accumulators are
// f32. Offsets into x, w and the output are 64-bit; positions and K are 32-bit.

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

// The problem's sizes, as the launcher passes them (one struct, `Geometry` in conv3d.rs).
struct Geometry {
  int c_in, t_in, h_in, w_in;
  int c_out, t_out, h_out, w_out;
  int kt, kh, kw;
  int st, sh, sw;
  int pt, ph, pw;
  int c_in_pad;   // channels per tap in the packed weight
  int positions;  // N
};

constexpr int WARPS_M = 2;
constexpr int WARPS_N = 4;
constexpr int THREADS = 32 * WARPS_M * WARPS_N;
constexpr int BN = 128;

template <typename T> struct Elem;

template <> struct Elem<float> {
  static constexpr int BK = 16;  // two k8 steps
  static constexpr int B_PAD = 8;  // 136-float rows: the fragment reads (k = lane % 4) hit 32 banks
};

template <> struct Elem<__nv_bfloat16> {
  static constexpr int BK = 32;  // two k16 steps
  static constexpr int B_PAD = 8;  // 272-byte rows: the 8 rows one ldmatrix reads hit 8 bank groups
};

// Shared A rows are BK elements plus 16 bytes (80 bytes): ldmatrix's 8 rows hit 8 bank groups.
template <typename T> __host__ __device__ constexpr int a_stride() {
  return Elem<T>::BK + 16 / sizeof(T);
}

template <typename T> __host__ __device__ constexpr int b_stride() {
  return BN + Elem<T>::B_PAD;
}

#include "tensor_core.cuh"

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// f32 bits as a TF32 mma operand: half a TF32 ulp added, since the tensor cores ignore the 13 low
// mantissa bits (truncate) the product reads x rounded to nearest, ties away from zero, as
// cvt.rna would round it (one integer add instead of cvt's three instructions; a NaN whose
// payload lies only in those bits reads as an infinity).
__device__ __forceinline__ uint32_t tf32_bits(uint32_t x) { return x + 0x1000u; }

// ldmatrix.x4 of f32 rows (each 8x4 f32 matrix read as 8x8 b16), as TF32 operands.
__device__ __forceinline__ void ldsm_x4_tf32(uint32_t (&r)[4], uint32_t addr) {
  ldsm_x4(r, addr);
#pragma unroll
  for (int i = 0; i < 4; ++i) r[i] = tf32_bits(r[i]);
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void store1(float *p, float v) { *p = v; }
__device__ __forceinline__ void store1(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store2(float *p, float lo, float hi) {
  *reinterpret_cast<float2 *>(p) = make_float2(lo, hi);
}
__device__ __forceinline__ void store2(__nv_bfloat16 *p, float lo, float hi) {
  *reinterpret_cast<__nv_bfloat162 *>(p) = __floats2bfloat162_rn(lo, hi);
}

// Channels last: one ldmatrix.x4 of a [n][k] f32 tile reads the four 8x4 matrices (n 0-7, k 0-3),
// (n 0-7, k 4-7), (n 8-15, k 0-3), (n 8-15, k 4-7), b0 and b1 of two n8 tiles; this lane's row
// and column of them.
__device__ __forceinline__ int cl_b_row(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
__device__ __forceinline__ int cl_b_k(int lane) { return ((lane >> 3) & 1) * 4; }

// The two n8 tiles of such a load: c0 += a b[0..1], c1 += a b[2..3].
__device__ __forceinline__ void mma_tf32_pair(float (&c0)[4], float (&c1)[4],
                                              const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  mma_tf32(c0, a, b[0], b[1]);
  mma_tf32(c1, a, b[2], b[3]);
}

// Channels last: what the store adds to the accumulators, each where not null: bias [C_out], then
// residual (laid out as y), in the order of the separate pass y + bias + residual it replaces, so
// the sums are the same bits and the output is written once.
//
// With parity_channels = C > 0 (conv3d_cl only, no residual, C even, C_out = 4 C) the output
// channels are the four 2x2 parities p = 2a + b of C channels each, over a grid of (H + 1) x
// (W + 1) positions per frame (an upsampler's nearest x2 then 3x3 convolution, computed as four
// 2x2 kernels on the frame), and they are stored interleaved: parity p at grid (i, j) is output
// pixel (2 i - a, 2 j - b) of the 2H x 2W frame (nothing where that falls outside), plus bias[c].
struct ClEpilogue {
  const float *__restrict__ bias;
  const float *__restrict__ residual;
  int parity_channels;

  __device__ __forceinline__ float add(float v, long long row, int n) const {
    if (bias) v += bias[n];
    if (residual) v += residual[row + n];
    return v;
  }

  // The residual pair at channels n, n + 1 of the row starting at `row`, where the pair path of
  // store_pair reads one (zeros otherwise). Read for a whole row of accumulator pairs before its
  // stores, so that the loads are in flight together: read one by one at each store, their
  // latency showed in every block's epilogue (the Wan decoder's 96-channel convolutions took
  // 16% longer with the residual).
  __device__ __forceinline__ float2 residual_pair(long long row, int n, int c_out) const {
    if (residual == nullptr || c_out % 2 != 0 || n >= c_out) return make_float2(0.f, 0.f);
    return *reinterpret_cast<const float2 *>(residual + row + n);
  }

  // An accumulator pair, output channels n and n + 1 of the position whose output row starts at
  // `row` (in y and residual alike); adjacent and 8-byte aligned where C_out is even, when `r`
  // is residual_pair(row, n, c_out).
  __device__ __forceinline__ void store_pair(float *__restrict__ y, long long row, int n,
                                             int c_out, float lo, float hi, float2 r) const {
    if (c_out % 2 == 0) {
      if (n >= c_out) return;
      if (bias) {
        const float2 b = *reinterpret_cast<const float2 *>(bias + n);
        lo += b.x;
        hi += b.y;
      }
      if (residual) {
        lo += r.x;
        hi += r.y;
      }
      store2(y + row + n, lo, hi);
    } else {
      if (n < c_out) y[row + n] = add(lo, row, n);
      if (n + 1 < c_out) y[row + n + 1] = add(hi, row, n + 1);
    }
  }

  // An accumulator pair, channels n and n + 1 of grid position (i, j) of frame f (see
  // parity_channels), stored at its output pixel plus the bias, as the separate interleaving
  // pass adds it.
  __device__ __forceinline__ void store_parity(float *__restrict__ y, long long f, int i, int j,
                                               int n, const Geometry &g, float lo,
                                               float hi) const {
    if (n >= g.c_out) return;
    const int p = n / parity_channels, c = n - p * parity_channels;
    const int oi = 2 * i - (p >> 1), oj = 2 * j - (p & 1);
    const int h2 = 2 * (g.h_out - 1), w2 = 2 * (g.w_out - 1);
    if (oi < 0 || oi >= h2 || oj < 0 || oj >= w2) return;
    if (bias) {
      const float2 b = *reinterpret_cast<const float2 *>(bias + c);
      lo = __fadd_rn(lo, b.x);
      hi = __fadd_rn(hi, b.y);
    }
    store2(y + ((f * h2 + oi) * w2 + oj) * parity_channels + c, lo, hi);
  }
};

// The next K tile's tap and first channel, stepped tile by tile (no divisions in the loop).
struct TileCursor {
  int c0, dt, dh, dw;

  __device__ __forceinline__ void advance(const Geometry &g, int bk) {
    c0 += bk;
    if (c0 >= g.c_in) {
      c0 = 0;
      if (++dw == g.kw) {
        dw = 0;
        if (++dh == g.kh) {
          dh = 0;
          ++dt;
        }
      }
    }
  }
};

template <typename T, int BM, int STAGES>
__device__ __forceinline__ void conv3d_igemm(const T *__restrict__ x, const T *__restrict__ w,
                                             T *__restrict__ y, const Geometry &g) {
  constexpr int BK = Elem<T>::BK;
  constexpr int AS = a_stride<T>();
  constexpr int BS = b_stride<T>();
  constexpr int WTM = BM / WARPS_M;   // warp tile rows
  constexpr int WTN = BN / WARPS_N;   // warp tile columns
  constexpr int MT = WTM / 16;        // m16 tiles per warp
  constexpr int NT = WTN / 8;         // n8 tiles per warp
  constexpr int CHUNK = 16 / sizeof(T);          // elements per 16-byte copy
  constexpr int A_CHUNKS = BM * BK / CHUNK / THREADS;  // A copies per thread per tile
  constexpr int B_ROWS = THREADS / BN;           // K rows one pass of the block copies
  constexpr int B_PASSES = BK / B_ROWS;          // B elements per thread per tile
  constexpr bool F32 = sizeof(T) == 4;
  static_assert(A_CHUNKS >= 1 && BM * BK == A_CHUNKS * CHUNK * THREADS, "A tile copy");
  static_assert(NT % 2 == 0, "bf16 B fragments load n8 tiles in pairs");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sA = reinterpret_cast<T *>(smem_raw);  // [STAGES][BM][AS]
  T *sB = sA + STAGES * BM * AS;            // [STAGES][BK][BS]

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  const int m_tiles = (g.c_out + BM - 1) / BM;
  // M tiles vary fastest, so the blocks that gather the same positions run together.
  const int m0 = (blockIdx.x % m_tiles) * BM;
  const int n0 = (blockIdx.x / m_tiles) * BN;

  const int taps = g.kt * g.kh * g.kw;
  const int k_tiles = taps * ((g.c_in + BK - 1) / BK);
  const long long hw = (long long)g.h_in * g.w_in;
  const long long thw = hw * g.t_in;  // one input channel
  const int out_hw = g.h_out * g.w_out;
  const long long out_thw = (long long)g.t_out * out_hw;

  // This thread's A copies: rows of the packed weight, 16 bytes each.
  const T *a_src[A_CHUNKS];
  bool a_row_ok[A_CHUNKS];
  int a_dst[A_CHUNKS], a_col[A_CHUNKS];
#pragma unroll
  for (int i = 0; i < A_CHUNKS; ++i) {
    const int c = tid + i * THREADS;
    const int row = c / (BK / CHUNK);
    a_col[i] = (c % (BK / CHUNK)) * CHUNK;
    a_dst[i] = row * AS + a_col[i];
    a_row_ok[i] = m0 + row < g.c_out;
    a_src[i] = w + (long long)(a_row_ok[i] ? m0 + row : 0) * taps * g.c_in_pad + a_col[i];
  }

  // This thread's B column: one output position, decomposed once.
  const int b_col = tid % BN, b_row0 = tid / BN;
  const int n = n0 + b_col;
  const bool n_ok = n < g.positions;
  int t0 = 0, h0 = 0, w0 = 0;
  long long x_pos = 0;  // offset of the position's (dt, dh, dw) = (0, 0, 0) tap, channel 0
  if (n_ok) {
    const long long p_per_batch = out_thw;
    const int b = (int)(n / p_per_batch);
    const int p = (int)(n - b * p_per_batch);
    const int to = p / out_hw, rem = p - to * out_hw;
    const int ho = rem / g.w_out, wo = rem - ho * g.w_out;
    t0 = to * g.st - g.pt;
    h0 = ho * g.sh - g.ph;
    w0 = wo * g.sw - g.pw;
    x_pos = (long long)b * g.c_in * thw + t0 * hw + (long long)h0 * g.w_in + w0;
  }

  TileCursor cursor = {0, 0, 0, 0};
  // The B elements of the tile at `cursor` this thread copies: one source per pass, or none.
  auto b_sources = [&](const T *(&src)[B_PASSES], int &valid_rows) {
    const bool tap_ok = n_ok && (unsigned)(t0 + cursor.dt) < (unsigned)g.t_in &&
                        (unsigned)(h0 + cursor.dh) < (unsigned)g.h_in &&
                        (unsigned)(w0 + cursor.dw) < (unsigned)g.w_in;
    valid_rows = tap_ok ? g.c_in - cursor.c0 : 0;
    const T *base = x + x_pos + (cursor.dt * hw + (long long)cursor.dh * g.w_in + cursor.dw) +
                    (cursor.c0 + b_row0) * thw;
#pragma unroll
    for (int j = 0; j < B_PASSES; ++j) src[j] = base + j * B_ROWS * thw;
  };
  auto load_a = [&](int stage) {
    const int tap = (cursor.dt * g.kh + cursor.dh) * g.kw + cursor.dw;
    const long long k_off = (long long)tap * g.c_in_pad + cursor.c0;
    T *dst = sA + stage * BM * AS;
#pragma unroll
    for (int i = 0; i < A_CHUNKS; ++i) {
      const bool ok = a_row_ok[i] && cursor.c0 + a_col[i] < g.c_in_pad;
      cp_async16(smem_addr(dst + a_dst[i]), ok ? a_src[i] + k_off : w, ok ? 16 : 0);
    }
  };
  // f32: the B tile straight to shared memory, zeros where the tap or channel is outside x.
  auto load_b_async = [&](int stage) {
    const T *src[B_PASSES];
    int valid_rows;
    b_sources(src, valid_rows);
    T *dst = sB + stage * BK * BS + b_row0 * BS + b_col;
#pragma unroll
    for (int j = 0; j < B_PASSES; ++j) {
      const bool ok = b_row0 + j * B_ROWS < valid_rows;
      cp_async4(smem_addr(dst + j * B_ROWS * BS), ok ? src[j] : x, ok ? 4 : 0);
    }
  };
  // bf16: the B tile into registers (stored after the current tile's products).
  auto fetch_b = [&](unsigned short (&r)[B_PASSES]) {
    const T *src[B_PASSES];
    int valid_rows;
    b_sources(src, valid_rows);
#pragma unroll
    for (int j = 0; j < B_PASSES; ++j) {
      r[j] = b_row0 + j * B_ROWS < valid_rows
                 ? __ldg(reinterpret_cast<const unsigned short *>(src[j]))
                 : (unsigned short)0;
    }
  };
  auto store_b = [&](const unsigned short (&r)[B_PASSES], int stage) {
    unsigned short *dst =
        reinterpret_cast<unsigned short *>(sB + stage * BK * BS + b_row0 * BS + b_col);
#pragma unroll
    for (int j = 0; j < B_PASSES; ++j) dst[j * B_ROWS * BS] = r[j];
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
  }

  // Prologue: the first STAGES - 1 tiles (one commit group each, empty past the end).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) {
      load_a(s);
      if constexpr (F32) {
        load_b_async(s);
      } else {
        unsigned short r[B_PASSES];
        fetch_b(r);
        store_b(r, s);
      }
      cursor.advance(g, BK);
    }
    cp_async_commit();
  }

  const int g8 = lane / 4, t4 = lane % 4;
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    // The stage refilled now was read in the previous iteration, which every warp has left.
    const int next = kt + STAGES - 1;
    const int next_stage = next % STAGES;
    unsigned short staged[F32 ? 1 : B_PASSES];
    if (next < k_tiles) {
      load_a(next_stage);
      if constexpr (F32) {
        load_b_async(next_stage);
      } else {
        fetch_b(staged);
      }
    }
    cp_async_commit();

    const T *a = sA + (kt % STAGES) * BM * AS;
    const T *b = sB + (kt % STAGES) * BK * BS;
    if constexpr (F32) {
#pragma unroll
      for (int ks = 0; ks < BK; ks += 8) {
        uint32_t af[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const int row = wm * WTM + i * 16 + lane % 16;
          ldsm_x4(af[i], smem_addr(a + row * AS + ks + (lane / 16) * 4));
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const float *col = reinterpret_cast<const float *>(b) + (ks + t4) * BS +
                             wn * WTN + j * 8 + g8;
          const uint32_t b0 = to_tf32(col[0]), b1 = to_tf32(col[4 * BS]);
#pragma unroll
          for (int i = 0; i < MT; ++i) mma_tf32(acc[i][j], af[i], b0, b1);
        }
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < BK; ks += 16) {
        uint32_t af[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const int row = wm * WTM + i * 16 + lane % 16;
          ldsm_x4(af[i], smem_addr(a + row * AS + ks + (lane / 16) * 8));
        }
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
          uint32_t bf[4];
          ldsm_x4_t(bf, smem_addr(b + (ks + lane % 16) * BS + wn * WTN + j * 8 + (lane / 16) * 8));
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            mma_bf16(acc[i][j], af[i], bf[0], bf[1]);
            mma_bf16(acc[i][j + 1], af[i], bf[2], bf[3]);
          }
        }
      }
    }
    if constexpr (!F32) {
      if (next < k_tiles) store_b(staged, next_stage);
    }
    if (next < k_tiles) cursor.advance(g, BK);
  }
  cp_async_wait<0>();

  // Epilogue: each accumulator pair (columns 2 * t4, 2 * t4 + 1) to y[b, m, p]; with an even
  // number of positions per batch the pair is adjacent in y and aligned, one store.
  const bool pairs = out_thw % 2 == 0;
  const long long batch_stride = (long long)g.c_out * out_thw;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    long long col_off[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = n0 + wn * WTN + j * 8 + 2 * t4 + e;
      const long long b = c / out_thw;
      col_off[e] = c < g.positions ? b * batch_stride + (c - b * out_thw) : -1;
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + wm * WTM + i * 16 + g8 + 8 * h;
        if (m >= g.c_out) continue;
        const long long row_off = m * out_thw;
        const float lo = acc[i][j][2 * h], hi = acc[i][j][2 * h + 1];
        if (pairs) {
          if (col_off[0] >= 0) store2(y + row_off + col_off[0], lo, hi);
        } else {
          if (col_off[0] >= 0) store1(y + row_off + col_off[0], lo);
          if (col_off[1] >= 0) store1(y + row_off + col_off[1], hi);
        }
      }
    }
  }
}

// The weight [C_out][C_in][taps] as [C_out][taps][c_in_pad], zeros in the added channels.
template <typename T, bool TF32>
__device__ __forceinline__ void pack(const T *__restrict__ w, T *__restrict__ out, int c_out,
                                     int c_in, int taps, int c_in_pad) {
  const long long total = (long long)c_out * taps * c_in_pad;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int c = (int)(i % c_in_pad);
    const long long row = i / c_in_pad;
    const int tap = (int)(row % taps);
    const long long o = row / taps;
    T v = T(0.f);
    if (c < c_in) {
      v = w[(o * c_in + c) * taps + tap];
      if constexpr (TF32) v = __uint_as_float(to_tf32(v));
    }
    out[i] = v;
  }
}

// Channels last (NDHWC), f32 in TF32.
//
// GEMM view: M = output positions (B * T' * H' * W'), N = C_out, K = taps * C_in. x is
// [B][T][H][W][C_in] and w [C_out][kt][kh][kw][C_in], so for one tap both operands' K rows are
// contiguous channels: a K tile (one tap, BK channels) is BK / 4 16-byte chunks per position and
// per output channel, copied by cp.async with zero fill for padding, positions past the end,
// output channels past C_out and channels past C_in (C_in % 4 == 0). w is read as it is: no
// packing.
//
// A block covers BM positions by BN output channels. BN = 96 takes the Wan decoder's 96-channel
// convolutions whole, so each gathered activation reaches shared memory once per block (cuDNN's
// 32-wide N tile gathers it three times); 96 also divides 192 and 384 (BN = 128: 384 in three).
// Warps are WARPS / 2 along M by 2 along N; a warp tile of 32 x 48 (BM 128, 8 warps) or 64 x 48
// (BM 256 with 8 warps, or BM 128 with 4) reads 5 or 7 ldmatrix.x4 per 12 or 24 mma: by estimate
// shared-memory bandwidth as much as the tensor cores bounds the small warp tile, whose lower
// register count lets two blocks share an SM.
//
// K tiles run (dt, dh, channel chunk, dw): the kw taps of one chunk read the same positions
// shifted by one, which the activations' L1-cached copies (cp.async.ca) can then find in L1
// instead of L2 (the weights, read once per block, bypass L1). Shared rows are BK + 4 floats (80
// or 144 bytes, an odd number of 16-byte units): the 8 rows of one ldmatrix phase fall in 8
// distinct bank groups. Both operands are rounded as their fragments are read (tf32_bits), so w
// needs no rounding pass.
template <int BM, int BN, int BK, int WARPS, int STAGES>
__device__ __forceinline__ void conv3d_cl(const float *__restrict__ x, const float *__restrict__ w,
                                          float *__restrict__ y, const ClEpilogue &epi,
                                          const Geometry &g) {
  constexpr int NTHREADS = 32 * WARPS;
  constexpr int WARPS_N_CL = 2;
  constexpr int WARPS_M_CL = WARPS / WARPS_N_CL;
  constexpr int S = BK + 4;                   // shared row stride, floats
  constexpr int WTM = BM / WARPS_M_CL;        // warp tile rows (positions)
  constexpr int WTN = BN / WARPS_N_CL;        // warp tile columns (output channels)
  constexpr int MT = WTM / 16;                // m16 tiles per warp
  constexpr int NT = WTN / 8;                 // n8 tiles per warp
  constexpr int CPR = BK / 4;                 // 16-byte chunks per row
  constexpr int ROWS = NTHREADS / CPR;        // rows one pass of the block copies
  constexpr int A_PASSES = BM / ROWS;
  constexpr int B_PASSES = (BN + ROWS - 1) / ROWS;
  static_assert(NTHREADS % CPR == 0 && BM % ROWS == 0, "activation tile copy");
  static_assert(WTM % 16 == 0 && WTN % 16 == 0, "whole m16 tiles, n8 tiles in pairs");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float *sA = reinterpret_cast<float *>(smem_raw);  // [STAGES][BM][S] activations
  float *sB = sA + STAGES * BM * S;                 // [STAGES][BN][S] weights

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int wm = warp / WARPS_N_CL, wn = warp % WARPS_N_CL;
  // Output-channel tiles vary fastest: the blocks that gather the same positions run together.
  const int n_tiles = (g.c_out + BN - 1) / BN;
  const int n0 = (blockIdx.x % n_tiles) * BN;
  const int m0 = (blockIdx.x / n_tiles) * BM;

  const int taps = g.kt * g.kh * g.kw;
  const int k_tiles = taps * ((g.c_in + BK - 1) / BK);
  const int out_hw = g.h_out * g.w_out;
  const int out_thw = g.t_out * out_hw;

  // This thread copies one 16-byte chunk column of every ROWS-th row.
  const int chunk = (tid % CPR) * 4;
  const int row0 = tid / CPR;

  // Its positions: the offset of tap (0, 0, 0), and which taps fall inside x (bit
  // (dt * kh + dh) * kw + dw; none for positions past the end).
  long long a_off[A_PASSES];
  uint32_t a_taps[A_PASSES];
#pragma unroll
  for (int i = 0; i < A_PASSES; ++i) {
    const int m = m0 + row0 + i * ROWS;
    a_off[i] = 0;
    a_taps[i] = 0;
    if (m < g.positions) {
      const int b = m / out_thw, p = m - b * out_thw;
      const int to = p / out_hw, rem = p - to * out_hw;
      const int ho = rem / g.w_out, wo = rem - ho * g.w_out;
      const int t0 = to * g.st - g.pt, h0 = ho * g.sh - g.ph, w0 = wo * g.sw - g.pw;
      a_off[i] = ((((long long)b * g.t_in + t0) * g.h_in + h0) * g.w_in + w0) * g.c_in + chunk;
      uint32_t mask = 0;
      int bit = 0;
      for (int dt = 0; dt < g.kt; ++dt) {
        const bool t_ok = (unsigned)(t0 + dt) < (unsigned)g.t_in;
        for (int dh = 0; dh < g.kh; ++dh) {
          const bool h_ok = t_ok && (unsigned)(h0 + dh) < (unsigned)g.h_in;
          for (int dw = 0; dw < g.kw; ++dw, ++bit) {
            if (h_ok && (unsigned)(w0 + dw) < (unsigned)g.w_in) mask |= 1u << bit;
          }
        }
      }
      a_taps[i] = mask;
    }
  }

  // Its weight rows (output channels n0 + row0 + j * ROWS), those past C_out zero-filled; one
  // pointer for all (registers are tight in the 128-channel tiles).
  const long long w_row0 = (long long)(n0 + row0) * taps * g.c_in + chunk;
  const int w_rows_step = ROWS * taps * g.c_in;

  // The next K tile: tap (dt, dh, dw) and first channel c0, dw fastest.
  int cdt = 0, cdh = 0, cdw = 0, cc0 = 0;
  auto advance = [&]() {
    if (++cdw == g.kw) {
      cdw = 0;
      cc0 += BK;
      if (cc0 >= g.c_in) {
        cc0 = 0;
        if (++cdh == g.kh) {
          cdh = 0;
          ++cdt;
        }
      }
    }
  };
  auto load_tile = [&](int stage) {
    const int tap = (cdt * g.kh + cdh) * g.kw + cdw;
    const bool chunk_ok = cc0 + chunk < g.c_in;
    const long long x_tap =
        (((long long)cdt * g.h_in + cdh) * g.w_in + cdw) * g.c_in + cc0;
    float *da = sA + stage * BM * S + row0 * S + chunk;
#pragma unroll
    for (int i = 0; i < A_PASSES; ++i) {
      const bool ok = chunk_ok && ((a_taps[i] >> tap) & 1u);
      cp_async16_ca(smem_addr(da + i * ROWS * S), ok ? x + (a_off[i] + x_tap) : x, ok ? 16 : 0);
    }
    const long long w_tap = w_row0 + tap * g.c_in + cc0;
    float *db = sB + stage * BN * S + row0 * S + chunk;
#pragma unroll
    for (int j = 0; j < B_PASSES; ++j) {
      if (B_PASSES * ROWS == BN || row0 + j * ROWS < BN) {
        const bool ok = chunk_ok && n0 + row0 + j * ROWS < g.c_out;
        cp_async16(smem_addr(db + j * ROWS * S), ok ? w + (w_tap + j * w_rows_step) : w,
                   ok ? 16 : 0);
      }
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
  }

  // Prologue: the first STAGES - 1 tiles (one commit group each, empty past the end).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) {
      load_tile(s);
      advance();
    }
    cp_async_commit();
  }

  // ldmatrix row addresses: A as the existing kernel's (rows lane % 16, k + 4 for lanes 16-31);
  // B's four 8x4 matrices are (n 0-7, k 0-3), (n 0-7, k 4-7), (n 8-15, k 0-3), (n 8-15, k 4-7):
  // b0 and b1 of two n8 tiles.
  const int a_row = wm * WTM + lane % 16, a_k = (lane / 16) * 4;
  const int b_row = wn * WTN + cl_b_row(lane), b_k = cl_b_k(lane);
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    // The stage refilled now was read in the previous iteration, which every warp has left.
    const int next = kt + STAGES - 1;
    if (next < k_tiles) {
      load_tile(next % STAGES);
      advance();
    }
    cp_async_commit();

    const float *a = sA + (kt % STAGES) * BM * S;
    const float *b = sB + (kt % STAGES) * BN * S;
#pragma unroll
    for (int ks = 0; ks < BK; ks += 8) {
      uint32_t af[MT][4], bf[NT / 2][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        ldsm_x4_tf32(af[i], smem_addr(a + (a_row + i * 16) * S + ks + a_k));
      }
#pragma unroll
      for (int j = 0; j < NT / 2; ++j) {
        ldsm_x4_tf32(bf[j], smem_addr(b + (b_row + j * 16) * S + ks + b_k));
      }
#pragma unroll
      for (int j = 0; j < NT / 2; ++j) {
#pragma unroll
        for (int i = 0; i < MT; ++i) mma_tf32_pair(acc[i][2 * j], acc[i][2 * j + 1], af[i], bf[j]);
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: accumulator pairs are output channels (2 t4, 2 t4 + 1) of one position.
  const int g8 = lane / 4, t4 = lane % 4;
  if (epi.parity_channels > 0) {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + wm * WTM + i * 16 + g8 + 8 * h;
        if (m >= g.positions) continue;
        const int col = m % g.w_out, frame_row = m / g.w_out;
        const int row = frame_row % g.h_out;
        const long long f = frame_row / g.h_out;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          epi.store_parity(y, f, row, col, n0 + wn * WTN + j * 8 + 2 * t4, g, acc[i][j][2 * h],
                           acc[i][j][2 * h + 1]);
        }
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + wm * WTM + i * 16 + g8 + 8 * h;
      if (m >= g.positions) continue;
      const long long row = (long long)m * g.c_out;
      float2 r[NT];
#pragma unroll
      for (int j = 0; j < NT; ++j) r[j] = epi.residual_pair(row, n0 + wn * WTN + j * 8 + 2 * t4, g.c_out);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        epi.store_pair(y, row, n0 + wn * WTN + j * 8 + 2 * t4, g.c_out, acc[i][j][2 * h],
                       acc[i][j][2 * h + 1], r[j]);
      }
    }
  }
}

// Channels last, 3x3 spatial kernels of spatial stride 1 (any kt, temporal stride and padding):
// the "halo" implicit GEMM. A block covers TH x 16 output positions of one output frame (TH rows
// of 16) by BN output channels. For each (dt, BK-channel chunk) it copies the (TH + 2) x 18 input
// positions those outputs read (the halo, zeros outside x) to shared memory once, and the 9
// spatial taps read it shifted: ldmatrix takes one row address per lane, so tap (dh, dw) of the
// 16 outputs of row py is halo rows (py + dh) * 18 + dw ... + 15. Each activation reaches shared
// memory once per dt instead of once per tap (conv3d_cl), and the 256-position blocks read the
// weight once per 256 positions: the L2 traffic that bounds conv3d_cl drops about 4x.
//
// K tiles are (dt, chunk, dw), each the 3 taps dh = 0..2 of that column: a warp covers MT output
// rows py0.. by WTN channels, and halo row py0 + r is tap dh of output row py0 + r - dh, so MT +
// 2 A fragments (not 3 MT) serve the tile's 3 MT products per n-tile pair: 5 ldmatrix per 24 mma
// at MT = 4 (conv3d_cl's 64 x 48 warp tile: 7). The weights of a K tile ([3][BN][BK + 4]) stream
// through STAGES buffers, the halos through two: the next lands while the current is read, 3 K
// tiles ahead (hence STAGES <= 4). Rows are BK + 4 floats as in conv3d_cl: 16 consecutive halo
// rows and the weight rows are conflict-free.
template <int TH, int BN, int BK, int WARPS, int STAGES>
__device__ __forceinline__ void conv3d_cl_halo(const float *__restrict__ x,
                                               const float *__restrict__ w,
                                               float *__restrict__ y, const ClEpilogue &epi,
                                               const Geometry &g) {
  constexpr int TW = 16;                     // output columns per block: one m16 tile per row
  constexpr int HW = TW + 2;                 // halo columns
  constexpr int HALO = (TH + 2) * HW;        // halo rows (positions)
  constexpr int NTHREADS = 32 * WARPS;
  constexpr int WARPS_N_CL = 2;
  constexpr int WARPS_M_CL = WARPS / WARPS_N_CL;
  constexpr int S = BK + 4;                  // shared row stride, floats
  constexpr int MT = TH / WARPS_M_CL;        // output rows (m16 tiles) per warp
  constexpr int WTN = BN / WARPS_N_CL;       // warp tile columns (output channels)
  constexpr int NT = WTN / 8;                // n8 tiles per warp
  constexpr int W_ROWS = 3 * BN;             // weight rows of a K tile: [dh][n]
  constexpr int CPR = BK / 4;                // 16-byte chunks per row
  constexpr int ROWS = NTHREADS / CPR;       // rows one pass of the block copies
  constexpr int H_PASSES = (HALO + ROWS - 1) / ROWS;
  constexpr int W_PASSES = (W_ROWS + ROWS - 1) / ROWS;
  static_assert(NTHREADS % CPR == 0 && TH % WARPS_M_CL == 0, "copy and warp split");
  static_assert(WTN % 16 == 0, "n8 tiles in pairs");
  static_assert(STAGES >= 2 && STAGES <= 4, "a halo waited for with the weights 3 tiles on");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float *s_halo = reinterpret_cast<float *>(smem_raw);  // [2][HALO][S]
  float *s_w = s_halo + 2 * HALO * S;                   // [STAGES][3][BN][S]

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int wm = warp / WARPS_N_CL, wn = warp % WARPS_N_CL;
  // Output-channel tiles vary fastest, then tile columns: neighbouring blocks share halos in L2.
  int idx = blockIdx.x;
  const int n_tiles = (g.c_out + BN - 1) / BN;
  const int n0 = (idx % n_tiles) * BN;
  idx /= n_tiles;
  const int col_tiles = (g.w_out + TW - 1) / TW;
  const int wo0 = (idx % col_tiles) * TW;
  idx /= col_tiles;
  const int row_tiles = (g.h_out + TH - 1) / TH;
  const int ho0 = (idx % row_tiles) * TH;
  const int frame = idx / row_tiles;  // b * T' + t'
  const int b = frame / g.t_out;
  const int t0 = (frame - b * g.t_out) * g.st - g.pt;
  const int h0 = ho0 - g.ph, w0 = wo0 - g.pw;

  const int taps = g.kt * 9;
  const int k_tiles = g.kt * ((g.c_in + BK - 1) / BK) * 3;

  // This thread copies one 16-byte chunk column of every ROWS-th halo and weight row.
  const int chunk = (tid % CPR) * 4;
  const int row0 = tid / CPR;

  // The next halo to copy: dt, first channel c0, buffer.
  int hdt = 0, hc0 = 0, hbuf = 0;
  auto load_halo = [&]() {
    const int t = t0 + hdt;
    const bool ok_tc = hc0 + chunk < g.c_in && (unsigned)t < (unsigned)g.t_in;
    const long long frame_row = ((long long)b * g.t_in + t) * g.h_in;
    float *dst = s_halo + hbuf * HALO * S + row0 * S + chunk;
#pragma unroll
    for (int p = 0; p < H_PASSES; ++p) {
      const int r = row0 + p * ROWS;
      if (H_PASSES * ROWS == HALO || r < HALO) {
        const int hy = r / HW, h = h0 + hy, wi = w0 + (r - hy * HW);
        const bool ok = ok_tc && (unsigned)h < (unsigned)g.h_in && (unsigned)wi < (unsigned)g.w_in;
        const float *src = x + ((frame_row + h) * g.w_in + wi) * g.c_in + hc0 + chunk;
        cp_async16(smem_addr(dst + p * ROWS * S), ok ? src : x, ok ? 16 : 0);
      }
    }
    hbuf ^= 1;
    hc0 += BK;
    if (hc0 >= g.c_in) {
      hc0 = 0;
      ++hdt;
    }
  };
  // The next weight tile to copy: dt, first channel c0, dw (fastest). Its row dh * BN + n is
  // w[n0 + n][dt][dh][dw][c0 + chunk ..].
  int cdt = 0, cc0 = 0, cdw = 0;
  auto load_weights = [&](int stage) {
    const bool chunk_ok = cc0 + chunk < g.c_in;
    const long long w_tap = (long long)(cdt * 9 + cdw) * g.c_in + cc0 + chunk;
    float *dst = s_w + stage * W_ROWS * S + row0 * S + chunk;
#pragma unroll
    for (int p = 0; p < W_PASSES; ++p) {
      const int r = row0 + p * ROWS;
      if (W_PASSES * ROWS == W_ROWS || r < W_ROWS) {
        const int dh = r / BN, n = n0 + r - dh * BN;
        const bool ok = chunk_ok && n < g.c_out;
        const float *src = w + (long long)n * taps * g.c_in + dh * 3 * g.c_in + w_tap;
        cp_async16(smem_addr(dst + p * ROWS * S), ok ? src : w, ok ? 16 : 0);
      }
    }
    if (++cdw == 3) {
      cdw = 0;
      cc0 += BK;
      if (cc0 >= g.c_in) {
        cc0 = 0;
        ++cdt;
      }
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
  }

  // Prologue: the first halo and STAGES - 1 weight tiles (one commit group each, empty past the
  // end).
  load_halo();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) load_weights(s);
    cp_async_commit();
  }

  // Lane addresses: A rows are the warp's first output row's 16 columns (k + 4 for lanes 16-31),
  // B as conv3d_cl's.
  const uint32_t a_lane = smem_addr(s_halo + (wm * MT * HW + lane % 16) * S + (lane / 16) * 4);
  const uint32_t b_lane = smem_addr(s_w + (wn * WTN + cl_b_row(lane)) * S + cl_b_k(lane));
  int dw = 0, halo = 0;  // the K tile multiplied now
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    // The weight stage refilled now was read in the previous iteration, which every warp has
    // left. The first tile of a halo copies the next one into the other buffer, whose last
    // reader, the previous tile, every warp has left too; it is waited for 3 tiles later, with
    // the weights of tile kt + 3 >= kt + STAGES - 1.
    if (dw == 0 && hdt < g.kt) load_halo();
    const int next = kt + STAGES - 1;
    if (next < k_tiles) load_weights(next % STAGES);
    cp_async_commit();

    const uint32_t a = a_lane + (halo * HALO + dw) * S * 4;
    const uint32_t bw = b_lane + (kt % STAGES) * W_ROWS * S * 4;
#pragma unroll
    for (int ks = 0; ks < BK; ks += 8) {
      uint32_t bf[3][NT / 2][4];
#pragma unroll
      for (int dh = 0; dh < 3; ++dh) {
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
          ldsm_x4_tf32(bf[dh][j], bw + ((dh * BN + j * 16) * S + ks) * 4);
        }
      }
      // Halo row r of the warp: tap dh of its output row r - dh.
      uint32_t af[2][4];
      ldsm_x4_tf32(af[0], a + ks * 4);
#pragma unroll
      for (int r = 0; r < MT + 2; ++r) {
        if (r + 1 < MT + 2) ldsm_x4_tf32(af[(r + 1) % 2], a + ((r + 1) * HW * S + ks) * 4);
#pragma unroll
        for (int dh = 0; dh < 3; ++dh) {
          const int i = r - dh;
          if (i < 0 || i >= MT) continue;
#pragma unroll
          for (int j = 0; j < NT / 2; ++j) {
            mma_tf32_pair(acc[i][2 * j], acc[i][2 * j + 1], af[r % 2], bf[dh][j]);
          }
        }
      }
    }
    if (++dw == 3) {
      dw = 0;
      halo ^= 1;
    }
  }
  cp_async_wait<0>();

  // Epilogue: accumulator pairs are output channels (2 t4, 2 t4 + 1) of one position.
  const int g8 = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    const int ho = ho0 + wm * MT + i;
    if (ho >= g.h_out) continue;
    // Both positions' residuals first (see ClEpilogue::residual_pair).
    long long row[2];
    float2 r[2][NT];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int wo = wo0 + g8 + 8 * h;
      row[h] = wo < g.w_out ? (((long long)frame * g.h_out + ho) * g.w_out + wo) * g.c_out : -1;
#pragma unroll
      for (int j = 0; j < NT; ++j)
        r[h][j] = row[h] < 0 ? make_float2(0.f, 0.f)
                             : epi.residual_pair(row[h], n0 + wn * WTN + j * 8 + 2 * t4, g.c_out);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row[h] < 0) continue;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        epi.store_pair(y, row[h], n0 + wn * WTN + j * 8 + 2 * t4, g.c_out, acc[i][j][2 * h],
                       acc[i][j][2 * h + 1], r[h][j]);
      }
    }
  }
}


// Channels last, few output channels (C_out <= NC <= 8), exact f32 on the FMA units: the
// "narrow" kernel, for the Wan decoder's 3-channel head, whose 96-wide tensor-core tiles (own or
// cuDNN's) would idle 93 of 96 columns. A block covers TH x 64 output positions of one output
// frame (TH = 8 rows per warp pair); each thread 8 consecutive positions of one row by NC output
// channels, 8 NC accumulators. Spatial stride 1, kh and kw at most 3 (the halo holds 3 x 3
// taps), any kt, temporal stride and padding; C_in % 4 == 0.
//
// For each (dt, CK-channel chunk) the block copies the (TH + 2) x 66 input positions its outputs
// read (zeros outside x) and the chunk's weights ([3][3][NC][CK]) to shared memory, double
// buffered: the next chunk lands while this one is read. The halo is laid out in planes of 4
// channels, [CK / 4][TH + 2][67][4]: one float4 per position, rows of an odd 67 positions, and
// the lanes of a warp are 8 rows (lane % 8) by 4 column groups, so the 8 lanes of one 128-bit
// load phase read 8 rows at one column, 8 distinct bank groups: no conflicts. Per (dh, plane) a
// thread loads its 10 halo positions once and the kw taps reuse them shifted; the weights are
// warp-uniform (broadcast) float4 loads: 10 + 3 NC loads per 96 NC FMAs. Blocks run output
// frames fastest, so the blocks that read an input frame (kt of them) run together and it comes
// from DRAM once.
template <int NC, int WARPS, int CK>
__device__ __forceinline__ void conv3d_cl_narrow(const float *__restrict__ x,
                                                 const float *__restrict__ w,
                                                 float *__restrict__ y, const ClEpilogue &epi,
                                                 const Geometry &g) {
  constexpr int P = 8;                        // consecutive output positions per thread
  constexpr int WW = 2;                       // warps along a row
  constexpr int WH = WARPS / WW;              // warps down
  constexpr int TH = 8 * WH, TW = 32 * WW;    // output rows, columns per block
  constexpr int HR = TH + 2, HC = TW + 2;     // halo rows, columns
  constexpr int HWID = TW + 3;                // halo row stride, positions: odd
  constexpr int HALO = HR * HWID;             // positions per plane
  constexpr int PLANES = CK / 4;
  constexpr int W_VEC = 9 * NC * PLANES;      // weight float4s per chunk
  constexpr int STAGE = PLANES * HALO * 4 + W_VEC * 4;  // floats per buffer
  constexpr int NTHREADS = 32 * WARPS;
  constexpr int COPIES = (HR * HC + NTHREADS - 1) / NTHREADS;  // halo positions per thread
  static_assert(WARPS % WW == 0 && CK % 4 == 0 && NC >= 1 && NC <= 8, "narrow configuration");
  static_assert(HWID % 2 == 1, "odd halo rows: conflict-free 128-bit loads");
  static_assert(COPIES <= 32, "a 32-bit mask of halo positions");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float *smem = reinterpret_cast<float *>(smem_raw);  // [2][halo planes | weights]

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  // Output frames vary fastest, then tile columns, then tile rows.
  int idx = blockIdx.x;
  const int frames = g.t_out * (int)(g.positions / ((long long)g.t_out * g.h_out * g.w_out));
  const int frame = idx % frames;  // b * T' + t'
  idx /= frames;
  const int col_tiles = (g.w_out + TW - 1) / TW;
  const int wo0 = (idx % col_tiles) * TW;
  const int ho0 = (idx / col_tiles) * TH;
  const int b = frame / g.t_out;
  const int t0 = (frame - b * g.t_out) * g.st - g.pt;
  const int h0 = ho0 - g.ph, w0 = wo0 - g.pw;

  // The temporal taps inside x (the others read zeros: skipped), and the chunks.
  const int dt_lo = max(0, -t0), dt_hi = min(g.kt, g.t_in - t0);
  const int chunks = (g.c_in + CK - 1) / CK;
  const int stages = dt_hi > dt_lo ? (dt_hi - dt_lo) * chunks : 0;

  // This thread's halo positions: the pixel (h * W + w) each copies from, where in the plane it
  // goes, and which lie inside the frame.
  int pix[COPIES], dst[COPIES];
  uint32_t inside = 0, exists = 0;
#pragma unroll
  for (int k = 0; k < COPIES; ++k) {
    const int pos = tid + k * NTHREADS;
    const int hy = pos / HC, hx = pos - hy * HC;
    const int h = h0 + hy, wi = w0 + hx;
    pix[k] = h * g.w_in + wi;
    dst[k] = (hy * HWID + hx) * 4;
    if (pos < HR * HC) exists |= 1u << k;
    if ((unsigned)h < (unsigned)g.h_in && (unsigned)wi < (unsigned)g.w_in) inside |= 1u << k;
  }

  // The next chunk to copy: temporal tap dt, first channel c0.
  int cdt = dt_lo, cc0 = 0;
  auto load_stage = [&](int buf) {
    float *halo = smem + buf * STAGE;
    const long long frame_off = ((long long)b * g.t_in + t0 + cdt) * g.h_in * g.w_in;
#pragma unroll
    for (int k = 0; k < COPIES; ++k) {
      if ((exists >> k) & 1u) {
        const bool in = (inside >> k) & 1u;
        const float *src = x + (frame_off + pix[k]) * g.c_in + cc0;
#pragma unroll
        for (int q = 0; q < PLANES; ++q) {
          const bool ok = in && cc0 + 4 * q < g.c_in;
          cp_async16(smem_addr(halo + q * HALO * 4 + dst[k]), ok ? src + 4 * q : x, ok ? 16 : 0);
        }
      }
    }
    // Weights: float4 j is (tap = dh * 3 + dw, n, plane q), q fastest; zeros outside w.
    float *ws = halo + PLANES * HALO * 4;
    for (int j = tid; j < W_VEC; j += NTHREADS) {
      const int q = j % PLANES, rest = j / PLANES;
      const int n = rest % NC, tap = rest / NC;
      const int dh = tap / 3, dw = tap - dh * 3;
      const bool ok = dh < g.kh && dw < g.kw && n < g.c_out && cc0 + 4 * q < g.c_in;
      const float *src =
          w + ((((long long)n * g.kt + cdt) * g.kh + dh) * g.kw + dw) * g.c_in + cc0 + 4 * q;
      cp_async16(smem_addr(ws + j * 4), ok ? src : w, ok ? 16 : 0);
    }
    cc0 += CK;
    if (cc0 >= g.c_in) {
      cc0 = 0;
      ++cdt;
    }
  };

  float acc[P][NC];
#pragma unroll
  for (int p = 0; p < P; ++p) {
#pragma unroll
    for (int n = 0; n < NC; ++n) acc[p][n] = 0.f;
  }

  // This thread's outputs: row wr * 8 + lane % 8, columns wc * 32 + (lane / 8) * 8 + 0..7.
  const int wr = warp / WW, wc = warp % WW;
  const int orow = wr * 8 + (lane & 7), ocol = wc * 32 + (lane >> 3) * P;
  const int lane_off = (orow * HWID + ocol) * 4;

  if (stages > 0) load_stage(0);
  cp_async_commit();
  for (int s = 0; s < stages; ++s) {
    cp_async_wait<0>();
    __syncthreads();
    // The other buffer was read in the previous iteration, which every thread has left.
    if (s + 1 < stages) load_stage((s + 1) & 1);
    cp_async_commit();

    const float *halo = smem + (s & 1) * STAGE;
    const float *ws = halo + PLANES * HALO * 4;
    for (int dh = 0; dh < g.kh; ++dh) {
#pragma unroll
      for (int q = 0; q < PLANES; ++q) {
        const float *row = halo + q * HALO * 4 + lane_off + dh * HWID * 4;
        float4 xv[P + 2];
#pragma unroll
        for (int j = 0; j < P + 2; ++j) xv[j] = *reinterpret_cast<const float4 *>(row + j * 4);
#pragma unroll
        for (int dw = 0; dw < 3; ++dw) {
          if (dw >= g.kw) break;
#pragma unroll
          for (int n = 0; n < NC; ++n) {
            const float4 wv =
                *reinterpret_cast<const float4 *>(ws + (((dh * 3 + dw) * NC + n) * PLANES + q) * 4);
#pragma unroll
            for (int p = 0; p < P; ++p) {
              const float4 a = xv[p + dw];
              float v = acc[p][n];
              v = fmaf(a.x, wv.x, v);
              v = fmaf(a.y, wv.y, v);
              v = fmaf(a.z, wv.z, v);
              v = fmaf(a.w, wv.w, v);
              acc[p][n] = v;
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: the thread's 8 positions, each C_out channels (contiguous in y).
  const int ho = ho0 + orow;
  if (ho >= g.h_out) return;
  const long long row0 = ((long long)frame * g.h_out + ho) * g.w_out;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int wo = wo0 + ocol + p;
    if (wo >= g.w_out) break;
    const long long row = (row0 + wo) * g.c_out;
#pragma unroll
    for (int n = 0; n < NC; ++n) {
      if (n < g.c_out) y[row + n] = epi.add(acc[p][n], row, n);
    }
  }
}

}  // namespace

extern "C" __global__ void conv3d_pack_f32(const float *w, float *out, int c_out, int c_in,
                                           int taps, int c_in_pad) {
  pack<float, true>(w, out, c_out, c_in, taps, c_in_pad);
}

extern "C" __global__ void conv3d_pack_bf16(const __nv_bfloat16 *w, __nv_bfloat16 *out,
                                            int c_out, int c_in, int taps, int c_in_pad) {
  pack<__nv_bfloat16, false>(w, out, c_out, c_in, taps, c_in_pad);
}

// conv3d_<dtype>_m<BM>_s<STAGES>; the launcher picks one by C_out and shared memory.
#define CONV3D(NAME, T, BM, STAGES)                                                       \
  extern "C" __global__ void __launch_bounds__(THREADS, 2)                                \
      NAME(const T *x, const T *w, T *y, Geometry g) {                                    \
    conv3d_igemm<T, BM, STAGES>(x, w, y, g);                                              \
  }

#define CONV3D_CONFIGS(DTYPE, T) \
  CONV3D(conv3d_##DTYPE##_m128_s4, T, 128, 4) \
  CONV3D(conv3d_##DTYPE##_m128_s2, T, 128, 2) \
  CONV3D(conv3d_##DTYPE##_m64_s4, T, 64, 4)   \
  CONV3D(conv3d_##DTYPE##_m64_s2, T, 64, 2)

CONV3D_CONFIGS(f32, float)
CONV3D_CONFIGS(bf16, __nv_bfloat16)

// One channels-last entry point: y = x * w (+ bias) (+ residual), bias and residual null where
// not added, the parities interleaved where parity_channels > 0 (conv3d_cl only; see
// ClEpilogue); KERNEL the (parenthesized) template instance it runs.
#define CONV3D_CL_ENTRY(NAME, WARPS, MIN_BLOCKS, KERNEL)                                     \
  extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)                        \
      NAME(const float *x, const float *w, float *y, const float *bias, const float *residual,  \
           int parity_channels, Geometry g) {                                                 \
    KERNEL(x, w, y, ClEpilogue{bias, residual, parity_channels}, g);                          \
  }

// conv3d_cl_m<BM>_n<BN>_k<BK>_s<STAGES>_w<WARPS>: channels last, f32 in TF32; the launcher picks
// one by C_out and shared memory (`ClTile` in conv3d.rs).
#define CONV3D_CL(BM, BN, BK, STAGES, WARPS, MIN_BLOCKS)                                   \
  CONV3D_CL_ENTRY(conv3d_cl_m##BM##_n##BN##_k##BK##_s##STAGES##_w##WARPS, WARPS, MIN_BLOCKS, \
                  (conv3d_cl<BM, BN, BK, WARPS, STAGES>))

// MIN_BLOCKS caps the registers so that many blocks fit an SM's registers (H100/H200 shared
// memory allows them); the 64 x 48 warp tiles of the 8-warp BM 256 block need more than 128.
CONV3D_CL(128, 96, 32, 3, 8, 2)
CONV3D_CL(128, 96, 16, 4, 8, 2)
CONV3D_CL(256, 96, 16, 3, 8, 1)
CONV3D_CL(128, 96, 16, 4, 4, 3)
CONV3D_CL(128, 128, 16, 4, 8, 2)

// conv3d_clh_t<TH>_n<BN>_k<BK>_s<STAGES>_w<WARPS>: the halo kernel for 3x3 spatial kernels of
// spatial stride 1 (`ClKind::Halo` in conv3d.rs). Its 64 x 48 warp tiles hold about 170
// registers: one 8-warp block per SM (TH 16), or two 4-warp blocks (TH 8).
#define CONV3D_CL_HALO(TH, BN, BK, STAGES, WARPS, MIN_BLOCKS)                                \
  CONV3D_CL_ENTRY(conv3d_clh_t##TH##_n##BN##_k##BK##_s##STAGES##_w##WARPS, WARPS, MIN_BLOCKS, \
                  (conv3d_cl_halo<TH, BN, BK, WARPS, STAGES>))

CONV3D_CL_HALO(16, 96, 16, 2, 8, 1)
CONV3D_CL_HALO(16, 96, 8, 4, 8, 1)
CONV3D_CL_HALO(8, 96, 16, 3, 4, 2)

// conv3d_cln_t<TH>_n<NC>_k<CK>_s2_w<WARPS>: the narrow kernel for at most NC output channels
// (`ClKind::Narrow` in conv3d.rs), TH x 64 positions per block, exact f32.
#define CONV3D_CL_NARROW(TH, NC, CK, WARPS, MIN_BLOCKS)                                  \
  CONV3D_CL_ENTRY(conv3d_cln_t##TH##_n##NC##_k##CK##_s2_w##WARPS, WARPS, MIN_BLOCKS, \
                  (conv3d_cl_narrow<NC, WARPS, CK>))

#define CONV3D_CL_NARROW_CHANNELS(NC)    \
  CONV3D_CL_NARROW(16, NC, 8, 4, 2)      \
  CONV3D_CL_NARROW(8, NC, 8, 2, 4)

CONV3D_CL_NARROW_CHANNELS(1)
CONV3D_CL_NARROW_CHANNELS(2)
CONV3D_CL_NARROW_CHANNELS(3)
CONV3D_CL_NARROW_CHANNELS(4)
CONV3D_CL_NARROW_CHANNELS(8)
