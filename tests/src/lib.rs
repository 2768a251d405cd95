//! Helpers shared by the cross-crate tests: finite differences and losses.

use deltaref::dplr::{self, DplrInputs, DplrOptions};
use deltaref::kda::{self, KdaInputs, KdaOptions};
use deltaref::token_shift::{self, TokenShiftInputs};
use deltaref_verify::fd::dot;
use deltaref_verify::metrics::norm_ratio;
use deltaref_verify::outputs::Tensors;
use ndarray::ArrayD;

/// Central-difference gradient of `f` at `x` (every element).
pub fn fd_grad(x: &ArrayD<f64>, h: f64, f: impl Fn(&ArrayD<f64>) -> f64) -> ArrayD<f64> {
    deltaref_verify::fd::grad(x, h, f)
}

/// norm_ratio between two tensors of the same shape.
pub fn ratio(reference: &ArrayD<f64>, x: &ArrayD<f64>) -> f64 {
    assert_eq!(reference.shape(), x.shape());
    norm_ratio(
        &reference.iter().copied().collect::<Vec<_>>(),
        &x.iter().copied().collect::<Vec<_>>(),
    )
}

/// `Σ o·do + Σ final_state·dht` for KDA (naive).
pub fn kda_loss(x: &KdaInputs<f64>, opt: &KdaOptions, d_o: &ArrayD<f64>, dht: &ArrayD<f64>) -> f64 {
    let opt = KdaOptions {
        output_final_state: true,
        ..*opt
    };
    let out = kda::naive::forward(x, &opt).expect("valid inputs");
    dot(&out.o, d_o) + dot(out.final_state.as_ref().expect("asked for"), dht)
}

/// `Σ o·do + Σ final_state·dht` for DPLR (naive).
pub fn dplr_loss(
    x: &DplrInputs<f64>,
    opt: &DplrOptions,
    d_o: &ArrayD<f64>,
    dht: &ArrayD<f64>,
) -> f64 {
    let opt = DplrOptions {
        output_final_state: true,
        ..*opt
    };
    let out = dplr::naive::forward(x, &opt).expect("valid inputs");
    dot(&out.o, d_o) + dot(out.final_state.as_ref().expect("asked for"), dht)
}

/// `Σ y·dy + Σ final_cache·dfinal_cache` for token-shift.
pub fn token_shift_loss(x: &TokenShiftInputs<f64>, dy: &ArrayD<f64>, dfc: &ArrayD<f64>) -> f64 {
    let out = token_shift::forward(x).expect("valid inputs");
    dot(&out.y, dy) + dot(&out.final_cache, dfc)
}

/// Checks one analytic gradient against central differences of `loss` with
/// respect to `x`; returns the norm_ratio (asserting ≤ `tol`).
pub fn check_grad(
    what: &str,
    analytic: Option<&ArrayD<f64>>,
    x: &ArrayD<f64>,
    tol: f64,
    loss: impl Fn(&ArrayD<f64>) -> f64,
) -> f64 {
    let analytic = analytic.unwrap_or_else(|| panic!("{what}: gradient missing"));
    let fd = fd_grad(x, 1e-5, loss);
    let r = ratio(&fd, analytic);
    assert!(
        r <= tol,
        "{what}: analytic vs finite differences norm_ratio {r:e} > {tol:e}"
    );
    r
}

/// Every tensor of `reference` agrees with `got`: ≤ `tol` norm_ratio, or
/// max_abs ≤ 1e-12 for a near-zero reference (where the ratio's 1e-8 floor
/// dominates, e.g. dgk under exp(−20) decay); and `got` is finite.
pub fn assert_maps_close(what: &str, reference: &Tensors, got: &Tensors, tol: f64) {
    assert_eq!(
        reference.keys().collect::<Vec<_>>(),
        got.keys().collect::<Vec<_>>()
    );
    for (name, r) in reference {
        let v = ratio(r, &got[name]);
        let m = r
            .iter()
            .zip(got[name].iter())
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            v <= tol || m <= 1e-12,
            "{what}: {name} norm_ratio {v:e} > {tol:e}, max_abs {m:e}"
        );
        assert!(
            got[name].iter().all(|x| x.is_finite()),
            "{what}: {name} not finite"
        );
    }
}
