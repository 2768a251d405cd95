//! The forward over a piece's chunks, FLA's `chunk_gdn2_fwd`
//! (`gdn2/chunk_fwd.py`): the intra stage of each chunk, then the state
//! pass (`chunk_delta_h.rs`) reading out `o` (`chunk_o.rs`).

use ndarray::{s, Array2, ArrayView2};

use super::{Chunk, Intermediates};
use crate::gdn2::Gdn2Head;
use crate::scalar::Scalar;

impl Chunk {
    /// The chunked forward of a piece from `S_0 = h0 [K, V]`, with every
    /// intermediate.
    pub(crate) fn intermediates<T: Scalar>(
        &self,
        x: &Gdn2Head<T>,
        h0: ArrayView2<T>,
    ) -> Intermediates<T> {
        let intra = self.intras(x);
        let (l, vd) = (x.len(), x.v_dim());
        let (mut v_new, mut o) = (Array2::zeros((l, vd)), Array2::zeros((l, vd)));
        let mut h = Vec::with_capacity(intra.len());
        let mut state = h0.to_owned();
        for it in &intra {
            let rows = s![it.start..it.start + it.len(), ..];
            let (hn, vn) = self.fwd_h_step(it, &mut state);
            o.slice_mut(rows).assign(&Self::output(it, &hn, &vn));
            v_new.slice_mut(rows).assign(&vn);
            h.push(hn);
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
