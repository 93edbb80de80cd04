//! Progress on stderr: bars on a terminal, plain lines otherwise (logs, CI), nothing with --quiet.

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

    /// A message that is not an error (shown unless --quiet).
    pub fn note(&self, message: &str) {
        self.finish_bar();
        if !self.quiet {
            eprintln!("{message}");
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
