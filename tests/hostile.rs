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
    // Notes on what the device forced may come first; the error is one line, the last.
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "not one error line: {stderr}");
    assert!(
        stderr.trim_end().lines().last() == Some(errors[0]),
        "{stderr}"
    );
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

/// `dir/name` with a byte that is not UTF-8 appended.
#[cfg(unix)]
fn non_utf8(dir: &Path, name: &str) -> std::ffi::OsString {
    use std::os::unix::ffi::OsStringExt;
    let mut bytes = dir.join(name).into_os_string().into_vec();
    bytes.push(0xff);
    std::ffi::OsString::from_vec(bytes)
}

#[cfg(unix)]
#[test]
fn non_utf8_paths_are_refused_at_once_with_their_flag() {
    use std::ffi::OsString;
    let dir = scratch("utf8");
    let bad_out = non_utf8(&dir, "o/bad");
    let bad_config = non_utf8(&dir, "c.toml");
    std::fs::write(&bad_config, "seed = 1\n").unwrap();
    let bad_stats = non_utf8(&dir, "s.json");
    let good_out: OsString = dir.join("out").into();
    let mut joined = OsString::from("--output-path=");
    joined.push(&bad_out);
    let s = |x: &str| OsString::from(x);
    let cases: Vec<(Vec<OsString>, &str)> = vec![
        (
            vec![
                s("--prompt"),
                s("x"),
                s("--output-path"),
                bad_out.clone(),
                s("--dry-run"),
            ],
            "--output-path",
        ),
        (
            vec![
                s("--prompt"),
                s("x"),
                s("--output-path"),
                bad_out.clone(),
                s("--dry-run"),
                s("--json"),
            ],
            "--output-path",
        ),
        (
            vec![s("--prompt"), s("x"), s("--output-path"), bad_out.clone()],
            "--output-path",
        ),
        (vec![s("--prompt"), s("x"), joined], "--output-path"),
        (
            vec![s("--prompt"), s("x"), s("--config"), bad_config.clone()],
            "--config",
        ),
        (
            vec![
                s("--prompt"),
                s("x"),
                s("--config"),
                bad_config,
                s("--dry-run"),
            ],
            "--config",
        ),
        (
            vec![
                s("--prompt"),
                s("x"),
                s("--output-path"),
                good_out.clone(),
                s("--stats-json"),
                bad_stats.clone(),
            ],
            "--stats-json",
        ),
        (
            vec![
                s("--prompt"),
                s("x"),
                s("--stats-json"),
                bad_stats,
                s("--dry-run"),
                s("--json"),
            ],
            "--stats-json",
        ),
    ];
    for (args, flag) in cases {
        let run = vidgen(&args);
        assert_refused(&run, &[flag, "not valid UTF-8"]);
    }
    // Nothing was made: no output folder, no stats file.
    assert_eq!(names(&dir), vec!["c.toml\u{fffd}".to_string()]);
    // A config file can spell a NUL byte in a path: refused the same way.
    for key in ["output_path", "stats_json"] {
        let config = dir.join(format!("{key}.toml"));
        std::fs::write(
            &config,
            format!("{key} = \"{}/x\\u0000y\"\n", dir.display()),
        )
        .unwrap();
        let run = vidgen(&["--prompt", "x", "--config", config.to_str().unwrap()]);
        assert_refused(&run, &["NUL byte"]);
    }
}

