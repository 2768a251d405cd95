//! Shape and value checks shared by every operator, and the gather/scatter
//! between FLA's time-major `[B, T, heads, D]` tensors and the per-head
//! `[L, D]` blocks the engines work on.

use ndarray::{
    s, Array, Array2, Array4, ArrayBase, ArrayD, ArrayView, ArrayView2, ArrayView4, ArrayViewMut,
    ArrayViewMut2, ArrayViewMut4, Axis, CowArray, Data, Dimension, Ix2, Ix4, RemoveAxis,
};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::scalar::Scalar;
use crate::varlen::Segment;

/// Checks `got == expected`; `dims` names the axes (e.g. `"[B,T,H,K]"`).
pub fn expect_shape(tensor: &str, dims: &str, expected: &[usize], got: &[usize]) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::shape(tensor, format!("{dims} = {expected:?}"), got))
    }
}

/// Checks the rank only, returning the shape.
pub fn expect_rank<'a, T>(tensor: &str, dims: &str, x: &'a ArrayD<T>) -> Result<&'a [usize]> {
    let rank = dims.split(',').count();
    if x.ndim() == rank {
        Ok(x.shape())
    } else {
        Err(Error::shape(
            tensor,
            format!("{dims} ({rank} dimensions)"),
            x.shape(),
        ))
    }
}

/// Rejects NaN and ±Inf, naming the first offending index.
pub fn check_finite<T: Scalar>(tensor: &str, x: &ArrayD<T>) -> Result<()> {
    // Scan the flat data first (fast); build the index only on failure.
    let x = x.as_standard_layout();
    let flat = x.as_slice().expect("standard layout");
    let scan = |part: &[T]| {
        crate::simd::dispatch(
            #[inline(always)]
            || first_non_finite(part),
        )
    };
    // A long case's tensor holds 10⁸ values: one core scans it for a tenth
    // of a second. Parts in order, so the first bad index is the same.
    let first_bad = if flat.len() >= PAR_FILL {
        flat.par_chunks(PAR_FILL)
            .enumerate()
            .find_map_first(|(i, part)| scan(part).map(|p| i * PAR_FILL + p))
    } else {
        scan(flat)
    };
    match first_bad {
        None => Ok(()),
        Some(pos) => {
            let mut index = vec![0; x.ndim()];
            let mut rest = pos;
            for (ix, &n) in index.iter_mut().zip(x.shape()).rev() {
                *ix = rest % n;
                rest /= n;
            }
            Err(Error::NonFinite {
                tensor: tensor.to_string(),
                index,
                value: flat[pos].f64(),
            })
        }
    }
}

/// The index of the first NaN or ±Inf in `flat`. Chunks are counted without
/// an early exit, which vectorises; only a failing chunk is searched.
#[inline(always)]
fn first_non_finite<T: Scalar>(flat: &[T]) -> Option<usize> {
    const CHUNK: usize = 1024;
    flat.chunks(CHUNK)
        .enumerate()
        .find(|(_, c)| c.iter().filter(|v| !v.is_finite()).count() > 0)
        .map(|(i, c)| i * CHUNK + c.iter().position(|v| !v.is_finite()).expect("in chunk"))
}

/// Checks a scalar option is finite.
pub fn check_finite_option(option: &str, x: f64) -> Result<()> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(Error::option(option, format!("must be finite, got {x}")))
    }
}

/// A validated 4-D tensor as `Array4` (caller checked the rank).
pub fn to4<T: Scalar>(x: &ArrayD<T>) -> Array4<T> {
    view4(x).to_owned()
}

/// A validated 4-D tensor viewed as 4-D (caller checked the rank).
pub fn view4<T: Scalar>(x: &ArrayD<T>) -> ArrayView4<'_, T> {
    x.view()
        .into_dimensionality::<Ix4>()
        .expect("rank checked by validation")
}

