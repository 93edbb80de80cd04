//! LTX-Video's flow-match Euler schedule (dynamic shift from the sequence length, stretched to
//! `shift_terminal`) against `ltx-video-tiny-a/reference/scheduler.safetensors`.

mod common;

use common::{assert_close, named_fixture_dir, reference_in};
use vidgen::schedulers::euler::{FlowMatchEuler, FlowMatchEulerConfig};
use vidgen::schedulers::Scheduler;

fn config() -> FlowMatchEulerConfig {
    FlowMatchEulerConfig::from_file(
        named_fixture_dir("ltx-video-tiny-a").join("scheduler/scheduler_config.json"),
    )
    .unwrap()
}

#[test]
fn mu_from_the_sequence_length() {
    let cfg = config();
    assert!((cfg.mu(8) - 0.5861979166666665).abs() < 1e-15);
    assert!((cfg.mu(4096) - 2.05).abs() < 1e-12);
    assert!((cfg.mu(8192) - 3.5166666666666666).abs() < 1e-12);
}

#[test]
fn schedules_match_within_float_tolerance() {
    let r = reference_in(&named_fixture_dir("ltx-video-tiny-a"), "scheduler");
    let cfg = config();
    for (n, seq) in [
        (3usize, 8usize),
        (4, 8),
        (7, 8),
        (50, 8),
        (4, 4096),
        (4, 8192),
    ] {
        let s = FlowMatchEuler::for_sequence_length(&cfg, n, seq).unwrap();
        let want_s = r[&format!("sigmas_{n}_seq{seq}")].to_vec1::<f32>().unwrap();
        let want_t = r[&format!("timesteps_{n}_seq{seq}")]
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(s.sigmas().len(), want_s.len());
        assert_eq!(s.timesteps().len(), want_t.len());
        let mut worst = 0f64;
        for (got, want) in s.sigmas().iter().zip(&want_s) {
            let d = f64::from((got - want).abs());
            worst = worst.max(d);
            assert!(
                d <= 1e-6 * f64::from(want.abs()).max(1.0),
                "sigmas_{n}_seq{seq}: {got} vs {want}"
            );
        }
        for (got, want) in s.timesteps().iter().zip(&want_t) {
            let d = (got - f64::from(*want)).abs();
            worst = worst.max(d / f64::from(want.abs()).max(1.0));
            assert!(
                d <= 1e-6 * f64::from(want.abs()).max(1.0),
                "timesteps_{n}_seq{seq}: {got} vs {want}"
            );
        }
        println!("n {n} seq {seq}: worst relative |diff| {worst:e}");
    }
}

#[test]
fn euler_loop_matches() {
    let r = reference_in(&named_fixture_dir("ltx-video-tiny-a"), "scheduler");
    let mut s = FlowMatchEuler::for_sequence_length(&config(), 4, 8).unwrap();
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
    assert!(s.step(&r["loop4.model_output_0"], &sample).is_err());
}

#[test]
fn hostile_configs_are_errors() {
    let cfg: FlowMatchEulerConfig =
        serde_json::from_str(r#"{"base_image_seq_len": 7, "max_image_seq_len": 7}"#).unwrap();
    assert!(cfg
        .validate()
        .unwrap_err()
        .to_string()
        .contains("max_image_seq_len"));
    // One step ends at sigma 1: the terminal stretch would divide by zero.
    assert!(FlowMatchEuler::for_sequence_length(&config(), 1, 8).is_err());
    assert!(FlowMatchEuler::for_sequence_length(&config(), 0, 8).is_err());
}
