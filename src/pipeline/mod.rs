//! The stage runner: a pipeline is an ordered list of stages, and this is the single place where
//! components are loaded, placed on a device and released.

use crate::cli::ResolvedConfig;
use std::process::ExitCode;

/// Runs (or, with `--dry-run`, plans) a resolved job.
pub fn run(config: ResolvedConfig) -> anyhow::Result<ExitCode> {
    for o in &config.overrides {
        eprintln!("{o}");
    }
    if config.dry_run {
        if config.json {
            println!("{}", config.to_json());
        } else {
            println!("{}", serde_json::to_string_pretty(&config.to_json())?);
        }
        return Ok(ExitCode::SUCCESS);
    }
    anyhow::bail!("generation is not implemented yet")
}
