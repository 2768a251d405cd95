//! The intra-chunk stage, FLA's `kda/chunk_intra.py`: Γ (the in-chunk
//! cumsum of `g`), `Aqk`, `Akk = (I + L)^{-1} Diag(β)` per chunk
//! (`chunk_kda_fwd_intra`), and their backward into `q`, `k`, Γ
//! (`chunk_kda_bwd_intra`).

use ndarray::{s, Array1, Array2, ArrayView1, ArrayView2, CowArray, Ix2};

use super::decays::{DecayBlock, Decays};
use super::{qk_rows, Chunk};
use crate::fast::fused;
use crate::fast::gemm;
use crate::fast::par::par_chunks;
use crate::fast::tri;
use crate::fast::views;
use crate::kda::KdaHead;
use crate::precision::Stage;
use crate::scalar::Scalar;

/// One chunk's state-independent quantities (rows = the chunk's tokens).
#[derive(Clone, Debug)]
pub struct Intra<T> {
    /// First token of the chunk inside its head.
    pub start: usize,
    /// Γ: in-chunk cumulative log-decay, `[c, K]`.
    pub g_cumsum: Array2<T>,
    /// `(I + L)^{-1}` (unit lower triangular), `[c, c]`.
    pub n_inv: Array2<T>,
    /// `Akk = (I + L)^{-1} Diag(β)`, `[c, c]`.
    pub akk: Array2<T>,
    /// `Aqk[r, s] = Σ q_r k_s exp(Γ_r − Γ_s)`, `s ≤ r`, `[c, c]`.
    pub aqk: Array2<T>,
    /// `Σ k_r k_s exp(Γ_r − Γ_s)`, `s < r` (L without β), `[c, c]`.
    pub p: Array2<T>,
    /// `w = Akk (exp(Γ) ⊙ K)`, `[c, K]`.
    pub w: Array2<T>,
    /// `u = Akk V`, `[c, V]`.
    pub u: Array2<T>,
    /// `Q ⊙ exp(Γ)`, `[c, K]`.
    pub qg: Array2<T>,
    /// `K ⊙ exp(Γ_last − Γ)`, `[c, K]`.
    pub kg: Array2<T>,
    /// How the chunk forms its pairwise decays and exponentials.
    pub(super) decays: Decays<T>,
    /// `exp(Γ_last)`, `[K]`: read by the state passes and the backward.
    pub(super) decay_last: Array1<T>,
}

impl<T: Scalar> Intra<T> {
    pub fn len(&self) -> usize {
        self.g_cumsum.nrows()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `exp(Γ_last)`, `[K]` (formed once, in the intra stage).
    pub fn decay_last(&self) -> &Array1<T> {
        &self.decay_last
    }

    /// `M_chunk = Diag(exp Γ_last) − kgᵀ w`, `[K, K]`.
    pub fn transition(&self) -> Array2<T> {
        let mut m = -gemm::dot(self.kg.t(), self.w.view());
        for (d, e) in self.decay_last().iter().enumerate() {
            m[[d, d]] += *e;
        }
        m
    }
}

impl Chunk {
    /// [`Chunk::pair_products`] block by block: each block's products
    /// through its factors.
    fn block_products<T: Scalar>(
        blocks: &[DecayBlock<T>],
        q: ArrayView2<T>,
        k: ArrayView2<T>,
    ) -> (Array2<T>, Array2<T>) {
        let c = q.nrows();
        let (mut aqk, mut p) = (Array2::zeros((c, c)), Array2::zeros((c, c)));
        for b in blocks {
            let (r, cols) = (s![b.rows.clone(), ..], s![b.cols.clone(), ..]);
            let [qe, ke, km] = fused::products([
                (q.slice(r), b.row.view()),
                (k.slice(r), b.row.view()),
                (k.slice(cols), b.col.view()),
            ]);
            let at = s![b.rows.clone(), b.cols.clone()];
            if b.diagonal() {
                let [a, pp] = tri::dot_t_lower_each([qe.view(), ke.view()], km.view(), false);
                aqk.slice_mut(at).assign(&a);
                p.slice_mut(at).assign(&pp);
            } else {
                gemm::dot_to(qe.view(), km.t(), aqk.slice_mut(at));
                gemm::dot_to(ke.view(), km.t(), p.slice_mut(at));
            }
        }
        (aqk, p)
    }

