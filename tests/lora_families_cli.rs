//! LoRAs in the layouts the community shares for the families beyond Wan, as diffusers'
//! `load_lora_weights` reads them: FLUX.1's kohya (sd-scripts), ComfyUI and XLabs files, whose fused `qkv` and
//! single-block `linear1` modules are split into q, k, v (and the MLP's input) and whose modules
//! outside the blocks diffusers' conversion leaves out; HunyuanVideo's original module names
//! with PEFT halves, outside modules mapped and the output norm's modulation swapped in both
//! halves, as diffusers swaps it. Driven by `lora-families/README.json`: the frames within
//! 1e-4 + 1e-4|ref| of diffusers' at each scale, the same draws as the fixture's call; the
//! left-out modules named in one line.

mod common;

use candle_core::Device;
use common::{check_reference_frames, named_fixture_dir, references, scratch_dir};

#[test]
fn community_loras_make_what_diffusers_makes_of_them() {
    let (readme, refs) = references("lora-families", "reference.safetensors");
    let dir = named_fixture_dir("lora-families");
    let cases = readme["cli_cases"].as_array().unwrap();
    for case in cases {
        let lora = dir.join(case["lora"].as_str().unwrap());
        let spec = format!("{}:{}", lora.display(), case["scale"].as_f64().unwrap());
        let extra = ["--lora".to_string(), spec];
        check_reference_frames(case, &refs, &extra, ("lora-families", "no_lora_frames"));
    }
    assert_eq!(cases.len(), 16);
}

/// `vidgen generate --dry-run` of `fixture` with `--lora LORA`, writing into `out`.
fn dry_run(fixture: &str, lora: &std::path::Path, out: &std::path::Path) -> std::process::Output {
    let mut args = common::cpu_prompt_args(fixture);
    args.extend(
        [
            "--lora",
            lora.to_str().unwrap(),
            "--dry-run",
            "--output-path",
            out.to_str().unwrap(),
        ]
        .map(String::from),
    );
    common::run_vidgen(&args)
}

