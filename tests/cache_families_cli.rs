//! The step caches on every family whose diffusers transformer takes diffusers' cache hooks:
//! those that act between blocks (`--cache first-block:T`, `magcache:...` with its calibration),
//! TaylorSeer (`--cache taylorseer:...`: whole blocks of every list predicted, attentions and
//! feed-forwards inside them predicted or zeroed, lite mode) where diffusers' pipeline opens the cache context its
//! state needs, and Pyramid Attention Broadcast (`--cache pab:...`) where vidgen hooks attention
//! inside the blocks (Allegro and Latte, whose pipelines open no cache context, PAB only),
//! driven by `cache-families/README.json`'s `cli_cases` (diffusers' `enable_cache(config)`
//! around each tiny fixture's reference call, same draws): the frames within 1e-4 + 1e-4|ref|
//! of diffusers', which differ from the uncached run's where the case skips; the same modules
//! computed in every pass of every step; the calibrated ratios; `--stats-json` and the
//! progress line count what was skipped. Families whose transformer takes no hook refuse
//! `--cache` in one line, as the others here refuse the caches they cannot take.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{
    assert_close, cpu_prompt_args, draws_file, max_abs_diff, named_fixture_dir,
    planned_denoise_activations, run_vidgen, scratch_dir, strings, usage_error,
};
use std::collections::HashMap;
use std::path::Path;

const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-4;

