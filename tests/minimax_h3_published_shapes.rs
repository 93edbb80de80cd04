//! The MiniMax H3 components built from the *published* configs against the published
//! state-dict names and shapes (`tests/fixtures/minimax-h3-configs.json`, recorded on the meta
//! device), without weights: every tensor a component asks for must exist with that shape, and
//! the components must use every tensor of the parts they implement.

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use vidgen::models::minimax_h3::audio_vae::{MiniMaxH3AudioVaeConfig, MiniMaxH3AudioVaeDecoder};
use vidgen::models::minimax_h3::text_encoder::{MiniMaxH3TextEncoder, Qwen3VLConfig};
use vidgen::models::minimax_h3::transformer::{
    MiniMaxH3Modulations, MiniMaxH3Transformer3DModel, MiniMaxH3TransformerConfig,
};
use vidgen::models::minimax_h3::vae::{MiniMaxH3VaeConfig, MiniMaxH3VaeDecoder};
use vidgen::schedulers::minimax_h3::MiniMaxH3SchedulerConfig;

fn published() -> Value {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/minimax-h3-configs.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The config of `file`, without the values the export could not find (written as strings,
/// e.g. the VAEs' `latents_mean`): those keys take the defaults.
fn config<T: serde::de::DeserializeOwned>(all: &Value, file: &str) -> T {
    let mut cfg = all["configs"][file].clone();
    if let Some(map) = cfg.as_object_mut() {
        map.retain(|k, v| !(v.is_string() && k.starts_with("latents_")));
    }
    serde_json::from_value(cfg).unwrap()
}

/// Serves zero-stride tensors of the recorded shapes and remembers what was asked for.
struct Shapes {
    shapes: HashMap<String, Vec<usize>>,
    requested: Arc<Mutex<BTreeSet<String>>>,
}

impl SimpleBackend for Shapes {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            candle_core::bail!(
                "{name}: the model wants {s:?}, the checkpoint has {:?}",
                t.shape()
            );
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        let Some(shape) = self.shapes.get(name) else {
            candle_core::bail!("{name} is not in the published checkpoint");
        };
        self.requested.lock().unwrap().insert(name.to_string());
        Tensor::zeros((), dtype, dev)?.broadcast_as(shape.as_slice())
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.shapes.contains_key(name)
    }
}

fn var_builder(
    all: &Value,
    component: &str,
) -> (
    VarBuilder<'static>,
    Arc<Mutex<BTreeSet<String>>>,
    BTreeSet<String>,
) {
    let shapes: HashMap<String, Vec<usize>> =
        serde_json::from_value(all["state_dicts"][component]["tensors"].clone()).unwrap();
    let names = shapes.keys().cloned().collect();
    let requested = Arc::new(Mutex::new(BTreeSet::new()));
    let backend = Shapes {
        shapes,
        requested: requested.clone(),
    };
    (
        VarBuilder::from_backend(Box::new(backend), DType::BF16, Device::Cpu),
        requested,
        names,
    )
}

fn unused(
    names: &BTreeSet<String>,
    requested: &Mutex<BTreeSet<String>>,
    prefixes: &[&str],
) -> Vec<String> {
    let requested = requested.lock().unwrap();
    names
        .iter()
        .filter(|n| prefixes.iter().any(|p| n.starts_with(p)) && !requested.contains(*n))
        .cloned()
        .collect()
}

#[test]
fn transformer_matches_the_published_state_dict() {
    let all = published();
    let cfg: MiniMaxH3TransformerConfig = config(&all, "transformer/config.json");
    assert_eq!(cfg, MiniMaxH3TransformerConfig::default());
    let (vb, requested, names) = var_builder(&all, "transformer");
    let model = MiniMaxH3Transformer3DModel::new(&cfg, vb).unwrap();
    assert_eq!(model.blocks().len(), 50);
    assert_eq!(unused(&names, &requested, &[""]), Vec::<String>::new());
}

/// With the modulations apart (as the pipeline runs it), the transformer and its modulation
/// component split the published tensors: together they read every one, and none twice (the
/// time embedder and the output norm's Linear live in the modulation component alone).
#[test]
fn transformer_and_modulations_split_the_published_state_dict() {
    let all = published();
    let cfg = MiniMaxH3TransformerConfig {
        modulations_apart: true,
        ..config(&all, "transformer/config.json")
    };
    let (vb, transformer, names) = var_builder(&all, "transformer");
    MiniMaxH3Transformer3DModel::new(&cfg, vb).unwrap();
    let (vb, modulations, _) = var_builder(&all, "transformer");
    MiniMaxH3Modulations::new(&cfg, vb).unwrap();
    let (transformer, modulations) = (transformer.lock().unwrap(), modulations.lock().unwrap());
    let twice: Vec<&String> = transformer.intersection(&modulations).collect();
    assert_eq!(twice, Vec::<&String>::new());
    let read: BTreeSet<String> = transformer.union(&modulations).cloned().collect();
    assert_eq!(read, names);
}

#[test]
fn text_encoder_matches_the_published_state_dict() {
    let all = published();
    let cfg: Qwen3VLConfig = config(&all, "text_encoder/config.json");
    cfg.text_config.validate().unwrap();
    let (vb, requested, names) = var_builder(&all, "text_encoder");
    let encoder = MiniMaxH3TextEncoder::new(&cfg.text_config, vb).unwrap();
    assert_eq!(encoder.layers().len(), 50);
    // Layers 0..49 and the token table are read; layers 50..63, the final norm, lm_head and the
    // vision tower never are.
    let read = requested.lock().unwrap().clone();
    let needless = |n: &&String| {
        n.contains("layers.50.")
            || n.contains("visual")
            || n.starts_with("lm_head")
            || *n == "model.language_model.norm.weight"
    };
    assert_eq!(read.iter().filter(needless).count(), 0);
    let wanted: Vec<String> = names
        .iter()
        .filter(|n| {
            n.strip_prefix("model.language_model.layers.")
                .and_then(|rest| rest.split('.').next()?.parse::<usize>().ok())
                .is_some_and(|layer| layer < 50)
        })
        .cloned()
        .collect();
    let missing: Vec<&String> = wanted.iter().filter(|n| !read.contains(*n)).collect();
    assert!(missing.is_empty(), "{missing:?}");
    assert!(read.contains("model.language_model.embed_tokens.weight"));
}

#[test]
fn vae_decoder_matches_the_published_state_dict() {
    let all = published();
    let cfg: MiniMaxH3VaeConfig = config(&all, "vae/config.json");
    let (vb, requested, names) = var_builder(&all, "vae");
    MiniMaxH3VaeDecoder::new(&cfg, vb).unwrap();
    assert_eq!(
        unused(&names, &requested, &["decoder.", "post_quant_conv."]),
        Vec::<String>::new()
    );
}

#[test]
fn audio_vae_decoder_matches_the_published_state_dict() {
    let all = published();
    let cfg: MiniMaxH3AudioVaeConfig = config(&all, "audio_vae/config.json");
    let (vb, requested, names) = var_builder(&all, "audio_vae");
    MiniMaxH3AudioVaeDecoder::new(&cfg, vb).unwrap();
    assert_eq!(
        unused(&names, &requested, &["decoder.", "dec_in_proj."]),
        Vec::<String>::new()
    );
}

#[test]
fn published_schedules_parse() {
    let all = published();
    let video: MiniMaxH3SchedulerConfig = config(&all, "scheduler/scheduler_config.json");
    let audio: MiniMaxH3SchedulerConfig = config(&all, "audio_scheduler/scheduler_config.json");
    assert_eq!((video.shift, audio.shift), (12.0, 3.0));
}