/// Rows `seg.start..seg.end` of head `h` of batch row `seg.batch`: `[L, D]`.
pub fn gather<T: Scalar, S: Data<Elem = T>>(
    x: &ArrayBase<S, Ix4>,
    seg: &Segment,
    h: usize,
) -> Array2<T> {
    let rows = x.slice(s![seg.batch, seg.start..seg.end, h, ..]);
    let mut out = Vec::with_capacity(rows.len());
    // Row by row: each row is contiguous in the usual layout, and copying
    // whole rows is much faster than ndarray's element-wise strided copy.
    for row in rows.rows() {
        match row.to_slice() {
            Some(r) => out.extend_from_slice(r),
            None => out.extend(row.iter().copied()),
        }
    }
    Array2::from_shape_vec(rows.raw_dim(), out).expect("L×D")
}

/// A zero tensor of `shape`, written by every rayon thread at once when it
/// is large: a run's result tensors are tens of MiB, and the allocator
/// hands back memory that is either to be cleared or still to be faulted
/// in, which one thread would do alone before any pair starts.
pub fn zeros<T: Scalar, D: Dimension>(shape: D) -> Array<T, D> {
    let n = shape.size();
    if n < PAR_FILL {
        return Array::zeros(shape);
    }
    let mut v = Vec::with_capacity(n);
    v.par_extend(rayon::iter::repeat_n(T::zero(), n).with_min_len(1 << 16));
    Array::from_shape_vec(shape, v).expect("n elements")
}

/// `a` in standard layout: borrowed where it already is, else a copy.
pub fn standard<T: Clone + num_traits::Zero, D: Dimension>(
    a: ArrayView<'_, T, D>,
) -> CowArray<'_, T, D> {
    if a.is_standard_layout() {
        return CowArray::from(a);
    }
    // (A 0- or 1-D view that is not standard is strided.)
    let last = Axis(a.ndim().saturating_sub(1));
    if a.ndim() < 2 || a.stride_of(last) != 1 {
        return CowArray::from(a.as_standard_layout().into_owned());
    }
    // Contiguous rows (a head of [B, T, heads, D]): copied a row at a time,
    // much faster than ndarray's element-wise strided copy.
    let mut out = crate::stagger::vec(a.len());
    for row in a.lanes(last) {
        out.extend_from_slice(row.to_slice().expect("contiguous rows"));
    }
    CowArray::from(crate::stagger::array(out, a.raw_dim()))
}

/// `a · scale` in standard layout (`a` itself, borrowed or copied by
/// [`standard`], when `scale` is 1): a head's queries with the attention
/// scale folded in. The rows of a head of `[B, T, heads, D]` are scaled a
/// row at a time, in one pass.
pub fn scaled_standard<T: Scalar>(a: ArrayView2<'_, T>, scale: T) -> CowArray<'_, T, Ix2> {
    if scale == T::one() {
        return standard(a);
    }
    if a.is_standard_layout() || a.stride_of(Axis(1)) != 1 {
        return a.mapv(|e| e * scale).into();
    }
    let mut out = crate::stagger::vec(a.len());
    for row in a.rows() {
        out.extend(
            row.to_slice()
                .expect("contiguous rows")
                .iter()
                .map(|&e| e * scale),
        );
    }
    crate::stagger::array(out, a.raw_dim()).into()
}

/// `dst = src` (same shape), a row at a time where both have contiguous
/// rows (a pair's rows of a run's tensors), else element by element.
pub fn copy_into<T: Copy, D: Dimension>(mut dst: ArrayViewMut<'_, T, D>, src: ArrayView<'_, T, D>) {
    assert_eq!(dst.shape(), src.shape(), "copy_into: shapes");
    let rows = dst.ndim().checked_sub(1).map(Axis);
    match rows {
        Some(last) if dst.stride_of(last) == 1 && src.stride_of(last) == 1 => {
            for (mut d, s) in dst.lanes_mut(last).into_iter().zip(src.lanes(last)) {
                let d = d.as_slice_mut().expect("contiguous rows");
                d.copy_from_slice(s.to_slice().expect("contiguous rows"));
            }
        }
        _ => dst.assign(&src),
    }
}

/// Rows `seg.start..seg.end` of head `h` of `x [B, T, heads, D]`, `[L, D]`,
/// borrowed: strided by the other heads, each row contiguous where `x` is
/// row-major.
pub fn head_view<'a, T>(x: ArrayView4<'a, T>, seg: &Segment, h: usize) -> ArrayView2<'a, T> {
    x.slice_move(s![seg.batch, seg.start..seg.end, h, ..])
}