#[test]
fn stats_json_never_replaces_an_input_an_output_or_a_special_file() {
    let dir = scratch("stats-target");
    let out = dir.join("out");
    let prompts = dir.join("p.jsonl");
    let body = "{\"prompt\": \"a\"}\n";
    std::fs::write(&prompts, body).unwrap();
    let config = dir.join("c.toml");
    std::fs::write(&config, "seed = 3\n").unwrap();
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let o = p(&out);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--prompt-file".into(),
                p(&prompts),
                "--stats-json".into(),
                p(&prompts),
            ],
            "--prompt-file",
        ),
        (
            // The same file under another spelling.
            vec![
                "--prompt-file".into(),
                p(&prompts),
                "--stats-json".into(),
                p(&dir.join("out/../p.jsonl")),
            ],
            "--prompt-file",
        ),
        (
            vec![
                "--prompt".into(),
                "x".into(),
                "--config".into(),
                p(&config),
                "--stats-json".into(),
                p(&config),
            ],
            "--config",
        ),
        (
            vec![
                "--prompt".into(),
                "x".into(),
                "--stats-json".into(),
                "/dev/null".into(),
            ],
            "not a regular file",
        ),
        (
            vec![
                "--prompt".into(),
                "x".into(),
                "--output-video-name".into(),
                "v".into(),
                "--stats-json".into(),
                p(&out.join("v.mp4")),
            ],
            "is the output of",
        ),
    ];
    std::fs::create_dir_all(&out).unwrap();
    for (mut args, needle) in cases {
        args.extend(["--output-path".into(), o.clone()]);
        let run = vidgen(&args);
        assert_refused(&run, &["--stats-json", needle]);
        assert_eq!(std::fs::read_to_string(&prompts).unwrap(), body);
        assert_eq!(std::fs::read_to_string(&config).unwrap(), "seed = 3\n");
        assert_eq!(names(&out), Vec::<String>::new(), "{args:?}");
    }
    // The dry run refuses the same paths.
    let run = vidgen(&[
        "--prompt-file",
        &p(&prompts),
        "--stats-json",
        &p(&prompts),
        "--dry-run",
    ]);
    assert_refused(&run, &["--stats-json", "--prompt-file"]);

    // Only a new file, an empty one or stats vidgen wrote are written: never through a link,
    // never over another run's video or any other file, in a run and a dry run.
    let video = dir.join("other-run.mp4");
    std::fs::write(&video, b"\0\0\0\x20ftypisom").unwrap();
    let notes = dir.join("notes.json");
    std::fs::write(&notes, "{\"mine\": true}\n").unwrap();
    let target = dir.join("target.txt");
    std::fs::write(&target, "keep me\n").unwrap();
    let link = dir.join("link.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    for (path, needle) in [
        (&video, "is not stats vidgen wrote"),
        (&notes, "is not stats vidgen wrote"),
        (&link, "symbolic link"),
    ] {
        let path = p(path);
        for dry in [&[][..], &["--dry-run"][..]] {
            let args = [&["--prompt", "x", "--stats-json", &path][..], dry].concat();
            assert_refused(&vidgen(&args), &["--stats-json", needle]);
        }
    }
    assert_eq!(std::fs::read(&video).unwrap(), b"\0\0\0\x20ftypisom");
    assert_eq!(
        std::fs::read_to_string(&notes).unwrap(),
        "{\"mine\": true}\n"
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me\n");
    assert!(link.symlink_metadata().unwrap().file_type().is_symlink());
    // Stats of an earlier run, and an empty file, are written over.
    let stats_path = dir.join("stats.json");
    std::fs::write(&stats_path, "").unwrap();
    for _ in 0..2 {
        let run = vidgen(&[
            "--prompt",
            "x",
            "--stats-json",
            &p(&stats_path),
            "--output-path",
            &o,
        ]);
        assert!(run.status.success(), "{}", text(&run.stderr));
        assert_eq!(statuses(&stats(&stats_path)), ["written"]);
        std::fs::remove_dir_all(&out).unwrap();
    }
}

#[test]
fn sizes_no_machine_can_hold_are_refused_before_anything_allocates() {
    let cases: [(&[&str], &str); 6] = [
        // Every rank is planned: capped before the plans are allocated.
        (
            &["--num-gpus", "4294967295", "--memory-model", "discrete"],
            "1..=1024",
        ),
        // The text encoder's attention grows with the square of the length.
        (&["--max-sequence-length", "4097"], "pass at most 4096"),
        (&["--height", "1000000000"], "height"),
        (&["--width", "1000000000"], "width"),
        (&["--num-frames", "1000000001"], "num-frames"),
        (
            &[
                "--height",
                "16384",
                "--width",
                "16384",
                "--num-frames",
                "16385",
            ],
            "more than any machine can hold",
        ),
    ];
    let dir = scratch("sizes");
    let out = dir.join("out");
    for (flags, needle) in cases {
        for dry in [&[][..], &["--dry-run"][..], &["--dry-run", "--json"][..]] {
            let mut args: Vec<&str> = vec!["--prompt", "x", "--output-path", out.to_str().unwrap()];
            args.extend_from_slice(flags);
            args.extend_from_slice(dry);
            let run = vidgen(&args);
            assert_refused(&run, &[needle]);
        }
    }
    assert!(!out.exists(), "the output folder was created");
    // A prompt file's line merged with the flags: each value alone is fine, together not.
    let prompts = dir.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"a\"}\n{\"prompt\": \"b\", \"height\": 16384, \"width\": 16384}\n",
    )
    .unwrap();
    let run = vidgen(&[
        "--prompt-file",
        prompts.to_str().unwrap(),
        "--num-frames",
        "16385",
        "--output-path",
        out.to_str().unwrap(),
    ]);
    assert_refused(&run, &["p.jsonl:2", "more than any machine can hold"]);
    assert!(!out.exists(), "the output folder was created");
}

