//! Every CP fault preset fails at least one committed CP fixture at 5e-3
//! (FLA's bf16 KCP noise bar), so a port that reproduces one of FLA's CP
//! bugs cannot pass the whole committed set. The faults of SPEC §9 4–6 run
//! in f64; the bf16 M chain (§9 1) must fail a fixture on which `fla-bf16`
//! itself passes, so the failure is the chain's and not bf16 noise.

use std::path::PathBuf;

use deltaref_verify::case::Case;
use deltaref_verify::impls::{Compute, ImplRequest};
use deltaref_verify::report::VerifyReport;

const BAR: f64 = 5e-3;

fn cp_fixtures() -> Vec<(String, Case)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("fixtures");
    let mut out: Vec<(String, Case)> = std::fs::read_dir(&dir)
        .expect("fixtures dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| {
            let c = Case::read(&p).expect("fixture reads");
            (p.file_name().unwrap().to_string_lossy().into_owned(), c)
        })
        .filter(|(_, c)| c.meta.cp.is_some())
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Whether the CP run under `preset` passes the fixture's stored truth.
fn passes(case: &Case, preset: &str) -> Option<bool> {
    let req = ImplRequest {
        name: "cp".into(),
        precision: Some(preset.into()),
        ..ImplRequest::default()
    };
    let (imp, compute) = req.resolve_with_compute(case).ok()?;
    let got = imp
        .compute(case, compute.unwrap_or(Compute::F64))
        .expect("computes");
    Some(VerifyReport::new("", "", "", &case.results(), &got, BAR).pass)
}

#[test]
fn every_cp_fault_fails_a_committed_fixture() {
    let fixtures = cp_fixtures();
    assert!(fixtures.len() >= 3);
    for fault in ["drop-merged-state", "partial-merge-v", "wrong-preprocess"] {
        let caught: Vec<&str> = fixtures
            .iter()
            .filter(|(_, c)| passes(c, fault) == Some(false))
            .map(|(n, _)| n.as_str())
            .collect();
        assert!(
            !caught.is_empty(),
            "{fault} passes every committed CP fixture"
        );
    }
}

#[test]
fn the_bf16_m_chain_fails_a_fixture_that_fla_bf16_passes() {
    let caught: Vec<String> = cp_fixtures()
        .into_iter()
        .filter(|(_, c)| {
            passes(c, "fla-bf16") == Some(true) && passes(c, "fla-bf16-mchain-bf16") == Some(false)
        })
        .map(|(n, _)| n)
        .collect();
    assert!(
        !caught.is_empty(),
        "no committed CP fixture separates the bf16 M chain from fla-bf16"
    );
}
