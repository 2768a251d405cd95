//! Element-wise helpers of the chunked engines: one pass over contiguous
//! data instead of one `ndarray` temporary per operation.
//!
//! Every fused loop computes each element with the same operations, in the
//! same order, as the chain of array expressions it replaces, so the results
//! keep their bits.

use std::borrow::Cow;

use ndarray::{Array1, Array2, ArrayView2};

use crate::scalar::Scalar;

/// The elements of `a` in row-major order: borrowed when `a` is in standard
/// layout (the arrays the engines build, whole rows of them), else copied
/// (a caller's inputs may be strided).
pub fn flat<'a, T: Clone>(a: ArrayView2<'a, T>) -> Cow<'a, [T]> {
    match a.to_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(a.iter().cloned().collect()),
    }
}

/// The elements of an owned array in row-major order, for writing (`a` is
/// first moved to standard layout if it is not).
pub fn flat_mut<T: Clone>(a: &mut Array2<T>) -> &mut [T] {
    if !a.is_standard_layout() {
        *a = a.as_standard_layout().into_owned();
    }
    a.as_slice_mut().expect("standard layout")
}

/// `x ⊙ f` for each pair `(x, f)` of same-shape arrays.
pub fn products<T: Scalar, const N: usize>(
    pairs: [(ArrayView2<T>, ArrayView2<T>); N],
) -> [Array2<T>; N] {
    pairs.map(|(x, f)| {
        let mut o = Array2::zeros(x.raw_dim());
        let (x, f) = (flat(x), flat(f));
        for ((o, &x), &f) in flat_mut(&mut o).iter_mut().zip(x.iter()).zip(f.iter()) {
            *o = x * f;
        }
        o
    })
}

/// `s ← ((s ⊙ e) + x₁) + x₂ …` for `s`, `xᵢ` `[K, V]` and `e [K]` (one decay
/// per row): a state carried over one chunk.
pub fn decay_add<T: Scalar>(s: &mut Array2<T>, e: &Array1<T>, terms: &[&Array2<T>]) {
    let vd = s.ncols();
    let s = flat_mut(s);
    for (row, &e) in s.chunks_exact_mut(vd).zip(e) {
        row.iter_mut().for_each(|x| *x *= e);
    }
    for x in terms {
        for (y, &x) in s.iter_mut().zip(flat(x.view()).iter()) {
            *y += x;
        }
    }
}

/// Reverse cumulative sum down the rows of `g [c, K]`, in place: the
/// gradient of an in-chunk cumulative sum (`Γ_r = Σ_{i≤r} g_i`).
pub fn reverse_cumsum_rows<T: Scalar>(g: &mut Array2<T>) {
    let (c, kd) = g.dim();
    let data = flat_mut(g);
    for r in (0..c.saturating_sub(1)).rev() {
        let (head, tail) = data.split_at_mut((r + 1) * kd);
        for (x, &y) in head[r * kd..].iter_mut().zip(&tail[..kd]) {
            *x += y;
        }
    }
}
