//! Sequence-parallel groups on the CPU, thread ranks standing in for processes (each group its
//! own communicator): `--num-gpus 4 --sp-size 2` runs two groups of two, each making its share of
//! a prompt file with the video's tokens split across its ranks; the first rank of a group alone
//! encodes the text (the others receive the embeddings), decodes and writes.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use candle_core::{Device, Tensor};
use vidgen::cli::{parse, Parsed};
use vidgen::config::{Rank, ResolvedConfig};
use vidgen::models::source::ModelSource;
use vidgen::parallel::collective::{run_groups, Collective};
use vidgen::parallel::launch::{as_rank, Joined};
use vidgen::parallel::world::{Launcher, World};
use vidgen::parallel::{Groups, Ranks};
use vidgen::pipeline::frame::Frame;
use vidgen::pipeline::jobs::Job;
use vidgen::pipeline::progress::Progress;
use vidgen::pipeline::registry::{self, Configs, Family};
use vidgen::pipeline::runner::{self, BatchOrder, LoadPolicy, Pipeline};
use vidgen::pipeline::spec::PipelineSpec;

const MODEL: &str = "synthetic:wan2.1-tiny";

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-spg-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny synthetic Wan model on the CPU at 32x32, 5 frames, 2 steps, with `extra` flags.
fn config(out: &Path, extra: &[&str]) -> (ResolvedConfig, Box<dyn Family>, ModelSource) {
    let out = out.to_str().unwrap().to_string();
    let mut argv: Vec<String> = [
        "vidgen",
        "generate",
        "--model",
        MODEL,
        "--device",
        "cpu",
        "--memory-model",
        "unified",
        "--height",
        "32",
        "--width",
        "32",
        "--num-frames",
        "5",
        "--num-inference-steps",
        "2",
        "--seed",
        "3",
        "--output-type",
        "safetensors",
        "--quiet",
        "--output-path",
        &out,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    argv.extend(extra.iter().map(|s| s.to_string()));
    let args = match parse(argv.iter().map(std::ffi::OsString::from)).unwrap() {
        Parsed::Generate(a) => a,
        Parsed::Info(text) => panic!("{text}"),
    };
    let config = ResolvedConfig::resolve(*args).unwrap();
    let source = ModelSource::parse(MODEL).unwrap();
    let family = registry::family(Configs::Fetch(&source)).unwrap();
    let config = config.with_model_defaults(&family.defaults()).unwrap();
    (config, family, source)
}

fn frames(path: &Path) -> Tensor {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()["frames"].clone()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn statuses(path: &Path) -> Vec<String> {
    let stats: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    stats["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["status"].as_str().unwrap().to_string())
        .collect()
}

/// Four thread ranks in two groups of two make a three-prompt file: group 0 prompts 1 and 3,
/// group 1 prompt 2; each video within 1e-5 of one process's, written once by its group's
/// leader (the stats of group 1's leader beside rank 0's).
#[test]
fn two_groups_of_two_make_their_shares_of_a_prompt_file() {
    let dir = temp("groups");
    let prompts = dir.join("p.txt");
    std::fs::write(&prompts, "a cat\na dog\na fox\n").unwrap();
    let prompt_file = ["--prompt-file", prompts.to_str().unwrap()];

    let one = dir.join("one");
    let (alone, family, source) = config(&one, &prompt_file);
    let progress = Arc::new(Progress::new(true));
    let code =
        vidgen::pipeline::run_joined((alone, None, None), Ok(family), source, &progress).unwrap();
    assert_eq!(code, ExitCode::SUCCESS);

    let four = dir.join("four");
    std::fs::create_dir_all(&four).unwrap();
    let stats = four.join("stats.json");
    let mut args = prompt_file.to_vec();
    args.extend(["--num-gpus", "4", "--sp-size", "2"]);
    args.extend(["--stats-json", stats.to_str().unwrap()]);
    let groups = Groups { ranks: 4, sp: 2 };
    let ends = run_groups(groups, Duration::from_secs(120), |rank, member| {
        let (config, family, source) = config(&four, &args);
        let world = World {
            rank,
            world_size: 4,
            local_rank: rank,
            local_world_size: 4,
            master: None,
            launcher: Launcher::Supervisor,
        };
        let joined: Joined = as_rank(config, &world, Some(Arc::new(member))).unwrap();
        assert_eq!(joined.2, Some((rank / 2, 2)), "rank {rank}'s share");
        assert_eq!(joined.1.is_some(), rank % 2 == 1, "rank {rank}'s scratch");
        let progress = Arc::new(Progress::new(true));
        vidgen::pipeline::run_joined(joined, Ok(family), source, &progress).unwrap()
    });
    assert!(ends.iter().all(|c| *c == ExitCode::SUCCESS));

    let mut names: Vec<_> = std::fs::read_dir(&one)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names.len(), 3);
    for name in &names {
        let diff = max_diff(&frames(&one.join(name)), &frames(&four.join(name)));
        assert!(diff <= 1e-5, "{name:?} differs by {diff}");
    }
    assert_eq!(
        statuses(&stats),
        ["written", "other_gpu", "written"],
        "group 0 (rank 0)"
    );
    assert_eq!(
        statuses(&four.join("stats.rank2.json")),
        ["other_gpu", "written", "other_gpu"],
        "group 1 (rank 2)"
    );
    // The followers wrote nothing the run keeps, and no stats.
    let kept: Vec<_> = std::fs::read_dir(&four).unwrap().collect();
    assert_eq!(kept.len(), 5, "three videos and two stats files");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pipeline that records the components it loads and each job's prompt embeddings.
struct Recording {
    inner: Box<dyn Pipeline<Job = Job>>,
    loads: Vec<&'static str>,
    embeds: Vec<Tensor>,
}

impl Pipeline for Recording {
    type Job = Job;
    fn spec(&self) -> &PipelineSpec {
        self.inner.spec()
    }
    fn load(&mut self, component: usize) -> Result<()> {
        self.loads
            .push(self.inner.spec().components[component].name);
        self.inner.load(component)
    }
    fn release(&mut self, component: usize) {
        self.inner.release(component)
    }
    fn run_stage(&mut self, index: usize, job: &mut Job) -> Result<()> {
        self.inner.run_stage(index, job)?;
        if self.inner.spec().stages[index].name == "encode_text" {
            let cond = job.prompt_embeds.clone().unwrap();
            let uncond = job.negative_embeds.clone().unwrap();
            self.embeds.push(Tensor::cat(&[cond, uncond], 0)?);
        }
        Ok(())
    }
}

/// In a group of two, the leader alone loads the text encoder and the VAE; the follower runs
/// the DiT only, with the embeddings the leader broadcast (prompt and negative prompt).
#[test]
fn the_leader_alone_encodes_and_decodes_for_its_group() {
    let dir = temp("leader");
    let loads = Mutex::new(Vec::new());
    let embeds = run_groups(
        Groups { ranks: 2, sp: 2 },
        Duration::from_secs(120),
        |rank, member| {
            let out = dir.join(format!("rank{rank}"));
            std::fs::create_dir_all(&out).unwrap();
            let (config, family, source) =
                config(&out, &["--prompt", "a cat", "--guidance-scale", "5"]);
            let group: Arc<dyn Collective> = Arc::new(member);
            let config = config.for_rank(Rank {
                rank,
                local_rank: 0,
                ranks: Some(Ranks::new(group)),
                scratch: None,
            });
            let (mut jobs, _) = vidgen::pipeline::jobs::jobs(&config).unwrap();
            let progress = Arc::new(Progress::new(true));
            let inner =
                Frame::open(family.as_ref(), config, source, Device::Cpu, progress).unwrap();
            let mut pipeline = Recording {
                inner,
                loads: Vec::new(),
                embeds: Vec::new(),
            };
            let reports = runner::run(
                &mut pipeline,
                &mut jobs,
                LoadPolicy::Eager,
                BatchOrder::Prompt,
                |_, _| {},
            );
            assert!(reports[0].error.is_none(), "{:?}", reports[0].error);
            loads.lock().unwrap().push((rank, pipeline.loads));
            (
                pipeline.embeds,
                out.join(jobs[0].output.file_name().unwrap()),
            )
        },
    );
    let mut loads = loads.into_inner().unwrap();
    loads.sort();
    assert_eq!(
        loads,
        [
            (0, vec!["text_encoder", "transformer", "vae"]),
            (1, vec!["transformer"]),
        ]
    );
    // The follower's embeddings are the leader's, bit for bit.
    let (leader, follower) = (&embeds[0].0[0], &embeds[1].0[0]);
    assert_eq!(leader.dims(), follower.dims());
    assert_eq!(max_diff(leader, follower), 0.0);
    // Only the leader wrote the video.
    assert!(embeds[0].1.is_file());
    assert!(!embeds[1].1.exists());
    let _ = std::fs::remove_dir_all(&dir);
}
