//! The chunked form (SPEC §3.1), in the structure of FLA's `chunk_kda`:
//! per chunk of `C` tokens the state-independent "intra" quantities (Γ,
//! `Akk`, `Aqk`, `w`, `u`, `qg`, `kg`), then one pass over the chunks carrying
//! the state (`h`, `v_new`, `o`). Backward follows `chunk_kda_bwd`: output
//! backward, the `dh` recurrence over chunks, WY backward, intra-chunk
//! backward, gate (reverse cumsum) backward.
//!
//! A pairwise decay `exp(Γ_r − Γ_s)` is a product of two factors through
//! the chunk's middle row `m`, `exp(Γ_r − Γ_m)·exp(Γ_m − Γ_s)` (so the
//! pairs are matrix products); a chunk whose decays span too wide a range
//! for those factors splits into blocks ([`crate::fast::decay_blocks`]), so
//! strong decays never overflow. A [`Policy`] rounds each stored stage for
//! precision emulation; the default policy is exact.

use ndarray::{s, Array1, Array2, Array3, ArrayD, ArrayView1, ArrayView2, Axis, CowArray, Ix2};

use super::{
    Kda, KdaGrads, KdaHead, KdaHeadGrads, KdaHeadGradsMut, KdaInputs, KdaOptions, KdaOutputs,
    Prepared,
};
use crate::error::Result;
use crate::fast::columns::{
    backward_chunks, forward_chunks, StateColumns, StateGradColumns, StateRows,
};
use crate::fast::decay_blocks::Block;
use crate::fast::fused;
use crate::fast::gemm;
use crate::fast::par::{par_chunks, par_pairs};
use crate::fast::tri;
use crate::fast::views;
use crate::op::{self, Engine, HeadSink, Operator};
use crate::precision::{Feature, Policy, Stage};
use crate::scalar::{exp_bound, Scalar};
use crate::varlen::Segment;

/// The chunked engine.
#[derive(Clone, Debug, PartialEq)]
pub struct Chunk {
    pub chunk_size: usize,
    pub policy: Policy,
    /// Tokens per span of a long pair's forward+backward
    /// ([`crate::fast::spans::in_spans`]); a multiple of `chunk_size`.
    span_len: usize,
}

impl Chunk {
    /// Chunk sizes of FLA's kernels: 16, 32 or 64.
    pub fn new(chunk_size: usize) -> Result<Self> {
        Ok(Chunk::sized(crate::registry::ChunkSize::new(chunk_size)?))
    }

    /// The engine with chunks of `c` tokens.
    pub fn sized(c: crate::registry::ChunkSize) -> Self {
        Chunk {
            chunk_size: c.get(),
            policy: Policy::exact(),
            span_len: crate::fast::spans::SPAN_LEN,
        }
    }

    /// The same engine with stages rounded per `policy`.
    pub fn with_policy(self, policy: Policy) -> Self {
        Chunk { policy, ..self }
    }

    /// The same engine with spans of `tokens` (a positive multiple of the
    /// chunk size) for long pairs. The results do not depend on it.
    pub fn with_span_len(self, tokens: usize) -> Result<Self> {
        crate::fast::spans::check_span_len(tokens, self.chunk_size)?;
        Ok(Chunk {
            span_len: tokens,
            ..self
        })
    }

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

    /// Rounds `a` to the storage of the backward's low-precision operands.
    fn operand<T: Scalar>(&self, mut a: Array2<T>) -> Array2<T> {
        self.policy.round(Stage::BwdOperands, &mut a);
        a
    }

    /// `Σ_v h[k,v]·dh[k,v]` per key dim (`h`, `dh` `[K, V]`; returns `[K]`)
    /// as FLA's decay gradient forms it: products of the bf16 operands, and
    /// with a [`Stage::HdhSum`] storage each block of `BV` = 64 values
    /// reduced in it by 8 lanes of 8 values (`Dtype::lane_sum`; this
    /// order matched FLA's `dg` error best on an H100) before the blocks add
    /// in the compute scalar. A short last block is zero-padded, as the
    /// masked load is, which changes no sum.
    fn decay_sums<T: Scalar>(&self, h: ArrayView2<T>, dh: ArrayView2<T>) -> Array1<T> {
        const BV: usize = 64;
        const PER_LANE: usize = 8;
        let prods = self.operand(fused::zip_map(h, dh, |h, d| h * d));
        let Some(st) = self.policy.store(Stage::HdhSum) else {
            return prods.sum_axis(Axis(1));
        };
        prods
            .rows()
            .into_iter()
            .map(|row| {
                let row = row.to_vec();
                row.chunks(BV).fold(T::zero(), |acc, block| {
                    let mut padded = block.to_vec();
                    padded.resize(BV, T::zero());
                    acc + st.lane_sum(&padded, PER_LANE)
                })
            })
            .collect()
    }
}

/// `chunk::forward(x, opt, C)`: the chunked engine over a whole batch.
pub fn forward<T: Scalar>(
    x: &KdaInputs<T>,
    opt: &KdaOptions,
    chunk_size: usize,
) -> Result<KdaOutputs<T>> {
    op::forward(&Chunk::new(chunk_size)?, x, opt)
}

/// `chunk::backward(x, opt, do, dht, C)`.
pub fn backward<T: Scalar>(
    x: &KdaInputs<T>,
    opt: &KdaOptions,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
    chunk_size: usize,
) -> Result<KdaGrads<T>> {
    op::backward(&Chunk::new(chunk_size)?, x, opt, d_o, dht)
}

/// One chunk's state-independent quantities (rows = the chunk's tokens).
#[derive(Clone, Debug)]
pub struct Intra<T> {
    /// First token of the chunk inside its head.
    pub start: usize,
    /// Γ: in-chunk cumulative log-decay, `[c, K]`.
    pub g_cumsum: Array2<T>,
    /// `(I + L)^{-1}` (unit lower triangular), `[c, c]`.
    pub n_inv: Array2<T>,
    /// `Akk = (I + L)^{-1} Diag(β)`, `[c, c]`.
    pub akk: Array2<T>,
    /// `Aqk[r, s] = Σ q_r k_s exp(Γ_r − Γ_s)`, `s ≤ r`, `[c, c]`.
    pub aqk: Array2<T>,
    /// `Σ k_r k_s exp(Γ_r − Γ_s)`, `s < r` (L without β), `[c, c]`.
    pub p: Array2<T>,
    /// `w = Akk (exp(Γ) ⊙ K)`, `[c, K]`.
    pub w: Array2<T>,
    /// `u = Akk V`, `[c, V]`.
    pub u: Array2<T>,
    /// `Q ⊙ exp(Γ)`, `[c, K]`.
    pub qg: Array2<T>,
    /// `K ⊙ exp(Γ_last − Γ)`, `[c, K]`.
    pub kg: Array2<T>,
    /// How the chunk forms its pairwise decays and exponentials.
    decays: Decays<T>,
    /// `exp(Γ_last)`, `[K]`: read by the state passes and the backward.
    decay_last: Array1<T>,
}

