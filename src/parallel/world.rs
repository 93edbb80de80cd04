//! Which process this is among the ranks of one run, read from the launcher's environment:
//! torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`), Slurm (`SLURM_PROCID`,
//! `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_TASKS_PER_NODE`/`SLURM_NODEID`) or Open MPI
//! (`OMPI_COMM_WORLD_*`); the rendezvous address is `MASTER_ADDR:MASTER_PORT` for all three
//! (torchrun sets it, a Slurm or MPI script exports it). Under torchrun, whose own store holds
//! `MASTER_PORT` on rank 0's machine, vidgen's rendezvous takes the next port
//! (`VIDGEN_MASTER_PORT` overrides). torchrun's variables win when several launchers' are
//! present (torchrun started by `srun` sees both).

use std::fmt;

/// torchrun's default rendezvous port, used when `MASTER_PORT` is unset.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The launcher whose variables described the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Launcher {
    /// No launcher: one process, rank 0 of 1.
    None,
    Torchrun,
    Slurm,
    OpenMpi,
    /// `vidgen generate --num-gpus N` starting its own workers (torchrun's variables).
    Supervisor,
}

/// This process's place among the ranks.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct World {
    pub rank: usize,
    pub world_size: usize,
    /// Rank among the processes of this machine: the CUDA ordinal it drives.
    pub local_rank: usize,
    pub local_world_size: usize,
    /// The rendezvous address: `MASTER_ADDR` and the port; `None` for one process.
    pub master: Option<(String, u16)>,
    pub launcher: Launcher,
}

/// A launcher environment that cannot describe a world: one line naming the variable and the fix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WorldError {
    #[error("{launcher}: {var} is set but {missing} is not; the launcher sets both (export {missing}, or unset {var} for one process)")]
    Missing {
        launcher: &'static str,
        var: &'static str,
        missing: &'static str,
    },
    #[error("{var}={value:?} is not a number")]
    NotANumber { var: &'static str, value: String },
    #[error("{var}=0: a world has at least one rank")]
    Empty { var: &'static str },
    #[error("{rank_var}={rank} is not below {size_var}={size}")]
    OutOfRange {
        rank_var: &'static str,
        rank: usize,
        size_var: &'static str,
        size: usize,
    },
    #[error("{local_var}={local} exceeds {world_var}={world}: a machine cannot hold more ranks than the world")]
    LocalExceedsWorld {
        local_var: &'static str,
        local: usize,
        world_var: &'static str,
        world: usize,
    },
    #[error("{launcher} world of {world_size} ranks needs MASTER_ADDR (the address of rank 0's machine) for the rendezvous; export MASTER_ADDR (and MASTER_PORT, default {DEFAULT_MASTER_PORT})")]
    NoMaster {
        launcher: &'static str,
        world_size: usize,
    },
    #[error("MASTER_PORT={0:?} is not a port (1-65535)")]
    BadPort(String),
    #[error("SLURM_TASKS_PER_NODE={value:?} has no entry for SLURM_NODEID={node}")]
    BadTasksPerNode { value: String, node: usize },
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::None => "no launcher",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "Slurm",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Supervisor => "vidgen --num-gpus",
        })
    }
}

/// The variable names one launcher uses for (rank, world size, local rank, local world size).
struct Names {
    launcher: Launcher,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
}

const TORCHRUN: Names = Names {
    launcher: Launcher::Torchrun,
    rank: "RANK",
    size: "WORLD_SIZE",
    local_rank: "LOCAL_RANK",
    local_size: "LOCAL_WORLD_SIZE",
};
const SLURM: Names = Names {
    launcher: Launcher::Slurm,
    rank: "SLURM_PROCID",
    size: "SLURM_NTASKS",
    local_rank: "SLURM_LOCALID",
    local_size: "SLURM_TASKS_PER_NODE",
};
const OPEN_MPI: Names = Names {
    launcher: Launcher::OpenMpi,
    rank: "OMPI_COMM_WORLD_RANK",
    size: "OMPI_COMM_WORLD_SIZE",
    local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
    local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
};

/// The variable the `--num-gpus` supervisor sets in its workers (with torchrun's), so a worker
/// knows it is one and writes no outputs of its own unless rank 0.
pub const SUPERVISED_VAR: &str = "VIDGEN_SUPERVISED";

impl World {
    /// One process, no launcher.
    pub fn single() -> World {
        World {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master: None,
            launcher: Launcher::None,
        }
    }

    /// The world this process's environment describes.
    pub fn from_env() -> Result<World, WorldError> {
        World::from_vars(|k| std::env::var(k).ok())
    }

