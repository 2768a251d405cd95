//! The chunked DPLR form (SPEC §4), in the structure of FLA's
//! `chunk_dplr_delta_rule`: per chunk the state-independent A blocks
//! (`Aqk`, `Aqb`, `Aab`, `Aak`), the WY inverse `P = (I − Aab)^{-1}`, `w`,
//! `u`; then one pass over the chunks carrying the state (`h`, `v2`, `o`).
//! Backward: output backward, the `dh` recurrence, WY backward, A-block
//! backward, gate (reverse cumsum) backward. Pairwise decays are products
//! of two factors through the chunk's middle row (so the A blocks are
//! matrix products); a chunk whose decays span too wide a range for those
//! factors splits into blocks ([`crate::fast::decay_blocks`]), so nothing
//! overflows.

use ndarray::{s, Array1, Array2, Array3, ArrayBase, ArrayView2, Axis, CowArray, Data, Ix2};

use super::{Dplr, DplrHead, DplrHeadGrads, DplrHeadGradsMut};
use crate::chunked::Stages;
use crate::fast::columns::{
    backward_chunks, forward_chunks, StateColumns, StateGradColumns, StateRows,
};
use crate::fast::decay_blocks::Block;
use crate::fast::fused::{self, gate_grads, GateGrads, GateOperands};
use crate::fast::gemm;
use crate::fast::par::par_chunks;
use crate::fast::tri;
use crate::fast::views;
use crate::precision::{Feature, Stage};
use crate::scalar::{exp_bound, Scalar};

mod safe_gate;

/// The chunked engine: the shell [`crate::chunked::Chunk`] over DPLR's
/// stages.
pub type Chunk = crate::chunked::Chunk<Dplr>;

impl Chunk {
    /// What a policy may ask of this engine (FLA `chunk_dplr_delta_rule`'s
    /// stored tensors): `Aqk` covers `Aqk` and `Aqb`, `Akk` the WY inverse
    /// `P`, `qg/kg` the gated `qg`, `kg`, `ag`, `bg`, `v_new` FLA's `v_new`
    /// (`v2` here).
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
        // The safe-gate A stage's tensor-core operands (`safe_gate.rs`);
        // the non-safe kernel has no products there.
        Feature::Round(Stage::FwdDots),
        Feature::SafeGate,
        Feature::MidpointStride,
    ];

    fn as_stored<T: Scalar>(&self, stage: Stage, mut a: Array2<T>) -> Array2<T> {
        self.policy.round(stage, &mut a);
        a
    }

    /// `q·scale` as FLA's forward reads it: `chunk_dplr_fwd_intra` multiplies
    /// the token-dtype `q` by the float `scale` and Triton keeps the tensor's
    /// dtype, so `Aqk`, `Aqb` and `qg` see it rounded (exact when `scale` is a
    /// power of two). The backward's own products use the raw `q`.
    fn q_read<'a, T: Scalar>(&self, q: ArrayView2<'a, T>) -> CowArray<'a, T, Ix2> {
        self.policy.stored(Stage::Activations, q)
    }

    /// `x ⊙ decay` as FLA stores it (`qg`, `kg`, `ag`, `bg`).
    fn gated<T: Scalar>(&self, x: &ArrayView2<T>, decay: ArrayView2<T>) -> Array2<T> {
        self.as_stored(Stage::Gated, fused::zip_map(x.view(), decay, |x, e| x * e))
    }

    /// [`Chunk::gated`] by the chunk's exponential `which`, without forming
    /// it ([`Intra::times_exp`]).
    fn gated_by<T: Scalar>(&self, ch: &Intra<T>, x: ArrayView2<T>, which: Exp) -> Array2<T> {
        self.as_stored(Stage::Gated, ch.times_exp(x, which))
    }
}

/// One chunk's state-independent quantities (rows = the chunk's tokens).
#[derive(Clone, Debug)]
pub struct Intra<T> {
    pub start: usize,
    /// `[c, c]`: `Aqk`, `Aqb` (j ≤ i), `Aak` (j < i). (`Aab` (j < i) only
    /// enters through `P`.)
    pub aqk: Array2<T>,
    pub aqb: Array2<T>,
    pub aak: Array2<T>,
    /// `P = (I − Aab)^{-1}`, `[c, c]`.
    pub p: Array2<T>,
    /// `w = P (exp(Γx) ⊙ A)`, `[c, K]`; `u = P (Aak V)`, `[c, V]`.
    pub w: Array2<T>,
    pub u: Array2<T>,
    /// How the chunk's exponentials and pairwise decays are formed.
    decays: Decays<T>,
    /// `exp(Γ_last)`, `[K]`: read by the state passes and the backward.
    decay_last: Array1<T>,
}

