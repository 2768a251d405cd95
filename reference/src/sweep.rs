//! Pieces shared by the naive engines, which sweep a `[K, V]` state held as
//! a row-major slice once or twice per token.

use ndarray::{Array2, ArrayBase, ArrayView2, Data, Ix2};

use crate::scalar::Scalar;

/// Columns per tile of a forward sweep: a sweep walks down the `K` rows one
/// tile of columns at a time, so the tile's `[V]` accumulators stay in
/// registers. 16 (two cache lines of `f64` per row, two AVX-512 registers
/// per accumulator) against 8: the K = V = 256 naive forward+backward, whose
/// state lives in L2, takes 177 instead of 350 ms (AVX-512) and 178 instead
/// of 309 ms (AVX2) on the 2-core VM; K = V = 64 about 5 % less. The bits do
/// not depend on it (each element's operations are the same).
pub const TILE: usize = 16;

/// Tokens per block of the checkpointed backward: states are kept every
/// `⌈√L⌉` (at least 16) tokens and recomputed per block, so memory is
/// `O(√L · K · V)`. The GPU's naive backward uses the same spacing.
pub fn block_len(l: usize) -> usize {
    ((l as f64).sqrt().ceil() as usize).max(16)
}

/// The forward schedule of the naive engines over tokens `0 .. l`: sweep
/// `t` (one call `sweep(s, fin, start)`) finishes token `fin = t − 1` and
/// starts token `start = t`. With `checkpoints`, the state entering the first
/// token of every block of [`block_len`] tokens is appended to it, so there
/// the two halves run as two calls around the copy.
#[inline(always)]
pub fn run_tokens<T: Copy>(
    l: usize,
    s: &mut [T],
    mut checkpoints: Option<&mut Vec<T>>,
    mut sweep: impl FnMut(&mut [T], Option<usize>, Option<usize>),
) {
    let bl = block_len(l);
    if let Some(states) = &mut checkpoints {
        states.reserve(l.div_ceil(bl) * s.len());
    }
    for t in 0..=l {
        let (fin, start) = (t.checked_sub(1), (t < l).then_some(t));
        match &mut checkpoints {
            Some(states) if t < l && t % bl == 0 => {
                sweep(s, fin, None);
                states.extend_from_slice(s);
                sweep(s, None, start);
            }
            _ => sweep(s, fin, start),
        }
    }
}

/// The backward schedule matching [`run_tokens`]: blocks in reverse; each block's entering states `S_{t−1}` (`kv` values
/// each) are rebuilt from its checkpoint by `replay(t, S_{t−1}, S_t)`, then
/// `back(start, end, states, ds)` runs the block's reverse sweeps, taking
/// `ds` from `∂L/∂S_{end−1}` to `∂L/∂S_{start−1}`. Memory: one block of states.
#[inline(always)]
pub fn reverse_blocks<T: Scalar>(
    l: usize,
    kv: usize,
    checkpoints: &[T],
    ds: &mut [T],
    replay: impl Fn(usize, &[T], &mut [T]),
    mut back: impl FnMut(usize, usize, &[T], &mut [T]),
) {
    let bl = block_len(l);
    let mut prev = vec![T::zero(); bl * kv];
    for (blk, start) in (0..l).step_by(bl).enumerate().rev() {
        let end = (start + bl).min(l);
        prev[..kv].copy_from_slice(&checkpoints[blk * kv..(blk + 1) * kv]);
        for t in start..end - 1 {
            let (done, next) = prev.split_at_mut((t + 1 - start) * kv);
            replay(t, &done[(t - start) * kv..], &mut next[..kv]);
        }
        back(start, end, &prev, ds);
    }
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