fn readme() -> serde_json::Value {
    let path = named_fixture_dir("cache-families").join("README.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// What one case's run wrote: its tensors, stderr and `--stats-json`.
struct Run {
    outputs: HashMap<String, Tensor>,
    stderr: String,
    stats: serde_json::Value,
}

fn run_case(case: &serde_json::Value, dir: &Path) -> Run {
    let fixture = named_fixture_dir(case["fixture"].as_str().unwrap());
    let pipeline = candle_core::safetensors::load(
        fixture.join("reference/pipeline.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let draws = draws_file(case, &pipeline, dir);
    let stats = dir.join("stats.json");
    let mut args: Vec<String> = vec!["generate".into(), "--model".into()];
    args.push(fixture.to_str().unwrap().into());
    args.extend(strings(&case["args"]));
    for (flag, value) in [
        ("--latents", draws.as_path()),
        ("--output-path", dir),
        ("--stats-json", stats.as_path()),
    ] {
        args.extend([flag.to_string(), value.to_str().unwrap().to_string()]);
    }
    args.extend(
        [
            "--device",
            "cpu",
            "--dtype",
            "f32",
            "--output-type",
            "safetensors",
            "--output-video-name",
            "v",
            "--overwrite",
        ]
        .map(String::from),
    );
    let out = run_vidgen(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{}: {stderr}", case["name"]);
    Run {
        outputs: candle_core::safetensors::load(dir.join("v.safetensors"), &Device::Cpu).unwrap(),
        stderr,
        stats: serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap(),
    }
}

/// `pass: F of N forwards skipped work, M of T modules stood in for`, of recorded rows.
fn counts(pass: &str, rows: &[Vec<u8>]) -> (String, usize, usize) {
    let skipped = |r: &Vec<u8>| r.iter().filter(|&&c| c == 0).count();
    let forwards = rows.iter().filter(|r| skipped(r) > 0).count();
    let modules: usize = rows.iter().map(skipped).sum();
    let line = format!(
        "{pass}: {forwards} of {} forwards skipped work, {modules} of {} modules stood in for",
        rows.len(),
        rows.iter().map(|r| r.len()).sum::<usize>(),
    );
    (line, forwards, modules)
}

#[test]
fn caches_skip_and_compute_what_diffusers_does_in_every_family() {
    let readme = readme();
    let refs = candle_core::safetensors::load(
        named_fixture_dir("cache-families").join("cache.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let mut families = std::collections::BTreeSet::new();
    for case in readme["cli_cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let dir = scratch_dir("cache-families", name);
        let run = run_case(case, &dir);
        let fixture = named_fixture_dir(case["fixture"].as_str().unwrap());
        let plain = candle_core::safetensors::load(
            fixture.join("reference/pipeline.safetensors"),
            &Device::Cpu,
        )
        .unwrap();
        let uncached = plain[case["no_cache_frames"].as_str().unwrap()]
            .squeeze(0)
            .unwrap();
        let skips = case["expect"] == "skips";
        let want = match case["frames"].as_str() {
            Some(frames) => refs[frames].squeeze(0).unwrap(),
            None => uncached.clone(),
        };
        assert_close(name, &run.outputs["frames"], &want, ATOL, RTOL);
        // A skipping cache changes the video: a run that computes every block fails the check
        // above (Allegro's tiny attentions change little between steps: its reuse moves the
        // frames by 3e-3).
        let moved = max_abs_diff(&want, &uncached);
        assert!(
            !skips || moved > 20.0 * ATOL,
            "{name}: the cache moves frames {moved:.2e}"
        );
        let hook = case["hook"].as_str().unwrap();

        let (mut summary, mut skipping_passes) = (Vec::new(), 0);
        for (written, reference) in case["computed"].as_object().unwrap() {
            let got = run
                .outputs
                .get(written)
                .unwrap_or_else(|| panic!("{name}: no {written}"));
            assert_eq!(got.dtype(), DType::U8, "{name}: {written}");
            let rows = refs[reference.as_str().unwrap()].to_vec2::<u8>().unwrap();
            assert_eq!(got.to_vec2::<u8>().unwrap(), rows, "{name}: {written}");
            let pass = written.strip_prefix("cache.computed.").unwrap();
            let (line, forwards, modules) = counts(pass, &rows);
            skipping_passes += usize::from(forwards > 0);
            let stats = &run.stats["jobs"][0]["metrics"]["cache"][0];
            assert_eq!(stats["hook"], hook, "{name}");
            assert_eq!(stats[pass]["forwards"], rows.len(), "{name}: {pass}");
            assert_eq!(stats[pass]["forwards_with_skips"], forwards, "{name}");
            assert_eq!(stats[pass]["modules_skipped"], modules, "{name}: {pass}");
            summary.push(line);
        }
        // A skipping case skips in some pass (PAB's first pass may compute what the second
        // reuses), the others in none.
        assert_eq!(
            skipping_passes > 0,
            skips,
            "{name}: {skipping_passes} passes skip"
        );
        for (written, reference) in case["calibration_ratios"].as_object().unwrap() {
            let got = run
                .outputs
                .get(written)
                .unwrap_or_else(|| panic!("{name}: no {written}"));
            let want = &refs[reference.as_str().unwrap()];
            assert_close(name, got, want, ATOL, RTOL);
        }
        let extra = run.outputs.keys().filter(|k| k.starts_with("cache."));
        assert_eq!(
            extra.count(),
            case["computed"].as_object().unwrap().len()
                + case["calibration_ratios"].as_object().unwrap().len(),
            "{name}: {:?}",
            run.outputs.keys()
        );
        summary.sort();
        let line = format!("  cache {hook}: {}", summary.join("; "));
        assert!(
            run.stderr.lines().any(|l| l == line),
            "{name}: no line {line:?} in:\n{}",
            run.stderr
        );
        families.insert(case["fixture"].as_str().unwrap().to_string());
    }
    assert_eq!(families.len(), 7, "{families:?}");
}

/// A family whose diffusers transformer takes no cache hook refuses `--cache`, the families here
/// refuse the caches that stand in for modules inside blocks, and every family a step cache
/// with blocks streamed step by step, each in one line.
#[test]
fn caches_a_family_cannot_take_are_refused_in_one_line() {
    let dir = scratch_dir("cache-families", "refused");
    for (fixture, spec, says) in [
        (
            "latte-tiny-a",
            "first-block:0.1",
            "--cache first-block / magcache does not apply",
        ),
        (
            "allegro-tiny-a",
            "magcache:calibrate=true",
            "--cache first-block / magcache does not apply",
        ),
        (
            "latte-tiny-a",
            "taylorseer:cache_interval=2",
            "--cache taylorseer does not apply",
        ),
        (
            "minimax-h3-tiny-a",
            "pab:spatial_attention_block_skip_range=2",
            "--cache pab does not apply",
        ),
        (
            "allegro-tiny-a",
            "taylorseer:cache_interval=2",
            "--cache taylorseer does not apply",
        ),
        (
            "minimax-h3-tiny-a",
            "taylorseer:use_lite_mode=true",
            "--cache taylorseer does not apply",
        ),
        // Patterns that match modules the blocks do not hand the cache: the token refiner's
        // `attn` (inside `context_embedder`), a single block's MLP Linear, a Linear inside an
        // attention.
        (
            "hunyuanvideo-tiny-a",
            "taylorseer:cache_identifiers=.*attn",
            "the module \"context_embedder.token_refiner.refiner_blocks.0.attn\", which vidgen does not hook",
        ),
        (
            "flux-tiny-a",
            r"taylorseer:skip_predict_identifiers=single_transformer_blocks\.\d+\.proj_mlp",
            "the module \"single_transformer_blocks.0.proj_mlp\", which vidgen does not hook",
        ),
        (
            "wan-tiny-a",
            r"taylorseer:cache_identifiers=blocks\.\d+\.attn1\.to_q",
            "the module \"blocks.0.attn1.to_q\", which vidgen does not hook",
        ),
    ] {
        refused(fixture, &["--cache", spec], says, &dir);
    }
    // A step cache acts between whole blocks, which these stream one step at a time.
    for (fixture, flags) in [
        ("hunyuanvideo-tiny-a", &["--sequential-cpu-offload"][..]),
        (
            "wan-tiny-a",
            &["--dit-layerwise-offload", "--offload-type", "leaf-level"][..],
        ),
    ] {
        // Offloading as on a discrete GPU (the CPU's own memory needs none).
        let discrete = ["--memory-model", "discrete", "--cache", "first-block:0.1"];
        let args = [&discrete[..], flags].concat();
        refused(fixture, &args, "between whole blocks", &dir);
    }
}

/// Asserts that `vidgen generate` on `fixture` with `flags` is refused in one line saying `says`.
fn refused(fixture: &str, flags: &[&str], says: &str, dir: &Path) {
    let mut args = cpu_prompt_args(fixture);
    args.extend([
        "--output-path".to_string(),
        dir.to_str().unwrap().to_string(),
    ]);
    args.extend(flags.iter().map(|f| f.to_string()));
    let line = usage_error(&run_vidgen(&args), fixture);
    assert!(line.contains(says), "{fixture} {flags:?}: {line}");
}

/// The plan counts what a cache holds through the loop in the denoise stage's activations:
/// three block states per pass for First Block Cache, one for MagCache, in every family; for
/// TaylorSeer its factors of each predicted module per pass; and for PAB one per block and kind
/// of attention reused, of both prompts of the guided batch.
#[test]
fn the_plan_counts_the_states_a_cache_holds_in_every_family() {
    for fixture in [
        "cogvideox-tiny-a",
        "ltx-video-tiny-a",
        "hunyuanvideo-tiny-a",
        "mochi-tiny-a",
        "flux-tiny-a",
    ] {
        let denoise_activations = |cache: &[&str]| planned_denoise_activations(fixture, cache);
        let plain = denoise_activations(&[]);
        let first_block = denoise_activations(&["--cache", "first-block:0.1"]) - plain;
        let mag = denoise_activations(&["--cache", "magcache:calibrate=true"]) - plain;
        assert!(mag > 0, "{fixture}: MagCache holds its residuals");
        assert_eq!(first_block, 3 * mag, "{fixture}");
        // TaylorSeer: per pass two factors (max_order 1) of every predicted module, a block's
        // streams counted as one block state; lite mode predicts `proj_out` alone.
        let blocks = num_layers(fixture)
            + match fixture {
                "flux-tiny-a" | "hunyuanvideo-tiny-a" => config_u64(fixture, "num_single_layers"),
                _ => 0,
            };
        let taylor = |spec: &str| denoise_activations(&["--cache", spec]) - plain;
        let every_block = taylor(
            r"taylorseer:max_order=1,cache_identifiers=transformer_blocks\.\d+;single_transformer_blocks\.\d+",
        );
        assert_eq!(every_block, 2 * blocks * mag, "{fixture}");
        assert_eq!(
            taylor("taylorseer:use_lite_mode=true"),
            2 * mag,
            "{fixture}"
        );
        // CogVideoX's and Mochi-1's `attn1`, LTX-Video's `attn1` and `attn2` (both PAB's
        // spatial kind), each of the guided batch's two prompts; FLUX.1's and HunyuanVideo's
        // `attn` of every block of both lists, one prompt's (their passes run apart and share
        // the outputs).
        let (attentions, prompts) = match fixture {
            "cogvideox-tiny-a" | "mochi-tiny-a" => (num_layers(fixture), 2),
            "ltx-video-tiny-a" => (2 * num_layers(fixture), 2),
            "flux-tiny-a" => (
                num_layers(fixture) + config_u64(fixture, "num_single_layers"),
                1,
            ),
            // HunyuanVideo's token refiner's `attn` too (counted as block states).
            "hunyuanvideo-tiny-a" => (
                num_layers(fixture)
                    + config_u64(fixture, "num_single_layers")
                    + config_u64(fixture, "num_refiner_layers"),
                1,
            ),
            _ => continue,
        };
        let pab = denoise_activations(&["--cache", PAB_SPATIAL]) - plain;
        // MagCache holds two block states.
        assert_eq!(2 * pab, prompts * attentions * mag, "{fixture}");
    }
    let fixture = "allegro-tiny-a";
    let denoise_activations =
        |cache: &str| planned_denoise_activations(fixture, &["--cache", cache]);
    let plain = planned_denoise_activations(fixture, &[]);
    let spatial = denoise_activations(PAB_SPATIAL) - plain;
    let both =
        denoise_activations(&format!("{PAB_SPATIAL},cross_attention_block_skip_range=2")) - plain;
    assert!(
        spatial > 0 && spatial.is_multiple_of(num_layers(fixture)),
        "{spatial}"
    );
    assert_eq!(both, 2 * spatial);
    // Latte's temporal attentions take the spatial setting where it is set (diffusers matches
    // them by the spatial identifier too), their own only without it.
    let fixture = "latte-tiny-a";
    let denoise_activations =
        |cache: &str| planned_denoise_activations(fixture, &["--cache", cache]);
    let plain = planned_denoise_activations(fixture, &[]);
    let temporal = denoise_activations("pab:temporal_attention_block_skip_range=2") - plain;
    let spatial = denoise_activations(PAB_SPATIAL) - plain;
    let every = denoise_activations(&format!(
        "{PAB_SPATIAL},temporal_attention_block_skip_range=3,cross_attention_block_skip_range=2"
    )) - plain;
    assert!(
        temporal > 0 && temporal.is_multiple_of(num_layers(fixture)),
        "{temporal}"
    );
    assert_eq!((spatial, every), (2 * temporal, 3 * temporal));
}

/// PAB reusing the self-attention every other call.
const PAB_SPATIAL: &str = "pab:spatial_attention_block_skip_range=2";

/// The transformer's `num_layers` in `fixture`'s config.
fn num_layers(fixture: &str) -> u64 {
    config_u64(fixture, "num_layers")
}

/// The transformer's `key` in `fixture`'s config.
fn config_u64(fixture: &str, key: &str) -> u64 {
    let path = named_fixture_dir(fixture).join("transformer/config.json");
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    config[key].as_u64().unwrap()
}
