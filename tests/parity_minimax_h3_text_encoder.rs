//! Parity of MiniMax H3's prompt encoding (tokenizer + Qwen3-VL text model read at hidden state
//! 50, no final norm) with transformers/diffusers on the tiny fixture.

mod common;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use vidgen::models::minimax_h3::text_encoder::{
    text_token_tags, MiniMaxH3TextEncoder, MiniMaxH3Tokenizer, Qwen3VLConfig,
    PROMPT_HIDDEN_STATE_INDEX,
};

/// The fixture README's tolerance for text-encoder hidden states.
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-5;

fn dir() -> std::path::PathBuf {
    common::named_fixture_dir("minimax-h3-tiny-a")
}

fn config() -> Qwen3VLConfig {
    Qwen3VLConfig::from_file(&dir().join("text_encoder/config.json")).unwrap()
}

fn var_builder() -> VarBuilder<'static> {
    let path = dir().join("text_encoder/model.safetensors");
    unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu).unwrap() }
}

fn readme() -> serde_json::Value {
    let path = dir().join("reference/README.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn tokenizer_matches_transformers() {
    let tokenizer = MiniMaxH3Tokenizer::from_file(&dir().join("tokenizer/tokenizer.json")).unwrap();
    let readme = readme();
    let cases = readme["tokenizer_cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tokenizer.encode(text).unwrap(), want, "{text:?}");
    }
    let r = common::reference_in(&dir(), "text_encoder");
    let prompts = readme["files"]["text_encoder.safetensors"]["info"]["prompts"]
        .as_array()
        .unwrap()
        .clone();
    for (i, prompt) in prompts.iter().enumerate() {
        let ids = tokenizer.encode(prompt.as_str().unwrap()).unwrap();
        let want = r[&format!("p{i}.input_ids")].flatten_all().unwrap();
        let want: Vec<u32> = want
            .to_vec1::<i64>()
            .unwrap()
            .into_iter()
            .map(|v| v as u32)
            .collect();
        assert_eq!(ids, want, "prompt {i}");
    }
}

#[test]
fn prompt_embeds_match_transformers() {
    let cfg = config().text_config;
    let encoder = MiniMaxH3TextEncoder::new(&cfg, var_builder()).unwrap();
    assert_eq!(encoder.layers().len(), PROMPT_HIDDEN_STATE_INDEX);
    let r = common::reference_in(&dir(), "text_encoder");
    for i in 0..4 {
        let ids = r[&format!("p{i}.input_ids")].to_dtype(DType::U32).unwrap();
        let embeds = encoder.forward(&ids).unwrap();
        let name = format!("p{i}.prompt_embeds");
        common::assert_close(&name, &embeds, &r[&name], ATOL, RTOL);
        let tags = text_token_tags(ids.dim(1).unwrap(), &Device::Cpu).unwrap();
        common::assert_close(
            "tags",
            &tags,
            &r[&format!("p{i}.text_token_tags")],
            0.0,
            0.0,
        );
    }
}

#[test]
fn streamed_layers_match_hidden_states() {
    let cfg = config().text_config;
    let vb = var_builder();
    let encoder = MiniMaxH3TextEncoder::new_without_layers(&cfg, vb.clone()).unwrap();
    assert!(encoder.layers().is_empty());
    let r = common::reference_in(&dir(), "text_encoder");
    let ids = r["p3.input_ids"].to_dtype(DType::U32).unwrap();
    let (mut h, rope) = encoder.embed(&ids).unwrap();
    common::assert_close(
        "hidden_states.0",
        &h,
        &r["p3.debug.hidden_states.0"],
        ATOL,
        RTOL,
    );
    for i in 0..MiniMaxH3TextEncoder::layers_used() {
        let layer = MiniMaxH3TextEncoder::layer(&cfg, i, vb.clone()).unwrap();
        h = layer.forward(&h, &rope).unwrap();
        let name = format!("p3.debug.hidden_states.{}", i + 1);
        if let Some(want) = r.get(&name) {
            common::assert_close(&name, &h, want, ATOL, RTOL);
        }
    }
}

#[test]
fn a_stack_of_fifty_layers_is_refused() {
    let mut cfg = config().text_config;
    cfg.num_hidden_layers = PROMPT_HIDDEN_STATE_INDEX;
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("num_hidden_layers"), "{err}");
}

/// The encoder runs in bf16 on the GPU: it must run with a bf16 `VarBuilder` and stay near the
/// f32 result (loose sanity bound; values reach ~12 after 50 layers).
#[test]
fn bf16_prompt_embeds_run_near_f32() {
    let path = dir().join("text_encoder/model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::BF16, &Device::Cpu).unwrap() };
    let encoder = MiniMaxH3TextEncoder::new(&config().text_config, vb).unwrap();
    let r = common::reference_in(&dir(), "text_encoder");
    let ids = r["p0.input_ids"].to_dtype(DType::U32).unwrap();
    let embeds = encoder.forward(&ids).unwrap().to_dtype(DType::F32).unwrap();
    common::assert_close(
        "bf16 prompt_embeds",
        &embeds,
        &r["p0.prompt_embeds"],
        0.5,
        0.1,
    );
}
