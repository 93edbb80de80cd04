//! Parity of LTX-Video's text side (T5 v1.1 tokenization and encoder, called without an
//! attention mask) with `ltx-video-tiny-a/reference/text_encoder.safetensors`.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::{assert_close, named_fixture_dir, reference_in};
use std::path::PathBuf;
use vidgen::models::ltx::prompt::{prompt_embeds, prompt_tokens};
use vidgen::models::t5::encoder::{T5Block, T5Config, T5EncoderModel, T5Variant};
use vidgen::models::t5::tokenizer::PromptTokenizer;

const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn dir() -> PathBuf {
    named_fixture_dir("ltx-video-tiny-a")
}

fn readme() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference/README.json")).unwrap())
        .unwrap()
}

fn prompts() -> Vec<String> {
    readme()["files"]["text_encoder.safetensors"]["inputs"]["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect()
}

fn max_len() -> usize {
    readme()["files"]["text_encoder.safetensors"]["inputs"]["max_sequence_length"]
        .as_u64()
        .unwrap() as usize
}

fn config() -> T5Config {
    T5Config::from_file(&dir().join("text_encoder/config.json")).unwrap()
}

fn encoder() -> T5EncoderModel {
    let path = dir().join("text_encoder/model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu) }.unwrap();
    T5EncoderModel::new(&config(), vb).unwrap()
}

fn tokenizer() -> PromptTokenizer {
    PromptTokenizer::from_file(&dir().join("tokenizer/tokenizer.json")).unwrap()
}

fn to_i64(t: &Tensor) -> Vec<Vec<i64>> {
    t.to_dtype(DType::I64).unwrap().to_vec2::<i64>().unwrap()
}

/// The README's prompts tokenized as the pipeline does: ids `[4, L]` and masks `[4, L]`.
fn tokens() -> (Tensor, Tensor) {
    let tok = tokenizer();
    let (ids, masks): (Vec<Tensor>, Vec<Tensor>) = prompts()
        .iter()
        .map(|p| prompt_tokens(&tok, p, max_len(), &Device::Cpu).unwrap())
        .unzip();
    (
        Tensor::cat(&ids, 0).unwrap(),
        Tensor::cat(&masks, 0).unwrap(),
    )
}

#[test]
fn config_is_t5_not_umt5() {
    let cfg = config();
    assert_eq!(cfg.variant, T5Variant::T5);
    assert!(cfg.variant.block_has_relative_bias(0));
    assert!(!cfg.variant.block_has_relative_bias(1));
    let umt5: T5Config = serde_json::from_str(r#"{"model_type": "umt5"}"#).unwrap();
    assert_eq!((umt5.variant, umt5.vocab_size), (T5Variant::Umt5, 250112));
    let t5: T5Config = serde_json::from_str("{}").unwrap();
    assert_eq!(
        (t5.variant, t5.d_ff, t5.feed_forward_proj.as_str()),
        (T5Variant::T5, 2048, "relu")
    );
    assert!(serde_json::from_str::<T5Config>(r#"{"model_type": "bert"}"#).is_err());
    let zero: T5Config = serde_json::from_str(r#"{"num_heads": 0}"#).unwrap();
    assert!(zero
        .validate()
        .unwrap_err()
        .to_string()
        .contains("num_heads"));
    let huge: T5Config = serde_json::from_str(r#"{"d_kv": 18446744073709551615}"#).unwrap();
    assert!(huge.validate().unwrap_err().to_string().contains("d_kv"));
}

#[test]
fn tokenizes_like_the_pipeline_without_cleaning() {
    let r = reference_in(&dir(), "text_encoder");
    let (ids, mask) = tokens();
    assert_eq!(to_i64(&ids), to_i64(&r["input_ids"]), "input_ids");
    assert_eq!(
        to_i64(&mask),
        to_i64(&r["attention_mask"]),
        "attention_mask"
    );
    assert_eq!(
        to_i64(&mask),
        to_i64(&r["prompt_attention_mask"]),
        "prompt_attention_mask"
    );
    let tok = tokenizer();
    for case in readme()["tokenizer_cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let (got, len) = tok.encode(text, 64).unwrap();
        assert_eq!(&got[..len], &want[..], "ids of {text:?}");
    }
}

#[test]
fn encoder_matches_reference_blockwise_and_whole() {
    let r = reference_in(&dir(), "text_encoder");
    let cfg = config();
    let model = encoder();
    let (ids, _) = tokens();
    let ones = Tensor::ones(ids.dims2().unwrap(), DType::U32, &Device::Cpu).unwrap();

    let mut h = model.embed(&ids).unwrap();
    assert_close(
        "hidden_states.0",
        &h,
        &r["debug.hidden_states.0"],
        ATOL,
        RTOL,
    );
    // Block by block as a streaming engine runs it: block 0's bias is carried along.
    let mut bias = None;
    for (i, block) in model.blocks().iter().enumerate() {
        h = block.forward_sharing_bias(&h, &ones, &mut bias).unwrap();
        if i + 1 < cfg.num_layers {
            let name = format!("debug.hidden_states.{}", i + 1);
            assert_close(&name, &h, &r[&name], ATOL, RTOL);
        }
    }
    let last = model.final_norm(&h).unwrap();
    assert_close(
        "last_hidden_state (blockwise)",
        &last,
        &r["last_hidden_state"],
        ATOL,
        RTOL,
    );
    let name = format!("debug.hidden_states.{}", cfg.num_layers);
    assert_close(&name, &last, &r[&name], ATOL, RTOL);

    let whole = model.forward_unmasked(&ids).unwrap();
    let diff = (&whole - &r["last_hidden_state"])
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap();
    println!(
        "last_hidden_state max |diff| {}",
        diff.to_scalar::<f32>().unwrap()
    );
    assert_close(
        "last_hidden_state",
        &whole,
        &r["last_hidden_state"],
        ATOL,
        RTOL,
    );
}

#[test]
fn prompt_embeds_keep_pad_rows_and_return_the_mask() {
    let r = reference_in(&dir(), "text_encoder");
    let model = encoder();
    let tok = tokenizer();
    for (i, prompt) in prompts().iter().enumerate() {
        let (embeds, mask) = prompt_embeds(&model, &tok, prompt, max_len()).unwrap();
        let want = r["prompt_embeds"].narrow(0, i, 1).unwrap();
        assert_close(&format!("prompt_embeds[{i}]"), &embeds, &want, ATOL, RTOL);
        let want_mask = r["prompt_attention_mask"].narrow(0, i, 1).unwrap();
        assert_eq!(to_i64(&mask), to_i64(&want_mask), "mask {i}");
    }
}

#[test]
fn later_t5_blocks_need_the_shared_bias() {
    let cfg = config();
    let path = dir().join("text_encoder/model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu) }.unwrap();
    // Block 1 has no table of its own in a T5 checkpoint.
    assert!(T5Block::new(&cfg, vb.pp("encoder.block.1")).is_err());
    let block = T5EncoderModel::block(&cfg, 1, vb).unwrap();
    let h = Tensor::zeros((1, 4, cfg.d_model), DType::F32, &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, 4), DType::U32, &Device::Cpu).unwrap();
    let err = block.forward(&h, &mask).unwrap_err().to_string();
    assert!(err.contains("relative_attention_bias"), "{err}");
}
