//! Parity of MiniMax H3's packed layout and denoising loop (layout, per-row timesteps, three
//! transformer forwards and both schedules) with diffusers' `t2va` call on the tiny fixture.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vidgen::models::minimax_h3::layout::{
    pack_audio, row_timesteps, t2va_layout, unpack_audio, LayoutSizes, T2vaGeometry,
};
use vidgen::models::minimax_h3::transformer::{
    MiniMaxH3Transformer3DModel, MiniMaxH3TransformerConfig,
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

fn assert_exact(what: &str, actual: &Tensor, expected: &Tensor) {
    common::assert_close(what, actual, expected, 0.0, 0.0);
}

#[test]
fn layout_and_denoise_loop_match_diffusers() {
    let r = common::reference_in(&dir(), "pipeline");
    let cfg: MiniMaxH3TransformerConfig = json("transformer/config.json");
    let latents_init = &r["latents_init"];
    let (_, _, frames, lh, lw) = latents_init.dims5().unwrap();
    let audio_init = &r["audio_latents_init"];
    let (audio_channels, _, na) = audio_init.dims3().unwrap();
    let text_len = r["prompt_embeds"].dim(1).unwrap();
    let sizes = LayoutSizes {
        num_text_tokens: text_len,
        num_latent_frames: frames,
        latent_height: lh,
        latent_width: lw,
        num_audio_latents: na,
        audio_channels,
    };
    let layout = t2va_layout(&sizes, cfg.patch_size, &Device::Cpu).unwrap();
    assert_eq!(layout.position_ids.dtype(), DType::F64);
    let pos32 = layout.position_ids.to_dtype(DType::F32).unwrap();
    assert_exact("position_ids", &pos32, &r["layout.position_ids"]);
    assert_exact("token_tags", &layout.token_tags, &r["layout.token_tags"]);
    assert_exact(
        "video_indices",
        &layout.video_indices,
        &r["layout.video_indices"],
    );
    assert_exact(
        "audio_indices",
        &layout.audio_indices,
        &r["layout.audio_indices"],
    );
    assert_exact(
        "text_indices",
        &layout.text_indices,
        &r["layout.text_indices"],
    );

    let steps = r["timesteps"].dim(0).unwrap() + 1;
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
    assert_eq!(
        video_schedule.timesteps,
        r["timesteps"].to_vec1::<f32>().unwrap()
    );
    assert_eq!(
        audio_schedule.timesteps,
        r["audio_timesteps"].to_vec1::<f32>().unwrap()
    );

    let path = dir().join("transformer/diffusion_pytorch_model.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu).unwrap() };
    let model = MiniMaxH3Transformer3DModel::new(&cfg, vb).unwrap();
    let mut video = patchify(latents_init, cfg.patch_size).unwrap();
    let mut audio = pack_audio(audio_init).unwrap();
    for i in 0..video_schedule.timesteps.len() {
        let (t, t_idx) = row_timesteps(
            &layout,
            video_schedule.timesteps[i],
            audio_schedule.timesteps[i],
        )
        .unwrap();
        assert_exact(
            &format!("step{i}.timestep"),
            &t,
            &r[&format!("step{i}.timestep")],
        );
        assert_exact(
            &format!("step{i}.timestep_indices"),
            &t_idx,
            &r[&format!("step{i}.timestep_indices")],
        );
        let p = |name: &str| format!("step{i}.{name}");
        common::assert_close(
            &p("hidden_states"),
            &video,
            &r[&p("hidden_states")],
            ATOL,
            RTOL,
        );
        common::assert_close(
            &p("audio_hidden_states"),
            &audio,
            &r[&p("audio_hidden_states")],
            ATOL,
            RTOL,
        );
        let (v_pred, a_pred) = model
            .forward(&video, &audio, &r["prompt_embeds"], &t, &t_idx, &layout)
            .unwrap();
        common::assert_close(&p("noise_pred"), &v_pred, &r[&p("noise_pred")], ATOL, RTOL);
        common::assert_close(
            &p("audio_noise_pred"),
            &a_pred,
            &r[&p("audio_noise_pred")],
            ATOL,
            RTOL,
        );
        video = video_schedule.step(i, &v_pred, &video).unwrap();
        audio = audio_schedule.step(i, &a_pred, &audio).unwrap();
        common::assert_close(
            &p("latents"),
            &video.squeeze(0).unwrap(),
            &r[&p("latents")],
            ATOL,
            RTOL,
        );
        common::assert_close(
            &p("audio_latents"),
            &audio.squeeze(0).unwrap(),
            &r[&p("audio_latents")],
            ATOL,
            RTOL,
        );
    }
    let [pt, ph, pw] = cfg.patch_size;
    let grid = [frames / pt, lh / ph, lw / pw];
    let final_video = unpatchify(&video, grid, cfg.patch_size).unwrap();
    common::assert_close(
        "final.latents",
        &final_video,
        &r["final.latents"],
        ATOL,
        RTOL,
    );
    let final_audio = unpack_audio(&audio, audio_channels).unwrap();
    common::assert_close(
        "final.audio_latents",
        &final_audio,
        &r["final.audio_latents"],
        ATOL,
        RTOL,
    );
}

#[test]
fn packing_round_trips() {
    let r = common::reference_in(&dir(), "transformer");
    let rows = patchify(&r["input.latents"], [1, 2, 2]).unwrap();
    assert_exact("patchify", &rows, &r["hidden_states"]);
    let back = unpatchify(&rows, [37, 2, 3], [1, 2, 2]).unwrap();
    assert_exact("unpatchify", &back, &r["input.latents"]);
    assert!(patchify(&r["input.latents"], [1, 3, 2]).is_err());
}

#[test]
fn geometry_matches_diffusers() {
    let vae: vidgen::models::minimax_h3::vae::MiniMaxH3VaeConfig = json("vae/config.json");
    let r = common::reference_in(&dir(), "pipeline");
    let g = T2vaGeometry::new(16, 24, 121, &vae, [1, 2, 2]).unwrap();
    assert_eq!(g.num_frames, r["videos"].dim(1).unwrap());
    let (_, _, frames, lh, lw) = r["latents_init"].dims5().unwrap();
    assert_eq!(
        (g.num_latent_frames, g.latent_height, g.latent_width),
        (frames, lh, lw)
    );
    assert_eq!(g.num_audio_latents, r["audio_latents_init"].dim(2).unwrap());
    assert_eq!(g.layout_sizes(27).audio_channels, 2);
    // 17n + 5 counts stay, others snap up; the window is checked on the snapped count.
    assert_eq!(
        T2vaGeometry::new(16, 24, 124, &vae, [1, 2, 2])
            .unwrap()
            .num_frames,
        124
    );
    assert!(T2vaGeometry::new(16, 24, 100, &vae, [1, 2, 2]).is_err());
    assert!(T2vaGeometry::new(16, 24, 360, &vae, [1, 2, 2]).is_err());
    assert!(T2vaGeometry::new(12, 24, 121, &vae, [1, 2, 2]).is_err());
}
