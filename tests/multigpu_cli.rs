//! Several GPUs from the command line, on a machine without them: `--num-gpus`, `--sp-size` and
//! `--use-fsdp-inference` parse and plan (a forced memory model plans for another machine); a
//! build without the `nccl` feature refuses to run them, naming it.

use serde_json::Value;
use std::process::{Command, Output};

fn vidgen(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run vidgen")
}

/// `--dry-run --json` of the 14B on `gpus` discrete GPUs with extra flags.
fn plan(gpus: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "generate",
        "--dry-run",
        "--json",
        "--memory-model",
        "discrete",
        "--model",
        "synthetic:wan2.1-t2v-14b",
        "--num-gpus",
        gpus,
    ];
    args.extend_from_slice(extra);
    let out = vidgen(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap()
}

fn holds(gpu: &Value) -> Vec<String> {
    gpu["holds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap().split(' ').next().unwrap().to_string())
        .collect()
}

#[test]
fn sequence_parallel_ranks_and_what_each_holds() {
    let json = plan("4", &["--sp-size", "2"]);
    assert_eq!(json["config"]["sp_size"], 2);
    let gpus = json["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 4);
    // The first rank of each group of two encodes and decodes; the others hold the DiT alone.
    for (rank, gpu) in gpus.iter().enumerate() {
        assert_eq!(gpu["rank"], rank);
        assert_eq!(gpu["group"], rank / 2);
        if rank % 2 == 0 {
            assert_eq!(holds(gpu), ["text_encoder", "transformer", "vae"]);
        } else {
            assert_eq!(holds(gpu), ["transformer"]);
            assert!(gpu["peak_bytes"].as_u64() < gpus[0]["peak_bytes"].as_u64());
        }
    }
    // The text report names the groups.
    let out = vidgen(&[
        "generate",
        "--dry-run",
        "--memory-model",
        "discrete",
        "--model",
        "synthetic:wan2.1-t2v-14b",
        "--num-gpus",
        "4",
        "--sp-size",
        "2",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("2 group(s) of 2 ([0,1] [2,3])"), "{text}");
    assert!(
        text.contains("group 1: text_encoder, transformer, vae"),
        "{text}"
    );
    // --sp-size defaults to the GPU count; one GPU plans no ranks.
    assert_eq!(plan("2", &[])["config"]["sp_size"], 2);
    assert!(plan("1", &[])["gpus"].is_null());
}

#[test]
fn sequence_parallelism_splits_the_denoise_activations() {
    let one = plan("2", &["--sp-size", "1"]);
    let two = plan("2", &["--sp-size", "2"]);
    // sp 1 is prompt parallelism: every rank is a whole pipeline.
    assert_eq!(
        holds(&one["gpus"][1]),
        ["text_encoder", "transformer", "vae"]
    );
    let denoise = |j: &Value| {
        j["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == "denoise")
            .unwrap()["memory"]["activation_bytes"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(denoise(&two), denoise(&one).div_ceil(2));
}

#[test]
fn fsdp_keeps_a_share_of_every_block_per_gpu() {
    let resident = ["--no-dit-layerwise-offload", "--no-dit-cpu-offload"];
    let whole = plan("2", &resident)["gpus"][1]["denoise_weight_bytes"]
        .as_u64()
        .unwrap();
    let mut fsdp_args = resident.to_vec();
    fsdp_args.push("--use-fsdp-inference");
    let json = plan("2", &fsdp_args);
    assert_eq!(json["config"]["use_fsdp_inference"], true);
    let sharded = json["gpus"][1]["denoise_weight_bytes"].as_u64().unwrap();
    // Half of every block plus two gathered blocks (40 blocks: 5% of the whole) and the
    // unsharded rest.
    let ratio = sharded as f64 / whole as f64;
    assert!(
        (0.5..0.6).contains(&ratio),
        "FSDP per-GPU DiT weights {ratio:.3} of the whole"
    );
    // Four GPUs in groups of two: each group shards the DiT over its own two GPUs.
    let mut grouped = fsdp_args.clone();
    grouped.extend(["--sp-size", "2"]);
    let json4 = plan("4", &grouped);
    for rank in 0..4 {
        assert_eq!(
            json4["gpus"][rank]["denoise_weight_bytes"],
            json["gpus"][rank % 2]["denoise_weight_bytes"],
            "rank {rank}"
        );
    }
    // With --dit-cpu-offload the shards wait in host memory: only gathered blocks on the GPU.
    fsdp_args.pop();
    fsdp_args.pop();
    fsdp_args.push("--use-fsdp-inference");
    let host = plan("2", &fsdp_args)["gpus"][1]["denoise_weight_bytes"]
        .as_u64()
        .unwrap();
    assert!((host as f64) < 0.1 * whole as f64, "{host} of {whole}");
}

/// Asserts exit code 2 with one line naming each needle.
fn refused(args: &[&str], needles: &[&str]) {
    let out = vidgen(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn bad_parallel_options_are_usage_errors() {
    let base = ["generate", "--prompt", "x", "--memory-model", "discrete"];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    refused(
        &with(&["--num-gpus", "4", "--sp-size", "3"]),
        &["--sp-size 3", "--num-gpus 4"],
    );
    refused(&with(&["--sp-size", "2"]), &["--sp-size 2"]);
    // FSDP needs GPUs to shard across.
    refused(
        &with(&[
            "--use-fsdp-inference",
            "--no-dit-layerwise-offload",
            "--model",
            "synthetic:wan2.1-tiny",
        ]),
        &["--use-fsdp-inference", "--num-gpus"],
    );
}

#[cfg(not(feature = "nccl"))]
#[test]
fn a_build_without_nccl_refuses_to_run_several_gpus() {
    refused(
        &[
            "generate",
            "--prompt",
            "x",
            "--memory-model",
            "discrete",
            "--model",
            "synthetic:wan2.1-tiny",
            "--num-gpus",
            "2",
        ],
        &["--num-gpus 2", "`nccl` feature"],
    );
}

#[test]
fn a_launcher_world_must_match_num_gpus() {
    let out = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(["generate", "--prompt", "x", "--device", "cpu"])
        .env("HF_HUB_OFFLINE", "1")
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        "error: torchrun started 2 ranks but --num-gpus is 1: pass --num-gpus 2"
    );
    // An inconsistent launcher environment is bad input naming the variable.
    let out = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(["generate", "--prompt", "x", "--device", "cpu"])
        .env("SLURM_PROCID", "3")
        .env("SLURM_NTASKS", "2")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("SLURM_PROCID=3 is not below SLURM_NTASKS=2"),
        "{stderr}"
    );
}

/// `--num-gpus 2 --sp-size 1` on the CPU (prompt parallelism needs no collective): the
/// supervisor's two workers each make their share of a prompt file, and every video equals the
/// one-process run's.
#[test]
fn prompt_parallelism_splits_a_prompt_file() {
    let dir = std::env::temp_dir().join(format!("vidgen-pp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let prompts = dir.join("p.txt");
    std::fs::write(&prompts, "a cat\na dog\na fox\n").unwrap();
    let run = |out: &str, extra: &[&str]| {
        let out_dir = dir.join(out);
        std::fs::create_dir_all(&out_dir).unwrap();
        let stats = out_dir.join("stats.json");
        let mut args = vec![
            "generate",
            "--model",
            "synthetic:wan2.1-tiny",
            "--prompt-file",
            prompts.to_str().unwrap(),
            "--device",
            "cpu",
            "--memory-model",
            "unified",
            "--height",
            "32",
            "--width",
            "32",
            "--num-frames",
            "5",
            "--num-inference-steps",
            "2",
            "--seed",
            "3",
            "--output-type",
            "safetensors",
            "--output-path",
            out_dir.to_str().unwrap(),
            "--stats-json",
            stats.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let output = vidgen(&args);
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        assert!(output.status.success(), "{stderr}");
        let mut paths: Vec<String> = String::from_utf8(output.stdout)
            .unwrap()
            .lines()
            .map(String::from)
            .collect();
        paths.sort();
        (out_dir, paths, stderr)
    };
    let (one, one_paths, _) = run("one", &[]);
    let (two, two_paths, stderr) = run("two", &["--num-gpus", "2", "--sp-size", "1"]);
    // Every path on stdout, once; rank 0 made prompts 1 and 3, rank 1 prompt 2.
    assert_eq!(two_paths.len(), 3, "{two_paths:?}");
    assert!(
        stderr.contains("rank 0: done: 2 of 3 written, 1 on the other GPUs"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rank 1: done: 1 of 3 written, 2 on the other GPUs"),
        "{stderr}"
    );
    for (a, b) in one_paths.iter().zip(&two_paths) {
        let name = std::path::Path::new(a).file_name().unwrap();
        assert_eq!(name, std::path::Path::new(b).file_name().unwrap());
        let load = |p: &std::path::Path| {
            candle_core::safetensors::load(p, &candle_core::Device::Cpu).unwrap()["frames"]
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(load(&one.join(name)), load(&two.join(name)), "{name:?}");
    }
    // Rank 0's stats, and rank 1's beside them.
    let stats: Value =
        serde_json::from_slice(&std::fs::read(two.join("stats.json")).unwrap()).unwrap();
    let statuses: Vec<&str> = stats["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["written", "other_gpu", "written"]);
    assert!(two.join("stats.rank1.json").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}
