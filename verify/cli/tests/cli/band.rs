//! Noise bands on the real binary (issue 52): `band` (text and JSON rows,
//! the same bits for a seed, the same band against stored truth or the f64
//! oracle), `verify --band` and `diagnose --noise-band` passing a correct
//! bf16 emulation and failing a planted CP fault, `tolerance` printing bars
//! and a Python dict, and every bad option refused with exit 2 naming it.

use std::path::{Path, PathBuf};

use super::common::{code, run_ok, s};

/// A small bf16 KDA case (two sequences, safe gate, in-kernel l2norm),
/// with the oracle's truth stored when `expected`.
fn gen(dir: &Path, name: &str, expected: bool) -> PathBuf {
    let case = dir.join(format!("{name}.safetensors"));
    let mut a = vec![
        "gen",
        "--op",
        "kda",
        "--shape",
        "1,64,1,1,16,16",
        "--lengths",
        "24,40",
        "--gate",
        "lowerbound",
        "--l2norm",
        "--dtype",
        "bf16",
        "--seed",
        "3",
        "--out",
    ];
    a.push(s(&case));
    if expected {
        a.push("--expected");
    }
    run_ok(&a);
    case
}

/// `case` computed by `impl` under `precision` (extra flags in `more`).
fn candidate(dir: &Path, case: &Path, name: &str, precision: &str, more: &[&str]) -> PathBuf {
    let out = dir.join(format!("{name}.safetensors"));
    let mut a = vec!["run", "-q", "--case", s(case), "--precision", precision];
    a.extend(more);
    a.extend(["--out", s(&out)]);
    run_ok(&a);
    out
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn band_rows_are_ordered_quantiles_and_repeat_for_a_seed() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen(dir.path(), "c", true);
    let args = [
        "band",
        "--case",
        s(&case),
        "--precision",
        "fla-bf16",
        "--samples",
        "4",
        "--json",
    ];
    let first = run_ok(&args);
    assert_eq!(run_ok(&args), first, "the same seed gives the same band");
    let v = json(&first);
    let rows = v["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["tensor"].as_str().unwrap()).collect();
    for t in ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta"] {
        assert!(names.contains(&t), "{t} missing: {names:?}");
    }
    for r in rows {
        let q = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k}: {r}"));
        // The ensemble's quantiles are ordered; the band is them widened
        // by the model margin on each side.
        assert!(
            0.0 < q("ensemble_p1")
                && q("ensemble_p1") <= q("median")
                && q("median") <= q("ensemble_p99")
                && q("ensemble_p99") <= q("max")
                && q("margin") > 1.0,
            "{r}"
        );
        assert!(
            (q("p1") * q("margin") / q("ensemble_p1") - 1.0).abs() < 1e-12
                && (q("p99") / (q("ensemble_p99") * q("margin")) - 1.0).abs() < 1e-12,
            "{r}"
        );
    }
    assert_eq!(v["spec"]["samples"], 4);
    // Without stored truth the band is taken against the f64 oracle, which
    // is what `gen --expected` stored: the same band.
    let bare = gen(dir.path(), "bare", false);
    let mut a = args.to_vec();
    a[2] = s(&bare);
    assert_eq!(json(&run_ok(&a))["rows"], v["rows"]);
    let text = run_ok(&args[..args.len() - 1]);
    assert!(
        text.contains("band of `fla-bf16`") && text.contains("p99"),
        "{text}"
    );
}

#[test]
fn verify_and_diagnose_pass_a_correct_emulation_and_fail_a_planted_fault() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen(dir.path(), "c", true);
    let good = candidate(dir.path(), &case, "good", "fla-bf16", &["--impl", "chunk"]);
    // Failure mode 5 under bf16 noise: the CP merge covers half of V.
    let cp = ["--impl", "cp", "--world", "2"];
    let bad = candidate(dir.path(), &case, "bad", "fla-bf16+partial-merge-v", &cp);
    let verify = |cand: &Path, extra: &[&str]| {
        let mut a = vec![
            "verify",
            "--case",
            s(&case),
            "--candidate",
            s(cand),
            "--band",
            "fla-bf16",
            "--samples",
            "6",
        ];
        a.extend(extra);
        code(&a)
    };
    let (rc, out, err) = verify(&good, &[]);
    assert_eq!(rc, 0, "{out}{err}");
    assert!(
        out.contains("within their band") && out.contains("judged by the band"),
        "{out}"
    );
    let (rc, out, err) = verify(&bad, &[]);
    assert_eq!(rc, 1, "{out}{err}");
    assert!(
        out.contains("OUT above") && out.contains("out of band: "),
        "{out}"
    );
    let (rc, out, _) = verify(&bad, &["--json"]);
    assert_eq!(rc, 1);
    let v = json(&out);
    assert_eq!(v["pass"], false);
    let verdicts = v["band"]["verdicts"].as_array().unwrap();
    let out_above: Vec<&str> = verdicts
        .iter()
        .filter(|x| x["position"] == "out-above")
        .map(|x| x["tensor"].as_str().unwrap())
        .collect();
    assert!(out_above.contains(&"o"), "{out}");
    for x in verdicts {
        assert_eq!(x["pass"], x["position"] != "out-above", "{x}");
    }

    let diagnose = |cand: &Path| {
        code(&[
            "diagnose",
            "--case",
            s(&case),
            "--candidate",
            s(cand),
            "--noise-band",
            "fla-bf16",
            "--samples",
            "6",
        ])
    };
    let (rc, out, err) = diagnose(&good);
    assert_eq!(rc, 0, "{out}{err}");
    assert!(
        out.contains("against the band of `fla-bf16`") && out.contains("within their band"),
        "{out}"
    );
    let (rc, out, err) = diagnose(&bad);
    assert_eq!(rc, 1, "{out}{err}");
    assert!(out.contains("OUT above"), "{out}");
}

