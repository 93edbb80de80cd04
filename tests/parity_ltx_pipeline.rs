//! LTXPipeline's recipe chained from the LTX components (text encoder, transformer, scheduler,
//! VAE decoder), against `ltx-video-tiny-a/reference/pipeline.safetensors` for the guided
//! (CFG 3, one batched forward over [negative; positive]) and the unguided run. The draws come
//! from the reference: `latents_init`, `<run>.decode_noise`, `<run>.injected_noise.K`.
//! This is the order of stages a pipeline runs; the command-line pipeline lives elsewhere.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::{assert_close, named_fixture_dir, reference_in};
use std::path::{Path, PathBuf};
use vidgen::models::ltx::prompt::prompt_embeds;
use vidgen::models::ltx::transformer::{LtxTransformer3DModel, LtxTransformerConfig};
use vidgen::models::ltx::vae::{add_decode_noise, AutoencoderKLLTXVideo, GivenNoise, LtxVaeConfig};
use vidgen::models::patches::unpatchify;
use vidgen::models::t5::encoder::{T5Config, T5EncoderModel};
use vidgen::models::t5::tokenizer::PromptTokenizer;
use vidgen::schedulers::euler::{FlowMatchEuler, FlowMatchEulerConfig};
use vidgen::schedulers::Scheduler;

const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn dir() -> PathBuf {
    named_fixture_dir("ltx-video-tiny-a")
}

fn json<T: serde::de::DeserializeOwned>(path: &Path) -> T {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn vb(path: PathBuf) -> VarBuilder<'static> {
    unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu) }.unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Runs the pipeline for `run` (`cfg3` or `cfg1`) and checks every recorded stage.
