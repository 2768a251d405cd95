//! Issue 53 (part A) on the real binary: the debugging workflow's bugs and
//! silent answers — intermediates from the run's own precision, conv's CP
//! table, checks that cannot fail refused, a candidate from other inputs
//! refused, a gate outside its domain named, diagnose's verdict, excursions,
//! `--forward-only`, noise reference and CP layout, help text.

use super::common::{code, run_ok, s};

use std::path::{Path, PathBuf};

use deltaref_verify::case::{Case, Dtype, Op};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// `gen --op kda` of a small case in `dir` (`extra` flags appended).
fn gen_kda(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let path = dir.join(name);
    let mut args = vec![
        "gen",
        "--op",
        "kda",
        "--shape",
        "1,64,1,2,8,8",
        "--out",
        s(&path),
    ];
    args.extend_from_slice(extra);
    run_ok(&args);
    path
}

fn max_diff(a: &ndarray::ArrayD<f64>, b: &ndarray::ArrayD<f64>) -> f64 {
    a.iter()
        .zip(b.iter())
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
}

/// `run --intermediates` writes the intermediates of the run that made the
/// outputs: in f32 (`--compute f32` or `--precision f32`) they carry f32
/// rounding like `o` does, not the f64 oracle's values.
#[test]
fn intermediates_come_from_the_runs_own_precision() {
    let dir = tempfile::tempdir().unwrap();
    let case = fixture("cp_kda_intermediates_world2.safetensors");
    let write = |name: &str, flags: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec![
            "run",
            "--case",
            s(&case),
            "--impl",
            "cp",
            "--intermediates",
            s(&out),
        ];
        args.extend_from_slice(flags);
        run_ok(&args);
        Case::read_candidate(&out, Op::Kda).unwrap()
    };
    let f64_ = write("f64.safetensors", &[]);
    let compute = write("c32.safetensors", &["--compute", "f32"]);
    let preset = write("p32.safetensors", &["--precision", "f32"]);
    assert_eq!(
        compute.tensors, preset.tensors,
        "--compute f32 = --precision f32"
    );
    for name in [
        "o",
        "Akk",
        "h",
        "w",
        "u",
        "v_new",
        "S_ext",
        "M",
        "merged_initial_state",
    ] {
        let (a, b) = (&f64_.tensors[name], &compute.tensors[name]);
        let scale = a.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
        let d = max_diff(a, b);
        assert!(
            d > 0.0 && d < 1e-4 * scale,
            "{name}: f32 vs f64 intermediates differ by {d:e} (scale {scale:e})"
        );
    }
}

/// An exact CP run of causal conv1d with SiLU agrees with non-CP to
/// rounding in its per-rank table too (the merged cache gradient against a
/// reference run from the non-CP cache), and the table shows the cache,
/// not KDA's `S_ext`/`M` columns and long-memory hint.
#[test]
fn conv_cp_table_shows_its_cache_and_agrees_with_non_cp() {
    for case in [fixture("causal_conv1d_varlen_silu_bias.safetensors")] {
        for world in ["2", "4"] {
            let out = run_ok(&["cp", "--case", s(&case), "--world", world]);
            assert!(
                out.contains("|cache in|") && out.contains("|dcache in|"),
                "{out}"
            );
            for kda in ["|S_ext|", "|M|", "long-memory", "max |M|"] {
                assert!(!out.contains(kda), "{kda}: {out}");
            }
            let rows: Vec<&str> = out
                .lines()
                .skip_while(|l| !l.starts_with("rank "))
                .skip(1)
                .take_while(|l| l.starts_with(|c: char| c.is_ascii_digit()))
                .collect();
            assert_eq!(rows.len(), world.parse::<usize>().unwrap(), "{out}");
            let mut checked = 0;
            for row in rows {
                let cols: Vec<&str> = row.split_whitespace().collect();
                for c in [cols[cols.len() - 1], cols[cols.len() - 4]] {
                    if c != "-" {
                        let e: f64 = c.parse().unwrap();
                        assert!(e <= 1e-10, "vs nonCP {e:e}: {out}");
                        checked += 1;
                    }
                }
            }
            assert!(checked >= 2, "{out}");
        }
    }
}

