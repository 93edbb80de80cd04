//! Parity of the CogVideoX samplers and the pipeline's guidance with diffusers: on the
//! `cogvideox-tiny-a` references the schedule, a 4-step `CogVideoXDPMScheduler` loop with its
//! stored draws, and the guided (CFG 6) and unguided denoising loops of the pipeline run; on the
//! `cogvideox-ddim` references a 4-step loop of `CogVideoXDDIMScheduler`, the class the
//! CogVideoX-5b repo ships.

mod common;

use candle_core::{DType, Tensor};
use std::collections::HashMap;
use vidgen::models::cogvideox::guidance;
use vidgen::schedulers::cogvideox::{CogVideoXSampler, CogVideoXSchedulerConfig};

const FIXTURE: &str = "cogvideox-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn config() -> CogVideoXSchedulerConfig {
    CogVideoXSchedulerConfig::from_file(
        common::named_fixture_dir(FIXTURE).join("scheduler/scheduler_config.json"),
    )
    .unwrap()
}

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    eprintln!(
        "{what}: max |diff| {:.3e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, ATOL, RTOL);
}

fn ints(t: &Tensor) -> Vec<i64> {
    t.to_vec1::<i64>().unwrap()
}

/// The stored draws `{prefix}.k` of one step, in order.
fn draws(r: &HashMap<String, Tensor>, prefix: &str) -> Vec<Tensor> {
    (0..)
        .map_while(|k| r.get(&format!("{prefix}.{k}")).cloned())
        .collect()
}

#[test]
fn schedule_matches_diffusers() {
    let cfg = config();
    let r = common::named_reference(FIXTURE, "scheduler");
    let alphas: Vec<f32> = cfg.alphas_cumprod().iter().map(|&a| a as f32).collect();
    let alphas = Tensor::new(alphas, &candle_core::Device::Cpu).unwrap();
    eprintln!(
        "alphas_cumprod: max |diff| {:.3e}",
        common::max_abs_diff(&alphas, &r["alphas_cumprod"])
    );
    common::assert_close("alphas_cumprod", &alphas, &r["alphas_cumprod"], 0.0, 1e-6);
    assert_eq!(cfg.alphas_cumprod()[999], 0.0, "zero terminal SNR");
    for n in [3, 4, 7, 50] {
        let sched = CogVideoXSampler::new(&cfg, n).unwrap();
        assert_eq!(
            sched.timesteps(),
            ints(&r[&format!("timesteps_{n}")]),
            "{n} steps"
        );
    }
    // The DDIM class the 5b repo ships sets the same timesteps from the same config.
    let sched = CogVideoXSampler::new(&ddim(cfg.clone()), 4).unwrap();
    assert_eq!(sched.class(), CogVideoXSampler::DDIM);
    assert_eq!(sched.timesteps(), ints(&r["ddim.timesteps_4"]));
    assert!(CogVideoXSampler::new(&cfg, 0).is_err());
    assert!(CogVideoXSampler::new(&cfg, 1001).is_err());
}

/// Four steps of `sched` through reference `r`'s `loop4` (its stored model outputs, and the
/// draws of each step that `draws_at` names), each step's x0 and sample checked.
fn four_step_loop(mut sched: CogVideoXSampler, r: &HashMap<String, Tensor>) {
    let mut x = r["loop4.sample_0"].clone();
    for i in 0..4 {
        let noise = draws(r, &format!("loop4.noise_{i}"));
        assert_eq!(noise.len(), sched.draws_at(i), "draws of step {i}");
        let model_output = &r[&format!("loop4.model_output_{i}")];
        x = sched.step(model_output, &x, noise.last()).unwrap();
        check(
            &format!("loop4.pred_original_sample_{i}"),
            sched.pred_original_sample().unwrap(),
            &r[&format!("loop4.pred_original_sample_{i}")],
        );
        check(
            &format!("loop4.sample_{}", i + 1),
            &x,
            &r[&format!("loop4.sample_{}", i + 1)],
        );
    }
    let extra = sched.step(&x, &x, Some(&x));
    assert!(extra.is_err(), "a step past the schedule is refused");
}

