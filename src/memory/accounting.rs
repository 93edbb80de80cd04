//! Memory accounting: peak device memory from the CUDA memory pool's high-water marks (every
//! candle allocation goes through the default stream-ordered pool), the context's share from
//! cuMemGetInfo, and the process's resident host memory.

use candle_core::Device;
use serde::Serialize;

/// Peaks over an interval (since the last reset).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct MemoryPeaks {
    /// Bytes the pool handed out at most (what tensors used).
    pub device_used_peak: u64,
    /// Bytes the pool held from the driver at most (what the device lost to us).
    pub device_reserved_peak: u64,
    /// Device bytes in use by every context right now (total - free), incl. the CUDA context.
    pub device_in_use_now: u64,
    /// Peak resident host memory of the process (VmHWM).
    pub host_rss_peak: u64,
}

/// Reads and resets the peaks of one device; a no-op on devices without a pool. It also sets
/// how the pool caches: what is freed stays in the pool for the interval's later allocations,
/// and goes back to the device when the next interval starts (a stage, a load) or when the free
/// memory is asked for.
pub struct MemoryMeter {
    #[cfg(feature = "cuda")]
    pool: Option<cuda::Pool>,
}

impl MemoryMeter {
    /// A meter for `device` (device figures stay 0 off CUDA).
    pub fn new(device: &Device) -> Self {
        let _ = device;
        MemoryMeter {
            #[cfg(feature = "cuda")]
            pool: match device {
                Device::Cuda(d) => cuda::Pool::of(d).inspect(cuda::Pool::keep_freed),
                _ => None,
            },
        }
    }

    /// Starts a new interval: what the pool holds unused goes back to the device, and the
    /// high-water marks drop to the current use.
    pub fn reset(&self) {
        #[cfg(feature = "cuda")]
        if let Some(p) = &self.pool {
            p.reset();
        }
    }

    /// The device memory free now, once the pool has returned what it holds unused (`None` off
    /// CUDA).
    pub fn device_free(&self) -> Option<u64> {
        #[cfg(feature = "cuda")]
        if let Some(p) = &self.pool {
            return p.free();
        }
        None
    }

    /// The peaks since the last reset.
    pub fn peaks(&self) -> MemoryPeaks {
        #[allow(unused_mut)]
        let mut peaks = MemoryPeaks {
            host_rss_peak: host_rss_peak(),
            ..Default::default()
        };
        #[cfg(feature = "cuda")]
        if let Some(p) = &self.pool {
            p.read(&mut peaks);
        }
        peaks
    }
}

/// VmHWM of this process from /proc (0 where unavailable).
fn host_rss_peak() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use super::MemoryPeaks;
    use candle_core::cuda::cudarc::driver::{sys, CudaContext};
    use std::sync::Arc;

    /// The device's default memory pool.
    pub struct Pool {
        pool: sys::CUmemoryPool,
        ctx: Arc<CudaContext>,
    }

    impl Pool {
        pub fn of(device: &candle_core::CudaDevice) -> Option<Self> {
            let ctx = device.cuda_stream().context().clone();
            ctx.bind_to_thread().ok()?;
            let mut cu_device: sys::CUdevice = 0;
            // SAFETY: plain driver queries with valid out-pointers on a bound context.
            unsafe { sys::cuDeviceGet(&mut cu_device, ctx.ordinal() as i32) }
                .result()
                .ok()?;
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, cu_device) }
                .result()
                .ok()?;
            Some(Pool { pool, ctx })
        }

        fn attribute(&self, attr: sys::CUmemPool_attribute) -> u64 {
            let mut value: u64 = 0;
            // SAFETY: the *_MEM_* attributes are cuuint64_t.
            let r = unsafe {
                sys::cuMemPoolGetAttribute(self.pool, attr, &mut value as *mut u64 as *mut _)
            };
            if r.result().is_ok() {
                value
            } else {
                0
            }
        }

        /// Keeps what tensors free in the pool across synchronizations. By default the
        /// driver returns it to the device at every synchronization and maps it again for the
        /// next allocation: the Wan decode's chunks paid 0.1-0.4 s for that (an H200,
        /// `bench/RESULTS.md` session 31). [`Pool::trim`] returns it.
        pub fn keep_freed(&self) {
            let mut keep = u64::MAX;
            // SAFETY: the release threshold is a cuuint64_t.
            let _ = unsafe {
                sys::cuMemPoolSetAttribute(
                    self.pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut keep as *mut u64 as *mut _,
                )
            };
        }

        /// Returns what the pool holds unused to the device (after the work queued so far).
        fn trim(&self) {
            let _ = self.ctx.synchronize();
            // SAFETY: a valid pool; keeping 0 bytes releases every unused one.
            let _ = unsafe { sys::cuMemPoolTrimTo(self.pool, 0) };
        }

        pub fn reset(&self) {
            self.trim();
            for attr in [
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            ] {
                let mut zero: u64 = 0;
                // SAFETY: setting a high-water mark to 0 resets it to the current value.
                let _ = unsafe {
                    sys::cuMemPoolSetAttribute(self.pool, attr, &mut zero as *mut u64 as *mut _)
                };
            }
        }

        /// Bytes the pool's allocations hold now, and at most since [`Pool::reset`] (after the
        /// work queued so far).
        #[cfg(test)]
        pub fn used(&self) -> (u64, u64) {
            let _ = self.ctx.synchronize();
            (
                self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
                self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH),
            )
        }

        pub fn free(&self) -> Option<u64> {
            self.trim();
            self.ctx.mem_get_info().ok().map(|(free, _)| free as u64)
        }

        pub fn read(&self, peaks: &mut MemoryPeaks) {
            let _ = self.ctx.synchronize();
            peaks.device_used_peak =
                self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH);
            peaks.device_reserved_peak =
                self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH);
            if let Ok((free, total)) = self.ctx.mem_get_info() {
                peaks.device_in_use_now = (total - free) as u64;
            }
        }
    }

    // SAFETY: the pool handle is a process-wide driver object, usable from any thread.
    unsafe impl Send for Pool {}
    unsafe impl Sync for Pool {}
}
