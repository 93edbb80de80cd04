# Does the first copy from a page-locked file mapping cost host time (lazy mapping)? Per-call host
# time of async copies, pass 1 vs pass 2, for READ_ONLY and READ_ONLY|DEVICEMAP registrations,
# and for an anonymous arena registered the same way.
import ctypes, mmap, os, time, numpy as np, torch
GiB = 1 << 30
cuda = ctypes.CDLL("libcuda.so.1")
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
stream = torch.cuda.Stream(); sp = ctypes.c_void_p(stream.cuda_stream)
n = 3 * GiB; piece = 4 << 20
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
path = "/dev/shm/pin-first.bin"
with open(path, "wb") as f:
    blk = os.urandom(64 << 20)
    for _ in range(n // len(blk)): f.write(blk)
def passes(ptr, label):
    for p in range(3):
        host = 0.0; t0 = time.perf_counter()
        for off in range(0, n, piece):
            t = time.perf_counter()
            r = cuda.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(dev.data_ptr() + off), ctypes.c_void_p(ptr + off), ctypes.c_size_t(piece), sp)
            host += time.perf_counter() - t
            assert r == 0, r
        stream.synchronize(); wall = time.perf_counter() - t0
        print(f"{label} pass {p}: calls {host:.3f} s, wall {wall:.3f} s ({n/wall/1e9:.1f} GB/s)", flush=True)
for flags, name in [(0x08, "file READ_ONLY"), (0x0A, "file READ_ONLY|DEVICEMAP")]:
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ)
    a = np.frombuffer(m, dtype=np.uint8); ptr = a.ctypes.data
    t = time.perf_counter(); r = cuda.cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(n), ctypes.c_uint(flags))
    print(f"{name}: register rc {r} {time.perf_counter()-t:.3f} s", flush=True)
    if r == 0:
        passes(ptr, name)
        cuda.cuMemHostUnregister(ctypes.c_void_p(ptr))
    del a; m.close(); os.close(fd)
# anonymous memory, filled then registered
a = np.empty(n, dtype=np.uint8); a[:] = 1; ptr = a.ctypes.data
t = time.perf_counter(); r = cuda.cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(n), ctypes.c_uint(0))
print(f"anon: register rc {r} {time.perf_counter()-t:.3f} s", flush=True)
passes(ptr, "anon")
os.remove(path)
