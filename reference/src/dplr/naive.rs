//! The naive recurrent DPLR form, one token at a time (SPEC §4), with a
//! checkpointed hand-derived backward (`O(√L · K · V)` memory).

use ndarray::{Array2, ArrayD, ArrayView1, ArrayView2};

use super::{DplrEngine, DplrGrads, DplrHead, DplrHeadGrads, DplrInputs, DplrOptions, DplrOutputs};
use crate::error::Result;
use crate::scalar::Scalar;
use crate::tensor::dot;

#[derive(Clone, Copy, Debug, Default)]
pub struct Naive;

pub fn forward<T: Scalar>(x: &DplrInputs<T>, opt: &DplrOptions) -> Result<DplrOutputs<T>> {
    super::forward(&Naive, x, opt)
}

pub fn backward<T: Scalar>(
    x: &DplrInputs<T>,
    opt: &DplrOptions,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<DplrGrads<T>> {
    super::backward(&Naive, x, opt, d_o, dht)
}

/// `out_j = Σ_i w_i S[i, j]` (a row vector times the `[K, V]` state).
fn vec_mat<T: Scalar>(w: ArrayView1<T>, s: &[T], out: &mut [T]) {
    let vd = out.len();
    out.iter_mut().for_each(|x| *x = T::zero());
    for (i, &wi) in w.iter().enumerate() {
        for (oj, &sj) in out.iter_mut().zip(&s[i * vd..(i + 1) * vd]) {
            *oj += wi * sj;
        }
    }
}

/// One step `S ← Diag(exp gk) S + b (aᵀS) + k vᵀ`; `a_s` receives `aᵀ S_{t−1}`.
fn step<T: Scalar>(x: &DplrHead<T>, t: usize, s: &mut [T], a_s: &mut [T]) {
    let vd = x.v_dim();
    vec_mat(x.a.row(t), s, a_s);
    let v = x.v.row(t);
    for (i, ((&gi, &bi), &ki)) in
        x.gk.row(t)
            .iter()
            .zip(x.b.row(t))
            .zip(x.k.row(t))
            .enumerate()
    {
        let e = gi.exp();
        for ((sj, &asj), &vj) in s[i * vd..(i + 1) * vd]
            .iter_mut()
            .zip(a_s.iter())
            .zip(v.iter())
        {
            *sj = e * *sj + bi * asj + ki * vj;
        }
    }
}

fn run<T: Scalar>(
    x: &DplrHead<T>,
    s: &mut [T],
    from: usize,
    to: usize,
    mut o: Option<&mut Array2<T>>,
    mut keep: impl FnMut(usize, &[T]),
) {
    let mut a_s = vec![T::zero(); x.v_dim()];
    for t in from..to {
        keep(t, s);
        step(x, t, s, &mut a_s);
        if let Some(o) = o.as_deref_mut() {
            vec_mat(
                x.q.row(t),
                s,
                o.row_mut(t).as_slice_mut().expect("row-major"),
            );
        }
    }
}

fn block_len(l: usize) -> usize {
    ((l as f64).sqrt().ceil() as usize).max(16)
}

impl<T: Scalar> DplrEngine<T> for Naive {
    fn forward(&self, x: &DplrHead<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        let mut s = h0.as_standard_layout().into_owned();
        let mut o = Array2::zeros((x.len(), x.v_dim()));
        run(
            x,
            s.as_slice_mut().expect("standard layout"),
            0,
            x.len(),
            Some(&mut o),
            |_, _| {},
        );
        (o, s)
    }

    fn backward(
        &self,
        x: &DplrHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> DplrHeadGrads<T> {
        let (l, kd, vd) = (x.len(), x.k_dim(), x.v_dim());
        let (bl, kv) = (block_len(l), kd * vd);
        let mut a_s = vec![T::zero(); vd];
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
            step(x, t, &mut s, &mut a_s);
        }
        let z = || Array2::zeros((l, kd));
        let mut gr = DplrHeadGrads {
            dq: z(),
            dk: z(),
            dv: Array2::zeros((l, vd)),
            da: z(),
            db: z(),
            dgk: z(),
            dh0: Array2::zeros((kd, vd)),
        };
        let mut ds = dht
            .as_standard_layout()
            .into_owned()
            .into_raw_vec_and_offset()
            .0;
        // Per block: the state entering each token and its `aᵀS`.
        let mut prev = vec![T::zero(); bl * kv];
        let mut a_ss = vec![T::zero(); bl * vd];
        let mut da_s = vec![T::zero(); vd];
        for (blk, start) in (0..l).step_by(bl).enumerate().rev() {
            let end = (start + bl).min(l);
            s.copy_from_slice(&checkpoints[blk * kv..(blk + 1) * kv]);
            for t in start..end {
                let i = t - start;
                prev[i * kv..(i + 1) * kv].copy_from_slice(&s);
                step(x, t, &mut s, &mut a_ss[i * vd..(i + 1) * vd]);
            }
            for t in (start..end).rev() {
                let i = t - start;
                let (s_prev, a_s) = (&prev[i * kv..(i + 1) * kv], &a_ss[i * vd..(i + 1) * vd]);
                backward_step(x, t, s_prev, a_s, d_o, &mut ds, &mut da_s, &mut gr);
            }
        }
        gr.dh0 = Array2::from_shape_vec((kd, vd), ds).expect("K×V");
        gr
    }
}

/// One reverse step: `ds` holds `∂L/∂S_t` on entry and `∂L/∂S_{t−1}` on exit.
///
/// With `S_t = Diag(e^gk) S_{t−1} + b (aᵀS_{t−1})ᵀ + k vᵀ` and `o = S_tᵀ q`:
/// pass A gives `dq`, `dS_t += q doᵀ`, `dk = dS_t v`, `dv += dS_tᵀ k`,
/// `db = dS_t (aᵀS)`, `d(aᵀS) = dS_tᵀ b`, `dgk = e^gk ⊙ Σ_j dS_t ⊙ S_{t−1}`;
/// pass B: `da = S_{t−1} d(aᵀS)`, `dS_{t−1} = Diag(e^gk) dS_t + a d(aᵀS)ᵀ`.
#[allow(clippy::too_many_arguments)]
fn backward_step<T: Scalar>(
    x: &DplrHead<T>,
    t: usize,
    s_prev: &[T],
    a_s: &[T],
    d_o: ArrayView2<T>,
    ds: &mut [T],
    da_s: &mut [T],
    gr: &mut DplrHeadGrads<T>,
) {
    let vd = a_s.len();
    let (do_row, v_row) = (d_o.row(t), x.v.row(t));
    let (d_out, v) = (
        do_row.as_slice().expect("row-major"),
        v_row.as_slice().expect("row-major"),
    );
    let (ado, vdo) = (dot(a_s, d_out), dot(v, d_out));
    da_s.iter_mut().for_each(|x| *x = T::zero());
    let params =
        x.q.row(t)
            .into_iter()
            .zip(x.k.row(t))
            .zip(x.b.row(t))
            .zip(x.gk.row(t));
    for (i, ((dsr, spr), (((&qi, &ki), &bi), &gi))) in ds
        .chunks_exact_mut(vd)
        .zip(s_prev.chunks_exact(vd))
        .zip(params)
        .enumerate()
    {
        let e = gi.exp();
        // o_j = Σ_i q_i S_t[i, j] with S_t row i = e S_{t−1} row + b_i aᵀS + k_i v.
        gr.dq[[t, i]] = e * dot(spr, d_out) + bi * ado + ki * vdo;
        for (dj, &doj) in dsr.iter_mut().zip(d_out) {
            *dj += qi * doj;
        }
        gr.dk[[t, i]] = dot(dsr, v);
        gr.db[[t, i]] = dot(dsr, a_s);
        gr.dgk[[t, i]] = e * dot(dsr, spr);
        for ((dasj, dvj), &dj) in da_s.iter_mut().zip(gr.dv.row_mut(t)).zip(dsr.iter()) {
            *dasj += bi * dj;
            *dvj += ki * dj;
        }
    }
    for (i, ((dsr, spr), (&ai, &gi))) in ds
        .chunks_exact_mut(vd)
        .zip(s_prev.chunks_exact(vd))
        .zip(x.a.row(t).iter().zip(x.gk.row(t)))
        .enumerate()
    {
        let e = gi.exp();
        gr.da[[t, i]] = dot(spr, da_s);
        for (dj, &dasj) in dsr.iter_mut().zip(da_s.iter()) {
            *dj = e * *dj + ai * dasj;
        }
    }
}
