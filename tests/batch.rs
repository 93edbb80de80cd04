//! Unattended runs through the binary: prompt files and their errors, stage-major batches,
//! output names, --overwrite/--resume, --quiet, Ctrl-C, --stats-json and bad inputs that must
//! leave nothing partial behind.

mod common;

use common::fixture_dir;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A fresh, empty scratch folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-batch-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny-run flags: the fixture model on the CPU at a few pixels and steps.
fn tiny_args(out: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "generate",
        "--model",
        fixture_dir().to_str().unwrap(),
        "--device",
        "cpu",
        "--height",
        "32",
        "--width",
        "32",
        "--num-frames",
        "5",
        "--num-inference-steps",
        "2",
        "--max-sequence-length",
        "16",
        "--seed",
        "1",
        "--output-path",
    ]
    .map(String::from)
    .to_vec();
    args.push(out.to_str().unwrap().into());
    args
}

fn command(out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vidgen"));
    c.args(tiny_args(out))
        .args(extra)
        .env("HF_HUB_OFFLINE", "1");
    c
}

fn vidgen(out: &Path, extra: &[&str]) -> Output {
    command(out, extra).output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn lines(bytes: &[u8]) -> Vec<String> {
    text(bytes).lines().map(String::from).collect()
}

/// The names in a folder (empty if it does not exist).
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn write(path: &Path, contents: impl AsRef<[u8]>) -> String {
    std::fs::write(path, contents).unwrap();
    path.to_str().unwrap().to_string()
}

/// Asserts a failed run: its exit code, every needle in stderr, no panic, and `out` empty.
fn assert_fails(run: &Output, code: i32, needles: &[&str], out: &Path) {
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(code), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{stderr:?} lacks {n:?}");
    }
    assert!(run.stdout.is_empty(), "stdout: {}", text(&run.stdout));
    assert_eq!(names(out), Vec::<String>::new(), "left behind in {out:?}");
}

#[test]
fn bad_prompt_files_are_refused_with_file_and_line_before_any_model_loads() {
    let dir = scratch("prompt-files");
    let out = dir.join("out");
    let jsonl = |name: &str, body: &str| write(&dir.join(format!("{name}.jsonl")), body);
    let cases: Vec<(String, Vec<String>)> = vec![
        (
            jsonl("unknown", "{\"prompt\": \"a\"}\n{\"prompt\": \"b\", \"sed\": 3}\n"),
            vec!["unknown.jsonl:2".into(), "unknown key `sed`".into()],
        ),
        (
            jsonl("bad-value", "# c\n\n{\"prompt\": \"a\", \"height\": 30}\n"),
            vec!["bad-value.jsonl:3".into(), "`height` is 30".into()],
        ),
        (
            jsonl("bad-type", "{\"prompt\": \"a\", \"seed\": \"one\"}\n"),
            vec!["bad-type.jsonl:1".into(), "bad value for `seed`".into()],
        ),
        (
            jsonl("syntax", "{\"prompt\": \"a\"}\n{\"prompt\": \"b\",}\n"),
            vec!["syntax.jsonl:2".into(), "not valid JSON".into()],
        ),
        (
            jsonl("not-object", "\"just a string\"\n"),
            vec!["not-object.jsonl:1".into(), "JSON object".into()],
        ),
        (
            jsonl("no-prompt", "{\"seed\": 1}\n"),
            vec!["no-prompt.jsonl:1".into(), "`prompt`".into()],
        ),
        (
            jsonl("empty-prompt", "{\"prompt\": \"  \"}\n"),
            vec!["empty-prompt.jsonl:1".into(), "empty".into()],
        ),
        (
            jsonl("frames", "{\"prompt\": \"a\", \"num_frames\": 8}\n"),
            vec!["frames.jsonl:1".into(), "4k+1".into()],
        ),
        (
            jsonl("name", "{\"prompt\": \"a\", \"output_video_name\": \"../up\"}\n"),
            vec!["name.jsonl:1".into(), "output_video_name".into()],
        ),
        (
            jsonl(
                "twice",
                "{\"prompt\": \"a\", \"output_video_name\": \"v\"}\n{\"prompt\": \"b\", \"output_video_name\": \"v\"}\n",
            ),
            vec!["twice.jsonl:2".into(), "twice.jsonl:1".into()],
        ),
        (
            write(&dir.join("empty.txt"), ""),
            vec!["empty.txt".into(), "no prompts".into()],
        ),
        (
            write(&dir.join("comments.txt"), "# only\n\n   \n# comments\n"),
            vec!["comments.txt".into(), "no prompts".into()],
        ),
        (
            write(&dir.join("latin1.txt"), b"a fox\nun caf\xe9\n"),
            vec!["latin1.txt:2".into(), "UTF-8".into()],
        ),
        (
            dir.join("missing.txt").to_str().unwrap().into(),
            vec!["missing.txt".into()],
        ),
    ];
    for (file, needles) in cases {
        let run = vidgen(&out, &["--prompt-file", &file]);
        let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
        assert_fails(&run, 2, &needles, &out);
        let stderr = text(&run.stderr);
        let errors = stderr.lines().filter(|l| l.starts_with("error:")).count();
        assert_eq!(errors, 1, "one error line: {stderr}");
        assert!(!stderr.contains("loading"), "{stderr}");
    }
}

