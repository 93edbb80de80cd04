//! The frame reads only a family's description: a toy family made here from the tiny Wan parts
//! (a text encoder, two DiT experts, a VAE) is placed, planned, scheduled and run without any
//! change to the runner, the placement, the plan or the dry-run code.

mod common;

use anyhow::Result;
use std::sync::{Arc, Mutex};
use vidgen::cli::{parse, Parsed};
use vidgen::config::ResolvedConfig;
use vidgen::models::source::ModelSource;
use vidgen::models::wan::text_encoder::UMT5EncoderModel;
use vidgen::models::wan::transformer::WanTransformer3DModel;
use vidgen::models::wan::vae::AutoencoderKLWan;
use vidgen::offload::{HostMemory, Residency};
use vidgen::pipeline::frame::Frame;
use vidgen::pipeline::inert_options;
use vidgen::pipeline::placement::Placement;
use vidgen::pipeline::plan::{load_policy, Planner};
use vidgen::pipeline::registry::{About, Family, RunShape};
use vidgen::pipeline::runner::{self, BatchOrder, LoadPolicy, Pipeline};
use vidgen::pipeline::spec::{ComponentSpec, ModelConstructors, PipelineSpec, Role, StageSpec};
use vidgen::pipeline::wan_t2v::WanConfigs;

/// Two experts over the tiny Wan parts, as Wan2.2 A14B lays them out.
struct TwoExperts(WanConfigs);

impl Family for TwoExperts {
    fn about(&self) -> About {
        About::guided("two-expert toy", &[])
    }

    fn spec(&self, _: &RunShape) -> PipelineSpec {
        let c = &self.0;
        let component = |name, role, constructors| ComponentSpec {
            name,
            folder: name,
            role,
            dtype: None,
            deferrable: true,
            storage_cast_skip: &[],
            lora: None,
            constructors,
        };
        let dit = || {
            Arc::new(ModelConstructors::<WanTransformer3DModel>(
                c.transformer.clone(),
            ))
        };
        let stage = StageSpec::new;
        PipelineSpec {
            title: self.title(),
            components: vec![
                component(
                    "text_encoder",
                    Role::TextEncoder,
                    Arc::new(ModelConstructors::<UMT5EncoderModel>(
                        c.text_encoder.clone(),
                    )),
                ),
                component("transformer", Role::Dit, dit()),
                component("transformer_2", Role::Dit, dit()),
                component(
                    "vae",
                    Role::Vae,
                    Arc::new(ModelConstructors::<AutoencoderKLWan>(c.vae.clone())),
                ),
            ],
            stages: vec![
                stage("encode_text", &[0], 10),
                stage("denoise_high", &[1], 100),
                stage("denoise_low", &[2], 100),
                stage("decode", &[3], 1000),
                stage("write", &[], 0),
            ],
        }
    }

    fn facts(&self, _: &RunShape) -> serde_json::Value {
        serde_json::json!({ "experts": 2 })
    }

    fn open(&self, _: &Frame) -> Result<Box<dyn std::any::Any>> {
        anyhow::bail!("the toy family only plans")
    }
}

fn resolve(args: &[&str]) -> ResolvedConfig {
    let argv = ["vidgen", "generate", "--dry-run", "--device", "cpu"]
        .iter()
        .chain(args)
        .map(std::ffi::OsString::from);
    match parse(argv).unwrap() {
        Parsed::Generate(a) => ResolvedConfig::resolve(*a).unwrap(),
        Parsed::Info(text) => panic!("{text}"),
    }
}

fn toy() -> TwoExperts {
    let source = ModelSource::parse(common::fixture_dir().to_str().unwrap()).unwrap();
    TwoExperts(WanConfigs::read(&source).unwrap())
}

