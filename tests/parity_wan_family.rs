//! Parity of the Wan family's model parts with diffusers 0.42.1 on the tiny fixtures:
//! Wan2.1 I2V (`wan21-i2v-tiny-a`: image branch of the transformer, condition latents),
//! Wan2.2 TI2V-5B (`wan22-ti2v-tiny-a`: per-token timesteps, the 48-channel VAE) and the two
//! Wan2.2 A14B experts (`wan22-a14b-tiny-a`).

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use vidgen::models::clip::load_rgb_image;
use vidgen::models::wan::condition::{
    first_frame_condition, first_frame_mask, image_condition, per_token_timesteps,
    preprocess_image, replace_first_frame,
};
use vidgen::models::wan::transformer::{
    WanTransformer3DModel, WanTransformerBlock, WanTransformerConfig,
};
use vidgen::models::wan::vae::{
    patchify, unpatchify, AutoencoderKLWan, WanVaeConfig, WanVaeTiling,
};

const I2V: &str = "wan21-i2v-tiny-a";
const TI2V: &str = "wan22-ti2v-tiny-a";
const A14B: &str = "wan22-a14b-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn check(what: &str, actual: &Tensor, expected: &Tensor) {
    eprintln!(
        "{what}: max |diff| {:e}",
        common::max_abs_diff(actual, expected)
    );
    common::assert_close(what, actual, expected, ATOL, RTOL);
}

fn transformer(fixture: &str, folder: &str) -> (WanTransformerConfig, WanTransformer3DModel) {
    let cfg: WanTransformerConfig = common::config_in(fixture, &format!("{folder}/config.json"));
    let vb = common::var_builder_in(
        fixture,
        &format!("{folder}/diffusion_pytorch_model.safetensors"),
    );
    let model = WanTransformer3DModel::new(&cfg, vb).unwrap();
    (cfg, model)
}

/// A `[seq, D/2]` pair table in diffusers' `[1, seq, 1, D]` repeat-interleaved layout.
fn interleave(t: &Tensor) -> Tensor {
    common::interleave_pairs(t)
        .unsqueeze(0)
        .unwrap()
        .unsqueeze(2)
        .unwrap()
}

/// Runs the staged forward (the offload engine's path: blocks built one by one) and checks every
/// `{prefix}debug.*` tensor the fixture holds, then the output against `output`.
fn check_staged(
    fixture: &str,
    folder: &str,
    r: &HashMap<String, Tensor>,
    prefix: &str,
    (latents, timestep, text, image): (&Tensor, &Tensor, &Tensor, Option<&Tensor>),
    output: &str,
) {
    let cfg: WanTransformerConfig = common::config_in(fixture, &format!("{folder}/config.json"));
    let vb = common::var_builder_in(
        fixture,
        &format!("{folder}/diffusion_pytorch_model.safetensors"),
    );
    let model = WanTransformer3DModel::new_without_blocks(&cfg, vb.clone()).unwrap();
    let mut inputs = model
        .prepare_with_image(latents, timestep, text, image)
        .unwrap();
    let d = |name: &str| format!("{prefix}debug.{name}");
    check(
        &d("rope_cos"),
        &interleave(&inputs.rope_cos),
        &r[&d("rope_cos")],
    );
    check(
        &d("rope_sin"),
        &interleave(&inputs.rope_sin),
        &r[&d("rope_sin")],
    );
    // Per-token references ([B, seq, ...]) against the entries spread over the tokens.
    let (temb, tp) = if r[&d("temb")].rank() == 3 {
        (
            inputs.per_token(&inputs.temb).unwrap(),
            inputs
                .per_token(&inputs.timestep_proj)
                .unwrap()
                .flatten_from(2)
                .unwrap(),
        )
    } else {
        (
            inputs.temb.clone(),
            inputs.timestep_proj.flatten_from(1).unwrap(),
        )
    };
    check(&d("temb"), &temb, &r[&d("temb")]);
    check(&d("timestep_proj"), &tp, &r[&d("timestep_proj")]);
    check(
        &d("text_embedder"),
        &inputs.encoder_hidden_states,
        &r[&d("text_embedder")],
    );
    if let Some(img) = &inputs.encoder_hidden_states_image {
        check(&d("image_embedder"), img, &r[&d("image_embedder")]);
    }
    let mut x = inputs.take_hidden_states().unwrap();
    let [gf, gh, gw] = inputs.grid;
    let patch = x
        .reshape((1, gf, gh, gw, cfg.inner_dim()))
        .unwrap()
        .permute((0, 4, 1, 2, 3))
        .unwrap();
    check(&d("patch_embedding"), &patch, &r[&d("patch_embedding")]);
    for k in 0..cfg.num_layers {
        let block = WanTransformerBlock::new(&cfg, vb.pp(format!("blocks.{k}"))).unwrap();
        x = block.forward(&x, &inputs).unwrap();
        check(&d(&format!("block.{k}")), &x, &r[&d(&format!("block.{k}"))]);
    }
    let out = model.finish(&x, &inputs).unwrap();
    check(output, &out, &r[output]);
}

