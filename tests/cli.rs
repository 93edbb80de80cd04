//! Runs the binary: the resolution table, config-file precedence and every bad input.

use serde_json::{json, Value};
use std::process::{Command, Output};

fn vidgen(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run vidgen")
}

/// `--dry-run --json` with extra flags: the parsed JSON object and stderr.
fn dry_run(extra: &[&str]) -> (Value, String) {
    let mut args = vec!["generate", "--dry-run", "--json", "--device", "cpu"];
    args.extend_from_slice(extra);
    let out = vidgen(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "vidgen {args:?} failed: {stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let json: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {stdout}"));
    (json, stderr)
}

fn config_bool(json: &Value, key: &str) -> bool {
    json["config"][key]
        .as_bool()
        .unwrap_or_else(|| panic!("config.{key} is not a boolean: {}", json["config"][key]))
}

/// Asserts a one-line error, exit code 2, and that the message mentions each needle.
fn assert_usage_error(args: &[&str], needles: &[&str]) {
    let out = vidgen(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{args:?}: exit code; stderr: {stderr}"
    );
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "{args:?}: not one line: {stderr}"
    );
    assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{args:?}: {stderr:?} lacks {needle:?}"
        );
    }
    assert!(out.stdout.is_empty(), "{args:?}: stdout must stay empty");
}

const HOST_OFFLOAD: [&str; 5] = [
    "dit_layerwise_offload",
    "dit_cpu_offload",
    "text_encoder_cpu_offload",
    "image_encoder_cpu_offload",
    "vae_cpu_offload",
];

#[test]
fn defaults_follow_fastvideo_and_diffusers() {
    let (json, _) = dry_run(&["--memory-model", "discrete"]);
    let c = &json["config"];
    for key in HOST_OFFLOAD
        .iter()
        .chain(&["pin_cpu_memory", "offload_stream"])
    {
        assert!(config_bool(&json, key), "{key} defaults on");
    }
    for key in [
        "use_fsdp_inference",
        "model_cpu_offload",
        "sequential_cpu_offload",
    ] {
        assert!(!config_bool(&json, key), "{key} defaults off");
    }
    assert_eq!(c["offload_type"], "block-level");
    assert_eq!(c["num_blocks_per_group"], 1);
    assert!(
        c["prefetch_depth"].is_null(),
        "unset: 1, or for leaf level as many steps as make the smallest block"
    );
    assert_eq!(c["model"], "Wan-AI/Wan2.1-T2V-1.3B-Diffusers");
    assert_eq!(
        (c["height"].as_u64(), c["width"].as_u64()),
        (Some(480), Some(832))
    );
    assert_eq!(
        (c["num_frames"].as_u64(), c["fps"].as_u64()),
        (Some(81), Some(16))
    );
    assert_eq!(c["num_inference_steps"], 50);
    assert_eq!(c["guidance_scale"], 5.0);
    assert_eq!(c["max_sequence_length"], 512);
    assert_eq!(c["output_path"], "outputs");
    assert_eq!(c["output_type"], "mp4");
    assert_eq!(c["dtype"], "f32", "f32 on the CPU");
    assert_eq!(json["memory_model"], "discrete");
}

