//! Parity of MiniMax H3's two flow schedules with diffusers' `MiniMaxH3Scheduler`.

mod common;

use candle_core::Tensor;
use vidgen::schedulers::minimax_h3::{
    distinct_timesteps, MiniMaxH3Schedule, MiniMaxH3SchedulerConfig,
};

fn config(folder: &str) -> MiniMaxH3SchedulerConfig {
    let path = common::named_fixture_dir("minimax-h3-tiny-a")
        .join(folder)
        .join("scheduler_config.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

#[test]
fn schedules_and_steps_match_diffusers() {
    let r = common::reference_in(&common::named_fixture_dir("minimax-h3-tiny-a"), "scheduler");
    for (modality, folder, shift) in [
        ("video", "scheduler", 12.0),
        ("audio", "audio_scheduler", 3.0),
    ] {
        let cfg = config(folder);
        assert_eq!(cfg.shift, shift);
        for n in [2, 3, 4, 8, 50, 1000] {
            let s = MiniMaxH3Schedule::new(&cfg, n).unwrap();
            // Exact: the grid is computed in f32 exactly as torch computes it.
            assert_eq!(
                s.sigmas,
                values(&r[&format!("{modality}.sigmas_{n}")]),
                "{modality} sigmas {n}"
            );
            assert_eq!(
                s.timesteps,
                values(&r[&format!("{modality}.timesteps_{n}")]),
                "{modality} t {n}"
            );
        }
        let s = MiniMaxH3Schedule::new(&cfg, 5).unwrap();
        let mut x = r[&format!("{modality}.loop.sample_0")].clone();
        for i in 0..4 {
            let v = &r[&format!("{modality}.loop.model_output_{i}")];
            x = s.step(i, v, &x).unwrap();
            let want = &r[&format!("{modality}.loop.sample_{}", i + 1)];
            common::assert_close(&format!("{modality} sample_{}", i + 1), &x, want, 1e-6, 0.0);
        }
        assert!(s.step(4, &x, &x).is_err());
    }
}

#[test]
fn per_row_timesteps_are_sorted_and_distinct() {
    assert_eq!(distinct_timesteps(0.0, 0.0), (vec![0.0], 0, 0));
    assert_eq!(distinct_timesteps(0.04, 0.14), (vec![0.04, 0.14], 0, 1));
    assert_eq!(distinct_timesteps(0.5, 0.1), (vec![0.1, 0.5], 1, 0));
}

#[test]
fn hostile_schedules_are_errors() {
    assert!(MiniMaxH3SchedulerConfig { shift: 0.0 }.validate().is_err());
    assert!(MiniMaxH3Schedule::new(&MiniMaxH3SchedulerConfig::default(), 1).is_err());
}
