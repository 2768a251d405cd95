//! The chunked form, in the structure of FLA's `chunk_gdn2`
//! (`fla/ops/gdn2/chunk_fwd.py`, `chunk_bwd.py`), exactly (no rounding).
//!
//! Per chunk of `C` tokens (the last of a piece may be shorter), rows `r`,
//! with `q` already scaled and `Γ` the in-chunk inclusive cumsum of `g`:
//!
//! ```text
//! L[r,s]  = Σ_d b_r[d] k_r[d] k_s[d] exp(Γ_r[d] − Γ_s[d])     s < r
//! Akk     = (I + L)^{-1}                                       (forward substitution)
//! w_wy    = Akk (b ⊙ k ⊙ exp Γ)        u_wy = Akk (w ⊙ v)
//! Aqk[r,s]= Σ_d q_r[d] k_s[d] exp(Γ_r[d] − Γ_s[d])            s ≤ r
//! qg      = q ⊙ exp Γ                  kg = k ⊙ exp(Γ_last − Γ)
//! v_new   = u_wy − w_wy h              (h: the state entering the chunk)
//! o       = qg h + Aqk v_new
//! h'      = Diag(exp Γ_last) h + kgᵀ v_new
//! ```
//!
//! FLA's names throughout (`g_cumsum`, `Akk`, `Aqk`, `w_wy`, `u_wy`, `qg`,
//! `kg`, `h`, `v_new`; backward `dAqk`, `dv` → `dv2`, `dh`, `dAkk`). FLA
//! works in base 2 (`exp2` of `Γ·log2 e`) and factors pairwise decays
//! through anchors; both are the same numbers in exact arithmetic and are
//! left out: each pairwise decay `exp(Γ_r − Γ_s)` is taken directly (never
//! above 1 for a non-positive decay, so nothing overflows).
//!
//! The chunk transition `Diag(exp Γ_last) − kgᵀ w_wy` (`h' = M h + kgᵀ u_wy`)
//! gives CP's `M` as FLA's pre-process composes it.

use ndarray::{s, Array1, Array2, ArrayD, ArrayView2, Axis};

use super::{
    scale_rows, Gdn2, Gdn2Grads, Gdn2Head, Gdn2HeadGrads, Gdn2Inputs, Gdn2Options, Gdn2Outputs,
};
use crate::error::Result;
use crate::op::{self, Engine};
use crate::scalar::Scalar;

/// The chunked engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    chunk_size: usize,
}

impl Chunk {
    /// Chunks of `chunk_size` tokens: 16, 32 or 64 (FLA's `chunk_gdn2`
    /// takes 64 only; the results do not depend on it).
    pub fn new(chunk_size: usize) -> Result<Self> {
        Ok(Chunk::sized(crate::registry::ChunkSize::new(chunk_size)?))
    }

    /// The engine with chunks of `c` tokens.
    pub fn sized(c: crate::registry::ChunkSize) -> Self {
        Chunk {
            chunk_size: c.get(),
        }
    }

    /// `C`, tokens per chunk.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }
}

/// `op::forward(&Chunk::new(chunk_size)?, …)`: `o [B, T, H, V]` and, if
/// asked, `final_state`.
pub fn forward<T: Scalar>(
    x: &Gdn2Inputs<T>,
    opt: &Gdn2Options,
    chunk_size: usize,
) -> Result<Gdn2Outputs<T>> {
    op::forward(&Chunk::new(chunk_size)?, x, opt)
}

/// `op::backward(&Chunk::new(chunk_size)?, …)`: every gradient of
/// `Σ o·do + Σ final_state·dht`.
pub fn backward<T: Scalar>(
    x: &Gdn2Inputs<T>,
    opt: &Gdn2Options,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
    chunk_size: usize,
) -> Result<Gdn2Grads<T>> {
    op::backward(&Chunk::new(chunk_size)?, x, opt, d_o, dht)
}

/// One chunk's state-independent quantities (FLA's `chunk_gdn2_fwd_intra`
/// and `recompute_w_u_fwd_gdn2`), `c` rows.
#[derive(Clone, Debug)]
pub struct Intra<T> {
    /// First token of the chunk in its piece.
    pub start: usize,
    /// `[c, K]` in-chunk inclusive cumsum of `g` (natural log).
    pub g_cumsum: Array2<T>,
    /// `[c, c]` FLA's `Akk`: the inverse `(I + L)^{-1}` (unit lower triangular).
    pub akk: Array2<T>,
    /// `[c, c]` FLA's `Aqk` (lower triangular, diagonal included; `q` scaled).
    pub aqk: Array2<T>,
    /// `[c, K]` `Akk (b ⊙ k ⊙ exp Γ)`.
    pub w_wy: Array2<T>,
    /// `[c, V]` `Akk (w ⊙ v)`.
    pub u_wy: Array2<T>,
    /// `[c, K]` `q ⊙ exp Γ`.
    pub qg: Array2<T>,
    /// `[c, K]` `k ⊙ exp(Γ_last − Γ)`.
    pub kg: Array2<T>,
}

