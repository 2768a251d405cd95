//! `Impl::compute_forward` (outputs without the backward pass) gives the
//! same bits as `Impl::compute`'s outputs, for every engine, CP, precision
//! policy and compute scalar, and needs no upstream gradients.

use std::path::PathBuf;

use deltaref_verify::case::Case;
use deltaref_verify::impls::{Compute, ImplName, ImplRequest};

fn fixtures() -> Vec<Case> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("fixtures");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("fixtures/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| Case::read(p).expect("valid"))
        .collect()
}

fn requests(case: &Case) -> Vec<ImplRequest> {
    let mut r: Vec<ImplRequest> = [ImplName::Naive, ImplName::Chunk]
        .into_iter()
        .map(|name| ImplRequest {
            name,
            ..ImplRequest::default()
        })
        .collect();
    r.push(ImplRequest {
        name: ImplName::Chunk,
        precision: Some("fla-bf16".into()),
        ..ImplRequest::default()
    });
    if case.meta.cp.is_some() {
        r.push(ImplRequest {
            name: ImplName::Cp,
            ..ImplRequest::default()
        });
    }
    r
}

#[test]
fn forward_only_outputs_are_the_full_runs_outputs() {
    let cases = fixtures();
    assert!(cases.len() >= 10);
    for case in &cases {
        for req in requests(case) {
            let (imp, _) = req.resolve_with_compute(case).expect("resolves");
            for compute in [Compute::F64, Compute::F32] {
                let full = imp.compute(case, compute).expect("computes");
                let fwd = imp.compute_forward(case, compute).expect("forward");
                assert_eq!(fwd.len(), 2, "{}", imp.name());
                for (name, x) in &fwd {
                    let bits = |a: &ndarray::ArrayD<f64>| {
                        a.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    assert_eq!(
                        bits(x),
                        bits(&full[name]),
                        "{} {name} {compute:?}",
                        imp.name()
                    );
                }
            }
        }
    }
}

#[test]
fn forward_only_needs_no_upstream_gradients() {
    for case in fixtures() {
        let mut bare = case.clone();
        let op = bare.meta.op;
        bare.tensors
            .retain(|n, _| op.inputs().contains(&n.as_str()));
        let req = ImplRequest {
            name: ImplName::Chunk,
            ..ImplRequest::default()
        };
        let imp = req.resolve(&bare).expect("resolves");
        let fwd = imp.compute_forward(&bare, Compute::F64).expect("forward");
        let main = op.forward_results()[0];
        assert_eq!(fwd[main], imp.compute(&case, Compute::F64).unwrap()[main]);
        assert!(
            imp.compute(&bare, Compute::F64).is_err(),
            "the full run needs `do`"
        );
    }
}