/// Both DiTs follow the DiT flags, the notes name what acts on nothing, and the plan holds
/// one expert at a time when components load lazily.
#[test]
fn a_toy_family_is_placed_and_planned_by_role() {
    let family = toy();
    let config = resolve(&[
        "--memory-model",
        "discrete",
        "--lazy-module-load",
        "--no-dit-layerwise-offload",
        "--dit-cpu-offload",
    ]);
    let planner = Planner::new(&family, &config);
    let spec = planner.spec(&planner.request());
    let placement = Placement::new(config.memory(), &spec);
    assert_eq!(placement.residencies[1], Residency::Parked);
    assert_eq!(placement.residencies[2], Residency::Parked);
    assert_eq!(
        placement.json()["components"]["transformer_2"]["mode"],
        "parked"
    );
    let notes = inert_options(config.memory(), &spec);
    assert!(
        notes
            .iter()
            .any(|n| n.contains("two-expert toy has no image encoder")),
        "{notes:?}"
    );

    let plan = planner.plan(&planner.request()).unwrap();
    let high = plan.stage("denoise_high").unwrap();
    let low = plan.stage("denoise_low").unwrap();
    assert_eq!(high.weight_bytes, low.weight_bytes, "the experts are alike");
    assert_eq!((high.activation_bytes, low.activation_bytes), (100, 100));
    assert!(plan.stage("encode_text").unwrap().weight_bytes < high.weight_bytes + 1);

    // Resident and eager, both experts stay on the device through both denoise stages; lazy,
    // one at a time.
    let resident = |lazy: &'static str| {
        let config = resolve(&[
            "--memory-model",
            "discrete",
            lazy,
            "--no-dit-layerwise-offload",
            "--no-dit-cpu-offload",
        ]);
        let planner = Planner::new(&family, &config);
        let plan = planner.plan(&planner.request()).unwrap();
        plan.stage("denoise_high").unwrap().weight_bytes
    };
    let one_expert = resident("--lazy-module-load");
    assert!(resident("--no-lazy-module-load") >= 2 * one_expert);
}

/// What the runner did, in order.
#[derive(Default)]
struct Log(Mutex<Vec<String>>);

/// A pipeline that runs nothing but records the runner's calls.
struct Recording<'a> {
    spec: PipelineSpec,
    log: &'a Log,
}

impl Pipeline for Recording<'_> {
    type Job = ();

    fn spec(&self) -> &PipelineSpec {
        &self.spec
    }

    fn load(&mut self, component: usize) -> Result<()> {
        let name = self.spec.components[component].name;
        self.log.0.lock().unwrap().push(format!("load {name}"));
        Ok(())
    }

    fn release(&mut self, component: usize) {
        let name = self.spec.components[component].name;
        self.log.0.lock().unwrap().push(format!("free {name}"));
    }

    fn run_stage(&mut self, index: usize, _: &mut ()) -> Result<()> {
        let name = self.spec.stages[index].name;
        self.log.0.lock().unwrap().push(format!("run {name}"));
        Ok(())
    }
}

/// The runner's calls for `jobs` prompts of the toy family, prompt by prompt, with `flags` (whose
/// load policy is `policy`), each stage's start logged as `<stage> <job>`; every job succeeds.
fn recorded_run(flags: &[&str], jobs: usize, policy: LoadPolicy) -> Vec<String> {
    let family = toy();
    let config = resolve(&[&["--memory-model", "discrete"][..], flags].concat());
    assert_eq!(load_policy(config.memory()), policy);
    let log = Log::default();
    let mut pipeline = Recording {
        spec: family.spec(&RunShape::of(&config)),
        log: &log,
    };
    let reports = runner::run(
        &mut pipeline,
        &mut vec![(); jobs],
        policy,
        BatchOrder::Prompt,
        |job, stage| log.0.lock().unwrap().push(format!("{stage} {job}")),
    );
    assert!(reports.iter().all(|r| r.error.is_none()));
    log.0.into_inner().unwrap()
}

/// Loading lazily, the runner frees the first expert before the second loads: only the expert
/// in use needs the device.
#[test]
fn the_runner_switches_experts_without_holding_both() {
    let log = recorded_run(&["--lazy-module-load"], 1, LoadPolicy::Lazy);
    let at = |entry: &str| log.iter().position(|l| l == entry).unwrap();
    assert!(at("free transformer") < at("load transformer_2"), "{log:?}");
    assert!(at("free text_encoder") < at("load transformer"), "{log:?}");
    assert_eq!(log.last().map(String::as_str), Some("run write"), "{log:?}");
}

