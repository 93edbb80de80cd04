//! Scheduler parity against diffusers' UniPCMultistepScheduler (reference/scheduler.safetensors)
//! and the flow-matching Euler rules.

mod common;

use candle_core::{DType, Device, Tensor};
use vidgen::schedulers::{build, SchedulerConfig, SchedulerKind};

fn fixture_config() -> SchedulerConfig {
    SchedulerConfig::from_file(common::fixture_dir().join("scheduler/scheduler_config.json"))
        .expect("scheduler config")
}

#[test]
fn unipc_timesteps_and_sigmas_exact() {
    let r = common::reference("scheduler");
    let cfg = fixture_config();
    for n in [3usize, 4, 7, 50] {
        let s = build(SchedulerKind::UniPc, &cfg, n, None, None).unwrap();
        let want_t = r[&format!("timesteps_{n}")].to_vec1::<i64>().unwrap();
        let got_t: Vec<i64> = s.timesteps().iter().map(|&t| t as i64).collect();
        assert!(
            s.timesteps().iter().all(|t| t.fract() == 0.0),
            "integer timesteps"
        );
        assert_eq!(got_t, want_t, "timesteps_{n}");
        let want_s = r[&format!("sigmas_{n}")].to_vec1::<f32>().unwrap();
        let got_bits: Vec<u32> = s.sigmas().iter().map(|v| v.to_bits()).collect();
        let want_bits: Vec<u32> = want_s.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            got_bits,
            want_bits,
            "sigmas_{n}: {:?} vs {want_s:?}",
            s.sigmas()
        );
    }
}

#[test]
fn unipc_loop_samples() {
    let r = common::reference("scheduler");
    let cfg = fixture_config();
    for n in [4usize, 7] {
        let mut s = build(SchedulerKind::UniPc, &cfg, n, None, None).unwrap();
        let mut sample = r[&format!("loop{n}.sample_0")].clone();
        for i in 0..n {
            let v = &r[&format!("loop{n}.model_output_{i}")];
            sample = s.step(v, &sample).unwrap();
            let want = &r[&format!("loop{n}.sample_{}", i + 1)];
            let diff = sample.sub(want).unwrap().abs().unwrap().max_all().unwrap();
            println!(
                "loop{n} step {i}: max |d| = {}",
                diff.to_scalar::<f32>().unwrap()
            );
            common::assert_close(
                &format!("loop{n}.sample_{}", i + 1),
                &sample,
                want,
                1e-5,
                0.0,
            );
        }
        // The schedule is used up: one more step is an error, not a panic.
        let v = &r[&format!("loop{n}.model_output_0")];
        assert!(s.step(v, &sample).is_err());
    }
}

#[test]
fn unipc_flow_shift_override() {
    // With shift 1 the sigmas are the plain linspace(1, 1/1000, n+1)[:n] (first one nudged by 1e-6).
    let cfg = fixture_config();
    let s = build(SchedulerKind::UniPc, &cfg, 4, Some(1.0), None).unwrap();
    let expected: Vec<f32> = vec![
        (1.0f64 - 1e-6) as f32,
        (1.0f64 + (0.001 - 1.0) / 4.0) as f32,
        (2.0f64 * ((0.001 - 1.0) / 4.0) + 1.0) as f32,
        (3.0f64 * ((0.001 - 1.0) / 4.0) + 1.0) as f32,
        0.0,
    ];
    assert_eq!(s.sigmas(), expected.as_slice());
    assert_eq!(s.timesteps(), &[999.0, 750.0, 500.0, 250.0]);
}

#[test]
fn euler_schedule_and_step() {
    let cfg = fixture_config();
    let shift = 3.0f64;
    let n = 5usize;
    let mut s = build(SchedulerKind::Euler, &cfg, n, Some(shift), None).unwrap();
    let shifted = |x: f64| shift * x / (1.0 + (shift - 1.0) * x);
    // diffusers: sigma_min is the shifted last training sigma (in f32); the inference schedule is
    // the shifted linspace from 1 to it.
    let sigma_min = {
        let s = 1.0f32 / 1000.0;
        f64::from(3.0f32 * s / (1.0 + 2.0f32 * s))
    };
    assert_eq!(s.sigmas().len(), n + 1);
    assert_eq!(s.sigmas()[n], 0.0);
    for i in 0..n {
        let x = 1.0 + (sigma_min - 1.0) * i as f64 / (n - 1) as f64;
        let want = shifted(x);
        let got = f64::from(s.sigmas()[i]);
        assert!((got - want).abs() < 1e-6, "sigma {i}: {got} vs {want}");
        assert_eq!(
            s.timesteps()[i],
            f64::from(s.sigmas()[i] * 1000.0),
            "timestep {i}"
        );
    }
    assert_eq!(s.timesteps()[0], 1000.0);

    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (1, 16, 3, 4, 4), &dev).unwrap();
    let v = Tensor::randn(0f32, 1.0, (1, 16, 3, 4, 4), &dev).unwrap();
    let (s0, s1) = (s.sigmas()[0], s.sigmas()[1]);
    let got = s.step(&v, &x).unwrap();
    let want = (&x + (&v * f64::from(s1 - s0)).unwrap()).unwrap();
    common::assert_close("euler step", &got, &want, 1e-7, 0.0);
    assert_eq!(got.dtype(), DType::F32);
    for _ in 1..n {
        s.step(&v, &x).unwrap();
    }
    assert!(s.step(&v, &x).is_err(), "stepping past the schedule");
}