    /// The world described by `get` (a variable's value, `None` when unset or empty).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<World, WorldError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let names = [TORCHRUN, SLURM, OPEN_MPI]
            .into_iter()
            .find(|n| get(n.rank).is_some() || get(n.size).is_some());
        let Some(names) = names else {
            return Ok(World::single());
        };
        let launcher_name = match names.launcher {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "Slurm",
            _ => "Open MPI",
        };
        let number = |var: &'static str| -> Result<Option<usize>, WorldError> {
            get(var)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| WorldError::NotANumber {
                            var,
                            value: v.clone(),
                        })
                })
                .transpose()
        };
        let required = |var: &'static str, with: &'static str| -> Result<usize, WorldError> {
            number(var)?.ok_or(WorldError::Missing {
                launcher: launcher_name,
                var: with,
                missing: var,
            })
        };
        let rank = required(names.rank, names.size)?;
        let world_size = required(names.size, names.rank)?;
        if world_size == 0 {
            return Err(WorldError::Empty { var: names.size });
        }
        if rank >= world_size {
            return Err(WorldError::OutOfRange {
                rank_var: names.rank,
                rank,
                size_var: names.size,
                size: world_size,
            });
        }
        // Without local variables, every rank is on this machine (a single-node launch).
        let local_world_size = if names.launcher == Launcher::Slurm {
            slurm_tasks_here(&get, number("SLURM_NODEID")?.unwrap_or(0))?
        } else {
            number(names.local_size)?
        }
        .unwrap_or(world_size);
        let local_rank = number(names.local_rank)?.unwrap_or(rank % local_world_size);
        if local_world_size == 0 {
            return Err(WorldError::Empty {
                var: names.local_size,
            });
        }
        if local_world_size > world_size {
            return Err(WorldError::LocalExceedsWorld {
                local_var: names.local_size,
                local: local_world_size,
                world_var: names.size,
                world: world_size,
            });
        }
        if local_rank >= local_world_size {
            return Err(WorldError::OutOfRange {
                rank_var: names.local_rank,
                rank: local_rank,
                size_var: names.local_size,
                size: local_world_size,
            });
        }
        let master = if world_size == 1 {
            None
        } else {
            let addr = get("MASTER_ADDR").ok_or(WorldError::NoMaster {
                launcher: launcher_name,
                world_size,
            })?;
            let port = |var: &str| match get(var) {
                None => Ok(None),
                Some(p) => match p.trim().parse::<u16>() {
                    Ok(port) if port > 0 => Ok(Some(port)),
                    _ => Err(WorldError::BadPort(p)),
                },
            };
            let master = port("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT);
            let port = match port("VIDGEN_MASTER_PORT")? {
                Some(port) => port,
                // torchrun's agent store listens on MASTER_PORT itself.
                None if names.launcher == Launcher::Torchrun && get(SUPERVISED_VAR).is_none() => {
                    master
                        .checked_add(1)
                        .ok_or(WorldError::BadPort(master.to_string()))?
                }
                None => master,
            };
            Some((addr.trim().to_string(), port))
        };
        let launcher = if names.launcher == Launcher::Torchrun && get(SUPERVISED_VAR).is_some() {
            Launcher::Supervisor
        } else {
            names.launcher
        };
        Ok(World {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master,
            launcher,
        })
    }

    /// Whether this is rank 0: the one that writes outputs, stats and stdout.
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }

    /// The environment a launcher gives rank `rank` of `world_size` processes on one machine
    /// (torchrun's variables), for the `--num-gpus` supervisor's workers.
    pub fn local_env(rank: usize, world_size: usize, port: u16) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", world_size.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("LOCAL_WORLD_SIZE", world_size.to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", port.to_string()),
            (SUPERVISED_VAR, "1".to_string()),
        ]
    }
}