impl<T: Scalar> Intra<T> {
    pub fn len(&self) -> usize {
        self.w.nrows()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The exponentials `which` of the chunk's decay, `[c, K]` each: rebuilt
    /// through the middle row, which is cheap and keeps a chunk's stored
    /// intermediates small, or the direct exponentials it keeps otherwise.
    /// The same bits as in its intra stage.
    pub(crate) fn exps<const N: usize>(&self, which: [Exp; N]) -> [CowArray<'_, T, Ix2>; N] {
        match &self.decays {
            Decays::Mid { f, mid } => f.rebuild(mid, which).map(CowArray::from),
            Decays::Blocks { exps, .. } => which.map(|e| exps[e as usize].view().into()),
        }
    }

    /// `x ⊙` the exponential `which`, `[c, K]`, unrounded: in one pass
    /// through the middle row (the same operations as rebuilding the
    /// exponential first), or with the direct exponential the chunk keeps.
    fn times_exp(&self, x: ArrayView2<T>, which: Exp) -> Array2<T> {
        match &self.decays {
            Decays::Mid { f, mid } => f.times(x, mid, which),
            Decays::Blocks { exps, .. } => {
                fused::zip_map(x, exps[which as usize].view(), |x, e| x * e)
            }
        }
    }

    /// `exp(Γ_last)`, `[K]` (formed once, in the intra stage).
    fn decay_last(&self) -> &Array1<T> {
        &self.decay_last
    }

    /// `M_chunk = Diag(exp Γ_last) + (B ⊙ exp(Γ_last − Γ))ᵀ w`, `[K, K]`.
    pub fn transition(&self, b: ArrayView2<T>) -> Array2<T> {
        let [dl] = self.exps([Exp::Last]);
        let mut m = gemm::dot((&b * &dl).t(), self.w.view());
        for (d, e) in self.decay_last().iter().enumerate() {
            m[[d, d]] += *e;
        }
        m
    }
}

/// Forward intermediates of one head.
#[derive(Clone, Debug)]
pub struct ChunkForward<T> {
    pub intra: Vec<Intra<T>>,
    /// State entering each chunk, `[NT, K, V]`.
    pub h: Array3<T>,
    /// `v2 = u + w h` (the `aᵀS` terms), `[L, V]`.
    pub v2: Array2<T>,
    pub o: Array2<T>,
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
    /// Per chunk: gradients of `Aqk`, `Aqb`, `Aab`, `Aak`.
    pub da_blocks: Vec<[Array2<T>; 4]>,
    pub grads: DplrHeadGrads<T>,
}

/// One chunk's token gradients: rows of `[dq, dk, da, db, dgk]`, `[c, K]`
/// each, and of `dv`, `[c, V]`.
struct ChunkGrads<T> {
    rows: [Array2<T>; 5],
    dv: Array2<T>,
}

/// An exponential of a chunk's decay that its stages read; as a number, its
/// place among the exponentials a chunk keeps when it forms them directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exp {
    /// `exp(Γ)`
    G,
    /// `exp(Γx)`
    Gx,
    /// `exp(Γ_last − Γ)`
    Last,
}

/// `(exp(Γ), exp(Γx), exp(Γ_last − Γ))` for Γ, Γx `[c, K]`, `[c, K]` each
/// (`exp(Γ_last − Γ)` is at most 1: no overflow), formed directly.
fn direct_exps<T: Scalar>(g: &Array2<T>, gx: &Array2<T>) -> [Array2<T>; 3] {
    let last = g.row(g.nrows() - 1);
    [
        fused::exps(g.view()),
        fused::exps(gx.view()),
        fused::exps((-(g - &last)).view()),
    ]
}

/// Rows of `x` for one chunk.
fn rows<T: Scalar, S: Data<Elem = T>>(
    x: &ArrayBase<S, Ix2>,
    start: usize,
    c: usize,
) -> ArrayView2<'_, T> {
    x.slice(s![start..start + c, ..])
}

/// How a chunk forms its pairwise decays `exp(Γ_i − Γ_j)`,
/// `exp(Γx_i − Γ_j)` and its exponentials `exp(Γ)`, `exp(Γx)`,
/// `exp(Γ_last − Γ)` ([`Intra::exps`]).
#[derive(Clone, Debug)]
enum Decays<T> {
    /// Through the middle row `m`: the factors, and `(exp(Γ_m),
    /// exp(Γ_last − Γ_m))` ([`fused::mid_row_exps`], `[K]` each) that
    /// rebuild the exponentials from them. Cheap, and it keeps a chunk's
    /// stored intermediates small.
    Mid {
        f: Factors<T>,
        mid: (Vec<T>, Vec<T>),
    },
    /// Where the chunk's factors would overflow: in blocks
    /// ([`crate::fast::decay_blocks`]), each with its factors, and the
    /// exponentials formed directly and kept (`[Exp; 3]` order, `[c, K]`
    /// each).
    Blocks {
        blocks: Vec<DecayBlock<T>>,
        exps: [Array2<T>; 3],
    },
}

/// One block of a split chunk's pairwise decays ([`crate::fast::decay_blocks`]):
/// `exp(Γ_i − Γ_j) = f.ep[i]·f.em[j]` and `exp(Γx_i − Γ_j) =
/// f.exp_[i]·f.em[j]` for `i` in `rows`, `j` in `cols`.
#[derive(Clone, Debug)]
struct DecayBlock<T> {
    rows: std::ops::Range<usize>,
    /// `rows` itself on the diagonal (through its middle row, the lower
    /// triangle used); else the rows just before `rows`, through their last.
    cols: std::ops::Range<usize>,
    /// `ep`, `exp_` `[|rows|, K]`, `em` `[|cols|, K]`.
    f: Factors<T>,
}

impl<T> DecayBlock<T> {
    fn diagonal(&self) -> bool {
        self.rows == self.cols
    }
}

/// `exp(Γ − Γ_m)`, `exp(Γx − Γ_m)`, `exp(Γ_m − Γ)` through the chunk's middle row.
#[derive(Clone, Debug)]
struct Factors<T> {
    ep: Array2<T>,
    exp_: Array2<T>,
    em: Array2<T>,
}

