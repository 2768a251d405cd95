//! Helpers shared by the cross-crate tests: finite differences and losses.

use deltaref::dplr::{self, DplrInputs, DplrOptions};
use deltaref::kda::{self, KdaInputs, KdaOptions};
use deltaref::op::{self, Engine, Operator};
use deltaref::token_shift::{self, TokenShiftInputs};
use deltaref_verify::fd::dot;
use deltaref_verify::metrics::norm_ratio;
use deltaref_verify::outputs::{self, Tensors};
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
    let out = op::forward(&kda::Naive, x, &opt).expect("valid inputs");
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
    let out = op::forward(&dplr::Naive, x, &opt).expect("valid inputs");
    dot(&out.o, d_o) + dot(out.final_state.as_ref().expect("asked for"), dht)
}

/// `Σ y·dy + Σ final_cache·dfinal_cache` for token-shift.
pub fn token_shift_loss(x: &TokenShiftInputs<f64>, dy: &ArrayD<f64>, dfc: &ArrayD<f64>) -> f64 {
    let out = op::forward(&token_shift::Shift, x, &()).expect("valid inputs");
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

/// Log-decays `g [1, T, H, K]` made too steep for one pair of middle-row
/// factors per chunk (`decay_blocks` in the reference): each drawn value
/// (all `≤ 0`) rescaled to a mean of −0.8 a token, then key dim `d`
/// multiplied by `60^(d/(K−1))` (dim 0 gentle, the last about −50 a token),
/// and token `spike` of every head given −800 in every dim, a jump no
/// block of two rows can hold in f64.
pub fn steep_decays(g: &mut ArrayD<f64>, spike: usize) {
    let mean = g.iter().sum::<f64>() / g.len() as f64;
    let kd = g.shape()[3];
    for mut lane in g.lanes_mut(ndarray::Axis(3)) {
        for (d, x) in lane.iter_mut().enumerate() {
            *x *= -0.8 / mean * 60f64.powf(d as f64 / (kd - 1).max(1) as f64);
        }
    }
    g.index_axis_mut(ndarray::Axis(1), spike).fill(-800.0);
}

/// The widest span of Γ (the in-chunk cumulative sum of `g [1, T, H, K]`,
/// chunks of `c` tokens from the first) over chunks, heads and key dims.
pub fn widest_span(g: &ArrayD<f64>, c: usize) -> f64 {
    let (t, h, kd) = (g.shape()[1], g.shape()[2], g.shape()[3]);
    let mut widest = 0.0f64;
    for hh in 0..h {
        for d in 0..kd {
            for start in (0..t).step_by(c) {
                let span: f64 = (start..(start + c).min(t)).map(|i| g[[0, i, hh, d]]).sum();
                widest = widest.max(-span);
            }
        }
    }
    widest
}

/// A run of one operator's engines on fixed inputs: `x`, `opts`, and the
/// upstream gradients `d_o`, `dht`.
pub struct Run<'a, O: Operator<f64>> {
    pub x: &'a O::Inputs,
    pub opts: &'a O::Options,
    pub d_o: &'a ArrayD<f64>,
    pub dht: &'a ArrayD<f64>,
}

/// Chunked engines `chunk(c)` (C = 16, 32, 64) on inputs whose log-decays
/// `g` ([`steep_decays`]) span more than one pair of middle-row factors
/// holds in f64 (checked for the widest chunk at each C; a full chunk of
/// the steepest dims spans about 50·C), so chunks split into blocks:
/// against `naive` in f64 to 1e-10 (every output and gradient), and in f32
/// to 1e-4 (a broken block is off by its whole value).
pub fn assert_split_chunks_agree<O, N, C>(
    naive: &N,
    chunk: impl Fn(usize) -> C,
    g: &ArrayD<f64>,
    run: Run<'_, O>,
) where
    O: Operator<f64> + Operator<f32>,
    N: Engine<f64, Op = O>,
    C: Engine<f64, Op = O> + Engine<f32, Op = O>,
{
    let bound = 2.0 * deltaref::scalar::exp_bound::<f64>();
    let sizes = [16, 32, 64];
    for c in sizes {
        let span = widest_span(g, c);
        assert!(span > bound, "C={c}: widest span {span} fits f64");
    }
    let Run { x, opts, d_o, dht } = run;
    let want = outputs::all::<f64, _>(naive, x, opts, d_o, Some(dht)).expect("valid");
    for c in sizes {
        let chunk = chunk(c);
        let got = outputs::all::<f64, _>(&chunk, x, opts, d_o, Some(dht)).expect("valid");
        assert_maps_close(&format!("C={c}"), &want, &got, 1e-10);
        let single = outputs::all::<f32, _>(&chunk, x, opts, d_o, Some(dht)).expect("valid");
        for (name, r) in &want {
            let v = ratio(r, &single[name]);
            println!("C={c} f32 {name:<14} {v:.3e}");
            assert!(v <= 1e-4, "C={c} f32 {name}: {v:e}");
        }
    }
}
