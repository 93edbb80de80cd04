//! The `vidgen` binary: parse, resolve, run; errors become one line and an exit code.

use std::process::ExitCode;
use vidgen::cli::{self, Parsed, ResolvedConfig, UsageError};

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            if let Some(usage) = e.downcast_ref::<UsageError>() {
                eprintln!("error: {usage}");
                ExitCode::from(2)
            } else {
                eprintln!("error: {e:#}");
                ExitCode::from(1)
            }
        }
    }
}

fn run() -> anyhow::Result<ExitCode> {
    let args = match cli::parse(std::env::args_os())? {
        Parsed::Info(text) => {
            print!("{text}");
            return Ok(ExitCode::SUCCESS);
        }
        Parsed::Generate(args) => args,
    };
    let config = ResolvedConfig::resolve(*args)?;
    vidgen::pipeline::run(config)
}