/// Tasks on node `node` from `SLURM_TASKS_PER_NODE` (`"2(x3),1"`: three nodes of 2, one of 1);
/// `None` when unset.
fn slurm_tasks_here(
    get: &impl Fn(&str) -> Option<String>,
    node: usize,
) -> Result<Option<usize>, WorldError> {
    let Some(value) = get("SLURM_TASKS_PER_NODE") else {
        return Ok(None);
    };
    let bad = || WorldError::BadTasksPerNode {
        value: value.clone(),
        node,
    };
    let mut first = 0;
    for part in value.split(',') {
        let (tasks, repeat) = match part.split_once("(x") {
            Some((t, r)) => (t, r.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let tasks: usize = tasks.trim().parse().map_err(|_| bad())?;
        let repeat: usize = repeat.trim().parse().map_err(|_| bad())?;
        if node < first + repeat {
            return Ok(Some(tasks));
        }
        first += repeat;
    }
    Err(bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world(vars: &[(&str, &str)]) -> Result<World, WorldError> {
        World::from_vars(|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn no_launcher_is_one_process() {
        assert_eq!(world(&[]).unwrap(), World::single());
    }

    #[test]
    fn torchrun_two_nodes() {
        let w = world(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29600"),
        ])
        .unwrap();
        assert_eq!(
            w,
            World {
                rank: 3,
                world_size: 4,
                local_rank: 1,
                local_world_size: 2,
                // torchrun's store holds 29600.
                master: Some(("10.0.0.1".into(), 29601)),
                launcher: Launcher::Torchrun,
            }
        );
        assert!(!w.is_leader());
    }

    #[test]
    fn torchrun_wins_over_slurm_and_port_defaults() {
        let w = world(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("MASTER_ADDR", "node1"),
        ])
        .unwrap();
        assert_eq!(
            (w.rank, w.world_size, w.launcher),
            (0, 2, Launcher::Torchrun)
        );
        // No local variables: a single-node launch.
        assert_eq!((w.local_rank, w.local_world_size), (0, 2));
        assert_eq!(w.master, Some(("node1".into(), DEFAULT_MASTER_PORT + 1)));
    }

    #[test]
    fn slurm_heterogeneous_nodes() {
        let w = world(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "3"),
            ("SLURM_TASKS_PER_NODE", "2(x3),1"),
            ("MASTER_ADDR", "n0"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            (w.rank, w.world_size, w.local_rank, w.local_world_size),
            (6, 7, 0, 1)
        );
        assert_eq!(w.launcher, Launcher::Slurm);
        let w = world(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "2(x3),1"),
            ("MASTER_ADDR", "n0"),
        ])
        .unwrap();
        assert_eq!(w.local_world_size, 2);
    }

    #[test]
    fn open_mpi() {
        let w = world(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
            ("MASTER_ADDR", "spark-a"),
        ])
        .unwrap();
        assert_eq!(
            (w.rank, w.world_size, w.local_rank, w.local_world_size),
            (1, 2, 0, 1)
        );
        assert_eq!(w.launcher, Launcher::OpenMpi);
        assert_eq!(w.master, Some(("spark-a".into(), DEFAULT_MASTER_PORT)));
    }

    #[test]
    fn vidgen_master_port_overrides() {
        let w = world(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "29500"),
            ("VIDGEN_MASTER_PORT", "40000"),
        ])
        .unwrap();
        assert_eq!(w.master, Some(("a".into(), 40000)));
    }

    #[test]
    fn supervised_workers_say_so() {
        let vars: Vec<(&str, String)> = World::local_env(1, 2, 4000);
        let w = World::from_vars(|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.clone())
        })
        .unwrap();
        assert_eq!(w.launcher, Launcher::Supervisor);
        assert_eq!(w.master, Some(("127.0.0.1".into(), 4000)));
        assert_eq!((w.rank, w.world_size, w.local_rank), (1, 2, 1));
    }

    #[test]
    fn inconsistent_values_are_typed_errors() {
        let master = ("MASTER_ADDR", "h");
        assert_eq!(
            world(&[("RANK", "0")]).unwrap_err(),
            WorldError::Missing {
                launcher: "torchrun",
                var: "RANK",
                missing: "WORLD_SIZE"
            }
        );
        assert_eq!(
            world(&[("RANK", "2"), ("WORLD_SIZE", "2"), master]).unwrap_err(),
            WorldError::OutOfRange {
                rank_var: "RANK",
                rank: 2,
                size_var: "WORLD_SIZE",
                size: 2
            }
        );
        assert_eq!(
            world(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err(),
            WorldError::NotANumber {
                var: "RANK",
                value: "x".into()
            }
        );
        assert_eq!(
            world(&[("RANK", "0"), ("WORLD_SIZE", "0")]).unwrap_err(),
            WorldError::Empty { var: "WORLD_SIZE" }
        );
        assert_eq!(
            world(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_WORLD_SIZE", "4"),
                master
            ])
            .unwrap_err(),
            WorldError::LocalExceedsWorld {
                local_var: "LOCAL_WORLD_SIZE",
                local: 4,
                world_var: "WORLD_SIZE",
                world: 2
            }
        );
        assert!(matches!(
            world(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "4"),
                ("LOCAL_RANK", "2"),
                ("LOCAL_WORLD_SIZE", "2"),
                master
            ]),
            Err(WorldError::OutOfRange {
                rank_var: "LOCAL_RANK",
                ..
            })
        ));
        assert_eq!(
            world(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap_err(),
            WorldError::NoMaster {
                launcher: "torchrun",
                world_size: 2
            }
        );
        assert_eq!(
            world(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                master,
                ("MASTER_PORT", "0")
            ])
            .unwrap_err(),
            WorldError::BadPort("0".into())
        );
        assert!(matches!(
            world(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_NODEID", "5"),
                ("SLURM_TASKS_PER_NODE", "1(x2)"),
                master
            ]),
            Err(WorldError::BadTasksPerNode { node: 5, .. })
        ));
        // One rank needs no rendezvous address.
        assert_eq!(
            world(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap().master,
            None
        );
    }
}
