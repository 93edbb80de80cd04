//! FSDP flat shards on the CPU: thread ranks each keep 1/N of every Wan DiT block, gather the
//! block before it runs (prefetching ahead as the offload engine does), and the output is
//! bit-identical to the run without FSDP.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::wan::transformer::{
    WanTransformer3DModel, WanTransformerBlock, WanTransformerConfig,
};
use vidgen::parallel::collective::{run_threads, Collective};
use vidgen::parallel::fsdp::{FlatShard, Home, ShardedBlocks};
use vidgen::parallel::split;

const FIXTURE: &str = "wan-tiny-a";

fn block_tensors(all: &HashMap<String, Tensor>, i: usize) -> Vec<(String, Tensor)> {
    let prefix = format!("blocks.{i}.");
    let mut named: Vec<(String, Tensor)> = all
        .iter()
        .filter_map(|(k, t)| Some((k.strip_prefix(&prefix)?.to_string(), t.clone())))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

#[test]
fn sharded_blocks_are_bit_identical() {
    let cfg: WanTransformerConfig = common::config_in(FIXTURE, "transformer/config.json");
    let path =
        common::named_fixture_dir(FIXTURE).join("transformer/diffusion_pytorch_model.safetensors");
    let all = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
    let whole = WanTransformer3DModel::new(&cfg, vb.clone()).unwrap();
    let outer = WanTransformer3DModel::new_without_blocks(&cfg, vb).unwrap();
    let r = common::reference("transformer");
    let (latents, t, text) = (
        &r["hidden_states"],
        &r["timestep_float"],
        &r["encoder_hidden_states"],
    );
    let want = whole.forward(latents, t, text).unwrap();

    // Pieces on the device, and in host memory (copied in before each gather).
    let homes = [Home::Device(Device::Cpu), Home::Host(Device::Cpu)];
    for (ranks, home) in [(2, &homes[0]), (3, &homes[1])] {
        let held = Mutex::new(vec![0usize; ranks]);
        let outs = run_threads(ranks, Duration::from_secs(60), |group| {
            let rank = group.rank();
            let group: Arc<dyn Collective> = Arc::new(group);
            let shards: Vec<FlatShard> = (0..cfg.num_layers)
                .map(|i| FlatShard::new(&block_tensors(&all, i), rank, ranks, home).unwrap())
                .collect();
            held.lock().unwrap()[rank] = shards.iter().flat_map(|s| s.held()).map(|(_, n)| n).sum();
            let mut inputs = outer.prepare(latents, t, text).unwrap();
            let mut x = inputs.take_hidden_states().unwrap();
            ShardedBlocks::new(&shards, group.as_ref(), &Device::Cpu, 1)
                .for_each(|_, tensors| {
                    let map: HashMap<String, Tensor> = tensors.iter().cloned().collect();
                    let vb = VarBuilder::from_tensors(map, DType::F32, &Device::Cpu);
                    let block = WanTransformerBlock::new(&cfg, vb)?;
                    x = block.forward(&x, &inputs)?;
                    Ok(())
                })
                .unwrap();
            outer.finish(&x, &inputs).unwrap()
        });
        for (rank, out) in outs.iter().enumerate() {
            let diff = common::max_abs_diff(out, &want);
            assert_eq!(diff, 0.0, "{ranks} ranks: rank {rank} differs by {diff}");
        }
        // Each rank holds exactly its share of every block, none twice.
        let per_block: Vec<usize> = (0..cfg.num_layers)
            .map(|i| {
                block_tensors(&all, i)
                    .iter()
                    .map(|(_, t)| t.elem_count())
                    .sum()
            })
            .collect();
        let held = held.into_inner().unwrap();
        for (rank, n) in held.iter().enumerate() {
            let share: usize = per_block.iter().map(|&b| split(b, ranks)[rank].len()).sum();
            assert_eq!(*n, share);
        }
        assert_eq!(held.iter().sum::<usize>(), per_block.iter().sum::<usize>());
    }
}

/// The pipeline's path: the Wan DiT placed as FSDP shards (`Placed::load`) and run
/// through `dit_forward`, alone and together with sequence parallelism over the same thread
/// ranks: bit-identical without sequence parallelism, within 1e-5 with it.
#[test]
fn the_pipeline_runs_a_sharded_dit_with_and_without_sequence_parallelism() {
    use vidgen::offload::{HostMemory, Residency};
    use vidgen::parallel::ulysses::Ulysses;
    use vidgen::pipeline::holding::{Fsdp, Holding};
    use vidgen::pipeline::placement::Placed;
    use vidgen::pipeline::wan_t2v::dit_forward;
    use vidgen::weights::{WeightSet, Weights};

    let cfg: WanTransformerConfig = common::config_in(FIXTURE, "transformer/config.json");
    let path =
        common::named_fixture_dir(FIXTURE).join("transformer/diffusion_pytorch_model.safetensors");
    let weights = WeightSet::open(&Weights::Files(vec![path])).unwrap();
    let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
    let whole = WanTransformer3DModel::new(&cfg, vb).unwrap();
    let r = common::reference("transformer");
    let (latents, t, text) = (
        &r["hidden_states"],
        &r["timestep_float"],
        &r["encoder_hidden_states"],
    );
    let want = whole.forward(latents, t, text).unwrap();
    for (split_sequence, on_host) in [(false, false), (true, true)] {
        let outs = run_threads(2, Duration::from_secs(60), |group| {
            let group: Arc<dyn Collective> = Arc::new(group);
            let fsdp = Fsdp {
                rank: group.rank(),
                ranks: group.world_size(),
                on_host,
                depth: 1,
            };
            let holding = Holding::of::<WanTransformer3DModel>(
                &cfg,
                Residency::Resident,
                Some(fsdp),
                DType::F32,
            )
            .unwrap();
            let placed = Placed::<WanTransformer3DModel>::load(
                &cfg,
                &weights,
                holding,
                HostMemory::Pageable,
                DType::F32,
                &Device::Cpu,
                Some(&group),
            )
            .unwrap();
            let held = placed.hold().unwrap();
            let sp: Arc<dyn vidgen::models::sequence_parallel::SequenceParallel> =
                Arc::new(Ulysses::new(group));
            let sequence = split_sequence.then_some(&sp);
            dit_forward(&held, latents, t, text, None, sequence, None, false).unwrap()
        });
        for (rank, out) in outs.iter().enumerate() {
            let diff = common::max_abs_diff(out, &want);
            let tol = if split_sequence { 1e-5 } else { 0.0 };
            assert!(
                diff <= tol,
                "sequence split {split_sequence}: rank {rank} differs by {diff}"
            );
        }
    }
}

/// A collective that records when each gather ahead starts and when its result is waited for
/// (the thread stand-in completes the gather at once; the order is what a stream would see).
struct Recorder {
    inner: vidgen::parallel::collective::ThreadGroup,
    log: Arc<Mutex<Vec<String>>>,
    started: std::sync::atomic::AtomicUsize,
}

struct Logged {
    log: Arc<Mutex<Vec<String>>>,
    what: String,
}

impl vidgen::parallel::collective::Ready for Logged {
    fn wait(&mut self) -> candle_core::Result<()> {
        self.log.lock().unwrap().push(self.what.clone());
        Ok(())
    }
}

impl Collective for Recorder {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(
        &self,
        t: &Tensor,
        shapes: &[candle_core::Shape],
    ) -> candle_core::Result<Vec<Tensor>> {
        self.inner.all_gather(t, shapes)
    }
    fn all_to_all(
        &self,
        send: &[Tensor],
        shapes: &[candle_core::Shape],
    ) -> candle_core::Result<Vec<Tensor>> {
        self.inner.all_to_all(send, shapes)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> candle_core::Result<Tensor> {
        self.inner.broadcast(t, root)
    }
    fn barrier(&self) -> candle_core::Result<()> {
        self.inner.barrier()
    }
    fn all_gather_ahead(
        &self,
        piece: vidgen::parallel::collective::Piece<'_>,
        shapes: &[candle_core::Shape],
        device: &Device,
    ) -> candle_core::Result<vidgen::parallel::collective::Gathering> {
        let k = self
            .started
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.log.lock().unwrap().push(format!("gather {k}"));
        let parts = self.inner.all_gather(&piece.to_tensor(device)?, shapes)?;
        Ok(vidgen::parallel::collective::Gathering::pending(
            parts,
            Box::new(Logged {
                log: self.log.clone(),
                what: format!("wait {k}"),
            }),
        ))
    }
}

/// The gathers run `depth` blocks ahead of the one computing (started before it runs, waited
/// for just before their own block), never more than `depth + 1` blocks at once, and every
/// rank rebuilds each block exactly.
#[test]
fn gathers_start_depth_blocks_ahead_of_the_block_computing() {
    let blocks: Vec<Vec<(String, Tensor)>> = (0..4)
        .map(|b| {
            let t = Tensor::arange(0f32, 10.0, &Device::Cpu).unwrap();
            vec![("w".to_string(), (t + (100.0 * b as f64)).unwrap())]
        })
        .collect();
    for depth in [1, 2] {
        let logs: Vec<Arc<Mutex<Vec<String>>>> = (0..2).map(|_| Arc::default()).collect();
        run_threads(2, Duration::from_secs(60), |group| {
            let rank = group.rank();
            let log = &logs[rank];
            let recorder = Recorder {
                inner: group,
                log: log.clone(),
                started: Default::default(),
            };
            let shards: Vec<FlatShard> = blocks
                .iter()
                .map(|b| FlatShard::new(b, rank, 2, &Home::Host(Device::Cpu)).unwrap())
                .collect();
            ShardedBlocks::new(&shards, &recorder, &Device::Cpu, depth)
                .for_each(|i, tensors| {
                    assert_eq!(
                        tensors[0].1.to_vec1::<f32>()?,
                        blocks[i][0].1.to_vec1::<f32>()?
                    );
                    log.lock().unwrap().push(format!("run {i}"));
                    Ok(())
                })
                .unwrap();
        });
        let mut want: Vec<String> = (0..=depth).map(|k| format!("gather {k}")).collect();
        for i in 0..4 {
            want.push(format!("wait {i}"));
            want.push(format!("run {i}"));
            if i + depth + 1 < 4 {
                want.push(format!("gather {}", i + depth + 1));
            }
        }
        for log in &logs {
            assert_eq!(*log.lock().unwrap(), want, "depth {depth}");
        }
    }
}