#[test]
fn slugs_are_plain_bounded_file_names() {
    use vidgen::pipeline::jobs::slug;
    assert_eq!(slug("A red fox, in the SNOW!"), "a-red-fox-in-the-snow");
    assert_eq!(slug("../../etc/passwd"), "etc-passwd");
    assert_eq!(slug("tab\there\nnew\u{7}line"), "tab-here-new-line");
    assert_eq!(slug("   ...  "), "video");
    assert_eq!(slug("Çà et là"), "çà-et-là");
    for prompt in [
        "x".repeat(500),
        "é".repeat(100),
        "word ".repeat(100),
        "İstanbul ".repeat(20),
    ] {
        let s = slug(&prompt);
        assert!(!s.is_empty() && s.len() <= 48, "{s:?}");
        assert!(s.chars().all(|c| c == '-' || c.is_alphanumeric()), "{s:?}");
    }
}

/// The `[i/n] stage` lines of a run's stderr, in order.
fn stage_lines(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter(|l| l.starts_with('[') && !l.contains(':'))
        .map(String::from)
        .collect()
}

#[test]
fn batch_order_stage_loads_each_component_once_prompt_order_per_prompt() {
    let dir = scratch("order");
    let prompts = write(&dir.join("p.txt"), "a fox\na boat\na tree\n");
    let stages = ["encode_text", "denoise", "decode", "write"];

    let out = dir.join("stage");
    let run = vidgen(
        &out,
        &[
            "--prompt-file",
            &prompts,
            "--lazy-module-load",
            "--batch-order",
            "stage",
        ],
    );
    let stderr = text(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    // Each stage for every prompt, except that each video is written as soon as it is decoded.
    let mut expected: Vec<String> = stages[..2]
        .iter()
        .flat_map(|s| (1..=3).map(move |i| format!("[{i}/3] {s}")))
        .collect();
    expected.extend((1..=3).flat_map(|i| [format!("[{i}/3] decode"), format!("[{i}/3] write")]));
    assert_eq!(stage_lines(&stderr), expected);
    for component in ["text_encoder", "transformer", "vae"] {
        let loads = stderr
            .lines()
            .filter(|l| *l == format!("loading {component}"))
            .count();
        assert_eq!(loads, 1, "{component}: {stderr}");
    }
    let written = lines(&run.stdout);
    assert_eq!(
        written,
        ["a-fox_001_seed1", "a-boat_002_seed2", "a-tree_003_seed3"]
            .map(|n| out.join(format!("{n}.mp4")).display().to_string())
    );

    // auto is stage-major under lazy load.
    let auto = vidgen(
        &dir.join("auto"),
        &["--prompt-file", &prompts, "--lazy-module-load"],
    );
    assert!(auto.status.success());
    assert_eq!(stage_lines(&text(&auto.stderr)), expected);

    let out = dir.join("prompt");
    let run = vidgen(
        &out,
        &[
            "--prompt-file",
            &prompts,
            "--lazy-module-load",
            "--batch-order",
            "prompt",
        ],
    );
    let stderr = text(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let expected: Vec<String> = (1..=3)
        .flat_map(|i| stages.iter().map(move |s| format!("[{i}/3] {s}")))
        .collect();
    assert_eq!(stage_lines(&stderr), expected);
    let loads = stderr.lines().filter(|l| *l == "loading vae").count();
    assert_eq!(loads, 3, "lazy, prompt-major: reloaded per prompt");

    // The dry run reports the order in force.
    let plan = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(["generate", "--dry-run", "--json", "--device", "cpu"])
        .args(["--batch-order", "prompt"])
        .output()
        .unwrap();
    let plan: Value = serde_json::from_slice(&plan.stdout).unwrap();
    assert_eq!(plan["batch_order"], "prompt");
    assert_eq!(plan["config"]["batch_order"], "prompt");
}

#[test]
fn an_existing_output_fails_alone_resume_skips_and_overwrite_replaces() {
    let dir = scratch("existing");
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let taken = out.join("taken.mp4");
    std::fs::write(&taken, "keep me").unwrap();
    let prompts = write(
        &dir.join("p.jsonl"),
        "{\"prompt\": \"a fox\"}\n{\"prompt\": \"a boat\", \"output_video_name\": \"taken\", \"seed\": 9}\n{\"prompt\": \"a tree\", \"num_frames\": 1}\n",
    );
    let stats = dir.join("stats.json");
    let stats_arg = stats.to_str().unwrap();

    let run = vidgen(
        &out,
        &["--prompt-file", &prompts, "--stats-json", stats_arg],
    );
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    let others = [
        out.join("a-fox_001_seed1.mp4"),
        out.join("a-tree_003_seed3.mp4"),
    ];
    assert_eq!(
        lines(&run.stdout),
        others
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
    );
    assert!(others.iter().all(|p| p.is_file()));
    assert_eq!(std::fs::read(&taken).unwrap(), b"keep me");
    assert!(stderr.contains("p.jsonl:2"), "{stderr}");
    assert!(stderr.contains("taken.mp4 already exists"), "{stderr}");
    assert!(stderr.contains("--overwrite"), "{stderr}");
    assert!(stderr.contains("1 of 3 prompts failed"), "{stderr}");

    let json: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert_eq!(json["status"], "failed");
    assert_eq!(json["vidgen_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(json["device"]["kind"], "cpu");
    assert_eq!(json["config"]["num_inference_steps"], 2);
    let jobs = json["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 3);
    assert_eq!(jobs[0]["status"], "written");
    assert_eq!(jobs[0]["origin"], format!("{prompts}:1"));
    assert_eq!(jobs[1]["status"], "failed");
    assert_eq!(jobs[1]["seed"], 9);
    assert!(jobs[1]["error"]
        .as_str()
        .unwrap()
        .contains("already exists"));
    assert_eq!(jobs[2]["num_frames"], 1);
    let stage_names: Vec<&str> = jobs[2]["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(stage_names, ["encode_text", "denoise", "decode", "write"]);
    assert!(jobs[2]["stages"][1]["seconds"].as_f64().unwrap() > 0.0);
    assert!(jobs[2]["metrics"].is_object());

    // --resume: everything exists now, nothing runs, nothing goes to stdout.
    let run = vidgen(&out, &["--prompt-file", &prompts, "--resume"]);
    let stderr = text(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(run.stdout.is_empty());
    assert_eq!(stderr.matches("(--resume)").count(), 4, "{stderr}");
    assert!(!stderr.contains("loading"), "{stderr}");
    assert_eq!(std::fs::read(&taken).unwrap(), b"keep me");

    // --resume after removing one output makes only that one.
    std::fs::remove_file(&others[1]).unwrap();
    let run = vidgen(&out, &["--prompt-file", &prompts, "--resume"]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert_eq!(lines(&run.stdout), [others[1].display().to_string()]);

    // --overwrite replaces the file.
    let run = vidgen(&out, &["--prompt-file", &prompts, "--overwrite"]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert_eq!(lines(&run.stdout).len(), 3);
    assert_ne!(std::fs::read(&taken).unwrap(), b"keep me");
    assert!(!names(&out).iter().any(|n| n.contains("partial")));

    let both = vidgen(
        &out,
        &["--prompt-file", &prompts, "--overwrite", "--resume"],
    );
    assert_eq!(both.status.code(), Some(2));
    assert!(text(&both.stderr).contains("--resume"));
}

#[test]
fn quiet_prints_only_errors() {
    let dir = scratch("quiet");
    let out = dir.join("out");
    let run = vidgen(&out, &["--prompt", "a fox", "--quiet"]);
    assert!(run.status.success());
    assert_eq!(text(&run.stderr), "");
    assert_eq!(lines(&run.stdout).len(), 1);

    let run = vidgen(&out, &["--prompt", "a fox", "--quiet"]);
    assert_eq!(run.status.code(), Some(1));
    let stderr = text(&run.stderr);
    assert!(run.stdout.is_empty());
    assert!(
        stderr
            .lines()
            .all(|l| l.starts_with("error:") || l.contains("failed")),
        "{stderr}"
    );
    assert!(stderr.contains("already exists"), "{stderr}");
}

/// A running `vidgen` whose stdout and stderr lines arrive on one channel as they are printed.
struct Live {
    child: std::process::Child,
    lines: mpsc::Receiver<(bool, String)>,
    stderr: String,
}

impl Live {
    fn spawn(out: &Path, extra: &[&str]) -> Live {
        let mut child = command(out, extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, rx) = mpsc::channel();
        let streams: [(bool, Box<dyn std::io::Read + Send>); 2] = [
            (true, Box::new(child.stdout.take().unwrap())),
            (false, Box::new(child.stderr.take().unwrap())),
        ];
        for (is_stdout, stream) in streams {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send((is_stdout, line));
                }
            });
        }
        Live {
            child,
            lines: rx,
            stderr: String::new(),
        }
    }

    /// Waits for the first line matching `want`; returns it.
    fn wait_for(&mut self, want: impl Fn(bool, &str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (is_stdout, line) = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no such line; stderr so far:\n{}", self.stderr));
            if !is_stdout {
                self.stderr += &format!("{line}\n");
            }
            if want(is_stdout, &line) {
                return line;
            }
        }
    }

    fn sigint(&self) {
        self.signal("INT");
    }

    /// Sends signal `name` (`INT`, `TERM`, `KILL`).
    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the exit; returns the exit code and the rest of stdout and stderr.
    fn finish(mut self) -> (Option<i32>, Vec<String>, String) {
        let status = self.child.wait().unwrap();
        let mut stdout = Vec::new();
        while let Ok((is_stdout, line)) = self.lines.recv_timeout(Duration::from_secs(10)) {
            if is_stdout {
                stdout.push(line);
            } else {
                self.stderr += &format!("{line}\n");
            }
        }
        (status.code(), stdout, self.stderr)
    }
}

#[test]
fn ctrl_c_keeps_finished_videos_and_abandons_the_rest() {
    stop_mid_batch("INT");
}

/// SIGTERM (a `kill`, a service manager, a scheduler's time limit) takes the Ctrl-C path:
/// finished videos kept, no temporary left, the stats written, exit 130.
#[test]
fn sigterm_takes_the_ctrl_c_path() {
    stop_mid_batch("TERM");
}

/// Signal `name` once the first of three videos is written and the second has begun.
fn stop_mid_batch(name: &str) {
    let dir = scratch(&format!("stop-{name}"));
    let out = dir.join("out");
    let prompts = write(&dir.join("p.txt"), "a fox\na boat\na tree\n");
    let stats = dir.join("stats.json");
    let mut live = Live::spawn(
        &out,
        &[
            "--prompt-file",
            &prompts,
            "--batch-order",
            "prompt",
            "--height",
            "64",
            "--width",
            "64",
            "--num-inference-steps",
            "4",
            "--stats-json",
            stats.to_str().unwrap(),
        ],
    );
    // Ctrl-C once the first video is written and the second prompt has begun (a Ctrl-C before
    // that would find it not begun: `not_run`, like the third). stdout and stderr lines may
    // arrive in either order.
    let first = std::cell::RefCell::new(None);
    let second_begun = std::cell::Cell::new(false);
    live.wait_for(|is_stdout, line| {
        if is_stdout {
            first.borrow_mut().get_or_insert_with(|| line.to_string());
        } else if line == "[2/3] denoise" {
            second_begun.set(true);
        }
        first.borrow().is_some() && second_begun.get()
    });
    let first = first.into_inner().unwrap();
    live.signal(name);
    let (code, rest, stderr) = live.finish();
    assert_eq!(code, Some(130), "{stderr}");
    assert!(rest.is_empty(), "only the first was finished: {rest:?}");
    assert_eq!(first, out.join("a-fox_001_seed1.mp4").display().to_string());
    assert!(Path::new(&first).is_file());
    assert_eq!(names(&out), ["a-fox_001_seed1.mp4"], "no partial files");
    assert!(stderr.contains("interrupted at"), "{stderr}");
    assert!(stderr.contains("of [2/3]"), "{stderr}");
    assert!(stderr.contains("--resume"), "{stderr}");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert_eq!(json["status"], "interrupted");
    let status: Vec<&str> = json["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["status"].as_str().unwrap())
        .collect();
    // The third never started: not run, not interrupted.
    assert_eq!(status, ["written", "interrupted", "not_run"]);
    assert!(json["jobs"][2]["stopped_at"].is_null());
}

/// `--resume` removes the temporaries of runs that ended without cleaning up (SIGKILL), in the
/// output folder and beside `--stats-json`, and keeps those of a running process.
#[test]
fn resume_removes_the_temporaries_of_runs_killed_before_cleaning_up() {
    let dir = scratch("stale");
    let out = dir.join("out");
    let prompts = write(&dir.join("p.txt"), "a fox\na boat\n");
    let stats = dir.join("stats.json");
    let args = [
        "--prompt-file",
        &prompts,
        "--stats-json",
        stats.to_str().unwrap(),
    ];
    // A run killed mid-batch: what it finished stays, its stats never came.
    let mut live = Live::spawn(&out, &args);
    live.wait_for(|is_stdout, _| is_stdout);
    live.signal("KILL");
    let _ = live.finish();
    // The temporaries a SIGKILL leaves mid-write (its process is gone), and one of a run
    // writing now (this test's process).
    let gone = ended_pid();
    let stale = [
        out.join(format!(".a-boat_002_seed2.mp4.{gone}-0.partial")),
        out.join(format!(".png-folder_seed1.{gone}-3.partial")),
        dir.join(format!(".stats.json.{gone}.partial")),
    ];
    std::fs::create_dir_all(&stale[1]).unwrap();
    for path in [&stale[0], &stale[2]] {
        std::fs::write(path, b"half").unwrap();
    }
    let running = out.join(format!(
        ".a-boat_002_seed2.mp4.{}-0.partial",
        std::process::id()
    ));
    std::fs::write(&running, b"being written").unwrap();
    // Not vidgen's: kept.
    std::fs::write(out.join(".notes.partial"), b"mine").unwrap();
    let mut resumed = args.to_vec();
    resumed.push("--resume");
    let run = vidgen(&out, &resumed);
    assert!(run.status.success(), "{}", text(&run.stderr));
    for path in &stale {
        assert!(!path.exists(), "{} left", path.display());
        assert!(text(&run.stderr).contains(&path.display().to_string()));
    }
    assert!(
        running.is_file(),
        "a running process's temporary was removed"
    );
    let mut left = names(&out);
    left.retain(|n| n.starts_with('.'));
    assert_eq!(
        left,
        [
            format!(".a-boat_002_seed2.mp4.{}-0.partial", std::process::id()),
            ".notes.partial".to_string()
        ]
    );
    assert!(stats.is_file());
}

/// The id of a process that has ended.
fn ended_pid() -> u32 {
    let mut child = Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    child.id()
}

#[test]
fn a_second_ctrl_c_exits_at_once() {
    let dir = scratch("ctrl-c-twice");
    let out = dir.join("out");
    let prompts = write(&dir.join("p.txt"), "a fox\na boat\na tree\n");
    let mut live = Live::spawn(
        &out,
        &[
            "--prompt-file",
            &prompts,
            "--height",
            "128",
            "--width",
            "128",
            "--num-frames",
            "9",
        ],
    );
    // Decoding takes seconds at this size: both signals arrive while it runs (the pause lets
    // the VAE load and the decode begin; a stage not yet begun would just be skipped).
    live.wait_for(|is_stdout, line| !is_stdout && line == "[1/3] decode");
    std::thread::sleep(Duration::from_millis(500));
    let start = Instant::now();
    live.sigint();
    live.wait_for(|is_stdout, line| !is_stdout && line.starts_with("interrupted:"));
    live.sigint();
    let (code, stdout, stderr) = live.finish();
    assert_eq!(code, Some(130), "{stderr}");
    assert!(stderr.contains("exiting now"), "{stderr}");
    assert!(stdout.is_empty());
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn stats_json_is_written_when_the_model_fails_to_load() {
    let dir = scratch("stats-error");
    let out = dir.join("out");
    let stats = dir.join("stats.json");
    let not_a_model = dir.join("empty-model");
    std::fs::create_dir_all(&not_a_model).unwrap();
    let run = vidgen(
        &out,
        &[
            "--prompt",
            "a fox",
            "--model",
            not_a_model.to_str().unwrap(),
            "--stats-json",
            stats.to_str().unwrap(),
        ],
    );
    assert_fails(&run, 1, &["model_index.json"], &out);
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert_eq!(json["status"], "error");
    assert!(json["error"].as_str().unwrap().contains("model_index.json"));
    assert_eq!(json["jobs"][0]["status"], "not_run");
    assert_eq!(json["jobs"][0]["prompt"], "a fox");
    assert!(names(&dir).iter().all(|n| !n.contains("partial")));

    // A folder is not a stats file.
    let run = vidgen(
        &out,
        &["--prompt", "a", "--stats-json", dir.to_str().unwrap()],
    );
    assert_fails(&run, 2, &["--stats-json", "folder"], &out);
}

#[test]
fn an_unwritable_output_folder_is_refused_before_loading() {
    let dir = scratch("unwritable");
    let file = dir.join("a-file");
    std::fs::write(&file, "").unwrap();
    let run = vidgen(&file.join("out"), &["--prompt", "a fox"]);
    assert_eq!(run.status.code(), Some(2));
    let stderr = text(&run.stderr);
    assert!(stderr.contains("output folder"), "{stderr}");
    assert!(stderr.contains("--output-path"), "{stderr}");
    assert_eq!(names(&dir), ["a-file"]);

    // A read-only folder (meaningless as root, who may write anywhere).
    use std::os::unix::fs::PermissionsExt;
    let ro = dir.join("read-only");
    std::fs::create_dir_all(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::write(ro.join("probe"), "").is_err() {
        let run = vidgen(&ro, &["--prompt", "a fox"]);
        assert_fails(&run, 2, &["not writable", "--output-path"], &ro);
    }
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn a_full_disk_fails_the_write_and_leaves_nothing() {
    // RLIMIT_FSIZE stands in for a full disk: writes past 2 KiB fail with EFBIG (vidgen ignores
    // SIGXFSZ itself: no `trap` here).
    let dir = scratch("full");
    for output_type in ["mp4", "safetensors"] {
        let out = dir.join(output_type);
        let args: Vec<String> = tiny_args(&out)
            .into_iter()
            .chain(["--prompt", "a fox", "--output-type", output_type].map(String::from))
            .map(|a| format!("'{a}'"))
            .collect();
        let script = format!(
            "ulimit -f 2; exec '{}' {}",
            env!("CARGO_BIN_EXE_vidgen"),
            args.join(" ")
        );
        let run = Command::new("bash")
            .args(["-c", &script])
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        assert_fails(
            &run,
            1,
            &["write", "File too large", "1 of 1 prompts failed"],
            &out,
        );
    }
}

/// Copies the fixture's configs, tokenizer and weights (not its references) to `dst`.
fn copy_fixture(dst: &Path) {
    let src = fixture_dir();
    for component in [
        "scheduler",
        "text_encoder",
        "tokenizer",
        "transformer",
        "vae",
    ] {
        std::fs::create_dir_all(dst.join(component)).unwrap();
        for e in std::fs::read_dir(src.join(component)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dst.join(component).join(e.file_name())).unwrap();
        }
    }
    std::fs::copy(src.join("model_index.json"), dst.join("model_index.json")).unwrap();
}

/// Splits a safetensors file into its JSON header and data.
fn split_safetensors(bytes: &[u8]) -> (serde_json::Map<String, Value>, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

fn join_safetensors(header: &serde_json::Map<String, Value>, data: &[u8]) -> Vec<u8> {
    let mut h = serde_json::to_vec(header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

#[test]
fn a_missing_shard_and_a_lying_header_are_named() {
    let dir = scratch("weights");

    // An index that names a shard that is not there.
    let model = dir.join("sharded");
    copy_fixture(&model);
    let weights = model.join("transformer/diffusion_pytorch_model.safetensors");
    let shard = "diffusion_pytorch_model-00001-of-00002.safetensors";
    let missing = "diffusion_pytorch_model-00002-of-00002.safetensors";
    std::fs::rename(&weights, model.join("transformer").join(shard)).unwrap();
    let (header, _) =
        split_safetensors(&std::fs::read(model.join("transformer").join(shard)).unwrap());
    let mut names: Vec<&String> = header.keys().filter(|k| *k != "__metadata__").collect();
    names.sort();
    let weight_map: serde_json::Map<String, Value> = names
        .iter()
        .enumerate()
        .map(|(i, n)| ((*n).clone(), json_str(if i == 0 { missing } else { shard })))
        .collect();
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    write(
        &model.join("transformer/diffusion_pytorch_model.safetensors.index.json"),
        index.to_string(),
    );
    let out = dir.join("sharded-out");
    let run = vidgen(
        &out,
        &["--prompt", "a fox", "--model", model.to_str().unwrap()],
    );
    assert_fails(&run, 1, &[missing, "transformer"], &out);

    // A header whose offsets claim more data than the file holds.
    let model = dir.join("lying");
    copy_fixture(&model);
    let weights = model.join("vae/diffusion_pytorch_model.safetensors");
    let (mut header, data) = split_safetensors(&std::fs::read(&weights).unwrap());
    let last = header
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .max_by_key(|(_, v)| v["data_offsets"][1].as_u64().unwrap())
        .map(|(k, _)| k.clone())
        .unwrap();
    let end = header[&last]["data_offsets"][1].as_u64().unwrap();
    header.get_mut(&last).unwrap()["data_offsets"][1] = (end + 4096).into();
    std::fs::write(&weights, join_safetensors(&header, &data)).unwrap();
    let out = dir.join("lying-out");
    let run = vidgen(
        &out,
        &["--prompt", "a fox", "--model", model.to_str().unwrap()],
    );
    assert_fails(&run, 1, &["vae"], &out);
}

fn json_str(s: &str) -> Value {
    Value::String(s.to_string())
}

/// A batch without --seed: one drawn base seed, recorded on stderr and in --stats-json, and a
/// rerun with --resume finds the finished prompts although it draws another seed.
#[test]
fn resume_without_a_seed_finds_finished_prompts() {
    let dir = scratch("resume-seedless");
    let out = dir.join("out");
    let prompts = write(&dir.join("p.txt"), "a fox\na boat\na tree\n");
    let stats = dir.join("stats.json");
    let run_batch = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_vidgen"))
            .args([
                "generate",
                "--model",
                "synthetic:wan2.1-tiny",
                "--device",
                "cpu",
            ])
            .args(["--height", "32", "--width", "32", "--num-frames", "5"])
            .args(["--num-inference-steps", "2", "--max-sequence-length", "16"])
            .args([
                "--prompt-file",
                &prompts,
                "--output-path",
                out.to_str().unwrap(),
            ])
            .args(["--stats-json", stats.to_str().unwrap()])
            .args(extra)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    let read_stats =
        || -> Value { serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap() };

    let first = run_batch(&[]);
    let stderr = text(&first.stderr);
    assert!(first.status.success(), "{stderr}");
    let json = read_stats();
    let base = json["config"]["seed"]
        .as_u64()
        .expect("the drawn seed is recorded");
    assert_eq!(json["seed_drawn"], true);
    assert!(
        stderr.contains(&format!("drew base seed {base}"))
            && stderr.contains(&format!("--seed {base}")),
        "{stderr}"
    );
    let seeds: Vec<u64> = json["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["seed"].as_u64().unwrap())
        .collect();
    assert_eq!(seeds, [base, base + 1, base + 2]);
    let made = names(&out);
    assert_eq!(made.len(), 3);
    assert!(
        made.contains(&format!("a-fox_001_seed{base}.mp4")),
        "{made:?}"
    );

    // One video lost: --resume makes only that one, and finds the others whatever the seed.
    let boat = out.join(format!("a-boat_002_seed{}.mp4", base + 1));
    std::fs::remove_file(&boat).unwrap();
    let second = run_batch(&["--resume"]);
    let stderr = text(&second.stderr);
    assert!(second.status.success(), "{stderr}");
    assert_eq!(stderr.matches("(--resume)").count(), 3, "{stderr}");
    let written = lines(&second.stdout);
    assert_eq!(written.len(), 1, "{written:?}");
    assert!(written[0].contains("a-boat_002_seed"), "{written:?}");
    assert_eq!(names(&out).len(), 3, "{:?}", names(&out));
    let json = read_stats();
    let statuses: Vec<&str> = json["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["skipped", "written", "skipped"]);
    assert_eq!(
        json["jobs"][0]["seed"], base,
        "a skipped prompt reports its file's seed"
    );

    // Everything is there: nothing runs, nothing new appears.
    let third = run_batch(&["--resume"]);
    assert!(third.status.success(), "{}", text(&third.stderr));
    assert!(third.stdout.is_empty());
    assert!(!text(&third.stderr).contains("loading"));
    assert_eq!(names(&out).len(), 3, "{:?}", names(&out));

    // A fixed seed asks for exactly those videos: they are made next to the others.
    let fixed = run_batch(&["--resume", "--seed", "7"]);
    assert!(fixed.status.success(), "{}", text(&fixed.stderr));
    assert_eq!(lines(&fixed.stdout).len(), 3);
    assert!(names(&out).contains(&"a-tree_003_seed9.mp4".to_string()));
    assert_eq!(read_stats()["seed_drawn"], false);
}