#[test]
fn dry_run_shows_where_each_component_lives() {
    let placement = |extra: &[&str]| {
        let mut args = vec!["--memory-model", "discrete"];
        args.extend_from_slice(extra);
        dry_run(&args).0["placement"].clone()
    };
    let p = placement(&[]);
    assert_eq!(p["dit"]["mode"], "streamed");
    assert_eq!(
        (
            &p["dit"]["by_step"],
            &p["dit"]["stream"],
            &p["dit"]["depth"]
        ),
        (&json!(false), &json!(true), &json!(1))
    );
    assert_eq!(p["text_encoder"]["mode"], "streamed");
    assert_eq!(p["vae"]["mode"], "parked");
    assert_eq!(p["host_memory"]["kind"], "pinned");

    // Leaf-level streams the DiT step by step; the text encoder's blocks have no steps, so it
    // streams whole blocks, and a step is its own group whatever --num-blocks-per-group says.
    let p = placement(&[
        "--offload-type",
        "leaf-level",
        "--num-blocks-per-group",
        "3",
    ]);
    assert_eq!(p["dit"]["by_step"], true);
    assert_eq!(p["dit"]["blocks_per_group"], 1);
    assert_eq!(p["text_encoder"]["by_step"], false);
    assert_eq!(p["text_encoder"]["blocks_per_group"], 3);

    // With a copy stream, groups are single blocks (diffusers' rule for use_stream), and the
    // plan says so; without one, groups of N blocks move together.
    let (json, stderr) = dry_run(&["--memory-model", "discrete", "--num-blocks-per-group", "8"]);
    assert_eq!(json["placement"]["dit"]["blocks_per_group"], 1);
    assert_eq!(json["overrides"][0]["option"], "num_blocks_per_group");
    assert_eq!(json["overrides"][0]["to"], 1);
    assert!(stderr.contains("num_blocks_per_group: 8 -> 1"), "{stderr}");
    let p = placement(&["--num-blocks-per-group", "8", "--no-offload-stream"]);
    assert_eq!(p["dit"]["blocks_per_group"], 8);

    let p = placement(&["--sequential-cpu-offload"]);
    assert_eq!(
        (&p["dit"]["by_step"], &p["dit"]["stream"]),
        (&json!(true), &json!(false))
    );
    let p = placement(&["--model-cpu-offload"]);
    for role in ["text_encoder", "dit", "vae"] {
        assert_eq!(p[role]["mode"], "parked", "{role}");
    }
    let p = placement(&[
        "--max-pinned-memory",
        "2GiB",
        "--text-encoder-compute",
        "cpu",
    ]);
    assert_eq!(p["host_memory"]["kind"], "bounded");
    assert_eq!(p["host_memory"]["max_pinned"], 2u64 << 30);
    assert_eq!(p["text_encoder"]["mode"], "on_cpu");

    let p = dry_run(&["--memory-model", "unified"]).0["placement"].clone();
    for role in ["text_encoder", "dit", "vae"] {
        assert_eq!(p[role]["mode"], "resident", "{role}");
    }
}

#[test]
fn dry_run_names_options_that_act_on_nothing() {
    let (json, _) = dry_run(&["--memory-model", "discrete"]);
    let notes = json["notes"].as_array().expect("notes is a list");
    assert!(
        notes.iter().any(|n| n.as_str().is_some_and(
            |n| n.contains("--image-encoder-cpu-offload") && n.contains("no image encoder")
        )),
        "{notes:?}"
    );
    let (json, _) = dry_run(&[
        "--memory-model",
        "discrete",
        "--no-image-encoder-cpu-offload",
    ]);
    assert_eq!(json["notes"], json!([]));
}

#[test]
fn unified_memory_turns_host_offload_off_and_defers_loading() {
    let (json, stderr) = dry_run(&["--memory-model", "unified"]);
    assert_eq!(json["memory_model"], "unified");
    for key in HOST_OFFLOAD {
        assert!(!config_bool(&json, key), "{key} off on unified memory");
        let line = format!("{key}: true -> false (unified memory: ");
        assert_eq!(
            stderr.matches(&line).count(),
            1,
            "{key} reported once: {stderr}"
        );
    }
    assert!(config_bool(&json, "pin_cpu_memory"), "pinning unchanged");
    assert!(config_bool(&json, "lazy_module_load"), "lazy auto -> on");
    assert!(
        !config_bool(&json, "h3_sequential_load"),
        "lazy owns deferral"
    );
    let overrides = json["overrides"].as_array().unwrap();
    assert_eq!(overrides.len(), HOST_OFFLOAD.len());
    for o in overrides {
        assert_eq!(
            (o["from"].as_bool(), o["to"].as_bool()),
            (Some(true), Some(false))
        );
        assert!(o["reason"].as_str().unwrap().starts_with("unified memory"));
    }
}

