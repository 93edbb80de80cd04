//! Parity of `DDIMScheduler` (eta 0) with diffusers on the `latte-tiny-a` references: the f32
//! schedule, the leading timesteps and a 4-step loop.

mod common;

use candle_core::{Device, Tensor};
use vidgen::schedulers::ddim::{DdimConfig, DdimScheduler};

const FIXTURE: &str = "latte-tiny-a";

fn config() -> DdimConfig {
    common::config_in(FIXTURE, "scheduler/scheduler_config.json")
}

#[test]
fn schedule_matches_diffusers() {
    let cfg = config();
    let r = common::named_reference(FIXTURE, "scheduler");
    let alphas = Tensor::new(cfg.alphas_cumprod(), &Device::Cpu).unwrap();
    eprintln!(
        "alphas_cumprod: max |diff| {:.3e}",
        common::max_abs_diff(&alphas, &r["alphas_cumprod"])
    );
    assert_eq!(
        cfg.alphas_cumprod(),
        r["alphas_cumprod"].to_vec1::<f32>().unwrap(),
        "alphas_cumprod bit for bit"
    );
    for n in [3, 4, 7, 50] {
        let sched = DdimScheduler::new(&cfg, n).unwrap();
        let expected = r[&format!("timesteps_{n}")].to_vec1::<i64>().unwrap();
        assert_eq!(sched.timesteps(), expected, "{n} steps");
    }
}

#[test]
fn four_step_loop_matches_diffusers() {
    let sched = DdimScheduler::new(&config(), 4).unwrap();
    let r = common::named_reference(FIXTURE, "scheduler");
    let mut sample = r["loop4.sample_0"].clone();
    for (i, &t) in sched.timesteps().iter().enumerate() {
        sample = sched
            .step(&r[&format!("loop4.model_output_{i}")], t, &sample)
            .unwrap();
        let expected = &r[&format!("loop4.sample_{}", i + 1)];
        eprintln!(
            "loop4.sample_{}: max |diff| {:.3e} of max |ref| {:.3e}",
            i + 1,
            common::max_abs_diff(&sample, expected),
            expected
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        );
        common::assert_close(
            &format!("loop4.sample_{}", i + 1),
            &sample,
            expected,
            1e-5,
            1e-5,
        );
    }
}
