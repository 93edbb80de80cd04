//! Hostile but realistic inputs (issue 17): NUL bytes in prompts, non-UTF-8 paths, a
//! `--stats-json` aimed at the run's own files, two runs racing for one output name and sizes
//! no machine can hold. Each must end in a clean error or a clean run, never a panic or lost data.

use serde_json::Value;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh, empty scratch folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-hostile-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny synthetic run on the CPU.
const TINY: [&str; 13] = [
    "generate",
    "--model",
    "synthetic:wan2.1-tiny",
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
];

fn vidgen<S: AsRef<OsStr>>(extra: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(TINY)
        .args(extra)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run vidgen")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Asserts exit code 2 with one `error:` line, no panic and nothing on stdout.
fn assert_refused(out: &Output, needles: &[&str]) {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.starts_with("note:")).collect();
    assert_eq!(lines.len(), 1, "not one line: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{stderr:?} lacks {n:?}");
    }
    assert!(out.stdout.is_empty(), "stdout: {}", text(&out.stdout));
}

fn stats(path: &Path) -> Value {
    let body = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("--stats-json {} not written: {e}", path.display()));
    serde_json::from_str(&body).unwrap()
}

fn statuses(stats: &Value) -> Vec<String> {
    stats["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["status"].as_str().unwrap().to_string())
        .collect()
}

/// Every file (not folder) in `dir`, sorted.
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

#[test]
fn nul_bytes_in_prompts_are_escaped_in_metadata_and_every_prompt_runs() {
    let dir = scratch("nul");
    // A .txt prompt file: the middle line holds a NUL byte.
    let txt = dir.join("p.txt");
    std::fs::write(&txt, b"ok\nb\x00c\nok3\n").unwrap();
    // A JSONL prompt file with an escaped NUL.
    let jsonl = dir.join("p.jsonl");
    std::fs::write(
        &jsonl,
        "{\"prompt\": \"x\\u0000y\"}\n{\"prompt\": \"after\"}\n",
    )
    .unwrap();
    // A TOML config whose prompt holds a NUL.
    let toml = dir.join("c.toml");
    std::fs::write(&toml, "prompt = \"t\\u0000u\"\n").unwrap();
    let cases: Vec<(&str, Vec<String>, usize)> = vec![
        (
            "txt",
            vec![
                "--prompt-file".into(),
                txt.to_str().unwrap().into(),
                "--batch-order".into(),
                "prompt".into(),
            ],
            3,
        ),
        (
            "jsonl",
            vec!["--prompt-file".into(), jsonl.to_str().unwrap().into()],
            2,
        ),
        (
            "toml",
            vec!["--config".into(), toml.to_str().unwrap().into()],
            1,
        ),
    ];
    for (name, flags, n) in cases {
        let out_dir = dir.join(format!("out-{name}"));
        let stats_path = dir.join(format!("{name}.json"));
        let mut args = flags.clone();
        args.extend([
            "--output-path".into(),
            out_dir.to_str().unwrap().into(),
            "--stats-json".into(),
            stats_path.to_str().unwrap().into(),
        ]);
        let run = vidgen(&args);
        let stderr = text(&run.stderr);
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
        assert!(run.status.success(), "{name}: {stderr}");
        let s = stats(&stats_path);
        assert_eq!(statuses(&s), vec!["written"; n], "{name}: {s}");
        let videos: Vec<String> = names(&out_dir)
            .into_iter()
            .filter(|f| f.ends_with(".mp4"))
            .collect();
        assert_eq!(videos.len(), n, "{name}: {videos:?}");
        // The NUL survives in the stats (JSON escapes it) and in the MP4's tags, escaped.
        assert!(
            s["jobs"][if name == "txt" { 1 } else { 0 }]["prompt"]
                .as_str()
                .unwrap()
                .contains('\0'),
            "{name}: {s}"
        );
    }
}
