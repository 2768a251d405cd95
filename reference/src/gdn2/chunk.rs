//! The chunked form, in the structure of FLA's `chunk_gdn2`
//! (`fla/ops/gdn2/chunk_fwd.py`, `chunk_bwd.py`), exactly (no rounding).
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
//! A [`Policy`] rounds what FLA 0.6.0's gdn2 kernels store, stage by stage
//! ([`Chunk::FEATURES`]; the default policy is exact, bit for bit the
//! unrounded engine):
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

use ndarray::{s, Array1, Array2, ArrayD, ArrayView2, Axis};

use crate::dtype::Dtype;
use crate::precision::{Feature, Policy, Stage};

use super::{
    scale_rows, Gdn2, Gdn2Grads, Gdn2Head, Gdn2HeadGrads, Gdn2Inputs, Gdn2Options, Gdn2Outputs,
};
use crate::error::Result;
use crate::op::{self, Engine};
use crate::scalar::Scalar;

/// The chunked engine.
#[derive(Clone, Debug, PartialEq)]
pub struct Chunk {
    chunk_size: usize,
    policy: Policy,
}

/// FLA's sub-chunk of the intra kernels (`BC`): pairs of rows in different
/// sub-chunks go through tf32 `tl.dot`s.
const SUB_CHUNK: usize = 16;

/// FLA's safe-gate anchor shift: `C = Γ_0 − ½(BC − 1)·2` nats below the
/// sub-chunk's first row (`GATE_SHIFT` = 2, `chunk_gdn2` never passes its
/// `lower_bound` to the intra kernels).
const SAFE_GATE_SHIFT: f64 = 0.5 * (SUB_CHUNK as f64 - 1.0) * 2.0;

impl Chunk {
    /// Chunks of `chunk_size` tokens: 16, 32 or 64 (FLA's `chunk_gdn2`
    /// takes 64 only; the results do not depend on it).
    pub fn new(chunk_size: usize) -> Result<Self> {
        Ok(Chunk::sized(crate::registry::ChunkSize::new(chunk_size)?))
    }

    /// The engine with chunks of `c` tokens.
    pub fn sized(c: crate::registry::ChunkSize) -> Self {
        Chunk {
            chunk_size: c.get(),
            policy: Policy::exact(),
        }
    }

    /// The same engine with FLA's stored stages rounded per `policy` (only
    /// [`Chunk::FEATURES`]; the caller refuses a policy asking for more).
    pub fn with_policy(self, policy: Policy) -> Self {
        Chunk { policy, ..self }
    }

    /// The precision policy (exact by default).
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

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

    /// `a` rounded to the backward's operand storage ([`Stage::BwdOperands`]).
    fn operand<T: Scalar>(&self, mut a: Array2<T>) -> Array2<T> {
        self.policy.round(Stage::BwdOperands, &mut a);
        a
    }

    /// `exp` of every element (base 2 under the policy).
    fn exps<T: Scalar>(&self, a: &Array2<T>) -> Array2<T> {
        a.mapv(|x| self.policy.exp(x))
    }

    /// `C`, tokens per chunk.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }
}

/// `op::forward(&Chunk::new(chunk_size)?, …)`: `o [B, T, H, V]` and, if
/// asked, `final_state`.
pub fn forward<T: Scalar>(
    x: &Gdn2Inputs<T>,
    opt: &Gdn2Options,
    chunk_size: usize,
) -> Result<Gdn2Outputs<T>> {
    op::forward(&Chunk::new(chunk_size)?, x, opt)
}

/// `op::backward(&Chunk::new(chunk_size)?, …)`: every gradient of
/// `Σ o·do + Σ final_state·dht`.
pub fn backward<T: Scalar>(
    x: &Gdn2Inputs<T>,
    opt: &Gdn2Options,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
    chunk_size: usize,
) -> Result<Gdn2Grads<T>> {
    op::backward(&Chunk::new(chunk_size)?, x, opt, d_o, dht)
}

/// One chunk's state-independent quantities (FLA's `chunk_gdn2_fwd_intra`
/// and `recompute_w_u_fwd_gdn2`), `c` rows.
#[derive(Clone, Debug)]
pub struct Intra<T> {
    /// First token of the chunk in its piece.
    pub start: usize,
    /// `[c, K]` in-chunk inclusive cumsum of `g` (natural log).
    pub g_cumsum: Array2<T>,
    /// `[c, c]` FLA's `Akk`: the inverse `(I + L)^{-1}` (unit lower triangular).
    pub akk: Array2<T>,
    /// `[c, c]` FLA's `Aqk` (lower triangular, diagonal included; `q` scaled).
    pub aqk: Array2<T>,
    /// `[c, K]` `Akk (b ⊙ k ⊙ exp Γ)`.
    pub w_wy: Array2<T>,
    /// `[c, V]` `Akk (w ⊙ v)`.
    pub u_wy: Array2<T>,
    /// `[c, K]` `q ⊙ exp Γ`.
    pub qg: Array2<T>,
    /// `[c, K]` `k ⊙ exp(Γ_last − Γ)`.
    pub kg: Array2<T>,
}

