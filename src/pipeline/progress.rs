//! Progress on stderr: bars on a terminal, plain lines otherwise (logs, CI), nothing with --quiet.

use crate::memory::accounting::MemoryPeaks;
use crate::memory::overrides::{report_lines, Override};
use crate::weights::OnRead;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::Mutex;

/// Reports where a run is. stdout is never touched: it carries only the paths written.
pub struct Progress {
    terminal: bool,
    quiet: bool,
    bar: Mutex<Option<ProgressBar>>,
}

impl Progress {
    /// A reporter for this process's stderr.
    pub fn new(quiet: bool) -> Self {
        Progress {
            terminal: std::io::stderr().is_terminal(),
            quiet,
            bar: Mutex::new(None),
        }
    }

    /// A stage starts for job `index` of `total`.
    pub fn stage(&self, index: usize, total: usize, stage: &str) {
        self.finish_bar();
        if !self.quiet {
            eprintln!("[{}/{}] {stage}", index + 1, total);
        }
    }

    /// Denoising step `done` of `total` finished.
    pub fn step(&self, done: usize, total: usize) {
        if self.quiet {
            return;
        }
        if !self.terminal {
            eprintln!("  step {done}/{total}");
            return;
        }
        let mut bar = self.bar.lock().unwrap_or_else(|e| e.into_inner());
        let b = bar.get_or_insert_with(|| {
            let b = ProgressBar::new(total as u64);
            b.set_style(
                ProgressStyle::with_template("  {bar:30} {pos}/{len} steps {per_sec} ETA {eta}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b
        });
        b.set_position(done as u64);
        if done == total {
            b.finish();
            *bar = None;
        }
    }

    /// A byte counter for reading `what` (`total` bytes when known): a bar on a terminal, a
    /// line at each quarter otherwise. The next message or stage ends it.
    pub fn bytes(self: &std::sync::Arc<Self>, what: &str, total: Option<u64>) -> OnRead {
        if self.quiet {
            return std::sync::Arc::new(|_| {});
        }
        self.finish_bar();
        let what = what.to_string();
        if !self.terminal {
            let Some(total) = total.filter(|&t| t > 0) else {
                return std::sync::Arc::new(|_| {});
            };
            let done = std::sync::atomic::AtomicU64::new(0);
            return std::sync::Arc::new(move |n| {
                let before = done.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                let (q0, q1) = (before * 4 / total, (before + n) * 4 / total);
                if q1 > q0 && q1 <= 4 {
                    eprintln!("  {what}: {}% of {total} bytes", q1 * 25);
                }
            });
        }
        let template = match total {
            Some(_) => "  {msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
            None => "  {msg} {spinner} {bytes} {bytes_per_sec}",
        };
        let bar = match total {
            Some(t) => ProgressBar::new(t),
            None => ProgressBar::new_spinner(),
        };
        bar.set_style(
            ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_message(what);
        *self.bar.lock().unwrap_or_else(|e| e.into_inner()) = Some(bar.clone());
        std::sync::Arc::new(move |n| bar.inc(n))
    }

    /// A message that is not an error (shown unless --quiet).
    pub fn note(&self, message: &str) {
        self.finish_bar();
        if !self.quiet {
            eprintln!("{message}");
        }
    }

    /// What the device changed in the options, as [`report_lines`] groups them.
    pub fn overrides(&self, overrides: &[Override]) {
        for line in report_lines(overrides) {
            self.note(&line);
        }
    }

    /// An error: shown even with --quiet.
    pub fn error(&self, message: &str) {
        self.finish_bar();
        eprintln!("{message}");
    }

    fn finish_bar(&self) {
        if let Some(b) = self.bar.lock().unwrap_or_else(|e| e.into_inner()).take() {
            b.finish_and_clear();
        }
    }
}

/// One line for the memory of a stage or a load: the device pool's peaks (used / reserved) and
/// the host RSS peak. Without a device pool (the CPU, Metal) every device figure is 0, not a
/// measurement, so only the host peak is shown.
pub fn describe_peaks(p: &MemoryPeaks) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    let host = format!("host RSS peak {:.2} GiB", p.host_rss_peak as f64 / GIB);
    let measured = p.device_used_peak > 0 || p.device_reserved_peak > 0 || p.device_in_use_now > 0;
    if !measured {
        return host;
    }
    format!(
        "device peak {:.2} GiB used, {:.2} GiB reserved; {host}",
        p.device_used_peak as f64 / GIB,
        p.device_reserved_peak as f64 / GIB,
    )
}
