//! `deltaref verify` on candidates written the way a port writes them (only
//! outputs and gradients, any float dtype, metadata optional), non-finite
//! candidates, and the `gen`/`verify` flag combinations that must be refused.

use super::common::{code, s};

use std::collections::HashMap;
use std::path::Path;

use deltaref_verify::case::Case;
use safetensors::tensor::{Dtype as StDtype, TensorView};

/// Writes the outputs and gradients of the case at `from` the way a port
/// does (`safetensors.torch.save_file` of its results): `dtype`, nothing
/// else, and `case` metadata only when `meta` is given. `edit` changes
/// the values first.
fn port_candidate(
    from: &Path,
    to: &Path,
    st: StDtype,
    meta: Option<&str>,
    edit: impl Fn(&str, &mut ndarray::ArrayD<f64>),
) {
    let case = Case::read(from).expect("run --out wrote a case");
    let encoded: Vec<(String, Vec<u8>, Vec<usize>)> = case
        .results()
        .into_iter()
        .map(|(name, mut t)| {
            edit(&name, &mut t);
            let bytes = t
                .iter()
                .flat_map(|&v| match st {
                    StDtype::F64 => v.to_le_bytes().to_vec(),
                    StDtype::F32 => (v as f32).to_le_bytes().to_vec(),
                    StDtype::BF16 => deltaref::dtype::to_bf16(v).to_le_bytes().to_vec(),
                    StDtype::F16 => deltaref::dtype::to_f16(v).to_le_bytes().to_vec(),
                    other => panic!("ports write float tensors, not {other:?}"),
                })
                .collect();
            (name, bytes, t.shape().to_vec())
        })
        .collect();
    let views: Vec<(&str, TensorView)> = encoded
        .iter()
        .map(|(n, b, sh)| (n.as_str(), TensorView::new(st, sh.clone(), b).unwrap()))
        .collect();
    let meta = meta.map(|m| HashMap::from([("case".to_string(), m.to_string())]));
    safetensors::tensor::serialize_to_file(views, meta, to).unwrap();
}

/// A KDA case with stored truth, inputs stored in bf16 (as a bf16 port reads
/// them), and the oracle's results as a candidate case file.
fn case_and_results(dir: &Path, expected: bool) -> (std::path::PathBuf, std::path::PathBuf) {
    let case = dir.join("case.safetensors");
    let mut args = vec![
        "gen",
        "--op",
        "kda",
        "--lengths",
        "21,1,10",
        "--shape",
        "1,32,1,2,8,8",
        "--gate",
        "lowerbound",
        "--l2norm",
        "--initial-state",
        "--dtype",
        "bf16",
        "--out",
        s(&case),
    ];
    if expected {
        args.push("--expected");
    }
    let (rc, _, err) = code(&args);
    assert_eq!(rc, 0, "{err}");
    let results = dir.join("results.safetensors");
    let (rc, _, err) = code(&["run", "--case", s(&case), "--out", s(&results)]);
    assert_eq!(rc, 0, "{err}");
    (case, results)
}

/// A case file stores f64, f32, bf16 or f16; tf32 (a precision stage's
/// rounding) is refused by name.
#[test]
fn gen_refuses_a_dtype_no_case_file_stores() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c.safetensors");
    let (rc, _, err) = code(&["gen", "--op", "kda", "--dtype", "tf32", "--out", s(&out)]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("--dtype: dtype tf32 is not allowed here (allowed: f64, f32, bf16 or f16)"),
        "{err}"
    );
    let (rc, _, err) = code(&["gen", "--op", "kda", "--dtype", "f8", "--out", s(&out)]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("unknown dtype \"f8\""), "{err}");
}

#[test]
fn port_candidates_in_every_float_dtype_pass() {
    let dir = tempfile::tempdir().unwrap();
    for expected in [true, false] {
        let (case, results) = case_and_results(dir.path(), expected);
        for (dtype, meta) in [
            (StDtype::F64, None),
            (StDtype::F32, Some(r#"{"op": "kda"}"#)),
            (StDtype::BF16, None),
            (StDtype::F16, None),
        ] {
            let cand = dir.path().join("cand.safetensors");
            port_candidate(&results, &cand, dtype, meta, |_, _| {});
            let (rc, out, err) = code(&[
                "verify",
                "--case",
                s(&case),
                "--candidate",
                s(&cand),
                "--json",
            ]);
            assert_eq!(rc, 0, "{dtype:?} expected={expected}: {out}{err}");
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            let reference = if expected {
                "case file"
            } else {
                "impl:naive (f64 oracle)"
            };
            assert_eq!(v["reference"], reference);
            // o, final_state and eight gradients (dA_log, ddt_bias, dh0 included).
            assert_eq!(v["rows"].as_array().unwrap().len(), 10, "{v}");
        }
    }
}

#[test]
fn a_nan_in_the_candidate_fails_that_tensor_with_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let (case, results) = case_and_results(dir.path(), true);
    let cand = dir.path().join("nan.safetensors");
    port_candidate(&results, &cand, StDtype::F32, None, |name, t| {
        if name == "dk" {
            t[[0, 5, 0, 3]] = f64::NAN;
        }
    });
    let (rc, out, _) = code(&[
        "verify",
        "--case",
        s(&case),
        "--candidate",
        s(&cand),
        "--json",
    ]);
    assert_eq!(rc, 1, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("NaN must not break the JSON");
    let failing: Vec<&serde_json::Value> = v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["pass"] == false)
        .collect();
    assert_eq!(failing.len(), 1, "{v}");
    assert_eq!(failing[0]["tensor"], "dk");
    assert_eq!(failing[0]["argmax"], serde_json::json!([0, 5, 0, 3]));
    assert_eq!(failing[0]["problem"], "non-finite values in the candidate");
    let (rc, table, _) = code(&["verify", "--case", s(&case), "--candidate", s(&cand)]);
    assert_eq!(rc, 1);
    assert!(
        table.contains("FAIL (non-finite values in the candidate)"),
        "{table}"
    );
}

#[test]
fn refused_flag_combinations_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let (case, results) = case_and_results(dir.path(), true);
    let other = dir.path().join("dplr.safetensors");
    let out = dir.path().join("x.safetensors");
    let (rc, _, err) = code(&["gen", "--op", "dplr", "--out", s(&other)]);
    assert_eq!(rc, 0, "{err}");
    for (args, says) in [
        (
            vec![
                "verify",
                "--case",
                s(&case),
                "--candidate",
                s(&results),
                "--impl",
                "chunk",
            ],
            "drop them",
        ),
        (
            vec![
                "verify",
                "--case",
                s(&case),
                "--candidate",
                s(&results),
                "--compute",
                "f32",
            ],
            "drop them",
        ),
        (
            vec![
                "verify",
                "--case",
                s(&case),
                "--candidate",
                s(&results),
                "--layout",
                "zigzag",
            ],
            "drop them",
        ),
        (
            vec!["verify", "--case", s(&case), "--candidate", s(&other)],
            "candidate op `dplr` differs from the case's `kda`",
        ),
        (
            vec![
                "gen",
                "--op",
                "kda",
                "--lower-bound",
                "-3",
                "--out",
                s(&out),
            ],
            "--lower-bound needs --gate lowerbound",
        ),
        (
            vec!["gen", "--op", "kda", "--allow-neg-eigval", "--out", s(&out)],
            "allow_neg_eigval",
        ),
        (vec!["verify", "--case", s(&case), "--max-ratio"], "value"),
    ] {
        let (rc, _, err) = code(&args);
        assert_eq!(rc, 2, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    assert!(!out.exists());
}