/// Loading eagerly, every component stays loaded for the next prompt, and the last prompt
/// releases each after its last stage (the encoder before the denoising, the experts before the
/// decode), so the stages after have its memory and its teardown overlaps them.
#[test]
fn the_last_prompt_releases_each_component_after_its_last_stage() {
    let log = recorded_run(&[], 2, LoadPolicy::Eager);
    let at = |entry: &str| log.iter().position(|l| l == entry).unwrap();
    // Loaded once, before the first prompt's first stage.
    for name in ["text_encoder", "transformer", "transformer_2", "vae"] {
        let load = format!("load {name}");
        assert_eq!(log.iter().filter(|l| **l == load).count(), 1, "{log:?}");
        assert!(at(&load) < at("run encode_text"), "{log:?}");
    }
    // Nothing is freed before the last prompt begins.
    let first_free = log.iter().position(|l| l.starts_with("free ")).unwrap();
    assert!(first_free > at("encode_text 1"), "{log:?}");
    // Then each component right after its last stage.
    let last_run = |stage: &str| {
        log.iter()
            .rposition(|l| *l == format!("run {stage}"))
            .unwrap()
    };
    for (name, stage) in [
        ("text_encoder", "encode_text"),
        ("transformer", "denoise_high"),
        ("transformer_2", "denoise_low"),
        ("vae", "decode"),
    ] {
        assert_eq!(at(&format!("free {name}")), last_run(stage) + 1, "{log:?}");
    }
    assert_eq!(log.last().map(String::as_str), Some("run write"), "{log:?}");
}

/// A model whose pipeline no family runs (here the Wan2.1 image-to-video fixture) is refused
/// at once as bad input naming its class, in a dry run and a real run alike.
#[test]
fn a_pipeline_no_family_runs_is_bad_input() {
    // A Wan model of a pipeline no family runs (VACE): the I2V fixture's configs under another
    // `_class_name`.
    let source = common::named_fixture_dir("wan21-i2v-tiny-a");
    let fixture = std::env::temp_dir().join(format!("vidgen-vace-{}", std::process::id()));
    for rel in [
        "model_index.json",
        "transformer/config.json",
        "vae/config.json",
        "text_encoder/config.json",
        "scheduler/scheduler_config.json",
        "image_encoder/config.json",
        "image_processor/preprocessor_config.json",
    ] {
        let to = fixture.join(rel);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        let text = std::fs::read_to_string(source.join(rel)).unwrap();
        std::fs::write(
            &to,
            text.replace("\"WanImageToVideoPipeline\"", "\"WanVACEPipeline\""),
        )
        .unwrap();
    }
    let out_dir = std::env::temp_dir().join(format!("vidgen-family-{}", std::process::id()));
    for run in [&["--dry-run"][..], &["--prompt", "a"]] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_vidgen"))
            .args(["generate", "--model", fixture.to_str().unwrap()])
            .args([
                "--device",
                "cpu",
                "--memory-model",
                "discrete",
                "--output-path",
            ])
            .arg(&out_dir)
            .args(run)
            .output()
            .unwrap();
        let stderr = common::usage_error(&out, &format!("{run:?}"));
        assert!(stderr.contains("WanVACEPipeline"), "{stderr}");
    }
}

