//! Parity of the CLIP towers and CLIP's image preprocessing with transformers 5.24: the vision
//! tower and `CLIPImageProcessorPil` on the Wan2.1 I2V fixture, the text tower on
//! HunyuanVideo's `text_encoder_2`.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use vidgen::models::clip::{
    load_rgb_image, ClipImageProcessor, ClipImageProcessorConfig, ClipTextConfig, ClipTextModel,
    ClipVisionConfig, ClipVisionModel,
};

const I2V: &str = "wan21-i2v-tiny-a";
const HUNYUAN: &str = "hunyuanvideo-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn vision_config() -> ClipVisionConfig {
    common::config_in(I2V, "image_encoder/config.json")
}

#[test]
fn vision_hidden_states_match_transformers() {
    let cfg = vision_config();
    let model = ClipVisionModel::new(
        &cfg,
        common::var_builder_in(I2V, "image_encoder/model.safetensors"),
    )
    .unwrap();
    let r = common::named_reference(I2V, "image_encoder");
    let states = model.hidden_states(&r["pixel_values"]).unwrap();
    assert_eq!(states.len(), cfg.num_hidden_layers + 1);
    for (k, state) in states.iter().enumerate() {
        let name = format!("debug.hidden_states.{k}");
        eprintln!(
            "{name}: max |diff| {:e}",
            common::max_abs_diff(state, &r[&name])
        );
        common::assert_close(&name, state, &r[&name], ATOL, RTOL);
    }
}

#[test]
fn penultimate_layer_is_the_wan_image_embeds() {
    let cfg = vision_config();
    let vb = common::var_builder_in(I2V, "image_encoder/model.safetensors");
    let model = ClipVisionModel::new_penultimate(&cfg, vb).unwrap();
    assert_eq!(model.num_layers(), cfg.num_hidden_layers - 1);
    let r = common::named_reference(I2V, "image_encoder");
    let embeds = model.last_hidden_state(&r["pixel_values"]).unwrap();
    eprintln!(
        "image_embeds: max |diff| {:e}",
        common::max_abs_diff(&embeds, &r["image_embeds"])
    );
    common::assert_close("image_embeds", &embeds, &r["image_embeds"], ATOL, RTOL);
    // The partial tower has no post_layernorm.
    assert!(model.pooled_output(&embeds).is_err());
    assert!(ClipVisionModel::new_up_to_layer(
        &cfg,
        cfg.num_hidden_layers + 1,
        common::var_builder_in(I2V, "image_encoder/model.safetensors")
    )
    .is_err());
}

#[test]
fn image_processor_matches_pil_backend() {
    let cfg: ClipImageProcessorConfig =
        common::config_in(I2V, "image_processor/preprocessor_config.json");
    let processor = ClipImageProcessor::new(&cfg).unwrap();
    let img = load_rgb_image(&common::named_fixture_dir(I2V).join("reference/input.png")).unwrap();
    let pixels = processor.preprocess(&img, &Device::Cpu).unwrap();
    let r = common::named_reference(I2V, "image_encoder");
    let diff = common::max_abs_diff(&pixels, &r["pixel_values"]);
    eprintln!("pixel_values: max |diff| {diff:e}");
    common::assert_close("pixel_values", &pixels, &r["pixel_values"], 1e-6, 0.0);
}

#[test]
fn image_from_processor_to_embeds() {
    let cfg: ClipImageProcessorConfig =
        common::config_in(I2V, "image_processor/preprocessor_config.json");
    let img = load_rgb_image(&common::named_fixture_dir(I2V).join("reference/input.png")).unwrap();
    let pixels = ClipImageProcessor::new(&cfg)
        .unwrap()
        .preprocess(&img, &Device::Cpu)
        .unwrap();
    let vcfg = vision_config();
    let vb = common::var_builder_in(I2V, "image_encoder/model.safetensors");
    let model = ClipVisionModel::new_up_to_layer(&vcfg, vcfg.num_hidden_layers - 1, vb).unwrap();
    let embeds = model.last_hidden_state(&pixels).unwrap();
    let r = common::named_reference(I2V, "image_encoder");
    common::assert_close(
        "image_embeds (from png)",
        &embeds,
        &r["image_embeds"],
        ATOL,
        RTOL,
    );
}

