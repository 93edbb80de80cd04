//! Parity of `LattePipeline`'s denoising loop with diffusers on the `latte-tiny-a` references,
//! component by component: each step's timestep, both halves of the batched transformer
//! output (all 2C channels), the DDIM step's latents and the VAE's input, at CFG 7.5 and 1.

mod common;

use candle_core::{DType, Tensor};
use std::collections::HashMap;
use vidgen::models::autoencoder_kl::{AutoencoderKL, AutoencoderKLConfig};
use vidgen::models::guidance::guide_batched;
use vidgen::models::latte::transformer::LatteTransformer3DModel;
use vidgen::schedulers::ddim::{DdimConfig, DdimScheduler};

const FIXTURE: &str = "latte-tiny-a";

fn check(what: &str, actual: &Tensor, expected: &Tensor, atol: f64) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, atol, 1e-4);
}

/// The README's bar for the latents DDIM amplifies: 3e-4 of the tensor's largest value.
fn latents_atol(t: &Tensor) -> f64 {
    3e-4 * f64::from(
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
    )
}

fn run(run: &str, guidance: f64) {
    let r: HashMap<String, Tensor> = common::named_reference(FIXTURE, "pipeline");
    let text = common::named_reference(FIXTURE, "text_encoder");
    let model = LatteTransformer3DModel::new(
        &common::config_in(FIXTURE, "transformer/config.json"),
        common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let cfg: DdimConfig = common::config_in(FIXTURE, "scheduler/scheduler_config.json");
    let scheduler = DdimScheduler::new(&cfg, 3).unwrap();
    let guided = guidance > 1.0;
    let cond = &text["pipeline.prompt_embeds"];
    let embeds = if guided {
        Tensor::cat(&[&text["pipeline.negative_prompt_embeds"], cond], 0).unwrap()
    } else {
        cond.clone()
    };
    let mut latents = r["latents_init"].clone();
    let channels = latents.dim(1).unwrap();
    for (i, &t) in scheduler.timesteps().iter().enumerate() {
        let step = format!("{run}.step{i}");
        let want_t = r[&format!("{step}.timestep")].to_vec1::<i64>().unwrap();
        assert!(
            want_t.iter().all(|&w| w == t),
            "{step}.timestep {want_t:?} vs {t}"
        );
        let input = if guided {
            Tensor::cat(&[&latents, &latents], 0).unwrap()
        } else {
            latents.clone()
        };
        let timestep = Tensor::new(&[t], input.device()).unwrap();
        let out = model.forward(&input, &timestep, &embeds).unwrap();
        let cond_out = out.narrow(0, out.dim(0).unwrap() - 1, 1).unwrap();
        check(
            &format!("{step}.noise_pred_cond"),
            &cond_out,
            &r[&format!("{step}.noise_pred_cond")],
            1e-4,
        );
        let noise_pred = if guided {
            check(
                &format!("{step}.noise_pred_uncond"),
                &out.narrow(0, 0, 1).unwrap(),
                &r[&format!("{step}.noise_pred_uncond")],
                1e-4,
            );
            guide_batched(&out, guidance).unwrap()
        } else {
            out
        };
        latents = scheduler
            .step(&noise_pred.narrow(1, 0, channels).unwrap(), t, &latents)
            .unwrap();
        let want = &r[&format!("{step}.latents")];
        check(
            &format!("{step}.latents"),
            &latents,
            want,
            latents_atol(want),
        );
    }
    let vae_cfg: AutoencoderKLConfig = common::config_in(FIXTURE, "vae/config.json");
    let vae = AutoencoderKL::new_decoder_only(
        &vae_cfg,
        common::var_builder_in(FIXTURE, "vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let frames = latents.squeeze(0).unwrap().permute((1, 0, 2, 3)).unwrap();
    let input = vae.unscale_by_reciprocal(&frames).unwrap();
    let want = &r[&format!("{run}.vae_decode_input")];
    check(
        &format!("{run}.vae_decode_input"),
        &input.to_dtype(DType::F32).unwrap(),
        want,
        latents_atol(want),
    );
}

#[test]
fn guided_loop_matches_diffusers() {
    run("cfg7_5", 7.5);
}

#[test]
fn unguided_loop_matches_diffusers() {
    run("cfg1", 1.0);
}
