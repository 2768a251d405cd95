//! KDA's truth (SPEC §3): per sequence and value head `j` (q/k head
//! `j / (HV/H)`), from `S_0 = initial_state` (or 0),
//! ```text
//! S ← Diag(exp g_t) S
//! S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ
//! o_t = Sᵀ (scale · q_t)
//! ```
//! after FLA's in-kernel pre-processing (l2norm, gate, beta sigmoid). A
//! scalar gate `g [B, T, HV]` is broadcast over K. GDN's truth
//! ([`super::gdn`]) is this recurrence after its own gate.

use ndarray::{s, Array2, Array3, Array4, ArrayD, ArrayView4};

use super::{l2norm, sequences, sigmoid, softplus, sum, view3, view4, Real, Sequence, Truth};
use crate::gates::Gate;
use crate::kda::{Kda, KdaInputs, KdaOptions, KdaOutputs};

/// KDA forward. `x`: `q, k [B, T, H, K]`, `v [B, T, HV, V]`, `g [B, T, HV, K]`
/// (or `[B, T, HV]`), `beta [B, T, HV]`, `A_log [HV]`, `dt_bias [HV·K]`,
/// `initial_state [N, HV, K, V]`, `cu_seqlens [N + 1]`. Returns
/// `o [B, T, HV, V]` and, with `output_final_state`, `final_state [N, HV, K, V]`.
pub fn forward<R: Real>(x: &KdaInputs<R>, opt: &KdaOptions) -> KdaOutputs<R> {
    let rule = DeltaRule::new(x, decay(x, opt.gate), opt);
    let (o, final_state) = rule.run(x.initial_state.as_ref().map(view4), x.cu_seqlens.as_deref());
    KdaOutputs {
        o: o.into_dyn(),
        final_state: opt.output_final_state.then(|| final_state.into_dyn()),
    }
}

/// The log-space decay `[B, T, HV, K]`: `g` itself, or the in-kernel gate of
/// `x = g + dt_bias[j·K + d]` (SPEC §3 "Options").
fn decay<R: Real>(x: &KdaInputs<R>, gate: Gate) -> Array4<R> {
    let (b, t, hv, _) = view4(&x.v).dim();
    let kd = x.q.shape()[3];
    let raw = |(bi, ti, j, d): (usize, usize, usize, usize)| match x.g.ndim() {
        3 => x.g[[bi, ti, j]],
        _ => x.g[[bi, ti, j, d]],
    };
    let bias = |j: usize, d: usize| x.dt_bias.as_ref().map_or(R::zero(), |db| db[[j * kd + d]]);
    let rate = |j: usize| x.a_log.as_ref().map(|a| a[[j]].exp());
    Array4::from_shape_fn((b, t, hv, kd), |i @ (_, _, j, d)| {
        let z = raw(i) + bias(j, d);
        match gate {
            Gate::None => raw(i),
            Gate::Kda => -rate(j).expect("the kda gate needs A_log") * softplus(z),
            Gate::LowerBound { lower_bound } => {
                R::cst(lower_bound) * sigmoid(rate(j).map_or(z, |a| a * z))
            }
        }
    })
}

/// The pre-processed per-token tensors of the delta rule.
pub(super) struct DeltaRule<'a, R> {
    /// `[B, T, H, K]`, not yet scaled.
    q: Array4<R>,
    /// `[B, T, H, K]`
    k: Array4<R>,
    /// `[B, T, HV, V]`
    v: ArrayView4<'a, R>,
    /// `[B, T, HV, K]` log-space decay.
    g: Array4<R>,
    /// `[B, T, HV]`
    beta: Array3<R>,
    scale: R,
}

impl<'a, R: Real> DeltaRule<'a, R> {
    /// `x`'s q, k (l2-normalised if asked), v and β (`sigmoid(beta)`, or
    /// `2·sigmoid(beta)` with `allow_neg_eigval`, if asked) with the decay
    /// `g [B, T, HV, K]`; `opt.gate` is not read (`g` is the decay already).
    pub(super) fn new(x: &'a KdaInputs<R>, g: Array4<R>, opt: &KdaOptions) -> Self {
        let (q, k) = (view4(&x.q), view4(&x.k));
        let (q, k) = if opt.use_qk_l2norm_in_kernel {
            (l2norm(q), l2norm(k))
        } else {
            (q.to_owned(), k.to_owned())
        };
        let beta =
            view3(&x.beta).mapv(
                |b| match (opt.use_beta_sigmoid_in_kernel, opt.allow_neg_eigval) {
                    (false, _) => b,
                    (true, false) => sigmoid(b),
                    (true, true) => R::cst(2.0) * sigmoid(b),
                },
            );
        let kd = q.dim().3;
        DeltaRule {
            scale: R::cst(opt.scale.unwrap_or(1.0 / (kd as f64).sqrt())),
            q,
            k,
            v: view4(&x.v),
            g,
            beta,
        }
    }

