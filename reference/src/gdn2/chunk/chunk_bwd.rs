//! The backward of one chunk, FLA's `chunk_gdn2_bwd` (`gdn2/chunk_bwd.py`):
//! output (`chunk_o.rs`), the `dh` recurrence (`chunk_delta_h.rs`), WY
//! (`wy_fast.rs`) and the fused token gradients of
//! `chunk_gdn2_bwd_kernel_wy_dqkg_fused`, the intra backward
//! (`chunk_intra.rs`), then the reverse cumsum of `dΓ`.

use ndarray::{s, Array2, ArrayView2, Axis};

use super::chunk_intra::Intra;
use super::Chunk;
use crate::gdn2::{Gdn2Head, Gdn2HeadGrads};
use crate::scalar::Scalar;

impl Chunk {
    /// One chunk's backward into `gr`'s rows: from `h` (the state entering
    /// it, as stored), the piece's `v_new` and `do`, and `dh = ∂L/∂h'` (the
    /// state leaving it, the fp32 carry); returns `∂L/∂h`. The roundings
    /// are FLA's stored backward tensors and operands (the module's table).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn chunk_backward<T: Scalar>(
        &self,
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
        let decay_last = g_last.mapv(|x| self.policy.exp(x));

        // Output: o = qg h + Aqk v_new.
        let (daqk, dv_intra) = self.bwd_dav(it, d_o, v_new);
        // The dh recurrence.
        let [dh_used, dv2, dh_prev] = self.bwd_dhu_step(it, d_o, &dv_intra, dh, &decay_last);
        let dqg = d_o.dot(&h.t());
        let dkg = v_new.dot(&dh_used.t());
        // ∂L/∂Γ_last from h' = Diag(exp Γ_last) h + ….
        let mut dg_last = (&dh_used * h).sum_axis(Axis(1)) * &decay_last;

        // WY: w_wy = Akk kbg, u_wy = Akk vw, with v_new = u_wy − w_wy h.
        let eg = self.exps(g);
        let wy = self.wy_backward(it, [k, b, v, w], &eg, h, &dv2);
        let (kbg, dkbg) = (&wy.kbg, &wy.dkbg);

        // To the chunk's tokens: qg = q ⊙ exp Γ, kbg = b ⊙ k ⊙ exp Γ,
        // kg = k ⊙ exp(Γ_last − Γ), and the pairwise products of Aqk and L.
        let e_tail = self.exps(&(&g_last.view().insert_axis(Axis(0)) - g));
        let mut dq = &dqg * &eg;
        let mut dk = &(dkbg * &b) * &eg + &dkg * &e_tail;
        let mut db = &(dkbg * &k) * &eg;
        let mut dgam = &dqg * &it.qg + dkbg * kbg - &dkg * &it.kg;
        dg_last += &(&dkg * &it.kg).sum_axis(Axis(0));
        self.intra_backward(
            it,
            [q, k, b],
            &daqk,
            &wy.dl,
            [&mut dq, &mut dk, &mut db, &mut dgam],
        );
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
        gr.dv.slice_mut(rows).assign(&(&wy.dvw * &w));
        gr.dw.slice_mut(rows).assign(&(&wy.dvw * &v));
        dh_prev
    }
}