impl<T: Scalar> Factors<T> {
    /// The exponentials `which`, `[c, K]` each, rebuilt through the middle
    /// row `m` from `(exp(Γ_m), exp(Γ_last − Γ_m))`
    /// ([`fused::mid_row_exps`]): `exp(Γ − Γ_m)·exp(Γ_m)`,
    /// `exp(Γx − Γ_m)·exp(Γ_m)` and `exp(Γ_m − Γ)·exp(Γ_last − Γ_m)`.
    fn rebuild<const N: usize>(
        &self,
        (e_mid, e_last): &(Vec<T>, Vec<T>),
        which: [Exp; N],
    ) -> [Array2<T>; N] {
        which.map(|e| match e {
            Exp::G => fused::scale_columns(&self.ep, e_mid),
            Exp::Gx => fused::scale_columns(&self.exp_, e_mid),
            Exp::Last => fused::scale_columns(&self.em, e_last),
        })
    }

    /// `x ⊙` the exponential `which` as [`Factors::rebuild`] forms it, in one
    /// pass, `[c, K]`.
    fn times(&self, x: ArrayView2<T>, (e_mid, e_last): &(Vec<T>, Vec<T>), which: Exp) -> Array2<T> {
        match which {
            Exp::G => fused::times_scaled_columns(x, &self.ep, e_mid),
            Exp::Gx => fused::times_scaled_columns(x, &self.exp_, e_mid),
            Exp::Last => fused::times_scaled_columns(x, &self.em, e_last),
        }
    }
}

/// The factors when every exponent stays far from overflow in `T`; `None`
/// sends the caller to [`decay_blocks`].
fn factors<T: Scalar>(g: &Array2<T>, gx: &Array2<T>) -> Option<Factors<T>> {
    let limit = exp_bound::<T>();
    let (mut d, mut dx) = (
        fused::minus_mid_row(g, g, limit)?,
        fused::minus_mid_row(g, gx, limit)?,
    );
    // 2·c·K exponentials per chunk (twice the naive form's): vectorised.
    fused::exps_bounded(&mut d);
    let em = fused::reciprocals(d.view());
    fused::exps_bounded(&mut dx);
    Some(Factors {
        ep: d,
        exp_: dx,
        em,
    })
}

/// The blocks of a chunk whose factors do not fit ([`crate::fast::decay_blocks`]),
/// each with its factors, from Γ and Γx `[c, K]`.
fn decay_blocks<T: Scalar>(g: &Array2<T>, gx: &Array2<T>) -> Vec<DecayBlock<T>> {
    let blocks = crate::fast::decay_blocks::split(0..g.nrows(), &mut |r| {
        if r.len() == 1 {
            // A row's one pair is exp(0) in Aqk and Aqb; Aab and Aak have
            // none (strictly lower), so Γx's factor is never read: zero,
            // where exp(−gk) itself might overflow.
            let ones = Array2::ones((1, g.ncols()));
            return Some(Factors {
                ep: ones.clone(),
                exp_: Array2::zeros((1, g.ncols())),
                em: ones,
            });
        }
        factors(
            &rows(g, r.start, r.len()).to_owned(),
            &rows(gx, r.start, r.len()).to_owned(),
        )
    });
    blocks
        .into_iter()
        .map(|b| match b {
            Block::Diagonal { rows, factors: f } => DecayBlock {
                cols: rows.clone(),
                rows,
                f,
            },
            Block::Below { rows, cols } => {
                // Γx_i = Γ_{i−1} (up to rounding) is at most the anchor's Γ
                // for every row after it: all three factors at most 1.
                let anchor = g.row(cols.end - 1);
                let (r, c) = (s![rows.clone(), ..], s![cols.clone(), ..]);
                let f = Factors {
                    ep: fused::exps((&g.slice(r) - &anchor).view()),
                    exp_: fused::exps((&gx.slice(r) - &anchor).view()),
                    em: fused::exps((-(&g.slice(c) - &anchor)).view()),
                };
                DecayBlock { rows, cols, f }
            }
        })
        .collect()
}

/// The four A blocks `(Aqk, Aqb, Aab, Aak)`, `[c, c]` each, block by block
/// through each block's factors, as the middle-row factors form them for a
/// whole chunk (unmasked: the caller masks).
fn split_a_blocks<T: Scalar>(
    blocks: &[DecayBlock<T>],
    [q, k, a, b]: [&ArrayView2<T>; 4],
) -> [Array2<T>; 4] {
    let c = q.nrows();
    let mut out = [(); 4].map(|_| Array2::zeros((c, c)));
    for blk in blocks {
        let (r, cols) = (s![blk.rows.clone(), ..], s![blk.cols.clone(), ..]);
        let [qa, ax, kb, bb] = fused::products([
            (q.slice(r), blk.f.ep.view()),
            (a.slice(r), blk.f.exp_.view()),
            (k.slice(cols), blk.f.em.view()),
            (b.slice(cols), blk.f.em.view()),
        ]);
        let at = s![blk.rows.clone(), blk.cols.clone()];
        let [aqk, aqb, aab, aak] = &mut out;
        for (dst, (lhs, rhs)) in
            [aqk, aqb, aab, aak]
                .into_iter()
                .zip([(&qa, &kb), (&qa, &bb), (&ax, &bb), (&ax, &kb)])
        {
            if blk.diagonal() {
                dst.slice_mut(at)
                    .assign(&tri::dot_t_lower(lhs.view(), rhs.view(), false));
            } else {
                gemm::dot_to(lhs.view(), rhs.t(), dst.slice_mut(at));
            }
        }
    }
    out
}

