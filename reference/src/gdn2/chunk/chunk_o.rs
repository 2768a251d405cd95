//! The output `o = qg h + Aqk v_new` of one chunk, FLA's
//! `chunk_gla_fwd_o_gk` (called by `chunk_gdn2_fwd`), and its backward
//! `chunk_kda_bwd_dAv` (called by `chunk_gdn2_bwd`): `dAqk` and `Aqkᵀ do`.

use ndarray::{Array2, ArrayView2};

use super::chunk_intra::Intra;
use super::Chunk;
use crate::scalar::Scalar;

impl Chunk {
    /// `o = qg h + Aqk v_new` of chunk `it` (`h` `[K, V]` the state entering
    /// it as stored, `v_new` `[c, V]`): `[c, V]`.
    pub(super) fn output<T: Scalar>(it: &Intra<T>, h: &Array2<T>, v_new: &Array2<T>) -> Array2<T> {
        &it.qg.dot(h) + &it.aqk.dot(v_new)
    }

    /// `(dAqk, Aqkᵀ do)` of chunk `it` (`do`, `v_new` `[c, V]`): `dAqk =
    /// do v_newᵀ` on the lower triangle with the diagonal, zeros above,
    /// `[c, c]`; `Aqkᵀ do` `[c, V]` in the backward operands' storage.
    pub(super) fn bwd_dav<T: Scalar>(
        &self,
        it: &Intra<T>,
        d_o: ArrayView2<T>,
        v_new: ArrayView2<T>,
    ) -> (Array2<T>, Array2<T>) {
        let c = it.len();
        let daqk = Array2::from_shape_fn((c, c), |(r, s)| {
            if s <= r {
                d_o.row(r).dot(&v_new.row(s))
            } else {
                T::zero()
            }
        });
        (daqk, self.operand(it.aqk.t().dot(&d_o)))
    }
}