/// Writes an `[L, D]` block back at the place `gather` took it from.
fn scatter<T: Scalar>(dst: &mut Array4<T>, seg: &Segment, h: usize, src: ArrayView2<T>) {
    dst.slice_mut(s![seg.batch, seg.start..seg.end, h, ..])
        .assign(&src);
}

/// A `[B, T, heads, D]` tensor assembled from `[L, D]` blocks, each written
/// where `gather` would take it from (`(segment, head, block)`) and freed
/// once written; the rest is 0. A lone block that covers the whole tensor
/// (one sequence, one head: a streamed head block) becomes it without a
/// copy.
pub fn assemble<T: Scalar>(
    shape: (usize, usize, usize, usize),
    blocks: Vec<(Segment, usize, Array2<T>)>,
) -> Array4<T> {
    let (b, t, heads, d) = shape;
    if let [(seg, 0, block)] = &blocks[..] {
        let whole = b == 1 && heads == 1 && (seg.batch, seg.start, seg.end) == (0, 0, t);
        if whole && block.dim() == (t, d) && block.is_standard_layout() {
            let (_, _, block) = blocks.into_iter().next().expect("one block");
            return block
                .into_shape_with_order(shape)
                .expect("a standard-layout [T, D] block");
        }
    }
    let mut out = Array4::zeros(shape);
    for (seg, h, block) in blocks {
        scatter(&mut out, &seg, h, block.view());
    }
    out
}

/// Each segment's rows `seg.start..seg.end` of batch row `seg.batch` of a
/// `[B, T, …]` view, as disjoint mutable views `[L, …]`, in the order of
/// `segments`. Segments of one batch row must not overlap (those of
/// validated inputs never do).
pub fn segments_mut<'a, T, D: RemoveAxis>(
    x: ArrayViewMut<'a, T, D>,
    segments: &[Segment],
) -> Vec<ArrayViewMut<'a, T, D::Smaller>> {
    let mut batch: Vec<_> = split_axis(x, Axis(0)).into_iter().map(Some).collect();
    let mut order: Vec<usize> = (0..segments.len()).collect();
    order.sort_by_key(|&i| (segments[i].batch, segments[i].start));
    let mut out: Vec<_> = segments.iter().map(|_| None).collect();
    // The rest of the current batch row, starting at token `from`.
    let (mut rest, mut from, mut current) = (None, 0, usize::MAX);
    for i in order {
        let seg = segments[i];
        if seg.batch != current {
            (rest, from, current) = (batch[seg.batch].take(), 0, seg.batch);
        }
        let row = rest
            .take()
            .expect("segments of one batch row do not overlap");
        let (_, row) = row.split_at(Axis(0), seg.start - from);
        let (piece, row) = row.split_at(Axis(0), seg.len());
        (out[i], rest, from) = (Some(piece), Some(row), seg.end);
    }
    out.into_iter().map(|v| v.expect("every segment")).collect()
}

/// Splits `x` along `axis` into its `n` single-index views, that axis
/// removed.
pub fn split_axis<'a, T, D: RemoveAxis>(
    mut x: ArrayViewMut<'a, T, D>,
    axis: Axis,
) -> Vec<ArrayViewMut<'a, T, D::Smaller>> {
    let n = x.len_of(axis);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let (one, rest) = x.split_at(axis, 1);
        out.push(one.index_axis_move(axis, 0));
        x = rest;
    }
    out
}

/// The `[L, …]` block of each (segment, head) pair of a `[B, T, heads, …]`
/// view, in pair order (segment-major), as disjoint mutable views.
pub fn pair_blocks_mut<'a, T, D>(
    x: ArrayViewMut<'a, T, D>,
    segments: &[Segment],
) -> Vec<ArrayViewMut<'a, T, <D::Smaller as Dimension>::Smaller>>
where
    D: RemoveAxis,
    D::Smaller: RemoveAxis,
{
    segments_mut(x, segments)
        .into_iter()
        .flat_map(|piece| split_axis(piece, Axis(1)))
        .collect()
}