impl Chunk {
    /// The intra-chunk stage for tokens `start..start + c` of one head: its
    /// A blocks (`Aqk`, `Aqb`, `Aab`, `Aak`, `[c, c]`), WY factors and
    /// decays, as this engine's policy stores them.
    pub fn intra<T: Scalar>(&self, x: &DplrHead<T>, start: usize, c: usize) -> Intra<T> {
        let x = &x.standard();
        let q_read = self.q_read(rows(&x.q, start, c));
        let (q, k, a, b, v) = (
            q_read.view(),
            rows(&x.k, start, c),
            rows(&x.a, start, c),
            rows(&x.b, start, c),
            rows(&x.v, start, c),
        );
        let mut g = rows(&x.gk, start, c).to_owned();
        self.policy.cumsum_rows(&mut g);
        let gx = fused::zip_map(g.view(), rows(&x.gk, start, c), |g, gk| g - gk);
        let decay_last = fused::exps_of_last_row(&g);
        // FLA's safe gate switches the A stage to its midpoint-anchored
        // tensor-core kernel (`safe_gate.rs`); otherwise the oracle's own
        // factorisation, whose values are those of FLA's per-pair exps.
        let (decays, [aqk, aqb, aab, aak]) = if self.policy.safe_gate_at(self.chunk_size) {
            self.safe_gate_a_stage(x, start, &g, &gx, [q, k, a, b])
        } else {
            self.a_stage(&g, &gx, [q, k, a, b])
        };
        // (I − Aab)^{-1} (Aab strictly lower).
        let p = self.as_stored(
            Stage::Akk,
            crate::fast::tri::unit_lower_inverse(c, |i, j| aab[[i, j]]),
        );
        let ax = match &decays {
            Decays::Mid { f, mid } => self.as_stored(Stage::Gated, f.times(a, mid, Exp::Gx)),
            Decays::Blocks { exps, .. } => self.gated(&a, exps[Exp::Gx as usize].view()),
        };
        let w = self.as_stored(Stage::W, tri::lower_dot(p.view(), ax.view()));
        let u = self.as_stored(
            Stage::U,
            tri::lower_dot(p.view(), tri::lower_dot(aak.view(), v).view()),
        );
        Intra {
            start,
            aqk,
            aqb,
            aak,
            p,
            w,
            u,
            decays,
            decay_last,
        }
    }

    /// The A blocks `(Aqk, Aqb, Aab, Aak)`, `[c, c]` each, masked and stored
    /// as FLA's non-safe `chunk_dplr_fwd_intra` stores them (all four
    /// rounded to the token dtype), and how the chunk forms its decays, from
    /// Γ, Γx `[c, K]` and the chunk's `q` (as read), `k`, `a`, `b` `[c, K]`.
    fn a_stage<T: Scalar>(
        &self,
        g: &Array2<T>,
        gx: &Array2<T>,
        [q, k, a, b]: [ArrayView2<T>; 4],
    ) -> (Decays<T>, [Array2<T>; 4]) {
        // The factors bound every row's distance to Γ_m, Γx_0 = 0 included,
        // so the middle-row exponentials are normal wherever they exist.
        let decays = match factors(g, gx).and_then(|f| Some((f, fused::mid_row_exps(g)?))) {
            Some((f, mid)) => Decays::Mid { f, mid },
            None => Decays::Blocks {
                blocks: decay_blocks(g, gx),
                exps: direct_exps(g, gx),
            },
        };
        let mut a_blocks = match &decays {
            Decays::Mid { f, .. } => {
                // exp(Γ_i − Γ_j) = exp(Γ_i − Γ_m)·exp(Γ_m − Γ_j): matrix products.
                let [qa, ax, kb, bb] = fused::products([
                    (q, f.ep.view()),
                    (a, f.exp_.view()),
                    (k, f.em.view()),
                    (b, f.em.view()),
                ]);
                let [aqk, aak] = tri::dot_t_lower_each([qa.view(), ax.view()], kb.view(), false);
                let [aqb, aab] = tri::dot_t_lower_each([qa.view(), ax.view()], bb.view(), false);
                [aqk, aqb, aab, aak]
            }
            Decays::Blocks { blocks, .. } => split_a_blocks(blocks, [&q, &k, &a, &b]),
        };
        // Only the lower triangles are used (Aab, Aak strictly lower).
        for (i, blk) in a_blocks.iter_mut().enumerate() {
            tri::mask_lower(blk, i < 2);
        }
        let [aqk, aqb, aab, aak] = a_blocks;
        // FLA's `chunk_dplr_fwd_intra` rounds all four blocks to the token
        // dtype (`Aab`, `Aak` through `.to(Aqb.dtype)` into fp32 tensors).
        let [aqk, aqb, aab, aak] = [aqk, aqb, aab, aak].map(|a| self.as_stored(Stage::Aqk, a));
        (decays, [aqk, aqb, aab, aak])
    }

    pub(crate) fn intras<T: Scalar>(&self, x: &DplrHead<T>) -> Vec<Intra<T>> {
        let x = &x.standard();
        // Independent per chunk: in parallel, collected in chunk order.
        par_chunks(x.len().div_ceil(self.chunk_size), |n| self.intra_of(x, n))
    }

    /// Chunk `n`'s intra stage.
    fn intra_of<T: Scalar>(&self, x: &DplrHead<T>, n: usize) -> Intra<T> {
        let start = n * self.chunk_size;
        self.intra(x, start, self.chunk_size.min(x.len() - start))
    }

    /// The forward pass with every intermediate.
    pub fn forward_intermediates<T: Scalar>(
        &self,
        x: &DplrHead<T>,
        h0: ArrayView2<T>,
    ) -> ChunkForward<T> {
        self.forward_pass(&x.standard(), h0, true)
    }

    /// The forward pass; without `read_out` (what the backward recomputes)
    /// `o` is left empty, `[0, V]`.
    fn forward_pass<T: Scalar>(
        &self,
        x: &DplrHead<T>,
        h0: ArrayView2<T>,
        read_out: bool,
    ) -> ChunkForward<T> {
        let (intra, StateColumns { h, v_new, o, state }) = forward_chunks(
            x.len(),
            self.chunk_size,
            h0,
            read_out,
            |n| self.intra_of(x, n),
            |ch, state, out, cols| self.state_step(x, ch, state, out, cols, read_out),
        );
        ChunkForward {
            intra,
            h,
            v2: v_new,
            o,
            final_state: state,
        }
    }