impl<T: Scalar> Intra<T> {
    /// Rows `c` (tokens of the chunk).
    pub fn len(&self) -> usize {
        self.g_cumsum.nrows()
    }
    /// Never true for a chunk [`Chunk::intras`] made.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `Γ_last [K]`, the chunk's total log-decay.
    pub fn g_last(&self) -> Array1<T> {
        self.g_cumsum.row(self.len() - 1).to_owned()
    }
    /// `[K, K]` the chunk's transition `Diag(exp Γ_last) − kgᵀ w_wy`.
    pub fn transition(&self) -> Array2<T> {
        Array2::from_diag(&self.g_last().mapv(T::exp)) - self.kg.t().dot(&self.w_wy)
    }
}

/// A piece's chunked forward, FLA's stored and recomputed tensors.
#[derive(Clone, Debug)]
pub struct Intermediates<T> {
    /// Each chunk's state-independent quantities.
    pub intra: Vec<Intra<T>>,
    /// `[NT]` of `[K, V]`: the state entering each chunk (FLA's `h`).
    pub h: Vec<Array2<T>>,
    /// `[L, V]` `u_wy − w_wy h`, chunk by chunk.
    pub v_new: Array2<T>,
    /// `[L, V]`
    pub o: Array2<T>,
    /// `[K, V]`
    pub final_state: Array2<T>,
}

/// `Σ_d a_r[d] c_s[d] exp(Γ_r[d] − Γ_s[d])` for the rows `(r, s)` of a
/// chunk that `keep(r, s)` admits, else 0; `[c, c]`.
fn decayed_products<T: Scalar>(
    a: ArrayView2<T>,
    c: ArrayView2<T>,
    g_cumsum: &Array2<T>,
    keep: impl Fn(usize, usize) -> bool,
) -> Array2<T> {
    let n = g_cumsum.nrows();
    Array2::from_shape_fn((n, n), |(r, s)| {
        if !keep(r, s) {
            return T::zero();
        }
        let (gr, gs) = (g_cumsum.row(r), g_cumsum.row(s));
        (0..gr.len())
            .map(|d| a[[r, d]] * c[[s, d]] * (gr[d] - gs[d]).exp())
            .sum()
    })
}

/// `(I + L)^{-1}` of a strictly lower triangular `l [c, c]`, by forward
/// substitution: row `r` is `e_r − Σ_{s<r} L[r,s] · row s`.
fn unit_lower_inverse<T: Scalar>(l: &Array2<T>) -> Array2<T> {
    let n = l.nrows();
    let mut inv = Array2::<T>::eye(n);
    for r in 1..n {
        let (above, mut below) = inv.view_mut().split_at(Axis(0), r);
        let mut row = below.row_mut(0);
        for s in 0..r {
            row.scaled_add(-l[[r, s]], &above.row(s));
        }
    }
    inv
}

/// `b ⊙ k ⊙ exp Γ` and `w ⊙ v` of `x`'s rows `r0 .. r0 + c`.
fn gated_rows<T: Scalar>(x: &Gdn2Head<T>, r0: usize, g_cumsum: &Array2<T>) -> [Array2<T>; 2] {
    let c = g_cumsum.nrows();
    let rows = s![r0..r0 + c, ..];
    let kbg = &(&x.b.slice(rows) * &x.k.slice(rows)) * &g_cumsum.mapv(T::exp);
    let vw = &x.w.slice(rows) * &x.v.slice(rows);
    [kbg, vw]
}

