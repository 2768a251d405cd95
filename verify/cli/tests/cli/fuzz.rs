//! `deltaref fuzz`: exit codes, the runner protocol end to end (command
//! and worker), failure files and their replay, and ggml's kernel.

use crate::common::{code, s};

/// The oracle in f32, in process: every case passes.
#[test]
fn the_builtin_oracle_passes() {
    for conv in ["fla", "ggml", "opengdn", "flashinfer-gdn", "flashqla"] {
        let (c, out, err) = code(&[
            "fuzz",
            "-q",
            "--op",
            "gdn",
            "--runner",
            "builtin:f32",
            "--convention",
            conv,
            "--cases",
            "60",
            "--json",
        ]);
        assert_eq!(c, 0, "{conv}: {out}{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            (v["cases"].as_u64(), v["passes"].as_u64()),
            (Some(60), Some(60)),
            "{out}"
        );
    }
}

/// A command that copies the case to the output: it runs, but returns no
/// `o`; the failure is reported, written and replays with `verify`.
#[test]
fn a_failing_command_runner_is_reported_written_and_replays() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("failures");
    let (c, out, err) = code(&[
        "fuzz",
        "-q",
        "--op",
        "kda",
        "--runner",
        "cp {case} {out}",
        "--cases",
        "5",
        "--out",
        s(&out_dir),
    ]);
    assert_eq!(c, 1, "{out}{err}");
    assert!(out.contains("o: missing from the candidate"), "{out}");
    let replay = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("replay: deltaref "))
        .expect(&out)
        .to_string();
    let args: Vec<&str> = replay.split(' ').collect();
    let (c, rout, rerr) = code(&args);
    assert_eq!(c, 1, "{rout}{rerr}");
    assert!(rout.contains("missing"), "{rout}");
}

/// A worker speaking the line protocol with a shell loop that copies the
/// case (as above) and answers `{"ok": true}`: the same failure, one process.
#[test]
fn a_worker_runner_speaks_the_line_protocol() {
    let worker = r#"while read -r line; do c=$(echo "$line" | sed 's/.*"case":"\([^"]*\)".*/\1/'); o=$(echo "$line" | sed 's/.*"out":"\([^"]*\)".*/\1/'); cp "$c" "$o"; echo '{"ok": true}'; done"#;
    let (c, out, err) = code(&[
        "fuzz", "-q", "--op", "gdn", "--worker", worker, "--cases", "3",
    ]);
    assert_eq!(c, 1, "{out}{err}");
    assert!(out.contains("o: missing from the candidate"), "{out}");
    let answers_no = r#"while read -r line; do echo '{"ok": false, "error": "no GPU"}'; done"#;
    let (c, out, err) = code(&[
        "fuzz", "-q", "--op", "gdn", "--worker", answers_no, "--cases", "3",
    ]);
    assert_eq!(c, 2, "{out}{err}");
    assert!(
        err.contains("could not run the first case") && err.contains("no GPU"),
        "{err}"
    );
}

#[test]
fn usage_errors_and_broken_runners_exit_2() {
    for (args, want) in [
        (vec!["--runner", "echo hi"], "placeholders"),
        (
            vec!["--runner", "builtin:f32", "--convention", "nope"],
            "unknown `nope`",
        ),
        (
            vec!["--runner", "builtin:f32", "--convention", "flashkda"],
            "applies to --op kda",
        ),
        (
            vec![
                "--runner",
                "builtin:f32",
                "--convention",
                "ggml",
                "--fix",
                "2,8,4",
            ],
            "K = V",
        ),
        (
            vec!["--runner", "false {case} {out}"],
            "could not run the first case",
        ),
        (
            vec!["--worker", "true"],
            "the runner could not run: worker `true`",
        ),
        (vec![], "--runner"),
    ] {
        let mut a = vec!["fuzz", "-q", "--op", "gdn", "--cases", "2"];
        a.extend(args.iter());
        let (c, out, err) = code(&a);
        assert_eq!(c, 2, "{a:?}: {out}{err}");
        assert!(err.contains(want), "{a:?}: {err}");
    }
}