impl<T: Scalar> Intra<T> {
    pub fn len(&self) -> usize {
        self.g_cumsum.nrows()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `exp(Γ_last)`, `[K]` (formed once, in the intra stage).
    pub fn decay_last(&self) -> &Array1<T> {
        &self.decay_last
    }

    /// `M_chunk = Diag(exp Γ_last) − kgᵀ w`, `[K, K]`.
    pub fn transition(&self) -> Array2<T> {
        let mut m = -gemm::dot(self.kg.t(), self.w.view());
        for (d, e) in self.decay_last().iter().enumerate() {
            m[[d, d]] += *e;
        }
        m
    }
}

/// How a chunk forms its pairwise decays `exp(Γ_r − Γ_s)` and its
/// exponentials `(exp(Γ), exp(Γ_last − Γ))` ([`Decays::exps`]).
#[derive(Clone, Debug)]
enum Decays<T> {
    /// Through the middle row `m`: the factors `(exp(Γ − Γ_m),
    /// exp(Γ_m − Γ))`, `[c, K]` each, and `(exp(Γ_m), exp(Γ_last − Γ_m))`,
    /// `[K]` each, that rebuild the exponentials from them. Cheap, and it
    /// keeps a chunk's stored intermediates small.
    Mid {
        factors: (Array2<T>, Array2<T>),
        mid: (Vec<T>, Vec<T>),
    },
    /// The factors for the pairwise decays, with the exponentials formed
    /// directly and kept (`[c, K]` each, unrounded): under FLA's `exp2`, or
    /// where a middle-row exponential is not normal.
    Factored {
        factors: (Array2<T>, Array2<T>),
        exps: [Array2<T>; 2],
    },
    /// Where the chunk's factors would overflow: in blocks
    /// ([`crate::fast::decay_blocks`]), each with its factors, and the
    /// exponentials formed directly and kept.
    Blocks {
        blocks: Vec<DecayBlock<T>>,
        exps: [Array2<T>; 2],
    },
    /// Each pairwise decay from its difference (under FLA's `safe_gate`),
    /// with the exponentials formed directly and kept.
    Pairs { exps: [Array2<T>; 2] },
}

/// One block of a split chunk's pairwise decays ([`crate::fast::decay_blocks`]):
/// `exp(Γ_r − Γ_s) = row[r]·col[s]` for `r` in `rows`, `s` in `cols`.
#[derive(Clone, Debug)]
struct DecayBlock<T> {
    rows: std::ops::Range<usize>,
    /// `rows` itself on the diagonal (through its middle row, the lower
    /// triangle used); else the rows just before `rows`, through their last.
    cols: std::ops::Range<usize>,
    /// `exp(Γ_rows − Γ_anchor)`, `[|rows|, K]`
    row: Array2<T>,
    /// `exp(Γ_anchor − Γ_cols)`, `[|cols|, K]`
    col: Array2<T>,
}

impl<T> DecayBlock<T> {
    fn diagonal(&self) -> bool {
        self.rows == self.cols
    }
}

impl<T: Scalar> Decays<T> {
    /// The middle-row factors, where the pairwise decays go through them.
    fn factors(&self) -> Option<&(Array2<T>, Array2<T>)> {
        match self {
            Decays::Mid { factors, .. } | Decays::Factored { factors, .. } => Some(factors),
            Decays::Blocks { .. } | Decays::Pairs { .. } => None,
        }
    }

    /// `(exp(Γ), exp(Γ_last − Γ))`, `[c, K]` each (`exp(Γ_last − Γ)` is at
    /// most 1: no overflow): rebuilt through the middle row as
    /// `exp(Γ − Γ_m)·exp(Γ_m)` and `exp(Γ_m − Γ)·exp(Γ_last − Γ_m)`, or the
    /// direct exponentials kept. The same bits in the intra stage and after.
    fn exps(&self) -> [CowArray<'_, T, Ix2>; 2] {
        match self {
            Decays::Mid {
                factors: (ep, em),
                mid: (e_mid, e_last),
            } => [
                fused::scale_columns(ep, e_mid).into(),
                fused::scale_columns(em, e_last).into(),
            ],
            Decays::Factored { exps: [eg, tl], .. }
            | Decays::Blocks { exps: [eg, tl], .. }
            | Decays::Pairs { exps: [eg, tl] } => [eg.into(), tl.into()],
        }
    }
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

impl Chunk {
    /// `exp(Γ_r − Γ_s)` for one key dim, formed from differences; with the
    /// safe-gate policy, through the midpoint of `r`'s 16-token sub-chunk.
    #[inline]
    fn pair_decay<T: Scalar>(&self, g: &Array2<T>, r: usize, s: usize, d: usize) -> T {
        if self.policy.safe_gate_midpoint {
            let m = ((r / 16) * 16 + 8).min(g.nrows() - 1);
            self.policy.exp(g[[r, d]] - g[[m, d]]) * self.policy.exp(g[[m, d]] - g[[s, d]])
        } else {
            self.policy.exp(g[[r, d]] - g[[s, d]])
        }
    }

    /// `(exp(Γ − Γ_m), exp(Γ_m − Γ))` through the chunk's middle row `m`, when
    /// every exponent stays far from overflow in `T` (|x| ≤ [`exp_bound`]);
    /// `None` under the safe-gate emulation or when the decay range is too
    /// wide, and the pairwise differences are used instead.
    fn factors<T: Scalar>(&self, g: &Array2<T>) -> Option<(Array2<T>, Array2<T>)> {
        if self.policy.safe_gate_midpoint {
            return None;
        }
        let limit = exp_bound::<T>();
        let mut diff = fused::minus_mid_row(g, g, limit)?;
        if self.policy.exp2 {
            // Both as FLA's own exp2.
            let em = diff.mapv(|v| self.policy.exp(-v));
            diff.mapv_inplace(|v| self.policy.exp(v));
            return Some((diff, em));
        }
        // c·K exponentials per chunk, vectorised; exp(Γ_m − Γ) as
        // 1/exp(Γ − Γ_m) (a division, not an exponential).
        fused::exps_bounded(&mut diff);
        let em = fused::reciprocals(diff.view());
        Some((diff, em))
    }

