//! Parity of the Wan text side (prompt cleaning, tokenization, UMT5 encoder) with the
//! reference outputs of diffusers/transformers in `reference/text_encoder.safetensors`.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use common::{assert_close, fixture_dir, reference};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use vidgen::models::wan::prompt::{clean_prompt, PromptTokenizer};
use vidgen::models::wan::text_encoder::{
    relative_position_bucket, UMT5Block, UMT5Config, UMT5Embedding, UMT5EncoderModel, UMT5LayerNorm,
};

const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn readme() -> serde_json::Value {
    let path = fixture_dir().join("reference/README.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

fn raw_prompts() -> Vec<String> {
    strings(&readme()["preset"]["prompts"])
}

fn cleaned_prompts() -> Vec<String> {
    strings(&readme()["files"]["text_encoder.safetensors"]["inputs"]["cleaned_prompts"])
}

fn max_sequence_length() -> usize {
    readme()["preset"]["max_sequence_length"].as_u64().unwrap() as usize
}

fn config() -> UMT5Config {
    UMT5Config::from_file(&fixture_dir().join("text_encoder/config.json")).unwrap()
}

fn weights_path() -> PathBuf {
    fixture_dir().join("text_encoder/model.safetensors")
}

fn var_builder(path: &Path, dtype: DType) -> VarBuilder<'static> {
    unsafe { VarBuilder::from_mmaped_safetensors(&[path], dtype, &Device::Cpu).unwrap() }
}

fn tokenizer() -> PromptTokenizer {
    PromptTokenizer::from_file(&fixture_dir().join("tokenizer/tokenizer.json")).unwrap()
}

fn i64_rows(t: &Tensor) -> Vec<Vec<i64>> {
    t.to_vec2::<i64>().unwrap()
}

/// Tokenizes the README's raw prompts the way the pipeline does.
fn pipeline_tokens() -> (Tensor, Vec<usize>) {
    let tok = tokenizer();
    let len = max_sequence_length();
    let mut ids = Vec::new();
    let mut lens = Vec::new();
    for raw in raw_prompts() {
        let (row, n) = tok.encode(&clean_prompt(&raw), len).unwrap();
        ids.extend(row);
        lens.push(n);
    }
    let batch = lens.len();
    (
        Tensor::from_vec(ids, (batch, len), &Device::Cpu).unwrap(),
        lens,
    )
}

#[test]
fn cleans_the_fixture_prompts_exactly() {
    let raw = raw_prompts();
    let cleaned = cleaned_prompts();
    assert_eq!(raw.len(), 5);
    for (r, c) in raw.iter().zip(&cleaned) {
        assert_eq!(&clean_prompt(r), c, "cleaning {r:?}");
    }
}

#[test]
fn cleaning_follows_python_html_unescape_and_ftfy() {
    // Python's html.unescape also decodes the legacy entities without ';'.
    assert_eq!(clean_prompt("salt &amp pepper"), "salt & pepper");
    assert_eq!(clean_prompt("&#65;&#x42;&#X43;"), "ABC");
    assert_eq!(clean_prompt("&notanentity; &copy2024"), "¬anentity; ©2024");
    // ftfy unescapes (repeatedly) on top of diffusers' two passes when there is no '<'.
    assert_eq!(clean_prompt("&amp;amp;amp;amp;"), "&");
    assert_eq!(clean_prompt("<b> &amp;amp;amp;amp;"), "<b> &amp;amp;");
    // Whole-string mojibake, C1 controls, width, ligatures, quotes, NBSP and NFC.
    assert_eq!(clean_prompt("cafÃ© au lait"), "café au lait");
    assert_eq!(clean_prompt("\u{93}hi\u{94}"), "\"hi\"");
    assert_eq!(clean_prompt("ｆｕｌｌ\u{3000}ﬂat"), "full flat");
    assert_eq!(clean_prompt("e\u{301}\u{a0}\u{2019}x\u{2019}"), "é 'x'");
    assert_eq!(clean_prompt(" \t\n\u{1c} "), "");
}

#[test]
fn tokenizes_like_the_pipeline() {
    let r = reference("text_encoder");
    let (ids, lens) = pipeline_tokens();
    let expected_ids = i64_rows(&r["input_ids"]);
    let got_ids: Vec<Vec<i64>> = ids
        .to_vec2::<u32>()
        .unwrap()
        .into_iter()
        .map(|row| row.into_iter().map(i64::from).collect())
        .collect();
    assert_eq!(got_ids, expected_ids, "input_ids");
    let expected_lens: Vec<usize> = r["seq_lens"]
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|l| l as usize)
        .collect();
    assert_eq!(lens, expected_lens, "seq_lens");
    let mask: Vec<Vec<i64>> = lens
        .iter()
        .map(|&l| {
            (0..max_sequence_length())
                .map(|i| i64::from(i < l))
                .collect()
        })
        .collect();
    assert_eq!(mask, i64_rows(&r["attention_mask"]), "attention_mask");
}

