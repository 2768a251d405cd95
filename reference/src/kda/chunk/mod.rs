//! The chunked form (SPEC §3.1), in the structure of FLA's `chunk_kda`
//! (fla-core 0.6.0, `fla/ops/kda/`): per chunk of `C` tokens the
//! state-independent "intra" quantities (Γ, `Akk`, `Aqk`, `w`, `u`, `qg`,
//! `kg`), then one pass over the chunks carrying the state (`h`, `v_new`,
//! `o`). Backward follows `chunk_kda_bwd`: output backward, the `dh`
//! recurrence over chunks, WY backward, intra-chunk backward, gate (reverse
//! cumsum) backward.
//!
//! One file per stage, named after FLA's:
//!
//! | file | FLA | computes |
//! |---|---|---|
//! | `chunk_fwd.rs` | `kda/chunk_fwd.py` (`chunk_kda_fwd`) | the forward over a head's chunks |
//! | `chunk_intra.rs` | `kda/chunk_intra.py` (`chunk_kda_fwd_intra`, `chunk_kda_bwd_intra`) | Γ, `Akk`, `Aqk` and their backward |
//! | `decays.rs` | the gate exponentials inside those kernels | `exp(Γ_r − Γ_s)`, `exp(Γ)`, `exp(Γ_last − Γ)` |
//! | `wy_fast.rs` | `kda/wy_fast.py` (`recompute_w_u_fwd`, `prepare_wy_repr_bwd`) | `w`, `u`, `qg`, `kg` and the WY backward |
//! | `chunk_delta_h.rs` | `common/chunk_delta_h.py` (`fwd_h`, `bwd_dhu`) | `h`, `v_new`; `dh`, `dv` |
//! | `chunk_o.rs` | `gla/chunk.py` (`chunk_gla_fwd_o_gk`), `kda/chunk_bwd.py` (`chunk_kda_bwd_dAv`) | `o`; `dAqk`, `Aqkᵀ do` |
//! | `chunk_bwd.rs` | `kda/chunk_bwd.py` (`chunk_kda_bwd`, `wy_dqkg_fused`) | the backward over a head's chunks |
//!
//! A pairwise decay `exp(Γ_r − Γ_s)` is a product of two factors through
//! the chunk's middle row `m`, `exp(Γ_r − Γ_m)·exp(Γ_m − Γ_s)` (so the
//! pairs are matrix products); a chunk whose decays span too wide a range
//! for those factors splits into blocks ([`crate::fast::decay_blocks`]), so
//! strong decays never overflow. A [`crate::precision::Policy`] rounds each stored stage for
//! precision emulation; the default policy is exact.

mod chunk_bwd;
mod chunk_delta_h;
mod chunk_fwd;
mod chunk_intra;
mod chunk_o;
mod decays;
mod wy_fast;

pub use chunk_intra::Intra;

use std::ops::Range;

use ndarray::{s, Array2, Array3, ArrayView2, ArrayViewMut2, CowArray, Ix2};

use super::{Kda, KdaHead, KdaHeadGrads, KdaHeadGradsMut, Prepared};
use crate::chunked::Stages;
use crate::fast::gemm;
use crate::fast::views;
use crate::precision::{Feature, Stage};
use crate::scalar::Scalar;

/// The chunked engine: the shell [`crate::chunked::Chunk`] over KDA's
/// stages.
pub type Chunk = crate::chunked::Chunk<Kda>;

impl Chunk {
    /// What a policy may ask of this engine (plus the CP stages when CP runs
    /// over it, and the inputs/outputs the caller rounds).
    pub const FEATURES: &'static [Feature] = &[
        Feature::Round(Stage::Activations),
        Feature::Round(Stage::GCumsum),
        Feature::Round(Stage::Akk),
        Feature::Round(Stage::Aqk),
        Feature::Round(Stage::W),
        Feature::Round(Stage::U),
        Feature::Round(Stage::Gated),
        Feature::Round(Stage::H),
        Feature::Round(Stage::VNew),
        Feature::Round(Stage::Dh),
        Feature::Round(Stage::Dv),
        Feature::Round(Stage::BwdOperands),
        Feature::Round(Stage::KBeta),
        Feature::Round(Stage::KBetaBwd),
        Feature::Round(Stage::FwdDots),
        Feature::Round(Stage::HdhSum),
        Feature::Round(Stage::IntraDots),
        Feature::Exp2,
        Feature::SafeGate,
    ];
}

/// Forward intermediates of one head.
#[derive(Clone, Debug)]
pub struct ChunkForward<T> {
    pub intra: Vec<Intra<T>>,
    /// State entering each chunk, `[NT, K, V]`.
    pub h: Array3<T>,
    /// `u − w h`, `[L, V]`.
    pub v_new: Array2<T>,
    /// `[L, V]`
    pub o: Array2<T>,
    /// `[K, V]`
    pub final_state: Array2<T>,
}

