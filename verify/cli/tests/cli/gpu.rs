//! The `deltaref` command's GPU side: flag misuse is a usage error (exit 2)
//! everywhere; without a GPU the gpu-* implementations say why and selfcheck
//! reports the skipped rows; `bench` times implementations on a case.

use super::common::{code, s};

use std::path::Path;

fn gen(dir: &Path, name: &str, args: &[&str]) -> std::path::PathBuf {
    let out = dir.join(name);
    let mut a = vec!["gen"];
    a.extend_from_slice(args);
    a.extend(["--expected", "--out", s(&out)]);
    let (rc, _, err) = code(&a);
    assert_eq!(rc, 0, "{err}");
    out
}

#[test]
fn gpu_flag_misuse_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let kda = gen(dir.path(), "kda.safetensors", &["--op", "kda", "--l2norm"]);
    let dplr = gen(dir.path(), "dplr.safetensors", &["--op", "dplr"]);
    let k = s(&kda);
    for (args, says) in [
        (
            vec![
                "run",
                "--case",
                k,
                "--impl",
                "gpu-chunk",
                "--compute",
                "f32",
            ],
            "--compute",
        ),
        (
            vec![
                "run",
                "--case",
                k,
                "--impl",
                "gpu-chunk",
                "--precision",
                "fla-bf16",
            ],
            "--precision",
        ),
        (
            vec!["run", "--case", k, "--impl", "naive", "--gpu-dtype", "bf16"],
            "--gpu-dtype applies",
        ),
        (
            vec![
                "run",
                "--case",
                k,
                "--impl",
                "gpu-chunk",
                "--gpu-dtype",
                "f16",
            ],
            // clap's wording: flag and value; ours: the allowed values.
            "invalid value 'f16' for '--gpu-dtype <GPU_DTYPE>': --gpu-dtype: dtype f16 is not \
             allowed here (allowed: f32 or bf16)",
        ),
        (
            vec!["run", "--case", k, "--impl", "gpu-naive", "--world", "2"],
            "gpu-cp",
        ),
        (
            vec!["run", "--case", s(&dplr), "--impl", "gpu-chunk"],
            "naive dplr kernels only",
        ),
        (
            vec![
                "verify",
                "--case",
                k,
                "--candidate",
                k,
                "--gpu-dtype",
                "bf16",
            ],
            "drop them",
        ),
        (
            vec!["run", "--case", k, "--impl", "gpu-magic"],
            "gpu-naive, gpu-chunk, gpu-cp",
        ),
    ] {
        let (rc, _, err) = code(&args);
        assert_eq!(rc, 2, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: expected `{says}` in: {err}");
    }
}

#[test]
fn gpu_implementations_run_or_say_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let kda = gen(
        dir.path(),
        "kda.safetensors",
        &[
            "--op",
            "kda",
            "--l2norm",
            "--lengths",
            "20,0,9",
            "--shape",
            "1,29,1,2,16,16",
        ],
    );
    let cand = dir.path().join("cand.safetensors");
    let run = [
        "run",
        "--case",
        s(&kda),
        "--impl",
        "gpu-cp",
        "--world",
        "2",
        "--out",
        s(&cand),
    ];
    let (rc, out, err) = code(&run);
    match deltaref_gpu::Gpu::probe() {
        Ok(_) => {
            assert_eq!(rc, 0, "{err}");
            let (rc, out, err) = code(&["verify", "--case", s(&kda), "--candidate", s(&cand)]);
            assert_eq!(rc, 0, "{out}{err}");
        }
        Err(why) => {
            assert_eq!(rc, 2, "{out}");
            assert!(err.contains("GPU: "), "{err}");
            assert!(err.contains(&why.to_string()), "{err} vs {why}");
            let (rc, out, _) = code(&["selfcheck"]);
            assert_eq!(rc, 0);
            assert!(out.contains("skipped: GPU rows ("), "{out}");
        }
    }
}

#[test]
fn bench_times_implementations_with_their_errors() {
    let dir = tempfile::tempdir().unwrap();
    let kda = gen(
        dir.path(),
        "kda.safetensors",
        &[
            "--op",
            "kda",
            "--l2norm",
            "--lengths",
            "40,24",
            "--shape",
            "1,64,1,1,8,8",
        ],
    );
    let (rc, out, err) = code(&[
        "bench",
        "--case",
        s(&kda),
        "--impls",
        "naive,chunk,cp",
        "--reps",
        "2",
        "--json",
    ]);
    assert_eq!(rc, 0, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let rows = json["rows"].as_array().expect("array of rows");
    assert_eq!(rows.len(), 3);
    let peak = json["peak_gflops"].as_f64().expect("a measured peak");
    assert!(peak > 0.0, "{json}");
    for (i, r) in rows.iter().enumerate() {
        let best = r["total_s"].as_f64().expect("seconds");
        assert!(best > 0.0 && r["median_s"].as_f64().expect("seconds") >= best);
        // Each row against the first in the same rounds: none for the first.
        let ratio = &r["ratio_to_first"];
        if i == 0 {
            assert!(ratio.is_null(), "{r}");
        } else {
            let q = ["low", "median", "high"].map(|k| ratio[k].as_f64().expect("quartile"));
            assert!(0.0 < q[0] && q[0] <= q[1] && q[1] <= q[2], "{r}");
        }
        // GFLOP/s for the CPU engines; none for CP (no op count).
        let cp = r["imp"].as_str().expect("name").starts_with("cp");
        assert_eq!(r["gflops"].as_f64().is_some(), !cp, "{r}");
        assert_eq!(r["peak_fraction"].as_f64().is_some(), !cp, "{r}");
        // Every CPU form agrees with the f64 oracle to rounding.
        assert!(
            r["worst_norm_ratio"].as_f64().expect("ratio") < 1e-10,
            "{r}"
        );
    }
    let (rc, _, err) = code(&["bench", "--case", s(&kda), "--impls", "naive,warp"]);
    assert_eq!(rc, 2);
    assert!(err.contains("unknown --impl `warp`"), "{err}");
}