    /// One chunk's forward state step over the value columns `cols`
    /// ([`crate::fast::par::par_columns`]): pushes the state entering it as
    /// stored, `v2` (its `v_new`) and (with `read_out`) `o` to `out`, and
    /// carries `state` (`[K, w]`, those columns) over the chunk.
    fn state_step<T: Scalar>(
        &self,
        x: &DplrHead<T>,
        ch: &Intra<T>,
        state: &mut Array2<T>,
        out: &mut StateRows<T>,
        cols: std::ops::Range<usize>,
        read_out: bool,
    ) {
        let c = ch.len();
        let v = rows(&x.v, ch.start, c).slice_move(s![.., cols.clone()]);
        // The state as stored, a copy only where it is rounded.
        let hn = self.policy.stored(Stage::H, state.view());
        let hn = hn.view();
        let qg = read_out
            .then(|| self.gated_by(ch, self.q_read(rows(&x.q, ch.start, c)).view(), Exp::G));
        // v2 = u + w h.
        let v2n = self.as_stored(
            Stage::VNew,
            fused::zip_map(
                ch.u.slice(s![.., cols.clone()]),
                gemm::dot(ch.w.view(), hn).view(),
                |u, x| u + x,
            ),
        );
        // o = Aqk V + Aqb v2 + qg h, one sum per element.
        if let Some(qg) = &qg {
            let mut o = tri::lower_dot(ch.aqk.view(), v);
            tri::lower_dot_add(ch.aqb.view(), v2n.view(), o.view_mut());
            gemm::dot_add(qg.view(), hn, o.view_mut());
            out.push_o(o.view());
        }
        let (kgl, bgl) = (
            self.gated_by(ch, rows(&x.k, ch.start, c), Exp::Last),
            self.gated_by(ch, rows(&x.b, ch.start, c), Exp::Last),
        );
        out.push(hn, v2n.view());
        fused::decay_add_products(
            state,
            ch.decay_last(),
            &[(kgl.t(), v.view()), (bgl.t(), v2n.view())],
        );
    }

