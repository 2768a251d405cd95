//! Element-wise helpers of the chunked engines: one pass over contiguous
//! data instead of one `ndarray` temporary per operation.
//!
//! Every fused loop computes each element with the same operations, in the
//! same order, as the chain of array expressions it replaces, so the results
//! keep their bits.

use ndarray::{Array2, ArrayView2};

use crate::scalar::Scalar;

/// The elements of a standard-layout view (whole rows of an owned array:
/// every array the engines build or slice by rows), in order.
pub fn flat<'a, T>(a: ArrayView2<'a, T>) -> &'a [T] {
    a.to_slice().expect("standard layout")
}

/// The elements of an owned array, in order.
pub fn flat_mut<T>(a: &mut Array2<T>) -> &mut [T] {
    a.as_slice_mut().expect("standard layout")
}

/// `-(a b)` for `a [m, n]`, `b [n, p]` in one product (the negation of
/// each sum is exact): `[m, p]`.
pub fn neg_dot<T: Scalar>(a: ArrayView2<T>, b: ArrayView2<T>) -> Array2<T> {
    let mut out = Array2::zeros((a.nrows(), b.ncols()));
    ndarray::linalg::general_mat_mul(-T::one(), &a, &b, T::zero(), &mut out);
    out
}

/// `Γ ← reverse cumsum` down the rows of `g [c, K]` after adding `last [K]`
/// to its last row: the gradient of the in-chunk cumulative sum (`Γ_r =
/// Σ_{i≤r} g_i`) when `last` is the gradient of `Γ_last` on its own.
pub fn reverse_cumsum_rows<T: Scalar>(g: &mut Array2<T>, last: &[T]) {
    let kd = g.ncols();
    let c = g.nrows();
    let data = flat_mut(g);
    for (x, &y) in data[(c - 1) * kd..].iter_mut().zip(last) {
        *x += y;
    }
    for r in (0..c - 1).rev() {
        let (head, tail) = data.split_at_mut((r + 1) * kd);
        for (x, &y) in head[r * kd..].iter_mut().zip(&tail[..kd]) {
            *x += y;
        }
    }
}
