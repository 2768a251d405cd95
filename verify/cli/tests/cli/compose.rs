//! `gen --world/--cuts/--layout` writes the case's `cp` metadata, which
//! `cp` then uses without flags; `--precision` composed from a preset and
//! per-stage overrides (`fla-bf16,S_ext=bf16,g=fp16,midpoint=off`) and the
//! `fla-fp16` preset.

use std::path::{Path, PathBuf};

use super::common::{code, run_ok, s};

/// A KDA case over two sequences (40 and 88 tokens), long-memory draws so
/// that the state rank 0 hands on matters, with `extra` gen flags.
fn kda(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let case = dir.join(format!("{name}.safetensors"));
    let mut a = vec![
        "gen",
        "--op",
        "kda",
        "--lengths",
        "40,88",
        "--shape",
        "1,128,1,1,8,8",
        "--gate",
        "lowerbound",
        "--l2norm",
        "--regime",
        "long-memory",
        "--expected",
        "--seed",
        "3",
        "--out",
        s(&case),
    ];
    a.extend(extra);
    run_ok(&a);
    case
}

/// The `case` metadata of a case file (the safetensors header's
/// `__metadata__.case`, a JSON string).
fn case_meta(path: &Path) -> serde_json::Value {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    serde_json::from_str(h["__metadata__"]["case"].as_str().unwrap()).unwrap()
}

/// `cp`'s report without its first line (which names the case file).
fn body(out: &str) -> String {
    out.lines().skip(1).collect::<Vec<_>>().join("\n")
}

#[test]
fn gen_writes_the_cp_layout_and_cp_uses_it_without_flags() {
    let dir = tempfile::tempdir().unwrap();
    let plain = kda(dir.path(), "plain", &[]);
    for (name, flags, meta) in [
        ("world", vec!["--world", "2"], r#"{"world":2}"#),
        (
            "zigzag",
            vec!["--world", "2", "--layout", "zigzag"],
            r#"{"world":2,"layout":"zigzag"}"#,
        ),
        (
            "cuts",
            vec!["--cuts", "30,77,101"],
            r#"{"cuts":[30,77,101]}"#,
        ),
    ] {
        let with = kda(dir.path(), name, &flags);
        let want: serde_json::Value = serde_json::from_str(meta).unwrap();
        assert_eq!(case_meta(&with)["cp"], want, "{name}");
        let (rc, from_meta, err) = code(&["cp", "--case", s(&with)]);
        assert_eq!(rc, 0, "{name}: {from_meta}{err}");
        let mut a = vec!["cp", "--case", s(&plain)];
        a.extend(&flags);
        let (rc, from_flags, err) = code(&a);
        assert_eq!(rc, 0, "{name}: {from_flags}{err}");
        let same = |o: &str, f: &Path| body(o).replace(s(f), "CASE");
        assert_eq!(same(&from_meta, &with), same(&from_flags, &plain), "{name}");
        assert!(from_meta.contains("rank"), "{name}: {from_meta}");
    }
    // Without metadata and without flags there is no plan to use.
    let (rc, _, err) = code(&["cp", "--case", s(&plain)]);
    assert_eq!(rc, 2, "{err}");
}

#[test]
fn gen_refuses_a_cp_layout_that_cannot_cut_the_case() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.safetensors");
    let base = [
        "gen",
        "--op",
        "kda",
        "--lengths",
        "40,88",
        "--shape",
        "1,128,1,1,8,8",
        "--out",
    ];
    for (flags, says) in [
        (vec!["--world", "3"], "--world"),
        (vec!["--world", "0"], "--world"),
        (vec!["--layout", "zigzag"], "--layout applies to --world"),
        (vec!["--world", "2", "--cuts", "64"], "not both"),
        (vec!["--cuts", "64,200"], "--world/--cuts"),
    ] {
        let mut a: Vec<&str> = base.to_vec();
        a.push(s(&out));
        a.extend(&flags);
        let (rc, _, err) = code(&a);
        assert_eq!(rc, 2, "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
        assert!(!out.exists(), "{flags:?} wrote a file");
    }
}

/// `verify --json`'s `(tensor, norm_ratio)` rows
/// ([`crate::precision::norm_ratios`]).
fn ratios(case: &Path, imp: &str, precision: &str) -> Vec<(String, f64)> {
    let (_, json, err) = code(&[
        "verify",
        "--case",
        s(case),
        "--impl",
        imp,
        "--precision",
        precision,
        "--json",
    ]);
    assert!(!json.is_empty(), "{err}");
    crate::precision::norm_ratios(&json)
}

#[test]
fn a_cp_stage_override_changes_cp_runs_only() {
    let dir = tempfile::tempdir().unwrap();
    let case = kda(dir.path(), "k", &["--world", "2"]);
    let base = ratios(&case, "chunk", "fla-bf16");
    assert_eq!(ratios(&case, "chunk", "fla-bf16,S_ext=bf16"), base);
    assert_eq!(ratios(&case, "chunk", "fla-bf16,merged=bf16"), base);
    let cp = ratios(&case, "cp", "fla-bf16");
    for over in ["fla-bf16,S_ext=bf16", "fla-bf16,merged=bf16"] {
        let changed = ratios(&case, "cp", over);
        assert_ne!(changed, cp, "{over}");
    }
    // Restating what the preset already does changes nothing.
    assert_eq!(ratios(&case, "cp", "fla-bf16,S_ext=f32"), cp);
}

#[test]
fn gate_storage_and_midpoint_overrides_change_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let case = kda(dir.path(), "k", &[]);
    let base = ratios(&case, "chunk", "fla-bf16");
    // fla-bf16 stores g in bf16 with the other inputs; fp16 keeps 3 more bits.
    let g16 = ratios(&case, "chunk", "fla-bf16,g=fp16");
    assert_ne!(g16, base);
    let dg = |r: &[(String, f64)]| r.iter().find(|(t, _)| t == "dg").unwrap().1;
    assert!(dg(&g16) <= dg(&base), "{g16:?} vs {base:?}");
    // The lowerbound gate uses the midpoint factorisation; off is another run.
    assert_ne!(ratios(&case, "chunk", "fla-bf16,midpoint=off"), base);
}