/// The kohya modules outside FLUX.1's blocks are named as left out, in one line; a LoRA layout
/// vidgen does not map for the model, a part it does not read, or a FLUX.1 Control LoRA (for
/// another pipeline) is refused in one line before any work.
#[test]
fn left_out_modules_are_named_and_unmapped_layouts_refused() {
    let dir = named_fixture_dir("lora-families");
    let out = scratch_dir("lora-families", "notice");
    let lora = dir.join("flux-kohya.safetensors");
    let run = dry_run("flux-tiny-a", &lora, &out);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let notice: Vec<_> = stderr.lines().filter(|l| l.contains("left out")).collect();
    assert_eq!(notice.len(), 1, "{stderr}");
    for module in [
        "img_in",
        "time_in_in_layer",
        "final_layer_linear",
        "final_layer_adaLN_modulation_1",
    ] {
        assert!(notice[0].contains(module), "{}", notice[0]);
    }
    // A kohya file for a model whose original layout vidgen does not map for LoRAs (Mochi-1),
    // and a ComfyUI FLUX.1 file with a full delta (diffusers' conversion drops them): refused.
    let mut args = common::cpu_prompt_args("mochi-tiny-a");
    args.extend(["--lora", lora.to_str().unwrap()].map(String::from));
    let line = common::usage_error(&common::run_vidgen(&args), "kohya for Mochi-1");
    assert!(
        line.contains("kohya/musubi layout LoRA, which vidgen maps for"),
        "{line}"
    );
    // Wan's original names with PEFT halves, which diffusers' FLUX.1 loader does not convert.
    let wan = named_fixture_dir("wan-loras").join("wan-original-peft.safetensors");
    let mut args = common::cpu_prompt_args("flux-tiny-a");
    args.extend(["--lora", wan.to_str().unwrap()].map(String::from));
    let line = common::usage_error(&common::run_vidgen(&args), "PEFT halves for FLUX.1");
    assert!(
        line.contains("ComfyUI/original with PEFT halves layout LoRA, which vidgen maps for the Wan family only"),
        "{line}"
    );
    // BFL's Control LoRAs, for FluxControlPipeline's control image.
    let control = out.join("control.safetensors");
    let zeros = |dims: &[usize]| {
        candle_core::Tensor::zeros(dims, candle_core::DType::F32, &Device::Cpu).unwrap()
    };
    let tensors = [
        (
            "double_blocks.0.img_attn.norm.query_norm.scale",
            zeros(&[16]),
        ),
        ("img_in.lora_A.weight", zeros(&[4, 128])),
        ("img_in.lora_B.weight", zeros(&[32, 4])),
    ];
    let tensors = tensors.map(|(k, t)| (k.to_string(), t));
    candle_core::safetensors::save(&std::collections::HashMap::from(tensors), &control).unwrap();
    let mut args = common::cpu_prompt_args("flux-tiny-a");
    args.extend(["--lora", control.to_str().unwrap()].map(String::from));
    let line = common::usage_error(&common::run_vidgen(&args), "a Control LoRA");
    assert!(line.contains("a FLUX.1 Control LoRA"), "{line}");
    let diff = out.join("diff.safetensors");
    let delta =
        candle_core::Tensor::zeros((32, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
    let key = "diffusion_model.double_blocks.0.img_attn.proj.diff".to_string();
    candle_core::safetensors::save(&std::collections::HashMap::from([(key, delta)]), &diff)
        .unwrap();
    let mut args = common::cpu_prompt_args("flux-tiny-a");
    args.extend(["--lora", diff.to_str().unwrap()].map(String::from));
    let line = common::usage_error(&common::run_vidgen(&args), "ComfyUI delta");
    assert!(line.contains("a full delta of a FLUX.1 LoRA"), "{line}");
}

/// A FLUX.1 file's T5 modules (ComfyUI's `text_encoders.t5xxl.transformer.`) are named as left
/// out, in one line, as diffusers drops them; text-encoder keys for a model whose diffusers loader
/// reads none (Wan), and a CLIP key that names no Linear of its encoder layers, are refused in
/// one line before any work.
#[test]
fn text_encoder_keys_are_read_for_flux_alone() {
    let dir = named_fixture_dir("lora-families");
    let out = scratch_dir("lora-families", "text-encoder");
    let run = dry_run(
        "flux-tiny-a",
        &dir.join("flux-comfyui-te.safetensors"),
        &out,
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let notice: Vec<_> = stderr.lines().filter(|l| l.contains("left out")).collect();
    assert_eq!(notice.len(), 1, "{stderr}");
    assert!(
        notice[0].contains("1 T5 text-encoder modules (encoder.block.0.layer.0.SelfAttention.q)"),
        "{}",
        notice[0]
    );
    let line = common::usage_error(
        &dry_run("wan-tiny-a", &dir.join("flux-peft-te.safetensors"), &out),
        "CLIP keys for Wan",
    );
    assert!(
        line.contains(
            "a text encoder's module, which diffusers' LoRA loader for this model does not read"
        ),
        "{line}"
    );
    let stray = out.join("stray.safetensors");
    let factor =
        candle_core::Tensor::zeros((4, 24), candle_core::DType::F32, &Device::Cpu).unwrap();
    let stem = "lora_te1_text_model_embeddings_token_embedding";
    candle_core::safetensors::save(
        &std::collections::HashMap::from([
            (format!("{stem}.lora_down.weight"), factor.clone()),
            (format!("{stem}.lora_up.weight"), factor.t().unwrap()),
        ]),
        &stray,
    )
    .unwrap();
    let line = common::usage_error(&dry_run("flux-tiny-a", &stray, &out), "a CLIP embedding");
    assert!(
        line.contains("names no Linear of CLIP's encoder layers")
            && line.contains("kohya/musubi layout"),
        "{line}"
    );
}