#[test]
fn unified_memory_sequential_load_arms_only_without_lazy() {
    let (json, _) = dry_run(&["--memory-model", "unified", "--no-lazy-module-load"]);
    assert!(!config_bool(&json, "lazy_module_load"));
    assert!(config_bool(&json, "h3_sequential_load"));
    let (json, _) = dry_run(&["--memory-model", "unified", "--no-sequential-load"]);
    assert!(config_bool(&json, "lazy_module_load"));
    assert!(!config_bool(&json, "h3_sequential_load"));
    let (json, _) = dry_run(&["--memory-model", "unified", "--h3-sequential-load"]);
    assert!(config_bool(&json, "lazy_module_load") && config_bool(&json, "h3_sequential_load"));
}

#[test]
fn unified_memory_keeps_fsdp_on_cuda_class_devices() {
    let (json, _) = dry_run(&["--memory-model", "unified", "--use-fsdp-inference"]);
    assert!(config_bool(&json, "use_fsdp_inference"));
}

#[test]
fn discrete_resolves_autos_off_and_keeps_explicit_choices() {
    let (json, stderr) = dry_run(&["--memory-model", "discrete"]);
    assert!(!config_bool(&json, "lazy_module_load"));
    assert!(!config_bool(&json, "h3_sequential_load"));
    assert!(json["overrides"].as_array().unwrap().is_empty(), "{stderr}");
    assert!(
        stderr.is_empty(),
        "nothing changed, nothing printed: {stderr}"
    );
    let (json, _) = dry_run(&[
        "--memory-model",
        "discrete",
        "--lazy-module-load",
        "--sequential-load=true",
    ]);
    assert!(config_bool(&json, "lazy_module_load") && config_bool(&json, "h3_sequential_load"));
    let (json, _) = dry_run(&["--memory-model", "discrete", "--lazy-module-load=auto"]);
    assert!(!config_bool(&json, "lazy_module_load"));
}

#[test]
fn discrete_layerwise_excludes_fsdp() {
    let (json, stderr) = dry_run(&["--memory-model", "discrete", "--use-fsdp-inference"]);
    assert!(config_bool(&json, "dit_layerwise_offload"));
    assert!(!config_bool(&json, "use_fsdp_inference"));
    assert!(!config_bool(&json, "dit_cpu_offload"));
    assert!(stderr.contains(
        "use_fsdp_inference: true -> false (dit_layerwise_offload cannot combine with FSDP)"
    ));
    assert!(stderr.contains("dit_cpu_offload: true -> false"));
    let (json, _) = dry_run(&[
        "--memory-model",
        "discrete",
        "--use-fsdp-inference",
        "--no-dit-layerwise-offload",
    ]);
    assert!(config_bool(&json, "use_fsdp_inference") && config_bool(&json, "dit_cpu_offload"));
}

/// Whether a stderr line reports `key` turned off for want of an accelerator (alone, as
/// `key: true -> false (no accelerator)`, or in the one line of every such change).
fn reported_off_without_accelerator(stderr: &str, key: &str) -> bool {
    stderr.lines().any(|l| {
        l.ends_with("(no accelerator)")
            && l.contains("true -> false")
            && l.split([',', ':', ' ']).any(|word| word == key)
    })
}

#[test]
fn cpu_device_turns_every_host_offload_off() {
    let (json, stderr) = dry_run(&[]);
    assert_eq!(json["memory_model"], "none");
    assert_eq!(json["config"]["device"], "cpu");
    for key in HOST_OFFLOAD.iter().chain(&["pin_cpu_memory"]) {
        assert!(!config_bool(&json, key), "{key} off without an accelerator");
        assert!(reported_off_without_accelerator(&stderr, key), "{stderr}");
    }
    for key in [
        "use_fsdp_inference",
        "model_cpu_offload",
        "sequential_cpu_offload",
    ] {
        let (json, stderr) = dry_run(&[&format!("--{}", key.replace('_', "-"))]);
        assert!(!config_bool(&json, key), "{key}");
        assert!(reported_off_without_accelerator(&stderr, key), "{stderr}");
    }
}