impl<T: Scalar> Intra<T> {
    /// Rows `c` (tokens of the chunk).
    pub fn len(&self) -> usize {
        self.g_cumsum.nrows()
    }
    /// Never true for a chunk [`Chunk::intras`] made.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `Γ_last [K]`, the chunk's total log-decay.
    pub fn g_last(&self) -> Array1<T> {
        self.g_cumsum.row(self.len() - 1).to_owned()
    }
    /// `[K, K]` the chunk's transition `Diag(exp Γ_last) − kgᵀ w_wy`.
    pub fn transition(&self) -> Array2<T> {
        self.transition_with(&Policy::exact())
    }

    /// [`Intra::transition`] with `policy`'s exponential (base 2 or not).
    pub fn transition_with(&self, policy: &Policy) -> Array2<T> {
        Array2::from_diag(&self.g_last().mapv(|x| policy.exp(x))) - self.kg.t().dot(&self.w_wy)
    }
}

/// A piece's chunked forward, FLA's stored and recomputed tensors.
#[derive(Clone, Debug)]
pub struct Intermediates<T> {
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

/// Where the forward's pairwise products go through FLA's rounded `tl.dot`
/// operands ([`Stage::FwdDots`]): the storage, and whether the diagonal
/// sub-chunks do too (the safe-gate path).
#[derive(Clone, Copy)]
struct DotRounding {
    storage: Dtype,
    safe_gate: bool,
}

impl Chunk {
    /// `Σ_d a_r[d] c_s[d] exp(Γ_r[d] − Γ_s[d])` for the rows `(r, s)` of a
    /// chunk that `keep(r, s)` admits, else 0; `[c, c]`. Under
    /// [`Stage::FwdDots`], a pair in different 16-token sub-chunks (and,
    /// with the safe gate, in the same one) is FLA's product of rounded
    /// factors `(a_r exp(Γ_r − n)) · (c_s exp(n − Γ_s))` through the row
    /// sub-chunk's anchor `n` (its first row; safe gate inside a sub-chunk:
    /// that row minus [`SAFE_GATE_SHIFT`]); other pairs are FLA's fp32
    /// elementwise sums (`chunk_intra_token_parallel`).
    ///
    /// `a_safe` replaces `a` on the safe path's diagonal sub-chunks (FLA's
    /// `bk_dt`, `b k` rounded to the input dtype there only).
    fn decayed_products<T: Scalar>(
        &self,
        a: ArrayView2<T>,
        a_safe: ArrayView2<T>,
        c: ArrayView2<T>,
        g_cumsum: &Array2<T>,
        keep: impl Fn(usize, usize) -> bool,
    ) -> Array2<T> {
        let n = g_cumsum.nrows();
        let dots = self
            .policy
            .storage(Stage::FwdDots)
            .map(|storage| DotRounding {
                storage,
                safe_gate: self.policy.safe_gate_midpoint,
            });
        let e = |x: T| self.policy.exp(x);
        Array2::from_shape_fn((n, n), |(r, s)| {
            if !keep(r, s) {
                return T::zero();
            }
            let (gr, gs) = (g_cumsum.row(r), g_cumsum.row(s));
            let sub = |i: usize| i / SUB_CHUNK;
            match dots {
                Some(d) if sub(r) != sub(s) || d.safe_gate => {
                    let first = g_cumsum.row(sub(r) * SUB_CHUNK);
                    let (shift, a) = if sub(r) == sub(s) {
                        (T::c(SAFE_GATE_SHIFT), a_safe)
                    } else {
                        (T::zero(), a)
                    };
                    (0..gr.len())
                        .map(|k| {
                            let anchor = first[k] - shift;
                            let left = d.storage.round(a[[r, k]] * e(gr[k] - anchor));
                            let right = d.storage.round(c[[s, k]] * e(anchor - gs[k]));
                            left * right
                        })
                        .sum()
                }
                _ => (0..gr.len())
                    .map(|k| a[[r, k]] * c[[s, k]] * e(gr[k] - gs[k]))
                    .sum(),
            }
        })
    }
}

/// `(I + L)^{-1}` of a strictly lower triangular `l [c, c]`, by forward
/// substitution: row `r` is `e_r − Σ_{s<r} L[r,s] · row s`.
fn unit_lower_inverse<T: Scalar>(l: &Array2<T>) -> Array2<T> {
    let n = l.nrows();
    let mut inv = Array2::<T>::eye(n);
    for r in 1..n {
        let (above, mut below) = inv.view_mut().split_at(Axis(0), r);
        let mut row = below.row_mut(0);
        for s in 0..r {
            row.scaled_add(-l[[r, s]], &above.row(s));
        }
    }
    inv
}

impl Chunk {
    /// The state-independent quantities of `x`'s chunk of rows `start ..
    /// start + c` (`c ≥ 1`, `start + c ≤ L`), each stored as the policy says.
    pub fn intra<T: Scalar>(&self, x: &Gdn2Head<T>, start: usize, c: usize) -> Intra<T> {
        let p = &self.policy;
        let rows = s![start..start + c, ..];
        let (q, k, b) = (x.q.slice(rows), x.k.slice(rows), x.b.slice(rows));
        let mut g_cumsum = x.g.slice(rows).to_owned();
        p.cumsum_rows(&mut g_cumsum);
        let bk = &b * &k;
        // The safe path's diagonal blocks read `b k` rounded to the input
        // dtype (`bk_dt`); the other intra kernels form it in fp32.
        let bk_dt = p.stored(Stage::KBeta, bk.view());
        let l = self.decayed_products(bk.view(), bk_dt.view(), k, &g_cumsum, |r, s| s < r);
        let mut akk = unit_lower_inverse(&l);
        p.round(Stage::Akk, &mut akk);
        let mut aqk = self.decayed_products(q, q, k, &g_cumsum, |r, s| s <= r);
        p.round(Stage::Aqk, &mut aqk);
        let eg = self.exps(&g_cumsum);
        // `recompute_w_u_fwd_gdn2`: `b_k * b_b` (two input-dtype tensors),
        // times `2^Γ` in fp32, cast for the dot; `(v w)` cast likewise.
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
        let mut kg = &k * &self.exps(&(&g_last.insert_axis(Axis(0)) - &g_cumsum));
        let mut qg = &q * &eg;
        p.round(Stage::Gated, &mut qg);
        p.round(Stage::Gated, &mut kg);
        Intra {
            start,
            w_wy,
            u_wy,
            qg,
            kg,
            g_cumsum,
            akk,
            aqk,
        }
    }