#[test]
fn unsupported_configs_are_errors() {
    let base = fixture_config();
    let cases: Vec<(&str, SchedulerConfig)> = vec![
        (
            "prediction_type",
            SchedulerConfig {
                prediction_type: "epsilon".into(),
                ..base.clone()
            },
        ),
        (
            "use_flow_sigmas",
            SchedulerConfig {
                use_flow_sigmas: false,
                ..base.clone()
            },
        ),
        (
            "solver_type",
            SchedulerConfig {
                solver_type: "dpm".into(),
                ..base.clone()
            },
        ),
        (
            "final_sigmas_type",
            SchedulerConfig {
                final_sigmas_type: "one".into(),
                ..base.clone()
            },
        ),
        (
            "use_karras_sigmas",
            SchedulerConfig {
                use_karras_sigmas: true,
                ..base.clone()
            },
        ),
        (
            "predict_x0",
            SchedulerConfig {
                predict_x0: false,
                ..base.clone()
            },
        ),
    ];
    for (key, cfg) in cases {
        let err = match build(SchedulerKind::UniPc, &cfg, 4, None, None) {
            Ok(_) => panic!("{key}: accepted an unsupported config"),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            err.contains(key),
            "{key}: error does not name the setting: {err}"
        );
    }
    // The diffusers defaults (epsilon prediction) are not a flow model.
    let default: SchedulerConfig = serde_json::from_str("{}").unwrap();
    assert!(build(SchedulerKind::UniPc, &default, 4, None, None).is_err());
    assert!(build(SchedulerKind::Euler, &default, 4, None, None).is_err());
    assert!(build(SchedulerKind::UniPc, &base, 0, None, None).is_err());
    assert!(build(SchedulerKind::Euler, &base, 4, Some(-1.0), None).is_err());
    assert!(SchedulerConfig::from_file("/nonexistent/scheduler_config.json").is_err());
}

#[test]
fn bh1_and_sigma_min_run() {
    // bh1 and final sigma_min are accepted, give finite results, and bh1 differs from the bh2
    // reference once B(h) enters (the first corrector).
    let r = common::reference("scheduler");
    let cfg = SchedulerConfig {
        solver_type: "bh1".into(),
        final_sigmas_type: "sigma_min".into(),
        ..fixture_config()
    };
    let mut s = build(SchedulerKind::UniPc, &cfg, 4, None, None).unwrap();
    assert_eq!(s.sigmas()[4], s.sigmas()[3]);
    let mut sample = r["loop4.sample_0"].clone();
    for i in 0..4 {
        sample = s
            .step(&r[&format!("loop4.model_output_{i}")], &sample)
            .unwrap();
        let values = sample.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(values.iter().all(|v| v.is_finite()), "step {i}");
        if i == 1 {
            let want = &r["loop4.sample_2"];
            let d = sample.sub(want).unwrap().abs().unwrap().max_all().unwrap();
            assert!(
                d.to_scalar::<f32>().unwrap() > 1e-3,
                "bh1 should differ from bh2"
            );
        }
    }
}

#[test]
fn bf16_model_output_keeps_f32_sample() {
    // As in diffusers' bf16 runs: the velocity comes in bf16, the latents stay f32.
    let r = common::reference("scheduler");
    let cfg = fixture_config();
    let mut s = build(SchedulerKind::UniPc, &cfg, 4, None, None).unwrap();
    let mut sample = r["loop4.sample_0"].clone();
    for i in 0..4 {
        let v = r[&format!("loop4.model_output_{i}")]
            .to_dtype(DType::BF16)
            .unwrap();
        sample = s.step(&v, &sample).unwrap();
        assert_eq!(sample.dtype(), DType::F32);
        common::assert_close(
            "bf16 velocity",
            &sample,
            &r[&format!("loop4.sample_{}", i + 1)],
            5e-2,
            1e-2,
        );
    }
}