fn float_timestep(t: f32) -> Tensor {
    Tensor::new(&[t], &Device::Cpu).unwrap()
}

#[test]
fn i2v_transformer_matches_diffusers() {
    let (cfg, model) = transformer(I2V, "transformer");
    assert!(cfg.has_image_branch());
    let r = common::named_reference(I2V, "transformer");
    let (x, text, image) = (
        &r["hidden_states"],
        &r["encoder_hidden_states"],
        &r["encoder_hidden_states_image"],
    );
    let out = model
        .forward_with_image(x, &r["timestep_int"], text, Some(image))
        .unwrap();
    check("output_t999", &out, &r["output_t999"]);
    let out = model
        .forward_with_image(x, &float_timestep(937.5), text, Some(image))
        .unwrap();
    check("output_t937_5", &out, &r["output_t937_5"]);
    check_staged(
        I2V,
        "transformer",
        &r,
        "",
        (x, &r["timestep_int"], text, Some(image)),
        "output_t999",
    );
}

#[test]
fn i2v_transformer_refuses_what_diffusers_would_split_wrongly() {
    let (_, model) = transformer(I2V, "transformer");
    let r = common::named_reference(I2V, "transformer");
    let (x, t, text, image) = (
        &r["hidden_states"],
        &r["timestep_int"],
        &r["encoder_hidden_states"],
        &r["encoder_hidden_states_image"],
    );
    // No image tokens.
    assert!(model.forward(x, t, text).is_err());
    // A text context of another length than 512.
    let short = text.narrow(1, 0, 20).unwrap();
    let err = model
        .forward_with_image(x, t, &short, Some(image))
        .unwrap_err()
        .to_string();
    assert!(err.contains("512"), "{err}");
    // Image tokens given to a text-to-video model.
    let (_, t2v) = transformer(A14B, "transformer");
    let ra = common::named_reference(A14B, "transformer");
    assert!(t2v
        .forward_with_image(
            &ra["hidden_states"],
            &ra["timestep_int"],
            &ra["encoder_hidden_states"],
            Some(image)
        )
        .is_err());
}

#[test]
fn ti2v_transformer_per_token_timesteps_match_diffusers() {
    let (_, model) = transformer(TI2V, "transformer");
    let r = common::named_reference(TI2V, "transformer");
    let (x, text) = (&r["hidden_states"], &r["encoder_hidden_states"]);
    let out = model.forward(x, &r["timestep_int"], text).unwrap();
    check("output_t999", &out, &r["output_t999"]);
    assert_eq!(r["timestep_expanded"].dtype(), DType::F32);
    let out = model.forward(x, &r["timestep_expanded"], text).unwrap();
    check("expanded.output", &out, &r["expanded.output"]);
    let out = model.forward(x, &r["timestep_i2v"], text).unwrap();
    check("i2v_ts.output", &out, &r["i2v_ts.output"]);
    check_staged(
        TI2V,
        "transformer",
        &r,
        "expanded.",
        (x, &r["timestep_expanded"], text, None),
        "expanded.output",
    );
    // Equal per-token timesteps need one embedding per video; TI2V image-to-video's (frame 0
    // at 0) one per run, the staged path giving the same output.
    let (_, model) = transformer(TI2V, "transformer");
    let inputs = model.prepare(x, &r["timestep_expanded"], text).unwrap();
    assert!(!inputs.per_token_timesteps());
    let inputs = model.prepare(x, &r["timestep_i2v"], text).unwrap();
    let runs = inputs.timestep_runs.clone().unwrap();
    assert_eq!(
        runs.iter().map(|r| (r.row0, r.len)).collect::<Vec<_>>(),
        vec![(0, 4), (4, 4)]
    );
    assert_eq!(inputs.temb.dims(), &[2, 24]);
    let mut staged = inputs.clone();
    let mut h = staged.take_hidden_states().unwrap();
    let cfg: WanTransformerConfig = common::config_in(TI2V, "transformer/config.json");
    let vb = common::var_builder_in(TI2V, "transformer/diffusion_pytorch_model.safetensors");
    for k in 0..cfg.num_layers {
        let block = WanTransformerBlock::new(&cfg, vb.pp(format!("blocks.{k}"))).unwrap();
        h = block.forward(&h, &staged).unwrap();
    }
    check(
        "i2v_ts.output (staged)",
        &model.finish(&h, &staged).unwrap(),
        &r["i2v_ts.output"],
    );
    // A per-token timestep with the wrong token count is refused.
    let wrong = r["timestep_expanded"].narrow(1, 0, 5).unwrap();
    assert!(model.forward(x, &wrong, text).is_err());
}