#[test]
fn each_flag_has_a_negation_and_an_explicit_value() {
    for key in HOST_OFFLOAD
        .iter()
        .chain(&["pin_cpu_memory", "offload_stream"])
    {
        let flag = key.replace('_', "-");
        let (json, _) = dry_run(&["--memory-model", "discrete", &format!("--no-{flag}")]);
        assert!(!config_bool(&json, key), "--no-{flag}");
        let (json, _) = dry_run(&[
            "--memory-model",
            "discrete",
            &format!("--{flag}=false"),
            &format!("--{flag}"),
        ]);
        assert!(config_bool(&json, key), "last --{flag} wins");
    }
}

#[test]
fn tf32_is_on_by_default_and_no_tf32_turns_it_off() {
    assert!(config_bool(&dry_run(&[]).0, "tf32"));
    assert!(!config_bool(&dry_run(&["--no-tf32"]).0, "tf32"));
    assert!(!config_bool(&dry_run(&["--tf32=false"]).0, "tf32"));
}

#[test]
fn config_file_sits_between_defaults_and_the_command_line() {
    let dir = tempdir();
    let path = dir.join("run.toml");
    std::fs::write(
        &path,
        "height = 320\nwidth = 512\nvae_cpu_offload = false\nlazy_module_load = true\nnum_inference_steps = 7\noffload_type = \"leaf-level\"\n",
    )
    .unwrap();
    let p = path.to_str().unwrap();
    let (json, _) = dry_run(&[
        "--memory-model",
        "discrete",
        "--config",
        p,
        "--width",
        "640",
        "--vae-cpu-offload",
    ]);
    let c = &json["config"];
    assert_eq!(c["height"], 320, "file over default");
    assert_eq!(c["width"], 640, "command line over file");
    assert_eq!(c["num_inference_steps"], 7);
    assert_eq!(c["offload_type"], "leaf-level");
    assert!(config_bool(&json, "vae_cpu_offload"), "flag over file");
    assert!(config_bool(&json, "lazy_module_load"), "file over auto");
    // What the device forces wins over the file too.
    let (json, _) = dry_run(&["--memory-model", "unified", "--config", p]);
    assert!(!config_bool(&json, "vae_cpu_offload"));
}

