//! The memory plan against what it predicts: weight bytes recorded from the model constructors
//! against the published state dicts (`tests/fixtures/wan2.1-configs.json`, written by
//! diffusers/transformers) and against what the tiny models and the offload engine really hold,
//! the plans of the load policies and offload modes, the out-of-memory advice, and the dry run's
//! report.

mod common;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use serde_json::Value;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use vidgen::cli::{parse, Parsed};
use vidgen::config::ResolvedConfig;
use vidgen::memory::plan::{self as memory_plan, first_fitting, gib, Fit, MemoryPlan};
use vidgen::models::source::{component_weights, ModelSource};
use vidgen::models::wan::text_encoder::{UMT5Config, UMT5EncoderModel};
use vidgen::models::wan::transformer::{
    BlockStep, WanTransformer3DModel, WanTransformerBlock, WanTransformerConfig,
};
use vidgen::models::wan::vae::{AutoencoderKLWan, WanVaeConfig};
use vidgen::offload::residency::between_passes_bytes;
use vidgen::offload::{record, HostMemory, Packing, Residency, StreamOptions};
use vidgen::pipeline::holding::{Holding, Outer};
use vidgen::pipeline::placement::{Blockwise, Placed};
use vidgen::pipeline::plan::Planner;
use vidgen::pipeline::registry::Configs;
use vidgen::pipeline::spec::{Constructors, ModelConstructors};
use vidgen::pipeline::wan_t2v::WanConfigs;
use vidgen::weights::{var_builder, WeightSet};

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

/// Bytes in `dtype` of the tensors of a published state dict whose names pass `wanted`; a tensor
/// stays f32 when a module of `kept` is one of its name's parts (as the libraries match
/// `_keep_in_fp32_modules`).
fn state_dict_bytes(
    state_dict: &str,
    kept: &[String],
    dtype: DType,
    wanted: impl Fn(&str) -> bool,
) -> u64 {
    let tensors = published()["state_dicts"][state_dict]["tensors"].clone();
    let mut bytes = 0;
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
        let kept_f32 = name.split('.').any(|part| kept.iter().any(|k| k == part));
        bytes += n * if kept_f32 {
            4
        } else {
            dtype.size_in_bytes() as u64
        };
    }
    bytes
}

fn shipped(name: &str) -> WanConfigs {
    WanConfigs::read(&ModelSource::parse(&format!("synthetic:{name}")).unwrap()).unwrap()
}

