//! FluxPipeline's flow-match Euler schedule (`sigmas = linspace(1, 1/N, N)`, shifted by `mu`
//! from the image's packed token count) against `flux-tiny-a/reference/scheduler.safetensors`.

mod common;

use common::{assert_close, named_fixture_dir, reference_in};
use vidgen::schedulers::euler::{FlowMatchEuler, FlowMatchEulerConfig};
use vidgen::schedulers::Scheduler;

const FIXTURE: &str = "flux-tiny-a";

fn config() -> FlowMatchEulerConfig {
    FlowMatchEulerConfig::from_file(
        named_fixture_dir(FIXTURE).join("scheduler/scheduler_config.json"),
    )
    .unwrap()
}

/// The cases the fixture records: `(steps, image tokens, mu)`.
fn cases() -> Vec<(usize, usize, f64)> {
    let path = named_fixture_dir(FIXTURE).join("reference/README.json");
    let readme: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    readme["files"]["scheduler.safetensors"]["inputs"]["mu"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(key, case)| {
            let steps = key.split('_').next().unwrap().parse().unwrap();
            let seq = case["image_seq_len"].as_u64().unwrap() as usize;
            (steps, seq, case["mu"].as_f64().unwrap())
        })
        .collect()
}

#[test]
fn mu_from_the_image_sequence_length() {
    let cfg = config();
    for (_, seq, mu) in cases() {
        assert!(
            (cfg.mu(seq) - mu).abs() < 1e-12,
            "mu({seq}) {} vs {mu}",
            cfg.mu(seq)
        );
    }
}

#[test]
fn schedules_match_within_float_tolerance() {
    let r = reference_in(&named_fixture_dir(FIXTURE), "scheduler");
    let cfg = config();
    let cases = cases();
    assert_eq!(cases.len(), 5);
    for (n, seq, _) in cases {
        let s = FlowMatchEuler::for_sequence_length(&cfg, n, seq).unwrap();
        let want_s = r[&format!("sigmas_{n}_seq{seq}")].to_vec1::<f32>().unwrap();
        let want_t = r[&format!("timesteps_{n}_seq{seq}")]
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(s.sigmas().len(), want_s.len());
        assert_eq!(s.timesteps().len(), want_t.len());
        for (got, want) in s.sigmas().iter().zip(&want_s) {
            let d = f64::from((got - want).abs());
            assert!(
                d <= 1e-6 * f64::from(want.abs()).max(1.0),
                "sigmas_{n}_seq{seq}: {got} vs {want}"
            );
        }
        for (got, want) in s.timesteps().iter().zip(&want_t) {
            let d = (got - f64::from(*want)).abs();
            assert!(
                d <= 1e-6 * f64::from(want.abs()).max(1.0),
                "timesteps_{n}_seq{seq}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn euler_loop_matches() {
    let r = reference_in(&named_fixture_dir(FIXTURE), "scheduler");
    let tokens = r["loop4.sample_0"].dim(1).unwrap();
    let mut s = FlowMatchEuler::for_sequence_length(&config(), 4, tokens).unwrap();
    let mut sample = r["loop4.sample_0"].clone();
    for i in 0..4 {
        sample = s
            .step(&r[&format!("loop4.model_output_{i}")], &sample)
            .unwrap();
        assert_close(
            &format!("loop4.sample_{}", i + 1),
            &sample,
            &r[&format!("loop4.sample_{}", i + 1)],
            1e-6,
            1e-6,
        );
    }
}
