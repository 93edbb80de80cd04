//! How a `generate` process takes part in a run on several GPUs: alone, as the `--num-gpus`
//! supervisor of its own workers, or as one rank that a launcher (or the supervisor) started.

use std::process::ExitCode;

use super::world::World;
use crate::cli::args::GenerateOptions;

/// Seconds the ranks wait for each other at the rendezvous and on each collective.
pub const TIMEOUT_SECS: u64 = 300;

/// This process's part.
#[derive(Debug, PartialEq, Eq)]
pub enum Part {
    /// One GPU (or none), no other process.
    Alone,
    /// `--num-gpus N` without a launcher: start and supervise N workers.
    Supervisor(usize),
    /// One rank of a world a launcher started.
    Rank(World),
}

/// The part `o` and the launcher's `world` give this process; an error (one line with the fix)
/// when they disagree.
pub fn part(o: &GenerateOptions, world: World) -> Result<Part, String> {
    let gpus = o.num_gpus as usize;
    if world.world_size > 1 {
        if gpus != world.world_size {
            return Err(format!(
                "{} started {} ranks but --num-gpus is {gpus}: pass --num-gpus {}",
                world.launcher, world.world_size, world.world_size
            ));
        }
        return Ok(Part::Rank(world));
    }
    Ok(if gpus > 1 {
        Part::Supervisor(gpus)
    } else {
        Part::Alone
    })
}

/// Runs this same command line as `workers` ranks and exits as they did; every rank's stdout
/// passes through with prompt parallelism (each writes its own prompts), rank 0's alone else.
pub fn supervise_self(workers: usize, prompt_parallel: bool) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    let program = std::env::current_exe().context("finding the vidgen executable")?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let port = super::supervisor::free_port().context("finding a free port for the rendezvous")?;
    let sink: super::supervisor::Sink =
        std::sync::Arc::new(std::sync::Mutex::new(std::io::stderr()));
    // Ctrl-C reaches the workers too (one process group): they stop as a run does (exit 130)
    // while the supervisor waits for them, forwarding their last lines.
    let _ = ctrlc::set_handler(|| {});
    let stdout = if prompt_parallel { workers } else { 1 };
    let ended = super::supervisor::supervise(&program, &args, (workers, stdout), port, sink)
        .context("starting the workers")?;
    Ok(ExitCode::from(ended.code.clamp(0, 255) as u8))
}

/// Joins the world as one rank (feature `nccl`): the rendezvous publishes rank 0's NCCL id, the
/// DiT's self-attention goes through Ulysses over NCCL (and its blocks are FSDP shards with
/// `--use-fsdp-inference`), the rank drives the GPU of its local rank, and every rank but 0
/// writes its outputs to a folder of its own that is removed after (rank 0 alone writes outputs
/// and stats).
#[cfg(feature = "nccl")]
pub fn join(
    mut config: crate::cli::ResolvedConfig,
    world: World,
) -> anyhow::Result<(crate::cli::ResolvedConfig, Option<std::path::PathBuf>)> {
    use super::{nccl, rendezvous, ulysses::Ulysses};
    use crate::memory::probe::DeviceChoice;
    use std::sync::Arc;
    use std::time::Duration;
    let timeout = Duration::from_secs(TIMEOUT_SECS);
    let id = if world.rank == 0 {
        Some(nccl::unique_id()?)
    } else {
        None
    };
    let id = rendezvous::share_id(&world, id, timeout)?;
    config.device.ordinal = world.local_rank;
    config.options.device = DeviceChoice::Cuda(Some(world.local_rank));
    let rank = world.rank;
    let group: Arc<dyn super::collective::Collective> =
        Arc::new(nccl::LazyNccl::new(world, id, timeout));
    config.ranks = Some(super::Ranks {
        sequence: Arc::new(Ulysses::new(group.clone())),
        group,
    });
    let scratch = if rank == 0 {
        None
    } else {
        let dir = std::env::temp_dir().join(format!("vidgen-rank{rank}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        config.options.output_path = dir.clone();
        config.options.stats_json = None;
        Some(dir)
    };
    Ok((config, scratch))
}

/// A rank of a prompt-parallel run (`--sp-size 1`): it makes its own share of the prompts on the
/// GPU of its local rank, with no collective; a rank other than 0 writes its `--stats-json` next
/// to rank 0's, as `NAME.rankR.EXT`.
pub fn own_prompts(
    mut config: crate::cli::ResolvedConfig,
    world: &World,
) -> crate::cli::ResolvedConfig {
    config.device.ordinal = world.local_rank;
    if config.device.kind == crate::memory::DeviceKind::Cuda {
        config.options.device = crate::memory::probe::DeviceChoice::Cuda(Some(world.local_rank));
    }
    if world.rank > 0 {
        if let Some(path) = &mut config.options.stats_json {
            let stem = path
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string();
            let name = match path.extension() {
                Some(ext) => format!("{stem}.rank{}.{}", world.rank, ext.to_string_lossy()),
                None => format!("{stem}.rank{}", world.rank),
            };
            path.set_file_name(name);
        }
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::world::Launcher;
    use clap::Parser;

    fn options(gpus: &str) -> GenerateOptions {
        let cli = crate::cli::args::Cli::parse_from(["vidgen", "generate", "--num-gpus", gpus]);
        let crate::cli::args::Command::Generate(args) = cli.command;
        args.options
    }

    fn world(size: usize) -> World {
        World {
            rank: 1.min(size - 1),
            world_size: size,
            local_rank: 0,
            local_world_size: 1,
            master: Some(("h".into(), 1)),
            launcher: Launcher::Torchrun,
        }
    }

    #[test]
    fn the_part_follows_the_gpus_and_the_launcher() {
        assert_eq!(part(&options("1"), World::single()), Ok(Part::Alone));
        assert_eq!(
            part(&options("2"), World::single()),
            Ok(Part::Supervisor(2))
        );
        assert_eq!(part(&options("2"), world(2)), Ok(Part::Rank(world(2))));
        assert_eq!(
            part(&options("1"), world(2)),
            Err("torchrun started 2 ranks but --num-gpus is 1: pass --num-gpus 2".into())
        );
    }
}