#[test]
fn tokenizes_the_readme_cases() {
    let tok = tokenizer();
    let cases = readme()["tokenizer_cases"].as_array().unwrap().clone();
    assert_eq!(cases.len(), 7);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let (ids, len) = tok.encode(text, 64).unwrap();
        assert_eq!(&ids[..len], &expected[..], "ids of {text:?}");
        assert!(ids[len..].iter().all(|&i| i == 0), "padding of {text:?}");
        // Truncation keeps </s> last.
        let (short, short_len) = tok.encode(text, 3).unwrap();
        assert_eq!(short_len, expected.len().min(3));
        assert_eq!(short[short_len - 1], 1, "</s> last in {text:?}");
    }
    assert!(tok.encode("x", 1).is_err(), "no room for the prompt");
}

#[test]
fn relative_position_buckets_match_transformers() {
    // Run-length form of transformers' table for d = key - query in -511..=511 (32 buckets,
    // max distance 128), from wan2.1-configs.json.
    let runs: [(i64, usize); 31] = [
        (-511, 15),
        (-90, 14),
        (-63, 13),
        (-45, 12),
        (-31, 11),
        (-22, 10),
        (-15, 9),
        (-11, 8),
        (-7, 7),
        (-6, 6),
        (-5, 5),
        (-4, 4),
        (-3, 3),
        (-2, 2),
        (-1, 1),
        (0, 0),
        (1, 17),
        (2, 18),
        (3, 19),
        (4, 20),
        (5, 21),
        (6, 22),
        (7, 23),
        (8, 24),
        (12, 25),
        (16, 26),
        (23, 27),
        (32, 28),
        (46, 29),
        (64, 30),
        (91, 31),
    ];
    for d in -511i64..=511 {
        let expected = runs.iter().rev().find(|(start, _)| *start <= d).unwrap().1;
        assert_eq!(relative_position_bucket(d, 32, 128), expected, "d = {d}");
    }
}

#[test]
fn encoder_matches_reference() {
    let r = reference("text_encoder");
    let cfg = config();
    let model = UMT5EncoderModel::new(&cfg, var_builder(&weights_path(), DType::F32)).unwrap();
    let (ids, lens) = pipeline_tokens();
    let mask = r["attention_mask"].clone();

    let mut h = model.embed(&ids).unwrap();
    assert_close(
        "hidden_states.0",
        &h,
        &r["debug.hidden_states.0"],
        ATOL,
        RTOL,
    );
    assert_eq!(model.blocks().len(), cfg.num_layers);
    // transformers 5 overwrites the last `hidden_states` entry with `last_hidden_state`
    // (`capture_outputs(tie_last_hidden_states=True)`): entry k < num_layers is the output of
    // block k-1, entry num_layers is after the final norm.
    for (i, block) in model.blocks().iter().enumerate() {
        h = block.forward(&h, &mask).unwrap();
        if i + 1 < cfg.num_layers {
            let name = format!("debug.hidden_states.{}", i + 1);
            assert_close(&name, &h, &r[&name], ATOL, RTOL);
        }
    }
    let last = model.final_norm(&h).unwrap();
    let name = format!("debug.hidden_states.{}", cfg.num_layers);
    assert_close(&name, &last, &r[&name], ATOL, RTOL);
    assert_close(
        "last_hidden_state (blockwise)",
        &last,
        &r["last_hidden_state"],
        ATOL,
        RTOL,
    );

    let last = model.forward(&ids, &mask).unwrap();
    assert_close(
        "last_hidden_state",
        &last,
        &r["last_hidden_state"],
        ATOL,
        RTOL,
    );

    let embeds = model.prompt_embeds(&ids, &lens).unwrap();
    assert_close("prompt_embeds", &embeds, &r["prompt_embeds"], ATOL, RTOL);
    let rows = embeds.to_vec3::<f32>().unwrap();
    for (b, (prompt, &len)) in rows.iter().zip(&lens).enumerate() {
        for row in &prompt[len..] {
            assert!(
                row.iter().all(|v| v.to_bits() == 0),
                "prompt {b}: padded row not exactly +0"
            );
        }
        assert!(
            prompt[len - 1].iter().any(|v| *v != 0.0),
            "prompt {b}: last real row zeroed"
        );
    }
}

