//! Parity of Mochi's text side (T5 v1.1 tokenization and the encoder called *with* the
//! attention mask, pad rows not zeroed) with `mochi-tiny-a/reference/text_encoder.safetensors`.

mod common;

use candle_core::{DType, Device, Tensor};
use vidgen::models::t5::encoder::{attention_mask, T5Config, T5EncoderModel};
use vidgen::models::t5::tokenizer::PromptTokenizer;

const FIXTURE: &str = "mochi-tiny-a";

fn inputs() -> serde_json::Value {
    let path = common::named_fixture_dir(FIXTURE).join("reference/README.json");
    let readme: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    readme["files"]["text_encoder.safetensors"]["inputs"].clone()
}

/// The README's prompts tokenized as `_get_t5_prompt_embeds` does: ids and masks `[4, L]`.
fn tokens() -> (Tensor, Tensor) {
    let inputs = inputs();
    let max_len = inputs["max_sequence_length"].as_u64().unwrap() as usize;
    let tokenizer = PromptTokenizer::from_file(
        &common::named_fixture_dir(FIXTURE).join("tokenizer/tokenizer.json"),
    )
    .unwrap();
    let (ids, lens): (Vec<Vec<u32>>, Vec<usize>) = inputs["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| tokenizer.encode(p.as_str().unwrap(), max_len).unwrap())
        .unzip();
    let rows = ids.len();
    let ids = Tensor::from_vec(ids.concat(), (rows, max_len), &Device::Cpu).unwrap();
    (ids, attention_mask(&lens, max_len, &Device::Cpu).unwrap())
}

fn ints(t: &Tensor) -> Vec<Vec<i64>> {
    t.to_dtype(DType::I64).unwrap().to_vec2::<i64>().unwrap()
}

#[test]
fn ids_and_masks_match_the_tokenizer() {
    let r = common::named_reference(FIXTURE, "text_encoder");
    let (ids, mask) = tokens();
    assert_eq!(ints(&ids), ints(&r["input_ids"]));
    assert_eq!(ints(&mask), ints(&r["attention_mask"]));
    assert_eq!(ints(&mask), ints(&r["prompt_attention_mask"]));
}

#[test]
fn masked_embeddings_match_diffusers() {
    let r = common::named_reference(FIXTURE, "text_encoder");
    let cfg: T5Config = common::config_in(FIXTURE, "text_encoder/config.json");
    let encoder = T5EncoderModel::new(
        &cfg,
        common::var_builder_in(FIXTURE, "text_encoder/model.safetensors"),
    )
    .unwrap();
    let (ids, mask) = tokens();
    let embeds = encoder.forward(&ids, &mask).unwrap();
    eprintln!(
        "prompt_embeds: max |diff| {:.3e}",
        common::max_abs_diff(&embeds, &r["prompt_embeds"])
    );
    common::assert_close("prompt_embeds", &embeds, &r["prompt_embeds"], 1e-4, 1e-4);
}