    /// `Σ_d q_r k_s exp(Γ_r − Γ_s)` and `Σ_d k_r k_s exp(Γ_r − Γ_s)` for
    /// `s ≤ r`, each decay formed from its difference (any range).
    fn pair_products<T: Scalar>(
        &self,
        g: &Array2<T>,
        q: ArrayView2<T>,
        k: ArrayView2<T>,
    ) -> (Array2<T>, Array2<T>) {
        let c = g.nrows();
        let (mut aqk, mut p) = (Array2::zeros((c, c)), Array2::zeros((c, c)));
        for r in 0..c {
            for s in 0..=r {
                let (mut a, mut b) = (T::zero(), T::zero());
                for d in 0..k.ncols() {
                    let e = self.pair_decay(g, r, s, d);
                    a += q[[r, d]] * k[[s, d]] * e;
                    b += k[[r, d]] * k[[s, d]] * e;
                }
                aqk[[r, s]] = a;
                p[[r, s]] = b;
            }
        }
        (aqk, p)
    }

    /// [`Chunk::pair_products`] in the structure of FLA's forward intra
    /// kernels: a pair in different 16-token sub-chunks is a `tl.dot` of
    /// `q_r·e^(Γ_r − Γ_n)` and `k_s·e^(Γ_n − Γ_s)` (`n` the first row of
    /// `r`'s sub-chunk) with both operands rounded to `st`; a pair inside one
    /// sub-chunk is element-wise fp32, or with safe_gate a `tl.dot` through
    /// the sub-chunk's anchor (the midpoint, as [`Chunk::pair_decay`]).
    fn pair_products_subchunks<T: Scalar>(
        &self,
        st: crate::precision::Store,
        g: &Array2<T>,
        q: ArrayView2<T>,
        k: ArrayView2<T>,
    ) -> (Array2<T>, Array2<T>) {
        const BC: usize = 16;
        let c = g.nrows();
        let e = |x: T| self.policy.exp(x);
        let (mut aqk, mut p) = (Array2::zeros((c, c)), Array2::zeros((c, c)));
        for r in 0..c {
            for s in 0..=r {
                let same = s / BC == r / BC;
                let anchor = match (same, self.policy.safe_gate_midpoint) {
                    (false, _) => (r / BC) * BC,
                    (true, true) => ((r / BC) * BC + 8).min(c - 1),
                    (true, false) => {
                        for d in 0..k.ncols() {
                            let ee = self.pair_decay(g, r, s, d);
                            aqk[[r, s]] += q[[r, d]] * k[[s, d]] * ee;
                            p[[r, s]] += k[[r, d]] * k[[s, d]] * ee;
                        }
                        continue;
                    }
                };
                for d in 0..k.ncols() {
                    let row = e(g[[r, d]] - g[[anchor, d]]);
                    let col = st.round(k[[s, d]] * e(g[[anchor, d]] - g[[s, d]]));
                    aqk[[r, s]] += st.round(q[[r, d]] * row) * col;
                    p[[r, s]] += st.round(k[[r, d]] * row) * col;
                }
            }
        }
        (aqk, p)
    }

