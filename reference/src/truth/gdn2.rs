//! GDN-2's truth (FLA's `naive_recurrent_gdn2`): per sequence and head,
//! from `S_0 = initial_state` (or 0),
//! ```text
//! S ← Diag(exp g_t) S
//! S ← S + k_t (w_t ⊙ v_t − Sᵀ (b_t ⊙ k_t))ᵀ
//! o_t = Sᵀ (scale · q_t)
//! ```
//! after FLA's in-kernel pre-processing (l2norm of q and k, the gate). The
//! state is read at the gated key `b ⊙ k` and written at the plain key `k`;
//! `b = w = β` is KDA's recurrence ([`super::kda`]).
//!
//! The in-kernel gate of `z = g + dt_bias[j·K + d]` is picked by
//! `lower_bound`, as FLA's `chunk_gdn2` picks it: `lower_bound ·
//! sigmoid(exp(A_log[j]) · z)` (`sigmoid(z)` without `A_log`), else
//! `−exp(A_log[j]) · softplus(z)`. Softplus here is `ln(1 + eᶻ)`; FLA's
//! returns `z` itself above 20, which differs by `ln(1 + e⁻ᶻ) < 2.1e-9`
//! there, a relative 1e-10 of the decay.

use ndarray::{s, Array2, Array4, ArrayD, ArrayView4};

use super::{
    l2norm, sequences, sigmoid, softplus, state_layout, sum, view4, Real, Sequence, Truth,
};
use crate::gdn2::{Gdn2, Gdn2Inputs, Gdn2Options, Gdn2Outputs};

/// GDN-2 forward. `x`: `q, k, g, b [B, T, H, K]`, `v, w [B, T, H, V]`,
/// `A_log [H]`, `dt_bias [H·K]`, `initial_state [N, H, K, V]` (`[N, H, V,
/// K]` with `state_v_first`), `cu_seqlens [N + 1]`. Returns `o [B, T, H, V]`
/// and, with `output_final_state`, `final_state` in the initial state's
/// layout.
pub fn forward<R: Real>(x: &Gdn2Inputs<R>, opt: &Gdn2Options) -> Gdn2Outputs<R> {
    let (q, k) = (view4(&x.q), view4(&x.k));
    let (q, k) = if opt.use_qk_l2norm_in_kernel {
        (l2norm(q), l2norm(k))
    } else {
        (q.to_owned(), k.to_owned())
    };
    let (b, t, h, kd) = q.dim();
    let vd = x.v.shape()[3];
    let rule = Rule {
        scale: R::cst(opt.scale.unwrap_or(1.0 / (kd as f64).sqrt())),
        q,
        k,
        v: view4(&x.v),
        g: decay(x, opt),
        b: view4(&x.b),
        w: view4(&x.w),
    };
    let layout = |s: ArrayView4<'_, R>| state_layout(s, opt.state_v_first);
    let h0 = x.initial_state.as_ref().map(|s| layout(view4(s)));
    let seqs = sequences(b, t, x.cu_seqlens.as_deref());
    let mut o = Array4::zeros((b, t, h, vd));
    let mut fin = Array4::zeros((seqs.len(), h, kd, vd));
    for seq in &seqs {
        for j in 0..h {
            let s0 = h0.as_ref().map_or(Array2::zeros((kd, vd)), |s| {
                s.slice(s![seq.n, j, .., ..]).to_owned()
            });
            let s = rule.head(seq, j, s0, &mut o);
            fin.slice_mut(s![seq.n, j, .., ..]).assign(&s);
        }
    }
    Gdn2Outputs {
        o: o.into_dyn(),
        final_state: opt
            .output_final_state
            .then(|| layout(fin.view()).into_dyn()),
    }
}

/// The log-space decay `[B, T, H, K]`: `g` itself, or the in-kernel gate
/// (see the module doc).
fn decay<R: Real>(x: &Gdn2Inputs<R>, opt: &Gdn2Options) -> Array4<R> {
    let g = view4(&x.g);
    if !opt.use_gate_in_kernel {
        return g.to_owned();
    }
    let kd = g.dim().3;
    let bias = |j: usize, d: usize| x.dt_bias.as_ref().map_or(R::zero(), |db| db[[j * kd + d]]);
    let rate = |j: usize| x.a_log.as_ref().map(|a| a[[j]].exp());
    Array4::from_shape_fn(g.dim(), |(bi, ti, j, d)| {
        let z = g[[bi, ti, j, d]] + bias(j, d);
        match opt.lower_bound {
            Some(lower_bound) => R::cst(lower_bound) * sigmoid(rate(j).map_or(z, |a| a * z)),
            None => -rate(j).expect("the softplus gate needs A_log") * softplus(z),
        }
    })
}

