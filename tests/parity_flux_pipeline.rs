//! The FLUX components chained as `FluxPipeline.__call__` chains them (the `cfg1` run of
//! `flux-tiny-a`: true_cfg_scale 1, embedded guidance 3.5), against every recorded step: the
//! transformer's timestep input, each step's prediction and latents, the decode input (unpacked,
//! `z / scaling_factor + shift_factor`) and the image.

mod common;

use candle_core::{DType, Device, Tensor};
use vidgen::models::autoencoder_kl::{AutoencoderKL, AutoencoderKLConfig};
use vidgen::models::flux::packing::unpack;
use vidgen::models::flux::transformer::{
    image_ids, timestep_input, FluxTransformer2DModel, FluxTransformerConfig,
};
use vidgen::schedulers::euler::{FlowMatchEuler, FlowMatchEulerConfig};
use vidgen::schedulers::Scheduler;

const FIXTURE: &str = "flux-tiny-a";
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

#[test]
fn the_cfg1_run_matches_diffusers_step_by_step() {
    let cpu = &Device::Cpu;
    let text = common::named_reference(FIXTURE, "text_encoder");
    let r = common::named_reference(FIXTURE, "pipeline");
    // The pipeline's prompt is the text encoder call's first.
    let embeds = text["prompt_embeds"].narrow(0, 0, 1).unwrap();
    let pooled = text["pooled_prompt_embeds"].narrow(0, 0, 1).unwrap();
    let cfg: FluxTransformerConfig = common::config_in(FIXTURE, "transformer/config.json");
    let vb = common::var_builder_in(FIXTURE, "transformer/diffusion_pytorch_model.safetensors");
    let model = FluxTransformer2DModel::new(&cfg, vb).unwrap();
    let vae_cfg: AutoencoderKLConfig = common::config_in(FIXTURE, "vae/config.json");
    let vae_vb = common::var_builder_in(FIXTURE, "vae/diffusion_pytorch_model.safetensors");
    let vae = AutoencoderKL::new(&vae_cfg, vae_vb).unwrap();
    let scheduler_cfg = FlowMatchEulerConfig::from_file(
        common::named_fixture_dir(FIXTURE).join("scheduler/scheduler_config.json"),
    )
    .unwrap();

    // The 48x64 image: a 6x8 latent, 3x4 packed tokens.
    let (h, w) = (6, 8);
    let mut latents = r["latents_init"].clone();
    let steps = 3;
    let mut scheduler =
        FlowMatchEuler::for_sequence_length(&scheduler_cfg, steps, latents.dim(1).unwrap())
            .unwrap();
    let guidance = Tensor::new(&[3.5f32], cpu).unwrap();
    common::assert_close("guidance", &guidance, &r["cfg1.guidance"], 0.0, 0.0);
    let txt_ids = Tensor::zeros((embeds.dim(1).unwrap(), 3), DType::F32, cpu).unwrap();
    let img_ids = image_ids(h / 2, w / 2, cpu).unwrap();
    let timesteps = scheduler.timesteps().to_vec();
    for (i, &t) in timesteps.iter().enumerate() {
        let timestep = timestep_input(t, DType::F32, cpu).unwrap();
        let step = |name: &str| r[&format!("cfg1.step{i}.{name}")].clone();
        common::assert_close(
            &format!("step{i}.timestep"),
            &timestep,
            &step("timestep"),
            0.0,
            0.0,
        );
        let noise = model
            .forward(
                &latents,
                &timestep,
                &embeds,
                &pooled,
                Some(&guidance),
                &txt_ids,
                &img_ids,
            )
            .unwrap();
        let what = format!("step{i}.noise_pred_cond");
        common::assert_close(&what, &noise, &step("noise_pred_cond"), ATOL, RTOL);
        latents = scheduler.step(&noise, &latents).unwrap();
        let what = format!("step{i}.latents");
        common::assert_close(&what, &latents, &step("latents"), ATOL, RTOL);
    }
    let z = vae.unscale(&unpack(&latents, h, w).unwrap()).unwrap();
    common::assert_close(
        "vae_decode_input",
        &z,
        &r["cfg1.vae_decode_input"],
        ATOL,
        RTOL,
    );
    // `(image / 2 + 0.5).clamp(0, 1)` as [1, 1, H, W, 3].
    let image = ((vae.decode(&z).unwrap() * 0.5).unwrap() + 0.5)
        .unwrap()
        .clamp(0f32, 1f32)
        .unwrap()
        .permute((0, 2, 3, 1))
        .unwrap()
        .unsqueeze(1)
        .unwrap();
    common::assert_close("frames", &image, &r["cfg1.frames"], ATOL, RTOL);
}