/// Hidden temporaries left in `dir`.
fn partials(dir: &Path) -> Vec<String> {
    names(dir)
        .into_iter()
        .filter(|n| n.starts_with('.'))
        .collect()
}

#[test]
fn concurrent_writers_of_one_name_use_their_own_temporaries_and_the_loser_reports_the_file() {
    use candle_core::{Device, Tensor};
    use vidgen::output::{self, OutputType};
    let dir = scratch("race-writers");
    let frames = Tensor::rand(0f32, 1f32, (3, 16, 16, 3), &Device::Cpu).unwrap();
    for kind in [OutputType::Mp4, OutputType::Safetensors, OutputType::Png] {
        let dest = dir.join(format!("v.{}", kind.extension()));
        let results: Vec<anyhow::Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|_| s.spawn(|| output::write_with(kind, &dest, &frames, 8, &[], false)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let won = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(won, 1, "{kind:?}: exactly one writer wins: {results:?}");
        for e in results.iter().filter_map(|r| r.as_ref().err()) {
            let msg = format!("{e:#}");
            assert!(msg.contains("already exists"), "{kind:?}: {msg}");
            assert!(msg.contains(&dest.display().to_string()), "{kind:?}: {msg}");
        }
        assert!(dest.exists());
        // The winner's file is whole: the loaders read it back.
        if kind == OutputType::Safetensors {
            let t = candle_core::safetensors::load(&dest, &Device::Cpu).unwrap();
            assert_eq!(t["frames"].dims(), &[3, 16, 16, 3]);
        }
        assert_eq!(partials(&dir), Vec::<String>::new(), "{kind:?}");
        // Replacing stays possible when asked for (files).
        if kind != OutputType::Png {
            output::write_with(kind, &dest, &frames, 8, &[], true).unwrap();
        }
    }
}

#[test]
fn two_runs_writing_one_output_name_never_corrupt_it() {
    let dir = scratch("race-runs");
    let out = dir.join("out");
    let args: Vec<String> = [
        "--prompt",
        "same",
        "--seed",
        "7",
        "--output-video-name",
        "v",
        "--output-path",
        out.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_vidgen"))
            .args(TINY)
            .args(&args)
            .env("HF_HUB_OFFLINE", "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let runs = [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()];
    let ok = runs.iter().filter(|r| r.status.success()).count();
    assert_eq!(ok, 1, "exactly one run writes v.mp4");
    let loser = runs.iter().find(|r| !r.status.success()).unwrap();
    let stderr = text(&loser.stderr);
    assert_eq!(loser.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("v.mp4"), "{stderr}");
    assert!(
        stderr.contains("already exists") || stderr.contains("appeared during the run"),
        "{stderr}"
    );
    assert_eq!(names(&out), vec!["v.mp4".to_string()]);
    // The file is a whole MP4: its index ("moov", put first by faststart) and its data.
    let bytes = std::fs::read(out.join("v.mp4")).unwrap();
    let find = |tag: &[u8]| bytes.windows(4).any(|w| w == tag);
    assert!(find(b"ftyp") && find(b"moov") && find(b"mdat"));
}

/// Writes a `latents` tensor of the tiny run's shape `[1, 16, 2, 4, 4]` filled with `value`.
fn latents_file(path: &Path, value: f32) {
    use candle_core::{Device, Tensor};
    let t = (Tensor::ones((1, 16, 2, 4, 4), candle_core::DType::F32, &Device::Cpu).unwrap()
        * value as f64)
        .unwrap();
    let tensors: std::collections::HashMap<String, Tensor> = [("latents".to_string(), t)].into();
    candle_core::safetensors::save(&tensors, path).unwrap();
}

#[test]
fn non_finite_latents_fail_the_prompt_with_the_step_and_write_nothing() {
    let dir = scratch("nan");
    let nan = dir.join("nan.safetensors");
    latents_file(&nan, f32::NAN);
    let cases: [(&str, Vec<&str>); 2] = [
        ("guidance", vec!["--guidance-scale", "1e308"]),
        ("latents", vec!["--latents", nan.to_str().unwrap()]),
    ];
    for (name, flags) in cases {
        let out = dir.join(format!("out-{name}"));
        let stats_path = dir.join(format!("{name}.json"));
        let mut args = vec![
            "--prompt",
            "x",
            "--output-path",
            out.to_str().unwrap(),
            "--stats-json",
            stats_path.to_str().unwrap(),
        ];
        args.extend(flags);
        let run = vidgen(&args);
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{name}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            stderr.contains("NaN or infinite at denoising step 1 of 2"),
            "{name}: {stderr}"
        );
        let s = stats(&stats_path);
        assert_eq!(statuses(&s), vec!["failed"], "{name}: {s}");
        assert!(
            s["jobs"][0]["error"].as_str().unwrap().contains("NaN"),
            "{s}"
        );
        assert_eq!(names(&out), Vec::<String>::new(), "{name}");
        assert!(run.stdout.is_empty(), "{name}");
    }
}

#[test]
fn latents_files_are_checked_before_anything_loads() {
    use candle_core::{Device, Tensor};
    let dir = scratch("latents");
    let out = dir.join("out");
    let save = |name: &str, tensors: Vec<(&str, Tensor)>| {
        let path = dir.join(name);
        let map: std::collections::HashMap<String, Tensor> = tensors
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        candle_core::safetensors::save(&map, &path).unwrap();
        path.to_str().unwrap().to_string()
    };
    let zeros =
        |shape: &[usize]| Tensor::zeros(shape, candle_core::DType::F32, &Device::Cpu).unwrap();
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, [7u8; 100]).unwrap();
    let truncated = dir.join("truncated.safetensors");
    let whole = std::fs::read(save(
        "whole.safetensors",
        vec![("latents", zeros(&[1, 16, 2, 4, 4]))],
    ))
    .unwrap();
    std::fs::write(&truncated, &whole[..whole.len() - 10]).unwrap();
    let cases: Vec<(String, &str)> = vec![
        (
            dir.join("missing.safetensors").to_str().unwrap().into(),
            "missing.safetensors",
        ),
        ("/dev/zero".into(), "not a regular file"),
        (dir.to_str().unwrap().into(), "not a regular file"),
        (garbage.to_str().unwrap().into(), "not a safetensors file"),
        (truncated.to_str().unwrap().into(), "not a safetensors file"),
        (
            save(
                "shape.safetensors",
                vec![("latents", zeros(&[1, 16, 3, 4, 4]))],
            ),
            "[1, 16, 2, 4, 4]",
        ),
        (
            save(
                "names.safetensors",
                vec![("a", zeros(&[1])), ("b", zeros(&[1]))],
            ),
            "no tensor named `latents`",
        ),
        (
            save(
                "ints.safetensors",
                vec![(
                    "latents",
                    Tensor::zeros((1, 16, 2, 4, 4), candle_core::DType::U8, &Device::Cpu).unwrap(),
                )],
            ),
            "U8",
        ),
    ];
    for (path, needle) in cases {
        let run = vidgen(&[
            "--prompt",
            "x",
            "--output-path",
            out.to_str().unwrap(),
            "--latents",
            &path,
        ]);
        assert_refused(&run, &["--latents", needle]);
        assert!(
            !text(&run.stderr).contains("loading"),
            "{}",
            text(&run.stderr)
        );
        assert!(!out.exists(), "{path}: the output folder was made");
    }
    // A prompt file's line of another size needs other latents: named with its line.
    let prompts = dir.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"a\"}\n{\"prompt\": \"b\", \"num_frames\": 9}\n",
    )
    .unwrap();
    let good = dir.join("whole.safetensors");
    let run = vidgen(&[
        "--prompt-file",
        prompts.to_str().unwrap(),
        "--output-path",
        out.to_str().unwrap(),
        "--latents",
        good.to_str().unwrap(),
    ]);
    assert_refused(&run, &["p.jsonl:2", "[1, 16, 3, 4, 4]"]);
}