/// The pre-processed per-token tensors.
struct Rule<'a, R> {
    /// `[B, T, H, K]`, not yet scaled.
    q: Array4<R>,
    /// `[B, T, H, K]`
    k: Array4<R>,
    /// `[B, T, H, V]`
    v: ArrayView4<'a, R>,
    /// `[B, T, H, K]` log-space decay.
    g: Array4<R>,
    /// `[B, T, H, K]` erase gate.
    b: ArrayView4<'a, R>,
    /// `[B, T, H, V]` write gate.
    w: ArrayView4<'a, R>,
    scale: R,
}

impl<R: Real> Rule<'_, R> {
    /// Head `j` of one sequence from state `s [K, V]`: writes its `o` rows,
    /// returns its final state.
    fn head(&self, seq: &Sequence, j: usize, mut s: Array2<R>, o: &mut Array4<R>) -> Array2<R> {
        let (kd, vd) = s.dim();
        let bt = seq.batch;
        for t in seq.tokens.clone() {
            let row = s![bt, t, j, ..];
            let (q, k, g) = (self.q.slice(row), self.k.slice(row), self.g.slice(row));
            let (v, b, w) = (self.v.slice(row), self.b.slice(row), self.w.slice(row));
            // S ← Diag(exp g_t) S
            for a in 0..kd {
                for c in 0..vd {
                    s[[a, c]] = g[a].exp() * s[[a, c]];
                }
            }
            // S ← S + k_t (w_t ⊙ v_t − Sᵀ (b_t ⊙ k_t))ᵀ
            for c in 0..vd {
                let v_new = w[c] * v[c] - sum(kd, |a| s[[a, c]] * (b[a] * k[a]));
                for a in 0..kd {
                    s[[a, c]] = s[[a, c]] + k[a] * v_new;
                }
            }
            // o_t = Sᵀ (scale · q_t)
            for c in 0..vd {
                o[[bt, t, j, c]] = sum(kd, |a| s[[a, c]] * (self.scale * q[a]));
            }
        }
        s
    }
}

impl Truth for Gdn2 {
    type Inputs<R: Real> = Gdn2Inputs<R>;
    type Outputs<R: Real> = Gdn2Outputs<R>;

    fn forward<R: Real>(x: &Gdn2Inputs<R>, opt: &Gdn2Options) -> Gdn2Outputs<R> {
        forward(x, opt)
    }

    fn tensors<R: Real>(x: &Gdn2Inputs<R>) -> Vec<Option<&ArrayD<R>>> {
        vec![
            Some(&x.q),
            Some(&x.k),
            Some(&x.v),
            Some(&x.g),
            Some(&x.b),
            Some(&x.w),
            x.a_log.as_ref(),
            x.dt_bias.as_ref(),
            x.initial_state.as_ref(),
        ]
    }

    fn map_tensors<R: Real, S: Real>(
        x: &Gdn2Inputs<R>,
        mut f: impl FnMut(usize, &ArrayD<R>) -> ArrayD<S>,
    ) -> Gdn2Inputs<S> {
        Gdn2Inputs {
            q: f(0, &x.q),
            k: f(1, &x.k),
            v: f(2, &x.v),
            g: f(3, &x.g),
            b: f(4, &x.b),
            w: f(5, &x.w),
            a_log: x.a_log.as_ref().map(|a| f(6, a)),
            dt_bias: x.dt_bias.as_ref().map(|a| f(7, a)),
            initial_state: x.initial_state.as_ref().map(|a| f(8, a)),
            cu_seqlens: x.cu_seqlens.clone(),
        }
    }

    fn outputs<R: Real>(y: &Gdn2Outputs<R>) -> Vec<Option<&ArrayD<R>>> {
        vec![Some(&y.o), y.final_state.as_ref()]
    }
}
