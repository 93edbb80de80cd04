//! The memory plan's MiniMax H3 denoise activations against what one transformer forward
//! allocates on the CPU (f32, a 32x32 canvas with the plan's 512-token prompt): every heap allocation of this test process is counted, and the peak
//! above what was held before the forward must not exceed the plan's estimate; the same for the
//! video and the audio decode. One test in the file, so no other test's allocations mix in.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::path::Path;
use vidgen::models::minimax_h3::audio_vae::{MiniMaxH3AudioVaeConfig, MiniMaxH3AudioVaeDecoder};
use vidgen::models::minimax_h3::layout::{
    pack_audio, row_timesteps, t2va_layout, T2vaGeometry, AUDIO_CHANNELS,
};
use vidgen::models::minimax_h3::transformer::{
    MiniMaxH3Transformer3DModel, MiniMaxH3TransformerConfig, CHUNK_ELEMENTS,
};
use vidgen::models::minimax_h3::vae::{MiniMaxH3VaeConfig, MiniMaxH3VaeDecoder};
use vidgen::models::patches::patchify;

const FIXTURE: &str = "minimax-h3-tiny-a";

#[global_allocator]
static ALLOCATOR: common::heap::Counting = common::heap::Counting;

/// The plan's activations of `stage` for the model in `dir` at `height` x `width` x `frames`
/// (f32, on the CPU), and the prompt length it plans with.
fn planned(dir: &Path, stage: &str, size: (usize, usize, usize)) -> (usize, usize) {
    let plan = common::heap::plan(dir, size);
    let text_len = plan["config"]["max_sequence_length"].as_u64().unwrap() as usize;
    (common::heap::stage_activations(&plan, stage), text_len)
}

/// Heap bytes one forward of `model` holds at most above what was held before it, on random
/// latents of the request's sizes with `text_len` prompt rows.
fn measured(
    model: &MiniMaxH3Transformer3DModel,
    g: &T2vaGeometry,
    text_len: usize,
) -> (usize, usize, usize) {
    let cfg = model.config();
    let dev = Device::Cpu;
    let latents = Tensor::randn(
        0f32,
        1.,
        (
            1,
            cfg.in_channels,
            g.num_latent_frames,
            g.latent_height,
            g.latent_width,
        ),
        &dev,
    )
    .unwrap();
    let video = patchify(&latents, cfg.patch_size).unwrap();
    let audio = pack_audio(
        &Tensor::randn(
            0f32,
            1.,
            (2, cfg.audio_in_channels, g.num_audio_latents),
            &dev,
        )
        .unwrap(),
    )
    .unwrap();
    let text = Tensor::randn(0f32, 1., (1, text_len, cfg.text_dim), &dev).unwrap();
    let layout = t2va_layout(&g.layout_sizes(text_len), cfg.patch_size, &dev).unwrap();
    let (t, t_idx) = row_timesteps(&layout, 900.0, 700.0).unwrap();
    assert_eq!(video.dtype(), DType::F32);
    let before = common::heap::start();
    let out = model
        .forward(&video, &audio, &text, &t, &t_idx, &layout)
        .unwrap();
    let peak = common::heap::peak_above(before);
    drop(out);
    let rows = layout.position_ids.dim(0).unwrap();
    (peak, rows, cfg.rows_per_chunk())
}

