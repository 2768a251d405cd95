//! Precision presets on the real binary: a preset naming a stage the chosen
//! engine does not implement is refused (exit 2, naming the stage and the
//! engine) instead of silently changing nothing; `fla-bf16` changes DPLR's
//! numbers; `diagnose --bisect` names a deliberately coarse stage first.

use std::path::{Path, PathBuf};

use super::common::{code, run_ok, s};

fn gen(dir: &Path, name: &str, args: &[&str]) -> PathBuf {
    let case = dir.join(format!("{name}.safetensors"));
    let mut a = vec!["gen", "--expected", "--seed", "5", "--out", s(&case)];
    a.extend(args);
    run_ok(&a);
    case
}

pub(crate) fn norm_ratios(json: &str) -> Vec<(String, f64)> {
    let v: serde_json::Value = serde_json::from_str(json).expect("JSON report");
    v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["tensor"].as_str().unwrap().to_string(),
                r["norm_ratio"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn presets_naming_a_stage_the_engine_lacks_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let kda = gen(
        dir.path(),
        "kda",
        &[
            "--op",
            "kda",
            "--lengths",
            "20,12",
            "--shape",
            "1,32,1,1,8,8",
        ],
    );
    let dplr = gen(
        dir.path(),
        "dplr",
        &[
            "--op",
            "dplr",
            "--lengths",
            "20,12",
            "--shape",
            "1,32,1,8,8",
        ],
    );
    let ts = gen(
        dir.path(),
        "ts",
        &["--op", "token_shift", "--shape", "1,16,4"],
    );
    // (case, impl and flags, preset, the stage named, the engine named)
    let refused: &[(&PathBuf, &[&str], &str, &str, &str)] = &[
        (
            &kda,
            &["--impl", "naive"],
            "fla-bf16",
            "`g_cumsum`",
            "naive",
        ),
        (&kda, &["--impl", "naive"], "akk-bf16", "`Akk`", "naive"),
        (
            &kda,
            &["--impl", "naive"],
            "coarse-v-new",
            "`g_cumsum`",
            "naive",
        ),
        (
            &kda,
            &["--impl", "chunk"],
            "fla-bf16-mchain-bf16",
            "`M`",
            "chunk(C=64)",
        ),
        (
            &kda,
            &["--impl", "cp", "--world", "2", "--cp-engine", "naive"],
            "tf32-solve",
            "`Akk`",
            "cp(world=2, naive)",
        ),
        (
            &dplr,
            &["--impl", "naive"],
            "fla-bf16",
            "`g_cumsum`",
            "naive",
        ),
        (
            &dplr,
            &["--impl", "chunk"],
            "fla-bf16-mchain-bf16",
            "`M`",
            "chunk(C=64)",
        ),
        (
            &ts,
            &["--impl", "chunk"],
            "akk-bf16",
            "`Akk`",
            "token_shift",
        ),
        (
            &ts,
            &["--impl", "naive"],
            "tf32-solve",
            "`Akk`",
            "token_shift",
        ),
        (
            &ts,
            &["--impl", "cp", "--world", "2"],
            "fla-bf16-mchain-bf16",
            "`M`",
            "token_shift",
        ),
    ];
    for (case, imp, preset, stage, engine) in refused {
        let mut args = vec!["verify", "--case", s(case), "--precision", preset];
        args.extend(*imp);
        let (rc, _, err) = code(&args);
        assert_eq!(rc, 2, "{args:?}: {err}");
        assert!(
            err.contains(stage) && err.contains(engine) && err.contains("does not implement"),
            "{args:?}: {err}"
        );
    }
    // What each engine does implement runs: fla-bf16 on token-shift rounds
    // its inputs and outputs; on the chunked engines every stage.
    for (case, imp) in [(&ts, "naive"), (&kda, "chunk"), (&dplr, "chunk")] {
        let (rc, _, err) = code(&[
            "verify",
            "--case",
            s(case),
            "--impl",
            imp,
            "--precision",
            "fla-bf16",
        ]);
        assert!(rc == 0 || rc == 1, "{imp}: {err}");
    }
}

#[test]
fn fla_bf16_changes_dplr_like_bf16_not_like_f32() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen(
        dir.path(),
        "dplr",
        &[
            "--op",
            "dplr",
            "--lengths",
            "70,58",
            "--shape",
            "1,128,2,16,16",
            "--dtype",
            "bf16",
        ],
    );
    let ratios = |p: &str| {
        let (_, out, err) = code(&[
            "verify",
            "--case",
            s(&case),
            "--impl",
            "chunk",
            "--precision",
            p,
            "--json",
        ]);
        assert!(!out.is_empty(), "{err}");
        norm_ratios(&out)
    };
    let (f32_, bf16) = (ratios("f32"), ratios("fla-bf16"));
    for ((n, a), (_, b)) in f32_.iter().zip(&bf16) {
        assert!(*a < 1e-5, "{n}: f32 {a:e}");
        assert!(
            *b > 1e-4 && *b > 100.0 * a,
            "{n}: fla-bf16 {b:e} vs f32 {a:e}"
        );
    }
}

#[test]
fn bisect_names_the_coarse_stage_first() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen(
        dir.path(),
        "kda",
        &[
            "--op",
            "kda",
            "--lengths",
            "40,24",
            "--shape",
            "1,64,2,2,16,16",
            "--gate",
            "kda",
            "--dtype",
            "bf16",
        ],
    );
    // coarse-v-new is fla-bf16 with v_new in e5m2 (2 mantissa bits), far
    // coarser than every other stage: bisection must name it first for
    // every tensor its value reaches (all but dv and dbeta: the backward
    // is linear in v, so v_new's value does not enter them).
    let (rc, text, err) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--impl",
        "chunk",
        "--chunk-size",
        "16",
        "--precision",
        "coarse-v-new",
        "--bisect",
    ]);
    assert_eq!(rc, 1, "a 2-bit v_new fails: {err}");
    assert!(
        text.contains("bisection of --precision coarse-v-new"),
        "{text}"
    );
    let (_, json, _) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--impl",
        "chunk",
        "--chunk-size",
        "16",
        "--precision",
        "coarse-v-new",
        "--bisect",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v["stages"].as_array().unwrap().len() >= 10, "{v}");
    let reached = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| !["dv", "dbeta"].contains(&t["tensor"].as_str().unwrap()));
    for t in reached {
        let first = &t["stages"][0];
        assert_eq!(first["stage"], "v_new", "{t}");
        assert!(first["share"].as_f64().unwrap() > 0.9, "{t}");
        // Made exact, v_new's error goes away: the rest is bf16 noise.
        assert!(
            first["without"].as_f64().unwrap() < 0.3 * t["full"].as_f64().unwrap(),
            "{t}"
        );
    }
    let conclusions: Vec<&str> = v["conclusions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    for t in ["o", "final_state", "dq", "dk", "dg", "dA_log", "ddt_bias"] {
        let line = conclusions
            .iter()
            .find(|c| c.starts_with(&format!("{t}: ")));
        assert!(
            line.is_some_and(|c| c.contains("% from v_new ")),
            "{t}: {conclusions:?}"
        );
    }
    let (rc, _, err) = code(&["diagnose", "--case", s(&case), "--bisect"]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("give --precision"), "{err}");
    let (rc, _, err) = code(&[
        "diagnose",
        "--case",
        s(&case),
        "--precision",
        "f32",
        "--bisect",
    ]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("rounds no stage"), "{err}");
}
