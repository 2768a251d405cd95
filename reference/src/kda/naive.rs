//! The naive recurrent form: one token at a time, exactly SPEC §3.
//!
//! Backward is the hand-derived reverse-time recurrence. States are kept only
//! at checkpoints every `⌈√L⌉` tokens and recomputed per block, so memory is
//! `O(√L · K · V)` rather than `O(L · K · V)`.

use ndarray::{Array1, Array2, ArrayView2};

use super::{KdaEngine, KdaGrads, KdaHead, KdaHeadGrads, KdaInputs, KdaOptions, KdaOutputs};
use crate::error::Result;
use crate::scalar::Scalar;

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
    d_o: &ndarray::ArrayD<T>,
    dht: Option<&ndarray::ArrayD<T>>,
) -> Result<KdaGrads<T>> {
    super::backward(&Naive, x, opt, d_o, dht)
}

/// Scratch for one token step: the decayed state and the delta-rule terms.
struct Step<T> {
    /// `S' = Diag(exp g) S_{t−1}`, `[K, V]` row-major.
    sp: Vec<T>,
    /// `v − S'ᵀ k`, `[V]`.
    r: Vec<T>,
    /// `β r`, `[V]`.
    u: Vec<T>,
}

impl<T: Scalar> Step<T> {
    fn new(kd: usize, vd: usize) -> Self {
        Step {
            sp: vec![T::zero(); kd * vd],
            r: vec![T::zero(); vd],
            u: vec![T::zero(); vd],
        }
    }

    /// Computes `S'`, `r`, `u` for token `t` from `s_prev`.
    fn compute(&mut self, x: &KdaHead<T>, t: usize, s_prev: &[T]) {
        let vd = x.v_dim();
        let (k, g, v) = (x.k.row(t), x.g.row(t), x.v.row(t));
        self.r.iter_mut().zip(v.iter()).for_each(|(r, &vj)| *r = vj);
        for (i, (&ki, &gi)) in k.iter().zip(g.iter()).enumerate() {
            let e = gi.exp();
            let row = &mut self.sp[i * vd..(i + 1) * vd];
            for (spj, &sj) in row.iter_mut().zip(&s_prev[i * vd..(i + 1) * vd]) {
                *spj = e * sj;
            }
            for (rj, &spj) in self.r.iter_mut().zip(row.iter()) {
                *rj -= ki * spj;
            }
        }
        let b = x.beta[t];
        self.u
            .iter_mut()
            .zip(&self.r)
            .for_each(|(u, &r)| *u = b * r);
    }

    /// Writes `S_t = S' + k uᵀ` into `s`.
    fn state(&self, x: &KdaHead<T>, t: usize, s: &mut [T]) {
        let vd = x.v_dim();
        for (i, &ki) in x.k.row(t).iter().enumerate() {
            let (dst, src) = (&mut s[i * vd..(i + 1) * vd], &self.sp[i * vd..(i + 1) * vd]);
            for ((d, &sp), &u) in dst.iter_mut().zip(src).zip(&self.u) {
                *d = sp + ki * u;
            }
        }
    }
}

/// `o_j = Σ_i q_i S[i, j]`.
fn read_out<T: Scalar>(q: ndarray::ArrayView1<T>, s: &[T], o: &mut [T]) {
    let vd = o.len();
    o.iter_mut().for_each(|x| *x = T::zero());
    for (i, &qi) in q.iter().enumerate() {
        for (oj, &sj) in o.iter_mut().zip(&s[i * vd..(i + 1) * vd]) {
            *oj += qi * sj;
        }
    }
}

