//! Allegro through the command line, driven as PARITY-CLI.md says: the `allegro-tiny-a`
//! pipeline runs (CFG 7.5 and 1) reproduced from a draws file holding diffusers' initial
//! latents and scheduler noise; offload modes bit-identical to the resident run; the dry run of
//! the fixture and of `synthetic:allegro`; flags and sizes that do not apply refused. Also the
//! components against the fixture's references: the transformer, the tiled VAE decode, the
//! Euler ancestral scheduler and the text encoder.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{
    assert_close, config_in, generate_frames, max_abs_diff, named_fixture_dir, named_reference,
    run_vidgen, scratch_dir, var_builder_in,
};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use vidgen::models::allegro::transformer::{AllegroTransformer3DModel, AllegroTransformerConfig};
use vidgen::models::allegro::vae::{AllegroVaeConfig, AutoencoderKLAllegro};
use vidgen::models::t5::encoder::{T5Config, T5EncoderModel};
use vidgen::models::t5::tokenizer::{clean_caption, PromptTokenizer};
use vidgen::offload::{record, Packing};
use vidgen::schedulers::euler_ancestral::{EulerAncestral, EulerAncestralConfig};

const FIXTURE: &str = "allegro-tiny-a";

fn preset() -> serde_json::Value {
    let path = named_fixture_dir(FIXTURE).join("reference/README.json");
    let readme: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    readme["preset"].clone()
}

/// The draws file of run `run`: diffusers' `latents_init` as `latents` and the run's
/// `stepN.scheduler_noise.0`.
fn draws_file(dir: &Path, run: &str) -> PathBuf {
    let refs = named_reference(FIXTURE, "pipeline");
    let mut draws: HashMap<String, Tensor> =
        [("latents".to_string(), refs["latents_init"].clone())].into();
    let prefix = format!("{run}.");
    for (name, t) in &refs {
        if let Some(rest) = name.strip_prefix(&prefix) {
            if rest.contains(".scheduler_noise.") {
                draws.insert(rest.to_string(), t.clone());
            }
        }
    }
    let path = dir.join(format!("draws-{run}.safetensors"));
    candle_core::safetensors::save(&draws, &path).unwrap();
    path
}

