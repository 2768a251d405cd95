//! The naive recurrent form: one token at a time, exactly SPEC §3.
//!
//! Backward is the hand-derived reverse-time recurrence. States are kept only
//! at checkpoints every `⌈√L⌉` tokens and recomputed per block, so memory is
//! `O(√L · K · V)` rather than `O(L · K · V)`. Each token costs two fused
//! passes over the `[K, V]` state forward and two backward.

use ndarray::{Array1, Array2, ArrayD, ArrayView2};

use super::{KdaEngine, KdaGrads, KdaHead, KdaHeadGrads, KdaInputs, KdaOptions, KdaOutputs};
use crate::error::Result;
use crate::scalar::Scalar;
use crate::tensor::dot;

/// The naive recurrent engine.
#[derive(Clone, Copy, Debug, Default)]
pub struct Naive;

/// `forward(&Naive, …)`: outputs `o [B,T,HV,V]` and optionally `final_state`.
pub fn forward<T: Scalar>(x: &KdaInputs<T>, opt: &KdaOptions) -> Result<KdaOutputs<T>> {
    super::forward(&Naive, x, opt)
}

/// `backward(&Naive, …)`: all gradients from `do` and optional `dht`.
pub fn backward<T: Scalar>(
    x: &KdaInputs<T>,
    opt: &KdaOptions,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<KdaGrads<T>> {
    super::backward(&Naive, x, opt, d_o, dht)
}

/// One token: `S ← Diag(e^g) S`, `r = v − Sᵀk`, `S ← S + β k rᵀ`, and when
/// `o` is given `o = Sᵀ q`. `r` receives `v − S'ᵀk` (needed by backward).
fn step<T: Scalar>(x: &KdaHead<T>, t: usize, s: &mut [T], r: &mut [T], o: Option<&mut [T]>) {
    let vd = r.len();
    r.copy_from_slice(x.v.row(t).as_slice().expect("row-major"));
    for ((row, &ki), &gi) in s.chunks_exact_mut(vd).zip(x.k.row(t)).zip(x.g.row(t)) {
        let e = gi.exp();
        for (sj, rj) in row.iter_mut().zip(r.iter_mut()) {
            *sj *= e;
            *rj -= ki * *sj;
        }
    }
    let beta = x.beta[t];
    match o {
        Some(o) => {
            o.iter_mut().for_each(|v| *v = T::zero());
            for ((row, &ki), &qi) in s.chunks_exact_mut(vd).zip(x.k.row(t)).zip(x.q.row(t)) {
                let c = ki * beta;
                for ((sj, &rj), oj) in row.iter_mut().zip(r.iter()).zip(o.iter_mut()) {
                    *sj += c * rj;
                    *oj += qi * *sj;
                }
            }
        }
        None => {
            for (row, &ki) in s.chunks_exact_mut(vd).zip(x.k.row(t)) {
                let c = ki * beta;
                row.iter_mut()
                    .zip(r.iter())
                    .for_each(|(sj, &rj)| *sj += c * rj);
            }
        }
    }
}

/// Block length for checkpointed backward.
fn block_len(l: usize) -> usize {
    ((l as f64).sqrt().ceil() as usize).max(16)
}

impl<T: Scalar> KdaEngine<T> for Naive {
    fn forward(&self, x: &KdaHead<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        let mut s = h0.as_standard_layout().into_owned();
        let mut o = Array2::zeros((x.len(), x.v_dim()));
        let mut r = vec![T::zero(); x.v_dim()];
        let sl = s.as_slice_mut().expect("standard layout");
        for (t, mut orow) in o.rows_mut().into_iter().enumerate() {
            step(x, t, sl, &mut r, orow.as_slice_mut());
        }
        (o, s)
    }

    fn backward(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> KdaHeadGrads<T> {
        let (l, kd, vd) = (x.len(), x.k_dim(), x.v_dim());
        let (bl, kv) = (block_len(l), kd * vd);
        let mut r = vec![T::zero(); vd];
        // The state entering each block.
        let mut checkpoints: Vec<T> = Vec::with_capacity(l.div_ceil(bl) * kv);
        let mut s = h0
            .as_standard_layout()
            .into_owned()
            .into_raw_vec_and_offset()
            .0;
        for t in 0..l {
            if t % bl == 0 {
                checkpoints.extend_from_slice(&s);
            }
            step(x, t, &mut s, &mut r, None);
        }
        let mut gr = KdaHeadGrads {
            dq: Array2::zeros((l, kd)),
            dk: Array2::zeros((l, kd)),
            dv: Array2::zeros((l, vd)),
            dg: Array2::zeros((l, kd)),
            dbeta: Array1::zeros(l),
            dh0: Array2::zeros((kd, vd)),
        };
        let mut ds = dht
            .as_standard_layout()
            .into_owned()
            .into_raw_vec_and_offset()
            .0;
        // Per block: the state entering each token and its `r`.
        let mut prev = vec![T::zero(); bl * kv];
        let mut rs = vec![T::zero(); bl * vd];
        let mut du = vec![T::zero(); vd];
        for (b, start) in (0..l).step_by(bl).enumerate().rev() {
            let end = (start + bl).min(l);
            s.copy_from_slice(&checkpoints[b * kv..(b + 1) * kv]);
            for t in start..end {
                let i = t - start;
                prev[i * kv..(i + 1) * kv].copy_from_slice(&s);
                step(x, t, &mut s, &mut rs[i * vd..(i + 1) * vd], None);
            }
            for t in (start..end).rev() {
                let i = t - start;
                let bs = BackStep {
                    x,
                    t,
                    s_prev: &prev[i * kv..(i + 1) * kv],
                    r: &rs[i * vd..(i + 1) * vd],
                };
                bs.run(d_o, &mut ds, &mut du, &mut gr);
            }
        }
        gr.dh0 = Array2::from_shape_vec((kd, vd), ds).expect("K×V");
        gr
    }
}

/// What one reverse step needs: the token, the state entering it and `r`.
struct BackStep<'a, T> {
    x: &'a KdaHead<T>,
    t: usize,
    s_prev: &'a [T],
    r: &'a [T],
}

impl<T: Scalar> BackStep<'_, T> {
    /// `ds` holds `∂L/∂S_t` on entry and `∂L/∂S_{t−1}` on exit.
    ///
    /// With `S' = Diag(e^g) S_{t−1}`, `u = β r`, `S_t = S' + k uᵀ`, `o = S_tᵀ q`:
    /// pass A gives `dq = S_t do`, `dS_t += q doᵀ`, `du = dS_tᵀ k`, `dk = dS_t u`;
    /// pass B applies `d(S'ᵀk) = −β du`: `dS' = dS_t + k d(S'ᵀk)ᵀ`,
    /// `dk += S' d(S'ᵀk)`, `dg = Σ_j dS' ⊙ S'`, `dS_{t−1} = Diag(e^g) dS'`.
    fn run(&self, d_o: ArrayView2<T>, ds: &mut [T], du: &mut [T], gr: &mut KdaHeadGrads<T>) {
        let (x, t, vd) = (self.x, self.t, self.r.len());
        let beta = x.beta[t];
        let do_row = d_o.row(t);
        let dot_ = do_row.as_slice().expect("row-major");
        let rdo = dot(self.r, dot_);
        let (q, k, g) = (x.q.row(t), x.k.row(t), x.g.row(t));
        du.iter_mut().for_each(|v| *v = T::zero());
        let rows = ds.chunks_exact_mut(vd).zip(self.s_prev.chunks_exact(vd));
        for (i, ((dsr, spr), ((&qi, &ki), &gi))) in rows.zip(q.iter().zip(&k).zip(&g)).enumerate() {
            let e = gi.exp();
            // dq_i = S_t row · do with S_t row = e·S_{t−1} row + k_i β r.
            gr.dq[[t, i]] = e * dot(spr, dot_) + ki * beta * rdo;
            for ((dj, duj), &doj) in dsr.iter_mut().zip(du.iter_mut()).zip(dot_) {
                *dj += qi * doj;
                *duj += ki * *dj;
            }
            gr.dk[[t, i]] = beta * dot(dsr, self.r);
        }
        let mut dbeta = T::zero();
        for (j, (duj, &rj)) in du.iter_mut().zip(self.r).enumerate() {
            dbeta += *duj * rj;
            gr.dv[[t, j]] = beta * *duj;
            *duj = -beta * *duj;
        }
        gr.dbeta[t] = dbeta;
        let rows = ds.chunks_exact_mut(vd).zip(self.s_prev.chunks_exact(vd));
        for (i, ((dsr, spr), (&ki, &gi))) in rows.zip(k.iter().zip(&g)).enumerate() {
            let e = gi.exp();
            for (dj, &dksj) in dsr.iter_mut().zip(du.iter()) {
                *dj += ki * dksj;
            }
            // With S' = e·S_{t−1}: dk += S' d(S'ᵀk), dg = Σ dS' ⊙ S'.
            gr.dk[[t, i]] += e * dot(spr, du);
            gr.dg[[t, i]] = e * dot(dsr, spr);
            dsr.iter_mut().for_each(|d| *d *= e);
        }
    }
}