#[test]
fn four_step_loop_matches_diffusers() {
    let r = common::named_reference(FIXTURE, "scheduler");
    four_step_loop(CogVideoXSampler::new(&config(), 4).unwrap(), &r);
}

/// The tiny fixture's config as the CogVideoX-5b repo names it.
fn ddim(cfg: CogVideoXSchedulerConfig) -> CogVideoXSchedulerConfig {
    CogVideoXSchedulerConfig {
        class_name: CogVideoXSampler::DDIM.into(),
        ..cfg
    }
}

/// The DDIM sampler draws nothing (its reference holds no `loop4.noise_*`).
#[test]
fn ddim_four_step_loop_matches_diffusers() {
    let r = common::named_reference("cogvideox-ddim", "ddim");
    let sched = CogVideoXSampler::new(&ddim(config()), 4).unwrap();
    assert_eq!(sched.timesteps(), ints(&r["loop4.timesteps"]));
    four_step_loop(sched, &r);
}

/// The pipeline's denoising loop on the stored transformer outputs: guidance, then the sampler
/// with the step's last draw.
fn pipeline_loop(run: &str, guidance_scale: f64) {
    let cfg = config();
    let r = common::named_reference(FIXTURE, "pipeline");
    let steps = 3;
    let mut sched = CogVideoXSampler::new(&cfg, steps).unwrap();
    let mut latents = (r["latents_init"].clone() * sched.init_noise_sigma()).unwrap();
    for (i, &t) in sched.timesteps().to_vec().iter().enumerate() {
        let prefix = format!("{run}.step{i}");
        let stored_t = ints(&r[&format!("{prefix}.timestep")]);
        assert!(stored_t.iter().all(|&s| s == t), "timestep of step {i}");
        let cond = r[&format!("{prefix}.noise_pred_cond")]
            .to_dtype(DType::F32)
            .unwrap();
        let noise_pred = if guidance::is_guided(guidance_scale) {
            let scale = guidance::scale_at(guidance_scale, false, t, steps);
            let uncond = &r[&format!("{prefix}.noise_pred_uncond")];
            guidance::apply(uncond, &cond, scale).unwrap()
        } else {
            cond
        };
        let noise = draws(&r, &format!("{prefix}.scheduler_noise"));
        assert_eq!(noise.len(), sched.draws_at(i), "draws of step {i}");
        latents = sched.step(&noise_pred, &latents, noise.last()).unwrap();
        check(
            &format!("{prefix}.latents"),
            &latents,
            &r[&format!("{prefix}.latents")],
        );
    }
}

#[test]
fn guided_pipeline_loop_matches_diffusers() {
    pipeline_loop("cfg6", 6.0);
}

#[test]
fn unguided_pipeline_loop_matches_diffusers() {
    pipeline_loop("cfg1", 1.0);
}

#[test]
fn hostile_configs_are_refused_with_the_key() {
    let cfg = config();
    let cases = vec![
        (
            CogVideoXSchedulerConfig {
                num_train_timesteps: 0,
                ..cfg.clone()
            },
            "num_train_timesteps",
        ),
        (
            CogVideoXSchedulerConfig {
                beta_schedule: "squaredcos_cap_v2".into(),
                ..cfg.clone()
            },
            "beta_schedule",
        ),
        (
            CogVideoXSchedulerConfig {
                prediction_type: "flow_prediction".into(),
                ..cfg.clone()
            },
            "prediction_type",
        ),
        (
            CogVideoXSchedulerConfig {
                snr_shift_scale: 0.0,
                ..cfg.clone()
            },
            "snr_shift_scale",
        ),
        (
            CogVideoXSchedulerConfig {
                timestep_spacing: "karras".into(),
                ..cfg.clone()
            },
            "timestep_spacing",
        ),
        (
            CogVideoXSchedulerConfig {
                class_name: "DDIMScheduler".into(),
                ..cfg.clone()
            },
            "_class_name",
        ),
    ];
    for (bad, key) in cases {
        let err = CogVideoXSampler::new(&bad, 3).unwrap_err().to_string();
        assert!(err.contains(key), "{key}: {err}");
    }
}