#[test]
fn blocks_load_alone() {
    // What a block-by-block engine does: each part built from the checkpoint just before use.
    let r = reference("text_encoder");
    let cfg = config();
    let vb = var_builder(&weights_path(), DType::F32);
    let (ids, _) = pipeline_tokens();
    let mut h = UMT5Embedding::new(&cfg, vb.clone())
        .unwrap()
        .forward(&ids)
        .unwrap();
    for i in 0..cfg.num_layers {
        let block = UMT5Block::new(&cfg, vb.pp(format!("encoder.block.{i}"))).unwrap();
        h = block.forward(&h, &r["attention_mask"]).unwrap();
    }
    let last = UMT5LayerNorm::final_norm(&cfg, vb)
        .unwrap()
        .forward(&h)
        .unwrap();
    assert_close(
        "last_hidden_state",
        &last,
        &r["last_hidden_state"],
        ATOL,
        RTOL,
    );
}

#[test]
fn bf16_run_keeps_wo_in_f32_and_stays_close() {
    let r = reference("text_encoder");
    let model =
        UMT5EncoderModel::new(&config(), var_builder(&weights_path(), DType::BF16)).unwrap();
    let (ids, lens) = pipeline_tokens();
    let embeds = model.prompt_embeds(&ids, &lens).unwrap();
    assert_eq!(embeds.dtype(), DType::BF16);
    // Block outputs are f32 once the f32 `wo` output joins the residual stream.
    let h = model.blocks()[0]
        .forward(&model.embed(&ids).unwrap(), &r["attention_mask"])
        .unwrap();
    assert_eq!(h.dtype(), DType::F32);
    // bf16 rounding moves values by ~0.035 at |ref| ~3; a real bug moves them by > 0.5.
    assert_close(
        "bf16 prompt_embeds",
        &embeds,
        &r["prompt_embeds"],
        0.05,
        0.02,
    );
}

/// Writes a copy of the fixture weights with `edit` applied, in a fresh temp dir.
fn modified_weights(tag: &str, edit: impl FnOnce(&mut HashMap<String, Tensor>)) -> PathBuf {
    let mut tensors = candle_core::safetensors::load(weights_path(), &Device::Cpu).unwrap();
    edit(&mut tensors);
    let dir = std::env::temp_dir().join(format!("vidgen-textenc-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &path).unwrap();
    path
}

fn load_error(path: &Path) -> String {
    match UMT5EncoderModel::new(&config(), var_builder(path, DType::F32)) {
        Ok(_) => panic!("loading {} should fail", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_an_error_naming_it() {
    let name = "encoder.block.1.layer.1.DenseReluDense.wo.weight";
    let path = modified_weights("missing", |t| {
        t.remove(name);
    });
    let err = load_error(&path);
    assert!(err.contains(name), "{err}");

    let path = modified_weights("no-embedding", |t| {
        t.remove("shared.weight");
    });
    let err = load_error(&path);
    assert!(err.contains("shared.weight"), "{err}");
}

#[test]
fn wrong_shape_is_an_error_naming_it() {
    let name = "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight";
    let path = modified_weights("shape", |t| {
        let wrong = Tensor::zeros((7, 2), DType::F32, &Device::Cpu).unwrap();
        t.insert(name.to_string(), wrong);
    });
    let err = load_error(&path);
    assert!(err.contains(name), "{err}");
}

#[test]
fn embed_tokens_alias_is_accepted() {
    let r = reference("text_encoder");
    let path = modified_weights("alias", |t| {
        let shared = t.remove("shared.weight").unwrap();
        t.insert("encoder.embed_tokens.weight".to_string(), shared);
    });
    let model = UMT5EncoderModel::new(&config(), var_builder(&path, DType::F32)).unwrap();
    let (ids, _) = pipeline_tokens();
    let last = model.forward(&ids, &r["attention_mask"]).unwrap();
    assert_close(
        "last_hidden_state (alias)",
        &last,
        &r["last_hidden_state"],
        ATOL,
        RTOL,
    );
}
