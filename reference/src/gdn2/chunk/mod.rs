//! The chunked form, in the structure of FLA's `chunk_gdn2`
//! (`fla/ops/gdn2/chunk_fwd.py`, `chunk_bwd.py`), exactly (no rounding).
//! One file per stage, named after FLA's (as KDA's chunked engine):
//! `chunk_fwd.rs` (`chunk_gdn2_fwd`), `chunk_intra.rs` (`Akk`, `Aqk` and
//! their backward, `chunk_gdn2_fwd_intra` / `chunk_gdn2_bwd_intra`),
//! `wy_fast.rs` (`recompute_w_u_fwd_gdn2`, the WY backward),
//! `chunk_delta_h.rs` (`h`, `v_new`; `dh`, `dv2`), `chunk_o.rs` (`o`;
//! `dAqk`, `Aqkᵀ do`) and `chunk_bwd.rs` (`chunk_gdn2_bwd`).
//!
//! Per chunk of `C` tokens (the last of a piece may be shorter), rows `r`,
//! with `q` already scaled and `Γ` the in-chunk inclusive cumsum of `g`:
//!
//! ```text
//! L[r,s]  = Σ_d b_r[d] k_r[d] k_s[d] exp(Γ_r[d] − Γ_s[d])     s < r
//! Akk     = (I + L)^{-1}                                       (forward substitution)
//! w_wy    = Akk (b ⊙ k ⊙ exp Γ)        u_wy = Akk (w ⊙ v)
//! Aqk[r,s]= Σ_d q_r[d] k_s[d] exp(Γ_r[d] − Γ_s[d])            s ≤ r
//! qg      = q ⊙ exp Γ                  kg = k ⊙ exp(Γ_last − Γ)
//! v_new   = u_wy − w_wy h              (h: the state entering the chunk)
//! o       = qg h + Aqk v_new
//! h'      = Diag(exp Γ_last) h + kgᵀ v_new
//! ```
//!
//! FLA's names throughout (`g_cumsum`, `Akk`, `Aqk`, `w_wy`, `u_wy`, `qg`,
//! `kg`, `h`, `v_new`; backward `dAqk`, `dv` → `dv2`, `dh`, `dAkk`). FLA
//! works in base 2 (`exp2` of `Γ·log2 e`) and factors pairwise decays
//! through anchors; both are the same numbers in exact arithmetic and are
//! left out of the exact policy: each pairwise decay `exp(Γ_r − Γ_s)` is
//! taken directly (never above 1 for a non-positive decay, so nothing
//! overflows).
//!
//! A [`crate::precision::Policy`] rounds what FLA 0.6.0's gdn2 kernels
//! store, stage by stage ([`Chunk::FEATURES`]; the default policy is exact,
//! bit for bit the unrounded engine):
//!
//! | stage | FLA (`fla/ops/gdn2/`) | here |
//! |---|---|---|
//! | `activations` | `l2norm_fwd` returns q/k in the input dtype | [`Engine::stored`] |
//! | `g_cumsum` | `chunk_local_cumsum` / `kda_gate_chunk_cumsum`, fp32 | every partial sum |
//! | `fwd-dots` | `inter_solve_fused`: the fp32 `tl.dot`s between 16-token sub-chunks (tf32), operands gated to the row sub-chunk's first row; with `safe_gate` also inside one (`intra_sub_chunk`, anchor `Γ_0 − 15`) | both operands |
//! | `Akk`, `Aqk` | stored in the input dtype (`Akk` the inverse `(I + L)^{-1}`) | after the solve / the products |
//! | `k-beta` | `recompute_w_u_fwd_gdn2`: `b_k * b_b` of two bf16 tensors (and the safe path's `bk_dt`) | `b ⊙ k` |
//! | `w`, `u` | the operands `(b k 2^Γ).to(dt)`, `(v w).to(dt)` and the results | both |
//! | `qg/kg` | stored in the input dtype | both |
//! | `h`, `v_new` | `chunk_gated_delta_rule_fwd_h`: the state as a dot operand, `v_new`; the carried state stays fp32 | both |
//! | `dv` | `dv2`, stored in the input dtype | after `kg dh` is added |
//! | `dh` | `chunk_gated_delta_rule_bwd_dhu`: `dh` stored, the carry fp32 | the stored copy |
//! | `bwd-operands` | `Aqkᵀ do` (`chunk_kda_bwd_dAv`, in `do`'s dtype), `−dWflow.to(dt)`, `(k 2^Γ b).to(dt)`, `v w`, the `dAkk` operands (`chunk_gdn2_bwd_kernel_wy_dqkg_fused`) | each |
//!
//! plus `exp2` (FLA's base-2 exponentials). The backward's intra-chunk
//! tf32 dots and the bf16 reduction of `Σ h·dh` (KDA's `intra-dots`,
//! `hdh-sum`) are not emulated here and not declared: a preset asking for
//! them is refused.
//!
//! The chunk transition `Diag(exp Γ_last) − kgᵀ w_wy` (`h' = M h + kgᵀ u_wy`)
//! gives CP's `M` as FLA's pre-process composes it.

