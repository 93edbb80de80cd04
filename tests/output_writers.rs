//! Output writers: MP4 checked with ffprobe/ffmpeg, PNG folders against the pipeline's uint8
//! reference, safetensors round trip, and failure cleanup.

mod common;

use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};
use std::process::Command;
use vidgen::output::{self, OutputType};

/// A fresh, empty scratch folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vidgen-output-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Names in a folder, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A smooth moving RGB gradient, [F, H, W, 3] in [0, 1].
fn gradient(f: usize, h: usize, w: usize) -> Tensor {
    let mut v = Vec::with_capacity(f * h * w * 3);
    for t in 0..f {
        for y in 0..h {
            for x in 0..w {
                let (fx, fy, ft) = (
                    x as f32 / w as f32,
                    y as f32 / h as f32,
                    t as f32 / f as f32,
                );
                v.extend([fx, fy, (fx + fy + ft) / 3.0]);
            }
        }
    }
    Tensor::from_vec(v, (f, h, w, 3), &Device::Cpu).unwrap()
}

#[test]
fn mp4_has_the_right_stream_and_tags() {
    let dir = scratch("mp4");
    let path = dir.join("clip.mp4");
    let (f, h, w) = (9, 48, 64);
    let frames = gradient(f, h, w);
    let meta = vec![
        ("comment".to_string(), "a test clip".to_string()),
        ("vidgen_seed".to_string(), "1234".to_string()),
    ];
    output::write(OutputType::Mp4, &path, &frames, 16, &meta).unwrap();
    assert_eq!(listing(&dir), vec!["clip.mp4"], "no temporary left behind");

    let probe = Command::new("ffprobe")
        .args([
            "-v",
            "error",
            "-count_frames",
            "-show_streams",
            "-show_format",
            "-of",
            "json",
        ])
        .arg(&path)
        .output()
        .expect("running ffprobe");
    assert!(
        probe.status.success(),
        "ffprobe: {}",
        String::from_utf8_lossy(&probe.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&probe.stdout).unwrap();
    let s = &j["streams"][0];
    assert_eq!(j["streams"].as_array().unwrap().len(), 1);
    assert_eq!(s["codec_name"], "h264");
    assert_eq!(s["pix_fmt"], "yuv420p");
    assert_eq!(s["width"], w);
    assert_eq!(s["height"], h);
    assert_eq!(s["nb_read_frames"], f.to_string());
    assert_eq!(s["avg_frame_rate"], "16/1");
    assert_eq!(s["r_frame_rate"], "16/1");
    let tags = &j["format"]["tags"];
    assert_eq!(tags["comment"], "a test clip", "tags: {tags}");
    assert_eq!(tags["vidgen_seed"], "1234", "tags: {tags}");

    // The content survives the (lossy) encode: decode back to RGB and compare with the
    // truncated uint8 input.
    let raw = Command::new("ffmpeg")
        .args(["-v", "error", "-i"])
        .arg(&path)
        .args(["-f", "rawvideo", "-pix_fmt", "rgb24", "-"])
        .output()
        .expect("running ffmpeg");
    assert!(raw.status.success());
    assert_eq!(raw.stdout.len(), f * h * w * 3);
    let want: Vec<u8> = frames
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|&x| (x * 255.0) as u8)
        .collect();
    let mean_abs = raw
        .stdout
        .iter()
        .zip(&want)
        .map(|(&a, &b)| (a as f64 - b as f64).abs())
        .sum::<f64>()
        / want.len() as f64;
    assert!(
        mean_abs < 3.0,
        "decoded video differs from the input by {mean_abs} on average"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn png_frames_round_half_to_even() {
    let dir = scratch("png");
    let out = dir.join("frames");
    let r = common::reference("pipeline");
    let frames = r["cfg5.frames"].squeeze(0).unwrap();
    let want = r["cfg5.frames_uint8_round"].squeeze(0).unwrap();
    let (f, h, w, _) = frames.dims4().unwrap();
    output::write(OutputType::Png, &out, &frames, 16, &[]).unwrap();
    assert_eq!(listing(&dir), vec!["frames"], "no temporary left behind");
    let names = listing(&out);
    let expected: Vec<String> = (0..f).map(|i| format!("frame_{i:05}.png")).collect();
    assert_eq!(names, expected);
    let want = want.to_dtype(DType::U8).unwrap();
    for (i, name) in names.iter().enumerate() {
        let img = image::open(out.join(name)).unwrap().to_rgb8();
        assert_eq!((img.width() as usize, img.height() as usize), (w, h));
        let want_i = want
            .get(i)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<u8>()
            .unwrap();
        assert_eq!(
            img.into_raw(),
            want_i,
            "{name}: pixels differ from numpy's round()"
        );
    }
    // The same frames truncated differ from the rounded ones on many pixels: the rule matters.
    let trunc = r["cfg5.frames_uint8_trunc"].to_dtype(DType::U8).unwrap();
    let differ = trunc
        .flatten_all()
        .unwrap()
        .to_vec1::<u8>()
        .unwrap()
        .iter()
        .zip(want.flatten_all().unwrap().to_vec1::<u8>().unwrap())
        .filter(|(a, b)| **a != *b)
        .count();
    assert!(differ > 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn png_exact_ties_go_to_even() {
    // x = (k + 0.5) / 255 gives exactly k + 0.5 after * 255 in f32 for every k < 255: numpy's
    // round() takes the even neighbour, round-half-up would not.
    let dir = scratch("png-ties");
    let out = dir.join("ties");
    let (h, w) = (16usize, 16usize);
    let mut values = Vec::with_capacity(h * w * 3);
    let mut want = Vec::with_capacity(h * w * 3);
    for i in 0..h * w * 3 {
        let k = (i % 255) as u32;
        let x = (k as f32 + 0.5) / 255.0;
        assert_eq!(x * 255.0, k as f32 + 0.5, "tie construction for {k}");
        values.push(x);
        want.push(if k.is_multiple_of(2) {
            k as u8
        } else {
            (k + 1) as u8
        });
    }
    let frames = Tensor::from_vec(values, (1, h, w, 3), &Device::Cpu).unwrap();
    output::write_png_frames(&out, &frames).unwrap();
    let img = image::open(out.join("frame_00000.png")).unwrap().to_rgb8();
    assert_eq!(img.into_raw(), want);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn safetensors_round_trip() {
    let dir = scratch("st");
    let path = dir.join("frames.safetensors");
    let frames = gradient(3, 16, 32);
    let meta = vec![("prompt".to_string(), "a cat".to_string())];
    output::write(OutputType::Safetensors, &path, &frames, 16, &meta).unwrap();
    assert_eq!(listing(&dir), vec!["frames.safetensors"]);
    let loaded = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let got = &loaded["frames"];
    assert_eq!(got.dtype(), DType::F32);
    common::assert_close("frames", got, &frames, 0.0, 0.0);
    let bytes = std::fs::read(&path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(header.metadata().as_ref().unwrap()["prompt"], "a cat");

    // Plain writer, other dtype in: stored as f32.
    let path2 = dir.join("plain.safetensors");
    output::write_safetensors(&path2, &frames.to_dtype(DType::F64).unwrap()).unwrap();
    let loaded = candle_core::safetensors::load(&path2, &Device::Cpu).unwrap();
    assert_eq!(loaded["frames"].dtype(), DType::F32);
    common::assert_close("frames f64", &loaded["frames"], &frames, 0.0, 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn failures_are_errors_and_leave_nothing_behind() {
    let dir = scratch("fail");
    let frames = gradient(2, 16, 16);
    for kind in [OutputType::Mp4, OutputType::Png, OutputType::Safetensors] {
        // The destination is an existing non-empty folder: the final rename fails after the
        // temporary was written, which must then be removed.
        let dest = dir.join(format!("taken.{}", kind.extension()));
        std::fs::create_dir_all(&dest).unwrap();
        std::fs::write(dest.join("keep.txt"), b"x").unwrap();
        if kind == OutputType::Png {
            // A PNG output is a folder: unless told to replace it, an existing one is kept;
            // told to, it is swapped for the finished new one (`--overwrite`).
            let err = output::write_with(kind, &dest, &frames, 16, &[], false).unwrap_err();
            assert!(format!("{err:#}").contains("already exists"), "{err:#}");
            assert_eq!(listing(&dest), vec!["keep.txt"]);
            output::write(kind, &dest, &frames, 16, &[]).unwrap();
            assert_eq!(listing(&dest), vec!["frame_00000.png", "frame_00001.png"]);
            let hidden: Vec<String> = listing(&dir)
                .into_iter()
                .filter(|n| n.starts_with('.'))
                .collect();
            assert!(hidden.is_empty(), "left beside it: {hidden:?}");
            std::fs::remove_dir_all(&dest).unwrap();
        } else {
            let err = output::write(kind, &dest, &frames, 16, &[]).unwrap_err();
            assert!(
                format!("{err:#}").contains(&dest.display().to_string()),
                "{kind:?}: {err:#}"
            );
            assert_eq!(listing(&dest), vec!["keep.txt"]);
        }

        // A destination in a folder that does not exist.
        let missing = dir
            .join("no/such/folder")
            .join(format!("x.{}", kind.extension()));
        let err = output::write(kind, &missing, &frames, 16, &[]).unwrap_err();
        assert!(
            format!("{err:#}").contains(&missing.display().to_string()),
            "{kind:?}: {err:#}"
        );
    }
    let mut names = listing(&dir);
    names.retain(|n| n.starts_with('.'));
    assert!(names.is_empty(), "temporaries left: {names:?}");

    // Bad input: wrong rank, wrong channel count, odd size for yuv420p, zero fps.
    let flat = Tensor::zeros((2, 16, 16), DType::F32, &Device::Cpu).unwrap();
    let four = Tensor::zeros((2, 16, 16, 4), DType::F32, &Device::Cpu).unwrap();
    // (The MP4 writer exists with the `mp4` feature, the default.)
    #[cfg(feature = "mp4")]
    {
        let odd = gradient(2, 15, 16);
        let p = dir.join("bad.mp4");
        assert!(output::write_mp4(&p, &flat, 16, &[]).is_err());
        assert!(output::write_mp4(&p, &four, 16, &[]).is_err());
        assert!(output::write_mp4(&p, &odd, 16, &[]).is_err());
        assert!(output::write_mp4(&p, &frames, 0, &[]).is_err());
    }
    assert!(output::write_png_frames(&dir.join("bad"), &four).is_err());
    assert!(output::write_safetensors(&dir.join("bad.safetensors"), &flat).is_err());
    assert!(
        listing(&dir).iter().all(|n| n.starts_with("taken.")),
        "{:?}",
        listing(&dir)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn extensions() {
    assert_eq!(OutputType::Mp4.extension(), "mp4");
    assert_eq!(OutputType::Png.extension(), "png");
    assert_eq!(OutputType::Safetensors.extension(), "safetensors");
}