    /// The blocks of a chunk whose factors do not fit
    /// ([`crate::fast::decay_blocks`]), each with its factors; `None` under the
    /// safe-gate emulation, whose pairs go through their own anchors.
    fn decay_blocks<T: Scalar>(&self, g: &Array2<T>) -> Option<Vec<DecayBlock<T>>> {
        if self.policy.safe_gate_midpoint {
            return None;
        }
        let rows_of = |r: &std::ops::Range<usize>| g.slice(s![r.clone(), ..]);
        // One row's factors are exp(0) = 1 and always fit.
        let blocks = crate::fast::decay_blocks::split(0..g.nrows(), &mut |r| {
            self.factors(&rows_of(&r).to_owned())
        });
        let blocks = blocks.into_iter().map(|b| match b {
            Block::Diagonal {
                rows,
                factors: (row, col),
            } => DecayBlock {
                cols: rows.clone(),
                rows,
                row,
                col,
            },
            Block::Below { rows, cols } => {
                let anchor = g.row(cols.end - 1);
                let row = self.exps((&rows_of(&rows) - &anchor).view());
                let col = self.exps((-(&rows_of(&cols) - &anchor)).view());
                DecayBlock {
                    rows,
                    cols,
                    row,
                    col,
                }
            }
        });
        Some(blocks.collect())
    }

    /// `exp` of every element of `x` (any range): libm's bits, or FLA's
    /// `exp2` under that policy.
    fn exps<T: Scalar>(&self, x: ArrayView2<T>) -> Array2<T> {
        if self.policy.exp2 {
            return x.mapv(|v| self.policy.exp(v));
        }
        fused::exps(x)
    }

    /// [`Chunk::pair_products`] block by block: each block's products
    /// through its factors.
    fn block_products<T: Scalar>(
        blocks: &[DecayBlock<T>],
        q: ArrayView2<T>,
        k: ArrayView2<T>,
    ) -> (Array2<T>, Array2<T>) {
        let c = q.nrows();
        let (mut aqk, mut p) = (Array2::zeros((c, c)), Array2::zeros((c, c)));
        for b in blocks {
            let (r, cols) = (s![b.rows.clone(), ..], s![b.cols.clone(), ..]);
            let [qe, ke, km] = fused::products([
                (q.slice(r), b.row.view()),
                (k.slice(r), b.row.view()),
                (k.slice(cols), b.col.view()),
            ]);
            let at = s![b.rows.clone(), b.cols.clone()];
            if b.diagonal() {
                let [a, pp] = tri::dot_t_lower_each([qe.view(), ke.view()], km.view(), false);
                aqk.slice_mut(at).assign(&a);
                p.slice_mut(at).assign(&pp);
            } else {
                gemm::dot_to(qe.view(), km.t(), aqk.slice_mut(at));
                gemm::dot_to(ke.view(), km.t(), p.slice_mut(at));
            }
        }
        (aqk, p)
    }

    /// `Σ_d q_r k_s exp(Γ_r − Γ_s)` and `Σ_d k_r k_s exp(Γ_r − Γ_s)` for
    /// `s ≤ r`, each decay formed from its difference (any range).
    fn pair_products<T: Scalar>(
        &self,
        g: &Array2<T>,
        q: ArrayView2<T>,
        k: ArrayView2<T>,
    ) -> (Array2<T>, Array2<T>) {
        let c = g.nrows();
        let (mut aqk, mut p) = (Array2::zeros((c, c)), Array2::zeros((c, c)));
        for r in 0..c {
            for s in 0..=r {
                let (mut a, mut b) = (T::zero(), T::zero());
                for d in 0..k.ncols() {
                    let e = self.pair_decay(g, r, s, d);
                    a += q[[r, d]] * k[[s, d]] * e;
                    b += k[[r, d]] * k[[s, d]] * e;
                }
                aqk[[r, s]] = a;
                p[[r, s]] = b;
            }
        }
        (aqk, p)
    }

    /// [`Chunk::pair_products`] in the structure of FLA's forward intra
    /// kernels: a pair in different 16-token sub-chunks is a `tl.dot` of
    /// `q_r·e^(Γ_r − Γ_n)` and `k_s·e^(Γ_n − Γ_s)` (`n` the first row of
    /// `r`'s sub-chunk) with both operands rounded to `st`; a pair inside one
    /// sub-chunk is element-wise fp32, or with safe_gate a `tl.dot` through
    /// the sub-chunk's anchor (the midpoint, as [`Chunk::pair_decay`]).
    fn pair_products_subchunks<T: Scalar>(
        &self,
        st: crate::precision::Store,
        g: &Array2<T>,
        q: ArrayView2<T>,
        k: ArrayView2<T>,
    ) -> (Array2<T>, Array2<T>) {
        const BC: usize = 16;
        let c = g.nrows();
        let e = |x: T| self.policy.exp(x);
        let (mut aqk, mut p) = (Array2::zeros((c, c)), Array2::zeros((c, c)));
        for r in 0..c {
            for s in 0..=r {
                let same = s / BC == r / BC;
                let anchor = match (same, self.policy.safe_gate_midpoint) {
                    (false, _) => (r / BC) * BC,
                    (true, true) => ((r / BC) * BC + 8).min(c - 1),
                    (true, false) => {
                        for d in 0..k.ncols() {
                            let ee = self.pair_decay(g, r, s, d);
                            aqk[[r, s]] += q[[r, d]] * k[[s, d]] * ee;
                            p[[r, s]] += k[[r, d]] * k[[s, d]] * ee;
                        }
                        continue;
                    }
                };
                for d in 0..k.ncols() {
                    let row = e(g[[r, d]] - g[[anchor, d]]);
                    let col = st.round(k[[s, d]] * e(g[[anchor, d]] - g[[s, d]]));
                    aqk[[r, s]] += st.round(q[[r, d]] * row) * col;
                    p[[r, s]] += st.round(k[[r, d]] * row) * col;
                }
            }
        }
        (aqk, p)
    }

    /// `(exp(Γ_m), exp(Γ_last − Γ_m))` ([`fused::mid_row_exps`]), `[K]`
    /// each, through which a chunk's exponentials are rebuilt; `None`
    /// without the `factors`, under FLA's `exp2`, or when a column factor is
    /// not normal.
    fn mid_exps<T: Scalar>(
        &self,
        g_cumsum: &Array2<T>,
        factors: Option<&(Array2<T>, Array2<T>)>,
    ) -> Option<(Vec<T>, Vec<T>)> {
        factors.filter(|_| !self.policy.exp2)?;
        fused::mid_row_exps(g_cumsum)
    }