    /// `(o [B, T, HV, V], final_state [N, HV, K, V])` from
    /// `initial_state [N, HV, K, V]` (zeros when `None`).
    pub(super) fn run(
        &self,
        initial_state: Option<ArrayView4<R>>,
        cu_seqlens: Option<&[i64]>,
    ) -> (Array4<R>, Array4<R>) {
        let (b, t, h, kd) = self.q.dim();
        let (_, _, hv, vd) = self.v.dim();
        let seqs = sequences(b, t, cu_seqlens);
        let mut o = Array4::zeros((b, t, hv, vd));
        let mut fin = Array4::zeros((seqs.len(), hv, kd, vd));
        for seq in &seqs {
            for j in 0..hv {
                let s0 = initial_state.map_or(Array2::zeros((kd, vd)), |s| {
                    s.slice(s![seq.n, j, .., ..]).to_owned()
                });
                let s = self.head(seq, j, j / (hv / h), s0, &mut o);
                fin.slice_mut(s![seq.n, j, .., ..]).assign(&s);
            }
        }
        (o, fin)
    }

    /// Value head `j` (q/k head `i`) of one sequence from state `s [K, V]`:
    /// writes its `o` rows, returns its final state.
    fn head(
        &self,
        seq: &Sequence,
        j: usize,
        i: usize,
        mut s: Array2<R>,
        o: &mut Array4<R>,
    ) -> Array2<R> {
        let (kd, vd) = s.dim();
        let b = seq.batch;
        for t in seq.tokens.clone() {
            let (q, k) = (self.q.slice(s![b, t, i, ..]), self.k.slice(s![b, t, i, ..]));
            let (v, g, beta) = (
                self.v.slice(s![b, t, j, ..]),
                self.g.slice(s![b, t, j, ..]),
                self.beta[[b, t, j]],
            );
            // S ← Diag(exp g_t) S
            for a in 0..kd {
                for c in 0..vd {
                    s[[a, c]] = g[a].exp() * s[[a, c]];
                }
            }
            // S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ
            for c in 0..vd {
                let error = v[c] - sum(kd, |a| s[[a, c]] * k[a]);
                for a in 0..kd {
                    s[[a, c]] = s[[a, c]] + beta * k[a] * error;
                }
            }
            // o_t = Sᵀ (scale · q_t)
            for c in 0..vd {
                o[[b, t, j, c]] = sum(kd, |a| s[[a, c]] * (self.scale * q[a]));
            }
        }
        s
    }
}

impl Truth for Kda {
    type Inputs<R: Real> = KdaInputs<R>;
    type Outputs<R: Real> = KdaOutputs<R>;

    fn forward<R: Real>(x: &KdaInputs<R>, opt: &KdaOptions) -> KdaOutputs<R> {
        forward(x, opt)
    }

    fn tensors<R: Real>(x: &KdaInputs<R>) -> Vec<Option<&ArrayD<R>>> {
        inputs_of(x)
    }

    fn map_tensors<R: Real, S: Real>(
        x: &KdaInputs<R>,
        f: impl FnMut(usize, &ArrayD<R>) -> ArrayD<S>,
    ) -> KdaInputs<S> {
        map_inputs(x, f)
    }

    fn outputs<R: Real>(y: &KdaOutputs<R>) -> Vec<Option<&ArrayD<R>>> {
        vec![Some(&y.o), y.final_state.as_ref()]
    }
}

/// KDA's (and GDN's) floating-point inputs in `INPUTS` order.
pub(super) fn inputs_of<R>(x: &KdaInputs<R>) -> Vec<Option<&ArrayD<R>>> {
    vec![
        Some(&x.q),
        Some(&x.k),
        Some(&x.v),
        Some(&x.g),
        Some(&x.beta),
        x.a_log.as_ref(),
        x.dt_bias.as_ref(),
        x.initial_state.as_ref(),
    ]
}

/// `x` with each floating-point input `i` ([`inputs_of`] order) mapped by `f`.
pub(super) fn map_inputs<R, S>(
    x: &KdaInputs<R>,
    mut f: impl FnMut(usize, &ArrayD<R>) -> ArrayD<S>,
) -> KdaInputs<S> {
    KdaInputs {
        q: f(0, &x.q),
        k: f(1, &x.k),
        v: f(2, &x.v),
        g: f(3, &x.g),
        beta: f(4, &x.beta),
        a_log: x.a_log.as_ref().map(|a| f(5, a)),
        dt_bias: x.dt_bias.as_ref().map(|a| f(6, a)),
        initial_state: x.initial_state.as_ref().map(|a| f(7, a)),
        cu_seqlens: x.cu_seqlens.clone(),
    }
}
