//! The state pass, FLA's `common/chunk_delta_h.py`: forward
//! (`chunk_gated_delta_rule_fwd_h`) the state entering each chunk `h` and
//! `v_new = u_wy − w_wy h`, carried by `h' = Diag(exp Γ_last) h + kgᵀ
//! v_new`; backward (`chunk_gated_delta_rule_bwd_dhu`) `dv2` and the state
//! gradient carried back over a chunk.

use ndarray::{Array2, ArrayView2};

use super::chunk_intra::Intra;
use super::Chunk;
use crate::gdn2::scale_rows;
use crate::precision::Stage;
use crate::scalar::Scalar;

impl Chunk {
    /// One chunk's forward state step: the state entering chunk `it` as
    /// stored, `h` `[K, V]`, and `v_new` `[c, V]`; carries `state` `[K, V]`
    /// over the chunk. FLA stores `h` (the dot operand) and `v_new`; the
    /// state it carries from chunk to chunk stays in fp32 registers.
    pub(super) fn fwd_h_step<T: Scalar>(
        &self,
        it: &Intra<T>,
        state: &mut Array2<T>,
    ) -> (Array2<T>, Array2<T>) {
        let hn = self.policy.stored(Stage::H, state.view()).into_owned();
        let mut vn = &it.u_wy - &it.w_wy.dot(&hn);
        self.policy.round(Stage::VNew, &mut vn);
        scale_rows(state, it.g_last().mapv(|x| self.policy.exp(x)).view());
        *state += &it.kg.t().dot(&vn);
        (hn, vn)
    }

    /// One chunk's backward state step: from `dh = ∂L/∂h'` `[K, V]` (the
    /// state leaving chunk `it`, the fp32 carry), `do` `[c, V]` and
    /// `Aqkᵀ do` `[c, V]` ([`Chunk::bwd_dav`]), returns `(dh_used, dv2,
    /// dh_prev)`: `dh` as FLA stores it (what the chunk's products read),
    /// `∂L/∂v_new` `[c, V]` (`v_new` feeds `h'` through `kg` and depends on
    /// `h` through `w_wy`), and `∂L/∂h` `[K, V]` less the decay term of
    /// `Γ_last` (which [`Chunk::chunk_backward`] adds to `dΓ`).
    pub(super) fn bwd_dhu_step<T: Scalar>(
        &self,
        it: &Intra<T>,
        d_o: ArrayView2<T>,
        dv_intra: &Array2<T>,
        dh: Array2<T>,
        decay_last: &ndarray::Array1<T>,
    ) -> [Array2<T>; 3] {
        let dh_used = self.policy.stored(Stage::Dh, dh.view()).into_owned();
        let mut dv2 = dv_intra + &it.kg.dot(&dh_used);
        self.policy.round(Stage::Dv, &mut dv2);
        let mut dh_prev = it.qg.t().dot(&d_o) - it.w_wy.t().dot(&dv2);
        let mut decayed = dh;
        scale_rows(&mut decayed, decay_last.view());
        dh_prev += &decayed;
        [dh_used, dv2, dh_prev]
    }
}