/// The `[K, V]` state of each (segment, head) pair of an `[N, heads, K, V]`
/// view (row `seg.seq`), in pair order, as disjoint mutable views. Each
/// sequence has one segment (the drivers without CP).
pub fn pair_states_mut<'a, T>(
    x: ArrayViewMut4<'a, T>,
    segments: &[Segment],
) -> Vec<ArrayViewMut2<'a, T>> {
    let mut seqs: Vec<_> = split_axis(x, Axis(0)).into_iter().map(Some).collect();
    segments
        .iter()
        .flat_map(|seg| {
            let seq = seqs[seg.seq].take().expect("one segment per sequence");
            split_axis(seq, Axis(0))
        })
        .collect()
}

/// Converts between scalars (through `f64`: exact widening, rounded narrowing).
pub fn cast<T: Scalar, U: Scalar>(x: &ArrayD<T>) -> ArrayD<U> {
    // A long case's tensors hold 10⁸ values: convert them on every core.
    match x.as_slice() {
        Some(s) if s.len() >= PAR_CAST => {
            let v = s
                .par_iter()
                .with_min_len(1 << 16)
                .map(|v| U::c(v.f64()))
                .collect();
            ArrayD::from_shape_vec(x.raw_dim(), v).expect("same element count")
        }
        _ => x.mapv(|v| U::c(v.f64())),
    }
}

/// Elements from which [`cast`] runs in parallel.
const PAR_CAST: usize = 1 << 20;

/// Elements from which [`zeros`] and [`check_finite`] use every thread
/// (a bench-shape tensor, `[1, 1024, 4, 64]`, is 2¹⁸).
const PAR_FILL: usize = 1 << 16;

/// `cast` over an optional tensor.
pub fn cast_opt<T: Scalar, U: Scalar>(x: &Option<ArrayD<T>>) -> Option<ArrayD<U>> {
    x.as_ref().map(cast)
}

/// `Σ a_i b_i` with four independent partial sums (fixed order, so
/// deterministic): a strict left-to-right sum is one long dependency chain.
#[inline(always)]
pub fn dot<T: Scalar>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut sum = DotSum::new();
    for (x, y) in a.chunks_exact(4).zip(b.chunks_exact(4)) {
        for l in 0..4 {
            sum.lanes[l] += x[l] * y[l];
        }
    }
    let full = n / 4 * 4;
    for (&x, &y) in a[full..].iter().zip(&b[full..]) {
        sum.tail += x * y;
    }
    sum.finish()
}

/// The partial sums of [`dot`], for passes that accumulate dot products
/// while doing other work on the same row: `lanes[l]` sums the products at
/// `4c + l` over the full chunks of 4, `tail` the rest, and `finish`
/// combines them in `dot`'s order, so the result has `dot`'s bits.
#[derive(Clone, Copy, Debug)]
pub struct DotSum<T> {
    pub lanes: [T; 4],
    pub tail: T,
}

impl<T: Scalar> DotSum<T> {
    /// The tail starts at −0 like `Iterator::sum`, so an empty tail adds nothing.
    #[inline(always)]
    pub fn new() -> Self {
        DotSum {
            lanes: [T::zero(); 4],
            tail: -T::zero(),
        }
    }

    #[inline(always)]
    pub fn finish(self) -> T {
        // Passing the lanes through memory keeps them one vector register in
        // the loop: otherwise LLVM pairs lanes (0, 2) and (1, 3) to suit this
        // final sum and shuffles every load.
        let l = std::hint::black_box(self.lanes);
        (l[0] + l[1]) + (l[2] + l[3]) + self.tail
    }
}

/// `S` sums of [`dot`]'s order for each of the `N / 4` (1 or 2) state rows
/// of a row group in the [`crate::sweep::Pairs`] layout, as a row pass
/// accumulates them: `lanes[s][4h + l]` is row `h`'s lane `l` of sum `s`,
/// `tails[s][h]` its tail.
#[derive(Clone, Copy, Debug)]
pub struct RowSums<T, const N: usize, const S: usize> {
    pub lanes: [[T; N]; S],
    pub tails: [[T; 2]; S],
}

