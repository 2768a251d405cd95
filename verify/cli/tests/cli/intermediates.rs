//! Issue 15 on the real binary: input regimes, intermediates out (`run
//! --intermediates`) and in (`verify` on a candidate holding them),
//! `verify --forward-only`, and `diagnose` judging a fault against bf16
//! rounding noise.

use super::common::{code, run_ok, s};

use std::path::{Path, PathBuf};

use deltaref_verify::case::{Case, Dtype, Op};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

#[test]
fn regimes_are_recorded_and_cp_says_whether_the_merge_is_exercised() {
    let dir = tempfile::tempdir().unwrap();
    let case = dir.path().join("lm.safetensors");
    let gen = |regime: &str| {
        run_ok(&[
            "gen",
            "--op",
            "kda",
            "--shape",
            "1,256,1,1,8,8",
            "--gate",
            "lowerbound",
            "--l2norm",
            "--regime",
            regime,
            "--out",
            s(&case),
        ])
    };
    gen("long-memory");
    let c = Case::read(&case).unwrap();
    assert_eq!(c.meta.to_json()["regime"], "long-memory");
    let out = run_ok(&["cp", "--case", s(&case), "--world", "4"]);
    assert!(out.contains("the merge is exercised"), "{out}");
    gen("fla-test");
    let out = run_ok(&["cp", "--case", s(&case), "--world", "4"]);
    assert!(out.contains("merge faults barely show"), "{out}");
    let (rc, _, err) = code(&["gen", "--op", "kda", "--regime", "slow", "--out", s(&case)]);
    assert_eq!(rc, 2);
    assert!(err.contains("--regime: unknown regime `slow`"), "{err}");
}

/// Rewrites `name` in a candidate file through `f`.
fn edit(path: &Path, name: &str, f: impl Fn(&mut ndarray::ArrayD<f64>)) {
    let mut c = Case::read_candidate(path, Op::Kda).unwrap();
    let mut t = c.tensors[name].clone();
    f(&mut t);
    c.insert(name, t, Dtype::F64);
    c.write(path).unwrap();
}

#[test]
fn intermediates_out_and_in_name_the_first_chunk_and_rank_out_of_band() {
    let dir = tempfile::tempdir().unwrap();
    let case = fixture("cp_kda_intermediates_world2.safetensors");
    let cand = dir.path().join("cand.safetensors");
    let out = run_ok(&[
        "run",
        "--case",
        s(&case),
        "--impl",
        "cp",
        "--intermediates",
        s(&cand),
    ]);
    assert!(out.contains("h            [1, 9, 1, 8, 8]"), "{out}");
    assert!(out.contains("M            [2, 1, 8, 8]"), "{out}");
    let out = run_ok(&["verify", "--case", s(&case), "--candidate", s(&cand)]);
    assert!(out.contains("22 of 22 tensors pass"), "{out}");
    // The stored intermediates are the ones `run` writes.
    let stored = Case::read(&case).unwrap();
    let written = Case::read_candidate(&cand, Op::Kda).unwrap();
    for &n in Op::Kda.info().intermediates {
        assert_eq!(stored.tensors.get(n), written.tensors.get(n), "{n}");
    }
    // Rank 1 starts at token 64: its first chunk is chunk 5 (rank 0 holds
    // chunks 0..16, 16..20, 20..36, 36..52, 52..64).
    edit(&cand, "v_new", |t| {
        t.slice_mut(ndarray::s![.., 70.., .., ..])
            .mapv_inplace(|x| x * 1.1)
    });
    edit(&cand, "M", |t| {
        t.slice_mut(ndarray::s![1, .., .., ..]).fill(0.0)
    });
    let (rc, out, _) = code(&["verify", "--case", s(&case), "--candidate", s(&cand)]);
    assert_eq!(rc, 1, "{out}");
    let line = |n: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{n} ")))
            .unwrap_or_else(|| panic!("no row {n}: {out}"))
            .to_string()
    };
    assert!(
        line("v_new").contains("chunk 5 (batch 0, tokens 64..80, rank 1)"),
        "{out}"
    );
    assert!(
        line("M").contains("rank 1") && line("M").ends_with("FAIL"),
        "{out}"
    );
    assert!(line("w").ends_with("pass"), "{out}");
}

