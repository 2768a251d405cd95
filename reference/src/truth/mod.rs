//! The truth: each operator's definition, written as the plain recurrence of
//! SPEC §3–§5 in float64, readable line by line against the spec.
//!
//! **This is the definition.** The engines (`naive`, `chunk`, CP, intra-card
//! CP, the f32 runs, the precision emulation) are the fast machinery, and
//! they are tested against it (`truth/tests.rs`), never the other way round.
//! Nothing here calls an engine or the engines' pre-processing
//! ([`crate::gates`]): the l2norm, the in-kernel gates and the beta sigmoid
//! are written out again as formulas, so that a slip in the shared code
//! cannot hide in both.
//!
//! Each operator's truth is one `forward` function, generic over a real
//! scalar (`f64` outside the crate) and taking the operator's public inputs
//! and options: its [`Truth::forward`] (`<Kda as Truth>::forward(&x,
//! &opt)`), written in this module's file of the operator's name
//! (`truth/kda.rs`). Gradients are not derived by hand: the crate's tests
//! run the same `forward` on dual numbers (`truth/dual.rs`), which gives
//! `LANES` directional derivatives of FLA's loss `L = Σ out₀·do + Σ
//! out₁·dht` per pass (`jvp`), and passes over basis tangents give every
//! input element's `∂L/∂x` (`grads`).
//!
//! The forwards assume valid inputs (the shapes and options each operator's
//! `validate` accepts); they panic on shapes that do not fit.

// One file per operator, each its `forward`, reached as the operator's
// [`Truth::forward`] (`<Kda as Truth>::forward`).
mod conv;
mod dplr;
// Dual numbers: the gradients of the truth, for the crate's tests.
#[cfg(test)]
mod dual;
mod gdn;
mod gdn2;
mod kda;
mod real;
mod token_shift;
// Every engine against the truth, and the truth's gradients against finite
// differences.
#[cfg(test)]
mod tests;

use std::ops::Range;

use ndarray::{Array, ArrayD, ArrayView2, ArrayView3, ArrayView4, Ix4};

use crate::op::OpSpec;
#[cfg(test)]
use dual::{Dual, LANES};
use real::Real;

/// `1 / (1 + e^−x)`.
fn sigmoid<R: Real>(x: R) -> R {
    R::one() / (R::one() + (-x).exp())
}

/// `ln(1 + e^x)` (exact; overflows only for `x > 709`).
fn softplus<R: Real>(x: R) -> R {
    x.exp().ln_1p()
}

/// FLA's `l2norm` of the last axis of `[B, T, H, D]`: `x / sqrt(Σx² + 1e-6)`.
fn l2norm<R: Real>(x: ArrayView4<'_, R>) -> Array<R, Ix4> {
    let mut y = x.to_owned();
    for mut row in y.rows_mut() {
        let ss = row.iter().fold(R::zero(), |acc, &v| acc + v * v);
        let r = R::one() / (ss + R::cst(1e-6)).sqrt();
        row.mapv_inplace(|v| v * r);
    }
    y
}

/// A state tensor `[N, H, ·, ·]` to or from the `state_v_first` layout:
/// with `v_first` its last two axes swapped (an involution, so the same
/// call reads `[N, H, V, K]` in and writes it back out), else a copy.
fn state_layout<R: Clone>(mut s: ArrayView4<'_, R>, v_first: bool) -> Array<R, Ix4> {
    if v_first {
        s.swap_axes(2, 3);
    }
    s.to_owned()
}

/// A rank-2 tensor as such (panics otherwise).
fn view2<R>(a: &ArrayD<R>) -> ArrayView2<'_, R> {
    a.view().into_dimensionality().expect("a rank-2 tensor")
}

/// A rank-3 tensor as such (panics otherwise).
fn view3<R>(a: &ArrayD<R>) -> ArrayView3<'_, R> {
    a.view().into_dimensionality().expect("a rank-3 tensor")
}

/// A rank-4 tensor as such (panics otherwise).
fn view4<R>(a: &ArrayD<R>) -> ArrayView4<'_, R> {
    a.view().into_dimensionality().expect("a rank-4 tensor")
}

