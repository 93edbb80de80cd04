//! Tiled VAE decodes against diffusers 0.42.1's `tiled_decode` (`tests/fixtures/*-tiling`, made
//! by the script beside each reference from the tiny fixtures' VAEs with tiles small enough to
//! split their latents into several overlapping tiles), and the CLI's `--vae-tiling` in the
//! plan.

mod common;

use candle_core::Tensor;
use common::{assert_close, config_in, named_fixture_dir, var_builder_in};
use std::collections::HashMap;
use vidgen::cli::{parse, Parsed};
use vidgen::config::ResolvedConfig;
use vidgen::models::autoencoder_kl::{AutoencoderKL, AutoencoderKLConfig};
use vidgen::models::cogvideox::vae::{AutoencoderKLCogVideoX, CogVideoXVaeConfig};
use vidgen::models::ltx::vae::{AutoencoderKLLTXVideo, GivenNoise, LtxVaeConfig, LtxVaeTiling};
use vidgen::models::mochi::vae::{AutoencoderKLMochi, MochiVaeConfig, DEFAULT_TILING};
use vidgen::models::source::ModelSource;
use vidgen::models::vae_tiling::{OverlapTiles, SampleTiles};
use vidgen::pipeline::plan::Planner;
use vidgen::pipeline::registry::{self, Configs};

/// The fixtures README's tolerance for f32 references.
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

