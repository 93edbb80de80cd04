//! Ulysses sequence parallelism of the Wan DiT on the CPU: thread ranks over the CPU stand-in
//! for NCCL give the one-rank output (uneven token and head splits included).

mod common;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use vidgen::models::wan::transformer::{WanTransformer3DModel, WanTransformerConfig};
use vidgen::parallel::collective::{run_threads, Collective};
use vidgen::parallel::ulysses::Ulysses;

const TOL: f64 = 1e-5;

fn model(fixture: &str) -> WanTransformer3DModel {
    let cfg: WanTransformerConfig = common::config_in(fixture, "transformer/config.json");
    let vb = common::var_builder_in(fixture, "transformer/diffusion_pytorch_model.safetensors");
    WanTransformer3DModel::new(&cfg, vb).unwrap()
}

/// The DiT forward with the sequence split over `ranks` thread ranks; every rank's output.
fn split_forward(
    model: &WanTransformer3DModel,
    latents: &Tensor,
    timestep: &Tensor,
    text: &Tensor,
    ranks: usize,
) -> Vec<Tensor> {
    run_threads(ranks, Duration::from_secs(60), |group| {
        let group: Arc<dyn Collective> = Arc::new(group);
        let mut whole = model.prepare(latents, timestep, text).unwrap();
        let mut mine = whole.split_sequence(Arc::new(Ulysses::new(group))).unwrap();
        let mut x = mine.take_hidden_states().unwrap();
        for block in model.blocks() {
            x = block.forward(&x, &mine).unwrap();
        }
        let x = mine.gather_sequence(&x).unwrap();
        model.finish(&x, &whole).unwrap()
    })
}

fn check(name: &str, got: &[Tensor], want: &Tensor) {
    for (rank, out) in got.iter().enumerate() {
        assert_eq!(out.dims(), want.dims());
        let diff = common::max_abs_diff(out, want);
        assert!(diff <= TOL, "{name}: rank {rank} differs by {diff}");
    }
}

#[test]
fn split_sequence_matches_one_rank() {
    let model = model("wan-tiny-a");
    let r = common::reference("transformer");
    let (latents, text) = (&r["hidden_states"], &r["encoder_hidden_states"]);
    let t = &r["timestep_float"];
    let want = model.forward(latents, t, text).unwrap();
    eprintln!(
        "latents {:?} heads {}",
        latents.dims(),
        model.config().num_attention_heads
    );
    // 2 ranks: even; 3: uneven tokens and a rank without a head.
    for ranks in [2, 3] {
        check(
            &format!("{ranks} ranks"),
            &split_forward(&model, latents, t, text, ranks),
            &want,
        );
    }
}

#[test]
fn uneven_token_shares() {
    let model = model("wan-tiny-a");
    let r = common::reference("transformer");
    // Two latent frames: 8 tokens, 3 + 3 + 2 over 3 ranks; 5 ranks: 2 + 2 + 2 + 1 + 1.
    let latents = r["hidden_states"].narrow(2, 0, 2).unwrap();
    let (text, t) = (&r["encoder_hidden_states"], &r["timestep_float"]);
    let want = model.forward(&latents, t, text).unwrap();
    for ranks in [3, 5] {
        check(
            &format!("{ranks} ranks"),
            &split_forward(&model, &latents, t, text, ranks),
            &want,
        );
    }
}

#[test]
fn split_sequence_with_a_batch_and_per_token_timesteps() {
    let model = model("wan22-ti2v-tiny-a");
    let r = common::named_reference("wan22-ti2v-tiny-a", "transformer");
    let latents = &r["hidden_states"];
    let text = &r["encoder_hidden_states"];
    // A batch of two different entries.
    let latents = Tensor::cat(&[latents, &(latents * 0.5).unwrap()], 0).unwrap();
    let text = Tensor::cat(&[text, &text.flip(&[1]).unwrap()], 0).unwrap();
    let want_scalar = model
        .forward(
            &latents,
            &Tensor::new(&[900f32, 500.], &Device::Cpu).unwrap(),
            &text,
        )
        .unwrap();
    check(
        "batch",
        &split_forward(
            &model,
            &latents,
            &Tensor::new(&[900f32, 500.], &Device::Cpu).unwrap(),
            &text,
            3,
        ),
        &want_scalar,
    );
    // Wan2.2 TI2V's per-token timesteps: the first frame's tokens at 0, the rest at 700, so
    // timestep runs straddle the ranks' token shares.
    let cfg = model.config();
    let (_, _, f, h, w) = latents.dims5().unwrap();
    let per_frame = (h / cfg.patch_size[1]) * (w / cfg.patch_size[2]);
    let seq = (f / cfg.patch_size[0]) * per_frame;
    let values: Vec<f32> = (0..2 * seq)
        .map(|i| {
            if i % seq < per_frame {
                0.0
            } else {
                700.0 + (i / seq) as f32
            }
        })
        .collect();
    let t = Tensor::from_vec(values, (2, seq), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let want = model.forward(&latents, &t, &text).unwrap();
    for ranks in [2, 3] {
        check(
            &format!("per-token {ranks}"),
            &split_forward(&model, &latents, &t, &text, ranks),
            &want,
        );
    }
}
