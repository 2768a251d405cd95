//! The drivers' and engines' views of FLA's `[B, T, heads, D]` tensors:
//! each (sequence, head) pair's rows as disjoint mutable views, so that
//! every pair writes its results in place; copies a row at a time where
//! `ndarray`'s element-wise strided copy is slow; large zero tensors filled
//! by every thread.

use ndarray::{
    Array, ArrayBase, ArrayView, ArrayView2, ArrayViewMut, ArrayViewMut2, ArrayViewMut4, Axis,
    CowArray, Data, DataMut, Dimension, Ix2, RemoveAxis,
};
use rayon::prelude::*;

use super::par::PAR_FILL;
use crate::scalar::Scalar;
use crate::varlen::Segment;

/// A zero tensor of `shape`, written by every rayon thread at once when it
/// is large: a run's result tensors are tens of MiB, and the allocator
/// hands back memory that is either to be cleared or still to be faulted
/// in, which one thread would do alone before any pair starts.
pub(crate) fn zeros<T: Scalar, D: Dimension>(shape: D) -> Array<T, D> {
    let n = shape.size();
    if n < PAR_FILL {
        return Array::zeros(shape);
    }
    let mut v = Vec::with_capacity(n);
    v.par_extend(rayon::iter::repeat_n(T::zero(), n).with_min_len(1 << 16));
    Array::from_shape_vec(shape, v).expect("n elements")
}

/// `a` in standard layout: borrowed where it already is, else a copy.
pub(crate) fn standard<T: Clone + num_traits::Zero, D: Dimension>(
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
    let mut out = crate::fast::stagger::vec(a.len());
    for row in a.lanes(last) {
        out.extend_from_slice(row.to_slice().expect("contiguous rows"));
    }
    CowArray::from(crate::fast::stagger::array(out, a.raw_dim()))
}

/// `a · scale` in standard layout (`a` itself, borrowed or copied by
/// [`standard`], when `scale` is 1): a head's queries with the attention
/// scale folded in. The rows of a head of `[B, T, heads, D]` are scaled a
/// row at a time, in one pass.
pub(crate) fn scaled_standard<T: Scalar>(a: ArrayView2<'_, T>, scale: T) -> CowArray<'_, T, Ix2> {
    if scale == T::one() {
        return standard(a);
    }
    if a.is_standard_layout() || a.stride_of(Axis(1)) != 1 {
        return a.mapv(|e| e * scale).into();
    }
    let mut out = crate::fast::stagger::vec(a.len());
    for row in a.rows() {
        out.extend(
            row.to_slice()
                .expect("contiguous rows")
                .iter()
                .map(|&e| e * scale),
        );
    }
    crate::fast::stagger::array(out, a.raw_dim()).into()
}

/// `dst = src` (same shape), a row at a time where both have contiguous
/// rows (a pair's rows of a run's tensors), else element by element.
pub(crate) fn copy_into<T: Copy, D: Dimension>(
    mut dst: ArrayViewMut<'_, T, D>,
    src: ArrayView<'_, T, D>,
) {
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

/// Each segment's rows `seg.start..seg.end` of batch row `seg.batch` of a
/// `[B, T, …]` view, as disjoint mutable views `[L, …]`, in the order of
/// `segments`. Segments of one batch row must not overlap (those of
/// validated inputs never do).
pub(crate) fn segments_mut<'a, T, D: RemoveAxis>(
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
pub(crate) fn split_axis<'a, T, D: RemoveAxis>(
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
pub(crate) fn pair_blocks_mut<'a, T, D>(
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
pub(crate) fn pair_states_mut<'a, T>(
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

/// `a` where its rows are contiguous (a head's rows of a `[B, T, heads, D]`
/// tensor, strided by the other heads), else a row-major copy: what
/// [`row`] reads.
pub(crate) fn contiguous_rows<T: Clone>(a: ArrayView2<'_, T>) -> CowArray<'_, T, Ix2> {
    if a.ncols() <= 1 || a.strides()[1] == 1 {
        CowArray::from(a)
    } else {
        CowArray::from(a.as_standard_layout().into_owned())
    }
}

/// Row `t` of a `[rows, cols]` array whose rows are contiguous (row-major,
/// or rows of a larger row-major tensor).
#[inline(always)]
pub(crate) fn row<T, S: Data<Elem = T>>(a: &ArrayBase<S, Ix2>, t: usize) -> &[T] {
    a.row(t).to_slice().expect("contiguous rows")
}

/// Row `t` of an array with contiguous rows, mutable.
#[inline(always)]
pub(crate) fn row_mut<T, S: DataMut<Elem = T>>(a: &mut ArrayBase<S, Ix2>, t: usize) -> &mut [T] {
    a.row_mut(t).into_slice().expect("contiguous rows")
}

#[cfg(test)]
mod tests {
    use ndarray::{s, Array4};

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

    /// Rows of a head strided by the other heads are read in place; rows
    /// that are not contiguous are copied to row-major.
    #[test]
    fn contiguous_rows_borrow_only_contiguous_rows() {
        let a = ndarray::Array2::from_shape_fn((4, 6), |(i, j)| (10 * i + j) as f64);
        let strided = a.slice(ndarray::s![.., ..3]);
        let kept = contiguous_rows(strided);
        assert!(kept.is_view());
        assert_eq!(row(&kept, 2), &[20.0, 21.0, 22.0]);
        let columns = a.t();
        let copied = contiguous_rows(columns);
        assert!(!copied.is_view());
        assert_eq!(row(&copied, 1), &[1.0, 11.0, 21.0, 31.0]);
        crate::fast::sweep::prefetch(row(&copied, 1));
    }
}