/// `tests/fixtures/<dir>/vae_tiled.safetensors`.
fn tiled_reference(dir: &str) -> HashMap<String, Tensor> {
    let path = named_fixture_dir(dir).join("vae_tiled.safetensors");
    candle_core::safetensors::load(&path, &candle_core::Device::Cpu)
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

#[test]
fn cogvideox_tiled_decode_matches_diffusers() {
    let fixture = "cogvideox-tiny-a";
    let cfg: CogVideoXVaeConfig = config_in(fixture, "vae/config.json");
    let vae = AutoencoderKLCogVideoX::new_decoder_only(
        &cfg,
        var_builder_in(fixture, "vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let r = tiled_reference("cogvideox-tiling");
    // `enable_tiling(32, 32, 0.25, 0.25)`: 2x2 tiles of 4x4 latent pixels every 3, each of 5
    // latent frames decoded in two frame batches.
    let tiles = OverlapTiles {
        min_height: 32,
        min_width: 32,
        overlap_factor_height: 0.25,
        overlap_factor_width: 0.25,
    };
    let video = vae.decode_tiled(&r["latents"], &tiles).unwrap();
    assert_close("cogvideox tiled video", &video, &r["video"], ATOL, RTOL);
    let whole = vae.decode(&r["latents"]).unwrap();
    assert!(
        common::max_abs_diff(&whole, &r["video"]) > 1e-3,
        "the tiles change the video"
    );
    // diffusers' defaults: half the sample size, a sixth and a fifth of overlap.
    let defaults = cfg.tiling();
    assert_eq!((defaults.min_height, defaults.min_width), (240, 360));
}

/// AutoencoderKL's tiled decode with Latte-1's and FLUX.1's tiny VAEs: 32-pixel tiles (4 latent
/// pixels every 3) over a 6x6 latent, a batch of two images (frames) for Latte's.
#[test]
fn autoencoder_kl_tiled_decode_matches_diffusers() {
    let r = tiled_reference("autoencoder-kl-tiling");
    for name in ["latte", "flux"] {
        let fixture = format!("{name}-tiny-a");
        let cfg: AutoencoderKLConfig = config_in(&fixture, "vae/config.json");
        let vae = AutoencoderKL::new_decoder_only(
            &cfg,
            var_builder_in(&fixture, "vae/diffusion_pytorch_model.safetensors"),
        )
        .unwrap();
        let tiles = OverlapTiles {
            min_height: 32,
            min_width: 32,
            ..cfg.tiling()
        };
        let latents = &r[&format!("{name}.latents")];
        let images = vae
            .with_tiling(Some(tiles))
            .unwrap()
            .decode(latents)
            .unwrap();
        let expected = &r[&format!("{name}.images")];
        assert_close(
            &format!("{name} tiled images"),
            &images,
            expected,
            ATOL,
            RTOL,
        );
        let whole = vae.decode(latents).unwrap();
        assert!(
            common::max_abs_diff(&whole, expected) > 1e-3,
            "{name}: the tiles change the images"
        );
    }
    // diffusers' defaults: the config's sample size, a quarter of overlap.
    let latte: AutoencoderKLConfig = config_in("latte-tiny-a", "vae/config.json");
    let tiles = latte.tiling();
    assert_eq!((tiles.min_height, tiles.overlap_factor_width), (256, 0.25));
}

/// Mochi-1's tiny VAE with `enable_tiling(16, 16, 8, 8)`: a 3x3 latent in 3x3 tiles of 2x2
/// latent pixels every 1, blended over 8 pixels.
#[test]
fn mochi_tiled_decode_matches_diffusers() {
    let fixture = "mochi-tiny-a";
    let cfg: MochiVaeConfig = config_in(fixture, "vae/config.json");
    let vae = AutoencoderKLMochi::new(
        &cfg,
        var_builder_in(fixture, "vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let r = tiled_reference("mochi-tiling");
    let tiled = vae.with_tiling(Some(SampleTiles::square(16, 8))).unwrap();
    let video = tiled.decode(&r["latents"]).unwrap();
    assert_close("mochi tiled video", &video, &r["video"], ATOL, RTOL);
    let whole = vae.decode(&r["latents"]).unwrap();
    assert!(
        common::max_abs_diff(&whole, &r["video"]) > 1e-3,
        "the tiles change the video"
    );
    assert_eq!(DEFAULT_TILING, SampleTiles::square(256, 192));
}

/// LTX-Video's tiny VAE (32 pixels and 8 frames a latent voxel) with tiles of 48 pixels every
/// 32 and 12 frames every 8: `spatial` splits a 2x2 latent into 2x2 tiles (`enable_tiling`
/// alone), `temporal` 3 latent frames into 3 frame tiles (`use_framewise_decoding`); the
/// decoder's injected noise is replayed, draw by draw, from the reference run.
#[test]
fn ltx_video_tiled_decode_matches_diffusers() {
    let fixture = "ltx-video-tiny-a";
    let cfg: LtxVaeConfig = config_in(fixture, "vae/config.json");
    let vae = AutoencoderKLLTXVideo::new(
        &cfg,
        var_builder_in(fixture, "vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let r = tiled_reference("ltx-video-tiling");
    let spatial = SampleTiles::square(48, 32);
    for (case, frames) in [("spatial", None), ("temporal", Some((12, 8)))] {
        let tiled = vae
            .with_tiling(Some(LtxVaeTiling { spatial, frames }))
            .unwrap();
        let draws: Vec<Tensor> = (0..)
            .map_while(|k| r.get(&format!("{case}.injected_noise.{k}")).cloned())
            .collect();
        let mut noise = GivenNoise::new(draws);
        let latents = &r[&format!("{case}.latents")];
        let video = tiled
            .decode(latents, Some(&r["timestep"]), &mut noise)
            .unwrap();
        noise.check_all_used().unwrap();
        let expected = &r[&format!("{case}.video")];
        assert_close(
            &format!("ltx {case} tiled video"),
            &video,
            expected,
            ATOL,
            RTOL,
        );
    }
    assert_eq!(
        LtxVaeTiling::default().spatial,
        SampleTiles::square(512, 448)
    );
    assert!(vae
        .with_tiling(Some(LtxVaeTiling {
            spatial,
            frames: Some((4, 8))
        }))
        .is_err());
}

/// The dry run's planned activation bytes of the decode of `model` at `height` x `width` x
/// `frames`, with `--vae-tiling` or without.
fn planned_decode(model: &str, (height, width, frames): (u32, u32, u32), tiled: bool) -> u64 {
    let mut args: Vec<String> = [
        "generate",
        "--dry-run",
        "--json",
        "--device",
        "cpu",
        "--prompt",
        "x",
    ]
    .map(String::from)
    .to_vec();
    args.extend(["--model".to_string(), model.to_string()]);
    for (flag, value) in [
        ("--height", height),
        ("--width", width),
        ("--num-frames", frames),
    ] {
        args.extend([flag.to_string(), value.to_string()]);
    }
    if tiled {
        args.push("--vae-tiling".into());
    }
    let out = common::run_vidgen(&args);
    assert!(
        out.status.success(),
        "{model} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    plan["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "decode")
        .unwrap()["memory"]["activation_bytes"]
        .as_u64()
        .unwrap()
}

/// `--vae-tiling` is taken by every family whose diffusers VAE tiles, and the dry run's decode
/// (of the published VAEs) then counts one tile instead of the frame: less for a video larger
/// than the default tile (diffusers' `enable_tiling()` sizes), the same for one that fits in a
/// tile.
#[test]
fn vae_tiling_lowers_the_planned_decode_of_large_videos() {
    let families = [
        ("synthetic:cogvideox-5b", (480, 720, 49), (192, 320, 49)),
        ("synthetic:ltx-video", (704, 1216, 121), (512, 512, 121)),
        ("synthetic:latte-1", (512, 512, 16), (256, 256, 16)),
        ("synthetic:mochi-1", (480, 848, 19), (256, 256, 19)),
        ("synthetic:flux.1-dev", (2048, 2048, 1), (1024, 1024, 1)),
    ];
    for (model, large, small) in families {
        let (whole, tiled) = (
            planned_decode(model, large, false),
            planned_decode(model, large, true),
        );
        assert!(tiled < whole, "{model}: tiled {tiled} whole {whole}");
        assert_eq!(
            planned_decode(model, small, true),
            planned_decode(model, small, false),
            "{model}: one tile is decoded whole"
        );
    }
}

/// The memory plan's advice (the option sets it would fall back to, cheapest first) turns on
/// `--vae-tiling` for the families that tile when their whole-frame decode is what bounds the
/// run, and never for one whose VAE has no tiles.
#[test]
fn the_advice_offers_vae_tiling_where_the_vae_tiles() {
    for (model, size, offered) in [
        ("synthetic:cogvideox-5b", ["480", "720", "9"], true),
        ("synthetic:ltx-video", ["704", "1216", "121"], true),
        ("synthetic:mochi-1", ["480", "848", "19"], true),
        ("synthetic:latte-1", ["512", "512", "16"], true),
        ("synthetic:flux.1-dev", ["2048", "2048", "1"], true),
        ("synthetic:minimax-h3", ["480", "832", "121"], false),
    ] {
        let argv = ["vidgen", "generate", "--dry-run", "--device", "cpu"]
            .into_iter()
            .chain(["--memory-model", "discrete", "--model", model])
            .chain([
                "--height",
                size[0],
                "--width",
                size[1],
                "--num-frames",
                size[2],
            ])
            .map(std::ffi::OsString::from);
        let Parsed::Generate(args) = parse(argv).unwrap() else {
            panic!("not a generate command")
        };
        let config = ResolvedConfig::resolve(*args).unwrap();
        let source = ModelSource::parse(model).unwrap();
        let family = registry::family(Configs::OnDisk(&source)).unwrap();
        let planner = Planner::new(family.as_ref(), &config);
        let flags: Vec<String> = planner
            .candidates(None)
            .iter()
            .flat_map(|c| c.flags.clone())
            .collect();
        assert_eq!(
            flags.iter().any(|f| f == "--vae-tiling"),
            offered,
            "{model}: {flags:?}"
        );
    }
}

/// A family whose VAE has no tiles still refuses `--vae-tiling` (exit 2, one line).
#[test]
fn vae_tiling_is_refused_without_tiles() {
    let args: Vec<String> = [
        "generate",
        "--dry-run",
        "--device",
        "cpu",
        "--prompt",
        "x",
        "--vae-tiling",
        "--model",
    ]
    .map(String::from)
    .into_iter()
    .chain([named_fixture_dir("minimax-h3-tiny-a")
        .to_str()
        .unwrap()
        .to_string()])
    .collect();
    let stderr = common::usage_error(&common::run_vidgen(&args), "minimax-h3 --vae-tiling");
    assert!(stderr.contains("--vae-tiling"), "{stderr}");
}
