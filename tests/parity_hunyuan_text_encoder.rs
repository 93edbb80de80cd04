//! Parity of HunyuanVideo's Llama prompt encoding (`_get_llama_prompt_embeds`) with diffusers on
//! `hunyuanvideo-tiny-a`: template, `crop_start`, tokens, mask, `hidden_states[-3]`, crop.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::hunyuan_video::text_encoder::{
    crop_prompt, LlamaConfig, LlamaDecoderLayer, LlamaPromptTokenizer, LlamaTextEncoder,
    LlamaTokenizerLoad, DEFAULT_PROMPT_TEMPLATE,
};

const FIXTURE: &str = "hunyuanvideo-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;
/// The fixture's `max_sequence_length`.
const MAX_SEQUENCE_LENGTH: usize = 16;

fn readme() -> serde_json::Value {
    let path = common::named_fixture_dir(FIXTURE).join("reference/README.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn prompts() -> Vec<String> {
    readme()["preset"]["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_owned())
        .collect()
}

/// The load behaviour of the tokenizer class named by the fixture's `model_index.json`.
fn tokenizer_load() -> LlamaTokenizerLoad {
    let path = common::named_fixture_dir(FIXTURE).join("model_index.json");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    LlamaTokenizerLoad::for_class(index["tokenizer"][1].as_str().unwrap())
}

fn tokenizer(load: LlamaTokenizerLoad) -> LlamaPromptTokenizer {
    LlamaPromptTokenizer::from_dir(&common::named_fixture_dir(FIXTURE).join("tokenizer"), load)
        .unwrap()
}

fn config() -> LlamaConfig {
    LlamaConfig::from_file(&common::named_fixture_dir(FIXTURE).join("text_encoder/config.json"))
        .unwrap()
}

fn var_builder() -> VarBuilder<'static> {
    common::var_builder_in(FIXTURE, "text_encoder/model.safetensors")
}

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, ATOL, RTOL);
}

fn ints(t: &Tensor) -> Vec<Vec<i64>> {
    t.to_dtype(DType::I64).unwrap().to_vec2().unwrap()
}

#[test]
fn tokenizer_cases_match_transformers() {
    assert_eq!(tokenizer_load(), LlamaTokenizerLoad::LlamaTokenizerFast);
    // The tiny tokenizer.json is already in LlamaTokenizerFast's rebuilt form: both loads agree.
    for load in [
        LlamaTokenizerLoad::LlamaTokenizerFast,
        LlamaTokenizerLoad::Verbatim,
    ] {
        let tok = tokenizer(load);
        for case in readme()["tokenizer_cases"]["tokenizer"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let want: Vec<u32> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(tok.ids(text).unwrap(), want, "{load:?} {text:?}");
        }
    }
}

#[test]
fn tokens_and_crop_start_match_the_pipeline() {
    let tok = tokenizer(tokenizer_load());
    let crop_start = tok.crop_start(DEFAULT_PROMPT_TEMPLATE).unwrap();
    assert_eq!(
        crop_start,
        readme()["derived"]["crop_start"].as_u64().unwrap() as usize
    );
    let prompts = prompts();
    let prompts: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let (ids, mask) = tok
        .batch(
            DEFAULT_PROMPT_TEMPLATE,
            &prompts,
            crop_start,
            MAX_SEQUENCE_LENGTH,
            &Device::Cpu,
        )
        .unwrap();
    let r = common::named_reference(FIXTURE, "text_encoder");
    assert_eq!(ints(&ids), ints(&r["llama.input_ids"]));
    assert_eq!(ints(&mask), ints(&r["llama.attention_mask"]));
}

#[test]
fn prompt_embeds_match_diffusers() {
    let cfg = config();
    let r = common::named_reference(FIXTURE, "text_encoder");
    let (ids, mask) = (&r["llama.input_ids"], &r["llama.attention_mask"]);
    let model = LlamaTextEncoder::new(&cfg, var_builder()).unwrap();
    assert_eq!(model.blocks().len(), cfg.num_hidden_layers - 2);
    check(
        "hidden_states.0",
        &model.embed(ids).unwrap(),
        &r["llama.hidden_states.0"],
    );
    let hidden = model.forward(ids, mask).unwrap();
    check("hidden_states[-3]", &hidden, &r["llama.hidden_states.1"]);

    let crop_start = tokenizer(tokenizer_load())
        .crop_start(DEFAULT_PROMPT_TEMPLATE)
        .unwrap();
    let (embeds, cropped_mask) = crop_prompt(&hidden, mask, crop_start).unwrap();
    check("prompt_embeds", &embeds, &r["prompt_embeds"]);
    assert_eq!(ints(&cropped_mask), ints(&r["prompt_attention_mask"]));

    // The engine's path: embeddings, then layers built one at a time.
    let bare = LlamaTextEncoder::new_without_blocks(&cfg, var_builder()).unwrap();
    let inputs = bare.prepare(mask, &Device::Cpu).unwrap();
    let mut h = bare.embed(ids).unwrap();
    for i in 0..cfg.layers_used() {
        let layer = LlamaDecoderLayer::new(&cfg, var_builder().pp(format!("layers.{i}"))).unwrap();
        h = layer.forward(&h, &inputs).unwrap();
    }
    check(
        "streamed hidden_states[-3]",
        &h,
        &r["llama.hidden_states.1"],
    );
}

#[test]
fn hostile_configs_are_refused_with_the_key() {
    let base = config();
    for (key, cfg) in [
        (
            "num_key_value_heads",
            LlamaConfig {
                num_key_value_heads: Some(3),
                ..base.clone()
            },
        ),
        (
            "num_hidden_layers",
            LlamaConfig {
                num_hidden_layers: 1,
                ..base.clone()
            },
        ),
        (
            "hidden_act",
            LlamaConfig {
                hidden_act: "gelu".into(),
                ..base.clone()
            },
        ),
        (
            "head_dim",
            LlamaConfig {
                head_dim: Some(7),
                ..base.clone()
            },
        ),
        (
            "rope_scaling",
            serde_json::from_str::<LlamaConfig>(
                r#"{"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 3,
                    "rope_scaling": {"type": "llama3", "factor": 8.0}}"#,
            )
            .unwrap(),
        ),
    ] {
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(key), "{key}: {err}");
        assert!(LlamaTextEncoder::new(&cfg, var_builder()).is_err());
    }
}

/// The bf16 path stays close to the f32 reference (dtype plumbing, not rounding).
#[test]
fn bf16_encoder_tracks_the_reference() {
    let path = common::named_fixture_dir(FIXTURE).join("text_encoder/model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::BF16, &Device::Cpu).unwrap() };
    let model = LlamaTextEncoder::new(&config(), vb).unwrap();
    let r = common::named_reference(FIXTURE, "text_encoder");
    let out = model
        .forward(&r["llama.input_ids"], &r["llama.attention_mask"])
        .unwrap();
    assert_eq!(out.dtype(), DType::BF16);
    let reference = &r["llama.hidden_states.1"];
    let scale = common::max_abs_diff(reference, &reference.zeros_like().unwrap());
    let err = common::max_abs_diff(&out, reference) / scale;
    eprintln!("bf16 hidden_states[-3]: max |diff| / max |ref| = {err:.3e}");
    assert!(err < 5e-2, "bf16 output drifts {err} from the reference");
}