    /// The backward pass with every intermediate.
    pub fn backward_intermediates<T: Scalar>(
        &self,
        x: &DplrHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> ChunkBackward<T> {
        let x = &x.standard();
        self.backward_from(x, &self.forward_pass(x, h0, false), d_o, dht, true)
    }

    /// The backward pass given the forward's intermediates `fwd`; `dh` and
    /// the per-chunk A-block gradients are kept only with `keep_blocks`
    /// (else left empty: only the intermediates need them).
    fn backward_from<T: Scalar>(
        &self,
        x: &DplrHead<T>,
        fwd: &ChunkForward<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        keep_blocks: bool,
    ) -> ChunkBackward<T> {
        let mut grads = DplrHeadGrads::zeros(x.len(), x.k_dim(), x.v_dim());
        let (dh, da_blocks) = self.backward_into(x, fwd, d_o, dht, keep_blocks, grads.view_mut());
        ChunkBackward {
            dh,
            da_blocks,
            grads,
        }
    }

    /// [`Chunk::backward_from`] writing the gradients into `gr`, each
    /// chunk's rows as they are computed; returns `(dh, A-block gradients)`,
    /// both empty without `keep_blocks`.
    #[allow(clippy::type_complexity)]
    fn backward_into<T: Scalar>(
        &self,
        x: &DplrHead<T>,
        fwd: &ChunkForward<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        keep_blocks: bool,
        mut gr: DplrHeadGradsMut<T>,
    ) -> (Array3<T>, Vec<[Array2<T>; 4]>) {
        let chunks: Vec<_> = fwd
            .intra
            .iter()
            .map(|ch| ch.start..ch.start + ch.len())
            .collect();
        let mut da_blocks = vec![];
        let StateGradColumns { dh, dh0, .. } = backward_chunks(
            d_o,
            dht,
            &chunks,
            keep_blocks,
            |dh| self.policy.round(Stage::Dh, dh),
            |n, d_o, ds_used, ds| self.state_backward(x, &fwd.intra[n], d_o, ds_used, ds),
            |n, ds, dv2n| self.chunk_backward(x, &fwd.intra[n], fwd, n, d_o, ds, dv2n),
            |n, (grads, blocks): (ChunkGrads<T>, _)| {
                let rows = s![chunks[n].clone(), ..];
                let token_rows = [&mut gr.dq, &mut gr.dk, &mut gr.da, &mut gr.db, &mut gr.dgk];
                for (dst, src) in token_rows.into_iter().zip(&grads.rows) {
                    views::copy_into(dst.slice_mut(rows), src.view());
                }
                views::copy_into(gr.dv.slice_mut(rows), grads.dv.view());
                if keep_blocks {
                    da_blocks.push(blocks);
                }
            },
        );
        views::copy_into(gr.dh0.view_mut(), dh0.view());
        (dh, da_blocks)
    }

    /// The state pass of one chunk's backward given `ds_used = ∂L/∂(state at
    /// its end)` as FLA stores it (`dh`), for `w` value columns (`do`
    /// `[L, w]`, `ds_used` `[K, w]`): returns `dv2 [c, w]` and takes the
    /// carried `ds` `[K, w]` (in the compute scalar) back to the chunk's start.
    fn state_backward<T: Scalar>(
        &self,
        x: &DplrHead<T>,
        ch: &Intra<T>,
        d_o: ArrayView2<T>,
        ds_used: ArrayView2<T>,
        ds: &mut Array2<T>,
    ) -> Array2<T> {
        let (c, st) = (ch.len(), ch.start);
        let (q, b) = (rows(&x.q, st, c), rows(&x.b, st, c));
        let dout = d_o.slice(s![st..st + c, ..]);
        let qg = self.gated_by(ch, self.q_read(q).view(), Exp::G);
        // S' = Diag(e^Γlast) h + (K ⊙ dl)ᵀ V + (B ⊙ dl)ᵀ v2, v2 = u + w h.
        let mut dv2 = tri::lower_t_dot(ch.aqb.view(), dout);
        let bgl = self.gated_by(ch, b, Exp::Last);
        gemm::dot_add(bgl.view(), ds_used, dv2.view_mut());
        let dv2 = self.as_stored(Stage::Dv, dv2);
        fused::decay_add_products(
            ds,
            ch.decay_last(),
            &[(qg.t(), dout), (ch.w.t(), dv2.view())],
        );
        dv2
    }

    /// Backward through chunk `n` given `ds = ∂L/∂(state at its end)` and
    /// `dv2` of its rows (from the state pass): the chunk's token gradients
    /// and the A-block gradients.
    #[allow(clippy::too_many_arguments)]
    fn chunk_backward<T: Scalar>(
        &self,
        x: &DplrHead<T>,
        ch: &Intra<T>,
        fwd: &ChunkForward<T>,
        n: usize,
        d_o: ArrayView2<T>,
        ds: ArrayView2<T>,
        dv2: ArrayView2<T>,
    ) -> (ChunkGrads<T>, [Array2<T>; 4]) {
        let (c, st) = (ch.len(), ch.start);
        let r = s![st..st + c, ..];
        let (q, k, a, b, v) = (
            rows(&x.q, st, c),
            rows(&x.k, st, c),
            rows(&x.a, st, c),
            rows(&x.b, st, c),
            rows(&x.v, st, c),
        );
        let h = fwd.h.index_axis(Axis(0), n);
        let v2 = fwd.v2.slice(r);
        let dout = d_o.slice(r);
        let [eg, egx, dl] = ch.exps([Exp::G, Exp::Gx, Exp::Last]);
        let decay_last = ch.decay_last();
        // FLA stores the gated tensors' gradients (`chunk_dplr_bwd_o`:
        // dqg, dkg, dbg, dw; `chunk_dplr_bwd_wy`: dag) in the token dtype.
        // One product for dqg = dO hᵀ and dw = dv2 hᵀ (v2 = u + w h).
        let dqg_dw = tri::stacked_dot(&[dout, dv2], h.t());
        let dqg = self
            .policy
            .stored(Stage::BwdOperands, dqg_dw.slice(s![..c, ..]));
        // dAqk and (below) dAak multiply by vᵀ: one packing of it.
        let dz = tri::lower_t_dot(ch.p.view(), dv2);
        let [mut daqk, mut daak] = tri::dot_t_lower_each([dout, dz.view()], v, false);
        let mut daqb = tri::dot_t_lower(dout, v2, false);
        tri::mask_lower(&mut daqk, true);
        tri::mask_lower(&mut daqb, true);
        // dv = Aqkᵀ dO + (K ⊙ dl) ds + Aakᵀ dz, one sum per element (below).
        let mut dv = tri::lower_t_dot(ch.aqk.view(), dout);
        // State: S' = Diag(e^Γlast) h + (K ⊙ dl)ᵀ V + (B ⊙ dl)ᵀ v2.
        let (kgl, bgl) = (self.gated(&k, dl.view()), self.gated(&b, dl.view()));
        // `tl.sum((b_h * b_dh).to(tl.float32))`: the product of the two bf16
        // operands is rounded to bf16 before the fp32 sum (`chunk_dplr_bwd_o`).
        let hdh = self.as_stored(Stage::BwdOperands, fused::zip_map(h, ds, |h, d| h * d));
        let mut dgamma_last: Array1<T> = hdh.sum_axis(Axis(1)) * decay_last;
        // The fp32 accumulators `b_dk`, `b_db` of `chunk_dplr_bwd_o` (one
        // product), and their bf16 stores `dkg`, `dbg`.
        let dkbg_acc = tri::stacked_dot(&[v, v2], ds.t());
        let (dkg_acc, dbg_acc) = (dkbg_acc.slice(s![..c, ..]), dkbg_acc.slice(s![c.., ..]));
        let dkgl = self.policy.stored(Stage::BwdOperands, dkg_acc);
        let dbgl = self.policy.stored(Stage::BwdOperands, dbg_acc);
        gemm::dot_add(kgl.view(), ds, dv.view_mut());
        let dw = self
            .policy
            .stored(Stage::BwdOperands, dqg_dw.slice(s![c.., ..]));
        // u = P (Aak V), w = P (e^Γx ⊙ A), P = (I − Aab)^{-1}.
        let zv = tri::lower_dot(ch.aak.view(), v);
        let ax = self.gated(&a, egx.view());
        // Only dP's strict lower triangle reaches dAab (P is unit lower triangular).
        let mut dp = tri::dot_t_lower(dv2, zv.view(), false);
        tri::dot_t_lower_add(dw.view(), ax.view(), false, dp.view_mut());
        tri::mask_lower(&mut daak, false);
        tri::lower_t_dot_add(ch.aak.view(), dz.view(), dv.view_mut());
        let dax = self.as_stored(Stage::BwdOperands, tri::lower_t_dot(ch.p.view(), dw.view()));
        let mut daab = tri::dot_t_lower(
            tri::lower_t_dot(ch.p.view(), dp.view()).view(),
            ch.p.view(),
            true,
        );
        tri::mask_lower(&mut daab, false);
        let GateGrads {
            rows: [mut dq, mut dk, mut da, mut db, mut dgamma, mut dgx],
            last,
        } = gate_grads(GateOperands {
            q,
            k,
            b,
            eg: eg.view(),
            egx: egx.view(),
            dl: dl.view(),
            ax: ax.view(),
            kgl: kgl.view(),
            bgl: bgl.view(),
            dax: dax.view(),
            dqg: dqg.view(),
            dkgl: dkgl.view(),
            dbgl: dbgl.view(),
            dkg_acc,
            dbg_acc,
        });
        for l in last {
            dgamma_last += &l;
        }
        blocks_backward(
            ch,
            [&q, &k, &a, &b],
            [&daqk, &daqb, &daab, &daak],
            [&mut dq, &mut dk, &mut da, &mut db],
            [&mut dgamma, &mut dgx],
        );
        // Γlast is Γ's last row; Γx = Γ − gk; Γ = cumsum(gk).
        let mut last = dgamma.row_mut(c - 1);
        last += &dgamma_last;
        fused::add_assign(&mut dgamma, dgx.view());
        fused::reverse_cumsum_rows(&mut dgamma);
        let dgk = fused::zip_map(dgamma.view(), dgx.view(), |g, x| g - x);
        let rows = [dq, dk, da, db, dgk];
        (ChunkGrads { rows, dv }, [daqk, daqb, daab, daak])
    }
}

/// Through the four A blocks (pairwise decays `e^{Γ_i − Γ_j}` for Aqk/Aqb,
/// `e^{Γx_i − Γ_j}` for Aab/Aak): gradients of q, k, a, b, Γ and Γx.
fn blocks_backward<T: Scalar>(
    ch: &Intra<T>,
    x: [&ArrayView2<T>; 4],
    da_blocks: [&Array2<T>; 4],
    grads: [&mut Array2<T>; 4],
    dgammas: [&mut Array2<T>; 2],
) {
    let [dq, dk, da, db] = grads.map(fused::flat_mut);
    let [dgamma, dgx] = dgammas.map(fused::flat_mut);
    let out = [dq, dk, da, db, dgamma, dgx];
    match &ch.decays {
        Decays::Mid { f, .. } => {
            factored_blocks_backward(f, x.map(|x| x.view()), da_blocks.map(|a| a.view()), out)
        }
        Decays::Blocks { blocks, .. } => {
            let kd = x[0].ncols();
            let mut out = out;
            for blk in blocks {
                let (r, at) = (
                    s![blk.rows.clone(), ..],
                    s![blk.rows.clone(), blk.cols.clone()],
                );
                let da_blk = da_blocks.map(|a| a.slice(at));
                if blk.diagonal() {
                    let rows = blk.rows.start * kd..blk.rows.end * kd;
                    let out = out.each_mut().map(|o| &mut o[rows.clone()]);
                    factored_blocks_backward(&blk.f, x.map(|x| x.slice(r)), da_blk, out);
                } else {
                    below_blocks_backward(blk, x, da_blk, out.each_mut().map(|o| &mut **o));
                }
            }
        }
    }
}

/// What the A blocks' gradients send the factored operands of a block of
/// pairs, `[dqa, dax, dkb, dbb]` (each a sum of two products, one sum per
/// element), then the operands `[qa, ax, kb, bb]` (`q`, `a` on its rows
/// times `f.ep`, `f.exp_`; `k`, `b` on its columns times `f.em`), with the
/// products of [`crate::fast::decay_blocks::grad_products`].
fn factored_grads<T: Scalar>(
    f: &Factors<T>,
    [q, k, a, b]: [ArrayView2<T>; 4],
    [daqk, daqb, daab, daak]: [ArrayView2<T>; 4],
    diagonal: bool,
) -> [Array2<T>; 8] {
    // Γ's anchor cancels in every product, so it is held constant.
    let [qa, ax, kb, bb] = fused::products([
        (q, f.ep.view()),
        (a, f.exp_.view()),
        (k, f.em.view()),
        (b, f.em.view()),
    ]);
    let (l, l_add, lt, lt_add) = crate::fast::decay_blocks::grad_products(diagonal);
    let sum = |first: crate::fast::decay_blocks::Dot<T>,
               then: crate::fast::decay_blocks::DotAdd<T>,
               [(x1, y1), (x2, y2)]: [(ArrayView2<T>, &Array2<T>); 2]| {
        let mut s = first(x1, y1.view());
        then(x2, y2.view(), s.view_mut());
        s
    };
    let dqa = sum(l, l_add, [(daqk, &kb), (daqb, &bb)]);
    let dax = sum(l, l_add, [(daab, &bb), (daak, &kb)]);
    let dkb = sum(lt, lt_add, [(daqk, &qa), (daak, &ax)]);
    let dbb = sum(lt, lt_add, [(daqb, &qa), (daab, &ax)]);
    [dqa, dax, dkb, dbb, qa, ax, kb, bb]
}

/// [`blocks_backward`] for rows whose pairs go through the factors `f` of
/// one middle row (the whole chunk's, or a diagonal block's): `q`, `k`, `a`,
/// `b` `[n, K]` those rows, the A blocks' gradients `[n, n]` their pairs,
/// and `dq`, `dk`, `da`, `db`, `dΓ`, `dΓx` those rows (row-major, added to).
fn factored_blocks_backward<T: Scalar>(
    f: &Factors<T>,
    [q, k, a, b]: [ArrayView2<T>; 4],
    [daqk, daqb, daab, daak]: [ArrayView2<T>; 4],
    [dq_, dk_, da_, db_, dg_, dgx_]: [&mut [T]; 6],
) {
    let grads = factored_grads(f, [q, k, a, b], [daqk, daqb, daab, daak], true);
    let flats = grads.each_ref().map(|x| fused::flat(x.view()));
    let factors = [&f.ep, &f.exp_, &f.em].map(|x| fused::flat(x.view()));
    let n = grads[0].len();
    let [dqa_, dax_, dkb_, dbb_, qa_, ax_, kb_, bb_] = flats.each_ref().map(|x| &x[..n]);
    let [ep_, exp_, em_] = factors.each_ref().map(|x| &x[..n]);
    let [dq_, dk_, da_, db_, dg_, dgx_] = [dq_, dk_, da_, db_, dg_, dgx_].map(|x| &mut x[..n]);
    crate::fast::simd::dispatch(
        #[inline(always)]
        || {
            for i in 0..n {
                dq_[i] += dqa_[i] * ep_[i];
                da_[i] += dax_[i] * exp_[i];
                dk_[i] += dkb_[i] * em_[i];
                db_[i] += dbb_[i] * em_[i];
                dg_[i] += dqa_[i] * qa_[i] - dkb_[i] * kb_[i] - dbb_[i] * bb_[i];
                dgx_[i] += dax_[i] * ax_[i];
            }
        },
    );
}

/// [`blocks_backward`] for the pairs of a block below the diagonal,
/// `blk.rows` against `blk.cols` through `blk`'s factors: `q`, `k`, `a`,
/// `b` and `dq`, `dk`, `da`, `db`, `dΓ`, `dΓx` the chunk's (row-major,
/// added to), the A blocks' gradients the block's `[|rows|, |cols|]`.
fn below_blocks_backward<T: Scalar>(
    blk: &DecayBlock<T>,
    [q, k, a, b]: [&ArrayView2<T>; 4],
    [daqk, daqb, daab, daak]: [ArrayView2<T>; 4],
    [dq, dk, da, db, dg, dgx]: [&mut [T]; 6],
) {
    let (r, cols) = (s![blk.rows.clone(), ..], s![blk.cols.clone(), ..]);
    let rows_and_cols = [q.slice(r), k.slice(cols), a.slice(r), b.slice(cols)];
    let grads = factored_grads(&blk.f, rows_and_cols, [daqk, daqb, daab, daak], false);
    let [dqa, dax, dkb, dbb, qa, ax, kb, bb] = grads.each_ref().map(|x| fused::flat(x.view()));
    let [ep, exp_, em] = [&blk.f.ep, &blk.f.exp_, &blk.f.em].map(|x| fused::flat(x.view()));
    let kd = q.ncols();
    let rows = blk.rows.start * kd..blk.rows.end * kd;
    for (i, j) in rows.enumerate() {
        dq[j] += dqa[i] * ep[i];
        da[j] += dax[i] * exp_[i];
        dg[j] += dqa[i] * qa[i];
        dgx[j] += dax[i] * ax[i];
    }
    let cols = blk.cols.start * kd..blk.cols.end * kd;
    for (i, j) in cols.enumerate() {
        dk[j] += dkb[i] * em[i];
        db[j] += dbb[i] * em[i];
        dg[j] -= dkb[i] * kb[i] + dbb[i] * bb[i];
    }
}

impl crate::chunked::Spans for Dplr {}

impl<T: Scalar> Stages<T> for Dplr {
    type Forward = ChunkForward<T>;

