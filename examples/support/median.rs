//! The examples' timer: the median wall time of repeated device work.

use std::time::Instant;

use candle_core::Device;

/// Median seconds of `reps` calls of `f` after one warm-up call, each ended by a device
/// synchronize.
pub fn median_seconds<T, E>(
    dev: &Device,
    reps: usize,
    mut f: impl FnMut() -> Result<T, E>,
) -> anyhow::Result<f64>
where
    anyhow::Error: From<E>,
{
    f()?;
    dev.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        dev.synchronize()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[reps / 2])
}