/// Tensor bytes `build` asks for, recorded from the constructors alone (nothing allocated).
fn recorded<B>(
    dtype: DType,
    build: impl FnOnce(VarBuilder<'static>) -> candle_core::Result<B>,
) -> u64 {
    record(None, dtype, Packing::ByDtype, build)
        .unwrap()
        .tensor_bytes() as u64
}

fn streamed(blocks_per_group: usize, by_step: bool, stream: bool, depth: usize) -> Residency {
    Residency::Streamed {
        blocks_per_group,
        by_step,
        options: StreamOptions {
            stream,
            depth,
            kept_bytes: 0,
            // As leaf level streams (the placement's rule).
            exact_fills: by_step,
        },
    }
}

/// How `constructors` hold their component streamed one block per group on a copy stream.
fn streamed_holding(constructors: &dyn Constructors, dtype: DType) -> Holding {
    constructors
        .holding(streamed(1, false, true, 1), None, dtype)
        .unwrap()
}

/// The constructors of the published 1.3B and 14B DiTs ask for exactly the published tensors,
/// in bf16 with diffusers' f32 modules kept f32: whole, their outer part, and one block.
#[test]
fn transformer_weights_match_the_published_state_dicts() {
    let kept = kept_f32_modules("transformer");
    for (repo, state_dict, name) in REPOS {
        let cfg: WanTransformerConfig = published_config(repo, "transformer/config.json");
        assert_eq!(shipped(name).transformer, cfg, "{name}: shipped config");
        let bf16 = DType::BF16;
        let model = ModelConstructors::<WanTransformer3DModel>(cfg.clone());
        let resident = model.layout(Holding::Resident, bf16, None).unwrap();
        assert_eq!(
            resident.direct_bytes as u64,
            state_dict_bytes(state_dict, &kept, bf16, |_| true),
            "{repo}"
        );
        let layers = cfg.num_layers;
        let streaming = model
            .layout(streamed_holding(&model, bf16), bf16, None)
            .unwrap();
        assert_eq!(
            streaming.direct_bytes as u64,
            state_dict_bytes(state_dict, &kept, bf16, |n| !n.starts_with("blocks."))
        );
        assert_eq!(streaming.groups.len(), layers);
        assert_eq!(
            streaming.groups[0].tensor_bytes() as u64,
            state_dict_bytes(state_dict, &kept, bf16, |n| n.starts_with("blocks.0."))
        );
    }
}

#[test]
fn text_encoder_and_vae_weights_match_the_published_state_dicts() {
    let te_dict = "text_encoder_UMT5EncoderModel_umt5-xxl";
    let kept = kept_f32_modules("text_encoder");
    let (repo, _, name) = REPOS[0];
    let cfg: UMT5Config = published_config(repo, "text_encoder/config.json");
    // The tied embedding is listed under both names and stored (and loaded) once.
    let stored = |n: &str| n != "encoder.embed_tokens.weight";
    let bf16 = DType::BF16;
    let encoder = ModelConstructors::<UMT5EncoderModel>(cfg.clone());
    assert_eq!(
        encoder
            .layout(Holding::Resident, bf16, None)
            .unwrap()
            .direct_bytes as u64,
        state_dict_bytes(te_dict, &kept, bf16, stored)
    );
    assert_eq!(
        resident::<UMT5EncoderModel>(&shipped(name).text_encoder, bf16),
        state_dict_bytes(te_dict, &kept, bf16, stored)
    );
    let streaming = encoder
        .layout(streamed_holding(&encoder, bf16), bf16, None)
        .unwrap();
    assert_eq!(
        streaming.groups[0].tensor_bytes() as u64,
        state_dict_bytes(te_dict, &kept, bf16, |n| n.starts_with("encoder.block.0."))
    );
    // Streamed, the token table stays in host memory: only the final norm is on the device.
    assert_eq!(
        streaming.direct_bytes as u64,
        state_dict_bytes(te_dict, &kept, bf16, |n| n
            .starts_with("encoder.final_layer_norm"))
    );

    let vae_dict = "vae_AutoencoderKLWan_Wan2.1";
    let cfg: WanVaeConfig = published_config(repo, "vae/config.json");
    let vae_bytes = |cfg: &WanVaeConfig| {
        ModelConstructors::<AutoencoderKLWan>(cfg.clone())
            .layout(Holding::Resident, DType::F32, None)
            .unwrap()
            .direct_bytes as u64
    };
    let all = state_dict_bytes(vae_dict, &[], DType::F32, |_| true);
    assert_eq!(vae_bytes(&cfg), all);
    assert_eq!(vae_bytes(&shipped(name).vae), all);
    assert_eq!(
        Some(all / 4),
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
/// in every run dtype: the bytes recorded from the constructors alone (what the plan counts) are
/// what the models hold once built from real weights.
#[test]
fn recorded_weight_bytes_equal_what_the_tiny_models_hold() {
    let fixture = ModelSource::parse(common::fixture_dir().to_str().unwrap()).unwrap();
    let synthetic = ModelSource::parse("synthetic:wan2.1-tiny").unwrap();
    for source in [fixture, synthetic] {
        let configs = WanConfigs::read(&source).unwrap();
        let (te, dit) = (&configs.text_encoder, &configs.transformer);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let what = format!("{source} in {dtype:?}");
            let check =
                |component, build: &dyn Fn(VarBuilder<'static>) -> candle_core::Result<()>| {
                    assert_eq!(
                        held(&source, component, dtype, build),
                        recorded(dtype, build),
                        "{what}: {component}"
                    );
                };
            check("text_encoder", &|vb| {
                UMT5EncoderModel::new(te, vb).map(drop)
            });
            check("text_encoder", &|vb| {
                UMT5EncoderModel::block(te, 0, vb).map(drop)
            });
            check("transformer", &|vb| {
                WanTransformer3DModel::new(dit, vb).map(drop)
            });
            check("transformer", &|vb| {
                WanTransformer3DModel::new_without_blocks(dit, vb).map(drop)
            });
            for step in BlockStep::ALL {
                check("transformer", &|vb| {
                    WanTransformerBlock::with_steps(dit, vb.pp("blocks.0"), &[step]).map(drop)
                });
            }
        }
        let vae = |vb| AutoencoderKLWan::new(&configs.vae, vb).map(drop);
        assert_eq!(
            held(&source, "vae", DType::F32, vae),
            recorded(DType::F32, vae),
            "{source}"
        );
    }
}

/// For every streamed mode, the plan's device bytes of a streamed component are what the
/// offload engine holds for it: the groups it records from the real weights are the groups the
/// plan records from the configs alone, and its slots (or, without a copy stream, the largest
/// group) are the plan's; the outer part is what the model holds. One group of every block
/// (`--num-blocks-per-group` = the layer count) included.
#[test]
fn the_plan_holds_what_the_offload_engine_allocates() {
    let source = ModelSource::parse(common::fixture_dir().to_str().unwrap()).unwrap();
    let configs = WanConfigs::read(&source).unwrap();
    let dit = &configs.transformer;
    let weights = WeightSet::open(&component_weights(&source, "transformer").unwrap()).unwrap();
    let layers = dit.num_layers;
    let dtype = DType::BF16;
    let mut modes = Vec::new();
    for (per_group, by_step) in [(1, false), (2, false), (layers, false), (1, true)] {
        for (stream, depth) in [(true, 1), (true, 2), (true, 4), (false, 1)] {
            modes.push(streamed(per_group, by_step, stream, depth));
        }
    }
    let constructors = ModelConstructors::<WanTransformer3DModel>(dit.clone());
    for residency in modes {
        let holding = constructors.holding(residency, None, dtype).unwrap();
        let planned = constructors.layout(holding, dtype, None).unwrap();
        let placed = Placed::<WanTransformer3DModel>::load(
            dit,
            &weights,
            holding,
            HostMemory::Pageable,
            dtype,
            &Device::Cpu,
            None,
        )
        .unwrap();
        let Placed::Streamed { blocks, .. } = &placed else {
            panic!("{residency:?}: not streamed");
        };
        let engine = blocks.layouts();
        assert_eq!(engine.len(), planned.groups.len(), "{residency:?}");
        for (e, p) in engine.iter().zip(&planned.groups) {
            assert_eq!((e.bytes, e.tensor_bytes()), (p.bytes, p.tensor_bytes()));
        }
        let weights = holding.device_weights(&planned);
        let usage = placed.offload_usage().unwrap();
        let (direct, streamed) = (planned.direct_bytes as u64, usage.device_bytes as u64);
        let Holding::Streamed { outer, options, .. } = holding else {
            panic!("{residency:?}: not streamed");
        };
        let moments = match outer {
            // Step by step the outer part comes in per use: the blocks' moment holds the groups
            // in flight, the outer part's its weights beside what the groups hold between passes.
            Outer::PerUse => (
                streamed,
                Some(direct + between_passes_bytes(&engine, options)),
            ),
            _ => (direct + streamed, None),
        };
        assert_eq!((weights.active, weights.apart), moments, "{residency:?}");
        let outer = held(&source, "transformer", dtype, |vb| {
            WanTransformer3DModel::outer(dit, vb.clone(), vb).map(drop)
        });
        assert_eq!(planned.direct_bytes as u64, outer, "{residency:?}");
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
    let config = resolve(args);
    let planner = Planner::new(configs, &config);
    planner.plan(&planner.request()).unwrap()
}

/// Resident bytes of a component's constructors.
fn resident<M: Blockwise>(cfg: &M::Config, dtype: DType) -> u64 {
    ModelConstructors::<M>(cfg.clone())
        .layout(Holding::Resident, dtype, None)
        .unwrap()
        .direct_bytes as u64
}

/// bf16 bytes of one published 14B block: f32 for the modules diffusers keeps in f32.
fn published_14b_block_bf16_bytes() -> u64 {
    state_dict_bytes(
        REPOS[1].1,
        &kept_f32_modules("transformer"),
        DType::BF16,
        |n| n.starts_with("blocks.0."),
    )
}

/// Streaming the DiT's blocks takes all but the groups in flight off the device while
/// denoising: (prefetch depth + 1) groups with a copy stream, one group without, each at most
/// its tensors plus their 256-byte alignment.
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
    // (With a copy stream groups are single blocks: the resolver makes N = 1 there.)
    for (per_group, depth, stream) in [(1, 1, true), (1, 2, true), (4, 1, false), (3, 2, false)] {
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
        let padding = saved("denoise").abs_diff((layers - kept) * block);
        assert!(
            padding <= kept * 256 * 32,
            "{args:?}: {padding} bytes of padding"
        );
        assert_eq!(saved("decode"), 0, "{args:?}: lazy, the DiT is gone");
        assert_eq!(
            resident.stage("denoise").unwrap().activation_bytes,
            streamed.stage("denoise").unwrap().activation_bytes
        );
    }
}

/// Step-by-step streaming (`--offload-type leaf-level`) keeps the `depth + 1` consecutive steps
/// in flight on the device, each in memory of its own size (one without a stream), not whole
/// blocks; the outer part comes in around its uses, beside the first `depth` steps prefetched
/// for the next pass.
#[test]
fn leaf_level_offload_holds_the_steps_in_flight_not_whole_blocks() {
    let configs = shipped("wan2.1-t2v-14b");
    let dit = &configs.transformer;
    let bf16 = DType::BF16;
    let steps: Vec<u64> = BlockStep::ALL
        .iter()
        .map(|&s| {
            record(None, bf16, Packing::ByDtype, |vb| {
                WanTransformerBlock::with_steps(dit, vb.pp("blocks.0"), &[s])
            })
            .unwrap()
            .bytes as u64
        })
        .collect();
    let largest = *steps.iter().max().unwrap();
    let shared = recorded(bf16, |vb| {
        WanTransformer3DModel::new_without_blocks(dit, vb)
    });
    assert!(
        2 * largest < published_14b_block_bf16_bytes(),
        "a step is well under a block"
    );
    // Every block's steps alike: the most `n` consecutive steps take, and the first `n`.
    let window = |n: usize| {
        (0..steps.len())
            .map(|i| (i..i + n).map(|k| steps[k % steps.len()]).sum::<u64>())
            .max()
            .unwrap()
    };
    let first = |n: usize| steps[..n].iter().sum::<u64>();
    for (depth, stream) in [(1usize, true), (2, true), (1, false)] {
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
        // The stage peaks while the blocks run: their steps in flight beside the blocks'
        // activations, above the outer part beside the next pass's first steps (`shared +
        // first(depth)` with the copy stream) and the head's activations.
        let weights = match stream {
            true => window(depth + 1),
            false => largest,
        };
        assert!(weights < (depth as u64 + 1) * largest, "{args:?}");
        let plan = plan_of(&configs, &args);
        let denoise = plan.stage("denoise").unwrap();
        assert_eq!(denoise.weight_bytes, weights, "{args:?}");
        assert!(shared + first(depth) > weights, "{args:?}");
        let default = plan_of(&configs, &["--memory-model", "discrete", "--dtype", "bf16"]);
        assert_eq!(
            denoise.activation_bytes,
            default.stage("denoise").unwrap().activation_bytes,
            "{args:?}"
        );
    }
}

/// The runner's schedule decides which components a stage holds: all three when eager (until
/// each one's last stage), only the stage's own with lazy load, the text encoder alone and then the DiT and VAE with
/// sequential load.
#[test]
fn the_load_policy_decides_which_weights_each_stage_holds() {
    let configs = shipped("wan2.1-t2v-1.3b");
    let dtype = DType::BF16;
    let te = resident::<UMT5EncoderModel>(&configs.text_encoder, dtype);
    let dit = resident::<WanTransformer3DModel>(&configs.transformer, dtype);
    let vae = resident::<AutoencoderKLWan>(&configs.vae, DType::F32);
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
        // Eager: all three from the first stage, each released after its last (one prompt).
        ("--no-lazy-module-load", [te + dit + vae, dit + vae, vae, 0]),
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

/// Parked components are on the device only for their own stage (as the one image the engine
/// moves in); a text encoder computing on the CPU never is.
#[test]
fn offloaded_components_leave_the_device_between_their_stages() {
    let configs = shipped("wan2.1-t2v-1.3b");
    let vae = resident::<AutoencoderKLWan>(&configs.vae, DType::F32);
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
    let resident_plan = plan_of(
        &configs,
        &[
            &args[..],
            &["--no-vae-cpu-offload", "--no-text-encoder-cpu-offload"],
        ]
        .concat(),
    );
    for (stage, difference) in [("encode_text", vae), ("denoise", vae)] {
        assert_eq!(
            resident_plan.stage(stage).unwrap().weight_bytes
                - parked.stage(stage).unwrap().weight_bytes,
            difference,
            "{stage}"
        );
    }
    // Moved in whole for the decode: its tensors, each aligned to 256 bytes.
    let decode = |p: &MemoryPlan| p.stage("decode").unwrap().weight_bytes;
    assert!(decode(&parked) >= decode(&resident_plan));
    assert!(decode(&parked) - decode(&resident_plan) < 256 * 1024);
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
    let te = resident::<UMT5EncoderModel>(&configs.text_encoder, DType::BF16);
    let encode = |p: &MemoryPlan| p.stage("encode_text").unwrap().clone();
    assert_eq!(
        encode(&resident_plan).weight_bytes - encode(&on_cpu).weight_bytes,
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

/// 14B with every component resident and loaded eagerly.
fn resident_14b() -> (WanConfigs, ResolvedConfig) {
    let config = resolve(&[
        "--memory-model",
        "discrete",
        "--dtype",
        "bf16",
        "--no-dit-layerwise-offload",
        "--no-dit-cpu-offload",
        "--no-text-encoder-cpu-offload",
        "--no-vae-cpu-offload",
    ]);
    (shipped("wan2.1-t2v-14b"), config)
}

/// The candidates in order, each needing less than the one before here, and the first that
/// fits a device is the one the advice names.
#[test]
fn the_first_candidate_that_fits_is_chosen() {
    let (configs, config) = resident_14b();
    let planner = Planner::new(&configs, &config);
    let current = planner.plan(&planner.request()).unwrap();
    let found = planner.candidates(Some(current.required_bytes()));
    let flags: Vec<String> = found.iter().map(|c| c.flags.join(" ")).collect();
    assert_eq!(
        flags[..5],
        // (Leaf level lowers no stage's peak here until the tiles: the streamed DiT already
        // holds nothing outside its stage, and the peak is the resident text encoder's, then
        // the decode's. A candidate leaves out what it does not need.)
        [
            "--dit-layerwise-offload",
            "--dit-layerwise-offload --text-encoder-cpu-offload",
            // (Lazy loading lowers no peak yet: the one prompt releases each component after
            // its last stage already; offered with low activation.)
            "--dit-layerwise-offload --offload-type leaf-level --text-encoder-cpu-offload --vae-tiling",
            // (Low activation lowers the denoise, no longer the peak, since leaf level moves the
            // DiT's outer part in per use: offered with the tiles. Synchronous copies are not
            // needed.)
            "--dit-layerwise-offload --offload-type leaf-level --text-encoder-cpu-offload --lazy-module-load --vae-tiling --low-activation --vae-tile-size 128",
            "--dit-layerwise-offload --offload-type leaf-level --text-encoder-cpu-offload --lazy-module-load --vae-tiling --low-activation --vae-tile-size 128 --num-frames 77",
        ]
    );
    for (k, c) in found.iter().enumerate() {
        assert!(
            found[..k]
                .iter()
                .all(|e| e.plan.required_bytes() > c.plan.required_bytes()),
            "candidate {k} ({}) needs no less than an earlier one",
            flags[k]
        );
        let total = c.plan.required_bytes();
        let chosen = first_fitting(&found, total).expect("a candidate fits");
        assert_eq!(chosen.flags, c.flags, "device of {:.2} GiB", gib(total));
        let on_device = config.clone().with_total_memory(Some(total));
        let text = Planner::new(&configs, &on_device).advice();
        assert!(
            text.contains(&format!("predicted to fit: {}", flags[k])),
            "{text}"
        );
        assert!(text.contains(&format!("{:.2} GiB", gib(total))), "{text}");
    }
    let too_small = found.last().unwrap().plan.required_bytes() - 1;
    assert!(first_fitting(&found, too_small).is_none());
}

/// With the device a little smaller than the tiled 81-frame run needs, the last candidate
/// is the most frames (4k+1) that fit: four more would not.
#[test]
fn fewer_frames_are_the_most_that_fit() {
    let (configs, config) = resident_14b();
    let planner = Planner::new(&configs, &config);
    let all_savings = planner.candidates(None);
    let leanest = all_savings.last().unwrap();
    let total = leanest.plan.required_bytes() - 1;
    let found = planner.candidates(Some(total));
    let last = found.last().unwrap();
    let frames: u32 = last
        .flags
        .last()
        .and_then(|f| f.strip_prefix("--num-frames "))
        .expect("a --num-frames candidate")
        .parse()
        .unwrap();
    assert!(frames < config.video().num_frames && (frames - 1).is_multiple_of(4));
    assert!(last.plan.fits(total));
    let mut more = planner.request();
    more.options.dit_layerwise_offload = true;
    more.options.leaf_level = true;
    more.options.text_encoder_cpu_offload = true;
    more.options.lazy_module_load = Some(true);
    more.options.vae_tiling = true;
    more.options.low_activation = true;
    more.options.vae_tile_size = Some(memory_plan::SMALL_VAE_TILE);
    more.options.offload_stream = false;
    more.num_frames = frames + 4;
    assert!(!planner.plan(&more).unwrap().fits(total));
    assert_eq!(first_fitting(&found, total).unwrap().flags, last.flags);
}

/// Fewer frames are offered by the family's own frame rule: LTX-Video's 8k+1, not Wan's 4k+1.
#[test]
fn fewer_frames_follow_the_family_frame_rule() {
    let source = ModelSource::parse("synthetic:ltx-video").unwrap();
    let family = vidgen::pipeline::registry::family(Configs::Fetch(&source)).unwrap();
    let config = resolve(&[
        "--model",
        "synthetic:ltx-video",
        "--memory-model",
        "discrete",
    ])
    .with_model_defaults(&family.defaults())
    .unwrap();
    assert_eq!(config.video().num_frames, 161);
    let planner = Planner::new(family.as_ref(), &config);
    let leanest = planner.candidates(None).pop().unwrap();
    let found = planner.candidates(Some(leanest.plan.required_bytes() - 1));
    let frames: u32 = found
        .last()
        .and_then(|c| c.flags.last())
        .and_then(|f| f.strip_prefix("--num-frames "))
        .expect("a --num-frames candidate")
        .parse()
        .unwrap();
    assert!(frames < 161 && (frames - 1).is_multiple_of(8), "{frames}");
}

/// On unified memory the device rules turn host offload off, so it is never offered.
#[test]
fn savings_the_device_would_undo_are_not_offered() {
    let configs = shipped("wan2.1-t2v-14b");
    let config = resolve(&["--memory-model", "unified", "--no-lazy-module-load"]);
    let found = Planner::new(&configs, &config).candidates(Some(1 << 40));
    assert!(!found.is_empty());
    for c in &found {
        assert!(
            !c.flags.iter().any(|f| f.contains("offload")),
            "{:?}",
            c.flags
        );
    }
    assert_eq!(found[0].flags, ["--lazy-module-load"]);
}

/// Nothing fits a device smaller than the leanest candidate: the advice says so and names
/// the leanest; without a known size, or when the run's own options should fit, it names the
/// leanest too.
#[test]
fn advice_without_a_fit_names_the_leanest() {
    let (configs, config) = resident_14b();
    let advice = |total: Option<u64>| {
        let on_device = config.clone().with_total_memory(total);
        Planner::new(&configs, &on_device).advice()
    };
    let text = advice(Some(1 << 30));
    assert!(
        text.contains("nothing the plan knows is predicted to fit"),
        "{text}"
    );
    assert!(text.contains("--num-frames 1 (predicted peak"), "{text}");
    let planner = Planner::new(&configs, &config);
    let current = planner.plan(&planner.request()).unwrap();
    for total in [None, Some(current.required_bytes())] {
        let text = advice(total);
        assert!(text.contains(&current.describe_peak()), "{text}");
        assert!(
            text.contains("the leanest option set: --dit-layerwise-offload"),
            "{text}"
        );
        assert_eq!(
            text.contains("other processes may hold device memory"),
            total.is_some(),
            "{text}"
        );
    }
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
    // The host's budget: what Linux says is available (bounded by the cgroup limit).
    let host = json["host_available_bytes"]
        .as_u64()
        .expect("a Linux host's MemAvailable");
    assert!(host > 0);

    let text = dry_run(&args, &hf_home);
    for want in &expected.stages {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{} ", want.name)))
            .unwrap_or_else(|| panic!("no line for {}: {text}", want.name));
        let columns: Vec<&str> = line.split_whitespace().rev().take(2).collect();
        assert_eq!(
            columns,
            [
                format!("{:.2}", gib(want.host_bytes)),
                format!("{:.2}", gib(want.peak_bytes))
            ],
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

/// A run whose options do not fit the memory that is free takes the first leaner option set
/// predicted to fit, never one that changes an option the user set, nor the frames; the changes
/// become overrides under their config-file keys. Where nothing fits, nothing is taken.
#[test]
fn a_run_fits_itself_to_the_free_memory_keeping_what_the_user_set() {
    let (configs, config) = resident_14b();
    let planner = Planner::new(&configs, &config);
    let request = planner.request();
    let asked = planner.plan(&request).unwrap();
    assert!(matches!(
        planner.fit(asked.required_free_bytes()),
        Fit::AsAsked
    ));
    let free = asked.required_free_bytes() - 1;
    // Nothing kept: the cheapest saving in speed comes first.
    let fit_keeping_nothing = memory_plan::fit(
        &request,
        config.device(),
        &|r| planner.plan(r),
        free,
        &|_| false,
    );
    match fit_keeping_nothing {
        Fit::Leaner(c) => assert_eq!(c.flags, ["--dit-layerwise-offload"]),
        other => panic!("{other:?}"),
    }
    // This run gave --no-dit-layerwise-offload and --no-text-encoder-cpu-offload: kept.
    let leaner = match planner.fit(free) {
        Fit::Leaner(c) => c,
        other => panic!("{other:?}"),
    };
    assert!(leaner.plan.fits_free(free));
    assert!(!leaner.flags.is_empty());
    for flag in &leaner.flags {
        assert!(
            !flag.contains("layerwise")
                && !flag.contains("text-encoder")
                && !flag.contains("frames"),
            "{:?}",
            leaner.flags
        );
    }
    assert_eq!(leaner.request.num_frames, request.num_frames);
    let fitted = config
        .clone()
        .with_memory_options(leaner.request.options.clone(), "free memory");
    let changed: Vec<&str> = fitted
        .overrides()
        .iter()
        .skip(config.overrides().len())
        .map(|o| o.option.as_str())
        .collect();
    assert!(!changed.is_empty());
    assert!(
        changed
            .iter()
            .all(|o| ["lazy_module_load", "vae_tiling", "leaf_level"].contains(o)),
        "{changed:?}"
    );
    assert_eq!(fitted.memory(), &leaner.request.options);
    assert!(matches!(planner.fit(1 << 30), Fit::Nothing));
}

/// The case: another process holds 136 of an H200's 139.8 GiB, so 3.30 GiB are free,
/// 2.79 GiB once this process's context is open (what the probe reads). The 14B at its default
/// flags and size (81x480x832) plans to fit by adding the savings that lower a stage:
/// step-by-step streaming, VAE tiling, the low-activation DiT and 128 px VAE tiles (whose caveat
/// the override names; the copies stay asynchronous), and none of the last two can be spared;
/// with plenty free it
/// runs as asked, low-activation off; with `--no-low-activation` or `--no-vae-tiling` pinned
/// nothing fits (the run exits 2 before loading).
#[test]
fn the_14b_default_run_fits_2_8_gib_free_with_the_low_activation_dit() {
    let configs = shipped("wan2.1-t2v-14b");
    let args = ["--memory-model", "discrete", "--dtype", "bf16"];
    let config = resolve(&args);
    let planner = Planner::new(&configs, &config);
    let free = 279 * (1u64 << 30) / 100;
    let leaner = match planner.fit(free) {
        Fit::Leaner(c) => c,
        other => panic!("{other:?}"),
    };
    let o = &leaner.request.options;
    assert!(o.low_activation && o.leaf_level && o.vae_tiling && o.offload_stream);
    // Lazy loading saves nothing here: the one prompt releases each component after its last
    // stage, and the offloaded encoder and parked VAE hold nothing on the device outside theirs.
    assert!(!o.lazy(), "{:?}", leaner.flags);
    assert_eq!(o.vae_tile_size, Some(memory_plan::SMALL_VAE_TILE));
    assert_eq!(leaner.request.num_frames, 81);
    assert!(
        leaner.plan.fits_free(free),
        "{}",
        leaner.plan.describe_peak()
    );
    for flag in ["--low-activation", "--vae-tile-size 128"] {
        assert!(leaner.flags.iter().any(|f| f == flag), "{:?}", leaner.flags);
    }
    let caveats = memory_plan::caveats(config.memory(), o);
    assert_eq!(caveats.len(), 1);
    assert!(caveats[0].contains("frames differ slightly"), "{caveats:?}");
    // The small tiles are needed. Low activation comes with them, offered as one step: since
    // leaf level moves the DiT's outer part in per use, it lowers the denoise but no longer the
    // peak (the candidates add levers in order and offer a lever only with the next one that
    // lowers the peak).
    let mut without = leaner.request.clone();
    without.options.vae_tile_size = None;
    assert!(!planner.plan(&without).unwrap().fits_free(free));

    assert!(matches!(planner.fit(100 << 30), Fit::AsAsked));
    assert!(!config.memory().low_activation);

    for pin in ["--no-low-activation", "--no-vae-tiling"] {
        let pinned = resolve(&[&args[..], &[pin]].concat());
        let fit = Planner::new(&configs, &pinned).fit(free);
        assert!(matches!(fit, Fit::Nothing), "{pin}: {fit:?}");
    }
}

/// The low-activation DiT holds the hidden states, keys and values whole and one chunk of
/// 1024 tokens' intermediates: at 14B and 81x480x832 (32,760 tokens of 5120 in bf16, 0.31 GiB
/// each) 1.08 GiB where the normal forward holds five hidden states (1.65); the estimate is the
/// same with the option off.
#[test]
fn the_low_activation_estimate_holds_three_hidden_states_and_a_chunk() {
    let configs = shipped("wan2.1-t2v-14b");
    let denoise = |extra: &[&str]| {
        let args = [&["--memory-model", "discrete", "--dtype", "bf16"], extra].concat();
        plan_of(&configs, &args)
            .stage("denoise")
            .unwrap()
            .activation_bytes
    };
    let (normal, low) = (denoise(&[]), denoise(&["--low-activation"]));
    let hidden = 32_760 * 5120 * 2;
    assert!(
        low >= 3 * hidden && low < 3 * hidden + (160 << 20),
        "{}",
        gib(low)
    );
    assert!(
        normal >= 5 * hidden && normal > low + hidden,
        "{} vs {}",
        gib(normal),
        gib(low)
    );
    assert_eq!(normal, denoise(&["--no-low-activation"]));
}

/// Where the whole DiT does not fit what is free, as many of its streamed blocks as fit with a
/// tenth to spare stay on the device: within the budget, filling the room but for two blocks (or
/// keeping every block), also where the DiT's stages are not the run's peak and two experts
/// stream (Wan2.2 A14B); none where the streamed run alone does not fit, and never over a DiT
/// placement the user set.
#[test]
fn blocks_stay_on_the_device_where_the_whole_dit_does_not_fit() {
    let args = ["--memory-model", "discrete", "--dtype", "bf16"];
    let with = |extra: &[&str]| resolve(&[&args[..], extra].concat());
    // A 14B block holds under 0.85 GiB in bf16.
    let block = 27u64 << 30 >> 5;
    for name in ["wan2.1-t2v-14b", "wan2.2-t2v-a14b"] {
        let configs = shipped(name);
        let config = with(&[]);
        let planner = Planner::new(&configs, &config);
        let streamed = planner.plan(&planner.request()).unwrap();
        let (_, whole) = planner.dit_on_device(400 << 30).unwrap();
        let (low, high) = (streamed.required_free_bytes(), whole.required_free_bytes());
        let free = (low + high) / 2;
        let room = free - free / 10;
        assert!(planner.dit_on_device(free).is_none(), "{name}");
        let (kept, plan) = planner.dit_kept_on_device(free).unwrap();
        let budget = kept.options.dit_resident_memory;
        assert!(kept.options.dit_layerwise_offload && budget > 0, "{name}");
        assert!(plan.fits_free(room), "{name}");
        // The room is filled but for two blocks, or every block is kept (the A14B: each expert
        // whole in its own stage, where both at once do not fit).
        let mut more = kept.clone();
        more.options.dit_resident_memory = budget + 2 * block;
        assert!(
            plan.required_free_bytes() + 2 * block > room || planner.plan(&more).unwrap() == plan,
            "{name}"
        );
        let denoise_weights = |p: &MemoryPlan| {
            (p.stages.iter())
                .filter(|s| s.name.starts_with("denoise"))
                .map(|s| s.weight_bytes)
                .max()
                .unwrap()
        };
        let gained = denoise_weights(&plan) - denoise_weights(&streamed);
        assert!(
            gained > 0 && gained <= budget,
            "{name}: {} of {}",
            gib(gained),
            gib(budget)
        );
        // The streamed run alone needs all that is free, with a tenth spare.
        assert!(planner
            .dit_kept_on_device(low + low / 9 - (1 << 20))
            .is_none());
        for placement in [
            &["--dit-layerwise-offload"][..],
            &["--dit-resident-memory", "4GiB"],
        ] {
            let asked = with(placement);
            assert!(
                Planner::new(&configs, &asked)
                    .dit_kept_on_device(free)
                    .is_none(),
                "{name} {placement:?}"
            );
        }
    }
}

/// A DiT is held on the device where only the defaults stream it and the plan says the resident
/// set fits what is free with a tenth to spare (a streamed DiT copies its weights every forward;
/// merged LoRA host copies of a 14B cost seconds), with or without LoRAs; not where it does not
/// fit, and never over a DiT placement the user set.
#[test]
fn the_dit_is_held_on_the_device_where_it_fits() {
    let configs = shipped("wan2.1-t2v-14b");
    let args = ["--memory-model", "discrete", "--dtype", "bf16"];
    let lora = ["--lora", "distill.safetensors"];
    for extra in [&[][..], &lora] {
        let config = resolve(&[&args[..], extra].concat());
        assert!(config.memory().dit_layerwise_offload);
        let planner = Planner::new(&configs, &config);
        let streamed = planner.plan(&planner.request()).unwrap();
        let (resident, plan) = planner.dit_on_device(100 << 30).unwrap();
        let o = &resident.options;
        assert!(!o.dit_layerwise_offload && !o.dit_cpu_offload);
        // The 14B's 26.7 GiB of weights are on the device in the denoise stage now.
        let denoise_weights = |p: &MemoryPlan| p.stage("denoise").unwrap().weight_bytes;
        // (The streamed DiT holds 1.8 GiB there: its outer part and the blocks in flight.)
        assert!(denoise_weights(&plan) > denoise_weights(&streamed) + (24 << 30));
        // A tenth of what is free stays spare.
        let need = plan.required_free_bytes();
        assert!(planner.dit_on_device(need).is_none());
        assert!(planner.dit_on_device(need + need / 20).is_none());
        assert!(planner.dit_on_device(need + need / 9 + 10).is_some());
        for placement in [
            &["--dit-layerwise-offload"][..],
            &["--num-blocks-per-group", "1"],
            &["--offload-type", "leaf-level"],
            &["--dit-cpu-offload"],
        ] {
            let asked = resolve(&[&args[..], extra, placement].concat());
            assert!(
                Planner::new(&configs, &asked)
                    .dit_on_device(100 << 30)
                    .is_none(),
                "{placement:?}"
            );
        }
    }
}

/// Where only the defaults stream the text encoder and the run with it loaded whole fits what is
/// free with a tenth to spare, it loads whole for its stage (a streamed one copies all its weights
/// for every prompt); not where that does not fit, and never over a placement the user set.
#[test]
fn the_text_encoder_loads_whole_where_it_fits() {
    let configs = shipped("wan2.1-t2v-14b");
    let args = ["--memory-model", "discrete", "--dtype", "bf16"];
    let config = resolve(&args);
    assert!(config.memory().text_encoder_cpu_offload);
    let planner = Planner::new(&configs, &config);
    let streamed = planner.plan(&planner.request()).unwrap();
    let (whole, plan) = planner.text_encoders_on_device(100 << 30).unwrap();
    assert!(!whole.options.text_encoder_cpu_offload);
    // UMT5's 10.6 GiB are on the device in its stage now, where its slots were.
    let text_weights = |p: &MemoryPlan| p.stage("encode_text").unwrap().weight_bytes;
    assert!(text_weights(&plan) > text_weights(&streamed) + (8 << 30));
    // A tenth of what is free stays spare.
    let need = plan.required_free_bytes();
    assert!(planner.text_encoders_on_device(need).is_none());
    assert!(planner
        .text_encoders_on_device(need + need / 9 + 10)
        .is_some());
    for placement in [
        &["--text-encoder-cpu-offload"][..],
        &["--text-encoder-compute", "gpu"],
    ] {
        let asked = resolve(&[&args[..], placement].concat());
        assert!(
            Planner::new(&configs, &asked)
                .text_encoders_on_device(100 << 30)
                .is_none(),
            "{placement:?}"
        );
    }
}

/// The decode plans against the decode peaks a GPU measured (bf16, bench/RESULTS.md): FLUX.1's
/// whole decode stage at 768x768 (its VAE's weights and maps, the device pool's used peak
/// through `--stats-json`; an H100, session 48), HunyuanVideo's decode above its weights and
/// latents (`examples/vae_decode`) at five sizes (an H100, session 48) and tiled at 720p (an
/// H200, session 35), and the tiled decodes above the weights and latents (`vae_decode --tiled`)
/// of LTX-Video, CogVideoX-5b, Latte-1 and FLUX.1 (AutoencoderKL); and HunyuanVideo's denoise at
/// 720p, its blocks' peak above the weights (`examples/offload_bench`, resident; an H100,
/// session 49: six copies of the joint sequence, where the plan had counted eight); and FLUX.1's
/// leaf-level denoise, its steps in exact fills and its outer part moved in per use (the pool's
/// peak, `offload_bench`; an H100, session 50); and without guidance (one CFG branch a forward)
/// the leaf-level denoise of five families and the resident activations of four (`offload_bench`;
/// an H100, session 50) and Wan2.1 1.3B's leaf-level denoise stage (`--stats-json`; an H200,
/// session 55). Each plan is within a tenth of its measurement.
#[test]
fn plans_are_within_a_tenth_of_the_measured_peaks() {
    let hf_home = std::env::temp_dir().join(format!("vidgen-decode-hf-{}", std::process::id()));
    let gib = |bytes: &Value| bytes.as_u64().unwrap() as f64 / (1u64 << 30) as f64;
    let plan = |model: &str, (frames, height, width): (u32, u32, u32), extra: &[&str], name| {
        let (frames, height, width) = (frames.to_string(), height.to_string(), width.to_string());
        let mut args = vec!["--model", model, "--memory-model", "discrete"];
        args.extend(["--dtype", "bf16", "--lazy-module-load", "--json"]);
        args.extend(["--height", &height, "--width", &width]);
        if frames != "1" {
            args.extend(["--num-frames", &frames]);
        }
        args.extend(extra);
        let json: Value = serde_json::from_str(&dry_run(&args, &hf_home)).unwrap();
        let stages = json["stages"].as_array().unwrap();
        let stage = stages.iter().find(|s| s["name"] == name).unwrap();
        stage["memory"].clone()
    };
    let decode = |model: &str, size, extra: &[&str]| plan(model, size, extra, "decode");
    let within = |planned: f64, measured: f64, what: &str| {
        assert!(
            (planned - measured).abs() <= measured / 10.0,
            "{what}: planned {planned:.3} GiB against {measured:.3} measured"
        );
    };
    let flux = decode("synthetic:flux.1-dev", (1, 768, 768), &[]);
    within(gib(&flux["peak_bytes"]), 1.250, "FLUX.1 768x768");
    for (size, measured) in [
        ((17, 320, 512), 3.64),
        ((33, 320, 512), 3.65),
        ((65, 320, 512), 3.70),
        ((33, 480, 848), 8.97),
        ((129, 720, 1280), 21.01),
    ] {
        let hunyuan = decode("synthetic:hunyuanvideo", size, &[]);
        within(
            gib(&hunyuan["activation_bytes"]),
            measured,
            &format!("HunyuanVideo {size:?}"),
        );
    }
    let hunyuan = decode(
        "synthetic:hunyuanvideo",
        (129, 720, 1280),
        &["--vae-tiling"],
    );
    within(
        gib(&hunyuan["activation_bytes"]),
        2.44,
        "HunyuanVideo tiled",
    );
    // An H200, session 39.
    let ltx = decode("synthetic:ltx-video", (161, 512, 704), &["--vae-tiling"]);
    within(gib(&ltx["activation_bytes"]), 3.30, "LTX-Video tiled");
    // An H200 in session 39, and an H100 in session 43 (call 2) on its channels-last stores.
    let cogvideox = decode("synthetic:cogvideox-5b", (49, 480, 720), &["--vae-tiling"]);
    within(
        gib(&cogvideox["activation_bytes"]),
        2.28,
        "CogVideoX-5b tiled",
    );
    // An H100, session 44 (call 6), with the image convolutions' runs of 2^26 elements.
    let latte = decode("synthetic:latte-1", (16, 512, 512), &["--vae-tiling"]);
    within(gib(&latte["activation_bytes"]), 1.37, "Latte-1 tiled");
    let resident = ["--dit-layerwise-offload=false", "--dit-cpu-offload=false"];
    let hunyuan = plan(
        "synthetic:hunyuanvideo",
        (129, 720, 1280),
        &resident,
        "denoise",
    );
    within(
        gib(&hunyuan["activation_bytes"]),
        4.145,
        "HunyuanVideo 720p denoise",
    );
    // An H100, session 50 (call 1): the seed table's leaf-level row, weights and activations.
    let leaf = ["--dit-layerwise-offload", "--offload-type", "leaf-level"];
    let flux = plan("synthetic:flux.1-dev", (1, 768, 768), &leaf, "denoise");
    within(
        gib(&flux["peak_bytes"]),
        0.377,
        "FLUX.1 768x768 leaf-level denoise",
    );
    // An H100, session 50 (calls 2, 5 and 7; `offload_bench`): one forward of one CFG branch
    // (a run without guidance), the pool's peak above the model's memory resident, and in all
    // at leaf level, its steps in exact fills and its outer part moved in per use.
    let unguided = ["--guidance-scale", "1"];
    let leaf_unguided = [&leaf[..], &unguided].concat();
    let resident_unguided = [&resident[..], &unguided].concat();
    for (model, size, leaf_peak) in [
        ("latte-1", (16, 512, 512), 0.482),
        ("allegro", (88, 720, 1280), 3.570),
        ("mochi-1", (85, 480, 848), 2.197),
        ("ltx-video", (161, 512, 768), 0.437),
        ("hunyuanvideo", (61, 320, 512), 0.854),
    ] {
        let model = format!("synthetic:{model}");
        let denoise = plan(&model, size, &leaf_unguided, "denoise");
        let what = format!("{model} {size:?} leaf-level denoise without guidance");
        within(gib(&denoise["peak_bytes"]), leaf_peak, &what);
    }
    // An H200, session 55 (`calls.sh 2`): the command line's leaf-level denoise without
    // guidance, `--stats-json`'s used peak (it holds the scheduler's latents).
    let wan = plan(
        "synthetic:wan2.1-t2v-1.3b",
        (81, 480, 832),
        &leaf_unguided,
        "denoise",
    );
    within(
        gib(&wan["peak_bytes"]),
        0.568,
        "Wan2.1 1.3B leaf-level denoise without guidance",
    );
    // An H200, session 56 (`calls.sh 1`), the same way: CogVideoX-5b at leaf level without
    // guidance, and resident with its guided pair (the weights and both prompts' activations).
    let cogvideox = |flags: &[&str]| {
        let denoise = plan("synthetic:cogvideox-5b", (49, 480, 720), flags, "denoise");
        gib(&denoise["peak_bytes"])
    };
    let what = "CogVideoX-5b leaf-level denoise without guidance";
    within(cogvideox(&leaf_unguided), 1.002, what);
    let what = "CogVideoX-5b resident denoise with guidance";
    within(cogvideox(&resident), 12.235, what);
    // An H200, session 55 (`calls.sh 2`), the default flags: MiniMax H3's audio decode of a 5 s
    // request, the audio VAE's weights and its activations.
    let audio = plan("synthetic:minimax-h3", (120, 384, 672), &[], "decode_audio");
    within(gib(&audio["peak_bytes"]), 0.327, "MiniMax H3 audio decode");
    for (model, size, activations) in [
        ("latte-1", (16, 512, 512), 0.383),
        ("mochi-1", (85, 480, 848), 1.944),
        ("ltx-video", (161, 512, 768), 0.309),
        ("hunyuanvideo", (61, 320, 512), 0.606),
    ] {
        let model = format!("synthetic:{model}");
        let denoise = plan(&model, size, &resident_unguided, "denoise");
        let what = format!("{model} {size:?} resident denoise activations without guidance");
        within(gib(&denoise["activation_bytes"]), activations, &what);
    }
    // An H100, session 49 (call 1): 2x2 and 3x3 tiles of 1024 px.
    for (size, measured) in [(1536, 2.00), (2048, 2.03)] {
        let flux = decode("synthetic:flux.1-dev", (1, size, size), &["--vae-tiling"]);
        within(
            gib(&flux["activation_bytes"]),
            measured,
            &format!("FLUX.1 {size}x{size} tiled"),
        );
    }
}
