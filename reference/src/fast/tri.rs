//! Matrix products of the chunked engines where a `[C, C]` factor is
//! lower triangular or only the lower triangle of the result is used,
//! done in blocks of [`BLOCK`] rows so that the blocks of zeros (or of
//! unwanted results) are never multiplied: about `(C + BLOCK) / (2C)` of
//! the full product's work (`deltaref bench` counts it so:
//! `deltaref_verify::bench::op_count`).
//!
//! Each element is the same sum, in the same order, as in the full
//! product, less terms `0·y` on the zero side of the triangle (always at
//! the start or the end of the sum); with finite values `x + 0·y` is `x`
//! and `0 + x` is `x`, so the results have the full product's bits.

use ndarray::{s, Array2, ArrayView2, ArrayViewMut2};

use crate::fast::gemm;
use crate::scalar::Scalar;

/// Rows per block. 16 is FLA's sub-chunk and keeps the blocks large enough
/// for the matrix-product kernel (4 blocks at C = 64).
pub(crate) const BLOCK: usize = 16;

/// Row blocks `(r0, r1)` of `c` rows.
fn blocks(c: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..c)
        .step_by(BLOCK)
        .map(move |r0| (r0, (r0 + BLOCK).min(c)))
}

/// `a b` for a lower triangular `a [C, C]` (zeros above the diagonal) and
/// `b [C, N]`: row block `r0..r1` reads `a`'s columns `..r1` only.
/// Returns `[C, N]`.
pub(crate) fn lower_dot<T: Scalar>(a: ArrayView2<T>, b: ArrayView2<T>) -> Array2<T> {
    gemm::stacked(b.ncols(), &lower_parts(a, b))
}

/// `out ← out + a b` ([`lower_dot`]'s product added as [`gemm::dot_add`]
/// adds: each sum goes on from `out`'s element). `out` is `[C, N]`.
pub(crate) fn lower_dot_add<T: Scalar>(a: ArrayView2<T>, b: ArrayView2<T>, out: ArrayViewMut2<T>) {
    gemm::stacked_add(&lower_parts(a, b), out)
}

/// [`lower_dot`]'s row blocks, as the products that make them.
fn lower_parts<'a, T: Scalar>(
    a: ArrayView2<'a, T>,
    b: ArrayView2<'a, T>,
) -> Vec<(ArrayView2<'a, T>, ArrayView2<'a, T>)> {
    blocks(a.nrows())
        .map(|(r0, r1)| (a.slice_move(s![r0..r1, ..r1]), b.slice_move(s![..r1, ..])))
        .collect()
}

/// `aᵀ b` for a lower triangular `a [C, C]` and `b [C, N]`: row block
/// `r0..r1` of the result reads rows `r0..` of `a` and `b` only.
/// Returns `[C, N]`.
pub(crate) fn lower_t_dot<T: Scalar>(a: ArrayView2<T>, b: ArrayView2<T>) -> Array2<T> {
    gemm::stacked(b.ncols(), &lower_t_parts(a, b))
}

/// `out ← out + aᵀ b` ([`lower_t_dot`]'s product added as
/// [`gemm::dot_add`] adds). `out` is `[C, N]`.
pub(crate) fn lower_t_dot_add<T: Scalar>(
    a: ArrayView2<T>,
    b: ArrayView2<T>,
    out: ArrayViewMut2<T>,
) {
    gemm::stacked_add(&lower_t_parts(a, b), out)
}

/// [`lower_t_dot`]'s row blocks, as the products that make them.
fn lower_t_parts<'a, T: Scalar>(
    a: ArrayView2<'a, T>,
    b: ArrayView2<'a, T>,
) -> Vec<(ArrayView2<'a, T>, ArrayView2<'a, T>)> {
    blocks(a.ncols())
        .map(|(r0, r1)| {
            (
                a.slice_move(s![r0.., r0..r1]).reversed_axes(),
                b.slice_move(s![r0.., ..]),
            )
        })
        .collect()
}

/// The blocks on and below the diagonal of `a bᵀ` (`a [C, N]`, `b [C, N]`);
/// the blocks above stay zero and the diagonal blocks are whole (the caller
/// masks what it does not use). With `b_lower` (`b [C, C]` lower triangular)
/// the sums stop at the block's end. Returns `[C, C]`.
pub(crate) fn dot_t_lower<T: Scalar>(
    a: ArrayView2<T>,
    b: ArrayView2<T>,
    b_lower: bool,
) -> Array2<T> {
    let [out] = dot_t_lower_each([a], b, b_lower);
    out
}

/// [`dot_t_lower`] of each `aᵢ` with one `b`, whose transpose is packed
/// once for all. Returns `[C, C]` each.
pub(crate) fn dot_t_lower_each<T: Scalar, const N: usize>(
    a: [ArrayView2<T>; N],
    b: ArrayView2<T>,
    b_lower: bool,
) -> [Array2<T>; N] {
    let bt = gemm::rows_contiguous(b.t());
    a.map(|a| {
        let mut out = crate::fast::stagger::zeros((a.nrows(), b.nrows()));
        lower_blocks_of(a, bt.view(), b_lower, out.view_mut(), gemm::dot_to);
        out
    })
}