/// A check that cannot fail is refused: `verify` of a case without stored
/// truth with the oracle itself says what would have been compared and how
/// to get a truth; anything else against the oracle still runs.
#[test]
fn verify_refuses_to_compare_the_oracle_with_itself() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen_kda(dir.path(), "c.safetensors", &[]);
    let (rc, out, err) = code(&["verify", "--case", s(&case)]);
    assert_eq!(rc, 2, "{out}{err}");
    for words in [
        "stores no expected results",
        "f64 oracle",
        "by construction",
        "--expected",
    ] {
        assert!(err.contains(words), "{words}: {err}");
    }
    let out = run_ok(&["verify", "--case", s(&case), "--impl", "chunk"]);
    assert!(out.contains("against impl:naive (f64 oracle)"), "{out}");
    let truth = gen_kda(dir.path(), "t.safetensors", &["--expected"]);
    run_ok(&["verify", "--case", s(&truth)]);
}

/// Every report header names the preset and the compute dtype.
#[test]
fn report_headers_name_the_preset_and_compute_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen_kda(dir.path(), "c.safetensors", &["--expected"]);
    let out = run_ok(&[
        "verify",
        "--case",
        s(&case),
        "--impl",
        "chunk",
        "--precision",
        "f32",
    ]);
    assert!(
        out.lines()
            .next()
            .unwrap()
            .contains("[precision f32, compute f32]"),
        "{out}"
    );
    let out = run_ok(&["verify", "--case", s(&case)]);
    assert!(
        out.lines()
            .next()
            .unwrap()
            .contains("[precision exact, compute f64]"),
        "{out}"
    );
    let out = run_ok(&["run", "--case", s(&case), "--compute", "f32"]);
    assert!(
        out.lines()
            .next()
            .unwrap()
            .contains("[precision exact, compute f32]"),
        "{out}"
    );
    let (_, out, _) = code(&[
        "cp",
        "--case",
        s(&case),
        "--world",
        "2",
        "--precision",
        "fla-bf16",
    ]);
    assert!(out.contains("[precision fla-bf16, compute f32]"), "{out}");
    let (_, out, _) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--impl",
        "chunk",
        "--precision",
        "akk-bf16",
    ]);
    let first = out.lines().next().unwrap();
    assert!(
        first.contains("[precision akk-bf16, compute f32] against case file"),
        "{out}"
    );
}

/// A candidate computed from other inputs than the case's (another seed,
/// another packing) is refused naming the tensor and the difference; the
/// same inputs in bf16 are the case's.
#[test]
fn a_candidate_from_other_inputs_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen_kda(dir.path(), "c.safetensors", &["--expected"]);
    let other = gen_kda(dir.path(), "o.safetensors", &["--expected", "--seed", "1"]);
    let (rc, out, err) = code(&["verify", "--case", s(&case), "--candidate", s(&other)]);
    assert_eq!(rc, 2, "{out}{err}");
    assert!(
        err.contains("`q`") || err.contains("q:") || err.contains(" q "),
        "{err}"
    );
    assert!(
        err.contains("differs from the case's by up to") && err.contains("other inputs"),
        "{err}"
    );
    let (rc, _, err) = code(&["diagnose", "--case", s(&case), "--candidate", s(&other)]);
    assert_eq!(rc, 2, "{err}");
    let lens = |l: &str, name: &str| {
        let p = dir.path().join(name);
        run_ok(&[
            "gen",
            "--op",
            "kda",
            "--lengths",
            l,
            "--shape",
            "1,64,1,2,8,8",
            "--expected",
            "--out",
            s(&p),
        ]);
        p
    };
    let (a, b) = (
        lens("20,44", "a.safetensors"),
        lens("30,34", "b.safetensors"),
    );
    let (rc, _, err) = code(&["verify", "--case", s(&a), "--candidate", s(&b)]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("cu_seqlens") && err.contains("[0, 30, 64]"),
        "{err}"
    );
    // A port's bf16 copy of the case's own inputs passes the check.
    let c = Case::read(&case).unwrap();
    let mut bf = Case::new(c.meta.clone());
    for (n, t) in &c.tensors {
        bf.insert(n, t.clone(), Dtype::Bf16);
    }
    let bpath = dir.path().join("bf.safetensors");
    bf.write(&bpath).unwrap();
    let (rc, out, err) = code(&["verify", "--case", s(&case), "--candidate", s(&bpath)]);
    assert!(rc == 0 || rc == 1, "{out}{err}");
}

