//! The forward over a head's chunks, FLA's `chunk_kda_fwd`
//! (`kda/chunk_fwd.py`): the intra stage of each chunk, then the state pass
//! ([`super::chunk_delta_h`]) reading out `o` ([`super::chunk_o`]).

use ndarray::ArrayView2;

use super::{Chunk, ChunkForward};
use crate::fast::columns::{forward_chunks, StateColumns};
use crate::kda::KdaHead;
use crate::scalar::Scalar;

impl Chunk {
    /// The forward pass with every intermediate.
    pub fn forward_intermediates<T: Scalar>(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
    ) -> ChunkForward<T> {
        self.forward_pass(x, h0, true)
    }

    /// The forward pass; without `read_out` (what the backward recomputes)
    /// `o` is left empty, `[0, V]`.
    pub(super) fn forward_pass<T: Scalar>(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        read_out: bool,
    ) -> ChunkForward<T> {
        let (intra, StateColumns { h, v_new, o, state }) = forward_chunks(
            x.len(),
            self.chunk_size,
            h0,
            read_out,
            |n| self.intra_of(x, n),
            |ch, state, out, cols| self.state_step(ch, state, out, cols, read_out),
        );
        ChunkForward {
            intra,
            h,
            v_new,
            o,
            final_state: state,
        }
    }
}
