//! The real `deltaref` binary on temporary files: exit codes 0 (pass),
//! 1 (a comparison failed), 2 (usage or input error); `--json` parses.

use super::common::{code, deltaref, run_ok, s};

use std::path::Path;

use deltaref::cp::Layout;
use deltaref_verify::case::{Case, CpLayout, Dtype};

#[test]
fn gen_run_verify_round_trip_for_every_op() {
    let dir = tempfile::tempdir().unwrap();
    for (op, extra) in [
        (
            "kda",
            vec![
                "--gate",
                "lowerbound",
                "--lower-bound",
                "-4",
                "--l2norm",
                "--beta-sigmoid",
                "--lengths",
                "13,0,1,20",
            ],
        ),
        ("kda", vec!["--gate", "kda", "--shape", "2,9,1,2,4,3"]),
        ("dplr", vec!["--lengths", "5,1,12"]),
        ("token_shift", vec!["--lengths", "5,0,12"]),
    ] {
        let case = dir.path().join(format!("{op}.safetensors"));
        let mut args = vec![
            "gen",
            "--op",
            op,
            "--initial-state",
            "--expected",
            "--seed",
            "3",
            "--out",
            s(&case),
        ];
        args.extend(extra);
        run_ok(&args);
        let table = run_ok(&["verify", "--case", s(&case), "--impl", "naive"]);
        assert!(table.contains("pass") && !table.contains("FAIL"), "{table}");
        let cand = dir.path().join(format!("{op}-cand.safetensors"));
        run_ok(&[
            "run",
            "--case",
            s(&case),
            "--impl",
            "naive",
            "--out",
            s(&cand),
        ]);
        let json = run_ok(&[
            "verify",
            "--case",
            s(&case),
            "--candidate",
            s(&cand),
            "--json",
        ]);
        let v: serde_json::Value = serde_json::from_str(&json).expect("JSON report");
        assert_eq!(v["pass"], true);
        for row in v["rows"].as_array().unwrap() {
            assert!(row["norm_ratio"].as_f64().unwrap() <= 1e-15, "{row}");
        }
    }
}

#[test]
fn perturbed_and_low_precision_candidates() {
    let dir = tempfile::tempdir().unwrap();
    let case = dir.path().join("c.safetensors");
    run_ok(&[
        "gen",
        "--op",
        "kda",
        "--lengths",
        "20,7",
        "--gate",
        "lowerbound",
        "--initial-state",
        "--out",
        s(&case),
    ]);
    let cand = dir.path().join("cand.safetensors");
    run_ok(&["run", "--case", s(&case), "--out", s(&cand)]);
    // A bf16 candidate (the case has no stored truth: compared with the oracle).
    let mut c = Case::read(&cand).unwrap();
    for name in c.meta.op.results() {
        if let Some(t) = c.tensors.get(name).cloned() {
            c.insert(name, t, Dtype::Bf16);
        }
    }
    let bf = dir.path().join("bf16.safetensors");
    c.write(&bf).unwrap();
    let (rc, out, err) = code(&["verify", "--case", s(&case), "--candidate", s(&bf)]);
    assert_eq!(rc, 0, "{out}{err}");
    // dv scaled by 1.01 fails alone, with norm_ratio ≈ 1e-2.
    let mut c = Case::read(&cand).unwrap();
    let dv = c.tensors["dv"].mapv(|v| v * 1.01);
    c.insert("dv", dv, Dtype::F32);
    let bad = dir.path().join("bad.safetensors");
    c.write(&bad).unwrap();
    let (rc, out, _) = code(&[
        "verify",
        "--case",
        s(&case),
        "--candidate",
        s(&bad),
        "--json",
    ]);
    assert_eq!(rc, 1, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let failing: Vec<&str> = v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["pass"] == false)
        .map(|r| r["tensor"].as_str().unwrap())
        .collect();
    assert_eq!(failing, vec!["dv"]);
    let nr = v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["tensor"] == "dv")
        .unwrap()["norm_ratio"]
        .as_f64()
        .unwrap();
    assert!((nr - 1e-2).abs() < 2e-4, "{nr}");
}