impl Chunk {
    /// The state-independent quantities of `x`'s chunk of rows `start ..
    /// start + c` (`c ≥ 1`, `start + c ≤ L`).
    pub fn intra<T: Scalar>(&self, x: &Gdn2Head<T>, start: usize, c: usize) -> Intra<T> {
        let rows = s![start..start + c, ..];
        let (q, k, b) = (x.q.slice(rows), x.k.slice(rows), x.b.slice(rows));
        let mut g_cumsum = x.g.slice(rows).to_owned();
        g_cumsum.accumulate_axis_inplace(Axis(0), |&prev, cur| *cur += prev);
        let bk = &b * &k;
        let l = decayed_products(bk.view(), k, &g_cumsum, |r, s| s < r);
        let akk = unit_lower_inverse(&l);
        let aqk = decayed_products(q, k, &g_cumsum, |r, s| s <= r);
        let [kbg, vw] = gated_rows(x, start, &g_cumsum);
        let eg = g_cumsum.mapv(T::exp);
        let g_last = g_cumsum.row(c - 1).to_owned();
        let kg = &k * &(&g_last.insert_axis(Axis(0)) - &g_cumsum).mapv(T::exp);
        Intra {
            start,
            w_wy: akk.dot(&kbg),
            u_wy: akk.dot(&vw),
            qg: &q * &eg,
            kg,
            g_cumsum,
            akk,
            aqk,
        }
    }

    /// Each chunk's [`Intra`] of a piece.
    pub fn intras<T: Scalar>(&self, x: &Gdn2Head<T>) -> Vec<Intra<T>> {
        (0..x.len())
            .step_by(self.chunk_size)
            .map(|start| self.intra(x, start, self.chunk_size.min(x.len() - start)))
            .collect()
    }

    /// The chunked forward of a piece from `S_0 = h0 [K, V]`, with every
    /// intermediate.
    pub fn intermediates<T: Scalar>(&self, x: &Gdn2Head<T>, h0: ArrayView2<T>) -> Intermediates<T> {
        let intra = self.intras(x);
        let (l, vd) = (x.len(), x.v_dim());
        let (mut v_new, mut o) = (Array2::zeros((l, vd)), Array2::zeros((l, vd)));
        let mut h = Vec::with_capacity(intra.len());
        let mut state = h0.to_owned();
        for it in &intra {
            let rows = s![it.start..it.start + it.len(), ..];
            let vn = &it.u_wy - &it.w_wy.dot(&state);
            o.slice_mut(rows)
                .assign(&(&it.qg.dot(&state) + &it.aqk.dot(&vn)));
            let mut next = state.clone();
            scale_rows(&mut next, it.g_last().mapv(T::exp).view());
            next += &it.kg.t().dot(&vn);
            v_new.slice_mut(rows).assign(&vn);
            h.push(std::mem::replace(&mut state, next));
        }
        Intermediates {
            intra,
            h,
            v_new,
            o,
            final_state: state,
        }
    }
}

impl<T: Scalar> Engine<T> for Chunk {
    type Op = Gdn2;

    fn forward(&self, x: &Gdn2Head<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        let f = self.intermediates(x, h0);
        (f.o, f.final_state)
    }

