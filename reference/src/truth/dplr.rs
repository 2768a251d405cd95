//! DPLR's truth (SPEC §4): per sequence and head, from `S_0 = initial_state`
//! (or 0),
//! ```text
//! S_t = Diag(exp gk_t) S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ
//! o_t = S_tᵀ (scale · q_t)
//! ```
//! (`a_tᵀ S_{t−1}` reads the undecayed previous state). No pre-processing.

use ndarray::{s, Array1, Array2, Array4, ArrayD};

use super::{sequences, sum, view4, Real, Sequence, Truth};
use crate::dplr::{Dplr, DplrInputs, DplrOptions, DplrOutputs};

/// DPLR forward. `x`: `q, k, a, b, gk [B, T, H, K]`, `v [B, T, H, V]`,
/// `initial_state [N, H, K, V]`, `cu_seqlens [N + 1]`. Returns
/// `o [B, T, H, V]` and, with `output_final_state`, `final_state [N, H, K, V]`.
pub fn forward<R: Real>(x: &DplrInputs<R>, opt: &DplrOptions) -> DplrOutputs<R> {
    let (b, t, h, kd) = view4(&x.q).dim();
    let vd = x.v.shape()[3];
    let scale = R::cst(opt.scale.unwrap_or(1.0 / (kd as f64).sqrt()));
    let seqs = sequences(b, t, x.cu_seqlens.as_deref());
    let mut o = Array4::zeros((b, t, h, vd));
    let mut fin = Array4::zeros((seqs.len(), h, kd, vd));
    for seq in &seqs {
        for j in 0..h {
            let s0 = x
                .initial_state
                .as_ref()
                .map_or(Array2::zeros((kd, vd)), |s0| {
                    view4(s0).slice(s![seq.n, j, .., ..]).to_owned()
                });
            let s = head(x, scale, seq, j, s0, &mut o);
            fin.slice_mut(s![seq.n, j, .., ..]).assign(&s);
        }
    }
    DplrOutputs {
        o: o.into_dyn(),
        final_state: opt.output_final_state.then(|| fin.into_dyn()),
    }
}

/// Head `j` of one sequence from state `s [K, V]`: writes its `o` rows,
/// returns its final state.
fn head<R: Real>(
    x: &DplrInputs<R>,
    scale: R,
    seq: &Sequence,
    j: usize,
    mut s: Array2<R>,
    o: &mut Array4<R>,
) -> Array2<R> {
    let (kd, vd) = s.dim();
    let tensors = [&x.q, &x.k, &x.v, &x.a, &x.b, &x.gk].map(view4);
    for t in seq.tokens.clone() {
        let [q, k, v, a, b, gk] = tensors.each_ref().map(|x| x.slice(s![seq.batch, t, j, ..]));
        // S_t = Diag(exp gk_t) S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ, with
        // a_tᵀ S_{t−1} taken before S is overwritten.
        let a_s = Array1::from_shape_fn(vd, |c| sum(kd, |d| a[d] * s[[d, c]]));
        for d in 0..kd {
            for c in 0..vd {
                s[[d, c]] = gk[d].exp() * s[[d, c]] + b[d] * a_s[c] + k[d] * v[c];
            }
        }
        // o_t = S_tᵀ (scale · q_t)
        for c in 0..vd {
            o[[seq.batch, t, j, c]] = sum(kd, |d| s[[d, c]] * (scale * q[d]));
        }
    }
    s
}

impl Truth for Dplr {
    type Inputs<R: Real> = DplrInputs<R>;
    type Outputs<R: Real> = DplrOutputs<R>;

    fn forward<R: Real>(x: &DplrInputs<R>, opt: &DplrOptions) -> DplrOutputs<R> {
        forward(x, opt)
    }

    fn tensors<R: Real>(x: &DplrInputs<R>) -> Vec<Option<&ArrayD<R>>> {
        vec![
            Some(&x.q),
            Some(&x.k),
            Some(&x.v),
            Some(&x.a),
            Some(&x.b),
            Some(&x.gk),
            x.initial_state.as_ref(),
        ]
    }

    fn map_tensors<R: Real, S: Real>(
        x: &DplrInputs<R>,
        mut f: impl FnMut(usize, &ArrayD<R>) -> ArrayD<S>,
    ) -> DplrInputs<S> {
        DplrInputs {
            q: f(0, &x.q),
            k: f(1, &x.k),
            v: f(2, &x.v),
            a: f(3, &x.a),
            b: f(4, &x.b),
            gk: f(5, &x.gk),
            initial_state: x.initial_state.as_ref().map(|s| f(6, s)),
            cu_seqlens: x.cu_seqlens.clone(),
        }
    }

    fn outputs<R: Real>(y: &DplrOutputs<R>) -> Vec<Option<&ArrayD<R>>> {
        vec![Some(&y.o), y.final_state.as_ref()]
    }
}