    /// `(exp(Γ), exp(Γ_last − Γ))` formed directly from Γ, `[c, K]` each.
    fn direct_exps<T: Scalar>(&self, g_cumsum: &Array2<T>) -> [Array2<T>; 2] {
        let last = g_cumsum.row(g_cumsum.nrows() - 1);
        [
            self.exps(g_cumsum.view()),
            self.exps((-(g_cumsum - &last)).view()),
        ]
    }

    /// The intra-chunk stage for tokens `start..start + c` of `x`.
    pub fn intra<T: Scalar>(&self, x: &KdaHead<T>, start: usize, c: usize) -> Intra<T> {
        let rows = s![start..start + c, ..];
        let [q, k] = qk_rows(x, start..start + c);
        let (q, k, v) = (q.view(), k.view(), x.v.slice(rows));
        let beta = x.beta.slice(s![start..start + c]);
        let mut g_cumsum = views::standard(x.g.slice(rows)).into_owned();
        self.policy.cumsum_rows(&mut g_cumsum);
        let factors = self.factors(&g_cumsum);
        let blocks = factors
            .is_none()
            .then(|| self.decay_blocks(&g_cumsum))
            .flatten();
        let fwd_dots = self.policy.store(Stage::FwdDots);
        let (mut aqk, mut p) = match factors.as_ref().filter(|_| fwd_dots.is_none()) {
            Some((ep, em)) => {
                // exp(Γ_r − Γ_s) = exp(Γ_r − Γ_m)·exp(Γ_m − Γ_s): two matrix
                // products, of which only the lower triangles are used.
                let [qe, ke, km] =
                    fused::products([(q, ep.view()), (k, ep.view()), (k, em.view())]);
                let [aqk, p] = tri::dot_t_lower_each([qe.view(), ke.view()], km.view(), false);
                (aqk, p)
            }
            None => match (fwd_dots, &blocks) {
                (Some(st), _) => self.pair_products_subchunks(st, &g_cumsum, q, k),
                (None, Some(blocks)) => Self::block_products(blocks, q, k),
                (None, None) => self.pair_products(&g_cumsum, q, k),
            },
        };
        tri::mask_lower(&mut aqk, true);
        tri::mask_lower(&mut p, false);
        // (I + L)^{-1}, L[r, s] = β_r p[r, s].
        // FLA stores the inverse `(I + L)^{-1}` (its `Akk`) and applies β
        // when it forms w and u: the stage rounds the inverse.
        let mut n_inv = crate::fast::tri::unit_lower_inverse(c, |r, s| -(beta[r] * p[[r, s]]));
        self.policy.round(Stage::Akk, &mut n_inv);
        let beta_v = beta.to_vec();
        let akk = fused::scale_columns(&n_inv, &beta_v);
        self.policy.round(Stage::Aqk, &mut aqk);
        let decays = match (self.mid_exps(&g_cumsum, factors.as_ref()), factors) {
            (Some(mid), Some(factors)) => Decays::Mid { factors, mid },
            (None, Some(factors)) => Decays::Factored {
                factors,
                exps: self.direct_exps(&g_cumsum),
            },
            (_, None) => {
                let exps = self.direct_exps(&g_cumsum);
                match blocks {
                    Some(blocks) => Decays::Blocks { blocks, exps },
                    None => Decays::Pairs { exps },
                }
            }
        };
        let [eg, tl] = decays.exps();
        let [mut qg, mut kg] = fused::products([(q, eg.view()), (k, tl.view())]);
        let (mut w, mut u) = if [Stage::W, Stage::U, Stage::KBeta]
            .into_iter()
            .any(|s| self.policy.storage(s).is_some())
        {
            // FLA (`recompute_w_u_fwd`) multiplies the stored inverse by
            // `(β k ⊙ 2^g).to(bf16)` and `(β v).to(bf16)`: the operands are
            // rounded like the stage they form, `β k` once more before
            // the decay when β is bf16 (`Stage::KBeta`).
            let bcol = beta.insert_axis(Axis(1));
            let mut kb = &k * &bcol;
            self.policy.round(Stage::KBeta, &mut kb);
            kb *= &eg;
            let mut vb = &v * &bcol;
            self.policy.round(Stage::W, &mut kb);
            self.policy.round(Stage::U, &mut vb);
            (
                tri::lower_dot(n_inv.view(), kb.view()),
                tri::lower_dot(n_inv.view(), vb.view()),
            )
        } else {
            (
                tri::lower_dot(
                    akk.view(),
                    fused::zip_map(eg.view(), k, |e, k| e * k).view(),
                ),
                tri::lower_dot(akk.view(), v),
            )
        };
        self.policy.round(Stage::W, &mut w);
        self.policy.round(Stage::U, &mut u);
        self.policy.round(Stage::Gated, &mut qg);
        self.policy.round(Stage::Gated, &mut kg);
        Intra {
            start,
            decay_last: fused::exps_of_last_row(&g_cumsum),
            g_cumsum,
            n_inv,
            akk,
            aqk,
            p,
            w,
            u,
            qg,
            kg,
            decays,
        }
    }

    /// All chunks' intra stages of one head.
    pub fn intras<T: Scalar>(&self, x: &KdaHead<T>) -> Vec<Intra<T>> {
        // Independent per chunk: in parallel, collected in chunk order.
        par_chunks(x.len().div_ceil(self.chunk_size), |n| self.intra_of(x, n))
    }

    /// Chunk `n`'s intra stage.
    fn intra_of<T: Scalar>(&self, x: &KdaHead<T>, n: usize) -> Intra<T> {
        let start = n * self.chunk_size;
        self.intra(x, start, self.chunk_size.min(x.len() - start))
    }

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
    fn forward_pass<T: Scalar>(
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

    /// One chunk's forward state step over the value columns `cols`
    /// ([`crate::fast::par::par_columns`]): pushes the state entering it as
    /// stored, `v_new` and (with `read_out`) `o` to `out`, and carries
    /// `state` (`[K, w]`, those columns) over the chunk.
    fn state_step<T: Scalar>(
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
            let mut av = tri::lower_dot(ch.aqk.view(), vn.view());
            fused::add_assign(&mut av, wh.slice(s![c.., ..]));
            out.push_o(av.view());
        }
        out.push(hn, vn.view());
        fused::decay_add(state, ch.decay_last(), &[&gemm::dot(ch.kg.t(), vn.view())]);
    }