    /// Each chunk's [`Intra`] of a piece.
    pub fn intras<T: Scalar>(&self, x: &Gdn2Head<T>) -> Vec<Intra<T>> {
        (0..x.len())
            .step_by(self.chunk_size)
            .map(|start| self.intra(x, start, self.chunk_size.min(x.len() - start)))
            .collect()
    }

    /// The chunked forward of a piece from `S_0 = h0 [K, V]`, with every
    /// intermediate.
    pub fn intermediates<T: Scalar>(&self, x: &Gdn2Head<T>, h0: ArrayView2<T>) -> Intermediates<T> {
        let intra = self.intras(x);
        let (l, vd) = (x.len(), x.v_dim());
        let (mut v_new, mut o) = (Array2::zeros((l, vd)), Array2::zeros((l, vd)));
        let mut h = Vec::with_capacity(intra.len());
        let mut state = h0.to_owned();
        for it in &intra {
            let rows = s![it.start..it.start + it.len(), ..];
            // FLA stores `h` (the dot operand) and `v_new`; the state it
            // carries from chunk to chunk stays in fp32 registers.
            let hn = self.policy.stored(Stage::H, state.view()).into_owned();
            let mut vn = &it.u_wy - &it.w_wy.dot(&hn);
            self.policy.round(Stage::VNew, &mut vn);
            o.slice_mut(rows)
                .assign(&(&it.qg.dot(&hn) + &it.aqk.dot(&vn)));
            scale_rows(&mut state, it.g_last().mapv(|x| self.policy.exp(x)).view());
            state += &it.kg.t().dot(&vn);
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

impl Chunk {
    /// One chunk's backward into `gr`'s rows: from `h` (the state entering
    /// it, as stored), the piece's `v_new` and `do`, and `dh = ∂L/∂h'` (the
    /// state leaving it, the fp32 carry); returns `∂L/∂h`. The roundings
    /// are FLA's stored backward tensors and operands (the module's table).
    #[allow(clippy::too_many_arguments)]
    fn chunk_backward<T: Scalar>(
        &self,
        x: &Gdn2Head<T>,
        it: &Intra<T>,
        h: &Array2<T>,
        v_new: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dh: Array2<T>,
        gr: &mut Gdn2HeadGrads<T>,
    ) -> Array2<T> {
        let p = &self.policy;
        let e = |x: T| p.exp(x);
        let (c, r0) = (it.len(), it.start);
        let rows = s![r0..r0 + c, ..];
        let (v_new, d_o) = (v_new.slice(rows), d_o.slice(rows));
        let (q, k, b) = (x.q.slice(rows), x.k.slice(rows), x.b.slice(rows));
        let (v, w) = (x.v.slice(rows), x.w.slice(rows));
        let g = &it.g_cumsum;
        let g_last = it.g_last();
        let decay_last = g_last.mapv(e);
        // FLA stores `dh` (what the chunk's products read); the carry stays fp32.
        let dh_used = p.stored(Stage::Dh, dh.view()).into_owned();

        // Output: o = qg h + Aqk v_new (FLA's chunk_kda_bwd_dAv for dAqk, dv).
        let daqk = Array2::from_shape_fn((c, c), |(r, s)| {
            if s <= r {
                d_o.row(r).dot(&v_new.row(s))
            } else {
                T::zero()
            }
        });
        let dv_intra = self.operand(it.aqk.t().dot(&d_o));
        // The dh recurrence (chunk_gated_delta_rule_bwd_dhu): v_new feeds h'
        // through kg and depends on h through w_wy.
        let mut dv2 = &dv_intra + &it.kg.dot(&dh_used);
        p.round(Stage::Dv, &mut dv2);
        let dqg = d_o.dot(&h.t());
        let dkg = v_new.dot(&dh_used.t());
        // ∂L/∂Γ_last from h' = Diag(exp Γ_last) h + …, then ∂L/∂h.
        let mut dg_last = (&dh_used * h).sum_axis(Axis(1)) * &decay_last;
        let mut dh_prev = it.qg.t().dot(&d_o) - it.w_wy.t().dot(&dv2);
        let mut decayed = dh;
        scale_rows(&mut decayed, decay_last.view());
        dh_prev += &decayed;

        // WY: w_wy = Akk kbg, u_wy = Akk vw, with v_new = u_wy − w_wy h.
        let dw_wy = self.operand(-dv2.dot(&h.t()));
        let du_wy = &dv2;
        let eg = self.exps(g);
        let kbg = self.operand(&(&k * &eg) * &b);
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

        // To the chunk's tokens: qg = q ⊙ exp Γ, kbg = b ⊙ k ⊙ exp Γ,
        // kg = k ⊙ exp(Γ_last − Γ), and the pairwise products of Aqk and L.
        let e_tail = self.exps(&(&g_last.view().insert_axis(Axis(0)) - g));
        let mut dq = &dqg * &eg;
        let mut dk = &(&dkbg * &b) * &eg + &dkg * &e_tail;
        let mut db = &(&dkbg * &k) * &eg;
        let mut dgam = &dqg * &it.qg + &dkbg * &kbg - &dkg * &it.kg;
        dg_last += &(&dkg * &it.kg).sum_axis(Axis(0));
        let kd = k.ncols();
        for r in 0..c {
            for s in 0..=r {
                let (a_qk, a_l) = (daqk[[r, s]], if s < r { dl[[r, s]] } else { T::zero() });
                for d in 0..kd {
                    let ed = e(g[[r, d]] - g[[s, d]]);
                    let ks = k[[s, d]] * ed;
                    // Aqk[r,s] = Σ_d q_r k_s e, L[r,s] = Σ_d b_r k_r k_s e.
                    let t_qk = a_qk * q[[r, d]] * ks;
                    let t_l = a_l * b[[r, d]] * k[[r, d]] * ks;
                    dq[[r, d]] += a_qk * ks;
                    dk[[s, d]] += (a_qk * q[[r, d]] + a_l * b[[r, d]] * k[[r, d]]) * ed;
                    dk[[r, d]] += a_l * b[[r, d]] * ks;
                    db[[r, d]] += a_l * k[[r, d]] * ks;
                    dgam[[r, d]] += t_qk + t_l;
                    dgam[[s, d]] -= t_qk + t_l;
                }
            }
        }
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
        gr.dv.slice_mut(rows).assign(&(&dvw * &w));
        gr.dw.slice_mut(rows).assign(&(&dvw * &v));
        dh_prev
    }
}