    /// The intra-chunk stage for tokens `start..start + c` of `x`.
    pub(crate) fn intra<T: Scalar>(&self, x: &KdaHead<T>, start: usize, c: usize) -> Intra<T> {
        let rows = s![start..start + c, ..];
        let [q, k] = qk_rows(x, start..start + c);
        let (q, k, v) = (q.view(), k.view(), x.v.slice(rows));
        let beta = x.beta.slice(s![start..start + c]);
        let mut g_cumsum = views::standard(x.g.slice(rows)).into_owned();
        self.policy.cumsum_rows(&mut g_cumsum);
        let factors = self.factors(&g_cumsum);
        let blocks = factors
            .is_none()
            .then(|| self.decay_blocks(&g_cumsum))
            .flatten();
        let fwd_dots = self.policy.store(Stage::FwdDots);
        let (mut aqk, mut p) = match factors.as_ref().filter(|_| fwd_dots.is_none()) {
            Some((ep, em)) => {
                // exp(Γ_r − Γ_s) = exp(Γ_r − Γ_m)·exp(Γ_m − Γ_s): two matrix
                // products, of which only the lower triangles are used.
                let [qe, ke, km] =
                    fused::products([(q, ep.view()), (k, ep.view()), (k, em.view())]);
                let [aqk, p] = tri::dot_t_lower_each([qe.view(), ke.view()], km.view(), false);
                (aqk, p)
            }
            None => match (fwd_dots, &blocks) {
                (Some(st), _) => self.pair_products_subchunks(st, &g_cumsum, q, k),
                (None, Some(blocks)) => Self::block_products(blocks, q, k),
                (None, None) => self.pair_products(&g_cumsum, q, k),
            },
        };
        tri::mask_lower(&mut aqk, true);
        tri::mask_lower(&mut p, false);
        // (I + L)^{-1}, L[r, s] = β_r p[r, s].
        // FLA stores the inverse `(I + L)^{-1}` (its `Akk`) and applies β
        // when it forms w and u: the stage rounds the inverse.
        let mut n_inv = crate::fast::tri::unit_lower_inverse(c, |r, s| -(beta[r] * p[[r, s]]));
        self.policy.round(Stage::Akk, &mut n_inv);
        let beta_v = beta.to_vec();
        let akk = fused::scale_columns(&n_inv, &beta_v);
        self.policy.round(Stage::Aqk, &mut aqk);
        let decays = match (self.mid_exps(&g_cumsum, factors.as_ref()), factors) {
            (Some(mid), Some(factors)) => Decays::Mid { factors, mid },
            (None, Some(factors)) => Decays::Factored {
                factors,
                exps: self.direct_exps(&g_cumsum),
            },
            (_, None) => {
                let exps = self.direct_exps(&g_cumsum);
                match blocks {
                    Some(blocks) => Decays::Blocks { blocks, exps },
                    None => Decays::Pairs { exps },
                }
            }
        };
        let [w, u, qg, kg] = self.recompute_w_u(&decays, (&n_inv, &akk), beta, [q, k, v]);
        Intra {
            start,
            decay_last: fused::exps_of_last_row(&g_cumsum),
            g_cumsum,
            n_inv,
            akk,
            aqk,
            p,
            w,
            u,
            qg,
            kg,
            decays,
        }
    }

    /// All chunks' intra stages of one head.
    pub fn intras<T: Scalar>(&self, x: &KdaHead<T>) -> Vec<Intra<T>> {
        // Independent per chunk: in parallel, collected in chunk order.
        par_chunks(x.len().div_ceil(self.chunk_size), |n| self.intra_of(x, n))
    }

    /// Chunk `n`'s intra stage.
    pub(super) fn intra_of<T: Scalar>(&self, x: &KdaHead<T>, n: usize) -> Intra<T> {
        let start = n * self.chunk_size;
        self.intra(x, start, self.chunk_size.min(x.len() - start))
    }

