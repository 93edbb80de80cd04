//! Parity of HunyuanVideoPipeline's flow-match Euler schedule (its own sigmas, static shift)
//! and guidance inputs with diffusers on `hunyuanvideo-tiny-a`.

mod common;

use candle_core::{DType, Device, Tensor};
use vidgen::models::hunyuan_video::scheduler::{
    guidance_input, sampler, schedule, uses_true_cfg, FlowMatchEulerConfig,
};
use vidgen::schedulers::Scheduler;

const FIXTURE: &str = "hunyuanvideo-tiny-a";

fn config() -> FlowMatchEulerConfig {
    FlowMatchEulerConfig::from_file(
        common::named_fixture_dir(FIXTURE).join("scheduler/scheduler_config.json"),
    )
    .unwrap()
}

#[test]
fn schedules_match_diffusers() {
    let cfg = config();
    assert_eq!(cfg.shift, 7.0);
    let r = common::named_reference(FIXTURE, "scheduler");
    for n in [3usize, 4, 7, 50] {
        let (timesteps, sigmas) = schedule(&cfg, n, None).unwrap();
        let want_t: Vec<f32> = r[&format!("timesteps_{n}")].to_vec1().unwrap();
        let want_s: Vec<f32> = r[&format!("sigmas_{n}")].to_vec1().unwrap();
        assert_eq!(timesteps.len(), want_t.len());
        assert_eq!(sigmas.len(), want_s.len());
        for (got, want) in timesteps.iter().zip(&want_t) {
            let tol = 1e-6 * f64::from(want.abs()).max(1.0);
            assert!(
                (got - f64::from(*want)).abs() <= tol,
                "n={n}: timestep {got} vs {want}"
            );
        }
        for (got, want) in sigmas.iter().zip(&want_s) {
            let tol = 1e-6 * f64::from(want.abs()).max(1.0);
            assert!(
                f64::from(got - want).abs() <= tol,
                "n={n}: sigma {got} vs {want}"
            );
        }
    }
}

#[test]
fn euler_loop_matches_diffusers() {
    let r = common::named_reference(FIXTURE, "scheduler");
    let mut euler = sampler(&config(), 4, None, None).unwrap();
    let mut sample = r["loop4.sample_0"].clone();
    for i in 0..4 {
        sample = euler
            .step(&r[&format!("loop4.model_output_{i}")], &sample)
            .unwrap();
        let want = &r[&format!("loop4.sample_{}", i + 1)];
        common::assert_close(
            &format!("loop4.sample_{}", i + 1),
            &sample,
            want,
            1e-4,
            1e-4,
        );
    }
    assert!(euler.step(&r["loop4.model_output_3"], &sample).is_err());
}

#[test]
fn guidance_inputs_match_the_pipeline() {
    let r = common::named_reference(FIXTURE, "pipeline");
    let g = guidance_input(6.0, 1, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(
        g.to_vec1::<f32>().unwrap(),
        r["cfg1.guidance"].to_vec1::<f32>().unwrap()
    );
    assert_eq!(
        g.to_vec1::<f32>().unwrap(),
        r["truecfg4.guidance"].to_vec1::<f32>().unwrap()
    );
    // bf16 rounds 6000 to 6016, as torch does.
    let g16 = guidance_input(6.0, 2, DType::BF16, &Device::Cpu).unwrap();
    assert_eq!(
        g16.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
        vec![6016.0, 6016.0]
    );
    assert!(uses_true_cfg(4.0, true));
    assert!(!uses_true_cfg(1.0, true));
    assert!(!uses_true_cfg(4.0, false));

    // True CFG then one Euler step reproduces the pipeline's step-0 latents.
    let cond = &r["truecfg4.step0.noise_pred_cond"];
    let uncond = &r["truecfg4.step0.noise_pred_uncond"];
    let noise = vidgen::models::guidance::guide(uncond, cond, 4.0).unwrap();
    let mut euler = sampler(&config(), 3, None, None).unwrap();
    let t0 = euler.timesteps()[0] as f32;
    assert_eq!(
        t0,
        r["truecfg4.step0.timestep"].to_vec1::<f32>().unwrap()[0]
    );
    let latents: Tensor = euler.step(&noise, &r["latents_init"]).unwrap();
    common::assert_close(
        "truecfg4.step0.latents",
        &latents,
        &r["truecfg4.step0.latents"],
        1e-4,
        1e-4,
    );
}

#[test]
fn hostile_configs_are_refused_with_the_key() {
    for (key, cfg) in [
        (
            "shift",
            FlowMatchEulerConfig {
                shift: -1.0,
                ..config()
            },
        ),
        (
            "use_dynamic_shifting",
            FlowMatchEulerConfig {
                use_dynamic_shifting: true,
                ..config()
            },
        ),
        (
            "num_train_timesteps",
            FlowMatchEulerConfig {
                num_train_timesteps: 0,
                ..config()
            },
        ),
    ] {
        let err = schedule(&cfg, 3, None).unwrap_err().to_string();
        assert!(err.contains(key), "{key}: {err}");
    }
    assert!(schedule(&config(), 0, None).is_err());
}