    /// The backward pass with every intermediate.
    pub fn backward_intermediates<T: Scalar>(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> ChunkBackward<T> {
        self.backward_from(x, &self.forward_pass(x, h0, false), d_o, dht, true)
    }

    /// The backward pass given the forward's intermediates `fwd`; `dh`,
    /// `dv_new` and the per-chunk A-block gradients are kept only with
    /// `keep_blocks` (else left empty: only the intermediates need them).
    fn backward_from<T: Scalar>(
        &self,
        x: &KdaHead<T>,
        fwd: &ChunkForward<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        keep_blocks: bool,
    ) -> ChunkBackward<T> {
        let mut grads = KdaHeadGrads::zeros(x.len(), x.k_dim(), x.v_dim());
        let (dh, dv_new, daqk, dakk) =
            self.backward_into(x, fwd, d_o, dht, keep_blocks, grads.view_mut());
        ChunkBackward {
            dh,
            dv_new,
            daqk,
            dakk,
            grads,
        }
    }

    /// [`Chunk::backward_from`] writing the gradients into `gr`, each
    /// chunk's rows as they are computed; returns `(dh, dv_new, dAqk,
    /// dAkk)`, all empty without `keep_blocks`.
    #[allow(clippy::type_complexity)]
    fn backward_into<T: Scalar>(
        &self,
        x: &KdaHead<T>,
        fwd: &ChunkForward<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        keep_blocks: bool,
        mut gr: KdaHeadGradsMut<T>,
    ) -> (Array3<T>, Array2<T>, Vec<Array2<T>>, Vec<Array2<T>>) {
        let chunks: Vec<_> = fwd
            .intra
            .iter()
            .map(|ch| ch.start..ch.start + ch.len())
            .collect();
        let (mut daqk, mut dakk) = (vec![], vec![]);
        let StateGradColumns { dh, dv_new, dh0 } = backward_chunks(
            d_o,
            dht,
            &chunks,
            keep_blocks,
            |dh| self.policy.round(Stage::Dh, dh),
            |n, d_o, ds_used, ds| self.state_backward(&fwd.intra[n], d_o, ds_used, ds),
            |n, ds, dvn| self.chunk_backward(x, &fwd.intra[n], fwd, n, d_o, ds, dvn),
            |n, step: ChunkStep<T>| {
                let rows = s![chunks[n].clone(), ..];
                for (dst, src) in [
                    (&mut gr.dq, &step.dq),
                    (&mut gr.dk, &step.dk),
                    (&mut gr.dv, &step.dv),
                    (&mut gr.dg, &step.dg),
                ] {
                    views::copy_into(dst.slice_mut(rows), src.view());
                }
                gr.dbeta
                    .slice_mut(s![chunks[n].clone()])
                    .assign(&step.dbeta);
                if keep_blocks {
                    daqk.push(step.daqk);
                    dakk.push(step.dakk);
                }
            },
        );
        views::copy_into(gr.dh0.view_mut(), dh0.view());
        (dh, dv_new, daqk, dakk)
    }

    /// The state pass of one chunk's backward given `ds_used = ∂L/∂(state at
    /// its end)` as stored, for `w` value columns (`do` `[L, w]`, `ds_used`
    /// `[K, w]`): returns `dv_new [c, w]` and takes the carried `ds` `[K, w]`
    /// back to the chunk's start, `ds e^Γlast + qgᵀ dO − wᵀ dv_new` (decayed
    /// carry plus the chunk's own reads of the state).
    fn state_backward<T: Scalar>(
        &self,
        ch: &Intra<T>,
        d_o: ArrayView2<T>,
        ds_used: ArrayView2<T>,
        ds: &mut Array2<T>,
    ) -> Array2<T> {
        let dout = d_o.slice(s![ch.start..ch.start + ch.len(), ..]);
        // S' = Diag(e^Γlast) h + kgᵀ v_new, O = qg h + Aqk v_new.
        // FLA stores `Aqkᵀ do` (chunk_kda_bwd_dAv) before the state pass adds `kg dh`.
        let mut dvn = self.operand(tri::lower_t_dot(ch.aqk.view(), dout));
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

    /// Backward through chunk `n` given the state gradient at its end as
    /// stored, `ds [K, V]`, and its rows of `dv_new`, `[c, V]` (from the
    /// state pass): the chunk's token gradients.
    #[allow(clippy::too_many_arguments)]
    fn chunk_backward<T: Scalar>(
        &self,
        x: &KdaHead<T>,
        ch: &Intra<T>,
        fwd: &ChunkForward<T>,
        n: usize,
        d_o: ArrayView2<T>,
        ds: ArrayView2<T>,
        dvn: ArrayView2<T>,
    ) -> ChunkStep<T> {
        let c = ch.len();
        let rows = s![ch.start..ch.start + c, ..];
        let h = fwd.h.index_axis(Axis(0), n);
        let vn = fwd.v_new.slice(rows);
        let dout = d_o.slice(rows);
        let decay_last = ch.decay_last();
        // Output: O = qg h + Aqk v_new; v_new = u − w h. One product gives
        // dqg = dO hᵀ and −dw = dv_new hᵀ.
        let dqg_dw = tri::stacked_dot(&[dout, dvn], h.t());
        let dqg = dqg_dw.slice(s![..c, ..]);
        let mut daqk = tri::dot_t_lower(dout, vn, false);
        tri::mask_lower(&mut daqk, true);
        // State pass: S' = Diag(e^Γlast) h + kgᵀ v_new, v_new = u − w h.
        let dkg = gemm::dot(vn.view(), ds.t());
        let mut dgamma_last: Array1<T> = self.decay_sums(h, ds) * decay_last;
        let dw = self.operand(dqg_dw.slice(s![c.., ..]).mapv(|x| -x));
        let du = &dvn;
        // WY: w = Akk (e^Γ ⊙ K), u = Akk V, Akk = N Diag(β), N = (I + L)^{-1}.
        let [q, k] = qk_rows(x, ch.start..ch.start + c);
        let k = k.view();
        let [eg, tl] = ch.decays.exps();
        let kd_ = self.operand(fused::zip_map(eg.view(), k, |e, k| e * k));
        // Only the lower triangle of dAkk reaches an input (Akk is lower triangular).
        let mut dakk = tri::dot_t_lower(dw.view(), kd_.view(), false);
        tri::dot_t_lower_add(du.view(), x.v.slice(rows), false, dakk.view_mut());
        tri::mask_lower(&mut dakk, true);
        let dkd = tri::lower_t_dot(ch.akk.view(), dw.view());
        let dv = tri::lower_t_dot(ch.akk.view(), du.view());
        let beta = x.beta.slice(s![ch.start..ch.start + c]);
        let beta_v = beta.to_vec();
        let mut dbeta: Array1<T> =
            fused::zip_map(dakk.view(), ch.n_inv.view(), |a, n| a * n).sum_axis(Axis(0));
        let dn = self.operand(fused::scale_columns(&dakk, &beta_v));
        // FLA casts the masked product to the operand dtype between the two
        // multiplications by the stored inverse.
        let mut dlow = -tri::dot_t_lower(
            self.operand(tri::lower_t_dot(ch.n_inv.view(), dn.view()))
                .view(),
            ch.n_inv.view(),
            true,
        );
        tri::mask_lower(&mut dlow, false);
        dbeta += &fused::zip_map(dlow.view(), ch.p.view(), |a, p| a * p).sum_axis(Axis(1));
        let dp = fused::scale_rows(dlow.view(), &beta_v);
        // With qg = Q ⊙ e^Γ, kg = K ⊙ e^(Γlast − Γ), kd = e^Γ ⊙ K, one pass:
        // dq = dqg e^Γ, dk = dkd e^Γ + dkg e^(Γlast − Γ),
        // dΓ = dkd kd + dqg qg − dkg kg and dΓlast += Σ_rows dkg kg.
        let q = q.view();
        let kd = x.k_dim();
        let (mut dq, mut dk, mut dgamma) = (
            crate::fast::stagger::zeros((c, kd)),
            crate::fast::stagger::zeros((c, kd)),
            crate::fast::stagger::zeros((c, kd)),
        );
        let mut dkg_kg_sum = vec![T::zero(); kd];
        let flats = [
            dqg.view(),
            eg.view(),
            dkd.view(),
            kd_.view(),
            ch.qg.view(),
            dkg.view(),
            tl.view(),
            ch.kg.view(),
        ]
        .map(fused::flat);
        let (dq_, dk_, dgamma_) = (
            fused::flat_mut(&mut dq),
            fused::flat_mut(&mut dk),
            fused::flat_mut(&mut dgamma),
        );
        let sum = &mut dkg_kg_sum[..kd];
        crate::fast::simd::dispatch(
            #[inline(always)]
            || {
                for r in 0..c {
                    // Slices of length `kd` exactly: no bounds checks in the
                    // loop, which then vectorises.
                    let [dqg_, eg_, dkd_, kdd_, qg_, dkg_, tl_, kg_] =
                        flats.each_ref().map(|x| &x[r * kd..][..kd]);
                    let (dq_, dk_, dgamma_) = (
                        &mut dq_[r * kd..][..kd],
                        &mut dk_[r * kd..][..kd],
                        &mut dgamma_[r * kd..][..kd],
                    );
                    for d in 0..kd {
                        let t = dkg_[d] * kg_[d];
                        dq_[d] = dqg_[d] * eg_[d];
                        dk_[d] = dkd_[d] * eg_[d] + dkg_[d] * tl_[d];
                        dgamma_[d] = dkd_[d] * kdd_[d] + dqg_[d] * qg_[d] - t;
                        sum[d] += t;
                    }
                }
            },
        );
        dgamma_last += &ndarray::aview1(&dkg_kg_sum);
        let k_col = self.k_beta_col(k, beta);
        self.intra_backward(
            ch,
            q,
            k,
            k_col.view(),
            &daqk,
            &dp,
            &mut dq,
            &mut dk,
            &mut dgamma,
        );
        // Γlast is the last row of Γ; Γ_r = Σ_{i≤r} g_i ⇒ dg = reverse cumsum of dΓ.
        let mut last = dgamma.row_mut(c - 1);
        last += &dgamma_last;
        fused::reverse_cumsum_rows(&mut dgamma);
        ChunkStep {
            dq,
            dk,
            dv,
            dg: dgamma,
            dbeta,
            daqk,
            dakk,
        }
    }

    /// `k` with the rounding of `k_r·β_r` folded in (`round(k·β)/β`; `k`
    /// itself, not copied, without a [`Stage::KBetaBwd`] storage): the column side of FLA's
    /// `chunk_kda_bwd_kernel_intra` multiplies `dAkk` by `b_k * b_b`, the
    /// product of two bf16 tensors, so `∂/∂k_s` reads every later row's
    /// `k·β` rounded (between sub-chunks, and inside one with safe_gate).
    fn k_beta_col<'a, T: Scalar>(
        &self,
        k: ArrayView2<'a, T>,
        beta: ArrayView1<T>,
    ) -> CowArray<'a, T, Ix2> {
        let Some(st) = self.policy.store(Stage::KBetaBwd) else {
            return k.into();
        };
        Array2::from_shape_fn(k.raw_dim(), |(r, d)| match beta[r] {
            b if b == T::zero() => k[[r, d]],
            b => st.round(k[[r, d]] * b) / b,
        })
        .into()
    }