#[test]
fn fla_fp16_errors_are_about_8x_smaller_than_fla_bf16() {
    // bf16 keeps 8 significant bits, fp16 11: each rounding is 2^3 = 8
    // times finer, and the errors (sums of such roundings) scale with it.
    let dir = tempfile::tempdir().unwrap();
    let case = kda(dir.path(), "k", &[]);
    let bf16 = ratios(&case, "chunk", "fla-bf16");
    let fp16 = ratios(&case, "chunk", "fla-fp16");
    // The per-token tensors; dA_log and ddt_bias sum every token's rounding
    // (measured 29x on this case, 2-core box). Measured per-token ratios:
    // 7-17 (dg 16.7: its error is mostly the gate's own rounding, which
    // fp16's smaller range near 0 resolves better still).
    let per_token = |t: &str| !matches!(t, "dA_log" | "ddt_bias");
    for ((t, b), (_, f)) in bf16.iter().zip(&fp16).filter(|((t, _), _)| per_token(t)) {
        let r = b / f;
        assert!(
            (4.0..24.0).contains(&r),
            "{t}: bf16 {b:e} / fp16 {f:e} = {r}"
        );
    }
}

#[test]
fn a_bad_override_is_refused_with_the_valid_choices() {
    let dir = tempfile::tempdir().unwrap();
    let case = kda(dir.path(), "k", &[]);
    for (precision, says) in [
        (
            "fla-bf16,S_xt=bf16",
            "unknown stage `S_xt` (stages: inputs, g_cumsum, Akk",
        ),
        (
            "fla-bf16,S_ext=bf17",
            "unknown dtype `bf17` (dtypes: f64, f32, bf16, f16",
        ),
        ("fla-bf16,midpoint=maybe", "midpoint is on or off"),
        ("fla-bf16,S_ext", "expected STAGE=DTYPE"),
        ("fla-bf17,S_ext=bf16", "unknown --precision `fla-bf17`"),
    ] {
        let (rc, _, err) = code(&[
            "verify",
            "--case",
            s(&case),
            "--impl",
            "chunk",
            "--precision",
            precision,
        ]);
        assert_eq!(rc, 2, "{precision}: {err}");
        assert!(err.contains(says), "{precision}: {err}");
    }
}

#[test]
fn gen_dplr_lower_bound_is_recorded_and_bad_bounds_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("d.safetensors");
    let base = ["gen", "--op", "dplr", "--shape", "1,32,1,8,8", "--out"];
    let with = |extra: &[&str]| {
        let mut a: Vec<&str> = base.to_vec();
        a.push(s(&out));
        a.extend(extra);
        code(&a)
    };
    let (rc, _, err) = with(&["--lower-bound", "-8"]);
    assert_eq!(rc, 0, "{err}");
    assert_eq!(case_meta(&out)["lower_bound"], serde_json::json!(-8.0));
    for (extra, says) in [
        (vec!["--lower-bound", "1"], "negative"),
        (vec!["--gate", "kda"], "--gate kda does not apply"),
    ] {
        let (rc, _, err) = with(&extra);
        assert_eq!(rc, 2, "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}
