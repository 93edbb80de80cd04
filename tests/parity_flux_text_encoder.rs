//! Parity of FluxPipeline's `encode_prompt` with diffusers on `flux-tiny-a`: the CLIP text
//! model's pooled output (`text_encoder`, 77 tokens) and T5's `last_hidden_state` without a
//! mask (`text_encoder_2`, `max_sequence_length` tokens, pads not zeroed).

mod common;

use candle_core::{DType, Tensor};
use vidgen::models::clip::{ClipTextConfig, ClipTextModel};
use vidgen::models::t5::encoder::{T5Config, T5EncoderModel};
use vidgen::models::t5::tokenizer::PromptTokenizer;

const FIXTURE: &str = "flux-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn readme() -> serde_json::Value {
    let path = common::named_fixture_dir(FIXTURE).join("reference/README.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The call's prompts and `max_sequence_length`.
fn inputs() -> (Vec<String>, usize) {
    let inputs = &readme()["files"]["text_encoder.safetensors"]["inputs"];
    let prompts = inputs["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_owned())
        .collect();
    (
        prompts,
        inputs["max_sequence_length"].as_u64().unwrap() as usize,
    )
}

fn ints(t: &Tensor) -> Vec<Vec<i64>> {
    t.to_dtype(DType::I64).unwrap().to_vec2().unwrap()
}

#[test]
fn t5_tokens_match_the_pipeline() {
    let (prompts, max_len) = inputs();
    let dir = common::named_fixture_dir(FIXTURE).join("tokenizer_2/tokenizer.json");
    let tokenizer = PromptTokenizer::from_file(&dir).unwrap();
    let ids: Vec<Vec<i64>> = prompts
        .iter()
        .map(|p| {
            let (ids, _) = tokenizer.encode(p, max_len).unwrap();
            ids.into_iter().map(i64::from).collect()
        })
        .collect();
    let r = common::named_reference(FIXTURE, "text_encoder");
    assert_eq!(ids, ints(&r["t5.input_ids"]));
}

#[test]
fn t5_prompt_embeds_match_diffusers() {
    let cfg: T5Config = common::config_in(FIXTURE, "text_encoder_2/config.json");
    let vb = common::var_builder_in(FIXTURE, "text_encoder_2/model.safetensors");
    let model = T5EncoderModel::new(&cfg, vb).unwrap();
    let r = common::named_reference(FIXTURE, "text_encoder");
    let embeds = model.forward_unmasked(&r["t5.input_ids"]).unwrap();
    common::assert_close("prompt_embeds", &embeds, &r["prompt_embeds"], ATOL, RTOL);
}

#[test]
fn clip_pooled_embeds_match_diffusers() {
    let cfg: ClipTextConfig = common::config_in(FIXTURE, "text_encoder/config.json");
    let vb = common::var_builder_in(FIXTURE, "text_encoder/model.safetensors");
    let model = ClipTextModel::new(&cfg, vb).unwrap();
    let r = common::named_reference(FIXTURE, "text_encoder");
    let out = model.forward(&r["clip.input_ids"]).unwrap();
    common::assert_close(
        "clip.last_hidden_state",
        &out.last_hidden_state,
        &r["clip.last_hidden_state"],
        ATOL,
        RTOL,
    );
    common::assert_close(
        "pooled_prompt_embeds",
        &out.pooler_output,
        &r["pooled_prompt_embeds"],
        ATOL,
        RTOL,
    );
}
