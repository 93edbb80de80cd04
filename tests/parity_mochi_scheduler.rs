//! Parity of Mochi's sampler (the linear-quadratic sigmas handed to
//! `FlowMatchEulerDiscreteScheduler` with `invert_sigmas`) with the `mochi-tiny-a` references.

mod common;

use candle_core::{Device, Tensor};
use vidgen::schedulers::euler::{FlowMatchEuler, FlowMatchEulerConfig};
use vidgen::schedulers::linear_quadratic::{linear_quadratic_schedule, THRESHOLD_NOISE};
use vidgen::schedulers::Scheduler;

const FIXTURE: &str = "mochi-tiny-a";

fn config() -> FlowMatchEulerConfig {
    FlowMatchEulerConfig::from_file(
        common::named_fixture_dir(FIXTURE).join("scheduler/scheduler_config.json"),
    )
    .unwrap()
}

fn f32s(values: impl IntoIterator<Item = f32>) -> Tensor {
    Tensor::new(values.into_iter().collect::<Vec<_>>(), &Device::Cpu).unwrap()
}

#[test]
fn schedule_matches_diffusers() {
    let r = common::named_reference(FIXTURE, "scheduler");
    for n in [3, 4, 7, 64] {
        let input = linear_quadratic_schedule(n, THRESHOLD_NOISE);
        let input = f32s(input.iter().map(|&s| s as f32));
        common::assert_close(
            &format!("input_sigmas_{n}"),
            &input,
            &r[&format!("input_sigmas_{n}")],
            1e-6,
            1e-6,
        );
        let sched = FlowMatchEuler::with_sigmas(
            &config(),
            &linear_quadratic_schedule(n, THRESHOLD_NOISE),
            None,
        )
        .unwrap();
        let sigmas = f32s(sched.sigmas().iter().copied());
        common::assert_close(
            &format!("sigmas_{n}"),
            &sigmas,
            &r[&format!("sigmas_{n}")],
            1e-6,
            1e-6,
        );
        let timesteps = f32s(sched.timesteps().iter().map(|&t| t as f32));
        common::assert_close(
            &format!("timesteps_{n}"),
            &timesteps,
            &r[&format!("timesteps_{n}")],
            1e-6,
            1e-6,
        );
    }
}

#[test]
fn four_step_loop_matches_diffusers() {
    let r = common::named_reference(FIXTURE, "scheduler");
    let mut sched = FlowMatchEuler::with_sigmas(
        &config(),
        &linear_quadratic_schedule(4, THRESHOLD_NOISE),
        None,
    )
    .unwrap();
    let mut sample = r["loop4.sample_0"].clone();
    for i in 0..4 {
        sample = sched
            .step(&r[&format!("loop4.model_output_{i}")], &sample)
            .unwrap();
        let name = format!("loop4.sample_{}", i + 1);
        eprintln!(
            "{name}: max |diff| {:.3e}",
            common::max_abs_diff(&sample, &r[&name])
        );
        common::assert_close(&name, &sample, &r[&name], 1e-4, 1e-4);
    }
}