/// A gate given in linear space (decays in (0, 1] where a log-decay ≤ 0 is
/// expected) is named with its count on stderr; the run goes on.
#[test]
fn a_gate_in_linear_space_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let path = gen_kda(dir.path(), "c.safetensors", &[]);
    let (rc, _, err) = code(&["run", "--case", s(&path)]);
    assert_eq!(rc, 0);
    assert!(!err.contains("warning"), "{err}");
    let mut c = Case::read(&path).unwrap();
    let g = c.tensors["g"].mapv(f64::exp);
    let n = g.len();
    c.insert("g", g, Dtype::F64);
    c.write(&path).unwrap();
    for cmd in ["run", "verify", "diagnose"] {
        let mut args = vec![cmd, "--case", s(&path)];
        if cmd != "run" {
            args.extend(["--impl", "chunk"]);
        }
        let (_, _, err) = code(&args);
        assert!(
            err.contains("warning: `g` is a log-decay")
                && err.contains(&format!("{n} of {n} entries are positive")),
            "{cmd}: {err}"
        );
    }
}

/// Writes `case`'s f64 truth as a candidate, `edit` applied, with `dtype`
/// declared in its metadata (None: the `case` entry names the op only).
fn candidate(
    case: &Path,
    to: &Path,
    dtype: Option<&str>,
    edit: impl Fn(&str, &mut ndarray::ArrayD<f64>),
) {
    let c = Case::read(case).unwrap();
    let mut meta = c.meta.clone();
    meta.dtype = dtype.map(|d| Dtype::parse(d).unwrap());
    let mut cand = Case::new(meta);
    for (n, mut t) in c.results() {
        edit(&n, &mut t);
        cand.insert(&n, t, Dtype::F64);
    }
    cand.write(to).unwrap();
}

/// diagnose's exit status is verify's, and its last line says it: a
/// failing tensor that is not per-token (`dh0`) fails both, and the
/// headline names it; a clean candidate passes both.
#[test]
fn diagnose_exits_as_verify_with_a_verdict_headline() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen_kda(
        dir.path(),
        "c.safetensors",
        &["--expected", "--initial-state"],
    );
    let cand = dir.path().join("cand.safetensors");
    for (bad, want) in [(false, 0), (true, 1)] {
        candidate(&case, &cand, None, |n, t| {
            if bad && n == "dh0" {
                t.mapv_inplace(|v| v * 1.1)
            }
        });
        let (vrc, _, _) = code(&["verify", "--case", s(&case), "--candidate", s(&cand)]);
        let (drc, out, err) = code(&["diagnose", "--case", s(&case), "--candidate", s(&cand)]);
        assert_eq!((vrc, drc), (want, want), "{out}{err}");
        let last = out.lines().last().unwrap();
        if bad {
            assert!(
                last.starts_with("verdict: FAIL") && last.contains("dh0"),
                "{out}"
            );
        } else {
            assert!(last.starts_with("verdict: pass"), "{out}");
        }
    }
}

/// Every separate stretch out of band is listed, with its sequence.
#[test]
fn diagnose_lists_every_excursion() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen_kda(dir.path(), "c.safetensors", &["--expected"]);
    let cand = dir.path().join("cand.safetensors");
    candidate(&case, &cand, None, |n, t| {
        if n == "o" {
            for range in [3..5, 40..41] {
                t.slice_mut(ndarray::s![.., range, .., ..])
                    .mapv_inplace(|v| v * 2.0);
            }
        }
    });
    let (rc, out, _) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--candidate",
        s(&cand),
        "--impl",
        "chunk",
        "--chunk-size",
        "16",
    ]);
    assert_eq!(rc, 1, "{out}");
    assert!(out.contains("`o` leaves the band in 2 place(s)"), "{out}");
    assert!(
        out.contains("tokens 3..16") && out.contains("tokens 40..48"),
        "{out}"
    );
}