/// `Σ_{a < n} f(a)`, summed in index order.
fn sum<R: Real>(n: usize, f: impl Fn(usize) -> R) -> R {
    (0..n).fold(R::zero(), |acc, a| acc + f(a))
}

/// One sequence of a batch: row `n` of the states, tokens `tokens` of batch
/// row `batch`.
struct Sequence {
    n: usize,
    batch: usize,
    tokens: Range<usize>,
}

/// The sequences of a `[B, T, …]` batch (SPEC §2): one per batch row, or,
/// with `cu_seqlens` (B = 1), tokens `cu[n] .. cu[n+1]` (possibly none).
fn sequences(b: usize, t: usize, cu_seqlens: Option<&[i64]>) -> Vec<Sequence> {
    match cu_seqlens {
        None => (0..b)
            .map(|n| Sequence {
                n,
                batch: n,
                tokens: 0..t,
            })
            .collect(),
        Some(cu) => cu
            .windows(2)
            .enumerate()
            .map(|(n, w)| Sequence {
                n,
                batch: 0,
                tokens: w[0] as usize..w[1] as usize,
            })
            .collect(),
    }
}

/// An operator's truth, and what the differentiation needs to know of its
/// tensors. Implemented by the operators' marker types ([`crate::kda::Kda`],
/// …), so the tensor names are their [`OpSpec`] ones.
pub trait Truth: OpSpec {
    /// The public inputs in scalar `R` (e.g. `KdaInputs<R>`).
    type Inputs<R: Real>;
    /// The public outputs in scalar `R` (e.g. `KdaOutputs<R>`).
    type Outputs<R: Real>;

    /// The operator's definition (its module's `forward`).
    fn forward<R: Real>(x: &Self::Inputs<R>, opt: &Self::Options) -> Self::Outputs<R>;
    /// The floating-point inputs in [`OpSpec::INPUTS`] order (all but
    /// `cu_seqlens`), `None` where absent; input `i`'s gradient is
    /// [`OpSpec::GRADS`]`[i]`.
    fn tensors<R: Real>(x: &Self::Inputs<R>) -> Vec<Option<&ArrayD<R>>>;
    /// `x` with floating-point input `i` (as in [`Truth::tensors`]) replaced
    /// by `f(i, x_i)`; `cu_seqlens` kept.
    fn map_tensors<R: Real, S: Real>(
        x: &Self::Inputs<R>,
        f: impl FnMut(usize, &ArrayD<R>) -> ArrayD<S>,
    ) -> Self::Inputs<S>;
    /// The outputs in [`OpSpec::OUTPUTS`] order, `None` where not produced.
    fn outputs<R: Real>(y: &Self::Outputs<R>) -> Vec<Option<&ArrayD<R>>>;
}

/// FLA's loss `Σ out₀·do + Σ out₁·dht` of the truth at `x` (every output
/// asked for; `dht` zero when `None`). `do` is shaped like the first output
/// (`o`, `y`), `dht` like the second (the final state or cache).
#[cfg(test)]
pub(crate) fn loss<O: Truth, R: Real>(
    x: &O::Inputs<R>,
    opt: &O::Options,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
) -> R {
    let y = O::forward(x, &O::all_outputs(opt));
    let outs = O::outputs(&y);
    let dot = |a: &ArrayD<R>, b: &ArrayD<f64>| {
        assert_eq!(a.shape(), b.shape(), "{}: upstream gradient shape", O::NAME);
        a.iter()
            .zip(b)
            .fold(R::zero(), |acc, (&p, &w)| acc + p * R::cst(w))
    };
    let mut l = dot(outs[0].expect("the main output"), d_o);
    if let Some(dht) = dht {
        l = l + dot(outs[1].expect("every output asked for"), dht);
    }
    l
}

/// The loss at `x` on dual numbers whose lane `l` moves input `i`'s element
/// `j` (flat, standard order) by `seed(i, j)[l]`: `[∂L/∂x · seed_l]`.
#[cfg(test)]
fn loss_lanes<O: Truth>(
    x: &O::Inputs<f64>,
    opt: &O::Options,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    mut seed: impl FnMut(usize, usize) -> [f64; LANES],
) -> [f64; LANES] {
    let lifted = O::map_tensors(x, |i, t| {
        let duals = t.iter().enumerate().map(|(j, &v)| Dual::new(v, seed(i, j)));
        Array::from_shape_vec(t.raw_dim(), duals.collect()).expect("same size")
    });
    loss::<O, Dual>(&lifted, opt, d_o, dht).d
}

