// What the Hopper kernels (flash_attn_sm90.cu, sage_attn_sm90.cu: sm_90a only) share: mbarriers,
// TMA loads, wgmma descriptors and fences, the consumer warpgroups' turns, the accumulator lists.
// Included inside their anonymous namespaces.

#pragma once

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@done bra DONE;\nbra WAIT;\nDONE:\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One box of `map` at (column, row, head, batch) into shared memory.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                         int col, int row, int head, int batch) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(bar)
      : "memory");
}

// wgmma shared-memory matrix descriptor of a 128-byte-swizzled operand at `addr`: `lbo` bytes to
// the next 64 columns (MN-major operands), `sbo` bytes to the next 8 rows.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The mbarriers of the Hopper attention kernels' pipeline, in shared memory: the query tile's, and
// per stage of `STAGES`: keys full, values full, keys empty, values empty.
template <int STAGES> struct Barriers {
  uint64_t bars[1 + 4 * STAGES];

  __device__ __forceinline__ uint32_t q() { return smem_addr(&bars[0]); }
  __device__ __forceinline__ uint32_t full_k(int s) { return smem_addr(&bars[1 + s]); }
  __device__ __forceinline__ uint32_t full_v(int s) { return smem_addr(&bars[1 + STAGES + s]); }
  __device__ __forceinline__ uint32_t empty_k(int s) { return smem_addr(&bars[1 + 2 * STAGES + s]); }
  __device__ __forceinline__ uint32_t empty_v(int s) { return smem_addr(&bars[1 + 3 * STAGES + s]); }

  // Thread 0 initialises them (a stage is freed by `consumer_warps` arrivals); then the block syncs.
  __device__ __forceinline__ void init(int consumer_warps) {
    if (threadIdx.x == 0) {
      mbar_init(q(), 1);
      for (int s = 0; s < STAGES; ++s) {
        mbar_init(full_k(s), 1);
        mbar_init(full_v(s), 1);
        mbar_init(empty_k(s), consumer_warps);
        mbar_init(empty_v(s), consumer_warps);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
};

// The two consumer warpgroups take turns (barriers 1 and 2, 256 threads each).
__device__ __forceinline__ void turn_wait(int consumer) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(1 + consumer) : "memory");
}
__device__ __forceinline__ void turn_pass(int consumer) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - consumer) : "memory");
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The 64 accumulators a thread holds of a wgmma m64n128 tile: their list in the instruction
// (%0-%63) and the operands bound to them, with constraint C ("+f" for f32, "+r" for s32).
#define ACCUMULATOR_REGISTERS                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                        \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "               \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "               \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define ACCUMULATORS8(C, d, i)                                                                     \
  C(d[i]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]), C(d[i + 7])
#define ACCUMULATORS(C, d)                                                                         \
  ACCUMULATORS8(C, d, 0), ACCUMULATORS8(C, d, 8), ACCUMULATORS8(C, d, 16), ACCUMULATORS8(C, d, 24), \
      ACCUMULATORS8(C, d, 32), ACCUMULATORS8(C, d, 40), ACCUMULATORS8(C, d, 48),                   \
      ACCUMULATORS8(C, d, 56)
// The same for the 68 accumulators of an n136 product (operands from %68).
#define ACCUMULATOR_REGISTERS_68                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                        \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "               \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "               \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "               \
  "%64, %65, %66, %67}, "
#define ACCUMULATORS_68(C, d) ACCUMULATORS(C, d), C(d[64]), C(d[65]), C(d[66]), C(d[67])
// The same for the 48 and 32 accumulators of an n96 or n64 product (operands from %48 or %32).
#define ACCUMULATOR_REGISTERS_48                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                        \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "               \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "
#define ACCUMULATORS_48(C, d)                                                                      \
  ACCUMULATORS8(C, d, 0), ACCUMULATORS8(C, d, 8), ACCUMULATORS8(C, d, 16), ACCUMULATORS8(C, d, 24), \
      ACCUMULATORS8(C, d, 32), ACCUMULATORS8(C, d, 40)
#define ACCUMULATOR_REGISTERS_32                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                        \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define ACCUMULATORS_32(C, d)                                                                      \
  ACCUMULATORS8(C, d, 0), ACCUMULATORS8(C, d, 8), ACCUMULATORS8(C, d, 16), ACCUMULATORS8(C, d, 24)