#[test]
fn usage_and_input_errors_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.safetensors");
    for args in [
        vec!["verify", "--bogus"],
        vec!["gen", "--op", "gla", "--out", s(&out)],
        vec![
            "gen",
            "--op",
            "kda",
            "--gate",
            "sometimes",
            "--out",
            s(&out),
        ],
        vec!["gen", "--op", "kda", "--shape", "1,2,3", "--out", s(&out)],
        vec![
            "gen",
            "--op",
            "kda",
            "--shape",
            "2,10,1,1,4,4",
            "--lengths",
            "4,6",
            "--out",
            s(&out),
        ],
        vec!["gen", "--op", "dplr", "--l2norm", "--out", s(&out)],
        vec!["verify", "--case", "/nonexistent/case.safetensors"],
        vec!["run", "--case", "/nonexistent/case.safetensors"],
        vec!["selfcheck", "--verbose"],
    ] {
        let (rc, _, err) = code(&args);
        assert_eq!(rc, 2, "{args:?}: {err}");
        assert!(!err.is_empty(), "{args:?} printed no error");
    }
    // A fixture without stored truth: the f64 oracle recomputes it for
    // anything but itself (that comparison cannot fail, and is refused).
    run_ok(&["gen", "--op", "token_shift", "--out", s(&out)]);
    let table = run_ok(&["verify", "--case", s(&out), "--compute", "f32"]);
    assert!(table.contains("f64 oracle"), "{table}");
    let (rc, _, err) = code(&["verify", "--case", s(&out)]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("stores no expected results"), "{err}");
    let (rc, _, err) = code(&["run", "--case", s(&out), "--impl", "magic"]);
    assert_eq!(rc, 2);
    assert!(err.contains("unknown --impl `magic`"), "{err}");
    // A corrupt file.
    std::fs::write(&out, b"\x10\x00\x00\x00\x00\x00\x00\x00{}").unwrap();
    let (rc, _, err) = code(&["verify", "--case", s(&out)]);
    assert_eq!(rc, 2, "{err}");
}

#[test]
fn selfcheck_passes_and_prints_the_table() {
    let out = run_ok(&["selfcheck"]);
    assert!(out.contains("naive analytic vs finite-diff"), "{out}");
    assert!(out.trim_end().ends_with("0 failed"), "{out}");
}

#[test]
fn cp_command_prints_the_rank_table_and_matches_non_cp() {
    let dir = tempfile::tempdir().unwrap();
    let case = dir.path().join("c.safetensors");
    run_ok(&[
        "gen",
        "--op",
        "kda",
        "--lengths",
        "400,624",
        "--shape",
        "1,1024,1,2,8,8",
        "--gate",
        "lowerbound",
        "--out",
        s(&case),
    ]);
    let out = run_ok(&["cp", "--case", s(&case), "--world", "2"]);
    assert!(
        out.contains("0..512") && out.contains("[0, 400, 512]") && out.contains("512..1024"),
        "{out}"
    );
    assert!(
        out.contains("of 9 tensors pass") && !out.contains("FAIL"),
        "{out}"
    );
    let out = run_ok(&[
        "cp",
        "--case",
        s(&case),
        "--intra",
        "--subseq-len",
        "128",
        "--cp-engine",
        "naive",
    ]);
    assert!(out.contains("cuts=[128, 256"), "{out}");
    // A "candidate" without outputs fails on every tensor (all missing).
    let (rc, out, _) = code(&["verify", "--case", s(&case), "--candidate", s(&case)]);
    assert_eq!(rc, 1);
    assert!(out.contains("missing from the candidate"), "{out}");
    for args in [
        vec!["cp", "--case", s(&case), "--world", "3"],
        vec!["cp", "--case", s(&case), "--cuts", "0,10"],
        vec!["cp", "--case", s(&case), "--cuts", "10,5"],
        vec!["cp", "--case", s(&case), "--world", "2", "--cuts", "512"],
        vec![
            "cp",
            "--case",
            s(&case),
            "--world",
            "2",
            "--cp-engine",
            "turbo",
        ],
        vec![
            "verify",
            "--case",
            s(&case),
            "--impl",
            "naive",
            "--world",
            "2",
        ],
    ] {
        let (rc, _, err) = code(&args);
        assert_eq!(rc, 2, "{args:?}: {err}");
    }
}