#[test]
fn per_token_timesteps_batch_of_two() {
    let (_, model) = transformer(TI2V, "transformer");
    let r = common::named_reference(TI2V, "transformer");
    let two = |t: &Tensor| Tensor::cat(&[t, t], 0).unwrap();
    let x = two(&r["hidden_states"]);
    let text = two(&r["encoder_hidden_states"]);
    let ts = Tensor::cat(&[&r["timestep_expanded"], &r["timestep_i2v"]], 0).unwrap();
    let out = model.forward(&x, &ts, &text).unwrap();
    check(
        "batch[0]",
        &out.narrow(0, 0, 1).unwrap(),
        &r["expanded.output"],
    );
    check(
        "batch[1]",
        &out.narrow(0, 1, 1).unwrap(),
        &r["i2v_ts.output"],
    );
}

#[test]
fn a14b_experts_match_diffusers() {
    let r = common::named_reference(A14B, "transformer");
    let (x, text) = (&r["hidden_states"], &r["encoder_hidden_states"]);
    let (_, high) = transformer(A14B, "transformer");
    let (_, low) = transformer(A14B, "transformer_2");
    let out = high.forward(x, &r["timestep_int"], text).unwrap();
    check(
        "transformer.t999.output",
        &out,
        &r["transformer.t999.output"],
    );
    let out = low.forward(x, &r["timestep_low"], text).unwrap();
    check(
        "transformer_2.t500.output",
        &out,
        &r["transformer_2.t500.output"],
    );
    let out = low.forward(x, &r["timestep_int"], text).unwrap();
    check(
        "transformer_2.t999.output",
        &out,
        &r["transformer_2.t999.output"],
    );
    check_staged(
        A14B,
        "transformer_2",
        &r,
        "transformer_2.t500.",
        (x, &r["timestep_low"], text, None),
        "transformer_2.t500.output",
    );
}

#[test]
fn transformer_config_validation() {
    let cfg: WanTransformerConfig = common::config_in(I2V, "transformer/config.json");
    cfg.validate().unwrap();
    let mut bad = cfg.clone();
    bad.added_kv_proj_dim = Some(cfg.inner_dim() + 1);
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("added_kv_proj_dim"));
    let mut bad = cfg.clone();
    bad.image_dim = None;
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("image_dim"));
    let mut bad = cfg;
    bad.pos_embed_seq_len = Some(514);
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("pos_embed_seq_len"));
}

fn vae(fixture: &str) -> AutoencoderKLWan {
    let cfg: WanVaeConfig = common::config_in(fixture, "vae/config.json");
    let vb = common::var_builder_in(fixture, "vae/diffusion_pytorch_model.safetensors");
    AutoencoderKLWan::new(&cfg, vb).unwrap()
}

#[test]
fn wan22_vae_config_sizes() {
    let cfg: WanVaeConfig = common::config_in(TI2V, "vae/config.json");
    cfg.validate().unwrap();
    assert!(cfg.is_residual());
    assert_eq!(cfg.scale_factor_spatial(), 16);
    assert_eq!(cfg.scale_factor_temporal(), 4);
    let mut bad = cfg.clone();
    bad.patch_size = Some(0);
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("patch_size"));
    let mut bad = cfg;
    bad.dim_mult = vec![1, 3, 4, 4];
    assert!(bad.validate().unwrap_err().to_string().contains("dim_mult"));
}

