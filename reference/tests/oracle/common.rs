//! Helpers shared by the oracle's integration tests.
#![allow(dead_code)]

use ndarray::ArrayD;

/// FLA's `get_err_ratio` (SPEC §7).
pub fn norm_ratio(reference: &ArrayD<f64>, x: &ArrayD<f64>) -> f64 {
    assert_eq!(reference.shape(), x.shape(), "shapes differ");
    let n = reference.len().max(1) as f64;
    let err: f64 = reference
        .iter()
        .zip(x)
        .map(|(a, b)| (a - b) * (a - b))
        .sum();
    let base: f64 = reference.iter().map(|a| a * a).sum();
    let r = (err / n).sqrt() / ((base / n).sqrt() + 1e-8);
    assert!(r.is_finite(), "non-finite norm_ratio");
    r
}

/// Asserts `norm_ratio(reference, x) ≤ tol`, naming the tensor.
pub fn assert_close(what: &str, reference: &ArrayD<f64>, x: &ArrayD<f64>, tol: f64) {
    let r = norm_ratio(reference, x);
    assert!(r <= tol, "{what}: norm_ratio {r:e} > {tol:e}");
}

/// Same, for optional tensors that must be present or absent together.
pub fn assert_close_opt(what: &str, r: &Option<ArrayD<f64>>, x: &Option<ArrayD<f64>>, tol: f64) {
    match (r, x) {
        (Some(r), Some(x)) => assert_close(what, r, x, tol),
        (None, None) => {}
        _ => panic!("{what}: present in one result only"),
    }
}

/// Central finite differences of `loss` at `x` against `analytic`, norm_ratio ≤ 1e-6.
pub fn check_grad(
    what: &str,
    analytic: Option<&ArrayD<f64>>,
    x: &ArrayD<f64>,
    loss: impl Fn(&ArrayD<f64>) -> f64,
) {
    let analytic = analytic.unwrap_or_else(|| panic!("{what}: gradient missing"));
    let h = 1e-5;
    let mut fd = ArrayD::zeros(x.raw_dim());
    for (i, v) in x.iter().enumerate() {
        let mut p = x.clone();
        let mut m = x.clone();
        p.as_slice_mut().expect("standard layout")[i] = v + h;
        m.as_slice_mut().expect("standard layout")[i] = v - h;
        fd.as_slice_mut().expect("standard layout")[i] = (loss(&p) - loss(&m)) / (2.0 * h);
    }
    assert!(
        fd.iter().any(|v| v.abs() > 1e-8),
        "{what}: the loss does not depend on it"
    );
    assert_close(
        &format!("{what} (analytic vs finite differences)"),
        &fd,
        analytic,
        1e-6,
    );
}

/// `Σ a·b`.
pub fn dot(a: &ArrayD<f64>, b: &ArrayD<f64>) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `[N, H, a, b]` → `[N, H, b, a]`: the `state_v_first` layout swap (its own
/// inverse), written here from its definition rather than borrowed from the
/// oracle it checks.
pub fn swap_state(s: &ArrayD<f64>) -> ArrayD<f64> {
    s.view()
        .permuted_axes(vec![0, 1, 3, 2])
        .as_standard_layout()
        .into_owned()
}

/// A proptest config of `cases` cases whose saved failures are read from,
/// and written to, `<test file>.proptest-regressions` beside the test file.
/// proptest's default looks for the crate root above the file and, in this
/// binary (`oracle/main.rs`), would use `tests/proptest-regressions/`
/// instead, leaving the committed regression cases unread.
pub fn proptest_config(cases: u32) -> proptest::prelude::ProptestConfig {
    proptest::prelude::ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        ..Default::default()
    }
}
