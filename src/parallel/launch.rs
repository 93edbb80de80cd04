//! How a `generate` process takes part in a run on several GPUs: alone, as the `--num-gpus`
//! supervisor of its own workers, or as one rank that a launcher (or the supervisor) started.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use super::collective::Collective;
use super::world::World;
use super::{Groups, Ranks};
use crate::config::{Rank, ResolvedConfig};

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

/// The part `--num-gpus` (`gpus`) and the launcher's `world` give this process; an error (one
/// line with the fix) when they disagree.
pub fn part(gpus: usize, world: World) -> Result<Part, String> {
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

/// Runs this same command line as the ranks of `groups` and exits as they did; the stdout of
/// each group's leader passes through (it writes its group's prompts), the others' is dropped.
pub fn supervise_self(groups: Groups) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    let program = std::env::current_exe().context("finding the vidgen executable")?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let port = super::supervisor::free_port().context("finding a free port for the rendezvous")?;
    let sink: super::supervisor::Sink =
        std::sync::Arc::new(std::sync::Mutex::new(std::io::stderr()));
    // Ctrl-C (and a closing terminal's SIGHUP) reaches the workers too (one process group):
    // they stop as a run does (exit 130) while the supervisor waits for them, forwarding their
    // last lines. A SIGTERM sent to the supervisor alone is passed on to them.
    crate::pipeline::interrupt::set_handler(|| {});
    super::supervisor::forward_sigterm();
    let ended =
        super::supervisor::supervise(&program, &args, (groups.ranks, groups.sp), port, sink)
            .context("starting the workers")?;
    Ok(ExitCode::from(ended.code.clamp(0, 255) as u8))
}

/// A rank's configuration in a run on several GPUs, the scratch folder its outputs go to (a
/// rank that does not lead its group: it writes nothing the run keeps) and its share of the
/// prompts (it makes job `i` when `i % of == mine`).
pub type Joined = (ResolvedConfig, Option<PathBuf>, Option<(usize, usize)>);

/// Joins the world as one rank of a sequence-parallel group (feature `nccl`): the rendezvous
/// publishes rank 0's NCCL ids, two per group (its communicator and FSDP's gathers ahead), and
/// the rank joins its group's communicators, made at their first collectives on the GPU of its
/// local rank (see [`as_rank`]).
#[cfg(feature = "nccl")]
pub fn join(config: ResolvedConfig, world: World) -> anyhow::Result<Joined> {
    use super::{nccl, rendezvous};
    use std::time::Duration;
    let timeout = Duration::from_secs(TIMEOUT_SECS);
    let groups = config.groups();
    let count = groups.count() * nccl::IDS_PER_GROUP;
    let ids = if world.rank == 0 {
        Some(
            (0..count)
                .map(|_| nccl::unique_id())
                .collect::<candle_core::Result<Vec<_>>>()?,
        )
    } else {
        None
    };
    let ids = rendezvous::share_ids(&world, ids, count, timeout)?;
    let first = groups.group(world.rank) * nccl::IDS_PER_GROUP;
    let mine = [ids[first], ids[first + 1]];
    let member = (groups.rank_in_group(world.rank), groups.sp);
    let group: Arc<dyn Collective> = Arc::new(nccl::LazyNccl::new(member, mine, timeout));
    as_rank(config, &world, Some(group))
}

/// What rank `world.rank` runs with, `group` its sequence-parallel group's collective (`None`
/// with prompt parallelism): it drives the GPU of its local rank and makes its group's share of
/// the prompts; the DiT's self-attention goes through Ulysses over the group (its blocks are
/// FSDP shards over the group with `--use-fsdp-inference`). A group's leader writes its
/// outputs and, if it is not rank 0, its `--stats-json` next to rank 0's as `NAME.rankR.EXT`;
/// the other ranks write to a scratch folder of their own, removed after.
pub fn as_rank(
    config: ResolvedConfig,
    world: &World,
    group: Option<Arc<dyn Collective>>,
) -> anyhow::Result<Joined> {
    let groups = config.groups();
    let rank = world.rank;
    let scratch = if !groups.leads(rank) {
        let dir = std::env::temp_dir().join(format!("vidgen-rank{rank}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Some(dir)
    } else {
        None
    };
    let config = config.for_rank(Rank {
        rank,
        local_rank: world.local_rank,
        ranks: group.map(Ranks::new),
        scratch: scratch.clone(),
    });
    Ok((config, scratch, Some(groups.prompts(rank))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::world::Launcher;

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
        assert_eq!(part(1, World::single()), Ok(Part::Alone));
        assert_eq!(part(2, World::single()), Ok(Part::Supervisor(2)));
        assert_eq!(part(2, world(2)), Ok(Part::Rank(world(2))));
        assert_eq!(
            part(1, world(2)),
            Err("torchrun started 2 ranks but --num-gpus is 1: pass --num-gpus 2".into())
        );
    }
}
