#!/usr/bin/env python3
"""How fast can host memory be page-locked on this machine? (informs the offload setup time)

Measures, through the CUDA driver API (ctypes, no torch): cuMemHostAlloc of 1 GiB pieces one after
another and from several threads at once, and cuMemHostRegister of memory that was first allocated
and filled as ordinary memory (4 KiB pages, and transparent huge pages via madvise).
  python3 bench/pin_cost.py [GIB=8]
"""
import ctypes, mmap, sys, time, threading
from concurrent.futures import ThreadPoolExecutor

GIB = 1 << 30
total = int(sys.argv[1]) if len(sys.argv) > 1 else 8
cu = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL("libc.so.6", use_errno=True)
def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")
ck(cu.cuInit(0), "cuInit")
dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
def bind():
    ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
bind()
cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
cu.cuMemFreeHost.argtypes = [ctypes.c_void_p]
cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

def host_alloc(size):
    bind(); p = ctypes.c_void_p(); ck(cu.cuMemHostAlloc(ctypes.byref(p), size, 0), "cuMemHostAlloc"); return p.value

def report(name, seconds, nbytes):
    print(f"{name:58s} {seconds:7.2f} s  {nbytes / GIB / seconds:6.2f} GiB/s", flush=True)

# 1. cuMemHostAlloc, 1 GiB at a time, serial.
t = time.perf_counter(); ptrs = [host_alloc(GIB) for _ in range(total)]; report(f"cuMemHostAlloc {total} x 1 GiB, serial", time.perf_counter() - t, total * GIB)
for p in ptrs: cu.cuMemFreeHost(p)
# 2. the same from several threads.
for threads in (4, 16):
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex: ptrs = list(ex.map(host_alloc, [GIB] * total))
    report(f"cuMemHostAlloc {total} x 1 GiB, {threads} threads", time.perf_counter() - t, total * GIB)
    for p in ptrs: cu.cuMemFreeHost(p)
# 3. cuMemHostRegister of ordinary memory, already touched (as when it was filled first).
MAP = 0x02 | 0x20  # MAP_PRIVATE | MAP_ANONYMOUS
def region(huge):
    p = libc.mmap(None, GIB, 3, MAP, -1, 0)
    if huge: libc.madvise(p, GIB, 14)  # MADV_HUGEPAGE
    return p
def touch(p):
    ctypes.memset(p, 1, GIB)
def register(p):
    bind(); ck(cu.cuMemHostRegister_v2(p, GIB, 0), "cuMemHostRegister")
for huge in (False, True):
    for threads in (1, 8):
        ptrs = [region(huge) for _ in range(total)]
        t = time.perf_counter()
        with ThreadPoolExecutor(8) as ex: list(ex.map(touch, ptrs))
        touched = time.perf_counter() - t
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex: list(ex.map(register, ptrs))
        report(f"cuMemHostRegister {total} x 1 GiB, huge={huge}, {threads} threads (touch {touched:.2f} s)", time.perf_counter() - t, total * GIB)
        for p in ptrs: cu.cuMemHostUnregister(p); libc.munmap(p, GIB)
print(open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip())
