//! The naive recurrent DPLR form, one token at a time (SPEC §4), with a
//! checkpointed hand-derived backward (`O(√L · K · V)` memory).

use ndarray::{Array2, ArrayD, ArrayView1, ArrayView2};

use super::{DplrEngine, DplrGrads, DplrHead, DplrHeadGrads, DplrInputs, DplrOptions, DplrOutputs};
use crate::error::Result;
use crate::scalar::Scalar;

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
        let bl = block_len(l);
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
        let mut s_t = vec![T::zero(); kd * vd];
        let mut a_s = vec![T::zero(); vd];
        let mut da_s = vec![T::zero(); vd];
        for (blk, start) in checkpoints.iter().zip((0..l).step_by(bl)).rev() {
            let end = (start + bl).min(l);
            let mut prev: Vec<Vec<T>> = Vec::with_capacity(end - start);
            let mut s = blk.clone();
            run(x, &mut s, start, end, None, |_, st| prev.push(st.to_vec()));
            for t in (start..end).rev() {
                let s_prev = &prev[t - start];
                s_t.copy_from_slice(s_prev);
                step(x, t, &mut s_t, &mut a_s);
                backward_step(x, t, s_prev, &s_t, &a_s, d_o, &mut ds, &mut da_s, &mut gr);
            }
        }
        gr.dh0 = Array2::from_shape_vec((kd, vd), ds).expect("K×V");
        gr
    }
}

/// One reverse step: `ds` holds `∂L/∂S_t` on entry and `∂L/∂S_{t−1}` on exit.
#[allow(clippy::too_many_arguments)]
fn backward_step<T: Scalar>(
    x: &DplrHead<T>,
    t: usize,
    s_prev: &[T],
    s_t: &[T],
    a_s: &[T],
    d_o: ArrayView2<T>,
    ds: &mut [T],
    da_s: &mut [T],
    gr: &mut DplrHeadGrads<T>,
) {
    let vd = x.v_dim();
    let dot = d_o.row(t);
    let v = x.v.row(t);
    // o = S_tᵀ q.
    for (i, &qi) in x.q.row(t).iter().enumerate() {
        let mut acc = T::zero();
        for ((&sj, dj), &doj) in s_t[i * vd..(i + 1) * vd]
            .iter()
            .zip(&mut ds[i * vd..(i + 1) * vd])
            .zip(dot.iter())
        {
            acc += sj * doj;
            *dj += qi * doj;
        }
        gr.dq[[t, i]] = acc;
    }
    // S_t = Diag(e^gk) S_{t−1} + b (aᵀS_{t−1})ᵀ + k vᵀ.
    da_s.iter_mut().for_each(|x| *x = T::zero());
    for (i, ((&ki, &bi), &gi)) in
        x.k.row(t)
            .iter()
            .zip(x.b.row(t))
            .zip(x.gk.row(t))
            .enumerate()
    {
        let (dsr, spr) = (&ds[i * vd..(i + 1) * vd], &s_prev[i * vd..(i + 1) * vd]);
        let (mut dk, mut db, mut dg) = (T::zero(), T::zero(), T::zero());
        for (j, (&dj, &sj)) in dsr.iter().zip(spr).enumerate() {
            dk += dj * v[j];
            db += dj * a_s[j];
            dg += dj * sj;
            da_s[j] += bi * dj;
            gr.dv[[t, j]] += ki * dj;
        }
        gr.dk[[t, i]] = dk;
        gr.db[[t, i]] = db;
        gr.dgk[[t, i]] = gi.exp() * dg;
    }
    for (i, (&ai, &gi)) in x.a.row(t).iter().zip(x.gk.row(t)).enumerate() {
        let (dsr, spr) = (&mut ds[i * vd..(i + 1) * vd], &s_prev[i * vd..(i + 1) * vd]);
        let e = gi.exp();
        let mut da = T::zero();
        for ((dj, &sj), &dasj) in dsr.iter_mut().zip(spr).zip(da_s.iter()) {
            da += sj * dasj;
            *dj = e * *dj + ai * dasj;
        }
        gr.da[[t, i]] = da;
    }
}
