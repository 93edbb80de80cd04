//! The Mochi-1 transformer and VAE decoder built from the *published* configs (the shipped
//! `synthetic:mochi-1` ones) against genmo/mochi-1-preview's state-dict names and shapes
//! (`tests/fixtures/seed-rest-configs.json`, recorded on the meta device), without weights:
//! every tensor a component asks for exists with that shape, and every published tensor of the
//! parts vidgen implements is used.

use candle_core::DType;
use serde_json::Value;
use std::collections::BTreeMap;
use vidgen::models::mochi::transformer::{MochiTransformer3DModel, MochiTransformerConfig};
use vidgen::models::mochi::vae::{AutoencoderKLMochi, MochiVaeConfig};
use vidgen::offload::{record, Packing};

fn manifest(relative: &str) -> Value {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(relative);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The published state dict `name` as tensor name -> shape.
fn published(name: &str) -> BTreeMap<String, Vec<usize>> {
    serde_json::from_value(
        manifest("tests/fixtures/seed-rest-configs.json")["state_dicts"][name]["tensors"].clone(),
    )
    .unwrap()
}

/// What `build` asks for, as tensor name -> shape.
fn requested<B>(
    build: impl FnOnce(candle_nn::VarBuilder<'static>) -> candle_core::Result<B>,
) -> BTreeMap<String, Vec<usize>> {
    record(None, DType::BF16, Packing::ByDtype, build)
        .unwrap()
        .slots
        .into_iter()
        .map(|slot| (slot.name, slot.shape.dims().to_vec()))
        .collect()
}

/// Every requested tensor is published with its shape; the published ones not requested are
/// exactly `unused`.
fn check(
    requested: &BTreeMap<String, Vec<usize>>,
    published: &BTreeMap<String, Vec<usize>>,
    unused: impl Fn(&str) -> bool,
) {
    for (name, shape) in requested {
        assert_eq!(published.get(name), Some(shape), "{name}");
    }
    for name in published.keys() {
        assert_eq!(
            requested.contains_key(name),
            !unused(name),
            "{name}: requested {}",
            requested.contains_key(name)
        );
    }
}

#[test]
fn transformer_asks_for_the_published_tensors() {
    let cfg: MochiTransformerConfig =
        serde_json::from_value(manifest("assets/mochi-1/transformer/config.json")).unwrap();
    let asked = requested(|vb| MochiTransformer3DModel::new(&cfg, vb));
    let last = format!("transformer_blocks.{}.attn1.", cfg.num_layers - 1);
    // The last block is context_pre_only: its text queries only feed outputs it discards.
    check(&asked, &published("Mochi transformer"), |name| {
        name == format!("{last}add_q_proj.weight") || name == format!("{last}norm_added_q.weight")
    });
}

#[test]
fn vae_decoder_asks_for_the_published_tensors() {
    let cfg: MochiVaeConfig =
        serde_json::from_value(manifest("assets/mochi-1/vae/config.json")).unwrap();
    let asked = requested(|vb| AutoencoderKLMochi::new(&cfg, vb));
    // Text-to-video decodes only.
    check(&asked, &published("Mochi VAE"), |name| {
        name.starts_with("encoder.")
    });
}
