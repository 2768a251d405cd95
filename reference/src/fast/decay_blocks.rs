//! A chunk's pairwise decays `exp(Γ_r − Γ_s)` (`s ≤ r`) in blocks, for a
//! chunk whose decay range is too wide for one pair of middle-row factors.
//!
//! The chunked engines form `exp(Γ_r − Γ_s)` as `exp(Γ_r − Γ_m)·exp(Γ_m −
//! Γ_s)` through the chunk's middle row `m`: two matrix products instead of
//! one exponential per pair and key dim. A factor overflows where a column
//! of Γ spans more than about `2·`[`crate::scalar::exp_bound`] within the
//! chunk (in `f32` a span of 71: a gate of −1.1 per token at C = 64). Such
//! a chunk is split in halves until each half's factors fit; the pairs
//! across a split go through the last row `a` before it, where both
//! factors are at most 1 (`Γ` falls along the chunk): `exp(Γ_r − Γ_a)` for
//! the rows after the split and `exp(Γ_a − Γ_s)` for those before. Such a
//! factor can only underflow where the decay it is part of is smaller
//! still. The blocks are matrix products like the whole chunk's; what they
//! replace, one exponential per pair and key dim, made a chunked run 6 to
//! 14 times as slow as the naive one at K = V = 64.

use std::ops::Range;

use ndarray::{Array2, ArrayView2, ArrayViewMut2};

use crate::fast::gemm;
use crate::fast::tri;
use crate::scalar::Scalar;

/// `x [m, n] · y [n, p]`, returned.
pub(crate) type Dot<T> = fn(ArrayView2<T>, ArrayView2<T>) -> Array2<T>;
/// `out [m, p] += x [m, n] · y [n, p]`.
pub(crate) type DotAdd<T> = fn(ArrayView2<T>, ArrayView2<T>, ArrayViewMut2<T>);

/// The products a block's backward takes of a pair gradient `dA`:
/// `(dA·x, out += dA·x, dAᵀ·x, out += dAᵀ·x)`. On the diagonal `dA` is
/// lower triangular and they are [`crate::fast::tri`]'s blocked products; below
/// it `dA` is full and they are plain ones.
pub(crate) fn grad_products<T: Scalar>(diagonal: bool) -> (Dot<T>, DotAdd<T>, Dot<T>, DotAdd<T>) {
    if diagonal {
        (
            tri::lower_dot,
            tri::lower_dot_add,
            tri::lower_t_dot,
            tri::lower_t_dot_add,
        )
    } else {
        (
            gemm::dot,
            gemm::dot_add,
            |x, y| gemm::dot(x.t(), y),
            |x, y, out| gemm::dot_add(x.t(), y, out),
        )
    }
}

/// One block of a split chunk's pairs.
#[derive(Clone, Debug)]
pub(crate) enum Block<F> {
    /// Rows `rows` against themselves, through the middle row's factors
    /// `F` (their lower triangle is used).
    Diagonal { rows: Range<usize>, factors: F },
    /// Rows `rows` against the rows `cols` just before them, through the
    /// last row of `cols`.
    Below {
        rows: Range<usize>,
        cols: Range<usize>,
    },
}

/// The blocks that cover the pairs `s ≤ r` of `rows`: `rows` itself where
/// `diagonal(rows)` gives its factors, else the blocks of each half and the
/// half after the split below the half before. A single row always fits
/// (its one pair is `exp(0)`), which ends the splitting: `diagonal` must
/// return `Some` for one row.
pub(crate) fn split<F>(
    rows: Range<usize>,
    diagonal: &mut impl FnMut(Range<usize>) -> Option<F>,
) -> Vec<Block<F>> {
    let mut out = Vec::new();
    split_into(rows, diagonal, &mut out);
    out
}

fn split_into<F>(
    rows: Range<usize>,
    diagonal: &mut impl FnMut(Range<usize>) -> Option<F>,
    out: &mut Vec<Block<F>>,
) {
    if let Some(factors) = diagonal(rows.clone()) {
        out.push(Block::Diagonal { rows, factors });
        return;
    }
    assert!(rows.len() > 1, "decay_blocks: one row's factors must fit");
    let mid = rows.start + rows.len() / 2;
    split_into(rows.start..mid, diagonal, out);
    split_into(mid..rows.end, diagonal, out);
    out.push(Block::Below {
        rows: mid..rows.end,
        cols: rows.start..mid,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many blocks hold each pair `(r, s)` of `0..c`.
    fn coverage(c: usize, blocks: &[Block<()>]) -> Vec<Vec<usize>> {
        let mut n = vec![vec![0; c]; c];
        for b in blocks {
            let pairs: Vec<(usize, usize)> = match b {
                Block::Diagonal { rows, .. } => rows
                    .clone()
                    .flat_map(|r| (rows.start..=r).map(move |s| (r, s)))
                    .collect(),
                Block::Below { rows, cols } => {
                    assert_eq!(cols.end, rows.start, "below block right under its columns");
                    rows.clone()
                        .flat_map(|r| cols.clone().map(move |s| (r, s)))
                        .collect()
                }
            };
            for (r, s) in pairs {
                n[r][s] += 1;
            }
        }
        n
    }

    #[test]
    fn blocks_cover_every_pair_once() {
        // Blocks fit where they span at most `w` rows (a decay range
        // growing with the rows).
        for c in [1, 2, 5, 16, 33, 64] {
            for w in 1..=c {
                let blocks = split(0..c, &mut |r: Range<usize>| (r.len() <= w).then_some(()));
                let n = coverage(c, &blocks);
                for (r, row) in n.iter().enumerate() {
                    for (s, &k) in row.iter().enumerate() {
                        assert_eq!(k, usize::from(s <= r), "c = {c}, w = {w}: pair ({r}, {s})");
                    }
                }
                let diagonal = blocks
                    .iter()
                    .filter(|b| matches!(b, Block::Diagonal { .. }))
                    .count();
                assert_eq!(
                    diagonal == 1,
                    w >= c,
                    "c = {c}, w = {w}: split only when needed"
                );
            }
        }
    }
}