#[test]
fn bad_inputs_are_one_line_errors_with_exit_code_2() {
    let dir = tempdir();
    let unknown_key = dir.join("unknown.toml");
    std::fs::write(&unknown_key, "heigth = 480\n").unwrap();
    let bad_value = dir.join("bad.toml");
    std::fs::write(&bad_value, "height = \"tall\"\n").unwrap();
    let zero = dir.join("zero.toml");
    std::fs::write(&zero, "num_inference_steps = 0\n").unwrap();
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (
            vec!["generate", "--prompt", "a", "--frobnicate"],
            vec!["--frobnicate"],
        ),
        (
            vec!["generate", "--prompt", "a", "--prompt-file", "p.txt"],
            vec!["--prompt", "--prompt-file"],
        ),
        (
            vec!["generate", "--device", "cpu"],
            vec!["no prompt", "--prompt"],
        ),
        (
            vec!["generate", "--prompt", "a", "--height", "500"],
            vec!["--height 500", "multiple of 16"],
        ),
        (
            vec!["generate", "--prompt", "a", "--width", "0"],
            vec!["--width"],
        ),
        (
            vec!["generate", "--prompt", "a", "--num-frames", "80"],
            vec!["4k+1", "81"],
        ),
        (
            vec!["generate", "--prompt", "a", "--num-frames", "0"],
            vec!["--num-frames"],
        ),
        (
            vec!["generate", "--prompt", "a", "--num-inference-steps", "0"],
            vec!["--num-inference-steps"],
        ),
        (
            vec!["generate", "--prompt", "a", "--num-inference-steps", "-5"],
            vec!["--num-inference-steps"],
        ),
        (
            vec!["generate", "--prompt", "a", "--fps", "0"],
            vec!["--fps"],
        ),
        (
            vec!["generate", "--prompt", "a", "--fps", "-1"],
            vec!["--fps"],
        ),
        (
            vec![
                "generate",
                "--prompt",
                "a",
                "--config",
                "/nonexistent/run.toml",
            ],
            vec!["config file", "/nonexistent/run.toml"],
        ),
        (
            vec![
                "generate",
                "--prompt",
                "a",
                "--config",
                unknown_key.to_str().unwrap(),
            ],
            vec!["unknown key `heigth`"],
        ),
        (
            vec![
                "generate",
                "--prompt",
                "a",
                "--config",
                bad_value.to_str().unwrap(),
            ],
            vec!["`height`"],
        ),
        (
            vec![
                "generate",
                "--prompt",
                "a",
                "--config",
                zero.to_str().unwrap(),
            ],
            vec!["num-inference-steps"],
        ),
        (
            vec!["generate", "--prompt", "a", "--device", "tpu"],
            vec!["tpu", "cuda:N"],
        ),
        (
            vec!["generate", "--prompt", "a", "--dtype", "f64"],
            vec!["f64", "bf16"],
        ),
        (
            vec![
                "generate",
                "--prompt",
                "a",
                "--device",
                "cpu",
                "--num-gpus",
                "2",
            ],
            vec!["--num-gpus 2"],
        ),
        (
            vec!["generate", "--prompt", "a", "--num-gpus", "64"],
            vec!["--num-gpus 64"],
        ),
        (
            vec!["generate", "--prompt", "a", "--output-video-name", "../x"],
            vec!["--output-video-name"],
        ),
        (
            vec!["generate", "--prompt", "a", "--lazy-module-load=maybe"],
            vec!["maybe"],
        ),
        (
            vec![
                "generate",
                "--dry-run",
                "--max-sequence-length",
                "4294967295",
            ],
            vec!["--max-sequence-length", "4096"],
        ),
        (
            vec![
                "generate",
                "--dry-run",
                "--dit-resident-memory",
                "4GiB",
                "--no-dit-layerwise-offload",
            ],
            vec!["--dit-resident-memory", "--no-dit-layerwise-offload"],
        ),
        (
            vec![
                "generate",
                "--dry-run",
                "--dit-resident-memory",
                "4GiB",
                "--model-cpu-offload",
            ],
            vec!["--dit-resident-memory", "--model-cpu-offload"],
        ),
        (
            vec!["generate", "--dry-run", "--dit-resident-memory", "0"],
            vec!["'0'", "positive size"],
        ),
    ];
    for (args, needles) in cases {
        assert_usage_error(&args, &needles);
    }
}

