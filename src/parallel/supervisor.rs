//! `vidgen generate --num-gpus N` on one machine: the process starts N workers of itself with a
//! launcher's environment (torchrun's variables, [`World::local_env`]) and supervises them.
//! Rank 0 alone inherits stdout (only it writes outputs, stats and paths); every worker's stderr
//! comes through line by line with its rank in front. A worker that fails (an exit other than
//! 0, or 1: "a prompt failed, the others ran") stops every other at once, so no rank waits on a
//! collective that can never complete; outputs are written under temporary names and renamed
//! when complete, so a stopped rank leaves none under a final name.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::world::World;

/// How a supervised run ended.
#[derive(Debug, PartialEq, Eq)]
pub struct Ended {
    /// The exit code the supervisor exits with: the first failing rank's, else 1 if a rank
    /// reported a failed prompt, else 0.
    pub code: i32,
    /// The rank that failed first and stopped the others.
    pub failed: Option<usize>,
}

/// Where prefixed stderr lines go (the supervisor's stderr; a buffer in tests).
pub type Sink = Arc<Mutex<dyn Write + Send>>;

/// Runs `program args` as `workers` ranks on this machine (rendezvous on 127.0.0.1:`port`),
/// every `leaders`-th of them (rank 0, `leaders`, ...) on this process's stdout, forwarding
/// their stderr to `sink` as `rank R: line`, until all end or one fails.
pub fn supervise(
    program: &Path,
    args: &[OsString],
    (workers, leaders): (usize, usize),
    port: u16,
    sink: Sink,
) -> std::io::Result<Ended> {
    let mut children: Vec<Child> = Vec::with_capacity(workers);
    let mut readers = Vec::with_capacity(workers);
    for rank in 0..workers {
        let spawned = Command::new(program)
            .args(args)
            .envs(World::local_env(rank, workers, port))
            .stdin(Stdio::null())
            .stdout(if rank.is_multiple_of(leaders.max(1)) {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                stop(&mut children);
                return Err(e);
            }
        };
        let stderr = child.stderr.take().expect("piped");
        let sink = sink.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut out = sink.lock().unwrap();
                let _ = writeln!(out, "rank {rank}: {line}");
            }
        }));
        children.push(child);
    }
    let mut codes: Vec<Option<i32>> = vec![None; workers];
    let mut failed = None;
    while codes.iter().any(Option::is_none) {
        for (rank, child) in children.iter_mut().enumerate() {
            if codes[rank].is_some() {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                // Killed by a signal: a failure, reported as a shell would.
                let code = status.code().unwrap_or(137);
                codes[rank] = Some(code);
                if code > 1 && failed.is_none() {
                    failed = Some(rank);
                }
            }
        }
        if take_sigterm() {
            for (rank, child) in children.iter().enumerate() {
                if codes[rank].is_none() {
                    terminate(child);
                }
            }
        }
        if failed.is_some() {
            for (rank, child) in children.iter_mut().enumerate() {
                if codes[rank].is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                    codes[rank] = Some(137);
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for reader in readers {
        let _ = reader.join();
    }
    let code = match failed {
        Some(rank) => codes[rank].unwrap_or(1),
        None => codes.iter().flatten().copied().max().unwrap_or(0),
    };
    if let Some(rank) = failed {
        let mut out = sink.lock().unwrap();
        let _ = writeln!(
            out,
            "error: rank {rank} failed (exit {code}); the other ranks were stopped"
        );
    }
    Ok(Ended { code, failed })
}

/// Whether a SIGTERM came since the last call (after [`forward_sigterm`]).
static SIGTERM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn take_sigterm() -> bool {
    SIGTERM.swap(false, std::sync::atomic::Ordering::SeqCst)
}

#[cfg(unix)]
extern "C" fn record_sigterm(_: libc::c_int) {
    SIGTERM.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// From now on a SIGTERM to this process is passed on to the workers [`supervise`] runs, each
/// of which then stops as on Ctrl-C (the supervisor exits as they do).
pub fn forward_sigterm() {
    #[cfg(unix)]
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGTERM,
            record_sigterm as extern "C" fn(libc::c_int) as libc::sighandler_t,
        )
    };
}

/// Sends `child` a SIGTERM.
fn terminate(child: &Child) {
    #[cfg(unix)]
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: signals one process of ours; an error (it has just exited) changes nothing.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
}

/// Kills and reaps `children` (after a failed start).
fn stop(children: &mut [Child]) {
    for child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A TCP port free now on this machine, for the workers' rendezvous.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    /// Runs a shell script as `workers` ranks; returns how it ended and the stderr lines.
    fn run(script: &str, workers: usize) -> (Ended, Vec<String>) {
        let buffer: Arc<Mutex<Vec<u8>>> = Arc::new(Mutex::new(Vec::new()));
        let sink: Sink = buffer.clone();
        let args: Vec<OsString> = vec!["-c".into(), script.into()];
        let ended =
            supervise(Path::new("/bin/sh"), &args, (workers, workers), 29999, sink).unwrap();
        let text = String::from_utf8(buffer.lock().unwrap().clone()).unwrap();
        (ended, text.lines().map(String::from).collect())
    }

    #[test]
    fn workers_get_the_launcher_environment_and_rank_prefixed_stderr() {
        let (ended, mut lines) = run(
            "echo \"$RANK/$WORLD_SIZE local $LOCAL_RANK at $MASTER_ADDR:$MASTER_PORT\" >&2",
            3,
        );
        assert_eq!(
            ended,
            Ended {
                code: 0,
                failed: None
            }
        );
        lines.sort();
        assert_eq!(
            lines,
            [
                "rank 0: 0/3 local 0 at 127.0.0.1:29999",
                "rank 1: 1/3 local 1 at 127.0.0.1:29999",
                "rank 2: 2/3 local 2 at 127.0.0.1:29999",
            ]
        );
    }

    #[test]
    fn a_failing_rank_stops_the_others() {
        // Rank 1 fails; the others would wait (as on a collective) until stopped.
        let (ended, lines) = run(
            "if [ \"$RANK\" = 1 ]; then echo boom >&2; exit 3; fi; exec sleep 600",
            3,
        );
        assert_eq!(
            ended,
            Ended {
                code: 3,
                failed: Some(1)
            }
        );
        assert!(lines.contains(&"rank 1: boom".to_string()), "{lines:?}");
        assert_eq!(
            lines.last().unwrap(),
            "error: rank 1 failed (exit 3); the other ranks were stopped"
        );
    }

    #[test]
    fn a_failed_prompt_is_not_a_failed_rank() {
        // Exit 1 (a prompt failed, the others ran): the other ranks finish their work.
        let (ended, lines) = run(
            "if [ \"$RANK\" = 0 ]; then exit 1; fi; sleep 0.2; echo done >&2",
            2,
        );
        assert_eq!(
            ended,
            Ended {
                code: 1,
                failed: None
            }
        );
        assert_eq!(lines, ["rank 1: done"]);
    }
}
