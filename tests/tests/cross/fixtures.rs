//! The committed fixture set: regeneration reproduces it byte for byte, a
//! flipped byte is caught and named, and every fixture's stored truth agrees
//! with the naive, chunked and (for CP cases) CP implementations to ≤ 1e-10.

use std::path::PathBuf;

use deltaref_verify::case::{Case, Op};
use deltaref_verify::fixtures::{check, Manifest};
use deltaref_verify::impls::{Compute, EngineName, Impl, ImplName, ImplRequest};
use deltaref_verify::report::VerifyReport;

fn committed() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("fixtures")
}

fn manifest() -> Manifest {
    serde_json::from_str(
        &std::fs::read_to_string(committed().join("manifest.json")).expect("manifest"),
    )
    .expect("parses")
}

#[test]
fn committed_set_regenerates_byte_for_byte() {
    let problems = check(&committed()).expect("regenerates");
    assert!(problems.is_empty(), "{problems:#?}");
    assert!(manifest().fixtures.len() >= 15);
}

#[test]
fn a_flipped_byte_is_named() {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(committed()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let victim = dir.path().join("kda_gva.safetensors");
    let mut bytes = std::fs::read(&victim).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&victim, bytes).unwrap();
    let problems = check(dir.path()).unwrap();
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(
        problems[0].starts_with("kda_gva.safetensors: bytes differ"),
        "{problems:#?}"
    );
    std::fs::remove_file(dir.path().join("dplr_rwkv7.safetensors")).unwrap();
    let problems = check(dir.path()).unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p == "dplr_rwkv7.safetensors: missing"),
        "{problems:#?}"
    );
}

#[test]
fn every_fixture_verifies_against_every_implementation() {
    for e in manifest().fixtures {
        let case = Case::read(&committed().join(&e.file)).expect("reads");
        let expected = case.results();
        assert!(!expected.is_empty(), "{}: no stored truth", e.file);
        let mut impls = vec![Impl::NAIVE];
        if case.meta.op == Op::Kda {
            impls.push(Impl::chunk(case.meta.chunk_size.unwrap_or(64)).unwrap());
        }
        if case.meta.cp.is_some() {
            let cp_engine = if case.meta.op == Op::Kda {
                EngineName::Chunk
            } else {
                EngineName::Naive
            };
            let req = ImplRequest {
                name: ImplName::Cp,
                cp_engine: Some(cp_engine),
                ..ImplRequest::default()
            };
            impls.push(req.resolve(&case).unwrap());
        }
        for imp in impls {
            let got = imp.compute(&case, Compute::F64).expect("computes");
            let report =
                VerifyReport::new(&e.file, "case file", &imp.name(), &expected, &got, 1e-10);
            let worst = report
                .rows
                .iter()
                .filter_map(|r| r.norm_ratio)
                .fold(0.0, f64::max);
            assert!(
                report.pass && worst <= 1e-10,
                "{}: {} worst {worst:e}\n{report}",
                e.file,
                imp.name()
            );
        }
    }
}

/// The named regression cases of the public bugs deltaref's conformance
/// run is for, each saying in the manifest which bug it is.
#[test]
fn named_regressions_say_which_bug_they_are_for() {
    let bugs: Vec<String> = manifest()
        .fixtures
        .into_iter()
        .filter_map(|e| e.bug)
        .collect();
    for bug in [
        "fla#1107",
        "fla#1093",
        "fla#1134",
        "fla#862",
        "cudnn-frontend#1051",
        "vmlx-swift#433",
        "transformers#48455",
        "fla#1085",
    ] {
        assert!(
            bugs.iter().any(|b| b.starts_with(&format!("{bug}:"))),
            "no fixture for {bug} in fixtures/manifest.json: {bugs:?}"
        );
    }
}