#[test]
fn wan22_vae_decode_matches_diffusers() {
    let vae = vae(TI2V);
    let r = common::named_reference(TI2V, "vae");
    let z = vae.denormalize(&r["decode.latents_normalized"]).unwrap();
    check(
        "decode.latents_denormalized",
        &z,
        &r["decode.latents_denormalized"],
    );
    let video = vae.decode(&r["decode.latents_denormalized"]).unwrap();
    check("decode.video", &video, &r["decode.video"]);
    let one = r["decode.latents_denormalized"].narrow(2, 0, 1).unwrap();
    check(
        "decode1.video",
        &vae.decode(&one).unwrap(),
        &r["decode1.video"],
    );
}

#[test]
fn wan22_vae_encode_matches_diffusers() {
    let vae = vae(TI2V);
    let r = common::named_reference(TI2V, "vae");
    let video = &r["encode.video"];
    let patched = patchify(&video.narrow(2, 0, 1).unwrap(), 2).unwrap();
    check(
        "encode.debug.patchified_frame0",
        &patched,
        &r["encode.debug.patchified_frame0"],
    );
    check(
        "unpatchify(patchify)",
        &unpatchify(&patched, 2).unwrap(),
        &video.narrow(2, 0, 1).unwrap(),
    );
    let (mean, logvar) = vae.encode(video).unwrap();
    check(
        "encode.latent_dist.mean",
        &mean,
        &r["encode.latent_dist.mean"],
    );
    check(
        "encode.latent_dist.logvar",
        &logvar,
        &r["encode.latent_dist.logvar"],
    );
}

#[test]
fn wan22_vae_tiled_decode_of_one_tile_is_the_decode() {
    let vae = vae(TI2V);
    let r = common::named_reference(TI2V, "vae");
    let tiling = WanVaeTiling {
        tile_min_height: 32,
        tile_min_width: 32,
        tile_stride_height: 16,
        tile_stride_width: 16,
    };
    // Tiles of 2x2 latents every latent: runs the patch-aware blending; the whole-tile case
    // must equal the plain decode.
    let tiled = vae
        .decode_tiled(&r["decode.latents_denormalized"], &tiling)
        .unwrap();
    assert_eq!(tiled.dims(), r["decode.video"].dims());
    let whole = vae
        .decode_tiled(&r["decode.latents_denormalized"], &WanVaeTiling::default())
        .unwrap();
    check("decode_tiled (one tile)", &whole, &r["decode.video"]);
}

fn input_image(fixture: &str) -> image::RgbImage {
    load_rgb_image(&common::named_fixture_dir(fixture).join("reference/input.png")).unwrap()
}

#[test]
fn i2v_condition_latents_match_diffusers() {
    let vae = vae(I2V);
    let r = common::named_reference(I2V, "vae");
    let (_, _, frames, h, w) = r["video_condition"].dims5().unwrap();
    let sf = vae.config().scale_factor_spatial();
    let image = preprocess_image(&input_image(I2V), h, w, sf, &Device::Cpu).unwrap();
    check("image", &image, &r["image"]);
    let (mean, _) = vae.encode(&r["video_condition"]).unwrap();
    check("latent_dist.mean", &mean, &r["latent_dist.mean"]);
    let condition = image_condition(&vae, &image, frames, 1, DType::F32).unwrap();
    check("condition", &condition, &r["condition"]);
    check("mask", &condition.narrow(1, 0, 4).unwrap(), &r["mask"]);
    // Batch of two: the same condition twice; a frame count that is not 1 + 4k is refused.
    let two = image_condition(&vae, &image, frames, 2, DType::F32).unwrap();
    check(
        "condition[1]",
        &two.narrow(0, 1, 1).unwrap(),
        &r["condition"],
    );
    assert!(image_condition(&vae, &image, frames - 1, 1, DType::F32).is_err());

    // What the transformer got at step 0: [latents | condition].
    let p = common::named_reference(I2V, "pipeline");
    let input = Tensor::cat(&[&p["latents_init"], &condition], 1).unwrap();
    check(
        "cfg5.step0.latent_model_input",
        &input,
        &p["cfg5.step0.latent_model_input"],
    );
}

