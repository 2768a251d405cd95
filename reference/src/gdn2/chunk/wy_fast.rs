//! The WY representation, FLA's `gdn2/wy_fast.py`: forward
//! (`recompute_w_u_fwd_gdn2`) `w_wy = Akk (b ⊙ k ⊙ exp Γ)`,
//! `u_wy = Akk (w ⊙ v)` and the gated `qg`, `kg` of one chunk; backward
//! what `dw_wy`, `du_wy` send to `Akk`'s operands and through
//! `Akk = (I + L)^{-1}` to `L` (in `chunk_gdn2_bwd_kernel_wy_dqkg_fused`).

use ndarray::{s, Array2, ArrayView2, Axis};

use super::chunk_intra::Intra;
use super::Chunk;
use crate::gdn2::Gdn2Head;
use crate::precision::Stage;
use crate::scalar::Scalar;

/// What one chunk's WY backward sends on, rows the chunk's tokens.
pub(super) struct WyGrads<T> {
    /// `b ⊙ k ⊙ exp Γ` as the backward's operand, `[c, K]`.
    pub kbg: Array2<T>,
    /// `∂/∂(b ⊙ k ⊙ exp Γ) = Akkᵀ dw_wy`, `[c, K]`.
    pub dkbg: Array2<T>,
    /// `∂/∂(w ⊙ v) = Akkᵀ du_wy`, `[c, V]`.
    pub dvw: Array2<T>,
    /// `∂/∂L`, strictly lower, zeros elsewhere, `[c, c]`.
    pub dl: Array2<T>,
}

impl Chunk {
    /// FLA's `recompute_w_u_fwd_gdn2` for `x`'s chunk of rows `start ..
    /// start + c` (`akk` `[c, c]` its stored inverse, `g_cumsum` `[c, K]`):
    /// `[w_wy, u_wy, qg, kg]` = `Akk (b ⊙ k ⊙ exp Γ)` `[c, K]`,
    /// `Akk (w ⊙ v)` `[c, V]`, `q ⊙ exp Γ` and `k ⊙ exp(Γ_last − Γ)`
    /// `[c, K]`, each stored as the policy says.
    pub(super) fn recompute_w_u<T: Scalar>(
        &self,
        x: &Gdn2Head<T>,
        start: usize,
        akk: &Array2<T>,
        g_cumsum: &Array2<T>,
    ) -> [Array2<T>; 4] {
        let p = &self.policy;
        let c = g_cumsum.nrows();
        let rows = s![start..start + c, ..];
        let (q, k, b) = (x.q.slice(rows), x.k.slice(rows), x.b.slice(rows));
        let eg = self.exps(g_cumsum);
        // `b_k * b_b` (two input-dtype tensors), times `2^Γ` in fp32, cast
        // for the dot; `(v w)` cast likewise.
        let mut kbg = &b * &k;
        p.round(Stage::KBeta, &mut kbg);
        kbg *= &eg;
        p.round(Stage::W, &mut kbg);
        let mut vw = &x.w.slice(rows) * &x.v.slice(rows);
        p.round(Stage::U, &mut vw);
        let (mut w_wy, mut u_wy) = (akk.dot(&kbg), akk.dot(&vw));
        p.round(Stage::W, &mut w_wy);
        p.round(Stage::U, &mut u_wy);
        let g_last = g_cumsum.row(c - 1).to_owned();
        let mut kg = &k * &self.exps(&(&g_last.insert_axis(Axis(0)) - g_cumsum));
        let mut qg = &q * &eg;
        p.round(Stage::Gated, &mut qg);
        p.round(Stage::Gated, &mut kg);
        [w_wy, u_wy, qg, kg]
    }

    /// The WY backward of chunk `it`: with `v_new = u_wy − w_wy h` (`h`
    /// `[K, V]` the state entering it, as stored) and `dv2 = ∂L/∂v_new`
    /// `[c, V]`, `dw_wy = −dv2 hᵀ` and `du_wy = dv2` go back through
    /// `w_wy = Akk kbg`, `u_wy = Akk (v ⊙ w)` (`k`, `b` `[c, K]`, `v`, `w`
    /// `[c, V]` the chunk's rows, `eg = exp Γ` `[c, K]`) and
    /// `Akk = (I + L)^{-1}`.
    pub(super) fn wy_backward<T: Scalar>(
        &self,
        it: &Intra<T>,
        [k, b, v, w]: [ArrayView2<T>; 4],
        eg: &Array2<T>,
        h: &Array2<T>,
        dv2: &Array2<T>,
    ) -> WyGrads<T> {
        let dw_wy = self.operand(-dv2.dot(&h.t()));
        let du_wy = dv2;
        let kbg = self.operand(&(&k * eg) * &b);
        let vw = self.operand(&v * &w);
        let dakk = self.operand(dw_wy.dot(&kbg.t()) + du_wy.dot(&vw.t()));
        let dkbg = it.akk.t().dot(&dw_wy);
        let dvw = it.akk.t().dot(du_wy);
        // Akk = (I + L)^{-1}: dL = −Akkᵀ dAkk Akkᵀ, strictly lower (FLA casts
        // the inner product to the operand dtype between the two).
        let mut dl = -self.operand(it.akk.t().dot(&dakk)).dot(&it.akk.t());
        dl.indexed_iter_mut()
            .filter(|((r, s), _)| s >= r)
            .for_each(|(_, e)| *e = T::zero());
        WyGrads { kbg, dkbg, dvw, dl }
    }
}
