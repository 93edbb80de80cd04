//! vidgen: text-to-video with open video diffusion models, on whatever memory the machine has.
//!
//! The file tree mirrors the architecture: `cli` turns flags into one resolved configuration
//! (`config`, what they mean: all that later layers read),
//! `memory` probes the device and plans memory, `offload` moves weights between host and device,
//! `models` holds one folder per model family, `schedulers` the diffusion samplers, `pipeline`
//! runs the stages and is the one place where components are loaded, placed and released, and
//! `output` writes the frames, `rng` draws what torch's CPU generator draws for a seed, `parallel`
//! lets several processes (GPUs) compute one run, `teardown` unmaps and unlocks large host memory off
//! the critical path, and `weights` reads weight files for models and
//! the engine alike (with `lora`'s deltas merged in).

pub mod cli;
pub mod config;
#[cfg(test)]
mod fuzz;
pub mod lora;
pub mod memory;
pub mod models;
pub mod offload;
pub mod output;
pub mod parallel;
pub mod pipeline;
pub mod rng;
pub mod schedulers;
pub mod teardown;
pub mod weights;