impl<T> crate::fast::spans::SpanForward<T> for ChunkForward<T> {
    fn o(&self) -> ArrayView2<'_, T> {
        self.o.view()
    }
    fn final_state(&self) -> ArrayView2<'_, T> {
        self.final_state.view()
    }
}

/// Backward intermediates of one head.
#[derive(Clone, Debug)]
pub struct ChunkBackward<T> {
    /// Gradient of the state at the END of each chunk (FLA's `dh`), `[NT, K, V]`.
    pub dh: Array3<T>,
    /// Gradient of `v_new` (FLA's `dv` after the state pass), `[L, V]`.
    pub dv_new: Array2<T>,
    /// Per chunk, `[c, c]`.
    pub daqk: Vec<Array2<T>>,
    /// Per chunk, gradient of `Akk`, `[c, c]`: its lower triangle (with the
    /// diagonal), zeros above, where `Akk` has no entries.
    pub dakk: Vec<Array2<T>>,
    pub grads: KdaHeadGrads<T>,
}

/// Tokens `r` of the head's query (scaled) and key, `[c, K]` each, in
/// standard layout for the element-wise passes: copied only where the
/// head's rows are strided or the query is to be scaled. (The products read
/// `v`'s rows where they are; Γ is copied once, into the cumulative sum.)
fn qk_rows<'a, T: Scalar>(
    x: &'a KdaHead<'_, T>,
    r: std::ops::Range<usize>,
) -> [CowArray<'a, T, Ix2>; 2] {
    [
        views::scaled_standard(x.q.slice(s![r.clone(), ..]), x.scale),
        views::standard(x.k.slice(s![r, ..])),
    ]
}

impl crate::chunked::Spans for Kda {}

impl<T: Scalar> Stages<T> for Kda {
    type Forward = ChunkForward<T>;

    fn head_len(x: &KdaHead<T>) -> usize {
        x.len()
    }

    /// The head as it is (its chunks' rows are copied where they are read,
    /// [`qk_rows`]).
    fn staged<'a>(x: &'a KdaHead<'_, T>) -> KdaHead<'a, T> {
        KdaHead {
            q: x.q.view().into(),
            k: x.k.view().into(),
            v: x.v.view().into(),
            g: x.g.view().into(),
            beta: x.beta.view().into(),
            scale: x.scale,
        }
    }

    fn span<'a>(x: &'a KdaHead<'_, T>, r: Range<usize>) -> KdaHead<'a, T> {
        x.standard_rows(r)
    }

    fn forward_pass(
        e: &Chunk,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        read_out: bool,
    ) -> ChunkForward<T> {
        e.forward_pass(x, h0, read_out)
    }

    fn output(f: ChunkForward<T>) -> (Array2<T>, Array2<T>) {
        (f.o, f.final_state)
    }

    fn backward_from(
        e: &Chunk,
        x: &KdaHead<T>,
        fwd: &ChunkForward<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> KdaHeadGrads<T> {
        e.backward_from(x, fwd, d_o, dht, false).grads
    }

    fn backward_into(
        e: &Chunk,
        x: &KdaHead<T>,
        fwd: &ChunkForward<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        gr: KdaHeadGradsMut<T>,
    ) {
        e.backward_into(x, fwd, d_o, dht, false, gr);
    }

    fn sink_rows<'a>(
        gr: &'a mut KdaHeadGradsMut<'_, T>,
        r: Range<usize>,
        dh0: ArrayViewMut2<'a, T>,
    ) -> KdaHeadGradsMut<'a, T> {
        gr.rows_mut(r, dh0)
    }

    fn sink_dh0<'a>(gr: crate::chunked::Sink<'a, T, Self>) -> ArrayViewMut2<'a, T> {
        gr.dh0
    }

    /// `M = Π M_chunk`, later chunks on the left.
    fn transition(e: &Chunk, x: &KdaHead<T>) -> Array2<T> {
        let mut m = Array2::eye(x.k_dim());
        for ch in e.intras(x) {
            m = gemm::dot(ch.transition().view(), m.view());
            e.policy.round(Stage::MChain, &mut m);
        }
        m
    }

    /// q/k after an in-kernel l2norm and β after an in-kernel sigmoid, in
    /// the policy's activation storage.
    fn stored<'a>(e: &Chunk, p: Prepared<'a, T>) -> Prepared<'a, T>
    where
        T: 'a,
    {
        p.with_stored_activations(&e.policy)
    }
}
