//! Parity of Latte's text side (caption cleaning, 120 T5 tokens with the mask, `mask_feature`)
//! with `latte-tiny-a/reference/text_encoder.safetensors`.

mod common;

use candle_core::{DType, Tensor};
use vidgen::models::latte::prompt::{mask_feature, tokens, MAX_LENGTH};
use vidgen::models::t5::encoder::{attention_mask, T5Config, T5EncoderModel};
use vidgen::models::t5::tokenizer::{clean_caption, PromptTokenizer};

const FIXTURE: &str = "latte-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn inputs() -> serde_json::Value {
    let text =
        std::fs::read_to_string(common::named_fixture_dir(FIXTURE).join("reference/README.json"))
            .unwrap();
    let readme: serde_json::Value = serde_json::from_str(&text).unwrap();
    readme["files"]["text_encoder.safetensors"]["inputs"].clone()
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

fn tokenizer() -> PromptTokenizer {
    PromptTokenizer::from_file(&common::named_fixture_dir(FIXTURE).join("tokenizer/tokenizer.json"))
        .unwrap()
}

fn encoder() -> T5EncoderModel {
    let cfg: T5Config = common::config_in(FIXTURE, "text_encoder/config.json");
    T5EncoderModel::new(
        &cfg,
        common::var_builder_in(FIXTURE, "text_encoder/model.safetensors"),
    )
    .unwrap()
}

/// `last_hidden_state` `[1, 120, D]` of one prompt, with its real length.
fn embed(encoder: &T5EncoderModel, prompt: &str) -> (Tensor, usize) {
    let (ids, len) = tokens(&tokenizer(), prompt).unwrap();
    let device = encoder.device();
    let ids = Tensor::new(ids.as_slice(), &device)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mask = attention_mask(&[len], MAX_LENGTH, &device).unwrap();
    (encoder.forward(&ids, &mask).unwrap(), len)
}

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, ATOL, RTOL);
}

#[test]
fn prompts_are_cleaned_and_tokenized_like_the_pipeline() {
    let inputs = inputs();
    let cleaned: Vec<String> = strings(&inputs["prompts"])
        .iter()
        .map(|p| clean_caption(p))
        .collect();
    assert_eq!(cleaned, strings(&inputs["preprocessed_prompts"]));
    let r = common::named_reference(FIXTURE, "text_encoder");
    let tok = tokenizer();
    for (i, prompt) in strings(&inputs["prompts"]).iter().enumerate() {
        let (ids, len) = tokens(&tok, prompt).unwrap();
        let want_ids = r["input_ids"].get(i).unwrap().to_vec1::<i64>().unwrap();
        let want_mask = r["attention_mask"]
            .get(i)
            .unwrap()
            .to_vec1::<i64>()
            .unwrap();
        let ids: Vec<i64> = ids.iter().map(|&x| i64::from(x)).collect();
        assert_eq!(ids, want_ids, "input_ids of prompt {i}");
        assert_eq!(
            len as i64,
            want_mask.iter().sum::<i64>(),
            "mask of prompt {i}"
        );
    }
}

#[test]
fn masked_encoder_matches_diffusers() {
    let encoder = encoder();
    let r = common::named_reference(FIXTURE, "text_encoder");
    for (i, prompt) in strings(&inputs()["prompts"]).iter().enumerate() {
        let (hidden, _) = embed(&encoder, prompt);
        check(
            &format!("last_hidden_state[{i}]"),
            &hidden.squeeze(0).unwrap(),
            &r["last_hidden_state"].get(i).unwrap(),
        );
    }
}

#[test]
fn mask_feature_cuts_both_prompts_to_the_prompt_rows() {
    let encoder = encoder();
    let r = common::named_reference(FIXTURE, "text_encoder");
    let pipeline: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::named_fixture_dir(FIXTURE).join("reference/README.json"))
            .unwrap(),
    )
    .unwrap();
    let preset = &pipeline["preset"];
    let prompt = strings(&preset["prompts"])
        [preset["pipeline_prompt_index"].as_u64().unwrap() as usize]
        .clone();
    let negative = preset["negative_prompt"].as_str().unwrap();
    let (cond, len) = embed(&encoder, &prompt);
    let (uncond, _) = embed(&encoder, negative);
    assert_eq!(
        len as u64,
        inputs()["pipeline_keep_tokens"].as_u64().unwrap()
    );
    let (cond, uncond) = mask_feature(&cond, len, Some(&uncond)).unwrap();
    check(
        "pipeline.prompt_embeds",
        &cond,
        &r["pipeline.prompt_embeds"],
    );
    check(
        "pipeline.negative_prompt_embeds",
        &uncond.unwrap(),
        &r["pipeline.negative_prompt_embeds"],
    );
    assert_eq!(cond.dtype(), DType::F32);
}