/// `diagnose --forward-only` judges a forward-only port on its outputs and
/// final state (no backward run, no missing gradients counted).
#[test]
fn diagnose_forward_only() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen_kda(dir.path(), "c.safetensors", &[]);
    let full = dir.path().join("full.safetensors");
    run_ok(&["run", "--case", s(&case), "--out", s(&full)]);
    let c = Case::read(&full).unwrap();
    let mut fwd = Case::new(c.meta.clone());
    for n in ["o", "final_state"] {
        if let Some(t) = c.tensors.get(n) {
            fwd.insert(n, t.clone(), Dtype::F64);
        }
    }
    let fpath = dir.path().join("fwd.safetensors");
    fwd.write(&fpath).unwrap();
    let (rc, out, err) = code(&["diagnose", "--case", s(&case), "--candidate", s(&fpath)]);
    assert_eq!(
        rc, 1,
        "missing gradients fail without --forward-only: {out}{err}"
    );
    let (rc, out, err) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--candidate",
        s(&fpath),
        "--forward-only",
    ]);
    assert_eq!(rc, 0, "{out}{err}");
    assert!(out.contains("\no ") && !out.contains("\ndq "), "{out}");
    let (rc, out, err) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--impl",
        "chunk",
        "--precision",
        "fla-bf16",
        "--forward-only",
        "--bisect",
    ]);
    assert!(rc == 0 || rc == 1, "{out}{err}");
    assert!(!out.contains("dq") && out.contains("o"), "{out}");
}

/// `--noise auto` follows the dtype the candidate declares, and the report
/// says which reference it used and why; an undeclared candidate with bf16
/// inputs is assumed bf16, and says so.
#[test]
fn diagnose_noise_follows_the_declared_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen_kda(
        dir.path(),
        "c.safetensors",
        &["--expected", "--dtype", "bf16"],
    );
    let cand = dir.path().join("cand.safetensors");
    for (declared, want) in [
        (
            Some("f32"),
            "`f32` (chosen by the candidate declares dtype f32)",
        ),
        (
            Some("bf16"),
            "`fla-bf16` (chosen by the candidate declares dtype bf16)",
        ),
        (
            None,
            "`fla-bf16` (chosen by the candidate declares no dtype",
        ),
    ] {
        candidate(&case, &cand, declared, |_, _| {});
        let out = run_ok(&["diagnose", "--case", s(&case), "--candidate", s(&cand)]);
        assert!(out.contains(want), "{declared:?}: {out}");
    }
}

/// `run --out` writes a candidate that declares what computed it: the
/// dtype (f32 for `--compute f32` or `--precision f32`, bf16 for
/// `fla-bf16`, f64 for the oracle) and the preset, not the case's bf16
/// input dtype; `--noise auto` then takes the noise of the run that made it.
#[test]
fn run_candidates_declare_their_compute_dtype_and_preset() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen_kda(
        dir.path(),
        "c.safetensors",
        &["--expected", "--dtype", "bf16"],
    );
    let cand = dir.path().join("cand.safetensors");
    for (how, dtype, precision, noise) in [
        (
            &["--compute", "f32"][..],
            "f32",
            None,
            "`f32` (chosen by the candidate declares dtype f32)",
        ),
        (
            &["--precision", "f32"],
            "f32",
            Some("f32"),
            "`f32` (chosen by the candidate declares precision f32)",
        ),
        (
            &["--precision", "fla-bf16"],
            "bf16",
            Some("fla-bf16"),
            "`fla-bf16` (chosen by the candidate declares precision fla-bf16)",
        ),
    ] {
        let mut args = vec![
            "run",
            "--case",
            s(&case),
            "--impl",
            "chunk",
            "--out",
            s(&cand),
        ];
        args.extend_from_slice(how);
        run_ok(&args);
        let meta = Case::read(&cand).unwrap().meta;
        assert_eq!(meta.dtype.map(|d| d.name()), Some(dtype), "{how:?}");
        assert_eq!(meta.precision.as_deref(), precision, "{how:?}");
        let out = run_ok(&["diagnose", "--case", s(&case), "--candidate", s(&cand)]);
        assert!(out.contains(noise), "{how:?}: {out}");
    }
    run_ok(&["run", "--case", s(&case), "--out", s(&cand)]);
    assert_eq!(Case::read(&cand).unwrap().meta.dtype, Some(Dtype::F64));
}

/// A candidate is broken down over the ranks of the case's own `cp`
/// metadata.
#[test]
fn diagnose_honours_the_cases_cp_layout_for_a_candidate() {
    let dir = tempfile::tempdir().unwrap();
    let case = fixture("cp_kda_intermediates_world2.safetensors");
    let cand = dir.path().join("cand.safetensors");
    run_ok(&["run", "--case", s(&case), "--impl", "cp", "--out", s(&cand)]);
    let out = run_ok(&["diagnose", "--case", s(&case), "--candidate", s(&cand)]);
    let o = out.lines().find(|l| l.starts_with("o ")).unwrap();
    // Two per-rank errors at the end of the row.
    let ranks: Vec<&str> = o
        .split_whitespace()
        .rev()
        .take_while(|c| c.contains('e'))
        .collect();
    assert_eq!(
        ranks.len(),
        2,
        "two ranks after the first-token column: {out}"
    );
}

