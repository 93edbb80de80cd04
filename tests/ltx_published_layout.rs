//! The LTX-Video components built from the published configs (`seed-families-configs.json`:
//! Lightricks/LTX-Video, its 0.9.0 and 0.9.1 VAEs, T5 v1.1 XXL) request exactly the published
//! tensor names and shapes. Weights are zero-stride views, so nothing real-sized is allocated.

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use vidgen::models::ltx::transformer::{LtxTransformer3DModel, LtxTransformerConfig};
use vidgen::models::ltx::vae::{AutoencoderKLLTXVideo, LtxVaeConfig, LtxVideoEncoder};
use vidgen::models::t5::encoder::{T5Config, T5EncoderModel, T5Variant};
use vidgen::schedulers::euler::{FlowMatchEuler, FlowMatchEulerConfig};
use vidgen::schedulers::Scheduler;

const REPO: &str = "Lightricks/LTX-Video";

fn published() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/seed-families-configs.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn config<T: serde::de::DeserializeOwned>(file: &str) -> T {
    serde_json::from_value(published()["models"][REPO][file].clone()).unwrap()
}

/// Serves any published tensor as a zero view of its shape and records what was requested.
struct Published {
    shapes: HashMap<String, Vec<usize>>,
    requested: Arc<Mutex<BTreeSet<String>>>,
}

impl Published {
    fn new(state_dict: &str) -> (Self, Arc<Mutex<BTreeSet<String>>>) {
        let shapes = published()["state_dicts"][state_dict]["tensors"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                let dims = v
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap() as usize);
                (k.clone(), dims.collect())
            })
            .collect();
        let requested = Arc::new(Mutex::new(BTreeSet::new()));
        (
            Self {
                shapes,
                requested: requested.clone(),
            },
            requested,
        )
    }

    fn tensor(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let Some(dims) = self.shapes.get(name) else {
            candle_core::bail!("{name} is not in the published state dict");
        };
        self.requested.lock().unwrap().insert(name.to_string());
        Tensor::zeros((), dtype, dev)?.broadcast_as(dims.as_slice())
    }
}

impl SimpleBackend for Published {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.tensor(name, dtype, dev)?;
        if t.shape() != &s {
            candle_core::bail!("{name}: requested {s:?}, published {:?}", t.shape());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.tensor(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.shapes.contains_key(name)
    }
}

/// Builds with `build` and returns the published names nobody requested, minus `skip`.
fn unrequested(
    state_dict: &str,
    skip: impl Fn(&str) -> bool,
    build: impl FnOnce(VarBuilder<'static>),
) -> Vec<String> {
    let (backend, requested) = Published::new(state_dict);
    let all: Vec<String> = backend.shapes.keys().cloned().collect();
    build(VarBuilder::from_backend(
        Box::new(backend),
        DType::F32,
        Device::Cpu,
    ));
    let requested = requested.lock().unwrap();
    let mut left: Vec<String> = all
        .into_iter()
        .filter(|n| !requested.contains(n) && !skip(n))
        .collect();
    left.sort();
    left
}

/// `prefix.{i}.`'s index, if `name` is inside a numbered block.
fn block_index(name: &str, prefix: &str) -> Option<usize> {
    name.strip_prefix(prefix)?.split('.').next()?.parse().ok()
}

#[test]
fn transformer_requests_the_published_tensors() {
    let cfg: LtxTransformerConfig = config("transformer/config.json");
    cfg.validate().unwrap();
    let built = [0usize, cfg.num_layers - 1];
    let left = unrequested(
        "LTX-Video transformer",
        |n| block_index(n, "transformer_blocks.").is_some_and(|i| !built.contains(&i)),
        |vb| {
            LtxTransformer3DModel::new_without_blocks(&cfg, vb.clone()).unwrap();
            for i in built {
                vidgen::models::ltx::transformer::LtxTransformerBlock::new(
                    &cfg,
                    vb.pp(format!("transformer_blocks.{i}")),
                )
                .unwrap();
            }
        },
    );
    assert!(left.is_empty(), "never requested: {left:?}");
}

#[test]
fn t5_xxl_requests_the_published_tensors() {
    let cfg: T5Config = config("text_encoder/config.json");
    assert_eq!(cfg.variant, T5Variant::T5);
    let built = [0usize, 1, cfg.num_layers - 1];
    let left = unrequested(
        "T5EncoderModel t5-v1_1-xxl (LTX, CogVideoX)",
        // The tied table is stored once; the encoder reads `encoder.embed_tokens.weight`.
        |n| {
            n == "shared.weight"
                || block_index(n, "encoder.block.").is_some_and(|i| !built.contains(&i))
        },
        |vb| {
            T5EncoderModel::new_without_blocks(&cfg, vb.clone(), vb.clone()).unwrap();
            for i in built {
                T5EncoderModel::block(&cfg, i, vb.clone()).unwrap();
            }
        },
    );
    assert!(left.is_empty(), "never requested: {left:?}");
}

fn check_vae(file: &str, state_dict: &str, conditioned: bool) {
    let cfg: LtxVaeConfig = config(file);
    assert_eq!(cfg.timestep_conditioning, conditioned);
    assert_eq!(cfg.spatial_compression_ratio(), 32);
    assert_eq!(cfg.temporal_compression_ratio(), 8);
    let left = unrequested(
        state_dict,
        |_| false,
        |vb| {
            AutoencoderKLLTXVideo::new(&cfg, vb.clone()).unwrap();
            LtxVideoEncoder::new(&cfg, vb).unwrap();
        },
    );
    assert!(left.is_empty(), "{file}: never requested: {left:?}");
}

#[test]
fn vae_0_9_0_requests_the_published_tensors() {
    check_vae(
        "vae/config.json (0.9.0, repo root)",
        "LTX-Video VAE 0.9.0",
        false,
    );
}

#[test]
fn vae_0_9_1_requests_the_published_tensors() {
    check_vae(
        "vae/config.json (0.9.1 layout, a-r-r-o-w/LTX-Video-0.9.1-diffusers; what ltx-video-tiny-a follows)",
        "LTX-Video VAE 0.9.1",
        true,
    );
}

#[test]
fn published_scheduler_at_the_default_size() {
    // 512x768x161 at the 32x/8x VAE: 21 x 16 x 24 = 8064 tokens.
    let cfg: FlowMatchEulerConfig = config("scheduler/scheduler_config.json");
    let s = FlowMatchEuler::for_sequence_length(&cfg, 50, 21 * 16 * 24).unwrap();
    assert_eq!(s.sigmas().len(), 51);
    assert_eq!(s.sigmas()[0], 1.0);
    assert!(
        (s.sigmas()[49] - 0.1).abs() < 1e-6,
        "stretched to shift_terminal"
    );
}