#[test]
fn config_file_values_meet_the_flags_range_checks() {
    let dir = scratch("config-ranges");
    let cases = [
        ("prefetch_depth = 0", "--prefetch-depth"),
        ("num_blocks_per_group = 0", "--num-blocks-per-group"),
        ("num_gpus = 0", "--num-gpus"),
        ("max_pinned_memory = 0", "not a positive size"),
        ("max_pinned_memory = \"0\"", "not a positive size"),
        ("fps = 4294967295", "1..=1000"),
        ("guidance_scale = nan", "NaN is not a finite number"),
        ("guidance_scale = inf", "inf is not a finite number"),
    ];
    for (line, needle) in cases {
        let config = dir.join("c.toml");
        std::fs::write(&config, format!("{line}\n")).unwrap();
        for dry in [&[][..], &["--dry-run"][..]] {
            let mut args = vec!["--prompt", "x", "--config", config.to_str().unwrap()];
            args.extend_from_slice(dry);
            let run = vidgen(&args);
            assert_refused(&run, &["c.toml", needle]);
        }
    }
    // The flag itself: the frame rate is bounded up front, not at write.
    assert_refused(
        &vidgen(&["--prompt", "x", "--fps", "4294967295"]),
        &["--fps", "1..=1000"],
    );
    // Every option the dry run lists as a config key, fed back as a config file, passes its
    // flag's parser.
    let dump = vidgen(&["--prompt", "x", "--dry-run"]);
    let report = text(&dump.stdout);
    let keys: String = report
        .lines()
        .skip_while(|l| !l.starts_with("options (as --config file keys)"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .map(|l| format!("{}\n", l.trim()))
        .collect();
    assert!(keys.lines().count() > 30, "{report}");
    let all = dir.join("all.toml");
    std::fs::write(&all, &keys).unwrap();
    let run = vidgen(&["--config", all.to_str().unwrap(), "--dry-run"]);
    assert!(run.status.success(), "{keys}: {}", text(&run.stderr));
    // Values in range still pass, as numbers or strings.
    for line in [
        "max_pinned_memory = \"2GiB\"",
        "max_pinned_memory = 1024",
        "prefetch_depth = 2",
    ] {
        let config = dir.join("ok.toml");
        std::fs::write(&config, format!("{line}\n")).unwrap();
        let run = vidgen(&[
            "--prompt",
            "x",
            "--config",
            config.to_str().unwrap(),
            "--dry-run",
        ]);
        assert!(run.status.success(), "{line}: {}", text(&run.stderr));
    }
}

/// Every float flag refuses what the config file refuses, through one parser: NaN and the
/// infinities are exit 2 with one line naming the flag, before any work and in a dry run too,
/// whether or not the model would use the value.
#[test]
fn float_flags_refuse_what_the_config_file_refuses() {
    let dir = scratch("float-flags");
    let config = dir.join("c.toml");
    for flag in [
        "--guidance-scale",
        "--guidance-scale-2",
        "--true-cfg-scale",
        "--decode-timestep",
        "--decode-noise-scale",
        "--flow-shift",
    ] {
        let key = flag.trim_start_matches("--").replace('-', "_");
        for value in ["nan", "inf", "-inf"] {
            let given = format!("{flag}={value}");
            std::fs::write(&config, format!("{key} = {value}\n")).unwrap();
            for dry in [&[][..], &["--dry-run"][..]] {
                let run = vidgen(&[&["--prompt", "x", &given][..], dry].concat());
                assert_refused(&run, &[flag, "is not a finite number"]);
                let from_file = ["--prompt", "x", "--config", config.to_str().unwrap()];
                let run = vidgen(&[&from_file[..], dry].concat());
                assert_refused(&run, &["c.toml", &key, "is not a finite number"]);
            }
        }
    }
}

/// Copies the tiny Wan fixture (configs, tokenizer, weights) to `dir/model`.
fn copy_tiny_model(dir: &Path) -> PathBuf {
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wan-tiny-a");
    let to = dir.join("model");
    std::fs::create_dir_all(&to).unwrap();
    for entry in [
        "model_index.json",
        "scheduler",
        "text_encoder",
        "tokenizer",
        "transformer",
        "vae",
    ] {
        let src = from.join(entry);
        if src.is_file() {
            std::fs::copy(&src, to.join(entry)).unwrap();
            continue;
        }
        std::fs::create_dir_all(to.join(entry)).unwrap();
        for f in std::fs::read_dir(&src).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), to.join(entry).join(f.file_name())).unwrap();
        }
    }
    to
}