/// `out ← out + a bᵀ` on the blocks [`dot_t_lower`] computes, each sum
/// going on from `out`'s element ([`gemm::dot_add`]); the blocks above the
/// diagonal are left as they are. `out` is `[C, C]`.
pub(crate) fn dot_t_lower_add<T: Scalar>(
    a: ArrayView2<T>,
    b: ArrayView2<T>,
    b_lower: bool,
    out: ArrayViewMut2<T>,
) {
    let bt = gemm::rows_contiguous(b.t());
    lower_blocks_of(a, bt.view(), b_lower, out, gemm::dot_add);
}

/// `product(a block, bt block, out block)` for the row blocks of `a [C, N]`
/// and the blocks of `bt [N, C]` on and below the diagonal.
fn lower_blocks_of<T: Scalar>(
    a: ArrayView2<T>,
    bt: ArrayView2<T>,
    b_lower: bool,
    mut out: ArrayViewMut2<T>,
    product: fn(ArrayView2<T>, ArrayView2<T>, ArrayViewMut2<T>),
) {
    for (r0, r1) in blocks(a.nrows()) {
        let inner = if b_lower { r1 } else { a.ncols() };
        product(
            a.slice(s![r0..r1, ..inner]),
            bt.slice(s![..inner, ..r1]),
            out.slice_mut(s![r0..r1, ..r1]),
        );
    }
}

/// `[a₁; a₂; …] b`: the products `aᵢ b` (`aᵢ [mᵢ, n]`, `b [n, p]`)
/// stacked by rows, each with its own product's bits. Returns `[Σ mᵢ, p]`.
pub(crate) fn stacked_dot<T: Scalar>(a: &[ArrayView2<T>], b: ArrayView2<T>) -> Array2<T> {
    let b = gemm::rows_contiguous(b);
    let parts: Vec<_> = a.iter().map(|x| (x.view(), b.view())).collect();
    gemm::stacked(b.ncols(), &parts)
}

/// Zeroes the strict upper triangle of `a [C, C]`, and the diagonal too
/// unless `diagonal`: the part of a blocked product's diagonal blocks that
/// the caller does not use.
pub(crate) fn mask_lower<T: Scalar>(a: &mut Array2<T>, diagonal: bool) {
    let n = a.ncols();
    if n == 0 {
        return;
    }
    // Rows of the flat data: slicing an ndarray row per row cost as much
    // as the product it masks at C = 32.
    for (r, row) in crate::fast::fused::flat_mut(a)
        .chunks_exact_mut(n)
        .enumerate()
    {
        let from = (r + usize::from(diagonal)).min(n);
        row[from..].fill(T::zero());
    }
}