#[test]
fn text_model_matches_transformers() {
    let cfg: ClipTextConfig = common::config_in(HUNYUAN, "text_encoder_2/config.json");
    let vb = common::var_builder_in(HUNYUAN, "text_encoder_2/model.safetensors");
    let model = ClipTextModel::new(&cfg, vb).unwrap();
    let r = common::named_reference(HUNYUAN, "text_encoder");
    let ids = &r["clip.input_ids"];
    assert_eq!(ids.dtype(), DType::I64);
    let out = model.forward(ids).unwrap();
    eprintln!(
        "last_hidden_state: max |diff| {:e}; pooled: {:e}",
        common::max_abs_diff(&out.last_hidden_state, &r["clip.last_hidden_state"]),
        common::max_abs_diff(&out.pooler_output, &r["pooled_prompt_embeds"])
    );
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

#[test]
fn configs_reject_what_cannot_run() {
    let mut cfg = vision_config();
    cfg.num_attention_heads = 3;
    assert!(cfg
        .validate()
        .unwrap_err()
        .to_string()
        .contains("num_attention_heads"));
    let mut cfg = vision_config();
    cfg.patch_size = 0;
    assert!(cfg
        .validate()
        .unwrap_err()
        .to_string()
        .contains("patch_size"));
    let mut cfg: ClipTextConfig = common::config_in(HUNYUAN, "text_encoder_2/config.json");
    cfg.hidden_size = 0;
    assert!(cfg.validate().is_err());
    let mut p: ClipImageProcessorConfig =
        common::config_in(I2V, "image_processor/preprocessor_config.json");
    p.resample = 0;
    assert!(p.validate().unwrap_err().to_string().contains("resample"));
}

#[test]
fn jpeg_input_decodes_to_rgb() {
    let png = common::named_fixture_dir(I2V).join("reference/input.png");
    let img = load_rgb_image(&png).unwrap();
    let dir = std::env::temp_dir().join(format!("vidgen-jpeg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let jpeg = dir.join("input.jpg");
    img.save_with_format(&jpeg, image::ImageFormat::Jpeg)
        .unwrap();
    let decoded = load_rgb_image(&jpeg).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(decoded.dimensions(), img.dimensions());
    // Lossy, but the same picture.
    let mean_abs: f64 = img
        .as_raw()
        .iter()
        .zip(decoded.as_raw())
        .map(|(&a, &b)| (a as f64 - b as f64).abs())
        .sum::<f64>()
        / img.as_raw().len() as f64;
    assert!(mean_abs < 12.0, "mean |png - jpeg| = {mean_abs}");
    assert!(load_rgb_image(&dir.join("missing.png"))
        .unwrap_err()
        .to_string()
        .contains("missing.png"));
}

/// The Pillow port against `PIL.Image.resize` (Pillow 13.0.0, tests/fixtures/pil-resize/make.py):
/// up- and downscaling, one axis only, every supported filter, bit-exact.
#[test]
fn resize_is_bit_exact_with_pillow() {
    use vidgen::models::clip::{resize_like_pil, PilFilter};
    let src = load_rgb_image(&common::named_fixture_dir(I2V).join("reference/input.png")).unwrap();
    let dir = common::named_fixture_dir("pil-resize");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("png") {
            continue;
        }
        let stem = path.file_stem().unwrap().to_str().unwrap().to_string();
        let (name, size) = stem.split_once('_').unwrap();
        let (w, h) = size.split_once('x').unwrap();
        let (w, h): (u32, u32) = (w.parse().unwrap(), h.parse().unwrap());
        let filter = match name {
            "lanczos" => PilFilter::Lanczos,
            "bicubic" => PilFilter::Bicubic,
            "bilinear" => PilFilter::Bilinear,
            "box" => PilFilter::Box,
            "hamming" => PilFilter::Hamming,
            other => panic!("unknown filter {other}"),
        };
        let want = load_rgb_image(&path).unwrap();
        let got = resize_like_pil(&src, w, h, filter);
        let differing = got
            .as_raw()
            .iter()
            .zip(want.as_raw())
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(differing, 0, "{stem}: {differing} bytes differ from Pillow");
        checked += 1;
    }
    assert_eq!(checked, 8);
}

/// transformers writes `CLIPTextModel` under `text_model.` (the published HunyuanVideo file;
/// the fixture has no prefix). An engine streaming the layers builds each from only that
/// layer's tensors, so a layer finds its prefix by its own tensors.
#[test]
fn text_layers_load_under_the_text_model_prefix_alone() {
    let cfg: ClipTextConfig = common::config_in(HUNYUAN, "text_encoder_2/config.json");
    let path = common::named_fixture_dir(HUNYUAN).join("text_encoder_2/model.safetensors");
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let whole = ClipTextModel::new(
        &cfg,
        VarBuilder::from_tensors(tensors.clone(), DType::F32, &Device::Cpu),
    )
    .unwrap();
    let layer0: HashMap<String, Tensor> = tensors
        .into_iter()
        .filter(|(name, _)| name.starts_with("encoder.layers.0."))
        .map(|(name, t)| (format!("text_model.{name}"), t))
        .collect();
    let vb = VarBuilder::from_tensors(layer0, DType::F32, &Device::Cpu);
    let streamed = ClipTextModel::layer(&cfg, 0, vb).unwrap();
    let x = Tensor::randn(0f32, 1.0, (1, 7, cfg.hidden_size), &Device::Cpu).unwrap();
    let expected = whole.layers()[0].forward(&x, true).unwrap();
    assert_eq!(
        common::max_abs_diff(&streamed.forward(&x, true).unwrap(), &expected),
        0.0
    );
}