impl<T: Scalar, const N: usize, const S: usize> Default for RowSums<T, N, S> {
    #[inline(always)]
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Scalar, const N: usize, const S: usize> RowSums<T, N, S> {
    #[inline(always)]
    pub fn new() -> Self {
        RowSums {
            lanes: [[T::zero(); N]; S],
            tails: [[-T::zero(); 2]; S],
        }
    }

    /// Keeps the sums of rows `row .. row + N / 4` in `out`, unfinished.
    #[inline(always)]
    pub fn store(&self, row: usize, out: &mut SweepSums<T, S>) {
        for s in 0..S {
            out.lanes[s][4 * row..4 * row + N].copy_from_slice(&self.lanes[s]);
            let rows = N / 4;
            out.tails[s][row..row + rows].copy_from_slice(&self.tails[s][..rows]);
        }
    }
}

/// The `S` sums of every row of a `[K, V]` state over one sweep, kept
/// unfinished by the row passes ([`RowSums::store`]) and finished together
/// once the sweep is done: the sums feed only the per-row gradients, so the
/// adds that finish them run as vectors over the rows instead of as a few
/// scalar adds and shuffles after each row group.
#[derive(Clone, Debug)]
pub struct SweepSums<T, const S: usize> {
    /// `[K · 4]` each: row `i`'s lanes at `4i ..`.
    lanes: [Vec<T>; S],
    /// `[K]` each.
    tails: [Vec<T>; S],
    /// `[K]` each: the finished sums, [`dot`]'s bits.
    pub done: [Vec<T>; S],
}

impl<T: Scalar, const S: usize> SweepSums<T, S> {
    pub fn new(k: usize) -> Self {
        SweepSums {
            lanes: std::array::from_fn(|_| vec![T::zero(); 4 * k]),
            tails: std::array::from_fn(|_| vec![T::zero(); k]),
            done: std::array::from_fn(|_| vec![T::zero(); k]),
        }
    }