/// A copy of the fixture model's configs and tokenizer (all a dry run reads) in a fresh folder,
/// with `edit` applied to the JSON of `file`.
fn model_with(name: &str, file: &str, edit: impl FnOnce(&mut Value)) -> std::path::PathBuf {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wan-tiny-a");
    let dst = tempdir().join(name);
    let _ = std::fs::remove_dir_all(&dst);
    for rel in [
        "model_index.json",
        "transformer/config.json",
        "vae/config.json",
        "text_encoder/config.json",
        "scheduler/scheduler_config.json",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "tokenizer/special_tokens_map.json",
    ] {
        std::fs::create_dir_all(dst.join(rel).parent().unwrap()).unwrap();
        std::fs::copy(src.join(rel), dst.join(rel)).unwrap();
    }
    let mut json: Value =
        serde_json::from_str(&std::fs::read_to_string(dst.join(file)).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(dst.join(file), json.to_string()).unwrap();
    dst
}

#[test]
fn configs_the_model_cannot_run_are_one_line_errors_naming_file_and_key() {
    let cases: Vec<(&str, &str, Value, &str)> = vec![
        (
            "dim-mult",
            "vae/config.json",
            json!({"dim_mult": []}),
            "dim_mult",
        ),
        (
            "temperal",
            "vae/config.json",
            json!({"temperal_downsample": [false]}),
            "temperal_downsample",
        ),
        (
            "patch",
            "transformer/config.json",
            json!({"patch_size": [1, 0, 2]}),
            "patch_size",
        ),
        (
            "heads",
            "transformer/config.json",
            json!({"num_attention_heads": "many"}),
            "num_attention_heads",
        ),
        (
            "umt5",
            "text_encoder/config.json",
            json!({"d_model": 0}),
            "d_model",
        ),
        (
            "sampler",
            "scheduler/scheduler_config.json",
            json!({"solver_type": "bh9"}),
            "solver_type",
        ),
        (
            "index",
            "model_index.json",
            json!({"_class_name": null}),
            "_class_name",
        ),
    ];
    for (name, file, patch, key) in cases {
        let model = model_with(name, file, |json| {
            for (k, v) in patch.as_object().unwrap() {
                json[k] = v.clone();
            }
        });
        let model = model.to_str().unwrap();
        // Discrete memory: no device overrides on stderr besides the error.
        let quiet_device = ["--device", "cpu", "--memory-model", "discrete"];
        for run in [
            &["--dry-run"][..],
            &["--dry-run", "--json"],
            &["--prompt", "a"],
        ] {
            let mut args = vec!["generate", "--model", model];
            args.extend_from_slice(run);
            args.extend_from_slice(&quiet_device);
            assert_usage_error(&args, &[model, file, &format!("`{key}`")]);
        }
    }
    // The fixture's own configs pass.
    let model = model_with("fine", "model_index.json", |_| {});
    let (json, _) = dry_run(&["--model", model.to_str().unwrap()]);
    assert_eq!(json["model"]["configs_read"], true);
}

#[test]
fn output_names_are_checked_before_anything_loads() {
    let model = model_with("names", "model_index.json", |_| {});
    let model = model.to_str().unwrap();
    let long = "x".repeat(201);
    for (name, needle) in [
        (long.as_str(), "200"),
        (".hidden", "'.'"),
        ("a/b", "separator"),
    ] {
        assert_usage_error(
            &[
                "generate",
                "--prompt",
                "a",
                "--device",
                "cpu",
                "--memory-model",
                "discrete",
                "--model",
                model,
                "--output-video-name",
                name,
            ],
            &["--output-video-name", needle],
        );
    }
}

/// Resolves a `generate` command line as the binary does.
fn resolve(args: &[&str]) -> vidgen::config::ResolvedConfig {
    let argv = ["vidgen", "generate", "--dry-run"].iter().chain(args);
    let vidgen::cli::Parsed::Generate(parsed) =
        vidgen::cli::parse(argv.map(|a| (*a).into())).unwrap()
    else {
        panic!("not a generate command")
    };
    vidgen::cli::ResolvedConfig::resolve(*parsed).unwrap()
}

#[test]
fn the_cpu_reports_what_it_turns_off_in_one_line() {
    use vidgen::memory::overrides::report_lines;
    let cpu = resolve(&["--device", "cpu", "--model-cpu-offload"]);
    let lines = report_lines(cpu.overrides());
    assert_eq!(lines.len(), 1, "{lines:?}");
    for key in HOST_OFFLOAD
        .iter()
        .chain(&["pin_cpu_memory", "model_cpu_offload"])
    {
        assert!(
            reported_off_without_accelerator(&lines[0], key),
            "{lines:?}"
        );
    }
    // Elsewhere each change is a decision of its own, with its own line.
    let unified = resolve(&["--device", "cpu", "--memory-model", "unified"]);
    assert_eq!(
        report_lines(unified.overrides()),
        unified
            .overrides()
            .iter()
            .map(|o| o.to_string())
            .collect::<Vec<_>>()
    );
}

#[test]
fn memory_lines_show_no_device_figures_where_none_were_measured() {
    use vidgen::memory::accounting::MemoryPeaks;
    use vidgen::pipeline::progress::describe_peaks;
    let host_only = MemoryPeaks {
        host_rss_peak: 3 << 29,
        ..Default::default()
    };
    assert_eq!(describe_peaks(&host_only), "host RSS peak 1.50 GiB");
    let cuda = MemoryPeaks {
        device_used_peak: 1 << 30,
        device_reserved_peak: 2 << 30,
        device_in_use_now: 3 << 30,
        host_rss_peak: 1 << 30,
    };
    assert_eq!(
        describe_peaks(&cuda),
        "device peak 1.00 GiB used, 2.00 GiB reserved; host RSS peak 1.00 GiB"
    );
}

/// The whole binary on the CPU: one override line, no device peaks. Needs the two call sites
/// in src/pipeline (the refactor in progress there) to use `Progress::overrides` and
/// `progress::describe_peaks`.
#[test]
fn a_cpu_run_prints_one_override_line_and_no_device_peaks() {
    let out = tempdir().join("cpu-run");
    let run = vidgen(&[
        "generate",
        "--model",
        "synthetic:wan2.1-tiny",
        "--device",
        "cpu",
        "--prompt",
        "a fox",
        "--seed",
        "1",
        "--height",
        "32",
        "--width",
        "32",
        "--num-frames",
        "5",
        "--num-inference-steps",
        "1",
        "--max-sequence-length",
        "16",
        "--overwrite",
        "--output-path",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let moot: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("no accelerator"))
        .collect();
    assert_eq!(moot.len(), 1, "{stderr}");
    assert!(!stderr.contains("device peak"), "{stderr}");
    assert!(stderr.contains("host RSS peak"), "{stderr}");
}

#[test]
fn help_documents_every_flag_with_its_default() {
    let out = vidgen(&["generate", "--help"]);
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for (flag, default) in [
        ("--dit-cpu-offload", "true"),
        ("--use-fsdp-inference", "false"),
        ("--dit-layerwise-offload", "true"),
        ("--text-encoder-cpu-offload", "true"),
        ("--image-encoder-cpu-offload", "true"),
        ("--vae-cpu-offload", "true"),
        ("--pin-cpu-memory", "true"),
        ("--lazy-module-load", "auto"),
        ("--h3-sequential-load", "auto"),
        ("--offload-type", "block-level"),
        ("--num-blocks-per-group", "1"),
        ("--offload-stream", "true"),
        (
            "--prefetch-depth",
            "1; leaf level: as many steps as make the smallest block",
        ),
        ("--model-cpu-offload", "false"),
        ("--sequential-cpu-offload", "false"),
        ("--model", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
        ("--height", "480"),
        ("--width", "832"),
        ("--num-frames", "81"),
        ("--fps", "16"),
        ("--num-inference-steps", "50"),
        ("--guidance-scale", "5"),
        ("--max-sequence-length", "512"),
        ("--output-path", "outputs"),
        ("--output-type", "mp4"),
        ("--device", "auto"),
        ("--num-gpus", "1"),
        ("--memory-model", "auto"),
    ] {
        // An on/off flag is shown with its negation: `--[no-]dit-cpu-offload`.
        let negatable = format!("--[no-]{}", &flag[2..]);
        let pos = [flag, negatable.as_str()]
            .iter()
            .flat_map(|f| [format!("{f} "), format!("{f}\n")])
            .find_map(|f| help.find(&f))
            .unwrap_or_else(|| panic!("{flag} missing from help"));
        let entry: String = help[pos..]
            .split("\n      --")
            .next()
            .unwrap()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            entry.contains(&format!("[default: {default}]")),
            "{flag}: {entry}"
        );
        assert_eq!(entry.matches("[default:").count(), 1, "{flag}: {entry}");
    }
    for on_off in HOST_OFFLOAD.iter().chain(&[
        "use_fsdp_inference",
        "pin_cpu_memory",
        "lazy_module_load",
        "h3_sequential_load",
        "offload_stream",
        "model_cpu_offload",
        "sequential_cpu_offload",
        "vae_tiling",
        "overwrite",
        "resume",
        "quiet",
    ]) {
        let negatable = format!("--[no-]{} [<", on_off.replace('_', "-"));
        assert!(help.contains(&negatable), "{negatable} missing from help");
    }
    for flag in [
        "--sequential-load",
        "--flow-shift",
        "--seed",
        "--latents",
        "--output-video-name",
        "--dtype",
        "--negative-prompt",
        "--config",
        "--dry-run",
    ] {
        assert!(help.contains(flag), "{flag} missing from help");
    }
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "vidgen-cli-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