#[test]
fn tolerance_prints_bars_and_a_python_dict() {
    let args = [
        "tolerance",
        "--op",
        "kda",
        "--shape",
        "1,32,1,1,16,16",
        "--gate",
        "lowerbound",
        "--l2norm",
        "--dtype",
        "bf16",
        "--precision",
        "fla-bf16",
        "--false-alarm",
        "1e-2",
        "--draws",
        "3",
        "--samples",
        "2",
    ];
    let text = run_ok(&args);
    assert!(
        text.contains("3 input draws × 2 emulation runs") && text.contains("only 3 input draws"),
        "{text}"
    );
    let dict = &text[text.find('{').expect("a dict")..];
    assert!(
        dict.trim_end().ends_with('}') && dict.contains("\"dq\": "),
        "{text}"
    );
    let mut a = args.to_vec();
    a.push("--json");
    let v = json(&run_ok(&a));
    let rows = v["rows"].as_array().unwrap();
    assert!(rows.len() >= 7, "{v}");
    for r in rows {
        let (bar, max_seen) = (r["bar"].as_f64().unwrap(), r["max_seen"].as_f64().unwrap());
        assert!(bar >= max_seen && max_seen > 0.0, "{r}");
        assert_eq!(
            (r["draws"].as_u64(), r["samples"].as_u64()),
            (Some(3), Some(2))
        );
    }
    assert_eq!(v["python"].as_str().unwrap(), dict.trim_end());
}

/// Runs `args`, asserting exit 2 and an error naming every one of `words`.
fn refused(args: &[&str], words: &[&str]) {
    let (rc, out, err) = code(args);
    assert_eq!(rc, 2, "{args:?}: {out}{err}");
    for w in words {
        assert!(err.contains(w), "{args:?}: `{w}` not in: {err}");
    }
}

#[test]
fn bad_band_options_are_refused_naming_the_option() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen(dir.path(), "c", true);
    let c = s(&case);
    let good = candidate(dir.path(), &case, "good", "fla-bf16", &["--impl", "chunk"]);
    let g = s(&good);
    refused(
        &["band", "--case", c, "--precision", "nope"],
        &["--precision", "`nope`", "fla-bf16"],
    );
    refused(&["band", "--case", c], &["--precision", "fla-bf16"]);
    refused(
        &["band", "--case", c, "--precision", "exact"],
        &["`exact`", "single point"],
    );
    for n in ["0", "1"] {
        refused(
            &[
                "band",
                "--case",
                c,
                "--precision",
                "fla-bf16",
                "--samples",
                n,
            ],
            &["--samples", "at least 2", &format!("got {n}")],
        );
    }
    refused(
        &[
            "band",
            "--case",
            c,
            "--precision",
            "fla-bf16",
            "--jitter",
            "0.5",
        ],
        &["--jitter", "0.5"],
    );
    refused(
        &[
            "band",
            "--case",
            c,
            "--precision",
            "fla-bf16",
            "--compute",
            "f32",
        ],
        &["--compute"],
    );
    refused(
        &[
            "band",
            "--case",
            c,
            "--precision",
            "fla-bf16+partial-merge-v",
        ],
        &["partial-merge-v", "--impl cp"],
    );
    let missing = dir.path().join("missing.safetensors");
    refused(
        &["band", "--case", s(&missing), "--precision", "fla-bf16"],
        &["missing.safetensors"],
    );
    refused(
        &["verify", "--case", c, "--candidate", g, "--band", "nope"],
        &["`nope`"],
    );
    refused(
        &[
            "verify",
            "--case",
            c,
            "--candidate",
            g,
            "--band",
            "fla-bf16",
            "--samples",
            "0",
        ],
        &["--samples", "got 0"],
    );
    refused(
        &[
            "diagnose",
            "--case",
            c,
            "--candidate",
            g,
            "--noise-band",
            "nope",
        ],
        &["`nope`"],
    );
    refused(
        &[
            "diagnose",
            "--case",
            c,
            "--candidate",
            g,
            "--noise-band",
            "fla-bf16",
            "--samples",
            "0",
        ],
        &["--samples", "got 0"],
    );
    let tol = [
        "tolerance",
        "--op",
        "kda",
        "--shape",
        "1,32,1,1,16,16",
        "--dtype",
        "bf16",
    ];
    let with = |extra: &[&'static str]| [&tol[..], extra].concat();
    refused(&with(&[]), &["--precision"]);
    refused(&with(&["--precision", "nope"]), &["`nope`"]);
    refused(
        &with(&["--precision", "fla-bf16", "--draws", "1"]),
        &["--draws", "at least 2", "got 1"],
    );
    for p in ["0", "1.5"] {
        refused(
            &with(&["--precision", "fla-bf16", "--false-alarm", p]),
            &["--false-alarm", p],
        );
    }
    refused(
        &with(&["--precision", "fla-bf16", "--samples", "0"]),
        &["--samples", "got 0"],
    );
}
