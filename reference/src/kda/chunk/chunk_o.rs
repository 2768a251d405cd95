//! The output `o = qg h + Aqk v_new` of one chunk, FLA's
//! `chunk_gla_fwd_o_gk` (called by `chunk_kda_fwd`), and its backward
//! `chunk_kda_bwd_dAv` (`kda/chunk_bwd.py`): `dAqk` and `Aqkᵀ do`. The
//! products with the state, `qg h` and `dqg = do hᵀ`, are stacked with the
//! state pass's `w h` (`chunk_delta_h.rs`) and `dw = −dv_new hᵀ`
//! (`chunk_bwd.rs`): one product each instead of two.

use ndarray::{Array2, ArrayView2};

use super::chunk_intra::Intra;
use super::Chunk;
use crate::fast::fused;
use crate::fast::tri;
use crate::scalar::Scalar;

impl Chunk {
    /// `o = Aqk v_new + qg h` of chunk `ch` over some value columns
    /// (`v_new`, `qg_h` `[c, w]`): `[c, w]`.
    pub(super) fn output<T: Scalar>(
        ch: &Intra<T>,
        v_new: ArrayView2<T>,
        qg_h: ArrayView2<T>,
    ) -> Array2<T> {
        let mut o = tri::lower_dot(ch.aqk.view(), v_new);
        fused::add_assign(&mut o, qg_h);
        o
    }

    /// `Aqkᵀ do` of chunk `ch` (`do` `[c, w]`) in the backward operands'
    /// storage: FLA stores it (`chunk_kda_bwd_dAv`'s `dv`) before the state
    /// pass adds `kg dh`. `[c, w]`.
    pub(super) fn aqk_t_do<T: Scalar>(&self, ch: &Intra<T>, d_o: ArrayView2<T>) -> Array2<T> {
        self.operand(tri::lower_t_dot(ch.aqk.view(), d_o))
    }

    /// `dAqk = do v_newᵀ` (`do`, `v_new` `[c, V]`): its lower triangle with
    /// the diagonal, zeros above, where `Aqk` has no entries. `[c, c]`.
    pub(super) fn d_aqk<T: Scalar>(d_o: ArrayView2<T>, v_new: ArrayView2<T>) -> Array2<T> {
        let mut daqk = tri::dot_t_lower(d_o, v_new, false);
        tri::mask_lower(&mut daqk, true);
        daqk
    }
}
