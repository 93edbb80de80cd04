//! The memory plan against what it predicts: parameter counts against the published state
//! dicts (`tests/fixtures/wan2.1-configs.json`, written by diffusers/transformers), weight bytes
//! against what the tiny models really hold, and the dry run's report.

mod common;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use serde_json::Value;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use vidgen::cli::{parse, Parsed, ResolvedConfig};
use vidgen::memory::plan::{gib, wan, MemoryPlan, Params};
use vidgen::models::loader::{component_weights, var_builder};
use vidgen::models::source::ModelSource;
use vidgen::models::wan::text_encoder::{UMT5Config, UMT5EncoderModel};
use vidgen::models::wan::transformer::{
    BlockStep, WanTransformer3DModel, WanTransformerBlock, WanTransformerConfig,
};
use vidgen::models::wan::vae::{AutoencoderKLWan, WanVaeConfig};
use vidgen::pipeline::wan_t2v::WanConfigs;

const REPOS: [(&str, &str, &str); 2] = [
    (
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "transformer_Wan2.1-T2V-1.3B",
        "wan2.1-t2v-1.3b",
    ),
    (
        "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        "transformer_Wan2.1-T2V-14B",
        "wan2.1-t2v-14b",
    ),
];

/// The published configs and state-dict layouts.
fn published() -> Value {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wan2.1-configs.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// A config of a published model, as its repository ships it.
fn published_config<T: serde::de::DeserializeOwned>(repo: &str, file: &str) -> T {
    serde_json::from_value(published()["models"][repo][file].clone()).unwrap()
}

/// The modules a library keeps in f32, as the fixture quotes its `_keep_in_fp32_modules`.
fn kept_f32_modules(component: &str) -> Vec<String> {
    let text = published()["weights_dtype"][component]["recommended_runtime"]
        .as_str()
        .unwrap()
        .to_string();
    let list = text
        .split("_keep_in_fp32_modules = [")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .expect("the fixture quotes _keep_in_fp32_modules");
    list.split(',')
        .map(|m| m.trim().trim_matches('"').to_string())
        .collect()
}

/// Parameters of the tensors of a published state dict whose names pass `wanted`; a tensor
/// counts as kept f32 when a module of `kept` is one of its name's parts (as the libraries
/// match `_keep_in_fp32_modules`).
fn state_dict_params(state_dict: &str, kept: &[String], wanted: impl Fn(&str) -> bool) -> Params {
    let tensors = published()["state_dicts"][state_dict]["tensors"].clone();
    let mut params = Params::default();
    for (name, shape) in tensors.as_object().unwrap() {
        if !wanted(name) {
            continue;
        }
        let n: u64 = shape
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .product();
        params.count += n;
        if name.split('.').any(|part| kept.iter().any(|k| k == part)) {
            params.kept_f32 += n;
        }
    }
    params
}

fn shipped(name: &str) -> WanConfigs {
    WanConfigs::read(&ModelSource::parse(&format!("synthetic:{name}")).unwrap()).unwrap()
}

#[test]
fn transformer_parameters_match_the_published_state_dicts() {
    let kept = kept_f32_modules("transformer");
    // The f32 share diffusers keeps, as published (GiB to three decimals).
    for ((repo, state_dict, name), f32_gib) in REPOS.iter().zip(["0.012", "0.109"]) {
        let cfg: WanTransformerConfig = published_config(repo, "transformer/config.json");
        assert_eq!(shipped(name).transformer, cfg, "{name}: shipped config");
        let all = state_dict_params(state_dict, &kept, |_| true);
        assert_eq!(
            Some(all.count),
            published()["state_dicts"][state_dict]["num_parameters"].as_u64()
        );
        assert_eq!(wan::transformer(&cfg), all, "{repo}");
        assert_eq!(
            wan::transformer_block(&cfg),
            state_dict_params(state_dict, &kept, |n| n.starts_with("blocks.0."))
        );
        assert_eq!(
            wan::transformer_shared(&cfg),
            state_dict_params(state_dict, &kept, |n| !n.starts_with("blocks."))
        );
        let f32_bytes = wan::transformer(&cfg).kept_f32 * 4;
        assert_eq!(format!("{:.3}", gib(f32_bytes)), f32_gib, "{repo}");
    }
}

#[test]
fn text_encoder_and_vae_parameters_match_the_published_state_dicts() {
    let te_dict = "text_encoder_UMT5EncoderModel_umt5-xxl";
    let kept = kept_f32_modules("text_encoder");
    let (repo, _, name) = REPOS[0];
    let cfg: UMT5Config = published_config(repo, "text_encoder/config.json");
    // The tied embedding is listed under both names and stored (and loaded) once.
    let stored = |n: &str| n != "encoder.embed_tokens.weight";
    assert_eq!(
        wan::text_encoder(&cfg),
        state_dict_params(te_dict, &kept, stored)
    );
    assert_eq!(
        wan::text_encoder(&shipped(name).text_encoder),
        wan::text_encoder(&cfg)
    );
    assert_eq!(
        wan::text_encoder_block(&cfg),
        state_dict_params(te_dict, &kept, |n| n.starts_with("encoder.block.0."))
    );
    assert_eq!(
        wan::text_encoder_outer(&cfg),
        state_dict_params(te_dict, &kept, |n| stored(n) && !n.contains(".block."))
    );

    let vae_dict = "vae_AutoencoderKLWan_Wan2.1";
    let cfg: WanVaeConfig = published_config(repo, "vae/config.json");
    let all = state_dict_params(vae_dict, &[], |_| true);
    assert_eq!(wan::vae(&cfg).count, all.count);
    assert_eq!(wan::vae(&shipped(name).vae).count, all.count);
    assert_eq!(
        Some(all.count),
        published()["state_dicts"][vae_dict]["num_parameters"].as_u64()
    );
}

/// Adds up the bytes of every tensor a model asks its `VarBuilder` for.
struct Counting {
    inner: VarBuilder<'static>,
    bytes: Arc<AtomicUsize>,
}

impl Counting {
    fn count(&self, t: Tensor) -> candle_core::Result<Tensor> {
        self.bytes.fetch_add(
            t.elem_count() * t.dtype().size_in_bytes(),
            Ordering::Relaxed,
        );
        Ok(t)
    }
}

impl SimpleBackend for Counting {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let vb = self.inner.clone().set_dtype(dtype);
        self.count(vb.get_with_hints(s, name, h)?.to_device(dev)?)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let vb = self.inner.clone().set_dtype(dtype);
        self.count(vb.get_unchecked(name)?.to_device(dev)?)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// Bytes of the weights `build` holds once built from `component`'s weights in `dtype`.
fn held<M>(
    source: &ModelSource,
    component: &str,
    dtype: DType,
    build: impl FnOnce(VarBuilder<'static>) -> candle_core::Result<M>,
) -> u64 {
    let weights = component_weights(source, component).unwrap();
    let bytes = Arc::new(AtomicUsize::new(0));
    let counting = Counting {
        inner: var_builder(&weights, dtype, &Device::Cpu).unwrap(),
        bytes: bytes.clone(),
    };
    let model = build(VarBuilder::from_backend(
        Box::new(counting),
        dtype,
        Device::Cpu,
    ))
    .unwrap();
    drop(model);
    bytes.load(Ordering::Relaxed) as u64
}

/// For the tiny fixture (real safetensors) and the shipped tiny configs (synthetic weights),
/// in every run dtype: the plan's bytes of each component, and of the parts the offload
/// engine moves apart, are what the models hold.
#[test]
fn planned_weight_bytes_equal_what_the_tiny_models_hold() {
    let fixture = ModelSource::parse(common::fixture_dir().to_str().unwrap()).unwrap();
    let synthetic = ModelSource::parse("synthetic:wan2.1-tiny").unwrap();
    for source in [fixture, synthetic] {
        let configs = WanConfigs::read(&source).unwrap();
        let (te, dit) = (&configs.text_encoder, &configs.transformer);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let what = format!("{source} in {dtype:?}");
            let held =
                |component, build: &dyn Fn(VarBuilder<'static>) -> candle_core::Result<()>| {
                    held(&source, component, dtype, build)
                };
            assert_eq!(
                held("text_encoder", &|vb| UMT5EncoderModel::new(te, vb)
                    .map(drop)),
                wan::text_encoder(te).bytes(dtype),
                "{what}"
            );
            assert_eq!(
                held("text_encoder", &|vb| UMT5EncoderModel::new_without_blocks(
                    te,
                    vb.clone(),
                    vb
                )
                .map(drop)),
                wan::text_encoder_outer(te).bytes(dtype),
                "{what}"
            );
            assert_eq!(
                held("text_encoder", &|vb| UMT5EncoderModel::block(te, 0, vb)
                    .map(drop)),
                wan::text_encoder_block(te).bytes(dtype),
                "{what}"
            );
            assert_eq!(
                held("transformer", &|vb| WanTransformer3DModel::new(dit, vb)
                    .map(drop)),
                wan::transformer(dit).bytes(dtype),
                "{what}"
            );
            assert_eq!(
                held("transformer", &|vb| {
                    WanTransformer3DModel::new_without_blocks(dit, vb).map(drop)
                }),
                wan::transformer_shared(dit).bytes(dtype),
                "{what}"
            );
            assert_eq!(
                held("transformer", &|vb| WanTransformerBlock::new(
                    dit,
                    vb.pp("blocks.0")
                )
                .map(drop)),
                wan::transformer_block(dit).bytes(dtype),
                "{what}"
            );
            for (step, planned) in BlockStep::ALL.into_iter().zip(wan::transformer_steps(dit)) {
                assert_eq!(
                    held("transformer", &|vb| WanTransformerBlock::with_steps(
                        dit,
                        vb.pp("blocks.0"),
                        &[step]
                    )
                    .map(drop)),
                    planned.bytes(dtype),
                    "{what}: {step:?}"
                );
            }
        }
        // The VAE runs in f32 whatever the run dtype.
        assert_eq!(
            held(&source, "vae", DType::F32, |vb| AutoencoderKLWan::new(
                &configs.vae,
                vb
            )),
            wan::vae(&configs.vae).bytes(DType::BF16),
            "{source}"
        );
    }
}

/// A resolved `vidgen generate --dry-run --device cpu ARGS`.
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

fn plan_of(configs: &WanConfigs, args: &[&str]) -> MemoryPlan {
    wan::plan(configs, &resolve(args)).unwrap()
}

/// bf16 bytes of one published 14B block: f32 for the modules diffusers keeps in f32.
fn published_14b_block_bf16_bytes() -> u64 {
    let p = state_dict_params(REPOS[1].1, &kept_f32_modules("transformer"), |n| {
        n.starts_with("blocks.0.")
    });
    (p.count - p.kept_f32) * 2 + p.kept_f32 * 4
}

/// Streaming the DiT's blocks takes all but the groups in flight off the device while
/// denoising: (prefetch depth + 1) groups with a copy stream, one group without.
#[test]
fn layerwise_offload_lowers_the_denoise_weights_by_the_streamed_blocks() {
    let configs = shipped("wan2.1-t2v-14b");
    let layers = configs.transformer.num_layers as u64;
    let block = published_14b_block_bf16_bytes();
    let base = [
        "--memory-model",
        "discrete",
        "--dtype",
        "bf16",
        "--lazy-module-load",
    ];
    let resident = plan_of(
        &configs,
        &[
            &base[..],
            &["--no-dit-layerwise-offload", "--no-dit-cpu-offload"],
        ]
        .concat(),
    );
    for (per_group, depth, stream) in [(1, 1, true), (2, 2, true), (4, 1, true), (3, 2, false)] {
        let (g, d) = (per_group.to_string(), depth.to_string());
        let mut args = base.to_vec();
        args.extend(["--dit-layerwise-offload", "--num-blocks-per-group", &g]);
        args.extend(["--prefetch-depth", &d]);
        if !stream {
            args.push("--no-offload-stream");
        }
        let streamed = plan_of(&configs, &args);
        let groups_on_device = if stream { depth + 1 } else { 1 };
        let kept = layers.min(groups_on_device * per_group);
        let saved = |name| {
            resident.stage(name).unwrap().weight_bytes - streamed.stage(name).unwrap().weight_bytes
        };
        assert_eq!(saved("denoise"), (layers - kept) * block, "{args:?}");
        assert_eq!(saved("decode"), 0, "{args:?}: lazy, the DiT is gone");
        assert_eq!(
            resident.stage("denoise").unwrap().activation_bytes,
            streamed.stage("denoise").unwrap().activation_bytes
        );
    }
}

/// Step-by-step streaming (`--offload-type leaf-level`) keeps `depth + 1` of the largest step
/// of a block on the device (one without a stream), not whole blocks.
#[test]
fn leaf_level_offload_holds_the_largest_steps_not_whole_blocks() {
    let configs = shipped("wan2.1-t2v-14b");
    let dit = &configs.transformer;
    let bf16 = |p: Params| p.bytes(DType::BF16);
    let step = wan::transformer_steps(dit)
        .map(bf16)
        .into_iter()
        .max()
        .unwrap();
    let shared = bf16(wan::transformer_shared(dit));
    assert!(
        2 * step < bf16(wan::transformer_block(dit)),
        "a step is well under a block"
    );
    for (depth, stream) in [(1u64, true), (2, true), (1, false)] {
        let d = depth.to_string();
        let mut args = vec![
            "--memory-model",
            "discrete",
            "--dtype",
            "bf16",
            "--lazy-module-load",
        ];
        args.extend(["--offload-type", "leaf-level", "--prefetch-depth", &d]);
        if !stream {
            args.push("--no-offload-stream");
        }
        let on_device = if stream { depth + 1 } else { 1 };
        assert_eq!(
            plan_of(&configs, &args)
                .stage("denoise")
                .unwrap()
                .weight_bytes,
            shared + on_device * step,
            "{args:?}"
        );
    }
}

/// The runner's schedule decides which components a stage holds: all three when eager, only
/// the stage's own with lazy load, the text encoder alone and then the DiT and VAE with
/// sequential load.
#[test]
fn the_load_policy_decides_which_weights_each_stage_holds() {
    let configs = shipped("wan2.1-t2v-1.3b");
    let dtype = DType::BF16;
    let te = wan::text_encoder(&configs.text_encoder).bytes(dtype);
    let dit = wan::transformer(&configs.transformer).bytes(dtype);
    let vae = wan::vae(&configs.vae).bytes(dtype);
    let resident = [
        "--memory-model",
        "discrete",
        "--dtype",
        "bf16",
        "--no-dit-layerwise-offload",
        "--no-dit-cpu-offload",
        "--no-text-encoder-cpu-offload",
        "--no-vae-cpu-offload",
    ];
    let cases: [(&str, [u64; 4]); 3] = [
        ("--no-lazy-module-load", [te + dit + vae; 4]),
        ("--lazy-module-load", [te, dit, vae, 0]),
        (
            "--h3-sequential-load",
            [te, dit + vae, dit + vae, dit + vae],
        ),
    ];
    for (flag, expected) in cases {
        let plan = plan_of(&configs, &[&resident[..], &[flag]].concat());
        let weights: Vec<u64> = plan.stages.iter().map(|s| s.weight_bytes).collect();
        assert_eq!(weights, expected, "{flag}");
    }
}

/// Parked components are on the device only for their own stage; a text encoder computing
/// on the CPU never is.
#[test]
fn offloaded_components_leave_the_device_between_their_stages() {
    let configs = shipped("wan2.1-t2v-1.3b");
    let vae = wan::vae(&configs.vae).bytes(DType::BF16);
    let args = [
        "--memory-model",
        "discrete",
        "--dtype",
        "bf16",
        "--no-lazy-module-load",
        "--no-dit-layerwise-offload",
        "--no-dit-cpu-offload",
    ];
    let parked = plan_of(
        &configs,
        &[
            &args[..],
            &["--vae-cpu-offload", "--no-text-encoder-cpu-offload"],
        ]
        .concat(),
    );
    let resident = plan_of(
        &configs,
        &[
            &args[..],
            &["--no-vae-cpu-offload", "--no-text-encoder-cpu-offload"],
        ]
        .concat(),
    );
    for (stage, difference) in [("encode_text", vae), ("denoise", vae), ("decode", 0)] {
        assert_eq!(
            resident.stage(stage).unwrap().weight_bytes - parked.stage(stage).unwrap().weight_bytes,
            difference,
            "{stage}"
        );
    }
    let on_cpu = plan_of(
        &configs,
        &[
            &args[..],
            &[
                "--no-vae-cpu-offload",
                "--text-encoder-cpu-offload",
                "--text-encoder-compute",
                "cpu",
            ],
        ]
        .concat(),
    );
    let te = wan::text_encoder(&configs.text_encoder).bytes(DType::BF16);
    let encode = |p: &MemoryPlan| p.stage("encode_text").unwrap().clone();
    assert_eq!(
        encode(&resident).weight_bytes - encode(&on_cpu).weight_bytes,
        te
    );
    assert_eq!(encode(&on_cpu).activation_bytes, 0);
}

/// Tiling bounds the decode by the tile size: less than a whole 480x832 decode, the same for a
/// video that fits in one tile (decoded whole, as `decode_tiled` does).
#[test]
fn vae_tiling_lowers_the_decode_of_large_videos_only() {
    let configs = shipped("wan2.1-t2v-1.3b");
    let decode = |size: &[&str], tiling: bool| {
        let mut args = vec!["--memory-model", "discrete", "--lazy-module-load"];
        args.extend_from_slice(size);
        if tiling {
            args.push("--vae-tiling");
        }
        plan_of(&configs, &args)
            .stage("decode")
            .unwrap()
            .activation_bytes
    };
    let large = ["--height", "480", "--width", "832"];
    assert!(decode(&large, true) < decode(&large, false));
    let one_tile = ["--height", "256", "--width", "256"];
    assert_eq!(decode(&one_tile, true), decode(&one_tile, false));
}

fn dry_run(args: &[&str], hf_home: &std::path::Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_vidgen"))
        .args(["generate", "--dry-run", "--device", "cpu"])
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", hf_home)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `--dry-run --json` carries each stage's predicted weights, activations and peak, and the
/// run's peak; the text report shows the same peaks.
#[test]
fn the_dry_run_reports_the_predicted_peak_of_every_stage() {
    let hf_home = std::env::temp_dir().join(format!("vidgen-plan-hf-{}", std::process::id()));
    let configs = shipped("wan2.1-t2v-14b");
    let args = [
        "--model",
        "synthetic:wan2.1-t2v-14b",
        "--memory-model",
        "discrete",
        "--dtype",
        "bf16",
        "--num-frames",
        "41",
    ];
    let expected = plan_of(&configs, &args);
    let json: Value =
        serde_json::from_str(&dry_run(&[&args[..], &["--json"]].concat(), &hf_home)).unwrap();
    let stages = json["stages"].as_array().unwrap();
    assert_eq!(stages.len(), expected.stages.len());
    for (stage, want) in stages.iter().zip(&expected.stages) {
        let m = &stage["memory"];
        assert_eq!(stage["name"], want.name);
        assert_eq!(m["weight_bytes"], want.weight_bytes);
        assert_eq!(m["activation_bytes"], want.activation_bytes);
        assert_eq!(
            m["peak_bytes"].as_u64(),
            Some(want.weight_bytes + want.activation_bytes)
        );
    }
    let peak = expected.peak().unwrap();
    let plan = &json["memory_plan"];
    assert_eq!(plan["peak_stage"], peak.name);
    assert_eq!(plan["peak_bytes"], peak.peak_bytes);
    assert_eq!(
        plan["peak_bytes"].as_u64(),
        stages
            .iter()
            .filter_map(|s| s["memory"]["peak_bytes"].as_u64())
            .max()
    );
    assert_eq!(plan["required_bytes"], expected.required_bytes());
    assert_eq!(
        plan["device_total_bytes"],
        Value::Null,
        "the CPU has no device limit"
    );

    let text = dry_run(&args, &hf_home);
    for want in &expected.stages {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{} ", want.name)))
            .unwrap_or_else(|| panic!("no line for {}: {text}", want.name));
        assert!(
            line.ends_with(&format!(" {:.2}", gib(want.peak_bytes))),
            "{line}"
        );
    }
    assert!(
        text.contains(&format!("predicted peak {}", expected.describe_peak())),
        "{text}"
    );
}

/// A Hub model not in the cache is planned from the published configs vidgen ships; one whose
/// configs are nowhere to be read has no plan, and the report says why.
#[test]
fn the_dry_run_plans_uncached_published_models_from_shipped_configs() {
    let hf_home = std::env::temp_dir().join(format!("vidgen-plan-empty-hf-{}", std::process::id()));
    let (repo, _, name) = REPOS[1];
    let json: Value =
        serde_json::from_str(&dry_run(&["--json", "--model", repo], &hf_home)).unwrap();
    assert_eq!(json["model"]["configs_from"], "shipped");
    let args = ["--model", &format!("synthetic:{name}")];
    let synthetic: Value =
        serde_json::from_str(&dry_run(&[&args[..], &["--json"]].concat(), &hf_home)).unwrap();
    assert_eq!(json["memory_plan"], synthetic["memory_plan"]);
    assert!(json["memory_plan"]["peak_bytes"].as_u64().unwrap() > 0);

    let unknown = ["--model", "someone/not-a-wan-model"];
    let json: Value =
        serde_json::from_str(&dry_run(&[&unknown[..], &["--json"]].concat(), &hf_home)).unwrap();
    assert_eq!(json["model"]["configs_read"], false);
    assert_eq!(json["memory_plan"], Value::Null);
    assert!(json["stages"][0].get("memory").is_none());
    assert!(dry_run(&unknown, &hf_home).contains("memory not predicted"));
}