#[cfg(unix)]
#[test]
fn shard_names_stay_inside_the_model_folder() {
    let dir = scratch("shards");
    let model = copy_tiny_model(&dir);
    let transformer = model.join("transformer");
    let weights = transformer.join("diffusion_pytorch_model.safetensors");
    // The real weights, outside the model folder, and a shard file name.
    let outside = dir.join("outside.safetensors");
    std::fs::rename(&weights, &outside).unwrap();
    let index = transformer.join("diffusion_pytorch_model.safetensors.index.json");
    let run_with = |shard: &str, dry: bool| {
        std::fs::write(
            &index,
            format!(
                "{{\"weight_map\": {{\"proj_out.weight\": {}}}}}",
                serde_json::json!(shard)
            ),
        )
        .unwrap();
        Command::new(env!("CARGO_BIN_EXE_vidgen"))
            .args([
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--device",
                "cpu",
            ])
            .args(["--height", "32", "--width", "32", "--num-frames", "5"])
            .args([
                "--num-inference-steps",
                "2",
                "--prompt",
                "x",
                "--output-path",
            ])
            .arg(dir.join("out"))
            .args(dry.then_some("--dry-run"))
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    let relative = format!("../../{}", outside.file_name().unwrap().to_str().unwrap());
    // Refused before anything loads (exit 2), in a dry run too.
    let refused = |shard: &str, needle: &str| {
        for dry in [false, true] {
            let run = run_with(shard, dry);
            let stderr = text(&run.stderr);
            assert_eq!(run.status.code(), Some(2), "{shard}: {stderr}");
            assert!(!stderr.contains("panicked"), "{stderr}");
            assert!(!stderr.contains("loading"), "nothing loads: {stderr}");
            assert!(stderr.contains(needle), "{shard}: {stderr}");
        }
    };
    for shard in [
        relative.as_str(),
        outside.to_str().unwrap(),
        "sub/x.safetensors",
    ] {
        refused(shard, "is not a file name in transformer/");
    }
    // A link in the folder to a file outside it is refused; one to a file inside it is followed.
    let link = transformer.join("shard-1.safetensors");
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    refused("shard-1.safetensors", "links outside the model");
    std::fs::remove_file(&link).unwrap();
    std::fs::rename(&outside, transformer.join("real.safetensors")).unwrap();
    std::os::unix::fs::symlink("real.safetensors", &link).unwrap();
    let run = run_with("shard-1.safetensors", false);
    assert!(run.status.success(), "{}", text(&run.stderr));
}

#[cfg(unix)]
#[test]
fn a_file_size_limit_fails_the_write_cleanly_and_the_stats_are_written() {
    // No `trap '' XFSZ`: vidgen itself must not die of SIGXFSZ. 16 KiB: the 60 KiB video
    // passes the limit, the stats do not.
    let dir = scratch("ulimit");
    let out = dir.join("out");
    let stats_path = dir.join("s.json");
    let args: Vec<String> = TINY
        .iter()
        .map(|a| a.to_string())
        .chain(
            [
                "--prompt",
                "a fox",
                "--output-type",
                "safetensors",
                "--output-path",
            ]
            .map(String::from),
        )
        .chain([out.to_str().unwrap().to_string(), "--stats-json".into()])
        .chain([stats_path.to_str().unwrap().to_string()])
        .map(|a| format!("'{a}'"))
        .collect();
    let script = format!(
        "ulimit -f 16; exec '{}' {}",
        env!("CARGO_BIN_EXE_vidgen"),
        args.join(" ")
    );
    let run = Command::new("bash")
        .args(["-c", &script])
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let stderr = text(&run.stderr);
    assert_eq!(
        run.status.code(),
        Some(1),
        "killed by a signal? {:?} {stderr}",
        run.status
    );
    assert!(stderr.contains("File too large"), "{stderr}");
    assert_eq!(names(&out), Vec::<String>::new(), "a temporary was left");
    let s = stats(&stats_path);
    assert_eq!(statuses(&s), vec!["failed"]);
    assert!(
        s["jobs"][0]["error"]
            .as_str()
            .unwrap()
            .contains("File too large"),
        "{s}"
    );
}

#[test]
fn overwrite_replaces_a_png_folder_only_once_the_new_one_is_complete() {
    let dir = scratch("png-overwrite");
    let out = dir.join("out");
    let args = |extra: &[&str]| {
        let mut a = vec![
            "--prompt",
            "x",
            "--output-type",
            "png",
            "--output-video-name",
            "v",
            "--output-path",
            out.to_str().unwrap(),
        ];
        a.extend_from_slice(extra);
        vidgen(&a)
    };
    let first = args(&[]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let folder = out.join("v");
    std::fs::write(folder.join("marker"), "old").unwrap();
    // Without --overwrite the old folder stays.
    let kept = args(&[]);
    assert_eq!(kept.status.code(), Some(1), "{}", text(&kept.stderr));
    assert!(folder.join("marker").exists());
    let frames = vec![
        "frame_00000.png",
        "frame_00001.png",
        "frame_00002.png",
        "frame_00003.png",
        "frame_00004.png",
    ];
    let replaced = args(&["--overwrite"]);
    assert!(replaced.status.success(), "{}", text(&replaced.stderr));
    assert_eq!(text(&replaced.stdout).trim(), folder.to_str().unwrap());
    assert_eq!(names(&folder), frames, "the old folder's files are gone");
    assert_eq!(
        names(&out),
        vec!["v".to_string()],
        "no temporary or old folder left"
    );
    // A file in the folder's place is replaced too.
    std::fs::remove_dir_all(&folder).unwrap();
    std::fs::write(&folder, "a file").unwrap();
    let replaced = args(&["--overwrite"]);
    assert!(replaced.status.success(), "{}", text(&replaced.stderr));
    assert_eq!(names(&folder), frames);
    assert_eq!(names(&out), vec!["v".to_string()]);
}

#[test]
fn small_refusals_name_the_problem() {
    let dir = scratch("small");
    let file = dir.join("model.safetensors");
    std::fs::write(&file, "x").unwrap();
    let run = vidgen(&["--prompt", "x", "--model", file.to_str().unwrap()]);
    assert_refused(&run, &["is a file, not a folder", "model_index.json"]);
    let run = vidgen(&["--prompt", "x", "--json"]);
    assert_refused(&run, &["--dry-run"]);
    for blank in ["", "   ", "\t\n"] {
        let run = vidgen(&["--prompt", blank]);
        assert_refused(&run, &["--prompt is empty"]);
    }
}

#[test]
fn a_megabyte_prompt_is_cut_in_logs_and_kept_whole_in_the_stats() {
    let dir = scratch("long-prompt");
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    // The output exists: the prompt fails at once and its summary line names it.
    std::fs::write(out.join("v.mp4"), "old").unwrap();
    let prompt = "a fox ".repeat(200_000);
    let prompts = dir.join("p.txt");
    std::fs::write(&prompts, format!("{prompt}\n")).unwrap();
    let stats_path = dir.join("s.json");
    let run = vidgen(&[
        "--prompt-file",
        prompts.to_str().unwrap(),
        "--output-video-name",
        "v",
        "--output-path",
        out.to_str().unwrap(),
        "--stats-json",
        stats_path.to_str().unwrap(),
    ]);
    let stderr = text(&run.stderr);
    assert_eq!(
        run.status.code(),
        Some(1),
        "{}",
        &stderr[..stderr.len().min(2000)]
    );
    assert!(stderr.len() < 4000, "{} bytes of stderr", stderr.len());
    assert!(stderr.contains("... (1199999 bytes)"), "{stderr}");
    assert!(stderr.contains("already exists"), "{stderr}");
    let s = stats(&stats_path);
    assert_eq!(s["jobs"][0]["prompt"].as_str().unwrap(), prompt.trim());
}

#[cfg(unix)]
#[test]
fn ctrl_c_after_the_last_stage_began_still_exits_130() {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    let dir = scratch("ctrl-c-last");
    let out = dir.join("out");
    let stats_path = dir.join("s.json");
    // stdout is a full pipe: printing the finished video's path blocks, after the file is
    // complete and with no stage left that could see Ctrl-C.
    let (mut reader, mut writer) = std::io::pipe().unwrap();
    let fd = writer.as_raw_fd();
    // SAFETY: fcntl on a pipe this test owns.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
    loop {
        match writer.write(&[b'#'; 4096]) {
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
    }
    unsafe { libc::fcntl(fd, libc::F_SETFL, flags) };
    let mut child = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(TINY)
        .args(["--prompt", "x", "--output-video-name", "v", "--output-path"])
        .arg(&out)
        .arg("--stats-json")
        .arg(&stats_path)
        .env("HF_HUB_OFFLINE", "1")
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let video = out.join("v.mp4");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !video.exists() {
        assert!(std::time::Instant::now() < deadline, "no video");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // stderr is read on a thread, so that the Ctrl-C notice can be awaited before stdout is
    // drained (the handler runs on a thread of its own: draining first would race it).
    let err = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let lines = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut all = String::new();
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            all += &format!("{line}\n");
        }
        all
    });
    // SAFETY: a signal to the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    while let Ok(line) = rx.recv_timeout(std::time::Duration::from_secs(120)) {
        if line.starts_with("interrupted: stopping") {
            break;
        }
    }
    let mut stdout = String::new();
    reader.read_to_string(&mut stdout).unwrap();
    let status = child.wait().unwrap();
    let stderr = lines.join().unwrap();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(
        stdout.trim_start_matches('#').trim() == video.to_str().unwrap(),
        "{stdout}"
    );
    let s = stats(&stats_path);
    assert_eq!(s["status"], "interrupted", "{s}");
    assert_eq!(statuses(&s), vec!["written"]);
}