/// Every option of every subcommand has help text; `--precision` explains
/// each preset; `cp --help` and its refusal agree on `--impl`.
#[test]
fn every_option_has_help_and_cp_agrees_on_impl() {
    let subs = [
        "selfcheck",
        "gen",
        "run",
        "verify",
        "cp",
        "fixtures",
        "diagnose",
        "band",
        "tolerance",
        "bench",
        "fuzz",
    ];
    for sub in subs {
        let out = run_ok(&[sub, "--help"]);
        for line in out.lines().filter(|l| l.trim_start().starts_with('-')) {
            let text = line.trim();
            let (_, help) = text.split_once("  ").unwrap_or((text, ""));
            assert!(!help.trim().is_empty(), "{sub}: `{text}` has no help");
        }
    }
    let out = run_ok(&["verify", "--help"]);
    for p in [
        "`fla-bf16`:",
        "`akk-bf16`:",
        "`partial-merge-v`:",
        "PRESET+FAULT",
    ] {
        assert!(out.contains(p), "{p}: {out}");
    }
    let help = run_ok(&["cp", "--help"]);
    assert!(help.contains("`deltaref cp` always runs cp"), "{help}");
    let dir = tempfile::tempdir().unwrap();
    let case = gen_kda(dir.path(), "c.safetensors", &[]);
    let (rc, _, err) = code(&["cp", "--case", s(&case), "--impl", "chunk", "--world", "2"]);
    assert_eq!(rc, 2);
    assert!(
        err.contains("always runs --impl cp") && err.contains("naive, means cp"),
        "{err}"
    );
}

/// `--against non-cp`: a CP run against the same engine and precision
/// without CP (FLA's CP tests). The reference is named; in exact
/// arithmetic CP and non-CP agree to 1e-10; in f32 and fla-bf16 the CP path
/// adds rounding only (the comparison passes), and `cp` prints its per-rank
/// table in every precision; a fault still fails; without CP the option is
/// refused.
#[test]
fn against_non_cp_compares_cp_with_the_same_run_without_cp() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen_kda(dir.path(), "c.safetensors", &["--regime", "long-memory"]);
    let c = s(&case);
    for precision in ["exact", "f32", "fla-bf16"] {
        let flags = [
            "--case",
            c,
            "--impl",
            "cp",
            "--world",
            "2",
            "--precision",
            precision,
        ];
        let (rc, out, err) = code(&[&["verify"][..], &flags, &["--against", "non-cp"]].concat());
        assert_eq!(rc, 0, "{out}{err}");
        let want = format!("against impl:chunk(C=64) [precision {precision}, compute");
        assert!(out.contains(&want) && out.contains("without CP"), "{out}");
        let max_ratio = if precision == "exact" {
            "1e-10"
        } else {
            "5e-3"
        };
        let (rc, out, err) = code(&[
            "cp",
            "--case",
            c,
            "--world",
            "2",
            "--precision",
            precision,
            "--against",
            "non-cp",
            "--max-ratio",
            max_ratio,
        ]);
        assert_eq!(rc, 0, "{out}{err}");
        assert!(
            out.contains("per-rank table") && out.contains("without CP"),
            "{out}"
        );
    }
    let (rc, out, _) = code(&[
        "verify",
        "--case",
        c,
        "--impl",
        "cp",
        "--world",
        "2",
        "--precision",
        "drop-merged-state",
        "--against",
        "non-cp",
    ]);
    assert_eq!(rc, 1, "a fault is the CP path's error: {out}");
    let (rc, out, _) = code(&[
        "diagnose",
        "--case",
        c,
        "--impl",
        "cp",
        "--world",
        "2",
        "--precision",
        "f32",
        "--against",
        "non-cp",
        "--band",
        "1e-4",
    ]);
    assert_eq!(rc, 0, "{out}");
    let (rc, _, err) = code(&[
        "verify",
        "--case",
        c,
        "--impl",
        "chunk",
        "--against",
        "non-cp",
    ]);
    assert_eq!(rc, 2);
    assert!(err.contains("--against non-cp compares a CP run"), "{err}");
}