    /// Through `Aqk[r,s] = Σ q_r k_s E_rs` and `p[r,s] = Σ k_r k_s E_rs` with
    /// `E_rs = exp(Γ_r − Γ_s)`: gradients of q, k and Γ. `k_col` is `k` as
    /// the `∂/∂k_s` side reads row `r`'s key ([`Chunk::k_beta_col`]).
    #[allow(clippy::too_many_arguments)]
    fn intra_backward<T: Scalar>(
        &self,
        ch: &Intra<T>,
        q: ArrayView2<T>,
        k: ArrayView2<T>,
        k_col: ArrayView2<T>,
        daqk: &Array2<T>,
        dp: &Array2<T>,
        dq: &mut Array2<T>,
        dk: &mut Array2<T>,
        dgamma: &mut Array2<T>,
    ) {
        if let Some(st) = self.policy.store(Stage::IntraDots) {
            return self.intra_backward_subchunks(st, ch, q, k, k_col, daqk, dp, dq, dk, dgamma);
        }
        let flats = [dq, dk, dgamma].map(fused::flat_mut);
        if let Some((ep, em)) = ch.decays.factors() {
            let ops = [q, k, k_col];
            return self.diagonal_backward(
                (ep.view(), em.view()),
                ops,
                daqk.view(),
                dp.view(),
                flats,
            );
        }
        if let Decays::Blocks { blocks, .. } = &ch.decays {
            let [dq, dk, dgamma] = flats;
            let kd = k.ncols();
            for b in blocks {
                let r = s![b.rows.clone(), ..];
                let at = s![b.rows.clone(), b.cols.clone()];
                let (dq, dk, dgamma) = (&mut *dq, &mut *dk, &mut *dgamma);
                if b.diagonal() {
                    let rows = b.rows.start * kd..b.rows.end * kd;
                    self.diagonal_backward(
                        (b.row.view(), b.col.view()),
                        [q.slice(r), k.slice(r), k_col.slice(r)],
                        daqk.slice(at),
                        dp.slice(at),
                        [dq, dk, dgamma].map(|x| &mut x[rows.clone()]),
                    );
                } else {
                    self.below_backward(
                        b,
                        [q, k, k_col],
                        daqk.slice(at),
                        dp.slice(at),
                        [dq, dk, dgamma],
                    );
                }
            }
            return;
        }
        let [dq, dk, dgamma] = flats;
        let (c, kd) = (ch.len(), k.ncols());
        for r in 0..c {
            for s in 0..=r {
                let (a, p) = (daqk[[r, s]], dp[[r, s]]);
                if a == T::zero() && p == T::zero() {
                    continue;
                }
                for d in 0..kd {
                    let e = self.pair_decay(&ch.g_cumsum, r, s, d);
                    let ks = k[[s, d]];
                    let aq = a * q[[r, d]];
                    let (coef, coef_col) = (aq + p * k[[r, d]], aq + p * k_col[[r, d]]);
                    let (r, s) = (r * kd + d, s * kd + d);
                    dq[r] += a * ks * e;
                    dk[r] += p * ks * e;
                    dk[s] += coef_col * e;
                    dgamma[r] += coef * ks * e;
                    dgamma[s] -= coef_col * ks * e;
                }
            }
        }
    }

