#!/usr/bin/env python3
"""Why the first large host allocation of a process can be slow on the lent GPU machine.

Times allocating and touching 20-40 GiB of anonymous memory (as the offload engine's arenas are filled),
with 4 KiB pages and with transparent huge pages (madvise), before and after the page cache holds
a 30 GiB tmpfs file, printing MemTotal each time (the VM's memory grows as it is first used).
  python3 bench/host_memory_growth.py
"""
import ctypes, os, time
from concurrent.futures import ThreadPoolExecutor

GIB = 1 << 30
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

def mem_total():
    return next(l.split()[1] for l in open("/proc/meminfo") if l.startswith("MemTotal")) + " kB"

def run(label, gib, huge):
    t = time.perf_counter()
    ptrs = [libc.mmap(None, GIB, 3, 0x22, -1, 0) for _ in range(gib)]
    if huge:
        for p in ptrs: libc.madvise(p, GIB, 14)
    with ThreadPoolExecutor(8) as ex: list(ex.map(lambda p: ctypes.memset(p, 1, GIB), ptrs))
    s = time.perf_counter() - t
    for p in ptrs: libc.munmap(p, GIB)
    print(f"{label:40s} {gib} GiB in {s:6.2f} s ({gib / s:5.1f} GiB/s), MemTotal {mem_total()}", flush=True)

for f in ("enabled", "defrag"):
    print(f, open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip())
print("MemTotal", mem_total())
run("huge pages, first use of this memory", 40, True)
run("huge pages, again", 40, True)
run("4k pages", 20, False)
run("4k pages, again", 20, False)
path = "/dev/shm/page-cache-fill"
with open(path, "wb") as f:
    chunk = b"\1" * (256 << 20)
    for _ in range(30 * 4): f.write(chunk)
print("wrote 30 GiB to", path, "MemTotal", mem_total())
run("huge pages, page cache full", 20, True)
run("4k pages, page cache full", 20, False)
run("huge pages, page cache full, again", 20, True)
os.remove(path)
