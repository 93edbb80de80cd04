//! Where MiniMax H3's per-block time goes, beside `bench/peer_minimax_blocks.py` (diffusers' block
//! at the same sizes): the published transformer config with 2 and 6 blocks, seeded synthetic
//! weights, bf16, the packed sequence of a 5 s 768x1344 request (512 text rows); the per-block
//! time is the difference of the two forwards over 4, as the peer computes it. Each forward runs
//! with the blocks' default row chunks and with the whole sequence as one chunk (or the chunk
//! sizes `CHUNKS` lists), two interleaved rounds; then attention alone over the whole sequence
//! against the same in the blocks' query chunks. `PROFILE=1` runs one forward of the smaller
//! model at the default chunks and stops, for a profiler.
//!
//! `cargo build --release --no-default-features --features cuda --example minimax_blocks`

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use vidgen::models::attention::sdpa;
use vidgen::models::minimax_h3::layout::{row_timesteps, t2va_layout, LayoutSizes};
use vidgen::models::minimax_h3::transformer::{
    chunk_rows, MiniMaxH3Transformer3DModel, MiniMaxH3TransformerConfig,
};
use vidgen::weights::{WeightSet, Weights};

#[path = "support/median.rs"]
mod median;
use median::median_seconds as time;

/// 5 s at 768x1344: 37 latent frames of 48x84, 207 audio latents per channel.
const SIZES: LayoutSizes = LayoutSizes {
    num_text_tokens: 512,
    num_latent_frames: 37,
    latent_height: 48,
    latent_width: 84,
    num_audio_latents: 207,
    audio_channels: 2,
};

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let base = MiniMaxH3TransformerConfig::default();
    let layout = t2va_layout(&SIZES, base.patch_size, &dev)?;
    let (timestep, timestep_indices) = row_timesteps(&layout, 0.7, 0.4)?;
    let video_rows = SIZES.num_latent_frames * SIZES.latent_height * SIZES.latent_width
        / (base.patch_size[1] * base.patch_size[2]);
    let randn = |rows: usize, width: usize| {
        Tensor::randn(0f32, 1., (1, rows, width), &dev)?.to_dtype(DType::BF16)
    };
    let video = randn(video_rows, base.video_patch_dim())?;
    let audio = randn(2 * SIZES.num_audio_latents, base.audio_in_channels)?;
    let text = randn(SIZES.num_text_tokens, base.text_dim)?;
    let default_chunks = (base.rows_per_chunk(), base.rows_per_chunk());
    let variants = chunk_variants(default_chunks)?;
    let models = [2usize, 6]
        .iter()
        .map(|&blocks| {
            let cfg = MiniMaxH3TransformerConfig {
                num_layers: blocks,
                ..base.clone()
            };
            let vb =
                WeightSet::open(&Weights::Synthetic { seed: 1 })?.var_builder(DType::BF16, &dev);
            Ok(MiniMaxH3Transformer3DModel::new(&cfg, vb)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let forward = |model: &MiniMaxH3Transformer3DModel, (rows, queries): (usize, usize)| {
        let rope = base.rope(&layout)?;
        let mut inputs = model.prepare(
            &video,
            &audio,
            &text,
            &timestep,
            &timestep_indices,
            &layout,
            &rope,
        )?;
        inputs.rows_per_chunk = rows;
        inputs.query_rows_per_chunk = queries;
        let mut x = inputs.take_hidden_states()?;
        for block in model.blocks() {
            x = block.forward(&x, &inputs)?;
        }
        model.finish(&x, &inputs)?;
        anyhow::Ok(())
    };
    if std::env::var_os("PROFILE").is_some() {
        // One forward of the smaller model at the default chunks, for a profiler to read.
        forward(&models[0], default_chunks)?;
        dev.synchronize()?;
        return Ok(());
    }
    // Rounds of every variant in turn, so clock drift spreads over all of them.
    let mut per_block = vec![Vec::new(); variants.len()];
    for _round in 0..2 {
        for (i, &chunks) in variants.iter().enumerate() {
            let small = time(&dev, 3, || forward(&models[0], chunks))?;
            let large = time(&dev, 3, || forward(&models[1], chunks))?;
            per_block[i].push((large - small) / 4.0);
        }
    }
    for (&(rows, queries), times) in variants.iter().zip(&per_block) {
        let shown = |n: usize| {
            if n == usize::MAX {
                "all".to_string()
            } else {
                n.to_string()
            }
        };
        let times: Vec<String> = times.iter().map(|t| format!("{t:.4}")).collect();
        println!(
            "per block, chunks of {} rows, queries {}: {} s",
            shown(rows),
            shown(queries),
            times.join(" ")
        );
    }
    let seq = layout.token_tags.dim(0)?;
    let (heads, d) = (base.num_attention_heads, base.attention_head_dim);
    let qkv = || Tensor::randn(0f32, 1., (1, heads, seq, d), &dev)?.to_dtype(DType::BF16);
    let (q, k, v) = (qkv()?, qkv()?, qkv()?);
    let scale = 1.0 / (d as f64).sqrt();
    let whole = time(&dev, 5, || sdpa(&q, &k, &v, scale))?;
    let rows = chunk_rows(seq, base.rows_per_chunk());
    let chunked = time(&dev, 5, || -> Result<()> {
        for start in (0..seq).step_by(rows) {
            let q = q.narrow(2, start, rows.min(seq - start))?.contiguous()?;
            sdpa(&q, &k, &v, scale)?;
        }
        Ok(())
    })?;
    println!("attention over {seq} rows, {heads} heads: whole {whole:.4} s, in chunks of {rows} rows {chunked:.4} s");
    Ok(())
}

/// The (feed-forward rows, query rows) each timed: `CHUNKS` as `ROWS:QUERIES,...` (`all` for the
/// whole sequence), else the config's defaults and the whole sequence as one chunk.
fn chunk_variants(default: (usize, usize)) -> Result<Vec<(usize, usize)>> {
    let Ok(list) = std::env::var("CHUNKS") else {
        return Ok(vec![default, (usize::MAX, usize::MAX)]);
    };
    let rows = |n: &str| -> Result<usize> { Ok(if n == "all" { usize::MAX } else { n.parse()? }) };
    list.split(',')
        .map(|pair| {
            let (r, q) = pair
                .split_once(':')
                .ok_or_else(|| anyhow::anyhow!("CHUNKS: `{pair}` is not ROWS:QUERIES"))?;
            Ok((rows(r)?, rows(q)?))
        })
        .collect()
}