/// Every other op under `fla`: the f32 oracle passes, in process.
#[test]
fn every_op_is_fuzzed() {
    for op in ["dplr", "gdn2", "token_shift", "causal_conv1d"] {
        let (c, out, err) = code(&[
            "fuzz",
            "-q",
            "--op",
            op,
            "--runner",
            "builtin:f32",
            "--cases",
            "40",
            "--json",
        ]);
        assert_eq!(c, 0, "{op}: {out}{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["passes"].as_u64(), Some(40), "{out}");
    }
}

/// FLA's CP fault 5 as the runner (`builtin:partial-merge-v`): caught on a
/// case with cut points; the shrunk case keeps one (`cp world=2`); with
/// `--no-cp` the same runner passes.
#[test]
fn a_cp_fault_runner_is_caught_on_cut_points_and_passes_without_them() {
    let (c, out, err) = code(&[
        "fuzz",
        "-q",
        "--op",
        "gdn",
        "--runner",
        "builtin:partial-merge-v",
        "--cases",
        "100",
    ]);
    assert_eq!(c, 1, "{out}{err}");
    assert!(
        out.contains("shrunk in") && out.contains("cp world=2 cuts=["),
        "{out}"
    );
    let (c, out, err) = code(&[
        "fuzz",
        "-q",
        "--op",
        "gdn",
        "--runner",
        "builtin:partial-merge-v",
        "--cases",
        "60",
        "--no-cp",
    ]);
    assert_eq!(c, 0, "{out}{err}");
}

/// `--band`: the bf16 emulation passes in its own band; `--band f32` (no
/// rounding, no band) is a usage error; `--band` and `--tolerance` conflict.
#[test]
fn band_judges_each_case_in_its_noise_band() {
    let (c, out, err) = code(&[
        "fuzz",
        "-q",
        "--op",
        "kda",
        "--runner",
        "builtin:fla-bf16",
        "--dtype",
        "bf16",
        "--band",
        "--cases",
        "15",
        "--max-tokens",
        "96",
    ]);
    assert_eq!(c, 0, "{out}{err}");
    assert!(out.contains("judged by band fla-bf16 (4 samples)"), "{out}");
    let (c, out, err) = code(&[
        "fuzz",
        "-q",
        "--op",
        "kda",
        "--runner",
        "builtin:f32",
        "--band",
        "f32",
        "--cases",
        "2",
    ]);
    assert_eq!(c, 2, "{out}{err}");
    assert!(err.contains("single point"), "{err}");
    let (c, _, err) = code(&[
        "fuzz",
        "-q",
        "--op",
        "kda",
        "--runner",
        "builtin:f32",
        "--band",
        "--tolerance",
        "1e-3",
    ]);
    assert_eq!(c, 2, "{err}");
}

/// ggml's kernels through `tools/ggml_runner.py`: GATED_DELTA_NET (GDN and
/// KDA) passes in ggml's convention, and wrapped for FLA's layout its
/// grouped value heads are caught and the tiled head mapping named;
/// RWKV_WKV7 (DPLR, at RWKV-7's head size 64) and SSM_CONV (causal conv1d,
/// bias and SiLU in the graph) pass in FLA's layout.
#[test]
#[ignore = "needs ggml-python 0.0.45: DELTAREF_GGML_PYTHON=/path/to/python cargo test --release --workspace --test cli ggml -- --ignored"]
fn ggml_passes_in_its_convention_and_its_head_mapping_is_named_under_fla() {
    let py = std::env::var("DELTAREF_GGML_PYTHON")
        .expect("DELTAREF_GGML_PYTHON: a python with ggml-python installed");
    let runner = format!(
        "{py} {}/../../tools/ggml_runner.py",
        env!("CARGO_MANIFEST_DIR")
    );
    for op in ["gdn", "kda"] {
        let (c, out, err) = code(&[
            "fuzz",
            "-q",
            "--op",
            op,
            "--convention",
            "ggml",
            "--worker",
            &runner,
            "--cases",
            "100",
        ]);
        assert_eq!(c, 0, "{op}: {out}{err}");
        let (c, out, err) = code(&[
            "fuzz",
            "-q",
            "--op",
            op,
            "--convention",
            "fla",
            "--within",
            "ggml",
            "--worker",
            &runner,
            "--cases",
            "60",
            "--keep-going",
        ]);
        assert_eq!(c, 1, "{op}: {out}{err}");
        assert!(
            out.contains("head-mapping") && out.contains("`j % H` (tiled)"),
            "{op}: {out}"
        );
    }
    for (op, extra) in [
        ("dplr", ["--fix", "2,64,64"]),
        ("causal_conv1d", ["--seed", "1"]),
    ] {
        let mut args = vec!["fuzz", "-q", "--op", op, "--worker", &runner];
        args.extend(extra);
        args.extend(["--cases", "60", "--max-tokens", "64"]);
        let (c, out, err) = code(&args);
        assert_eq!(c, 0, "{op}: {out}{err}");
        assert!(out.contains("60 passed"), "{op}: {out}");
    }
}

/// `gen --convention ggml` writes the case in ggml's layout (tiled value
/// heads, state `[V, K]`) with the map back in its metadata; its stored
/// truth, taken as a candidate in ggml's convention, passes `verify
/// --convention ggml`; taken in FLA's it fails with the head mapping and
/// the state layout named, and the per-head errors shown.
#[test]
fn a_case_generated_in_a_convention_verifies_in_it() {
    let dir = tempfile::tempdir().unwrap();
    let case = dir.path().join("ggml.safetensors");
    let (c, out, err) = code(&[
        "gen",
        "--op",
        "gdn",
        "--shape",
        "1,12,2,4,4,4",
        "--initial-state",
        "--dtype",
        "f32",
        "--expected",
        "--convention",
        "ggml",
        "--out",
        s(&case),
    ]);
    assert_eq!(c, 0, "{out}{err}");
    let bytes = std::fs::read(&case).unwrap();
    let head = String::from_utf8_lossy(&bytes[8..2000]).to_string();
    assert!(
        head.contains("\"convention\"") && head.contains("tiled"),
        "{head}"
    );
    let verify = |conv: &str| {
        code(&[
            "verify",
            "--case",
            s(&case),
            "--candidate",
            s(&case),
            "--convention",
            conv,
        ])
    };
    let (c, out, err) = verify("ggml");
    assert_eq!(c, 0, "{out}{err}");
    let (c, out, err) = verify("fla");
    assert_eq!(c, 1, "{out}{err}");
    assert!(
        out.contains("likely cause:")
            && out.contains("convention ggml's layout")
            && out.contains("--convention ggml"),
        "{out}"
    );
    assert!(out.contains("o per head: worst head"), "{out}");
    let (c, out, err) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--candidate",
        s(&case),
        "--convention",
        "ggml",
    ]);
    assert_eq!(c, 0, "{out}{err}");
    let (c, out, err) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--candidate",
        s(&case),
        "--convention",
        "fla",
    ]);
    assert_eq!(c, 1, "{out}{err}");
    assert!(out.contains("o per head: worst head"), "{out}");
    let (c, _, err) = code(&[
        "gen",
        "--op",
        "gdn",
        "--shape",
        "1,12,2,4,4,4",
        "--convention",
        "opengdn",
        "--out",
        s(&dir.path().join("x.safetensors")),
    ]);
    assert_eq!(c, 2, "{err}");
    assert!(
        err.contains("--convention opengdn") && err.contains("HV = H"),
        "{err}"
    );
}