#[cfg(unix)]
#[test]
fn endless_inputs_are_read_up_to_a_cap() {
    let dir = scratch("endless");
    let out = dir.join("out");
    let o = out.to_str().unwrap();
    for dry in [&[][..], &["--dry-run"][..]] {
        let mut args = vec!["--prompt-file", "/dev/zero", "--output-path", o];
        args.extend_from_slice(dry);
        assert_refused(&vidgen(&args), &["--prompt-file /dev/zero", "64 MiB"]);
        let mut args = vec!["--prompt", "x", "--config", "/dev/zero", "--output-path", o];
        args.extend_from_slice(dry);
        assert_refused(&vidgen(&args), &["config file /dev/zero", "16 MiB"]);
    }
    // --latents /dev/zero: see latents_files_are_checked_before_anything_loads.
    assert!(!out.exists());
}

#[test]
fn the_dry_run_reads_the_prompt_file_and_plans_every_size_it_asks_for() {
    let dir = scratch("dry-prompts");
    let out = dir.join("out");
    let o = out.to_str().unwrap();
    let prompts = dir.join("p.jsonl");
    let p = prompts.to_str().unwrap();
    // A missing or broken file is bad input in a dry run too.
    for (body, needle) in [
        (None, "cannot read --prompt-file"),
        (
            Some("{\"prompt\": \"a\"}\n{\"prompt\": \"b\", \"bad\": 1}\n"),
            "p.jsonl:2: unknown key `bad`",
        ),
        (Some("\n# only a comment\n"), "has no prompts"),
        (
            Some("{\"prompt\": \"a\", \"num_frames\": 6}\n"),
            "p.jsonl:1",
        ),
    ] {
        if let Some(body) = body {
            std::fs::write(&prompts, body).unwrap();
        }
        for json in [&[][..], &["--json"][..]] {
            let mut args = vec!["--prompt-file", p, "--output-path", o, "--dry-run"];
            args.extend_from_slice(json);
            assert_refused(&vidgen(&args), &[needle]);
        }
    }
    // Each line's size is planned: two sizes, counted, the second from a line's override.
    std::fs::write(
        &prompts,
        "{\"prompt\": \"a\"}\n{\"prompt\": \"b\", \"num_frames\": 9, \"height\": 64}\n{\"prompt\": \"c\"}\n",
    )
    .unwrap();
    let run = vidgen(&[
        "--prompt-file",
        p,
        "--output-path",
        o,
        "--dry-run",
        "--json",
    ]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let plan: Value = serde_json::from_slice(&run.stdout).unwrap();
    let sizes = plan["prompts"]["sizes"].as_array().unwrap();
    assert_eq!(plan["prompts"]["count"], 3);
    let got: Vec<(u64, u64, u64)> = sizes
        .iter()
        .map(|s| {
            (
                s["prompts"].as_u64().unwrap(),
                s["num_frames"].as_u64().unwrap(),
                s["height"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, vec![(2, 5, 32), (1, 9, 64)]);
    assert!(sizes.iter().all(|s| s["required_bytes"].as_u64().is_some()));
    let text_run = vidgen(&["--prompt-file", p, "--output-path", o, "--dry-run"]);
    let report = text(&text_run.stdout);
    assert!(report.contains("prompts      3, 2 size(s)"), "{report}");
    assert!(report.contains("1 x 9 frames of 64x32"), "{report}");
    // 100,000 prompts: the job list is linear, so the dry run finishes.
    let many = dir.join("many.txt");
    let body: String = (0..100_000)
        .map(|i| format!("prompt number {i}\n"))
        .collect();
    std::fs::write(&many, body).unwrap();
    let run = vidgen(&[
        "--prompt-file",
        many.to_str().unwrap(),
        "--dry-run",
        "--json",
    ]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let plan: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(plan["prompts"]["count"], 100_000);
    assert!(!out.exists(), "a dry run makes nothing");
}

#[test]
fn a_stage_major_batch_writes_each_video_before_the_next_is_decoded() {
    use std::io::BufRead;
    let dir = scratch("stage-major");
    let out = dir.join("out");
    let prompts = dir.join("p.txt");
    std::fs::write(&prompts, "a fox\na boat\na tree\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(TINY)
        .args(["--seed", "1", "--batch-order", "stage", "--prompt-file"])
        .arg(&prompts)
        .arg("--output-path")
        .arg(&out)
        .env("HF_HUB_OFFLINE", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    for line in stderr.lines().map_while(Result::ok) {
        seen += &format!("{line}\n");
        if line == "[3/3] decode" {
            // The last prompt's decode begins: the first two videos are already whole files.
            assert_eq!(
                names(&out),
                vec!["a-boat_002_seed2.mp4", "a-fox_001_seed1.mp4"],
                "{seen}"
            );
        }
    }
    assert!(child.wait().unwrap().success(), "{seen}");
    assert!(seen.contains("[3/3] decode"), "{seen}");
    assert_eq!(names(&out).len(), 3);
}
