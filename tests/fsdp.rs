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
use vidgen::parallel::fsdp::{FlatShard, ShardedBlocks};
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

    for ranks in [2, 3] {
        let held = Mutex::new(vec![0usize; ranks]);
        let outs = run_threads(ranks, Duration::from_secs(60), |group| {
            let rank = group.rank();
            let group: Arc<dyn Collective> = Arc::new(group);
            let shards: Vec<FlatShard> = (0..cfg.num_layers)
                .map(|i| FlatShard::new(&block_tensors(&all, i), rank, ranks).unwrap())
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

/// The pipeline's path: the Wan DiT placed as FSDP shards (`Placed::load_sharded`) and run
/// through `dit_forward`, alone and together with sequence parallelism over the same thread
/// ranks: bit-identical without sequence parallelism, within 1e-5 with it.
#[test]
fn the_pipeline_runs_a_sharded_dit_with_and_without_sequence_parallelism() {
    use vidgen::parallel::ulysses::Ulysses;
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
            let placed = Placed::<WanTransformer3DModel>::load_sharded(
                &cfg,
                &weights,
                group.clone(),
                DType::F32,
                &Device::Cpu,
                on_host,
                1,
            )
            .unwrap();
            let held = placed.hold().unwrap();
            let sp: Arc<dyn vidgen::models::sequence_parallel::SequenceParallel> =
                Arc::new(Ulysses::new(group));
            let sequence = split_sequence.then_some(&sp);
            dit_forward(&held, latents, t, text, None, sequence).unwrap()
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