    /// FLA's backward: the `dh` recurrence over chunks in reverse (from
    /// `dht`), each chunk's output, WY and intra backward, then the reverse
    /// cumsum of the decay gradient.
    fn backward(
        &self,
        x: &Gdn2Head<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> Gdn2HeadGrads<T> {
        let f = self.intermediates(x, h0);
        let mut gr = Gdn2HeadGrads::zeros(x.len(), x.k_dim(), x.v_dim());
        let mut dh = dht.to_owned();
        for (it, h) in f.intra.iter().zip(&f.h).rev() {
            dh = chunk_backward(x, it, h, f.v_new.view(), d_o, dh, &mut gr);
        }
        gr.dh0 = dh;
        gr
    }

    /// `M = Π_chunks (Diag(exp Γ_last) − kgᵀ w_wy)`, later chunks on the left.
    fn transition(&self, x: &Gdn2Head<T>) -> Array2<T> {
        self.intras(x)
            .iter()
            .fold(Array2::eye(x.k_dim()), |m, it| it.transition().dot(&m))
    }
}

/// One chunk's backward into `gr`'s rows: from `h` (the state entering it),
/// the piece's `v_new` and `do`, and `dh = ∂L/∂h'` (the state leaving it);
/// returns `∂L/∂h`.
fn chunk_backward<T: Scalar>(
    x: &Gdn2Head<T>,
    it: &Intra<T>,
    h: &Array2<T>,
    v_new: ArrayView2<T>,
    d_o: ArrayView2<T>,
    dh: Array2<T>,
    gr: &mut Gdn2HeadGrads<T>,
) -> Array2<T> {
    let (c, r0) = (it.len(), it.start);
    let rows = s![r0..r0 + c, ..];
    let (v_new, d_o) = (v_new.slice(rows), d_o.slice(rows));
    let (q, k, b) = (x.q.slice(rows), x.k.slice(rows), x.b.slice(rows));
    let (v, w) = (x.v.slice(rows), x.w.slice(rows));
    let g = &it.g_cumsum;
    let g_last = it.g_last();
    let decay_last = g_last.mapv(T::exp);

    // Output: o = qg h + Aqk v_new (FLA's chunk_kda_bwd_dAv for dAqk, dv).
    let daqk = Array2::from_shape_fn((c, c), |(r, s)| {
        if s <= r {
            d_o.row(r).dot(&v_new.row(s))
        } else {
            T::zero()
        }
    });
    let dv_intra = it.aqk.t().dot(&d_o);
    // The dh recurrence (chunk_gated_delta_rule_bwd_dhu): v_new feeds h'
    // through kg and depends on h through w_wy.
    let dv2 = &dv_intra + &it.kg.dot(&dh);
    let dqg = d_o.dot(&h.t());
    let dkg = v_new.dot(&dh.t());
    // ∂L/∂Γ_last from h' = Diag(exp Γ_last) h + …, then ∂L/∂h.
    let mut dg_last = (&dh * h).sum_axis(Axis(1)) * &decay_last;
    let mut dh_prev = it.qg.t().dot(&d_o) - it.w_wy.t().dot(&dv2);
    let mut decayed = dh;
    scale_rows(&mut decayed, decay_last.view());
    dh_prev += &decayed;

    // WY: w_wy = Akk kbg, u_wy = Akk vw, with v_new = u_wy − w_wy h.
    let dw_wy = -dv2.dot(&h.t());
    let du_wy = &dv2;
    let [kbg, vw] = gated_rows(x, r0, g);
    let dakk = dw_wy.dot(&kbg.t()) + du_wy.dot(&vw.t());
    let dkbg = it.akk.t().dot(&dw_wy);
    let dvw = it.akk.t().dot(du_wy);
    // Akk = (I + L)^{-1}: dL = −Akkᵀ dAkk Akkᵀ, strictly lower.
    let mut dl = -it.akk.t().dot(&dakk).dot(&it.akk.t());
    dl.indexed_iter_mut()
        .filter(|((r, s), _)| s >= r)
        .for_each(|(_, e)| *e = T::zero());

    // To the chunk's tokens: qg = q ⊙ exp Γ, kbg = b ⊙ k ⊙ exp Γ,
    // kg = k ⊙ exp(Γ_last − Γ), and the pairwise products of Aqk and L.
    let eg = g.mapv(T::exp);
    let e_tail = (&g_last.view().insert_axis(Axis(0)) - g).mapv(T::exp);
    let mut dq = &dqg * &eg;
    let mut dk = &(&dkbg * &b) * &eg + &dkg * &e_tail;
    let mut db = &(&dkbg * &k) * &eg;
    let mut dgam = &dqg * &it.qg + &dkbg * &kbg - &dkg * &it.kg;
    dg_last += &(&dkg * &it.kg).sum_axis(Axis(0));
    let kd = k.ncols();
    for r in 0..c {
        for s in 0..=r {
            let (a_qk, a_l) = (daqk[[r, s]], if s < r { dl[[r, s]] } else { T::zero() });
            for d in 0..kd {
                let e = (g[[r, d]] - g[[s, d]]).exp();
                let ks = k[[s, d]] * e;
                // Aqk[r,s] = Σ_d q_r k_s e, L[r,s] = Σ_d b_r k_r k_s e.
                let t_qk = a_qk * q[[r, d]] * ks;
                let t_l = a_l * b[[r, d]] * k[[r, d]] * ks;
                dq[[r, d]] += a_qk * ks;
                dk[[s, d]] += (a_qk * q[[r, d]] + a_l * b[[r, d]] * k[[r, d]]) * e;
                dk[[r, d]] += a_l * b[[r, d]] * ks;
                db[[r, d]] += a_l * k[[r, d]] * ks;
                dgam[[r, d]] += t_qk + t_l;
                dgam[[s, d]] -= t_qk + t_l;
            }
        }
    }
    // Γ_last is Γ's last row; Γ_r = Σ_{i≤r} g_i, so dg is dΓ's reverse cumsum.
    let mut last = dgam.row_mut(c - 1);
    last += &dg_last;
    dgam.invert_axis(Axis(0));
    dgam.accumulate_axis_inplace(Axis(0), |&prev, cur| *cur += prev);
    dgam.invert_axis(Axis(0));

    gr.dq.slice_mut(rows).assign(&dq);
    gr.dk.slice_mut(rows).assign(&dk);
    gr.db.slice_mut(rows).assign(&db);
    gr.dg.slice_mut(rows).assign(&dgam);
    gr.dv.slice_mut(rows).assign(&(&dvw * &w));
    gr.dw.slice_mut(rows).assign(&(&dvw * &v));
    dh_prev
}