    fn head_len(x: &DplrHead<T>) -> usize {
        x.len()
    }

    /// A chunk's rows of the head are read by its intra stage, state step,
    /// state backward and chunk backward: one copy of the head in standard
    /// layout serves them all (copying each chunk's rows where it is read,
    /// as KDA's two readers do, was level here and slower on one long
    /// pair).
    fn staged<'a>(x: &'a DplrHead<'_, T>) -> DplrHead<'a, T> {
        x.standard()
    }

    fn span<'a>(x: &'a DplrHead<'_, T>, r: std::ops::Range<usize>) -> DplrHead<'a, T> {
        x.standard_rows(r)
    }

    fn forward_pass(
        e: &Chunk,
        x: &DplrHead<T>,
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
        x: &DplrHead<T>,
        fwd: &ChunkForward<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> DplrHeadGrads<T> {
        e.backward_from(x, fwd, d_o, dht, false).grads
    }

    fn backward_into(
        e: &Chunk,
        x: &DplrHead<T>,
        fwd: &ChunkForward<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        gr: DplrHeadGradsMut<T>,
    ) {
        e.backward_into(x, fwd, d_o, dht, false, gr);
    }

    fn sink_rows<'a>(
        gr: &'a mut DplrHeadGradsMut<'_, T>,
        r: std::ops::Range<usize>,
        dh0: ndarray::ArrayViewMut2<'a, T>,
    ) -> DplrHeadGradsMut<'a, T> {
        gr.rows_mut(r, dh0)
    }

    fn sink_dh0<'a>(gr: crate::chunked::Sink<'a, T, Self>) -> ndarray::ArrayViewMut2<'a, T> {
        gr.dh0
    }

    /// `M = Π M_chunk`, later chunks on the left.
    fn transition(e: &Chunk, x: &DplrHead<T>) -> Array2<T> {
        let x = &x.standard();
        let mut m = Array2::eye(x.k_dim());
        for ch in e.intras(x) {
            m = gemm::dot(
                ch.transition(rows(&x.b, ch.start, ch.len())).view(),
                m.view(),
            );
            e.policy.round(Stage::MChain, &mut m);
        }
        m
    }
}
