//! The TCP rendezvous at `MASTER_ADDR:MASTER_PORT`: rank 0 listens, every other rank connects
//! (retrying while rank 0 is not up yet) and says who it is; once all have, rank 0 sends each
//! the 128-byte ids (NCCL's unique ids, one per sequence-parallel group) it publishes. It doubles as the start barrier: no rank
//! leaves it before every rank arrived, and a missing rank is an error on every rank within the
//! timeout, not a hang.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::world::World;

/// Bytes of the published id (`ncclUniqueId`).
pub const ID_BYTES: usize = 128;

/// Opens every message, so a stray connection (or another program's) is told apart.
const MAGIC: &[u8; 8] = b"vidgen\x01\x00";

/// How long rank 0 waits for a connection to introduce itself.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

/// Why the ranks could not meet.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rendezvous: rank 0 cannot listen on port {port}: {source} (another run on the port? set MASTER_PORT)")]
    Listen { port: u16, source: std::io::Error },
    #[error("rendezvous: MASTER_ADDR {addr}:{port} does not resolve: {why}")]
    Resolve {
        addr: String,
        port: u16,
        why: String,
    },
    #[error("rendezvous: timed out after {secs}s {waiting}")]
    Timeout { secs: u64, waiting: String },
    #[error("rendezvous: rank {rank} says the world has {theirs} ranks, rank 0 has {ours}: the ranks were launched with different WORLD_SIZE")]
    WorldMismatch {
        rank: usize,
        theirs: usize,
        ours: usize,
    },
    #[error("rendezvous: two processes claim rank {0}")]
    DuplicateRank(usize),
    #[error("rendezvous: rank 0 closed the connection: {0}")]
    Closed(std::io::Error),
    #[error("rendezvous: rank 0 needs the ids to publish")]
    NoId,
    #[error("rendezvous: rank 0 publishes {theirs} group ids, this rank expects {ours}: the ranks were launched with different --sp-size")]
    GroupsMismatch { theirs: usize, ours: usize },
}

/// Meets every rank of `world` at its master address and returns rank 0's `count` ids on
/// every rank (rank 0 passes them, the others `None`), failing after `timeout`.
pub fn share_ids(
    world: &World,
    ids: Option<Vec<[u8; ID_BYTES]>>,
    count: usize,
    timeout: Duration,
) -> Result<Vec<[u8; ID_BYTES]>, RendezvousError> {
    if world.world_size == 1 {
        return ids.ok_or(RendezvousError::NoId);
    }
    let (addr, port) = world
        .master
        .clone()
        .expect("a world of several ranks has a master address");
    let deadline = Instant::now() + timeout;
    if world.rank == 0 {
        let ids = ids.ok_or(RendezvousError::NoId)?;
        // All interfaces, as torchrun's store does: MASTER_ADDR is how the others reach us.
        let listener = TcpListener::bind(("0.0.0.0", port))
            .map_err(|source| RendezvousError::Listen { port, source })?;
        serve(&listener, world.world_size, &ids, deadline, timeout)?;
        Ok(ids)
    } else {
        let target = (addr.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| RendezvousError::Resolve {
                addr: addr.clone(),
                port,
                why: e.to_string(),
            })?
            .next()
            .ok_or_else(|| RendezvousError::Resolve {
                addr: addr.clone(),
                port,
                why: "no address".into(),
            })?;
        join(target, world, count, deadline, timeout)
    }
}

/// Rank 0: accepts one connection per other rank, then sends the ids to all.
pub fn serve(
    listener: &TcpListener,
    world_size: usize,
    ids: &[[u8; ID_BYTES]],
    deadline: Instant,
    timeout: Duration,
) -> Result<(), RendezvousError> {
    listener
        .set_nonblocking(true)
        .map_err(RendezvousError::Closed)?;
    let mut peers: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
    let timed_out = |peers: &[Option<TcpStream>]| {
        let missing: Vec<String> = (1..world_size)
            .filter(|&r| peers[r].is_none())
            .map(|r| r.to_string())
            .collect();
        RendezvousError::Timeout {
            secs: timeout.as_secs(),
            waiting: format!("on rank 0 waiting for rank(s) {}", missing.join(", ")),
        }
    };
    while peers[1..].iter().any(Option::is_none) {
        let mut stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(timed_out(&peers));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(RendezvousError::Closed(e)),
        };
        // A connection that does not introduce itself in time is not one of ours.
        let hello = (|| {
            stream.set_nonblocking(false)?;
            stream.set_read_timeout(Some(remaining(deadline).min(HELLO_TIMEOUT)))?;
            let mut buf = [0u8; 8 + 16];
            stream.read_exact(&mut buf)?;
            Ok::<_, std::io::Error>(buf)
        })();
        let Ok(hello) = hello else { continue };
        if &hello[..8] != MAGIC {
            continue;
        }
        let rank = u64::from_le_bytes(hello[8..16].try_into().unwrap()) as usize;
        let theirs = u64::from_le_bytes(hello[16..24].try_into().unwrap()) as usize;
        if theirs != world_size {
            return Err(RendezvousError::WorldMismatch {
                rank,
                theirs,
                ours: world_size,
            });
        }
        if rank == 0 || rank >= world_size || peers[rank].is_some() {
            return Err(RendezvousError::DuplicateRank(rank));
        }
        peers[rank] = Some(stream);
    }
    for stream in peers.iter_mut().flatten() {
        let mut msg = MAGIC.to_vec();
        msg.extend_from_slice(&(ids.len() as u64).to_le_bytes());
        ids.iter().for_each(|id| msg.extend_from_slice(id));
        stream.write_all(&msg).map_err(RendezvousError::Closed)?;
    }
    Ok(())
}