/// The directional derivatives `∂L/∂x · t` of the loss ([`loss`]) along each
/// tangent `t` of `tangents` (inputs shaped like `x`: a tangent for every
/// floating-point input `x` has; `cu_seqlens` is ignored). One forward pass
/// on [`Dual`] numbers per [`LANES`] tangents. Returns one number per tangent.
#[cfg(test)]
pub(crate) fn jvp<O: Truth>(
    x: &O::Inputs<f64>,
    opt: &O::Options,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    tangents: &[O::Inputs<f64>],
) -> Vec<f64> {
    let mut out = Vec::with_capacity(tangents.len());
    for group in tangents.chunks(LANES) {
        let dirs: Vec<Vec<Vec<f64>>> = group
            .iter()
            .map(|t| {
                let ts = O::tensors(t);
                ts.iter()
                    .map(|a| a.map_or(vec![], |a| a.iter().copied().collect()))
                    .collect()
            })
            .collect();
        let lanes = loss_lanes::<O>(x, opt, d_o, dht, |i, j| {
            let mut s = [0.0; LANES];
            for (l, d) in dirs.iter().enumerate() {
                s[l] = d[i][j];
            }
            s
        });
        out.extend_from_slice(&lanes[..group.len()]);
    }
    out
}

/// Every gradient of the loss ([`loss`]) under FLA's names
/// ([`OpSpec::GRADS`]), in that order, each shaped like its input; absent
/// inputs have no gradient. Forward-mode: one pass on [`Dual`] numbers per
/// [`LANES`] input elements, so `⌈(elements of all inputs) / LANES⌉` passes,
/// each about `LANES + 1` times an f64 forward: for small cases only.
#[cfg(test)]
pub(crate) fn grads<O: Truth>(
    x: &O::Inputs<f64>,
    opt: &O::Options,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
) -> Vec<(&'static str, ArrayD<f64>)> {
    let inputs = O::tensors(x);
    assert_eq!(inputs.len(), O::GRADS.len(), "{}: GRADS", O::NAME);
    // Number the elements of all inputs one after the other: input `i`'s
    // element `j` is `offsets[i] + j`; pass `p` moves elements `p·LANES ..`.
    let sizes: Vec<usize> = inputs.iter().map(|t| t.map_or(0, |t| t.len())).collect();
    let offsets: Vec<usize> = sizes
        .iter()
        .scan(0, |at, &n| {
            *at += n;
            Some(*at - n)
        })
        .collect();
    let total: usize = sizes.iter().sum();
    let mut flat = vec![0.0; total];
    for first in (0..total).step_by(LANES) {
        let lanes = loss_lanes::<O>(x, opt, d_o, dht, |i, j| {
            let mut s = [0.0; LANES];
            if let Some(l) = (offsets[i] + j).checked_sub(first).filter(|&l| l < LANES) {
                s[l] = 1.0;
            }
            s
        });
        let n = LANES.min(total - first);
        flat[first..first + n].copy_from_slice(&lanes[..n]);
    }
    inputs
        .iter()
        .zip(offsets)
        .zip(O::GRADS)
        .filter_map(|((t, at), &name)| {
            t.map(|t| {
                let g = flat[at..at + t.len()].to_vec();
                (
                    name,
                    Array::from_shape_vec(t.raw_dim(), g).expect("same size"),
                )
            })
        })
        .collect()
}

/// The outputs of the truth in f64 under FLA's names ([`OpSpec::OUTPUTS`]),
/// those `opt` asks for, in that order.
#[cfg(test)]
pub(crate) fn named_outputs<O: Truth>(
    x: &O::Inputs<f64>,
    opt: &O::Options,
) -> Vec<(&'static str, ArrayD<f64>)> {
    let y = O::forward(x, opt);
    O::OUTPUTS
        .iter()
        .zip(O::outputs(&y))
        .filter_map(|(&name, t)| t.map(|t| (name, t.clone())))
        .collect()
}
