//! The whole MiniMax H3 `t2va` call chained from the model parts (tokenizer, text encoder,
//! layout, both schedules, transformer, video and audio decode) against diffusers' frames and
//! stereo audio on the tiny fixture, for two prompts with the same initial noise.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::minimax_h3::audio_vae::{
    stereo_from_batch, MiniMaxH3AudioVaeConfig, MiniMaxH3AudioVaeDecoder,
};
use vidgen::models::minimax_h3::layout::{
    pack_audio, row_timesteps, t2va_layout, unpack_audio, T2vaGeometry,
};
use vidgen::models::minimax_h3::text_encoder::{
    MiniMaxH3TextEncoder, MiniMaxH3Tokenizer, Qwen3VLConfig,
};
use vidgen::models::minimax_h3::transformer::{
    MiniMaxH3Transformer3DModel, MiniMaxH3TransformerConfig,
};
use vidgen::models::minimax_h3::vae::{
    decoded_to_unit_range, MiniMaxH3VaeConfig, MiniMaxH3VaeDecoder,
};
use vidgen::models::patches::{patchify, unpatchify};
use vidgen::schedulers::minimax_h3::{MiniMaxH3Schedule, MiniMaxH3SchedulerConfig};

const ATOL: f64 = 3e-5;
const RTOL: f64 = 3e-5;

fn dir() -> std::path::PathBuf {
    common::named_fixture_dir("minimax-h3-tiny-a")
}

fn json<T: serde::de::DeserializeOwned>(path: &str) -> T {
    serde_json::from_str(&std::fs::read_to_string(dir().join(path)).unwrap()).unwrap()
}

fn var_builder(path: &str) -> VarBuilder<'static> {
    let path = dir().join(path);
    unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu).unwrap() }
}

/// Runs the `t2va` stages in order for `prompt` from the given initial noise; returns the final
/// video latents, the frames `[1, T, H, W, 3]` and the audio `[1, 2, samples]`.
fn t2va(
    prompt: &str,
    latents: &Tensor,
    audio_latents: &Tensor,
    steps: usize,
) -> (Tensor, Tensor, Tensor) {
    let device = Device::Cpu;
    // 1. Text: tokenizer, Qwen3-VL to hidden state 50.
    let tokenizer = MiniMaxH3Tokenizer::from_file(&dir().join("tokenizer/tokenizer.json")).unwrap();
    let ids = tokenizer.encode(prompt).unwrap();
    let ids = Tensor::new(ids.as_slice(), &device)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let te_cfg = Qwen3VLConfig::from_file(&dir().join("text_encoder/config.json")).unwrap();
    let encoder = MiniMaxH3TextEncoder::new(
        &te_cfg.text_config,
        var_builder("text_encoder/model.safetensors"),
    )
    .unwrap();
    let prompt_embeds = encoder.forward(&ids).unwrap();

    // 2. Geometry and layout.
    let tr_cfg: MiniMaxH3TransformerConfig = json("transformer/config.json");
    let vae_cfg: MiniMaxH3VaeConfig = json("vae/config.json");
    let geometry = T2vaGeometry::new(16, 24, 121, &vae_cfg, tr_cfg.patch_size).unwrap();
    let layout = t2va_layout(
        &geometry.layout_sizes(prompt_embeds.dim(1).unwrap()),
        tr_cfg.patch_size,
        &device,
    )
    .unwrap();

    // 3. Denoise: one forward per step, both schedules.
    let video_schedule = MiniMaxH3Schedule::new(
        &json::<MiniMaxH3SchedulerConfig>("scheduler/scheduler_config.json"),
        steps,
    )
    .unwrap();
    let audio_schedule = MiniMaxH3Schedule::new(
        &json::<MiniMaxH3SchedulerConfig>("audio_scheduler/scheduler_config.json"),
        steps,
    )
    .unwrap();
    let model = MiniMaxH3Transformer3DModel::new(
        &tr_cfg,
        var_builder("transformer/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let mut video = patchify(latents, tr_cfg.patch_size).unwrap();
    let mut audio = pack_audio(audio_latents).unwrap();
    for i in 0..video_schedule.timesteps.len() {
        let (t, t_idx) = row_timesteps(
            &layout,
            video_schedule.timesteps[i],
            audio_schedule.timesteps[i],
        )
        .unwrap();
        let (v, a) = model
            .forward(&video, &audio, &prompt_embeds, &t, &t_idx, &layout)
            .unwrap();
        video = video_schedule.step(i, &v, &video).unwrap();
        audio = audio_schedule.step(i, &a, &audio).unwrap();
    }
    let grid = geometry.token_grid(tr_cfg.patch_size);
    let final_latents = unpatchify(&video, grid, tr_cfg.patch_size).unwrap();

    // 4. Decode video and audio.
    let vae = MiniMaxH3VaeDecoder::new(
        &vae_cfg,
        var_builder("vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let decoded = vae
        .decode(&vae.denormalize(&final_latents).unwrap())
        .unwrap();
    let frames = decoded_to_unit_range(&decoded)
        .unwrap()
        .permute((0, 2, 3, 4, 1))
        .unwrap();
    let audio_cfg: MiniMaxH3AudioVaeConfig = json("audio_vae/config.json");
    let audio_vae = MiniMaxH3AudioVaeDecoder::new(
        &audio_cfg,
        var_builder("audio_vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let audio_latents = unpack_audio(&audio, 2).unwrap();
    let waveform = audio_vae
        .decode(&audio_vae.denormalize(&audio_latents).unwrap())
        .unwrap();
    (final_latents, frames, stereo_from_batch(&waveform).unwrap())
}

#[test]
fn whole_t2va_call_matches_diffusers() {
    let r = common::reference_in(&dir(), "pipeline");
    let readme: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir().join("reference/README.json")).unwrap(),
    )
    .unwrap();
    let prompts = &readme["preset"]["prompts"];
    let steps = readme["preset"]["num_inference_steps"].as_u64().unwrap() as usize;
    let (latents, frames, audio) = t2va(
        prompts[0].as_str().unwrap(),
        &r["latents_init"],
        &r["audio_latents_init"],
        steps,
    );
    common::assert_close("final.latents", &latents, &r["final.latents"], ATOL, RTOL);
    common::assert_close("videos", &frames, &r["videos"], ATOL, RTOL);
    common::assert_close("audio", &audio, &r["audio"], ATOL, RTOL);

    let (latents, _, audio) = t2va(
        prompts[1].as_str().unwrap(),
        &r["latents_init"],
        &r["audio_latents_init"],
        steps,
    );
    common::assert_close(
        "alt_prompt.final.latents",
        &latents,
        &r["alt_prompt.final.latents"],
        ATOL,
        RTOL,
    );
    common::assert_close(
        "alt_prompt.audio",
        &audio,
        &r["alt_prompt.audio"],
        ATOL,
        RTOL,
    );
}
