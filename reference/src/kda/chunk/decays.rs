//! How a chunk forms its gate exponentials: the pairwise decays
//! `exp(Γ_r − Γ_s)` of the intra stage and `exp(Γ)`, `exp(Γ_last − Γ)` of
//! `qg`, `kg` and `w` (FLA forms them inside `chunk_kda_fwd_intra` and
//! `recompute_w_u_fwd`): through the chunk's middle row, in blocks where
//! that would overflow ([`crate::fast::decay_blocks`]), or pair by pair.

use ndarray::{s, Array2, ArrayView2, CowArray, Ix2};

use super::Chunk;
use crate::fast::decay_blocks::Block;
use crate::fast::fused;
use crate::scalar::{exp_bound, Scalar};

/// How a chunk forms its pairwise decays `exp(Γ_r − Γ_s)` and its
/// exponentials `(exp(Γ), exp(Γ_last − Γ))` ([`Decays::exps`]).
#[derive(Clone, Debug)]
pub(super) enum Decays<T> {
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
pub(super) struct DecayBlock<T> {
    pub(super) rows: std::ops::Range<usize>,
    /// `rows` itself on the diagonal (through its middle row, the lower
    /// triangle used); else the rows just before `rows`, through their last.
    pub(super) cols: std::ops::Range<usize>,
    /// `exp(Γ_rows − Γ_anchor)`, `[|rows|, K]`
    pub(super) row: Array2<T>,
    /// `exp(Γ_anchor − Γ_cols)`, `[|cols|, K]`
    pub(super) col: Array2<T>,
}

impl<T> DecayBlock<T> {
    pub(super) fn diagonal(&self) -> bool {
        self.rows == self.cols
    }
}

impl<T: Scalar> Decays<T> {
    /// The middle-row factors, where the pairwise decays go through them.
    pub(super) fn factors(&self) -> Option<&(Array2<T>, Array2<T>)> {
        match self {
            Decays::Mid { factors, .. } | Decays::Factored { factors, .. } => Some(factors),
            Decays::Blocks { .. } | Decays::Pairs { .. } => None,
        }
    }

    /// `(exp(Γ), exp(Γ_last − Γ))`, `[c, K]` each (`exp(Γ_last − Γ)` is at
    /// most 1: no overflow): rebuilt through the middle row as
    /// `exp(Γ − Γ_m)·exp(Γ_m)` and `exp(Γ_m − Γ)·exp(Γ_last − Γ_m)`, or the
    /// direct exponentials kept. The same bits in the intra stage and after.
    pub(super) fn exps(&self) -> [CowArray<'_, T, Ix2>; 2] {
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

impl Chunk {
    /// `exp(Γ_r − Γ_s)` for one key dim, formed from differences; with the
    /// safe-gate policy, through the midpoint of `r`'s 16-token sub-chunk.
    #[inline]
    pub(super) fn pair_decay<T: Scalar>(&self, g: &Array2<T>, r: usize, s: usize, d: usize) -> T {
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
    pub(super) fn factors<T: Scalar>(&self, g: &Array2<T>) -> Option<(Array2<T>, Array2<T>)> {
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
    pub(super) fn decay_blocks<T: Scalar>(&self, g: &Array2<T>) -> Option<Vec<DecayBlock<T>>> {
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
    pub(super) fn exps<T: Scalar>(&self, x: ArrayView2<T>) -> Array2<T> {
        if self.policy.exp2 {
            return x.mapv(|v| self.policy.exp(v));
        }
        fused::exps(x)
    }

    /// `(exp(Γ_m), exp(Γ_last − Γ_m))` ([`fused::mid_row_exps`]), `[K]`
    /// each, through which a chunk's exponentials are rebuilt; `None`
    /// without the `factors`, under FLA's `exp2`, or when a column factor is
    /// not normal.
    pub(super) fn mid_exps<T: Scalar>(
        &self,
        g_cumsum: &Array2<T>,
        factors: Option<&(Array2<T>, Array2<T>)>,
    ) -> Option<(Vec<T>, Vec<T>)> {
        factors.filter(|_| !self.policy.exp2)?;
        fused::mid_row_exps(g_cumsum)
    }

    /// `(exp(Γ), exp(Γ_last − Γ))` formed directly from Γ, `[c, K]` each.
    pub(super) fn direct_exps<T: Scalar>(&self, g_cumsum: &Array2<T>) -> [Array2<T>; 2] {
        let last = g_cumsum.row(g_cumsum.nrows() - 1);
        [
            self.exps(g_cumsum.view()),
            self.exps((-(g_cumsum - &last)).view()),
        ]
    }
}