    /// What `dAqk` and `dp` of a block of pairs send its factored operands,
    /// `[da, dc, db]`, then the operands `[a, b, cc]`: with the block's
    /// factors `(row, col)`, `A = Q⊙row` and `C = K⊙row` on its rows (`q`,
    /// `k`, `k_col` those rows; `C` from `k_col` under [`Stage::KBetaBwd`],
    /// as the `∂/∂k_s` side reads it) and `B = K⊙col` on its columns
    /// (`k_cols`), so that `Aqk = A Bᵀ` and `p = C Bᵀ` on the block. The
    /// anchor cancels in every product, so it is held constant. The
    /// products are [`crate::fast::decay_blocks::grad_products`].
    fn factored_grads<T: Scalar>(
        &self,
        (row, col): (ArrayView2<T>, ArrayView2<T>),
        [q, k, k_col]: [ArrayView2<T>; 3],
        k_cols: ArrayView2<T>,
        [daqk, dp]: [ArrayView2<T>; 2],
        diagonal: bool,
    ) -> [Array2<T>; 6] {
        let (dot, _, t_dot, t_dot_add) = crate::fast::decay_blocks::grad_products(diagonal);
        let [a, b, cc] = fused::products([(q, row), (k_cols, col), (k, row)]);
        let cc = match self.policy.storage(Stage::KBetaBwd) {
            Some(_) => &k_col * &row,
            None => cc,
        };
        let (da, dc) = (dot(daqk, b.view()), dot(dp, b.view()));
        let mut db = t_dot(daqk, a.view());
        t_dot_add(dp, cc.view(), db.view_mut());
        [da, dc, db, a, b, cc]
    }

    /// [`Chunk::intra_backward`] for rows whose pairs go through the
    /// factors `(ep, em) = (exp(Γ − Γ_m), exp(Γ_m − Γ))` of one middle row
    /// (`[n, K]` each; the whole chunk's, or a diagonal block's): `q`, `k`,
    /// `k_col` and `dq`, `dk`, `dΓ` (row-major, added to) those rows, `dAqk`
    /// and `dp` `[n, n]` their pairs.
    fn diagonal_backward<T: Scalar>(
        &self,
        (ep, em): (ArrayView2<T>, ArrayView2<T>),
        [q, k, k_col]: [ArrayView2<T>; 3],
        daqk: ArrayView2<T>,
        dp: ArrayView2<T>,
        [dq_, dk_, dg_]: [&mut [T]; 3],
    ) {
        let grads = self.factored_grads((ep, em), [q, k, k_col], k, [daqk, dp], true);
        let flats = grads.each_ref().map(|x| fused::flat(x.view()));
        let factors = [ep, em].map(fused::flat);
        let n = grads[0].len();
        let [da_, dc_, db_, a_, b_, cc_] = flats.each_ref().map(|x| &x[..n]);
        let [ep_, em_] = factors.each_ref().map(|x| &x[..n]);
        let (dq_, dk_, dg_) = (&mut dq_[..n], &mut dk_[..n], &mut dg_[..n]);
        crate::fast::simd::dispatch(
            #[inline(always)]
            || {
                for i in 0..n {
                    dq_[i] += da_[i] * ep_[i];
                    dk_[i] += dc_[i] * ep_[i] + db_[i] * em_[i];
                    dg_[i] += da_[i] * a_[i] + dc_[i] * cc_[i] - db_[i] * b_[i];
                }
            },
        );
    }

