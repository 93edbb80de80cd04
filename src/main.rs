//! The `vidgen` binary: parse, resolve, run; errors become one line and an exit code.

use std::process::ExitCode;
use vidgen::cli::{self, Parsed, ResolvedConfig, UsageError};

fn main() -> ExitCode {
    ignore_file_size_signal();
    match run() {
        Ok(code) => code,
        Err(e) => {
            if let Some(usage) = e.downcast_ref::<UsageError>() {
                eprintln!("error: {usage}");
                ExitCode::from(2)
            } else {
                eprintln!("error: {e:#}");
                ExitCode::from(1)
            }
        }
    }
}

fn run() -> anyhow::Result<ExitCode> {
    let args = match cli::parse(std::env::args_os())? {
        Parsed::Info(text) => {
            print!("{text}");
            return Ok(ExitCode::SUCCESS);
        }
        Parsed::Generate(args) => args,
    };
    let config = ResolvedConfig::resolve(*args)?;
    let code = vidgen::pipeline::run(config);
    vidgen::teardown::finish();
    code
}

/// Past a file-size limit (`ulimit -f`) a write raises SIGXFSZ, which kills the process with no
/// message, a temporary left behind and no `--stats-json`. Ignored, the write fails with EFBIG
/// instead and takes the ordinary error path: the prompt fails naming the file, the temporary
/// is removed, the stats are written.
fn ignore_file_size_signal() {
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to SIG_IGN at start-up, before any thread exists.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}