/// The parity command line at guidance `guidance` with `extra` flags (diffusers' call: the
/// pipeline prompt, its negative prompt, 24 frames of 64x64, 3 steps, 16 tokens).
fn args(guidance: &str, extra: &[&str]) -> Vec<String> {
    let preset = preset();
    let index = preset["pipeline_prompt_index"].as_u64().unwrap() as usize;
    let prompt = preset["prompts"][index].as_str().unwrap();
    let negative = preset["negative_prompt"].as_str().unwrap();
    let model = named_fixture_dir(FIXTURE);
    let mut args: Vec<String> = [
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
        "--negative-prompt",
        negative,
        "--height",
        "64",
        "--width",
        "64",
        "--num-frames",
        "24",
        "--num-inference-steps",
        "3",
        "--guidance-scale",
        guidance,
        "--max-sequence-length",
        "16",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn check_run(run: &str, guidance: &str) {
    let dir = scratch_dir("allegro", run);
    let frames = generate_frames(&args(guidance, &[]), &draws_file(&dir, run), &dir).unwrap();
    common::assert_reference_run(FIXTURE, run, &frames, (1e-4, 1e-4));
}

#[test]
fn guided_run_matches_diffusers() {
    check_run("cfg7_5", "7.5");
}

#[test]
fn unguided_run_matches_diffusers() {
    check_run("cfg1", "1");
}

/// Every offload mode gives the resident run's frames, bit for bit; so does a tiled decode
/// asked for (the VAE decodes in tiles either way).
#[test]
fn offload_modes_are_bit_identical_to_resident() {
    let dir = scratch_dir("allegro", "offload");
    let draws = draws_file(&dir, "cfg7_5");
    common::assert_offload_modes_bit_identical(&[(&["--vae-tiling"], "transformer")], |flags| {
        common::generate_frames_logged(&args("7.5", flags), &draws, &dir)
    });
}

/// `--fp8-matmul`: the blocks' attention and feed-forward Linears in e4m3 change the video by
/// about e4m3's precision (measured: 0.39% relative L2), and every offload mode gives the
/// resident fp8 run's frames bit for bit.
#[test]
fn fp8_matmuls_run_in_every_offload_mode() {
    let dir = scratch_dir("allegro", "fp8");
    let draws = draws_file(&dir, "cfg7_5");
    common::assert_fp8_runs(0.01, |flags| {
        common::generate_frames_logged(&args("7.5", flags), &draws, &dir)
    });
}

/// The published call defaults (720x1280, 88 frames, 100 steps, guidance 7.5, 512 tokens) and
/// the plan's stages, for the fixture and `synthetic:allegro`.
#[test]
fn dry_run_plans_the_fixture_and_the_published_model() {
    let fixture = named_fixture_dir(FIXTURE);
    let plan = common::dry_run_plan(fixture.to_str().unwrap(), &["--device", "cpu"]);
    // The fixture's transformer: sample 8 x 8 x 6 latents (x8 = 64, x4 = 24).
    common::assert_planned_call(&plan, &json!({"height": 64, "num_frames": 24}));
    for extra in [&["--device", "cpu"][..], common::STREAMED_BF16] {
        let plan = common::dry_run_plan("synthetic:allegro", extra);
        common::assert_planned_call(
            &plan,
            &json!({"height": 720, "width": 1280, "num_frames": 88, "num_inference_steps": 100,
                "guidance_scale": 7.5, "max_sequence_length": 512}),
        );
        let model = &plan["model"];
        assert_eq!(model["transformer_layers"], 32, "{plan}");
        assert_eq!(model["latent_shape"], json!([1, 4, 22, 90, 160]), "{plan}");
        assert_eq!(model["vae_tiles"], json!([5, 3, 5]), "{plan}");
    }
}

/// Flags of other families, and sizes the tiled VAE cannot decode, are refused in one line
/// (exit 2), in a dry run too.
#[test]
fn flags_and_sizes_that_do_not_apply_are_refused() {
    let dir = scratch_dir("allegro", "refused");
    let fixture = named_fixture_dir(FIXTURE);
    let image = dir.join("x.png");
    let other_family = "does not apply to Allegro";
    let cases: &[(&[&str], &str)] = &[
        (&["--image", image.to_str().unwrap()], other_family),
        (&["--lora", "x.safetensors"], other_family),
        (&["--true-cfg-scale", "3"], other_family),
        (&["--flow-shift", "3"], other_family),
        (&["--scheduler", "euler"], other_family),
        (
            &["--num-frames", "16"],
            "4 latent frames are fewer than a VAE tile's 6",
        ),
        (
            &["--height", "48"],
            "6 latent rows are fewer than a VAE tile's 8",
        ),
        (&["--height", "80"], "10 latent rows fit no VAE tile of 8"),
        (&["--width", "40"], "multiple of 16"),
    ];
    for (flags, why) in cases {
        common::assert_refused(&fixture, &dir, flags, &[why]);
    }
}

/// The transformer on the fixture's inputs at t = 937.5 and 999.
#[test]
fn transformer_matches_diffusers() {
    let r = named_reference(FIXTURE, "transformer");
    let cfg: AllegroTransformerConfig = config_in(FIXTURE, "transformer/config.json");
    let vb = var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
    let model = AllegroTransformer3DModel::new(&cfg, vb).unwrap();
    for (t, out) in [("timestep", "output"), ("timestep_999", "output_t999")] {
        let got = model
            .forward(
                &r["hidden_states"],
                &r[t],
                &r["encoder_hidden_states"],
                &r["encoder_attention_mask"],
            )
            .unwrap();
        eprintln!("{out}: max |diff| {:.3e}", max_abs_diff(&got, &r[out]));
        assert_close(out, &got, &r[out], 1e-4, 1e-4);
    }
}

/// One tile of the VAE decode: `1 / scaling_factor · z`, then the decoder.
#[test]
fn vae_decode_matches_diffusers() {
    let r = named_reference(FIXTURE, "vae");
    let cfg: AllegroVaeConfig = config_in(FIXTURE, "vae/config.json");
    let vb = var_builder_in(FIXTURE, "vae/diffusion_pytorch_model.safetensors");
    let vae = AutoencoderKLAllegro::new(&cfg, vb).unwrap();
    let scaled = vae.unscale(&r["decode.latents"]).unwrap();
    assert_close(
        "decode.latents_scaled",
        &scaled,
        &r["decode.latents_scaled"],
        1e-6,
        1e-6,
    );
    // diffusers returns [B, T, C, H, W]; ours is [B, C, T, H, W].
    let video = vae
        .decode(&scaled)
        .unwrap()
        .permute((0, 2, 1, 3, 4))
        .unwrap();
    eprintln!(
        "decode.video: max |diff| {:.3e}",
        max_abs_diff(&video, &r["decode.video"])
    );
    assert_close("decode.video", &video, &r["decode.video"], 1e-4, 1e-4);
}

/// The schedules of 3, 4, 7 and 100 steps, `init_noise_sigma`, and the 4-step loop driven by
/// the stored model outputs and draws (its `sample_0` is the draw before `× init_noise_sigma`).
#[test]
fn scheduler_matches_diffusers() {
    let r = named_reference(FIXTURE, "scheduler");
    let cfg: EulerAncestralConfig = config_in(FIXTURE, "scheduler/scheduler_config.json");
    let alphas = Tensor::new(cfg.alphas_cumprod(), &Device::Cpu).unwrap();
    assert_eq!(max_abs_diff(&alphas, &r["alphas_cumprod"]), 0.0);
    for n in [3, 4, 7, 100] {
        let s = EulerAncestral::new(&cfg, n).unwrap();
        let timesteps = Tensor::new(s.timesteps(), &Device::Cpu).unwrap();
        assert_eq!(max_abs_diff(&timesteps, &r[&format!("timesteps_{n}")]), 0.0);
        let sigmas = Tensor::new(s.sigmas(), &Device::Cpu).unwrap();
        assert_close(
            &format!("sigmas_{n}"),
            &sigmas,
            &r[&format!("sigmas_{n}")],
            0.0,
            1e-6,
        );
    }
    let s = EulerAncestral::new(&cfg, 4).unwrap();
    let init = Tensor::new(&[s.init_noise_sigma()], &Device::Cpu).unwrap();
    assert_close(
        "init_noise_sigma",
        &init,
        &r["loop4.init_noise_sigma"],
        0.0,
        1e-6,
    );
    for i in 0..4 {
        let sample = &r[&format!("loop4.sample_{i}")];
        let sample = match i {
            0 => sample.affine(f64::from(s.init_noise_sigma()), 0.0).unwrap(),
            _ => sample.clone(),
        };
        let sample = &sample;
        let scaled = s.scale_model_input(sample, i).unwrap();
        assert_close(
            &format!("scaled_input_{i}"),
            &scaled,
            &r[&format!("loop4.scaled_input_{i}")],
            1e-5,
            1e-5,
        );
        let next = s
            .step(
                &r[&format!("loop4.model_output_{i}")],
                sample,
                &r[&format!("loop4.noise_{i}")],
                i,
            )
            .unwrap();
        let expected = &r[&format!("loop4.sample_{}", i + 1)];
        eprintln!(
            "sample_{}: max |diff| {:.3e}",
            i + 1,
            max_abs_diff(&next, expected)
        );
        assert_close(&format!("sample_{}", i + 1), &next, expected, 1e-4, 1e-4);
    }
}

/// The prompts lower-cased and stripped, tokenized to 16 ids with their mask, and T5's
/// `last_hidden_state` with that mask (pad rows not zeroed).
#[test]
fn text_encoder_matches_diffusers() {
    let r = named_reference(FIXTURE, "text_encoder");
    let tokenizer =
        PromptTokenizer::from_file(&named_fixture_dir(FIXTURE).join("tokenizer/tokenizer.json"))
            .unwrap();
    let preset = preset();
    let prompts = preset["prompts"].as_array().unwrap();
    let ids = r["input_ids"].to_vec2::<i64>().unwrap();
    let mask = r["attention_mask"].to_vec2::<i64>().unwrap();
    let cfg: T5Config = config_in(FIXTURE, "text_encoder/config.json");
    let encoder = T5EncoderModel::new(
        &cfg,
        var_builder_in(FIXTURE, "text_encoder/model.safetensors"),
    )
    .unwrap();
    for (k, prompt) in prompts.iter().enumerate() {
        let (got, len) = tokenizer
            .encode(&clean_caption(prompt.as_str().unwrap()), 16)
            .unwrap();
        let keep: Vec<u32> = (0..16).map(|i| u32::from(i < len)).collect();
        let states = encoder
            .forward(
                &Tensor::new(got.as_slice(), &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap(),
                &Tensor::new(keep.as_slice(), &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap(),
            )
            .unwrap();
        let got: Vec<i64> = got.into_iter().map(i64::from).collect();
        assert_eq!(got, ids[k], "prompt {k}");
        assert_eq!(len as i64, mask[k].iter().sum::<i64>(), "prompt {k}");
        let expected = r["last_hidden_state"].narrow(0, k, 1).unwrap();
        eprintln!(
            "prompt {k}: max |diff| {:.3e}",
            max_abs_diff(&states, &expected)
        );
        assert_close(&format!("prompt {k}"), &states, &expected, 1e-4, 1e-4);
    }
}

/// Without `--latents` the seed draws the latents and every step's noise: the same seed writes
/// the same video, another seed another one.
#[test]
fn a_run_from_the_seed_is_reproducible() {
    let dir = scratch_dir("allegro", "seed");
    let fixture = named_fixture_dir(FIXTURE);
    let run = |name: &str, seed: &str| {
        let args: Vec<String> = [
            "generate",
            "--model",
            fixture.to_str().unwrap(),
            "--prompt",
            "a red car",
            "--num-inference-steps",
            "2",
            "--max-sequence-length",
            "16",
            "--seed",
            seed,
            "--device",
            "cpu",
            "--output-type",
            "safetensors",
            "--output-path",
            dir.to_str().unwrap(),
            "--output-video-name",
            name,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let out = run_vidgen(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = dir.join(format!("{name}.safetensors"));
        candle_core::safetensors::load(path, &Device::Cpu).unwrap()["frames"].clone()
    };
    let (a, b, c) = (run("a", "7"), run("b", "7"), run("c", "8"));
    assert_eq!(a.dims(), [24, 64, 64, 3]);
    assert_eq!(max_abs_diff(&a, &b), 0.0);
    assert!(max_abs_diff(&a, &c) > 1e-3);
}

/// A draws file without a step's scheduler noise, or with a tensor the run never takes, is bad
/// input named in one line (exit 2) before anything loads.
#[test]
fn a_draws_file_that_does_not_fit_is_refused() {
    let dir = scratch_dir("allegro", "draws");
    let refs = named_reference(FIXTURE, "pipeline");
    let latents = refs["latents_init"].clone();
    let noise = refs["cfg7_5.step0.scheduler_noise.0"].clone();
    // (file, the steps whose noise it holds, the draw the refusal names)
    let cases = [
        ("missing", 0..1, "step1.scheduler_noise.0"),
        ("extra", 0..4, "step3.scheduler_noise.0"),
    ];
    for (name, steps, why) in cases {
        let mut draws: HashMap<String, Tensor> = [("latents".to_string(), latents.clone())].into();
        for i in steps {
            draws.insert(format!("step{i}.scheduler_noise.0"), noise.clone());
        }
        let path = dir.join(format!("{name}.safetensors"));
        candle_core::safetensors::save(&draws, &path).unwrap();
        let err = generate_frames(&args("7.5", &[]), &path, &dir).unwrap_err();
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert_eq!(errors.len(), 1, "{name}: {err}");
        assert!(errors[0].contains(why), "{name}: {err}");
    }
}

/// A shipped published config (`assets/allegro/...`).
fn published_config<T: serde::de::DeserializeOwned>(relative: &str) -> T {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("assets/allegro")
        .join(relative);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// rhymes-ai/Allegro's state dict `name` (recorded on the meta device) as name -> shape.
fn published_tensors(name: &str) -> BTreeMap<String, Vec<usize>> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/seed-rest-configs.json");
    let all: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    serde_json::from_value(all["state_dicts"][name]["tensors"].clone()).unwrap()
}

/// What `build` asks for at the published sizes, without weights, as name -> shape; every
/// name is published with that shape, and the published names not asked for are `unused`.
fn asks_for_the_published<B>(
    build: impl FnOnce(candle_nn::VarBuilder<'static>) -> candle_core::Result<B>,
    published: &BTreeMap<String, Vec<usize>>,
    unused: impl Fn(&str) -> bool,
) {
    let asked: BTreeMap<String, Vec<usize>> = record(None, DType::BF16, Packing::ByDtype, build)
        .unwrap()
        .slots
        .into_iter()
        .map(|slot| (slot.name, slot.shape.dims().to_vec()))
        .collect();
    for (name, shape) in &asked {
        assert_eq!(published.get(name), Some(shape), "{name}");
    }
    for name in published.keys() {
        assert_eq!(asked.contains_key(name), !unused(name), "{name}");
    }
}

/// The transformer and the VAE decoder built from the shipped configs ask for exactly
/// rhymes-ai/Allegro's tensors (the encoder side of the VAE aside: text-to-video only decodes).
#[test]
fn published_configs_ask_for_the_published_tensors() {
    let cfg: AllegroTransformerConfig = published_config("transformer/config.json");
    asks_for_the_published(
        |vb| AllegroTransformer3DModel::new(&cfg, vb),
        &published_tensors("Allegro transformer"),
        |_| false,
    );
    let cfg: AllegroVaeConfig = published_config("vae/config.json");
    asks_for_the_published(
        |vb| AutoencoderKLAllegro::new(&cfg, vb),
        &published_tensors("Allegro VAE"),
        |name| name.starts_with("encoder.") || name.starts_with("quant_conv."),
    );
}