    /// `k` with the rounding of `k_r·β_r` folded in (`round(k·β)/β`; `k`
    /// itself, not copied, without a [`Stage::KBetaBwd`] storage): the column side of FLA's
    /// `chunk_kda_bwd_kernel_intra` multiplies `dAkk` by `b_k * b_b`, the
    /// product of two bf16 tensors, so `∂/∂k_s` reads every later row's
    /// `k·β` rounded (between sub-chunks, and inside one with safe_gate).
    pub(super) fn k_beta_col<'a, T: Scalar>(
        &self,
        k: ArrayView2<'a, T>,
        beta: ArrayView1<T>,
    ) -> CowArray<'a, T, Ix2> {
        let Some(st) = self.policy.store(Stage::KBetaBwd) else {
            return k.into();
        };
        Array2::from_shape_fn(k.raw_dim(), |(r, d)| match beta[r] {
            b if b == T::zero() => k[[r, d]],
            b => st.round(k[[r, d]] * b) / b,
        })
        .into()
    }

    /// Through `Aqk[r,s] = Σ q_r k_s E_rs` and `p[r,s] = Σ k_r k_s E_rs` with
    /// `E_rs = exp(Γ_r − Γ_s)`: gradients of q, k and Γ. `k_col` is `k` as
    /// the `∂/∂k_s` side reads row `r`'s key ([`Chunk::k_beta_col`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn intra_backward<T: Scalar>(
        &self,
        ch: &Intra<T>,
        q: ArrayView2<T>,
        k: ArrayView2<T>,
        k_col: ArrayView2<T>,
        daqk: &Array2<T>,
        dp: &Array2<T>,
        dq: &mut Array2<T>,
        dk: &mut Array2<T>,
        dgamma: &mut Array2<T>,
    ) {
        if let Some(st) = self.policy.store(Stage::IntraDots) {
            return self.intra_backward_subchunks(st, ch, q, k, k_col, daqk, dp, dq, dk, dgamma);
        }
        let flats = [dq, dk, dgamma].map(fused::flat_mut);
        if let Some((ep, em)) = ch.decays.factors() {
            let ops = [q, k, k_col];
            return self.diagonal_backward(
                (ep.view(), em.view()),
                ops,
                daqk.view(),
                dp.view(),
                flats,
            );
        }
        if let Decays::Blocks { blocks, .. } = &ch.decays {
            let [dq, dk, dgamma] = flats;
            let kd = k.ncols();
            for b in blocks {
                let r = s![b.rows.clone(), ..];
                let at = s![b.rows.clone(), b.cols.clone()];
                let (dq, dk, dgamma) = (&mut *dq, &mut *dk, &mut *dgamma);
                if b.diagonal() {
                    let rows = b.rows.start * kd..b.rows.end * kd;
                    self.diagonal_backward(
                        (b.row.view(), b.col.view()),
                        [q.slice(r), k.slice(r), k_col.slice(r)],
                        daqk.slice(at),
                        dp.slice(at),
                        [dq, dk, dgamma].map(|x| &mut x[rows.clone()]),
                    );
                } else {
                    self.below_backward(
                        b,
                        [q, k, k_col],
                        daqk.slice(at),
                        dp.slice(at),
                        [dq, dk, dgamma],
                    );
                }
            }
            return;
        }
        let [dq, dk, dgamma] = flats;
        let (c, kd) = (ch.len(), k.ncols());
        for r in 0..c {
            for s in 0..=r {
                let (a, p) = (daqk[[r, s]], dp[[r, s]]);
                if a == T::zero() && p == T::zero() {
                    continue;
                }
                for d in 0..kd {
                    let e = self.pair_decay(&ch.g_cumsum, r, s, d);
                    let ks = k[[s, d]];
                    let aq = a * q[[r, d]];
                    let (coef, coef_col) = (aq + p * k[[r, d]], aq + p * k_col[[r, d]]);
                    let (r, s) = (r * kd + d, s * kd + d);
                    dq[r] += a * ks * e;
                    dk[r] += p * ks * e;
                    dk[s] += coef_col * e;
                    dgamma[r] += coef * ks * e;
                    dgamma[s] -= coef_col * ks * e;
                }
            }
        }
    }

    /// What `dAqk` and `dp` of a block of pairs send its factored operands,
    /// `[da, dc, db]`, then the operands `[a, b, cc]`: with the block's
    /// factors `(row, col)`, `A = Q⊙row` and `C = K⊙row` on its rows (`q`,
    /// `k`, `k_col` those rows; `C` from `k_col` under [`Stage::KBetaBwd`],
    /// as the `∂/∂k_s` side reads it) and `B = K⊙col` on its columns
    /// (`k_cols`), so that `Aqk = A Bᵀ` and `p = C Bᵀ` on the block. The
    /// anchor cancels in every product, so it is held constant. The
    /// products are [`crate::fast::decay_blocks::grad_products`].
    fn factored_grads<T: Scalar>(
        &self,
        (row, col): (ArrayView2<T>, ArrayView2<T>),
        [q, k, k_col]: [ArrayView2<T>; 3],
        k_cols: ArrayView2<T>,
        [daqk, dp]: [ArrayView2<T>; 2],
        diagonal: bool,
    ) -> [Array2<T>; 6] {
        let (dot, _, t_dot, t_dot_add) = crate::fast::decay_blocks::grad_products(diagonal);
        let [a, b, cc] = fused::products([(q, row), (k_cols, col), (k, row)]);
        let cc = match self.policy.storage(Stage::KBetaBwd) {
            Some(_) => &k_col * &row,
            None => cc,
        };
        let (da, dc) = (dot(daqk, b.view()), dot(dp, b.view()));
        let mut db = t_dot(daqk, a.view());
        t_dot_add(dp, cc.view(), db.view_mut());
        [da, dc, db, a, b, cc]
    }

    /// [`Chunk::intra_backward`] for rows whose pairs go through the
    /// factors `(ep, em) = (exp(Γ − Γ_m), exp(Γ_m − Γ))` of one middle row
    /// (`[n, K]` each; the whole chunk's, or a diagonal block's): `q`, `k`,
    /// `k_col` and `dq`, `dk`, `dΓ` (row-major, added to) those rows, `dAqk`
    /// and `dp` `[n, n]` their pairs.
    fn diagonal_backward<T: Scalar>(
        &self,
        (ep, em): (ArrayView2<T>, ArrayView2<T>),
        [q, k, k_col]: [ArrayView2<T>; 3],
        daqk: ArrayView2<T>,
        dp: ArrayView2<T>,
        [dq_, dk_, dg_]: [&mut [T]; 3],
    ) {
        let grads = self.factored_grads((ep, em), [q, k, k_col], k, [daqk, dp], true);
        let flats = grads.each_ref().map(|x| fused::flat(x.view()));
        let factors = [ep, em].map(fused::flat);
        let n = grads[0].len();
        let [da_, dc_, db_, a_, b_, cc_] = flats.each_ref().map(|x| &x[..n]);
        let [ep_, em_] = factors.each_ref().map(|x| &x[..n]);
        let (dq_, dk_, dg_) = (&mut dq_[..n], &mut dk_[..n], &mut dg_[..n]);
        crate::fast::simd::dispatch(
            #[inline(always)]
            || {
                for i in 0..n {
                    dq_[i] += da_[i] * ep_[i];
                    dk_[i] += dc_[i] * ep_[i] + db_[i] * em_[i];
                    dg_[i] += da_[i] * a_[i] + dc_[i] * cc_[i] - db_[i] * b_[i];
                }
            },
        );
    }

    /// [`Chunk::intra_backward`] for the pairs of a block below the
    /// diagonal, `b.rows` against `b.cols` through `b`'s factors: `q`, `k`,
    /// `k_col` and `dq`, `dk`, `dΓ` (row-major, added to) the chunk's,
    /// `dAqk` and `dp` the block's `[|rows|, |cols|]`.
    fn below_backward<T: Scalar>(
        &self,
        b: &DecayBlock<T>,
        [q, k, k_col]: [ArrayView2<T>; 3],
        daqk: ArrayView2<T>,
        dp: ArrayView2<T>,
        [dq, dk, dg]: [&mut [T]; 3],
    ) {
        let (r, cols) = (s![b.rows.clone(), ..], s![b.cols.clone(), ..]);
        let rows_of = [q.slice(r), k.slice(r), k_col.slice(r)];
        let factors = (b.row.view(), b.col.view());
        let grads = self.factored_grads(factors, rows_of, k.slice(cols), [daqk, dp], false);
        let [da, dc, db, a, bm, cc] = grads.each_ref().map(|x| fused::flat(x.view()));
        let [row, col] = [&b.row, &b.col].map(|x| fused::flat(x.view()));
        let kd = k.ncols();
        let (rows, cols) = (
            b.rows.start * kd..b.rows.end * kd,
            b.cols.start * kd..b.cols.end * kd,
        );
        for (i, j) in rows.enumerate() {
            dq[j] += da[i] * row[i];
            dk[j] += dc[i] * row[i];
            dg[j] += da[i] * a[i] + dc[i] * cc[i];
        }
        for (i, j) in cols.enumerate() {
            dk[j] += db[i] * col[i];
            dg[j] -= db[i] * bm[i];
        }
    }

    /// [`Chunk::intra_backward`] in the structure of FLA's
    /// `chunk_kda_bwd_kernel_intra`: a pair `s < r` in different 16-token
    /// sub-chunks goes through a `tl.dot` whose fp32 operands (`dAqk`,
    /// `dAkk`, and the other side's q/k gated to the sub-chunk boundary) are
    /// rounded to `st`; a pair inside one sub-chunk is element-wise fp32.
    #[allow(clippy::too_many_arguments)]
    fn intra_backward_subchunks<T: Scalar>(
        &self,
        st: crate::precision::Store,
        ch: &Intra<T>,
        q: ArrayView2<T>,
        k: ArrayView2<T>,
        k_col: ArrayView2<T>,
        daqk: &Array2<T>,
        dp: &Array2<T>,
        dq: &mut Array2<T>,
        dk: &mut Array2<T>,
        dgamma: &mut Array2<T>,
    ) {
        const BC: usize = 16;
        // Inside a sub-chunk only the safe-gate `tl.dot` reads the rounded
        // `k·β`; the element-wise path multiplies fp32 `k` by β.
        let k_diag = if self.policy.safe_gate_midpoint {
            k_col
        } else {
            k
        };
        let (c, kd, g) = (ch.len(), k.ncols(), &ch.g_cumsum);
        let e = |x: T| self.policy.exp(x);
        for r in 0..c {
            // Row side (dq, dk of r): anchored at the first row of r's sub-chunk.
            let first = (r / BC) * BC;
            // Column side (dk of s): anchored at the last row of s's sub-chunk.
            for s in 0..=r {
                let (a, p) = (daqk[[r, s]], dp[[r, s]]);
                if a == T::zero() && p == T::zero() {
                    continue;
                }
                if s / BC == r / BC {
                    for d in 0..kd {
                        let ee = self.pair_decay(g, r, s, d);
                        let aq = a * q[[r, d]];
                        let (coef, coef_col) = (aq + p * k[[r, d]], aq + p * k_diag[[r, d]]);
                        dq[[r, d]] += a * k[[s, d]] * ee;
                        dk[[r, d]] += p * k[[s, d]] * ee;
                        dk[[s, d]] += coef_col * ee;
                        dgamma[[r, d]] += coef * k[[s, d]] * ee;
                        dgamma[[s, d]] -= coef_col * k[[s, d]] * ee;
                    }
                    continue;
                }
                let last = ((s / BC + 1) * BC).min(c) - 1;
                let (ar, pr) = (st.round(a), st.round(p));
                for d in 0..kd {
                    let kg_s = st.round(k[[s, d]] * e(g[[first, d]] - g[[s, d]]));
                    let e_r = e(g[[r, d]] - g[[first, d]]);
                    let (row_q, row_k) = (ar * kg_s * e_r, pr * kg_s * e_r);
                    dq[[r, d]] += row_q;
                    dk[[r, d]] += row_k;
                    dgamma[[r, d]] += q[[r, d]] * row_q + k[[r, d]] * row_k;
                    let qg_r = st.round(q[[r, d]] * e(g[[r, d]] - g[[last, d]]));
                    let kg_r = st.round(k_col[[r, d]] * e(g[[r, d]] - g[[last, d]]));
                    let col = (ar * qg_r + pr * kg_r) * e(g[[last, d]] - g[[s, d]]);
                    dk[[s, d]] += col;
                    dgamma[[s, d]] -= k[[s, d]] * col;
                }
            }
        }
    }
}
