//! GDN and causal conv1d through the command line: gen, run, verify (chunk,
//! CP, a candidate at 1e-10), and the inputs and flags that must be refused.

use super::common::{code, run_ok, s};
use deltaref_verify::case::{CaseMeta, Op};

const GDN: &[&str] = &[
    "gen",
    "--op",
    "gdn",
    "--lengths",
    "23,0,1,40",
    "--shape",
    "1,64,1,2,8,8",
    "--gate",
    "kda",
    "--l2norm",
    "--state-v-first",
    "--initial-state",
    "--seed",
    "3",
];
const CONV: &[&str] = &[
    "gen",
    "--op",
    "causal_conv1d",
    "--lengths",
    "9,1,0,22",
    "--shape",
    "1,32,6,4",
    "--activation",
    "silu",
    "--bias",
    "--initial-state",
    "--seed",
    "4",
];

#[test]
fn gen_run_and_verify_agree_to_1e_10() {
    let dir = tempfile::tempdir().unwrap();
    for (name, gen) in [("gdn", GDN), ("conv", CONV)] {
        let case = dir.path().join(format!("{name}.safetensors"));
        let cand = dir.path().join(format!("{name}.chunk.safetensors"));
        run_ok(&[gen, &["--out", s(&case)]].concat());
        run_ok(&[
            "run",
            "--case",
            s(&case),
            "--impl",
            "chunk",
            "--chunk-size",
            "16",
            "--out",
            s(&cand),
        ]);
        for extra in [
            vec!["--candidate", s(&cand)],
            vec!["--impl", "cp", "--cuts", "2,9,10,30"],
            vec!["--impl", "cp", "--world", "4", "--cp-engine", "naive"],
        ] {
            let args = [
                &["verify", "--case", s(&case), "--max-ratio", "1e-10"][..],
                &extra,
            ]
            .concat();
            let out = run_ok(&args);
            assert!(out.contains("tensors pass"), "{args:?}: {out}");
        }
    }
}

#[test]
fn refused_flags_and_impls_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let case = dir.path().join("gdn.safetensors");
    run_ok(&[GDN, &["--out", s(&case)]].concat());
    let out = dir.path().join("x.safetensors");
    for (args, says) in [
        (
            vec!["gen", "--op", "gdn", "--gate", "lowerbound"],
            "--gate kda",
        ),
        (
            vec!["gen", "--op", "kda", "--state-v-first"],
            "--state-v-first does not apply to --op kda (it applies to --op gdn, gdn2)",
        ),
        (
            vec!["gen", "--op", "causal_conv1d", "--activation", "gelu"],
            "unknown activation `gelu`",
        ),
        (
            vec!["gen", "--op", "kda", "--bias"],
            "--bias does not apply to --op kda",
        ),
        (
            vec!["gen", "--op", "causal_conv1d", "--shape", "1,8,4,0"],
            "≥ 1",
        ),
        (
            vec!["gen", "--op", "causal_conv1d", "--l2norm"],
            "--l2norm does not apply to --op causal_conv1d (it applies to --op kda, gdn, gdn2)",
        ),
        (
            vec!["gen", "--op", "causal_conv1d", "--regime", "sharp"],
            "fla-test",
        ),
        (vec!["gen", "--op", "gdn3"], "unknown op `gdn3`"),
    ] {
        let args = [&args[..], &["--out", s(&out)]].concat();
        let (rc, _, err) = code(&args);
        assert_eq!(rc, 2, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    assert!(!out.exists());
    // GDN runs on KDA's GPU kernels; causal conv1d has none.
    let conv = dir.path().join("conv.safetensors");
    run_ok(&[CONV, &["--out", s(&conv)]].concat());
    for imp in [
        &["gpu-naive"][..],
        &["gpu-chunk"],
        &["gpu-cp", "--world", "2"],
    ] {
        let args = [&["verify", "--case", s(&conv), "--impl"][..], imp].concat();
        let (rc, _, err) = code(&args);
        assert_eq!(rc, 2, "{imp:?}: {err}");
        assert!(
            err.contains("no GPU kernels for op causal_conv1d"),
            "{imp:?}: {err}"
        );
    }
}

#[test]
fn case_metadata_keys_belong_to_their_op() {
    let ok = CaseMeta::from_json(
        r#"{"op": "gdn", "use_gate_in_kernel": true, "state_v_first": true, "use_qk_l2norm_in_kernel": false}"#,
    )
    .unwrap();
    assert_eq!(ok.op, Op::Gdn);
    assert!(ok.flag("use_gate_in_kernel") && ok.flag("state_v_first"));
    let conv = CaseMeta::from_json(r#"{"op": "causal_conv1d", "activation": "swish"}"#).unwrap();
    assert_eq!(conv.options["activation"], "swish");
    // The JSON a case writes reads back to the same metadata.
    assert_eq!(CaseMeta::from_json(&ok.to_json().to_string()).unwrap(), ok);
    assert_eq!(
        CaseMeta::from_json(&conv.to_json().to_string()).unwrap(),
        conv
    );
    for (json, says) in [
        (
            r#"{"op": "kda", "state_v_first": true}"#,
            "only applies to op gdn",
        ),
        (
            r#"{"op": "gdn", "activation": "silu"}"#,
            "only applies to op causal_conv1d",
        ),
        (
            r#"{"op": "causal_conv1d", "activation": "relu"}"#,
            "unknown activation `relu`",
        ),
        (
            r#"{"op": "causal_conv1d", "use_gate_in_kernel": true}"#,
            "only applies to op gdn",
        ),
        (r#"{"op": "gdn", "gate": "kda"}"#, "only applies to op kda"),
    ] {
        let e = CaseMeta::from_json(json).expect_err(json);
        assert!(e.contains(says), "{json}: {e}");
    }
}