/// Any other rank: connects (retrying until the deadline), introduces itself, reads the
/// `count` ids.
fn join(
    target: SocketAddr,
    world: &World,
    count: usize,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<[u8; ID_BYTES]>, RendezvousError> {
    let timed_out = |what: &str| RendezvousError::Timeout {
        secs: timeout.as_secs(),
        waiting: format!("on rank {} {what} {target}", world.rank),
    };
    let mut stream = loop {
        match TcpStream::connect_timeout(&target, remaining(deadline)) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(_) => return Err(timed_out("connecting to rank 0 at")),
        }
    };
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&(world.rank as u64).to_le_bytes());
    hello.extend_from_slice(&(world.world_size as u64).to_le_bytes());
    stream.write_all(&hello).map_err(RendezvousError::Closed)?;
    stream
        .set_read_timeout(Some(remaining(deadline)))
        .map_err(RendezvousError::Closed)?;
    let mut head = [0u8; 16];
    let read = stream.read_exact(&mut head).and_then(|()| {
        if &head[..8] != MAGIC {
            return Err(std::io::Error::other("not a vidgen rendezvous"));
        }
        let theirs = u64::from_le_bytes(head[8..].try_into().unwrap()) as usize;
        if theirs != count {
            return Ok(Err(RendezvousError::GroupsMismatch {
                theirs,
                ours: count,
            }));
        }
        let mut ids = vec![[0u8; ID_BYTES]; count];
        for id in &mut ids {
            stream.read_exact(id)?;
        }
        Ok(Ok(ids))
    });
    match read {
        Ok(ids) => ids,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Err(timed_out("waiting for the other ranks through rank 0 at"))
        }
        Err(e) => Err(RendezvousError::Closed(e)),
    }
}

/// Time left before `deadline` (at least a millisecond: a zero timeout means "none" to std).
fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::world::Launcher;

    fn world(rank: usize, size: usize, port: u16) -> World {
        World {
            rank,
            world_size: size,
            local_rank: rank,
            local_world_size: size,
            master: Some(("127.0.0.1".into(), port)),
            launcher: Launcher::Torchrun,
        }
    }

    /// A port free now (bound and released by the OS).
    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let port = free_port();
        let mut id = [0u8; ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        let mut other = id;
        other.reverse();
        // The others start first: they retry until rank 0 listens. Two groups: two ids.
        let handles: Vec<_> = (0..3)
            .rev()
            .map(|rank| {
                std::thread::spawn(move || {
                    let mine = (rank == 0).then_some(vec![id, other]);
                    share_ids(&world(rank, 3, port), mine, 2, Duration::from_secs(20))
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), vec![id, other]);
        }
    }

    #[test]
    fn a_rank_expecting_other_groups_is_told() {
        let port = free_port();
        let rank0 = std::thread::spawn(move || {
            share_ids(
                &world(0, 2, port),
                Some(vec![[1; ID_BYTES]]),
                1,
                Duration::from_secs(20),
            )
        });
        let err = share_ids(&world(1, 2, port), None, 2, Duration::from_secs(20)).unwrap_err();
        assert!(
            matches!(err, RendezvousError::GroupsMismatch { theirs: 1, ours: 2 }),
            "{err}"
        );
        rank0.join().unwrap().unwrap();
    }

    #[test]
    fn a_missing_rank_times_out_on_rank_zero_naming_it() {
        let port = free_port();
        let one = std::thread::spawn(move || {
            share_ids(&world(1, 3, port), None, 1, Duration::from_secs(20))
        });
        let err = share_ids(
            &world(0, 3, port),
            Some(vec![[1; ID_BYTES]]),
            1,
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(
            matches!(&err, RendezvousError::Timeout { waiting, .. } if waiting.contains("rank(s) 2")),
            "{err}"
        );
        // Rank 0 gave up and closed: rank 1 fails too instead of waiting for its own timeout.
        assert!(one.join().unwrap().is_err());
    }

    #[test]
    fn no_rank_zero_times_out() {
        let port = free_port();
        let err = share_ids(&world(1, 2, port), None, 1, Duration::from_millis(300)).unwrap_err();
        assert!(matches!(err, RendezvousError::Timeout { .. }), "{err}");
    }

    #[test]
    fn world_size_mismatch_is_named() {
        let port = free_port();
        let other = std::thread::spawn(move || {
            share_ids(&world(1, 3, port), None, 1, Duration::from_secs(10))
        });
        let err = share_ids(
            &world(0, 2, port),
            Some(vec![[0; ID_BYTES]]),
            1,
            Duration::from_secs(10),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                RendezvousError::WorldMismatch {
                    rank: 1,
                    theirs: 3,
                    ours: 2
                }
            ),
            "{err}"
        );
        assert!(other.join().unwrap().is_err());
    }

    #[test]
    fn strangers_are_ignored() {
        let port = free_port();
        let rank0 = std::thread::spawn(move || {
            share_ids(
                &world(0, 2, port),
                Some(vec![[9; ID_BYTES]]),
                1,
                Duration::from_secs(20),
            )
        });
        // A connection that speaks another protocol, then the real rank 1.
        let stranger = loop {
            if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
                break s;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        (&stranger)
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let got = share_ids(&world(1, 2, port), None, 1, Duration::from_secs(20)).unwrap();
        assert_eq!(got, vec![[9; ID_BYTES]]);
        rank0.join().unwrap().unwrap();
    }
}