mod chunk_bwd;
mod chunk_delta_h;
mod chunk_fwd;
mod chunk_intra;
mod chunk_o;
mod wy_fast;

use ndarray::{Array2, ArrayView2};

use chunk_intra::Intra;

use super::{Gdn2, Gdn2Head, Gdn2HeadGrads};
use crate::op::Engine;
use crate::precision::{Feature, Stage};
use crate::scalar::Scalar;

/// The chunked engine: the shell [`crate::chunked::Chunk`] over GDN-2's
/// stages (FLA's `chunk_gdn2` takes chunks of 64 only; the results do not
/// depend on the size).
pub type Chunk = crate::chunked::Chunk<Gdn2>;

impl Chunk {
    /// What a policy may ask of this engine (the module's table), plus the
    /// inputs/outputs the caller rounds and CP's stages under CP.
    pub const FEATURES: &'static [Feature] = &[
        Feature::Round(Stage::Activations),
        Feature::Round(Stage::GCumsum),
        Feature::Round(Stage::Akk),
        Feature::Round(Stage::Aqk),
        Feature::Round(Stage::W),
        Feature::Round(Stage::U),
        Feature::Round(Stage::KBeta),
        Feature::Round(Stage::Gated),
        Feature::Round(Stage::H),
        Feature::Round(Stage::VNew),
        Feature::Round(Stage::Dh),
        Feature::Round(Stage::Dv),
        Feature::Round(Stage::FwdDots),
        Feature::Round(Stage::BwdOperands),
        Feature::Exp2,
        Feature::SafeGate,
    ];

    /// `exp` of every element (base 2 under the policy).
    fn exps<T: Scalar>(&self, a: &Array2<T>) -> Array2<T> {
        a.mapv(|x| self.policy.exp(x))
    }
}

/// A piece's chunked forward, FLA's stored and recomputed tensors.
#[derive(Clone, Debug)]
pub(crate) struct Intermediates<T> {
    /// Each chunk's state-independent quantities.
    pub intra: Vec<Intra<T>>,
    /// `[NT]` of `[K, V]`: the state entering each chunk (FLA's `h`).
    pub h: Vec<Array2<T>>,
    /// `[L, V]` `u_wy − w_wy h`, chunk by chunk.
    pub v_new: Array2<T>,
    /// `[L, V]`
    pub o: Array2<T>,
    /// `[K, V]`
    pub final_state: Array2<T>,
}

impl<T: Scalar> Engine<T> for Chunk {
    type Op = Gdn2;

    fn forward(&self, x: &Gdn2Head<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        let f = self.intermediates(x, h0);
        (f.o, f.final_state)
    }

    /// FLA's backward: the `dh` recurrence over chunks in reverse (from
    /// `dht`), each chunk's output, WY and intra backward, then the reverse
    /// cumsum of the decay gradient.
    fn backward(
        &self,
        x: &Gdn2Head<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> Gdn2HeadGrads<T> {
        let f = self.intermediates(x, h0);
        let mut gr = Gdn2HeadGrads::zeros(x.len(), x.k_dim(), x.v_dim());
        let mut dh = dht.to_owned();
        for (it, h) in f.intra.iter().zip(&f.h).rev() {
            dh = self.chunk_backward(x, it, h, f.v_new.view(), d_o, dh, &mut gr);
        }
        gr.dh0 = dh;
        gr
    }

    /// `M = Π_chunks (Diag(exp Γ_last) − kgᵀ w_wy)`, later chunks on the
    /// left, each partial product stored as [`Stage::MChain`] says.
    fn transition(&self, x: &Gdn2Head<T>) -> Array2<T> {
        self.intras(x).iter().fold(Array2::eye(x.k_dim()), |m, it| {
            let mut next = it.transition_with(&self.policy).dot(&m);
            self.policy.round(Stage::MChain, &mut next);
            next
        })
    }

    /// q and k after an in-kernel l2norm, as `l2norm_fwd` stores them.
    fn stored<'a>(&self, p: super::Prepared<'a, T>) -> super::Prepared<'a, T>
    where
        T: 'a,
    {
        p.with_stored_activations(&self.policy)
    }
}