/// Runs tokens `from..to` forward, updating `s` in place; writes `o` rows
/// when given and calls `keep(t, S_{t−1})` before each step.
fn run<T: Scalar>(
    x: &KdaHead<T>,
    s: &mut [T],
    from: usize,
    to: usize,
    mut o: Option<&mut Array2<T>>,
    mut keep: impl FnMut(usize, &[T]),
) {
    let mut step = Step::new(x.k_dim(), x.v_dim());
    for t in from..to {
        keep(t, s);
        step.compute(x, t, s);
        step.state(x, t, s);
        if let Some(o) = o.as_deref_mut() {
            read_out(
                x.q.row(t),
                s,
                o.row_mut(t).as_slice_mut().expect("row-major"),
            );
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
        let sl = s.as_slice_mut().expect("standard layout");
        run(x, sl, 0, x.len(), Some(&mut o), |_, _| {});
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
        let bl = block_len(l);
        // Checkpoints: the state entering each block.
        let mut checkpoints: Vec<Vec<T>> = Vec::new();
        let mut s = h0
            .as_standard_layout()
            .into_owned()
            .into_raw_vec_and_offset()
            .0;
        run(x, &mut s, 0, l, None, |t, st| {
            if t % bl == 0 {
                checkpoints.push(st.to_vec());
            }
        });

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
        let mut step = Step::new(kd, vd);
        let mut s_t = vec![T::zero(); kd * vd];
        let mut du = vec![T::zero(); vd];
        for (blk, start) in checkpoints.iter().zip((0..l).step_by(bl)).rev() {
            let end = (start + bl).min(l);
            // States entering each token of the block.
            let mut prev: Vec<Vec<T>> = Vec::with_capacity(end - start);
            let mut s = blk.clone();
            run(x, &mut s, start, end, None, |_, st| prev.push(st.to_vec()));
            for t in (start..end).rev() {
                step.compute(x, t, &prev[t - start]);
                step.state(x, t, &mut s_t);
                backward_step(x, t, &step, &s_t, d_o, &mut ds, &mut du, &mut gr);
            }
        }
        gr.dh0 = Array2::from_shape_vec((kd, vd), ds).expect("K×V");
        gr
    }
}

/// One reverse step: `ds` holds `∂L/∂S_t` on entry and `∂L/∂S_{t−1}` on exit.
#[allow(clippy::too_many_arguments)]
fn backward_step<T: Scalar>(
    x: &KdaHead<T>,
    t: usize,
    step: &Step<T>,
    s_t: &[T],
    d_o: ArrayView2<T>,
    ds: &mut [T],
    du: &mut [T],
    gr: &mut KdaHeadGrads<T>,
) {
    let vd = x.v_dim();
    let (q, k, g) = (x.q.row(t), x.k.row(t), x.g.row(t));
    let dot = d_o.row(t);
    let beta = x.beta[t];
    // o = S_tᵀ q: dq = S_t do, dS_t += q doᵀ.
    for (i, &qi) in q.iter().enumerate() {
        let (row, dsr) = (&s_t[i * vd..(i + 1) * vd], &mut ds[i * vd..(i + 1) * vd]);
        let mut acc = T::zero();
        for ((&sj, dj), &doj) in row.iter().zip(dsr.iter_mut()).zip(dot.iter()) {
            acc += sj * doj;
            *dj += qi * doj;
        }
        gr.dq[[t, i]] = acc;
    }
    // S_t = S' + k uᵀ: du = dS_tᵀ k, dk = dS_t u.
    du.iter_mut().for_each(|x| *x = T::zero());
    for (i, &ki) in k.iter().enumerate() {
        let dsr = &ds[i * vd..(i + 1) * vd];
        let mut acc = T::zero();
        for ((duj, &dj), &uj) in du.iter_mut().zip(dsr).zip(&step.u) {
            *duj += ki * dj;
            acc += dj * uj;
        }
        gr.dk[[t, i]] = acc;
    }
    // u = β (v − S'ᵀk).
    let mut dbeta = T::zero();
    for (j, (&duj, &rj)) in du.iter().zip(&step.r).enumerate() {
        dbeta += duj * rj;
        gr.dv[[t, j]] = beta * duj;
    }
    gr.dbeta[t] = dbeta;
    // d(S'ᵀk) = −β du: reuse `du` for it.
    du.iter_mut().for_each(|x| *x = -beta * *x);
    for (i, (&ki, &gi)) in k.iter().zip(g.iter()).enumerate() {
        let (spr, dsr) = (
            &step.sp[i * vd..(i + 1) * vd],
            &mut ds[i * vd..(i + 1) * vd],
        );
        let (mut dk_acc, mut dg_acc) = (T::zero(), T::zero());
        for ((dj, &spj), &dksj) in dsr.iter_mut().zip(spr).zip(du.iter()) {
            // dS' = dS_t + k d(S'ᵀk)ᵀ
            *dj += ki * dksj;
            dk_acc += spj * dksj;
            dg_acc += *dj * spj;
        }
        gr.dk[[t, i]] += dk_acc;
        gr.dg[[t, i]] = dg_acc;
        // S' = Diag(exp g) S_{t−1}
        let e = gi.exp();
        dsr.iter_mut().for_each(|d| *d *= e);
    }
}
