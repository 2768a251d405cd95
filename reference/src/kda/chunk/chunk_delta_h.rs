//! The state pass, FLA's `common/chunk_delta_h.py`: forward
//! (`chunk_gated_delta_rule_fwd_h`) the state entering each chunk `h` and
//! `v_new = u − w h`, carried by `h' = Diag(exp Γ_last) h + kgᵀ v_new`;
//! backward (`chunk_gated_delta_rule_bwd_dhu`) `dv` and the state gradient
//! carried back over the chunks.

use ndarray::{s, Array2, ArrayView2};

use super::chunk_intra::Intra;
use super::Chunk;
use crate::fast::columns::StateRows;
use crate::fast::fused;
use crate::fast::gemm;
use crate::fast::tri;
use crate::precision::Stage;
use crate::scalar::Scalar;

impl Chunk {
    /// One chunk's forward state step over the value columns `cols`
    /// ([`crate::fast::par::par_columns`]): pushes the state entering it as
    /// stored, `v_new` and (with `read_out`) `o` to `out`, and carries
    /// `state` (`[K, w]`, those columns) over the chunk.
    pub(super) fn state_step<T: Scalar>(
        &self,
        ch: &Intra<T>,
        state: &mut Array2<T>,
        out: &mut StateRows<T>,
        cols: std::ops::Range<usize>,
        read_out: bool,
    ) {
        // The state as stored, a copy only where it is rounded.
        let hn = self.policy.stored(Stage::H, state.view());
        let hn = hn.view();
        // v_new = u − w h and, with the readout, qg h: one product.
        let c = ch.len();
        let wh = if read_out {
            tri::stacked_dot(&[ch.w.view(), ch.qg.view()], hn)
        } else {
            gemm::dot(ch.w.view(), hn.view())
        };
        let u = ch.u.slice(s![.., cols]);
        let mut vn = fused::zip_map(u, wh.slice(s![..c, ..]), |u, x| u - x);
        self.policy.round(Stage::VNew, &mut vn);
        if read_out {
            out.push_o(Self::output(ch, vn.view(), wh.slice(s![c.., ..])).view());
        }
        out.push(hn, vn.view());
        fused::decay_add(state, ch.decay_last(), &[&gemm::dot(ch.kg.t(), vn.view())]);
    }

    /// The state pass of one chunk's backward given `ds_used = ∂L/∂(state at
    /// its end)` as stored, for `w` value columns (`do` `[L, w]`, `ds_used`
    /// `[K, w]`): returns `dv_new [c, w]` and takes the carried `ds` `[K, w]`
    /// back to the chunk's start, `ds e^Γlast + qgᵀ dO − wᵀ dv_new` (decayed
    /// carry plus the chunk's own reads of the state).
    pub(super) fn state_backward<T: Scalar>(
        &self,
        ch: &Intra<T>,
        d_o: ArrayView2<T>,
        ds_used: ArrayView2<T>,
        ds: &mut Array2<T>,
    ) -> Array2<T> {
        let dout = d_o.slice(s![ch.start..ch.start + ch.len(), ..]);
        // S' = Diag(e^Γlast) h + kgᵀ v_new, O = qg h + Aqk v_new.
        let mut dvn = self.aqk_t_do(ch, dout);
        fused::add_assign(&mut dvn, gemm::dot(ch.kg.view(), ds_used.view()).view());
        self.policy.round(Stage::Dv, &mut dvn);
        let mut local = gemm::dot(ch.qg.t(), dout.view());
        fused::zip_update(
            &mut local,
            gemm::dot(ch.w.t(), dvn.view()).view(),
            |a, b| a - b,
        );
        fused::decay_add(ds, ch.decay_last(), &[&local]);
        dvn
    }
}