/// The fixture as it is (its sequence fits one chunk), then with a feed-forward wide enough
/// that the blocks run in chunks (zero weights: the values do not matter here; the configs
/// are read from a copy of the fixture's folder with the wider transformer).
#[test]
fn one_forward_allocates_no_more_than_the_plan_predicts() {
    let (height, width, frames) = (32usize, 32usize, 121usize);
    let fixture = common::named_fixture_dir(FIXTURE);
    let vae: MiniMaxH3VaeConfig = common::config_in(FIXTURE, "vae/config.json");
    let tiny: MiniMaxH3TransformerConfig = common::config_in(FIXTURE, "transformer/config.json");
    // One block and no refiner keep the wide matmuls few (the CPU test build is slow at them);
    // chunks of at most 1024 rows.
    let wide = MiniMaxH3TransformerConfig {
        ffn_dim: CHUNK_ELEMENTS / (2 * 1024),
        num_layers: 1,
        num_refiner_layers: 0,
        ..tiny.clone()
    };
    let wide_dir =
        std::env::temp_dir().join(format!("vidgen-h3-activations-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&wide_dir);
    copy_configs(&fixture, &wide_dir);
    std::fs::write(
        wide_dir.join("transformer/config.json"),
        serde_json::to_string(&serde_json::json!({
            "_class_name": "MiniMaxH3Transformer3DModel",
            "ffn_dim": wide.ffn_dim,
            "attention_head_dim": tiny.attention_head_dim,
            "audio_in_channels": tiny.audio_in_channels,
            "final_norm_eps": tiny.final_norm_eps,
            "freq_dim": tiny.freq_dim,
            "hidden_size": tiny.hidden_size,
            "in_channels": tiny.in_channels,
            "norm_eps": tiny.norm_eps,
            "num_attention_heads": tiny.num_attention_heads,
            "num_layers": wide.num_layers,
            "num_refiner_layers": wide.num_refiner_layers,
            "patch_size": tiny.patch_size,
            "qk_norm_eps": tiny.qk_norm_eps,
            "rope_freq_dim": tiny.rope_freq_dim,
            "rope_theta": tiny.rope_theta,
            "text_dim": tiny.text_dim,
            "time_embed_dim": tiny.time_embed_dim,
            "time_embed_hidden_dim": tiny.time_embed_hidden_dim,
        }))
        .unwrap(),
    )
    .unwrap();
    let g = T2vaGeometry::new(height, width, frames, &vae, tiny.patch_size).unwrap();
    let cases = [
        (
            "fixture",
            fixture.clone(),
            MiniMaxH3Transformer3DModel::new(
                &tiny,
                common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors"),
            )
            .unwrap(),
        ),
        (
            "wide feed-forward",
            wide_dir.clone(),
            MiniMaxH3Transformer3DModel::new(&wide, VarBuilder::zeros(DType::F32, &Device::Cpu))
                .unwrap(),
        ),
    ];
    for (name, dir, model) in &cases {
        let (predicted, text_len) = planned(dir, "denoise", (height, width, frames));
        let (peak, rows, chunk) = measured(model, &g, text_len);
        eprintln!(
            "{name}: {rows} packed rows in chunks of {chunk}: peak {peak} bytes above the inputs, predicted {predicted}"
        );
        assert!(
            peak <= predicted,
            "{name}: one forward held {peak} bytes, the plan predicts {predicted}"
        );
        if *name == "wide feed-forward" {
            assert!(chunk < rows, "{chunk} rows per chunk, {rows} rows");
        }
    }
    std::fs::remove_dir_all(&wide_dir).unwrap();

    // The video decode, each finished stretch of frames dropped at once (the pipeline moves it
    // to host memory).
    let decoder = MiniMaxH3VaeDecoder::new(
        &vae,
        common::var_builder_in(FIXTURE, "vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let (predicted, _) = planned(&fixture, "decode_video", (height, width, frames));
    let z = Tensor::randn(
        0f32,
        1.,
        (
            1,
            vae.latent_channels,
            g.num_latent_frames,
            g.latent_height,
            g.latent_width,
        ),
        &Device::Cpu,
    )
    .unwrap();
    let before = common::heap::start();
    let kept = decoder
        .decode_into(&z, |piece| piece.contiguous().map(drop))
        .unwrap();
    let peak = common::heap::peak_above(before);
    eprintln!(
        "decode of {kept} frames: peak {peak} bytes above the latents, predicted {predicted}"
    );
    assert_eq!(kept, frames + 3, "121 frames snap to 124");
    assert!(
        peak <= predicted,
        "the decode held {peak} bytes, the plan predicts {predicted}"
    );

    // The audio decode of the stereo batch, as the pipeline runs it.
    let audio: MiniMaxH3AudioVaeConfig = common::config_in(FIXTURE, "audio_vae/config.json");
    let audio_decoder = MiniMaxH3AudioVaeDecoder::new(
        &audio,
        common::var_builder_in(FIXTURE, "audio_vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let (predicted, _) = planned(&fixture, "decode_audio", (height, width, frames));
    let z = Tensor::randn(
        0f32,
        1.,
        (AUDIO_CHANNELS, audio.latent_channels, g.num_audio_latents),
        &Device::Cpu,
    )
    .unwrap();
    let before = common::heap::start();
    let waveform = audio_decoder
        .decode(&audio_decoder.denormalize(&z).unwrap())
        .unwrap();
    let peak = common::heap::peak_above(before);
    drop(waveform);
    eprintln!("audio decode: peak {peak} bytes above the latents, predicted {predicted}");
    assert!(
        peak <= predicted,
        "the audio decode held {peak} bytes, the plan predicts {predicted}"
    );
}

/// The fixture's folder without its weights (a dry run reads configs and the tokenizer only).
fn copy_configs(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_configs(&entry.path(), &target);
        } else if !entry
            .file_name()
            .to_string_lossy()
            .ends_with(".safetensors")
        {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}