/// FLA's zigzag layout from the flag and from the case's `cp` metadata: the
/// table lists the parts in chain order, CP equals non-CP, and every
/// misuse is a usage error.
#[test]
fn cp_zigzag_layout_from_flag_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let case = dir.path().join("c.safetensors");
    run_ok(&[
        "gen",
        "--op",
        "kda",
        "--lengths",
        "400,624",
        "--shape",
        "1,1024,1,2,8,8",
        "--gate",
        "lowerbound",
        "--out",
        s(&case),
    ]);
    let out = run_ok(&[
        "cp",
        "--case",
        s(&case),
        "--world",
        "2",
        "--layout",
        "zigzag",
    ]);
    let order: Vec<usize> = ["0.front", "1.front", "1.back", "0.back"]
        .iter()
        .map(|l| out.find(l).unwrap_or_else(|| panic!("{l} missing: {out}")))
        .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{out}");
    assert!(
        out.contains("768..1024") && out.contains("[0, 144, 256]"),
        "{out}"
    );
    assert!(out.contains("9 of 9 tensors pass"), "{out}");

    let zz = dir.path().join("zz.safetensors");
    let mut c = Case::read(&case).unwrap();
    c.meta.cp = Some(CpLayout::World(2, Layout::Zigzag));
    c.write(&zz).unwrap();
    assert_eq!(Case::read(&zz).unwrap().meta.cp, c.meta.cp);
    let out = run_ok(&["cp", "--case", s(&zz)]);
    assert!(
        out.contains("world=2, zigzag") && out.contains("0.back"),
        "{out}"
    );
    // The flag overrides the case's layout.
    let out = run_ok(&["cp", "--case", s(&zz), "--layout", "contiguous"]);
    assert!(
        !out.contains("zigzag") && out.contains("512..1024"),
        "{out}"
    );

    for args in [
        vec![
            "cp",
            "--case",
            s(&case),
            "--world",
            "3",
            "--layout",
            "zigzag",
        ],
        vec![
            "cp",
            "--case",
            s(&case),
            "--cuts",
            "512",
            "--layout",
            "zigzag",
        ],
        vec!["cp", "--case", s(&case), "--world", "2", "--layout", "ring"],
        vec![
            "run",
            "--case",
            s(&case),
            "--impl",
            "chunk",
            "--layout",
            "zigzag",
        ],
    ] {
        let (rc, _, err) = code(&args);
        assert_eq!(rc, 2, "{args:?}: {err}");
        assert!(
            err.contains("layout") || err.contains("zigzag"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn diagnose_locates_a_fault_and_draws_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    let case = dir.path().join("c.safetensors");
    run_ok(&[
        "gen",
        "--op",
        "kda",
        "--lengths",
        "100,92",
        "--shape",
        "1,192,1,1,8,8",
        "--expected",
        "--out",
        s(&case),
    ]);
    let png = dir.path().join("err.png");
    let (rc, out, err) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--impl",
        "cp",
        "--world",
        "2",
        "--precision",
        "partial-merge-v",
        "--plot",
        s(&png),
    ]);
    assert_eq!(rc, 1, "{out}{err}");
    assert!(
        out.contains("error starts at token 96 (batch 0, sequence 0, rank 1"),
        "{out}"
    );
    assert_eq!(&std::fs::read(&png).unwrap()[1..4], b"PNG");
    let (rc, json, _) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--impl",
        "cp",
        "--world",
        "2",
        "--json",
    ]);
    assert_eq!(rc, 0);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v["first_bad"].is_null(), "{v}");
    let (rc, _, err) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--precision",
        "drop-merged-state",
    ]);
    assert_eq!(rc, 2, "a CP fault needs --impl cp: {err}");
    let (rc, _, err) = code(&["diagnose", "--case", s(&case), "--precision", "fp8"]);
    assert_eq!(rc, 2);
    assert!(err.contains("unknown --precision `fp8`"), "{err}");
}

/// Every vector width gives the same bits: with `DELTAREF_NO_SIMD` (the
/// baseline code) and `DELTAREF_NO_AVX512` (AVX2 where the CPU has it) the
/// committed fixtures still regenerate byte for byte (the in-process fixture
/// test covers the default, widest path). The chunked engines' products are
/// sums in a fixed order (the oracle's `fast::gemm`), so this holds for their
/// intermediates too.
#[test]
fn fixtures_regenerate_on_every_code_path() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    for cap in ["DELTAREF_NO_SIMD", "DELTAREF_NO_AVX512"] {
        let out = deltaref()
            .env(cap, "1")
            .args(["fixtures", "--check", s(&fixtures)])
            .output()
            .expect("runs");
        assert!(
            out.status.success(),
            "{cap}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