#[test]
fn ti2v_first_frame_condition_matches_diffusers() {
    let vae = vae(TI2V);
    let p = common::named_reference(TI2V, "pipeline_i2v");
    let (_, _, h, w) = p["image"].dims4().unwrap();
    let sf = vae.config().scale_factor_spatial();
    let image = preprocess_image(&input_image(TI2V), h, w, sf, &Device::Cpu).unwrap();
    check("image", &image, &p["image"]);
    let condition = first_frame_condition(&vae, &image, 1, DType::F32).unwrap();
    check("condition", &condition, &p["condition"]);
    let latents = &p["latents_init"];
    let (_, _, frames, lh, lw) = latents.dims5().unwrap();
    let mask = first_frame_mask(frames, (lh, lw), DType::F32, &Device::Cpu).unwrap();
    check("first_frame_mask", &mask, &p["first_frame_mask"]);
    let input = replace_first_frame(latents, &condition, &mask).unwrap();
    check(
        "i2v_cfg5.step0.latent_model_input",
        &input,
        &p["i2v_cfg5.step0.latent_model_input"],
    );
    // Per-token timesteps: 0 on frame 0's tokens, t elsewhere (timesteps of the 3-step run).
    for (i, t) in [999.0, 909.0, 714.0].into_iter().enumerate() {
        let ts = per_token_timesteps(t, &mask, 1, (2, 2)).unwrap();
        let name = format!("i2v_cfg5.step{i}.timestep");
        common::assert_close(&name, &ts, &p[&name], 0.0, 0.0);
    }
    // T2V: a mask of ones gives t everywhere.
    let t2v = common::named_reference(TI2V, "pipeline");
    let ones = mask.ones_like().unwrap();
    let ts = per_token_timesteps(999.0, &ones, 1, (2, 2)).unwrap();
    common::assert_close(
        "cfg5.step0.timestep",
        &ts,
        &t2v["cfg5.step0.timestep"],
        0.0,
        0.0,
    );
    // After the loop frame 0 is the condition again: the decode input's frame 0 is the
    // de-normalised condition.
    let decode_in = &p["i2v_cfg5.vae_decode_input"];
    let denorm = vae.denormalize(&condition).unwrap();
    check(
        "i2v_cfg5.vae_decode_input[frame 0]",
        &decode_in.narrow(2, 0, 1).unwrap(),
        &denorm,
    );
}

/// The transformer inputs the I2V pipeline builds (prompt embeds of the text encoder, image
/// embeds of the image encoder, [latents | condition]) give its step-0 noise predictions.
#[test]
fn i2v_step0_noise_predictions_match_diffusers() {
    let (_, model) = transformer(I2V, "transformer");
    let text = common::named_reference(I2V, "text_encoder");
    let image = common::named_reference(I2V, "image_encoder");
    let p = common::named_reference(I2V, "pipeline");
    let input = &p["cfg5.step0.latent_model_input"];
    let t = p["cfg5.step0.timestep"].to_dtype(DType::I64).unwrap();
    let embeds = &text["prompt_embeds"];
    for (row, name) in [
        (0, "cfg5.step0.noise_pred_cond"),
        (1, "cfg5.step0.noise_pred_uncond"),
    ] {
        let out = model
            .forward_with_image(
                input,
                &t,
                &embeds.narrow(0, row, 1).unwrap(),
                Some(&image["image_embeds"]),
            )
            .unwrap();
        check(name, &out, &p[name]);
    }
}

/// Wan2.2 TI2V image-to-video: the step-0 input with per-token timesteps (0 on frame 0).
#[test]
fn ti2v_i2v_step0_noise_predictions_match_diffusers() {
    let (_, model) = transformer(TI2V, "transformer");
    let text = common::named_reference(TI2V, "text_encoder");
    let p = common::named_reference(TI2V, "pipeline_i2v");
    let input = &p["i2v_cfg5.step0.latent_model_input"];
    let t = &p["i2v_cfg5.step0.timestep"];
    let embeds = &text["prompt_embeds"];
    for (row, name) in [
        (0, "i2v_cfg5.step0.noise_pred_cond"),
        (1, "i2v_cfg5.step0.noise_pred_uncond"),
    ] {
        let out = model
            .forward(input, t, &embeds.narrow(0, row, 1).unwrap())
            .unwrap();
        check(name, &out, &p[name]);
    }
    // Both CFG branches in one batch.
    let two = Tensor::cat(&[input, input], 0).unwrap();
    let out = model.forward(&two, t, embeds).unwrap();
    check(
        "batched uncond",
        &out.narrow(0, 1, 1).unwrap(),
        &p["i2v_cfg5.step0.noise_pred_uncond"],
    );
}
