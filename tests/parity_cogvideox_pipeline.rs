//! The CogVideoX components chained as `CogVideoXPipeline.__call__` chains them, against the
//! `cogvideox-tiny-a` pipeline run (the T5 stage replaced by the stored prompt embeddings):
//! transformer -> guidance -> DPM step -> 1/scaling_factor -> frame-batched decode -> frames.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use vidgen::models::cogvideox::guidance;
use vidgen::models::cogvideox::transformer::{
    CogVideoXTransformer3DModel, CogVideoXTransformerConfig,
};
use vidgen::models::cogvideox::vae::{AutoencoderKLCogVideoX, CogVideoXVaeConfig};
use vidgen::schedulers::cogvideox::{CogVideoXSampler, CogVideoXSchedulerConfig};

const FIXTURE: &str = "cogvideox-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;
const STEPS: usize = 3;

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, ATOL, RTOL);
}

fn var_builder(component: &str) -> VarBuilder<'static> {
    let path = common::named_fixture_dir(FIXTURE)
        .join(component)
        .join("diffusion_pytorch_model.safetensors");
    unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu).unwrap() }
}

fn read_config<T: serde::de::DeserializeOwned>(component: &str, file: &str) -> T {
    let path = common::named_fixture_dir(FIXTURE)
        .join(component)
        .join(file);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn scheduler() -> CogVideoXSampler {
    let cfg = CogVideoXSchedulerConfig::from_file(
        common::named_fixture_dir(FIXTURE).join("scheduler/scheduler_config.json"),
    )
    .unwrap();
    CogVideoXSampler::new(&cfg, STEPS).unwrap()
}

/// The step's last stored draw (the one that enters the result), after checking the count.
fn step_noise(r: &HashMap<String, Tensor>, prefix: &str, draws: usize) -> Tensor {
    let stored: Vec<&Tensor> = (0..)
        .map_while(|k| r.get(&format!("{prefix}.scheduler_noise.{k}")))
        .collect();
    assert_eq!(stored.len(), draws, "{prefix}: draws");
    stored[draws - 1].clone()
}

/// Decode as `decode_latents` + `postprocess_video(output_type="np")` (before the uint8 step).
fn decode_and_check(run: &str, latents: &Tensor, r: &HashMap<String, Tensor>) {
    let vae = AutoencoderKLCogVideoX::new_decoder_only(
        &read_config::<CogVideoXVaeConfig>("vae", "config.json"),
        var_builder("vae"),
    )
    .unwrap();
    let z = vae.scale_latents(latents).unwrap();
    check(
        &format!("{run}.vae_decode_input"),
        &z,
        &r[&format!("{run}.vae_decode_input")],
    );
    let video = vae.decode(&z).unwrap();
    let frames = ((video / 2.0).unwrap() + 0.5)
        .unwrap()
        .clamp(0f32, 1f32)
        .unwrap()
        .permute((0, 2, 3, 4, 1))
        .unwrap();
    check(
        &format!("{run}.frames"),
        &frames,
        &r[&format!("{run}.frames")],
    );
}

#[test]
fn unguided_run_matches_diffusers() {
    let r = common::named_reference(FIXTURE, "pipeline");
    let text = common::named_reference(FIXTURE, "text_encoder");
    let prompt_embeds = text["prompt_embeds"].narrow(0, 0, 1).unwrap();
    let cfg: CogVideoXTransformerConfig = read_config("transformer", "config.json");
    let model = CogVideoXTransformer3DModel::new(&cfg, var_builder("transformer")).unwrap();
    let mut sched = scheduler();
    let mut latents = r["latents_init"].clone();
    for (i, &t) in sched.timesteps().to_vec().iter().enumerate() {
        let prefix = format!("cfg1.step{i}");
        let timestep = Tensor::new(&[t], &Device::Cpu).unwrap();
        let noise_pred = model.forward(&latents, &timestep, &prompt_embeds).unwrap();
        check(
            &format!("{prefix}.noise_pred_cond"),
            &noise_pred,
            &r[&format!("{prefix}.noise_pred_cond")],
        );
        let noise = step_noise(&r, &prefix, sched.draws_at(i));
        latents = sched.step(&noise_pred, &latents, Some(&noise)).unwrap();
        check(
            &format!("{prefix}.latents"),
            &latents,
            &r[&format!("{prefix}.latents")],
        );
    }
    decode_and_check("cfg1", &latents, &r);
}

#[test]
fn guided_run_matches_diffusers() {
    // The negative prompt's embeddings are not stored: the loop runs on the stored transformer
    // outputs of the batched [negative; positive] call.
    let r = common::named_reference(FIXTURE, "pipeline");
    let mut sched = scheduler();
    let mut latents = r["latents_init"].clone();
    for (i, &t) in sched.timesteps().to_vec().iter().enumerate() {
        let prefix = format!("cfg6.step{i}");
        let scale = guidance::scale_at(6.0, false, t, STEPS);
        let noise_pred = guidance::apply(
            &r[&format!("{prefix}.noise_pred_uncond")],
            &r[&format!("{prefix}.noise_pred_cond")],
            scale,
        )
        .unwrap();
        let noise = step_noise(&r, &prefix, sched.draws_at(i));
        latents = sched.step(&noise_pred, &latents, Some(&noise)).unwrap();
        check(
            &format!("{prefix}.latents"),
            &latents,
            &r[&format!("{prefix}.latents")],
        );
    }
    decode_and_check("cfg6", &latents, &r);
}