    /// [`Chunk::intra_backward`] for the pairs of a block below the
    /// diagonal, `b.rows` against `b.cols` through `b`'s factors: `q`, `k`,
    /// `k_col` and `dq`, `dk`, `dΓ` (row-major, added to) the chunk's,
    /// `dAqk` and `dp` the block's `[|rows|, |cols|]`.
    fn below_backward<T: Scalar>(
        &self,
        b: &DecayBlock<T>,
        [q, k, k_col]: [ArrayView2<T>; 3],
        daqk: ArrayView2<T>,
        dp: ArrayView2<T>,
        [dq, dk, dg]: [&mut [T]; 3],
    ) {
        let (r, cols) = (s![b.rows.clone(), ..], s![b.cols.clone(), ..]);
        let rows_of = [q.slice(r), k.slice(r), k_col.slice(r)];
        let factors = (b.row.view(), b.col.view());
        let grads = self.factored_grads(factors, rows_of, k.slice(cols), [daqk, dp], false);
        let [da, dc, db, a, bm, cc] = grads.each_ref().map(|x| fused::flat(x.view()));
        let [row, col] = [&b.row, &b.col].map(|x| fused::flat(x.view()));
        let kd = k.ncols();
        let (rows, cols) = (
            b.rows.start * kd..b.rows.end * kd,
            b.cols.start * kd..b.cols.end * kd,
        );
        for (i, j) in rows.enumerate() {
            dq[j] += da[i] * row[i];
            dk[j] += dc[i] * row[i];
            dg[j] += da[i] * a[i] + dc[i] * cc[i];
        }
        for (i, j) in cols.enumerate() {
            dk[j] += db[i] * col[i];
            dg[j] -= db[i] * bm[i];
        }
    }
}

impl Chunk {
    /// [`Chunk::intra_backward`] in the structure of FLA's
    /// `chunk_kda_bwd_kernel_intra`: a pair `s < r` in different 16-token
    /// sub-chunks goes through a `tl.dot` whose fp32 operands (`dAqk`,
    /// `dAkk`, and the other side's q/k gated to the sub-chunk boundary) are
    /// rounded to `st`; a pair inside one sub-chunk is element-wise fp32.
    #[allow(clippy::too_many_arguments)]
    fn intra_backward_subchunks<T: Scalar>(
        &self,
        st: crate::precision::Store,
        ch: &Intra<T>,
        q: ArrayView2<T>,
        k: ArrayView2<T>,
        k_col: ArrayView2<T>,
        daqk: &Array2<T>,
        dp: &Array2<T>,
        dq: &mut Array2<T>,
        dk: &mut Array2<T>,
        dgamma: &mut Array2<T>,
    ) {
        const BC: usize = 16;
        // Inside a sub-chunk only the safe-gate `tl.dot` reads the rounded
        // `k·β`; the element-wise path multiplies fp32 `k` by β.
        let k_diag = if self.policy.safe_gate_midpoint {
            k_col
        } else {
            k
        };
        let (c, kd, g) = (ch.len(), k.ncols(), &ch.g_cumsum);
        let e = |x: T| self.policy.exp(x);
        for r in 0..c {
            // Row side (dq, dk of r): anchored at the first row of r's sub-chunk.
            let first = (r / BC) * BC;
            // Column side (dk of s): anchored at the last row of s's sub-chunk.
            for s in 0..=r {
                let (a, p) = (daqk[[r, s]], dp[[r, s]]);
                if a == T::zero() && p == T::zero() {
                    continue;
                }
                if s / BC == r / BC {
                    for d in 0..kd {
                        let ee = self.pair_decay(g, r, s, d);
                        let aq = a * q[[r, d]];
                        let (coef, coef_col) = (aq + p * k[[r, d]], aq + p * k_diag[[r, d]]);
                        dq[[r, d]] += a * k[[s, d]] * ee;
                        dk[[r, d]] += p * k[[s, d]] * ee;
                        dk[[s, d]] += coef_col * ee;
                        dgamma[[r, d]] += coef * k[[s, d]] * ee;
                        dgamma[[s, d]] -= coef_col * k[[s, d]] * ee;
                    }
                    continue;
                }
                let last = ((s / BC + 1) * BC).min(c) - 1;
                let (ar, pr) = (st.round(a), st.round(p));
                for d in 0..kd {
                    let kg_s = st.round(k[[s, d]] * e(g[[first, d]] - g[[s, d]]));
                    let e_r = e(g[[r, d]] - g[[first, d]]);
                    let (row_q, row_k) = (ar * kg_s * e_r, pr * kg_s * e_r);
                    dq[[r, d]] += row_q;
                    dk[[r, d]] += row_k;
                    dgamma[[r, d]] += q[[r, d]] * row_q + k[[r, d]] * row_k;
                    let qg_r = st.round(q[[r, d]] * e(g[[r, d]] - g[[last, d]]));
                    let kg_r = st.round(k_col[[r, d]] * e(g[[r, d]] - g[[last, d]]));
                    let col = (ar * qg_r + pr * kg_r) * e(g[[last, d]] - g[[s, d]]);
                    dk[[s, d]] += col;
                    dgamma[[s, d]] -= k[[s, d]] * col;
                }
            }
        }
    }
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

/// One chunk's token gradients (rows of `dq`, `dk`, `dv`, `dg`, `dbeta`)
/// and its A-block gradients, `[c, c]` each.
struct ChunkStep<T> {
    dq: Array2<T>,
    dk: Array2<T>,
    dv: Array2<T>,
    dg: Array2<T>,
    dbeta: Array1<T>,
    daqk: Array2<T>,
    dakk: Array2<T>,
}

impl<T: Scalar> Engine<T> for Chunk {
    type Op = Kda;

    fn forward(&self, x: &KdaHead<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        let f = self.forward_intermediates(x, h0);
        (f.o, f.final_state)
    }

    fn backward(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> KdaHeadGrads<T> {
        self.backward_from(x, &self.forward_pass(x, h0, false), d_o, dht, false)
            .grads
    }

    /// One forward pass (with its readout) serves the backward too.
    fn forward_backward(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> ((Array2<T>, Array2<T>), KdaHeadGrads<T>) {
        let fwd = self.forward_pass(x, h0, true);
        let grads = self.backward_from(x, &fwd, d_o, dht, false).grads;
        ((fwd.o, fwd.final_state), grads)
    }

    /// The gradients written into the run's tensors chunk by chunk; a pair
    /// longer than a span in spans ([`crate::fast::spans::in_spans`]).
    fn forward_backward_into(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        out: HeadSink<'_, T, Kda>,
    ) {
        if x.len() > self.span_len {
            return crate::fast::spans::chunked_in_spans!(self, x, h0, d_o, dht, out);
        }
        let fwd = self.forward_pass(x, h0, true);
        views::copy_into(out.o, fwd.o.view());
        views::copy_into(out.final_state, fwd.final_state.view());
        self.backward_into(x, &fwd, d_o, dht, false, out.grads);
    }

    /// q/k after an in-kernel l2norm and β after an in-kernel sigmoid, in
    /// the policy's activation storage.
    fn stored<'a>(&self, p: Prepared<'a, T>) -> Prepared<'a, T>
    where
        T: 'a,
    {
        p.with_stored_activations(&self.policy)
    }

    /// `M = Π M_chunk`, later chunks on the left.
    fn transition(&self, x: &KdaHead<T>) -> Array2<T> {
        let mut m = Array2::eye(x.k_dim());
        for ch in self.intras(x) {
            m = gemm::dot(ch.transition().view(), m.view());
            self.policy.round(Stage::MChain, &mut m);
        }
        m
    }
}

/// Forward intermediates of every (sequence, value head) pair of a batch, in
/// pair order (sequence-major), for dumping and comparing with a kernel.
pub fn intermediates<T: Scalar>(
    engine: &Chunk,
    x: &KdaInputs<T>,
    opt: &KdaOptions,
) -> Result<Vec<(Segment, usize, ChunkForward<T>)>> {
    let p = Prepared::new(x, opt)?.with_stored_activations(&engine.policy);
    let hv = p.dims.hv;
    Ok(par_pairs(p.segments.len(), hv, |si, h| {
        let seg = p.segments[si];
        (
            seg,
            h,
            engine.forward_intermediates(
                &Kda::head(&p, &seg, h),
                op::initial_state(&p, seg.seq, h).view(),
            ),
        )
    }))
}
