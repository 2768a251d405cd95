//! Pieces shared by the naive engines, which sweep a `[K, V]` state held as
//! a row-major slice once or twice per token.

use ndarray::{Array2, ArrayBase, ArrayView2, Data, Ix2};

use crate::scalar::Scalar;

/// Columns per tile of a forward sweep: a sweep walks down the `K` rows one
/// tile of columns at a time, so the tile's `[V]` accumulators stay in
/// registers.
pub const TILE: usize = 8;

/// Tokens per block of the checkpointed backward: states are kept every
/// `⌈√L⌉` tokens and recomputed per block, so memory is `O(√L · K · V)`.
pub fn block_len(l: usize) -> usize {
    ((l as f64).sqrt().ceil() as usize).max(16)
}

/// A `[K, V]` view as a row-major vector.
pub fn state<T: Scalar>(a: ArrayView2<T>) -> Vec<T> {
    a.as_standard_layout()
        .into_owned()
        .into_raw_vec_and_offset()
        .0
}

/// Row `t` of a row-major (standard-layout) array.
#[inline(always)]
pub fn row<T, S: Data<Elem = T>>(a: &ArrayBase<S, Ix2>, t: usize) -> &[T] {
    let n = a.ncols();
    &a.as_slice().expect("row-major")[t * n..(t + 1) * n]
}

/// Row `t` of a row-major array, mutable.
#[inline(always)]
pub fn row_mut<T>(a: &mut Array2<T>, t: usize) -> &mut [T] {
    let n = a.ncols();
    &mut a.as_slice_mut().expect("row-major")[t * n..(t + 1) * n]
}

/// A chunk of four as an array. Row kernels load their chunks into arrays
/// and store the results after the arithmetic: with loads and stores apart,
/// LLVM vectorises the four lanes without proving the rows never overlap.
#[inline(always)]
pub fn quad<T: Copy>(a: &[T]) -> [T; 4] {
    a.try_into().expect("4 elements")
}
