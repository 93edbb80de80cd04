//! Ctrl-C: the first asks the run to stop at the next stage boundary or denoising step, so the
//! video in progress is abandoned cleanly and finished ones stay; the second exits at once.
//! SIGTERM (a `kill`, a service manager, a job scheduler's time limit) and SIGHUP (the terminal
//! closed) take the same path; a hang-up that was ignored (a run under `nohup`) stays ignored.

use std::sync::atomic::{AtomicBool, Ordering};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The exit code of a run stopped by Ctrl-C (128 + SIGINT, as shells report it).
pub const EXIT_CODE: u8 = 130;

/// The error a stage returns when it stops because of Ctrl-C.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by Ctrl-C or SIGTERM")]
pub struct Interrupted;

/// Installs the Ctrl-C (and SIGTERM, SIGHUP) handler. `quiet` suppresses the notice printed on
/// the first signal.
///
/// Installing twice in one process keeps the first handler.
pub fn install(quiet: bool) {
    let handler = move || {
        if INTERRUPTED.swap(true, Ordering::SeqCst) {
            eprintln!("interrupted again: exiting now");
            std::process::exit(i32::from(EXIT_CODE));
        }
        if !quiet {
            eprintln!(
                "interrupted: stopping at the next step (finished videos are kept); press Ctrl-C again to exit at once"
            );
        }
    };
    set_handler(handler);
}

/// `ctrlc::set_handler(handler)` for SIGINT, SIGTERM and SIGHUP, except that an ignored SIGHUP
/// (`nohup`) stays ignored: an unattended batch goes on when its terminal closes.
pub fn set_handler(handler: impl FnMut() + Send + 'static) {
    #[cfg(unix)]
    let hangup_ignored = {
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a null new action only reads the current one into `old`.
        let read = unsafe { libc::sigaction(libc::SIGHUP, std::ptr::null(), &mut old) };
        read == 0 && old.sa_sigaction == libc::SIG_IGN
    };
    // The only error is a handler already set (a library caller's, or an earlier run's).
    let _ = ctrlc::set_handler(handler);
    #[cfg(unix)]
    if hangup_ignored {
        // SAFETY: ignoring a signal installs no code.
        unsafe { libc::signal(libc::SIGHUP, libc::SIG_IGN) };
    }
}

/// Whether Ctrl-C was pressed.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// `Err(Interrupted)` once Ctrl-C was pressed: long loops call it between steps.
pub fn check() -> Result<(), Interrupted> {
    if interrupted() {
        Err(Interrupted)
    } else {
        Ok(())
    }
}