#[test]
fn intermediates_are_refused_where_they_do_not_exist() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("i.safetensors");
    let kda = fixture("kda_intermediates_lowerbound_l2norm.safetensors");
    let (rc, _, err) = code(&["run", "--case", s(&kda), "--intermediates", s(&out)]);
    assert_eq!(rc, 2);
    assert!(err.contains("--impl chunk or cp"), "{err}");
    let dplr = fixture("dplr_rwkv7.safetensors");
    let (rc, _, err) = code(&[
        "run",
        "--case",
        s(&dplr),
        "--impl",
        "chunk",
        "--intermediates",
        s(&out),
    ]);
    assert_eq!(rc, 2);
    assert!(err.contains("this case is dplr"), "{err}");
    assert!(!out.exists());
    // Unknown names stay errors, next to the intermediates.
    let mut c = Case::read(&kda).unwrap();
    let akk = c.tensors["Akk"].clone();
    c.insert("Akk_inv", akk, Dtype::F64);
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, c.to_bytes().unwrap()).unwrap();
    let (rc, _, err) = code(&["verify", "--case", s(&kda), "--candidate", s(&bad)]);
    assert_eq!(rc, 2);
    assert!(err.contains("`Akk_inv`: not a tensor of op kda"), "{err}");
    // A non-CP case has no per-rank tensors to compare against.
    let cp_int = dir.path().join("cp.safetensors");
    run_ok(&[
        "run",
        "--case",
        s(&fixture("cp_kda_intermediates_world2.safetensors")),
        "--impl",
        "cp",
        "--intermediates",
        s(&cp_int),
    ]);
    let mut c = Case::read_candidate(&cp_int, Op::Kda).unwrap();
    let m = c.tensors["M"].clone();
    let mut own = Case::read_candidate(&kda, Op::Kda).unwrap();
    own.insert("M", m, Dtype::F64);
    c = own;
    c.write(&bad).unwrap();
    let (rc, out, _) = code(&["verify", "--case", s(&kda), "--candidate", s(&bad)]);
    assert_eq!(rc, 1);
    assert!(out.contains("CP tensors need a CP case"), "{out}");
}

#[test]
fn forward_only_checks_outputs_and_final_state_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let case = fixture("kda_intermediates_lowerbound_l2norm.safetensors");
    let full = Case::read(&case).unwrap();
    let mut fwd = Case::new(full.meta.clone());
    for n in ["o", "final_state", "h", "Aqk"] {
        fwd.insert(n, full.tensors[n].clone(), Dtype::F32);
    }
    let cand = dir.path().join("fwd.safetensors");
    fwd.write(&cand).unwrap();
    let (rc, out, _) = code(&["verify", "--case", s(&case), "--candidate", s(&cand)]);
    assert_eq!(rc, 1, "gradients missing without --forward-only: {out}");
    let out = run_ok(&[
        "verify",
        "--case",
        s(&case),
        "--candidate",
        s(&cand),
        "--forward-only",
    ]);
    assert!(
        out.contains("forward only: outputs and final state compared"),
        "{out}"
    );
    assert!(out.contains("4 of 4 tensors pass"), "{out}");
    assert!(!out.contains("dq "), "{out}");
    let json = run_ok(&[
        "verify",
        "--case",
        s(&case),
        "--candidate",
        s(&cand),
        "--forward-only",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["forward_only"], true);
    assert_eq!(v["intermediates"].as_array().unwrap().len(), 2);
}

#[test]
fn diagnose_judges_a_fault_against_bf16_noise() {
    let dir = tempfile::tempdir().unwrap();
    let case = fixture("cp_kda_long_memory_world8_bf16.safetensors");
    let run = |precision: &str| {
        code(&[
            "diagnose",
            "--case",
            s(&case),
            "--impl",
            "cp",
            "--precision",
            precision,
        ])
    };
    let (_, out, err) = run("fla-bf16");
    assert!(out.contains("4× the error of `fla-bf16`"), "{out}{err}");
    // No per-token tensor leaves the noise band, but `dg` as a whole is
    // above verify's 5e-3: the headline says so, as the exit status does.
    assert!(
        out.contains("no per-token tensor leaves the noise band\n"),
        "{out}"
    );
    let last = out.lines().last().unwrap();
    assert!(last.starts_with("verdict: FAIL (dg fail verify"), "{out}");
    // World 8 over 768 tokens: rank 1 starts at token 96.
    let (rc, out, _) = run("fla-bf16+partial-merge-v");
    assert_eq!(rc, 1);
    assert!(
        out.contains("error starts at token 96 (batch 0, sequence 1, rank 1"),
        "{out}"
    );
    let o = out
        .lines()
        .find(|l| l.starts_with("o ") && l.contains("per V column"))
        .unwrap();
    assert!(o.contains("upper half of V only"), "{out}");
    let (_, out, _) = run("fla-bf16+drop-merged-state");
    assert!(
        out.contains("error starts at token 96 (batch 0, sequence 1, rank 1"),
        "{out}"
    );
    let o = out
        .lines()
        .find(|l| l.starts_with("o ") && l.contains("per V column"))
        .unwrap();
    assert!(!o.contains("upper half of V only"), "{out}");
    let (rc, _, err) = run("fla-bf16+akk-bf16");
    assert_eq!(rc, 2, "a precision preset is not a fault: {err}");
    let _ = dir;
}