/// A family's defaults replace only what the user did not give, on the command line or in the
/// config file, and the result is checked as a whole.
#[test]
fn model_defaults_fill_only_what_was_not_given() {
    use vidgen::config::ModelDefaults;
    let dir = std::env::temp_dir().join(format!("vidgen-defaults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("c.toml");
    std::fs::write(&file, "num_frames = 49\n").unwrap();
    let config = resolve(&["--height", "256", "--config", file.to_str().unwrap()]);
    let defaults = ModelDefaults {
        height: Some(512),
        width: Some(768),
        num_frames: Some(161),
        fps: Some(24),
        ..ModelDefaults::default()
    };
    let o = config.with_model_defaults(&defaults).unwrap();
    assert_eq!(
        (
            o.video().height,
            o.video().width,
            o.video().num_frames,
            o.output().fps
        ),
        (256, 768, 49, 24)
    );
    let bad = ModelDefaults {
        num_frames: Some(80),
        ..ModelDefaults::default()
    };
    assert!(resolve(&[]).with_model_defaults(&bad).is_err());
    // An image model's output type (FLUX.1's png) replaces only one not given.
    use vidgen::output::OutputType;
    let image = ModelDefaults {
        image: true,
        ..ModelDefaults::default()
    };
    let kind = |args: &[&str]| {
        resolve(args)
            .with_model_defaults(&image)
            .unwrap()
            .output()
            .kind
    };
    assert_eq!(kind(&[]), OutputType::Png);
    assert_eq!(
        kind(&["--output-type", "safetensors"]),
        OutputType::Safetensors
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Stage-major (each component loads once per group of prompts): each video is written as soon
/// as it is decoded, not after the batch's last decode, and at most `MAX_IN_FLIGHT` prompts wait
/// between stages however long the batch: what they hold (embeddings, latents) is bounded.
#[test]
fn stage_major_batches_write_each_video_at_once_and_bound_what_waits() {
    let family = toy();
    let config = resolve(&["--memory-model", "discrete", "--lazy-module-load"]);
    let log = Log::default();
    let mut pipeline = Recording {
        spec: family.spec(&RunShape::of(&config)),
        log: &log,
    };
    let n = 2 * runner::MAX_IN_FLIGHT + 3;
    let reports = runner::run(
        &mut pipeline,
        &mut vec![(); n],
        LoadPolicy::Lazy,
        BatchOrder::Stage,
        |job, stage| log.0.lock().unwrap().push(format!("{stage} {job}")),
    );
    assert!(reports.iter().all(|r| r.error.is_none()));
    let log = log.0.into_inner().unwrap();
    // The stages as they started, `<stage> <job>`.
    let started: Vec<&String> = log
        .iter()
        .filter(|l| {
            l.rsplit(' ')
                .next()
                .is_some_and(|j| j.parse::<usize>().is_ok())
        })
        .collect();
    let at = |entry: &str| {
        started
            .iter()
            .position(|l| *l == entry)
            .unwrap_or_else(|| panic!("no {entry}: {log:?}"))
    };
    for job in 0..n {
        // Its write follows its decode at once.
        assert_eq!(
            at(&format!("write {job}")),
            at(&format!("decode {job}")) + 1
        );
        for (a, b) in [
            ("encode_text", "denoise_high"),
            ("denoise_high", "denoise_low"),
        ] {
            assert!(at(&format!("{a} {job}")) < at(&format!("{b} {job}")));
        }
    }
    // Prompts begun (encoded) but not yet written never outnumber the bound.
    let mut waiting = 0usize;
    let mut most = 0;
    for line in &log {
        if line.starts_with("encode_text ") {
            waiting += 1;
        } else if line.starts_with("write ") {
            waiting -= 1;
        }
        most = most.max(waiting);
    }
    assert_eq!(most, runner::MAX_IN_FLIGHT, "{log:?}");
    // Each component loads once per group of prompts, and is freed as often.
    let loads = log.iter().filter(|l| *l == "load text_encoder").count();
    assert_eq!(loads, n.div_ceil(runner::MAX_IN_FLIGHT));
    assert_eq!(log.iter().filter(|l| *l == "free vae").count(), loads);
}

/// With pinned host memory (the default) the encoders, run once per job, stream from the
/// memory map through a staging ring and the DiTs are pinned; other host memory choices apply
/// to every component alike.
#[test]
fn encoders_stream_through_a_staging_ring_when_memory_is_pinned() {
    let family = toy();
    let placed = |flags: &[&str]| {
        let mut args = vec!["--memory-model", "discrete"];
        args.extend_from_slice(flags);
        let config = resolve(&args);
        let planner = Planner::new(&family, &config);
        let spec = planner.spec(&planner.request());
        let placement = Placement::new(config.memory(), &spec);
        let by_name = |name: &str| {
            let i = spec.components.iter().position(|c| c.name == name).unwrap();
            placement.memory_for(i)
        };
        (by_name("text_encoder"), by_name("transformer"))
    };
    assert_eq!(placed(&[]), (HostMemory::Staged, HostMemory::Pinned));
    assert_eq!(
        placed(&["--no-pin-cpu-memory"]),
        (HostMemory::Pageable, HostMemory::Pageable)
    );
    let bounded = HostMemory::Bounded {
        max_pinned: 1 << 30,
    };
    assert_eq!(placed(&["--max-pinned-memory", "1GiB"]), (bounded, bounded));
}