/// `(I − L)^{-1}` of a strictly lower triangular `L [c, c]` given by
/// `l(r, s)` (`s < r`), by forward substitution: row `r` of the result
/// gains `l(r, s) ·` row `s` for each `s < r` with `l(r, s) ≠ 0`, as
/// `y + l·x` in that order. Row `s` is zero beyond column `s` (and never
/// `−0`), so only columns `..= s` are touched: the same bits as adding
/// whole rows, without the copies. Returns the unit lower triangular `[c, c]`.
pub(crate) fn unit_lower_inverse<T: Scalar>(c: usize, l: impl Fn(usize, usize) -> T) -> Array2<T> {
    let mut n = crate::fast::stagger::zeros((c, c));
    n.diag_mut().fill(T::one());
    let data = n.as_slice_mut().expect("standard layout");
    crate::fast::simd::dispatch(
        #[inline(always)]
        || {
            for r in 1..c {
                let (above, rest) = data.split_at_mut(r * c);
                let row_r = &mut rest[..c];
                for s in 0..r {
                    let coef = l(r, s);
                    if coef != T::zero() {
                        let row_s = &above[s * c..s * c + s + 1];
                        for (y, &x) in row_r.iter_mut().zip(row_s) {
                            *y += coef * x;
                        }
                    }
                }
            }
        },
    );
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Stream;

    /// `[r, c]` of normal draws (stream `name`), lower triangular (with the
    /// diagonal) when `lower`.
    fn draw(name: &str, r: usize, c: usize, lower: bool) -> Array2<f64> {
        let x = Array2::from_shape_vec((r, c), Stream::new(11, name).normals(r * c)).unwrap();
        if lower {
            lower_part(x)
        } else {
            x
        }
    }

    fn lower_part(mut a: Array2<f64>) -> Array2<f64> {
        a.indexed_iter_mut().for_each(|((i, j), v)| {
            if j > i {
                *v = 0.0
            }
        });
        a
    }

    fn same_bits(a: &Array2<f64>, b: &Array2<f64>) -> bool {
        a.shape() == b.shape() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    #[test]
    fn blocked_products_have_the_full_products_bits() {
        for (c, n) in [(16, 8), (32, 64), (64, 48), (40, 24), (7, 5)] {
            let l = draw("l", c, c, true);
            let b = draw("b", c, n, false);
            let a = draw("a", c, n, false);
            assert!(
                same_bits(
                    &lower_dot(l.view(), b.view()),
                    &gemm::dot(l.view(), b.view())
                ),
                "{c} {n}"
            );
            assert!(same_bits(
                &lower_t_dot(l.view(), b.view()),
                &gemm::dot(l.t(), b.view())
            ));
            let full = lower_part(gemm::dot(a.view(), b.t()));
            assert!(same_bits(
                &lower_part(dot_t_lower(a.view(), b.view(), false)),
                &full
            ));
            let x = draw("x", c, c, false);
            let full = lower_part(gemm::dot(x.view(), l.t()));
            assert!(same_bits(
                &lower_part(dot_t_lower(x.view(), l.view(), true)),
                &full
            ));
        }
    }

    #[test]
    fn stacked_products_have_the_separate_products_bits() {
        for (m1, m2, n, p) in [(16, 16, 64, 64), (32, 32, 128, 128), (7, 40, 33, 9)] {
            let (a1, a2) = (draw("a1", m1, n, false), draw("a2", m2, n, false));
            let b = draw("b", p, n, false);
            let both = stacked_dot(&[a1.view(), a2.view()], b.t());
            assert!(same_bits(
                &both.slice(s![..m1, ..]).to_owned(),
                &gemm::dot(a1.view(), b.t())
            ));
            assert!(same_bits(
                &both.slice(s![m1.., ..]).to_owned(),
                &gemm::dot(a2.view(), b.t())
            ));
        }
    }

    /// `[a₁ a₂]` side by side, the inner dimensions joined.
    fn joined(a1: ArrayView2<f64>, a2: ArrayView2<f64>) -> Array2<f64> {
        ndarray::concatenate![ndarray::Axis(1), a1, a2]
    }

    /// A product added to another has the bits of the full product over the
    /// joined inner dimension, and `dot_t_lower_add` leaves the blocks above
    /// the diagonal as they were.
    #[test]
    fn added_products_have_the_joined_full_products_bits() {
        for (c, n) in [(16, 8), (32, 64), (64, 48), (40, 24), (7, 5)] {
            let (l1, l2) = (draw("l1", c, c, true), draw("l2", c, c, true));
            let (b1, b2) = (draw("b1", c, n, false), draw("b2", c, n, false));
            let b12 = ndarray::concatenate![ndarray::Axis(0), b1, b2];
            let mut sum = lower_dot(l1.view(), b1.view());
            lower_dot_add(l2.view(), b2.view(), sum.view_mut());
            let want = gemm::dot(joined(l1.view(), l2.view()).view(), b12.view());
            assert!(same_bits(&sum, &want), "lower_dot_add {c} {n}");
            let mut sum = lower_t_dot(l1.view(), b1.view());
            lower_t_dot_add(l2.view(), b2.view(), sum.view_mut());
            let want = gemm::dot(joined(l1.t(), l2.t()).view(), b12.view());
            assert!(same_bits(&sum, &want), "lower_t_dot_add {c} {n}");

            let (a1, a2) = (draw("a1", c, n, false), draw("a2", c, c, false));
            let mut sum = dot_t_lower(a1.view(), b1.view(), false);
            let upper = sum.mapv(|_| 7.0) - lower_part(sum.mapv(|_| 7.0));
            // Distinct values above the blocks, to see that they are kept.
            sum += &upper.mapv(|x| x * 3.0);
            let before = sum.clone();
            dot_t_lower_add(a2.view(), l2.view(), true, sum.view_mut());
            let full = gemm::dot(
                joined(a1.view(), a2.view()).view(),
                joined(b1.view(), l2.view()).t(),
            );
            assert!(
                same_bits(&lower_part(sum.clone()), &lower_part(full)),
                "dot_t_lower_add {c} {n}"
            );
            let blocked = dot_t_lower(a2.view(), l2.view(), true);
            for ((i, j), &v) in sum.indexed_iter() {
                if blocked[[i, j]] == 0.0 && j > i {
                    assert_eq!(v.to_bits(), before[[i, j]].to_bits(), "{i} {j} kept");
                }
            }
        }
    }

    #[test]
    fn masking_keeps_the_lower_triangle() {
        let full = draw("m", 5, 5, false);
        for diagonal in [true, false] {
            let mut a = full.clone();
            mask_lower(&mut a, diagonal);
            for ((r, c), &v) in a.indexed_iter() {
                let keep = c < r || (diagonal && c == r);
                assert_eq!(v, if keep { full[[r, c]] } else { 0.0 }, "{r} {c}");
            }
        }
        let mut empty = Array2::<f64>::zeros((0, 0));
        mask_lower(&mut empty, true);
    }
}