    /// `done[s][i] = (l₀ + l₁) + (l₂ + l₃) + tail` for the sums kept, as
    /// [`DotSum::finish`].
    #[inline(always)]
    pub fn finish(&mut self) {
        for s in 0..S {
            let rows = self.lanes[s].chunks_exact(4).zip(&self.tails[s]);
            for (d, (l, &tail)) in self.done[s].iter_mut().zip(rows) {
                *d = ((l[0] + l[1]) + (l[2] + l[3])) + tail;
            }
        }
    }
}

impl<T: Scalar> Default for DotSum<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// A chunked engine's span of a long pair ([`crate::varlen::in_spans`]):
/// a positive multiple of its chunk size.
pub fn check_span_len(span_len: usize, chunk_size: usize) -> Result<()> {
    if span_len > 0 && span_len.is_multiple_of(chunk_size) {
        Ok(())
    } else {
        Err(Error::option(
            "span_len",
            format!("must be a positive multiple of the chunk size {chunk_size}, got {span_len}"),
        ))
    }
}

/// `(I − L)^{-1}` of a strictly lower triangular `L [c, c]` given by
/// `l(r, s)` (`s < r`), by forward substitution: row `r` of the result
/// gains `l(r, s) ·` row `s` for each `s < r` with `l(r, s) ≠ 0`, as
/// `y + l·x` in that order. Row `s` is zero beyond column `s` (and never
/// `−0`), so only columns `..= s` are touched: the same bits as adding
/// whole rows, without the copies. Returns the unit lower triangular `[c, c]`.
pub fn unit_lower_inverse<T: Scalar>(c: usize, l: impl Fn(usize, usize) -> T) -> Array2<T> {
    let mut n = crate::stagger::zeros((c, c));
    n.diag_mut().fill(T::one());
    let data = n.as_slice_mut().expect("standard layout");
    crate::simd::dispatch(
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

    /// A head's rows of `[T, heads, D]` (contiguous rows, strided), a
    /// standard array and a column view are each scaled element for
    /// element as `mapv` scales them; scale 1 borrows a standard view.
    #[test]
    fn scaled_standard_is_mapv_for_every_layout() {
        let x = Array::from_shape_fn((5, 3, 4), |(t, h, d)| (t * 12 + h * 4 + d) as f64 / 7.0);
        let head = x.slice(s![.., 1, ..]);
        let cols = x.slice(s![.., .., 2]);
        let standard = head.to_owned();
        for (what, a) in [
            ("head rows", head),
            ("standard", standard.view()),
            ("columns", cols),
        ] {
            let got = scaled_standard(a, 0.3);
            assert!(got.is_standard_layout(), "{what}");
            assert_eq!(got, a.mapv(|e| e * 0.3), "{what}");
            assert_eq!(scaled_standard(a, 1.0), a, "{what}");
        }
        assert!(scaled_standard(standard.view(), 1.0).is_view());
    }

    fn seg(batch: usize, start: usize, end: usize) -> Segment {
        Segment {
            seq: batch,
            batch,
            start,
            end,
        }
    }

    /// A lone block covering the tensor becomes it (same buffer); blocks
    /// that do not are written in place with zeros around them.
    #[test]
    fn assemble_moves_a_whole_block_and_places_the_others() {
        let block = Array2::from_shape_fn((5, 3), |(t, d)| (10 * t + d) as f64);
        let (at, copy) = (block.as_ptr(), block.clone());
        let whole = assemble((1, 5, 1, 3), vec![(seg(0, 0, 5), 0, block)]);
        assert_eq!(whole.as_ptr(), at, "moved, not copied");
        assert_eq!(whole.slice(s![0, .., 0, ..]), copy);
        let placed = assemble((2, 6, 2, 3), vec![(seg(1, 1, 6), 1, copy.clone())]);
        assert_eq!(placed.slice(s![1, 1..6, 1, ..]), copy);
        assert_eq!(placed.iter().filter(|&&v| v != 0.0).count(), 14);
    }

    /// The row passes' sums, kept per row group (one row, or a pair in
    /// the `Pairs` layout) and finished over the sweep, have the bits of
    /// each row's [`DotSum::finish`], in f64 and f32, for lanes of mixed
    /// magnitudes and signs (where the order of the adds shows in the
    /// result) and for `−0`, `+0` and non-empty tails.
    #[test]
    fn sweep_sums_finish_with_the_bits_of_each_dot_sum() {
        fn check<T: Scalar + std::fmt::Debug>(rng: &crate::rng::Stream) {
            const K: usize = 5;
            let mut reordered_differs = false;
            for case in 0..400u64 {
                let draw = |s: usize, i: usize, l: u64| {
                    let n = case * 4000 + (s * K + i) as u64 * 8 + l;
                    let (x, e) = (rng.normal(n), rng.uniform(n, 1));
                    T::c(x * 2f64.powi((e * 60.0) as i32 - 30))
                };
                let alone: [[DotSum<T>; 3]; K] = std::array::from_fn(|i| {
                    std::array::from_fn(|s| DotSum {
                        lanes: std::array::from_fn(|l| draw(s, i, l as u64)),
                        tail: match (case + i as u64) % 3 {
                            0 => -T::zero(),
                            1 => T::zero(),
                            _ => draw(s, i, 4),
                        },
                    })
                });
                let mut kept = SweepSums::<T, 3>::new(K);
                // Rows 0-1 and 2-3 as pairs, row 4 alone.
                for row in [0, 2] {
                    let mut pair = RowSums::<T, 8, 3>::new();
                    for (h, sums) in alone[row..row + 2].iter().enumerate() {
                        for (s, d) in sums.iter().enumerate() {
                            pair.lanes[s][4 * h..4 * h + 4].copy_from_slice(&d.lanes);
                            pair.tails[s][h] = d.tail;
                        }
                    }
                    pair.store(row, &mut kept);
                }
                let mut one = RowSums::<T, 4, 3>::new();
                for (s, d) in alone[4].iter().enumerate() {
                    one.lanes[s] = d.lanes;
                    one.tails[s][0] = d.tail;
                }
                one.store(4, &mut kept);
                kept.finish();
                for (i, sums) in alone.iter().enumerate() {
                    for (s, d) in sums.iter().enumerate() {
                        let want = d.finish();
                        assert_eq!(kept.done[s][i].f64().to_bits(), want.f64().to_bits());
                        let l = d.lanes;
                        reordered_differs |= ((l[0] + l[2]) + (l[1] + l[3]) + d.tail) != want;
                    }
                }
            }
            assert!(
                reordered_differs,
                "the draws never expose the order of the adds"
            );
        }
        let rng = crate::rng::Stream::new(3, "sweep sums");
        check::<f64>(&rng);
        check::<f32>(&rng);
    }

    /// The (segment, head) views of a run's tensors cover every element
    /// once and sit where the segment's rows and the head are, for batch
    /// rows and for packed sequences (an empty one among them); the state
    /// views likewise per (sequence, head).
    #[test]
    fn pair_views_partition_the_tensors() {
        let heads = 3;
        let layouts = [
            (2, 9, vec![seg(0, 0, 9), seg(1, 0, 9)]),
            (
                1,
                20,
                vec![seg_in(0, 0, 5), seg_in(1, 5, 5), seg_in(2, 5, 20)],
            ),
        ];
        for (b, t, segments) in layouts {
            let mut x = Array4::<f64>::from_elem((b, t, heads, 2), -1.0);
            for (i, mut v) in pair_blocks_mut(x.view_mut(), &segments)
                .into_iter()
                .enumerate()
            {
                assert_eq!(v.dim(), (segments[i / heads].len(), 2));
                v.fill(i as f64);
            }
            for ((bi, ti, h, _), &v) in x.indexed_iter() {
                let si = segments
                    .iter()
                    .position(|s| s.batch == bi && (s.start..s.end).contains(&ti))
                    .expect("every token is in a segment");
                assert_eq!(v, (si * heads + h) as f64, "[{bi}, {ti}, {h}]");
            }
            let n = segments.len();
            let mut states = Array4::<f64>::from_elem((n, heads, 2, 2), -1.0);
            for (i, mut v) in pair_states_mut(states.view_mut(), &segments)
                .into_iter()
                .enumerate()
            {
                v.fill(i as f64);
            }
            for ((si, h, _, _), &v) in states.indexed_iter() {
                assert_eq!(
                    v,
                    (segments.iter().position(|s| s.seq == si).unwrap() * heads + h) as f64
                );
            }
        }
    }

    /// A sequence of a packed batch (batch row 0).
    fn seg_in(seq: usize, start: usize, end: usize) -> Segment {
        Segment {
            seq,
            batch: 0,
            start,
            end,
        }
    }

    /// One head's rows, borrowed: the head's values, strided by the other
    /// heads.
    #[test]
    fn head_view_is_the_heads_rows() {
        let three = Array4::from_shape_fn((2, 7, 3, 3), |(b, t, h, d)| {
            (1000 * b + 100 * t + 10 * h + d) as f64
        });
        let rows = head_view(three.view(), &seg(1, 2, 6), 2);
        assert_eq!(rows, gather(&three, &seg(1, 2, 6), 2));
        assert_eq!(rows.strides(), &[9, 1]);
    }

    /// A tensor long enough to be scanned in parallel parts names the
    /// first bad value, not whichever part finished first.
    #[test]
    fn check_finite_names_the_first_bad_index_of_a_long_tensor() {
        let mut x = ArrayD::<f64>::zeros(ndarray::IxDyn(&[3 * PAR_FILL / 4 + 2, 4]));
        // The scan splits into parts of PAR_FILL values; both bad values lie
        // past the first part.
        assert!(check_finite("x", &x).is_ok());
        let flat = x.as_slice_mut().expect("standard layout");
        flat[2 * PAR_FILL + 7] = f64::INFINITY;
        flat[PAR_FILL + 3] = f64::NAN;
        match check_finite("x", &x) {
            Err(Error::NonFinite { tensor, index, .. }) => {
                assert_eq!(tensor, "x");
                let at = PAR_FILL + 3;
                assert_eq!(index, vec![at / 4, at % 4]);
            }
            other => panic!("expected NonFinite, got {other:?}"),
        }
    }
}