fn run_pipeline(run: &str, guidance_scale: f64) {
    let d = dir();
    let r = reference_in(&d, "pipeline");
    let readme: serde_json::Value = json(&d.join("reference/README.json"));
    let preset = &readme["preset"];
    let (height, width, num_frames) = (
        preset["height"].as_u64().unwrap() as usize,
        preset["width"].as_u64().unwrap() as usize,
        preset["num_frames"].as_u64().unwrap() as usize,
    );
    let max_len = preset["max_sequence_length"].as_u64().unwrap() as usize;
    let frame_rate = preset["frame_rate"].as_f64().unwrap();
    let steps = readme["files"]["pipeline.safetensors"]["inputs"]["num_inference_steps"]
        .as_u64()
        .unwrap() as usize;
    let prompt = preset["prompts"][preset["pipeline_prompt_index"].as_u64().unwrap() as usize]
        .as_str()
        .unwrap();
    let negative = preset["negative_prompt"].as_str().unwrap();
    let (decode_timestep, decode_noise_scale) = (
        preset["decode_timestep"].as_f64().unwrap(),
        preset["decode_noise_scale"].as_f64().unwrap(),
    );

    // 1. Text: T5 without attention mask; the masks go to cross-attention.
    let te_cfg = T5Config::from_file(&d.join("text_encoder/config.json")).unwrap();
    let encoder =
        T5EncoderModel::new(&te_cfg, vb(d.join("text_encoder/model.safetensors"))).unwrap();
    let tokenizer = PromptTokenizer::from_file(&d.join("tokenizer/tokenizer.json")).unwrap();
    let (mut embeds, mut mask) = prompt_embeds(&encoder, &tokenizer, prompt, max_len).unwrap();
    let guided = guidance_scale > 1.0;
    if guided {
        let (neg, neg_mask) = prompt_embeds(&encoder, &tokenizer, negative, max_len).unwrap();
        embeds = Tensor::cat(&[&neg, &embeds], 0).unwrap();
        mask = Tensor::cat(&[&neg_mask, &mask], 0).unwrap();
    }
    drop(encoder);

    // 2. Sizes from the configs.
    let vae_cfg: LtxVaeConfig = json(&d.join("vae/config.json"));
    let (r_t, r_s) = (
        vae_cfg.temporal_compression_ratio(),
        vae_cfg.spatial_compression_ratio(),
    );
    let grid = [(num_frames - 1) / r_t + 1, height / r_s, width / r_s];
    let tr_cfg: LtxTransformerConfig = json(&d.join("transformer/config.json"));
    let transformer = LtxTransformer3DModel::new(
        &tr_cfg,
        vb(d.join("transformer/diffusion_pytorch_model.safetensors")),
    )
    .unwrap();
    let rope_scale = LtxTransformerConfig::rope_interpolation_scale(r_t, r_s, frame_rate);
    let sched_cfg =
        FlowMatchEulerConfig::from_file(d.join("scheduler/scheduler_config.json")).unwrap();
    let mut scheduler =
        FlowMatchEuler::for_sequence_length(&sched_cfg, steps, grid.iter().product()).unwrap();

    // 3. Denoise on packed latents.
    let mut latents = r["latents_init"].clone();
    let timesteps = scheduler.timesteps().to_vec();
    for (i, &t) in timesteps.iter().enumerate() {
        let batch = if guided { 2 } else { 1 };
        let input = Tensor::cat(&vec![&latents; batch], 0).unwrap();
        let timestep = Tensor::full(t as f32, batch, &Device::Cpu).unwrap();
        assert_close(
            &format!("{run}.step{i}.timestep"),
            &timestep,
            &r[&format!("{run}.step{i}.timestep")],
            0.0,
            1e-6,
        );
        let pred = transformer
            .forward(&input, &embeds, &timestep, Some(&mask), grid, rope_scale)
            .unwrap();
        let pred = if guided {
            let uncond = pred.narrow(0, 0, 1).unwrap();
            let cond = pred.narrow(0, 1, 1).unwrap();
            assert_close(
                &format!("{run}.step{i}.noise_pred_uncond"),
                &uncond,
                &r[&format!("{run}.step{i}.noise_pred_uncond")],
                ATOL,
                RTOL,
            );
            assert_close(
                &format!("{run}.step{i}.noise_pred_cond"),
                &cond,
                &r[&format!("{run}.step{i}.noise_pred_cond")],
                ATOL,
                RTOL,
            );
            (&uncond + ((&cond - &uncond).unwrap() * guidance_scale).unwrap()).unwrap()
        } else {
            assert_close(
                &format!("{run}.step{i}.noise_pred_cond"),
                &pred,
                &r[&format!("{run}.step{i}.noise_pred_cond")],
                ATOL,
                RTOL,
            );
            pred
        };
        latents = scheduler.step(&pred, &latents).unwrap();
        let name = format!("{run}.step{i}.latents");
        println!("{name} max |diff| {}", max_diff(&latents, &r[&name]));
        assert_close(&name, &latents, &r[&name], ATOL, RTOL);
    }
    drop(transformer);

    // 4. Decode: unpack, de-normalise, decode noise, timestep-conditioned decoder.
    let vae = AutoencoderKLLTXVideo::new(
        &vae_cfg,
        vb(d.join("vae/diffusion_pytorch_model.safetensors")),
    )
    .unwrap();
    let z = unpatchify(&latents, grid, tr_cfg.patch()).unwrap();
    let z = vae.denormalize(&z).unwrap();
    let z = add_decode_noise(&z, &r[&format!("{run}.decode_noise")], decode_noise_scale).unwrap();
    assert_close(
        &format!("{run}.vae_decode_input"),
        &z,
        &r[&format!("{run}.vae_decode_input")],
        ATOL,
        RTOL,
    );
    let timestep = Tensor::new(&[decode_timestep as f32], &Device::Cpu).unwrap();
    assert_close(
        "vae_decode_timestep",
        &timestep,
        &r[&format!("{run}.vae_decode_timestep")],
        0.0,
        0.0,
    );
    let draws: Vec<Tensor> = (0..)
        .map_while(|k| r.get(&format!("{run}.injected_noise.{k}")).cloned())
        .collect();
    let mut noise = GivenNoise::new(draws);
    let video = vae.decode(&z, Some(&timestep), &mut noise).unwrap();

    // 5. output_type="np": (video / 2 + 0.5).clamp(0, 1) as [B, T, H, W, 3].
    let frames = ((video / 2.0).unwrap() + 0.5)
        .unwrap()
        .clamp(0f32, 1f32)
        .unwrap()
        .permute((0, 2, 3, 4, 1))
        .unwrap();
    let name = format!("{run}.frames");
    println!("{name} max |diff| {}", max_diff(&frames, &r[&name]));
    assert_close(&name, &frames, &r[&name], ATOL, RTOL);
}

#[test]
fn guided_run_matches() {
    run_pipeline("cfg3", 3.0);
}

#[test]
fn unguided_run_matches() {
    run_pipeline("cfg1", 1.0);
}
